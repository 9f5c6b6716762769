"""Which process a pid is: its start time, so that a pid recorded long ago is never taken for
the unrelated process that reuses it, and the boot it belongs to.

A process is named by (boot id, pid, start time): the start time is field 22 of
`/proc/<pid>/stat`, in clock ticks since boot, fixed for the life of the process; the boot id
(`/proc/sys/kernel/random/boot_id`) changes at every boot, when every recorded pid is stale.
Standard library only: the agent (Python 3.10) and `poprunctl reap`'s remote script use it.

And whose a process is, while its ancestry holds: `children` (every thread's, as
/proc/<pid>/task/*/children lists them) and `descendants` (the whole subtree, each with its
start time).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def start_ticks(pid: int, proc: str = "/proc") -> int | None:
    """The start time of `pid` (clock ticks after boot), or None when there is no such
    process."""
    fields = _stat_fields(pid, proc)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def _stat_fields(pid: int, proc: str) -> list[bytes] | None:
    """`/proc/<pid>/stat` from field 3 (the state) on. The command name (field 2) may hold
    spaces and parentheses: fields are counted from the last `)`."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def boot_id() -> str | None:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def is_same(pid: int, ticks: int | None, proc: str = "/proc") -> bool:
    """Whether `pid` is still the process that started at `ticks` (False when `ticks` is
    unknown: never act on a pid that cannot be told apart from its successor)."""
    return ticks is not None and start_ticks(pid, proc) == ticks


def has_exited(pid: int, proc: str = "/proc") -> bool:
    """Whether `pid` runs nothing: gone, or a zombie (dead, not reaped yet)."""
    fields = _stat_fields(pid, proc)
    return fields is None or fields[0] in (b"Z", b"X")


def is_running(pid: int, ticks: int | None, proc: str = "/proc") -> bool:
    """Whether `pid` is still the process that started at `ticks` and has not exited: a
    zombie (dead, its parent has not reaped it yet; an orphan waits for init, which may take
    its time) keeps its pid and start time but runs nothing."""
    fields = _stat_fields(pid, proc)
    try:
        return ticks is not None and fields is not None and fields[0] not in (b"Z", b"X") \
            and int(fields[19]) == ticks
    except (ValueError, IndexError):
        return False


def children(pid: int | str = "self", proc: str = "/proc") -> set[int]:
    """`pid`'s children, every thread's (a child belongs to the thread that forked it or, once
    orphaned, to the subreaper's thread that took it)."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"{proc}/{pid}/task/{tid}/children", "rb") as f:
                found.update(int(child) for child in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def descendants(roots: Iterable[int], proc: str = "/proc") -> dict[int, int]:
    """Every process below `roots` (not the roots), each with its start time; one that ended
    while it was read is left out."""
    found: dict[int, int] = {}
    level = set(roots)
    while level:
        below = set()
        for pid in level:
            below |= children(pid, proc)
        below -= found.keys()
        level = set()
        for pid in below:
            ticks = start_ticks(pid, proc)
            if ticks is not None:
                found[pid] = ticks
                level.add(pid)
    return found
