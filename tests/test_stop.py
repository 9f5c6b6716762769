"""End-to-end tests of how a job ends badly: failing instances, signals, orphans, cleanup.

docs/architecture.md, "Runtime guarantees": no orphans ever (an instance fails, Ctrl-C, SIGTERM,
SIGKILL of poprun itself), cleanup on every exit path; "Errors and exit statuses": a failed job
exits with the failing instance's status.

Every instance (and a grandchild it starts) writes its pid to a file in the test's directory,
so survivors are checked by pid. The grandchildren ignore SIGINT and SIGTERM: only the kill of
their instance's whole process group (or the lifeline's) can stop them. Each job also carries a
unique marker in every command line, to find anything else it may have left (the watchdog).
Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import poprun_argv, poprun_env

PY = sys.executable
OFF = "--offline-mode=yes"
START_TIMEOUT = 30  # for instances to start and register (they take well under a second)
END_TIMEOUT = 30  # for poprun to finish once it has been told to
GONE_TIMEOUT = 5  # for killed processes to disappear (orphans are reaped by init)
QUICK = 10  # "well under": what the fast paths must beat by far

_FOREIGN = ("POPTORCH_CACHE_DIR", "POPART_CACHE_DIR", "TF_POPLAR_FLAGS", "IPUOF_CONFIG_PATH")

# argv: DIR MARKER NAME. Ignores the polite signals; registers its pid; sleeps.
GRANDCHILD = r"""
import os, signal, sys, time
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
d, name = sys.argv[1], sys.argv[3]
with open(os.path.join(d, name + ".tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name + ".pid"))
time.sleep(300)
"""

# argv: DIR MARKER ACTION-OF-INSTANCE-0 ACTION-OF-INSTANCE-1 ...
INSTANCE = r"""
import os, signal, subprocess, sys, time
d, marker = sys.argv[1], sys.argv[2]
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
action = sys.argv[3 + rank]

def put(name, text):
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name))

def wait_for_everyone():  # every instance and every grandchild has registered
    deadline = time.monotonic() + 30
    while sum(n.endswith(".pid") for n in os.listdir(d)) < 2 * size:
        if time.monotonic() > deadline:
            sys.exit("the others did not start in time")
        time.sleep(0.01)

if action == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if action == "ignore-int":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
put(f"cache.{rank}", os.environ.get("POPDIST_EXECUTABLE_CACHE_PATH", ""))
subprocess.Popen([sys.executable, "-c", os.environ["GRANDCHILD"], d, marker, f"gc.{rank}"])
put(f"inst.{rank}.pid", str(os.getpid()))
if action == "exit3":
    wait_for_everyone()
    for n in range(25):
        print(f"boom {n}", file=sys.stderr)
    sys.exit(3)
if action == "sigkill":
    wait_for_everyone()
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


def clean_env() -> dict[str, str]:
    env = poprun_env({"GRANDCHILD": GRANDCHILD})
    for name in _FOREIGN:
        env.pop(name, None)
    return env


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("State:"):
                    return line.split()[1] != "Z"
    except FileNotFoundError:
        return False
    return True


def marked(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line carries `marker`."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if needle not in fh.read():
                    continue
        except OSError:
            continue
        if alive(int(entry)):
            found.append(int(entry))
    return found


def wait_until(condition, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


class Job:
    """One poprun run in the background, with the instances' pid files in `self.dir`."""

    def __init__(self, tmp_path: Path, program: list[str], num_instances: int,
                 options: tuple[str, ...]) -> None:
        self.dir = tmp_path / "reg"
        self.dir.mkdir()
        self.marker = f"poprun-test-{uuid.uuid4().hex}"
        self.n = num_instances
        self._out = tmp_path / "stdout"
        self._err = tmp_path / "stderr"
        argv = poprun_argv("--num-instances", str(num_instances), "--num-replicas",
                           str(num_instances), OFF, *options,
                           *[a.format(dir=self.dir, marker=self.marker) for a in program])
        with open(self._out, "wb") as out, open(self._err, "wb") as err:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(argv, env=clean_env(), stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err)

    @property
    def stdout(self) -> bytes:
        return self._out.read_bytes()

    @property
    def stderr(self) -> bytes:
        return self._err.read_bytes()

    def pids(self) -> dict[str, int]:
        return {p.name[:-4]: int(p.read_text()) for p in self.dir.glob("*.pid")}

    def wait_running(self, expected: int | None = None) -> dict[str, int]:
        """Until every instance and grandchild has registered its pid."""
        expected = 2 * self.n if expected is None else expected

        def ready():
            pids = self.pids()
            if len(pids) == expected:  # (an instance may end the job right after this)
                return pids
            assert self.proc.poll() is None, (
                f"poprun ended early ({self.proc.returncode}): {self.stderr!r}")
            return None

        return wait_until(ready, START_TIMEOUT, "the instances to start")

    def cache_dir(self) -> str:
        paths = {p.read_text() for p in self.dir.glob("cache.*")}
        assert len(paths) == 1, paths
        (path,) = paths
        assert path, "no temporary executable cache was set"
        return path

    def finish(self, timeout: float = END_TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def assert_no_survivors(self) -> None:
        pids = self.pids()
        assert pids, "nothing registered"
        left = []
        deadline = time.monotonic() + GONE_TIMEOUT
        while True:
            left = {name: pid for name, pid in pids.items() if alive(pid)}
            others = marked(self.marker)
            if not left and not others:
                return
            assert time.monotonic() < deadline, (
                f"survivors {GONE_TIMEOUT} s after the end: {left}, marked: {others}")
            time.sleep(0.02)

    def kill_everything(self) -> None:
        """Last resort after a failed test: no sleeper may outlive it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=END_TIMEOUT)
        for pid in marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def start(tmp_path: Path):
    """`start(actions, *options)`: poprun with one instance per action (see INSTANCE);
    `start(program=[...], n=..)` for another program ({dir} and {marker} are filled in)."""
    jobs: list[Job] = []
    script = tmp_path / "instance.py"
    script.write_text(INSTANCE)

    def _start(actions: tuple[str, ...] = (), *options: str, program: list[str] | None = None,
               n: int | None = None) -> Job:
        if program is None:
            program = [PY, str(script), "{dir}", "{marker}", *actions]
            n = len(actions)
        job = Job(tmp_path, program, n, options)
        jobs.append(job)
        return job

    yield _start
    for job in jobs:
        job.kill_everything()


# --- an instance fails -------------------------------------------------------------------


def test_failing_instance_stops_the_others_and_is_reported(start) -> None:
    # Only instance 0's output reaches the console, so what poprun says about instance 1's
    # stderr can only come from its failure report.
    job = start(("sleep", "exit3", "sleep"), "--only-output-from-instance=0")
    pids = job.wait_running()
    cache = job.cache_dir()
    assert job.finish() == 3
    assert job.elapsed() < QUICK  # the sleepers die of the SIGTERM: no kill timeout involved
    err = job.stderr
    assert b"instance 1" in err and b"pid %d" % pids["inst.1"] in err
    assert b"exited with status 3" in err
    assert b"boom 23" in err and b"boom 24" in err  # its last stderr lines
    assert b"SIGTERM" in err  # what happened to the others
    job.assert_no_survivors()
    assert not os.path.exists(cache)


def test_instance_ignoring_sigterm_is_killed_after_kill_timeout(start) -> None:
    job = start(("ignore-term", "exit3"), "--kill-timeout=1")
    job.wait_running()
    assert job.finish() == 3
    assert job.elapsed() < QUICK
    assert b"SIGKILL" in job.stderr  # instance 0 needed the hard kill
    job.assert_no_survivors()


def test_instance_killed_by_sigkill(start) -> None:
    job = start(("sleep", "sigkill"))
    job.wait_running()
    cache = job.cache_dir()
    assert job.finish() == 137
    assert b"SIGKILL" in job.stderr
    job.assert_no_survivors()
    assert not os.path.exists(cache)


SHELL = ('"$0" -c "$GRANDCHILD" "$1" "$2" "gc.$RANK" & '
         'echo $$ > "$1/sh.$RANK.tmp" && mv "$1/sh.$RANK.tmp" "$1/sh.$RANK.pid"; wait')


def test_grandchild_of_a_shell_instance_dies_with_it(start) -> None:
    job = start(program=["sh", "-c", SHELL, PY, "{dir}", "{marker}"], n=2)
    pids = job.wait_running()
    os.kill(pids["sh.0"], signal.SIGKILL)  # instance 0 dies; its grandchild must follow
    assert job.finish() == 137
    assert job.elapsed() < QUICK
    job.assert_no_survivors()


# --- signals to poprun -------------------------------------------------------------------


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_stops_the_job(start, sig: int, code: int) -> None:
    job = start(("sleep", "sleep"))
    job.wait_running()
    cache = job.cache_dir()
    assert os.path.isdir(cache)
    job.proc.send_signal(sig)
    assert job.finish() == code
    assert job.elapsed() < QUICK
    job.assert_no_survivors()
    assert not os.path.exists(cache)


def test_second_sigint_kills_at_once(start) -> None:
    job = start(("ignore-int", "sleep"), "--kill-timeout=60")
    pids = job.wait_running()
    first = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    # The first Ctrl-C reached the instances: the obedient one is gone, the other is not.
    wait_until(lambda: not alive(pids["inst.1"]), QUICK, "instance 1 to obey SIGINT")
    assert alive(pids["inst.0"]) and job.proc.poll() is None
    job.proc.send_signal(signal.SIGINT)
    assert job.finish() == 130
    assert time.monotonic() - first < QUICK  # not the 60 s kill timeout
    job.assert_no_survivors()


def test_sigkill_of_poprun_leaves_no_orphans(start) -> None:
    """The lifeline: no `finally` runs in poprun, yet its instances, their children and the
    temporary cache directory all go, and so does the watchdog itself."""
    job = start(("sleep", "ignore-term"))
    job.wait_running()
    cache = job.cache_dir()
    assert os.path.isdir(cache)
    job.proc.kill()
    assert job.finish() == -signal.SIGKILL
    job.assert_no_survivors()
    wait_until(lambda: not os.path.exists(cache), GONE_TIMEOUT, "the cache dir to be removed")
