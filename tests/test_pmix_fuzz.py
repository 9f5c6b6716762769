"""Fuzzing what may reach poprun's PMIx service, with Hypothesis (docs/architecture.md, "The
instances' worlds"; spawner/worlds/pmixgate.py, spawner/worlds/pmixhost.py, run/worlds/pmix.py):

- the raw listener from outside the job: any bytes, any number of connections at once (past
  the gate's round of 256 accepts), sent and dropped or held idle, to the PMIx port of a
  running job, whose real Open MPI world must then form with the same result and report as
  untouched (every connection refused unread, at once);
- the raw listener from inside the job: bytes a descendant of an instance sends libpmix
  itself through the gate (noise, headers announcing huge messages, a client's first
  message with lies in it), after which the world must still form;
- what an agent may send the launcher about a world's PMIx (FENCE_IN, MODEX_WANT, MODEX_GOT,
  PMIX_LOST with any fields), which must never raise, never grow without bound, and leave a
  proper fence working.

Reproducible: derandomized, no example database, bounded in examples (never in wall-clock
time), no shrinking for the launches (a failure shows its example as generated). The Open
MPI ones run with both Open MPIs (test_openmpi_world.py's `ompi`): skipped where one is
missing, failed instead where POPRUN_REQUIRE_OPENMPI=1.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import OFFLINE, poprun_env, reaped
from fuzzing import FAST, LAUNCHES
from test_openmpi_world import ompi  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(300)

# Each example sends to a running job: bounded, reproducible, not shrunk (fuzzing.py).
ON_A_JOB = settings(LAUNCHES, max_examples=15)
IN_PROCESS = settings(FAST, max_examples=150)
REFUSED_WITHIN = 5.0  # seconds for the gate to close a connection from outside the job

# Ranks say where their server is, wait for the test's go, then form their world.
WORLD_AFTER_GO = r"""
import os, sys, time
relay = None
if os.environ["PMIX_RANK"] == "0":
    print("uri", os.environ["PMIX_SERVER_URI2"], os.environ["PMIX_NAMESPACE"], flush=True)
    if len(sys.argv) > 2:  # a helper of the job's own, relaying the test's bytes to PMIx
        import subprocess
        relay = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[2]])
deadline = time.monotonic() + 240
while not os.path.exists(sys.argv[1]):
    assert time.monotonic() < deadline, "no go"
    time.sleep(0.01)
if relay is not None:
    relay.kill()
    relay.wait()
from mpi4py import MPI
c = MPI.COMM_WORLD
print("world", c.Get_rank(), c.Get_size(), c.allreduce(c.Get_rank() + 1), flush=True)
"""

# The relay: a descendant of instance 0, so the gate lets it through to libpmix. It takes
# one example a connection on a Unix socket (JSON: the bytes, base64, and how long to hold
# the PMIx connection afterwards), sends them to the PMIx port, and answers when done.
RELAY = r"""
import base64, json, os, socket, sys, time
uri = os.environ["PMIX_SERVER_URI2"].split(";", 1)[1]
host, port = uri.split("//", 1)[1].rsplit(":", 1)
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1] + ".tmp"); os.rename(sys.argv[1] + ".tmp", sys.argv[1])
server.listen(4)
while True:
    conn, _ = server.accept()
    example = json.loads(conn.makefile().readline())
    pmix = socket.create_connection((host, int(port)), timeout=5)
    try:
        pmix.sendall(base64.b64decode(example["data"]))
        pmix.settimeout(example["hold"])
        pmix.recv(65536)
    except OSError:
        pass
    pmix.close()
    conn.sendall(b"done\n")
    conn.close()
"""


def _start(ompi, tmp_path, *relay: str):
    python, env = ompi
    go, out = tmp_path / "go", tmp_path / "r.json"
    job = subprocess.Popen(
        ompi.poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", f"--result-json={out}",
                    *python, "-c", WORLD_AFTER_GO, str(go), *relay),
        env=poprun_env({"POPRUN_NO_DASHBOARD": "1", **env}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    _, uri, _ = job.stdout.readline().decode().split()
    host, port = uri.split("//", 1)[1].rsplit(":", 1)
    return job, go, out, (host, int(port))


def _assert_untouched(job, go, out) -> str:
    """Go: the world forms, and the job ends as one nobody touched."""
    go.touch()
    stdout, stderr = job.communicate(timeout=120)
    stderr = stderr.decode()
    assert job.returncode == 0, stderr[-3000:]
    assert sorted(line.split() for line in stdout.decode().splitlines()
                  if line.startswith("world")) == [["world", "0", "2", "3"],
                                                    ["world", "1", "2", "3"]]
    result = json.loads(out.read_text())
    assert result["exit_code"] == 0 and result["root_cause"] is None
    assert [i["exit_status"] for i in result["instances"]] == [0, 0]
    # No error of poprun's and no report (libpmix's own complaints about bytes from the
    # job's own processes, in its server's stderr, are libpmix's)
    assert not [line for line in stderr.splitlines()
                if " POPRUN [E] " in line or line.startswith("poprun:")], stderr
    return stderr


# PMIx's wire: a client's messages start with a header of four 32-bit numbers (pindex, tag,
# nbytes, ...); its first one names its security mode, namespace and rank.
HEADERS = st.builds(lambda a, b, n, d: struct.pack("!IIII", a, b, n, d),
                    st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                    st.sampled_from([0, 1, 16, 1 << 20, 0x7FFFFFFF, 0xFFFFFFF0, 0xFFFFFFFF]),
                    st.integers(0, 2**32 - 1))


def _first_messages(nspace: str):
    return st.builds(
        lambda pindex, mode, ns, rank, rest: (struct.pack("!I", pindex) + mode + b"\0"
                                              + ns + b"\0" + struct.pack("!I", rank) + rest),
        st.integers(0, 1 << 16), st.sampled_from([b"native", b"munge", b"none", b""]),
        st.sampled_from([nspace.encode(), b"", b"x" * 300]),
        st.sampled_from([0, 1, 2, 0xFFFFFFFE, 0xFFFFFFFF]), st.binary(max_size=256))


def _payloads(nspace: str):
    return st.one_of(
        st.binary(max_size=2048),
        st.binary(min_size=60_000, max_size=300_000),  # past the gate's 64 KiB chunks
        st.builds(bytes.__add__, HEADERS, st.binary(max_size=64)),
        _first_messages(nspace),
        st.just(b""))


def test_the_pmix_port_refuses_everyone_outside_the_job_unread(tmp_path, ompi):
    job, go, out, where = _start(ompi, tmp_path)
    with reaped(job):
        @ON_A_JOB
        @given(connections=st.lists(st.tuples(_payloads("poprun"), st.booleans()),
                                    min_size=1, max_size=8),
               idle=st.integers(0, 300))
        @example(connections=[(b"\0" * 300_000, True)], idle=300)  # past a round of accepts
        def from_outside(connections, idle):
            held = [socket.create_connection(where, timeout=REFUSED_WITHIN)
                    for _ in range(idle)]  # idle ones: past one round of the gate's accepts
            try:
                for data, wait in connections:
                    sock = socket.create_connection(where, timeout=REFUSED_WITHIN)
                    with sock:
                        try:
                            sock.sendall(data)
                        except OSError:
                            pass  # closed while we sent: refused
                        if wait:
                            _assert_closed(sock)
                for sock in held:
                    _assert_closed(sock)
            finally:
                for sock in held:
                    sock.close()

        from_outside()
        stderr = _assert_untouched(job, go, out)
    assert "refused unread: no process of the job holds its socket" in stderr


def _assert_closed(sock: socket.socket) -> None:
    """The gate closed it without an answer (EOF or a reset), within REFUSED_WITHIN."""
    sock.settimeout(REFUSED_WITHIN)
    try:
        assert sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        pass


def test_what_the_job_s_own_processes_send_libpmix_leaves_the_world_working(tmp_path, ompi):
    relay = tmp_path / "relay.sock"
    job, go, out, _ = _start(ompi, tmp_path, str(relay), RELAY)
    with reaped(job):
        deadline = time.monotonic() + 60
        while not relay.exists():
            assert time.monotonic() < deadline and job.poll() is None, "no relay"
            time.sleep(0.01)
        nspace = _nspace_of(job.pid)

        @ON_A_JOB
        @given(data=_payloads(nspace), hold=st.sampled_from([0.0, 0.05, 0.3]))
        def from_inside(data, hold):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(30)
                sock.connect(str(relay))
                sock.sendall(json.dumps({"data": base64.b64encode(data).decode(),
                                         "hold": hold}).encode() + b"\n")
                assert sock.makefile().readline() == "done\n"
            assert job.poll() is None

        from_inside()
        _assert_untouched(job, go, out)


def _nspace_of(pid: int) -> str:
    """The job's namespace, from its record's worlds (poprun `pid`'s own child's
    environment would do too)."""
    from spawner import procid

    for child in procid.descendants([pid]):
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                for entry in f.read().split(b"\0"):
                    if entry.startswith(b"PMIX_NAMESPACE="):
                        return entry.split(b"=", 1)[1].decode()
        except OSError:
            continue
    raise AssertionError("no instance with a PMIx namespace")


# --- what an agent sends the launcher about PMIx ---------------------------------------------

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


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=50) | st.sampled_from(["QUJD", "!!notbase64", "A" * 10_000]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=20)
RANKS = st.lists(st.integers(-2, 5), max_size=6) | st.just(list(range(1000)))
FIELDS = st.fixed_dictionaries({}, optional={
    "ranks": RANKS | JSON_VALUES, "seq": st.integers(-1, 2**40) | JSON_VALUES,
    "data": st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()) | JSON_VALUES,
    "id": st.integers(-1, 2**40) | JSON_VALUES, "rank": st.integers(-1, 8) | JSON_VALUES,
    "status": st.integers(-200, 10) | JSON_VALUES, "error": JSON_VALUES})
MESSAGES = st.lists(st.tuples(
    st.sampled_from(["FENCE_IN", "MODEX_WANT", "MODEX_GOT", "PMIX_UNSERVED", "PMIX_LOST",
                     "BOGUS"]), st.sampled_from(["h1", "h2"]), FIELDS), max_size=60)


@IN_PROCESS
@given(messages=MESSAGES)
def test_what_an_agent_sends_about_pmix_never_breaks_the_launcher(messages):
    from poprun.run.worlds.pmix import PmixWorld
    from spawner.worlds import pmixplan
    from spawner.worlds.fences import MAX_OPEN_FENCES

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    log, lost = _Log(), []
    world = PmixWorld("poprun-fuzz-0", ["h1", "h1", "h2", "h2"], agents, None,
                      lambda host, why: lost.append((host, why)), log)
    for kind, host, fields in messages:
        world.from_agent(agents[host], kind, fields)
    assert len(world._fences._open) <= MAX_OPEN_FENCES
    assert all(len(m) < 1000 for m in log.warnings)
    assert all(len(why) <= 500 for _, why in lost)
    # A proper fence over the whole world still completes, with both hosts' data in order.
    for agent in agents.values():
        agent.told.clear()
    ranks, seq = [0, 1, 2, 3], 10**12
    world.from_agent(agents["h2"], "FENCE_IN", {"ranks": ranks, "seq": seq,
                                                "data": base64.b64encode(b"two").decode()})
    world.from_agent(agents["h1"], "FENCE_IN", {"ranks": ranks, "seq": seq,
                                                "data": base64.b64encode(b"one").decode()})
    for agent in agents.values():
        (out,) = [f for kind, f in agent.told if kind == "FENCE_OUT" and f.get("seq") == seq]
        assert base64.b64decode(out["data"]) == b"onetwo"


SETS = st.lists(st.tuples(st.sampled_from(["poprun-fuzz-0", "poprun-fuzz-0-spawn0", "x", ""]),
                          RANKS), max_size=4).map(lambda s: [[n, r] for n, r in s])
CROSS_MESSAGES = st.lists(st.tuples(st.sampled_from([0, 1]), st.sampled_from(["h1", "h2"]),
                                    st.fixed_dictionaries({}, optional={
                                        "ranks": RANKS | JSON_VALUES,
                                        "seq": st.integers(-1, 3) | JSON_VALUES,
                                        "data": st.just("") | JSON_VALUES,
                                        "sets": SETS | JSON_VALUES})), max_size=60)


@IN_PROCESS
@given(messages=CROSS_MESSAGES)
def test_what_an_agent_sends_about_a_connect_across_namespaces_never_breaks_the_launcher(
        messages):
    """FENCE_IN's `sets` (a connect or group over the instances' and a spawned world's
    namespaces), fuzzed through either world's link: nothing raised, the job's table
    bounded, and then a proper connect over both still completes on both hosts, each
    answered by the link it came by."""
    from poprun.run.worlds.pmix import PmixWorld
    from spawner.worlds.fences import MAX_OPEN_FENCES

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    log = _Log()
    parents = PmixWorld("poprun-fuzz-0", ["h1", "h2"], agents, None,
                        lambda *a: None, log)
    children = PmixWorld("poprun-fuzz-0-spawn0", ["h2", "h2", "h1"], agents, None,
                         lambda *a: None, log,
                         beside=parents)
    worlds = [parents, children]
    for which, host, fields in messages:
        worlds[which].from_agent(agents[host], "FENCE_IN", fields)
    assert len(parents.crossings.table._open) <= MAX_OPEN_FENCES
    assert all(len(m) < 1000 for m in log.warnings)
    for agent in agents.values():
        agent.told.clear()
    sets = [["poprun-fuzz-0", [0]], ["poprun-fuzz-0-spawn0", [0, 1, 2]]]
    children.from_agent(agents["h2"], "FENCE_IN", {"ranks": [0, 1, 2], "seq": 9, "data": "",
                                                   "sets": sets})
    assert not agents["h2"].told  # h1 holds participants too
    parents.from_agent(agents["h1"], "FENCE_IN", {"ranks": [0], "seq": 9, "data": "",
                                                  "sets": sets})
    assert agents["h1"].told == [("FENCE_OUT", {"kvsname": "poprun-fuzz-0", "ranks": [0],
                                                "seq": 9, "sets": sets, "data": ""})]
    assert agents["h2"].told == [("FENCE_OUT", {"kvsname": "poprun-fuzz-0-spawn0",
                                                "ranks": [0, 1, 2], "seq": 9, "sets": sets,
                                                "data": ""})]


def test_a_connect_across_namespaces_is_refused_to_a_host_without_a_participant_by_its_link():
    """h2 enters a connect by the parents' link, holding none of their participants (rank 0
    is h1's); a namespace that is not the job's; an entry twice: each answered with an
    error, to that host only."""
    from poprun.run.worlds.pmix import PmixWorld

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    parents = PmixWorld("poprun-fuzz-0", ["h1", "h2"], agents, None,
                        lambda *a: None, _Log())
    PmixWorld("poprun-fuzz-0-spawn0", ["h2"], agents, None,
              lambda *a: None, _Log(), beside=parents)
    sets = [["poprun-fuzz-0", [0]], ["poprun-fuzz-0-spawn0", [0]]]
    parents.from_agent(agents["h2"], "FENCE_IN", {"ranks": [0], "seq": 0, "data": "",
                                                  "sets": sets})
    assert "holds no participant" in agents["h2"].told[-1][1]["error"]
    parents.from_agent(agents["h1"], "FENCE_IN", {"ranks": [0], "seq": 0, "data": "",
                                                  "sets": [["poprun-fuzz-0", [0]],
                                                           ["poprun-other", [0]]]})
    assert "not the job's" in agents["h1"].told[-1][1]["error"]
    parents.from_agent(agents["h1"], "FENCE_IN", {"ranks": [0], "seq": 1, "data": "",
                                                  "sets": sets})
    parents.from_agent(agents["h1"], "FENCE_IN", {"ranks": [0], "seq": 1, "data": "",
                                                  "sets": sets})
    assert agents["h1"].told[-1][1]["error"] == "h1 entered connect 1 twice"
    assert not [f for _, f in agents["h2"].told if "data" in f]


def test_what_an_agent_says_about_pmix_in_a_loop_is_warned_once_per_host():
    """PMIX_UNSERVED, and messages that cannot be PMIx's, over and over from each host: each
    host's of each is said once (another host's too), never once a frame."""
    from poprun.run.worlds.pmix import PmixWorld

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    log = _Log()
    world = PmixWorld("poprun-fuzz-3", ["h1", "h2"], agents, None,
                      lambda *a: None, log)
    for _ in range(100):
        for host in ("h1", "h2"):
            world.from_agent(agents[host], "PMIX_UNSERVED", {"error": "no libpmix"})
            world.from_agent(agents[host], "FENCE_IN", {"ranks": "x", "seq": 0})
            world.from_agent(agents[host], "MODEX_WANT", {"id": 1, "rank": 99})
    assert sorted(w.split(":")[0] + ("" if "not served" in w else " bad")
                  for w in log.warnings) == ["h1", "h1 bad", "h2", "h2 bad"], log.warnings


def test_a_host_that_enters_a_fence_twice_or_for_others_fails_that_fence_only():
    from poprun.run.worlds.pmix import PmixWorld

    agents = {"h1": _Agent("h1"), "h2": _Agent("h2")}
    world = PmixWorld("poprun-fuzz-1", ["h1", "h2"], agents, None,
                      lambda *a: None, _Log())
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


def test_only_the_host_asked_for_a_rank_s_data_answers_for_it():
    """h1 wants rank 2's data: the launcher asks h3, its owner (MODEX_ASK). h2 answering that
    ask (guessing its id) is ignored; h3's answer reaches h1."""
    from poprun.run.worlds.pmix import PmixWorld

    agents = {h: _Agent(h) for h in ("h1", "h2", "h3")}
    world = PmixWorld("poprun-fuzz-2", ["h1", "h2", "h3"], agents, None,
                      lambda *a: None, _Log())
    world.from_agent(agents["h1"], "MODEX_WANT", {"id": 5, "rank": 2})
    [(kind, ask)] = agents["h3"].told
    assert kind == "MODEX_ASK" and ask["rank"] == 2
    forged, real = (base64.b64encode(data).decode() for data in (b"forged", b"real"))
    world.from_agent(agents["h2"], "MODEX_GOT", {"id": ask["id"], "status": 0, "data": forged})
    assert agents["h1"].told == []
    world.from_agent(agents["h3"], "MODEX_GOT", {"id": ask["id"], "status": 0, "data": real})
    assert agents["h1"].told == [("MODEX_DATA", {"kvsname": "poprun-fuzz-2", "id": 5,
                                                 "status": 0, "data": real})]


def test_the_kernel_s_socket_table_is_read_as_the_kernel_writes_it():
    """pmixgate's reading of /proc/net/tcp, against this machine's own table: a socket we
    listen on is found, with our uid, as LISTEN."""
    from spawner.worlds import pmixgate

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with open("/proc/net/tcp") as f:
            table = pmixgate.parse_table(f.read())
        key = (pmixgate.address_hex("127.0.0.1", port, socket.AF_INET), "00000000:0000")
        uid, inode, state = table[key]
        assert (uid, state) == (os.getuid(), pmixgate.LISTEN)
        assert pmixgate.socket_inodes("self")[inode] == listener.fileno()


def test_an_epoll_that_watched_libpmix_s_listener_watches_the_gate_s_unix_listener(tmp_path):
    """What libpmix 5.0.5+'s libevent loop sees once the gate has put its Unix listener
    under the TCP listener's descriptor (pmixgate._rewatch): a real epoll, registered as
    libevent registers it (level-triggered EPOLLIN, the descriptor's number as its data),
    is woken by a connection to the Unix listener and reports that number, and no longer by
    one to the TCP port the gate keeps. Without the move it is the other way round (the
    registration follows the TCP socket), which left instances outside the world."""
    import select

    from spawner.worlds import pmixgate

    with socket.socket() as tcp, select.epoll() as loop:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        fd = tcp.fileno()
        loop.register(fd, select.EPOLLIN)
        watchers = pmixgate.epoll_watchers(fd, os.fstat(fd).st_ino)
        # the kernel adds EPOLLERR and EPOLLHUP to every registration
        assert watchers == [(loop.fileno(), select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP)]
        kept = socket.socket(fileno=os.dup(fd))  # the gate's: the port stays open
        inner = socket.socket(socket.AF_UNIX)
        inner.bind(str(tmp_path / "gate"))
        inner.listen(8)
        pmixgate._rewatch(watchers, fd, lambda: os.dup2(inner.fileno(), fd))
        inner.close()
        with kept, socket.create_connection(kept.getsockname()):
            assert loop.poll(0.5) == []  # the TCP port's connection wakes nobody there
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(tmp_path / "gate"))
                assert loop.poll(5) == [(fd, select.EPOLLIN)]
        assert pmixgate.epoll_watchers(fd, os.fstat(fd).st_ino) == watchers


def test_an_epoll_s_fdinfo_is_read_as_the_kernel_writes_it():
    from spawner.worlds import pmixgate

    text = ("pos:\t0\nflags:\t02000002\nmnt_id:\t17\nino:\t1044\n"
            "tfd:        6 events:       19 data:                6  pos:0 ino:414 sdev:10\n"
            "tfd:       15 events:       19 data:     7f980000000f  pos:0 ino:4f8cd1 sdev:9\n"
            "tfd:       x events: zz\n")
    assert pmixgate.parse_epoll_fdinfo(text) == {6: (0x19, 0x414), 15: (0x19, 0x4f8cd1)}


def test_a_select_thread_waiting_on_libpmix_s_listener_is_woken_onto_the_gate_s(tmp_path):
    """libpmix's listen thread up to 4.2.8 (Debian's 4.2.2) select()s its listener's number;
    one already inside select() when the gate puts its Unix listener under that number
    waits on the TCP socket still, until its 2 s timeout: the first instances' MPI_Init
    waited with it. `pmixgate.interrupt` ends that select() (EINTR), and the next one is on
    the Unix listener. A Python thread's select.select stands in for libpmix's: the same
    system call on the same number, retried after EINTR (PEP 475) as libpmix's loop does."""
    import platform
    import select
    import signal
    import threading

    from spawner.worlds import pmixgate

    selects = {"x86_64": {"23", "270"}, "aarch64": {"72"}}.get(platform.machine())
    if selects is None:  # no switch: the machine's architecture
        pytest.skip(f"select's system call number on {platform.machine()} is not known here")
    old = signal.signal(pmixgate.WAKE_SIGNAL, lambda *_: None)
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as inner:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        fd = tcp.fileno()
        kept = socket.socket(fileno=os.dup(fd))  # the gate's: the port stays open
        woke = []
        waiter = threading.Thread(target=lambda: woke.append(select.select([fd], [], [], 60)),
                                  daemon=True)
        waiter.start()
        try:
            deadline = time.monotonic() + 30
            while True:  # inside select(), on the TCP socket
                with open(f"/proc/self/task/{waiter.native_id}/syscall") as f:
                    if f.read().split()[0] in selects:
                        break
                assert time.monotonic() < deadline, "the thread never selected"
                time.sleep(0.01)
            inner.bind(str(tmp_path / "gate"))
            inner.listen(8)
            os.dup2(inner.fileno(), fd)
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(str(tmp_path / "gate"))
                waiter.join(0.5)
                assert waiter.is_alive()  # its select() is on the TCP socket still
                pmixgate.interrupt([waiter.native_id])
                waiter.join(30)
                assert woke == [([fd], [], [])]
        finally:
            kept.close()
            signal.signal(pmixgate.WAKE_SIGNAL, old)


def test_sock_diag_names_a_connection_s_owner_as_the_kernel_s_table_does():
    """spawner/worlds/sockdiag.py's exact lookup, against /proc/net/tcp (the gate's fallback) for
    the same real loopback connection: our uid and the client socket's inode from both; a
    socket that is not there is None; answers that are not the kernel's are refused."""
    from spawner.worlds import pmixgate, sockdiag

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname()) as client:
            server, _ = listener.accept()
            with server:
                diag = sockdiag.Diag()
                try:
                    # as the gate asks: the peer's socket, seen from the accepted one
                    found = diag.lookup(server.getpeername(), server.getsockname(),
                                        socket.AF_INET)
                    assert found == (os.getuid(), os.fstat(client.fileno()).st_ino)
                    with open("/proc/net/tcp") as f:
                        table = pmixgate.parse_table(f.read())
                    peer, ours = server.getpeername(), server.getsockname()
                    key = (pmixgate.address_hex(*peer, socket.AF_INET),
                           pmixgate.address_hex(*ours, socket.AF_INET))
                    assert table[key][:2] == found
                    assert diag.lookup(("127.0.0.1", 1), ("127.0.0.1", 2), socket.AF_INET) \
                        is None
                finally:
                    diag.close()
    for garbage in (b"", b"\0" * 15, sockdiag.NLMSG.pack(16, 99, 0, 7, 0),
                    sockdiag.NLMSG.pack(20, sockdiag.NLMSG_ERROR, 0, 7, 0) + b"\xf3\xff\xff\xff",
                    sockdiag.NLMSG.pack(16, sockdiag.SOCK_DIAG_BY_FAMILY, 0, 8, 0)):
        with pytest.raises(sockdiag.Unavailable):
            sockdiag.parse_answer(garbage, 7)
