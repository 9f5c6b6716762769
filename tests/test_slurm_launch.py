"""`poprun --launcher slurm` on a real Slurm cluster (tests/slurm_cluster.py: munged,
slurmctld and two slurmd on this machine): poprun runs under `salloc` and `sbatch`, its agents
start as one job step per node, instances run on both nodes with the right environment, output
arrives tagged, a failing instance's status propagates, `scancel` leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import SRC
from slurm_cluster import SlurmCluster
from spawner.srun import ACK_INTERVAL, SrunConnection, StepAck
from sshd_hosts import instances_with, processes_with, wait_until

pytestmark = pytest.mark.timeout(120)
PY = sys.executable  # the nodes are this machine
POPRUN = [PY, "-m", "poprun", "--offline-mode=yes"]
# Which node an instance ran on (SLURMD_NODENAME comes with the job step), and what it saw.
SHOW = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ('SLURMD_NODENAME',"
        " 'RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'SLURM_JOB_ID', 'SLURM_PROCID', 'MASTER_ADDR')}))")


@pytest.fixture
def cluster(slurm_cluster: SlurmCluster) -> SlurmCluster:
    slurm_cluster.reset()
    return slurm_cluster


def env() -> dict[str, str]:
    return {"PYTHONPATH": SRC, "POPRUN_NO_DASHBOARD": "1"}


def test_under_salloc_instances_run_on_both_nodes_as_job_steps(cluster):
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=2", *POPRUN, "--tag-output",
                        "--num-replicas=4", PY, "-c", SHOW], env=env(), timeout=90)
    assert done.returncode == 0, done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        tag, _, text = line.partition("<stdout>:")
        seen[int(tag.strip("[]").split(",")[1])] = json.loads(text)
    assert sorted(seen) == [0, 1, 2, 3]  # SLURM_NTASKS=4 gave the instances
    assert [seen[i]["SLURMD_NODENAME"] for i in range(4)] == ["node1", "node1", "node2", "node2"]
    assert [(seen[i]["RANK"], seen[i]["LOCAL_RANK"]) for i in range(4)] == \
        [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]
    assert all(s["SLURM_JOB_ID"] and s["SLURM_PROCID"] is None for s in seen.values())
    assert len({s["MASTER_ADDR"] for s in seen.values()}) == 1


async def test_a_step_ack_goes_at_once_then_at_most_every_interval():
    """StepAck (the answer that carries the step I/O's ACK): the first call sends at once;
    calls within ACK_INTERVAL of it make one more send, ACK_INTERVAL after the first."""
    loop = asyncio.get_running_loop()
    sent: list[float] = []
    second = loop.create_future()

    def send() -> None:
        sent.append(loop.time())
        if len(sent) == 2:
            second.set_result(None)

    ack = StepAck(send)
    ack()
    assert len(sent) == 1
    ack()
    ack()
    assert len(sent) == 1
    await asyncio.wait_for(second, 5)
    assert sent[1] - sent[0] >= ACK_INTERVAL * 0.99  # the loop's clock, as StepAck's



@pytest.fixture
def fake_srun(tmp_path) -> str:
    """An `srun` that runs the step's command here (what follows its options)."""
    path = tmp_path / "srun"
    path.write_text('#!/bin/sh\nwhile [ "$1" != /bin/sh ]; do shift; done\nexec "$@"\n')
    path.chmod(0o755)
    return str(path)


class _Session:
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.lost = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes, datatype: int | None) -> None:
        self.received.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


async def test_a_step_started_ahead_hands_its_session_what_it_sent_in_order(fake_srun, tmp_path):
    """SrunConnection.start: the step runs before create_session asks for it; what it wrote
    meanwhile reaches the session first, then the rest, then its end."""
    said = tmp_path / "said"
    conn = SrunConnection("node1", fake_srun)
    command = f"echo early; touch {said}; read line; echo \"late $line\""
    conn.start(command)
    await asyncio.wait_for(_until(said.exists), 20)
    step, session = await conn.create_session(_Session, command)
    step.write(b"reply\n")
    step.write_eof()
    assert await asyncio.wait_for(session.lost, 20) is None
    assert b"".join(session.received) == b"early\nlate reply\n"
    assert step.get_exit_status() == 0
    conn.close()
    await conn.wait_closed()


@pytest.mark.parametrize("agent", ["cat", "sleep 300"], ids=["ends-at-eof", "does-not"])
async def test_a_step_started_ahead_and_never_asked_for_is_ended_by_close(fake_srun, tmp_path,
                                                                          agent):
    """Its agent is told to end (EOF), as by a launcher that is done; one that does not is
    cancelled (srun's SIGKILL) after HELD_EOF_GRACE. Either way it is reaped."""
    pid_file = tmp_path / "pid"
    conn = SrunConnection("node1", fake_srun)
    conn.start(f"echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; exec {agent}")
    # (the fake srun execs sh, which execs the agent: one pid all along)
    await asyncio.wait_for(_until(pid_file.exists), 20)
    pid = int(pid_file.read_text())
    conn.close()
    await asyncio.wait_for(conn.wait_closed(), 20)
    assert not Path(f"/proc/{pid}").exists()  # reaped: not even a zombie


async def test_a_step_started_ahead_is_ended_by_a_close_while_it_is_created(fake_srun):
    marker = f"poprun-test-{uuid.uuid4().hex}"
    conn = SrunConnection("node1", fake_srun)
    conn.start(f"exec {PY} -c 'import time; time.sleep(300)' {marker}")
    conn.close()  # before the loop ran the step's creation at all
    await asyncio.wait_for(conn.wait_closed(), 20)
    assert not processes_with(marker)


async def _until(predicate, interval: float = 0.01) -> None:
    while not predicate():
        await asyncio.sleep(interval)


def test_a_slurm_launch_imports_no_asyncssh(cluster):
    """Agents as job steps need no SSH: asyncssh (~200 ms to import) stays out of the
    launcher (spawner/remote.py makes its session class only for an SSH connection)."""
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", PY, "-X", "importtime",
                        *POPRUN[1:], "--num-replicas=2", "true"], env=env(), timeout=90)
    assert done.returncode == 0, done.stderr
    modules = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines()
               if line.startswith("import time:")}
    assert "spawner.srun" in modules  # the list is the launch's: the agents went through srun
    assert not {m for m in modules if m.partition(".")[0] in ("asyncssh", "cryptography")}


def test_an_mpi_world_spans_both_nodes(cluster):
    """Each node's agent (a job step) serves its instances' PMI and meets the other's
    through poprun (spawner/agentworld.py), as over SSH."""
    if os.environ.get("POPRUN_REQUIRE_MPI") != "1":  # CI: its absence fails the test
        pytest.importorskip("mpi4py")
    program = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
               "print('world', c.Get_rank(), c.Get_size(), c.allreduce(c.Get_rank() + 1), "
               "MPI.Get_processor_name(), flush=True)")
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=2", *POPRUN, "--num-replicas=4",
                        PY, "-c", program], env=env(), timeout=90)
    assert done.returncode == 0, done.stderr
    worlds = sorted(line.split()[:4] for line in done.stdout.splitlines()
                    if line.startswith("world"))
    assert worlds == [["world", str(r), "4", "10"] for r in range(4)]


def test_a_failing_instance_ends_the_job_and_its_status_propagates(cluster):
    """The others would sleep 300 s: only poprun stopping them ends the job within the
    timeout; nothing of it is left."""
    marker = f"slurm-{uuid.uuid4().hex[:8]}"
    failing = ("import os, sys, time; sys.exit(7) if os.environ['RANK'] == '3' else "
               "time.sleep(300)")
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=2", *POPRUN, "--num-replicas=4",
                        PY, "-c", failing, marker], env=env(), timeout=60)
    assert done.returncode == 7, done.stderr
    assert "instance 3" in done.stderr and "exited with status 7" in done.stderr
    wait_until(lambda: not processes_with(marker), "every process of the job to be gone", 30)


def test_caches_bindings_and_sources_on_every_node(cluster, tmp_path):
    """Each node's agent makes the executable cache there and removes it; each node's
    instances are bound from that node's own topology (--report-bindings reads them back
    there); -v says the hosts and counts came from the allocation. The instances stay until
    poprun knows all four run: one that exits first has no binding left to read."""
    from poprun.jobctl import records as jobs

    before = set(Path("/tmp").glob("poprun-cache-*"))
    go = tmp_path / "go"
    program = ("import os, sys, time; c = os.environ['POPDIST_EXECUTABLE_CACHE_PATH']; "
               "print(c, os.path.isdir(c), flush=True)\n"
               "while not os.path.exists(sys.argv[1]): time.sleep(0.01)")
    proc = cluster.popen(["salloc", "-N2", "--ntasks-per-node=2", *POPRUN, "-v",
                          "--report-bindings", "--num-replicas=4", "--process-placement=close",
                          PY, "-c", program, str(go)], env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)

    def running() -> bool:
        return any(str(go) in (r.get("argv") or []) and
                   sum(i.get("state") == "running" for i in r["instances"]) == 4
                   for r in jobs.scan().records)
    try:
        wait_until(running, "poprun to see its 4 instances run", 60)
        go.write_text("")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    caches = {line.split()[0] for line in out.splitlines()}
    assert {line.split()[1] for line in out.splitlines()} == {"True"}
    assert len(caches) == 2  # one per node, made by its agent
    assert not {Path(c) for c in caches} & before and not any(map(os.path.exists, caches))
    assert "hosts: node1 (2), node2 (2) from the Slurm allocation (SLURM_JOB_NODELIST=node[1-2]) " \
           "with SLURM_TASKS_PER_NODE=2(x2), over slurm" in err, err
    bound = re.findall(r"instance (\d) \(pid \d+\) on (node\d): cpus ", err)
    assert sorted(bound) == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")]


def test_under_sbatch(cluster, tmp_path):
    script = tmp_path / "job.sh"
    out = tmp_path / "job.out"
    script.write_text("#!/bin/sh\n" + " ".join(
        [*POPRUN, "--num-replicas=2", PY, "-c",
         "\"import os; print('hello from', os.environ['SLURMD_NODENAME'])\""]) + "\n")
    done = cluster.run(["sbatch", "--wait", "-N2", "--ntasks-per-node=1", f"--output={out}",
                        str(script)], env=env(), timeout=90)
    assert done.returncode == 0, (done.stderr, out.read_text() if out.exists() else "")
    assert sorted(out.read_text().splitlines()) == ["hello from node1", "hello from node2"]


def test_scancel_ends_poprun_and_leaves_no_process(cluster, tmp_path):
    marker = f"slurm-{uuid.uuid4().hex[:8]}"
    proc = cluster.popen(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "--num-replicas=2",
                          PY, "-c", "import time; time.sleep(300)", marker], env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(instances_with(marker)) >= 2, "both instances to run", 60)
        jobs = cluster.jobs()
        assert len(jobs) == 1
        cluster.run(["scancel", str(next(iter(jobs)))], timeout=30)
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert re.search(r"^poprun: stopped by Slurm: node\d: \*\*\* STEP \S+ ON node\d CANCELLED AT", err,
                     re.M), err  # the reason is named
    wait_until(lambda: not processes_with(marker), "every process of the job to be gone", 30)


def test_launcher_slurm_outside_an_allocation_is_one_clear_line(cluster):
    environ = {k: "" for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST")}
    done = cluster.run([*POPRUN, "--launcher=slurm", "--num-replicas=1", "true"],
                       env={**env(), **environ}, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "poprun: error: --launcher slurm runs inside a Slurm allocation: start poprun with "
        "`salloc -N <nodes> poprun ...` or from an `sbatch` script (or use --launcher ssh)"]


@pytest.mark.timeout(240)
@pytest.mark.skipif(not (os.environ.get("POPRUN_SLURM_SLOW") or os.environ.get("CI")),
                    reason="Slurm time limits are whole minutes, checked every 30 s: a run "
                           "takes 66-89 s (CI runs it; POPRUN_SLURM_SLOW=1 here)")
def test_the_time_limit_ends_poprun_naming_it(cluster):
    marker = f"slurm-{uuid.uuid4().hex[:8]}"
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", "--time=1", *POPRUN,
                        "--num-replicas=2", PY, "-c", "import time; time.sleep(600)", marker],
                       env=env(), timeout=200)
    assert done.returncode != 0
    assert re.search(r"^poprun: stopped by Slurm: node\d: \*\*\* STEP .* DUE TO TIME LIMIT",
                     done.stderr, re.M), done.stderr
    wait_until(lambda: not processes_with(marker), "every process of the job to be gone", 30)


def test_ctrl_c_reaches_every_instance_and_leaves_nothing(cluster):
    """SIGINT to poprun (inside salloc) is forwarded to the instances on both nodes; poprun
    exits 130 and no process of the job is left."""
    marker = f"slurm-{uuid.uuid4().hex[:8]}"
    proc = cluster.popen(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "--num-replicas=2",
                          PY, "-c", "import time; time.sleep(300)", marker], env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(instances_with(marker)) >= 2, "both instances to run", 60)
        launchers = [p for p in processes_with(marker)  # not salloc, whose argv has it too
                     if Path(f"/proc/{p}/cmdline").read_bytes().startswith(
                         PY.encode() + b"\0-m\0poprun")]
        parent = {p: int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
                  for p in launchers}
        poprun = next(p for p in launchers if parent[p] not in launchers)  # not its watchdog
        os.kill(poprun, signal.SIGINT)
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "SIGINT received: stopping 2 running instance(s)" in err, err
    wait_until(lambda: not processes_with(marker), "every process of the job to be gone", 30)

