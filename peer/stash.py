"""Weight versions and the per-micro-batch stash (PipeDream-style weight stashing).

Why two structures: a forward of micro-batch ``m`` runs with the weight version ``v`` that is current
when it starts, and its backward must use the *same* ``v`` even if the peer has stepped since, or the
gradient would be computed against weights that did not produce the activation.

- :class:`WeightVersions` keeps the last ``max_versions`` versions, each a dict of tensors that are
  never written in place (the optimizer produces new tensors per step, see ``swarm/run/optimizer.py``).
  A backward whose version was evicted is refused with :class:`VersionEvicted`.
- :class:`MicroBatchStash` keeps what a backward needs per micro-batch (the version, the stage input
  or a kept autograd graph, the route), and expires entries whose backward never comes after
  ``ttl_s`` seconds. Time comes from an injected clock so tests never sleep.

Neither class locks: the owner (``peer/compute.py``) holds its weights lock around every call.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.errors import Failure, RequestError

__all__ = ["VersionEvicted", "WeightVersions", "StashEntry", "MicroBatchStash"]

Params = dict[str, torch.Tensor]


class VersionEvicted(RequestError):
    """A backward asked for a weight version this peer no longer keeps."""

    failure = Failure.VERSION_EVICTED


class WeightVersions:
    """The last ``max_versions`` weight versions, keyed by increasing integer version.

    Memory: ``max_versions`` full copies of the stage's parameters at most (a version shares no
    storage with the next one because every update writes new tensors).
    """

    def __init__(self, max_versions: int):
        if max_versions < 1:
            raise ValueError(f"max_versions must be >= 1, got {max_versions}")
        self.max_versions = max_versions
        self._versions: OrderedDict[int, Params] = OrderedDict()
        self.evicted_refusals = 0  # backwards refused because their version was gone

    def push(self, version: int, params: Params) -> list[int]:
        """Add ``version`` (greater than every kept one) and return the versions evicted to make room."""
        if self._versions and version <= self.latest_version:
            raise ValueError(f"version {version} is not newer than the latest kept {self.latest_version}")
        self._versions[version] = params
        evicted = []
        while len(self._versions) > self.max_versions:
            old, _ = self._versions.popitem(last=False)
            evicted.append(old)
        return evicted

    def reset(self, version: int, params: Params) -> None:
        """Forget every version and start from ``(version, params)`` (state download, stage switch)."""
        self._versions.clear()
        self._versions[version] = params

    @property
    def latest_version(self) -> int:
        if not self._versions:
            raise LookupError("no weight version has been pushed yet")
        return next(reversed(self._versions))

    @property
    def latest(self) -> Params:
        return self._versions[self.latest_version]

    def has(self, version: int) -> bool:
        return version in self._versions

    def get(self, version: int) -> Params:
        """The tensors of ``version``; raises :class:`VersionEvicted` (and counts it) when it is gone."""
        try:
            return self._versions[version]
        except KeyError:
            self.evicted_refusals += 1
            kept = list(self._versions)
            raise VersionEvicted(
                f"version evicted: weight version {version} is no longer kept (kept: {kept}, "
                f"max_versions={self.max_versions}); the micro-batch must be retried. Raise "
                "optimizer.max_versions or send fewer micro-batches in flight if this is frequent"
            ) from None

    def kept(self) -> list[int]:
        return list(self._versions)

    def __len__(self) -> int:
        return len(self._versions)


@dataclass
class StashEntry:
    """What the backward of one micro-batch needs.

    ``inputs`` is the stage input as received (token ids ``(B, T)`` on stage 0, hidden ``(B, T, C)``
    elsewhere), kept on the compute device. ``graph`` holds ``(output, input_leaf, param_leaves)``
    when recompute is off; it references tensors of ``version`` only, which are never mutated.
    ``context`` is opaque to the stash (the peer keeps the forward header there: route, trainer).
    """

    mb_id: str
    version: int
    inputs: torch.Tensor
    created_at: float
    output_shape: tuple[int, ...] = ()
    graph: tuple[torch.Tensor, torch.Tensor | None, Params] | None = None
    context: Any = None
    meta: dict[str, float] = field(default_factory=dict)
    count: bool = True  # add the gradient to the optimizer (False: a retry this stage already counted)
    # speculative weights the forward ran on instead of ``version``'s (peer/compute.py, note "speculative
    # rounds"); None: the version's own weights
    params: Params | None = None

    @property
    def ahead(self) -> int:
        """Versions ahead of ``version`` the forward's weights stand for: 1 on speculative weights."""
        return 0 if self.params is None else 1


class MicroBatchStash:
    """``mb_id -> StashEntry`` with a time-to-live; insertion order is age order."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic, max_entries: int = 4096):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, StashEntry] = OrderedDict()
        self.expired = 0  # entries dropped because their backward never came in time
        self.dropped = 0  # entries dropped on purpose (failed route, version evicted)

    def put(self, entry: StashEntry) -> None:
        if entry.mb_id in self._entries:
            raise RequestError(
                f"micro-batch {entry.mb_id!r} is already stashed on this peer; every attempt needs a new mb_id"
            )
        if len(self._entries) >= self.max_entries:
            raise RequestError(
                f"stash is full ({self.max_entries} micro-batches awaiting backward); wait for backwards "
                "to complete or send fewer micro-batches in flight"
            )
        self._entries[entry.mb_id] = entry

    def new_entry(self, mb_id: str, version: int, inputs: torch.Tensor, **kw: Any) -> StashEntry:
        """Build an entry stamped with the stash's clock (not yet stored: see :meth:`put`)."""
        return StashEntry(mb_id=mb_id, version=version, inputs=inputs, created_at=self.clock(), **kw)

    def get(self, mb_id: str) -> StashEntry | None:
        return self._entries.get(mb_id)

    def pop(self, mb_id: str) -> StashEntry | None:
        return self._entries.pop(mb_id, None)

    def drop(self, mb_id: str) -> StashEntry | None:
        """Remove an entry on purpose (its micro-batch failed); counted separately from expiry."""
        entry = self._entries.pop(mb_id, None)
        if entry is not None:
            self.dropped += 1
        return entry

    def expire(self) -> list[StashEntry]:
        """Remove and return every entry older than ``ttl_s`` (oldest first)."""
        now = self.clock()
        out = []
        while self._entries:
            mb_id, entry = next(iter(self._entries.items()))
            if now - entry.created_at < self.ttl_s:
                break
            del self._entries[mb_id]
            out.append(entry)
        self.expired += len(out)
        return out

    def versions_in_use(self) -> set[int]:
        return {e.version for e in self._entries.values()}

    def __contains__(self, mb_id: object) -> bool:
        return mb_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[StashEntry]:
        return iter(list(self._entries.values()))
