"""`poprun --launcher slurm` on a real Slurm cluster (tests/slurm_cluster.py: munged,
slurmctld and two slurmd on this machine; three or four where a test says so): poprun runs
under `salloc` and `sbatch`, one job step starts every node's agent and each calls back,
instances run on every node with the right environment (and the processes they spawn with
MPI_Comm_spawn, on another node), output arrives tagged, a failing
instance's status propagates, a lost node is noticed and restarted with a step of its own,
`scancel` leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import SRC, second_user
from requires import require_module, skip_or_fail
from slurm_cluster import SlurmCluster, required_slurm_cluster
from spawner.callback import CALLBACK_VARIABLE, MAGIC, NONCE, PROOF, SECRET_VARIABLE
from spawner.containment import MARK, helpers_mark
from spawner.lifeline import WATCHDOG_NAME
from sshd_hosts import instances_with, kill_marked, kill_trees, processes_with, wait_until

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
    through poprun (spawner/worlds/nodeworld.py), as over SSH."""
    require_module("mpi4py", "POPRUN_REQUIRE_MPI")
    program = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
               "print('world', c.Get_rank(), c.Get_size(), c.allreduce(c.Get_rank() + 1), "
               "MPI.Get_processor_name(), flush=True)")
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=2", *POPRUN, "--num-replicas=4",
                        PY, "-c", program], env=env(), timeout=90)
    assert done.returncode == 0, done.stderr
    worlds = sorted(line.split()[:4] for line in done.stdout.splitlines()
                    if line.startswith("world"))
    assert worlds == [["world", str(r), "4", "10"] for r in range(4)]


def test_an_instance_spawns_children_on_the_other_node(cluster):
    """Instance 0 on node1 spawns two children on node2 (the `host` info key): node2's
    agent starts them and serves their world; they connect to their parent across nodes."""
    require_module("mpi4py", "POPRUN_REQUIRE_MPI")
    child = ("import os; from mpi4py import MPI; p = MPI.Comm.Get_parent(); "
             "print('child', MPI.COMM_WORLD.Get_rank(), os.environ['SLURMD_NODENAME'], "
             "flush=True); p.reduce(MPI.COMM_WORLD.Get_rank() + 1, root=0); p.Disconnect()")
    program = ("import os, sys\nfrom mpi4py import MPI\nif MPI.COMM_WORLD.Get_rank() == 0:\n"
               "    info = MPI.Info.Create()\n    info.Set('host', 'node2')\n"
               f"    inter = MPI.COMM_SELF.Spawn(sys.executable, ['-c', {child!r}], 2, info)\n"
               "    print('parent', os.environ['SLURMD_NODENAME'], "
               "inter.reduce(None, root=MPI.ROOT), flush=True)\n    inter.Disconnect()\n")
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "--num-replicas=2",
                        "--tag-output", PY, "-c", program], env=env(), timeout=90)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "[1,0]<stdout>:parent node1 3", "[2,0]<stdout>:child 0 node2",
        "[2,1]<stdout>:child 1 node2"]


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
        wait_until(lambda: not processes_with(marker), "every process of the job to be gone", 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_marked(marker)  # what a failed test left
    assert proc.returncode != 0
    assert re.search(r"^poprun: stopped by Slurm: node\d: \*\*\* STEP \S+ ON node\d CANCELLED AT", err,
                     re.M), err  # the reason is named


def test_scancel_signal_term_gives_every_instance_the_whole_kill_timeout(cluster, tmp_path):
    """`scancel --signal TERM` (as a preemption's warning): the agents' step gets SIGTERM,
    poprun does not. Under --kill-timeout 20, each instance (on both nodes) needs 15 s to
    "checkpoint" after its first SIGTERM: every checkpoint is written and the job ends 0.
    (How many SIGTERMs each got is checked below.)"""
    from test_stop_window import CHECKPOINTS, checkpoints

    (tmp_path / "notes").mkdir()
    proc = cluster.popen(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "--num-replicas=2",
                          "--kill-timeout=20", PY, "-c", CHECKPOINTS, str(tmp_path / "notes")],
                         env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(list((tmp_path / "notes").glob("ready-?"))) == 2,
                   "both instances to run", 60)
        [job] = cluster.jobs()
        cluster.run(["scancel", "--signal=TERM", str(job)], timeout=30, check=True)
        err = proc.communicate(timeout=90)[1].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    written = checkpoints(tmp_path)
    assert sorted(written) == ["ckpt-0", "ckpt-1"], err
    # 1 or 2 each (one run: 1 and 2): Slurm's proctrack/linuxproc signals every process of
    # the step, the instances too, and the agent forwards its own (it cannot tell): see
    # docs/troubleshooting.md, "The stop window".
    assert all(count in (1, 2) for count in written.values()), written


def test_launcher_slurm_outside_an_allocation_is_one_clear_line(cluster):
    environ = {k: "" for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST")}
    done = cluster.run([*POPRUN, "--launcher=slurm", "--num-replicas=1", "true"],
                       env={**env(), **environ}, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "poprun: error: --launcher slurm runs inside a Slurm allocation: start poprun with "
        "`salloc -N <nodes> poprun ...` or from an `sbatch` script (or use --launcher ssh)"]


@pytest.mark.timeout(240)
# no switch: slow, run on request (POPRUN_SLURM_SLOW=1) and in CI
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
        wait_until(lambda: not processes_with(marker), "every process of the job to be gone", 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_marked(marker)  # what a failed test left
    assert "SIGINT received: stopping 2 running instance(s)" in err, err



# --- one step for every node, and what it must keep ------------------------------------------

# Waits for a file to exist (argv[1]), then exits 0; with a second argument, each instance
# prints its node first.
WAIT_FOR = ("import os, sys, time\n"
            "print('up', os.environ['SLURMD_NODENAME'], os.environ['RANK'], flush=True)\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.02)")


@pytest.fixture(scope="module")
def four_nodes():
    """A cluster of its own with four node daemons (the session's has two)."""
    with required_slurm_cluster(4) as cluster:
        yield cluster


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _launcher(marker: str) -> int:
    """poprun's own pid (not its watchdog's, nor salloc's)."""
    command = PY.encode() + b"\0-m\0poprun"
    found = [p for p in processes_with(marker)
             if Path(f"/proc/{p}/cmdline").read_bytes().startswith(command)]
    return next(p for p in found if _parent(p) not in found)


def _sruns_of(pid: int) -> list[int]:
    """The `srun` processes `pid` started itself."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() == "srun" and \
                    _parent(int(entry)) == pid:
                found.append(int(entry))
        except (OSError, IndexError):
            pass
    return found


def _steps(cluster: SlurmCluster) -> list[tuple[str, str, str]]:
    """(step id, name, node list) of every job step squeue lists."""
    out = cluster.run(["squeue", "-s", "-h", "-o", "%i %j %N"], timeout=20, check=True).stdout
    return [tuple(line.split()) for line in out.splitlines() if line.strip()]


def _agents(cluster: SlurmCluster, watchdogs: bool = False) -> dict[str, int]:
    """node -> pid of each running poprun agent started by a step of `cluster` (its
    SLURM_CONF, and SLURMD_NODENAME, in its environment), not its watchdog (a fork, named
    WATCHDOG_NAME) unless `watchdogs`."""
    found: dict[int, tuple[str, int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"spawner.agent" not in Path(f"/proc/{entry}/cmdline").read_bytes() or \
                    (not watchdogs and
                     Path(f"/proc/{entry}/comm").read_bytes().strip() == WATCHDOG_NAME):
                continue
            env = dict(v.split(b"=", 1) for v in
                       Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if b"=" in v)
            ours = env.get(b"SLURM_CONF") == str(cluster.conf).encode()
            if ours and env.get(b"SLURMD_NODENAME"):
                found[int(entry)] = (env[b"SLURMD_NODENAME"].decode(), _parent(int(entry)))
        except OSError:  # gone meanwhile
            pass
    return {node: pid for pid, (node, parent) in found.items() if parent not in found}


def _helpers_mark(pid: int) -> bool:
    """Whether process `pid` carries a launcher's helpers' mark (containment.helpers_mark)."""
    suffix = helpers_mark("").encode()
    return any(v.startswith(MARK.encode() + b"=") and v.endswith(suffix)
               for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))


def _start(cluster: SlurmCluster, nodes: int, go: Path, *extra: str) -> subprocess.Popen:
    return cluster.popen(["salloc", f"-N{nodes}", "--ntasks-per-node=1", *POPRUN, "-v",
                          *extra, f"--num-replicas={nodes}", PY, "-c", WAIT_FOR, str(go)],
                         env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out.decode(), err.decode()


@pytest.mark.parametrize("nodes", [1, 4])
def test_one_step_and_one_srun_start_every_nodes_agent(four_nodes, tmp_path, nodes):
    """Whatever the node count: one job step (squeue -s) and one srun of poprun's own;
    every node's instance runs, and the secret reaches no instance."""
    four_nodes.reset()
    go = tmp_path / "go"
    proc = _start(four_nodes, nodes, go)
    try:
        wait_until(lambda: len(instances_with(str(go))) >= nodes, "every instance to run", 60)
        steps = _steps(four_nodes)
        launcher = _launcher(str(go))
        sruns = _sruns_of(launcher)
        secrets = [p for p in instances_with(str(go)) if SECRET_VARIABLE.encode() in
                   Path(f"/proc/{p}/environ").read_bytes()]
        job = _job_of(str(go))  # poprunctl reaches the instances through the agents
        stacks = _poprunctl("stacks", job, "--json")
        logs = _poprunctl("logs", job)
        go.write_text("")
        out, err = _finish(proc)
    finally:
        go.write_text("")
    assert proc.returncode == 0, err
    assert [name for _, name, _ in steps] == ["poprun-agent"], steps
    assert len(sruns) == 1, sruns
    assert sorted(line.split()[1] for line in out.splitlines()) == \
        [f"node{k}" for k in range(1, nodes + 1)]
    assert not secrets
    assert sorted(json.loads(stacks.stdout)["instances"]) == list(range(nodes)), stacks
    assert sorted(line.split()[1] for line in logs.stdout.splitlines()) == \
        [f"node{k}" for k in range(1, nodes + 1)], logs


def _job_of(marker: str) -> str:
    """The id of the running job whose command line holds `marker`."""
    from poprun.jobctl import records as jobs

    return next(r["id"] for r in jobs.scan().records if marker in (r.get("argv") or []))


def _poprunctl(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([PY, "-m", "poprun.cli.ctl", *args], env={**os.environ, **env()},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def _kill_node(cluster: SlurmCluster, node: str) -> None:
    """The node fails: its slurmd, its slurmstepds and everything under them SIGKILLed."""
    log = f"{cluster.dir}/log/slurmd-{node}.log"

    def roots() -> list[int]:
        found = [cluster.daemons[f"slurmd-{node}"].pid]
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                if Path(f"/proc/{entry}/comm").read_text().startswith("slurmstepd") and any(
                        os.readlink(f"/proc/{entry}/fd/{fd}") == log
                        for fd in os.listdir(f"/proc/{entry}/fd")):
                    found.append(int(entry))
            except OSError:
                pass
        return found
    kill_trees(roots)


def test_a_node_that_fails_mid_job_is_noticed_and_nothing_is_left(tmp_path):
    """node2's slurmd and slurmstepd killed under a running job (its agent and instance
    with them): poprun names the lost node, stops the others' instances, ends (its srun,
    still waiting for node2's task, SIGKILLed) and leaves no process of the job."""
    with required_slurm_cluster(3) as cluster:
        go = tmp_path / "go"
        proc = _start(cluster, 3, go, "--kill-timeout=2")
        try:
            wait_until(lambda: len(instances_with(str(go))) >= 3, "every instance to run", 60)
            _kill_node(cluster, "node2")
            out, err = _finish(proc)
        finally:
            go.write_text("")
        assert proc.returncode == 255, err  # a lost host (docs/troubleshooting.md, salloc's)
        assert re.search(r"node2: .*lost", err), err
        wait_until(lambda: not processes_with(str(go)), "every process of the job gone", 30)


@pytest.mark.parametrize("spares", [
    "--spare-nodes=1",  # said
    "--num-instances=2",  # the allocation's node beyond the two instances' nodes: a spare
], ids=["spare-nodes", "automatic"])
def test_a_spare_node_takes_over_a_node_that_fails(tmp_path, spares):
    """A 2-node job in a 3-node allocation (--spare-nodes 1, or without it: two instances at
    one task per node need two nodes): node3 stands by, its agent started by a step of its
    own. node2's slurmd and slurmstepd are killed (its agent and instance with them): the
    next attempt runs instance 1 on node3, node1's agent is the same process throughout, and
    node2 is quarantined. (A cluster of its own: node2's slurmd does not come back.)"""
    go = tmp_path / "go"
    out_json = tmp_path / "result.json"
    with required_slurm_cluster(3) as cluster:
        proc = cluster.popen(["salloc", "-N3", "--ntasks-per-node=1", *POPRUN, "-v",
                              spares, "--max-restarts=1", "--restart-delay=0",
                              "--quarantine-for=0", f"--result-json={out_json}",
                              "--num-replicas=2", PY, "-c", WAIT_FOR, str(go)],
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: len(instances_with(str(go))) >= 2, "every instance to run", 60)
            before = _agents(cluster)
            assert sorted(before) == ["node1", "node2", "node3"]  # node3's: standing by
            _kill_node(cluster, "node2")
            wait_until(lambda: len(instances_with(str(go))) >= 2 and "node3" in
                       _nodes_running(str(go)), "the next attempt's instances", 60)
            after = _agents(cluster)
            go.write_text("")
            out, err = _finish(proc)
        finally:
            go.write_text("")
    assert proc.returncode == 0, err
    assert re.search(r"hosts: node1 \(1\), node2 \(1\) from the Slurm allocation .*over "
                     r"slurm; spare hosts: node3\n", err), err
    assert "node2 quarantined for the rest of the job" in err, err
    assert "node2 replaced by spare host node3 for the next attempt (1 instance(s))" in err
    assert after["node1"] == before["node1"] and after["node3"] == before["node3"]
    result = json.loads(out_json.read_text())
    assert [i["host"] for i in result["instances"]] == ["node1", "node3"]
    assert [q["host"] for q in result["quarantined"]] == ["node2"]
    ran = [line.split()[1:] for line in out.splitlines() if line.startswith("up")]
    assert ["node3", "1"] in ran and ["node1", "0"] in ran, out


def _nodes_running(marker: str) -> set[str]:
    """The nodes (SLURMD_NODENAME) the instances holding `marker` run on."""
    found = set()
    for pid in instances_with(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found.update(v.split(b"=", 1)[1].decode() for v in env
                     if v.startswith(b"SLURMD_NODENAME="))
    return found


def _callback_target(launcher: int) -> tuple[str, int]:
    """Where poprun's agents call it back (its srun's environment, as the step's)."""
    srun = _sruns_of(launcher)[0]
    env = dict(v.split(b"=", 1) for v in
               Path(f"/proc/{srun}/environ").read_bytes().split(b"\0") if b"=" in v)
    host, _, port = env[CALLBACK_VARIABLE.encode()].decode().rpartition(":")
    return host or "127.0.0.1", int(port)


def _held_srun(cluster: SlurmCluster, bin_dir: Path, release: Path) -> dict[str, str]:
    """The environment of a poprun whose `srun` (found on PATH, as poprun finds it) waits
    for `release` to exist before it runs Slurm's: meanwhile every node's link waits for its
    agent's call, as at any job's start, and a call that proved the secret would be taken."""
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/sh\nwhile [ ! -e {release} ]; do sleep 0.02; done\n"
                    f"exec {cluster.bin['srun']} \"$@\"\n")
    srun.chmod(0o755)
    return {**env(), "PATH": f"{bin_dir}{os.pathsep}{cluster.env['PATH']}"}


def _srun_of(marker: str) -> list[int]:
    """The srun of the poprun whose command line holds `marker`, once both run."""
    try:
        return _sruns_of(_launcher(marker))
    except StopIteration:
        return []


def test_a_call_without_the_secret_is_refused_and_runs_nothing(cluster, tmp_path):
    """While poprun waits for its agents' calls (its srun held back), (1) a real agent with
    another secret calls poprun back: it finds poprun's proof wrong and exits; (2) a caller
    that fakes its proof, as node1's agent, is refused by poprun (-v names it): poprun sends
    it nothing (not the job's HELLO and SPAWNs), and the real protocol frames it sends after
    (an instance's output and exit) are never read. Then the real agents call back and the
    job ends as it would have."""
    import socket

    from spawner.local import Stream
    from spawner.protocol import MAGIC as PROTOCOL_MAGIC
    from spawner.protocol import Kind, encode, encode_output

    go, release = tmp_path / "go", tmp_path / "release"
    (tmp_path / "bin").mkdir()
    proc = cluster.popen(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "-v",
                          "--num-replicas=2", PY, "-c", WAIT_FOR, str(go)],
                         env=_held_srun(cluster, tmp_path / "bin", release),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: _srun_of(str(go)), "poprun's srun to start", 60)
        host, port = _callback_target(_launcher(str(go)))
        agent = subprocess.run(
            [PY, "-m", "spawner.agent"], env={**os.environ, "PYTHONPATH": SRC,
                                              CALLBACK_VARIABLE: f"{host}:{port}",
                                              "SLURMD_NODENAME": "node1"},
            input=b"00" * 32 + b"\n", capture_output=True, timeout=30)  # srun's way
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(MAGIC + os.urandom(NONCE))
            answer = b""
            while len(answer) < NONCE + PROOF:
                answer += sock.recv(NONCE + PROOF - len(answer))
            identity = json.dumps({"node": "node1", "step": "0", "task": "0"}).encode()
            forged = (PROTOCOL_MAGIC + encode_output(0, Stream.STDOUT, b"forged\n")
                      + encode(Kind.EXIT, key=0, returncode=0, error=None))
            sock.sendall(os.urandom(PROOF) + bytes([len(identity)]) + identity + forged)
            try:
                heard = sock.recv(65536)  # the end of the connection: nothing before it
            except ConnectionResetError:
                heard = b""
        assert heard == b"", heard
        release.write_text("")
        wait_until(lambda: len(instances_with(str(go))) >= 2, "both instances to run", 60)
        go.write_text("")
        out, err = _finish(proc)
    finally:
        release.write_text("")
        go.write_text("")
    assert agent.returncode == 2
    assert b"does not hold this job's secret" in agent.stderr, agent.stderr
    assert re.search(r"refused a connection from \S+: it does not hold this job's secret",
                     err), err
    assert proc.returncode == 0, err
    assert sorted(line.split()[1] for line in out.splitlines()) == ["node1", "node2"], out


def test_sigkill_of_the_launcher_leaves_nothing(four_nodes, tmp_path):
    """Killed outright, poprun closes nothing itself: its connections' end tells every
    agent, which stops its instances and exits, and the step ends with its tasks. poprun's
    watchdog SIGKILLs srun meanwhile, and Slurm then kills the step's tree, agents included,
    maybe before they are done: each agent's watchdog, out of that tree, finishes for it
    (an instance was left running in 1 run of 2 under load while it was inside)."""
    four_nodes.reset()
    go = tmp_path / "go"
    proc = _start(four_nodes, 3, go)
    try:
        wait_until(lambda: len(instances_with(str(go))) >= 3, "every instance to run", 60)
        for agent in _agents(four_nodes).values():  # no launcher's helper, for its watchdog
            assert not _helpers_mark(agent), agent
        os.kill(_launcher(str(go)), signal.SIGKILL)
        wait_until(lambda: not instances_with(str(go)), "every instance gone", 30)
        wait_until(lambda: not _agents(four_nodes, watchdogs=True),
                   "every agent and its watchdog gone", 30)
        wait_until(lambda: not _steps(four_nodes), "the step gone", 30)
    finally:
        go.write_text("")
        _finish(proc)


def test_an_agent_that_cannot_start_is_named_with_its_nodes_own_words(cluster):
    """The step's command fails on every node (no such interpreter): srun's word on each
    task's end, and what that node's shell said (the step's labelled output, told apart by
    node), make each node's line; nothing waits for a call that will not come."""
    done = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN,
                        "--remote-python=/nonexistent/python", "--num-replicas=2", "true"],
                       env=env(), timeout=90)
    assert done.returncode == 2, done.stderr  # a job that could not start (troubleshooting.md)
    for node in ("node1", "node2"):
        line = next((x for x in done.stderr.splitlines() if f" {node}: " in x), "")
        assert "its task of the job step ended" in line and "exit code 127" in line, \
            done.stderr
        assert "/nonexistent/python" in line, done.stderr


def test_the_agents_call_back_on_the_network_the_user_chose(cluster, tmp_path):
    """--host-subnet=lo: poprun listens on its address there and tells the agents so (with
    no choice they take SLURM_LAUNCH_NODE_IPADDR: the other tests)."""
    go = tmp_path / "go"
    proc = _start(cluster, 2, go, "--host-subnet=lo")
    try:
        wait_until(lambda: len(instances_with(str(go))) >= 2, "both instances to run", 60)
        srun = _sruns_of(_launcher(str(go)))[0]
        told = dict(v.split(b"=", 1) for v in Path(f"/proc/{srun}/environ").read_bytes()
                    .split(b"\0") if b"=" in v)[CALLBACK_VARIABLE.encode()].decode()
        go.write_text("")
        _, err = _finish(proc)
    finally:
        go.write_text("")
    assert proc.returncode == 0, err
    assert told.startswith("127.0.0.1:"), told


# --- neighbours: the callback and the secret ----------------------------------------

# Opens COUNT connections to HOST:PORT that prove nothing (silent, or noise: GARBAGE 1), says
# how many, then holds them HOLD seconds. Run as another local user; stdlib only (the system
# Python). Arguments: COUNT GARBAGE HOLD HOST PORT.
FLOOD = """
import os, socket, sys, time
count, garbage, hold, host, port = sys.argv[1:6]
opened = []
for k in range(int(count)):
    try:
        s = socket.create_connection((host, int(port)), timeout=5)
        if garbage == "1":
            s.sendall(os.urandom(1 + k % 100))
        opened.append(s)
    except OSError:
        pass
print(len(opened), flush=True)
time.sleep(float(hold))
"""

# An `srun` first on PATH: keeps a copy of what poprun writes on its stdin (the secret's
# line), and, where told to, has another user flood the callback port before the real srun
# starts (so before any agent can call back), then becomes the real srun with that line as
# its stdin.
SRUN = """#!{python}
import os, subprocess, sys
line = sys.stdin.buffer.readline()
with open({copy!r}, "wb") as f:
    f.write(line)
if {flood!r}:
    host, _, port = os.environ["POPRUN_AGENT_CALLBACK"].rpartition(":")
    flooder = subprocess.Popen([*{flood!r}, host or "127.0.0.1", port], stdout=subprocess.PIPE)
    with open({copy!r} + ".flood", "w") as f:
        f.write(str(flooder.pid) + " " + flooder.stdout.readline().decode())
read, write = os.pipe()
os.write(write, line)
os.close(write)
os.dup2(read, 0)
os.execv({srun!r}, ["srun", *sys.argv[1:]])
"""


def _srun_wrapper(cluster: SlurmCluster, where: Path, flood: list[str] | None = None
                  ) -> tuple[dict[str, str], Path]:
    """poprun's environment with the wrapping srun first on PATH, and where its copy of the
    secret's line goes."""
    copy = where / "secret-line"
    bin_dir = where / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "srun"
    wrapper.write_text(SRUN.format(python=PY, copy=str(copy), flood=flood or [],
                                   srun=cluster.bin["srun"]))
    wrapper.chmod(0o755)
    return {**env(), "PATH": f"{bin_dir}{os.pathsep}{cluster.env['PATH']}"}, copy


@pytest.fixture
def neighbour():
    """A second local user, gone after the test."""
    import shutil

    if os.geteuid() != 0:
        pytest.skip("needs root: a second local user")  # no switch: root is no package
    if not shutil.which("useradd") or not shutil.which("setpriv"):
        skip_or_fail("needs useradd and setpriv: a second local user", "POPRUN_REQUIRE_TOOLS")
    with second_user("poprun-n") as user:
        yield user


@pytest.mark.parametrize("garbage", [False, True], ids=["idle", "garbage"])
def test_another_users_thousand_connections_cannot_lock_the_launch_out(cluster, tmp_path,
                                                                       neighbour, garbage):
    """Guards a defect: 200 idle connections to the callback port in its first 0.3 s failed the
    launch (exit 2, both agents refused: "too many connections still proving the secret").
    Here another local user holds 1,000 open (silent, or sending noise) before srun even
    starts; on a loopback cluster they come from the nodes' own address, so the bounds do
    the work: the agents make room or try again, the job runs, and -v says one line."""
    flood = ["setpriv", f"--reuid={neighbour.pw_uid}", f"--regid={neighbour.pw_gid}",
             "--clear-groups", "/usr/bin/python3", "-c", FLOOD, "1000", "1" if garbage else "0",
             "20"]
    poprun_env, copy = _srun_wrapper(cluster, tmp_path, flood)
    flooder = None
    try:
        done = cluster.run(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "-v",
                            "--num-replicas=2", PY, "-c", SHOW], env=poprun_env, timeout=100)
        flooder, opened = Path(str(copy) + ".flood").read_text().split()
    finally:
        if flooder is not None:
            subprocess.run(["kill", flooder], capture_output=True)
    assert int(opened) >= 900, opened  # the flood was there (the kernel's backlog took it)
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(line)["SLURMD_NODENAME"] for line in done.stdout.splitlines()) \
        == ["node1", "node2"], done.stdout
    refusals = re.findall(r"refused a connection from (\S+?):\d+: ", done.stderr)
    assert refusals.count("127.0.0.1") == 1, done.stderr  # once for the address
    assert "too many connections" not in done.stderr
    assert "cannot tell the addresses" not in done.stderr  # scontrol named the nodes'


def _ancestors(pid: int) -> list[int]:
    chain = [pid]
    while chain[-1] > 1:
        chain.append(_parent(chain[-1]))
    return chain


def test_no_ancestor_of_an_instance_holds_the_secret(cluster, tmp_path):
    """Guards a defect: the agent unset the secret's variable in itself, but its original
    environment block kept it: every instance could read it from /proc/$PPID/environ. Now it
    comes on the agent's stdin: every ancestor of every instance, up to pid 1 (the agent,
    slurmstepd, ...) whose files can be read, has it neither in its environment nor on its
    command line."""
    poprun_env, copy = _srun_wrapper(cluster, tmp_path)
    go = tmp_path / "go"
    proc = cluster.popen(["salloc", "-N2", "--ntasks-per-node=1", *POPRUN, "-v",
                          "--num-replicas=2", PY, "-c", WAIT_FOR, str(go)],
                         env=poprun_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(instances_with(str(go))) >= 2, "both instances to run", 60)
        seen, walked = {}, set()
        for instance in instances_with(str(go)):
            for pid in _ancestors(instance)[1:]:
                walked.add(pid)
                try:
                    seen[pid] = b"\0".join(Path(f"/proc/{pid}/{part}").read_bytes()
                                           for part in ("environ", "cmdline"))
                except PermissionError:  # pid 1 of a container, as root of its namespace
                    pass
        go.write_text("")
        _, err = _finish(proc)
    finally:
        go.write_text("")
    assert proc.returncode == 0, err
    names = [text.split(b"\0", 1)[0] for text in seen.values()]
    assert any(b"spawner.agent" in text for text in seen.values()), names  # walked them
    assert any(b"slurmstepd" in text for text in seen.values()), names
    assert 1 in walked
    named = [pid for pid, text in seen.items() if SECRET_VARIABLE.encode() in text]
    assert not named, named  # main: the agent's original environment block
    secret = copy.read_bytes().strip()
    assert re.fullmatch(rb"[0-9a-f]{64}", secret), secret  # what srun was given
    assert not [pid for pid, text in seen.items() if secret in text]
