"""What pipeline stages send each other: a micro-batch's activations (up) or their gradient
(down), with the batch's token ids and targets, as safetensors bytes.

Up (``F``): ``states`` ``[B, T, H]`` (the chunk's output) and the micro-batch's tensors
(:data:`BATCH_KEYS`: token ids, mask and what the loss scores), so every stage can rebuild the
layers' masks and position tables from the ids and take a loss at its output; the receiving
stage attaches its own task object (the run config names the dataset; no code crosses).
Down (``B``): ``grad`` ``[B, T, H]``, the gradient of the loss with respect to ``states``.

Safetensors, never pickle: a stage on another device is untrusted input. :func:`decode` checks
names, dtypes and shapes against each other and against the receiver's hidden size and byte
limit (:func:`max_bytes`), token ids against its vocabulary, and raises :class:`ActivationError`
naming what is wrong. :func:`batch_digest` names a micro-batch's tensors, so the server can
check that a stage passes on the batch stage 0 sent it.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedcybgd.choices import ACTIVATION_DTYPES
from fedcybgd.data.prompts import Batch

# Record names of pipeline mode's messages (``train.pipeline``).
PIPELINE = "pipeline"  # ConfigRecord: the instruction (stage, kind, step, final) / the status
ACTIVATIONS = "activations"  # ConfigRecord: "mb.<i>" -> this module's bytes for micro-batch i
CHUNK = "chunk"  # ArrayRecord: the stage's trained tensors, in the reply to its last message
STAGE_STATE = "stage-state"  # ArrayRecord: a stage's chunk and AdamW state (checkpoint, restore)
PIPELINE_METRICS = "pipeline-metrics"  # MetricRecord: losses, seconds, memory of the message

FLOAT_DTYPES = {name: getattr(torch, name) for name in ACTIVATION_DTYPES}
# Batch fields that travel with the activations (None fields are left out).
BATCH_KEYS = ("input_ids", "attention_mask", "last_index", "target_ids", "labels",
              "class_token_ids", "class_log_prior", "score_rows", "score_positions")
_INT_KEYS = {"input_ids", "attention_mask", "last_index", "target_ids", "labels",
             "class_token_ids", "score_rows", "score_positions"}


class ActivationError(ValueError):
    """A stage's message is malformed: the text says which tensor and what is wrong."""


def max_bytes(rows: int, tokens: int, hidden_size: int) -> int:
    """The most bytes one micro-batch's message may take: float32 states (or gradients) of
    ``rows x tokens`` tokens of ``hidden_size`` dimensions, the batch's tensors (at most 64
    bytes a token: ids, mask, scored positions and their targets) and 1 MiB for the header and
    the per-row and per-class tensors."""
    return rows * tokens * (hidden_size * 4 + 64) + (1 << 20)


def encode(kind: str, mb: int, tensor: torch.Tensor, batch: Batch | None = None,
           dtype: str = "float32") -> bytes:
    """``kind`` ``"F"`` (``tensor`` = states, with ``batch``) or ``"B"`` (``tensor`` = grad) of
    micro-batch ``mb``, with the float tensor sent as ``dtype`` (:data:`FLOAT_DTYPES`)."""
    if kind not in ("F", "B"):
        raise ValueError(f"kind must be 'F' or 'B', got {kind!r}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"activation dtype must be one of {sorted(FLOAT_DTYPES)}, got {dtype!r}")
    name = "states" if kind == "F" else "grad"
    tensors = {name: tensor.detach().to(FLOAT_DTYPES[dtype]).contiguous()}
    if kind == "F":
        if batch is None:
            raise ValueError("a forward message carries its micro-batch")
        for key in BATCH_KEYS:
            value = getattr(batch, key)
            if value is not None:
                tensors[key] = value.detach().contiguous()
    return st_save(tensors, metadata={"kind": kind, "mb": str(mb)})


def decode(data: bytes, hidden_size: int, limit: int, task: object = None,
           vocab_size: int | None = None) -> tuple[str, int, torch.Tensor, Batch | None]:
    """``(kind, mb, float32 tensor, batch or None)`` from :func:`encode`'s bytes, checked.

    ``limit``: the most bytes the message may take (:func:`max_bytes`). The batch gets ``task``
    (the receiver's own task object); with ``vocab_size`` its token ids must be in
    ``0..vocab_size - 1``, and its labels index its classes.
    """
    if len(data) > limit:
        raise ActivationError(f"message of {len(data):,} bytes exceeds the limit {limit:,}")
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except (SafetensorError, ValueError, RuntimeError, struct.error, UnicodeDecodeError) as err:
        raise ActivationError(f"not a safetensors activation message: {err}") from err
    kind, mb_text = meta.get("kind"), meta.get("mb", "")
    if kind not in ("F", "B"):
        raise ActivationError(f"metadata 'kind' must be 'F' or 'B', got {kind!r}")
    if not mb_text.isdigit():
        raise ActivationError(f"metadata 'mb' must be a micro-batch index, got {mb_text!r}")
    name = "states" if kind == "F" else "grad"
    allowed = {name, *BATCH_KEYS} if kind == "F" else {name}
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise ActivationError(f"unexpected tensors {unknown} in a {kind} message")
    if name not in tensors:
        raise ActivationError(f"a {kind} message lacks '{name}'")
    value = tensors[name]
    if value.dtype not in FLOAT_DTYPES.values():
        raise ActivationError(f"'{name}' has dtype {value.dtype}, not a float type")
    if value.dim() != 3 or value.shape[2] != hidden_size:
        raise ActivationError(f"'{name}' has shape {tuple(value.shape)}, expected "
                              f"[batch, tokens, {hidden_size}]")
    if not bool(torch.isfinite(value).all()):
        raise ActivationError(f"'{name}' holds non-finite values")
    value = value.float()
    if kind == "B":
        return kind, int(mb_text), value, None
    batch = _batch(tensors, value.shape[:2], task)
    if vocab_size is not None:
        _check_ids(batch, vocab_size)
    return kind, int(mb_text), value, batch


def _metadata(data: bytes) -> dict[str, str]:
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata is not a table of strings")
    return meta


def _batch(tensors: dict[str, torch.Tensor], shape: torch.Size, task: object) -> Batch:
    """The micro-batch, its tensors checked against the states' ``[B, T]``."""
    rows, tokens = int(shape[0]), int(shape[1])
    for key in ("input_ids", "attention_mask", "last_index", "target_ids", "labels",
                "class_token_ids"):
        if key not in tensors:
            raise ActivationError(f"a forward message lacks '{key}'")
    for key, value in tensors.items():
        allowed = (torch.int64, torch.int32, torch.bool) if key == "attention_mask" else (
            torch.int64, torch.int32)
        if key in _INT_KEYS and value.dtype not in allowed:
            raise ActivationError(f"'{key}' has dtype {value.dtype}, not an integer type")
    for key in ("input_ids", "attention_mask"):
        if tuple(tensors[key].shape) != (rows, tokens):
            raise ActivationError(f"'{key}' has shape {tuple(tensors[key].shape)}, the states "
                                  f"[{rows}, {tokens}]")
    for key in ("last_index", "labels"):
        if tuple(tensors[key].shape) != (rows,):
            raise ActivationError(f"'{key}' has shape {tuple(tensors[key].shape)}, expected "
                                  f"[{rows}]")
    last = tensors["last_index"]
    if rows and (int(last.min()) < 0 or int(last.max()) >= tokens):
        raise ActivationError(f"'last_index' points outside 0..{tokens - 1}")
    if ("score_rows" in tensors) != ("score_positions" in tensors):
        raise ActivationError("'score_rows' and 'score_positions' come together")
    scored = tensors["target_ids"].shape[0]
    if "score_rows" in tensors:
        r, p = tensors["score_rows"], tensors["score_positions"]
        if r.shape != (scored,) or p.shape != (scored,):
            raise ActivationError("'score_rows'/'score_positions' do not match 'target_ids'")
        if scored and (int(r.min()) < 0 or int(r.max()) >= rows or int(p.min()) < 0
                       or int(p.max()) >= tokens):
            raise ActivationError("scored positions point outside the micro-batch")
    elif scored != rows:
        raise ActivationError(f"'target_ids' has {scored} rows, the micro-batch {rows}")
    return Batch(tensors["input_ids"], tensors["attention_mask"], tensors["last_index"],
                 tensors["target_ids"], tensors["labels"], tensors["class_token_ids"],
                 tensors.get("class_log_prior"), tensors.get("score_rows"),
                 tensors.get("score_positions"), task)


def _check_ids(batch: Batch, vocab_size: int) -> None:
    """Token ids inside the vocabulary, the classes' prior one number a class, labels indexing
    the classes: what the receiver's embedding and loss index with."""
    for key in ("input_ids", "target_ids", "class_token_ids"):
        value = getattr(batch, key)
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= vocab_size):
            raise ActivationError(f"'{key}' holds token ids outside 0..{vocab_size - 1}")
    classes = batch.class_token_ids
    if classes.dim() != 1:
        raise ActivationError(f"'class_token_ids' has shape {tuple(classes.shape)}, expected "
                              "[classes]")
    prior = batch.class_log_prior
    if prior is not None:
        if prior.dtype not in FLOAT_DTYPES.values() or prior.shape != classes.shape:
            raise ActivationError(f"'class_log_prior' is {prior.dtype} {tuple(prior.shape)}, "
                                  f"expected a float per class {tuple(classes.shape)}")
        if not bool(torch.isfinite(prior).all()):
            raise ActivationError("'class_log_prior' holds non-finite values")
    labels = batch.labels
    low = 0 if prior is not None else -1  # the adjusted loss indexes the classes by label
    if labels.numel() and classes.numel() and (
            int(labels.min()) < low or int(labels.max()) >= classes.numel()):
        raise ActivationError(f"'labels' outside {low}..{classes.numel() - 1} (the classes)")


def batch_digest(batch: Batch) -> str:
    """A digest of the micro-batch's tensors (:data:`BATCH_KEYS`: names, dtypes, shapes and
    values): equal digests, equal batches."""
    digest = hashlib.sha256()
    for key in BATCH_KEYS:
        value = getattr(batch, key)
        if value is None:
            continue
        value = value.detach().contiguous().cpu()
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def peek(data: bytes) -> tuple[str, int]:
    """``(kind, micro-batch)`` of a message, from its header alone (for routing; :func:`decode`
    checks the rest). Raises :class:`ActivationError`."""
    try:
        meta = _metadata(data)
    except (ValueError, struct.error, UnicodeDecodeError) as err:
        raise ActivationError(f"not a safetensors activation message: {err}") from err
    kind, mb_text = meta.get("kind"), meta.get("mb", "")
    if kind not in ("F", "B") or not mb_text.isdigit():
        raise ActivationError(f"metadata kind={kind!r} mb={mb_text!r} is not a stage message")
    return kind, int(mb_text)
