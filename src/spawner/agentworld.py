"""One MPI world's instances on an agent's host: served here, joined to the job's world
through the launcher (docs/architecture.md, "The instances' worlds").

The launcher's WORLD frame says which of its ranks run here. Each gets a PMI socket (its end
watched until it speaks: spawner/pmiends.py); then an agent-mode PmiServer (spawner/pmi.py)
answers them, and goes to the launcher only where the world is bigger than this host: ONE
BARRIER_IN per barrier for all of this host's instances (with their puts), answered by
BARRIER_OUT with every put of that epoch; a GET for a key this host has not seen; an
instance's MPI_ABORT or a connection closed before MPI_Finalize (MPI_LOST), for the job to act
on. What MPICH leaves in /dev/shm is removed when the launcher ends the world (WORLD_END), when
the agent ends, and by its lifeline's watchdog when the agent is killed outright.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import Callable
from typing import Any

from popdist.env import PMI_FD, PMI_HOSTNAME

from .pmiends import PmiEnds
from .protocol import Kind, encode


class AgentWorld:
    """The world named in a WORLD frame, for the instances of it that run here."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fields: dict[str, Any],
                 send: Callable[[bytes], None], lifeline) -> None:
        self.kvsname = str(fields["kvsname"])
        self.size = int(fields["size"])
        self._nodes = [int(n) for n in fields["nodes"]]  # each rank's host, in host order
        self.ranks = [int(r) for r in fields["ranks"]]
        if len(self._nodes) != self.size or not all(0 <= r < self.size for r in self.ranks):
            raise ValueError("WORLD: ranks and nodes do not fit its size")
        self._send, self._lifeline = send, lifeline
        self._ends = PmiEnds(loop, self._start)
        self.server = None  # spawner.pmi.PmiServer, once an instance here has spoken
        self._barrier: asyncio.Future | None = None
        self._gets: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    def attach(self, rank: int) -> tuple[dict[str, str], socket.socket]:
        """The instance's end of its PMI socket (to inherit, then close here) and the
        variables the launcher could not give it (the descriptor, this host's name)."""
        theirs = self.server.attach(rank) if self.server else self._ends.attach(rank)
        return {PMI_FD: str(theirs.fileno()), PMI_HOSTNAME: os.uname().nodename}, theirs

    def _start(self) -> None:
        from .pmi import PmiServer, process_mapping_for_ranks

        if self._lifeline is not None:  # before MPICH makes its segment (spawner/lifeline.py)
            self._lifeline.add_mpi_world(self.kvsname)
        self.server = PmiServer(self.kvsname, self.size, local_ranks=self.ranks,
                                process_mapping=process_mapping_for_ranks(self._nodes),
                                upstream=self, on_abort=self._aborted, on_lost=self._lost)
        for rank, ours in self._ends.hand_over().items():
            self.server.adopt(rank, ours)

    # --- the launcher, as the agent-mode server's upstream (spawner.pmi.Upstream) -------

    async def barrier(self, count: int, puts: dict[str, str]) -> dict[str, str]:
        self._barrier = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.BARRIER_IN, kvsname=self.kvsname, count=count, puts=puts))
        return await self._barrier

    async def get(self, key: str) -> str | None:
        ask = next(self._ids)
        future = self._gets[ask] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.GET, kvsname=self.kvsname, id=ask, key=key))
        return await future

    def answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """BARRIER_OUT or VALUE from the launcher."""
        from .pmi import PmiError

        if kind is Kind.BARRIER_OUT:
            future, self._barrier = self._barrier, None
            if future is None or future.done():
                return
            if fields.get("error"):
                future.set_exception(PmiError(fields["error"]))
            else:
                future.set_result(dict(fields["puts"]))
        else:
            future = self._gets.pop(int(fields["id"]), None)
            if future is not None and not future.done():
                future.set_result(fields.get("value"))

    def _aborted(self, rank: int, code: int, message: str) -> None:
        self._send(encode(Kind.MPI_ABORT, kvsname=self.kvsname, key=rank, exitcode=code,
                          message=message))

    def _lost(self, rank: int, initialized: bool) -> None:
        self._send(encode(Kind.MPI_LOST, kvsname=self.kvsname, key=rank,
                          initialized=initialized))

    # --- ending -------------------------------------------------------------------------

    async def close(self) -> None:
        """The world ends (its instances are gone): stop serving, remove MPICH's leftovers."""
        self._ends.close()
        if self.server is not None:
            await self.server.close()
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        if self.server is None:  # nobody spoke: MPICH made nothing
            return
        from .reaphere import remove_mpich_shm

        remove_mpich_shm(self.kvsname)
        if self._lifeline is not None:
            self._lifeline.discard_mpi_world(self.kvsname)
