"""The FedAvg baselines under Flower's own FedAvg, and the process Grid the experiments use."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, Context, Message, MessageType, MetricRecord
from flwr.clientapp import ClientApp
from safetensors.torch import load_file

from fedcybgd.client import baselines
from fedcybgd.client.app import app as client_app
from fedcybgd.client.app import node_key as client_node_key
from fedcybgd.client.app import train as client_train
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.harness.procgrid import ProcessGrid
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import run_server
from fedcybgd.server.baselines import run_fedavg
from fedcybgd.server.verdict import RunFailed


@pytest.fixture
def fedavg_config(tiny_run_config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    return dict(tiny_run_config, **{
        "strategy": "fedavg", "fedavg-params": "full", "lr": 1e-3, "eval-every": 1,
        "output-dir": str(tmp_path / "out"),
    })


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_fedavg_full_trains_and_exchanges_the_whole_model(fedavg_config, tmp_path):
    # Prepare
    grid = LoopbackGrid(client_app, 4, fedavg_config)
    model = load_model("tiny-llama")
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    headers = 2 * 256 * len(list(model.parameters()))  # Flower's .npy headers, 2 clients
    # Execute
    summary = run_fedavg(grid, RunConfig.from_run_config(fedavg_config))
    # Assert: every round moves the whole model down to and up from each of 2 clients
    rounds = records(tmp_path / "out")
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(2 * model_bytes < r["bytes_up"] < 2 * model_bytes + headers for r in rounds[1:])
    assert all(r["bytes_down"] == r["bytes_up"] for r in rounds[1:])
    assert summary["exchanged_params"] == sum(p.numel() for p in model.parameters())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    saved = load_model(str(tmp_path / "out" / "final"))
    assert any(not torch.equal(a, b) for a, b in
               zip(saved.parameters(), model.parameters(), strict=True))


def test_fedavg_lora_exchanges_only_the_adapters(fedavg_config, tmp_path):
    # Prepare: rank-4 adapters on q and v of the 4 layers
    config = dict(fedavg_config, **{"fedavg-params": "lora", "lora-rank": 4,
                                    "lora-target-modules": "q_proj,v_proj"})
    grid = LoopbackGrid(client_app, 4, config)
    # Execute
    summary = run_fedavg(grid, RunConfig.from_run_config(config))
    # Assert: 4 layers x 2 modules x (A, B); a small fraction of the model travels
    exchanged = baselines.build_lora(RunConfig.from_run_config(config)).get()
    assert len(exchanged) == 16
    assert all(".lora_A." in k or ".lora_B." in k for k in exchanged)
    assert summary["exchanged_params"] == sum(t.numel() for t in exchanged.values())
    assert summary["exchanged_params"] < 0.02 * sum(
        p.numel() for p in load_model("tiny-llama").parameters())
    # 2 clients x 2 rounds of fp32 adapters, plus .npy headers
    assert summary["bytes_up"] < 4 * (4 * summary["exchanged_params"] + 16 * 256)
    adapter = load_file(tmp_path / "out" / "final" / "adapter" / "adapter_model.safetensors")
    # B starts at zero: non-zero B means adapters were trained, averaged and saved
    assert max(float(t.abs().max()) for k, t in adapter.items() if "lora_B" in k) > 0
    assert summary["final_eval_loss"] != summary["initial_eval_loss"]


def test_fedavg_lora_final_is_the_merged_model_and_keeps_its_adapter(fedavg_config, tmp_path):
    # Prepare
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = dict(fedavg_config, **{"fedavg-params": "lora", "lora-rank": 4,
                                    "lora-target-modules": "q_proj,v_proj"})
    grid = LoopbackGrid(client_app, 4, config)
    final = tmp_path / "out" / "final"
    ids = torch.tensor([[1, 17, 230, 4051, 99, 7, 512, 3]])
    # Execute
    run_fedavg(grid, RunConfig.from_run_config(config))
    # Assert: final/ loads with plain transformers as the base with the adapter merged in
    adapter_config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny-llama"
    assert not (final / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    base = load_model("tiny-llama")
    with torch.no_grad():
        base_logits = base(ids).logits
        merged = PeftModel.from_pretrained(base, final / "adapter").merge_and_unload().eval()
        merged_logits = merged(ids).logits
        got = loaded(ids).logits
    assert not any(".lora_" in name for name, _ in loaded.named_parameters())
    assert torch.allclose(got, merged_logits, atol=1e-6, rtol=0)
    assert (got - base_logits).abs().max() > 1e-4  # the adapters changed the model


def corrupting_app(corrupt: Any) -> ClientApp:
    """Our ClientApp, with ``corrupt(reply, partition_id)`` applied to every train reply."""
    app = ClientApp()
    app.query("node_key")(client_node_key)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = client_train(msg, context)
        corrupt(reply, int(context.node_config["partition-id"]))
        return reply

    return app


def test_fedavg_drops_bad_uploads_and_averages_the_rest(fedavg_config, tmp_path, caplog):
    # Prepare: of 6 clients, 4 send something wrong; 2 are fine
    def corrupt(reply: Message, pid: int) -> None:
        arrays = reply.content.array_records[baselines.ARRAYS]
        metrics = reply.content.metric_records[baselines.METRICS]
        first = next(iter(arrays))
        if pid == 0:
            arrays[first] = Array(np.full(arrays[first].shape, np.nan, dtype=np.float32))
        elif pid == 1:
            arrays[first] = Array(np.zeros((3,), dtype=np.float32))
        elif pid == 2:
            metrics["num-examples"] = float("nan")
        elif pid == 3:
            arrays[first] = Array(np.zeros(arrays[first].shape, dtype=np.float16))

    config = dict(fedavg_config, **{"clients-per-round": 6, "num-server-rounds": 1})
    grid = LoopbackGrid(corrupting_app(corrupt), 6, config)
    start = load_model("tiny-llama")
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        summary = run_fedavg(grid, RunConfig.from_run_config(config))
    # Assert: each bad upload named and dropped; the 2 good ones averaged into a finite model
    for reason in ("holds NaN or Inf", "has shape (3,)", "num-examples = nan", "dtype"):
        assert reason in caplog.text
    record = records(tmp_path / "out")[1]
    assert record["dropped_uploads"] == 4 and len(record["clients"]) == 2
    saved = load_model(str(tmp_path / "out" / "final"))
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    assert any(not torch.equal(a, b) for a, b in
               zip(saved.parameters(), start.parameters(), strict=True))
    assert np.isfinite(summary["final_eval_loss"])


def test_fedavg_survives_a_round_of_only_bad_uploads(fedavg_config, tmp_path):
    # Prepare: every reply of round 1 carries a second, unexpected metric record
    corrupted: list[int] = []

    def corrupt(reply: Message, pid: int) -> None:
        if len(corrupted) < 2:  # round 1's two replies
            corrupted.append(pid)
            reply.content.metric_records["extra"] = MetricRecord({"x": 1.0})

    config = dict(fedavg_config, **{"num-server-rounds": 2})
    grid = LoopbackGrid(corrupting_app(corrupt), 4, config)
    # Execute
    summary = run_fedavg(grid, RunConfig.from_run_config(config))
    # Assert: round 1 left the global model as it was; round 2 trained; the run completed
    rows = records(tmp_path / "out")
    assert rows[1]["dropped_uploads"] == 2 and rows[1]["eval_loss"] == rows[0]["eval_loss"]
    assert rows[2]["dropped_uploads"] == 0 and rows[2]["eval_loss"] != rows[0]["eval_loss"]
    assert summary["status"] == "completed"


def test_fedavg_in_which_every_upload_is_bad_fails(fedavg_config, tmp_path):
    # Prepare: every reply carries a second, unexpected metric record
    def corrupt(reply: Message, pid: int) -> None:
        reply.content.metric_records["extra"] = MetricRecord({"x": 1.0})

    config = dict(fedavg_config, **{"num-server-rounds": 1})
    grid = LoopbackGrid(corrupting_app(corrupt), 4, config)
    # Execute
    with pytest.raises(RunFailed, match="no update was averaged in 1 round"):
        run_fedavg(grid, RunConfig.from_run_config(config))
    # Assert: the server finished the run and wrote why; no final model
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and "malformed 2" in summary["reason"]
    assert not (tmp_path / "out" / "final").exists()


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_fedavg_clients_train_at_the_rate_the_server_schedules(fedavg_config, tmp_path,
                                                                schedule):
    # Prepare: 3 rounds, the rate decayed by cosine to 0.1 x lr at the last (or constant)
    config = dict(fedavg_config, **{"num-server-rounds": 3, "lr-schedule": schedule,
                                    "eval-every": 3})
    grid = LoopbackGrid(client_app, 4, config)  # keeps the messages it carried
    # Execute
    run_fedavg(grid, RunConfig.from_run_config(config))
    # Assert: every node of a round got that round's rate in its instruction
    rates: dict[int, list[float]] = {}
    for m in grid.sent:
        if m.metadata.message_type != MessageType.TRAIN:
            continue  # the node-key queries
        cfg = m.content.config_records["config"]
        rates.setdefault(int(cfg["server-round"]), []).append(float(cfg["lr"]))
    expected = [1e-3, 1e-3, 1e-3] if schedule == "constant" else [1e-3, 0.55e-3, 1e-4]
    assert sorted(rates) == [1, 2, 3]
    assert [rates[r] for r in (1, 2, 3)] == [pytest.approx([e, e]) for e in expected]


def test_fedavg_client_trains_at_the_instructions_rate_not_its_run_configs(fedavg_config):
    # Prepare: one round's message asking lr 1e-2 of a node whose run config says 1e-3, and
    # the same round at the run config's rate
    from flwr.app import ConfigRecord, RecordDict

    from fedcybgd.baselines import ARRAYS, build_baseline, to_record

    arrays = to_record(build_baseline(RunConfig.from_run_config(fedavg_config)).get())

    def trained(config: dict[str, Any]) -> dict[str, np.ndarray]:
        grid = LoopbackGrid(client_app, 1, fedavg_config)
        message = Message(RecordDict({ARRAYS: arrays, "config": ConfigRecord(config)}),
                          dst_node_id=grid.node_ids[0], message_type=MessageType.TRAIN,
                          group_id="1")
        (reply,) = grid.send_and_receive([message])
        assert not reply.has_error()
        return {k: v.numpy() for k, v in reply.content.array_records[ARRAYS].items()}

    # Execute
    scheduled = trained({"server-round": 1, "lr": 1e-2})
    again = trained({"server-round": 1, "lr": 1e-2})
    own = trained({"server-round": 1})
    stated = trained({"server-round": 1, "lr": 1e-3})
    # Assert: the instruction's rate is the one trained at (deterministic per round)
    assert all(np.array_equal(scheduled[k], again[k]) for k in scheduled)
    assert any(not np.array_equal(scheduled[k], own[k]) for k in scheduled)
    assert all(np.array_equal(own[k], stated[k]) for k in own)


def test_client_rejects_arrays_that_do_not_match_its_model(fedavg_config):
    # Prepare
    bm = baselines.build_full("tiny-llama")
    tensors = bm.get()
    name = next(iter(tensors))
    # Execute / Assert
    with pytest.raises(ValueError, match="missing"):
        bm.set({k: v for k, v in tensors.items() if k != name})
    with pytest.raises(ValueError, match="shape"):
        bm.set({**tensors, name: torch.zeros(2)})
    with pytest.raises(ValueError, match="dtype"):
        bm.set({**tensors, name: tensors[name].double()})


@pytest.mark.parametrize("key,value,fragment", [
    ("strategy", "fedprox", "strategy"),
    ("fedavg-params", "adapters", "fedavg-params"),
    ("lora-rank", 0, "lora-rank"),
    ("lora-target-modules", " , ", "lora-target-modules"),
])
def test_bad_baseline_config_names_the_key(fedavg_config, key, value, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RunConfig.from_run_config(dict(fedavg_config, **{key: value}))


@pytest.mark.slow
def test_process_grid_gives_the_same_run_as_loopback(tiny_run_config, tmp_path):
    # Prepare: the same FedCyBGD run, clients in this process vs in a child process
    def config(name: str) -> dict[str, Any]:
        return dict(tiny_run_config, **{"output-dir": str(tmp_path / name)})

    loop = LoopbackGrid(client_app, 4, config("loop"),
                        node_config=lambda i: {"cache-dir": str(tmp_path / "loop-cache")})
    # Execute
    in_process = run_server(loop, RunConfig.from_run_config(config("loop")))
    with ProcessGrid("fedcybgd.client.app:app", 4, config("proc"),
                     threads=torch.get_num_threads(),  # same arithmetic as this process
                     node_config=lambda i: {"cache-dir": str(tmp_path / "proc-cache")}) as grid:
        child = run_server(grid, RunConfig.from_run_config(config("proc")))
        exchanges = list(grid.exchanges)
    # Assert: protobuf bytes through a pipe change nothing; each exchange was measured
    assert child["final_eval_loss"] == in_process["final_eval_loss"]
    assert child["block_versions"] == in_process["block_versions"]
    assert len(exchanges) == 4 + 4  # 2 rounds x 2 nodes, and one node-key query per node
    assert all(e.bytes_down > 0 and e.bytes_up > 0 and e.peak_rss_mb > 100 for e in exchanges)
    assert all(e.max_rss_mb >= e.peak_rss_mb * 0.99 for e in exchanges)
    assert sum(e.bytes_up for e in exchanges) > child["bytes_up"]  # payloads + the envelope


def test_process_grid_turns_a_client_crash_into_an_error_reply(tiny_run_config, tmp_path):
    # Prepare: a cache folder that is a file makes the ClientApp raise
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    config = dict(tiny_run_config, **{"num-server-rounds": 1,
                                      "output-dir": str(tmp_path / "out")})
    # Execute: a run in which nothing could train ends failed, after its round was closed
    with ProcessGrid("fedcybgd.client.app:app", 2, config, threads=1,
                     node_config=lambda i: {"cache-dir": str(bad)}) as grid, \
            pytest.raises(RunFailed, match="no block was installed"):
        run_server(grid, RunConfig.from_run_config(config))
    # Assert: the server read the crashes as error replies and re-queued the blocks
    row = records(tmp_path / "out")[1]
    assert row["failed_blocks"] == ["layer.0", "layer.1"]
    assert row["dropped"] == {"client-error": 2}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert all(v == 0 for v in summary["block_versions"].values())
