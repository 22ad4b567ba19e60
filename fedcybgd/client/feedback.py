"""A node's weights upload, with error feedback for lossy codecs.

Error feedback (EF-SGD style): a lossy codec (top-k, int8/int4/int2, fp16/bf16) drops part of the
node's update of a block; the node keeps what was dropped, the residual, and adds it to its
next upload of that block, so compression error is sent later instead of lost. The residual is
``sent - decoded``: what the node meant to send minus what the server will decode from these
exact bytes (the same :func:`fedcybgd.compression.decode`), so the node's running total of
decoded uploads plus its residual is the total of what it trained, whatever the codec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcybgd.compression import decode, encode, parse_spec, uses_base

Tensors = dict[str, torch.Tensor]


@dataclass
class EncodedUpload:
    """An upload's payload; what it decodes to (when asked for) and the new residual (with
    error feedback on a lossy codec)."""

    payload: bytes
    decoded: Tensors | None = None
    residual: Tensors | None = None


def with_residual(trained: Tensors, residual: Tensors | None) -> Tensors:
    """``trained + residual``, or ``trained`` when no usable residual is kept (none yet, or
    one of other names or shapes)."""
    if residual is None or set(residual) != set(trained) or any(
            residual[n].shape != t.shape for n, t in trained.items()):
        return trained
    return {n: (t.float() + residual[n].float()).to(t.dtype) for n, t in trained.items()}


def encode_upload(trained: Tensors, start: Tensors, codec: str, *, block: str, version: int,
                  base_version: int, residual: Tensors | None = None, feedback: bool = False,
                  want_decoded: bool = False) -> EncodedUpload:
    """Encode ``trained`` (the block after training from ``start``) through ``codec``.

    With ``feedback`` and a lossy codec, ``residual`` (the block's last residual, if any) is
    added first and the new residual returned. ``want_decoded`` returns what the server decodes
    from the payload (a lossless codec's is ``trained`` itself).
    """
    lossy = not parse_spec(codec).lossless
    feedback = feedback and lossy
    sent = with_residual(trained, residual) if feedback else trained
    base = start if uses_base(codec) else None
    payload = encode(sent, codec, block=block, target_version=version,
                     base_version=base_version, base=base)
    out = EncodedUpload(payload)
    if feedback or want_decoded:
        decoded = (decode(payload, base=base, expect_block=block, max_bytes=len(payload)).tensors
                   if lossy else trained)
        if feedback:
            out.residual = {n: sent[n].float() - decoded[n].float() for n in sent}
        if want_decoded:
            out.decoded = decoded
    return out
