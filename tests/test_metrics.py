"""Metrics: JSONL records, progress lines (terminal and plain), the loss plot and the summary."""

from __future__ import annotations

import io
import json
import math

from swarm.train.metrics import (
    MetricsWriter,
    ProgressDisplay,
    ProgressSnapshot,
    format_progress,
    format_summary,
    plot_loss,
    read_metrics,
    step_record,
    summarize,
    uncompressed_bytes_per_token,
)


def steps(n: int, *, tokens_per_step: int = 1000, bytes_per_step: float = 64000.0) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        out.append(
            step_record(
                step=i,
                elapsed_s=float(i),
                loss=5.0 - 0.1 * i,
                tokens=i * tokens_per_step,
                step_tokens=tokens_per_step,
                step_stats={
                    "fwd_bytes_0": bytes_per_step / 2,
                    "bwd_bytes_1": bytes_per_step / 2,
                    "fwd_s": 9.0,
                },
                completed=i,
                dropped=0,
                inflight=2,
                tokens_per_s=1000.0,
            )
        )
    return out


def test_writer_appends_flushed_lines_and_nan_becomes_null(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write({"type": "step", "loss": 1.0})
        assert len(read_metrics(path)) == 1  # flushed before close
        w.write({"type": "eval", "eval_loss": math.nan})
    with open(path, "a") as f:
        f.write('{"type": "step", "loss"')  # a line cut by a crash
    recs = read_metrics(path)
    assert [r["type"] for r in recs] == ["step", "eval"] and recs[1]["eval_loss"] is None
    assert read_metrics(path, "eval") == [recs[1]]
    for line in path.read_text().splitlines()[:2]:
        json.loads(line)


def test_step_record_bytes_per_token_per_link():
    rec = steps(1)[0]
    assert rec["bytes_per_token"] == {"bwd_bytes_1": 32.0, "fwd_bytes_0": 32.0}
    assert rec["bytes_per_token_total"] == 64.0


def test_format_progress_shows_everything():
    line = format_progress(
        ProgressSnapshot(
            tokens=51200,
            target_tokens=None,
            step=12,
            target_steps=30,
            tokens_per_s=1900.0,
            loss=2.3141,
            inflight=4,
            completed=12,
            dropped=1,
        )
    )
    assert "40%" in line and "step 12/30" in line and "51.2k tok" in line and "1.9k tok/s" in line
    assert "loss 2.314" in line and "in flight 4" in line and "dropped 1" in line


def snap(step: int) -> ProgressSnapshot:
    return ProgressSnapshot(
        tokens=step * 10,
        target_tokens=100,
        step=step,
        target_steps=None,
        tokens_per_s=1.0,
        loss=None,
        inflight=0,
        completed=step,
        dropped=0,
    )


def test_plain_progress_prints_periodic_lines():
    t = [0.0]
    out = io.StringIO()
    d = ProgressDisplay(out, is_tty=False, interval_s=10.0, clock=lambda: t[0])
    for i in range(30):
        t[0] = float(i)
        d.update(snap(i))
    text = out.getvalue()
    assert "\r" not in text and len(text.splitlines()) == 3  # t = 0, 10, 20
    d.message("stage 1 has no peers")
    assert text + "stage 1 has no peers\n" == out.getvalue()


def test_terminal_progress_redraws_one_line():
    t = [0.0]
    out = io.StringIO()
    d = ProgressDisplay(out, is_tty=True, clock=lambda: t[0])
    d.update(snap(1))
    t[0] = 1.0
    d.update(snap(2))
    d.message("hello")
    d.close()
    text = out.getvalue()
    assert text.startswith("\r[") and text.count("\n") == 1 and "hello\n" in text


def test_plot_writes_png(tmp_path):
    recs = steps(30) + [{"type": "eval", "tokens": 10000, "eval_loss": 3.0, "step": 10}]
    path = plot_loss(recs, tmp_path / "loss.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert plot_loss([], tmp_path / "empty.png").exists()


def test_summary_numbers_and_text():
    recs = steps(20)
    totals = {
        "completed": 20,
        "dropped": 1,
        "dropped_by_reason": {"timeout": 1},
        "retries": 2,
        "late_reports": 1,
    }
    s = summarize(
        recs,
        wall_s=10.0,
        totals=totals,
        num_stages=2,
        d_model=128,
        peers_by_stage={0: {"peerAAAAAAAAAA": 12, "peerBBBBBBBBBB": 8}, 1: {"peerCCCCCCCCCC": 20}},
    )
    assert s["tokens"] == 20000 and s["tokens_per_s"] == 2000.0 and s["steps"] == 20
    assert s["loss_first"] > s["loss_last"]
    assert s["loss_first"] == sum(5.0 - 0.1 * i for i in range(1, 6)) / 5
    assert s["bytes_per_token"] == 64.0
    assert s["uncompressed_bytes_per_token"] == uncompressed_bytes_per_token(2, 128) == 1024.0
    assert s["compression_ratio"] == 16.0
    json.dumps(s)
    text = format_summary(s)
    assert "20000 tokens" in text and "16.0x smaller" in text and "1 dropped" in text
    assert "stage 0: AAAAAAAA: 12, BBBBBBBB: 8" in text
    s["peer_loss"] = {"0": {"peerAAAAAAAAAA": 2.5, "peerBBBBBBBBBB": 412.0}}
    assert "AAAAAAAA: 12 (loss 2.50), BBBBBBBB: 8 (loss 412.00)" in format_summary(s)


def test_step_records_carry_per_stage_staleness_and_the_summary_its_mean():
    from swarm.train.metrics import step_record, summarize

    recs = []
    for step, (s0, n) in enumerate([(2.0, 2), (6.0, 2)], start=1):
        recs.append(
            step_record(
                step=step,
                elapsed_s=float(step),
                loss=1.0,
                tokens=100 * step,
                step_tokens=100,
                step_stats={
                    "staleness_0": s0,
                    "staleness_1": 0.0,
                    "applied_staleness_0": s0 + 1.0,
                    "applied_staleness_1": 1.4,
                },
                completed=2 * step,
                dropped=0,
                inflight=0,
                tokens_per_s=1.0,
                step_micro_batches=n,
            )
        )
    assert recs[0]["staleness"] == {"0": 1.0, "1": 0.0} and recs[1]["staleness"]["0"] == 3.0
    summary = summarize(recs, wall_s=2.0, totals={}, num_stages=2, d_model=8)
    assert summary["staleness"] == {"0": 2.0, "1": 0.0}
    assert recs[0]["applied_staleness"] == {"0": 1.5, "1": 0.7}  # replicas: their rounds add some
    assert summary["applied_staleness"] == {"0": 2.5, "1": 0.7}
    assert "applied staleness (versions between forward and the step applying it" in format_summary(summary)
