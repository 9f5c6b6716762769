"""`poprunctl` (poprun/cli/ctl.py) and what it reaches: the command surface through typer's
CliRunner, then real jobs — instances that deadlock on each other's sockets and one stuck in
time.sleep, on this host and on real sshd hosts (tests/sshd_hosts.py) — seen, folded, read,
stopped and reaped by a second process; `--stall-timeout` end to end.

Every job runs with a state directory of the test's own ($XDG_RUNTIME_DIR), every wait is
bounded (sshd_hosts.wait_until, subprocess timeouts)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import OFFLINE, poprun_argv, poprun_env, reaped, remove_job_leftovers
from poprun.cli import ctl
from poprun.jobctl import joblog
from poprun.jobctl import records as jobs
from poprun.result import JOB_SCHEMA
from spawner import procid
from sshd_hosts import instances_with, kill_marked, start_ssh_hosts, wait_until, watchdog_of
from vipu_harness import sim  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)
PY = sys.executable

# Instances 0 and 1 each listen, connect to the other and wait for it to speak first: a
# deadlock. Instance 2 (when there is one) is stuck in time.sleep: the odd one out.
PROGRAM = """\
import os, socket, sys, time
import popdist

def wait_for_peer(conn):
    return conn.recv(1)  # BLOCKED IN RECV

def deadlock(rank):
    # Each listens on a port the kernel chose and tells the other through a file beside
    # this script (a fixed offset from MASTER_PORT could be taken by another process).
    here = os.path.dirname(os.path.abspath(__file__))
    server = socket.create_server(("127.0.0.1", 0))
    with open(os.path.join(here, f"port{rank}.tmp"), "w") as f:
        f.write(str(server.getsockname()[1]))
    os.replace(os.path.join(here, f"port{rank}.tmp"), os.path.join(here, f"port{rank}"))
    while True:
        try:
            with open(os.path.join(here, f"port{1 - rank}")) as f:
                out = socket.create_connection(("127.0.0.1", int(f.read())))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.02)
    conn, _ = server.accept()
    print(f"rank {rank} connected", flush=True)
    wait_for_peer(conn)

def nap():
    print("napping", flush=True)
    time.sleep(300)  # ASLEEP

rank = int(os.environ["RANK"])
if rank < 2:
    deadlock(rank)
else:
    nap()
"""


@pytest.fixture
def environ(tmp_path, monkeypatch):
    """A state directory of the test's own, for the jobs and for poprunctl (here and in
    subprocesses)."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return {"XDG_RUNTIME_DIR": str(run)}


@pytest.fixture
def program(tmp_path) -> str:
    path = tmp_path / "stuck.py"
    path.write_text(PROGRAM)
    return str(path)


def poprunctl(*args: str, env: dict[str, str], timeout: float = 60
              ) -> subprocess.CompletedProcess:
    """poprunctl in a process of its own, as a user would run it."""
    return subprocess.run([PY, "-m", "poprun.cli.ctl", *args], env=poprun_env(env),
                          capture_output=True, text=True, timeout=timeout)


def start_job(*args: str, env: dict[str, str], cwd=None) -> subprocess.Popen:
    return subprocess.Popen(poprun_argv(*OFFLINE, *args), env=poprun_env(env), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@contextlib.contextmanager
def job_running(*args: str, env: dict[str, str], cwd=None) -> Iterator[subprocess.Popen]:
    """start_job, killed on the way out if it still runs (an assertion failed)."""
    with reaped(start_job(*args, env=env, cwd=cwd)) as job:
        yield job


def kill_leftovers(marker: str, job: subprocess.Popen) -> None:
    """What a reap test left if it failed: the instances poprun can no longer stop (every
    process whose command line holds the marker, whatever instances_with finds)."""
    kill_marked(marker)
    with reaped(job):
        pass


def running_job(env: dict[str, str], instances: int) -> str:
    """The id of the one job running, once `instances` of its instances run."""
    ids: list[str] = []

    def ready():  # the ids it saw: asking again could see the job moved on
        found = json.loads(poprunctl("list", "--json", env=env).stdout)["jobs"]
        ids[:] = [j["id"] for j in found if j["state"] == "running"
                  and j["running"] == instances]
        return ids
    wait_until(ready, f"a job with {instances} running instances", timeout=60)
    return ids[0]


def record_of(env: dict[str, str], job_id: str) -> dict:
    return next(r for r in jobs.scan(env).records if r["id"] == job_id)


def wait_lines(env, job_id, text: str, count: int) -> None:
    wait_until(lambda: poprunctl("logs", job_id, env=env).stdout.count(text) >= count,
               f"{count} x {text!r} in the job's output")


# --- the command surface (CliRunner) -----------------------------------------------------

runner = CliRunner()


def test_every_command_is_there_with_json(environ):
    result = runner.invoke(ctl.app, ["--help"])
    assert result.exit_code == 0
    for command in ("list", "show", "stacks", "kill", "logs", "reap"):
        assert command in result.output
        assert "--json" in runner.invoke(ctl.app, [command, "--help"]).output
    assert "--install-completion" in result.output


def test_no_jobs_no_such_job_and_usage_errors(environ):
    result = runner.invoke(ctl.app, ["list"])
    assert result.exit_code == 0 and result.output == "no jobs\n"
    assert json.loads(runner.invoke(ctl.app, ["list", "--json"]).output)["jobs"] == []
    missing = runner.invoke(ctl.app, ["show", "zzzzzz"])
    assert missing.exit_code == 1
    assert "poprunctl: error: no job 'zzzzzz'" in missing.output
    assert runner.invoke(ctl.app, ["kill", "x", "--signal", "NOPE"]).exit_code == 2
    assert runner.invoke(ctl.app, ["stacks"]).exit_code == 2  # JOB missing
    assert runner.invoke(ctl.app, ["frobnicate"]).exit_code == 2
    nothing = runner.invoke(ctl.app, ["reap"])
    assert nothing.exit_code == 0 and nothing.output.startswith("nothing to reap")


def ended_record(environ, **fields) -> str:
    job_id, directory = jobs.create(environ)
    jobs.write(directory, {
        "schema": JOB_SCHEMA, "id": job_id, "state": "ended", "exit_code": 3,
        "exit_reason": "instance", "start_time": time.time() - 90, "num_instances": 2,
        "program": ["python3", "train.py", "--lr\n1"], "dir": directory,
        "hosts": [{"label": "localhost", "local": True}],
        "instances": [{"index": i, "host": "localhost", "pid": 100 + i, "state": "failed",
                       "outcome": "exited with status 3", "lines": 5, "start_time": 1.0,
                       "end_time": 3.5} for i in range(2)], **fields})
    return job_id


def test_an_ended_job_is_listed_and_shown_from_its_record(environ):
    job_id = ended_record(environ)
    listed = runner.invoke(ctl.app, ["list"])
    assert listed.exit_code == 0
    line = next(x for x in listed.output.splitlines() if x.startswith(job_id))
    assert "ended: instance (3)" in line and "0/2" in line and "1m30s" in line
    assert "train.py --lr␊1" in line  # a newline in an argument stays on one line
    shown = runner.invoke(ctl.app, ["show", job_id[:4]])
    assert shown.exit_code == 0, shown.output
    assert "exited with status 3" in shown.output
    data = json.loads(runner.invoke(ctl.app, ["show", job_id, "--json"]).output)
    assert [r["pid"] for r in data["instances"]] == [100, 101]
    for command in ("stacks", "kill"):
        refused = runner.invoke(ctl.app, [command, job_id])
        assert refused.exit_code == 1 and "has ended" in refused.output


def test_a_damaged_record_is_reported_not_fatal(environ):
    good = ended_record(environ)
    _, broken = jobs.create(environ)
    Path(broken, jobs.RECORD).write_text("{not json")
    result = runner.invoke(ctl.app, ["list", "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert [j["id"] for j in data["jobs"]] == [good]
    assert data["skipped"][0]["path"] == broken
    plain = runner.invoke(ctl.app, ["list"])
    assert f"poprunctl: skipped {broken}: not JSON" in plain.stderr
    # Right schema, wrong types: skipped too, by every command that reads records.
    _, typed = jobs.create(environ)
    jobs.write(typed, {"schema": JOB_SCHEMA, "id": Path(typed).name, "state": "running",
                       "start_time": "yesterday", "hosts": ["h1"], "instances": []})
    for command in (["list"], ["reap", "--dry-run"], ["show", Path(typed).name]):
        result = runner.invoke(ctl.app, command)
        assert result.exception is None or isinstance(result.exception, SystemExit), command
        assert f"poprunctl: skipped {typed}: damaged: start_time, hosts[]" in result.stderr


def test_list_shows_the_latest_and_says_how_many_there_are(environ):
    """A shared account keeps up to 100 jobs: list shows the latest LIST_LATEST, the most
    recent first, and says how many there are; --all shows every one (JSON the same)."""
    ids = [ended_record(environ, start_time=1000.0 + i) for i in range(ctl.LIST_LATEST + 3)]
    latest = ids[::-1][:ctl.LIST_LATEST]
    listed = runner.invoke(ctl.app, ["list"])
    assert listed.exit_code == 0
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == latest
    assert lines[-1] == f"the latest {ctl.LIST_LATEST} of {len(ids)} jobs (poprunctl list " \
        "--all: every one)"
    every = runner.invoke(ctl.app, ["list", "--all"]).stdout.splitlines()
    assert [line.split()[0] for line in every[1:]] == ids[::-1]  # no count line: all shown
    data = json.loads(runner.invoke(ctl.app, ["list", "--json"]).stdout)
    assert [j["id"] for j in data["jobs"]] == latest and data["total"] == len(ids)
    data = json.loads(runner.invoke(ctl.app, ["list", "--json", "-a"]).stdout)
    assert [j["id"] for j in data["jobs"]] == ids[::-1] and data["total"] == len(ids)


@pytest.mark.parametrize("removed", ["directory", "record"])
def test_a_record_removed_while_listing_is_skipped_without_a_word(environ, monkeypatch,
                                                                   removed):
    """A record that goes between the listing of the jobs' directory and its read (another
    poprun's prune removes it: the directory whole, or its record first, as rmtree goes) is
    not a problem to report: list skips it without a word (it once printed `cannot read
    it: No such file or directory`). Removed here at that very point, by the real reader."""
    kept, victim = ended_record(environ), ended_record(environ)
    victim_dir = os.path.join(jobs.jobs_dir(environ), victim)
    real_load = jobs.load
    seen = []

    def load_after_a_prune(directory):
        if directory == victim_dir:
            seen.append(directory)
            if removed == "directory":
                shutil.rmtree(directory)
            else:
                os.unlink(os.path.join(directory, jobs.RECORD))
        return real_load(directory)
    monkeypatch.setattr(jobs, "load", load_after_a_prune)
    listed = runner.invoke(ctl.app, ["list"])
    assert seen == [victim_dir]  # listed, then removed before its read
    assert listed.exit_code == 0 and listed.stderr == ""
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == [kept]
    data = json.loads(runner.invoke(ctl.app, ["list", "--json"]).stdout)
    assert data["skipped"] == [] and [j["id"] for j in data["jobs"]] == [kept]


def test_job_ids_complete(environ):
    first, second = ended_record(environ), ended_record(environ)
    assert {i for i, _ in ctl._complete_job("")} == {first, second}
    assert first in [i for i, _ in ctl._complete_job(first[:3])]
    assert [i for i, _ in ctl._complete_job(first)] == [first]


def test_the_dashboard_says_the_job_id_and_stalled():
    from rich.console import Console

    from poprun.view.dashboard import DashboardState, panel_lines

    state = DashboardState(2, ["localhost"], 0.0)
    for i in range(2):
        state.instance_started(i, "localhost", 10 + i, 0.0)
    state.job_id, state.stalled = "k3f9qz", True
    console = Console(width=100)
    with console.capture() as capture:
        console.print(panel_lines(state, 5.0, 100, 20)[0])
    assert capture.get().startswith("poprun k3f9qz stalled")


# --- a real job, from a second process -----------------------------------------------------

def test_list_show_stacks_logs_kill_against_a_live_local_job(environ, program, tmp_path):
    with job_running("--num-instances=3", "--num-replicas=3", "--result-json",
                     str(tmp_path / "r.json"), PY, program, env=environ) as job:
        job_id = running_job(environ, 3)
        wait_lines(environ, job_id, "connected", 2)
        listed = poprunctl("list", env=environ)
        assert listed.returncode == 0
        row = next(x for x in listed.stdout.splitlines() if x.startswith(job_id))
        assert "running" in row and "3/3" in row and "localhost" in row and "stuck.py" in row

        shown = poprunctl("show", job_id, "--json", env=environ)
        rows = json.loads(shown.stdout)["instances"]
        assert [r["state"] for r in rows] == ["running"] * 3
        assert {r["last_line"] for r in rows} == {"rank 0 connected", "rank 1 connected",
                                                  "napping"}
        assert all(r["rss"] for r in rows)  # sampled from /proc for local instances
        table = poprunctl("show", job_id, env=environ).stdout
        assert "napping" in table and "running" in table

        started = time.monotonic()
        stacks = poprunctl("stacks", job_id, env=environ)
        assert stacks.returncode == 0, stacks.stderr
        assert time.monotonic() - started < 10
        text = stacks.stdout
        assert "instances [2] (1 of 3):" in text and "instances [0-1] (2 of 3):" in text
        assert text.index("instances [2]") < text.index("instances [0-1]")  # odd one first
        assert "time.sleep(300)  # ASLEEP" in text
        assert f"{program}:5 in wait_for_peer   return conn.recv(1)  # BLOCKED IN RECV" in text
        folded = json.loads(poprunctl("stacks", job_id, "--json", "-i", "1", env=environ)
                            .stdout)
        assert folded["instances"] == [1]
        assert folded["groups"][0]["frames"][0]["code"].endswith("# BLOCKED IN RECV")

        logs = poprunctl("logs", job_id, "--instance", "2", env=environ).stdout
        assert logs == "[1,2]<stdout>:napping\n"

        killed = poprunctl("kill", job_id, env=environ)
        assert killed.returncode == 0 and "SIGINT sent" in killed.stdout
        _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err.decode()
    assert err.decode().count("KeyboardInterrupt") >= 3  # every instance got the Ctrl-C
    ended = poprunctl("list", "--json", env=environ)
    (entry,) = json.loads(ended.stdout)["jobs"]
    assert entry["state"] == "ended" and entry["exit_reason"] == "signal"
    record = record_of(environ, job_id)
    record.pop("_dir")
    assert record == json.loads((tmp_path / "r.json").read_text())  # one schema
    assert not os.path.exists(record["control"])
    after = poprunctl("logs", job_id, env=environ).stdout  # from the ring, once ended
    assert "[1,0]<stdout>:rank 0 connected" in after and "[1,2]<stdout>:napping" in after


def test_logs_follow_sees_every_new_line_once_and_ends_with_the_job(environ, tmp_path):
    count = 60
    with job_running("--num-instances=2", "--num-replicas=2", PY, "-c",
                     "import sys, time\n"
                     "for i in range(%d):\n"
                     "    print('tick', i, flush=True)\n"
                     "    time.sleep(0.03)\n" % count, env=environ) as job:
        job_id = running_job(environ, 2)
        follow = subprocess.run([PY, "-m", "poprun.cli.ctl", "logs", "-f", job_id],
                                env=poprun_env(environ), capture_output=True, text=True,
                                timeout=60)
        job.communicate(timeout=60)
    assert follow.returncode == 0, follow.stderr
    for index in range(2):
        mine = [x for x in follow.stdout.splitlines() if x.startswith(f"[1,{index}]")]
        assert mine == [f"[1,{index}]<stdout>:tick {i}" for i in range(count)]


def test_a_job_with_output_filename_keeps_no_ring_and_logs_read_its_files(environ, tmp_path):
    job = subprocess.run(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                     "--output-filename", "out", PY, "-c",
                                     "import sys; print('o'); print('e', file=sys.stderr)"),
                         env=poprun_env(environ), cwd=tmp_path, capture_output=True,
                         timeout=60)
    assert job.returncode == 0, job.stderr.decode()
    (record,) = jobs.scan(environ).records
    assert record["log"] is None and record["output_dir"] == str(tmp_path / "out")
    assert joblog.LOG not in os.listdir(record["_dir"])
    logs = poprunctl("logs", record["id"], env=environ).stdout.splitlines()
    assert sorted(logs) == sorted(["[1,0]<stdout>:o", "[1,0]<stderr>:e", "[1,1]<stdout>:o",
                                   "[1,1]<stderr>:e"])



@pytest.mark.parametrize("suffix", [":nocopy", ":NOCOPY", ":NoCopy"])
def test_logs_of_a_nocopy_job_read_its_files_whatever_the_suffix_case(environ, tmp_path, suffix):
    """Open MPI takes `DIR:nocopy` in any case, and so does poprun's output router; the
    record once stripped only `:nocopy`, so `poprunctl logs` of a `DIR:NOCOPY` job read
    `DIR:NOCOPY/...`, found nothing and printed nothing, exit 0."""
    job = subprocess.run(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                     "--output-filename", f"out{suffix}", PY, "-c",
                                     "print('o')"),
                         env=poprun_env(environ), cwd=tmp_path, capture_output=True,
                         timeout=60)
    assert job.returncode == 0, job.stderr.decode()
    assert job.stdout == b""  # nocopy: files only
    (record,) = jobs.scan(environ).records
    assert record["output_dir"] == str(tmp_path / "out")
    logs = poprunctl("logs", record["id"], env=environ)
    assert sorted(logs.stdout.splitlines()) == ["[1,0]<stdout>:o", "[1,1]<stdout>:o"]


# --- stalls ---------------------------------------------------------------------------------

def test_a_stall_is_reported_once_and_the_job_goes_on(environ, tmp_path):
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import os, time\nimport popdist\nprint('step 0', flush=True)\n"
                     "time.sleep(2.5)  # QUIET HERE\nprint('step 1', flush=True)\n")
    proc = subprocess.run(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                      "--stall-timeout=1", "--result-json",
                                      str(tmp_path / "r.json"), PY, str(quiet)),
                          env=poprun_env(environ), capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert proc.stdout.decode().count("step 1") == 2
    assert err.count("no instance has written a line for") == 1, err
    assert "instances [0-1] (2 of 2):" in err and "time.sleep(2.5)  # QUIET HERE" in err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["exit_reason"] == "success" and result["stall"] is None
    (stall,) = result["stalls"]
    assert stall["timeout"] == 1 and stall["idle"] >= 1
    assert Path(stall["stacks_file"]).parent == Path(result["dir"])
    assert "# QUIET HERE" in Path(stall["stacks_file"]).read_text()


def test_a_stalled_job_is_seen_stalled_from_outside_then_running_again(environ, tmp_path):
    """`list` and `show` from a second process say "stalled" while the job is silent, and
    "running" once an instance writes again."""
    go = tmp_path / "go"
    waiting = tmp_path / "waiting.py"
    waiting.write_text(f"import os, time\nimport popdist\nprint('step 0', flush=True)\n"
                       f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
                       f"while os.path.exists({str(go)!r}):  # never silent again\n"
                       f"    print('step 1', flush=True)\n    time.sleep(0.1)\n")

    def listed(state: str) -> list[str]:
        found = json.loads(poprunctl("list", "--json", env=environ).stdout)["jobs"]
        return [j["id"] for j in found if j["state"] == state]
    with job_running("--num-instances=2", "--num-replicas=2", "--stall-timeout=1", PY,
                     str(waiting), env=environ) as job:
        wait_until(lambda: listed("stalled"), "the job to be listed as stalled", timeout=30)
        job_id = listed("stalled")[0]
        assert json.loads(poprunctl("show", job_id, "--json", env=environ).stdout)[
            "state"] == "stalled"
        go.write_text("")
        wait_until(lambda: listed("running") == [job_id], "the job to run again", timeout=30)
        go.unlink()
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err.decode()
    assert record_of(environ, job_id)["exit_reason"] == "success"


def test_stall_action_kill_names_the_stall_as_the_root_cause(environ, program, tmp_path):
    proc = subprocess.run(poprun_argv(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                                      "--stall-timeout=1.5", "--stall-action=kill",
                                      "--result-json", str(tmp_path / "r.json"), PY, program),
                          env=poprun_env(environ), capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 124, err
    assert "poprun: stalled: no instance wrote a line for" in err
    assert "stopped by --stall-action kill" in err
    assert "poprun:   instances [2] at " in err and "# ASLEEP" in err
    assert "# BLOCKED IN RECV" in err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["exit_reason"] == "stall" and result["exit_code"] == 124
    assert result["root_cause"] is None
    groups = result["stall"]["stacks"]["groups"]
    assert [g["instances"] for g in groups][:2] == [[2], [0, 1]]
    assert all(i["stopped_by_poprun"] for i in result["instances"])


# --- reap -----------------------------------------------------------------------------------

def dead_launcher_record(environ, **fields) -> str:
    """A record of a job whose launcher is gone (its pid is this test's, its start time not);
    `fields` complete or replace it. Returns the job id."""
    job_id, directory = jobs.create(environ)
    jobs.write(directory, {
        "schema": JOB_SCHEMA, "id": job_id, "state": "running", "dir": directory,
        "start_time": time.time(), "program": ["train"], "num_instances": 1,
        "launcher": {"host": __import__("socket").gethostname(), "boot_id": procid.boot_id(),
                     "pid": os.getpid(), "start": procid.start_ticks(os.getpid()) + 5},
        "hosts": [{"label": "localhost", "local": True, "boot_id": procid.boot_id()}],
        "instances": [], **fields})
    return job_id


def test_a_host_that_cannot_be_reached_keeps_the_record_for_the_next_reap(environ, tmp_path):
    """A remote host that does not answer: the rest is cleaned, reap exits 1 saying so, and
    the job is still there to reap (not marked ended)."""
    cache = tmp_path / "poprun-cache-here"
    cache.mkdir()
    job_id = dead_launcher_record(
        environ, caches={"localhost": str(cache)},
        hosts=[{"label": "localhost", "local": True, "boot_id": procid.boot_id()},
               {"label": "poprun-test-no-such-host.invalid", "local": False}])
    done = poprunctl("reap", env=environ)
    assert done.returncode == 1, done
    assert f"localhost: {cache}: removed" in done.stdout and not cache.exists()
    assert "poprun-test-no-such-host.invalid: nothing done: " in done.stdout
    assert "run poprunctl reap again" in done.stdout
    record = record_of(environ, job_id)
    assert record["state"] == "running" and record["last_reap"]["complete"] is False
    assert jobs.state_of(record) == "gone"
    again = poprunctl("reap", "--json", env=environ)
    assert again.returncode == 1 and json.loads(again.stdout)["jobs"][0]["id"] == job_id


def test_reap_removes_the_partition_poprun_created(environ, sim):
    """The V-IPU side (the simulator: no V-IPU server exists here): a partition poprun
    created is removed, one it was told to keep is kept; the job then ends."""
    sim.add("made-by-poprun")
    sim.add("kept")
    partition = {"host": "localhost", "port": 8090, "timeout": 30, "executable": "vipu",
                 "created": True}
    removed = dead_launcher_record(environ, partition={**partition, "name": "made-by-poprun",
                                                       "remove": True})
    kept = dead_launcher_record(environ, partition={**partition, "name": "kept",
                                                    "remove": False})
    dry = poprunctl("reap", "--dry-run", env=environ)
    assert "partition made-by-poprun: would remove it" in dry.stdout, dry
    assert set(sim.partitions()) == {"made-by-poprun", "kept"}
    done = poprunctl("reap", env=environ)
    assert done.returncode == 0, done
    assert "partition made-by-poprun: removed" in done.stdout
    assert "partition kept: kept (--remove-partition=no)" in done.stdout
    assert set(sim.partitions()) == {"kept"}
    assert {record_of(environ, j)["exit_reason"] for j in (removed, kept)} == {"reaped"}


def test_after_a_reboot_recorded_pids_are_never_touched(tmp_path):
    """A host whose boot id changed: every recorded pid belongs to someone else now (this
    test's own sleep stands for one): nothing is killed; poprun's temporary dirs still go."""
    from spawner import reaphere

    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    cache = tmp_path / "poprun-cache-old"
    cache.mkdir()
    try:
        done = reaphere.reap_here({
            "boot_id": "another-boot", "dirs": [str(cache)],
            "instances": [[0, other.pid, procid.start_ticks(other.pid)]]})
        assert done[0] == {"what": "instance", "index": 0, "pid": other.pid, "done": False,
                           "note": "gone (the host has rebooted since)"}
        assert other.poll() is None and not cache.exists()
    finally:
        other.kill()
        other.wait()


def test_reap_leaves_alone_a_process_that_reuses_a_recorded_pid(environ, tmp_path):
    """A fake record of a dead launcher whose instance's pid now belongs to an unrelated
    process (its start time differs): reap kills nothing, removes only poprun's dirs."""
    unrelated = subprocess.Popen(["sleep", "300"])
    cache = tmp_path / "poprun-cache-leftover"
    cache.mkdir()
    (cache / "compiled.bin").write_text("x")
    mine = tmp_path / "precious"
    mine.mkdir()
    try:
        job_id, directory = jobs.create(environ)
        host = {"host": os.uname().nodename, "boot_id": procid.boot_id()}
        jobs.write(directory, {
            "schema": JOB_SCHEMA, "id": job_id, "state": "running", "dir": directory,
            "start_time": time.time(), "program": ["train"], "num_instances": 1,
            "launcher": {**host, "pid": unrelated.pid,
                         "start": procid.start_ticks(unrelated.pid) + 5},
            "hosts": [{"label": "localhost", "local": True, "boot_id": procid.boot_id()}],
            "caches": {"localhost": str(cache)}, "error_dirs": {"localhost": str(mine)},
            "instances": [{"index": 0, "host": "localhost", "pid": unrelated.pid,
                           "start": procid.start_ticks(unrelated.pid) - 1,
                           "state": "running"}]})
        if os.uname().nodename != __import__("socket").gethostname():
            # no switch: the machine's names
            pytest.skip("uname and gethostname differ here")
        listed = poprunctl("list", "--json", env=environ)
        assert json.loads(listed.stdout)["jobs"][0]["state"] == "gone"
        dry = poprunctl("reap", "--dry-run", env=environ)
        assert "localhost: instance 0 (pid %d): its pid is another process's now: not " \
               "touched" % unrelated.pid in dry.stdout
        assert f"{cache}: would remove it" in dry.stdout and cache.exists()
        done = poprunctl("reap", env=environ)
        assert done.returncode == 0, done.stderr
        assert "not touched" in done.stdout and f"{cache}: removed" in done.stdout
        assert f"{mine}: not a poprun temporary directory: kept" in done.stdout
        assert unrelated.poll() is None and not cache.exists() and mine.exists()
        assert record_of(environ, job_id)["exit_reason"] == "reaped"
        assert poprunctl("reap", env=environ).stdout.startswith("nothing to reap")
    finally:
        unrelated.kill()
        unrelated.wait()


def test_reap_after_sigkill_of_poprun_and_its_lifeline(environ, program):
    marker = f"reap-local-{os.getpid()}"
    job = start_job("--num-instances=3", "--num-replicas=3", PY, program, marker, env=environ)
    try:
        job_id = running_job(environ, 3)
        record = record_of(environ, job_id)
        caches = list(record["caches"].values())
        assert caches and all(os.path.isdir(c) for c in caches)
        os.kill(record["lifeline"]["pid"], signal.SIGKILL)
        os.kill(record["launcher"]["pid"], signal.SIGKILL)
        job.wait(timeout=30)
        leftovers = instances_with(marker)
        assert len(leftovers) == 3  # nobody cleaned up
        assert json.loads(poprunctl("list", "--json", env=environ).stdout)["jobs"][0][
            "state"] == "gone"
        reaped = poprunctl("reap", env=environ)
        assert reaped.returncode == 0, reaped.stderr
        for index in range(3):
            assert f"localhost: instance {index} (pid" in reaped.stdout
        assert reaped.stdout.count("killed its process group") == 3
        assert f"{caches[0]}: removed" in reaped.stdout
        wait_until(lambda: not instances_with(marker), "the leftovers gone")
        assert not any(os.path.exists(c) for c in caches)
    finally:
        kill_leftovers(marker, job)


def _killed_outright(environ, marker: str, lifeline_too: bool) -> str:
    """A 3-instance job whose poprun (and, `lifeline_too`, its watchdog) was SIGKILLed; its
    id. Without the watchdog's kill, it cleans up: the instances are gone on return."""
    earlier = set(instances_with(marker))  # those of an earlier job, left on purpose
    job = start_job("--num-instances=3", "--num-replicas=3", PY, "-c",
                    "import time; print('up', flush=True); time.sleep(300)", marker,
                    env=environ)
    with reaped(job):
        job_id = running_job(environ, 3)
        wait_lines(environ, job_id, "up", 3)  # something in its output ring
        assert len(set(instances_with(marker)) - earlier) == 3  # what "gone" is checked on
        record = record_of(environ, job_id)
        if lifeline_too:
            os.kill(record["lifeline"]["pid"], signal.SIGKILL)
        os.kill(record["launcher"]["pid"], signal.SIGKILL)
        job.wait(timeout=30)
    if not lifeline_too:
        wait_until(lambda: not instances_with(marker), "the watchdog's cleanup")
    return job_id


@pytest.mark.timeout(120)
def test_a_job_whose_watchdog_cleaned_up_shows_nothing_running(environ):
    """poprun SIGKILLed, its watchdog killed every instance: the record still says what ran
    when poprun died, but list and show say what is alive (they once showed
    3/3 and `running`); on another host, what cannot be known from here."""
    marker = f"watchdog-cleaned-{os.getpid()}"
    job_id = _killed_outright(environ, marker, lifeline_too=False)
    assert [i["state"] for i in record_of(environ, job_id)["instances"]] == ["running"] * 3
    (row,) = json.loads(poprunctl("list", "--json", env=environ).stdout)["jobs"]
    assert (row["state"], row["running"], row["unknown"]) == ("gone", 0, 0)
    assert "0/3" in poprunctl("list", env=environ).stdout
    shown = json.loads(poprunctl("show", job_id, "--json", env=environ).stdout)
    assert [r["state"] for r in shown["instances"]] == ["gone"] * 3
    remote = dead_launcher_record(
        environ, num_instances=2,
        hosts=[{"label": "localhost", "local": True, "boot_id": procid.boot_id()},
               {"label": "h9", "local": False}],
        instances=[{"index": 0, "host": "localhost", "pid": os.getpid(),
                    "start": procid.start_ticks(os.getpid()), "state": "running"},
                   {"index": 1, "host": "h9", "pid": 4242, "start": 1, "state": "running"}])
    rows = {r["id"]: r for r in json.loads(poprunctl("list", "--json", env=environ).stdout)[
        "jobs"]}
    assert (rows[remote]["running"], rows[remote]["unknown"]) == (1, 1)
    assert "1/2 (1?)" in poprunctl("list", env=environ).stdout
    shown = json.loads(poprunctl("show", remote, "--json", env=environ).stdout)
    assert [r["state"] for r in shown["instances"]] == ["running", "unknown"]


@pytest.mark.timeout(180)
def test_records_and_rings_stay_bounded_whatever_state_jobs_were_left_in(environ):
    """Jobs killed outright (poprun and its watchdog) leave their control socket; reaped or
    not, they count against the bounds like any ended job, and so do their output rings
    (prune once skipped them for 7 days)."""
    marker = f"bounded-{os.getpid()}"
    try:
        reaped_ids = [_killed_outright(environ, marker, lifeline_too=True) for _ in range(2)]
        assert poprunctl("reap", env=environ).returncode == 0
        gone_ids = [_killed_outright(environ, marker, lifeline_too=True) for _ in range(2)]
    finally:
        kill_marked(marker)
        remove_job_leftovers(environ)  # of the jobs left "gone" on purpose
    directories = {r["id"]: r["_dir"] for r in jobs.scan(environ).records}
    for job_id in reaped_ids:
        assert record_of(environ, job_id)["exit_reason"] == "reaped"
        assert not os.path.exists(os.path.join(directories[job_id], jobs.SOCKET))
    assert all(os.path.exists(os.path.join(directories[j], jobs.SOCKET)) for j in gone_ids)
    assert {jobs.state_of(record_of(environ, j)) for j in gone_ids} == {"gone"}
    assert sorted(jobs.prune(environ, keep=2, keep_logs=1)) == sorted(reaped_ids)
    rings = [j for j in gone_ids if os.path.exists(os.path.join(directories[j], joblog.LOG))]
    assert rings == gone_ids[1:]  # the most recent only
    assert jobs.prune(environ, keep=1) == gone_ids[:1]
    assert [r["id"] for r in jobs.scan(environ).records] == gone_ids[1:]


# --- remote hosts ----------------------------------------------------------------------------

@pytest.fixture
def hosts(tmp_path):
    with start_ssh_hosts(2, tmp_path) as h:
        yield h


def test_stacks_show_kill_with_instances_on_sshd_hosts(environ, program, hosts, tmp_path):
    env = {**hosts.env(), **environ}
    # The deadlock spans this host and h1; the sleeper is on h2.
    with job_running("--host", "localhost,h1,h2", "--num-instances=3", "--num-replicas=3",
                     PY, program, env=env) as job:
        job_id = running_job(env, 3)
        wait_lines(env, job_id, "connected", 2)
        rows = json.loads(poprunctl("show", job_id, "--json", env=env).stdout)["instances"]
        assert [r["host"] for r in rows] == ["localhost", "h1", "h2"]
        assert all(r["state"] == "running" and r["pid"] for r in rows)
        stacks = poprunctl("stacks", job_id, env=env)
        assert stacks.returncode == 0, stacks.stderr
        text = stacks.stdout
        assert "instances [2] (1 of 3):" in text and "# ASLEEP" in text  # read by h2's agent
        assert "instances [0-1] (2 of 3):" in text  # here and on h1
        assert "return conn.recv(1)  # BLOCKED IN RECV" in text
        assert text.index("instances [2]") < text.index("instances [0-1]")
        killed = poprunctl("kill", job_id, "--signal", "SIGTERM", env=env)
        assert killed.returncode == 0
        _, err = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, err.decode()
    record = record_of(env, job_id)
    assert {h["label"]: h["local"] for h in record["hosts"]} == {
        "h1": False, "h2": False, "localhost": True}
    assert all(i["start"] for i in record["instances"])  # remote start times from agents


def test_stall_kill_reads_remote_stacks(environ, program, hosts, tmp_path):
    env = {**hosts.env(), **environ}
    proc = subprocess.run(poprun_argv(*OFFLINE, "--host", "h1,h2,localhost",
                                      "--num-instances=3", "--num-replicas=3",
                                      "--stall-timeout=2", "--stall-action=kill", PY, program),
                          env=poprun_env(env), capture_output=True, timeout=90)
    err = proc.stderr.decode()
    assert proc.returncode == 124, err
    assert "instances [0-1] (2 of 3):" in err and "# BLOCKED IN RECV" in err


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


def test_reap_over_ssh_after_the_launcher_and_a_remote_agent_were_killed(environ, program,
                                                                        hosts):
    """poprun, its lifeline, and h1's agent with its own lifeline all SIGKILLed: instances
    are left on this host and on h1, and h1 keeps what its agent made (its error dir, the
    instances' cgroup tree where cgroups are writable). reap kills both instances (over SSH
    for h1) and removes every host's leftovers: the record names them."""
    from spawner.containment import CGROUP_PREFIX, remove_tree
    from spawner.reaphere import pmix_leftovers

    env = {**hosts.env(), **environ}
    marker = f"reap-ssh-{os.getpid()}"
    job = start_job("--host", "localhost,h1", "--num-instances=2", "--num-replicas=2", PY,
                    "-c", "import time; time.sleep(300)", marker, env=env)
    left: list[str] = []  # h1's agent's error dir and cgroup tree, removed if the test fails
    try:
        job_id = running_job(env, 2)
        record = record_of(env, job_id)
        remote = next(i for i in record["instances"] if i["host"] == "h1")
        environ_there = dict(e.split("=", 1) for e in Path(f"/proc/{remote['pid']}/environ")
                             .read_text().split("\0") if "=" in e)
        error_dir = os.path.dirname(environ_there["POPDIST_ERROR_FILE"])
        cgroup = _cgroup_tree(remote["pid"])
        left += [error_dir, *([cgroup] if cgroup else [])]
        (agent_leaves,) = record["agents"]["h1"]
        assert agent_leaves["error_dir"] == error_dir
        assert agent_leaves["mark"] == environ_there["POPRUN_LIFELINE"]
        if cgroup:  # this host gives poprun cgroups: the instance is in the named tree
            assert agent_leaves["cgroup"] == cgroup and cgroup.rsplit("/", 1)[1] == \
                CGROUP_PREFIX + agent_leaves["mark"]
        agent = _ppid(remote["pid"])
        launcher = record["launcher"]["pid"]
        os.kill(launcher, signal.SIGSTOP)  # it must not see its agent go
        os.kill(record["lifeline"]["pid"], signal.SIGKILL)
        os.kill(watchdog_of(agent), signal.SIGKILL)  # the agent's lifeline
        os.kill(agent, signal.SIGKILL)
        os.kill(launcher, signal.SIGKILL)
        job.wait(timeout=30)
        assert len(instances_with(marker)) == 2
        assert all(map(os.path.isdir, left))  # nobody cleaned up on h1
        caches = dict(record["caches"])
        assert set(caches) == {"localhost", "h1"} and all(map(os.path.isdir, caches.values()))
        dry = poprunctl("reap", "--dry-run", "--json", env=env)
        (plan,) = json.loads(dry.stdout)["jobs"]
        by_host = {h["host"]: h for h in plan["hosts"]}
        assert by_host["h1"]["error"] is None
        notes = {e["note"] for e in by_host["h1"]["entries"]}
        assert notes == {"would kill its process group", "would remove it",
                         "would kill 1 process(es) still carrying the job's mark "
                         "(POPRUN_LIFELINE)"}
        # The job's PMIx directories are named by its worlds (reaphere.pmix_leftovers): both
        # hosts being this machine, each host's reap finds every host's.
        pmix = {path for names in record["mpi_worlds"].values() for name in names
                for path in pmix_leftovers(name)}
        assert {e["path"] for e in by_host["h1"]["entries"] if e["what"] == "dir"} - pmix == {
            caches["h1"], *left}
        assert all(map(os.path.isdir, left))
        reaped = poprunctl("reap", env=env)
        assert reaped.returncode == 0, reaped.stderr
        assert f"h1: instance {remote['index']} (pid {remote['pid']}): killed its process " \
               "group" in reaped.stdout
        for path in (caches["h1"], *left):
            assert f"h1: {path}: removed" in reaped.stdout
        assert f"localhost: {caches['localhost']}: removed" in reaped.stdout
        wait_until(lambda: not instances_with(marker), "every leftover gone")
        assert not any(map(os.path.exists, [*caches.values(), *left]))
        assert record_of(env, job_id)["state"] == "ended"
    finally:
        kill_leftovers(marker, job)
        for path in left:
            if path.startswith("/sys/fs/cgroup"):
                remove_tree(path)
            else:
                shutil.rmtree(path, ignore_errors=True)


def _cgroup_tree(pid: int) -> str | None:
    """The `poprun-<token>` cgroup tree `pid` is in (its own cgroup's parent), if any."""
    from spawner.containment import CGROUP_PREFIX, own_cgroup_dir

    relative = Path(f"/proc/{pid}/cgroup").read_text().strip().partition("::")[2]
    mount = own_cgroup_dir()
    if not mount or not relative.startswith("/"):
        return None
    here = Path("/proc/self/cgroup").read_text().strip().partition("::")[2]
    root = mount[:len(mount) - len(here)] if here != "/" and mount.endswith(here) else mount
    tree = os.path.dirname(os.path.join(root, relative.lstrip("/")))
    return tree if os.path.basename(tree).startswith(CGROUP_PREFIX) else None
