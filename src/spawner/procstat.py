"""CPU % and memory of live instances: what the dashboard shows per instance. Here in the
spawner layer because each host's agent samples its own instances.

Where the instance has a cgroup of its own (containment.Cgroups), the figures are the whole
instance's, descendants and escaped helpers included: CPU from the cgroup's `cpu.stat`
(`usage_usec`, there without any controller), memory from `memory.current` where the memory
controller is enabled for it, else the resident memory of every process in `cgroup.procs`.
Otherwise they are the instance's leader process's, from /proc."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """One sample of an instance's resource use."""

    cpu_percent: float | None  # None until two samples give a rate
    rss: int  # resident set size, bytes


def cpu_seconds(stat: bytes, ticks_per_second: int) -> float:
    """utime + stime from /proc/<pid>/stat. The command name (field 2) may hold spaces and
    parentheses, so fields are counted from the last `)`."""
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second  # fields 14 and 15


def rss_bytes(statm: bytes, page_size: int) -> int:
    """Resident pages (field 2 of /proc/<pid>/statm) in bytes."""
    return int(statm.split()[1]) * page_size


def cgroup_cpu_seconds(cpu_stat: bytes) -> float:
    """`usage_usec` of a cgroup v2 `cpu.stat`, in seconds."""
    for line in cpu_stat.splitlines():
        name, _, value = line.partition(b" ")
        if name == b"usage_usec":
            return int(value) / 1e6
    raise ValueError("no usage_usec in cpu.stat")


class ProcSampler:
    """CPU % and memory of local instances; CPU % is the rate between two samples of a pid
    (from the same source: a cgroup's figures and a leader's are not comparable)."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")
        # pid -> (when, cpu seconds, the cgroup they came from or None)
        self._last: dict[int, tuple[float, float, str | None]] = {}

    def sample(self, pid: int, now: float, cgroup: str | None = None) -> Usage | None:
        """None when the process is gone. `cgroup`: the instance's own cgroup, if it has
        one: its figures are then the whole instance's."""
        whole = self._read_cgroup(cgroup) if cgroup else None
        try:
            if whole is None:
                cpu, rss, cgroup = self._read_leader(pid) + (None,)
            else:
                cpu, rss = whole
                if not os.path.exists(f"{self._proc}/{pid}"):
                    raise FileNotFoundError(pid)  # the leader is gone: so is the instance
        except (OSError, ValueError, IndexError):  # gone, or a zombie with empty files
            self._last.pop(pid, None)
            return None
        previous = self._last.get(pid)
        self._last[pid] = (now, cpu, cgroup)
        if previous is None or now <= previous[0] or previous[2] != cgroup:
            return Usage(None, rss)
        return Usage(100 * (cpu - previous[1]) / (now - previous[0]), rss)

    def _read_leader(self, pid: int) -> tuple[float, int]:
        with open(f"{self._proc}/{pid}/stat", "rb") as f:
            cpu = cpu_seconds(f.read(), self._ticks)
        with open(f"{self._proc}/{pid}/statm", "rb") as f:
            return cpu, rss_bytes(f.read(), self._page)

    def _read_cgroup(self, path: str) -> tuple[float, int] | None:
        """(CPU seconds, memory bytes) of every process the cgroup has had; None when it
        cannot be read (then the leader's figures serve)."""
        try:
            with open(os.path.join(path, "cpu.stat"), "rb") as f:
                cpu = cgroup_cpu_seconds(f.read())
        except (OSError, ValueError):
            return None
        try:
            with open(os.path.join(path, "memory.current"), "rb") as f:
                return cpu, int(f.read())
        except (OSError, ValueError):  # no memory controller there: its processes' RSS
            pass
        try:
            with open(os.path.join(path, "cgroup.procs"), "rb") as f:
                pids = f.read().split()
        except OSError:
            return None
        rss = 0
        for member in pids:
            try:
                with open(f"{self._proc}/{int(member)}/statm", "rb") as f:
                    rss += rss_bytes(f.read(), self._page)
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
        return cpu, rss

    def forget(self, pid: int) -> None:
        self._last.pop(pid, None)
