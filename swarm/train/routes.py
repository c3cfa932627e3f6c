"""What the trainer may route through now: the stage peers' records without the peers found dead, the
per-peer in-flight caps (note "staleness cap" in swarm/client/routing.py), and the wait, with its
messages, while a stage has no usable peer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarm.client.routing import NoPeersError, staleness_caps
from swarm.errors import StageUnavailableError

if TYPE_CHECKING:
    from swarm.dht.records import PeerRecord
    from swarm.run.spec import RunSpec
    from swarm.train.config import TrainerConfig

__all__ = ["Routes", "service_seconds"]


def service_seconds(stats: dict[str, float], stage: int) -> float | None:
    """Compute seconds stage ``stage`` spent on one micro-batch, from the peers' report stats.

    Peers record per-hop figures named ``fwd_compute_s_<stage>`` and ``bwd_compute_s_<stage>``
    (swarm/wire/protocol.py); missing ones count as 0, and None means the stage reported nothing.
    Routing weighs replicas by it (``Router.on_success``).
    """
    parts = [stats.get(f"fwd_compute_s_{stage}"), stats.get(f"bwd_compute_s_{stage}")]
    known = [p for p in parts if p is not None and math.isfinite(p) and p >= 0]
    return sum(known) if known else None


class Routes:
    def __init__(
        self,
        config: TrainerConfig,
        spec: RunSpec,
        *,
        lockstep: bool,
        say: Callable[[str], None],
        event: Callable[..., None],
    ) -> None:
        self.config = config
        self.spec = spec
        self.lockstep = lockstep  # sync mode: the caps need to hold one window only
        self.say = say
        self.event = event
        self.stages: list[dict[str, PeerRecord]] = [{} for _ in range(spec.num_stages)]
        self.dead: dict[str, float] = {}  # peer found dead -> when (note "dead hold": ``found_dead``)
        self._dead_records: dict[str, PeerRecord | None] = {}  # its record when it was found dead
        self.max_per_peer: list[int | None] = [None] * spec.num_stages  # recomputed at every refresh
        self.cap_noted = False
        self.waiting_since: float | None = None
        self.last_wait_msg = -math.inf

    def update(self, stages: list[dict[str, PeerRecord]]) -> None:
        """New stage records: recompute the staleness caps; say once when they hold fewer micro-batches
        than ``max_inflight``."""
        self.stages = stages
        opt, most = self.spec.optimizer, self.config.max_inflight
        self.max_per_peer = staleness_caps(
            stages, accumulate=opt.accumulate, max_versions=opt.max_versions, sync=self.lockstep
        )
        limits = [
            cap * sum(1 for r in recs.values() if r.state == "online")
            for cap, recs in zip(self.max_per_peer, stages, strict=True)
            if cap is not None and recs
        ]
        allowed = min(limits, default=None)
        if allowed is not None and allowed < most and not self.cap_noted:
            self.cap_noted = True
            self.say(
                f"note: at most {allowed} micro-batches in flight (max_inflight is {most}): "
                f"more would outlive the {opt.max_versions} weight versions a peer keeps; raise "
                "optimizer.max_versions (or optimizer.accumulate) to keep more in flight"
            )
            self.event("inflight_capped", allowed=allowed, max_inflight=most)

    def departed(self, route: tuple[str, ...]) -> list[str]:
        """The peers of ``route`` whose record left their stage or says ``leaving``."""
        out = []
        for stage, pid in enumerate(route):
            rec = self.stages[stage].get(pid) if stage < len(self.stages) else None
            if rec is None or rec.state == "leaving":
                out.append(pid)
        return out

    def found_dead(self, peer: str, now: float) -> None:
        """Keep ``peer`` out of routes (note "dead hold"): for ``liveness.dead_hold_s`` (the lifetime of
        the record a dead peer leaves behind), or until its record changes: a dead peer cannot store one,
        a peer that restarted with the same identity (or was only unreachable) stores a new one."""
        self.dead[peer] = now
        self._dead_records[peer] = self._record_of(peer)

    def routable(self, now: float) -> list[dict[str, PeerRecord]]:
        """The stage records without the peers held as dead (``found_dead``)."""
        hold = self.config.liveness.dead_hold_s
        for pid in [p for p, t in self.dead.items() if now - t >= hold or self._came_back(p)]:
            del self.dead[pid]
            self._dead_records.pop(pid, None)
        if not self.dead:
            return self.stages
        return [{p: r for p, r in recs.items() if p not in self.dead} for recs in self.stages]

    def _came_back(self, peer: str) -> bool:
        """Whether ``peer``'s record differs from the one it had when it was found dead."""
        then, now = self._dead_records.get(peer), self._record_of(peer)
        return then is not None and now is not None and now != then

    def _record_of(self, peer: str) -> PeerRecord | None:
        """``peer``'s record in the latest stage lists, None when no stage lists it."""
        return next((st[peer] for st in self.stages if peer in st), None)

    def unavailable(self, e: NoPeersError, now: float) -> None:
        """No route: say how to start a peer (every 30 s); give up after ``stage_wait_s``."""
        cfg, run = self.config, self.spec.run_id
        if self.waiting_since is None:
            self.waiting_since = now
            self.event("stage_unavailable", stage=e.stage, reason=e.reason)
        if now - self.last_wait_msg >= 30.0:
            self.last_wait_msg = now
            if e.reason == "empty":
                self.say(
                    f"waiting: stage {e.stage} of run {run!r} has no online peer. Start one with:\n"
                    f"  swarm peer --initial-peers {cfg.initial_peers[0]} --run {run} --stage {e.stage}"
                )
            else:
                self.say(f"waiting: {e}; training continues when one of them is back")
        if cfg.stage_wait_s is not None and now - self.waiting_since > cfg.stage_wait_s:
            raise StageUnavailableError(
                f"stage {e.stage} of run {run!r} had no usable peer for "
                f"{now - self.waiting_since:.0f} s (stage_wait_s = {cfg.stage_wait_s}); start a peer "
                f"with `swarm peer --initial-peers {cfg.initial_peers[0]} --run {run} "
                f"--stage {e.stage}` and run the trainer again"
            )

    def available(self, now: float) -> None:
        if self.waiting_since is not None:
            self.event("stage_available", waited_s=round(now - self.waiting_since, 2))
            self.say(
                f"every stage has peers again after {now - self.waiting_since:.1f} s; training continues"
            )
            self.waiting_since = None
            self.last_wait_msg = -math.inf
