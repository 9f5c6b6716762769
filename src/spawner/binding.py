"""Binding a process to CPUs and NUMA memory from its first instruction, and reading it back.

A child inherits the CPU affinity and the memory policy of the *thread* that forks it, and keeps
both across exec. So `bound()` sets them on the calling thread around the `Popen` call and
restores them afterwards: the program, and every thread and child it makes, starts bound, and
nothing runs in Python between fork and exec (a `preexec_fn` would force the slow full fork,
DESIGN.md §8). Only the calling thread is affected; the launcher's other threads are not.

The memory policy is set with `set_mempolicy(MPOL_BIND)` from libnuma (`libnuma.so.1`, loaded
with ctypes on the first binding that needs it). Without libnuma, or on a kernel without NUMA,
CPU binding still happens and `bound()` says memory binding was skipped.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .cpulist import parse_allowed, parse_cpu_list

LIBNUMA = "libnuma.so.1"
MPOL_BIND = 2
# Node masks passed to the kernel: get_mempolicy wants room for every possible node, and the
# kernel allows at most 1024 (CONFIG_NODES_SHIFT <= 10).
_MASK_BITS = 1024


# --- applying ----------------------------------------------------------------------------


@contextmanager
def bound(cpus: Collection[int] | None, mems: Collection[int] | None) -> Iterator[bool]:
    """Inside the block, the calling thread runs on `cpus` and allocates memory only from the
    nodes `mems` (None or empty: leave that alone), so a process it starts inherits both.
    Yields whether a memory binding is in force: False when `mems` was given but libnuma or
    the kernel's NUMA support is missing (the caller warns). Raises OSError when the kernel
    refuses a binding (CPUs or nodes outside the cpuset); the thread is then left as it was."""
    saved_cpus = os.sched_getaffinity(0) if cpus else None
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        policy = _mempolicy() if mems else None
        saved_policy = policy.bind(mems) if policy else None
        try:
            yield saved_policy is not None
        finally:
            if saved_policy is not None:
                policy.set(*saved_policy)
    finally:
        if saved_cpus is not None:
            os.sched_setaffinity(0, saved_cpus)


def memory_binding_available() -> bool:
    """Whether `bound()` can bind memory on this host (libnuma present, kernel with NUMA)."""
    return _mempolicy() is not None


class _MemPolicy:
    """The calling thread's memory policy, through libnuma's get_mempolicy/set_mempolicy."""

    def __init__(self, lib) -> None:
        import ctypes

        self._ctypes = ctypes
        ulong_bits = ctypes.sizeof(ctypes.c_ulong) * 8
        self._ulong_bits = ulong_bits
        self._mask_type = ctypes.c_ulong * (_MASK_BITS // ulong_bits)
        mask = ctypes.POINTER(self._mask_type)
        lib.set_mempolicy.argtypes = [ctypes.c_int, mask, ctypes.c_ulong]
        lib.get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int), mask, ctypes.c_ulong,
                                      ctypes.c_void_p, ctypes.c_ulong]
        self._lib = lib

    def bind(self, mems: Collection[int]) -> tuple[int, object]:
        """Set MPOL_BIND on `mems`; returns the previous (mode, nodes) for `set`."""
        mode, nodes = self._ctypes.c_int(), self._mask_type()
        if self._lib.get_mempolicy(self._ctypes.byref(mode), nodes, _MASK_BITS, None, 0) != 0:
            self._raise("get_mempolicy")
        self.set(MPOL_BIND, self._mask(mems))
        return mode.value, nodes

    def set(self, mode: int, nodes: object) -> None:
        # maxnode counts one more than the bits to read: the kernel reads maxnode - 1 bits.
        if self._lib.set_mempolicy(mode, nodes, _MASK_BITS + 1) != 0:
            self._raise("set_mempolicy")

    def _mask(self, nodes: Collection[int]) -> object:
        mask = self._mask_type()
        for node in nodes:
            if not 0 <= node < _MASK_BITS:
                raise OSError(f"NUMA node {node} is out of range")
            mask[node // self._ulong_bits] |= 1 << (node % self._ulong_bits)
        return mask

    def _raise(self, call: str) -> None:
        err = self._ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")


@functools.cache
def _mempolicy() -> _MemPolicy | None:
    import ctypes  # only once a memory binding is wanted: it costs start-up time

    try:
        lib = ctypes.CDLL(LIBNUMA, use_errno=True)
    except OSError:
        return None
    if lib.numa_available() < 0:  # the kernel has no NUMA support (no mempolicy syscalls)
        return None
    return _MemPolicy(lib)


# --- reading back ------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessBinding:
    """What a live process is bound to, as the kernel reports it."""

    cpus: tuple[int, ...]  # Cpus_allowed_list
    # The nodes its memory policy allocates from: the policy's nodes, or (default policy)
    # every node its cpuset allows. Mems_allowed_list alone would not show a memory binding:
    # it is the cpuset, which set_mempolicy does not change.
    mems: tuple[int, ...]
    mempolicy: str  # "default", "bind", "prefer", "interleave", "local", ... (numa_maps names)
    mems_allowed: tuple[int, ...]  # Mems_allowed_list


# numa_maps names a policy (some names have spaces), then optional =flags, then :nodes.
_POLICY = re.compile(
    r"\S+ (prefer \(many\)|weighted interleave|\w+)(?:=\S*?)?(?::([\d,-]+))?(?: |$)")


def read_binding(pid: int) -> ProcessBinding:
    """The binding process `pid` runs under, from `/proc/<pid>/status` and the memory policy
    shown in `/proc/<pid>/numa_maps`. Raises OSError when the process is gone."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    try:
        with open(f"/proc/{pid}/numa_maps") as f:
            # A mapping without a policy of its own shows the process's policy; the first
            # one is the program's text, which nothing gives a policy of its own.
            first_mapping = f.readline()
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):  # it is gone
            raise
        first_mapping = ""  # a kernel without NUMA has no numa_maps (and no policies)
    return parse_binding(status, first_mapping)


def parse_binding(status: str, numa_maps_line: str) -> ProcessBinding:
    """A `ProcessBinding` from the text of `/proc/<pid>/status` and a line of its numa_maps."""
    cpus, mems_allowed = parse_allowed(status)
    policy, nodes = parse_mempolicy(numa_maps_line)
    mems = nodes if nodes is not None else tuple(sorted(mems_allowed))
    return ProcessBinding(tuple(sorted(cpus)), mems, policy, tuple(sorted(mems_allowed)))


def parse_mempolicy(numa_maps_line: str) -> tuple[str, tuple[int, ...] | None]:
    """("bind", (0, 1)) from a numa_maps line "7f.. bind:0-1 file=...";
    ("default", None) when the policy names no nodes."""
    match = _POLICY.match(numa_maps_line)
    if not match:
        return "default", None
    return match[1], parse_cpu_list(match[2]) if match[2] else None
