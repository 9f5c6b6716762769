"""One asyncssh connection per host, opened concurrently, never prompting.

`connect_all(targets)` opens a connection to every target with at most `fanout` attempts in
flight, each bounded by `timeout`, and returns them all, or closes whatever it opened and raises
`SshConnectError` carrying one `HostFailure` per failed host. `connect_each` is the same without
the all-or-nothing rule, for callers that report per host (preflight, key distribution).

What the user's ssh setup says is honoured because asyncssh reads it itself: `~/.ssh/config`
(relative to `$HOME`: HostName, Port, User, IdentityFile, ProxyJump, UserKnownHostsFile...),
the agent at `$SSH_AUTH_SOCK`, the default keys, and known_hosts. asyncssh evaluates the
config for each connection; `spawner.sshconfig` spares it splitting the same lines, and
decoding the same known_hosts keys, again. Authentication is by key only
unless a password is given explicitly: no password or keyboard-interactive prompt, no passphrase
prompt (encrypted keys are skipped), stdin is never read.

asyncssh costs ~250 ms to import, so it is imported inside the functions that need it: the
error and result types here are free to import. A connection loads it with `load_asyncssh()`,
which spares the import a C compiler's runs and X.509 code it cannot use (see there).

Errors:

    SshError                    base of every error this module raises on purpose
    └── SshConnectError         some hosts could not be reached; `.failures` says why, per host
"""

from __future__ import annotations

import asyncio
import enum
import errno
import functools
import os
import socket
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from .uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

if TYPE_CHECKING:
    import asyncssh

__all__ = [
    "DEFAULT_FANOUT", "DEFAULT_TIMEOUT", "ConnectResults", "ConnectTiming", "Connections",
    "FailureKind", "HostFailure", "Progress", "SshConnectError", "SshError", "SshTarget",
    "Target",
    "close_all", "connect_all", "connect_each", "fold_failures",
]

DEFAULT_FANOUT = 64
DEFAULT_TIMEOUT = 10.0
# Closing is a courtesy to the server: never let a dead peer hold up the error path.
CLOSE_TIMEOUT = 2.0
KEEPALIVE_INTERVAL = 5.0
KEEPALIVE_COUNT = 3


class SshTarget(Hashable, Protocol):
    """What a host must look like: `poprun.plan.hosts.Host` and `Target` both qualify."""

    @property
    def name(self) -> str: ...  # looked up in ~/.ssh/config (Host patterns)

    @property
    def user(self) -> str | None: ...  # None: the config's User, else the local user

    @property
    def port(self) -> int | None: ...  # None: the config's Port, else 22


T = TypeVar("T", bound=SshTarget)


class Target(NamedTuple):
    """A host to connect to, for callers without a host type of their own."""

    name: str
    user: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        text = f"{self.user}@{self.name}" if self.user else self.name
        return f"{text}:{self.port}" if self.port else text


class FailureKind(str, enum.Enum):
    """Why a host could not be connected to; each kind has its own message."""

    UNKNOWN_HOST_KEY = "unknown host key"
    """The server's host key is not in known_hosts, which has no key for that host at all."""
    CHANGED_HOST_KEY = "changed host key"
    """known_hosts has a key for that host, but the server offered a different one."""
    PERMISSION_DENIED = "permission denied"
    """The server refused every key offered (passwords are never tried unless given)."""
    NAME_NOT_RESOLVED = "name not resolved"
    """The host name (after ~/.ssh/config's HostName) has no address."""
    CONNECTION_REFUSED = "connection refused"
    """Nothing listens on the SSH port (sshd down, or the wrong port)."""
    TIMEOUT = "timeout"
    """No authenticated connection within the timeout (host down, firewall, silent server)."""
    CONNECTION_CLOSED = "connection closed"
    """The server closed the connection before the SSH handshake ended: not an SSH server
    (a web server on that port), or an sshd turning connections away (MaxStartups...)."""
    OTHER = "other"
    """Anything else: unreachable network, protocol or key-exchange failure..."""


@dataclass(frozen=True)
class ConnectTiming:
    """Seconds a host waited for a fan-out slot, then took to connect (or to fail)."""

    queued: float
    connect: float


@dataclass(frozen=True)
class HostFailure:
    """One host's failure: `message` is one line naming the host, ready to print."""

    target: Any  # the caller's target object (an SshTarget)
    kind: FailureKind
    message: str
    timing: ConnectTiming


class SshError(Exception):
    """Base of the errors this module raises on purpose; `str()` is one line."""


class SshConnectError(SshError):
    """Some hosts could not be connected to; every connection that was opened is closed.

    `failures` holds one `HostFailure` per failed host in the order the targets were given;
    `not_attempted` the targets never tried because an earlier one failed; `total` the number
    of targets. `str()` is a one-line summary; print `failure.message` per host for details.
    """

    def __init__(self, failures: Iterable[HostFailure], total: int,
                 not_attempted: Iterable[Any] = ()) -> None:
        self.failures = tuple(failures)
        self.total = total
        self.not_attempted = tuple(not_attempted)
        first = self.failures[0].message if self.failures else "no failure recorded"
        more = len(self.failures) - 1
        tail = f" (and {more} more host{'s' if more > 1 else ''})" if more else ""
        super().__init__(
            f"cannot connect to {len(self.failures)} of {total} hosts: {first}{tail}")

    def by_kind(self) -> dict[FailureKind, list[Any]]:
        """The failed targets grouped by kind, for a folded report."""
        return fold_failures(self.failures)


# Called as each host finishes: (target, timing, its failure or None when connected).
Progress = Callable[[Any, ConnectTiming, "HostFailure | None"], None]


def fold_failures(failures: Iterable[HostFailure]) -> dict[FailureKind, list[Any]]:
    """{kind: [targets]} in first-seen order, e.g. to print "permission denied: h[3,7-9]"."""
    folded: dict[FailureKind, list[Any]] = {}
    for failure in failures:
        folded.setdefault(failure.kind, []).append(failure.target)
    return folded


class Connections(Mapping[Any, "asyncssh.SSHClientConnection"]):
    """The open connections by target (in the order given), plus how long each took.

    An async context manager: leaving it closes every connection.
    """

    def __init__(self, conns: dict[Any, asyncssh.SSHClientConnection],
                 timings: dict[Any, ConnectTiming]) -> None:
        self._conns = conns
        self.timings = timings

    def __getitem__(self, target: Any) -> asyncssh.SSHClientConnection:
        return self._conns[target]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._conns)

    def __len__(self) -> int:
        return len(self._conns)

    async def close(self) -> None:
        await close_all(self._conns.values())

    async def __aenter__(self) -> Connections:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def connect_all(targets: Iterable[T], *, fanout: int = DEFAULT_FANOUT,
                      timeout: float = DEFAULT_TIMEOUT, keep_going: bool = False,
                      password: str | None = None, progress: Progress | None = None
                      ) -> Connections:
    """Connect to every target, or to none: on any failure close all and raise
    `SshConnectError`.

    `keep_going=False` (launching): once a host has failed, queued hosts are not attempted,
    so the error comes within one `timeout` of the first failure. `keep_going=True`
    (reporting): every host is tried.
    """
    results = await connect_each(targets, fanout=fanout, timeout=timeout,
                                 keep_going=keep_going, password=password, progress=progress)
    opened = results.connections
    if len(opened) < len(results.outcomes):
        await close_all(opened.values())
        raise SshConnectError(results.failures, len(results.outcomes), results.not_attempted)
    return Connections(opened, results.timings)


@dataclass(frozen=True)
class ConnectResults:
    """What `connect_each` got, per target in the order given."""

    outcomes: dict[Any, Any]  # open connection, HostFailure, or None: not attempted
    timings: dict[Any, ConnectTiming]  # for the targets attempted

    @property
    def connections(self) -> dict[Any, asyncssh.SSHClientConnection]:
        return {t: r for t, r in self.outcomes.items() if _is_connection(r)}

    @property
    def failures(self) -> list[HostFailure]:
        return [r for r in self.outcomes.values() if isinstance(r, HostFailure)]

    @property
    def not_attempted(self) -> list[Any]:
        return [t for t, r in self.outcomes.items() if r is None]


async def connect_each(targets: Iterable[T], *, fanout: int = DEFAULT_FANOUT,
                       timeout: float = DEFAULT_TIMEOUT, keep_going: bool = True,
                       password: str | None = None, progress: Progress | None = None,
                       on_open: Callable[[T, asyncssh.SSHClientConnection], None] | None = None
                       ) -> ConnectResults:
    """Try every target, at most `fanout` at once, each within `timeout`; a host's failure is
    data, not an exception. The caller owns the connections returned (if this is cancelled,
    it closes them itself). With a `password`, password and keyboard-interactive auth are
    tried with it; without one they are off, so nothing can prompt. `progress(target,
    timing, failure_or_None)` is called as each host finishes, e.g. for a live display;
    `on_open(target, connection)` as each connection opens (to use it before the others)."""
    targets = _unique(targets)
    if fanout < 1 or timeout <= 0:
        raise ValueError(f"fanout must be >= 1 and timeout > 0, got {fanout}, {timeout}")
    results = ConnectResults(dict.fromkeys(targets), {})
    slots = asyncio.Semaphore(fanout)
    failed = asyncio.Event()

    async def attempt(target: T) -> None:
        queued_at = time.monotonic()
        async with slots:
            if failed.is_set() and not keep_going:
                return
            started = time.monotonic()
            outcome = await _connect_one(target, timeout, password)
            timing = ConnectTiming(started - queued_at, time.monotonic() - started)
            results.timings[target] = timing
            if isinstance(outcome, _Failed):
                outcome = HostFailure(target, outcome.kind, outcome.message, timing)
                failed.set()
            results.outcomes[target] = outcome
            if on_open is not None and not isinstance(outcome, HostFailure):
                on_open(target, outcome)
            if progress is not None:
                progress(target, timing, outcome if isinstance(outcome, HostFailure) else None)

    try:
        async with asyncio.TaskGroup() as group:
            for target in targets:
                group.create_task(attempt(target))
    except BaseException:
        await close_all(results.connections.values())
        raise
    return results


def _unique(targets: Iterable[T]) -> list[T]:
    targets = list(targets)
    if len(set(targets)) != len(targets):
        raise ValueError("duplicate targets: each host needs its own connection")
    return targets


def _is_connection(result: object) -> bool:
    return result is not None and not isinstance(result, HostFailure)


async def close_all(conns: Iterable[asyncssh.SSHClientConnection]) -> None:
    """Close connections and wait (bounded) until they are closed."""
    conns = list(conns)
    for conn in conns:
        conn.close()
    if conns:
        await asyncio.wait([asyncio.ensure_future(c.wait_closed()) for c in conns],
                           timeout=CLOSE_TIMEOUT)


# -- one connection ------------------------------------------------------------------------


class _Failed(NamedTuple):
    kind: FailureKind
    message: str


class _Rejected(NamedTuple):
    """A host key the server offered and known_hosts did not trust."""

    host: str  # as looked up in known_hosts: HostKeyAlias or HostName
    addr: str
    port: int
    key: Any  # asyncssh.SSHKey


@functools.cache
def load_asyncssh() -> Any:
    """asyncssh, imported without running a C compiler (see _import_asyncssh) nor the X.509
    code it cannot use (_x509_hidden), its config file's lines split and known_hosts' keys
    decoded once rather than for every connection (spawner.sshconfig)."""
    from spawner import sshconfig

    hidden = _x509_hidden()
    try:
        asyncssh = _import_asyncssh()
    finally:
        if hidden and sys.modules.get(_X509_MODULE, False) is None:
            del sys.modules[_X509_MODULE]
    sshconfig.install(asyncssh)
    prefer_aes_gcm(asyncssh)
    return asyncssh


# OpenSSH's AES-GCM ciphers, fastest first: on a CPU with AES instructions a packet costs
# ~4 µs against ~45 µs for asyncssh's chacha20-poly1305 (its default first choice), which
# builds a cipher context twice per packet (bench/README.md, "SSH fan-out to 64 hosts").
AES_GCM = (b"aes128-gcm@openssh.com", b"aes256-gcm@openssh.com")


def prefer_aes_gcm(asyncssh: Any) -> None:
    """Put AES-GCM first in asyncssh's default ciphers, the same set reordered. The server
    takes the client's first cipher it allows, so a host that allows AES-GCM gets it and
    one that does not gets the next; a `Ciphers` line in ~/.ssh/config still decides
    where it is given (asyncssh takes the default only where the config names none, and
    applies `+`, `-` and `^` to this order)."""
    defaults = asyncssh.encryption.get_default_encryption_algs()  # the list asyncssh uses
    first = [alg for alg in AES_GCM if alg in defaults]
    defaults[:] = first + [alg for alg in defaults if alg not in first]


# asyncssh's X.509 certificate support (x509v3-* keys: PKIX-SSH's, never OpenSSH's), which
# needs pyOpenSSL; asyncssh.crypto imports it under `except ImportError`.
_X509_MODULE = "asyncssh.crypto.x509"


def _x509_hidden() -> bool:
    """Where pyOpenSSL is not installed, asyncssh's X.509 module fails at its `from OpenSSL
    import crypto`, after importing cryptography.x509 for nothing: 25-45 ms of every SSH
    launch's start, before its first connection (bench/README.md, "Remote launches").
    Hidden then, it fails at once instead, with the same ImportError and the same outcome:
    no X.509 in asyncssh. True if hidden (the caller unhides it after the import)."""
    import importlib.util

    if "asyncssh" in sys.modules or "OpenSSL" in sys.modules or \
            importlib.util.find_spec("OpenSSL") is not None:
        return False
    sys.modules[_X509_MODULE] = None  # type: ignore[assignment]: import -> ImportError
    return True


def _import_asyncssh() -> Any:
    """asyncssh, imported with `ctypes.util.find_library` not running gcc. At import asyncssh
    looks for optional libraries (liboqs, twice; nettle); for each that ld.so's cache lacks,
    find_library runs gcc, then ld: three gcc and ld runs took ~150 ms of every SSH launch on
    a machine with a compiler (strace; bench/README.md, "Remote launches"). The cache and
    `ld -t` (what gcc would link, LD_LIBRARY_PATH too) still answer; elsewhere than Linux, or
    should CPython's helpers change, the import is left as it is."""
    import ctypes.util

    found = [getattr(ctypes.util, name, None)
             for name in ("_findSoname_ldconfig", "_findLib_ld", "_get_soname")]
    if None in found:
        import asyncssh

        return asyncssh
    ldconfig, ld, soname = found
    full = ctypes.util.find_library
    ctypes.util.find_library = lambda name: ldconfig(name) or soname(ld(name))
    try:
        import asyncssh
    finally:
        ctypes.util.find_library = full
    return asyncssh


async def _connect_one(target: SshTarget, timeout: float, password: str | None
                       ) -> asyncssh.SSHClientConnection | _Failed:
    asyncssh = load_asyncssh()

    clients: list[Any] = []

    def client_factory() -> asyncssh.SSHClient:
        clients.append(_recording_client_class()())
        return clients[-1]

    try:
        # asyncio.timeout bounds everything: config parsing, DNS, ProxyJump hops, auth.
        async with asyncio.timeout(timeout):
            return await asyncssh.connect(
                target.name, **_target_options(target), client_factory=client_factory,
                password=password, password_auth=password is not None,
                kbdint_auth=password is not None,
                # A host that goes silent (powered off, cable cut: no reset ever arrives)
                # is declared lost after ~15 s instead of the TCP timeout's many minutes.
                keepalive_interval=KEEPALIVE_INTERVAL, keepalive_count_max=KEEPALIVE_COUNT,
            )
    except Exception as exc:  # every failure becomes data, one line per host
        client = clients[0] if clients else None
        return await _classify(target, exc, timeout, password is not None, client)


def _target_options(target: SshTarget) -> dict[str, Any]:
    # () means "not given": asyncssh then takes the config's value, as ssh does.
    return {"port": target.port or (), "username": target.user or ()}


@functools.cache
def _recording_client_class() -> type:
    import asyncssh

    class RecordingClient(asyncssh.SSHClient):
        """Refuses untrusted host keys like the default, remembering the key it refused."""

        rejected: _Rejected | None = None

        def validate_host_public_key(self, host: str, addr: str, port: int,
                                     key: asyncssh.SSHKey) -> bool:
            self.rejected = _Rejected(host, addr, port, key)
            return False

    return RecordingClient


async def _classify(target: SshTarget, exc: Exception, timeout: float, with_password: bool,
                    client: Any) -> _Failed:
    """Turn an exception from asyncssh.connect into a kind and a one-line message.

    `client` is None when the failure came before the TCP connection to the target itself:
    then, if ~/.ssh/config routes it through a ProxyJump, the failure was on a jump hop and
    asyncssh's own text (which names that hop) is the message.
    """
    import asyncssh

    if isinstance(exc, TimeoutError):
        return _Failed(FailureKind.TIMEOUT, f"{target}: no SSH connection within {timeout:g}s")
    options = await asyncio.to_thread(_options_for, target)
    jump = getattr(options, "tunnel", None) if client is None else None
    where = f"{target} (via ProxyJump {jump})" if jump else f"{target}"
    rejected = getattr(client, "rejected", None)
    if isinstance(exc, asyncssh.HostKeyNotVerifiable) and rejected is not None:
        return await asyncio.to_thread(_host_key_failure, target, rejected, options)
    if isinstance(exc, asyncssh.PermissionDenied):
        return _Failed(FailureKind.PERMISSION_DENIED,
                       f"{where}: {_denied(exc, options, with_password, jump)}")
    if isinstance(exc, socket.gaierror):
        return _Failed(FailureKind.NAME_NOT_RESOLVED,
                       f"{where}: host name not resolved ({exc.strerror})")
    if _is_refused(exc):
        return _Failed(FailureKind.CONNECTION_REFUSED,
                       f"{where}: connection refused, is sshd running there? ({exc})")
    if isinstance(exc, (asyncssh.ConnectionLost, ConnectionResetError, EOFError)):
        return _Failed(FailureKind.CONNECTION_CLOSED,
                       f"{where}: not an SSH server, or it closed the connection before the "
                       f"SSH handshake ended ({getattr(exc, 'reason', None) or exc})")
    if isinstance(exc, FileNotFoundError):
        # Unlike ssh, asyncssh fails on an IdentityFile that does not exist.
        return _Failed(FailureKind.OTHER, f"{where}: cannot read {exc.filename}: {exc.strerror}"
                                          " (an IdentityFile in ~/.ssh/config?)")
    reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    return _Failed(FailureKind.OTHER, f"{where}: {reason}")


def _options_for(target: SshTarget) -> Any:
    """The options asyncssh derived from ~/.ssh/config for this target, or None if the
    config itself is what failed."""
    import asyncssh

    try:
        # config=(): load ~/.ssh/config as connect() does (the constructor's default is none).
        return asyncssh.SSHClientConnectionOptions(
            config=(), host=target.name, **_target_options(target), password_auth=False,
            kbdint_auth=False)
    except Exception:  # reported through the original exception instead
        return None


def _denied(exc: Exception, options: Any, with_password: bool, jump: str | None) -> str:
    if jump or options is None:
        return f"permission denied ({getattr(exc, 'reason', exc)})"
    why = "password and keys rejected" if with_password else \
        "no key accepted; passwords are not tried"
    return f"permission denied for user {options.username} ({why})"


def _is_refused(exc: Exception) -> bool:
    if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
        return True
    # Several addresses, all refusing: asyncio folds them into one OSError without an errno.
    text = str(exc)
    return text.startswith("Multiple exceptions:") and \
        text.count(f"[Errno {errno.ECONNREFUSED}]") == text.count("[Errno")


def _host_key_failure(target: SshTarget, rejected: _Rejected, options: Any) -> _Failed:
    """Unknown or changed? asyncssh raises HostKeyNotVerifiable for both: look the host up
    in the known_hosts files the connection used, as OpenSSH does to tell them apart."""
    offered = f"{rejected.key.get_algorithm()} key {rejected.key.get_fingerprint()}"
    if _known_keys(options, rejected):
        return _Failed(
            FailureKind.CHANGED_HOST_KEY,
            f"{target}: host key CHANGED: {rejected.host} offered {offered}, but known_hosts "
            f"has a different key for it (an attack, or the host was reinstalled: then "
            f"remove the old key with ssh-keygen -R)")
    return _Failed(
        FailureKind.UNKNOWN_HOST_KEY,
        f"{target}: unknown host key: {rejected.host} offered {offered}, which is not in "
        f"known_hosts (connect once with ssh, or add it with ssh-keyscan)")


def _known_keys(options: Any, rejected: _Rejected) -> list[Any]:
    import asyncssh

    files = (options.known_hosts if options else None) or _default_known_hosts()
    if not files:
        return []
    port = None if rejected.port == 22 else rejected.port
    return list(asyncssh.match_known_hosts(files, rejected.host, rejected.addr, port)[0])


def _default_known_hosts() -> list[str]:
    # What asyncssh falls back to when the config names no UserKnownHostsFile.
    path = Path("~", ".ssh", "known_hosts").expanduser()
    return [str(path)] if os.access(path, os.R_OK) else []
