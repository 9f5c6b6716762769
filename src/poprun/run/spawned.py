"""The processes the job's instances start with MPI_Comm_spawn[_multiple] (PMI-1's spawn),
started by poprun itself on its own host (docs/architecture.md, "The instances' worlds").

Each spawn is a world of its own, as under Hydra: a new kvsname (`<the job's>-spawn<n>`), its
own root-mode PMI server (spawner/pmi.py) carrying its key-value space and barriers, the
preput keys in it (MPICH puts the parent's port as ``PARENT_ROOT_PORT_NAME``; the children's
MPI_Init connects to it over MPICH's own network module), ``PMI_SPAWNED=1`` in the children's
environment, and the job's names. The children are the job's processes like its instances:
started by the job's spawner (its containment, its lifeline: a killed poprun leaves none),
stopped with the job, their output tagged ``[2,0]`` for the first spawn's rank 0 (Open MPI's
tag for a spawned job: the instances are ``[1,i]``), and a child that fails stops the job as
an instance would, its spawning instance counted as the root cause. The job waits for them
as mpiexec does. Bounds (spawner/pmispawn.py): a spawn storm is refused with rc=1 (an MPI
error), never started.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket

from popdist import env as E
from spawner import pmispawn
from spawner.local import ProcessSpec, Stream
from spawner.pmi import PmiError, PmiServer, process_mapping_for_ranks


class Child:
    """One spawned process: its tag, the instance whose spawn (or whose child's) made it."""

    __slots__ = ("label", "origin", "pid", "kvsname", "returncode")

    def __init__(self, label: str, origin: int, pid: int, kvsname: str) -> None:
        self.label, self.origin, self.pid, self.kvsname = label, origin, pid, kvsname
        self.returncode: int | None = None


class Spawned:
    """The job's spawned processes and their worlds, on this host. `job`: run/job.Job (its
    spawner, environment, log, router, and its stop policy: `child_failed`)."""

    # Keys of spawned processes in the job's spawner: after any instance index.
    KEY_BASE = 1 << 24

    def __init__(self, job, kvsname: str, lifeline, names, unserved) -> None:
        self._job, self._kvsname, self._lifeline = job, kvsname, lifeline
        self._names, self._unserved = names, unserved
        self._keys = itertools.count(self.KEY_BASE)
        self._worlds: list[PmiServer] = []
        self.children: dict[int, Child] = {}  # spawner key -> the child

    def alive(self) -> list[int]:
        return [k for k, c in self.children.items() if c.returncode is None]

    def for_world(self, origin: int | None = None):
        """The on_spawn of a world's server: the instances' (`origin` None: the spawning
        rank is the instance) or a spawned world's (its processes' instance)."""
        async def on_spawn(rank: int, request: pmispawn.SpawnRequest) -> dict:
            return self.spawn(rank if origin is None else origin, request)
        return on_spawn

    def spawn(self, origin: int, request: pmispawn.SpawnRequest) -> dict:
        """Start `request` for instance `origin`; the spawn_result fields."""
        log = self._job.log
        try:
            if self._job.stop_reason != "success":  # its stop would miss them
                raise PmiError(f"spawn refused: the job is stopping ({self._job.stop_reason})")
            if all(inst.host in self._job.remote for inst in self._job.plan.instances):
                raise PmiError("spawn: poprun's host runs none of the job's instances, and "
                               "spawned processes start only there so far")
            placed, ignored = pmispawn.place(request, self._here(), self._job_hosts())
            if len(self.alive()) + len(placed) > pmispawn.SPAWNED_MAX:
                raise PmiError(f"spawn of {len(placed)} refused: the job has "
                               f"{len(self.alive())} spawned processes alive, at most "
                               f"{pmispawn.SPAWNED_MAX} taken")
            for process in placed:
                if process.wdir and not os.path.isdir(os.path.join(self._job.cwd,
                                                                   process.wdir)):
                    raise PmiError(f"spawn: wdir {process.wdir}: no such directory")
            number = len(self._worlds) + 2  # the tag's job number: the instances are 1
            server = self._world(origin, number, placed, request.preput)
        except PmiError as exc:
            return pmispawn.spawn_reply(1, msg=str(exc))
        for key in sorted(set(ignored)):
            log.info(f"instance {origin}: spawn info key {key!r} ignored (poprun acts on "
                     f"{', '.join(pmispawn.INFO_KEYS)})")
        try:
            pids = self._start(origin, number, server, placed)
        except OSError as exc:
            return pmispawn.spawn_reply(1, msg=f"cannot start {placed[0].argv[0]}: "
                                        f"{exc.strerror or exc}")
        log.info(f"instance {origin}: spawned {len(placed)} process(es) in world "
                 f"{server.kvsname}, tagged [{number},*] (pids {', '.join(map(str, pids))})")
        return pmispawn.spawn_reply(0, len(placed))

    def _world(self, origin: int, number: int, placed: list[pmispawn.Placed],
               preput: dict[str, str]) -> PmiServer:
        kvsname = f"{self._kvsname}-spawn{number - 1}"
        server = PmiServer(
            kvsname, len(placed), process_mapping=process_mapping_for_ranks([0] * len(placed)),
            appnums={p.rank: p.appnum for p in placed}, names=self._names,
            on_spawn=self.for_world(origin),
            on_unserved=lambda rank, cmd, why: self._unserved(
                origin, cmd, f"(from its spawned process [{number},{rank}]) {why}"),
            on_abort=lambda rank, code, message: self._job.child_failed(
                origin, f"its spawned process [{number},{rank}] called MPI_Abort ({code})",
                code & 0xFF))
        for key, value in preput.items():
            err = server.kvs.check(key, value)
            if err:
                raise PmiError(f"spawn: preput key {key[:64]!r}: {err}")
        server.kvs.update(preput)
        if self._lifeline is not None:  # MPICH's segments of it go with the job
            self._lifeline.add_mpi_world(kvsname)
        self._worlds.append(server)
        return server

    def _start(self, origin: int, number: int, server: PmiServer,
               placed: list[pmispawn.Placed]) -> list[int]:
        job, pids = self._job, []
        keys = [next(self._keys) for _ in placed]
        job.local.reserve(keys)
        for key, process in zip(keys, placed):
            theirs = server.attach(process.rank)
            env = {**job.environ, E.PMI_FD: str(theirs.fileno()),
                   E.PMI_RANK: str(process.rank), E.PMI_SIZE: str(server.size),
                   E.PMI_SPAWNED: "1", E.PMI_HOSTNAME: socket.gethostname(),
                   E.MPI_LOCALRANKID: str(process.rank), E.MPI_LOCALNRANKS: str(server.size)}
            spec = ProcessSpec(key=key, argv=process.argv, env=env,
                               cwd=os.path.join(job.cwd, process.wdir or ""),
                               merge_stderr=job.config.effective_merge_stderr,
                               pass_fds=(theirs.fileno(),))
            try:
                pid = job.local.spawn(spec)
            except OSError:
                for started in keys[:len(pids)]:  # they would wait for it in MPI_Init
                    job.local.signal(started, signal.SIGKILL)
                raise
            finally:
                theirs.close()
            pids.append(pid)
            self.children[key] = Child(f"{number},{process.rank}", origin, pid,
                                       server.kvsname)
        return pids

    def _here(self) -> set[str]:
        names = {"localhost", socket.gethostname(), socket.getfqdn()}
        return names | {inst.host for inst in self._job.plan.instances
                        if inst.host not in self._job.remote}

    def _job_hosts(self) -> set[str]:
        return {inst.host for inst in self._job.plan.instances}

    # --- the job's spawner's sink, for the spawned processes ---------------------------

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
        self._job.log.info(f"spawned process [{child.label}] (pid {child.pid}) exited with "
                           f"{returncode}")
        if returncode != 0:
            self._job.child_failed(child.origin, f"its spawned process [{child.label}] "
                                   f"exited with {returncode}", returncode)

    def to_json(self) -> tuple[dict, ...]:
        """The spawned processes, for the job's result (`--result-json`'s `spawned`)."""
        return tuple({"tag": c.label, "spawned_by": c.origin, "pid": c.pid,
                      "exit_status": (None if c.returncode is None else c.returncode
                                      if c.returncode >= 0 else 128 - c.returncode),
                      "kvsname": c.kvsname} for c in self.children.values())

    async def close(self) -> None:
        """Stop serving the spawned worlds (their processes are gone) and remove what MPICH
        left of them here."""
        from spawner.reaphere import remove_mpich_shm

        for server in self._worlds:
            await server.close()
            remove_mpich_shm(server.kvsname)
            if self._lifeline is not None:
                self._lifeline.discard_mpi_world(server.kvsname)
        self._worlds.clear()
