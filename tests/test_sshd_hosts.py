"""Tests of the loopback sshd harness itself (tests/sshd_hosts.py).

Every wait is bounded: subprocess timeouts, asyncio.wait_for, or a deadline loop.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import asyncssh
import pytest

from requires import assert_skips_or_fails, skip_or_fail
import sshd_hosts
from sshd_hosts import (SshHosts, processes_with, require_sshd, require_tool, start_ssh_hosts,
                        wait_until)
from conftest import OFFLINE, poprun_argv, poprun_env, remove_job_leftovers, wait_started
from sshd_hosts import instances_with, kill_marked

TIMEOUT = 20
PY = shlex.quote(sys.executable)  # the "remote" hosts are this machine


@pytest.fixture
def hosts(tmp_path: Path):
    require_tool("ssh")
    with start_ssh_hosts(2, tmp_path) as h:
        yield h


def ssh(hosts: SshHosts, i: int, command: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        hosts.ssh_argv(i, command), capture_output=True, text=True, timeout=TIMEOUT, **kw
    )


def server_addr(ssh_connection: str) -> str:
    # SSH_CONNECTION = "client_addr client_port server_addr server_port"
    return ssh_connection.split()[2]


def start_remote_sleeper(hosts: SshHosts, i: int) -> tuple[subprocess.Popen[str], str]:
    """A long-running session on host i, returned once it is known to be running."""
    marker = f"marker-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        hosts.ssh_argv(i, f"echo started; exec {PY} -c 'import time; time.sleep(300)' {marker}"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n"  # the ssh process exits (EOF) on failure
    return proc, marker


def test_openssh_runs_on_each_host(hosts: SshHosts) -> None:
    assert hosts.aliases == ["h1", "h2"]
    for i, expected in enumerate(["127.0.77.1", "127.0.77.2"]):
        r = ssh(hosts, i, "echo $SSH_CONNECTION")
        assert r.returncode == 0, r.stderr
        assert server_addr(r.stdout) == expected
        assert hosts.hosts[i].addr == expected and hosts.hosts[i].port > 1024


def test_known_hosts_is_enforced(hosts: SshHosts) -> None:
    # Give h1 h2's host key: OpenSSH must refuse, proving the file is really checked.
    wrong = hosts.known_hosts.with_name("known_hosts.wrong")
    h1, h2 = hosts.known_hosts.read_text().splitlines()
    wrong.write_text(h1.split()[0] + " " + " ".join(h2.split()[1:]) + "\n")
    r = subprocess.run(
        ["ssh", "-F", str(hosts.ssh_config), "-o", f"UserKnownHostsFile={wrong}", "h1", "true"],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert r.returncode == 255
    assert "Host key verification failed" in r.stderr


def test_asyncssh_runs_on_each_host(hosts: SshHosts) -> None:
    async def main() -> None:
        for host in hosts.hosts:
            async with asyncssh.connect(
                host.addr, port=host.port, known_hosts=str(hosts.known_hosts),
                client_keys=[str(hosts.user_key)], username=hosts.user, connect_timeout=TIMEOUT,
            ) as conn:
                r = await asyncio.wait_for(conn.run("echo $SSH_CONNECTION", check=True), TIMEOUT)
                assert server_addr(r.stdout) == host.addr
            # By alias: HostName, Port, User, IdentityFile and UserKnownHostsFile all come
            # from the generated config (known_hosts is keyed by "[addr]:port", not the alias).
            async with asyncssh.connect(
                host.alias, config=[str(hosts.ssh_config)], connect_timeout=TIMEOUT
            ) as conn:
                r = await asyncio.wait_for(conn.run("echo $SSH_CONNECTION", check=True), TIMEOUT)
                assert server_addr(r.stdout) == host.addr

    asyncio.run(main())


def test_home_env_is_enough_for_asyncssh(hosts: SshHosts) -> None:
    # What a launcher under test gets: HOME only, no explicit config/keys/known_hosts.
    code = (
        "import asyncio, asyncssh\n"
        "async def main():\n"
        "    async with asyncssh.connect('h2', connect_timeout=20) as conn:\n"
        "        print((await conn.run('echo $SSH_CONNECTION', check=True)).stdout)\n"
        "asyncio.run(main())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=hosts.env(), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert server_addr(r.stdout) == "127.0.77.2"


def test_asyncssh_rejects_unknown_host_key(hosts: SshHosts, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    h = hosts.hosts[0]

    async def main() -> None:
        with pytest.raises(asyncssh.HostKeyNotVerifiable):
            await asyncssh.connect(
                h.addr, port=h.port, known_hosts=str(empty), client_keys=[str(hosts.user_key)],
                username=hosts.user, connect_timeout=TIMEOUT,
            )

    asyncio.run(main())


def test_kill_host_refuses_new_and_drops_existing_connections(hosts: SshHosts) -> None:
    sleeper, marker = start_remote_sleeper(hosts, 0)
    assert processes_with(marker)

    hosts.kill_host(0)

    # The established session is torn down too, like on a host that died.
    assert sleeper.wait(timeout=TIMEOUT) != 0
    assert processes_with(marker) == []
    r = ssh(hosts, 0, "true")
    assert r.returncode == 255 and "Connection refused" in r.stderr, r.stderr
    h = hosts.hosts[0]

    async def main() -> None:
        with pytest.raises(ConnectionRefusedError):
            await asyncssh.connect(h.addr, port=h.port, config=[str(hosts.ssh_config)],
                                   connect_timeout=TIMEOUT)

    asyncio.run(main())
    r = ssh(hosts, 1, "echo $SSH_CONNECTION")
    assert r.returncode == 0 and server_addr(r.stdout) == "127.0.77.2"
    hosts.kill_host(0)  # idempotent


def test_teardown_kills_everything_and_removes_files(tmp_path: Path) -> None:
    require_tool("ssh")
    with start_ssh_hosts(3, tmp_path) as hosts:
        procs = [h.proc for h in hosts.hosts]
        assert all(p is not None and p.poll() is None for p in procs)
        sleeper, marker = start_remote_sleeper(hosts, 2)  # a session left running
        home = hosts.home
    assert all(p is not None and p.returncode is not None for p in procs)
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)
    assert processes_with(marker) == []
    assert sleeper.wait(timeout=TIMEOUT) != 0
    assert not home.exists() and list(tmp_path.iterdir()) == []


def test_teardown_on_exception(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        with start_ssh_hosts(1, tmp_path) as hosts:
            proc = hosts.hosts[0].proc
            raise KeyError("boom")
    assert proc is not None and proc.returncode is not None


def test_retries_when_port_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate losing the race between picking a free port and sshd binding it.
    with socket.socket() as squatter:
        squatter.bind(("127.0.77.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real = sshd_hosts._free_port
        ports = iter([taken])
        monkeypatch.setattr(sshd_hosts, "_free_port", lambda addr: next(ports, None) or real(addr))
        with start_ssh_hosts(1, tmp_path) as hosts:
            assert hosts.hosts[0].port != taken
            assert hosts.hosts[0].proc is not None and hosts.hosts[0].proc.poll() is None


def test_missing_tool_skips_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_skips_or_fails(lambda: require_tool("no-such-sshd"), "POPRUN_REQUIRE_SSHD",
                          "no-such-sshd not found", monkeypatch)


def test_servers_die_with_a_killed_test_process(tmp_path: Path) -> None:
    # pytest SIGKILLed (no teardown) must not leave sshd listening.
    require_sshd()
    if not sshd_hosts._DIE_WITH_US:
        skip_or_fail("setpriv (util-linux) not found", "POPRUN_REQUIRE_TOOLS")
    code = (
        "import sys, time\n"
        "from sshd_hosts import start_ssh_hosts\n"
        f"with start_ssh_hosts(1, {str(tmp_path)!r}) as hosts:\n"
        "    print(hosts.hosts[0].proc.pid, flush=True)\n"
        "    time.sleep(300)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        sshd_pid = int(child.stdout.readline())
    finally:
        child.kill()
        child.wait(timeout=TIMEOUT)

    wait_until(lambda: _dead(sshd_pid), f"sshd {sshd_pid} to die with its parent")


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for init (or a subreaper) to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# A session leader whose child and grandchild have process groups of their own (slurmstepd,
# its task, the task's child), each writing its pid to argv[1] once its handlers are set,
# and to argv[2] if it ever runs a SIGHUP or SIGCONT handler.
_ORPHANABLE_CHAIN = """\
import os, signal, sys
def woke(*_):
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\\n")
for level in range(3):
    if level:
        os.setpgid(0, 0)
        signal.signal(signal.SIGHUP, woke)
        signal.signal(signal.SIGCONT, woke)
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    if level == 2 or os.fork():
        break
while True:
    signal.pause()
"""


def test_kill_trees_ends_a_tree_as_a_failed_host_would(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Children are SIGKILLed before their parents: a stopped process whose parent died
    first is in an orphaned group, which the kernel SIGHUPs and SIGCONTs, and it ran (a
    Slurm task, poprun's agent, then killed its instance and reported that: the node-failure
    test's 137 instead of a lost host's 255). None of the chain's handlers ever runs."""
    ready, woke = tmp_path / "ready", tmp_path / "woke"
    ready.touch()
    leader = subprocess.Popen([sys.executable, "-c", _ORPHANABLE_CHAIN, str(ready), str(woke)],
                              start_new_session=True)
    kills: list[int] = []
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            kills.append(pid)
        real_kill(pid, sig)

    try:
        wait_until(lambda: len(ready.read_text().split()) == 3, "the chain to start", TIMEOUT)
        chain = [int(pid) for pid in ready.read_text().split()]
        monkeypatch.setattr(sshd_hosts.os, "kill", kill)
        sshd_hosts.kill_trees(lambda: [leader.pid])
        monkeypatch.undo()
        leader.wait(timeout=TIMEOUT)
        wait_until(lambda: all(map(_dead, chain)), "the chain to die", TIMEOUT)
    finally:
        monkeypatch.undo()
        if not kills:  # failed before kill_trees: the chain (all alive) is ours to end
            for pid in map(int, ready.read_text().split()):
                os.kill(pid, signal.SIGKILL)
        leader.wait(timeout=TIMEOUT)
    assert [pid for pid in kills if pid in chain] == chain[::-1]  # the deepest first
    assert not woke.exists(), woke.read_text()


def test_instances_are_told_from_poprun_whatever_their_paths_hold(tmp_path: Path) -> None:
    """instances_with finds a job's instances, not poprun nor its watchdog, where every
    command line holds "poprun" (a clone in a folder of that name with its venv inside once
    hid every instance from the reap tests); kill_marked then leaves no process of the job
    (poprun and its watchdog too: the test removes the directories they would have)."""
    bin_dir = tmp_path / "poprun" / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    marker = f"m{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2", str(bin_dir / "python"),
                    "-c", "import time; time.sleep(300)", marker),
        env=poprun_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(instances_with(marker)) == 2, "both instances to run", TIMEOUT)
        wait_started(proc.pid, 2)  # its record names its directories
        found = instances_with(marker)
        assert all(f"{bin_dir}/python".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
                   for pid in found)
        assert proc.pid not in found and len(processes_with(marker)) > 2  # poprun, watchdog
    finally:
        kill_marked(marker)
        proc.wait(timeout=TIMEOUT)
        remove_job_leftovers(launcher=proc.pid)
    assert not processes_with(marker)
