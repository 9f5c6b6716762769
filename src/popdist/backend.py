"""PopDist's host-side collectives backend: this instance's membership of the job's MPI world.

What Graphcore's popdist means by it (PopART's python/popart/_popdist_backend_manager.py):
`popdist.init()` registers and initialises PopDist's default backend, MPI-based, and has it
finalised at exit; `isBackendInitialized()` says whether one is initialised (PopART 3.1's
sessions ask before calling `popdist.init()` themselves); `finalizeBackend()` finalises it
(graphcore/tensorflow's PopDistStrategy tests call it). Frameworks then run their host
collectives (allreduce, broadcast) over that MPI world.

Here that world is the one poprun serves the job over PMI-1 (run/worlds/pmi1.py), which MPICH
programs join at MPI_Init. `initialize()` joins it as they do, on the instance's own socket
(`PMI_FD`): `init` (answered `response_to_init rc=0`), then `get_my_kvsname` (the world's
name); `finalize()` leaves it (`finalize`, answered `finalize_ack`), and an exit handler
does so at the latest. The socket is read and written as it is, never closed: MPICH's
MPI_Init in the same process speaks on the same one, before or after. No barrier: a barrier
would make `popdist.init()` wait for every instance, and would put the barriers of an MPI
library sharing the socket out of step where not every instance calls it.

Open MPI joins no PMI-1 world: it wires up only through PMIx, which poprun serves apart
(`PMIX_NAMESPACE` and the other PMIX_* variables). Where Open MPI's library is loaded in this
process and poprun served it no PMIx world (`--mpi-worlds pmi1`, or no libpmix found), its
MPI_Init makes a world of one whatever the PMI-1 world holds: popdist then claims no world
either (`initialize()` returns False, `initialized()` is False, also when Open MPI is loaded
after `popdist.init()`), so that the backend agrees with the world the frameworks' MPI has.

Without a world (outside poprun; a job whose instances get none, see run/worlds/pmi1.py; a
process poprun did not start itself, which lacks the socket) there is nothing to join:
`initialize()` returns False and the backend stays uninitialised.
"""

from __future__ import annotations

import atexit
import os
import select
import stat

from popdist import env

__all__ = ["initialize", "initialized", "finalize"]

REPLY_TIMEOUT = 60.0  # seconds: poprun answers at once; silence means it is gone
OPEN_MPI_LIBRARY = b"/libmpi.so.40"  # Open MPI 4 and 5's soname (MPICH's is libmpi.so.12)
_MAX_REPLY = 4096


class _Membership:
    """This process's place in the world, once it joined."""

    def __init__(self, fd: int, identity: tuple[int, int], kvsname: str) -> None:
        self.pid = os.getpid()
        self.fd, self.identity, self.kvsname = fd, identity, kvsname
        self.finalized = False


_joined: _Membership | None = None


def initialized() -> bool:
    """Whether this process has joined its job's world and not left it (and that world is
    the one its MPI has: _open_mpi_alone)."""
    return _mine() is not None and not _joined.finalized and not _open_mpi_alone()


def initialize() -> bool:
    """Join the job's world (once; again is a no-op). False where there is none to join."""
    global _joined
    if _open_mpi_alone():
        return False
    if _mine() is not None:
        if _joined.finalized:
            raise RuntimeError("popdist.init(): the backend was finalised in this process; "
                               "as with MPI, it cannot be initialised again")
        return True
    fd = _world_socket()
    if fd is None:
        return False
    _request(fd, "cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")
    kvsname = _request(fd, "cmd=get_my_kvsname", "my_kvsname").get("kvsname", "")
    _joined = _Membership(fd, _identity(fd), kvsname)
    atexit.register(_finalize_at_exit)
    return True


def finalize() -> None:
    """Leave the world (a no-op when not in it). The socket stays open for MPICH. A member
    leaves whatever MPI was loaded since (not `initialized()`, which also asks that): the
    PMI-1 world would otherwise see it exit unfinalized and end the job."""
    if _mine() is None or _joined.finalized:
        return
    _joined.finalized = True
    if _identity(_joined.fd) == _joined.identity:  # MPICH's MPI_Finalize closes it
        _request(_joined.fd, "cmd=finalize", "finalize_ack")


def _finalize_at_exit() -> None:
    try:
        finalize()
    except (OSError, RuntimeError):
        pass  # poprun is gone: nobody is left to tell


def _open_mpi_alone() -> bool:
    """Open MPI's library is loaded in this process and poprun served it no PMIx world: its
    world is this process alone (module docstring)."""
    if env.PMIX_NAMESPACE in os.environ:
        return False
    try:
        with open("/proc/self/maps", "rb") as maps:
            return any(OPEN_MPI_LIBRARY in line for line in maps)
    except OSError:
        return False


def _mine() -> _Membership | None:
    # A forked child inherits the record but is no member: the world counts processes.
    return _joined if _joined is not None and _joined.pid == os.getpid() else None


def _world_socket() -> int | None:
    """PMI_FD when it names a socket this process holds; None otherwise (a descendant
    started without it sees another file, or none, at that number)."""
    try:
        fd = int(os.environ.get(env.PMI_FD, ""))
        return fd if stat.S_ISSOCK(os.fstat(fd).st_mode) else None
    except (ValueError, OSError):
        return None


def _identity(fd: int) -> tuple[int, int]:
    try:
        found = os.fstat(fd)
    except OSError:
        return (-1, -1)
    return (found.st_dev, found.st_ino)


def _request(fd: int, line: str, answer: str) -> dict[str, str]:
    """One PMI-1 command and its reply's fields; RuntimeError unless it says rc=0.

    Plain reads and writes on the descriptor, waited for with select: a socket object would
    set O_NONBLOCK for its timeout (or socket.setdefaulttimeout's), and that flag belongs to
    the open socket, which MPICH reads with blocking calls (its PMI_Init fails on EAGAIN)."""
    try:
        _write_all(fd, f"{line}\n".encode())
        reply = _read_line(fd)
    except OSError as error:
        raise RuntimeError(f"popdist: the job's world did not answer {line!r}: "
                           f"{error}") from None
    fields = dict(word.partition("=")[::2] for word in reply.split())
    if fields.get("cmd") != answer or fields.get("rc") != "0":
        raise RuntimeError(f"popdist: the job's world answered {line!r} with {reply!r}")
    return fields


def _write_all(fd: int, data: bytes) -> None:
    while data:
        _wait(fd, writing=True)
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            continue


def _read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        _wait(fd, writing=False)
        try:
            chunk = os.read(fd, 1)  # byte by byte: what follows the line is not ours to take
        except BlockingIOError:
            continue
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
        if len(data) > _MAX_REPLY:
            raise ConnectionError("the reply is too long")
    return data.decode("utf-8", "replace").strip()


def _wait(fd: int, writing: bool) -> None:
    ready = select.select([], [fd], [], REPLY_TIMEOUT) if writing else \
        select.select([fd], [], [], REPLY_TIMEOUT)
    if not any(ready):
        raise TimeoutError(f"no answer in {REPLY_TIMEOUT:.0f} s")
