"""One MPI world's instances on an agent's host: served here, joined to the job's world
through the launcher (docs/architecture.md, "The instances' worlds"). The launcher's own host
runs this same code, linked to the world's root in-process (poprun/run/worlds/hostlink.py).

The launcher's WORLD frame says which of its ranks run here. Each gets a PMI socket (its end
watched until it speaks: worlds/pmi1ends.py); then a node-level PmiServer (worlds/pmi1.py)
answers them, and goes to the launcher only where the world is bigger than this host: ONE
FENCE_IN per barrier for all of this host's instances (a fence over every rank, with their
puts: worlds/fences.py), answered by FENCE_OUT with every put of that epoch; a GET for a key
this host has not seen; a NAME to publish, unpublish or look up (the job's names are the
launcher's: worlds/mpinames.py); a SPAWN_ASK for an instance's MPI_Comm_spawn (the launcher
starts the children, here too: a spawned world's ranks on this host are served by an
AgentWorld of its own, its SPAWNs naming each child's rank, its WORLD frame their appnums);
an instance's MPI_ABORT or a connection closed before MPI_Finalize (MPI_LOST), for the job
to act on; PMI_UNSERVED, for the launcher's -v line, where a command was answered with an
error. What MPICH leaves in /dev/shm is removed when the launcher ends the world
(WORLD_END), when the agent ends, and by its lifeline's watchdog when the agent is killed
outright.

Where the WORLD frame asks for it, Open MPI's world is served here too: a PMIx server of its
own (spawner/worlds/pmixhost.py, a process per world) registers the world's namespace, the SPAWNs
wait for it (`ready`), each instance gets its PMIX_* variables, and what crosses hosts goes
to the launcher (run/worlds/pmix.py):
ONE FENCE_IN per fence for this host's instances (answered by FENCE_OUT with every host's
data), MODEX_WANT for a rank on another host (answered by MODEX_DATA), MODEX_GOT answering the
launcher's MODEX_ASK for a rank here, the server's NAMEs (PMIx's names and group context
IDs, asked of the launcher's table as PMI-1's), PMI_UNSERVEDs, and SPAWN_ASK for a PMIx_Spawn
(Open MPI's MPI_Comm_spawn, the launcher starting the children as for PMI-1's). A spawned
world's namespace goes on the server of its parents' where any of them runs here (WORLD's
pmix `beside`), where libpmix holds both. Where no libpmix is found or the server does not
start, PMIX_UNSERVED says why; a server that dies while the world is open, PMIX_LOST.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Callable, Mapping
from typing import Any

from .pmi1ends import PmiEnds, end_variables
from ..protocol import Kind, encode


class AgentWorld:
    """The world named in a WORLD frame, for the instances of it that run here."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fields: dict[str, Any],
                 send: Callable[[bytes], None], lifeline, pmix_host=None,
                 worlds: Mapping[str, AgentWorld] | None = None) -> None:
        """`worlds`: the agent's others, by kvsname (a spawned world's PMIx namespace goes
        on the server of its parents', named by WORLD's pmix `beside`)."""
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
        self._worlds = worlds if worlds is not None else {}
        self._ends = PmiEnds(loop, self._start)
        self.server = None  # spawner.worlds.pmi1.PmiServer, once an instance here has spoken
        self._barriers: dict[int, asyncio.Future] = {}  # by number (the fence's seq)
        self._barrier_seq = itertools.count()
        self._gets: dict[int, asyncio.Future] = {}
        # NAME and SPAWN_ASK frames awaiting their NAMED and SPAWNED_ANSWER
        self._asks: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._pmix = None  # this host's PMIx service, where Open MPI's world is served too
        self.pmix_ns = None  # the world's namespace on it (spawner.worlds.pmixhost.Served)
        self.pmix_error: str | None = None  # why it could not be served here, if so
        self._made_uplink = None  # `_uplink`, once needed
        # Done once the instances can be spawned (Open MPI's world registered, or not served)
        self.ready: asyncio.Future = loop.create_future()
        if fields.get("pmix") and pmix_host is not None and (
                self.ranks or str(dict(fields["pmix"]).get("beside")) in self._worlds):
            task = loop.create_task(self._open_pmix(dict(fields["pmix"]), pmix_host))
            task.add_done_callback(lambda _: self.ready.done() or self.ready.set_result(None))
        else:
            self.ready.set_result(None)

    @property
    def _uplink(self):
        """Its PMIx fences and requests to the root (spawner/worlds/pmixuplink.py), made
        when first needed: a world without Open MPI's spares its modules' import."""
        if self._made_uplink is None:
            from .pmixuplink import Uplink

            self._made_uplink = Uplink(self.kvsname, lambda kind, **fields: self._send(
                encode(kind, **fields)), len(set(self._nodes)))
        return self._made_uplink

    async def _open_pmix(self, pmix: dict[str, Any], pmix_host) -> None:
        from . import pmixplan
        try:
            names = [str(n) for n in pmix["names"]]
            hosts = [names[n] for n in self._nodes]
            here = hosts[self.ranks[0]] if self.ranks else None  # None: only its parents
            beside = None
            parents = self._worlds.get(str(pmix.get("beside")))
            if parents is not None:  # else none of its parents is here: a server of its own
                await parents.ready
                beside = parents.pmix_ns
            if here is None and beside is None:
                return
            self._pmix = pmix_host(pmix, here or beside.world.names[beside.world.here])
            appnums = [self._appnums.get(rank, 0) for rank in range(self.size)]
            self.pmix_ns = await self._pmix.open(
                pmixplan.world(self.kvsname, hosts, here, appnums), self, beside=beside)
        except (LookupError, OSError, RuntimeError, TypeError, ValueError) as exc:
            self._pmix = None
            self.pmix_error = str(exc)
            self._send(encode(Kind.PMIX_UNSERVED, kvsname=self.kvsname, error=str(exc)))

    def attach(self, rank: int, environ: dict[str, str] | None = None
               ) -> tuple[dict[str, str], socket.socket]:
        """The instance's end of its PMI socket (to inherit, then close here) and the
        variables the launcher could not give it (the descriptor, this host's name, PMIx's
        where served; what `environ`, the instance's own, sets wins)."""
        theirs = self.server.attach(rank) if self.server else self._ends.attach(rank)
        pmix = (self._pmix.instance_env(self.pmix_ns, rank, environ)
                if self.pmix_ns is not None else {})
        return {**end_variables(theirs), **pmix}, theirs

    def adopt(self, ends: Mapping[int, socket.socket]) -> None:
        """Ranks' ends handed out before the world was opened here (the launcher's host,
        where a PMI-1 world opens when one of its ranks first speaks: run/worlds/pmi1.
        MpiWorld.attach), served from now on as its own."""
        if self.server is None:
            self._start()
        for rank, ours in ends.items():
            self.server.adopt(rank, ours)

    def _start(self) -> None:
        from .pmi1 import PmiServer, process_mapping_for_ranks

        if self._lifeline is not None:  # before MPICH makes its segment (spawner/lifeline.py)
            self._lifeline.add_mpi_world(self.kvsname)
        self.server = PmiServer(self.kvsname, self.size, local_ranks=self.ranks,
                                process_mapping=process_mapping_for_ranks(self._nodes),
                                upstream=self, on_abort=self._aborted, on_lost=self._lost,
                                on_unserved=self._unserved, on_spawn=self._spawn,
                                appnums=self._appnums)
        for rank, ours in self._ends.hand_over().items():
            self.server.adopt(rank, ours)

    # --- the launcher, as the agent-mode server's upstream (spawner.worlds.pmi1.Upstream) -------

    async def barrier(self, puts: dict[str, str]) -> dict[str, str]:
        seq = next(self._barrier_seq)
        future = self._barriers[seq] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.FENCE_IN, kvsname=self.kvsname, of="pmi1",
                          ranks=list(range(self.size)), seq=seq, puts=puts))
        return await future

    async def get(self, key: str) -> str | None:
        ask = next(self._ids)
        future = self._gets[ask] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.GET, kvsname=self.kvsname, id=ask, key=key))
        return await future

    async def name(self, op: str, service: str, port: str = "", **pmix) -> tuple[int, str]:
        """`pmix`: a PMIx name's wait and once (spawner/worlds/mpinames.py)."""
        ask = next(self._ids)
        future = self._asks[ask] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.NAME, kvsname=self.kvsname, id=ask, op=op, service=service,
                          port=port, **pmix))
        return await future

    async def _spawn(self, rank: int, request) -> dict:
        """An instance here called MPI_Comm_spawn: the launcher starts the children."""
        from .pmi1spawn import request_json

        return await self._ask_spawn(rank, request_json(request))

    async def _ask_spawn(self, rank: int, request: dict) -> dict:
        ask = next(self._ids)
        future = self._asks[ask] = asyncio.get_running_loop().create_future()
        self._send(encode(Kind.SPAWN_ASK, kvsname=self.kvsname, id=ask, key=rank,
                          request=request))
        return await future

    def _unserved(self, rank: int, cmd: str, why: str) -> None:
        self._send(encode(Kind.PMI_UNSERVED, kvsname=self.kvsname, key=rank, cmd=cmd, why=why))

    # --- this host's PMIx server (spawner.worlds.pmixhost.Handler) -----------------------------

    def fence(self, fence, data: bytes, done: Callable[[int, bytes], None]) -> None:
        self._uplink.fence(fence, data, done)

    def direct_modex(self, rank: int, done: Callable[[int, bytes], None]) -> None:
        self._uplink.direct_modex(rank, done)

    def pmix_name(self, fields: dict[str, Any], done: Callable[[int, str], None]) -> None:
        """Asked of the launcher as PMI-1's names are, for the PMIx server here."""
        task = asyncio.get_running_loop().create_task(self.name(
            str(fields.get("op")), str(fields.get("service") or ""),
            str(fields.get("port") or ""), pmix=True, wait=fields.get("wait") or 0,
            once=bool(fields.get("once"))))
        task.add_done_callback(lambda t: t.cancelled() or done(*t.result()))

    def unserved(self, rank: int, cmd: str, why: str) -> None:
        self._unserved(rank, cmd, why)

    def abort(self, rank: int, status: int, message: str) -> None:
        from . import pmixplan

        self._aborted(rank, status, pmixplan.abort_message(message))

    def spawn(self, rank: int, request: dict, done: Callable[[dict], None]) -> None:
        """PMIx_Spawn here: the launcher starts the children, as for PMI-1's spawn."""
        task = asyncio.get_running_loop().create_task(self._ask_spawn(rank, request))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() or done(t.result()))

    def server_lost(self, reason: str) -> None:
        self._send(encode(Kind.PMIX_LOST, kvsname=self.kvsname, error=reason))

    def exited(self, rank: int) -> None:
        """An instance here exited: had it joined Open MPI's world and not left it properly?"""
        if self.pmix_ns is not None and self.pmix_ns.lost_on_exit(rank):
            self._lost(rank, True)

    def _pmix_answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """FENCE_OUT, MODEX_DATA, MODEX_ASK from the launcher (their data decoded as the
        launcher decodes the agents': spawner/worlds/pmixuplink.py)."""
        if kind is not Kind.MODEX_ASK:
            self._uplink.answered(kind, fields)
        elif self.pmix_ns is not None:
            self._pmix.dmodex_request(self.pmix_ns, int(fields["rank"]),
                                      self._uplink.modex_got(fields["id"]))

    def answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """FENCE_OUT (PMI-1's barrier or PMIx's), VALUE, NAMED, SPAWNED_ANSWER from the
        launcher (or PMIx's other answers)."""
        if kind is Kind.FENCE_OUT and fields.get("of") == "pmi1":
            self._barrier_out(fields)
        elif kind in (Kind.FENCE_OUT, Kind.MODEX_DATA, Kind.MODEX_ASK):
            self._pmix_answered(kind, fields)
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

    def _barrier_out(self, fields: dict[str, Any]) -> None:
        """The launcher's answer to a barrier: its delta (checked as the launcher checks a
        host's puts: pmi1.checked_puts), or why it failed."""
        from .pmi1 import PmiError, checked_puts

        future = self._barriers.pop(int(fields["seq"]), None)
        if future is None or future.done():
            return
        try:
            if fields.get("error"):
                raise PmiError(str(fields["error"]))
            future.set_result(checked_puts(fields.get("puts")))
        except PmiError as exc:
            future.set_exception(exc)

    def _aborted(self, rank: int, code: int, message: str) -> None:
        self._send(encode(Kind.MPI_ABORT, kvsname=self.kvsname, key=rank, exitcode=code,
                          message=message))

    def _lost(self, rank: int, initialized: bool) -> None:
        self._send(encode(Kind.MPI_LOST, kvsname=self.kvsname, key=rank,
                          initialized=initialized))

    # --- ending -------------------------------------------------------------------------

    async def close(self) -> list[str]:
        """The world ends (its instances are gone): stop serving, remove MPICH's leftovers
        and the namespace (with Open MPI's segments); the paths of MPICH's removed."""
        self._ends.close()
        self._close_pmix()
        if self.server is not None:
            await self.server.close()
        return self.remove_leftovers()

    def _close_pmix(self) -> None:
        if self._made_uplink is not None:
            self._made_uplink.close()
        if self.pmix_ns is not None:
            self._pmix.close_world(self.pmix_ns)
            self.pmix_ns = None

    def remove_leftovers(self) -> list[str]:
        """What MPICH left in /dev/shm removed (the paths), and the namespace."""
        self._close_pmix()
        if self.server is None:  # nobody spoke: MPICH made nothing
            return []
        from ..reaphere import remove_mpich_shm

        removed = [entry["path"] for entry in remove_mpich_shm(self.kvsname) if entry["done"]]
        if self._lifeline is not None:
            self._lifeline.discard_mpi_world(self.kvsname)
        return removed


class HostWorlds:
    """A host's node-level worlds, by kvsname, as its link to the launcher's root opens,
    answers and ends them (WORLD, the answers, WORLD_END): the agent's on every other host,
    and the launcher's own host's (poprun/run/worlds/hostlink.py), the same code on both.
    `send(bytes)`: a frame up the link; `pmix_host(pmix, hostname)`: the host's PMIx
    service (LookupError where there is none)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[bytes], None],
                 lifeline, pmix_host) -> None:
        self._loop, self._send, self._lifeline = loop, send, lifeline
        self._pmix_host = pmix_host
        self._worlds: dict[str, AgentWorld] = {}
        self._closing: set[asyncio.Task] = set()

    def get(self, kvsname: object) -> AgentWorld | None:
        return self._worlds.get(kvsname)  # type: ignore[arg-type]

    def __getitem__(self, kvsname: str) -> AgentWorld:
        return self._worlds[kvsname]

    def handle(self, kind: Kind, fields: dict[str, Any]) -> asyncio.Task | None:
        """One of the link's world frames; WORLD_END's: the task that ends the world (its
        result: the paths of MPICH's leftovers removed)."""
        if kind is Kind.WORLD:
            world = AgentWorld(self._loop, fields, self._send, self._lifeline,
                               self._pmix_host, self._worlds)
            self._worlds[world.kvsname] = world
            return None
        if kind is Kind.WORLD_END:
            world = self._worlds.pop(fields["kvsname"], None)
            if world is None:
                return None
            task = self._loop.create_task(world.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            return task
        world = self._worlds.get(fields["kvsname"])
        if world is not None:  # else one that has ended
            world.answered(kind, fields)
        return None

    def exited(self, key: int) -> None:
        for world in self._worlds.values():  # left Open MPI's world without MPI_Finalize?
            world.exited(key)

    def remove_leftovers(self) -> None:
        """Its instances are dead now."""
        for world in self._worlds.values():
            world.remove_leftovers()
        self._worlds.clear()


def answer_no_world(tell: Callable[..., None], frame) -> None:
    """A world frame up a link for a kvsname not served there (the world has ended, or
    never ran on that host): dropped, a request answered with an error (its rank, if any,
    must not wait: MPI_Comm_spawn, the name call or the get fails)."""
    fields = frame.fields
    if type(fields.get("id")) is not int:
        return
    if frame.kind is Kind.SPAWN_ASK:
        from .pmi1spawn import spawn_reply

        tell(Kind.SPAWNED_ANSWER, kvsname=fields["kvsname"], id=fields["id"],
             reply=spawn_reply(1, msg="spawn: no such MPI world here"))
    elif frame.kind is Kind.NAME:
        tell(Kind.NAMED, kvsname=fields["kvsname"], id=fields["id"], rc=1,
             value="no_such_world")
    elif frame.kind is Kind.GET:
        tell(Kind.VALUE, kvsname=fields["kvsname"], id=fields["id"], value=None)
