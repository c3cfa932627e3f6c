"""Where a stage peer's stage and its state come from: picking the stage, building it, loading it.

State comes from (first that works): a live same-stage replica (hivemind's load_state_from_peers),
a keeper's snapshot, this peer's --checkpoint-dir, the spec's seed -- or, for a --from-pretrained
run, the --weights checkpoint (digest-checked). A trained run never silently restarts a stage from
the seed: ``StageStateLost`` unless ``start_fresh`` (swarm/dht/snapshots.py, swarm/tools/keeper.py).

``StageJoining`` is one of ``StagePeer``'s parts (peer/server.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from peer.averaging import StageAverager
from peer.checkpoint import Checkpoint, load_checkpoint
from peer.compute import StageCompute
from peer.state_stream import flatten_into, shared_empty
from peer.throughput import ServedRate, measure_throughput, store_throughput
from swarm.errors import ConfigError, RequestError, SwarmError

__all__ = ["StageJoining"]

logger = logging.getLogger(__name__)

_SOURCES = {
    "peer": "a live replica",
    "keeper": "the keeper's snapshot",
    "checkpoint": "the checkpoint",
    "seed": "the spec's seed",
    "weights": "the checkpoint given with --weights",
}
_STATE_ATTEMPTS = 3  # state downloads tried when a live replica or a keeper should answer


class StageJoining:
    """Joining a stage and loading its state (a part of ``StagePeer``: see peer/server.py)."""

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

    async def _join_stage(self, stage: int, resume: Checkpoint | None) -> None:
        """Build the stage, load its state (donor > checkpoint > seed), start its averager and rounds."""
        self.state = "joining"
        compute = await self._build_stage(stage)
        await self._announce()
        await self._start_averager(compute)
        t_state = time.monotonic()
        logger.info(
            "stage %d built, averager ready after %.1f s; loading its state",
            stage,
            t_state - self._started_at,
        )
        await self._refresh_authorized()
        await self._load_state(compute, resume)
        logger.info(
            "stage %d: state from %s (version %d) in %.1f s",
            stage,
            _SOURCES.get(self.loaded_from, "the spec's seed"),
            compute.version,
            time.monotonic() - t_state,
        )
        self._averager.share_state(True, priority=compute.version)
        compute.set_replicas(await self._live_replicas(stage))
        self._start_rounds(compute)
        self._notify_queue()

    async def _build_stage(self, stage: int) -> StageCompute:
        """Measure this machine on ``stage`` and build it (with its initial weights); not yet loaded."""
        self.throughput = await self._measure(stage)
        # note "served throughput" (peer/throughput.py): the measurement only seeds what is announced
        self._rate = (
            ServedRate(self.throughput, now=time.monotonic()) if self.config.throughput is None else None
        )
        self._fwd_s.clear()
        self._fwd_stats.clear()
        initial = await self._initial_weights(stage)
        compute = await asyncio.to_thread(
            StageCompute,
            self.spec,
            stage,
            device=self.device,
            initial=initial,
            emulate_s=self.config.emulate_compute_s,
        )
        del initial  # the compute holds its own copy
        compute.on_gate_change = self._notify_queue
        self._compute = compute
        return compute

    async def _start_averager(self, compute: StageCompute) -> None:
        # the state's shapes only: a copy of the state (export_state) would cost 3x the stage's memory here
        shapes = [t.shape for t in compute.optimizer.state_tensors()]
        self._averager = StageAverager.create(
            self._dht,
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            stage=compute.stage,
            shapes=shapes,
            grad_shapes=[compute.optimizer.params[n].shape for n in compute.optimizer.names],
            state_fn=self._donor_state,
            min_matchmaking_time_s=self.config.averaging_matchmaking_s,
        )
        await asyncio.to_thread(self._averager.wait_ready, 30.0)

    async def _load_state(self, compute: StageCompute, resume: Checkpoint | None) -> None:
        """The stage's state from a live replica, else what ``_restore_stage`` finds."""
        stage = compute.stage
        records = await asyncio.to_thread(self._membership.stage_records, stage)
        others = [r for pid, r in records.items() if pid != self.peer_id and r.state == "online"]
        # a dead replica's donor declaration outlives it by up to 10 s and may hold up an attempt: retry
        # when someone (a live replica or a keeper) should be able to send the state
        attempts = _STATE_ATTEMPTS if others or await self._keeper_holds(stage) else 1
        loaded, snapshot = await self._download_state(compute, attempts)
        if not loaded:
            await self._restore_stage(compute, resume, snapshot, others=len(others))

    async def _download_state(self, compute: StageCompute, attempts: int) -> tuple[bool, Any]:
        """Whether a live replica's state was adopted, and a keeper's snapshot (the fallback when no
        live replica answers; swarm/tools/keeper.py) if one came instead."""
        stage, snapshot = compute.stage, None
        for attempt in range(attempts):
            loaded = await asyncio.to_thread(self._averager.load_state, self.config.state_timeout_s)
            if loaded is not None and isinstance(loaded[0].get("snapshot"), dict):
                # donors are tried by priority and a keeper's is below every live peer's: none answered
                snapshot = loaded
                if await self._live_replicas(stage) <= 1:
                    break  # no other replica is alive: retrying would only reach the keeper again
            elif loaded is not None:
                try:
                    self._check_initial(stage, loaded, "a live replica")
                    compute.import_state(*loaded)
                    self.loaded_from = "peer"
                    return True, snapshot
                except RequestError as e:
                    logger.warning("refused the state a donor of stage %d sent: %s", stage, e)
            if attempt + 1 < attempts:
                await asyncio.sleep(1.0)
        return False, snapshot

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
        stage = compute.stage
        evidence, seen = await self._run_history(stage)
        if not self._restore_newest(compute, resume, snapshot):
            await self._start_initial(stage, evidence)
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

    async def _run_history(self, stage: int) -> tuple[Any, int]:
        """Whether the run has trained (``training_evidence``, None if not or unknown) and the newest
        version of ``stage`` anyone saw (-1 if none), from the DHT."""
        from swarm.dht.snapshots import last_seen_version, training_evidence

        try:
            records = await asyncio.to_thread(self._membership.all_stage_records)
            progress = await asyncio.to_thread(self._membership.progress)
            indexes = await asyncio.to_thread(self._membership.snapshot_indexes)
            mine = {pid: r for pid, r in records[stage].items() if pid != self.peer_id}
            return training_evidence(records, progress, indexes), last_seen_version(stage, mine, indexes)
        except (SwarmError, OSError) as e:
            logger.warning("could not read the run's history from the DHT: %s", e)
            return None, -1

    def _restore_newest(self, compute: StageCompute, resume: Checkpoint | None, snapshot: Any) -> bool:
        """Import the newest of a keeper's snapshot and this peer's checkpoint that is accepted."""
        from swarm.dht.snapshots import Restorable, choose_newest

        stage = compute.stage
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
                return True
            except RequestError as e:
                logger.warning("refused the %s state of stage %d: %s", best.source, stage, e)
                candidates.remove(best)
        return False

    async def _start_initial(self, stage: int, evidence: Any) -> None:
        """Nothing to restore: keep the initial weights (seed or --weights) if that is allowed, else
        stop the averager and raise ``StageStateLost`` saying what was lost and what to do."""
        from swarm.dht.snapshots import StageStateLost, lost_state_message

        self.loaded_from, problem = self._initial_source(stage)
        if evidence is not None and not self.config.start_fresh:
            problem = lost_state_message(self.spec.run_id, stage, evidence)
        if problem is not None:
            if self._averager is not None:
                await asyncio.to_thread(self._averager.shutdown)
                self._averager = None
            raise StageStateLost(problem)

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

    def _donor_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a joining peer downloads (called in hivemind's fetcher thread)."""
        compute = self._compute
        if compute is None or self.state not in ("online", "leaving"):
            raise RequestError("this peer holds no stage state to share yet")
        self._stage_hint()  # a joiner (or a lagging replica) of this stage: count the replicas again soon
        return compute.export_state(copy=lambda live: [flatten_into(live, shared_empty)])

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
