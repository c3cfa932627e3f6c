"""DHT keys of a run and their signed subkeys: how a record is named, and who may write it.

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
to ``swarm.run.limits.RUN_ID_RE`` (``[A-Za-z0-9_-]{1,64}``, also the rule of ``RunSpec.run_id``): no '.', because hivemind averager prefixes built from the run
id must not contain one, and no separator surprises in keys.

Subkeys are *owner markers*: the ``[owner:ssh-rsa ...]`` bytes of hivemind's
``RSASignatureValidator``, optionally preceded by a label (``b"<run> "`` in the registry,
``b"<trainer_id> "`` for progress). A record under such a subkey can only be written by the
holder of that RSA key, and since ``network.start_dht`` makes the libp2p identity the same RSA key,
a reader also checks that a peer record's ``peer_id`` is the peer id of the key in its subkey. A
record whose subkey carries no marker, or whose claimed peer id belongs to another key, is forged.
"""

from __future__ import annotations

import hashlib
import re

from swarm.errors import ConfigError, RecordError
from swarm.run.limits import MAX_STAGES, RUN_ID_RE

KEY_PREFIX = "swarmpipe"
REGISTRY_FIELD = "runs"
REGISTRY_KEY = f"{KEY_PREFIX}_{REGISTRY_FIELD}"
LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
"""A subkey label (run id, trainer id, event id): what ``labelled_subkey`` accepts."""
OWNER_MARKER_RE = re.compile(rb"\[owner:(.+?)\]")


# --------------------------------------------------------------------------------------------- keys


def check_run_id(run_id: object) -> str:
    """Return ``run_id`` if it can name DHT keys, else raise ``ConfigError`` (see module docstring)."""
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
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
    found = OWNER_MARKER_RE.findall(subkey)
    if len(found) != 1:
        raise RecordError(
            f"subkey holds {len(found)} owner keys, expected exactly 1: the record is not signed"
        )
    return b"[owner:" + found[0] + b"]"


def labelled_subkey(label: str, marker: bytes) -> bytes:
    """A subkey ``b"<label> " + marker``: one signed subkey per label (run id, trainer id) per owner."""
    if not isinstance(label, str) or not LABEL_RE.fullmatch(label):
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
    if not LABEL_RE.fullmatch(label):
        raise RecordError(f"subkey label {label[:40]!r} is not a valid label")
    return label


def peer_id_from_ssh_public_key(ssh_key: bytes) -> str:
    """The libp2p peer id (base58) of an RSA public key in OpenSSH format.

    libp2p's rule: protobuf ``PublicKey{key_type=RSA(0), data=DER SubjectPublicKeyInfo}``, hashed
    with sha2-256 as a multihash (RSA keys are too long for the identity hash). Raises
    ``RecordError`` if the bytes are not an RSA public key.
    """
    import base58
    import varint
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    try:
        key = serialization.load_ssh_public_key(ssh_key)
    except (ValueError, TypeError) as e:  # cryptography raises these for malformed keys
        raise RecordError(f"owner key is not a valid OpenSSH public key: {e}") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise RecordError(f"owner key is a {type(key).__name__}, expected RSA")
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    # proto2: the required key_type is always written, even at its default (RSA = 0)
    message = b"\x08\x00" + b"\x12" + varint.encode(len(der)) + der
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(message).digest()).decode()


def peer_id_of_subkey(subkey: object) -> str:
    """The peer id owning a signed subkey (the RSA key inside its owner marker)."""
    marker = owner_marker_in(subkey)
    return peer_id_from_ssh_public_key(marker[len(b"[owner:") : -1])
