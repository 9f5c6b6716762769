"""Shared test helpers: run the real `poprun` (as `python -m poprun`) in a subprocess."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")
# Which test left poprun's temporary directories behind: a report after the run.
pytest_plugins = ["leftovers"]


def poprun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a poprun under test: this checkout's sources first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("CI", None)  # CI disables the dashboard; tests decide that themselves
    env.update(extra or {})
    return env


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """`with reaped(Popen(...)) as proc:` a process that must not outlive the test: killed
    and reaped on the way out if it still runs (an assertion failed, a wait timed out)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def second_user(prefix: str = "poprun-t"):
    """A real second local user (useradd; no home, no login shell), its pwd entry; removed
    after (userdel). Needs root."""
    import pwd
    import uuid

    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def poprun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "poprun", *args]


def run_poprun(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
               cwd: str | os.PathLike | None = None, input: bytes | None = None
               ) -> subprocess.CompletedProcess:
    """Run poprun to completion; stdout/stderr captured as bytes."""
    return subprocess.run(poprun_argv(*args), env=poprun_env(env), cwd=cwd, input=input,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)


OFFLINE = ("--offline-mode=yes",)


def run_poprunctl(*args: str, env: dict[str, str], text: bool = False
                  ) -> subprocess.CompletedProcess:
    """Run `poprunctl` to completion (this checkout's), stdout/stderr captured."""
    return subprocess.run([sys.executable, "-m", "poprun.cli.ctl", *args], env=poprun_env(env),
                          capture_output=True, text=text, timeout=60)


@pytest.fixture
def job_state(tmp_path, monkeypatch):
    """A state directory of the test's own (jobs' records and logs, for poprunctl): set for
    this process, and returned as the environment to give the poprun and poprunctl it runs."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return {"XDG_RUNTIME_DIR": str(run)}


def assert_usage_error(proc, *fragments: str, stdout_empty: bool = True) -> str:
    """Exit status 2, exactly one stderr line `poprun: error: ...` containing `fragments`,
    no traceback (and, unless told otherwise, nothing on stdout). Returns the line."""
    err = proc.stderr.decode()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("poprun: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    if stdout_empty:
        assert proc.stdout == b""
    return lines[0]


@pytest.fixture
def poprun():
    """`poprun(*args, timeout=..., env=..., cwd=...)` -> CompletedProcess (bytes)."""
    return run_poprun


from slurm_cluster import slurm_cluster  # noqa: E402,F401  a one-machine Slurm cluster


@pytest.fixture
def dead_host_leftovers():
    """For tests that kill a host whole: its agent's temporary dirs are removed at the end
    (sshd_hosts.dead_host_leftovers)."""
    from sshd_hosts import dead_host_leftovers as leftovers

    with leftovers():
        yield


@pytest.fixture(autouse=True, scope="session")
def _private_state_dir(tmp_path_factory):
    """Job records and crash files (jobs.jobs_dir, crash.state_dir) go under
    $XDG_RUNTIME_DIR: the test session gets its own, so it never fills (or reads) the real
    user's `poprunctl list`. Subprocesses inherit it through poprun_env."""
    state = tmp_path_factory.mktemp("xdg-runtime")
    state.chmod(0o700)
    previous = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(state)
    yield state
    if previous is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = previous


@pytest.fixture(autouse=True)
def _no_quarantine_between_tests(_private_state_dir):
    """Every test's hosts are h1, h2...: a host one test's job lost, quarantined for this
    user's later jobs (poprun/jobctl/quarantine.py), must not leave the next test's out."""
    yield
    (_private_state_dir / "poprun" / "quarantine.json").unlink(missing_ok=True)


def wait_started(launcher_pid: int, count: int, timeout: float = 30,
                 environ: dict[str, str] | None = None) -> None:
    """Until the poprun of `launcher_pid` knows `count` of its instances run: its job record
    says so (poprun/jobctl/records.py; rewritten as they start, in the session's XDG_RUNTIME_DIR).
    Seeing the processes in /proc is not enough for a test that then kills a host: their
    STARTED frames may still be on the way, and a host lost then is a launch that failed
    (exit 2), not a running job that lost a host. `environ`: the job's, when it has its own
    XDG_RUNTIME_DIR."""
    from poprun.jobctl import records as jobs
    from sshd_hosts import wait_until

    def running() -> int:
        for record in jobs.scan(environ or os.environ).records:
            if (record.get("launcher") or {}).get("pid") == launcher_pid:
                return sum(i.get("state") == "running" for i in record["instances"])
        return 0

    wait_until(lambda: running() >= count, f"poprun to see {count} instance(s) run", timeout)


def remove_job_leftovers(environ: dict[str, str] | None = None,
                         launcher: int | None = None) -> None:
    """What jobs killed outright with their watchdogs (on purpose: poprun and its watchdog
    SIGKILLed, so nothing cleaned up) left in the temporary directory and /dev/shm, as their
    records name it: caches, error directories, PMIx worlds' directories (a Python with
    mpi4py gets one). `launcher`: only the job of that poprun."""
    import shutil

    from poprun.jobctl import records
    from spawner.reaphere import pmix_leftovers

    for record in records.scan(environ or os.environ).records:
        if launcher is not None and (record.get("launcher") or {}).get("pid") != launcher:
            continue
        paths = [*(record.get("caches") or {}).values(),
                 *(record.get("error_dirs") or {}).values()]
        for names in (record.get("mpi_worlds") or {}).values():
            paths += [p for name in names for p in pmix_leftovers(name)]
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


def run_poprun_peak(*args: str, timeout: float = 60, env: dict[str, str] | None = None
                    ) -> tuple[subprocess.CompletedProcess, int]:
    """Run poprun to completion as `run_poprun` does; also its peak resident memory (KiB,
    /proc's VmHWM, read until it exits: the last reading is within 50 ms of its end)."""
    import threading

    proc = subprocess.Popen(poprun_argv(*args), env=poprun_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    peak = [0]

    def watch() -> None:
        while proc.returncode is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    peak[0] = max(peak[0], next(int(line.split()[1]) for line in f
                                                if line.startswith("VmHWM:")))
            except (OSError, StopIteration):
                return
            time.sleep(0.05)  # a sampling period, not a wait for an event

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with reaped(proc):
        out, err = proc.communicate(timeout=timeout)
    watcher.join(timeout=5)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak[0]
