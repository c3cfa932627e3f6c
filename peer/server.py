"""``StagePeer``: one stage peer, put together from its parts, and its lifecycle.

Lifecycle (``start`` .. ``shutdown``)::

    DHT up -> fetch + verify the run spec -> pick a stage (placement, or --stage) -> measure
    throughput -> announce "joining" -> load the stage's state (a same-stage donor via hivemind's
    load_state_from_peers, a keeper's snapshot included; else --checkpoint-dir; else the spec's seed, or
    for a --from-pretrained run the --weights checkpoint, digest-checked) -> serve FORWARD / BACKWARD
    / INFO / CANCEL -> announce "online" -> background: announce + rebalance (every ~5 s, jittered),
    stash expiry, averaging, checkpoints -> on stop: "leaving", drain, checkpoint, shut down.

The parts, one job each: ``StageJoining`` (peer/joining.py: which stage, where its state comes
from), ``Background`` (peer/loops.py: the loops and what a crash of each means), ``RequestHandlers``
(peer/handlers.py: where a FORWARD is validated), ``WorkerTasks`` (peer/work.py: what the compute
thread runs); and the objects ``Admission`` (peer/admission.py: access gate, queue caps),
``Outbox`` (peer/sends.py: sends to the next hop and reports), ``TrainerWatch`` (peer/trainers.py:
trainers that vanish) and ``TaskOwner`` (peer/tasks.py: every background task; a crashed loop is
restarted or stops the peer, and says so). The parts share the peer's state (``__init__`` lists it).

Concurrency (one model per process: a process that serves a stage holds no other model): the asyncio loop owns every network call (P2P
handlers, sends to the next hop, reports, DHT calls through ``asyncio.to_thread`` into the one
``Membership``). Compute runs only in the worker thread of ``peer/runtime.py``; a finished task
hands its network sends back to the loop (``Outbox.send``). Averaging rounds run in their own
thread and apply their result under the compute lock between micro-batches. Every background task
belongs to ``self._tasks`` and is cancelled in ``shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import OrderedDict
from typing import Any

import torch

from peer.admission import Admission
from peer.announcements import DONOR_PRIORITY_EVERY_STORES, AnnounceRule, EveryNth, MoveReads
from peer.averaging import StageAverager
from peer.compute import StageCompute
from peer.config import PeerConfig, resolve_device
from peer.handlers import RequestHandlers
from peer.joining import StageJoining
from peer.loops import Background
from peer.recount import Recount
from peer.replicas import ReplicaRounds
from peer.runtime import ComputeQueue
from peer.sends import Outbox
from peer.tasks import TaskOwner
from peer.throughput import ServedRate
from peer.timeline import Timeline
from peer.trainers import TrainerWatch
from peer.work import WorkerTasks
from swarm.dht.auth import RunAuth
from swarm.errors import ConfigError, SwarmError
from swarm.traffic import TRAFFIC
from swarm.wire.channel import close_channels
from swarm.wire.protocol import BACKWARD, CANCEL, FORWARD, INFO, serve, unserve

__all__ = ["StagePeer"]

logger = logging.getLogger(__name__)

_HANDLED = (FORWARD, BACKWARD, INFO, CANCEL)


class StagePeer(StageJoining, Background, RequestHandlers, WorkerTasks):
    """A stage peer. ``await start()`` joins and serves; ``await shutdown()`` leaves cleanly. A peer
    whose background loop crashed for good stops by itself: ``state`` becomes ``"stopped"`` and
    ``crashed`` names the loop."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.spec: Any = None  # swarm.run.spec.RunSpec once started
        self.device = torch.device(resolve_device(config.device))
        self.state = "starting"  # starting | joining | online | leaving | stopped
        self.throughput = 0.0
        self.counters: dict[str, int] = {
            "forwards": 0,
            "backwards": 0,
            "refused": 0,
            "failed_sends": 0,
            "version_evicted": 0,
            "expired": 0,
            "moves": 0,
            "refused_auth": 0,  # no valid join proof, listed, penalized (part of "refused")
            "penalized": 0,  # senders put in the penalty box for poison gradients
            "dropped_on_leave": 0,  # accumulated micro-batches a replica dropped when leaving its stage
            "cancelled": 0,  # micro-batches dropped because their trainer cancelled them (CANCEL)
            "trainer_gone": 0,  # micro-batches dropped because their trainer could not be reached
        }
        self.auth: Any = None  # swarm.dht.auth.RunAuth once the spec is known
        self.loaded_from = ""  # "peer", "keeper", "checkpoint", "seed" or "weights" (--weights DIR)
        self._dht: Any = None
        self._p2p: Any = None
        self._membership: Any = None
        self._compute: StageCompute | None = None
        self._averager: StageAverager | None = None
        self._queue: ComputeQueue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rng = random.Random()
        self._announcements = AnnounceRule(config.announce_period_s)  # note "announce on change"
        self._recount = Recount()  # note "replica recount"
        self._move_reads = MoveReads()  # note "lone reads"
        self._donor_priority = EveryNth(DONOR_PRIORITY_EVERY_STORES)  # with every few record stores
        self._rounds: ReplicaRounds | None = None
        self._round_counters: dict[str, int] = dict.fromkeys(ReplicaRounds.COUNTERS, 0)  # of stages left
        self._switch_lock = asyncio.Lock()
        self._move_refused: set[int] = set()  # stages a move to was refused (no state there; said once)
        self._codecs: tuple[Any, Any] | None = None  # (activations, gradients)
        self._rate: ServedRate | None = None  # note "served throughput" (peer/throughput.py)
        self._fwd_s: OrderedDict[str, float] = OrderedDict()  # mb_id -> its forward task's seconds
        self._fwd_stats: OrderedDict[str, dict] = OrderedDict()  # mb_id -> its forward's stats (one report)
        self._started_at = time.monotonic()  # start() resets it: the startup lines count from there
        self._stopping: asyncio.Future | None = None  # the one shutdown, once begun
        self._tasks = TaskOwner(self._stop_on_crash)
        self._admission = Admission(config, self.counters)
        self.timeline = Timeline()  # note "timeline" (peer/timeline.py): always on, cheap
        self._trainers = TrainerWatch(
            compute=lambda: self._compute, ping=self._ping, spawn=self._tasks.spawn, counters=self.counters
        )
        self._outbox = Outbox(
            config,
            self.counters,
            self._trainers,
            loop=lambda: self._loop,
            p2p=lambda: self._p2p,
            auth=lambda: self.auth,
            timeline=self.timeline,
        )

    # ------------------------------------------------------------------------------ properties

    @property
    def peer_id(self) -> str:
        if self._membership is None:
            raise RuntimeError("the peer has not started")
        return self._membership.peer_id

    @property
    def stage(self) -> int:
        if self._compute is None:
            raise RuntimeError("the peer serves no stage yet")
        return self._compute.stage

    @property
    def version(self) -> int:
        return -1 if self._compute is None else self._compute.version

    @property
    def compute(self) -> StageCompute:
        if self._compute is None:
            raise RuntimeError("the peer serves no stage yet")
        return self._compute

    @property
    def queue(self) -> ComputeQueue:
        assert self._queue is not None
        return self._queue

    @property
    def dht(self) -> Any:
        return self._dht

    @property
    def crashed(self) -> str | None:
        """The background loop whose crash stopped this peer, if one did (peer/loops.py)."""
        return self._tasks.crashed

    def visible_maddrs(self) -> list[str]:
        from swarm.dht.network import visible_maddrs

        return visible_maddrs(self._dht)

    def stats(self) -> dict[str, float]:
        """Counters, queue figures and stash figures, for status and tests."""
        out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        rounds = self._rounds.counters if self._rounds is not None else {}
        for k, v in self._round_counters.items():  # gradient rounds (peer/replicas.py), every stage served
            out[k] = float(v + rounds.get(k, 0))
        if self._queue is not None:
            out.update({f"queue_{k}": v for k, v in self._queue.stats.as_dict().items()})
        if self._compute is not None:
            c = self._compute
            out.update(
                stash=float(len(c.stash)),
                stash_expired=float(c.stash.expired),
                stash_dropped=float(c.stash.dropped),
                version=float(c.version),
                steps=float(c.steps_taken),
                evicted_refusals=float(c.versions.evicted_refusals),
                replicas=float(c.replicas),
            )
            if c.device.type == "cuda":  # what this process's stage held at most (benchmarks/gpu_check.py)
                out["cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(c.device))
        out["held"] = float(self._outbox.held_count())
        out.update(TRAFFIC.as_stats())  # what this process sent, by kind (swarm/traffic.py)
        return out

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Join the run and serve. On failure everything started so far is shut down again."""
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._started_at = time.monotonic()
        try:
            await self._start_dht()
            self.spec = await asyncio.to_thread(self._membership.fetch_spec, cfg.spec_timeout_s)
            # a private run needs the right secret (ConfigError otherwise); from here on every record
            # we write carries a join proof and every record we read must carry one
            self.auth = RunAuth.from_spec(self.spec, cfg.secret)
            self._membership.set_auth(self.auth)
            self._check_device()
            self._codecs = _build_codecs(self.spec, cfg)
            self._queue = ComputeQueue(cfg.max_queue, forward_gate=self._forward_gate)
            self._queue.start()
            self._p2p = await self._dht.replicate_p2p()
            resume = await asyncio.to_thread(self._read_checkpoint)
            stage = await self._pick_stage(resume)
            await self._join_stage(stage, resume)
            await self._serve()
            self.state = "online"
            await self._announce()
            self._start_loops()
            logger.info("peer %s serving stage %d of run %s", self.peer_id, self.stage, cfg.run_id)
        except BaseException:
            await self.shutdown()
            raise

    async def _start_dht(self) -> None:
        from swarm.dht.membership import Membership
        from swarm.dht.network import DHTConfig, reachability_warning, start_dht, visible_maddrs

        cfg = self.config
        dht_cfg = DHTConfig(
            initial_peers=cfg.initial_peers,
            host_maddrs=cfg.host_maddrs,
            announce_maddrs=cfg.announce_maddrs,
            identity_path=cfg.identity_path,
            public=cfg.public,
        )
        self._dht = await asyncio.to_thread(start_dht, dht_cfg)
        logger.info("DHT node up after %.1f s", time.monotonic() - self._started_at)
        self._membership = Membership(self._dht, cfg.run_id)
        warning = reachability_warning(
            cfg.initial_peers, cfg.announce_maddrs or tuple(visible_maddrs(self._dht))
        )
        if warning:
            logger.warning("%s", warning)

    async def _serve(self) -> None:
        """Open admission and register the data-plane handlers (peer/handlers.py)."""
        self._admission.open(self.auth, self.peer_id, self.queue)
        handlers = (self._on_forward, self._on_backward, self._on_info, self._on_cancel)
        for name, handler in zip(_HANDLED, handlers, strict=True):
            await serve(
                self._p2p,
                name,
                handler,
                max_payload_bytes=self.config.max_payload_bytes,
                gate=self._admission.gate,
                on_refused=self._admission.count_refusal,
            )

    def _check_device(self) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device {self.config.device!r} was requested but CUDA is not available on this machine; "
                "use --device cpu (or auto)"
            )

    def _forward_gate(self) -> bool:
        compute = self._compute
        return compute is None or compute.forward_allowed()

    def _notify_queue(self) -> None:
        if self._queue is not None:
            self._queue.notify()

    async def _stop_on_crash(self, name: str, error: BaseException) -> None:
        """``TaskOwner``'s ``on_fatal``: a background loop crashed for good (peer/loops.py)."""
        logger.error(
            "peer %s stops: its background task %r crashed (%s: %s)",
            self.peer_id,
            name,
            type(error).__name__,
            error,
        )
        await self.shutdown()

    async def shutdown(self) -> None:
        """Announce leaving, drain, checkpoint, stop everything this peer started. Idempotent; a call
        while a shutdown runs (the peer stopping after a crash, then its runner) waits for that one."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown())
        await self._stopping

    async def _shutdown(self) -> None:
        if self.state == "stopped":
            return
        was_serving = self.state in ("online", "joining", "leaving")
        if self._compute is not None:  # one line of what this peer did (benchmarks read it from the log)
            logger.info(
                "peer %s stopping: stash %d, version %d, counters %s",
                self.peer_id,
                len(self._compute.stash),
                self._compute.version,
                json.dumps(self.stats(), sort_keys=True),
            )
        self.state = "leaving"
        if was_serving and self._membership is not None and self._compute is not None:
            with contextlib.suppress(SwarmError, OSError):
                await asyncio.wait_for(self._announce(), timeout=5)
        await self._tasks.close()
        await self._finish_work(was_serving)
        await self._stop_network()
        self._write_timeline()
        self.state = "stopped"

    def _write_timeline(self) -> None:
        """``--timeline FILE``: write what this peer served (note "timeline"), once it is all done."""
        path = self.config.timeline_path
        if path is None:
            return
        if self._compute is not None:
            self.timeline.stage = self._compute.stage
        try:
            n = self.timeline.write(path, peer=self._membership.peer_id if self._membership else "")
            logger.info("timeline of %d events written to %s", n, path)
        except OSError as e:
            logger.error("could not write the timeline to %s: %s", path, e)

    async def _finish_work(self, was_serving: bool) -> None:
        """Drain the queue and the sends, stop the rounds, keep what was learnt (rate, checkpoint)."""
        if was_serving and self._compute is not None and self._queue is not None:
            await self._drain(self._compute)  # backwards of stashed micro-batches may still arrive
        if self._queue is not None:
            await asyncio.to_thread(self._queue.close, timeout_s=self.config.drain_timeout_s)
        await self._outbox.wait(min(5.0, self.config.request_timeout_s))
        await self._stop_rounds()
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self._store_rate)
        if self._compute is not None and self.config.checkpoint_dir is not None:
            try:
                await asyncio.to_thread(self._save_checkpoint)
            except OSError as e:
                logger.error("could not save the final checkpoint to %s: %s", self.config.checkpoint_dir, e)

    async def _stop_network(self) -> None:
        if self._averager is not None:
            if self.auth is not None and self.auth.gated:
                # the authorized set is per process (peer/averaging.py): do not leave it active for
                # a public-run peer started later in this process (tests run several peers in one)
                self._averager.set_authorized(None)
            await asyncio.to_thread(self._averager.shutdown)
            self._averager = None
        if self._p2p is not None:
            for (
                name
            ) in _HANDLED:  # each on its own: one the daemon cannot remove must not keep the rest served
                with contextlib.suppress(Exception):
                    await unserve(self._p2p, name)
            close_channels(self._p2p)
            # a replicated P2P's shutdown closes its handler socket and removes the socket file
            # (the DHT's daemon stays up until the DHT stops); without it /tmp collects sockets
            with contextlib.suppress(Exception):
                await self._p2p.shutdown()
            self._p2p = None
        if self._dht is not None:
            await asyncio.to_thread(self._dht.shutdown)
            self._dht = None

    async def _drain(self, compute: StageCompute) -> None:
        """Wait (up to ``drain_timeout_s``) until no micro-batch awaits its backward here and the
        queue and outgoing sends are empty. New forwards are refused meanwhile (state != online)."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline and (
            len(compute.stash) or not self.queue.idle or self._outbox.busy
        ):
            await asyncio.sleep(0.05)

    async def move_to(self, stage: int) -> None:
        """Leave the current stage (finishing in-flight work) and serve ``stage`` with its current state."""
        if not 0 <= stage < self.spec.num_stages:
            raise ConfigError(f"stage {stage} does not exist: the run has {self.spec.num_stages} stages")
        async with self._switch_lock:
            old = self.compute
            await self._leave_stage(old)
            from swarm.dht.snapshots import StageStateLost

            try:
                await self._join_stage(stage, None)
            except StageStateLost as e:  # the pre-check in _maybe_move passed, then the state vanished
                logger.warning("not moving to stage %d after all, back to stage %d: %s", stage, old.stage, e)
                await self._join_stage(old.stage, self._as_checkpoint(old))
            self.state = "online"
            self.counters["moves"] += 1
            self._move_reads = MoveReads()  # a new stage: read its lists on the next tick
            await self._announce()

    async def _leave_stage(self, old: StageCompute) -> None:
        """Announce leaving, finish in-flight work, step or drop what is accumulated, stop the averager."""
        self.state = "leaving"
        await self._announce()
        await self._drain(old)
        await self._stop_rounds()
        if old.replicas <= 1:
            await asyncio.to_thread(old.flush_step)  # a lone replica loses no accumulated gradient
        elif old.uncombined():
            # the stage's other replicas step on without them: say so (work lost, never silently)
            self.counters["dropped_on_leave"] += old.uncombined()
            logger.warning(
                "left stage %d with the gradients of %d micro-batches not yet combined; they are dropped",
                old.stage,
                old.uncombined(),
            )
        if self._averager is not None:
            await asyncio.to_thread(self._averager.shutdown)
            self._averager = None
        await asyncio.to_thread(self._store_rate)


def _build_codecs(spec: Any, cfg: PeerConfig) -> tuple[Any, Any]:
    """The run's activation and gradient codecs, decoding at most 8x the payload cap."""
    from compression import CodecError, get_codec

    try:
        return (
            get_codec(spec.codecs.activations, max_decoded_bytes=cfg.max_payload_bytes * 8),
            get_codec(spec.codecs.gradients, max_decoded_bytes=cfg.max_payload_bytes * 8),
        )
    except CodecError as e:
        raise ConfigError(
            f"run {cfg.run_id!r} uses a codec this peer cannot build ({e}); upgrade swarmpipe"
        ) from e
