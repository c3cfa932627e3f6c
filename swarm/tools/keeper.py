"""The keeper: recent snapshots of every stage's state, so a stage outlives its peers.

(Over 400 lines on purpose: one long-lived node; its config, its first snapshot and the ``Keeper``
loop of downloads, writes and announcements share one lifecycle.)

A keeper is a long-lived node (the run owner's ``swarm init`` runs one; ``swarm keeper`` lets anyone
run another) that, for each stage of a run:

1. downloads the stage's state from its live replicas at most every ``interval_s`` seconds (longer
   on a slow link, so that its downloads take at most ``link_share`` of a peer's time: note "link
   share" at :func:`download_gap_s`), and
   only when a replica announces a newer version than the keeper holds (and above 0: version 0 is
   the initial weights, so the first snapshot is taken as soon as a stage has stepped once). The download is hivemind's
   own state download, the one joining peers use (``peer.averaging.StageAverager.load_state``:
   ``load_state_from_peers`` under the stage's averager prefix), never a transport of our own;
2. writes it atomically to disk, keeping the ``keep`` newest snapshots per stage
   (``swarm.dht.snapshots.SnapshotStore``), and keeps the newest one in memory;
3. declares itself a donor of that snapshot through the same averager, with a priority below
   every live peer's (``keeper_priority``: negative, higher for newer snapshots). Joiners try
   donors by priority, so they get a live replica's state when one answers and the keeper's
   snapshot when none does: a stage whose every replica died rolls back to the last snapshot, at
   most ``interval_s`` plus one download behind, never to its initial weights;
4. publishes a ``SnapshotIndex`` in the DHT (``swarmpipe_<run>_snapshots``): the version of its
   newest snapshot per stage and the highest version it saw each stage's peers announce. Peers
   read it to know that the run has trained and how far a restored stage fell back.

A restarted keeper serves the snapshots it finds on disk (for the same spec hash) at once.

A run that continues a checkpoint (``swarm init --from-pretrained``; ``KeeperConfig.initial_weights``):
a stage with no snapshot on disk is served at version 0 from the checkpoint (``initial_snapshot``: its
tensors, digest-checked, with zero optimizer slots), so peers without a copy of the checkpoint can
start; version 0 is never written to disk (it is rebuilt from the checkpoint).
Memory: the newest snapshot of every stage (parameters and optimizer slots: about 3x the model
for AdamW) is held in memory; disk: ``keep`` of them per stage.

Private and gated runs: peers share state only with ids in the stage lists, so the keeper keeps a
``reading`` record in every stage list (as ``swarm export`` does) and serves its snapshots only
to peers whose records carry valid join proofs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.dht.snapshots import Snapshot, SnapshotStore, keeper_priority
from swarm.errors import ConfigError, SwarmError
from swarm.run.fields import check_fields, integer, number

if TYPE_CHECKING:
    import hivemind

    from peer.averaging import StageAverager
    from swarm.dht.membership import Membership
    from swarm.run.spec import RunSpec

__all__ = [
    "KeeperConfig",
    "Keeper",
    "stage_state_numel",
    "initial_snapshot",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_LINK_SHARE",
    "DEFAULT_KEEP",
]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 180.0
DEFAULT_LINK_SHARE = 0.05
DEFAULT_KEEP = 3


@dataclass(frozen=True, kw_only=True)
class KeeperConfig:
    """How a keeper keeps snapshots (``swarm keeper`` and ``swarm init`` map their flags 1:1)."""

    directory: str
    """Where snapshots live: ``<directory>/<spec_hash>/stage<i>/v<version>.pt``."""
    interval_s: float = number(
        DEFAULT_INTERVAL_S, gt=0.0, hint="Give a positive number of seconds, e.g. 180."
    )
    """Download a stage's state at most this often (only when its peers announce a newer version).
    A stage that loses every replica rolls back at most this far (plus one download), or as far as
    ``link_share`` stretches the interval on a slow link."""
    link_share: float = number(
        DEFAULT_LINK_SHARE,
        gt=0.0,
        le=1.0,
        hint="Give a fraction in (0, 1], e.g. 0.05: the share of a peer's time its uploads to the keeper may take.",
    )
    """The most of a stage's time the keeper's downloads of its state may take (note "link share"):
    after a download of ``d`` seconds the next one of that stage waits at least ``d / link_share``."""
    keep: int = integer(DEFAULT_KEEP, lo=1, hint="Keep at least 1 snapshot per stage, e.g. 3.")
    """Snapshots kept on disk per stage (the oldest are deleted)."""
    state_timeout_s: float = number(60.0, gt=0.0, hint="Give a positive number of seconds.")
    """How long one stage's download may take."""
    tick_s: float = number(5.0, gt=0.0, hint="Give a positive number of seconds.")
    """How often the keeper reads the stage records (one DHT read) to see what changed."""
    index_period_s: float = number(
        30.0, gt=0.0, le=60.0, hint="Give at most 60 s: the index expires after 120 s."
    )
    """How often the snapshot index is re-published (it expires after 120 s)."""
    initial_weights: str | None = None
    """A --from-pretrained run's checkpoint directory: a stage with no snapshot on disk is served at
    version 0 from it (the checkpoint's weights, checked against the spec's digests, and zero optimizer
    slots), so peers without a copy of the checkpoint can start (``swarm init --from-pretrained`` sets it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ConfigError(f"keeper directory={self.directory!r} must be a non-empty path")
        check_fields(self, "keeper")


def download_gap_s(download_s: float, cfg: KeeperConfig) -> float:
    """Note "link share": seconds from the start of one download of a stage's state to the next.

    A snapshot is a stage's whole state (parameters and optimizer slots: ~3x the parameters for AdamW),
    uploaded by one of its peers over the link it trains on. On a fast link that takes a second and
    ``interval_s`` decides; on a slow one (77 MB per stage of examples/bench.yaml takes ~31 s at 20
    Mbit/s) a download every 180 s would hold 17% of the peer's upload, so the gap grows until the
    downloads take at most ``link_share`` of the time. The rollback bound grows with it."""
    return max(cfg.interval_s, download_s / cfg.link_share)


def stage_state_numel(spec: RunSpec, stage: int) -> int:
    """Values in one stage's shared state (parameters plus optimizer slots), as its peers lay it out."""
    from swarm.run.model import StageModule
    from swarm.tools.export_download import _state_layout

    module = StageModule(spec, stage, draw=False)  # shapes only: nothing is drawn
    _, _, layout = _state_layout(spec, module)
    return sum(t.numel() for t in layout)


def initial_snapshot(spec: RunSpec, stage: int, directory: str, *, taken_at: float) -> Snapshot:
    """Version 0 of a --from-pretrained run's ``stage``, laid out as its peers share state: the
    checkpoint's weights (read memory-mapped, checked against the spec's digest: ``ConfigError``) and
    the optimizer's zero slots."""
    import torch

    from swarm.run.model import build_stage
    from swarm.run.optimizer import StageOptimizer
    from swarm.run.pretrained import check_stage_weights, read_stage_weights

    weights = read_stage_weights(directory, spec, stage)
    check_stage_weights(spec, stage, weights, source=f"the keeper's checkpoint {directory}")
    module = build_stage(spec, stage, weights=weights)
    del weights
    opt = StageOptimizer(dict(module.named_parameters()), spec.optimizer)
    del module
    meta = {
        "spec_hash": spec.spec_hash,
        "stage": stage,
        "version": 0,
        "names": opt.state_names(),
        **opt.metadata(),
    }
    flat = torch.cat([t.reshape(-1) for t in opt.state_tensors()])
    return Snapshot(
        spec_hash=spec.spec_hash,
        run_id=spec.run_id,
        stage=stage,
        version=0,
        meta=meta,
        flat=flat,
        taken_at=taken_at,
    )


class Keeper:
    """Snapshots of every stage of one run (see the module docstring). ``start``, then ``tick``
    repeatedly (or ``serve`` / ``start_background``), then ``close`` in ``finally``."""

    def __init__(
        self,
        dht: hivemind.DHT,
        membership: Membership,
        spec: RunSpec,
        cfg: KeeperConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if membership.run_id != spec.run_id:
            raise ConfigError(f"a keeper of run {spec.run_id!r} needs a Membership of that run")
        self.dht, self.membership, self.spec, self.cfg = dht, membership, spec, cfg
        self.store = SnapshotStore(cfg.directory, spec_hash=spec.spec_hash, keep=cfg.keep)
        self._clock, self._wall = clock, wall
        n = spec.num_stages
        self.held: list[Snapshot | None] = [None] * n
        self.seen: list[int] = [-1] * n
        self._numel: list[int] = []
        self._averagers: list[StageAverager] = []
        self._last_download = [-math.inf] * n
        self._gap_s = [cfg.interval_s] * n  # note "link share": the interval, stretched by slow downloads
        self._last_index = -math.inf
        self._lock = threading.Lock()  # guards ``held`` (read by hivemind's fetcher threads)
        self._reader: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.snapshots_taken = 0
        self.downloads_failed = 0

    @property
    def peer_id(self) -> str:
        return self.membership.peer_id

    @property
    def running(self) -> bool:
        """Whether the background thread (``start_background``) runs."""
        return self._thread is not None and self._thread.is_alive()

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> Keeper:
        """Load the snapshots on disk, start one averager per stage, declare what it holds."""
        import torch

        from peer.averaging import StageAverager

        try:
            for stage in range(self.spec.num_stages):
                numel = stage_state_numel(self.spec, stage)
                self._numel.append(numel)
                self.held[stage] = self.store.newest(stage, numel=numel) or self._initial(stage)
                averager = StageAverager.create(
                    self.dht,
                    run_id=self.spec.run_id,
                    spec_hash=self.spec.spec_hash,
                    stage=stage,
                    shapes=[torch.Size([numel])],
                    grad_shapes=[],  # a keeper never joins a gradient round
                    state_fn=lambda stage=stage: self._donor_state(stage),
                )
                self._averagers.append(averager)
            for averager in self._averagers:
                averager.wait_ready(30.0)
            from swarm.dht.auth import RunAuth

            auth = self.membership.auth or RunAuth.from_spec(self.spec, None)
            if auth.gated:
                from swarm.tools.export_download import _ReaderRecords

                self._reader = _ReaderRecords(self.membership, self.spec).start()
                self.refresh_authorized()  # before anything is declared: the set starts open
            for stage, snap in enumerate(self.held):
                if snap is not None:
                    logger.info(
                        "keeper: serving stage %d's snapshot at version %d from disk", stage, snap.version
                    )
                    self._averagers[stage].share_state(True, keeper_priority(snap.version))
            self.publish_index()
        except BaseException:
            self.close()
            raise
        return self

    def _initial(self, stage: int) -> Snapshot | None:
        """The checkpoint's version 0 of ``stage`` (``initial_weights``, pretrained runs only), else None."""
        if self.cfg.initial_weights is None or self.spec.pretrained is None:
            return None
        logger.info("keeper: reading stage %d's initial weights from %s", stage, self.cfg.initial_weights)
        return initial_snapshot(self.spec, stage, self.cfg.initial_weights, taken_at=self._wall())

    def start_background(self, out: Callable[[str], None] | None = None) -> Keeper:
        """Run ``serve`` in a daemon thread (stopped by ``close``)."""
        self._thread = threading.Thread(target=self.serve, args=(self._stop, out), name="keeper", daemon=True)
        self._thread.start()
        return self

    def serve(self, stop: threading.Event, out: Callable[[str], None] | None = None) -> None:
        """``tick`` every ``tick_s`` until ``stop`` is set; DHT trouble is logged and retried. In a gated
        run the ids allowed to download are refreshed every second (a joiner announces itself just
        before it asks for state)."""
        say = out or logger.info
        next_tick = -math.inf
        while True:
            try:
                if self._reader is not None:
                    self.refresh_authorized()
                if self._clock() >= next_tick:
                    next_tick = self._clock() + self.cfg.tick_s
                    for line in self.tick():
                        say(line)
            except SwarmError as e:
                say(f"keeper: warning: {e}")
            if stop.wait(1.0 if self._reader is not None else self.cfg.tick_s):
                return

    def refresh_authorized(self, records: list | None = None) -> None:
        """Serve snapshots only to the stage peers whose records carry valid join proofs (gated runs)."""
        if self._reader is None or not self._averagers:
            return
        if records is None:
            records = self.membership.all_stage_records(self.spec.num_stages)
        allowed = {pid for stage in records for pid in stage} | {self.peer_id}
        self._averagers[0].set_authorized(sorted(allowed))  # one set per process (peer/averaging.py)

    def close(self) -> None:
        """Stop the background thread, the reader records and the averagers. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.cfg.state_timeout_s + 10)
        self._thread = None
        if self._reader is not None:
            with contextlib.suppress(SwarmError):
                self._reader.stop()
            self._reader = None
        averagers, self._averagers = self._averagers, []
        for averager in averagers:
            averager.shutdown()

    def __enter__(self) -> Keeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ duties

    def _donor_state(self, stage: int) -> tuple[dict[str, Any], list[Any]]:
        """What a joiner downloads from the keeper (hivemind's fetcher thread)."""
        with self._lock:
            snap = self.held[stage]
        if snap is None:
            raise SwarmError(f"the keeper holds no snapshot of stage {stage} yet")
        meta = dict(snap.meta) | {"snapshot": {"keeper": self.peer_id, "taken_at": snap.taken_at}}
        return meta, [snap.flat]

    def tick(self) -> list[str]:
        """One pass: read the stage records, download newer states that are due, publish the index.
        Returns a line per snapshot taken (blocking: downloads take seconds)."""
        records = self.membership.all_stage_records(self.spec.num_stages)
        self.refresh_authorized(records)
        lines = []
        now = self._clock()
        seen_before = list(self.seen)
        for stage, recs in enumerate(records):
            self.seen[stage] = max(
                [self.seen[stage], *(r.version for r in recs.values() if r.state != "reading")]
            )
            live = [r.version for r in recs.values() if r.state == "online"]
            held = self.held[stage]
            # nothing newer to take; version 0 is the spec's initial weights, which every peer can rebuild
            if not live or max(live) <= (held.version if held else 0):
                continue
            start = self._clock()  # the stages before this one may have taken a while
            if start - self._last_download[stage] < self._gap_s[stage]:
                continue
            self._last_download[stage] = start
            line = self._take(stage)
            self._gap_s[stage] = download_gap_s(self._clock() - start, self.cfg)
            if line:
                lines.append(line)
        if lines or self.seen != seen_before or now - self._last_index >= self.cfg.index_period_s:
            self.publish_index()
        return lines

    def _take(self, stage: int) -> str | None:
        """Download stage ``stage`` from its live replicas and keep it if it is newer than ours."""
        held = self.held[stage]
        loaded = self._averagers[stage].load_state(self.cfg.state_timeout_s)
        if loaded is None:
            self.downloads_failed += 1
            logger.info("keeper: no replica of stage %d sent its state; trying again next interval", stage)
            return None
        meta, [flat] = loaded
        version = meta.get("version")
        if (
            meta.get("spec_hash") != self.spec.spec_hash
            or meta.get("stage") != stage
            or isinstance(version, bool)
            or not isinstance(version, int)
            or version < 0
        ):
            self.downloads_failed += 1
            logger.warning(
                "keeper: a donor of stage %d sent state of another spec/stage/version; ignored", stage
            )
            return None
        if held is not None and version <= held.version:
            return None  # another keeper's (older) snapshot, or nothing new
        meta = {k: v for k, v in meta.items() if k != "snapshot"}
        snap = Snapshot(
            spec_hash=self.spec.spec_hash,
            run_id=self.spec.run_id,
            stage=stage,
            version=version,
            meta=meta,
            flat=flat,
            taken_at=self._wall(),
        )
        try:
            path = self.store.write(snap)
        except OSError as e:
            logger.error(
                "keeper: could not write the snapshot of stage %d to %s: %s", stage, self.cfg.directory, e
            )
            path = None  # still serve it from memory
        with self._lock:
            self.held[stage] = snap
        self._averagers[stage].share_state(True, keeper_priority(version))
        self.snapshots_taken += 1
        where = f" ({path})" if path is not None else " (in memory only)"
        return f"keeper: stage {stage} snapshot at version {version}{where}"

    def index(self) -> Any:
        from swarm.dht.records import SnapshotIndex

        held = list(self.held)
        return SnapshotIndex(
            keeper_id=self.peer_id,
            run_id=self.spec.run_id,
            spec_hash=self.spec.spec_hash,
            versions=tuple(s.version if s else -1 for s in held),
            taken_at=tuple(s.taken_at if s else 0.0 for s in held),
            seen=tuple(max(v, s.version if s else -1) for v, s in zip(self.seen, held, strict=True)),
            interval_s=float(max(self._gap_s)),  # stretched by slow downloads (note "link share")
        )

    def publish_index(self) -> None:
        self.membership.publish_snapshot_index(self.index())
        self._last_index = self._clock()

    def status(self) -> str:
        held = ", ".join(
            f"{s}: v{snap.version}" if snap else f"{s}: none" for s, snap in enumerate(self.held)
        )
        return f"keeper of run {self.spec.run_id}: snapshots {held}"
