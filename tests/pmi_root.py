"""A node-level PMI-1 server's upstream straight into a world's real root
(spawner/worlds/pmi1.Root), in this process, for tests of the servers and the root without a
link between them. Poprun itself links every host's node-level world to the root by frames
(docs/architecture.md, "The instances' worlds"); this skips only the frames: each barrier is
a fence over every rank, numbered as a host's world numbers them, entered with the host's
puts and answered by the root's delta or error, as FENCE_IN and FENCE_OUT carry them."""

from __future__ import annotations

import asyncio

from spawner.worlds import pmi1
from spawner.worlds.fences import FenceId


class RootUpstream(pmi1.Upstream):
    """Host `node`'s way into `root`: its barriers, gets and names answered there."""

    def __init__(self, root: pmi1.Root, node: int) -> None:
        self.root, self.node, self._seq = root, node, 0

    async def barrier(self, puts):
        future = asyncio.get_running_loop().create_future()

        def done(delta, error) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(pmi1.PmiError(error))
            else:
                future.set_result(delta)

        fence, self._seq = FenceId(self.root.ranks, self._seq), self._seq + 1
        self.root.enter(fence, self.node, puts, done)
        return await future

    async def get(self, key):
        return self.root.kvs.get(key)

    async def name(self, op, service, port=""):
        return self.root.names.answer(op, service, port)
