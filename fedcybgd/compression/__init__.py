"""Codecs and the wire format of block payloads.

A payload is one ``bytes`` object: a small JSON header (block, versions, codec spec, per-tensor
layout, checksums) and a body, encoded by a pipeline such as ``"delta+int8+zstd"``. Decoding
checks everything and raises :class:`CodecError` for any bad input.
"""

from fedcybgd.compression.errors import CodecError
from fedcybgd.compression.header import (
    FORMAT_VERSION,
    PartRef,
    PayloadHeader,
    TensorEntry,
    read_header,
)
from fedcybgd.compression.records import PAYLOAD_STYPE, payload_from_array, payload_to_array
from fedcybgd.compression.spec import CodecSpec, parse_spec
from fedcybgd.compression.tensors import raw_fp32_bytes
from fedcybgd.compression.wire import DecodedPayload, decode, encode

__all__ = [
    "FORMAT_VERSION",
    "PAYLOAD_STYPE",
    "CodecError",
    "CodecSpec",
    "DecodedPayload",
    "PartRef",
    "PayloadHeader",
    "TensorEntry",
    "decode",
    "encode",
    "parse_spec",
    "payload_from_array",
    "payload_to_array",
    "raw_fp32_bytes",
    "read_header",
]
