"""The binary header in front of every encoded tensor, and its validation.

Layout (little-endian), version 1::

    offset  size  field
    0       4     magic b"SWPC"
    4       1     format version (1)
    5       1     codec id (see CODEC_IDS)
    6       1     dtype code of the decoded tensor (see DTYPE_CODES)
    7       1     ndim (0..MAX_NDIM)
    8       2     header length in bytes, this field's bytes and the shape and params included
    10      8*n   shape, one uint64 per dim
    ..      1     number of params (0..MAX_PARAMS)
    ..            per param: 1 byte key length, ASCII key, int64 value
    (payload follows, its size fixed by the codec from shape and params)

Why a hand-rolled struct and not msgpack/JSON: every field has a fixed width, so a reader checks each
bound with a few comparisons *before* allocating anything, and an attacker controls nothing but
integers that are range-checked here. ``parse_header`` also applies the decoded-size cap, so a
tiny message cannot declare a tensor of terabytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from compression.errors import CodecError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "CODEC_IDS",
    "DTYPE_CODES",
    "MAX_NDIM",
    "DEFAULT_MAX_DECODED_BYTES",
    "Header",
    "pack_header",
    "parse_header",
    "header_info",
]

MAGIC = b"SWPC"
FORMAT_VERSION = 1
DEFAULT_MAX_DECODED_BYTES = 1 << 30

# Wire ids: never renumber, only append (a renumbering is a new FORMAT_VERSION).
CODEC_IDS: dict[str, int] = {
    "none": 1,
    "fp16": 2,
    "bf16": 3,
    "int8": 4,
    "blockwise8": 5,
    "blockwise4": 6,
    "lowrank": 7,
}
_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

MAX_NDIM = 8
MAX_PARAMS = 16
MAX_KEY_LEN = 16
MAX_DIM = 1 << 48  # far above any real tensor; keeps products of dims in a sane range
_FIXED = struct.Struct("<4sBBBBH")
_DIM = struct.Struct("<Q")
_VALUE = struct.Struct("<q")


@dataclass(frozen=True)
class Header:
    """A parsed, validated header; ``payload`` is a zero-copy view of the bytes after it."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: dict[str, int]
    header_len: int
    payload: memoryview

    @property
    def codec_name(self) -> str:
        return _CODEC_NAMES[self.codec_id]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def param(self, key: str, lo: int, hi: int) -> int:
        """The integer param ``key``, which must be present and in ``[lo, hi]``."""
        if key not in self.params:
            raise CodecError(
                f"{self.codec_name} header lacks param {key!r} (has {sorted(self.params)}); "
                "the sender's bytes are corrupt or from an incompatible build"
            )
        value = self.params[key]
        if not lo <= value <= hi:
            raise CodecError(
                f"{self.codec_name} header param {key}={value} is outside [{lo}, {hi}]; "
                "the bytes are corrupt or from an incompatible build"
            )
        return value

    def expect_payload(self, nbytes: int) -> memoryview:
        """The payload, after checking it is exactly ``nbytes`` long (the size shape and params imply)."""
        if len(self.payload) != nbytes:
            raise CodecError(
                f"{self.codec_name} payload is {len(self.payload)} bytes but shape {list(self.shape)} and "
                f"params {self.params} need exactly {nbytes}; the message was truncated or corrupted"
            )
        return self.payload


def pack_header(codec: str, dtype: torch.dtype, shape: tuple[int, ...], params: dict[str, int]) -> bytes:
    """Serialize a header; the encoder's own values, so violations are programming errors (asserts)."""
    assert len(shape) <= MAX_NDIM and len(params) <= MAX_PARAMS
    parts = [_DIM.pack(int(d)) for d in shape]
    parts.append(bytes([len(params)]))
    for key, value in params.items():
        raw = key.encode("ascii")
        assert 0 < len(raw) <= MAX_KEY_LEN
        parts.append(bytes([len(raw)]) + raw + _VALUE.pack(int(value)))
    body = b"".join(parts)
    length = _FIXED.size + len(body)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[codec], DTYPE_CODES[dtype], len(shape), length)
    return fixed + body


def parse_header(data: bytes | bytearray | memoryview, *, max_decoded_bytes: int) -> Header:
    """Parse and validate the header of ``data``; raises ``CodecError`` on any violation.

    ``max_decoded_bytes`` caps the size of the decoded tensor, counted at >= 4 bytes per element
    because lossy codecs decode through float32.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(
            f"expected encoded bytes, got {type(data).__name__}; pass the bytes an encoder produced"
        )
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:  # a non-contiguous memoryview
        raise CodecError(f"encoded bytes must be one contiguous buffer ({e}); pass bytes(...) of it") from e
    if len(view) < _FIXED.size:
        raise CodecError(
            f"encoded tensor is {len(view)} bytes, shorter than the {_FIXED.size}-byte fixed header; "
            "the message was truncated"
        )
    magic, version, codec_id, dtype_code, ndim, header_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(
            f"bytes start with {bytes(magic)!r}, not the codec magic {MAGIC!r}; they are not an encoded tensor"
        )
    if version != FORMAT_VERSION:
        raise CodecError(
            f"codec format version {version} is not supported (this build reads {FORMAT_VERSION}); "
            "run the same swarmpipe version as the sender"
        )
    if codec_id not in _CODEC_NAMES:
        raise CodecError(
            f"unknown codec id {codec_id} (known: {sorted(_CODEC_NAMES)}); the sender runs a newer or "
            "incompatible build"
        )
    if dtype_code not in _DTYPES:
        raise CodecError(f"unknown dtype code {dtype_code} (known: {sorted(_DTYPES)}); the bytes are corrupt")
    if ndim > MAX_NDIM:
        raise CodecError(
            f"header declares {ndim} dims, more than the maximum {MAX_NDIM}; the bytes are corrupt"
        )
    min_len = _FIXED.size + ndim * _DIM.size + 1
    if not min_len <= header_len <= len(view):
        raise CodecError(
            f"header length {header_len} is invalid: it must be at least {min_len} for {ndim} dims and at most "
            f"the {len(view)} bytes received; the message was truncated or corrupted"
        )
    shape = tuple(_DIM.unpack_from(view, _FIXED.size + i * _DIM.size)[0] for i in range(ndim))
    if any(d > MAX_DIM for d in shape):
        raise CodecError(f"declared shape {list(shape)} has a dim above {MAX_DIM}; the bytes are corrupt")
    dtype = _DTYPES[dtype_code]
    itemsize = max(torch.empty((), dtype=dtype).element_size(), 4)
    # Zero dims count as 1: an empty tensor of shape (0, 2^40) still needs sane strides.
    decoded = math.prod(max(d, 1) for d in shape) * itemsize
    if decoded > max_decoded_bytes:
        raise CodecError(
            f"declared shape {list(shape)} ({dtype}) would decode to {decoded} bytes, above the cap of "
            f"{max_decoded_bytes}; raise max_decoded_bytes if such tensors are legitimate"
        )
    params = _parse_params(view, _FIXED.size + ndim * _DIM.size, header_len, _CODEC_NAMES[codec_id])
    return Header(codec_id, dtype, shape, params, header_len, view[header_len:])


def _parse_params(view: memoryview, pos: int, end: int, codec: str) -> dict[str, int]:
    count = view[pos]
    pos += 1
    if count > MAX_PARAMS:
        raise CodecError(
            f"{codec} header declares {count} params, more than {MAX_PARAMS}; the bytes are corrupt"
        )
    params: dict[str, int] = {}
    for _ in range(count):
        if pos >= end:
            raise CodecError(f"{codec} header params run past the header length {end}; the bytes are corrupt")
        key_len = view[pos]
        if not 0 < key_len <= MAX_KEY_LEN or pos + 1 + key_len + _VALUE.size > end:
            raise CodecError(f"{codec} header param at offset {pos} is malformed; the bytes are corrupt")
        raw = bytes(view[pos + 1 : pos + 1 + key_len])
        if not (raw.isascii() and raw.decode("ascii").isidentifier()):
            raise CodecError(f"{codec} header param name {raw!r} is not an identifier; the bytes are corrupt")
        key = raw.decode("ascii")
        if key in params:
            raise CodecError(f"{codec} header repeats param {key!r}; the bytes are corrupt")
        params[key] = _VALUE.unpack_from(view, pos + 1 + key_len)[0]
        pos += 1 + key_len + _VALUE.size
    if pos != end:
        raise CodecError(
            f"{codec} header params end at byte {pos} but the header length says {end}; the bytes are corrupt"
        )
    return params


def header_info(
    data: bytes | bytearray | memoryview, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
) -> dict:
    """Validate only the header and describe it, so a server can check codec and shape before decoding.

    Returns ``{"codec", "dtype", "shape", "params", "numel", "header_bytes", "payload_bytes"}``;
    the payload size is checked against the shape only by ``decode``.
    """
    h = parse_header(data, max_decoded_bytes=max_decoded_bytes)
    return {
        "codec": h.codec_name,
        "dtype": str(h.dtype).removeprefix("torch."),
        "shape": h.shape,
        "params": dict(h.params),
        "numel": h.numel,
        "header_bytes": h.header_len,
        "payload_bytes": len(h.payload),
    }
