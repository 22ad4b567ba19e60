"""Data no client could train on stops the run at start, by name; small data is visible.

In process: the ServerApp's runner on a loopback grid whose nodes must never be asked, and
whose model must never be loaded, for a run refused at start. Then a short run on a tiny model
whose held-out split is smaller than ``eval-examples``.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message

from fedcybgd.client.app import app as client_app
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.data.sources import DataError
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.server import app as server_app
from fedcybgd.server.app import run_server


def write_csv(path: Path, rows: int, label: Callable[[int], object],
              header: tuple[str, str] = ("review", "feel")) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for i in range(rows):
            writer.writerow([f"a short review number {i}", label(i)])
    return path


def never_asked(message: Message, context: Context) -> Message:
    raise AssertionError(f"node {context.node_id} was sent {message.metadata.message_type!r} "
                         "by a run that should have stopped at start")


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: the data check must come first and need none."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"the model {name!r} was loaded before the data was checked")

    monkeypatch.setattr(server_app, "load_model", refuse)


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    """The WARNING lines of the ``fedcybgd`` loggers (which may not propagate to the root)."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler, logger = Keep(), logging.getLogger("fedcybgd")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def start(config: dict[str, Any], tmp_path: Path,
          app: Callable[[Message, Context], Message] = never_asked) -> dict[str, Any]:
    grid = LoopbackGrid(app, 2, config,  # type: ignore[arg-type]
                        node_config=lambda i: {"cache-dir": str(tmp_path / f"cache-{i}")})
    return run_server(grid, RunConfig.from_run_config(config), node_wait_s=5)


@pytest.fixture
def classes(tiny_run_config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """A classification run on CSV columns ``review``/``feel``, scored on a sound file."""
    good = write_csv(tmp_path / "held_out.csv", 12, lambda i: ("calm", "angry")[i % 2])
    return dict(tiny_run_config, **{"text-field": "review", "label-field": "feel",
                                    "label-words": "calm,angry", "eval-dataset": str(good)})


def test_a_label_outside_the_classes_stops_the_run_at_start_naming_file_row_field(
        classes, tmp_path, no_model):
    # Prepare: row 30 of the training file has a label that is no class
    weather = write_csv(tmp_path / "weather.csv", 60,
                        lambda i: "mild" if i == 29 else ("calm", "angry")[i % 2])
    config = dict(classes, dataset=str(weather))
    # Execute
    with pytest.raises(DataError) as refused:
        start(config, tmp_path)
    # Assert: one line naming the file, the row and the field; no output written
    line = str(refused.value)
    assert "\n" not in line
    assert f"{weather}, row 30: field 'feel' = 'mild' is not a class index 0..1" in line
    assert not Path(config["output-dir"]).exists()


def test_a_chat_row_missing_its_messages_stops_the_run_at_start(tiny_run_config, tmp_path,
                                                                 no_model):
    # Prepare: line 8 of a chat file lacks the messages column the others have
    chat = tmp_path / "chat.jsonl"
    rows: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": f"Repeat {i}"},
                                                {"role": "assistant", "content": f"{i}"}]}
                                  for i in range(40)]
    rows[7] = {"other": "no messages here"}
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[:7]))
    config = dict(tiny_run_config, **{"task": "sft", "dataset": str(chat),
                                      "eval-dataset": str(held_out),
                                      "messages-field": "messages"})
    # Execute
    with pytest.raises(DataError) as refused:
        start(config, tmp_path)
    # Assert
    assert str(refused.value) == (f"{chat}, row 8: field 'messages' is missing (a row without "
                                  "it, among rows that have it)")


@pytest.mark.parametrize(("name", "body", "says"), [
    ("empty.csv", "", "the file is empty"),
    ("blank.jsonl", "\n  \n", "the file is empty (whitespace only)"),
    ("header.csv", "review,feel\n", "the file holds no rows"),
])
def test_an_empty_data_file_stops_the_run_at_start_naming_it(classes, tmp_path, no_model,
                                                              name, body, says):
    # Prepare
    empty = tmp_path / name
    empty.write_text(body)
    config = dict(classes, dataset=str(empty))
    # Execute
    with pytest.raises(DataError) as refused:
        start(config, tmp_path)
    # Assert
    assert str(refused.value) == f"{empty}: {says}"


@pytest.mark.parametrize("exists", [True, False])
@pytest.mark.parametrize("key", ["dataset", "eval-dataset"])
def test_a_relative_path_is_refused_naming_the_folder_searched(classes, tmp_path, monkeypatch,
                                                               no_model, exists, key):
    # Prepare: the server's working directory, with or without the file in it
    monkeypatch.chdir(tmp_path)
    if exists:
        write_csv(tmp_path / "weather.csv", 20, lambda i: i % 2)
    config = dict(classes, **{key: "weather.csv"})
    # Execute
    with pytest.raises(ConfigError) as refused:
        start(config, tmp_path)
    # Assert: the key, the folder searched and the absolute path to give instead
    line = str(refused.value)
    assert line.startswith(f"{key} = 'weather.csv' is a relative path")
    assert f"working directory {Path.cwd()} (" in line
    assert ("it exists there" if exists else "nothing is there by that name") in line
    assert line.endswith(f"{key}='{Path.cwd() / 'weather.csv'}'")


def test_fewer_held_out_rows_than_eval_examples_warn_once_and_show_the_real_count(
        classes, tmp_path, warnings_seen, capsys):
    # Prepare: 12 held-out rows, 200 asked for
    train = write_csv(tmp_path / "train.csv", 40, lambda i: ("calm", "angry")[i % 2])
    config = dict(classes, **{"dataset": str(train), "eval-examples": 200,
                              "num-server-rounds": 1})
    # Execute
    summary = start(config, tmp_path, app=client_app)
    # Assert: one warning with both numbers; every figure says it rests on 12 examples
    about = [w for w in warnings_seen if "eval-examples" in w]
    assert about == [f"eval-examples = 200, but eval-dataset = {classes['eval-dataset']!r} "
                     "holds 12 rows: every evaluation of this run uses those 12"]
    out = Path(config["output-dir"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("eval_examples") for r in rows] == [12, 12]
    assert summary["eval_examples"] == 12
    assert json.loads((out / "summary.json").read_text())["eval_examples"] == 12
    printed = capsys.readouterr().out
    assert "round 1/1" in printed and "on 12 examples" in printed
    assert "eval examples" in printed


def test_the_split_of_a_small_dataset_is_what_is_counted(classes, tmp_path, warnings_seen):
    # Prepare: no eval-dataset: the test split cut from 40 rows holds 4 of them
    train = write_csv(tmp_path / "train.csv", 40, lambda i: ("calm", "angry")[i % 2])
    config = dict(classes, **{"dataset": str(train), "eval-dataset": "", "eval-examples": 200,
                              "num-server-rounds": 1})
    # Execute
    summary = start(config, tmp_path, app=client_app)
    # Assert
    assert [w for w in warnings_seen if "eval-examples" in w] == [
        f"eval-examples = 200, but the test split of dataset = {str(train)!r} holds 4 rows: "
        "every evaluation of this run uses those 4"]
    assert summary["eval_examples"] == 4
