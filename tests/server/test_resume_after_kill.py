"""A hard kill costs no round: a server killed anywhere (mid-round after its nodes trained and
moved past its checkpoint, or between any two checkpoint files) and resumed ends with the
model the uninterrupted run made, its first resumed round dropping nothing; summary.json
records each segment of the run; a stopped run writes a summary.json that says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedcybgd.compression import decode, payload_from_array, read_header
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.checkpoint import SENT, Checkpointer, CheckpointError
from fedcybgd.server.stops import Terminated
from fedcybgd.strategies.downloads import DownloadPlanner
from fedcybgd.strategies.versions import BlockVersions
from tests.server.test_resume_truth import rows, run

ROUNDS = 3


class ServerKilled(BaseException):
    """Stands for SIGKILL: nothing in the server may catch it."""


def config_for(tiny_run_config: dict[str, Any], out: Path, **extra: Any) -> dict[str, Any]:
    """Every node trains every round (four nodes, one a block, four blocks): each holds exact
    copies of blocks it trained earlier and is sent deltas against them, and self-syncs the
    block it trains (a pending copy the next instruction promotes)."""
    return dict(tiny_run_config, **{"num-server-rounds": ROUNDS, "clients-per-round": 4,
                                    "clients-per-block": 1, "output-dir": str(out)}, **extra)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def killer(server_round: int, nth_file: int | str) -> Callable[[Path], None]:
    """A checkpoint-file hook that kills the server at ``server_round``'s save: after its
    ``nth_file``-th file (1: the first block file, when the round's replies are read and
    installed, its nodes trained and moved on), or after its ``state.json``."""
    state = {"saves": 0, "files": 0}

    def kill(path: Path) -> None:
        if state["saves"] == server_round - 1:
            state["files"] += 1
            if (nth_file == "state.json" and path.name == "state.json") or \
                    state["files"] == nth_file:
                raise ServerKilled
        if path.name == "state.json":
            state["saves"] += 1

    return kill


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The uninterrupted run: its output folder and summary."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    root = tmp_path_factory.mktemp("straight")
    tiny = {"model": "tiny-llama", "partitioner": "iid", "block-schedule": "ascending",
            "layers-per-block": 1, "train-embeddings": False, "train-head": False,
            "update-rule": "fo", "local-steps": 2, "batch-size": 4, "max-seq-len": 48,
            "lr": 1e-3, "eval-every": 1, "eval-examples": 16, "eval-batch-size": 16, "seed": 0}
    summary = run(config_for(tiny, root / "out"), root / "cache")
    return root / "out", summary


@pytest.mark.slow
@pytest.mark.parametrize(("kill_round", "nth_file"), [(3, 1), (3, 3), (2, "state.json")],
                         ids=["after-the-nodes-trained", "between-block-files", "after-state"])
def test_a_kill_anywhere_in_a_round_costs_no_round(straight, tiny_run_config, tmp_path,
                                                   kill_round, nth_file):
    # Prepare: the same run killed in a round's checkpoint: its nodes have trained, applied the
    # round's downloads (deltas against blocks they hold) and promotions, and keep pending
    # copies the checkpoint knows nothing of
    out_a, _ = straight
    config = config_for(tiny_run_config, tmp_path / "killed")
    with pytest.raises(ServerKilled):
        run(config, tmp_path / "cache", on_checkpoint_file=killer(kill_round, nth_file))
    # Execute
    summary = run(dict(config, resume=True), tmp_path / "cache")
    # Assert: no upload dropped, every block of every round installed, and the model the
    # uninterrupted run made, bit for bit
    resumed, uninterrupted = rows(tmp_path / "killed"), rows(out_a)
    assert [r["round"] for r in resumed] == list(range(ROUNDS + 1))
    assert [r.get("dropped") for r in resumed] == [r.get("dropped") for r in uninterrupted]
    assert all(not r["dropped"] and not r["failed_blocks"] for r in resumed[1:])
    assert [r.get("accepted") for r in resumed] == [r.get("accepted") for r in uninterrupted]
    a, b = weights(out_a), weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the summary: two segments, the first ended without a word at its last checkpoint
    checkpointed = kill_round if nth_file == "state.json" else kill_round - 1
    assert summary["status"] == "completed"
    assert [(s["resumed_after"], s["first_round"], s["last_round"], s["end"])
            for s in summary["segments"]] == [(None, 1, checkpointed, "interrupted"),
                                              (checkpointed, checkpointed + 1, ROUNDS,
                                               "completed")]
    assert summary["wall_s"] == pytest.approx(sum(s["wall_s"] for s in summary["segments"]))
    assert json.loads((tmp_path / "killed" / "summary.json").read_text())["segments"] == \
        summary["segments"]


CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    config, cache, kill_round, sig = json.loads(sys.argv[1])
    saves = []

    def hook(path):
        if path.name == "state.json":
            saves.append(path)
        elif len(saves) == kill_round - 1:  # the round's first file: its nodes have trained
            os.kill(os.getpid(), getattr(signal, sig))

    grid = LoopbackGrid(client_app, 4, config, node_config=lambda i: {"cache-dir": cache})
    run_server(grid, RunConfig.from_run_config(config), on_checkpoint_file=hook)
""")


def run_child(config: dict[str, Any], cache: Path, kill_round: int, sig: str
              ) -> subprocess.CompletedProcess[str]:
    """The run in a process of its own, which sends itself ``sig`` at the first checkpoint file
    of ``kill_round``."""
    return subprocess.run([sys.executable, "-c", CHILD,
                           json.dumps([config, str(cache), kill_round, sig])],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_server_process_killed_by_sigkill_mid_round_resumes_to_the_uninterrupted_model(
        straight, tiny_run_config, tmp_path):
    # Prepare: a real SIGKILL of the server's process in round 3, after its nodes trained
    out_a, _ = straight
    config = config_for(tiny_run_config, tmp_path / "killed")
    child = run_child(config, tmp_path / "cache", 3, "SIGKILL")
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not (tmp_path / "killed" / "summary.json").exists()  # SIGKILL cannot be caught
    # Execute
    summary = run(dict(config, resume=True), tmp_path / "cache")
    # Assert: round 3 redone without a drop; the uninterrupted model
    assert [r.get("dropped") for r in rows(tmp_path / "killed")] == \
        [r.get("dropped") for r in rows(out_a)]
    a, b = weights(out_a), weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [s["end"] for s in summary["segments"]] == ["interrupted", "completed"]


def stop_in_round_2(how: str) -> Callable[[Path], None]:
    """A checkpoint-file hook that stops the run at round 2's first file: SIGTERM to this
    process, Ctrl-C, or an error."""
    saves = []

    def stop(path: Path) -> None:
        if path.name == "state.json":
            saves.append(path)
        elif len(saves) == 1:
            if how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
            if how == "Ctrl-C":
                raise KeyboardInterrupt
            if how == "error":
                raise OSError(28, "No space left on device")

    return stop


@pytest.mark.slow
@pytest.mark.parametrize(("how", "raised", "reason"), [
    ("SIGTERM", Terminated, "stopped by SIGTERM"),
    ("Ctrl-C", KeyboardInterrupt, "stopped by SIGINT (Ctrl-C)"),
    ("error", OSError, "stopped by an error: OSError: [Errno 28] No space left on device"),
])
def test_a_stopped_run_writes_a_summary_that_says_so(tiny_run_config, tmp_path, how, raised,
                                                     reason):
    # Prepare
    config = dict(tiny_run_config, **{"num-server-rounds": 2})
    out = Path(config["output-dir"])
    # Execute: stopped in round 2, after round 1's checkpoint
    with pytest.raises(raised):
        run(config, tmp_path / "cache", on_checkpoint_file=stop_in_round_2(how))
    # Assert: summary.json says it stopped, why, at which round, and how to go on
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["reason"] == reason
    assert (summary["last_round"], summary["stopped_in_round"], summary["rounds_run"]) == \
        (1, 2, 1)
    assert "resume = true" in summary["resume"] and "round 2" in summary["resume"]
    assert [(s["resumed_after"], s["last_round"], s["end"]) for s in summary["segments"]] == \
        [(None, 1, "stopped")]
    assert summary["wall_s"] == summary["segments"][0]["wall_s"] > 0
    assert summary["initial_eval_loss"] is not None
    assert not (out / "final").exists()
    if how != "SIGTERM":
        return
    # and the resume after it lists the stopped segment, then its own
    resumed = run(dict(config, resume=True), tmp_path / "cache")
    assert [(s["resumed_after"], s["first_round"], s["last_round"], s["end"])
            for s in resumed["segments"]] == [(None, 1, 1, "stopped"), (1, 2, 2, "completed")]
    assert resumed["wall_s"] == pytest.approx(summary["wall_s"] +
                                              resumed["segments"][1]["wall_s"])


class StoppedGrid(LoopbackGrid):
    """A loopback grid whose ``after``-th push of messages raises Ctrl-C's interrupt."""

    def __init__(self, *args: Any, after: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pushes, self.after = 0, after

    def push_messages(self, messages):
        self.pushes += 1
        if self.pushes == self.after:
            raise KeyboardInterrupt
        return super().push_messages(messages)


@pytest.mark.parametrize(("strategy", "after", "done"), [
    ("pipeline", 5, 1),  # gpipe on two stages: F, F, B, B of step 1, then step 2's first F
    ("fedavg", 3, 1),  # node keys, round 1, round 2 (an empty evaluation sends nothing)
])
def test_a_stopped_run_that_keeps_no_checkpoint_writes_a_summary_that_says_so(
        tmp_path, strategy, after, done):
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.server.app import RUNNERS

    # Prepare
    config = {"model": "tiny-llama", "strategy": strategy, "pipeline-schedule": "gpipe",
              "num-server-rounds": 3, "clients-per-round": 2, "local-steps": 2,
              "batch-size": 4, "max-seq-len": 32, "micro-batches": 2, "eval-examples": 16,
              "eval-every": 0, "partitioner": "iid", "output-dir": str(tmp_path / "run")}
    grid = StoppedGrid(client_app, 2, config, after=after,
                       node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}")})
    # Execute
    with pytest.raises(KeyboardInterrupt):
        RUNNERS[strategy](grid, RunConfig.from_run_config(config))
    # Assert: summary.json says it stopped, why, after which round, and that it starts again
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["reason"] == "stopped by SIGINT (Ctrl-C)"
    assert summary["rounds_run"] == summary["last_round"] == done
    assert "keeps no checkpoint" in summary["resume"] and summary["strategy"] == strategy
    assert summary["initial_eval_loss"] is not None and summary["wall_s"] > 0
    assert not (tmp_path / "run" / "final").exists()


FLOWER_CHILD = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from flwr.supercore.exit import register_signal_handlers
    from flwr.supercore.telemetry import EventType
    from fedcybgd.client.app import app as client_app
    from fedcybgd.config import RunConfig
    from fedcybgd.harness.loopback import LoopbackGrid
    from fedcybgd.server.app import run_server

    config, cache, thread = json.loads(sys.argv[1])
    # as Flower's ServerApp and simulation processes do: SIGINT, SIGTERM (and `flwr stop`,
    # which its runtime turns into SIGINT) run Flower's exit handlers, then SystemExit
    register_signal_handlers(event_type=EventType.FLWR_SERVERAPP_RUN_LEAVE,
                             exit_message="Task stopped by user.")
    saves = []

    def hook(path):
        if path.name == "state.json":
            saves.append(path)
        elif len(saves) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # on a thread of its own the run goes on until the process ends

    def serve():
        grid = LoopbackGrid(client_app, 4, config, node_config=lambda i: {"cache-dir": cache})
        run_server(grid, RunConfig.from_run_config(config), on_checkpoint_file=hook)

    if thread:  # Flower's simulation: the ServerApp on a thread, signals on the main one
        threading.Thread(target=serve, daemon=True).start()
        while True:
            time.sleep(0.1)
    serve()
""")


@pytest.mark.slow
@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "own-thread"])
def test_a_run_stopped_through_flowers_exit_writes_a_stopped_summary(tiny_run_config,
                                                                     tmp_path, thread):
    # Prepare
    config = dict(tiny_run_config, **{"num-server-rounds": 2})
    out = Path(config["output-dir"])
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    # Execute: SIGTERM in round 2, under Flower's own signal handlers
    child = subprocess.run([sys.executable, "-c", FLOWER_CHILD,
                            json.dumps([config, str(tmp_path / "cache"), thread])],
                           capture_output=True, text=True, timeout=600, env=env)
    # Assert
    assert child.returncode in (0, 1), child.stderr[-3000:]  # Flower's exit, not a signal
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped", summary
    assert summary["reason"].startswith("stopped by the Flower runtime")
    assert (summary["last_round"], summary["stopped_in_round"]) == (1, 2)


# ------------------------------------------------------------------- the parts, on their own


def test_an_unconfirmed_node_gets_the_planned_content_from_the_pretrained_block():
    # Prepare: a node holds layer.1 and layer.2 exactly at version 1; both are now at version
    # 2; it trains layer.2 (exact) and gets layer.1 frozen (a lossy delta against its copy) and
    # layer.3, which it holds pretrained, frozen (a lossy delta against the pretrained block)
    model = load_model("tiny-llama")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    versions = BlockVersions(BlockMap(model, 1), weights)
    versions.install("layer.3", {k: v + 0.01 for k, v in versions.tensors("layer.3").items()},
                     version=1)
    held = {}
    for version in (1, 2):
        for block in ("layer.1", "layer.2"):
            moved = {k: v + 0.01 * version for k, v in versions.tensors(block).items()}
            versions.install(block, moved, version=version)
            if version == 1:
                held[block] = versions.current(block)
    sure = DownloadPlanner(versions, exact_codec="xor+zstd", download_codec="delta+int8+zstd")
    unsure = DownloadPlanner(versions, exact_codec="xor+zstd",
                             download_codec="delta+int8+zstd", unconfirmed=lambda node: True)
    # Execute
    planned = sure.plan(3, node=1, assigned="layer.2", held=held)
    restated = unsure.plan(3, node=1, assigned="layer.2", held=held)
    # Assert: the same holdings after, each payload from version 0, decoding to what the
    # planned one decodes to on the node's copy (bit for bit, the lossy frozen copy too)
    assert restated.expect == planned.expect
    assert set(restated.arrays.keys()) == set(planned.arrays.keys()) == \
        {"layer.1", "layer.2", "layer.3"}
    assert payload_from_array(restated.arrays["layer.3"]) == \
        payload_from_array(planned.arrays["layer.3"])  # from version 0 already: as it is
    for block in ("layer.1", "layer.2"):
        ours = payload_from_array(restated.arrays[block])
        theirs = payload_from_array(planned.arrays[block])
        assert read_header(ours, max_bytes=len(ours)).base_version == 0
        assert read_header(theirs, max_bytes=len(theirs)).base_version == 1
        a = decode(ours, base=versions.pretrained(block), max_bytes=len(ours)).tensors
        b = decode(theirs, base=versions.base_for(block, held[block])[1],
                   max_bytes=len(theirs)).tensors
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert planned.expect["layer.1"] != versions.current("layer.1")  # lossy, and still equal
    assert restated.bytes > planned.bytes


def test_the_nodes_sent_since_the_checkpoint_are_read_back_and_checked(tmp_path):
    # Prepare: a checkpoint of round 2, then round 3's instructions to two nodes
    root = tmp_path / "checkpoint"
    first = Checkpointer(root)
    first.save(2, {}, {"x": 1})
    first.note_sent([1003, 1001])
    # Execute: a resume reads them; its redone round, killed again, adds its own
    again = Checkpointer(root)
    again.read_state()
    sent = again.read_sent()
    again.note_sent([1002])
    # Assert
    assert sent == {1001, 1003}
    third = Checkpointer(root)
    third.read_state()
    assert third.read_sent() == {1001, 1002, 1003}
    # a save answers for them (its state does), and a record of an earlier checkpoint counts
    # for nothing
    third.save(3, {}, {"x": 1})
    assert not (root / SENT).exists()
    (root / SENT).write_text(json.dumps({"after_round": 2, "nodes": ["1001"]}))
    fourth = Checkpointer(root)
    fourth.read_state()
    assert fourth.read_sent() == set()


@pytest.mark.parametrize("body", [
    b"{", b"[]", b'{"after_round": 4, "nodes": []}', b'{"after_round": 2, "nodes": [1001]}',
    b'{"after_round": -1, "nodes": []}', b'{"after_round": 2, "nodes": ["-1"]}',
    b'{"after_round": true, "nodes": []}', b'{"nodes": []}', b'[' * 100_000,
])
def test_a_malformed_record_of_the_nodes_sent_is_a_checkpoint_error_naming_it(tmp_path, body):
    # Prepare
    root = tmp_path / "checkpoint"
    Checkpointer(root).save(2, {}, {"x": 1})
    (root / SENT).write_bytes(body)
    reader = Checkpointer(root)
    reader.read_state()
    # Execute, Assert
    with pytest.raises(CheckpointError, match=r"sent\.json"):
        reader.read_sent()
