"""Stage snapshots on disk, and the rules that decide where a stage's state comes from.

A keeper (``swarm/tools/keeper.py``) keeps recent copies of every stage's state so that a stage whose
every replica died rolls back to a recent snapshot instead of to its initial weights. This module
holds the parts without networking, so they are unit tested directly:

- ``SnapshotStore``: one directory per (spec hash, stage) with at most ``keep`` files
  ``v<version>.pt``; writes are atomic (a temporary file in the same directory, fsync, then
  ``os.replace``), so a crash mid-write leaves the previous snapshots intact; ``newest`` skips
  unreadable files. A snapshot is the state a stage's peer shares with a joiner: its metadata
  (``StageCompute.export_state``) and ONE flat float32 tensor (``peer/averaging.py`` sends state
  that way; the receiver unflattens it with its own shapes). Read with ``torch.load(weights_only=True)``.
- ``prune_plan``: which versions rotation deletes (all but the ``keep`` newest).
- ``choose_newest``: among restorable states (a keeper's snapshot, the peer's own checkpoint),
  the one with the highest version.
- ``training_evidence``: whether a run has trained, from what its DHT records say (versions other
  stages announce, trainers' progress, keepers' indexes); a peer that finds no state for a stage
  of a trained run refuses to start it from initial weights (``StageStateLost``) unless told to.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.atomic import atomic_torch_save
from swarm.errors import ConfigError
from swarm.run.limits import SPEC_HASH_RE

if TYPE_CHECKING:
    import torch

    from swarm.dht.records import PeerRecord, SnapshotIndex

__all__ = [
    "Snapshot",
    "SnapshotStore",
    "StageStateLost",
    "Restorable",
    "prune_plan",
    "choose_newest",
    "training_evidence",
    "last_seen_version",
    "keeper_priority",
    "lost_state_message",
]

logger = logging.getLogger(__name__)

_FORMAT = 1
_FILE_RE = re.compile(r"v(\d{1,19})\.pt")


class StageStateLost(ConfigError):
    """A stage of a run that has trained has no live replica, snapshot or checkpoint to start from."""


@dataclass(frozen=True)
class Snapshot:
    """One stage's state as a donor shares it: ``meta`` (version, names, optimizer metadata) and ``flat``."""

    spec_hash: str
    run_id: str
    stage: int
    version: int
    meta: dict[str, Any]
    flat: torch.Tensor  # 1-D float32: parameters then optimizer slots, in the stage's state order
    taken_at: float  # wall-clock seconds


def prune_plan(versions: Iterable[int], keep: int) -> list[int]:
    """The versions rotation deletes so that only the ``keep`` newest remain (sorted, oldest first)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep={keep!r} must be an integer >= 1 (snapshots kept per stage)")
    ordered = sorted(set(versions))
    return ordered[: max(0, len(ordered) - keep)]


class SnapshotStore:
    """Snapshots of one run spec under ``root/<spec_hash>/stage<i>/v<version>.pt`` (see module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, spec_hash: str, keep: int = 3):
        if not isinstance(spec_hash, str) or not SPEC_HASH_RE.fullmatch(spec_hash):
            raise ConfigError(f"spec_hash={spec_hash!r} must be the 16 hex chars of RunSpec.spec_hash")
        prune_plan([], keep)  # validates keep
        self.root = Path(root)
        self.spec_hash = spec_hash
        self.keep = keep

    def stage_dir(self, stage: int) -> Path:
        return self.root / self.spec_hash / f"stage{int(stage)}"

    def versions(self, stage: int) -> list[int]:
        """Versions on disk for ``stage``, oldest first (temporary files are not snapshots)."""
        d = self.stage_dir(stage)
        if not d.is_dir():
            return []
        found = (_FILE_RE.fullmatch(p.name) for p in d.iterdir())
        return sorted(int(m.group(1)) for m in found if m is not None)

    def path(self, stage: int, version: int) -> Path:
        return self.stage_dir(stage) / f"v{int(version)}.pt"

    def write(self, snap: Snapshot) -> Path:
        """Write ``snap`` atomically, then delete all but the ``keep`` newest versions of its stage."""
        import torch

        if snap.spec_hash != self.spec_hash:
            raise ConfigError(
                f"a snapshot of spec {snap.spec_hash} cannot go into the store of spec {self.spec_hash}"
            )
        path = self.path(snap.stage, snap.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": _FORMAT,
            "spec_hash": snap.spec_hash,
            "run_id": snap.run_id,
            "stage": int(snap.stage),
            "version": int(snap.version),
            "taken_at": float(snap.taken_at),
            "meta": dict(snap.meta),
            "flat": snap.flat.detach().to("cpu", torch.float32).contiguous().reshape(-1),
        }
        atomic_torch_save(payload, path, prefix=".tmp-snap-")
        for old in prune_plan(self.versions(snap.stage), self.keep):
            try:
                self.path(snap.stage, old).unlink()
            except FileNotFoundError:
                pass
        return path

    def read(self, stage: int, version: int, *, numel: int | None = None) -> Snapshot:
        """Read one snapshot; ``ConfigError`` if it is unreadable, of another spec/stage, or not ``numel`` long."""
        import torch

        path = self.path(stage, version)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises many types on a corrupt file  # noqa: BLE001
            raise ConfigError(f"snapshot {str(path)!r} cannot be read ({type(e).__name__}: {e})") from None
        ok = (
            isinstance(payload, dict)
            and payload.get("format") == _FORMAT
            and payload.get("spec_hash") == self.spec_hash
            and payload.get("stage") == stage
            and payload.get("version") == version
            and isinstance(payload.get("meta"), dict)
            and isinstance(payload.get("flat"), torch.Tensor)
            and payload["flat"].dim() == 1
        )
        if not ok:
            raise ConfigError(
                f"snapshot {str(path)!r} is not a snapshot of stage {stage} version {version} of spec "
                f"{self.spec_hash}; move it away"
            )
        if numel is not None and payload["flat"].numel() != numel:
            raise ConfigError(
                f"snapshot {str(path)!r} holds {payload['flat'].numel()} values, stage {stage} needs {numel}"
            )
        return Snapshot(
            spec_hash=self.spec_hash,
            run_id=str(payload.get("run_id", "")),
            stage=stage,
            version=version,
            meta=dict(payload["meta"]),
            flat=payload["flat"],
            taken_at=float(payload.get("taken_at", 0.0)),
        )

    def newest(self, stage: int, *, numel: int | None = None) -> Snapshot | None:
        """The newest readable snapshot of ``stage`` (unreadable ones are skipped with a warning)."""
        for version in reversed(self.versions(stage)):
            try:
                return self.read(stage, version, numel=numel)
            except ConfigError as e:
                logger.warning("skipping a snapshot: %s", e)
        return None


@dataclass(frozen=True)
class Restorable:
    """A state a peer could restore a stage from: ``source`` is ``keeper`` or ``checkpoint``."""

    source: str
    version: int
    payload: Any = field(default=None, compare=False, repr=False)


def choose_newest(candidates: Sequence[Restorable | None]) -> Restorable | None:
    """The candidate with the highest version (None entries ignored); on a tie the earlier one."""
    best: Restorable | None = None
    for c in candidates:
        if c is not None and (best is None or c.version > best.version):
            best = c
    return best


def training_evidence(
    records_by_stage: Sequence[Mapping[str, PeerRecord]],
    progress: Mapping[str, Any] | None,
    indexes: Sequence[SnapshotIndex] = (),
) -> str | None:
    """Why the run has trained (a sentence), or None when nothing in the DHT says it has.

    Evidence: any stage's peer announcing a version above 0, trainers reporting tokens or steps, or
    a keeper holding (or having seen) a stage above version 0.
    """
    for stage, records in enumerate(records_by_stage):
        for r in records.values():
            if r.version > 0:
                return f"stage {stage} announces version {r.version} (peer {r.peer_id[:12]})"
    if progress and (progress.get("tokens", 0) > 0 or progress.get("steps", 0) > 0):
        return f"its trainers report {progress.get('tokens', 0)} tokens trained"
    for index in indexes:
        for stage, (version, seen) in enumerate(zip(index.versions, index.seen, strict=True)):
            if max(version, seen) > 0:
                return f"keeper {index.keeper_id[:12]} has seen stage {stage} at version {max(version, seen)}"
    return None


def last_seen_version(
    stage: int, records: Mapping[str, PeerRecord], indexes: Sequence[SnapshotIndex] = ()
) -> int:
    """The highest version ``stage`` is known to have reached (its records, keepers' ``seen``); -1 if none."""
    best = max((r.version for r in records.values()), default=-1)
    for index in indexes:
        if stage < len(index.seen):
            best = max(best, index.seen[stage], index.versions[stage])
    return best


def keeper_priority(version: int) -> float:
    """A keeper's donor priority for a snapshot at ``version``: below every live peer (whose priority is
    its version, >= 0), higher for newer snapshots, so joiners fall back to the newest keeper."""
    return -1.0 / (2.0 + max(0, int(version)))


def lost_state_message(run_id: str, stage: int, evidence: str) -> str:
    """What a peer says when it refuses to start a trained run's stage from initial weights."""
    return (
        f"stage {stage} of run {run_id!r} has no live replica, no keeper snapshot and no checkpoint to "
        f"load, but the run has trained ({evidence}): starting it from the initial weights would silently "
        f"erase stage {stage}'s training. Start a peer of this stage with the --checkpoint-dir it saved "
        f"to, or make sure a keeper (`swarm keeper`, or the run's `swarm init`) is reachable, then retry; "
        f"or pass --start-fresh to start stage {stage} from its initial weights anyway (the event is "
        "reported to trainers and monitors)"
    )
