"""``make deploy-local``: a SuperLink and N SuperNodes as real processes on 127.0.0.1.

The same topology as ``docker-compose.yml``, for machines without Docker: ``flower-superlink``,
N ``flower-supernode`` (each with its ``partition-id`` / ``num-partitions`` / ``cache-dir``), a
``config.toml`` connection, then ``flwr run`` and a poll of ``flwr ls`` until the run finishes.
With ``--tls`` the SuperLink serves HTTPS with a freshly made CA and server certificate and
requires SuperNode authentication; each node's key is registered with
``flwr supernode register`` before the node starts. The SuperNodes then dial a Fleet gateway
(``fedcybgd.deploy.gateway``) on a port of its own, which forwards only the Fleet API: the
SuperLink's port, with its unauthenticated Control and Runtime APIs, is the operator's alone.

    python -m fedcybgd.deploy.local --nodes 3 [--tls] [--run-config "num-server-rounds=2"]

Every process gets its own ``FLWR_HOME`` under a state folder outside the project (everything in
the project folder may be bundled into the app), logs to ``<output-dir>/logs/`` and is stopped
(its whole process group) at the end. The :class:`LocalDeployment` class is the library the
end-to-end tests use, so the tests and the command run one code path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

import psutil

from fedcybgd.deploy import certs
from fedcybgd.deploy.commands import (
    ServerTls,
    format_config,
    gateway_command,
    merge_config,
    node_config,
    parse_config,
    superlink_command,
    supernode_command,
)
from fedcybgd.deploy.control import Control, DeployError, healthy
from fedcybgd.deploy.diagnose import failure_line
from fedcybgd.server.output_dir import resolve_output_dir

PROJECT = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT_DIR = PROJECT / "outputs" / "deploy-local"
HOST = "127.0.0.1"
BIN_DIR = Path(sys.executable).parent  # flower-superlink & co. live beside python

# A run config that trains a 4-layer random Llama for 2 rounds: seconds per round on a CPU.
QUICK_RUN_CONFIG: dict[str, object] = {
    "model": "tiny-llama",
    "layers-per-block": 1,
    "clients-per-block": 1,
    "num-server-rounds": 2,
    "eval-examples": 16,
    "local-steps": 2,
    "batch-size": 4,
    "max-seq-len": 48,
}


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def app_default(key: str, project: Path = PROJECT) -> Any:
    """A run-config default from the project's ``[tool.flwr.app.config]``."""
    with (project / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"].get(key)


# ANSI escape sequences (CSI such as Flower's level colours, and two-byte escapes).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def plain_log_text(text: str) -> str:
    """``text`` as a log file should hold it: without ANSI escape codes, and of a line that a
    progress bar redrew with carriage returns, only its last state.

    Flower colours its log levels whatever the output is, so the launcher strips the codes
    when it writes a process's output to its log file.
    """
    lines = _ANSI.sub("", text).split("\n")
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines)


def _pump(source: IO[bytes], sink: TextIO) -> None:
    """Copy a process's output into its log file line by line, as :func:`plain_log_text`."""
    with contextlib.suppress(ValueError, OSError):  # the log was closed: the process is gone
        for raw in iter(source.readline, b""):
            sink.write(plain_log_text(raw.decode(errors="replace")))
            sink.flush()
    source.close()


@dataclass
class Proc:
    """A started process, its log file, the log's handle and the thread that writes it; for a
    node in a container, the container it runs in."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    handle: TextIO
    pump: threading.Thread | None = None
    container: NodeContainer | None = None

    def exit_code(self) -> int | None:
        """None while the process runs."""
        return self.popen.poll()

    def close_log(self) -> None:
        """Write what the process still had to say, then close its log."""
        if self.pump is not None:
            self.pump.join(timeout=5.0)
        self.handle.close()


# What a containerised SuperNode gets of the launcher's environment (its PATH and caches are the
# image's own).
CONTAINER_ENV = ("FLWR_HOME", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
                 "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "TQDM_DISABLE",
                 "HF_HUB_DISABLE_PROGRESS_BARS", "NO_COLOR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class NodeContainer:
    """Run each SuperNode in a container of ``image`` instead of as a local process.

    The container shares the host's network (it dials the SuperLink on 127.0.0.1, as a local
    node does) and sees the deployment's state folder at the same path, so its command is the
    local one. ``platform`` runs an image of another architecture (``linux/arm64`` under qemu's
    binfmt emulation on an x86 machine); ``memory`` is a hard limit the kernel enforces (docker
    ``--memory``, swap included: ``--memory-swap`` the same), e.g. ``"1.5g"``.
    """

    image: str
    platform: str = ""
    memory: str = ""
    docker: str = "docker"

    def describe(self) -> str:
        """The image, its platform and the memory limit, as a log line says them."""
        parts = [self.image] + ([self.platform] if self.platform else [])
        return " ".join(parts) + (f", memory limit {self.memory}" if self.memory else "")

    def name_for(self, state: Path, node: str) -> str:
        """The container's name: one per deployment (its state folder) and node."""
        return f"fedcybgd-{hashlib.sha256(str(state).encode()).hexdigest()[:10]}-{node}"

    def command(self, state: Path, node: str, cmd: list[str],
                env: Mapping[str, str]) -> list[str]:
        """``docker run ... image cmd``: the SuperNode's command inside its container."""
        run = [self.docker, "run", "--rm", "--init", "--name", self.name_for(state, node),
               "--network", "host", "--user", f"{os.getuid()}:{os.getgid()}",
               "-v", f"{state}:{state}", "-e", f"HOME={state / node}"]
        if self.platform:
            run += ["--platform", self.platform]
        if self.memory:
            run += ["--memory", self.memory, "--memory-swap", self.memory]
        for key in CONTAINER_ENV:
            if key in env:
                run += ["-e", f"{key}={env[key]}"]
        return [*run, self.image, *cmd]

    def remove(self, state: Path, node: str) -> None:
        """Remove the node's container if it outlived its ``docker run`` (a SIGKILL)."""
        subprocess.run([self.docker, "rm", "-f", self.name_for(state, node)],
                       capture_output=True, check=False, timeout=60)


@dataclass
class LocalDeployment:
    """A SuperLink, SuperNodes and the ``flwr`` CLI on 127.0.0.1, each with its own FLWR_HOME.

    ``state`` holds the FLWR_HOMEs, the SuperLink's database, certificates, node keys and node
    caches; keep it outside the project folder. ``logs`` receives one log file per process.
    Use as a context manager (or call :meth:`stop`) so no process outlives it.
    """

    state: Path
    logs: Path
    tls: bool = False
    threads_per_process: int | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    fleet_port: int = 0
    node_container: NodeContainer | None = None
    procs: dict[str, Proc] = field(default_factory=dict)
    cert_files: certs.CertFiles | None = None

    def __post_init__(self) -> None:
        self.state = Path(self.state).resolve()
        self.logs = Path(self.logs).resolve()
        if self.state.is_relative_to(PROJECT):
            raise DeployError(f"state folder {self.state} is inside the project {PROJECT}: "
                              "it would be bundled into the app; choose one outside it")
        self.state.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        if self.tls:
            self.cert_files = certs.make_ca_and_server_cert(self.state / "certs")
            self.fleet_port = self.fleet_port or free_port()
        ca = str(self.cert_files.ca_cert) if self.cert_files else None
        self.control = Control(self.state / "flwr-cli", self.address, root_certificates=ca,
                               env=self.env(self.state / "flwr-cli"),
                               log=self.logs / "flwr-cli.log")

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The SuperLink's own ``host:port`` (Fleet, Control and Runtime APIs): the operator's."""
        return f"{HOST}:{self.port}"

    @property
    def fleet_address(self) -> str:
        """The ``host:port`` SuperNodes dial: the Fleet gateway under TLS, else the SuperLink."""
        return f"{HOST}:{self.fleet_port}" if self.tls else self.address

    def server_tls(self) -> ServerTls | None:
        """The CA, certificate and key the SuperLink and the gateway serve (None: insecure)."""
        if self.cert_files is None:
            return None
        return ServerTls(str(self.cert_files.ca_cert), str(self.cert_files.server_cert),
                         str(self.cert_files.server_key))

    def env(self, flwr_home: Path, bin_dir: Path = BIN_DIR) -> dict[str, str]:
        """Environment of every process: offline hub, no runtime dependency installation, no
        progress bars or colours in the log files; ``bin_dir`` (the Python environment whose
        Flower commands the process runs) first on ``PATH``, so what it starts is that
        environment's too."""
        env = dict(os.environ)
        env.update(
            FLWR_HOME=str(flwr_home),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
            # Logs are files: no progress bars, no colours (Flower's own are stripped by
            # plain_log_text, it colours whatever the output).
            TQDM_DISABLE="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            NO_COLOR="1",
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        env.setdefault("FEDCYBGD_OUTPUT_ROOT", str(PROJECT))  # relative output-dir
        if self.threads_per_process:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env.setdefault(var, str(self.threads_per_process))
        env.update(self.extra_env)
        return env

    def _spawn(self, name: str, cmd: list[str], container: NodeContainer | None = None,
               bin_dir: Path = BIN_DIR) -> Proc:
        if name in self.procs and self.procs[name].exit_code() is None:
            raise DeployError(f"{name} is already running")
        home = self.state / name
        home.mkdir(parents=True, exist_ok=True)
        env = self.env(home, bin_dir)
        argv = ([str(bin_dir / cmd[0]), *cmd[1:]] if container is None
                else container.command(self.state, name, cmd, env))
        log = self.logs / f"{name}.log"
        handle = log.open("a")
        handle.write(f"$ {shlex.join(argv)}\n")
        handle.flush()
        popen = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, cwd=home, start_new_session=True,
        )
        assert popen.stdout is not None
        pump = threading.Thread(target=_pump, args=(popen.stdout, handle), daemon=True,
                                name=f"log-{name}")
        pump.start()
        proc = Proc(name, popen, log, handle, pump, container)
        self.procs[name] = proc
        return proc

    # -- SuperLink --------------------------------------------------------------------------
    def superlink_args(self) -> list[str]:
        """The SuperLink's command (what ``docker-compose.yml`` runs, with local paths)."""
        return superlink_command(host=HOST, port=self.port,
                                 database=str(self.state / "superlink" / "state.db"),
                                 tls=self.server_tls(), supernode_auth=self.tls)

    def gateway_args(self) -> list[str]:
        """The Fleet gateway's command (what ``docker-compose.tls.yml`` runs); TLS only."""
        tls = self.server_tls()
        if tls is None:
            raise DeployError("the Fleet gateway serves TLS deployments only")
        return gateway_command(host=HOST, port=self.fleet_port, upstream=self.address, tls=tls)

    def start_superlink(self, timeout: float = 60.0) -> Proc:
        """Start the SuperLink (and, under TLS, the Fleet gateway before it); wait until
        ``GET /health`` answers at both addresses."""
        proc = self._spawn("superlink", self.superlink_args())
        self.wait_health(timeout, self.address, "superlink")
        if self.tls:
            self._spawn("fleet-gateway", self.gateway_args())
            self.wait_health(timeout, self.fleet_address, "fleet-gateway")
        return proc

    def wait_health(self, timeout: float, address: str | None = None,
                    name: str = "superlink") -> None:
        """Poll ``address``'s ``/health`` (default: the SuperLink's) until it answers 200."""
        address = address or self.address
        ca = str(self.cert_files.ca_cert) if self.cert_files else None
        deadline = time.monotonic() + timeout
        while not healthy(address, ca):
            self.check_alive()
            if time.monotonic() > deadline:
                raise DeployError(f"no answer from {address}/health after {timeout:.0f} s;"
                                  f" see {self.procs[name].log}")
            time.sleep(0.5)

    # -- SuperNodes -------------------------------------------------------------------------
    def node_key(self, name: str, register: bool = True) -> certs.NodeKey:
        """Make ``name``'s key pair and (by default) register its public key."""
        key = certs.make_node_key(self.state / "keys", name)
        if register:
            self.control.register(key.public, name)
        return key

    def supernode_args(self, name: str, config: Mapping[str, object], port: int,
                       key: certs.NodeKey | None = None) -> list[str]:
        """A SuperNode's command (what ``docker-compose.yml`` runs, with local paths)."""
        ca = str(self.cert_files.ca_cert) if self.cert_files else None
        return supernode_command(superlink=self.fleet_address, port=port, node_config=config,
                                 root_certificates=ca,
                                 auth_private_key=str(key.private) if key else None)

    def start_supernode(self, name: str, partition_id: int, num_partitions: int,
                        key: certs.NodeKey | None = None,
                        extra: Mapping[str, object] | None = None,
                        bin_dir: Path = BIN_DIR) -> Proc:
        """Start one SuperNode. Under TLS it authenticates with ``key`` (default: a fresh key
        named after the node, registered first). ``extra``: more node-config, e.g.
        ``{"update_rule": "lezo", "memory_budget_mb": 1024.0}``. ``bin_dir``: the Python
        environment the node runs from (default: this one), e.g. ``.venv-executorch/bin`` for a
        node beside others of the project's venv."""
        if self.tls and key is None:
            key = self.node_key(name)
        cache = self.state / name / "cache"
        config = node_config(partition_id, num_partitions, str(cache), **(extra or {}))
        return self._spawn(name, self.supernode_args(name, config, free_port(), key),
                           self.node_container, bin_dir)

    def start_supernodes(self, count: int,
                         per_node: Mapping[int, Mapping[str, object]] | None = None
                         ) -> list[Proc]:
        """Start ``supernode-1..count`` with partitions ``0..count-1``; ``per_node`` maps a
        partition id to its extra node-config."""
        per_node = per_node or {}
        return [self.start_supernode(f"supernode-{i + 1}", i, count, extra=per_node.get(i))
                for i in range(count)]

    def check_alive(self, nodes: int = 0) -> None:
        """Raise if the SuperLink or the gateway died, or fewer than ``nodes`` SuperNodes run."""
        for name, title in (("superlink", "the SuperLink"), ("fleet-gateway", "the Fleet gateway")):
            proc = self.procs.get(name)
            if proc and proc.exit_code() is not None:
                raise DeployError(f"{title} exited with {proc.exit_code()}; see {proc.log}")
        alive = [p for n, p in self.procs.items()
                 if n.startswith("supernode") and p.exit_code() is None]
        if len(alive) < nodes:
            raise DeployError(f"only {len(alive)} SuperNodes still run, {nodes} needed; "
                              f"logs in {self.logs}")

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Wait until ``count`` SuperNodes are online."""
        self.control.wait_nodes(count, timeout, check=lambda: self.check_alive(count))

    def submit(self, run_config: Mapping[str, object] | str, app: Path = PROJECT) -> int:
        """``flwr run APP <connection> --run-config ...``; returns the run id."""
        return self.control.submit(run_config, app)

    def wait_run(self, run_id: int, timeout: float = 3600.0, poll_s: float = 2.0) -> str:
        """Poll until the run's status starts with ``finished``; returns it.

        On a timeout the error carries the tail of the run's log and of every process's log,
        so a stalled run can be diagnosed from the error alone (a CI log, for instance).
        """
        try:
            return self.control.wait_run(run_id, timeout, poll_s, check=self.check_alive)
        except DeployError as err:
            raise DeployError(f"{err}\n{self.log_tails(run_id)}") from err

    def log_tails(self, run_id: int | None = None, lines: int = 12) -> str:
        """The last ``lines`` lines of the run's ServerApp log and of each process's log."""
        parts = []
        if run_id is not None:
            parts.append((f"run {run_id}", self.control.run_log(run_id)))
        for name, proc in self.procs.items():
            text = proc.log.read_text(errors="replace") if proc.log.exists() else ""
            parts.append((f"{name} (exit {proc.exit_code()})", text))
        return "\n".join(f"--- {title}, last {lines} lines:\n"
                         + "\n".join(text.splitlines()[-lines:]) for title, text in parts)

    def save_run_log(self, run_id: int) -> Path:
        """Write the ServerApp's log (``flwr log --show``) to ``logs/run-<id>.log``."""
        path = self.logs / f"run-{run_id}.log"
        path.write_text(plain_log_text(self.control.run_log(run_id)))
        return path

    # -- teardown ---------------------------------------------------------------------------
    def kill_process(self, name: str) -> int | None:
        """SIGKILL ``name``'s whole process group at once: a crash, no goodbye to the SuperLink
        (fault tests). Returns the exit code."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        if proc.container is not None:
            proc.container.remove(self.state, name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=10.0)
        proc.close_log()
        return proc.exit_code()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every process still running: SIGTERM to all their process groups at once,
        SIGKILL to whatever is left after ``grace_s``.

        Each group (``start_new_session``) holds the process, the SuperExec it spawned and the
        ServerApp/ClientApp processes, so nothing outlives the deployment; a node's container
        is removed besides.
        """
        running = [p for p in self.procs.values() if not p.handle.closed]
        self._stop(running, grace_s)
        for proc in running:
            if proc.container is not None:
                proc.container.remove(self.state, proc.name)

    @staticmethod
    def _stop(procs: list[Proc], grace_s: float) -> None:
        # what each process started (SuperExec, ServerApp, ClientApps), whatever its group
        started: list[psutil.Process] = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                started += psutil.Process(proc.popen.pid).children(recursive=True)
        for proc in procs:  # the group id is the leader's pid (start_new_session)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=5.0)
            proc.close_log()
        _, alive = psutil.wait_procs(started, timeout=grace_s)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def output_dir_of(run_config: str, default: Path) -> Path:
    """The run's output folder: ``output-dir`` of ``run_config``, else ``default``; a relative
    one is taken from the folder the command was typed in (or ``$FEDCYBGD_OUTPUT_ROOT``), as
    ``fedcybgd run`` takes it, and the run is given the absolute path."""
    return resolve_output_dir(str(parse_config(run_config).get("output-dir", default))).resolve()


# What a run writes in its output folder (listed after a run, those this run wrote).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "plots.png", "final", "checkpoint")


@dataclass
class DeployResult:
    """How a deployment's run ended: its status, the line that says why it failed (if it
    did), its output folder, the ServerApp's log, and the outputs this run wrote."""

    status: str
    output_dir: Path
    run_log: Path | None = None
    reason: str | None = None
    written: list[str] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


def written_since(output_dir: Path, since: float) -> list[str]:
    """The run outputs in ``output_dir`` written at or after ``since`` (a ``time.time()``)."""
    return [name for name in RUN_OUTPUTS
            if (output_dir / name).exists() and (output_dir / name).stat().st_mtime >= since]


def run_deployment(
    nodes: int,
    run_config: str,
    output_dir: Path,
    tls: bool = False,
    state: Path | None = None,
    timeout: float = 3600.0,
    per_node: Mapping[int, Mapping[str, object]] | None = None,
    replace_outputs: bool = False,
    node_container: NodeContainer | None = None,
) -> DeployResult:
    """Bring the topology up, run the app once, bring it down; returns how the run ended.

    ``output_dir`` applies unless ``run_config`` sets ``output-dir``; logs go to its ``logs/``.
    ``replace_outputs``: unless ``run_config`` sets ``output-dir``, ``overwrite`` or
    ``resume``, the run replaces the previous run's outputs there (``overwrite = true``).
    ``node_container``: the SuperNodes run in containers of that image (another architecture,
    a hard memory limit).
    """
    given = parse_config(run_config)
    output_dir = output_dir_of(run_config, output_dir)
    logs = output_dir / "logs"
    temp_state = state is None
    state = Path(tempfile.mkdtemp(prefix="fedcybgd-deploy-")) if state is None else state
    threads = max(1, (os.cpu_count() or 1) // (nodes + 1))
    defaults: dict[str, object] = {"output-dir": str(output_dir)}
    if replace_outputs and not {"output-dir", "overwrite", "resume"} & set(given):
        defaults["overwrite"] = True
    if "clients-per-round" not in parse_config(run_config):
        defaults["clients-per-round"] = min(int(app_default("clients-per-round") or nodes), nodes)
    # the folder as resolved here, whatever the ServerApp's working folder
    overrides = merge_config(merge_config(defaults, run_config),
                             format_config({"output-dir": str(output_dir)}))
    print(f"output-dir: {output_dir}", flush=True)
    print(f"logs: {logs}", flush=True)
    try:
        with LocalDeployment(state, logs, tls=tls, threads_per_process=threads,
                             node_container=node_container) as dep:
            dep.start_superlink()
            print(f"SuperLink on {'https' if tls else 'http'}://{dep.address} "
                  f"({'TLS, SuperNode authentication' if tls else 'insecure'}; state {state})",
                  flush=True)
            if tls:
                print(f"SuperNodes dial the Fleet gateway on https://{dep.fleet_address}",
                      flush=True)
            dep.start_supernodes(nodes, per_node)
            if node_container is not None:
                print(f"SuperNodes in containers: {node_container.describe()}", flush=True)
            dep.wait_nodes(nodes, timeout=600.0 if node_container else 120.0)
            print(f"{nodes} SuperNodes online; flwr run --run-config \"{overrides}\"",
                  flush=True)
            started = time.time()
            run_id = dep.submit(overrides)
            print(f"run {run_id} submitted; waiting for it to finish", flush=True)
            try:
                status = dep.wait_run(run_id, timeout=timeout)
            finally:
                run_log = dep.save_run_log(run_id)
            result = DeployResult(status, output_dir, run_log,
                                  written=written_since(output_dir, started))
            if not result.completed:
                details = str(dep.control.run_record(run_id).get("status-details", ""))
                result.reason = failure_line(details, run_log.read_text().splitlines())
    finally:
        if temp_state:
            shutil.rmtree(state, ignore_errors=True)
    return result


class Terminated(Exception):
    """A SIGTERM (or SIGHUP) arrived: unwinding stops every process the deployment started."""


def _terminate(signum: int, frame: object) -> None:
    # Raise once; a second signal during the clean-up must not cut the clean-up short.
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Run the app once on a loopback deployment; exit 0 when it finished:completed.

    Ctrl-C (exit 130) and SIGTERM or SIGHUP (exit 143), e.g. from ``systemctl stop``, ``kill``
    or a closed terminal, stop the run and every process it started before the command exits.
    """
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes to start")
    parser.add_argument("--tls", action="store_true",
                        help="HTTPS with a fresh CA and SuperNode authentication")
    parser.add_argument("--run-config", default="",
                        help="run-config overrides, e.g. "
                             "\"num-server-rounds=2 update-rule='lezo'\"")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny random model for 2 rounds: {format_config(QUICK_RUN_CONFIG)}")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="where the run writes its outputs and logs (default: "
                             "<project>/outputs/deploy-local, whose previous outputs each run "
                             "replaces; a folder given here, or output-dir in --run-config, "
                             "is never overwritten unless the run config says overwrite=true)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="keep FLWR_HOMEs, database, certificates and node caches here "
                             "(default: a temporary folder, removed at the end)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the run")
    parser.add_argument("--node-image", default=None,
                        help="run each SuperNode in a container of this image (docker, host "
                             "network), e.g. fedcybgd:0.1.0-arm64 from "
                             "scripts/prepare-docker-offline.sh --platform linux/arm64")
    parser.add_argument("--node-platform", default="",
                        help="the node image's platform, e.g. linux/arm64 (emulated on x86)")
    parser.add_argument("--node-memory", default="",
                        help="a hard memory limit per node container, e.g. 1.5g (the node "
                             "budgets within it)")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be >= 1")
    if (args.node_platform or args.node_memory) and not args.node_image:
        parser.error("--node-platform and --node-memory need --node-image")
    container = (NodeContainer(args.node_image, args.node_platform, args.node_memory)
                 if args.node_image else None)
    run_config = args.run_config
    if args.quick:
        run_config = merge_config(QUICK_RUN_CONFIG, run_config)
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _terminate) for sig in handled}
    try:
        result = run_deployment(args.nodes, run_config, args.output_dir or DEFAULT_OUTPUT_DIR,
                                tls=args.tls, state=args.state_dir, timeout=args.timeout,
                                replace_outputs=args.output_dir is None,
                                node_container=container)
    except DeployError as err:
        print(f"deploy-local failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deploy-local interrupted: the run and every process it started are stopped",
              file=sys.stderr)
        return 130
    except Terminated as why:
        print(f"deploy-local terminated ({why}): the run and every process it started are "
              "stopped", file=sys.stderr)
        return 143
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    out = result.output_dir
    print(f"status: {result.status}")
    if not result.completed:
        print(f"why: {result.reason or 'no reason given'}", file=sys.stderr)
    written = [name + ("/" if (out / name).is_dir() else "") for name in result.written]
    print(f"outputs: {out} ({', '.join(written) if written else 'nothing written by this run'})")
    print(f"logs: {out / 'logs'} ({result.run_log.name if result.run_log else 'run-*.log'}, "
          f"superlink.log, {'fleet-gateway.log, ' if args.tls else ''}"
          "supernode-*.log, flwr-cli.log)")
    return 0 if result.completed else 1


if __name__ == "__main__":
    sys.exit(main())
