"""Weight versions and the micro-batch stash: versions kept, eviction refused and counted, expiry by TTL."""

import pytest
import torch

from peer.stash import MicroBatchStash, VersionEvicted, WeightVersions
from swarm.errors import RequestError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_versions_keep_the_last_max_versions():
    vs = WeightVersions(max_versions=2)
    vs.reset(0, {"w": torch.zeros(1)})
    assert vs.push(1, {"w": torch.ones(1)}) == []
    assert vs.push(2, {"w": torch.full((1,), 2.0)}) == [0]
    assert vs.kept() == [1, 2] and vs.latest_version == 2
    assert float(vs.get(1)["w"]) == 1.0
    with pytest.raises(VersionEvicted, match="version evicted"):
        vs.get(0)
    assert vs.evicted_refusals == 1
    assert isinstance(VersionEvicted("x"), RequestError)
    with pytest.raises(ValueError):
        vs.push(2, {})


def test_stash_expiry_with_injected_clock():
    clock = FakeClock()
    st = MicroBatchStash(ttl_s=10.0, clock=clock)
    st.put(st.new_entry("a", 0, torch.zeros(1)))
    clock.now += 6
    st.put(st.new_entry("b", 0, torch.zeros(1)))
    assert st.expire() == [] and len(st) == 2
    clock.now += 4.5  # "a" is 10.5 s old, "b" 4.5 s
    gone = st.expire()
    assert [e.mb_id for e in gone] == ["a"] and "b" in st and "a" not in st
    assert st.expired == 1
    clock.now += 6
    assert [e.mb_id for e in st.expire()] == ["b"] and len(st) == 0


def test_stash_refuses_duplicates_and_counts_drops():
    st = MicroBatchStash(ttl_s=1.0, clock=FakeClock(), max_entries=2)
    st.put(st.new_entry("a", 3, torch.zeros(1)))
    with pytest.raises(RequestError, match="already stashed"):
        st.put(st.new_entry("a", 3, torch.zeros(1)))
    st.put(st.new_entry("b", 4, torch.zeros(1)))
    with pytest.raises(RequestError, match="stash is full"):
        st.put(st.new_entry("c", 4, torch.zeros(1)))
    assert st.versions_in_use() == {3, 4}
    assert st.drop("a").version == 3 and st.dropped == 1
    assert st.drop("a") is None and st.dropped == 1
    assert st.pop("b").mb_id == "b" and len(st) == 0
