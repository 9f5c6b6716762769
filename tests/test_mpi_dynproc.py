"""MPI's dynamic processes under poprun with real MPICH (the `mpich` wheel) under mpi4py
(issue 49): names published by one instance are found by another, on this host and across
two sshd hosts, and connect them; a PMI-1 command poprun does not serve is answered at once
and said at -v (a raw PMI_FD client: MPICH sends none); MPI_Comm_spawn and
MPI_Comm_spawn_multiple start their children under poprun, with their arguments and info
keys; mpi4py.futures' MPIPoolExecutor works, and a killed poprun leaves none of its workers;
a spawn storm is refused with an MPI error and the job goes on.

They skip without mpi4py and MPICH, and fail instead where POPRUN_REQUIRE_MPI=1 (CI).
"""

from __future__ import annotations

import sys

import pytest

from conftest import OFFLINE, run_poprun
from test_mpi_world import mpich, run_across, two_hosts  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)


def poprun(*args: str, timeout: float = 90) -> tuple[int, str, str]:
    """poprun offline with `args` (a program given as `-c` text runs in this Python):
    (its status, its output, its stderr)."""
    proc = run_poprun(*OFFLINE, *args, timeout=timeout)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()

# Rank 0 publishes a port, the last rank looks it up and connects; after the unpublish the
# name is gone (MPI_ERR_NAME).
NAMES = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, last = comm.Get_rank(), comm.Get_size() - 1
if rank == 0:
    port = MPI.Open_port()
    MPI.Publish_name("poprun-ocean", port)
    comm.Barrier()
    inter = MPI.COMM_SELF.Accept(port)
    print("accepted", inter.recv(source=0), flush=True)
    inter.Disconnect()
    MPI.Unpublish_name("poprun-ocean", port)
    MPI.Close_port(port)
    comm.Barrier()
else:
    comm.Barrier()
    if rank == last:
        inter = MPI.COMM_SELF.Connect(MPI.Lookup_name("poprun-ocean"))
        inter.send(f"hello from {rank}", dest=0)
        inter.Disconnect()
    comm.Barrier()
if rank == last:
    try:
        MPI.Lookup_name("poprun-ocean")
    except MPI.Exception as exc:
        print("after unpublish:", MPI.Get_error_class(exc.Get_error_code()) == MPI.ERR_NAME,
              flush=True)
"""


def test_a_name_one_instance_publishes_another_finds_and_connects_to():
    rc, out, err = poprun("--num-instances=2", "--num-replicas=2", sys.executable, "-c", NAMES)
    assert rc == 0, err[-3000:]
    assert sorted(out.split("\n")) == ["", "accepted hello from 1", "after unpublish: True"]


def test_names_cross_hosts_through_the_launcher(two_hosts, tmp_path):
    """Rank 0 on h1 publishes, rank 3 on h2 looks up (each agent asks the launcher: NAME)."""
    proc, _ = run_across(two_hosts, tmp_path, "h1,h2", NAMES)
    out = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert sorted(out.split("\n")) == ["", "accepted hello from 3", "after unpublish: True"]


RAW = """
import os, socket
f = socket.socket(fileno=int(os.environ["PMI_FD"])).makefile("rwb", buffering=0)
for line in ["cmd=init pmi_version=1 pmi_subversion=1", "cmd=frobnicate x=1", "cmd=finalize"]:
    f.write(line.encode() + b"\\n")
    print(f.readline().decode().strip(), flush=True)
"""


def test_a_command_poprun_does_not_serve_is_answered_at_once_and_said_at_v():
    rc, out, err = poprun("-v", "--num-instances=1", sys.executable, "-c", RAW)
    assert rc == 0, err[-3000:]
    assert out.split("\n")[1] == "cmd=frobnicate_result rc=1 msg=unknown_command"
    assert ("instance 0: PMI-1 command 'frobnicate' answered with an error: poprun does not "
            "serve it") in err
