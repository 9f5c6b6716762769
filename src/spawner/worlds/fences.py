"""One protocol for what crosses hosts in every world (docs/architecture.md, "The instances'
worlds"): a fence. PMI-1's barrier is a fence over every rank of its world; PMIx's fences
are over the ranks that call them. Each host's node-level world enters a fence once for all
of its instances (FENCE_IN: the fence's ranks, its sequence number, the host's part); the
root (the launcher) combines the hosts' parts (`FenceTable`) and answers each host that took
part once every such host has (FENCE_OUT). Pure: no I/O.

A fence is named by its participants and how many fences over that same set came before, so
that every host names the n-th fence alike (PMIx allows concurrent fences on different sets,
never two on one set at once). What a host sends is another host's word: bounded and
checked here, a bad part failing that host's fence, never the root.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any, NamedTuple

MAX_OPEN_FENCES = 1024  # fences begun and not complete, in one world
MAX_CONNECT_NSPACES = 64  # namespaces one connect or group may span
MAX_CROSS_RANKS = 1 << 20  # ranks one connect across namespaces may name, in all
NSPACE_MAX = 255  # PMIX_MAX_NSLEN: a namespace is a char[256]

Sets = tuple[tuple[str, tuple[int, ...]], ...]


class FenceId(NamedTuple):
    """A fence, as hosts agree on it: the ranks taking part and how many fences over that
    same set this host has entered before."""

    ranks: tuple[int, ...]
    seq: int
    # A PMIx connect or group over several namespaces: each one's ranks, by namespace in
    # order (`ranks` then the set of the namespace whose link it goes up; `seq` counts per
    # sets)
    sets: Sets = ()


def fence_of(fields: dict) -> FenceId:
    """The fence a FENCE_IN or FENCE_OUT frame names, its `sets` where it spans several
    namespaces (another process's word: KeyError, TypeError or ValueError where its fields
    cannot be one)."""
    return FenceId(tuple(int(r) for r in fields["ranks"]), int(fields["seq"]),
                   parse_sets(fields.get("sets"), MAX_CROSS_RANKS))


def parse_sets(value: object, limit: int) -> Sets:
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


def sets_json(sets: Sets) -> list:
    return [[nspace, list(ranks)] for nspace, ranks in sets]


class FenceError(ValueError):
    """A host's fence contribution that cannot be one (hostile or broken)."""


class FenceTable:
    """The root's view of one world's fences across hosts. `nodes`: each rank's host (its
    node index); `limit`: the most one host's part may hold (its `len`: PMIx's bytes,
    PMI-1's keys). Each host that holds a participant contributes once; the fence is
    complete when every such host has."""

    def __init__(self, nodes: Sequence[int], limit: int) -> None:
        self.nodes, self.limit = list(nodes), limit
        self._open: dict[FenceId, dict[int, object]] = {}

    def contribute(self, fence: FenceId, node: int, part
                   ) -> tuple[list[int], list] | None:
        """Record `node`'s part; when the fence is complete, (the nodes to answer, their
        parts, both in node order). FenceError for a part that cannot be one (nothing is
        recorded)."""
        ranks, size = fence.ranks, len(self.nodes)
        if (not ranks or len(ranks) > size or list(ranks) != sorted(set(ranks))
                or ranks[0] < 0 or ranks[-1] >= size or fence.seq < 0):
            raise FenceError(f"a fence over ranks that are not this world's: {ranks[:8]}")
        needed = {self.nodes[rank] for rank in ranks}
        if node not in needed:
            raise FenceError(f"node {node} holds no rank of that fence")
        if len(part) > self.limit:
            raise FenceError(f"{len(part)} for one fence, past {self.limit}")
        parts = _entered(self._open, fence, node, f"node {node}", f"fence {fence.seq}")
        parts[node] = part
        if set(parts) != needed:
            return None
        del self._open[fence]
        nodes = sorted(parts)
        return nodes, [parts[n] for n in nodes]


class CrossTable:
    """The root's fences, connects and groups over several namespaces of the job's PMIx
    worlds (`worlds`, by namespace: spawner/worlds/pmixplan.World): each host holding a
    participant enters once, by the link of one namespace it holds a participant of;
    complete when every such host has, their data then concatenated in host order (at most
    `limit` bytes in all)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.worlds: dict[str, Any] = {}
        self._open: dict[tuple, dict[str, tuple[str, bytes]]] = {}

    def enter(self, fence: FenceId, nspace: str, host: str, data: bytes = b""
              ) -> tuple[dict[str, str], bytes] | None:
        """`host` entered `fence` by `nspace`'s link with `data`; once all have: each host's
        namespace (to answer it by), and all their data. FenceError for an entry that
        cannot be one."""
        needed = set()
        for name, ranks in fence.sets:
            w = self.worlds.get(name)
            if w is None or not ranks or ranks[-1] >= w.size:
                raise FenceError(f"a connect over namespace {name[:80]}, not the job's, or "
                                 "ranks outside it")
            needed.update(_hosts(w, ranks))
        w = self.worlds.get(nspace)
        if (fence.seq < 0 or w is None or dict(fence.sets).get(nspace) != fence.ranks
                or host not in _hosts(w, fence.ranks)):
            raise FenceError(f"{host} entered a connect by a namespace it holds no "
                             "participant of")
        key = (fence.sets, fence.seq)
        entered = _entered(self._open, key, host, host, f"connect {fence.seq}")
        if len(data) + sum(len(d) for _, d in entered.values()) > self.limit:
            raise FenceError(f"more than {self.limit} bytes for one connect")
        entered[host] = (nspace, data)
        if set(entered) != needed:
            return None
        del self._open[key]
        return ({h: n for h, (n, _) in entered.items()},
                b"".join(entered[h][1] for h in sorted(entered)))


def _hosts(w: Any, ranks: Sequence[int]) -> set[str]:
    """The names of the hosts of world `w` (a pmixplan.World) that hold any of `ranks`."""
    return {w.names[w.nodes[r]] for r in ranks}


def _entered(table: dict, key: Any, who: Any, name: str, what: str) -> dict:
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
    """Bytes in a JSON frame (spawner/protocol.py)."""
    return base64.b64encode(data).decode()


def decode_data(text: object, limit: int) -> bytes:
    """The bytes of a frame's base64 `data` field, at most `limit` of them: ValueError for
    anything else (not a string, longer than `limit` bytes could encode, not strict base64).
    The one decoder of data from another process: the launcher reads what agents send,
    an agent what the launcher sends, a PMIx server's process and its spawner what the other
    sends (docs/architecture.md, "Runtime guarantees")."""
    if not isinstance(text, str) or len(text) > (limit + 2) // 3 * 4:
        raise ValueError("no data, or too much")
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from None
