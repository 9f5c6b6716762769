"""A host whose instance the kernel's OOM killer ended is quarantined and replaced by a spare
(docs/several-hosts.md, "Spare hosts"; spawner/oomkills.py). Real sshd hosts on loopback
(tests/sshd_hosts.py): h1 and h2 run the job, h3 stands by. h2's sshd listener is moved into a
memory cgroup the test makes, limited to MEMORY_LIMIT, so that its sessions, its agent and its
instances run in it (as on a host, or in a Slurm job, short of memory), and the real OOM killer
kills the instance that outgrows it. A SIGKILL from anyone else is no such proof: that
instance's host is restarted as before."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from attempt_notes import noting, notes
from conftest import OFFLINE, poprun_argv, poprun_env, reaped, run_poprunctl
from sshd_hosts import start_ssh_hosts, wait_until

pytestmark = pytest.mark.timeout(150)
PY = sys.executable
MEMORY_LIMIT = 192 << 20  # bytes: sshd's session and the agent fit, the instance outgrows it
# Notes where it runs in each attempt; once all have noted, in attempt 0 rank 2 (on h2)
# outgrows its host's memory ("grow", its second argument) or waits to be killed ("wait"),
# the others wait to be stopped; in later attempts every instance ends 0.
NOTES = noting('{"host": os.environ["POPRUN_SSH_CONNECTION"].split()[2], "pid": os.getpid()}',
               """
if attempt == 0 and rank == "2" and sys.argv[2] == "grow":
    held = [bytearray(16 << 20) for _ in range(64)]  # touched: every page is charged
    sys.exit(5)  # 1 GiB and no OOM kill: the limit did not hold (the test fails, not the host)
if attempt == 0:
    time.sleep(300)
""")


def _memory_cgroup_parent() -> tuple[str, str] | None:
    """Where this machine lets a memory-limited cgroup be made ("v1" or "v2", its directory):
    cgroup v1's memory controller, or cgroup v2's root with the memory controller."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        sep = fields.index("-")
        kind, options = fields[sep + 1], fields[sep + 3].split(",")
        if kind == "cgroup" and "memory" in options:
            return "v1", fields[4]
        if kind == "cgroup2" and "memory" in Path(fields[4], "cgroup.controllers").read_text() \
                .split():
            return "v2", fields[4]
    return None


@contextlib.contextmanager
def memory_limited(pid: int, limit: int) -> Iterator[Path]:
    """Process `pid` (and what it starts from now on) in a new memory cgroup of `limit`
    bytes; moved back and the cgroup removed at the end."""
    found = _memory_cgroup_parent() if os.geteuid() == 0 else None
    if found is None:
        pytest.skip("no memory cgroup can be made here: root and a cgroup memory "  # no switch:
                    "controller are needed")  # no switch: a property of the machine, no package
    version, parent = found
    path = Path(parent, f"poprun-test-oom-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    try:
        if version == "v2":
            with contextlib.suppress(OSError):  # already on: fine
                Path(parent, "cgroup.subtree_control").write_text("+memory")
            (path / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):  # no swap accounting: no swap to limit
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            if (path / "memory.memsw.limit_in_bytes").exists():  # swap too, where counted
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        (path / "cgroup.procs").write_text(str(pid))
        yield path
    finally:
        with contextlib.suppress(OSError):
            Path(parent, "cgroup.procs").write_text(str(pid))
        wait_until(lambda: _emptied(path), "the test's memory cgroup to empty", 30)
        path.rmdir()


def _emptied(path: Path) -> bool:
    return not (path / "cgroup.procs").read_text().split()


def start(hosts, tmp_path: Path, how: str, *args: str) -> subprocess.Popen:
    (tmp_path / "notes").mkdir()
    return subprocess.Popen(
        poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4",
                    "--restart-delay=0", "--max-restarts=1", "--kill-timeout=5",
                    f"--result-json={tmp_path / 'result.json'}", *args,
                    PY, "-c", NOTES, str(tmp_path / "notes"), how),
        env=poprun_env(hosts.env()), stderr=subprocess.PIPE)


def test_an_instance_the_oom_killer_ends_quarantines_its_host_for_the_spare(tmp_path):
    """Instance 2 outgrows h2's memory and the kernel kills it: h2 is quarantined (named in
    the log, --result-json and poprunctl show), and attempt 1 runs instances 2 and 3 on the
    spare h3, instances 0 and 1 staying on h1."""
    with start_ssh_hosts(3, tmp_path) as hosts, \
            memory_limited(hosts.hosts[1].proc.pid, MEMORY_LIMIT) as cgroup:
        job = start(hosts, tmp_path, "grow", "--spare-hosts", "h3")
        with reaped(job):
            _, err = job.communicate(timeout=120)
        err = err.decode()
        kills = (cgroup / "memory.events").read_text() if (cgroup / "memory.events").exists() \
            else (cgroup / "memory.oom_control").read_text()
    assert "oom_kill 0" not in kills, kills  # the kernel's own count: a real OOM kill
    assert job.returncode == 0, err
    seen = notes(tmp_path / "notes")
    assert [seen[f"{r}-0"]["host"] for r in range(4)] == ["127.0.77.1"] * 2 + \
        ["127.0.77.2"] * 2, err
    assert [seen[f"{r}-1"]["host"] for r in range(4)] == ["127.0.77.1"] * 2 + \
        ["127.0.77.3"] * 2, err
    assert ("h2 quarantined for the rest of the job: oom (instance 2 killed by the kernel's "
            "out-of-memory killer (SIGKILL))") in err, err
    assert "h2 replaced by spare host h3 for the next attempt (2 instance(s))" in err
    assert "perhaps the kernel's out-of-memory killer" not in err  # known, not guessed
    result = json.loads((tmp_path / "result.json").read_text())
    [failed] = result["attempts"]
    [cause] = [i for i in failed["instances"] if i["index"] == failed["root_cause"]]
    assert (cause["index"], cause["host"], cause["signal"]) == (2, "h2", "SIGKILL")
    assert cause["outcome"] == "killed by the kernel's out-of-memory killer (SIGKILL)"
    [quarantined] = result["quarantined"]
    assert quarantined["host"] == "h2"
    assert quarantined["reason"] == ("oom: instance 2 killed by the kernel's out-of-memory "
                                     "killer (SIGKILL)")
    assert [i["host"] for i in result["instances"]] == ["h1", "h1", "h3", "h3"]
    shown = run_poprunctl("show", result["id"], "--json", env={})
    assert json.loads(shown.stdout)["quarantined"] == [quarantined], shown.stderr
    text = run_poprunctl("show", result["id"], env={}).stdout.decode()
    assert "quarantined: h2 " in text and "(oom: instance 2 killed" in text, text


def test_without_a_spare_the_oom_killed_host_ends_the_job(tmp_path):
    """No spare: h2 is quarantined all the same, and the job cannot restart without it: it
    ends with the instance's status (137), saying why."""
    with start_ssh_hosts(2, tmp_path) as hosts, \
            memory_limited(hosts.hosts[1].proc.pid, MEMORY_LIMIT):
        job = start(hosts, tmp_path, "grow")
        with reaped(job):
            _, err = job.communicate(timeout=120)
    err = err.decode()
    assert job.returncode == 137, err
    assert ("cannot restart the job: h2: quarantined (oom: instance 2 killed by the kernel's "
            "out-of-memory killer (SIGKILL)), and no spare host is left") in err, err
    assert not list((tmp_path / "notes").glob("*-1.json"))  # no attempt 1


def test_a_sigkill_from_elsewhere_is_no_proof_and_the_host_is_used_again(tmp_path):
    """Instance 2 on h2 (its memory limited as above, but not outgrown) is SIGKILLed by the
    test: not the OOM killer's doing, so h2 is not quarantined and attempt 1 runs there
    again, the spare h3 unused; the report still suggests the OOM killer as a possibility."""
    with start_ssh_hosts(3, tmp_path) as hosts, \
            memory_limited(hosts.hosts[1].proc.pid, MEMORY_LIMIT):
        job = start(hosts, tmp_path, "wait", "--spare-hosts", "h3")
        with reaped(job):
            wait_until(lambda: len(notes(tmp_path / "notes")) == 4, "attempt 0's notes", 60)
            os.kill(notes(tmp_path / "notes")["2-0"]["pid"], signal.SIGKILL)
            _, err = job.communicate(timeout=120)
    err = err.decode()
    assert job.returncode == 0, err
    seen = notes(tmp_path / "notes")
    assert [seen[f"{r}-1"]["host"] for r in range(4)] == ["127.0.77.1"] * 2 + \
        ["127.0.77.2"] * 2, err
    assert "quarantined" not in err and "replaced by spare" not in err, err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["quarantined"] == []
    [failed] = result["attempts"]
    [cause] = [i for i in failed["instances"] if i["index"] == failed["root_cause"]]
    assert cause["outcome"] != "killed by the kernel's out-of-memory killer (SIGKILL)"
    assert cause["signal"] == "SIGKILL"
