"""Fuzzing what may reach poprun's PMIx service, bounded in time (docs/architecture.md, "The
instances' worlds"): an instance's bytes to its host's PMIx server socket (libpmix's own
listener: garbage, headers announcing huge messages, connections dropped midway), after
which the real Open MPI world of the same instances must still form; and what an agent may
send the launcher about a world's PMIx (FENCE_IN, MODEX_WANT, MODEX_GOT with any fields),
which must never raise, never grow without bound, and leave a proper fence working.
"""

from __future__ import annotations

import base64
import random
import time

import pytest

from conftest import OFFLINE, run_poprun
from requires import skip_or_fail
from test_openmpi_world import OPEN_MPIS, _probe

pytestmark = pytest.mark.timeout(180)

FUZZ_SECONDS = 3.0

GARBAGE = """
import os, random, socket, struct, time
uri = os.environ["PMIX_SERVER_URI2"].split(";", 1)[1]  # tcp4://127.0.0.1:<port>
host, port = uri.split("//", 1)[1].rsplit(":", 1)
rng = random.Random(1000 + int(os.environ["PMIX_RANK"]))
end, sent = time.monotonic() + SECONDS, 0
while time.monotonic() < end:
    try:
        s = socket.create_connection((host, int(port)), timeout=1)
    except OSError:
        continue
    kind = rng.randrange(4)
    if kind == 0:  # noise
        data = rng.randbytes(rng.randrange(1, 2048))
    elif kind == 1:  # a header that announces a huge message, then little
        data = struct.pack("!IIII", rng.getrandbits(32), rng.getrandbits(32), 0xFFFFFFF0,
                           rng.getrandbits(32)) + rng.randbytes(16)
    elif kind == 2:  # what a client's first message could look like, with lies in it
        data = (struct.pack("!I", rng.randrange(1 << 16)) + b"native\\0" +
                os.environ["PMIX_NAMESPACE"].encode() + b"\\0" + struct.pack("!I", 7) +
                rng.randbytes(rng.randrange(64)))
    else:  # nothing: connect and drop
        data = b""
    try:
        s.sendall(data)
        s.settimeout(0.05)
        s.recv(64)
    except OSError:
        pass
    s.close()
    sent += 1
from mpi4py import MPI
c = MPI.COMM_WORLD
print("after", sent > 0, c.Get_rank(), c.Get_size(), c.allreduce(1), flush=True)
""".replace("SECONDS", repr(FUZZ_SECONDS))


def test_garbage_on_the_pmix_socket_leaves_the_world_working():
    version = next((v for v in sorted(OPEN_MPIS) if _probe(v) is None), None)
    if version is None:
        skip_or_fail("no Open MPI under mpi4py here", "POPRUN_REQUIRE_OPENMPI")
    python, env = OPEN_MPIS[version]
    started = time.monotonic()
    proc = run_poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3", *python, "-c",
                      GARBAGE, timeout=150, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("after"))
    assert lines == [f"after True {r} 3 3" for r in range(3)]
    assert time.monotonic() - started < 120


class _Agent:
    """A RemoteSpawner as PmixWorld uses it: its host and what it is told."""

    def __init__(self, host: str) -> None:
        self.host, self.told = host, []

    def tell(self, kind, **fields) -> None:
        self.told.append((kind.name, fields))


class _Log:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str) -> None:
        self.warnings.append(msg)

    def debug(self, msg: str) -> None:
        pass


def _value(rng: random.Random):
    return rng.choice([None, -1, 0, 1, 3, 2**40, "1", "x", [], [0, 1], [3, 2], [0, 0],
                       [-1], ["a"], {}, 1.5, True, "QUJD", "!!notbase64", "A" * 1000,
                       [0, 1, 2, 3], list(range(100))])


def test_what_an_agent_sends_about_pmix_never_breaks_the_launcher():
    from poprun.run.pmixworld import PmixWorld
    from spawner import pmixplan

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    log = _Log()
    world = PmixWorld("poprun-fuzz-0", ["h1", "h1", "h2", "h2"], agents, None,
                      lambda *a: None, log)
    rng = random.Random(7)
    end = time.monotonic() + FUZZ_SECONDS
    kinds = ["FENCE_IN", "MODEX_WANT", "MODEX_GOT", "PMIX_UNSERVED", "BOGUS"]
    while time.monotonic() < end:
        fields = {key: _value(rng) for key in rng.sample(
            ["ranks", "seq", "data", "id", "rank", "status", "error"], rng.randrange(8))}
        world.from_agent(agents[rng.choice(["h1", "h2"])], rng.choice(kinds), fields)
    assert len(world._fences._open) <= pmixplan.MAX_OPEN_FENCES
    assert all(len(m) < 1000 for m in log.warnings)
    # A proper fence over the whole world still completes, with both hosts' data in order.
    for agent in agents.values():
        agent.told.clear()
    ranks, seq = [0, 1, 2, 3], 10**6
    world.from_agent(agents["h2"], "FENCE_IN", {"ranks": ranks, "seq": seq,
                                                "data": base64.b64encode(b"two").decode()})
    world.from_agent(agents["h1"], "FENCE_IN", {"ranks": ranks, "seq": seq,
                                                "data": base64.b64encode(b"one").decode()})
    for agent in agents.values():
        (out,) = [f for kind, f in agent.told if kind == "FENCE_OUT" and f.get("seq") == seq]
        assert base64.b64decode(out["data"]) == b"onetwo"


def test_a_host_that_enters_a_fence_twice_or_for_others_fails_that_fence_only():
    from poprun.run.pmixworld import PmixWorld

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    world = PmixWorld("poprun-fuzz-1", ["h1", "h2"], agents, None, lambda *a: None, _Log())
    data = base64.b64encode(b"x").decode()
    world.from_agent(agents["h1"], "FENCE_IN", {"ranks": [0, 1], "seq": 0, "data": data})
    world.from_agent(agents["h1"], "FENCE_IN", {"ranks": [0, 1], "seq": 0, "data": data})
    assert agents["h1"].told == [("FENCE_OUT", {"kvsname": "poprun-fuzz-1", "ranks": [0, 1],
                                                "seq": 0,
                                                "error": "node 0 entered fence 0 twice"})]
    world.from_agent(agents["h2"], "FENCE_IN", {"ranks": [0], "seq": 0, "data": data})
    assert agents["h2"].told[-1][1]["error"] == "node 1 holds no rank of that fence"
    # The first entry stands: h2's own entry completes that fence for both.
    world.from_agent(agents["h2"], "FENCE_IN", {"ranks": [0, 1], "seq": 0, "data": data})
    assert agents["h1"].told[-1][1]["data"] == base64.b64encode(b"xx").decode()
