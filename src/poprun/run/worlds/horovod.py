"""Horovod's Gloo rendezvous: what `horovodrun --gloo` serves its
processes, served by poprun, so that `hvd.init()` in the instances forms one world on a host
without MPI. The instances find it through `HOROVOD_GLOO_RENDEZVOUS_ADDR`/`_PORT`
(popdist/env.py) and speak HTTP to it, one connection per request (horovod 0.28:
horovod/common/gloo/http_store.cc, third_party/HTTPRequest; the server side is
horovod/runner/http/http_server.py):

- `PUT /<scope>/<key>`, the body the value (raw bytes): stored, 200.
- `GET /<scope>/<key>`: 200 and the value, or 404 at once when it is not there (the client
  polls every 10 ms until it is; a 5xx makes it fail after three tries).
- `DELETE /<scope>/<key>`: 200. In a scope of known size (`global`, `local_<host>`,
  `cross_<local rank>`) it marks the key's rank done (a key the scope holds; any other
  name changes nothing) and, once every rank is, the scope is
  emptied (a later `hvd.init()` starts afresh); elsewhere (process sets) the key goes.
- Every reply says `Content-Length`, spelt so: the client reads the body by it.

A job that does not use Horovod pays for a listening socket: the server starts at the first
connection. Poprun's address is the one its hosts reach it at (as MASTER_ADDR's).

Anyone who reaches that address can connect (another local user; any host, for a multi-host
job's), unauthenticated, as with horovodrun's own: what arrives is hostile input. So a
request is parsed strictly and anything else gets a 4xx and a closed connection (nothing a
client sends reaches the launch's exception handler); at most `MAX_CONNECTIONS` are served at
once (the others wait in the kernel's backlog, costing poprun no descriptor), each within
`DEADLINE` seconds from its accept; a value holds at most `MAX_VALUE` bytes and the store
`MAX_STORE` (413 past either).
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Mapping, Sequence

from popdist import env as E

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Content Too Large"}
# A Gloo address list is ~136 bytes a rank; a store of 16 MiB holds every scope of a job of
# tens of thousands of ranks. Each entry also costs its key and ENTRY_COST (what a dict entry
# and its bytes objects take), so that a flood of tiny keys is bounded as well.
MAX_VALUE = 64 << 10  # bytes
MAX_STORE = 16 << 20  # bytes
ENTRY_COST = 256  # bytes
MAX_HEAD = 8 << 10  # bytes: the request line and headers (Horovod's are ~100)
MAX_CONNECTIONS = 128  # served at once; a non-root user's soft limit is 1,024 descriptors
DEADLINE = 10.0  # seconds from accept to the reply sent (Horovod sends its request at once)
# After the reply, what a client sent past its request is read and dropped until its EOF, at
# most this many bytes and seconds (`_linger`)
LINGER_BYTES = 1 << 20
LINGER = 2.0

_REQUEST_LINE = re.compile(r"([A-Z]+) (/[^/ ]+/[^/ ]+) HTTP/1\.[01]")
_LENGTH = re.compile(r"[0-9]{1,19}")  # ASCII digits only ('²' is isdigit() but no int)


class BadRequest(Exception):
    """A request that is not one a Horovod client sends: its status (4xx)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Store:
    """The key-value store, by scope; pure. `sizes`: the scopes of known size. It holds at
    most `limit` bytes (each entry's scope, key and value, and ENTRY_COST)."""

    def __init__(self, sizes: Mapping[str, int], limit: int = MAX_STORE) -> None:
        self.sizes = dict(sizes)
        self.values: dict[str, dict[str, bytes]] = {}
        self._done: dict[str, set[str]] = {}
        self.limit, self.used = limit, 0

    def put(self, scope: str, key: str, value: bytes) -> bool:
        """Store it; False (nothing changed) where it would take the store past its limit."""
        values = self.values.get(scope, {})
        old = values.get(key)
        grown = _cost(scope, key, value) - (0 if old is None else _cost(scope, key, old))
        if self.used + grown > self.limit:
            return False
        self.values.setdefault(scope, values)[key] = value
        self.used += grown
        return True

    def get(self, scope: str, key: str) -> bytes | None:
        return self.values.get(scope, {}).get(key)

    def delete(self, scope: str, key: str) -> None:
        if scope in self.sizes:
            # Only a key the scope holds counts toward its size (each rank deletes the key it
            # put): a DELETE of any other name costs nothing and cannot empty the scope.
            if key not in self.values.get(scope, {}):
                return
            done = self._done.setdefault(scope, set())
            done.add(key)
            if len(done) >= self.sizes[scope]:
                self._drop_scope(scope)
                done.clear()
            return
        values = self.values.get(scope, {})
        if key in values:
            self.used -= _cost(scope, key, values.pop(key))
        if not values:
            self.values.pop(scope, None)

    def _drop_scope(self, scope: str) -> None:
        for key, value in self.values.pop(scope, {}).items():
            self.used -= _cost(scope, key, value)


def _cost(scope: str, key: str, value: bytes) -> int:
    return len(scope) + len(key) + len(value) + ENTRY_COST


def scope_sizes(instances: Sequence[Mapping[str, str]]) -> dict[str, int]:
    """The scopes of known size, as horovodrun declares them (global, each host's local
    scope, each local rank's cross scope), from the variables the plan gave each instance:
    the ranks are the planner's (popdist/env.horovod_environment), not worked out again."""
    sizes = {"global": len(instances)}
    for env in instances:
        sizes[f"local_{env[E.HOROVOD_HOSTNAME]}"] = int(env[E.HOROVOD_LOCAL_SIZE])
        sizes[f"cross_{env[E.HOROVOD_LOCAL_RANK]}"] = int(env[E.HOROVOD_CROSS_SIZE])
    return sizes


def parse_head(head: bytes) -> tuple[str, str, str, int]:
    """The request line and headers (up to the blank line) as (method, scope, key, body
    length); BadRequest for anything a Horovod client would not send."""
    lines = head.decode("latin-1").split("\r\n")
    request = _REQUEST_LINE.fullmatch(lines[0])
    if request is None:
        raise BadRequest(400)
    lengths = set()
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        name = name.strip().lower()
        if not colon or not name:
            raise BadRequest(400)
        if name == "transfer-encoding":  # a body of unknown length: never Horovod's
            raise BadRequest(400)
        if name == "content-length":
            if not _LENGTH.fullmatch(value.strip()):
                raise BadRequest(400)
            lengths.add(int(value.strip()))
    if len(lengths) > 1:
        raise BadRequest(400)
    length = lengths.pop() if lengths else 0
    if length > MAX_VALUE:
        raise BadRequest(413)
    _, scope, key = request.group(2).split("/")
    return request.group(1), scope, key, length


class Rendezvous:
    """The listening socket of one launch, and its server once an instance connects."""

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.store = Store({})
        self._sock = socket.create_server((address, 0), backlog=128)
        self._sock.setblocking(False)
        self.address = (address, self._sock.getsockname()[1])
        self._accepting: asyncio.Task | None = None
        self._served: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        loop.add_reader(self._sock.fileno(), self._first_connection)

    def new_world(self, instances: Sequence[Mapping[str, str]]) -> None:
        """An attempt's instances (each one's planned variables): the store starts empty."""
        self.store = Store(scope_sizes(instances))

    def _first_connection(self) -> None:
        self.loop.remove_reader(self._sock.fileno())
        self._accepting = self.loop.create_task(self._accept())

    async def _accept(self) -> None:
        """Accept while a slot is free: past MAX_CONNECTIONS the others wait in the backlog
        (a descriptor each only once accepted)."""
        while True:
            await self._slots.acquire()
            try:
                conn, _ = await self.loop.sock_accept(self._sock)
            except OSError:  # out of descriptors (the job's other files) or a reset: later
                self._slots.release()
                await asyncio.sleep(0.1)
                continue
            task = self.loop.create_task(self._serve(conn))
            self._served.add(task)
            task.add_done_callback(self._served.discard)

    async def _serve(self, conn: socket.socket) -> None:
        writer = None
        try:
            async with asyncio.timeout(DEADLINE):
                reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_HEAD)
                status, body = await self._answer(reader)
                writer.write(b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nConnection: close\r\n"
                             b"\r\n" % (status, _REASONS[status].encode(), len(body)) + body)
                await writer.drain()
                await _linger(reader, writer)
        except (OSError, EOFError, TimeoutError, asyncio.LimitOverrunError,
                asyncio.IncompleteReadError):
            pass  # gone, too slow or too long: closed, nothing to answer
        finally:
            if writer is not None:
                writer.close()
            else:
                conn.close()
            self._slots.release()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return 400, b""
        try:
            method, scope, key, length = parse_head(head[:-4])
        except BadRequest as bad:
            return bad.status, b""
        body = await reader.readexactly(length) if length else b""
        if method == "GET":
            value = self.store.get(scope, key)
            return (404, b"") if value is None else (200, value)
        if method == "PUT":
            return (200, b"") if self.store.put(scope, key, body) else (413, b"")
        if method == "DELETE":
            self.store.delete(scope, key)
            return 200, b""
        return 405, b""

    async def close(self) -> None:
        if self._accepting is None:
            self.loop.remove_reader(self._sock.fileno())
        tasks = [t for t in (self._accepting, *self._served) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.close()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Our end closed for writing after the reply, then the client's bytes past its request
    (a GET's body without Content-Length, say) read and dropped until its EOF, bounded by
    LINGER_BYTES and LINGER: a socket closed with bytes unread sends a reset, which can
    discard the reply before the client reads it (HTTP servers' "lingering close")."""
    if not writer.can_write_eof():
        return
    writer.write_eof()
    left = LINGER_BYTES
    async with asyncio.timeout(LINGER):
        while left > 0:
            chunk = await reader.read(min(left, 64 << 10))
            if not chunk:
                return
            left -= len(chunk)
