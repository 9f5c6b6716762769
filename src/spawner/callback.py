"""An agent that calls its launcher back over TCP, and the launcher's end that takes the call.

Under Slurm one job step starts every node's agent (spawner/srun.py). Each agent connects to
the launcher at the address its environment names (`CALLBACK_VARIABLE`, `host:port`; with
no host, `SLURM_LAUNCH_NODE_IPADDR`: the address srun ran from, as Slurm gives it to the
step's tasks), and before either side says anything else each proves to the other that it
holds the job's secret (`SECRET_VARIABLE`, in the step's environment, never on a command
line, where `ps` shows it to every user of the node). From then on the connection carries
the agent protocol (spawner/protocol.py), as an SSH channel does.

    agent    -> launcher   MAGIC (8 bytes), the agent's nonce (32)
    launcher -> agent      the launcher's nonce (32), MAC(secret, "launcher", nonces) (32)
    agent    -> launcher   MAC(secret, "agent", nonces, identity) (32),
                           the identity's length (1), the identity (JSON: node, step, task)

The secret itself never travels, and each proof covers fresh nonces of both sides: a proof
seen on the network proves nothing on another connection. The launcher proves itself first,
so an agent that reached something else (its port taken by another process after poprun
died) runs nothing it is told; a connection that does not prove the secret is closed before
one byte of the agent protocol is read from it.

The agent's end is blocking and stdlib-only (it runs before the agent's event loop); the
launcher's (`CallbackListener`) is asyncio, bounded in what it reads, how long it waits and
how many unproven connections it holds: anyone on the network can connect.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, MutableMapping
from typing import Any

CALLBACK_VARIABLE = "POPRUN_AGENT_CALLBACK"  # host:port of the launcher's listener
SECRET_VARIABLE = "POPRUN_AGENT_SECRET"  # the job's secret, hex
STEP_VARIABLE = "POPRUN_AGENT_STEP"  # which of the launcher's steps started the agent
LAUNCH_NODE_VARIABLE = "SLURM_LAUNCH_NODE_IPADDR"
MAGIC = b"POPRUNCB"
NONCE = 32
PROOF = 32  # bytes of a MAC (`proof`)
MAX_IDENTITY = 255
CONNECT_TIMEOUT = 30.0  # seconds: an agent's connection to the launcher, and its handshake
HANDSHAKE_TIMEOUT = 30.0  # seconds the launcher gives a connection to prove the secret
MAX_UNPROVEN = 128  # connections still proving at once; more are closed at once


class CallbackError(Exception):
    """The handshake failed (the other side does not hold the secret, or says nonsense)."""


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

def connect_back(environ: MutableMapping[str, str]) -> socket.socket:
    """The connection to the launcher, proven both ways (see the module docstring). The
    callback variables are taken out of `environ` (the agent's own: its instances must not
    inherit the secret). Raises CallbackError or OSError."""
    target = environ.pop(CALLBACK_VARIABLE, "")
    secret_hex = environ.pop(SECRET_VARIABLE, "")
    step = environ.pop(STEP_VARIABLE, "0")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        raise CallbackError(f"{SECRET_VARIABLE} is not hex") from None
    if not secret:
        raise CallbackError(f"{SECRET_VARIABLE} is not set: the launcher's step sets it")
    host, _, port = target.rpartition(":")
    host = host.strip("[]") or environ.get(LAUNCH_NODE_VARIABLE, "")
    if not host or not port.isdigit():
        raise CallbackError(f"no launcher address in {CALLBACK_VARIABLE}={target!r} "
                            f"({LAUNCH_NODE_VARIABLE}={environ.get(LAUNCH_NODE_VARIABLE)!r})")
    identity = json.dumps({"node": environ.get("SLURMD_NODENAME") or os.uname().nodename,
                           "step": step, "task": environ.get("SLURM_PROCID")}).encode()
    if len(identity) > MAX_IDENTITY:
        raise CallbackError("the node's name is too long")
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
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
            raise CallbackError("the launcher closed the connection during the handshake")
        data += chunk
    return data


# --- the launcher's end ------------------------------------------------------------------

class CallbackListener:
    """A listening socket that takes agents' calls: each proven connection is handed to
    `on_agent(identity, caller)` (identity: {"node", "step", "task"}), which returns what
    receives the connection from then on (`data_received(data)`, `eof_received()`,
    `connection_lost(exc)`), or None to refuse it. `on_refused(why)` for every connection
    closed unproven. `bind()` is synchronous: the port is known before the steps start;
    connections wait in the backlog until `serve()`."""

    def __init__(self, secret: bytes, on_agent: Callable[[dict[str, Any], Caller], Any],
                 on_refused: Callable[[str], None]) -> None:
        self.secret, self._on_agent, self._on_refused = secret, on_agent, on_refused
        self._sock: socket.socket | None = None
        self._server: Any = None
        self.unproven: set[Caller] = set()
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

    def proven(self, caller: Caller, identity: dict[str, Any]) -> Any:
        return self._on_agent(identity, caller)

    def refused(self, why: str) -> None:
        self._on_refused(why)


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

    def connection_made(self, transport: Any) -> None:
        import asyncio

        self.transport = transport
        if len(self._listener.unproven) >= MAX_UNPROVEN:
            self.refuse("too many connections still proving the secret")
            return
        self._listener.unproven.add(self)
        self._timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT, self.refuse, f"no proof within {HANDSHAKE_TIMEOUT:g} s")

    def peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{peer[0]}:{peer[1]}" if peer else "?"

    def refuse(self, why: str | None) -> None:
        self._forget()
        if why is not None:
            self._listener.refused(f"{self.peer()}: {why}")
        self.transport.abort()

    def _forget(self) -> None:
        self._listener.unproven.discard(self)
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
