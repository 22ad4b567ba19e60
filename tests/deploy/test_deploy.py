"""Deployment Engine: real SuperLink + SuperNodes on 127.0.0.1, TLS + node auth, compose files.

The end-to-end tests start real ``flower-superlink`` / ``flower-supernode`` processes through
``fedcybgd.deploy.local.LocalDeployment`` (the library behind ``make deploy-local``), each test
with its own state folder and FLWR_HOMEs, and always stop every process they started.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, load_ssh_private_key

from fedcybgd.config import NodeConfig
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
from fedcybgd.deploy.control import DeployError
from fedcybgd.deploy.control import main as control_main
from fedcybgd.deploy.local import PROJECT, LocalDeployment

COMPOSE = PROJECT / "docker-compose.yml"
COMPOSE_TLS = PROJECT / "docker-compose.tls.yml"
NODES = 3
CONTAINER_TLS = ServerTls("/certs/ca.crt", "/certs/server.pem", "/certs/server.key")
E2E_RUN_CONFIG: dict[str, object] = {
    "model": "tiny-llama",
    "partitioner": "iid",
    "layers-per-block": 1,
    "clients-per-block": 1,
    "num-server-rounds": 2,
    "clients-per-round": 2,
    "eval-examples": 16,
    "local-steps": 2,
    "batch-size": 4,
    "max-seq-len": 48,
}


# -- fast: commands, certificates ------------------------------------------------------------
def test_config_strings_round_trip_through_flowers_parser() -> None:
    values = {"partition-id": 2, "num-partitions": 3, "cache-dir": "/a b/c",
              "update-rule": "lezo", "memory-budget-mb": 1024.0, "resume": False}
    assert parse_config(format_config(values)) == values
    assert parse_config(merge_config({"output-dir": "/o", "clients-per-round": 3},
                                     "clients-per-round=2 lr=0.1")) == {
        "output-dir": "/o", "clients-per-round": 2, "lr": 0.1}


def test_commands_refuse_auth_without_tls() -> None:
    with pytest.raises(ValueError, match="TLS"):
        superlink_command(host="h", port=1, database="d", supernode_auth=True)
    with pytest.raises(ValueError, match="TLS"):
        supernode_command(superlink="h:1", port=2, node_config={}, auth_private_key="k")


def test_a_timed_out_wait_reports_every_process_log_tail(tmp_path: Path) -> None:
    # Prepare: a deployment whose "SuperLink" is a process that prints and exits, with no
    # SuperLink to answer the CLI, so the run's status stays unknown
    dep = LocalDeployment(tmp_path / "state", tmp_path / "logs")
    try:
        proc = dep._spawn("printer", ["python", "-c", "print('\\n'.join(map(str, range(40))))"])
        proc.popen.wait(30)
        # Execute
        with pytest.raises(DeployError) as err:
            dep.wait_run(7, timeout=0.1, poll_s=0.05)
    finally:
        dep.stop()
    # Assert: the error names the stall and carries the last lines of the process's log
    text = str(err.value)
    assert "run 7 still 'unknown'" in text
    assert "printer (exit 0), last 12 lines" in text
    assert text.endswith("\n".join(map(str, range(28, 40))))
    assert "\n27\n" not in text


def test_certificates_and_node_keys(tmp_path: Path) -> None:
    files = certs.make_ca_and_server_cert(tmp_path)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink" in sans.get_values_for_type(x509.DNSName)
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert files.server_key.stat().st_mode & 0o077 == 0
    # kept, not regenerated, on a second call
    again = certs.make_ca_and_server_cert(tmp_path)
    assert again.ca_cert.read_bytes() == ca.public_bytes(Encoding.PEM)

    key = certs.make_node_key(tmp_path, "supernode-1")
    private = load_ssh_private_key(key.private.read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert private.curve.name == "secp384r1"
    assert key.public.read_text().startswith("ecdsa-sha2-nistp384 ")


# -- compose files -----------------------------------------------------------------------------
def _compose_services(*files: Path) -> dict[str, dict[str, Any]]:
    """Services after overlaying ``files`` (an overlay's ``command`` replaces the base's)."""
    services: dict[str, dict[str, Any]] = {}
    for path in files:
        for name, spec in yaml.safe_load(path.read_text())["services"].items():
            services.setdefault(name, {}).update(spec)
    return services


_VALUE_FLAGS = {"--host", "--port", "--superlink", "--database", "--ssl-ca-certfile",
                "--ssl-certfile", "--ssl-keyfile", "--root-certificates",
                "--auth-supernode-private-key", "--upstream"}


def _normalize(cmd: list[str]) -> list[str]:
    """Flags in order; values of host/port/path flags blanked; node-config reduced to the keys
    every node must declare (its optional keys are checked separately)."""
    out: list[str] = []
    it = iter(cmd)
    for token in it:
        out.append(token)
        if token in _VALUE_FLAGS:
            next(it)
            out.append("<value>")
        elif token == "--node-config":
            keys = set(parse_config(next(it)))
            out.append(" ".join(sorted(keys & {"partition-id", "num-partitions", "cache-dir"})))
    return out


@pytest.mark.parametrize("tls", [False, True], ids=["insecure", "tls"])
def test_compose_services_run_the_launchers_commands(tmp_path: Path, tls: bool) -> None:
    files = (COMPOSE, COMPOSE_TLS) if tls else (COMPOSE,)
    services = _compose_services(*files)
    nodes = sorted(n for n in services if n.startswith("supernode-"))
    assert len(nodes) == NODES
    dep = LocalDeployment(tmp_path / "state", tmp_path / "logs", tls=tls)
    try:
        assert _normalize(services["superlink"]["command"]) == _normalize(dep.superlink_args())
        # the exact container command, from the same builder the launcher uses
        assert services["superlink"]["command"] == superlink_command(
            host="0.0.0.0", port=8000, database="/state/state.db",
            tls=CONTAINER_TLS if tls else None, supernode_auth=tls)
        assert ("fleet-gateway" in services) == tls
        if tls:  # the nodes' door: the gateway forwarding the Fleet API to the SuperLink
            gateway = services["fleet-gateway"]["command"]
            assert _normalize(gateway) == _normalize(dep.gateway_args())
            assert gateway == gateway_command(host="0.0.0.0", port=8000,
                                              upstream="superlink-internal:8000",
                                              tls=CONTAINER_TLS)
        seen = []
        for i, name in enumerate(nodes):
            command = services[name]["command"]
            values = parse_config(command[command.index("--node-config") + 1])
            node = NodeConfig.from_node_config(values)  # optional keys must be valid too
            assert (node.partition_id, node.num_partitions) == (i, NODES)
            seen.append(node.partition_id)
            key = dep.node_key(name, register=False) if tls else None
            local = dep.supernode_args(name, node_config(i, NODES, "/x"), 9999, key)
            assert _normalize(command) == _normalize(local)
            assert command == supernode_command(
                superlink="superlink:8000", port=9094, node_config=values,
                root_certificates="/certs/ca.crt" if tls else None,
                auth_private_key=f"/certs/{name}" if tls else None)
        assert seen == list(range(NODES))
        assert all(services[n].get("mem_limit") for n in nodes)  # limits the kernel enforces
        runner = services["runner"]["command"]
        assert runner[:3] == ["python", "-m", "fedcybgd.deploy.control"]
        assert ("--root-certificates" in runner) == tls
        defaults = parse_config(runner[runner.index("--defaults") + 1])
        assert str(defaults["output-dir"]).startswith("/outputs/")
        assert int(str(defaults["clients-per-round"])) <= NODES
        assert services["runner"]["profiles"] == ["run"]
    finally:
        dep.stop()


@pytest.mark.parametrize("tls", [False, True], ids=["base", "with-tls-overlay"])
def test_docker_compose_accepts_the_files(tls: bool) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed: `apt-get install -y docker-compose` "
                    "(Debian's package, no Docker engine needed for `config`)")
    args = [binary, "-f", str(COMPOSE)] + (["-f", str(COMPOSE_TLS)] if tls else [])
    for extra in ([], ["--profile", "run"]):
        result = subprocess.run([*args, *extra, "config", "-q"], capture_output=True,
                                text=True, cwd=PROJECT, timeout=60, check=False)
        assert result.returncode == 0, result.stderr


# -- end to end ------------------------------------------------------------------------------
@pytest.fixture
def deployment(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalDeployment]:
    """A deployment with a private state folder; every process is stopped afterwards."""
    tls = bool(getattr(request, "param", False))
    dep = LocalDeployment(tmp_path / "state", tmp_path / "out" / "logs", tls=tls,
                          threads_per_process=1)
    request.addfinalizer(dep.stop)
    yield dep


def _check_outputs(out: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    assert [r["round"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        for key in ("bytes_down", "bytes_up", "bytes_down_raw", "bytes_up_raw"):
            assert isinstance(record[key], int) and record[key] >= 0, (key, record)
        assert record["bytes_up"] > 0
        assert len(record["clients"]) == E2E_RUN_CONFIG["clients-per-round"]
    assert records[-1]["eval_loss"] is not None
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    return records


def _submit_as_the_runner(deployment: LocalDeployment, tmp_path: Path,
                          config: dict[str, object]) -> subprocess.CompletedProcess[str]:
    """Submit ``config`` the way the compose ``runner`` service does (outputs in
    ``tmp_path/out``, the runner's own output in its ``logs/runner.log``) and wait for it."""
    out = tmp_path / "out"
    runner = subprocess.run(
        [sys.executable, "-m", "fedcybgd.deploy.control", "--superlink", deployment.address,
         "--flwr-home", str(tmp_path / "runner-home"), "--timeout", "300",
         "run", "--app", str(PROJECT), "--nodes", str(NODES),
         "--defaults", f"output-dir='{out}' clients-per-round={NODES}",
         "--run-config", format_config(config)],
        capture_output=True, text=True, timeout=400, env=deployment.env(tmp_path / "runner"),
        check=False)
    (out / "logs" / "runner.log").write_text(runner.stdout + runner.stderr)
    return runner


@pytest.mark.slow
def test_e2e_superlink_and_three_supernodes(deployment: LocalDeployment,
                                            tmp_path: Path) -> None:
    """Insecure: the run is submitted the way the compose ``runner`` service does it."""
    out = tmp_path / "out"
    deployment.start_superlink()
    deployment.start_supernodes(NODES, per_node={2: {"memory_budget_mb": 4096.0}})
    deployment.wait_nodes(NODES)
    runner = _submit_as_the_runner(deployment, tmp_path, E2E_RUN_CONFIG)
    assert runner.returncode == 0, runner.stdout[-3000:] + runner.stderr[-3000:]
    assert "status: finished:completed" in runner.stdout
    _check_outputs(out)
    assert all(p.exit_code() is None for p in deployment.procs.values())


@pytest.mark.slow
@pytest.mark.parametrize("deployment", [True], indirect=True, ids=["tls"])
def test_e2e_tls_with_supernode_auth(deployment: LocalDeployment, tmp_path: Path) -> None:
    """TLS + SuperNode authentication: registered nodes train; an unregistered one is refused."""
    out = tmp_path / "out"
    deployment.start_superlink()
    assert deployment.cert_files is not None
    ca = str(deployment.cert_files.ca_cert)
    assert control_main(["--superlink", deployment.address, "--root-certificates", ca,
                         "health"]) == 0
    assert control_main(["--superlink", deployment.address, "health"]) == 1  # not plain HTTP

    rogue_key = certs.make_node_key(deployment.state / "keys", "rogue")  # never registered
    rogue = deployment.start_supernode("supernode-rogue", 0, NODES, key=rogue_key)
    deployment.start_supernodes(NODES)  # keys made and registered with `flwr supernode register`
    deadline = time.monotonic() + 90
    while rogue.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rogue.exit_code() not in (None, 0), "an unregistered SuperNode was not refused"
    assert "305" in rogue.log.read_text() or "Failed to activate" in rogue.log.read_text()
    deployment.procs.pop("supernode-rogue").handle.close()

    deployment.wait_nodes(NODES)
    assert deployment.control.online_nodes() == NODES  # the rogue never came online
    run_id = deployment.submit(merge_config(E2E_RUN_CONFIG, f"output-dir='{out}'"))
    status = deployment.wait_run(run_id, timeout=300)
    deployment.save_run_log(run_id)
    assert status == "finished:completed", (out / "logs").as_posix()
    _check_outputs(out)


@pytest.mark.slow
def test_deploy_local_stops_every_process_on_sigterm(tmp_path: Path) -> None:
    """``kill`` / ``systemctl stop`` of deploy-local: exit 143, nothing it started is left."""
    import queue
    import signal
    import threading

    import psutil

    cmd = [sys.executable, "-m", "fedcybgd.deploy.local", "--quick", "--nodes", "1",
           "--output-dir", str(tmp_path / "out"), "--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],  # type: ignore[union-attr]
                     daemon=True).start()
    seen: list[str] = []
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not any("SuperNodes online" in line for line in seen):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1.0))
        started = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "flower-superlink" in names and "flower-supernode" in names, names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
        _, alive = psutil.wait_procs(started, timeout=15)
        assert alive == [], [p.cmdline() for p in alive]
        time.sleep(0.5)  # the reader thread drains the pipe
        while not lines.empty():
            seen.append(lines.get())
        assert "deploy-local terminated (SIGTERM)" in "".join(seen), "".join(seen)[-2000:]
    finally:  # a failed check leaves nothing running either
        if proc.poll() is None:
            proc.kill()
        for leftover in started:
            with contextlib.suppress(psutil.Error):
                leftover.kill()


@pytest.mark.slow
def test_e2e_language_modelling_on_a_built_in_corpus_by_play(deployment: LocalDeployment,
                                                              tmp_path: Path) -> None:
    """The ``lm`` task on real SuperNodes: Shakespeare's plays, each node its own plays, the
    held-out loss per token, the perplexity and the reference text's loss in every evaluation."""
    out = tmp_path / "out"
    deployment.start_superlink()
    deployment.start_supernodes(NODES)
    deployment.wait_nodes(NODES)
    config = {**E2E_RUN_CONFIG, "task": "lm", "dataset": "shakespeare", "partitioner": "movie",
              "reference-dataset": "rotten-tomatoes"}
    runner = _submit_as_the_runner(deployment, tmp_path, config)
    assert runner.returncode == 0, runner.stdout[-3000:] + runner.stderr[-3000:]
    assert "status: finished:completed" in runner.stdout
    records = _check_outputs(out)
    for record in (records[0], records[-1]):
        assert record["eval_perplexity"] > 1 and record["eval_reference_loss"] > 0
    assert records[-1]["eval_loss"] != records[0]["eval_loss"]
