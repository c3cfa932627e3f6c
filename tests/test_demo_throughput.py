"""The demo A/B's pure parts (benchmarks/demo_throughput.py): the held-out curve read from a demo's
metrics.jsonl, the seconds until a curve reaches a loss, and the table's time-to-quality columns."""

from __future__ import annotations

import json

import pytest

from benchmarks.demo_throughput import eval_curve, render, seconds_to


def test_eval_curve_keeps_the_evaluations_only(tmp_path):
    rows = [
        {"type": "event", "event": "start", "time": 0.0},
        {"type": "step", "loss": 5.0, "time": 1.0, "tokens": 4096},
        {"type": "eval", "eval_loss": 2.9, "time": 12.0, "tokens": 76800},
        {"type": "eval", "eval_loss": None, "time": 13.0, "tokens": 80000},
        {"type": "eval", "eval_loss": 2.7, "time": 40.0, "tokens": 307200},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert eval_curve(path) == [[12.0, 76800.0, 2.9], [40.0, 307200.0, 2.7]]


def test_seconds_to_interpolates_between_the_evaluations_around_the_crossing():
    curve = [[10.0, 1e5, 3.0], [20.0, 2e5, 2.0], [30.0, 3e5, 1.5]]
    assert seconds_to(curve, 2.5) == pytest.approx(15.0)
    assert seconds_to(curve, 2.0) == pytest.approx(20.0)
    assert seconds_to(curve, 3.5) == 10.0  # already there at the first evaluation
    assert seconds_to(curve, 1.0) is None  # never
    assert seconds_to([], 2.0) is None
    # a noisy curve that goes up before it comes down: the first evaluation at or below counts
    assert seconds_to([[10.0, 1e5, 2.4], [20.0, 2e5, 2.6], [30.0, 3e5, 2.2]], 2.5) == 10.0


def test_render_compares_the_time_to_the_base_final_loss():
    """The target is the mean of the base runs' last held-out losses; the base's own time is its training
    time (to its last evaluation), whether or not its curve crosses that mean."""
    run = lambda variant, tps, last, curve: {  # noqa: E731
        "variant": variant,
        "tokens_per_s": tps,
        "eval_loss_last": last,
        "eval_curve": curve,
    }
    result = {
        "base": "7d961c3",
        "this": "abc1234",
        "runs": [
            run("base", 8000.0, 2.5, [[20.0, 1e5, 2.9], [36.0, 3e5, 2.5]]),
            run("base", 6000.0, 2.7, [[20.0, 1e5, 2.8], [44.0, 3e5, 2.7]]),
            run("paced", 4000.0, 2.2, [[20.0, 1e5, 2.5], [60.0, 3e5, 2.2]]),
            run("paced", 4000.0, 2.2, [[20.0, 1e5, 2.7], [60.0, 3e5, 2.2]]),
        ],
    }
    table = render(result)
    base_row, paced_row = table.splitlines()[2:4]
    assert "| 7000 | 1.00 |" in base_row and "| 36, 44 | 1.00 |" in base_row  # target: 2.6
    # paced: 0.57 of the base's tokens/s; it reaches 2.6 at its first evaluation (20 s), and between
    # 2.7 at 20 s and 2.2 at 60 s, at 28 s: 24 s in the mean against the base's 40
    assert "| 4000 | 0.57 |" in paced_row
    assert "| 20, 28 | 1.67 |" in paced_row
