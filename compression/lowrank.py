"""``lowrank``: a rank-r factorization of the tensor's 2-D view, found by warm-started power iteration.

An activation ``(B, T, C)`` is viewed as ``X = (B*T, C)`` and sent as two factors ``P (B*T, r)``
and ``Q (C, r)`` with ``X ~= P @ Q.T``: ``r * (B*T + C)`` numbers instead of ``B*T*C``. The factors
come from a few steps of subspace (power) iteration, PowerSGD-style::

    Q <- warm start (previous Q of this stream) or random    # (C, r)
    repeat iters: P = orth(X @ Q); Q = X.T @ P                # (B*T, r), (C, r)

Warm starting from the previous call of the same stream makes one or two iterations enough when
consecutive tensors share their dominant subspace (gradients of one layer across steps).
The factors are themselves encoded by another codec (``factors=fp16`` by default, or ``blockwise8``,
``int8``, ``bf16``, ``none``), each a self-describing blob, and balanced (equal column norms) so
fp16 cannot overflow. The rank is given directly (``rank=8``) or derived per tensor from a target
ratio vs fp32 (``ratio=16``). Low rank loses whatever is outside the top-r subspace; pair it with
error feedback (``ef=1``) so that loss is carried into later calls instead of dropped.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

from compression.base import BytesLike, Codec, Param, decode_header
from compression.errors import CodecError
from compression.floating import BFloat16Codec, Float16Codec, NoneCodec
from compression.header import CODEC_IDS, DEFAULT_MAX_DECODED_BYTES, Header, parse_header
from compression.quantization import Blockwise8Codec, Int8Codec
from compression.streams import StreamStates

__all__ = ["LowRankCodec"]

# Codecs allowed for the factors; never lowrank itself, so decoding cannot recurse.
_FACTOR_CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (Float16Codec, BFloat16Codec, Blockwise8Codec, Int8Codec, NoneCodec)
}
_FACTOR_IDS = {CODEC_IDS[name]: cls for name, cls in _FACTOR_CODECS.items()}
_LEN = struct.Struct("<I")
_REFERENCE_SHAPE = (8 * 256, 1024)  # (B*T, C) used to quote a nominal ratio when the rank is fixed


def _matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view ``(rows, last axis)`` of a non-empty tensor; a 0-d tensor is ``(1, 1)``."""
    cols = shape[-1] if len(shape) else 1
    return math.prod(shape) // cols, cols


class LowRankCodec(Codec):
    """Rank-r factors of the 2-D view, via warm-started power iteration; state per stream."""

    name = "lowrank"
    lossy = True
    summary = "rank-r factors of the (rows, last axis) view by warm-started power iteration; ratio=16 default"
    PARAMS: ClassVar[dict[str, Param]] = {
        "rank": Param("int", None, "fixed rank r (excludes ratio)", 1, 1 << 16),
        "ratio": Param(
            "int", 16, "target size ratio vs fp32; the rank is derived per tensor shape", 1, 1 << 16
        ),
        "iters": Param(
            "int", 2, "power iterations per call (1 is enough for slowly changing streams)", 1, 16
        ),
        "factors": Param("choice", "fp16", "codec of the two factors", choices=tuple(_FACTOR_CODECS)),
    }

    def __init__(
        self,
        *,
        rank: int | None = None,
        ratio: int | None = None,
        iters: int = 2,
        factors: str = "fp16",
        max_streams: int = 1024,
        max_state_bytes: int = 256 << 20,
        seed: int = 0,
        max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES,
    ) -> None:
        super().__init__(max_decoded_bytes=max_decoded_bytes)
        if rank is not None and ratio is not None:
            raise CodecError(f"lowrank takes rank={rank} or ratio={ratio}, not both; drop one of them")
        if rank is None and ratio is None:
            ratio = 16
        if (rank is not None and rank < 1) or (ratio is not None and ratio < 1) or iters < 1:
            raise CodecError(f"lowrank rank, ratio and iters must be >= 1, got {rank}, {ratio}, {iters}")
        if factors not in _FACTOR_CODECS:
            raise CodecError(f"lowrank factors={factors!r} is not one of {sorted(_FACTOR_CODECS)}")
        self.rank, self.ratio, self.iters, self.factors = rank, ratio, iters, factors
        self._factor_codec = _FACTOR_CODECS[factors](max_decoded_bytes=max_decoded_bytes)
        self._states = StreamStates(max_streams=max_streams, max_bytes=max_state_bytes)
        self._gen = torch.Generator().manual_seed(seed)

    def rank_for(self, rows: int, cols: int) -> int:
        """The rank used for a ``(rows, cols)`` view: fixed, or the largest meeting the target ratio."""
        if self.rank is not None:
            r = self.rank
        else:
            bytes_per_value = 4.0 / self._factor_codec.nominal_ratio
            r = int(rows * cols * 4 / (self.ratio * (rows + cols) * bytes_per_value))
        return max(1, min(r, rows, cols))

    @property
    def nominal_ratio(self) -> float:
        if self.ratio is not None:
            return float(self.ratio)
        rows, cols = _REFERENCE_SHAPE
        return rows * cols * self._factor_codec.nominal_ratio / (self.rank_for(rows, cols) * (rows + cols))

    def spec_params(self) -> dict[str, str]:
        p = {"rank": str(self.rank)} if self.rank is not None else {"ratio": str(self.ratio)}
        p.update(iters=str(self.iters), factors=self.factors)
        return p

    def forget(self, stream: Hashable) -> None:
        """Drop the warm start of ``stream`` (e.g. its peer left)."""
        self._states.discard(stream)

    def _encode(self, x: torch.Tensor, stream: Hashable | None) -> tuple[dict[str, int], Sequence[BytesLike]]:
        rows, cols = _matrix_shape(x.shape)
        r = self.rank_for(rows, cols)
        X = x.reshape(rows, cols).float()  # (M, N)
        q = self._states.get(stream) if stream is not None else None
        if q is None or q.shape != (cols, r):
            q = torch.randn(cols, r, generator=self._gen)  # (N, r) cold start
        for _ in range(self.iters):
            p = torch.linalg.qr(X @ q).Q  # (M, r), orthonormal columns
            q = X.T @ p  # (N, r)
        if not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(p).all())):
            raise CodecError(
                "codec lowrank got a tensor with NaN or Inf values; find where they come from or send with 'none'"
            )
        if stream is not None:
            self._states.put(stream, q)
        # Balance: give both factors the same column norms (fp16-safe); X ~= p @ q.T is unchanged.
        gain = q.norm(dim=0).sqrt_().clamp_min_(1e-30)  # (r,)
        p_blob = self._factor_codec.encode(p * gain)
        q_blob = self._factor_codec.encode(q / gain)
        return {"rank": r}, [_LEN.pack(len(p_blob)), p_blob, q_blob]

    @classmethod
    def _decode(cls, header: Header, *, max_decoded_bytes: int) -> torch.Tensor:
        rows, cols = _matrix_shape(header.shape)
        r = header.param("rank", 1, min(rows, cols))
        payload = header.payload
        if len(payload) < _LEN.size:
            raise CodecError(
                f"lowrank payload is {len(payload)} bytes, too short for its factor table; truncated"
            )
        (p_len,) = _LEN.unpack_from(payload, 0)
        if p_len > len(payload) - _LEN.size:
            raise CodecError(
                f"lowrank first factor claims {p_len} bytes but only {len(payload) - _LEN.size} follow; truncated"
            )
        p = _decode_factor(payload[_LEN.size : _LEN.size + p_len], (rows, r), max_decoded_bytes)
        q = _decode_factor(payload[_LEN.size + p_len :], (cols, r), max_decoded_bytes)
        return p @ q.T  # (M, N)


def _decode_factor(blob: memoryview, shape: tuple[int, int], max_decoded_bytes: int) -> torch.Tensor:
    h = parse_header(blob, max_decoded_bytes=max_decoded_bytes)
    if h.codec_id not in _FACTOR_IDS:
        raise CodecError(f"lowrank factor uses codec {h.codec_name!r}, not one of {sorted(_FACTOR_CODECS)}")
    if h.shape != shape or h.dtype != torch.float32:
        raise CodecError(
            f"lowrank factor has shape {list(h.shape)} ({h.dtype}) but the header implies {list(shape)} "
            "(torch.float32); the bytes are corrupt"
        )
    return decode_header(_FACTOR_IDS[h.codec_id], h, max_decoded_bytes=max_decoded_bytes)
