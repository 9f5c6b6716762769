"""`launch(config)`: check, acquire resources, plan, start the job, clean up after it.

The resources of a launch (lifeline, cache dirs, V-IPU partition, remote connections and
agents) live in a `_Session`, whose exit runs on every path: it closes the agents (which kill
what still runs on their hosts), kills and reaps what still runs here, restores the signal
handlers, removes temporary caches and releases the partition. A SIGKILL of poprun itself is
covered by the lifelines (here and in each agent). What happens while the job runs (failures,
signals, lost hosts) is the job's policy: see job.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from spawner.cpulist import format_cpu_list
from spawner.lifeline import Lifeline
from spawner.local import resolve_program

from . import plan as planning
from .config import INERT_FIELDS, VIPU_FIELDS, LaunchConfig
from .errors import ConfigError, LaunchError
from .hosts import Host, is_local, job_hosts
from .log import Log
from .output import write_all
from .plan import CacheMode, LaunchPlan
from .job import Job
from .render import topology_table
from .result import LaunchResult
from .topology import Topology, local_topology

DRY_RUN_CACHE_DIR = "<temporary directory, created at launch>"
DASHBOARD_REFRESH = 0.25  # seconds between live panel updates (it redraws only on change)
LOOPBACK = "127.0.0.1"


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
        self.job: Job | None = None
        self.fleet = None
        self.dashboard = None
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
                         "do here (no MPI, no device to attach to)")
        for name in VIPU_FIELDS if config.offline_mode else ():
            if getattr(config, name) not in (None, False):
                log.info(f"--{name.replace('_', '-')}: ignored with --offline-mode (no V-IPU "
                         "server is contacted)")
        self.lifeline = Lifeline()
        self.cache = _CacheDir(config, self.mode, self.lifeline, log)
        self.job = Job(self.config, self.environ, self.cwd, self.log, self.stdout_fd,
                        self.stderr_fd)
        return self

    def start(self, loop, on_finished=None) -> Job:
        """This host only: create the cache dir, plan, and start every instance."""
        self._open_dashboard(loop)
        self._acquire_partition()
        cache_dir = self.cache.create()
        self._plan({h: cache_dir for h in self.hosts.labels} if cache_dir else {}, LOOPBACK)
        self.job.start(loop, self.lifeline, on_finished)
        return self.job

    async def start_async(self, loop, on_finished=None) -> Job:
        """As `start`, with remote hosts: their connections and agents first, so that any
        host's problem stops the launch before a single instance has started."""
        if not self.hosts.remote:
            return self.start(loop, on_finished)
        from .fleet import Fleet  # asyncssh: only runs with remote hosts import it

        self._open_dashboard(loop)
        self._acquire_partition()  # blocks the loop briefly: nothing else runs yet
        self.fleet = Fleet([h for h in self.hosts.hosts if str(h) in self.hosts.remote],
                           self.config, self.log)
        await self.fleet.open(self.job, self.job.on_host_lost, cwd=self.cwd,
                              program=self.program[0], path=self.environ.get("PATH"),
                              view=self.job.view)
        self.job.phases.update(self.fleet.phases(since=self.job.launch_time))
        caches = {}
        local_cache = self.cache.create() if self.hosts.any_local else None
        if local_cache or self.mode is CacheMode.EXPLICIT:  # an explicit path: on every host
            caches = {h: local_cache or _explicit_cache(self.config, self.mode)
                      for h in self.hosts.labels}
        if self.mode is CacheMode.TEMPORARY:
            caches.update(await self.fleet.temp_dirs())
        elif self.mode is CacheMode.EXPLICIT:
            await self.fleet.make_dirs(_explicit_cache(self.config, self.mode))
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

    def _open_dashboard(self, loop) -> None:
        """The live panel, when stderr is a terminal (dashboard.wants_dashboard says): every
        console write (instance output, poprun's messages) then goes through it."""
        if not os.isatty(self.stderr_fd):  # the usual case in scripts: skip the import
            return
        from .dashboard import wants_dashboard

        if not wants_dashboard(self.stderr_fd, self.environ, self.config.no_dashboard):
            return
        from .dashboard import Dashboard, DashboardState

        state = DashboardState(self.config.num_instances, self.hosts.labels, loop.time(),
                               remote_hosts=len(self.hosts.remote),
                               offline=self.config.offline_mode)
        self.dashboard = Dashboard(state, self.stderr_fd)
        self.job.view = state
        self.job.router.write = self.log.write = self.dashboard.emit
        self._tick(loop)

    def _tick(self, loop) -> None:
        self.dashboard.tick(loop.time())
        self._ticker = loop.call_later(DASHBOARD_REFRESH, self._tick, loop)

    def _close_dashboard(self) -> None:
        """Erase the panel (the report then prints below the output, as without it)."""
        if self.dashboard is None:
            return
        self._ticker.cancel()
        self.dashboard.close()
        self.job.router.write = write_all
        self.log.write = os.write

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
        if self.job.view is not None:
            self.job.view.set_partition(self.partition.name)

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
        if self.job.view is not None:
            self.job.view.plan((i.index, i.host) for i in launch_plan.instances)
            caches = set(cache_paths.values())
            self.job.view.set_cache_dir(caches.pop() if len(caches) == 1 else
                                        f"{len(caches)} dirs, one per host" if caches else None)

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
            self._close_dashboard()
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
