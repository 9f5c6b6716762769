"""`--max-restarts`: a failed job is stopped, cleaned up and started again.
Real processes, locally and over sshd hosts; the V-IPU server is the simulator (none exists
here, see vipu_harness.py)."""

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

from conftest import OFFLINE, poprun_argv, poprun_env, reaped, run_poprun, wait_started
from sshd_hosts import start_ssh_hosts, wait_until
from vipu_harness import sim  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)
PY = sys.executable
# Fails in attempts 0 and 1, succeeds in attempt 2; leaves a note of what it saw each time.
FLAKY = """
import json, os, sys
attempt = int(os.environ["POPDIST_RESTART_COUNT"])
cache = os.environ.get("POPDIST_EXECUTABLE_CACHE_PATH")
note = {k: os.environ[k] for k in ("POPDIST_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT",
                                   "MASTER_PORT")}
note["cache_kept"] = bool(cache) and os.path.exists(os.path.join(cache, "compiled"))
if cache and os.environ["RANK"] == "0":
    open(os.path.join(cache, "compiled"), "w").close()
with open(os.path.join(sys.argv[1], f"{os.environ['RANK']}-{attempt}.json"), "w") as fh:
    json.dump(note, fh)
# Every instance's note is written before one fails (poprun then stops the others).
import glob, time
deadline = time.monotonic() + 30
while len(glob.glob(os.path.join(sys.argv[1], f"*-{attempt}.json"))) < int(os.environ["WORLD_SIZE"]):
    assert time.monotonic() < deadline, "the other instances' notes never came"
    time.sleep(0.01)
sys.exit(3 if attempt < 2 else 0)
"""


def program(tmp_path: Path) -> list[str]:
    (tmp_path / "notes").mkdir()
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    return [PY, str(path), str(tmp_path / "notes")]


def notes(tmp_path: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (tmp_path / "notes").glob("*.json")}


def test_a_job_that_fails_twice_then_succeeds_exits_0_with_three_attempts(tmp_path):
    result_json = tmp_path / "result.json"
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--max-restarts=2",
                      "--restart-delay=0", f"--result-json={result_json}", *program(tmp_path))
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(result_json.read_text())
    assert [a["exit_code"] for a in record["attempts"]] + [record["exit_code"]] == [3, 3, 0]
    seen = notes(tmp_path)
    assert sorted(seen) == [f"{rank}-{attempt}" for rank in (0, 1) for attempt in (0, 1, 2)]
    for attempt in (0, 1, 2):
        note = seen[f"0-{attempt}"]
        assert note["POPDIST_RESTART_COUNT"] == note["TORCHELASTIC_RESTART_COUNT"] == \
            str(attempt)
        assert seen[f"1-{attempt}"]["MASTER_PORT"] == note["MASTER_PORT"]
    assert len({seen[f"0-{a}"]["MASTER_PORT"] for a in (0, 1, 2)}) == 3  # fresh each time
    assert seen["1-2"]["cache_kept"]  # the executable cache survived the restarts
    assert "attempt 1 of 3 failed" in proc.stderr.decode()


def test_the_last_attempts_status_is_the_exit_status_and_every_attempt_is_reported(tmp_path):
    """Attempts that fail differently (5, then 6): the restarts are spent, the last status
    stands (exit_class restarts_spent)."""
    out = tmp_path / "result.json"
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", "--max-restarts=1",
                      "--restart-delay=0", f"--result-json={out}", PY, "-c",
                      "import os, sys; sys.exit(5 + int(os.environ['POPDIST_RESTART_COUNT']))")
    err = proc.stderr.decode()
    assert proc.returncode == 6, err
    assert "poprun: attempt 1 of 2 failed: instance 0 on localhost: exited with status 5" in err
    assert "poprun: attempt 2 of 2 (the last):" in err
    result = json.loads(out.read_text())
    assert (result["exit_class"], result["exit_reason"]) == ("restarts_spent", "instance")
    assert "do not requeue" not in err


def test_attempts_that_fail_the_same_way_exit_with_the_do_not_requeue_status(tmp_path):
    """Every attempt exits 5 the same way: requeueing would fail again. Status 78
    (DO_NOT_REQUEUE_STATUS), exit_class do_not_requeue, said in the report."""
    out = tmp_path / "result.json"
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", "--max-restarts=2",
                      "--restart-delay=0", f"--result-json={out}", PY, "-c",
                      "import sys; sys.exit(5)")
    err = proc.stderr.decode()
    assert proc.returncode == 78, err
    assert "poprun: every attempt (3) failed the same way: exit status 78, do not requeue" \
        in err
    result = json.loads(out.read_text())
    assert (result["exit_code"], result["exit_class"]) == (78, "do_not_requeue")
    assert [a["exit_code"] for a in result["attempts"]] == [5, 5]
    assert result["instances"][0]["exit_status"] == 5  # the instance's own status is kept


def test_attempts_that_make_no_progress_exit_with_the_do_not_requeue_status(tmp_path):
    """The attempts fail differently, but each resumes at step 10 and fails there
    (popdist.progress): no progress between attempts, 78."""
    out = tmp_path / "result.json"
    program = ("import os, sys, popdist; a = int(os.environ['POPDIST_RESTART_COUNT']); "
               "popdist.progress(10 - a); sys.exit(5 + a)")
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--max-restarts=1",
                      "--restart-delay=0", f"--result-json={out}", PY, "-c", program)
    err = proc.stderr.decode()
    assert proc.returncode == 78, err
    assert "no progress between attempts: the last reached step 9, an earlier one 10" in err
    result = json.loads(out.read_text())
    assert result["exit_class"] == "do_not_requeue"
    assert [a["highest_step"] for a in result["attempts"]] + [result["highest_step"]] == \
        [10, 9]


def test_a_job_that_progresses_between_attempts_keeps_its_status(tmp_path):
    program = ("import os, sys, popdist; a = int(os.environ['POPDIST_RESTART_COUNT']); "
               "popdist.progress(10 + a); sys.exit(5 + a)")
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", "--max-restarts=1",
                      "--restart-delay=0", PY, "-c", program)
    assert proc.returncode == 6, proc.stderr.decode()


def test_ctrl_c_during_the_restart_delay_ends_poprun_without_a_restart(tmp_path):
    proc = subprocess.Popen(
        poprun_argv(*OFFLINE, "--num-instances=1", "--num-replicas=1", "--max-restarts=3",
                    "--restart-delay=60", *program(tmp_path)),
        env=poprun_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    err = b""
    try:
        while b"starting attempt 2 in 60 s" not in err:  # bounded by the test's timeout
            line = proc.stderr.readline()
            assert line, err.decode()
            err += line
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=10)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, (err + rest).decode()
    assert time.monotonic() - stopped < 5
    assert sorted(notes(tmp_path)) == ["0-0"]  # no second attempt


def test_remote_instances_restart_too(tmp_path):
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = run_poprun(*OFFLINE, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                          "--max-restarts=2", "--restart-delay=0", *program(tmp_path),
                          env=hosts.env())
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(notes(tmp_path)) == [f"{r}-{a}" for r in (0, 1) for a in (0, 1, 2)]


def test_the_partition_is_kept_and_reset_between_attempts(sim, tmp_path):  # noqa: F811
    proc = run_poprun("--vipu-server-host=localhost", "--vipu-partition=job",
                      "--num-instances=2", "--num-replicas=2", "--max-restarts=2",
                      "--restart-delay=0", *program(tmp_path))
    assert proc.returncode == 0, proc.stderr.decode()
    verbs = sim.verbs()
    assert verbs.count("create") == 1 and verbs.count("reset") == 2, verbs
    assert verbs[-1] == "remove" and sim.partitions() == {}


def test_without_max_restarts_instances_see_no_restart_count(tmp_path):
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", PY, "-c",
                      "import os; print('POPDIST_RESTART_COUNT' in os.environ)")
    assert proc.stdout == b"False\n"


# Attempt 0: once the test says go (poprun knows both instances run), instance 1 (on h2)
# kills its agent, as a host that goes down would lose it; attempt 1 succeeds. Each instance
# notes the attempts it ran in.
LOSES_ITS_HOST = """
import os, signal, sys, time
attempt = int(os.environ["POPDIST_RESTART_COUNT"])
open(os.path.join(sys.argv[1], f"{os.environ['RANK']}-{attempt}.json"), "w").write("{}")
if attempt == 0:
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 30
        while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(300)
"""


def test_a_lost_host_is_quarantined_not_connected_again(tmp_path):
    """h2's agent dies (h2 itself answers at once: its sshd runs): h2 is quarantined for
    the rest of the job, not connected again (once, the next attempt ran there); with no
    spare host, the job ends with the loss (255) and no attempt 1 ran."""
    (tmp_path / "notes").mkdir()
    out = tmp_path / "result.json"
    go = tmp_path / "go"
    with start_ssh_hosts(2, tmp_path) as hosts:
        job = subprocess.Popen(poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=2",
                                           "--num-replicas=2", "--max-restarts=1",
                                           "--restart-delay=0", f"--result-json={out}", PY,
                                           "-c", LOSES_ITS_HOST, str(tmp_path / "notes"),
                                           str(go)),
                               env=poprun_env(hosts.env()), stderr=subprocess.PIPE)
        with reaped(job):
            wait_started(job.pid, 2)  # else a host lost while starting: exit 2, no restart
            # ... and both have noted attempt 0 (else the loss may stop instance 0 first)
            wait_until(lambda: {"0-0", "1-0"} <= {p.stem for p in (tmp_path / "notes").glob(
                "*.json")}, "attempt 0's notes")
            go.write_text("")
            err = job.communicate(timeout=60)[1].decode()
    assert job.returncode == 255, err
    assert "h2: lost the connection to the host" in err
    assert "h2 quarantined for the rest of the job: lost (the agent was killed by SIGKILL" \
        in err, err
    assert "cannot restart the job: h2: lost, and no spare host is left to take its place" \
        in err, err
    assert sorted(notes(tmp_path)) == ["0-0", "1-0"]
    result = json.loads(out.read_text())
    assert result["exit_reason"] == "host_lost" and result["attempts"] == []
    [quarantined] = result["quarantined"]
    assert quarantined["host"] == "h2" and quarantined["reason"].startswith(
        "lost: the agent was killed by SIGKILL")
    assert abs(quarantined["at"] - time.time()) < 60


def test_a_host_that_stays_down_ends_the_job_with_its_loss(tmp_path):
    (tmp_path / "notes").mkdir()
    out = tmp_path / "result.json"
    sleeper = "import os, sys, time; open(sys.argv[1] + '/' + os.environ['RANK'], 'w'); " \
              "time.sleep(300)"
    with start_ssh_hosts(2, tmp_path) as hosts:
        job = subprocess.Popen(poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=2",
                                           "--num-replicas=2", "--max-restarts=3",
                                           "--restart-delay=0", f"--result-json={out}", PY,
                                           "-c", sleeper, str(tmp_path / "notes")),
                               env=poprun_env(hosts.env()), stderr=subprocess.PIPE)
        with reaped(job):
            wait_started(job.pid, 2)
            for pid in hosts.sshd_pids(1):  # h2 goes down: its sshd, listener and sessions
                os.kill(pid, signal.SIGKILL)
            _, err = job.communicate(timeout=60)
    err = err.decode()
    assert job.returncode == 255, err
    assert re.search(r"POPRUN \[E\] cannot restart the job: h2: lost, and no spare host is "
                     r"left", err), err
    result = json.loads(out.read_text())
    assert result["exit_reason"] == "host_lost" and result["attempts"] == []


def test_a_host_lost_between_attempts_is_replaced_by_a_spare(tmp_path):
    """h2's connection goes during the restart delay, before the next attempt started
    anything there. Was: `internal error: KeyError: 'h2'` (the new attempt's Job heard of a
    host it had not started on); now the host is quarantined and replaced by the spare h3
    like one lost during an attempt."""
    (tmp_path / "notes").mkdir()
    fails_first = ("import os, sys; open(sys.argv[1] + '/' + os.environ['RANK'] + '-' + "
                   "os.environ['POPDIST_RESTART_COUNT'], 'w'); "
                   "sys.exit(3 if os.environ['POPDIST_RESTART_COUNT'] == '0' else 0)")
    with start_ssh_hosts(3, tmp_path) as hosts:
        job = subprocess.Popen(poprun_argv(*OFFLINE, "-H", "h1,h2", "--spare-hosts=h3",
                                           "--num-instances=2",
                                           "--num-replicas=2", "--max-restarts=1",
                                           "--restart-delay=10", PY, "-c", fails_first,
                                           str(tmp_path / "notes")),
                               env=poprun_env(hosts.env()), stderr=subprocess.PIPE)
        with reaped(job):
            err = b""
            while b"starting attempt 2 in 10 s" not in err:  # bounded by the test's timeout
                line = job.stderr.readline()
                assert line, err.decode()
                err += line
            listener = hosts.hosts[1].proc.pid
            for pid in hosts.sshd_pids(1):  # h2's sessions end; its sshd stays (it is back)
                if pid != listener:
                    os.kill(pid, signal.SIGKILL)
            err += job.communicate(timeout=60)[1]
    err = err.decode()
    assert job.returncode == 0, err
    assert "h2: lost the connection to the host" in err
    assert "h2 quarantined for the rest of the job" in err
    assert "h2 replaced by spare host h3 for the next attempt" in err
    assert "internal error" not in err
    # Both ran attempt 1 (attempt 0's first failure may stop the other before its note).
    assert {"0-1", "1-1"} <= {p.name for p in (tmp_path / "notes").iterdir()}
