"""poprun's own messages, in the original's shape: `HH:MM:SS.mmm <pid> POPRUN [I|D|W|E] msg`.

Warnings and errors always show; `-v` adds information, `-vv` debugging detail. Messages go to
stderr so they never mix with the instances' stdout.
"""

from __future__ import annotations

import os
import time


class Log:
    def __init__(self, verbosity: int = 0, fd: int = 2) -> None:
        self.verbosity = verbosity
        self._fd = fd
        self._pid = os.getpid()
        # os.write, or a live dashboard's emit (which erases its panel around the line).
        self.write = os.write
        # The first error writing to `fd` (a stderr opened read-only, a full disk): the message
        # is lost, and the launch ends with the output error's status (74) for it.
        self.lost: OSError | None = None

    def error(self, msg: str) -> None:
        self._emit("E", msg)

    def warning(self, msg: str) -> None:
        self._emit("W", msg)

    def always(self, msg: str) -> None:
        """Information the user asked for (e.g. --report-bindings): shown at any verbosity."""
        self._emit("I", msg)

    def info(self, msg: str) -> None:
        if self.verbosity >= 1:
            self._emit("I", msg)

    def debug(self, msg: str) -> None:
        if self.verbosity >= 2:
            self._emit("D", msg)

    def _emit(self, level: str, msg: str) -> None:
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        line = f"{stamp} {self._pid} POPRUN [{level}] {msg}\n"
        try:
            self.write(self._fd, line.encode("utf-8", "replace"))
        except OSError as exc:  # a stderr that cannot take it must not turn it into a crash
            self.lost = self.lost or exc
