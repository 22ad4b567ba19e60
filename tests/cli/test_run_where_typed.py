"""``fedcybgd run`` puts a run's outputs where the user typed the command, in this environment.

Through the console entry point a user types, from folders other than the project and other
than the one the local SuperLink was started from: a relative ``output-dir`` lands in the
folder the command was typed in, and the launcher says where; without ``output-dir`` a run
does not collide with the demo's outputs; a run that fails at its start leaves no folder; a run
needing more nodes than the simulation has, or a folder holding another run, is refused before
anything starts; a local SuperLink of another environment is refused. In process: each
environment gets a local SuperLink of its own, and ``deploy-local`` takes a relative
``output-dir`` from where it was typed too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcybgd.cli import build_parser
from fedcybgd.cli.launch import Launch, local_superlink, prepare

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ("model='tiny-llama' partitioner='iid' num-server-rounds=1 clients-per-round=2 "
        "clients-per-block=1 layers-per-block=1 local-steps=2 batch-size=4 max-seq-len=48 "
        "eval-examples=16 eval-every=0")
NODES = "num-supernodes=2 client-resources-num-cpus=1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def private_env(home: Path) -> dict[str, str]:
    """The user's environment with a private Flower home and local-SuperLink ports (the
    SuperLink is this test's alone) and no output root: relative paths are the launcher's."""
    env = {k: v for k, v in os.environ.items() if k != "FEDCYBGD_OUTPUT_ROOT"}
    env.update(FLWR_HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
               FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()))
    return env


def fedcybgd(env: dict[str, str], cwd: Path, *args: str,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The console entry point, typed in ``cwd``."""
    return subprocess.run([str(BIN / "fedcybgd"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def said(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout[-4000:] + done.stderr[-4000:]


@pytest.fixture(scope="module")
def started_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """A private local SuperLink started from folder ``first`` (``flwr ls`` starts it), as the
    first command of a session does; stopped at the end."""
    from fedcybgd.cli.demo import stop_local_superlink

    base = tmp_path_factory.mktemp("typed")
    home, first = base / "flwr-home", base / "first"
    first.mkdir()
    env = private_env(home)
    listed = subprocess.run([str(BIN / "flwr"), "ls", "local"], cwd=first, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    yield {"env": env, "first": first, "base": base}
    stop_local_superlink(home)


@pytest.mark.slow
def test_a_relative_output_dir_lands_in_the_folder_the_command_was_typed_in(started_elsewhere):
    # Prepare: a folder of the user's own, not the project, not the SuperLink's
    env, first = started_elsewhere["env"], started_elsewhere["first"]
    here = started_elsewhere["base"] / "mine"
    here.mkdir()
    # Execute
    done = fedcybgd(env, here, "run", str(ROOT), "local", "--run-config",
                    f"{TINY} output-dir='outputs/run1'", "--federation-config", NODES)
    # Assert: completed, its outputs under the folder it was typed in, said at the start
    assert done.returncode == 0, said(done)
    out = here / "outputs" / "run1"
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    assert not (first / "outputs").exists()
    assert f"fedcybgd: outputs: {out}" in done.stdout.splitlines()


@pytest.mark.slow
def test_without_output_dir_a_run_takes_a_fresh_folder_beside_the_demo_s(started_elsewhere):
    # Prepare: `make demo` has filled outputs/demo, the app's default output-dir
    env = started_elsewhere["env"]
    here = started_elsewhere["base"] / "after-demo"
    demo = here / "outputs" / "demo"
    demo.mkdir(parents=True)
    (demo / "summary.json").write_text('{"status": "completed"}')
    # Execute: a newcomer's command, no output-dir
    done = fedcybgd(env, here, "run", str(ROOT), "local", "--run-config", TINY,
                    "--federation-config", NODES)
    # Assert: completed in a new folder beside the demo's, named at the start; the demo's kept
    assert done.returncode == 0, said(done)
    fresh = [p for p in (here / "outputs").iterdir() if p.name != "demo"]
    assert len(fresh) == 1 and fresh[0].name.startswith("demo-")
    assert json.loads((fresh[0] / "summary.json").read_text())["status"] == "completed"
    assert [p.name for p in demo.iterdir()] == ["summary.json"]
    assert f"fedcybgd: outputs: {fresh[0]}" in done.stdout.splitlines()
    assert "overwrite=true" in done.stdout  # how to reuse the demo's folder instead


@pytest.mark.slow
def test_a_run_that_fails_at_its_start_leaves_no_output_folder(started_elsewhere):
    # Prepare: a device no machine has (the ServerApp fails after judging its folder)
    env = started_elsewhere["env"]
    parent = started_elsewhere["base"] / "never"
    out = parent / "run"
    # Execute
    done = fedcybgd(env, started_elsewhere["base"], "run", str(ROOT), "local", "--run-config",
                    f"{TINY} device='cuda:99' output-dir='{out}'",
                    "--federation-config", NODES)
    # Assert: failed, and neither the folder nor the parent it needed is left
    assert done.returncode == 1, said(done)
    assert "cuda:99" in done.stderr
    assert not parent.exists()


@pytest.mark.slow
def test_an_output_dir_holding_another_run_is_refused_before_the_run_starts(
        started_elsewhere):
    # Prepare: the folder, relative to where the user is, holds a run's outputs
    env = started_elsewhere["env"]
    here = started_elsewhere["base"] / "taken"
    (here / "outputs" / "run1").mkdir(parents=True)
    (here / "outputs" / "run1" / "summary.json").write_text("{}")
    # Execute
    started = time.monotonic()
    done = fedcybgd(env, here, "run", str(ROOT), "local", "--run-config",
                    f"{TINY} output-dir='outputs/run1'", "--federation-config", NODES,
                    timeout=60)
    # Assert: refused at once, naming the folder and the override to type; nothing submitted
    assert done.returncode == 1, said(done)
    assert time.monotonic() - started < 30
    assert str(here / "outputs" / "run1") in done.stderr
    assert '--run-config "overwrite=true"' in done.stderr
    assert "Successfully started run" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("run_config", "federation", "wanted", "have"), [
    ("", [], 4, 2),  # the app's clients-per-round, Flower's default simulation
    ("clients-per-round=3", ["--federation-config", "num-supernodes=2"], 3, 2),
])
def test_a_run_needing_more_nodes_than_the_simulation_has_is_refused_at_once(
        tmp_path, run_config, federation, wanted, have):
    # Prepare
    from fedcybgd.cli.demo import stop_local_superlink

    env = private_env(tmp_path / "flwr-home")
    out = tmp_path / "out"
    # Execute
    started = time.monotonic()
    try:
        done = fedcybgd(env, tmp_path, "run", str(ROOT), "local", "--run-config",
                        f"model='tiny-llama' output-dir='{out}' {run_config}", *federation,
                        timeout=60)
    finally:
        stop_local_superlink(tmp_path / "flwr-home")  # none, unless it was not refused
    # Assert: refused in seconds with the fix to type; no SuperLink, no folder
    assert done.returncode == 1, said(done)
    assert time.monotonic() - started < 30
    assert f"clients-per-round = {wanted}" in done.stderr and f"{have} SuperNodes" in done.stderr
    assert f'--federation-config "num-supernodes={wanted}"' in done.stderr
    assert not out.exists() and not (tmp_path / "flwr-home" / "local-superlink").exists()


@pytest.mark.slow
def test_a_local_superlink_of_another_environment_is_refused(tmp_path):
    # Prepare: another checkout's flower-superlink (a copy of this one in another folder)
    # started as the local SuperLink of these ports
    from fedcybgd.cli.demo import stop_local_superlink

    other = tmp_path / "other" / ".venv" / "bin"
    other.mkdir(parents=True)
    shutil.copy2(BIN / "flower-superlink", other / "flower-superlink")
    env = private_env(tmp_path / "flwr-home")
    try:
        listed = subprocess.run([str(BIN / "flwr"), "ls", "local"], cwd=tmp_path,
                                env={**env, "PATH": f"{other}{os.pathsep}{env['PATH']}"},
                                capture_output=True, text=True, timeout=120, check=False)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        # Execute
        done = fedcybgd(env, tmp_path, "run", str(ROOT), "local", "--run-config",
                        f"{TINY} output-dir='{tmp_path / 'out'}'", "--federation-config",
                        NODES, timeout=120)
    finally:
        stop_local_superlink(tmp_path / "flwr-home")
    # Assert: refused, naming the other environment's SuperLink and how to get past it
    assert done.returncode == 1, said(done)
    assert str(other / "flower-superlink") in done.stderr
    assert "kill " in done.stderr
    assert "Successfully started run" not in done.stdout


def test_each_environment_gets_a_local_superlink_of_its_own(tmp_path, monkeypatch):
    # Prepare: no Flower home or ports of the user's; two checkouts' environments
    monkeypatch.setenv("HOME", str(tmp_path))
    env = {"FEDCYBGD_CACHE": str(tmp_path / "cache")}
    bins = [tmp_path / name / ".venv" / "bin" for name in ("a", "b")]
    # Execute
    a, b, again = (local_superlink(Launch(superlink="local"), dict(env), bin_dir=d)
                   for d in (*bins, bins[0]))
    # Assert: homes and ports of their own, the same each time; the home outside the project
    assert a is not None and b is not None and again is not None
    assert a.home != b.home and a.home.is_relative_to(tmp_path / "cache")
    assert {a.http_port, a.control_port}.isdisjoint({b.http_port, b.control_port})
    assert (again.home, again.http_port, again.control_port) == \
        (a.home, a.http_port, a.control_port)
    assert a.env == {"FLWR_HOME": str(a.home),
                     "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(a.http_port),
                     "FLWR_LOCAL_CONTROL_API_PORT": str(a.control_port)}


def test_the_simulation_s_default_size_is_flower_s():
    from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

    from fedcybgd.cli.launch import FLOWER_DEFAULT_SUPERNODES

    assert DEFAULT_SIMULATION_CONFIG.num_supernodes == FLOWER_DEFAULT_SUPERNODES


def test_a_flower_home_and_ports_the_user_set_are_kept(tmp_path):
    # Prepare
    env = {"FLWR_HOME": str(tmp_path / "home"), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "31001",
           "FLWR_LOCAL_CONTROL_API_PORT": "31002"}
    # Execute
    local = local_superlink(Launch(superlink="local"), dict(env), bin_dir=tmp_path / "bin")
    # Assert
    assert local is not None and local.env == {}
    assert (local.home, local.http_port, local.control_port) == (tmp_path / "home", 31001, 31002)


def test_a_superlink_at_an_address_of_its_own_is_left_to_its_operator(tmp_path):
    # Prepare: a connection to a deployed SuperLink
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "prod"\n\n[superlink.prod]\n'
                                      'address = "10.0.0.5:9093"\ninsecure = true\n')
    # Execute, Assert
    assert local_superlink(Launch(), {"FLWR_HOME": str(home)}, bin_dir=tmp_path) is None


def test_deploy_local_takes_a_relative_output_dir_from_where_it_was_typed(tmp_path, monkeypatch):
    # Prepare
    from fedcybgd.deploy.local import output_dir_of

    monkeypatch.delenv("FEDCYBGD_OUTPUT_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    # Execute, Assert
    assert output_dir_of("output-dir='outputs/x'", ROOT / "unused") == \
        tmp_path.resolve() / "outputs" / "x"
    assert output_dir_of("", Path("elsewhere")) == tmp_path.resolve() / "elsewhere"


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]


def page_commands(first_line: str) -> list[tuple[str, str]]:
    """Every command of the pages' bash blocks whose first line matches ``first_line`` (a
    regular expression), in page order: ``(page, command)``, the command's continuation lines
    joined (a ``\\`` at the end, or a quote still open)."""
    commands = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            command = ""
            for line in block.replace("\\\n", " ").split("\n"):
                if command:
                    command += "\n" + line
                elif re.match(first_line, line):
                    command = line
                else:
                    continue
                try:
                    shlex.split(command)
                except ValueError:  # a quote still open: the command goes on
                    continue
                commands.append((page.relative_to(ROOT).as_posix(), command))
                command = ""
    return commands


def documented_runs() -> list[tuple[str, str]]:
    """Every ``fedcybgd run`` command of the pages' bash blocks: ``(page, command)``."""
    return page_commands(r"^(cd \S+ && )?\S*fedcybgd run ")


def test_the_pages_run_the_app_on_the_local_superlink_through_fedcybgd_run():
    # Plain `flwr run` exits 0 while a run fails, and uses Flower's SuperLink for the machine
    plain = [(page.name, line) for page in PAGES
             for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
             for line in block.splitlines() if re.match(r"^\s*flwr run \S+ local\b", line)]
    assert plain == []


@pytest.mark.parametrize(("page", "command"), [
    pytest.param(page, command, id=f"{page}-{n}")
    for n, (page, command) in enumerate(documented_runs())])
def test_a_documented_command_passes_the_launcher_s_checks_after_the_demo(
        page, command, tmp_path, monkeypatch):
    # Prepare: the folder it is typed in after `make demo` (outputs/demo taken), the app's
    # folder as the page says, a private Flower home and ports
    here = tmp_path / "typed-here"
    (here / "outputs" / "demo").mkdir(parents=True)
    (here / "outputs" / "demo" / "summary.json").write_text("{}")
    folder, line = ROOT, command
    if (cd := re.match(r"cd (\S+) && (.*)", command, flags=re.S)) is not None:
        folder, line = ROOT / cd.group(1), cd.group(2)
    args = build_parser().parse_args(shlex.split(line.replace("$PWD", str(here)))[1:])
    monkeypatch.chdir(folder)
    env = private_env(tmp_path / "flwr-home")
    run = Launch(app=args.app, superlink=args.superlink, run_config=args.run_config,
                 federation_config=args.federation_config, federation=args.federation)
    # Execute: everything the launcher decides before flwr run (nodes, output folder)
    submission = prepare(run, env, cwd=here)
    # Assert: its own SuperLink, enough nodes, a folder of its own under where it was typed
    assert submission.local is not None, (page, command)
    assert submission.output_dir is not None and submission.output_dir.is_relative_to(here)
    assert submission.output_dir != here / "outputs" / "demo"
