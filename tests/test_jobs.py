"""The per-user job records (poprun/jobctl/records.py) and the output ring (poprun/jobctl/joblog.py): files in a
temporary state directory, no launch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from poprun.jobctl import records as jobs

from poprun.jobctl import joblog
from poprun.result import JOB_SCHEMA
from spawner import procid
from spawner.local import Stream


@pytest.fixture
def environ(tmp_path):
    """A state directory of the test's own ($XDG_RUNTIME_DIR/poprun)."""
    (tmp_path / "run").mkdir()
    return {"XDG_RUNTIME_DIR": str(tmp_path / "run")}


def record(job_id: str, **fields) -> dict:
    base = {"schema": JOB_SCHEMA, "id": job_id, "state": "ended", "instances": [],
            "start_time": time.time(), "end_time": time.time(), "program": ["true"]}
    return {**base, **fields}


def new(environ, **fields) -> tuple[str, str]:
    job_id, directory = jobs.create(environ)
    jobs.write(directory, record(job_id, **fields))
    return job_id, directory


def test_a_job_directory_is_private_and_its_id_short_and_unique(environ):
    ids = {jobs.create(environ)[0] for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == jobs.ID_LENGTH for i in ids)
    assert all(set(i) <= set(jobs.ID_ALPHABET) for i in ids)
    parent = jobs.jobs_dir(environ)
    assert parent == os.path.join(environ["XDG_RUNTIME_DIR"], "poprun", "jobs")
    for path in (os.path.dirname(parent), parent, os.path.join(parent, ids.pop())):
        assert os.stat(path).st_mode & 0o777 == 0o700


def test_without_xdg_runtime_dir_the_records_are_under_the_home(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert jobs.jobs_dir(env) == os.path.join(os.path.expanduser("~"), ".local", "state",
                                              "poprun", "jobs")


def test_a_record_is_replaced_whole(environ):
    job_id, directory = new(environ, state="running")
    jobs.write(directory, record(job_id, state="ended", exit_code=3))
    loaded = jobs.load(directory)
    assert loaded["state"] == "ended" and loaded["exit_code"] == 3
    assert os.listdir(directory) == [jobs.RECORD]  # no temporary file left
    assert os.stat(os.path.join(directory, jobs.RECORD)).st_mode & 0o777 == 0o600


def test_damaged_and_foreign_records_are_reported_and_skipped(environ):
    good, _ = new(environ)
    _, broken = jobs.create(environ)
    with open(os.path.join(broken, jobs.RECORD), "w") as f:
        f.write('{"schema": "poprun.job/1", "id": ')  # cut short
    _, other = jobs.create(environ)
    jobs.write(other, {"schema": "someone-else/9", "id": os.path.basename(other)})
    _, empty = jobs.create(environ)  # no record yet (a launch starting)
    _, renamed = jobs.create(environ)
    jobs.write(renamed, record("notthis"))
    with open(os.path.join(jobs.jobs_dir(environ), "stray-file"), "w") as f:
        f.write("x")
    found = jobs.scan(environ)
    assert [r["id"] for r in found.records] == [good]
    reasons = dict(found.problems)
    assert "not JSON" in reasons[broken]
    assert "not a poprun.job/1 record" in reasons[other]
    assert "cannot read it" in reasons[empty]
    assert "id" in reasons[renamed]
    assert "not a job directory" in reasons[os.path.join(jobs.jobs_dir(environ), "stray-file")]


@pytest.mark.parametrize("fields, named", [
    ({"start_time": "yesterday"}, "start_time"),
    ({"hosts": ["h1"]}, "hosts[]"),
    ({"launcher": ["pid", 1]}, "launcher"),
    ({"instances": [{"index": 0, "pid": "12"}]}, "instances[0].pid"),
    ({"instances": ["x"]}, "instances[0]"),
    ({"instances": None}, "instances"),
    ({"num_instances": True}, "num_instances"),
])
def test_a_record_with_fields_of_the_wrong_type_is_skipped_naming_them(environ, fields, named):
    """Right schema, wrong shapes (a hand edit): the readers would crash on them later."""
    good, _ = new(environ)
    _, damaged = new(environ, **fields)
    found = jobs.scan(environ)
    assert [r["id"] for r in found.records] == [good]
    (path, why), = found.problems
    assert path == damaged and why.startswith("damaged: ") and named in why.split(": ")[1]


# no switch: root, a property of the run
@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_record_is_not_trusted(environ):
    _, directory = new(environ)
    os.chown(os.path.join(directory, jobs.RECORD), 12345, -1)
    (path, why), = jobs.scan(environ).problems
    assert path == directory and "another user" in why


def test_a_job_is_found_by_its_id_or_a_prefix(environ):
    records = [record("abc234"), record("abd567"), record("xyz234")]
    assert jobs.find(records, "xyz")["id"] == "xyz234"
    assert jobs.find(records, "abc234")["id"] == "abc234"
    with pytest.raises(LookupError, match="ambiguous: abc234, abd567"):
        jobs.find(records, "ab")
    with pytest.raises(LookupError, match="no job 'qqq'"):
        jobs.find(records, "qqq")


def test_the_launcher_is_told_apart_from_a_process_that_reused_its_pid(environ):
    here = {"host": socket.gethostname(), "boot_id": procid.boot_id()}
    me = os.getpid()
    alive = record("a", state="running",
                   launcher={**here, "pid": me, "start": procid.start_ticks(me)})
    assert jobs.launcher_status(alive) == "alive" and jobs.state_of(alive) == "running"
    reused = record("b", state="running",
                    launcher={**here, "pid": me, "start": procid.start_ticks(me) - 1})
    assert jobs.launcher_status(reused) == "gone" and jobs.state_of(reused) == "gone"
    rebooted = record("c", state="running",
                      launcher={**here, "pid": me, "start": procid.start_ticks(me),
                                "boot_id": "another-boot"})
    assert jobs.launcher_status(rebooted) == "gone"
    elsewhere = record("d", state="running", launcher={**here, "host": "not-this-host",
                                                       "pid": me})
    assert jobs.launcher_status(elsewhere) == "elsewhere"
    assert jobs.launcher_status(record("e")) == "ended"


def test_ended_jobs_are_kept_bounded_and_running_ones_never_pruned(environ):
    now = time.time()
    made = [new(environ) for _ in range(7)]
    running, _ = new(environ, state="running")
    old_id, old_dir = new(environ)
    os.utime(os.path.join(old_dir, jobs.RECORD), (now - 8 * 86400,) * 2)
    for rank, (_, directory) in enumerate(made):  # the first made is the oldest
        os.utime(os.path.join(directory, jobs.RECORD), (now - 100 + rank,) * 2)
        joblog.RingLog(directory, cap=1000).close()
    # Most recent first: running, made[6], ..., made[0], then the 8-day-old one.
    removed = jobs.prune(environ, now=now, keep=5, keep_logs=3)
    assert set(removed) == {old_id, made[0][0], made[1][0], made[2][0]}
    left = {r["id"] for r in jobs.scan(environ).records}
    assert left == {running} | {i for i, _ in made[3:]}
    with_logs = [i for i, d in made if os.path.exists(os.path.join(d, joblog.LOG))]
    assert with_logs == [i for i, _ in made[-2:]]  # 3 most recent: running + the 2 newest


def test_the_ring_keeps_the_most_recent_whole_records_within_its_cap(tmp_path):
    ring = joblog.RingLog(str(tmp_path), cap=1000)
    for n in range(100):
        ring.write(n % 3, Stream.STDERR if n % 2 else Stream.STDOUT, b"line %d\n" % n)
    ring.close()
    assert os.path.getsize(tmp_path / joblog.LOG) == joblog.HEADER_SIZE + 1000
    data = joblog.read_ring(str(tmp_path))
    assert 1000 - 20 < len(data) <= 1000  # full, but for less than one record
    got = list(joblog.records(data))
    assert got[-1] == (99 % 3, "stderr", b"line 99\n")
    numbers = [int(d.split()[1]) for _, _, d in got]
    assert numbers == list(range(numbers[0], 100))  # in order, whole, nothing lost since


def test_the_ring_holds_each_record_as_soon_as_it_is_written(tmp_path):
    """No flush: another reader of the file sees every record at once, across the wrap."""
    ring = joblog.RingLog(str(tmp_path), cap=300)
    assert joblog.read_ring(str(tmp_path)) == b""
    for n in range(60):
        ring.write(1, Stream.STDOUT, b"line %d\n" % n)
        got = [d for _, _, d in joblog.records(joblog.read_ring(str(tmp_path)))]
        assert got[-1] == b"line %d\n" % n and len(b"".join(got)) <= 300
    ring.close()


def test_a_block_longer_than_the_ring_keeps_its_end(tmp_path):
    ring = joblog.RingLog(str(tmp_path), cap=joblog.MIN_CAP)
    ring.write(0, Stream.STDOUT, b"old\n")
    block = b"".join(b"%04d\n" % n for n in range(1000))
    ring.write(2, Stream.STDOUT, block)
    ring.close()
    kept = joblog.read_ring(str(tmp_path))
    *_, (key, stream, data) = joblog.records(kept)
    assert len(kept) <= joblog.MIN_CAP
    assert (key, stream) == (2, "stdout") and block.endswith(data)
    assert joblog.MIN_CAP - 48 <= len(data) < joblog.MIN_CAP


def test_the_ring_survives_its_writer_killed_outright(tmp_path):
    """What a launcher routed before a SIGKILL is in the file: the kernel keeps the
    mapped pages (a real process, killed by the real signal)."""
    script = (
        "import os, signal, sys\n"
        "from poprun.jobctl import joblog\n"
        "from spawner.local import Stream\n"
        f"ring = joblog.RingLog({str(tmp_path)!r}, cap=1 << 16)\n"
        "for n in range(500):\n"
        "    ring.write(n % 4, Stream.STDOUT, b'line %d\\n' % n)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -9
    numbers = [int(d.split()[1]) for _, _, d in joblog.records(joblog.read_ring(
        str(tmp_path)))]
    assert numbers == list(range(500))


def test_a_ring_the_filesystem_cannot_back_is_refused_at_its_making(tmp_path):
    """Space is reserved up front: a file that cannot have it (here the file-size limit
    stands for a full disk) raises OSError and leaves no file, rather than a SIGBUS on a
    later store into the mapping."""
    script = (
        "import resource, signal\n"
        "from poprun.jobctl import joblog\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    joblog.RingLog({str(tmp_path)!r}, cap=1 << 20)\n"
        "except OSError as exc:\n"
        "    print('refused', exc.strerror)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.stdout.decode().startswith("refused "), proc.stderr.decode()
    assert not (tmp_path / joblog.LOG).exists()


def test_anything_but_a_ring_file_reads_as_no_output(tmp_path):
    assert joblog.read_ring(str(tmp_path)) == b""
    for junk in (b"", b"@0 o 2\nx\n", b"poprunR1" + bytes(100), bytes(joblog.HEADER_SIZE + 8)):
        (tmp_path / joblog.LOG).write_bytes(junk)
        assert joblog.read_ring(str(tmp_path)) == b""


def test_records_survive_any_bytes_and_a_torn_end():
    data = b"\xff\x00binary\n\r\n"
    whole = joblog.encode(2, "stdout", data) + joblog.encode(0, "stderr", b"e\n")
    assert list(joblog.records(whole)) == [(2, "stdout", data), (0, "stderr", b"e\n")]
    assert list(joblog.records(whole[:-1])) == [(2, "stdout", data)]
    assert joblog.tagged(3, "stderr", b"a\nb") == b"[1,3]<stderr>:a\n[1,3]<stderr>:b\n"


def test_the_ring_cap_comes_from_the_environment():
    assert joblog.cap_from({}) == joblog.DEFAULT_CAP
    assert joblog.cap_from({joblog.CAP_VARIABLE: "0"}) == 0
    assert joblog.cap_from({joblog.CAP_VARIABLE: "junk"}) == joblog.DEFAULT_CAP


def test_a_launch_registers_and_its_record_is_its_result_json(tmp_path, environ):
    """Both are LaunchResult.to_json(): one schema."""
    from conftest import OFFLINE, run_poprun

    out = tmp_path / "r.json"
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "-v",
                      f"--result-json={out}", sys.executable, "-c", "print('hi')",
                      env=environ)
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(out.read_text())
    (found,) = jobs.scan(environ).records
    assert f"job {found['id']} (poprunctl show {found['id']}" in proc.stderr.decode()
    found.pop("_dir")
    assert found == result
    assert result["schema"] == JOB_SCHEMA and result["state"] == "ended"
    assert result["argv"][-3:] == [sys.executable, "-c", "print('hi')"]
    assert result["launcher"]["pid"] > 0 and result["hosts"][0]["label"] == "localhost"
    assert all(i["start"] and i["state"] == "exited" for i in result["instances"])
    lines = list(joblog.records(joblog.read_ring(result["dir"])))
    assert sorted(k for k, _, _ in lines) == [0, 1]


def test_a_launch_prunes_old_records_and_their_rings(environ):
    """A launch removes ended jobs beyond the bounds (on a thread of its own, joined before
    it ends): one older than KEEP_SECONDS goes with its output ring; a running one stays."""
    from conftest import OFFLINE, run_poprun

    old_id, old_dir = new(environ)
    joblog.RingLog(old_dir, cap=1000).close()
    running_id, _ = new(environ, state="running")
    stale = time.time() - jobs.KEEP_SECONDS - 60
    os.utime(os.path.join(old_dir, jobs.RECORD), (stale, stale))
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", "true", env=environ)
    assert proc.returncode == 0, proc.stderr.decode()
    assert not os.path.exists(old_dir)
    left = {r["id"]: r["state"] for r in jobs.scan(environ).records}
    assert left.pop(running_id) == "running"
    assert list(left.values()) == ["ended"]  # the launch's own


def test_an_unwritable_state_directory_does_not_stop_a_launch(tmp_path):
    from conftest import OFFLINE, run_poprun

    (tmp_path / "poprun").write_text("a file where the state directory should be")
    proc = run_poprun(*OFFLINE, "-v", sys.executable, "-c", "print('ok')",
                      env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"ok" in proc.stdout
    assert b"no job record" in proc.stderr


def test_a_subprocess_sees_the_record_written_while_the_job_runs(tmp_path, environ):
    from conftest import OFFLINE, poprun_argv, poprun_env
    from sshd_hosts import wait_until

    proc = subprocess.Popen(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                        sys.executable, "-c", "import time; time.sleep(30)"),
                            env=poprun_env(environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        def running():
            records = jobs.scan(environ).records
            return records and sum(i["state"] == "running"
                                   for i in records[0]["instances"]) == 2
        wait_until(running, "a running record")
        (found,) = jobs.scan(environ).records
        assert found["state"] == "running" and found["exit_code"] is None
        assert jobs.launcher_status(found) == "alive"
        assert all(procid.is_same(i["pid"], i["start"]) for i in found["instances"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    (ended,) = jobs.scan(environ).records
    assert ended["state"] == "ended" and ended["exit_reason"] == "signal"


def test_a_dead_launchers_record_counts_as_any_other_against_the_bounds(environ):
    """Its launcher died, its control socket left behind: kept for reap among the `keep`
    most recent, never beyond (such records once stayed 7 days, uncounted,
    their rings with them)."""
    now = time.time()
    gone = {"host": socket.gethostname(), "boot_id": procid.boot_id(), "pid": 2 ** 22 + 7,
            "start": 1}
    made = [new(environ, state="running", launcher=gone) for _ in range(3)]
    for age, (_, directory) in zip((8 * 86400, 60, 0), made):
        open(os.path.join(directory, jobs.SOCKET), "w").close()  # what a SIGKILL leaves
        joblog.RingLog(directory, cap=1000).close()
        os.utime(os.path.join(directory, jobs.RECORD), (now - age,) * 2)
    (stale, _), (older, older_dir), (fresh, fresh_dir) = made
    assert sorted(jobs.prune(environ, now=now, keep=2, keep_logs=1)) == [stale]
    assert os.path.exists(os.path.join(fresh_dir, joblog.LOG))
    assert not os.path.exists(os.path.join(older_dir, joblog.LOG))
    assert jobs.prune(environ, now=now, keep=1) == [older]
    assert [r["id"] for r in jobs.scan(environ).records] == [fresh]


# --- whose state directory -----------------------------------------------------------------

def _sticky_tmp() -> str:
    """A directory like /tmp (root's, 1777) of the test's own: another user can make
    things in it, and nobody can rename what is not theirs."""
    import tempfile

    # Not named poprun-*: tests of dead hosts remove the /tmp/poprun-* that appear meanwhile.
    shared = tempfile.mkdtemp(prefix="sticky-state-test-")
    os.chmod(shared, 0o1777)
    return shared


def _refused(env: dict, marker: str) -> None:
    """poprun and poprunctl refuse this state directory: one line each, exit 2, nothing run."""
    from conftest import OFFLINE, assert_usage_error, poprun_env, run_poprun

    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "touch", marker,
                      env=env)
    assert_usage_error(proc, "state directory")
    assert not os.path.exists(marker)
    ctl = subprocess.run([sys.executable, "-m", "poprun.cli.ctl", "list"], env=poprun_env(env),
                         capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 2 and ctl.stdout == "", ctl
    (line,) = ctl.stderr.splitlines()
    assert line.startswith("poprunctl: error: ") and "state directory" in line


@pytest.mark.timeout(120)
def test_a_state_directory_another_user_made_is_refused(tmp_path):
    """XDG_RUNTIME_DIR=/tmp where another user made /tmp/poprun 0777 first: using it would
    let them read every record and rename the job directories poprunctl acts on. poprun
    and poprunctl refuse it (as tmux its socket directory); nothing is written there."""
    import shutil

    from password_sshd import throwaway_user

    shared = _sticky_tmp()
    try:
        with throwaway_user() as user:
            foreign = os.path.join(shared, "poprun")
            subprocess.run(["mkdir", "-m", "0777", foreign], user=user.name, check=True,
                           timeout=30)
            _refused({"XDG_RUNTIME_DIR": shared}, str(tmp_path / "ran"))
            assert os.listdir(foreign) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_state_directory_open_to_others_or_in_a_changeable_parent_is_refused(tmp_path):
    """This user's own state directory made 0777, or one whose parent others can write to
    (not sticky): refused, saying what to do. In a sticky, root-owned parent (/tmp's kind)
    a new one is made 0700 and used."""
    import shutil
    import stat

    from conftest import OFFLINE, run_poprun

    mine = tmp_path / "mine"
    (mine / "poprun").mkdir(parents=True)
    (mine / "poprun").chmod(0o777)
    _refused({"XDG_RUNTIME_DIR": str(mine)}, str(tmp_path / "ran"))
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    _refused({"XDG_RUNTIME_DIR": str(open_parent)}, str(tmp_path / "ran"))
    shared = _sticky_tmp()
    try:
        proc = run_poprun(*OFFLINE, "true", env={"XDG_RUNTIME_DIR": shared})
        assert proc.returncode == 0, proc.stderr.decode()
        made = os.lstat(os.path.join(shared, "poprun"))
        assert made.st_uid == os.getuid() and stat.S_IMODE(made.st_mode) == 0o700
        assert len(jobs.scan({"XDG_RUNTIME_DIR": shared}).records) == 1
    finally:
        shutil.rmtree(shared, ignore_errors=True)
