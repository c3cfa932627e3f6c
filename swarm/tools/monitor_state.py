"""The monitor's model of a run: snapshots built from polled ``RunStatus`` plus what the DHT does not keep.

:class:`MonitorState` keeps a bounded history of progress samples per run (the loss and tokens/s
curves; ``history`` samples at most, oldest dropped) and when this monitor first saw each peer on its
stage ("seen for": PeerRecords carry no start time, so a peer that was online before the monitor
started shows the monitor's uptime). Every update builds one immutable JSON-ready *snapshot*; the
poller writes, request threads only read the latest one under a lock.

Bytes per token: the fp32 reference ``2 * (stages - 1) * d_model * 4`` (see swarm/train/metrics.py,
note "link bytes"), the nominal figure of the run's codecs (the reference divided by each codec's
``nominal_ratio``), and the measured value when trainers publish one (``bytes_per_token`` in their
progress entries; averaged over trainers that report it).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from swarm.tools.status import RunStatus

if TYPE_CHECKING:
    from swarm.run.spec import RunSpec

__all__ = ["MonitorState", "build_run_view"]


def _bytes_per_token(spec: RunSpec | None, progress: Mapping[str, Any]) -> dict[str, float | None]:
    """fp32 reference, nominal (codec ratios) and measured bytes per token on all stage links."""
    out: dict[str, float | None] = {"uncompressed": None, "nominal": None, "measured": None}
    if spec is not None:
        links = spec.num_stages - 1
        per_direction = links * spec.model.d_model * 4.0  # one fp32 vector per token per link
        out["uncompressed"] = 2.0 * per_direction
        try:
            from compression import get_codec

            ratios = [get_codec(c).nominal_ratio for c in (spec.codecs.activations, spec.codecs.gradients)]
            out["nominal"] = per_direction / ratios[0] + per_direction / ratios[1]
        except ValueError:  # CodecError: a codec this software does not know; show the reference only
            pass
    measured = [
        float(t["bytes_per_token"])
        for t in progress.get("trainers", {}).values()
        if isinstance(t.get("bytes_per_token"), int | float) and math.isfinite(t["bytes_per_token"])
    ]
    if measured:
        out["measured"] = math.fsum(measured) / len(measured)
    return out


def build_run_view(
    status: RunStatus,
    spec: RunSpec | None,
    *,
    history: Sequence[Mapping[str, Any]],
    first_seen: Mapping[tuple[int, str], float],
    now: float,
) -> dict[str, Any]:
    """One run's part of the snapshot: ``RunStatus.to_json()`` plus model, bytes, history, seen-for.

    Pure: ``first_seen`` maps (stage, peer id) to the wall time the monitor first saw the peer there.
    """
    view = status.to_json()
    for stage in view["stages"]:
        for peer in stage["peers"]:
            since = first_seen.get((stage["stage"], peer["peer_id"]))
            peer["seen_for_s"] = None if since is None else max(0.0, now - since)
        stage["active_peers"] = sum(1 for p in stage["peers"] if p["state"] in ("joining", "online"))
    covered = [s["throughput"] for s in view["stages"] if s["covered"]]
    view["bottleneck_tokens_per_s"] = min(covered) if len(covered) == len(view["stages"]) and covered else 0.0
    if spec is not None:
        view["model"] = {
            "n_params": spec.n_params(),
            "d_model": spec.model.d_model,
            "n_layers": spec.model.n_layers,
            "n_heads": spec.model.n_heads,
            "vocab_size": spec.model.vocab_size,
            "seq_len": spec.model.seq_len,
        }
        view["codecs"] = {"activations": spec.codecs.activations, "gradients": spec.codecs.gradients}
    else:
        view["model"], view["codecs"] = None, None
    view["bytes_per_token"] = _bytes_per_token(spec, view["progress"])
    view["history"] = [dict(s) for s in history]
    return view


class MonitorState:
    """What the monitor knows between polls: the latest snapshot, progress histories, first sightings.

    Written only by the poller (``update``/``error``), read by any request thread (``snapshot``).
    """

    def __init__(
        self, *, history: int = 2000, poll_interval_s: float = 2.0, clock: Callable[[], float] = time.time
    ):
        self._clock = clock
        self._lock = threading.Lock()
        self._history_len = history
        self._histories: dict[str, collections.deque[dict[str, Any]]] = {}
        self._first_seen: dict[str, dict[tuple[int, str], float]] = {}
        self.started_at = clock()
        self._poll = {
            "poll_interval_s": poll_interval_s,
            "polls": 0,
            "errors": 0,
            "last_poll_at": None,
            "last_error": None,
            "started_at": self.started_at,
        }
        self._snapshot: dict[str, Any] = self._make_snapshot([], {}, self.started_at)

    def _make_snapshot(
        self, runs: list[dict[str, Any]], run_errors: dict[str, str], now: float
    ) -> dict[str, Any]:
        return {
            "generated_at": now,
            "monitor": dict(self._poll),
            "runs": runs,
            "run_errors": dict(run_errors),
        }

    def update(
        self, results: Iterable[tuple[RunStatus, RunSpec | None]], run_errors: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Record one poll's statuses (and per-run errors); return the new snapshot."""
        now = self._clock()
        runs = []
        seen_runs = set()
        for status, spec in results:
            run_id = status.run_id
            seen_runs.add(run_id)
            history = self._histories.setdefault(run_id, collections.deque(maxlen=self._history_len))
            p = status.progress
            sample = {
                "t": now,
                "tokens": int(p.get("tokens", 0)),
                "steps": int(p.get("steps", 0)),
                "loss": p.get("loss"),
                "tokens_per_s": float(p.get("tokens_per_s", 0.0)),
                "trainers": len(p.get("trainers", {})),
                "losses": {tid: t.get("loss") for tid, t in p.get("trainers", {}).items()},
            }
            # A stalled or idle run adds no point: the curve shows progress, not the poll rate.
            last = history[-1] if history else None
            if last is None or any(last[k] != sample[k] for k in ("tokens", "steps", "loss", "losses")):
                history.append(sample)
            # First sightings: peers that disappeared are forgotten, so a returning peer starts anew.
            old = self._first_seen.get(run_id, {})
            current = {
                (s.stage, p.peer_id): old.get((s.stage, p.peer_id), now)
                for s in status.stages
                for p in s.peers
            }
            self._first_seen[run_id] = current
            runs.append(build_run_view(status, spec, history=list(history), first_seen=current, now=now))
        for gone in set(self._first_seen) - seen_runs:
            self._first_seen.pop(gone)  # a run that left the registry; its history stays (bounded)
        with self._lock:
            self._poll["polls"] += 1
            self._poll["last_poll_at"] = now
            self._snapshot = self._make_snapshot(runs, dict(run_errors or {}), now)
            return self._snapshot

    def error(self, message: str) -> None:
        """Record a failed poll (the DHT did not answer, ...); the last good data stays on the page."""
        with self._lock:
            self._poll["errors"] += 1
            self._poll["last_error"] = {"at": self._clock(), "message": message}
            self._snapshot = {**self._snapshot, "monitor": dict(self._poll)}

    def snapshot(self) -> dict[str, Any]:
        """The latest snapshot (treat as read-only: it is shared between request threads)."""
        with self._lock:
            return self._snapshot
