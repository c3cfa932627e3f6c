"""DHT records of a run: their keys, their wire format, and how a reader validates them.

Everything a swarm says about itself lives in the hivemind DHT under string keys. This module is
the single source of truth for those keys and values; it has no networking (``membership.py`` does
the DHT calls) and imports no hivemind, so it is cheap to import and to unit test.

Keys (all strings; ``<run>`` is the run id)::

    swarmpipe_runs                registry: one subkey per (run, owner), value: RunEntry
    swarmpipe_<run>_spec          the run spec: subkey = owner marker, value: SpecRecord
    swarmpipe_<run>_stage_<i>     stage i: one subkey per peer, value: PeerRecord
    swarmpipe_<run>_progress      one subkey per trainer, value: ProgressRecord
    swarmpipe_<run>_snapshots     one subkey per keeper (swarm/tools/keeper.py), value: SnapshotIndex
    swarmpipe_<run>_events        one subkey per (event, peer), value: StageEvent (a stage restored
                                  from a snapshot or checkpoint, or restarted from initial weights)

Why this scheme: hivemind keys may be any msgpack value (they are hashed into DHT ids), but
``SchemaValidator`` can only check keys spelled ``<prefix>_<field>``, so every key here has that
shape (prefix ``swarmpipe`` for the registry, ``swarmpipe_<run>`` for a run). Run ids are limited
to ``[A-Za-z0-9_-]{1,64}`` (the rule of ``RunSpec.run_id``): no '.', because hivemind averager prefixes built from the run
id must not contain one, and no separator surprises in keys.

Subkeys are *owner markers*: the ``[owner:ssh-rsa ...]`` bytes of hivemind's
``RSASignatureValidator``, optionally preceded by a label (``b"<run> "`` in the registry,
``b"<trainer_id> "`` for progress). A record under such a subkey can only be written by the
holder of that RSA key, and since ``network.start_dht`` makes the libp2p identity the same RSA key,
a reader also checks that a peer record's ``peer_id`` is the peer id of the key in its subkey. A
record whose subkey carries no marker, or whose claimed peer id belongs to another key, is forged.

Every value is a msgpack dict with ``"v": RECORD_VERSION``; unknown fields are ignored (newer
peers may add fields without a version bump; a bump means an incompatible change). Readers call
the ``*.from_wire`` constructors, which raise ``RecordError`` on anything malformed; callers in
``membership.py`` drop such records and count them, so garbage in the DHT never crashes a reader.

The pydantic (v1) schemas at the end are what ``network.start_dht`` installs in every DHT node, so
nodes refuse wrong types before storing them. They are deliberately looser than ``from_wire`` (they
cannot see the run id or spec hash a reader expects), never stricter: a test checks that every
record ``from_wire`` accepts passes them, so all our nodes agree on what may be stored.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import pydantic.v1 as pydantic

from swarm.errors import ConfigError, RecordError
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

RECORD_VERSION = 1
KEY_PREFIX = "swarmpipe"
REGISTRY_FIELD = "runs"
REGISTRY_KEY = f"{KEY_PREFIX}_{REGISTRY_FIELD}"
# Stage fields are spelled out in the DHT schema, so the schema needs an upper bound.
MAX_STAGES = 256
# The DHT process dies on values of ~45 KB (docs/HIVEMIND.md, "DHT"); a spec is a few hundred bytes.
MAX_SPEC_BYTES = 16 * 1024
PEER_STATES = ("joining", "online", "leaving", "reading")
ACTIVE_STATES = frozenset({"joining", "online"})
PeerState = Literal["joining", "online", "leaving", "reading"]

_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the rule of RunSpec.run_id (swarm/run/spec.py)
_LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
_SPEC_HASH_RE = re.compile(r"[0-9a-f]{16}")
_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58
_OWNER_RE = re.compile(rb"\[owner:(.+?)\]")
_MAX_STR = 128
_MAX_CODECS = 16
_MAX_THROUGHPUT = 1e12  # tokens/s; anything above is a lie, not a measurement
_MAX_COUNT = 1 << 62  # tokens, steps, queue, version: fits msgpack int64 with room


# --------------------------------------------------------------------------------------------- keys


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it can name DHT keys, else raise ``ConfigError`` (see module docstring)."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
        raise ConfigError(
            f"run id {run_id!r} cannot name DHT keys: use 1 to 64 characters from A-Z a-z 0-9 _ - "
            "(no '.', no spaces), e.g. 'tiny-run_1'"
        )
    return run_id


def run_prefix(run_id: str) -> str:
    """The prefix of every key of a run (also the ``SchemaValidator`` prefix for ``RunKeysSchema``)."""
    return f"{KEY_PREFIX}_{check_run_id(run_id)}"


def stage_key(run_id: str, stage: int) -> str:
    """Key holding one subkey per peer serving ``stage`` of ``run_id``."""
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < MAX_STAGES:
        raise ConfigError(f"stage {stage!r} is out of range: stages are integers 0..{MAX_STAGES - 1}")
    return f"{run_prefix(run_id)}_stage_{stage}"


def spec_key(run_id: str) -> str:
    """Key holding the owner-signed run spec."""
    return f"{run_prefix(run_id)}_spec"


def progress_key(run_id: str) -> str:
    """Key holding one subkey per trainer with its training progress."""
    return f"{run_prefix(run_id)}_progress"


def snapshots_key(run_id: str) -> str:
    """Key holding one subkey per keeper with the versions of the stage snapshots it holds."""
    return f"{run_prefix(run_id)}_snapshots"


def events_key(run_id: str) -> str:
    """Key holding the run's stage events (one labelled subkey per event and peer)."""
    return f"{run_prefix(run_id)}_events"


# ------------------------------------------------------------------------------------------ subkeys


def owner_marker_in(subkey: object) -> bytes:
    """Return the ``[owner:...]`` marker inside ``subkey``; ``RecordError`` if there is not exactly one."""
    if not isinstance(subkey, bytes):
        raise RecordError(
            f"subkey of type {type(subkey).__name__} is not signed: expected bytes with an owner key"
        )
    found = _OWNER_RE.findall(subkey)
    if len(found) != 1:
        raise RecordError(
            f"subkey holds {len(found)} owner keys, expected exactly 1: the record is not signed"
        )
    return b"[owner:" + found[0] + b"]"


def labelled_subkey(label: str, marker: bytes) -> bytes:
    """A subkey ``b"<label> " + marker``: one signed subkey per label (run id, trainer id) per owner."""
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        raise ConfigError(
            f"label {label!r} cannot be part of a DHT subkey: use 1 to 128 characters from "
            "A-Z a-z 0-9 _ . : @ -, starting with a letter or digit"
        )
    return label.encode() + b" " + marker


def subkey_label(subkey: bytes) -> str:
    """The label of a ``labelled_subkey``; ``RecordError`` if it has none or is not signed."""
    marker = owner_marker_in(subkey)
    if not subkey.endswith(b" " + marker):
        raise RecordError("labelled subkey must be '<label> [owner:...]'")
    label = subkey[: -len(marker) - 1].decode("ascii", errors="replace")
    if not _LABEL_RE.fullmatch(label):
        raise RecordError(f"subkey label {label[:40]!r} is not a valid label")
    return label


def _b58encode(data: bytes) -> str:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    number = int.from_bytes(data, "big")
    out = ""
    while number:
        number, rem = divmod(number, 58)
        out = alphabet[rem] + out
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def peer_id_from_ssh_public_key(ssh_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH format.

    libp2p's rule: protobuf ``PublicKey{key_type=RSA(0), data=DER SubjectPublicKeyInfo}``, hashed
    with sha2-256 as a multihash (RSA keys are too long for the identity hash). Raises
    ``RecordError`` if the bytes are not an RSA public key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    try:
        key = serialization.load_ssh_public_key(ssh_key)
    except (ValueError, TypeError) as e:  # cryptography raises these for malformed keys
        raise RecordError(f"owner key is not a valid OpenSSH public key: {e}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise RecordError(f"owner key is a {type(key).__name__}, expected RSA")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    message = b"\x08\x00" + b"\x12" + _varint(len(der)) + der  # proto2: required key_type is always written
    return _b58encode(b"\x12\x20" + hashlib.sha256(message).digest())


def peer_id_of_subkey(subkey: object) -> str:
    """The peer id owning a signed subkey (the RSA key inside its owner marker)."""
    marker = owner_marker_in(subkey)
    return peer_id_from_ssh_public_key(marker[len(b"[owner:") : -1])


# -------------------------------------------------------------------------------- field validators


def _wire_dict(value: object, kind: str) -> dict:
    if not isinstance(value, dict):
        raise RecordError(f"{kind} value is a {type(value).__name__}, expected a dict")
    version = value.get("v")
    if version != RECORD_VERSION or isinstance(version, bool):
        raise RecordError(
            f"{kind} has record version {version!r}; this software reads version {RECORD_VERSION}"
        )
    return value


def _str(d: dict, name: str, pattern: re.Pattern | None = None, max_len: int = _MAX_STR) -> str:
    value = d.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise RecordError(
            f"field {name!r}={value!r:.60} must be a non-empty string of at most {max_len} chars"
        )
    if pattern is not None and not pattern.fullmatch(value):
        raise RecordError(f"field {name!r}={value!r:.60} does not match {pattern.pattern}")
    return value


def _count(d: dict, name: str) -> int:
    value = d.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_COUNT:
        raise RecordError(f"field {name!r}={value!r:.40} must be an integer in 0..2**62")
    return value


def _rate(d: dict, name: str) -> float:
    value = d.get(name)
    if not isinstance(value, float) or not math.isfinite(value) or not 0.0 <= value <= _MAX_THROUGHPUT:
        raise RecordError(f"field {name!r}={value!r:.40} must be a finite float in [0, 1e12]")
    return value


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    """What one stage peer says about itself, refreshed every few seconds with a short expiration."""

    peer_id: str  # libp2p peer id (base58) of the peer's DHT/P2P identity
    run_id: str
    stage: int
    # joining: loading weights; online: serving; leaving: about to go; reading: downloads the stage's
    # state and serves nothing (``swarm export`` of a gated run: peers share state only with listed ids)
    state: PeerState
    throughput: float  # tokens/s of forward+backward on this stage, as measured by the peer; finite, >= 0
    queue: int  # requests waiting in the peer's compute queue
    version: int  # local weight version (optimizer steps taken on this stage)
    codecs: tuple[str, ...]  # codec names this peer can decode
    spec_hash: str  # RunSpec.spec_hash the peer runs with
    software: str = __version__  # swarm.version.__version__ of the peer

    def __post_init__(self) -> None:
        # Coerce the natural local spellings (int throughput, list of codecs) before the strict checks.
        if isinstance(self.throughput, int) and not isinstance(self.throughput, bool):
            object.__setattr__(self, "throughput", float(self.throughput))
        if isinstance(self.codecs, list):
            object.__setattr__(self, "codecs", tuple(self.codecs))
        PeerRecord._validate(self.to_wire())

    def to_wire(self) -> dict:
        return {
            "v": RECORD_VERSION,
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "stage": self.stage,
            "state": self.state,
            "throughput": self.throughput,
            "queue": self.queue,
            "version": self.version,
            "codecs": list(self.codecs) if isinstance(self.codecs, tuple | list) else self.codecs,
            "spec_hash": self.spec_hash,
            "software": self.software,
        }

    @staticmethod
    def _validate(d: dict) -> dict:
        d = _wire_dict(d, "peer record")
        out = {
            "peer_id": _str(d, "peer_id", _PEER_ID_RE),
            "run_id": _str(d, "run_id", _RUN_ID_RE),
            "stage": _count(d, "stage"),
            "state": _str(d, "state"),
            "throughput": _rate(d, "throughput"),
            "queue": _count(d, "queue"),
            "version": _count(d, "version"),
            "spec_hash": _str(d, "spec_hash", _SPEC_HASH_RE),
            "software": _str(d, "software", max_len=32),
        }
        if out["stage"] >= MAX_STAGES:
            raise RecordError(f"field 'stage'={out['stage']} is not below {MAX_STAGES}")
        if out["state"] not in PEER_STATES:
            raise RecordError(f"field 'state'={out['state']!r:.40} is not one of {PEER_STATES}")
        codecs = d.get("codecs")
        if (
            not isinstance(codecs, list)
            or len(codecs) > _MAX_CODECS
            or not all(isinstance(c, str) and 0 < len(c) <= 64 for c in codecs)
        ):
            raise RecordError(f"field 'codecs'={codecs!r:.80} must be a list of at most 16 short strings")
        out["codecs"] = tuple(codecs)
        return out

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
        fields = cls._validate(value)  # type: ignore[arg-type]
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
class RunEntry:
    """One run in the registry of a swarm (what ``swarm runs`` lists)."""

    run_id: str
    spec_hash: str
    num_stages: int
    n_params: int  # parameters of the whole model (RunSpec.n_params())
    n_layers: int
    d_model: int
    peers: int  # active stage peers the publisher saw when it last refreshed the entry
    owner: str  # peer id of the node that publishes the entry (the run's bootstrap)
    software: str = __version__

    def __post_init__(self) -> None:
        RunEntry._validate(self.to_wire())

    def to_wire(self) -> dict:
        return {"v": RECORD_VERSION, **{k: getattr(self, k) for k in self.__dataclass_fields__}}

    @staticmethod
    def _validate(d: object) -> dict:
        d = _wire_dict(d, "run entry")
        out = {
            "run_id": _str(d, "run_id", _RUN_ID_RE),
            "spec_hash": _str(d, "spec_hash", _SPEC_HASH_RE),
            "num_stages": _count(d, "num_stages"),
            "n_params": _count(d, "n_params"),
            "n_layers": _count(d, "n_layers"),
            "d_model": _count(d, "d_model"),
            "peers": _count(d, "peers"),
            "owner": _str(d, "owner", _PEER_ID_RE),
            "software": _str(d, "software", max_len=32),
        }
        if not 1 <= out["num_stages"] <= MAX_STAGES:
            raise RecordError(f"field 'num_stages'={out['num_stages']} must be in 1..{MAX_STAGES}")
        return out

    @classmethod
    def from_wire(cls, value: object, *, subkey: object) -> RunEntry:
        """Validate a registry value; its subkey must be ``labelled_subkey(run_id, owner marker)``."""
        fields = cls._validate(value)
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
class ProgressRecord:
    """Training progress one trainer reports for a run (summed by ``Membership.progress``)."""

    trainer_id: str
    run_id: str
    spec_hash: str
    tokens: int  # tokens whose gradients reached every stage, since the trainer started
    steps: int  # micro-batches applied, since the trainer started
    loss: float | None  # last loss the trainer saw, None before the first one
    tokens_per_s: float  # the trainer's recent rate
    software: str = __version__

    def __post_init__(self) -> None:
        for name in ("loss", "tokens_per_s"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        ProgressRecord._validate(self.to_wire())

    def to_wire(self) -> dict:
        return {"v": RECORD_VERSION, **{k: getattr(self, k) for k in self.__dataclass_fields__}}

    @staticmethod
    def _validate(d: object) -> dict:
        d = _wire_dict(d, "progress record")
        loss = d.get("loss")
        if loss is not None and (not isinstance(loss, float) or not math.isfinite(loss)):
            raise RecordError(f"field 'loss'={loss!r:.40} must be a finite float or None")
        return {
            "trainer_id": _str(d, "trainer_id", _LABEL_RE),
            "run_id": _str(d, "run_id", _RUN_ID_RE),
            "spec_hash": _str(d, "spec_hash", _SPEC_HASH_RE),
            "tokens": _count(d, "tokens"),
            "steps": _count(d, "steps"),
            "loss": loss,
            "tokens_per_s": _rate(d, "tokens_per_s"),
            "software": _str(d, "software", max_len=32),
        }

    @classmethod
    def from_wire(
        cls, value: object, *, subkey: object, run_id: str, spec_hash: str | None = None
    ) -> ProgressRecord:
        """Validate a progress value; its subkey must be ``labelled_subkey(trainer_id, owner marker)``."""
        fields = cls._validate(value)
        if fields["run_id"] != run_id:
            raise RecordError(f"progress of run {fields['run_id']!r} found under run {run_id!r}")
        if spec_hash is not None and fields["spec_hash"] != spec_hash:
            raise RecordError(f"progress has spec hash {fields['spec_hash']}, this run's is {spec_hash}")
        if subkey_label(subkey) != fields["trainer_id"]:  # type: ignore[arg-type]
            raise RecordError(f"progress of trainer {fields['trainer_id']!r} is filed under another subkey")
        return cls(**fields)


_MAX_TIME = 1e11  # wall-clock seconds (year ~5138): anything above is garbage


def _time(d: dict, name: str) -> float:
    value = d.get(name)
    if not isinstance(value, float) or not math.isfinite(value) or not 0.0 <= value <= _MAX_TIME:
        raise RecordError(f"field {name!r}={value!r:.40} must be a finite float of wall-clock seconds")
    return value


def _version_list(d: dict, name: str, n: int | None) -> tuple[int, ...]:
    """A list of per-stage versions, -1 = none."""
    value = d.get(name)
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_STAGES
        or (n is not None and len(value) != n)
        or not all(isinstance(v, int) and not isinstance(v, bool) and -1 <= v <= _MAX_COUNT for v in value)
    ):
        want = f"{n}" if n is not None else f"1..{MAX_STAGES}"
        raise RecordError(f"field {name!r}={value!r:.60} must be a list of {want} integers >= -1")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class SnapshotIndex:
    """What one keeper holds: per stage, the version of its newest snapshot (-1: none), when it was
    taken, and the highest version it saw the stage's live peers announce (-1: none seen)."""

    keeper_id: str  # peer id of the keeper (must sign the subkey)
    run_id: str
    spec_hash: str
    versions: tuple[int, ...]
    taken_at: tuple[float, ...]  # wall-clock seconds, 0.0 where there is no snapshot
    seen: tuple[int, ...]
    interval_s: float  # how often the keeper takes snapshots
    software: str = __version__

    def __post_init__(self) -> None:
        for name in ("versions", "taken_at", "seen"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "taken_at", tuple(float(t) for t in self.taken_at))
        if isinstance(self.interval_s, int) and not isinstance(self.interval_s, bool):
            object.__setattr__(self, "interval_s", float(self.interval_s))
        SnapshotIndex._validate(self.to_wire())

    def to_wire(self) -> dict:
        return {
            "v": RECORD_VERSION,
            "keeper_id": self.keeper_id,
            "run_id": self.run_id,
            "spec_hash": self.spec_hash,
            "versions": list(self.versions),
            "taken_at": list(self.taken_at),
            "seen": list(self.seen),
            "interval_s": self.interval_s,
            "software": self.software,
        }

    @staticmethod
    def _validate(d: object) -> dict:
        d = _wire_dict(d, "snapshot index")
        versions = _version_list(d, "versions", None)
        taken = d.get("taken_at")
        if (
            not isinstance(taken, list)
            or len(taken) != len(versions)
            or not all(isinstance(t, float) and math.isfinite(t) and 0.0 <= t <= _MAX_TIME for t in taken)
        ):
            raise RecordError(f"field 'taken_at'={taken!r:.60} must be {len(versions)} wall-clock floats")
        return {
            "keeper_id": _str(d, "keeper_id", _PEER_ID_RE),
            "run_id": _str(d, "run_id", _RUN_ID_RE),
            "spec_hash": _str(d, "spec_hash", _SPEC_HASH_RE),
            "versions": versions,
            "taken_at": tuple(taken),
            "seen": _version_list(d, "seen", len(versions)),
            "interval_s": _rate(d, "interval_s"),
            "software": _str(d, "software", max_len=32),
        }

    @classmethod
    def from_wire(
        cls, value: object, *, subkey: object, run_id: str, spec_hash: str | None = None
    ) -> SnapshotIndex:
        """Validate an index read from ``snapshots_key(run_id)``; the subkey must be the keeper's marker."""
        fields = cls._validate(value)
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
class StageEvent:
    """A stage lost its live state: a peer restored it from a snapshot or checkpoint (``rollback``) or
    started it from initial weights (``fresh``, only with ``--start-fresh``) in a run that had trained."""

    peer_id: str  # the peer that started the stage (signs the subkey)
    run_id: str
    spec_hash: str
    stage: int
    kind: str  # one of EVENT_KINDS
    source: str  # one of EVENT_SOURCES: where the stage's state came from
    version: int  # the version the stage continues from
    lost_from: int  # the highest version the stage was last seen at (-1: unknown)
    at: float  # wall-clock seconds when it happened
    software: str = __version__

    def __post_init__(self) -> None:
        if isinstance(self.at, int) and not isinstance(self.at, bool):
            object.__setattr__(self, "at", float(self.at))
        StageEvent._validate(self.to_wire())

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

    def to_wire(self) -> dict:
        return {"v": RECORD_VERSION, **{k: getattr(self, k) for k in self.__dataclass_fields__}}

    @staticmethod
    def _validate(d: object) -> dict:
        d = _wire_dict(d, "stage event")
        out = {
            "peer_id": _str(d, "peer_id", _PEER_ID_RE),
            "run_id": _str(d, "run_id", _RUN_ID_RE),
            "spec_hash": _str(d, "spec_hash", _SPEC_HASH_RE),
            "stage": _count(d, "stage"),
            "kind": _str(d, "kind"),
            "source": _str(d, "source"),
            "version": _count(d, "version"),
            "at": _time(d, "at"),
            "software": _str(d, "software", max_len=32),
        }
        lost = d.get("lost_from")
        if not isinstance(lost, int) or isinstance(lost, bool) or not -1 <= lost <= _MAX_COUNT:
            raise RecordError(f"field 'lost_from'={lost!r:.40} must be an integer >= -1")
        out["lost_from"] = lost
        if out["stage"] >= MAX_STAGES:
            raise RecordError(f"field 'stage'={out['stage']} is not below {MAX_STAGES}")
        if out["kind"] not in EVENT_KINDS:
            raise RecordError(f"field 'kind'={out['kind']!r:.40} is not one of {EVENT_KINDS}")
        if out["source"] not in EVENT_SOURCES:
            raise RecordError(f"field 'source'={out['source']!r:.40} is not one of {EVENT_SOURCES}")
        return out

    @classmethod
    def from_wire(
        cls, value: object, *, subkey: object, run_id: str, spec_hash: str | None = None
    ) -> StageEvent:
        """Validate an event from ``events_key(run_id)``; its subkey is ``labelled_subkey(event_id, marker)``."""
        fields = cls._validate(value)
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
class SpecRecord:
    """The run spec as published: canonical JSON bytes plus their hash, signed by the run owner."""

    run_id: str
    spec_hash: str
    canonical: bytes = field(repr=False)  # RunSpec.canonical_bytes()

    def __post_init__(self) -> None:
        SpecRecord._validate(self.to_wire())

    def to_wire(self) -> dict:
        return {
            "v": RECORD_VERSION,
            "run_id": self.run_id,
            "spec_hash": self.spec_hash,
            "spec": self.canonical,
        }

    @staticmethod
    def _validate(d: object) -> dict:
        d = _wire_dict(d, "spec record")
        canonical = d.get("spec")
        if not isinstance(canonical, bytes) or not 0 < len(canonical) <= MAX_SPEC_BYTES:
            size = len(canonical) if isinstance(canonical, bytes) else type(canonical).__name__
            raise RecordError(f"field 'spec' ({size}) must be 1..{MAX_SPEC_BYTES} bytes of canonical JSON")
        out = {
            "run_id": _str(d, "run_id", _RUN_ID_RE),
            "spec_hash": _str(d, "spec_hash", _SPEC_HASH_RE),
            "canonical": canonical,
        }
        actual = spec_hash_of(canonical)
        if actual != out["spec_hash"]:
            raise RecordError(f"spec bytes hash to {actual}, the record claims {out['spec_hash']}")
        return out

    @classmethod
    def from_wire(cls, value: object, *, subkey: object, run_id: str) -> SpecRecord:
        """Validate a spec value (content hash included); the subkey must be an owner marker."""
        fields = cls._validate(value)
        if fields["run_id"] != run_id:
            raise RecordError(f"spec of run {fields['run_id']!r} found under run {run_id!r}")
        if owner_marker_in(subkey) != subkey:
            raise RecordError("spec subkey must be exactly the owner's key marker")
        return cls(**fields)


# ------------------------------------------------------------------ DHT-level schemas (pydantic v1)
# hivemind.dht.schema.SchemaValidator checks each stored (key, subkey, value) against these; it
# forbids type conversions, so numbers use strict types. ``Extra.allow`` on the value models keeps
# newer peers' extra fields valid (the validator compares the parsed dict with the raw one).


class _Value(pydantic.BaseModel):
    v: pydantic.StrictInt

    class Config:
        extra = pydantic.Extra.allow


class PeerRecordSchema(_Value):
    peer_id: pydantic.StrictStr
    run_id: pydantic.StrictStr
    stage: pydantic.conint(strict=True, ge=0, lt=MAX_STAGES)
    state: pydantic.StrictStr
    throughput: pydantic.confloat(strict=True, ge=0.0, le=_MAX_THROUGHPUT)
    queue: pydantic.conint(strict=True, ge=0)
    version: pydantic.conint(strict=True, ge=0)
    codecs: list[pydantic.StrictStr]
    spec_hash: pydantic.StrictStr
    software: pydantic.StrictStr


class RunEntrySchema(_Value):
    run_id: pydantic.StrictStr
    spec_hash: pydantic.StrictStr
    num_stages: pydantic.conint(strict=True, ge=1, le=MAX_STAGES)
    peers: pydantic.conint(strict=True, ge=0)


class ProgressSchema(_Value):
    trainer_id: pydantic.StrictStr
    run_id: pydantic.StrictStr
    tokens: pydantic.conint(strict=True, ge=0)
    steps: pydantic.conint(strict=True, ge=0)
    loss: pydantic.StrictFloat | None
    tokens_per_s: pydantic.confloat(strict=True, ge=0.0)


class SnapshotIndexSchema(_Value):
    keeper_id: pydantic.StrictStr
    run_id: pydantic.StrictStr
    versions: list[pydantic.StrictInt]
    taken_at: list[pydantic.StrictFloat]
    seen: list[pydantic.StrictInt]


class StageEventSchema(_Value):
    peer_id: pydantic.StrictStr
    run_id: pydantic.StrictStr
    stage: pydantic.conint(strict=True, ge=0, lt=MAX_STAGES)
    kind: pydantic.StrictStr
    version: pydantic.conint(strict=True, ge=0)
    lost_from: pydantic.conint(strict=True, ge=-1)
    at: pydantic.StrictFloat


class SpecSchema(_Value):
    run_id: pydantic.StrictStr
    spec_hash: pydantic.StrictStr
    spec: pydantic.conbytes(strict=True, min_length=1, max_length=MAX_SPEC_BYTES)


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
        if len(_OWNER_RE.findall(value)) != 1:
            raise ValueError("subkey must carry exactly one [owner:...] marker")
        return value


class _KeysConfig:
    # hivemind's SchemaValidator sets ``schema.Config.extra``; a model without its own Config would
    # make it change pydantic's global BaseConfig for every model in the process.
    extra = pydantic.Extra.forbid


# Keys of the DHT schema are ``<prefix>_<field>``: see ``run_prefix`` and the module docstring.
RegistryKeysSchema = pydantic.create_model(
    "RegistryKeysSchema",
    __module__=__name__,
    __config__=_KeysConfig,
    **{REGISTRY_FIELD: (dict[_OwnerBytes, RunEntrySchema] | None, None)},
)
RunKeysSchema = pydantic.create_model(
    "RunKeysSchema",
    __module__=__name__,
    __config__=_KeysConfig,
    spec=(dict[_OwnerBytes, SpecSchema] | None, None),
    progress=(dict[_OwnerBytes, ProgressSchema] | None, None),
    snapshots=(dict[_OwnerBytes, SnapshotIndexSchema] | None, None),
    events=(dict[_OwnerBytes, StageEventSchema] | None, None),
    **{f"stage_{i}": (dict[_OwnerBytes, PeerRecordSchema] | None, None) for i in range(MAX_STAGES)},
)
