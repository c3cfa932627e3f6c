"""The compute queue: bounded with a clear refusal, backward lane first, forward gate, observable stats."""

import threading

import pytest

from peer.runtime import ComputeQueue
from swarm.errors import RequestError


def test_full_queue_refuses_and_stats_are_observable():
    release = threading.Event()
    started = threading.Event()
    q = ComputeQueue(max_queue=2)
    q.start()
    try:

        def blocker(waited):
            started.set()
            release.wait(5)

        q.submit("forward", blocker)
        assert started.wait(5)  # the worker holds the first task; the queue itself is empty again
        assert q.submit("forward", lambda w: None) == 1
        assert q.submit("forward", lambda w: None) == 2
        with pytest.raises(RequestError, match="busy, queue full"):
            q.submit("forward", lambda w: None)
        assert q.stats.refused == 1 and q.stats.peak == 2 and len(q) == 2
        release.set()
        assert q.wait_idle(5)
        assert q.stats.completed == 3 and q.stats.length == 0 and q.stats.max_wait_s > 0
    finally:
        release.set()
        q.close()
    with pytest.raises(RequestError, match="shutting down"):
        q.submit("forward", lambda w: None)


def test_backward_lane_runs_first_and_gate_holds_forwards():
    order = []
    gate_open = threading.Event()
    q = ComputeQueue(max_queue=8, forward_gate=gate_open.is_set)
    done = threading.Event()
    q.submit("forward", lambda w: order.append("f1"))
    q.submit("backward", lambda w: order.append("b1"))
    q.submit("backward", lambda w: order.append("b2"))
    q.start()
    try:
        q.submit("backward", lambda w: done.set())
        assert done.wait(5)
        assert order == ["b1", "b2"]  # f1 is held by the closed gate
        assert not q.idle
        gate_open.set()
        q.notify()
        assert q.wait_idle(5)
        assert order == ["b1", "b2", "f1"]
    finally:
        q.close()


def test_a_failing_task_does_not_kill_the_worker():
    q = ComputeQueue(max_queue=4)
    q.start()
    try:
        ran = threading.Event()

        def boom(waited):
            raise RuntimeError("bug")

        q.submit("forward", boom)
        q.submit("forward", lambda w: ran.set())
        assert ran.wait(5) and q.wait_idle(5)
        assert q.stats.failed == 1 and q.stats.completed == 2
    finally:
        q.close()
