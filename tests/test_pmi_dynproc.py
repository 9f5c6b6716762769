"""MPI's dynamic-process commands of PMI-1, against fake clients over real sockets:
every command poprun does not serve is answered at once with an error (and said), names are
published, looked up and unpublished in the job's table (an agent's through its upstream),
and MPICH's multi-line spawn message is read, bounded, parsed and its processes placed on
the job's hosts (spawner/worlds/pmi1.py, mpinames.py, pmi1spawn.py); fuzzed (Hypothesis)
into the server and into a real launch, where nothing an instance writes makes poprun fail.
The real MPICH + mpi4py programs are tests/test_mpi_dynproc.py's.

The wire format is MPICH's client's (pmodels/mpich src/pmi/src/pmi_wire.c: PMIU_msg_set_query_spawn,
PMIU_cmd_output_v1_mcmd; src/pmi/maint/pmi-1.1.txt), written out here as MPICH writes it.
"""

import asyncio
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from spawner.worlds import pmi1, mpinames, pmi1spawn
from conftest import OFFLINE, run_poprun
from test_fuzz_surfaces import ABORTER as WRITES  # writes its argument's bytes to PMI_FD
from test_fuzz_peers import Warnings
from pmi_root import RootUpstream
from test_pmi import Client, run

T = pytest.mark.timeout


def spawn_message(*commands, preput=()) -> str:
    """What MPICH's PMI_Spawn_multiple sends for `commands` ((execname, nprocs, args, info))."""
    lines = []
    for n, (execname, nprocs, args, info) in enumerate(commands, 1):
        lines += ["mcmd=spawn", f"nprocs={nprocs}", f"execname={execname}",
                  f"totspawns={len(commands)}", f"spawnssofar={n}", f"argcnt={len(args)}"]
        lines += [f"arg{i}={a}" for i, a in enumerate(args, 1)]
        if n == 1:
            lines.append(f"preput_num={len(preput)}")
            for i, (k, v) in enumerate(preput):
                lines += [f"preput_key_{i}={k}", f"preput_val_{i}={v}"]
        lines.append(f"info_num={len(info)}")
        for i, (k, v) in enumerate(info):
            lines += [f"info_key_{i}={k}", f"info_val_{i}={v}"]
        lines.append("endcmd")
    return "\n".join(lines)


def read(message: str) -> pmi1spawn.SpawnRequest:
    reader = pmi1spawn.McmdReader()
    lines = (message + "\n").encode().splitlines(keepends=True)
    done = [reader.feed(line) for line in lines]
    assert done == [False] * (len(lines) - 1) + [True]
    return pmi1spawn.parse_spawn(reader.lines)


# ===================================================================== pure

@T(5)
def test_a_spawn_multiple_message_is_read_as_mpich_writes_it():
    request = read(spawn_message(
        ("python3", 2, ["-c", "print('a b')"], [("wdir", "/tmp"), ("soft", "1:2")]),
        ("/bin/echo", 1, [], []), preput=[("PARENT_ROOT_PORT_NAME", "tag#0$desc#x$")]))
    assert [(c.execname, c.nprocs, c.args, c.info) for c in request.commands] == [
        ("python3", 2, ["-c", "print('a b')"], {"wdir": "/tmp", "soft": "1:2"}),
        ("/bin/echo", 1, [], {})]
    assert request.preput == {"PARENT_ROOT_PORT_NAME": "tag#0$desc#x$"}
    assert request.total == 3


@T(5)
def test_a_message_ends_only_at_its_last_endcmd_and_is_bounded():
    reader = pmi1spawn.McmdReader()
    first = spawn_message(("a", 1, [], []), ("b", 1, [], [])).split("endcmd")[0] + "endcmd\n"
    assert not any(reader.feed(line) for line in first.encode().splitlines(keepends=True))
    huge = pmi1spawn.McmdReader()
    with pytest.raises(pmi1.PmiError, match="too long"):
        for _ in range(pmi1spawn.MCMD_MAX_LINES + 1):
            huge.feed(b"arg1=x\n")


@pytest.mark.parametrize("message, why", [
    (spawn_message(("a", 10000, [], [])), "10000 processes refused"),
    (spawn_message(("a", 0, [], [])), "nprocs=0"),
    (spawn_message(("", 1, [], [])), "no execname"),
    (spawn_message(("a", 1, ["x"], [])).replace("arg1=x\n", ""), "arg1 missing"),
    (spawn_message(("a", 1, [], [("k", "v")])).replace("info_val_0=v\n", ""), "info_val_0"),
    (spawn_message(("a", 1, [], [])).replace("nprocs=1", "nprocs=one"), "not a number"),
    (spawn_message(("a", 1, [], [])).replace("argcnt=0", "argcnt"), "bad spawn line"),
    ("\n".join(["mcmd=spawn", "nprocs=1", "execname=a", f"totspawns={pmi1spawn.COMMANDS_MAX + 1}",
                "spawnssofar=1", "endcmd"] + [
        line for n in range(2, pmi1spawn.COMMANDS_MAX + 2) for line in (
            "mcmd=spawn", "nprocs=1", "execname=a", f"spawnssofar={n}", "endcmd")]),
     "commands"),
])
@T(5)
def test_a_bad_or_oversized_spawn_is_refused(message, why):
    with pytest.raises(pmi1.PmiError, match=why):
        read(message)


JOB_HOSTS = [("h1", 2), ("h2", 2)]  # the job's hosts and their instance counts


def resolve(name: str) -> str | None:
    """The job's hosts as -H names them, and h1 by another name of its own."""
    return {"h1": "h1", "h2": "h2", "node1.example": "h1"}.get(name)


def hosts_of(message: str) -> list[tuple[str, int, int]]:
    placed, _ = pmi1spawn.place(read(message), JOB_HOSTS, resolve)
    assert [p.rank for p in placed] == list(range(len(placed)))
    return [(p.host, p.appnum, p.rank) for p in placed]


@T(5)
def test_children_fill_the_job_s_hosts_slots_in_turn_as_hydra_places_them():
    assert hosts_of(spawn_message(("a", 5, [], []))) == [
        ("h1", 0, 0), ("h1", 0, 1), ("h2", 0, 2), ("h2", 0, 3), ("h1", 0, 4)]
    # the default placement goes on from one command to the next; a named list has its own
    assert hosts_of(spawn_message(("a", 1, [], []), ("b", 2, [], [("host", "h2")]),
                                  ("c", 2, [], []))) == [
        ("h1", 0, 0), ("h2", 1, 1), ("h2", 1, 2), ("h1", 2, 3), ("h2", 2, 4)]


@pytest.mark.parametrize("value, hosts", [
    ("h2", ["h2"] * 3),
    ("h1,h2", ["h1", "h2", "h1"]),
    ("h2:2, node1.example", ["h2", "h2", "h1"]),
    (" h1 ,", ["h1"] * 3),
])
@T(5)
def test_the_host_info_key_names_the_job_s_hosts_and_their_slots(value, hosts):
    for key in ("host", "hosts"):
        assert [h for h, _, _ in hosts_of(spawn_message(("a", 3, [], [(key, value)])))] == hosts


@pytest.mark.parametrize("value, why", [
    ("elsewhere", "spawn on elsewhere: not one of the job's hosts"),
    ("h1,elsewhere", "spawn on elsewhere: not one of the job's hosts"),
    ("h2:0", "slots are 1..256"), ("h2:x", "slots are 1..256"), ("h2:257", "slots are"),
    (",", "names no host"),
])
@T(5)
def test_a_host_info_key_that_is_not_the_job_s_hosts_is_refused(value, why):
    with pytest.raises(pmi1.PmiError, match=why):
        hosts_of(spawn_message(("a", 1, [], [("host", value)])))


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=80), st.integers(1, pmi1spawn.SPAWN_MAX))
def test_any_host_info_value_places_on_the_job_s_hosts_or_is_refused(value, nprocs):
    """What an instance writes as `host` (hostile input): each process on one of the job's
    hosts, or a PmiError, nothing else."""
    request = pmi1spawn.SpawnRequest([pmi1spawn.Command("a", nprocs, [], {"host": value})], {})
    try:
        placed, _ = pmi1spawn.place(request, JOB_HOSTS, resolve)
    except pmi1.PmiError:
        return
    assert len(placed) == nprocs and {p.host for p in placed} <= {"h1", "h2"}


@T(5)
def test_the_job_s_names_are_bounded_and_published_once():
    names = mpinames.NameService(names_max=2)
    assert names.answer("publish", "a", "port-a") == (0, "")
    assert names.answer("publish", "a", "port-b") == (1, "service_already_published")
    assert names.answer("lookup", "a") == (0, "port-a")
    assert names.answer("publish", "b", "p") == (0, "")
    assert names.answer("publish", "c", "p") == (1, "too_many_names")
    assert names.answer("publish", "x" * (mpinames.SERVICE_MAX + 1), "p")[0] == 1
    assert names.answer("publish", "d", "p" * (mpinames.PORT_MAX + 1))[0] == 1
    assert names.answer("publish", "", "p")[0] == 1
    assert names.answer("unpublish", "a") == (0, "")
    assert names.answer("unpublish", "a") == (1, "service_not_found")
    assert names.answer("lookup", "a") == (1, "service_not_found")
    assert names.answer("delete", "b") == (1, "unknown_name_operation")
    assert len(names) == 1


# ===================================================================== server

@T(15)
def test_what_poprun_does_not_serve_is_answered_at_once_and_said():
    async def main():
        said = []
        srv = pmi1.PmiServer("poprun-d1-0", 1, on_unserved=lambda *a: said.append(a))
        sock = srv.attach(0)
        c = await Client.over(sock)
        await c.ask("cmd=init pmi_version=1 pmi_subversion=1")
        assert await c.ask("cmd=frobnicate x=1") == \
            "cmd=frobnicate_result rc=1 msg=unknown_command"
        assert await c.ask("cmd=singinit pmi_version=1") == \
            "cmd=singinit_info rc=1 msg=not_served_by_poprun"
        assert await c.ask("hello there") == \
            "cmd=unknown_result rc=1 msg=not\\ a\\ PMI-1\\ command"
        assert await c.ask("cmd=bad\\ name\\=x") == "cmd=badnamex_result rc=1 msg=unknown_command"
        # a spawn where no spawn is served (no on_spawn): refused, the next command answered
        assert (await c.ask(spawn_message(("true", 1, [], [])))).startswith(
            "cmd=spawn_result rc=1 msg=spawn\\ is\\ not\\ served")
        assert await c.ask("cmd=get_appnum") == "cmd=appnum rc=0 appnum=0"
        assert [s[:2] for s in said] == [(0, "frobnicate"), (0, "singinit"),
                                         (0, ""), (0, "bad name=x"),
                                         (0, "spawn")]
        # a spawn message past its bounds: said, and the connection dropped
        await c.send("mcmd=spawn\n" + "arg1=x\n" * pmi1spawn.MCMD_MAX_LINES)
        assert await asyncio.wait_for(c.r.read(), 5) == b""
        assert "too long" in said[-1][2]
        c.close()
        await srv.close()
    run(main())


@T(15)
def test_a_spawn_is_handed_to_the_launcher_with_its_request():
    async def main():
        asked = []

        async def on_spawn(rank, request):
            asked.append((rank, request))
            return pmi1spawn.spawn_reply(0, request.total)

        srv = pmi1.PmiServer("poprun-d2-0", 2, on_spawn=on_spawn)
        c = await Client.over(srv.attach(1))
        assert await c.ask(spawn_message(("a", 2, ["x"], []), ("b", 1, [], []))) == \
            "cmd=spawn_result rc=0 errcodes=0,0,0"
        [(rank, request)] = asked
        assert rank == 1 and [c.execname for c in request.commands] == ["a", "b"]
        c.close()
        await srv.close()
    run(main())


@T(15)
def test_names_are_the_job_s_across_the_root_and_an_agent():
    """Rank 0 is served on the launcher's host, rank 1 on an agent's, each by a node-level
    server: a name one publishes the other finds (both ask the root's table: in-process, or
    NAME/NAMED across hosts)."""
    async def main():
        root = pmi1.Root(2, [0, 1])
        here = pmi1.PmiServer("poprun-d3-0", 2, local_ranks=[0],
                              upstream=RootUpstream(root, 0))
        agent = pmi1.PmiServer("poprun-d3-0", 2, local_ranks=[1],
                               upstream=RootUpstream(root, 1))
        c0, c1 = await Client.over(here.attach(0)), await Client.over(agent.attach(1))
        assert await c1.ask("cmd=publish_name service=ocean port=tag#0$x$") == \
            "cmd=publish_result rc=0"
        assert await c0.ask("cmd=lookup_name service=ocean") == \
            "cmd=lookup_result rc=0 port=tag#0$x$"
        assert await c0.ask("cmd=publish_name service=ocean port=p") == \
            "cmd=publish_result rc=1 msg=service_already_published"
        assert await c0.ask("cmd=unpublish_name service=ocean") == "cmd=unpublish_result rc=0"
        assert await c1.ask("cmd=lookup_name service=ocean") == \
            "cmd=lookup_result rc=1 msg=service_not_found"
        for c in (c0, c1):
            c.close()
        await agent.close()
        await here.close()
    run(main())


# ============================================ an agent's requests, as the launcher reads them

def answers(spawner) -> list:
    """What the launcher wrote to the agent after its WORLD frames: (kind name, fields)."""
    from spawner.protocol import Control, FrameDecoder

    frames = FrameDecoder().feed(bytes(spawner._chan.written))
    return [(f.kind.name, f.fields) for f in frames
            if type(f) is Control and f.kind.name != "WORLD"]


# The instances' world of the launcher's host (ranks 0-1) and host h9 (ranks 2-4), and a world
# spawned on the launcher's host only.
HOSTS = ["localhost"] * 2 + ["h9"] * 3
KVS, SPAWNED_KVS = "poprun-frames-0", "poprun-frames-0-spawn1"


async def h9_and_its_worlds(loop):
    """A real RemoteSpawner for host h9, its agent's greeting read, and the launcher's worlds
    behind it: the instances' (HOSTS, opened on h9) and one spawned on this host only.
    (spawner, session, worlds, log, spawned ranks, unserved calls, lost, crashes)"""
    from poprun.run.worlds.pmi1 import MpiWorld
    from spawner.protocol import MAGIC
    from test_fuzz_peers import spawner_under_test

    spawner, session, _, lost, crashes = spawner_under_test(loop)
    log, spawned, unserved = Warnings(), [], []

    async def on_spawn(rank, request):
        spawned.append(rank)
        return pmi1spawn.spawn_reply(0, request.total)

    world = MpiWorld(KVS, HOSTS, loop, remote={"h9": spawner}, log=log,
                     on_abort=lambda *a: None, on_lost=lambda *a: None,
                     on_unserved=lambda *a: unserved.append(a))
    world.on_spawn = on_spawn
    world.open_remote()
    world.start()  # the job's names start with the instances' world
    other = MpiWorld(SPAWNED_KVS, ["localhost"], loop, log=log,
                     on_abort=lambda *a: None, on_lost=lambda *a: None, names=world.names)
    other.on_spawn = on_spawn
    other.start()
    session.data_received(MAGIC, None)  # the agent's greeting
    return spawner, session, (world, other), log, spawned, unserved, lost, crashes


SPAWN = pmi1spawn.request_json(read(spawn_message(("true", 1, [], []))))


@pytest.mark.parametrize("kind, fields, answer, said", [
    ("SPAWN_ASK", {"kvsname": KVS, "key": 0, "request": SPAWN},  # rank 0 runs here
     ("SPAWNED_ANSWER", {"reply": {"rc": 1, "msg": "spawn: not one of this host's ranks"}}),
     "SPAWN_ASK for rank 0 of MPI world " + KVS),
    ("SPAWN_ASK", {"kvsname": KVS, "key": 7, "request": SPAWN},  # a rank of no world
     ("SPAWNED_ANSWER", {"reply": {"rc": 1, "msg": "spawn: not one of this host's ranks"}}),
     "SPAWN_ASK for rank 7 of MPI world " + KVS),
    ("SPAWN_ASK", {"kvsname": SPAWNED_KVS, "key": 0, "request": SPAWN},  # not on h9
     ("SPAWNED_ANSWER", {"reply": {"rc": 1, "msg": "spawn: no such MPI world here"}}), None),
    ("SPAWN_ASK", {"kvsname": "poprun-nonesuch", "key": 2, "request": SPAWN},
     ("SPAWNED_ANSWER", {"reply": {"rc": 1, "msg": "spawn: no such MPI world here"}}), None),
    ("NAME", {"kvsname": SPAWNED_KVS, "op": "publish", "service": "s", "port": "p"},
     ("NAMED", {"rc": 1, "value": "no_such_world"}), None),
    ("NAME", {"kvsname": "poprun-nonesuch", "op": "lookup", "service": "s"},
     ("NAMED", {"rc": 1, "value": "no_such_world"}), None),
    ("GET", {"kvsname": "poprun-nonesuch", "key": "k"}, ("VALUE", {"value": None}), None),
    ("PMI_UNSERVED", {"kvsname": KVS, "key": 1, "cmd": "frobnicate", "why": "no"}, None,
     "PMI_UNSERVED for rank 1 of MPI world " + KVS),
], ids=["spawn-for-another-hosts-rank", "spawn-for-no-rank", "spawn-in-a-world-not-there",
        "spawn-in-no-world", "name-in-a-world-not-there", "name-in-no-world", "get-in-no-world",
        "unserved-of-another-hosts-rank"])
@T(15)
def test_an_agent_speaks_only_for_the_ranks_of_its_own_host(kind, fields, answer, said):
    """docs/architecture.md, "What arrives is hostile input": a SPAWN_ASK, NAME or
    PMI_UNSERVED of h9's agent for a rank of another host, of none, or of a world that does
    not run on h9 (or does not exist) is answered with an error at once where its rank
    waits, and nothing is spawned, published or said for it but one warning naming h9 (a
    kvsname it does not serve is answered as one of a world that has ended is). Twice, said
    once; the agent is kept, and its own ranks are served as before."""
    from spawner.protocol import Kind, encode

    async def main():
        loop = asyncio.get_running_loop()
        spawner, session, worlds, log, spawned, unserved, lost, crashes = \
            await h9_and_its_worlds(loop)
        for ask in (1, 2):
            session.data_received(encode(Kind[kind], id=ask, **fields), None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert answers(spawner) == ([] if answer is None else [
            (answer[0], {"kvsname": fields["kvsname"], "id": ask, **answer[1]})
            for ask in (1, 2)])
        assert spawned == [] and len(worlds[0].names) == 0 and unserved == []
        assert log.warnings == ([] if said is None else [
            f"h9: its agent sent a {said}, which does not run there: refused (its host speaks "
            "only for its own ranks; its other such requests are refused too, not said again)"])
        # h9's own ranks are served as before
        spawner._chan.written.clear()
        session.data_received(encode(Kind.SPAWN_ASK, kvsname=KVS, id=7, key=3, request=SPAWN)
                              + encode(Kind.NAME, kvsname=KVS, id=8, op="publish",
                                       service="s", port="p")
                              + encode(Kind.PMI_UNSERVED, kvsname=KVS, key=4, cmd="x",
                                       why="no"), None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert answers(spawner) == [
            ("NAMED", {"kvsname": KVS, "id": 8, "rc": 0, "value": ""}),
            ("SPAWNED_ANSWER", {"kvsname": KVS, "id": 7, "reply": {"rc": 0, "errcodes": "0"}})]
        assert spawned == [3] and unserved == [(4, "x", "no")] and len(log.warnings) <= 1
        assert spawner.lost is None and not lost and not crashes, crashes
        for world in reversed(worlds):
            await world.close()
    run(main())


@T(15)
def test_a_world_refuses_a_name_or_a_key_asked_from_a_host_it_does_not_run_on():
    """MpiWorld's own check, whatever routed the frames there: a NAME or GET from a host with
    none of the world's ranks is answered as refused (rc=1, no value), publishes nothing and
    is said once."""
    from poprun.run.worlds.pmi1 import MpiWorld
    from spawner.protocol import Control, Kind

    async def main():
        told = []
        h7 = type("Spawner", (), {"host": "h7", "refused": 0, "tell": lambda self, kind, **f:
                                  told.append((kind, f))})()
        world = MpiWorld(KVS, HOSTS, asyncio.get_running_loop(),
                         on_abort=lambda *a: None, on_lost=lambda *a: None, log=Warnings())
        world.start()
        world.root.kvs.update({"k": "v"})
        world._from_agent(h7, Control(Kind.NAME, {"kvsname": KVS, "id": 1, "op": "publish",
                                                  "service": "s", "port": "p"}))
        world._from_agent(h7, Control(Kind.GET, {"kvsname": KVS, "id": 2, "key": "k"}))
        assert told == [(Kind.NAMED, {"kvsname": KVS, "id": 1, "rc": 1,
                                      "value": "not_one_of_this_hosts_ranks"}),
                        (Kind.VALUE, {"kvsname": KVS, "id": 2, "value": None})]
        assert len(world.names) == 0
        assert world._log.warnings == [
            f"h7: its agent sent a NAME for a rank of MPI world {KVS}, which does not run "
            "there: refused (its host speaks only for its own ranks; its other such requests "
            "are refused too, not said again)"]
        await world.close()
    run(main())


# ===================================================================== fuzzing

SPAWN_WORDS = [b"mcmd=spawn", b"endcmd", b"nprocs=", b"execname=", b"totspawns=",
               b"spawnssofar=", b"argcnt=", b"arg1=", b"preput_num=", b"preput_key_0=",
               b"preput_val_0=", b"info_num=", b"info_key_0=", b"info_val_0=", b"1", b"2",
               b"10000", b"-1", b"cmd=publish_name", b"cmd=lookup_name",
               b"cmd=unpublish_name", b" service=", b" port=", b"=", b"\n", b"\\", b"\xff"]
spawn_bytes = st.lists(st.one_of(st.binary(max_size=20), st.sampled_from(SPAWN_WORDS)),
                       max_size=60).map(b"".join)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(spawn_bytes, max_size=6))
def test_a_pmi_server_survives_any_spawn_messages_and_names(messages):
    """What an instance writes, spawn messages and names among it, straight into the
    server: it answers or drops the connection, never crashes; every spawn it hands on is
    within the bounds."""
    asked = []

    async def on_spawn(rank, request):
        asked.append(request)
        return pmi1spawn.spawn_reply(1, msg="fuzz")

    async def main():
        server = pmi1.PmiServer("poprun-fuzz-1", 1, on_spawn=on_spawn)
        reader, writer = await asyncio.open_unix_connection(sock=server.attach(0))
        writer.write(b"".join(m + b"\n" for m in messages))
        writer.write_eof()
        while await asyncio.wait_for(reader.read(65536), 10):
            pass
        writer.close()
        await server.close()
        assert len(server.names) <= mpinames.NAMES_MAX

    asyncio.run(asyncio.wait_for(main(), 20))
    for request in asked:
        assert 1 <= len(request.commands) <= pmi1spawn.COMMANDS_MAX
        assert 1 <= request.total <= pmi1spawn.SPAWN_MAX
        assert all(c.execname and c.nprocs >= 1 for c in request.commands)


@settings(max_examples=4, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(st.lists(spawn_bytes.map(lambda m: m.replace(b"execname=", b"execname=true")),
                max_size=6))
@T(300)
def test_a_launch_survives_any_spawn_messages_and_names(messages):
    """An instance writes them to its PMI socket under a real poprun (any spawn it makes
    valid starts `true`): the job ends 0 or 1 (an MPI process that left without
    MPI_Finalize), never as poprun's own failure."""
    data = b"".join(m + b"\n" for m in messages)
    proc = run_poprun(*OFFLINE, "--num-instances=1", sys.executable, "-c", WRITES, data.hex(),
                      timeout=60)
    assert proc.returncode in (0, 1), proc.stderr.decode()[-3000:]
    assert b"Traceback" not in proc.stderr
