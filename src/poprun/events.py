"""The one seam between a running job and what watches it (docs/architecture.md, "Events").

The `Job` publishes what happens — an instance started, a block of its output (counted), its
CPU and memory, its exit, a host lost, a stall, the job stopping, a new attempt — to its
`Observers`: the dashboard's panel, the job's record, the output log, the stall watch, and
whatever comes next. An observer overrides the `JobObserver` methods it uses; it is given
what else it needs (job metadata, a stop callback) when it is built, never reaches into the
session, and never writes another observer's state.

`InstanceRow` is the one per-instance row: the dashboard, `poprunctl show` and the record all
keep theirs in an `InstanceRows`, fed by the same events. Pure: no I/O, times passed in (the
launcher's loop clock).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from poprun.text import signal_name

LAST_LINE_KEEP = 512  # bytes of an instance's last line kept: the panel shows one row of it


class InstanceState(str, enum.Enum):
    """Where one instance is in its life."""

    STARTING = "starting"
    """Planned; no pid yet."""
    RUNNING = "running"
    """Started and not yet exited."""
    EXITED = "exited"
    """Exited with status 0."""
    FAILED = "failed"
    """Exited with a non-zero status."""
    KILLED = "killed"
    """Ended by a signal."""
    LOST = "lost"
    """Its host's connection or agent went away: its fate is unknown."""


DONE = (InstanceState.EXITED, InstanceState.FAILED, InstanceState.KILLED, InstanceState.LOST)
BAD = (InstanceState.FAILED, InstanceState.KILLED, InstanceState.LOST)


def last_line(data: bytes) -> bytes:
    """The last non-empty line of a block, cut to LAST_LINE_KEEP bytes; `\\r` ends a line as
    `\\n` does, so of `10%\\r20%\\r` it is `20%` (a progress bar shows as it moves)."""
    end = len(data)
    while end and data[end - 1] in b"\r\n":
        end -= 1
    # The last `\n` first, then a `\r` only after it: a `\r` searched for from the end of a
    # block without one scanned all of it (a block is up to 1 MiB: ~2 ns a line).
    newline = data.rfind(b"\n", 0, end)
    start = max(newline, data.rfind(b"\r", newline + 1, end)) + 1
    return data[start:min(end, start + LAST_LINE_KEEP)]


class InstanceRow:
    """One instance as every view of a running job shows it; updated by InstanceRows."""

    __slots__ = ("index", "host", "pid", "local", "state", "returncode", "started", "ended",
                 "lines", "last_output", "last_line", "usage", "progress")

    def __init__(self, index: int, host: str) -> None:
        self.index, self.host = index, host
        self.pid: int | None = None
        self.local = False  # its pid is on this host: /proc can be read
        self.state = InstanceState.STARTING
        self.returncode: int | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self.lines = 0
        self.last_output: float | None = None
        self.last_line = b""
        self.usage = None  # spawner.procstat.Usage: sampled here, or reported by an agent
        # Its entry in the last progress report (poprun.progress.Report): step, total, rate...
        self.progress: Mapping[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.state in DONE

    @property
    def status(self) -> str:
        """As the panel and `poprunctl show` say it: running, exited 0, failed 3, killed
        SIGTERM, lost..."""
        if self.state is InstanceState.EXITED:
            return "exited 0"
        if self.state is InstanceState.FAILED:
            return f"failed {self.returncode}"
        if self.state is InstanceState.KILLED:
            return f"killed {signal_name(-self.returncode)}"
        return self.state.value

    @property
    def slow(self) -> bool:
        """A running straggler, as the last progress report has it."""
        return not self.done and self.progress is not None and self.progress["slow"]

    def uptime(self, now: float) -> float | None:
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else now) - self.started

    def idle(self, now: float) -> float | None:
        """Seconds since its last line (since its start when it has written none); None once
        it has ended, when silence no longer means anything."""
        if self.done or self.started is None:
            return None
        return now - (self.last_output if self.last_output is not None else self.started)


class InstanceRows:
    """Every instance of one attempt, by index."""

    def __init__(self, hosts: Sequence[str], now: float) -> None:
        self.began = now
        self.instances = {i: InstanceRow(i, host) for i, host in enumerate(hosts)}
        self.report = None  # the last progress report (poprun.progress.Report), if any

    @property
    def all_started(self) -> bool:
        return all(r.pid is not None for r in self.instances.values())

    def planned(self, hosts: Iterable[tuple[int, str]]) -> None:
        """(instance, host) pairs, once the plan is made: rows show their host before pids."""
        for index, host in hosts:
            self.instances[index].host = host

    def started(self, index: int, host: str, pid: int, now: float, local: bool) -> None:
        row = self.instances[index]
        row.host, row.pid, row.local, row.started = host, pid, local, now
        if row.state is InstanceState.STARTING:  # an exit may be reported before the start
            row.state = InstanceState.RUNNING

    def output(self, index: int, data: bytes, now: float, lines: int | None = None) -> None:
        """A block of whole lines (or a `\\r` progress update); `lines`: its `\\n` count,
        when the caller has it already."""
        row = self.instances[index]
        row.lines += data.count(b"\n") if lines is None else lines
        row.last_output = now
        row.last_line = last_line(data) or row.last_line

    def exited(self, index: int, returncode: int, now: float) -> None:
        row = self.instances[index]
        row.returncode, row.ended = returncode, now
        row.state = (InstanceState.EXITED if returncode == 0 else
                     InstanceState.FAILED if returncode > 0 else InstanceState.KILLED)

    def progressed(self, report) -> None:
        """A progress report (poprun.progress.Report): each row keeps its entry."""
        self.report = report
        for index, entry in report.instances.items():
            self.instances[index].progress = entry

    def host_lost(self, host: str, now: float) -> None:
        """Every instance of `host` that had not ended is lost with it."""
        for row in self.instances.values():
            if row.host == host and not row.done:
                row.state, row.ended = InstanceState.LOST, now


class JobObserver:
    """What a running job publishes; each method a no-op here. Times are the launcher's loop
    clock. Called on the loop's thread, in the order things happened; an observer must not
    block (the output path runs through `output`)."""

    def planned(self, hosts: Sequence[str]) -> None:
        """The attempt's plan is made: `hosts[i]` runs instance i."""

    def started(self, key: int, host: str, pid: int, now: float, *, local: bool,
                start_ticks: int | None) -> None:
        """Instance `key` runs as `pid` (`local`: on this host); `start_ticks`: its start in
        /proc's clock (spawner/procid.py), when known."""

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        """A block of whole lines of `stream` (spawner.local.Stream), `lines` of them."""

    def usage(self, key: int, usage) -> None:
        """An agent's sample of a remote instance's CPU and memory (spawner.procstat.Usage)."""

    def stepped(self, key: int, step: int, total: int | None, now: float) -> None:
        """An agent's sample of a remote instance's own progress (`popdist.progress`): for
        the progress watch (poprun/jobctl/progress.py), which samples local ones itself."""

    def progress(self, report) -> None:
        """The progress watch's report (poprun.progress.Report), about once a second: each
        instance's step, total, rate and whether it is slow; the slowest one and its ETA."""

    def exited(self, key: int, returncode: int, now: float,
               error: Mapping[str, Any] | None) -> None:
        """Instance `key` ended (after its last output); `error`: its uncaught exception as
        popdist wrote it, if any."""

    def host_lost(self, host: str, keys: Sequence[int], now: float) -> None:
        """`host`'s connection or agent is gone, and with it instances `keys`."""

    def stopping(self, reason: str, now: float) -> None:
        """The job is being stopped ("SIGINT", "instance 3 failed"...); may come again."""

    def stalled(self, stall: Mapping[str, Any], ongoing: bool) -> None:
        """No instance wrote a line for --stall-timeout: `stall` is what was found (idle,
        timeout, stacks_file, stacks); `ongoing`: still silent once the stacks were read."""

    def unstalled(self) -> None:
        """Output again after a stall."""

    def restarted(self, attempt: int, attempts: int) -> None:
        """A new attempt (`--max-restarts`), 1-based, of `attempts`: rows start afresh."""


_EVENTS = tuple(name for name in vars(JobObserver) if not name.startswith("_"))


class Observers:
    """The job's observers; calling an event calls it on each, in the order they were
    added. Only observers that override an event are called for it: the output path pays
    for the observers that want output, nothing more."""

    def __init__(self, observers: Iterable[JobObserver] = ()) -> None:
        self._all: list[JobObserver] = []
        for name in _EVENTS:
            setattr(self, name, _Fanout())
        for observer in observers:
            self.add(observer)

    def add(self, observer: JobObserver) -> None:
        self._all.append(observer)
        for name in _EVENTS:
            if getattr(type(observer), name) is not getattr(JobObserver, name):
                getattr(self, name).handlers.append(getattr(observer, name))

    def __iter__(self):
        return iter(self._all)


class _Fanout:
    __slots__ = ("handlers",)

    def __init__(self) -> None:
        self.handlers: list = []

    def __call__(self, *args, **kwargs) -> None:
        for handler in self.handlers:
            handler(*args, **kwargs)
