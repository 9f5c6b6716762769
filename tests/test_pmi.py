"""spawner/worlds/pmi1.py, the PMI-1 server behind the instances' MPI world: the pure
protocol core, then the server against fake clients over real sockets (one session, abort and
lost connections, an agent's forwarding: one upstream call per host and barrier). The real
MPICH + mpi4py worlds are tests/test_mpi_world.py's.

The protocol is MPICH's simple PMI (pmodels/mpich: src/pmi/src/pmi_v1.c, pmi_wire.c,
src/pmi/maint/pmi-1.1.txt) and Hydra's server side (src/pm/hydra/proxy/pmip_pmi.c).
"""

import asyncio
import os
import re

import pytest

from spawner.worlds import pmi1
from spawner.worlds.fences import FenceId
from spawner.reaphere import mpich_shm_leftovers, mpich_world_ids

from pmi_root import RootUpstream

T = pytest.mark.timeout


def run(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ===================================================================== pure

@T(5)
def test_parse_basic():
    assert pmi1.parse("cmd=init pmi_version=1 pmi_subversion=1\n") == (
        "init", {"pmi_version": "1", "pmi_subversion": "1"})
    assert pmi1.parse(b"cmd=get_maxes\n") == ("get_maxes", {})
    assert pmi1.parse("cmd=barrier_in") == ("barrier_in", {})
    # extra spaces are tolerated, like pmi_wire.c SKIP_SPACES
    assert pmi1.parse("cmd=get  kvsname=k   key=a \n") == ("get", {"kvsname": "k", "key": "a"})


@T(5)
def test_parse_put_value_runs_to_end_of_line():
    cmd, a = pmi1.parse("cmd=put kvsname=kvs-1 key=bc-0 value=tcp://h:1 x=y  z\\q\n")
    assert cmd == "put"
    assert a == {"kvsname": "kvs-1", "key": "bc-0", "value": "tcp://h:1 x=y  z\\q"}
    cmd, a = pmi1.parse("cmd=abort exitcode=3 message=PMI_Init failed badly\n")
    assert (cmd, a) == ("abort", {"exitcode": "3", "message": "PMI_Init failed badly"})
    # empty value
    assert pmi1.parse("cmd=put kvsname=k key=a value=\n")[1]["value"] == ""


@T(5)
def test_parse_escapes_and_flags():
    cmd, a = pmi1.parse(r"cmd=get_result rc=0 value=a\ b\\c endcmd")
    assert cmd == "get_result"
    assert a == {"rc": "0", "value": "a b\\c", "endcmd": None}


@T(5)
def test_parse_errors():
    for bad in ["", "\n", "init pmi_version=1", "mcmd=spawn\n", "cmd=\n", "cmd=x =y\n"]:
        with pytest.raises(pmi1.PmiError):
            pmi1.parse(bad)


@T(5)
def test_format():
    assert pmi1.format_cmd("barrier_out", rc=0) == "cmd=barrier_out rc=0\n"
    assert pmi1.format_cmd("maxes", rc=0, kvsname_max=256, keylen_max=64, vallen_max=1024) == \
        "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n"
    assert pmi1.format_cmd("get_result", rc=0, value="a b") == "cmd=get_result rc=0 value=a\\ b\n"
    assert pmi1.format_cmd("x", {"spawner-jobid": "j"}, a=None) == "cmd=x spawner-jobid=j\n"
    with pytest.raises(pmi1.PmiError):
        pmi1.format_cmd("get_result", value="a\nb")
    # round trip through the MPICH-style parser
    for v in ["plain", "a b", "back\\slash", " lead", "trail ", "x=y", "(vector,(0,2,4))"]:
        assert pmi1.parse(pmi1.format_cmd("get_result", rc=0, value=v))[1]["value"] == v


def mpl_rankmap_str_to_array(s, sz):
    """Python port of MPICH's MPL_rankmap_str_to_array (mpl_rankmap.c),
    including its wrap-around for short mappings, to check our output."""
    m = re.fullmatch(r"\(vector,(.*)\)", s)
    assert m, s
    blocks = [tuple(map(int, b)) for b in re.findall(r"\((\d+),(\d+),(\d+)\)", m.group(1))]
    assert "(" + "),(".join(",".join(map(str, b)) for b in blocks) + ")" == m.group(1)
    out = []
    while len(out) < sz:
        start = len(out)
        for x, y, z in blocks:
            for i in range(y):
                for _ in range(z):
                    if len(out) < sz:
                        out.append(x + i)
        assert len(out) > start
    return out


@T(5)
def test_process_mapping():
    assert pmi1.process_mapping([4]) == "(vector,(0,1,4))"
    assert pmi1.process_mapping([4, 4]) == "(vector,(0,2,4))"
    assert pmi1.process_mapping([4, 4, 2]) == "(vector,(0,2,4),(2,1,2))"
    assert pmi1.process_mapping([2, 4, 4, 1, 1]) == "(vector,(0,1,2),(1,2,4),(3,2,1))"
    assert pmi1.process_mapping([2, 0, 2]) == "(vector,(0,1,2),(2,1,2))"
    with pytest.raises(ValueError):
        pmi1.process_mapping([])
    with pytest.raises(ValueError):
        pmi1.process_mapping([0, 0])
    for counts in ([4], [4, 4], [4, 4, 2], [1, 3, 3, 3, 2], [2, 0, 2], [1] * 7):
        expect = [i for i, c in enumerate(counts) for _ in range(c)]
        assert mpl_rankmap_str_to_array(pmi1.process_mapping(counts), sum(counts)) == expect


@T(5)
def test_process_mapping_for_ranks():
    rr = [0, 1, 0, 1]  # round robin over 2 nodes
    s = pmi1.process_mapping_for_ranks(rr)
    assert s == "(vector,(0,2,1),(0,2,1))"
    assert mpl_rankmap_str_to_array(s, 4) == rr
    weird = [3, 3, 0, 0, 1, 1, 2, 5]
    assert mpl_rankmap_str_to_array(pmi1.process_mapping_for_ranks(weird), 8) == weird


@T(5)
def test_kvs():
    kvs = pmi1.KeyValueSpace({"PMI_process_mapping": "(vector,(0,1,2))"})
    kvs.put("a", "1")
    kvs.put("a", "2")  # replace, as Hydra does
    assert kvs.get("a") == "2" and "a" in kvs and len(kvs) == 1
    assert kvs.get("PMI_process_mapping") == "(vector,(0,1,2))"
    assert kvs.get("PMI_hwloc_xmlfile") is None and kvs.get("b") is None
    assert kvs.check("PMI_x", "v") and kvs.check("k" * 65, "v") and kvs.check("k", "v" * 1025)
    with pytest.raises(pmi1.PmiError):
        kvs.put("PMI_x", "v")
    kvs.update({"b": "3"})
    assert kvs.snapshot() == {"a": "2", "b": "3"}


@T(5)
def test_a_world_holds_a_bounded_number_of_keys():
    """An instance that puts key after key is refused past KEYS_PER_RANK a rank; a key it
    already holds can still change."""
    async def main():
        srv = pmi1.PmiServer("poprun-t9-0", 1)
        client = await Client.over(srv.attach(0))
        await client.ask("cmd=init pmi_version=1 pmi_subversion=1")
        for i in range(pmi1.KEYS_PER_RANK):
            assert await client.ask(f"cmd=put kvsname=poprun-t9-0 key=k{i} value=v") == \
                "cmd=put_result rc=0"
        assert await client.ask("cmd=put kvsname=poprun-t9-0 key=more value=v") == \
            "cmd=put_result rc=1 msg=too_many_keys"
        assert await client.ask("cmd=put kvsname=poprun-t9-0 key=k0 value=w") == \
            "cmd=put_result rc=0"
        client.close()
        await srv.close()
    run(main())


@T(5)
def test_barrier_counts_groups_and_deltas():
    b = pmi1.Barrier(5)
    assert b.enter(1, {"r0": "a"}) is None
    assert b.enter(2, {"agent1-x": "b", "r0": "A"}) is None  # a group of 2
    assert b.enter(1) is None
    rel = b.enter(1, {"r4": "c"})
    assert rel.epoch == 0 and rel.puts == {"r0": "A", "agent1-x": "b", "r4": "c"}
    # next epoch starts empty; the delta only carries that epoch's puts
    assert b.epoch == 1 and b.arrived == 0
    assert b.enter(5, {"z": "1"}) == pmi1.BarrierRelease(1, {"z": "1"})
    assert b.enter(3) is None
    with pytest.raises(pmi1.PmiError):
        b.enter(3)
    with pytest.raises(pmi1.PmiError):
        b.enter(0)
    with pytest.raises(ValueError):
        pmi1.Barrier(0)


@T(5)
def test_mpich_shm_names_and_their_removal(tmp_path):
    # Measured with the mpich 5.0.2 wheel: kvsname -> /dev/shm/mpich_shm_<id>_<node>.
    ids = mpich_world_ids("poprun-9578671fc968-0")
    assert ids[0] == 0xdaabe4fa
    assert mpich_world_ids("poprun-28fc5b8289c9-0")[0] == 0x837547d6
    name = "poprun-42ea10077066-0"
    assert mpich_world_ids(name)[0] == 0xb83f0d2  # written unpadded: b83f0d2
    keep = ["mpich_shm_b83f0d2_x", "mpich_shm_b83f0d3_0", "other"]
    drop = ["mpich_shm_b83f0d2_0", "mpich_shm_b83f0d2_12", "mpich_vci_b83f0d2_1",
            "mpich_shm_%x_0" % mpich_world_ids(name)[2]]  # MPICH's newer naming, 2nd init
    for f in keep + drop:
        (tmp_path / f).write_text("")
    found = mpich_shm_leftovers(name, shm_dir=str(tmp_path))
    assert sorted(os.path.basename(p) for p in found) == sorted(drop)


# ============================================= protocol, fake clients, no MPI

class Client:
    """A fake PMI client speaking raw lines over the child socket."""

    def __init__(self, reader, writer):
        self.r, self.w = reader, writer

    @classmethod
    async def over(cls, sock):
        r, w = await asyncio.open_unix_connection(sock=sock)
        return cls(r, w)

    async def send(self, line):
        self.w.write(line.encode() + b"\n")
        await self.w.drain()

    async def recv(self):
        return (await asyncio.wait_for(self.r.readline(), 5)).decode().rstrip("\n")

    async def ask(self, line):
        await self.send(line)
        return await self.recv()

    def close(self):
        self.w.close()


@T(15)
def test_server_session_fd():
    async def main():
        srv = pmi1.PmiServer("poprun-t1-0", 2, process_mapping=pmi1.process_mapping([2]))
        socks = [srv.attach(r) for r in range(2)]
        assert srv.env(1, fd=socks[1].fileno()) == {
            "PMI_FD": str(socks[1].fileno()), "PMI_RANK": "1", "PMI_SIZE": "2"}
        c0, c1 = [await Client.over(s) for s in socks]
        assert await c0.ask("cmd=init pmi_version=1 pmi_subversion=1") == \
            "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"
        assert await c0.ask("cmd=get_maxes") == \
            "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024"
        assert await c0.ask("cmd=get_appnum") == "cmd=appnum rc=0 appnum=0"
        assert await c0.ask("cmd=get_universe_size") == "cmd=universe_size rc=0 size=2"
        assert await c0.ask("cmd=get_my_kvsname") == "cmd=my_kvsname rc=0 kvsname=poprun-t1-0"
        assert await c0.ask("cmd=get kvsname=poprun-t1-0 key=PMI_process_mapping") == \
            "cmd=get_result rc=0 value=(vector,(0,1,2))"
        assert (await c0.ask("cmd=get kvsname=poprun-t1-0 key=PMI_hwloc_xmlfile")
                ).startswith("cmd=get_result rc=1")
        assert await c0.ask("cmd=put kvsname=poprun-t1-0 key=k0 value=v 0") == \
            "cmd=put_result rc=0"
        assert (await c0.ask("cmd=put kvsname=poprun-t1-0 key=PMI_x value=1")
                ).startswith("cmd=put_result rc=1")
        assert await c1.ask("cmd=init pmi_version=1 pmi_subversion=1") != ""
        assert await c1.ask("cmd=put kvsname=poprun-t1-0 key=k1 value=v1") == "cmd=put_result rc=0"
        # barrier: c0 waits until c1 enters
        await c0.send("cmd=barrier_in")
        pending = asyncio.ensure_future(c0.r.readline())
        done, _ = await asyncio.wait({pending}, timeout=0.2)
        assert not done                       # c0 is held until c1 enters
        assert await c1.ask("cmd=barrier_in") == "cmd=barrier_out rc=0"
        assert await asyncio.wait_for(pending, 5) == b"cmd=barrier_out rc=0\n"
        assert await c1.ask("cmd=get kvsname=poprun-t1-0 key=k0") == \
            "cmd=get_result rc=0 value=v\\ 0"
        assert await c0.ask("cmd=get kvsname=poprun-t1-0 key=k1") == "cmd=get_result rc=0 value=v1"
        assert (await c0.ask("cmd=spawn_whatever")).endswith("rc=1 msg=unknown_command")
        assert await c0.ask("cmd=finalize") == "cmd=finalize_ack rc=0"
        assert await c1.ask("cmd=finalize") == "cmd=finalize_ack rc=0"
        assert srv.finished()
        for s in socks:
            s.close()
        c0.close(), c1.close()
        await srv.close()
    run(main())


@T(15)
def test_server_abort_and_lost():
    async def main():
        events = []
        three = asyncio.get_running_loop().create_future()

        def note(*e):
            events.append(e)
            if len(events) == 3:
                three.set_result(None)
        srv = pmi1.PmiServer("poprun-t2-0", 4, on_abort=lambda *a: note("abort", *a),
                            on_lost=lambda *a: note("lost", *a))
        socks = [srv.attach(r) for r in range(4)]
        cs = [await Client.over(s) for s in socks]   # the clients own the sockets now
        for c in cs[:3]:
            await c.ask("cmd=init pmi_version=1 pmi_subversion=1")
        # abort: no reply; the later EOF is not reported as lost
        await cs[1].send("cmd=abort exitcode=3 message=it went wrong")
        cs[1].close()
        cs[0].close()       # initialized, no finalize -> lost(0, True)
        cs[3].close()       # never initialized -> lost(3, False)
        await cs[2].ask("cmd=finalize")
        cs[2].close()       # finalized -> nothing
        await asyncio.wait_for(three, 5)
        assert srv.finished()
        await srv.close()
        return events
    events = run(main())
    assert ("abort", 1, 3, "it went wrong") in events
    assert sorted(e for e in events if e[0] == "lost") == [("lost", 0, True), ("lost", 3, False)]
    assert len(events) == 3


class CountingUpstream(pmi1.Upstream):
    """A node-level server's upstream into the root (pmi_root.py), counting what it is
    sent."""

    def __init__(self, upstream):
        self.upstream, self.calls = upstream, []

    async def barrier(self, puts):
        self.calls.append(dict(puts))
        return await self.upstream.barrier(puts)

    async def get(self, key):
        return await self.upstream.get(key)


@T(15)
def test_node_forwarding_fake_clients():
    """One root (the launcher's), three node-level servers: the launcher's host serves rank
    0, host A ranks 1 and 2, host B rank 3; every barrier is one fence each host enters
    once with its instances' puts."""
    async def main():
        root = pmi1.Root(4, [0, 1, 1, 2])
        ups = {n: CountingUpstream(RootUpstream(root, node))
               for node, n in enumerate("HAB")}
        here = pmi1.PmiServer("poprun-t4-0", 4, local_ranks=[0], upstream=ups["H"])
        a = pmi1.PmiServer("poprun-t4-0", 4, local_ranks=[1, 2], upstream=ups["A"])
        b = pmi1.PmiServer("poprun-t4-0", 4, local_ranks=[3], upstream=ups["B"])
        srv_of = {0: here, 1: a, 2: a, 3: b}
        socks = {r: srv_of[r].attach(r) for r in range(4)}
        cs = {r: await Client.over(s) for r, s in socks.items()}
        for r in range(4):
            await cs[r].ask(f"cmd=put kvsname=poprun-t4-0 key=bc-{r} value=addr {r}")
        # rank 1 can already see rank 2's put (same host), not rank 3's
        assert (await cs[1].ask("cmd=get key=bc-2")).endswith("value=addr\\ 2")
        for r in range(4):
            await cs[r].send("cmd=barrier_in")
        for r in range(4):
            assert await cs[r].recv() == "cmd=barrier_out rc=0"
        for r in range(4):
            for k in range(4):
                assert await cs[r].ask(f"cmd=get key=bc-{k}") == \
                    f"cmd=get_result rc=0 value=addr\\ {k}"
        # one upstream message per host and epoch, carrying its instances' puts
        assert ups["A"].calls == [{"bc-1": "addr 1", "bc-2": "addr 2"}]
        assert ups["B"].calls == [{"bc-3": "addr 3"}]
        assert ups["H"].calls == [{"bc-0": "addr 0"}]
        # second epoch: delta only; a key the root holds that a host has not seen (a
        # spawned world's preput) is found through upstream.get
        root.kvs.update({"late": "L"})
        assert await cs[3].ask("cmd=get key=late") == "cmd=get_result rc=0 value=L"
        for r in range(4):
            await cs[r].send("cmd=barrier_in")
        for r in range(4):
            assert await cs[r].recv() == "cmd=barrier_out rc=0"
        assert ups["A"].calls[1] == {} and ups["B"].calls[1] == {}
        for c in cs.values():
            await c.ask("cmd=finalize")
            c.close()
        for s in socks.values():
            s.close()
        for srv in (a, b, here):
            await srv.close()
    run(main())


def test_a_hosts_barrier_batch_is_bounded_by_its_total_not_key_by_key():
    """Guards a defect: the root checked each key of a host's barrier batch against the count
    held before the batch, so one batch could bring any number of keys. The batch's new keys
    together must fit KEYS_PER_RANK x size; keys already held cost nothing new. A part that
    cannot be one fails that host's barrier at once, nothing of it taken."""
    root = pmi1.Root(2, [0, 1])
    limit = pmi1.KEYS_PER_RANK * 2

    def enter(node, puts, seq=0, ranks=(0, 1)):
        answers = []
        root.enter(FenceId(ranks, seq), node, puts, lambda *a: answers.append(a))
        return answers

    [(delta, error)] = enter(0, {f"k{i}": "v" for i in range(limit + 1)})
    assert delta is None and "too_many_keys" in error
    assert len(root.kvs) == 0  # refused whole: nothing of it was taken
    waiting = enter(0, {f"k{i}": "v" for i in range(limit - 1)})
    assert waiting == []
    [(_, error)] = enter(1, {"k0": "w", "new1": "v", "new2": "v"})  # 2 new ones: one too many
    assert "too_many_keys" in error
    [(delta, error)] = enter(1, {"k0": "w", "new1": "v"})  # fits exactly
    assert error is None and len(delta) == limit and waiting == [(delta, None)]
    assert "PMI_" in enter(0, {"PMI_x": "v"}, seq=1)[0][1]
    assert "not text" in enter(0, {"k": 3}, seq=1)[0][1]  # JSON from a host: any type
    assert "every rank" in enter(0, {}, seq=1, ranks=(0,))[0][1]
    assert enter(0, {}, seq=1) == []
    assert "twice" in enter(0, {}, seq=1)[0][1]  # a host enters a barrier once
