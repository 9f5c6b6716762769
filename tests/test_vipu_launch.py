"""poprun without --offline-mode: the partition's lifecycle around a real launch, with the
`vipu` simulator first on PATH (a fake: no V-IPU server can exist here; see vipu_harness.py).
The simulator's state file shows what is left on the "server" afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid

import pytest

from conftest import assert_usage_error, poprun_argv, poprun_env, run_poprun
from sshd_hosts import launched_with, processes_with, wait_until
from vipu_harness import sim  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
SERVER = ("--vipu-server-host=localhost", "--vipu-server-timeout=5", "--vipu-allocation=alloc1")
SHOW = ("import os, json, popdist; print(json.dumps({**{k: v for k, v in os.environ.items() "
        "if k.startswith(('IPUOF_', 'POPDIST_NODE')) or k == 'POPLAR_TARGET_OPTIONS'}, "
        "'device': popdist.getDeviceId()}))")


def test_the_job_runs_on_a_partition_poprun_creates_and_removes(sim):
    proc = run_poprun(*SERVER, "--vipu-partition=job", "--num-instances=2", "--num-replicas=4",
                      "--tag-output", PY, "-c", SHOW)
    assert proc.returncode == 0, proc.stderr.decode()
    seen = sorted(proc.stdout.decode().splitlines())
    envs = [json.loads(line.split("<stdout>:", 1)[1]) for line in seen]
    for index, env in enumerate(envs):
        assert env["IPUOF_VIPU_API_PARTITION_ID"] == "job"
        assert env["IPUOF_VIPU_API_HOST"] == "localhost"
        assert env["IPUOF_VIPU_API_GCD_ID"] == str(index)  # 2 instances, 2 GCDs
        assert env["IPUOF_LOG_LEVEL"] == "WARN"  # as real PopRun gives it
        # Not reconfigurable: no node device; popdist's is the instance's whole GCD of 2
        # IPUs (device 2), all of them this instance's replicas'.
        assert "POPDIST_NODE_DEVICE_ID" not in env and env["device"] == 2
        assert json.loads(env["POPLAR_TARGET_OPTIONS"])["instanceSize"] == "2"
    assert "create" in sim.verbs() and "remove" in sim.verbs()
    assert sim.partitions() == {}  # nothing leaked


def test_on_a_larger_reconfigurable_partition_each_instance_gets_the_jobs_device(sim):
    """As PopRun 3.1.0 on a reconfigurable 64-IPU partition: 2 one-IPU instances get node
    device 64 (the pair of IPUs 0-1), and popdist's device of each is its own IPU."""
    sim.add("p64", size=64, gcds=1, ilds=1, reconfigurable=True)
    proc = run_poprun(*SERVER, "--num-instances=2", "--num-replicas=2", "--tag-output",
                      PY, "-c", SHOW)
    assert proc.returncode == 0, proc.stderr.decode()
    envs = [json.loads(line.split("<stdout>:", 1)[1])
            for line in sorted(proc.stdout.decode().splitlines())]
    assert [(env["POPDIST_NODE_DEVICE_ID"], env["device"]) for env in envs] == [
        ("64", 0), ("64", 1)]
    assert all(env["IPUOF_VIPU_API_PARTITION_ID"] == "p64" and "IPUOF_VIPU_API_GCD_ID" not in env
               for env in envs)
    assert "p64" in sim.partitions() and "create" not in sim.verbs()  # not poprun's: kept


@pytest.mark.parametrize("reconfigurable, topology", [(True, "mesh"), (False, "torus")])
def test_a_64_ipu_partition_s_own_description_decides_what_instances_get(sim, reconfigurable,
                                                                         topology):
    """One instance on all 64 IPUs of each kind of 64-IPU partition: on ALCF's reconfigurable
    one PopRun 3.1.0 gives a mesh and the node device 126 (all 64); on another an SDK 3.3 log
    shows a torus, GCD 0 and no node device. popdist's device is the same, 126, either way."""
    sim.add("p64", size=64, gcds=1, ilds=1, reconfigurable=reconfigurable)
    proc = run_poprun(*SERVER, "--num-instances=1", "--num-replicas=64", PY, "-c", SHOW)
    assert proc.returncode == 0, proc.stderr.decode()
    env = json.loads(proc.stdout)
    assert json.loads(env["POPLAR_TARGET_OPTIONS"])["ipuLinkTopology"] == topology
    if reconfigurable:
        assert env["POPDIST_NODE_DEVICE_ID"] == "126" and "IPUOF_VIPU_API_GCD_ID" not in env
    else:
        assert env["IPUOF_VIPU_API_GCD_ID"] == "0" and "POPDIST_NODE_DEVICE_ID" not in env
    assert env["device"] == 126


def test_a_failed_instance_still_removes_the_partition(sim):
    proc = run_poprun(*SERVER, "--vipu-partition=job", "--num-instances=2", "--num-replicas=2",
                      PY, "-c", "import os, sys; sys.exit(int(os.environ['RANK']) + 3)")
    assert proc.returncode in (3, 4), proc.stderr.decode()
    assert sim.partitions() == {}


def test_ctrl_c_removes_the_partition(sim):
    marker = f"m{uuid.uuid4().hex}"
    proc = subprocess.Popen(poprun_argv(*SERVER, "--vipu-partition=job", "--num-instances=2",
                                        "--num-replicas=2", PY, "-c",
                                        "import time; time.sleep(300)", marker),
                            env=poprun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: len(launched_with(marker)) >= 3, "2 instances (and poprun)")
        assert "job" in sim.partitions()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err.decode()
        assert sim.partitions() == {}
    finally:
        proc.kill()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_during_a_slow_create_ends_poprun_at_once(sim, sig):
    """The loop is never blocked by `vipu`: while a create takes 30 s (the simulator sleeps
    before answering), Ctrl-C (or SIGTERM) ends poprun within 2 s with exit 128+N, the create
    is killed, the
    partition poprun asked for is removed (`vipu remove`, harmless if it never came to be), and
    no `vipu` process is left."""
    name = f"slow-{uuid.uuid4().hex[:8]}"
    sim.fail(delay=30, delay_on="create")
    proc = subprocess.Popen(poprun_argv("--vipu-server-host=localhost",
                                        "--vipu-server-timeout=60", f"--vipu-partition={name}",
                                        "--num-instances=2", "--num-replicas=2", PY, "-c", "pass"),
                            env=poprun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: "create" in sim.verbs(), "the create to be under way")
        wait_until(lambda: processes_with(name), "the slow vipu create to run")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=2)
        assert proc.returncode == 128 + sig, err.decode()
    finally:
        proc.kill()
        proc.wait()
    assert sim.verbs()[-1] == "remove"
    assert sim.partitions() == {}
    assert processes_with(name) == []  # the create was killed and reaped, not left running


def test_an_existing_partition_is_kept(sim):
    sim.add("mine", size=2, gcds=2, ilds=1)
    proc = run_poprun(*SERVER, "--vipu-partition=mine", "--num-instances=2", "--num-replicas=2",
                      PY, "-c", "pass")
    assert proc.returncode == 0, proc.stderr.decode()
    assert "mine" in sim.partitions()
    assert "remove" not in sim.verbs() and "create" not in sim.verbs()


def test_offline_mode_never_runs_vipu(sim):
    proc = run_poprun("--offline-mode=yes", *SERVER, "--num-instances=2", "--num-replicas=2",
                      PY, "-c", "pass")
    assert proc.returncode == 0, proc.stderr.decode()
    assert sim.calls() == []


def test_server_unreachable_is_one_clear_line_and_nothing_starts(sim, tmp_path):
    sim.fail(unreachable=1)
    marker = tmp_path / "started"
    proc = run_poprun(*SERVER, "--vipu-partition=job", "touch", str(marker))
    assert_usage_error(proc, "cannot reach the V-IPU server")
    assert not marker.exists()


def test_vipu_missing_suggests_offline_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # python is run by absolute path
    proc = run_poprun(*SERVER, "--vipu-partition=job", PY, "-c", "pass")
    assert_usage_error(proc, "vipu", "--offline-mode=yes")


def test_an_instance_killed_by_sigkill_still_removes_the_partition(sim):
    proc = run_poprun(*SERVER, "--vipu-partition=job", "--num-instances=2", "--num-replicas=2",
                      PY, "-c", "import os, signal, time; "
                      "os.kill(os.getpid(), signal.SIGKILL) if os.environ['RANK'] == '1' "
                      "else time.sleep(300)")
    assert proc.returncode == 137, proc.stderr.decode()
    assert sim.partitions() == {}
