"""`--fold-output` on the console: the router's console write goes through a `Folder`
(poprun/fold.py), and what it releases goes back to the router's console write, tagged with
its set of instances. Only the console folds: the per-instance files and the job's log
(observers of the job's events) still get every instance's own lines.

An event observer too: it learns which instances the attempt has (`planned`) and which will
write no more (`exited`, `host_lost`), so that a line every running instance has written is
printed at once; one loop timer prints what has waited `fold.BOUND`. A new attempt and the
router's close print everything still held, before poprun's report.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from poprun.events import JobObserver
from poprun.fold import BOUND, Folder

# For tests only: the bound in seconds. Tests that count the lines of 64 instances on a
# loaded machine cannot make them all write one line within 100 ms (their own scheduling
# spreads them); the tests of the bound itself leave it alone.
TEST_BOUND_VARIABLE = "_POPRUN_FOLD_BOUND"


def _bound() -> float:
    try:
        return float(os.environ.get(TEST_BOUND_VARIABLE) or BOUND)
    except ValueError:
        return BOUND


class ConsoleFold(JobObserver):
    """Between the router's console path (`add`) and its writes (`router.console`, which
    tags a block with the instance or the set that wrote it)."""

    def __init__(self, router, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._router = router
        self._loop = loop or asyncio.get_running_loop()
        self._core = Folder(bound=_bound())
        self._timer: asyncio.TimerHandle | None = None

    def add(self, key: int, stream, data: bytes) -> None:
        self._print(self._core.add(key, stream, data, self._loop.time()))

    def planned(self, hosts: Sequence[str]) -> None:
        self._print(self._core.start(range(len(hosts))))

    def exited(self, key: int, returncode: int, now: float, error) -> None:
        self._print(self._core.exited(key))

    def host_lost(self, host: str, keys: Sequence[int], now: float) -> None:
        for key in keys:
            self._print(self._core.exited(key))

    def flush(self) -> None:
        """Everything held, now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._print(self._core.flush())

    def _expire(self) -> None:
        self._timer = None
        self._print(self._core.expire(self._loop.time()))

    def _print(self, released: list) -> None:
        for keys, stream, data in released:
            self._router.console(keys, stream, data)
        # One timer, for the oldest held line; it fires at most once a bound or so (the
        # head moves on by itself meanwhile: it then only sets the next one).
        if self._timer is None:
            deadline = self._core.deadline()
            if deadline is not None:
                self._timer = self._loop.call_at(deadline, self._expire)
