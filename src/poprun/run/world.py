"""The instances' MPI world (issue 24): what mpirun gave the instances of Graphcore's PopRun,
poprun serves itself. MPICH-family programs (the `mpich` wheel under mpi4py, Intel MPI,
MVAPICH) find their world through PMI-1: each instance gets one end of a socket pair
(`PMI_FD`, `PMI_RANK`, `PMI_SIZE`, and the variables Hydra adds) and poprun's server
(spawner/pmi.py) answers its puts, gets and barriers. Ranks are instance indices.

Served for jobs whose instances all run on this host; a job on several hosts gets no PMI
world yet (its agents will serve theirs and forward: spawner/pmi.py's agent mode) and `-v`
says so. A program that does not use MPI never speaks to the server: an idle socket is all
it costs.

The kvsname is unique per job and per attempt: MPICH names its shared memory after it, and a
name used again finds the old segment (MPI_Init hangs). What an aborted or killed world
leaves in /dev/shm is removed when the attempt ends (and by `poprunctl reap`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from popdist import env as E
from spawner import pmi
from spawner.reaphere import remove_mpich_shm

from poprun.plan.planner import InstancePlan, LaunchPlan


class MpiWorld:
    """One attempt's world: a PMI-1 server for the plan's instances, all on this host."""

    def __init__(self, kvsname: str, launch_plan: LaunchPlan, *,
                 on_abort: Callable[[int, int, str], None],
                 on_lost: Callable[[int, bool], None]) -> None:
        self.kvsname = kvsname
        instances = launch_plan.instances
        hosts = list(dict.fromkeys(inst.host for inst in instances))
        self._local_size = {host: sum(1 for i in instances if i.host == host) for host in hosts}
        self.server = pmi.PmiServer(
            kvsname, len(instances), on_abort=on_abort, on_lost=on_lost,
            process_mapping=pmi.process_mapping_for_ranks(
                hosts.index(inst.host) for inst in instances))

    def attach(self, inst: InstancePlan) -> tuple[dict[str, str], socket.socket]:
        """The instance's end of its PMI socket (to inherit, then close here) and the
        variables that point it there."""
        end = self.server.attach(inst.index)
        return {**self.server.env(inst.index, end.fileno()),
                E.PMI_HOSTNAME: socket.gethostname(),
                E.MPI_LOCALRANKID: str(inst.local_index),
                E.MPI_LOCALNRANKS: str(self._local_size[inst.host])}, end

    async def close(self) -> list[str]:
        """Stop serving (every instance has ended by now) and remove what MPICH left in
        /dev/shm; the paths removed."""
        await self.server.close()
        return [entry["path"] for entry in remove_mpich_shm(self.kvsname) if entry["done"]]
