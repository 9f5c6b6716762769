"""This host's PMIx server for one attempt, in a process of its own (docs/architecture.md,
"The instances' worlds"): a fork of its spawner, `forked()` its start.

Forked by spawner/worlds/pmixhost.py, on the launcher's host by poprun and on the others by the
agent, with one end of a socket pair: the framed protocol of spawner/protocol.py
("spawner -> its PMIx server's process"). Whatever libpmix does here (wedge its thread,
free a fence tracker twice, abort the process on a second PMIx_server_init) stays here: the
spawner kills this process and removes its directories, and libpmix never runs in poprun.

Three threads: the main one reads the spawner's frames and makes every libpmix call (one at a
time, as the upcalls' answers); libpmix's own progress thread runs the upcalls
(spawner/worlds/pmixserver.py), which write the client events to the spawner at once and hand
fences and direct modex to the main thread; the gate's (spawner/worlds/pmixgate.py) lets only the
job's own instances reach libpmix. Writes to the spawner are whole frames under one lock.
The process ends when the spawner closes its end (or dies: the socket's EOF), at once, with
no PMIx_server_finalize (its wedge is what this process exists to contain).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
from typing import Any

from . import pmixplan
# At the process's start, not at PMIX_SERVE: it is started before the job has a name, and
# what it imports then is off the launch's path (ctypes and the gate's modules).
from .pmixgate import Gate
from .pmixserver import SERVER_MCA, PmixServer
from ..protocol import Control, FrameDecoder, Kind, ProtocolError, encode

MAX_REFUSALS_TOLD = 64  # PMIX_REFUSED frames per process: one per uid, and at most these
NAME = b"poprun-pmix"  # its /proc/PID/comm (15 bytes at most)


class ServerProcess:
    """The spawner's link and the server it drives."""

    def __init__(self, link: socket.socket) -> None:
        self._link = link
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self.server = None  # spawner.worlds.pmixserver.PmixServer, once PMIX_SERVE started it
        self._namespaces: dict[str, Any] = {}  # kvsname -> _Namespace
        self._told: set[int | None] = set()

    # --- to the spawner ------------------------------------------------------------------

    def post(self, kind: Kind, **fields: Any) -> None:
        """One frame to the spawner, from any thread (blocking: the spawner reads always)."""
        data = encode(kind, **fields)
        with self._lock:
            try:
                self._link.sendall(data)
            except OSError:
                os._exit(0)  # the spawner is gone: so is the job here

    def submit(self, fn, *args) -> None:
        self._work.put((fn, args))

    # --- from the spawner ----------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._read, name="poprun-pmix-link", daemon=True).start()
        while True:
            fn, args = self._work.get()
            fn(*args)

    def _read(self) -> None:
        decoder = FrameDecoder()
        while True:
            try:
                data = self._link.recv(1 << 20)
                if not data:
                    os._exit(0)  # the spawner closed its end, or died
                frames = decoder.feed(data)
            except (OSError, ProtocolError):
                os._exit(0)
            for frame in frames:
                if isinstance(frame, Control):
                    self.submit(self._handle, frame)

    def _handle(self, frame: Control) -> None:
        fields = frame.fields
        if frame.kind is Kind.PMIX_SERVE:
            self._answer(fields, self._serve)
        elif frame.kind is Kind.PMIX_OPEN:
            self._answer(fields, self._open)
        else:
            ns = self._namespaces.get(fields.get("kvsname"))
            if ns is not None:
                ns.from_spawner(frame.kind, fields)

    def _answer(self, fields: dict[str, Any], fn) -> None:
        try:
            result = fn(fields)
        except Exception as exc:  # noqa: BLE001 - the spawner reports it; nothing ran yet
            self.post(Kind.FAILED, id=fields.get("id"), error=f"{type(exc).__name__}: {exc}")
        else:
            self.post(Kind.REPLY, id=fields.get("id"), result=result)

    def _serve(self, fields: dict[str, Any]) -> dict[str, Any]:
        os.environ.update(SERVER_MCA)
        tmpdir = str(fields["tmpdir"])
        self.server = PmixServer(str(fields["libpmix"]), tmpdir, str(fields["hostname"]),
                                 self.submit)
        self.server.start()
        mark = fields.get("mark")
        gate = Gate(tmpdir, int(fields["owner"]), mark.encode() if mark else None,
                    self._refused)
        port = gate.take()
        gate.shut_early()
        gate.start()
        return {"version": self.server.version, "port": port}

    def _open(self, fields: dict[str, Any]) -> dict[str, Any]:
        world = pmixplan.World(str(fields["kvsname"]), [int(n) for n in fields["nodes"]],
                               [str(n) for n in fields["names"]], int(fields["here"]),
                               tuple(int(a) for a in fields.get("appnums") or ()))
        ns = _Namespace(self, world)
        # In the server's directory: the spawner, its lifeline and `poprunctl reap` remove it
        # with that (made again, private, where a /tmp cleaner took it meanwhile); private
        # before libpmix registers the namespace (a pip-only Open MPI's PMIx writes there).
        os.makedirs(self.server.tmpdir, 0o700, exist_ok=True)
        os.mkdir(pmixplan.nsdir(self.server.tmpdir, world.nspace), 0o700)
        ns.ns = self.server.open(world, ns)
        self._namespaces[world.nspace] = ns
        return {"env": {str(rank): ns.ns.client_env(rank) for rank in world.local_ranks}}

    def _refused(self, uid: int | None, why: str) -> None:
        if uid not in self._told and len(self._told) < MAX_REFUSALS_TOLD:
            self._told.add(uid)
            self.post(Kind.PMIX_REFUSED, uid=uid, why=why)


class _Namespace:
    """A world's namespace here, as its server's handler (spawner.worlds.pmixserver.Handler): what
    crosses hosts goes to the spawner, as an agent's does to the launcher."""

    def __init__(self, proc: ServerProcess, world: pmixplan.World) -> None:
        from .pmixuplink import Uplink

        self.proc, self.world, self.kvsname = proc, world, world.nspace
        self.ns = None  # spawner.worlds.pmixserver.Namespace
        self.uplink = Uplink(world.nspace, proc.post, len(world.names))
        self.fence, self.direct_modex = self.uplink.fence, self.uplink.direct_modex
        self.spawn = self.uplink.spawn
        self.unserved = self.uplink.unserved

    def name(self, request, done) -> None:
        from .pmixserver import name_status

        self.uplink.name(request, lambda rc, value: done(*name_status(rc, value)))

    def event(self, what: str, rank: int, *args) -> None:  # on libpmix's thread
        if what == "abort":
            status, message = args
            self.proc.post(Kind.MPI_ABORT, kvsname=self.kvsname, key=rank, exitcode=status,
                           message=message)
        else:
            self.proc.post(Kind.PMIX_CLIENT, kvsname=self.kvsname, key=rank, event=what)

    def from_spawner(self, kind: Kind, fields: dict[str, Any]) -> None:
        """FENCE_OUT, MODEX_DATA, NAMED, SPAWNED_ANSWER, MODEX_ASK, WORLD_END."""
        if kind is Kind.WORLD_END:
            import shutil  # here: its import (compression modules) is not the start's

            self.ns.close()
            shutil.rmtree(pmixplan.nsdir(self.proc.server.tmpdir, self.kvsname),
                          ignore_errors=True)
            self.proc._namespaces.pop(self.kvsname, None)
        elif kind is Kind.MODEX_ASK:
            self.proc.server.dmodex_request(self.kvsname, int(fields["rank"]),
                                            self.uplink.modex_got(fields["id"]))
        else:
            self.uplink.answered(kind, fields)


def forked(fd: int, mask: set[int]) -> None:
    """The server's process, in the child of its spawner's fork (spawner/worlds/pmixhost.py's
    `_fork`), with `fd` its end of the link and `mask` the signal mask to restore; never
    returns. What the fork copied of the spawner is made harmless first (its Python objects
    are out of the collector's reach already: `_fork`): its signal handlers and wakeup
    descriptor go, and every descriptor but the link and the standard ones is closed (a
    pipe of the spawner's held here would keep its readers, the lifeline's watchdog among
    them, waiting)."""
    os.setpgid(0, 0)  # its own group: the lifeline's, killed whole
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):  # the spawner's Python handlers
            signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    try:  # `ps` and the tests tell it from its spawner (same command line: a fork)
        with open("/proc/self/comm", "wb", buffering=0) as comm:
            comm.write(NAME)
    except OSError:
        pass
    # Stop signals are its spawner's business, never its own: Slurm signals every process
    # of a job step (`scancel --signal TERM`, a preemption's warning: proctrack linuxproc),
    # and a server that died of it lost its host's instances their world while they were
    # still in their stop window. It ends with its link, or by its spawner's SIGKILL.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    link = socket.socket(fileno=fd)
    link.setblocking(True)
    ServerProcess(link).run()
