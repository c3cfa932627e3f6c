"""``PeerConfig``: everything a stage peer is told on its command line, typed and checked once.

The CLI (``swarm peer``) parses into this dataclass and the Python API (``peer.StagePeer``) takes
it, so both paths share one set of rules. Everything about the *run* (model, optimizer, codecs)
comes from the run spec in the DHT, never from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from swarm.errors import ConfigError
from swarm.run.fields import check_fields, check_float, flag, integer, number, reject

__all__ = ["PeerConfig", "resolve_device"]


def _tuple(value: object, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise reject(
            name, value, "it must be a list of multiaddr strings", "Give e.g. /ip4/1.2.3.4/tcp/31337."
        )
    return tuple(value)


_SECONDS = "Give a number of seconds."


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """How one stage peer joins and serves. Checked in ``__post_init__`` (raises ``ConfigError``): the
    rules of most fields are declared with them (``swarm/run/fields.py``), and ``swarm peer``'s flags,
    defaults and help come from here (``swarm/cli/flags.py``)."""

    initial_peers: tuple[str, ...]
    """Multiaddrs (with /p2p/) of peers already in the swarm, e.g. what `swarm init` printed."""
    run_id: str
    """The run to serve; its spec is read from the DHT and verified by hash."""
    stage: Literal["auto"] | int = "auto"
    """``"auto"``: claim the weakest stage and rebalance later; an int pins the peer to that stage."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``mps`` (Apple silicon), ``cuda`` or ``cuda:N``."""
    host_maddrs: tuple[str, ...] = ()
    """Where to listen; empty = loopback only (this machine). See ``public``."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses others should dial, e.g. ``/ip4/<public ip>/tcp/<port>`` behind port forwarding."""
    identity_path: str | None = None
    """RSA identity file for a stable peer id (created if missing); None = new id each start."""
    checkpoint_dir: str | None = None
    """Save state here periodically and on exit, and resume from it; None = no checkpoints."""
    public: bool = flag(False)
    """Listen on all interfaces (``/ip4/0.0.0.0/tcp/0``) instead of loopback."""
    announce_period_s: float = number(5.0, gt=0.0, hint=_SECONDS)
    """Seconds between announcements and rebalancing checks (jittered by +-20 %). An unchanged record is
    stored every 3 ticks, a change at once (peer/announcements.py); records expire after 3 refreshes, so a
    crashed peer's record lingers up to ~45 s by default (trainers find it dead sooner, by probing it)."""
    rebalance: bool | None = None
    """Move to another stage when placement says so; None = only when ``stage == "auto"``."""
    rebalance_margin: float = number(0.2, ge=0.0, hint="Use a fraction such as 0.2.")
    """Relative improvement of the swarm's bottleneck a move must bring (see swarm/dht/placement.py)."""
    slowdown_s: float = number(0.0, ge=0.0, hint="Use 0 (no delay) or a few hundredths of a second.")
    """Artificial extra delay per micro-batch (seconds, added to every forward) to emulate a slow
    peer in straggler tests and demos; 0 = none. The announced throughput accounts for it."""
    emulate_compute_s: tuple[float, float] | None = None
    """Benchmark knob (``benchmarks/bubbles.py``): (forward, backward) seconds a training micro-batch
    occupies the stage at least; after the real compute the peer sleeps the rest, CPU-free like a GPU
    (note "emulated compute" in peer/compute.py). None = real compute only. Not for real runs."""
    timeline_path: str | None = None
    """Write this peer's per-micro-batch timeline (note "timeline" in peer/timeline.py) to this file as
    JSON lines when it stops; None = keep it in memory only. Read by ``benchmarks/timeline.py``."""
    max_queue: int = integer(64, lo=1, hint="Use e.g. 64.")
    """Compute tasks queued at most; more are refused with "busy, queue full" (backpressure)."""
    throughput: float | None = number(
        None, gt=0.0, optional=True, hint="Declare tokens/s, or leave it out to measure."
    )
    """Declared tokens/s instead of measuring (tests, demos, or a known figure); None = measure."""
    cache_dir: str | None = None
    """Where the throughput measurement is cached; None = ``~/.cache/swarmpipe``."""
    spec_timeout_s: float = number(30.0, gt=0.0, hint=_SECONDS)
    """How long to wait for the run spec in the DHT before giving up."""
    request_timeout_s: float = number(30.0, gt=0.0, hint=_SECONDS)
    """Timeout of one call to the next hop (or a report to the trainer); raise on slow links."""
    state_timeout_s: float = number(30.0, gt=0.0, hint=_SECONDS)
    """How long a state download from a same-stage peer may take."""
    checkpoint_period_s: float = number(300.0, gt=0.0, hint=_SECONDS)
    """Seconds between periodic checkpoints (with ``checkpoint_dir``)."""
    averaging_matchmaking_s: float = number(1.0, gt=0.0, hint=_SECONDS)
    """Seconds a gradient round's leader waits for the stage's other replicas before it gives up on a
    full group and tries again (hivemind min_matchmaking_time; a full group starts at once)."""
    max_failed_rounds: int = integer(3, lo=1, hint="Use e.g. 3.")
    """Gradient rounds that may fail in a row before a replica steps alone (the stage's other replicas
    then catch up by downloading its state). Raise it on slow links if ``solo_steps`` grows."""
    drain_timeout_s: float = number(10.0, gt=0.0, hint=_SECONDS)
    """On leaving a stage or shutting down: how long to wait for in-flight micro-batches to finish."""
    max_payload_bytes: int = 256 << 20
    """Largest activation/gradient message this peer accepts (bytes)."""
    secret: bytes | None = field(default=None, repr=False)
    """The join secret of a private run (``swarm.dht.auth.load_secret``); None for public runs. A private
    run refuses to start without the right one."""
    max_queue_per_sender: int | None = integer(
        None, lo=1, optional=True, hint="Leave it out for 3/4 of max_queue."
    )
    """Compute tasks one sender may have queued here; None = three quarters of ``max_queue``, so a
    flood from one peer leaves room for the others."""
    penalty_s: float = number(30.0, gt=0.0, hint=_SECONDS)
    """Seconds a sender is ignored after sending non-finite or absurd gradients."""
    max_grad_rms: float = number(1e4, gt=0.0, hint="Use e.g. 1e4.")
    """A backward payload whose root-mean-square exceeds this is refused as absurd (and penalized)."""
    max_activation_rms: float = number(1e6, gt=0.0, hint="Use e.g. 1e6.")
    """A forward payload whose root-mean-square exceeds this is refused as absurd."""
    start_fresh: bool = flag(False)
    """Start a stage from its initial weights even though the run has trained and no live replica,
    keeper snapshot or checkpoint of the stage can be loaded (otherwise the peer refuses to start:
    ``swarm.dht.snapshots.StageStateLost``). The event is published for trainers and monitors."""
    weights_dir: str | None = None
    """A local copy of the checkpoint a ``--from-pretrained`` run was made from (``swarm peer --weights
    DIR``): the stage's initial weights when no live replica or keeper sends its state. Only the stage's
    own tensors are read (memory-mapped), and checked against the spec's digest."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "initial_peers", _tuple(self.initial_peers, "initial_peers"))
        set_(self, "host_maddrs", _tuple(self.host_maddrs, "host_maddrs"))
        set_(self, "announce_maddrs", _tuple(self.announce_maddrs, "announce_maddrs"))
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ConfigError(f"run_id={self.run_id!r} must be a non-empty string (the run to serve)")
        stage = self.stage
        if isinstance(stage, str) and stage != "auto":
            if not stage.isdigit():
                raise ConfigError(f"stage={stage!r} must be 'auto' or a stage number such as 0")
            stage = int(stage)
            set_(self, "stage", stage)
        if stage != "auto" and (isinstance(stage, bool) or not isinstance(stage, int) or stage < 0):
            raise ConfigError(f"stage={stage!r} must be 'auto' or a stage number >= 0")
        resolve_device(self.device)  # validates the spelling; CUDA presence is checked at start
        check_fields(self)
        if self.emulate_compute_s is not None:
            pair = self.emulate_compute_s
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise reject(
                    "emulate_compute_s", pair, "it must be (forward, backward)", "Use e.g. (0.04, 0.08)."
                )
            hint = "Give seconds >= 0."
            set_(
                self,
                "emulate_compute_s",
                tuple(check_float("emulate_compute_s", v, ge=0.0, hint=hint) for v in pair),
            )
        if self.max_queue_per_sender is None:
            set_(self, "max_queue_per_sender", max(1, (3 * self.max_queue) // 4))
        if self.secret is not None and (not isinstance(self.secret, bytes) or len(self.secret) != 32):
            raise ConfigError(
                "secret must be the 32 bytes of a join secret (swarm.dht.auth.load_secret reads it)"
            )
        if self.checkpoint_dir is not None:
            set_(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        if self.timeline_path is not None:
            set_(self, "timeline_path", os.fspath(self.timeline_path))
        if self.weights_dir is not None:
            if not os.path.isdir(self.weights_dir):
                raise ConfigError(
                    f"--weights {os.fspath(self.weights_dir)!r} is not a directory; give the local checkpoint "
                    "directory (config.json, *.safetensors) the run was made from"
                )
            set_(self, "weights_dir", os.fspath(self.weights_dir))
        if self.identity_path is not None:
            set_(self, "identity_path", os.fspath(self.identity_path))

    @property
    def rebalancing(self) -> bool:
        return self.stage == "auto" if self.rebalance is None else bool(self.rebalance)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available else ``cpu``; validates other spellings."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device in ("cpu", "mps"):  # mps: Apple silicon (no pinned copies, autocast only where supported)
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ConfigError(f"device={device!r} must be auto, cpu, mps, cuda or cuda:N")
