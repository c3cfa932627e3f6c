"""``TrainerConfig``: everything one trainer needs, checked when it is built (``swarm train`` fills it).

It lives apart from the loop so that the trainer's modules (swarm/train/loop.py and its helpers) can
read it without importing ``swarm.train.trainer``, which re-exports it for every caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.client.liveness import LivenessConfig
from swarm.client.routing import RoutingConfig
from swarm.errors import ConfigError
from swarm.run.fields import check_fields, integer, number
from swarm.train.data import DataConfig

__all__ = ["TrainerConfig"]


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
    """Evaluate held-out loss through the swarm every N trainer steps (and at the end); 0 = never. In
    sync mode training waits for each evaluation (it sees exactly that step's weights); in async mode
    evaluations overlap training (swarm/train/steps.py, note "evaluation between windows")."""
    eval_batches: int = integer(2, lo=1, hint="Use e.g. 2.")
    """Held-out micro-batches per evaluation."""
    progress_interval_s: float = number(10.0, gt=0.0, hint="Give a positive number of seconds.")
    """Seconds between progress lines when the output is not a terminal."""
    publish_every_s: float = number(15.0, gt=0.0, hint="Give a positive number of seconds.")
    """Seconds between publications of this trainer's progress to the DHT (`swarm status` reads it; the
    record lives 60 s, so three publications may be lost)."""
    refresh_every_s: float = number(2.0, gt=0.0, hint="Give a positive number of seconds.")
    """Seconds between re-reads of the stage peers' records; while they do not change the period grows
    to 5x this (swarm/train/background.py, ``next_refresh_s``)."""
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
