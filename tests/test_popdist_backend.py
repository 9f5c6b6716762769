"""popdist's backend: popdist.init() joins the job's MPI world that poprun
serves (PMI-1 on the instance's socket, run/worlds/pmi1.py), isBackendInitialized() says whether
this instance is in it, finalizeBackend() leaves it (an exit handler does at the latest).
Real processes under poprun; with MPICH (mpi4py) on the same socket where installed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import popdist
from popdist import env
from requires import skip_or_fail

from conftest import OFFLINE, run_poprun

pytestmark = pytest.mark.timeout(120)
PY = sys.executable


def run_instances(program: str, instances: int = 2) -> subprocess.CompletedProcess:
    return run_poprun(*OFFLINE, f"--num-instances={instances}", f"--num-replicas={instances}",
                      PY, "-c", program, timeout=90)


def lines_of(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(proc.stdout.decode().splitlines())


def test_outside_poprun_there_is_no_backend(monkeypatch):
    for name in (env.NUM_TOTAL_REPLICAS, env.NUM_LOCAL_REPLICAS, env.REPLICA_INDEX_OFFSET,
                 env.NUM_IPUS_PER_REPLICA, env.PMI_FD):
        monkeypatch.delenv(name, raising=False)
    assert popdist.isBackendInitialized() is False
    assert popdist.init() is None
    assert popdist.isBackendInitialized() is False
    assert popdist.finalizeBackend() is None  # nothing to leave


JOIN = """
import os, popdist
from popdist import backend
before = popdist.isBackendInitialized()
popdist.init(); popdist.init()  # once joined, again is nothing
print(os.environ["RANK"], before, popdist.isBackendInitialized(), backend._joined.kvsname,
      flush=True)
"""


def test_init_joins_the_job_s_world_and_the_exit_handler_leaves_it():
    """No finalizeBackend(): the exit handler leaves the world, so poprun sees a clean end
    (an instance that joined and left without leaving would end the job, as below)."""
    proc = run_instances(JOIN)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    rows = [line.split() for line in lines_of(proc)]
    assert [row[:3] for row in rows] == [["0", "False", "True"], ["1", "False", "True"]]
    assert rows[0][3] == rows[1][3] and rows[0][3].startswith("poprun-")  # one world


FINALIZE = """
import popdist
popdist.init()
popdist.finalizeBackend(); popdist.finalizeBackend()  # leaving twice is nothing
print("left", popdist.isBackendInitialized(), flush=True)
try:
    popdist.init()
except RuntimeError as error:
    print("again:", error, flush=True)
"""


def test_finalize_leaves_and_the_backend_cannot_come_back():
    proc = run_instances(FINALIZE, instances=1)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert lines_of(proc) == [
        "again: popdist.init(): the backend was finalised in this process; as with MPI, it "
        "cannot be initialised again", "left False"]


def test_an_instance_that_leaves_without_finalizing_ends_the_job():
    """os._exit skips the exit handler: to poprun's world that is an MPI process gone
    without MPI_Finalize, and the job ends (as mpirun ends it)."""
    proc = run_instances("import os, time, popdist\npopdist.init()\n"
                         "if os.environ['RANK'] == '0':\n    os._exit(0)\ntime.sleep(60)\n")
    assert proc.returncode == 1
    assert "exited with status 0 before MPI_Finalize" in proc.stderr.decode()


DESCENDANTS = """
import os, subprocess, sys, popdist
popdist.init()
child = "import os, popdist; popdist.init(); print('child', popdist.isBackendInitialized())"
subprocess.run([sys.executable, "-c", child], check=True)  # close_fds: PMI_FD names nothing
pid = os.fork()
if pid == 0:  # a forked child holds the socket, but the world counts the instance only
    print("fork", popdist.isBackendInitialized(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("instance", popdist.isBackendInitialized(), flush=True)
"""


def test_descendants_of_an_instance_are_not_in_its_world():
    proc = run_instances(DESCENDANTS, instances=1)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert lines_of(proc) == ["child False", "fork False", "instance True"]


def test_instances_on_two_hosts_join_one_world(tmp_path):
    """Across hosts each host's agent serves its instances' sockets (run/worlds/pmi1.py)."""
    from conftest import poprun_argv, poprun_env
    from sshd_hosts import start_ssh_hosts

    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = subprocess.run(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4",
                        PY, "-c", JOIN),
            env=poprun_env(hosts.env()), capture_output=True, timeout=100)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    rows = [line.split() for line in lines_of(proc)]
    assert [row[:3] for row in rows] == [[str(r), "False", "True"] for r in range(4)]
    assert len({row[3] for row in rows}) == 1


# --- with MPICH on the same socket ----------------------------------------------------------

@pytest.fixture(scope="module")
def mpich():
    probe = subprocess.run([PY, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or "MPICH" not in probe.stdout:
        skip_or_fail("mpi4py over MPICH is not installed", "POPRUN_REQUIRE_MPI")


BEFORE_MPI = """
import socket
socket.setdefaulttimeout(5)  # popdist must not leave the socket non-blocking for MPICH
import popdist
popdist.init()
from mpi4py import MPI
comm = MPI.COMM_WORLD
print("sum", comm.Get_rank(), comm.allreduce(comm.Get_rank() + 1), popdist.isBackendInitialized(),
      flush=True)
"""

AFTER_MPI = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
import popdist
popdist.init()
print("sum", comm.Get_rank(), comm.allreduce(1), popdist.isBackendInitialized(), flush=True)
popdist.finalizeBackend()
comm.Barrier()  # MPICH goes on on the socket popdist left
"""


@pytest.mark.parametrize("program, total", [(BEFORE_MPI, 6), (AFTER_MPI, 3)],
                         ids=["popdist-first", "mpi-first"])
def test_popdist_and_mpich_share_the_instance_s_world(mpich, program, total):
    proc = run_instances(program, instances=3)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert lines_of(proc) == [f"sum {rank} {total} True" for rank in range(3)]
