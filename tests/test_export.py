"""GGUF export: written with the ``gguf`` package's writer, read back with transformers' own GGUF
loader, and compared with the Hugging Face folder it came from: the same tokens, and next-token
logits within each type's stated tolerance (largest error over the logits' spread)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedcybgd.cli import main
from fedcybgd.model.export import ExportError, export_gguf, interleave_rotary_halves
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
    assert "holds no model" in capsys.readouterr().out
