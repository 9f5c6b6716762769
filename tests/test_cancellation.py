"""A stop is never lost to an answer that came in the same turn of the event loop.

Python 3.11's `asyncio.wait_for` returns the awaited result when the cancellation of its
task meets that result's arrival in one turn, and the cancellation is gone: a SIGTERM before
any instance started, meeting the PMIx server's answer, left poprun waiting for good. The
waits on an answer use `spawner.within` instead (the agent's Python 3.10 has no
`asyncio.timeout`). These tests make the two arrive in the same turn, on purpose.
"""

from __future__ import annotations

import asyncio

import pytest

from spawner.worlds import pmixhost
from spawner.worlds.mpinames import NameService
from spawner.within import bounded, within


class _Link:
    """What `_Server._answer` uses of its server: the answers it waits for."""

    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future] = {}
        self.killed: list[str] = []

    def kill(self, why: str) -> None:
        self.killed.append(why)


def _cancelled_as_answered(waiter, answer) -> None:
    """Run `waiter()` until it waits, then answer it and cancel it in one turn: the
    cancellation must come out of the task."""

    async def main():
        task = asyncio.get_running_loop().create_task(waiter())
        for _ in range(3):  # it is waiting
            await asyncio.sleep(0)
        answer()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_a_cancellation_that_meets_the_pmix_server_s_answer_is_not_lost():
    link = _Link()
    future: asyncio.Future | None = None

    async def waiter():
        nonlocal future
        future = asyncio.get_running_loop().create_future()
        link._waiting[1] = future
        return await pmixhost._Server._answer(link, 1, future)

    _cancelled_as_answered(waiter, lambda: future.set_result({"version": "4.2.2"}))
    assert link._waiting == {} and link.killed == []


def test_an_answer_that_does_not_come_is_a_timeout():
    async def main():
        future = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await within(future, 0.01)

    asyncio.run(main())


def test_a_cancellation_that_meets_a_waited_for_name_is_not_lost():
    names = NameService()

    async def waiter():
        return await names.name("lookup", "svc", wait=30.0)

    _cancelled_as_answered(waiter, lambda: names.answer("publish", "svc", "port-1"))
    assert names.waiting() == 0


def test_a_cancellation_that_meets_a_bounded_wait_s_result_is_not_lost():
    """`bounded` (an srun step's call back, a subprocess's output, a reach-back connection):
    asyncio.wait_for in its place returns the result here, and the stop is gone."""
    inner: asyncio.Future | None = None

    async def waiter():
        nonlocal inner
        inner = asyncio.get_running_loop().create_future()
        return await bounded(asyncio.shield(inner), 30)

    _cancelled_as_answered(waiter, lambda: inner.set_result("called back"))


def test_a_bounded_wait_ends_its_awaitable_at_its_time_limit():
    async def main():
        ended = []

        async def slow():
            try:
                await asyncio.sleep(30)
            finally:
                ended.append(True)

        with pytest.raises(TimeoutError):
            await bounded(slow(), 0.01)
        assert ended == [True]  # cancelled, and waited for
        assert await bounded(asyncio.sleep(0, "done"), 30) == "done"

    asyncio.run(main())
