"""Codecs that only change the float format: ``none`` (bit-exact, any dtype), ``fp16`` and ``bf16``.

``none`` keeps every dtype as is (bf16 stays bf16: two bytes, not four). ``fp16`` and ``bf16``
halve fp32 tensors; the decoded tensor has the sender's dtype again. fp16 saturates at +-65504
instead of overflowing to inf (an activation of 1e5 becomes 65504, not inf, so one outlier cannot
poison the next stage); bf16 keeps fp32's range with 8 bits of mantissa.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

from compression.base import BytesLike, Codec, tensor_bytes, tensor_from
from compression.header import DTYPE_CODES, Header

__all__ = ["NoneCodec", "Float16Codec", "BFloat16Codec"]

_FP16_MAX = 65504.0


class NoneCodec(Codec):
    """Raw bytes of the tensor, any dtype: bit-exact."""

    name = "none"
    lossy = False
    summary = "raw bytes, any dtype (bf16 stays bf16); bit-exact"
    accepted_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(DTYPE_CODES)

    @property
    def nominal_ratio(self) -> float:
        return 1.0

    def _encode(self, x: torch.Tensor, stream: Hashable | None) -> tuple[dict[str, int], Sequence[BytesLike]]:
        return {}, [tensor_bytes(x)]

    @classmethod
    def _decode(cls, header: Header, *, max_decoded_bytes: int) -> torch.Tensor:
        itemsize = torch.empty((), dtype=header.dtype).element_size()
        payload = header.expect_payload(header.numel * itemsize)
        if header.dtype == torch.bool:  # untrusted bytes may hold values other than 0/1
            return tensor_from(payload, 0, torch.uint8, header.numel) != 0
        return tensor_from(payload, 0, header.dtype, header.numel)


class _HalfCodec(Codec):
    """Shared body of fp16/bf16: cast to a 2-byte float on encode, back to the sender's dtype on decode."""

    lossy = True
    wire_dtype: ClassVar[torch.dtype]

    @property
    def nominal_ratio(self) -> float:
        return 2.0

    def _encode(self, x: torch.Tensor, stream: Hashable | None) -> tuple[dict[str, int], Sequence[BytesLike]]:
        if x.dtype != self.wire_dtype:
            if self.wire_dtype == torch.float16:
                x = x.clamp(-_FP16_MAX, _FP16_MAX)  # saturate (NaN stays NaN)
            x = x.to(self.wire_dtype)
        return {}, [tensor_bytes(x)]

    @classmethod
    def _decode(cls, header: Header, *, max_decoded_bytes: int) -> torch.Tensor:
        payload = header.expect_payload(header.numel * 2)
        return tensor_from(payload, 0, cls.wire_dtype, header.numel)


class Float16Codec(_HalfCodec):
    """IEEE half precision (10-bit mantissa, saturating at +-65504)."""

    name = "fp16"
    summary = "IEEE fp16 (saturates at +-65504); relative error ~3e-4"
    wire_dtype = torch.float16


class BFloat16Codec(_HalfCodec):
    """bfloat16 (fp32's exponent range, 7-bit mantissa)."""

    name = "bf16"
    summary = "bfloat16 (fp32 range, 8-bit mantissa); relative error ~2e-3"
    wire_dtype = torch.bfloat16
