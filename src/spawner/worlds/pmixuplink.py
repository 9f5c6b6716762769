"""A PMIx namespace's requests that go up a link, and their answers (docs/architecture.md,
"The instances' worlds"): what an agent's world sends the launcher, and what a PMIx
server's process sends its spawner, are the same frames. A fence this side's instances
entered goes up as FENCE_IN and comes back as FENCE_OUT with every host's data; a rank's
data from elsewhere is asked for with MODEX_WANT and comes back as MODEX_DATA; a name of the
job's table (PMIx_Publish, _Lookup, _Unpublish) with NAME, answered by NAMED; a spawn
(PMIx_Spawn) with SPAWN_ASK, answered by SPAWNED_ANSWER, the new world's name in its reply
(run/worlds/spawn.py); a request answered with an error at once, for the launcher's -v, is said
with PMI_UNSERVED.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from . import pmixplan
from ..protocol import Kind
from .pmixplan import ERROR, SUCCESS

Done = Callable[[int, bytes], None]
Spawned = Callable[[int, str], None]  # a spawn's status and its world's name


class Uplink:
    """`send(kind, **fields)`: one frame up the link; `hosts`: how many the world spans (a
    complete fence's data is every host's part, each at most pmixplan.MAX_FENCE_DATA)."""

    def __init__(self, kvsname: str, send: Callable[..., None], hosts: int) -> None:
        self.kvsname, self._send, self._hosts = kvsname, send, hosts
        self._fences: dict[pmixplan.FenceId, Done] = {}
        self._wants: dict[int, Done] = {}
        self._spawns: dict[int, Spawned] = {}
        self._names: dict[int, Callable[[int, str], None]] = {}
        self._ids = itertools.count(1)

    def fence(self, fence: pmixplan.FenceId, data: bytes, done: Done) -> None:
        self._fences[fence] = done
        sets = {"sets": pmixplan.sets_json(fence.sets)} if fence.sets else {}
        self._send(Kind.FENCE_IN, kvsname=self.kvsname, ranks=list(fence.ranks),
                   seq=fence.seq, data=pmixplan.b64(data), **sets)

    def direct_modex(self, rank: int, done: Done) -> None:
        want = next(self._ids)
        self._wants[want] = done
        self._send(Kind.MODEX_WANT, kvsname=self.kvsname, id=want, rank=rank)

    def spawn(self, rank: int, request: dict, done: Spawned) -> None:
        ask = next(self._ids)
        self._spawns[ask] = done
        self._send(Kind.SPAWN_ASK, kvsname=self.kvsname, id=ask, key=rank,
                   request={"pmix": request})

    def name(self, request, done: Callable[[int, str], None]) -> None:
        """One name of the job's table (spawner.worlds.pmixserver.NameRequest): `done(rc, port or
        why)`, rc 0 or 1 as spawner.worlds.mpinames.NameService answers."""
        ask = next(self._ids)
        self._names[ask] = done
        self._send(Kind.NAME, kvsname=self.kvsname, id=ask, key=request.rank, op=request.op,
                   service=request.service, port=request.port, wait=request.wait,
                   once=request.once)

    def unserved(self, rank: int, what: str, why: str) -> None:
        self._send(Kind.PMI_UNSERVED, kvsname=self.kvsname, key=rank, cmd=f"PMIx {what}",
                   why=why)

    def answered(self, kind: Kind, fields: dict[str, Any]) -> None:
        """FENCE_OUT, MODEX_DATA, NAMED or SPAWNED_ANSWER: the waiting fence or request
        completes. Their data is decoded as the launcher decodes the agents'
        (pmixplan.decode_data: strict, bounded); data that cannot be is an error answered to
        the waiting server, never a fault of this side. Raises KeyError/TypeError/ValueError
        for other fields that cannot be."""
        if kind is Kind.FENCE_OUT:
            done = self._fences.pop(pmixplan.fence_of(fields), None)
            if done is not None:
                done(*_decoded(fields, pmixplan.MAX_FENCE_DATA * self._hosts))
        elif kind is Kind.NAMED:
            done = self._names.pop(int(fields["id"]), None)
            if done is not None:
                done(int(fields["rc"]), str(fields.get("value") or ""))
        elif kind is Kind.MODEX_DATA:
            done = self._wants.pop(int(fields["id"]), None)
            if done is not None:
                status, data = _decoded(fields, pmixplan.MAX_MODEX)
                done(int(fields["status"]) if status == SUCCESS else status, data)
        elif kind is Kind.SPAWNED_ANSWER:
            done = self._spawns.pop(int(fields["id"]), None)
            if done is not None:
                done(*spawn_status(fields.get("reply")))

    def modex_got(self, ask: object) -> Done:
        """The answer to the MODEX_ASK `ask`: its MODEX_GOT, once the data is here."""
        return lambda status, blob: self._send(Kind.MODEX_GOT, kvsname=self.kvsname, id=ask,
                                               status=status, data=pmixplan.b64(blob))

    def close(self) -> None:
        """Nobody is left to complete what waits."""
        for done in [*self._fences.values(), *self._wants.values()]:
            done(ERROR, b"")
        for spawned in self._spawns.values():
            spawned(ERROR, "")
        for named in self._names.values():
            named(1, "the world ended")
        self._fences.clear()
        self._wants.clear()
        self._names.clear()
        self._spawns.clear()


def spawn_status(reply: object) -> tuple[int, str]:
    """A spawn's reply (pmi1spawn.spawn_reply's fields, `world` its new world's name) as
    PMIx's answer: (0, the namespace), or (ERROR, "") for a refusal or a reply that cannot
    be one."""
    if isinstance(reply, dict) and reply.get("rc") == 0 and isinstance(
            reply.get("world"), str) and 0 < len(reply["world"]) <= pmixplan.NSPACE_MAX:
        return 0, reply["world"]
    return ERROR, ""


def _decoded(fields: dict[str, Any], limit: int) -> tuple[int, bytes]:
    """(SUCCESS, the data of a PMIx answer), or (ERROR, b"") where it is an error or cannot be
    data."""
    if fields.get("error"):
        return ERROR, b""
    try:
        return SUCCESS, pmixplan.decode_data(fields.get("data") or "", limit)
    except ValueError:
        return ERROR, b""
