"""spawner.ssh against real OpenSSH servers (tests/sshd_hosts.py) on 127.0.77.x.

Real: sshd, TCP, key exchange, host keys checked against known_hosts, public-key auth, the
~/.ssh/config that asyncssh reads from $HOME (HostName, Port, User, IdentityFile,
UserKnownHostsFile, ProxyJump). The failure cases are made the way they happen in life: a
host missing from known_hosts, another host's key in it, a key the server does not know, a
name in the reserved `.invalid` domain, a port nobody listens on, a TCP listener that never
speaks SSH. No agent: SSH_AUTH_SOCK is removed so a developer's agent cannot change outcomes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import gc
import os
import selectors
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import asyncssh
import pytest

import sshd_hosts
from password_sshd import start_password_hosts
from sshd_hosts import SshHosts, require_tool, start_ssh_hosts
from spawner.ssh import (
    ConnectTiming, FailureKind, HostFailure, SshConnectError, Target, connect_all, connect_each,
)

TIMEOUT = 20  # for waits that should end long before; the SSH timeouts under test are shorter
SSH_TIMEOUT = 3.0


@pytest.fixture
def hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with start_ssh_hosts(4, tmp_path) as h:
        use_home(monkeypatch, h.home)
        yield h


def use_home(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv("HOME", str(home))  # asyncssh finds .ssh/config, keys, known_hosts
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


def server_addr(ssh_connection: str) -> str:
    return ssh_connection.split()[2]  # "client_addr client_port server_addr server_port"


def sessions(host: sshd_hosts.SshHost) -> int:
    """Connections the host's sshd is serving: one child process each."""
    assert host.proc is not None
    return len(sshd_hosts._children().get(host.proc.pid, []))


async def wait_for(predicate, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def known_hosts_lines(hosts: SshHosts) -> dict[str, str]:
    """The harness's known_hosts by host address."""
    lines = hosts.known_hosts.read_text().splitlines()
    return {line.split()[0][1:].split("]")[0]: line for line in lines}


def only_failure(results, target) -> HostFailure:
    failure = results.outcomes[target]
    assert isinstance(failure, HostFailure), failure
    assert results.failures == [failure]
    return failure


# -- success ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_one_connection_per_host_through_the_users_ssh_config(hosts: SshHosts) -> None:
    targets = [Target(alias) for alias in hosts.aliases]
    async with await connect_all(targets, timeout=SSH_TIMEOUT) as conns:
        assert list(conns) == targets
        for target, host in zip(targets, hosts.hosts):
            done = await asyncio.wait_for(conns[target].run("echo $SSH_CONNECTION", check=True),
                                          TIMEOUT)
            # The alias's HostName, Port, User and IdentityFile came from ~/.ssh/config.
            assert server_addr(done.stdout) == host.addr
            assert sessions(host) == 1
            timing = conns.timings[target]
            assert isinstance(timing, ConnectTiming) and 0 < timing.connect < SSH_TIMEOUT
        opened = list(conns.values())
    assert all(conn.is_closed() for conn in opened)
    for host in hosts.hosts:
        await wait_for(lambda: sessions(host) == 0, f"{host.alias}'s session to end")


# -- ciphers --------------------------------------------------------------------------------

GCM = "aes128-gcm@openssh.com"
CHACHA = "chacha20-poly1305@openssh.com"


async def ciphers(targets: list[Target]) -> list[tuple[str, str]]:
    """The cipher each connection negotiated, each way."""
    async with await connect_all(targets, timeout=SSH_TIMEOUT) as conns:
        return [(c.get_extra_info("send_cipher"), c.get_extra_info("recv_cipher"))
                for c in conns.values()]


@pytest.mark.timeout(60)
async def test_aes_gcm_is_chosen_where_the_host_allows_it(hosts: SshHosts) -> None:
    # sshd's default ciphers put chacha20-poly1305 first, as asyncssh's do; the client's
    # order decides.
    assert await ciphers([Target(a) for a in hosts.aliases]) == [(GCM, GCM)] * len(hosts.hosts)


@pytest.mark.timeout(60)
async def test_a_host_that_refuses_aes_gcm_gets_the_next_cipher(tmp_path: Path,
                                                                 monkeypatch) -> None:
    no_gcm = lambda host: ["Ciphers chacha20-poly1305@openssh.com,aes256-ctr"]  # noqa: E731
    with start_ssh_hosts(1, tmp_path, sshd_lines=no_gcm) as one:
        use_home(monkeypatch, one.home)
        assert await ciphers([Target("h1")]) == [(CHACHA, CHACHA)]


@pytest.mark.timeout(60)
async def test_a_ciphers_line_in_the_users_config_decides(hosts: SshHosts) -> None:
    config = hosts.ssh_config.read_text()
    hosts.ssh_config.write_text(config.replace("Host h2\n", "Host h2\n    Ciphers aes256-ctr\n")
                                .replace("Host h3\n", f"Host h3\n    Ciphers +{GCM}\n"))
    # h2 names its own; h3 adds to the default (already in it: the order stays ours).
    assert await ciphers([Target("h1"), Target("h2"), Target("h3")]) == [
        (GCM, GCM), ("aes256-ctr", "aes256-ctr"), (GCM, GCM)]


@pytest.mark.timeout(60)
async def test_default_key_and_known_hosts_without_a_config_entry(hosts: SshHosts) -> None:
    h2 = hosts.hosts[1]
    # No "Host 127.0.77.2" in the config: the key is found as ~/.ssh/id_ed25519 and the host
    # key in ~/.ssh/known_hosts (under "[addr]:port"), the defaults ssh uses too.
    target = Target(h2.addr, user=hosts.user, port=h2.port)
    async with await connect_all([target], timeout=SSH_TIMEOUT) as conns:
        done = await asyncio.wait_for(conns[target].run("echo $SSH_CONNECTION"), TIMEOUT)
        assert server_addr(done.stdout) == h2.addr


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A real ssh-agent on its own socket, as $SSH_AUTH_SOCK."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([require_tool("ssh-agent"), "-D", "-a", str(sock)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        asyncio.run(wait_for(sock.exists, "ssh-agent's socket"))
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        yield sock
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
async def test_agent_key_and_encrypted_default_key_never_prompt(
        hosts: SshHosts, agent: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "agent-home"
    (home / ".ssh").mkdir(parents=True)
    h1 = hosts.hosts[0]
    # No IdentityFile: only the agent holds the authorised key. The default key file is
    # passphrase-protected (and not authorised): it must be skipped, not prompted for.
    (home / ".ssh" / "config").write_text(
        f"Host h1\n    HostName {h1.addr}\n    Port {h1.port}\n"
        f"    UserKnownHostsFile {hosts.known_hosts}\n")
    made = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f",
                           str(home / ".ssh" / "id_ed25519")], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=TIMEOUT)
    assert made.returncode == 0, made.stderr
    added = subprocess.run([require_tool("ssh-add"), str(hosts.user_key)], capture_output=True,
                           text=True, timeout=TIMEOUT, env={**os.environ, "HOME": str(home)})
    assert added.returncode == 0, added.stderr
    monkeypatch.setenv("HOME", str(home))
    async with await connect_all([Target("h1")], timeout=SSH_TIMEOUT) as conns:
        done = await asyncio.wait_for(conns[Target("h1")].run("echo $SSH_CONNECTION"), TIMEOUT)
        assert server_addr(done.stdout) == h1.addr

    monkeypatch.delenv("SSH_AUTH_SOCK")  # without the agent, nothing is left to offer
    await connect_expecting(Target("h1"), FailureKind.PERMISSION_DENIED, "no key accepted")


@pytest.mark.timeout(60)
async def test_proxy_jump_through_another_host(hosts: SshHosts) -> None:
    h1, h2 = hosts.hosts[:2]
    with hosts.ssh_config.open("a") as config:
        config.write(f"Host via-h1\n    HostName {h2.addr}\n    Port {h2.port}\n"
                     f"    ProxyJump h1\n    IdentityFile {hosts.user_key}\n")
    accepted_before = "".join(h1.log).count("Accepted publickey")
    async with await connect_all([Target("via-h1")], timeout=SSH_TIMEOUT) as conns:
        done = await asyncio.wait_for(conns[Target("via-h1")].run("echo $SSH_CONNECTION"),
                                      TIMEOUT)
        assert server_addr(done.stdout) == h2.addr
        assert sessions(h1) == 1 and sessions(h2) == 1  # the jump host carries the tunnel
    assert "".join(h1.log).count("Accepted publickey") == accepted_before + 1
    await wait_for(lambda: sessions(h1) == 0, "the jump connection to close with its target")

    hosts.kill_host(0)
    results = await connect_each([Target("via-h1")], timeout=SSH_TIMEOUT)
    failure = only_failure(results, Target("via-h1"))
    assert failure.kind is FailureKind.CONNECTION_REFUSED
    assert failure.message.startswith("via-h1 (via ProxyJump h1): connection refused")
    assert h1.addr in failure.message  # asyncssh's text names the hop that refused


# -- each failure has its own kind and message, within the timeout ---------------------------


async def connect_expecting(target: Target, kind: FailureKind, *fragments: str,
                            timeout: float = SSH_TIMEOUT) -> HostFailure:
    started = time.monotonic()
    with pytest.raises(SshConnectError) as caught:
        await connect_all([target], timeout=timeout)
    elapsed = time.monotonic() - started
    assert elapsed < timeout + 1.0, elapsed
    error = caught.value
    (failure,) = error.failures
    assert failure.kind is kind and failure.target == target
    assert failure.message.startswith(f"{target}: "), failure.message
    for fragment in fragments:
        assert fragment in failure.message, (fragment, failure.message)
    assert "\n" not in str(error) and failure.message in str(error)
    assert error.by_kind() == {kind: [target]}
    return failure


@pytest.mark.timeout(60)
async def test_unknown_host_key(hosts: SshHosts) -> None:
    lines = known_hosts_lines(hosts)
    del lines[hosts.hosts[0].addr]
    hosts.known_hosts.write_text("".join(f"{line}\n" for line in lines.values()))
    await connect_expecting(Target("h1"), FailureKind.UNKNOWN_HOST_KEY, "unknown host key",
                            "ssh-ed25519 key SHA256:")


@pytest.mark.timeout(60)
async def test_changed_host_key(hosts: SshHosts) -> None:
    lines = known_hosts_lines(hosts)
    h1, h2 = (h.addr for h in hosts.hosts[:2])
    # h1's entry now holds h2's key: exactly what a reinstalled (or impersonated) host shows.
    lines[h1] = lines[h1].split()[0] + " " + " ".join(lines[h2].split()[1:])
    hosts.known_hosts.write_text("".join(f"{line}\n" for line in lines.values()))
    await connect_expecting(Target("h1"), FailureKind.CHANGED_HOST_KEY, "host key CHANGED",
                            "ssh-keygen -R")


@pytest.mark.timeout(60)
async def test_wrong_user_key_is_permission_denied(hosts: SshHosts, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger_key"
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(stranger))
    config = hosts.ssh_config.read_text().replace(str(hosts.user_key), str(stranger))
    hosts.ssh_config.write_text(config)
    await connect_expecting(Target("h2"), FailureKind.PERMISSION_DENIED,
                            f"permission denied for user {hosts.user}")


@pytest.mark.timeout(60)
async def test_unknown_user_is_permission_denied(hosts: SshHosts) -> None:
    await connect_expecting(Target("h3", user="no-such-user"), FailureKind.PERMISSION_DENIED,
                            "for user no-such-user")


@pytest.mark.timeout(60)
async def test_unresolvable_name(hosts: SshHosts) -> None:
    await connect_expecting(Target("no-such-host.invalid"), FailureKind.NAME_NOT_RESOLVED,
                            "not resolved")


@pytest.mark.timeout(60)
async def test_connection_refused(hosts: SshHosts) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nobody listens there
        probe.bind(("127.0.77.200", 0))
        port = probe.getsockname()[1]
    await connect_expecting(Target("127.0.77.200", port=port), FailureKind.CONNECTION_REFUSED,
                            "connection refused")


class SilentListener:
    """A TCP server that accepts and never speaks SSH, recording how many clients it held
    open at once. A client's close (FIN) reaches us before its next connect (SYN) on loopback,
    and closed sockets are pruned before each accept, so `max_open` is exact."""

    def __init__(self, addr: str) -> None:
        self.sock = socket.create_server((addr, 0), backlog=256)
        self.addr, self.port = addr, self.sock.getsockname()[1]
        self.open: set[socket.socket] = set()
        self.accepted = self.max_open = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> SilentListener:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._wake_w.send(b"x")
        self._thread.join(TIMEOUT)
        for s in (*self.open, self.sock, self._wake_r, self._wake_w):
            s.close()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in sel.select()}
                if self._wake_r in ready:
                    return
                self._prune(sel)
                if self.sock in ready:
                    conn, _ = self.sock.accept()
                    sel.register(conn, selectors.EVENT_READ)
                    self.open.add(conn)
                    self.accepted += 1
                    self.max_open = max(self.max_open, len(self.open))

    def _prune(self, sel: selectors.BaseSelector) -> None:
        for conn in list(self.open):
            try:
                while conn.recv(65536, socket.MSG_DONTWAIT):
                    pass  # the client's version string: ignore
            except BlockingIOError:
                continue  # still open
            except OSError:
                pass  # reset: closed
            sel.unregister(conn)
            self.open.discard(conn)
            conn.close()


@pytest.mark.timeout(60)
async def test_silent_server_times_out(hosts: SshHosts) -> None:
    with SilentListener("127.0.77.201") as silent:
        failure = await connect_expecting(Target(silent.addr, port=silent.port),
                                          FailureKind.TIMEOUT, "within 0.5s", timeout=0.5)
        assert failure.timing.connect >= 0.5
        await wait_for(lambda: silent.accepted == 1 and not silent.open,
                       "the timed-out connection to be closed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("says", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n"],
                         ids=["closes at once", "a web server"])
async def test_a_server_that_closes_before_the_banner_is_not_ssh(says: bytes) -> None:
    """A server that closes before the banner, or speaks HTTP, is "not an SSH server", not
    `h: Connection lost`."""
    server = socket.create_server(("127.0.77.202", 0))

    def serve() -> None:
        conn, _ = server.accept()
        conn.sendall(says)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        await connect_expecting(Target("127.0.77.202", port=server.getsockname()[1]),
                                FailureKind.CONNECTION_CLOSED,
                                "not an SSH server, or it closed the connection")
    finally:
        thread.join(TIMEOUT)
        server.close()


def write_aliases(home: Path, aliases: list[str], addr: str, port: int) -> None:
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "config").write_text("".join(
        f"Host {alias}\n    HostName {addr}\n    Port {port}\n" for alias in aliases))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fanout", [3, 64])
async def test_fanout_bounds_concurrent_attempts(fanout: int, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    aliases = [f"s{i}" for i in range(9)]
    with SilentListener("127.0.77.202") as silent:
        write_aliases(tmp_path, aliases, silent.addr, silent.port)
        use_home(monkeypatch, tmp_path)
        results = await connect_each([Target(a) for a in aliases], fanout=fanout, timeout=0.3)
        assert [f.kind for f in results.failures] == [FailureKind.TIMEOUT] * len(aliases)
        await wait_for(lambda: not silent.open, "every attempt's socket to close")
    assert silent.accepted == len(aliases)
    assert silent.max_open == min(fanout, len(aliases))
    queued = [results.timings[Target(a)].queued for a in aliases]
    if fanout < len(aliases):  # the last ones waited for a slot: two rounds of 0.3 s
        assert max(queued) >= 0.25 * (len(aliases) // fanout - 1)


@pytest.mark.timeout(60)
async def test_after_a_failure_queued_hosts_are_not_attempted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aliases = [f"s{i}" for i in range(9)]
    with SilentListener("127.0.77.203") as silent:
        write_aliases(tmp_path, aliases, silent.addr, silent.port)
        use_home(monkeypatch, tmp_path)
        started = time.monotonic()
        with pytest.raises(SshConnectError) as caught:
            await connect_all([Target(a) for a in aliases], fanout=3, timeout=0.3)
        assert time.monotonic() - started < 0.3 + 1.0  # one round, not three
    error = caught.value
    assert [f.target for f in error.failures] == [Target(a) for a in aliases[:3]]
    assert list(error.not_attempted) == [Target(a) for a in aliases[3:]]
    assert silent.accepted == 3


@pytest.mark.timeout(60)
async def test_mixed_failures_close_the_connections_that_worked(hosts: SshHosts) -> None:
    good, bad = Target("h1"), Target("h2", user="no-such-user")
    with socket.socket() as probe:
        probe.bind(("127.0.77.204", 0))
        refused = Target("127.0.77.204", port=probe.getsockname()[1])
    with pytest.raises(SshConnectError) as caught:
        await connect_all([good, bad, refused], timeout=SSH_TIMEOUT, keep_going=True)
    error = caught.value
    assert error.total == 3 and str(error).startswith("cannot connect to 2 of 3 hosts: ")
    assert error.by_kind() == {FailureKind.PERMISSION_DENIED: [bad],
                               FailureKind.CONNECTION_REFUSED: [refused]}
    await wait_for(lambda: sessions(hosts.hosts[0]) == 0, "h1's connection to be closed")


@pytest.mark.timeout(60)
async def test_missing_identity_file_is_named(hosts: SshHosts, tmp_path: Path) -> None:
    # ssh skips an IdentityFile that does not exist; asyncssh fails: say which file.
    missing = tmp_path / "no_such_key"
    hosts.ssh_config.write_text(hosts.ssh_config.read_text().replace(str(hosts.user_key),
                                                                     str(missing)))
    await connect_expecting(Target("h1"), FailureKind.OTHER, f"cannot read {missing}")


@pytest.mark.timeout(60)
async def test_cancelling_closes_the_connections_already_open(hosts: SshHosts) -> None:
    with SilentListener("127.0.77.205") as silent:
        slow = Target(silent.addr, port=silent.port)
        done: list[tuple[Target, HostFailure | None]] = []
        task = asyncio.create_task(connect_all(
            [Target("h1"), slow], timeout=TIMEOUT,
            progress=lambda target, timing, failure: done.append((target, failure))))
        await wait_for(lambda: done == [(Target("h1"), None)] and silent.accepted == 1,
                       "h1 to be connected while the other host hangs")
        assert sessions(hosts.hosts[0]) == 1
        gc.disable()  # a dropped connection must be closed by the code, not by the collector
        try:
            task.cancel()  # e.g. Ctrl-C during start-up
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for(lambda: sessions(hosts.hosts[0]) == 0, "h1's connection to close")
            await wait_for(lambda: not silent.open, "the pending attempt's socket to close")
        finally:
            gc.enable()


@pytest.mark.timeout(60)
def test_never_prompts_even_when_the_server_offers_passwords(tmp_path: Path) -> None:
    """The server offers password auth; with stdin closed and no controlling terminal, an
    unauthorised key must give "permission denied" at once, not a prompt or a hang."""
    with start_password_hosts(1, tmp_path) as hosts:
        h1 = hosts.hosts[0]
        offered = asyncio.run(asyncssh.get_server_auth_methods(
            h1.addr, h1.port, config=None))  # no host key check: it only lists methods
        assert "password" in offered
        code = textwrap.dedent("""\
            import asyncio, sys
            from spawner.ssh import SshConnectError, Target, connect_all
            try:
                asyncio.run(connect_all([Target("h1")], timeout=10))
            except SshConnectError as e:
                print(e.failures[0].kind.name, e.failures[0].message)
        """)
        started = time.monotonic()
        done = subprocess.run(
            ["sh", "-c", 'exec "$0" -c "$1" <&-', sys.executable, code],  # fd 0 closed
            env={**hosts.env(), "SSH_AUTH_SOCK": ""}, capture_output=True, text=True,
            timeout=TIMEOUT, start_new_session=True,  # no controlling terminal either
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("PERMISSION_DENIED h1: permission denied"), done.stdout
    assert "passwords are not tried" in done.stdout
    assert time.monotonic() - started < 10


def test_duplicate_targets_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        asyncio.run(connect_each([Target("a"), Target("a")]))


def test_importing_does_not_import_asyncssh() -> None:
    code = "import sys, spawner.ssh; print('asyncssh' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.stdout.strip() == "False", done.stderr


# -- importing asyncssh ------------------------------------------------------------------------

# Imports asyncssh in a fresh interpreter, `how` being the statement; prints whether
# ctypes.util.find_library is the same function afterwards.
_IMPORT = ("import ctypes.util, sys; before = ctypes.util.find_library; {how}; "
           "print('asyncssh' in sys.modules, ctypes.util.find_library is before)")


def _import_counting_gcc(tmp_path: Path, how: str) -> tuple[str, int]:
    """Run _IMPORT with a `gcc` first on PATH that counts its runs (and then fails, as a
    compiler that finds no library does): its stdout, and how often gcc ran."""
    bin_dir, count = tmp_path / "bin", tmp_path / "gcc-runs"
    bin_dir.mkdir(exist_ok=True)
    count.write_text("")
    gcc = bin_dir / "gcc"
    gcc.write_text(f"#!/bin/sh\necho run >> {count}\nexit 1\n")
    gcc.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", _IMPORT.format(how=how)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), len(count.read_text().split())


# Imports asyncssh in a fresh interpreter, `how` being the statement; prints whether its
# X.509 support is there, and whether cryptography.x509 or a hidden module is left loaded.
_X509 = ("import sys; {how}; import asyncssh; "
         "print(hasattr(asyncssh.crypto, 'X509Certificate'), 'cryptography.x509' in sys.modules,"
         " sys.modules.get('asyncssh.crypto.x509', 0) is None)")


@pytest.mark.parametrize("pyopenssl", [False, True], ids=["no-pyopenssl", "pyopenssl"])
def test_load_asyncssh_leaves_out_x509_only_where_asyncssh_cannot_use_it(tmp_path, pyopenssl):
    """asyncssh's X.509 support needs pyOpenSSL. Without it, load_asyncssh does not import
    cryptography.x509 for it (~25-45 ms) and asyncssh has no X.509, as a plain import gives;
    with it (a stand-in package here), X.509 is loaded as a plain import loads it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if pyopenssl:
        (tmp_path / "OpenSSL").mkdir()
        (tmp_path / "OpenSSL" / "__init__.py").write_text("")
        (tmp_path / "OpenSSL" / "crypto.py").write_text("")
    elif importlib.util.find_spec("OpenSSL") is not None:
        # no switch: what it checks cannot happen where pyOpenSSL is installed
        pytest.skip("pyOpenSSL is installed here")

    def run(how: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", _X509.format(how=how)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    plain = run("pass")
    loaded = run("from spawner.ssh import load_asyncssh; load_asyncssh()")
    assert loaded[0] == plain[0] == str(pyopenssl)
    assert loaded[1:] == ([str(pyopenssl), "False"])


def test_load_asyncssh_runs_no_compiler(tmp_path):
    """asyncssh looks for optional libraries at import; where ld.so's cache lacks one,
    find_library runs gcc (~50 ms each): load_asyncssh imports it without, and leaves
    find_library as it found it."""
    plain, plain_runs = _import_counting_gcc(tmp_path, "import asyncssh")
    if plain_runs == 0:  # this machine has every library asyncssh looks for
        # no switch: what it checks cannot happen where liboqs is installed
        pytest.skip("asyncssh's import runs no gcc here (liboqs is installed)")
    loaded, runs = _import_counting_gcc(
        tmp_path, "from spawner.ssh import load_asyncssh; load_asyncssh()")
    assert (plain, loaded) == ("True True", "True True")
    assert runs == 0
