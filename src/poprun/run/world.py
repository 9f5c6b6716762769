"""The instances' MPI world (issue 24): what mpirun gave the instances of Graphcore's PopRun,
poprun serves itself. MPICH-family programs (the `mpich` wheel under mpi4py, Intel MPI,
MVAPICH) find their world through PMI-1: each instance gets one end of a socket pair
(`PMI_FD`, `PMI_RANK`, `PMI_SIZE`, and the variables Hydra adds) and poprun's server
(spawner/pmi.py) answers its puts, gets and barriers. Ranks are instance indices.

Served for jobs whose instances all run on this host; a job on several hosts gets no PMI
world yet (its agents will serve theirs and forward: spawner/pmi.py's agent mode) and `-v`
says so.

A job that does not use MPI pays for a socket pair per instance and nothing more: the server
(and the import of its module, ~5 ms) starts when an instance first writes to its socket;
until then the launcher's ends are only watched, and an instance that ends without a word is
forgotten.

The kvsname is unique per job and per attempt: MPICH names its shared memory after it, and a
name used again finds the old segment (MPI_Init hangs). What an aborted or killed world
leaves in /dev/shm is removed when the attempt ends, by the lifeline's watchdog when poprun is
killed outright, and by `poprunctl reap` (a host whose watchdog could not run).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from popdist import env as E

from poprun.plan.planner import InstancePlan, LaunchPlan


class MpiWorld:
    """One attempt's world for the plan's instances, all on this host."""

    def __init__(self, kvsname: str, launch_plan: LaunchPlan, loop: asyncio.AbstractEventLoop,
                 *, lifeline, on_abort: Callable[[int, int, str], None],
                 on_lost: Callable[[int, bool], None]) -> None:
        self.kvsname, self.loop, self._lifeline = kvsname, loop, lifeline
        self._plan = launch_plan
        self._on_abort, self._on_lost = on_abort, on_lost
        hosts = [inst.host for inst in launch_plan.instances]
        self._local_size = {host: hosts.count(host) for host in set(hosts)}
        self._hostname = socket.gethostname()
        self._waiting: dict[int, socket.socket] = {}  # rank -> our end, not served yet
        self.server = None  # spawner.pmi.PmiServer, once an instance has spoken

    def attach(self, inst: InstancePlan) -> tuple[dict[str, str], socket.socket]:
        """The instance's end of its PMI socket (to inherit, then close here) and the
        variables that point it there."""
        # Every instance is attached before the loop runs again: the server is not up yet.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        ours.setblocking(False)
        self._waiting[inst.index] = ours
        self.loop.add_reader(ours.fileno(), self._readable, inst.index)
        return {E.PMI_FD: str(theirs.fileno()), E.PMI_RANK: str(inst.index),
                E.PMI_SIZE: str(len(self._plan.instances)), E.PMI_HOSTNAME: self._hostname,
                E.MPI_LOCALRANKID: str(inst.local_index),
                E.MPI_LOCALNRANKS: str(self._local_size[inst.host])}, theirs

    def _readable(self, rank: int) -> None:
        """An instance wrote (the world starts) or ended without a word (forgotten)."""
        ours = self._waiting[rank]
        try:
            spoke = ours.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return
        except OSError:
            spoke = False
        if not spoke:
            self.loop.remove_reader(ours.fileno())
            ours.close()
            del self._waiting[rank]
            return
        self._start_server()

    def _start_server(self) -> None:
        from spawner import pmi

        # Before MPICH makes its segment (its MPI_Init speaks PMI first): a poprun killed
        # outright leaves nothing in /dev/shm either (spawner/lifeline.py).
        if self._lifeline is not None:
            self._lifeline.add_mpi_world(self.kvsname)
        instances = self._plan.instances
        hosts = list(dict.fromkeys(inst.host for inst in instances))
        self.server = pmi.PmiServer(
            self.kvsname, len(instances), on_abort=self._on_abort, on_lost=self._on_lost,
            process_mapping=pmi.process_mapping_for_ranks(
                hosts.index(inst.host) for inst in instances))
        waiting, self._waiting = self._waiting, {}
        for rank, ours in waiting.items():
            self.loop.remove_reader(ours.fileno())
            ours.setblocking(True)  # asyncio's streams set their own mode
            self.server.adopt(rank, ours)

    async def close(self) -> list[str]:
        """Stop serving (every instance has ended by now) and remove what MPICH left in
        /dev/shm; the paths removed. A world nobody spoke to has left nothing."""
        for ours in self._waiting.values():
            self.loop.remove_reader(ours.fileno())
            ours.close()
        self._waiting.clear()
        if self.server is None:
            return []
        await self.server.close()
        from spawner.reaphere import remove_mpich_shm

        removed = [entry["path"] for entry in remove_mpich_shm(self.kvsname) if entry["done"]]
        if self._lifeline is not None:
            self._lifeline.discard_mpi_world(self.kvsname)
        return removed
