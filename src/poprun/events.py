"""A running job's instances as `poprunctl show` lists them and its record stores them: pure
state fed by the Job's events, times passed in (the launcher's loop clock).

The dashboard has a richer model of its own (dashboard.DashboardState); this one is what every
launch keeps, dashboard or not, so it stays small and cheap to import (a launch pays for it).
The states and status words are the dashboard's: starting, running, exited 0, failed N,
killed SIGx, lost.
"""

from __future__ import annotations

from collections.abc import Sequence

from poprun.text import signal_name

LAST_LINE_KEEP = 512  # bytes of an instance's last line kept


class Row:
    """One instance."""

    __slots__ = ("index", "host", "pid", "local", "state", "returncode", "started", "ended",
                 "lines", "last_output", "last_line")

    def __init__(self, index: int, host: str) -> None:
        self.index, self.host = index, host
        self.pid: int | None = None
        self.local = False
        self.state = "starting"  # running, exited, failed, killed, lost
        self.returncode: int | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self.lines = 0
        self.last_output: float | None = None
        self.last_line = b""

    @property
    def done(self) -> bool:
        return self.state in ("exited", "failed", "killed", "lost")

    @property
    def status(self) -> str:
        if self.state == "exited":
            return "exited 0"
        if self.state == "failed":
            return f"failed {self.returncode}"
        if self.state == "killed":
            return f"killed {signal_name(-self.returncode)}"
        return self.state

    def uptime(self, now: float) -> float | None:
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else now) - self.started

    def idle(self, now: float) -> float | None:
        """Seconds since its last line (since its start when none), while it runs."""
        if self.done or self.started is None:
            return None
        return now - (self.last_output if self.last_output is not None else self.started)


class Rows:
    """Every instance of one attempt."""

    def __init__(self, hosts: Sequence[str], now: float) -> None:
        self.began = now
        self.instances = {i: Row(i, host) for i, host in enumerate(hosts)}
        self.stop_reason: str | None = None

    @property
    def all_started(self) -> bool:
        return all(r.pid is not None for r in self.instances.values())

    def started(self, index: int, pid: int, now: float, local: bool) -> None:
        row = self.instances[index]
        row.pid, row.local, row.started = pid, local, now
        if row.state == "starting":  # an exit may be reported before the start
            row.state = "running"

    def output(self, index: int, data: bytes, now: float, lines: int | None = None) -> None:
        """`lines`: the block's `\\n` count, when the caller has it already."""
        row = self.instances[index]
        row.lines += data.count(b"\n") if lines is None else lines
        row.last_output = now
        end = len(data)
        while end and data[end - 1] in b"\r\n":
            end -= 1
        if end:
            start = data.rfind(b"\n", 0, end) + 1
            start = data.rfind(b"\r", start, end) + 1 or start  # a \r after it (progress)
            row.last_line = data[start:min(end, start + LAST_LINE_KEEP)]

    def exited(self, index: int, returncode: int, now: float) -> None:
        row = self.instances[index]
        row.returncode, row.ended = returncode, now
        row.state = "exited" if returncode == 0 else "failed" if returncode > 0 else "killed"

    def host_lost(self, host: str, now: float) -> None:
        for row in self.instances.values():
            if row.host == host and not row.done:
                row.state, row.ended = "lost", now
