"""The per-host agent (`python -m spawner.agent`) and its launcher side (spawner.remote).

First the agent alone, run here with pipes for stdin/stdout; then through real OpenSSH servers
on loopback addresses (tests/sshd_hosts.py), where `POPRUN_SSH_CONNECTION` in an instance's
environment proves it was started through sshd. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections import defaultdict
from pathlib import Path

import asyncssh
import pytest

from conftest import poprun_env
from poprun._version import __version__
from requires import needs
from sshd_hosts import SshHosts, processes_with, start_ssh_hosts, wait_until
from spawner.agent import HIGH_WATER
from spawner.local import Stream
from spawner.protocol import (PROTOCOL_VERSION, Control, FrameDecoder, Kind, SpawnRequest,
                              encode)
from spawner.remote import (AgentInfo, AgentStartError, AgentVersionError, RemoteSpawner,
                            RemoteSpawnError, Versions, check_versions)

TIMEOUT = 20
pytestmark = pytest.mark.timeout(60)
PY = sys.executable
SLEEPER = "import time; time.sleep(300)"


# --- helpers -----------------------------------------------------------------------------

def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def with_marker(marker: str) -> list[int]:
    return [pid for pid in processes_with(marker) if alive(pid)]


def sleeper_with_grandchild(marker: str) -> tuple[str, ...]:
    """An instance that starts a grandchild in its process group, prints both pids, waits."""
    sleep = shlex.join([PY, "-c", SLEEPER, marker])
    return ("sh", "-c", f"{sleep} & echo $$ $!; wait", marker)


class LocalAgent:
    """The agent run here as a subprocess, with the test playing the launcher."""

    def __init__(self, argv: tuple[str, ...] = (PY, "-m", "spawner.agent"),
                 env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE,
                                     env=poprun_env() if env is None else env)
        self.decoder = FrameDecoder(expect_magic=True)
        self.output: dict[tuple[int, Stream], bytearray] = defaultdict(bytearray)
        self.events: list[Control] = []
        self._ids = iter(range(1, 10**6))

    def send(self, kind: Kind, **fields) -> None:
        self.proc.stdin.write(encode(kind, **fields))
        self.proc.stdin.flush()

    def request(self, kind: Kind, **fields) -> Control:
        request_id = next(self._ids)
        self.send(kind, id=request_id, **fields)
        return self.wait_for(lambda f: f.fields.get("id") == request_id)

    def spawn(self, key: int, *argv: str, **fields) -> Control:
        self.send(Kind.SPAWN, **SpawnRequest(key=key, argv=argv, **fields).to_fields())
        return self.wait_for(lambda f: f.kind in (Kind.STARTED, Kind.SPAWN_FAILED)
                             and f.fields["key"] == key)

    def wait_for(self, predicate, timeout: float = TIMEOUT) -> Control:
        """The first control event (past or future) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if predicate(event):
                    self.events.remove(event)
                    return event
            self._read(deadline - time.monotonic())

    def read_line(self, key: int) -> bytes:
        def line() -> bytes | None:
            data = self.output[(key, Stream.STDOUT)]
            return bytes(data[:data.index(b"\n") + 1]) if b"\n" in data else None

        deadline = time.monotonic() + TIMEOUT
        while line() is None:
            self._read(deadline - time.monotonic())
        return line()

    def _read(self, timeout: float) -> None:
        fd = self.proc.stdout.fileno()
        if timeout <= 0 or not select.select([fd], [], [], timeout)[0]:
            pytest.fail("timed out waiting for the agent")
        data = os.read(fd, 1 << 20)
        if not data:
            pytest.fail(f"agent ended: {self.proc.stderr.read().decode()}")
        for frame in self.decoder.feed(data):
            if isinstance(frame, Control):
                self.events.append(frame)
            else:
                self.output[(frame.key, frame.stream)] += frame.data

    def close(self) -> int:
        """Close its stdin, as a launcher that is done does; returns its exit status. Its
        stdout stays open and unread: ending must not need us to read."""
        self.proc.stdin.close()
        return self.proc.wait(TIMEOUT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            pipe.close()


@pytest.fixture
def agent():
    a = LocalAgent()
    yield a
    a.kill()


# --- the agent alone ---------------------------------------------------------------------

def test_hello_describes_the_host(agent, tmp_path):
    script = tmp_path / "myprog"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    result = agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__,
                           python=list(sys.version_info[:2]), cwd=str(tmp_path),
                           program="myprog", path="/nonexistent").fields["result"]
    assert result["protocol"] == PROTOCOL_VERSION and result["poprun"] == __version__
    assert result["python"]["version"][:3] == list(sys.version_info[:3])
    assert os.path.samefile(result["python"]["executable"], sys.executable)
    assert result["hostname"] == os.uname().nodename and result["pid"] == agent.proc.pid
    assert result["cwd_exists"] is True
    assert result["program"] == str(script)  # not on PATH, found in cwd (as mpirun does)

    missing = agent.request(Kind.HELLO, cwd=str(tmp_path / "gone"), program="no-such-prog-x",
                            path=os.environ["PATH"]).fields["result"]
    assert missing["cwd_exists"] is False and missing["program"] is None
    assert agent.request(Kind.HELLO, cwd=str(tmp_path), program="sh",
                         path=os.environ["PATH"]).fields["result"]["program"] == "sh"


def test_spawn_streams_output_and_exit_with_the_environment_applied(agent, tmp_path,
                                                                    monkeypatch):
    script = "echo out $POPRUN_T_SET ${HOME-unset}; echo err >&2; exit 3"
    started = agent.spawn(0, "sh", "-c", script, env_set={"POPRUN_T_SET": "v a l"},
                          env_unset=("HOME",), cwd=str(tmp_path))
    assert started.kind is Kind.STARTED and started.fields["pid"] > 0
    exit_event = agent.wait_for(lambda f: f.kind is Kind.EXIT)
    assert exit_event.fields == {"key": 0, "returncode": 3}
    assert agent.output[(0, Stream.STDOUT)] == b"out v a l unset\n"
    assert agent.output[(0, Stream.STDERR)] == b"err\n"

    agent.spawn(1, "sh", "-c", "pwd; echo err >&2", cwd=str(tmp_path), merge_stderr=True)
    assert agent.wait_for(lambda f: f.kind is Kind.EXIT).fields["returncode"] == 0
    assert agent.output[(1, Stream.STDOUT)] == f"{tmp_path}\nerr\n".encode()
    assert (1, Stream.STDERR) not in agent.output


def test_spawn_binds_the_instance_to_the_cpus_asked_for(agent):
    cpu = max(os.sched_getaffinity(0))
    script = "import os; print(sorted(os.sched_getaffinity(0)))"
    started = agent.spawn(0, PY, "-c", script, cpus=(cpu,))
    assert started.fields["memory_binding_reason"] is None  # no memory binding asked for
    assert agent.wait_for(lambda f: f.kind is Kind.EXIT).fields["returncode"] == 0
    assert agent.output[(0, Stream.STDOUT)] == f"[{cpu}]\n".encode()



def test_the_launchers_own_python_runs_the_agent_without_site(tmp_path):
    """agent_command(None): `python -S`, the agent found in this launcher's directory with no
    PYTHONPATH, and what an instance needs from site-packages (py-libnuma for a memory
    binding) found there when it is needed (spawner.agent._SiteOnDemand)."""
    from spawner.binding import memory_binding_available
    from spawner.remote import agent_command

    env = {k: v for k, v in poprun_env().items() if k != "PYTHONPATH"}
    agent = LocalAgent(("/bin/sh", "-c", agent_command(None)), env)
    try:
        hello = agent.request(Kind.HELLO, cwd=str(tmp_path)).fields["result"]
        assert hello["poprun"] == __version__
        argv = Path(f"/proc/{hello['pid']}/cmdline").read_bytes().split(b"\0")
        assert argv[:3] == [PY.encode(), b"-S", b"-c"]
        started = agent.spawn(0, "true", mems=(0,))
        assert started.kind is Kind.STARTED
        assert (started.fields["memory_binding_reason"] is None) is memory_binding_available()
        assert agent.close() == 0
    finally:
        agent.kill()


def make_venv(base_python: str, where: Path, *, numa: bool) -> str:
    """A virtual environment of `base_python` (no system site packages, no pip: nothing is
    downloaded), with py-libnuma's package copied from this Python's when `numa`: a user's
    venv into which py-libnuma was installed. Returns its interpreter."""
    import numa as numa_package

    subprocess.run([base_python, "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=60)
    python = where / "bin" / "python"
    if numa:
        site_packages = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True, timeout=30, capture_output=True, text=True).stdout.strip()
        shutil.copytree(Path(numa_package.__file__).parent, Path(site_packages) / "numa",
                        ignore=shutil.ignore_patterns("__pycache__"))
    return str(python)


def agent_with_python(python: str, monkeypatch) -> LocalAgent:
    """The agent as the launcher starts it with its own interpreter (agent_command(None):
    `python -S`), had that interpreter been `python`."""
    from spawner.remote import agent_command

    with monkeypatch.context() as patched:
        patched.setattr(sys, "executable", python)
        command = agent_command(None)
    env = {k: v for k, v in poprun_env().items() if k != "PYTHONPATH"}
    return LocalAgent(("/bin/sh", "-c", command), env)


def spawn_bound(agent: LocalAgent, cwd: Path) -> Control:
    agent.request(Kind.HELLO, cwd=str(cwd))
    started = agent.spawn(0, "true", mems=(0,))
    assert started.kind is Kind.STARTED
    return started


def assert_binds_memory(python: str, tmp_path, monkeypatch) -> None:
    """An agent run by `python` starts an instance with its memory bound, nothing skipped."""
    agent = agent_with_python(python, monkeypatch)
    try:
        started = spawn_bound(agent, tmp_path)
        assert started.fields["memory_binding_reason"] is None, started.fields
        assert started.fields["binding"]["mempolicy"] == "bind"
        assert agent.close() == 0
    finally:
        agent.kill()


needs_libnuma = needs("POPRUN_REQUIRE_TOOLS", "no libnuma or NUMA support on this host",
                      not __import__("spawner.binding").binding.memory_binding_available())
DEBIAN_PYTHON = "/usr/bin/python3"  # Debian's own: a base interpreter without py-libnuma


@needs_libnuma
def test_an_agent_run_by_a_venvs_python_finds_py_libnuma_in_the_venv(tmp_path, monkeypatch):
    """Under -S a venv's interpreter has the *base* sys.prefix (site's venv() never ran): the
    agent must find the venv's site-packages itself, not the base installation's."""
    assert_binds_memory(make_venv(sys.executable if sys.prefix == sys.base_prefix
                                  else sys._base_executable, tmp_path / "venv", numa=True),
                        tmp_path, monkeypatch)


@needs_libnuma
@needs("POPRUN_REQUIRE_TOOLS", f"no {DEBIAN_PYTHON} without py-libnuma",
       subprocess.run([DEBIAN_PYTHON, "-c", "import numa"], capture_output=True).returncode == 0
       if os.path.exists(DEBIAN_PYTHON) else True)
def test_py_libnuma_in_the_venv_only_binds_memory(tmp_path, monkeypatch):
    """The base interpreter lacks py-libnuma, the venv has it: the binding is in force."""
    assert_binds_memory(make_venv(DEBIAN_PYTHON, tmp_path / "venv", numa=True), tmp_path,
                        monkeypatch)


def test_a_venv_without_py_libnuma_says_which_module_and_where_it_looked(tmp_path, monkeypatch):
    """The skipped binding's reason names the module and the venv's site-packages, not a
    libnuma that is in fact installed."""
    venv = tmp_path / "venv"
    agent = agent_with_python(make_venv(sys.executable if sys.prefix == sys.base_prefix
                                        else sys._base_executable, venv, numa=False),
                              monkeypatch)
    try:
        started = spawn_bound(agent, tmp_path)
        reason = started.fields["memory_binding_reason"]
        assert "'numa'" in reason and f"{venv}/lib/python" in reason, reason
        assert "libnuma1" not in reason
        assert agent.close() == 0
    finally:
        agent.kill()


# Waits (at most 5 s: without cgroups it never moves) until this process is no longer in
# its parent's cgroup.
IN_OWN_CGROUP = ("import os, time\n"
                 "cg = lambda pid: open(f'/proc/{pid}/cgroup').read()\n"
                 "end = time.monotonic() + 5\n"
                 "while cg('self') == cg(os.getppid()) and time.monotonic() < end:\n"
                 "    time.sleep(0.01)\n")


def test_stats_are_sent_only_when_hello_asks_for_them(agent):
    agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__,
                  python=list(sys.version_info[:2]), cwd=os.getcwd(), stats=0.05)
    # Memory is charged to the cgroup a process is in when it touches the pages, and stays
    # there when it moves: the instance allocates once it is in its own cgroup, where it
    # has one (it enters it before its first instruction: spawner.containment.entering).
    started = agent.spawn(3, PY, "-c", IN_OWN_CGROUP + "x = bytearray(30 << 20); "
                          "print('allocated', flush=True); import time; time.sleep(30)")
    assert agent.read_line(3) == b"allocated\n"  # samples from now on see the 30 MB
    # ... and those read before it may not: wait_for also returns events already read.
    agent.events = [e for e in agent.events if e.kind is not Kind.STATS]
    rates = []
    while not rates or rates[-1][0] is None:  # the first sample has no rate yet
        stats = agent.wait_for(lambda f: f.kind is Kind.STATS)
        rates.append(stats.fields["usage"]["3"])
    cpu, rss = rates[-1]
    assert 0 <= cpu and rss > 30 << 20  # the instance's own 30 MB are resident
    agent.send(Kind.SIGNAL, key=3, signal="SIGKILL")
    assert started.fields["pid"] > 0


def test_mkdir_creates_parents_keeps_them_and_reports_failures(agent, tmp_path):
    path = tmp_path / "a" / "b"
    assert agent.request(Kind.MKDIR, path=str(path)).fields["result"] == {"path": str(path)}
    assert agent.request(Kind.MKDIR, path=str(path)).kind is Kind.REPLY  # exists: fine
    failed = agent.request(Kind.MKDIR, path="/proc/no/such")
    assert failed.kind is Kind.FAILED and "/proc/no/such" in failed.fields["error"]
    assert agent.close() == 0
    assert path.is_dir()  # kept: unlike MKTEMP's


def test_no_stats_without_asking(agent):
    agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__,
                  python=list(sys.version_info[:2]), cwd=os.getcwd())
    agent.spawn(0, PY, "-c", "import time; time.sleep(0.5)")
    agent.wait_for(lambda f: f.kind is Kind.EXIT)
    assert not any(e.kind is Kind.STATS for e in agent.events)


def test_spawn_failures_are_reported_per_instance(agent, tmp_path):
    failed = agent.spawn(0, "/no/such/program")
    assert failed.kind is Kind.SPAWN_FAILED and "No such file" in failed.fields["error"]
    failed = agent.spawn(1, "true", cwd=str(tmp_path / "gone"))
    assert failed.kind is Kind.SPAWN_FAILED and str(tmp_path / "gone") in failed.fields["error"]
    assert agent.spawn(2, PY, "-c", SLEEPER).kind is Kind.STARTED
    duplicate = agent.spawn(2, "true")
    assert duplicate.kind is Kind.SPAWN_FAILED and "already in use" in duplicate.fields["error"]
    agent.send(Kind.SPAWN, key=3, argv=[])
    assert "bad SPAWN" in agent.wait_for(lambda f: f.kind is Kind.SPAWN_FAILED).fields["error"]


def test_signal_reaches_one_instance_or_all(agent):
    for key in range(3):
        assert agent.spawn(key, PY, "-c", SLEEPER).kind is Kind.STARTED
    agent.send(Kind.SIGNAL, key=1, signal="SIGTERM")
    assert agent.wait_for(lambda f: f.kind is Kind.EXIT).fields == {"key": 1, "returncode": -15}
    agent.send(Kind.SIGNAL, key=None, signal="SIGHUP")
    exits = [agent.wait_for(lambda f: f.kind is Kind.EXIT).fields for _ in range(2)]
    assert sorted(e["key"] for e in exits) == [0, 2]
    assert {e["returncode"] for e in exits} == {-signal.SIGHUP}


def test_a_malformed_request_gets_a_failure_naming_it(agent):
    reply = agent.request(Kind.MKTEMP)  # no prefix
    assert reply.kind is Kind.FAILED and "bad MKTEMP request" in reply.fields["error"]
    agent.send(Kind.REPLY, id=99, result={})  # an agent message sent to the agent
    failed = agent.wait_for(lambda f: f.kind is Kind.FAILED)
    assert failed.fields == {"id": None, "error": "unexpected REPLY frame"}


def test_a_garbled_stream_ends_the_agent_and_its_instances(agent):
    started = agent.spawn(0, PY, "-c", SLEEPER)
    agent.proc.stdin.write(b"\0\0\0\2\x63{}")  # a frame of an unknown kind
    agent.proc.stdin.flush()
    failed = agent.wait_for(lambda f: f.kind is Kind.FAILED)
    assert failed.fields == {"id": None, "error": "unknown frame kind 99"}
    assert agent.proc.wait(TIMEOUT) == 1
    wait_until(lambda: not alive(started.fields["pid"]), "the instance to be killed")


# A PMI-1 client as MPICH's speaks it (spawner/worlds/pmi1.py): init, a put, a barrier, gets of
# every rank's key (rank 0's put on another host), then finalize, abort or nothing.
PMI_CLIENT = textwrap.dedent("""
    import os, socket, sys
    s = socket.socket(fileno=int(os.environ["PMI_FD"]))
    f = s.makefile("rwb", buffering=0)
    rank = os.environ["PMI_RANK"]
    def ask(line):
        f.write(line.encode() + b"\\n")
        return f.readline().decode().strip()
    ask("cmd=init pmi_version=1 pmi_subversion=1")
    ask(f"cmd=put kvsname=w key=k{rank} value=from {rank}")
    ask("cmd=barrier_in")
    print(rank, os.environ["PMI_SIZE"], [ask(f"cmd=get kvsname=w key=k{r}") for r in range(3)],
          flush=True)
    end = sys.argv[1]
    if end == "finalize":
        ask("cmd=finalize")
    elif end == "abort":
        f.write(b"cmd=abort exitcode=9 message=bye now\\n")
        sys.stdin.read()  # MPICH returns from MPI_Abort and waits to be killed
""")


def test_a_world_s_ranks_here_go_to_the_launcher_once_per_barrier(agent):
    """The agent serves the PMI of the world's ranks on its host (spawner/worlds/nodeworld.py):
    one FENCE_IN of PMI-1's for both (a fence over every rank), with both puts; FENCE_OUT's
    puts answer their gets of a key put on another host; abort and a connection closed
    unfinalized are reported."""
    agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__, python=[3, 11])
    agent.send(Kind.WORLD, kvsname="w", size=3, ranks=[1, 2], nodes=[0, 1, 1])
    for rank, end in ((1, "none"), (2, "abort")):
        assert agent.spawn(rank, PY, "-c", PMI_CLIENT, end, world="w",
                           env_set={"PMI_RANK": str(rank), "PMI_SIZE": "3"}).kind is Kind.STARTED
    barrier = agent.wait_for(lambda f: f.kind is Kind.FENCE_IN)
    assert barrier.fields == {"kvsname": "w", "of": "pmi1", "ranks": [0, 1, 2], "seq": 0,
                              "puts": {"k1": "from 1", "k2": "from 2"}}
    agent.send(Kind.FENCE_OUT, kvsname="w", of="pmi1", ranks=[0, 1, 2], seq=0,
               puts={"k0": "from 0", "k1": "from 1", "k2": "from 2"})
    for rank in (1, 2):
        assert agent.read_line(rank).decode().split(" ", 2) == [
            str(rank), "3", "['cmd=get_result rc=0 value=from\\\\ 0', "
            "'cmd=get_result rc=0 value=from\\\\ 1', 'cmd=get_result rc=0 value=from\\\\ 2']\n"]
    assert agent.wait_for(lambda f: f.kind is Kind.MPI_ABORT).fields == {
        "kvsname": "w", "key": 2, "exitcode": 9, "message": "bye now"}
    assert agent.wait_for(lambda f: f.kind is Kind.MPI_LOST).fields == {
        "kvsname": "w", "key": 1, "initialized": True}
    assert not [f for f in agent.events if f.kind is Kind.FENCE_IN]  # once per barrier


def test_a_spawn_into_a_world_the_agent_was_not_told_of_fails(agent):
    agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__, python=[3, 11])
    failed = agent.spawn(0, PY, "-c", "pass", world="nowhere")
    assert failed.kind is Kind.SPAWN_FAILED and "nowhere" in failed.fields["error"]


def test_the_agent_imports_the_node_level_world_only_once_a_world_opens_here():
    """An agent whose instances speak no MPI never imports spawner/worlds/nodeworld.py (its
    start stays where it was); the first WORLD frame does (spawner.agent.Agent._world_frame)."""
    def imports(*frames: tuple[Kind, dict]) -> set[str]:
        agent = LocalAgent((PY, "-X", "importtime", "-m", "spawner.agent"))
        try:
            agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__,
                          python=[3, 11])
            for kind, fields in frames:
                agent.send(kind, **fields)
            assert agent.spawn(0, PY, "-c", "pass").kind is Kind.STARTED
            agent.wait_for(lambda f: f.kind is Kind.EXIT)
            assert agent.close() == 0
            log = agent.proc.stderr.read().decode()
        finally:
            agent.kill()
        return {line.rpartition("|")[2].strip() for line in log.splitlines()
                if line.startswith("import time:")}

    plain = imports()
    assert "spawner.local" in plain and "spawner.worlds.nodeworld" not in plain
    assert "spawner.worlds.nodeworld" in imports(
        (Kind.WORLD, {"kvsname": "w", "size": 2, "ranks": [1], "nodes": [0, 1]}))


def test_stdin_must_be_a_pipe():
    proc = subprocess.run([PY, "-m", "spawner.agent"], stdin=subprocess.DEVNULL,
                          capture_output=True, env=poprun_env(), timeout=TIMEOUT)
    assert proc.returncode == 2 and b"stdin must be a pipe" in proc.stderr


def test_stdin_eof_kills_instance_groups_and_removes_temp_dirs(agent):
    path = Path(agent.request(Kind.MKTEMP, prefix="poprun-test-").fields["result"]["path"])
    assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o700
    marker = f"marker-{uuid.uuid4().hex}"
    assert agent.spawn(0, *sleeper_with_grandchild(marker)).kind is Kind.STARTED
    pids = [int(p) for p in agent.read_line(0).split()]
    assert all(alive(pid) for pid in pids)
    # `$!` is printed once forked, maybe before its exec (a process's cmdline reads empty
    # in the middle of one): wait for both to show their marker.
    wait_until(lambda: len(with_marker(marker)) == 2, "the instance and its grandchild", 10)

    assert agent.close() == 0
    wait_until(lambda: not any(alive(pid) for pid in pids), "the instance and its grandchild")
    assert not path.exists()


def test_hello_makes_the_temp_dir_asked_for_and_the_agent_removes_it(agent):
    """HELLO's `mktemp` spares the launcher MKTEMP's round trip: the same 0700 dir, in the
    reply, removed at EOF; one that cannot be made is said in the reply, not as a failure."""
    hello = dict(protocol=PROTOCOL_VERSION, poprun=__version__, python=[3, 11])
    result = agent.request(Kind.HELLO, **hello, mktemp="poprun-test-").fields["result"]
    path = Path(result["temp_dir"])
    assert path.name.startswith("poprun-test-") and "temp_dir_error" not in result
    assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o700
    failed = agent.request(Kind.HELLO, **hello, mktemp="no/such/dir/x").fields["result"]
    assert "temp_dir" not in failed
    assert failed["temp_dir_error"].startswith("cannot create a temporary directory: ")
    assert "temp_dir" not in agent.request(Kind.HELLO, **hello).fields["result"]
    assert agent.close() == 0
    assert not path.exists()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_killed_agent_leaves_no_instance_and_no_temp_dir(agent, how):
    path = Path(agent.request(Kind.MKTEMP, prefix="poprun-test-").fields["result"]["path"])
    marker = f"marker-{uuid.uuid4().hex}"
    agent.spawn(0, *sleeper_with_grandchild(marker))
    pids = [int(p) for p in agent.read_line(0).split()]
    agent.proc.send_signal(how)
    agent.proc.wait(TIMEOUT)
    wait_until(lambda: not any(alive(pid) for pid in pids) and not path.exists(),
               f"the agent's lifeline to clean up after {how.name}")


def test_a_frozen_agent_is_ended_by_its_watchdog_within_the_host_timeout(agent):
    """An agent that stops acting (here SIGSTOP) never closes its watchdog's pipe. Told a
    timeout by HELLO's heartbeat, the watchdog hears no beat for that long, SIGKILLs the agent
    and cleans up after it: instances and temp dir gone. Nothing else would: the
    agent's own check of the launcher's silence runs on its loop, frozen with it."""
    timeout = 1.0
    agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__, python=[3, 11],
                  heartbeat=[timeout / 3, timeout])
    path = Path(agent.request(Kind.MKTEMP, prefix="poprun-test-").fields["result"]["path"])
    marker = f"marker-{uuid.uuid4().hex}"
    agent.spawn(0, *sleeper_with_grandchild(marker))
    pids = [int(p) for p in agent.read_line(0).split()]
    try:
        os.kill(agent.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: not any(alive(pid) for pid in pids) and not path.exists(),
                   "the watchdog to end the instances and remove the temp dir", timeout + 5)
        assert time.monotonic() - stopped < timeout + 3
        assert agent.proc.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.proc.pid, signal.SIGCONT)


def test_an_agent_that_beats_is_left_alone_by_its_watchdog(agent):
    """A well agent beats its watchdog: three timeouts later, with the launcher's heartbeats
    coming as HELLO said, it and its instance still run, and it ends cleanly on EOF."""
    timeout = 1.0
    agent.request(Kind.HELLO, protocol=PROTOCOL_VERSION, poprun=__version__, python=[3, 11],
                  heartbeat=[timeout / 3, timeout])
    started = agent.spawn(0, PY, "-c", SLEEPER)
    until = time.monotonic() + 3 * timeout
    while time.monotonic() < until:  # the launcher's side of the heartbeat
        agent.send(Kind.HEARTBEAT)
        time.sleep(timeout / 3)
    assert agent.proc.poll() is None and alive(started.fields["pid"])
    assert agent.close() == 0


# An instance that writes `total` bytes of output and records, the first time its stdout
# stays unwritable for a whole second, how much it had written by then.
PRODUCER = textwrap.dedent("""
    import os, select, sys
    total, flag = int(sys.argv[1]), sys.argv[2]
    os.set_blocking(1, False)
    line, written, stalled = b"y" * 65535 + b"\\n", 0, False
    while written < total:
        try:
            written += os.write(1, line)
        except BlockingIOError:
            if not select.select([], [1], [], 1.0)[1] and not stalled:
                stalled = True
                with open(flag, "w") as f:
                    f.write(str(written))
""")


def test_backpressure_bounds_memory_and_never_blocks_shutdown(agent, tmp_path):
    flag = tmp_path / "stalled"
    total = 32 << 20
    agent.spawn(0, PY, "-c", PRODUCER, str(total), str(flag))
    # We read nothing more: the agent's stdout fills, then its outbox, then it stops
    # reading the instance, whose writes then block.
    wait_until(flag.exists, "the producer to be held back")
    held_at = int(flag.read_text() or 0)
    assert held_at < HIGH_WATER + (4 << 20), held_at
    # Reading again releases it: every byte arrives, in order, then its exit.
    exit_event = agent.wait_for(lambda f: f.kind is Kind.EXIT, timeout=60)
    assert exit_event.fields["returncode"] == 0
    assert len(agent.output[(0, Stream.STDOUT)]) >= total
    assert set(agent.output[(0, Stream.STDOUT)]) == {ord("y"), ord("\n")}


def test_stdin_eof_while_the_launcher_does_not_read_still_kills(agent, tmp_path):
    flag = tmp_path / "stalled"
    started = agent.spawn(0, PY, "-c", PRODUCER, str(1 << 40), str(flag))
    wait_until(flag.exists, "the producer to be held back")
    assert agent.close() == 0  # stdout is full and closed: EOF must still be seen
    wait_until(lambda: not alive(started.fields["pid"]), "the producer to be killed")


# --- through real sshd --------------------------------------------------------------------

class Recorder:
    """A Sink that keeps everything and wakes waiters."""

    def __init__(self) -> None:
        self.output: dict[tuple[int, Stream], bytearray] = defaultdict(bytearray)
        self.exits: dict[int, int] = {}
        self.lost: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    def on_output(self, key: int, stream: Stream, data: bytes) -> None:
        self.output[(key, stream)] += data
        self.changed.set()

    def on_exit(self, key: int, returncode: int) -> None:
        self.exits[key] = returncode
        self.changed.set()

    def on_lost(self, host: str, reason: str) -> None:
        self.lost.append((host, reason))
        self.changed.set()

    async def until(self, predicate, timeout: float = TIMEOUT) -> None:
        async def changes() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(changes(), timeout)


@pytest.fixture
def hosts(tmp_path):
    with start_ssh_hosts(2, tmp_path) as h:
        yield h


async def connect(hosts: SshHosts, i: int) -> asyncssh.SSHClientConnection:
    return await asyncssh.connect(hosts.aliases[i], config=[str(hosts.ssh_config)],
                                  connect_timeout=TIMEOUT)


async def start_agent(hosts: SshHosts, sink: Recorder, i: int, **kw) -> RemoteSpawner:
    spawner = RemoteSpawner(await connect(hosts, i), hosts.aliases[i], sink, sink.on_lost, **kw)
    await spawner.start(cwd=os.getcwd(), program=PY)
    return spawner


async def start_agents(hosts: SshHosts, sink: Recorder) -> list[RemoteSpawner]:
    return [await start_agent(hosts, sink, i) for i in range(len(hosts.hosts))]


async def close_all(spawners: list[RemoteSpawner]) -> None:
    for spawner in spawners:
        await spawner.close()
        spawner.conn.close()


def server_addr(environ_line: bytes) -> str:
    return environ_line.split()[2].decode()  # SSH_CONNECTION = "caddr cport saddr sport"


# The agent's SSH_CONNECTION, as the agent passes it on (instances get no SSH_* of their own).
PRINT_SSH_CONNECTION = ("import os, sys; print(os.environ['POPRUN_SSH_CONNECTION']); "
                        "sys.exit(int(sys.argv[1]))")


async def test_instances_run_on_each_host_and_report_output_and_exit(hosts):
    sink = Recorder()
    spawners = await start_agents(hosts, sink)
    try:
        for i, spawner in enumerate(spawners):
            assert spawner.info.program == PY and spawner.info.cwd_exists
            assert spawner.timings.ready is not None and spawner.timings.ready > 0
            pids = await spawner.spawn_all([
                SpawnRequest(key=2 * i + k, argv=(PY, "-c", PRINT_SSH_CONNECTION, str(2 * i + k)),
                             env_set={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
                for k in range(2)])
            assert sorted(pids) == [2 * i, 2 * i + 1]
        await sink.until(lambda: len(sink.exits) == 4)
        assert sink.exits == {0: 0, 1: 1, 2: 2, 3: 3}
        for key in range(4):
            assert server_addr(sink.output[(key, Stream.STDOUT)]) == hosts.hosts[key // 2].addr
        assert all(s.idle and s.running() == [] for s in spawners)
        assert spawners[0].timings.first_started >= spawners[0].timings.ready
    finally:
        await close_all(spawners)
    assert sink.lost == []


async def test_arguments_arrive_byte_for_byte(hosts):
    args = ["a b", "it's", 'say "hi"', "$HOME", "`id`", "x; rm -rf /nonexistent;", "*",
            "back\\slash", "new\nline", "tab\there", "", os.fsdecode(b"\xff\xfe not utf-8")]
    dump = "import os, sys; sys.stdout.buffer.write(b'\\0'.join(map(os.fsencode, sys.argv[1:])))"
    sink = Recorder()
    spawner = await start_agent(hosts, sink, 1)
    try:
        await spawner.spawn(SpawnRequest(key=0, argv=(PY, "-c", dump, *args)))
        await sink.until(lambda: 0 in sink.exits)
    finally:
        await close_all([spawner])
    assert sink.exits[0] == 0
    assert bytes(sink.output[(0, Stream.STDOUT)]) == b"\0".join(map(os.fsencode, args))


async def test_temp_dir_lives_until_close_and_spawn_failures_name_the_host(hosts):
    sink = Recorder()
    spawner = await start_agent(hosts, sink, 0)
    try:
        path = Path(await spawner.make_temp_dir("poprun-test-"))
        assert path.is_dir()
        with pytest.raises(RemoteSpawnError) as failure:
            await spawner.spawn_all([SpawnRequest(key=0, argv=(PY, "-c", SLEEPER)),
                                     SpawnRequest(key=1, argv=("/no/such/prog",))])
        assert str(failure.value).startswith("h1: cannot start instance 1: No such file")
        assert list(failure.value.started) == [0] and spawner.running() == [0]
        pid = failure.value.started[0]
    finally:
        await close_all([spawner])
    assert not path.exists() and not alive(pid)
    # Closing kills what still runs, and the agent still reports how it ended.
    assert sink.exits == {0: -signal.SIGKILL} and spawner.unaccounted() == []
    assert sink.lost == []


async def test_the_temp_dir_hello_made_is_the_first_one_asked_for(hosts):
    sink = Recorder()
    spawner = RemoteSpawner(await connect(hosts, 0), hosts.aliases[0], sink, sink.on_lost)
    try:
        await spawner.start(cwd=os.getcwd(), temp_dir="poprun-test-")
        made = spawner.info.raw["temp_dir"]
        other = await spawner.make_temp_dir("poprun-other-")  # another prefix: MKTEMP's
        assert Path(other).name.startswith("poprun-other-")
        assert await spawner.make_temp_dir("poprun-test-") == made  # no MKTEMP for it
        again = await spawner.make_temp_dir("poprun-test-")  # MKTEMP's, a new one
        assert again != made and Path(made).is_dir() and Path(again).is_dir()
    finally:
        await close_all([spawner])
    assert not any(Path(p).exists() for p in (made, other, again))


@pytest.mark.usefixtures("dead_host_leftovers")
async def test_killed_host_is_reported_lost_and_the_others_keep_running(hosts):
    sink = Recorder()
    spawners = await start_agents(hosts, sink)
    try:
        pids = [await s.spawn(SpawnRequest(key=i, argv=(PY, "-c", SLEEPER)))
                for i, s in enumerate(spawners)]
        hosts.kill_host(0)
        await sink.until(lambda: sink.lost)
        [(host, reason)] = sink.lost
        assert host == "h1" and reason == "the SSH connection was lost", reason
        assert spawners[0].idle and spawners[0].unaccounted() == [0]
        assert spawners[1].running() == [1] and alive(pids[1])
    finally:
        await close_all(spawners)
    wait_until(lambda: not alive(pids[1]), "h2's instance to stop when its agent closes")


async def test_signals_reach_remote_instances_and_a_killed_agent_is_reported(hosts):
    sink = Recorder()
    spawner = await start_agent(hosts, sink, 0)
    try:
        pids = await spawner.spawn_all(
            [SpawnRequest(key=k, argv=(PY, "-c", SLEEPER)) for k in range(3)])
        spawner.signal(0, signal.SIGTERM)
        await sink.until(lambda: 0 in sink.exits)
        spawner.signal_all(signal.SIGHUP)
        await sink.until(lambda: len(sink.exits) == 3)
        assert sink.exits == {0: -signal.SIGTERM, 1: -signal.SIGHUP, 2: -signal.SIGHUP}

        later = await spawner.spawn(SpawnRequest(key=3, argv=(PY, "-c", SLEEPER)))
        os.kill(spawner.info.pid, signal.SIGKILL)
        await sink.until(lambda: sink.lost)
        assert sink.lost == [("h1", "the agent was killed by SIGKILL")]
        assert spawner.unaccounted() == [3] and spawner.idle
        wait_until(lambda: not alive(later), "the agent's lifeline to kill its instance")
    finally:
        await close_all([spawner])
    assert not any(alive(pid) for pid in pids.values())


async def test_what_the_remote_shell_prints_before_the_agent_is_set_aside(hosts, tmp_path):
    noisy = tmp_path / "noisy-python"
    noisy.write_text(f"#!/bin/sh\necho 'Welcome to h1'\nexec {shlex.quote(PY)} \"$@\"\n")
    noisy.chmod(0o755)
    sink = Recorder()
    spawner = await start_agent(hosts, sink, 0, python=str(noisy))
    try:
        assert spawner.info.noise == b"Welcome to h1\n"
        await spawner.spawn(SpawnRequest(key=0, argv=("echo", "fine")))
        await sink.until(lambda: 0 in sink.exits)
    finally:
        await close_all([spawner])
    assert sink.output[(0, Stream.STDOUT)] == b"fine\n"


async def test_version_mismatch_is_an_error_before_anything_starts(hosts):
    here = Versions.here()
    other = Versions(here.protocol, "0.0.0-other", (2, 7))
    spawner = RemoteSpawner(await connect(hosts, 1), "h2", Recorder(), expect=other)
    try:
        with pytest.raises(AgentVersionError) as error:
            await spawner.start(cwd=os.getcwd())
    finally:
        spawner.conn.close()
    message = str(error.value)
    assert message.startswith("h2: ")
    assert f"poprun {__version__} there, 0.0.0-other here" in message
    assert "Python 3." not in message  # another Python than the launcher's is fine (3.10+)
    wait_until(lambda: not alive(spawner.info.pid), "the agent to be stopped")


def test_an_agent_python_older_than_the_minimum_is_a_version_error():
    info = AgentInfo.from_reply("h1", {"protocol": PROTOCOL_VERSION, "poprun": __version__,
                                       "python": {"version": [3, 9, 18], "executable": "/p"}},
                                b"")
    with pytest.raises(AgentVersionError, match=r"^h1: Python 3\.9\.18 \(/p\) there, 3\.10 or "
                                                r"later here"):
        check_versions(info, Versions.here())
    check_versions(AgentInfo.from_reply("h1", {**info.raw, "python": {
        "version": [3, 10, 0], "executable": "/p"}}, b""), Versions.here())  # the oldest


async def test_missing_remote_python_is_a_start_error_naming_the_host(hosts):
    spawner = RemoteSpawner(await connect(hosts, 0), "h1", Recorder(), python="/no/such/python")
    try:
        with pytest.raises(AgentStartError, match=r"^h1: the poprun agent .* did not start: the "
                                                  r"agent exited with status 127: .*/no/such/py"):
            await spawner.start(cwd=os.getcwd())
    finally:
        spawner.conn.close()


# The launcher's side in its own process, so that it can be SIGKILLed like a real one.
LAUNCHER = textwrap.dedent("""
    import asyncio, json, os, sys
    import asyncssh
    from spawner.protocol import SpawnRequest
    from spawner.remote import RemoteSpawner

    class Sink:
        def on_output(self, key, stream, data):
            pids.extend(int(p) for p in data.split())
            if len(pids) == 4:
                print(json.dumps(pids), flush=True)
        def on_exit(self, key, returncode): pass

    async def main():
        for key, alias in enumerate(sys.argv[2:]):
            conn = await asyncssh.connect(alias, config=[sys.argv[1]], connect_timeout=20)
            spawner = RemoteSpawner(conn, alias, Sink())
            await spawner.start(cwd=os.getcwd())
            await spawner.spawn(SpawnRequest(key=key, argv=tuple(json.loads(os.environ["ARGV"]))))
        await asyncio.sleep(300)

    pids = []
    asyncio.run(main())
""")


def test_launcher_sigkilled_leaves_no_instance_on_any_host(hosts):
    marker = f"marker-{uuid.uuid4().hex}"
    env = poprun_env({"ARGV": json.dumps(sleeper_with_grandchild(marker))})
    launcher = subprocess.Popen([PY, "-c", LAUNCHER, str(hosts.ssh_config), *hosts.aliases],
                                stdout=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([launcher.stdout], [], [], TIMEOUT)
        assert ready, "the launcher did not start its instances"
        pids = json.loads(launcher.stdout.readline())
        addrs = {server_addr(_environ(pid)["POPRUN_SSH_CONNECTION"].encode()) for pid in pids}
        assert addrs == {h.addr for h in hosts.hosts}  # they ran through each sshd
        launcher.kill()
        wait_until(lambda: not with_marker(marker), "every instance to die", timeout=TIMEOUT)
    finally:
        launcher.kill()
        launcher.wait(TIMEOUT)
        launcher.stdout.close()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if item)
