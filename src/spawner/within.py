"""Awaiting an answer of ours with a time limit, without ever losing a cancellation.

`asyncio.wait_for`, up to Python 3.11, returns a result that arrives in the same turn as the
cancellation of the task awaiting it, and the cancellation is gone (a stop signal before any
instance started, meeting the PMIx server's answer, left poprun waiting for good).
`asyncio.timeout` does not lose it, but is 3.11's, and the agent runs on 3.10
(`carried.MIN_PYTHON`). So `within` bounds a future of ours, and `bounded` anything else
(a subprocess's output, a connection, a shielded future); both raise the built-in
TimeoutError, which 3.10's asyncio.TimeoutError is not.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def within(future: asyncio.Future, seconds: float) -> Any:
    """`future`'s result, or TimeoutError after `seconds`. For a future made and completed
    only by us: the time limit is set on it as its exception. Awaited bare, a cancellation
    of the awaiting task always comes out of it (and cancels `future`)."""

    def expire() -> None:
        if not future.done():
            future.set_exception(TimeoutError())

    deadline = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        return await future
    finally:
        deadline.cancel()


async def bounded(awaitable, seconds: float) -> Any:
    """`awaitable`'s result, or TimeoutError after `seconds`, once it has been cancelled
    (and has ended, as `asyncio.wait_for` waits). A cancellation of the awaiting task always
    comes out of it, and cancels `awaitable` too (not what a shield protects)."""
    task = asyncio.ensure_future(awaitable)
    if not task.done():
        settled = task.get_loop().create_future()
        task.add_done_callback(lambda _: settled.done() or settled.set_result(None))
        try:
            await within(settled, seconds)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        except BaseException:
            task.cancel()
            raise
    return task.result()
