"""GGUF export: written with the ``gguf`` package's writer, read back with transformers' own GGUF
loader, and compared with the Hugging Face folder it came from: the same tokens, and next-token
logits within each type's stated tolerance (largest error over the logits' spread). A checkpoint
the file could not hold (a NaN or infinite weight, one beyond the type's range, a tensor of the
wrong shape, missing or unknown) is refused by name, and nothing is written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedcybgd.cli import main
from fedcybgd.model.export import (
    ExportError,
    export_gguf,
    interleave_rotary_halves,
    tensor_problem,
)
from fedcybgd.model.loading import load_model, load_tokenizer

TEXT = "Mary moved the apple to the kitchen. Where is the apple? In the"
# largest |logit error| / std(logits) a type may bring: exact, half precision, 8 and 4 bits
TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "q8_0": 0.25, "q4_1": 0.8}


def _folder(name: str, root: Path) -> Path:
    folder = root / name
    load_model(name).save_pretrained(folder)
    load_tokenizer(name).save_pretrained(folder)
    return folder


def _round_trip(folder: Path, kind: str, tmp_path: Path,
                check_tokenizer: bool = True) -> tuple[float, Path]:
    """The exported file's logits against the folder's (max error over the logits' deviation);
    with ``check_tokenizer``, its tokenizer and chat template too (written alike whatever the
    type: one check per model is enough)."""
    out = export_gguf(folder, tmp_path / f"{folder.name}-{kind}.gguf", kind)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    if check_tokenizer:
        back_tokenizer = AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
        assert back_tokenizer(TEXT).input_ids == ids[0].tolist()
        assert back_tokenizer.chat_template == tokenizer.chat_template
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(out.parent, gguf_file=out.name,
                                                dtype=torch.float32)
    with torch.no_grad():
        want, got = reference(ids).logits, back(ids).logits
    return float((got - want).abs().max() / want.std()), out


def test_rotary_interleave_is_what_transformers_gguf_reader_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    undo = LlamaTensorProcessor()._reverse_permute_weights
    for heads in (8, 2):
        mixed = interleave_rotary_halves(weight, heads)
        assert not np.array_equal(mixed, weight)
        assert np.array_equal(undo(mixed, 8, heads), weight)


@pytest.mark.slow
def test_a_tiny_llama_round_trips_exactly_at_f32_and_within_q8_0s_tolerance(tmp_path):
    folder = _folder("tiny-llama", tmp_path)
    exact, f32 = _round_trip(folder, "f32", tmp_path)
    assert exact <= TOLERANCE["f32"]
    error, q8 = _round_trip(folder, "q8_0", tmp_path, check_tokenizer=False)
    assert error <= TOLERANCE["q8_0"]
    assert q8.stat().st_size < 0.4 * f32.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny-qwen2", "tiny-mistral"])
def test_other_families_round_trip(family, tmp_path):
    # each family's tensor names and layout exactly (f32) and through a quantized type; f16 is
    # the same writer path for every family (SmolLM2's test below)
    folder = _folder(family, tmp_path)
    for kind in ("f32", "q8_0"):
        error, _ = _round_trip(folder, kind, tmp_path, check_tokenizer=kind == "f32")
        assert error <= TOLERANCE[kind], (kind, error)


@pytest.mark.slow
def test_smollm2_round_trips_within_each_types_tolerance(tmp_path):
    # f32's exactness is the tiny Llama's test (the same writer); here the real weights at the
    # widest and the narrowest type edge runtimes load, each within its tolerance (q8_0's round
    # trip is the tiny families' and the tiny Llama's), and each type smaller than the one before
    folder = _folder("smollm2-135m", tmp_path)
    sizes = {}
    for kind in ("f16", "q4_1"):
        error, out = _round_trip(folder, kind, tmp_path, check_tokenizer=kind == "f16")
        assert error <= TOLERANCE[kind], (kind, error)
        sizes[kind] = out.stat().st_size
    sizes["q8_0"] = export_gguf(folder, tmp_path / "smollm2-q8_0.gguf", "q8_0").stat().st_size
    assert sizes["f16"] > sizes["q8_0"] > sizes["q4_1"]


def test_an_unsupported_family_is_refused_by_name(tmp_path):
    folder = _folder("tiny-gpt2", tmp_path)
    with pytest.raises(ExportError, match="model family 'gpt2' cannot be exported"):
        export_gguf(folder, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_the_export_command(tmp_path, capsys):
    folder = _folder("tiny-llama", tmp_path)
    assert main(["export", str(folder), "--gguf", str(tmp_path / "out" / "m.gguf"),
                 "--type", "q4_1"]) == 0
    assert "m.gguf" in capsys.readouterr().out and (tmp_path / "out" / "m.gguf").stat().st_size
    assert main(["export", str(tmp_path), "--gguf", str(tmp_path / "y.gguf")]) == 2
    assert "holds no model" in capsys.readouterr().err


# -- checkpoints the file could not hold ------------------------------------------------------

UP = "model.layers.0.mlp.up_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return _folder("tiny-llama", tmp_path_factory.mktemp("export"))


def _altered(folder: Path, root: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``folder`` whose weights ``change`` has edited in place."""
    copy = shutil.copytree(folder, root / "altered")
    weights = load_file(copy / "model.safetensors")
    change(weights)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def _set(name: str, value: float, index: tuple[int, ...] = (0, 0)):
    def change(weights: dict[str, torch.Tensor]) -> None:
        weights[name][index] = value
    return change


def _refused(folder: Path, out: Path, kind: str, message: str) -> None:
    """``export_gguf`` raises ``message`` and leaves nothing in the output's folder."""
    before = sorted(out.parent.iterdir()) if out.parent.exists() else None
    with pytest.raises(ExportError, match=message):
        export_gguf(folder, out, kind)
    assert not out.exists()
    assert (sorted(out.parent.iterdir()) if out.parent.exists() else None) == before


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0", "q4_1"])
def test_a_nan_weight_is_refused_by_name_at_every_type(tiny_llama, tmp_path, kind):
    folder = _altered(tiny_llama, tmp_path, _set(UP, float("nan"), (3, 5)))
    _refused(folder, tmp_path / "out" / "m.gguf", kind, rf"^{UP}: 1 NaN value\(s\)$")


def test_infinite_weights_are_refused_by_name(tiny_llama, tmp_path):
    def change(weights: dict[str, torch.Tensor]) -> None:
        weights[UP][0, :2] = torch.tensor([float("inf"), -float("inf")])
    folder = _altered(tiny_llama, tmp_path, change)
    for kind in ("f32", "q8_0"):
        _refused(folder, tmp_path / f"m-{kind}.gguf", kind, rf"^{UP}: 2 infinite value\(s\)$")


def test_nan_in_a_norm_is_refused_too(tiny_llama, tmp_path):
    # one-dimensional tensors stay f32 at every type: finiteness is still checked
    folder = _altered(tiny_llama, tmp_path, _set(NORM, float("nan"), (7,)))
    _refused(folder, tmp_path / "m.gguf", "q4_1", rf"^{NORM}: 1 NaN value\(s\)$")


def test_a_weight_beyond_float16_is_refused_at_f16_and_exports_at_f32(tiny_llama, tmp_path):
    folder = _altered(tiny_llama, tmp_path, _set(UP, -1.2e5, (2, 1)))
    _refused(folder, tmp_path / "m.gguf", "f16",
             rf"^{UP}: max \|w\| = 1.2e\+05 beyond float16's 65504; export at f32$")
    out = export_gguf(folder, tmp_path / "m.gguf", "f32")
    tensor = next(t for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.ffn_up.weight")
    assert tensor.data[2, 1] == -1.2e5
    # q8_0 and q4_1 store a float16 scale per block of 32, which holds this block's
    assert export_gguf(folder, tmp_path / "m-q8_0.gguf", "q8_0").stat().st_size


def test_a_norm_beyond_float16_exports_at_f16_since_it_stays_f32(tiny_llama, tmp_path):
    folder = _altered(tiny_llama, tmp_path, _set(NORM, 1e6, (0,)))
    assert export_gguf(folder, tmp_path / "m.gguf", "f16").stat().st_size


def test_quantized_types_refuse_blocks_their_float16_scales_cannot_hold(tiny_llama, tmp_path):
    # q8_0: a block's scale is max |w| / 127 as float16; q4_1: the block's minimum and its step
    # (max - min) / 15, both float16
    folder = _altered(tiny_llama, tmp_path, _set(UP, 1e7))
    _refused(folder, tmp_path / "m.gguf", "q8_0",
             rf"^{UP}: max \|w\| = 1e\+07 beyond q8_0's 8\.3e\+06 \(its float16 block "
             r"scale, max \|w\| / 127\); export at f32$")
    folder = _altered(tiny_llama, tmp_path / "step", _set(UP, 5e6))
    _refused(folder, tmp_path / "m.gguf", "q4_1",
             rf"^{UP}: a block's step \(max - min\) / 15 = 3.3e\+05 is beyond float16's 65504 "
             r"\(q4_1 stores it as float16\); export at f32$")
    assert export_gguf(folder, tmp_path / "m-q8_0.gguf", "q8_0").stat().st_size
    folder = _altered(tiny_llama, tmp_path / "min", _set(UP, -7e4))
    _refused(folder, tmp_path / "m.gguf", "q4_1",
             rf"^{UP}: a block's minimum -7e\+04 is beyond float16's 65504 \(q4_1 stores it as "
             r"float16\); export at f32$")


def test_each_stored_type_holds_its_own_range():
    # a matrix whose rows are not whole 32-value blocks is stored f16 by q8_0 and q4_1
    assert "float16's 65504 (q8_0 stores a matrix whose rows are not whole 32-value blocks as " \
        "f16); export at f32" in str(tensor_problem("w", torch.full((2, 48), 7e4), "q8_0"))
    assert tensor_problem("w", torch.full((2, 32), 7e4), "q8_0") is None
    # float64 weights beyond float32's range; bfloat16 ones beyond float16's
    assert "beyond float32's 3.403e+38" in str(
        tensor_problem("w", torch.full((2, 2), 1e39, dtype=torch.float64), "f32"))
    assert "beyond float16's 65504" in str(
        tensor_problem("w", torch.full((2, 2), 1e5, dtype=torch.bfloat16), "f16"))
    assert tensor_problem("w", torch.full((2, 2), 1e5, dtype=torch.bfloat16), "f32") is None
    assert tensor_problem("w", torch.ones(2, 2, dtype=torch.int64), "f32") == \
        "w: torch.int64 is not a floating-point weight"
    nan_and_inf = torch.tensor([[float("nan"), float("inf")], [float("nan"), 0.0]])
    assert tensor_problem("w", nan_and_inf, "f32") == \
        "w: 2 NaN value(s) and 1 infinite value(s)"


def test_sharded_and_pytorch_bin_weights_are_checked_alike(tiny_llama, tmp_path):
    sharded = tmp_path / "sharded"
    load_model("tiny-llama").save_pretrained(sharded, max_shard_size="1MB")
    load_tokenizer("tiny-llama").save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert export_gguf(sharded, tmp_path / "sharded.gguf", "f32").stat().st_size
    pickled = shutil.copytree(tiny_llama, tmp_path / "bin")
    weights = load_file(pickled / "model.safetensors")
    weights[UP][1, 1] = float("nan")
    torch.save(weights, pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    _refused(pickled, tmp_path / "bin.gguf", "f16", rf"^{UP}: 1 NaN value\(s\)$")


def test_a_wrong_shape_is_refused_by_name(tiny_llama, tmp_path):
    def change(weights: dict[str, torch.Tensor]) -> None:
        weights[UP] = weights[UP][:-1]
    folder = _altered(tiny_llama, tmp_path, change)
    _refused(folder, tmp_path / "m.gguf", "f16",
             rf"^{UP}: shape \(127, 64\) where the model's config gives \(128, 64\)$")


def test_missing_and_unknown_tensors_are_refused_by_name(tiny_llama, tmp_path):
    def change(weights: dict[str, torch.Tensor]) -> None:
        del weights[UP]
        weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    folder = _altered(tiny_llama, tmp_path, change)
    _refused(folder, tmp_path / "m.gguf", "f32",
             rf"^{UP}: missing from the checkpoint \(and 1 more problem: "
             r"model.layers.0.mlp.extra.weight: not a tensor of the model's config\)$")


def test_a_refused_export_leaves_an_existing_file_as_it_was(tiny_llama, tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"the previous export")
    folder = _altered(tiny_llama, tmp_path, _set(UP, float("nan")))
    _refused(folder, out.with_name("other.gguf"), "f16", "NaN")
    with pytest.raises(ExportError):
        export_gguf(folder, out, "f16")
    assert out.read_bytes() == b"the previous export"


def test_a_write_that_fails_midway_leaves_no_file(tiny_llama, tmp_path, monkeypatch):
    def fail(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="No space left"):
        export_gguf(tiny_llama, tmp_path / "out" / "m.gguf", "f16")
    assert list((tmp_path / "out").iterdir()) == []


def test_the_export_command_refuses_in_one_line_with_a_non_zero_exit(tiny_llama, tmp_path):
    folder = _altered(tiny_llama, tmp_path, _set(UP, 1.2e5))
    out = tmp_path / "out" / "m.gguf"
    command = Path(sys.executable).with_name("fedcybgd")
    done = subprocess.run([str(command), "export", str(folder), "--gguf", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"fedcybgd export: {UP}: max |w| = 1.2e+05 beyond float16's 65504; export at f32"]
    assert done.stdout == ""
    assert not out.parent.exists()


def test_the_export_command_names_a_broken_checkpoint_file(tmp_path, capsys):
    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"')
    assert main(["export", str(folder), "--gguf", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedcybgd export: {folder}") and len(err.splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists()
