"""The Linux list format of CPUs and memory nodes ("0-3,8,10-11"), as sysfs `cpulist` files
and `/proc/<pid>/status` write it. Shared by the spawner (binding checks) and poprun (topology)."""

from __future__ import annotations

import re
from collections.abc import Iterable

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11), ascending; "" -> (). The format of sysfs
    `cpulist` files and of `Cpus_allowed_list` / `Mems_allowed_list` (node lists too)."""
    ids: set[int] = set()
    for item in text.strip().split(","):
        if not item:
            continue
        match = _RANGE.fullmatch(item.strip())
        if not match or (match[2] and int(match[2]) < int(match[1])):
            raise ValueError(f"{text.strip()!r} is not a CPU list like 0-3,8,10-11")
        first = int(match[1])
        ids.update(range(first, int(match[2] or first) + 1))
    return tuple(sorted(ids))


def format_cpu_list(ids: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8, 10, 11) -> "0-3,8,10-11", the inverse of `parse_cpu_list`."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def parse_allowed(status: str) -> tuple[frozenset[int], frozenset[int]]:
    """(CPUs, memory nodes) from the text of a `/proc/<pid>/status`: its `Cpus_allowed_list`
    and `Mems_allowed_list` (the cpuset intersected with the affinity)."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        return (frozenset(parse_cpu_list(fields["Cpus_allowed_list"])),
                frozenset(parse_cpu_list(fields["Mems_allowed_list"])))
    except KeyError as e:
        raise ValueError(f"no {e.args[0]} in the process status") from None
