"""The processes the job's instances start with MPI_Comm_spawn[_multiple] (PMI-1's spawn),
started by poprun itself on the job's hosts (docs/architecture.md, "The instances' worlds").

Each spawn is a world of its own, as under Hydra: a new kvsname (`<the job's>-spawn<n>`),
served as the instances' world is (run/worlds/pmi1.MpiWorld: its root here, an agent serving the
ranks on each other host), the preput keys in it (MPICH puts the parent's port as
``PARENT_ROOT_PORT_NAME``; the children's MPI_Init connects to it over MPICH's own network
module), ``PMI_SPAWNED=1`` in the children's environment, and the job's names. Where they
run is pure planning (spawner/worlds/pmi1spawn.place): the `host` info key, else Hydra's
way over the job's hosts. The children are the job's processes like its instances: started
by the job's spawners (this host's, or the agent of theirs: its containment, its lifeline: a killed
poprun leaves none), stopped with the job, their output tagged ``[2,0]`` for the first
spawn's rank 0 (Open MPI's tag for a spawned job: the instances are ``[1,i]``), and a child
that fails stops the job as an instance would, its spawning instance counted as the root
cause. The job waits for them as mpiexec does. Bounds (spawner/worlds/pmi1spawn.py): a spawn storm
is refused with rc=1 (an MPI error), never started.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import stat

from poprun.errors import LaunchError
from poprun.run.worlds.pmi1 import MpiWorld
from spawner.worlds import pmi1spawn
from spawner.local import ProcessSpec, Stream
from spawner.worlds.pmi1 import KeyValueSpace, PmiError


def read_hostfile(where: str, path: str) -> str:
    """The text of the hostfile an instance's spawn names (`path`, at `where`): a regular
    file of at most HOSTFILE_MAX_BYTES, else PmiError. Opened without blocking and checked
    before a byte is read: a FIFO, a terminal or a device named there cannot hold up the
    launcher's event loop (an instance's word: docs/architecture.md, "What arrives is
    hostile input")."""
    shown = path[:200]
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise PmiError(f"spawn: hostfile {shown}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PmiError(f"spawn: hostfile {shown}: not a regular file")
        text = os.read(fd, pmi1spawn.HOSTFILE_MAX_BYTES + 1)
    except OSError as exc:
        raise PmiError(f"spawn: hostfile {shown}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(text) > pmi1spawn.HOSTFILE_MAX_BYTES:
        raise PmiError(f"spawn: hostfile {shown}: too long")
    return text.decode("utf-8", "replace")


class Child:
    """One spawned process: its tag, the instance whose spawn (or whose child's) made it,
    its host (the job's name for it)."""

    __slots__ = ("label", "origin", "pid", "kvsname", "host", "returncode", "abandoned")

    def __init__(self, label: str, origin: int, kvsname: str, host: str) -> None:
        self.label, self.origin, self.kvsname, self.host = label, origin, kvsname, host
        self.pid: int | None = None  # until it has started
        self.returncode: int | None = None
        self.abandoned = False  # killed because its spawn could not start whole


class Spawned:
    """The job's spawned processes and their worlds. `job`: run/job.Job (its spawners,
    environment, log, router, and its stop policy: `child_failed`)."""

    # Keys of spawned processes in the job's spawners: after any instance index.
    KEY_BASE = 1 << 24

    def __init__(self, job, kvsname: str, names, unserved) -> None:
        self._job, self._kvsname = job, kvsname
        self._names, self._unserved = names, unserved
        self._keys = itertools.count(self.KEY_BASE)
        self._worlds: list[MpiWorld] = []
        self.children: dict[int, Child] = {}  # spawner key -> the child

    def alive(self) -> list[int]:
        return [k for k, c in self.children.items() if c.returncode is None]

    def for_world(self, origin: int | None = None):
        """The on_spawn of a world's server: the instances' (`origin` None: the spawning
        rank is the instance) or a spawned world's (its processes' instance)."""
        async def on_spawn(rank: int, request: pmi1spawn.SpawnRequest) -> dict:
            return await self.spawn(rank if origin is None else origin, request)
        return on_spawn

    async def spawn(self, origin: int, request: pmi1spawn.SpawnRequest) -> dict:
        """Start `request` for instance `origin`; the spawn_result fields."""
        log = self._job.log
        try:
            if self._job.stop_reason != "success":  # its stop would miss them
                raise PmiError(f"spawn refused: the job is stopping ({self._job.stop_reason})")
            self._read_hostfiles(request)
            placed, ignored = pmi1spawn.place(request, self._slots(), self._resolve)
            if len(self.alive()) + len(placed) > pmi1spawn.SPAWNED_MAX:
                raise PmiError(f"spawn of {len(placed)} refused: the job has "
                               f"{len(self.alive())} spawned processes alive, at most "
                               f"{pmi1spawn.SPAWNED_MAX} taken")
            self._check(placed, request.preput)
            number = len(self._worlds) + 2  # the tag's job number: the instances are 1
            world = self._world(origin, number, placed, request)
            await world.ready()
        except PmiError as exc:
            return pmi1spawn.spawn_reply(1, msg=str(exc))
        except LaunchError as exc:  # its PMIx namespace could not be registered here
            return pmi1spawn.spawn_reply(1, msg=f"spawn: {exc}")
        for key in sorted(set(ignored)):
            log.info(f"instance {origin}: spawn info key {key!r} ignored (poprun acts on "
                     f"{', '.join(pmi1spawn.INFO_KEYS)})")
        try:
            keys = await self._start(origin, number, world, placed)
        except PmiError as exc:
            return pmi1spawn.spawn_reply(1, msg=str(exc))
        hosts = ", ".join(dict.fromkeys(p.host for p in placed))
        log.info(f"instance {origin}: spawned {len(placed)} process(es) in world "
                 f"{world.kvsname} on {hosts}, tagged [{number},*] (pids "
                 f"{', '.join(str(self.children[k].pid) for k in keys)})")
        reply = pmi1spawn.spawn_reply(0, len(placed))
        if request.pmix:  # Open MPI's answer names the children's namespace
            reply["world"] = world.kvsname
        return reply

    def _read_hostfiles(self, request: pmi1spawn.SpawnRequest) -> None:
        """Open MPI's `hostfile` info key, read (here, bounded) into the `host` it means."""
        for command in request.commands:
            path = command.info.get("hostfile")
            if path and not command.info.get("host"):
                command.info["host"] = pmi1spawn.hostfile_hosts(
                    read_hostfile(os.path.join(self._job.cwd, path), path))

    def _check(self, placed: list[pmi1spawn.Placed], preput: dict[str, str]) -> None:
        """What can be refused before anything starts: a preput key MPICH's client could not
        have sent, a working directory missing here (another host's is its agent's to say)."""
        for key, value in preput.items():
            err = KeyValueSpace().check(key, value)
            if err:
                raise PmiError(f"spawn: preput key {key[:64]!r}: {err}")
        for process in placed:
            if (process.wdir and process.host not in self._job.remote
                    and not os.path.isdir(os.path.join(self._job.cwd, process.wdir))):
                raise PmiError(f"spawn: wdir {process.wdir}: no such directory")

    def _world(self, origin: int, number: int, placed: list[pmi1spawn.Placed],
               request: pmi1spawn.SpawnRequest) -> MpiWorld:
        """The spawn's world: PMI-1's, and for Open MPI's spawn a PMIx namespace too, on
        the server of the parents' namespace on each host (`ready()` registers it)."""
        job = self._job
        hosts = [p.host for p in placed]
        parents = job.world.pmix if request.pmix and job.world is not None else None
        world = MpiWorld(
            f"{self._kvsname}-spawn{number - 1}", hosts, job.loop,
            # Open MPI's: its parents' hosts too, whose servers then hold its namespace
            remote=job.remote, here=job.host_link, log=job.log, names=self._names,
            appnums={p.rank: p.appnum for p in placed},
            spawned=True, pmix=parents.service if parents is not None else None,
            pmix_beside=parents,
            on_unserved=lambda rank, cmd, why: self._unserved(
                origin, cmd, f"(from its spawned process [{number},{rank}]) {why}"),
            on_abort=lambda rank, code, message: job.child_failed(
                origin, f"its spawned process [{number},{rank}] called MPI_Abort ({code})",
                code & 0xFF),
            on_lost=lambda rank, initialized: job.log.info(
                f"spawned process [{number},{rank}]: its MPI world connection closed"
                + (" before MPI_Finalize" if initialized else "")))
        world.on_spawn = self.for_world(origin)
        world.start()
        world.root.kvs.update(request.preput)
        world.open_remote()
        self._worlds.append(world)
        return world

    async def _start(self, origin: int, number: int, world: MpiWorld,
                     placed: list[pmi1spawn.Placed]) -> list[int]:
        """Start every process of the spawn, this host's and the agents' at once; the keys.
        One that cannot start fails the spawn (PmiError): the others are killed, as they
        would wait for it in MPI_Init."""
        keys = [next(self._keys) for _ in placed]
        mine: list[tuple[int, pmi1spawn.Placed]] = []
        theirs: dict[str, list[tuple[int, pmi1spawn.Placed]]] = {}
        for key, process in zip(keys, placed):
            self.children[key] = Child(f"{number},{process.rank}", origin, world.kvsname,
                                       process.host)
            (theirs.setdefault(process.host, []) if process.host in self._job.remote
             else mine).append((key, process))
        try:
            outcomes = await asyncio.gather(self._start_here(world, mine), *(
                self._start_there(world, host, started) for host, started in theirs.items()),
                return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except Exception as exc:
            self._abandon(keys)
            if isinstance(exc, PmiError):
                raise
            raise PmiError(f"cannot start {placed[0].argv[0]}: "
                           f"{getattr(exc, 'strerror', None) or exc}") from None
        if self._job.stop_reason != "success":  # it began to stop while these started
            self._abandon(keys)
            raise PmiError(f"spawn refused: the job is stopping ({self._job.stop_reason})")
        return keys

    async def _start_here(self, world: MpiWorld,
                          mine: list[tuple[int, pmi1spawn.Placed]]) -> None:
        """On this host, all at once (LocalSpawner.spawn_many: not one start waiting for
        the one before)."""
        job = self._job
        job.local.reserve(key for key, _ in mine)
        specs, ends = [], []
        try:
            for key, process in mine:
                environ = {**job.environ, **process.env}
                env, pmi_end = world.attach(process.rank, environ)
                ends.append(pmi_end)
                specs.append(ProcessSpec(key=key, argv=process.argv, env={**environ, **env},
                                         cwd=os.path.join(job.cwd, process.wdir or ""),
                                         merge_stderr=job.config.effective_merge_stderr,
                                         pass_fds=(pmi_end.fileno(),)))
            outcomes = await job.local.spawn_many(specs)
        finally:
            for pmi_end in ends:  # the children have their copies
                pmi_end.close()
        for (key, _), outcome in zip(mine, outcomes):
            if not isinstance(outcome, OSError):
                self.children[key].pid = outcome
        for outcome in outcomes:
            if isinstance(outcome, OSError):
                raise outcome

    async def _start_there(self, world: MpiWorld, host: str,
                           started: list[tuple[int, pmi1spawn.Placed]]) -> None:
        """Through `host`'s agent, as the instances there: the environment every instance
        of the job is given over the agent's (less what the plan unsets), and the world's."""
        from spawner.protocol import SpawnRequest
        from spawner.remote import RemoteSpawnError

        job = self._job
        spawner = job.remote[host]
        requests = [SpawnRequest(
            key=key, argv=tuple(process.argv), env_set={
                **self._common_env(), **process.env, **world.variables(process.rank)},
            env_unset=job.plan.unset_env, cwd=os.path.join(job.cwd, process.wdir or ""),
            merge_stderr=job.config.effective_merge_stderr, world=world.kvsname,
            rank=process.rank) for key, process in started]
        pids: dict[int, int] = {}
        try:
            pids = await spawner.spawn_all(requests)
        except RemoteSpawnError as exc:
            pids = exc.started
            raise PmiError(f"cannot start {started[0][1].argv[0]} on {host}: " + "; ".join(
                sorted(set(exc.failures.values())))[:300]) from None
        finally:
            for key, pid in pids.items():
                self.children[key].pid = pid

    def _common_env(self) -> dict[str, str]:
        """The variables every instance of the job is given (each instance's own, such as
        its index, left out): what a spawned process on an agent's host gets over its
        environment, as one here gets poprun's."""
        envs = [inst.env for inst in self._job.plan.instances]
        return {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}

    def _abandon(self, keys: list[int]) -> None:
        """A spawn that could not start whole: its started processes are killed (not a
        failure of the job: MPI_Comm_spawn fails instead), the others forgotten."""
        for key in keys:
            child = self.children[key]
            if child.pid is None:
                del self.children[key]
                continue
            child.abandoned = True
            spawner = self._job.local if child.host not in self._job.remote else \
                self._job.remote[child.host]
            spawner.signal(key, signal.SIGKILL)

    def _slots(self) -> list[tuple[str, int]]:
        """The job's hosts in order, each with its count of instances."""
        hosts = [inst.host for inst in self._job.plan.instances]
        return [(host, hosts.count(host)) for host in dict.fromkeys(hosts)]

    def _resolve(self, name: str) -> str | None:
        """The job's name for the host a `host` info key names: one of the job's hosts as
        given, poprun's own host by any of its names (where it runs instances), or an
        agent's host by the name it reports (where only one does)."""
        job_hosts = dict.fromkeys(inst.host for inst in self._job.plan.instances)
        if name in job_hosts:
            return name
        remote = self._job.remote
        here = [h for h in job_hosts if h not in remote]
        if here and name in ("localhost", socket.gethostname(), socket.getfqdn()):
            return here[0]
        reported = [h for h in job_hosts if h in remote and getattr(
            getattr(remote[h], "info", None), "hostname", None) == name]
        return reported[0] if len(reported) == 1 else None

    # --- the job's spawners' sink, for the spawned processes ---------------------------

    def on_output(self, key: int, stream: Stream, data: bytes) -> None:
        router = self._job.router
        label = self.children[key].label
        if router.fold is None:
            router.on_output(label, stream, data)
        else:  # folding is for the instances' lines
            router.console(label, stream, data)

    def on_exit(self, key: int, returncode: int) -> None:
        child = self.children[key]
        child.returncode = returncode
        if child.pid is None:  # its exit came before its spawner's answer (_start_there)
            remote = self._job.remote.get(child.host)
            child.pid = remote.pid(key) if remote is not None else None
        self._job.log.info(f"spawned process [{child.label}] (pid {child.pid}) on "
                           f"{child.host} exited with {returncode}")
        if returncode != 0 and not child.abandoned:
            self._job.child_failed(child.origin, f"its spawned process [{child.label}] "
                                   f"exited with {returncode}", returncode)

    def host_lost(self, keys: list[int], why: str) -> list[int]:
        """A host was lost with these of the job's keys on it: its spawned processes among
        them are gone (status 255, as ssh's), the instances' keys returned. Where no
        instance went with it, the first child lost stops the job as a failed one would."""
        gone = [self.children[k] for k in keys if k in self.children
                and self.children[k].returncode is None]
        for child in gone:
            child.returncode = 255
            self._job.log.info(f"spawned process [{child.label}] on {child.host} is gone "
                               f"with its host ({why})")
        instances = [key for key in keys if key not in self.children]
        if gone and not instances:
            self._job.child_failed(gone[0].origin, f"its spawned process [{gone[0].label}] "
                                   f"is gone with {gone[0].host} ({why})", 255)
        return instances

    def to_json(self) -> tuple[dict, ...]:
        """The spawned processes, for the job's result (`--result-json`'s `spawned`)."""
        return tuple({"tag": c.label, "spawned_by": c.origin, "host": c.host, "pid": c.pid,
                      "exit_status": (None if c.returncode is None else c.returncode
                                      if c.returncode >= 0 else 128 - c.returncode),
                      "kvsname": c.kvsname} for c in self.children.values())

    async def close(self) -> None:
        """Stop serving the spawned worlds (their processes are gone) and remove what MPICH
        left of them on every host (the agents, at WORLD_END)."""
        for world in self._worlds:
            await world.close()
        self._worlds.clear()
