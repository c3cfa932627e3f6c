"""The trainer's traffic with the DHT beside the loop: re-reading the stage peers' records (posted to the
loop as a :class:`~swarm.train.events.Refreshed`), and publishing this trainer's progress while
saying each stage event of the run once.

DHT calls are blocking and go through ``asyncio.to_thread``; ``Membership`` serialises them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from swarm.errors import PeerFailure
from swarm.train.events import Refreshed

if TYPE_CHECKING:
    from swarm.client.link import SwarmLink
    from swarm.train.events import Inbox
    from swarm.train.steps import StepBook

__all__ = ["refresh_loop", "next_refresh_s", "records_view", "Publisher"]


REFRESH_BACKOFF = 2.0
"""Factor by which the period between two reads of the stage records grows while nothing changes."""
REFRESH_MAX_FACTOR = 5.0
"""The longest period between two reads, in multiples of ``every_s``."""


def records_view(records: Sequence[Mapping[str, Any]]) -> tuple:
    """What a change of the stage lists means for routing: per stage, the peers and their states."""
    return tuple(tuple(sorted((pid, r.state) for pid, r in st.items())) for st in records)


def next_refresh_s(current_s: float, every_s: float, *, changed: bool, complete: bool) -> float:
    """The period until the next read of the stage records (note "refresh backoff").

    ``every_s`` right after a change or while a stage has no online peer (a trainer waits for joiners
    there); otherwise the period doubles, up to ``REFRESH_MAX_FACTOR x every_s``: a joiner of a complete
    run is found within that, a dead peer never waited for (probes find it: swarm/client/liveness.py).
    """
    if changed or not complete:
        return every_s
    return min(current_s * REFRESH_BACKOFF, every_s * REFRESH_MAX_FACTOR)


async def refresh_loop(link: SwarmLink, inbox: Inbox, *, every_s: float, event: Callable[..., None]) -> None:
    """The stage records, for the loop to route with: every ``every_s`` (jittered), less often while
    they do not change (:func:`next_refresh_s`)."""
    period, seen = every_s, None
    while True:
        await asyncio.sleep(period * random.uniform(0.8, 1.2))
        try:
            records = await link.stage_records()
        except PeerFailure as e:
            event("dht_error", detail=str(e)[:200])
            inbox.wake.set()
            period = every_s
            continue
        inbox.put(Refreshed(records))
        view = records_view(records)
        complete = all(any(r.state == "online" for r in st.values()) for st in records)
        period = next_refresh_s(period, every_s, changed=view != seen, complete=complete)
        seen = view


class Publisher:
    """This trainer's progress in the DHT (`swarm status` reads it), and the run's stage events: a stage
    that lost every replica and was rolled back to a keeper's snapshot or a checkpoint, or restarted from
    initial weights (swarm/tools/keeper.py)."""

    def __init__(
        self,
        link: SwarmLink,
        *,
        trainer_id: str,
        book: StepBook,
        clock: Callable[[], float],
        say: Callable[[str], None],
        event: Callable[..., None],
    ) -> None:
        self.link = link
        self.trainer_id = trainer_id
        self.book = book
        self.clock = clock
        self.say = say
        self.event = event
        self.stage_events_seen: set[tuple[str, str]] = set()  # (peer, event id) already printed

    async def loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s * random.uniform(0.8, 1.2))
            try:
                await self.publish()
                await self._poll_stage_events()
            except PeerFailure as e:
                self.event("dht_error", detail=str(e)[:200])

    async def publish(self) -> None:
        book = self.book
        await asyncio.to_thread(
            self.link.membership.publish_progress,
            self.trainer_id,
            book.tokens_done,
            book.step,
            book.last_loss,
            tokens_per_s=book.tokens_per_s(self.clock()),
        )

    async def _poll_stage_events(self) -> None:
        """Say each stage event of the run once."""
        events = await asyncio.to_thread(self.link.membership.events)
        for ev in events:
            key = (ev.peer_id, ev.event_id)
            if key in self.stage_events_seen:
                continue
            self.stage_events_seen.add(key)
            age = time.time() - ev.at
            when = f" ({age / 60:.0f} min ago)" if age > 120 else ""
            self.say(f"warning: {ev.describe()}{when}")
            self.event(
                "stage_event",
                kind=ev.kind,
                stage=ev.stage,
                source=ev.source,
                version=ev.version,
                lost_from=ev.lost_from,
                peer=ev.peer_id,
            )
