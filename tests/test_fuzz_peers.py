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
import struct

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fuzzing import FAST, HEAVY, run, ticking

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
               "kvsname", "count", "puts", "exitcode", "message", "initialized", "value"]
json_values = st.sampled_from(  # each JSON type, and the values at its edges
    [None, True, False, 0, 1, 3, -1, 2**31, 2**70, -2**70, 1.5, float("nan"), float("inf"),
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
    the loop's exception handler), keeps what it buffers bounded, and either reports the
    honest instances exactly as the agent said, or gives the agent up as lost, once, saying
    its output is not the agent protocol."""
    from spawner.protocol import MAGIC

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
        from spawner.remote import AgentInternalError

        # Only an INTERNAL frame's news reaches the handler: the agent's bug, as it said it.
        assert all(isinstance(c.get("exception"), AgentInternalError) for c in crashes), \
            crashes[0].get("exception")
        assert spawner._decoder.pending <= len(data)
        assert_in_order(sink.events)
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
    frame of gigabytes: the launcher says so at once, rather than wait for it (and hold it)."""
    from spawner.protocol import MAGIC

    async def main():
        spawner, session, sink, lost, crashes = spawner_under_test(asyncio.get_running_loop())
        session.data_received(MAGIC + honest_frames([0])[0] + b"hello, world\n", None)
        await asyncio.sleep(0.01)
        assert lost == [("h9", "the agent's output is not the agent protocol (a frame of "
                                 "1751477356 bytes announced, past the protocol's 268435456)")]
        assert spawner.pid(0) == 1000  # what came whole before it still counts
        assert not crashes

    run(main())


# --- an agent's frames about the MPI world it serves (poprun/run/world.py) --------------------

class Plan:
    """The little of a LaunchPlan an MpiWorld reads: ranks 0-1 here, 2-4 on host h9."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.instances = [SimpleNamespace(index=i, host="localhost" if i < 2 else "h9",
                                          local_index=i if i < 2 else i - 2, argv=("x",))
                          for i in range(5)]

    def on_host(self, host: str):
        return [inst for inst in self.instances if inst.host == host]


world_fields = st.fixed_dictionaries(
    {"kvsname": st.sampled_from(["poprun-fuzz-9", "other"])},
    optional={"key": st.sampled_from([0, 2, 4, 5, -1, "2", True, None, 2**70]),
              "count": st.sampled_from([0, 1, 3, 4, -1, "3", None, 2**70]),
              "puts": st.sampled_from([{}, {"k": "v"}, {"k": 1}, [], None, "x"]),
              "id": st.sampled_from([1, "1", None]), "exitcode": json_values,
              "message": json_values, "initialized": json_values, "value": json_values})


@settings(FAST, max_examples=100)
@given(st.lists(st.tuples(st.sampled_from(["BARRIER_IN", "GET", "MPI_ABORT", "MPI_LOST"]),
                          world_fields), max_size=8))
def test_an_agents_world_frames_are_checked_before_the_world_acts(frames):
    """Every world frame of host h9's agent, as the launcher's world reads them: one that
    names a rank of another host, or has a field of the wrong type, is a ProtocolError (its
    spawner gives the agent up); the others reach the world, an abort or a loss naming one
    of h9's ranks, with its numbers."""
    from poprun.run.world import MpiWorld
    from spawner.protocol import Control, Kind, ProtocolError

    async def main():
        loop = asyncio.get_running_loop()
        aborts, lost, told = [], [], []
        spawner = type("Spawner", (), {"host": "h9", "tell": lambda self, kind, **f:
                                       told.append((kind, f))})()
        world = MpiWorld("poprun-fuzz-9", Plan(), loop, lifeline=None,
                         on_abort=lambda *a: aborts.append(a), on_lost=lambda *a: lost.append(a))
        async with ticking():
            for name, fields in frames:
                try:
                    world._from_agent(spawner, Control(Kind[name], dict(fields)))
                except ProtocolError:
                    event("refused")
                await asyncio.sleep(0)
        assert all(rank in (2, 3, 4) and type(code) is int and type(message) is str
                   for rank, code, message in aborts), aborts
        assert all(rank in (2, 3, 4) and type(initialized) is bool
                   for rank, initialized in lost), lost
        for kind, fields in told:
            assert kind in (Kind.VALUE, Kind.BARRIER_OUT), told
        await world.close()

    run(main())
