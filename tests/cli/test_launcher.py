"""A run that trains nothing is a failed run, and ``fedcybgd run`` exits non-zero for it.

In process (loopback grid, the real ServerApp runner and ClientApp): the rule of
:mod:`fedcybgd.server.verdict`, what it must not do (one bad round, one hostile node), and what
a failed run leaves in its output folder. Through the command a user types
(``fedcybgd run . local ...`` on Flower's Simulation Engine): its exit status and its lines.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from fedcybgd.client.app import app as client_app
from fedcybgd.config import RunConfig
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.server.app import run_server
from fedcybgd.server.baselines import run_fedavg
from fedcybgd.server.verdict import (
    FAILED_ROUNDS,
    MAX_REASONS,
    RoundReplies,
    RunFailed,
    Seen,
    Verdict,
    read_error,
)

ROOT = Path(__file__).resolve().parents[2]
LABEL_ERROR = "is not a class index 0..1 nor one of label-words"


def write_csv(path: Path, labels: Callable[[int], object], rows: int = 40) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(rows):
            writer.writerow([f"a short review number {i}", labels(i)])
    return path


@pytest.fixture
def data(tmp_path: Path) -> dict[str, Path]:
    """A training file whose labels are all outside the classes, and a sound held-out one."""
    return {"bad": write_csv(tmp_path / "bad.csv", lambda i: "maybe"),
            "good": write_csv(tmp_path / "good.csv", lambda i: i % 2)}


def loopback(config: dict[str, Any], tmp_path: Path, nodes: int = 3,
             app: Callable[[Message, Context], Message] = client_app,
             data_path: Path | None = None) -> LoopbackGrid:
    """In-process nodes; with ``data_path`` each node trains on that file of its own (the
    server, which checks the run's ``dataset`` at start, never sees it)."""
    extra = {} if data_path is None else {"data-path": str(data_path)}
    return LoopbackGrid(app, nodes, config,  # type: ignore[arg-type]
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}"),
                                               **extra})


def outputs(config: dict[str, Any]) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    out = Path(config["output-dir"])
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return out, summary, rows


def error_reply(message: Message, reason: str,
                code: int = int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION)) -> Message:
    return Message(Error(code, reason), reply_to=message)


# ---- in process: the ServerApp's runner on a loopback grid --------------------------------

def test_a_data_file_no_client_can_read_fails_the_run(tiny_run_config, data, tmp_path):
    # Prepare: every client's own training file has labels outside the classes; the run's
    # dataset (which the server checks at start) is sound, so only the clients fail
    config = dict(tiny_run_config, **{"num-server-rounds": 5, "dataset": str(data["good"])})
    # Execute
    with pytest.raises(RunFailed) as failed:
        run_server(loopback(config, tmp_path, data_path=data["bad"]),
                   RunConfig.from_run_config(config), node_wait_s=5)
    # Assert: stopped after FAILED_ROUNDS rounds, the clients' error named in one line
    line = str(failed.value)
    assert "\n" not in line and "DataError" in line and LABEL_ERROR in line
    out, summary, rows = outputs(config)
    assert summary["status"] == "failed" and summary["reason"] == line
    assert summary["last_round"] == FAILED_ROUNDS
    assert [r["round"] for r in rows] == list(range(FAILED_ROUNDS + 1))
    assert not (out / "final").exists()


@pytest.mark.parametrize("params", ["full", "lora"])
def test_a_fedavg_baseline_that_averaged_nothing_fails_without_a_model(tiny_run_config, data,
                                                                      tmp_path, params):
    # Prepare: FedAvg's clients all train on a file with labels outside the classes
    config = dict(tiny_run_config, **{"strategy": "fedavg", "fedavg-params": params,
                                      "num-server-rounds": 2, "dataset": str(data["good"])})
    # Execute
    with pytest.raises(RunFailed) as failed:
        run_fedavg(loopback(config, tmp_path, data_path=data["bad"]),
                   RunConfig.from_run_config(config))
    # Assert: failed at the end, naming the clients' error; the summary says so; no final/
    line = str(failed.value)
    assert line.startswith("no update was averaged in 2 rounds"), line
    assert "DataError" in line and LABEL_ERROR in line
    out, summary, rows = outputs(config)
    assert summary["status"] == "failed" and summary["reason"] == line
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert not (out / "final").exists()


def test_a_chat_file_with_a_row_missing_its_messages_fails_the_run(tiny_run_config, tmp_path):
    # Prepare: the clients' own chat file has a row that lacks the messages column (the
    # run's dataset, checked by the server at start, is sound)
    rows: list[dict[str, Any]] = [{"conversation": [{"role": "user", "content": f"Repeat {i}"},
                                    {"role": "assistant", "content": f"{i}"}]}
                                  for i in range(40)]
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[7] = {"other": "no messages here"}
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = dict(tiny_run_config, **{"task": "sft", "dataset": str(good),
                                      "messages-field": "conversation", "max-new-tokens": 3,
                                      "num-server-rounds": 4})
    # Execute
    with pytest.raises(RunFailed) as failed:
        run_server(loopback(config, tmp_path, data_path=chat),
                   RunConfig.from_run_config(config), node_wait_s=5)
    # Assert: the clients keyed themselves, then every training reply was the file's error
    line = str(failed.value)
    assert line.startswith(f"every client failed in rounds 1-{FAILED_ROUNDS}")
    assert "DataError" in line and "field 'conversation'" in line
    out, summary, rows = outputs(config)
    assert rows[1]["dropped"] == {"client-error": 2} and summary["status"] == "failed"
    assert not (out / "final").exists()


def test_one_round_in_which_every_client_fails_does_not_fail_the_run(tiny_run_config,
                                                                      tmp_path):
    # Prepare: every node raises the same error for everything of round 1, then works
    def flaky(message: Message, context: Context) -> Message:
        if message.metadata.group_id in ("1", "node-key-1"):
            raise RuntimeError("the disk is briefly full")
        return client_app(message, context)

    config = dict(tiny_run_config, **{"num-server-rounds": 3})
    # Execute
    summary = run_server(loopback(config, tmp_path, app=flaky),
                         RunConfig.from_run_config(config), node_wait_s=5)
    # Assert: round 1 trained nothing, the run went on and completed
    out, written, rows = outputs(config)
    assert not rows[1]["accepted"] and rows[2]["accepted"]
    assert summary["status"] == written["status"] == "completed"
    assert (out / "final" / "model.safetensors").exists()


def test_a_hostile_node_that_always_fails_cannot_fail_an_honest_run(tiny_run_config,
                                                                     tmp_path):
    # Prepare: node 1001 answers its node key, then raises on every training instruction
    def hostile_first(message: Message, context: Context) -> Message:
        if context.node_id == 1001 and message.metadata.message_type == "train":
            raise RuntimeError("the run is over, stop it")
        return client_app(message, context)

    config = dict(tiny_run_config, **{"num-server-rounds": 3})
    # Execute
    summary = run_server(loopback(config, tmp_path, app=hostile_first),
                         RunConfig.from_run_config(config), node_wait_s=5)
    # Assert: the hostile node's errors were drops; the run completed
    out, _, rows = outputs(config)
    assert sum(r["dropped"].get("client-error", 0) for r in rows[1:]) >= 1
    assert summary["status"] == "completed" and (out / "final").exists()


def test_clients_failing_for_different_reasons_fail_the_run_at_its_end(tiny_run_config,
                                                                       tmp_path):
    # Prepare: every node raises on training, each with an error of its own
    def broken(message: Message, context: Context) -> Message:
        if message.metadata.message_type == "train":
            name = {1001: "alpha", 1002: "beta", 1003: "gamma"}[context.node_id]
            raise RuntimeError(f"node {name} cannot train")
        return client_app(message, context)

    config = dict(tiny_run_config, **{"num-server-rounds": 3})
    # Execute
    with pytest.raises(RunFailed) as failed:
        run_server(loopback(config, tmp_path, app=broken), RunConfig.from_run_config(config),
                   node_wait_s=5)
    # Assert: no early stop (the errors differ), the whole run ran and installed nothing
    line = str(failed.value)
    assert line.startswith("no block was installed in 3 rounds (dropped: client-error 6)")
    assert "RuntimeError: node" in line
    out, summary, rows = outputs(config)
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert summary["status"] == "failed" and summary["last_round"] == 3
    assert not (out / "final").exists()


def test_a_failed_run_removes_a_final_model_left_in_its_folder(tiny_run_config, data,
                                                               tmp_path):
    # Prepare: a folder an earlier attempt left a final model in (and no checkpoint), where
    # a run resumes, so starts afresh, and fails
    config = dict(tiny_run_config, **{"dataset": str(data["good"]), "resume": True})
    (Path(config["output-dir"]) / "final").mkdir(parents=True)
    (Path(config["output-dir"]) / "final" / "model.safetensors").write_bytes(b"old")
    # Execute
    with pytest.raises(RunFailed):
        run_server(loopback(config, tmp_path, data_path=data["bad"]),
                   RunConfig.from_run_config(config), node_wait_s=5)
    # Assert
    assert not (Path(config["output-dir"]) / "final").exists()


# ---- the rule on its own: replies in, a verdict out ---------------------------------------

def instruction(node: int, message_type: str = "train") -> Message:
    message = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=node,
                      message_type=message_type)
    message.metadata.__dict__["_message_id"] = str(uuid4())  # what a grid's push does
    return message


def round_of(*replies: Message, unanswered: tuple[Message, ...] = ()) -> RoundReplies:
    """A round that asked what ``replies`` answer, and ``unanswered``, and got ``replies``."""
    asked = {r.metadata.reply_to_message_id: r.metadata.message_type for r in replies}
    asked.update({m.metadata.message_id: m.metadata.message_type for m in unanswered})
    return RoundReplies(asked, [Seen.of(r) for r in replies])


def test_the_same_error_from_every_node_in_two_rounds_in_a_row_fails():
    verdict = Verdict()
    # Execute: the same error, reported from different rows, in rounds 1 and 2
    first = verdict.after_round(1, round_of(
        error_reply(instruction(1), "ValueError: bad row 3"),
        error_reply(instruction(2), "ValueError: bad row 17")), installed=False)
    second = verdict.after_round(2, round_of(
        error_reply(instruction(1), "ValueError: bad row 3")), installed=False)
    # Assert
    assert first is None
    assert second is not None and "rounds 1-2" in second and "ValueError: bad row 3" in second


@pytest.mark.parametrize("second_round", [
    # a node answered without an error
    lambda: round_of(error_reply(instruction(1), "ValueError: bad"),
                     Message(RecordDict(), reply_to=instruction(2))),
    # another reason
    lambda: round_of(error_reply(instruction(1), "KeyError: 'text'")),
    # the nodes are away, not failing
    lambda: round_of(error_reply(instruction(1), "node gone",
                                 int(ErrorCode.NODE_UNAVAILABLE))),
    # a node did not answer (a timeout)
    lambda: round_of(error_reply(instruction(1), "ValueError: bad"),
                     unanswered=(instruction(2),)),
    # no node answered
    lambda: round_of(unanswered=(instruction(1), instruction(2))),
], ids=["a-success", "another-reason", "node-unavailable", "one-timeout", "no-reply"])
def test_a_round_that_is_not_the_same_client_error_breaks_the_streak(second_round):
    verdict = Verdict()
    # Execute: the same error in rounds 1 and 3, the round between not
    got = [verdict.after_round(1, round_of(error_reply(instruction(1), "ValueError: bad")),
                               False),
           verdict.after_round(2, second_round(), installed=False),
           verdict.after_round(3, round_of(error_reply(instruction(1), "ValueError: bad")),
                               False)]
    # Assert
    assert got == [None, None, None]


def test_nothing_fails_early_once_a_block_was_installed():
    verdict = Verdict()
    verdict.after_round(1, round_of(Message(RecordDict(), reply_to=instruction(1))), True)
    # Execute: the same error everywhere, many rounds after an install
    got = [verdict.after_round(r, round_of(error_reply(instruction(1), "ValueError: bad")),
                               installed=False) for r in range(2, 6)]
    # Assert
    assert got == [None] * 4 and verdict.at_end(5, {"client-error": 4}) is None


def test_a_round_without_training_is_judged_on_its_node_key_replies():
    verdict = Verdict()
    key_error = error_reply(instruction(1, "query.node_key"), "DataError: row 1: bad label")
    # Execute: no training was sent (no node could be keyed), twice
    got = [verdict.after_round(r, round_of(key_error), installed=False)
           for r in (1, 2)]
    # Assert
    assert got[0] is None and got[1] is not None and "DataError: row 1: bad label" in got[1]


def test_a_successful_node_key_reply_does_not_hide_failing_training():
    verdict = Verdict()
    key_ok = Message(RecordDict(), reply_to=instruction(1, "query.node_key"))
    train_error = error_reply(instruction(1), "KeyError: 'messages'")
    # Execute
    got = [verdict.after_round(r, round_of(key_ok, train_error), installed=False)
           for r in (1, 2)]
    # Assert
    assert got[1] is not None and "KeyError: 'messages'" in got[1]


def test_at_end_nothing_installed_names_the_drops_and_the_commonest_error():
    verdict = Verdict()
    verdict.after_round(1, round_of(error_reply(instruction(1), "OSError: no space"),
                                    error_reply(instruction(2), "OSError: no space"),
                                    error_reply(instruction(3), "MemoryError: out")), False)
    # Execute
    line = verdict.at_end(1, {"client-error": 3, "no-reply": 1})
    # Assert
    assert line == ("no block was installed in 1 round (dropped: client-error 3, no-reply 1); "
                    "most common client error (2x): OSError: no space")


@pytest.mark.parametrize("reason", [
    # a SuperNode's ClientApp process (deployment)
    "<class 'fedcybgd.data.sources.DataError'>:<'/d/bad.csv, row 15: field 'label' is bad'>",
    # the Simulation Engine: Ray's traceback, the cause first, colour codes in it
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor"
    ".run()\x1b[39m (pid=20527, ip=192.0.2.2)\n  File \"x.py\", line 3, in run\n"
    "fedcybgd.data.sources.DataError: /d/bad.csv, row 15: field 'label' is bad\n\n"
    "The above exception was the direct cause of the following exception:\n\n"
    "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. "
    "Message: /d/bad.csv, row 15: field 'label' is bad'>",
    # the loopback grid
    "DataError: /d/bad.csv, row 15: field 'label' is bad",
], ids=["deployment", "simulation", "loopback"])
def test_a_client_error_is_read_down_to_its_cause(reason):
    # Execute
    error = read_error(reason)
    # Assert: one line, the cause; other rows of the same error compare equal
    assert error.text == "DataError: /d/bad.csv, row 15: field 'label' is bad"
    assert error.key == read_error(reason.replace("row 15", "row 52")).key


def test_nodes_that_vary_their_errors_cannot_grow_the_server_s_memory():
    verdict = Verdict()
    def word(n: int) -> str:  # no digits: numbers are masked when reasons are compared
        return "".join(chr(ord("a") + int(d)) for d in str(n))

    # Execute: a new reason from every reply, for many rounds
    for r in range(1, 101):
        verdict.after_round(r, round_of(error_reply(instruction(1), f"ValueError: {word(r)}"),
                                        error_reply(instruction(2), f"OSError: {word(r)}")),
                            installed=False)
    # Assert
    assert len(verdict.errors) == len(verdict.texts) == MAX_REASONS


def test_a_huge_hostile_reason_is_read_short():
    # Execute
    error = read_error("ValueError: " + "x" * 10_000_000)
    # Assert
    assert len(error.text) <= 300


# ---- the command a user types ----------------------------------------------------------------

TINY = ("model='tiny-llama' partitioner='iid' num-server-rounds=1 clients-per-round=2 "
        "clients-per-block=1 layers-per-block=1 local-steps=2 batch-size=4 max-seq-len=48 "
        "eval-examples=16")


@pytest.fixture(scope="module")
def flower_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The user's environment with the venv on PATH and a private Flower home and ports, so
    the managed SuperLink these runs start is this module's alone (stopped at the end)."""
    from fedcybgd.cli.demo import stop_local_superlink

    home = tmp_path_factory.mktemp("flwr-home")
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    yield env
    stop_local_superlink(home)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fedcybgd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["fedcybgd", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.slow
def test_fedcybgd_run_fails_a_run_whose_data_cannot_be_read(flower_env, data, tmp_path):
    # Prepare: a training file whose labels are all outside the classes
    out = tmp_path / "out"
    overrides = (f"{TINY} dataset='{data['bad']}' eval-dataset='{data['good']}' "
                 f"output-dir='{out}'")
    # Execute
    done = fedcybgd(flower_env, "run", ".", "local", "--run-config", overrides,
                    "--federation-config", "num-supernodes=2 client-resources-num-cpus=1")
    # Assert: non-zero, the file's error (file, row, field) in the launcher's last lines, no
    # model written: the ServerApp refused the data before round 1
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    mine = [x for x in done.stderr.splitlines() if x.startswith("fedcybgd: ")]
    assert "finished:failed" in mine[-2] and LABEL_ERROR in mine[-2]
    assert str(data["bad"]) in mine[-2] and "row " in mine[-2]
    assert mine[-1].startswith("fedcybgd: full log: ")
    assert Path(mine[-1].split()[3]).is_file()
    assert not (out / "final").exists()


@pytest.mark.slow
def test_fedcybgd_run_names_the_misspelt_key(flower_env):
    # Execute
    done = fedcybgd(flower_env, "run", ".", "local", "--run-config",
                    "model='tiny-llama' num-server-round=2")
    # Assert
    assert done.returncode == 1
    assert "did you mean 'num-server-rounds'?" in done.stderr
    assert "Key 'num-server-round' is not present" in done.stderr  # the SuperLink's reason


@pytest.mark.slow
def test_fedcybgd_run_exits_0_for_an_honest_run(flower_env, tmp_path):
    # Prepare
    out = tmp_path / "out"
    # Execute
    done = fedcybgd(flower_env, "run", ".", "local", "--run-config",
                    f"{TINY} output-dir='{out}'", "--federation-config",
                    "num-supernodes=2 client-resources-num-cpus=1")
    # Assert
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "finished:completed" in done.stdout.splitlines()[-1]
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    assert (out / "final" / "model.safetensors").exists()


def test_python_m_fedcybgd_cli_is_the_command():
    # Execute
    done = subprocess.run([sys.executable, "-m", "fedcybgd.cli", "run", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    # Assert
    assert done.returncode == 0 and "exit status: 0 the run finished:completed" in \
        done.stdout.replace("\n", " ")


@pytest.mark.parametrize("name", ["demo", "certs", "deploy-local", "gateway"])
def test_the_operator_tools_are_subcommands_with_their_own_help(name, capsys):
    from fedcybgd.cli import main

    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: fedcybgd {name}")


def test_report_and_plots_read_run_folders(tmp_path, capsys):
    import json

    from fedcybgd.cli import main

    for name, accuracy in (("a", 0.61), ("b", 0.72)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({
            "status": "completed", "update_rule": "fo", "model": "tiny-llama",
            "rounds_run": 2, "final_eval_accuracy": accuracy, "bytes_up": 2**20}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
            {"round": 0, "eval_loss": 3.0, "eval_accuracy": 0.5},
            {"round": 1, "train_loss": 2.9, "bytes_down": 10, "bytes_up": 10})))
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "0.610" in out and "0.720" in out and "1.0" in out
    assert main(["plots", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "plots.png").stat().st_size > 0
    assert main(["report", str(tmp_path)]) == 2
    assert "no readable summary.json" in capsys.readouterr().out
