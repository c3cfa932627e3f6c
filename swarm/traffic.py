"""What this process serialised for the network, by kind of message (the control plane's accounting).

Each process counts what it *sends*: data-plane requests by protocol name (header bytes and payload
bytes apart), the replies it serves, and the values it stores in the DHT and the reads it asks for, by
record kind. The counts are of serialised bytes (msgpack headers, codec payloads, msgpack DHT values);
what hivemind and libp2p add on top (RPC framing, signatures, replication to several DHT nodes,
encryption, TCP/IP) is the difference to the bytes on the wire that ``benchmarks/control_plane.py``
measures per network namespace.

``TRAFFIC`` is the process's one counter (a peer and a trainer are separate processes; tests that run
several in one process read a difference of two snapshots). Counting takes a lock: the DHT owner's
thread and the event loop both add to it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping

__all__ = ["Traffic", "TRAFFIC", "message_kind", "record_kind", "per_token"]

_FIELDS = ("count", "header", "payload")


def message_kind(protocol_name: str) -> str:
    """``swarmpipe.stage.forward`` -> ``forward`` (the last dotted part of a protocol name)."""
    return protocol_name.rsplit(".", 1)[-1]


def record_kind(key: str) -> str:
    """The kind of a DHT key: ``..._stage_3`` -> ``stage``, ``..._progress`` -> ``progress``."""
    return re.sub(r"_\d+$", "", key).rsplit("_", 1)[-1]


class Traffic:
    """Counters of messages sent: ``kind -> {count, header, payload}`` (bytes as serialised)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}

    def add(self, kind: str, header: int = 0, payload: int = 0) -> None:
        if header < 0 or payload < 0:
            raise ValueError(f"traffic of {kind!r}: byte counts must be >= 0, got {header}, {payload}")
        with self._lock:
            c = self._counts.setdefault(kind, [0, 0, 0])
            c[0] += 1
            c[1] += header
            c[2] += payload

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {k: dict(zip(_FIELDS, v, strict=True)) for k, v in sorted(self._counts.items())}

    def as_stats(self) -> dict[str, float]:
        """Flat numbers for a stats dict: ``traffic.<kind>.<field>``."""
        return {f"traffic.{k}.{f}": float(n) for k, d in self.snapshot().items() for f, n in d.items()}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


def from_stats(stats: Mapping[str, float]) -> dict[str, dict[str, int]]:
    """The inverse of :meth:`Traffic.as_stats` (other keys of ``stats`` are ignored)."""
    out: dict[str, dict[str, int]] = {}
    for key, value in stats.items():
        kind, _, f = key.removeprefix("traffic.").rpartition(".")
        if key.startswith("traffic.") and kind and f in _FIELDS:
            out.setdefault(kind, dict.fromkeys(_FIELDS, 0))[f] = int(value)
    return out


def per_token(snapshots: list[Mapping[str, Mapping[str, int]]], tokens: int) -> dict[str, dict[str, float]]:
    """Sum several processes' snapshots and divide by ``tokens``: bytes (and messages) per token."""
    if tokens <= 0:
        raise ValueError(f"tokens = {tokens} must be positive to count bytes per token")
    total: dict[str, dict[str, float]] = {}
    for snap in snapshots:
        for kind, d in snap.items():
            t = total.setdefault(kind, dict.fromkeys(_FIELDS, 0.0))
            for f in _FIELDS:
                t[f] += d.get(f, 0)
    return {k: {f: v / tokens for f, v in d.items()} for k, d in sorted(total.items())}


TRAFFIC = Traffic()
