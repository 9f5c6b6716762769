"""A PMIx namespace's requests that go up a link, and their answers (docs/architecture.md,
"The instances' worlds"): what an agent's world sends the launcher, and what a PMIx
server's process sends its spawner, are the same frames. A fence this side's instances
entered goes up as FENCE_IN and comes back as FENCE_OUT with every host's data; a rank's
data from elsewhere is asked for with MODEX_WANT and comes back as MODEX_DATA.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from . import pmixplan
from ..protocol import Kind
from .pmixplan import ERROR, SUCCESS

Done = Callable[[int, bytes], None]


class Uplink:
    """`send(kind, **fields)`: one frame up the link; `hosts`: how many the world spans (a
    complete fence's data is every host's part, each at most pmixplan.MAX_FENCE_DATA)."""

    def __init__(self, kvsname: str, send: Callable[..., None], hosts: int) -> None:
        self.kvsname, self._send, self._hosts = kvsname, send, hosts
        self._fences: dict[tuple[tuple[int, ...], int], Done] = {}
        self._wants: dict[int, Done] = {}
        self._ids = itertools.count(1)

    def fence(self, fence: pmixplan.FenceId, data: bytes, done: Done) -> None:
        self._fences[(tuple(fence.ranks), fence.seq)] = done
        self._send(Kind.FENCE_IN, kvsname=self.kvsname, ranks=list(fence.ranks),
                   seq=fence.seq, data=pmixplan.b64(data))

    def direct_modex(self, rank: int, done: Done) -> None:
        want = next(self._ids)
        self._wants[want] = done
        self._send(Kind.MODEX_WANT, kvsname=self.kvsname, id=want, rank=rank)

    def answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """FENCE_OUT or MODEX_DATA: the waiting fence or request completes. Their data is
        decoded as the launcher decodes the agents' (pmixplan.decode_data: strict, bounded);
        data that cannot be is an error answered to the waiting server, never a fault of
        this side. Raises KeyError/TypeError/ValueError for other fields that cannot be."""
        if kind is Kind.FENCE_OUT:
            fence = pmixplan.fence_of(fields)
            done = self._fences.pop((fence.ranks, fence.seq), None)
            if done is not None:
                done(*_decoded(fields, pmixplan.MAX_FENCE_DATA * self._hosts))
        elif kind is Kind.MODEX_DATA:
            done = self._wants.pop(int(fields["id"]), None)
            if done is not None:
                status, data = _decoded(fields, pmixplan.MAX_MODEX)
                done(int(fields["status"]) if status == SUCCESS else status, data)

    def modex_got(self, ask: object) -> Done:
        """The answer to the MODEX_ASK `ask`: its MODEX_GOT, once the data is here."""
        return lambda status, blob: self._send(Kind.MODEX_GOT, kvsname=self.kvsname, id=ask,
                                               status=status, data=pmixplan.b64(blob))

    def close(self) -> None:
        """Nobody is left to complete what waits."""
        for done in [*self._fences.values(), *self._wants.values()]:
            done(ERROR, b"")
        self._fences.clear()
        self._wants.clear()


def _decoded(fields: dict[str, Any], limit: int) -> tuple[int, bytes]:
    """(SUCCESS, the data of a PMIx answer), or (ERROR, b"") where it is an error or cannot be
    data."""
    if fields.get("error"):
        return ERROR, b""
    try:
        return SUCCESS, pmixplan.decode_data(fields.get("data") or "", limit)
    except ValueError:
        return ERROR, b""
