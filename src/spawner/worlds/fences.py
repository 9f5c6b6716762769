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
from typing import NamedTuple

MAX_OPEN_FENCES = 1024  # fences begun and not complete, in one world


class FenceId(NamedTuple):
    """A fence, as hosts agree on it: the ranks taking part and how many fences over that
    same set this host has entered before."""

    ranks: tuple[int, ...]
    seq: int


def fence_of(fields: dict) -> FenceId:
    """The fence a FENCE_IN or FENCE_OUT frame names (another process's word: KeyError,
    TypeError or ValueError where its fields cannot be one)."""
    return FenceId(tuple(int(r) for r in fields["ranks"]), int(fields["seq"]))


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
        parts = self._open.get(fence)
        if parts is None:
            if len(self._open) >= MAX_OPEN_FENCES:
                raise FenceError(f"more than {MAX_OPEN_FENCES} fences open")
            parts = self._open[fence] = {}
        if node in parts:
            raise FenceError(f"node {node} entered fence {fence.seq} twice")
        parts[node] = part
        if set(parts) != needed:
            return None
        del self._open[fence]
        nodes = sorted(parts)
        return nodes, [parts[n] for n in nodes]


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
