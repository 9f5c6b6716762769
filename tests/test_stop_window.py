"""The stop window (docs/architecture.md, "Runtime guarantees"): a SIGTERM gives every
instance on every host the whole --kill-timeout before SIGKILL, whoever sends it and however
often. Real sshd hosts (tests/sshd_hosts.py); each instance needs 15 s to "write its
checkpoint" after its first SIGTERM, under --kill-timeout 20."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, reaped
from sshd_hosts import start_ssh_hosts, wait_until

pytestmark = pytest.mark.timeout(150)
PY = sys.executable
CHECKPOINT_SECONDS = 15
# Notes its agent's pid (its parent), counts the SIGTERMs it gets, and once the first came,
# "writes a checkpoint" for CHECKPOINT_SECONDS, then exits 0.
CHECKPOINTS = f"""
import os, signal, sys, time
where, rank = sys.argv[1], os.environ["RANK"]
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(time.monotonic()))
with open(f"{{where}}/ready-{{rank}}.tmp", "w") as fh:
    fh.write(str(os.getppid()))
os.rename(f"{{where}}/ready-{{rank}}.tmp", f"{{where}}/ready-{{rank}}")
while not terms:
    signal.pause()
open(f"{{where}}/term-{{rank}}", "w").close()
while time.monotonic() < terms[0] + {CHECKPOINT_SECONDS}:
    time.sleep(0.1)
with open(f"{{where}}/ckpt-{{rank}}", "w") as fh:
    fh.write(str(len(terms)))
"""


def start_job(hosts, tmp_path: Path, out: Path) -> subprocess.Popen:
    (tmp_path / "notes").mkdir()
    return subprocess.Popen(
        poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4",
                    "--kill-timeout=20", f"--result-json={out}", PY, "-c", CHECKPOINTS,
                    str(tmp_path / "notes")),
        env=poprun_env(hosts.env()), stderr=subprocess.PIPE)


def agents(tmp_path: Path) -> set[int]:
    """The agents' pids, as their instances noted them (each instance's parent)."""
    notes = tmp_path / "notes"
    wait_until(lambda: len(list(notes.glob("ready-?"))) == 4, "every instance to start")
    pids = {int((notes / f"ready-{rank}").read_text()) for rank in range(4)}
    for pid in pids:
        # The agent: `python -S`, the module itself or its bootstrap (spawner.remote)
        assert b"\0-S\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return pids


def checkpoints(tmp_path: Path) -> dict[str, int]:
    """Each instance's finished checkpoint: how many SIGTERMs it had got by then."""
    return {p.name: int(p.read_text()) for p in (tmp_path / "notes").glob("ckpt-*")}


def test_a_sigterm_to_the_agents_gives_every_instance_the_whole_kill_timeout(tmp_path):
    """As `scancel --signal TERM` does: the agents' steps get it, poprun does not. Each agent
    forwards it (once) and waits: every instance finishes its 15 s checkpoint and exits 0,
    and so does the job (an agent once SIGKILLed its instances on SIGTERM at once)."""
    out = tmp_path / "result.json"
    with start_ssh_hosts(2, tmp_path) as hosts:
        job = start_job(hosts, tmp_path, out)
        with reaped(job):
            pids = agents(tmp_path)
            assert len(pids) == 2  # one agent per host
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            _, err = job.communicate(timeout=CHECKPOINT_SECONDS + 60)
    assert job.returncode == 0, err.decode()
    assert checkpoints(tmp_path) == {f"ckpt-{rank}": 1 for rank in range(4)}


def test_sigterm_to_poprun_then_to_everything_keeps_the_first_deadline(tmp_path):
    """As Slurm's `scancel --full`, preemption or a Kubernetes pod's end, sent twice: poprun
    gets SIGTERM; once every instance heard it, poprun gets a second one and every agent one
    too. Nothing shortens the 20 s: every checkpoint is written, every instance heard one
    SIGTERM (a second may mean "now" to a program), the job ends 143 (no SIGKILL)."""
    out = tmp_path / "result.json"
    with start_ssh_hosts(2, tmp_path) as hosts:
        job = start_job(hosts, tmp_path, out)
        with reaped(job):
            pids = agents(tmp_path)
            sent = time.monotonic()
            job.send_signal(signal.SIGTERM)
            wait_until(lambda: len(list((tmp_path / "notes").glob("term-?"))) == 4,
                       "every instance to hear the SIGTERM")
            job.send_signal(signal.SIGTERM)
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            _, err = job.communicate(timeout=CHECKPOINT_SECONDS + 60)
            took = time.monotonic() - sent
    text = err.decode()
    assert job.returncode == 143, text
    assert checkpoints(tmp_path) == {f"ckpt-{rank}": 1 for rank in range(4)}, text
    assert "the stop under way keeps its --kill-timeout (20 s)" in text
    assert CHECKPOINT_SECONDS <= took
    result = json.loads(out.read_text())
    assert [(i["exit_status"], i["signal"]) for i in result["instances"]] == [(0, None)] * 4
    assert result["exit_reason"] == "signal"
