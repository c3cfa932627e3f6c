"""The compute core without network: sync-mode gating, version eviction, last-stage train step, replica rounds."""

import pytest
import torch

from peer.compute import PREVIEW_NS_STEPS, StageCompute
from peer.stash import VersionEvicted
from swarm.errors import RequestError
from swarm.run.spec import RunSpec


def spec(**optimizer) -> RunSpec:
    return RunSpec.from_dict(
        {
            "run_id": "compute-test",
            "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
            "stages": 2,
            "codecs": {"activations": "none", "gradients": "none"},
            "optimizer": {"lr": 1e-2} | optimizer,
            "micro_batch_size": 2,
            "stash_ttl_s": 10,
        }
    )


def tokens(seed):
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def grad(seed):
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed))


def replica_with_a_complete_share(**optimizer) -> StageCompute:
    """A stage 0 replica of 2 (accumulate 4) whose share of 2 micro-batches waits for its round."""
    comp = StageCompute(spec(accumulate=4, **optimizer), 0)
    comp.replicas = 2
    for i, mb in enumerate("ab"):
        comp.forward(mb, tokens(i), "train")
        comp.backward(mb, grad(i))
    return comp


def test_sync_mode_gates_forwards_until_the_step():
    comp = StageCompute(spec(mode="sync", accumulate=2), 0)
    assert comp.forward_allowed()
    comp.forward("a", tokens(0), "train")
    comp.forward("b", tokens(1), "train")
    assert not comp.forward_allowed()  # both forwards of this step are in flight
    comp.backward("a", grad(0))
    assert comp.version == 0 and not comp.forward_allowed()
    comp.backward("b", grad(1))
    assert comp.version == 1 and comp.forward_allowed()  # stepped once both backwards arrived
    comp.forward("c", tokens(2), "eval")  # eval forwards neither stash nor count
    assert len(comp.stash) == 0 and comp.forward_allowed()


def test_sync_mode_dropped_micro_batch_frees_its_slot():
    comp = StageCompute(spec(mode="sync", accumulate=2), 0)
    comp.forward("a", tokens(0), "train")
    comp.forward("b", tokens(1), "train")
    comp.backward("a", grad(0))
    comp.drop("b")  # its route failed: the step must not wait for it forever
    assert comp.forward_allowed() and comp.version == 0
    comp.forward("c", tokens(2), "train")
    comp.backward("c", grad(2))
    assert comp.version == 1


def test_async_backward_of_an_evicted_version_is_refused_and_counted():
    comp = StageCompute(spec(mode="async", accumulate=1, max_versions=1), 0)
    comp.forward("old", tokens(0), "train")
    comp.forward("new", tokens(1), "train")
    comp.backward("new", grad(1))  # step -> version 1; version 0 is evicted (max_versions=1)
    assert comp.versions.kept() == [1]
    with pytest.raises(VersionEvicted, match="version evicted"):
        comp.backward("old", grad(0))
    assert comp.versions.evicted_refusals == 1 and "old" not in comp.stash and comp.version == 1
    with pytest.raises(RequestError, match="no stashed forward"):
        comp.backward("old", grad(0))


def test_last_stage_train_forward_steps_and_returns_the_input_gradient():
    comp = StageCompute(spec(accumulate=1), 1)
    x = torch.randn(2, 16, 32)
    res = comp.forward("m", x, "train", targets=tokens(3))
    assert res.loss > 0 and res.grad_input.shape == (2, 16, 32) and res.stepped and comp.version == 1
    assert len(comp.stash) == 0
    with pytest.raises(RequestError, match="targets"):
        comp.forward("m2", x, "eval")


def test_stash_expiry_releases_entries():
    now = [0.0]
    comp = StageCompute(spec(mode="sync", accumulate=1), 0, clock=lambda: now[0])
    comp.forward("a", tokens(0), "train")
    assert not comp.forward_allowed()
    now[0] = 11.0
    assert [e.mb_id for e in comp.expire()] == ["a"]
    assert comp.forward_allowed() and comp.stash.expired == 1


def test_a_replica_steps_only_through_rounds_with_the_combined_gradient():
    comp = StageCompute(spec(accumulate=4), 0)
    comp.replicas = 2
    due = []
    comp.on_round_due = lambda: due.append(comp.uncombined())
    assert comp.quota() == 2
    for i, mb in enumerate("ab"):
        comp.forward(mb, tokens(i), "train")
        comp.backward(mb, grad(i))
    # woken when the share began (the round is scheduled then) and when it is in: no local step
    assert comp.version == 0 and due == [1, 2]
    assert comp.round_due()
    sums, count, version = comp.take_round()
    assert count == 2 and comp.uncombined() == 0 and not comp.round_due() and not comp.can_fill_in(0.0)
    comp.forward("c", tokens(2), "train")  # async: serving goes on while the round runs
    comp.backward("c", grad(2))
    assert comp.uncombined() == 1  # kept apart for the next round
    # the other replica contributed the same again: the mean over 4 is the mean over our 2
    mean = [s / count for s in sums]
    ref = StageCompute(spec(accumulate=2), 0)
    for i, mb in enumerate("ab"):
        ref.forward(mb, tokens(i), "train")
        ref.backward(mb, grad(i))
    assert comp.end_round(mean, version, None)
    assert comp.version == 1 and comp.uncombined() == 1
    for n, t in comp.params().items():
        torch.testing.assert_close(t, ref.params()[n])
    # a failed round gives the share back (retried first); a round for an older version does not step
    comp.forward("d", tokens(3), "train")
    comp.backward("d", grad(3))  # a second complete share waits behind the first
    sums, count, version = comp.take_round()
    assert count == 2 and comp.uncombined() == 0
    assert not comp.end_round(None, version, (sums, count))
    assert comp.uncombined() == 2 and comp.version == 1 and comp.round_due()
    assert comp.take_round()[1] == 2
    assert not comp.end_round([s for s in sums], version - 1, None)


def test_a_round_or_a_flush_on_part_of_a_step_takes_that_part_of_a_step():
    # note "token-weighted steps": a round that combined 2 of accumulate's 4 micro-batches (a partner
    # filled in with nothing) steps at half the learning rate; a replica flushing 1 at a quarter
    def moved(a, b):
        return [b[n] - a[n] for n in a]

    comp = StageCompute(spec(accumulate=4, name="adamw", weight_decay=0.0), 0)
    comp.replicas = 2
    comp.speculate = False
    for i, mb in enumerate("ab"):
        comp.forward(mb, tokens(i), "train")
        comp.backward(mb, grad(i))
    before = comp.params()
    sums, count, version = comp.take_round()
    ref = StageCompute(spec(accumulate=2, name="adamw", weight_decay=0.0), 0)
    for i, mb in enumerate("ab"):  # the same two micro-batches as a full step of accumulate 2
        ref.forward(mb, tokens(i), "train")
        ref.backward(mb, grad(i))
    assert comp.end_round([s / count for s in sums], version, None, combined=2)
    for got, full in zip(moved(before, comp.params()), moved(before, ref.params()), strict=True):
        torch.testing.assert_close(got, 0.5 * full, rtol=1e-4, atol=1e-7)
    comp.forward("c", tokens(2), "train")
    comp.backward("c", grad(2))
    opt = comp.optimizer
    full = opt.twin().step_with([opt.grads[n] / opt.pending for n in opt.names])  # the same step at weight 1
    before = comp.params()
    assert comp.flush_step() and comp.version == 2  # alone, with the 1 micro-batch it holds
    for got, whole in zip(moved(before, comp.params()), moved(before, full), strict=True):
        torch.testing.assert_close(got, 0.25 * whole, rtol=1e-4, atol=1e-7)
    assert comp.optimizer.step_count == 2


def test_a_replicas_staleness_is_counted_when_its_round_applies_the_share():
    comp = StageCompute(spec(accumulate=4), 0)
    comp.replicas = 2
    comp.speculate = False  # forwards during the round run on the round's version (note "speculative rounds")
    for i, mb in enumerate("ab"):  # forwards and backwards at version 0
        comp.forward(mb, tokens(i), "train")
        comp.backward(mb, grad(i))
    assert comp.optimizer.staleness == 0.0  # nothing applied yet
    sums, count, version = comp.take_round()
    for i, mb in enumerate("cd"):  # served during the round, still on version 0
        comp.forward(mb, tokens(2 + i), "train")
        comp.backward(mb, grad(2 + i))
    assert comp.end_round([s / count for s in sums], version, None)  # applied at once: 0
    assert comp.optimizer.staleness == 0.0
    sums, count, version = comp.take_round()
    assert comp.end_round([s / count for s in sums], version, None)  # computed on 0, applied at 1
    assert comp.optimizer.staleness == pytest.approx(1 - 0.9**2)


def test_an_async_replica_serves_the_step_it_previews_while_its_round_runs():
    comp = StageCompute(spec(accumulate=4, name="muon"), 0)
    comp.replicas = 2
    for i, mb in enumerate("ab"):
        comp.forward(mb, tokens(i), "train")
        comp.backward(mb, grad(i))
    before = [t.clone() for t in comp.optimizer.state_tensors()]
    sums, count, version = comp.take_round()
    # the preview changed nothing of the optimizer: state, step count and version are the round's
    for t, b in zip(comp.optimizer.state_tensors(), before, strict=True):
        assert torch.equal(t, b)
    assert comp.optimizer.step_count == 0 and comp.version == 0
    comp.forward("c", tokens(2), "train")  # served during the round, on the previewed weights
    entry = comp.stash.get("c")
    assert entry.version == 0 and entry.ahead == 1 and entry.params is not None
    assert any(not torch.equal(entry.params[n], p) for n, p in comp.params().items())
    comp.forward("e", tokens(4), "eval")  # only training forwards speculate
    # the partner's share had the same mean: the preview is that step with fewer Newton-Schulz iterations
    mean = [s / count for s in sums]
    previewed = comp.optimizer.twin(ns_steps=PREVIEW_NS_STEPS).step_with(mean)
    for n, p in previewed.items():
        torch.testing.assert_close(entry.params[n], p)
    assert comp.end_round(mean, version, None)
    matrices = set(comp.optimizer.matrices)
    assert matrices
    for n, t in comp.params().items():  # the combined step: the same AdamW part, Muon's at 5 iterations
        if n in matrices:
            assert not torch.equal(t, entry.params[n])
        else:
            torch.testing.assert_close(t, entry.params[n])
    assert comp.stash.get("c").params is not None  # the backward still runs on what the forward ran on
    comp.backward("c", grad(2))
    comp.forward("d", tokens(3), "train")  # after the round: version 1's own weights
    assert comp.stash.get("d").ahead == 0 and comp.stash.get("d").params is None
    comp.backward("d", grad(3))
    sums, count, version = comp.take_round()
    assert comp.end_round([s / count for s in sums], version, None)
    # "c" counted as a forward of version 1, applied by the step from version 1: not stale
    assert comp.optimizer.staleness == 0.0 and comp.version == 2


def test_the_forward_gate_stays_closed_until_the_preview_is_served():
    """Forwards queued behind a complete share run on the preview, not on the version the round replaces."""
    comp = StageCompute(spec(accumulate=4, name="muon"), 0)
    comp.replicas = 2
    for i, mb in enumerate("ab"):
        comp.forward(mb, tokens(i), "train")
        comp.backward(mb, grad(i))
    assert not comp.forward_allowed()  # the complete share waits for its round
    gate_while_previewing = []
    twin_step = comp.optimizer.twin

    def spying_twin(**kw):
        twin = twin_step(**kw)
        step_with = twin.step_with

        def step(mean):
            gate_while_previewing.append(comp.forward_allowed())
            return step_with(mean)

        twin.step_with = step
        return twin

    comp.optimizer.twin = spying_twin
    opened = []
    comp.on_gate_change = lambda: opened.append(comp.forward_allowed())
    comp.take_round()
    assert gate_while_previewing == [False]  # closed while the twin steps
    assert opened[-1] is True and comp._speculative is not None  # open once the preview is served


def test_a_failed_round_drops_the_preview_and_sync_replicas_never_preview():
    comp = replica_with_a_complete_share()
    sums, count, version = comp.take_round()
    assert not comp.end_round(None, version, (sums, count))
    comp.forward("c", tokens(2), "train")
    assert comp.stash.get("c").ahead == 0
    assert not StageCompute(spec(accumulate=4, mode="sync"), 0).speculate


def test_a_replica_adopts_a_newer_state_keeping_its_in_flight_work():
    donor = StageCompute(spec(accumulate=1), 0)
    for i in range(2):
        donor.forward(f"d{i}", tokens(i), "train")
        donor.backward(f"d{i}", grad(i))
    comp = StageCompute(spec(accumulate=1), 0)
    comp.replicas = 2
    comp.forward("x", tokens(5), "train")  # in flight on version 0
    comp.forward("y", tokens(6), "train")
    comp.backward("y", grad(6))  # pending, not stepped (replicated)
    meta, tensors = donor.export_state()
    assert comp.adopt_state(meta, tensors) and comp.version == 2
    assert not comp.adopt_state(meta, tensors)  # not newer: nothing changes
    for n, t in comp.params().items():
        torch.testing.assert_close(t, donor.params()[n])
    assert comp.uncombined() == 1 and "x" in comp.stash
    comp.backward("x", grad(5))  # still runs on version 0, which is kept
    assert comp.uncombined() == 2
    with pytest.raises(RequestError, match="stage"):
        comp.adopt_state(meta | {"stage": 1, "version": 9}, tensors)
    assert comp.version == 2


def test_a_download_exports_the_state_once_into_shared_memory():
    """A donor's state for a download (peer/averaging.py, note "state in shared memory") is copied once
    into one flat float32 tensor in shared memory: the same values as the plain export, passed on as it
    is, independent of the live tensors, and imported like the plain one."""
    from peer.averaging import _flatten, _unflatten
    from peer.state_stream import flatten_into, shared_empty

    donor = StageCompute(spec(accumulate=1), 0)
    donor.forward("d", tokens(0), "train")
    donor.backward("d", grad(0))
    meta, tensors = donor.export_state()
    meta_flat, [flat] = donor.export_state(copy=lambda live: [flatten_into(live, shared_empty)])
    assert meta_flat == meta and meta["version"] == 1
    assert (
        flat.is_shared() and flat.dtype == torch.float32 and flat.numel() == sum(t.numel() for t in tensors)
    )
    assert _flatten([flat]).data_ptr() == flat.data_ptr()  # already shared and flat: no copy
    from_parts = _flatten(tensors)
    assert from_parts.is_shared() and torch.equal(from_parts, flat)
    shapes = [t.shape for t in tensors]
    for got, want in zip(_unflatten(flat, shapes), tensors, strict=True):
        assert torch.equal(got, want)
    comp = StageCompute(spec(accumulate=1), 0)
    comp.import_state(meta_flat, _unflatten(flat, shapes))
    flat.zero_()  # neither peer's live state shares memory with the exported copy
    for name, value in comp.params().items():
        torch.testing.assert_close(value, donor.params()[name], rtol=0, atol=0)
        assert value.abs().sum() > 0


def test_sync_replica_closes_its_share_when_the_next_window_begins():
    clock = [0.0]
    comp = StageCompute(spec(mode="sync", accumulate=2), 0, clock=lambda: clock[0])
    comp.replicas = 2
    comp.note_window("t", 0)
    comp.forward("a", tokens(0), "train")
    comp.forward("b", tokens(1), "train")  # the trainer decides how much of a window each replica gets
    comp.backward("a", grad(0))
    comp.backward("b", grad(1))
    assert comp.version == 0 and not comp.round_due()  # window 0 may still go on here
    comp.note_window("t", 0)  # a retry of window 0 changes nothing
    assert not comp.round_due()
    comp.note_window("t", 1)  # window 1 began: window 0 is over everywhere
    assert comp.round_due() and not comp.forward_allowed()  # its forward waits for the combined step
    sums, count, version = comp.take_round()
    assert count == 2 and not comp.forward_allowed()
    comp.end_round([s / count for s in sums], version, None)
    assert comp.version == 1 and comp.forward_allowed()
    comp.forward("c", tokens(2), "train")
    comp.backward("c", grad(2))
    assert not comp.can_fill_in(idle_s=1.0)  # between two micro-batches of a window: not over yet
    clock[0] = 5.0  # after the last window: it closes by itself once quiet
    assert comp.round_due()


def test_a_retry_already_counted_here_adds_no_gradient():
    comp = StageCompute(spec(accumulate=2), 0)
    comp.forward("a", tokens(0), "train", count=False)
    res = comp.backward("a", grad(0))
    assert res.grad_input is None and comp.uncombined() == 0  # ran, but added nothing
    last = StageCompute(spec(accumulate=1), 1)
    x = torch.randn(2, 16, 32)
    out = last.forward("b", x, "train", targets=tokens(1), count=False)
    assert out.grad_input is not None and last.version == 0 and last.uncombined() == 0


def test_a_replica_without_traffic_may_fill_in_only_when_idle():
    clock = [0.0]
    comp = StageCompute(spec(accumulate=4), 0, clock=lambda: clock[0])
    comp.replicas = 2
    assert not comp.can_fill_in(idle_s=1.0)  # nothing yet, but only just started
    clock[0] = 1.0
    assert comp.can_fill_in(idle_s=1.0)  # nothing for idle_s
    comp.forward("a", tokens(0), "train")
    assert not comp.can_fill_in(idle_s=1.0)  # something in flight
    comp.backward("a", grad(0))
    assert not comp.can_fill_in(idle_s=1.0) and not comp.round_due()  # 1 of 2: a gradient just came
    clock[0] = 5.0
    assert comp.can_fill_in(idle_s=1.0)


def test_a_replica_counts_its_traffic_stopped_only_after_a_gap_longer_than_its_recent_ones():
    clock = [0.0]
    comp = StageCompute(spec(accumulate=16), 0, clock=lambda: clock[0])
    comp.replicas = 2
    assert comp.quiet_after(1.0, 5.0) == 1.0  # nothing seen yet: the floor
    assert comp.quiet_after(1.0, 5.0, unseen_s=4.0) == 4.0  # ... or what the caller asks for then
    for i, at in enumerate([0.5, 1.0, 3.0, 3.2]):  # gaps 0.5, 0.5, 2.0, 0.2 (a loaded machine)
        clock[0] = at
        comp.forward(f"m{i}", tokens(i), "train")
        comp.backward(f"m{i}", grad(i))
    assert comp.quiet_after(1.0, 5.0) == pytest.approx(3.0)  # 1.5 x the longest recent gap
    clock[0] = 3.2 + 2.5
    assert comp.can_fill_in(idle_s=1.0) and not comp.can_fill_in(idle_s=comp.quiet_after(1.0, 5.0))
    assert comp.quiet_after(1.0, 2.0) == 2.0  # never past the cap (a partner's round would time out)


def test_emulated_compute_holds_each_micro_batch_for_its_busy_time():
    """Note "emulated compute": forward >= F, backward >= B, the last stage's loss and backward >= F + B,
    and the result's compute_s (what peers report as busy) includes the sleep."""
    first = StageCompute(spec(accumulate=1), 0, emulate_s=(0.05, 0.1))
    res = first.forward("a", tokens(0), "train")
    assert res.compute_s >= 0.05
    assert first.backward("a", grad(0)).compute_s >= 0.1
    last = StageCompute(spec(accumulate=1), 1, emulate_s=(0.05, 0.1))
    out = last.forward("a", res.output, "train", targets=tokens(1))
    assert out.compute_s >= 0.15 and out.stepped


def test_no_emulated_sleep_without_the_knob(monkeypatch):
    import peer.compute

    slept = []
    monkeypatch.setattr(peer.compute.time, "sleep", slept.append)
    plain = StageCompute(spec(accumulate=1), 0)
    plain.forward("a", tokens(0), "train")
    plain.backward("a", grad(0))
    assert slept == []  # time.sleep is the emulation's only sleep here


def test_a_replica_left_alone_steps_with_the_shares_that_waited_and_says_so():
    comp = replica_with_a_complete_share()
    assert comp.uncombined() > 0 and comp.version == 0  # a complete share waits for its round
    assert comp.set_replicas(2) is False  # still replicated: nothing to do
    assert comp.set_replicas(1) is True and comp.version == 1 and comp.steps_taken == 1
    assert comp.set_replicas(1) is False  # nothing left to step with
