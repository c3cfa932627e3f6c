"""Error feedback: a wrapper that carries each stream's compression error into its next call.

For a lossy codec ``C`` and a stream of tensors ``x_1, x_2, ...`` it sends ``C(x_t + e_t)`` and
keeps ``e_{t+1} = x_t + e_t - decode(C(x_t + e_t))``. What one call loses is added to the next, so
the *sum* of what the receiver gets tracks the sum of what was meant (the total error stays bounded
by one residual instead of growing with t). That is what optimizers need from gradient and
parameter-delta streams. For activations it matters less (each micro-batch is different data).

Residuals are float32, one per stream, in a ``StreamStates`` LRU bounded by stream count and bytes.
A residual whose shape differs from the new tensor (e.g. a shorter last batch) is dropped. With
``stream=None`` nothing is carried: the call is a plain encode.

Concurrency: calls are thread-safe, but two concurrent calls on the *same* stream both read the same
residual and the later write wins, so one call's residual is lost (a bounded, one-off error, not a
crash). Encode one stream from one thread at a time when that matters.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from compression.base import BytesLike, Codec, decode_header, to_cpu
from compression.errors import CodecError
from compression.header import Header, parse_header
from compression.streams import StreamStates

__all__ = ["ErrorFeedback"]

_NO_CAP = 1 << 62  # decoding our own bytes: the cap is for untrusted input


class ErrorFeedback(Codec):
    """Wraps a lossy codec; the bytes on the wire are exactly the inner codec's (any receiver decodes them)."""

    lossy = True

    def __init__(self, inner: Codec, *, max_streams: int = 1024, max_bytes: int = 256 << 20) -> None:
        if not inner.lossy:
            raise CodecError(f"error feedback needs a lossy codec, but {inner.name!r} is exact; drop ef=1")
        if isinstance(inner, ErrorFeedback):
            raise CodecError("error feedback is already applied; drop the second ef=1")
        super().__init__(max_decoded_bytes=inner.max_decoded_bytes)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # same wire codec
        self.summary = inner.summary + " + error feedback"  # type: ignore[misc]
        self.accepted_dtypes = inner.accepted_dtypes  # type: ignore[misc]
        self.residuals = StreamStates(max_streams=max_streams, max_bytes=max_bytes)

    @property
    def nominal_ratio(self) -> float:
        return self.inner.nominal_ratio

    def spec_params(self) -> dict[str, str]:
        return {**self.inner.spec_params(), "ef": "1"}

    def forget(self, stream: Hashable) -> None:
        """Drop the residual of ``stream`` (its peer left, or the optimizer state was reset), and the
        inner codec's state for it (a low-rank warm start)."""
        self.residuals.discard(stream)
        self.inner.forget(stream)

    def encode(self, tensor: torch.Tensor, *, stream: Hashable | None = None) -> bytes:
        x = to_cpu(tensor)
        if stream is None or x.dtype not in self.accepted_dtypes or x.numel() == 0:
            return self.inner._encode_cpu(x, x.dtype, stream)
        residual = self.residuals.get(stream)
        if residual is not None and residual.shape == x.shape:
            target = x.float() + residual  # new tensor: never alias the caller's
        else:
            target = x.to(torch.float32, copy=True)
        data = self.inner._encode_cpu(target, x.dtype, stream)
        sent = decode_header(
            type(self.inner), parse_header(data, max_decoded_bytes=_NO_CAP), max_decoded_bytes=_NO_CAP
        )
        self.residuals.put(stream, target.sub_(sent.float()))
        return data

    def decode(self, data: BytesLike) -> torch.Tensor:
        return self.inner.decode(data)

    def _encode(self, x: torch.Tensor, stream: Hashable | None) -> tuple[dict[str, int], Sequence[BytesLike]]:
        raise AssertionError("ErrorFeedback overrides encode")

    @classmethod
    def _decode(cls, header: Header, *, max_decoded_bytes: int) -> torch.Tensor:
        raise AssertionError("ErrorFeedback overrides decode")
