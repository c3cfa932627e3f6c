"""Pure logic of stage snapshots (swarm/dht/snapshots.py, the keeper's records): no sockets, no sleeps."""

from __future__ import annotations

import os
import time

import pytest
import torch

from swarm.dht import records as R
from swarm.dht.snapshots import (
    Restorable,
    Snapshot,
    SnapshotStore,
    StageStateLost,
    choose_newest,
    keeper_priority,
    last_seen_version,
    lost_state_message,
    prune_plan,
    training_evidence,
)
from swarm.errors import ConfigError, RecordError
from swarm.tools.keeper import KeeperConfig
from tests.helpers import make_owner

SPEC_HASH = "0123456789abcdef"


@pytest.fixture(scope="module")
def owner():
    return make_owner()


def snap(stage: int, version: int, n: int = 6, hash_: str = SPEC_HASH) -> Snapshot:
    meta = {"spec_hash": hash_, "stage": stage, "version": version, "names": ["w"], "step_count": version}
    return Snapshot(
        spec_hash=hash_,
        run_id="tiny",
        stage=stage,
        version=version,
        meta=meta,
        flat=torch.arange(n, dtype=torch.float32) + version,
        taken_at=1000.0 + version,
    )


def record(peer_id: str, stage: int, version: int, state: str = "online") -> R.PeerRecord:
    return R.PeerRecord(
        peer_id=peer_id,
        run_id="tiny",
        stage=stage,
        state=state,  # type: ignore[arg-type]
        throughput=1.0,
        queue=0,
        version=version,
        codecs=("none",),
        spec_hash=SPEC_HASH,
    )


def index(keeper_id: str, versions, seen=None) -> R.SnapshotIndex:
    return R.SnapshotIndex(
        keeper_id=keeper_id,
        run_id="tiny",
        spec_hash=SPEC_HASH,
        versions=tuple(versions),
        taken_at=tuple(0.0 if v < 0 else 1.0 for v in versions),
        seen=tuple(seen if seen is not None else versions),
        interval_s=60.0,
    )


# ------------------------------------------------------------------------------------ rotation


def test_prune_plan_keeps_the_newest():
    assert prune_plan([5, 1, 9, 3], keep=2) == [1, 3]
    assert prune_plan([5, 1], keep=3) == []
    assert prune_plan([], keep=1) == []
    assert prune_plan([4, 4, 2], keep=1) == [2]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="keep="):
            prune_plan([1], keep=bad)  # type: ignore[arg-type]


def test_store_rotates_and_reads_back(tmp_path):
    store = SnapshotStore(tmp_path, spec_hash=SPEC_HASH, keep=2)
    assert store.versions(0) == [] and store.newest(0) is None
    for v in (3, 7, 5, 9):
        store.write(snap(0, v))
    store.write(snap(1, 2))
    assert store.versions(0) == [7, 9]  # 3 and 5 rotated out (5 was older than 7 when written)
    assert store.versions(1) == [2]
    got = store.newest(0, numel=6)
    assert got is not None and got.version == 9 and got.taken_at == 1009.0
    torch.testing.assert_close(got.flat, snap(0, 9).flat)
    assert got.meta["step_count"] == 9
    with pytest.raises(ConfigError, match="holds 6 values, stage 0 needs 7"):
        store.read(0, 9, numel=7)


def test_write_is_atomic_a_crash_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path, spec_hash=SPEC_HASH, keep=3)
    store.write(snap(0, 1))

    def crash(obj, f, *a, **k):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        store.write(snap(0, 2))
    monkeypatch.undo()
    assert store.versions(0) == [1]
    assert os.listdir(store.stage_dir(0)) == ["v1.pt"]  # no temporary file left behind
    assert store.newest(0).version == 1


def test_newest_skips_unreadable_and_foreign_files(tmp_path):
    store = SnapshotStore(tmp_path, spec_hash=SPEC_HASH, keep=5)
    store.write(snap(0, 1))
    store.write(snap(0, 2))
    store.path(0, 3).write_bytes(b"garbage")  # a truncated file from elsewhere
    (store.stage_dir(0) / "notes.txt").write_text("not a snapshot")
    assert store.versions(0) == [1, 2, 3]
    assert store.newest(0).version == 2
    os.replace(store.path(0, 1), store.path(0, 4))  # a file whose name and content disagree
    with pytest.raises(ConfigError, match="not a snapshot of stage 0 version 4"):
        store.read(0, 4)
    assert store.newest(0).version == 2


def test_store_refuses_another_spec(tmp_path):
    store = SnapshotStore(tmp_path, spec_hash=SPEC_HASH)
    with pytest.raises(ConfigError, match="cannot go into the store"):
        store.write(snap(0, 1, hash_="fedcba9876543210"))
    with pytest.raises(ConfigError, match="spec_hash="):
        SnapshotStore(tmp_path, spec_hash="nothex")


# ------------------------------------------------------------------------------ choosing a state


def test_choose_newest():
    assert choose_newest([]) is None and choose_newest([None, None]) is None
    keeper, ckpt = Restorable("keeper", 12), Restorable("checkpoint", 9)
    assert choose_newest([keeper, ckpt]) is keeper
    assert choose_newest([None, Restorable("checkpoint", 13), keeper]).version == 13
    tie = Restorable("checkpoint", 12)
    assert choose_newest([keeper, tie]) is keeper  # a tie keeps the first


def test_training_evidence(owner):
    _, _, pid = owner
    fresh = [{pid: record(pid, 0, 0)}, {}]
    assert training_evidence(fresh, {"tokens": 0, "steps": 0}) is None
    assert training_evidence([{}, {}], None, [index(pid, [-1, -1])]) is None
    trained = [{pid: record(pid, 0, 0)}, {pid: record(pid, 1, 4, state="leaving")}]
    assert "stage 1 announces version 4" in training_evidence(trained, None)
    assert "1024 tokens" in training_evidence(fresh, {"tokens": 1024, "steps": 2})
    assert "stage 1 at version 8" in training_evidence(fresh, None, [index(pid, [-1, 3], seen=[-1, 8])])


def test_last_seen_version(owner):
    _, _, pid = owner
    assert last_seen_version(1, {}) == -1
    assert last_seen_version(1, {pid: record(pid, 1, 5)}) == 5
    assert last_seen_version(1, {pid: record(pid, 1, 5)}, [index(pid, [0, 3], seen=[0, 11])]) == 11
    assert last_seen_version(3, {}, [index(pid, [0, 3])]) == -1  # the index knows fewer stages


def test_keeper_priority_is_below_every_live_peer_and_prefers_newer():
    priorities = [keeper_priority(v) for v in (0, 1, 10, 10_000)]
    assert all(p < 0 for p in priorities)  # a live peer's priority is its version, >= 0
    assert priorities == sorted(priorities) and len(set(priorities)) == 4


def test_lost_state_message_names_the_stage_the_evidence_and_the_way_out():
    msg = lost_state_message("tiny", 1, "stage 0 announces version 40")
    assert "stage 1 of run 'tiny'" in msg and "stage 0 announces version 40" in msg
    assert "--start-fresh" in msg and "swarm keeper" in msg and "--checkpoint-dir" in msg
    assert issubclass(StageStateLost, ConfigError)


def test_keeper_config_refuses_bad_values():
    assert KeeperConfig(directory="d").interval_s == 180.0
    for kw, rule in (
        ({"interval_s": 0}, r"keeper\.interval_s = 0\.0 is invalid: it must be > 0"),
        ({"interval_s": float("nan")}, "interval_s = nan is invalid: it must be a finite number"),
        ({"keep": 0}, "keep = 0 is invalid: it must be >= 1"),
        ({"index_period_s": 90}, "at most 60"),
        ({"directory": ""}, "directory"),
    ):
        with pytest.raises(ConfigError, match=rule):
            KeeperConfig(**({"directory": "d"} | kw))


def test_peer_config_start_fresh_is_a_bool():
    from peer.config import PeerConfig

    assert PeerConfig(initial_peers=(), run_id="tiny").start_fresh is False
    with pytest.raises(ConfigError, match="start_fresh = 'yes' is invalid: it must be true or false"):
        PeerConfig(initial_peers=(), run_id="tiny", start_fresh="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- DHT records


def test_snapshot_index_round_trips_and_is_bound_to_its_keeper(owner):
    _, marker, pid = owner
    _, other_marker, _ = make_owner()
    idx = index(pid, [3, -1], seen=[5, 2])
    back = R.SnapshotIndex.from_wire(idx.to_wire(), subkey=marker, run_id="tiny", spec_hash=SPEC_HASH)
    assert back == idx
    with pytest.raises(RecordError, match="signed by"):
        R.SnapshotIndex.from_wire(idx.to_wire(), subkey=other_marker, run_id="tiny")
    with pytest.raises(RecordError, match="under run"):
        R.SnapshotIndex.from_wire(idx.to_wire(), subkey=marker, run_id="other")
    for bad in ({"versions": [1, -2]}, {"seen": [1]}, {"taken_at": [1.0]}, {"versions": []}):
        with pytest.raises(RecordError):
            R.SnapshotIndex.from_wire(idx.to_wire() | bad, subkey=marker, run_id="tiny")


def test_stage_event_round_trips_describes_itself_and_is_bound_to_its_subkey(owner):
    _, marker, pid = owner
    ev = R.StageEvent(
        peer_id=pid,
        run_id="tiny",
        spec_hash=SPEC_HASH,
        stage=1,
        kind="rollback",
        source="keeper",
        version=40,
        lost_from=46,
        at=time.time(),
    )
    subkey = R.labelled_subkey(ev.event_id, marker)
    assert R.StageEvent.from_wire(ev.to_wire(), subkey=subkey, run_id="tiny", spec_hash=SPEC_HASH) == ev
    assert ev.lost_versions == 6
    text = ev.describe()
    assert "stage 1" in text and "keeper's snapshot at version 40" in text and "6 stage steps" in text
    with pytest.raises(RecordError, match="another subkey"):
        R.StageEvent.from_wire(ev.to_wire(), subkey=R.labelled_subkey("s1-x-1", marker), run_id="tiny")
    with pytest.raises(RecordError, match="kind"):
        R.StageEvent.from_wire(ev.to_wire() | {"kind": "party"}, subkey=subkey, run_id="tiny")
    fresh = R.StageEvent(**{**ev.__dict__, "kind": "fresh", "source": "seed", "version": 0, "lost_from": -1})
    assert "initial weights" in fresh.describe() and fresh.lost_versions is None
    with pytest.raises(RecordError, match="lost_from"):
        R.StageEvent(**{**ev.__dict__, "lost_from": -2})


def test_dht_schema_accepts_snapshot_indexes_and_events(owner):
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    _, marker, pid = owner
    schema = SchemaValidator(R.RunKeysSchema, prefix=R.run_prefix("tiny"), allow_extra_keys=True)

    def ok(key, subkey, value) -> bool:
        record = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(),
            subkey=MSGPackSerializer.dumps(subkey),
            value=MSGPackSerializer.dumps(value),
            expiration_time=time.time() + 10,
        )
        return schema.validate(record)

    idx = index(pid, [3, -1])
    ev = R.StageEvent(
        peer_id=pid,
        run_id="tiny",
        spec_hash=SPEC_HASH,
        stage=0,
        kind="fresh",
        source="seed",
        version=0,
        lost_from=-1,
        at=1.5e9,
    )
    assert ok(R.snapshots_key("tiny"), marker, idx.to_wire())
    assert ok(R.events_key("tiny"), R.labelled_subkey(ev.event_id, marker), ev.to_wire())
    assert not ok(R.snapshots_key("tiny"), marker, idx.to_wire() | {"versions": [1.0, 2.0]})
    assert not ok(R.events_key("tiny"), b"no marker", ev.to_wire())


# ---------------------------------------------------------------------------------- keeper pacing


def test_download_gap_keeps_the_interval_on_fast_links_and_stretches_it_on_slow_ones():
    from swarm.tools.keeper import download_gap_s

    cfg = KeeperConfig(directory="d", interval_s=180.0, link_share=0.05)
    assert download_gap_s(1.5, cfg) == 180.0  # loopback: the interval decides
    assert download_gap_s(31.0, cfg) == pytest.approx(620.0)  # 77 MB at 20 Mbit/s: 5% of the link
    with pytest.raises(ConfigError, match=r"link_share = 0\.0 is invalid"):
        KeeperConfig(directory="d", link_share=0.0)
    with pytest.raises(ConfigError, match=r"link_share = 1\.5 is invalid"):
        KeeperConfig(directory="d", link_share=1.5)


class _Rec:
    def __init__(self, version: int):
        self.version, self.state = version, "online"


class _Stages:
    """What Keeper.tick reads: every stage's records (one online peer at ``version``)."""

    run_id = "tiny"

    def __init__(self, spec):
        self.spec, self.version, self.indexes = spec, 1, []
        self.peer_id = make_owner()[2]

    def all_stage_records(self, n):
        return [{"p": _Rec(self.version)} for _ in range(n)]

    def publish_snapshot_index(self, idx):
        self.indexes.append(idx)


class _SlowDonor:
    """A stage's averager whose state download takes ``seconds`` of the keeper's clock."""

    def __init__(self, clock, stage, spec, numel, members, seconds):
        self.clock, self.stage, self.spec, self.numel = clock, stage, spec, numel
        self.members, self.seconds, self.loads = members, seconds, 0

    def load_state(self, timeout_s):
        self.loads += 1
        self.clock[0] += self.seconds
        meta = {"spec_hash": self.spec.spec_hash, "stage": self.stage, "version": self.members.version}
        return meta, [torch.zeros(self.numel)]

    def share_state(self, allow, priority=0.0):
        pass


def test_a_keeper_on_a_slow_link_downloads_a_stage_at_most_link_share_of_the_time(tmp_path):
    from swarm.tools.keeper import Keeper, stage_state_numel
    from tests.helpers import tiny_spec

    spec = tiny_spec("tiny", stages=2)
    members = _Stages(spec)
    clock = [1000.0]
    cfg = KeeperConfig(directory=str(tmp_path), interval_s=60.0, link_share=0.1)
    keeper = Keeper(None, members, spec, cfg, clock=lambda: clock[0])  # type: ignore[arg-type]
    donors = [_SlowDonor(clock, s, spec, stage_state_numel(spec, s), members, 20.0) for s in range(2)]
    keeper._averagers = donors  # type: ignore[assignment]
    keeper.tick()  # both stages stepped once: both downloaded (20 s each)
    assert [d.loads for d in donors] == [1, 1] and [s.version for s in keeper.held] == [1, 1]
    assert members.indexes[-1].interval_s == pytest.approx(200.0)  # 20 s / 0.1, not 60
    for _ in range(9):  # 90 s of ticks with newer versions announced: past interval_s, not past 200 s
        members.version += 1
        clock[0] += 10.0
        keeper.tick()
    assert [d.loads for d in donors] == [1, 1]
    clock[0] += 200.0
    keeper.tick()
    assert [d.loads for d in donors] == [2, 2] and keeper.held[0].version == members.version


def test_a_written_snapshot_drops_its_cached_pages_after_fsync_and_writes_without_fadvise(
    tmp_path, monkeypatch
):
    """Note "write-once files" (swarm/atomic.py): the pages are dropped once the data is on disk;
    where the OS has no posix_fadvise, or refuses it, the write is the same."""
    from swarm import atomic

    calls: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    if hasattr(os, "posix_fadvise"):
        real_advise = os.posix_fadvise
        monkeypatch.setattr(
            os,
            "posix_fadvise",
            lambda fd, off, n, advice: (
                calls.append(f"advise {advice == os.POSIX_FADV_DONTNEED}"),
                real_advise(fd, off, n, advice),
            )[1],
        )
    store = SnapshotStore(tmp_path, spec_hash=SPEC_HASH, keep=3)
    store.write(snap(0, 1))
    assert calls[:2] == ["fsync", "advise True"] if hasattr(os, "posix_fadvise") else ["fsync"]

    def refuse(*a):
        raise OSError("fadvise not supported here")

    monkeypatch.setattr(os, "posix_fadvise", refuse, raising=False)
    assert atomic.drop_cached_pages(0) is False
    store.write(snap(0, 2))
    monkeypatch.delattr(os, "posix_fadvise")
    assert atomic.drop_cached_pages(0) is False
    store.write(snap(0, 3))
    assert store.versions(0) == [1, 2, 3]
    torch.testing.assert_close(store.newest(0).flat, snap(0, 3).flat)
