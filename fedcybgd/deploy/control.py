"""Talk to a running SuperLink through the ``flwr`` CLI: register nodes, submit, wait, logs.

:class:`Control` binds the CLI to one SuperLink connection written into a private
``FLWR_HOME/config.toml`` (never the user's own ``~/.flwr``). The loopback launcher and the
docker-compose services (``register`` and ``runner``) use it, so all of them submit and wait the
same way:

    python -m fedcybgd.deploy.control --superlink superlink:8000 health   # exit 0: up
    python -m fedcybgd.deploy.control --superlink superlink:8000 \\
        --root-certificates /certs/ca.crt register /certs/supernode-1.pub /certs/supernode-2.pub
    python -m fedcybgd.deploy.control --superlink superlink:8000 run --nodes 3 \\
        --app /app --run-config "output-dir='/outputs/run' num-server-rounds=2"

``run`` waits for the SuperNodes, submits ``flwr run APP superlink-conn``, streams the run's log,
and exits 0 only when the run ends ``finished:completed``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedcybgd.deploy.commands import connection_toml, format_config, merge_config

CONNECTION = "superlink-conn"
BIN_DIR = Path(sys.executable).parent  # flwr & co. live beside python


class DeployError(RuntimeError):
    """A process did not come up, a command failed, or a run did not finish in time."""


def parse_json_output(text: str) -> Any:
    """The JSON object a ``flwr ... --format json`` command printed (other text is skipped)."""
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:])
            return value
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise DeployError(f"no JSON in flwr output: {text[-2000:]!r}")


def healthy(address: str, root_certificates: str | None = None, timeout: float = 2.0) -> bool:
    """True when ``GET http(s)://address/health`` answers 200 (HTTPS when a CA is given)."""
    scheme, context = "http", None
    if root_certificates:
        scheme, context = "https", ssl.create_default_context(cafile=root_certificates)
    try:
        with urllib.request.urlopen(f"{scheme}://{address}/health", timeout=timeout,
                                    context=context) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def flwr_executable() -> str:
    """``flwr`` beside this Python (a virtualenv), else the one on PATH."""
    local = BIN_DIR / "flwr"
    return str(local) if local.exists() else (shutil.which("flwr") or "flwr")


class Control:
    """The ``flwr`` CLI bound to one SuperLink connection in its own ``FLWR_HOME``.

    ``check`` (optional) is called while waiting; it raises to abort a wait, e.g. when a
    process the caller started has died.
    """

    def __init__(
        self,
        home: Path,
        address: str,
        root_certificates: str | None = None,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        name: str = CONNECTION,
    ) -> None:
        self.home = Path(home)
        self.address = address
        self.name = name
        self.log = log
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            connection_toml(name, address, root_certificates=root_certificates)
        )
        self.env = dict(os.environ if env is None else env)
        self.env.update(FLWR_HOME=str(self.home), HF_HUB_OFFLINE="1",
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")

    def flwr(self, *args: str, timeout: float = 120.0, check: bool = True
             ) -> subprocess.CompletedProcess[str]:
        """Run ``flwr ARGS`` (its output is appended to the log, if any)."""
        result = subprocess.run([flwr_executable(), *args], capture_output=True, text=True,
                                timeout=timeout, env=self.env, cwd=self.home, check=False)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"$ {shlex.join(['flwr', *args])}\n{result.stdout}{result.stderr}"
                        f"[exit {result.returncode}]\n")
        if check and result.returncode != 0:
            raise DeployError(f"flwr {' '.join(args)} failed ({result.returncode}): "
                              f"{(result.stdout + result.stderr)[-2000:]}")
        return result

    def register(self, public_key: Path, name: str | None = None) -> str | None:
        """``flwr supernode register``; returns the node id, None if the key was registered
        already (so re-running a deployment on kept state is harmless)."""
        args = ["supernode", "register", str(public_key), self.name, "--format", "json"]
        if name:
            args += ["--name", name]
        reply = parse_json_output(self.flwr(*args).stdout)  # flwr exits 0 on failure too
        if reply.get("success"):
            return str(reply["node-id"])
        if "already in use" in str(reply.get("error-message")):
            return None
        raise DeployError(f"registering {public_key} failed: {reply}")

    def online_nodes(self) -> int:
        """How many SuperNodes the SuperLink sees online (0 if it does not answer)."""
        out = self.flwr("supernode", "ls", self.name, "--format", "json", check=False)
        if out.returncode != 0:
            return 0
        try:
            nodes = parse_json_output(out.stdout).get("nodes") or []
        except DeployError:
            return 0
        return sum(1 for n in nodes if n.get("status") == "online")

    def wait_nodes(self, count: int, timeout: float = 120.0,
                   check: Callable[[], None] | None = None) -> None:
        """Wait until ``count`` SuperNodes are online."""
        deadline = time.monotonic() + timeout
        while (online := self.online_nodes()) < count:
            if check:
                check()
            if time.monotonic() > deadline:
                raise DeployError(f"{online}/{count} SuperNodes online after {timeout:.0f} s")
            time.sleep(1.0)

    def submit(self, run_config: Mapping[str, object] | str, app: Path) -> int:
        """``flwr run APP <connection> --run-config ...``; returns the run id."""
        overrides = run_config if isinstance(run_config, str) else format_config(run_config)
        out = self.flwr("run", str(app), self.name, "--run-config", overrides,
                        "--format", "json", timeout=300.0)
        reply = parse_json_output(out.stdout)
        if not reply.get("success") or not reply.get("run-id"):
            raise DeployError(f"flwr run did not start a run: {reply}")
        return int(reply["run-id"])

    def run_record(self, run_id: int) -> dict[str, Any]:
        """The run's entry of ``flwr ls --run-id ID --format json`` (``status``,
        ``status-details``, ...); empty when it cannot be read."""
        out = self.flwr("ls", self.name, "--run-id", str(run_id), "--format", "json",
                        check=False)
        if out.returncode != 0:
            return {}
        try:
            runs = parse_json_output(out.stdout).get("runs") or []
        except DeployError:
            return {}
        return dict(runs[0]) if runs and isinstance(runs[0], dict) else {}

    def run_status(self, run_id: int) -> str:
        """The run's status text, e.g. ``running`` or ``finished:completed``."""
        return str(self.run_record(run_id).get("status", "unknown"))

    def wait_run(self, run_id: int, timeout: float = 3600.0, poll_s: float = 2.0,
                 check: Callable[[], None] | None = None, recheck_s: float = 30.0) -> str:
        """Wait until the run's status starts with ``finished``; returns it.

        What waits is one ``flwr log ID --stream``, which the SuperLink ends when the run
        finishes, not a ``flwr ls`` every ``poll_s``: each CLI call costs most of a second of
        CPU, a whole core's third at a 2 s poll, taken from the nodes on a small machine.
        ``check`` (called every ``poll_s``) may raise to stop waiting, e.g. when a process of
        the deployment died; the status is read again every ``recheck_s`` in case the stream
        outlives the run, and the stream is restarted if it ends first (a dropped connection).
        """
        deadline = time.monotonic() + timeout
        while True:
            stream = subprocess.Popen(
                [flwr_executable(), "log", str(run_id), self.name, "--stream"], env=self.env,
                cwd=self.home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            recheck = time.monotonic() + recheck_s
            try:
                while stream.poll() is None and time.monotonic() < recheck:
                    if check:
                        check()
                    if time.monotonic() > deadline:
                        break
                    time.sleep(poll_s)
            finally:
                if stream.poll() is None:
                    stream.kill()
                stream.wait()
            status = self.run_status(run_id)
            if status.startswith("finished"):
                return status
            if time.monotonic() > deadline:
                raise DeployError(f"run {run_id} still '{status}' after {timeout:.0f} s")
            if stream.returncode != -signal.SIGKILL:  # it ended before the run, not killed here
                time.sleep(poll_s)  # not a busy loop

    def run_log(self, run_id: int) -> str:
        """The ServerApp's log so far (``flwr log --show``)."""
        out = self.flwr("log", str(run_id), self.name, "--show", check=False)
        return out.stdout + out.stderr

    def stream_log(self, run_id: int) -> None:
        """Print the run's log as it grows until the run ends (``flwr log --stream``)."""
        subprocess.run([flwr_executable(), "log", str(run_id), self.name, "--stream"],
                       env=self.env, cwd=self.home, check=False)


def _retry(action: Callable[[], Any], timeout: float) -> Any:
    """Call ``action`` until it stops raising (the SuperLink may still be starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except DeployError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def main(argv: list[str] | None = None) -> int:
    """``register`` node keys, or ``run`` the app once and wait for it."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink host:port")
    parser.add_argument("--root-certificates", default=None,
                        help="CA certificate of a TLS SuperLink (default: insecure)")
    parser.add_argument("--flwr-home", type=Path, default=None,
                        help="FLWR_HOME for the CLI (default: a fresh temporary folder)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("health", help="exit 0 when the SuperLink answers GET /health")
    reg = sub.add_parser("register", help="register SuperNode public keys (OpenSSH format)")
    reg.add_argument("keys", nargs="+", type=Path)
    run = sub.add_parser("run", help="submit the app, stream its log, wait for the end")
    run.add_argument("--app", type=Path, default=Path.cwd())
    run.add_argument("--nodes", type=int, default=1, help="SuperNodes to wait for")
    run.add_argument("--run-config", default="", help="run-config overrides")
    run.add_argument("--defaults", default="",
                     help="run-config values that --run-config may override")
    args = parser.parse_args(argv)

    if args.command == "health":
        return 0 if healthy(args.superlink, args.root_certificates) else 1
    if args.flwr_home is not None:
        return _run_command(args, args.flwr_home)
    with tempfile.TemporaryDirectory(prefix="fedcybgd-flwr-") as home:
        return _run_command(args, Path(home))


def _run_command(args: argparse.Namespace, home: Path) -> int:
    control = Control(home, args.superlink, args.root_certificates)
    try:
        if args.command == "register":
            for key in args.keys:
                node_id = _retry(functools.partial(control.register, key, key.stem),
                                 args.timeout)
                print(f"{key}: " + (f"registered as node {node_id}" if node_id
                                    else "registered already"), flush=True)
            return 0
        control.wait_nodes(args.nodes, timeout=args.timeout)
        print(f"{args.nodes} SuperNodes online at {args.superlink}", flush=True)
        run_config = merge_config(args.defaults, args.run_config)
        run_id = control.submit(run_config, args.app)
        print(f"run {run_id} submitted (run config: {run_config or 'defaults'})", flush=True)
        control.stream_log(run_id)
        status = control.wait_run(run_id, timeout=args.timeout)
    except DeployError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"status: {status}", flush=True)
    return 0 if status == "finished:completed" else 1

if __name__ == "__main__":
    sys.exit(main())
