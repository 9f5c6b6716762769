"""`--stall-timeout`: the job's stall watch, an observer of its events (poprun/events.py).

When no instance has written a line for the timeout while some run, it reads every
instance's stacks (poprun/jobctl/stacks.py), prints them folded once, keeps them beside the
record (`stall-<n>.txt`) and reports the stall (`on_stall`): the job then publishes it to
every observer and, with `--stall-action kill`, stops. Output again is a new start
(`on_unstall`): the next silence is a new stall.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from poprun.events import JobObserver

STALL_STACKS_TIMEOUT = 10.0  # seconds to gather the stacks of a stalled job


class StallWatch(JobObserver):
    """Given what it needs when it is built: the timeout, the job's id and directory (for
    the stacks file), `running()` (the instances running now), `gather(keys, timeout)` (their
    stacks), `emit(text)` (poprun's stderr), and the two reports."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, *, job_id: str,
                 directory: str, cwd: str, running: Callable[[], Sequence[int]],
                 gather: Callable[..., Awaitable[Mapping[int, Any]]],
                 emit: Callable[[bytes], None],
                 on_stall: Callable[[Mapping[str, Any], bool], None],
                 on_unstall: Callable[[], None]) -> None:
        self.loop, self.timeout = loop, timeout
        self.id, self.dir, self.cwd = job_id, directory, cwd
        self._running, self._gather, self._emit = running, gather, emit
        self._on_stall, self._on_unstall = on_stall, on_unstall
        self.stalled = False  # silent for the timeout, and not since
        self._count = 0  # stalls seen: stall-<n>.txt
        self._last_output = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self.closed = False

    # --- the job's events ---------------------------------------------------------------

    def started(self, key: int, host: str, pid: int, now: float, *, local: bool,
                start_ticks: int | None) -> None:
        if self._timer is None and not self.stalled and not self._stopping:
            self._last_output = now
            self._arm()

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        self._last_output = now
        if self.stalled:
            self._unstall()

    def stopping(self, reason: str, now: float) -> None:
        self._stopping = True
        self.cancel()

    def restarted(self, attempt: int, attempts: int) -> None:
        self.cancel()
        self._stopping = self.stalled = False

    # --- the watch ----------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        self.cancel()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _arm(self) -> None:
        if self.timeout and not self.closed:
            delay = max(0.0, self._last_output + self.timeout - self.loop.time())
            self._timer = self.loop.call_later(delay, self._check)

    def _check(self) -> None:
        self._timer = None
        idle = self.loop.time() - self._last_output
        if idle < self.timeout:
            self._arm()
            return
        if self._stopping or not self._running():
            return
        self.stalled = True
        self._task = self.loop.create_task(self._report(idle))

    def _unstall(self) -> None:
        self.stalled = False
        self._on_unstall()
        if self._task is None and self._timer is None:
            self._arm()

    async def _report(self, idle: float) -> None:
        """Print the folded stacks once, keep them beside the record, report the stall
        (`ongoing`: no output came while the stacks were read)."""
        from poprun.jobctl import stacks

        found = await self._gather(None, STALL_STACKS_TIMEOUT)
        folded = stacks.fold(found)
        self._count += 1
        path = os.path.join(self.dir, f"stall-{self._count}.txt")
        title = (f"poprun: job {self.id}: no instance has written a line for "
                 f"{idle:.0f} s (--stall-timeout {self.timeout:g}); where each one is (most "
                 f"recent call first), the odd ones out first:")
        text = stacks.render(folded, title, base=self.cwd)
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError:
            path = None
        self._emit(text.encode("utf-8", "replace"))
        stall = {"time": time.time(), "idle": round(idle, 3), "timeout": self.timeout,
                 "stacks_file": path, "stacks": folded.to_json()}
        self._task = None
        if not self.stalled:  # output came meanwhile: watch for the next silence
            self._arm()
        self._on_stall(stall, self.stalled)
