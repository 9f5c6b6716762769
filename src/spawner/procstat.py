"""CPU % and resident memory of live processes, from /proc: what the dashboard shows per
instance. Here in the spawner layer because each host's agent samples its own instances."""

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


class ProcSampler:
    """CPU % and RSS of local processes; CPU % is the rate between two samples of a pid."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._last: dict[int, tuple[float, float]] = {}  # pid -> (when, cpu seconds)

    def sample(self, pid: int, now: float) -> Usage | None:
        """None when the process is gone."""
        try:
            with open(f"{self._proc}/{pid}/stat", "rb") as f:
                cpu = cpu_seconds(f.read(), self._ticks)
            with open(f"{self._proc}/{pid}/statm", "rb") as f:
                rss = rss_bytes(f.read(), self._page)
        except (OSError, ValueError, IndexError):  # gone, or a zombie with empty files
            self._last.pop(pid, None)
            return None
        previous = self._last.get(pid)
        self._last[pid] = (now, cpu)
        if previous is None or now <= previous[0]:
            return Usage(None, rss)
        return Usage(100 * (cpu - previous[1]) / (now - previous[0]), rss)

    def forget(self, pid: int) -> None:
        self._last.pop(pid, None)
