"""Codecs and the wire format of block payloads.

A payload is one ``bytes`` object::

    b"FCYB" | u16 format version | u32 header length | UTF-8 JSON header | body

The header names the block, the base and target versions, the codec spec, each tensor's
dtype/shape/parts/codec metadata, a sha256 of the stored body and the content checksum of the
reconstructed tensors (:func:`fedcybgd.core.checksum.content_checksum`, the same one client caches
keep). The body is the parts back to back, byte-shuffled and zstd-compressed when the spec
ends in ``zstd``.

Specs compose stages with ``+`` in the order ``[delta|xor] [topk] [fp32|fp16|bf16]
[int8|int4|int2] [zstd]`` (see :mod:`fedcybgd.compression.spec`). ``fp32``, ``zstd`` and
``xor(+zstd)`` are bit-exact; the rest are lossy. Decoding validates everything and raises
:class:`CodecError` (a ``ValueError``) for any bad input; nothing is ever unpickled. Every decode
is bounded before it allocates: the payload by ``max_bytes``, what it decodes to by the caller's
shapes or ``max_decoded_bytes`` (default :data:`MAX_DECODED_BYTES`), shapes, strides and header by
:mod:`fedcybgd.compression.limits`.
"""

from fedcybgd.compression.errors import CodecError
from fedcybgd.compression.header import (
    FORMAT_VERSION,
    PartRef,
    PayloadHeader,
    TensorEntry,
    read_header,
)
from fedcybgd.compression.limits import MAX_DECODED_BYTES
from fedcybgd.compression.records import PAYLOAD_STYPE, payload_from_array, payload_to_array
from fedcybgd.compression.spec import CodecSpec, lossy_delta_spec, parse_spec, uses_base
from fedcybgd.compression.tensors import raw_fp32_bytes
from fedcybgd.compression.wire import DecodedPayload, decode, encode

__all__ = [
    "FORMAT_VERSION",
    "MAX_DECODED_BYTES",
    "PAYLOAD_STYPE",
    "CodecError",
    "CodecSpec",
    "DecodedPayload",
    "PartRef",
    "PayloadHeader",
    "TensorEntry",
    "decode",
    "encode",
    "lossy_delta_spec",
    "parse_spec",
    "payload_from_array",
    "payload_to_array",
    "raw_fp32_bytes",
    "read_header",
    "uses_base",
]
