"""Instances on one host share one session, and so one scheduling autogroup, yet each leads a
process group of its own and none has a controlling terminal (docs/architecture.md, "One
session per host and attempt"). Real poprun on a real pseudo-terminal, real sshd hosts, the
kernel's own view of every process (/proc/PID/stat, /proc/PID/autogroup)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spawner import sessionleader
from spawner.local import LocalSpawner, ProcessSpec

from conftest import OFFLINE, poprun_argv, poprun_env
from sshd_hosts import start_ssh_hosts
from terminal import run_on_a_terminal

PY = sys.executable
TIMEOUT = 60
AUTOGROUPS = os.path.exists("/proc/self/autogroup")  # CONFIG_SCHED_AUTOGROUP

# Each instance reports what the kernel says of it, and what opening /dev/tty does.
FACTS = r"""
import json, os
if os.isatty(0):  # the launcher's terminal, as instance 0's stdin: opened, it must not become ours
    os.close(os.open(os.ttyname(0), os.O_RDWR))
try:
    os.close(os.open('/dev/tty', os.O_RDWR))
    tty = 'opened'
except OSError as exc:
    tty = exc.errno
rest = open('/proc/self/stat').read().rsplit(')', 1)[1].split()
group = open('/proc/self/autogroup').read().split()[0] if os.path.exists('/proc/self/autogroup') else None
print('FACTS ' + json.dumps(dict(pid=os.getpid(), ppid=int(rest[1]), pgrp=int(rest[2]),
      sid=int(rest[3]), tty_nr=int(rest[4]), tty=tty, autogroup=group)), flush=True)
"""

# poprun in a session of its own whose controlling terminal is the pty: as from a shell.
ON_ITS_TERMINAL = r"""
import fcntl, os, sys, termios
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
group = open('/proc/self/autogroup').read().split()[0] if os.path.exists('/proc/self/autogroup') else None
os.write(2, ('LAUNCHER %d %s\n' % (os.getpid(), group)).encode())
os.execv(sys.executable, [sys.executable, '-m', 'poprun', *sys.argv[1:]])
"""


def facts(output: str) -> list[dict]:
    """Each instance's facts, once (on a terminal the dashboard's "last line" column shows
    a line again, cut short)."""
    found: dict[int, dict] = {}
    for line in output.splitlines():
        if "FACTS {" in line:
            try:
                fact = json.loads(line.split("FACTS ", 1)[1])
            except json.JSONDecodeError:
                continue
            found[fact["pid"]] = fact
    return list(found.values())


def assert_one_session_of_groups(seen: list[dict], launcher: int | None) -> None:
    sids = {f["sid"] for f in seen}
    assert len(sids) == 1, seen  # one session for the host's instances...
    sid = sids.pop()
    for f in seen:
        assert f["pgrp"] == f["pid"], f  # ...each a process group of its own
        assert f["sid"] != f["pid"], f  # not a session leader: it can never get a terminal
        assert f["tty_nr"] == 0, f  # no controlling terminal
        assert f["tty"] == errno.ENXIO, f  # /dev/tty: "No such device or address"
        if launcher is not None:
            assert f["ppid"] == launcher, f  # the launcher's child, as before
    assert sid not in {f["pid"] for f in seen}
    if AUTOGROUPS:
        assert len({f["autogroup"] for f in seen}) == 1, seen


def test_local_instances_share_one_session_and_autogroup_without_a_terminal():
    code, out = run_on_a_terminal(*OFFLINE, "--num-instances=3", "--num-replicas=3", PY, "-c",
                                  FACTS, command=[PY, "-c", ON_ITS_TERMINAL], timeout=TIMEOUT)
    text = out.decode(errors="replace")
    assert code == 0, text
    launcher = [line.split() for line in text.splitlines() if line.startswith("LAUNCHER ")]
    assert len(launcher) == 1, text
    pid, group = int(launcher[0][1]), launcher[0][2]
    seen = facts(text)
    assert len(seen) == 3, text
    assert_one_session_of_groups(seen, launcher=pid)
    assert seen[0]["sid"] != pid  # not the launcher's session, which has the terminal
    if AUTOGROUPS:
        assert seen[0]["autogroup"] != group


def test_each_attempt_gets_a_session_of_its_own(tmp_path: Path):
    """A restarted job's instances: a fresh session per attempt, each the same guarantees."""
    flag = tmp_path / "failed-once"
    program = FACTS + (f"\nimport pathlib, sys\nf = pathlib.Path({str(flag)!r})\n"
                       "if not f.exists():\n    f.touch(); sys.exit(3)\n")
    proc = subprocess.run(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                      "--max-restarts=1", PY, "-c", program),
                          env=poprun_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    seen = facts(proc.stdout)
    assert len(seen) == 4, proc.stdout + proc.stderr
    by_session: dict[int, list[dict]] = {}
    for f in seen:
        by_session.setdefault(f["sid"], []).append(f)
    assert sorted(len(v) for v in by_session.values()) == [2, 2], seen
    for group in by_session.values():
        assert_one_session_of_groups(group, launcher=None)


def test_remote_instances_share_one_session_on_their_host(tmp_path: Path):
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = subprocess.run(
            poprun_argv(*OFFLINE, "--host", "h1,h2", "--num-instances=4", "--num-replicas=4",
                        "--tag-output", PY, "-c", FACTS),
            env=poprun_env(hosts.env()), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    by_host: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        index = int(line.split("]", 1)[0].split(",")[1])
        by_host.setdefault("h1" if index < 2 else "h2", []).extend(facts(line))
    assert sorted(by_host) == ["h1", "h2"] and all(len(v) == 2 for v in by_host.values())
    for seen in by_host.values():
        assert_one_session_of_groups(seen, launcher=None)
        assert len({f["ppid"] for f in seen}) == 1  # the host's agent's children


class _Sink:
    def __init__(self) -> None:
        self.output: dict[int, bytearray] = {}
        self.exits: dict[int, int] = {}
        self.streams: dict[tuple[int, int], bytearray] = {}  # (key, 1 or 2): what it wrote there

    def on_output(self, key, stream, data) -> None:
        self.output.setdefault(key, bytearray()).extend(data)
        self.streams.setdefault((key, int(stream)), bytearray()).extend(data)

    def on_exit(self, key, returncode) -> None:
        self.exits[key] = returncode


def _run_spawner(specs, timeout: float = TIMEOUT) -> _Sink:
    """Start `specs` with a LocalSpawner on a real event loop until every one has exited."""
    import asyncio

    async def main() -> _Sink:
        sink = _Sink()
        spawner = LocalSpawner(sink, asyncio.get_running_loop(), cgroups=False)
        try:
            for spec in specs:
                spawner.spawn(spec)
            async with asyncio.timeout(timeout):
                while not spawner.idle:
                    await asyncio.sleep(0.01)
        finally:
            spawner.close()
        return sink

    return asyncio.run(main())


def test_the_spawner_passes_descriptors_and_stdin_and_reports_signals(tmp_path: Path):
    """What Popen gave each instance, the session leader gives too: stdin (the launcher's
    or /dev/null), a passed descriptor at its own number, the working directory, its CPU
    binding, stderr merged or not, an exit by signal as a negative status."""
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, False)
    show = ("import os, sys; os.write(%d, b'passed'); print(os.getcwd()); "
            "print(sys.stdin.read() == '', file=sys.stderr); "
            "print(sorted(os.sched_getaffinity(0)))" % write_end)
    cpu = max(os.sched_getaffinity(0))
    sink = _run_spawner([
        ProcessSpec(1, (PY, "-c", show), dict(os.environ), cwd=str(tmp_path),
                    pass_fds=(write_end,), cpus=(cpu,)),
        ProcessSpec(2, (PY, "-c", "import os; os.kill(os.getpid(), 15)"), dict(os.environ),
                    merge_stderr=True),
    ])
    os.close(write_end)
    assert os.read(read_end, 100) == b"passed"
    os.close(read_end)
    assert sink.exits == {1: 0, 2: -signal.SIGTERM}
    assert sink.streams[1, 1] == f"{tmp_path}\n[{cpu}]\n".encode()  # bound from the start
    assert sink.streams[1, 2] == b"True\n"  # stdin: /dev/null


@pytest.mark.parametrize("spec, error", [
    (dict(argv=("no-such-program-here",)), FileNotFoundError),
    (dict(argv=("true",), cwd="/no/such/dir"), FileNotFoundError),
    (dict(argv=("/dev/null",)), PermissionError),
    (dict(argv=("true",), cpus=(4095,)), OSError),  # a binding refused, in the leader
])
def test_a_start_that_fails_is_raised_as_popen_would(spec, error):
    import asyncio

    async def main() -> None:
        spawner = LocalSpawner(_Sink(), asyncio.get_running_loop(), cgroups=False)
        try:
            with pytest.raises(error):
                spawner.spawn(ProcessSpec(0, env=dict(os.environ), **spec))
            # ...and the leader still starts the next one
            spawner.spawn(ProcessSpec(1, ("true",), dict(os.environ)))
            async with asyncio.timeout(TIMEOUT):
                while not spawner.idle:
                    await asyncio.sleep(0.01)
        finally:
            spawner.close()

    asyncio.run(main())


def test_a_host_that_refuses_clone_parent_gives_each_instance_its_own_session(monkeypatch):
    """Where the kernel refuses the leader's clone (here: no clone number for this machine),
    the spawner starts instances as before, each leading its own session."""
    monkeypatch.setattr(sessionleader, "_clone_number", lambda: -1)
    sink = _run_spawner([ProcessSpec(k, (PY, "-c", FACTS), dict(os.environ))
                         for k in range(2)])
    seen = facts("".join(out.decode() for out in sink.output.values()))
    assert sink.exits == {0: 0, 1: 0}
    assert [f["sid"] == f["pid"] == f["pgrp"] for f in seen] == [True, True]
