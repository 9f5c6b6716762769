"""The launcher's own host is one more host of an MPI world (docs/architecture.md, "The
instances' worlds"): its ranks are served by the agents' node-level world
(spawner/worlds/nodeworld.py), which reaches the world's root by the agent protocol's frames
over run/worlds/hostlink.py, as an agent's does over its connection. Real PMI-1 servers and
sockets; the ranks are PMI-1 clients speaking raw lines (test_pmi.Client)."""

from __future__ import annotations

import asyncio

import pytest

from poprun.run.worlds.hostlink import HostLink
from poprun.run.worlds.pmi1 import MpiWorld
from spawner.protocol import Kind, ProtocolError, encode
from test_pmi import Client, run

pytestmark = pytest.mark.timeout(20)

KVS = "poprun-hostlink-0"


def world_here(loop, frames: list, hosts=("here", "here")) -> tuple[MpiWorld, HostLink]:
    """A world whose ranks on "here" are served through a HostLink whose frames up are
    recorded in `frames` (kind, fields) before the root reads them."""
    link = HostLink("here", loop, None)
    up = link._from_host

    def spied(data: bytes) -> None:
        from spawner.protocol import FrameDecoder

        frames.extend((f.kind, f.fields) for f in FrameDecoder().feed(data))
        up(data)

    link.worlds._send = spied
    world = MpiWorld(KVS, list(hosts), loop, here=link, on_abort=lambda *a: None,
                     on_lost=lambda *a: None)
    return world, link


def test_the_launchers_host_enters_the_root_by_one_fence_in_per_barrier():
    """Two ranks here: their barrier reaches the root as ONE FENCE_IN of PMI-1's with both
    ranks' puts, a key the host has not seen as a GET, each answered as an agent's is."""
    async def main():
        frames = []
        world, _ = world_here(asyncio.get_running_loop(), frames)
        await world.ready()
        clients = []
        for rank in range(2):
            env, theirs = world.attach(rank)
            assert env["PMI_RANK"] == str(rank) and env["PMI_SIZE"] == "2"
            assert env["PMI_FD"] == str(theirs.fileno())
            clients.append(await Client.over(theirs))
        for rank, client in enumerate(clients):
            assert (await client.ask("cmd=init pmi_version=1 pmi_subversion=1")).endswith(
                "rc=0 pmi_version=1 pmi_subversion=1")
            await client.send(f"cmd=put kvsname={KVS} key=k{rank} value=v{rank}")
            assert await client.recv() == "cmd=put_result rc=0"
        for client in clients:
            await client.send("cmd=barrier_in")
        for client in clients:
            assert await client.recv() == "cmd=barrier_out rc=0"
        fences = [f for kind, f in frames if kind is Kind.FENCE_IN]
        assert [(f["of"], f["ranks"], f["puts"]) for f in fences] == [
            ("pmi1", [0, 1], {"k0": "v0", "k1": "v1"})]
        assert world.root.kvs.get("k1") == "v1"  # the root holds what the host brought
        assert await clients[0].ask(f"cmd=get kvsname={KVS} key=k1") == \
            "cmd=get_result rc=0 value=v1"
        world.root.kvs.put("late", "x")  # after the barrier: asked of the root
        assert await clients[0].ask(f"cmd=get kvsname={KVS} key=late") == \
            "cmd=get_result rc=0 value=x"
        assert [(f["kvsname"], f["key"]) for kind, f in frames if kind is Kind.GET] == [
            (KVS, "late")]
        for client in clients:
            client.close()
        assert await world.close() == []  # MPICH made no segment: nothing to remove
    run(main())


def test_what_goes_up_the_link_is_checked_as_an_agents_words():
    """A frame up the link that is not a world's (kind, or a kvsname not text) is a
    ProtocolError, as on an agent's connection; one for a world that has ended is answered
    as refused (the GET's rank must not wait)."""
    async def main():
        frames = []
        _, link = world_here(asyncio.get_running_loop(), frames)
        for bad in (encode(Kind.EXIT, key=0, returncode=0),
                    encode(Kind.GET, kvsname=3, id=1, key="k")):
            with pytest.raises(ProtocolError):
                link._from_host(bad)
        answered = []
        link.worlds.handle = lambda kind, fields: answered.append((kind, fields))
        link._from_host(encode(Kind.GET, kvsname="poprun-ended", id=4, key="k"))
        assert answered == [(Kind.VALUE, {"kvsname": "poprun-ended", "id": 4,
                                          "value": None})]
    run(main())
