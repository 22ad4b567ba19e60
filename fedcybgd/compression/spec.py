"""Codec spec strings: parse, validate, and print them in canonical form.

Grammar (stages joined by ``+``, case-insensitive, each at most once)::

    spec  := "" | "fp32" | "raw" | stage ("+" stage)*
    order := [delta | xor] [topk] [fp32 | fp16 | bf16] [int8 | int4 | int2] [zstd]

``topk`` may also be written after the cast or quantizer (``int8+topk``): it always selects
first and the cast/quantizer then applies to the kept values. ``fp32``/``raw`` means "keep the
tensor's own dtype" (no cast). Canonical form follows ``order``; the empty pipeline is ``fp32``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from fedcybgd.compression.errors import CodecError

BaseStage = Literal["delta", "xor"]
CastStage = Literal["fp16", "bf16"]
QuantStage = Literal["int8", "int4", "int2"]

# Slot of each stage name; slots must appear in increasing rank (topk is checked separately).
_SLOT = {
    "delta": 0,
    "xor": 0,
    "fp32": 1,
    "raw": 1,
    "fp16": 1,
    "bf16": 1,
    "int8": 2,
    "int4": 2,
    "int2": 2,
    "zstd": 3,
}
_ALLOWED = "delta, xor, topk, fp32 (= raw), fp16, bf16, int8, int4, int2, zstd"


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec pipeline; ``str()`` gives the canonical spec string."""

    base: BaseStage | None = None
    topk: bool = False
    cast: CastStage | None = None
    quant: QuantStage | None = None
    zstd: bool = False

    @property
    def needs_base(self) -> bool:
        """Encode and decode both need the base tensors."""
        return self.base is not None

    @property
    def lossless(self) -> bool:
        """Reconstruction is bit-exact (raw or xor, with or without zstd)."""
        return self.base != "delta" and not self.topk and self.cast is None and self.quant is None

    def __str__(self) -> str:
        stages: list[str] = []
        if self.base:
            stages.append(self.base)
        if self.topk:
            stages.append("topk")
        if self.cast:
            stages.append(self.cast)
        if self.quant:
            stages.append(self.quant)
        if self.zstd:
            stages.append("zstd")
        return "+".join(stages) or "fp32"


def parse_spec(spec: str) -> CodecSpec:
    """Parse and validate a spec string such as ``"delta+int8+zstd"``.

    Raises
    ------
    CodecError
        Unknown stage, repeated or misordered stage, or a combination that makes no sense.
    """
    if not isinstance(spec, str):
        raise CodecError(f"codec spec must be a string, got {type(spec).__name__}")
    text = spec.strip().lower()
    names = [] if text == "" else [s.strip() for s in text.split("+")]
    seen: set[str] = set()
    last_rank = -1
    topk_at: int | None = None
    values: dict[int, str] = {}
    for pos, name in enumerate(names):
        if name == "":
            raise CodecError(f"empty stage in spec {spec!r}")
        if name != "topk" and name not in _SLOT:
            raise CodecError(f"unknown codec {name!r} in spec {spec!r}; allowed: {_ALLOWED}")
        if name in seen:
            raise CodecError(f"codec {name!r} repeated in spec {spec!r}")
        seen.add(name)
        if name == "topk":
            topk_at = pos
            continue
        rank = _SLOT[name]
        if rank <= last_rank:
            raise CodecError(
                f"codec {name!r} out of place in spec {spec!r}; "
                "order: [delta|xor] [topk] [fp32|fp16|bf16] [int8|int4|int2] [zstd]"
            )
        last_rank = rank
        values[rank] = name
    if topk_at is not None and (
        any(_SLOT.get(n) == 0 for n in names[topk_at:]) or "zstd" in names[:topk_at]
    ):
        raise CodecError(f"'topk' must come after delta/xor and before zstd in spec {spec!r}")
    cast_name = values.get(1)
    parsed = CodecSpec(
        base=typing.cast(BaseStage | None, values.get(0)),
        topk=topk_at is not None,
        cast=typing.cast(CastStage | None, None if cast_name in ("fp32", "raw") else cast_name),
        quant=typing.cast(QuantStage | None, values.get(2)),
        zstd=3 in values,
    )
    if parsed.cast and parsed.quant:
        # Both set the stored precision; quantizing cast values only adds rounding.
        raise CodecError(
            f"spec {spec!r} combines {parsed.cast!r} with {parsed.quant!r}; use one of them"
        )
    if parsed.base == "xor" and not parsed.lossless:
        raise CodecError(
            f"spec {spec!r}: 'xor' is an exact delta and cannot be combined with lossy stages"
        )
    return parsed


def lossy_delta_spec(spec: str) -> CodecSpec:
    """``spec`` parsed, if it is a lossy ``delta`` codec (what a quantized install rounds to);
    ``CodecError`` otherwise."""
    parsed = parse_spec(spec)
    if parsed.base != "delta" or parsed.lossless:
        raise CodecError(f"spec {spec!r} is not a lossy 'delta' codec (e.g. 'delta+int8+zstd')")
    return parsed


def uses_base(spec: str) -> bool:
    """Does ``spec`` encode against a base (``delta`` or ``xor``)?"""
    return parse_spec(spec).needs_base
