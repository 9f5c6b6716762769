"""Binding a process to CPUs and NUMA memory from its first instruction, and reading it back.

A child inherits the CPU affinity and the memory policy of the *thread* that forks it, and keeps
both across exec. So `bound()` sets them on the calling thread around the `Popen` call and
restores them afterwards: the program, and every thread and child it makes, starts bound, and
nothing runs in Python between fork and exec (a `preexec_fn` would force the slow full fork:
docs/architecture.md, "Measured reasons"). Only the calling thread is affected; the launcher's
other threads are not.

Who does what:

- CPUs: `os.sched_setaffinity`, what taskset does.
- Memory, through py-libnuma (module `numa`): loading libnuma, asking whether the kernel has
  NUMA (`numa.info.numa_available`) and binding (`numa.memory.set_membind_nodes`: libnuma's
  numa_set_membind, MPOL_BIND). py-libnuma is imported on the first binding that needs memory,
  never by a run without one (its import costs ~4 ms in the launcher here: ctypes and its
  declarations; not the `ldconfig -p` run its own lookup of libnuma would make: `_import_numa`).
  When it cannot be imported (not
  installed; or no libnuma.so.1, which makes its own import fail) or the kernel has no NUMA,
  CPU binding still happens and `bound()` says memory binding was skipped.
- Memory, hand-written, because py-libnuma lacks it (class `_MemPolicy`):
  - reading the thread's policy whole, mode and nodes (get_mempolicy). py-libnuma reads only
    lossy pieces: `get_membind_nodes` answers "every node" both for the default policy and for a
    binding to every node, and nothing tells the mode.
  - putting that policy back exactly (set_mempolicy). py-libnuma cannot set MPOL_DEFAULT, the
    policy the launcher's thread normally has: its nearest, `set_local_alloc`, sets MPOL_LOCAL.
    A thread left bound (or "local") would hand that policy to everything the launcher starts
    afterwards, the instances it does not bind included, and they would show it in
    --report-bindings; an explicit policy also opts them out of automatic NUMA balancing.
  - the checks py-libnuma leaves out: node numbers before it parses them (`set_membind_nodes`
    passes libnuma's NULL "unparsable" mask on to numa_set_membind, which crashes the process),
    and the policy after it sets it (numa_set_membind returns nothing and reports a refusal
    only on stderr).
- Reading back a live process's binding: /proc (`read_binding`). py-libnuma reads only the
  calling thread's policy (libnuma's get_mempolicy has no pid), so it has nothing for this.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from .cpulist import format_cpu_list, parse_allowed, parse_cpu_list
from .uncompiled import dataclass  # read back only for --report-bindings: nothing compiled

MPOL_BIND = 2
_MPOL_MODE = 0xFF  # get_mempolicy's mode without its flags (MPOL_F_STATIC_NODES, ...)
_READS = 5  # of a process whose numa_maps comes back empty (read_binding)


# --- applying ----------------------------------------------------------------------------


@contextmanager
def bound(cpus: Collection[int] | None, mems: Collection[int] | None) -> Iterator[bool]:
    """Inside the block, the calling thread runs on `cpus` and allocates memory only from the
    nodes `mems` (None or empty: leave that alone), so a process it starts inherits both.
    Yields whether a memory binding is in force: False when `mems` was given but py-libnuma,
    libnuma or the kernel's NUMA support is missing (the caller warns). Raises OSError when a
    binding is refused (CPUs or nodes outside the cpuset); the thread is then left as it was."""
    # Before the CPUs are touched: py-libnuma's import may run `ldconfig -p` (_import_numa),
    # which need not run bound, and may fail.
    policy = _mempolicy() if mems else None
    if isinstance(policy, str):
        policy = None  # not possible here: the caller asks memory_binding_unavailable why
    saved_cpus = os.sched_getaffinity(0) if cpus else None
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        saved_policy = policy.bind(mems) if policy else None
        try:
            yield saved_policy is not None
        finally:
            if saved_policy is not None:
                policy.restore(saved_policy)
    finally:
        if saved_cpus is not None:
            os.sched_setaffinity(0, saved_cpus)


class _MemPolicy:
    """The calling thread's memory policy: bound by py-libnuma; read, checked and put back by
    hand with libnuma's get_mempolicy/set_mempolicy (py-libnuma lacks both: module docstring),
    called through py-libnuma's handle on libnuma."""

    def __init__(self, numa) -> None:
        import ctypes

        self._ctypes = ctypes
        self._numa = numa
        lib = numa.LIBNUMA
        # Node masks as large as the kernel's (py-libnuma sizes nodemask_t by libnuma's reading
        # of it); maxnode counts one more than the bits the kernel reads, as libnuma passes it.
        self._mask_type = numa.nodemask_t
        self._word_bits = ctypes.sizeof(ctypes.c_ulong) * 8
        self._maxnode = numa.MAX_NUMANODES + 1
        mask = ctypes.POINTER(numa.nodemask_t)
        # Prototypes of our own on the same handle, so that errno is kept (py-libnuma's handle
        # does not keep it) and py-libnuma's function attributes stay as it declared them.
        self._get = ctypes.CFUNCTYPE(
            ctypes.c_long, ctypes.POINTER(ctypes.c_int), mask, ctypes.c_ulong, ctypes.c_void_p,
            ctypes.c_ulong, use_errno=True)(("get_mempolicy", lib))
        self._set = ctypes.CFUNCTYPE(
            ctypes.c_long, ctypes.c_int, mask, ctypes.c_ulong, use_errno=True)(
            ("set_mempolicy", lib))
        # The nodes numa_parse_nodestring (under set_membind_nodes) accepts: the cpuset's
        # Mems_allowed as libnuma read it when loaded. Read from the mask's words, as
        # numa_bitmask_isbitset reads them (py-libnuma's get_bitset_list calls it for each
        # of the mask's 1024 bits: ~1 ms of the first binding spawn).
        allowed = ctypes.POINTER(numa.bitmask_t).in_dll(lib, "numa_all_nodes_ptr").contents
        words = allowed.maskp[:-(-allowed.size // self._word_bits)]
        self._parsable = frozenset(i * self._word_bits + bit for i, word in enumerate(words)
                                   for bit in range(self._word_bits) if word >> bit & 1)

    def bind(self, mems: Collection[int]) -> tuple[int, object]:
        """Bind the thread's allocations to the nodes `mems`; returns the previous policy for
        `restore`. Raises OSError, the policy unchanged, when the binding is refused."""
        nodes = frozenset(mems)
        if not nodes <= self._parsable:
            raise OSError(errno.EINVAL, f"set_mempolicy: NUMA node(s) "
                          f"{format_cpu_list(nodes - self._parsable)} not allowed here "
                          f"(Mems_allowed_list {format_cpu_list(self._parsable)})")
        saved = self._read()
        self._numa.memory.set_membind_nodes(*nodes)
        mode, now = self._read()
        got = sum(word << i * self._word_bits  # bit n: node n
                  for i, word in enumerate(now.n[:]) if word)
        # The kernel may leave out nodes without memory, never add one.
        if mode & _MPOL_MODE != MPOL_BIND or not got or got & ~sum(1 << n for n in nodes):
            self.restore(saved)
            raise OSError(errno.EINVAL, f"set_mempolicy: MPOL_BIND on NUMA node(s) "
                          f"{format_cpu_list(nodes)} refused")
        return saved

    def restore(self, saved: tuple[int, object]) -> None:
        """Put back a policy `bind` returned: mode, flags and nodes, as they were."""
        mode, mask = saved
        if self._set(mode, mask, self._maxnode) != 0:
            self._raise("set_mempolicy")

    def _read(self) -> tuple[int, object]:
        mode, mask = self._ctypes.c_int(), self._mask_type()
        if self._get(self._ctypes.byref(mode), mask, self._maxnode, None, 0) != 0:
            self._raise("get_mempolicy")
        return mode.value, mask

    def _raise(self, call: str) -> None:
        err = self._ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")


def memory_binding_available() -> bool:
    """Whether `bound()` can bind memory on this host (py-libnuma and libnuma present, kernel
    with NUMA). Imports py-libnuma."""
    return not isinstance(_mempolicy(), str)


def memory_binding_unavailable() -> str | None:
    """Why `bound()` cannot bind memory on this host, in a few words for a warning (which
    piece is missing and, for py-libnuma, where this Python looked); None when it can."""
    policy = _mempolicy()
    return policy if isinstance(policy, str) else None


@functools.cache
def _mempolicy() -> _MemPolicy | str:
    """The policy handle, or why there is none (memory_binding_unavailable)."""
    try:
        numa = _import_numa()  # py-libnuma, once a memory binding is wanted (module docstring)
    except ImportError as exc:  # not installed (an agent's finder says where it looked)
        return f"py-libnuma cannot be imported by {sys.executable} ({exc})"
    except (OSError, AttributeError):
        # Without libnuma.so.1 py-libnuma's import fails itself: ctypes.util.find_library("numa")
        # finds nothing, CDLL(None) is then the program, and the first libnuma function it
        # calls is not there (AttributeError). OSError: a libnuma found but not loadable.
        return f"libnuma ({LIBNUMA_SONAME}, package libnuma1) is missing or cannot be loaded"
    if not numa.info.numa_available():  # the kernel has no NUMA support (no mempolicy calls)
        return "the kernel has no NUMA support"
    return _MemPolicy(numa)


# libnuma's soname: what ctypes.util.find_library("numa") answers wherever libnuma is installed.
LIBNUMA_SONAME = "libnuma.so.1"


def _import_numa():
    """py-libnuma, whose import looks libnuma up with `ctypes.util.find_library("numa")`: that
    runs `ldconfig -p` (a process, and a parse of its whole listing: ~3 ms of every launch that
    binds memory, spreadnuma's default included). Here the loader answers instead: where
    libnuma's soname loads (what find_library would find, from the same ld.so cache), it is
    the answer; otherwise, or where find_library is not CPython's own (a test's stand-in), the
    lookup is find_library's as it is."""
    import ctypes
    import ctypes.util

    full = ctypes.util.find_library

    def find_library(name: str) -> str | None:
        if name == "numa" and full.__module__ == "ctypes.util":
            try:
                ctypes.CDLL(LIBNUMA_SONAME)
                return LIBNUMA_SONAME
            except OSError:
                pass
        return full(name)

    ctypes.util.find_library = find_library
    try:
        import numa
    finally:
        ctypes.util.find_library = full
    return numa


# --- reading back ------------------------------------------------------------------------
# From /proc: py-libnuma (libnuma) reads only the calling thread's own policy, not another
# process's.


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
# Compiled on first use (re's cache): read back only for --report-bindings and by agents.
_POLICY = r"\S+ (prefer \(many\)|weighted interleave|\w+)(?:=\S*?)?(?::([\d,-]+))?(?: |$)"


def read_binding(pid: int) -> ProcessBinding:
    """The binding process `pid` runs under, from `/proc/<pid>/status` and the memory policy
    shown in `/proc/<pid>/numa_maps`. Raises OSError when the process is gone (exited, reaped
    or not)."""
    for attempt in range(_READS):
        if attempt:
            time.sleep(0.001 * attempt)
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        if "\nState:\tZ" in status or "\nState:\tX" in status:
            # Exited, not reaped yet: its memory, and with it its policy, are gone.
            raise ProcessLookupError(errno.ESRCH, f"process {pid} has exited")
        try:
            with open(f"/proc/{pid}/numa_maps") as f:
                # A mapping without a policy of its own shows the process's policy; the first
                # one is the program's text, which nothing gives a policy of its own.
                first_mapping = f.readline()
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}"):  # it is gone
                raise
            first_mapping = ""  # a kernel without NUMA has no numa_maps (and no policies)
            break
        if first_mapping:
            break
        # Nothing: caught in an exec (numa_maps reads the memory the process had when it was
        # opened, gone by the read: 1 read in 20 right after a fork here), or exiting.
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
    match = re.match(_POLICY, numa_maps_line)
    if not match:
        return "default", None
    return match[1], parse_cpu_list(match[2]) if match[2] else None
