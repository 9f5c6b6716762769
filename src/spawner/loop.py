"""A small event loop for runs that need nothing but pipes, pidfds, timers and signals.

`import asyncio` costs ~35 ms of start-up here (DESIGN.md §8), about half of what mpirun needs
to start 8 processes. A local-only `poprun` run and the per-host agent need only the few loop
methods below, so they drive the spawner with this loop; `await launch()` and SSH keep asyncio.
The method names and semantics are asyncio's (`add_reader`, `call_later`, `add_signal_handler`,
...), so the spawner and the job policy work unchanged on either loop.
"""

from __future__ import annotations

import heapq
import os
import selectors
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# Written to the wake-up pipe by call_soon_threadsafe; signal.set_wakeup_fd writes the signal
# number, and no signal is numbered 0.
_THREAD_WAKEUP = b"\0"


class Handle:
    """A scheduled callback; `cancel()` stops it from running."""

    __slots__ = ("callback", "args", "cancelled")

    def __init__(self, callback: Callable[..., Any], args: tuple) -> None:
        self.callback, self.args, self.cancelled = callback, args, False

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: Handle) -> bool:  # ties in the timer heap: any order will do
        return id(self) < id(other)


class SelectLoop:
    """Single-threaded: every callback runs on the thread that calls `run_until`."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._ready: deque[Handle] = deque()  # deque.append is atomic: threads may add
        self._timers: list[tuple[float, Handle]] = []
        self._signal_handlers: dict[int, Handle] = {}
        self._old_wakeup_fd: int | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ,
                                Handle(self._on_wakeup, ()))

    def time(self) -> float:
        return time.monotonic()

    # --- scheduling ---------------------------------------------------------------------

    def add_reader(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        self._selector.register(fd, selectors.EVENT_READ, Handle(callback, args))

    def remove_reader(self, fd: int) -> bool:
        try:
            key = self._selector.unregister(fd)
        except KeyError:
            return False
        key.data.cancel()  # an event already collected for this fd must not run
        return True

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> Handle:
        handle = Handle(callback, args)
        self._ready.append(handle)
        return handle

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Handle:
        handle = self.call_soon(callback, *args)
        try:
            os.write(self._wake_w, _THREAD_WAKEUP)
        except BlockingIOError:  # pipe full: a wake-up is pending anyway
            pass
        return handle

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Handle:
        handle = Handle(callback, args)
        heapq.heappush(self._timers, (self.time() + delay, handle))
        return handle

    # --- signals ------------------------------------------------------------------------

    def add_signal_handler(self, sig: int, callback: Callable[..., Any], *args: Any) -> None:
        """Run `callback(*args)` on the loop when `sig` arrives (main thread only, as in
        asyncio). The C-level handler writes the signal number to the wake-up pipe, which
        interrupts the select; the Python-level handler itself does nothing."""
        if self._old_wakeup_fd is None:
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w)
        signal.signal(sig, _ignore)
        self._signal_handlers[sig] = Handle(callback, args)

    def remove_signal_handler(self, sig: int) -> bool:
        if self._signal_handlers.pop(sig, None) is None:
            return False
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                      else signal.SIG_DFL)
        if not self._signal_handlers:
            self._restore_wakeup_fd()
        return True

    def _restore_wakeup_fd(self) -> None:
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None

    def _on_wakeup(self) -> None:
        try:
            data = os.read(self._wake_r, 4096)
        except BlockingIOError:
            return
        for signum in data:
            handle = self._signal_handlers.get(signum)
            if handle is not None:
                self._ready.append(handle)

    # --- running ------------------------------------------------------------------------

    def run_until(self, done: Callable[[], bool]) -> None:
        """Dispatch events until `done()` is true (checked after every round)."""
        while not done():
            for key, _ in self._selector.select(self._timeout()):
                self._ready.append(key.data)
            self._move_due_timers()
            for _ in range(len(self._ready)):  # callbacks added now run next round
                handle = self._ready.popleft()
                if not handle.cancelled:
                    handle.callback(*handle.args)

    def _timeout(self) -> float | None:
        if self._ready:
            return 0
        while self._timers and self._timers[0][1].cancelled:
            heapq.heappop(self._timers)
        return max(0.0, self._timers[0][0] - self.time()) if self._timers else None

    def _move_due_timers(self) -> None:
        now = self.time()
        while self._timers and self._timers[0][0] <= now:
            self._ready.append(heapq.heappop(self._timers)[1])

    def close(self) -> None:
        for sig in list(self._signal_handlers):
            self.remove_signal_handler(sig)
        self._restore_wakeup_fd()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _ignore(signum: int, frame: object) -> None:
    """Python-level handler: the work happens on the loop (see add_signal_handler)."""
