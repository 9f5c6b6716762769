"""Tests of the one-machine Slurm cluster harness (tests/slurm_cluster.py) on the real thing.

Besides proving the harness, they pin down the Slurm behaviour poprun's Slurm transport
relies on: what salloc/sbatch/srun set and return, how stdin/stdout travel, and that one
``srun -N1 -n1 -w nodeK -u`` job step per node gives one ordered, binary-safe, bidirectional
byte stream per node. Timings are printed (``pytest -s``) with generous bounds only: the
machine is shared.

Every wait is bounded: subprocess timeouts or a deadline loop.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from requires import assert_skips_or_fails
import slurm_cluster as harness
from slurm_cluster import SlurmCluster, start_slurm_cluster
from sshd_hosts import processes_with

pytestmark = pytest.mark.timeout(120)

PY = sys.executable  # the "nodes" are this machine
TIMEOUT = 30


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The session's cluster, idle: no job left over from an earlier test."""
    slurm_cluster.reset()
    return slurm_cluster


def tasks_with(marker: str) -> list[int]:
    """``processes_with(marker)`` less srun clients (whose argv holds the marker too; srun
    runs as two processes)."""
    return [pid for pid in processes_with(marker)
            if not _argv0(pid).endswith(b"srun")]


def _argv0(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


def wait_until(predicate, what: str, timeout: float = TIMEOUT) -> float:
    """Poll ``predicate`` until true; fail after ``timeout`` s. Returns the seconds waited."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def read_exactly(stream, n: int, timeout: float = TIMEOUT) -> bytes:
    """``n`` bytes from a pipe, failing the test if they don't all come within ``timeout``."""
    deadline = time.monotonic() + timeout
    got = b""
    while len(got) < n:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            pytest.fail(f"only {got!r} of {n} bytes within {timeout}s")
        chunk = os.read(stream.fileno(), n - len(got))
        if not chunk:
            pytest.fail(f"EOF after {got!r}, expected {n} bytes")
        got += chunk
    return got


def env_dump(prefix: str = "SLURM") -> str:
    """A python3 -c program printing the environment variables starting with ``prefix``."""
    return (f"import json, os; print(json.dumps({{k: v for k, v in os.environ.items() "
            f"if k.startswith({prefix!r})}}))")


# -- the harness ----------------------------------------------------------------------------

def test_cluster_is_up_with_two_idle_nodes(cluster: SlurmCluster) -> None:
    assert cluster.nodes == ["node1", "node2"]
    assert cluster.node_states() == {"node1": "idle", "node2": "idle"}
    assert cluster.jobs() == {}
    ping = cluster.run(["scontrol", "ping"], timeout=TIMEOUT)
    assert ping.returncode == 0 and "UP" in ping.stdout, ping
    env = cluster.env
    assert env["SLURM_CONF"] == str(cluster.conf)
    assert not any(k.startswith("SLURM_") and k != "SLURM_CONF" for k in env)
    print(f"\n2-node cluster started in {cluster.start_seconds:.2f}s")


def test_start_and_stop_leave_no_process_and_no_file(tmp_path: Path) -> None:
    """A second cluster beside the session's: its own ports, dir and munged. Stopping it
    kills what it still runs (a step, a batch job, their srun/sbatch clients) and removes
    its directory, without touching the session's cluster."""
    harness.require_slurm()
    marker = f"slurm-marker-{uuid.uuid4().hex}"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nexec {PY} -c 'import time; time.sleep(300)' {marker}-batch\n")
    t0 = time.monotonic()
    with start_slurm_cluster(1) as c:
        started = time.monotonic() - t0
        root, conf = c.dir, c.conf
        step = c.popen(["srun", "-N1", PY, "-c", "import time; time.sleep(300)", marker],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        batch = c.run(["sbatch", "--parsable", f"--output={tmp_path}/out", str(script)],
                      timeout=TIMEOUT, cwd=tmp_path)
        assert batch.returncode == 0, batch.stderr
        wait_until(lambda: len(tasks_with(marker)) == 2, "the step's task and the batch's")
        t1 = time.monotonic()
    stopped = time.monotonic() - t1
    assert step.wait(TIMEOUT) != 0
    assert processes_with(marker) == []
    assert not root.exists()
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        assert f"SLURM_CONF={conf}".encode() not in environ.split(b"\0"), entry
    print(f"\n1-node cluster: started in {started:.2f}s, stopped in {stopped:.2f}s")
    assert started < 20 and stopped < 10


def test_a_cluster_that_cannot_start_says_why(monkeypatch) -> None:
    """A broken slurm.conf: SlurmClusterError quoting slurmctld's log; nothing left behind."""
    harness.require_slurm()
    write = harness._write_slurm_conf

    def broken(cluster: SlurmCluster) -> None:
        write(cluster)
        with cluster.conf.open("a") as f:
            f.write("NoSuchOption=1\n")

    monkeypatch.setattr(harness, "_write_slurm_conf", broken)
    before = set(Path(tempfile.gettempdir()).glob("slurm-cluster-*"))
    with pytest.raises(harness.SlurmClusterError) as error:
        with start_slurm_cluster(1, timeout=20):
            pytest.fail("started with a broken slurm.conf")
    message = str(error.value)
    assert "daemons exited" in message and "slurmctld" in message, message
    assert "NoSuchOption" in message, message  # from the log tail
    assert set(Path(tempfile.gettempdir()).glob("slurm-cluster-*")) == before


def test_missing_slurm_skips_or_fails_with_the_reason(monkeypatch) -> None:
    monkeypatch.setattr(harness.shutil, "which", lambda name, path=None: None)
    assert_skips_or_fails(harness.require_slurm, "POPRUN_REQUIRE_SLURM",
                          "slurmctld.*not found.*apt-get install", monkeypatch)


def test_reset_cancels_leftover_jobs(cluster: SlurmCluster, tmp_path: Path) -> None:
    marker = f"slurm-marker-{uuid.uuid4().hex}"
    # (sbatch writes slurm-<job>.out into its cwd unless told --output.)
    submitted = cluster.run(["sbatch", "--parsable", "-N2", "--wrap",
                             f"{PY} -c 'import time; time.sleep(300)' {marker}"],
                            timeout=TIMEOUT, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    wait_until(lambda: cluster.jobs().get(job) == "RUNNING", "the batch job to run")
    cluster.reset()
    assert cluster.jobs() == {}
    wait_until(lambda: processes_with(marker) == [], "the batch job's processes to end")


# -- srun, salloc, sbatch ----------------------------------------------------------------

def test_srun_runs_one_task_per_node(cluster: SlurmCluster) -> None:
    out = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "--label", "sh", "-c",
                       "echo $SLURMD_NODENAME $SLURM_JOB_NODELIST $SLURM_PROCID $SLURM_NODEID"],
                      timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        "0: node1 node[1-2] 0 0",
        "1: node2 node[1-2] 1 1",
    ]


def test_salloc_runs_the_command_locally_with_the_job_environment(
        cluster: SlurmCluster) -> None:
    out = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", PY, "-c", env_dump()],
                      timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    env = json.loads(out.stdout)
    assert env["SLURM_JOB_ID"].isdigit()
    assert env["SLURM_JOB_NODELIST"] == "node[1-2]"
    assert env["SLURM_NNODES"] == "2"
    assert env["SLURM_NTASKS"] == "2"
    assert env["SLURM_TASKS_PER_NODE"] == "1(x2)"
    assert "SLURMD_NODENAME" not in env  # the command runs here, not on a node
    assert "Granted job allocation" in out.stderr

    # Without a task count salloc sets no SLURM_NTASKS (SLURM_TASKS_PER_NODE: one per node).
    out = cluster.run(["salloc", "-N2", PY, "-c", env_dump()], timeout=TIMEOUT)
    env = json.loads(out.stdout)
    assert "SLURM_NTASKS" not in env and env["SLURM_TASKS_PER_NODE"] == "1(x2)"

    # srun inside it runs its tasks in that job, on its nodes.
    out = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", "sh", "-c",
                       "echo job=$SLURM_JOB_ID; srun --label sh -c 'echo $SLURM_JOB_ID "
                       "$SLURMD_NODENAME'"], timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    first, *rest = out.stdout.splitlines()
    job = first.removeprefix("job=")
    assert sorted(rest) == [f"0: {job} node1", f"1: {job} node2"]


def test_salloc_returns_the_command_exit_status(cluster: SlurmCluster) -> None:
    out = cluster.run(["salloc", "-N1", "sh", "-c", "exit 5"], timeout=TIMEOUT)
    assert out.returncode == 5, out.stderr


def test_sbatch_wait_runs_the_batch_script(cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/sh\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1\n"
        "echo batch on $SLURMD_NODENAME tasks=$SLURM_NTASKS\n"
        "srun --label sh -c 'echo $SLURMD_NODENAME'\n"
        "exit 3\n"
    )
    out = cluster.run(["sbatch", "--wait", "--parsable", f"--output={tmp_path}/out-%j.txt",
                       str(script)], timeout=TIMEOUT, cwd=tmp_path)
    # --wait: sbatch returns once the job ends, with the script's exit status.
    assert out.returncode == 3, out.stderr
    job = out.stdout.strip().split(";")[0]
    lines = (tmp_path / f"out-{job}.txt").read_text().splitlines()
    assert lines[0] == "batch on node1 tasks=2"  # the script runs on the first node
    assert sorted(lines[1:]) == ["0: node1", "1: node2"]
    info = cluster.job_info(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0"
    assert info["BatchHost"] == "node1" and info["NodeList"] == "node[1-2]"


def test_failing_srun_propagates_the_exit_status(cluster: SlurmCluster) -> None:
    out = cluster.run(["srun", "-N1", "sh", "-c", "exit 7"], timeout=TIMEOUT)
    assert out.returncode == 7
    assert "node1: task 0: Exited with exit code 7" in out.stderr
    # Several tasks failing: srun returns the largest status.
    out = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "sh", "-c",
                       "exit $((SLURM_PROCID + 3))"], timeout=TIMEOUT)
    assert out.returncode == 4
    # A task killed by a signal: 128 + the signal, as a shell would report it.
    out = cluster.run(["srun", "-N1", "sh", "-c", "kill -KILL $$"], timeout=TIMEOUT)
    assert out.returncode == 128 + signal.SIGKILL
    assert "task 0: Killed" in out.stderr


def test_scancel_ends_a_running_job(cluster: SlurmCluster) -> None:
    marker = f"slurm-marker-{uuid.uuid4().hex}"
    step = cluster.popen(["srun", "-N2", "--ntasks-per-node=1", f"--job-name={marker}", PY,
                          "-c", "import time; time.sleep(300)", marker],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(tasks_with(marker)) == 2, "both tasks to run")
        job = cluster.run(["squeue", "-h", "-n", marker, "-o", "%i"],
                          timeout=TIMEOUT).stdout.strip()
        assert job.isdigit()
        t0 = time.monotonic()
        assert cluster.run(["scancel", job], timeout=TIMEOUT).returncode == 0
        _, err = step.communicate(timeout=TIMEOUT)
        gone = wait_until(lambda: processes_with(marker) == [], "every marked process to end")
        print(f"\nscancel: srun exited after {time.monotonic() - t0 - gone:.2f}s, "
              f"all processes gone {gone:.2f}s later")
        assert step.returncode != 0
        assert "CANCELLED" in err, err
        # COMPLETING until every node has reported the job's end.
        wait_until(lambda: cluster.job_info(job)["JobState"] == "CANCELLED", "CANCELLED")
    finally:
        if step.poll() is None:
            step.kill()
            step.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_srun_ends_its_tasks(cluster: SlurmCluster, sig: signal.Signals) -> None:
    """If the launcher (and so its srun) dies, the step's tasks do not outlive it: SIGKILL'd,
    srun's connection drops and slurmstepd cancels the step; SIGTERM'd, srun cancels it."""
    marker = f"slurm-marker-{uuid.uuid4().hex}"
    step = cluster.popen(["srun", "-N1", "-u", PY, "-u", "-c",
                          "import time; print('up'); time.sleep(300)", marker],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    try:
        assert read_exactly(step.stdout, 3) == b"up\n"
        step.send_signal(sig)
        step.wait(TIMEOUT)
        gone = wait_until(lambda: processes_with(marker) == [], "the task to end")
        print(f"\nsrun {sig.name}: task gone {gone:.2f}s later (srun status {step.returncode})")
    finally:
        if step.poll() is None:
            step.kill()
            step.wait()


# no switch: slow, run on request (POPRUN_SLURM_SLOW=1)
@pytest.mark.skipif(os.environ.get("POPRUN_SLURM_SLOW") != "1",
                    reason="Slurm time limits are whole minutes, checked every 30 s: a "
                           "--time=1 job ends after 60-90 s (set POPRUN_SLURM_SLOW=1)")
@pytest.mark.timeout(240)
def test_time_limit_ends_the_job(cluster: SlurmCluster) -> None:
    marker = f"slurm-marker-{uuid.uuid4().hex}"
    t0 = time.monotonic()
    out = cluster.run(["srun", "-N1", "--time=1", PY, "-c", "import time; time.sleep(300)",
                       marker], timeout=180)
    print(f"\n--time=1 job ended after {time.monotonic() - t0:.0f}s")
    assert out.returncode == 128 + signal.SIGTERM
    assert "DUE TO TIME LIMIT" in out.stderr
    wait_until(lambda: processes_with(marker) == [], "the task to end")


# -- stdin and stdout --------------------------------------------------------------------

def test_label_and_input_0_send_stdin_to_task_0_only(cluster: SlurmCluster) -> None:
    out = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "--label", "--input=0", "sh",
                       "-c", "cat; echo end $SLURMD_NODENAME"], input="a\nb\n",
                      timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # Per task, its lines keep their order; the tasks' lines interleave arbitrarily.
    assert [x for x in lines if x.startswith("0: ")] == ["0: a", "0: b", "0: end node1"]
    assert [x for x in lines if x.startswith("1: ")] == ["1: end node2"]  # stdin: EOF


def test_stdin_is_broadcast_to_every_task_by_default(cluster: SlurmCluster) -> None:
    out = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "--label", "cat"],
                      input="a\nb\n", timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [x for x in lines if x.startswith("0: ")] == ["0: a", "0: b"]
    assert [x for x in lines if x.startswith("1: ")] == ["1: a", "1: b"]


def test_multi_prog_runs_one_program_per_task(cluster: SlurmCluster, tmp_path: Path) -> None:
    conf = tmp_path / "multi.conf"
    conf.write_text("0 sh -c 'echo first on $SLURMD_NODENAME'\n"
                    "1 echo second task=%t offset=%o\n")
    out = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "--label", "--multi-prog",
                       str(conf)], timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["0: first on node1", "1: second task=1 offset=0"]


def test_output_is_line_buffered_unless_unbuffered(cluster: SlurmCluster) -> None:
    """Without -u slurmstepd forwards only whole lines (a partial line waits for its newline
    or the task's exit); with -u every write comes through as it is made."""
    emit = ("import os, sys, time; os.write(1, b'partial'); sys.stdin.read(); "
            "os.write(1, b' line\\n')")
    for unbuffered in (False, True):
        step = cluster.popen(["srun", "-N1", *(["-u"] if unbuffered else []), PY, "-c", emit],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        try:
            if unbuffered:
                assert read_exactly(step.stdout, 7) == b"partial"
            else:
                ready, _, _ = select.select([step.stdout], [], [], 2)
                assert not ready  # "partial" is held back
            step.stdin.close()  # the task then writes the rest of its line and exits
            rest = step.stdout.read()
            assert rest == (b" line\n" if unbuffered else b"partial line\n")
            assert step.wait(TIMEOUT) == 0
        finally:
            if step.poll() is None:
                step.kill()
                step.wait()


# -- one bidirectional stream per node -------------------------------------------------

# Run inside an allocation (salloc -N<n> --ntasks-per-node=1): start one job step per node,
# each a tiny agent echoing what it reads, upper-cased, with its node name; then check that
# each stream reaches its own node, in order, binary-safe, and time it. Prints one JSON line.
STREAMS_DRIVER = r'''
import json, os, select, subprocess, sys, time
nodes, extra = sys.argv[1].split(","), sys.argv[2:]
agent = ("import os\n"
         "me = os.environ['SLURMD_NODENAME'].encode()\n"
         "while True:\n"
         "    d = os.read(0, 65536)\n"
         "    if not d: break\n"
         "    os.write(1, me + b':' + d.upper())\n")
def read_exactly(f, n, timeout=20):
    got, deadline = b"", time.monotonic() + timeout
    while len(got) < n:
        if not select.select([f], [], [], max(0, deadline - time.monotonic()))[0]:
            sys.exit(f"timeout: {got!r}")
        chunk = os.read(f.fileno(), n - len(got))
        if not chunk:
            sys.exit(f"EOF: {got!r}")
        got += chunk
    return got
t0 = time.monotonic()
steps = [subprocess.Popen(["srun", "--nodes=1", "--ntasks=1", "-w", n, "-u", *extra,
                           sys.executable, "-c", agent],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) for n in nodes]
up = []
for n, p in zip(nodes, steps):
    os.write(p.stdin.fileno(), b"hello")  # no newline: needs -u
    assert read_exactly(p.stdout, len(n) + 6) == n.encode() + b":HELLO"
    up.append(time.monotonic() - t0)
t1 = time.monotonic()
rounds = 200
for i in range(rounds):
    msg = b"m%d\x00\xff" % i
    for p in steps:
        os.write(p.stdin.fileno(), msg)
    for n, p in zip(nodes, steps):
        assert read_exactly(p.stdout, len(n) + 1 + len(msg)) == n.encode() + b":" + msg.upper()
round_trip = (time.monotonic() - t1) / rounds
for p in steps:
    p.stdin.close()
codes = [p.wait(20) for p in steps]
tail = [p.stdout.read() for p in steps]
print(json.dumps({"all_up_s": max(up), "round_trip_ms": round_trip * 1000, "codes": codes,
                  "tail": [t.decode() for t in tail], "total_s": time.monotonic() - t0}))
'''


def run_streams(cluster: SlurmCluster, tmp_path: Path, nodes: list[str], *extra: str) -> dict:
    driver = tmp_path / "streams.py"
    driver.write_text(STREAMS_DRIVER)
    out = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", PY, str(driver),
                       ",".join(nodes), *extra], timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["codes"] == [0] * len(nodes) and result["tail"] == [""] * len(nodes)
    return result


def test_one_srun_step_per_node_gives_one_byte_stream_per_node(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    r = run_streams(cluster, tmp_path, ["node1", "node2"])
    print(f"\none step per node: both streams up in {r['all_up_s'] * 1000:.0f} ms, "
          f"a round trip to both {r['round_trip_ms']:.2f} ms, "
          f"start to both exited {r['total_s'] * 1000:.0f} ms")
    assert r["all_up_s"] < 20


def test_a_second_step_on_a_node_needs_overlap(cluster: SlurmCluster, tmp_path: Path) -> None:
    """With one CPU per node allocated (--ntasks-per-node=1), a second concurrent step on
    node1 waits for the first to end unless every step says --overlap."""
    r = run_streams(cluster, tmp_path, ["node1", "node2", "node1"], "--overlap")
    print(f"\nthree --overlap steps on two nodes: up in {r['all_up_s'] * 1000:.0f} ms")

    marker = f"slurm-marker-{uuid.uuid4().hex}"
    script = (f"srun -N1 -n1 -w node1 {PY} -c 'import time; time.sleep(300)' {marker} & "
              f"first=$!; sleep 1; srun -N1 -n1 -w node1 --immediate=3 true; "
              f"echo second=$?; kill $first; wait")
    out = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", "sh", "-c", script],
                      timeout=60)
    assert "second=1" in out.stdout, out.stdout + out.stderr
    assert "Unable to create step for job" in out.stderr, out.stderr
    assert "Requested nodes are busy" in out.stderr, out.stderr


def test_step_start_latency(cluster: SlurmCluster) -> None:
    """How long one job step takes, start to exit, inside an allocation (printed)."""
    timing = (f"import subprocess, time; t = time.monotonic(); "
              f"[subprocess.run(['srun', '-N1', '-n1', '-w', 'node2', 'true'], check=True) "
              f"for _ in range(10)]; print((time.monotonic() - t) / 10)")
    out = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", PY, "-c", timing],
                      timeout=60)
    assert out.returncode == 0, out.stderr
    per_step = float(out.stdout)
    t0 = time.monotonic()
    assert cluster.run(["srun", "-N2", "true"], timeout=TIMEOUT).returncode == 0
    job_and_step = time.monotonic() - t0
    print(f"\nsrun -N1 true inside salloc: {per_step * 1000:.0f} ms per step; "
          f"srun -N2 true (new job): {job_and_step * 1000:.0f} ms")
    assert per_step < 5


def test_tasks_see_the_cluster_through_the_inherited_environment(
        cluster: SlurmCluster) -> None:
    """srun exports the client's environment (SLURM_CONF included) to the tasks, so a task
    can itself run srun/squeue against the same cluster."""
    out = cluster.run(["srun", "-N1", "sh", "-c", f"echo $SLURM_CONF; squeue -h -o %i"],
                      timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    conf, job = out.stdout.split()
    assert conf == str(cluster.conf) and job.isdigit()
