"""The running job's control socket (poprun/jobctl/control.py): what `poprunctl show`,
`stacks`, `kill` and `logs` ask of a live job.

It reads the job's record (JobRecord: rows, status, attempt), its output log (JobLog) and
its stall watch; it acts through the callbacks it is given when it is built: `stop(signum)`
(the launch's stop signal handling), `gather(keys, timeout)` (the instances' stacks) and
`cgroup_of(key)` (a local instance's cgroup, for its whole CPU and memory).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from popdist._stacks import signal_number

from poprun.jobctl.control import ControlServer
from poprun.jobctl.joblog import JobLog
from poprun.jobctl.watch import JobRecord
from poprun.text import shown

SHOW_SAMPLE = 0.2  # seconds between the two CPU samples of `show`
_SIGNALS = {int(s) for s in signal.Signals}


class ControlService:
    """One launch's answers on its control socket."""

    def __init__(self, record: JobRecord, log: JobLog, *, stalled: Callable[[], bool],
                 stop: Callable[[int], None],
                 gather: Callable[..., Awaitable[Mapping[int, Any]]],
                 cgroup_of: Callable[[int], str | None],
                 spawned: Callable[[], Any] = tuple) -> None:
        self.record, self.log, self._spawned = record, log, spawned
        self._stalled, self._stop, self._gather, self._cgroup_of = stalled, stop, gather, cgroup_of
        self.server: ControlServer | None = None

    async def start(self, path: str) -> None:
        """Listen on `path`; raises OSError where it cannot."""
        server = ControlServer(path, self.handle)
        await server.start()
        self.server = server

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def handle(self, request: dict[str, Any], writer: asyncio.StreamWriter):
        op = request.get("op")
        if op == "show":
            return await self._show()
        if op == "stacks":
            return await self._stacks(request.get("instances"), request.get("timeout"))
        if op == "kill":
            return self._kill(str(request.get("signal") or "SIGINT"))
        if op == "logs":
            await self._logs(writer, bool(request.get("follow")))
            return None
        return {"ok": False, "error": f"unknown request {op!r}"}

    async def _stacks(self, keys, timeout) -> dict[str, Any]:
        from poprun.jobctl import stacks

        timeout = float(timeout or stacks.DEFAULT_TIMEOUT)
        found = await self._gather(None if keys is None else [int(k) for k in keys],
                                   min(timeout, 120.0))
        return {"ok": True, "job": self.record.id, "stacks": found}

    def _kill(self, name: str) -> dict[str, Any]:
        number = signal_number(name)
        if number is None:
            return {"ok": False, "error": f"{name!r} is not a signal poprun can send"}
        self._stop(number)
        return {"ok": True, "signal": signal.Signals(number).name
                if number in _SIGNALS else str(number)}

    async def _show(self) -> dict[str, Any]:
        """Every instance as the record has it, with the CPU and memory of the local ones
        sampled twice (a rate needs two samples) and the agents' last report of the others."""
        from spawner.procstat import ProcSampler

        record, loop = self.record, self.record.loop
        sampler = ProcSampler()
        local = [r for r in record.rows.instances.values() if r.local and not r.done]
        for row in local:
            sampler.sample(row.pid, loop.time(), self._cgroup_of(row.index))
        if local:
            await asyncio.sleep(SHOW_SAMPLE)
        now = loop.time()
        rows = []
        for index, row in sorted(record.rows.instances.items()):
            usage = (sampler.sample(row.pid, now, self._cgroup_of(index))
                     if row.local and not row.done else row.usage)
            rows.append({
                "index": index, "host": row.host, "pid": row.pid, "state": row.status,
                "uptime": row.uptime(now), "cpu_percent": usage and usage.cpu_percent,
                "rss": usage and usage.rss, "lines": row.lines, "idle": row.idle(now),
                "last_line": shown(row.last_line), "slow": row.slow,
                **{k: (row.progress or {}).get(k) for k in ("step", "total", "rate")}})
        return {"ok": True, "job": record.id, "state": record.status,
                "stop_reason": record.stop_reason, "attempt": record.attempt,
                "uptime": now - record.rows.began, "stalled": self._stalled(),
                "instances": rows, "spawned": list(self._spawned()),
                **record.progress_json()}

    async def _logs(self, writer: asyncio.StreamWriter, follow: bool) -> None:
        """The reply line, what was kept, then (follow) each block as it comes, all from
        this loop: nothing is missed or sent twice between the two."""
        writer.write(json.dumps({"ok": True, "source": self.log.source}).encode() + b"\n")
        writer.write(self.log.history())
        if not follow:
            await writer.drain()
            return
        self.log.followers.add(writer)
        try:
            await writer.drain()
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        finally:
            self.log.followers.discard(writer)
