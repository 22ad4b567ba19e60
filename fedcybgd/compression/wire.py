"""Encode named tensors into a payload and decode them back, with every check on the way in."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import zstandard

from fedcybgd.compression import codecs
from fedcybgd.compression.errors import CodecError
from fedcybgd.compression.header import (
    FORMAT_VERSION,
    PartRef,
    PayloadHeader,
    TensorEntry,
    pack_frame,
    read_header,
    split_frame,
)
from fedcybgd.compression.layout import MAX_TOPK_NUMEL
from fedcybgd.compression.limits import MAX_DECODED_BYTES
from fedcybgd.compression.spec import CodecSpec, parse_spec
from fedcybgd.compression.tensors import (
    BITS_DTYPE,
    FLOAT_DTYPES,
    PART_ITEMSIZE,
    dtype_name,
    tensor_from_bytes,
    tensor_to_bytes,
    torch_dtype,
    work_dtype,
)
from fedcybgd.core.checksum import content_checksum

_MIN_ZSTD_LEVEL = -(2**17)  # zstd's fastest negative level


@dataclass(frozen=True)
class DecodedPayload:
    """A decoded payload: its header and the reconstructed tensors (CPU, contiguous)."""

    header: PayloadHeader
    tensors: dict[str, torch.Tensor]


def _check_int(value: object, what: str, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CodecError(f"{what} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise CodecError(f"{what} must be {bound}, got {value}")
    return value


def _check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    for name, t in tensors.items():
        if dtype_name(t.dtype, tensor=name) in FLOAT_DTYPES and not bool(torch.isfinite(t).all()):
            raise CodecError(f"tensor {name!r}: NaN or Inf in the {where}")


def _cpu_tensors(tensors: object, what: str) -> dict[str, torch.Tensor]:
    """Name-ordered, detached, contiguous CPU copies (views where possible) of a mapping."""
    if not isinstance(tensors, Mapping):
        raise CodecError(f"{what} must be a mapping of name -> tensor")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors, key=str):
        t = tensors[name]
        if not isinstance(name, str):
            raise CodecError(f"{what}: tensor name {name!r} is not a string")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise CodecError(f"{what}: {name!r} is not a dense torch.Tensor")
        dtype_name(t.dtype, tensor=name)
        out[name] = t.detach().cpu().contiguous()
    return out


def _check_base(
    codec: CodecSpec,
    wanted: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    base: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """The base tensors a delta/xor codec needs: same names, shapes and dtypes."""
    if base is None:
        raise CodecError(f"spec {codec} needs a base (delta/xor) but none was given")
    tensors = _cpu_tensors(base, "base")
    missing = sorted(set(wanted) - set(tensors))
    extra = sorted(set(tensors) - set(wanted))
    if missing or extra:
        raise CodecError(f"base names differ from the payload's: missing {missing}, extra {extra}")
    for name, (dtype, shape) in wanted.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CodecError(
                f"base tensor {name!r} is {t.dtype} {tuple(t.shape)}, "
                f"the payload's is {dtype} {shape}"
            )
    return tensors


def _encode_tensor(
    codec: CodecSpec,
    x: torch.Tensor,
    base: torch.Tensor | None,
    *,
    name: str,
    group_size: int,
    topk_ratio: float,
) -> tuple[list[tuple[str, str, int, bytes]], int | None, int | None]:
    """One tensor's parts ``(key, dtype, count, bytes)``, group size and top-k count."""
    dtype = dtype_name(x.dtype, tensor=name)
    flat = x.reshape(-1)
    if codec.base == "xor":
        assert base is not None
        bits = torch_dtype(BITS_DTYPE[dtype])
        data = codecs.xor_bits(flat.view(bits), base.reshape(-1).view(bits))
        return [("data", BITS_DTYPE[dtype], data.numel(), tensor_to_bytes(data))], None, None
    values = flat
    if codec.base == "delta":
        assert base is not None
        work = work_dtype(dtype)
        values = flat.to(work) - base.reshape(-1).to(work)
    parts: list[tuple[str, str, int, bytes]] = []
    topk: int | None = None
    if codec.topk:
        if values.numel() > MAX_TOPK_NUMEL:
            raise CodecError(f"tensor {name!r}: {values.numel()} elements is too many for top-k")
        topk = codecs.topk_count(values.numel(), topk_ratio)
        idx = codecs.topk_indices(values, topk)
        parts.append(("idx", "uint32", topk, codecs.encode_indices(idx)))
        values = values[idx]
    if codec.cast:
        values = codecs.cast_values(values, codec.cast, tensor=name)
    if codec.quant:
        q, scales = codecs.quantize(values, codec.quant, group_size)
        q = codecs.pack_codes(q, codec.quant)
        parts.append(("q", dtype_name(q.dtype, tensor=name), q.numel(), tensor_to_bytes(q)))
        parts.append(("scales", "float32", scales.numel(), tensor_to_bytes(scales)))
        return parts, group_size, topk
    value_dtype = dtype_name(values.dtype, tensor=name)
    parts.append(("data", value_dtype, values.numel(), tensor_to_bytes(values)))
    return parts, None, topk


def _part_tensor(entry: TensorEntry, key: str, body: memoryview) -> torch.Tensor | memoryview:
    ref = entry.part(key)
    buf: bytes | memoryview = body[ref.offset : ref.offset + ref.length]
    if ref.shuffled:
        buf = codecs.unshuffle(buf, PART_ITEMSIZE[ref.dtype])
    if ref.dtype == "uint32":
        return memoryview(buf)  # top-k gaps are decoded through numpy
    return tensor_from_bytes(buf, torch_dtype(ref.dtype))


def _reconstruct(
    codec: CodecSpec, entry: TensorEntry, body: memoryview, base: torch.Tensor | None
) -> torch.Tensor:
    """One tensor from its parts (the header has already been validated)."""
    dtype = torch_dtype(entry.dtype)
    if codec.base == "xor":
        assert base is not None
        stored = _part_tensor(entry, "data", body)
        assert isinstance(stored, torch.Tensor)
        bits = codecs.xor_bits(stored, base.reshape(-1).view(stored.dtype))
        return bits.view(dtype).reshape(entry.shape)
    if codec.quant:
        q = _part_tensor(entry, "q", body)
        scales = _part_tensor(entry, "scales", body)
        assert isinstance(q, torch.Tensor) and isinstance(scales, torch.Tensor)
        count = entry.topk if entry.topk is not None else entry.numel
        q = codecs.unpack_codes(q, codec.quant, count)
        assert entry.group_size is not None
        values = codecs.dequantize(q, scales, entry.group_size)
    else:
        data = _part_tensor(entry, "data", body)
        assert isinstance(data, torch.Tensor)
        values = data
    if codec.topk:
        gaps = _part_tensor(entry, "idx", body)
        assert isinstance(gaps, memoryview)
        idx = codecs.decode_indices(gaps, entry.numel, tensor=entry.name)
        dense = torch.zeros(entry.numel, dtype=values.dtype)
        dense[idx] = values
        values = dense
    if codec.base == "delta":
        assert base is not None
        work = work_dtype(entry.dtype)
        # two separate IEEE ops (no fused multiply-add): same bits on every machine
        values = base.reshape(-1).to(work) + values.to(work)
    return values.to(dtype).reshape(entry.shape).contiguous()


def _reconstruct_all(
    codec: CodecSpec,
    entries: tuple[TensorEntry, ...],
    body: memoryview,
    bases: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        try:
            out[entry.name] = _reconstruct(codec, entry, body, bases.get(entry.name))
        except CodecError:
            raise
        except (RuntimeError, MemoryError, ValueError) as exc:  # e.g. allocation failure
            raise CodecError(f"tensor {entry.name!r}: cannot reconstruct: {exc}") from None
    return out


def encode(
    tensors: Mapping[str, torch.Tensor],
    spec: str,
    *,
    block: str,
    target_version: int,
    base_version: int = 0,
    base: Mapping[str, torch.Tensor] | None = None,
    group_size: int | None = None,
    zstd_level: int = 3,
    topk_ratio: float = 0.1,
) -> bytes:
    """Encode named tensors into a self-describing payload.

    Parameters
    ----------
    tensors
        Name -> tensor (fp32/fp16/bf16/fp64; integer dtypes with lossless specs only).
    spec
        Codec pipeline, e.g. ``"delta+int8+zstd"`` (see :mod:`fedcybgd.compression.spec`).
    block, target_version, base_version
        Recorded in the header: which block, which version it becomes, which it is a delta of.
    base
        The tensors a ``delta``/``xor`` spec is relative to (same names, shapes, dtypes);
        ignored by other specs.
    group_size, zstd_level, topk_ratio
        Quantizer group size (``None``: 64 for int8/int4, 256 for int2, whose codes are
        small beside a float32 scale), zstd level, fraction of entries top-k keeps (at least
        one).

    Returns
    -------
    bytes
        The payload. Its checksum is computed by decoding the body the same way
        :func:`decode` does, so an encoder bug cannot produce a payload that verifies.
    """
    codec = parse_spec(spec)
    group_size = _check_encode_args(
        codec,
        block=block,
        target_version=target_version,
        base_version=base_version,
        group_size=group_size,
        zstd_level=zstd_level,
        topk_ratio=topk_ratio,
    )
    inputs = _cpu_tensors(tensors, "tensors")
    _check_finite(inputs, "input")
    bases, base_checksum = _encode_bases(codec, inputs, base)
    entries, raw_body = _encode_body(
        codec, inputs, bases, group_size=group_size, topk_ratio=topk_ratio
    )
    checksum = _reconstruction_checksum(codec, entries, raw_body, bases, inputs)
    body = codecs.zstd_compress(raw_body, zstd_level) if codec.zstd else raw_body
    header = PayloadHeader(
        format_version=FORMAT_VERSION,
        spec=str(codec),
        block=block,
        base_version=base_version,
        target_version=target_version,
        entries=entries,
        checksum=checksum,
        base_checksum=base_checksum,
        body_length=len(body),
        raw_body_length=len(raw_body),
        body_sha256=hashlib.sha256(body).hexdigest(),
    )
    data = pack_frame(header, body)
    if read_header(data, max_bytes=len(data)) != header:  # the header must parse back to itself
        raise RuntimeError("internal error: payload header does not round-trip")
    return data


def _check_encode_args(
    codec: CodecSpec,
    *,
    block: object,
    target_version: object,
    base_version: object,
    group_size: int | None,
    zstd_level: object,
    topk_ratio: object,
) -> int:
    """Check :func:`encode`'s scalar arguments; return the group size (default filled in)."""
    if not isinstance(block, str) or not block:
        raise CodecError("block name must be a non-empty string")
    _check_int(target_version, "target_version", 0)
    _check_int(base_version, "base_version", 0)
    if group_size is None:
        group_size = codecs.DEFAULT_GROUP_SIZE.get(codec.quant or "int8", 64)
    _check_int(group_size, "group_size", 1)
    _check_int(zstd_level, "zstd_level", _MIN_ZSTD_LEVEL, zstandard.MAX_COMPRESSION_LEVEL)
    if not isinstance(topk_ratio, float | int) or not 0.0 < topk_ratio <= 1.0:
        raise CodecError(f"topk_ratio must be in (0, 1], got {topk_ratio!r}")
    return group_size


def _encode_bases(
    codec: CodecSpec,
    inputs: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """The checked base tensors and their checksum (none for a codec without a base)."""
    if not codec.needs_base:
        return {}, None
    wanted = {n: (t.dtype, tuple(t.shape)) for n, t in inputs.items()}
    bases = _check_base(codec, wanted, base)
    _check_finite(bases, "base")
    return bases, content_checksum(bases)


def _encode_body(
    codec: CodecSpec,
    inputs: Mapping[str, torch.Tensor],
    bases: Mapping[str, torch.Tensor],
    *,
    group_size: int,
    topk_ratio: float,
) -> tuple[tuple[TensorEntry, ...], bytes]:
    """Every tensor's header entry and the uncompressed body holding all their parts (each
    part byte-shuffled when the body is zstd-compressed and its items are wider than a byte).
    """
    chunks: list[bytes] = []
    entries: list[TensorEntry] = []
    offset = 0
    for name, x in inputs.items():
        dtype = dtype_name(x.dtype, tensor=name)
        if not codec.lossless and dtype not in FLOAT_DTYPES:
            raise CodecError(
                f"tensor {name!r}: lossy codec {codec} needs a float tensor, not {dtype}"
            )
        parts, gsize, topk = _encode_tensor(
            codec, x, bases.get(name), name=name, group_size=group_size, topk_ratio=topk_ratio
        )
        refs = []
        for key, part_dtype, count, raw in parts:
            itemsize = PART_ITEMSIZE[part_dtype]
            shuffled = codec.zstd and itemsize > 1
            stored = codecs.shuffle(raw, itemsize) if shuffled else raw
            refs.append(PartRef(key, part_dtype, count, offset, len(stored), shuffled))
            chunks.append(stored)
            offset += len(stored)
        entries.append(TensorEntry(name, dtype, tuple(x.shape), tuple(refs), gsize, topk))
    return tuple(entries), b"".join(chunks)


def _reconstruction_checksum(
    codec: CodecSpec,
    entries: tuple[TensorEntry, ...],
    raw_body: bytes,
    bases: Mapping[str, torch.Tensor],
    inputs: Mapping[str, torch.Tensor],
) -> str:
    """The payload's checksum: that of the tensors :func:`decode` rebuilds from ``raw_body``
    (which must be finite, and equal ``inputs`` for a lossless codec).
    """
    recon = _reconstruct_all(codec, entries, memoryview(raw_body), bases)
    _check_finite(recon, "reconstruction (value overflow?)")
    checksum = content_checksum(recon)
    if codec.lossless and checksum != content_checksum(inputs):
        raise RuntimeError(f"internal error: lossless spec {codec} did not round-trip")
    return checksum


def _check_shapes(header: PayloadHeader, expect: Mapping[str, tuple[int, ...]]) -> None:
    got = header.shapes
    missing = sorted(set(expect) - set(got))
    extra = sorted(set(got) - set(expect))
    if missing or extra:
        raise CodecError(f"expect_shapes mismatch: missing {missing}, extra {extra}")
    for name, shape in got.items():
        if tuple(expect[name]) != shape:
            raise CodecError(
                f"expect_shapes mismatch: tensor {name!r} has shape {shape}, "
                f"expected {tuple(expect[name])}"
            )


def decode(
    data: bytes | bytearray | memoryview,
    *,
    base: Mapping[str, torch.Tensor] | None = None,
    expect_block: str | None = None,
    expect_shapes: Mapping[str, tuple[int, ...]] | None = None,
    max_bytes: int,
    max_decoded_bytes: int | None = None,
) -> DecodedPayload:
    """Decode and verify a payload.

    Parameters
    ----------
    data
        The payload bytes.
    base
        For ``delta``/``xor`` payloads: the tensors they were encoded against (checked by
        checksum); ignored otherwise.
    expect_block, expect_shapes
        What the caller expects; any difference is an error. With ``expect_shapes`` every
        allocation is bounded by the caller's own shapes: pass it for untrusted payloads.
    max_bytes
        Refuse payloads larger than this, before any parsing (mandatory: every decode of
        untrusted bytes is bounded).
    max_decoded_bytes
        Refuse payloads whose uncompressed body or reconstructed tensors would exceed this many
        bytes, from the header alone: before anything is decompressed or allocated. ``None``:
        the shapes bound it when ``expect_shapes`` is given, and
        :data:`fedcybgd.compression.limits.MAX_DECODED_BYTES` (1 GiB) otherwise. Peak memory
        is a small multiple of it (float32 work arrays: up to about 8x for a bf16 ``delta``).

    Raises
    ------
    CodecError
        Anything wrong with the payload or the arguments; no other exception escapes for bad
        bytes.
    """
    if max_decoded_bytes is not None:
        _check_int(max_decoded_bytes, "max_decoded_bytes", 0)
    elif expect_shapes is None:
        max_decoded_bytes = MAX_DECODED_BYTES
    max_entries = len(expect_shapes) if expect_shapes is not None else None
    header, stored = split_frame(data, max_bytes=max_bytes, max_entries=max_entries)
    codec = header.codec
    if expect_block is not None and header.block != expect_block:
        raise CodecError(
            f"block mismatch: payload is for {header.block!r}, expected {expect_block!r}"
        )
    if expect_shapes is not None:
        _check_shapes(header, expect_shapes)
    if max_decoded_bytes is not None:
        size = max(header.decoded_bytes, header.raw_body_length)
        if size > max_decoded_bytes:
            raise CodecError(
                f"payload decodes to {size} bytes, more than max_decoded_bytes={max_decoded_bytes}"
            )
    bases: dict[str, torch.Tensor] = {}
    if codec.needs_base:
        wanted = {e.name: (torch_dtype(e.dtype), e.shape) for e in header.entries}
        bases = _check_base(codec, wanted, base)
        if content_checksum(bases) != header.base_checksum:
            raise CodecError(
                "wrong base: its checksum differs from the base the payload was encoded "
                f"against (block {header.block!r}, base version {header.base_version})"
            )
    if hashlib.sha256(stored).hexdigest() != header.body_sha256:
        raise CodecError("body checksum mismatch: the payload body is corrupt")
    raw = codecs.zstd_decompress(stored, header.raw_body_length) if codec.zstd else stored
    tensors = _reconstruct_all(codec, header.entries, memoryview(raw), bases)
    _check_finite(tensors, "reconstructed tensor")
    if content_checksum(tensors) != header.checksum:
        raise CodecError(
            "checksum mismatch: the reconstructed tensors differ from what was encoded"
        )
    return DecodedPayload(header, tensors)
