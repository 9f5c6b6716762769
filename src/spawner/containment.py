"""Finding and ending everything an instance started, even what left its process group.

An instance leads a process group of its own, and a signal to the group reaches what it
started. A helper that calls `setsid` or double-forks (a daemon, `nohup cmd &`, some data
loaders) leaves the group; three mechanisms catch it, strongest first:

- **cgroup v2**, where a subtree is writable (root, or systemd's user delegation): each
  instance runs in a cgroup of its own, `<our cgroup>/poprun-<token>/i<key>`, which nothing
  it starts can leave; `cgroup.kill` ends the lot. The instance is in it before its
  program's first instruction (`entering`: a shell moves itself in and execs the program),
  so nothing it forks is ever outside. Moving the launcher itself in around the fork (as the
  CPU binding is set) would do the same, but measured 1.5 ms a spawn here (the launcher's own
  migration into a new cgroup); a move made from outside after the spawn left a window in
  which a helper forked at once stayed in the launcher's cgroup (and, started with `env -i`,
  without the mark below).
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
import time
from collections.abc import Iterable

from . import procid

MARK = "POPRUN_LIFELINE"  # instances' environment: the token of the lifeline watching them
# POPRUN_CGROUPS=0 in the launcher's (or an agent's) environment: no cgroups, the other two
# mechanisms only (e.g. where creating cgroups is allowed but unwanted).
CGROUPS_SWITCH = "POPRUN_CGROUPS"
PR_SET_CHILD_SUBREAPER = 36
CGROUP_PREFIX = "poprun-"  # every cgroup tree poprun makes is named so (reap checks it)
CGROUP_EMPTY_TIMEOUT = 2.0  # seconds to wait for a killed cgroup to empty before rmdir


# --- the environment mark --------------------------------------------------------------------

def helpers_mark(token: str) -> str:
    """The mark of the launcher's own helpers (an SSH ProxyCommand, `srun`, the V-IPU CLI):
    killed with the instances when the launcher dies (lifeline, reap), but not by the sweep
    after an attempt, which would cut the connections the next attempt runs on."""
    return f"{token}.launcher"


def marked(*tokens: str, exclude: int | None = None) -> list[int]:
    """Pids of the processes whose environment carries `MARK=<one of tokens>` (readable
    ones: ours)."""
    wanted = {f"{MARK}={token}".encode() for token in tokens}
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and int(entry) != exclude and _carries(entry, wanted)]


def marked_with(pid: int, token: str) -> bool:
    return _carries(str(pid), {f"{MARK}={token}".encode()})


def _carries(pid: str, wanted: set[bytes]) -> bool:
    """Whether process `pid`'s environment has one of the `wanted` entries (b"NAME=value")."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return False
    return MARK.encode() in environ and not wanted.isdisjoint(environ.split(b"\0"))


def kill_marked(*tokens: str) -> int:
    """SIGKILL every process marked with one of `tokens`, and its process group; how many
    were found."""
    pids = marked(*tokens, exclude=os.getpid())
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


_spared: set[int] = set()  # children the sweep between attempts leaves: spare_child


def spare_child(pid: int) -> None:
    """A helper of the launcher's (its child) that the sweep between attempts leaves, as it
    leaves those carrying the helpers' mark, until `unspare_child`: one whose environment
    cannot show the mark (a fork: /proc/PID/environ is what its parent started with; the
    PMIx server's process, spawner/pmixhost.py)."""
    _spared.add(pid)


def unspare_child(pid: int) -> None:
    _spared.discard(pid)


def reap_children(keep: frozenset[int] = frozenset(), spare: str | None = None) -> int:
    """For a subreaper at its end: SIGKILL and reap every child but `keep` (descendants
    re-parented to us, whatever they did to their environment) and, with `spare`, but those
    marked with it and those spared (the launcher's helpers, between attempts); how many
    there were."""
    count = 0
    for pid in procid.children() - keep:
        if spare is not None and (pid in _spared or marked_with(pid, spare)):
            continue
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        count += 1
    return count


HELPERS_REAPED_TIMEOUT = 1.0  # seconds for asyncio to reap a helper, before and after SIGKILL


async def helpers_reaped(keep: frozenset[int] = frozenset()) -> None:
    """For a subreaper whose helpers (an SSH ProxyCommand, srun) asyncio started: wait,
    bounded, until asyncio's watcher threads are done and no child but `keep` still runs
    (helpers already told to end), SIGKILLing what is left after a first bound. asyncio
    reaps its own children (on Python 3.11 with a thread each); the final sweep
    (`reap_children`, once the loop is closed) reaping one first makes asyncio write
    "Unknown child process pid N" on stderr. Zombies no watcher waits for (what srun's
    forks leave to a subreaper) are the final sweep's: waiting on them cost 2 s a launch."""
    import asyncio
    import threading

    def waiting() -> bool:  # a zombie nobody waits for (an orphan of srun's) is the sweep's
        return any(t.name.startswith("asyncio-waitpid-") for t in threading.enumerate()) or \
            any(not procid.has_exited(pid) for pid in procid.children() - keep)

    for last in (False, True):
        deadline = time.monotonic() + HELPERS_REAPED_TIMEOUT
        while waiting() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)  # asyncio's reaping sends no event we could await
        if not waiting() or last:
            break
        for pid in procid.children() - keep:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0)  # the callbacks asyncio's threads scheduled run before the loop ends


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


def cgroup_root(token: str) -> str | None:
    """Where the instances of the lifeline `token` get their cgroups on this host:
    `<this process's cgroup>/poprun-<token>` (None without cgroup v2). The one definition:
    the spawner makes it there, the job's record names it for reap."""
    home = own_cgroup_dir()
    return os.path.join(home, f"{CGROUP_PREFIX}{token}") if home else None


# How an instance enters its cgroup before its program's first instruction: a shell writes 0
# (itself) to the cgroup's cgroup.procs, then execs the program in its place (same pid), so
# nothing the program ever forks can be outside it. The move is the child's: the kernel's
# wait on a launch's first move (an RCU grace period, 5-25 ms here) never holds up the
# launcher, and no Python runs between fork and exec (spawning stays on the vfork path). A
# move that fails (the cgroup gone meanwhile) leaves the mark and the sweep to catch it.
_ENTER = 'echo 0 >"$0" 2>/dev/null; exec "$@"'
SHELL = "/bin/sh"


def entering(procs: str, argv: tuple[str, ...]) -> list[str]:
    """`argv`, run so that it starts inside the cgroup whose cgroup.procs is `procs`."""
    return [SHELL, "-c", _ENTER, procs, *argv]


class Cgroups:
    """One cgroup per instance under `cgroup_root(token)`; `None` from `create()`
    where no writable cgroup v2 subtree exists."""

    def __init__(self, home: str, root: str) -> None:
        self.home, self.root = home, root
        self._made: dict[int, str] = {}
        self.members: dict[int, str] = {}  # instance -> its cgroup, once it was moved there

    @classmethod
    def create(cls, token: str) -> Cgroups | None:
        root = cgroup_root(token)
        if root is None:
            return None  # no cgroup v2 here
        home = os.path.dirname(root)
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

    def make(self, keys: Iterable[int]) -> None:
        """Make the cgroups of instances about to start, all before the first of them starts:
        a mkdir waits for the cgroup lock, which an instance moving itself holds through
        the kernel's RCU grace period (5-30 ms, the first move of a launch), so a cgroup
        made between two spawns held the launcher up that long. One that cannot be made is
        tried again, and said, by `prepare`."""
        for key in keys:
            if key not in self._made:
                self._make(key)

    def prepare(self, key: int) -> str | None:
        """Instance `key`'s own cgroup, made before it starts (by `make`, or now); its
        `cgroup.procs`, for the instance to enter (`entering`). None when it could not be
        made (the other mechanisms still hold)."""
        path = self._made.get(key) or self._make(key)  # made once: the key's restarts reuse it
        if path is None:
            self.members.pop(key, None)
            return None
        self.members[key] = path
        return os.path.join(path, "cgroup.procs")

    def _make(self, key: int) -> str | None:
        path = self.path(key)
        try:
            os.makedirs(path, 0o755, exist_ok=True)
        except OSError:
            return None
        self._made[key] = path
        return path

    def kill(self, key: int) -> None:
        """SIGKILL everything in instance `key`'s cgroup (cgroup.kill)."""
        path = self._made.get(key)
        if path is not None:
            _write(os.path.join(path, "cgroup.kill"), b"1")

    def close(self) -> None:
        """Kill whatever is left in every instance cgroup and remove them all."""
        _write(os.path.join(self.root, "cgroup.kill"), b"1")
        remove_tree(self.root)


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
