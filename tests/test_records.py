"""DHT records (swarm/dht/records.py): keys, wire format, validation of what readers receive."""

from __future__ import annotations

import math
import time

import pytest
from cryptography.hazmat.primitives import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.dht import records as R
from swarm.errors import ConfigError, RecordError
from swarm.version import __version__
from tests.helpers import make_owner

SPEC_HASH = "0123456789abcdef"


@pytest.fixture(scope="module")
def owner():
    return make_owner()


@pytest.fixture(scope="module")
def other():
    return make_owner()


def peer_wire(owner_id: str, /, **changes) -> dict:
    rec = R.PeerRecord(
        peer_id=owner_id,
        run_id="tiny",
        stage=1,
        state="online",
        throughput=120.5,
        queue=2,
        version=7,
        codecs=("fp16", "blockwise8"),
        spec_hash=SPEC_HASH,
    )
    return {**rec.to_wire(), **changes}


def test_peer_id_of_an_rsa_key_matches_libp2p(owner):
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    key, marker, peer_id = owner
    der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    identity = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    assert PeerID.from_identity(identity).to_base58() == peer_id == R.peer_id_of_subkey(marker)


def test_valid_peer_record_round_trips_and_tolerates_unknown_fields(owner):
    _, marker, peer_id = owner
    wire = peer_wire(peer_id, added_in_a_later_release={"x": 1})
    rec = R.PeerRecord.from_wire(wire, subkey=marker, run_id="tiny", stage=1, spec_hash=SPEC_HASH)
    assert rec.peer_id == peer_id and rec.throughput == 120.5 and rec.codecs == ("fp16", "blockwise8")
    assert rec.software == __version__
    assert R.PeerRecord.from_wire(rec.to_wire(), subkey=marker, run_id="tiny", stage=1) == rec


@pytest.mark.parametrize(
    "changes, rule",
    [
        ({"throughput": float("nan")}, "throughput"),
        ({"throughput": float("inf")}, "throughput"),
        ({"throughput": -1.0}, "throughput"),
        ({"throughput": 120}, "throughput"),  # an int on the wire is a type error, not a number
        ({"stage": "1"}, "stage"),
        ({"stage": True}, "stage"),
        ({"queue": -3}, "queue"),
        ({"version": 1.5}, "version"),
        ({"state": "dancing"}, "state"),
        ({"codecs": "fp16"}, "codecs"),
        ({"codecs": [1, 2]}, "codecs"),
        ({"spec_hash": "feedfacefeedface"}, "spec hash"),
        ({"spec_hash": "XYZ"}, "spec_hash"),
        ({"run_id": "other"}, "run"),
        ({"stage": 2}, "stage"),
        ({"v": 2}, "version"),
        ({"peer_id": None}, "peer_id"),
        ({"software": "x" * 100}, "software"),
    ],
)
def test_each_kind_of_bad_peer_record_is_refused(owner, changes, rule):
    _, marker, peer_id = owner
    with pytest.raises(RecordError, match=rule):
        R.PeerRecord.from_wire(
            peer_wire(peer_id, **changes), subkey=marker, run_id="tiny", stage=1, spec_hash=SPEC_HASH
        )


def test_forged_and_unsigned_subkeys_are_refused(owner, other):
    _, marker, peer_id = owner
    _, other_marker, _ = other
    wire = peer_wire(peer_id)
    with pytest.raises(RecordError, match="forged"):  # another key claims this peer id
        R.PeerRecord.from_wire(wire, subkey=other_marker, run_id="tiny", stage=1)
    for subkey in (peer_id, peer_id.encode(), b"[owner:garbage]", marker + other_marker, None):
        with pytest.raises(RecordError):
            R.PeerRecord.from_wire(wire, subkey=subkey, run_id="tiny", stage=1)


def test_non_dict_values_are_refused(owner):
    _, marker, _ = owner
    for value in (None, 3, "text", b"bytes", [1, 2], {"v": 1}):
        with pytest.raises(RecordError):
            R.PeerRecord.from_wire(value, subkey=marker, run_id="tiny", stage=1)


@settings(max_examples=200, deadline=None)
@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=12),
        max_leaves=20,
    ),
    subkey=st.none() | st.binary(max_size=40) | st.text(max_size=10),
)
def test_readers_raise_only_record_error_on_garbage(value, subkey):
    for parse in (
        lambda: R.PeerRecord.from_wire(value, subkey=subkey, run_id="tiny", stage=0),
        lambda: R.RunEntry.from_wire(value, subkey=subkey),
        lambda: R.ProgressRecord.from_wire(value, subkey=subkey, run_id="tiny"),
        lambda: R.SpecRecord.from_wire(value, subkey=subkey, run_id="tiny"),
    ):
        with pytest.raises(RecordError):
            parse()


def test_building_a_bad_record_locally_fails_early():
    with pytest.raises(RecordError, match="throughput"):
        R.PeerRecord(
            peer_id="Qm" + "z" * 30,
            run_id="tiny",
            stage=0,
            state="online",
            throughput=math.nan,
            queue=0,
            version=0,
            codecs=(),
            spec_hash=SPEC_HASH,
        )
    rec = R.PeerRecord(
        peer_id="Qm" + "z" * 30,
        run_id="tiny",
        stage=0,
        state="joining",
        throughput=3,
        queue=0,
        version=0,
        codecs=["fp16"],
        spec_hash=SPEC_HASH,
    )
    assert rec.throughput == 3.0 and isinstance(rec.throughput, float) and rec.codecs == ("fp16",)


def test_registry_entry_is_bound_to_its_run_and_owner(owner, other):
    _, marker, peer_id = owner
    entry = R.RunEntry(
        run_id="tiny",
        spec_hash=SPEC_HASH,
        num_stages=4,
        n_params=10**6,
        n_layers=8,
        d_model=256,
        peers=3,
        owner=peer_id,
    )
    subkey = R.labelled_subkey("tiny", marker)
    assert R.RunEntry.from_wire(entry.to_wire(), subkey=subkey) == entry
    with pytest.raises(RecordError, match="another run"):
        R.RunEntry.from_wire(entry.to_wire(), subkey=R.labelled_subkey("other", marker))
    with pytest.raises(RecordError, match="forged"):
        R.RunEntry.from_wire(entry.to_wire(), subkey=R.labelled_subkey("tiny", other[1]))
    with pytest.raises(RecordError, match="num_stages"):
        R.RunEntry.from_wire({**entry.to_wire(), "num_stages": 0}, subkey=subkey)


def test_progress_record(owner):
    _, marker, _ = owner
    rec = R.ProgressRecord(
        trainer_id="trainer-1",
        run_id="tiny",
        spec_hash=SPEC_HASH,
        tokens=4096,
        steps=8,
        loss=None,
        tokens_per_s=512,
    )
    subkey = R.labelled_subkey("trainer-1", marker)
    assert R.ProgressRecord.from_wire(rec.to_wire(), subkey=subkey, run_id="tiny") == rec
    assert rec.tokens_per_s == 512.0
    for bad in (
        {"loss": float("nan")},
        {"tokens": -1},
        {"tokens_per_s": float("inf")},
        {"trainer_id": "x y"},
    ):
        with pytest.raises(RecordError):
            R.ProgressRecord.from_wire({**rec.to_wire(), **bad}, subkey=subkey, run_id="tiny")
    with pytest.raises(RecordError, match="spec hash"):
        R.ProgressRecord.from_wire(rec.to_wire(), subkey=subkey, run_id="tiny", spec_hash="feedfacefeedface")
    with pytest.raises(RecordError, match="another subkey"):
        R.ProgressRecord.from_wire(
            rec.to_wire(), subkey=R.labelled_subkey("trainer-2", marker), run_id="tiny"
        )


def test_spec_record_checks_content_hash_and_size(owner):
    _, marker, _ = owner
    canonical = b'{"run_id":"tiny","seed":0}'
    rec = R.SpecRecord(run_id="tiny", spec_hash=R.spec_hash_of(canonical), canonical=canonical)
    assert R.SpecRecord.from_wire(rec.to_wire(), subkey=marker, run_id="tiny") == rec
    tampered = {**rec.to_wire(), "spec": canonical.replace(b"0", b"1")}
    with pytest.raises(RecordError, match="hash"):
        R.SpecRecord.from_wire(tampered, subkey=marker, run_id="tiny")
    big = b"x" * (R.MAX_SPEC_BYTES + 1)
    with pytest.raises(RecordError, match="bytes"):
        R.SpecRecord(run_id="tiny", spec_hash=R.spec_hash_of(big), canonical=big)
    with pytest.raises(RecordError, match="owner"):
        R.SpecRecord.from_wire(rec.to_wire(), subkey=R.labelled_subkey("tiny", marker), run_id="tiny")


def test_keys_and_run_ids():
    assert R.stage_key("tiny", 3) == "swarmpipe_tiny_stage_3"
    assert R.spec_key("tiny") == "swarmpipe_tiny_spec"
    assert R.progress_key("tiny-2_b") == "swarmpipe_tiny-2_b_progress"
    assert R.REGISTRY_KEY == "swarmpipe_runs"
    for bad in ("", "a.b", "x" * 65, "a b", "é", None, 3):
        with pytest.raises(ConfigError, match="run id"):
            R.check_run_id(bad)
    for bad in (-1, R.MAX_STAGES, 1.0, True):
        with pytest.raises(ConfigError, match="stage"):
            R.stage_key("tiny", bad)
    with pytest.raises(ConfigError, match="label"):
        R.labelled_subkey("has space", b"[owner:x]")


def test_dht_schema_accepts_what_readers_accept_and_refuses_garbage(owner):
    """All nodes must agree: the DHT-level schema may never drop a record that readers accept."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    _, marker, peer_id = owner
    run_schema = SchemaValidator(R.RunKeysSchema, prefix=R.run_prefix("tiny"), allow_extra_keys=True)
    registry_schema = SchemaValidator(R.RegistryKeysSchema, prefix=R.KEY_PREFIX, allow_extra_keys=True)

    def ok(validator, key, subkey, value) -> bool:
        record = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(),
            subkey=MSGPackSerializer.dumps(subkey),
            value=MSGPackSerializer.dumps(value),
            expiration_time=time.time() + 10,
        )
        return validator.validate(record)

    canonical = b'{"run_id":"tiny"}'
    spec = R.SpecRecord(run_id="tiny", spec_hash=R.spec_hash_of(canonical), canonical=canonical)
    progress = R.ProgressRecord(
        trainer_id="t1", run_id="tiny", spec_hash=SPEC_HASH, tokens=1, steps=1, loss=2.5, tokens_per_s=3.0
    )
    entry = R.RunEntry(
        run_id="tiny",
        spec_hash=SPEC_HASH,
        num_stages=2,
        n_params=1000,
        n_layers=2,
        d_model=8,
        peers=0,
        owner=peer_id,
    )
    assert ok(run_schema, R.stage_key("tiny", 1), marker, peer_wire(peer_id, future_field=[1]))
    assert ok(
        run_schema, R.stage_key("tiny", R.MAX_STAGES - 1), marker, peer_wire(peer_id, stage=R.MAX_STAGES - 1)
    )
    assert ok(run_schema, R.spec_key("tiny"), marker, spec.to_wire())
    assert ok(run_schema, R.progress_key("tiny"), R.labelled_subkey("t1", marker), progress.to_wire())
    assert ok(registry_schema, R.REGISTRY_KEY, R.labelled_subkey("tiny", marker), entry.to_wire())
    assert ok(run_schema, "some_other_key", "any", 1)  # keys of other software pass through

    for bad in ({"throughput": float("nan")}, {"throughput": -1.0}, {"throughput": 7}, {"stage": "1"}):
        assert not ok(run_schema, R.stage_key("tiny", 1), marker, peer_wire(peer_id, **bad))
    assert not ok(run_schema, R.stage_key("tiny", 1), b"no marker", peer_wire(peer_id))
    assert not ok(run_schema, R.stage_key("tiny", 1), marker, "garbage")
    assert not ok(
        run_schema, R.spec_key("tiny"), marker, {**spec.to_wire(), "spec": b"x" * (R.MAX_SPEC_BYTES + 1)}
    )
    assert not ok(
        registry_schema, R.REGISTRY_KEY, R.labelled_subkey("tiny", marker), {**entry.to_wire(), "peers": -1}
    )


# sha256 of MSGPackSerializer.dumps(record.to_wire()): the bytes every DHT node stores and compares.
# A refactoring of records.py must not change them (old and new peers must read each other).
GOLDEN_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
GOLDEN_WIRE = {
    "peer": "dc9f3a71c4ee201bf504d42868dd8d6b474496113810102851edf4bf0cbbbe73",
    "entry": "843c72849b7513b76339f422b9b50b717483d68710d1e722662b22609b3919cf",
    "progress": "1c88996211be6d2ddff3c4f522157f7d3d9d2bd1f4adde0d7c872119eb360890",
    "progress_noloss": "eb0d2cd20f35f9b8f66ce4426d9fe90e25f5298a14638ddf263c18b3e90507ab",
    "snapshots": "54510355cea3a46659b76e2a5b7f177beeb47ad55a8d742eb6ea9f8c6a5dff51",
    "event": "84ce5ae8a3193cdef2ce7a39bc20e2332149ff926075e26ecb46f1ea6192becb",
    "spec": "312122b1238cf1c49ebfeeba10454371a5f0fd0a77fde54a1ac79a709eb68260",
}


def golden_records() -> dict[str, object]:
    pid, h, sw, canonical = GOLDEN_ID, SPEC_HASH, "0.9.1", b'{"run_id":"tiny","seed":0}'
    return {
        "peer": R.PeerRecord(
            peer_id=pid,
            run_id="tiny",
            stage=3,
            state="online",
            throughput=1234.5,
            queue=2,
            version=7,
            codecs=("fp16", "blockwise8"),
            spec_hash=h,
            software=sw,
        ),
        "entry": R.RunEntry(
            run_id="tiny",
            spec_hash=h,
            num_stages=4,
            n_params=10**6,
            n_layers=8,
            d_model=256,
            peers=3,
            owner=pid,
            software=sw,
        ),
        "progress": R.ProgressRecord(
            trainer_id="trainer-1",
            run_id="tiny",
            spec_hash=h,
            tokens=4096,
            steps=8,
            loss=2.25,
            tokens_per_s=512,
            software=sw,
        ),
        "progress_noloss": R.ProgressRecord(
            trainer_id="t",
            run_id="tiny",
            spec_hash=h,
            tokens=0,
            steps=0,
            loss=None,
            tokens_per_s=0.0,
            software=sw,
        ),
        "snapshots": R.SnapshotIndex(
            keeper_id=pid,
            run_id="tiny",
            spec_hash=h,
            versions=[3, -1],
            taken_at=[1700000000.5, 0],
            seen=[4, -1],
            interval_s=30,
            software=sw,
        ),
        "event": R.StageEvent(
            peer_id=pid,
            run_id="tiny",
            spec_hash=h,
            stage=1,
            kind="rollback",
            source="keeper",
            version=5,
            lost_from=9,
            at=1700000000.25,
            software=sw,
        ),
        "spec": R.SpecRecord(run_id="tiny", spec_hash=R.spec_hash_of(canonical), canonical=canonical),
    }


def test_record_bytes_on_the_wire_are_pinned():
    import hashlib

    from hivemind.utils import MSGPackSerializer

    found = {
        name: hashlib.sha256(MSGPackSerializer.dumps(rec.to_wire())).hexdigest()
        for name, rec in golden_records().items()
    }
    assert found == GOLDEN_WIRE


_ODD_VALUES = (
    None,
    True,
    -1,
    0,
    7,
    1.5,
    -2.0,
    math.nan,
    "",
    "x",
    "x" * 200,
    b"x",
    [],
    ["fp16"],
    [1],
    [-1, 3],
    {},
)


def test_dht_schema_and_readers_share_each_field_rule(owner):
    """The schema is derived from the record declarations: on every field, a value the readers' field
    rules refuse is refused by DHT nodes too, and anything the readers accept is stored."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    _, marker, _ = owner
    run_schema = SchemaValidator(R.RunKeysSchema, prefix=R.run_prefix("tiny"), allow_extra_keys=True)
    registry_schema = SchemaValidator(R.RegistryKeysSchema, prefix=R.KEY_PREFIX, allow_extra_keys=True)
    where = {
        "peer": (run_schema, R.stage_key("tiny", 3)),
        "entry": (registry_schema, R.REGISTRY_KEY),
        "progress": (run_schema, R.progress_key("tiny")),
        "snapshots": (run_schema, R.snapshots_key("tiny")),
        "event": (run_schema, R.events_key("tiny")),
        "spec": (run_schema, R.spec_key("tiny")),
    }
    checked = 0
    for name, (validator, key) in where.items():
        rec = golden_records()[name]
        for field_name, good in rec.to_wire().items():
            for odd in (*_ODD_VALUES, good):
                wire = {**rec.to_wire(), field_name: odd}
                record = DHTRecord(
                    key=DHTID.generate(source=key).to_bytes(),
                    subkey=MSGPackSerializer.dumps(marker),
                    value=MSGPackSerializer.dumps(wire),
                    expiration_time=time.time() + 10,
                )
                stored = validator.validate(record)
                try:
                    type(rec).parse_wire(wire)
                except RecordError as e:
                    if str(e).startswith("field "):  # a field rule, not one between fields
                        assert not stored, (name, field_name, odd)
                        checked += 1
                else:
                    assert stored, (name, field_name, odd)
    assert checked > 300


def _reference_b58encode(data: bytes) -> str:
    """Base58 (bitcoin alphabet) written out: what records.py used before it took the base58 package."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    number, out = int.from_bytes(data, "big"), ""
    while number:
        number, rem = divmod(number, 58)
        out = alphabet[rem] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def _reference_varint(n: int) -> bytes:
    """Unsigned LEB128 written out: what records.py used before it took the varint package."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


@settings(max_examples=2000, deadline=None)
@given(data=st.binary(max_size=64), n=st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_installed_base58_and_varint_encode_as_libp2p_peer_ids_need(data, n):
    import base58
    import varint

    assert base58.b58encode(data).decode() == _reference_b58encode(data)
    assert base58.b58encode(b"\0\0" + data).decode() == _reference_b58encode(b"\0\0" + data)
    assert varint.encode(n) == _reference_varint(n)
    for edge in (0, 127, 128, 16383, 16384, 294):  # 294: the DER length of a 2048-bit RSA key
        assert varint.encode(edge) == _reference_varint(edge)
