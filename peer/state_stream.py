"""A stage's state on the wire of a hivemind state download, with as few copies as we can make.

A state download (peer/averaging.py) sends one flat float32 tensor: the stage's base parameters and
optimizer slots end to end. hivemind streams a tensor as ``runtime_pb2.Tensor`` parts (the first one
carries its dtype, shape and compression, the others only bytes) and rebuilds it on the other side.
Its stock path copies the 77 MB of a benchmark stage seven times on the donor and six on the receiver
(a serialisation, a slice per part, protobuf's own copies on every field access, a join, a ``bytearray``,
and the move into shared memory on the way back to the host process). Note "state stream":

- ``state_parts`` (donor): the parts straight from the tensor's memory, 1 MiB each, where hivemind
  uses 64 KiB (1,232 messages per benchmark stage, each a trip through asyncio and the daemon's
  socket); the bytes are copied once per part before protobuf takes them.
- ``StateAssembler`` (receiver): each part's bytes copied once into one tensor allocated in shared
  memory up front (``shared_empty``), so the hand-over to the host process passes a handle.

The messages are the ones hivemind's own code sends and reads (dtype on the first part, ``chunks`` its
number of parts), so a donor or receiver on hivemind's stock path interoperates with ours. A part
that does not fit the shape its first part announced, a stream that ends short, or a header that
announces more elements than the receiver's state holds (checked before anything is allocated: a donor
cannot make a receiver allocate what it never sends) is refused with a ``ValueError`` naming the sizes; tensors that are not plain float32 go through hivemind's own
functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

PART_BYTES = 1 << 20
PART_SLACK = 4096  # bytes over 8 an element that a tensor hivemind rebuilds may bring (headers)


def shared_empty(numel: int) -> torch.Tensor:
    """An uninitialised 1-D float32 CPU tensor in shared memory (peer/averaging.py note "state in
    shared memory")."""
    storage = torch.UntypedStorage._new_shared(numel * 4)
    return torch.empty(0, dtype=torch.float32).set_(storage, 0, (numel,), (1,))


def flatten_into(tensors: list[torch.Tensor], empty: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``tensors`` end to end as float32, copied once into ``empty(total numel)`` (pure)."""
    flat = empty(sum(t.numel() for t in tensors))
    offset = 0
    for t in tensors:
        flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return flat


def _plain(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()


def state_parts(tensor: torch.Tensor, part_bytes: int = PART_BYTES) -> Iterator[Any]:
    """``tensor`` as hivemind's streamed ``runtime_pb2.Tensor`` parts, uncompressed (note "state
    stream"); a tensor that is not a contiguous float32 CPU tensor takes hivemind's own path."""
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto import runtime_pb2
    from hivemind.utils.streaming import split_for_streaming

    if not _plain(tensor):
        yield from split_for_streaming(serialize_torch_tensor(tensor.detach().cpu()), part_bytes)
        return
    raw = memoryview(tensor.detach().numpy()).cast("B")
    n = len(raw)
    starts = range(0, n, part_bytes) if n else range(1)
    for i, start in enumerate(starts):
        data = raw[start : start + part_bytes].tobytes()
        if i == 0:
            yield runtime_pb2.Tensor(
                compression=runtime_pb2.CompressionType.NONE,
                buffer=data,
                chunks=len(starts),
                size=list(tensor.shape),
                dtype="float32",
                requires_grad=False,
            )
        else:
            yield runtime_pb2.Tensor(buffer=data)


class StateAssembler:
    """Rebuilds the tensors of a state download from its parts (note "state stream"): ``add`` each
    part in order, then ``finish``. Float32 tensors are written into ``empty(numel)`` as their parts
    arrive; any other kind is collected and rebuilt by hivemind."""

    def __init__(self, empty: Callable[[int], torch.Tensor] = shared_empty, max_numel: int | None = None):
        self._empty = empty
        self._room = max_numel  # elements all tensors together may have, before any is allocated
        self.tensors: list[torch.Tensor] = []
        self._flat: np.ndarray | None = None  # the current tensor's bytes, when written in place
        self._tensor: torch.Tensor | None = None
        self._offset = 0
        self._parts: list[Any] = []  # the current tensor's parts, when hivemind rebuilds it
        self._parts_shape = torch.Size()  # that tensor's shape, as its first part announced
        self._parts_limit = 0  # the most bytes its parts may bring
        self._parts_bytes = 0  # what they brought so far

    def add(self, part: Any) -> None:
        from hivemind.proto import runtime_pb2

        if part.dtype:  # the first part of a new tensor
            self._close()
            shape = torch.Size(part.size)
            if self._room is not None:
                if shape.numel() > self._room:
                    raise ValueError(
                        f"a state download announced a tensor of shape {tuple(shape)} ({shape.numel()} "
                        f"elements) where at most {self._room} more were expected; not allocating it"
                    )
                self._room -= shape.numel()
            if part.dtype == "float32" and part.compression == runtime_pb2.CompressionType.NONE:
                self._tensor = self._empty(shape.numel()).view(shape)
                self._flat = self._tensor.view(-1).numpy().view(np.uint8)
                self._offset = 0
            else:
                self._parts = []
                # uncompressed, no dtype we share takes over 8 bytes an element; compressed ones take less
                self._parts_shape, self._parts_limit = shape, shape.numel() * 8 + PART_SLACK
                self._parts_bytes = 0
        elif self._flat is None and not self._parts:
            raise ValueError("a state download sent a part before the first part of its tensor")
        if self._flat is None:
            self._parts_bytes += len(part.buffer)
            if self._parts_bytes > self._parts_limit:
                raise ValueError(
                    f"a state download sent over {self._parts_limit} bytes for "
                    f"a {self._parts_shape.numel()}-element tensor of shape {tuple(self._parts_shape)} "
                    "(at most 8 bytes an element); the donor's state does not match its header"
                )
            self._parts.append(part)
            return
        data = part.buffer  # one copy out of protobuf
        end = self._offset + len(data)
        if end > len(self._flat):
            raise ValueError(
                f"a state download sent {end} bytes for a tensor of {len(self._flat)} bytes "
                f"(shape {tuple(self._tensor.shape)}); the donor's state does not match its header"
            )
        self._flat[self._offset : end] = np.frombuffer(data, dtype=np.uint8)
        self._offset = end

    def _close(self) -> None:
        if self._flat is not None:
            if self._offset != len(self._flat):
                raise ValueError(
                    f"a state download ended after {self._offset} of {len(self._flat)} bytes of a "
                    f"tensor of shape {tuple(self._tensor.shape)}"
                )
            self.tensors.append(self._tensor)
        elif self._parts:
            from hivemind.compression import deserialize_torch_tensor
            from hivemind.utils.streaming import combine_from_streaming

            self.tensors.append(deserialize_torch_tensor(combine_from_streaming(self._parts)))
        self._flat, self._tensor, self._parts, self._offset = None, None, [], 0

    def finish(self) -> list[torch.Tensor]:
        """The tensors, once the stream has ended; ``ValueError`` if the last one came short."""
        self._close()
        return self.tensors
