"""MPI's dynamic processes under poprun with real MPICH (the `mpich` wheel) under mpi4py:
names published by one instance are found by another, on this host and across
two sshd hosts, and connect them; a PMI-1 command poprun does not serve is answered at once
and said at -v (a raw PMI_FD client: MPICH sends none); MPI_Comm_spawn and
MPI_Comm_spawn_multiple start their children under poprun, with their arguments and info
keys, on the job's hosts (a parent on one sshd host, children on another, where the `host`
info key says or spread as Hydra spreads them); mpi4py.futures' MPIPoolExecutor works, and a
killed poprun leaves none of its workers, on any host; a spawn storm is refused with an MPI
error and the job goes on.

They skip without mpi4py and MPICH, and fail instead where POPRUN_REQUIRE_MPI=1 (CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, reaped, run_poprun, run_poprunctl
from spawner.reaphere import mpich_shm_leftovers
from sshd_hosts import wait_until
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


# The parent spawns (MPI_Comm_spawn_multiple where `multiple`) children that report their
# world, arguments, appnum and working directory, and a sum over the intercommunicator.
SPAWN = """
import os, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    here = MPI.Info.Create()
    here.Set("wdir", {wdir!r})
    here.Set("soft", "1:3")
    if {multiple}:
        inter = MPI.COMM_SELF.Spawn_multiple(
            [sys.executable, sys.executable], args=[[__file__, "one", "a b"], [__file__, "two"]],
            maxprocs=[2, 1], info=[here, MPI.INFO_NULL])
    else:
        inter = MPI.COMM_SELF.Spawn(sys.executable, args=[__file__, "one", "a b"], maxprocs=3,
                                    info=here)
    total = inter.reduce(None, op=MPI.SUM, root=MPI.ROOT)
    print("parent", inter.Get_remote_size(), total, flush=True)
    inter.Disconnect()
else:
    world = MPI.COMM_WORLD
    print("child", world.Get_rank(), world.Get_size(), world.Get_attr(MPI.APPNUM),
          sys.argv[1:], os.getcwd(), os.environ["PMI_SPAWNED"], flush=True)
    parent.reduce(world.Get_rank() + 1, op=MPI.SUM, root=0)
    parent.Disconnect()
"""


def spawning(tmp_path, multiple: bool) -> str:
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN.format(wdir=str(tmp_path), multiple=multiple))
    return str(script)


def test_spawn_starts_its_children_with_their_arguments_and_info_keys(tmp_path):
    result = tmp_path / "r.json"
    rc, out, err = poprun("-v", "--tag-output", "--num-instances=1", f"--result-json={result}",
                          sys.executable, spawning(tmp_path, False))
    assert rc == 0, err[-3000:]
    assert sorted(out.splitlines()) == ["[1,0]<stdout>:parent 3 6"] + [
        f"[2,{r}]<stdout>:child {r} 3 0 ['one', 'a b'] {tmp_path} 1" for r in range(3)]
    assert "instance 0: spawn info key 'soft' ignored" in err
    assert "instance 0: spawned 3 process(es) in world" in err
    spawned = json.loads(result.read_text())["spawned"]
    assert [(c["tag"], c["spawned_by"], c["exit_status"]) for c in spawned] == [
        ("2,0", 0, 0), ("2,1", 0, 0), ("2,2", 0, 0)]
    assert {c["kvsname"] for c in spawned} == {json.loads(result.read_text())[
        "mpi_worlds"]["localhost"][0] + "-spawn1"}


def test_spawn_multiple_gives_each_command_its_arguments_appnum_and_info(tmp_path):
    rc, out, err = poprun("--num-instances=1", sys.executable, spawning(tmp_path, True))
    assert rc == 0, err[-3000:]
    job_cwd = os.getcwd()
    assert sorted(out.splitlines()) == [
        f"child 0 3 0 ['one', 'a b'] {tmp_path} 1", f"child 1 3 0 ['one', 'a b'] {tmp_path} 1",
        f"child 2 3 1 ['two'] {job_cwd} 1", "parent 3 6"]


POOL = """
import os, time
from mpi4py import MPI
from mpi4py.futures import MPIPoolExecutor

def work(x):
    return x * x, os.getpid()

def wait(_):
    time.sleep(120)

if __name__ == "__main__":
    if MPI.COMM_WORLD.Get_rank() > 0:  # one pool, instance 0's
        raise SystemExit
    with MPIPoolExecutor(max_workers=3, mpi_info={info}) as pool:
        results = list(pool.map(work, range(12), chunksize=1))
        print("squares", [r for r, _ in results], flush=True)
        print("workers", " ".join(str(p) for p in sorted({{p for _, p in results}})), flush=True)
        if {hang}:
            list(pool.map(wait, range(3)))
"""


def pool(tmp_path, hang: bool, host: str | None = None) -> str:
    """The pool's program, in a file (its workers import their functions from it); its
    workers on `host` (None: where poprun places them)."""
    script = tmp_path / "pool.py"
    script.write_text(POOL.format(hang=hang, info=None if host is None else {"host": host}))
    return str(script)


def test_an_mpi_pool_of_three_workers_gives_the_right_results(tmp_path):
    rc, out, err = poprun("--num-instances=1", sys.executable, pool(tmp_path, False))
    assert rc == 0, err[-3000:]
    squares, workers = out.splitlines()
    assert squares == f"squares {[x * x for x in range(12)]}"
    assert 1 <= len(workers.split()[1:]) <= 3


def killed_with_its_pool(tmp_path, job_state, options: tuple[str, ...],
                         env: dict[str, str], host: str | None = None) -> tuple[dict, str]:
    """poprun `options` running an MPI pool that hangs (its workers on `host`), SIGKILLed
    once poprunctl has shown the workers, all alive then: (what `show --json` said, what
    `show` said). Returns once none of the workers is left, nor their world's segment."""
    shown, text = shown_then_killed(
        poprun_argv(*OFFLINE, *options, sys.executable, pool(tmp_path, True, host)), env,
        job_state)
    kvsname = shown["spawned"][0]["kvsname"]  # and their world's segment goes too
    wait_until(lambda: not mpich_shm_leftovers(kvsname), "the watchdog to remove the segment")
    return shown, text


def shown_then_killed(argv: list[str], env: dict[str, str], job_state) -> tuple[dict, str]:
    """`argv`, a poprun running an MPI pool that prints its squares and workers and hangs,
    SIGKILLed once poprunctl has shown the workers, all alive then: (what `show --json`
    said, what `show` said). Returns once none of the workers is left."""
    with reaped(subprocess.Popen(
            argv, env=poprun_env({**env, **job_state, "POPRUN_NO_DASHBOARD": "1"}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)) as job:
        assert job.stdout.readline().startswith(b"squares")
        workers = [int(p) for p in job.stdout.readline().split()[1:]]
        assert workers and all(os.path.exists(f"/proc/{p}") for p in workers)
        [listed] = json.loads(run_poprunctl("list", "--json", env=job_state).stdout)["jobs"]
        shown = json.loads(run_poprunctl("show", "--json", listed["id"], env=job_state).stdout)
        text = run_poprunctl("show", listed["id"], env=job_state, text=True).stdout
        job.kill()
        job.wait(30)
    assert set(workers) <= {c["pid"] for c in shown["spawned"]}
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in workers),
               "the lifelines to kill the spawned workers")
    return shown, text


def test_a_killed_poprun_leaves_none_of_the_pool_s_workers(tmp_path, job_state):
    """poprunctl shows the workers while they run; a SIGKILL of poprun leaves none, nor
    what MPICH made in /dev/shm for their world."""
    shown, text = killed_with_its_pool(tmp_path, job_state, ("--num-instances=1",), {})
    assert [(c["tag"], c["spawned_by"], c["exit_status"]) for c in shown["spawned"]] == [
        ("2,0", 0, None), ("2,1", 0, None), ("2,2", 0, None)]
    assert (f"spawned [2,0] by instance 0: pid {shown['spawned'][0]['pid']} on localhost, "
            "running") in text


STORM = """
import sys
from mpi4py import MPI
try:
    MPI.COMM_SELF.Spawn(sys.executable, args=["-c", "pass"], maxprocs=10000)
except MPI.Exception as exc:
    print("refused", MPI.Get_error_class(exc.Get_error_code()) == MPI.ERR_OTHER, flush=True)
child = "from mpi4py import MPI; p = MPI.Comm.Get_parent(); p.send('on', dest=0); p.Disconnect()"
inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-c", child], maxprocs=2)
print("then", inter.recv(source=0), flush=True)
inter.Disconnect()
"""


def test_a_spawn_storm_is_refused_with_an_mpi_error_and_the_job_goes_on():
    rc, out, err = poprun("-v", "--num-instances=1", sys.executable, "-c", STORM)
    assert rc == 0, err[-3000:]
    # (MPICH's UCX may warn on stdout of a message left over from the refused spawn.)
    assert [line for line in out.splitlines() if "UCX  WARN" not in line] == [
        "refused True", "then on"]
    assert "spawn of 10000 processes refused: poprun starts at most 256 in one spawn" in err


def test_a_failing_child_stops_the_job_with_its_spawning_instance_as_root_cause(tmp_path):
    """(A newline cannot cross PMI-1's spawn message, as under Hydra: the child's program is
    one line.)"""
    child = "import sys; from mpi4py import MPI; MPI.Comm.Get_parent().Barrier(); sys.exit(3)"
    program = ("import sys, time\nfrom mpi4py import MPI\n"
               f"MPI.COMM_WORLD.Spawn(sys.executable, args=['-c', {child!r}]).Barrier()\n"
               "time.sleep(60)\n")
    out = tmp_path / "r.json"
    rc, _, err = poprun("--num-instances=2", "--num-replicas=2", f"--result-json={out}",
                        sys.executable, "-c", program)
    assert rc == 3, err[-3000:]
    assert re.search(r"instance 0 \(pid \d+ on localhost\) failed first: MPI_Comm_spawn: its "
                     r"spawned process \[2,0\] exited with 3", err), err[-3000:]
    result = json.loads(out.read_text())
    assert result["root_cause"] == 0 and result["instances"][0]["exit_status"] == 3


# The last rank (on another host than poprun's) spawns two children; they start on poprun's
# host and connect back to it across hosts.
ACROSS_SPAWN = """
import socket, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    world = MPI.COMM_WORLD
    if world.Get_rank() == world.Get_size() - 1:
        inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-c", sys.argv[1]], maxprocs=2)
        print("parent", world.Get_rank(), inter.reduce(None, op=MPI.SUM, root=MPI.ROOT),
              flush=True)
        inter.Disconnect()
    world.Barrier()
"""
ACROSS_CHILD = ("from mpi4py import MPI; p = MPI.Comm.Get_parent(); "
                "p.reduce(MPI.COMM_WORLD.Get_rank() + 10, op=MPI.SUM, root=0); p.Disconnect()")


def test_an_instance_on_another_host_spawns_children_on_poprun_s_host(two_hosts, tmp_path):
    """Instances 0-1 here, 2-3 on h2: instance 3's spawn goes to poprun (SPAWN_ASK), its
    children start here and connect to it on h2."""
    proc, result = run_across(two_hosts, tmp_path, "localhost,h2",
                              ACROSS_SPAWN.replace("sys.argv[1]", repr(ACROSS_CHILD)))
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert proc.stdout.decode().splitlines() == ["parent 3 21"]
    assert [(c["tag"], c["spawned_by"], c["exit_status"]) for c in result["spawned"]] == [
        ("2,0", 3, 0), ("2,1", 3, 0)]
    assert "instance 3: spawned 2 process(es)" in err


# Instance 0 (on h1) spawns: 2 copies of one command on the host its info key names
# (`host_info`), and 3 of another placed by default (the job's hosts' slots, in turn: h1, h1,
# h2). Each child says its world, appnum and host (its sshd's address, in the SSH_CONNECTION
# its agent passes on), and adds to a sum over the intercommunicator.
ON_HOSTS = """
import os, sys
from mpi4py import MPI
parent = MPI.Comm.Get_parent()
if parent == MPI.COMM_NULL:
    if MPI.COMM_WORLD.Get_rank() == 0:
        there = MPI.Info.Create()
        there.Set("host", {host_info!r})
        inter = MPI.COMM_SELF.Spawn_multiple(
            [sys.executable] * 2, args=[[sys.argv[1], "named"], [sys.argv[1], "spread"]],
            maxprocs=[2, 3], info=[there, MPI.INFO_NULL])
        print("parent", inter.Get_remote_size(), inter.reduce(None, op=MPI.SUM, root=MPI.ROOT),
              flush=True)
        inter.Disconnect()
    MPI.COMM_WORLD.Barrier()
"""
ON_HOSTS_CHILD = """
import os, sys
from mpi4py import MPI
world, parent = MPI.COMM_WORLD, MPI.Comm.Get_parent()
print("child", world.Get_rank(), world.Get_size(), world.Get_attr(MPI.APPNUM), sys.argv[1],
      os.environ["POPRUN_SSH_CONNECTION"].split()[2], flush=True)
world.Barrier()
parent.reduce(world.Get_rank() + 1, op=MPI.SUM, root=0)
parent.Disconnect()
"""


@pytest.mark.parametrize("host_info", ["h2", "h2:2"])
def test_a_parent_on_one_host_spawns_children_on_another(two_hosts, tmp_path, host_info):
    """The `host` info key puts a command's processes on h2 (as Hydra reads it, `h2:2`
    too), the default spreads the other's over both hosts; one world across them, connected
    to their parent on h1; tagged, in the result with their hosts, and all exit 0."""
    child = tmp_path / "child.py"
    child.write_text(ON_HOSTS_CHILD)
    proc, result = run_across(two_hosts, tmp_path, "h1,h2",
                              ON_HOSTS.format(host_info=host_info), "--tag-output",
                              program_args=(str(child),))
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    h1, h2 = (host.addr for host in two_hosts.hosts)
    assert sorted(proc.stdout.decode().splitlines()) == ["[1,0]<stdout>:parent 5 15"] + [
        f"[2,{r}]<stdout>:child {r} 5 {app} {word} {addr}" for r, app, word, addr in [
            (0, 0, "named", h2), (1, 0, "named", h2), (2, 1, "spread", h1),
            (3, 1, "spread", h1), (4, 1, "spread", h2)]]
    assert [(c["tag"], c["spawned_by"], c["host"], c["exit_status"])
            for c in result["spawned"]] == [
        ("2,0", 0, "h2", 0), ("2,1", 0, "h2", 0), ("2,2", 0, "h1", 0), ("2,3", 0, "h1", 0),
        ("2,4", 0, "h2", 0)]
    assert "instance 0: spawned 5 process(es) in world" in err and " on h2, h1," in err
    kvsname = result["spawned"][0]["kvsname"]
    assert mpich_shm_leftovers(kvsname) == []


def test_a_spawn_on_a_host_that_is_not_the_job_s_is_an_mpi_error(two_hosts, tmp_path):
    program = ("import sys\nfrom mpi4py import MPI\ninfo = MPI.Info.Create()\n"
               "info.Set('host', 'elsewhere')\ntry:\n"
               "    MPI.COMM_SELF.Spawn(sys.executable, args=['-c', 'pass'], info=info)\n"
               "except MPI.Exception:\n    print('refused', flush=True)\n")
    proc, _ = run_across(two_hosts, tmp_path, "h1,h2", program)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert proc.stdout.decode().splitlines() == ["refused"] * 4
    assert "spawn on elsewhere: not one of the job's hosts" in err


def test_a_child_failing_on_another_host_is_the_root_cause(two_hosts, tmp_path):
    """Instance 0 on h1 spawns a child on h2 that exits 3: the job ends 3, instance 0 its
    root cause."""
    child = "import sys; from mpi4py import MPI; MPI.Comm.Get_parent().Barrier(); sys.exit(3)"
    program = ("import sys, time\nfrom mpi4py import MPI\n"
               "if MPI.COMM_WORLD.Get_rank() == 0:\n"
               "    info = MPI.Info.Create()\n    info.Set('host', 'h2')\n"
               f"    MPI.COMM_SELF.Spawn(sys.executable, args=['-c', {child!r}], "
               "info=info).Barrier()\ntime.sleep(60)\n")
    proc, result = run_across(two_hosts, tmp_path, "h1,h2", program)
    err = proc.stderr.decode()
    assert proc.returncode == 3, err[-3000:]
    assert re.search(r"instance 0 \(pid \d+ on h1\) failed first: MPI_Comm_spawn: its "
                     r"spawned process \[2,0\] exited with 3", err), err[-3000:]
    assert result["root_cause"] == 0
    assert [(c["host"], c["exit_status"]) for c in result["spawned"]] == [("h2", 3)]


def test_a_killed_poprun_leaves_none_of_the_workers_on_another_host(two_hosts, tmp_path,
                                                                     job_state):
    """An MPI pool on h2 for instance 0 here (mpi4py.futures' `mpi_info`): poprunctl shows
    its workers there; a SIGKILL of poprun leaves none (h2's agent's lifeline), nor their
    world's segment."""
    shown, text = killed_with_its_pool(
        tmp_path, job_state, ("-H", "localhost,h2", "--num-instances=2", "--num-replicas=2"),
        two_hosts.env(), "h2")
    assert [(c["tag"], c["host"], c["exit_status"]) for c in shown["spawned"]] == [
        ("2,0", "h2", None), ("2,1", "h2", None), ("2,2", "h2", None)]
    assert f"spawned [2,2] by instance 0: pid {shown['spawned'][2]['pid']} on h2" in text
