"""A running job's control socket: how `poprunctl` reaches the launcher.

The launcher listens on a Unix socket in its job directory (poprun/jobctl/records.py: mode 0700, and the
socket 0600; a peer of another user is refused by its credentials). One request per
connection, one line of JSON:

    {"op": "show"}                               -> {"ok": true, "instances": [...], ...}
    {"op": "stacks", "instances": [i...] | null, "timeout": s}
                                                 -> {"ok": true, "stacks": {i: {pid, how,
                                                     threads, error}}}
    {"op": "kill", "signal": "SIGINT"}           -> {"ok": true, "signal": "SIGINT"}
    {"op": "logs", "follow": bool}               -> {"ok": true, "source": "ring" | "files"},
                                                    then the job's output as records
                                                    (poprun/jobctl/joblog.py) until it ends (follow)
                                                    or all that was kept is sent

An error is {"ok": false, "error": "..."}. The server runs on the launch's own event loop
(asyncio.start_unix_server); the client is blocking and bounded by a timeout (poprunctl).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

MAX_REQUEST = 1 << 16
REQUEST_TIMEOUT = 5.0  # seconds a client has to send its request
_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid

Handler = Callable[[dict[str, Any], asyncio.StreamWriter], Awaitable[dict[str, Any] | None]]


class ControlServer:
    """Serves `handler(request, writer)`: it returns the reply, or None when it has written
    the reply itself (a stream). `close()` ends every connection."""

    def __init__(self, path: str, handler: Handler) -> None:
        self.path, self._handler = path, handler
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._serve, path=self.path,
                                                       limit=MAX_REQUEST)
        os.chmod(self.path, 0o600)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            if not _same_user(writer):
                await _send(writer, {"ok": False, "error": "another user's job"})
                return
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT):  # not wait_for: spawner/within.py
                    line = await reader.readline()
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("not a JSON object")
            except (asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError) as exc:
                await _send(writer, {"ok": False, "error": f"bad request: {exc}"})
                return
            try:
                reply = await self._handler(request, writer)
            except (KeyError, TypeError, ValueError) as exc:
                reply = {"ok": False, "error": f"bad request: {exc!r}"}
            if reply is not None:
                await _send(writer, reply)
        except (ConnectionError, OSError):
            pass  # the client went away
        finally:
            self._connections.discard(writer)
            writer.close()

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):
            writer.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self._server = None


def _same_user(writer: asyncio.StreamWriter) -> bool:
    sock = writer.get_extra_info("socket")
    try:
        _, uid, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        _CREDENTIALS.size))
    except (OSError, AttributeError):
        return True  # no credentials to check (the directory's mode still guards it)
    return uid in (os.getuid(), 0)


async def _send(writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
    writer.write(json.dumps(reply, default=str).encode() + b"\n")
    await writer.drain()


# --- the client (poprunctl) ---------------------------------------------------------------

class ControlError(Exception):
    """The job's launcher could not be asked (gone, not answering) or refused."""


def connect(path: str, request: dict[str, Any], timeout: float
            ) -> tuple[dict, socket.socket, bytes]:
    """Send `request`, read the reply line; the socket stays open for what follows (logs),
    whose first bytes (read with the reply) are returned too. Raises ControlError."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        line, rest = _read_line(sock)
    except (OSError, socket.timeout) as exc:
        sock.close()
        reason = "no answer in time" if isinstance(exc, socket.timeout) else (
            exc.strerror or str(exc))
        raise ControlError(f"cannot reach the job's launcher ({reason})") from None
    try:
        reply = json.loads(line)
    except ValueError:
        sock.close()
        raise ControlError("the launcher's answer is not JSON") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        sock.close()
        raise ControlError(str(reply.get("error") if isinstance(reply, dict) else reply)
                           or "refused")
    return reply, sock, rest


def ask(path: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    reply, sock, _ = connect(path, request, timeout)
    sock.close()
    return reply


def _read_line(sock: socket.socket, limit: int = 256 << 20) -> tuple[bytes, bytes]:
    data = bytearray()
    while True:
        at = data.find(b"\n")
        if at >= 0:
            return bytes(data[:at]), bytes(data[at + 1:])
        chunk = sock.recv(1 << 16)
        if not chunk:
            return bytes(data), b""
        data += chunk
        if len(data) > limit:
            raise OSError("answer too long")
