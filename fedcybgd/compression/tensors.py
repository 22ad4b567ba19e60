"""Dtype names on the wire, and tensors to and from little-endian bytes."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import torch

from fedcybgd.compression.errors import CodecError

# The wire is little-endian and we write tensors' native bytes: refuse to run where they differ.
if sys.byteorder != "little":  # pragma: no cover - no big-endian machine in our fleet
    raise ImportError("fedcybgd.compression needs a little-endian host")

# Tensor dtypes a payload may carry, by their wire name.
TENSOR_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})

# Dtypes of the byte sections ("parts") inside a body; uint32 only holds top-k index gaps.
PART_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint32": 4,
}

# Integer dtype with the same width, used to XOR bit patterns.
BITS_DTYPE: dict[str, str] = {
    "float32": "int32",
    "float16": "int16",
    "bfloat16": "int16",
    "float64": "int64",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
}

_NAME_OF = {dtype: name for name, dtype in TENSOR_DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, tensor: str) -> str:
    """Wire name of a torch dtype; CodecError for dtypes a payload cannot carry."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        allowed = ", ".join(TENSOR_DTYPES)
        raise CodecError(f"tensor {tensor!r}: unknown dtype {dtype}; allowed: {allowed}") from None


def torch_dtype(name: str) -> torch.dtype:
    """Torch dtype of a part or tensor wire name (``uint32`` is read through numpy instead)."""
    return TENSOR_DTYPES[name]


def work_dtype(name: str) -> torch.dtype:
    """Float dtype for delta arithmetic: float64 stays float64, the rest use float32."""
    return torch.float64 if name == "float64" else torch.float32


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """Native (little-endian) bytes of a tensor in its own dtype, bf16 included."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(buf: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A fresh, writable 1-D tensor over a copy of ``buf``; length must fit the dtype."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size == 0:
        # torch refuses to reinterpret an empty numpy-backed uint8 tensor as another dtype
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype)


def raw_fp32_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """What the tensors cost as plain fp32: 4 bytes per element, summed."""
    return sum(4 * int(t.numel()) for t in tensors.values())
