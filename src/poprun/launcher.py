"""`launch(config)`: plan the job, start it, watch it, stop it, clean up after it.

Exit paths and what they do (every one of them runs the `finally` in `_run`, which kills what
still runs, removes temporary cache dirs and restores signal handlers; a SIGKILL of poprun
itself is covered by the lifeline instead):

- all instances exit 0                   -> exit code 0
- an instance fails (non-zero or signal) -> SIGTERM to the others, SIGKILL after
                                            `kill_timeout`; exit code = its status (128+N)
- SIGINT / SIGTERM / SIGHUP to poprun    -> forwarded to every instance; SIGKILL after
                                            `kill_timeout`, or at once on a second signal;
                                            exit code 128+N
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spawner.binding import read_binding
from spawner.cpulist import format_cpu_list
from spawner.lifeline import Lifeline
from spawner.local import LocalSpawner, ProcessSpec, Stream, resolve_program

from . import plan as planning
from .config import INERT_FIELDS, LaunchConfig
from .errors import ConfigError, LaunchError
from .hosts import Host, is_local, job_hosts
from .log import Log
from .output import OutputOptions, OutputRouter
from .plan import CacheMode, LaunchPlan
from .render import topology_table
from .result import InstanceResult, LaunchResult
from .topology import Topology, local_topology

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DRY_RUN_CACHE_DIR = "<temporary directory, created at launch>"
LOOPBACK = "127.0.0.1"
LOST_HOST_STATUS = 255  # the status of an instance whose host was lost (ssh's own 255)


def make_plan(config: LaunchConfig, environ: Mapping[str, str], cwd: str) -> LaunchPlan:
    """The plan `--dry-run` shows: a launch's plan, contacting no host. Cache dirs not made
    yet are placeholders; MASTER_ADDR is the first host's name (a launch uses its address)."""
    hosts = JobHosts.of(config, environ)
    program, mode = preflight(config, environ, cwd, resolve=hosts.any_local)
    cache = _explicit_cache(config, mode) or DRY_RUN_CACHE_DIR
    master = LOOPBACK if hosts.first_is_local and not hosts.remote else hosts.labels[0]
    return planning.plan(config, environ, program=program, master_port=free_port(),
                         hosts=hosts.labels, master_addr=master, remote_hosts=hosts.remote,
                         cache_paths={label: cache for label in hosts.labels},
                         topologies=local_topologies(config, hosts))


def local_topologies(config: LaunchConfig, hosts: JobHosts) -> dict[str, Topology]:
    """This machine's NUMA topology under each of its labels, when placement needs it."""
    local = [label for label in hosts.labels if label not in hosts.remote]
    per_host = config.num_instances // len(hosts.labels)
    if not local or not planning.needs_topology(config, per_host):
        return {}
    topology = local_topology()
    return {label: topology for label in local}


@dataclass(frozen=True)
class JobHosts:
    """Where a job runs: host labels in instance order, and which of them need SSH."""

    hosts: tuple[Host, ...]  # empty: this host only
    remote: frozenset[str]

    @classmethod
    def of(cls, config: LaunchConfig, environ: Mapping[str, str]) -> JobHosts:
        hosts = job_hosts(config.host_list, environ)
        this = socket.gethostname()
        return cls(hosts, frozenset(str(h) for h in hosts if not is_local(h, this)))

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(str(h) for h in self.hosts) or (planning.LOCALHOST,)

    @property
    def any_local(self) -> bool:
        return len(self.remote) < len(self.labels)

    @property
    def first_is_local(self) -> bool:
        return self.labels[0] not in self.remote


def preflight(config: LaunchConfig, environ: Mapping[str, str], cwd: str,
              resolve: bool = True) -> tuple[tuple[str, ...], CacheMode]:
    """Everything checked before anything starts: the program (argv[0] resolved here when
    `resolve`; remote hosts resolve it themselves) and the executable cache mode."""
    program = config.program
    if not resolve:
        return program, planning.cache_mode(config, environ)
    resolved = resolve_program(program[0], environ.get("PATH"), cwd)
    if resolved is None:
        raise ConfigError(f"program {program[0]!r} not found or not executable "
                          f"(looked in PATH and in {cwd})")
    return (resolved,) + program[1:], planning.cache_mode(config, environ)


def free_port() -> int:
    """A TCP port nobody listens on now, for torch.distributed's MASTER_PORT."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _explicit_cache(config: LaunchConfig, mode: CacheMode) -> str | None:
    if mode is CacheMode.EXPLICIT and config.executable_cache_path:
        return os.path.abspath(config.executable_cache_path)
    return None


async def launch(config: LaunchConfig, *, stdout_fd: int = 1, stderr_fd: int = 2,
                 environ: Mapping[str, str] | None = None, cwd: str | None = None) -> LaunchResult:
    """Run the job to its end. Raises ConfigError/LaunchError when it cannot start; a job
    whose instances fail is not an error: the result says so. Cancelling it stops the job."""
    import asyncio

    async with _Session(config, stdout_fd, stderr_fd, environ, cwd) as session:
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        job = await session.start_async(
            loop, on_finished=lambda: finished.done() or finished.set_result(None))
        if not job.finished:
            await finished
        return session.result()


def launch_blocking(config: LaunchConfig, *, stdout_fd: int = 1, stderr_fd: int = 2,
                    environ: Mapping[str, str] | None = None,
                    cwd: str | None = None) -> LaunchResult:
    """`launch()` on spawner.loop.SelectLoop instead of asyncio, for runs with no remote host:
    the command line then starts ~35 ms sooner (the cost of importing asyncio)."""
    from spawner.loop import SelectLoop

    loop = SelectLoop()
    try:
        with _Session(config, stdout_fd, stderr_fd, environ, cwd) as session:
            if session.hosts.remote:
                raise LaunchError("launch_blocking() runs on this host only: use launch() "
                                  "for remote hosts")
            job = session.start(loop)
            loop.run_until(lambda: job.finished)
            return session.result()
    finally:
        loop.close()


class _Session:
    """One launch's resources, whichever loop drives it: entering checks the configuration
    and creates the lifeline; starting creates the cache dirs (and, for remote hosts, the
    connections and agents), plans and spawns; leaving closes the agents (which kill what
    still runs there), kills and reaps what still runs here, restores signal handlers,
    removes the temporary cache and prints the failure report."""

    def __init__(self, config: LaunchConfig, stdout_fd: int, stderr_fd: int,
                 environ: Mapping[str, str] | None, cwd: str | None) -> None:
        self.config, self.stdout_fd, self.stderr_fd = config, stdout_fd, stderr_fd
        self.environ = dict(os.environ if environ is None else environ)
        self.cwd = cwd or os.getcwd()
        self.log = Log(config.verbose, stderr_fd)
        self.job: _Job | None = None
        self.fleet = None
        self.partition = None  # the V-IPU partition (poprun.vipu.Partition), unless offline
        self._result: LaunchResult | None = None

    def __enter__(self) -> _Session:
        config, log = self.config, self.log
        self.hosts = JobHosts.of(config, self.environ)
        self.program, self.mode = preflight(config, self.environ, self.cwd,
                                            resolve=self.hosts.any_local)
        for ignored in config.mpi.ignored:
            log.info(f"ignoring mpirun argument {ignored!r}: poprun does not use MPI")
        for name in INERT_FIELDS:
            if getattr(config, name) not in (None, False):
                log.info(f"--{name.replace('_', '-')}: accepted for compatibility, nothing to "
                         "do here (no MPI; V-IPU polling is bounded by --vipu-server-timeout)"
                         if name == "vipu_partition_attempts" else
                         f"--{name.replace('_', '-')}: accepted for compatibility, nothing to "
                         "do without MPI or IPUs")
        self.lifeline = Lifeline()
        self.cache = _CacheDir(config, self.mode, self.lifeline, log)
        self.job = _Job(self.config, self.environ, self.cwd, self.log, self.stdout_fd,
                        self.stderr_fd)
        return self

    def start(self, loop, on_finished=None) -> _Job:
        """This host only: create the cache dir, plan, and start every instance."""
        self._acquire_partition()
        cache_dir = self.cache.create()
        self._plan({h: cache_dir for h in self.hosts.labels} if cache_dir else {}, LOOPBACK)
        self.job.start(loop, self.lifeline, on_finished)
        return self.job

    async def start_async(self, loop, on_finished=None) -> _Job:
        """As `start`, with remote hosts: their connections and agents first, so that any
        host's problem stops the launch before a single instance has started."""
        if not self.hosts.remote:
            return self.start(loop, on_finished)
        from .fleet import Fleet  # asyncssh: only runs with remote hosts import it

        self._acquire_partition()  # blocks the loop briefly: nothing else runs yet
        self.fleet = Fleet([h for h in self.hosts.hosts if str(h) in self.hosts.remote],
                           self.config, self.log)
        await self.fleet.open(self.job, self.job.on_host_lost, cwd=self.cwd,
                              program=self.program[0], path=self.environ.get("PATH"))
        self.job.phases.update(self.fleet.phases(since=self.job.launch_time))
        caches = {}
        local_cache = self.cache.create() if self.hosts.any_local else None
        if local_cache or self.mode is CacheMode.EXPLICIT:  # an explicit path: on every host
            caches = {h: local_cache or _explicit_cache(self.config, self.mode)
                      for h in self.hosts.labels}
        if self.mode is CacheMode.TEMPORARY:
            caches.update(await self.fleet.temp_dirs())
        first = self.hosts.labels[0]
        master = (self.fleet.own_address() if self.hosts.first_is_local
                  else self.fleet.address_of(first))
        per_host = self.config.num_instances // len(self.hosts.labels)
        remote_topologies = (self.fleet.topologies()
                             if planning.needs_topology(self.config, per_host) else {})
        self._plan(caches, master, remote_topologies)
        self.job.start(loop, self.lifeline, on_finished, remote=self.fleet.spawners)
        await self.job.spawn_remote()
        return self.job

    def _acquire_partition(self) -> None:
        """The job's V-IPU partition (found, checked, created or reset), unless offline.
        Before any signal handler is ours: a Ctrl-C here interrupts `vipu`, and vipu.acquire
        removes what it created before the KeyboardInterrupt goes on."""
        if self.config.offline_mode:
            return
        from . import vipu

        settings = vipu.VipuSettings.from_config(self.config)
        ilds = self.config.num_ilds if self.config.num_ilds > 1 else None
        required = vipu.Requirements.of(self.config.num_replicas, self.config.ipus_per_replica,
                                        self.config.num_instances, ilds, settings)
        self.partition = vipu.acquire(settings, required, self.environ, self.log)

    def _plan(self, cache_paths: Mapping[str, str], master_addr: str,
              remote_topologies: Mapping[str, Topology] | None = None) -> None:
        topologies = {**local_topologies(self.config, self.hosts), **(remote_topologies or {})}
        launch_plan = planning.plan(
            self.config, self.environ, program=self.program, master_port=free_port(),
            hosts=self.hosts.labels, master_addr=master_addr, remote_hosts=self.hosts.remote,
            cache_paths=cache_paths, topologies=topologies,
            partition_env=self.partition.environment if self.partition else None)
        if self.config.num_instances == 1 and self.config.num_replicas == 1:
            self.log.warning("Using --num-instances=1 and --num-replicas=1 together is not "
                             "supported and might give additional overhead and/or raise other "
                             "issues.")
        for warning in launch_plan.warnings:
            self.log.warning(warning)
        self._log_placement(launch_plan)
        if self.config.print_topology:
            os.write(self.stdout_fd, topology_table(launch_plan).encode())
        self.job.plan = launch_plan

    def _log_placement(self, launch_plan: LaunchPlan) -> None:
        """-v: each host's strategy; -vv: each instance's binding."""
        per_host = self.config.num_instances // len(launch_plan.hosts)
        strategy = planning.host_strategy(self.config, per_host)
        mpi = self.config.mpi
        if mpi.bind_to and planning.strategy_from_mpi(mpi.bind_to, mpi.map_by) is None:
            self.log.info(f"ignoring mpirun --bind-to {mpi.bind_to}"
                          f"{' --map-by ' + mpi.map_by if mpi.map_by else ''}: no placement "
                          "strategy matches it")
        self.log.info(f"process placement: {strategy.value} ({per_host} instance(s) per host)")
        for inst in launch_plan.instances:
            self.log.debug(f"instance {inst.index} on {inst.host}: cpus "
                           f"{'any' if inst.cpus is None else format_cpu_list(inst.cpus)}, "
                           f"memory nodes "
                           f"{'any' if inst.mems is None else format_cpu_list(inst.mems)}")

    def result(self) -> LaunchResult:
        if self._result is None:
            self._result = self.job.result()
        return self._result

    async def __aenter__(self) -> _Session:
        return self.__enter__()

    async def __aexit__(self, *exc_info) -> None:
        try:
            if self.fleet is not None:
                await self.fleet.close()
        finally:
            self.__exit__(*exc_info)

    def __exit__(self, *exc_info) -> None:
        try:
            self.job.close()
        finally:
            self.cache.remove()
            self.lifeline.close()
            if self.partition is not None:  # after the instances are gone from it
                from .vipu import release

                release(self.partition, self.log, self.environ)
        if self._result is not None:
            report = self._result.failure_report()
            if not report and self.config.verbose:
                report = self._result.summary()
            if report:
                os.write(self.stderr_fd, report.encode())


class _CacheDir:
    """The executable cache directory of this host, for the job's lifetime."""

    def __init__(self, config: LaunchConfig, mode: CacheMode, lifeline: Lifeline,
                 log: Log) -> None:
        self._config, self._mode, self._lifeline, self._log = config, mode, lifeline, log
        self.path: str | None = None
        self._temporary = False

    def create(self) -> str | None:
        if self._mode is CacheMode.EXPLICIT:
            self.path = _explicit_cache(self._config, self._mode)
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as exc:
                raise LaunchError(f"cannot create executable cache {self.path}: "
                                  f"{exc.strerror}") from None
        elif self._mode is CacheMode.TEMPORARY:
            self.path = tempfile.mkdtemp(prefix="poprun-cache-")  # mode 0700
            self._temporary = True
            self._lifeline.add_dir(self.path)
        if self.path:
            self._log.info(f"executable cache ({self._mode.value}): {self.path}")
        return self.path

    def remove(self) -> None:
        if self._temporary and self.path:
            shutil.rmtree(self.path, ignore_errors=True)
            self._lifeline.discard_dir(self.path)
            self._log.info(f"removed temporary executable cache {self.path}")


@dataclass
class _Started:
    pid: int
    start: float
    end: float = 0.0
    returncode: int | None = None
    signalled: bool = False
    lost: str | None = None  # why its host was lost, if it was


class _Job:
    """One run of the plan: the spawners' sink, and the failure and signal policy."""

    def __init__(self, config: LaunchConfig, environ: dict[str, str], cwd: str, log: Log,
                 stdout_fd: int, stderr_fd: int) -> None:
        self.config, self.environ, self.cwd, self.log = config, environ, cwd, log
        self.plan: LaunchPlan | None = None  # set by the session once the hosts are known
        directory = config.effective_output_filename
        nocopy = bool(directory) and directory.lower().endswith(":nocopy")
        self.router = OutputRouter(OutputOptions(
            tag=config.effective_tag_output, timestamp=config.effective_timestamp_output,
            only_instance=config.only_output_from_instance,
            directory=os.path.abspath(directory[:-7] if nocopy else directory) if directory
            else None, copy_to_console=not nocopy), stdout_fd, stderr_fd, self._broken_pipe)
        self.started: dict[int, _Started] = {}
        self.first_output: dict[int, float] = {}  # time.time() of each instance's first block
        self.launch_time = time.time()
        self.phases: dict[str, dict[str, float]] = {}  # host -> phase -> seconds (result)
        self.done: set[int] = set()  # exit reported, or lost with its host
        self.root_cause: int | None = None
        self.stop_signal: int | None = None
        self.on_finished = None
        self._all_started = False
        self._kill_timer = None
        self._restore_signals = lambda: None
        self.local: LocalSpawner | None = None
        self.remote: Mapping[str, object] = {}
        self.spawner_of: dict[int, object] = {}  # instance -> the spawner that runs it

    def start(self, loop, lifeline: Lifeline, on_finished=None, remote=None) -> None:
        """Start this host's instances on `loop` (asyncio's or a SelectLoop); with `remote`
        spawners (by host), `spawn_remote()` starts theirs. `on_finished` is called once
        every instance has exited (or was lost) and its output has been delivered."""
        self.loop, self.on_finished, self.remote = loop, on_finished, remote or {}
        self.local = LocalSpawner(self, loop, lifeline)
        self._restore_signals = _install_signal_handlers(loop, self.on_signal)
        self._spawn_local()
        self._all_started = not self.remote
        self._maybe_finish()

    @property
    def finished(self) -> bool:
        return self._all_started and len(self.done) == len(self.started)

    def close(self) -> None:
        """Kill and reap what still runs here, stop timers, flush output, restore signals."""
        if self._kill_timer:
            self._kill_timer.cancel()
        if self.local:
            self.local.close()
        self.router.close()
        self._restore_signals()

    def _spawn_local(self) -> None:
        merge = self.config.effective_merge_stderr
        for inst in self.plan.instances:
            if inst.host in self.remote:
                continue
            spec = ProcessSpec(
                key=inst.index, argv=inst.argv, cwd=self.cwd, merge_stderr=merge,
                env=planning.instance_environ(self.environ, inst, self.plan),
                inherit_stdin=inst.index == 0,  # as mpirun: stdin goes to the first instance
                cpus=inst.cpus, mems=inst.mems)
            try:
                pid = self.local.spawn(spec)
            except OSError as exc:
                raise LaunchError(f"cannot start instance {inst.index} ({inst.argv[0]}): "
                                  f"{exc.strerror or exc}") from None
            self._record(inst.index, pid, self.local)
        if self.local.memory_binding_skipped:
            self.log.warning("memory binding skipped: libnuma (libnuma1) or the kernel's NUMA "
                             "support is missing on this host; CPU binding is in force")
        if self.config.effective_report_bindings:
            self._report_bindings()

    async def spawn_remote(self) -> None:
        """Start every remote host's instances, all hosts at once. Raises LaunchError when
        any could not start (the session then stops the others)."""
        import asyncio

        from spawner.protocol import SpawnRequest
        from spawner.remote import RemoteSpawnError

        merge = self.config.effective_merge_stderr
        hosts = list(self.remote)
        outcomes = await asyncio.gather(*(self.remote[host].spawn_all(
            SpawnRequest(key=inst.index, argv=inst.argv, env_set=inst.env,
                         env_unset=self.plan.unset_env, cwd=self.cwd, merge_stderr=merge,
                         cpus=inst.cpus, mems=inst.mems)
            for inst in self.plan.on_host(host)) for host in hosts), return_exceptions=True)
        problems = []
        for host, outcome in zip(hosts, outcomes):
            pids = outcome.started if isinstance(outcome, RemoteSpawnError) else outcome
            if isinstance(pids, dict):
                for key, pid in pids.items():
                    self._record(key, pid, self.remote[host])
            if isinstance(outcome, BaseException):
                problems.append(str(outcome))
        if problems:
            raise LaunchError("\n".join(problems))
        for host in hosts:
            self.log.info(f"{host}: {self.remote[host].timings.describe()}")
            if self.remote[host].memory_binding_skipped:
                self.log.warning(f"{host}: memory binding skipped: libnuma (libnuma1) or the "
                                 "kernel's NUMA support is missing there; CPU binding is in force")
        self._all_started = True
        if self.root_cause is not None or self.stop_signal is not None:
            self._signal_all(signal.SIGTERM)  # stopped while these were starting
        self._maybe_finish()

    def _record(self, key: int, pid: int, spawner) -> None:
        if key in self.started:  # its exit beat the end of spawn_all (see on_exit)
            return
        self.started[key] = _Started(pid=pid, start=time.time())
        self.spawner_of[key] = spawner
        inst = self.plan.instances[key]
        self.log.debug(f"started instance {key} on {inst.host}, pid {pid}: "
                       f"{' '.join(inst.argv)}")

    def _report_bindings(self) -> None:
        """mpirun's --report-bindings, from what the kernel says of each live instance."""
        for inst in self.plan.instances:
            if inst.index not in self.started or self.spawner_of[inst.index] is not self.local:
                continue
            pid = self.started[inst.index].pid
            try:
                actual = read_binding(pid)
            except OSError:  # already gone: nothing to report
                continue
            self.log.always(f"instance {inst.index} (pid {pid}) on {inst.host}: cpus "
                            f"{format_cpu_list(actual.cpus)}, memory {actual.mempolicy} "
                            f"{format_cpu_list(actual.mems)}")
            for what, planned, got in (("cpus", inst.cpus, actual.cpus),
                                       ("memory nodes", inst.mems, actual.mems)):
                if planned is not None and tuple(planned) != tuple(got):
                    self.log.warning(f"instance {inst.index} runs on {what} "
                                     f"{format_cpu_list(got)}, planned "
                                     f"{format_cpu_list(planned)}")

    # --- spawner sink -----------------------------------------------------------------

    def on_output(self, key: int, stream: Stream, data: bytes) -> None:
        if key not in self.first_output:
            self.first_output[key] = time.time()
        self.router.on_output(key, stream, data)

    def on_exit(self, key: int, returncode: int) -> None:
        if key not in self.started:  # a remote instance can exit before spawn_all returns
            spawner = self.remote[self.plan.instances[key].host]
            self._record(key, spawner.pid(key), spawner)
        record = self.started[key]
        record.returncode, record.end = returncode, time.time()
        self.done.add(key)
        self.log.info(f"instance {key} (pid {record.pid}) exited with {returncode}")
        if returncode != 0 and self.root_cause is None and self.stop_signal is None:
            self.root_cause = key
            self._stop(signal.SIGTERM)
        self._maybe_finish()

    def on_host_lost(self, host: str, reason: str) -> None:
        """A remote host's agent or connection ended early: its instances are gone with it
        (the agent kills them when it can), so the job stops everywhere."""
        spawner = self.remote[host]
        lost = sorted(k for k in spawner.unaccounted() if k not in self.done)
        self.log.error(f"{host}: lost the connection to the host ({reason}); "
                       f"{len(lost)} instance(s) there are gone")
        for key in lost:
            record = self.started[key]
            record.lost, record.end = reason, time.time()
            self.done.add(key)
        if lost and self.root_cause is None and self.stop_signal is None:
            self.root_cause = lost[0]
            self._stop(signal.SIGTERM)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.on_finished and self.finished:
            self.on_finished()

    # --- stopping ---------------------------------------------------------------------

    def running(self) -> list[int]:
        spawners = {id(s): s for s in self.spawner_of.values()}
        return [k for s in spawners.values() for k in s.running()]

    def on_signal(self, sig: int) -> None:
        if self.stop_signal is not None or self.root_cause is not None:
            self.log.warning(f"{signal.Signals(sig).name} again: killing every instance now")
            self._signal_all(signal.SIGKILL)
            return
        self.stop_signal = sig
        self.log.warning(f"{signal.Signals(sig).name} received: stopping "
                         f"{len(self.running())} running instance(s)")
        self._stop(sig)

    def _broken_pipe(self) -> None:
        if self.stop_signal is None:
            self.stop_signal = signal.SIGPIPE
            self._stop(signal.SIGTERM)

    def _stop(self, sig: int) -> None:
        """Signal every instance still running; SIGKILL them all after the one deadline."""
        self._signal_all(sig)
        if self._kill_timer is None:
            self._kill_timer = self.loop.call_later(self.config.kill_timeout, self._signal_all,
                                                    signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for key in self.running():
            self.started[key].signalled = True
            self.spawner_of[key].signal(key, sig)

    def result(self) -> LaunchResult:
        instances = tuple(
            InstanceResult(
                index=i, host=self.plan.instances[i].host, pid=r.pid,
                returncode=(r.returncode if r.returncode is not None
                            else LOST_HOST_STATUS if r.lost else -signal.SIGKILL),
                start_time=r.start, end_time=r.end or time.time(),
                lines=self.router.instances[i].lines,
                stderr_tail=tuple(self.router.instances[i].stderr_tail),
                stopped_by_poprun=r.signalled, lost=r.lost,
                first_output_time=self.first_output.get(i))
            for i, r in sorted(self.started.items()))
        by_index = {inst.index: inst for inst in instances}
        if self.stop_signal is not None:
            code = 128 + self.stop_signal
        elif self.root_cause is not None:
            code = by_index[self.root_cause].exit_status
        else:
            code = 0
        return LaunchResult(instances=instances, exit_code=code, root_cause=self.root_cause,
                            stop_signal=self.stop_signal, phases=self._phases(instances),
                            start_time=self.launch_time)

    def _phases(self, instances: tuple[InstanceResult, ...]) -> dict[str, dict[str, float]]:
        """Per host: what the fleet measured (remote), plus first start and first output."""
        phases = {host: dict(p) for host, p in self.phases.items()}
        for inst in instances:
            host = phases.setdefault(inst.host, {})
            marks = (("first_started", inst.start_time), ("first_output", inst.first_output_time))
            for name, at in marks:
                if at is not None:
                    since = round(at - self.launch_time, 6)
                    host[name] = min(host.get(name, since), since)
        return phases


def _install_signal_handlers(loop, handler):
    """Route SIGINT/SIGTERM/SIGHUP to `handler`; returns a function restoring the old ones.
    Only the main thread can own signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)

    def restore() -> None:
        for sig, old in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, old if old is not None else signal.SIG_DFL)

    return restore
