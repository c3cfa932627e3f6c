"""DHT records of a run: their wire format, and how a reader validates them.

(Over 400 lines on purpose: one record class per kind of DHT value plus the DHT schemas derived from
them; split, the wire format every node must agree on would be scattered.)

Everything a swarm says about itself lives in the hivemind DHT under string keys. This module is
the single source of truth for the values, ``swarm/dht/keys.py`` for the keys and subkeys (who may
write a record; its names are importable from here too). Neither has networking (``membership.py``
does the DHT calls) nor imports hivemind, so both are cheap to import and to unit test.

Every value is a msgpack dict with ``"v": RECORD_VERSION``; unknown fields are ignored (newer
peers may add fields without a version bump; a bump means an incompatible change). Readers call
the ``*.from_wire`` constructors, which raise ``RecordError`` on anything malformed; callers in
``membership.py`` drop such records and count them, so garbage in the DHT never crashes a reader.

Each record is declared once, as a dataclass whose fields carry their wire rule
(``swarm/dht/wire_fields.py``). The pydantic (v1) schemas at the end, which ``network.start_dht``
installs in every DHT node so nodes refuse malformed values before storing them, are derived from
those declarations and run the readers' own field checks. They cannot see the run id, subkey or spec
hash a reader expects, so they are looser than ``from_wire`` there, never stricter: all our nodes
agree on what may be stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pydantic.v1 as pydantic

from swarm.dht.keys import (
    KEY_PREFIX,
    LABEL_RE,
    OWNER_MARKER_RE,
    REGISTRY_FIELD,
    REGISTRY_KEY,
    check_run_id,
    events_key,
    labelled_subkey,
    owner_marker_in,
    peer_id_from_ssh_public_key,
    peer_id_of_subkey,
    progress_key,
    run_prefix,
    snapshots_key,
    spec_key,
    stage_key,
    subkey_label,
)
from swarm.dht.wire_fields import RECORD_VERSION, Rule, WireRecord, blob, choice, count, items, real, text
from swarm.errors import RecordError
from swarm.run.limits import MAX_SPEC_BYTES, MAX_STAGES, PEER_ID_RE, RUN_ID_RE, SPEC_HASH_RE
from swarm.version import __version__

__all__ = [
    "RECORD_VERSION",
    "KEY_PREFIX",
    "REGISTRY_KEY",
    "MAX_STAGES",
    "MAX_SPEC_BYTES",
    "PEER_STATES",
    "ACTIVE_STATES",
    "PeerState",
    "PeerRecord",
    "RunEntry",
    "ProgressRecord",
    "SpecRecord",
    "SnapshotIndex",
    "StageEvent",
    "EVENT_KINDS",
    "EVENT_SOURCES",
    "check_run_id",
    "run_prefix",
    "stage_key",
    "spec_key",
    "progress_key",
    "snapshots_key",
    "events_key",
    "owner_marker_in",
    "peer_id_of_subkey",
    "peer_id_from_ssh_public_key",
    "labelled_subkey",
    "subkey_label",
    "spec_hash_of",
    "RunKeysSchema",
    "RegistryKeysSchema",
]

PEER_STATES = ("joining", "online", "leaving", "reading")
ACTIVE_STATES = frozenset({"joining", "online"})
PeerState = Literal["joining", "online", "leaving", "reading"]

_MAX_CODECS = 16
_MAX_THROUGHPUT = 1e12  # tokens/s; anything above is a lie, not a measurement
_MAX_TIME = 1e11  # wall-clock seconds (year ~5138): anything above is garbage


# ---------------------------------------------------------------------------------------- records
# Each field is declared once, with its rule (swarm/dht/wire_fields.py): the wire dict, the readers'
# checks and the DHT nodes' schema all come from these declarations. Wire order = declaration order.


def _rule(rule: Rule, *, default: object = dataclasses.MISSING, wire_name: str | None = None) -> Any:
    metadata = {"rule": rule} if wire_name is None else {"rule": rule, "wire_name": wire_name}
    return field(default=default, metadata=metadata)


_PEER_ID = text(PEER_ID_RE)
_RUN_ID = text(RUN_ID_RE)
_SPEC_HASH = text(SPEC_HASH_RE)
_SOFTWARE = text(max_len=32)
_STAGE = count(0, MAX_STAGES - 1)
_RATE = real(0.0, _MAX_THROUGHPUT, "a finite float in [0, 1e12]")
_TIME = real(0.0, _MAX_TIME, "a finite float of wall-clock seconds")
_VERSIONS = items(count(-1), 1, MAX_STAGES, f"a list of 1..{MAX_STAGES} integers >= -1")


@dataclass(frozen=True, kw_only=True)
class PeerRecord(WireRecord):
    """What one stage peer says about itself, refreshed every few seconds with a short expiration."""

    KIND: ClassVar[str] = "peer record"

    peer_id: str = _rule(_PEER_ID)  # libp2p peer id (base58) of the peer's DHT/P2P identity
    run_id: str = _rule(_RUN_ID)
    stage: int = _rule(_STAGE)
    # joining: loading weights; online: serving; leaving: about to go; reading: downloads the stage's
    # state and serves nothing (``swarm export`` of a gated run: peers share state only with listed ids)
    state: PeerState = _rule(choice(PEER_STATES))
    # tokens/s of forward+backward on this stage, as measured by the peer
    throughput: float = _rule(_RATE)
    queue: int = _rule(count())  # requests waiting in the peer's compute queue
    version: int = _rule(count())  # local weight version (optimizer steps taken on this stage)
    codecs: tuple[str, ...] = _rule(  # codec names this peer can decode
        items(text(max_len=64), 0, _MAX_CODECS, f"a list of at most {_MAX_CODECS} short strings")
    )
    spec_hash: str = _rule(_SPEC_HASH)  # RunSpec.spec_hash the peer runs with
    software: str = _rule(_SOFTWARE, default=__version__)  # swarm.version.__version__ of the peer

    @classmethod
    def from_wire(
        cls,
        value: object,
        *,
        subkey: object,
        run_id: str,
        stage: int,
        spec_hash: str | None = None,
    ) -> PeerRecord:
        """Validate a value read from ``stage_key(run_id, stage)`` under ``subkey``.

        Raises ``RecordError`` if the value is malformed, belongs to another run, stage or spec
        hash (when ``spec_hash`` is given), or if ``subkey`` is not signed by the key of the claimed
        ``peer_id`` (a forged record).
        """
        fields = cls.parse_wire(value)
        if fields["run_id"] != run_id or fields["stage"] != stage:
            raise RecordError(
                f"record of run {fields['run_id']!r} stage {fields['stage']} found under run {run_id!r} stage {stage}"
            )
        if spec_hash is not None and fields["spec_hash"] != spec_hash:
            raise RecordError(f"record has spec hash {fields['spec_hash']}, this run's is {spec_hash}")
        owner = peer_id_of_subkey(subkey)
        if owner != fields["peer_id"]:
            raise RecordError(f"record claims peer {fields['peer_id']} but is signed by {owner}: forged")
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class RunEntry(WireRecord):
    """One run in the registry of a swarm (what ``swarm runs`` lists)."""

    KIND: ClassVar[str] = "run entry"

    run_id: str = _rule(_RUN_ID)
    spec_hash: str = _rule(_SPEC_HASH)
    num_stages: int = _rule(count(1, MAX_STAGES))
    n_params: int = _rule(count())  # parameters of the whole model (RunSpec.n_params())
    n_layers: int = _rule(count())
    d_model: int = _rule(count())
    peers: int = _rule(count())  # active stage peers the publisher saw when it last refreshed the entry
    owner: str = _rule(_PEER_ID)  # peer id of the node that publishes the entry (the run's bootstrap)
    software: str = _rule(_SOFTWARE, default=__version__)

    @classmethod
    def from_wire(cls, value: object, *, subkey: object) -> RunEntry:
        """Validate a registry value; its subkey must be ``labelled_subkey(run_id, owner marker)``."""
        fields = cls.parse_wire(value)
        if subkey_label(subkey) != fields["run_id"]:  # type: ignore[arg-type]
            raise RecordError(
                f"registry entry of run {fields['run_id']!r} is filed under another run's subkey"
            )
        owner = peer_id_of_subkey(subkey)
        if owner != fields["owner"]:
            raise RecordError(
                f"registry entry claims owner {fields['owner']} but is signed by {owner}: forged"
            )
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class ProgressRecord(WireRecord):
    """Training progress one trainer reports for a run (summed by ``Membership.progress``)."""

    KIND: ClassVar[str] = "progress record"

    trainer_id: str = _rule(text(LABEL_RE))
    run_id: str = _rule(_RUN_ID)
    spec_hash: str = _rule(_SPEC_HASH)
    tokens: int = _rule(count())  # tokens whose gradients reached every stage, since the trainer started
    steps: int = _rule(count())  # micro-batches applied, since the trainer started
    # last loss the trainer saw, None before the first one
    loss: float | None = _rule(real(None, None, "a finite float or None", nullable=True))
    tokens_per_s: float = _rule(_RATE)  # the trainer's recent rate
    software: str = _rule(_SOFTWARE, default=__version__)

    @classmethod
    def from_wire(
        cls, value: object, *, subkey: object, run_id: str, spec_hash: str | None = None
    ) -> ProgressRecord:
        """Validate a progress value; its subkey must be ``labelled_subkey(trainer_id, owner marker)``."""
        fields = cls.parse_wire(value)
        if fields["run_id"] != run_id:
            raise RecordError(f"progress of run {fields['run_id']!r} found under run {run_id!r}")
        if spec_hash is not None and fields["spec_hash"] != spec_hash:
            raise RecordError(f"progress has spec hash {fields['spec_hash']}, this run's is {spec_hash}")
        if subkey_label(subkey) != fields["trainer_id"]:  # type: ignore[arg-type]
            raise RecordError(f"progress of trainer {fields['trainer_id']!r} is filed under another subkey")
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class SnapshotIndex(WireRecord):
    """What one keeper holds: per stage, the version of its newest snapshot (-1: none), when it was
    taken, and the highest version it saw the stage's live peers announce (-1: none seen)."""

    KIND: ClassVar[str] = "snapshot index"

    keeper_id: str = _rule(_PEER_ID)  # peer id of the keeper (must sign the subkey)
    run_id: str = _rule(_RUN_ID)
    spec_hash: str = _rule(_SPEC_HASH)
    versions: tuple[int, ...] = _rule(_VERSIONS)
    # wall-clock seconds, 0.0 where there is no snapshot
    taken_at: tuple[float, ...] = _rule(items(_TIME, 1, MAX_STAGES, "a list of wall-clock floats"))
    seen: tuple[int, ...] = _rule(_VERSIONS)
    interval_s: float = _rule(_RATE)  # how often the keeper takes snapshots
    software: str = _rule(_SOFTWARE, default=__version__)

    @classmethod
    def cross_check(cls, fields: dict[str, Any]) -> None:
        n = len(fields["versions"])
        for name in ("taken_at", "seen"):
            if len(fields[name]) != n:
                raise RecordError(
                    f"{name!r} has {len(fields[name])} entries, 'versions' has {n}: one per stage"
                )

    @classmethod
    def from_wire(
        cls, value: object, *, subkey: object, run_id: str, spec_hash: str | None = None
    ) -> SnapshotIndex:
        """Validate an index read from ``snapshots_key(run_id)``; the subkey must be the keeper's marker."""
        fields = cls.parse_wire(value)
        if fields["run_id"] != run_id:
            raise RecordError(f"snapshot index of run {fields['run_id']!r} found under run {run_id!r}")
        if spec_hash is not None and fields["spec_hash"] != spec_hash:
            raise RecordError(
                f"snapshot index has spec hash {fields['spec_hash']}, this run's is {spec_hash}"
            )
        owner = peer_id_of_subkey(subkey)
        if owner != fields["keeper_id"]:
            raise RecordError(f"snapshot index claims keeper {fields['keeper_id']} but is signed by {owner}")
        return cls(**fields)


EVENT_KINDS = ("rollback", "fresh")
EVENT_SOURCES = ("keeper", "checkpoint", "seed")


@dataclass(frozen=True, kw_only=True)
class StageEvent(WireRecord):
    """A stage lost its live state: a peer restored it from a snapshot or checkpoint (``rollback``) or
    started it from initial weights (``fresh``, only with ``--start-fresh``) in a run that had trained."""

    KIND: ClassVar[str] = "stage event"

    peer_id: str = _rule(_PEER_ID)  # the peer that started the stage (signs the subkey)
    run_id: str = _rule(_RUN_ID)
    spec_hash: str = _rule(_SPEC_HASH)
    stage: int = _rule(_STAGE)
    kind: str = _rule(choice(EVENT_KINDS))
    source: str = _rule(choice(EVENT_SOURCES))  # where the stage's state came from
    version: int = _rule(count())  # the version the stage continues from
    lost_from: int = _rule(count(-1))  # the highest version the stage was last seen at (-1: unknown)
    at: float = _rule(_TIME)  # wall-clock seconds when it happened
    software: str = _rule(_SOFTWARE, default=__version__)

    @property
    def event_id(self) -> str:
        """The label of the event's subkey: unique per peer, stage and time (milliseconds)."""
        return f"s{self.stage}-{self.kind}-{int(self.at * 1000)}"

    @property
    def lost_versions(self) -> int | None:
        """Stage steps of training lost, when the version it was last seen at is known."""
        return None if self.lost_from < 0 else max(0, self.lost_from - self.version)

    def describe(self) -> str:
        """One line for trainers and the monitor."""
        lost = self.lost_versions
        lost_text = "" if lost is None else f"; {lost} stage step{'s' if lost != 1 else ''} of training lost"
        seen = "" if self.lost_from < 0 else f" (last seen at version {self.lost_from})"
        if self.kind == "fresh":
            return (
                f"stage {self.stage} restarted from its initial weights by peer {self.peer_id[:12]} "
                f"(--start-fresh){seen}{lost_text}"
            )
        what = "a keeper's snapshot" if self.source == "keeper" else f"a {self.source}"
        return (
            f"stage {self.stage} lost every live replica and was rolled back to {what} at version "
            f"{self.version}{seen}{lost_text}"
        )

    @classmethod
    def from_wire(
        cls, value: object, *, subkey: object, run_id: str, spec_hash: str | None = None
    ) -> StageEvent:
        """Validate an event from ``events_key(run_id)``; its subkey is ``labelled_subkey(event_id, marker)``."""
        fields = cls.parse_wire(value)
        if fields["run_id"] != run_id:
            raise RecordError(f"event of run {fields['run_id']!r} found under run {run_id!r}")
        if spec_hash is not None and fields["spec_hash"] != spec_hash:
            raise RecordError(f"event has spec hash {fields['spec_hash']}, this run's is {spec_hash}")
        owner = peer_id_of_subkey(subkey)
        if owner != fields["peer_id"]:
            raise RecordError(f"event claims peer {fields['peer_id']} but is signed by {owner}: forged")
        event = cls(**fields)
        if subkey_label(subkey) != event.event_id:  # type: ignore[arg-type]
            raise RecordError(f"event {event.event_id} is filed under another subkey")
        return event


def spec_hash_of(canonical: bytes) -> str:
    """16 hex chars of sha256: the same rule as ``RunSpec.spec_hash`` (over ``canonical_bytes()``)."""
    return hashlib.sha256(canonical).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class SpecRecord(WireRecord):
    """The run spec as published: canonical JSON bytes plus their hash, signed by the run owner."""

    KIND: ClassVar[str] = "spec record"

    run_id: str = _rule(_RUN_ID)
    spec_hash: str = _rule(_SPEC_HASH)
    canonical: bytes = field(  # RunSpec.canonical_bytes()
        repr=False,
        metadata={
            "rule": blob(MAX_SPEC_BYTES, f"1..{MAX_SPEC_BYTES} bytes of canonical JSON"),
            "wire_name": "spec",
        },
    )

    @classmethod
    def cross_check(cls, fields: dict[str, Any]) -> None:
        actual = spec_hash_of(fields["canonical"])
        if actual != fields["spec_hash"]:
            raise RecordError(f"spec bytes hash to {actual}, the record claims {fields['spec_hash']}")

    @classmethod
    def from_wire(cls, value: object, *, subkey: object, run_id: str) -> SpecRecord:
        """Validate a spec value (content hash included); the subkey must be an owner marker."""
        fields = cls.parse_wire(value)
        if fields["run_id"] != run_id:
            raise RecordError(f"spec of run {fields['run_id']!r} found under run {run_id!r}")
        if owner_marker_in(subkey) != subkey:
            raise RecordError("spec subkey must be exactly the owner's key marker")
        return cls(**fields)


# ------------------------------------------------------------------ DHT-level schemas (pydantic v1)
# hivemind.dht.schema.SchemaValidator checks each stored (key, subkey, value) against these. The value
# models come from the record declarations above (``WireRecord.v1_schema``); only the keys are here.


class _OwnerBytes(pydantic.ConstrainedBytes):
    """A bytes subkey that carries an ``[owner:...]`` marker (so RSASignatureValidator checks it)."""

    strict = True
    min_length = 1
    max_length = 2048

    @classmethod
    def __get_validators__(cls):
        yield from super().__get_validators__()
        yield cls._has_marker

    @classmethod
    def _has_marker(cls, value: bytes) -> bytes:
        if len(OWNER_MARKER_RE.findall(value)) != 1:
            raise ValueError("subkey must carry exactly one [owner:...] marker")
        return value


class _KeysConfig:
    # hivemind's SchemaValidator sets ``schema.Config.extra``; a model without its own Config would
    # make it change pydantic's global BaseConfig for every model in the process.
    extra = pydantic.Extra.forbid


def _signed(record: type[WireRecord]) -> tuple[object, None]:
    """An optional key field: a dict from signed subkeys to values of ``record``."""
    return (dict[_OwnerBytes, record.v1_schema()] | None, None)


# Keys of the DHT schema are ``<prefix>_<field>``: see ``run_prefix`` and the module docstring.
RegistryKeysSchema = pydantic.create_model(
    "RegistryKeysSchema",
    __module__=__name__,
    __config__=_KeysConfig,
    **{REGISTRY_FIELD: _signed(RunEntry)},
)
_PEER_RECORDS = _signed(PeerRecord)
RunKeysSchema = pydantic.create_model(
    "RunKeysSchema",
    __module__=__name__,
    __config__=_KeysConfig,
    spec=_signed(SpecRecord),
    progress=_signed(ProgressRecord),
    snapshots=_signed(SnapshotIndex),
    events=_signed(StageEvent),
    **{f"stage_{i}": _PEER_RECORDS for i in range(MAX_STAGES)},
)
