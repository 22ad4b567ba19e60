"""Which byte sections ("parts") a tensor's entry holds for a codec, with dtypes and counts.

The encoder builds entries from this table and the decoder checks every header against it, so
the two can never disagree about what a body contains.
"""

from __future__ import annotations

from fedcybgd.compression.codecs import CODES_PER_BYTE
from fedcybgd.compression.errors import CodecError
from fedcybgd.compression.spec import CodecSpec
from fedcybgd.compression.tensors import BITS_DTYPE, FLOAT_DTYPES

_CAST_NAME = {"fp16": "float16", "bf16": "bfloat16"}
MAX_TOPK_NUMEL = 2**32 - 1  # index gaps are stored as uint32


def value_dtype(codec: CodecSpec, dtype: str) -> str:
    """Dtype of the stored values when no quantizer is used."""
    if codec.cast:
        return _CAST_NAME[codec.cast]
    if codec.base == "xor":
        return BITS_DTYPE[dtype]
    if codec.base == "delta":
        return "float64" if dtype == "float64" else "float32"
    return dtype


def entry_layout(
    codec: CodecSpec,
    *,
    name: str,
    dtype: str,
    numel: int,
    group_size: int | None,
    topk: int | None,
) -> list[tuple[str, str, int]]:
    """Expected ``(key, dtype, count)`` of each part, in body order.

    Raises
    ------
    CodecError
        The codec does not apply to the dtype, or its metadata is missing or inconsistent.
    """
    if not codec.lossless and dtype not in FLOAT_DTYPES:
        raise CodecError(f"tensor {name!r}: lossy codec {codec} needs a float tensor, not {dtype}")
    parts: list[tuple[str, str, int]] = []
    count = numel
    if codec.topk:
        if topk is None:
            raise CodecError(f"tensor {name!r}: top-k count missing")
        if not (0 <= topk <= numel) or (numel > 0 and topk == 0):
            raise CodecError(f"tensor {name!r}: top-k count {topk} invalid for {numel} elements")
        if numel > MAX_TOPK_NUMEL:
            raise CodecError(f"tensor {name!r}: {numel} elements is too many for top-k")
        parts.append(("idx", "uint32", topk))
        count = topk
    elif topk is not None:
        raise CodecError(f"tensor {name!r}: top-k count given but spec {codec} has no topk")
    if codec.quant:
        if group_size is None or group_size < 1:
            raise CodecError(f"tensor {name!r}: quantizer group size missing or < 1")
        codes = count if codec.quant == "int8" else -(-count // CODES_PER_BYTE[codec.quant])
        parts.append(("q", "int8" if codec.quant == "int8" else "uint8", codes))
        parts.append(("scales", "float32", -(-count // group_size)))
    else:
        if group_size is not None:
            raise CodecError(f"tensor {name!r}: group size given but spec {codec} has no quantizer")
        parts.append(("data", value_dtype(codec, dtype), count))
    return parts
