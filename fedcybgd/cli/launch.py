"""``fedcybgd run``: ``flwr run --stream`` with an exit status that tells the truth.

``flwr run APP SUPERLINK --stream`` exits 0 once the log stream ends, whether the run completed
or its ServerApp raised. This launcher runs it, prints its output as it comes (and saves it),
then asks the SuperLink for the run's final status (``flwr ls SUPERLINK --run-id ID --format
json``) and exits with :data:`EXIT_CODES`'s status. A failed run prints the line that says why
(:func:`fedcybgd.deploy.diagnose.failure_line`); a run the SuperLink refused to start prints the
SuperLink's reason and, for a misspelt run-config key, the closest key the app has. Before
Flower starts anything, the app's run config with the overrides and its model are checked
(:func:`fedcybgd.server.preflight.launch_refusal`): a value of the wrong type or a model no one
could load is one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import click
from flwr.common.config import parse_config_args

from fedcybgd.deploy.diagnose import (
    app_config_keys,
    failure_line,
    flower_home,
    local_superlink_log,
    plain,
    superlink_errors,
    unknown_key_hints,
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

    def flwr_args(self) -> list[str]:
        """``flwr``'s arguments for this run: ``run APP [SUPERLINK] --stream ...``."""
        args = ["run", self.app, *([self.superlink] if self.superlink else []), "--stream"]
        for value in self.run_config:
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


def log_dir_of(launch: Launch) -> Path:
    """Where full logs are saved."""
    return Path(launch.log_dir) if launch.log_dir else \
        flower_home(launch.environment()) / "fedcybgd-logs"


def launch(launch: Launch) -> int:
    """Run ``launch``; returns the exit status (:data:`EXIT_CODES`)."""
    env = launch.environment()
    from fedcybgd.server.preflight import launch_refusal  # torch: only once a run is asked for

    refusal = launch_refusal(launch.app, launch.run_config, launch.superlink, env)
    if refusal is not None:  # before Flower starts anything
        say(refusal, sys.stderr)
        return EXIT_BAD_ARGUMENTS
    home = flower_home(env)
    # where the managed local SuperLink logs (flwr may create it, and its config, on this run)
    local_log = local_superlink_log(home, launch.superlink) or \
        home / "local-superlink" / "superlink.log"
    log_offset = local_log.stat().st_size if local_log.is_file() else 0
    pending = log_dir_of(launch) / f"run-pending-{os.getpid()}.log"
    result = stream([flwr_executable(), *launch.flwr_args()], pending, env)
    if result.interrupted:
        return interrupted(launch, result)
    if result.run_id is None:
        return refused(launch, result, local_superlink_log(home, launch.superlink), log_offset)
    log_path = pending.with_name(f"run-{result.run_id}.log")
    pending.replace(log_path)
    where = (f"full log: {log_path} (or `flwr log {result.run_id}"
             f"{' ' + launch.superlink if launch.superlink else ''} --show`)")
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
            f"with `flwr log {result.run_id} --stream`", sys.stderr)
        say(where, sys.stderr)
        return EXIT_UNKNOWN
    say(f"run {result.run_id} {status}: {why or 'no reason given'}", sys.stderr)
    say(where, sys.stderr)
    return EXIT_FAILED


def interrupted(launch: Launch, result: Streamed) -> int:
    """Ctrl-C: stop the run when asked to (``stop_on_interrupt``), else say it goes on."""
    if result.run_id is not None:
        result.log_path = result.log_path.replace(
            result.log_path.with_name(f"run-{result.run_id}.log"))
    if result.run_id is None:
        say(f"interrupted before a run started; flwr's output: {result.log_path}", sys.stderr)
    elif launch.stop_on_interrupt:
        problem = stop_run(result.run_id, launch.superlink, launch.environment())
        say(f"interrupted; run {result.run_id} "
            + (f"could not be stopped ({problem}): stop it with `flwr stop {result.run_id}`"
               if problem else "stopped")
            + f"; its log so far is in {result.log_path}", sys.stderr)
    else:
        say(f"interrupted; run {result.run_id} goes on (`flwr stop {result.run_id}` stops it), "
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
