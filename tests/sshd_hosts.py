"""Real OpenSSH ``sshd`` servers on loopback addresses, for multi-host tests.

``start_ssh_hosts(n, tmp_path)`` starts one ``sshd -D -e`` per "host" on 127.0.77.1 ..
127.0.77.n (Linux routes all of 127/8 to ``lo``, so no setup is needed), each on a free port,
and writes a HOME-like directory holding a user key, ``authorized_keys``, ``known_hosts`` and an
``ssh_config`` with one ``Host hN`` alias per server::

    with start_ssh_hosts(2, tmp_path) as hosts:
        subprocess.run(["ssh", "-F", hosts.ssh_config, "h1", "true"], check=True)
        hosts.kill_host(0)          # h1 "dies": its sshd and every session on it are killed

``SSH_CONNECTION`` inside a session names the server address, so it tells which host ran it.

The hosts share this machine's files. A host can have files of its own at the same paths, as
separate machines would: ``mounts(host)`` gives ``mount`` argument lists (``["--bind", src,
dst]``, ``["-t", "tmpfs", "-o", "size=1m", "tmpfs", dir]``) made in a mount namespace of that
host's own (``unshare --mount --propagation private``) before its sshd starts there; every
session, and so every process poprun starts on that host, inherits it. This needs root (or
CAP_SYS_ADMIN): without it those tests skip (CI: fail).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from requires import skip_or_fail

__all__ = ["SshClientFiles", "SshHost", "SshHosts", "in_mount_namespace", "make_client_files",
           "processes_with", "require_mount_namespaces", "require_sshd", "require_tool",
           "skip_or_fail", "sshd_options", "start_ssh_hosts", "wait_until"]

READY_TIMEOUT = 10.0
# 127.0.77.1-254, then 127.0.78.1-254...: each host an address of its own on lo.
MAX_HOSTS = 4 * 254
BIND_ATTEMPTS = 5
# If pytest is killed outright (no teardown), don't leave servers listening forever.
# setpriv execs sshd in place, so Popen.pid stays sshd's pid. (The death signal fires when the
# *thread* that started sshd exits: start hosts from the main thread or a long-lived one.)
_DIE_WITH_US = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []


def require_tool(name: str, *candidates: str) -> str:
    """Absolute path of ``name``; skip the test if missing, or fail when CI demands it.

    CI sets POPRUN_REQUIRE_SSHD=1 so multi-host tests cannot silently turn into skips.
    """
    for path in (*candidates, shutil.which(name)):
        if path and os.access(path, os.X_OK):
            return os.path.abspath(path)  # sshd re-execs itself, so it refuses relative paths
    skip_or_fail(f"{name} not found (install openssh-server / openssh-client)",
                 "POPRUN_REQUIRE_SSHD")


@cache
def _mount_namespaces() -> str | None:
    """Why a host cannot have a mount namespace of its own here, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "unshare not found (util-linux)"
    done = subprocess.run([unshare, "--mount", "--propagation", "private", "true"],
                          capture_output=True, text=True, timeout=10)
    return None if done.returncode == 0 else \
        f"cannot make a mount namespace: {done.stderr.strip() or done.returncode}"


def require_mount_namespaces() -> None:
    """Skip (CI: fail) where hosts cannot have files of their own (``mounts``)."""
    why = _mount_namespaces()
    if why:
        skip_or_fail(why, "POPRUN_REQUIRE_SSHD")


def require_sshd() -> str:
    """Path of ``sshd`` (skip/fail as in ``require_tool``); also checks ``ssh-keygen``."""
    require_tool("ssh-keygen")
    # /usr/sbin is often not on a non-root PATH.
    return require_tool("sshd", "/usr/sbin/sshd")


@dataclass
class SshHost:
    """One loopback "host": its alias in ssh_config, address, port and sshd process."""

    alias: str
    addr: str
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    log: list[str] = field(default_factory=list)  # sshd's stderr (-e), for failure messages
    _listening: bool = False
    _started: threading.Event = field(default_factory=threading.Event)  # listening, or EOF

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class SshHosts:
    """The running servers plus the client-side files that reach them."""

    hosts: list[SshHost]
    home: Path  # HOME-like dir; its .ssh/config is the ssh_config below
    user: str
    user_key: Path  # private key; the public one is user_key + ".pub"
    known_hosts: Path
    ssh_config: Path

    @property
    def aliases(self) -> list[str]:
        return [h.alias for h in self.hosts]

    def env(self) -> dict[str, str]:
        """os.environ with HOME = ``home``: asyncssh then finds .ssh/config, keys and
        known_hosts by itself. OpenSSH's ``ssh`` takes ~ from passwd, not $HOME: pass -F."""
        return {**os.environ, "HOME": str(self.home)}

    def ssh_argv(self, i: int, *command: str) -> list[str]:
        """``ssh`` argv running ``command`` (a remote shell string) on host ``i``."""
        return ["ssh", "-F", str(self.ssh_config), self.hosts[i].alias, *command]

    def sshd_pids(self, i: int) -> list[int]:
        """Host ``i``'s sshd processes (the listener and each connection's), not what they
        run: SIGSTOP them all and the host's network path stalls while its programs live."""
        children, tree, todo = _children(), [], [self.hosts[i].proc.pid]
        while todo:
            pid = todo.pop()
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("sshd"):
                tree.append(pid)
                todo.extend(children.get(pid, ()))
        return tree

    def kill_host(self, i: int) -> None:
        """Simulate host ``i`` dying: kill its sshd and every session process under it.

        Only killing the listener would leave established connections (and the instances
        they run) alive, which is not what a dead host looks like to the launcher.
        """
        _stop(self.hosts[i])


@dataclass(frozen=True)
class SshClientFiles:
    """The client side of a set of test servers, in a HOME-like dir: a user key that every
    server authorises, a known_hosts and an ssh_config (the caller writes those two)."""

    home: Path
    user: str
    user_key: Path  # private key; the public one is user_key + ".pub"

    @property
    def authorized_keys(self) -> Path:
        return self.home / ".ssh" / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        return self.home / ".ssh" / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.home / ".ssh" / "config"

    def host_entry(self, alias: str, **options: object) -> str:
        """One ``Host`` block of the ssh_config: ``options`` (HostName=..., ProxyCommand=...)
        first, then key-only login as this user, never prompting, the host key checked
        against our known_hosts alone."""
        lines = [*(f"{k} {v}" for k, v in options.items()),
                 f"User {self.user}",
                 f"IdentityFile {self.user_key}",
                 "IdentitiesOnly yes",
                 f"UserKnownHostsFile {self.known_hosts}",
                 "GlobalKnownHostsFile /dev/null",
                 "StrictHostKeyChecking yes",
                 "BatchMode yes"]
        return f"Host {alias}\n" + "".join(f"    {line}\n" for line in lines)


def make_client_files(root: Path, host_keys: list[Path]) -> SshClientFiles:
    """``root``/home/.ssh with a user key in ``authorized_keys``; generates the servers'
    ``host_keys`` too, all at once (ssh-keygen processes run concurrently)."""
    ssh_dir = root / "home" / ".ssh"
    ssh_dir.mkdir(parents=True, mode=0o700)
    client = SshClientFiles(root / "home", pwd.getpwuid(os.getuid()).pw_name,
                            ssh_dir / "id_ed25519")
    _keygen([client.user_key, *host_keys])
    shutil.copyfile(f"{client.user_key}.pub", client.authorized_keys)
    return client


@contextlib.contextmanager
def start_ssh_hosts(n: int, tmp_path: Path | str,
                    setenv: Callable[[SshHost], Mapping[str, str]] | None = None,
                    sshd_lines: Callable[[SshHost], Sequence[str]] | None = None,
                    mounts: Callable[[SshHost], Sequence[Sequence[str]]] | None = None
                    ) -> Iterator[SshHosts]:
    """Start ``n`` sshd servers (h1..hn on 127.0.77.1..254, then 127.0.78.1...); stop them
    and clean up on exit. ``setenv(host)``: variables every session on that host gets
    (sshd's SetEnv), e.g. an XDG_CACHE_HOME of its own, as separate machines would have.
    ``sshd_lines(host)``: more sshd_config lines for that host (``Ciphers ...``).
    ``mounts(host)``: the ``mount`` argument lists that give that host files of its own (see
    the module's doc)."""
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"n must be in 1..{MAX_HOSTS}, got {n}")
    sshd = require_sshd()
    _ensure_privsep_dir()
    root = Path(tempfile.mkdtemp(prefix="sshd-hosts-", dir=tmp_path))
    hosts: list[SshHost] = []
    try:
        hosts = [
            SshHost(f"h{k}", host_address(k), 0, root / f"h{k}") for k in range(1, n + 1)
        ]
        for host in hosts:
            host.dir.mkdir()
        client = make_client_files(root, [h.dir / "ssh_host_ed25519_key" for h in hosts])

        if mounts is not None:
            require_mount_namespaces()
        _start_all(sshd, hosts, client.authorized_keys, setenv, sshd_lines, mounts)

        client.known_hosts.write_text("".join(
            # Keyed the way OpenSSH looks it up: HostName plus non-default port.
            f"[{h.addr}]:{h.port} {_pubkey(h.dir / 'ssh_host_ed25519_key')}\n" for h in hosts
        ))
        client.ssh_config.write_text("".join(
            client.host_entry(h.alias, HostName=h.addr, Port=h.port) for h in hosts
        ))
        yield SshHosts(hosts, client.home, client.user, client.user_key, client.known_hosts,
                       client.ssh_config)
    finally:
        for host in hosts:
            _stop(host)
        shutil.rmtree(root, ignore_errors=True)


def _start_all(sshd: str, hosts: list[SshHost], authorized_keys: Path,
               setenv: Callable[[SshHost], Mapping[str, str]] | None = None,
               sshd_lines: Callable[[SshHost], Sequence[str]] | None = None,
               mounts: Callable[[SshHost], Sequence[Sequence[str]]] | None = None) -> None:
    """Start every sshd, then wait for all; restart those that lost their port to a race."""
    pending = list(hosts)
    for _ in range(BIND_ATTEMPTS):
        for host in pending:
            host.port = _free_port(host.addr)
            host.log.clear()
            host._listening = False
            host._started.clear()
            _write_sshd_config(host, authorized_keys, setenv(host) if setenv else {},
                               sshd_lines(host) if sshd_lines else ())
            host.proc = subprocess.Popen(
                [*_DIE_WITH_US, *in_mount_namespace(mounts(host) if mounts else ()),
                 sshd, "-D", "-e", "-f", str(host.dir / "sshd_config")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C aimed at pytest must not hit it first
            )
            # sshd logs every connection; keep draining so it never blocks on a full pipe.
            threading.Thread(target=_pump, args=(host,), daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT
        retry = []
        for host in pending:
            assert host.proc is not None
            if host._started.wait(max(0.0, deadline - time.monotonic())):
                if host._listening:
                    continue
                host.proc.wait(READY_TIMEOUT)  # stderr hit EOF: sshd is exiting
                if "Address already in use" in "".join(host.log):
                    retry.append(host)  # someone took the port since _free_port; pick another
                    continue
                what = f"exited with status {host.proc.returncode}"
            else:
                host.proc.kill()
                host.proc.wait()
                what = f"did not report listening within {READY_TIMEOUT}s"
            raise RuntimeError(
                f"sshd for {host.alias} ({host.addr}:{host.port}) {what}; "
                f"its stderr:\n{''.join(host.log)}"
            )
        if not retry:
            return
        pending = retry
    raise RuntimeError(f"sshd could not bind a port after {BIND_ATTEMPTS} attempts")


def in_mount_namespace(mounts: Sequence[Sequence[str]]) -> list[str]:
    """The words before a command (sshd's) that start it in a mount namespace of its own with
    `mounts` made there (each exec'd in place: the command keeps the pid Popen gave, which
    the death signal and _stop act on). A mount that fails fails the start, its error on
    the command's stderr."""
    if not mounts:
        return []
    script = "".join(f"mount {shlex.join(m)} || exit 1\n" for m in mounts) + 'exec "$@"\n'
    return ["unshare", "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", script, "sh"]


def _pump(host: SshHost) -> None:
    assert host.proc is not None and host.proc.stderr is not None
    with host.proc.stderr:
        for raw in host.proc.stderr:
            host.log.append(raw.decode(errors="replace"))
            if b"Server listening on" in raw:
                host._listening = True
                host._started.set()
    host._started.set()  # EOF: sshd died before listening; wake the waiter to report it


def _stop(host: SshHost) -> None:
    # poll() first: once reaped, the pid may belong to an unrelated process.
    if host.proc is not None and host.proc.poll() is None:
        _kill_tree(host.proc.pid)
        host.proc.wait()


def _write_sshd_config(host: SshHost, authorized_keys: Path,
                       setenv: Mapping[str, str] | None = None,
                       extra: Sequence[str] = ()) -> None:
    lines = [
        f"ListenAddress {host.addr}:{host.port}",
        f"PidFile {host.dir / 'sshd.pid'}",
        *sshd_options(host.dir / "ssh_host_ed25519_key", authorized_keys, setenv),
        *extra,
    ]
    (host.dir / "sshd_config").write_text("\n".join(lines) + "\n")


def sshd_options(host_key: Path, authorized_keys: Path,
                 setenv: Mapping[str, str] | None = None) -> list[str]:
    """The sshd_config lines every test server shares: its host key, key-only login as any
    user in ``authorized_keys``, no PAM; ``setenv``: variables every session gets."""
    lines = [
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",  # pytest's tmp dirs may be group/world-writable
        # Defaults (10 unauthenticated connections, 10 channels per connection) make a
        # launcher that opens many connections or channels at once fail at random.
        "MaxStartups 1000",
        "MaxSessions 1000",
    ]
    if _sshd_version() >= (9, 8):
        # Else a test that provokes auth failures gets later connections refused.
        lines.append("PerSourcePenalties no")
    if setenv:
        lines.append("SetEnv " + " ".join(f'"{k}={v}"' for k, v in setenv.items()))
    return lines


def _keygen(paths: list[Path]) -> None:
    procs = [
        subprocess.Popen(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", p.name, "-f", str(p)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for p in paths
    ]
    for p, proc in zip(paths, procs):
        out, _ = proc.communicate(timeout=30)
        if proc.returncode:
            raise RuntimeError(f"ssh-keygen for {p} failed: {out.decode(errors='replace')}")


def _pubkey(private_key: Path) -> str:
    kind, blob = Path(f"{private_key}.pub").read_text().split()[:2]  # drop the comment
    return f"{kind} {blob}"


def host_address(k: int) -> str:
    """Host k's (1-based) loopback address."""
    return f"127.0.{77 + (k - 1) // 254}.{(k - 1) % 254 + 1}"


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _ensure_privsep_dir() -> None:
    # sshd refuses to start without its privilege-separation dir, absent in fresh containers.
    if os.getuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)


@cache
def _sshd_version() -> tuple[int, int]:
    out = subprocess.run(
        [require_sshd(), "-V"], capture_output=True, text=True, timeout=10
    )
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", out.stdout + out.stderr)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # exited meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # comm may contain spaces/parens
            children.setdefault(ppid, []).append(int(entry))
    return children


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and all its descendants (sshd setsid()s every connection, so a
    process-group kill misses sessions: the ppid tree is walked instead)."""
    kill_trees(lambda: [root])


def kill_trees(find_roots, spare: frozenset[int] = frozenset()) -> None:
    """SIGKILL every process ``find_roots()`` returns and all their descendants, except the
    pids in ``spare`` (and theirs), as a host that fails whole would end them: none of them
    runs again once the first is killed.

    Each process is SIGSTOPped as it is found, so none forks or is reparented (and lost)
    between a scan and the kill; rescan until no new process shows up. Then the deepest
    are killed first: a stopped process whose parent (of its session, in another process
    group: slurmstepd and its task) dies first is in an orphaned process group, and the
    kernel sends that group SIGHUP and SIGCONT. The task woke and acted on its SIGHUP before
    its own SIGKILL (an agent killed its instance and reported it: test_slurm_launch's
    node-failure test got 137, not a lost host's 255, once under load). With its SIGKILL
    already pending, it dies without running.
    """
    depth: dict[int, int] = {}  # every process found -> its depth below a root
    while True:
        children = _children()
        tree: dict[int, int] = {}
        todo = [(root, 0) for root in find_roots()]
        while todo:
            pid, level = todo.pop()
            if pid in spare or tree.get(pid, -1) >= level:  # deeper under another root
                continue
            tree[pid] = level
            todo.extend((child, level + 1) for child in children.get(pid, ()))
        new = tree.keys() - depth.keys()
        depth.update(tree)  # the latest scan's (a root found late may sit above others)
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
    for pid in sorted(depth, key=depth.__getitem__, reverse=True):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def dead_host_leftovers() -> Iterator[None]:
    """Remove, at the end, the temporary dirs (/tmp/poprun-*) and cgroups that appeared
    meanwhile: a host killed whole keeps its agent's (nothing of it survives to remove them;
    a real host's go with it), and here every "host" shares this machine."""
    from spawner.containment import own_cgroup_dir, remove_tree

    cgroups = Path(own_cgroup_dir() or "/nonexistent")
    before = set(Path("/tmp").glob("poprun-*")) | set(cgroups.glob("poprun-*"))
    try:
        yield
    finally:
        for path in set(Path("/tmp").glob("poprun-*")) - before:
            shutil.rmtree(path, ignore_errors=True)
        for path in set(cgroups.glob("poprun-*")) - before:  # its agent's cgroups, killed
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
            remove_tree(str(path))


def launched_with(marker: str) -> list[int]:
    """`processes_with(marker)` but poprun's own forks: its lifeline's watchdog and its PMIx
    server's process carry poprun's command line (spawner.lifeline.WATCHDOG_NAME,
    spawner.worlds.pmixproc.NAME name them in /proc/PID/comm)."""
    from spawner.lifeline import WATCHDOG_NAME
    from spawner.worlds.pmixproc import NAME

    def own_fork(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/comm").read_bytes().strip() in (WATCHDOG_NAME, NAME)
        except OSError:
            return False
    return [pid for pid in processes_with(marker) if not own_fork(pid)]


def processes_with(marker: str) -> list[int]:
    """Pids of every process whose command line contains `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


# A variable poprun adds to every instance's environment (docs/architecture.md, "The
# environment contract"), which what the instance starts inherits; poprun itself, its
# watchdog, the agents, ssh, srun and salloc do not carry it.
INSTANCE_VARIABLE = b"POPDIST_NUM_TOTAL_REPLICAS="


def instances_with(marker: str) -> list[int]:
    """The instances (and what they started) among ``processes_with(marker)``: poprun's own
    command line holds the marker too (and its watchdog's, and that of a salloc running it),
    so they are told apart by the environment poprun gives an instance, never by a word of a
    command line, which a path can hold (a clone in a folder named ``poprun``)."""
    return [pid for pid in processes_with(marker) if _is_instance(pid)]


def _is_instance(pid: int) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone meanwhile
        return False
    return environ.startswith(INSTANCE_VARIABLE) or b"\0" + INSTANCE_VARIABLE in environ


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker`` (poprun, its watchdog, its
    instances: whatever a failed test left) and all their descendants: a cleanup for a
    ``finally`` that needs no instance lookup."""
    kill_trees(lambda: [pid for pid in processes_with(marker) if pid != os.getpid()])


def freeze(pids: list[int]) -> None:
    """SIGSTOP each of `pids`: a host (its agent, sshd) that no longer acts."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def thaw(pids: list[int]) -> None:
    """SIGCONT each of `pids` still there (a test's `finally`)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def watchdog_of(owner: int) -> int:
    """The lifeline watchdog of `owner` (poprun's is its child, an agent's is detached): the
    process named WATCHDOG_NAME that holds the other end of one of `owner`'s pipes."""
    from spawner.lifeline import WATCHDOG_NAME

    pipes = _pipes(owner)
    return next(pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if _comm(pid) == WATCHDOG_NAME and pipes & _pipes(pid))


def _pipes(pid: int) -> set[str]:
    found = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("pipe:"):
                    found.add(target)
    return found


def _comm(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip()
    except OSError:
        return b""


def wait_until(predicate, what: str, timeout: float = 20.0) -> None:
    """Poll `predicate` (every 20 ms) until true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
