"""The replica-round decisions without network (peer/replicas.py)."""

from peer.replicas import round_outcome

D = [10.0, 4.0, 2.0]


def test_members_at_the_newest_version_with_agreeing_digests_step():
    gathered = {"A": {"version": 3, "digest": D}, "B": {"version": 3, "digest": [10.0 + 1e-9, 4.0, 2.0]}}
    for me in ("A", "B"):
        out = round_outcome(me, 3, gathered)
        assert out.step and not out.catch_up and out.newest == 3


def test_a_member_behind_catches_up_instead_of_stepping():
    gathered = {"A": {"version": 5, "digest": D}, "B": {"version": 4, "digest": D}}
    out = round_outcome("B", 4, gathered)
    assert not out.step and out.catch_up and out.newest == 5
    assert round_outcome("A", 5, gathered).step


def test_a_member_whose_weights_diverged_downloads_the_reference_ones():
    gathered = {"A": {"version": 2, "digest": D}, "B": {"version": 2, "digest": [10.5, 4.0, 2.0]}}
    assert round_outcome("A", 2, gathered).step  # the lowest peer id at the version is the reference
    out = round_outcome("B", 2, gathered)
    assert not out.step and out.catch_up and out.diverged


def test_the_majority_of_a_group_keeps_its_weights_against_a_lone_stepper():
    # "A" stepped alone after failed rounds: its weights differ from B's and C's at the same version;
    # the lowest peer id must not make the two others throw their step away for its weights
    odd = [10.5, 4.0, 2.0]
    gathered = {
        "A": {"version": 2, "digest": odd},
        "B": {"version": 2, "digest": D},
        "C": {"version": 2, "digest": D},
    }
    out = round_outcome("A", 2, gathered)
    assert not out.step and out.catch_up and out.diverged
    assert round_outcome("B", 2, gathered).step and round_outcome("C", 2, gathered).step


def test_a_member_without_a_digest_is_not_judged():
    gathered = {"A": {"version": 1}, "B": {"version": 1, "digest": D}}
    assert round_outcome("B", 1, gathered).step and round_outcome("A", 1, gathered).step


class _QuietCompute:
    """What ``ReplicaRounds.quiet_s`` reads of a stage's compute: its policy and its gap statistics."""

    stage, replicas, speculate = 0, 4, False
    on_round_due = None

    def __init__(self, policy, longest_gap_s):
        self.policy = policy
        self.longest_gap_s = longest_gap_s

    def quiet_after(self, floor_s, cap_s, *, unseen_s=None):  # as StageCompute.quiet_after
        if self.longest_gap_s is None and unseen_s is not None:
            return unseen_s
        return min(cap_s, max(floor_s, 1.5 * (self.longest_gap_s or 0.0)))


def _rounds(policy, longest_gap_s):
    from peer.replicas import ReplicaRounds, RoundsConfig

    return ReplicaRounds(
        _QuietCompute(policy, longest_gap_s),
        None,
        peer_id="me",
        config=RoundsConfig(timeout_s=5.0, idle_s=1.0),
        replicas_fn=lambda: 4,
        catch_up=lambda v: False,
    )


def test_an_async_replica_in_a_formed_group_waits_longer_before_it_fills_in():
    """Note "patient fill-in": 2 s gaps between a replica's gradients are normal with 4 replicas on a
    slow machine; the half-timeout cap (2.5 s) made it join with nothing and cut the stage step short."""
    from peer.policy import AsyncPolicy
    from peer.replicas import PATIENT_QUIET_S

    rounds = _rounds(AsyncPolicy(), longest_gap_s=3.0)
    assert rounds.quiet_s() == 2.5  # no group yet: a partner's group search must not time out
    assert PATIENT_QUIET_S >= 4.5
    assert rounds.quiet_s(formed=True) == 4.5  # 1.5 x the longest gap, within the patient cap
    assert _rounds(AsyncPolicy(), longest_gap_s=10.0).quiet_s(formed=True) == PATIENT_QUIET_S
    assert _rounds(AsyncPolicy(), longest_gap_s=0.4).quiet_s(formed=True) == 1.0  # the floor still holds
    fresh = _rounds(AsyncPolicy(), longest_gap_s=None)  # no gap seen yet: the run's start, a joiner
    assert fresh.quiet_s() == 1.0 and fresh.quiet_s(formed=True) == PATIENT_QUIET_S


def test_a_sync_replica_fills_in_as_before_once_its_group_formed():
    from peer.policy import SyncPolicy

    rounds = _rounds(SyncPolicy(4), longest_gap_s=3.0)
    assert rounds.quiet_s(formed=True) == rounds.quiet_s() == 2.5  # the window is sent: nothing more comes


def test_a_sync_replica_closes_its_share_by_itself_only_after_a_window_could_have_ended():
    """Note "settled share": a window takes ~2.4 s with 4 replicas on 2 cores; settling after the quiet
    threshold (1-2.5 s) closed shares mid-window."""
    from peer.policy import SyncPolicy
    from peer.replicas import SETTLE_S

    rounds = _rounds(SyncPolicy(4), longest_gap_s=1.0)
    assert rounds.settle_s(rounds.quiet_s()) == SETTLE_S >= 5.0
    assert rounds.settle_s(7.0) == 7.0
