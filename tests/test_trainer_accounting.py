"""The micro-batch ledger: completed or dropped, retries with new ids, late and unknown reports."""

from __future__ import annotations

import pytest

from swarm.train.accounting import Ledger
from swarm.wire.protocol import Report

ROUTE = ("peerA", "peerB")


def report(mb_id: str, kind: str, *, loss=None, stage=0, reason="", stats=None) -> Report:
    return Report(
        run_id="r", mb_id=mb_id, kind=kind, stage=stage, peer="p", loss=loss, reason=reason, stats=stats or {}
    )


def test_train_micro_batch_completes_on_done_with_loss_and_stats():
    led = Ledger(tag="t", max_attempts=3)
    mb = led.open("train", 1024)
    a = led.start_attempt(mb.index, ROUTE, now=0.0, timeout_s=5.0)
    assert (
        led.on_report(report(a.mb_id, "loss", loss=2.5, stage=1, stats={"fwd_bytes_0": 10.0})).event == "loss"
    )
    assert mb.state == "inflight"
    out = led.on_report(report(a.mb_id, "done", stats={"bwd_bytes_1": 20.0}))
    assert out.event == "completed" and mb.state == "completed" and mb.loss == 2.5
    assert a.stats == {"fwd_bytes_0": 10.0, "bwd_bytes_1": 20.0}
    led.check()
    assert led.totals()["completed"] == 1 and led.totals()["dropped"] == 0


def test_loss_arriving_after_done_is_still_used():
    led = Ledger(tag="t", max_attempts=1)
    mb = led.open("train", 10)
    a = led.start_attempt(mb.index, ROUTE, now=0.0, timeout_s=5.0)
    assert led.on_report(report(a.mb_id, "done")).event == "completed"
    assert led.on_report(report(a.mb_id, "loss", loss=1.5)).event == "loss"
    assert mb.loss == 1.5
    assert led.on_report(report(a.mb_id, "loss", loss=9.0)).event == "late"  # a duplicate is late
    assert mb.loss == 1.5


def test_failure_retries_with_new_id_then_drops_after_max_attempts():
    led = Ledger(tag="t", max_attempts=2)
    mb = led.open("train", 10)
    a1 = led.start_attempt(mb.index, ROUTE, now=0.0, timeout_s=5.0)
    assert led.on_report(report(a1.mb_id, "failed", stage=1, reason="unreachable")).event == "failed"
    assert led.fail(a1.mb_id, reason="unreachable", stage=1, peer="peerB") == "retry"
    assert mb.state == "pending" and [m.index for m in led.pending()] == [mb.index]
    led.check()
    a2 = led.start_attempt(mb.index, ROUTE, now=1.0, timeout_s=5.0)
    assert a2.mb_id != a1.mb_id
    assert led.fail(a2.mb_id, reason="timeout", stage=None) == "dropped"
    assert mb.state == "dropped" and mb.drop_reason == "timeout"
    t = led.totals()
    assert t["dropped"] == 1 and t["retries"] == 1 and t["attempts"] == 2
    assert t["dropped_by_reason"] == {"timeout": 1} and t["failures_by_reason"] == {
        "unreachable": 1,
        "timeout": 1,
    }
    led.check()


def test_late_and_unknown_reports_are_counted_not_applied():
    led = Ledger(tag="t", max_attempts=3)
    mb = led.open("train", 10)
    a1 = led.start_attempt(mb.index, ROUTE, now=0.0, timeout_s=1.0)
    assert [x.mb_id for x in led.expired(0.5)] == []
    assert [x.mb_id for x in led.expired(1.0)] == [a1.mb_id]
    assert led.fail(a1.mb_id, reason="timeout") == "retry"
    assert led.fail(a1.mb_id, reason="timeout") == "stale"  # a second verdict on a closed attempt
    a2 = led.start_attempt(mb.index, ROUTE, now=1.0, timeout_s=1.0)
    assert led.on_report(report(a1.mb_id, "done")).event == "late"
    assert mb.state == "inflight"
    assert led.on_report(report("someone-else-1-0", "done")).event == "unknown"
    assert led.on_report(report(a2.mb_id, "done")).event == "completed"
    t = led.totals()
    assert (t["late_reports"], t["unknown_reports"], t["completed"]) == (1, 1, 1)


def test_eval_completes_on_result_and_ignores_train_kinds():
    led = Ledger(tag="t", max_attempts=1)
    mb = led.open("eval", 10)
    a = led.start_attempt(mb.index, ROUTE, now=0.0, timeout_s=1.0)
    assert led.on_report(report(a.mb_id, "done")).event == "ignored"
    assert led.on_report(report(a.mb_id, "result", loss=3.0)).event == "completed"
    assert mb.loss == 3.0
    assert led.totals("eval")["completed"] == 1 and led.totals("train")["opened"] == 0


def test_close_all_drops_everything_left():
    led = Ledger(tag="t", max_attempts=2)
    a = led.open("train", 10)
    led.open("train", 10)
    led.start_attempt(a.index, ROUTE, now=0.0, timeout_s=1.0)
    assert led.close_all(reason="shutdown") == 2
    t = led.totals()
    assert t["dropped"] == 2 and t["inflight"] == 0 and t["pending"] == 0
    assert t["dropped_by_reason"] == {"shutdown": 2}
    led.check()


def test_max_attempts_must_be_positive():
    with pytest.raises(ValueError):
        Ledger(tag="t", max_attempts=0)
