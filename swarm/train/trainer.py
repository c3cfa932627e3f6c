"""The trainer: holds data, no weights, and drives micro-batches through the swarm's stages.

Run it::

    swarm train --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID --run demo --steps 100 --out runs/demo

or from Python::

    from swarm.train.trainer import Trainer, TrainerConfig
    summary = Trainer(TrainerConfig(initial_peers=(maddr,), run_id="demo", steps=100)).train()

One micro-batch (see swarm/wire/protocol.py for the wire side)
--------------------------------------------------------
1. ``Router.route`` draws one peer per stage (stochastic wiring, swarm/client/routing.py).
2. ``FORWARD`` with the token ids (and targets) goes to the stage-0 peer of the route; the peers pass
   activations along the route and gradients back by themselves.
3. Peers send ``REPORT`` s to this trainer: ``loss`` from the last stage, ``done`` from stage 0 once
   the gradients reached every stage (``result`` in eval/generate mode), or ``failed`` naming the
   hop that broke. Silence is never waited out (note "failure detection", below).
4. A broken route closes the attempt; the micro-batch is re-sent on a new route (new ``mb_id``,
   only token ids travel again) up to ``max_attempts`` times, then counted as dropped. The ledger
   (swarm/train/accounting.py) keeps ``opened == completed + dropped + in flight + pending``.

Failures (note "failure classes", at ``REACTIONS``)
---------------------------------------------------
Every failure arrives with its code (``swarm.errors.Failure``: in a refusal, a ``failed`` report or a
``PeerFailure``; note "failure codes" in swarm/wire/protocol.py), and ``REACTIONS`` says what each
does to the peer it names: ``unreachable``, ``timeout`` and ``error`` back off from it (exponential,
routing.Router.on_failure); ``busy`` pauses it briefly; staleness refusals (``version_evicted``,
``stash_expired``) and ``refused`` name no culprit. A peer found
unreachable closes every other attempt routed through it at once (they could only time out), and a
stage-0 peer that never acknowledged a micro-batch before its deadline is the one blamed for it.
Per-peer in-flight counts are capped (note "staleness cap" in swarm/client/routing.py) so that peers keep
the weight version a micro-batch's backward needs.

Failure detection (note "failure detection"; the pure logic is swarm/client/liveness.py)
--------------------------------------------------------------------------------
A peer that dies takes the micro-batches it held with it, and nobody reports that. So: every report,
acknowledgement and probe answer counts as having heard from its peer; a peer that holds micro-batches
of ours and was silent for ``liveness.silence_s`` (1 s), or whose record left its stage or says
``leaving`` at a refresh, is probed with ``INFO``; a refused connection (or repeated probe timeouts)
closes every attempt through it at once, and the peer is kept out of routes for
``liveness.dead_hold_s`` (its record outlives it by up to its TTL). Past an attempt's adaptive check
time (the retransmit timeout of completed micro-batches' round trips), the route's peers are asked
whether they still hold it; if none does in two rounds, it is re-sent. The hard deadline (note
"deadline" in swarm/client/routing.py) only remains for peers that answer but never finish. Every attempt the
trainer closes is cancelled at the peers of its route (``CANCEL``), so none of them keeps its stash
entry until the TTL (in sync mode a stage cannot step while one waits).

Counted stages (note "counted stages")
--------------------------------------
A backward that fails at stage i (its weight version was evicted, a send failed) has already added
the micro-batch's gradient at every later stage: they ran their backward first. The ``failed`` report
says so (``counted_from = i + 1``), and the retry's forward header carries ``counted_from``: those
stages run the retry's forward and backward as usual (stage i needs the gradient) but add nothing to
their optimizers, so a retry never counts one micro-batch twice and stage step counts stay equal.

Steps (note "trainer step")
---------------------------
A stage steps once every ``optimizer.accumulate`` micro-batches *of the stage*, whatever its number
of replicas (peer/replicas.py: replicas combine their gradients in a round and step as one); a
trainer *step* is the same amount of work seen from here: ``accumulate`` completed training
micro-batches, so trainer steps, stage versions and exported step counts agree.
``mode: async`` keeps up to ``max_inflight`` micro-batches in the swarm; ``mode: sync`` sends
exactly ``accumulate`` micro-batches, waits until every one of them is completed or dropped, and
only then sends the next ``accumulate`` (so peers step in lock-step).

Resuming (note "resume")
------------------------
``resume=True`` (``swarm train --resume OUT``) continues the run whose trainer wrote ``OUT`` and was
killed or stopped: :func:`read_resume_state` reads ``OUT/metrics.jsonl`` (its first ``start`` event and
its last step record) and the trainer continues from that step, token count and data position (the
number of micro-batches drawn from the seeded data stream, skipped again on resume), with the same
trainer id and data seed, appending to the metrics file. The steps (or tokens) to reach are the same
totals as before unless given again. Anything that does not fit (no such directory, no start record, a
different run, spec, data source or seed, nothing left to do) raises ``ConfigError`` before anything is
written. Micro-batches the old trainer had in flight are lost with it (their peers drop them: note
"trainers that vanish" in peer/server.py).

One asyncio loop owns everything: the report handler, the sending tasks, and two background loops
(refreshing stage records from the DHT, publishing this trainer's progress). DHT calls are blocking
and go through ``asyncio.to_thread``; ``Membership`` serialises them. Every background task is
owned by :class:`_Tasks` and cancelled in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import secrets
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from swarm.client.link import SwarmLink
from swarm.client.liveness import HoldCheck, Liveness, LivenessConfig, RttEstimator, hold_verdict, next_check
from swarm.client.routing import NoPeersError, Router, RoutingConfig, staleness_caps
from swarm.errors import ConfigError, Failure, PeerFailure, RequestError, StageUnavailableError
from swarm.run.fields import check_fields, integer, number
from swarm.train.accounting import Attempt, Ledger, MicroBatch
from swarm.train.data import DataConfig, TokenData, build_data
from swarm.train.logging_sinks import make_sinks
from swarm.train.metrics import (
    MetricsWriter,
    ProgressDisplay,
    ProgressSnapshot,
    format_summary,
    plot_loss,
    read_metrics,
    step_record,
    summarize,
)
from swarm.train.pacing import InflightPacer

if TYPE_CHECKING:
    from swarm.dht.records import PeerRecord
    from swarm.run.spec import RunSpec
    from swarm.wire.protocol import Report

logger = logging.getLogger(__name__)

__all__ = [
    "TrainerConfig",
    "Trainer",
    "ResumeState",
    "read_resume_state",
    "service_seconds",
    "REACTIONS",
    "Reaction",
    "inflight_rule_of_thumb",
]


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Everything one trainer needs; ``swarm train`` parses its flags into this."""

    initial_peers: tuple[str, ...]
    """Multiaddrs (with /p2p/) of any peer of the swarm, e.g. what `swarm init` printed."""
    run_id: str
    """The run to train; its spec (model, stages, optimizer) is read from the DHT."""
    data: DataConfig = field(default_factory=DataConfig)
    """Text source and split (default: this machine's Python standard library sources)."""
    steps: int | None = integer(None, lo=1, optional=True, hint="Give a positive step count (--steps).")
    """Trainer steps to run (see note "trainer step"); exclusive with ``tokens``; both None = 100."""
    tokens: int | None = integer(None, lo=1, optional=True, hint="Give a positive token count (--tokens).")
    """Tokens to train on instead of a step count (rounded up to whole micro-batches)."""
    max_inflight: int = integer(8, lo=1, hint="Use e.g. 8.")
    """The most micro-batches in the swarm at once (async mode). With ``pacing`` (the default) the
    trainer keeps between the number of stages and this many, as many as keep the swarm busy
    (swarm/train/pacing.py, note "pacing"); without it, exactly this many. More in flight overlaps compute
    and transfers on more peers, but every one beyond what the swarm needs only waits in a queue and
    makes gradients staler (BENCHMARKS.md, "Convergence": one peer per stage ends at 1.003 of one
    process's held-out loss paced, 1.04 with 4 in flight). Pacing costs throughput where peers share
    their machine with other work (BENCHMARKS.md, "Demo throughput"): ``--fixed-inflight`` trades
    quality back for it."""
    pacing: bool = True
    """Adapt the in-flight count to the swarm (note "pacing"); False keeps ``max_inflight`` in flight."""
    max_attempts: int = integer(4, lo=1, hint="Use e.g. 4 (1 = never re-send).")
    """Routes one micro-batch may try before it is dropped (1 = never re-send)."""
    out_dir: str | None = None
    """Where metrics.jsonl, loss.png and summary.json go; None = write no files."""
    seed: int = 0
    """Seed of data sampling and routing; give each trainer of a run its own to read different text."""
    eval_every: int = integer(0, lo=0, hint="Use 0 (never) or a step count.")
    """Evaluate held-out loss through the swarm every N trainer steps (and at the end); 0 = never."""
    eval_batches: int = integer(2, lo=1, hint="Use e.g. 2.")
    """Held-out micro-batches per evaluation."""
    progress_interval_s: float = number(10.0, gt=0.0, hint="Give a positive number of seconds.")
    """Seconds between progress lines when the output is not a terminal."""
    publish_every_s: float = number(5.0, gt=0.0, hint="Give a positive number of seconds.")
    """Seconds between publications of this trainer's progress to the DHT (`swarm status` reads it)."""
    refresh_every_s: float = number(2.0, gt=0.0, hint="Give a positive number of seconds.")
    """Seconds between re-reads of the stage peers' records."""
    spec_timeout_s: float = number(60.0, gt=0.0, hint="Give a positive number of seconds.")
    """How long to wait for the run spec to appear in the DHT."""
    call_timeout_s: float = number(5.0, gt=0.0, hint="Give a positive number of seconds.")
    """Timeout of the FORWARD call to a stage-0 peer: it only acknowledges validation and queueing,
    so raise it only for very slow links (a timeout backs off from that peer)."""
    drain_timeout_s: float = number(120.0, gt=0.0, hint="Give a positive number of seconds.")
    """At the end, how long to wait for micro-batches still in flight before dropping them."""
    stage_wait_s: float | None = number(
        None, gt=0.0, optional=True, hint="Give seconds, or None to wait forever."
    )
    """Give up when a stage has had no peer for this long; None = wait forever (with messages)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    """Failure detection: probes of silent peers, holding checks (note "failure detection")."""
    host_maddrs: tuple[str, ...] = ()
    """Where this trainer listens for reports; empty = loopback only."""
    trainer_id: str | None = None
    """Name under which progress is published; None = ``trainer-<random>``."""
    quiet: bool = False
    """No progress line and no printed summary (files are still written)."""
    log: tuple[str, ...] = ()
    """Extra metric sinks besides metrics.jsonl: "tensorboard" and/or "wandb" (optional packages;
    W&B runs offline when no API key is configured). Empty = JSONL only."""
    resume: bool = False
    """Continue the run this trainer's ``out_dir`` holds (note "resume"): its step, tokens, data position,
    trainer id and seed; metrics are appended. ``steps``/``tokens`` (totals) default to the old target."""
    secret: bytes | None = field(default=None, repr=False)
    """Join secret of a private run (``swarm.dht.auth.load_secret``: --secret-file or SWARMPIPE_SECRET);
    None for public runs. See SECURITY.md."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.initial_peers, str):
            set_(self, "initial_peers", (self.initial_peers,))
        set_(self, "initial_peers", tuple(self.initial_peers))
        set_(self, "host_maddrs", tuple(self.host_maddrs))
        set_(self, "log", (self.log,) if isinstance(self.log, str) else tuple(self.log))
        if not self.initial_peers:
            raise ConfigError(
                "the trainer needs --initial-peers: the address `swarm init` printed "
                "(e.g. /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID)"
            )
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigError(f"run_id={self.run_id!r} must name the run to train (--run)")
        if self.steps is not None and self.tokens is not None:
            raise ConfigError(
                f"give either steps ({self.steps}) or tokens ({self.tokens}), not both; "
                "drop one of --steps / --tokens"
            )
        check_fields(self)
        if self.resume and not self.out_dir:
            raise ConfigError(
                "resume=True needs out_dir: the directory of the run to continue (swarm train --resume OUT)"
            )
        if self.trainer_id is not None and not (
            isinstance(self.trainer_id, str)
            and 0 < len(self.trainer_id) <= 64
            and self.trainer_id[0].isalnum()
        ):
            raise ConfigError(
                f"trainer_id={self.trainer_id!r} must be 1-64 characters starting with a letter or digit"
            )


@dataclass(frozen=True)
class Reaction:
    """What a failure does to the peer it names (note "failure classes")."""

    backoff: bool = False  # the peer is suspect: exponential backoff (routing.Router.on_failure)
    pause: bool = False  # its queue is full: a short pause, no failure counted (routing.Router.on_busy)
    dead: bool = False  # most likely dead: no CANCEL to it, and every other attempt through it closes now
    names_stage: bool = True  # with no peer named, the failed stage's peer of the route is the one


# Note "failure classes": the reaction to each failure code.
#   version_evicted, stash_expired, refused: about this micro-batch (staleness, a peer joining or
#     leaving), not the peer's health: no backoff, the retry avoids it.
#   lost: no peer of its route holds it any more (note "failure detection"): names nobody.
#   timeout: a silence names nobody unless the caller names the peer (no acknowledgement).
REACTIONS: dict[Failure, Reaction] = {
    Failure.UNREACHABLE: Reaction(backoff=True, dead=True),
    Failure.TIMEOUT: Reaction(backoff=True, names_stage=False),
    Failure.ERROR: Reaction(backoff=True),
    Failure.BUSY: Reaction(pause=True),
    Failure.REFUSED: Reaction(),
    Failure.VERSION_EVICTED: Reaction(),
    Failure.STASH_EXPIRED: Reaction(),
    Failure.LOST: Reaction(),
}


def inflight_rule_of_thumb(stages: int, peers: int) -> int:
    """Micro-batches to keep in flight for ``stages`` stages served by ``peers`` peers in all."""
    return max(2 * stages, peers)


def service_seconds(stats: dict[str, float], stage: int) -> float | None:
    """Compute seconds stage ``stage`` spent on one micro-batch, from the peers' report stats.

    Peers record per-hop figures named ``fwd_compute_s_<stage>`` and ``bwd_compute_s_<stage>``
    (swarm/wire/protocol.py); missing ones count as 0, and None means the stage reported nothing.
    """
    parts = [stats.get(f"fwd_compute_s_{stage}"), stats.get(f"bwd_compute_s_{stage}")]
    known = [p for p in parts if p is not None and math.isfinite(p) and p >= 0]
    return sum(known) if known else None


@dataclass(frozen=True)
class ResumeState:
    """Where a trainer's earlier session stopped (note "resume"), read from its ``metrics.jsonl``."""

    out_dir: str
    run_id: str
    spec_hash: str
    trainer_id: str
    seed: int
    data_source: str | None
    target_steps: int
    step: int = 0
    tokens: int = 0
    data_position: int = 0
    time_s: float = 0.0


def read_resume_state(out_dir: str, *, run_id: str) -> ResumeState:
    """Read where the trainer that wrote ``out_dir`` stopped; ``ConfigError`` (naming the value, the rule
    and the next step) when there is nothing of run ``run_id`` to resume there. Reads only."""
    out = Path(out_dir)
    fresh = "or drop --resume to start a new run there"
    if not out.is_dir():
        raise ConfigError(
            f"--resume {out_dir}: no such directory; give the --out directory of the trainer to continue, {fresh}"
        )
    path = out / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    starts = [r for r in records if r.get("type") == "event" and r.get("event") == "start"]
    start = starts[-1] if starts else None  # the latest session's (a resumed one repeats the rest)
    if start is None:
        raise ConfigError(
            f"--resume {out_dir}: {path} holds no trainer start record, so no trainer ran there; "
            f"give the --out directory of the trainer to continue, {fresh}"
        )
    if start.get("run_id") != run_id:
        raise ConfigError(
            f"--resume {out_dir} was written by a trainer of run {start.get('run_id')!r}, not of run "
            f"{run_id!r} (--run); resume with --run {start.get('run_id')}, or use another --out for run {run_id!r}"
        )
    steps = [r for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    last = steps[-1] if steps else {}
    target = start.get("target_steps")
    return ResumeState(
        out_dir=str(out),
        run_id=run_id,
        spec_hash=str(start.get("spec_hash")),
        trainer_id=str(start.get("trainer")),
        seed=int(start.get("seed", 0)),
        data_source=start.get("data_source"),
        target_steps=int(target) if isinstance(target, int) else 0,
        step=int(last.get("step", 0)),
        tokens=int(last.get("tokens", 0)),
        # older files have no data position: at least every completed or dropped one was drawn
        data_position=int(
            last.get("data_position", int(last.get("completed", 0)) + int(last.get("dropped", 0)))
        ),
        time_s=float(last.get("time", 0.0) or 0.0),
    )


class _Tasks:
    """Owner of background tasks: each is cancelled and awaited in :meth:`close` (structured enough
    for Python 3.10, which has no ``asyncio.TaskGroup``). A task that crashes stops the owner's run."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.error: BaseException | None = None
        self.wake: asyncio.Event | None = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            if self.wake is not None:
                self.wake.set()

    async def close(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Step:
    """Accumulators of the trainer step in progress."""

    losses: list[float] = field(default_factory=list)
    tokens: int = 0
    stats: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    resolved: int = 0  # micro-batches of this step completed or dropped
    completed: int = 0  # micro-batches of this step completed


class Trainer:
    """Drives training micro-batches of one run through the swarm (see the module docstring).

    ``clock`` (monotonic seconds) and ``out`` (where progress and the summary go) are injectable.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        out: IO[str] | None = None,
    ):
        self.config = config
        self.trainer_id = config.trainer_id or f"trainer-{secrets.token_hex(4)}"
        self._clock = clock
        self._out = out if out is not None else sys.stderr
        self.summary: dict[str, Any] | None = None
        self.resumed: ResumeState | None = None  # note "resume"

    # ---- entry points ----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run to the configured length and return the summary (blocking; owns its event loop)."""
        return asyncio.run(self.run())

    async def run(self) -> dict[str, Any]:
        """Run to the configured length and return the summary; everything is shut down in ``finally``."""
        cfg = self.config
        if cfg.resume:  # a bad OUT fails here, before joining anything
            self._adopt(read_resume_state(cfg.out_dir, run_id=cfg.run_id))
        self.say(f"trainer {self.trainer_id}: joining run {cfg.run_id!r} via {cfg.initial_peers[0]}")
        link = await SwarmLink.open(
            initial_peers=cfg.initial_peers,
            run_id=cfg.run_id,
            host_maddrs=cfg.host_maddrs,
            spec_timeout_s=cfg.spec_timeout_s,
            secret=cfg.secret,
        )
        try:
            spec = link.spec
            data, _ = await asyncio.to_thread(
                build_data,
                cfg.data,
                seq_len=spec.model.seq_len,
                vocab_size=spec.model.vocab_size,
                pretrained=spec.pretrained,  # a checkpoint's run trains with its tokenizer
            )
            return await self.run_on(link, data)
        finally:
            await link.close()

    def _adopt(self, state: ResumeState) -> None:
        self.resumed = state
        if self.config.trainer_id is None:
            self.trainer_id = state.trainer_id

    def _check_resume(self, spec: RunSpec) -> None:
        """Refuse a resume that would not continue the same run (note "resume"); writes nothing."""
        cfg, state = self.config, self.resumed
        assert state is not None
        where = f"--resume {cfg.out_dir}"
        if state.spec_hash != spec.spec_hash:
            raise ConfigError(
                f"{where} trained run {cfg.run_id!r} with spec {state.spec_hash}, but the run's spec is now "
                f"{spec.spec_hash} (the run was set up again with another spec); a resume needs the same spec, "
                "so train into a new --out instead"
            )
        if state.data_source != cfg.data.source:
            raise ConfigError(
                f"{where} read data from {state.data_source or 'the standard library'}, not "
                f"{cfg.data.source or 'the standard library'} (--data); resume with the same --data, or use a new --out"
            )
        target = self._target_steps(spec)
        if state.step >= target:
            raise ConfigError(
                f"{where} already reached step {state.step} of {target}: nothing is left to do; "
                f"pass a larger --steps (or --tokens) to train further"
            )

    def _target_steps(self, spec: RunSpec) -> int:
        cfg = self.config
        if cfg.tokens is not None:
            return math.ceil(math.ceil(cfg.tokens / spec.tokens_per_micro_batch) / spec.optimizer.accumulate)
        if cfg.steps is not None:
            return cfg.steps
        if self.resumed is not None and self.resumed.target_steps > 0:
            return self.resumed.target_steps
        return 100

    # ---- the loop -------------------------------------------------------------------------------

    def _setup(self, link: SwarmLink, data: TokenData) -> None:
        cfg, spec = self.config, link.spec
        self.link, self.spec, self.data = link, spec, data
        self.accumulate = spec.optimizer.accumulate
        self.sync = spec.optimizer.mode == "sync"
        self.tokens_per_mb = spec.tokens_per_micro_batch
        # note "staleness cap" (swarm/client/routing.py): per-peer in-flight caps, recomputed from the replica
        # counts at every refresh of the stage records (_update_caps)
        self.max_per_peer: list[int | None] = [None] * spec.num_stages
        self.cap_noted = False
        # note "pacing" (swarm/train/pacing.py): the in-flight target of async mode
        self.pacer = InflightPacer(floor=spec.num_stages, ceiling=cfg.max_inflight) if cfg.pacing else None
        self.stage_events_seen: set[tuple[str, str]] = set()  # (peer, event id) already printed
        self.target_steps = self._target_steps(spec)
        self.target_mbs = self.target_steps * self.accumulate
        seed = cfg.seed if self.resumed is None else self.resumed.seed
        self.ledger = Ledger(tag=f"{self.trainer_id}.{secrets.token_hex(3)}", max_attempts=cfg.max_attempts)
        self.router = Router(cfg.routing, clock=self._clock, rng=random.Random(seed))
        live = cfg.liveness
        self.liveness = Liveness(live)  # note "failure detection"
        self.rtt = RttEstimator(initial_s=live.initial_rto_s, min_s=live.min_rto_s, max_s=live.max_rto_s)
        self.checks: dict[str, HoldCheck] = {}  # mb_id of an acknowledged attempt -> its holding check
        self.dead: dict[str, float] = {}  # peer found dead -> when (kept out of routes for dead_hold_s)
        self.cancels: dict[str, list[str]] = defaultdict(list)  # peer -> closed attempts to cancel there
        self.detected: list[dict[str, Any]] = []  # peers found dead: when and how (benchmarks read it)
        self.stream = data.stream(spec.micro_batch_size, seed=seed)
        self.data_position = 0  # micro-batches drawn from the stream (note "resume")
        self.stages: list[dict[str, PeerRecord]] = [{} for _ in range(spec.num_stages)]
        self.tasks = _Tasks()
        self.wake = asyncio.Event()
        self.tasks.wake = self.wake
        self.step = 0
        self.tokens_done = 0
        self.completed_train = 0
        self.cur = _Step()
        self.window_left = 0  # sync mode: micro-batches of the current window still to open
        self.window_open = 0  # sync mode: micro-batches of the current window not yet resolved
        self.eval_round: list[int] | None = None
        self.eval_due = False
        self.last_loss: float | None = None
        self.peers_by_stage: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # EMA of the training loss of micro-batches routed through each peer (stage -> peer -> loss)
        self.peer_loss: dict[int, dict[str, float]] = defaultdict(dict)
        self.waiting_since: float | None = None
        self.last_wait_msg = -math.inf
        self.started = self._clock()
        self.first_send: float | None = None
        self.tokens_before = 0  # tokens of earlier sessions (note "resume"): not in this session's rate
        if self.resumed is not None:
            st = self.resumed
            self.step, self.tokens_done, self.tokens_before = st.step, st.tokens, st.tokens
            self.completed_train = st.step * self.accumulate
            self.started -= st.time_s  # record times continue from the earlier session's
            for _ in range(st.data_position):  # the same data stream, from where it stopped
                next(self.stream)
            self.data_position = st.data_position
        link.on_report = self._on_report
        link.on_heard = self._heard
        # wire-byte estimate for deadlines: fp32 activation + gradient per token on each link
        self.wire_bytes = 2 * (spec.num_stages - 1) * self.tokens_per_mb * spec.model.d_model * 4
        self.writer = MetricsWriter(Path(cfg.out_dir) / "metrics.jsonl") if cfg.out_dir else None
        self.sinks = make_sinks(cfg.log, cfg.out_dir, spec.run_id, spec.to_dict()) if cfg.log else None
        self.progress = None if cfg.quiet else ProgressDisplay(self._out, interval_s=cfg.progress_interval_s)

    async def run_on(self, link: SwarmLink, data: TokenData) -> dict[str, Any]:
        """Train over an already open ``link`` (the caller closes it) with ``data``; returns the summary."""
        cfg = self.config
        if cfg.resume:
            if self.resumed is None:
                self._adopt(read_resume_state(cfg.out_dir, run_id=cfg.run_id))
            self._check_resume(link.spec)
            metrics = Path(cfg.out_dir, "metrics.jsonl")
            if metrics.read_bytes()[-1:] not in (b"", b"\n"):
                with open(metrics, "a", encoding="utf-8") as f:
                    f.write("\n")  # the killed trainer's last line was cut: keep ours apart
        elif cfg.out_dir:
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            Path(cfg.out_dir, "metrics.jsonl").write_text("")  # this run's records only
        self._setup(link, data)
        resumed = self.resumed
        self._event(
            "start",
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            trainer=self.trainer_id,
            target_steps=self.target_steps,
            mode=self.spec.optimizer.mode,
            seed=cfg.seed if resumed is None else resumed.seed,
            data_source=cfg.data.source,
            **({} if resumed is None else {"resumed_step": resumed.step, "resumed_tokens": resumed.tokens}),
        )
        if resumed is not None:
            self.say(
                f"resuming at step {resumed.step}/{self.target_steps} ({resumed.tokens} tokens, data position "
                f"{resumed.data_position}); appending to {Path(cfg.out_dir, 'metrics.jsonl')}"
            )
        interrupted = True
        try:
            self.stages = await link.stage_records()
            self._update_caps()
            self.tasks.spawn(self._refresh_loop())
            self.tasks.spawn(self._publish_loop())
            if hasattr(link, "probe"):
                self.tasks.spawn(self._probe_loop())
            await self._main_loop()
            await self._drain()
            if cfg.eval_every:
                await self._final_eval()
            interrupted = False
        finally:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._cancel_inflight(), timeout=3.0)
            left = self.ledger.close_all(reason="shutdown" if not interrupted else "interrupted")
            if left:
                self.say(f"{left} micro-batches still in flight or waiting were dropped at shutdown")
            await self.tasks.close()
            self.ledger.check()
            with contextlib.suppress(PeerFailure):
                await self._publish()
            self.summary = self._finish()
            if self.writer is not None:
                self.writer.close()
            if self.sinks is not None:
                self.sinks.close()
        return self.summary

    def _raise_errors(self) -> None:
        """Re-raise a crash of a background task or of report handling (our bugs, never swallowed)."""
        if self.tasks.error is not None:
            raise self.tasks.error
        handler_error = getattr(self.link, "handler_error", None)
        if handler_error is not None:
            raise handler_error

    def _training_done(self) -> bool:
        # async: dropped micro-batches are replaced, so count completions; sync: count closed windows
        if self.sync:
            return self.step >= self.target_steps
        return self.completed_train >= self.target_mbs

    async def _main_loop(self) -> None:
        while not self._training_done() or self.eval_round is not None:
            self._raise_errors()
            now = self._clock()
            self._expire(now)
            self._flush_cancels()
            self._fill(now, open_new=not self._training_done())
            self._show()
            await self._wait(now)

    def _expire(self, now: float) -> None:
        """Fail attempts past their deadline. One whose stage-0 peer never even acknowledged it
        names that peer (it is hanging or gone); otherwise the silence names nobody."""
        for attempt in self.ledger.expired(now):
            if attempt.acked:
                self._fail(attempt, reason=Failure.TIMEOUT, stage=None, peer=None)
            else:
                self._fail(
                    attempt,
                    reason=Failure.TIMEOUT,
                    stage=0,
                    peer=attempt.route[0],
                    detail="no acknowledgement",
                )

    async def _drain(self) -> None:
        """Wait for micro-batches still in flight (extra work opened near the end) to resolve."""
        deadline = self._clock() + self.config.drain_timeout_s
        while (self.ledger.inflight() or self.ledger.n_pending()) and self._clock() < deadline:
            self._raise_errors()
            now = self._clock()
            self._expire(now)
            self._flush_cancels()
            self._fill(now, open_new=False)
            self._show()
            await self._wait(now)

    async def _final_eval(self) -> None:
        self._open_eval()
        while self.eval_round is not None:
            self._raise_errors()
            now = self._clock()
            self._expire(now)
            self._flush_cancels()
            self._fill(now, open_new=False)
            await self._wait(now)

    async def _wait(self, now: float) -> None:
        """Sleep until a report, a send outcome or the nearest deadline (at most 0.5 s)."""
        timeout = 0.5
        expiring = [a.deadline for a in self.ledger.expired(math.inf)]
        if expiring:
            timeout = min(timeout, max(0.0, min(expiring) - now))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=timeout)
        self.wake.clear()

    # ---- filling the pipeline ---------------------------------------------------------------------

    def _train_quota(self) -> int:
        """How many new training micro-batches may be opened now."""
        t = self.ledger
        outstanding = t.inflight("train") + sum(1 for mb in t.pending() if mb.kind == "train")
        if self.sync:
            if self.window_open == 0 and self.window_left == 0 and self.step < self.target_steps:
                self.window_left = self.accumulate
            return self.window_left
        return max(0, self.target_mbs - self.completed_train - outstanding)

    def _next_micro_batch(self, open_new: bool) -> MicroBatch | None:
        for mb in self.ledger.pending():  # retries and evaluations first, oldest first
            return mb
        if not open_new or self._train_quota() <= 0:
            return None
        tokens, targets = next(self.stream)  # (B, T), (B, T)
        self.data_position += 1
        data = {"tokens": tokens, "targets": targets, "avoid": set()}
        if self.sync:
            data["window"] = (
                self.step
            )  # the window being filled (peers close a replica's share on a newer one)
        mb = self.ledger.open("train", tokens.numel(), data=data)
        if self.sync:
            self.window_left -= 1
            self.window_open += 1
        return mb

    def _fill(self, now: float, *, open_new: bool = True) -> None:
        if self.eval_due and self.eval_round is None:
            self._open_eval()
        self._send_more(now, open_new)
        if self.pacer is not None:
            self.pacer.track(now, self.ledger.inflight())

    def _send_more(self, now: float, open_new: bool) -> None:
        while self.ledger.inflight() < self.inflight_target():
            mb = self._next_micro_batch(open_new)
            if mb is None:
                return
            try:
                route = self.router.route(
                    self._routable(now), avoid=frozenset(mb.data["avoid"]), max_per_peer=self.max_per_peer
                )
            except NoPeersError as e:
                if e.reason != "saturated":  # saturated: every peer has enough of ours; wait for completions
                    self._stage_unavailable(e, now)
                return
            self._stage_available(now)
            timeout = self.router.deadline_s(
                route, self.stages, n_tokens=mb.n_tokens, wire_bytes=self.wire_bytes
            )
            attempt = self.ledger.start_attempt(mb.index, route, now=now, timeout_s=timeout)
            for pid in route:
                self.liveness.track(pid, now)
            if self.first_send is None:
                self.first_send = now
            self.tasks.spawn(self._send(attempt, mb))

    async def _send(self, attempt: Attempt, mb: MicroBatch) -> None:
        mode = "train" if mb.kind == "train" else mb.kind
        try:
            await self.link.send_forward(
                route=attempt.route,
                mb_id=attempt.mb_id,
                mode=mode,
                tokens=mb.data["tokens"],
                targets=mb.data["targets"],
                timeout_s=self.config.call_timeout_s,
                counted_from=mb.data.get("counted_from", -1),
                window=mb.data.get("window", -1),
            )
            attempt.acked = True
            now = self._clock()
            self.liveness.heard(attempt.route[0], now)
            if attempt.state == "inflight":  # note "failure detection": the adaptive check time
                self.checks[attempt.mb_id] = HoldCheck(check_at=attempt.started + self.rtt.rto_s)
        except PeerFailure as e:
            self._fail(attempt, reason=e.failure, stage=0, peer=attempt.route[0], detail=str(e))
        except RequestError as e:  # stage 0 refused it: busy, or anything else is a refusal of this one
            reason = Failure.BUSY if e.failure is Failure.BUSY else Failure.REFUSED
            self._fail(attempt, reason=reason, stage=0, peer=attempt.route[0], detail=str(e))
        self.wake.set()

    def _stage_unavailable(self, e: NoPeersError, now: float) -> None:
        if self.waiting_since is None:
            self.waiting_since = now
            self._event("stage_unavailable", stage=e.stage, reason=e.reason)
        if now - self.last_wait_msg >= 30.0:
            self.last_wait_msg = now
            if e.reason == "empty":
                self.say(
                    f"waiting: stage {e.stage} of run {self.spec.run_id!r} has no online peer. Start one with:\n"
                    f"  swarm peer --initial-peers {self.config.initial_peers[0]} --run {self.spec.run_id} "
                    f"--stage {e.stage}"
                )
            else:
                self.say(f"waiting: {e}; training continues when one of them is back")
        if self.config.stage_wait_s is not None and now - self.waiting_since > self.config.stage_wait_s:
            raise StageUnavailableError(
                f"stage {e.stage} of run {self.spec.run_id!r} had no usable peer for "
                f"{now - self.waiting_since:.0f} s (stage_wait_s = {self.config.stage_wait_s}); start a peer "
                f"with `swarm peer --initial-peers {self.config.initial_peers[0]} --run {self.spec.run_id} "
                f"--stage {e.stage}` and run the trainer again"
            )

    def _stage_available(self, now: float) -> None:
        if self.waiting_since is not None:
            self._event("stage_available", waited_s=round(now - self.waiting_since, 2))
            self.say(
                f"every stage has peers again after {now - self.waiting_since:.1f} s; training continues"
            )
            self.waiting_since = None
            self.last_wait_msg = -math.inf

    # ---- outcomes -------------------------------------------------------------------------------

    def _on_report(self, report: Report, payload: bytes) -> None:
        outcome = self.ledger.on_report(report)
        attempt, mb = outcome.attempt, outcome.micro_batch
        if outcome.event == "completed":
            assert attempt is not None and mb is not None
            attempt.payload = payload
            self._completed(attempt, mb)
        elif outcome.event == "failed":
            assert attempt is not None
            if report.counted_from >= 0:
                # note "counted stages": a retry must not add this gradient again at these stages
                data = self.ledger.micro_batches[attempt.index].data
                known = data.get("counted_from", -1)
                data["counted_from"] = report.counted_from if known < 0 else min(known, report.counted_from)
            self._fail(
                attempt,
                reason=report.failure or Failure.ERROR,
                stage=report.stage,
                peer=report.peer or None,
                detail=report.reason,
            )
        elif outcome.event == "loss" and mb is not None and mb.state == "completed" and mb.kind == "train":
            if report.loss is not None and math.isfinite(report.loss):
                self.cur.losses.append(report.loss)  # a loss that arrived after its `done`
        self.wake.set()

    def _completed(self, attempt: Attempt, mb: MicroBatch) -> None:
        self.checks.pop(attempt.mb_id, None)
        if mb.kind == "train":
            trip = self._clock() - attempt.started
            self.rtt.observe(trip)
            self._pace(trip)
        for stage, pid in enumerate(attempt.route):
            self.router.on_success(pid, n_tokens=mb.n_tokens, service_s=service_seconds(attempt.stats, stage))
            self.peers_by_stage[stage][pid] += 1
        if mb.kind == "eval":
            self._eval_progress()
            return
        self.completed_train += 1
        self.tokens_done += mb.n_tokens
        self.cur.tokens += mb.n_tokens
        if mb.loss is not None and math.isfinite(mb.loss):
            self.cur.losses.append(mb.loss)
            for stage, pid in enumerate(attempt.route):  # a replica whose weights went bad shows here
                old = self.peer_loss[stage].get(pid)
                self.peer_loss[stage][pid] = mb.loss if old is None else 0.9 * old + 0.1 * mb.loss
        for k, v in attempt.stats.items():
            self.cur.stats[k] += v
        self.cur.completed += 1
        self._resolved_train()

    def inflight_target(self) -> int:
        """Micro-batches to keep in flight now: the pacer's target, or ``max_inflight`` (note "pacing")."""
        if self.pacer is None or self.sync:
            return self.config.max_inflight
        return self.pacer.target

    def _inflight_summary(self) -> dict[str, Any]:
        """What the summary says about in-flight pacing (note "pacing")."""
        if self.sync:
            return {"mode": "sync windows", "max": self.config.max_inflight}
        if self.pacer is None:
            return {"mode": "fixed", "max": self.config.max_inflight}
        return {
            "mode": "paced",
            "max": self.config.max_inflight,
            "floor": self.pacer.floor,
            "final": self.pacer.target,
            "changes": self.pacer.changes,
        }

    def _pace(self, trip: float) -> None:
        if self.pacer is None or self.sync:
            return
        now = self._clock()
        self.pacer.track(now, self.ledger.inflight())
        if self.pacer.observe(now, trip):
            self._event(
                "inflight",
                target=self.pacer.target,
                queued=round(self.pacer.queued or 0.0, 3),
                base_s=round(self.pacer.base_s, 4),
            )

    def _fail(
        self,
        attempt: Attempt,
        *,
        reason: Failure,
        stage: int | None,
        peer: str | None,
        detail: str = "",
        cascade: bool = False,
    ) -> None:
        """Close a broken attempt: act on the peer it names (note "failure classes"), release the
        others, then retry or drop the micro-batch.

        An ``unreachable`` peer is most likely dead, and every other attempt whose route holds it
        would only find out at its deadline (its gradients must come back through that peer), so
        those are closed at once too (``cascade``: they count no second failure against the peer).
        """
        react = REACTIONS[reason]
        blamed = peer if peer in attempt.route else None
        if blamed is None and stage is not None and 0 <= stage < len(attempt.route) and react.names_stage:
            blamed = attempt.route[stage]
        decision = self.ledger.fail(attempt.mb_id, reason=reason.value, stage=stage, peer=blamed)
        if decision == "stale":
            return
        self.checks.pop(attempt.mb_id, None)
        for pid in set(attempt.route):  # the route's other peers drop what they hold of it (CANCEL)
            if not (pid == blamed and react.dead) and pid not in self.dead:
                self.cancels[pid].append(attempt.mb_id)
        for pid in attempt.route:
            if pid == blamed and react.backoff and not cascade:
                self.router.on_failure(pid)
            elif pid == blamed and react.pause:
                self.router.on_busy(pid)
            else:
                self.router.release(pid)
        mb = self.ledger.micro_batches[attempt.index]
        # a timeout names nobody: prefer other peers for the whole route next time
        mb.data["avoid"].update([blamed] if blamed else attempt.route)
        self._event(
            "attempt_failed",
            mb_id=attempt.mb_id,
            reason=reason.value,
            stage=stage,
            peer=blamed,
            decision=decision,
            detail=detail[:200],
        )
        if decision == "dropped":
            if mb.kind == "train":
                self._resolved_train()
            else:
                self._eval_progress()
        if react.dead and blamed is not None and not cascade:
            for other in self.ledger.inflight_attempts():
                if blamed in other.route:
                    self._fail(
                        other,
                        reason=reason,
                        stage=other.route.index(blamed),
                        peer=blamed,
                        detail=f"its route holds {blamed}, which just failed as unreachable",
                        cascade=True,
                    )
        self.wake.set()

    # ---- failure detection (note "failure detection", swarm/client/liveness.py) --------------------------

    def _heard(self, peer: str) -> None:
        self.liveness.heard(peer, self._clock())

    def _routable(self, now: float) -> list[dict[str, PeerRecord]]:
        """The stage records without the peers found dead within ``dead_hold_s``."""
        hold = self.config.liveness.dead_hold_s
        for pid in [p for p, t in self.dead.items() if now - t >= hold]:
            del self.dead[pid]
        if not self.dead:
            return self.stages
        return [{p: r for p, r in recs.items() if p not in self.dead} for recs in self.stages]

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.liveness.probe_every_s)
            self._probe_tick(self._clock())

    def _probe_tick(self, now: float) -> None:
        """Start the holding checks that are due and probe the peers that need it."""
        from swarm.wire.protocol import MAX_LISTED_IDS

        holding: dict[str, list[str]] = defaultdict(list)
        forced: set[str] = set()
        for a in self.ledger.inflight_attempts():
            if not a.acked:
                continue  # the FORWARD call itself is still out (call_timeout_s covers it)
            for pid in set(a.route):
                holding[pid].append(a.mb_id)
            check = self.checks.get(a.mb_id)
            if check is not None and check.since is None and now >= check.check_at:
                check.since, check.answers = now, {}
                forced.update(a.route)
        for pid in self.liveness.due(holding, now, forced=forced):
            self.liveness.probe_sent(pid, now)
            self.tasks.spawn(self._probe(pid, holding.get(pid, [])[:MAX_LISTED_IDS], sent=now))
        self.liveness.forget(holding)

    async def _probe(self, peer: str, mb_ids: list[str], *, sent: float) -> None:
        live = self.config.liveness
        try:
            reply: dict[str, Any] | None = await self.link.probe(peer, mb_ids, timeout_s=live.probe_timeout_s)
        except PeerFailure as e:
            now = self._clock()
            if e.reason == "timeout":
                if self.liveness.probe_timed_out(peer, now):
                    self._peer_dead(peer, Failure.TIMEOUT, f"{live.max_misses} probes timed out: {e}", sent)
            else:
                self.liveness.probe_failed(peer, now)
                self._peer_dead(peer, Failure.UNREACHABLE, f"probe failed: {e}", sent)
            return
        except RequestError:  # it answered (a refusal): alive, holdings unknown
            reply = None
        now = self._clock()
        self.liveness.probe_answered(peer, now)
        held = reply.get("held") if reply is not None else None
        known = set(held) if isinstance(held, list) else None  # None: an older peer, counts as holding
        for mb_id in mb_ids:
            attempt = self.ledger.attempts.get(mb_id)
            check = self.checks.get(mb_id)
            if attempt is None or attempt.state != "inflight" or check is None:
                continue
            if check.since is None or sent < check.since:
                continue  # no round in progress, or this probe left before the round started
            check.answers[peer] = known is None or mb_id in known
            verdict = hold_verdict(attempt.route, check.answers)
            if verdict != "pending" and next_check(
                check, verdict, now=now, rto_s=self.rtt.rto_s, config=live
            ):
                self._fail(
                    attempt,
                    reason=Failure.LOST,
                    stage=None,
                    peer=None,
                    detail=f"no peer of its route holds it ({live.quiet_rounds} checks)",
                )
        self.wake.set()

    def _peer_dead(self, peer: str, reason: Failure, detail: str, sent: float) -> None:
        """``peer`` is gone: close every attempt through it at once and keep it out of routes."""
        now = self._clock()
        self.dead[peer] = now
        through = [a for a in self.ledger.inflight_attempts() if peer in a.route]
        self.detected.append({"peer": peer, "time": now, "reason": reason.value, "attempts": len(through)})
        self._event("peer_dead", peer=peer, reason=reason.value, attempts=len(through), detail=detail[:200])
        if not through:
            self.router.on_failure(peer, in_flight=False)
        for i, attempt in enumerate(through):
            if attempt.state == "inflight":  # the first one's cascade may have closed the others
                self._fail(
                    attempt,
                    reason=reason,
                    stage=attempt.route.index(peer),
                    peer=peer,
                    detail=detail,
                    cascade=i > 0,
                )
        self.wake.set()

    def _flush_cancels(self) -> None:
        if not self.cancels or not hasattr(self.link, "cancel"):
            self.cancels.clear()
            return
        for pid, ids in self.cancels.items():
            self.tasks.spawn(self.link.cancel(pid, ids))
        self.cancels = defaultdict(list)

    async def _cancel_inflight(self) -> None:
        """At the end: cancel what is still in flight, so peers drop it at once (best effort)."""
        if not hasattr(self.link, "cancel"):
            return
        by_peer: dict[str, list[str]] = defaultdict(list)
        for a in self.ledger.inflight_attempts():
            for pid in set(a.route):
                by_peer[pid].append(a.mb_id)
        for pid, ids in self.cancels.items():
            by_peer[pid].extend(ids)
        self.cancels.clear()
        await asyncio.gather(*(self.link.cancel(p, ids, timeout_s=2.0) for p, ids in by_peer.items()))

    def _resolved_train(self) -> None:
        """One training micro-batch completed or dropped: close the step when it is full."""
        self.cur.resolved += 1
        if self.sync:
            self.window_open -= 1
            if self.window_open == 0 and self.window_left == 0:
                self._close_step()
        elif self.cur.completed >= self.accumulate:  # async: a step is `accumulate` completed micro-batches
            self._close_step()

    def _close_step(self) -> None:
        cur = self.cur
        self.step += 1
        loss = sum(cur.losses) / len(cur.losses) if cur.losses else None
        if loss is not None:
            self.last_loss = loss
        totals = self.ledger.totals("train")
        now = self._clock()
        rec = step_record(
            step=self.step,
            elapsed_s=now - self.started,
            loss=loss,
            tokens=self.tokens_done,
            step_tokens=cur.tokens,
            step_stats=dict(cur.stats),
            completed=totals["completed"],
            dropped=totals["dropped"],
            inflight=totals["inflight"],
            tokens_per_s=self._tokens_per_s(now),
            step_micro_batches=cur.completed,
        )
        rec["data_position"] = self.data_position  # note "resume"
        if not self.sync:
            rec["inflight_target"] = self.inflight_target()  # note "pacing"
        if self.writer is not None:
            self.writer.write(rec)
        if self.sinks is not None:
            self.sinks.write(rec)
        self.cur = _Step()
        if (
            self.config.eval_every
            and self.step % self.config.eval_every == 0
            and self.step < self.target_steps
        ):
            self.eval_due = True

    # ---- evaluation -----------------------------------------------------------------------------

    def _open_eval(self) -> None:
        self.eval_due = False
        batches = self.data.eval_batches(self.spec.micro_batch_size, self.config.eval_batches)
        self.eval_step = self.step  # the weights being evaluated are those of this step
        self.eval_tokens = self.tokens_done
        self.eval_round = [
            self.ledger.open("eval", x.numel(), data={"tokens": x, "targets": y, "avoid": set()}).index
            for x, y in batches
        ]

    def _eval_progress(self) -> None:
        if self.eval_round is None:
            return
        mbs = [self.ledger.micro_batches[i] for i in self.eval_round]
        if any(mb.state in ("pending", "inflight") for mb in mbs):
            return
        losses = [mb.loss for mb in mbs if mb.state == "completed" and mb.loss is not None]
        rec = {
            "type": "eval",
            "step": self.eval_step,
            "time": round(self._clock() - self.started, 3),
            "tokens": self.eval_tokens,
            "eval_loss": sum(losses) / len(losses) if losses else None,
            "eval_micro_batches": len(losses),
        }
        if self.writer is not None:
            self.writer.write(rec)
        if self.sinks is not None:
            self.sinks.write(rec)
        if losses:
            self.say(f"step {self.eval_step}: held-out loss {rec['eval_loss']:.3f}")
        self.eval_round = None

    # ---- background loops ------------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_every_s * random.uniform(0.8, 1.2))
            try:
                self.stages = await self.link.stage_records()
                self._update_caps()
                self._flag_departed()
            except PeerFailure as e:
                self._event("dht_error", detail=str(e)[:200])
            self.wake.set()

    def _flag_departed(self) -> None:
        """Peers holding our micro-batches whose record left their stage or says leaving: probe them."""
        now = self._clock()
        for a in self.ledger.inflight_attempts():
            for stage, pid in enumerate(a.route):
                rec = self.stages[stage].get(pid) if stage < len(self.stages) else None
                if rec is None or rec.state == "leaving":
                    self.liveness.flag(pid, now)

    def _update_caps(self) -> None:
        """Recompute the staleness caps; say once when they hold fewer micro-batches than ``max_inflight``."""
        opt = self.spec.optimizer
        self.max_per_peer = staleness_caps(
            self.stages, accumulate=opt.accumulate, max_versions=opt.max_versions, sync=self.sync
        )
        limits = [
            cap * sum(1 for r in recs.values() if r.state == "online")
            for cap, recs in zip(self.max_per_peer, self.stages, strict=True)
            if cap is not None and recs
        ]
        allowed = min(limits, default=None)
        if allowed is not None and allowed < self.config.max_inflight and not self.cap_noted:
            self.cap_noted = True
            self.say(
                f"note: at most {allowed} micro-batches in flight (max_inflight is {self.config.max_inflight}): "
                f"more would outlive the {opt.max_versions} weight versions a peer keeps; raise "
                "optimizer.max_versions (or optimizer.accumulate) to keep more in flight"
            )
            self._event("inflight_capped", allowed=allowed, max_inflight=self.config.max_inflight)

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.publish_every_s * random.uniform(0.8, 1.2))
            try:
                await self._publish()
                await self._poll_stage_events()
            except PeerFailure as e:
                self._event("dht_error", detail=str(e)[:200])

    async def _poll_stage_events(self) -> None:
        """Say each stage event of the run once: a stage that lost every replica and was rolled back to a
        keeper's snapshot or a checkpoint, or restarted from initial weights (swarm/tools/keeper.py)."""
        events = await asyncio.to_thread(self.link.membership.events)
        for ev in events:
            key = (ev.peer_id, ev.event_id)
            if key in self.stage_events_seen:
                continue
            self.stage_events_seen.add(key)
            age = time.time() - ev.at
            when = f" ({age / 60:.0f} min ago)" if age > 120 else ""
            self.say(f"warning: {ev.describe()}{when}")
            self._event(
                "stage_event",
                kind=ev.kind,
                stage=ev.stage,
                source=ev.source,
                version=ev.version,
                lost_from=ev.lost_from,
                peer=ev.peer_id,
            )

    async def _publish(self) -> None:
        await asyncio.to_thread(
            self.link.membership.publish_progress,
            self.trainer_id,
            self.tokens_done,
            self.step,
            self.last_loss,
            tokens_per_s=self._tokens_per_s(self._clock()),
        )

    # ---- output ---------------------------------------------------------------------------------

    def _tokens_per_s(self, now: float) -> float:
        if self.first_send is None or now <= self.first_send:
            return 0.0
        return (self.tokens_done - self.tokens_before) / (now - self.first_send)

    def _show(self) -> None:
        if self.progress is None:
            return
        t = self.ledger.totals("train")
        self.progress.update(
            ProgressSnapshot(
                tokens=self.tokens_done,
                target_tokens=self.target_mbs * self.tokens_per_mb,
                step=self.step,
                target_steps=self.target_steps,
                tokens_per_s=self._tokens_per_s(self._clock()),
                loss=self.last_loss,
                inflight=self.ledger.inflight(),
                completed=t["completed"],
                dropped=t["dropped"],
            )
        )

    def say(self, text: str) -> None:
        """Print a line to the user without breaking the progress line (nothing when ``quiet``)."""
        if self.config.quiet:
            return
        progress = getattr(self, "progress", None)
        if progress is not None:
            progress.message(text)
        else:
            print(text, file=self._out, flush=True)

    def _event(self, event: str, **fields: Any) -> None:
        writer = getattr(self, "writer", None)
        if writer is not None:
            writer.write(
                {"type": "event", "event": event, "time": round(self._clock() - self.started, 3), **fields}
            )

    def _finish(self) -> dict[str, Any]:
        if self.progress is not None:
            self._show()
            self.progress.close()
        now = self._clock()
        totals = self.ledger.totals("train")
        cfg = self.config
        records = read_metrics(Path(cfg.out_dir) / "metrics.jsonl") if cfg.out_dir else []
        summary = summarize(
            records,
            wall_s=now - (self.first_send or self.started),
            totals=totals,
            num_stages=self.spec.num_stages,
            d_model=self.spec.model.d_model,
            peers_by_stage={s: dict(p) for s, p in self.peers_by_stage.items()},
            extra={
                "run_id": self.spec.run_id,
                "spec_hash": self.spec.spec_hash,
                "trainer_id": self.trainer_id,
                "mode": self.spec.optimizer.mode,
                "inflight": self._inflight_summary(),
                "eval_micro_batches": self.ledger.totals("eval"),
                "peer_loss": {
                    str(st): {p: round(v, 4) for p, v in d.items()} for st, d in self.peer_loss.items()
                },
                "codecs": {
                    "activations": self.spec.codecs.activations,
                    "gradients": self.spec.codecs.gradients,
                },
            },
        )
        if not records:  # no files: the summary still needs the numbers the ledger knows
            summary["tokens"] = self.tokens_done
            summary["steps"] = self.step
        if cfg.out_dir:
            out = Path(cfg.out_dir)
            (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
            plot_loss(records, out / "loss.png", title=f"run {self.spec.run_id}: training loss")
        if not cfg.quiet:
            print(format_summary(summary), file=self._out, flush=True)
            if cfg.out_dir:
                print(f"metrics, loss plot and summary in {os.path.abspath(cfg.out_dir)}", file=self._out)
        return summary
