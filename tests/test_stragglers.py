"""Stragglers, progress and ETA in real runs: real instances, one
told to sleep longer per step, flagged within the stated time (poprun/progress.py: about
1.5 x --straggler-after after it starts, at most 2x), none flagged in uniform runs (run
several times); progress from lines, from `--progress-pattern`, from popdist.progress()
locally and across two real sshd hosts; `poprunctl show/list` while it runs, the
dashboard on a real terminal, `--result-json` after."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest

from conftest import (OFFLINE, assert_usage_error, poprun_argv, poprun_env, reaped, run_poprun,
                      run_poprunctl)
from sshd_hosts import start_ssh_hosts, wait_until
from terminal import run_on_a_terminal

pytestmark = pytest.mark.timeout(120)
PY = sys.executable
HOLD = 2.0  # --straggler-after in these runs
PATTERN = r"step (\d+)/(\d+)"

# Each instance steps for SECONDS (steps of 0.05 s; SLOW's of 0.3 s), saying each step as
# asked: a line `step i/1000` (lines and --progress-pattern), or popdist.progress(i, 1000).
PROGRAM = """
import os, sys, time
rank, slow = int(os.environ["RANK"]), int(os.environ.get("SLOW", "-1"))
how, seconds = sys.argv[1], float(sys.argv[2])
if how == "popdist":
    import popdist
end, i = time.monotonic() + seconds, 0
while time.monotonic() < end:
    i += 1
    if how == "popdist":
        popdist.progress(i, 1000)
    else:
        print(f"step {i}/1000 loss 0.5", flush=True)
    time.sleep(0.3 if rank == slow else 0.05)
if how == "popdist":
    print(f"last {rank} {i}", flush=True)
"""


def launch(tmp_path, how: str, seconds: float, *args: str, slow: int | None = None,
           instances: int = 4, env: dict | None = None) -> dict:
    result = tmp_path / "result.json"
    extra = ("--progress-pattern", PATTERN) if how == "pattern" else ()
    proc = run_poprun(*OFFLINE, f"--num-instances={instances}", f"--num-replicas={instances}",
                      f"--straggler-after={HOLD}", *extra, *args, f"--result-json={result}",
                      PY, "-c", PROGRAM, how, str(seconds), timeout=90,
                      env={**({} if slow is None else {"SLOW": str(slow)}), **(env or {})})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(result.read_text())


@pytest.mark.parametrize("how", ["lines", "pattern", "popdist"])
def test_a_slowed_instance_is_flagged_within_the_stated_time(tmp_path, how):
    result = launch(tmp_path, how, 7, slow=2)
    assert [s["instance"] for s in result["stragglers"]] == [2], result["stragglers"]
    entry = result["stragglers"][0]
    # Stated: ~1.5 x the hold after its first progress, 2 x at most. That is its first line;
    # popdist's first call comes after `import popdist`: a second's start-up allowed.
    inst = result["instances"][2]
    first = inst["first_output_time"] if how != "popdist" else inst["start_time"] + 1.0
    assert entry["when"] - first <= 2 * HOLD, (entry, inst)
    assert entry["rate"] < entry["median"] / 2
    assert entry["cleared"] is not None  # closed when it exited
    progress = result["progress"]
    assert progress["source"] == how
    rates = {i["index"]: i["mean_rate"] for i in progress["instances"]}
    assert rates[2] < min(rates[0], rates[1], rates[3]) / 2
    if how != "lines":  # the steps' total is known: the slowest's step of it
        assert progress["slowest"] == 2 and progress["total"] == 1000
        assert progress["step"] == progress["instances"][2]["step"] < 50


@pytest.mark.parametrize("run", range(3))
def test_no_straggler_in_a_uniform_run(tmp_path, run):
    result = launch(tmp_path, "lines" if run < 2 else "pattern", 6)
    assert result["stragglers"] == []
    assert all(i["mean_rate"] > 5 for i in result["progress"]["instances"])


def test_a_silent_rank_is_no_straggler(tmp_path):
    """Only rank 0 logs: the others write nothing, which is not slowness."""
    program = ("import os, time\n"
               "for i in range(100):\n"
               "    if os.environ['RANK'] == '0': print(i, flush=True)\n"
               "    time.sleep(0.05)\n")
    result = tmp_path / "result.json"
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                      f"--straggler-after={HOLD}", f"--result-json={result}", PY, "-c", program)
    assert proc.returncode == 0, proc.stderr.decode()
    data = json.loads(result.read_text())
    assert data["stragglers"] == [] and data["progress"]["instances"][1]["step"] is None


def test_the_default_hold_flags_a_slowed_instance_within_twenty_seconds(tmp_path):
    """--straggler-after left at 10 s: flagged ~15 s after the start, 20 s at most."""
    result = tmp_path / "result.json"
    proc = run_poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                      f"--result-json={result}", PY, "-c", PROGRAM, "lines", "19",
                      env={"SLOW": "1"}, timeout=90)
    assert proc.returncode == 0, proc.stderr.decode()
    data = json.loads(result.read_text())
    (entry,) = data["stragglers"]
    assert entry["instance"] == 1
    assert entry["when"] - data["instances"][1]["start_time"] <= 20






def test_show_and_list_say_slow_and_the_eta_while_it_runs(job_state, tmp_path):
    result = tmp_path / "result.json"
    argv = poprun_argv(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                       f"--straggler-after={HOLD}", "--progress-pattern", PATTERN,
                       f"--result-json={result}", PY, "-c", PROGRAM, "pattern", "60")
    with reaped(subprocess.Popen(argv, env=poprun_env({**job_state, "SLOW": "1"}),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)) as job:
        shown: dict = {}

        def slow_and_eta() -> bool:
            listed = json.loads(run_poprunctl("list", "--json", env=job_state, text=True).stdout)["jobs"]
            running = [j for j in listed if j["state"] == "running"]
            if not running:
                return False
            shown.update(json.loads(run_poprunctl("show", "--json", running[0]["id"],
                                                  env=job_state, text=True).stdout))
            shown["listed"] = running[0]
            return bool(shown.get("progress") and shown["progress"]["eta"]
                        and shown["progress"]["slow"] and running[0]["slow"])
        wait_until(slow_and_eta, "poprunctl to show instance 1 slow and an ETA", timeout=30)
        states = [i["state"] for i in shown["instances"]]
        assert states == ["running", "slow", "running"], states
        progress = shown["progress"]
        assert progress["slowest"] == 1 and progress["total"] == 1000 and progress["slow"] == [1]
        assert progress["eta"] == pytest.approx((1000 - progress["step"]) / progress["rate"],
                                                rel=0.01)
        assert shown["stragglers"][0]["instance"] == 1
        listed = shown["listed"]
        assert listed["slow"] == [1] and re.fullmatch(
            r"step \d+/1000 \(instance 1\) [\d.]+/s ETA \d+m\d\ds", listed["progress"])
        table = run_poprunctl("show", shown["job"], env=job_state, text=True).stdout
        assert re.search(r"\bslow\b", table) and "ETA" in table, table
        table = run_poprunctl("list", env=job_state, text=True).stdout
        assert "slow: [1]" in table and "ETA" in table, table
        job.send_signal(signal.SIGINT)
        job.wait(timeout=30)
    data = json.loads(result.read_text())  # the record's last word: the history's summary
    assert data["stragglers"][0]["instance"] == 1
    assert all(i["mean_rate"] for i in data["progress"]["instances"])


def test_the_dashboard_marks_the_slow_instance_and_shows_the_eta():
    code, raw = run_on_a_terminal(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                                  "--straggler-after=1", "--progress-pattern", PATTERN, PY, "-c",
                                  PROGRAM, "pattern", "6", env={"SLOW": "0"}, timeout=60)
    assert code == 0, raw[-2000:]
    text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", raw).decode()
    assert re.search(r"progress: step \d+/1000 \(instance 0\) [\d.]+/s ETA \d+m\d\ds +"
                     r"slow: \[0\]", text), text[-3000:]
    # instance 0's row: "0  <host>  <pid>  slow ..."
    assert re.search(r"^0 +\S+ +\d+ +slow ", text, re.M), text[-3000:]


def test_popdist_progress_reaches_the_launcher_from_two_ssh_hosts(tmp_path):
    result = tmp_path / "result.json"
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = subprocess.run(
            poprun_argv(*OFFLINE, "--host", "h1,h2", "-x", "SLOW", "--num-instances=4",
                        "--num-replicas=4",
                        f"--straggler-after={HOLD}", f"--result-json={result}", PY, "-c",
                        PROGRAM, "popdist", "6"),
            env=poprun_env({**hosts.env(), "SLOW": "3"}), capture_output=True, timeout=90)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    data = json.loads(result.read_text())
    progress = data["progress"]
    assert progress["source"] == "popdist"
    steps = {i["index"]: i["step"] for i in progress["instances"]}
    assert all(steps[i] > 40 for i in (0, 1, 2)) and 5 < steps[3] < 30, steps
    # each one's last step, sent with its exit (the STATS before it may be a second old)
    said = dict(map(int, line.split()[1:]) for line in proc.stdout.decode().splitlines())
    assert steps == said
    assert [s["instance"] for s in data["stragglers"]] == [3]


@pytest.mark.parametrize("args,fragment", [
    (("--progress-pattern", "step ("), "is not a regular expression"),
    (("--progress-pattern", r"step \d+"), "0 capture groups"),
    (("--progress-pattern", r"(\d+)/(\d+)/(\d+)"), "3 capture groups"),
    (("--straggler-after=-1",), "--straggler-after must not be negative"),
])
def test_a_bad_pattern_or_hold_is_one_line(args, fragment):
    proc = run_poprun(*OFFLINE, *args, PY, "-c", "pass")
    assert_usage_error(proc, fragment)
