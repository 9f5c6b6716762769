"""The Python API: `await poprun.launch(LaunchConfig(...))` with real instances.

Output is captured by passing the fds of temporary files. Every launch runs under
asyncio.wait_for, and every other wait is a bounded poll of a real condition.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import poprun
from poprun import ConfigError, LaunchConfig, launch
from requires import skip_or_fail

PY = sys.executable
TIMEOUT = 30
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def children() -> set[int]:
    """Live (not zombie) child processes of this test process."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as fh:
            pids.update(int(p) for p in fh.read().split())
    live = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rpartition(")")[2].split()[0] != "Z":
                    live.add(pid)
        except FileNotFoundError:
            pass
    return live


class Capture:
    """Temporary files standing in for poprun's stdout and stderr."""

    def __init__(self, tmp_path: Path) -> None:
        self._out = open(tmp_path / "stdout", "w+b")
        self._err = open(tmp_path / "stderr", "w+b")
        self.fds = {"stdout_fd": self._out.fileno(), "stderr_fd": self._err.fileno()}

    def read(self) -> tuple[bytes, bytes]:
        return ((self._out.seek(0), self._out.read())[1], (self._err.seek(0), self._err.read())[1])

    def close(self) -> None:
        self._out.close()
        self._err.close()


@pytest.fixture
def capture(tmp_path: Path):
    cap = Capture(tmp_path)
    yield cap
    cap.close()


def config(*program: str, **options) -> LaunchConfig:
    options = {"num_instances": 2, "num_replicas": 2, "offline_mode": True, **options}
    return LaunchConfig(program=program, **options)


def test_public_surface() -> None:
    for name in poprun.__all__:
        assert getattr(poprun, name) is not None
    assert {"launch", "LaunchConfig", "LaunchResult", "InstanceResult", "ConfigError",
            "LaunchError", "PoprunError"} <= set(poprun.__all__)


async def test_successful_launch_returns_a_result(capture: Capture) -> None:
    before = children()
    t0 = time.time()
    result = await asyncio.wait_for(launch(config(
        PY, "-c", "import os, sys; r = os.environ['RANK']; print('hello', r); print('x');"
        "print('to stderr', r, file=sys.stderr)"), **capture.fds), TIMEOUT)
    t1 = time.time()
    out, err = capture.read()
    assert sorted(out.splitlines()) == [b"hello 0", b"hello 1", b"x", b"x"]
    assert b"to stderr 0\n" in err and b"to stderr 1\n" in err

    assert isinstance(result, poprun.LaunchResult)
    assert result.ok and result.exit_code == 0
    assert result.root_cause is None and result.stop_signal is None
    assert result.failure_report() == ""
    assert [i.index for i in result.instances] == [0, 1]
    for inst in result.instances:
        assert isinstance(inst, poprun.InstanceResult)
        assert inst.returncode == 0 and inst.exit_status == 0 and inst.signal is None
        assert inst.host == "localhost"
        assert inst.pid > 0
        assert t0 <= inst.start_time <= inst.end_time <= t1
        assert inst.lines == 3  # two on stdout, one on stderr
        assert not inst.stopped_by_poprun
    assert len({i.pid for i in result.instances}) == 2
    assert children() <= before  # instances and the watchdog are all reaped


FAIL_AFTER_PEER = r"""
import os, sys, time
d = sys.argv[1]
if os.environ["RANK"] == "0":
    open(os.path.join(d, "0.up"), "w").close()
    time.sleep(300)
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(d, "0.up")):  # fail only once instance 0 runs
    if time.monotonic() > deadline:
        sys.exit("instance 0 did not start")
    time.sleep(0.01)
print("giving up", file=sys.stderr)
sys.exit(4)
"""


async def test_failed_job_returns_a_result(tmp_path: Path, capture: Capture) -> None:
    before = children()
    script = tmp_path / "fail.py"
    script.write_text(FAIL_AFTER_PEER)
    result = await asyncio.wait_for(
        launch(config(PY, str(script), str(tmp_path)), **capture.fds), TIMEOUT)
    assert not result.ok
    assert result.exit_code == 4 and result.root_cause == 1 and result.stop_signal is None
    failed, stopped = result.instances[1], result.instances[0]
    assert failed.returncode == 4 and failed.stderr_tail == (b"giving up",)
    assert stopped.returncode == -signal.SIGTERM and stopped.stopped_by_poprun
    assert stopped.exit_status == 128 + signal.SIGTERM and stopped.signal == signal.SIGTERM
    assert failed.end_time <= stopped.end_time
    _, err = capture.read()
    assert b"instance 1" in err and b"exited with status 4" in err  # the report, on stderr_fd
    assert result.failure_report() in err.decode()
    assert children() <= before


WAIT_FOR_GO = r"""
import os, sys, time
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]):
    if time.monotonic() > deadline:
        sys.exit("no go")
    time.sleep(0.01)
print("done", os.environ["RANK"])
"""


async def test_consecutive_launches_in_one_process(tmp_path: Path, capture: Capture) -> None:
    """The objects of a finished launch, garbage-collected while the next one runs, must
    not close file descriptors that now belong to it (the second launch would hang)."""
    first = await asyncio.wait_for(launch(config("true"), **capture.fds), TIMEOUT)
    assert first.ok
    del first
    go = tmp_path / "go"
    task = asyncio.ensure_future(
        launch(config(PY, "-c", WAIT_FOR_GO, str(go)), **capture.fds))
    await asyncio.sleep(0)  # let it start its instances
    deadline = time.monotonic() + TIMEOUT
    while len(children()) < 2:  # the watchdog and at least one instance
        assert time.monotonic() < deadline and not task.done(), "the launch did not start"
        await asyncio.sleep(0.01)
    gc.collect()
    go.touch()
    second = await asyncio.wait_for(task, TIMEOUT)
    assert second.ok and [i.lines for i in second.instances] == [1, 1]
    out, _ = capture.read()
    assert sorted(out.splitlines()) == [b"done 0", b"done 1"]


OPEN_MPI_WORLD = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
                  "print('world', c.Get_size(), c.allreduce(1), flush=True)")


async def test_every_launch_in_one_process_gets_open_mpi_s_world(capture: Capture) -> None:
    """libpmix serves once per process (a second PMIx_server_init aborts the process), so it
    never runs in poprun's: each launch's server is a process of its own (spawner/
    pmixhost.py), and a second launch() in the same process gets its Open MPI world too."""
    from test_openmpi_world import OPEN_MPIS, _probe

    version = next((v for v in sorted(OPEN_MPIS) if _probe(v) is None), None)
    if version is None:
        skip_or_fail("no Open MPI under mpi4py here", "POPRUN_REQUIRE_OPENMPI")
    python, env = OPEN_MPIS[version]
    program = config(*python, "-c", OPEN_MPI_WORLD)
    results = []
    for _ in range(2):
        results.append(await asyncio.wait_for(
            launch(program, environ={**os.environ, **env}, **capture.fds), TIMEOUT))
    assert [r.ok for r in results] == [True, True]
    out, err = capture.read()
    assert out.splitlines() == [b"world 2 2"] * 4, (out, err[-2000:])
    with open("/proc/self/maps") as maps:
        assert "libpmix" not in maps.read()


@pytest.mark.parametrize("options", [
    {"num_instances": 2, "num_replicas": 3},
    {"num_instances": 0},
    {"num_replicas": -1},
    {"only_output_from_instance": 2},
    {"kill_timeout": -1.0},
    {"env": ("1BAD=x",)},
    {"mpi_global_args": ("--no-such-mpi-option",)},
], ids=lambda o: ",".join(o))
def test_invalid_config_raises_at_construction(options) -> None:
    with pytest.raises(ConfigError):
        config("true", **options)


def test_no_program_raises_at_construction() -> None:
    with pytest.raises(ConfigError):
        LaunchConfig(program=())


async def test_missing_program_raises_from_launch(capture: Capture) -> None:
    before = children()
    with pytest.raises(ConfigError, match="no-such-program-xyz"):
        await asyncio.wait_for(launch(config("no-such-program-xyz", "arg"), **capture.fds),
                               TIMEOUT)
    assert capture.read() == (b"", b"")
    assert children() <= before


def _custom_handler(signum, frame) -> None:  # pragma: no cover - never delivered
    raise AssertionError("not expected to run")


async def test_signal_handlers_are_restored(capture: Capture) -> None:
    previous = signal.signal(signal.SIGTERM, _custom_handler)
    try:
        before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        ok = await asyncio.wait_for(launch(config("true"), **capture.fds), TIMEOUT)
        assert ok.exit_code == 0
        assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
        failed = await asyncio.wait_for(launch(config("false"), **capture.fds), TIMEOUT)
        assert failed.exit_code == 1
        assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
        with pytest.raises(ConfigError):
            await launch(config("no-such-program-xyz"), **capture.fds)
        assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
        assert signal.getsignal(signal.SIGTERM) is _custom_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_cancelled_launch_leaves_nothing(tmp_path: Path, capture: Capture) -> None:
    """A caller's timeout cancels the launch: instances are killed and reaped, not orphaned."""
    before = children()
    up = tmp_path / "up"
    program = (PY, "-c", "import os, sys, time; open(sys.argv[1] + os.environ['RANK'], 'w')"
               ".close(); time.sleep(300)", str(up))
    task = asyncio.ensure_future(launch(config(*program), **capture.fds))
    deadline = time.monotonic() + TIMEOUT
    while not (Path(f"{up}0").exists() and Path(f"{up}1").exists()):
        assert time.monotonic() < deadline and not task.done(), "instances did not start"
        await asyncio.sleep(0.01)
    pids = children() - before
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, TIMEOUT)
    assert pids and not (children() & pids)
    assert children() <= before


async def test_a_launch_from_python_is_a_job_poprunctl_sees(tmp_path: Path, capture: Capture,
                                                             monkeypatch) -> None:
    """`await launch()` registers the job as the command does: its ended record is the
    result's JSON (one schema), in the caller's state directory."""
    from poprun.jobctl import records as jobs

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    result = await asyncio.wait_for(launch(config(PY, "-c", "print('hi')"), **capture.fds),
                                    TIMEOUT)
    assert result.exit_code == 0
    (found,) = jobs.scan().records
    assert found.pop("_dir") == os.path.join(tmp_path, "poprun", "jobs", found["id"])
    assert found == json.loads(json.dumps(result.to_json()))
    assert found["state"] == "ended" and found["exit_reason"] == "success"
    assert [i["state"] for i in found["instances"]] == ["exited", "exited"]
