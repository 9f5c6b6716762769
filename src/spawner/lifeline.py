"""A watchdog that outlives its owner by exactly as long as it takes to clean up after it.

`Lifeline()` forks a small process that holds the read end of a pipe. The owner writes to it
the process groups it starts, its cgroups, the directories it creates and the MPI worlds it
serves. If the owner dies in any way — even by SIGKILL, where no `finally` runs — the pipe
reaches EOF and the watchdog kills every group and cgroup still registered, and every process
marked with its token (see containment.py: an instance started but not registered yet when
the owner died, a helper that left its group), runs the cleanup commands still registered
(the removal of a podman container: spawner/containers.py), removes every directory still
registered and what MPICH left in /dev/shm of every world still registered, then exits.

Why the mark closes the start-up race: the pipe's write end is inherited by every child until
its exec (close-on-exec), so the watchdog sees EOF only once every instance has exec'd, with
the mark in its environment; a second sweep a moment later covers a child caught between
closing its descriptors and exec.

An owner that is alive but no longer acts (frozen by SIGSTOP, stuck in a call) is no better
than a dead one, and no pipe closes: an owner can ask to be watched for that too
(`expect_beats(timeout)`, then `beat()` more often than `timeout`). A watchdog that hears
nothing from it for `timeout` SIGKILLs it and cleans up as after its death. The agent does
this with its host timeout: poprun declares a silent host lost after that long, and what the
agent started on its host must not outlive it.

Without a cgroup, a helper that left the process group *and* dropped the mark (`setsid env
-i ...`) can be found only through its ancestry, and only while the owner (the subreaper)
lives: once the owner is gone it is re-parented away. An owner without cgroups therefore asks
the watchdog to learn its descendants (`track_descendants`): every `TRACK_EVERY` seconds (less
often for a tree that takes longer to walk: at most a tenth of a core) the watchdog walks the
owner's process tree, or only the trees below its instances where the owner is not a
subreaper (a program that called launch(), whose other children are not the job's), and keeps
each process with its start time. If the owner dies it freezes those still running (SIGSTOP,
checked by start time through a pidfd, so a reused pid is never touched), adds what they
started meanwhile, and kills them all. A helper started less than `TRACK_EVERY` before the
owner's death, whose parent died with the owner's instances, is the one that can still
escape.

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
from .procid import descendants, start_ticks

RESWEEP_DELAY = 0.05  # seconds between the watchdog's two sweeps for marked processes
# Seconds between the watchdog's walks of its owner's tree, when asked to (no cgroups), at
# least: a walk reads two or three small /proc files per process below the owner.
TRACK_EVERY = 0.1
COMMAND_TIMEOUT = 30.0  # seconds a cleanup command (add_command) may take at most
COMMAND_TRIES = 3  # ... and tries, COMMAND_RETRY_DELAY seconds apart
COMMAND_RETRY_DELAY = 0.5
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
    def write_fd(self) -> int:
        """The pipe's write end (-1 once closed). A process that starts the owner's
        instances for it holds it too (spawner/sessionleader.py), so that the watchdog
        hears of the owner's death only once every instance it was starting has exec'd."""
        return self._write_fd

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

    def add_command(self, argv: list[str]) -> None:
        """A command to run once the owner's processes are killed, if the owner dies first
        (a container runtime's removal: spawner/containers.py's `cleanup`)."""
        self._send(b"r" + _joined(argv) + b"\0")

    def discard_command(self, argv: list[str]) -> None:
        self._send(b"s" + _joined(argv) + b"\0")

    def track_descendants(self, whole_tree: bool) -> None:
        """From now on the watchdog learns the owner's descendants, to kill those still
        running if the owner dies (for an owner whose instances have no cgroup): all of them
        for a subreaper, which owns every child it has (the poprun command, the agent), else
        (a program that called launch()) only those below its registered groups."""
        self._send(b"a%d\n" % whole_tree)

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


def _joined(argv: list[str]) -> bytes:
    """A command as one message body: its words apart by the unit separator."""
    return b"\x1f".join(os.fsencode(word) for word in argv)


def _run_commands(commands: set[bytes]) -> None:
    """The owner's cleanup commands (add_command)."""
    for command in commands:
        run_command([os.fsdecode(w) for w in command.split(b"\x1f")])


def run_command(argv: list[str]) -> bool:
    """Run a cleanup command until it succeeds, COMMAND_TRIES times at most (podman refuses
    to remove a container whose processes are still leaving it: "state improper"), each
    try bounded by COMMAND_TIMEOUT, output discarded. Whether it succeeded."""
    import subprocess

    for attempt in range(COMMAND_TRIES):
        if attempt:
            time.sleep(COMMAND_RETRY_DELAY)
        try:
            if subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=COMMAND_TIMEOUT,
                              check=False).returncode == 0:
                return True
        except (OSError, subprocess.SubprocessError):
            return False
    return False


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
    commands: set[bytes] = set()
    closed: list[bool] = []  # the owner said goodbye: it has cleaned up after itself
    beats: list[float] = []  # the owner's beat timeout, once it asked to be watched
    tracking: list[bool] = []  # the owner asked for its descendants to be learnt: its whole
    # tree (True), or below its groups (False)
    known: dict[int, int] = {}  # its descendants so far: pid -> start time
    pending = b""
    heard = time.monotonic()
    walk_at = heard + TRACK_EVERY  # the next walk of the owner's tree, when tracking
    while True:
        now = time.monotonic()
        if beats and now - heard >= beats[-1]:  # silent past its timeout: frozen or stuck
            _kill_owner(owner)
            break
        if tracking and now >= walk_at:
            _learn([owner] if tracking[-1] else list(groups), known)
            # A big tree takes longer to walk: the watchdog spends at most a tenth of a core.
            walk_at = now + max(TRACK_EVERY, 10 * (time.monotonic() - now))
        chunk = _read(read_fd, _wait(now, heard, beats, walk_at if tracking else None))
        if chunk is None:
            continue
        if not chunk:  # EOF: the owner is gone
            break
        heard = time.monotonic()
        pending += chunk
        pending = _apply(pending, groups, dirs, cgroups, closed, worlds, beats, tracking,
                         commands)
    if known and not closed:  # before the groups: their members' helpers keep their parents
        _kill_known(known)
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
    _run_commands(commands)  # after the kills: what they leave is what is removed
    for path in cgroups:
        remove_tree(os.fsdecode(path))
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    if worlds:  # after the kills: a live rank may still use its segment
        from .reaphere import remove_mpich_shm

        for kvsname in worlds:
            remove_mpich_shm(os.fsdecode(kvsname))


def _wait(now: float, heard: float, beats: list[float], walk_at: float | None
          ) -> float | None:
    """How long the watchdog may wait for its owner's next bytes: until the owner's beat is
    overdue, or the next walk of its tree is due (None: for ever)."""
    until = [at for at in (heard + beats[-1] if beats else None, walk_at) if at is not None]
    return max(0.0, min(until) - now) if until else None


def _learn(roots: list[int], known: dict[int, int]) -> None:
    """Add the descendants of `roots` now to `known`, and forget those that ended."""
    found = descendants(roots)
    found.pop(os.getpid(), None)  # the watchdog is the owner's child too
    for pid, ticks in list(known.items()):
        if pid not in found and start_ticks(pid) != ticks:
            del known[pid]
    known.update(found)


def _kill_known(known: dict[int, int]) -> None:
    """SIGKILL what the owner's tree held: each process first frozen (SIGSTOP) where it is
    still the one that started at its recorded time, then what the frozen ones started
    meanwhile, until nothing new appears; then all of them at once."""
    frozen: dict[int, tuple[int | None, int]] = {}  # pid -> (its pidfd, its start time)
    new = dict(known)
    for _ in range(8):  # a fork bomb must not hold the watchdog: what it froze still dies
        for pid, ticks in new.items():
            held, fd = _hold(pid, ticks)
            if held:
                _signal(pid, fd, ticks, signal.SIGSTOP)
                frozen[pid] = (fd, ticks)
        new = {pid: ticks for pid, ticks in descendants(frozen).items() if pid not in frozen}
        if not new:
            break
    for pid, (fd, ticks) in frozen.items():
        _signal(pid, fd, ticks, signal.SIGKILL)
        if fd is not None:
            os.close(fd)


def _hold(pid: int, ticks: int) -> tuple[bool, int | None]:
    """Whether `pid` is still the process that started at `ticks`, and a pidfd of it (checked
    after the pidfd is open: from then on it names that one process, and a reused pid is never
    signalled). No pidfd where none can be had (out of descriptors): the pid, checked again at
    each signal."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False, None
    except OSError:
        return start_ticks(pid) == ticks, None
    if start_ticks(pid) == ticks:
        return True, fd
    os.close(fd)
    return False, None


def _signal(pid: int, pidfd: int | None, ticks: int, signum: int) -> None:
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signum)
        elif start_ticks(pid) == ticks:
            os.kill(pid, signum)
    except OSError:
        pass


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
           closed: list[bool], worlds: set[bytes], beats: list[float],
           tracking: list[bool], commands: set[bytes]) -> bytes:
    """Apply every complete message in `buf`; return the incomplete rest."""
    while buf:
        kind = buf[:1]
        end = buf.find(b"\n" if kind in b"+-qtba" else b"\0")
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
        elif kind == b"r":
            commands.add(body)
        elif kind == b"s":
            commands.discard(body)
        elif kind == b"q":
            closed.append(True)
        elif kind == b"t":
            beats.append(float(body))
        elif kind == b"a":
            tracking.append(body == b"1")
        # b"b", a beat: its arrival is the news
    return buf
