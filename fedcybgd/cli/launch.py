"""``fedcybgd run``: ``flwr run --stream`` with an exit status that tells the truth.

``flwr run APP SUPERLINK --stream`` exits 0 once the log stream ends, whether the run completed
or its ServerApp raised. This launcher runs it, prints its output as it comes (and saves it),
then asks the SuperLink for the run's final status (``flwr ls SUPERLINK --run-id ID --format
json``) and exits with :data:`EXIT_CODES`'s status. A failed run prints the line that says why
(:func:`fedcybgd.deploy.diagnose.failure_line`); a run the SuperLink refused to start prints the
SuperLink's reason and, for a misspelt run-config key, the closest key the app has. Before
Flower starts anything, the app's run config with the overrides and its model are checked
(:func:`fedcybgd.cli.precheck.launch_refusal`): a value of the wrong type or a model no one
could load is one line and exit status 2.

On Flower's managed local SuperLink (a connection whose address is ``:local:``, e.g. ``local``)
the launcher also sees to what it alone knows before a run is submitted (:func:`prepare`):

* **the environment**: each Python environment (the folder of this ``python``: a checkout's
  venv) has a local SuperLink of its own, with a Flower home under
  ``~/.cache/fedcybgd/flwr-local/`` and a pair of ports of its own, unless ``FLWR_HOME`` or the
  ports (``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``, ``FLWR_LOCAL_CONTROL_API_PORT``) are set. A
  SuperLink on those ports that runs another environment's ``flower-superlink`` is refused: the
  run would execute with that environment's packages;
* **the output folder**: a relative ``output-dir`` is taken from the folder the command was
  typed in (or ``$FEDCYBGD_OUTPUT_ROOT``) and goes to the ServerApp as that absolute path, named
  at the start. Without ``output-dir`` on the command line, a run whose default folder holds an
  earlier run gets a fresh one beside it (``outputs/demo-20250101-120000``); an ``output-dir``
  given that holds an earlier run is refused unless ``resume`` or ``overwrite`` says what to do.
  A run that fails leaves no folder it created and wrote nothing to;
* **the nodes**: a run that needs more nodes (``clients-per-round``, pipeline mode's
  ``pipeline-stages``) than the simulation starts is refused with the ``--federation-config``
  to type, instead of waiting for nodes that never come.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import click
import psutil
from flwr.common.config import flatten_dict, parse_config_args

from fedcybgd.deploy.commands import format_config, toml_value
from fedcybgd.deploy.diagnose import (
    LOCAL_ADDRESSES,
    app_config_keys,
    failure_line,
    flower_home,
    local_superlink_log,
    plain,
    superlink_address,
    superlink_errors,
    unknown_key_hints,
)
from fedcybgd.server.output_dir import (
    earlier_outputs,
    first_missing,
    holds_files,
    name_entries,
    output_dir_refusal,
    resolve_output_dir,
)

COMPLETED = "finished:completed"
EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGUMENTS, EXIT_UNKNOWN, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = ((EXIT_OK, "the run finished:completed"),
              (EXIT_FAILED, "the run failed or was stopped, or no run was started"),
              (EXIT_BAD_ARGUMENTS, "bad arguments, or a run config or model that cannot work "
                                   "(named before anything starts)"),
              (EXIT_UNKNOWN, "the run's final status could not be read"),
              (EXIT_INTERRUPTED, "interrupted (the run goes on unless --stop-on-interrupt)"))
STATUS_WAIT_S = 60.0  # how long to wait for "finished" once the log stream has ended
KEEP_LINES = 5000  # the last lines of the log kept in memory for the diagnosis
_RUN_ID = re.compile(r"(?:Successfully started run |logstream for run_id `?)(\d+)")
HTTP_PORT_ENV = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"  # Flower's, for its managed SuperLink
CONTROL_PORT_ENV = "FLWR_LOCAL_CONTROL_API_PORT"
# An environment's own pair of ports (HTTP API, Control API) is PORTS_FROM + 2k (and + 1),
# k < PORT_PAIRS: below Linux's ephemeral ports (32768-60999) and Flower's defaults (39091/3).
PORTS_FROM, PORT_PAIRS = 21000, 4000
# How many SuperNodes Flower's local simulation starts when told nothing
# (flwr.supercore.constant.DEFAULT_SIMULATION_CONFIG; a test compares).
FLOWER_DEFAULT_SUPERNODES = 2


@dataclass
class Launch:
    """What to run: ``flwr run``'s arguments (see ``fedcybgd run --help``)."""

    app: str = "."
    superlink: str | None = None
    run_config: list[str] = field(default_factory=list)
    federation_config: list[str] = field(default_factory=list)
    federation: str | None = None
    log_dir: str | None = None
    stop_on_interrupt: bool = False  # Ctrl-C stops the submitted run too (else it goes on)
    env: dict[str, str] = field(default_factory=dict)  # set for flwr and what it starts

    def environment(self) -> dict[str, str]:
        """The environment ``flwr`` runs in: this process's, with :attr:`env` on top."""
        return {**os.environ, **self.env}

    def flwr_args(self, run_config: list[str] | None = None) -> list[str]:
        """``flwr``'s arguments for this run: ``run APP [SUPERLINK] --stream ...``, with
        ``run_config`` in place of :attr:`run_config` when given."""
        args = ["run", self.app, *([self.superlink] if self.superlink else []), "--stream"]
        for value in self.run_config if run_config is None else run_config:
            args += ["--run-config", value]
        for value in self.federation_config:
            args += ["--federation-config", value]
        if self.federation:
            args += ["--federation", self.federation]
        return args


def flwr_executable() -> str:
    """``flwr`` beside this Python (a virtualenv), else the one on PATH."""
    local = Path(sys.executable).with_name("flwr")
    return str(local) if local.exists() else (shutil.which("flwr") or "flwr")


def say(message: str, out: TextIO | None = None) -> None:
    """A line of the launcher's own, marked as such."""
    print(f"fedcybgd: {message}", file=out or sys.stdout, flush=True)


@dataclass
class Streamed:
    """What ``flwr run`` printed: the run id (if a run started), its exit code, the log."""

    run_id: str | None
    returncode: int
    lines: deque[str]
    log_path: Path
    interrupted: bool = False


def stream(command: list[str], log_path: Path,
           base_env: dict[str, str] | None = None) -> Streamed:
    """Run ``command``, copying its output (stderr merged) to stdout and to ``log_path``.

    A ``KeyboardInterrupt`` ends the command (SIGTERM, then SIGKILL) and returns what was
    read so far, with ``interrupted`` set.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result = Streamed(None, 0, deque(maxlen=KEEP_LINES), log_path)
    # flwr starts the managed local SuperLink by name: the one beside flwr, without
    # activating its virtualenv (`.venv/bin/fedcybgd run ...`)
    base = dict(os.environ if base_env is None else base_env)
    path = os.pathsep.join([str(Path(command[0]).parent), base.get("PATH", "")])
    env = {**base, "PYTHONUNBUFFERED": "1", "PATH": path}
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, encoding="utf-8", errors="replace", env=env)
        assert proc.stdout is not None  # stdout=PIPE
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(plain(line))
                result.lines.append(line.rstrip("\n"))
                if result.run_id is None and (match := _RUN_ID.search(plain(line))):
                    result.run_id = match.group(1)
        except KeyboardInterrupt:
            result.interrupted = True
            proc.terminate()
        try:
            result.returncode = proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            result.returncode = proc.wait()
        proc.stdout.close()
    return result


def stop_run(run_id: str, superlink: str | None, env: dict[str, str] | None = None) -> str:
    """``flwr stop RUN_ID [SUPERLINK]``; returns what went wrong, or ``""``."""
    args = ["stop", run_id, *([superlink] if superlink else []), "--format", "json"]
    try:
        done = subprocess.run([flwr_executable(), *args], capture_output=True, text=True,
                              timeout=60, check=False, env=env)
        reply = read_json(done.stdout)
    except (ValueError, OSError, subprocess.SubprocessError) as err:
        return f"{type(err).__name__}: {err}"
    return "" if reply.get("success") else str(reply.get("error-message", reply))


def read_json(text: str) -> Any:
    """The first JSON object in ``text`` (``flwr --format json`` may print other lines)."""
    start = text.find("{")
    while start != -1:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise ValueError(f"no JSON object in: {text[-500:]!r}")


def run_record(run_id: str, superlink: str | None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """The run's entry of ``flwr ls [SUPERLINK] --run-id ID --format json``."""
    args = ["ls", *([superlink] if superlink else []), "--run-id", run_id, "--format", "json"]
    done = subprocess.run([flwr_executable(), *args], capture_output=True, text=True,
                          timeout=120, check=False, env=env)
    reply = read_json(done.stdout)
    runs = reply.get("runs") or []
    if not reply.get("success", True) or not runs:
        raise ValueError(f"flwr {' '.join(args)}: {reply.get('error-message', reply)}")
    return dict(runs[0])


def final_status(run_id: str, superlink: str | None, wait_s: float = STATUS_WAIT_S,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """The run's record once its status starts with ``finished`` (or after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        record = run_record(run_id, superlink, env)
        if str(record.get("status", "")).startswith("finished") or \
                time.monotonic() >= deadline:
            return record
        time.sleep(1.0)


def log_dir_of(launch: Launch, env: Mapping[str, str] | None = None) -> Path:
    """Where full logs are saved (``env``: flwr's environment, default the launch's)."""
    return Path(launch.log_dir) if launch.log_dir else \
        flower_home(launch.environment() if env is None else env) / "fedcybgd-logs"


# -- the managed local SuperLink of this environment -----------------------------------------
@dataclass(frozen=True)
class LocalSuperLink:
    """The managed local SuperLink a run goes to: its Flower home and ports, the environment
    it must run from (the folder of its ``flower-superlink``), the number of SuperNodes the
    connection's deprecated ``options.num-supernodes`` asks for, and ``env``: the variables
    this launcher chose for flwr (what the user set is kept and not listed)."""

    home: Path
    http_port: int
    control_port: int
    bin_dir: Path
    options_supernodes: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def log(self) -> Path:
        """The SuperLink's log file (Flower's place for it)."""
        return self.home / "local-superlink" / "superlink.log"

    def flwr(self, args: str) -> str:
        """A ``flwr`` command line that reaches this SuperLink when typed in a shell."""
        prefix = "".join(f"{key}={shlex.quote(value)} " for key, value in self.env.items())
        return f"{prefix}flwr {args}"


def environment_bin() -> Path:
    """This environment's folder of executables (``flower-superlink`` is there)."""
    return Path(sys.executable).absolute().parent


def fedcybgd_cache(env: Mapping[str, str]) -> Path:
    """fedcybgd's cache folder: ``$FEDCYBGD_CACHE``, else ``~/.cache/fedcybgd`` (as
    :func:`fedcybgd.model.loading.cache_root`, without importing the model code)."""
    return Path(env.get("FEDCYBGD_CACHE") or Path.home() / ".cache" / "fedcybgd").expanduser()


def environment_ports(home: Path) -> tuple[int, int]:
    """The ports (HTTP API, Control API) of the local SuperLink whose Flower home is ``home``."""
    pair = int(hashlib.sha256(str(home).encode()).hexdigest(), 16) % PORT_PAIRS
    return PORTS_FROM + 2 * pair, PORTS_FROM + 2 * pair + 1


def local_superlink(launch: Launch, env: Mapping[str, str],
                    bin_dir: Path | None = None) -> LocalSuperLink | None:
    """The managed local SuperLink ``launch`` goes to, in the environment of ``bin_dir``
    (default: this one); ``None`` when its connection has an address of its own (a SuperLink
    its operator runs). Writes nothing.

    Without ``FLWR_HOME`` in ``env`` the Flower home is the environment's own (under
    :func:`fedcybgd_cache`), without the port variables the ports are the home's own
    (:func:`environment_ports`).

    Raises
    ------
    click.ClickException
        A port variable that is not a port number.
    """
    bin_dir = bin_dir or environment_bin()
    user_home = flower_home(env)
    config = user_home / "config.toml"
    address = superlink_address(user_home, launch.superlink)
    if address is None and not config.is_file() and launch.superlink in (None, "local"):
        address = LOCAL_ADDRESSES[0]  # flwr writes a configuration whose "local" is this
    if address not in LOCAL_ADDRESSES:
        return None
    chosen: dict[str, str] = {}
    home = user_home
    if not env.get("FLWR_HOME"):
        digest = hashlib.sha256(str(bin_dir).encode()).hexdigest()[:12]
        home = fedcybgd_cache(env) / "flwr-local" / digest
        chosen["FLWR_HOME"] = str(home)
    ports = list(environment_ports(home))
    for i, name in enumerate((HTTP_PORT_ENV, CONTROL_PORT_ENV)):
        given = env.get(name)
        if not given:
            chosen[name] = str(ports[i])
        elif not given.isdigit() or not 0 < int(given) < 65536:
            raise click.ClickException(f"{name}={given!r} is not a port number")
        else:
            ports[i] = int(given)
    return LocalSuperLink(home, ports[0], ports[1], bin_dir,
                          connection_supernodes(config, launch.superlink), chosen)


def connection_supernodes(config: Path, connection: str | None) -> int | None:
    """The ``options.num-supernodes`` of ``connection`` (default: the default one) in the
    Flower configuration ``config``, if it has one."""
    if not config.is_file():
        return None
    with config.open("rb") as f:
        superlink = tomllib.load(f).get("superlink", {})
    entry = superlink.get(connection if connection is not None else superlink.get("default"))
    options = entry.get("options") if isinstance(entry, dict) else None
    value = options.get("num-supernodes") if isinstance(options, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prepare_home(local: LocalSuperLink, user_env: Mapping[str, str]) -> None:
    """Create the environment's own Flower home, with the user's Flower configuration (its
    connections) copied in each time and a note of the environment it belongs to."""
    if "FLWR_HOME" not in local.env:
        return
    local.home.mkdir(parents=True, exist_ok=True)
    user_config = flower_home(user_env) / "config.toml"
    if user_config.is_file():
        shutil.copyfile(user_config, local.home / "config.toml")
    (local.home / "environment.txt").write_text(
        f"The Flower home of `fedcybgd run` in the environment {local.bin_dir}: its local "
        f"SuperLink listens on 127.0.0.1:{local.http_port} (Control API "
        f"{local.control_port}).\n")


def superlinks_on(port: int) -> list[tuple[psutil.Process, Path]]:
    """The ``flower-superlink`` processes serving ``--port port``, each with its executable."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        script = next((part for part in cmdline[:2] if Path(part).name == "flower-superlink"),
                      None)
        if script is None or "--port" not in cmdline:
            continue
        at = cmdline.index("--port")
        if at + 1 < len(cmdline) and cmdline[at + 1] == str(port):
            found.append((proc, Path(script)))
    return found


def port_taken(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def environment_refusal(local: LocalSuperLink) -> str | None:
    """Why a run cannot go to ``local`` now: its ports serve another environment's SuperLink,
    or another program; ``None`` when they serve this environment's or nothing."""
    mine = (local.bin_dir / "flower-superlink").resolve()
    running = superlinks_on(local.http_port)
    for proc, script in running:
        if script.resolve() != mine:
            return (f"the local SuperLink on 127.0.0.1:{local.http_port} (pid {proc.pid}) runs "
                    f"{script}, not this environment's {local.bin_dir / 'flower-superlink'}: "
                    "the run would execute with that environment's packages and code. Stop it "
                    f"(`kill {proc.pid}`), or choose other ports for this one ({HTTP_PORT_ENV}, "
                    f"{CONTROL_PORT_ENV})")
    if running:
        return None
    for port, name in ((local.http_port, HTTP_PORT_ENV), (local.control_port, CONTROL_PORT_ENV)):
        if port_taken(port):
            return (f"127.0.0.1:{port}, a port of this environment's local SuperLink, is taken "
                    f"by another program: set {name} to a free port")
    return None


# -- the run config as the ServerApp will see it ---------------------------------------------
def app_run_config(app: str) -> dict[str, Any] | None:
    """The run config of the Flower App in folder ``app`` (``[tool.flwr.app.config]``, nested
    tables as dotted keys), or ``None`` when ``app`` is not an app folder here."""
    project = Path(app).expanduser() / "pyproject.toml"
    if not project.is_file():
        return None
    with project.open("rb") as f:
        table = tomllib.load(f).get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    return dict(flatten_dict(table)) if isinstance(table, dict) else None


def run_config_of(launch: Launch) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The run config the ServerApp will get (the app's, then the overrides in order) and the
    overrides alone; ``None`` when flwr run will refuse the overrides itself (text it cannot
    read, keys the app lacks: it names them, and the launcher the closest key)."""
    defaults = app_run_config(launch.app)
    try:
        overrides = dict(parse_config_args(launch.run_config or None))
        parse_config_args(launch.federation_config or None)
    except (click.ClickException, ValueError, OSError):
        return None
    if defaults is not None and any(key not in defaults for key in overrides):
        return None
    return {**(defaults or {}), **overrides}, overrides


def nodes_refusal(config: Mapping[str, Any], federation_config: list[str],
                  local: LocalSuperLink) -> str | None:
    """Why the simulation cannot hold the run: it needs more nodes than will be started."""
    key = "pipeline-stages" if config.get("strategy") == "pipeline" else "clients-per-round"
    needed = config.get(key)
    if not isinstance(needed, int) or isinstance(needed, bool):
        return None
    if federation_config:
        nodes = parse_config_args(federation_config).get("num-supernodes")
        source = "--federation-config"
        if nodes is None:
            nodes, source = FLOWER_DEFAULT_SUPERNODES, "Flower's default"
    elif local.options_supernodes is not None:
        nodes, source = local.options_supernodes, "the connection's options.num-supernodes"
    else:
        nodes, source = FLOWER_DEFAULT_SUPERNODES, "Flower's default"
    if not isinstance(nodes, int) or needed <= nodes:
        return None
    return (f"{key} = {needed}, but the local simulation starts {nodes} SuperNodes ({source}): "
            f'add --federation-config "num-supernodes={needed}", or lower {key}')


@dataclass
class Submission:
    """What goes to ``flwr run`` for a :class:`Launch`: its environment and run config, the
    local SuperLink it goes to (``None``: a SuperLink of its own address), the run's output
    folder when known here, and the outermost folder the run would create for it."""

    env: dict[str, str]
    run_config: list[str]
    local: LocalSuperLink | None = None
    output_dir: Path | None = None
    creates: Path | None = None

    def flwr(self, args: str) -> str:
        """A ``flwr`` command line that reaches the run's SuperLink when typed in a shell."""
        return self.local.flwr(args) if self.local is not None else f"flwr {args}"

    def remove_unused_folder(self) -> None:
        """After a failed run: remove the folder it created for its outputs if it holds no
        file (the run wrote nothing there)."""
        created = self.creates
        if created is None or not created.is_dir() or holds_files(created):
            return
        shutil.rmtree(created)
        say(f"removed {created}: the run wrote nothing there", sys.stderr)


class Refusal(Exception):
    """A run that cannot work as asked: nothing is submitted."""


def prepare(launch: Launch, env: dict[str, str], cwd: Path | None = None) -> Submission:
    """The :class:`Submission` for ``launch`` from the environment ``env`` (the folder the
    command was typed in: ``cwd``, default the working folder); see the module's docstring.

    Raises
    ------
    Refusal
        Another environment's SuperLink on the ports, too few nodes, or an ``output-dir``
        holding another run (a message with what to type instead).
    """
    submission = Submission(dict(env), list(launch.run_config))
    try:
        local = local_superlink(launch, env)
    except click.ClickException as err:
        raise Refusal(err.format_message()) from None
    if local is not None:
        submission.local = local
        submission.env.update(local.env)
        problem = environment_refusal(local)
        if problem is not None:
            raise Refusal(problem)
    read = run_config_of(launch)
    if read is not None and local is None:
        value = read[0].get("output-dir")
        if isinstance(value, str) and not Path(value).expanduser().is_absolute():
            say(f"output-dir '{value}' is relative: the ServerApp takes it from its "
                "FEDCYBGD_OUTPUT_ROOT, else its working folder, on the SuperLink's machine "
                "(its log names the folder)")
    elif read is not None and local is not None:
        config, overrides = read
        problem = nodes_refusal(config, launch.federation_config, local)
        if problem is not None:
            raise Refusal(problem)
        plan_outputs(submission, config, "output-dir" in overrides, launch.run_config,
                     overrides, cwd)
    if local is not None:
        prepare_home(local, env)
        own = " (this environment's own)" if "FLWR_HOME" in local.env else ""
        say(f"local SuperLink: 127.0.0.1:{local.http_port}, Flower home {local.home}{own}; "
            f"environment {local.bin_dir}")
    if submission.output_dir is not None:
        say(f"outputs: {submission.output_dir}")
    return submission


def plan_outputs(submission: Submission, config: Mapping[str, Any], given: bool,
                 run_config: list[str], overrides: Mapping[str, Any],
                 cwd: Path | None) -> None:
    """Choose the run's absolute output folder and add it to the submission's run config."""
    value = config.get("output-dir")
    if not isinstance(value, str):
        return
    out = resolve_output_dir(value, submission.env, cwd)
    resume, overwrite = bool(config.get("resume")), bool(config.get("overwrite"))
    earlier = earlier_outputs(out)
    if earlier and not given and not resume and not overwrite:
        taken, out = out, fresh_folder(out)
        say(f"{taken} holds an earlier run ({name_entries(earlier)}); this run gets a folder "
            f"of its own. To use that one instead: --run-config \"resume=true\" continues its "
            f"run, --run-config \"overwrite=true\" replaces it")
    else:
        refusal = output_dir_refusal(out, resume, overwrite)
        if refusal is not None:
            if earlier:
                refusal += ('; e.g. --run-config "overwrite=true", or no output-dir for a '
                            'folder of its own')
            raise Refusal(refusal)
    submission.output_dir, submission.creates = out, first_missing(out)
    setting = f"output-dir={toml_value(str(out))}"
    if len(run_config) == 1 and run_config[0].endswith(".toml"):  # flwr takes a file alone
        submission.run_config = [format_config(overrides), setting]
    else:
        submission.run_config = [*run_config, setting]


def fresh_folder(taken: Path) -> Path:
    """A folder beside ``taken`` named after it and the time: ``demo-20250101-120000``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = taken.with_name(f"{taken.name}-{stamp}"), 1
    while candidate.exists():
        n += 1
        candidate = taken.with_name(f"{taken.name}-{stamp}-{n}")
    return candidate


# -- the run ---------------------------------------------------------------------------------
def launch(launch: Launch) -> int:
    """Run ``launch``; returns the exit status (:data:`EXIT_CODES`)."""
    env = launch.environment()
    from fedcybgd.cli.precheck import launch_refusal  # torch: only once a run is asked for

    refusal = launch_refusal(launch.app, launch.run_config, launch.superlink, env)
    if refusal is not None:  # before Flower starts anything
        say(refusal, sys.stderr)
        return EXIT_BAD_ARGUMENTS
    try:
        submission = prepare(launch, env)
    except Refusal as why:
        say(f"no run was started: {why}", sys.stderr)
        return EXIT_FAILED
    code = submit(launch, submission)
    if code == EXIT_FAILED:
        submission.remove_unused_folder()
    return code


def submit(launch: Launch, submission: Submission) -> int:
    """``flwr run`` with the submission, then the run's final status."""
    env = submission.env
    home = flower_home(env)
    # where the managed local SuperLink logs (flwr may create it, and its config, on this run)
    superlink_log = submission.local.log if submission.local is not None else \
        local_superlink_log(home, launch.superlink)
    local_log = superlink_log or home / "local-superlink" / "superlink.log"
    log_offset = local_log.stat().st_size if local_log.is_file() else 0
    pending = log_dir_of(launch, env) / f"run-pending-{os.getpid()}.log"
    result = stream([flwr_executable(), *launch.flwr_args(submission.run_config)], pending, env)
    if result.interrupted:
        return interrupted(launch, result, submission)
    if result.run_id is None:
        return refused(launch, result, superlink_log, log_offset)
    log_path = pending.with_name(f"run-{result.run_id}.log")
    pending.replace(log_path)
    connection = f" {launch.superlink}" if launch.superlink else ""
    where = (f"full log: {log_path} (or "
             f"`{submission.flwr(f'log {result.run_id}{connection} --show')}`)")
    try:
        record = final_status(result.run_id, launch.superlink, env=env)
    except (ValueError, OSError, subprocess.SubprocessError) as err:
        say(f"run {result.run_id}: could not read its final status: {err}", sys.stderr)
        say(where, sys.stderr)
        return EXIT_UNKNOWN
    status = str(record.get("status", "unknown"))
    if status == COMPLETED:
        say(f"run {result.run_id} {status}; {where}")
        return EXIT_OK
    why = failure_line(str(record.get("status-details", "")), result.lines)
    if not status.startswith("finished"):
        say(f"run {result.run_id} is still '{status}' after its log stream ended; follow it "
            f"with `{submission.flwr(f'log {result.run_id}{connection} --stream')}`",
            sys.stderr)
        say(where, sys.stderr)
        return EXIT_UNKNOWN
    say(f"run {result.run_id} {status}: {why or 'no reason given'}", sys.stderr)
    say(where, sys.stderr)
    return EXIT_FAILED


def interrupted(launch: Launch, result: Streamed, submission: Submission) -> int:
    """Ctrl-C: stop the run when asked to (``stop_on_interrupt``), else say it goes on."""
    if result.run_id is not None:
        result.log_path = result.log_path.replace(
            result.log_path.with_name(f"run-{result.run_id}.log"))
    connection = f" {launch.superlink}" if launch.superlink else ""
    stop = f"`{submission.flwr(f'stop {result.run_id}{connection}')}`"
    if result.run_id is None:
        say(f"interrupted before a run started; flwr's output: {result.log_path}", sys.stderr)
    elif launch.stop_on_interrupt:
        problem = stop_run(result.run_id, launch.superlink, submission.env)
        say(f"interrupted; run {result.run_id} "
            + (f"could not be stopped ({problem}): stop it with {stop}" if problem
               else "stopped")
            + f"; its log so far is in {result.log_path}", sys.stderr)
    else:
        say(f"interrupted; run {result.run_id} goes on ({stop} stops it), "
            f"its log so far is in {result.log_path}", sys.stderr)
    return EXIT_INTERRUPTED


def refused(launch: Launch, result: Streamed, superlink_log: Path | None,
            log_offset: int) -> int:
    """No run was started: say why (flwr's output, the SuperLink's log, unknown keys)."""
    say(f"no run was started (flwr run exited {result.returncode})", sys.stderr)
    reasons: list[str] = []
    if superlink_log is not None and superlink_log.is_file():
        with superlink_log.open("rb") as f:
            f.seek(log_offset)
            reasons = superlink_errors(f.read().decode("utf-8", errors="replace"))
        if reasons:  # the first says why; the SuperLink's API layer repeats it
            say(f"SuperLink: {reasons[0]}", sys.stderr)
    try:
        overrides = list(parse_config_args(launch.run_config or None))
    except (click.ClickException, ValueError, OSError) as err:
        say(f"could not read --run-config ({type(err).__name__}: {err})", sys.stderr)
        overrides = []
    for hint in unknown_key_hints(reasons, overrides, app_config_keys(Path(launch.app))):
        say(hint, sys.stderr)
    saved = result.log_path.with_name(f"refused-{int(time.time())}.log")
    result.log_path.replace(saved)
    say(f"flwr's output: {saved}"
        + (f"; the SuperLink's log: {superlink_log}" if superlink_log is not None else ""),
        sys.stderr)
    return EXIT_FAILED
