"""`launch(config)`: check, acquire resources, plan, start the job, clean up after it.

The resources of a launch (lifeline, cache dirs, V-IPU partition, remote connections and
agents) live in a `_Session`, whose exit runs on every path: it closes the agents (which kill
what still runs on their hosts), kills and reaps what still runs here, restores the signal
handlers, removes temporary caches and releases the partition. A SIGKILL of poprun itself is
covered by the lifelines (here and in each agent). What happens while the job runs (failures,
signals, lost hosts) is the job's policy: see job.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from popdist.env import EXECUTABLE_CACHE_PATH
from spawner import containment, fdlimit, procid
from spawner.cpulist import format_cpu_list
from spawner.lifeline import Lifeline
from spawner.local import resolve_program

from poprun.crash import report_internal_error, state_dir_problem
from poprun.errors import ConfigError, LaunchError, PoprunError
from poprun.events import Observers
from poprun.fdio import write_all
from poprun.log import Log
from poprun.plan import planner as planning
from poprun.plan.config import (INERT_FIELDS, VIPU_FIELDS, LaunchConfig, missing_program,
                                wants_fold)
from poprun.plan.jobhosts import JobHosts
from poprun.plan.network import HostNetwork, address_here
from poprun.plan.network import resolve as resolve_network
from poprun.plan.planner import CacheMode, LaunchPlan
from poprun.plan.topology import Topology, local_topology
from poprun.result import DO_NOT_REQUEUE_STATUS, OUTPUT_ERROR_STATUS, LaunchResult
from poprun.run.job import Job
from poprun.run.output import output_files
from poprun.run.signals import install_signal_handlers
from poprun.text import at_launch
from poprun.view.render import topology_table

if TYPE_CHECKING:  # an offline launch never needs the partition's module
    from poprun.plan.partition import PartitionStep
    from spawner.containers import Container

DRY_RUN_CACHE_DIR = "<temporary directory, created at launch>"
DASHBOARD_REFRESH = 0.25  # seconds between live panel updates (it redraws only on change)
LOOPBACK = "127.0.0.1"


def make_plan(config: LaunchConfig, environ: Mapping[str, str], cwd: str) -> LaunchPlan:
    """The plan `--dry-run` shows: a launch's plan, contacting no host and no V-IPU server.
    What only they can tell is a stand-in marked as known at launch (text.at_launch): cache
    dirs not made yet, the partition's server, name and shape (plan/partition.py), a remote
    host's address and interface, the launcher's address as other hosts reach it."""
    hosts, left_out = without_quarantined(JobHosts.of(config, environ), environ)
    program, mode = preflight(config, environ, cwd, resolve=hosts.any_local)
    cache = planning.explicit_cache(config, mode) or DRY_RUN_CACHE_DIR
    network, warnings = dry_run_network(config, hosts)
    first = hosts.labels[0]
    if network:  # as _master_address and _open_rendezvous
        master = network[first].address
    elif hosts.remote:
        master = at_launch(f"{first}'s address as the other hosts reach it")
    else:
        master = LOOPBACK
    if hosts.remote:
        here = at_launch("this machine's address as the hosts reach it")
    else:
        here = network[first].address if network else LOOPBACK
    launch_plan = planning.plan(
        config, environ, program=program, master_port=free_port(), hosts=hosts.labels,
        master_addr=master, remote_hosts=hosts.remote,
        cache_paths={label: cache for label in hosts.labels},
        topologies=local_topologies(config, hosts), counts=hosts.counts,
        rendezvous=None if config.mpi_worlds == "none" else (here, free_port()),
        interfaces={label: n.interface for label, n in network.items()} if network else None,
        partition_step=dry_run_partition(config, environ))
    return replace(launch_plan, warnings=launch_plan.warnings + tuple(left_out + warnings),
                   spares=tuple(str(h) for h in hosts.spares))


def without_quarantined(hosts: JobHosts, environ: Mapping[str, str]
                        ) -> tuple[JobHosts, list[str]]:
    """The job's hosts without those this user's earlier jobs quarantined
    (jobctl/quarantine.py; plan/jobhosts.leave_out), and the warnings to say; ConfigError
    when one cannot be left out."""
    if not hosts.remote:  # only remote hosts are ever quarantined: no file to read
        return hosts, []
    import time

    from poprun.jobctl import quarantine
    from poprun.plan.jobhosts import leave_out

    unsafe = state_dir_problem(environ)  # (a launch refuses it first; a dry run says it)
    if unsafe:
        return hosts, [f"quarantined hosts not read: {unsafe}"]
    entries, problem = quarantine.read(environ)
    now = time.time()
    found = {host: f"{entry.reason}; until {_clock(entry.until)}"
             for host, entry in quarantine.active(entries, now).items()}
    hosts, warnings = leave_out(hosts, found)
    return hosts, [problem] * bool(problem) + warnings


def _clock(when: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M", time.localtime(when))


def dry_run_partition(config: LaunchConfig,
                      environ: Mapping[str, str]) -> PartitionStep | None:
    """The partition step as a dry run sees it (plan/partition.py); None offline."""
    if config.offline_mode:
        return None
    from poprun.plan.partition import Requirements, VipuSettings, partition_step

    settings = VipuSettings.from_config(config)
    return partition_step(settings, Requirements.of_config(config, settings), environ)


def dry_run_network(config: LaunchConfig,
                    hosts: JobHosts) -> tuple[dict[str, HostNetwork], list[str]]:
    """Each host on the chosen network as a launch finds it (_choose_network), as far as
    this machine can tell: its own labels resolved on its interfaces, a remote host's
    address and interface known at launch (its agent lists them); empty without a choice.
    Where this machine has no interface on it (a command meant for another machine), the
    launch's error is a warning of the dry run's, and the values are known at launch."""
    choice = config.network
    if not choice.chosen:
        return {}, []
    warnings = []
    try:
        found = resolve_network(choice, local_interfaces(hosts))
    except ConfigError as exc:
        warnings.append(f"{exc}: a launch on this machine stops there")
        found = {}
    for label in hosts.labels:
        found.setdefault(label, HostNetwork(
            at_launch(f"{label}'s address matching {choice.control.source}"),
            at_launch(f"{label}'s interface matching {choice.data.source}")))
    return {label: found[label] for label in hosts.labels}, warnings


def local_interfaces(hosts: JobHosts) -> dict[str, dict[str, list[str]]]:
    """This machine's interfaces (spawner/netifs.py) under each of its labels."""
    from spawner.netifs import interfaces

    here = interfaces()
    return {label: here for label in hosts.labels if label not in hosts.remote}


def local_topologies(config: LaunchConfig, hosts: JobHosts) -> dict[str, Topology]:
    """This machine's NUMA topology under each of its labels, when placement needs it."""
    local = [label for label in hosts.labels if label not in hosts.remote
             and planning.needs_topology(config, hosts.count(label))]
    if not local:
        return {}
    topology = local_topology()
    return {label: topology for label in local}


def preflight(config: LaunchConfig, environ: Mapping[str, str], cwd: str,
              resolve: bool = True) -> tuple[tuple[str, ...], CacheMode]:
    """Everything checked before anything starts: the program (argv[0] resolved here when
    `resolve`; remote hosts resolve it themselves) and the executable cache mode."""
    program = config.program
    if config.container_spec is not None:  # the program is the image's, found in there
        check_runtime(config.container_spec, environ, resolve)
        return program, planning.cache_mode(config, environ)
    if not resolve:
        return program, planning.cache_mode(config, environ)
    resolved = resolve_program(program[0], environ.get("PATH"), cwd)
    if resolved is None:
        raise missing_program(program[0], cwd)
    return (resolved,) + program[1:], planning.cache_mode(config, environ)


def check_runtime(container: Container, environ: Mapping[str, str], here: bool) -> None:
    """A container runtime missing on this host (where instances run here) is refused
    before anything starts; the remote hosts' agents look for it as for a program
    (`host_program`)."""
    if here and shutil.which(container.program, path=environ.get("PATH")) is None:
        raise ConfigError(f"--container={container.runtime}: {container.program} not found "
                          f"on PATH on this host ({socket.gethostname()})")


def host_program(config: LaunchConfig, program: tuple[str, ...]) -> str:
    """What the remote hosts' agents must find (HELLO's `program`): the container runtime
    when there is one, else the program."""
    spec = config.container_spec
    return spec.program if spec is not None else program[0]


def free_port() -> int:
    """A TCP port nobody listens on now, for torch.distributed's MASTER_PORT."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quiet_asyncio_reaping_race() -> None:
    """CPython's asyncio reaps a subprocess in a watcher thread while its transport's close()
    may reap it too (Popen.poll, then again in Popen.kill: python/cpython#86276): the one that
    comes second makes asyncio log "Unknown child process pid N, will report returncode
    255". An SSH ProxyCommand ending as its connection closes loses that race about one run
    in nine here; the exit status lost is one nobody reads, so the line is only noise on
    the user's stderr. (For the poprun command only: a library caller's logging is theirs.)"""
    import logging

    logging.getLogger("asyncio").addFilter(
        lambda record: not str(record.msg).startswith("Unknown child process pid"))


async def launch(config: LaunchConfig, *, stdout_fd: int = 1, stderr_fd: int = 2,
                 environ: Mapping[str, str] | None = None, cwd: str | None = None) -> LaunchResult:
    """Run the job to its end. Raises ConfigError/LaunchError when it cannot start; a job
    whose instances fail is not an error: the result says so. Cancelling it stops the job.
    Any unexpected exception — here or in a callback the loop runs for the job — stops the
    job, cleans up and raises InternalError (the `poprun` command exits 70)."""
    loop = asyncio.get_running_loop()
    session = _Session(config, stdout_fd, stderr_fd, environ, cwd, loop)
    guard = _Guard(loop)
    try:
        with guard:
            async with session:
                session.job.on_interrupt = guard.interrupt
                await guard.run(session.run())
    except Exception as exc:  # noqa: BLE001 - sorted below: ours, or a bug
        if guard.error is None and isinstance(exc, PoprunError):
            raise
        guard.error = guard.error or exc
    if guard.error is not None:
        raise report_internal_error(guard.error, stderr_fd, config.verbose) from guard.error
    return session.result()


def _check_open_files(hosts: JobHosts, config: LaunchConfig) -> None:
    """Refuse, before the first connection, a job whose descriptors this process's open-file
    limit cannot hold (the poprun command raised its soft limit to the hard one already)."""
    output_files = config.effective_output_filename is not None
    need = hosts.open_files_here(output_files)
    limit = fdlimit.limits()
    if not fdlimit.shortfall(need, limit.soft):
        return
    parts = [f"{n} {what}: {each} each" for n, what, each in (
        (len(hosts.remote), "remote hosts", fdlimit.PER_CONNECTION),
        (hosts.local_instances, "local instances", fdlimit.PER_INSTANCE),
        (sum(hosts.counts) if output_files else 0, "instances' output files",
         fdlimit.PER_OUTPUT_FILES)) if n]
    raise LaunchError(
        f"this job needs at least {need} open files in poprun ({'; '.join(parts)}), but its "
        f"open-file limit (ulimit -n) is {limit.describe()}: raise the hard limit "
        f"(limits.conf nofile, systemd LimitNOFILE=), or run fewer hosts or instances per "
        f"launch")


class _Guard:
    """Makes every unexpected exception of a launch stop it. The loop's exception handler
    (where asyncio sends what a callback raises: a pipe reader, a timer, a signal handler)
    records the first one and cancels the launch's body, whose cleanup then runs as for
    Ctrl-C; `launch()` raises it as an InternalError afterwards. Without this, asyncio only
    logs such an exception and the job would go on, or end "successfully"."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task = asyncio.current_task()
        self._previous = None
        self._running = self._cancelled = False
        self.error: BaseException | None = None

    def __enter__(self) -> _Guard:
        self._previous = self._loop.get_exception_handler()
        self._loop.set_exception_handler(self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        self._loop.set_exception_handler(self._previous)

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        if error is None or isinstance(error, asyncio.CancelledError):
            # A message without an exception (e.g. a slow callback): asyncio's own handling.
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.fault(error)

    def fault(self, error: BaseException) -> None:
        """Record `error` (the first one wins) and stop the launch."""
        if self.error is None:
            self.error = error
        self.interrupt()

    def interrupt(self) -> None:
        """Cancel the launch's body (not its cleanup): a fault, or a stop signal that came
        before any instance was started."""
        if self._running and not self._cancelled and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    async def run(self, body) -> None:
        """Await `body`; a cancellation that `interrupt()` asked for ends it quietly."""
        self._running = True
        try:
            await body
        except asyncio.CancelledError:
            if not self._cancelled or self._task.uncancel() > 0:
                raise  # cancelled from outside too: the caller's cancellation goes on
        finally:
            self._running = False


class _Session:
    """One launch's resources. Entering checks the configuration, creates the lifeline and
    takes the stop signals; `run()` acquires the partition, opens the remote hosts (their
    connections and agents first, so any host's problem stops the launch before a single
    instance has started), creates the cache dirs, plans, spawns and waits for the end.
    Leaving — on every path — closes the agents (which kill what still runs there), kills
    and reaps what still runs here, restores the signal handlers, removes the temporary
    caches, releases the partition and prints the failure report."""

    def __init__(self, config: LaunchConfig, stdout_fd: int, stderr_fd: int,
                 environ: Mapping[str, str] | None, cwd: str | None,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.config, self.stdout_fd, self.stderr_fd = config, stdout_fd, stderr_fd
        self.environ = dict(os.environ if environ is None else environ)
        self.cwd = cwd or os.getcwd()
        self.loop = loop
        self.log = Log(config.verbose, stderr_fd)
        self.job: Job | None = None
        self.lifeline: Lifeline | None = None
        self.cache: _CacheDir | None = None
        self.fleet = None
        self.spares = None  # the spare hosts standing by (run/spares.SparePool), if any
        # Hosts never used again in this job ({host, reason, at}: --result-json's
        # `quarantined`), in the order they were.
        self.quarantined: list[dict] = []
        self.dashboard = None
        self.panel = None  # the dashboard's state (view.dashboard.DashboardState), if shown
        self.events = Observers()  # the job's observers, every attempt's
        self.partition = None  # the V-IPU partition (poprun.run.vipu.Partition), unless offline
        self._ticker = None
        self._pause: asyncio.Task | None = None  # the wait between two attempts
        self._pause_signal: int | None = None  # a stop signal that came during it
        self._restore_signals = lambda: None
        self._result: LaunchResult | None = None
        self.control = None  # poprunctl's view of the job (run/watching.JobControl)
        self.progress = None  # the progress watch (jobctl/progress.ProgressWatch)
        self.mpi_worlds: list[str] = []  # the kvsname of every attempt's MPI world
        self.libpmix = None  # the libpmix that serves Open MPI's world here (its check)
        self.pmix = None  # this host's PMIx service (spawner.worlds.pmixhost.PmixHost), if served
        self._pmix_here = False  # ... and its instances here (a server here)
        # Each host on the network the user chose (plan/network.py); None without a choice.
        self.network: dict[str, HostNetwork] | None = None
        self.rendezvous = None  # Horovod's (run/worlds/horovod.Rendezvous), once hosts are open
        self._own_id: str | None = None  # the job's id when it has no record
        self._leaves: dict[str, list[dict]] = {}  # per remote host, its agents' (for reap)
        self._boot_ids: dict[str, object] = {}  # per remote host, its last agent's boot id
        self.host_differences: tuple = ()  # plan/alike.py's Differences among the hosts
        self._compare = False  # the hosts are to be compared before anything starts
        self._facts_here: asyncio.Future | None = None  # this host's facts, read on a thread
        # Job hosts that failed their checks at the start, replaced by spares there (they are
        # not compared: `_replace_failed`).
        self._failed_checks: frozenset[str] = frozenset()

    async def __aenter__(self) -> _Session:
        config, log = self.config, self.log
        self.hosts = JobHosts.of(config, self.environ)
        self.program, self.mode = preflight(config, self.environ, self.cwd,
                                            resolve=self.hosts.any_local)
        _check_open_files(self.hosts, config)
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
        unsafe = state_dir_problem(self.environ)  # first: no state dir others can steer
        if unsafe:
            raise LaunchError(unsafe)
        self.hosts, left_out = without_quarantined(self.hosts, self.environ)
        for warning in left_out:
            log.warning(warning)
        wants_fold(config, self.environ)  # a bad POPRUN_FOLD_OUTPUT: one line, nothing started
        self.libpmix = self._find_libpmix()
        self.lifeline = Lifeline()
        if self.libpmix is not None:  # its process starts now, its server once named below
            self._start_pmix()
        if containment.is_subreaper():  # the poprun command: every child it starts is its own
            # ... so its helpers (an SSH ProxyCommand, srun, vipu) carry a mark of the lifeline's
            # too, one that the sweep after an attempt spares (the instances get the token).
            os.environ[containment.MARK] = self.environ[containment.MARK] = \
                containment.helpers_mark(self.lifeline.token)
            _quiet_asyncio_reaping_race()
        self.cache = _CacheDir(config, self.mode, self.lifeline, log)
        self.job = Job(self.config, self.environ, self.cwd, self.log, self.stdout_fd,
                       self.stderr_fd, self.loop, events=self.events)
        # Every attempt's Job shares this router: poprun's messages never join a line an
        # instance left unfinished (output.OutputRouter.write_own).
        self.log.write = self.job.router.write_own
        if self.job.router.fold is not None:  # --fold-output learns of plans and exits
            self.events.add(self.job.router.fold)
        try:  # poprun writes every instance's files, remote ones too: here is the place
            self.job.router.check_directory()
        except OSError as exc:
            self._close_pmix()
            self.lifeline.close()
            given = config.effective_output_filename
            # The path that failed may be a parent of the one given (a directory without
            # search permission): name both, the user's first; or a path below it (a link
            # planted there): name that one.
            failed = exc.filename if isinstance(exc.filename, str) else given
            where = failed if failed.startswith(given) else f"{given} ({failed})"
            raise LaunchError(f"--output-filename: cannot write to {where} on this host "
                              f"({socket.gethostname()}): {exc.strerror}") from None
        await self._start_steps()
        try:
            await self._open_job_control()
            if self.pmix is not None:
                self._serve_pmix()
            self._open_progress()
            # From here a stop signal is the job's: before any instance runs, it ends the launch.
            self._restore_signals = install_signal_handlers(self.loop, self.on_signal)
            if self.control is not None:
                self.control.start_pruning(self.environ)
        except BaseException:
            self._close_pmix()
            await self._close_fleet()  # __aexit__ will not run: the steps end here
            raise
        return self

    def _find_libpmix(self):
        """The libpmix that serves Open MPI's world on this host, where the job may use one
        (run/worlds/pmi1.find_libpmix): its server must be up before the instances start. Where
        Open MPI is there and no libpmix, said now, not after a wrong result."""
        from poprun.run.worlds.pmi1 import find_libpmix

        return find_libpmix(self.config, self.environ, self.program, self.log)

    def _start_pmix(self) -> None:
        """This host's PMIx service, its first server's process starting while the launch
        goes on (spawner/worlds/pmixhost.py); libpmix's server in it once the library passed its
        check (`_serve_pmix`)."""
        from spawner.worlds.pmixhost import PmixHost

        local = [label for label in self.hosts.labels if label not in self.hosts.remote]
        # Named as the plan names this host: Open MPI finds itself in the node map so.
        self.pmix = PmixHost(self.libpmix.path, self.lifeline,
                             local[0] if local else socket.gethostname(), self.loop,
                             given=self.config.libpmix, warn=self.log.warning)
        self._pmix_here = bool(local)
        if local:
            self.pmix.spawn()

    def _serve_pmix(self) -> None:
        """Once the job has a name and its libpmix passed its check (run/worlds/pmi1.usable_libpmix:
        a process of its own, started with the launch), libpmix's server starts in the
        process started for it. A library that fails the check is never loaded: a bad
        --libpmix is bad input (one line), one poprun found is not served (one warning)."""
        from poprun.run.worlds.pmi1 import usable_libpmix

        if usable_libpmix(self.libpmix, self.config, self.log) is None:
            self._close_pmix()
            self.pmix = self.libpmix = None
        elif self._pmix_here:  # named by the job's id
            self.pmix.prestart(self._kvsname(0))

    def _close_pmix(self) -> None:
        if self.pmix is not None:
            self.pmix.close()

    async def _start_steps(self) -> None:
        """Over Slurm, the agents' job steps are created now, not once the job's record and
        control socket are up: slurmctld's step creation and the agents' start overlap them
        (bench/README.md, "Remote launches")."""
        if self.hosts.remote and self.hosts.transport == "slurm":
            from poprun.run.fleet import Fleet

            self.fleet = Fleet.of(self.hosts, self.config, self.log)
            self.fleet.start_steps()
            # One turn of the loop: each srun is forked now, not at the next wait (after the
            # job control's synchronous start, ~50 ms later under load).
            await asyncio.sleep(0)

    async def _open_job_control(self) -> None:
        """poprunctl's view of the job: its record, log, stall watch and control
        socket, given callbacks into this launch, never the launch itself."""
        from poprun.run.watching import JobControl

        self.control = await JobControl.open(
            self, facts=self._record_facts, stop=self.on_signal,
            running=lambda: self.job.running(), gather=self._gather_stacks,
            cgroup_of=self._cgroup_of,
            on_stall=lambda stall, ongoing: self.job.report_stall(stall, ongoing),
            on_unstall=lambda: self.job.report_unstall(),
            spawned=lambda: self.job.spawned.to_json() if self.job.spawned else ())
        for observer in self.control.observers if self.control is not None else ():
            self.events.add(observer)

    def _open_progress(self) -> None:
        """The progress watch (stragglers, ETA): its reports go to every observer
        through the job."""
        from poprun.jobctl.progress import progress_watch

        self.progress = progress_watch(
            self.loop, self.config.num_instances, pattern=self.config.progress_pattern,
            hold=self.config.straggler_after, local=lambda keys=None: self.job.local_progress(keys),
            report=lambda report: self.job.report_progress(report), note=self.log.info)
        self.events.add(self.progress)

    async def _gather_stacks(self, keys, timeout: float):
        """The running instances' stacks (`keys`: only these), from every host at once."""
        from poprun.jobctl import stacks  # imported when asked: a launch rarely is

        return await stacks.gather(self.job, keys, timeout)

    @property
    def _job_id(self) -> str:
        """The job's id (its record's), else one of its own: unique among this user's jobs."""
        if self.control is not None:
            return self.control.id
        if self._own_id is None:
            self._own_id = os.urandom(6).hex()
        return self._own_id

    def _kvsname(self, attempt: int) -> str:
        """The name of an attempt's MPI world: MPICH's shared memory and PMIx's directories
        are named by it (spawner/reaphere.py)."""
        return f"poprun-{self._job_id}-{attempt}"

    def _cgroup_of(self, key: int) -> str | None:
        """A local instance's own cgroup, where it has one: its CPU and memory are then the
        whole instance's, escaped helpers included."""
        return self.job.local.cgroup_of(key) if self.job.local else None

    def _record_facts(self) -> dict:
        """The record's keys that this launch learns as it goes (JobRecord.meta)."""
        labels, remote = self.hosts.labels, self.hosts.remote
        agents = {label: spawner.info for label, spawner in
                  (self.fleet.spawners.items() if self.fleet is not None else ())
                  if spawner.info is not None}
        here = procid.boot_id()
        plan = self.job.plan
        caches = {}
        if plan is not None and plan.cache_mode is CacheMode.TEMPORARY:
            for inst in plan.instances:
                if inst.env.get(EXECUTABLE_CACHE_PATH):
                    caches.setdefault(inst.host, inst.env[EXECUTABLE_CACHE_PATH])
        error_dir = self.job.local.error_dir if self.job.local else None
        partition = self.partition
        for label, info in agents.items():  # a host replaced by a spare is still reaped
            self._boot_ids[label] = info.raw.get("boot_id")
        replaced = [q["host"] for q in self.quarantined if q["host"] not in labels]
        return {
            "hosts": [{"label": label, "local": label not in remote and label not in replaced,
                       "boot_id": self._boot_ids.get(label) if label in remote
                       or label in replaced else here}
                      for label in (*labels, *dict.fromkeys(replaced))],
            "pythons": {label: info.python_executable for label, info in agents.items()},
            "caches": caches,
            "error_dirs": {label: error_dir for label in labels
                           if label not in remote} if error_dir else {},
            "partition": None if partition is None else {
                "name": partition.name, "created": partition.created,
                "remove": partition.remove_on_release, "host": partition.host,
                "port": partition.port, "timeout": partition.timeout,
                "executable": partition.executable},
            "output_dir": output_files(self.config.effective_output_filename, self.cwd)[0],
            # Every host's instances join them (run/worlds/pmi1.py): what reap removes from
            # /dev/shm on each.
            "mpi_worlds": {label: list(self.mpi_worlds) for label in labels}
            if self.mpi_worlds else {},
            "agents": self._agents_leaves(agents),
            # What differs among the hosts (--compare-hosts), as it was reported.
            "host_differences": _recorded(self.host_differences),
            "quarantined": list(self.quarantined),  # as --result-json will have them
        }

    def _agents_leaves(self, agents: dict) -> dict[str, list[dict]]:
        """Per remote host, what each of its agents said it may leave there (its HELLO's
        `leaves`: instances' mark, cgroup root, error dir), for reap. Every agent the job
        had, a host's earlier ones too (a host lost and connected again)."""
        for label, info in agents.items():
            leaves = info.raw.get("leaves")
            seen = self._leaves.setdefault(label, [])
            if isinstance(leaves, dict) and leaves not in seen:
                seen.append(leaves)
        return {label: list(found) for label, found in self._leaves.items()}

    async def run(self) -> None:
        """Start every instance, here and on the remote hosts, and wait for the job's end.
        A stop signal before any instance started cancels this: the result then says so."""
        try:
            await self._run()
        except asyncio.CancelledError:
            if self.job.stop_signal is not None:
                self._result = self.job.result()
            raise

    async def _run(self) -> None:
        self._open_dashboard()
        await self._acquire_partition()
        if self.control is not None and self.partition is not None:
            self.control.record.write()  # a partition poprun created is in it from now
        if self.hosts.remote:
            await self._open_fleet()
        self._choose_network()
        caches = await self._create_caches()
        master = await self._master_address()
        self._open_rendezvous()
        earlier: list[LaunchResult] = []
        while True:
            await self._plan(caches, master, attempt=len(earlier))
            result = await self._run_attempt(len(earlier))
            lost = self._quarantine(result.host_faults())
            if not self._restarts(result, len(earlier)):
                break
            earlier.append(result)
            if not await self._pause_between_attempts(result, len(earlier)):
                result = replace(result, stop_signal=self._pause_signal,
                                 exit_code=128 + self._pause_signal)
                break
            lost += self._quarantine(self._lost_meanwhile())  # during the restart delay
            if lost:
                try:
                    caches, master = await self._recover(lost, caches)
                except LaunchError as exc:  # still gone: the lost host's failure stands
                    earlier.pop()
                    for line in str(exc).splitlines():
                        self.log.error(f"cannot restart the job: {line}")
                    break
        self._result = replace(result, attempts=tuple(earlier),
                               quarantined=tuple(self.quarantined))
        if self._result.exit_class == "do_not_requeue":  # the contract's status
            self._result = replace(self._result, exit_code=DO_NOT_REQUEUE_STATUS)

    def _lost_meanwhile(self) -> dict[str, tuple[str, float]]:
        """Hosts lost before the next attempt started anything there (the new Job heard)."""
        import time

        return {host: (f"lost: {reason}", time.time())
                for host, reason in self.job.lost_before_start.items()}

    def _quarantine(self, found: Mapping[str, tuple[str, float]]) -> list[str]:
        """The remote hosts that failed the job (label -> why, when: LaunchResult.host_faults:
        lost, frozen, or an instance there killed by the kernel's OOM killer): quarantined,
        never used again in this job even once they answer (a host that failed once is likely
        to again, and a restart there would spend the restarts), and remembered for later
        jobs. Their labels, in host order."""
        lost = [label for label in self.hosts.labels if label in found
                and label in self.hosts.remote]  # this host runs poprun: never left out
        for label in lost:
            reason, at = found[label]
            self.quarantined.append({"host": label, "reason": reason, "at": round(at, 3)})
            kind, _, detail = reason.partition(": ")
            self.log.warning(f"{label} quarantined for the rest of the job: {kind} ({detail})")
        self._remember_quarantine(self.quarantined[-len(lost):] if lost else [])
        return lost

    def _remember_quarantine(self, new: list[dict]) -> None:
        """Hosts just quarantined, left out of this user's later jobs for --quarantine-for
        (jobctl/quarantine.py); a state directory that cannot take them is said."""
        if not new or not self.config.quarantine_for:
            return
        import time

        from poprun.jobctl import quarantine

        entries = [quarantine.Entry(q["host"], q["reason"], q["at"],
                                    q["at"] + self.config.quarantine_for, self._job_id)
                   for q in new]
        try:
            quarantine.add(entries, time.time(), self.environ)
        except OSError as exc:
            hosts = ", ".join(q["host"] for q in new)
            self.log.warning(f"cannot remember the quarantine of {hosts} for later jobs: "
                             f"{exc.strerror or exc}")

    async def _recover(self, lost: list[str], caches: dict[str, str]
                       ) -> tuple[dict[str, str], str]:
        """Hosts quarantined after the last attempt, each replaced by a spare for the next;
        LaunchError naming those no spare is left for (the job ends there)."""
        if self.spares is not None:
            replaced, caches = await self._take_spares(lost, caches)
            lost = [label for label in lost if label not in replaced]
        why = {q["host"]: q["reason"] for q in self.quarantined}
        if lost:  # "lost", or why else it was quarantined
            said = {label: "lost" if why[label].startswith("lost:")
                    else f"quarantined ({why[label]})" for label in lost}
            raise LaunchError("\n".join(f"{label}: {said[label]}, and no spare host is left to "
                                        "take its place (--spare-hosts)" for label in lost))
        return caches, await self._master_address()

    async def _take_spares(self, lost: list[str], caches: dict[str, str]
                           ) -> tuple[dict[str, str], dict[str, str]]:
        """Spares in the lost hosts' places for the next attempt (run/spares.py): the same
        instance indices, placement and environment; their caches made (a temporary one
        there, or the explicit path). Which host each replaced, and the caches."""
        pairs = self._substitute_spares(lost, "for the next attempt")
        if not pairs:
            return pairs, caches
        for new in pairs.values():
            self.fleet.spawners[new].new_attempt(self.job, self.job.on_host_lost)
        caches = {label: path for label, path in caches.items() if label not in pairs}
        spares = list(pairs.values())
        if self.mode is CacheMode.TEMPORARY:
            caches.update(await self.fleet.temp_dirs(spares))
        elif (explicit := planning.explicit_cache(self.config, self.mode)) is not None:
            await self.fleet.make_dirs(explicit, spares)
            caches.update((label, explicit) for label in spares)
        self._choose_network()
        return pairs, caches

    def _substitute_spares(self, failed: list[str], when: str) -> dict[str, str]:
        """Spares in the `failed` hosts' places (as many as are ready), in the fleet and in
        `hosts`, each said: failed label -> spare label."""
        pairs = self.spares.take(failed, self.fleet)
        self.hosts = self.hosts.substituted({
            old: next(h for h in self.hosts.spares if str(h) == new)
            for old, new in pairs.items()})
        for old, new in pairs.items():
            self.log.warning(f"{old} replaced by spare host {new} {when} "
                             f"({self.hosts.count(new)} instance(s))")
        return pairs

    async def _run_attempt(self, attempt: int) -> LaunchResult:
        finished = self.loop.create_future()
        kvsname = self._kvsname(attempt)
        self.mpi_worlds.append(kvsname)
        await self.job.start(self.lifeline,
                             lambda: finished.done() or finished.set_result(None),
                             remote=self.fleet.spawners if self.fleet else None,
                             kvsname=kvsname if self.config.mpi_worlds != "none" else None,
                             pmix=self.pmix)
        if self.fleet is not None:
            await self.job.spawn_remote()
        if not self.job.finished:
            await finished
        result = self.job.result()
        await self.job.close_world()  # its instances are gone: MPICH's leftovers can go
        return result

    def _restarts(self, result: LaunchResult, done: int) -> bool:
        """Whether a failed attempt is followed by another: not after a stop by the user or
        an output error (a lost host is replaced by a spare first: `_recover`)."""
        return (not result.ok and done < self.config.max_restarts
                and result.stop_signal is None and result.output_error is None)

    async def _pause_between_attempts(self, failed: LaunchResult, attempt: int) -> bool:
        """Clean up after a failed attempt, wait --restart-delay, make the next attempt's
        Job; False when a stop signal came meanwhile (then no restart)."""
        total = self.config.max_restarts + 1
        self.log.warning(f"attempt {attempt} of {total} failed (exit status "
                         f"{failed.exit_code}); starting attempt {attempt + 1} in "
                         f"{self.config.restart_delay:g} s")
        previous = self.job
        previous.close(keep_output=True)  # its instances are gone; reap, sweep, keep files
        if self.pmix is not None and previous.world_served_here:
            self.pmix.prestart(self._kvsname(attempt))  # a fresh server, started meanwhile
        self.job = Job(self.config, self.environ, self.cwd, self.log, self.stdout_fd,
                       self.stderr_fd, self.loop, router=previous.router, events=self.events)
        self.job.on_interrupt = previous.on_interrupt
        self.job.phases = previous.phases
        for spawner in (self.fleet.spawners.values() if self.fleet else ()):
            spawner.new_attempt(self.job, self.job.on_host_lost)
        self._pause = self.loop.create_task(asyncio.sleep(self.config.restart_delay))
        try:
            await self._pause
        except asyncio.CancelledError:
            if self._pause_signal is None:
                raise  # cancelled from outside, not by a stop signal
        finally:
            self._pause = None
        if self._pause_signal is not None:
            self.log.warning(f"{signal.Signals(self._pause_signal).name} received: no "
                             "restart")
            return False
        if self.partition is not None:
            from poprun.run.vipu import reset

            await reset(self.partition, self.log, self.environ)
        self.events.restarted(attempt + 1, total)
        return True

    def on_signal(self, sig: int) -> None:
        """The stop signals: the running attempt's job decides, except between attempts."""
        if self._pause is not None and self._pause_signal is None:
            self._pause_signal = sig
            self._pause.cancel()
            return
        self.job.on_signal(sig)

    async def _open_fleet(self) -> None:
        from poprun.run import hostcheck
        from poprun.run.fleet import Fleet  # asyncssh: only runs with remote hosts import it

        if self.fleet is None:  # over Slurm it is there already (_start_steps)
            self.fleet = Fleet.of(self.hosts, self.config, self.log)
        ask = None
        if hostcheck.wanted(self.config, self.hosts):  # each agent asked with its HELLO
            program, cache = self.config.program, planning.explicit_cache(self.config, self.mode)
            ask = hostcheck.ask(self.config, self.environ, program, self.cwd, cache)
            self._compare = True
            if self.hosts.any_local:  # read here while the agents start
                here = self._facts_here = self.loop.run_in_executor(
                    None, hostcheck.gather_here, self.config, self.environ, program, self.cwd,
                    cache)
                # Its error taken even if the launch ends before it is read.
                here.add_done_callback(lambda done: done.cancelled() or done.exception())
        standby = self._open_spares(ask)  # meanwhile: their problems are said, not raised
        try:
            failed = await self.fleet.open(
                self.job, self.job.on_host_lost, cwd=self.cwd,
                program=host_program(self.config, self.program), path=self.environ.get("PATH"),
                view=self.panel, temp_dirs=self.mode is CacheMode.TEMPORARY, facts=ask,
                keep_going=standby is not None)
        except BaseException:
            if standby is not None:  # what it opened is closed with the session
                standby.cancel()
                await asyncio.gather(standby, return_exceptions=True)
            raise
        if standby is not None:
            await standby
        if failed:
            await self._replace_failed(failed)
        self.job.phases.update(self.fleet.phases(since=self.job.launch_mono))

    async def _replace_failed(self, failed: Mapping[str, str]) -> None:
        """Job hosts that failed their checks at the start (unreachable, no agent, no working
        directory or program there...: Fleet.open's problems, one line each), where spares
        stand by: each quarantined and its place given to a spare, compared and admitted
        first. LaunchError with every problem, nothing quarantined, when the spares left
        cannot take every place: a check every host fails is the job's, not a host's."""
        self._failed_checks = frozenset(failed)
        await self._compare_hosts()  # without them: the spares are admitted by it
        if len(failed) > len(self.spares.ready):
            raise LaunchError("\n".join(failed.values()))
        import time

        now = time.time()
        self._quarantine({label: (f"checks: {_without_label(label, problem)}", now)
                          for label, problem in failed.items()})
        self._substitute_spares(list(failed), "from the start")

    def _open_spares(self, ask: dict | None) -> asyncio.Future | None:
        """The spare hosts connected and given agents while the job's hosts are (the same
        HELLO, facts included: they are compared in `_compare_hosts`)."""
        if not self.hosts.spares:
            return None
        from poprun.run.spares import SparePool

        self.spares = SparePool(self.hosts, self.fleet, self.log)
        return asyncio.ensure_future(self.spares.open(
            self.job, cwd=self.cwd, program=host_program(self.config, self.program),
            path=self.environ.get("PATH"), facts=ask))

    async def _compare_hosts(self) -> None:
        """The hosts' differences, before anything starts (their facts came while the launch
        went on, up to its first plan): warned about (and kept in the record), or with
        --compare-hosts=error, the launch refused (LaunchError: exit 2). Once."""
        if not self._compare:
            return
        from poprun.run import hostcheck

        self._compare = False
        began = self.loop.time()
        facts_here = await self._facts_here if self._facts_here is not None else None
        remote = await hostcheck.answers(self.fleet.spawners)
        waited = self.loop.time() - began
        labels = [label for label in self.hosts.labels if label not in self._failed_checks]
        local = [label for label in labels if label not in self.hosts.remote]
        self.host_differences = hostcheck.compare(self.config, self.environ,
                                                  labels, local, facts_here, remote)
        if self.spares is not None:
            self.spares.admit(hostcheck.spare_differences(
                self.config, self.environ, labels, local, facts_here, remote,
                await hostcheck.answers(self.spares.fleet.spawners)))
        self.log.debug(f"hosts compared ({len(self.host_differences)} difference(s)): waited "
                       f"{waited * 1000:.1f} ms for their facts, "
                       f"{(self.loop.time() - began - waited) * 1000:.1f} ms comparing")
        if not self.host_differences:
            return
        lines = hostcheck.report_lines(self.host_differences, self.config.compare_hosts)
        if self.config.compare_hosts == "error":
            raise LaunchError("\n".join(lines))
        for line in lines:
            self.log.warning(line)

    async def _create_caches(self) -> dict[str, str]:
        """The executable cache of every host: a temporary dir on each (removed at the end),
        or the explicit path, created where missing; none when caching is off."""
        local_cache = self.cache.create() if self.hosts.any_local else None
        explicit = planning.explicit_cache(self.config, self.mode)
        caches = {}
        if local_cache or explicit:  # an explicit path: the same on every host
            caches = {h: local_cache or explicit for h in self.hosts.labels}
        if self.fleet is not None and self.mode is CacheMode.TEMPORARY:
            caches.update(await self.fleet.temp_dirs())
        elif self.fleet is not None and explicit:
            await self.fleet.make_dirs(explicit)
        return caches

    def _choose_network(self) -> None:
        """Each host on the network the user chose (plan/network.py), from the interfaces
        its agent listed (this host's read here); nothing without a choice."""
        choice = self.config.network
        if not choice.chosen:
            return
        found = local_interfaces(self.hosts)
        if self.fleet is not None:
            found.update(self.fleet.interfaces())
        self.network = resolve_network(choice, found)
        self.log.info(f"network ({choice.control.source}; data: {choice.data.source}): "
                      + ", ".join(f"{label} {n.address} ({n.interface})"
                                  for label, n in self.network.items()))

    def _open_rendezvous(self) -> None:
        """Horovod's Gloo rendezvous (run/worlds/horovod.py), on this machine's address as the
        hosts reach it (on the chosen network, where it has one); none (said at -v) where
        it cannot listen there, or where `--mpi-worlds none` turned every world off (then
        poprun listens on no port at all)."""
        from poprun.run.worlds.horovod import Rendezvous

        if self.config.mpi_worlds == "none":
            self.log.info("no Horovod rendezvous: --mpi-worlds none")
            return

        if self.fleet is not None:
            address = self.fleet.reach_back_address()
        elif self.config.network.chosen:  # every instance here, on the chosen network
            from spawner.netifs import interfaces

            address = address_here(self.config.network, interfaces) or LOOPBACK
        else:
            address = LOOPBACK
        try:
            self.rendezvous = Rendezvous(address, self.loop)
        except OSError as exc:
            self.log.info(f"no Horovod rendezvous: cannot listen on {address}: "
                          f"{exc.strerror or exc}")
            return
        self.log.info(f"Horovod's Gloo rendezvous: {address}:{self.rendezvous.address[1]}")

    async def _close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            await self.rendezvous.close()

    async def _master_address(self) -> str:
        """MASTER_ADDR: loopback for a job on this host only, else the first host's address
        as the others reach it (on the chosen network, if any)."""
        if self.network is not None:
            return self.network[self.hosts.labels[0]].address
        if self.fleet is None:
            return LOOPBACK
        return (self.fleet.own_address() if self.hosts.first_is_local
                else self.fleet.address_of(self.hosts.labels[0]))

    def _open_dashboard(self) -> None:
        """The live panel, when stderr is a terminal (dashboard.wants_dashboard says): every
        console write (instance output, poprun's messages) then goes through it."""
        if not os.isatty(self.stderr_fd):  # the usual case in scripts: skip the import
            return
        from poprun.view.dashboard import wants_dashboard

        if not wants_dashboard(self.stderr_fd, self.environ, self.config.no_dashboard,
                               stdout_fd=self.stdout_fd, force=self.config.dashboard):
            return
        from poprun.view.dashboard import Dashboard, DashboardState, PanelFeed, expected_cache

        state = DashboardState(self.config.num_instances, self.hosts.labels, self.loop.time(),
                               remote_hosts=len(self.hosts.remote),
                               offline=self.config.offline_mode,
                               cache_dir=expected_cache(self.config, self.mode, self.environ),
                               kill_timeout=self.config.kill_timeout)
        state.job_id = self.control.id if self.control is not None else None
        self.dashboard = Dashboard(state, self.stderr_fd, cgroup_of=self._cgroup_of)
        self.panel = state
        self.events.add(PanelFeed(state))
        self.job.router.write = self.dashboard.emit  # the log writes through the router
        self._tick()

    def _tick(self) -> None:
        self.dashboard.tick(self.loop.time())
        self._ticker = self.loop.call_later(DASHBOARD_REFRESH, self._tick)

    def _close_dashboard(self) -> None:
        """Erase the panel (the report then prints below the output, as without it)."""
        if self.dashboard is None:
            return
        self._ticker.cancel()
        self.job.router.write = write_all
        dashboard, self.dashboard = self.dashboard, None
        dashboard.close()

    async def _acquire_partition(self) -> None:
        """The job's V-IPU partition (found, checked, created or reset), unless offline.
        A stop signal meanwhile cancels this; vipu.acquire then removes what it created."""
        if self.config.offline_mode:
            return
        from poprun.run import vipu

        settings = vipu.VipuSettings.from_config(self.config)
        required = vipu.Requirements.of_config(self.config, settings)
        self.partition = await vipu.acquire(settings, required, self.environ, self.log)
        if self.panel is not None:
            self.panel.set_partition(self.partition.name)

    async def _plan(self, cache_paths: Mapping[str, str], master_addr: str,
                    attempt: int = 0) -> None:
        topologies = local_topologies(self.config, self.hosts)
        if self.fleet is not None and any(planning.needs_topology(self.config, n)
                                          for n in self.hosts.counts):
            topologies.update(self.fleet.topologies())
        launch_plan = planning.plan(
            self.config, self.environ, program=self.program, master_port=free_port(),
            hosts=self.hosts.labels, master_addr=master_addr, remote_hosts=self.hosts.remote,
            cache_paths=cache_paths, topologies=topologies,
            partition_env=self.partition.environment if self.partition else None,
            restart_count=attempt if self.config.max_restarts else None,
            counts=self.hosts.counts,
            rendezvous=self.rendezvous.address if self.rendezvous else None,
            interfaces={label: n.interface for label, n in self.network.items()}
            if self.network else None)
        # Planned, nothing said or used yet: the hosts' facts, read meanwhile, compared.
        await self._compare_hosts()
        if self.rendezvous is not None:  # each attempt's hvd.init() starts afresh
            self.rendezvous.new_world([inst.env for inst in launch_plan.instances])
        if self.config.warns_single_instance:
            self.log.warning("Using --num-instances=1 and --num-replicas=1 together is not "
                             "supported and might give additional overhead and/or raise other "
                             "issues.")
        for warning in launch_plan.warnings:
            self.log.warning(warning)
        self._log_placement(launch_plan)
        if self.config.print_topology:
            self.job.router.write(self.stdout_fd, topology_table(launch_plan).encode())
        self.job.set_plan(launch_plan)
        if self.panel is not None:
            caches = set(cache_paths.values())
            self.panel.set_cache_dir(caches.pop() if len(caches) == 1 else
                                        f"{len(caches)} dirs, one per host" if caches else None)

    def _log_placement(self, launch_plan: LaunchPlan) -> None:
        """-v: the hosts, and each host's strategy; -vv: each instance's binding."""
        self.log.info(f"hosts: {self.hosts.describe()}")
        mpi = self.config.mpi
        if mpi.bind_to and planning.strategy_from_mpi(mpi.bind_to, mpi.map_by) is None:
            self.log.info(f"ignoring mpirun --bind-to {mpi.bind_to}"
                          f"{' --map-by ' + mpi.map_by if mpi.map_by else ''}: no placement "
                          "strategy matches it")
        counts = self.hosts.counts
        if len(set(counts)) == 1:
            strategy = planning.host_strategy(self.config, counts[0])
            self.log.info(f"process placement: {strategy.value} ({counts[0]} instance(s) per "
                          "host)")
        for label, count in zip(self.hosts.labels, counts) if len(set(counts)) > 1 else ():
            strategy = planning.host_strategy(self.config, count)
            self.log.info(f"process placement on {label}: {strategy.value} ({count} "
                          "instance(s))")
        for inst in launch_plan.instances:
            self.log.debug(f"instance {inst.index} on {inst.host}: cpus "
                           f"{'any' if inst.cpus is None else format_cpu_list(inst.cpus)}, "
                           f"memory nodes "
                           f"{'any' if inst.mems is None else format_cpu_list(inst.mems)}")

    def result(self) -> LaunchResult:
        if self._result is None:
            self._result = self.job.result()
        if self.control is not None:  # the final record: --result-json's schema
            self._result = self.control.record.finish(self._result)
        return self._result

    async def __aexit__(self, *exc_info) -> None:
        """Every step runs whatever the others do; the first exception is raised after all
        of them (a bug in one step must not leave processes, caches or a partition)."""
        errors = []
        for step in (lambda: self.progress and self.progress.close(),
                     self._close_fleet, self._close_dashboard, self.job.close,
                     self.job.close_world, self._close_pmix,
                     self._close_rendezvous,
                     self._restore_signals, self.cache.remove, self.lifeline.close,
                     self._release_partition, self._helpers_reaped,
                     lambda: errors or self._report(),
                     # After the report: the record has what its writing did to the status.
                     lambda: self.control and self.control.close(self._result, exc_info[1])):
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:  # noqa: BLE001 - raised below, after the other steps
                errors.append(exc)
        if errors:
            raise errors[0]

    def _report(self) -> None:
        if self._result is not None:
            self._note_scheduler_stop()
            self._print_report()

    def _note_scheduler_stop(self) -> None:
        """Slurm ending the job (scancel, a time limit) kills the instances, which then look
        like failures: name the reason, from the agents' steps' stderr (read by now, the
        agents being closed)."""
        if self.fleet is None or self.fleet.transport != "slurm":
            return
        from spawner.srun import cancellation

        for label, spawner in self.fleet.spawners.items():
            reason = cancellation(spawner.stderr_tail)
            if reason:
                self._result = replace(self._result, scheduler_stop=f"{label}: {reason}")
                return

    async def _helpers_reaped(self) -> None:
        if containment.is_subreaper():  # the poprun command: its children are all its own
            await containment.helpers_reaped(keep=frozenset([self.lifeline.pid]))

    async def _close_fleet(self) -> None:
        if self.fleet is not None:  # first: a spare that took a place may run in the
            await self.fleet.close()  # spares' Slurm step, which closing them cancels
        if self.spares is not None:
            await self.spares.close()

    async def _release_partition(self) -> None:
        if self.partition is not None:  # after the instances are gone from it
            from poprun.run.vipu import release

            await release(self.partition, self.log, self.environ)

    def _print_report(self) -> None:
        """The report on stderr. What poprun had to say there and could not (a stderr opened
        read-only, a full disk) is an output error, as on stdout: exit 74, the reason in the
        result (--result-json, the record) since stderr cannot show it."""
        from poprun.view.render import render_report  # plain text, or rich's on a terminal

        try:  # rendering too: rich's console writes what it still holds to the terminal
            report = render_report(self._result, self.stderr_fd, self.environ,
                                   self.config.verbose)
            if report:  # nothing to say is no write: a quiet success needs no stderr
                self.job.router.write_own(self.stderr_fd, report)
        except OSError as exc:
            self.log.lost = self.log.lost or exc
        lost = self.log.lost
        if lost is not None and self._result.output_error is None:
            self._result = replace(self._result, exit_code=OUTPUT_ERROR_STATUS,
                                   output_error=f"cannot write poprun's stderr: "
                                                f"{lost.strerror or lost}")


def _without_label(label: str, line: str) -> str:
    """A host's problem line (`h2: ...`) without its label: a quarantine names the host."""
    return line[len(label) + 2:] if line.startswith(f"{label}: ") else line


def _recorded(differences: tuple) -> list[dict]:
    """The hosts' differences as the record keeps them (imported only when there are)."""
    if not differences:
        return []
    from poprun.plan.alike import recorded

    return recorded(differences)


class _CacheDir:
    """The executable cache directory of this host, for the job's lifetime."""

    def __init__(self, config: LaunchConfig, mode: CacheMode, lifeline: Lifeline,
                 log: Log) -> None:
        self._config, self._mode, self._lifeline, self._log = config, mode, lifeline, log
        self.path: str | None = None
        self._temporary = False

    def create(self) -> str | None:
        if self._mode is CacheMode.EXPLICIT:
            self.path = planning.explicit_cache(self._config, self._mode)
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as exc:
                raise LaunchError(f"cannot create executable cache {self.path}: "
                                  f"{exc.strerror}") from None
        elif self._mode is CacheMode.TEMPORARY:
            self.path = self._lifeline.make_temp_dir("poprun-cache-")  # mode 0700
            self._temporary = True
        if self.path:
            self._log.info(f"executable cache ({self._mode.value}): {self.path}")
        return self.path

    def remove(self) -> None:
        if self._temporary and self.path:
            shutil.rmtree(self.path, ignore_errors=True)
            self._lifeline.discard_dir(self.path)
            self._log.info(f"removed temporary executable cache {self.path}")
