"""``Timeline``: when each micro-batch's passes arrived, waited, ran and left this stage peer.

Note "timeline"
---------------
Every stage peer keeps, in memory, one event per step of each pass it serves, stamped with the
wall clock (``time.time()``, so the timelines of the peers of one machine line up):

- ``arrived``: the handler got the FORWARD or BACKWARD (before decoding its payload);
- ``queued``: it was validated, decoded and handed to the compute queue;
- ``started`` / ``ended``: the worker thread ran it (forward: the stage's forward and the encoding of
  its output; the last stage's forward task also runs the loss and the backward; backward: the
  backward and the encoding of the input gradient), with the worker thread's CPU seconds at both
  (a task's CPU over its wall time: how much of a core it had while it ran);
- ``sending`` / ``sent``: the event loop began the send to the next hop, and the next hop
  acknowledged it (stage 0's backward: its ``done`` report was delivered to the trainer).

An event is a tuple appended to a bounded deque (thread-safe in CPython; 1-8 us a mark measured
here, against tasks of tens of milliseconds; the newest 50,000 events are kept, 6.5 MiB, some
minutes of a busy peer), so the timeline is always on. ``swarm peer --timeline FILE`` writes it as
JSON lines at shutdown, and ``benchmarks/timeline.py`` turns the files of one run into busy
fractions, idle gaps by cause and a Gantt chart.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["EVENTS", "Timeline"]

EVENTS = ("arrived", "queued", "started", "ended", "sending", "sent")
"""The events of one pass, in the order they happen."""


class Timeline:
    """The bounded in-memory event log of one peer (note "timeline")."""

    def __init__(self, max_events: int = 50_000):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._events: deque[tuple[float, str, str, str, float | None]] = deque(maxlen=max_events)
        self.stage = -1  # the stage served; set by the peer when it joins one

    def mark(
        self, mb_id: str, kind: str, event: str, at: float | None = None, cpu: float | None = None
    ) -> None:
        """``event`` of micro-batch ``mb_id``'s ``kind`` pass (``forward`` or ``backward``), now or
        ``at`` (a ``time.time()`` taken earlier); ``cpu``: the calling thread's CPU seconds then
        (``time.thread_time()``, given at ``started``/``ended``). Any thread."""
        self._events.append((time.time() if at is None else at, mb_id, kind, event, cpu))

    def __len__(self) -> int:
        return len(self._events)

    def records(self) -> list[dict[str, Any]]:
        """The events so far as dicts (``t``, ``mb``, ``pass``, ``event``, ``stage``, and ``cpu`` where
        known), oldest first."""
        stage = self.stage
        out = []
        for t, mb, k, e, cpu in list(self._events):
            r: dict[str, Any] = {"t": t, "mb": mb, "pass": k, "event": e, "stage": stage}
            if cpu is not None:
                r["cpu"] = cpu
            out.append(r)
        return out

    def write(self, path: str | os.PathLike[str], *, peer: str = "") -> int:
        """Write the events as JSON lines (a first line names the peer and stage); the count written."""
        records = self.records()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"peer": peer, "stage": self.stage, "events": len(records)}) + "\n")
            for r in records:
                f.write(json.dumps(r) + "\n")
        tmp.replace(p)
        return len(records)
