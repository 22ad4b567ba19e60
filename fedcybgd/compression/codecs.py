"""The per-stage transforms, each a pure function on flat tensors or bytes.

Decoders only multiply and add elementwise (never reduce or fuse), so a payload reconstructs to
the same bits on every CPU and its checksum can be verified anywhere.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import zstandard

from fedcybgd.compression.errors import CodecError

_QMAX = {"int8": 127, "int4": 7}
# int2 steps tried per group, in units of the group's mean |x|; the one with the least squared
# error wins. Lloyd-Max's step for a Gaussian is 1.25; an Adam update, flatter, wants ~1.
INT2_STEPS = (0.6, 0.8, 1.0, 1.25, 1.5, 1.8)
CODES_PER_BYTE = {"int4": 2, "int2": 4}
QUANT_BITS = {"int8": 8, "int4": 4, "int2": 2}
DEFAULT_GROUP_SIZE = {"int8": 64, "int4": 64, "int2": 256}
_CAST_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
ZSTD_READ_CHUNK = 1 << 20  # zstd output is read this much at a time


def cast_values(values: torch.Tensor, cast: str, *, tensor: str) -> torch.Tensor:
    """Round to fp16/bf16; values that overflow the target's range are an error, not inf."""
    out = values.to(_CAST_DTYPE[cast])
    if out.numel() and not bool(torch.isfinite(out).all()):
        raise CodecError(f"tensor {tensor!r}: values out of {cast} range")
    return out


def _tight_group(group_size: int, n: int) -> int:
    """The group size that groups ``n`` values exactly as ``group_size`` does, without padding
    past them: a group larger than all the values is one group of ``n`` (at least 1).

    Padding is what a header's group size could otherwise blow up (``2**33`` for one value).
    """
    return min(group_size, max(n, 1))


def quantize(
    values: torch.Tensor, quant: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise quantization of a flat tensor: absmax for ``int8``/``int4``, a fitted step
    for ``int2`` (:func:`quantize_int2`).

    Returns
    -------
    (q, scales)
        ``q``: int8 codes in [-qmax, qmax], one per value; ``scales``: float32, one per group
        (``absmax / qmax``; 0 for an all-zero group, whose codes are then all 0).

    Notes
    -----
    Scales are kept in fp32, not fp16: update deltas are often ~1e-5, where fp16 scales
    (normal range ends at 6e-5) lose precision or flush to zero, and a rounded scale breaks
    the ``absmax / (2 * qmax)`` error bound. The cost is 2 extra bytes per group (3 % at int8,
    g=64).
    """
    if quant == "int2":
        return quantize_int2(values, group_size)
    qmax = _QMAX[quant]
    n = values.numel()
    group_size = _tight_group(group_size, n)
    groups = -(-n // group_size)
    padded = torch.zeros(groups * group_size, dtype=torch.float32)
    padded[:n] = values.to(torch.float32)
    grid = padded.view(groups, group_size)
    scales = grid.abs().amax(dim=1) / qmax
    # Divide by 1 where the scale is 0 (all-zero group, or underflow): the codes round to 0.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grid / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(-1)[:n].contiguous(), scales


def quantize_int2(values: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two bits a value: codes in {-3, -1, 1, 3}, decoded as ``code * scale``.

    Absmax scaling wastes two bits (with four levels, most values round to the inner pair or
    zero), so each group's step is fitted instead: of :data:`INT2_STEPS` times the group's mean
    ``|x|``, the one with the least squared error; values beyond the outer levels are clipped
    to them. The decoder is the int8/int4 one (``q * scale``), and the encoder's choice is its
    own business. An all-zero group gets scale 0 (and codes 1).
    """
    n = values.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int8), torch.zeros(0)
    group_size = _tight_group(group_size, n)
    groups = -(-n // group_size)
    padded = torch.zeros(groups * group_size, dtype=torch.float32)
    padded[:n] = values.to(torch.float32)
    grid = padded.view(groups, group_size)
    # the padding of a short last group is not part of its mean
    counts = torch.full((groups,), float(group_size))
    counts[-1] = n - (groups - 1) * group_size
    mean_abs = grid.abs().sum(dim=1) / counts
    best_q = torch.ones_like(grid, dtype=torch.int8)
    best_scale = torch.zeros(groups)
    best_err = grid.square().sum(dim=1)  # what sending zero would cost
    for factor in INT2_STEPS:
        step = mean_abs * factor
        safe = torch.where(step > 0, step, torch.ones_like(step))
        q = (2 * torch.floor(grid / safe[:, None]) + 1).clamp_(-3, 3)
        scale = step / 2
        err = (q * scale[:, None] - grid).square().sum(dim=1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_q = torch.where(better[:, None], q.to(torch.int8), best_q)
    return best_q.reshape(-1)[:n].contiguous(), best_scale


def pack_int2(q: torch.Tensor) -> torch.Tensor:
    """Four int2 codes per byte ({-3, -1, 1, 3} -> {0, 1, 2, 3}); first value in the low bits."""
    u = ((q.to(torch.int16) + 3) // 2).to(torch.uint8)
    pad = -u.numel() % 4
    if pad:
        u = torch.cat([u, torch.zeros(pad, dtype=torch.uint8)])
    quads = u.view(-1, 4)
    return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).contiguous()


def unpack_int2(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_int2`: ``count`` int8 codes in {-3, -1, 1, 3}."""
    parts = [((packed >> shift) & 0x03).to(torch.int16) for shift in (0, 2, 4, 6)]
    codes = torch.stack(parts, dim=1).reshape(-1)[:count]
    return (2 * codes - 3).to(torch.int8)


def pack_codes(q: torch.Tensor, quant: str) -> torch.Tensor:
    """The stored form of ``quant``'s codes: int8 as they are, int4/int2 packed into bytes."""
    if quant == "int4":
        return pack_int4(q)
    if quant == "int2":
        return pack_int2(q)
    return q


def unpack_codes(stored: torch.Tensor, quant: str, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`."""
    if quant == "int4":
        return unpack_int4(stored, count)
    if quant == "int2":
        return unpack_int2(stored, count)
    return stored


def dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 values, ``q * scale`` of their group."""
    n = q.numel()
    groups = scales.numel()
    group_size = _tight_group(group_size, n)
    if groups != -(-n // group_size):
        raise CodecError(f"{groups} scales for {n} codes in groups of {group_size}")
    padded = torch.zeros(groups * group_size, dtype=torch.float32)
    padded[:n] = q.to(torch.float32)
    return (padded.view(groups, group_size) * scales[:, None]).reshape(-1)[:n].contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two int4 codes per byte, offset by 8 ([-7, 7] -> [1, 15]); first value in the low nibble."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
    pairs = u.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``count`` int8 codes."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    both = torch.stack([low, high], dim=1).reshape(-1)[:count]
    return (both - 8).to(torch.int8)


def topk_count(numel: int, ratio: float) -> int:
    """How many entries top-k keeps: ``ratio * numel`` rounded, at least 1 (0 if empty)."""
    if numel == 0:
        return 0
    return min(numel, max(1, round(ratio * numel)))


def topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest magnitudes, ascending (int64)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    idx = torch.topk(values.abs().to(torch.float32), k, sorted=False).indices
    return torch.sort(idx).values


def encode_indices(idx: torch.Tensor) -> bytes:
    """Ascending indices as uint32 gaps (first one absolute): small numbers that zstd likes."""
    arr = idx.numpy().astype(np.int64)
    gaps = np.diff(arr, prepend=np.int64(0)) if arr.size else arr
    return gaps.astype("<u4").tobytes()


def decode_indices(buf: bytes | memoryview, numel: int, *, tensor: str) -> torch.Tensor:
    """Inverse of :func:`encode_indices`, checking the indices are increasing and in range."""
    gaps = np.frombuffer(buf, dtype="<u4").astype(np.int64)
    if gaps.size == 0:
        return torch.empty(0, dtype=torch.int64)
    if gaps.size > 1 and int(gaps[1:].min()) == 0:
        raise CodecError(f"tensor {tensor!r}: top-k indices repeat")
    idx = np.cumsum(gaps)
    if int(idx[-1]) >= numel:
        raise CodecError(f"tensor {tensor!r}: top-k index {int(idx[-1])} out of range {numel}")
    return torch.from_numpy(idx)


def xor_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise XOR of two same-dtype integer bit views."""
    return torch.bitwise_xor(a, b)


def shuffle(buf: bytes, itemsize: int) -> bytes:
    """Split elements into byte planes (all first bytes, then all second bytes, ...).

    Float exponents and small deltas then form long runs that zstd compresses well.
    """
    if itemsize == 1 or not buf:
        return buf
    return np.frombuffer(buf, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()


def unshuffle(buf: bytes | memoryview, itemsize: int) -> bytes | memoryview:
    """Inverse of :func:`shuffle`."""
    if itemsize == 1 or len(buf) == 0:
        return buf
    return np.frombuffer(buf, dtype=np.uint8).reshape(itemsize, -1).T.tobytes()


def zstd_compress(buf: bytes, level: int) -> bytes:
    """One zstd frame, with the content size in its header (the decoder checks it)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(buf)


def zstd_decompress(buf: bytes | memoryview, raw_length: int) -> bytearray:
    """Decompress exactly ``raw_length`` bytes from one frame, refusing anything bigger.

    The size comes from our header (which the caller has already checked against its decode
    limit), not from the frame. Output is read in bounded chunks into a buffer that grows only as
    real output arrives, and reading stops one byte past ``raw_length``: a frame that expands
    further (a zip bomb) costs at most ``raw_length`` bytes plus one chunk, and a frame that ends
    early costs what it held.
    """
    try:
        # -1: the frame does not say (our encoder always writes it; the bounded read still holds)
        declared = zstandard.frame_content_size(bytes(buf[:18]))
        if declared not in (raw_length, -1):
            raise CodecError(
                f"zstd frame declares {declared} bytes but the header records {raw_length}"
            )
        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(buf), read_across_frames=True
        )
        out = bytearray()
        while len(out) < raw_length:
            chunk = reader.read(min(ZSTD_READ_CHUNK, raw_length - len(out)))
            if not chunk:
                break
            out += chunk
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd decompression failed: {exc}") from None
    if len(out) != raw_length:
        raise CodecError(
            f"zstd decompression failed: body ends after {len(out)} of the {raw_length} bytes "
            "the header records"
        )
    if extra:
        raise CodecError(f"zstd body decompresses to more than the recorded {raw_length} bytes")
    return out
