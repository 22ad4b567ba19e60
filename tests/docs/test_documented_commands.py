"""Every ``fedcybgd`` command the pages show runs as written, from a fresh clone, after the demo.

The pages are README.md, docs/*.md and examples/README.md; a command is a line of one of their
``bash`` blocks that calls the ``fedcybgd`` console script (``fedcybgd ...``,
``.venv/bin/fedcybgd ...``, ``cd examples/x && ../../.venv/bin/fedcybgd ...``), its
continuation lines joined. Each command not in :data:`SKIP` is typed, in page order, into one
scratch copy of the project's tracked files (a fresh clone with the working tree's contents and
the project's venv as its ``.venv``), in which:

* ``make demo`` has run: ``outputs/demo`` holds a completed run's ``summary.json``;
* the venv is activated (its ``bin`` first on ``PATH``);
* the files of the user's own that a command names (``$PWD/topics.csv``, ...) exist, in the
  format the page gives beside it (:data:`USER_FILES`);
* Flower's home and the local SuperLink's ports are this module's own (stopped at the end).

The command goes to ``bash -c`` as the page writes it (its ``cd``, quotes and ``$PWD``), with
one argument appended to a ``fedcybgd run`` so that it costs seconds instead of hours:
``--run-config "<overrides>"``, a second run config that Flower merges over the page's. The
overrides are only about size and length:

* always, replacing the page's value if it sets one: ``model='tiny-llama'``,
  ``num-server-rounds=1``, ``local-steps=2``, ``eval-examples=16``;
* only where the page sets none (a value the page sets is kept): ``batch-size=4``,
  ``eval-batch-size=16``, ``max-seq-len=48``, ``max-new-tokens=8``;
* of these, only the keys the app has (its ``pyproject.toml``): an example's own app, which
  names fewer keys, would refuse the others.

Every other key the page sets is the run's (checked in its ``summary.json``). A ``fedcybgd run``
passes when it exits 0 (the run finished:completed) and the folder the launcher names
(``fedcybgd: outputs: DIR``) is a new one inside the scratch copy, not the demo's, holding a
``summary.json`` with ``"status": "completed"`` (a ServerApp of the user's own, which writes
files of its own: holding files); any other command passes when it exits 0.

A command a test cannot run (a remote SuperLink, a server that runs until stopped, a synopsis
with options to choose) is in :data:`SKIP` with the reason, and is reported as skipped. A
command that is neither is run, so a new command on a page is tested as soon as it is written;
an entry of :data:`SKIP` no longer on its page fails
(:func:`test_every_skipped_command_is_still_on_its_page`).
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import signal
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.common.config import parse_config_args

from tests.cli.test_run_where_typed import BIN, ROOT, documented_runs, page_commands, private_env
from tests.deploy.test_commands import stop_gracefully

# Replace the page's value (model, rounds, steps, evaluation size).
FORCED = {"model": "'tiny-llama'", "num-server-rounds": "1", "local-steps": "2",
          "eval-examples": "16"}
# Only where the page sets none.
IF_UNSET = {"batch-size": "4", "eval-batch-size": "16", "max-seq-len": "48",
            "max-new-tokens": "8"}
COMMAND_TIMEOUT_S = 600  # below pytest-timeout's 900 s (pyproject.toml), so Ctrl-C comes first
FEDCYBGD_SERVERAPP = "fedcybgd.server.app:app"

# (page, command as extracted, whitespace runs made one space): why a test cannot run it.
SKIP: dict[tuple[str, str], str] = {
    ("README.md", "fedcybgd node --superlink link.example.org:9092 --root-certificates ca.crt "
                  "--auth-key node_key --data my_data.jsonl --memory-budget-mb 1500"):
        "joins a deployed SuperLink (link.example.org) with its CA certificate and a node key "
        "the operator registered",
    ("docs/deploy.md", ".venv/bin/fedcybgd deploy-local --nodes 3 [--tls] [--quick] "
                       "[--run-config \"...\"] [--output-dir DIR] [--state-dir DIR] "
                       "[--timeout S] [--node-image IMAGE [--node-platform linux/arm64] "
                       "[--node-memory 1.5g]]"):
        "a synopsis (options in brackets to choose from), not a command; the deployment it "
        "starts is tests/deploy/test_deploy.py's",
    ("docs/deploy.md", "fedcybgd gateway --host 0.0.0.0 --port 9092 --upstream 127.0.0.1:8000 "
                       "--ssl-ca-certfile certs/ca.crt --ssl-certfile certs/server.pem "
                       "--ssl-keyfile certs/server.key"):
        "a server that runs until stopped, on port 9092 of every interface, in front of the TLS "
        "SuperLink of the line above it (port 8000); the gateway is "
        "tests/deploy/test_fleet_auth.py's",
    ("docs/deploy.md", "OMP_NUM_THREADS=4 fedcybgd node --superlink link.example.org:9092 "
                       "--root-certificates ~/.fedcybgd/ca.crt --auth-key ~/.fedcybgd/node_key "
                       "--partition-id 4 --num-partitions 10 --cache-dir ~/.cache/fedcybgd-node "
                       "--update-rule lezo --memory-budget-mb 1500"):
        "joins a deployed SuperLink (link.example.org) with its CA certificate and a node key "
        "the operator registered",
    ("docs/deploy.md", ".venv-executorch/bin/fedcybgd node --superlink link.example.org:9092 "
                       "--root-certificates ~/.fedcybgd/ca.crt --auth-key ~/.fedcybgd/node_key "
                       "--trainer executorch"):
        "joins a deployed SuperLink (link.example.org) with its CA certificate and a node key "
        "the operator registered; an ExecuTorch node on real SuperNodes is "
        "tests/client/updates/test_fo_program.py's",
}

_FEDCYBGD = re.compile(r"^(?:cd \S+ && )?(?:[A-Z_]+=\S* )*\S*\bfedcybgd\s")


def _one_line(command: str) -> str:
    return " ".join(command.split())


def documented_commands() -> list[tuple[str, str]]:
    """Every ``fedcybgd`` command of the pages' bash blocks, in page order: ``(page,
    command)``, continuation lines joined."""
    return page_commands(_FEDCYBGD.pattern)


def _words(command: str, folder: Path) -> tuple[Path, list[str]]:
    """The folder ``command`` runs in (after its ``cd``) and its words, as bash reads them
    (``$PWD`` is that folder)."""
    if (cd := re.match(r"cd (\S+) && (.*)", command, flags=re.S)) is not None:
        folder, command = folder / cd.group(1), cd.group(2)
    if re.search(r"\$(?!PWD\b)", command):
        pytest.fail(f"only $PWD is expanded here: {command}")
    return folder, shlex.split(command.replace("$PWD", str(folder)))


def _page_run_config(words: list[str]) -> dict[str, object]:
    values = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--run-config"]
    return dict(parse_config_args(values))


def flower_app(app: Path) -> dict[str, Any]:
    """The ``[tool.flwr.app]`` table of the Flower app in ``app``."""
    return dict(tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"])


def overrides(page_config: dict[str, object], known: set[str]) -> str:
    """The run config appended to a documented ``fedcybgd run`` of an app with the keys
    ``known``."""
    tiny = {**{k: v for k, v in IF_UNSET.items() if k not in page_config}, **FORCED}
    return " ".join(f"{key}={value}" for key, value in tiny.items() if key in known)


# --------------------------------------------------------------- the user's own files
def _topics_csv(path: Path) -> None:
    # topics.csv: sentence,topic   ("Stocks fell sharply",politics)
    said = {"sports": ["The team won the final", "A striker scored twice", "The race ended"],
            "politics": ["Stocks fell sharply", "The senate passed the bill", "Voters went out"],
            "science": ["A new comet was seen", "The cells divided fast", "Lab mice slept"]}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence", "topic"])
        for i in range(20):
            for topic, sentences in said.items():
                writer.writerow([f"{sentences[i % 3]} on day {i}", topic])


def _jsonl(rows: list[dict[str, object]]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return write


def _books(path: Path) -> None:
    # books/: one .txt file a book; nodes get whole books
    path.mkdir()
    for book in range(8):
        lines = [f"Chapter {line // 10 + 1}, line {line}: the traveller of book {book} walked "
                 f"on past the {['mill', 'river', 'church', 'market'][line % 4]}."
                 for line in range(150)]
        (path / f"book{book}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


_CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Peru", "Lima"),
             ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Chile", "Santiago")]
USER_FILES: dict[str, Callable[[Path], None]] = {
    "topics.csv": _topics_csv,
    # sft.jsonl: {"prompt": "Capital of France?", "response": "Paris."}
    "sft.jsonl": _jsonl([{"prompt": f"Capital of {country}? ({i})", "response": f"{city}."}
                         for i in range(8) for country, city in _CAPITALS]),
    # chat.jsonl: {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", ...}]}
    "chat.jsonl": _jsonl([{"messages": [{"role": "user", "content": f"Capital of {country}? "
                                                                     f"({i})"},
                                        {"role": "assistant", "content": f"{city}."}]}
                          for i in range(8) for country, city in _CAPITALS]),
    "books": _books,
    # notes.jsonl: {"body": "..."}
    "notes.jsonl": _jsonl([{"body": f"Note {i}: bought bread, called {city}'s office, "
                                    f"wrote to the {country} desk."}
                           for i in range(25) for country, city in _CAPITALS]),
    # mc.jsonl: {"question": "2+2?", "options": ["3", "4"], "answer": 1}
    "mc.jsonl": _jsonl([{"question": f"{a}+{b}?", "options": [str(a + b + 1), str(a + b)],
                         "answer": 1} for a in range(8) for b in range(8)]),
}


def user_files_named(command: str, folder: Path) -> list[str]:
    """The files under ``folder`` that ``command`` names by ``$PWD/NAME`` and the project
    does not hold: the user's own."""
    if (cd := re.match(r"cd (\S+) && ", command)) is not None:
        folder = folder / cd.group(1)
    return [name for name in re.findall(r"\$PWD/([\w.-]+)", command)
            if not (folder / name).exists() and name != "outputs"]


# --------------------------------------------------------------- the scratch clone
@pytest.fixture(scope="module")
def after_the_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The project's tracked files copied into a scratch folder, the venv as its ``.venv``,
    ``outputs/demo`` taken, the user's files beside them; a private Flower home and ports."""
    from fedcybgd.cli.demo import stop_local_superlink

    base = tmp_path_factory.mktemp("docs")
    clone, home = base / "fedcybgd", base / "flwr-home"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                            check=False)
    if listed.returncode != 0:
        pytest.fail(f"the project is not a git checkout: {listed.stderr.decode()}")
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():  # a file deleted in the working tree is left out
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    (clone / ".venv").symlink_to(BIN.parent, target_is_directory=True)
    if (ROOT / ".venv-executorch").is_dir():  # make test-docs builds it (make executorch)
        (clone / ".venv-executorch").symlink_to(ROOT / ".venv-executorch",
                                                target_is_directory=True)
    (clone / "outputs" / "demo").mkdir(parents=True)
    (clone / "outputs" / "demo" / "summary.json").write_text('{"status": "completed"}')
    for name, write in USER_FILES.items():
        write(clone / name)
    env = private_env(home)
    env.update(VIRTUAL_ENV=str(BIN.parent), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    yield {"clone": clone, "env": env}
    stop_local_superlink(home)


def typed(command: str, clone: Path, env: dict[str, str]) -> tuple[int, str]:
    """``command`` typed into bash in ``clone``: its exit status and output. A command still
    running after :data:`COMMAND_TIMEOUT_S` gets Ctrl-C (then SIGKILL) and fails."""
    proc = subprocess.Popen(["bash", "-c", command], cwd=clone, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        output, _ = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_gracefully(proc)
        output, _ = proc.communicate()
        pytest.fail(f"still running after {COMMAND_TIMEOUT_S} s: {command}\n{output[-4000:]}")
    return proc.returncode, output


# --------------------------------------------------------------- the tests
def test_the_run_commands_are_those_the_launcher_s_test_reads():
    runs = [(page, _one_line(command)) for page, command in documented_commands()
            if re.search(r"\bfedcybgd run ", command)]
    assert runs == [(page, _one_line(command)) for page, command in documented_runs()]


def test_every_skipped_command_is_still_on_its_page():
    shown = {(page, _one_line(command)) for page, command in documented_commands()}
    assert [entry for entry in SKIP if entry not in shown] == []


def test_every_file_of_the_user_s_a_command_names_has_a_stand_in():
    # A new $PWD/NAME on a page needs a file in USER_FILES, in the format the page gives
    named = {name for _, command in documented_commands()
             for name in user_files_named(command, ROOT)}
    assert named - set(USER_FILES) == set()


@pytest.mark.docs
@pytest.mark.slow
@pytest.mark.parametrize(("page", "command"), [
    pytest.param(page, command, id=f"{page}-{n}")
    for n, (page, command) in enumerate(documented_commands())])
def test_a_documented_command_runs_as_written_after_the_demo(page, command, after_the_demo):
    # Prepare
    if (reason := SKIP.get((page, _one_line(command)))) is not None:
        pytest.skip(reason)
    clone, env = after_the_demo["clone"], after_the_demo["env"]
    assert isinstance(clone, Path) and isinstance(env, dict)
    folder, words = _words(command, clone)
    program = next(i for i, word in enumerate(words) if not re.match(r"[A-Z_]+=", word))
    is_run = words[program + 1:program + 2] == ["run"]
    page_config: dict[str, object] = {}
    command_line = command
    if is_run:  # the tiny model's run config after the page's
        page_config = _page_run_config(words)
        app = flower_app(folder / words[program + 2])
        command_line += f" --run-config {shlex.quote(overrides(page_config, set(app['config'])))}"
    # Execute
    status, output = typed(command_line, clone, env)
    # Assert: exit 0; a run completed in the folder the launcher named, a new one in the clone
    assert status == 0, f"{page}: {command}\nexit {status}\n{output[-6000:]}"
    if not is_run:
        return
    named = re.findall(r"^fedcybgd: outputs: (.+)$", output, flags=re.M)
    assert len(named) == 1, output[-4000:]
    out = Path(named[0])
    assert out.is_relative_to(folder) and out != clone / "outputs" / "demo", out
    if app["components"]["serverapp"] != FEDCYBGD_SERVERAPP:  # a ServerApp of the user's own
        assert any(out.iterdir()), out
        return
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["run_config"]["model"] == "tiny-llama"
    kept = {k: v for k, v in page_config.items() if k not in FORCED and k != "output-dir"}
    assert {k: summary["run_config"].get(k) for k in kept} == kept
