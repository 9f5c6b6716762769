"""Whether the kernel's out-of-memory killer ended an instance: the evidence its host is
quarantined on (docs/architecture.md, "Errors and exit statuses": Restarts).

A SIGKILL alone is no proof: poprun sends one after --kill-timeout, and a user, a scheduler or
a watchdog may. The kernel counts its own kills per memory cgroup, `oom_kill` in cgroup v2's
`memory.events` (hierarchical: a cgroup counts its descendants' kills) and in v1's
`memory.oom_control` (kernel 4.13+), whether the limit hit was the cgroup's or the host's.
An instance that ended by SIGKILL while that count rose in the memory cgroup it ran in was
killed by it. The cgroup read is the instance's own where the memory controller reaches it
(then the count is its processes' alone), else the nearest one the agent runs in that has a
count (shared with the host's other instances: a kill of another process there coinciding
with a SIGKILL from elsewhere is the one case read wrong, and the host is short of memory
then too). The kernel's log names the killed pid, but reading it takes a privilege
(kernel.dmesg_restrict) an agent rarely has, and /proc/vmstat's count is the whole host's.
Where no count can be read, nothing is claimed."""

from __future__ import annotations

import os
import signal

V2_FILE = "memory.events"  # cgroup v2
V1_FILE = "memory.oom_control"  # cgroup v1's memory controller
COUNT = b"oom_kill "
MAX_READ = 4096  # either file is a few short lines


def read_count(path: str) -> int | None:
    """The `oom_kill` count in `path` (either file), None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_READ)
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith(COUNT) and line[len(COUNT):].strip().isdigit():
            return int(line[len(COUNT):])
    return None


def shared_counter(proc_cgroup: str = "/proc/self/cgroup",
                   mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The count file of the memory cgroup this process (the agent) runs in, which its
    instances inherit: cgroup v2's nearest (self or ancestor) with a memory.events, else v1's
    memory controller's memory.oom_control. None where neither can be read."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    paths = {controllers: path for _, controllers, path in (p for p in lines if len(p) == 3)}
    for fields in mounts:
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or len(fields) < sep + 4:
            continue
        kind, options = fields[sep + 1], fields[sep + 3].split(",")
        if kind == "cgroup2" and "" in paths:
            found = _nearest(fields[4], paths[""])
            if found:
                return found
        elif kind == "cgroup" and "memory" in options:
            path = next((p for c, p in paths.items() if "memory" in c.split(",")), None)
            if path is not None:
                found = os.path.join(fields[4], path.lstrip("/"), V1_FILE)
                if read_count(found) is not None:
                    return found
    return None


def _nearest(mount: str, path: str) -> str | None:
    """The memory.events of `path` or its nearest ancestor below the mount's root (the root
    cgroup has none) that has one."""
    parts = [p for p in path.split("/") if p]
    while parts:
        found = os.path.join(mount, *parts, V2_FILE)
        if read_count(found) is not None:
            return found
        parts.pop()
    return None


class OomWatch:
    """Each instance's count at its start, and at its end the kills since (`killed`)."""

    def __init__(self) -> None:
        self._shared: str | None | bool = False  # False: not looked for yet
        self._start: dict[int, tuple[str, int]] = {}

    def started(self, key: int, own_cgroup: str | None) -> None:
        """Instance `key` started (in `own_cgroup`, where it has one)."""
        path = os.path.join(own_cgroup, V2_FILE) if own_cgroup else None
        count = read_count(path) if path else None
        if count is None:
            if self._shared is False:
                self._shared = shared_counter()
            path = self._shared or None
            count = read_count(path) if path else None
        if path is not None and count is not None:
            self._start[key] = (path, count)
        else:
            self._start.pop(key, None)

    def killed(self, key: int, returncode: int) -> int:
        """How many processes the OOM killer killed in instance `key`'s memory cgroup since
        it started, where it ended by SIGKILL (else 0: see the module's docstring)."""
        start = self._start.pop(key, None)
        if start is None or returncode != -signal.SIGKILL:
            return 0
        now = read_count(start[0])
        return max(0, now - start[1]) if now is not None else 0
