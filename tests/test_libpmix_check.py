"""A libpmix is checked before poprun serves Open MPI's world with it (spawner/worlds/pmixcheck.py,
docs/architecture.md "The instances' worlds"): a `--libpmix` that is not a readable libpmix
of a tested version (4.2 to 5.0) is one line and exit 2, before anything starts; one poprun
found itself falls back to PMI-1 with one warning.

The libraries are real: libz, Debian's libpmix 4.2.2, and copies of it whose version string
says 3.2.2 or 6.2.2 (no libpmix of another version can be installed here; the copy is the
real library, so only the version it reports differs). Where the system libpmix is
replaced, a mount namespace of the test's own does it (root; else a skip, CI: a failure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprun
from requires import skip_or_fail
from sshd_hosts import in_mount_namespace, require_mount_namespaces
from spawner.reaphere import pmix_prefixes
from spawner.worlds import pmixcheck, pmixfind

pytestmark = pytest.mark.timeout(120)

SYSTEM_LIBPMIX = next((p for p in pmixfind.system_candidates() if os.path.isfile(p)), None)
VERSION_SAID = b"OpenPMIx 4.2.2rc2"  # what Debian 12's libpmix2 says (PMIx_Get_version)


def require_system_libpmix() -> str:
    if SYSTEM_LIBPMIX is None:
        skip_or_fail("no system libpmix (apt-get install libpmix2)", "POPRUN_REQUIRE_OPENMPI")
    return SYSTEM_LIBPMIX


def libz() -> str:
    """The libz this Python's zlib module loaded (the issue's example of a wrong library)."""
    probe = subprocess.run([sys.executable, "-c", "import zlib\nprint(*{l.split()[-1] for l in "
                            "open('/proc/self/maps') if '/libz.so' in l})"],
                           capture_output=True, text=True, timeout=30)
    path = probe.stdout.strip()
    assert os.path.isfile(path), probe
    return path


def saying(version: bytes, tmp_path) -> str:
    """A copy of the system libpmix whose PMIx_Get_version says `version` (same length)."""
    data = open(os.path.realpath(require_system_libpmix()), "rb").read()
    if data.count(VERSION_SAID) != 1:
        pytest.fail(f"the system libpmix does not say {VERSION_SAID!r} once: update the test")
    copy = tmp_path / f"said-{version.decode()}" / os.path.basename(os.path.realpath(
        SYSTEM_LIBPMIX))
    copy.parent.mkdir()
    copy.write_bytes(data.replace(VERSION_SAID, b"OpenPMIx " + version))
    return str(copy)


@pytest.mark.parametrize("said, expected", [
    ("OpenPMIx 4.2.2rc2 (PMIx Standard: 4.2, Stable ABI: 0.0, Provisional ABI: 0.0)", (4, 2)),
    ("OpenPMIx 5.0.11 (PMIx Standard: 5.0, Stable ABI: 0.0, Provisional ABI: 0.0)", (5, 0)),
    ("OpenPMIx 3.2.3 (PMIx Standard: 3.1)", (3, 2)),
    ("PMIx 6.0.0", (6, 0)),
    ("libz 1.2.13", None),
    ("", None),
])
def test_the_version_libpmix_says_is_read(said, expected):
    assert pmixcheck.parse_version(said) == expected
    refused = pmixcheck.version_problem(said)
    assert (refused is None) == (expected in ((4, 2), (5, 0))), refused


def test_versions_outside_the_tested_range_are_refused_in_one_line():
    for said in ("OpenPMIx 4.1.2 (PMIx Standard: 4.1)", "OpenPMIx 5.1.0 (x)", "OpenPMIx 3.2.3"):
        assert pmixcheck.version_problem(said) == (
            f"{said.split('(')[0].strip()}: poprun serves Open MPI with libpmix 4.2 to 5.0 only")


def assert_one_line_error(proc, state: dict, line: str) -> None:
    """Exit 2, exactly `line` on stderr, nothing on stdout, no crash file."""
    err = proc.stderr.decode()
    assert (proc.returncode, err, proc.stdout) == (2, line + "\n", b"")
    crashes = [name for folder in (os.path.join(state["XDG_RUNTIME_DIR"], "poprun"),)
               if os.path.isdir(folder) for name in os.listdir(folder)
               if name.startswith("crash-")]
    assert crashes == []


def bad_libraries(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, what poprun must say after `--libpmix: PATH: `)."""
    text = tmp_path / "libpmix-text.so.2"
    text.write_text("this is not a library\n" * 10)
    empty = tmp_path / "libpmix-empty.so.2"
    empty.write_bytes(b"")
    directory = tmp_path / "libpmix.d"
    directory.mkdir()
    return {
        "libz": (libz(), "not a libpmix (it has no PMIx_Get_version, PMIx_server_init)"),
        "text": (str(text), "cannot load it as a library: invalid ELF header"),
        "empty": (str(empty), "cannot load it as a library: file too short"),
        "directory": (str(directory), "is a directory, not a library"),
        "missing": (str(tmp_path / "nonexistent.so.2"), "no such file"),
    }


@pytest.mark.parametrize("kind", ["libz", "text", "empty", "directory", "missing"])
def test_a_given_libpmix_that_is_not_one_is_a_usage_error(tmp_path, job_state, kind):
    path, said = bad_libraries(tmp_path)[kind]
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", f"--libpmix={path}",
                      sys.executable, "-c", "pass", env=job_state)
    assert_one_line_error(proc, job_state, f"poprun: error: --libpmix: {path}: {said}")


@pytest.mark.parametrize("version", [b"3.2.2rc2", b"6.2.2rc2"])
def test_a_given_libpmix_of_an_untested_version_is_a_usage_error(tmp_path, job_state, version):
    path = saying(version, tmp_path)
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", f"--libpmix={path}",
                      sys.executable, "-c", "pass", env=job_state)
    assert_one_line_error(proc, job_state, (
        f"poprun: error: --libpmix: {path}: OpenPMIx {version.decode()}: poprun serves Open "
        "MPI with libpmix 4.2 to 5.0 only"))


def test_the_server_itself_refuses_an_untested_version(tmp_path):
    """pmixserver checks again what it loads before PMIx_server_init reads its module table
    (MODULE_SLOTS holds for 4.2 and 5.0 only). In a process of its own: it loads the copy."""
    path = saying(b"3.2.2rc2", tmp_path)
    done = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom spawner.worlds.pmixserver import PmixError, _checked_lib\n"
        "for path in sys.argv[1:]:\n    try:\n        _checked_lib(path)\n"
        "    except PmixError as exc:\n        print(exc)\n    else:\n        print('served')\n"),
        path, libz(), require_system_libpmix()],
        capture_output=True, text=True, timeout=60, env=poprun_env())
    assert done.returncode == 0, done.stderr
    refused, not_one, served = done.stdout.splitlines()
    assert refused == (f"{path}: OpenPMIx 3.2.2rc2: poprun serves Open MPI with libpmix 4.2 "
                       "to 5.0 only")
    assert not_one.startswith(f"{libz()}: not a libpmix to serve with: ") and "PMIx_" in not_one
    assert served == "served"


@pytest.mark.parametrize("kind", ["text", "3.x"])
def test_a_found_libpmix_that_fails_its_check_falls_back_to_pmi1_with_one_warning(
        tmp_path, kind):
    """The system's libpmix replaced (a mount namespace) by a text file or a 3.x: poprun
    finds it, says once that Open MPI's world is not served, and the job runs with PMI-1."""
    require_mount_namespaces()
    system = require_system_libpmix()
    real = os.path.realpath(system)
    if kind == "text":
        stand_in = tmp_path / "text" / os.path.basename(real)
        stand_in.parent.mkdir()
        stand_in.write_text("not a library\n" * 10)
        stand_in = str(stand_in)
    else:
        stand_in = saying(b"3.2.2rc2", tmp_path)
    argv = in_mount_namespace([["--bind", os.path.dirname(stand_in), os.path.dirname(real)]]) \
        + poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2", "sh", "-c",
                      'echo "pmix=${PMIX_NAMESPACE:-none} pmi1=${PMI_FD:+yes}"')
    proc = subprocess.run(argv, env=poprun_env(), capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert proc.stdout.decode().splitlines() == ["pmix=none pmi1=yes"] * 2
    said = {"text": "cannot load it as a library: invalid ELF header",
            "3.x": "OpenPMIx 3.2.2rc2: poprun serves Open MPI with libpmix 4.2 to 5.0 only"}
    (line,) = err.splitlines()  # the warning, once, and nothing else
    assert " POPRUN [W] " in line and line.split(" POPRUN [W] ", 1)[1] == (
        f"Open MPI's world (PMIx) is not served: {system}: {said[kind]}; its instances "
        "would each be a world of one (name a libpmix with --libpmix, or say --mpi-worlds "
        "pmi1)"), err


def test_the_check_looks_for_every_function_the_server_binds():
    """pmixcheck.SYMBOLS and the functions spawner/worlds/pmixserver.py's _Lib binds are one list:
    a function added to the server and not to the check would crash a launch instead of
    refusing the library in one line."""
    import re

    from spawner.worlds import pmixserver

    source = open(pmixserver.__file__).read()
    bound = set(re.findall(r'^\s+"(PMIx_\w+)": \(', source, re.M))
    assert len(bound) >= 10 and bound == set(pmixcheck.SYMBOLS)


def test_a_check_that_does_not_finish_in_time_refuses_the_library_and_ends_its_probe():
    """Loading a library may hang (a constructor's): the probe is given a bound, then killed
    and reaped, and the library refused in one line. (A real libpmix, a bound it cannot
    meet.)"""
    check = pmixcheck.Check(require_system_libpmix())
    with pytest.raises(pmixcheck.Unusable, match=r"^loading it did not finish in 1e-06 s$"):
        check.version(timeout=1e-6)
    assert check._proc.returncode is not None  # killed and reaped, not left running
    with pytest.raises(pmixcheck.Unusable):  # and said again, not checked twice
        check.version()


# --- the server's directory and the job's record ------------------------------------------

def pmix_dirs() -> set[str]:
    """Every PMIx world's directory here (spawner/reaphere.pmix_prefixes: in the temporary
    directory and /dev/shm)."""
    import glob

    return {path for place in (os.path.dirname(p) for p in pmix_prefixes("poprun-x-0"))
            for path in glob.glob(os.path.join(place, "poprun-*-pmix-*"))}


def test_the_pmix_world_is_named_by_the_job_s_record(tmp_path, job_state):
    """The server's directory and the instances' namespace are named by the job's id (that
    of its record: `poprunctl reap` finds them by it), the namespace the job's first world."""
    out = tmp_path / "r.json"
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                      f"--libpmix={require_system_libpmix()}", f"--result-json={out}",
                      sys.executable, "-c", "import os; print(os.environ['PMIX_NAMESPACE'])",
                      env=job_state)
    assert proc.returncode == 0, proc.stderr.decode()
    job_id = json.loads(out.read_text())["id"]
    assert proc.stdout.decode().split() == [f"poprun-{job_id}-0"] * 2
    assert os.listdir(os.path.join(job_state["XDG_RUNTIME_DIR"], "poprun", "jobs")) == [job_id]


def test_a_launch_refused_after_its_pmix_server_started_leaves_nothing(tmp_path, job_state):
    """--output-filename that cannot be written is checked after the server's process has
    started: the usage error leaves neither PMIx directories nor a job record directory."""
    before = pmix_dirs()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                      f"--libpmix={require_system_libpmix()}",
                      f"--output-filename={blocker}/out", sys.executable, "-c", "pass",
                      env=job_state)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.startswith("poprun: error: --output-filename: "), err
    jobs = os.path.join(job_state["XDG_RUNTIME_DIR"], "poprun", "jobs")
    assert not os.path.isdir(jobs) or os.listdir(jobs) == []
    assert pmix_dirs() - before == set()
