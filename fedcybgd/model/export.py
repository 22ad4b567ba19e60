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

Reading a file back: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``
(transformers dequantizes), or any GGUF runtime.
"""

from __future__ import annotations

import json
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


class ExportError(ValueError):
    """The folder cannot be written as GGUF (family, tokenizer or a tensor it does not know)."""


def export_gguf(folder: Path, out: Path, kind: str = "f16") -> Path:
    """Write the Hugging Face model in ``folder`` to the GGUF file ``out``.

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
        The family is not one of :data:`FAMILIES`, the tokenizer is not byte-level BPE, or a
        tensor has no GGUF name.
    """
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if kind not in TYPES:
        raise ExportError(f"type {kind!r} is not one of {list(TYPES)}")
    config = AutoConfig.from_pretrained(folder)
    family = getattr(config, "model_type", "")
    if family not in FAMILIES:
        raise ExportError(f"{folder}: model family {family!r} cannot be exported to GGUF here; "
                          f"supported: {sorted(FAMILIES)}")
    arch_name, permuted = FAMILIES[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch_name)
    _hyperparameters(writer, config, family, folder, kind)
    _tokenizer(writer, tokenizer, folder)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # llama.cpp reads a missing output as the token embedding
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(f"{folder}: tensor {name!r} has no GGUF name for {arch_name}")
        data = tensor.detach().float().numpy()
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = interleave_rotary_halves(data, heads if "q_proj" in name else kv_heads)
        _add_tensor(writer, gguf_name, data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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
