"""An agent that calls its launcher back over TCP, and the launcher's end that takes the call.

Under Slurm one job step starts every node's agent (spawner/srun.py). Each agent connects to
the launcher at the address its environment names (`CALLBACK_VARIABLE`, `host:port`; with
no host, `SLURM_LAUNCH_NODE_IPADDR`: the address srun ran from, as Slurm gives it to the
step's tasks), and before either side says anything else each proves to the other that it
holds the job's secret. From then on the connection carries the agent protocol
(spawner/protocol.py), as an SSH channel does.

The secret reaches the agent on its stdin, one line of hex that srun broadcasts to the
step's tasks (`read_secret`): never on a command line, where `ps` shows it to every user of
the node, and never in an environment, where it would outlive its reading: a process's
original environment block stays readable in /proc/PID/environ for as long as it runs, by
its instances among others (docs/architecture.md, "Runtime guarantees").

    agent    -> launcher   MAGIC (8 bytes), the agent's nonce (32)
    launcher -> agent      the launcher's nonce (32), MAC(secret, "launcher", nonces) (32)
    agent    -> launcher   MAC(secret, "agent", nonces, identity) (32),
                           the identity's length (1), the identity (JSON: node, step, task)

The secret itself never travels, and each proof covers fresh nonces of both sides: a proof
seen on the network proves nothing on another connection. The launcher proves itself first,
so an agent that reached something else (its port taken by another process after poprun
died) runs nothing it is told; a connection that does not prove the secret is closed before
one byte of the agent protocol is read from it.

The agent's end is blocking and stdlib-only (it runs before the agent's event loop). It tries
again, with backoff, while CONNECT_TIMEOUT lasts, when its connection is refused or closed
before the launcher proved itself: a launcher busy with a flood of connections closes some.

The launcher's (`CallbackListener`) is asyncio: anyone who reaches the port can connect, so
it serves only the allocation. A peer that is not an address of the job's nodes (`learnt`)
is closed at once; the others get HANDSHAKE_TIMEOUT to prove the secret, at most
MAX_UNPROVEN_PER_SOURCE of them still proving per address (MAX_UNPROVEN in all), the oldest
closed to make room for a new one: idle connections cannot keep an agent out, only delay it
until it tries again. Where every node is this machine (a test cluster on loopback), the
job's addresses are this machine's and a neighbour on it shares them: the bounds and the
secret are what keep it out. Refusals are logged once per address (MAX_TOLD addresses).
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Callable, Collection, MutableMapping
from typing import Any

CALLBACK_VARIABLE = "POPRUN_AGENT_CALLBACK"  # host:port of the launcher's listener
# The name the secret had in the step's environment before it came on stdin: set nowhere
# now (tests look for it in every ancestor's environment).
SECRET_VARIABLE = "POPRUN_AGENT_SECRET"
STEP_VARIABLE = "POPRUN_AGENT_STEP"  # which of the launcher's steps started the agent
LAUNCH_NODE_VARIABLE = "SLURM_LAUNCH_NODE_IPADDR"
MAGIC = b"POPRUNCB"
NONCE = 32
PROOF = 32  # bytes of a MAC (`proof`)
MAX_IDENTITY = 255
CONNECT_TIMEOUT = 30.0  # seconds an agent tries to reach the launcher (srun.CALLBACK_TIMEOUT
# waits 60 from the step's start), the secret's line on stdin included
RETRY_FIRST, RETRY_MOST = 0.05, 2.0  # seconds between an agent's tries: doubling, jittered
HANDSHAKE_TIMEOUT = 5.0  # seconds the launcher gives a connection to prove the secret (an
# agent takes milliseconds; it tries again if it was too slow)
MAX_UNPROVEN = 128  # connections still proving at once; the oldest makes room for a new one
MAX_UNPROVEN_PER_SOURCE = 32  # ... from one address (a loopback cluster's nodes share one)
MAX_TOLD = 256  # addresses whose refusals are logged (once each); later ones are not
SECRET_LINE = 2 * 32 + 1  # bytes of the secret's line on stdin: hex, newline


class CallbackError(Exception):
    """The handshake failed (the other side does not hold the secret, or says nonsense)."""


class Dropped(CallbackError):
    """The launcher closed the connection before it proved itself: busy (a flood of
    connections made it close some), so the agent tries again."""


def proof(secret: bytes, who: bytes, agent_nonce: bytes, launcher_nonce: bytes,
          identity: bytes = b"") -> bytes:
    """BLAKE2b keyed with the secret: a MAC by design (RFC 7693), and the standard library's
    own. Not hashlib's HMAC: importing hashlib loads OpenSSL's libcrypto, 3.7 MB more of the
    launcher's RSS (bench/README.md, "One step for every node")."""
    try:
        from _blake2 import blake2b
    except ImportError:  # not CPython
        from hashlib import blake2b
    return blake2b(b"\0".join((who, agent_nonce, launcher_nonce, identity)), key=secret,
                   digest_size=PROOF).digest()


def same(shown: bytes, expected: bytes) -> bool:
    """Compared in a time that does not tell how much matched (hmac.compare_digest's)."""
    try:
        from _operator import _compare_digest
    except ImportError:  # not CPython
        from hmac import compare_digest as _compare_digest
    return _compare_digest(shown, expected)


def new_secret() -> bytes:
    return os.urandom(32)


# --- the agent's end ---------------------------------------------------------------------

def read_secret(fd: int, deadline: float) -> bytes:
    """The job's secret: the first line of `fd` (the agent's stdin, as srun gives it), hex,
    read by then (time.monotonic()). Raises CallbackError."""
    line = b""
    while not line.endswith(b"\n") and len(line) < SECRET_LINE:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise CallbackError("the job's secret did not come on stdin in time")
        try:
            chunk = os.read(fd, SECRET_LINE - len(line))
        except BlockingIOError:
            continue
        if not chunk:
            break
        line += chunk
    try:
        secret = bytes.fromhex(line.strip().decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != 32 or not line.endswith(b"\n"):
        raise CallbackError("stdin does not start with the job's secret: the launcher's "
                            "step writes it there")
    return secret


def connect_back(environ: MutableMapping[str, str], secret: bytes,
                 deadline: float | None = None,
                 retrying: Callable[[BaseException], None] | None = None) -> socket.socket:
    """The connection to the launcher, proven both ways (see the module docstring), tried
    again with backoff until `deadline` (time.monotonic(); default CONNECT_TIMEOUT from
    now) while it is refused or dropped (or its name does not resolve yet), `retrying` told
    of each failure tried again. The callback variables are taken out of `environ` (the
    agent's own: its instances do not inherit them). Raises CallbackError or OSError."""
    target = environ.pop(CALLBACK_VARIABLE, "")
    step = environ.pop(STEP_VARIABLE, "0")
    host, _, port = target.rpartition(":")
    host = host.strip("[]") or environ.get(LAUNCH_NODE_VARIABLE, "")
    if not host or not port.isdigit():
        raise CallbackError(f"no launcher address in {CALLBACK_VARIABLE}={target!r} "
                            f"({LAUNCH_NODE_VARIABLE}={environ.get(LAUNCH_NODE_VARIABLE)!r})")
    identity = json.dumps({"node": environ.get("SLURMD_NODENAME") or os.uname().nodename,
                           "step": step, "task": environ.get("SLURM_PROCID")}).encode()
    if len(identity) > MAX_IDENTITY:
        raise CallbackError("the node's name is too long")
    deadline = time.monotonic() + CONNECT_TIMEOUT if deadline is None else deadline
    pause = RETRY_FIRST
    while True:
        try:
            return _call(host, int(port), secret, identity,
                         max(0.1, deadline - time.monotonic()))
        except (OSError, Dropped) as exc:
            if time.monotonic() + pause >= deadline:
                raise
            if retrying is not None:
                retrying(exc)
        time.sleep(pause * (0.5 + os.urandom(1)[0] / 255))  # agents do not retry in step
        pause = min(pause * 2, RETRY_MOST)


def _call(host: str, port: int, secret: bytes, identity: bytes, timeout: float
          ) -> socket.socket:
    """One try: connected and proven both ways within `timeout` seconds."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        mine = os.urandom(NONCE)
        sock.sendall(MAGIC + mine)
        answer = _read_exactly(sock, NONCE + PROOF)
        theirs, shown = answer[:NONCE], answer[NONCE:]
        if not same(shown, proof(secret, b"launcher", mine, theirs)):
            raise CallbackError(f"{host}:{port} does not hold this job's secret")
        sock.sendall(proof(secret, b"agent", mine, theirs, identity)
                     + bytes([len(identity)]) + identity)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames go at once
    except BaseException:
        sock.close()
        raise
    return sock


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise Dropped("the launcher closed the connection during the handshake")
        data += chunk
    return data


# --- the launcher's end ------------------------------------------------------------------

class CallbackListener:
    """A listening socket that takes agents' calls: each proven connection is handed to
    `on_agent(identity, caller)` (identity: {"node", "step", "task"}), which returns what
    receives the connection from then on (`data_received(data)`, `eof_received()`,
    `connection_lost(exc)`), or None to refuse it. `on_refused(why)` for the first
    connection of each address closed unproven. `bind()` is synchronous: the port is known
    before the steps start; connections wait in the backlog until `serve()`.

    Which addresses may call: none until `learning()` says the job's nodes' are being
    looked up (meanwhile any may, as if it were one), then those `learnt()` says; None
    learnt (the lookup failed): any."""

    def __init__(self, secret: bytes, on_agent: Callable[[dict[str, Any], Caller], Any],
                 on_refused: Callable[[str], None]) -> None:
        self.secret, self._on_agent, self._on_refused = secret, on_agent, on_refused
        self._sock: socket.socket | None = None
        self._server: Any = None
        self.unproven: dict[Caller, None] = {}  # in arrival order: the oldest first
        self._by_source: dict[str, dict[Caller, None]] = {}
        self._allowed: set[str] = set()
        self._loopback = False  # any 127.0.0.0/8 or ::1 address may call (a node is here)
        self._any = True  # until learning(): a listener of its own (tests) takes anyone
        self._learning = 0
        self._told: set[str] = set()
        self.address: str | None = None  # as given to bind(): None, any of this machine's
        self.port = 0

    def bind(self, address: str | None, port: int = 0) -> None:
        """Listen on `address`, or on every address of this machine (IPv6 and IPv4 on one
        port where the machine has IPv6) when None; on `port`, or any free one when 0."""
        if address is not None:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            where = (address, port)
        else:
            try:
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                where = ("::", port)
            except OSError:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                where = ("0.0.0.0", port)
        try:
            if port:  # a known port (pod mode's leader) is taken again at once after a restart
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock, self.address, self.port = sock, address, sock.getsockname()[1]

    def target(self) -> str:
        """The callback variable's value: `host:port`, or `:port` (the agent then uses the
        address Slurm gives it for the launch node)."""
        host = f"[{self.address}]" if self.address and ":" in self.address else self.address
        return f"{host or ''}:{self.port}"

    async def serve(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Caller(self), sock=self._sock)

    def close(self) -> None:
        """No more calls; the unproven ones closed (proven ones are their receivers')."""
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        for caller in list(self.unproven):
            caller.refuse(None)

    # --- who may call ------------------------------------------------------------------

    def learning(self) -> None:
        """The addresses of more nodes are being looked up: until `learnt`, a caller from
        an address not known yet may be one of theirs."""
        if self._learning == 0 and self._any and not self._allowed:
            self._any = False  # the first lookup: from now on only the nodes' addresses
        self._learning += 1

    def learnt(self, addresses: Collection[str] | None, loopback: bool = False) -> None:
        """The addresses those nodes call from (`loopback`: any of this machine's loopback
        ones too), or None where they could not be told (then any may call). The unproven
        callers from other addresses are closed."""
        self._learning = max(0, self._learning - 1)
        if addresses is None:
            self._any = True
        else:
            self._allowed.update(addresses)
            self._loopback |= loopback
        for caller in list(self.unproven):
            if self.admits(caller.source) is False:
                caller.refuse("not an address of the job's nodes")

    def admits(self, source: str) -> bool | None:
        """Whether `source` may call: None while it may yet be a node's (lookups under
        way)."""
        if self._any or source in self._allowed:
            return True
        if self._loopback and is_loopback(source):
            return True
        return None if self._learning else False

    def enter(self, caller: Caller) -> None:
        """A new unproven caller, within the bounds: the oldest of its address (or of all)
        makes room for it."""
        mine = self._by_source.setdefault(caller.source, {})
        if len(mine) >= MAX_UNPROVEN_PER_SOURCE:
            next(iter(mine)).refuse("newer connections from its address took its place")
        elif len(self.unproven) >= MAX_UNPROVEN:
            next(iter(self.unproven)).refuse("newer connections took its place")
        mine[caller] = None
        self.unproven[caller] = None

    def leave(self, caller: Caller) -> None:
        self.unproven.pop(caller, None)
        mine = self._by_source.get(caller.source)
        if mine is not None:
            mine.pop(caller, None)
            if not mine:
                del self._by_source[caller.source]

    def proven(self, caller: Caller, identity: dict[str, Any]) -> Any:
        return self._on_agent(identity, caller)

    def refused(self, caller: Caller, why: str) -> None:
        """Said once per address: a flood from one says one line."""
        if caller.source in self._told or len(self._told) >= MAX_TOLD:
            return
        self._told.add(caller.source)
        self._on_refused(f"{caller.peer()}: {why} (later refusals of {caller.source} are not "
                         "logged)")


def is_loopback(address: str) -> bool:
    """An address of 127.0.0.0/8 or ::1 (as getaddrinfo and peernames write them)."""
    return address == "::1" or address.startswith("127.")


def source_of(peername: object) -> str:
    """The address a peer called from, as its nodes' addresses are written: an IPv4 peer of
    the dual-stack listener (::ffff:10.0.0.5) as its IPv4 address."""
    if not isinstance(peername, tuple) or not peername:
        return "?"
    host = str(peername[0])
    return host.removeprefix("::ffff:") if "." in host else host


class Caller:
    """One connection to the listener (asyncio's protocol): the handshake, then a pipe to
    its receiver."""

    def __init__(self, listener: CallbackListener) -> None:
        self._listener = listener
        self._buffer = bytearray()
        self._receiver: Any = None
        self._nonce = b""
        self.transport: Any = None
        self._timer: Any = None
        self.source = "?"

    def connection_made(self, transport: Any) -> None:
        import asyncio

        self.transport = transport
        self.source = source_of(transport.get_extra_info("peername"))
        if self._listener.admits(self.source) is False:
            self.refuse("not an address of the job's nodes")
            return
        self._listener.enter(self)
        self._timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT, self.refuse, f"no proof within {HANDSHAKE_TIMEOUT:g} s")

    def peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{source_of(peer)}:{peer[1]}" if peer else "?"

    def refuse(self, why: str | None) -> None:
        self._forget()
        if why is not None:
            self._listener.refused(self, why)
        self.transport.abort()

    def _forget(self) -> None:
        self._listener.leave(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        if self._receiver is not None:
            self._receiver.data_received(data)
            return
        self._buffer += data
        if not self._nonce:
            if len(self._buffer) < len(MAGIC) + NONCE:
                return
            if not self._buffer.startswith(MAGIC):
                self.refuse("not a poprun agent")
                return
            self._agent_nonce = bytes(self._buffer[len(MAGIC):len(MAGIC) + NONCE])
            del self._buffer[:len(MAGIC) + NONCE]
            self._nonce = os.urandom(NONCE)
            self.transport.write(self._nonce + proof(self._listener.secret, b"launcher",
                                                     self._agent_nonce, self._nonce))
        # What is kept stays bounded: past the proof and a length byte's worth of identity,
        # the handshake is decided (the bytes after it are the agent protocol's).
        if len(self._buffer) < PROOF + 1 or len(self._buffer) < PROOF + 1 + self._buffer[PROOF]:
            return
        self._proven(bytes(self._buffer))

    def _proven(self, buffer: bytes) -> None:
        shown, size = buffer[:PROOF], buffer[PROOF]
        raw, rest = buffer[PROOF + 1:PROOF + 1 + size], buffer[PROOF + 1 + size:]
        if not same(shown, proof(self._listener.secret, b"agent",
                                                self._agent_nonce, self._nonce, raw)):
            self.refuse("it does not hold this job's secret")
            return
        try:
            identity = json.loads(raw)
            if not (isinstance(identity, dict) and isinstance(identity.get("node"), str)):
                raise ValueError(raw)
        except ValueError:
            self.refuse("its identity is not one")  # only an agent of ours holds the secret
            return
        self._forget()
        self._buffer = bytearray()
        receiver = self._listener.proven(self, identity)
        if receiver is None:
            self.transport.abort()
            return
        self._receiver = receiver
        if rest:
            receiver.data_received(rest)

    def eof_received(self) -> bool:
        if self._receiver is not None:
            self._receiver.eof_received()
        return False  # the transport closes: the agent's end is its exit

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if self._receiver is not None:
            self._receiver.connection_lost(exc)
