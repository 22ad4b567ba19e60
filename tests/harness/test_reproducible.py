"""Same seed, same numbers: node ids change between runs, metrics do not.

Flower picks node ids (in simulation: random ones per run). The strategies sample nodes in the
order of their stable keys (node config ``node-key``, else ``partition-id``), learnt with one
node-key query per node, and derive node seeds from the keys. Each test runs the same config
twice with different node ids and compares every field of ``metrics.jsonl`` but wall-clock
times and sampled memory; node ids in the records are compared through the keys they stand for.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from fedcybgd import protocol
from fedcybgd.cli import demo
from fedcybgd.client.app import app as client_app
from fedcybgd.client.app import train as client_train
from fedcybgd.config import ConfigError, NodeConfig, RunConfig
from fedcybgd.harness import loopback, procgrid
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.harness.procgrid import ProcessGrid
from fedcybgd.server.app import run_server
from fedcybgd.server.baselines import run_fedavg
from fedcybgd.server.checkpoint import Checkpointer
from fedcybgd.strategies.node_keys import NodeKeys, key_order
from fedcybgd.strategies.sampling import NodeSampler

# Measured, not computed: wall-clock times and the sampled resident memory of client processes.
MEASURED = {"round_s", "eval_s", "client_train_s", "wall_s", "client_peak_mem_mb"}


def shuffled_ids(salt: str) -> Callable[..., dict[int, dict[str, Any]]]:
    """A stand-in for :func:`fedcybgd.harness.loopback.node_configs` giving partition ``i`` a random
    node id (seeded by ``salt``), listed in random order, as Flower's runtimes do."""

    def node_configs(num_nodes: int, node_config: Callable[[int], dict[str, Any]] | None,
                     first_node_id: int) -> dict[int, dict[str, Any]]:
        rng = random.Random(salt)
        ids = rng.sample(range(10**6, 10**12), num_nodes)
        configs = {}
        for i in rng.sample(range(num_nodes), num_nodes):
            config: dict[str, Any] = {"partition-id": i, "num-partitions": num_nodes}
            if node_config is not None:
                config.update(node_config(i))
            configs[ids[i]] = config
        return configs

    return node_configs


def id_order_differs(salts: tuple[str, str], nodes: int) -> bool:
    """Do the two salts order the partitions differently by node id (as sampling by sorted
    id did)? Then a run that sampled by node id would not repeat."""
    orders = []
    for salt in salts:
        configs = shuffled_ids(salt)(nodes, None, 0)
        orders.append([configs[n]["partition-id"] for n in sorted(configs)])
    return orders[0] != orders[1]


def read_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def comparable(records: list[dict[str, Any]], key_of: dict[str, str]) -> list[dict[str, Any]]:
    """The records without measured fields, node ids replaced by the nodes' keys."""
    out = []
    for record in records:
        row = {k: v for k, v in record.items() if k not in MEASURED}
        if "clients" in row:
            row["clients"] = [key_of[str(n)] for n in row["clients"]]
        if "accepted" in row:
            row["accepted"] = {b: [key_of[str(n)] for n in nodes]
                               for b, nodes in row["accepted"].items()}
        out.append(row)
    return out


def assert_same_run(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):  # wire bytes too: ids count at their widest
        assert a == b, f"round {a.get('round')} differs"
    # not vacuous: the runs trained, evaluated and moved the loss
    trained = [r for r in first if r["round"] > 0]
    assert trained and all(r["clients"] and r["bytes_up"] > 0 for r in trained)
    assert all(isinstance(r["train_loss"], float) for r in trained)
    assert first[0]["eval_loss"] != first[-1]["eval_loss"]


def grid_keys(grid: LoopbackGrid) -> dict[str, str]:
    """Node id (as text) -> key, from the loopback grid's node configs."""
    return {str(node): NodeConfig.from_node_config(ctx.node_config).key
            for node, ctx in grid.contexts.items()}


def checkpoint_keys(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The final checkpoint's node id -> key map and block checksums."""
    state, _ = Checkpointer(out / "checkpoint").load()
    return state["strategy"]["node_keys"], state["strategy"]["checksums"]


@pytest.fixture
def repro_config(tiny_run_config: dict[str, Any]) -> dict[str, Any]:
    # 3 rounds of 2 clients out of 5 nodes, Dirichlet partitions: who trains matters
    return dict(tiny_run_config, **{"num-server-rounds": 3, "partitioner": "dirichlet",
                                    "dirichlet-alpha": 0.5, "seed": 7})


SALTS = ("first run", "second run")


# ----------------------------------------------------------------------- loopback Grid
def loopback_run(config: dict[str, Any], tmp_path: Path, name: str, salt: str,
                 monkeypatch: pytest.MonkeyPatch, fedavg: bool = False) -> tuple[Any, Path]:
    monkeypatch.setattr(loopback, "node_configs", shuffled_ids(salt))
    out = tmp_path / name
    # eval-cache off: the second run must compute round 0, not read the first run's figures
    config = dict(config, **{"output-dir": str(out), "eval-cache": False})
    grid = LoopbackGrid(client_app, 5, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"{name}-cache")})
    run = RunConfig.from_run_config(config)
    run_fedavg(grid, run) if fedavg else run_server(grid, run)
    return grid, out


def test_loopback_same_seed_same_metrics_whatever_the_node_ids(repro_config, tmp_path,
                                                               monkeypatch):
    assert id_order_differs(SALTS, 5)
    # Execute: the same config twice, node ids drawn differently
    runs = [loopback_run(repro_config, tmp_path, f"run{i}", salt, monkeypatch)
            for i, salt in enumerate(SALTS)]
    # Assert: every metric equal, the same partitions sampled, the same final blocks
    (grid_a, out_a), (grid_b, out_b) = runs
    assert set(grid_a.node_ids).isdisjoint(grid_b.node_ids)
    assert_same_run(comparable(read_records(out_a), grid_keys(grid_a)),
                    comparable(read_records(out_b), grid_keys(grid_b)))
    keys_a, sums_a = checkpoint_keys(out_a)
    keys_b, sums_b = checkpoint_keys(out_b)
    assert keys_a == grid_keys(grid_a) and keys_b == grid_keys(grid_b)
    assert sums_a == sums_b


def test_loopback_fedavg_same_seed_same_metrics(tiny_run_config, tmp_path, monkeypatch):
    assert id_order_differs(SALTS, 5)
    config = dict(tiny_run_config, **{"strategy": "fedavg", "fedavg-params": "lora",
                                      "partitioner": "dirichlet", "seed": 3,
                                      "num-server-rounds": 3, "lr": 1e-2})
    runs = [loopback_run(config, tmp_path, f"run{i}", salt, monkeypatch, fedavg=True)
            for i, salt in enumerate(SALTS)]
    (grid_a, out_a), (grid_b, out_b) = runs
    assert_same_run(comparable(read_records(out_a), grid_keys(grid_a)),
                    comparable(read_records(out_b), grid_keys(grid_b)))


# ------------------------------------------------------------------------ process Grid
@pytest.mark.slow
def test_process_grid_same_seed_same_metrics(repro_config, tmp_path, monkeypatch):
    assert id_order_differs(SALTS, 5)
    records = []
    for i, salt in enumerate(SALTS):
        out = tmp_path / f"run{i}"
        config = dict(repro_config, **{"output-dir": str(out), "eval-cache": False})
        node_config = {"cache-dir": str(tmp_path / f"cache{i}")}
        configs = shuffled_ids(salt)(5, lambda _, c=node_config: c, 0)
        monkeypatch.setattr(procgrid, "node_configs", shuffled_ids(salt))
        # Execute: clients in a child process, messages as protobuf bytes
        with ProcessGrid("fedcybgd.client.app:app", 5, config, threads=1,
                         node_config=lambda _, c=node_config: c) as grid:
            run_server(grid, RunConfig.from_run_config(config))
            assert set(grid.node_ids) == set(configs)
        key_of = {str(n): NodeConfig.from_node_config(c).key for n, c in configs.items()}
        assert checkpoint_keys(out)[0] == key_of
        records.append(comparable(read_records(out), key_of))
    # Assert
    assert_same_run(*records)
    assert checkpoint_keys(tmp_path / "run0")[1] == checkpoint_keys(tmp_path / "run1")[1]


# ---------------------------------------------------------------------- the node keys
def hostile_app(answers: dict[int, Callable[[Message, Context], Message]]) -> ClientApp:
    """Our ClientApp, but partition ``i`` answers the node-key query with ``answers[i]``."""
    app = ClientApp()

    @app.query("node_key")
    def node_key(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid in answers:
            return answers[pid](msg, context)
        return client_app(msg, context)

    app.train()(client_train)
    return app


def identity(value: Any, **extra: Any) -> Callable[[Message, Context], Message]:
    def answer(msg: Message, context: Context) -> Message:
        return Message(RecordDict({protocol.IDENTITY: ConfigRecord({protocol.NODE_KEY: value}),
                                   **extra}), reply_to=msg)
    return answer


def raising(msg: Message, context: Context) -> Message:
    raise RuntimeError("no key here")


def test_bad_key_replies_are_logged_and_those_nodes_sit_out(tiny_run_config, tmp_path, caplog):
    # Prepare: of 7 nodes, 5 answer the key query with something unusable
    answers = {
        1: identity(7),  # not a string
        2: identity("x" * 65),  # too long
        3: identity("../etc"),  # not a key
        4: identity("4", extra=ConfigRecord({"a": 1})),  # a second record
        5: raising,  # the ClientApp raised: an error reply
    }
    config = dict(tiny_run_config, **{"clients-per-round": 2, "num-server-rounds": 2})
    grid = LoopbackGrid(hostile_app(answers), 7, config,
                        node_config=lambda i: {"cache-dir": str(tmp_path / "cache")})
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        run_server(grid, RunConfig.from_run_config(config))
    # Assert: only partitions 0 and 6 took part; each bad reply named; asked again in round 2
    key_of = grid_keys(grid)
    records = read_records(tmp_path / "out")
    for record in records[1:]:
        assert sorted(key_of[n] for n in record["clients"]) == ["0", "6"]
    for why in ("malformed: field 'node-key' must be a string", "is 65 characters long",
                "does not match", "config records ['extra', 'identity']",
                "client-error: RuntimeError: no key here"):
        assert why in caplog.text
    assert caplog.text.count("sent no usable node key") == 2 * len(answers)
    assert len([m for m in grid.sent if m.metadata.message_type == protocol.QUERY_NODE_KEY]) \
        == 7 + len(answers)


def test_duplicate_keys_warn_and_get_distinct_seeds(tiny_run_config, tmp_path, caplog):
    # Prepare: two nodes claim node-key "site-a"
    config = dict(tiny_run_config, **{"clients-per-round": 3, "num-server-rounds": 1})
    grid = LoopbackGrid(client_app, 3, config, node_config=lambda i: {
        "cache-dir": str(tmp_path / "cache"), **({"node-key": "site-a"} if i < 2 else {})})
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        run_server(grid, RunConfig.from_run_config(config))
    # Assert: the run went on; one warning names the key; the two got different seeds
    assert caplog.text.count("all have node key 'site-a'") == 1
    train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 3
    assert len({m.content["config"]["seed"] for m in train}) == 3


def test_node_keys_order_state_and_queries_once(tiny_run_config):
    grid = LoopbackGrid(client_app, 12, tiny_run_config, first_node_id=50)
    keys = NodeKeys(timeout_s=5)
    # Execute: learn twice
    keys.learn(grid, grid.get_node_ids(), 1)
    keys.learn(grid, grid.get_node_ids(), 2)
    # Assert: one query per node; numeric keys in number order (partition 10 after 9)
    assert len(grid.sent) == 12
    assert [keys.keys[n] for n in keys.order(grid.get_node_ids())] == [str(i) for i in range(12)]
    restored = NodeKeys()
    restored.load_state(json.loads(json.dumps(keys.state())))
    assert restored.keys == keys.keys
    assert sorted(["b", "10", "9", "a"], key=key_order) == ["9", "10", "a", "b"]


class SlowStartGrid(LoopbackGrid):
    """A LoopbackGrid whose node ``slow`` answers only its first message, and that answer
    reaches the server only once ``started`` is set (a cold start past the timeout)."""

    def __init__(self, *args: Any, slow: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slow, self.started, self.first = slow, False, ""

    def push_messages(self, messages: Any) -> Any:
        messages = list(messages)
        for message in messages:
            asked_before = any(m.metadata.dst_node_id == self.slow for m in self.sent)
            self.silent = {self.slow} if asked_before else set()
            super().push_messages([message])
            if message.metadata.dst_node_id == self.slow and not asked_before:
                self.first = message.metadata.message_id
        self.silent = set()
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Any) -> Any:
        return super().pull_messages(
            [i for i in message_ids if self.started or i != self.first])


def test_a_late_node_key_answer_counts_in_a_later_round(tiny_run_config, caplog):
    # Prepare: once seen under load, a Ray worker's first answer came after the key query's
    # timeout, so round 1 sampled no node; its answer to a re-sent query came late too
    grid = SlowStartGrid(client_app, 3, tiny_run_config, slow=1002)
    keys = NodeKeys(timeout_s=0.3)
    # Execute: round 1 times out on the slow node; then its first answer arrives
    with caplog.at_level(logging.WARNING, logger="fedcybgd"):
        keys.learn(grid, grid.get_node_ids(), 1)
    keyed_in_round_1 = sorted(keys.keys)
    grid.started = True
    keys.learn(grid, grid.get_node_ids(), 2)
    # Assert: the slow node sat round 1 out, named, and its late answer to the first query
    # (it never answered the second) keyed it in round 2
    assert keyed_in_round_1 == [1001, 1003]
    assert "node 1002 did not answer the node-key query" in caplog.text
    assert sorted(keys.keys) == [1001, 1002, 1003] and keys.keys[1002] == "1"
    assert sum(m.metadata.dst_node_id == 1002 for m in grid.sent) == 2


def test_a_node_that_never_answers_is_awaited_by_at_most_two_queries(tiny_run_config):
    # Prepare: node 1002 loses every reply
    grid = LoopbackGrid(client_app, 2, tiny_run_config)
    grid.silent = {1002}
    keys = NodeKeys(timeout_s=0.05)
    # Execute: five rounds ask it again
    for server_round in range(1, 6):
        keys.learn(grid, grid.get_node_ids(), server_round)
    # Assert: asked each round, but only its first and its newest query are awaited
    assert sorted(keys.keys) == [1001]
    asked = [m.metadata.message_id for m in grid.sent if m.metadata.dst_node_id == 1002]
    assert len(asked) == 5 and sorted(keys._pending) == sorted([asked[0], asked[-1]])


def test_a_new_nodes_key_query_waits_as_long_as_nodes_are_waited_for(tiny_run_config,
                                                                     monkeypatch):
    # Prepare: record how long the key queries may wait
    waits: list[float | None] = []
    learn = NodeKeys.learn
    monkeypatch.setattr(NodeKeys, "learn", lambda self, grid, nodes, rnd, timeout_s=None:
                        waits.append(timeout_s) or learn(self, grid, nodes, rnd, timeout_s))
    grid = LoopbackGrid(client_app, 3, tiny_run_config)
    # Execute
    nodes = NodeSampler(seed=0).sample(grid, 1, count=2, per_block=1, excluded=(),
                                       wait_s=300.0)
    # Assert: a cold start gets the node wait (300 s), not the key query's own 120 s
    assert waits == [300.0] and len(nodes) == 2


def test_node_key_config_is_checked():
    assert NodeConfig.from_node_config({"node-key": "site-a.eu:1"}).key == "site-a.eu:1"
    assert NodeConfig.from_node_config({"partition-id": 3, "num-partitions": 4}).key == "3"
    for bad in ("a b", "../x", "x" * 65, "-x"):
        with pytest.raises(ConfigError, match="node-key"):
            NodeConfig.from_node_config({"node-key": bad})


# ------------------------------------------------------------------ Simulation Engine
@pytest.fixture
def flwr_home(private_flower: Path) -> Iterator[Path]:
    # A private Flower home and ports, so the managed SuperLink is ours alone (demo.main stops it)
    yield private_flower


@pytest.mark.slow
def test_flwr_run_simulation_completes_and_a_rerun_gives_the_same_metrics(
        tmp_path, flwr_home, capsys):
    """The real app through `flwr run` on Flower's Simulation Engine (Ray), as `make demo` runs
    it: the run completes with every output, and the same command again, into the same folder,
    replaces the first run's outputs and gives the same run."""
    overrides = ("model='tiny-llama' layers-per-block=1 num-server-rounds=3 clients-per-round=2 "
                 "local-steps=2 batch-size=4 max-seq-len=48 eval-examples=16 eval-every=1 "
                 "lr=0.001 seed=5 eval-cache=false")
    out = tmp_path / "out"
    runs, said = [], []
    for _ in range(2):
        # Execute: `flwr run . local` on 4 simulated SuperNodes (new random node ids each time)
        code = demo.main(["--nodes", "4", "--output-dir", str(out), "--run-config", overrides])
        assert code == 0
        said.append(capsys.readouterr().out)
        key_of, checksums = checkpoint_keys(out)
        assert sorted(key_of.values()) == ["0", "1", "2", "3"]
        runs.append((key_of, checksums, read_records(out)))
    # Assert: each run completed with its outputs (the second's replaced the first's: one run's
    # rows); Flower gave the second other node ids, yet every metric is the same
    (keys_a, sums_a, records_a), (keys_b, sums_b, records_b) = runs
    assert all("outputs:" in text.splitlines()[-1] for text in said), said
    assert [r["round"] for r in records_a] == [r["round"] for r in records_b] == [0, 1, 2, 3]
    assert all(r["bytes_up"] > 0 and r["blocks"] for r in records_a[1:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3
    assert (out / "final" / "model.safetensors").exists()
    assert set(keys_a).isdisjoint(keys_b)
    assert_same_run(comparable(records_a, keys_a), comparable(records_b, keys_b))
    assert sums_a == sums_b
