"""docker-compose for real: build the image, bring up the SuperLink and three SuperNodes, train.

The container tier (``make test-containers``; .ci/run runs it after ``make test``).

On a local Docker engine (started by scripts/prepare-docker-offline.sh when it is installed but
not running; a base image made with debootstrap when none can be pulled):

1. build ``fedcybgd:0.1.0`` (``docker-compose build``, the layer cache keeps a rebuild short);
2. plain stack: ``up -d`` (SuperLink + 3 SuperNodes), the one-shot ``runner`` trains a tiny model
   for two rounds, ``outputs/compose/metrics.jsonl`` and ``final/`` are checked, ``down -v``;
3. TLS overlay: ``certs`` writes the CA, server certificate and node keys (private keys 0600),
   ``register`` registers the three node keys, the published port answers HTTPS only and on
   127.0.0.1 only, a SuperNode with an unregistered key is refused, the runner trains and the
   outputs are checked, ``down -v``.

Each stack is its own compose project (own network and volumes) with the SuperLink published
on a free loopback port and /outputs in a kept temporary folder (with every command's log).
Skipped, with the reason in the warnings summary, where no engine can run (no docker CLI /
docker-compose, or dockerd neither running nor startable: not root, not installed). Durations
are printed (``-s``) and written to ``compose-e2e-timings.json`` in the stack's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcybgd.deploy import certs
from fedcybgd.deploy.commands import format_config
from fedcybgd.deploy.control import healthy
from fedcybgd.deploy.local import QUICK_RUN_CONFIG, NodeContainer, run_deployment

PROJECT = Path(__file__).resolve().parents[2]
PREPARE = PROJECT / "scripts" / "prepare-docker-offline.sh"
BUILD_ENV = PROJECT / "docker-extra" / "build.env"
IMAGE = "fedcybgd:0.1.0"
NODES = 3
# The launcher's quick run (a 4-layer random Llama, 2 rounds), on IID partitions.
RUN_CONFIG: dict[str, object] = {**QUICK_RUN_CONFIG, "partitioner": "iid"}
TIMINGS: dict[str, float] = {}

# A cold build is ~4 min; each stack 2-5 min on 2 idle cores, far more on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(3600)]
RUN_TIMEOUT_S = 1500


def _skip(reason: str) -> None:
    """Skip and say why where `pytest -q` shows it (the warnings summary)."""
    warnings.warn(f"docker-compose end-to-end test skipped: {reason}", stacklevel=2)
    pytest.skip(reason)


def _engine_unavailable() -> str | None:
    """Why no Docker engine can run here, or None."""
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return (f"no `{tool}` command (Debian: apt-get install docker.io docker-compose "
                    "debootstrap; .ci/run does this as root)")
    running = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60,
                             check=False).returncode == 0
    if running:
        return None
    if shutil.which("dockerd") is None:
        return "the Docker engine is not running and dockerd is not installed"
    if os.geteuid() != 0:
        return "the Docker engine is not running and starting dockerd needs root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(name: str, start: float) -> None:
    TIMINGS[name] = round(time.monotonic() - start, 1)
    print(f"[compose-e2e] {name}: {TIMINGS[name]:.1f} s", flush=True)


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The engine running, the build arguments for this machine, the image built."""
    reason = _engine_unavailable()
    if reason:
        _skip(reason)
    start = time.monotonic()
    prep = subprocess.run(["bash", str(PREPARE), "--no-build", "--quiet"], capture_output=True,
                          text=True, timeout=1200, check=False)
    print(prep.stdout, prep.stderr, flush=True)
    assert prep.returncode == 0, f"prepare-docker-offline.sh failed:\n{prep.stdout}{prep.stderr}"
    _timed("prepare", start)
    start = time.monotonic()
    # One service builds the image all of them use (every service has the same build section).
    build = subprocess.run(["docker-compose", "--env-file", str(BUILD_ENV), "build",
                            "superlink"], cwd=PROJECT, capture_output=True, text=True,
                           timeout=1800, check=False)
    assert build.returncode == 0, f"build failed:\n{build.stdout[-5000:]}{build.stderr[-5000:]}"
    _timed("build", start)
    size = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", IMAGE],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    TIMINGS["image_size_mb"] = round(int(size) / 1e6)
    print(f"[compose-e2e] image {IMAGE}: {TIMINGS['image_size_mb']} MB", flush=True)
    yield IMAGE


class Stack:
    """One compose project: its own network, volumes, loopback port and outputs folder.

    Its folder (outputs, one log per compose command, every service's log) is a fresh one in the
    system's temporary folder, kept after the test (pytest's own temporary folders are pruned
    by later sessions) and printed at the start."""

    def __init__(self, name: str, tls: bool) -> None:
        self.name = name
        self.project = f"fedcybgde2e{name}{os.getpid()}"
        self.files = ["-f", "docker-compose.yml"] + (
            ["-f", "docker-compose.tls.yml"] if tls else [])
        self.port = _free_port()
        self.folder = Path(tempfile.mkdtemp(prefix=f"fedcybgd-compose-e2e-{name}-"))
        print(f"[compose-e2e] {name}: project {self.project}, logs and outputs in {self.folder}",
              flush=True)
        self.outputs = self.folder / "outputs"
        self.outputs.mkdir()
        os.chown(self.outputs, 1000, 1000)  # the image's user writes the run's outputs
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FEDCYBGD_")}
        self.env.update(FEDCYBGD_PUBLISH=f"127.0.0.1:{self.port}",
                        FEDCYBGD_OUTPUTS=str(self.outputs),
                        RUN_CONFIG=format_config(RUN_CONFIG))
        self.calls = 0

    def compose(self, *args: str, timeout: float = 600,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one docker-compose command; its output goes to a log file as it comes (a command
        that times out leaves what it printed), and is returned as ``stdout``."""
        cmd = ["docker-compose", "-p", self.project, *self.files, "--env-file", str(BUILD_ENV),
               *args]
        self.calls += 1
        subcommand = next((a for a in args if a in ("up", "run", "port", "exec", "down")), "x")
        log = self.folder / f"{self.calls:02d}-{subcommand}.log"
        header = f"$ {' '.join(cmd)}\n"
        with log.open("w") as out:
            out.write(header)
            out.flush()
            try:
                code = subprocess.run(cmd, cwd=PROJECT, env=self.env, stdout=out,
                                      stderr=subprocess.STDOUT, timeout=timeout,
                                      check=False).returncode
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{' '.join(args)} did not finish in {timeout:.0f} s (log: {log}):\n"
                    f"{log.read_text()[-4000:]}\n{self.service_logs()}") from None
        text = log.read_text()[len(header):]
        if check and code != 0:
            raise AssertionError(f"{' '.join(args)} exited {code} (log: {log}):\n"
                                 f"{text[-4000:]}\n{self.service_logs()}")
        return subprocess.CompletedProcess(cmd, code, text, "")

    def service_logs(self, tail: int = 60) -> str:
        """The last lines of every service's log; all of it is saved in services.log."""
        result = subprocess.run(
            ["docker-compose", "-p", self.project, *self.files, "--env-file", str(BUILD_ENV),
             "logs", "--no-color", "--timestamps"], cwd=PROJECT, env=self.env,
            capture_output=True, text=True, timeout=120, check=False)
        (self.folder / "services.log").write_text(result.stdout + result.stderr)
        return "\n".join(result.stdout.splitlines()[-tail:])

    def down(self) -> None:
        self.compose("--profile", "run", "down", "-v", "--remove-orphans", timeout=300)


@pytest.fixture
def stack(request: pytest.FixtureRequest, image: str) -> Iterator[Stack]:
    tls = bool(request.param)
    s = Stack("tls" if tls else "plain", tls)
    try:
        yield s
    finally:
        s.service_logs()
        start = time.monotonic()
        s.down()
        _timed(f"{s.name}: down -v", start)
        leftovers = subprocess.run(
            ["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project="
             f"{s.project}"], capture_output=True, text=True, timeout=60, check=True).stdout
        (s.folder / "compose-e2e-timings.json").write_text(json.dumps(TIMINGS, indent=1))
        assert not leftovers.strip(), f"containers left behind: {leftovers}"


def _up_and_train(s: Stack, label: str) -> Path:
    start = time.monotonic()
    s.compose("up", "-d", timeout=900)
    _timed(f"{label}: up -d", start)
    published = s.compose("port", "superlink", "8000").stdout.strip()
    assert published == f"127.0.0.1:{s.port}", published  # loopback only
    assert healthy(published, timeout=10)

    start = time.monotonic()
    runner = s.compose("--profile", "run", "run", "--rm", "-T", "runner",
                       timeout=RUN_TIMEOUT_S, check=False)
    _timed(f"{label}: runner (2 rounds, tiny-llama)", start)
    assert runner.returncode == 0, runner.stdout[-5000:] + s.service_logs()
    assert "status: finished:completed" in runner.stdout
    return s.outputs / "compose"


def _check_outputs(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    assert [r["round"] for r in rows] == [0, 1, 2], rows
    for row in rows[1:]:
        assert row["bytes_up"] > 0
        assert len(row["clients"]) == NODES, row  # all three SuperNodes trained each round
    assert rows[-1]["eval_loss"] is not None
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    final = out / "final"
    assert final.is_dir() and any(final.iterdir()), f"no final model in {final}"


@pytest.mark.parametrize("stack", [False], indirect=True, ids=["plain"])
def test_compose_stack_trains(stack: Stack) -> None:
    out = _up_and_train(stack, "plain")
    _check_outputs(out)


@pytest.mark.parametrize("stack", [True], indirect=True, ids=["tls"])
def test_compose_tls_stack_trains_and_refuses_an_unregistered_node(stack: Stack) -> None:
    start = time.monotonic()
    stack.compose("up", "-d", timeout=900)
    _timed("tls: up -d (certs, register, 3 nodes)", start)
    published = stack.compose("port", "superlink", "8000").stdout.strip()
    assert published == f"127.0.0.1:{stack.port}", published

    # the certs volume: private keys 0600, public files 0644 (as the image's user wrote them)
    modes = stack.compose("exec", "-T", "superlink", "stat", "-c", "%a %n", "/certs/ca.key",
                          "/certs/server.key", "/certs/supernode-1", "/certs/ca.crt",
                          "/certs/supernode-1.pub").stdout.split("\n")
    modes = [m for m in modes if m.strip()]
    assert [m.split()[0] for m in modes] == ["600", "600", "600", "644", "644"], modes

    # the published port answers HTTPS (the CA's certificate, SAN IP:127.0.0.1), not HTTP
    ca = stack.folder / "ca.crt"
    ca.write_text(stack.compose("exec", "-T", "superlink", "cat", "/certs/ca.crt").stdout)
    address = f"127.0.0.1:{stack.port}"
    assert healthy(address, root_certificates=str(ca), timeout=10)
    assert not healthy(address, timeout=10)

    # a SuperNode whose key was never registered is refused (flower-supernode exits, 305)
    rogue = stack.folder / "rogue"
    key = certs.make_node_key(rogue, "rogue")
    for path in (rogue, key.private, key.public):
        os.chown(path, 1000, 1000)
    start = time.monotonic()
    refused = stack.compose(
        "run", "--rm", "-T", "--no-deps", "-v", f"{rogue}:/rogue:ro", "supernode-1",
        "flower-supernode", "--root-certificates", "/certs/ca.crt",
        "--auth-supernode-private-key", "/rogue/rogue", "--superlink", "superlink:8000",
        "--port", "9094", "--node-config", "partition-id=0 num-partitions=3 cache-dir='/tmp'",
        timeout=300, check=False)
    _timed("tls: unregistered node refused", start)
    text = refused.stdout
    assert refused.returncode != 0, text[-3000:]
    assert "305" in text or "Failed to activate" in text, text[-3000:]

    start = time.monotonic()
    runner = stack.compose("--profile", "run", "run", "--rm", "-T", "runner",
                           timeout=RUN_TIMEOUT_S, check=False)
    _timed("tls: runner (2 rounds, tiny-llama)", start)
    assert runner.returncode == 0, runner.stdout[-5000:] + stack.service_logs()
    assert "status: finished:completed" in runner.stdout
    _check_outputs(stack.outputs / "compose")


def test_a_node_under_a_hard_memory_limit_budgets_within_it(image: str, tmp_path: Path) -> None:
    """A SuperNode in a container the kernel limits to 1.5 GB, SmolLM2 at the app's defaults
    (`fo` asked): the node reads the limit, takes a rule that fits where `fo` does not, and every
    round finishes under the limit (an OOM kill would lose the round's reply)."""
    # Prepare: one node, its container limited (swap included) to 1.5 GB
    limit_mb = 1536
    node = NodeContainer(image, memory=f"{limit_mb}m")
    # Execute: two rounds on the loopback deployment, the node in its container
    start = time.monotonic()
    result = run_deployment(1, "num-server-rounds=2 eval-examples=16", tmp_path / "out",
                            node_container=node, timeout=RUN_TIMEOUT_S)
    _timed("memory limit: 2 rounds of SmolLM2 in 1.5 GB", start)
    # Assert: completed; each round answered by the node, under the limit; the budget the limit
    # set moved the node off `fo` where `fo` does not fit
    assert result.completed, f"{result.status}: {result.reason}"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    trained = [r for r in rows if r["round"] >= 1]
    assert len(trained) == 2 and all(r.get("update_rule") for r in trained), trained
    peaks = [r["client_peak_mem_mb"] for r in trained]
    assert max(peaks) < limit_mb, peaks
    rules = {rule for r in trained for rule in r["update_rule"]}
    assert rules - {"fo"}, rules
    print(f"[compose-e2e] memory limit {limit_mb} MB: rules {sorted(rules)}, peaks {peaks} MB",
          flush=True)
