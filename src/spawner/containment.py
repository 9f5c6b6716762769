"""Finding and ending everything an instance started, even what left its process group.

An instance leads a process group of its own, and a signal to the group reaches what it
started. A helper that calls `setsid` or double-forks (a daemon, `nohup cmd &`, some data
loaders) leaves the group; three mechanisms catch it, strongest first:

- **cgroup v2**, where a subtree is writable (root, or systemd's user delegation): each
  instance runs in a cgroup of its own, `<our cgroup>/poprun-<token>/i<key>`, which nothing
  it starts can leave; `cgroup.kill` ends the lot. The instance is moved there right after
  its spawn: moving the launcher itself in around the fork (as the CPU binding is set) would
  have it there from its first instruction, but measured 1.5 ms a spawn here (the launcher's
  own migration into a new cgroup) against 0.03 ms for the child's. What it forks in those
  microseconds is caught by the mark below, which the final sweep uses too.
- **the environment mark**: every instance gets `POPRUN_LIFELINE=<token>` (`MARK`), which its
  descendants inherit; `marked(token)` finds them in /proc whatever their parent or session.
- **child subreaper** (`become_subreaper`, for the poprun command and the agent, never for
  a library caller's process): orphaned descendants are re-parented to us, not to init, so
  the final sweep can reap them (`reap_children`).

The lifeline (lifeline.py) uses the first two when its owner dies without cleaning up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

MARK = "POPRUN_LIFELINE"  # instances' environment: the token of the lifeline watching them
# POPRUN_CGROUPS=0 in the launcher's (or an agent's) environment: no cgroups, the other two
# mechanisms only (e.g. where creating cgroups is allowed but unwanted).
CGROUPS_SWITCH = "POPRUN_CGROUPS"
PR_SET_CHILD_SUBREAPER = 36
CGROUP_EMPTY_TIMEOUT = 2.0  # seconds to wait for a killed cgroup to empty before rmdir


# --- the environment mark --------------------------------------------------------------------

def marked(token: str, exclude: int | None = None) -> list[int]:
    """Pids of the processes whose environment carries `MARK=token` (readable ones: ours)."""
    needle = f"{MARK}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle + b"\0" in environ or environ.endswith(needle):
            found.append(int(entry))
    return found


def kill_marked(token: str) -> int:
    """SIGKILL every marked process and its process group; how many were found."""
    pids = marked(token, exclude=os.getpid())
    for pid in pids:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
    return len(pids)


# --- child subreaper -------------------------------------------------------------------------

_subreaper = False


def become_subreaper() -> bool:
    """Make orphaned descendants children of this process (prctl PR_SET_CHILD_SUBREAPER).
    For processes that own all their children (the poprun command, the agent)."""
    global _subreaper
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        _subreaper = False
    return _subreaper


def is_subreaper() -> bool:
    return _subreaper


def children() -> set[int]:
    """This process's children (every thread's), from /proc/self/task/*/children."""
    found: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                found.update(int(pid) for pid in f.read().split())
        except OSError:
            continue
    return found


def reap_children(keep: frozenset[int] = frozenset()) -> int:
    """For a subreaper at its end: SIGKILL and reap every child but `keep` (descendants
    re-parented to us, whatever they did to their environment); how many there were."""
    count = 0
    for pid in children() - keep:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        count += 1
    return count


# --- cgroup v2 -------------------------------------------------------------------------------

def own_cgroup_dir() -> str | None:
    """This process's cgroup v2 directory, when the unified hierarchy is mounted."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), None)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    if path is None:
        return None
    for fields in mounts:
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            directory = os.path.join(fields[4], path.lstrip("/"))
            if os.path.isdir(directory):
                return directory
    return None


class Cgroups:
    """One cgroup per instance under `<own cgroup>/poprun-<token>`; `None` from `create()`
    where no writable cgroup v2 subtree exists."""

    def __init__(self, home: str, root: str) -> None:
        self.home, self.root = home, root
        self._made: dict[int, str] = {}
        self.members: dict[int, str] = {}  # instance -> its cgroup, once it was moved there

    @classmethod
    def create(cls, token: str) -> Cgroups | None:
        home = own_cgroup_dir()
        if home is None:
            return None  # no cgroup v2 here
        root = os.path.join(home, f"poprun-{token}")
        try:
            os.mkdir(root, 0o755)
        except OSError:  # not writable: no delegation here
            return None
        try:
            if not os.path.exists(os.path.join(root, "cgroup.kill")):
                raise OSError("a kernel before 5.14: no cgroup.kill")
            return cls(home, root)
        except OSError:
            os.rmdir(root)
            return None

    def path(self, key: int) -> str:
        return os.path.join(self.root, f"i{key}")

    def adopt(self, key: int, pid: int) -> bool:
        """Move instance `key`'s process `pid` into a cgroup of its own (right after its
        spawn). False when it could not (the other mechanisms still hold)."""
        path = self.path(key)
        try:
            os.makedirs(path, 0o755, exist_ok=True)  # exists: the key's earlier process
            self._made[key] = path
            with open(os.path.join(path, "cgroup.procs"), "wb", buffering=0) as procs:
                procs.write(str(pid).encode())
        except OSError:
            self.members.pop(key, None)
            return False
        self.members[key] = path
        return True

    def kill(self, key: int) -> None:
        """SIGKILL everything in instance `key`'s cgroup (cgroup.kill)."""
        path = self._made.get(key)
        if path is not None:
            _write(os.path.join(path, "cgroup.kill"), b"1")

    def close(self) -> None:
        """Kill whatever is left in every instance cgroup and remove them all."""
        _write(os.path.join(self.root, "cgroup.kill"), b"1")
        remove_tree(self.root)


class Adopter:
    """Moves spawned processes into their cgroups (`Cgroups.adopt`) on a thread of its own.

    Why a thread: the first move of a run waits out an RCU grace period in the kernel
    (cgroup_threadgroup_rwsem: 5-25 ms measured here, for each launch) while the event loop
    could be routing output; the moves after it are ~0.1 ms. The price is a longer moment
    before an instance is in its cgroup: what it forks meanwhile stays outside, which the
    environment mark and the final sweep cover (as for the microseconds before a move made
    at once). A process must be `settle`d before it is reaped: a move after the reap could
    take another process that reused the pid."""

    def __init__(self, cgroups: Cgroups) -> None:
        self.cgroups = cgroups
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[tuple[int, int]] = deque()  # (key, pid) not moved yet
        self._moving: int | None = None  # the key being moved now
        self._then: list[Callable[[], None]] = []  # to call once that move is made
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, key: int, pid: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._queue.append((key, pid))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="poprun-cgroups",
                                                daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def settle(self, key: int) -> None:
        """`key`'s process has been moved, or never will be."""
        with self._lock:
            self._drop(key)
            while self._moving == key:
                self._changed.wait()

    def settled(self, key: int, then: Callable[[], None]) -> bool:
        """As `settle` without waiting: True when `key` is settled now; else False, and
        `then()` is called (on the adopter's thread) once its move is made."""
        with self._lock:
            self._drop(key)
            if self._moving != key:
                return True
            self._then.append(then)
            return False

    def _drop(self, key: int) -> None:
        if any(k == key for k, _ in self._queue):
            self._queue = deque(item for item in self._queue if item[0] != key)

    def close(self) -> None:
        """No more moves (those not made are dropped); returns once none is under way."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()
            while self._moving is not None:
                self._changed.wait()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                key, pid = self._queue.popleft()
                self._moving = key
            try:
                self.cgroups.adopt(key, pid)
            finally:
                with self._lock:
                    self._moving = None
                    then, self._then = self._then, []
                    self._changed.notify_all()
                for call in then:
                    with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                        call()


def _write(path: str, data: bytes) -> None:
    with contextlib.suppress(OSError):
        with open(path, "wb", buffering=0) as f:
            f.write(data)


def remove_tree(root: str, timeout: float = CGROUP_EMPTY_TIMEOUT) -> None:
    """rmdir a killed cgroup subtree, children first, once the kernel has emptied it."""
    deadline = time.monotonic() + timeout
    for directory, subdirs, _ in sorted(os.walk(root), key=lambda w: -w[0].count(os.sep)):
        while True:
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:  # still populated for a moment after cgroup.kill
                if time.monotonic() > deadline:
                    break
                time.sleep(0.005)
