"""The launcher's side of job control (issue 15): one `JobWatch` per launch.

It keeps the job's record (poprun/jobctl/records.py) up to date, serves the job's control socket
(poprun/jobctl/control.py: show, stacks, kill, logs), keeps the output ring (poprun/jobctl/joblog.py) and
watches for stalls (`--stall-timeout`). The session opens it when the launch starts and
closes it on every path; the `Job` tells it what happens (`job.watch`: started, output,
exited, host_lost, stopping), as it tells the dashboard.

A launch never fails because of it: a state directory that cannot be written means no record
(said at -v), a log that cannot be written is turned off.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from popdist._stacks import signal_number
from popdist.env import EXECUTABLE_CACHE_PATH
from spawner import procid
from spawner.local import Stream

from poprun.jobctl import records as jobs

from poprun.jobctl import joblog
from poprun.jobctl.control import ControlServer
from poprun.events import Rows
from poprun.result import JOB_SCHEMA, LaunchResult

STALL_STACKS_TIMEOUT = 10.0  # seconds to gather the stacks of a stalled job
SHOW_SAMPLE = 0.2  # seconds between the two CPU samples of `show`
# The record is rewritten at most this often (its final write is at once): a job whose eight
# instances start and end within a second would otherwise write it ~20 times (~0.4 ms each).
RECORD_EVERY = 0.05
MAX_FOLLOWER_BACKLOG = 8 << 20  # bytes a slow `logs --follow` may lag before it is dropped


class JobWatch:
    """One launch's record, control socket, output ring and stall watch."""

    def __init__(self, session, job_id: str, directory: str) -> None:
        self.session, self.id, self.dir = session, job_id, directory
        self.job = session.job
        self.loop: asyncio.AbstractEventLoop = session.loop
        self.config = session.config
        self.start_time = time.time()
        self.status = "starting"
        self.server: ControlServer | None = None
        self.log: joblog.RingLog | None = None
        self.followers: set[asyncio.StreamWriter] = set()
        self.ticks: dict[int, int | None] = {}  # per instance of this attempt, its start
        self.state = self._new_state()
        self.stalls: list[dict[str, Any]] = []
        self.attempt = 0
        self._pruning: threading.Thread | None = None  # removing old jobs' records
        self._write_scheduled: asyncio.TimerHandle | None = None
        self._written_at = -RECORD_EVERY  # loop time of the last write
        # finish()'s last (result given, record written): it ends the record's writes
        self._finished: tuple[LaunchResult, LaunchResult] | None = None
        self._last_output = self.loop.time()
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_task: asyncio.Task | None = None
        self._stalled = False
        self._meta_static = self._static_meta()
        self.closed = False

    # --- opening and closing ------------------------------------------------------------

    @classmethod
    async def open(cls, session) -> JobWatch | None:
        """Register the launch; None (said at -v) where no record can be written."""
        try:
            job_id, directory = jobs.create(session.environ)
        except OSError as exc:
            session.log.info(f"no job record (poprunctl will not see this job): "
                             f"{exc.strerror or exc}")
            return None
        watch = cls(session, job_id, directory)
        session.job.watch = watch
        cap = joblog.cap_from(session.environ)
        if cap and not session.config.effective_output_filename:
            try:
                watch.log = joblog.RingLog(directory, cap)
            except OSError as exc:
                session.log.info(f"no output log for poprunctl logs: {exc.strerror}")
        path = jobs.socket_path(directory)
        if path is None:
            session.log.info(f"no control socket: {directory} is too long a path for one")
        else:
            try:
                watch.server = ControlServer(path, watch.handle)
                await watch.server.start()
            except OSError as exc:
                session.log.info(f"no control socket: {exc.strerror or exc}")
                watch.server = None
        watch.write()
        session.log.info(f"job {job_id} (poprunctl show {job_id}; record in {directory})")
        return watch

    async def close(self, result: LaunchResult | None, error: BaseException | None = None
                    ) -> None:
        """The launch is over (every path): stop serving, end the record (old records were
        pruned meanwhile)."""
        if self.closed:
            return
        self.closed = True
        self._cancel_stall()
        if self.server is not None:
            await self.server.close()
        for writer in list(self.followers):
            writer.close()
        self.followers.clear()
        if self.log is not None:
            self.log.close()
        if result is not None:
            self.finish(result)
        else:
            self.status = jobs.ENDED
            self.write(extra={"exit_reason": "error" if error is not None else None,
                              "error": None if error is None else
                              f"{type(error).__name__}: {error}"})
        if self._pruning is not None and self._pruning.ident is not None:  # it started
            self._pruning.join()

    def start_pruning(self) -> None:
        """Old records go while the job runs, on a thread: removing a job's output ring
        frees 4 MiB of disk, ~1-2 ms of a launch's end otherwise. Called once the launch
        holds the stop signals: before, a signal raises in the main thread, which must not
        happen inside threading's own locks."""
        if self._pruning is None and not self.closed:
            self._pruning = threading.Thread(target=self._prune, name="poprun-prune",
                                             daemon=True)
            self._pruning.start()

    def _prune(self) -> None:
        try:
            jobs.prune(self.session.environ)
        except OSError:
            pass

    def finish(self, result: LaunchResult) -> LaunchResult:
        """The result with the job's record in it (`job`, each instance's start); writes it
        as the final record. Idempotent: the same result again (the launch's end, then
        `launch()`'s return) gives the same answer and writes nothing."""
        if self._finished is not None and any(result is r for r in self._finished):
            return self._finished[1]

        def decorate(one: LaunchResult) -> LaunchResult:
            return replace(one, job=self.meta(), instances=tuple(
                replace(i, start_ticks=i.start_ticks or self.ticks.get(i.index))
                for i in one.instances))

        given = result
        result = replace(decorate(result), attempts=tuple(
            replace(a, job=None) for a in result.attempts))
        self.status = jobs.ENDED
        self._cancel_write()  # a running job's record must not come after the final one
        try:
            jobs.write(self.dir, result.to_json())
        except OSError:
            pass
        self._finished = (given, result)
        return result

    def attach(self, job) -> None:
        """A new attempt (`--max-restarts`): its Job reports here from now on."""
        self._cancel_stall()
        self.job, job.watch = job, self
        self.attempt += 1
        self.ticks.clear()
        self.state = self._new_state()
        self.status = "starting"
        self._schedule_write()

    def _new_state(self) -> Rows:
        """The instances as `show` sends them (their hosts known once the plan is made)."""
        return Rows([""] * self.config.num_instances, self.loop.time())

    # --- the Job's events -----------------------------------------------------------------

    def started(self, key: int, pid: int, spawner) -> None:
        job = self.job
        if not self.state.instances[key].host:
            for inst in job.plan.instances:
                self.state.instances[inst.index].host = inst.host
        local = spawner is job.local
        self.ticks[key] = (procid.start_ticks(pid) if local
                           else getattr(spawner, "start_ticks", {}).get(key))
        self.state.started(key, pid, self.loop.time(), local)
        if self.status == "starting" and self.state.all_started:
            self.status = "running"
        if self._stall_timer is None and not self._stalled:
            self._last_output = self.loop.time()
            self._arm_stall()
        self._schedule_write()

    def output(self, key: int, stream: Stream, data: bytes, lines: int | None = None
               ) -> None:
        self._last_output = now = self.loop.time()
        self.state.output(key, data, now, lines)
        if self.log is not None:
            self.log.write(key, stream, data)
        if self.followers:
            self._forward(joblog.encode(key, stream.name.lower(), data))
        if self._stalled:
            self._unstall()

    def exited(self, key: int, returncode: int) -> None:
        self.state.exited(key, returncode, self.loop.time())
        self._schedule_write()

    def host_lost(self, host: str, keys: list[int]) -> None:
        self.state.host_lost(host, self.loop.time())
        self._schedule_write()

    def stopping(self, reason: str) -> None:
        self.state.stop_reason = reason
        self.status = "stopping"
        self._cancel_stall()
        self._schedule_write()

    # --- the record -----------------------------------------------------------------------

    def _static_meta(self) -> dict[str, Any]:
        session = self.session
        hosts = session.hosts
        lifeline = session.lifeline
        this = socket.gethostname()
        return {
            "id": self.id,
            "argv": list(sys.argv),
            "program": list(self.config.program),
            "cwd": session.cwd,
            "user": os.getuid(),
            "start_time": self.start_time,
            "launcher": {"host": this, "pid": os.getpid(),
                         "start": procid.start_ticks(os.getpid()), "boot_id": procid.boot_id()},
            "lifeline": {"pid": lifeline.pid, "start": procid.start_ticks(lifeline.pid),
                         "token": lifeline.token} if lifeline is not None else None,
            "transport": hosts.transport if hosts.remote else None,
            "num_instances": self.config.num_instances,
            "control": jobs.socket_path(self.dir),
            "dir": self.dir,
            "stall_timeout": self.config.stall_timeout,
            "stall_action": self.config.stall_action,
            # Where its instances' cgroups are, if this host gives poprun cgroups (reap).
            "cgroup": _cgroup_root(lifeline.token) if lifeline is not None else None,
        }

    def meta(self) -> dict[str, Any]:
        """The job's own keys of the record (LaunchResult.job)."""
        session, job = self.session, self.job
        labels, remote = session.hosts.labels, session.hosts.remote
        fleet = session.fleet
        agents = {label: spawner.info for label, spawner in
                  (fleet.spawners.items() if fleet is not None else ())
                  if spawner.info is not None}
        boot_ids = {label: agents[label].raw.get("boot_id") if label in agents else None
                    for label in remote}
        here = procid.boot_id()
        caches = {}
        if job.plan is not None and job.plan.cache_mode.value == "temporary":
            for inst in job.plan.instances:
                path = inst.env.get(EXECUTABLE_CACHE_PATH)
                if path:
                    caches.setdefault(inst.host, path)
        error_dir = getattr(job.local, "_error_dir", None)  # spawner.local's private dir
        partition = session.partition
        output_dir = self.config.effective_output_filename
        if output_dir:
            output_dir = os.path.join(session.cwd, output_dir.removesuffix(":nocopy"))
        return {
            **self._meta_static,
            "end_time": time.time() if self.status == jobs.ENDED else None,
            "attempt": self.attempt,
            "hosts": [{"label": label, "local": label not in remote,
                       "boot_id": boot_ids[label] if label in remote else here}
                      for label in labels],
            "pythons": {label: info.python_executable for label, info in agents.items()},
            "caches": caches,
            "error_dirs": {label: error_dir for label in labels
                           if label not in remote} if error_dir else {},
            "partition": None if partition is None else {
                "name": partition.name, "created": partition.created,
                "remove": partition.remove_on_release, "host": partition.host,
                "port": partition.port, "timeout": partition.timeout,
                "executable": partition.executable},
            "log": self.log.path if self.log is not None else None,
            "output_dir": output_dir,
            "stalls": list(self.stalls),
        }

    def record(self) -> dict[str, Any]:
        """The running job's record: LaunchResult.to_json()'s keys, the result's still null."""
        state = self.state
        instances = []
        for index, inst in sorted(state.instances.items()):
            ended = inst.returncode
            signalled = ended is not None and ended < 0
            instances.append({
                "index": index, "host": inst.host or None, "pid": inst.pid,
                "start_time": None, "end_time": None, "first_output_time": None,
                "exit_status": None if ended is None else 128 - ended if signalled else ended,
                "signal": signal.Signals(-ended).name if signalled and -ended in
                _SIGNALS else None,
                "outcome": None, "lines": inst.lines, "lost": None,
                "stopped_by_poprun": None, "error": None, "collateral": None,
                "start": self.ticks.get(index),
                "state": inst.state})
        return {
            "schema": JOB_SCHEMA, **self.meta(), "state": self.status,
            "stall": None, "exit_code": None, "exit_reason": None, "root_cause": None,
            "stop_signal": None, "output_error": None, "scheduler_stop": None,
            "attempts": [], "phases": {}, "instances": instances,
        }

    def write(self, extra: dict[str, Any] | None = None) -> None:
        self._cancel_write()  # this write is the scheduled one, or makes it needless
        self._written_at = self.loop.time()
        if self.closed and self.status != jobs.ENDED:
            return
        try:
            jobs.write(self.dir, {**self.record(), **(extra or {})})
        except OSError:
            pass  # the state dir went away or filled up: the job goes on

    def _cancel_write(self) -> None:
        if self._write_scheduled is not None:
            self._write_scheduled.cancel()
            self._write_scheduled = None

    def _schedule_write(self) -> None:
        """Coalesced: the events of `RECORD_EVERY` seconds make one write."""
        if self._write_scheduled is None and not self.closed and self._finished is None:
            self._write_scheduled = self.loop.call_at(self._written_at + RECORD_EVERY,
                                                      self.write)

    # --- the control socket ---------------------------------------------------------------

    async def handle(self, request: dict[str, Any], writer: asyncio.StreamWriter):
        op = request.get("op")
        if op == "show":
            return await self._show()
        if op == "stacks":
            keys = request.get("instances")
            from poprun.jobctl import stacks

            timeout = float(request.get("timeout") or stacks.DEFAULT_TIMEOUT)
            found = await stacks.gather(self.job, None if keys is None else
                                        [int(k) for k in keys], min(timeout, 120.0))
            return {"ok": True, "job": self.id, "stacks": found}
        if op == "kill":
            name = str(request.get("signal") or "SIGINT")
            number = signal_number(name)
            if number is None:
                return {"ok": False, "error": f"{name!r} is not a signal poprun can send"}
            self.session._on_signal(number)
            return {"ok": True, "signal": signal.Signals(number).name
                    if number in _SIGNALS else str(number)}
        if op == "logs":
            await self._logs(writer, bool(request.get("follow")))
            return None
        return {"ok": False, "error": f"unknown request {op!r}"}

    async def _show(self) -> dict[str, Any]:
        from spawner.procstat import ProcSampler

        sampler = ProcSampler()
        local = [i for i in self.state.instances.values() if i.local and not i.done]
        cgroup_of = self.job.local.cgroup_of if self.job.local else lambda key: None
        for inst in local:
            sampler.sample(inst.pid, self.loop.time(), cgroup_of(inst.index))
        if local:
            await asyncio.sleep(SHOW_SAMPLE)
        now = self.loop.time()
        view = self.job.view
        rows = []
        for index, inst in sorted(self.state.instances.items()):
            usage = (sampler.sample(inst.pid, now, cgroup_of(index))
                     if inst.local and not inst.done
                     else view.instances[index].usage if view is not None
                     and index in view.instances else None)
            rows.append({
                "index": index, "host": inst.host, "pid": inst.pid, "state": inst.status,
                "uptime": inst.uptime(now), "cpu_percent": usage and usage.cpu_percent,
                "rss": usage and usage.rss, "lines": inst.lines, "idle": inst.idle(now),
                "last_line": inst.last_line.decode("utf-8", "replace")})
        return {"ok": True, "job": self.id, "state": self.status,
                "stop_reason": self.state.stop_reason, "attempt": self.attempt,
                "uptime": now - self.state.began, "stalled": self._stalled,
                "instances": rows}

    async def _logs(self, writer: asyncio.StreamWriter, follow: bool) -> None:
        """The reply line, what was kept, then (follow) each block as it comes, all from
        this loop: nothing is missed or sent twice between the two."""
        import json

        source = "ring" if self.log is not None else "files" if self.config.\
            effective_output_filename else "none"
        if self.log is not None:
            history = joblog.read_ring(self.dir)
        elif source == "files":
            history = joblog.from_output_files(self.meta()["output_dir"],
                                               range(self.config.num_instances))
        else:
            history = b""
        writer.write(json.dumps({"ok": True, "source": source}).encode() + b"\n")
        writer.write(history)
        if not follow:
            await writer.drain()
            return
        self.followers.add(writer)
        try:
            await writer.drain()
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        finally:
            self.followers.discard(writer)

    def _forward(self, record: bytes) -> None:
        for writer in list(self.followers):
            if writer.transport.get_write_buffer_size() > MAX_FOLLOWER_BACKLOG:
                self.followers.discard(writer)
                writer.close()  # too slow a reader: it may reconnect
                continue
            writer.write(record)

    # --- stalls ---------------------------------------------------------------------------

    def _arm_stall(self) -> None:
        timeout = self.config.stall_timeout
        if timeout and not self.closed:
            delay = max(0.0, self._last_output + timeout - self.loop.time())
            self._stall_timer = self.loop.call_later(delay, self._check_stall)

    def _cancel_stall(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self._stall_task is not None:
            self._stall_task.cancel()
            self._stall_task = None

    def _check_stall(self) -> None:
        self._stall_timer = None
        idle = self.loop.time() - self._last_output
        if idle < self.config.stall_timeout:
            self._arm_stall()
            return
        if self.status not in ("running", "starting") or not self.job.running():
            return
        self._stalled = True
        self._stall_task = self.loop.create_task(self._on_stall(idle))

    def _unstall(self) -> None:
        """Output again after a stall: the next silence is a new stall."""
        self._stalled = False
        if self.status == "stalled":
            self.status = "running"
            self._schedule_write()
        if self.job.view is not None and getattr(self.job.view, "stalled", False):
            self.job.view.stalled = False
            self.job.view.changes += 1
        if self._stall_task is None and self._stall_timer is None:
            self._arm_stall()

    async def _on_stall(self, idle: float) -> None:
        """Print the folded stacks once, keep them beside the record, mark the job
        stalled; with --stall-action kill, stop it with the stall as the root cause."""
        from poprun.jobctl import stacks

        timeout = self.config.stall_timeout
        found = await stacks.gather(self.job, None, STALL_STACKS_TIMEOUT)
        folded = stacks.fold(found)
        number = len(self.stalls) + 1
        path = os.path.join(self.dir, f"stall-{number}.txt")
        title = (f"poprun: job {self.id}: no instance has written a line for "
                 f"{idle:.0f} s (--stall-timeout {timeout:g}); where each one is (most "
                 f"recent call first), the odd ones out first:")
        text = stacks.render(folded, title, base=self.session.cwd)
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError:
            path = None
        session = self.session
        session.log.write(session.stderr_fd, text.encode("utf-8", "replace"))
        stall = {"time": time.time(), "idle": round(idle, 3), "timeout": timeout,
                 "stacks_file": path, "stacks": folded.to_json()}
        self.stalls.append({k: v for k, v in stall.items() if k != "stacks"})
        self._stall_task = None
        if self._stalled:  # no output meanwhile
            self.status = "stalled"
            if self.job.view is not None:
                self.job.view.stalled = True
                self.job.view.changes += 1
        else:
            self._arm_stall()
        self._schedule_write()
        if self.config.stall_action == "kill":
            self.job.stop_stalled(stall)


_SIGNALS = {int(s) for s in signal.Signals}


def _cgroup_root(token: str) -> str | None:
    """spawner.containment's cgroup tree for the lifeline `token`, under this process's own
    cgroup (it exists only where this host gives poprun cgroups)."""
    from spawner.containment import own_cgroup_dir

    home = own_cgroup_dir()
    return os.path.join(home, f"poprun-{token}") if home else None
