"""Tests of the network-namespace hosts harness itself (tests/netns_hosts.py).

Real namespaces, bridges, sshd and sockets. Every wait is bounded: subprocess timeouts, socket
timeouts, or wait_until's deadline. They skip unless root with `ip` (fail where
POPRUN_REQUIRE_NETNS=1).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import netns_hosts
from conftest import reaped
from netns_hosts import NetnsHosts, require_netns, start_netns_hosts
from requires import assert_skips_or_fails
from sshd_hosts import processes_with, wait_until

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 20
PY = sys.executable  # the "hosts" are this machine
MIB = 1 << 20

# Accepts connections forever; for each, counts the bytes until EOF and answers the count.
SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        n = 0
        while chunk := conn.recv(65536):
            n += len(chunk)
        conn.sendall(str(n).encode())
"""
# Sends `size` bytes and prints the server's count; exit status 3 when it cannot connect.
CLIENT = """
import socket, sys
host, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    s = socket.create_connection((host, port), timeout=timeout)
except OSError as e:
    sys.exit(print(f"cannot connect: {e}") or 3)
with s:
    s.settimeout(20)
    s.sendall(bytes(size))
    s.shutdown(socket.SHUT_WR)
    print(s.recv(64).decode())
"""


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[NetnsHosts]:
    with start_netns_hosts(2, tmp_path) as h:
        yield h


def run_in(hosts: NetnsHosts, i: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` run to completion inside host ``i``'s namespace, with the hosts' HOME."""
    return subprocess.run(hosts.exec_argv(i, *cmd), env=hosts.env(), capture_output=True,
                          text=True, timeout=TIMEOUT)


@contextlib.contextmanager
def listening(hosts: NetnsHosts, i: int, net: str) -> Iterator[int]:
    """A SERVER in host ``i``'s namespace on its ``net`` address; yields its port once bound."""
    argv = hosts.exec_argv(i, PY, "-c", SERVER, hosts.addr(i, net))
    with reaped(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)) as server:
        assert server.stdout is not None
        port = server.stdout.readline()  # "" (EOF) if it failed to bind
        assert port.strip().isdigit(), f"server on h{i}/{net} did not start"
        yield int(port)


def send(hosts: NetnsHosts, i: int, addr: str, port: int, size: int = 5,
         timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """CLIENT run inside host ``i``'s namespace."""
    return run_in(hosts, i, PY, "-c", CLIENT, addr, str(port), str(size), str(timeout))


def test_ssh_reaches_each_host_through_its_namespace(hosts: NetnsHosts) -> None:
    assert hosts.aliases == ["h1", "h2"]
    for i in (1, 2):
        # From h1's namespace (where a launcher under test runs) and from this one.
        for argv in (hosts.exec_argv(1, *hosts.ssh_argv(i, "ip netns identify")),
                     hosts.ssh_argv(i, "ip netns identify")):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() == hosts.namespace(i)


def test_what_a_session_sees(hosts: NetnsHosts) -> None:
    """The surprises the module's docstring names: no addresses in SSH_CONNECTION (sshd -i
    on a pipe), and the same hostname on every host (namespaces share it)."""
    r = run_in(hosts, 1, *hosts.ssh_argv(2, "echo $SSH_CONNECTION; hostname; ip -4 -o addr"))
    assert r.returncode == 0, r.stderr
    connection, hostname, *addrs = r.stdout.splitlines()
    assert connection == "UNKNOWN 65535 UNKNOWN 65535"
    assert hostname == socket.gethostname()
    assert {line.split()[3] for line in addrs} == {
        "127.0.0.1/8", f"{hosts.addr(2, 'a')}/24", f"{hosts.addr(2, 'b')}/24"}


def test_asyncssh_with_home_only(hosts: NetnsHosts) -> None:
    # What the launcher gets: HOME only; asyncssh must run the ProxyCommand from .ssh/config.
    code = (
        "import asyncio, asyncssh\n"
        "async def main():\n"
        "    async with asyncssh.connect('h2', connect_timeout=20) as conn:\n"
        "        print((await conn.run('ip netns identify', check=True)).stdout)\n"
        "asyncio.run(main())\n"
    )
    r = run_in(hosts, 1, PY, "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == hosts.namespace(2)


def test_tcp_between_hosts_on_each_network(hosts: NetnsHosts) -> None:
    with listening(hosts, 2, "b") as port:
        r = send(hosts, 1, hosts.addr(2, "b"), port)
        assert (r.returncode, r.stdout) == (0, "5\n"), r.stdout + r.stderr
    # Back from a program run over ssh on h2, to a listener in h1's namespace on network a.
    with listening(hosts, 1, "a") as port:
        client = shlex.join([PY, "-c", CLIENT, hosts.addr(1, "a"), str(port), "7", "20"])
        r = run_in(hosts, 1, *hosts.ssh_argv(2, client))
        assert (r.returncode, r.stdout) == (0, "7\n"), r.stdout + r.stderr


def test_a_link_down_cuts_that_network_only(hosts: NetnsHosts) -> None:
    with listening(hosts, 2, "a") as port_a, listening(hosts, 2, "b") as port_b:
        assert send(hosts, 1, hosts.addr(2, "a"), port_a).returncode == 0

        hosts.set_link(2, "a", False)
        # Across a bridge on one machine a connection takes microseconds: a second is ample.
        r = send(hosts, 1, hosts.addr(2, "a"), port_a, timeout=1)
        assert r.returncode == 3, r.stdout + r.stderr
        r = send(hosts, 1, hosts.addr(2, "b"), port_b)
        assert r.returncode == 0, r.stdout + r.stderr

        hosts.set_link(2, "a", True)
        r = send(hosts, 1, hosts.addr(2, "a"), port_a)
        assert (r.returncode, r.stdout) == (0, "5\n"), r.stdout + r.stderr


def test_ssh_over_a_network_crosses_it_and_a_link_down_cuts_it(hosts: NetnsHosts) -> None:
    """NetnsHosts.ssh_over: from h1's namespace, SSH reaches h2 at its address on b (a real
    TCP connection: SSH_CONNECTION names both ends); with h2's link on b down it cannot;
    afterwards the pipes' entries are back."""
    with hosts.ssh_over("b"):
        r = run_in(hosts, 1, *hosts.ssh_argv(2, "echo $SSH_CONNECTION; ip netns identify"))
        assert r.returncode == 0, r.stderr
        connection, namespace = r.stdout.split("\n")[:2]
        assert connection.split()[::2] == [hosts.addr(1, "b"), hosts.addr(2, "b")]
        assert namespace == hosts.namespace(2)
        hosts.set_link(2, "b", False)
        try:
            r = run_in(hosts, 1, "ssh", "-F", str(hosts.ssh_config), "-o", "ConnectTimeout=2",
                       "h2", "true")
            assert r.returncode == 255 and "timed out" in r.stderr, r.stderr
        finally:
            hosts.set_link(2, "b", True)
    assert "ProxyCommand" in hosts.ssh_config.read_text()


def test_counters_show_which_network_carried_the_traffic(hosts: NetnsHosts) -> None:
    with listening(hosts, 2, "b") as port:
        before = {(i, net): hosts.counters(i, net) for i in (1, 2) for net in ("a", "b")}
        r = send(hosts, 1, hosts.addr(2, "b"), port, size=MIB)
        assert (r.returncode, r.stdout) == (0, f"{MIB}\n"), r.stdout + r.stderr
        after = {key: hosts.counters(*key) for key in before}
    grew = {key: (after[key][0] - before[key][0], after[key][1] - before[key][1])
            for key in before}
    assert grew[1, "b"][1] >= MIB and grew[2, "b"][0] >= MIB, grew  # tx of h1, rx of h2
    assert grew[1, "a"] == grew[2, "a"] == (0, 0), grew  # the links are otherwise silent


def test_private_addresses_only_inside_the_namespaces(hosts: NetnsHosts) -> None:
    prefix = hosts.subnet("a").rsplit(".", 2)[0] + "."  # 10.213.
    assert hosts.subnet("b").startswith(prefix)
    inside = run_in(hosts, 1, hosts.ip, "-4", "addr").stdout
    assert f"inet {hosts.addr(1, 'a')}/24" in inside and f"inet {hosts.addr(1, 'b')}/24" in inside
    for what in (["addr"], ["route"]):
        out = subprocess.run([hosts.ip, "-4", *what], capture_output=True, text=True,
                             timeout=TIMEOUT, check=True).stdout
        assert prefix not in out, out
    links = subprocess.run([hosts.ip, "-o", "link"], capture_output=True, text=True,
                           timeout=TIMEOUT, check=True).stdout
    assert not {"br-a", "eth-a", "h1-a"} & {line.split()[1].split("@")[0].rstrip(":")
                                            for line in links.splitlines()}


def test_teardown_removes_namespaces_and_kills_everything(tmp_path: Path) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    sleep = f"import time; time.sleep(300)  # {marker}"
    with start_netns_hosts(2, tmp_path) as hosts:
        names, home = hosts.namespaces, hosts.home
        inodes = netns_hosts._inodes(names)
        # Left running: a program in h1's namespace and an SSH session on h2.
        local = subprocess.Popen(hosts.exec_argv(1, PY, "-c", sleep))
        remote = subprocess.Popen(
            hosts.ssh_argv(2, f"echo started; exec {shlex.join([PY, '-c', sleep])}"),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert remote.stdout is not None and remote.stdout.readline() == "started\n"
        # Both sleepers inside the namespaces (the ssh client, whose argv holds the marker too,
        # runs in this one).
        wait_until(lambda: len(set(processes_with(marker)) & set(hosts.pids())) == 2,
                   "both sleepers to run", TIMEOUT)
    assert local.wait(TIMEOUT) != 0 and remote.wait(TIMEOUT) != 0
    assert processes_with(marker) == []
    assert netns_hosts._pids_in(inodes) == []
    assert not set(names) & set(netns_hosts._existing_namespaces())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=TIMEOUT, check=True).stdout
    assert hosts.tag not in listed
    assert not home.exists() and list(tmp_path.iterdir()) == []


def test_teardown_on_exception(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        with start_netns_hosts(1, tmp_path, networks=("x",)) as hosts:
            assert hosts.counters(1, "x") == (0, 0)
            raise KeyError("boom")
    assert not set(hosts.namespaces) & set(netns_hosts._existing_namespaces())


def test_leftovers_of_a_dead_test_process_are_removed(tmp_path: Path) -> None:
    ip = require_netns()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names no process
    dead, live = f"prn{gone.pid}-0-h1", f"prn{os.getpid()}-999999-h1"
    for name in (dead, live):
        subprocess.run([ip, "netns", "add", name], check=True, timeout=TIMEOUT)
    try:
        marker = f"marker-{uuid.uuid4().hex}"
        # A process left in the dead one, as an SSH session of a killed pytest would be.
        with reaped(subprocess.Popen([ip, "netns", "exec", dead, PY, "-c",
                                      f"import time; time.sleep(300)  # {marker}"])) as left:
            wait_until(lambda: processes_with(marker), "the leftover process to run", TIMEOUT)
            with start_netns_hosts(1, tmp_path):
                names = netns_hosts._existing_namespaces()
                assert dead not in names and live in names  # a live pid's are not ours to take
                assert left.wait(TIMEOUT) != 0
    finally:
        subprocess.run([ip, "netns", "del", live], timeout=TIMEOUT)
        subprocess.run([ip, "netns", "del", dead], capture_output=True, timeout=TIMEOUT)


def test_arguments_are_checked(tmp_path: Path) -> None:
    for n, networks in ((0, ("a",)), (255, ("a",)), (1, ()), (1, ("a", "a")), (1, ("eth_b",)),
                        (1, ("toolongname",))):
        with pytest.raises(ValueError):
            with start_netns_hosts(n, tmp_path, networks):
                pass


def test_not_root_skips_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert_skips_or_fails(require_netns, "POPRUN_REQUIRE_NETNS", "need root", monkeypatch)
