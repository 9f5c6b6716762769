"""`spawner.binding` on live processes: what the kernel reports in `/proc/<pid>/status` and
`/proc/<pid>/numa_maps` of a bound child and of a grandchild it starts, and the launcher's own
thread put back as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from poprun.topology import parse_cpu_list
from spawner import binding
from spawner.binding import (ProcessBinding, bound, memory_binding_available, parse_binding,
                             parse_mempolicy, read_binding)

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2,
                                    reason="binding to one of one CPUs cannot be told apart")
needs_libnuma = pytest.mark.skipif(not memory_binding_available(),
                                   reason="libnuma.so.1 or kernel NUMA support is missing")
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


@pytest.fixture
def without_libnuma(monkeypatch):
    monkeypatch.setattr(binding, "LIBNUMA", "libnuma-that-is-not-installed.so.1")
    binding._mempolicy.cache_clear()
    yield
    binding._mempolicy.cache_clear()


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


@needs_two_cpus
@pytest.mark.timeout(30)
def test_without_libnuma_cpus_are_still_bound(without_libnuma):
    assert not memory_binding_available()
    child, grandchild, memory_bound = start_family((ALLOWED[0],), (0,))
    try:
        assert not memory_bound  # the caller warns that memory binding was skipped
        got = read_binding(grandchild)
        assert got.cpus == (ALLOWED[0],)
        assert got.mempolicy == "default"
    finally:
        stop_family(child)


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
def test_refused_memory_nodes_restore_the_cpus():
    before = thread_mempolicy()
    with pytest.raises(OSError, match="set_mempolicy"):
        with bound((ALLOWED[0],), (1023,)):  # no such node: the kernel says EINVAL
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


@pytest.mark.timeout(30)
def test_read_binding_of_a_gone_process():
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(OSError):
        read_binding(proc.pid)


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
