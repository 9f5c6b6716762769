"""PMI-1 ("simple PMI") wire-protocol server, pure Python (stdlib + asyncio).

This lets programs linked with MPICH (e.g. the ``mpich`` PyPI wheel used by
mpi4py) form one MPI world when they are started by our own launcher instead
of ``mpiexec``, the same way MPICH's Hydra and Slurm's srun do it.

Protocol summary (from pmodels/mpich: src/pmi/src/pmi_v1.c, pmi_wire.c,
pmi_util.c, src/pmi/maint/pmi-1.1.txt, src/pm/hydra/proxy/pmip_pmi.c):

* Transport.  The process finds the server through its environment:
  ``PMI_FD=<n>``  an inherited, already connected stream socket (we use one
                  end of a socketpair); ``PMI_RANK`` and ``PMI_SIZE`` then give
                  the rank and the world size (both default to 0 / 1).
  ``PMI_PORT=<host>:<port>``  a TCP address to connect to (IPv4/IPv6 only:
                  MPICH uses MPL_get_sockaddr + MPL_socket, no Unix sockets);
                  with ``PMI_ID=<id>`` the client first sends
                  ``cmd=initack pmiid=<id>`` and reads rank/size from the reply.
                  Without ``PMI_ID`` there is no handshake and rank/size stay
                  0/1: every process is a world of one.
  ``PMI_SPAWNED=1`` marks processes created by MPI_Comm_spawn (has a parent).
  ``PMI_FD`` wins over ``PMI_PORT``.  Neither -> singleton (size 1).
  poprun serves ``PMI_FD`` only: a ``PMI_PORT`` listener would let any user
  of the host speak for a rank.
* Framing.  One command per line: ``cmd=<name> key=value key=value\\n``.
  Tokens are separated by single spaces; a value ends at the next unescaped
  space; MPICH's parser (pmi_wire.c ``parse_v1``) un-escapes ``\\x`` -> ``x``.
  MPICH's client never escapes what it sends, so a value that holds spaces
  (the ``value`` of ``put``, the ``message`` of ``abort``) arrives raw; we
  therefore let those *last* fields run to the end of the line.
* Replies carry ``rc=0`` (Hydra adds it to every response) or ``rc=<n>`` on
  failure; the client checks rc only after the reply's cmd name matched.

  ==========================================  =====================================================
  query                                        reply
  ==========================================  =====================================================
  init pmi_version=1 pmi_subversion=1          response_to_init rc=0 pmi_version=1 pmi_subversion=1
  initack pmiid=<id>   (PMI_PORT only)         initack rc=0 rank= size= appnum= debug=0 + 3 lines
                                               ``cmd=set size=`` / ``cmd=set rank=`` / ``cmd=set debug=``
  get_maxes                                    maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024
  get_appnum                                   appnum rc=0 appnum=0
  get_universe_size                            universe_size rc=0 size=<n>
  get_my_kvsname                               my_kvsname rc=0 kvsname=<name>
  put kvsname= key= value=                     put_result rc=0
  get kvsname= key=                            get_result rc=0 value=<v>   | get_result rc=1 (absent)
  barrier_in                                   barrier_out rc=0   (when everybody has entered)
  finalize                                     finalize_ack rc=0
  abort exitcode= message=                     (no reply; see below: the launcher must kill)
  publish_name service= port=                  publish_result rc=0   (spawner/worlds/mpinames.py)
  unpublish_name service=                      unpublish_result rc=0
  lookup_name service=                         lookup_result rc=0 port=<p>
  mcmd=spawn ... endcmd  (several lines)       spawn_result rc=0 errcodes=0,...  (pmi1spawn.py)
  anything else                                <its reply name> rc=1 msg=<why>, at once
  ==========================================  =====================================================

  ``abort``: MPICH 5.0 (ch4_globals.c MPID_Abort) sends it for MPI_Abort on
  COMM_WORLD of size > 1 and then RETURNS: the aborting process carries on
  (measured: MPI_Abort returned, the ranks went on and exited 0).  The
  launcher has to kill every rank, the aborting one included, and report
  the abort's exit code.  MPICH's pmi1_abort always sends ``message=abort``.

  We answer init with version 1.1 (Hydra answers 1.2).  A 1.2 answer switches
  the client into its threaded mode (barrier_out with ``tag=``, group
  barriers ``barrier_in group=...``); with 1.1 MPICH sets
  MPIR_CVAR_PMI_DISABLE_GROUP and only ever sends plain ``barrier_in``.

* Job attributes: ``get`` of a ``PMI_`` key is answered from the launcher's
  attributes (``PMI_process_mapping``; ``PMI_hwloc_xmlfile`` and
  ``PMI_mpi_memory_alloc_kinds`` are simply absent -> rc=1, as in Hydra).
  ``put`` of a ``PMI_`` key is refused with rc=1, as in Hydra.

Structure of this module:

* pure protocol core, no I/O: :func:`parse`, :func:`format`,
  :func:`process_mapping`, :func:`process_mapping_for_ranks`,
  :class:`KeyValueSpace`, :class:`Barrier`;
* asyncio I/O: :class:`PmiServer` (serves one host's instances of a world,
  alone or as a node of a world across hosts, forwarding to an upstream), and
  :class:`Root` (the world's root: its key-value space, and each barrier as a
  fence every host enters once: spawner/worlds/fences.py);
* MPICH's /dev/shm segments of a job are found and removed by spawner/reaphere.py
  (``mpich_shm_leftovers``, ``remove_mpich_shm``): reap runs it on every host.

Barrier / key-value exchange across hosts (node-level forwarding)
-----------------------------------------------------------------
Every host serves its own instances with a node-level :class:`PmiServer`
(spawner/worlds/nodeworld.py: in its agent, the launcher's host's in poprun, linked
alike); when all of *its* instances have entered the barrier it enters ONE fence
upstream over every rank of the world (the barrier's number its sequence number), its
part the union of their puts (FENCE_IN).  The :class:`Root`
completes the fence once every host has entered it (fences.FenceTable) and
then answers each with the *delta* of that epoch: every key/value
contributed by anybody during the epoch (not the whole key-value space).
Node-level servers merge the delta into their local mirror of the key-value space and
answer their instances' ``get`` locally; a key missing locally is asked
upstream (:meth:`Upstream.get`).  This is Hydra's design (proxy ``mput`` +
``barrier_in count=`` upstream, server broadcast of ``keyval_cache`` before
``barrier_out``).  Deltas keep the traffic at O(total puts) per host instead
of O(barriers x puts); a full snapshot would only be needed by an agent that
joins late, which cannot happen for a fixed-size job.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from popdist.env import PMI_FD, PMI_RANK, PMI_SIZE

from .pmi1wire import PmiError, escape, unescape

__all__ = [
    "PmiError", "parse", "format_cmd", "escape", "unescape",
    "process_mapping", "process_mapping_for_ranks",
    "KeyValueSpace", "Barrier", "BarrierRelease",
    "PmiServer", "Upstream", "Root", "checked_puts",
    "KVSNAME_MAX", "KEYLEN_MAX", "VALLEN_MAX", "KEYS_PER_RANK",
]

# Limits announced in ``maxes`` (the values Hydra uses: lib/pmiserv_common.h).
# MPICH splits binary business cards into hex segments of (vallen_max-2)/2
# bytes, so vallen_max must be honoured by whoever stores values.
KVSNAME_MAX = 256
KEYLEN_MAX = 64
VALLEN_MAX = 1024
# Keys a world may hold, per rank (MPICH puts a handful: its business card, in segments of
# vallen_max): an instance that puts key after key is refused (rc=1) past it, not stored.
KEYS_PER_RANK = 256

# Commands whose last field may contain spaces: that field runs to the end
# of the line.  (MPICH sends ``put kvsname= key= value=`` and
# ``abort exitcode= message=`` in that order; see pmi-1.1.txt.)
_TAIL_KEYS = {"put": "value", "abort": "message"}

# Reply names (MPICH's pmi-1.2.txt) of queries poprun does not serve: answered at once with
# rc=1, the client fails cleanly (an MPI error) instead of waiting forever. A command MPICH
# does not know is answered as ``<cmd>_result`` (the client fails on any name it did not
# expect). ``initack`` is PMI_PORT's handshake, which poprun does not serve.
_UNSUPPORTED_REPLIES = {
    "spawn": "spawn_result",
    "initack": "initack",
    "singinit": "singinit_info",
}
# Name publishing (spawner/worlds/mpinames.py): the query, its operation and reply.
_NAME_QUERIES = {"publish_name": ("publish", "publish_result"),
                 "unpublish_name": ("unpublish", "unpublish_result"),
                 "lookup_name": ("lookup", "lookup_result")}


# --------------------------------------------------------------------------
# pure protocol core
# --------------------------------------------------------------------------

def parse(line) -> Tuple[str, Dict[str, Optional[str]]]:
    """Parse one PMI-1 command line into ``(cmd, {key: value})``.

    ``line`` may be ``str`` or ``bytes`` and may end with ``\\n``.  A token
    without ``=`` maps to ``None``.  For ``put`` (``value``) and ``abort``
    (``message``) that field takes the rest of the line verbatim, spaces
    included.  Other values end at an unescaped space and are un-escaped.
    Raises :class:`PmiError` when the line does not start with ``cmd=``.
    """
    if isinstance(line, (bytes, bytearray)):
        line = bytes(line).decode("utf-8", "surrogateescape")
    line = line.rstrip("\r\n")
    if not line.startswith("cmd="):
        raise PmiError(f"expecting cmd=, got {line[:60]!r}")
    cmd = None
    args: Dict[str, Optional[str]] = {}
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i] == " ":
            i += 1
        if i >= n:
            break
        # key: up to '=', space or end
        j = i
        while j < n and line[j] not in " =":
            j += 1
        key = line[i:j]
        if not key:
            raise PmiError(f"empty key at column {i} in {line[:60]!r}")
        if j < n and line[j] == "=":
            j += 1
            if cmd is not None and _TAIL_KEYS.get(cmd) == key:
                args[key] = line[j:]
                break
            k = j
            while k < n and line[k] != " ":
                k += 2 if (line[k] == "\\" and k + 1 < n) else 1
            val = unescape(line[j:k])
            i = k
        else:
            val = None
            i = j
        if key == "cmd" and cmd is None:
            if not val:
                raise PmiError("empty cmd")
            cmd = val
        else:
            args[key] = val
    assert cmd is not None
    return cmd, args


def format_cmd(cmd: str, _fields: Optional[Dict[str, object]] = None, **kv) -> str:
    """Format one reply line: ``cmd=<cmd> k=v ...\\n``.

    Fields keep their order (``_fields`` first, then keyword arguments; use
    ``_fields`` for keys that are not Python identifiers such as
    ``spawner-jobid``).  ``None`` values are dropped; ints are rendered with
    ``str``; string values are escaped with :func:`escape`.
    """
    parts = ["cmd=" + cmd]
    items = list((_fields or {}).items()) + list(kv.items())
    for key, val in items:
        if val is None:
            continue
        if " " in key or "=" in key or not key:
            raise PmiError(f"bad key {key!r}")
        sval = escape(val) if isinstance(val, str) else str(int(val))
        if "\n" in sval:
            raise PmiError(f"newline in value of {key!r}")
        parts.append(f"{key}={sval}")
    return " ".join(parts) + "\n"


def process_mapping_for_ranks(node_of_rank: Iterable[int]) -> str:
    """``PMI_process_mapping`` for an arbitrary rank -> node-id list.

    Format (pmodels/mpich src/mpl/src/mpl_rankmap.c): ``(vector,B,B,...)``
    where a block ``(X,Y,Z)`` means "nodes X..X+Y-1 each hold the next Z
    ranks".  Consecutive ranks on one node form a block; adjacent blocks
    with consecutive node ids and equal sizes are merged.  (MPICH's own
    writer can also emit ``[...]xN`` repeats; its reader does not need them.)
    Note MPICH's reader *wraps around* to the first block when the string
    describes fewer ranks than the world size, so the mapping must be exact.
    """
    nodes = list(node_of_rank)
    if not nodes:
        raise ValueError("empty mapping")
    runs: List[List[int]] = []  # [node, count]
    for nd in nodes:
        if nd < 0:
            raise ValueError("negative node id")
        if runs and runs[-1][0] == nd:
            runs[-1][1] += 1
        else:
            runs.append([nd, 1])
    blocks: List[List[int]] = []  # [start, nnodes, per_node]
    for nd, cnt in runs:
        if blocks:
            b = blocks[-1]
            if b[2] == cnt and b[0] + b[1] == nd:
                b[1] += 1
                continue
        blocks.append([nd, 1, cnt])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


def process_mapping(counts_per_node: Iterable[int]) -> str:
    """``PMI_process_mapping`` for block placement: node i holds the next
    ``counts_per_node[i]`` ranks.  ``[4, 4]`` -> ``(vector,(0,2,4))``;
    ``[4, 4, 2]`` -> ``(vector,(0,2,4),(2,1,2))``.  A zero count uses up
    a node id but holds no rank.
    """
    node_of_rank: List[int] = []
    for node, cnt in enumerate(counts_per_node):
        if cnt < 0:
            raise ValueError("negative count")
        node_of_rank.extend([node] * cnt)
    return process_mapping_for_ranks(node_of_rank)


class KeyValueSpace:
    """The job's key-value space plus read-only job attributes.

    ``attrs`` holds the ``PMI_*`` job attributes (``PMI_process_mapping``).
    Keys starting with ``PMI_`` cannot be put (Hydra refuses them too).
    """

    def __init__(self, attrs: Optional[Dict[str, str]] = None,
                 keylen_max: int = KEYLEN_MAX, vallen_max: int = VALLEN_MAX,
                 keys_max: Optional[int] = None):
        self.attrs: Dict[str, str] = dict(attrs or {})
        self._kv: Dict[str, str] = {}
        self.keylen_max = keylen_max
        self.vallen_max = vallen_max
        self.keys_max = keys_max  # None: no bound

    def check(self, key: str, value: str) -> Optional[str]:
        """Return an error message if ``put(key, value)`` is not allowed."""
        if not key:
            return "empty_key"
        if key.startswith("PMI_"):
            return "Keys with PMI_ prefix are reserved"
        if len(key) > self.keylen_max:
            return "key_too_long"
        if len(value) > self.vallen_max:
            return "value_too_long"
        if (self.keys_max is not None and len(self._kv) >= self.keys_max
                and key not in self._kv):
            return "too_many_keys"
        return None

    def check_batch(self, puts: Dict[str, str]) -> Optional[str]:
        """An error message if ``update(puts)`` is not allowed: each key as ``check`` sees
        it, and the keys it adds all together against ``keys_max`` (a host's barrier
        batch: checked key by key against the count before it, any batch would pass)."""
        for key, value in puts.items():
            if not (isinstance(key, str) and isinstance(value, str)):  # another host's JSON
                return f"{str(key)[:KEYLEN_MAX]}: not_text"
            err = self.check(key, value)
            if err:
                return f"{key}: {err}"
        added = sum(key not in self._kv for key in puts)
        if self.keys_max is not None and len(self._kv) + added > self.keys_max:
            return f"too_many_keys: {added} new keys, {len(self._kv)} of {self.keys_max} held"
        return None

    def put(self, key: str, value: str) -> None:
        err = self.check(key, value)
        if err:
            raise PmiError(err)
        self._kv[key] = value

    def update(self, puts: Dict[str, str]) -> None:
        """Merge puts that were already checked (e.g. a barrier delta)."""
        self._kv.update(puts)

    def get(self, key: str) -> Optional[str]:
        if key.startswith("PMI_"):
            return self.attrs.get(key)
        return self._kv.get(key)

    def snapshot(self) -> Dict[str, str]:
        return dict(self._kv)

    def __len__(self) -> int:
        return len(self._kv)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None


class BarrierRelease:
    """What every participant of a completed barrier epoch receives."""

    __slots__ = ("epoch", "puts")

    def __init__(self, epoch: int, puts: Dict[str, str]) -> None:
        self.epoch, self.puts = epoch, puts

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BarrierRelease)
                and (self.epoch, self.puts) == (other.epoch, other.puts))

    def __repr__(self) -> str:
        return f"BarrierRelease({self.epoch}, {self.puts})"


class Barrier:
    """Counting barrier whose participants may stand for several processes.

    ``enter(count, puts)`` adds ``count`` arrivals and the participant's
    puts since its previous barrier.  When the arrivals reach ``total`` the
    epoch completes: ``enter`` returns a :class:`BarrierRelease` carrying
    all puts of the epoch (later puts of a key win), and the barrier resets
    for the next epoch.  Otherwise it returns ``None``.  Pure: the I/O layer
    keeps the list of waiters and answers them.
    """

    def __init__(self, total: int):
        if total <= 0:
            raise ValueError("barrier total must be positive")
        self.total = total
        self.epoch = 0
        self.arrived = 0
        self._puts: Dict[str, str] = {}

    def enter(self, count: int = 1, puts: Optional[Dict[str, str]] = None
              ) -> Optional[BarrierRelease]:
        if count <= 0:
            raise PmiError(f"barrier count must be positive, got {count}")
        if self.arrived + count > self.total:
            raise PmiError(f"barrier epoch {self.epoch}: {self.arrived}+{count} "
                           f"arrivals exceed {self.total}")
        self.arrived += count
        if puts:
            self._puts.update(puts)
        if self.arrived < self.total:
            return None
        release = BarrierRelease(self.epoch, self._puts)
        self.epoch += 1
        self.arrived = 0
        self._puts = {}
        return release


# --------------------------------------------------------------------------
# asyncio I/O
# --------------------------------------------------------------------------

class Upstream:
    """What a node-level :class:`PmiServer` needs from the level above."""

    async def barrier(self, puts: Dict[str, str]) -> Dict[str, str]:
        """Enter the world-wide barrier for every instance here, with their
        puts; return the epoch's delta once every host has entered."""

    async def get(self, key: str) -> Optional[str]:
        """Look up a key this host has not seen (None if absent)."""

    async def name(self, op: str, service: str, port: str = "") -> Tuple[int, str]:
        """Publish, unpublish or look up a name in the job's table (spawner/worlds/mpinames.py):
        (0, the port for a lookup) or (rc, why)."""


class _Instance:
    """One rank served here. (Plain classes, no dataclasses: this module is imported on a
    launch's path once an instance speaks PMI, and every class made at import counts.)"""

    __slots__ = ("rank", "initialized", "finalized", "aborted", "lost", "connected", "puts",
                 "writer")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.initialized = self.finalized = self.aborted = self.lost = False
        self.connected = False
        self.puts: Dict[str, str] = {}  # since the last barrier
        self.writer: Optional[asyncio.StreamWriter] = None


AbortCallback = Callable[[int, int, str], None]
LostCallback = Callable[[int, bool], None]
UnservedCallback = Callable[[int, str, str], None]


class PmiServer:
    """Serves the PMI-1 connections of one job's instances on this host.

    Alone (``upstream=None``): its own key-value space and a :class:`Barrier`
    over its ranks (a world that is all here, as tests serve one).

    Node-level (``upstream`` given: the world's :class:`Root` through
    :meth:`Root.node`, or an agent's link to the launcher): serves
    ``local_ranks`` only; when all of them entered a barrier it calls
    ``upstream.barrier(their puts)`` once, merges the returned delta and
    releases them.

    ``kvsname`` must be unique per job *and attempt* (e.g.
    ``poprun-<jobid>-<attempt>``): MPICH derives its /dev/shm names from it.

    Callbacks (called in the event loop, must not block):
    ``on_abort(rank, exitcode, message)`` when an instance sends abort
    (MPICH does not exit after it: kill the whole job, aborting rank
    included, and report ``exitcode``);
    ``on_lost(rank, initialized)`` when a connection closes before the
    instance sent finalize (and did not abort).  ``initialized`` tells
    whether it had sent init (a non-MPI program never does);
    ``on_unserved(rank, cmd, why)`` when a command is answered with an error
    (not served, refused, malformed: for the launcher's -v line).

    ``names``: the job's published names (spawner/worlds/mpinames.py; an agent's
    ``upstream`` by default, else a table of this server's own).
    ``on_spawn(rank, request)``: an awaitable that starts a spawn's
    processes (spawner/worlds/pmi1spawn.py's SpawnRequest) and returns the
    ``spawn_result`` fields; without it spawn is answered rc=1.
    ``appnums``: each rank's appnum where they differ (MPI_Comm_spawn_multiple).
    """

    def __init__(self, kvsname: str, size: int, *,
                 local_ranks: Optional[Iterable[int]] = None,
                 process_mapping: Optional[str] = None,
                 attrs: Optional[Dict[str, str]] = None,
                 appnum: int = 0,
                 universe_size: Optional[int] = None,
                 upstream: Optional[Upstream] = None,
                 on_abort: Optional[AbortCallback] = None,
                 on_lost: Optional[LostCallback] = None,
                 names=None, on_spawn=None,
                 on_unserved: Optional[UnservedCallback] = None,
                 appnums: Optional[Dict[int, int]] = None):
        if not kvsname or " " in kvsname or len(kvsname) >= KVSNAME_MAX:
            raise ValueError(f"bad kvsname {kvsname!r}")
        if size <= 0:
            raise ValueError("size must be positive")
        self.kvsname = kvsname
        self.size = size
        self.appnum = appnum
        self.universe_size = universe_size if universe_size is not None else size
        attrs = dict(attrs or {})
        attrs["PMI_process_mapping"] = process_mapping or attrs.get(
            "PMI_process_mapping") or process_mapping_for_ranks([0] * size)
        self.kvs = KeyValueSpace(attrs, keys_max=KEYS_PER_RANK * size)
        self.upstream = upstream
        ranks = list(range(size)) if local_ranks is None else sorted(set(local_ranks))
        for r in ranks:
            if not 0 <= r < size:
                raise ValueError(f"rank {r} outside world of {size}")
        self.instances: Dict[int, _Instance] = {r: _Instance(r) for r in ranks}
        self.barrier = Barrier(max(1, len(ranks)))  # the world's other hosts: upstream
        self._waiters: List[asyncio.Future] = []
        self.on_abort = on_abort
        self.on_lost = on_lost
        self._tasks: set = set()
        self._closing = False
        if names is None and upstream is None:
            from .mpinames import NameService
            names = NameService()
        self.names = names if names is not None else upstream
        self.on_spawn, self.on_unserved = on_spawn, on_unserved
        self.appnums = dict(appnums or {})

    # ---- setting up instances ------------------------------------------

    def attach(self, rank: int) -> socket.socket:
        """Create the socketpair for ``rank`` and start serving our end.

        Returns the child's end (inheritable).  Start the process with
        ``pass_fds=[sock.fileno()]`` and :meth:`env`, then close the
        returned socket in the parent.  Must be called with a running loop.
        """
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child.set_inheritable(True)
        self.adopt(rank, parent)
        return child

    def adopt(self, rank: int, sock: socket.socket) -> None:
        """Serve `rank` on `sock`, our end of a socket pair made earlier (what the instance
        wrote meanwhile is still in it). Must be called with a running loop."""
        inst = self._instance(rank)
        if inst.connected:
            raise PmiError(f"rank {rank} already attached")
        inst.connected = True
        self._spawn(self._serve_socket(sock, inst))

    def env(self, rank: int, fd: int) -> Dict[str, str]:
        """The environment that points `rank` at its end of the socketpair, inherited as
        `fd` (``PMI_SPAWNED`` is never set: no dynamic spawn)."""
        return {PMI_FD: str(fd), PMI_RANK: str(rank), PMI_SIZE: str(self.size)}

    # ---- state ------------------------------------------------------------

    def _instance(self, rank: int) -> _Instance:
        try:
            return self.instances[rank]
        except KeyError:
            raise PmiError(f"rank {rank} is not served here") from None

    def finished(self) -> bool:
        """True when every instance finalized, aborted or was lost."""
        return all(i.finalized or i.aborted or i.lost for i in self.instances.values())

    async def close(self) -> None:
        """Stop listening, close all connections, cancel pending work.
        Connections closed here are not reported to ``on_lost``."""
        self._closing = True
        for fut in self._waiters:
            if not fut.done():
                fut.cancel()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _enter(self, count: int, puts: Dict[str, str]) -> Dict[str, str]:
        # Make the puts visible at once (gets before the barrier completes
        # may see them; PMI only promises visibility after it).
        self.kvs.update(puts)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        release = self.barrier.enter(count, puts)
        if release is not None:
            waiters, self._waiters = self._waiters, []
            try:
                if self.upstream is not None:
                    # All local instances are in; go upstream once.
                    delta = await self.upstream.barrier(release.puts)
                    self.kvs.update(delta)
                else:
                    delta = release.puts
            except BaseException as e:
                for w in waiters:
                    if not w.done():
                        w.set_exception(e if isinstance(e, Exception) else PmiError(repr(e)))
            else:
                for w in waiters:
                    if not w.done():
                        w.set_result(delta)
        return await fut

    # ---- connection handling ---------------------------------------------------

    async def _serve_socket(self, sock: socket.socket, inst: _Instance) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        await self._serve(reader, writer, inst)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     inst: _Instance) -> None:
        inst.writer = writer
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ConnectionError, asyncio.LimitOverrunError, ValueError):
                    break
                if not line:
                    break  # EOF
                if not line.endswith(b"\n"):
                    break  # EOF in the middle of a line
                if not line.strip():
                    continue
                try:
                    if line.startswith(b"mcmd="):
                        reply = await self._mcmd(reader, inst, line)
                    else:
                        reply = await self._command(inst, line)
                except PmiError:
                    # protocol violation (e.g. barrier overflow, bad upstream
                    # data): drop the connection, reported as lost below
                    break
                if reply:
                    writer.write(reply.encode("utf-8", "surrogateescape"))
                    try:
                        await writer.drain()
                    except ConnectionError:
                        break
        finally:
            inst.writer = None
            writer.close()
            if not (inst.finalized or inst.aborted or self._closing):
                inst.lost = True
                if self.on_lost:
                    self.on_lost(inst.rank, inst.initialized)

    async def _handle(self, inst: _Instance, cmd: str, args: Dict[str, Optional[str]]
                      ) -> Optional[str]:
        if cmd == "init":
            inst.initialized = True
            if args.get("pmi_version") != "1":
                # PMI-2 clients send init pmi_version=2 over the v2 framing;
                # we only speak v1.
                return format_cmd("response_to_init", rc=1, pmi_version=1, pmi_subversion=1)
            return format_cmd("response_to_init", rc=0, pmi_version=1, pmi_subversion=1)
        if cmd == "get_maxes":
            return format_cmd("maxes", rc=0, kvsname_max=KVSNAME_MAX,
                              keylen_max=KEYLEN_MAX, vallen_max=VALLEN_MAX)
        if cmd == "get_appnum":
            return format_cmd("appnum", rc=0, appnum=self.appnums.get(inst.rank, self.appnum))
        if cmd == "get_universe_size":
            return format_cmd("universe_size", rc=0, size=self.universe_size)
        if cmd == "get_my_kvsname":
            return format_cmd("my_kvsname", rc=0, kvsname=self.kvsname)
        if cmd == "put":
            key, value = args.get("key") or "", args.get("value") or ""
            err = self.kvs.check(key, value)
            if err:
                return format_cmd("put_result", rc=1, msg=err)
            self.kvs.put(key, value)
            inst.puts[key] = value
            return format_cmd("put_result", rc=0)
        if cmd == "get":
            key = args.get("key") or ""
            val = self.kvs.get(key)
            if val is None and self.upstream is not None and not key.startswith("PMI_"):
                val = await self.upstream.get(key)
            if val is None:
                # Hydra answers rc=1 only (its msg lands on the query by a bug);
                # the client treats any rc != 0 as "not found".
                return format_cmd("get_result", rc=1, msg="key_not_found")
            return format_cmd("get_result", rc=0, value=val)
        if cmd == "barrier_in":
            puts, inst.puts = inst.puts, {}
            await self._enter(1, puts)
            return format_cmd("barrier_out", rc=0)
        if cmd == "finalize":
            inst.finalized = True
            return format_cmd("finalize_ack", rc=0)
        if cmd == "abort":
            inst.aborted = True
            try:
                code = int(args.get("exitcode") or "1")
            except ValueError:
                code = 1
            msg = args.get("message") or ""
            if self.on_abort:
                self.on_abort(inst.rank, code, msg)
            return None
        if cmd in _NAME_QUERIES:
            return await self._name(cmd, args)
        return self._unserved(inst, cmd)

    # ---- what poprun does not serve, names, spawn ------------------------------

    def _unserved(self, inst: _Instance, cmd: str, why: str = "") -> str:
        """The error reply to a command poprun does not serve, said to on_unserved."""
        if self.on_unserved:
            self.on_unserved(inst.rank, cmd, why or "poprun does not serve it")
        reply = _UNSUPPORTED_REPLIES.get(cmd)
        if reply is None:  # a name MPICH does not send: keep the reply one plain word
            word = "".join(c for c in cmd[:64] if c.isalnum() or c in "_-") or "unknown"
            reply = word + "_result"
        return format_cmd(reply, rc=1, msg=why or ("not_served_by_poprun" if cmd in
                                                   _UNSUPPORTED_REPLIES else "unknown_command"))

    async def _command(self, inst: _Instance, line: bytes) -> Optional[str]:
        try:
            cmd, args = parse(line)
        except PmiError:  # not a PMI-1 line (MPICH never sends one): an error, at once
            return self._unserved(inst, "", "not a PMI-1 command")
        return await self._handle(inst, cmd, args)

    async def _name(self, cmd: str, args: Dict[str, Optional[str]]) -> str:
        op, reply = _NAME_QUERIES[cmd]
        rc, value = await self.names.name(op, args.get("service") or "",
                                          args.get("port") or "")
        if rc:
            return format_cmd(reply, rc=rc, msg=value)
        return format_cmd(reply, rc=0, port=value if op == "lookup" else None)

    async def _mcmd(self, reader: asyncio.StreamReader, inst: _Instance,
                    first: bytes) -> str:
        """A multi-line command (MPICH sends only ``mcmd=spawn``): read to its end, bounded,
        and answer it; one that breaks the bounds is answered rc=1 and the connection
        dropped (its rest cannot be told from the next command)."""
        from .pmi1spawn import McmdReader, parse_spawn

        message = McmdReader()
        line = first
        try:
            while not message.feed(line):
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    raise PmiError("EOF in a spawn message")
        except (PmiError, ConnectionError, ValueError) as exc:
            self._unserved(inst, "spawn", f"{exc}: connection dropped")
            raise PmiError(str(exc)) from None
        try:
            request = parse_spawn(message.lines)
        except PmiError as exc:
            return self._unserved(inst, "spawn", str(exc))
        if self.on_spawn is None:
            return self._unserved(inst, "spawn", "spawn is not served on this host")
        fields = await self.on_spawn(inst.rank, request)
        if fields.get("rc") and self.on_unserved:
            self.on_unserved(inst.rank, "spawn", str(fields.get("msg")))
        return format_cmd("spawn_result", fields)


def checked_puts(value: object) -> Dict[str, str]:
    """A barrier's puts as another process sent them (a host's part, the root's delta):
    text keys and values, else PmiError. The one check of them on both sides."""
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PmiError("a barrier's puts that are not text keys and values")
    return value


class Root:
    """The root of one world across hosts: the job's key-value space (what every barrier
    brought, and a spawned world's preput keys), its published names, and each barrier as a
    fence over every rank (fences.FenceTable): each host enters it once, with its
    instances' puts, bounded and checked against the space; once every host has, each gets
    the epoch's delta. A host's part that cannot be one fails that host's barrier, never the
    root. `nodes`: each rank's host, as node indices. Every host's node-level world enters
    through FENCE_IN (`enter`), the launcher's own host's too (run/worlds/hostlink.py)."""

    def __init__(self, size: int, nodes: Iterable[int], names=None) -> None:
        from .fences import FenceTable

        self.ranks = tuple(range(size))
        self.kvs = KeyValueSpace(keys_max=KEYS_PER_RANK * size)
        self._fences = FenceTable(list(nodes), KEYS_PER_RANK * size)
        self._answers: Dict[object, Dict[int, Callable]] = {}
        if names is None:
            from .mpinames import NameService
            names = NameService()
        self.names = names

    def enter(self, fence, node: int, puts: object,
              answer: Callable[[Optional[Dict[str, str]], Optional[str]], None]) -> None:
        """`node` entered barrier `fence` (fences.FenceId: every rank, the barrier's
        number) with `puts`: `answer(delta, None)` once every host has, or `answer(None,
        why)` at once where its part cannot be one."""
        from .fences import FenceError

        try:
            if fence.ranks != self.ranks:
                raise FenceError("a barrier is over every rank of the world")
            puts = checked_puts(puts)
            err = self.kvs.check_batch(puts)
            if err:
                raise FenceError(err)
            complete = self._fences.contribute(fence, node, puts)
        except (FenceError, PmiError) as exc:
            answer(None, str(exc))
            return
        # Visible at once (gets before the barrier completes may see them; PMI only
        # promises visibility after it).
        self.kvs.update(puts)
        self._answers.setdefault(fence, {})[node] = answer
        if complete is None:
            return
        delta: Dict[str, str] = {}
        for part in complete[1]:  # in node order
            delta.update(part)
        for done in self._answers.pop(fence).values():
            done(delta, None)
