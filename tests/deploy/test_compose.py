"""The docker-compose example as shipped: build arguments, published ports, node configs that fit
the default model, and private keys written 0600 atomically. No Docker engine needed (the
end-to-end run of the stack is tests/deploy/test_compose_e2e.py)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedcybgd.config import NodeConfig
from fedcybgd.deploy import certs
from fedcybgd.deploy.commands import parse_config

PROJECT = Path(__file__).resolve().parents[2]
COMPOSE = PROJECT / "docker-compose.yml"
COMPOSE_TLS = PROJECT / "docker-compose.tls.yml"
DOCKERFILE = PROJECT / "Dockerfile"


def _services(*files: Path) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = {}
    for path in files:
        for name, spec in yaml.safe_load(path.read_text())["services"].items():
            services.setdefault(name, {}).update(spec)
    return services


def _default(value: str) -> str:
    """The default of a compose ``${VAR:-default}`` / ``${VAR-default}`` value."""
    match = re.fullmatch(r"\$\{(\w+):?-(.*)\}", value)
    assert match, value
    return match.group(2)


def _clean_env() -> dict[str, str]:
    """This process's environment without the variables the compose files read."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("FEDCYBGD_") and k != "RUN_CONFIG"}


# -- build arguments -------------------------------------------------------------------------
def test_compose_build_args_default_to_the_dockerfiles() -> None:
    """Without docker-extra/build.env, `docker-compose build` builds what `docker build .` does:
    python:3.11-slim and torch from the CPU index."""
    dockerfile_args = dict(re.findall(r"^ARG (\w+)=(.*)$", DOCKERFILE.read_text(), re.M))
    assert dockerfile_args["BASE_IMAGE"] == "python:3.11-slim"
    assert dockerfile_args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    base = yaml.safe_load(COMPOSE.read_text())
    build = base["x-fedcybgd"]["build"]
    assert build["context"] == "."
    compose_args = {k: _default(v) for k, v in build["args"].items()}
    assert compose_args == {k: dockerfile_args[k] for k in compose_args}
    assert set(compose_args) == set(dockerfile_args)
    # an empty TORCH_INDEX_URL (offline: torch from FIND_LINKS) must not fall back to the index
    assert build["args"]["TORCH_INDEX_URL"].startswith("${FEDCYBGD_TORCH_INDEX_URL-")


def test_every_service_that_builds_builds_the_same_image() -> None:
    """Any service with a build section (the TLS overlay's one-shot `certs` and `register`
    too) builds fedcybgd:0.1.0 with the same arguments: a section without them would rebuild
    the shared tag with the defaults (and fail offline)."""
    base = yaml.safe_load(COMPOSE.read_text())
    expected = base["x-fedcybgd"]["build"]
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_TLS)):
        for name, spec in _services(*files).items():
            if "build" in spec:
                assert spec["build"] == expected, name
                assert spec["image"] == "fedcybgd:0.1.0", name


def test_build_context_is_the_package_and_docker_extra() -> None:
    lines = [ln.strip() for ln in (PROJECT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!fedcybgd/", "!docker-extra/"} <= set(lines)
    assert (PROJECT / "docker-extra" / "README.md").is_file()  # COPY docker-extra/ needs it


# -- ports -----------------------------------------------------------------------------------
def test_the_model_conversion_layer_copies_every_module_loading_imports() -> None:
    # Prepare: the package files the Dockerfile copies into /tmp/convert, and the fedcybgd
    # modules model/loading.py imports, followed through the modules they import
    import ast

    copied = {src for line in DOCKERFILE.read_text().splitlines()
              if line.startswith("COPY ") and line.split()[-1].startswith("/tmp/convert/")
              for src in line.split()[1:-1]}
    needed, todo = set(), ["fedcybgd/model/loading.py"]
    while todo:
        path = todo.pop()
        if path in needed:
            continue
        needed.add(path)
        package = Path(path).parent
        while package.name:  # a module's packages run their __init__ first
            needed.add(str(package / "__init__.py"))
            package = package.parent
        tree = ast.parse((PROJECT / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedcybgd"):
                module = PROJECT / Path(*node.module.split("."))
                todo.append(str((module.with_suffix(".py") if module.with_suffix(".py").exists()
                                 else module / "__init__.py").relative_to(PROJECT)))
    # Assert: every one of them is copied (a missing one fails the image build)
    assert needed - {"__init__.py"} <= copied, sorted(needed - copied - {"__init__.py"})


def test_only_the_superlink_and_the_gateway_publish_and_on_loopback_by_default() -> None:
    for files in ((COMPOSE,), (COMPOSE, COMPOSE_TLS)):
        services = _services(*files)
        published = {name: spec["ports"] for name, spec in services.items() if "ports" in spec}
        tls = COMPOSE_TLS in files
        assert sorted(published) == (["fleet-gateway", "superlink"] if tls else ["superlink"])
        (port,) = published["superlink"]
        host, _, container = port.rpartition(":")
        assert container == "8000"
        assert _default(host) == "127.0.0.1:8000"
        if tls:  # the gateway: a free loopback port unless FEDCYBGD_FLEET_PUBLISH says otherwise
            (port,) = published["fleet-gateway"]
            host, _, container = port.rpartition(":")
            assert container == "8000"
            assert host.startswith("${FEDCYBGD_FLEET_PUBLISH:-")
            assert _default(host) == "127.0.0.1:"


def test_tls_nodes_reach_only_the_gateway() -> None:
    """Under the TLS overlay the SuperNodes sit on the `fleet` network alone, where `superlink`
    is the Fleet gateway; the SuperLink (Control and Runtime APIs too) is not on it."""
    services = _services(COMPOSE, COMPOSE_TLS)
    nodes = [n for n in services if n.startswith("supernode-")]
    assert nodes
    for name in nodes:
        assert services[name]["networks"] == ["fleet"], name
        command = services[name]["command"]
        assert command[command.index("--superlink") + 1] == "superlink:8000"
        assert services[name]["depends_on"]["fleet-gateway"] == {"condition": "service_healthy"}
    gateway = services["fleet-gateway"]["networks"]
    assert gateway["fleet"] == {"aliases": ["superlink"]}
    assert "default" in gateway
    link = services["superlink"]["networks"]
    assert set(link) == {"default"}
    assert "superlink-internal" in link["default"]["aliases"]
    upstream = services["fleet-gateway"]["command"]
    assert upstream[upstream.index("--upstream") + 1] == "superlink-internal:8000"
    sans = services["certs"]["command"]
    assert {"DNS:superlink", "DNS:superlink-internal"} <= set(sans)
    for name in ("register", "runner"):  # the operator's tools stay off the fleet network
        assert "fleet" not in (services[name].get("networks") or [])


@pytest.mark.parametrize("tls", [False, True], ids=["base", "with-tls-overlay"])
def test_docker_compose_resolves_the_port_to_loopback(tls: bool) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed: `apt-get install -y docker-compose`")
    files = ["-f", str(COMPOSE)] + (["-f", str(COMPOSE_TLS)] if tls else [])
    config = subprocess.run([binary, *files, "config"], capture_output=True, text=True,
                            cwd=PROJECT, env=_clean_env(), timeout=60, check=True).stdout
    services = yaml.safe_load(config)["services"]
    assert ("fleet-gateway" in services) == tls
    if tls:
        (gateway,) = services["fleet-gateway"]["ports"]
        if isinstance(gateway, dict):
            assert (gateway.get("host_ip"), gateway["target"]) == ("127.0.0.1", 8000), gateway
            assert not gateway.get("published"), gateway  # a free port, the engine's pick
        else:
            assert str(gateway).startswith("127.0.0.1::8000"), gateway
    ports = services["superlink"]["ports"]
    assert len(ports) == 1
    port = ports[0]
    if isinstance(port, dict):  # long syntax (newer compose)
        assert (port.get("host_ip"), str(port["published"]), port["target"]) == (
            "127.0.0.1", "8000", 8000)
    else:
        assert str(port).startswith("127.0.0.1:8000:8000"), port


# -- the example's nodes fit the default model -------------------------------------------------
def _default_run_config() -> dict[str, Any]:
    pyproject = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    config: dict[str, Any] = pyproject["tool"]["flwr"]["app"]["config"]
    return config


# An allowance for what a SuperNode's own processes (flower-supernode, its SuperExec) hold in
# anonymous memory beside the ClientApp: `ps` showed 128-141 MB RSS each, shared library pages
# included (anonymous memory is less); 200 MB for the two is on the safe side of what they hold.
SUPERNODE_ANON_BYTES = 200 * 2**20


def _bytes(limit: str | int) -> int:
    """A compose ``mem_limit`` (``3g``, ``1536m``, bytes) in bytes."""
    text = str(limit).strip().lower().rstrip("b")
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get(text[-1:], 1)
    return int(float(text.rstrip("kmg")) * scale)


def test_example_nodes_fit_the_default_model() -> None:
    """Every SuperNode of the example, as configured, has an update rule that fits its memory
    budget (its container's hard limit, less the SuperNode's own processes) on every block of a
    default run: none is left out of the run it was written for.
    The estimate is the client's own (fedcybgd.memory.estimate), on SmolLM2's real shapes (a
    randomly initialised model from its config: the weights do not matter)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedcybgd.client.limits import enforced_budget
    from fedcybgd.core.measure import CgroupMemory
    from fedcybgd.memory.estimate import ModelShape, estimate_peak_mb, fitting_rule
    from fedcybgd.model.blocks import BlockMap
    from fedcybgd.model.loading import smollm2_folder

    run = _default_run_config()
    assert run["model"] == "smollm2-135m"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_folder()))
    blocks = BlockMap(model, int(run["layers-per-block"]))
    shape = ModelShape.of(model, blocks)
    cycle = blocks.cycle(bool(run["train-embeddings"]), bool(run["train-head"]))
    assert cycle

    for files in ((COMPOSE,), (COMPOSE, COMPOSE_TLS)):
        services = _services(*files)
        nodes = {}
        for name in sorted(n for n in services if n.startswith("supernode-")):
            command = services[name]["command"]
            nodes[name] = NodeConfig.from_node_config(
                parse_config(command[command.index("--node-config") + 1]))
            # the node's budget under its container's hard limit, the SuperNode process beside it
            limit = CgroupMemory(_bytes(services[name]["mem_limit"]), SUPERNODE_ANON_BYTES)
            nodes[name] = enforced_budget(nodes[name], limit)
        budgeted = {n: c for n, c in nodes.items() if c.memory_budget_mb}
        assert budgeted, "the example should show a node with a memory budget"
        for name, node in budgeted.items():
            preferred = node.update_rule or str(run["update-rule"])
            for block in cycle:
                rule = fitting_rule(shape, blocks, block, node.memory_budget_mb,
                                    int(run["batch-size"]), int(run["max-seq-len"]), preferred)
                need = estimate_peak_mb(shape, blocks, "lezo", block, int(run["batch-size"]),
                                        int(run["max-seq-len"]))
                assert rule is not None, (
                    f"{name}: memory-budget-mb={node.memory_budget_mb:.0f} fits no rule for "
                    f"{block} (lezo needs ~{need:.0f} MB)")


# -- private keys: 0600 from the first byte, written atomically ------------------------------
def test_private_keys_are_created_0600_with_o_excl(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, *args: Any, **kwargs: Any) -> int:
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(certs.os, "open", spy)
    old_umask = os.umask(0)  # the most permissive umask: the mode must not depend on it
    try:
        folder = tmp_path / "certs"
        files = certs.make_ca_and_server_cert(folder)
        key = certs.make_node_key(folder, "supernode-1")
    finally:
        os.umask(old_umask)
        monkeypatch.undo()

    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for private in (files.ca_key, files.server_key, key.private):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    for public in (files.ca_cert, files.server_cert, key.public):
        assert stat.S_IMODE(public.stat().st_mode) == 0o644, public
    # every file began as a fresh O_EXCL temporary file in the same folder, keys with mode 0600
    file_opens = [(p, f, m) for p, f, m in opened if f & os.O_CREAT]
    assert len(file_opens) == 6
    for path, flags, _mode in file_opens:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW, path
        assert Path(path).parent == folder and Path(path).name.endswith(".tmp")
    key_modes = sorted(m for _, _, m in file_opens)
    assert key_modes == [0o600] * 3 + [0o644] * 3
    assert not list(folder.glob(".*.tmp"))  # renamed into place, nothing left behind


def test_existing_key_with_lax_mode_is_tightened(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    key = certs.make_node_key(tmp_path, "supernode-1")
    key.private.chmod(0o644)  # as an older version wrote it
    before = key.private.read_bytes()
    again = certs.make_node_key(tmp_path, "supernode-1")
    assert again.private.read_bytes() == before  # kept
    assert stat.S_IMODE(key.private.stat().st_mode) == 0o600
    assert "was mode 644, now 600" in capsys.readouterr().err


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(certs.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        certs.make_node_key(tmp_path, "supernode-1")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
