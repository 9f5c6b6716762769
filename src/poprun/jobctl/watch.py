"""The running job's record: an observer of the job's events (poprun/events.py)
that keeps `job.json` (poprun/jobctl/records.py) up to date for `poprunctl`.

It is given what it records when it is built: the job's id and directory, the launch's
static facts, and `facts()`, the session's answer for what becomes known as the launch goes
(agents, caches, partition...). Writes are coalesced (`RECORD_EVERY`); the final record is
the launch's result (`finish`), written once.

A launch never fails because of it: a state directory that cannot be written means no record
(said at -v), a write that fails is skipped.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from spawner import procid
from spawner.containment import cgroup_root

from poprun.events import InstanceRows, JobObserver
from poprun.jobctl import records
from poprun.result import LaunchResult, instance_json, job_json

# The record is rewritten at most this often (its final write is at once): a job whose eight
# instances start and end within a second would otherwise write it ~20 times (~0.4 ms each).
RECORD_EVERY = 0.05


class JobRecord(JobObserver):
    """One launch's record. `facts()` gives the record's keys that the session learns as the
    launch goes; `lifeline` and `transport` are the launch's (for reap)."""

    def __init__(self, job_id: str, directory: str, loop: asyncio.AbstractEventLoop, *,
                 config, cwd: str, lifeline, transport: str | None,
                 facts: Callable[[], Mapping[str, Any]], log_path: str | None) -> None:
        self.id, self.dir, self.loop, self.config = job_id, directory, loop, config
        self.start_time = time.time()
        self.wall = self.start_time - loop.time()  # the loop clock to the epoch
        self.status = "starting"
        self.attempt = 0
        self.ticks: dict[int, int | None] = {}  # per instance of this attempt, its start
        self.rows = self._new_rows()
        self.stop_reason: str | None = None
        self.stalls: list[dict[str, Any]] = []
        self._facts = facts
        self._log_path = log_path
        self._static = self._static_meta(cwd, lifeline, transport)
        self._write_scheduled: asyncio.TimerHandle | None = None
        self._written_at = -RECORD_EVERY  # loop time of the last write
        # finish()'s last (result given, record written): it ends the record's writes
        self._finished: tuple[LaunchResult, LaunchResult] | None = None
        self.closed = False

    def _new_rows(self) -> InstanceRows:
        """The instances as `show` sends them (their hosts known once the plan is made)."""
        return InstanceRows([""] * self.config.num_instances, self.loop.time())

    # --- the job's events ---------------------------------------------------------------

    def planned(self, hosts: Sequence[str]) -> None:
        self.rows.planned(enumerate(hosts))

    def started(self, key: int, host: str, pid: int, now: float, *, local: bool,
                start_ticks: int | None) -> None:
        self.ticks[key] = start_ticks
        self.rows.started(key, host, pid, now, local)
        if self.status == "starting" and self.rows.all_started:
            self.status = "running"
        self._schedule_write()

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        self.rows.output(key, data, now, lines)

    def usage(self, key: int, usage) -> None:
        self.rows.instances[key].usage = usage

    def exited(self, key: int, returncode: int, now: float, error) -> None:
        self.rows.exited(key, returncode, now)
        self._schedule_write()

    def progress(self, report) -> None:
        """Rewritten when an instance turns slow or recovers, and, with steps of a total,
        for the ETA; a job counting lines only otherwise waits for its next write."""
        before = self.rows.report
        self.rows.progressed(report)
        if report.source != "lines" or before is None or before.slow != report.slow \
                or len(before.stragglers) != len(report.stragglers):
            self._schedule_write()

    def host_lost(self, host: str, keys: Sequence[int], now: float) -> None:
        self.rows.host_lost(host, now)
        self._schedule_write()

    def stopping(self, reason: str, now: float) -> None:
        self.stop_reason = reason
        self.status = "stopping"
        self._schedule_write()

    def stalled(self, stall: Mapping[str, Any], ongoing: bool) -> None:
        self.stalls.append({k: v for k, v in stall.items() if k != "stacks"})
        if ongoing:
            self.status = "stalled"
        self._schedule_write()

    def unstalled(self) -> None:
        if self.status == "stalled":
            self.status = "running"
            self._schedule_write()

    def restarted(self, attempt: int, attempts: int) -> None:
        self.attempt = attempt - 1  # 0-based in the record, as the attempts list counts
        self.ticks.clear()
        hosts = [row.host for row in self.rows.instances.values()]
        self.rows = self._new_rows()
        self.rows.planned(enumerate(hosts))
        self.stop_reason = None
        self.status = "starting"
        self._schedule_write()

    # --- the record -----------------------------------------------------------------------

    def _static_meta(self, cwd: str, lifeline, transport: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "argv": list(sys.argv),
            "program": list(self.config.program),
            "cwd": cwd,
            "user": os.getuid(),
            "start_time": self.start_time,
            "launcher": {"host": socket.gethostname(), "pid": os.getpid(),
                         "start": procid.start_ticks(os.getpid()), "boot_id": procid.boot_id()},
            "lifeline": {"pid": lifeline.pid, "start": procid.start_ticks(lifeline.pid),
                         "token": lifeline.token} if lifeline is not None else None,
            "transport": transport,
            "num_instances": self.config.num_instances,
            "control": records.socket_path(self.dir),
            "dir": self.dir,
            "stall_timeout": self.config.stall_timeout,
            "stall_action": self.config.stall_action,
            # Where its instances' cgroups are, if this host gives poprun cgroups (reap).
            "cgroup": cgroup_root(lifeline.token) if lifeline is not None else None,
        }

    def meta(self) -> dict[str, Any]:
        """The job's own keys of the record (LaunchResult.job)."""
        return {
            **self._static,
            **self._facts(),
            "end_time": time.time() if self.status == records.ENDED else None,
            "attempt": self.attempt,
            "log": self._log_path,
            "stalls": list(self.stalls),
            **self.progress_json(),
        }

    def record(self) -> dict[str, Any]:
        """The running job's record: LaunchResult.to_json()'s keys, the result's still null."""
        return job_json(self.status, self.meta(), instances=[instance_json(
            index, row.host or None, row.pid, row.returncode, row.state.value,
            lines=row.lines, start=self.ticks.get(index))
            for index, row in sorted(self.rows.instances.items())])

    def progress_json(self) -> dict[str, Any]:
        """The record's `progress` and `stragglers` (poprun.progress.Report.to_json)."""
        report = self.rows.report
        return (report.to_json(self.wall) if report is not None
                else {"progress": None, "stragglers": []})

    def write(self, **fields: Any) -> None:
        self._cancel_write()  # this write is the scheduled one, or makes it needless
        self._written_at = self.loop.time()
        if self.closed and self.status != records.ENDED:
            return
        try:
            records.write(self.dir, {**self.record(), **fields})
        except OSError:
            pass  # the state dir went away or filled up: the job goes on

    def finish(self, result: LaunchResult) -> LaunchResult:
        """The result with the job's record in it (`job`, each instance's start); writes it
        as the final record. Idempotent: the same result again (the launch's end, then
        `launch()`'s return) gives the same answer and writes nothing."""
        if self._finished is not None and any(result is r for r in self._finished):
            return self._finished[1]
        given = result
        self.status = records.ENDED
        result = replace(result, job=self.meta(), attempts=tuple(
            replace(a, job=None) for a in result.attempts), instances=tuple(
            replace(i, start_ticks=i.start_ticks or self.ticks.get(i.index))
            for i in result.instances))
        self._cancel_write()  # a running job's record must not come after the final one
        try:
            records.write(self.dir, result.to_json())
        except OSError:
            pass
        self._finished = (given, result)
        return result

    def close(self, result: LaunchResult | None, error: BaseException | None = None) -> None:
        """The launch is over (every path): the final record, the result's or, when the
        launch ended without one, why."""
        if self.closed:
            return
        self.closed = True
        if result is not None:
            self.finish(result)
            return
        self.status = records.ENDED
        self.write(exit_reason="error" if error is not None else None,
                   error=None if error is None else f"{type(error).__name__}: {error}")

    def _cancel_write(self) -> None:
        if self._write_scheduled is not None:
            self._write_scheduled.cancel()
            self._write_scheduled = None

    def _schedule_write(self) -> None:
        """Coalesced: the events of `RECORD_EVERY` seconds make one write."""
        if self._write_scheduled is None and not self.closed and self._finished is None:
            self._write_scheduled = self.loop.call_at(self._written_at + RECORD_EVERY,
                                                      self.write)

