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
from .protocol import Kind

ERROR = -1  # PMIx's PMIX_ERROR: a fence or a request nobody is left to complete
Done = Callable[[int, bytes], None]


class Uplink:
    """`send(kind, **fields)`: one frame up the link."""

    def __init__(self, kvsname: str, send: Callable[..., None]) -> None:
        self.kvsname, self._send = kvsname, send
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
        """FENCE_OUT or MODEX_DATA: the waiting fence or request completes. Raises
        KeyError/TypeError/ValueError for fields that cannot be one."""
        if kind is Kind.FENCE_OUT:
            done = self._fences.pop((tuple(int(r) for r in fields["ranks"]),
                                     int(fields["seq"])), None)
            if done is not None:
                error = fields.get("error")
                done(ERROR if error else 0,
                     b"" if error else pmixplan.unb64(fields.get("data") or "",
                                                      pmixplan.MAX_FENCE_DATA))
        elif kind is Kind.MODEX_DATA:
            done = self._wants.pop(int(fields["id"]), None)
            if done is not None:
                done(int(fields["status"]),
                     pmixplan.unb64(fields.get("data") or "", pmixplan.MAX_MODEX))

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
