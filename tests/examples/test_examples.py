"""The examples in examples/: their pieces on their own, each app through `flwr run`, and the
claim of examples/README.md that Flower's strategy wrappers cannot wrap FedCyBGD."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

from fedcybgd.config import RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.strategies import (
    FedCyBGD,
    aggregator_names,
    schedule_names,
    unregister_aggregator,
    unregister_schedule,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LAYERS = ["layer.0", "layer.1", "layer.2", "layer.3"]


@pytest.fixture
def own_serverapp(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """examples/own_serverapp/my_server.py, imported as Flower would; its names removed after."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "own_serverapp"))
    import my_server

    yield my_server
    sys.modules.pop("my_server", None)
    if "largest-updates" in schedule_names():
        unregister_schedule("largest-updates")
    if "drop-farthest" in aggregator_names():
        unregister_aggregator("drop-farthest")


# ------------------------------------------------------------------ the examples' pieces


def test_largest_updates_trains_blocks_that_moved_most_more_often(own_serverapp):
    # Prepare: every block trained once, layer.1 moved ten times as far as the others
    schedule = own_serverapp.LargestUpdatesFirst(blocks=LAYERS)
    first = [schedule.take(1) for _ in LAYERS]
    for block, size in zip(LAYERS, (1.0, 10.0, 1.0, 1.0), strict=True):
        schedule.observe(block, size)
    # Execute
    taken = [schedule.take(1)[0] for _ in range(30)]
    # Assert: untrained blocks first in model order; then layer.1 most, yet none starves
    assert first == [[b] for b in LAYERS]
    assert taken.count("layer.1") > max(taken.count(b) for b in LAYERS if b != "layer.1")
    assert set(taken) == set(LAYERS)


def test_largest_updates_requeues_and_restores_its_state(own_serverapp):
    # Prepare
    schedule = own_serverapp.LargestUpdatesFirst(blocks=LAYERS)
    schedule.take(2)
    schedule.observe("layer.0", 0.5)
    schedule.requeue("layer.1")
    restored = own_serverapp.LargestUpdatesFirst(blocks=LAYERS)
    restored.load_state(json.loads(json.dumps(schedule.state())))
    # Execute / Assert: the failed block first, then the same choices from either copy
    assert schedule.take(2)[0] == "layer.1"
    assert restored.take(2)[0] == "layer.1"
    assert [schedule.take(2) for _ in range(4)] == [restored.take(2) for _ in range(4)]


def test_drop_farthest_leaves_the_outlier_out_of_the_mean(own_serverapp):
    # Prepare: two close uploads and one far off; then only two
    merge = own_serverapp.drop_farthest(trim_fraction=0.2)
    close = [(1.0, {"w": torch.tensor([1.0, 1.0])}), (3.0, {"w": torch.tensor([2.0, 2.0])})]
    far = (1.0, {"w": torch.tensor([50.0, -50.0])})
    # Execute
    three = merge([close[0], far, close[1]])
    two = merge([close[0], far])
    # Assert: the far one dropped from three, the example-weighted mean of the rest; two kept
    assert torch.allclose(three["w"], torch.tensor([1.75, 1.75]))
    assert torch.allclose(two["w"], torch.tensor([25.5, -24.5]))
    assert merge.dropped == [1, None]


# ------------------------------------------------------------------------- flwr run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def documented_command(example: str) -> str:
    """The command examples/README.md gives for ``example`` (one line: ``cd examples/...``)."""
    text = (EXAMPLES / "README.md").read_text()
    found = re.findall(rf"^cd examples/{example} && .+$", text, flags=re.MULTILINE)
    assert len(found) == 1, f"examples/README.md gives {len(found)} commands for {example}"
    return found[0]


def run_as_documented(example: str, tmp_path: Path, extra: str = "") -> Path:
    """Run ``example``'s documented command from the project folder, as a user types it;
    returns the folder its relative ``output-dir`` lands in.

    Only the surroundings are private: a fresh Flower home and ports (the managed SuperLink is
    ours alone, and stopped after), outputs under ``tmp_path``, and when this suite's Python
    is not the project's ``.venv``, the documented ``../../.venv/bin/`` points at its own.
    ``extra``: more ``--run-config`` for the run.
    """
    from fedcybgd.cli.demo import stop_local_superlink

    command = documented_command(example)
    bin_dir = Path(sys.executable).parent
    if bin_dir.resolve() != (ROOT / ".venv" / "bin").resolve():
        command = command.replace("../../.venv/bin/", f"{bin_dir}/")
    if extra:
        command += f" --run-config {shlex.quote(extra)}"
    flwr_home = tmp_path / "flwr-home"
    env = dict(os.environ, FLWR_HOME=str(flwr_home), FEDCYBGD_OUTPUT_ROOT=str(tmp_path),
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
               FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()))
    try:
        done = subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=900, check=False)
    finally:
        stop_local_superlink(flwr_home)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "finished:completed" in log
    return tmp_path / "outputs"


@pytest.mark.slow
def test_own_serverapp_example_runs_as_documented(tmp_path):
    # Execute: the example as it ships, with the command its README gives
    out = run_as_documented("own_serverapp", tmp_path) / "own-serverapp"
    # Assert: its own schedule chose (untrained blocks first, then by observed step size) and
    # its own aggregator merged three uploads per block, dropping one each time
    history = json.loads((out / "history.json").read_text())
    rounds = history["rounds"]
    assert len(rounds) == 4
    assert [r["blocks"] for r in rounds[:2]] == [["layer.0-1"], ["layer.2-3"]]
    assert all(len(r["accepted"][r["blocks"][0]]) == 3 for r in rounds)
    assert len(history["dropped"]) == 4 and None not in history["dropped"]
    sizes = history["schedule"]["size"]
    assert set(sizes) == {"layer.0-1", "layer.2-3"} and min(sizes.values()) > 0


@pytest.mark.slow
def test_signsgd_example_runs_as_documented(tmp_path):
    # Execute: fedcybgd's own apps, the rule loaded from the example's folder by run config
    out = run_as_documented("signsgd_rule", tmp_path, "signsgd-momentum=0.5") / "signsgd"
    # Assert: every upload trained by the plug-in rule, with its option
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert summary["rounds"] == 2 and summary["run_config"]["signsgd-momentum"] == 0.5
    assert [r["update_rule"] for r in rows] == [["signsgd"], ["signsgd"]]
    assert all(r["bytes_up"] > 0 for r in rows)


@pytest.mark.slow
def test_pair_task_example_runs_as_documented(tmp_path):
    # Execute: fedcybgd's own apps, the task loaded from the example's folder by run config
    out = run_as_documented("pair_task", tmp_path) / "pair-task"
    # Assert: the plug-in task ran: both rounds trained on the pairs and were evaluated
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["run_config"]["task"] == "sentence-pair"
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r["bytes_up"] > 0 for r in rows[1:])
    assert summary["final_eval_loss"] != summary["initial_eval_loss"]


def test_pair_task_reads_both_sentences_and_names_a_bad_row(monkeypatch):
    # Prepare: the example's module, importable as plugin-modules imports it
    import pandas as pd

    from fedcybgd.config import RunConfig
    from fedcybgd.tasks import build_task

    monkeypatch.syspath_prepend(str(EXAMPLES / "pair_task"))
    run = RunConfig.from_run_config({
        "plugin-modules": "pair_task", "task": "sentence-pair", "label-words": "no,yes",
        "dataset": str(EXAMPLES / "pair_task" / "pairs.jsonl")})
    task = build_task(run)
    frame = pd.DataFrame({"premise": ["A is red.", "B is blue."],
                          "hypothesis": ["A is red.", "B is red."], "label": ["yes", "no"]})
    # Execute
    checked = task.check(frame)
    # Assert: one text holding both sentences, labels by word; a missing sentence is named
    assert checked["text"].tolist()[0] == "Premise: A is red.\nHypothesis: A is red."
    assert checked["label"].tolist() == [1, 0]
    assert len(task.split("train")) > 0 and set(task.split("train")["label"]) == {0, 1}
    with pytest.raises(ValueError, match="field 'hypothesis' is empty"):
        task.check(frame.assign(hypothesis=["A is red.", ""]))


# ------------------------------------------------------------ Flower's strategy wrappers


def _wrapped_round(tmp_path: Path, wrapper: type, noise: float) -> tuple[Any, FedCyBGD, Any]:
    """One round of FedCyBGD under ``wrapper`` on a loopback grid of two nodes."""
    from fedcybgd.client.app import app as client_app
    from fedcybgd.harness.loopback import LoopbackGrid

    config = {"model": "tiny-llama", "partitioner": "iid", "layers-per-block": 1,
              "local-steps": 2, "batch-size": 4, "max-seq-len": 48, "lr": 1e-3,
              "clients-per-round": 2, "output-dir": str(tmp_path / "out")}
    grid = LoopbackGrid(client_app, 2, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    model = load_model("tiny-llama")
    weights = dict(model.named_parameters())
    strategy = FedCyBGD(block_map=BlockMap(model, 1), weights=weights, cycle=LAYERS,
                        base_hash=content_checksum(weights), config=RunConfig.from_run_config(
                            {"clients-per-round": 2, "clients-per-block": 1, "local-steps": 2,
                             "batch-size": 4, "node-wait": 0.0}))
    dp = wrapper(strategy, noise_multiplier=noise, clipping_norm=1.0, num_sampled_clients=2)
    initial = ArrayRecord({n: p.detach().clone() for n, p in weights.items()})
    replies = grid.send_and_receive(list(dp.configure_train(1, initial, ConfigRecord(), grid)))
    return dp, strategy, (grid, replies)


def test_server_side_dp_clipping_cannot_read_fedcybgd_uploads(tmp_path):
    # Prepare
    dp, _, (_, replies) = _wrapped_round(tmp_path, DifferentialPrivacyServerSideFixedClipping,
                                         0.0)
    # Execute / Assert: the wrapper converts the encoded uploads to numpy and fails
    with pytest.raises(TypeError, match=r"fedcybgd\.payload"):
        dp.aggregate_train(1, replies)


def test_client_side_dp_noise_leaves_fedcybgd_on_inconsistent_blocks(tmp_path):
    # Prepare
    dp, strategy, (grid, replies) = _wrapped_round(
        tmp_path, DifferentialPrivacyClientSideFixedClipping, 0.5)
    arrays, _ = dp.aggregate_train(1, replies)
    trained = set(strategy.history[-1].accepted)
    # Execute: the noised model goes back in, as Strategy.start passes it on
    strategy.configure_train(2, arrays, ConfigRecord(), grid)
    # Assert: every trained block now differs from the version the nodes hold (its checksum)
    stale = {b for b in trained
             if content_checksum(strategy.block_tensors(b)) != strategy.checksums[b]}
    assert len(trained) == 2 and stale == trained
