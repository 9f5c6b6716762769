"""`spawner.binding` on live processes: what the kernel reports in `/proc/<pid>/status` and
`/proc/<pid>/numa_maps` of a bound child and of a grandchild it starts, the launcher's own
thread put back exactly as it was, and a host where py-libnuma cannot be imported (fresh
interpreters in which its import really fails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from poprun.plan.topology import parse_cpu_list
from requires import needs, skip_or_fail
from spawner.binding import (ProcessBinding, bound, memory_binding_available, parse_binding,
                             parse_mempolicy, read_binding)

ALLOWED = sorted(os.sched_getaffinity(0))
MEMS_ALLOWED = read_binding(os.getpid()).mems_allowed
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2,  # no switch: the machine's CPUs
                                    reason="binding to one of one CPUs cannot be told apart")
needs_libnuma = needs("POPRUN_REQUIRE_TOOLS", "libnuma.so.1 or kernel NUMA support is missing",
                      not memory_binding_available())
# A child that starts a grandchild, prints its pid and waits for it.
FAMILY = ["sh", "-c", "sleep 60 & echo $!; wait"]


def thread_mempolicy() -> tuple[str, tuple[int, ...] | None]:
    """The calling thread's own memory policy, as the kernel shows it."""
    with open(f"/proc/self/task/{threading.get_native_id()}/numa_maps") as f:
        return parse_mempolicy(f.readline())


def start_family(cpus, mems) -> tuple[subprocess.Popen, int, bool]:
    with bound(cpus, mems) as memory_bound:
        child = subprocess.Popen(FAMILY, stdout=subprocess.PIPE, start_new_session=True)
    grandchild = int(child.stdout.readline())
    return child, grandchild, memory_bound


def stop_family(child: subprocess.Popen) -> None:
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()


def on_a_thread_of_its_own(fn):
    """fn() on a new thread, which ends with it: a memory policy set there dies with it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=20)


# A fresh interpreter: runs `prelude`, starts one long sleep under bound(cpus, mems), says what
# it saw as one JSON line, and keeps the child until its stdin closes.
SPAWN_ONE = """
import json, os, signal, subprocess, sys
{prelude}
from spawner.binding import bound
with bound({cpus!r}, {mems!r}) as memory_bound:
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
numa_was_imported = "numa" in sys.modules
try:
    import numa
    numa_import = "ok"
except Exception as e:
    numa_import = type(e).__name__
print(json.dumps(dict(pid=child.pid, memory_bound=memory_bound,
                      numa_was_imported=numa_was_imported, numa_import=numa_import)), flush=True)
sys.stdin.read()
os.killpg(child.pid, signal.SIGKILL)
child.wait()
"""
# py-libnuma not installed: `import numa` raises ModuleNotFoundError.
NOT_INSTALLED = """
class NoNuma:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "numa":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoNuma())
"""
# No libnuma on the host: ctypes.util.find_library("numa") answers None, and py-libnuma's
# import fails on its own (it loads CDLL(None), the program, and misses libnuma's functions).
NO_LIBNUMA = """
import ctypes.util
_find = ctypes.util.find_library
ctypes.util.find_library = lambda name: None if name == "numa" else _find(name)
"""


@contextmanager
def one_spawn(cpus, mems, prelude="", wrapper=()):
    """What SPAWN_ONE saw, while its child lives."""
    script = SPAWN_ONE.format(prelude=prelude, cpus=cpus, mems=mems)
    proc = subprocess.Popen([*wrapper, sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the spawning interpreter failed (exit {proc.wait()})"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


def hiding_libnuma() -> list[str]:
    """A command prefix that runs a program in a mount namespace of its own where the loaded
    libnuma and the loader's cache (which ctypes.util.find_library reads) are empty files:
    a host without libnuma, as far as that program can tell. Skips where that is not allowed."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "/libnuma.so" in line}
    if len(libs) != 1 or not os.path.exists("/etc/ld.so.cache"):
        skip_or_fail("no loaded libnuma, or no loader cache, to hide", "POPRUN_REQUIRE_TOOLS")
    prefix = ["unshare", "-m", "sh", "-c",
              'mount --bind /dev/null /etc/ld.so.cache && mount --bind /dev/null "$0" && exec "$@"',
              os.path.realpath(libs.pop())]
    try:
        if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
            # no switch: a privilege of the machine's, no package
            pytest.skip("no permission for a mount namespace (unshare -m) and mounts in it")
    except FileNotFoundError:
        skip_or_fail("unshare is not installed", "POPRUN_REQUIRE_TOOLS")
    return prefix


@needs_two_cpus
@needs_libnuma
@pytest.mark.timeout(30)
def test_child_and_grandchild_are_bound():
    cpu = ALLOWED[-1]
    before = os.sched_getaffinity(0), thread_mempolicy()
    child, grandchild, memory_bound = start_family((cpu,), (0,))
    try:
        assert memory_bound
        for pid in (child.pid, grandchild):
            got = read_binding(pid)
            assert got.cpus == (cpu,)
            assert (got.mempolicy, got.mems) == ("bind", (0,))
    finally:
        stop_family(child)
    assert (os.sched_getaffinity(0), thread_mempolicy()) == before


@pytest.mark.timeout(30)
def test_unbound_child_reports_everything_allowed():
    child, grandchild, memory_bound = start_family(None, None)
    try:
        assert not memory_bound
        got = read_binding(grandchild)
        assert got.cpus == tuple(ALLOWED)
        assert got.mempolicy == "default"
        assert got.mems == got.mems_allowed
    finally:
        stop_family(child)


@needs_libnuma
@pytest.mark.timeout(30)
def test_a_later_unbound_child_gets_the_default_policy():
    # The launcher's thread goes back to MPOL_DEFAULT, not left bound or "local" (the nearest
    # py-libnuma can set): what it starts afterwards unbound inherits the default.
    if thread_mempolicy() != ("default", None):
        pytest.skip("the tests run under a memory policy of their own")  # no switch: how run
    child, _, memory_bound = start_family(None, (0,))
    stop_family(child)
    assert memory_bound
    child, grandchild, _ = start_family(None, None)
    try:
        assert read_binding(grandchild).mempolicy == "default"
    finally:
        stop_family(child)
    assert thread_mempolicy() == ("default", None)


@needs_libnuma
@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["interleave", "prefer", "local", "bind"])
def test_the_launchers_own_policy_is_restored_exactly(policy):
    # poprun run under numactl --interleave, --preferred, --localalloc or --membind: the
    # instances get their binding, and the launcher's thread its own policy back. Set (with
    # py-libnuma) on a thread of its own, so that this one keeps the default.
    import numa

    set_policy = {"interleave": lambda: numa.memory.set_interleave_nodes(0),
                  "prefer": lambda: numa.schedule.set_preferred_node(0),
                  "local": numa.memory.set_local_alloc,
                  "bind": lambda: numa.memory.set_membind_nodes(0)}[policy]

    def launcher():
        set_policy()
        before = thread_mempolicy()
        child, grandchild, memory_bound = start_family((ALLOWED[-1],), (0,))
        try:
            got = read_binding(grandchild)
        finally:
            stop_family(child)
        return before, memory_bound, got, thread_mempolicy()

    ours = thread_mempolicy()
    before, memory_bound, got, after = on_a_thread_of_its_own(launcher)
    assert before[0] == policy
    assert memory_bound
    assert (got.cpus, got.mempolicy, got.mems) == ((ALLOWED[-1],), "bind", (0,))
    assert after == before
    assert thread_mempolicy() == ours


@needs_two_cpus
@pytest.mark.timeout(30)
@pytest.mark.parametrize("host", ["py-libnuma not installed", "no libnuma",
                                  "libnuma hidden in a mount namespace"])
def test_without_py_libnuma_cpus_are_still_bound(host):
    # py-libnuma's import really fails in the spawning interpreter: CPU binding still
    # happens, and memory binding is reported as skipped.
    prelude, wrapper, failure = {
        "py-libnuma not installed": (NOT_INSTALLED, (), "ModuleNotFoundError"),
        "no libnuma": (NO_LIBNUMA, (), "AttributeError"),
        "libnuma hidden in a mount namespace": ("", hiding_libnuma(), None),
    }[host]
    with one_spawn((ALLOWED[0],), (0,), prelude, wrapper) as seen:
        if failure:
            assert seen["numa_import"] == failure
        else:
            assert seen["numa_import"] != "ok"
        assert not seen["memory_bound"]  # the caller warns that memory binding was skipped
        got = read_binding(seen["pid"])
        assert got.cpus == (ALLOWED[0],)
        assert got.mempolicy == thread_mempolicy()[0]  # left alone: inherited from here


@pytest.mark.timeout(30)
def test_no_memory_binding_does_not_import_py_libnuma():
    with one_spawn((ALLOWED[-1],), None) as seen:
        assert not seen["numa_was_imported"]
        assert not seen["memory_bound"]
        assert read_binding(seen["pid"]).cpus == (ALLOWED[-1],)


@needs_two_cpus
@pytest.mark.timeout(30)
def test_only_the_calling_thread_is_bound():
    main = threading.get_native_id()
    seen = {}

    def spawn_side():
        with bound((ALLOWED[0],), None):
            seen["worker"] = os.sched_getaffinity(0)
            with open(f"/proc/self/task/{main}/status") as f:
                seen["main"] = next(line for line in f if line.startswith("Cpus_allowed_list"))
        seen["after"] = os.sched_getaffinity(0)

    worker = threading.Thread(target=spawn_side)
    worker.start()
    worker.join(timeout=10)
    assert seen["worker"] == {ALLOWED[0]}
    assert seen["after"] == set(ALLOWED)
    assert parse_cpu_list(seen["main"].split(":")[1]) == tuple(ALLOWED)


def test_refused_cpus_leave_the_thread_as_it_was():
    with pytest.raises(OSError):
        with bound((max(ALLOWED) + 4096,), None):
            pytest.fail("entered a binding the kernel refused")
    assert os.sched_getaffinity(0) == set(ALLOWED)


@needs_libnuma
@pytest.mark.parametrize("node", [1023, max(MEMS_ALLOWED) + 1])
def test_refused_memory_nodes_restore_the_cpus(node):
    # No such node here. Refused before py-libnuma sees it: its set_membind_nodes would crash
    # the process on a node libnuma cannot parse.
    before = thread_mempolicy()
    with pytest.raises(OSError, match="set_mempolicy"):
        with bound((ALLOWED[0],), (node,)):
            pytest.fail("entered a binding the kernel refused")
    assert os.sched_getaffinity(0) == set(ALLOWED)
    assert thread_mempolicy() == before


def test_binding_is_restored_after_an_error_inside():
    before = thread_mempolicy()
    with pytest.raises(RuntimeError):
        with bound((ALLOWED[0],), (0,)):
            raise RuntimeError("Popen failed")
    assert os.sched_getaffinity(0) == set(ALLOWED)
    assert thread_mempolicy() == before


@needs_libnuma
@pytest.mark.timeout(60)
def test_read_binding_of_a_process_caught_in_an_exec():
    # The grandchild's pid comes right after its fork, often while it execs sleep: numa_maps
    # opened before the exec reads nothing (the old memory is gone), which is no policy at
    # all, not the default one. Read before the fix, 1 in 3 came back "default" here.
    for _ in range(50):
        child, grandchild, _ = start_family(None, (0,))
        try:
            assert read_binding(grandchild).mempolicy == "bind"
        finally:
            stop_family(child)


@pytest.mark.timeout(30)
def test_read_binding_of_a_gone_process():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(OSError):
        read_binding(proc.pid)


@pytest.mark.timeout(30)
def test_read_binding_of_an_exited_unreaped_process():
    # A zombie still has a status, but no memory and so no policy: not "default", gone.
    proc = subprocess.Popen(["true"])
    try:
        while True:
            with open(f"/proc/{proc.pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    break
        with pytest.raises(OSError):
            read_binding(proc.pid)
    finally:
        proc.wait()


@pytest.mark.parametrize("line, policy", [
    ("55d0 bind:0 file=/usr/bin/head mapped=2 N0=2 kernelpagesize_kB=4\n", ("bind", (0,))),
    ("55d0 default file=/usr/bin/head mapped=2\n", ("default", None)),
    ("7f00 prefer:1 anon=1\n", ("prefer", (1,))),
    ("7f00 interleave=static:0-3 heap\n", ("interleave", (0, 1, 2, 3))),
    ("7f00 bind=static|balancing:0,2\n", ("bind", (0, 2))),
    ("7f00 prefer (many):0-1 anon=3\n", ("prefer (many)", (0, 1))),
    ("7f00 weighted interleave:0-1\n", ("weighted interleave", (0, 1))),
    ("7f00 local stack\n", ("local", None)),
    ("", ("default", None)),
])
def test_parse_mempolicy(line, policy):
    assert parse_mempolicy(line) == policy


STATUS = "Name:\tsh\nCpus_allowed_list:\t4-7\nMems_allowed_list:\t0-3\nThreads:\t1\n"


@pytest.mark.parametrize("line, expected", [
    ("55d0 bind:2 file=/bin/sh\n", ProcessBinding((4, 5, 6, 7), (2,), "bind", (0, 1, 2, 3))),
    ("55d0 default file=/bin/sh\n", ProcessBinding((4, 5, 6, 7), (0, 1, 2, 3), "default",
                                                    (0, 1, 2, 3))),
    ("", ProcessBinding((4, 5, 6, 7), (0, 1, 2, 3), "default", (0, 1, 2, 3))),
])
def test_parse_binding(line, expected):
    assert parse_binding(STATUS, line) == expected
