"""Tests for fedcybgd.compression: codecs, wire format, validation, fuzzing, Flower records."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import struct
from typing import Any

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcybgd.compression import (
    FORMAT_VERSION,
    PAYLOAD_STYPE,
    CodecError,
    CodecSpec,
    encode,
    parse_spec,
    payload_from_array,
    payload_to_array,
    raw_fp32_bytes,
)
from fedcybgd.compression import decode as strict_decode
from fedcybgd.compression import read_header as strict_read_header
from fedcybgd.core.checksum import content_checksum

# FEDCYBGD_FUZZ_SCALE=N runs every hypothesis fuzzer N times longer (the long fuzz runs).
FUZZ_SCALE = int(os.environ.get("FEDCYBGD_FUZZ_SCALE", "1"))
# Every decode takes a size bound; these tests bound payloads generously unless the bound is the
# point of the test.
LIMIT = 1 << 30


def decode(data: Any, **kw: Any) -> Any:
    kw.setdefault("max_bytes", LIMIT)
    return strict_decode(data, **kw)


def read_header(data: Any, **kw: Any) -> Any:
    kw.setdefault("max_bytes", LIMIT)
    return strict_read_header(data, **kw)


FLOATS = [torch.float32, torch.float16, torch.bfloat16]
LOSSLESS = ["fp32", "zstd", "xor", "xor+zstd"]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _enc(tensors: dict[str, torch.Tensor], spec: str, **kw: Any) -> bytes:
    kw.setdefault("block", "layer.0")
    kw.setdefault("target_version", 3)
    return encode(tensors, spec, **kw)


def _randn(*shape: int, seed: int = 0, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _split(payload: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack_from("<I", payload, 6)
    return json.loads(payload[10 : 10 + length]), payload[10 + length :]


def _join(header: dict[str, Any] | bytes, body: bytes, *, fix_body: bool = True) -> bytes:
    """Rebuild a frame, by default with a body length and hash that match the new body."""
    if isinstance(header, dict) and fix_body:
        header = {**header, "body_length": len(body)}
        header["body_sha256"] = hashlib.sha256(body).hexdigest()
    head = json.dumps(header).encode() if isinstance(header, dict) else header
    return b"FCYB" + struct.pack("<HI", FORMAT_VERSION, len(head)) + head + body


def _group_errors(
    x: torch.Tensor, y: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: max |x - y| and absmax of x (last group zero-padded)."""
    n = x.numel()
    pad = -n % group
    xf = torch.cat([x.reshape(-1).double(), torch.zeros(pad, dtype=torch.float64)])
    yf = torch.cat([y.reshape(-1).double(), torch.zeros(pad, dtype=torch.float64)])
    err = (xf - yf).abs().view(-1, group).amax(dim=1)
    absmax = xf.abs().view(-1, group).amax(dim=1)
    return err, absmax


# --- spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("", "fp32"),
        ("fp32", "fp32"),
        ("raw+zstd", "zstd"),
        ("FP16 + zstd", "fp16+zstd"),
        ("delta+topk+int8+zstd", "delta+topk+int8+zstd"),
        ("delta+int8+topk+zstd", "delta+topk+int8+zstd"),
        ("xor+zstd", "xor+zstd"),
        ("delta+fp16+zstd", "delta+fp16+zstd"),
    ],
)
def test_parse_spec_canonical_form(spec: str, canonical: str):
    # Execute
    parsed = parse_spec(spec)

    # Assert
    assert str(parsed) == canonical
    assert parse_spec(canonical) == parsed


def test_parse_spec_fields():
    # Execute
    parsed = parse_spec("delta+topk+int4+zstd")

    # Assert
    assert parsed == CodecSpec(base="delta", topk=True, quant="int4", zstd=True)
    assert parsed.needs_base and not parsed.lossless
    assert parse_spec("xor+zstd").lossless
    assert parse_spec("delta+int2+zstd") == CodecSpec(base="delta", quant="int2", zstd=True)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("xyz", "unknown codec 'xyz'"),
        ("int8+lz4", "unknown codec 'lz4'"),
        ("zstd+int8", "out of place"),
        ("int8+delta", "out of place"),
        ("zstd+zstd", "repeated"),
        ("fp16+bf16", "out of place"),
        ("int8++zstd", "empty stage"),
        ("fp16+int8", "use one of them"),
        ("xor+int8", "cannot be combined with lossy"),
        ("xor+topk+zstd", "cannot be combined with lossy"),
        ("zstd+topk", "'topk' must come after"),
    ],
)
def test_parse_spec_rejects(spec: str, message: str):
    # Execute / Assert
    with pytest.raises(CodecError, match=message):
        parse_spec(spec)


def test_unknown_codec_lists_allowed():
    # Execute
    with pytest.raises(CodecError) as info:
        _enc({"w": torch.ones(3)}, "int8+xyz")

    # Assert
    assert "unknown codec 'xyz'" in str(info.value)
    assert "allowed:" in str(info.value) and "delta" in str(info.value)


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["fp32", "zstd"])
@pytest.mark.parametrize("dtype", [*FLOATS, torch.float64, torch.int64, torch.int8])
def test_lossless_round_trip_is_bit_exact(spec: str, dtype: torch.dtype):
    # Prepare
    x = (_randn(7, 33, seed=1) * 50).to(dtype)
    tensors = {"b": x, "a": x[:3].clone(), "scalar": x[0, 0].clone(), "empty": x[:0]}

    # Execute
    out = decode(_enc(tensors, spec))

    # Assert
    assert list(out.tensors) == sorted(tensors)
    for name, t in tensors.items():
        assert out.tensors[name].dtype == dtype
        assert out.tensors[name].shape == t.shape
        assert out.tensors[name].is_contiguous()
        assert torch.equal(out.tensors[name], t)


@pytest.mark.parametrize("spec", ["xor", "xor+zstd"])
@pytest.mark.parametrize("dtype", [*FLOATS, torch.int32])
def test_xor_round_trip_is_bit_exact(spec: str, dtype: torch.dtype):
    # Prepare
    base = (_randn(64, 40, seed=2) * 10).to(dtype)
    new = (base.double() + (_randn(64, 40, seed=3) * 1e-2).double()).to(dtype)

    # Execute
    payload = _enc({"w": new}, spec, base={"w": base}, base_version=2)
    out = decode(payload, base={"w": base})

    # Assert
    assert out.header.base_version == 2 and out.header.base_checksum is not None
    assert out.tensors["w"].dtype == dtype
    assert torch.equal(out.tensors["w"].view(torch.uint8), new.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("cast", ["fp16", "bf16"])
def test_cast_rounds_like_torch(dtype: torch.dtype, cast: str):
    # Prepare
    x = _randn(50, 30, seed=4, dtype=dtype)
    target = torch.float16 if cast == "fp16" else torch.bfloat16

    # Execute
    out = decode(_enc({"w": x}, f"{cast}+zstd")).tensors["w"]

    # Assert
    assert out.dtype == dtype
    assert torch.equal(out, x.to(target).to(dtype))
    rel = ((out.double() - x.double()).abs() / x.double().abs().clamp_min(1e-3)).max().item()
    assert rel <= (2**-11 if cast == "fp16" else 2**-8) * 1.01


def test_fp16_cast_refuses_overflow():
    # Prepare
    x = torch.tensor([1.0, 1e6])

    # Execute / Assert
    with pytest.raises(CodecError, match=r"tensor 'w': values out of fp16 range"):
        _enc({"w": x}, "fp16")


@pytest.mark.parametrize(("quant", "levels"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantizer_error_bounded_per_group(quant: str, levels: int, dtype: torch.dtype):
    # Prepare: 3 x 50 = 150 values -> groups of 64, 64 and a short one of 22; zero middle group
    x = _randn(3, 50, seed=5, dtype=dtype) * torch.logspace(-6, 2, 150).view(3, 50).to(dtype)
    x.view(-1)[64:128] = 0

    # Execute
    out = decode(_enc({"w": x}, f"{quant}+zstd", group_size=64)).tensors["w"]

    # Assert
    assert out.dtype == dtype and out.shape == x.shape
    err, absmax = _group_errors(x.float(), out.float(), 64)
    # plus the rounding back into the tensor's own dtype (half an ulp, relative)
    rounding = torch.finfo(dtype).eps / 2 if dtype != torch.float32 else 0.0
    bound = absmax / (2 * levels) * (1 + 1e-5) + absmax * rounding * 1.01 + 1e-12
    assert torch.all(err <= bound), (err, absmax)
    assert torch.all(out.view(-1)[64:128] == 0)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantizer_all_zero_and_odd_sizes(quant: str):
    # Prepare
    tensors = {"zeros": torch.zeros(5, 7), "one": torch.tensor([3.5]), "odd": _randn(13, seed=6)}

    # Execute
    out = decode(_enc(tensors, quant, group_size=4)).tensors

    # Assert
    assert torch.equal(out["zeros"], tensors["zeros"])
    assert torch.equal(out["one"], tensors["one"])  # absmax maps to the top code exactly
    err, absmax = _group_errors(tensors["odd"], out["odd"], 4)
    assert torch.all(err <= absmax / (254 if quant == "int8" else 14) * (1 + 1e-5))


def test_int4_packs_two_values_per_byte():
    # Prepare
    x = _randn(4096, seed=7)

    # Execute
    header = read_header(_enc({"w": x}, "int4", group_size=64))

    # Assert
    (entry,) = header.entries
    assert entry.part("q").length == 2048
    assert entry.part("scales").length == 4 * 64  # fp32 scales, one per group


def test_int2_packs_four_values_per_byte_with_a_scale_per_256_by_default():
    # Prepare
    x = _randn(4096, seed=7)

    # Execute
    header = read_header(_enc({"w": x}, "int2"))

    # Assert
    (entry,) = header.entries
    assert entry.group_size == 256
    assert entry.part("q").length == 1024
    assert entry.part("scales").length == 4 * 16


def test_int2_encodes_empty_and_all_zero_tensors():
    # Prepare
    tensors = {"empty": torch.zeros(0, 3), "zeros": torch.zeros(5, 7), "one": torch.tensor([2.5])}

    # Execute
    out = decode(_enc(tensors, "int2+zstd", group_size=4)).tensors

    # Assert
    assert out["empty"].shape == (0, 3)
    assert torch.equal(out["zeros"], tensors["zeros"])
    assert float((out["one"] - 2.5).abs()) <= 2.5 * 0.25  # a lone value: within its level


def test_int2_reconstructs_values_on_its_levels_exactly():
    # Prepare: every group holds -3s, -s, s, 3s (its mean |x| is 2s, a step the encoder tries)
    levels = torch.tensor([-3.0, -1.0, 1.0, 3.0])
    x = torch.cat([levels * 0.25, levels * 1e-5, torch.zeros(4), levels * 7.0])

    # Execute
    out = decode(_enc({"w": x}, "int2", group_size=4)).tensors["w"]

    # Assert
    assert torch.equal(out, x)


def test_int2_keeps_a_gaussian_update_direction():
    # Prepare
    x = _randn(64, 1024, seed=8, scale=1e-4)

    # Execute
    base = {"w": torch.zeros_like(x)}
    out = decode(_enc({"w": x}, "delta+int2+zstd", base=base), base=base).tensors["w"]

    # Assert: Lloyd-Max's 2-bit quantizer keeps cos 0.94 of a Gaussian; a fitted step gets close
    cos = float((x * out).sum() / (x.norm() * out.norm()))
    assert cos > 0.93
    mse = float((x - out).square().mean() / x.square().mean())
    assert mse < 0.13


@FAST
@given(numel=st.integers(1, 300), group=st.integers(1, 80), log_scale=st.floats(-30, 30),
       seed=st.integers(0, 2**31))
def test_property_int2_is_never_worse_than_sending_nothing(numel, group, log_scale, seed):
    # Prepare
    x = _randn(numel, seed=seed, scale=10.0**log_scale)

    # Execute
    out = decode(_enc({"t": x}, "int2+zstd", group_size=group)).tensors["t"]

    # Assert: per group the squared error is at most the group's energy, and every value is one
    # of the group's four levels (or 0)
    for start in range(0, numel, group):
        xs, ys = x[start:start + group].double(), out[start:start + group].double()
        assert float((xs - ys).square().sum()) <= float(xs.square().sum()) * (1 + 1e-6) + 1e-300
        scale = float(ys.abs().min())
        if scale > 0:
            ratios = (ys.abs() / scale).round()
            assert set(ratios.tolist()) <= {1.0, 3.0}


def test_topk_keeps_exactly_the_largest():
    # Prepare
    x = _randn(40, 25, seed=8)
    k = round(0.1 * x.numel())

    # Execute
    out = decode(_enc({"w": x}, "topk", topk_ratio=0.1)).tensors["w"]

    # Assert
    kept = out.reshape(-1) != 0
    assert int(kept.sum()) == k
    expected = torch.topk(x.reshape(-1).abs(), k).indices
    assert set(kept.nonzero().reshape(-1).tolist()) == set(expected.tolist())
    assert torch.equal(out.reshape(-1)[kept], x.reshape(-1)[kept])


def test_topk_keeps_at_least_one():
    # Prepare
    x = torch.tensor([0.1, -5.0, 0.2])

    # Execute
    out = decode(_enc({"w": x}, "topk+zstd", topk_ratio=1e-6)).tensors["w"]

    # Assert
    assert torch.equal(out, torch.tensor([0.0, -5.0, 0.0]))


def test_delta_int8_reconstructs_base_plus_quantized_delta():
    # Prepare
    base = _randn(96, 80, seed=9, scale=0.02)
    new = base + _randn(96, 80, seed=10, scale=1e-3)

    # Execute
    payload = _enc({"w": new}, "delta+int8+zstd", base={"w": base}, base_version=1)
    out = decode(payload, base={"w": base}).tensors["w"]

    # Assert
    err, absmax = _group_errors(new - base, out - base, 64)
    assert torch.all(err <= absmax / 254 * (1 + 1e-3) + 1e-9)


def test_delta_fp16_and_topk_pipelines():
    # Prepare
    base = _randn(30, 30, seed=11, dtype=torch.bfloat16)
    new = (base.float() + _randn(30, 30, seed=12, scale=0.05)).to(torch.bfloat16)
    delta = new.float() - base.float()

    # Execute
    fp16 = decode(_enc({"w": new}, "delta+fp16+zstd", base={"w": base}), base={"w": base})
    topk = decode(_enc({"w": new}, "delta+topk+int8+zstd", base={"w": base}), base={"w": base})

    # Assert
    assert torch.equal(fp16.tensors["w"], (base.float() + delta.half().float()).bfloat16())
    changed = (topk.tensors["w"] != base).sum().item()
    assert 0 < changed <= round(0.1 * 900)
    assert topk.tensors["w"].dtype == torch.bfloat16


def test_encode_is_deterministic_and_header_is_cheap():
    # Prepare
    tensors = {"w": _randn(20, 20, seed=13), "b": _randn(20, seed=14)}

    # Execute
    first = _enc(tensors, "int8+zstd", block="layer.4", target_version=9)
    header = read_header(first)

    # Assert
    assert first == _enc(tensors, "int8+zstd", block="layer.4", target_version=9)
    assert (header.block, header.target_version, header.spec) == ("layer.4", 9, "int8+zstd")
    assert header.shapes == {"b": (20,), "w": (20, 20)}
    assert header.raw_fp32_bytes == raw_fp32_bytes(tensors)
    assert header.checksum == content_checksum(decode(first).tensors)


# --- compression actually compresses ------------------------------------------------------


def test_xor_of_unchanged_tensor_is_tiny():
    # Prepare
    w = _randn(256, 256, seed=15, scale=0.02)

    # Execute
    payload = _enc({"w": w}, "xor+zstd", base={"w": w.clone()})

    # Assert
    assert len(payload) < 0.02 * raw_fp32_bytes({"w": w})


def test_delta_int8_zstd_of_small_update_is_small():
    # Prepare
    base = _randn(256, 256, seed=16, scale=0.02)
    new = base + _randn(256, 256, seed=17, scale=1e-3)

    # Execute
    payload = _enc({"w": new}, "delta+int8+zstd", base={"w": base})

    # Assert
    assert len(payload) < 0.30 * raw_fp32_bytes({"w": new})


def test_raw_fp32_bytes_counts_four_per_element():
    # Execute / Assert
    tensors = {
        "a": torch.zeros(3, 4, dtype=torch.bfloat16),
        "b": torch.zeros(5),
        "c": torch.zeros(0),
    }
    assert raw_fp32_bytes(tensors) == 4 * (12 + 5)


# --- property tests -----------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8]


def _any_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (subnormals, -0.0, extremes), non-finite ones replaced by 0."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).reshape(shape)
    if t.is_floating_point():
        t = torch.where(torch.isfinite(t), t, torch.zeros((), dtype=dtype))
    return t


@FAST
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(_DTYPES),
    spec=st.sampled_from(LOSSLESS),
    seed=st.integers(0, 2**31),
)
def test_property_lossless_round_trip(shape, dtype, spec, seed):
    # Prepare
    x = _any_bits(shape, dtype, seed)
    base = {"t": _any_bits(shape, dtype, seed + 1)}

    # Execute
    out = decode(_enc({"t": x}, spec, base=base), base=base).tensors["t"]

    # Assert
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out.reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8))


@FAST
@given(
    numel=st.integers(1, 300),
    group=st.integers(1, 80),
    quant=st.sampled_from(["int8", "int4"]),
    log_scale=st.floats(-30, 30),
    seed=st.integers(0, 2**31),
)
def test_property_quantizer_bound(numel, group, quant, log_scale, seed):
    # Prepare
    x = _randn(numel, seed=seed, scale=10.0**log_scale)

    # Execute
    out = decode(_enc({"t": x}, f"{quant}+zstd", group_size=group)).tensors["t"]

    # Assert
    err, absmax = _group_errors(x, out, group)
    levels = 127 if quant == "int8" else 7
    assert torch.all(err <= absmax / (2 * levels) * (1 + 1e-5) + 1e-37)


# --- bad input: each check names the problem ---------------------------------------------


@pytest.fixture(scope="module")
def payload() -> bytes:
    return _enc({"w": _randn(8, 8, seed=20), "b": _randn(8, seed=21)}, "fp32")


@pytest.fixture(scope="module")
def zpayload() -> bytes:
    return _enc({"w": _randn(8, 8, seed=20), "b": _randn(8, seed=21)}, "int8+zstd")


def test_bad_magic(payload: bytes):
    with pytest.raises(CodecError, match="bad magic"):
        decode(b"XXXX" + payload[4:])


def test_unsupported_format_version(payload: bytes):
    with pytest.raises(CodecError, match="unsupported format version 2"):
        decode(payload[:4] + struct.pack("<H", 2) + payload[6:])


@pytest.mark.parametrize("cut", [3, 12, 40, -1])
def test_truncated(payload: bytes, cut: int):
    with pytest.raises(CodecError, match="truncated"):
        decode(payload[:cut])


def test_trailing_data(payload: bytes):
    with pytest.raises(CodecError, match="trailing data: 2 bytes"):
        decode(payload + b"\0\0")


def test_header_not_json(payload: bytes):
    _, body = _split(payload)
    with pytest.raises(CodecError, match="header is not valid JSON"):
        decode(_join(b"{not json", body))


def test_header_deeply_nested_json(payload: bytes):
    _, body = _split(payload)
    with pytest.raises(CodecError, match="header"):
        decode(_join(b"[" * 100_000 + b"]" * 100_000, body))


@pytest.mark.parametrize("field", ["block", "checksum", "entries", "spec", "body_length"])
def test_header_missing_field(payload: bytes, field: str):
    header, body = _split(payload)
    del header[field]
    with pytest.raises(CodecError, match=f"missing field '{field}'"):
        decode(_join(header, body, fix_body=field != "body_length"))


def test_header_wrong_field_type(payload: bytes):
    header, body = _split(payload)
    header["target_version"] = True
    with pytest.raises(CodecError, match="'target_version' must be int"):
        decode(_join(header, body))


def test_unknown_codec_in_header(payload: bytes):
    header, body = _split(payload)
    header["spec"] = "fp32+brotli"
    with pytest.raises(CodecError, match="unknown codec 'brotli'"):
        decode(_join(header, body))


def test_unknown_dtype_in_header(payload: bytes):
    header, body = _split(payload)
    header["entries"][0]["dtype"] = "complex64"
    with pytest.raises(CodecError, match="tensor 'b': unknown dtype 'complex64'"):
        decode(_join(header, body))


def test_unknown_dtype_at_encode():
    with pytest.raises(CodecError, match=r"tensor 'c': unknown dtype torch.complex64"):
        _enc({"c": torch.zeros(2, dtype=torch.complex64)}, "fp32")


def test_shape_length_mismatch(payload: bytes):
    header, body = _split(payload)
    header["entries"][1]["shape"] = [8, 9]
    with pytest.raises(CodecError, match=r"tensor 'w'.*shape/length mismatch"):
        decode(_join(header, body))


def test_part_length_mismatch(payload: bytes):
    header, body = _split(payload)
    header["entries"][0]["parts"]["data"]["length"] = 31
    with pytest.raises(CodecError, match=r"tensor 'b'.*shape/length mismatch"):
        decode(_join(header, body))


def test_offsets_out_of_range(payload: bytes):
    header, body = _split(payload)
    header["entries"][1]["parts"]["data"]["offset"] = 10_000
    with pytest.raises(CodecError, match="tensor 'w' part 'data': offsets out of range"):
        decode(_join(header, body))


def test_overlapping_parts(payload: bytes):
    header, body = _split(payload)
    header["entries"][1]["parts"]["data"]["offset"] = 16  # 'b' occupies bytes 0..32
    with pytest.raises(CodecError, match="tensor 'w' part 'data': offset 16, expected 32"):
        decode(_join(header, body))


def test_expect_block_mismatch(payload: bytes):
    with pytest.raises(
        CodecError, match=r"block mismatch: payload is for 'layer.0', expected 'head'"
    ):
        decode(payload, expect_block="head")


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        # more tensors than expected: refused before the entries are even parsed
        ({"w": (8, 8)}, r"header lists 2 tensors, more than the 1 expected"),
        ({"w": (8, 8), "b": (8,), "x": (1,)}, r"expect_shapes mismatch: missing \['x'\]"),
        ({"w": (64,), "b": (8,)},
         r"expect_shapes mismatch: tensor 'w' has shape \(8, 8\), expected \(64,\)"),
    ],
)
def test_expect_shapes_mismatch(payload: bytes, shapes, message: str):
    with pytest.raises(CodecError, match=message):
        decode(payload, expect_shapes=shapes)


def test_decode_bound_is_mandatory(payload: bytes):
    with pytest.raises(TypeError, match="max_bytes"):
        strict_decode(payload)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="max_bytes"):
        strict_read_header(payload)  # type: ignore[call-arg]


def test_header_over_one_mib_is_refused_before_parsing():
    # a frame announcing a 20 MiB header: refused from the length alone
    frame = struct.pack("<4sHI", b"FCYB", FORMAT_VERSION, 20 << 20)
    with pytest.raises(CodecError, match="exceeds the 1048576-byte limit"):
        decode(frame + b"{" * 64)
    head = b'{"pad":"' + b"x" * (1 << 20) + b'"}'
    frame = struct.pack("<4sHI", b"FCYB", FORMAT_VERSION, len(head))
    with pytest.raises(CodecError, match="exceeds the 1048576-byte limit"):
        decode(frame + head)


def test_expect_checks_pass(payload: bytes):
    out = decode(payload, expect_block="layer.0", expect_shapes={"w": (8, 8), "b": (8,)})
    assert set(out.tensors) == {"b", "w"}


def test_max_bytes(payload: bytes):
    with pytest.raises(CodecError, match=f"payload is {len(payload)} bytes, larger than max_bytes"):
        decode(payload, max_bytes=len(payload) - 1)
    with pytest.raises(CodecError, match="larger than max_bytes"):
        read_header(payload, max_bytes=100)


def test_max_decoded_bytes(payload: bytes):
    with pytest.raises(CodecError, match="more than max_decoded_bytes=100"):
        decode(payload, max_decoded_bytes=100)


def test_zip_bomb_is_refused(zpayload: bytes):
    # Prepare: a body that expands to 64 MiB, far beyond the size the header records
    header, _ = _split(zpayload)
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    declared = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))

    # Execute / Assert
    with pytest.raises(CodecError, match="more than the recorded"):
        decode(_join(header, bomb))
    with pytest.raises(CodecError, match="zstd frame declares 67108864 bytes"):
        decode(_join(header, declared))


def test_decompression_failure(zpayload: bytes):
    # Prepare
    header, body = _split(zpayload)
    garbage = body[:8] + bytes(range(200, 256)) + body[64:]

    # Execute / Assert
    for bad in (garbage, body[:-9], b"\x28\xb5\x2f\xfd" + bytes(len(body))):
        with pytest.raises(CodecError, match="zstd decompression failed"):
            decode(_join(header, bad))


def test_body_checksum_mismatch(payload: bytes):
    corrupt = bytearray(payload)
    corrupt[-3] ^= 0x40
    with pytest.raises(CodecError, match="body checksum mismatch"):
        decode(bytes(corrupt))


def test_content_checksum_mismatch(payload: bytes):
    header, body = _split(payload)
    tampered = bytearray(body)
    tampered[-3] ^= 0x01  # a tiny change of one float, still finite
    with pytest.raises(CodecError, match="checksum mismatch: the reconstructed tensors differ"):
        decode(_join(header, bytes(tampered)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_in_encode_input(bad: float):
    with pytest.raises(CodecError, match="tensor 'w': NaN or Inf in the input"):
        _enc({"w": torch.tensor([1.0, bad])}, "zstd")


def test_nan_in_reconstruction(payload: bytes):
    header, body = _split(payload)
    tampered = bytearray(body)
    tampered[0:4] = struct.pack("<f", float("nan"))
    with pytest.raises(CodecError, match="tensor 'b': NaN or Inf in the reconstructed"):
        decode(_join(header, bytes(tampered)))


def test_header_nan_constant_rejected(payload: bytes):
    header, body = _split(payload)
    raw = json.dumps(header).replace('"base_version": 0', '"base_version": NaN').encode()
    with pytest.raises(CodecError, match="non-finite number NaN"):
        decode(_join(raw, body))


@pytest.mark.parametrize("spec", ["delta+int8+zstd", "xor+zstd"])
def test_base_missing(spec: str):
    x = {"w": torch.ones(4)}
    with pytest.raises(CodecError, match="needs a base"):
        _enc(x, spec)
    payload = _enc(x, spec, base={"w": torch.zeros(4)})
    with pytest.raises(CodecError, match="needs a base"):
        decode(payload)


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ({"w": torch.zeros(5)}, r"base tensor 'w' is torch.float32 \(5,\)"),
        ({"w": torch.zeros(4, dtype=torch.float16)}, "base tensor 'w' is torch.float16"),
        ({"v": torch.zeros(4)}, r"missing \['w'\], extra \['v'\]"),
        ({"w": torch.zeros(4), "v": torch.zeros(1)}, r"extra \['v'\]"),
    ],
)
def test_base_with_wrong_names_shapes_dtypes(base, message: str):
    x = {"w": torch.ones(4)}
    with pytest.raises(CodecError, match=message):
        _enc(x, "delta+int8", base=base)
    payload = _enc(x, "delta+int8", base={"w": torch.zeros(4)})
    with pytest.raises(CodecError, match=message):
        decode(payload, base=base)


@pytest.mark.parametrize("spec", ["delta+int8+zstd", "xor+zstd"])
def test_wrong_base_is_detected(spec: str):
    # Prepare
    base = _randn(16, seed=22)
    payload = _enc({"w": base + 0.1}, spec, base={"w": base})

    # Execute / Assert
    with pytest.raises(CodecError, match="wrong base"):
        decode(payload, base={"w": base + 1e-3})


def test_lossy_codec_on_integer_tensor():
    with pytest.raises(CodecError, match="tensor 'ids': lossy codec int8 needs a float tensor"):
        _enc({"ids": torch.arange(5)}, "int8")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"group_size": 0}, "group_size must be >= 1"),
        ({"topk_ratio": 0.0}, "topk_ratio must be in"),
        ({"topk_ratio": 1.5}, "topk_ratio must be in"),
        ({"zstd_level": 99}, "zstd_level must be in"),
        ({"block": ""}, "block name must be a non-empty string"),
        ({"target_version": -1}, "target_version must be >= 0"),
    ],
)
def test_encode_rejects_bad_arguments(kw: dict[str, Any], message: str):
    with pytest.raises(CodecError, match=message):
        _enc({"w": torch.ones(3)}, "int8+zstd", **kw)


def test_encode_rejects_non_tensors():
    with pytest.raises(CodecError, match=r"'w' is not a dense torch.Tensor"):
        _enc({"w": [1.0, 2.0]}, "fp32")  # type: ignore[dict-item]


def test_decode_rejects_non_bytes():
    with pytest.raises(CodecError, match="payload must be bytes"):
        decode("FCYB")  # type: ignore[arg-type]


# --- fuzzing: anything but a verified payload is a CodecError -----------------------------


@pytest.fixture(scope="module")
def fuzz_cases() -> list[tuple[bytes, dict[str, torch.Tensor] | None]]:
    base = {"w": _randn(6, 10, seed=30), "b": _randn(5, seed=31)}
    new = {k: v + _randn(*v.shape, seed=32, scale=0.01) for k, v in base.items()}
    cases: list[tuple[bytes, dict[str, torch.Tensor] | None]] = []
    for spec in ["fp32", "zstd", "bf16+zstd", "int4+zstd", "topk+int8", "int2+zstd"]:
        cases.append((_enc(new, spec, group_size=8), None))
    for spec in ["xor+zstd", "delta+topk+int8+zstd", "delta+fp16"]:
        cases.append((_enc(new, spec, base=base, group_size=8), base))
    return cases


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.choice([1, 1, 1, 2, 4])):
        # half the edits land in the frame + header, where the parser is exercised most
        (length,) = struct.unpack_from("<I", data, 6)
        hi = 10 + length if rng.random() < 0.5 else max(len(buf), 1)
        pos = rng.randrange(0, max(1, min(hi, len(buf))))
        op = rng.choice(["flip", "set", "insert", "delete", "truncate"])
        if op == "flip" and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == "set" and buf:
            buf[pos] = rng.choice([0, 0x22, 0x30, 0x39, 0x5B, 0x7D, 0xFF, rng.randrange(256)])
        elif op == "insert":
            buf[pos:pos] = bytes([rng.randrange(256)])
        elif op == "delete" and buf:
            del buf[pos]
        else:
            del buf[pos:]
    return bytes(buf)


def _decode_or_codec_error(data: bytes, base: dict[str, torch.Tensor] | None,
                           original: bytes | None = None) -> bool:
    """True if decoded (and then verified), False if refused with CodecError.

    With ``original`` (the payload ``data`` was mutated from), a mutation that decodes must
    decode to exactly the original's content: a corruption is refused or changes nothing.
    """
    try:
        out = decode(data, base=base, max_decoded_bytes=1 << 20)
    except CodecError:
        return False
    assert content_checksum(out.tensors) == out.header.checksum
    if original is not None:
        assert out.header.checksum == decode(original, base=base).header.checksum
    return True


@pytest.mark.timeout(60)
def test_fuzz_random_bytes():
    rng = random.Random(1234)
    for i in range(400):
        blob = rng.randbytes(rng.randrange(0, 300))
        if i % 2:  # get past the magic and version checks
            blob = b"FCYB" + struct.pack("<HI", 1, rng.randrange(0, 300)) + blob
        assert not _decode_or_codec_error(blob, None)


@pytest.mark.timeout(60)
def test_fuzz_mutated_payloads(fuzz_cases):
    rng = random.Random(5678)
    outcomes = {True: 0, False: 0}
    for _ in range(1500):
        data, base = rng.choice(fuzz_cases)
        outcomes[_decode_or_codec_error(_mutate(data, rng), base, data)] += 1
    assert outcomes[False] > 1000  # nearly every mutation is caught


@pytest.mark.timeout(60)
def test_fuzz_corrupt_bodies_with_matching_body_hash(fuzz_cases):
    """Past the body hash: zstd, index, quantizer and checksum checks must hold on their own."""
    rng = random.Random(4321)
    refused = 0
    for _ in range(600):
        data, base = rng.choice(fuzz_cases)
        header, body = _split(data)
        buf = bytearray(body)
        for _ in range(rng.choice([1, 2, 5])):
            pos = rng.randrange(len(buf))
            op = rng.choice(["flip", "set", "insert", "delete"])
            if op == "flip":
                buf[pos] ^= 1 << rng.randrange(8)
            elif op == "set":
                buf[pos] = rng.randrange(256)
            elif op == "insert":
                buf[pos:pos] = bytes([rng.randrange(256)])
            else:
                del buf[pos]
        if not header["spec"].endswith("zstd"):
            header = {**header, "raw_body_length": len(buf)}  # get past the length check
        refused += not _decode_or_codec_error(_join(header, bytes(buf)), base, data)
    assert refused >= 590, refused  # 598 of 600 measured; the 2 decoded changed nothing


@pytest.mark.timeout(60 * FUZZ_SCALE)
@settings(max_examples=100 * FUZZ_SCALE, deadline=None)
@given(blob=st.binary(max_size=400), framed=st.booleans())
def test_fuzz_random_bytes_hypothesis(blob: bytes, framed: bool):
    if framed:
        blob = b"FCYB" + struct.pack("<HI", 1, len(blob)) + blob
    assert not _decode_or_codec_error(blob, None)


@pytest.mark.timeout(60 * FUZZ_SCALE)
@settings(max_examples=150 * FUZZ_SCALE, deadline=None)
@given(case=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
def test_fuzz_mutated_payloads_hypothesis(fuzz_cases, case, seed):
    data, base = fuzz_cases[case]
    _decode_or_codec_error(_mutate(data, random.Random(seed)), base, data)


# --- Flower records -----------------------------------------------------------------------


def test_payload_array_round_trip(zpayload: bytes):
    # Execute
    array = payload_to_array(zpayload)

    # Assert
    assert (array.dtype, array.shape, array.stype) == ("uint8", (len(zpayload),), PAYLOAD_STYPE)
    assert payload_from_array(array) == zpayload


def test_payload_survives_array_record_serialization(zpayload: bytes):
    # Prepare
    from flwr.app import ArrayRecord
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    record = ArrayRecord({"blk": payload_to_array(zpayload)})

    # Execute: deflate into the objects Flower ships (record, array, chunks) and inflate back
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(record).items()}
    restored = inflate_object_from_contents(record.object_id, contents)

    # Assert
    assert isinstance(restored, ArrayRecord)
    data = payload_from_array(restored["blk"])
    assert data == zpayload
    assert torch.equal(decode(data).tensors["w"], decode(zpayload).tensors["w"])


def test_payload_from_array_rejects_other_arrays():
    from flwr.app import Array

    numpy_array = Array(dtype="uint8", shape=(3,), stype="numpy.ndarray", data=b"abc")
    wrong_dtype = Array(dtype="int8", shape=(3,), stype=PAYLOAD_STYPE, data=b"abc")
    wrong_shape = Array(dtype="uint8", shape=(4,), stype=PAYLOAD_STYPE, data=b"abc")
    with pytest.raises(CodecError, match=r"stype 'numpy.ndarray' is not 'fedcybgd.payload.v1'"):
        payload_from_array(numpy_array)
    with pytest.raises(CodecError, match="dtype 'int8' is not 'uint8'"):
        payload_from_array(wrong_dtype)
    with pytest.raises(CodecError, match=r"shape \(4,\) does not match 3 data bytes"):
        payload_from_array(wrong_shape)
