"""``StagePeer``: one stage peer's lifecycle and its data-plane handlers.

Lifecycle (``start`` .. ``shutdown``)::

    DHT up -> fetch + verify the run spec -> pick a stage (placement, or --stage) -> measure
    throughput -> announce "joining" -> load the stage's state (a same-stage donor via hivemind's
    load_state_from_peers, a keeper's snapshot included; else --checkpoint-dir; else the spec's seed, or
    for a --from-pretrained run the --weights checkpoint, digest-checked) -> serve FORWARD / BACKWARD
    / INFO -> announce "online" -> background: announce + rebalance (every ~5 s, jittered),
    stash expiry, averaging, checkpoints -> on stop: "leaving", drain, checkpoint, shut down.

Concurrency (one model per process, see STYLE.md): the asyncio loop owns every network call (P2P
handlers, sends to the next hop, reports, DHT calls through ``asyncio.to_thread`` into the one
``Membership``). Compute runs only in the worker thread of ``peer/runtime.py``; a finished task
hands its network sends back to the loop with ``run_coroutine_threadsafe``. Averaging rounds run
in their own thread and apply their result under the compute lock between micro-batches. Every
background task belongs to ``self._tasks`` and is cancelled in ``shutdown``.

Data plane (see ``swarm/wire/protocol.py`` for the message flow): a request is validated completely
(run, spec hash, stage, route, token range, codec header shape before decoding, finite values) and
then queued; the reply is the ack with the queue length. A peer that cannot deliver to the next hop
reports ``failed`` to the trainer, naming that hop, and drops its stash entry.

Per-hop stats keys added to headers and reports (all floats): ``fwd_compute_s_<s>``,
``fwd_queue_s_<s>``, ``fwd_bytes_<s>`` (bytes sent to stage s+1), ``bwd_compute_s_<s>``,
``bwd_queue_s_<s>``, ``bwd_bytes_<s>`` (bytes sent to stage s-1), ``version_<s>`` (forward
version) and ``staleness_<s>`` (versions elapsed until backward).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from typing import Any

import torch

from peer.averaging import StageAverager
from peer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from peer.compute import StageCompute
from peer.config import PeerConfig, resolve_device
from peer.replicas import ReplicaRounds, RoundsConfig
from peer.runtime import ComputeQueue
from peer.stash import VersionEvicted
from peer.throughput import ServedRate, measure_throughput, store_throughput
from swarm.dht.auth import AuthError, PenaltyBox, RunAuth, SenderLimiter
from swarm.errors import ConfigError, Failure, PeerFailure, RequestError, SwarmError
from swarm.wire.protocol import (
    BACKWARD,
    CANCEL,
    FORWARD,
    INFO,
    REPORT,
    BackwardHeader,
    ForwardHeader,
    Message,
    Report,
    call,
    listed_ids,
    serve,
    unpack_tokens,
)

__all__ = ["StagePeer"]

logger = logging.getLogger(__name__)

_EXPIRY_PERIOD_S = 1.0
_AUTHORIZED_PERIOD_S = 1.0
_PING_TIMEOUT_S = 2.0  # an INFO call that tells a live same-stage replica from a dead one
# note "trainers that vanish": a trainer whose stash entries wait this long without news is probed
_TRAINER_QUIET_S = 5.0
_GONE_TRAINERS = 256  # trainers remembered as gone (their late micro-batches are dropped)
_CANCELLED = 8192  # cancelled (trainer, mb_id) pairs remembered
_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58, as in swarm/dht/records.py


class StagePeer:
    """A stage peer. ``await start()`` joins and serves; ``await shutdown()`` leaves cleanly."""

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
        self._penalties = PenaltyBox(config.penalty_s)
        self._limiter = SenderLimiter(config.max_queue_per_sender)
        self.loaded_from = ""  # "peer", "keeper", "checkpoint", "seed" or "weights" (--weights DIR)
        self._dht: Any = None
        self._p2p: Any = None
        self._membership: Any = None
        self._compute: StageCompute | None = None
        self._averager: StageAverager | None = None
        self._queue: ComputeQueue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._sends: set[asyncio.Future] = set()
        self._rng = random.Random()
        self._rounds: ReplicaRounds | None = None
        self._round_counters: dict[str, int] = dict.fromkeys(ReplicaRounds.COUNTERS, 0)  # of stages left
        self._switch_lock = asyncio.Lock()
        self._move_refused: set[int] = set()  # stages a move to was refused (no state there; said once)
        self._codecs: tuple[Any, Any] | None = None
        # note "holding": mb_id -> queued/running tasks and unfinished sends of that micro-batch here
        self._held: Counter[str] = Counter()
        self._held_lock = threading.Lock()
        self._cancelled: OrderedDict[tuple[str, str], None] = OrderedDict()  # (trainer, mb_id)
        self._gone: OrderedDict[str, float] = OrderedDict()  # trainer -> when it was found unreachable
        self._trainer_heard: dict[str, float] = {}  # trainer -> last sign of life (monotonic)
        self._probing_trainers: set[str] = set()
        self._rate: ServedRate | None = None  # note "served throughput" (peer/throughput.py)
        self._fwd_s: OrderedDict[str, float] = OrderedDict()  # mb_id -> its forward task's seconds
        self._started_at = time.monotonic()  # start() resets it: the startup lines count from there

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
        with self._held_lock:
            out["held"] = float(len(self._held))
        return out

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Join the run and serve. On failure everything started so far is shut down again."""
        from swarm.dht.membership import Membership
        from swarm.dht.network import DHTConfig, reachability_warning, start_dht, visible_maddrs

        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._started_at = time.monotonic()
        try:
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
            self.spec = await asyncio.to_thread(self._membership.fetch_spec, cfg.spec_timeout_s)
            # a private run needs the right secret (ConfigError otherwise); from here on every record
            # we write carries a join proof and every record we read must carry one
            self.auth = RunAuth.from_spec(self.spec, cfg.secret)
            self._membership.set_auth(self.auth)
            self._check_device()
            from compression import CodecError, get_codec

            try:
                self._codecs = (
                    get_codec(self.spec.codecs.activations, max_decoded_bytes=cfg.max_payload_bytes * 8),
                    get_codec(self.spec.codecs.gradients, max_decoded_bytes=cfg.max_payload_bytes * 8),
                )
            except CodecError as e:
                raise ConfigError(
                    f"run {cfg.run_id!r} uses a codec this peer cannot build ({e}); upgrade swarmpipe"
                ) from e
            self._queue = ComputeQueue(cfg.max_queue, forward_gate=self._forward_gate)
            self._queue.start()
            self._p2p = await self._dht.replicate_p2p()
            resume = await asyncio.to_thread(self._read_checkpoint)
            stage = await self._pick_stage(resume)
            await self._join_stage(stage, resume)
            for name, handler in (
                (FORWARD, self._on_forward),
                (BACKWARD, self._on_backward),
                (INFO, self._on_info),
                (CANCEL, self._on_cancel),
            ):
                await serve(
                    self._p2p,
                    name,
                    handler,
                    max_payload_bytes=cfg.max_payload_bytes,
                    gate=self._gate,
                    on_refused=self._count_refusal,
                )
            self.state = "online"
            await self._announce()
            self._spawn(self._announce_loop())
            self._spawn(self._expiry_loop())
            if self.auth.gated:
                self._spawn(self._authorized_loop())
            if cfg.checkpoint_dir is not None:
                self._spawn(self._checkpoint_loop())
            logger.info("peer %s serving stage %d of run %s", self.peer_id, self.stage, cfg.run_id)
        except BaseException:
            await self.shutdown()
            raise

    def _check_device(self) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device {self.config.device!r} was requested but CUDA is not available on this machine; "
                "use --device cpu (or auto)"
            )

    def _read_checkpoint(self) -> Checkpoint | None:
        if self.config.checkpoint_dir is None:
            return None
        return load_checkpoint(self.config.checkpoint_dir, spec_hash=self.spec.spec_hash)

    async def _pick_stage(self, resume: Checkpoint | None) -> int:
        n = self.spec.num_stages
        if self.config.stage != "auto":
            stage = int(self.config.stage)
            if stage >= n:
                raise ConfigError(
                    f"--stage {stage} does not exist: run {self.spec.run_id!r} has {n} stages (0..{n - 1}); "
                    "pass one of those or --stage auto"
                )
            return stage
        if resume is not None and resume.stage < n:
            return resume.stage  # resume where this peer left off; rebalancing may move it later
        from swarm.dht.placement import choose_stage

        records = await asyncio.to_thread(self._membership.all_stage_records)
        # choose_stage does not depend on our own throughput (the weakest stage gains most from
        # any peer), so the stage is chosen first and measured once below.
        return choose_stage(records, my_throughput=0.0, rng=self._rng)

    async def _measure(self, stage: int) -> float:
        if self.config.throughput is not None:
            value = self.config.throughput
        else:
            value = await asyncio.to_thread(
                measure_throughput, self.spec, stage, self.device, cache_dir=self.config.cache_dir
            )
        if self.config.slowdown_s > 0:
            # the artificial delay is part of what a micro-batch costs here: announce the slower rate
            per_mb = self.spec.tokens_per_micro_batch / value + self.config.slowdown_s
            value = self.spec.tokens_per_micro_batch / per_mb
        return value

    async def _join_stage(self, stage: int, resume: Checkpoint | None) -> None:
        """Build the stage, load its state (donor > checkpoint > seed), start its averager."""
        self.state = "joining"
        self.throughput = await self._measure(stage)
        # note "served throughput" (peer/throughput.py): the measurement only seeds what is announced
        self._rate = (
            ServedRate(self.throughput, now=time.monotonic()) if self.config.throughput is None else None
        )
        self._fwd_s.clear()
        initial = await self._initial_weights(stage)
        compute = await asyncio.to_thread(StageCompute, self.spec, stage, device=self.device, initial=initial)
        del initial  # the compute holds its own copy
        compute.on_gate_change = self._notify_queue
        self._compute = compute
        await self._announce()
        # the state's shapes only: a copy of the state (export_state) would cost 3x the stage's memory here
        shapes = [t.shape for t in compute.optimizer.state_tensors()]
        self._averager = StageAverager.create(
            self._dht,
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            stage=stage,
            shapes=shapes,
            grad_shapes=[compute.optimizer.params[n].shape for n in compute.optimizer.names],
            state_fn=self._donor_state,
            min_matchmaking_time_s=self.config.averaging_matchmaking_s,
        )
        await asyncio.to_thread(self._averager.wait_ready, 30.0)
        t_state = time.monotonic()
        logger.info(
            "stage %d built, averager ready after %.1f s; loading its state",
            stage,
            t_state - self._started_at,
        )
        await self._refresh_authorized()
        records = await asyncio.to_thread(self._membership.stage_records, stage)
        others = [r for pid, r in records.items() if pid != self.peer_id and r.state == "online"]
        loaded = None
        snapshot = (
            None  # a keeper's snapshot (swarm/tools/keeper.py): the fallback when no live replica answers
        )
        # a dead replica's donor declaration outlives it by up to 10 s and may hold up an attempt: retry
        # when someone (a live replica or a keeper) should be able to send the state
        attempts = 3 if others or await self._keeper_holds(stage) else 1
        for attempt in range(attempts):
            loaded = await asyncio.to_thread(self._averager.load_state, self.config.state_timeout_s)
            if loaded is not None and isinstance(loaded[0].get("snapshot"), dict):
                # donors are tried by priority and a keeper's is below every live peer's: none answered
                snapshot, loaded = loaded, None
                if await self._live_replicas(stage) <= 1:
                    break  # no other replica is alive: retrying would only reach the keeper again
            elif loaded is not None:
                try:
                    self._check_initial(stage, loaded, "a live replica")
                    compute.import_state(*loaded)
                    self.loaded_from = "peer"
                    break
                except RequestError as e:
                    logger.warning("refused the state a donor of stage %d sent: %s", stage, e)
                    loaded = None
            if attempt + 1 < attempts:
                await asyncio.sleep(1.0)
        if loaded is None:
            await self._restore_stage(compute, resume, snapshot, others=len(others))
        logger.info(
            "stage %d: state from %s (version %d) in %.1f s",
            stage,
            _SOURCES.get(self.loaded_from, "the spec's seed"),
            compute.version,
            time.monotonic() - t_state,
        )
        self._averager.share_state(True, priority=compute.version)
        compute.set_replicas(await self._live_replicas(stage))
        self._rounds = ReplicaRounds(
            compute,
            self._averager,
            peer_id=self.peer_id,
            config=RoundsConfig(
                timeout_s=self.spec.averaging.timeout_s,
                max_failed_rounds=self.config.max_failed_rounds,
            ),
            replicas_fn=lambda: self._on_loop(self._live_replicas(stage), timeout_s=10.0),
            catch_up=self._catch_up,
        )
        self._rounds.start()
        self._notify_queue()

    async def _initial_weights(self, stage: int) -> dict[str, torch.Tensor] | None:
        """A --from-pretrained run's initial weights of ``stage`` from ``--weights`` (only its tensors, read
        memory-mapped and checked against the spec's digest: a mismatch stops the peer), or None. Read
        before the stage is built, so that no seed is drawn; a live replica or keeper still comes first.
        Without ``--weights``: zeros (``placeholder_weights``), never served (the seed means nothing here)."""
        if self.config.weights_dir is None:
            if self.spec.pretrained is None:
                return None
            from swarm.run.pretrained import placeholder_weights

            return await asyncio.to_thread(placeholder_weights, self.spec, stage)
        if self.spec.pretrained is None:
            logger.warning(
                "--weights %s ignored: run %r does not continue a checkpoint (its initial weights come from "
                "its seed)",
                self.config.weights_dir,
                self.spec.run_id,
            )
            return None
        from swarm.run.pretrained import check_stage_weights, read_stage_weights

        directory = self.config.weights_dir

        def read() -> dict[str, torch.Tensor]:
            weights = read_stage_weights(directory, self.spec, stage)
            check_stage_weights(self.spec, stage, weights, source=f"--weights {directory}")
            return weights

        return await asyncio.to_thread(read)

    def _check_initial(
        self, stage: int, state: tuple[dict[str, Any], list[torch.Tensor]], source: str
    ) -> None:
        """A shared state at version 0 of a --from-pretrained run must hold the checkpoint's weights
        (``RequestError`` otherwise, so the caller refuses it like any bad state)."""
        from swarm.run.pretrained import check_initial_state

        try:
            check_initial_state(self.spec, stage, state[0], state[1], source=source)
        except ConfigError as e:
            raise RequestError(str(e)) from None

    def _initial_source(self, stage: int) -> tuple[str, str | None]:
        """Where a stage that no one sends state for starts: ``("seed", None)``, ``("weights", None)``
        for a --from-pretrained run with ``--weights``, or ``("", why not)``."""
        pre = self.spec.pretrained
        if pre is None:
            return "seed", None
        if self.config.weights_dir is not None:
            return "weights", None
        return "", (
            f"stage {stage} of run {self.spec.run_id!r} continues the checkpoint {pre.source!r}, and neither a "
            "live replica nor a keeper sent its weights: start this peer with --weights DIR, a local copy of "
            f"that checkpoint (only stage {stage}'s tensors are read and checked against the run spec), or "
            "make sure the run's keeper (`swarm init --from-pretrained ...`) is reachable, then retry"
        )

    async def _keeper_holds(self, stage: int) -> bool:
        """Whether a keeper's index in the DHT lists a snapshot of ``stage``."""
        try:
            indexes = await asyncio.to_thread(self._membership.snapshot_indexes)
        except (SwarmError, OSError):
            return False
        return any(stage < len(i.versions) and i.versions[stage] >= 0 for i in indexes)

    async def _restore_stage(
        self, compute: StageCompute, resume: Checkpoint | None, snapshot: Any, *, others: int
    ) -> None:
        """No live replica sent the stage's state: take the newest of a keeper's snapshot and this peer's
        checkpoint; with neither, start from the spec's seed only if the run has not trained (or with
        ``start_fresh``), else raise ``StageStateLost``. In a trained run the event is published for
        trainers and monitors (``StageEvent``). See swarm/dht/snapshots.py and swarm/tools/keeper.py."""
        from swarm.dht.snapshots import (
            Restorable,
            StageStateLost,
            choose_newest,
            last_seen_version,
            lost_state_message,
            training_evidence,
        )

        stage = compute.stage
        evidence, seen = None, -1
        try:
            records = await asyncio.to_thread(self._membership.all_stage_records)
            progress = await asyncio.to_thread(self._membership.progress)
            indexes = await asyncio.to_thread(self._membership.snapshot_indexes)
            mine = {pid: r for pid, r in records[stage].items() if pid != self.peer_id}
            evidence = training_evidence(records, progress, indexes)
            seen = last_seen_version(stage, mine, indexes)
        except (SwarmError, OSError) as e:
            logger.warning("could not read the run's history from the DHT: %s", e)
        candidates = []
        if snapshot is not None:
            candidates.append(Restorable("keeper", int(snapshot[0].get("version", -1)), snapshot))
        if resume is not None and resume.stage == stage:
            candidates.append(Restorable("checkpoint", resume.version, resume))
        while candidates:
            best = choose_newest(candidates)
            assert best is not None
            try:
                if best.source == "keeper":
                    self._check_initial(stage, best.payload, "the keeper")
                    compute.import_state(*best.payload)
                else:
                    compute.import_state(best.payload.meta | {"version": best.version}, best.payload.tensors)
                self.loaded_from = best.source
                break
            except RequestError as e:
                logger.warning("refused the %s state of stage %d: %s", best.source, stage, e)
                candidates.remove(best)
        else:
            self.loaded_from, problem = self._initial_source(stage)
            if evidence is not None and not self.config.start_fresh:
                problem = lost_state_message(self.spec.run_id, stage, evidence)
            if problem is not None:
                if self._averager is not None:
                    await asyncio.to_thread(self._averager.shutdown)
                    self._averager = None
                raise StageStateLost(problem)
        if others:
            logger.warning(
                "stage %d has %d online peer record(s) but none sent its state; started from the %s",
                stage,
                others,
                _SOURCES[self.loaded_from].removeprefix("the "),
            )
        if evidence is None or await self._live_replicas(stage) > 1:
            return  # a fresh run, or live replicas exist: the replica rounds bring this peer up to date
        await self._publish_stage_event(stage, compute.version, seen)

    async def _publish_stage_event(self, stage: int, version: int, seen: int) -> None:
        """Tell trainers and monitors that the stage was restored (or restarted) and what it lost."""
        from swarm.dht.records import StageEvent

        event = StageEvent(
            peer_id=self.peer_id,
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            stage=stage,
            kind="fresh" if self.loaded_from in ("seed", "weights") else "rollback",
            source="seed" if self.loaded_from == "weights" else self.loaded_from,  # the initial weights
            version=version,
            lost_from=seen,
            at=time.time(),
        )
        logger.warning("%s", event.describe())
        try:
            await asyncio.to_thread(self._membership.publish_event, event)
        except (SwarmError, OSError) as e:
            logger.warning("could not publish the stage event: %s", e)

    async def _live_replicas(self, stage: int) -> int:
        """Replicas of ``stage``, this peer included, whose records say online and who answer an INFO
        call for that stage (a SIGKILLed peer's record outlives it by up to its TTL; its connection
        fails at once)."""
        records = await asyncio.to_thread(self._membership.stage_records, stage)
        others = [pid for pid, r in records.items() if pid != self.peer_id and r.state == "online"]
        answers = await asyncio.gather(*(self._serves_stage(pid, stage) for pid in others))
        return 1 + sum(answers)

    async def _serves_stage(self, peer: str, stage: int) -> bool:
        try:
            info = await call(self._p2p, peer, INFO, Message({}), timeout_s=_PING_TIMEOUT_S, auth=self.auth)
        except (PeerFailure, RequestError):
            return False
        return info.get("stage") == stage and info.get("state") == "online"

    def _on_loop(self, coro: Coroutine[Any, Any, Any], *, timeout_s: float) -> Any:
        """Run ``coro`` on the peer's event loop from another thread and wait for its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _refresh_replicas(self) -> None:
        compute = self._compute
        if compute is None:
            return
        live = await self._live_replicas(compute.stage)
        if live != compute.replicas:
            logger.info("stage %d: %d live replica(s) now (was %d)", compute.stage, live, compute.replicas)
        await asyncio.to_thread(compute.set_replicas, live)

    def _catch_up(self, version: int) -> bool:
        """Download the stage's state from a replica at ``version`` or newer and adopt it (rounds' thread)."""
        compute, averager = self._compute, self._averager
        if compute is None or averager is None:
            return False
        loaded = averager.load_state(self.config.state_timeout_s)
        if loaded is None:
            logger.warning(
                "stage %d: no replica sent its state (wanted version %d); retrying next round",
                compute.stage,
                version,
            )
            return False
        try:
            adopted = compute.adopt_state(*loaded)
        except RequestError as e:
            logger.warning("refused the state a replica of stage %d sent: %s", compute.stage, e)
            return False
        if adopted:
            averager.share_state(True, priority=compute.version)
            logger.info("stage %d: caught up to version %d by state download", compute.stage, compute.version)
        return adopted

    async def _stop_rounds(self) -> None:
        if self._rounds is not None:
            await asyncio.to_thread(self._rounds.stop, self.spec.averaging.timeout_s + 5)
            for k, v in self._rounds.counters.items():
                self._round_counters[k] += v
            self._rounds = None

    def _donor_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining peer downloads (called in hivemind's fetcher thread)."""
        compute = self._compute
        if compute is None or self.state not in ("online", "leaving"):
            raise RequestError("this peer holds no stage state to share yet")
        return compute.export_state()

    async def shutdown(self) -> None:
        """Announce leaving, drain, checkpoint, stop everything this peer started. Idempotent."""
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
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if was_serving and self._compute is not None and self._queue is not None:
            await self._drain(self._compute)  # backwards of stashed micro-batches may still arrive
        if self._queue is not None:
            await asyncio.to_thread(self._queue.close, timeout_s=self.config.drain_timeout_s)
        if self._sends:
            await asyncio.wait(list(self._sends), timeout=min(5.0, self.config.request_timeout_s))
        await self._stop_rounds()
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self._store_rate)
        if self._compute is not None and self.config.checkpoint_dir is not None:
            try:
                await asyncio.to_thread(self._save_checkpoint)
            except OSError as e:
                logger.error("could not save the final checkpoint to %s: %s", self.config.checkpoint_dir, e)
        if self._averager is not None:
            if self.auth is not None and self.auth.gated:
                # the authorized set is per process (peer/averaging.py): do not leave it active for
                # a public-run peer started later in this process (tests run several peers in one)
                self._averager.set_authorized(None)
            await asyncio.to_thread(self._averager.shutdown)
            self._averager = None
        if self._p2p is not None:
            with contextlib.suppress(Exception):
                for name in (FORWARD, BACKWARD, INFO, CANCEL):
                    await self._p2p.remove_protobuf_handler(name)
            # a replicated P2P's shutdown closes its handler socket and removes the socket file
            # (the DHT's daemon stays up until the DHT stops); without it /tmp collects sockets
            with contextlib.suppress(Exception):
                await self._p2p.shutdown()
            self._p2p = None
        if self._dht is not None:
            await asyncio.to_thread(self._dht.shutdown)
            self._dht = None
        self.state = "stopped"

    async def _drain(self, compute: StageCompute) -> None:
        """Wait (up to ``drain_timeout_s``) until no micro-batch awaits its backward here and the
        queue and outgoing sends are empty. New forwards are refused meanwhile (state != online)."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline and (len(compute.stash) or not self.queue.idle or self._sends):
            await asyncio.sleep(0.05)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------- announcing, rebalancing

    def _record(self) -> Any:
        from swarm.dht.records import PeerRecord

        compute = self.compute
        state = self.state if self.state in ("joining", "online", "leaving") else "joining"
        return PeerRecord(
            peer_id=self.peer_id,
            run_id=self.spec.run_id,
            stage=compute.stage,
            state=state,
            throughput=float(self.throughput),
            queue=len(self._queue) if self._queue is not None else 0,
            version=compute.version,
            codecs=_decodable_codecs(),
            spec_hash=self.spec.spec_hash,
        )

    async def _announce(self) -> None:
        period = self.config.announce_period_s
        await asyncio.to_thread(self._membership.announce, self._record(), 3 * period)

    async def _announce_loop(self) -> None:
        period = self.config.announce_period_s
        while True:
            await asyncio.sleep(period * self._rng.uniform(0.8, 1.2))
            try:
                if self.state == "online":
                    if self._rate is not None:
                        self.throughput = self._rate.fold(time.monotonic())
                    await self._announce()
                    if self._averager is not None:
                        self._averager.share_state(True, priority=self.compute.version)
                    await self._refresh_replicas()
                    if self.config.rebalancing:
                        await self._maybe_move()
            except (SwarmError, OSError) as e:
                logger.warning("announce/rebalance round failed: %s", e)

    def _store_rate(self) -> None:
        """Write what this peer served on its stage into the throughput cache (the next start's seed)."""
        rate, compute = self._rate, self._compute
        if rate is None or compute is None or rate.samples < 8:
            return
        value = rate.fold(time.monotonic())
        if self.config.slowdown_s > 0:  # the cache holds the machine's speed, without the emulated delay
            per_token = 1.0 / value - self.config.slowdown_s / self.spec.tokens_per_micro_batch
            if per_token <= 0:
                return
            value = 1.0 / per_token
        store_throughput(self.spec, compute.stage, self.device, value, cache_dir=self.config.cache_dir)

    async def _maybe_move(self) -> None:
        from swarm.dht.placement import should_move

        records = await asyncio.to_thread(self._membership.all_stage_records)
        target = should_move(records, self.peer_id, margin=self.config.rebalance_margin, rng=self._rng)
        if target is not None and target != self.stage and await self._stage_restorable(target, records):
            logger.info("rebalancing: moving from stage %d to stage %d", self.stage, target)
            await self.move_to(target)

    async def _stage_restorable(self, stage: int, records: list) -> bool:
        """Whether a peer moving to ``stage`` finds state there (a live replica or a keeper's snapshot), or
        may start it from the seed (the run has not trained, or ``start_fresh``). Says why not, once."""
        from swarm.dht.snapshots import lost_state_message, training_evidence

        live = [pid for pid, r in records[stage].items() if pid != self.peer_id and r.state == "online"]
        if live or (self.config.start_fresh and self._initial_source(stage)[1] is None):
            return True
        indexes = await asyncio.to_thread(self._membership.snapshot_indexes)
        if any(stage < len(i.versions) and i.versions[stage] >= 0 for i in indexes):
            return True
        evidence = training_evidence(records, await asyncio.to_thread(self._membership.progress), indexes)
        if evidence is None and self._initial_source(stage)[1] is None:
            return True
        if stage not in self._move_refused:
            self._move_refused.add(stage)
            why = self._initial_source(stage)[1] if evidence is None else None
            logger.warning(
                "not moving to stage %d: %s",
                stage,
                why or lost_state_message(self.spec.run_id, stage, evidence),
            )
        return False

    async def move_to(self, stage: int) -> None:
        """Leave the current stage (finishing in-flight work) and serve ``stage`` with its current state."""
        if not 0 <= stage < self.spec.num_stages:
            raise ConfigError(f"stage {stage} does not exist: the run has {self.spec.num_stages} stages")
        async with self._switch_lock:
            old = self.compute
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
            from swarm.dht.snapshots import StageStateLost

            try:
                await self._join_stage(stage, None)
            except StageStateLost as e:  # the pre-check in _maybe_move passed, then the state vanished
                logger.warning("not moving to stage %d after all, back to stage %d: %s", stage, old.stage, e)
                await self._join_stage(old.stage, self._as_checkpoint(old))
            self.state = "online"
            self.counters["moves"] += 1
            await self._announce()

    # ----------------------------------------------------------------------------- background

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(_EXPIRY_PERIOD_S)
            compute = self._compute
            if compute is None:
                continue
            await self._check_trainers()
            for entry in compute.expire():
                self.counters["expired"] += 1
                header: ForwardHeader = entry.context
                self._report_failed(
                    header,
                    stage=compute.stage,
                    peer=self.peer_id,
                    reason=f"stash expired: no backward within {self.spec.stash_ttl_s:.0f} s",
                    failure=Failure.STASH_EXPIRED,
                )

    async def _refresh_authorized(self) -> None:
        """Tell the averager which peer ids may download state or average with us: the stage peers of
        the run whose DHT records carry valid join proofs (Membership already dropped the rest)."""
        if self.auth is None or not self.auth.gated or self._averager is None:
            return
        records = await asyncio.to_thread(self._membership.all_stage_records)
        allowed = {pid for stage in records for pid in stage} | {self.peer_id}
        averager = self._averager
        if averager is not None:
            averager.set_authorized(sorted(allowed))

    async def _authorized_loop(self) -> None:
        # every second: a joiner announces itself (with its proof) just before it asks for state
        while True:
            await asyncio.sleep(_AUTHORIZED_PERIOD_S)
            try:
                await self._refresh_authorized()
            except (SwarmError, OSError) as e:
                logger.warning("refreshing the authorized peers failed: %s", e)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_period_s)
            try:
                await asyncio.to_thread(self._save_checkpoint)
            except OSError as e:
                logger.error("periodic checkpoint to %s failed: %s", self.config.checkpoint_dir, e)

    def _as_checkpoint(self, compute: StageCompute) -> Checkpoint:
        """The state of ``compute`` as a checkpoint of this run (to save, or to rejoin its stage)."""
        meta, tensors = compute.export_state()
        return Checkpoint(
            spec_hash=self.spec.spec_hash,
            run_id=self.spec.run_id,
            stage=compute.stage,
            version=meta["version"],
            names=meta["names"],
            tensors=tensors,
            meta=meta,
        )

    def _save_checkpoint(self) -> None:
        save_checkpoint(self.config.checkpoint_dir, self._as_checkpoint(self.compute))

    # ------------------------------------------------------------------------------- handlers

    def _forward_gate(self) -> bool:
        compute = self._compute
        return compute is None or compute.forward_allowed()

    def _notify_queue(self) -> None:
        if self._queue is not None:
            self._queue.notify()

    def _gate(self, name: str, sender: str, header: dict[str, Any]) -> None:
        """Runs on every request's header before its payload is read: penalties, lists, join proof."""
        try:
            self._penalties.check(sender)
            self.auth.check_request(name, sender, self.peer_id, header)
        except AuthError:
            self.counters["refused_auth"] += 1
            raise

    def _count_refusal(self, error: RequestError) -> None:
        self.counters["refused"] += 1

    def _submit(self, kind: str, sender: str, fn: Any) -> int:
        """Queue ``fn`` under the sender's cap (``SenderLimiter``) and the queue's global cap."""
        self._limiter.acquire(sender)

        def task(waited: float) -> None:
            try:
                fn(waited)
            finally:
                self._limiter.release(sender)

        try:
            return self.queue.submit(kind, task)  # type: ignore[arg-type]
        except RequestError:
            self._limiter.release(sender)
            raise

    def _check_common(self, run_id: str, spec_hash: str, stage: int, what: str) -> StageCompute:
        if run_id != self.spec.run_id or spec_hash != self.spec.spec_hash:
            raise RequestError(
                f"{what} for run {run_id!r} spec {spec_hash} reached a peer of run {self.spec.run_id!r} "
                f"spec {self.spec.spec_hash}; refresh the route from the DHT"
            )
        compute = self._compute
        if compute is None or stage != compute.stage:
            mine = "none" if compute is None else compute.stage
            raise RequestError(
                f"{what} for stage {stage} reached a peer serving stage {mine}; refresh the route"
            )
        return compute

    def _decode(self, payload: bytes, shape: tuple[int, ...], what: str, max_rms: float) -> torch.Tensor:
        """Check the codec header's shape before decoding, then decode and check values (thread pool).

        Non-finite values, or a root-mean-square above ``max_rms``, raise ``PoisonError`` so that a
        caller can penalize the sender (gradients) or just refuse (activations).
        """
        from compression import CodecError, decode_any, header_info

        cap = self.config.max_payload_bytes * 8
        try:
            info = header_info(payload, max_decoded_bytes=cap)
            if tuple(info["shape"]) != shape:
                raise RequestError(
                    f"{what} payload has shape {tuple(info['shape'])}, expected {shape} (batch, seq, width): "
                    "width is d_model, or the subspace rank k in a subspace-constrained run"
                )
            tensor = decode_any(payload, max_decoded_bytes=cap)
        except CodecError as e:
            raise RequestError(f"{what} payload cannot be decoded: {e}") from None
        if not tensor.is_floating_point():
            raise RequestError(f"{what} payload has dtype {tensor.dtype}; expected floating point")
        tensor = tensor.float()
        if not torch.isfinite(tensor).all():
            raise PoisonError(f"{what} payload holds NaN or Inf values; refusing it")
        rms = float(tensor.pow(2).mean().sqrt()) if tensor.numel() else 0.0
        if not rms <= max_rms:  # also catches an overflow to inf in the square
            raise PoisonError(
                f"{what} payload has root-mean-square {rms:.3g}, above this peer's cap {max_rms:g}; "
                "refusing it as absurd"
            )
        return tensor

    async def _on_cancel(self, message: Message, remote: Any) -> dict[str, Any]:
        """A trainer gave up on these attempts: drop what this peer holds of them (its own only)."""
        run_id = message.header.get("run_id")
        if run_id != self.spec.run_id:
            raise RequestError(
                f"cancel for run {str(run_id)[:60]!r} reached a peer of run {self.spec.run_id!r}"
            )
        ids = listed_ids(message.header, "cancel request")
        sender = str(remote)
        self._trainer_heard[sender] = time.monotonic()
        for mb_id in ids:
            self._cancelled[(sender, mb_id)] = None
        while len(self._cancelled) > _CANCELLED:
            self._cancelled.popitem(last=False)
        compute = self._compute
        if compute is None:
            return {"dropped": 0}
        with compute.lock:
            mine = [
                i
                for i in ids
                if (e := compute.stash.get(i)) is not None and getattr(e.context, "trainer", None) == sender
            ]
        dropped = await asyncio.to_thread(lambda: sum(compute.drop(i) is not None for i in mine))
        self.counters["cancelled"] += dropped
        return {"dropped": dropped}

    async def _on_info(self, message: Message, remote: Any) -> dict[str, Any]:
        compute = self._compute
        ids = listed_ids(message.header, "info request")
        if ids:  # a probe (note "liveness probes", swarm/client/liveness.py): which of these do we hold?
            self._trainer_heard[str(remote)] = time.monotonic()
            with self._held_lock:
                held = [i for i in ids if self._held.get(i)]
            stashed = [] if compute is None else [i for i in ids if i in compute.stash]
            return {**self._info(), "held": held, "stashed": stashed}
        return self._info()

    def _info(self) -> dict[str, Any]:
        compute = self._compute
        return {
            "run_id": self.spec.run_id,
            "spec_hash": self.spec.spec_hash,
            "peer_id": self.peer_id,
            "stage": -1 if compute is None else compute.stage,
            "version": self.version,
            "queue": len(self._queue) if self._queue is not None else 0,
            "state": self.state,
        }

    async def _on_forward(self, message: Message, remote: Any) -> dict[str, Any]:
        try:
            h = ForwardHeader.from_wire(message.header)
            compute = self._check_common(h.run_id, h.spec_hash, h.stage, "forward")
            if self.state != "online":
                raise RequestError(
                    f"this peer is {self.state} and takes no new forwards; route to another peer"
                )
            bad = [p for p in (*h.route, h.trainer) if not _PEER_ID_RE.fullmatch(p)]
            if bad:
                raise RequestError(f"route/trainer entry {bad[0][:60]!r} is not a base58 libp2p peer id")
            if h.route[h.stage] != self.peer_id:
                raise RequestError(f"route names {h.route[h.stage]} for stage {h.stage}, not this peer")
            if len(h.route) != self.spec.num_stages:
                raise RequestError(
                    f"route has {len(h.route)} hops, the run has {self.spec.num_stages} stages"
                )
            model = self.spec.model
            if h.seq > model.seq_len:
                raise RequestError(f"sequence length {h.seq} exceeds the run's model.seq_len {model.seq_len}")
            tokens = unpack_tokens(h.tokens, h.batch, h.seq, model.vocab_size)
            targets = unpack_tokens(h.targets, h.batch, h.seq, model.vocab_size) if h.targets else None
            if compute.is_last and h.mode != "generate" and targets is None:
                raise RequestError(f"mode {h.mode!r} needs targets at the last stage")
            if compute.is_first:
                if message.payload:
                    raise RequestError("stage 0 takes token ids from the header; the payload must be empty")
                x = tokens
            else:
                shape = (h.batch, h.seq, compute.width)  # width = d_model, or k in a subspace run
                x = await asyncio.to_thread(
                    self._decode, message.payload, shape, "forward", self.config.max_activation_rms
                )
            if h.mode == "train" and h.mb_id in compute.stash:
                raise RequestError(
                    f"micro-batch {h.mb_id!r} is already in flight here; every attempt needs a new mb_id"
                )
            if h.window >= 0 and h.mode == "train":
                compute.note_window(h.trainer, h.window)  # sync: a newer window closes this replica's share
            if str(remote) == h.trainer:  # the trainer itself sent it: alive, whatever we concluded before
                self._trainer_heard[h.trainer] = time.monotonic()
                self._gone.pop(h.trainer, None)
            self._hold(h.mb_id)
            try:
                n = self._submit(
                    "forward",
                    str(remote),
                    lambda waited: self._forward_task(compute, h, x, tokens, targets, waited),
                )
            except RequestError:
                self._unhold(h.mb_id)
                raise
        except RequestError as e:
            if remote is None:  # called without the network (tests): serve's on_refused did not count it
                self._count_refusal(e)
            raise
        return {"queue": n}

    async def _on_backward(self, message: Message, remote: Any) -> dict[str, Any]:
        try:
            h = BackwardHeader.from_wire(message.header)
            compute = self._check_common(h.run_id, h.spec_hash, h.stage, "backward")
            entry = compute.peek(h.mb_id)
            fwd: ForwardHeader = entry.context
            if h.stage + 1 < len(fwd.route) and str(remote) != fwd.route[h.stage + 1]:
                raise RequestError(
                    f"backward of {h.mb_id!r} came from {remote}, not from the route's next peer {fwd.route[h.stage + 1]}"
                )
            if not compute.versions.has(entry.version):
                compute.drop(h.mb_id)
                compute.versions.evicted_refusals += 1
                self.counters["version_evicted"] += 1
                reason = (
                    f"version evicted: weight version {entry.version} of stage {compute.stage} is gone "
                    f"(max_versions={self.spec.optimizer.max_versions})"
                )
                self._report_failed(
                    fwd,
                    stage=compute.stage,
                    peer=self.peer_id,
                    reason=reason,
                    failure=Failure.VERSION_EVICTED,
                    counted_from=compute.stage + 1,
                )
                raise RequestError(reason, failure=Failure.VERSION_EVICTED)
            try:
                grad = await asyncio.to_thread(
                    self._decode, message.payload, entry.output_shape, "backward", self.config.max_grad_rms
                )
            except PoisonError as e:
                # one faulty or malicious peer must not poison the stage: ignore it for a while
                self._penalties.penalize(str(remote))
                self.counters["penalized"] += 1
                logger.warning("ignoring %s for %.0f s: %s", remote, self.config.penalty_s, e)
                raise
            self._hold(h.mb_id)
            try:
                n = self._submit(
                    "backward", str(remote), lambda waited: self._backward_task(compute, h, fwd, grad, waited)
                )
            except RequestError:
                self._unhold(h.mb_id)
                raise
        except RequestError as e:
            if remote is None:
                self._count_refusal(e)
            raise
        return {"queue": n}

    # -------------------------------------------------------------------- worker-thread tasks

    def _forward_task(
        self,
        compute: StageCompute,
        h: ForwardHeader,
        x: torch.Tensor,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        waited: float,
    ) -> None:
        """Worker thread: run one forward; any failure becomes a ``failed`` report, never silence."""
        try:
            if self._abandoned(h.trainer, h.mb_id):
                return  # cancelled, or its trainer is gone: nobody waits for it
            t0 = time.perf_counter()
            self._run_forward(compute, h, x, tokens, targets, waited)
            if h.mode == "train" and self._rate is not None:
                spent = time.perf_counter() - t0
                if compute.is_last:  # the last stage's forward task runs the backward too
                    self._rate.add(h.batch * h.seq, spent)
                else:
                    self._fwd_s[h.mb_id] = spent
                    while len(self._fwd_s) > 4096:
                        self._fwd_s.popitem(last=False)
        except (ValueError, RuntimeError) as e:  # RequestError, CodecError; RuntimeError: e.g. CUDA OOM
            compute.drop(h.mb_id)
            if not isinstance(e, RequestError):
                logger.exception("forward of %s failed on stage %d", h.mb_id, compute.stage)
            reason = str(e) if isinstance(e, RequestError) else f"compute error: {type(e).__name__}: {e}"
            self._report_failed(
                h, stage=compute.stage, peer=self.peer_id, reason=reason, failure=_failure_of(e)
            )
        finally:
            self._unhold(h.mb_id)

    def _run_forward(
        self,
        compute: StageCompute,
        h: ForwardHeader,
        x: torch.Tensor,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        waited: float,
    ) -> None:
        s = compute.stage
        if self.config.slowdown_s > 0:
            time.sleep(self.config.slowdown_s)  # the documented artificial straggler delay
        count = h.counted_from < 0 or s < h.counted_from  # a retry's gradient is added once per stage
        res = compute.forward(h.mb_id, x, h.mode, targets=targets, tokens=tokens, context=h, count=count)
        self.counters["forwards"] += 1
        stats = dict(h.stats)
        stats[f"fwd_compute_s_{s}"] = res.compute_s
        stats[f"fwd_queue_s_{s}"] = waited
        stats[f"version_{s}"] = float(res.version)
        if compute.is_last and h.mode == "train":  # its backward ran too: see _run_backward
            stats[f"applied_staleness_{s}"] = float(compute.optimizer.staleness)
        if not compute.is_last:
            nxt = h.route[s + 1]
            payload = self._codecs[0].encode(res.output, stream=(nxt, s, "act"))
            stats[f"fwd_bytes_{s}"] = float(len(payload))
            header = dataclasses.replace(h, stage=s + 1, stats=stats, sent_at=time.time())
            # if the hop fails the route broke downstream: its backward never comes, so free the stash entry
            self._send(self._deliver(FORWARD, nxt, h, header, payload, drop_from=compute), hold=h.mb_id)
            return

        # the last stage: loss, then backward (train) or the result (eval/generate)
        def report(kind: str) -> Report:
            return Report(
                run_id=h.run_id,
                mb_id=h.mb_id,
                kind=kind,  # type: ignore[arg-type]
                stage=s,
                peer=self.peer_id,
                loss=res.loss,
                n_tokens=res.n_tokens,
                version=res.version,
                stats=stats,
            )

        if h.mode == "train":
            self._send(self._report(h.trainer, report("loss")), hold=h.mb_id)
            self.counters["backwards"] += 1
            self._after_backward(compute, h, res.grad_input, stats)
        elif h.mode == "eval":
            self._send(self._report(h.trainer, report("result")), hold=h.mb_id)
        else:
            from compression import get_codec

            logits = get_codec("none").encode(res.logits_last.float())  # (B, vocab)
            self._send(self._report(h.trainer, report("result"), logits), hold=h.mb_id)

    def _backward_task(
        self, compute: StageCompute, h: BackwardHeader, fwd: ForwardHeader, grad: torch.Tensor, waited: float
    ) -> None:
        """Worker thread: run one backward; any failure becomes a ``failed`` report, never silence."""
        try:
            if self._abandoned(fwd.trainer, h.mb_id):
                compute.drop(h.mb_id)
                return
            t0 = time.perf_counter()
            self._run_backward(compute, h, fwd, grad, waited)
            if self._rate is not None:
                fwd_s = self._fwd_s.pop(h.mb_id, None)
                if fwd_s is not None:
                    self._rate.add(fwd.batch * fwd.seq, fwd_s + time.perf_counter() - t0)
        except (ValueError, RuntimeError) as e:  # VersionEvicted, RequestError, CodecError, CUDA OOM
            if isinstance(e, VersionEvicted):
                self.counters["version_evicted"] += 1
            elif not isinstance(e, RequestError):
                logger.exception("backward of %s failed on stage %d", h.mb_id, compute.stage)
            reason = str(e) if isinstance(e, RequestError) else f"compute error: {type(e).__name__}: {e}"
            self._report_failed(
                fwd,
                stage=compute.stage,
                peer=self.peer_id,
                reason=reason,
                failure=_failure_of(e),
                counted_from=compute.stage + 1,
            )
        finally:
            self._unhold(h.mb_id)

    def _run_backward(
        self, compute: StageCompute, h: BackwardHeader, fwd: ForwardHeader, grad: torch.Tensor, waited: float
    ) -> None:
        s = compute.stage
        res = compute.backward(h.mb_id, grad)
        self.counters["backwards"] += 1
        stats = dict(h.stats)
        stats[f"bwd_compute_s_{s}"] = res.compute_s
        stats[f"bwd_queue_s_{s}"] = waited
        stats[f"staleness_{s}"] = float(res.staleness)
        # the EMA of versions between forward and the step that applies the gradient, which for a
        # replica includes the wait for its round (note "applied staleness" in peer/compute.py)
        stats[f"applied_staleness_{s}"] = float(compute.optimizer.staleness)
        self._after_backward(compute, fwd, res.grad_input, stats)

    def _after_backward(
        self,
        compute: StageCompute,
        fwd: ForwardHeader,
        grad_input: torch.Tensor | None,
        stats: dict[str, float],
    ) -> None:
        """Send the input gradient to the previous stage, or report ``done`` from stage 0."""
        s = compute.stage
        if s == 0:
            self._send(
                self._report(
                    fwd.trainer,
                    Report(
                        run_id=fwd.run_id,
                        mb_id=fwd.mb_id,
                        kind="done",
                        stage=0,
                        peer=self.peer_id,
                        version=compute.version,
                        stats=stats,
                    ),
                ),
                hold=fwd.mb_id,
            )
            return
        prev = fwd.route[s - 1]
        payload = self._codecs[1].encode(grad_input, stream=(prev, s, "grad"))
        stats[f"bwd_bytes_{s}"] = float(len(payload))
        header = BackwardHeader(
            run_id=fwd.run_id, spec_hash=fwd.spec_hash, mb_id=fwd.mb_id, stage=s - 1, stats=stats
        )
        self._send(
            self._deliver(BACKWARD, fwd.route[header.stage], fwd, header, payload, drop_from=None),
            hold=fwd.mb_id,
        )

    # ---------------------------------------------------------------------- network (loop side)

    def _send(self, coro: Coroutine[Any, Any, Any], *, hold: str | None = None) -> None:
        """Hand a coroutine from any thread to the event loop; it is tracked until done. ``hold``: the
        micro-batch it carries counts as held here until it is done (note "holding")."""
        loop = self._loop
        assert loop is not None
        if hold is not None:
            self._hold(hold)

        def _schedule() -> None:
            fut = asyncio.ensure_future(coro)
            self._sends.add(fut)
            fut.add_done_callback(self._sends.discard)
            if hold is not None:
                fut.add_done_callback(lambda _: self._unhold(hold))

        if _running_loop() is loop:
            _schedule()
        else:
            try:
                loop.call_soon_threadsafe(_schedule)
            except RuntimeError:  # the loop is closed: we are shutting down
                coro.close()
                if hold is not None:
                    self._unhold(hold)

    # Holding (note "holding"): a micro-batch is *held* here from the moment its FORWARD or BACKWARD
    # is queued until the last message this peer sends about it (next hop acknowledged, report
    # delivered) is done. Answers to a trainer's INFO probe list the held ids (swarm/wire/protocol.py).

    def _hold(self, mb_id: str) -> None:
        with self._held_lock:
            self._held[mb_id] += 1

    def _unhold(self, mb_id: str) -> None:
        with self._held_lock:
            left = self._held[mb_id] - 1
            if left > 0:
                self._held[mb_id] = left
            else:
                self._held.pop(mb_id, None)

    # Trainers that vanish (note "trainers that vanish"): a trainer that cancels micro-batches, or
    # cannot be reached by a report or by the INFO probe of a peer whose stash holds its
    # micro-batches (probed after _TRAINER_QUIET_S without news), gets them dropped here at once:
    # stash entries, queued tasks, sends not yet made. Nothing waits for the stash TTL.

    def _abandoned(self, trainer: str, mb_id: str) -> bool:
        return trainer in self._gone or (trainer, mb_id) in self._cancelled

    def _trainer_unreachable(self, trainer: str) -> None:
        if trainer in self._gone:
            return
        self._gone[trainer] = time.monotonic()
        while len(self._gone) > _GONE_TRAINERS:
            self._gone.popitem(last=False)
        self._trainer_heard.pop(trainer, None)
        logger.info("trainer %s cannot be reached; dropping its micro-batches", trainer)
        self._spawn(self._drop_trainer(trainer))

    async def _drop_trainer(self, trainer: str) -> None:
        compute = self._compute
        if compute is None:
            return
        with compute.lock:
            ids = [e.mb_id for e in compute.stash if getattr(e.context, "trainer", None) == trainer]
        dropped = await asyncio.to_thread(lambda: sum(compute.drop(i) is not None for i in ids))
        self.counters["trainer_gone"] += dropped
        logger.info("trainer %s: dropped %d stashed micro-batch(es) of it", trainer, dropped)

    async def _check_trainers(self) -> None:
        """Probe the trainers whose stash entries here have waited ``_TRAINER_QUIET_S`` without news."""
        compute = self._compute
        if compute is None or self._p2p is None:
            return
        now = time.monotonic()
        for trainer in list(self._trainer_heard):  # bounded: forget trainers quiet for a minute
            if now - self._trainer_heard[trainer] > 60.0:
                del self._trainer_heard[trainer]
        with compute.lock:
            entries = list(compute.stash)
        stash_now = compute.stash.clock()
        quiet = {
            e.context.trainer
            for e in entries
            if isinstance(e.context, ForwardHeader)
            and stash_now - e.created_at >= _TRAINER_QUIET_S
            and now - self._trainer_heard.get(e.context.trainer, -1e18) >= _TRAINER_QUIET_S
        }
        for trainer in sorted(quiet - self._probing_trainers - set(self._gone)):
            self._probing_trainers.add(trainer)
            self._spawn(self._probe_trainer(trainer))

    async def _probe_trainer(self, trainer: str) -> None:
        try:
            await call(self._p2p, trainer, INFO, Message({}), timeout_s=_PING_TIMEOUT_S, auth=self.auth)
            self._trainer_heard[trainer] = time.monotonic()
        except RequestError:  # it answered (with a refusal): alive
            self._trainer_heard[trainer] = time.monotonic()
        except PeerFailure as e:
            if e.reason == "unreachable" and not _no_handler(str(e)):
                self._trainer_unreachable(trainer)
            elif e.reason == "unreachable":  # an older trainer without INFO: alive
                self._trainer_heard[trainer] = time.monotonic()
        finally:
            self._probing_trainers.discard(trainer)

    async def _deliver(
        self,
        name: str,
        peer: str,
        origin: ForwardHeader,
        header: ForwardHeader | BackwardHeader,
        payload: bytes,
        *,
        drop_from: StageCompute | None,
    ) -> None:
        """Send one hop of ``origin``'s micro-batch; on failure count it, drop its stash entry from
        ``drop_from`` (if given) and report it to the trainer, naming the hop's stage and peer."""
        if self._abandoned(origin.trainer, origin.mb_id):
            if drop_from is not None:
                drop_from.drop(origin.mb_id)
            return
        try:
            await call(
                self._p2p,
                peer,
                name,
                Message(header.to_wire(), payload),
                timeout_s=self.config.request_timeout_s,
                auth=self.auth,
            )
        except (PeerFailure, RequestError) as e:
            self.counters["failed_sends"] += 1
            if drop_from is not None:
                drop_from.drop(origin.mb_id)
            # a gradient that did not reach stage header.stage was already added by the sender's stage
            counted = header.stage + 1 if name == BACKWARD else -1
            await self._report(
                origin.trainer,
                self._failed(
                    origin,
                    stage=header.stage,
                    peer=peer,
                    reason=str(e),
                    failure=e.failure or Failure.ERROR,
                    counted_from=counted,
                ),
            )

    def _failed(
        self,
        h: ForwardHeader,
        *,
        stage: int,
        peer: str,
        reason: str,
        failure: Failure,
        counted_from: int = -1,
    ) -> Report:
        """A ``failed`` report; ``counted_from``: in the backward phase, the first stage of those that
        already added this micro-batch's gradient (all later ones did too), so a retry skips them."""
        return Report(
            run_id=h.run_id,
            mb_id=h.mb_id,
            kind="failed",
            stage=stage,
            peer=peer,
            reason=reason[:2000],
            failure=failure,
            counted_from=counted_from if 0 <= counted_from < len(h.route) else -1,
        )

    def _report_failed(
        self,
        h: ForwardHeader,
        *,
        stage: int,
        peer: str,
        reason: str,
        failure: Failure,
        counted_from: int = -1,
    ) -> None:
        if self._abandoned(h.trainer, h.mb_id):
            return  # nobody waits for it
        report = self._failed(
            h, stage=stage, peer=peer, reason=reason, failure=failure, counted_from=counted_from
        )
        self._send(self._report(h.trainer, report), hold=h.mb_id)

    async def _report(self, trainer: str, report: Report, payload: bytes = b"") -> None:
        if self._p2p is None:
            return
        try:
            await call(
                self._p2p,
                trainer,
                REPORT,
                Message(report.to_wire(), payload),
                timeout_s=self.config.request_timeout_s,
                auth=self.auth,
            )
        except (PeerFailure, RequestError) as e:
            logger.info(
                "report %s of %s to trainer %s was not delivered: %s", report.kind, report.mb_id, trainer, e
            )
            if isinstance(e, PeerFailure) and e.reason == "unreachable" and not _no_handler(str(e)):
                self._trainer_unreachable(trainer)  # note "trainers that vanish"
            return
        self._trainer_heard[trainer] = time.monotonic()


def _failure_of(e: Exception) -> Failure:
    """The failure code of an exception raised by this peer's own forward or backward: a refusal's
    own code (``version_evicted``), else ``error`` (note "failure codes" in swarm/wire/protocol.py)."""
    return (e.failure if isinstance(e, RequestError) else None) or Failure.ERROR


_SOURCES = {
    "peer": "a live replica",
    "keeper": "the keeper's snapshot",
    "checkpoint": "the checkpoint",
    "seed": "the spec's seed",
    "weights": "the checkpoint given with --weights",
}


class PoisonError(RequestError):
    """A tensor from a peer holds NaN/Inf or absurd magnitudes."""


def _decodable_codecs() -> tuple[str, ...]:
    """Names of every codec this build decodes (what the record's ``codecs`` field announces)."""
    from compression import available_codecs

    return tuple(name for name, _, _ in available_codecs())[:16]


def _no_handler(text: str) -> bool:
    """A call failed because the remote serves no such protocol (it is alive, just older)."""
    text = text.lower()
    return "protocol not supported" in text or "protocols not supported" in text


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
