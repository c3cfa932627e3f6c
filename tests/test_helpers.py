"""The waiting helpers of tests/helpers.py, which every loopback test relies on to fail instead of hang."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.helpers import time_limit, until, wait_until


def test_time_limit_turns_an_overrun_into_timeout_error_and_leaves_the_task_usable():
    async def main():
        with pytest.raises(TimeoutError, match="0.05 s"):
            async with time_limit(0.05):
                await asyncio.sleep(30)
        task = asyncio.current_task()
        assert not hasattr(task, "cancelling") or task.cancelling() == 0  # the cancellation was consumed
        async with time_limit(5):  # a block that finishes in time is untouched
            await asyncio.sleep(0)
            return "done"

    assert asyncio.run(main()) == "done"


def test_time_limit_lets_a_cancellation_from_elsewhere_through():
    async def victim():
        async with time_limit(30):
            await asyncio.sleep(30)

    async def main():
        task = asyncio.get_running_loop().create_task(victim())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_waits_return_once_the_condition_holds_and_fail_naming_it():
    calls = itertools.count()
    assert wait_until(lambda: next(calls) >= 3 and "the value", 5, "three polls", interval_s=0) == "the value"
    with pytest.raises(AssertionError, match="waiting for the impossible"):
        wait_until(lambda: False, 0.05, "the impossible", interval_s=0.01)

    async def main():
        ticks = itertools.count()
        assert await until(lambda: next(ticks) >= 3 and 7, 5, "three polls", interval_s=0) == 7
        with pytest.raises(AssertionError, match="after 0.05 s waiting for nothing"):
            await until(lambda: False, 0.05, "nothing", interval_s=0.01)

    asyncio.run(main())
