"""``fedcybgd node``: every input a node gives is checked and a bad one named before anything
starts; a good set prints the SuperNode it runs; and one real node joins a TLS federation
with node authentication through it."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedcybgd.cli import main
from fedcybgd.deploy import certs
from fedcybgd.deploy.commands import supernode_command


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("node")
    made = certs.make_ca_and_server_cert(folder / "certs")
    key = certs.make_node_key(folder / "keys", "node_key")
    data = folder / "mine.jsonl"
    data.write_text('{"text": "a fine film", "label": 1}\n')
    return {"ca": str(made.ca_cert), "key": str(key.private), "data": str(data),
            "folder": folder}


def _node(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["node", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_names_every_setting():
    done = subprocess.run([sys.executable, "-m", "fedcybgd.cli", "node", "--help"],
                          capture_output=True, text=True, check=True)
    for flag in ("--superlink", "--root-certificates", "--auth-key", "--data",
                 "--memory-budget-mb", "--node-key", "--config", "--dry-run"):
        assert flag in done.stdout


def test_a_good_set_prints_the_supernode_it_runs(capsys, files, tmp_path):
    code, out, err = _node(
        capsys, "--superlink", "link.example.org:9092", "--root-certificates", files["ca"],
        "--auth-key", files["key"], "--data", files["data"], "--memory-budget-mb", "1500",
        "--node-key", "site-a", "--cache-dir", str(tmp_path / "cache"), "--dry-run")
    assert (code, err) == (0, "")
    want = supernode_command(
        superlink="link.example.org:9092", port=9094,
        node_config={"data-path": str(Path(files["data"]).resolve()), "memory-budget-mb": 1500.0,
                     "node-key": "site-a", "cache-dir": str((tmp_path / "cache").resolve()),
                     "partition-id": 0, "num-partitions": 1},
        root_certificates=str(Path(files["ca"]).resolve()),
        auth_private_key=str(Path(files["key"]).resolve()))
    printed = shlex.split(out.splitlines()[-1])
    assert printed[0].endswith("flower-supernode") and printed[1:] == want[1:]


def test_a_config_file_holds_the_settings_and_flags_win(capsys, files, tmp_path):
    config = tmp_path / "node.toml"
    config.write_text(f'superlink = "127.0.0.1:9092"\nroot-certificates = "{files["ca"]}"\n'
                      f'auth-key = "{files["key"]}"\nnode-key = "from-file"\n')
    code, out, _ = _node(capsys, "--config", str(config), "--node-key", "from-flag",
                         "--dry-run")
    assert code == 0 and "node-key='from-flag'" in shlex.split(out.splitlines()[-1])[-1]
    assert "from-file" not in out
    config.write_text('superlnk = "127.0.0.1:9092"\n')
    code, _, err = _node(capsys, "--config", str(config), "--dry-run")
    assert code == 2 and "unknown setting 'superlnk'" in err


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda f: [], "--superlink is required"),
    (lambda f: ["--superlink", "link.example.org", "--insecure"], "is not HOST:PORT"),
    (lambda f: ["--superlink", "h:99999", "--insecure"], "is not HOST:PORT"),
    (lambda f: ["--superlink", "h:9092"], "either --root-certificates"),
    (lambda f: ["--superlink", "h:9092", "--insecure", "--root-certificates", f["ca"]],
     "either --root-certificates"),
    (lambda f: ["--superlink", "h:9092", "--insecure", "--auth-key", f["key"]],
     "--auth-key needs TLS"),
    (lambda f: ["--superlink", "h:9092", "--root-certificates", "/nonexistent/ca.crt"],
     "no such file (ask the operator"),
    (lambda f: ["--superlink", "h:9092", "--root-certificates", f["data"]],
     "not a PEM certificate"),
    (lambda f: ["--superlink", "h:9092", "--root-certificates", f["ca"], "--auth-key",
                f["folder"] / "missing_key"], "no such file (make one with ssh-keygen"),
    (lambda f: ["--superlink", "h:9092", "--root-certificates", f["ca"], "--auth-key",
                f["ca"]], None),  # a certificate, readable by others: refused either way
    (lambda f: ["--superlink", "h:9092", "--insecure", "--data", "/nonexistent/data.jsonl"],
     "no such file or folder"),
    (lambda f: ["--superlink", "h:9092", "--insecure", "--partition-id", "3",
                "--num-partitions", "2"], "partition-id must be in [0, num-partitions=2)"),
    (lambda f: ["--superlink", "h:9092", "--insecure", "--node-key", "bad key!"],
     "node-key must match"),
    (lambda f: ["--superlink", "h:9092", "--insecure", "--memory-budget-mb", "-5"],
     "memory-budget-mb must be"),
])
def test_bad_input_is_named_and_nothing_starts(capsys, files, make, fragment):
    code, out, err = _node(capsys, *map(str, make(files)), "--dry-run")
    assert code == 2 and out == ""
    assert err.startswith("fedcybgd node: ")
    if fragment is not None:
        assert fragment in err, err


def test_a_private_key_others_can_read_is_refused(capsys, files, tmp_path):
    key = certs.make_node_key(tmp_path, "shared_key")
    os.chmod(key.private, 0o644)
    code, _, err = _node(capsys, "--superlink", "h:9092", "--root-certificates", files["ca"],
                         "--auth-key", str(key.private), "--dry-run")
    assert code == 2 and "readable by others (mode 644)" in err and "chmod 600" in err
    os.chmod(key.private, 0o600)
    assert _node(capsys, "--superlink", "h:9092", "--root-certificates", files["ca"],
                 "--auth-key", str(key.private), "--dry-run")[0] == 0
    not_a_key = tmp_path / "not_a_key"
    not_a_key.write_text("hello\n")
    os.chmod(not_a_key, 0o600)
    code, _, err = _node(capsys, "--superlink", "h:9092", "--root-certificates", files["ca"],
                         "--auth-key", str(not_a_key), "--dry-run")
    assert code == 2 and "not an unencrypted EC private key" in err


@pytest.mark.slow
def test_a_node_joins_a_tls_federation_with_node_auth_through_the_command(tmp_path):
    from fedcybgd.deploy.local import LocalDeployment, free_port
    from tests.deploy.test_commands import stop_gracefully

    with LocalDeployment(tmp_path / "state", tmp_path / "logs", tls=True) as deployment:
        deployment.start_superlink()
        key = deployment.node_key("site-a")  # registered with the SuperLink
        assert deployment.cert_files is not None
        command = [sys.executable, "-m", "fedcybgd.cli", "node",
                   "--superlink", deployment.fleet_address,
                   "--root-certificates", str(deployment.cert_files.ca_cert),
                   "--auth-key", str(key.private), "--node-key", "site-a",
                   "--cache-dir", str(tmp_path / "cache"), "--port", str(free_port())]
        log = (tmp_path / "node.log").open("w")
        node = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**deployment.env(tmp_path / "node-home")},
                                start_new_session=True)
        try:
            deployment.control.wait_nodes(1, timeout=120)
            assert node.poll() is None  # the SuperNode runs in the command's own process
        finally:
            stop_gracefully(node)
            log.close()
        text = (tmp_path / "node.log").read_text()
        assert "fedcybgd node: the checks passed" in text


def test_the_supernode_finds_flowers_commands_in_the_nodes_own_environment(monkeypatch):
    # Prepare: this environment's folder also further down PATH
    from fedcybgd.cli.node import node_environment

    here = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", here, "/bin"]))
    # Execute
    env = node_environment()
    # Assert: first, and once (the SuperNode starts the SuperExec, the SuperExec a ClientApp
    # process, each by name)
    assert env["PATH"].split(os.pathsep) == [here, "/usr/bin", "/bin"]
    assert env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.skipif(importlib.util.find_spec("executorch") is not None,
                    reason="ExecuTorch is installed here")
def test_a_node_asking_for_executorch_where_it_is_missing_is_told_where_it_is(capsys):
    code, out, err = _node(capsys, "--superlink", "127.0.0.1:9092", "--insecure",
                           "--trainer", "executorch", "--dry-run")
    assert code == 2 and out == ""
    assert "--trainer executorch" in err and ".venv-executorch/bin/fedcybgd node" in err
    code, _, err = _node(capsys, "--superlink", "127.0.0.1:9092", "--insecure",
                         "--trainer", "tflite", "--dry-run")
    assert code == 2 and "trainer = 'tflite' is not allowed" in err
