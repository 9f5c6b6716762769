"""poprunctl's view of a launch: the job's record, output log, stall watch and
control socket, built for the session and given, as callbacks, the little of the launch
that they act on. Each is an observer of the job's events (poprun/events.py) or reads one;
none of them sees the session.

A launch never fails because of them: a state directory that cannot be written means no
record (said at -v); a log or a socket that cannot be made is left out (said at -v).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from poprun.jobctl import joblog, records
from poprun.jobctl.server import ControlService
from poprun.jobctl.stall import StallWatch
from poprun.jobctl.watch import JobRecord
from poprun.run.output import output_files


class JobControl:
    """The record, the log, the stall watch and the control service of one launch."""

    def __init__(self, record: JobRecord, log: joblog.JobLog, stall: StallWatch,
                 service: ControlService) -> None:
        self.record, self.log, self.stall, self.service = record, log, stall, service
        self._pruning = None  # the thread removing old jobs' records
        self.closed = False

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def observers(self) -> tuple:
        return self.record, self.log, self.stall

    @classmethod
    async def open(cls, session, *, facts: Callable[[], Mapping[str, Any]],
                   stop: Callable[[int], None], running: Callable[[], list[int]],
                   gather: Callable[..., Awaitable[Mapping[int, Any]]],
                   cgroup_of: Callable[[int], str | None],
                   on_stall: Callable[[Mapping[str, Any], bool], None],
                   on_unstall: Callable[[], None],
                   spawned: Callable[[], Any] = tuple) -> JobControl | None:
        """Register the launch; None (said at -v) where no record can be written. `session`
        gives the launch's constants (config, environ, cwd, loop, log, lifeline, hosts)."""
        log, config, environ = session.log, session.config, session.environ
        try:
            job_id, directory = records.create(environ)
        except OSError as exc:
            log.info(f"no job record (poprunctl will not see this job): {exc.strerror or exc}")
            return None
        ring = _ring(directory, environ, config, log)
        output_dir, _ = output_files(config.effective_output_filename, session.cwd)
        job_log = joblog.JobLog(ring, directory, output_dir, config.num_instances)
        record = JobRecord(job_id, directory, session.loop, config=config, cwd=session.cwd,
                           lifeline=session.lifeline,
                           transport=session.hosts.transport if session.hosts.remote else None,
                           facts=facts, log_path=ring.path if ring is not None else None)
        stall = StallWatch(session.loop, config.stall_timeout or 0.0, job_id=job_id,
                           directory=directory, cwd=session.cwd, running=running,
                           gather=gather, emit=lambda text: log.write(session.stderr_fd, text),
                           on_stall=on_stall, on_unstall=on_unstall)
        service = ControlService(record, job_log, stalled=lambda: stall.stalled, stop=stop,
                                 gather=gather, cgroup_of=cgroup_of, spawned=spawned)
        path = records.socket_path(directory)
        if path is None:
            log.info(f"no control socket: {directory} is too long a path for one")
        else:
            try:
                await service.start(path)
            except OSError as exc:
                log.info(f"no control socket: {exc.strerror or exc}")
        record.write()
        log.info(f"job {job_id} (poprunctl show {job_id}; record in {directory})")
        return cls(record, job_log, stall, service)

    def start_pruning(self, environ: Mapping[str, str]) -> None:
        """Old records go while the job runs, on a thread: removing a job's output ring
        frees 4 MiB of disk, ~1-2 ms of a launch's end otherwise. Called once the launch
        holds the stop signals: before, a signal raises in the main thread, which must not
        happen inside threading's own locks."""
        import threading

        if self._pruning is None and not self.closed:
            self._pruning = threading.Thread(target=_prune, args=(dict(environ),),
                                             name="poprun-prune", daemon=True)
            self._pruning.start()

    async def close(self, result, error: BaseException | None = None) -> None:
        """The launch is over (every path): stop serving and watching, end the record (old
        records were pruned meanwhile)."""
        if self.closed:
            return
        self.closed = True
        self.stall.close()
        await self.service.close()
        self.log.close()
        self.record.close(result, error)
        if self._pruning is not None and self._pruning.ident is not None:  # it started
            self._pruning.join()


def _ring(directory: str, environ: Mapping[str, str], config, log) -> joblog.RingLog | None:
    """The output ring, unless --output-filename keeps the output (or no room for it)."""
    cap = joblog.cap_from(environ)
    if not cap or config.effective_output_filename:
        return None
    try:
        return joblog.RingLog(directory, cap)
    except OSError as exc:
        log.info(f"no output log for poprunctl logs: {exc.strerror}")
        return None


def _prune(environ: Mapping[str, str]) -> None:
    try:
        records.prune(environ)
    except OSError:
        pass
