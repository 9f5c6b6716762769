"""A host's NUMA topology — nodes, their CPUs and memory, sockets, physical cores — from sysfs.

Parsing is pure: `parse_topology` takes the text of the sysfs files (keyed by their path under
the sysfs root) and returns frozen dataclasses, so tests and `--dry-run` can plan against
topologies recorded on other machines. The I/O is in three small functions at the end:
`read_sysfs` (the files under `/sys`, or under `$POPRUN_SYSFS_ROOT`), `read_allowed` (this
process's cpuset) and `local_topology` (both together). A remote host's `Topology` travels to
the launcher as `to_dict()` / `from_dict()`.

Like PopRun 2.1, only the CPUs and memory nodes the launcher's cpuset allows are used: a job
started inside a container or a Slurm allocation stays inside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from spawner.cpulist import format_cpu_list, parse_allowed, parse_cpu_list
from spawner.sysfs import CPU_DIR as _CPU
from spawner.sysfs import NODE_DIR as _NODE
from spawner.sysfs import SIBLING_FILES as _SIBLING_FILES
from spawner.sysfs import read_sysfs, sysfs_root
from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError


_MEMTOTAL = re.compile(r"MemTotal:\s*(\d+)\s*kB")


# --- the model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Cpu:
    """One logical CPU (a hardware thread) the launcher may use."""

    id: int
    node: int
    socket: int  # physical_package_id
    # The lowest-numbered hardware thread of its physical core: one number that names the
    # core across the whole machine (core_id repeats in every socket).
    core: int


@dataclass(frozen=True)
class Node:
    """One NUMA node."""

    id: int
    cpus: tuple[int, ...]  # the usable CPUs only (online, allowed by the cpuset)
    memory_kib: int  # MemTotal; 0 for a memory-less node, or when NUMA is disabled


@dataclass(frozen=True)
class Topology:
    """What the launcher may use on one host. Build it with `parse_topology` or `from_dict`."""

    cpus: tuple[Cpu, ...]  # ascending id
    nodes: tuple[Node, ...]  # every online node, ascending id, even those with no usable CPU
    mems: tuple[int, ...]  # nodes memory can be bound to: they have memory, the cpuset allows

    def to_dict(self) -> dict:
        """A JSON-able form; `Topology.from_dict(t.to_dict()) == t`."""
        return {
            "cpus": [[c.id, c.node, c.socket, c.core] for c in self.cpus],
            "nodes": [[n.id, n.memory_kib] for n in self.nodes],
            "mems": list(self.mems),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> Topology:
        try:
            cpus = [Cpu(*(_int(v) for v in row)) for row in data["cpus"]]
            memory = {_int(node): _int(kib) for node, kib in data["nodes"]}
            mems = [_int(v) for v in data["mems"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed topology ({type(e).__name__}: {e})") from None
        stray = [c.id for c in cpus if c.node not in memory]
        if stray:
            raise ConfigError(f"malformed topology: CPUs {format_cpu_list(stray)} are on "
                              f"nodes it does not list")
        return _assemble(cpus, memory, mems)


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def _assemble(cpus: Iterable[Cpu], memory_kib: Mapping[int, int],
              mems: Iterable[int]) -> Topology:
    cpus = tuple(sorted(cpus, key=lambda c: c.id))
    nodes = tuple(Node(n, tuple(c.id for c in cpus if c.node == n), kib)
                  for n, kib in sorted(memory_kib.items()))
    return Topology(cpus, nodes, tuple(sorted(mems)))


# --- parsing sysfs text ------------------------------------------------------------------


def parse_topology(files: Mapping[str, str], allowed_cpus: frozenset[int] | None = None,
                   allowed_mems: frozenset[int] | None = None) -> Topology:
    """The topology described by `files` (sysfs path relative to the root -> content, as
    `read_sysfs` returns), restricted to `allowed_cpus` / `allowed_mems` (None: no limit).

    Without a `devices/system/node` directory (a kernel without NUMA) the host is one node 0
    holding every CPU, with no memory to bind (there is no memory policy to set)."""
    online = _online_cpus(files)
    node_ids = _node_ids(files)
    if node_ids:
        node_of = {cpu: n for n in node_ids
                   for cpu in _cpu_list(files, f"{_NODE}/node{n}/cpulist")}
        memory = {n: _memtotal(files, n) for n in node_ids}
        mems = [n for n, kib in memory.items() if kib > 0]
    else:
        node_of, memory, mems = dict.fromkeys(online, 0), {0: 0}, []
    core_of = _cores(files, online)
    usable = [c for c in online if c in node_of and (allowed_cpus is None or c in allowed_cpus)]
    cpus = [Cpu(c, node_of[c], _socket(files, c), core_of[c]) for c in usable]
    if allowed_mems is not None:
        mems = [n for n in mems if n in allowed_mems]
    return _assemble(cpus, memory, mems)


def _online_cpus(files: Mapping[str, str]) -> tuple[int, ...]:
    if f"{_CPU}/online" in files:
        return _cpu_list(files, f"{_CPU}/online")
    # No `online` file (very old kernels): every CPU that has a topology directory.
    found = {int(m[1]) for path in files if (m := re.match(rf"{_CPU}/cpu(\d+)/topology/", path))}
    if not found:
        raise ConfigError(f"no CPUs found: neither {_CPU}/online nor any cpu*/topology in sysfs")
    return tuple(sorted(found))


def _node_ids(files: Mapping[str, str]) -> tuple[int, ...]:
    if f"{_NODE}/online" in files:
        return _cpu_list(files, f"{_NODE}/online")
    return tuple(sorted({int(m[1]) for path in files
                         if (m := re.match(rf"{_NODE}/node(\d+)/cpulist$", path))}))


def _memtotal(files: Mapping[str, str], node: int) -> int:
    match = _MEMTOTAL.search(files.get(f"{_NODE}/node{node}/meminfo", ""))
    return int(match[1]) if match else 0


def _socket(files: Mapping[str, str], cpu: int) -> int:
    text = files.get(f"{_CPU}/cpu{cpu}/topology/physical_package_id")
    return _number(text, f"{_CPU}/cpu{cpu}/topology/physical_package_id") if text else 0


def _cores(files: Mapping[str, str], online: Iterable[int]) -> dict[int, int]:
    """CPU -> the lowest CPU of its physical core (over all online CPUs, allowed or not)."""
    core_of: dict[int, int] = {}
    by_core_id: dict[tuple[int, int], int] = {}
    for cpu in online:
        topo = f"{_CPU}/cpu{cpu}/topology"
        siblings = next((f"{topo}/{n}" for n in _SIBLING_FILES if f"{topo}/{n}" in files), None)
        if siblings:
            core_of[cpu] = min(_cpu_list(files, siblings) or (cpu,))
        elif f"{topo}/core_id" in files:  # no sibling list: threads of a core share core_id
            key = (_socket(files, cpu), _number(files[f"{topo}/core_id"], f"{topo}/core_id"))
            core_of[cpu] = by_core_id.setdefault(key, cpu)
        else:
            core_of[cpu] = cpu
    return core_of


def _cpu_list(files: Mapping[str, str], path: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(files[path])
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def _number(text: str, path: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{path}: {text.strip()!r} is not a number") from None




# --- I/O ---------------------------------------------------------------------------------


def read_allowed(pid: int | str = "self") -> tuple[frozenset[int], frozenset[int]]:
    """The CPUs and memory nodes process `pid` may use, from `/proc/<pid>/status`."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    try:
        return parse_allowed(status)
    except ValueError as e:
        raise ConfigError(f"/proc/{pid}/status: {e}") from None


def agent_topology(reply: Mapping[str, object]) -> Topology:
    """A remote host's topology from its agent's HELLO reply (spawner.agent.hello_reply: the
    raw sysfs files and the agent's /proc status), cut to the agent's cpuset."""
    try:
        cpus, mems = parse_allowed(str(reply.get("status") or ""))
    except ValueError as e:
        raise ConfigError(f"its process status: {e}") from None
    return parse_topology(reply.get("sysfs") or {}, cpus, mems)


def local_topology(root: str | None = None) -> Topology:
    """This host's topology, restricted to what this process's cpuset allows. A recorded tree
    (`root` or $POPRUN_SYSFS_ROOT) is another machine's: our cpuset says nothing about it."""
    root = root or sysfs_root()
    if root != "/sys":
        return parse_topology(read_sysfs(root))
    allowed_cpus, allowed_mems = read_allowed()
    return parse_topology(read_sysfs(root), allowed_cpus, allowed_mems)
