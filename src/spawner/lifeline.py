"""A watchdog that outlives its owner by exactly as long as it takes to clean up after it.

`Lifeline()` forks a small process that holds the read end of a pipe. The owner writes to it
the process groups it starts, its cgroups, the directories it creates and the MPI worlds it
serves. If the owner dies in any way — even by SIGKILL, where no `finally` runs — the pipe
reaches EOF and the watchdog kills every group and cgroup still registered, and every process
marked with its token (see containment.py: an instance started but not registered yet when
the owner died, a helper that left its group), removes every directory still registered and
what MPICH left in /dev/shm of every world still registered, then exits.

Why the mark closes the start-up race: the pipe's write end is inherited by every child until
its exec (close-on-exec), so the watchdog sees EOF only once every instance has exec'd, with
the mark in its environment; a second sweep a moment later covers a child caught between
closing its descriptors and exec.

An owner that is alive but no longer acts (frozen by SIGSTOP, stuck in a call) is no better
than a dead one, and no pipe closes: an owner can ask to be watched for that too
(`expect_beats(timeout)`, then `beat()` more often than `timeout`). A watchdog that hears
nothing from it for `timeout` SIGKILLs it and cleans up as after its death. The agent does
this with its host timeout: poprun declares a silent host lost after that long, and what the
agent started on its host must not outlive it (issue 26).

Why a fork and not PR_SET_PDEATHSIG: a death signal reaches only the direct child, not the
dataloader workers it started, and setting it needs code between fork and exec, which forces
the slow spawn path (docs/architecture.md, "Measured reasons"). One watchdog per launcher
costs one fork in total.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import time

from .containment import MARK, helpers_mark, kill_marked, remove_tree

RESWEEP_DELAY = 0.05  # seconds between the watchdog's two sweeps for marked processes
_OWNER_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


class Lifeline:
    """Owner side of the watchdog. Not thread-safe; use from one thread."""

    def __init__(self) -> None:
        self.token = os.urandom(8).hex()
        read_fd, self._write_fd = os.pipe()
        # Stop signals wait until the fork is done: a Python handler run inside os.fork's
        # at-fork hooks would have its exception swallowed, and the watchdog must not die
        # of one before it ignores them.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _OWNER_SIGNALS)
        owner = os.getpid()
        try:
            pid = os.fork()
            if pid == 0:  # the watchdog; it never returns from here
                try:
                    os.close(self._write_fd)
                    _watch(read_fd, self.token, blocked, owner)
                finally:
                    os._exit(0)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(read_fd)
        self.pid = pid

    @property
    def mark(self) -> tuple[str, str]:
        """The environment variable and value every watched instance gets."""
        return MARK, self.token

    def add_group(self, pgid: int) -> None:
        self._send(b"+%d\n" % pgid)

    def discard_group(self, pgid: int) -> None:
        self._send(b"-%d\n" % pgid)

    def add_dir(self, path: str) -> None:
        self._send(b"d" + os.fsencode(path) + b"\0")

    def make_temp_dir(self, prefix: str, parent: str | None = None) -> str:
        """A new private (0700) temporary directory (in `parent`, else the temp dir) the
        watchdog removes if its owner dies. Registered *before* it exists: with
        mkdtemp-then-register, an owner SIGKILLed in between left the directory behind (1
        run in ~150 of the start-up SIGKILL test)."""
        if parent is None:
            import tempfile

            parent = tempfile.gettempdir()
        for _ in range(100):
            path = os.path.join(parent, prefix + os.urandom(6).hex())
            if os.path.lexists(path):
                continue
            self.add_dir(path)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:  # made meanwhile by someone else: not ours to remove
                self.discard_dir(path)
                continue
            except OSError:
                self.discard_dir(path)
                raise
            return path
        raise FileExistsError(f"no free name for {prefix}* in {parent}")

    def add_cgroup(self, path: str) -> None:
        """A cgroup tree to kill (cgroup.kill) and remove."""
        self._send(b"c" + os.fsencode(path) + b"\0")

    def discard_dir(self, path: str) -> None:
        self._send(b"k" + os.fsencode(path) + b"\0")

    def add_mpi_world(self, kvsname: str) -> None:
        """An MPI world served for the owner's instances: what MPICH leaves of it in /dev/shm
        is removed once they are gone (reaphere.remove_mpich_shm)."""
        self._send(b"w" + os.fsencode(kvsname) + b"\0")

    def discard_mpi_world(self, kvsname: str) -> None:
        self._send(b"x" + os.fsencode(kvsname) + b"\0")

    def expect_beats(self, timeout: float) -> None:
        """From now on, an owner silent for `timeout` seconds is stuck: the watchdog kills it
        and cleans up. Any message counts; `beat()` when there is nothing else to say."""
        self._send(b"t%r\n" % float(timeout))

    def beat(self) -> None:
        self._send(b"b\n")

    def close(self) -> None:
        """Release the watchdog: it cleans up whatever is still registered and exits."""
        if self._write_fd < 0:
            return
        self._send(b"q\n")  # a clean close: no sweep for marked processes needed
        os.close(self._write_fd)
        self._write_fd = -1
        os.waitpid(self.pid, 0)

    def _send(self, message: bytes) -> None:
        os.write(self._write_fd, message)  # small writes to a pipe are atomic


def _watch(read_fd: int, token: str, mask: set[int], owner: int) -> None:
    # Own session: a Ctrl-C or a kill of the launcher's process group must not take the
    # watchdog down before it has done its work; signals are ignored for the same reason.
    os.setsid()
    for sig in _OWNER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.closerange(0, read_fd)
    os.closerange(read_fd + 1, 4096)  # hold no pipe of the owner's open (its readers wait)
    groups: set[int] = set()
    dirs: set[bytes] = set()
    cgroups: set[bytes] = set()
    worlds: set[bytes] = set()
    closed: list[bool] = []  # the owner said goodbye: it has cleaned up after itself
    beats: list[float] = []  # the owner's beat timeout, once it asked to be watched
    pending = b""
    while (chunk := _read(read_fd, beats[-1] if beats else None)) is not None:
        if not chunk:  # EOF: the owner is gone
            break
        pending += chunk
        pending = _apply(pending, groups, dirs, cgroups, closed, worlds, beats)
    else:  # silent past its timeout: frozen or stuck; no one else will stop it
        _kill_owner(owner)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for path in cgroups:
        try:
            with open(os.path.join(path, b"cgroup.kill"), "wb", buffering=0) as f:
                f.write(b"1")
        except OSError:
            pass
    if not closed:  # the owner died: an instance it never registered may still run
        kill_marked(token, helpers_mark(token))
        time.sleep(RESWEEP_DELAY)
        kill_marked(token, helpers_mark(token))
    for path in cgroups:
        remove_tree(os.fsdecode(path))
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    if worlds:  # after the kills: a live rank may still use its segment
        from .reaphere import remove_mpich_shm

        for kvsname in worlds:
            remove_mpich_shm(os.fsdecode(kvsname))


def _read(fd: int, timeout: float | None) -> bytes | None:
    """The owner's next bytes (b"": EOF), or None when it said nothing for `timeout` s."""
    if timeout is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(timeout * 1000):
            return None
    return os.read(fd, 65536)


def _kill_owner(owner: int) -> None:
    """SIGKILL works on a stopped process too; the owner's own cleanup will never run, so
    the watchdog's does, as after a SIGKILL of the owner. Only while the watchdog is still
    its child: a dead owner's pid may be another process's by now."""
    if os.getppid() == owner:
        try:
            os.kill(owner, signal.SIGKILL)
        except OSError:
            pass


def _apply(buf: bytes, groups: set[int], dirs: set[bytes], cgroups: set[bytes],
           closed: list[bool], worlds: set[bytes], beats: list[float]) -> bytes:
    """Apply every complete message in `buf`; return the incomplete rest."""
    while buf:
        kind = buf[:1]
        end = buf.find(b"\n" if kind in b"+-qtb" else b"\0")
        if end < 0:
            return buf
        body, buf = buf[1:end], buf[end + 1:]
        if kind == b"+":
            groups.add(int(body))
        elif kind == b"-":
            groups.discard(int(body))
        elif kind == b"d":
            dirs.add(body)
        elif kind == b"k":
            dirs.discard(body)
        elif kind == b"c":
            cgroups.add(body)
        elif kind == b"w":
            worlds.add(body)
        elif kind == b"x":
            worlds.discard(body)
        elif kind == b"q":
            closed.append(True)
        elif kind == b"t":
            beats.append(float(body))
        # b"b", a beat: its arrival is the news
    return buf
