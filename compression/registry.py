"""Codec names, the spec grammar, and decoding by header: ``get_codec``, ``decode_any``, ``available_codecs``.

Spec grammar: ``NAME`` or ``NAME:key=value,key=value``, e.g. ``blockwise8:block=256``,
``lowrank:ratio=16,factors=blockwise8,ef=1``, ``int8:ef=1,sr=1``. Besides each codec's own params
(see ``codec_params``), every lossy codec takes ``ef=1`` (error feedback per stream),
``streams=N`` (how many streams keep state, LRU) and ``state_mb=M`` (their total memory).
"""

from __future__ import annotations

import torch

from compression.base import BytesLike, Codec, Param, decode_header
from compression.errors import CodecError
from compression.feedback import ErrorFeedback
from compression.floating import BFloat16Codec, Float16Codec, NoneCodec
from compression.header import CODEC_IDS, DEFAULT_MAX_DECODED_BYTES, parse_header
from compression.lowrank import LowRankCodec
from compression.quantization import Blockwise4Codec, Blockwise8Codec, Int8Codec

__all__ = [
    "CODECS",
    "STATE_PARAMS",
    "get_codec",
    "decode_any",
    "available_codecs",
    "codec_params",
    "parse_spec",
]

CODECS: dict[str, type[Codec]] = {
    c.name: c
    for c in (
        NoneCodec,
        Float16Codec,
        BFloat16Codec,
        Int8Codec,
        Blockwise8Codec,
        Blockwise4Codec,
        LowRankCodec,
    )
}
_BY_ID = {CODEC_IDS[name]: cls for name, cls in CODECS.items()}
assert set(_BY_ID) == set(CODEC_IDS.values()), "every wire id has a codec"

STATE_PARAMS: dict[str, Param] = {
    "ef": Param("bool", 0, "1 = error feedback: carry each stream's compression error into its next call"),
    "streams": Param(
        "int",
        1024,
        "streams that keep state (residuals, warm starts), least recently used dropped",
        1,
        1 << 20,
    ),
    "state_mb": Param("int", 256, "MiB of state kept over all streams, per kind of state", 0, 1 << 20),
}


def codec_params(name: str) -> dict[str, Param]:
    """Every ``key`` the spec of codec ``name`` accepts, with its meaning."""
    cls = _codec_class(name)
    return {**cls.PARAMS, **(STATE_PARAMS if cls.lossy else {})}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``NAME:key=value,...`` into the name and raw string params (validated by ``get_codec``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"codec spec must be a non-empty string like 'blockwise8:block=256', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))) if rest.strip() else ():
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise CodecError(f"codec spec {spec!r}: {item!r} is not key=value (e.g. 'blockwise8:block=256')")
        if key in params:
            raise CodecError(f"codec spec {spec!r} sets {key!r} twice; keep one")
        params[key] = value
    return name.strip(), params


def _codec_class(name: str) -> type[Codec]:
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)} (see `swarm codecs`)")
    return CODECS[name]


def _convert(spec: str, key: str, raw: str, param: Param) -> int | str | bool:
    if param.kind == "bool":
        if raw.lower() not in ("0", "1", "true", "false"):
            raise CodecError(f"codec spec {spec!r}: {key}={raw!r} must be 0 or 1")
        return raw.lower() in ("1", "true")
    if param.kind == "choice":
        if raw not in param.choices:
            raise CodecError(f"codec spec {spec!r}: {key}={raw!r} must be one of {', '.join(param.choices)}")
        return raw
    try:
        value = int(raw)
    except ValueError:
        raise CodecError(f"codec spec {spec!r}: {key}={raw!r} must be an integer") from None
    if not param.lo <= value <= param.hi:
        raise CodecError(f"codec spec {spec!r}: {key}={value} must be in [{param.lo}, {param.hi}]")
    return value


def get_codec(spec: str, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> Codec:
    """Build the codec a spec string names; ``max_decoded_bytes`` caps what its ``decode`` accepts.

    Raises ``CodecError`` naming the bad name/param and listing the valid choices.
    """
    name, raw = parse_spec(spec)
    cls = _codec_class(name)
    allowed = codec_params(name)
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        valid = ", ".join(allowed) or "none"
        raise CodecError(
            f"codec spec {spec!r}: unknown param(s) {', '.join(unknown)}; {name} accepts: {valid}"
        )
    values = {key: _convert(spec, key, value, allowed[key]) for key, value in raw.items()}
    ef = bool(values.pop("ef", False))
    max_streams = int(values.pop("streams", STATE_PARAMS["streams"].default))
    max_bytes = int(values.pop("state_mb", STATE_PARAMS["state_mb"].default)) << 20
    if cls is LowRankCodec:
        values.update(max_streams=max_streams, max_state_bytes=max_bytes)
    codec = cls(max_decoded_bytes=max_decoded_bytes, **values)
    return ErrorFeedback(codec, max_streams=max_streams, max_bytes=max_bytes) if ef else codec


def decode_any(data: BytesLike, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> torch.Tensor:
    """Decode the bytes of any codec by reading its header; ``CodecError`` on any bad input."""
    header = parse_header(data, max_decoded_bytes=max_decoded_bytes)
    return decode_header(_BY_ID[header.codec_id], header, max_decoded_bytes=max_decoded_bytes)


def available_codecs() -> list[tuple[str, float, str]]:
    """``(name, nominal ratio vs fp32 with default params, summary)`` for every codec."""
    return [(name, cls().nominal_ratio, cls.summary) for name, cls in CODECS.items()]
