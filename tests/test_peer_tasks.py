"""``TaskOwner`` (peer/tasks.py) without sockets: a crashed loop is logged, restarted or stops the peer."""

from __future__ import annotations

import asyncio
import logging

from peer.loops import SUPERVISION
from peer.tasks import Supervision, TaskOwner

FAST = Supervision(restart=True, max_restarts=2, backoff_s=0.0)


class Boom(RuntimeError):
    pass


def owner_with_fatal() -> tuple[TaskOwner, list[tuple[str, BaseException]]]:
    fatal: list[tuple[str, BaseException]] = []

    async def on_fatal(name: str, error: BaseException) -> None:
        fatal.append((name, error))

    return TaskOwner(on_fatal), fatal


def crash_records(caplog, name: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "peer.tasks" and r.levelno == logging.ERROR and repr(name) in r.getMessage()
    ]


async def settle(condition, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_a_crashed_loop_is_restarted_and_logged_with_its_traceback(caplog):
    async def main():
        owner, fatal = owner_with_fatal()
        runs: list[int] = []
        stay = asyncio.Event()

        async def loop():
            runs.append(1)
            if len(runs) <= 2:
                raise Boom(f"crash {len(runs)}")
            await stay.wait()

        owner.loop("expiry", loop, FAST)
        await settle(lambda: len(runs) == 3)
        await asyncio.sleep(0.05)
        assert fatal == [] and owner.crashed is None and len(owner) == 1  # running again
        await owner.close()
        assert len(owner) == 0

    with caplog.at_level(logging.ERROR, logger="peer.tasks"):
        asyncio.run(main())
    records = crash_records(caplog, "expiry")
    assert len(records) == 2
    assert all("restarting" in r.getMessage() for r in records)
    assert [str(r.exc_info[1]) for r in records] == ["crash 1", "crash 2"]  # the traceback is logged


def test_a_loop_that_keeps_crashing_stops_the_peer_after_its_restarts(caplog):
    async def main():
        owner, fatal = owner_with_fatal()
        runs: list[int] = []

        async def loop():
            runs.append(1)
            raise Boom("always")

        owner.loop("announce", loop, FAST)
        await settle(lambda: bool(fatal))
        assert len(runs) == 3  # the first run and max_restarts=2 restarts
        assert fatal[0][0] == "announce" and isinstance(fatal[0][1], Boom)
        assert owner.crashed == "announce"
        await owner.close()

    with caplog.at_level(logging.ERROR, logger="peer.tasks"):
        asyncio.run(main())
    assert "stopping the peer" in crash_records(caplog, "announce")[-1].getMessage()


def test_a_loop_without_restarts_stops_the_peer_at_once(caplog):
    async def main():
        owner, fatal = owner_with_fatal()
        runs: list[int] = []

        async def loop():
            runs.append(1)
            raise Boom("rounds broke")

        owner.loop("replica rounds", loop, Supervision(restart=False))
        await settle(lambda: bool(fatal))
        await asyncio.sleep(0.05)
        assert runs == [1] and owner.crashed == "replica rounds"
        await owner.close()

    with caplog.at_level(logging.ERROR, logger="peer.tasks"):
        asyncio.run(main())
    (record,) = crash_records(caplog, "replica rounds")
    assert "not restarted" in record.getMessage() and record.exc_info is not None


def test_a_loop_that_ran_healthy_counts_its_crashes_anew():
    async def main():
        now = [0.0]
        fatal: list[str] = []

        async def on_fatal(name, error):
            fatal.append(name)

        owner = TaskOwner(on_fatal, clock=lambda: now[0])
        runs: list[int] = []

        async def loop():
            runs.append(1)
            now[0] += 100.0  # every run lasts longer than healthy_s
            raise Boom("rare")

        how = Supervision(restart=True, max_restarts=1, backoff_s=0.0, healthy_s=60.0)
        owner.loop("checkpoint", loop, how)
        await settle(lambda: len(runs) >= 6)
        assert fatal == []
        await owner.close()

    asyncio.run(main())


def test_a_loop_that_returns_just_ends_and_close_cancels_the_rest():
    async def main():
        owner, fatal = owner_with_fatal()
        cancelled: list[str] = []

        async def done():
            return None

        async def forever():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append("forever")
                raise

        owner.loop("replica rounds", done, Supervision(restart=False))
        owner.loop("authorized", forever, FAST)
        await settle(lambda: len(owner) == 1)
        await owner.close()
        assert cancelled == ["forever"] and fatal == [] and len(owner) == 0

    asyncio.run(main())


def test_a_crashed_one_shot_task_is_logged_and_nothing_else(caplog):
    async def main():
        owner, fatal = owner_with_fatal()

        async def probe():
            raise Boom("probe failed")

        owner.spawn("probe trainer X", probe())
        await settle(lambda: len(owner) == 0)
        assert fatal == [] and owner.crashed is None

    with caplog.at_level(logging.ERROR, logger="peer.tasks"):
        asyncio.run(main())
    (record,) = crash_records(caplog, "probe trainer X")
    assert record.exc_info is not None


def test_every_peer_loop_has_a_supervision():
    assert set(SUPERVISION) == {"announce", "expiry", "authorized", "checkpoint", "replica rounds"}
    assert not SUPERVISION["replica rounds"].restart  # a half-taken round cannot be repaired by a restart
    assert all(SUPERVISION[name].restart for name in ("announce", "expiry", "authorized", "checkpoint"))


def test_a_crashed_replica_rounds_thread_stops_the_peer(caplog):
    """The rounds run in their own thread; its crash reaches the owner through ``watch_rounds``."""
    from peer.loops import watch_rounds
    from peer.policy import AsyncPolicy
    from peer.replicas import ReplicaRounds, RoundsConfig

    class BrokenCompute:
        stage, replicas, policy, speculate = 0, 2, AsyncPolicy(), False
        on_round_due = None

        def quiet_after(self, floor_s, cap_s):
            return floor_s

        def round_due(self, settle_s):
            raise Boom("a bug in the rounds")

    compute = BrokenCompute()
    rounds = ReplicaRounds(
        compute, None, peer_id="me", config=RoundsConfig(), replicas_fn=lambda: 2, catch_up=lambda v: False
    )

    async def main():
        owner, fatal = owner_with_fatal()
        rounds.start()
        owner.loop("replica rounds", lambda: watch_rounds(rounds), SUPERVISION["replica rounds"])
        await settle(lambda: bool(fatal))
        assert fatal[0][0] == "replica rounds" and isinstance(fatal[0][1], Boom)
        assert compute.replicas == 1  # meanwhile the stage steps alone
        await owner.close()

    with caplog.at_level(logging.ERROR, logger="peer.tasks"):
        asyncio.run(main())
    (record,) = crash_records(caplog, "replica rounds")
    assert "a bug in the rounds" in str(record.exc_info[1])


def test_stopped_replica_rounds_just_end_their_watch():
    from peer.loops import watch_rounds
    from peer.policy import AsyncPolicy
    from peer.replicas import ReplicaRounds, RoundsConfig

    class IdleCompute:
        stage, replicas, policy, speculate = 0, 1, AsyncPolicy(), False
        on_round_due = None

    rounds = ReplicaRounds(
        IdleCompute(),
        None,
        peer_id="me",
        config=RoundsConfig(),
        replicas_fn=lambda: 1,
        catch_up=lambda v: False,
    )

    async def main():
        rounds.start()
        await asyncio.to_thread(rounds.stop, 5)
        await asyncio.wait_for(watch_rounds(rounds), 5)  # returns, raises nothing

    asyncio.run(main())
