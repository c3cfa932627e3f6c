"""Per-stream state with bounded memory: the store behind error feedback and low-rank warm starts.

A *stream* is one logical sequence of tensors between two parties, keyed by a hashable such as
``(peer_id, stage, "act")``. State is kept per stream, never globally, so two neighbours' residuals
never mix. Memory is bounded by a count of streams and a total of bytes; the least recently used
streams are dropped first. Dropping state is always safe: the next call of that stream starts cold
(error feedback loses one residual, a low-rank warm start re-initialises).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import torch

from compression.errors import CodecError

__all__ = ["StreamStates"]


class StreamStates:
    """An LRU map ``stream -> tensor`` capped by ``max_streams`` entries and ``max_bytes`` in total.

    Thread-safe: encoders may be called from several worker threads at once.
    Increase ``max_streams`` if a peer talks to more neighbours than that and you see error feedback
    or warm starts having no effect (``evictions`` keeps growing).
    """

    def __init__(self, *, max_streams: int = 1024, max_bytes: int = 256 << 20):
        if max_streams < 1 or max_bytes < 0:
            raise CodecError(
                f"stream state caps must be max_streams >= 1 and max_bytes >= 0, got {max_streams}, {max_bytes}"
            )
        self.max_streams = max_streams
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, stream: Hashable) -> torch.Tensor | None:
        """The state of ``stream`` (marked most recently used), or None."""
        with self._lock:
            value = self._items.get(stream)
            if value is not None:
                self._items.move_to_end(stream)
            return value

    def put(self, stream: Hashable, value: torch.Tensor) -> bool:
        """Store ``value`` for ``stream``, evicting old streams; False if it alone exceeds ``max_bytes``."""
        size = value.numel() * value.element_size()
        with self._lock:
            old = self._items.pop(stream, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            if size > self.max_bytes:
                return False
            while self._items and (
                len(self._items) >= self.max_streams or self._bytes + size > self.max_bytes
            ):
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()
                self.evictions += 1
            self._items[stream] = value
            self._bytes += size
            return True

    def discard(self, stream: Hashable) -> None:
        """Forget ``stream`` (e.g. when its peer left)."""
        with self._lock:
            old = self._items.pop(stream, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes held by all streams' state."""
        return self._bytes
