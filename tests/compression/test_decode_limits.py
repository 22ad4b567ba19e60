"""Decoders refuse cheaply: whatever the bytes, decoding costs what the caller allowed.

Every public decode entry point is bounded before it allocates (payload size, decoded size or
the caller's shapes, shapes and strides, quantizer groups, zstd output, seed-log size), parses
in time linear in its input, and lets only ``CodecError``/``ValueError`` escape.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import re
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zstandard
from flwr.app import Array
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcybgd.compression import (
    MAX_DECODED_BYTES,
    PAYLOAD_STYPE,
    CodecError,
    codecs,
    decode,
    encode,
    parse_spec,
    payload_from_array,
    read_header,
)
from fedcybgd.compression.layout import entry_layout
from fedcybgd.compression.limits import (
    MAX_NUMEL,
    MAX_SEEDLOG_BYTES,
    MAX_SEEDLOG_HEADER_BYTES,
)
from fedcybgd.compression.tensors import PART_ITEMSIZE
from fedcybgd.protocol import seedlog, zeroth_order

MiB = 1 << 20
# What one hostile decode may add to the peak resident set in these tests: the payloads here are
# a few kB and the decode caps a few MiB, so anything near this means an allocation escaped
# its bound (the cases fixed here each reached GBs).
GROWTH_BOUND = 96 * MiB
# FEDCYBGD_FUZZ_SCALE=N runs the property tests N times longer (the long fuzz runs).
FUZZ_SCALE = int(os.environ.get("FEDCYBGD_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=300 * FUZZ_SCALE, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


# --- helpers --------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match, field
    return int(match.group(1))


@functools.cache
def _can_reset_peak() -> bool:
    """Linux lets a process reset its peak RSS (VmHWM) by writing 5 to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kib("VmHWM")
    except (OSError, AssertionError):
        return False
    return True


class Peak:
    """How much a block of code grew the process's peak memory, in bytes (``growth``)."""

    growth = 0


@contextmanager
def peak_growth() -> Iterator[Peak]:
    """Peak resident-set growth over the block (Linux); elsewhere the peak of traced Python
    allocations (bytes, numpy; not torch), which still sees zstd output and body copies."""
    peak = Peak()
    if _can_reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _status_kib("VmRSS")
        try:
            yield peak
        finally:
            peak.growth = (_status_kib("VmHWM") - start) * 1024
        return
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.growth = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _split(payload: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack_from("<I", payload, 6)
    return json.loads(payload[10 : 10 + length]), payload[10 + length :]


def _join(header: dict[str, Any], body: bytes, *, fix_body: bool = True) -> bytes:
    """A frame around ``header`` and ``body``, by default with a body length and hash that fit."""
    if fix_body:
        header = {**header, "body_length": len(body),
                  "body_sha256": hashlib.sha256(body).hexdigest()}
    head = json.dumps(header).encode()
    return b"FCYB" + struct.pack("<HI", 1, len(head)) + head + body


def _declaring(spec: str, numel: int, body: bytes) -> bytes:
    """A well-formed payload of one float32 tensor ``w`` of ``numel`` elements whose body is
    ``body``: what a hostile sender writes to make the decoder allocate ``4 * numel`` bytes."""
    header, _ = _split(encode({"w": torch.zeros(4)}, spec, block="b", target_version=1))
    entry = header["entries"][0]
    entry["shape"] = [numel]
    entry["parts"]["data"].update(count=numel, length=4 * numel)
    header["raw_body_length"] = 4 * numel
    return _join(header, body)


def _zero_frames(total: int, frame: int = 64 * MiB) -> bytes:
    """zstd frames (no content size) that expand to ``total`` zero bytes: a few kB per 64 MiB."""
    writer = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    zeros = bytes(MiB)
    one = b"".join(writer.compress(zeros) for _ in range(frame // MiB)) + writer.flush()
    return one * (total // frame)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- the named cases ------------------------------------------------------------------------


def test_a_64_gb_declaration_is_refused_from_the_header():
    # Prepare: 545 bytes declaring 16 Gi float32 elements, the default bound applies
    data = _declaring("zstd", 16 << 30, _zero_frames(MiB, frame=MiB))
    assert len(data) < 1024

    # Execute / Assert
    with peak_growth() as peak:
        start = time.perf_counter()
        with pytest.raises(
            CodecError,
            match=f"decodes to {64 << 30} bytes, more than max_decoded_bytes={MAX_DECODED_BYTES}",
        ):
            decode(data, max_bytes=len(data))
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert peak.growth < GROWTH_BOUND


def test_the_default_decode_bound_is_one_gib_and_a_caller_can_set_its_own():
    # Prepare: just over the default, and a 4 MiB payload
    over = _declaring("zstd", MAX_DECODED_BYTES // 4 + 1, _zero_frames(MiB, frame=MiB))
    payload = encode({"w": torch.ones(MiB)}, "zstd", block="b", target_version=1)

    # Execute / Assert
    assert MAX_DECODED_BYTES == 1 << 30
    with pytest.raises(CodecError, match=f"more than max_decoded_bytes={MAX_DECODED_BYTES}"):
        decode(over, max_bytes=len(over))
    with pytest.raises(CodecError, match=f"decodes to {4 * MiB} bytes, more than "
                                         f"max_decoded_bytes={4 * MiB - 1}"):
        decode(payload, max_bytes=len(payload), max_decoded_bytes=4 * MiB - 1)
    out = decode(payload, max_bytes=len(payload), max_decoded_bytes=4 * MiB)
    assert torch.equal(out.tensors["w"], torch.ones(MiB))
    for bad in (-1, 1.5, "big", True):
        with pytest.raises(CodecError, match="max_decoded_bytes must be"):
            decode(payload, max_bytes=len(payload), max_decoded_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="max_bytes must be"):
        decode(payload, max_bytes=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([0, 2**40, 2**40], r"spans 1208925819614629174706176 elements, more than 1099511627776"),
        ([2**40 + 1], r"not a list of sizes in \[0, 1099511627776\]"),
        ([0, 2**64], r"not a list of sizes in"),
        ([-1], r"not a list of sizes in"),
        ([1] * 65, r"65 dimensions, more than 64"),
        ([2**21, 2**21, 0], r"spans 4398046511104 elements"),
    ],
)
def test_shapes_are_bounded_in_every_size_and_stride(shape: list[int], message: str):
    # Prepare: an empty tensor's payload with the shape swapped (body stays empty, so valid)
    header, body = _split(encode({"w": torch.zeros(0)}, "fp32", block="b", target_version=1))
    header["entries"][0]["shape"] = shape
    data = _join(header, body)

    # Execute / Assert: refused from the header, by the header reader too
    with pytest.raises(CodecError, match=message):
        decode(data, max_bytes=len(data))
    with pytest.raises(CodecError, match=message):
        read_header(data, max_bytes=len(data))


def test_empty_tensors_with_large_sizes_still_decode():
    # Prepare: zero elements, strides well inside the bound
    tensors = {"a": torch.zeros(0, 1 << 20), "b": torch.zeros(1 << 19, 0, 3)}
    data = encode(tensors, "fp32", block="b", target_version=1)

    # Execute
    out = decode(data, max_bytes=len(data)).tensors

    # Assert
    assert {n: tuple(t.shape) for n, t in out.items()} == {"a": (0, 1 << 20), "b": (1 << 19, 0, 3)}


@pytest.mark.timeout(120)
def test_a_zstd_bomb_is_refused_before_it_decompresses():
    # Prepare: 2 GiB of zeros in 68 kB, declared honestly (shape and raw length), default bound
    bomb = _zero_frames(2 << 30)
    data = _declaring("zstd", (2 << 30) // 4, bomb)
    assert len(data) < 100_000

    # Execute / Assert
    with peak_growth() as peak:
        start = time.perf_counter()
        with pytest.raises(CodecError, match=f"decodes to {2 << 30} bytes, more than "
                                             f"max_decoded_bytes={MAX_DECODED_BYTES}"):
            decode(data, max_bytes=len(data))
        elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert peak.growth < GROWTH_BOUND


def test_a_zstd_bomb_with_a_small_cap_stops_at_the_cap():
    # Prepare: a header that records 4 MiB (under the caller's 8 MiB cap) over a frame that
    # expands to 512 MiB
    cap = 8 * MiB
    data = _declaring("zstd", MiB, _zero_frames(512 * MiB))

    # Execute / Assert: decompression stops one byte past what the header records
    bomb = pytest.raises(CodecError, match=f"decompresses to more than the recorded {4 * MiB}")
    with peak_growth() as peak, bomb:
        decode(data, max_bytes=len(data), max_decoded_bytes=cap)
    assert peak.growth < cap + GROWTH_BOUND


def test_zstd_output_grows_with_the_frame_not_with_the_recorded_length():
    # Prepare: a 64 kB frame where the header records 1 GiB
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 10))

    # Execute / Assert
    short = pytest.raises(CodecError, match=f"body ends after {64 << 10} of the {1 << 30}")
    with peak_growth() as peak, short:
        codecs.zstd_decompress(frame, 1 << 30)
    assert peak.growth < GROWTH_BOUND


def test_a_header_group_size_cannot_inflate_dequantization():
    # Prepare: one int8 value whose header claims groups of 2**28 (the old dequantizer padded
    # to one group: 1 GiB of zeros and 1 GiB of products, from 600 bytes); the caller passes
    # its shapes and a 1 kB decode cap, and the payload is otherwise honest
    header, body = _split(encode({"w": torch.full((1,), 0.5)}, "int8", block="b",
                                 target_version=1))
    header["entries"][0]["group_size"] = 2**28
    data = _join(header, body)
    too_big = {**header, "entries": [{**header["entries"][0], "group_size": MAX_NUMEL + 1}]}

    # Execute
    with peak_growth() as peak:
        out = decode(data, max_bytes=len(data), expect_shapes={"w": (1,)},
                     max_decoded_bytes=1024)

    # Assert: same values (a group larger than the tensor is one group), no padding
    assert out.tensors["w"].tolist() == [0.5]
    assert peak.growth < GROWTH_BOUND
    with pytest.raises(CodecError, match=f"group size {MAX_NUMEL + 1} exceeds"):
        decode(_join(too_big, body), max_bytes=1 << 20)


@pytest.mark.parametrize("quant", ["int8", "int4", "int2"])
def test_quantizers_group_a_short_tensor_as_one_group(quant: str):
    # Prepare: a group far larger than the tensor, and one exactly its size
    x = torch.randn(37, generator=torch.Generator().manual_seed(0))

    # Execute
    big = codecs.quantize(x, quant, 1 << 40)
    exact = codecs.quantize(x, quant, 37)

    # Assert
    assert torch.equal(big[0], exact[0]) and torch.equal(big[1], exact[1])
    assert torch.equal(codecs.dequantize(big[0], big[1], 1 << 40),
                       codecs.dequantize(exact[0], exact[1], 37))


# --- seed logs ------------------------------------------------------------------------------


def _seed_log(units: int, steps: int) -> zeroth_order.SeedLog:
    """``steps`` steps, each choosing every one of ``units`` units (the costliest mask)."""
    every = tuple(range(units))
    return zeroth_order.SeedLog(
        block="layer.0", units=units, layout="0123456789abcdef", eps=1e-3, weight_decay=0.0,
        torch=torch.__version__, z=zeroth_order.z_fingerprint(), base="a" * 64, result="",
        steps=tuple(zeroth_order.SeedStep(i, every, zeroth_order.to_f32(0.5),
                                          zeroth_order.to_f32(1e-6)) for i in range(steps)),
    )


@pytest.mark.timeout(120)
def test_seed_log_parsing_is_linear_in_its_size():
    # Prepare: the same number of chosen units (and about the same bytes) as 4 steps of 65,535
    # units and as 64 steps of 4,096: a parser quadratic in the mask width is 16x slower on
    # the first, a linear one is no slower
    wide = seedlog.encode_seedlog(_seed_log(65_535, 4))
    narrow = seedlog.encode_seedlog(_seed_log(4_096, 64))
    assert abs(len(wide) - len(narrow)) < 0.05 * len(narrow)
    assert seedlog.decode_seedlog(wide) == _seed_log(65_535, 4)

    # Execute: best of 3, interleaved (the machine is shared)
    t_wide = t_narrow = float("inf")
    for _ in range(3):
        t_wide = min(t_wide, _timed(lambda: seedlog.decode_seedlog(wide)))
        t_narrow = min(t_narrow, _timed(lambda: seedlog.decode_seedlog(narrow)))

    # Assert
    assert t_wide < 3 * t_narrow, (t_wide, t_narrow)


def test_seed_log_encoding_is_linear_in_its_size():
    # Prepare
    wide, narrow = _seed_log(65_535, 4), _seed_log(4_096, 64)

    # Execute
    t_wide = t_narrow = float("inf")
    for _ in range(3):
        t_wide = min(t_wide, _timed(lambda: seedlog.encode_seedlog(wide)))
        t_narrow = min(t_narrow, _timed(lambda: seedlog.encode_seedlog(narrow)))

    # Assert
    assert t_wide < 3 * t_narrow, (t_wide, t_narrow)


def test_seed_log_size_is_bounded_before_parsing():
    # Prepare: a log padded to one byte over the default bound, and a small one
    small = seedlog.encode_seedlog(_seed_log(30, 2))
    big = small + bytes(MAX_SEEDLOG_BYTES + 1 - len(small))

    # Execute / Assert: refused for its size alone, before the body is looked at
    with peak_growth() as peak:
        start = time.perf_counter()
        with pytest.raises(ValueError, match=f"seed log is {MAX_SEEDLOG_BYTES + 1} bytes, "
                                             f"larger than max_bytes={MAX_SEEDLOG_BYTES}"):
            seedlog.decode_seedlog(big)
        elapsed = time.perf_counter() - start
    assert elapsed < 0.1
    assert peak.growth < GROWTH_BOUND
    with pytest.raises(ValueError, match=f"larger than max_bytes={len(small) - 1}"):
        seedlog.decode_seedlog(small, max_bytes=len(small) - 1)
    assert seedlog.decode_seedlog(small, max_bytes=len(small)) == _seed_log(30, 2)
    with pytest.raises(ValueError, match="body has"):  # a larger bound reads it, and finds junk
        seedlog.decode_seedlog(big, max_bytes=len(big))


def test_a_caller_can_bound_a_seed_log_by_its_steps_and_units():
    # Prepare: a log at the most steps and units the caller allows, and one whose extra steps
    # (54 bytes each) outgrow the room the bound leaves for a header
    honest = seedlog.encode_seedlog(_seed_log(300, 8))
    longer = seedlog.encode_seedlog(_seed_log(300, 8 + MAX_SEEDLOG_HEADER_BYTES // 54 + 1))
    bound = seedlog.max_log_bytes(8, 300)
    assert len(honest) <= bound < len(longer)

    # Execute / Assert
    assert seedlog.decode_seedlog(honest, max_steps=8, max_bytes=bound) == _seed_log(300, 8)
    with pytest.raises(ValueError, match=f"larger than max_bytes={bound}"):
        seedlog.decode_seedlog(longer, max_steps=8, max_bytes=bound)


def test_seed_log_names_the_first_step_with_a_unit_out_of_range():
    # Prepare: 10 units (2 mask bytes), step 1 sets bit 12
    data = bytearray(seedlog.encode_seedlog(_seed_log(10, 3)))
    step = 16 + 2
    data[len(data) - 2 * step + 16 + 1] |= 1 << 4

    # Execute / Assert
    with pytest.raises(ValueError, match="step 1 names units beyond the 10 there are"):
        seedlog.decode_seedlog(bytes(data))


# --- property tests: any bytes, only CodecError/ValueError, bounded memory ------------------

SPECS = [
    "fp32", "fp16", "bf16", "int8", "int4", "int2", "topk", "topk+int8", "topk+bf16",
    "zstd", "fp16+zstd", "bf16+zstd", "int8+zstd", "int4+zstd", "int2+zstd", "topk+int4+zstd",
]
BASE_SPECS = ["delta", "delta+int8+zstd", "delta+topk+int2+zstd", "delta+fp16", "xor",
              "xor+zstd"]
DECODE_CAP = 4 * MiB  # the caps the fuzzers decode under


@functools.cache
def _cases() -> tuple[tuple[bytes, dict[str, torch.Tensor] | None], ...]:
    gen = torch.Generator().manual_seed(7)
    # "e" is empty: a hostile header can give it any zero-element shape with the body intact;
    # "s" is one quantizer group: any larger group size keeps its body intact
    base = {"b": torch.randn(9, generator=gen), "e": torch.zeros(0, 3),
            "s": torch.randn(5, generator=gen), "w": torch.randn(6, 10, generator=gen)}
    new = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    out: list[tuple[bytes, dict[str, torch.Tensor] | None]] = []
    for spec in SPECS:
        out.append((encode(new, spec, block="layer.0", target_version=2, group_size=8), None))
    for spec in BASE_SPECS:
        out.append((encode(new, spec, block="layer.0", target_version=2, base_version=1,
                           base=base, group_size=8), base))
    return tuple(out)


@functools.cache
def _logs() -> tuple[bytes, ...]:
    return tuple(seedlog.encode_seedlog(_seed_log(units, steps))
                 for units, steps in ((1, 1), (30, 2), (257, 3), (2048, 1)))


# Values a hostile header puts where a number, list or string belongs.
HOSTILE_INTS = [0, 1, -1, 7, 255, 2**16, 2**20, 2**28, 2**31, 2**32 - 1, 2**32, 2**40,
                2**40 + 1, 2**62, 2**63, 2**64, 10**30]
HOSTILE_SHAPES = [[], [0], [1], [2**20], [2**28], [2**40], [2**40, 2**40], [0, 2**40, 2**40],
                  [0, 2**63, 2**63], [2**20, 2**20], [1] * 80, [-1], [2**62], [3, 2**38]]
HOSTILE_OTHER = [0.5, -0.0, 1e308, True, None, "", "x" * 300, {}, "fp32", "int8+zstd",
                 "delta+topk+int2+zstd", "f" * 64]


def _hostile_like(value: Any, rng: random.Random) -> Any:
    """Mostly a hostile value of the same JSON type, so the parser gets past its type checks."""
    if rng.random() < 0.25:
        return rng.choice(HOSTILE_INTS + HOSTILE_SHAPES + HOSTILE_OTHER)
    if isinstance(value, int) and not isinstance(value, bool):
        return rng.choice(HOSTILE_INTS)
    if isinstance(value, list):
        return rng.choice(HOSTILE_SHAPES)
    return rng.choice(HOSTILE_OTHER)


def _coherent(doc: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    """The header with entry ``index``'s ``shape``/``group_size``/``topk`` replaced and kept
    self-consistent (parts and raw length recomputed, as a careful attacker would), so the
    decoder's size, stride and allocation checks are what has to refuse it. Unchanged if the
    library's own layout refuses the change."""
    try:
        codec = parse_spec(doc["spec"])
        entries, offset = [], 0
        for at, raw in enumerate(doc["entries"]):
            entry = {**raw, **changes} if at == index else dict(raw)
            layout = entry_layout(codec, name=entry["name"], dtype=entry["dtype"],
                                  numel=math.prod(entry["shape"]),
                                  group_size=entry.get("group_size"), topk=entry.get("topk"))
            parts = {}
            for key, dtype, count in layout:
                length = count * PART_ITEMSIZE[dtype]
                parts[key] = {**entry["parts"][key], "count": count, "offset": offset,
                              "length": length}
                offset += length
            entries.append({**entry, "parts": parts})
    except (CodecError, KeyError, TypeError, ValueError):
        return doc
    out = {**doc, "entries": entries, "raw_body_length": offset}
    if not codec.zstd:
        out["body_length"] = offset
    return out


def _random_coherent(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    entry = rng.choice(doc["entries"])
    key = rng.choice(["shape", "shape", *(k for k in ("group_size", "topk") if k in entry)])
    value = rng.choice(HOSTILE_SHAPES if key == "shape" else HOSTILE_INTS)
    return _coherent(doc, doc["entries"].index(entry), **{key: value})


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from _paths(value, (*prefix, index))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replace(doc[path[0]], path[1:], value)
    return copy


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        pos = rng.randrange(max(1, len(buf)))
        op = rng.choice(["flip", "set", "insert", "delete", "truncate"])
        if op == "flip" and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == "set" and buf:
            buf[pos] = rng.choice([0, 0x22, 0x30, 0x39, 0x5B, 0x7D, 0xFF, rng.randrange(256)])
        elif op == "insert":
            buf[pos:pos] = rng.randbytes(rng.choice([1, 4, 64]))
        elif op == "delete" and buf:
            del buf[pos : pos + rng.choice([1, 4, 64])]
        else:
            del buf[pos:]
    return bytes(buf)


def _mutate_header(data: bytes, rng: random.Random, *, magic: bytes) -> bytes:
    """Swap hostile values into the JSON header (body untouched; a payload's body hash fixed)."""
    (length,) = struct.unpack_from("<I", data, 6)
    doc = json.loads(data[10 : 10 + length])
    body = data[10 + length :]
    if magic == b"FCYB" and rng.random() < 0.5:
        doc = _random_coherent(doc, rng)
    else:
        for _ in range(rng.choice([1, 1, 2, 3])):
            path = rng.choice(list(_paths(doc))[1:])
            doc = _replace(doc, path, _hostile_like(_get(doc, path), rng))
    if magic == b"FCYB" and rng.random() < 0.9:
        doc = {**doc, "body_length": len(body), "body_sha256": hashlib.sha256(body).hexdigest()}
    head = json.dumps(doc).encode()
    return magic + data[4:6] + struct.pack("<I", len(head)) + head + body


def _only_codec_errors(fn: Callable[[], Any]) -> bool:
    """Run a decode under the memory bound: True if it decoded, False if refused cleanly."""
    with peak_growth() as peak:
        try:
            fn()
            decoded = True
        except ValueError:  # CodecError is a ValueError; anything else fails the test
            decoded = False
    assert peak.growth < DECODE_CAP + GROWTH_BOUND, peak.growth
    return decoded


def _decode_everywhere(data: bytes, base: dict[str, torch.Tensor] | None) -> None:
    """Every payload entry point, each under its own bound."""
    limit = len(data) + 1
    shapes = {"b": (9,), "e": (0, 3), "s": (5,), "w": (6, 10)}
    _only_codec_errors(lambda: read_header(data, max_bytes=limit))
    _only_codec_errors(lambda: decode(data, base=base, max_bytes=limit,
                                      max_decoded_bytes=DECODE_CAP))
    _only_codec_errors(lambda: decode(data, base=base, max_bytes=limit, expect_block="layer.0",
                                      expect_shapes=shapes))
    array = Array(dtype="uint8", shape=(len(data),), stype=PAYLOAD_STYPE, data=data)
    _only_codec_errors(lambda: payload_from_array(array))


def test_every_case_decodes_unmutated():
    # the property tests below start from payloads and logs that do decode
    shapes = {"b": (9,), "e": (0, 3), "s": (5,), "w": (6, 10)}
    for data, base in _cases():
        assert _only_codec_errors(lambda d=data, b=base: decode(
            d, base=b, max_bytes=len(d), expect_shapes=shapes))
    for data in _logs():
        assert _only_codec_errors(lambda d=data: seedlog.decode_seedlog(d))


@pytest.mark.timeout(120 * FUZZ_SCALE)
@FUZZ
@given(blob=st.binary(max_size=600), framed=st.sampled_from([b"", b"FCYB", b"FCZL"]),
       header_length=st.integers(0, 700))
def test_property_random_bytes_are_refused_cleanly(blob: bytes, framed: bytes,
                                                   header_length: int):
    data = framed + struct.pack("<HI", 1, header_length) + blob if framed else blob
    _decode_everywhere(data, None)
    _only_codec_errors(lambda: seedlog.decode_seedlog(data))
    raw_length = int.from_bytes(blob[:5].ljust(5, b"\0"), "little")
    _only_codec_errors(lambda: codecs.zstd_decompress(blob, raw_length % (DECODE_CAP + 1)))


@pytest.mark.timeout(120 * FUZZ_SCALE)
@FUZZ
@given(case=st.integers(0, len(SPECS) + len(BASE_SPECS) - 1), seed=st.integers(0, 2**32 - 1),
       header=st.booleans())
def test_property_mutated_payloads_of_every_codec_are_refused_cleanly(case: int, seed: int,
                                                                      header: bool):
    data, base = _cases()[case]
    rng = random.Random(seed)
    mutated = (_mutate_header(data, rng, magic=b"FCYB") if header
               else _mutate_bytes(data, rng))
    _decode_everywhere(mutated, base)


@pytest.mark.timeout(120)
def test_every_hostile_shape_group_and_topk_count_is_refused_cleanly():
    # The systematic half of the fuzzing: each hostile value in each entry of each codec's
    # payload, in a self-consistent header with a matching body hash.
    tried = 0
    for data, base in _cases():
        header, body = _split(data)
        for index, entry in enumerate(header["entries"]):
            changes = [{"shape": shape} for shape in HOSTILE_SHAPES]
            changes += [{key: value} for key in ("group_size", "topk") if key in entry
                        for value in HOSTILE_INTS]
            for change in changes:
                doc = _coherent(header, index, **change)
                if doc is not header:
                    tried += 1
                    _decode_everywhere(_join(doc, body), base)
    assert tried > 500


@pytest.mark.timeout(120 * FUZZ_SCALE)
@FUZZ
@given(case=st.integers(0, 3), seed=st.integers(0, 2**32 - 1), header=st.booleans())
def test_property_mutated_seed_logs_are_refused_cleanly(case: int, seed: int, header: bool):
    data = _logs()[case]
    rng = random.Random(seed)
    mutated = _mutate_header(data, rng, magic=b"FCZL") if header else _mutate_bytes(data, rng)
    if _only_codec_errors(lambda: seedlog.decode_seedlog(mutated, max_steps=8)):
        # anything that decodes is a log that encodes and decodes back to itself
        log = seedlog.decode_seedlog(mutated, max_steps=8)
        assert seedlog.decode_seedlog(seedlog.encode_seedlog(log)) == log
