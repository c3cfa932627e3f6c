"""Who is in a run: the one object through which a process reads and writes the swarm's DHT.

(Over 400 lines on purpose: one class, the process's only DHT owner; every DHT read and write of a
run goes through its lock, so they stay in one place.)

``Membership(dht, run_id, spec_hash=None)`` wraps a DHT made by ``network.start_dht``. Why one
object per process: concurrent DHT calls from several threads corrupt the pipe to hivemind's DHT
process and kill it (docs/HIVEMIND.md, "DHT"), so every call goes through one ``threading.Lock``.
Runs other than the first one share that lock via ``membership.for_run(other_run_id)``.

All methods block (async code calls them with ``asyncio.to_thread``); each DHT call has a timeout
(``call_timeout_s``) so a dead DHT process raises ``PeerFailure`` instead of hanging the caller.

Writers sign: every subkey is (or ends with) this node's ``[owner:...]`` marker, so hivemind's
``RSASignatureValidator`` lets only this node overwrite it. Readers validate every subkey's value
with ``records.*.from_wire`` and silently drop what fails (wrong types, NaN or negative numbers,
another run or spec hash, a subkey not signed by the claimed peer); each drop adds one to
``membership.rejected`` (reasons in ``rejected_reasons``). A reader never raises on garbage.

Access (``swarm/dht/auth.py``): once ``set_auth(RunAuth)`` is called (after ``fetch_spec``, since the
spec says whether the run is private), writers add a join proof to their peer and progress records,
and readers also drop records whose proof is missing, invalid or expired, or whose peer id the
run's allow/deny lists refuse: an outsider never appears in stage lists or progress.

Lifetimes (``expiration_s`` arguments; hivemind drops a record when it expires, and nothing else
removes a dead peer's record):

- peer records: a stage peer stores its record at once when what others act on changes, and
  otherwise every third tick of its announce loop (15 s with the default 5 s ticks), each store living
  3 refreshes (45 s; ``PEER_EXPIRATION_S`` = 15 s is the default of other writers): two lost refreshes
  are tolerated, a dead peer's record outlives it by up to that (peer/announcements.py, note
  "announce on change"; trainers and replicas find dead peers by probing them). A peer that stops or moves to
  another stage first announces ``state="leaving"`` (``announce_leaving``) on its old stage;
  that record outlives the last ``online`` one (later expiration wins for a subkey).
- spec: 300 s, registry entries: 120 s, both refreshed by the run's bootstrap (``swarm init``);
- progress: 60 s, refreshed by each trainer every few seconds.
- snapshot indexes: 120 s, refreshed by each keeper (``swarm/tools/keeper.py``) every 30 s;
- stage events: 1 hour, written once by the peer that restored (or restarted) a stage.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from swarm.dht.network import DHT_STORE_BEAM, get_latest_many, local_signer
from swarm.dht.records import (
    MAX_SPEC_BYTES,
    REGISTRY_KEY,
    PeerRecord,
    ProgressRecord,
    RunEntry,
    RunKeysSchema,
    SnapshotIndex,
    SpecRecord,
    StageEvent,
    check_run_id,
    events_key,
    labelled_subkey,
    peer_id_of_subkey,
    progress_key,
    run_prefix,
    snapshots_key,
    spec_key,
    stage_key,
)
from swarm.errors import ConfigError, PeerFailure, RecordError
from swarm.traffic import TRAFFIC, record_kind

if TYPE_CHECKING:
    import hivemind

    from swarm.dht.auth import RunAuth
    from swarm.run.spec import RunSpec

__all__ = [
    "ANNOUNCE_PERIOD_S",
    "PEER_EXPIRATION_S",
    "SPEC_EXPIRATION_S",
    "REGISTRY_EXPIRATION_S",
    "PROGRESS_EXPIRATION_S",
    "SNAPSHOT_INDEX_EXPIRATION_S",
    "EVENT_EXPIRATION_S",
    "Membership",
]

logger = logging.getLogger(__name__)

ANNOUNCE_PERIOD_S = 5.0
PEER_EXPIRATION_S = 15.0
SPEC_EXPIRATION_S = 300.0
REGISTRY_EXPIRATION_S = 120.0
PROGRESS_EXPIRATION_S = 60.0
SNAPSHOT_INDEX_EXPIRATION_S = 120.0
EVENT_EXPIRATION_S = 3600.0
_POLL_S = 0.25  # fetch_spec re-reads this often while waiting for the spec to appear

T = TypeVar("T")


def _dht_time() -> float:
    from hivemind.utils import get_dht_time

    return get_dht_time()


def _check_expiration(expiration_s: float) -> float:
    if (
        not isinstance(expiration_s, int | float)
        or not math.isfinite(expiration_s)
        or not 0 < expiration_s <= 86400
    ):
        raise ConfigError(f"expiration_s={expiration_s!r} must be a number of seconds in (0, 86400]")
    return float(expiration_s)


def _packed_size(value: Any) -> int:
    """Bytes of ``value`` as hivemind serialises a DHT value (msgpack), for the traffic counters."""
    return len(msgpack.packb(value, use_bin_type=True))


class _Shared:
    """State shared by the Membership objects of one DHT: the lock and the rejection counters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # serialises DHT calls
        self.counter_lock = threading.Lock()  # readers count rejections after the DHT call returned
        self.rejected = 0
        self.reasons: collections.Counter[str] = collections.Counter()
        self.runs_with_schema: set[str] = set()


class Membership:
    """Reads and writes a run's records in the DHT (see the module docstring).

    ``run_id`` may be None for a registry-only view (``list_runs``); run methods then raise
    ``ConfigError``. ``spec_hash``, when known, filters out records of other specs of the same run
    id; ``fetch_spec`` and ``publish_spec`` set it.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str | None,
        spec_hash: str | None = None,
        *,
        call_timeout_s: float = 20.0,
        auth: RunAuth | None = None,
        _shared: _Shared | None = None,
    ) -> None:
        self.dht = dht
        self.run_id = None if run_id is None else check_run_id(run_id)
        if spec_hash is not None and (not isinstance(spec_hash, str) or len(spec_hash) != 16):
            raise ConfigError(f"spec_hash={spec_hash!r} must be the 16 hex chars of RunSpec.spec_hash")
        self.spec_hash = spec_hash
        self.call_timeout_s = call_timeout_s
        self.spec: RunSpec | None = None
        self.auth: RunAuth | None = None
        if auth is not None:
            self.set_auth(auth)
        self._signer = local_signer(dht)
        self._shared = _shared or _Shared()
        if self.run_id is not None and self.run_id not in self._shared.runs_with_schema:
            # The same per-run schema in every process that touches the run (see network.py).
            from hivemind.dht.schema import SchemaValidator

            validator = SchemaValidator(RunKeysSchema, prefix=run_prefix(self.run_id), allow_extra_keys=True)
            self._call(lambda: dht.add_validators([validator]))
            self._shared.runs_with_schema.add(self.run_id)

    def for_run(self, run_id: str, spec_hash: str | None = None) -> Membership:
        """A view of another run on the same DHT, sharing this object's lock and counters."""
        return Membership(
            self.dht, run_id, spec_hash, call_timeout_s=self.call_timeout_s, _shared=self._shared
        )

    def set_auth(self, auth: RunAuth | None) -> None:
        """Prove membership in writes and require it in reads (see the module docstring)."""
        if auth is not None and auth.run_id != self.run_id:
            raise ConfigError(f"access rules of run {auth.run_id!r} cannot guard run {self.run_id!r}")
        self.auth = auth

    def _proof(self) -> dict:
        return {} if self.auth is None else self.auth.record_proof(self.peer_id)

    # ------------------------------------------------------------------------------- plumbing

    @property
    def peer_id(self) -> str:
        """This node's peer id (what its peer records must carry)."""
        return self._signer.peer_id

    @property
    def rejected(self) -> int:
        """How many records readers dropped as invalid so far (all runs of this DHT)."""
        return self._shared.rejected

    @property
    def rejected_reasons(self) -> collections.Counter[str]:
        return self._shared.reasons

    def _call(self, fn: Callable[[], T]) -> T:
        if not self.dht.is_alive():
            raise PeerFailure("this process's DHT node has stopped; restart the command")
        with self._shared.lock:
            return fn()

    def _result(self, future: Any, what: str) -> Any:
        try:
            return future.result(timeout=self.call_timeout_s)
        except TimeoutError:
            raise PeerFailure(
                f"the DHT did not answer {what} within {self.call_timeout_s:.0f} s; the DHT process may "
                "have died or the network is partitioned"
            ) from None

    def _store(self, key: str, subkey: bytes, value: dict, expiration_s: float) -> bool:
        expiration = _dht_time() + _check_expiration(expiration_s)
        TRAFFIC.add(
            f"dht_store.{record_kind(key)}", header=len(key) + len(subkey), payload=_packed_size(value)
        )
        return bool(
            self._call(
                lambda: self._result(
                    self.dht.store(
                        key, value, expiration, subkey=subkey, beam_size=DHT_STORE_BEAM, return_future=True
                    ),
                    f"store {key}",
                )
            )
        )

    def _get_many(self, keys: list[str]) -> list[dict[Any, Any]]:
        """``get(latest=True)`` of several keys, in one walk of the DHT for all of them."""

        for key in keys:
            TRAFFIC.add(f"dht_get.{record_kind(key)}", header=len(key))

        def run() -> list[Any]:
            if len(keys) == 1:
                return [
                    self._result(self.dht.get(keys[0], latest=True, return_future=True), f"get {keys[0]}")
                ]
            # note "one walk for several keys" (swarm/dht/network.py): fewer RPCs than one walk per key
            walk = functools.partial(get_latest_many, keys=tuple(keys))
            found = self._result(self.dht.run_coroutine(walk, return_future=True), f"get {', '.join(keys)}")
            return [found.get(key) for key in keys]

        out = []
        for key, found in zip(keys, self._call(run), strict=True):
            value = getattr(found, "value", None)
            if found is not None and not isinstance(value, Mapping):
                self._reject(f"{key} holds a plain value instead of one subkey per writer")
                value = None
            out.append(
                {
                    subkey: getattr(item, "value", None)
                    for subkey, item in (value or {}).items()
                    if getattr(item, "value", None) is not None
                }
            )
        return out

    def _reject(self, reason: str) -> None:
        with self._shared.counter_lock:
            self._shared.rejected += 1
            self._shared.reasons[reason] += 1
        logger.debug("dropped a DHT record: %s", reason)

    def _parse(self, items: Mapping[Any, Any], parse: Callable[[Any, Any], T]) -> list[T]:
        out = []
        for subkey, value in items.items():
            try:
                out.append(parse(value, subkey))
            except RecordError as e:
                self._reject(str(e))
        return out

    def _run(self) -> str:
        if self.run_id is None:
            raise ConfigError("this Membership has no run id; use membership.for_run(RUN_ID) for run records")
        return self.run_id

    # ----------------------------------------------------------------------------------- spec

    def publish_spec(self, spec: RunSpec, expiration_s: float = SPEC_EXPIRATION_S) -> None:
        """Publish the run spec (canonical JSON bytes) signed by this node, the run's owner.

        Refuses specs over ``MAX_SPEC_BYTES`` (DHT values near 45 KB crash hivemind). Raises
        ``PeerFailure`` if no DHT node accepted the record.
        """
        run_id = self._run()
        if spec.run_id != run_id:
            raise ConfigError(f"spec of run {spec.run_id!r} cannot be published as run {run_id!r}")
        canonical = spec.canonical_bytes()
        if len(canonical) > MAX_SPEC_BYTES:
            raise ConfigError(
                f"run spec {run_id!r} is {len(canonical)} bytes of JSON, above the {MAX_SPEC_BYTES}-byte "
                "limit for DHT values; give `stages` as a count instead of explicit ranges"
            )
        record = SpecRecord(run_id=run_id, spec_hash=spec.spec_hash, canonical=canonical)
        if not self._store(spec_key(run_id), self._signer.marker, record.to_wire(), expiration_s):
            raise PeerFailure(f"no DHT node accepted the spec of run {run_id!r}; is the DHT connected?")
        self.spec, self.spec_hash = spec, spec.spec_hash

    def fetch_spec(self, timeout_s: float = 30.0) -> RunSpec:
        """Find the run's spec in the DHT, check its content hash, and return it.

        Waits up to ``timeout_s`` for it to appear. If ``spec_hash`` is set, only a spec with that
        hash is accepted; otherwise all valid published specs must agree (two owners publishing
        different specs under one run id raise ``RecordError``: pass the intended hash).
        """
        from swarm.run.spec import RunSpec

        run_id = self._run()
        deadline = time.monotonic() + timeout_s
        while True:
            [items] = self._get_many([spec_key(run_id)])
            candidates: dict[str, RunSpec] = {}
            for record in self._parse(items, lambda v, s: SpecRecord.from_wire(v, subkey=s, run_id=run_id)):
                try:
                    spec = RunSpec.from_json(record.canonical)
                except ConfigError as e:
                    self._reject(f"spec {record.spec_hash} does not parse: {e}")
                    continue
                if spec.spec_hash != record.spec_hash or spec.run_id != run_id:
                    # The bytes were not canonical for this software: another version, or tampering.
                    self._reject(
                        f"spec {record.spec_hash} re-hashes to {spec.spec_hash} (run {spec.run_id!r})"
                    )
                    continue
                candidates[spec.spec_hash] = spec
            if self.spec_hash is not None:
                candidates = {h: s for h, s in candidates.items() if h == self.spec_hash}
            if len(candidates) == 1:
                [spec] = candidates.values()
                self.spec, self.spec_hash = spec, spec.spec_hash
                return spec
            if len(candidates) > 1:
                raise RecordError(
                    f"run {run_id!r} has {len(candidates)} different specs in the DHT "
                    f"({', '.join(sorted(candidates))}); ask the run's owner for its spec hash and pass it"
                )
            if time.monotonic() >= deadline:
                wanted = f" with hash {self.spec_hash}" if self.spec_hash else ""
                raise ConfigError(
                    f"no valid spec{wanted} for run {run_id!r} found in the DHT within {timeout_s:.0f} s; "
                    "check --run, and that `swarm init` for this run is running and reachable from "
                    "--initial-peers (`swarm runs --initial-peers ...` lists the runs it knows)"
                )
            time.sleep(_POLL_S)

    # ---------------------------------------------------------------------------- peer records

    def announce(self, record: PeerRecord, expiration_s: float = PEER_EXPIRATION_S) -> bool:
        """Publish this peer's record for its stage; call every ``ANNOUNCE_PERIOD_S`` seconds.

        Returns False if no DHT node accepted it (the caller retries at its next refresh).
        """
        run_id = self._run()
        if record.run_id != run_id:
            raise ConfigError(f"record of run {record.run_id!r} cannot be announced in run {run_id!r}")
        if record.peer_id != self.peer_id:
            raise ConfigError(
                f"record peer_id {record.peer_id!r} is not this node's ({self.peer_id}); records are signed "
                "by the node that announces them: build them with peer_id=membership.peer_id"
            )
        if self.spec_hash is not None and record.spec_hash != self.spec_hash:
            raise ConfigError(f"record spec hash {record.spec_hash} differs from the run's {self.spec_hash}")
        if self.spec is not None and record.stage >= self.spec.num_stages:
            raise ConfigError(
                f"stage {record.stage} does not exist: run {run_id!r} has {self.spec.num_stages}"
            )
        return self._store(
            stage_key(run_id, record.stage),
            self._signer.marker,
            record.to_wire() | self._proof(),
            expiration_s,
        )

    def announce_leaving(self, record: PeerRecord, expiration_s: float = PEER_EXPIRATION_S) -> bool:
        """Announce ``record`` with ``state="leaving"`` (before stopping, or before moving stage)."""
        import dataclasses

        return self.announce(dataclasses.replace(record, state="leaving"), expiration_s)

    def _parse_stage(self, run_id: str, stage: int, items: Mapping[Any, Any]) -> dict[str, PeerRecord]:
        spec_hash = self.spec_hash
        auth = self.auth

        def parse(value: Any, subkey: Any) -> PeerRecord:
            record = PeerRecord.from_wire(
                value, subkey=subkey, run_id=run_id, stage=stage, spec_hash=spec_hash
            )
            if auth is not None:
                auth.check_record(record.peer_id, value)
            return record

        records = self._parse(items, parse)
        return {r.peer_id: r for r in sorted(records, key=lambda r: r.peer_id)}

    def stage_records(self, stage: int) -> dict[str, PeerRecord]:
        """Valid records of ``stage`` by peer id (all states; ``leaving`` included)."""
        run_id = self._run()
        [items] = self._get_many([stage_key(run_id, stage)])
        return self._parse_stage(run_id, stage, items)

    def all_stage_records(self, num_stages: int | None = None) -> list[dict[str, PeerRecord]]:
        """``stage_records`` of every stage (index = stage), read in one batch.

        ``num_stages`` defaults to the spec's (after ``fetch_spec``/``publish_spec``).
        """
        run_id = self._run()
        if num_stages is None:
            if self.spec is None:
                raise ConfigError(
                    "the number of stages is unknown: call fetch_spec() first or pass num_stages"
                )
            num_stages = self.spec.num_stages
        keys = [stage_key(run_id, stage) for stage in range(num_stages)]
        return [self._parse_stage(run_id, s, items) for s, items in enumerate(self._get_many(keys))]

    # -------------------------------------------------------------------------------- registry

    def register_run(
        self, spec: RunSpec, *, peers: int = 0, expiration_s: float = REGISTRY_EXPIRATION_S
    ) -> bool:
        """List the run in the swarm's registry (refresh before ``expiration_s``); ``peers`` = active peers seen."""
        entry = RunEntry(
            run_id=spec.run_id,
            spec_hash=spec.spec_hash,
            num_stages=spec.num_stages,
            n_params=spec.n_params(),
            n_layers=spec.model.n_layers,
            d_model=spec.model.d_model,
            peers=peers,
            owner=self.peer_id,
        )
        subkey = labelled_subkey(spec.run_id, self._signer.marker)
        return self._store(REGISTRY_KEY, subkey, entry.to_wire(), expiration_s)

    def list_runs(self) -> list[RunEntry]:
        """Valid registry entries of the swarm, sorted by run id (a run listed by two owners appears twice)."""
        [items] = self._get_many([REGISTRY_KEY])
        entries = self._parse(items, lambda v, s: RunEntry.from_wire(v, subkey=s))
        return sorted(entries, key=lambda e: (e.run_id, e.owner))

    # -------------------------------------------------------------------------------- progress

    def publish_progress(
        self,
        trainer_id: str,
        tokens: int,
        steps: int,
        loss: float | None,
        *,
        tokens_per_s: float = 0.0,
        expiration_s: float = PROGRESS_EXPIRATION_S,
    ) -> bool:
        """Publish one trainer's totals since it started (one subkey per trainer id and node)."""
        run_id = self._run()
        if self.spec_hash is None:
            raise ConfigError("the run's spec hash is unknown: call fetch_spec() before publishing progress")
        record = ProgressRecord(
            trainer_id=trainer_id,
            run_id=run_id,
            spec_hash=self.spec_hash,
            tokens=tokens,
            steps=steps,
            loss=None if loss is None else float(loss),
            tokens_per_s=float(tokens_per_s),
        )
        subkey = labelled_subkey(trainer_id, self._signer.marker)
        return self._store(progress_key(run_id), subkey, record.to_wire() | self._proof(), expiration_s)

    def progress(self) -> dict[str, Any]:
        """Training progress of the run's live trainers, summed.

        Returns ``{"trainers": {trainer_id: {"tokens", "steps", "loss", "tokens_per_s"}},
        "tokens": int, "steps": int, "tokens_per_s": float, "loss": float | None}`` where ``loss``
        is the mean of the trainers' last losses. A trainer that stopped drops out after its record
        expires (``PROGRESS_EXPIRATION_S``), and its tokens with it.
        """
        run_id = self._run()
        [items] = self._get_many([progress_key(run_id)])
        spec_hash = self.spec_hash
        auth = self.auth

        def parse(value: Any, subkey: Any) -> ProgressRecord:
            record = ProgressRecord.from_wire(value, subkey=subkey, run_id=run_id, spec_hash=spec_hash)
            if auth is not None:
                auth.check_record(peer_id_of_subkey(subkey), value)
            return record

        records = self._parse(items, parse)
        trainers: dict[str, dict[str, Any]] = {}
        for r in sorted(records, key=lambda r: r.trainer_id):
            trainers[r.trainer_id] = {
                "tokens": r.tokens,
                "steps": r.steps,
                "loss": r.loss,
                "tokens_per_s": r.tokens_per_s,
            }
        losses = [r.loss for r in records if r.loss is not None]
        return {
            "trainers": trainers,  # two trainers that share an id (a user mistake) show as one, summed below
            "tokens": sum(r.tokens for r in records),
            "steps": sum(r.steps for r in records),
            "tokens_per_s": math.fsum(r.tokens_per_s for r in records),
            "loss": math.fsum(losses) / len(losses) if losses else None,
        }

    # ----------------------------------------------------------------- snapshots and stage events

    def publish_snapshot_index(
        self, index: SnapshotIndex, expiration_s: float = SNAPSHOT_INDEX_EXPIRATION_S
    ) -> bool:
        """Publish what this keeper holds (one subkey per keeper; refresh before it expires)."""
        run_id = self._run()
        if index.run_id != run_id or index.keeper_id != self.peer_id:
            raise ConfigError(
                f"snapshot index of run {index.run_id!r} by {index.keeper_id} cannot be published by "
                f"{self.peer_id} in run {run_id!r}: build it with keeper_id=membership.peer_id"
            )
        return self._store(
            snapshots_key(run_id), self._signer.marker, index.to_wire() | self._proof(), expiration_s
        )

    def snapshot_indexes(self) -> list[SnapshotIndex]:
        """Valid snapshot indexes of the run's live keepers, sorted by keeper id."""
        run_id = self._run()
        [items] = self._get_many([snapshots_key(run_id)])
        spec_hash, auth = self.spec_hash, self.auth

        def parse(value: Any, subkey: Any) -> SnapshotIndex:
            index = SnapshotIndex.from_wire(value, subkey=subkey, run_id=run_id, spec_hash=spec_hash)
            if auth is not None:
                auth.check_record(index.keeper_id, value)
            return index

        return sorted(self._parse(items, parse), key=lambda i: i.keeper_id)

    def publish_event(self, event: StageEvent, expiration_s: float = EVENT_EXPIRATION_S) -> bool:
        """Publish a stage event (a rollback or a fresh start) for trainers and monitors to show."""
        run_id = self._run()
        if event.run_id != run_id or event.peer_id != self.peer_id:
            raise ConfigError(
                f"event of run {event.run_id!r} by {event.peer_id} cannot be published by {self.peer_id} "
                f"in run {run_id!r}: build it with peer_id=membership.peer_id"
            )
        subkey = labelled_subkey(event.event_id, self._signer.marker)
        return self._store(events_key(run_id), subkey, event.to_wire() | self._proof(), expiration_s)

    def events(self) -> list[StageEvent]:
        """Valid stage events of the run (the last ``EVENT_EXPIRATION_S``), oldest first."""
        run_id = self._run()
        [items] = self._get_many([events_key(run_id)])
        spec_hash, auth = self.spec_hash, self.auth

        def parse(value: Any, subkey: Any) -> StageEvent:
            event = StageEvent.from_wire(value, subkey=subkey, run_id=run_id, spec_hash=spec_hash)
            if auth is not None:
                auth.check_record(event.peer_id, value)
            return event

        return sorted(self._parse(items, parse), key=lambda e: (e.at, e.peer_id))
