"""The open-file limit (spawner/fdlimit.py): poprun and each agent raise their soft limit to the
hard one, and a job that even the hard limit cannot hold is refused, naming the limit and the
need, before anything starts. Launches run under `prlimit --nofile=SOFT:HARD` (util-linux); a
remote host's limit is set on its sshd listener (`resource.prlimit`), which its sessions, and so
the agent, inherit."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, poprun_argv, poprun_env, reaped
from poprun.plan.jobhosts import JobHosts
from poprun.plan.hosts import Host
from requires import skip_or_fail
from spawner import fdlimit
from sshd_hosts import SshHosts, start_ssh_hosts, wait_until

pytestmark = pytest.mark.timeout(120)

# More instances than a soft limit of 256 holds: 70 x 4 descriptors, plus the process's own.
MANY = 70
SMALL = "256"


def prlimited(soft: str, hard: str, *args: str) -> list[str]:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        skip_or_fail("prlimit (util-linux) not installed", "POPRUN_REQUIRE_TOOLS")
    return [prlimit, f"--nofile={soft}:{hard}", "--", *poprun_argv(*OFFLINE, *args)]


def marking(directory: Path) -> list[str]:
    """An instance that leaves a file named by its pid holding its parent's pid (poprun for
    a local instance, the agent for a remote one), then waits to be stopped."""
    return ["sh", "-c", f'echo $PPID > "{directory}/$$"; exec sleep 60']


def marks(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.stat().st_size]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """Where the instances leave their marks (tmp_path holds the sshd hosts' files too)."""
    (tmp_path / "marks").mkdir()
    return tmp_path / "marks"


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- the counts --------------------------------------------------------------------------------


def test_the_needs_count_each_host_and_each_instance():
    assert fdlimit.launcher_need(0, 0) == fdlimit.LAUNCHER_BASE
    assert fdlimit.launcher_need(3, 2, output_files=5) == (
        fdlimit.LAUNCHER_BASE + 3 * fdlimit.PER_CONNECTION + 2 * fdlimit.PER_INSTANCE
        + 5 * fdlimit.PER_OUTPUT_FILES)
    assert fdlimit.agent_need(10) == fdlimit.AGENT_BASE + 10 * fdlimit.PER_INSTANCE
    assert fdlimit.shortfall(257, 256) and not fdlimit.shortfall(256, 256)
    assert not fdlimit.shortfall(10 ** 9, resource.RLIM_INFINITY)


def test_the_launchers_need_counts_local_instances_and_remote_hosts():
    hosts = JobHosts((Host("localhost"), Host("h1"), Host("h2")), frozenset({"h1", "h2"}),
                     (3, 4, 5))
    assert hosts.local_instances == 3
    assert hosts.open_files_here(output_files=False) == fdlimit.launcher_need(2, 3)
    assert hosts.open_files_here(output_files=True) == fdlimit.launcher_need(2, 3, 12)


def test_the_soft_limit_is_raised_to_the_hard_one():
    code = ("from spawner import fdlimit; before = fdlimit.limits(); after = "
            "fdlimit.raise_soft_limit(); print(before.soft, before.hard, after.soft, "
            "after.hard, *__import__('resource').getrlimit(7))")
    argv = prlimited(SMALL, "4096")[:3] + [sys.executable, "-c", code]
    done = subprocess.run(argv, env=poprun_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["256", "4096", "4096", "4096", "4096", "4096"]


# -- local launches -----------------------------------------------------------------------------


def test_a_launch_needing_more_than_the_soft_limit_runs(out):
    # Without the raise: "poprun: error: cannot start instance 59 (sh): Too many open files".
    done = subprocess.run(prlimited(SMALL, "4096", "--num-instances", str(MANY),
                                    "--num-replicas", str(MANY), "sh", "-c",
                                    f'echo $PPID > "{out}/$$"'),
                          env=poprun_env(), capture_output=True, timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(marks(out)) == MANY


def test_a_launch_the_hard_limit_cannot_hold_is_refused_before_anything_starts(out):
    done = subprocess.run(prlimited(SMALL, SMALL, "--num-instances", str(MANY),
                                    "--num-replicas", str(MANY), *marking(out)),
                          env=poprun_env(), capture_output=True, timeout=60)
    need = fdlimit.launcher_need(0, MANY)
    assert_usage_error(done, f"needs at least {need} open files in poprun",
                       f"{MANY} local instances", "open-file limit (ulimit -n) is 256 "
                       "(hard limit 256)")
    assert list(out.iterdir()) == []


def test_the_launchers_counted_need_is_a_floor(out):
    """What the launcher holds with every instance running is at least what it counts: a
    count above it would refuse jobs that fit."""
    count = 16
    argv = poprun_argv(*OFFLINE, "--num-instances", str(count), "--num-replicas", str(count),
                       *marking(out))
    with reaped(subprocess.Popen(argv, env=poprun_env(), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)) as proc:
        wait_until(lambda: len(marks(out)) == count, "every instance started", 60)
        assert {int(p.read_text()) for p in marks(out)} == {proc.pid}
        assert open_files(proc.pid) >= fdlimit.launcher_need(0, count)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


# -- remote hosts -------------------------------------------------------------------------------


@pytest.fixture
def hosts(tmp_path: Path):
    with start_ssh_hosts(2, tmp_path) as h:
        yield h


def limit_host(hosts: SshHosts, i: int, soft: int, hard: int) -> None:
    """Host i's sessions start under these limits: its sshd listener's, which they inherit."""
    resource.prlimit(hosts.hosts[i].proc.pid, resource.RLIMIT_NOFILE, (soft, hard))


def run_on(hosts: SshHosts, host: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(poprun_argv(*OFFLINE, "-H", host, "--num-instances", str(MANY),
                                      "--num-replicas", str(MANY), *args),
                          env=poprun_env(hosts.env()), capture_output=True, timeout=90)


def test_an_agent_needing_more_than_its_soft_limit_raises_it(hosts, out):
    limit_host(hosts, 0, 256, 4096)
    done = run_on(hosts, "h1", "sh", "-c", f'echo $PPID > "{out}/$$"')
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(marks(out)) == MANY


def test_a_host_whose_hard_limit_cannot_hold_its_instances_is_named(hosts, out):
    limit_host(hosts, 1, 256, 256)
    done = run_on(hosts, "h2", *marking(out))
    assert_usage_error(done, f"h2: its {MANY} instances need at least "
                       f"{fdlimit.agent_need(MANY)} open files in the poprun agent there",
                       "open-file limit (ulimit -n) is 256 (hard limit 256)")
    assert list(out.iterdir()) == []


def test_the_agents_counted_need_is_a_floor(hosts, out):
    count = 16
    argv = poprun_argv(*OFFLINE, "-H", "h1", "--num-instances", str(count), "--num-replicas",
                       str(count), *marking(out))
    with reaped(subprocess.Popen(argv, env=poprun_env(hosts.env()), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)) as proc:
        wait_until(lambda: len(marks(out)) == count, "every instance started", 60)
        agents = {int(p.read_text()) for p in marks(out)}
        assert len(agents) == 1 and proc.pid not in agents
        assert open_files(agents.pop()) >= fdlimit.agent_need(count)
        assert open_files(proc.pid) >= fdlimit.launcher_need(1, 0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
