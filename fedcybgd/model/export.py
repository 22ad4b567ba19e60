"""The trained model as one GGUF file: what llama.cpp-class runtimes on a device load.

A run leaves its model as a Hugging Face folder (``final/``); :func:`export_gguf` writes that
folder as GGUF with the ``gguf`` package's writer: the model's hyperparameters, its tokenizer
(byte-level BPE: tokens, merges, token kinds, special ids, chat template) and its weights, in
the layout llama.cpp's own converter gives these families:

* ``llama`` (SmolLM2 and the other Llama-layout models) and ``mistral`` (written as llama.cpp
  writes it: architecture ``llama``, a name that says mistral): the query and key projections
  are stored with each head's rotary halves interleaved, as llama.cpp's rope expects;
* ``qwen2`` (with the attention biases).

Qwen3 is not offered: transformers' GGUF reader takes its head size as Qwen3's default (128)
whatever the file says, so a round trip could not be checked here.

Types (``--type``): ``f32``; ``f16``; ``q8_0`` and ``q4_1`` (GGML block quantization of every
2-D weight; a matrix whose rows are not whole 32-value blocks is stored f16). One-dimensional
tensors (norms, biases) stay f32, as llama.cpp keeps them. A tied LM head is stored once (as the
token embedding, which llama.cpp then uses as the output).

Before anything is written, every tensor of the checkpoint (``model.safetensors``, sharded or
not, or ``pytorch_model.bin``) is checked against the model's config and the type it will be
stored at (:func:`tensor_problem`): each tensor the config declares is present with the config's
shape, none is unknown, every value is finite, and every value fits the stored type: float16's
±65504 at ``f16`` (and for a matrix a quantized type stores f16), q8_0's float16 block scale
(max |w| / 127 ≤ 65504), q4_1's float16 block minimum and step ((max − min) / 15), float32's
range at ``f32``. A checkpoint that fails raises :class:`ExportError` naming the tensor and what
is wrong, and no file is written; the file itself is written under a temporary name beside
``out`` and renamed into place when complete, so a failed write leaves no partial file either.

Reading a file back: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``
(transformers dequantizes), or any GGUF runtime.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

# model_type -> the GGUF architecture llama.cpp writes it as, and whether q/k are permuted
FAMILIES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
}
TYPES = ("f32", "f16", "q8_0", "q4_1")
# the values a GGML block of a quantized type holds (one float16 scale per block)
QUANT_BLOCK = {"q8_0": 32, "q4_1": 32}
F16_MAX = float(np.finfo(np.float16).max)  # 65504
F32_MAX = float(np.finfo(np.float32).max)
# checkpoint tensors a Llama-layout model no longer has and transformers skips when loading
SKIPPED = (r"rotary_emb\.inv_freq$",)


class ExportError(ValueError):
    """The folder cannot be written as GGUF: its family, its tokenizer, or its tensors (one the
    config does not declare or that is missing, a wrong shape, a NaN or infinite value, a value
    the output type cannot hold). ``problems`` lists every problem found, one line each; the
    message is the first (and how many more there are)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


def export_gguf(folder: Path, out: Path, kind: str = "f16") -> Path:
    """Write the Hugging Face model in ``folder`` to the GGUF file ``out``.

    Nothing is written unless every tensor passes its checks (see the module docstring); the
    file is written as ``.<name>.<pid>.partial`` beside ``out`` and renamed to ``out`` when
    complete (an existing ``out`` is replaced only then).

    Parameters
    ----------
    folder : Path
        A ``save_pretrained`` folder (weights, config, tokenizer), e.g. a run's ``final/``.
    out : Path
        The file to write (its folder is made).
    kind : str
        One of :data:`TYPES`.

    Raises
    ------
    ExportError
        The family is not one of :data:`FAMILIES`, the tokenizer is not byte-level BPE, the
        config or weights cannot be read, or a tensor fails a check (named in the message).
    """
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    if kind not in TYPES:
        raise ExportError(f"type {kind!r} is not one of {list(TYPES)}")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ExportError(f"{folder}: config.json cannot be read ({err})") from err
    family = getattr(config, "model_type", "")
    if family not in FAMILIES:
        raise ExportError(f"{folder}: model family {family!r} cannot be exported to GGUF here; "
                          f"supported: {sorted(FAMILIES)}")
    arch_name, permuted = FAMILIES[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = checked_tensors(folder, config, kind, names)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch_name)
    _hyperparameters(writer, config, family, folder, kind)
    _tokenizer(writer, tokenizer, folder)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, (gguf_name, tensor) in tensors.items():
        data = tensor.detach().float().numpy()
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = interleave_rotary_halves(data, heads if "q_proj" in name else kv_heads)
        _add_tensor(writer, gguf_name, data, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    except BaseException:  # the partial file goes; the error goes on to the caller
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return out


def checked_tensors(folder: Path, config: Any, kind: str,
                    names: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in the config's order, each with its GGUF name, once every one
    has passed its checks (:func:`tensor_problem`), none is missing (a tied LM head is the token
    embedding) and none is unknown to the config.

    Raises
    ------
    ExportError
        Naming every problem found (the message: the first, and how many more).
    """
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            expected = AutoModelForCausalLM.from_config(config).state_dict()
    except ValueError as err:
        raise ExportError(f"{folder}: the model's config does not build a model ({err})") from err
    checkpoint = _checkpoint(folder)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    problems: list[str] = []
    tensors: dict[str, tuple[str, torch.Tensor]] = {}
    for name, reference in expected.items():
        if tied and name == "lm_head.weight":
            checkpoint.pop(name, None)  # llama.cpp reads a missing output as the token embedding
            continue
        tensor = checkpoint.pop(name, None)
        if tensor is None:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            problems.append(f"{name}: has no GGUF name for {config.model_type}")
            continue
        if tuple(tensor.shape) != tuple(reference.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} where the model's config "
                            f"gives {tuple(reference.shape)}")
            continue
        problem = tensor_problem(name, tensor, kind)
        if problem is not None:
            problems.append(problem)
            continue
        tensors[name] = (gguf_name, tensor)
    skipped = re.compile("|".join(SKIPPED))
    problems += [f"{name}: not a tensor of the model's config" for name in checkpoint
                 if not skipped.search(name)]
    if problems:
        more = len(problems) - 1
        message = problems[0]
        if more:
            listed = "; ".join(problems[1:4]) + ("; ..." if more > 3 else "")
            message += f" (and {more} more problem{'s' if more > 1 else ''}: {listed})"
        raise ExportError(message, problems)
    return tensors


def stored_type(shape: tuple[int, ...], kind: str) -> str:
    """The type a tensor of ``shape`` is stored at in a ``kind`` file: one-dimensional tensors
    f32, a matrix whose rows are not whole blocks of a quantized type f16, the rest ``kind``."""
    if len(shape) < 2 or kind == "f32":
        return "f32"
    block = QUANT_BLOCK.get(kind)
    if block is not None and shape[-1] % block:
        return "f16"
    return kind


def tensor_problem(name: str, tensor: torch.Tensor, kind: str) -> str | None:
    """What is wrong with the weight ``name`` stored in a ``kind`` file, or None: not floating
    point, NaN or infinite values, or values beyond what the stored type holds (float32's range;
    float16's 65504; q8_0's float16 block scale max |w| / 127; q4_1's float16 block minimum and
    step (max - min) / 15)."""
    if not tensor.is_floating_point():
        return f"{name}: {tensor.dtype} is not a floating-point weight"
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    if nan or inf:
        counts = [f"{n} {what} value(s)" for n, what in ((nan, "NaN"), (inf, "infinite")) if n]
        return f"{name}: {' and '.join(counts)}"
    if tensor.numel() == 0:
        return None
    largest = float(tensor.abs().max())
    stored = stored_type(tuple(tensor.shape), kind)
    if stored == "f32":
        if largest > F32_MAX:
            return f"{name}: max |w| = {largest:.2g} beyond float32's {F32_MAX:.4g}"
        return None
    if stored == "f16":
        if largest > F16_MAX:
            why = "" if kind == "f16" else (f" ({kind} stores a matrix whose rows are not whole "
                                            f"{QUANT_BLOCK[kind]}-value blocks as f16)")
            return f"{name}: max |w| = {largest:.2g} beyond float16's {F16_MAX:.0f}{why}; " \
                   "export at f32"
        return None
    if stored == "q8_0":
        if largest / 127 > F16_MAX:
            return (f"{name}: max |w| = {largest:.2g} beyond q8_0's {F16_MAX * 127:.2g} (its "
                    "float16 block scale, max |w| / 127); export at f32")
        return None
    blocks = tensor.detach().float().reshape(-1, QUANT_BLOCK[stored])
    lows, highs = blocks.min(dim=1).values, blocks.max(dim=1).values
    low = float(lows[lows.abs().argmax()])
    if abs(low) > F16_MAX:
        return (f"{name}: a block's minimum {low:.2g} is beyond float16's {F16_MAX:.0f} "
                f"({stored} stores it as float16); export at f32")
    step = float(((highs - lows) / 15).max())
    if step > F16_MAX:
        return (f"{name}: a block's step (max - min) / 15 = {step:.2g} is beyond float16's "
                f"{F16_MAX:.0f} ({stored} stores it as float16); export at f32")
    return None


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights: ``model.safetensors`` (or its shards, by
    ``model.safetensors.index.json``), else ``pytorch_model.bin`` (or its shards)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for single in ("model.safetensors", "pytorch_model.bin"):
        index = folder / f"{single}.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise ExportError(f"{index}: not a weight index ({err!r})") from err
            break
        if (folder / single).is_file():
            files = [single]
            break
    else:
        raise ExportError(f"{folder}: no weights (model.safetensors or pytorch_model.bin)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        path = folder / file
        try:
            if file.endswith(".safetensors"):
                part = load_file(path)
            else:
                part = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, SafetensorError, RuntimeError, ValueError) as err:
            raise ExportError(f"{path}: cannot be read ({err})") from err
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise ExportError(f"{twice[0]}: in more than one weight file ({path} among them)")
        tensors.update(part)
    return tensors


def interleave_rotary_halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query or key projection ``[heads * head_dim, d]`` with each head's two rotary halves
    interleaved (row ``i`` of the first half, then row ``i`` of the second): how llama.cpp
    stores them, since its rope rotates adjacent pairs where Hugging Face rotates halves."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return (weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def _hyperparameters(writer: Any, config: Any, family: str, folder: Path, kind: str) -> None:
    import gguf

    name = getattr(config, "_name_or_path", "") or folder.name
    if family == "mistral" and "mistral" not in name.lower():
        name = f"mistral {name}"  # how a GGUF reader tells mistral from llama
    writer.add_name(str(name))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_rope_dimension_count(int(head_dim))
    writer.add_key_length(int(head_dim))
    writer.add_value_length(int(head_dim))
    writer.add_vocab_size(int(config.vocab_size))
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
    writer.add_file_type(int(file_type[kind]))


def _rope_theta(config: Any) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        parameters: Mapping[str, Any] = getattr(config, "rope_parameters", None) or {}
        theta = parameters.get("rope_theta", 10000.0)
    return float(theta)


def _tokenizer(writer: Any, tokenizer: Any, folder: Path) -> None:
    """Byte-level BPE from the fast tokenizer's own description (``tokenizer.json``)."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ExportError(f"{folder}: tokenizer model {model.get('type')!r} is not byte-level "
                          "BPE; only BPE tokenizers are exported")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for content, token in added.items():
        vocab[content] = int(token["id"])
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    kinds = [gguf.TokenType.UNUSED] * size
    for content, index in vocab.items():
        tokens[index] = content
        token = added.get(content)
        kinds[index] = (gguf.TokenType.NORMAL if token is None
                        else gguf.TokenType.CONTROL if token.get("special")
                        else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(k) for k in kinds])
    writer.add_token_merges(merges)
    for token_id, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                          (tokenizer.eos_token_id, writer.add_eos_token_id),
                          (tokenizer.unk_token_id, writer.add_unk_token_id),
                          (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(int(token_id))
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def _add_tensor(writer: Any, name: str, data: np.ndarray, kind: str) -> None:
    import gguf

    if data.ndim < 2 or kind == "f32":
        writer.add_tensor(name, data.astype(np.float32))
        return
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_1": gguf.GGMLQuantizationType.Q4_1}.get(kind)
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
    if qtype is None or data.shape[-1] % block:
        writer.add_tensor(name, data.astype(np.float16))
        return
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
