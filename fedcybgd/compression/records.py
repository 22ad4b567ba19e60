"""Carry a payload through Flower as one raw-bytes ``Array`` (chunked, deduplicated by Flower)."""

from __future__ import annotations

from flwr.app import Array

from fedcybgd.compression.errors import CodecError

PAYLOAD_STYPE = "fedcybgd.payload.v1"


def payload_to_array(data: bytes) -> Array:
    """Wrap payload bytes as ``Array(dtype="uint8", shape=(n,), stype=PAYLOAD_STYPE)``.

    Not a numpy-typed Array on purpose: Flower's FedAvg cannot average it by mistake.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(data).__name__}")
    raw = bytes(data)
    return Array(dtype="uint8", shape=(len(raw),), stype=PAYLOAD_STYPE, data=raw)


def payload_from_array(array: Array) -> bytes:
    """The payload bytes inside an Array made by :func:`payload_to_array`."""
    if not isinstance(array, Array):
        raise CodecError(f"expected a flwr Array, got {type(array).__name__}")
    if array.stype != PAYLOAD_STYPE:
        raise CodecError(f"array stype {array.stype!r} is not {PAYLOAD_STYPE!r}")
    if array.dtype != "uint8":
        raise CodecError(f"array dtype {array.dtype!r} is not 'uint8'")
    data = bytes(array.data)
    if tuple(array.shape) != (len(data),):
        raise CodecError(f"array shape {tuple(array.shape)} does not match {len(data)} data bytes")
    return data
