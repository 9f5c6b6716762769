"""One run of a plan: the spawners' sink, and the failure and signal policy.

- all instances exit 0                   -> exit code 0
- an instance fails (non-zero or signal) -> SIGTERM to the others, SIGKILL after
                                            `kill_timeout`; exit code = its status (128+N)
- a remote host is lost                  -> as a failure of its instances (status 255)
- SIGINT / SIGTERM / SIGHUP to poprun    -> forwarded to every instance; SIGKILL after
                                            `kill_timeout`, or at once on a second SIGINT
                                            or SIGHUP (SIGTERM never shortens it);
                                            exit code 128+N
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from dataclasses import replace

from spawner import procid
from spawner.binding import read_binding
from spawner.cpulist import format_cpu_list
from spawner.lifeline import Lifeline
from spawner.local import LocalSpawner, ProcessSpec, Stream
from spawner.uncompiled import dataclass

from poprun.errors import LaunchError
from poprun.events import Observers
from poprun.log import Log
from poprun.plan import planner as planning
from poprun.plan.config import LaunchConfig, wants_fold
from poprun.plan.planner import InstancePlan, LaunchPlan
from poprun.result import (LOST_HOST_STATUS, InstanceResult, LaunchResult, end_reason,
                           exit_status)
from poprun.run.output import OutputOptions, OutputRouter, output_files
from poprun.text import cut, shown_text

MAX_ABORT_MESSAGE = 1000  # characters of an MPI_Abort's message kept (MPICH's says "abort")


def _forwarded(stop_signal: int) -> int:
    """The signal instances get for the job's stop signal. A broken pipe (`poprun | head`)
    is SIGPIPE to poprun but SIGTERM to them: Python and most runtimes ignore SIGPIPE, so it
    once left them running until --kill-timeout."""
    return signal.SIGTERM if stop_signal == signal.SIGPIPE else stop_signal


@dataclass
class Started:
    pid: int
    start: float
    end: float = 0.0
    returncode: int | None = None
    signalled: bool = False
    lost: str | None = None  # why its host was lost, if it was

    def __init__(self, pid, start, end=0.0, returncode=None, signalled=False, lost=None):
        # by hand: one per instance (spawner/uncompiled.py)
        self.pid, self.start, self.end, self.returncode = pid, start, end, returncode
        self.signalled, self.lost = signalled, lost


class Job:
    """One run of the plan: the spawners' sink, and the failure and signal policy. What
    happens is published to `events` (poprun/events.py): the dashboard, the record, the log
    and the stall watch are its observers."""

    def __init__(self, config: LaunchConfig, environ: dict[str, str], cwd: str, log: Log,
                 stdout_fd: int, stderr_fd: int, loop, router: OutputRouter | None = None,
                 events: Observers | None = None) -> None:
        self.config, self.environ, self.cwd, self.log = config, environ, cwd, log
        self.loop = loop
        self.events = events if events is not None else Observers()
        self.plan: LaunchPlan | None = None  # set_plan(), once the hosts are known
        self.router = router or Job._router(config, environ, cwd, stdout_fd, stderr_fd)
        self.router.report_to(self._broken_pipe, self._write_error)
        self.router.instances.clear()  # a new attempt's counts and tails start afresh
        self.output_error: str | None = None  # why output could not be written, if so
        self.started: dict[int, Started] = {}
        self.launch_time = time.time()
        # Instants are taken on one clock, the monotonic one, as the fleet's are (wall-clock
        # times and monotonic spans do not order exactly); `_wall` gives their time.time().
        self.launch_mono = time.monotonic()
        self._marks: dict[str, dict[int, float]] = {"first_started": {}, "first_output": {}}
        self.phases: dict[str, dict[str, float]] = {}  # host -> phase -> seconds (result)
        self.done: set[int] = set()  # exit reported, or lost with its host
        self._steps: dict[int, int] = {}  # remote instances' last popdist.progress() step
        self.root_cause: int | None = None
        self.stop_signal: int | None = None
        self.on_finished = None
        # Called when a stop signal comes before any instance runs: the launch then ends
        # without starting them (the session sets it).
        self.on_interrupt = lambda: None
        self._all_started = False
        self._spawning_remote = False  # spawn requests are out; their instances may run already
        self._kill_timer = None
        self._signalled: set[int] = set()  # instances poprun has sent a stop signal to
        self.local: LocalSpawner | None = None
        self.remote: Mapping[str, object] = {}
        # Hosts lost before this attempt started its instances (between attempts: the
        # session connects them again, as those lost during an attempt).
        self.lost_before_start: dict[str, str] = {}
        self.spawner_of: dict[int, object] = {}  # instance -> the spawner that runs it
        self.stall: dict | None = None  # --stall-action kill stopped the job: the stall
        self.world = None  # the instances' MPI world (run/worlds/pmi1.MpiWorld), where served
        # this host's node-level worlds (run/worlds/hostlink.HostLink), where ranks run here
        self.host_link = None
        self.spawned = None  # what its instances spawned (run/worlds/spawn.Spawned), once they do
        # instance -> why a process it spawned failed and its status, for the first failure
        self._child_failures: dict[int, tuple[str, int]] = {}
        self.mpi_aborts: dict[int, tuple[int, str]] = {}  # instance -> MPI_Abort's code, text
        self._unfinalized: set[int] = set()  # closed its MPI world before MPI_Finalize
        self._no_finalize: int | None = None  # the instance whose exit 0 stopped the job
        self._server_lost: dict[int, str] = {}  # instance -> how its PMIx server died
        self._pmix_here = False

    @staticmethod
    def _router(config: LaunchConfig, environ: Mapping[str, str], cwd: str,
                stdout_fd: int, stderr_fd: int) -> OutputRouter:
        directory, copy = output_files(config.effective_output_filename, cwd)
        return OutputRouter(OutputOptions(
            tag=config.effective_tag_output, timestamp=config.effective_timestamp_output,
            only_instance=config.only_output_from_instance, directory=directory,
            copy_to_console=copy, colour_environ=environ, fold=wants_fold(config, environ)),
            stdout_fd, stderr_fd)

    def set_plan(self, launch_plan: LaunchPlan) -> None:
        self.plan = launch_plan
        self.events.planned(tuple(inst.host for inst in launch_plan.instances))

    @property
    def stop_reason(self) -> str:
        """Why the job is ending early, if it is (result.end_reason's precedence): "success"
        while nothing has stopped it."""
        return end_reason(output_error=self.output_error, stop_signal=self.stop_signal,
                          stall=self.stall, root_cause=self.root_cause)

    async def start(self, lifeline: Lifeline, on_finished=None, remote=None,
                    kvsname: str | None = None, pmix=None) -> None:
        """Start this host's instances; with `remote` spawners (by host), `spawn_remote()`
        starts theirs. `on_finished` is called once every instance has exited (or was lost)
        and its output has been delivered. `kvsname`: the name of the instances' MPI world
        (run/worlds/pmi1.py); `pmix`: this host's PMIx service
        (spawner.worlds.pmixhost), where Open MPI's world is served too."""
        self.on_finished, self.remote = on_finished, remote or {}
        self.local = LocalSpawner(self, self.loop, lifeline)
        if kvsname:
            from poprun.run.worlds.pmi1 import MpiWorld

            here = [inst.host for inst in self.plan.instances if inst.host not in self.remote]
            if here:  # this host's worlds, served as every agent serves its host's
                from poprun.run.worlds.hostlink import HostLink

                self.host_link = HostLink(here[0], self.loop, lifeline, pmix)
            self.world = MpiWorld(kvsname, [inst.host for inst in self.plan.instances],
                                  self.loop, remote=self.remote, here=self.host_link,
                                  on_abort=self.on_mpi_abort, on_lost=self.on_mpi_lost,
                                  on_server_lost=self.on_world_server_lost, pmix=pmix,
                                  argv=self.plan.instances[0].argv, log=self.log)
            self.world.on_spawn = self._spawn_children
            count = len({inst.host for inst in self.plan.instances})
            hosts = f" on {count} hosts" if count > 1 else ""
            self.log.info(f"MPI world: PMI-1 for {len(self.plan.instances)} instance(s)"
                          f"{hosts}, kvsname {kvsname}")
            await self.world.ready()
            self._pmix_here = self.world.served_here
            if pmix is not None:
                self.log.info(f"MPI world: PMIx for Open MPI, namespace {kvsname}, served "
                              f"by {pmix.version or 'libpmix'} ({pmix.path})")
        self._spawn_local()
        self._all_started = not self.remote
        self._maybe_finish()

    @property
    def finished(self) -> bool:
        """Every instance has ended, and every process they spawned (as mpiexec waits)."""
        return (self._all_started and len(self.done) == len(self.started)
                and not (self.spawned and self.spawned.alive()))

    def close(self, keep_output: bool = False) -> None:
        """Kill and reap what still runs here, stop timers, close the output files (not when
        `keep_output`: the next attempt of a restarted job writes on)."""
        if self._kill_timer:
            self._kill_timer.cancel()
        try:
            if self.local:
                self.local.close()
        finally:
            if not keep_output:
                self.router.close()

    def _spawn_local(self) -> None:
        merge = self.config.effective_merge_stderr
        here = [inst for inst in self.plan.instances if inst.host not in self.remote]
        self.local.reserve(inst.index for inst in here)
        for inst in here:
            env = planning.instance_environ(self.environ, inst, self.plan)
            pmi_end = None
            if self.world is not None:
                world_env, pmi_end = self.world.attach(inst.index, env)
                env.update(world_env)
            spec = ProcessSpec(
                key=inst.index, argv=inst.argv, cwd=self.cwd, merge_stderr=merge, env=env,
                inherit_stdin=inst.index == 0,  # as mpirun: stdin goes to the first instance
                cpus=inst.cpus, mems=inst.mems, container=self.config.container_spec,
                pass_fds=(pmi_end.fileno(),) if pmi_end is not None else ())
            try:
                pid = self.local.spawn(spec)
            except OSError as exc:
                raise LaunchError(f"cannot start instance {inst.index} ({inst.argv[0]}): "
                                  f"{exc.strerror or exc}") from None
            finally:
                if pmi_end is not None:
                    pmi_end.close()  # the instance has its copy
            self._record(inst.index, pid, self.local)
        if self.local.running():
            self.log.info(f"containment: {self.local.containment}")
        if self.local.memory_binding_skipped:
            self.log.warning(f"memory binding skipped: {self.local.memory_binding_skipped}; "
                             "CPU binding is in force")
        if self.config.effective_report_bindings and not self.remote:
            self._report_bindings()

    async def spawn_remote(self) -> None:
        """Start every remote host's instances, all hosts at once. Raises LaunchError when
        any could not start (the session then stops the others)."""
        import asyncio

        from spawner.protocol import SpawnRequest
        from spawner.remote import RemoteSpawnError

        merge = self.config.effective_merge_stderr
        hosts = list(self.remote)
        self._spawning_remote = True
        world = self.world
        if world is not None:
            world.open_remote()

        def request(inst: InstancePlan) -> SpawnRequest:
            env = inst.env if world is None else {**inst.env, **world.variables(inst.index)}
            return SpawnRequest(key=inst.index, argv=inst.argv, env_set=env,
                                env_unset=self.plan.unset_env, cwd=self.cwd, merge_stderr=merge,
                                cpus=inst.cpus, mems=inst.mems,
                                container=self.config.container_spec,
                                world=world.kvsname if world is not None else None)

        outcomes = await asyncio.gather(*(self.remote[host].spawn_all(
            request(inst) for inst in self.plan.on_host(host)) for host in hosts),
            return_exceptions=True)
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
            self.log.info(f"{host}: {self.remote[host].timings.describe()}; containment: "
                          f"{self.remote[host].containment}")
            if self.remote[host].memory_binding_skipped:
                self.log.warning(f"{host}: memory binding skipped: "
                                 f"{self.remote[host].memory_binding_skipped}; "
                                 "CPU binding is in force")
        self._all_started = True
        if self.config.effective_report_bindings:
            self._report_bindings()
        if self.stop_signal is not None:  # a stop signal came while these were starting
            self._log_stopping(self.stop_signal)
            self._stop(_forwarded(self.stop_signal))
        elif self.stop_reason != "success":
            self._signal_all(signal.SIGTERM)  # the job began to stop while these started
        self._maybe_finish()

    def _record(self, key: int, pid: int, spawner) -> None:
        if key in self.started:  # its exit beat the end of spawn_all (see on_exit)
            return
        # A remote instance started when its STARTED came, which may be well before this
        # (spawn_remote records a host's instances once all of them have started).
        at = getattr(spawner, "started_at", {}).get(key) or time.monotonic()
        # Signalled while its host was still starting (_spawners): poprun stopped it.
        self.started[key] = Started(pid=pid, start=self._wall(at),
                                    signalled=key in self._signalled)
        self._marks["first_started"][key] = at
        self.spawner_of[key] = spawner
        inst = self.plan.instances[key]
        local = spawner is self.local
        self.events.started(key, inst.host, pid, self.loop.time(), local=local,
                            start_ticks=procid.start_ticks(pid) if local
                            else spawner.start_ticks.get(key))
        self.log.debug(f"started instance {key} on {inst.host}, pid {pid}: "
                       f"{' '.join(inst.argv)}")

    def _report_bindings(self) -> None:
        """mpirun's --report-bindings, from what the kernel says of each live instance: read
        here from /proc, or by the agent on its host when the instance started."""
        for inst in self.plan.instances:
            if inst.index not in self.started:
                continue
            actual = self._binding_of(inst.index)
            if actual is None:  # already gone: nothing to report
                continue
            cpus, mems, policy = actual
            pid = self.started[inst.index].pid
            self.log.always(f"instance {inst.index} (pid {pid}) on {inst.host}: cpus "
                            f"{format_cpu_list(cpus)}, memory {policy} {format_cpu_list(mems)}")
            for what, planned, got in (("cpus", inst.cpus, cpus),
                                       ("memory nodes", inst.mems, mems)):
                if planned is not None and tuple(planned) != tuple(got):
                    self.log.warning(f"instance {inst.index} runs on {what} "
                                     f"{format_cpu_list(got)}, planned "
                                     f"{format_cpu_list(planned)}")

    def _binding_of(self, key: int) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
        spawner = self.spawner_of[key]
        if spawner is self.local:
            try:
                found = read_binding(self.started[key].pid)
            except OSError:
                return None
            return found.cpus, found.mems, found.mempolicy
        reported = spawner.bindings.get(key)
        if not reported:
            return None
        return tuple(reported["cpus"]), tuple(reported["mems"]), reported["mempolicy"]

    # --- spawner sink -----------------------------------------------------------------

    def _is_spawned(self, key: int) -> bool:
        return self.spawned is not None and key in self.spawned.children

    def on_output(self, key: int, stream: Stream, data: bytes) -> None:
        if self._is_spawned(key):
            self.spawned.on_output(key, stream, data)
            return
        first_output = self._marks["first_output"]
        if key not in first_output:
            first_output[key] = time.monotonic()
        counted = self.router.instances[key]
        before = counted.lines
        self.router.on_output(key, stream, data)
        # The router counts every instance's lines (hidden ones too), mostly for free while
        # tagging: the panel and the record take its count rather than scan the block again.
        self.events.output(key, stream, data, self.loop.time(), counted.lines - before)

    def on_usage(self, key: int, cpu_percent: float | None, rss: int) -> None:
        """A remote agent's sample of an instance's CPU and memory (every STATS_INTERVAL)."""
        from spawner.procstat import Usage  # remote launches only: a local one never samples

        if self._is_spawned(key):  # the views count the instances only
            return
        self.events.usage(key, Usage(cpu_percent, rss))

    def on_progress(self, key: int, step: int, total: int | None) -> None:
        """A remote agent's sample of an instance's popdist.progress()."""
        if self._is_spawned(key):
            return
        self._steps[key] = step
        self.events.stepped(key, step, total, self.loop.time())

    def _highest_step(self) -> int | None:
        """The highest step any instance gave popdist.progress() (the result's
        `highest_step`): the agents' samples and last words, this host's files."""
        local = self.local_progress([k for k in self.started if self.spawner_of.get(k)
                                     is self.local]) if self.local else {}
        steps = [*self._steps.values(), *(step for step, _ in local.values())]
        return max(steps) if steps else None

    def local_progress(self, keys=None) -> dict[int, tuple[int, int | None]]:
        """What the local running instances (or these of them, once exited too) last gave
        popdist.progress() (the watch samples it; the agents send theirs)."""
        if self.local is None:
            return {}
        found = {key: self.local.progress(key) for key in (self.local.running() if keys is None
                                                             else keys)}
        return {key: value for key, value in found.items() if value is not None}

    def report_progress(self, report) -> None:
        """The progress watch's report: every observer hears of it."""
        self.events.progress(report)

    def on_exit(self, key: int, returncode: int) -> None:
        if self._is_spawned(key):
            self.spawned.on_exit(key, returncode)
            self._maybe_finish()
            return
        if key not in self.started:  # a remote instance can exit before spawn_all returns
            spawner = self.remote[self.plan.instances[key].host]
            self._record(key, spawner.pid(key), spawner)
        record = self.started[key]
        record.returncode, record.end = returncode, time.time()
        self.done.add(key)
        self.events.exited(key, returncode, self.loop.time(),
                           self.spawner_of[key].errors.get(key))
        self.log.info(f"instance {key} (pid {record.pid}) exited with {returncode}")
        if self.world is not None and self.spawner_of[key] is self.local:
            self.world.exited(key)
        if returncode != 0 and self.stop_reason == "success":
            self.root_cause = key
            self._stopping(f"instance {key} failed")
            self._stop(signal.SIGTERM)
        elif returncode == 0:
            self._maybe_unfinalized(key)
        self._maybe_finish()

    def on_host_lost(self, host: str, reason: str) -> None:
        """A remote host's agent or connection ended early: its instances are gone with it
        (the agent kills them when it can), so the job stops everywhere."""
        spawner = self.remote.get(host)
        if spawner is None:  # none started there yet: nothing lost, but the host is gone
            self.lost_before_start[host] = reason
            self.log.warning(f"{host}: lost the connection to the host ({reason})")
            return
        lost = sorted(k for k in spawner.unaccounted() if k not in self.done)
        if self.spawned is not None:  # its spawned processes are gone too
            lost = self.spawned.host_lost(lost, reason)
        self.events.host_lost(host, lost, self.loop.time())
        self.log.error(f"{host}: lost the connection to the host ({reason}); "
                       f"{len(lost)} instance(s) there are gone")
        for key in lost:
            if key not in self.started:  # lost before spawn_remote recorded it (as on_exit)
                self._record(key, spawner.pid(key), spawner)
            record = self.started[key]
            record.lost, record.end = reason, time.time()
            self.done.add(key)
        if lost and self.stop_reason == "success":
            self.root_cause = lost[0]
            self._stopping(f"{host} lost")
            self._stop(signal.SIGTERM)
        self._maybe_finish()

    def on_mpi_abort(self, key: int, code: int, message: str) -> None:
        """MPI_Abort: the job ends with this instance as its root cause and the abort's exit
        code. MPICH sends the abort and returns (ch4's MPID_Abort): the aborting instance is
        stopped with the others."""
        self.mpi_aborts.setdefault(key, (code, cut(shown_text(message), MAX_ABORT_MESSAGE)))
        self.log.error(f"instance {key} called MPI_Abort (exit code {code})")
        if self.stop_reason == "success":
            self.root_cause = key
            self._stopping(f"instance {key}: MPI_Abort")
            self._stop(signal.SIGTERM)

    def on_mpi_lost(self, key: int, initialized: bool) -> None:
        """An instance's PMI connection closed before MPI_Finalize (one that never spoke
        PMI does not count). One that ends badly stops the job as any failure does; one that
        exits 0 (`os._exit`, say) would leave the others waiting for it in the world's next
        collective: that stops the job too (`_maybe_unfinalized`)."""
        if initialized:
            self._unfinalized.add(key)
            self.log.info(f"instance {key}: its MPI world connection closed before "
                          "MPI_Finalize")
            self._maybe_unfinalized(key)

    @property
    def world_served_here(self) -> bool:
        """Whether Open MPI's world was served on this host (a PMIx server here)."""
        return self._pmix_here

    def on_world_server_lost(self, host: str, reason: str) -> None:
        """`host`'s PMIx server died while its instances were in the world: the first of
        them still running is the root cause, the server's end its error (spawner/
        pmixhost.py)."""
        running = [inst.index for inst in self.plan.instances
                   if inst.host == host and inst.index in self.started
                   and inst.index not in self.done]
        if not running:  # its instances are gone already: nothing of theirs is lost
            self.log.info(f"{host}: {reason} (its instances had ended)")
            return
        self.log.error(f"{host}: {reason}; the MPI world of its instances cannot go on")
        if self.stop_reason == "success":
            self._server_lost[running[0]] = f"{reason} on {host}"
            self.root_cause = running[0]
            self._stopping(f"{host}: PMIx server lost")
            self._stop(signal.SIGTERM)

    def _maybe_unfinalized(self, key: int) -> None:
        """Its exit (status 0) and its unfinalized world, known in either order."""
        record = self.started.get(key)
        if (key in self._unfinalized and record is not None and record.returncode == 0
                and self.stop_reason == "success" and self.running()):
            self.log.error(f"instance {key} exited with status 0 without MPI_Finalize: its "
                           "MPI world cannot go on")
            self.root_cause = self._no_finalize = key
            self._stopping(f"instance {key}: no MPI_Finalize")
            self._stop(signal.SIGTERM)

    async def _spawn_children(self, rank: int, request) -> dict:
        """Instance `rank`'s MPI_Comm_spawn (run/worlds/spawn.py): the spawn_result fields."""
        if self.spawned is None:
            from poprun.run.worlds.spawn import Spawned

            self.spawned = Spawned(self, self.world.kvsname,
                                   self.world.job_names(), self.world.unserved)
        return await self.spawned.for_world()(rank, request)

    def child_failed(self, origin: int, why: str, returncode: int) -> None:
        """A process instance `origin` spawned failed (`returncode`, as a process's): the job
        stops as for a failed instance, `origin` its root cause, ending with that status."""
        self.log.error(f"instance {origin}: {why}")
        if self.stop_reason == "success":
            self.root_cause = origin
            self._child_failures[origin] = (why, returncode)
            self._stopping(f"instance {origin}: {why}")
            self._stop(signal.SIGTERM)

    async def close_world(self) -> None:
        """The attempt's MPI world ends: its server stops, MPICH's /dev/shm leftovers go."""
        if self.spawned is not None:
            await self.spawned.close()
        if self.world is not None:
            world, self.world = self.world, None
            for path in await world.close():
                self.log.info(f"removed MPICH's leftover {path}")

    def _maybe_finish(self) -> None:
        if self.on_finished and self.finished:
            self.on_finished()

    # --- stopping ---------------------------------------------------------------------

    def _spawners(self) -> list:
        """Every spawner running instances of this job (local, and one per remote host).
        Once spawn requests are out, every remote host's, recorded or not: a stop must reach
        an instance that already runs there (a broken pipe from its first line) while another
        host is still starting, not wait for spawn_remote."""
        spawners = [*self.spawner_of.values(), *(self.remote.values()
                                                 if self._spawning_remote else ())]
        return list({id(s): s for s in spawners}.values())

    def running(self) -> list[int]:
        return [k for s in self._spawners() for k in s.running()]

    @property
    def _starting_remote(self) -> bool:
        """Spawn requests are out and their instances may run, unrecorded (spawn_remote)."""
        return self._spawning_remote and not self._all_started

    def on_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and (self.stop_signal is not None
                                      or self.root_cause is not None):
            self._terminated_while_stopping()
            return
        if self.stop_signal is not None and self._starting_remote:
            self.log.warning(f"{signal.Signals(sig).name} again: stopping now")
            self.on_interrupt()  # the agents' teardown kills whatever they started
            return
        if self.stop_signal is not None or self.root_cause is not None:
            self.log.warning(f"{signal.Signals(sig).name} again: killing every instance now")
            self._stopping(f"{signal.Signals(sig).name} again: SIGKILL")
            self._signal_all(signal.SIGKILL)
            return
        self.stop_signal = sig
        name = signal.Signals(sig).name
        if self._starting_remote:
            # Agents may have forked instances whose STARTED has not come back yet: cancelling
            # now would leave their fate to the agents' teardown and the message would lie.
            # spawn_remote stops them all once it knows them (a second signal cancels).
            self._stopping(name)
            self.log.warning(f"{name} received: stopping once the instances being started "
                             "have started (again: stop now)")
            return
        if not self.started:  # nothing runs yet: do not start anything
            self.log.warning(f"{name} received: stopping before any instance started")
            self.on_interrupt()
            return
        self._stopping(name)
        self._log_stopping(sig)
        self._stop(sig)

    def _terminated_while_stopping(self) -> None:
        """SIGTERM while a stop is under way never shortens its --kill-timeout (a second
        SIGINT or SIGHUP does): a scheduler signals every process of the job, poprun's
        helpers and instances too, so its one SIGTERM may come after an instance's exit
        started the stop, or come twice. It still ends the job: no restart follows."""
        if self.stop_signal is None:
            self.stop_signal = signal.SIGTERM
        self.log.warning("SIGTERM received: the stop under way keeps its --kill-timeout "
                         f"({self.config.kill_timeout:g} s)")

    def _log_stopping(self, sig: int) -> None:
        self.log.warning(f"{signal.Signals(sig).name} received: stopping "
                         f"{len(self.running())} running instance(s)")

    def _broken_pipe(self) -> None:
        if self.stop_signal is None:
            self.stop_signal = signal.SIGPIPE
            self._stopping("SIGPIPE")
            self._stop(_forwarded(signal.SIGPIPE))

    def _write_error(self, where: str, exc: OSError) -> None:
        """Output that cannot be written is not dropped silently: the job stops (exit 74)."""
        if self.output_error is None and self.stop_signal is None:  # the report says it
            self.output_error = f"cannot write {where}: {exc.strerror or exc}"
            self._stopping("output error")
            self._stop(signal.SIGTERM)

    def report_stall(self, stall: dict, ongoing: bool) -> None:
        """The stall watch saw no output for --stall-timeout (`ongoing`: still none once it
        had the stacks): every observer hears of it; --stall-action kill stops the job."""
        self.events.stalled(stall, ongoing)
        if self.config.stall_action == "kill":
            self.stop_stalled(stall)

    def report_unstall(self) -> None:
        self.events.unstalled()

    def stop_stalled(self, stall: dict) -> None:
        """--stall-action kill: stop every instance, the stall being the root cause."""
        if self.stop_reason == "success":
            self.stall = stall
            self._stopping("stalled")
            self._stop(signal.SIGTERM)

    def _stopping(self, reason: str) -> None:
        self.events.stopping(reason, self.loop.time())

    def _stop(self, sig: int) -> None:
        """Signal every instance still running; SIGKILL them all after the one deadline."""
        self._signal_all(sig)
        if self._kill_timer is None:
            self._kill_timer = self.loop.call_later(self.config.kill_timeout, self._signal_all,
                                                    signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for spawner in self._spawners():
            for key in spawner.running():
                spawner.signal(key, sig)
                # An instance started there but not recorded yet (spawn_remote records a
                # host's instances once all have started) is marked when it is recorded.
                self._signalled.add(key)
                if key in self.started:
                    self.started[key].signalled = True

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
                first_output_time=self._wall(self._marks["first_output"].get(i)),
                error=self.spawner_of[i].errors.get(i),
                oom_killed=bool(self.spawner_of[i].oom_kills.get(i)) and not r.signalled)
            for i, r in sorted(self.started.items()))
        instances = tuple(self._as_child_failed(self._as_aborted(inst))
                          for inst in instances)
        root, collateral = self.root_cause, {}  # what rootcause.analyze says of no failure
        if self.root_cause is not None:  # one failed: imported then, off a clean run's path
            from poprun import rootcause

            root, collateral = rootcause.analyze(instances, self.root_cause)
        instances = tuple(replace(inst, collateral=collateral.get(inst.index))
                          for inst in instances)
        reason = end_reason(output_error=self.output_error, stop_signal=self.stop_signal,
                            stall=self.stall, root_cause=root)
        root_status = next((i.exit_status for i in instances if i.index == root), None)
        code = exit_status(reason, self.stop_signal, root_status)
        return LaunchResult(instances=instances, exit_code=code, root_cause=root,
                            stop_signal=self.stop_signal, phases=self._phases(instances),
                            start_time=self.launch_time, output_error=self.output_error,
                            stall=self.stall, highest_step=self._highest_step(),
                            spawned=self.spawned.to_json() if self.spawned else ())

    def _as_aborted(self, inst: InstanceResult) -> InstanceResult:
        """An instance that called MPI_Abort ends with the abort's code and says so (its own
        end was poprun's SIGTERM): its status is the code's low 8 bits, as the MPI launchers
        make it (-3 is 253, never a signal), its report the code as given. One whose exit 0
        without MPI_Finalize stopped the job ends with status 1 (a job that could not
        complete never exits 0)."""
        if inst.index == self._no_finalize and inst.returncode == 0:
            return replace(inst, returncode=1, error=inst.error or {
                "type": "MPI", "message": "exited with status 0 before MPI_Finalize"})
        if inst.index in self._server_lost:
            ended = inst.returncode if inst.returncode and not inst.stopped_by_poprun else 1
            return replace(inst, returncode=ended, error={
                "type": "PMIx", "message": self._server_lost[inst.index]})
        if inst.index not in self.mpi_aborts:
            return inst
        code, message = self.mpi_aborts[inst.index]
        return replace(inst, returncode=code & 0xFF, error=inst.error or {
            "type": "MPI_Abort", "message": f"exit code {code}" + (
                f": {message}" if message and message != "abort" else "")})

    def _as_child_failed(self, inst: InstanceResult) -> InstanceResult:
        """An instance whose spawned process failed first ends with that process's status
        and says so (its own end was poprun's SIGTERM, or came later)."""
        if inst.index not in self._child_failures:
            return inst
        why, returncode = self._child_failures[inst.index]
        return replace(inst, returncode=returncode, stopped_by_poprun=False,
                       error=inst.error or {"type": "MPI_Comm_spawn", "message": why})

    def _wall(self, mono: float | None) -> float | None:
        """time.time() of a time.monotonic() instant of this job."""
        return None if mono is None else self.launch_time + (mono - self.launch_mono)

    def _phases(self, instances: tuple[InstanceResult, ...]) -> dict[str, dict[str, float]]:
        """Per host: what the fleet measured (remote), plus first start and first output."""
        phases = {host: dict(p) for host, p in self.phases.items()}
        for inst in instances:
            host = phases.setdefault(inst.host, {})
            for name, marks in self._marks.items():
                if inst.index in marks:
                    since = round(marks[inst.index] - self.launch_mono, 6)
                    host[name] = min(host.get(name, since), since)
        return phases


