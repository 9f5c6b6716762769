"""Spare hosts (--spare-hosts; docs/several-hosts.md, "Spare hosts"): a host lost or frozen in
an attempt is replaced by a spare in the next, the same instances on it, and never used again
in the job. Real sshd hosts on loopback (tests/sshd_hosts.py): h1 and h2 run the job, h3 (and
h4) stand by. Each instance notes, per attempt, the host its agent was reached at
(POPRUN_SSH_CONNECTION's server address, 127.0.77.k for hk)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (OFFLINE, assert_usage_error, poprun_argv, poprun_env, reaped,
                      run_poprunctl)
from sshd_hosts import freeze, start_ssh_hosts, thaw, wait_until

pytestmark = pytest.mark.timeout(150)
PY = sys.executable
# Notes where it runs in each attempt. In attempts before HOLD (an argument, 1 unless
# said), waits to be killed with its host (the test does it); in attempt FAILS_IN, rank 0
# fails once all have noted; else ends 0.
NOTES = """
import json, os, sys, time, glob
where, fails_in, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, attempt = os.environ["RANK"], int(os.environ.get("POPDIST_RESTART_COUNT", "0"))
note = {"host": os.environ["POPRUN_SSH_CONNECTION"].split()[2], "pid": os.getpid(),
        "agent": os.getppid(), "local_rank": os.environ["LOCAL_RANK"],
        "replicas": os.environ.get("POPDIST_NUM_REPLICAS"),
        "instance_replicas": os.environ.get("POPDIST_NUM_LOCAL_REPLICAS"),
        "x": os.environ.get("FROM_X")}
with open(f"{where}/{rank}-{attempt}.tmp", "w") as fh:
    json.dump(note, fh)
os.rename(f"{where}/{rank}-{attempt}.tmp", f"{where}/{rank}-{attempt}.json")
world = int(os.environ["WORLD_SIZE"])
deadline = time.monotonic() + 60
while len(glob.glob(f"{where}/*-{attempt}.json")) < world:
    assert time.monotonic() < deadline, "the other instances' notes never came"
    time.sleep(0.02)
if attempt < hold:
    time.sleep(300)
sys.exit(3 if attempt == fails_in and rank == "0" else 0)
"""


def notes(where: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in where.glob("*.json")}


def start(hosts, tmp_path: Path, *args: str, fails_in: int = -1,
          hold: int = 1) -> subprocess.Popen:
    (tmp_path / "notes").mkdir()
    return subprocess.Popen(
        poprun_argv(*OFFLINE, "--num-instances=4", "--num-replicas=8", "--restart-delay=0",
                    "-x", "FROM_X=kept", f"--result-json={tmp_path / 'result.json'}", *args,
                    PY, "-c", NOTES, str(tmp_path / "notes"), str(fails_in), str(hold)),
        env=poprun_env(hosts.env()), stderr=subprocess.PIPE)


def wait_for_attempt_0(tmp_path: Path) -> dict[str, dict]:
    wait_until(lambda: len(notes(tmp_path / "notes")) == 4, "attempt 0's notes")
    return notes(tmp_path / "notes")


def kill_sessions(hosts, i: int) -> None:
    """Host i's sshd sessions and what they run die; its listener stays: the host is back
    at once, reachable for a new connection."""
    for pid in hosts.sshd_pids(i):
        if pid != hosts.hosts[i].proc.pid:
            os.kill(pid, signal.SIGKILL)


def test_a_lost_host_s_instances_run_on_the_spare_and_it_is_not_used_again(tmp_path):
    """h2's sessions and agent die mid-job (its sshd listener stays: it is back at once).
    Attempt 1 runs instances 2 and 3 on the spare h3, with the same indices, local ranks,
    replicas and -x; instances 0 and 1 stay on h1. Attempt 1 fails (instance 0), and
    attempt 2 runs on h1 and h3 again: h2, quarantined, is not used though it answers."""
    with start_ssh_hosts(3, tmp_path) as hosts:
        job = start(hosts, tmp_path, "-H", "h1,h2", "--spare-hosts", "h3",
                    "--max-restarts=2", fails_in=1)
        with reaped(job):
            first = wait_for_attempt_0(tmp_path)
            kill_sessions(hosts, 1)
            _, err = job.communicate(timeout=90)
    err = err.decode()
    assert job.returncode == 0, err
    seen = notes(tmp_path / "notes")
    assert sorted(seen) == [f"{r}-{a}" for r in range(4) for a in range(3)], err
    assert [first[f"{r}-0"]["host"] for r in range(4)] == ["127.0.77.1"] * 2 + \
        ["127.0.77.2"] * 2
    for attempt in (1, 2):
        assert [seen[f"{r}-{attempt}"]["host"] for r in range(4)] == \
            ["127.0.77.1"] * 2 + ["127.0.77.3"] * 2, err
    for key, note in seen.items():  # the same instance, whatever its host
        rank = int(key.split("-")[0])
        assert (note["local_rank"], note["x"]) == (str(rank % 2), "kept")
        assert note["instance_replicas"] == first[f"{rank}-0"]["instance_replicas"]
    assert "h2 replaced by spare host h3 for the next attempt (2 instance(s))" in err
    result = json.loads((tmp_path / "result.json").read_text())
    assert [i["host"] for i in result["instances"]] == ["h1", "h1", "h3", "h3"]
    assert [a["exit_reason"] for a in result["attempts"]] == ["host_lost", "instance"]
    [quarantined] = result["quarantined"]
    assert quarantined["host"] == "h2" and quarantined["reason"].startswith("lost: ")
    assert "h2 quarantined for the rest of the job: lost (" in err
    shown = run_poprunctl("show", result["id"], "--json", env={})
    assert json.loads(shown.stdout)["quarantined"] == [quarantined], shown.stderr
    text = run_poprunctl("show", result["id"], env={}).stdout.decode()
    assert re.search(r"quarantined: h2 \d\d:\d\d:\d\d \(lost: ", text), text


def test_a_frozen_host_is_replaced_by_the_spare_after_the_host_timeout(tmp_path):
    """h2's agent and sshd session are frozen (SIGSTOP): after --host-timeout (2 s) it is
    lost, and the next attempt runs its instances on h3."""
    with start_ssh_hosts(3, tmp_path) as hosts:
        job = start(hosts, tmp_path, "-H", "h1,h2", "--spare-hosts=h3", "--max-restarts=1",
                    "--host-timeout=2")
        with reaped(job):
            first = wait_for_attempt_0(tmp_path)
            frozen = [first["2-0"]["agent"]] + [
                pid for pid in hosts.sshd_pids(1) if pid != hosts.hosts[1].proc.pid]
            try:
                freeze(frozen)
                frozen_at = time.monotonic()
                wait_until(lambda: {f"{r}-1" for r in range(4)} <= set(
                    notes(tmp_path / "notes")), "attempt 1 to run", timeout=60)
                recovered = time.monotonic() - frozen_at
                _, err = job.communicate(timeout=60)
            finally:
                thaw(frozen)
    err = err.decode()
    assert job.returncode == 0, err
    assert re.search(r"h2: lost the connection to the host \(no word from the agent for "
                     r"2\.\d s", err), err
    seen = notes(tmp_path / "notes")
    assert [seen[f"{r}-1"]["host"] for r in range(4)] == ["127.0.77.1"] * 2 + \
        ["127.0.77.3"] * 2
    assert recovered < 30, recovered  # the bound is measured in bench/, not here


def test_with_no_spare_left_the_job_ends_with_the_loss(tmp_path):
    """h2 is lost and replaced by h3; then h3 is lost, and no spare is left: the job ends
    255, h3 named, h2 not reconnected though it answers."""
    with start_ssh_hosts(3, tmp_path) as hosts:
        job = start(hosts, tmp_path, "-H", "h1,h2", "--spare-hosts=h3", "--max-restarts=3",
                    hold=2)
        with reaped(job):
            wait_for_attempt_0(tmp_path)
            kill_sessions(hosts, 1)
            wait_until(lambda: {f"{r}-1" for r in range(4)} <= set(
                notes(tmp_path / "notes")), "attempt 1 to run", timeout=60)
            kill_sessions(hosts, 2)
            _, err = job.communicate(timeout=60)
    err = err.decode()
    assert job.returncode == 255, err
    assert "h2 replaced by spare host h3" in err
    assert "h3: lost, and no spare host is left to take its place" in err, err
    assert "reconnecting" not in err and err.count("quarantined for the rest of the job") == 2
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exit_reason"] == "host_lost"


def h2_lost_with_spares_h3_h4(hosts, tmp_path: Path) -> str:
    """A job on h1,h2 with the spares h3,h4 that loses h2 and ends well: its stderr."""
    job = start(hosts, tmp_path, "-H", "h1,h2", "--spare-hosts=h3,h4", "--max-restarts=1")
    with reaped(job):
        wait_for_attempt_0(tmp_path)
        kill_sessions(hosts, 1)
        _, err = job.communicate(timeout=90)
    assert job.returncode == 0, err.decode()
    return err.decode()


def test_a_spare_whose_facts_differ_is_refused(tmp_path):
    """h3's sessions give the instances another value of a variable the job depends on
    (sshd's SetEnv): it is refused at the start, named with the difference; h4 is taken
    in its place when h2 is lost."""
    setting = {"h3": "other"}
    with start_ssh_hosts(4, tmp_path, setenv=lambda host: {
            "JOB_SETTING": setting.get(host.alias, "same")}) as hosts:
        err = h2_lost_with_spares_h3_h4(hosts, tmp_path)
    assert "spare host h3 refused: it differs from the job's hosts" in err, err
    assert "JOB_SETTING" in err
    assert "h2 replaced by spare host h4" in err
    seen = notes(tmp_path / "notes")
    assert [seen[f"{r}-1"]["host"] for r in range(4)] == ["127.0.77.1"] * 2 + \
        ["127.0.77.4"] * 2


def test_an_unreachable_spare_is_said_at_the_start_and_skipped(tmp_path):
    """h3 is down from the start: one warning naming it, and h4 takes h2's place."""
    with start_ssh_hosts(4, tmp_path) as hosts:
        hosts.kill_host(2)
        err = h2_lost_with_spares_h3_h4(hosts, tmp_path)
    assert re.search(r"spare host skipped: h3: .*refused", err), err
    assert "h2 replaced by spare host h4" in err


@pytest.mark.parametrize("args,words", [
    (["-H", "h1,h2", "--spare-hosts=h2", "--max-restarts=1"],
     ["--spare-hosts", "h2 is also in --host"]),
    (["-H", "h1,h2", "--spare-hosts=h3"], ["--spare-hosts", "--max-restarts"]),
    (["--spare-hosts=h3", "--max-restarts=1"], ["--spare-hosts", "this host only"]),
    (["-H", "h1:2", "--spare-hosts=h3,h3", "--max-restarts=1"],
     ["--spare-hosts", "listed twice"]),
    (["-H", "h1,h2", "--spare-nodes=1", "--max-restarts=1"], ["--spare-nodes", "--host"]),
    (["--spare-nodes=1"], ["--spare-nodes", "--max-restarts"]),
    (["--spare-nodes=-1"], ["--spare-nodes", "non-negative"]),
], ids=["also a job host", "no restarts", "no remote host", "twice", "spare nodes and --host",
        "spare nodes without restarts", "negative spare nodes"])
def test_spares_that_cannot_be_used_are_a_usage_error(args, words):
    proc = subprocess.run(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                      *args, PY, "-c", "pass"),
                          env=poprun_env(), capture_output=True, timeout=60)
    assert_usage_error(proc, *words)


def test_a_host_file_marks_spares(tmp_path):
    """`h3 spare` in a host file: h3 stands by (as --spare-hosts h3); a dry run shows the
    job on h1 and h2 only, and a spare that is also a job host is refused in one line."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2  # the job\nh3 spare\n")
    proc = subprocess.run(poprun_argv(*OFFLINE, "--host-file", str(hostfile),
                                      "--num-instances=2", "--num-replicas=2",
                                      "--max-restarts=1", "--dry-run", PY, "-c", "pass"),
                          env=poprun_env(), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert "instance 0 on h1 " in out and "instance 1 on h2 " in out, out
    assert "spare hosts, standing by: h3\n" in out, out
    hostfile.write_text("h1\nh2\nh2 spare\n")
    proc = subprocess.run(poprun_argv(*OFFLINE, "--host-file", str(hostfile),
                                      "--num-instances=2", "--num-replicas=2",
                                      "--max-restarts=1", PY, "-c", "pass"),
                          env=poprun_env(), capture_output=True, timeout=60)
    assert_usage_error(proc, "h2", "listed twice")


WHERE = "import os; print(os.environ['POPRUN_SSH_CONNECTION'].split()[2])"


def run_where(hosts, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(poprun_argv(*OFFLINE, "--num-instances=4", "--num-replicas=4",
                                      "--tag-output", *args, PY, "-c", WHERE),
                          env=poprun_env(hosts.env()), capture_output=True, timeout=90)


def ran_on(stdout: bytes) -> list[str]:
    by_rank = {}
    for line in stdout.decode().splitlines():
        tag, _, text = line.partition("<stdout>:")
        by_rank[int(tag[1:-1].split(",")[1])] = text
    return [by_rank[r] for r in sorted(by_rank)]


def test_a_quarantined_host_is_left_out_of_later_jobs(tmp_path, job_state):
    """A job loses h2 (--quarantine-for 2h): `poprunctl hosts` lists it; a later job on
    h1,h2 with the spare h3 runs h2's instances on h3, saying so; one without a spare is
    refused in one line; once released, h2 runs jobs again."""
    with start_ssh_hosts(3, tmp_path) as hosts:
        job = start(hosts, tmp_path, "-H", "h1,h2", "--spare-hosts=h3", "--max-restarts=1",
                    "--quarantine-for=2h")
        with reaped(job):
            wait_for_attempt_0(tmp_path)
            kill_sessions(hosts, 1)
            _, err = job.communicate(timeout=90)
        assert job.returncode == 0, err.decode()
        listed = run_poprunctl("hosts", "--json", env=hosts.env())
        assert listed.returncode == 0, listed.stderr
        [entry] = json.loads(listed.stdout)["hosts"]
        assert entry["host"] == "h2" and entry["reason"].startswith("lost: ")
        assert 2 * 3600 - 120 < entry["until"] - time.time() <= 2 * 3600
        assert entry["job"] == json.loads((tmp_path / "result.json").read_text())["id"]
        table = run_poprunctl("hosts", env=hosts.env())
        assert re.search(rb"h2 +\d+s +1h5\dm", table.stdout), table.stdout

        later = run_where(hosts, "-H", "h1,h2", "--spare-hosts=h3", "--max-restarts=1")
        assert later.returncode == 0, later.stderr.decode()
        assert ran_on(later.stdout) == ["127.0.77.1"] * 2 + ["127.0.77.3"] * 2
        assert re.search(r"h2 left out: quarantined \(lost: .*; until .*\); spare host h3 "
                         r"runs its instances", later.stderr.decode()), later.stderr.decode()

        refused = run_where(hosts, "-H", "h1,h2")
        assert_usage_error(refused, "h2 is quarantined (lost: ", "no spare host is left",
                           "poprunctl hosts --release h2")

        released = run_poprunctl("hosts", "--release", "h2", env=hosts.env())
        assert (released.returncode, released.stdout) == (0, b"released h2\n")
        again = run_where(hosts, "-H", "h1,h2")
        assert again.returncode == 0, again.stderr.decode()
        assert ran_on(again.stdout) == ["127.0.77.1"] * 2 + ["127.0.77.2"] * 2
        unknown = run_poprunctl("hosts", "--release", "h9", env=hosts.env())
        assert unknown.returncode == 1 and b"not quarantined: h9" in unknown.stderr


def test_quarantine_for_0_remembers_nothing(tmp_path, job_state):
    with start_ssh_hosts(3, tmp_path) as hosts:
        job = start(hosts, tmp_path, "-H", "h1,h2", "--spare-hosts=h3", "--max-restarts=1",
                    "--quarantine-for=0")
        with reaped(job):
            wait_for_attempt_0(tmp_path)
            kill_sessions(hosts, 1)
            _, err = job.communicate(timeout=90)
        assert job.returncode == 0, err.decode()
        assert "h2 quarantined for the rest of the job" in err.decode()
        listed = run_poprunctl("hosts", env=hosts.env())
        assert listed.stdout == b"no quarantined hosts\n"


def test_a_job_without_restarts_quarantines_the_host_it_lost(tmp_path, job_state):
    """No --max-restarts: h2 is lost, the job ends 255, and h2 is quarantined all the same
    (the result, and later jobs: `poprunctl hosts`)."""
    with start_ssh_hosts(2, tmp_path) as hosts:
        job = start(hosts, tmp_path, "-H", "h1,h2")
        with reaped(job):
            wait_for_attempt_0(tmp_path)
            kill_sessions(hosts, 1)
            _, err = job.communicate(timeout=90)
        assert job.returncode == 255, err.decode()
        result = json.loads((tmp_path / "result.json").read_text())
        assert [q["host"] for q in result["quarantined"]] == ["h2"]
        assert result["exit_class"] == "host_lost"
        listed = json.loads(run_poprunctl("hosts", "--json", env=hosts.env()).stdout)
        assert [e["host"] for e in listed["hosts"]] == ["h2"]


def test_the_time_to_recover_benchmark_runs(tmp_path):
    """bench/recover_bench.py, one run of each kind (its figures are the page's, not this
    test's): it writes its JSON with a drop and a freeze run."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "recover_bench.py"
    proc = subprocess.run([PY, str(bench), "--reps=1", "--per-host=1", "--host-timeout=2",
                           f"--out={tmp_path}"], env=poprun_env(), capture_output=True,
                          timeout=140)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    [written] = tmp_path.glob("recover-*.json")
    runs = json.loads(written.read_text())["runs"]
    assert sorted(r["kind"] for r in runs) == ["drop", "freeze"]
    assert all(r["seconds"] > 0 for r in runs)


SAY_WHERE = ("import os; print('ran', os.environ['RANK'], "
             "os.environ['POPRUN_SSH_CONNECTION'].split()[2], flush=True)")


def without_work_dir_on_h2(work: Path):
    """h2's files: a tmpfs over `work`, so the job's working directory below it is missing
    there (a disk not mounted on one host)."""
    return lambda host: [["-t", "tmpfs", "-o", "size=64k", "tmpfs", str(work)]] \
        if host.alias == "h2" else []


def test_a_host_that_fails_its_checks_at_the_start_is_replaced_by_the_spare(tmp_path):
    """h2 lacks the job's working directory: at the start it is quarantined (its check's
    problem the reason) and the spare h3 runs its instance from the first attempt on."""
    job_dir = tmp_path / "work" / "job"
    job_dir.mkdir(parents=True)
    out_json = tmp_path / "result.json"
    with start_ssh_hosts(3, tmp_path, mounts=without_work_dir_on_h2(tmp_path / "work")) \
            as hosts:
        done = subprocess.run(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--spare-hosts", "h3", "--max-restarts=1",
                        "--num-instances=2", "--num-replicas=2", "--quarantine-for=0",
                        f"--result-json={out_json}", PY, "-c", SAY_WHERE),
            env=poprun_env(hosts.env()), cwd=job_dir, capture_output=True, text=True,
            timeout=90)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:2]) == ["ran 0 127.0.77.1", "ran 1 127.0.77.3"], \
        (done.stdout, done.stderr)
    assert (f"h2 quarantined for the rest of the job: checks (the working directory {job_dir} "
            "does not exist there)") in done.stderr, done.stderr
    assert "h2 replaced by spare host h3 from the start (1 instance(s))" in done.stderr
    result = json.loads(out_json.read_text())
    assert result["attempts"] == [] and [i["host"] for i in result["instances"]] == ["h1", "h3"]
    [quarantined] = result["quarantined"]
    assert quarantined["host"] == "h2" and quarantined["reason"] == \
        f"checks: the working directory {job_dir} does not exist there"


def test_a_check_every_host_fails_is_the_job_s_and_quarantines_none(tmp_path):
    """A program found on no host (a typo): every host, the spare too, fails the same
    check. That is the job's problem, not a host's: the launch is refused as without spares
    (every host named, exit 2), and nothing is quarantined."""
    state = tmp_path / "state"  # the quarantine's file: this test's own
    state.mkdir(mode=0o700)
    with start_ssh_hosts(3, tmp_path) as hosts:
        env = {**hosts.env(), "XDG_RUNTIME_DIR": str(state)}
        done = subprocess.run(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--spare-hosts", "h3", "--max-restarts=1",
                        "--num-instances=2", "--num-replicas=2", "no-such-program-x"),
            env=poprun_env(env), capture_output=True, text=True, timeout=90)
        hosts_listed = run_poprunctl("hosts", env=env, text=True)
    assert done.returncode == 2, done.stderr
    for host in ("h1", "h2"):
        assert f"{host}: program 'no-such-program-x' not found" in done.stderr, done.stderr
    assert "spare host skipped: h3: program 'no-such-program-x' not found" in done.stderr
    assert "quarantined" not in done.stderr and "replaced by spare" not in done.stderr
    assert hosts_listed.stdout.strip().lower() == "no quarantined hosts", hosts_listed


def test_a_job_host_unreachable_at_the_start_is_replaced_by_the_spare(tmp_path):
    """h2's sshd is gone before the job starts: the connection fails, h2 is quarantined
    (the connection's failure the reason) and the spare h3 runs its instance."""
    with start_ssh_hosts(3, tmp_path) as hosts:
        hosts.kill_host(1)
        done = subprocess.run(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--spare-hosts", "h3", "--max-restarts=1",
                        "--num-instances=2", "--num-replicas=2", "--quarantine-for=0",
                        PY, "-c", SAY_WHERE),
            env=poprun_env(hosts.env()), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")[:2]) == ["ran 0 127.0.77.1", "ran 1 127.0.77.3"], \
        (done.stdout, done.stderr)
    assert re.search(r"h2 quarantined for the rest of the job: checks \(.*refused",
                     done.stderr), done.stderr
    assert "h2 replaced by spare host h3 from the start (1 instance(s))" in done.stderr
