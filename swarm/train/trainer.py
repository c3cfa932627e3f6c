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
   hop that broke. Silence is never waited out (note "failure detection" in swarm/train/probing.py).
4. A broken route closes the attempt; the micro-batch is re-sent on a new route (new ``mb_id``,
   only token ids travel again) up to ``max_attempts`` times, then counted as dropped. The ledger
   (swarm/train/accounting.py) keeps ``opened == completed + dropped + in flight + pending``.

Where each part lives (every module of ``swarm/train/`` has one job)
--------------------------------------------------------------------
- ``loop``: one session's loop (fill routes, wait for events, react, close steps), note "counted stages";
- ``events``: what wakes the loop (callbacks and tasks only post events), the owner of its tasks;
- ``policy``: ``mode: sync`` windows or ``mode: async`` pacing, note "trainer step";
- ``failures``: ``REACTIONS`` to each failure code and closing broken attempts, note "failure classes";
- ``probing``: probes of silent peers and holding checks, note "failure detection";
- ``routes``: stage records, peers found dead, staleness caps, waiting for an empty stage;
- ``steps``: the step in progress, step and eval records; ``output``: terminal, metrics.jsonl, summary;
- ``background``: re-reading stage records and publishing progress to the DHT;
- ``resume``: a fresh ``OUT`` or the one a killed trainer left, note "resume"; ``config``: ``TrainerConfig``.

Everything runs on one asyncio event loop; DHT calls go through ``asyncio.to_thread``. Every
background task is owned by ``swarm.train.events.Tasks`` and cancelled when the session ends.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from swarm.client.link import SwarmLink
from swarm.train.config import TrainerConfig
from swarm.train.data import build_data
from swarm.train.failures import REACTIONS, Reaction
from swarm.train.loop import TrainLoop
from swarm.train.output import Console
from swarm.train.policy import inflight_rule_of_thumb
from swarm.train.resume import ResumeState, prepare_out_dir, read_resume_state
from swarm.train.routes import service_seconds

if TYPE_CHECKING:
    from swarm.client.routing import Router
    from swarm.train.accounting import Ledger
    from swarm.train.data import TokenData

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


class Trainer:
    """Drives training micro-batches of one run through the swarm (see the module docstring).

    ``clock`` (monotonic seconds) and ``out`` (where progress and the summary go) are injectable.
    ``session`` is the :class:`~swarm.train.loop.TrainLoop` once the trainer joined (it stays after
    the end); ``ledger``, ``router``, ``step``, ``completed_train``, ``data`` and ``detected`` read it.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        out: IO[str] | None = None,
    ):
        self.config = config
        self.trainer_id: str = config.trainer_id or f"trainer-{secrets.token_hex(4)}"
        self.summary: dict[str, Any] | None = None
        self.resumed: ResumeState | None = None  # note "resume"
        self.session: TrainLoop | None = None
        self._clock = clock
        self._console = Console(
            out if out is not None else sys.stderr, quiet=config.quiet, interval_s=config.progress_interval_s
        )

    # ---- entry points ----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Run to the configured length and return the summary (blocking; owns its event loop)."""
        return asyncio.run(self.run())

    async def run(self) -> dict[str, Any]:
        """Join the run, build its data and train (``run_on``); the link is closed in ``finally``."""
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

    async def run_on(self, link: SwarmLink, data: TokenData) -> dict[str, Any]:
        """Train over an already open ``link`` (the caller closes it) with ``data``; returns the summary."""
        cfg = self.config
        if cfg.resume and self.resumed is None:
            self._adopt(read_resume_state(cfg.out_dir, run_id=cfg.run_id))
        prepare_out_dir(cfg, self.resumed, link.spec)  # a resume that does not fit is refused here
        self.session = TrainLoop(
            cfg,
            link,
            data,
            trainer_id=self.trainer_id,
            resumed=self.resumed,
            clock=self._clock,
            console=self._console,
        )
        try:
            return await self.session.run()
        finally:
            self.summary = self.session.summary

    def _adopt(self, state: ResumeState) -> None:
        self.resumed = state
        if self.config.trainer_id is None:
            self.trainer_id = state.trainer_id

    def say(self, text: str) -> None:
        """Print a line to the user without breaking the progress line (nothing when ``quiet``)."""
        self._console.say(text)

    # ---- what callers read of the session (the demo, benchmarks, tests) ---------------------------

    @property
    def ledger(self) -> Ledger | None:
        return self.session.ledger if self.session is not None else None

    @property
    def router(self) -> Router | None:
        return self.session.router if self.session is not None else None

    @property
    def step(self) -> int:
        return self.session.book.step if self.session is not None else 0

    @property
    def completed_train(self) -> int:
        return self.session.book.completed_train if self.session is not None else 0

    @property
    def data(self) -> TokenData | None:
        return self.session.data if self.session is not None else None

    @property
    def detected(self) -> list[dict[str, Any]]:
        """Peers found dead: when, why and how many attempts it closed (benchmarks read it)."""
        return self.session.failures.detected if self.session is not None else []
