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


def test_a_member_without_a_digest_is_not_judged():
    gathered = {"A": {"version": 1}, "B": {"version": 1, "digest": D}}
    assert round_outcome("B", 1, gathered).step and round_outcome("A", 1, gathered).step
