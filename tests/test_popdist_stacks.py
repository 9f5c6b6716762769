"""The instance side of `poprunctl stacks` (popdist/_stacks.py) and the reading side on the
instance's host (spawner/stackdump.py), with real processes: what `import popdist` costs,
that a stuck program answers, that nothing is ever killed by the signal."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SRC
from popdist._stacks import signal_number
from popdist.env import STACKS_FILE, STACKS_SIGNAL
from requires import skip_or_fail
from spawner import stackdump

pytestmark = pytest.mark.timeout(60)
PY = sys.executable


def test_signal_names_and_numbers():
    assert signal_number("SIGRTMIN+7") == signal.SIGRTMIN + 7
    assert signal_number("sigrtmin") == signal.SIGRTMIN
    assert signal_number("SIGUSR2") == signal.SIGUSR2 == signal_number("USR2")
    assert signal_number(str(int(signal.SIGUSR1))) == signal.SIGUSR1
    for bad in ("SIGKILL", "SIGSEGV", "SIGSTOP", "SIGNOPE", "SIGRTMIN+x", "", None, "0",
                "999", "a b"):
        assert signal_number(bad) is None, bad


def imports(env: dict[str, str]) -> tuple[set[str], str]:
    code = ("import sys, os; before = set(sys.modules); import popdist; "
            "print(' '.join(sorted(set(sys.modules) - before))); "
            "print(len(os.listdir('/proc/self/task')))")
    out = subprocess.run([PY, "-c", code], env={**os.environ, "PYTHONPATH": SRC, **env},
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return set(out[0].split()), out[1]


def test_under_poprun_popdist_adds_only_faulthandler_and_signal_and_no_thread(tmp_path):
    outside, threads_outside = imports({})
    inside, threads_inside = imports({STACKS_FILE: str(tmp_path / "0.stacks")})
    assert inside - outside <= {"faulthandler", "signal"}, inside - outside
    assert "faulthandler" not in outside  # outside poprun: nothing at all
    assert threads_outside == threads_inside == "1"
    assert (tmp_path / "0.stacks").exists()


def start(tmp_path, code: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A Python process that prints 'ready' once it is where the test wants it."""
    script = tmp_path / "prog.py"  # a file: the stacks quote its lines
    script.write_text(code)
    proc = subprocess.Popen([PY, str(script)], env={**os.environ, "PYTHONPATH": SRC,
                                                   STACKS_FILE: str(tmp_path / "0.stacks"),
                                                   **(env or {})},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


STUCK = """
import threading, time, popdist
lock = threading.Lock()
lock.acquire()
def blocked():
    lock.acquire()  # blocked here
threading.Thread(target=blocked, name="worker").start()
print("ready", flush=True)
time.sleep(60)  # main here
"""


def test_a_stuck_program_answers_with_every_thread(tmp_path):
    proc = start(tmp_path, STUCK)
    expected = ["lock.acquire()  # blocked here", "time.sleep(60)  # main here"]
    try:
        # Asked until both threads got there (bounded): "ready" is read before the main
        # thread's print returns, and the worker may not have run yet.
        deadline = time.monotonic() + 10
        while True:
            found = asyncio.run(stackdump.collect(proc.pid, 5))
            assert found["how"] == "popdist" and found["error"] is None, found
            innermost = sorted(t["frames"][0][3] for t in found["threads"])
            if innermost == expected or time.monotonic() > deadline:
                break
        assert innermost == expected
        again = asyncio.run(stackdump.collect(proc.pid, 5))  # asked twice: same answer
        assert len(again["threads"]) == 2
        assert proc.poll() is None  # and it runs on
    finally:
        proc.kill()
        proc.wait()


def test_a_handler_of_the_programs_own_is_chained(tmp_path):
    code = """
import signal, sys
signal.signal(signal.SIGUSR2, lambda *a: print("own handler", flush=True))
import popdist, time
print("ready", flush=True)
time.sleep(60)
"""
    proc = start(tmp_path, code, {STACKS_SIGNAL: "SIGUSR2"})
    try:
        found = asyncio.run(stackdump.collect(proc.pid, 5))
        assert found["how"] == "popdist", found
        assert proc.stdout.readline() == "own handler\n"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_program_without_popdist_is_never_sent_the_signal(tmp_path, monkeypatch):
    proc = start(tmp_path, "import time; print('ready', flush=True); time.sleep(60)")
    try:
        monkeypatch.setattr(stackdump, "find_pyspy", lambda: None)
        found = asyncio.run(stackdump.collect(proc.pid, 2))
        assert found["how"] is None and "has not imported popdist" in found["error"]
        assert "pip install 'poprun[stacks]'" in found["error"]
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_py_spy_reads_a_program_without_popdist(tmp_path):
    if stackdump.find_pyspy() is None:
        skip_or_fail("py-spy is not installed (pip install 'poprun[stacks]')",
                     "POPRUN_REQUIRE_TOOLS")
    proc = start(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)  # here\n")
    try:
        found = asyncio.run(stackdump.collect(proc.pid, 10))
        assert found["how"] == "py-spy" and found["error"] is None, found
        assert found["threads"][0]["frames"][0][3] == "time.sleep(60)  # here"
    finally:
        proc.kill()
        proc.wait()


def test_no_python_no_process_and_a_stopped_one_are_one_line_each_in_time(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        found = asyncio.run(stackdump.collect(sleeper.pid, 2))
        assert found["error"].startswith("not a Python program (") and not found["threads"]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert asyncio.run(stackdump.collect(sleeper.pid, 2))["error"] == "exited"
    proc = start(tmp_path, STUCK)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        found = asyncio.run(stackdump.collect(proc.pid, 0.5))
        assert "no answer" in found["error"]
    finally:
        proc.kill()
        proc.wait()


def test_a_shell_wrapper_is_looked_through(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(STUCK)
    proc = subprocess.Popen(["sh", "-c", f"{PY} {script}; true"],
                            env={**os.environ, "PYTHONPATH": SRC,
                                 STACKS_FILE: str(tmp_path / "0.stacks")},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        found = asyncio.run(stackdump.collect(proc.pid, 5))
        assert found["how"] == "popdist" and found["pid"] != proc.pid, found
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)])
        proc.kill()
        proc.wait()
