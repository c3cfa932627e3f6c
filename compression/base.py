"""The ``Codec`` interface every tensor codec implements, and the helpers codecs share.

A codec turns a tensor into ``header + payload`` bytes (see ``header.py``) and back. Subclasses
implement two hooks on non-empty CPU tensors: ``_encode`` (returns header params and payload
parts) and the classmethod ``_decode`` (rebuilds the tensor from a validated header). This class
does everything around them once: moving the input to the CPU, dtype checks, empty tensors,
header packing, codec-id and payload checks, and the final dtype of the decoded tensor.

``_decode`` is a classmethod on purpose: a receiver decodes from the header alone
(``decode_any``), without knowing the sender's codec settings.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

from compression.errors import CodecError
from compression.header import (
    CODEC_IDS,
    DEFAULT_MAX_DECODED_BYTES,
    Header,
    pack_header,
    parse_header,
)

__all__ = [
    "Codec",
    "Param",
    "FLOAT_DTYPES",
    "to_cpu",
    "tensor_bytes",
    "tensor_from",
    "decode_header",
]

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
BytesLike = bytes | bytearray | memoryview


@dataclasses.dataclass(frozen=True)
class Param:
    """One ``key=value`` parameter a codec spec may set (see ``registry.get_codec``).

    ``kind`` is ``"int"`` (range ``[lo, hi]``), ``"bool"`` (``0``/``1``) or ``"choice"`` (one of ``choices``).
    """

    kind: str
    default: int | str | None
    help: str
    lo: int = 0
    hi: int = 1 << 30
    choices: tuple[str, ...] = ()


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, contiguous CPU tensor with the same values; one device-to-host copy at most.

    CUDA inputs are copied into pinned memory (PyTorch caches pinned blocks, so this is cheap after the
    first call) so the copy runs at full PCIe speed. Non-contiguous inputs are copied once.
    """
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"codecs encode torch.Tensor values, got {type(tensor).__name__}")
    t = tensor.detach()
    if t.device.type != "cpu":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        out.copy_(t)
        return out
    return t.contiguous()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (native little-endian), for ``b"".join``."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_from(view: memoryview, offset: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    """A new tensor of ``count`` elements read at ``offset`` (copied: the input bytes are read-only)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = bytearray(view[offset : offset + count * itemsize])
    assert len(raw) == count * itemsize, "callers check payload sizes first"
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype, count=count)


class Codec(ABC):
    """Turns tensors into self-describing bytes and back.

    Subclasses set ``name`` (registry and wire name), ``lossy``, ``summary`` and ``PARAMS``, and
    implement ``nominal_ratio``, ``_encode`` and ``_decode``. Stateful codecs keep state per
    ``stream`` key with bounded memory; ``stream=None`` means "no state for this call".
    """

    name: ClassVar[str]
    lossy: ClassVar[bool]
    summary: ClassVar[str]
    PARAMS: ClassVar[dict[str, Param]] = {}
    accepted_dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES

    def __init__(self, *, max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES):
        if max_decoded_bytes < 0:
            raise CodecError(f"max_decoded_bytes must be >= 0, got {max_decoded_bytes}")
        self.max_decoded_bytes = max_decoded_bytes

    @property
    def codec_id(self) -> int:
        return CODEC_IDS[self.name]

    @property
    @abstractmethod
    def nominal_ratio(self) -> float:
        """Size of the tensor in float32 divided by its encoded size, for large activation-shaped tensors."""

    def spec_params(self) -> dict[str, str]:
        """The ``key=value`` params that rebuild this codec with ``get_codec`` (see ``spec``)."""
        return {}

    @property
    def spec(self) -> str:
        """Canonical spec string: ``get_codec(codec.spec)`` builds an equivalent codec."""
        params = self.spec_params()
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"

    def forget(self, stream: Hashable) -> None:
        """Drop whatever state is kept for ``stream`` (its peer left); a no-op for stateless codecs."""
        return None  # stateless by default; stateful codecs override

    def encode(self, tensor: torch.Tensor, *, stream: Hashable | None = None) -> bytes:
        """Encode ``tensor`` (any device, any layout) into header + payload bytes."""
        x = to_cpu(tensor)
        return self._encode_cpu(x, x.dtype, stream)

    def _encode_cpu(self, x: torch.Tensor, dtype: torch.dtype, stream: Hashable | None) -> bytes:
        """Encode contiguous CPU ``x``, declaring ``dtype`` as the decoded dtype (error feedback encodes
        a float32 sum on behalf of a bf16 tensor, and the receiver must still get bf16)."""
        if x.dtype not in self.accepted_dtypes or dtype not in self.accepted_dtypes:
            raise CodecError(
                f"codec {self.name} cannot encode {dtype} tensors (it accepts "
                f"{sorted(str(d) for d in self.accepted_dtypes)}); use codec 'none' for this tensor"
            )
        if x.numel() == 0:
            return pack_header(self.name, dtype, tuple(x.shape), {})
        params, parts = self._encode(x, stream)
        return b"".join([pack_header(self.name, dtype, tuple(x.shape), params), *parts])

    def decode(self, data: BytesLike) -> torch.Tensor:
        """Decode bytes made by this codec into a CPU tensor; raises ``CodecError`` on any bad input."""
        header = parse_header(data, max_decoded_bytes=self.max_decoded_bytes)
        if header.codec_id != self.codec_id:
            raise CodecError(
                f"bytes were encoded with codec {header.codec_name!r}, but this is codec {self.name!r}; "
                "use compression.decode_any to accept any codec"
            )
        return decode_header(type(self), header, max_decoded_bytes=self.max_decoded_bytes)

    @abstractmethod
    def _encode(self, x: torch.Tensor, stream: Hashable | None) -> tuple[dict[str, int], Sequence[BytesLike]]:
        """Encode a non-empty contiguous CPU tensor of an accepted dtype: (header params, payload parts)."""

    @classmethod
    @abstractmethod
    def _decode(cls, header: Header, *, max_decoded_bytes: int) -> torch.Tensor:
        """Rebuild a non-empty tensor from a validated header (any dtype; the caller casts)."""


def decode_header(cls: type[Codec], header: Header, *, max_decoded_bytes: int) -> torch.Tensor:
    """Decode with ``cls`` after the generic checks; returns a tensor of the header's dtype and shape."""
    if header.dtype not in cls.accepted_dtypes:
        raise CodecError(f"codec {cls.name} never encodes {header.dtype} tensors; the bytes are corrupt")
    if header.numel == 0:
        header.expect_payload(0)
        return torch.empty(header.shape, dtype=header.dtype)
    out = cls._decode(header, max_decoded_bytes=max_decoded_bytes)
    assert out.numel() == header.numel, "codec decoders produce the declared number of elements"
    return out.reshape(header.shape).to(header.dtype)
