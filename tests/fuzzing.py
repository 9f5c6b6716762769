"""What the fuzz tests share (tests/test_fuzz_surfaces.py, tests/test_fuzz_peers.py,
tests/test_pmix_fuzz.py): how much Hypothesis tries, and the watch on the event loop that
every in-process fuzzer runs beside the surface it feeds.

Reproducible: `derandomize=True` draws every test's examples from a seed fixed by the test's
own name, so a run in CI tries exactly what a run here tried, and a failure reproduces by
running the test again; the example database is off (`database=None`), since with a fixed seed
it would only hold what the next run tries anyway, and a database left in the tree would make
two checkouts try different things. How much is tried is a number of examples, never a time:
deadlines are off, so a loaded 2-core machine makes a run slower, not different.
"""

from __future__ import annotations

import asyncio
import contextlib

from hypothesis import HealthCheck, Phase, settings

# In-process properties: many examples, each cheap. Shrinking is on: a failure shows the
# smallest example that still fails.
FAST = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
# Examples that move megabytes (the 1 MiB PMI line, a store filled to its limit) or run a
# server for each: fewer of them.
HEAVY = settings(FAST, max_examples=40)
# A launch takes seconds: a few examples, and no shrinking (a failure's example is shown as
# generated), so that a failing run is as bounded as a passing one.
LAUNCHES = settings(max_examples=4, deadline=None, database=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))

# The longest the loop may go without running a 10 ms tick while a surface is fed: generous for
# a loaded 2-core machine, and still what a blocked loop (an open() of a FIFO, a wait on a
# socket) or a quadratic parse of a megabyte never meets.
MAX_GAP = 5.0  # seconds


class Ticker:
    """A task that ticks every 10 ms on the running loop; `gap` is the longest time between
    two ticks, `ticks` how many there were."""

    def __init__(self) -> None:
        self.gap, self.ticks = 0.0, 0

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            now = loop.time()
            self.gap, self.ticks, last = max(self.gap, now - last), self.ticks + 1, now


@contextlib.asynccontextmanager
async def ticking():
    """`async with ticking():` around what feeds a surface: it fails unless the loop kept
    ticking throughout (the surface never blocked it)."""
    ticker = Ticker()
    task = asyncio.get_running_loop().create_task(ticker._run())
    try:
        yield ticker
        for _ in range(100):  # at least one tick, however fast the feeding was
            if ticker.ticks:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert ticker.ticks > 0 and ticker.gap < MAX_GAP, \
        f"the event loop went {ticker.gap:.1f} s without a tick"


def run(coro, timeout: float = 60):
    """An example's coroutine on a loop of its own, bounded in time (a hang is a failure)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
