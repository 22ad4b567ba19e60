"""Only the operator registers nodes or submits runs; strangers at the nodes' address cannot.

A stranger here holds what every SuperNode holds, the public ``ca.crt``, and reaches the address
the SuperNodes dial. It must not be able to list nodes or runs, register a key, submit a run,
reach the Runtime API or join as a SuperNode; the operator, at the SuperLink's own address,
still can, and an honest federation still trains. The deployment is the real one
(``LocalDeployment`` with TLS + SuperNode authentication on 127.0.0.1: ``flower-superlink``,
the Fleet gateway, ``flower-supernode`` processes and the ``flwr`` CLI); nothing is mocked.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fedcybgd.deploy import certs
from fedcybgd.deploy.commands import merge_config, node_config
from fedcybgd.deploy.control import CONNECTION, Control, DeployError, parse_json_output
from fedcybgd.deploy.local import PROJECT, LocalDeployment

NODES = 2
RUN_CONFIG: dict[str, object] = {
    "model": "tiny-llama",
    "partitioner": "iid",
    "layers-per-block": 1,
    "clients-per-block": 1,
    "num-server-rounds": 1,
    "clients-per-round": NODES,
    "eval-examples": 8,
    "local-steps": 1,
    "batch-size": 4,
    "max-seq-len": 32,
}
# What the SuperLink serves besides the Fleet API, by API: none of it at the nodes' address.
NOT_FOR_NODES = [
    ("POST", "/v1/control/list-nodes"),
    ("POST", "/v1/control/list-runs"),
    ("POST", "/v1/control/register-node"),
    ("POST", "/v1/control/start-run"),
    ("POST", "/v1/control/stop-run"),
    ("POST", "/v1/runtime/get-nodes"),
    ("POST", "/v1/runtime/acquire-task"),
    ("POST", "/v1/runtime/pull-messages"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
]


# -- fast: what the gateway forwards ---------------------------------------------------------
def test_the_gateway_forwards_the_fleet_api_and_nothing_else() -> None:
    from fedcybgd.deploy.gateway import allowed, fleet_routes

    routes = fleet_routes()
    # every call a 1.42 SuperNode makes (flwr/supernode/fleet_http_client.py)
    for path in ("register-node", "activate-node", "deactivate-node", "unregister-node",
                 "send-node-heartbeat", "pull-messages", "push-messages", "get-run", "get-fab",
                 "push-object", "pull-object", "confirm-message-received"):
        assert ("POST", f"/v1/fleet/{path}") in routes
        assert allowed("POST", f"/v1/fleet/{path}")
    assert allowed("GET", "/health") and allowed("HEAD", "/health")
    for method, path in NOT_FOR_NODES:
        assert not allowed(method, path), path
    # no prefix matching, no normalisation: only the exact route
    for method, path in [("GET", "/v1/fleet/pull-messages"), ("POST", "/v1/fleet/"),
                         ("POST", "/v1/fleet/pull-messages/"),
                         ("POST", "/v1/fleet/../control/list-nodes"),
                         ("POST", "//v1/fleet/pull-messages"),
                         ("POST", "/v1/fleet/pull-messages/../../control/start-run"),
                         ("POST", "/health"), ("DELETE", "/v1/fleet/unregister-node")]:
        assert not allowed(method, path), (method, path)


# -- end to end ------------------------------------------------------------------------------
def _dialled_address(dep: LocalDeployment) -> str:
    """The ``--superlink`` address the deployment gives its SuperNodes."""
    args = dep.supernode_args("probe", node_config(0, NODES, "/unused"), 1)
    return args[args.index("--superlink") + 1]


def _http(address: str, method: str, path: str, ca: str) -> int:
    """Status of one HTTPS request (an empty protobuf body for POST) to ``address``."""
    request = urllib.request.Request(f"https://{address}{path}", method=method,
                                     data=b"" if method == "POST" else None,
                                     headers={"content-type": "application/protobuf"})
    context = ssl.create_default_context(cafile=ca)
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def _reply(result: Any) -> dict[str, Any]:
    """The JSON a ``flwr ... --format json`` printed ({} when there is none)."""
    try:
        value = parse_json_output(result.stdout + result.stderr)
    except DeployError:
        return {}
    return value if isinstance(value, dict) else {}


def _succeeded(result: Any) -> bool:
    """Whether a ``flwr ... --format json`` command did what it was asked."""
    return result.returncode == 0 and _reply(result).get("success") is not False


def _registered(control: Control) -> list[dict[str, Any]]:
    """Every node the SuperLink knows (``flwr supernode list``), online or not."""
    nodes = _reply(control.flwr("supernode", "list", control.name, "--format", "json"))
    return list(nodes.get("nodes") or [])


def _runs(control: Control) -> list[dict[str, Any]]:
    return list(_reply(control.flwr("ls", control.name, "--format", "json")).get("runs") or [])


@pytest.mark.slow
def test_a_stranger_with_the_ca_cannot_act_at_the_nodes_address(tmp_path: Path) -> None:
    # Prepare: TLS + SuperNode authentication, two registered nodes online
    out = tmp_path / "out"
    dep = LocalDeployment(tmp_path / "state", out / "logs", tls=True, threads_per_process=1)
    try:
        dep.start_superlink()
        assert dep.cert_files is not None
        ca = str(dep.cert_files.ca_cert)  # public: every node has it
        dep.start_supernodes(NODES)
        dep.wait_nodes(NODES)
        operator = dep.control
        dialled = _dialled_address(dep)
        stranger = Control(tmp_path / "stranger", dialled, root_certificates=ca,
                           env=dep.env(tmp_path / "stranger"), log=out / "logs" / "stranger.log")
        honest = _registered(operator)
        assert len(honest) == NODES

        # Execute + Assert: the stranger at the nodes' address, with the CA only
        listed = stranger.flwr("supernode", "list", CONNECTION, "--format", "json", check=False)
        assert not _succeeded(listed), f"a stranger listed the nodes: {listed.stdout[-1500:]}"
        assert not any(str(n.get("node-id")) in listed.stdout for n in honest)
        runs = stranger.flwr("ls", CONNECTION, "--format", "json", check=False)
        assert not _succeeded(runs), f"a stranger listed the runs: {runs.stdout[-1500:]}"

        key = certs.make_node_key(tmp_path / "stranger-keys", "stranger")
        registered = stranger.flwr("supernode", "register", str(key.public), CONNECTION,
                                   "--format", "json", check=False)
        assert not _succeeded(registered), f"a stranger registered a key: {registered.stdout}"
        submitted = stranger.flwr("run", str(PROJECT), CONNECTION,
                                  "--format", "json", timeout=300, check=False)
        assert not _succeeded(submitted), f"a stranger submitted a run: {submitted.stdout}"

        for method, path in NOT_FOR_NODES:  # the APIs themselves, not only through the CLI
            assert _http(dialled, method, path, ca) == 404, (method, path)
        # what is left there: the Fleet API, which wants a registered node's signature
        assert _http(dialled, "POST", "/v1/fleet/pull-messages", ca) == 401
        assert _http(dialled, "POST", "/v1/fleet/get-fab", ca) == 401
        assert _http(dialled, "GET", "/health", ca) == 200
        # the same request reaches the SuperLink at the operator's address
        assert _http(operator.address, "POST", "/v1/control/list-nodes", ca) == 200

        # the stranger's own SuperNode, with its (unregistered) key, is refused
        rogue = dep.start_supernode("supernode-stranger", 0, NODES, key=key)
        deadline = time.monotonic() + 90
        while rogue.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rogue.exit_code() not in (None, 0), "the stranger's SuperNode was not refused"
        assert "Failed to activate" in rogue.log.read_text()
        dep.procs.pop("supernode-stranger").handle.close()

        # the operator still administers: same nodes, no run yet, and trains one round
        assert [n.get("node-id") for n in _registered(operator)] == [
            n.get("node-id") for n in honest]
        assert operator.online_nodes() == NODES
        assert _runs(operator) == []
        run_id = dep.submit(merge_config(RUN_CONFIG, f"output-dir='{out}'"))
        status = dep.wait_run(run_id, timeout=400)
        dep.save_run_log(run_id)
        assert status == "finished:completed", dep.log_tails(run_id)
        assert [int(r["run-id"]) for r in _runs(operator)] == [run_id]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        assert [r["round"] for r in rows] == [0, 1]
        assert len(rows[1]["clients"]) == NODES and rows[1]["bytes_up"] > 0
    finally:
        dep.stop()
