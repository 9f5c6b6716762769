"""Open MPI's world (PMIx) of one attempt, as the launcher serves and joins it
(docs/architecture.md, "The instances' worlds").

This host's instances are served by this host's PMIx server (spawner/worlds/pmixhost.py: a
process of its own per attempt, a fork of poprun); every other host's by its agent's
(spawner/worlds/nodeworld.py). What crosses hosts comes here over the agents' connections, as
for PMI-1: one FENCE_IN per host and fence (that host's instances' data), answered with
FENCE_OUT once every host holding a participant has entered (their data in node order:
spawner/worlds/fences.FenceTable); a direct modex for a rank on another host goes to that
host's agent (MODEX_ASK, answered MODEX_GOT) and back (MODEX_DATA). Fences are named by their
participants and a sequence number per participant set, which every host counts alike. Names
and spawns go to the PMI-1 world's (MpiWorld.name_for, MpiWorld.answer_spawn). A connect or
group over several of the job's namespaces (an MPI_Comm_spawn's parents and children,
MPI_Comm_connect between them) is the job's, not one world's: its hosts enter it by the link
of any world they hold a participant of, and `Crossings` (one per job, its worlds' table:
spawner/worlds/fences.CrossTable) answers each by that link once every host holding a
participant of any of the namespaces has entered.

What an agent sends is checked (spawner/worlds/fences.FenceError): a broken or hostile host's
fence ends in an error for that fence's instances, never in an exception here.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from poprun.errors import LaunchError
from spawner.worlds import pmixplan
from spawner.worlds.fences import CrossTable, FenceTable
from spawner.worlds.pmixplan import ERR_NOT_FOUND, ERROR, SUCCESS

MAX_ASKS = 1 << 16  # direct modex requests waiting for an agent's answer, in one world


class PmixWorld:
    """One attempt's PMIx namespace across hosts, or one its MPI_Comm_spawn made (`beside`:
    the parents' PmixWorld, whose server serves it too on each host holding both, and whose
    `crossings` it shares); `remote`: the agents by host.
    `on_spawn(rank, request)`: a spawn's reply (run/worlds/pmi1.MpiWorld.answer_spawn)."""

    def __init__(self, kvsname: str, hosts: Sequence[str], remote: Mapping[str, object],
                 pmix, on_abort: Callable[[int, int, str], None],
                 on_server_lost: Callable[[str, str], None], log, names=None,
                 on_unserved: Callable[[int, str, str], None] | None = None,
                 on_spawn: Callable[[int, object], Awaitable[dict]] | None = None,
                 beside: PmixWorld | None = None, appnums: Sequence[int] = ()) -> None:
        """`names(fields, done)`: asks the job's name table (run/worlds/pmi1.MpiWorld.name_for);
        `on_unserved(rank, cmd, why)`: a request answered with an error, for -v."""
        self.kvsname, self._remote, self._on_abort, self._log = kvsname, remote, on_abort, log
        self._names = names
        self.unserved = on_unserved or (lambda rank, cmd, why: None)
        self._on_spawn, self._beside = on_spawn, beside
        self._tasks: set[asyncio.Task] = set()
        self._on_server_lost = on_server_lost
        self.names = list(dict.fromkeys(hosts))
        self._hosts = list(hosts)
        local = [h for h in self.names if h not in remote]
        here = self.here = local[0] if local else self.names[0]
        self.world = pmixplan.world(kvsname, hosts, here, appnums)
        self._local_node = self.names.index(here) if local else None
        self._pmix = pmix
        self._fences = FenceTable(self.world.nodes, pmixplan.MAX_FENCE_DATA)
        self._done: dict[pmixplan.FenceId, Callable[[int, bytes], None]] = {}  # local waiter
        self._ids = itertools.count(1)
        # our MODEX_ASK's id -> (who waits for the data, the host asked: only its agent
        # answers it)
        self._asks: dict[int, tuple[Callable[[int, bytes], None], str]] = {}
        self._local = bool(local)
        self._said: set[tuple[str, str]] = set()  # (host, what): its warnings, once each
        self.ns = None  # the world's namespace on this host's server (worlds.pmixhost.Served)
        # The job's connects across namespaces: the instances' world makes it, each world
        # spawned from it shares it
        self.crossings = beside.crossings if beside is not None else Crossings()
        self.crossings.add(self)

    async def open(self) -> None:
        """Register the world on this host's server (a fresh one), before the instances
        that need its variables start."""
        from spawner.worlds.pmixhost import PmixServerError

        beside = self._beside.ns if self._beside is not None else None
        if self._pmix is not None and (self._local or beside is not None):
            # None of its ranks here but its parents: beside them, for their connect
            world = self.world if self._local else self.world._replace(
                here=pmixplan.NONE_HERE)
            try:
                self.ns = await self._pmix.open(world, self, beside=beside)
            except PmixServerError as exc:
                raise LaunchError(f"Open MPI's world (PMIx) cannot be served here: {exc}") \
                    from None

    @property
    def service(self):
        """This host's PMIx service (spawner.worlds.pmixhost.PmixHost)."""
        return self._pmix

    def world_fields(self, argv: Sequence[str]) -> dict:
        """What a WORLD frame tells the agents: serve PMIx too, with these node names (and
        the libpmix the user named, else theirs, found as here)."""
        return {"names": self.names, "libpmix": self._pmix.given, "argv": list(argv[:1]),
                **({"beside": self._beside.kvsname} if self._beside is not None else {})}

    def instance_env(self, rank: int, environ) -> dict[str, str]:
        return self._pmix.instance_env(self.ns, rank, environ)

    def lost_on_exit(self, rank: int) -> bool:
        """A local instance exited: lost to its peers (pmixhost.Served.lost_on_exit)?"""
        return self.ns is not None and self.ns.lost_on_exit(rank)

    # --- this host's server (spawner.worlds.pmixhost.Handler) -----------------------------------

    def fence(self, fence: pmixplan.FenceId, data: bytes, done) -> None:
        self._done[fence] = done
        if fence.sets:
            self.crossings.enter(self, self.here, fence, data)
        else:
            self._contribute(fence, self._local_node, data)

    def direct_modex(self, rank: int, done) -> None:
        spawner = self._remote.get(self._hosts[rank])
        if spawner is None:
            done(ERR_NOT_FOUND, b"")
            return
        ask = next(self._ids)
        self._asks[ask] = (done, self._hosts[rank])
        spawner.tell(_kind("MODEX_ASK"), kvsname=self.kvsname, id=ask, rank=rank)

    def abort(self, rank: int, status: int, message: str) -> None:
        self._on_abort(rank, status, pmixplan.abort_message(message))

    def pmix_name(self, fields: dict, done: Callable[[int, str], None]) -> None:
        if self._names is None:
            done(1, "names_not_served")
        else:
            self._names({**fields, "pmix": True}, done)

    def server_lost(self, reason: str) -> None:
        self._on_server_lost(self.here, reason)

    def spawn(self, rank: int, request: dict, done: Callable[[dict], None]) -> None:
        async def answer() -> None:
            if self._on_spawn is None:
                from spawner.worlds.pmi1spawn import spawn_reply

                done(spawn_reply(1, msg="spawn: not served"))
            else:
                done(await self._on_spawn(rank, request))

        task = asyncio.get_running_loop().create_task(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- what the agents send ------------------------------------------------------------

    def from_agent(self, spawner, kind_name: str, fields: dict) -> None:
        host = spawner.host
        if host not in self._remote:  # a host of the world's, or of its parents' only
            return
        try:
            if kind_name == "FENCE_IN":
                fence = pmixplan.fence_of(fields)
                data = pmixplan.decode_data(fields["data"], pmixplan.MAX_FENCE_DATA)
                if fence.sets:
                    self.crossings.enter(self, host, fence, data)
                else:
                    self._contribute(fence, self.names.index(host), data)
            elif kind_name == "MODEX_WANT":
                self._wanted(spawner, int(fields["id"]), int(fields["rank"]))
            elif kind_name == "MODEX_GOT":
                self._got(host, int(fields["id"]), int(fields["status"]),
                          pmixplan.decode_data(fields.get("data") or "", pmixplan.MAX_MODEX))
            elif kind_name == "PMIX_LOST":
                self._on_server_lost(host, str(fields.get("error"))[:500])
            elif kind_name == "PMIX_UNSERVED":
                self._warn_once(host, "unserved", f"{host}: Open MPI's world is not served "
                                f"there: {str(fields.get('error'))[:500]}")
        except (KeyError, TypeError, ValueError,
                pmixplan.FenceError) as exc:
            self._warn_once(host, "malformed", f"{host}: a PMIx message that cannot be one "
                            f"({str(exc)[:200]}); ignored (and its others, not said again)")

    def _warn_once(self, host: str, what: str, message: str) -> None:
        """Said once per host and kind of message: a host that sends it in a loop cannot
        fill the launcher's log."""
        if (host, what) not in self._said:
            self._said.add((host, what))
            self._log.warning(message)

    def _contribute(self, fence: pmixplan.FenceId, node: int, data: bytes) -> None:
        try:
            complete = self._fences.contribute(fence, node, data)
        except pmixplan.FenceError as exc:
            self._answer_fence(fence, [node], ERROR, b"", str(exc))
            return
        if complete is not None:
            nodes, parts = complete  # libpmix unpacks one host's blob after another
            self._answer_fence(fence, nodes, SUCCESS, b"".join(parts))

    def _answer_fence(self, fence: pmixplan.FenceId, nodes: list[int], status: int,
                      blob: bytes, error: str | None = None) -> None:
        for node in nodes:
            self.answer_host(self.names[node], fence, status, blob, error)

    def answer_host(self, host: str, fence: pmixplan.FenceId, status: int, blob: bytes,
                    error: str | None = None) -> None:
        """`host`'s answer to a fence it entered by this world's link."""
        if self._local and host == self.here:
            done = self._done.pop(fence, None)
            if done is not None:
                done(status, blob)
            return
        spawner = self._remote.get(host)
        if spawner is None:
            return
        sets = {"sets": pmixplan.sets_json(fence.sets)} if fence.sets else {}
        outcome = {"data": pmixplan.b64(blob)} if error is None else {"error": error}
        spawner.tell(_kind("FENCE_OUT"), kvsname=self.kvsname, ranks=list(fence.ranks),
                     seq=fence.seq, **sets, **outcome)

    def _wanted(self, spawner, their_id: int, rank: int) -> None:
        """An agent wants `rank`'s data: from this host's server, or from its host's agent."""
        if not 0 <= rank < self.world.size:
            raise ValueError(f"rank {rank}")
        owner = self._hosts[rank]
        self._log.debug(f"PMIx: {spawner.host} asks for rank {rank}'s data ({owner} has it)")
        asked = time.monotonic()

        def answer(status: int, data: bytes) -> None:
            # how long the owner took (it waits for the rank to commit): -vv
            self._log.debug(f"PMIx: rank {rank}'s data to {spawner.host}: status {status}, "
                            f"{len(data)} bytes, after {1000 * (time.monotonic() - asked):.0f} ms")
            spawner.tell(_kind("MODEX_DATA"), kvsname=self.kvsname, id=their_id,
                         status=status, data=pmixplan.b64(data))

        if owner not in self._remote:
            if self.ns is None:
                answer(ERR_NOT_FOUND, b"")
            else:
                self._pmix.dmodex_request(self.ns, rank, answer)
            return
        if len(self._asks) >= MAX_ASKS:  # an owner that never answers: refuse, not grow
            answer(ERROR, b"")
            return
        ask = next(self._ids)
        self._asks[ask] = (answer, owner)
        self._remote[owner].tell(_kind("MODEX_ASK"), kvsname=self.kvsname, id=ask, rank=rank)

    def _got(self, host: str, ask: int, status: int, data: bytes) -> None:
        """`host`'s agent answers a MODEX_ASK: one sent to another host is not its to
        answer (ignored, the ask left for its owner)."""
        waiting = self._asks.get(ask)
        if waiting is not None and waiting[1] == host:
            del self._asks[ask]
            waiting[0](status, data)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for done in self._done.values():  # nobody is left to complete them
            done(ERROR, b"")
        self._done.clear()
        self._asks.clear()
        self.crossings.remove(self)
        if self.ns is not None:
            self._pmix.close_world(self.ns)
            self.ns = None


class Crossings:
    """One job's fences, connects and groups over several of its worlds' namespaces (each
    world's PmixWorld added while open): a host's entry goes to fences.CrossTable, its
    answer back by the link it came by; one that cannot be an entry is answered with an
    error."""

    def __init__(self) -> None:
        self.table = CrossTable(pmixplan.MAX_FENCE_DATA)
        self._worlds: dict[str, PmixWorld] = {}

    def add(self, world: PmixWorld) -> None:
        self._worlds[world.kvsname] = world
        self.table.worlds[world.kvsname] = world.world

    def remove(self, world: PmixWorld) -> None:
        if self._worlds.get(world.kvsname) is world:
            del self._worlds[world.kvsname]
            del self.table.worlds[world.kvsname]

    def enter(self, via: PmixWorld, host: str, fence: pmixplan.FenceId, data: bytes) -> None:
        try:
            complete = self.table.enter(fence, via.kvsname, host, data)
        except pmixplan.FenceError as exc:
            via.answer_host(host, fence, ERROR, b"", str(exc))
            return
        entered, blob = complete or ({}, b"")
        for there, nspace in entered.items():
            world = self._worlds.get(nspace)
            if world is not None:
                world.answer_host(there, fence._replace(ranks=dict(fence.sets)[nspace]),
                                  SUCCESS, blob)


def _kind(name: str):
    from spawner.protocol import Kind

    return Kind[name]
