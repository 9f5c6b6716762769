"""One MPI world's instances on an agent's host: served here, joined to the job's world
through the launcher (docs/architecture.md, "The instances' worlds").

The launcher's WORLD frame says which of its ranks run here. Each gets a PMI socket (its end
watched until it speaks: spawner/pmiends.py); then an agent-mode PmiServer (spawner/pmi.py)
answers them, and goes to the launcher only where the world is bigger than this host: ONE
BARRIER_IN per barrier for all of this host's instances (with their puts), answered by
BARRIER_OUT with every put of that epoch; a GET for a key this host has not seen; a NAME to
publish, unpublish or look up (the job's names are the launcher's: spawner/pminames.py); a
SPAWN_ASK for an instance's MPI_Comm_spawn (the launcher starts the children, here too: a
spawned world's ranks on this host are served by an AgentWorld of its own, its SPAWNs naming
each child's rank, its WORLD frame their appnums); an
instance's MPI_ABORT or a connection closed before MPI_Finalize (MPI_LOST), for the job to act
on; PMI_UNSERVED, for the launcher's -v line, where a command was answered with an error.
What MPICH leaves in /dev/shm is removed when the launcher ends the world (WORLD_END), when
the agent ends, and by its lifeline's watchdog when the agent is killed outright.

Where the WORLD frame asks for it, Open MPI's world is served here too: this host's PMIx
server (spawner/pmixhost.py) registers the world's namespace before the SPAWNs, each instance
gets its PMIX_* variables, and what crosses hosts goes to the launcher (run/pmixworld.py):
ONE FENCE_IN per fence for this host's instances (answered by FENCE_OUT with every host's
data), MODEX_WANT for a rank on another host (answered by MODEX_DATA), MODEX_GOT answering the
launcher's MODEX_ASK for a rank here. Where no libpmix is found, PMIX_UNSERVED says why.
"""

from __future__ import annotations

import asyncio
import base64
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
                 send: Callable[[bytes], None], lifeline, pmix_host=None) -> None:
        self.kvsname = str(fields["kvsname"])
        self.size = int(fields["size"])
        self._nodes = [int(n) for n in fields["nodes"]]  # each rank's host, in host order
        self.ranks = [int(r) for r in fields["ranks"]]
        if len(self._nodes) != self.size or not all(0 <= r < self.size for r in self.ranks):
            raise ValueError("WORLD: ranks and nodes do not fit its size")
        # MPI_Comm_spawn_multiple's world: each command's processes have its appnum
        self._appnums = {int(r): int(n) for r, n in dict(fields.get("appnums") or {}).items()
                         if int(r) in self.ranks}
        self._send, self._lifeline = send, lifeline
        self._ends = PmiEnds(loop, self._start)
        self.server = None  # spawner.pmi.PmiServer, once an instance here has spoken
        self._barrier: asyncio.Future | None = None
        self._gets: dict[int, asyncio.Future] = {}
        # NAME and SPAWN_ASK frames awaiting their NAMED and SPAWNED_ANSWER
        self._asks: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._pmix = None  # this host's PMIx service, where Open MPI's world is served too
        self.pmix_ns = None  # the world's namespace on it (spawner.pmixserver.Namespace)
        self._fences: dict[Any, Callable[[int, bytes], None]] = {}
        self._wants: dict[int, Callable[[int, bytes], None]] = {}
        if fields.get("pmix") and self.ranks and pmix_host is not None:
            self._open_pmix(dict(fields["pmix"]), pmix_host)

    def _open_pmix(self, pmix: dict[str, Any], pmix_host) -> None:
        from . import pmixplan

        names = [str(n) for n in pmix["names"]]
        hosts = [names[n] for n in self._nodes]
        here = hosts[self.ranks[0]]
        try:
            self._pmix = pmix_host(pmix, here)
            self.pmix_ns = self._pmix.open(pmixplan.world(self.kvsname, hosts, here), self)
        except (LookupError, OSError, RuntimeError) as exc:
            self._pmix = None
            self._send(encode(Kind.PMIX_UNSERVED, kvsname=self.kvsname, error=str(exc)))

    def attach(self, rank: int, environ: dict[str, str] | None = None
               ) -> tuple[dict[str, str], socket.socket]:
        """The instance's end of its PMI socket (to inherit, then close here) and the
        variables the launcher could not give it (the descriptor, this host's name, PMIx's
        where served; what `environ`, the instance's own, sets wins)."""
        theirs = self.server.attach(rank) if self.server else self._ends.attach(rank)
        pmix = (self._pmix.instance_env(self.pmix_ns, rank, environ)
                if self.pmix_ns is not None else {})
        return {PMI_FD: str(theirs.fileno()), PMI_HOSTNAME: os.uname().nodename,
                **pmix}, theirs

    def _start(self) -> None:
        from .pmi import PmiServer, process_mapping_for_ranks

        if self._lifeline is not None:  # before MPICH makes its segment (spawner/lifeline.py)
            self._lifeline.add_mpi_world(self.kvsname)
        self.server = PmiServer(self.kvsname, self.size, local_ranks=self.ranks,
                                process_mapping=process_mapping_for_ranks(self._nodes),
                                upstream=self, on_abort=self._aborted, on_lost=self._lost,
                                on_unserved=self._unserved, on_spawn=self._spawn,
                                appnums=self._appnums)
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

    async def name(self, op: str, service: str, port: str = "") -> tuple[int, str]:
        ask = next(self._ids)
        future = self._asks[ask] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.NAME, kvsname=self.kvsname, id=ask, op=op, service=service,
                          port=port))
        return await future

    async def _spawn(self, rank: int, request) -> dict:
        """An instance here called MPI_Comm_spawn: the launcher starts the children."""
        from .pmispawn import request_json

        ask = next(self._ids)
        future = self._asks[ask] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.SPAWN_ASK, kvsname=self.kvsname, id=ask, key=rank,
                          request=request_json(request)))
        return await future

    def _unserved(self, rank: int, cmd: str, why: str) -> None:
        self._send(encode(Kind.PMI_UNSERVED, kvsname=self.kvsname, key=rank, cmd=cmd, why=why))

    # --- this host's PMIx server (spawner.pmixserver.Handler) ---------------------------

    def fence(self, fence, data: bytes, done: Callable[[int, bytes], None]) -> None:
        self._fences[(tuple(fence.ranks), fence.seq)] = done
        self._send(encode(Kind.FENCE_IN, kvsname=self.kvsname, ranks=list(fence.ranks),
                          seq=fence.seq, data=base64.b64encode(data).decode()))

    def direct_modex(self, rank: int, done: Callable[[int, bytes], None]) -> None:
        want = next(self._ids)
        self._wants[want] = done
        self._send(encode(Kind.MODEX_WANT, kvsname=self.kvsname, id=want, rank=rank))

    def abort(self, rank: int, status: int, message: str) -> None:
        from . import pmixplan

        self._aborted(rank, status, pmixplan.abort_message(message))

    def exited(self, rank: int) -> None:
        """An instance here exited: had it joined Open MPI's world and not left it properly?"""
        if self.pmix_ns is not None and self.pmix_ns.unfinalized(rank):
            self.pmix_ns.finalized.add(rank)  # said once
            self._lost(rank, True)

    def _pmix_answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """FENCE_OUT, MODEX_DATA, MODEX_ASK from the launcher. Their data is decoded as the
        launcher decodes the agents' (pmixplan.decode_data: strict, bounded); data that
        cannot be is an error answered to the local server, never a fault of the agent."""
        from .pmixplan import MAX_FENCE_DATA, MAX_MODEX

        if kind is Kind.FENCE_OUT:
            done = self._fences.pop((tuple(int(r) for r in fields["ranks"]),
                                     int(fields["seq"])), None)
            if done is not None:  # every host's part: at most MAX_FENCE_DATA each
                status, data = _decoded(fields, MAX_FENCE_DATA * len(set(self._nodes)))
                done(-1 if fields.get("error") else status, data)
        elif kind is Kind.MODEX_DATA:
            done = self._wants.pop(int(fields["id"]), None)
            if done is not None:
                status, data = _decoded(fields, MAX_MODEX)
                done(int(fields["status"]) if status == 0 else status, data)
        elif self._pmix is not None and self._pmix.server is not None:  # MODEX_ASK
            ask = fields["id"]
            self._pmix.server.dmodex_request(
                self.kvsname, int(fields["rank"]),
                lambda status, blob: self._send(encode(
                    Kind.MODEX_GOT, kvsname=self.kvsname, id=ask, status=status,
                    data=base64.b64encode(blob).decode())))

    def answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """BARRIER_OUT or VALUE from the launcher (or PMIx's answers)."""
        from .pmi import PmiError

        if kind in (Kind.FENCE_OUT, Kind.MODEX_DATA, Kind.MODEX_ASK):
            self._pmix_answered(kind, fields)
            return
        if kind is Kind.BARRIER_OUT:
            future, self._barrier = self._barrier, None
            if future is None or future.done():
                return
            if fields.get("error"):
                future.set_exception(PmiError(fields["error"]))
            else:
                future.set_result(dict(fields["puts"]))
        elif kind is Kind.NAMED:
            future = self._asks.pop(int(fields["id"]), None)
            if future is not None and not future.done():
                future.set_result((int(fields["rc"]), str(fields.get("value") or "")))
        elif kind is Kind.SPAWNED_ANSWER:
            future = self._asks.pop(int(fields["id"]), None)
            if future is not None and not future.done():
                future.set_result(dict(fields["reply"]))
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
        """The world ends (its instances are gone): stop serving, remove MPICH's leftovers
        and the namespace (with Open MPI's segments)."""
        self._ends.close()
        self._close_pmix()
        if self.server is not None:
            await self.server.close()
        self.remove_leftovers()

    def _close_pmix(self) -> None:
        for done in [*self._fences.values(), *self._wants.values()]:
            done(-1, b"")  # nobody is left to complete them
        self._fences.clear()
        self._wants.clear()
        if self.pmix_ns is not None:
            self._pmix.close_world(self.pmix_ns)
            self.pmix_ns = None

    def remove_leftovers(self) -> None:
        self._close_pmix()
        if self.server is None:  # nobody spoke: MPICH made nothing
            return
        from .reaphere import remove_mpich_shm

        remove_mpich_shm(self.kvsname)
        if self._lifeline is not None:
            self._lifeline.discard_mpi_world(self.kvsname)


def _decoded(fields: dict[str, Any], limit: int) -> tuple[int, bytes]:
    """(0, the data of a launcher's PMIx answer), or (-1, b"") where it cannot be data."""
    from .pmixplan import decode_data

    try:
        return 0, decode_data(fields.get("data") or "", limit)
    except ValueError:
        return -1, b""
