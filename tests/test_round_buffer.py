"""Note "partial rounds" (peer/round_buffer.py): the round buffer's sentinels, and what a replica does
with a round whose average arrived in part."""

import pytest
import torch

from peer.averaging import RoundResult
from peer.compute import StageCompute
from peer.replicas import ReplicaRounds, RoundsConfig
from peer.round_buffer import SENTINEL_EVERY, RoundBuffer
from tests.test_peer_compute import replica_with_a_complete_share


def test_pack_and_unpack_round_trip_with_a_sentinel_every_row():
    layout = RoundBuffer(3000)
    assert layout.size % SENTINEL_EVERY == 0 and layout.rows == 3  # 3000 values in rows of 1023
    payload = torch.randn(3000)
    buffer = torch.zeros(layout.size)
    layout.pack(buffer, payload, 1.25)
    back, sentinels = layout.unpack(buffer)
    assert torch.equal(back, payload)
    assert torch.equal(sentinels, torch.full((3,), 1.25))
    assert torch.equal(buffer.view(3, SENTINEL_EVERY)[:, -1], sentinels)  # each row's last element
    with pytest.raises(ValueError, match=r"this layout holds \(3072,\) with \(3000,\)"):
        layout.pack(torch.zeros(10), payload, 1.0)


def _members(layout: RoundBuffer, values: list[float]) -> list[torch.Tensor]:
    out = []
    for i, v in enumerate(values):
        b = torch.zeros(layout.size)
        layout.pack(b, torch.full((layout.payload,), float(i)), v)
        out.append(b)
    return out


def test_a_complete_round_holds_the_mean_in_every_sentinel():
    layout = RoundBuffer(5000)
    values = [1.1, 1.9]
    a, b = _members(layout, values)
    mean = (a + b) / 2
    _, sentinels = layout.unpack(mean)
    assert RoundBuffer.missing(sentinels, values, own=1.1) == 0.0


def test_a_span_that_kept_this_replicas_values_is_found():
    """hivemind's fallback for a reducer that failed: this replica's own values in that member's span."""
    layout = RoundBuffer(10_000)  # 10 rows
    values = [1.1, 1.9]
    a, b = _members(layout, values)
    result = (a + b) / 2
    span = slice(4 * SENTINEL_EVERY, layout.size)  # the partner's 60% of the buffer never came back
    result[span] = a[span]
    _, sentinels = layout.unpack(result)
    assert RoundBuffer.missing(sentinels, values, own=1.1) == pytest.approx(0.6)
    # too close to tell: a member whose own value is the mean cannot see its own values left behind
    assert RoundBuffer.missing(sentinels, [1.5, 1.5], own=1.5) is None
    assert RoundBuffer.missing(sentinels, [], own=1.5) is None


class _PartialAverager:
    """A stand-in for StageAverager's round API whose round completes with ``missing`` of its average absent."""

    def __init__(self, compute: StageCompute, missing: float = 0.4):
        self.compute = compute
        self.missing = missing
        self.scheduled = 0

    def schedule(self, *, group_size, gather, timeout_s):
        self.scheduled += 1
        return object()

    @staticmethod
    def group_formed(control):
        return True

    @staticmethod
    def cancel(control):
        pass

    def finish(self, control, sums, count, *, timeout_s, abort=None):
        flat = torch.cat([s.reshape(-1) for s in sums])
        gathered = {"me": {"version": 0}, "partner": {"version": 0}}
        return RoundResult(flat, float(count), gathered, self.missing)


def test_a_round_that_arrived_in_part_is_neither_applied_nor_given_back(caplog):
    comp = replica_with_a_complete_share()
    averager = _PartialAverager(comp)
    rounds = ReplicaRounds(
        comp, averager, peer_id="me", config=RoundsConfig(), replicas_fn=lambda: 2, catch_up=lambda v: False
    )
    with caplog.at_level("WARNING", logger="peer.replicas"):
        assert rounds.run_round() is False
    assert comp.version == 0 and comp.optimizer.step_count == 0  # not applied
    assert comp.optimizer.pending == 0 and comp.uncombined() == 0  # not given back (no double count)
    assert rounds.counters["partial_rounds"] == 1 and rounds.counters["rounds_failed"] == 0
    (record,) = [r for r in caplog.records if "arrived in part" in r.getMessage()]
    assert "40.0%" in record.getMessage() and "2 of them from this replica" in record.getMessage()
    assert averager.scheduled == 2  # the next round is looked for at once


def test_a_round_of_which_nothing_arrived_is_a_failed_round_and_its_share_goes_back():
    comp = replica_with_a_complete_share()
    averager = _PartialAverager(comp, missing=1.0)
    rounds = ReplicaRounds(
        comp, averager, peer_id="me", config=RoundsConfig(), replicas_fn=lambda: 2, catch_up=lambda v: False
    )
    assert rounds.run_round() is False
    assert comp.version == 0 and comp.uncombined() == 2  # given back: the next round retries it
    assert rounds.counters["rounds_failed"] == 1 and rounds.counters["partial_rounds"] == 0
