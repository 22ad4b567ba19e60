"""A resume continues the run its checkpoint was made by, or refuses by name: the summary of a
resumed finished run is the uninterrupted one's, a changed run config is refused naming each
key, tensors are checked against the model, and any malformed checkpoint is a CheckpointError
naming the file."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from fedcybgd.client.app import app as client_app
from fedcybgd.config import ConfigError, RunConfig
from fedcybgd.core.checksum import content_checksum
from fedcybgd.harness.loopback import LoopbackGrid
from fedcybgd.model.blocks import BlockMap
from fedcybgd.model.loading import load_model
from fedcybgd.server.app import build_strategy, run_server
from fedcybgd.server.checkpoint import Checkpointer, CheckpointError, block_file
from fedcybgd.server.resume import (
    HARMLESS_CHANGES,
    ResumeRefused,
    check_run_config,
    read_checkpoint,
)

FUZZ_SCALE = int(os.environ.get("FEDCYBGD_FUZZ_SCALE", "1"))
# tests/conftest.py's tiny_run_config, for the runs this module shares
TINY: dict[str, Any] = {
    "model": "tiny-llama", "partitioner": "iid", "num-server-rounds": 2,
    "clients-per-round": 2, "clients-per-block": 1, "block-schedule": "ascending",
    "layers-per-block": 1, "train-embeddings": False, "train-head": False,
    "update-rule": "fo", "local-steps": 2, "batch-size": 4, "max-seq-len": 48, "lr": 1e-3,
    "eval-every": 1, "eval-examples": 16, "eval-batch-size": 16, "seed": 0,
}
# summary.json keys that differ between any two runs (clocks, memory measured, folders,
# this start's resume)
UNSHARED = ("wall_s", "mean_round_s", "client_peak_mem_mb", "output_dir", "run_config",
            "segments")


class ServerKilled(BaseException):
    """Stands for SIGKILL: nothing in the server may catch it."""


def run(config: dict[str, Any], cache: Path,
        on_checkpoint_file: Callable[[Path], None] | None = None) -> dict[str, Any]:
    grid = LoopbackGrid(client_app, 4, config, node_config=lambda i: {"cache-dir": str(cache)})
    return run_server(grid, RunConfig.from_run_config(config),
                      on_checkpoint_file=on_checkpoint_file)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def shared(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in UNSHARED}


def files(out: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path]]:
    """A finished 2-round run (its config and output folder; its nodes' cache beside it):
    copy it before changing it."""
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1
    root = tmp_path_factory.mktemp("finished")
    config = dict(TINY, **{"output-dir": str(root / "out")})
    run(config, root / "cache")
    yield config, root / "out"


@pytest.fixture
def copy_of(finished: tuple[dict[str, Any], Path], tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """The finished run copied here with its nodes' cache (``out.parent / "cache"``: the
    nodes keep what they hold across a server restart), and the config that resumes it."""
    config, out = finished
    shutil.copytree(out, tmp_path / "out")
    shutil.copytree(out.parent / "cache", tmp_path / "cache")
    return dict(config, **{"output-dir": str(tmp_path / "out"), "resume": True}), tmp_path / "out"


def edit_state(out: Path, change: Callable[[dict[str, Any]], object]) -> None:
    path = out / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))


def resave_block(out: Path, block: str,
                 change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """Rewrite ``block``'s file as ``change`` says, with a consistent checksum everywhere (the
    file name, its entry, the strategy's record): only the tensors themselves are wrong."""
    folder = out / "checkpoint"
    state = json.loads((folder / "state.json").read_text())
    entry = state["blocks"][block]
    old = folder / entry["file"]
    tensors = change(load_file(str(old)))
    checksum = content_checksum(tensors)
    new = folder / block_file(block, entry["version"], checksum)
    save_file(tensors, str(new))
    old.unlink()
    entry.update(checksum=checksum, file=new.name)
    state["strategy"]["checksums"][block] = checksum
    (folder / "state.json").write_text(json.dumps(state))
    return new


# ------------------------------------------------------------------------------- summary


def test_resuming_a_run_killed_after_its_last_checkpoint_writes_the_uninterrupted_summary(
        finished, tmp_path):
    # Prepare: the same run killed right after the last round's state.json
    config, straight = finished
    killed = dict(config, **{"output-dir": str(tmp_path / "killed")})
    saves = []

    def kill(path: Path) -> None:
        if path.name == "state.json":
            saves.append(path)
            if len(saves) == config["num-server-rounds"]:
                raise ServerKilled

    with pytest.raises(ServerKilled):
        run(killed, tmp_path / "cache", on_checkpoint_file=kill)
    assert not (tmp_path / "killed" / "summary.json").exists()
    # Execute
    summary = run(dict(killed, resume=True), tmp_path / "cache")
    # Assert: the summary the uninterrupted run wrote; its final evaluation is the last round's
    expected = json.loads((straight / "summary.json").read_text())
    written = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert shared(written) == shared(expected)
    assert summary["final_eval_loss"] == rows(tmp_path / "killed")[-1]["eval_loss"]
    assert summary["final_eval_loss"] != summary["initial_eval_loss"]


def test_a_finished_checkpoint_without_its_last_evaluation_is_evaluated_again(copy_of,
                                                                               finished):
    # Prepare: a checkpoint as written before it kept the last evaluation; the run's summary
    # and final model lost (killed before they were written)
    config, out = copy_of
    edit_state(out, lambda s: s.pop("last_eval"))
    (out / "summary.json").unlink()
    shutil.rmtree(out / "final")
    # Execute
    summary = run(config, out.parent / "cache")
    # Assert: the final evaluation is that of the checkpoint's model, as uninterrupted
    expected = json.loads((finished[1] / "summary.json").read_text())
    assert shared(summary) == shared(expected)
    assert summary["final_eval_loss"] != summary["initial_eval_loss"]


# ------------------------------------------------------------------------------- run config


@pytest.mark.parametrize("changes", [
    {"seed": 1},
    {"upload-codec": "delta+int8+zstd"},
    {"outlier-factor": 5.0},
    {"layers-per-block": 2},
    {"seed": 3, "lr": 0.01, "zo-eps": 0.01},
], ids=lambda c: ",".join(c))
def test_a_resume_with_a_history_changing_key_is_refused_naming_each(copy_of, changes):
    # Prepare
    config, out = copy_of
    old = RunConfig.from_run_config(config).to_run_config()
    before = files(out)
    # Execute
    with pytest.raises(ResumeRefused) as refused:
        run(dict(config, **changes), out.parent / "cache")
    # Assert: every changed key named with both values; nothing touched
    for key, value in changes.items():
        assert f"{key}: {old[key]!r} -> {value!r}" in str(refused.value)
    assert isinstance(refused.value, ConfigError)
    assert files(out) == before


def test_harmless_changes_resume_to_the_uninterrupted_model(copy_of, tmp_path):
    # Prepare: the uninterrupted 3-round run
    config, out = copy_of
    straight = dict(TINY, **{"num-server-rounds": 3, "output-dir": str(tmp_path / "straight")})
    run(straight, tmp_path / "cache-a")
    # Execute: the finished 2-round run goes on, moved, with other evaluation and waiting
    moved = tmp_path / "moved"
    out.rename(moved)
    run(dict(config, **{"num-server-rounds": 3, "output-dir": str(moved), "eval-every": 0,
                        "eval-batch-size": 8, "eval-cache": False, "round-timeout": 99.0}),
        tmp_path / "cache")
    # Assert
    assert [r["round"] for r in rows(moved)] == [0, 1, 2, 3]
    a, b = load_model(str(tmp_path / "straight" / "final")), load_model(str(moved / "final"))
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(),
                                                     strict=True))


def test_num_server_rounds_may_change_only_under_a_constant_learning_rate(tmp_path):
    # Prepare
    constant = RunConfig(num_server_rounds=4)
    cosine = RunConfig(num_server_rounds=4, lr_schedule="cosine")
    # Execute / Assert: a longer run is fine at a constant rate, refused under a decay
    check_run_config(constant.to_run_config(), RunConfig(num_server_rounds=6), 2, tmp_path)
    with pytest.raises(ResumeRefused, match="num-server-rounds: 4 -> 6"):
        check_run_config(cosine.to_run_config(),
                         RunConfig(num_server_rounds=6, lr_schedule="cosine"), 2, tmp_path)
    # a run shorter than the checkpoint is refused too
    with pytest.raises(ResumeRefused, match=r"num-server-rounds = 1.*after round 2"):
        check_run_config(constant.to_run_config(), RunConfig(num_server_rounds=1), 2, tmp_path)


def test_a_key_the_checkpoint_lacks_counts_as_its_default(tmp_path):
    # Prepare: a run config stored before the key "eval-precision" existed
    saved = RunConfig().to_run_config()
    del saved["eval-precision"]
    # Execute / Assert: its default matches, anything else is a change
    check_run_config(saved, RunConfig(), 1, tmp_path)
    with pytest.raises(ResumeRefused, match="eval-precision: 'float32' -> 'frozen'"):
        check_run_config(saved, RunConfig(eval_precision="frozen"), 1, tmp_path)


def test_a_retired_key_at_its_unused_value_resumes_and_any_other_value_is_refused(tmp_path):
    # Prepare: run configs stored while "rule-modules" was a key
    unused = dict(RunConfig().to_run_config(), **{"rule-modules": ""})
    used = dict(RunConfig().to_run_config(), **{"rule-modules": "my_rules"})
    # Execute / Assert
    check_run_config(unused, RunConfig(), 1, tmp_path)
    with pytest.raises(ResumeRefused, match="rule-modules: 'my_rules' -> '\\(absent\\)'"):
        check_run_config(used, RunConfig(), 1, tmp_path)


def test_every_harmless_key_is_a_run_config_key():
    assert set(HARMLESS_CHANGES) <= set(RunConfig().to_run_config())


def test_a_checkpoint_of_other_pretrained_weights_is_refused(copy_of):
    # Prepare
    config, out = copy_of
    edit_state(out, lambda s: s.update(base_hash="0" * 64))
    before = files(out)
    # Execute / Assert
    with pytest.raises(ResumeRefused, match="other pretrained weights"):
        run(config, out.parent / "cache")
    assert files(out) == before


def test_a_checkpoint_without_its_run_config_is_refused(copy_of):
    # Prepare
    config, out = copy_of
    edit_state(out, lambda s: s.pop("run_config"))
    # Execute / Assert
    with pytest.raises(CheckpointError, match=re.escape(str(out / "checkpoint" / "state.json"))
                       + ".*holds no run config.*overwrite = true"):
        run(config, out.parent / "cache")


# ------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("wrong", ["one row of a matrix", "an extra dimension", "float64"])
def test_a_block_tensor_unlike_the_models_parameter_is_refused(copy_of, wrong):
    # Prepare: one tensor of a block saved unlike its parameter (a (1, hidden) row that
    # torch would broadcast over the (hidden, hidden) matrix, a (1, hidden) norm weight, or
    # float64), its checksum consistent everywhere
    config, out = copy_of
    hidden = load_model("tiny-llama").config.hidden_size
    norm, matrix = "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight"
    param, found, expected = {
        "one row of a matrix": (matrix, f"(1, {hidden}) torch.float32",
                                f"({hidden}, {hidden}) torch.float32"),
        "an extra dimension": (norm, f"(1, {hidden}) torch.float32", f"({hidden},) torch.float32"),
        "float64": (norm, f"({hidden},) torch.float64", f"({hidden},) torch.float32"),
    }[wrong]

    def change(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = tensors[param]
        tensors[param] = t.double() if wrong == "float64" else t.reshape(-1)[:hidden][None]
        return tensors

    file = resave_block(out, "layer.0", change)
    # Execute / Assert: the file, the parameter, what the model expects and what was found
    with pytest.raises(CheckpointError) as refused:
        run(config, out.parent / "cache")
    assert str(file) in str(refused.value) and repr(param) in str(refused.value)
    assert f"has shape {found}, the model expects shape {expected}" in str(refused.value)


# ------------------------------------------------------------------------------- malformed


def _raw(data: bytes) -> Callable[[Path], Path]:
    def change(out: Path) -> Path:
        (out / "checkpoint" / "state.json").write_bytes(data)
        return out / "checkpoint" / "state.json"
    return change


def _state(change: Callable[[dict[str, Any]], object]) -> Callable[[Path], Path]:
    def apply(out: Path) -> Path:
        edit_state(out, change)
        return out / "checkpoint" / "state.json"
    return apply


def _truncate(out: Path) -> Path:
    path = out / "checkpoint" / "state.json"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    return path


def _block_path(out: Path, block: str = "layer.0") -> Path:
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    return out / "checkpoint" / state["blocks"][block]["file"]


def _rename_block(out: Path) -> Path:
    # a block this model has not, its file and entry consistent
    path = out / "checkpoint" / "state.json"
    state = json.loads(path.read_text())
    entry = state["blocks"].pop("layer.0")
    file = block_file("layer.9", entry["version"], entry["checksum"])
    (out / "checkpoint" / entry["file"]).rename(out / "checkpoint" / file)
    state["blocks"]["layer.9"] = dict(entry, file=file)
    path.write_text(json.dumps(state))
    return path


def _missing_file(out: Path) -> Path:
    path = _block_path(out)
    path.unlink()
    return path


def _garbage_file(out: Path) -> Path:
    path = _block_path(out)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    return path


def _bad_header(out: Path) -> Path:
    path = _block_path(out)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\x00" * 8)
    return path


def _extra_tensor(out: Path) -> Path:
    return resave_block(out, "layer.0", lambda t: {**t, "stowaway": torch.zeros(3)})


def _oversized(out: Path) -> Path:
    # refused by its size, before it is read
    return resave_block(out, "layer.0", lambda t: {**t, "stowaway": torch.zeros(2**20)})


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


MALFORMED: dict[str, Callable[[Path], Path]] = {
    "truncated JSON": _truncate,
    "garbage": _raw(b"\x00\xffnot json at all"),
    "empty": _raw(b""),
    "deeply nested": _raw(_deep(100_000)),
    "deeply nested field": _raw(b'{"format": 2, "round": 1, "blocks": {}, "strategy": '
                                + _deep(100_000) + b"}"),
    "a list": _raw(b"[]"),
    "round a string": _state(lambda s: s.update(round="2")),
    "round a bool": _state(lambda s: s.update(round=True)),
    "round negative": _state(lambda s: s.update(round=-1)),
    "blocks a list": _state(lambda s: s.update(blocks=[])),
    "entry without file": _state(lambda s: s["blocks"]["layer.0"].pop("file")),
    "entry version a string": _state(lambda s: s["blocks"]["layer.0"].update(version="1")),
    "entry checksum not hex": _state(lambda s: s["blocks"]["layer.0"].update(checksum="xyz")),
    "entry file elsewhere": _state(lambda s: s["blocks"]["layer.0"].update(
        file="../state.json")),
    "unknown block": _rename_block,
    "no strategy": _state(lambda s: s.pop("strategy")),
    "strategy a list": _state(lambda s: s.update(strategy=[])),
    "strategy version of an unknown block": _state(
        lambda s: s["strategy"]["versions"].update({"layer.9": 1})),
    "strategy version unlike its entry": _state(
        lambda s: s["strategy"]["versions"].update({"layer.0": 7})),
    "strategy without schedule": _state(lambda s: s["strategy"].pop("schedule")),
    "strategy holdings garbage": _state(lambda s: s["strategy"].update(holdings={"x": 1})),
    "strategy schedule cycle a list": _state(
        lambda s: s["strategy"]["schedule"].update(cycle=[1])),
    "initial_eval with an unknown field": _state(lambda s: s["initial_eval"].update(x=1)),
    "initial_eval loss a string": _state(lambda s: s["initial_eval"].update(loss="high")),
    "last_eval of a later round": _state(lambda s: s["last_eval"].update(round=99)),
    "record a list": _state(lambda s: s.update(record=[])),
    "record of another round": _state(lambda s: s["record"].update(round=1)),
    "lineage a number": _state(lambda s: s.update(lineage=5)),
    "run_config value a list": _state(lambda s: s["run_config"].update(seed=[0])),
    "missing block file": _missing_file,
    "garbage block file": _garbage_file,
    "bad safetensors header": _bad_header,
    "block file with an extra tensor": _extra_tensor,
    "oversized block file": _oversized,
}


@pytest.mark.parametrize("damage", MALFORMED)
def test_a_malformed_checkpoint_is_a_checkpoint_error_naming_the_file(copy_of, damage):
    # Prepare
    config, out = copy_of
    named = MALFORMED[damage](out)
    # Execute / Assert
    with pytest.raises(CheckpointError, match=re.escape(str(named))):
        run(config, out.parent / "cache")


# ------------------------------------------------------------------------------- fuzzing


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into a JSON value (dict keys and list indices)."""
    yield prefix
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, child in items:
        yield from _paths(child, (*prefix, key))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8)


@pytest.fixture
def fuzz_rig(copy_of: tuple[dict[str, Any], Path]) -> dict[str, Any]:
    config, out = copy_of
    run_ = RunConfig.from_run_config(config)
    model = load_model(run_.model)
    blocks = BlockMap(model, run_.layers_per_block)
    weights = dict(model.named_parameters())
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    return {"run": run_, "out": out, "blocks": blocks, "weights": weights, "state": state,
            "base_hash": content_checksum(weights), "paths": list(_paths(state))[1:]}


@settings(max_examples=100 * FUZZ_SCALE, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_state_files_load_or_fail_with_a_checkpoint_error(fuzz_rig, data):
    # Prepare: the finished run's state.json with one value replaced or removed
    rig = fuzz_rig
    state = json.loads(json.dumps(rig["state"]))
    path = data.draw(st.sampled_from(rig["paths"]))
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values)
    (rig["out"] / "checkpoint" / "state.json").write_text(json.dumps(state))
    # Execute / Assert: read back and installed, or refused as a checkpoint error
    try:
        resumed = read_checkpoint(Checkpointer(rig["out"] / "checkpoint"), rig["run"],
                                  rig["blocks"], rig["weights"], rig["base_hash"])
        resumed.install(build_strategy(rig["run"], rig["blocks"], rig["weights"],
                                       resumed.lineage, rig["base_hash"]))
        event("restored")
    except CheckpointError as err:
        event("checkpoint error")
        assert "checkpoint state" in str(err) or "checkpoint file" in str(err)
    except ResumeRefused as err:
        event("resume refused")
        assert "resume:" in str(err)
