"""Fuzzing the decoder with untrusted bytes: only ``CodecError``, no other exception, hang or big allocation.

Inputs: random bytes, random bytes behind a valid magic/version, valid encodings truncated or with
bits flipped, and hand-packed headers declaring huge or inconsistent shapes. Every decode runs with
a 1 MiB cap; a hang shows up as a hypothesis deadline failure.
"""

from __future__ import annotations

import resource
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compression import CodecError, decode_any, get_codec, header_info
from compression.header import CODEC_IDS, DTYPE_CODES, FORMAT_VERSION, MAGIC

CAP = 1 << 20
SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "blockwise8:block=16",
    "blockwise4:block=16",
    "blockwise4:code=uniform",
    "lowrank:rank=3",
    "lowrank:rank=2,factors=blockwise8",
    "lowrank:rank=2,factors=int8",
]


def _corpus() -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    blobs = []
    for spec in SPECS:
        codec = get_codec(spec)
        for shape in [(), (5,), (3, 7), (2, 4, 9)]:
            blobs.append(codec.encode(torch.randn(shape, generator=gen)))
    blobs.append(get_codec("none").encode(torch.tensor([True, False, True])))
    blobs.append(get_codec("none").encode(torch.arange(6).view(2, 3)))
    return blobs


CORPUS = _corpus()
FUZZ = settings(max_examples=300, deadline=5000, suppress_health_check=[HealthCheck.too_slow])


def _decode_safely(data: bytes) -> None:
    try:
        out = decode_any(data, max_decoded_bytes=CAP)
    except CodecError:
        return
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    assert out.numel() * max(out.element_size(), 4) <= CAP


@pytest.fixture(scope="module", autouse=True)
def _no_large_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    yield
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 256, f"peak memory grew by {grown_mib:.0f} MiB while fuzzing"


def test_corpus_decodes():
    for blob in CORPUS:
        decode_any(blob, max_decoded_bytes=CAP)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data):
    _decode_safely(data)


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 255), st.integers(0, 255))
def test_random_bytes_after_valid_magic(rest, codec_id, dtype_code):
    _decode_safely(MAGIC + bytes([FORMAT_VERSION, codec_id % 9, dtype_code % 12]) + rest)


@FUZZ
@given(st.sampled_from(CORPUS), st.floats(0, 1, exclude_max=True))
def test_truncated(blob, fraction):
    cut = blob[: int(len(blob) * fraction)]
    with pytest.raises(CodecError):
        decode_any(cut, max_decoded_bytes=CAP)


@FUZZ
@given(st.sampled_from(CORPUS), st.lists(st.integers(0, 1 << 30), min_size=1, max_size=8))
def test_bit_flips(blob, positions):
    data = bytearray(blob)
    for pos in positions:
        data[(pos >> 3) % len(data)] ^= 1 << (pos & 7)
    _decode_safely(bytes(data))


@FUZZ
@given(
    st.sampled_from(sorted(CODEC_IDS.values())),
    st.sampled_from(sorted(DTYPE_CODES.values())),
    st.lists(st.integers(0, (1 << 64) - 1), max_size=9),
    st.dictionaries(
        st.sampled_from(["block", "mu", "code", "rank", "zz"]), st.integers(-(2**63), 2**63 - 1), max_size=4
    ),
    st.binary(max_size=64),
)
def test_declared_shapes_and_params(codec_id, dtype_code, shape, params, payload):
    body = b"".join(struct.pack("<Q", d) for d in shape) + bytes([len(params)])
    for key, value in params.items():
        body += bytes([len(key)]) + key.encode() + struct.pack("<q", value)
    ndim = min(len(shape), 255)
    header = struct.pack("<4sBBBBH", MAGIC, FORMAT_VERSION, codec_id, dtype_code, ndim, 10 + len(body)) + body
    _decode_safely(header + payload)
    try:
        info = header_info(header + payload, max_decoded_bytes=CAP)
    except CodecError:
        return
    assert info["numel"] * 4 <= CAP


def test_huge_declared_lowrank_is_refused_from_the_header():
    blob = get_codec("lowrank:rank=1").encode(torch.randn(4, 4))
    # rewrite the shape to (2^24, 2^24): a few hundred bytes claiming 1 PiB of output
    data = bytearray(blob)
    struct.pack_into("<QQ", data, 10, 1 << 24, 1 << 24)
    with pytest.raises(CodecError, match="above the cap"):
        decode_any(bytes(data))
