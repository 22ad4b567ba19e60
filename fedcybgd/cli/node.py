"""``fedcybgd node``: join a federation with one command.

It checks what a node needs before starting anything, names what is wrong, prints what it will
do, and then becomes Flower's ``flower-supernode`` (the same process: signals and the exit
status are the SuperNode's). Checked, in order:

* the SuperLink address is ``HOST:PORT``;
* TLS: the CA certificate file exists and holds a PEM certificate; or ``--insecure`` (then no
  node key, which Flower refuses without TLS);
* the node's private key (``--auth-key``) exists, is not the public half (``node_key.pub``),
  is readable only by its owner (like ssh, a key others can read is refused: ``chmod 600``) and
  is an EC private key (OpenSSH or PEM);
* the node's own data (``--data``) exists and can be read, if given;
* the node config these flags make is valid (:class:`fedcybgd.config.NodeConfig`: ranges,
  names, a device the node has);
* the node's Runtime API port (``--port``) is free on 127.0.0.1: a second node on one machine
  needs a port of its own;
* ``flower-supernode`` is installed.

Every flag can also come from a TOML file (``--config node.toml``: the same names, dashes, no
leading ``--``); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import tomllib
from pathlib import Path
from typing import Any

from fedcybgd.deploy.commands import supernode_command

DEFAULT_PORT = 9094  # the node's own Runtime API port (its SuperExec dials it; local only)
RUNTIME_HOST = "127.0.0.1"  # where flower-supernode listens on that port (its default host)
# flag -> node-config key (the rest are connection settings)
NODE_KEYS = {"data": "data-path", "memory_budget_mb": "memory-budget-mb", "node_key": "node-key",
             "cache_dir": "cache-dir", "update_rule": "update-rule", "device": "device",
             "partition_id": "partition-id", "num_partitions": "num-partitions",
             "trainer": "trainer"}


class NodeSetupError(ValueError):
    """What the node was given cannot work; the message names the flag and the fix."""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``node`` subcommand's parser (``commands``: the CLI's subparsers)."""
    parser = commands.add_parser(
        "node",
        help="Join a federation: check this node's files and settings, then run a SuperNode.",
        description=(
            "Join a federation as one SuperNode. Checks the SuperLink address, the CA "
            "certificate, this node's private key (readable by you alone), its data and its "
            "node config, prints what it will run, then runs Flower's flower-supernode in "
            "its place. Ask the operator for the address and ca.crt; send them the public "
            "half of your key (node_key.pub) to register."
        ),
        epilog=("example: fedcybgd node --superlink link.example.org:9092 --root-certificates "
                "~/.fedcybgd/ca.crt --auth-key ~/.fedcybgd/node_key --data my_data.jsonl "
                "--memory-budget-mb 1500 --node-key site-a"),
    )
    parser.add_argument("--config", metavar="FILE", help="A TOML file holding any of these "
                        "settings (e.g. superlink = \"host:9092\"); flags override it.")
    parser.add_argument("--superlink", metavar="HOST:PORT",
                        help="The address the operator gave you (their Fleet gateway).")
    parser.add_argument("--root-certificates", metavar="CA_CRT",
                        help="The operator's CA certificate (PEM): the connection uses TLS.")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="No TLS (a test federation on your own machine only).")
    parser.add_argument("--auth-key", metavar="KEY", help="This node's private key (ECDSA, "
                        "e.g. ssh-keygen -t ecdsa -b 384 -N '' -f node_key), whose public half "
                        "the operator registered.")
    parser.add_argument("--data", metavar="PATH", help="This node's own training data (a file "
                        "or folder, read here and never sent); default: a partition of the "
                        "run's dataset.")
    parser.add_argument("--memory-budget-mb", type=float, metavar="MB",
                        help="Memory this node may use; it trains with a rule that fits or "
                             "declines the round.")
    parser.add_argument("--node-key", metavar="NAME", help="This node's stable name (sampling "
                        "order and seeds); default: its partition id.")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="Where the node keeps blocks (default: ~/.cache/fedcybgd).")
    parser.add_argument("--update-rule", metavar="RULE",
                        help="This node's own rule (default: the run's).")
    parser.add_argument("--device", metavar="DEVICE",
                        help="cpu, cuda, cuda:N or mps (default: the run's).")
    parser.add_argument("--trainer", metavar="TRAINER",
                        help="eager (PyTorch, the default) or executorch (the block's training "
                             "step as an ExecuTorch program: run this command from "
                             ".venv-executorch/bin, built by make executorch).")
    parser.add_argument("--partition-id", type=int, metavar="I",
                        help="This node's partition of the run's dataset (default 0).")
    parser.add_argument("--num-partitions", type=int, metavar="N",
                        help="How many partitions the dataset is cut into (default 1).")
    parser.add_argument("--port", type=int, metavar="PORT",
                        help=f"This node's local Runtime API port (default {DEFAULT_PORT}).")
    parser.add_argument("--dry-run", action="store_true", default=None,
                        help="Check and print the command, then stop.")
    return parser


def plan(settings: dict[str, Any]) -> list[str]:
    """The ``flower-supernode`` command for ``settings`` (the flags over a ``--config`` file,
    see :func:`merged`), after every check above.

    Raises
    ------
    NodeSetupError
        Something given cannot work; the message names it.
    """
    superlink = settings.get("superlink")
    if not superlink:
        raise NodeSetupError("--superlink is required: the HOST:PORT the operator gave you")
    if not re.fullmatch(r"[A-Za-z0-9.\-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}", str(superlink)) \
            or not 0 < int(str(superlink).rsplit(":", 1)[1]) < 65536:
        raise NodeSetupError(f"--superlink {superlink!r} is not HOST:PORT (e.g. "
                             "link.example.org:9092)")
    ca, insecure = settings.get("root_certificates"), bool(settings.get("insecure"))
    if bool(ca) == insecure:
        raise NodeSetupError("give either --root-certificates CA_CRT (TLS) or --insecure "
                             "(no TLS, local tests only)")
    key = settings.get("auth_key")
    if key and insecure:
        raise NodeSetupError("--auth-key needs TLS: Flower refuses node authentication "
                             "without it; give --root-certificates instead of --insecure")
    if ca:
        ca = str(_check_certificate(Path(str(ca)).expanduser()))
    if key:
        key = str(_check_private_key(Path(str(key)).expanduser()))
    values = {NODE_KEYS[flag]: settings[flag] for flag in NODE_KEYS if settings.get(flag)
              is not None}
    values.setdefault("partition-id", 0)
    values.setdefault("num-partitions", 1)
    if "data-path" in values:
        data = Path(str(values["data-path"])).expanduser()
        if not data.exists():
            raise NodeSetupError(f"--data {data}: no such file or folder")
        if not os.access(data, os.R_OK):
            raise NodeSetupError(f"--data {data}: not readable by this user")
        values["data-path"] = str(data.resolve())
    if "cache-dir" in values:
        values["cache-dir"] = str(Path(str(values["cache-dir"])).expanduser().resolve())
    from fedcybgd.config import ConfigError, NodeConfig  # torch and the rules: only here

    try:
        NodeConfig.from_node_config(values)
    except ConfigError as err:
        raise NodeSetupError(f"node config: {err}") from None
    if values.get("trainer") == "executorch":
        from fedcybgd.model.block_programs import ExecuTorchError, require_executorch

        try:
            require_executorch()
        except ExecuTorchError as err:
            raise NodeSetupError(f"--trainer executorch: {err}, and this command runs from "
                                 "there (.venv-executorch/bin/fedcybgd node)") from None
    port = int(settings.get("port") or DEFAULT_PORT)
    if not 0 < port < 65536:
        raise NodeSetupError(f"--port {port} is not a port number")
    _check_port(port)
    command = supernode_command(superlink=str(superlink), port=port, node_config=values,
                                root_certificates=ca, auth_private_key=key)
    executable = _supernode_executable()
    return [executable, *command[1:]]


def run(args: argparse.Namespace) -> int:
    """Check, print the plan, then become ``flower-supernode`` (unless ``--dry-run``)."""
    try:
        settings = merged(args)
        command = plan(settings)
    except NodeSetupError as err:
        print(f"fedcybgd node: {err}", file=sys.stderr)
        return 2
    print("fedcybgd node: the checks passed; this node will run")
    print("  " + shlex.join(command))
    if settings.get("dry_run"):
        return 0
    sys.stdout.flush()
    os.execve(command[0], command, node_environment())
    return 0  # not reached


def node_environment() -> dict[str, str]:
    """The SuperNode's environment: this one, offline (the model and data come from installed
    packages), with this environment's commands first on ``PATH``: the SuperNode starts Flower's
    SuperExec and the SuperExec a ClientApp process per message by name, and those must be this
    environment's (``.venv-executorch`` for a node with ``trainer = "executorch"``), not the
    first ``flower-superexec`` found elsewhere."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    here = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([here, *(p for p in env.get("PATH", "").split(os.pathsep)
                                          if p and p != here)])
    return env


def merged(args: argparse.Namespace) -> dict[str, Any]:
    """The flags over the ``--config`` file's settings."""
    settings: dict[str, Any] = {}
    if args.config:
        path = Path(args.config).expanduser()
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise NodeSetupError(f"--config {path}: {err}") from None
        known = {a.replace("_", "-") for a in vars(args) if a != "config"}
        for name, value in raw.items():
            if name not in known:
                raise NodeSetupError(f"--config {path}: unknown setting {name!r}; known: "
                                     f"{sorted(known)}")
            settings[name.replace("-", "_")] = value
    settings.update({k: v for k, v in vars(args).items() if v is not None})
    return settings


def _check_certificate(path: Path) -> Path:
    from cryptography import x509

    if not path.is_file():
        raise NodeSetupError(f"--root-certificates {path}: no such file (ask the operator "
                             "for ca.crt)")
    try:
        x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as err:
        raise NodeSetupError(f"--root-certificates {path}: not a PEM certificate ({err})") \
            from None
    return path.resolve()


def _check_private_key(path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not path.is_file():
        raise NodeSetupError(f"--auth-key {path}: no such file (make one with ssh-keygen -t "
                             "ecdsa -b 384 -N '' -f node_key)")
    if _is_public_key(path):
        private = path.with_suffix("") if path.suffix == ".pub" else None
        give = (f": --auth-key {private}" if private is not None and private.is_file()
                else " (the file without .pub that ssh-keygen wrote beside it)")
        raise NodeSetupError(f"--auth-key {path}: this is a public key, the half the operator "
                             f"registers; give the node's private key{give}")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise NodeSetupError(f"--auth-key {path}: readable by others (mode {mode:o}); a "
                             f"private key must be the owner's alone: chmod 600 {path}")
    data = path.read_bytes()
    key: Any = None
    for load in (serialization.load_ssh_private_key, serialization.load_pem_private_key):
        try:
            key = load(data, password=None)
            break
        except (ValueError, TypeError):
            continue
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise NodeSetupError(f"--auth-key {path}: not an unencrypted EC private key "
                             "(OpenSSH or PEM)")
    return path.resolve()


def _is_public_key(path: Path) -> bool:
    """Whether ``path`` holds a public key (OpenSSH's one line, or PEM)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        data = path.read_bytes()
    except OSError as err:
        raise NodeSetupError(f"--auth-key {path}: cannot be read ({err.strerror})") from None
    for load in (serialization.load_ssh_public_key, serialization.load_pem_public_key):
        try:
            load(data)
            return True
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue  # not this format; the private-key check below names what it is
    return False


def _check_port(port: int) -> None:
    """The Runtime API port is free where flower-supernode will listen (a listening socket
    there, such as another node's, holds it)."""
    if _port_free(port):
        return
    spare = next((p for p in range(port + 1, min(port + 100, 65536)) if _port_free(p)), None)
    raise NodeSetupError(
        f"--port {port}: {RUNTIME_HOST}:{port} is in use (another fedcybgd node or SuperNode "
        f"on this machine?); each node on a machine needs its own Runtime API port"
        + (f", e.g. --port {spare}" if spare is not None else ""))


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the SuperNode's server
        try:
            s.bind((RUNTIME_HOST, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return False
            raise NodeSetupError(f"--port {port}: cannot listen on {RUNTIME_HOST}:{port} "
                                 f"({err.strerror})") from None
    return True


def _supernode_executable() -> str:
    beside = Path(sys.executable).parent / "flower-supernode"
    if beside.is_file():
        return str(beside)
    found = shutil.which("flower-supernode")
    if found is None:
        raise NodeSetupError("flower-supernode is not installed in this environment "
                             "(pip install the project: it depends on flwr)")
    return found
