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
  `cross_<local rank>`) it marks the key's rank done and, once every rank is, the scope is
  emptied (a later `hvd.init()` starts afresh); elsewhere (process sets) the key goes.
- Every reply says `Content-Length`, spelt so: the client reads the body by it.

A job that does not use Horovod pays for a listening socket: the server starts at the first
connection. Poprun's address is the one its hosts reach it at (as MASTER_ADDR's).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping, Sequence

from popdist import env as E

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
MAX_VALUE = 64 << 20  # bytes: a Gloo address list is ~136 bytes a rank


class Store:
    """The key-value store, by scope; pure. `sizes`: the scopes of known size."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.values: dict[str, dict[str, bytes]] = {}
        self._done: dict[str, set[str]] = {}

    def put(self, scope: str, key: str, value: bytes) -> None:
        self.values.setdefault(scope, {})[key] = value

    def get(self, scope: str, key: str) -> bytes | None:
        return self.values.get(scope, {}).get(key)

    def delete(self, scope: str, key: str) -> None:
        if scope in self.sizes:
            done = self._done.setdefault(scope, set())
            done.add(key)
            if len(done) >= self.sizes[scope]:
                self.values.pop(scope, None)
                done.clear()
            return
        values = self.values.get(scope, {})
        values.pop(key, None)
        if not values:
            self.values.pop(scope, None)


def scope_sizes(instances: Sequence[Mapping[str, str]]) -> dict[str, int]:
    """The scopes of known size, as horovodrun declares them (global, each host's local
    scope, each local rank's cross scope), from the variables the plan gave each instance:
    the ranks are the planner's (popdist/env.horovod_environment), not worked out again."""
    sizes = {"global": len(instances)}
    for env in instances:
        sizes[f"local_{env[E.HOROVOD_HOSTNAME]}"] = int(env[E.HOROVOD_LOCAL_SIZE])
        sizes[f"cross_{env[E.HOROVOD_LOCAL_RANK]}"] = int(env[E.HOROVOD_CROSS_SIZE])
    return sizes


class Rendezvous:
    """The listening socket of one launch, and its server once an instance connects."""

    def __init__(self, address: str, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.store = Store({})
        self._sock = socket.create_server((address, 0), backlog=128)
        self._sock.setblocking(False)
        self.address = (address, self._sock.getsockname()[1])
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Task | None = None
        loop.add_reader(self._sock.fileno(), self._first_connection)

    def new_world(self, instances: Sequence[Mapping[str, str]]) -> None:
        """An attempt's instances (each one's planned variables): the store starts empty."""
        self.store = Store(scope_sizes(instances))

    def _first_connection(self) -> None:
        self.loop.remove_reader(self._sock.fileno())
        self._starting = self.loop.create_task(self._serve())

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, sock=self._sock)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body = await self._answer(reader)
            writer.write(b"HTTP/1.1 %d %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % (status, _REASONS[status].encode(), len(body)) + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return 400, b""
        method, path = parts[0], parts[1].split("/")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip() or 0)
        if length > MAX_VALUE or len(path) != 3 or path[0]:
            return 400, b""
        body = await reader.readexactly(length) if length else b""
        scope, key = path[1], path[2]
        if method == "GET":
            value = self.store.get(scope, key)
            return (404, b"") if value is None else (200, value)
        if method == "PUT":
            self.store.put(scope, key, body)
            return 200, b""
        if method == "DELETE":
            self.store.delete(scope, key)
            return 200, b""
        return 405, b""

    async def close(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        elif self._starting is None:
            self.loop.remove_reader(self._sock.fileno())
        self._sock.close()
