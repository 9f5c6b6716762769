"""This host's PMIx service for one job, on the launcher and on an agent alike
(docs/architecture.md, "The instances' worlds"): one PMIx server process per attempt (a
fork of this one: `_fork`, spawner/worlds/pmixproc.py), started here and driven over a socket
pair in the framed protocol (spawner/protocol.py, "spawner -> its PMIx server's process").

libpmix never runs in this process: a server that wedges, crashes or aborts costs its
attempt's world, never poprun or the agent. Its death while its world is open is reported to
the world's owner (`Handler.server_lost`, with its signal); its end is a SIGKILL, with no
PMIx_server_finalize (where libpmix's thread wedges or frees a tracker twice). Each server
gets a private 0700 directory (libpmix's files, and the gate's Unix socket:
spawner/worlds/pmixgate.py) and each world a private directory in /dev/shm for Open MPI's
segments, both registered with the lifeline before they exist; the server's process group
too (a fork cannot show the helpers' mark: the sweep between attempts spares its pid, and it
ends at its link's EOF when its owner dies): a SIGKILLed owner leaves none of them.

The first server's process is started as soon as the launch knows it serves PMIx (right
after the lifeline's fork), libpmix's server in it as soon as the job has a name, and the
next attempt's as the previous one is cleaned up: their start (a fork, the server's own
imports and libpmix's initialisation: ~30 ms of CPU on the loaded machine here, ~80 with a
new Python; bench/pmix_start_bench.py) is off the launch's path where the launch's own
set-up takes longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import select
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

from . import pmixplan
from ..containment import spare_child, unspare_child
from ..protocol import Control, FrameDecoder, Kind, ProtocolError, encode
from ..within import within
from .pmixplan import ERROR, SUCCESS

START_TIMEOUT = 30.0  # seconds for a server to start and to register a world
MAX_FRAME_BACKLOG = 256 << 20  # bytes from a server not yet a whole frame
KILL_WAIT = 1.0  # seconds to wait for a SIGKILLed server to be reaped
EXITING_WAIT = 0.05  # seconds to wait for a server whose link closed to be reaped


class PmixServerError(RuntimeError):
    pass


class Handler:
    """What a world's owner answers (in the event loop)."""

    def fence(self, fence: pmixplan.FenceId, data: bytes,
              done: Callable[[int, bytes], None]) -> None:
        """This host's instances all entered `fence` with `data`; `done(status, all hosts'
        data)` once every host taking part has."""

    def direct_modex(self, rank: int, done: Callable[[int, bytes], None]) -> None:
        """An instance here wants `rank`'s data, which is on another host."""

    def abort(self, rank: int, status: int, message: str) -> None:
        """An instance here called MPI_Abort."""

    def pmix_name(self, fields: dict[str, Any], done: Callable[[int, str], None]) -> None:
        """A NAME from the server (an instance here publishes, looks up or unpublishes a
        name): `done(rc, port or why)` once the job's table answered."""

    def unserved(self, rank: int, cmd: str, why: str) -> None:
        """Instance `rank`'s request `cmd` was answered with an error at once (-v)."""

    def server_lost(self, reason: str) -> None:
        """The server died while the world was open (`reason`: how, with its signal)."""

    def spawn(self, rank: int, request: dict, done: Callable[[dict], None]) -> None:
        """An instance here called PMIx_Spawn (`request`: a SPAWN_ASK's, {"pmix": ...});
        `done(reply)` with spawn_reply's fields, the new world's name as `world`."""


class Served:
    """One world's namespace on this host's server, as its owner sees it."""

    def __init__(self, server: _Server, world: pmixplan.World, handler: Handler,
                 beside: bool = False) -> None:
        self.server, self.world, self.handler = server, world, handler
        self.beside = beside  # on the server of another world (a spawned one's: its parents')
        self.env: dict[int, dict[str, str]] = {}
        self.connected: set[int] = set()
        self.finalized: set[int] = set()

    def lost_on_exit(self, rank: int) -> bool:
        """`rank`'s instance exited: whether it had joined the world here and not left it
        properly (no MPI_Finalize), so that its peers lost it. True once a rank (the one
        place this is decided, for the launcher's host and an agent's alike). What the
        server said before the instance was released is read first: its exit cannot have
        overtaken its "finalized"."""
        self.server.drain()
        if rank not in self.connected or rank in self.finalized:
            return False
        self.finalized.add(rank)  # said once
        return True


class _Server:
    """One server process and its link."""

    def __init__(self, host: PmixHost) -> None:
        """Start the process (a fork, importing the gate's and libpmix's modules) before the
        job's name (and so the server's directory) is known; `serve()` then starts libpmix's
        server there."""
        self.host, self.loop = host, host.loop
        self.tmpdir: str | None = None
        ours, theirs = socket.socketpair()
        try:
            self.proc = _fork(theirs.fileno())
        finally:
            theirs.close()
        # Killed with its owner; spared by the sweep between attempts (where a helper is
        # known by its mark, which a fork's environment cannot show).
        if host._lifeline is not None:
            host._lifeline.add_group(self.proc.pid)
        spare_child(self.proc.pid)
        self.link = ours
        ours.setblocking(False)
        self._decoder = FrameDecoder()
        self._out = bytearray()
        self._writing = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._asks: dict[int, Callable[[int, bytes], None]] = {}
        self.worlds: dict[str, Served] = {}
        self.dead: str | None = None  # how it ended, once it has
        self.version = ""
        self._ready: asyncio.Task | None = None
        self.loop.add_reader(ours.fileno(), self._readable)

    def serve(self, kvsname: str) -> None:
        """Start libpmix's server in it, in a directory named after the job of `kvsname`."""
        if self._ready is not None:
            return
        self.tmpdir = self.host._make_dir(kvsname, tmp=True)
        lifeline = self.host._lifeline  # its token marks the job's instances
        mark = "=".join(lifeline.mark) if lifeline is not None else None
        # Sent now, not when the task first runs: libpmix's initialisation overlaps the
        # launch's own set-up until it awaits the world (~60 ms at load ~20: bench/README.md,
        # "Open MPI's wire-up and PMIx's cost").
        asked = self._ask(Kind.PMIX_SERVE, dict(
            libpmix=self.host.path, tmpdir=self.tmpdir, hostname=self.host.hostname,
            owner=os.getpid(), mark=mark))
        self._ready = self.loop.create_task(self._served(*asked))
        # Its failure is raised by `ready()`; one never awaited (a prestart the job did not
        # use) is not an error to report.
        self._ready.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _served(self, ident: int, future: asyncio.Future) -> None:
        result = await self._answer(ident, future)
        self.version = str(result.get("version") or "")

    async def ready(self) -> None:
        await self._ready

    # --- requests ------------------------------------------------------------------------

    async def request(self, kind: Kind, **fields: Any) -> dict[str, Any]:
        return await self._answer(*self._ask(kind, fields))

    def _ask(self, kind: Kind, fields: dict[str, Any]) -> tuple[int, asyncio.Future]:
        """`kind` sent now; its id, and the future of its answer (`_answer` awaits it)."""
        future = self.loop.create_future()
        if self.dead is not None:
            future.set_exception(PmixServerError(self.dead))
            return 0, future
        ident = next(self._ids)
        self._waiting[ident] = future
        self.send(kind, id=ident, **fields)
        return ident, future

    async def _answer(self, ident: int, future: asyncio.Future) -> dict[str, Any]:
        try:
            return await within(future, START_TIMEOUT)  # never wait_for: spawner/within.py
        except TimeoutError:
            self.kill(f"its PMIx server did not answer within {START_TIMEOUT:g} s")
            raise PmixServerError(self.dead) from None
        finally:
            self._waiting.pop(ident, None)

    def send(self, kind: Kind, **fields: Any) -> None:
        if self.dead is not None:
            return
        self._out += encode(kind, **fields)
        self._flush()

    def _flush(self) -> None:
        try:
            sent = self.link.send(self._out) if self._out else 0
            del self._out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._out.clear()
        if self._out and not self._writing:
            self._writing = True
            self.loop.add_writer(self.link.fileno(), self._flush)
        elif not self._out and self._writing:
            self._writing = False
            self.loop.remove_writer(self.link.fileno())

    # --- what the server says ------------------------------------------------------------

    def drain(self) -> None:
        """Handle whatever the server has written so far (not waiting for more)."""
        if self.dead is None:
            self._readable()

    def _readable(self) -> None:
        while self.dead is None:
            try:
                data = self.link.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._gone()
                return
            try:
                frames = self._decoder.feed(data)
                if self._decoder.pending > MAX_FRAME_BACKLOG:
                    raise ProtocolError("a frame too large")
            except ProtocolError as exc:
                self.kill(f"its PMIx server broke its protocol ({exc})")
                return
            for frame in frames:
                if isinstance(frame, Control):
                    try:
                        self._handle(frame.kind, frame.fields)
                    except (KeyError, TypeError, ValueError) as exc:
                        self.kill(f"its PMIx server sent a bad {frame.kind.name} ({exc})")
                        return

    def _handle(self, kind: Kind, fields: dict[str, Any]) -> None:
        if kind in (Kind.REPLY, Kind.FAILED):
            future = self._waiting.get(int(fields["id"]))
            if future is not None and not future.done():
                if kind is Kind.REPLY:
                    future.set_result(dict(fields["result"]))
                else:
                    future.set_exception(PmixServerError(str(fields.get("error"))[:500]))
            return
        if kind is Kind.PMIX_REFUSED:
            self.host.refused(fields.get("uid"), str(fields.get("why"))[:200])
            return
        served = self.worlds.get(fields.get("kvsname"))
        if served is None:
            return
        if kind is Kind.PMIX_CLIENT:
            rank = int(fields["key"])
            (served.connected if fields["event"] == "connected" else served.finalized).add(rank)
        elif kind is Kind.MPI_ABORT:
            served.handler.abort(int(fields["key"]), int(fields["exitcode"]),
                                 str(fields.get("message", "")))
        elif kind is Kind.FENCE_IN:
            fence = pmixplan.fence_of(fields)
            data = pmixplan.decode_data(fields["data"], pmixplan.MAX_FENCE_DATA)
            sets = {"sets": pmixplan.sets_json(fence.sets)} if fence.sets else {}
            served.handler.fence(fence, data, lambda status, blob: self.send(
                Kind.FENCE_OUT, kvsname=served.world.nspace, ranks=list(fence.ranks),
                seq=fence.seq, **sets, **({"data": pmixplan.b64(blob)} if status == SUCCESS
                                          else {"error": f"status {status}"})))
        elif kind is Kind.MODEX_WANT:
            want = int(fields["id"])
            served.handler.direct_modex(int(fields["rank"]), lambda status, blob: self.send(
                Kind.MODEX_DATA, kvsname=served.world.nspace, id=want, status=status,
                data=pmixplan.b64(blob)))
        elif kind is Kind.SPAWN_ASK:
            rank, ask = int(fields["key"]), int(fields["id"])
            if rank not in served.world.local_ranks:
                raise ValueError(f"a spawn for rank {rank}, not one of this host's")
            served.handler.spawn(rank, dict(fields["request"]), lambda reply: self.send(
                Kind.SPAWNED_ANSWER, kvsname=served.world.nspace, id=ask, reply=reply))
        elif kind is Kind.NAME:
            ask = int(fields["id"])
            served.handler.pmix_name(fields, lambda rc, value: self.send(
                Kind.NAMED, kvsname=served.world.nspace, id=ask, rc=rc, value=value))
        elif kind is Kind.PMI_UNSERVED:
            served.handler.unserved(int(fields["key"]), str(fields["cmd"])[:64],
                                    str(fields.get("why"))[:200])
        elif kind is Kind.MODEX_GOT:
            done = self._asks.pop(int(fields["id"]), None)
            if done is not None:
                done(int(fields["status"]), pmixplan.decode_data(fields.get("data") or "",
                                                           pmixplan.MAX_MODEX))

    def dmodex_request(self, served: Served, rank: int,
                       done: Callable[[int, bytes], None]) -> None:
        if self.dead is not None:
            done(ERROR, b"")
            return
        ask = next(self._ids)
        self._asks[ask] = done
        self.send(Kind.MODEX_ASK, kvsname=served.world.nspace, id=ask, rank=rank)

    # --- its end -------------------------------------------------------------------------

    def _gone(self) -> None:
        """Its end of the link closed: it died (or is dying). How, once it is reaped."""
        self._stop_reading()
        self.dead = "its PMIx server ended"
        # It is exiting: known now, the instances' exits it causes are not its cause.
        if self.proc.wait(EXITING_WAIT) is not None:
            self._ended(_how(self.proc.returncode))
            return
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except OSError:  # reaped already
            self._ended(_how(self.proc.wait()))
            return

        def reaped() -> None:
            self.loop.remove_reader(pidfd)
            os.close(pidfd)
            self._ended(_how(self.proc.wait()))

        self.loop.add_reader(pidfd, reaped)

    def _ended(self, how: str) -> None:
        self.dead = f"its PMIx server {how}"
        self._fail_waiting()
        for served in list(self.worlds.values()):
            served.handler.server_lost(self.dead)

    def _fail_waiting(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(PmixServerError(self.dead))
        for done in list(self._asks.values()):
            done(ERROR, b"")
        self._asks.clear()

    def _stop_reading(self) -> None:
        if self.link.fileno() >= 0:
            self.loop.remove_reader(self.link.fileno())
            if self._writing:
                self.loop.remove_writer(self.link.fileno())
                self._writing = False

    def kill(self, why: str | None = None) -> None:
        """SIGKILL it and reap it (bounded); `why`: it failed, and its worlds are told."""
        self._stop_reading()
        worlds = list(self.worlds.values())
        if why is None:
            self.worlds.clear()  # ended by us: nobody's loss
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait(KILL_WAIT)
        self.link.close()
        if self.dead is None:
            self.dead = why or "its PMIx server was stopped"
            self._fail_waiting()
            if why is not None:
                for served in worlds:
                    served.handler.server_lost(why)
        if self.host._lifeline is not None:
            self.host._lifeline.discard_group(self.proc.pid)
        unspare_child(self.proc.pid)
        if self.tmpdir is not None:
            self.host._remove(self.tmpdir)


def _usable_cpus() -> int:
    """The CPUs this host's instances may run on: this process's (they inherit it)."""
    try:
        return len(os.sched_getaffinity(0))
    except OSError:
        return os.cpu_count() or 1


class PmixHost:
    def __init__(self, path: str, lifeline, hostname: str,
                 loop: asyncio.AbstractEventLoop, given: str | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
        """`given`: the libpmix the user named (--libpmix), for the agents too; `warn`:
        where a refused connection is said (once per uid)."""
        self.path, self.hostname, self.loop = path, hostname, loop
        self.given, self._warn = given, warn
        self._lifeline = lifeline
        self._next: _Server | None = None  # started, for the next world
        self._servers: list[_Server] = []
        self._shm: dict[str, str] = {}  # nspace -> its segments' directory
        self._refused: set = set()
        self.version = ""

    def spawn(self) -> None:
        """Start the next world's server process now (Python's start, its imports), before
        the job has a name: as early in the launch as a libpmix is known."""
        if self._next is None:
            self._next = _Server(self)
            self._servers.append(self._next)

    def prestart(self, kvsname: str) -> None:
        """Start the next world's server now, while the launch prepares the rest.
        `kvsname`: any of the job's (its directory is named after the job, for `poprunctl
        reap`: spawner/reaphere.pmix_prefixes)."""
        self.spawn()
        self._next.serve(kvsname)

    def _make_dir(self, kvsname: str, tmp: bool) -> str:
        from ..reaphere import pmix_prefixes

        prefix = pmix_prefixes(kvsname)[0 if tmp else 1]
        parent, name = os.path.dirname(prefix), os.path.basename(prefix)
        if self._lifeline is not None:
            return self._lifeline.make_temp_dir(name, parent)
        import tempfile

        return tempfile.mkdtemp(prefix=name, dir=parent)

    async def open(self, world: pmixplan.World, handler: Handler,
                   beside: Served | None = None) -> Served:
        """`world`'s namespace here, on a server of its own, or on `beside`'s (a spawned
        world's, on its parents': libpmix serves their connect and each other's data only
        where it holds both namespaces)."""
        if beside is None:
            self.prestart(world.nspace)
            server, self._next = self._next, None
            await server.ready()
        else:
            server = beside.server
        self.version = server.version
        self._shm[world.nspace] = self._make_dir(world.nspace, tmp=False)
        served = Served(server, world, handler, beside is not None)
        server.worlds[world.nspace] = served
        result = await server.request(Kind.PMIX_OPEN, kvsname=world.nspace,
                                      appnums=list(world.appnums),
                                      nodes=list(world.nodes), names=list(world.names),
                                      here=world.here)
        env = result["env"]
        served.env = {rank: {str(k): str(v) for k, v in dict(env[str(rank)]).items()}
                      for rank in world.local_ranks}
        return served

    def instance_env(self, served: Served, rank: int,
                     environ: Mapping[str, str] | None) -> dict[str, str]:
        """Every variable that leads `rank` to its server, and what Open MPI's mpirun would
        set for this host (pmixplan.instance_variables)."""
        return {**served.env[rank],
                **pmixplan.instance_variables(dict(environ or {}), self._shm[served.world.nspace],
                                              len(served.world.local_ranks), _usable_cpus())}

    def dmodex_request(self, served: Served, rank: int,
                       done: Callable[[int, bytes], None]) -> None:
        """Another host asks for local `rank`'s data: `done(status, data)` once the server
        has it (when that instance has put it: the request waits)."""
        served.server.dmodex_request(served, rank, done)

    def refused(self, uid, why: str) -> None:
        if self._warn is not None and uid not in self._refused:
            self._refused.add(uid)
            self._warn(f"PMIx: a connection to the job's PMIx server was refused "
                             f"unread: {why}")

    def close_world(self, served: Served) -> None:
        """The world's instances are gone: its server and segments go (a world on another's
        server: its namespace, the server staying for that one)."""
        if served.beside:
            served.server.worlds.pop(served.world.nspace, None)
            served.server.send(Kind.WORLD_END, kvsname=served.world.nspace)
        else:
            served.server.kill()
        path = self._shm.pop(served.world.nspace, None)
        if path is not None:
            self._remove(path)

    def _remove(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        if self._lifeline is not None:
            self._lifeline.discard_dir(path)

    def close(self) -> None:
        """The job ends: every server and directory goes."""
        for server in self._servers:
            if server.link.fileno() >= 0 or server.proc.returncode is None:
                server.kill()
        self._servers.clear()
        self._next = None
        for path in list(self._shm.values()):
            self._remove(path)
        self._shm.clear()


class _Child:
    """A server's process as its spawner reaps it (what pmixhost used of subprocess.Popen)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None  # as Popen's: -N once killed by signal N

    def wait(self, timeout: float | None = None) -> int | None:
        """Its returncode once it has ended, waiting at most `timeout` s (None: for ever);
        None if it still runs then."""
        if self.returncode is None:
            if timeout:
                try:
                    pidfd = os.pidfd_open(self.pid)
                except OSError:
                    pidfd = None
                if pidfd is not None:
                    try:
                        select.select([pidfd], [], [], timeout)
                    finally:
                        os.close(pidfd)
            try:
                pid, status = os.waitpid(self.pid, 0 if timeout is None else os.WNOHANG)
            except ChildProcessError:  # reaped by a final sweep: its status went with it
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _fork(fd: int) -> _Child:
    """The server's process: a fork of this one, which becomes it (pmixproc.forked) with
    `fd` as its end of the link. A fork, not a new Python: the interpreter's start and the
    modules its spawner has imported already were most of a server's start (~45 of ~80 ms
    of CPU; bench/README.md, "Open MPI's wire-up and PMIx's cost"), and on the path of the
    first instances' MPI_Init wherever the launch reached its world before the server was
    up. Every signal waits until the child has replaced the handlers it inherited: a
    Ctrl-C for the terminal's group must not run poprun's in it."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        with contextlib.suppress(Exception):
            stream.flush()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        pid = os.fork()
        if pid == 0:  # the server's process; never returns
            try:
                # First: a copy of a socket of ours that the collector would close here
                # (garbage not yet collected at the fork) would close a descriptor number
                # that the server has reused by then.
                gc.freeze()
                from . import pmixproc

                pmixproc.forked(fd, mask)
            except BaseException:  # noqa: BLE001 - said, and the link's EOF tells its spawner
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with contextlib.suppress(OSError):  # here too: whichever runs first makes the group
        os.setpgid(pid, pid)
    return _Child(pid)


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"
