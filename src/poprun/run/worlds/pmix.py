"""Open MPI's world (PMIx) of one attempt, its root: what the hosts' PMIx servers send
(docs/architecture.md, "The instances' worlds").

Every host's instances, this host's too, are served by that host's PMIx server
(spawner/worlds/pmixhost.py: a process of its own per attempt) behind its node-level world
(spawner/worlds/nodeworld.py: an agent's, or this host's through run/worlds/hostlink.py).
What crosses hosts comes here by each host's link, as for PMI-1: one FENCE_IN per host and
fence (that host's instances' data), answered with FENCE_OUT once every host holding a
participant has entered (their data in node order: spawner/worlds/fences.FenceTable); a
direct modex for a rank goes to the host that has it (MODEX_ASK, answered MODEX_GOT) and
back (MODEX_DATA). Fences are named by their participants and a sequence number per
participant set, which every host counts alike. A host's names, spawns and aborts are the
PMI-1 world's frames (NAME, SPAWN_ASK, MPI_ABORT: run/worlds/pmi1.MpiWorld). A connect or
group over several of the job's namespaces (an MPI_Comm_spawn's parents and children,
MPI_Comm_connect between them) is the job's, not one world's: its hosts enter it by the link
of any world they hold a participant of, and `Crossings` (one per job, its worlds' table:
spawner/worlds/fences.CrossTable) answers each by that link once every host holding a
participant of any of the namespaces has entered.

What a host sends is checked (spawner/worlds/fences.FenceError): a broken or hostile host's
fence ends in an error for that fence's instances, never in an exception here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence

from spawner.worlds import pmixplan
from spawner.worlds.fences import CrossTable, FenceTable
from spawner.worlds.pmixplan import ERR_NOT_FOUND, ERROR, SUCCESS

MAX_ASKS = 1 << 16  # direct modex requests waiting for an agent's answer, in one world


class PmixWorld:
    """One attempt's PMIx namespace across hosts, or one its MPI_Comm_spawn made (`beside`:
    the parents' PmixWorld, whose server serves it too on each host holding both, and whose
    `crossings` it shares); `links`: every host's link (an agent's, this host's:
    run/worlds/hostlink.py), by host; `pmix`: this host's PMIx service, whose libpmix the
    agents are told of."""

    def __init__(self, kvsname: str, hosts: Sequence[str], links: Mapping[str, object],
                 pmix, on_server_lost: Callable[[str, str], None], log,
                 beside: PmixWorld | None = None, appnums: Sequence[int] = ()) -> None:
        self.kvsname, self._links, self._log = kvsname, links, log
        self._beside = beside
        self._on_server_lost = on_server_lost
        self.names = list(dict.fromkeys(hosts))
        self._hosts = list(hosts)
        self.world = pmixplan.world(kvsname, hosts, None, appnums)  # the root's: no host's
        self._pmix = pmix
        self._fences = FenceTable(self.world.nodes, pmixplan.MAX_FENCE_DATA)
        self._ids = itertools.count(1)
        # our MODEX_ASK's id -> (who waits for the data, the host asked: only its link
        # answers it)
        self._asks: dict[int, tuple[Callable[[int, bytes], None], str]] = {}
        self._said: set[tuple[str, str]] = set()  # (host, what): its warnings, once each
        # The job's connects across namespaces: the instances' world makes it, each world
        # spawned from it shares it
        self.crossings = beside.crossings if beside is not None else Crossings()
        self.crossings.add(self)

    @property
    def service(self):
        """This host's PMIx service (spawner.worlds.pmixhost.PmixHost)."""
        return self._pmix

    def world_fields(self, argv: Sequence[str]) -> dict:
        """What a WORLD frame tells each host: serve PMIx too, with these node names (and
        the libpmix the user named, else theirs, found as here)."""
        return {"names": self.names, "libpmix": self._pmix.given, "argv": list(argv[:1]),
                **({"beside": self._beside.kvsname} if self._beside is not None else {})}

    # --- what the agents send ------------------------------------------------------------

    def from_agent(self, spawner, kind_name: str, fields: dict) -> None:
        host = spawner.host
        if host not in self._links:  # a host of the world's, or of its parents' only
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
        spawner = self._links.get(host)
        if spawner is None:
            return
        sets = {"sets": pmixplan.sets_json(fence.sets)} if fence.sets else {}
        outcome = {"data": pmixplan.b64(blob)} if error is None else {"error": error}
        spawner.tell(_kind("FENCE_OUT"), kvsname=self.kvsname, ranks=list(fence.ranks),
                     seq=fence.seq, **sets, **outcome)

    def _wanted(self, spawner, their_id: int, rank: int) -> None:
        """A host wants `rank`'s data: from its host's node-level world."""
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

        if owner not in self._links:  # a host nobody serves
            answer(ERR_NOT_FOUND, b"")
            return
        if len(self._asks) >= MAX_ASKS:  # an owner that never answers: refuse, not grow
            answer(ERROR, b"")
            return
        ask = next(self._ids)
        self._asks[ask] = (answer, owner)
        self._links[owner].tell(_kind("MODEX_ASK"), kvsname=self.kvsname, id=ask, rank=rank)

    def _got(self, host: str, ask: int, status: int, data: bytes) -> None:
        """`host`'s agent answers a MODEX_ASK: one sent to another host is not its to
        answer (ignored, the ask left for its owner)."""
        waiting = self._asks.get(ask)
        if waiting is not None and waiting[1] == host:
            del self._asks[ask]
            waiting[0](status, data)

    def close(self) -> None:
        """The world ends (each host's node-level world closes its namespace)."""
        self._asks.clear()
        self.crossings.remove(self)


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
