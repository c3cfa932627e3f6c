"""The peer's sync/async policy (peer/policy.py): the decisions that differ between the modes."""

from __future__ import annotations

from peer.policy import AsyncPolicy, SyncPolicy, policy_for


def test_the_spec_mode_picks_the_policy_once():
    assert isinstance(policy_for("sync", 4), SyncPolicy) and policy_for("sync", 4).accumulate == 4
    assert isinstance(policy_for("async", 4), AsyncPolicy)


def test_sync_window_admits_accumulate_forwards_and_reopens_on_a_step():
    p = SyncPolicy(accumulate=2)
    assert p.forward_allowed(round_active=False, replicas=1)
    p.forward_started()
    p.forward_started()
    assert not p.forward_allowed(round_active=False, replicas=1)
    assert p.forward_allowed(round_active=False, replicas=2)  # a replica's window is what the trainer sends
    assert not p.forward_allowed(round_active=True, replicas=2)  # forwards wait for the round
    assert p.release_slot()  # a dropped forward frees its slot, and may complete the step
    assert p.forward_allowed(round_active=False, replicas=1)
    p.forward_started()
    assert p.reset_window() and p.window_forwards == 0
    p.release_slot()
    assert p.window_forwards == 0  # never below zero


def test_sync_steps_only_with_nothing_in_flight_and_shares_close_by_window():
    p = SyncPolicy(accumulate=2)
    assert p.may_step(0) and not p.may_step(1)
    assert not p.share_complete(pending=10, quota=1)
    assert p.settles_share()
    assert p.new_window("t", 0) and not p.new_window("t", 0) and p.new_window("t", 1)
    assert not p.new_window("t", 0) and p.new_window("u", 0)  # per trainer
    assert p.rounds_poll_s < AsyncPolicy.rounds_poll_s and not p.rounds_overlap and not p.speculates


def test_async_never_waits_for_a_window():
    p = AsyncPolicy()
    for _ in range(100):
        p.forward_started()
    assert p.forward_allowed(round_active=True, replicas=1)
    assert p.may_step(5) and not p.release_slot() and not p.reset_window()
    assert p.share_complete(pending=2, quota=2) and not p.share_complete(pending=1, quota=2)
    assert not p.settles_share() and not p.new_window("t", 3)
    assert p.rounds_overlap and p.speculates
