"""Exit statuses a script can tell apart, and `--result-json` saying which:
0 success, the root cause's status, 255 for a lost host, 128+N for a stop by signal N, 74 for
output that could not be written; 2 for a job that could not start (usage errors in
test_cli.py) and 70 for an internal error (test_internal_error.py). Real processes and sshd
hosts."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprun, wait_started
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(90)
PY = sys.executable


def result_of(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("code, reason", [(0, "success"), (3, "instance")])
def test_success_and_an_instances_status(code, reason, tmp_path):
    out = tmp_path / "r.json"
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", f"--result-json={out}",
                      PY, "-c", f"import sys; sys.exit({code})")
    assert proc.returncode == code
    assert (result_of(out)["exit_code"], result_of(out)["exit_reason"]) == (code, reason)


def test_a_job_that_cannot_start_says_so(tmp_path):
    """Exit 2 from a launch that could not start (a host that does not resolve): the JSON
    says `usage_error` with the message; nothing ran."""
    out = tmp_path / "r.json"
    witness = tmp_path / "ran"
    proc = run_poprun(*OFFLINE, "-H", "localhost,poprun-test-no-such-host.invalid",
                      "--num-instances=2", "--num-replicas=2", f"--result-json={out}",
                      "touch", str(witness))
    assert proc.returncode == 2, proc.stderr.decode()
    result = result_of(out)
    assert (result["exit_code"], result["exit_reason"]) == (2, "usage_error")
    assert "poprun-test-no-such-host.invalid" in result["error"]
    assert result["instances"] == [] and not witness.exists()


def test_a_stop_by_signal(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.Popen(poprun_argv(*OFFLINE, "--num-instances=1", "--num-replicas=1",
                                        f"--result-json={out}", PY, "-c",
                                        "import time; print('up', flush=True); time.sleep(60)"),
                            env=poprun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143
    assert (result_of(out)["exit_code"], result_of(out)["exit_reason"]) == (143, "signal")


def test_output_that_cannot_be_written(tmp_path):
    out = tmp_path / "r.json"
    command = shlex.join(poprun_argv(*OFFLINE, "--num-instances=1", "--num-replicas=1",
                                     f"--result-json={out}", PY, "-c", "print('x')"))
    done = subprocess.run(["sh", "-c", f"{command} 1</dev/null"], env=poprun_env(),
                          capture_output=True, timeout=60)
    assert done.returncode == 74
    record = result_of(out)
    assert record["exit_reason"] == "output_error"
    assert record["output_error"] == "cannot write poprun's stdout: Bad file descriptor"


@pytest.mark.usefixtures("dead_host_leftovers")
def test_a_lost_host(tmp_path):
    out = tmp_path / "r.json"
    marker = f"lost-{tmp_path.name}"
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = subprocess.Popen(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                        f"--result-json={out}", PY, "-c", "import time; time.sleep(60)",
                        marker),
            env=poprun_env(hosts.env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_started(proc.pid, 2)
            hosts.kill_host(1)
            err = proc.communicate(timeout=60)[1]
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 255, err.decode()
    assert (result_of(out)["exit_code"], result_of(out)["exit_reason"]) == (255, "host_lost")
