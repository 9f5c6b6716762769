"""One session for a spawner's instances: a small leader process that starts them, each in a
process group of its own, as children of the spawner (docs/architecture.md, "One session per
host and attempt").

Why one session and not one per instance: with the kernel's autogroup scheduling
(/proc/sys/kernel/sched_autogroup_enabled, on by default in most distributions) every
`setsid()` makes a new scheduling group, and CPU time is shared between groups first. A rank
of an oversubscribed host that waits in `sched_yield()` (Open MPI's `mpi_yield_when_idle`)
then yields only within its own group: the rank it waits for, in another group, does not get
the CPU. Under Open MPI's own launcher the ranks share one group: PRRTE's default odls forks
each with `setpgid(0, 0)` (a group of its own, which its signals are sent to) and no
`setsid()`, in the daemon's session. MPICH's Hydra calls `setsid()` for every rank, as poprun
did.

Why a session at all, and not poprun's own: a process in poprun's session shares poprun's
controlling terminal, so one that opened /dev/tty would be a background job of poprun's shell
(SIGTTIN/SIGTTOU). The leader calls `setsid()`: its session has no terminal, and the instances,
which are not session leaders, can never acquire one (opening /dev/tty fails with ENXIO).

Why the leader forks them with `clone(CLONE_PARENT)`: a process can join a session only by
being forked inside it, yet the spawner must stay each instance's parent: it waits for it
through a pidfd, reads its exit status, and its zombie pins the group id that the spawner
SIGKILLs for leftovers. With CLONE_PARENT the new process is forked by the leader (so in its
session, its autogroup, its CPU and memory binding) but is the spawner's child.

The leader is forked from the spawner's process (no interpreter to start: ~0.5 ms here); it
closes every descriptor but its socket and the lifeline's pipe (which it holds so that the
lifeline sees its owner's death only once every instance the leader was starting has exec'd
with the lifeline's mark: lifeline.py), ignores the stop signals (a scheduler that signals
every process of a job must not leave the next attempt without one), and ends when the
spawner closes its socket or dies. Where the kernel refuses CLONE_PARENT (a seccomp filter),
the spawner falls back to a session per instance, as before.
"""

from __future__ import annotations

import errno
import fcntl  # here, not in the new process: an import there costs ~10 ms on a loaded host
import marshal
import os
import signal
import socket
import struct
from collections.abc import Collection, Mapping, Sequence

from .binding import bound

CLONE_PARENT = 0x00008000
_HEADER = struct.Struct("=I")  # the request's length; its descriptors come with this
_REPLY = struct.Struct("=iiii")  # pid, what failed (_OK...), errno, memory bound (0/1)
_OK, _CHDIR, _EXEC, _CLONE, _SETUP = range(5)  # _SETUP: the leader's own step (a binding)
_ERROR = struct.Struct("=ii")  # from the new process before its exec: what failed, errno
_EXEC_PIPE = -1  # the place of the pipe that its exec closes (and its failure is written to)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Python ignores these itself; an exec keeps an ignored signal ignored, so they are reset.
_RESET_SIGNALS = (*_STOP_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ)
_REFUSED = (errno.EPERM, errno.ENOSYS, errno.EINVAL)  # a clone that will never work here
MAX_FDS = 64  # descriptors one start may pass (stdin, stdout, stderr, the PMI socket...)


class Unavailable(OSError):
    """This host cannot start processes in the leader's session (clone refused)."""


class Started:
    """What Popen would give the spawner for an instance the leader started: its child."""

    def __init__(self, pid: int, stdout, stderr) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped by someone else: as Popen does
                self.returncode = 0
        return self.returncode


class SessionLeader:
    """The spawner's side. Not thread-safe: one thread starts processes through it."""

    def __init__(self, keep: Collection[int] = ()) -> None:
        """Fork the leader; `keep`: descriptors it holds besides its socket."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:  # the leader; it never returns from here
                try:
                    mine.close()
                    _lead(theirs, keep, blocked)
                except BaseException:  # noqa: BLE001 - the spawner sees EOF and says so
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(0)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        theirs.close()
        self.pid = pid
        self._sock: socket.socket | None = mine

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, *,
              stdin: int | None, merge_stderr: bool, pass_fds: Sequence[int] = (),
              cpus: Collection[int] | None = None, mems: Collection[int] | None = None
              ) -> tuple[Started, bool]:
        """Start `argv` as Popen would (stdout and stderr pipes to the caller, stdin the
        descriptor `stdin` or /dev/null, `pass_fds` at their numbers, every other descriptor
        closed), in the leader's session and a process group of its own; returns it and
        whether its memory binding was made. Raises OSError as Popen would (a program or a
        directory that is not there), Unavailable where the kernel refuses."""
        if self._sock is None:
            raise OSError(errno.EBADF, "the session leader is closed")
        # The exec's error comes to us: the leader replies once it has cloned, and the
        # new process's exec closes this pipe (one hand-over fewer on a loaded host).
        exec_r, exec_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC) if not merge_stderr else (-1, out_w)
        try:
            places = {_EXEC_PIPE: exec_w, 1: out_w, 2: err_w, **{fd: fd for fd in pass_fds}}
            if stdin is not None:
                places[0] = stdin
            request = marshal.dumps((list(argv), dict(env), cwd, list(places),
                                     list(cpus) if cpus is not None else None,
                                     list(mems) if mems is not None else None))
            try:
                _send(self._sock, _HEADER.pack(len(request)) + request,
                      list(places.values()))
                os.close(exec_w)
                exec_w = -1
                reply = _receive_exactly(self._sock, _REPLY.size)
            except (OSError, EOFError):
                raise OSError(errno.EPIPE, f"the session leader (pid {self.pid}) has ended "
                                           "(an internal error)") from None
            pid, failed, code, memory_bound = _REPLY.unpack(reply)
            if failed == _OK:  # until its exec (or its failure) closes the pipe
                failed, code = _read_error(exec_r) or (_OK, 0)
        except BaseException:
            for fd in (out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in {exec_w, out_w, err_w} - {-1}:
                os.close(fd)
            os.close(exec_r)
        if failed != _OK:
            for fd in (out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            if pid > 0:
                os.waitpid(pid, 0)  # ours, exited before its exec
            if failed == _CLONE:
                raise Unavailable(code, f"clone(CLONE_PARENT): {os.strerror(code)}")
            if failed == _SETUP:
                raise OSError(code, os.strerror(code))
            raise OSError(code, os.strerror(code), cwd if failed == _CHDIR else argv[0])
        return (Started(pid, open(out_r, "rb", buffering=0),
                        open(err_r, "rb", buffering=0) if err_r >= 0 else None),
                bool(memory_bound))

    def close(self) -> None:
        """End the leader (it holds nothing the instances need) and reap it."""
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _send(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise EOFError("the session leader is gone")
        data += piece
    return bytes(data)


# --- the leader --------------------------------------------------------------------------------


def _lead(sock: socket.socket, keep: Collection[int], mask) -> None:
    import gc

    # The spawner's objects stay as they were forked: a collection here could finalize one
    # (a socket, a file) and close a descriptor number the leader has since reused.
    gc.disable()
    os.setsid()  # a new session, without a terminal, and a new autogroup
    signal.set_wakeup_fd(-1)  # the spawner's event loop's, which is not ours
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    _close_all_but({0, 1, 2, sock.fileno(), *keep})
    import ctypes

    syscall = ctypes.PyDLL(None, use_errno=True).syscall  # keeps the GIL: no thread here
    number = _clone_number()
    arguments = [ctypes.c_long(n) for n in (number, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)]

    def clone() -> int:  # fork's return values: 0 in the new process, else its pid or -1
        return syscall(*arguments) if number > 0 else -1

    while True:
        try:
            header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
        except OSError:
            return
        if not header:
            return  # the spawner closed its end, or died
        try:
            header += _receive_exactly(sock, _HEADER.size - len(header))
            request = marshal.loads(_receive_exactly(sock, _HEADER.unpack(header)[0]))
            reply = _start(clone, request, fds)
        except EOFError:
            return
        finally:
            for fd in fds:
                os.close(fd)
        sock.sendall(_REPLY.pack(*reply))


def _clone_number() -> int:
    import platform

    # The clone system call's number (the os module has none), on the machines whose clone
    # takes its flags first (s390's does not); elsewhere -1: refused, as a seccomp filter would.
    return {"x86_64": 56, "aarch64": 220, "riscv64": 220, "ppc64le": 120}.get(
        platform.machine(), -1)


def _start(clone, request, fds: list[int]) -> tuple[int, int, int, int]:
    """Clone the new process (it execs on its own); the reply: (pid, _OK or what failed,
    errno, memory bound)."""
    argv, env, cwd, places, cpus, mems = request
    try:
        with bound(cpus, mems) as memory_bound:  # the clone inherits this thread's binding
            pid = clone()
            if pid == 0:  # the instance, bound (not past the block: that unbinds)
                _become(argv, env, cwd, dict(zip(places, fds)))
            refused = _errno() if pid < 0 else 0
    except OSError as exc:  # refused before the clone (a binding outside the cpuset)
        return -1, _SETUP, exc.errno or errno.EIO, 0
    if pid < 0:  # refused for good (a seccomp filter), or for now (EAGAIN: limits)
        return -1, _CLONE if refused in _REFUSED else _SETUP, refused, 0
    return pid, _OK, 0, int(bool(memory_bound))


def _errno() -> int:
    import ctypes

    return ctypes.get_errno() or errno.ENOSYS


def _read_error(fd: int) -> tuple[int, int] | None:
    data = b""
    while len(data) < _ERROR.size:
        piece = os.read(fd, _ERROR.size - len(data))
        if not piece:
            return None
        data += piece
    return _ERROR.unpack(data)


def _become(argv: list[str], env: dict[str, str], cwd: str | None,
            places: dict[int, int]) -> None:
    """In the new process: a group of its own, its descriptors, then exec. Never returns."""
    step = _SETUP
    error_w = places.pop(_EXEC_PIPE)
    try:
        os.setpgid(0, 0)
        if 0 not in places:
            places[0] = os.open(os.devnull, os.O_RDONLY)
        # Out of the way of every target first, then into place (inheritable).
        high = max([*places, *places.values(), error_w]) + 1
        moved = {target: _dup_above(fd, high) for target, fd in places.items()}
        for target, fd in moved.items():
            os.dup2(fd, target)
        error_w = _dup_above(error_w, high)  # close-on-exec: closes at the exec
        _close_all_but({*places, error_w})
        for sig in _RESET_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        step = _CHDIR
        if cwd:
            os.chdir(cwd)
        step = _EXEC
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        try:
            os.write(error_w, _ERROR.pack(step, exc.errno or errno.EIO))
        except OSError:
            pass
    finally:
        os._exit(127)


def _dup_above(fd: int, lowest: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)


def _close_all_but(keep: set[int]) -> None:
    start = 0
    for fd in sorted(keep):
        if start < fd:  # never an empty range: closerange(0, 0) closes every descriptor
            os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, max(os.sysconf("SC_OPEN_MAX"), 4096))
