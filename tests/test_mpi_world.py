"""The instances' MPI world (this host): real MPICH (the `mpich` wheel) under
real mpi4py, started by poprun, which serves their PMI-1 itself (run/worlds/pmi1.py,
spawner/worlds/pmi1.py). Four instances form one world; MPI_Abort ends the job with its code and its
instance as the root cause; a killed rank ends the job; a restarted job gets a new world;
nothing of MPICH's stays in /dev/shm, after a job, after a SIGKILL of poprun (the lifeline),
or after `poprunctl reap` of a recorded world.

They skip without mpi4py and MPICH, and fail instead where POPRUN_REQUIRE_MPI=1 (CI).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, reaped, run_poprun, wait_started
from poprun.run.reap import host_parts
from requires import skip_or_fail
from spawner.reaphere import mpich_shm_leftovers, mpich_world_ids, reap_here
from sshd_hosts import start_ssh_hosts, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def mpich():
    """MPICH under mpi4py, or a skip (a failure where POPRUN_REQUIRE_MPI=1)."""
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                            "print(MPI.Get_library_version())"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode != 0 or "MPICH" not in probe.stdout:
        skip_or_fail(f"mpi4py over MPICH is not installed ({probe.stderr.strip()[-200:]})",
                     "POPRUN_REQUIRE_MPI")


WORLD = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1, op=MPI.SUM)
word = comm.bcast("hello" if rank == 0 else None, root=0)
comm.Barrier()
print(f"world rank={rank} size={size} sum={total} bcast={word}", flush=True)
"""


def kvsnames(environ: dict[str, str]) -> list[str]:
    """The MPI worlds of every job in the test's state directory (their records)."""
    from poprun.jobctl import records

    return [name for record in records.scan(environ).records
            for names in (record.get("mpi_worlds") or {}).values() for name in names]


def run_world(tmp_path, instances: int, program: str, *options: str):
    """poprun with a --result-json: (the process, the result, None if none was written).
    However the job ended, none of its worlds left a segment in /dev/shm."""
    out = tmp_path / "r.json"
    proc = run_poprun(*OFFLINE, f"--num-instances={instances}", f"--num-replicas={instances}",
                      *options, f"--result-json={out}", sys.executable, "-c", program,
                      timeout=90)
    result = json.loads(out.read_text()) if out.exists() else None
    for name in ((result or {}).get("mpi_worlds") or {}).get("localhost", []):
        assert mpich_shm_leftovers(name) == []
    return proc, result


def aborting(rank: int, code: int) -> str:
    """A program whose instance `rank` calls MPI_Abort(`code`) once the world is up; the others
    would sleep a minute."""
    return ("import time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\n"
            f"if c.Get_rank() == {rank}:\n    c.Abort({code})\ntime.sleep(60)\n")


def assert_aborted(proc, result, rank: int, code: int) -> None:
    """The job ended with `rank`'s MPI_Abort: its code, and that instance the root cause."""
    err = proc.stderr.decode()
    assert proc.returncode == code, err[-3000:]
    assert f"instance {rank} called MPI_Abort (exit code {code})" in err
    assert result["root_cause"] == rank and result["exit_reason"] == "instance"


def test_four_instances_form_one_world_with_ranks_their_indices():
    proc = run_poprun(*OFFLINE, "-v", "--num-instances=4", "--num-replicas=4", sys.executable,
                      "-c", WORLD, timeout=90)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10 bcast=hello" for r in range(4)]
    assert "MPI world: PMI-1 for 4 instance(s)" in proc.stderr.decode()
    for name in kvsnames(os.environ):
        assert mpich_shm_leftovers(name) == []


def test_mpi_abort_ends_the_job_with_its_code_and_its_instance_as_root_cause(tmp_path):
    # MPICH leaves its segment after an abort: poprun does not (run_world checks).
    proc, result = run_world(tmp_path, 4, "import time\nfrom mpi4py import MPI\n"
                             "c = MPI.COMM_WORLD\nc.Barrier()\nif c.Get_rank() == 1:\n"
                             "    c.Abort(3)\ntime.sleep(60)\n")
    err = proc.stderr.decode()
    assert proc.returncode == 3, err[-3000:]
    assert "instance 1 called MPI_Abort (exit code 3)" in err
    assert "instance 1 (pid" in err and "failed first: MPI_Abort: exit code 3" in err
    assert result["root_cause"] == 1 and result["exit_reason"] == "instance"
    assert {i["index"]: i["exit_status"] for i in result["instances"]}[1] == 3
    assert len(result["mpi_worlds"]["localhost"]) == 1


def test_a_killed_rank_ends_the_job_and_leaves_nothing_in_dev_shm(tmp_path):
    proc, result = run_world(tmp_path, 4, "import os, signal, time\nfrom mpi4py import MPI\n"
                             "c = MPI.COMM_WORLD\nc.Barrier()\nif c.Get_rank() == 2:\n"
                             "    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert result["root_cause"] == 2


def test_an_instance_that_exits_0_without_finalize_ends_the_job(tmp_path):
    """Its peers would wait for it in their next collective forever: the job stops, that
    instance the root cause, and poprun does not exit 0."""
    proc, result = run_world(tmp_path, 3, "import os\nfrom mpi4py import MPI\n"
                             "c = MPI.COMM_WORLD\nc.Barrier()\nif c.Get_rank() == 1:\n"
                             "    os._exit(0)\nc.Barrier()\n")
    err = proc.stderr.decode()
    assert proc.returncode == 1, err[-3000:]
    assert "instance 1 exited with status 0 without MPI_Finalize" in err
    assert "MPI: exited with status 0 before MPI_Finalize" in err
    assert result["root_cause"] == 1 and result["exit_reason"] == "instance"


def test_each_attempt_of_a_restarted_job_gets_a_world_of_its_own(tmp_path):
    proc, result = run_world(
        tmp_path, 2, "import os\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
        "print('attempt', os.environ['POPDIST_RESTART_COUNT'], 'size', c.Get_size(),"
        " flush=True)\nc.Barrier()\n"
        "if os.environ['POPDIST_RESTART_COUNT'] == '0' and c.Get_rank() == 0:\n"
        "    c.Abort(5)\n", "--max-restarts=1", "--restart-delay=0")
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    said = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("attempt"))
    assert said == ["attempt 0 size 2"] * 2 + ["attempt 1 size 2"] * 2
    names = result["mpi_worlds"]["localhost"]
    assert len(names) == 2 and names[0] != names[1]  # MPICH's shared memory is named by it
    assert [a["exit_code"] for a in result["attempts"]] == [5]


def test_a_killed_poprun_leaves_nothing_in_dev_shm(tmp_path):
    """SIGKILL of poprun while its instances hold their world: the lifeline's watchdog kills
    them and then removes MPICH's segment, which no rank removed."""
    program = ("import time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
               "print('in', flush=True)\ntime.sleep(60)\n")
    with reaped(subprocess.Popen(
            poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2", sys.executable,
                        "-c", program),
            env=poprun_env({"POPRUN_NO_DASHBOARD": "1"}), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)) as job:
        wait_started(job.pid, 2)
        assert job.stdout.readline() == b"in\n"  # the world is up: MPICH made its segment
        (name,) = [n for n in kvsnames(os.environ) if mpich_shm_leftovers(n)]
        job.kill()
        job.wait(30)
    wait_until(lambda: not mpich_shm_leftovers(name), "the watchdog to remove the segment")


def test_only_the_world_s_own_segments_are_its_leftovers(tmp_path):
    """MPICH's names for the world's ids, any node, and nothing else: not another id that
    begins with the same digits, not a name whose node is not a number."""
    name = "poprun-leftovertest-0"
    first, *_, last = mpich_world_ids(name)
    own = {f"mpich_shm_{first:x}_0", f"mpich_vci_{last:x}_12"}
    for entry in (*own, f"mpich_shm_{first:x}0_1", f"mpich_shm_{first:x}_x",
                  f"mpich_other_{first:x}_0", "sm_segment.vm.0.1.0"):
        (tmp_path / entry).touch()
    assert {os.path.basename(path) for path in mpich_shm_leftovers(name, str(tmp_path))} == own
    assert mpich_shm_leftovers(name, str(tmp_path / "absent")) == []


def test_reap_removes_a_recorded_world_s_segment():
    """`poprunctl reap` on a host whose watchdog could not run: the record's mpi_worlds go
    to reaphere, which removes MPICH's segments of each (a real file in /dev/shm)."""
    name = f"poprun-reaptest{os.getpid()}-0"
    path = f"/dev/shm/mpich_shm_{mpich_world_ids(name)[0]:x}_0"
    with open(path, "w"):
        pass
    try:
        parts = host_parts({"hosts": [{"label": "localhost", "local": True}],
                            "mpi_worlds": {"localhost": [name]}})
        assert parts["localhost"]["kvsnames"] == [name]
        assert reap_here({**parts["localhost"], "dry_run": True}) == [
            {"what": "shm", "path": path, "done": False, "note": "would remove it"}]
        assert os.path.exists(path)
        assert reap_here(parts["localhost"]) == [
            {"what": "shm", "path": path, "done": True, "note": "removed"}]
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_program_without_mpi_is_untouched_by_the_world():
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", sys.executable, "-c",
                      "import os; print(os.environ['PMI_RANK'], os.environ['PMI_SIZE'], "
                      "os.environ['MPI_LOCALNRANKS'])")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
    assert sorted(proc.stdout.decode().split("\n")[:2]) == ["0 2 2", "1 2 2"]


# --- across hosts: each agent serves its own instances and forwards (worlds/nodeworld.py) --

@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with start_ssh_hosts(2, tmp_path_factory.mktemp("hosts")) as hosts:
        yield hosts


ACROSS = """
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mine = np.full(1 << 20, rank + 1.0)  # 8 MB
total = np.empty_like(mine)
comm.Allreduce(mine, total)
word = comm.bcast("hello" if rank == 0 else None, root=0)
comm.Barrier()
print(f"world rank={rank} size={size} sum={total.min():g}-{total.max():g} bcast={word}",
      flush=True)
"""


def run_across(hosts, tmp_path, host_list: str, program: str, *options: str,
               program_args: tuple[str, ...] = ()):
    """poprun over sshd hosts with a --result-json, as run_world: (the process, the result).
    However the job ended, none of its worlds left a segment in /dev/shm (one for every
    test host: they share this machine's)."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-v", "-H", host_list, "--num-instances=4", "--num-replicas=4",
                    *options, f"--result-json={out}", sys.executable, "-c", program,
                    *program_args),
        env=poprun_env(hosts.env()), capture_output=True, timeout=100)
    result = json.loads(out.read_text()) if out.exists() else None
    for names in ((result or {}).get("mpi_worlds") or {}).values():
        for name in names:
            assert mpich_shm_leftovers(name) == []
    return proc, result


@pytest.mark.parametrize("host_list", ["h1,h2", "localhost,h2"])
def test_two_hosts_of_two_form_one_world_with_an_8_mb_allreduce(two_hosts, tmp_path, host_list):
    """Both hosts remote, or this one and a remote one (the launcher's own instances then
    join the world it serves)."""
    proc, result = run_across(two_hosts, tmp_path, host_list, ACROSS)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10-10 bcast=hello" for r in range(4)]
    assert "MPI world: PMI-1 for 4 instance(s) on 2 hosts" in err
    assert sorted(result["mpi_worlds"]) == sorted(host_list.split(","))


def test_mpi_abort_on_another_host_ends_the_job_with_its_code(two_hosts, tmp_path):
    proc, result = run_across(two_hosts, tmp_path, "h1,h2", aborting(3, 7))
    assert_aborted(proc, result, 3, 7)


def test_a_killed_rank_on_another_host_ends_the_job(two_hosts, tmp_path):
    proc, result = run_across(two_hosts, tmp_path, "h1,h2",
                              "import os, signal, time\nfrom mpi4py import MPI\n"
                              "c = MPI.COMM_WORLD\nc.Barrier()\nif c.Get_rank() == 2:\n"
                              "    os.kill(os.getpid(), signal.SIGKILL)\nc.Barrier()\n"
                              "time.sleep(60)\n")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert result["root_cause"] == 2


def test_each_attempt_across_hosts_gets_a_world_of_its_own(two_hosts, tmp_path):
    proc, result = run_across(
        two_hosts, tmp_path, "h1,h2",
        "import os\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
        "print('attempt', os.environ['POPDIST_RESTART_COUNT'], 'size', c.Get_size(),"
        " flush=True)\nc.Barrier()\n"
        "if os.environ['POPDIST_RESTART_COUNT'] == '0' and c.Get_rank() == 2:\n"
        "    c.Abort(5)\n", "--max-restarts=1", "--restart-delay=0")
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    said = sorted(line for line in proc.stdout.decode().splitlines()
                  if line.startswith("attempt 1"))
    assert said == ["attempt 1 size 4"] * 4
    names = result["mpi_worlds"]["h2"]
    assert len(names) == 2 and names[0] != names[1]


def test_a_killed_poprun_leaves_nothing_in_dev_shm_on_the_hosts(two_hosts):
    """SIGKILL of poprun while the world is up on two hosts: each agent sees its launcher
    go, kills its instances and removes what MPICH made there."""
    program = ("import time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
               "print('in', flush=True)\ntime.sleep(60)\n")
    with reaped(subprocess.Popen(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4",
                        sys.executable, "-c", program),
            env=poprun_env({**two_hosts.env(), "POPRUN_NO_DASHBOARD": "1"}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)) as job:
        for _ in range(4):
            assert job.stdout.readline() == b"in\n"  # the world is up on both hosts
        environ = {**os.environ, **two_hosts.env()}
        (name,) = {n for n in kvsnames(environ) if mpich_shm_leftovers(n)}  # one per host
        job.kill()
        job.wait(30)
    wait_until(lambda: not mpich_shm_leftovers(name), "the agents to remove the segments")
