"""The payload header (typed, validated) and the byte frame around header and body.

Frame: ``b"FCYB"`` | u16 format version | u32 header length | UTF-8 JSON header | body, all
little-endian. The header is plain JSON (no pickle anywhere) and fully describes the body.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from fedcybgd.compression.errors import CodecError
from fedcybgd.compression.layout import entry_layout
from fedcybgd.compression.limits import MAX_DIMS, MAX_HEADER_BYTES, MAX_NUMEL
from fedcybgd.compression.spec import CodecSpec, parse_spec
from fedcybgd.compression.tensors import PART_ITEMSIZE, TENSOR_DTYPES

MAGIC = b"FCYB"
FORMAT_VERSION = 1
_FRAME = struct.Struct("<4sHI")
FRAME_SIZE = _FRAME.size
_HEX64 = re.compile(r"[0-9a-f]{64}")
_T = TypeVar("_T")


@dataclass(frozen=True)
class PartRef:
    """One byte section of the (uncompressed) body: ``count`` elements of ``dtype``."""

    key: str
    dtype: str
    count: int
    offset: int
    length: int
    shuffled: bool = False  # stored as byte planes (see codecs.shuffle)


@dataclass(frozen=True)
class TensorEntry:
    """How one tensor is stored: its original dtype/shape, parts and codec metadata."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[PartRef, ...]
    group_size: int | None = None  # quantizer group size, when int8/int4
    topk: int | None = None  # number of kept entries, when topk

    @property
    def numel(self) -> int:
        """Number of elements of the reconstructed tensor."""
        return math.prod(self.shape)

    def part(self, key: str) -> PartRef:
        """The part called ``key`` (the layout check guarantees it exists)."""
        for ref in self.parts:
            if ref.key == key:
                return ref
        raise CodecError(f"tensor {self.name!r}: part {key!r} missing")


@dataclass(frozen=True)
class PayloadHeader:
    """Everything about a payload except the tensor data; cheap to read."""

    format_version: int
    spec: str
    block: str
    base_version: int
    target_version: int
    entries: tuple[TensorEntry, ...]
    checksum: str  # fedcybgd.core.checksum.content_checksum of the reconstructed tensors
    base_checksum: str | None  # same, of the base, for delta/xor payloads
    body_length: int  # stored (possibly compressed) body bytes
    raw_body_length: int  # body bytes before compression
    body_sha256: str  # sha256 of the stored body bytes

    @property
    def codec(self) -> CodecSpec:
        """The parsed spec."""
        return parse_spec(self.spec)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape."""
        return {e.name: e.shape for e in self.entries}

    @property
    def raw_fp32_bytes(self) -> int:
        """What the content would cost as plain fp32 (4 bytes per element)."""
        return sum(4 * e.numel for e in self.entries)

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the reconstructed tensors in their own dtypes."""
        return sum(e.numel * PART_ITEMSIZE[e.dtype] for e in self.entries)


def header_to_json(header: PayloadHeader) -> bytes:
    """Canonical compact JSON of a header."""
    entries = []
    for e in header.entries:
        item: dict[str, Any] = {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "parts": {
                p.key: {
                    "dtype": p.dtype,
                    "count": p.count,
                    "offset": p.offset,
                    "length": p.length,
                    "shuffled": p.shuffled,
                }
                for p in e.parts
            },
        }
        if e.group_size is not None:
            item["group_size"] = e.group_size
        if e.topk is not None:
            item["topk"] = e.topk
        entries.append(item)
    doc = {
        "format_version": header.format_version,
        "spec": header.spec,
        "block": header.block,
        "base_version": header.base_version,
        "target_version": header.target_version,
        "checksum": header.checksum,
        "base_checksum": header.base_checksum,
        "body_length": header.body_length,
        "raw_body_length": header.raw_body_length,
        "body_sha256": header.body_sha256,
        "entries": entries,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CodecError(f"header: duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise CodecError(f"header: non-finite number {name} is not allowed")


def _field(obj: Mapping[str, Any], key: str, kind: type[_T], where: str) -> _T:
    if key not in obj:
        raise CodecError(f"{where}: missing field {key!r}")
    value = obj[key]
    # bool is an int in Python; a JSON true where a number belongs is still wrong
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CodecError(
            f"{where}: field {key!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = _field(obj, key, int, where)
    if value < 0:
        raise CodecError(f"{where}: field {key!r} must be >= 0, got {value}")
    return value


def _optional_count(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    return None if obj.get(key) is None else _count(obj, key, where)


def _hex(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = _field(obj, key, str, where)
    if not _HEX64.fullmatch(value):
        raise CodecError(f"{where}: field {key!r} is not a sha256 hex digest")
    return value


def _shape(raw: list[Any], name: str) -> tuple[int, ...]:
    """A tensor shape whose every size, element count and stride fits :data:`MAX_NUMEL`.

    Strides are products of the later sizes whatever the others are, so a shape such as
    ``[0, 2**40, 2**40]`` holds no element yet overflows torch's stride arithmetic: the product
    of the non-zero sizes is what is bounded.
    """
    if len(raw) > MAX_DIMS:
        raise CodecError(f"tensor {name!r}: {len(raw)} dimensions, more than {MAX_DIMS}")
    for size in raw:
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_NUMEL:
            raise CodecError(
                f"tensor {name!r}: shape {raw!r:.200} is not a list of sizes in [0, {MAX_NUMEL}]"
            )
    shape = tuple(cast(list[int], raw))
    strides = math.prod(max(size, 1) for size in shape)
    if strides > MAX_NUMEL:
        raise CodecError(
            f"tensor {name!r}: shape {shape} spans {strides} elements, more than {MAX_NUMEL}"
        )
    return shape


def _parse_entry(item: object, codec: CodecSpec, index: int) -> TensorEntry:
    if not isinstance(item, dict):
        raise CodecError(f"header: entry {index} is not an object")
    name = _field(item, "name", str, f"header entry {index}")
    where = f"header entry {name!r}"
    dtype = _field(item, "dtype", str, where)
    if dtype not in TENSOR_DTYPES:
        raise CodecError(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape = _shape(_field(item, "shape", list, where), name)
    group_size = _optional_count(item, "group_size", where)
    if group_size is not None and group_size > MAX_NUMEL:
        raise CodecError(f"tensor {name!r}: group size {group_size} exceeds {MAX_NUMEL}")
    topk = _optional_count(item, "topk", where)
    layout = entry_layout(
        codec, name=name, dtype=dtype, numel=math.prod(shape), group_size=group_size, topk=topk
    )
    raw_parts = _field(item, "parts", dict, where)
    if set(raw_parts) != {key for key, _, _ in layout}:
        raise CodecError(
            f"tensor {name!r}: parts {sorted(raw_parts)} do not match codec {codec} "
            f"(expected {sorted(key for key, _, _ in layout)})"
        )
    parts = []
    for key, part_dtype, count in layout:
        raw = raw_parts[key]
        pwhere = f"tensor {name!r} part {key!r}"
        if not isinstance(raw, dict):
            raise CodecError(f"{pwhere}: not an object")
        ref = PartRef(
            key=key,
            dtype=_field(raw, "dtype", str, pwhere),
            count=_count(raw, "count", pwhere),
            offset=_count(raw, "offset", pwhere),
            length=_count(raw, "length", pwhere),
            shuffled=_field(raw, "shuffled", bool, pwhere),
        )
        if ref.dtype != part_dtype or ref.count != count:
            raise CodecError(
                f"{pwhere}: holds {ref.count} x {ref.dtype}, but shape {shape} with codec "
                f"{codec} needs {count} x {part_dtype} (shape/length mismatch)"
            )
        if ref.length != count * PART_ITEMSIZE[part_dtype]:
            raise CodecError(
                f"{pwhere}: length {ref.length} != {count} x {part_dtype} (shape/length mismatch)"
            )
        parts.append(ref)
    return TensorEntry(name, dtype, shape, tuple(parts), group_size, topk)


def _check_tiling(entries: tuple[TensorEntry, ...], raw_body_length: int) -> None:
    """Parts must cover the body exactly, back to back, so its size is set by the shapes."""
    refs = sorted((p.offset, p.length, e.name, p.key) for e in entries for p in e.parts)
    pos = 0
    for offset, length, name, key in refs:
        if offset + length > raw_body_length:
            raise CodecError(
                f"tensor {name!r} part {key!r}: offsets out of range "
                f"({offset}+{length} > body {raw_body_length})"
            )
        if offset != pos:
            raise CodecError(
                f"tensor {name!r} part {key!r}: offset {offset}, expected {pos} "
                "(parts overlap or leave gaps)"
            )
        pos += length
    if pos != raw_body_length:
        raise CodecError(f"header: parts cover {pos} bytes but the body is {raw_body_length}")


def parse_header_json(raw: bytes | memoryview, max_entries: int | None = None) -> PayloadHeader:
    """Parse and fully validate a header; CodecError names the first problem found.

    ``max_entries`` bounds the number of tensors (a block's own count, for untrusted data).
    """
    if len(raw) > MAX_HEADER_BYTES:
        raise CodecError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        doc = json.loads(
            bytes(raw).decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
        )
    except CodecError:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CodecError("header is not a JSON object")
    where = "header"
    version = _field(doc, "format_version", int, where)
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported format version {version} in header")
    spec = _field(doc, "spec", str, where)
    codec = parse_spec(spec)
    raw_entries = _field(doc, "entries", list, where)
    if max_entries is not None and len(raw_entries) > max_entries:
        raise CodecError(
            f"header lists {len(raw_entries)} tensors, more than the {max_entries} expected"
        )
    entries = tuple(_parse_entry(item, codec, i) for i, item in enumerate(raw_entries))
    names = [e.name for e in entries]
    if names != sorted(set(names)):
        raise CodecError("header: entries are not in strictly increasing name order")
    body_length = _count(doc, "body_length", where)
    raw_body_length = _count(doc, "raw_body_length", where)
    if not codec.zstd and raw_body_length != body_length:
        raise CodecError(
            f"header: body_length {body_length} != raw_body_length {raw_body_length} without zstd"
        )
    _check_tiling(entries, raw_body_length)
    base_checksum: str | None = None
    if codec.needs_base:
        base_checksum = _hex(doc, "base_checksum", where)
    elif doc.get("base_checksum") is not None:
        raise CodecError(f"header: base_checksum given but spec {spec!r} takes no base")
    return PayloadHeader(
        format_version=version,
        spec=spec,
        block=_field(doc, "block", str, where),
        base_version=_count(doc, "base_version", where),
        target_version=_count(doc, "target_version", where),
        entries=entries,
        checksum=_hex(doc, "checksum", where),
        base_checksum=base_checksum,
        body_length=body_length,
        raw_body_length=raw_body_length,
        body_sha256=_hex(doc, "body_sha256", where),
    )


def pack_frame(header: PayloadHeader, body: bytes) -> bytes:
    """Magic, version, header length, header, body."""
    head = header_to_json(header)
    return _FRAME.pack(MAGIC, header.format_version, len(head)) + head + body


def split_frame(
    data: object, *, max_bytes: int, max_entries: int | None = None
) -> tuple[PayloadHeader, memoryview]:
    """Check the frame and header; return the header and a view of the stored body.

    ``max_bytes`` is mandatory: every payload that crosses the wire is bounded before parsing.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(data).__name__}")
    try:
        view = memoryview(data).cast("B")
    except TypeError as exc:  # e.g. a non-contiguous view
        raise CodecError(f"payload is not a contiguous byte buffer: {exc}") from None
    size = view.nbytes
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
        raise CodecError(f"max_bytes must be an int >= 0, got {max_bytes!r:.40}")
    if size > max_bytes:
        raise CodecError(f"payload is {size} bytes, larger than max_bytes={max_bytes}")
    if size < FRAME_SIZE:
        raise CodecError(f"truncated payload: {size} bytes, the frame alone is {FRAME_SIZE}")
    magic, version, header_length = _FRAME.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a fedcybgd payload")
    if version != FORMAT_VERSION:
        raise CodecError(
            f"unsupported format version {version} (this library reads {FORMAT_VERSION})"
        )
    if header_length > MAX_HEADER_BYTES:
        raise CodecError(
            f"header length {header_length} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )
    if FRAME_SIZE + header_length > size:
        raise CodecError(
            f"truncated payload: header of {header_length} bytes but only "
            f"{size - FRAME_SIZE} follow the frame"
        )
    header = parse_header_json(view[FRAME_SIZE : FRAME_SIZE + header_length], max_entries)
    start = FRAME_SIZE + header_length
    end = start + header.body_length
    if size < end:
        raise CodecError(
            f"truncated payload: body needs {header.body_length} bytes, has {size - start}"
        )
    if size > end:
        raise CodecError(f"trailing data: {size - end} bytes after the body")
    return header, view[start:end]


def read_header(
    data: bytes | bytearray | memoryview, *, max_bytes: int, max_entries: int | None = None
) -> PayloadHeader:
    """Validate the frame and header of a payload without decoding any tensor.

    ``max_bytes`` (mandatory) bounds the payload, ``max_entries`` its number of tensors.

    Raises
    ------
    CodecError
        Anything wrong with the frame or header (the body is not checked).
    """
    return split_frame(data, max_bytes=max_bytes, max_entries=max_entries)[0]
