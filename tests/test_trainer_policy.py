"""The trainer's mode policies (swarm/train/policy.py): what each lets the loop open, and when a step is full."""

from __future__ import annotations

import dataclasses

from swarm.train.config import TrainerConfig
from swarm.train.pacing import InflightPacer
from swarm.train.policy import AsyncPolicy, SyncPolicy, make_policy
from swarm.train.steps import StepBook
from tests.test_trainer_loop import make_spec

TOTALS = {"completed": 0, "dropped": 0, "inflight": 0}


def test_sync_opens_the_next_window_only_once_every_micro_batch_of_the_last_resolved():
    book, policy = (
        StepBook(accumulate=3, resumed=None),
        SyncPolicy(accumulate=3, max_inflight=8, target_steps=2),
    )
    assert policy.quota(book, outstanding=0) == 3
    assert [policy.opened(book) for _ in range(3)] == [{"window": 0}] * 3
    assert policy.quota(book, outstanding=3) == 0 and not policy.step_full(book)
    for _ in range(2):
        book.dropped()
        policy.resolved()
    assert policy.quota(book, outstanding=1) == 0 and not policy.step_full(book)
    book.dropped()
    policy.resolved()
    assert policy.step_full(book)  # dropped ones count: a window is never waited out
    book.close(elapsed_s=1.0, totals=TOTALS, tokens_per_s=0.0)
    assert not policy.step_full(book) and not policy.done(book)
    assert policy.quota(book, outstanding=0) == 3 and policy.opened(book) == {"window": 1}
    assert policy.inflight_target() == 8 and policy.step_fields() == {}
    assert policy.summary() == {"mode": "sync windows", "max": 8}


def test_async_replaces_drops_and_closes_a_step_per_accumulate_completions():
    book = StepBook(accumulate=3, resumed=None)
    policy = AsyncPolicy(accumulate=3, max_inflight=5, target_steps=2, pacer=None)
    assert policy.quota(book, outstanding=2) == 4  # 6 to complete, 2 out
    assert policy.opened(book) == {}
    book.dropped()
    policy.resolved()
    assert policy.quota(book, outstanding=1) == 5 and not policy.step_full(book)
    book.cur.completed = 3
    assert policy.step_full(book)
    book.completed_train = 6
    assert policy.done(book) and policy.quota(book, outstanding=0) == 0
    assert policy.inflight_target() == 5 and policy.step_fields() == {"inflight_target": 5}
    assert policy.summary() == {"mode": "fixed", "max": 5}
    paced = AsyncPolicy(accumulate=3, max_inflight=5, target_steps=2, pacer=InflightPacer(floor=2, ceiling=5))
    assert paced.inflight_target() == 2 and paced.summary()["mode"] == "paced"


def test_the_policy_is_chosen_from_the_spec_mode():
    cfg = TrainerConfig(initial_peers=("/ip4/127.0.0.1/tcp/1/p2p/x",), run_id="p", max_inflight=6)
    assert isinstance(make_policy(make_spec("sync", accumulate=3), cfg, 4), SyncPolicy)
    policy = make_policy(make_spec("async", accumulate=3), cfg, 4)
    assert isinstance(policy, AsyncPolicy) and policy.target_mbs == 12 and policy.pacer is not None
    unpaced = make_policy(make_spec("async", accumulate=3), dataclasses.replace(cfg, pacing=False), 4)
    assert isinstance(unpaced, AsyncPolicy) and unpaced.pacer is None
