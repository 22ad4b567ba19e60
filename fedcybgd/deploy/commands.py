"""The argument lists of ``flower-superlink``, ``flower-supernode`` and the ``flwr`` connection.

One source for every deployment: the loopback launcher runs these lists as processes, and
``docker-compose.yml`` spells out the same lists for containers (a test compares them). Values are
strings so that container paths (``/certs/ca.crt``) and host paths fit alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

SUPERLINK_PORT = 8000  # Fleet + Control + Runtime APIs, one HTTP(S) port (flwr >= 1.40)
SUPERNODE_PORT = 9094  # a SuperNode's Runtime API, for the SuperExec it spawns


@dataclass(frozen=True)
class ServerTls:
    """The SuperLink's TLS files: the CA that signed its certificate, the certificate, its key."""

    ca: str
    cert: str
    key: str


def toml_value(value: object) -> str:
    """A node-config / run-config value as Flower parses it (a TOML scalar)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"'{value}'" if "'" not in value else json.dumps(value)
    raise TypeError(f"config values are bool, int, float or str, got {value!r}")


def format_config(values: Mapping[str, object]) -> str:
    """``{"partition-id": 0, "cache-dir": "/c"}`` -> ``partition-id=0 cache-dir='/c'``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in values.items())


def parse_config(text: str) -> dict[str, object]:
    """``"k=1 s='x'"`` -> ``{"k": 1, "s": "x"}``, the way ``flwr`` parses ``--run-config``."""
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text])) if text.strip() else {}


def merge_config(defaults: Mapping[str, object] | str, overrides: str) -> str:
    """``defaults`` overridden key by key by ``overrides`` (a key twice is an error in flwr)."""
    merged = parse_config(defaults) if isinstance(defaults, str) else dict(defaults)
    merged.update(parse_config(overrides))
    return format_config(merged)


def superlink_command(
    *,
    host: str,
    port: int,
    database: str,
    tls: ServerTls | None = None,
    supernode_auth: bool = False,
) -> list[str]:
    """``flower-superlink`` with its arguments.

    Runtime dependency installation stays off: it would ``uv sync`` the app's requirements for
    every run and pull a multi-GB CUDA torch; the app's dependencies are installed already.
    """
    if supernode_auth and tls is None:
        raise ValueError("SuperNode authentication needs TLS (flower-superlink exits 104)")
    cmd = ["flower-superlink"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", tls.ca, "--ssl-certfile", tls.cert, "--ssl-keyfile", tls.key]
    if supernode_auth:
        cmd.append("--enable-supernode-auth")
    cmd += [
        "--disable-runtime-dependency-installation",
        "--host", host,
        "--port", str(port),
        "--database", database,
    ]
    return cmd


def gateway_command(*, host: str, port: int, upstream: str, tls: ServerTls) -> list[str]:
    """The Fleet gateway (``fedcybgd.deploy.gateway``): the address SuperNodes dial.

    It serves ``tls.cert`` on ``host:port`` and forwards only the Fleet API (and ``/health``) to
    the SuperLink at ``upstream`` (``host:port``), whose certificate it checks against
    ``tls.ca``. The SuperLink's Control and Runtime APIs stay off this address.
    """
    return [
        "python", "-m", "fedcybgd.deploy.gateway",
        "--host", host,
        "--port", str(port),
        "--upstream", upstream,
        "--ssl-ca-certfile", tls.ca,
        "--ssl-certfile", tls.cert,
        "--ssl-keyfile", tls.key,
    ]


def supernode_command(
    *,
    superlink: str,
    port: int,
    node_config: Mapping[str, object],
    root_certificates: str | None = None,
    auth_private_key: str | None = None,
) -> list[str]:
    """``flower-supernode`` with its arguments.

    ``superlink`` is ``host:port`` of the SuperLink (no scheme); ``port`` is this node's own
    Runtime API port (its SuperExec connects there). ``auth_private_key`` needs TLS.
    """
    if auth_private_key and not root_certificates:
        raise ValueError("SuperNode authentication needs TLS (pass root_certificates)")
    cmd = ["flower-supernode"]
    if root_certificates is None:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", root_certificates]
    if auth_private_key:
        cmd += ["--auth-supernode-private-key", auth_private_key]
    cmd += [
        "--superlink", superlink,
        "--port", str(port),
        "--node-config", format_config(node_config),
    ]
    return cmd


def node_config(
    partition_id: int,
    num_partitions: int,
    cache_dir: str,
    **extra: object,
) -> dict[str, object]:
    """A SuperNode's ``--node-config`` (see :class:`fedcybgd.config.NodeConfig`).

    ``extra`` takes the optional per-node keys with underscores, e.g. ``update_rule="lezo"``,
    ``memory_budget_mb=1024``.
    """
    values: dict[str, object] = {
        "partition-id": partition_id,
        "num-partitions": num_partitions,
        "cache-dir": cache_dir,
    }
    values.update({key.replace("_", "-"): value for key, value in extra.items()})
    return values


def connection_toml(name: str, address: str, root_certificates: str | None = None) -> str:
    """A Flower configuration (``$FLWR_HOME/config.toml``) with one SuperLink connection."""
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]",
             f'address = "{address}"']
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {json.dumps(root_certificates)}")
    return "\n".join(lines) + "\n"
