"""Test hosts in network namespaces, each with networks of its own and its own sshd.

``start_netns_hosts(n, tmp_path)`` makes hosts h1..hn that differ in what a launcher's choice of
network depends on: each is a network namespace with one interface per network, on private
addresses that exist only inside the namespaces::

    with start_netns_hosts(2, tmp_path) as hosts:
        # the launcher runs inside h1, as it would on the first host of a cluster
        subprocess.run(hosts.exec_argv(1, "poprun", "-H", "h1,h2", ...), env=hosts.env())
        hosts.set_link(2, "a", False)     # h2's link on network a goes down mid-job
        hosts.counters(1, "b")            # (rx_bytes, tx_bytes) of h1's eth-b

Layout (``tag`` = ``prn<pytest's pid>-<n-th fixture of this process>``; hosts count from 1,
as in their aliases)::

    namespace <tag>-sw:  bridge br-<net> per network; ports h<i>-<net>
    namespace <tag>-h<i>: lo, eth-<net> (the veth peer of h<i>-<net>): 10.213.<k+1>.<i>/24
                          for the k-th network

The interface names are the same on every host, so one ``--mca btl_tcp_if_include eth-b``
fits all. Nothing is added to this machine's own (root) namespace: the veth pairs are created
from inside the switch namespace straight into the hosts'. The sequence number in ``tag`` (not
in the plain ``prn<pid>-h1`` form) lets one test process hold two fixtures at once.

SSH does not depend on the test networks, which tests take down while a job runs: every host
alias has a ``ProxyCommand ip netns exec <tag>-h<i> sshd -i -f <its sshd_config>``, so each
connection gets an sshd of its own inside that host's namespace, talking over the proxy's
pipes. OpenSSH and asyncssh (which the launcher uses, reading ~/.ssh/config under ``env()``'s
HOME) both run it. known_hosts is keyed by alias (there is no HostName). What that looks like
from inside a session:

- ``SSH_CONNECTION`` is ``UNKNOWN 65535 UNKNOWN 65535`` (sshd's stdin is a pipe, not a socket),
  and the launcher sees no peer address either: nothing names the host's address on a/b.
- The namespaces share this machine's hostname (``ip netns exec`` changes the network only):
  ``ip netns identify`` tells which host a command ran on. Inside each, the name resolves to
  that host's address on the first network (/etc/netns/<ns>/hosts, which ``ip netns exec``
  mounts over /etc/hosts), as a cluster node's name resolves to its own address.

A test whose SSH must cross a network (a link taken down must cut a job's agent off) uses
``with hosts.ssh_over("a"):`` instead: an sshd listens in each namespace on its host's address
on a, and each alias names that address; only a launcher inside a host's namespace reaches
them (``exec_argv``), and ``SSH_CONNECTION`` is then a real one.

The links carry nothing but what the tests send, so that ``counters`` tell which network a job
used: IPv6 is off in every namespace (autoconfiguration would send router solicitations and
MLD reports) and the bridges do no multicast snooping (they would send IGMP reports).

Teardown kills every process inside the namespaces (sessions, whatever tests started there)
and deletes the namespaces, which destroys their veths and bridges. Namespaces whose pid is
gone (a pytest killed outright) are removed likewise when a fixture starts. Tests skip when
not root or without ``ip``, and fail instead where POPRUN_REQUIRE_NETNS=1.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from sshd_hosts import (_DIE_WITH_US, SshClientFiles, _ensure_privsep_dir, _pubkey, kill_trees,
                        make_client_files, require_sshd, require_tool, skip_or_fail,
                        sshd_options, wait_until)

__all__ = ["NetnsHosts", "require_netns", "start_netns_hosts"]

PREFIX = "prn"
ETC_NETNS = Path("/etc/netns")  # per namespace, files `ip netns exec` mounts over /etc's
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` mounts them (iproute2's NETNS_RUN_DIR)
REQUIRE = "POPRUN_REQUIRE_NETNS"
COMMAND_TIMEOUT = 30
READY_TIMEOUT = 10.0
_NET_NAME = re.compile(r"[a-z0-9]{1,8}")  # eth-<net> must fit IFNAMSIZ (15)
_OURS = re.compile(rf"{PREFIX}(\d+)-\d+-(?:sw|h\d+)")
_fixtures = itertools.count()
# Every interface should carry only what a test sends (see the module's docstring).
_IPV6_OFF = ("for f in /proc/sys/net/ipv6/conf/default/disable_ipv6 "
             "/proc/sys/net/ipv6/conf/all/disable_ipv6; do [ ! -e $f ] || echo 1 > $f; done")


def require_netns() -> str:
    """Path of ``ip``; skip unless root (namespaces need CAP_SYS_ADMIN), or fail where
    POPRUN_REQUIRE_NETNS=1."""
    if os.geteuid() != 0:
        skip_or_fail("network namespaces need root", REQUIRE)
    for path in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip"):  # sbin: off a user's PATH
        if path and os.access(path, os.X_OK):
            return os.path.abspath(path)
    skip_or_fail("ip not found (install iproute2)", REQUIRE)


@dataclass(frozen=True)
class NetnsHosts:
    """The hosts, their networks, and the client files that reach them over SSH."""

    n: int
    networks: tuple[str, ...]
    tag: str  # prn<pid>-<seq>: every namespace's name starts with it
    client: SshClientFiles
    ip: str

    # --- names and addresses -------------------------------------------------------------
    @property
    def aliases(self) -> list[str]:
        return [f"h{i}" for i in range(1, self.n + 1)]

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def namespace(self, i: int) -> str:
        """Host ``i``'s namespace (i = 1..n, as in its alias hN)."""
        if not 1 <= i <= self.n:
            raise IndexError(f"host {i} not in 1..{self.n}")
        return f"{self.tag}-h{i}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the fixture: the switch's, then the hosts'."""
        return [self.switch, *(self.namespace(i) for i in range(1, self.n + 1))]

    def ifname(self, net: str) -> str:
        self._index(net)
        return f"eth-{net}"

    def subnet(self, net: str) -> str:
        return f"10.213.{self._index(net) + 1}.0/24"

    def addr(self, i: int, net: str) -> str:
        self.namespace(i)  # checks i
        return f"10.213.{self._index(net) + 1}.{i}"

    def _index(self, net: str) -> int:
        try:
            return self.networks.index(net)
        except ValueError:
            raise KeyError(f"no network {net!r}; there are {self.networks}") from None

    # --- running things there ------------------------------------------------------------
    @property
    def ssh_config(self) -> Path:
        return self.client.ssh_config

    @property
    def home(self) -> Path:
        return self.client.home

    def env(self) -> dict[str, str]:
        """os.environ with HOME = ``home``: asyncssh (the launcher) then finds .ssh/config and
        the keys by itself. OpenSSH's ``ssh`` takes ~ from passwd, not $HOME: pass -F."""
        return {**os.environ, "HOME": str(self.home)}

    def exec_argv(self, i: int, *cmd: str) -> list[str]:
        """argv running ``cmd`` inside host ``i``'s namespace. If pytest is killed outright,
        it dies too (pdeathsig, as sshd_hosts's servers: it fires when the *thread* that
        started it ends, so start it from the main thread or one that outlives it)."""
        return [*_DIE_WITH_US, self.ip, "netns", "exec", self.namespace(i), *cmd]

    def ssh_argv(self, i: int, *command: str) -> list[str]:
        """``ssh`` argv running ``command`` (a remote shell string) on host ``i``; it works
        from any namespace (the ProxyCommand enters host i's)."""
        return ["ssh", "-F", str(self.ssh_config), f"h{i}", *command]

    @contextlib.contextmanager
    def ssh_over(self, net: str) -> Iterator[None]:
        """SSH to every host crossing network ``net`` instead of the proxy's pipes: an sshd
        listening in each host's namespace on its address there, and each alias's entry
        naming that address (no ProxyCommand). Only from inside a host's namespace can it be
        reached (``exec_argv``); taking a host's link on ``net`` down then cuts its
        connections. The pipes' entries are back at the end."""
        root, sshd = self.home.parent, require_sshd()
        listeners = [subprocess.Popen(
            self.exec_argv(i, sshd, "-D", "-f", str(root / f"h{i}" / "sshd_config"),
                           "-E", str(root / f"h{i}" / f"sshd-{net}.log"),
                           "-o", f"ListenAddress={self.addr(i, net)}:22", "-o", "PidFile=none"),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for i in range(1, self.n + 1)]
        config, known = self.ssh_config.read_text(), self.client.known_hosts.read_text()
        try:
            self.ssh_config.write_text("".join(
                self.client.host_entry(f"h{i}", HostName=self.addr(i, net), HostKeyAlias=f"h{i}")
                for i in range(1, self.n + 1)))
            for i in range(1, self.n + 1):
                wait_until(lambda i=i: self._listening(i, net), f"h{i}'s sshd on {net}",
                           READY_TIMEOUT)
            yield
        finally:
            self.ssh_config.write_text(config)
            self.client.known_hosts.write_text(known)
            for proc in listeners:
                proc.kill()
                proc.wait()

    def _listening(self, i: int, net: str) -> bool:
        listed = _run([self.ip, "netns", "exec", self.namespace(i), "ss", "-Htln",
                       f"src {self.addr(i, net)}"]).stdout
        return f"{self.addr(i, net)}:22" in listed

    # --- links -----------------------------------------------------------------------------
    def set_link(self, i: int, net: str, up: bool) -> None:
        """Take host ``i``'s link on ``net`` down, or bring it back up; up returns once the
        link carries traffic again (its carrier is on and its switch port forwards)."""
        self._ip(self.namespace(i), "link", "set", self.ifname(net), "up" if up else "down")
        if up:
            wait_until(lambda: self._link_ready(i, net), f"h{i}'s {self.ifname(net)} up",
                       READY_TIMEOUT)

    def counters(self, i: int, net: str) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of host ``i``'s interface on ``net``, read inside its namespace."""
        stats = self._link_json(self.namespace(i), self.ifname(net), "-s")["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def pids(self) -> list[int]:
        """Every process inside the fixture's namespaces."""
        return _pids_in(_inodes(self.namespaces))

    def _link_ready(self, i: int, net: str) -> bool:
        # Carrier comes on at once, but the bridge port forwards (and the qdisc takes packets)
        # only once the kernel's link watcher has run: up to a second later.
        host = self._link_json(self.namespace(i), self.ifname(net))
        port = self._link_json(self.switch, f"h{i}-{net}", "-d")
        state = port.get("linkinfo", {}).get("info_slave_data", {}).get("state")
        return host["operstate"] == "UP" and port["operstate"] == "UP" and state == "forwarding"

    def _link_json(self, ns: str, dev: str, *flags: str) -> dict:
        return json.loads(self._ip(ns, "-j", *flags, "link", "show", "dev", dev))[0]

    def _ip(self, ns: str, *args: str) -> str:
        return _run([self.ip, "-n", ns, *args]).stdout


@contextlib.contextmanager
def start_netns_hosts(n: int, tmp_path: Path | str, networks: Sequence[str] = ("a", "b"),
                      setenv: Callable[[int], Mapping[str, str]] | None = None
                      ) -> Iterator[NetnsHosts]:
    """Make ``n`` hosts on ``networks`` (see the module's docstring); remove all on exit.
    ``setenv(i)``: variables every SSH session on host i gets (sshd's SetEnv)."""
    networks = tuple(networks)
    _check_args(n, networks)
    ip = require_netns()
    sshd = require_sshd()
    require_tool("ssh")
    _ensure_privsep_dir()
    remove_dead_leftovers(ip)
    root = Path(tempfile.mkdtemp(prefix="netns-hosts-", dir=tmp_path))
    hosts = None
    try:
        for i in range(1, n + 1):
            (root / f"h{i}").mkdir()
        client = make_client_files(root, [_host_key(root, i) for i in range(1, n + 1)])
        hosts = NetnsHosts(n, networks, f"{PREFIX}{os.getpid()}-{next(_fixtures)}", client, ip)
        _make_namespaces(hosts)
        _write_hosts_files(hosts)
        _write_ssh_files(hosts, root, sshd, setenv)
        yield hosts
    finally:
        if hosts is not None:
            _remove(ip, hosts.namespaces)
        shutil.rmtree(root, ignore_errors=True)


def remove_dead_leftovers(ip: str) -> list[str]:
    """Remove the namespaces (and kill what runs in them) of fixtures whose test process no
    longer exists, e.g. a pytest killed outright; returns their names. Those of live
    processes (other test runs on this machine) are left alone."""
    dead = [name for name in _existing_namespaces()
            if (m := _OURS.fullmatch(name)) and not _alive(int(m[1]))]
    _remove(ip, dead)
    return dead


# --- making ---------------------------------------------------------------------------------

def _check_args(n: int, networks: tuple[str, ...]) -> None:
    if not 1 <= n <= 254:
        raise ValueError(f"n must be in 1..254, got {n}")
    bad = [net for net in networks if not _NET_NAME.fullmatch(net)]
    if bad or not networks or len(set(networks)) != len(networks) or len(networks) > 254:
        raise ValueError(f"networks must be 1..254 distinct names of [a-z0-9]{{1,8}}, "
                         f"got {networks}")


def _make_namespaces(hosts: NetnsHosts) -> None:
    """The namespaces, then the switch (bridges, veth pairs into the hosts), then the hosts'
    addresses; returns once every link carries traffic."""
    added = _batch(hosts.ip, None, [f"netns add {ns}" for ns in hosts.namespaces], check=False)
    if added.returncode:
        _unavailable(added.stderr)
    _batch(hosts.ip, hosts.switch, _switch_commands(hosts))
    for i in range(1, hosts.n + 1):
        _batch(hosts.ip, hosts.namespace(i), _host_commands(hosts, i))
    for i in range(1, hosts.n + 1):
        for net in hosts.networks:
            wait_until(lambda: hosts._link_ready(i, net), f"h{i}'s {hosts.ifname(net)} up",
                       READY_TIMEOUT)


def _unavailable(stderr: str) -> NoReturn:
    # Root without CAP_SYS_ADMIN (an unprivileged container) cannot make namespaces: the
    # machine lacks the feature, as it would lack `ip`.
    if "Operation not permitted" in stderr or "Permission denied" in stderr:
        skip_or_fail(f"cannot create network namespaces: {stderr.strip()}", REQUIRE)
    raise RuntimeError(f"ip netns add failed: {stderr.strip()}")


def _switch_commands(hosts: NetnsHosts) -> list[str]:
    commands = ["link set lo up"]
    for net in hosts.networks:
        # No snooping: with it the bridge announces itself (IGMP reports for 224.0.0.106) on
        # every port, traffic the counters would show that no test sent.
        commands += [f"link add br-{net} type bridge mcast_snooping 0", f"link set br-{net} up"]
        for i in range(1, hosts.n + 1):
            port = f"h{i}-{net}"
            # Created here with its peer straight in the host's namespace: no interface ever
            # appears in this machine's own namespace.
            commands += [f"link add {port} type veth peer name {hosts.ifname(net)} "
                         f"netns {hosts.namespace(i)}",
                         f"link set {port} master br-{net}", f"link set {port} up"]
    return commands


def _host_commands(hosts: NetnsHosts, i: int) -> list[str]:
    commands = ["link set lo up"]
    for net in hosts.networks:
        commands += [f"addr add {hosts.addr(i, net)}/24 dev {hosts.ifname(net)}",
                     f"link set {hosts.ifname(net)} up"]
    return commands


def _write_ssh_files(hosts: NetnsHosts, root: Path, sshd: str,
                     setenv: Callable[[int], Mapping[str, str]] | None) -> None:
    entries, known = [], []
    for i, alias in enumerate(hosts.aliases, start=1):
        config = root / alias / "sshd_config"
        config.write_text("\n".join(sshd_options(
            _host_key(root, i), hosts.client.authorized_keys, setenv(i) if setenv else None
        )) + "\n")
        # sshd -i: one server per connection, on the proxy's pipes, inside the namespace; -E:
        # its log to a file (asyncssh passes a proxy's stderr through to the launcher's).
        proxy = shlex.join([hosts.ip, "netns", "exec", hosts.namespace(i), sshd, "-i",
                            "-f", str(config), "-E", str(root / alias / "sshd.log")])
        entries.append(hosts.client.host_entry(alias, ProxyCommand=proxy))
        known.append(f"{alias} {_pubkey(_host_key(root, i))}\n")  # no HostName: the alias
    hosts.client.known_hosts.write_text("".join(known))
    hosts.client.ssh_config.write_text("".join(entries))


def _host_key(root: Path, i: int) -> Path:
    return root / f"h{i}" / "ssh_host_ed25519_key"


def _write_hosts_files(hosts: NetnsHosts) -> None:
    """Each host's name resolves to its own address on the first network, as a cluster
    node's does (to its management address): `ip netns exec` mounts /etc/netns/<ns>/hosts
    over /etc/hosts. Without it the shared hostname is 127.0.0.1 everywhere, and a library
    that publishes its host's address by name (Horovod's process sets do) names loopback."""
    for i in range(1, hosts.n + 1):
        folder = ETC_NETNS / hosts.namespace(i)
        folder.mkdir(parents=True, exist_ok=True)
        first = hosts.addr(i, hosts.networks[0])
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{first} {socket.gethostname()}\n")


# --- removing -------------------------------------------------------------------------------

def _remove(ip: str, names: list[str]) -> None:
    """Delete the namespaces ``names``, then kill every process still in them: a namespace
    (and its interfaces) lives on, nameless, while a process is in it. Deleting first means
    no process can enter by name (a ProxyCommand's ``ip netns exec``) once the scan is done."""
    for name in names:  # its /etc/hosts (_write_hosts_files)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    inodes = _inodes(names)
    if not inodes:
        return
    # -force: go on past a namespace already gone (two fixtures cleaning the same leftovers).
    _batch(ip, None, [f"netns del {ns}" for ns in names], check=False, force=True)
    _let_end(_pids_in(inodes))
    kill_trees(lambda: _pids_in(inodes), spare=frozenset({os.getpid()}))


# How long what is still running in the hosts gets to end on SIGTERM before it is killed.
# An agent whose launcher is gone (its host cut off by the test) removes its instances'
# files on SIGTERM; SIGKILLed at once, it left its PMIx server's directories behind
# (/tmp/poprun-<job>-pmix-*, /dev/shm/...: test_spares_netns, when the job ended before
# that agent had noticed its launcher was gone).
STOP_GRACE_S = 3.0


def _let_end(pids: list[int]) -> None:
    """SIGTERM `pids`, then wait (on their pidfds) until they are gone or STOP_GRACE_S."""
    fds = []
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(pid)
            fds.append(fd)
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            ended = select.select(fds, [], [], left)[0]
            for fd in ended:
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _existing_namespaces() -> list[str]:
    try:
        return os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []


def _inodes(names: list[str]) -> set[int]:
    """The namespaces' identities, as /proc/<pid>/ns/net names them (net:[<inode>])."""
    found = set()
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            found.add(os.stat(NETNS_DIR / name).st_ino)
    return found


def _pids_in(inodes: set[int]) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                link = os.readlink(f"/proc/{entry}/ns/net")
            except OSError:
                continue  # exited meanwhile, or a kernel thread
            if int(link[5:-1]) in inodes:  # "net:[4026532...]"
                pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# --- running ip -----------------------------------------------------------------------------

def _batch(ip: str, ns: str | None, commands: list[str], *, check: bool = True,
           force: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``commands`` with one ``ip -batch``: in this namespace, or inside ``ns`` with IPv6
    turned off there first (on the interfaces it has and those it will get), as making a
    namespace wants: before its links go up."""
    if ns is None:
        argv = [ip, *(["-force"] if force else []), "-batch", "-"]
    else:
        argv = [ip, "netns", "exec", ns, "sh", "-c", f"{_IPV6_OFF}; exec {ip} -batch -"]
    return _run(argv, "".join(f"{c}\n" for c in commands), check)


def _run(argv: list[str], input: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, input=input, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT)
    if check and done.returncode:
        raise RuntimeError(f"{shlex.join(argv)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return done
