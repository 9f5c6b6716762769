"""The launcher's own host as one more host of the job's MPI worlds (docs/architecture.md,
"The instances' worlds"): its instances are served by the same node-level worlds every
agent runs (spawner/worlds/nodeworld.HostWorlds), linked to the worlds' root here in-process.

The link carries the agent protocol's world frames, encoded and decoded as on an agent's
connection (a few hundred bytes per fence, against a wire-up's milliseconds), so the root
(run/worlds/pmi1.MpiWorld, run/worlds/pmix.PmixWorld) reads this host's word exactly as an
agent's, through the same checks: WORLD, the answers and WORLD_END go down, the world kinds
(spawner.protocol.WORLD_KINDS) come up. It has what the root uses of a RemoteSpawner (its
`host`, `open_world`, `end_world`, `tell`, `refused`), and what the launcher's spawner needs
to start a rank here (`attach`, `exited`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spawner.protocol import Control, Kind
    from spawner.worlds.nodeworld import HostWorlds


def _protocol():
    """The agent protocol's module (~4 ms of imports with the node-level world's), imported
    once a world opens here, not with this module: a job whose instances never speak MPI
    opens none (run/worlds/pmi1.MpiWorld.attach), and its launch stays where it was."""
    import spawner.protocol

    return spawner.protocol


class HostLink:
    """The job's worlds on the launcher's host (`host`: its label in the plan); `pmix`: its
    PMIx service (spawner.worlds.pmixhost.PmixHost), where Open MPI's world is served."""

    def __init__(self, host: str, loop: asyncio.AbstractEventLoop, lifeline,
                 pmix=None) -> None:
        self.host, self._pmix = host, pmix
        self._loop, self._lifeline = loop, lifeline
        self.refused = 0  # as RemoteSpawner.refused (run/worlds/pmi1.MpiWorld._refuse)
        self._roots: dict[str, Callable[[HostLink, Control], None]] = {}
        self._worlds: HostWorlds | None = None  # once a world opens here (`worlds`)

    @property
    def worlds(self) -> HostWorlds:
        """This host's node-level worlds (made when the first opens)."""
        if self._worlds is None:
            from spawner.worlds.nodeworld import HostWorlds

            decoder = _protocol().FrameDecoder
            self._up, self._down = decoder(), decoder()
            self._worlds = HostWorlds(self._loop, self._from_host, self._lifeline,
                                      self._pmix_host)
        return self._worlds

    def _pmix_host(self, fields: Mapping[str, Any], hostname: str):
        if self._pmix is None:
            raise LookupError("Open MPI's world is not served on the launcher's host")
        return self._pmix

    # --- the root's side (as spawner.remote.RemoteSpawner's) -----------------------------

    def open_world(self, on_world: Callable[[HostLink, Control], None],
                   **fields: Any) -> None:
        """WORLD: the world's ranks here served; its frames up go to `on_world`."""
        self._roots[fields["kvsname"]] = on_world
        self.tell(_protocol().Kind.WORLD, **fields)

    def end_world(self, kvsname: str) -> asyncio.Task | None:
        """WORLD_END: the task that ends it here (its result: the paths of MPICH's
        leftovers removed), None where it was not open."""
        if self._roots.pop(kvsname, None) is None:
            return None
        return self._send_down(_protocol().Kind.WORLD_END, kvsname=kvsname)

    def tell(self, kind: Kind, **fields: Any) -> None:
        self._send_down(kind, **fields)

    def _send_down(self, kind: Kind, **fields: Any) -> asyncio.Task | None:
        protocol = _protocol()
        task = None
        worlds = self.worlds
        for frame in self._down.feed(protocol.encode(kind, **fields)):
            if not (isinstance(frame, protocol.Control) and frame.kind in protocol.DOWN_KINDS):
                raise protocol.ProtocolError(f"not a world's frame down its link: {frame!r:.100}")
            task = worlds.handle(frame.kind, frame.fields)
        return task

    # --- the host's side ------------------------------------------------------------------

    def _from_host(self, data: bytes) -> None:
        """A node-level world's frame up the link, read as RemoteSpawner reads an agent's."""
        from spawner.worlds.nodeworld import answer_no_world

        protocol = _protocol()
        for frame in self._up.feed(data):
            if not (isinstance(frame, protocol.Control) and frame.kind in protocol.WORLD_KINDS
                    and isinstance(frame.fields.get("kvsname"), str)):
                raise protocol.ProtocolError(f"not a world's frame up its link: {frame!r:.100}")
            on_world = self._roots.get(frame.fields["kvsname"])
            if on_world is not None:
                on_world(self, frame)
            else:  # a world that has ended
                answer_no_world(self.tell, frame)

    def attach(self, kvsname: str, rank: int, environ: Mapping[str, str] | None = None
               ) -> tuple[dict[str, str], socket.socket]:
        """A rank here: its end of its PMI socket and the variables its host gives it
        (nodeworld.AgentWorld.attach)."""
        return self.worlds[kvsname].attach(rank, dict(environ) if environ is not None else None)

    def exited(self, kvsname: str, rank: int) -> None:
        """A rank here exited (nodeworld.AgentWorld.exited: lost to its peers?)."""
        world = self._worlds.get(kvsname) if self._worlds is not None else None
        if world is not None:
            world.exited(rank)
