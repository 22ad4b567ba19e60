"""The wire form of a zeroth-order step log (:class:`fedcybgd.protocol.zeroth_order.SeedLog`).

``b"FCZL" | u16 version | u32 header length | JSON header | steps``, each step being
``u64 seed | f32 g | f32 lr | unit bitmask (ceil(units / 8) bytes)``, little-endian, unit ``u``
in bit ``u % 8`` of byte ``u // 8``. Nothing is ever unpickled; every malformed input raises
``ValueError``, and a decoded log is checked as strictly as one about to be encoded
(:func:`fedcybgd.protocol.zeroth_order.check_log`). Encoding and decoding take time linear in the
log's size. What a log means, and how it is replayed, is :mod:`fedcybgd.protocol.zeroth_order`'s.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from fedcybgd.compression.limits import MAX_SEEDLOG_BYTES, MAX_SEEDLOG_HEADER_BYTES
from fedcybgd.protocol.zeroth_order import SeedLog, SeedStep, check_log

FORMAT_VERSION = 1
MAGIC = b"FCZL"
_PREAMBLE = struct.Struct("<4sHI")
_STEP_HEAD = struct.Struct("<Qff")


def _mask_bytes(units: int) -> int:
    return (units + 7) // 8


def max_log_bytes(steps: int, units: int) -> int:
    """The most bytes an honest log of at most ``steps`` steps over ``units`` units can take:
    a tight ``max_bytes`` for :func:`decode_seedlog` when the caller knows both."""
    step = _STEP_HEAD.size + _mask_bytes(units)
    return _PREAMBLE.size + MAX_SEEDLOG_HEADER_BYTES + steps * step


def encode_seedlog(log: SeedLog) -> bytes:
    """Serialize ``log`` (see the module docstring); ``ValueError`` if it cannot be."""
    check_log(log)
    header = {
        "block": log.block,
        "units": log.units,
        "layout": log.layout,
        "eps": log.eps,
        "weight_decay": log.weight_decay,
        "torch": log.torch,
        "z": log.z,
        "chunk": log.chunk,
        "base": log.base,
        "result": log.result,
        "steps": len(log.steps),
    }
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    width = _mask_bytes(log.units)
    body = bytearray()
    for step in log.steps:
        bits = np.zeros(8 * width, dtype=np.uint8)
        bits[list(step.units)] = 1
        body += _STEP_HEAD.pack(step.seed, step.g, step.lr)
        body += np.packbits(bits, bitorder="little").tobytes()
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(head)) + head + bytes(body)


def decode_seedlog(
    data: bytes, *, max_steps: int | None = None, max_bytes: int = MAX_SEEDLOG_BYTES
) -> SeedLog:
    """Parse :func:`encode_seedlog` output; ``ValueError`` on anything malformed.

    ``max_steps`` bounds the number of steps (the local steps the server asked for), so the
    replay of an untrusted log costs at most what the honest client's training did.
    ``max_bytes`` bounds the log's size before anything is parsed (default
    :data:`fedcybgd.compression.limits.MAX_SEEDLOG_BYTES`); parsing then takes time and memory
    linear in it.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"a seed log must be bytes, got {type(data).__name__}")
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
        raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r:.40}")
    try:
        size = memoryview(data).nbytes
    except TypeError as err:  # e.g. a non-contiguous view
        raise ValueError(f"a seed log must be contiguous bytes: {err}") from None
    if size > max_bytes:
        raise ValueError(f"seed log is {size} bytes, larger than max_bytes={max_bytes}")
    data = bytes(data)
    if len(data) < _PREAMBLE.size:
        raise ValueError(f"seed log too short ({len(data)} bytes)")
    magic, version, head_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a seed log (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ValueError(f"seed log format {version} is not supported (this is {FORMAT_VERSION})")
    if head_len > MAX_SEEDLOG_HEADER_BYTES or _PREAMBLE.size + head_len > len(data):
        raise ValueError(f"seed log header length {head_len} exceeds the data")
    try:
        header = json.loads(data[_PREAMBLE.size:_PREAMBLE.size + head_len].decode(),
                            parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        # RecursionError: a header nested thousands of levels deep
        raise ValueError(f"seed log header is not JSON: {type(err).__name__}") from None
    if not isinstance(header, dict):
        raise ValueError("seed log header is not a JSON object")
    units = _field(header, "units", int)
    count = _field(header, "steps", int)
    if not 1 <= units < 1 << 16 or count < 0:
        raise ValueError(f"seed log has units={units}, steps={count}")
    if max_steps is not None and count > max_steps:
        raise ValueError(f"seed log has {count} steps, more than the {max_steps} asked for")
    width = _mask_bytes(units)
    body = data[_PREAMBLE.size + head_len:]
    step_size = _STEP_HEAD.size + width
    if len(body) != count * step_size:
        raise ValueError(
            f"seed log body has {len(body)} bytes, expected {count} steps x {step_size}"
        )
    steps = _parse_steps(body, count, units)
    log = SeedLog(
        block=_field(header, "block", str),
        units=units,
        layout=_field(header, "layout", str),
        eps=_number(header, "eps"),
        weight_decay=_number(header, "weight_decay"),
        torch=_field(header, "torch", str),
        z=_field(header, "z", str),
        steps=steps,
        chunk=_field(header, "chunk", int),
        base=_field(header, "base", str),
        result=_field(header, "result", str),
    )
    check_log(log)
    return log


def _parse_steps(body: bytes, count: int, units: int) -> tuple[SeedStep, ...]:
    """The ``count`` steps of a length-checked body, in time linear in its size."""
    step_size = _STEP_HEAD.size + _mask_bytes(units)
    rows = np.frombuffer(body, dtype=np.uint8).reshape(count, step_size)
    bits = np.unpackbits(rows[:, _STEP_HEAD.size:], axis=1, bitorder="little")
    beyond = np.flatnonzero(bits[:, units:].any(axis=1))
    if beyond.size:
        raise ValueError(
            f"seed log step {int(beyond[0])} names units beyond the {units} there are"
        )
    # one int object per unit, shared by every step: a step's tuple costs 8 bytes a unit
    numbers = tuple(range(units))
    steps = []
    for index in range(count):
        seed, g, lr = _STEP_HEAD.unpack_from(body, index * step_size)
        chosen = tuple(map(numbers.__getitem__, np.flatnonzero(bits[index]).tolist()))
        steps.append(SeedStep(seed, chosen, g, lr))
    return tuple(steps)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"seed log header holds the non-finite number {name}")


def _number(header: dict[str, Any], key: str) -> float:
    value = _field(header, key, (int, float))
    try:
        return float(value)
    except OverflowError:  # an integer such as 10**400
        raise ValueError(f"seed log header '{key}' is out of range") from None


def _field(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise ValueError(f"seed log header lacks '{key}'")
    value = header[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"seed log header '{key}' has the wrong type ({type(value).__name__})")
    return value
