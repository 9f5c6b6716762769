"""Fuzzing what a network peer or a broken agent can send the launcher (Hypothesis): the agent
protocol as the launcher reads it (spawner/remote.py's RemoteSpawner, fed the bytes a hostile or
broken agent writes: noise instead of its greeting, frames too long, of unknown kinds, not
JSON, with fields of any type, out of order) and the Slurm callback's listener
(spawner/callback.py: garbage, partial handshakes, wrong secrets, many connections). Each runs
in-process beside a tick that must keep ticking (tests/fuzzing.py), and checks what the
launcher reports: never its own internal error, the honest instances' events exactly as sent
unless the agent was given up on, once, with a reason that names the protocol."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fuzzing import FAST, run, ticking
from spawner.worlds import mpinames

pytestmark = pytest.mark.timeout(300)


# --- the agent protocol, from the launcher's side --------------------------------------------

class Channel:
    """What RemoteSpawner writes to and closes: a channel to an agent that is not there (the
    test plays the agent by calling the session's data_received)."""

    def __init__(self, session) -> None:
        self.session, self.written, self.closed = session, bytearray(), False

    def write(self, data: bytes) -> None:
        self.written += data

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.session.connection_lost, None)

    def get_exit_status(self):
        return None

    def get_exit_signal(self):
        return None


class Recorder:
    """The sink: what the launcher was told of each instance."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_output(self, key, stream, data) -> None:
        self.events.append(("output", key, int(stream), bytes(data)))

    def on_exit(self, key, returncode) -> None:
        self.events.append(("exit", key, returncode))

    def on_progress(self, key, step, total) -> None:
        self.events.append(("progress", key, step, total))

    def on_usage(self, key, cpu, rss) -> None:
        pass


def frame(kind: int, payload: bytes) -> bytes:
    return struct.pack(">IB", len(payload), kind) + payload


# Field names the launcher reads, and values of every JSON type for them.
FIELD_NAMES = ["key", "returncode", "error", "progress", "pid", "binding", "start", "id",
               "result", "usage", "traceback", "memory_binding_reason", "containment",
               "kvsname", "count", "puts", "exitcode", "message", "initialized", "value",
               "oom_kills"]
json_values = st.sampled_from(  # each JSON type, and the values at its edges
    [None, True, False, 0, 1, 3, -1, -9, 2**31, 2**70, -2**70, 1.5, float("nan"), float("inf"),
     "", "x", "2", "\udcff", [], [1], [1, 2], [1, None], [1.5, 2], ["a", "b"], [1, 2, 3],
     {}, {"a": 1}, {"type": "E", "message": "m"}, {"0": [1, 2]}, {"x": [1, 2]}])


@st.composite
def hostile_frames(draw):
    """One thing a broken agent writes: a frame of any kind with fields of any type, a frame
    of an unknown kind, one that is not JSON or not an object, an OUTPUT frame that is short
    or of an unknown stream, a header announcing a frame of up to 4 GiB, or raw bytes."""
    from spawner.protocol import Kind

    choice = draw(st.integers(0, 5))
    if choice == 0:
        kind = draw(st.sampled_from([k for k in Kind if k >= Kind.REPLY and k != Kind.OUTPUT]))
        fields = draw(st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=6))
        return frame(kind, json.dumps(fields).encode())
    if choice == 1:
        return frame(draw(st.sampled_from([0, 34, 99, 255])), b"{}")
    if choice == 2:
        kind = draw(st.sampled_from([k for k in Kind if k != Kind.OUTPUT]))
        return frame(kind, draw(st.sampled_from([b"", b"{", b"[1]", b"null", b"\xff\xfe",
                                                 b'{"key": NaN}', b"1" * 5000])))
    if choice == 3:
        return frame(Kind.OUTPUT, draw(st.binary(max_size=12)))
    if choice == 4:
        return struct.pack(">IB", draw(st.sampled_from([2**32 - 1, 2**31, 1 << 30])),
                           draw(st.integers(0, 255))) + draw(st.binary(max_size=100))
    return draw(st.binary(max_size=64))


def honest_frames(keys):
    """What a working agent says of instances `keys`: started, a line each, exited 0."""
    from spawner.local import Stream
    from spawner.protocol import Kind, encode, encode_output

    out = []
    for key in keys:
        out.append(encode(Kind.STARTED, key=key, pid=1000 + key, start=5, binding=None,
                          containment="cgroup"))
        out.append(encode_output(key, Stream.STDOUT, b"line %d\n" % key))
        out.append(encode(Kind.EXIT, key=key, returncode=0, error=None))
    return out


def spawner_under_test(loop):
    """A RemoteSpawner whose agent answered HELLO and was asked to start instances 0-2, the
    session its agent's bytes arrive through, and what it reports: (spawner, session, sink,
    lost, crashes)."""
    from spawner import remote

    sink, lost, crashes = Recorder(), [], []
    loop.set_exception_handler(lambda loop, context: crashes.append(context))
    spawner = remote.RemoteSpawner(None, "h9", sink, on_lost=lambda *a: lost.append(a))
    session = remote._AgentSession(spawner)
    spawner._chan = Channel(session)
    spawner.info = object()  # HELLO was answered: a loss from now on is the job's news
    for key in range(3):  # as spawn_all leaves them, waiting for STARTED (its outcome taken)
        spawner._spawning[key] = loop.create_future()
        spawner._spawning[key].add_done_callback(lambda f: f.cancelled() or f.exception())
    return spawner, session, sink, lost, crashes


def assert_in_order(events) -> None:
    """What the sink heard makes sense: only instances that were started, no output after an
    instance's exit, one exit each, numbers where numbers belong."""
    ended = set()
    for kind, key, *rest in events:
        assert key in range(3) and key not in ended, events
        if kind == "exit":
            ended.add(key)
            assert type(rest[0]) is int, events
        elif kind == "progress":
            assert all(v is None or type(v) is int for v in rest), events


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut where `cuts` say (as a channel delivers it: anywhere)."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@settings(FAST, max_examples=150)
@given(st.lists(hostile_frames(), max_size=4), st.integers(0, 8),
       st.lists(st.integers(0, 1 << 20), max_size=6),
       st.sampled_from([b"", b"motd\n", b"x" * 70000]))
def test_the_launcher_survives_anything_an_agent_sends(hostile, at, cuts, noise):
    """Honest frames with hostile ones among them, in pieces cut anywhere, after any noise of
    the remote shell's. The launcher never reports its own internal error (nothing reaches
    the loop's exception handler), never waits for (and holds) a frame announced past
    MAX_FRAME, tells its sink only what makes sense, and either goes on (reporting the honest
    instances exactly as the agent said, where nothing hostile came) or gives the agent up as
    lost, once, saying its output is not the agent protocol."""
    from spawner.protocol import MAGIC, MAX_FRAME
    from spawner.remote import AgentInternalError

    honest = honest_frames(range(3))
    frames = honest[:at] + hostile + honest[at:]
    data = noise + MAGIC + b"".join(frames)

    async def main():
        loop = asyncio.get_running_loop()
        spawner, session, sink, lost, crashes = spawner_under_test(loop)
        async with ticking():
            for piece in chunks(data, cuts):
                session.data_received(piece, None)
                await asyncio.sleep(0)
                if spawner.lost:
                    break
            await asyncio.sleep(0.01)  # a loss is reported through the loop
        # Only an INTERNAL frame's news reaches the handler: the agent's bug, as it said it.
        assert all(isinstance(c.get("exception"), AgentInternalError) for c in crashes), \
            crashes[0].get("exception")
        if not spawner.lost and spawner._decoder.pending >= 4:  # a frame still coming
            assert struct.unpack(">I", spawner._decoder._buf[:4])[0] <= MAX_FRAME
        assert_in_order(sink.events)
        # An OOM kill is believed of a SIGKILLed instance only, by a count (spawner/oomkills.py)
        assert all(type(n) is int and n > 0 for n in spawner.oom_kills.values()), \
            spawner.oom_kills
        assert all(("exit", k, -9) in sink.events for k in spawner.oom_kills), sink.events
        if spawner.lost:
            assert len(lost) == 1 and ("not the agent protocol" in lost[0][1]
                                       or "rejected a message" in lost[0][1]), lost
            event("given up")
        elif not hostile:  # the agent's word, exactly
            assert not lost and sorted(sink.events) == sorted(
                [("output", k, 1, b"line %d\n" % k) for k in range(3)]
                + [("exit", k, 0) for k in range(3)])
            event("served")

    run(main())


def test_a_stray_print_after_the_greeting_gives_the_agent_up_at_once():
    """Bytes that are no frame header (a library printing to the agent's stdout) announce a
    frame of gigabytes: the launcher says so at once, rather than wait for it (and hold it),
    and writes nothing more to the agent's closing channel (a request is refused as lost)."""
    from spawner.protocol import MAGIC
    from spawner.remote import AgentLostError

    async def main():
        spawner, session, sink, lost, crashes = spawner_under_test(asyncio.get_running_loop())
        session.data_received(MAGIC + honest_frames([0])[0] + b"hello, world\n", None)
        written = bytes(spawner._chan.written)
        spawner.signal_all(15)  # its channel is closing: nothing written to it, no error
        with pytest.raises(AgentLostError):
            await spawner.make_dir("/x")
        assert spawner._chan.written == written
        await asyncio.sleep(0.01)  # the loss is reported through the loop
        assert lost == [("h9", "the agent's output is not the agent protocol (a frame of "
                                 "1751477356 bytes announced, past the protocol's 268435456)")]
        assert spawner.pid(0) == 1000  # what came whole before it still counts
        assert not crashes

    run(main())


# --- an agent's frames about the MPI world it serves (poprun/run/worlds/pmi1.py) -----------------

# The world's ranks' hosts: ranks 0-1 here, 2-4 on host h9.
HOSTS = ["localhost"] * 2 + ["h9"] * 3


SPAWN_REQUEST = {"commands": [{"execname": "true", "nprocs": 1, "args": [], "info": {}}],
                 "preput": {}}
world_fields = st.fixed_dictionaries(
    {"kvsname": st.sampled_from(["poprun-fuzz-9", "other"])},
    optional={"key": st.sampled_from([0, 2, 4, 5, -1, "2", True, None, 2**70]),
              "of": st.sampled_from(["pmi1", "pmix", None]),
              "ranks": st.sampled_from([[0, 1, 2, 3, 4], [2, 3, 4], [0, 1, 2, 3, 4, 5], [], None,
                                        ["0"], [True, 1, 2, 3, 4], [2**70]]),
              "seq": st.sampled_from([0, 1, -1, "0", None, 2**70]),
              "puts": st.sampled_from([{}, {"k": "v"}, {"k": 1}, [], None, "x"]),
              "id": st.sampled_from([1, 2, "1", None]), "exitcode": json_values,
              "message": json_values, "initialized": json_values, "value": json_values,
              "request": st.sampled_from([SPAWN_REQUEST, {}, None, "x"]),
              "op": st.sampled_from(["publish", "lookup", "unpublish", "context", "x", None]),
              "service": st.sampled_from(["s", "", None, 1]),
              "port": st.sampled_from(["p", "", None, "p" * 70000]), "cmd": json_values,
              "why": json_values,
              # a PMIx name's (spawner/worlds/mpinames.py): a lookup that waits, a once-read name
              "wait": st.sampled_from([0, 0.001, 600, 10**9, -1, float("nan"), float("inf"),
                                       "1", True, None]),
              "once": st.sampled_from([True, False, 1, None]),
              "pmix": st.sampled_from([True, None])})


class Warnings:
    """The job's log, as MpiWorld uses it: its warnings kept."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str) -> None:
        self.warnings.append(msg)

    def info(self, msg: str) -> None:
        pass

    debug = info


class FakeAgent:
    """A RemoteSpawner as MpiWorld uses it: its host, what it is told, its refusals."""

    def __init__(self, host: str) -> None:
        self.host, self.told, self.refused = host, [], 0

    def tell(self, kind, **fields) -> None:
        self.told.append((kind, fields))


@settings(FAST, max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["h9", "h7"]),
                          st.sampled_from(["FENCE_IN", "GET", "MPI_ABORT", "MPI_LOST",
                                           "SPAWN_ASK", "NAME", "PMI_UNSERVED"]),
                          world_fields), max_size=8))
def test_an_agents_world_frames_are_checked_before_the_world_acts(frames):
    """Every world frame of host h9's agent (ranks 2-4) or h7's (none of the world's), as the
    launcher's world reads them: one that has a field of the wrong type is a ProtocolError
    (its spawner gives the agent up); a request for another host's rank, a rank of none, or
    from h7 (SPAWN_ASK, NAME, GET) is answered with an error and does nothing (PMI_UNSERVED,
    and an abort or a loss reported for such a rank: dropped), said once per host; the
    others reach the world with h9's ranks, and every request taken is answered once, but
    for the lookups that wait for a name nobody published (PMIx's PMIX_WAIT), each held by
    the job's table, bounded in time and number."""
    from poprun.run.worlds.pmi1 import MpiWorld
    from spawner.protocol import Control, Kind, ProtocolError

    async def main():
        loop = asyncio.get_running_loop()
        aborts, lost, spawned, unserved, log = [], [], [], [], Warnings()
        agents = {host: FakeAgent(host) for host in ("h9", "h7")}

        async def on_spawn(rank, request):
            spawned.append(rank)
            return {"rc": 0, "errcodes": "0"}

        world = MpiWorld("poprun-fuzz-9", HOSTS, loop, log=log,
                         on_abort=lambda *a: aborts.append(a), on_lost=lambda *a: lost.append(a),
                         on_unserved=lambda *a: unserved.append(a))
        world.on_spawn = on_spawn
        taken = []  # the requests the world took: (agent, kind, id)
        async with ticking():
            for host, name, fields in frames:
                try:
                    world._from_agent(agents[host], Control(Kind[name], dict(fields)))
                except ProtocolError:
                    event("refused")
                    continue
                if name in ("SPAWN_ASK", "NAME") and fields["kvsname"] == world.kvsname:
                    taken.append((host, name, fields["id"]))
                await asyncio.sleep(0)
            for _ in range(3):  # the spawns' answers
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)  # the shortest waits for a name have ended
        assert all(rank in (2, 3, 4) and type(code) is int and type(message) is str
                   for rank, code, message in aborts), aborts
        assert all(rank in (2, 3, 4) and type(initialized) is bool
                   for rank, initialized in lost), lost
        assert all(rank in (2, 3, 4) for rank in spawned), spawned
        assert all(rank in (2, 3, 4) for rank, _, _ in unserved), unserved
        answered = sorted((host, kind.name, fields["id"]) for host, agent in agents.items()
                          for kind, fields in agent.told
                          if kind in (Kind.SPAWNED_ANSWER, Kind.NAMED))
        expected = sorted((host, {"SPAWN_ASK": "SPAWNED_ANSWER"}.get(name, "NAMED"), ask)
                          for host, name, ask in taken)
        waiting = world.job_names().waiting()
        assert waiting <= mpinames.WAITING_MAX
        assert len(answered) == len(expected) - waiting and not Counter(answered) - Counter(
            expected), (answered, taken)
        if waiting:
            event("lookups left waiting for their name")
        for kind, fields in agents["h7"].told:  # h7 runs none of the world: refused, all
            if kind is Kind.VALUE:
                assert fields["value"] is None, fields
            elif kind is Kind.FENCE_OUT:
                assert fields["error"] and "puts" not in fields, fields
            else:
                assert fields.get("rc", fields.get("reply", {}).get("rc")) == 1, fields
        for kind, fields in agents["h9"].told:  # its barriers wait for this host's ranks'
            assert kind is not Kind.FENCE_OUT or fields["error"], fields
        for host, agent in agents.items():  # a refusal is said once per host
            said = [w for w in log.warnings if w.startswith(f"{host}: ")]
            assert len(said) == min(agent.refused, 1), (said, agent.refused)
            if agent.refused:
                event(f"{host}'s requests refused")
        assert all(kind in (Kind.VALUE, Kind.FENCE_OUT, Kind.SPAWNED_ANSWER, Kind.NAMED)
                   for agent in agents.values() for kind, _ in agent.told)
        await world.close()

    run(main())


def test_an_abort_or_a_loss_an_agent_reports_for_another_host_s_rank_is_refused():
    """h9 (ranks 2-4) reports MPI_Abort and a loss for rank 0, which runs here: refused, said
    once, nothing ended, and h9's agent is not given up (its own rank's abort still counts)."""
    from poprun.run.worlds.pmi1 import MpiWorld
    from spawner.protocol import Control, Kind

    async def main():
        aborts, lost, log = [], [], Warnings()
        world = MpiWorld("poprun-fuzz-9", HOSTS, asyncio.get_running_loop(),
                         log=log, on_abort=lambda *a: aborts.append(a),
                         on_lost=lambda *a: lost.append(a), on_unserved=lambda *a: None)
        h9 = FakeAgent("h9")
        for _ in range(3):
            world._from_agent(h9, Control(Kind.MPI_ABORT, {
                "kvsname": world.kvsname, "key": 0, "exitcode": 7, "message": "not mine"}))
            world._from_agent(h9, Control(Kind.MPI_LOST, {
                "kvsname": world.kvsname, "key": 1, "initialized": True}))
        assert (aborts, lost, h9.told, h9.refused) == ([], [], [], 6)
        (said,) = log.warnings
        assert said.startswith("h9: its agent sent a MPI_ABORT for rank 0 of MPI world "
                               "poprun-fuzz-9, which does not run there: refused"), said
        world._from_agent(h9, Control(Kind.MPI_ABORT, {
            "kvsname": world.kvsname, "key": 3, "exitcode": 7, "message": "mine"}))
        assert aborts == [(3, 7, "mine")]
        await world.close()

    run(main())


# --- the Slurm callback's listener (spawner/callback.py) --------------------------------------

SECRET = bytes(range(32))


@st.composite
def callers(draw):
    """One connection that does not hold the job's secret (or holds it and says nonsense):
    what it sends first, and then, once the launcher has answered, what it sends next (None:
    nothing; it closes)."""
    from spawner.callback import MAGIC, NONCE, PROOF

    nonce = draw(st.binary(min_size=NONCE, max_size=NONCE))
    how = draw(st.sampled_from(["garbage", "short", "wrong proof", "wrong secret",
                                "bad identity"]))
    if how == "garbage":
        return how, draw(st.binary(max_size=200)), None
    if how == "short":  # the handshake cut anywhere
        return how, (MAGIC + nonce)[:draw(st.integers(0, len(MAGIC) + NONCE - 1))], None
    identity = draw(st.sampled_from([b"", b"[]", b'{"node": 1}', b"\xff", b"x" * 255]
                                    + [b'{"node": "n1"}'] * (how != "bad identity")))
    if how == "wrong proof":
        return how, MAGIC + nonce, (draw(st.binary(min_size=PROOF, max_size=PROOF))
                                    + bytes([len(identity)]) + identity)
    return how, MAGIC + nonce, identity  # the proof is made once the launcher's nonce is known


async def call(address, how: str, first: bytes, then, cuts) -> None:
    """Play one caller; the launcher's answer is read when it has one to give."""
    from spawner.callback import MAGIC, NONCE, PROOF, proof

    reader, writer = await asyncio.open_connection(*address)
    try:
        for piece in chunks(first, cuts):
            writer.write(piece)
            await writer.drain()
        if then is not None:
            answer = await asyncio.wait_for(reader.readexactly(NONCE + PROOF), 30)
            if how != "wrong proof":
                secret = SECRET if how == "bad identity" else b"not the job's secret"
                then = (proof(secret, b"agent", first[len(MAGIC):], answer[:NONCE], then)
                        + bytes([len(then)]) + then)
            writer.write(then + b"agent protocol bytes")
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 30)  # refused: closed
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # refused before it was done
    finally:
        writer.close()


class Receiver:
    def __init__(self) -> None:
        self.data = bytearray()

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> None:
        pass

    def connection_lost(self, exc) -> None:
        pass


def agent_environ(target: str, node: str = "n1") -> dict[str, str]:
    from spawner.callback import CALLBACK_VARIABLE, STEP_VARIABLE

    return {CALLBACK_VARIABLE: target, STEP_VARIABLE: "2",
            "SLURMD_NODENAME": node, "SLURM_PROCID": "0"}


async def an_agent_calls(listener, receiver: Receiver, pieces: list[bytes]) -> None:
    """A real agent's end (connect_back, blocking: in a thread) gets through, and what it
    sends after the handshake, in pieces, reaches the receiver exactly."""
    from spawner import callback

    sock = await asyncio.to_thread(callback.connect_back, agent_environ(listener.target()),
                                   SECRET)
    with sock:
        for piece in pieces:
            await asyncio.to_thread(sock.sendall, piece)
        want = b"".join(pieces)
        for _ in range(3000):
            if len(receiver.data) >= len(want):
                break
            await asyncio.sleep(0.01)
        assert bytes(receiver.data) == want


@settings(FAST, max_examples=60)
@given(st.lists(st.tuples(callers(), st.lists(st.integers(0, 300), max_size=3)), max_size=12),
       st.lists(st.binary(max_size=50), max_size=4))
def test_the_callback_lets_only_the_secrets_holder_through(hostile, pieces):
    """Connections that send garbage, stop anywhere in the handshake, show a wrong proof or
    a proof made with another secret, all at once: each is refused with one line and none
    reaches the job; the listener holds none of them afterwards; an agent holding the secret
    still gets through, and its bytes arrive as it sent them."""
    from spawner.callback import CallbackListener

    async def main():
        agents, refused, receiver = [], [], Receiver()

        def on_agent(identity, caller):
            agents.append(identity)
            return receiver

        listener = CallbackListener(SECRET, on_agent, refused.append)
        listener.bind("127.0.0.1")
        await listener.serve()
        address = ("127.0.0.1", listener.port)
        try:
            async with ticking():
                await asyncio.gather(*(call(address, how, first, then, cuts)
                                       for (how, first, then), cuts in hostile))
                assert agents == []
                for _ in range(3000):  # the launcher's side of each refusal has run
                    if not listener.unproven:
                        break
                    await asyncio.sleep(0.01)
                assert not listener.unproven
                assert all(isinstance(why, str) and "\n" not in why for why in refused)
                await an_agent_calls(listener, receiver, pieces)
                assert agents == [{"node": "n1", "step": "2", "task": "0"}]
        finally:
            listener.close()

    run(main())


@pytest.mark.timeout(120)
def test_many_idle_connections_from_a_neighbour_do_not_lock_an_agent_out():
    """300 connections from another address (a neighbour on the network, here 127.0.0.2)
    that say nothing and stay open: an agent of the job's still gets through."""
    from spawner.callback import CallbackListener

    async def main():
        agents, receiver = [], Receiver()
        listener = CallbackListener(SECRET, lambda identity, caller: agents.append(identity)
                                    or receiver, lambda why: None)
        listener.bind("127.0.0.1")
        await listener.serve()
        idle = []
        try:
            async with ticking():
                for _ in range(300):
                    sock = socket.socket()
                    sock.setblocking(False)
                    sock.bind(("127.0.0.2", 0))
                    idle.append(sock)
                    await asyncio.get_running_loop().sock_connect(
                        sock, ("127.0.0.1", listener.port))
                await an_agent_calls(listener, receiver, [b"frames"])
                assert len(agents) == 1
        finally:
            for sock in idle:
                sock.close()
            listener.close()

    run(main(), timeout=90)


stack_frames = st.sampled_from([["/x.py", 3, "f", "x()"], ["/x.py", "3", "f", ""], ["a"], None,
                                [1, 2**70, None, []], {"file": "x"}])
stack_threads = st.fixed_dictionaries({}, optional={
    "thread": json_values, "truncated": json_values,
    "frames": st.lists(stack_frames, max_size=3) | json_values})
stack_answers = st.fixed_dictionaries({}, optional={
    "pid": json_values, "how": json_values, "error": json_values,
    "threads": st.lists(stack_threads | json_values, max_size=3) | json_values})


@settings(FAST, max_examples=150)
@given(st.dictionaries(st.sampled_from(["stacks", "other"]),
                       st.dictionaries(st.sampled_from(["0", "1", "x", "-1"]),
                                       stack_answers | json_values, max_size=3) | json_values,
                       max_size=2))
def test_an_agents_stacks_are_shown_whatever_it_answers(result):
    """poprunctl stacks and --stall-timeout fold and show what an agent answers STACKS with:
    any answer is either refused as no stacks (AgentRequestError) or shown."""
    from poprun.jobctl.stacks import fold, render
    from spawner.protocol import MAGIC, Kind, encode
    from spawner.remote import AgentRequestError

    async def main():
        spawner, session, sink, lost, crashes = spawner_under_test(asyncio.get_running_loop())
        session.data_received(MAGIC, None)
        asking = asyncio.ensure_future(spawner.stacks(None, 5))
        await asyncio.sleep(0)
        session.data_received(encode(Kind.REPLY, id=1, result=result), None)
        try:
            stacks = await asking
        except AgentRequestError:
            event("no stacks")
            return
        assert isinstance(render(fold(stacks)), str) and not lost and not crashes
        event("shown")

    run(main())


@settings(FAST, max_examples=150)
@given(st.dictionaries(st.sampled_from(["protocol", "poprun", "python", "hostname", "pid",
                                        "cwd", "cwd_exists", "program"]),
                       json_values | st.fixed_dictionaries(
                           {}, optional={"version": st.lists(json_values, max_size=4),
                                         "executable": json_values}), max_size=8))
def test_an_agents_hello_is_read_whatever_it_says(reply):
    """The agent's answer to HELLO, any fields of any types: read into the host's facts, their
    types as the launcher uses them; versions that cannot be read are versions that differ
    (AgentVersionError), never an error of the launcher's own."""
    from spawner.remote import AgentInfo, AgentVersionError, Versions, check_versions

    info = AgentInfo.from_reply("h9", reply, b"")
    assert type(info.protocol) is int and type(info.pid) is int
    assert all(type(v) is int for v in info.python)
    assert info.program is None or isinstance(info.program, str)
    try:
        check_versions(info, Versions.here())
    except AgentVersionError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("h9: ")


def test_an_agents_pmix_lost_goes_to_its_world_and_the_agent_is_kept():
    """PMIX_LOST (an agent's PMIx server died while its world was open) is one of a world's
    frames (spawner.protocol.WORLD_KINDS), as on the launcher's own host's link: it reaches
    the world's root, which makes it the job's root cause (run/worlds/pmix.py), and the agent
    is not given up as one that broke the protocol (before, it was: its host lost, the
    server's death unsaid)."""
    from spawner.protocol import MAGIC, Kind, encode

    async def main():
        spawner, session, _, lost, crashes = spawner_under_test(asyncio.get_running_loop())
        heard = []
        spawner.open_world(lambda agent, frame: heard.append((agent.host, *frame)),
                           kvsname="poprun-lost-0", size=1, ranks=[0], nodes=[0])
        session.data_received(MAGIC + encode(Kind.PMIX_LOST, kvsname="poprun-lost-0",
                                             error="was killed by SIGKILL"), None)
        await asyncio.sleep(0)
        assert heard == [("h9", Kind.PMIX_LOST, {"kvsname": "poprun-lost-0",
                                                 "error": "was killed by SIGKILL"})]
        assert spawner.lost is None and not lost and not crashes, crashes

    run(main())
