"""What a run looks like right now: gathered from the DHT, rendered as a table or as JSON.

Used by ``swarm status`` / ``swarm runs`` (``swarm/cli/commands/status.py``) and by the bootstrap's
periodic status line (``swarm/tools/bootstrap.py``). Gathering only reads through a ``Membership``;
rendering is pure, so its output is tested on hand-built data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm.dht.records import ACTIVE_STATES, PeerRecord, RunEntry, SnapshotIndex, StageEvent
from swarm.errors import ConfigError

if TYPE_CHECKING:
    from swarm.dht.membership import Membership
    from swarm.run.spec import RunSpec

__all__ = [
    "StageStatus",
    "RunStatus",
    "gather_run_status",
    "render_run_status",
    "render_runs",
    "status_line",
    "human",
]


def human(x: float) -> str:
    """1234567 -> '1.23M': counts and rates in a few characters."""
    if not math.isfinite(x):
        return str(x)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}" if isinstance(x, float) and x != int(x) else str(int(x))


@dataclass(frozen=True)
class StageStatus:
    stage: int
    layers: tuple[int, int] | None  # half-open layer range, None if the spec was not available
    peers: tuple[PeerRecord, ...]  # every valid record, leaving ones included

    @property
    def active(self) -> tuple[PeerRecord, ...]:
        return tuple(p for p in self.peers if p.state in ACTIVE_STATES)

    @property
    def throughput(self) -> float:
        """Total tokens/s of the stage's joining/online peers."""
        return math.fsum(p.throughput for p in self.active)

    @property
    def covered(self) -> bool:
        return bool(self.active)


@dataclass(frozen=True)
class RunStatus:
    run_id: str
    spec_hash: str | None
    stages: tuple[StageStatus, ...]
    progress: dict[str, Any]  # Membership.progress()
    entries: tuple[RunEntry, ...] = ()  # registry entries of this run (normally one)
    spec_found: bool = True
    rejected: int = 0  # invalid records the reader dropped
    notes: tuple[str, ...] = field(default=())
    events: tuple[StageEvent, ...] = ()  # stage rollbacks / fresh starts of the last hour, oldest first
    keepers: tuple[SnapshotIndex, ...] = ()  # snapshot indexes of the run's keepers (swarm/tools/keeper.py)

    @property
    def uncovered(self) -> list[int]:
        return [s.stage for s in self.stages if not s.covered]

    @property
    def num_peers(self) -> int:
        return len({p.peer_id for s in self.stages for p in s.active})

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``swarm status --json`` (stable keys; numbers as numbers)."""
        return {
            "run_id": self.run_id,
            "spec_hash": self.spec_hash,
            "spec_found": self.spec_found,
            "num_stages": len(self.stages),
            "uncovered_stages": self.uncovered,
            "peers": self.num_peers,
            "stages": [
                {
                    "stage": s.stage,
                    "layers": list(s.layers) if s.layers else None,
                    "covered": s.covered,
                    "throughput": s.throughput,
                    "peers": [
                        {
                            "peer_id": p.peer_id,
                            "state": p.state,
                            "throughput": p.throughput,
                            "queue": p.queue,
                            "version": p.version,
                            "codecs": list(p.codecs),
                            "software": p.software,
                        }
                        for p in s.peers
                    ],
                }
                for s in self.stages
            ],
            "progress": self.progress,
            "registry": [_entry_json(e) for e in self.entries],
            "rejected_records": self.rejected,
            "notes": list(self.notes),
            "events": [
                {
                    "kind": e.kind,
                    "stage": e.stage,
                    "source": e.source,
                    "version": e.version,
                    "lost_from": e.lost_from,
                    "lost_versions": e.lost_versions,
                    "peer_id": e.peer_id,
                    "at": e.at,
                    "text": e.describe(),
                }
                for e in self.events
            ],
            "keepers": [
                {
                    "keeper_id": k.keeper_id,
                    "versions": list(k.versions),
                    "taken_at": list(k.taken_at),
                    "seen": list(k.seen),
                    "interval_s": k.interval_s,
                }
                for k in self.keepers
            ],
        }


def _entry_json(e: RunEntry) -> dict[str, Any]:
    return {k: getattr(e, k) for k in e.__dataclass_fields__}


def apply_access(membership: Membership, spec: RunSpec, secret: bytes | None) -> str | None:
    """Make ``membership`` ignore the records its run's access rules refuse; a note if it cannot.

    Public runs: the spec's allow/deny lists. Private runs: with the right ``secret``, records without a
    valid join proof are dropped (``ConfigError`` for a wrong secret); without one only the lists
    apply and the returned note says that outsiders' records may be shown. The rules are set once per
    ``membership`` (later calls only return the note again).
    """
    from swarm.dht.auth import SECRET_ENV, RunAuth

    access = spec.access
    if access is None:
        return None
    unchecked = access.private and secret is None
    if membership.auth is None:
        if unchecked:
            membership.set_auth(RunAuth(spec.run_id, allow=access.allow, deny=access.deny))
        else:
            membership.set_auth(RunAuth.from_spec(spec, secret))
    if not unchecked:
        return None
    return (
        f"run {spec.run_id!r} is private and no join secret was given: its peer records are shown "
        f"unchecked (an outsider's may appear); pass --secret-file PATH or set {SECRET_ENV} to check them"
    )


def gather_run_status(
    membership: Membership, *, spec_timeout_s: float = 5.0, secret: bytes | None = None
) -> RunStatus:
    """Read everything ``swarm status`` shows about ``membership.run_id``.

    The stage count comes from the run's spec (hash-checked, fetched once per ``membership``); if
    no spec can be fetched in ``spec_timeout_s``, from the run's registry entry; if neither exists,
    ``ConfigError``. The spec's access rules filter the peer records (:func:`apply_access`; a private
    run's join proofs are checked only with its ``secret``).
    """
    run_id = membership.run_id
    if run_id is None:
        raise ConfigError("gather_run_status needs a Membership of one run (membership.for_run(RUN))")
    entries = tuple(e for e in membership.list_runs() if e.run_id == run_id)
    notes: list[str] = []
    try:
        # A spec never changes under its hash: once fetched, keep it (status survives the owner's exit).
        spec = (
            membership.spec
            if membership.spec is not None
            else membership.fetch_spec(timeout_s=spec_timeout_s)
        )
        num_stages, layers = spec.num_stages, [spec.stage_layers(s) for s in range(spec.num_stages)]
        spec_found = True
    except ConfigError:
        if not entries:
            raise ConfigError(
                f"run {run_id!r} has neither a spec nor a registry entry in this swarm; "
                "`swarm runs --initial-peers ...` lists the runs it knows"
            ) from None
        num_stages, layers, spec_found = entries[0].num_stages, [None] * entries[0].num_stages, False
        notes.append(f"the spec of run {run_id!r} was not found; stage count taken from the registry")
        spec = None
    if spec is not None:  # a wrong secret raises ConfigError here, not "spec not found" above
        access_note = apply_access(membership, spec, secret)
        if access_note is not None:
            notes.append(access_note)
    records = membership.all_stage_records(num_stages)
    stages = tuple(
        StageStatus(stage=s, layers=layers[s], peers=tuple(records[s].values())) for s in range(num_stages)
    )
    progress = membership.progress()
    events, keepers = tuple(membership.events()), tuple(membership.snapshot_indexes())
    return RunStatus(
        run_id=run_id,
        spec_hash=membership.spec_hash,
        stages=stages,
        progress=progress,
        entries=entries,
        spec_found=spec_found,
        rejected=membership.rejected,
        notes=tuple(notes),
        events=events,
        keepers=keepers,
    )


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:8]}…{peer_id[-6:]}"


def status_line(status: RunStatus) -> str:
    """One line: coverage, peers, throughput, progress (the bootstrap prints it periodically)."""
    covered = len(status.stages) - len(status.uncovered)
    p = status.progress
    line = (
        f"run {status.run_id}: {covered}/{len(status.stages)} stages covered, {status.num_peers} peers, "
        f"bottleneck {human(min((s.throughput for s in status.stages), default=0.0))} tok/s, "
        f"{len(p.get('trainers', {}))} trainers, {human(p.get('tokens', 0))} tokens"
    )
    if p.get("loss") is not None:
        line += f", loss {p['loss']:.4f}"
    if status.uncovered:
        line += f" | uncovered: {', '.join(map(str, status.uncovered))}"
    return line


def render_run_status(status: RunStatus) -> str:
    """The per-stage table of ``swarm status`` (one row per peer; uncovered stages marked)."""
    lines = []
    head = f"run {status.run_id}  spec {status.spec_hash or '?'}  {len(status.stages)} stages"
    if status.entries:
        e = status.entries[0]
        head += f"  {human(e.n_params)} params (d_model {e.d_model}, {e.n_layers} layers)"
    lines.append(head)
    lines.append(
        f"{'STAGE':<6}{'LAYERS':<9}{'PEER':<18}{'STATE':<9}{'TOKENS/S':>10}{'QUEUE':>7}{'VERSION':>9}  SOFTWARE"
    )
    for s in status.stages:
        layers = f"{s.layers[0]}-{s.layers[1]}" if s.layers else "?"
        if not s.peers:
            lines.append(f"{s.stage:<6}{layers:<9}{'-- UNCOVERED: no peers --'}")
            continue
        for i, p in enumerate(s.peers):
            prefix = f"{s.stage:<6}{layers:<9}" if i == 0 else " " * 15
            lines.append(
                f"{prefix}{_short(p.peer_id):<18}{p.state:<9}{p.throughput:>10.1f}{p.queue:>7}{p.version:>9}"
                f"  {p.software}"
            )
        total = f"{' ' * 15}{'stage total':<27}{s.throughput:>10.1f}"
        lines.append(total + ("" if s.covered else "  -- UNCOVERED: no active peers --"))
    p = status.progress
    trainers = p.get("trainers", {})
    loss = f", mean last loss {p['loss']:.4f}" if p.get("loss") is not None else ""
    lines.append(
        f"progress: {len(trainers)} trainers, {human(p.get('tokens', 0))} tokens, {p.get('steps', 0)} steps, "
        f"{human(p.get('tokens_per_s', 0.0))} tok/s{loss}"
    )
    for tid, t in trainers.items():
        tl = f", loss {t['loss']:.4f}" if t["loss"] is not None else ""
        lines.append(
            f"  trainer {tid}: {human(t['tokens'])} tokens, {t['steps']} steps, {human(t['tokens_per_s'])} tok/s{tl}"
        )
    if status.uncovered:
        lines.append(
            f"stages without peers: {', '.join(map(str, status.uncovered))}; trainers wait until a peer "
            "serves them (start one with `swarm peer --initial-peers ... --run " + status.run_id + "`)"
        )
    for k in status.keepers:
        held = " ".join(f"{s}:v{v}" if v >= 0 else f"{s}:-" for s, v in enumerate(k.versions))
        lines.append(f"keeper {_short(k.keeper_id)}: snapshots {held} (every {k.interval_s:.0f} s)")
    for e in status.events:
        lines.append(f"event: {e.describe()}")
    if status.rejected:
        lines.append(f"note: {status.rejected} invalid records were ignored")
    lines.extend(f"note: {n}" for n in status.notes)
    return "\n".join(lines)


def render_runs(entries: list[RunEntry]) -> str:
    """The table of ``swarm runs``."""
    if not entries:
        return "no runs registered in this swarm (start one with `swarm init RUN.yaml`)"
    lines = [f"{'RUN':<24}{'SPEC':<18}{'STAGES':>7}{'PARAMS':>9}{'PEERS':>7}  OWNER"]
    for e in entries:
        lines.append(
            f"{e.run_id:<24}{e.spec_hash:<18}{e.num_stages:>7}{human(e.n_params):>9}{e.peers:>7}  {e.owner}"
        )
    return "\n".join(lines)
