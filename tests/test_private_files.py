"""Files other users can read or steer: --result-json and --export-config
hold the command line (`-x SECRET=value`) and are created 0600; --output-filename never
follows a symbolic link poprun did not make and writes only in its own user's directories.

The other user is real: made for the test with useradd (removed after), its files made as
that user with setpriv, as a hostile neighbour would. This machine runs with
fs.protected_symlinks=0 or 1: the checks are poprun's own either way."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, run_poprun, second_user

pytestmark = [pytest.mark.timeout(90),
              # no switch: root, a property of the run
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                 reason="needs root and useradd: a second user")]
PY = sys.executable
SECRET = "SECRET=do-not-show"


@pytest.fixture
def other():
    """A second user, gone after the test (its files too)."""
    with second_user() as user:
        yield user


@pytest.fixture
def shared():
    """A directory both users may write in, as /tmp is (sticky), outside pytest's 0700 one."""
    top = Path(tempfile.mkdtemp(prefix="poprun-shared-"))
    top.chmod(0o1777)
    yield top
    shutil.rmtree(top)


def as_user(user, *argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                    "--clear-groups", *argv], check=True, capture_output=True, timeout=30)


def test_result_json_and_export_config_are_created_0600(tmp_path):
    result, exported = tmp_path / "result.json", tmp_path / "job.toml"
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", "-x", SECRET,
                      f"--result-json={result}", f"--export-config={exported}", "true")
    assert proc.returncode == 0, proc.stderr
    for path in (result, exported):
        assert SECRET in path.read_text()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_an_output_directory_of_another_user_is_refused(other, shared):
    out, witness = shared / "out", shared / "ran"
    as_user(other, "mkdir", "-m", "0777", str(out))
    proc = _write_output(out, witness)
    assert_usage_error(proc, f"--output-filename: cannot write to {out}", "owned by another "
                       f"user (uid {other.pw_uid})")
    assert not witness.exists() and list(out.iterdir()) == []


def test_a_symbolic_link_of_another_user_as_the_output_directory_is_refused(other, shared):
    """The link leads to a directory of root's: it is the link's owner that matters."""
    victim, out, witness = shared / "victim", shared / "out", shared / "ran"
    victim.mkdir()
    as_user(other, "ln", "-s", str(victim), str(out))
    proc = _write_output(out, witness)
    assert_usage_error(proc, str(out), "a symbolic link")
    assert not witness.exists() and list(victim.iterdir()) == []


@pytest.mark.parametrize("planted", ["1", "1/rank.0", "1/rank.0/stdout"])
def test_a_link_planted_below_the_output_directory_is_refused(planted, other, shared):
    """Root's own directory, but writable by others (0777): whatever poprun would make or
    write there, another user's link in its place is refused before anything starts, and
    what it points at is untouched."""
    victim = shared / "victim.txt"
    victim.write_text("root's own\n")
    out, witness = shared / "out", shared / "ran"
    parents = planted.split("/")[:-1]
    for parent in [out, *(out.joinpath(*parents[:i + 1]) for i in range(len(parents)))]:
        parent.mkdir()
        parent.chmod(0o777)
    as_user(other, "ln", "-s", str(victim if planted.endswith("stdout") else shared),
            str(out / planted))
    proc = _write_output(out, witness)
    assert_usage_error(proc, str(out / planted), "a symbolic link")
    assert not witness.exists()
    assert victim.read_text() == "root's own\n"


PLANT_THEN_WRITE = r"""
import os, subprocess, sys, time
rank, out, victim, planter, go = os.environ["RANK"], *sys.argv[1:]
if rank == "0":  # the other user plants its link where instance 1's stdout will go
    subprocess.run([*planter.split(), "ln", "-s", victim, f"{out}/1/rank.1/stdout"], check=True)
    open(go, "w").close()
else:
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    print("instance 1 writes", flush=True)
"""


def test_a_link_planted_while_the_job_runs_is_not_followed(other, shared, tmp_path):
    """After the check, before the file is made: the open itself refuses to follow (the job
    stops as for any file that cannot be written, 74, naming it)."""
    victim = shared / "victim.txt"
    victim.write_text("root's own\n")
    out, go = shared / "out", tmp_path / "go"
    (out / "1" / "rank.1").mkdir(parents=True)
    (out / "1" / "rank.1").chmod(0o777)
    planter = (f"setpriv --reuid={other.pw_uid} --regid={other.pw_gid} --clear-groups")
    proc = run_poprun(*OFFLINE, f"--output-filename={out}", "--num-instances=2",
                      "--num-replicas=2", PY, "-c", PLANT_THEN_WRITE, str(out), str(victim),
                      planter, str(go))
    err = proc.stderr.decode()
    assert proc.returncode == 74, err
    assert re.search(rf"^poprun: stopped: cannot write {re.escape(str(out))}/1/rank\.1/stdout: "
                     r"a symbolic link", err, re.M), err
    assert victim.read_text() == "root's own\n"


def test_the_user_s_own_symbolic_link_to_its_own_directory_is_followed(shared):
    real, out, witness = shared / "real", shared / "out", shared / "ran"
    real.mkdir()
    out.symlink_to(real)
    proc = _write_output(out, witness)
    assert proc.returncode == 0, proc.stderr
    assert (real / "1" / "rank.0" / "stdout").read_text() == "written\n"


def _write_output(out: Path, witness: Path):
    return run_poprun(*OFFLINE, f"--output-filename={out}", "--num-instances=1",
                      "--num-replicas=1", "sh", "-c", f"touch {witness}; echo written")
