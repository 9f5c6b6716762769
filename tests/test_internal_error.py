"""No internal error ever looks like success: a fault injected into each part of a launch (a
spawner callback, the output router, the dashboard, the partition release, a remote agent) stops
the job, leaves no process and no cache behind, releases the partition, and ends poprun with
`poprun: internal error: <Type>: <message>`, a crash file holding the traceback, and exit 70.

The fault is a real exception raised by poprun's own code at that place: the real `poprun`
runs in a subprocess whose first lines replace one method by a wrapper that raises (the
`python -c` prologue below). The V-IPU server is the simulator (no real one exists here).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from conftest import OFFLINE, poprun_env, reaped, wait_started
from poprun import InternalError, LaunchConfig, PoprunError, launch
from sshd_hosts import processes_with, start_ssh_hosts, wait_until
from terminal import run_on_a_terminal
from vipu_harness import sim  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(90)
PY = sys.executable
INTERNAL = 70
LINE = re.compile(r"^poprun: internal error: (.+)$", re.M)
CRASH = re.compile(r"^poprun: the traceback is in (\S+)$", re.M)


def with_fault(target: str, after: int = 0, message: str = "injected fault") -> str:
    """A prologue for `python -c`: `module:Class.method` raises RuntimeError(message) from
    its call number `after` + 1 on, then the poprun command runs (argv as given)."""
    module, _, attribute = target.partition(":")
    owner, _, method = attribute.rpartition(".")
    return textwrap.dedent(f"""
        import importlib, sys
        owner = importlib.import_module({module!r})
        for name in {owner!r}.split(".") if {owner!r} else ():
            owner = getattr(owner, name)
        original = getattr(owner, {method!r})
        calls = [0]
        def faulty(*args, **kwargs):
            calls[0] += 1
            if calls[0] > {after}:
                raise RuntimeError({message!r})
            return original(*args, **kwargs)
        setattr(owner, {method!r}, faulty)
        from poprun.cli.command import run
        run()
    """)


def sleeper(marker: str) -> list[str]:
    """An instance that says it runs, then sleeps: a survivor would be visible by `marker`."""
    return [PY, "-c", "import time; print('ready', flush=True); time.sleep(300)", marker]


def run_faulty(prologue: str, *args: str, env: dict[str, str], timeout: float = 60):
    return subprocess.run([PY, "-c", prologue, *args], env=poprun_env(env),
                          capture_output=True, timeout=timeout)


def assert_internal_error(returncode: int, stderr: str, message: str = "injected fault") -> Path:
    """Exit 70, the one-line report naming type and message, and a crash file with the
    traceback; returns the crash file."""
    assert returncode == INTERNAL, stderr
    assert "Traceback" not in stderr, stderr  # the traceback is for -v and the crash file
    found = LINE.findall(stderr)
    assert found and found[0].endswith(f"RuntimeError: {message}"), stderr
    crash = Path(CRASH.search(stderr).group(1))
    text = crash.read_text()
    assert "Traceback" in text and f"RuntimeError: {message}" in text
    return crash


@pytest.fixture
def place(tmp_path: Path) -> dict[str, str]:
    """Environment giving the job its own temp dir (caches) and state dir (crash files)."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    return {"TMPDIR": str(tmp_path / "tmp"), "XDG_RUNTIME_DIR": str(tmp_path / "run")}


def assert_nothing_left(marker: str, place: dict[str, str]) -> None:
    wait_until(lambda: not processes_with(marker), f"instances marked {marker} to be gone", 10)
    assert not list(Path(place["TMPDIR"]).glob("poprun-cache-*"))


@pytest.mark.parametrize("target", [
    "poprun.run.output:OutputRouter.on_output",  # the output router
    "spawner.local:LocalSpawner._on_readable",  # a spawner callback: a pipe reader
])
def test_a_fault_in_the_output_path_stops_the_job_with_exit_70(target, place):
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    proc = run_faulty(with_fault(target), *OFFLINE, "--num-instances=3", "--num-replicas=3",
                      *sleeper(marker), env=place)
    assert_internal_error(proc.returncode, proc.stderr.decode())
    assert_nothing_left(marker, place)


def test_an_exit_fault_when_one_instance_ends_first_kills_the_others(place):
    """The fault comes with the first instance's exit while the others still run."""
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    script = ("import os, time; print('ready', flush=True);"
              " time.sleep(0 if os.environ['RANK'] == '0' else 300)")
    proc = run_faulty(with_fault("poprun.run.job:Job.on_exit"), *OFFLINE, "--num-instances=3",
                      "--num-replicas=3", PY, "-c", script, marker, env=place)
    crash = assert_internal_error(proc.returncode, proc.stderr.decode())
    assert crash.parent == Path(place["XDG_RUNTIME_DIR"]) / "poprun"
    assert_nothing_left(marker, place)


def test_result_json_says_internal_error(place, tmp_path):
    """--result-json always says why the job ended: an internal error too (exit 70)."""
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "result.json"
    proc = run_faulty(with_fault("poprun.run.output:OutputRouter.on_output"), *OFFLINE,
                      f"--result-json={out}", "--num-instances=2", "--num-replicas=2",
                      *sleeper(marker), env=place)
    assert_internal_error(proc.returncode, proc.stderr.decode())
    result = json.loads(out.read_text())
    assert (result["exit_code"], result["exit_reason"]) == (INTERNAL, "internal_error")
    assert result["error"].startswith("RuntimeError: ")
    assert_nothing_left(marker, place)


def test_verbose_shows_the_traceback_too(place):
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    proc = run_faulty(with_fault("poprun.run.output:OutputRouter.on_output"), *OFFLINE, "-v",
                      "--num-instances=2", "--num-replicas=2", *sleeper(marker), env=place)
    err = proc.stderr.decode()
    assert proc.returncode == INTERNAL, err
    assert "Traceback" in err and "in faulty" in err
    assert_nothing_left(marker, place)


def test_a_fault_in_the_dashboard_stops_the_job(place):
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    prologue = with_fault("poprun.view.dashboard:Dashboard.tick", after=1)
    code, out = run_on_a_terminal(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                  *sleeper(marker), env=place, command=[PY, "-c", prologue])
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace")).replace("\r", "")
    assert code == INTERNAL, text
    # (the panel's erase codes, stripped above, put the line at the start of the screen row)
    assert "poprun: internal error: RuntimeError: injected fault\n" in text, text
    assert_nothing_left(marker, place)


def test_a_fault_in_the_partition_release_still_releases_it(sim, place):  # noqa: F811
    """The fault comes right after `vipu remove partition` did its work: the partition is
    gone, and the job that ran is not reported as a success."""
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    prologue = textwrap.dedent("""
        from poprun.run import vipu
        original = vipu.VipuRunner.run
        async def run(self, *command):
            out = await original(self, *command)
            if command[:1] == ("remove",):
                raise RuntimeError("injected fault")
            return out
        vipu.VipuRunner.run = run
        from poprun.cli.command import run
        run()
    """)
    proc = run_faulty(prologue, "--vipu-server-host=localhost", "--vipu-partition=job",
                      "--num-instances=2", "--num-replicas=2", PY, "-c", "print('ok')",
                      marker, env=place)
    assert_internal_error(proc.returncode, proc.stderr.decode())
    assert "remove" in sim.verbs()
    assert sim.partitions() == {}
    assert_nothing_left(marker, place)


def test_a_fault_when_a_host_is_lost_stops_the_job(tmp_path, place):
    """Job.on_host_lost raises when h2 goes down. asyncssh reports the loss from its own
    cleanup, where an exception is swallowed: poprun then waited forever for h2's instances.
    It must be an internal error like any other (exit 70, nothing left)."""
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    notes = tmp_path / "notes"
    notes.mkdir()
    program = [PY, "-c", "import os, sys, time; open(sys.argv[1] + '/' + os.environ['RANK'], "
                         "'w'); time.sleep(300)", str(notes), marker]
    before = set(Path("/tmp").glob("poprun-cache-*"))
    with start_ssh_hosts(2, tmp_path) as hosts:
        job = subprocess.Popen([PY, "-c", with_fault("poprun.run.job:Job.on_host_lost"), *OFFLINE,
                                "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                                *program], env=poprun_env({**hosts.env(), **place}),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with reaped(job):
            wait_started(job.pid, 2, environ=place)
            for pid in hosts.sshd_pids(1):  # h2 goes down
                os.kill(pid, signal.SIGKILL)
            err = job.communicate(timeout=30)[1].decode()
        assert_internal_error(job.returncode, err)
        wait_until(lambda: not processes_with(marker), "every instance to be gone", 15)
        wait_until(lambda: set(Path("/tmp").glob("poprun-cache-*")) <= before,
                   "the hosts' caches to be removed", 15)


def test_a_fault_in_a_remote_agent_stops_the_job_everywhere(tmp_path, place):
    """The agent on h2 raises while relaying its instances' output: it kills them, tells the
    launcher, and poprun stops h1's instances too and reports the agent's error."""
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    agent = tmp_path / "faulty-python"
    agent.write_text("#!/bin/sh\n"  # run by the agent command as `<python> -m spawner.agent`
                     f"exec {PY} -c {_sh(with_fault('spawner.agent:Agent.on_output'))}"
                     .replace("from poprun.cli.command import run\nrun()",
                              "from spawner.agent import main\nsys.exit(main())") + "\n")
    agent.chmod(0o755)
    before = set(Path("/tmp").glob("poprun-cache-*"))
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = subprocess.run(
            [PY, "-m", "poprun", *OFFLINE, "-H", "h1,h2", f"--remote-python={agent}",
             "--num-instances=4", "--num-replicas=4", *sleeper(marker)],
            env=poprun_env({**hosts.env(), **place}), capture_output=True, timeout=60)
        err = proc.stderr.decode()
        assert proc.returncode == INTERNAL, err
        assert re.search(r"^poprun: internal error: h\d: agent: RuntimeError: injected fault$",
                         err, re.M), err
        assert CRASH.search(err), err
        wait_until(lambda: not processes_with(marker), "every instance to be gone", 15)
        wait_until(lambda: set(Path("/tmp").glob("poprun-cache-*")) <= before,
                   "the hosts' caches to be removed", 15)


def _sh(text: str) -> str:
    import shlex

    return shlex.quote(text)


async def test_launch_raises_internal_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Through the API (the job used to return exit code 0):
    a fault in the output router raises InternalError, a PoprunError, chained to it."""
    from poprun.run import output

    def broken(self, key, stream, data):
        raise RuntimeError("router broke")

    monkeypatch.setattr(output.OutputRouter, "on_output", broken)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    marker = f"fault-{uuid.uuid4().hex[:8]}"
    read, write = os.pipe()
    try:
        with pytest.raises(InternalError) as caught:
            await asyncio.wait_for(launch(LaunchConfig(
                program=tuple(sleeper(marker)), num_instances=2, num_replicas=2,
                offline_mode=True), stdout_fd=write, stderr_fd=write), 30)
    finally:
        os.close(write)
        report = os.read(read, 65536).decode()
        os.close(read)
    assert isinstance(caught.value, PoprunError)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert str(caught.value) == "RuntimeError: router broke"
    assert caught.value.crash_file and Path(caught.value.crash_file).is_file()
    assert "poprun: internal error: RuntimeError: router broke" in report
    wait_until(lambda: not processes_with(marker), "instances to be gone", 10)
    assert not list(tmp_path.glob("poprun-cache-*"))
