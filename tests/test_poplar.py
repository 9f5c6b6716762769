"""Poplar-facing options: --offline-target (POPLAR_TARGET_OPTIONS), --autoreport-dir, and the
options later SDKs' scripts pass that have nothing to do here (guide §2.6, §2.7)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import OFFLINE, assert_usage_error, run_poprun
from poprun.plan.poplar import AUTOREPORT_CONFLICT, OFFLINE_TARGETS

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
# What PopRun passed for a 64-IPU POD64 partition driven by one instance (its -vv log).
POD64_ONE_INSTANCE = {"ipuLinkDomainSize": "64", "ipuLinkConfiguration": "slidingWindow",
                      "ipuLinkTopology": "torus", "gatewayMode": "true", "instanceSize": "64"}


def instance_env(*args: str, env: dict[str, str] | None = None) -> list[dict[str, str]]:
    proc = run_poprun(*OFFLINE, "--dry-run", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    return [i["env"] for i in json.loads(proc.stdout)["instances"]]


def test_pod64_target_gives_what_poprun_gives_for_a_pod64_partition():
    env = instance_env("--offline-target=pod64", "--num-replicas=16", "--ipus-per-replica=4",
                       PY)
    assert json.loads(env[0]["POPLAR_TARGET_OPTIONS"]) == POD64_ONE_INSTANCE


@pytest.mark.parametrize("name", sorted(OFFLINE_TARGETS))
def test_every_documented_target_is_accepted_and_sized(name):
    env = instance_env(f"--offline-target={name}", "--num-instances=2", "--num-replicas=4", PY)
    options = json.loads(env[1]["POPLAR_TARGET_OPTIONS"])
    ipus = int(name.rsplit("pod", 1)[1])
    assert options["ipuLinkDomainSize"] == str(min(ipus, 64))
    assert options["instanceSize"] == "2"  # 2 replicas of 1 IPU per instance
    assert env[0]["POPLAR_TARGET_OPTIONS"] == env[1]["POPLAR_TARGET_OPTIONS"]


def test_the_environments_target_options_win_over_the_targets():
    env = instance_env("--offline-target=pod16", PY,
                       env={"POPLAR_TARGET_OPTIONS": '{"gatewayMode":"false","extra":"1"}'})
    options = json.loads(env[0]["POPLAR_TARGET_OPTIONS"])
    assert options["gatewayMode"] == "false" and options["extra"] == "1"
    assert options["ipuLinkDomainSize"] == "16"


def test_target_options_reach_a_running_instance():
    proc = run_poprun(*OFFLINE, "--offline-target=bow-pod4", "--num-instances=2",
                      "--num-replicas=2", PY, "-c",
                      "import os; print(os.environ['POPLAR_TARGET_OPTIONS'])")
    assert proc.returncode == 0, proc.stderr.decode()
    seen = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(seen) == 2 and all(o["gatewayMode"] == "false" for o in seen)


@pytest.mark.parametrize("args,env,fragments", [
    (["--offline-target=pod16"], None, ["--offline-target needs --offline-mode=yes"]),
    ([*OFFLINE, "--offline-target=pod3"], None, ["'pod3'", "pod16", "bow-pod64"]),
    ([*OFFLINE, "--offline-target=pod16"], {"POPLAR_TARGET_OPTIONS": "{not json"},
     ["POPLAR_TARGET_OPTIONS is not valid JSON"]),
], ids=["without offline mode", "unknown target", "bad environment JSON"])
def test_target_errors(args, env, fragments):
    assert_usage_error(run_poprun(*args, "--dry-run", PY, env=env), *fragments)


def test_autoreport_dir_reaches_every_instance():
    env = instance_env("--autoreport-dir", "/tmp/profiles", "--num-instances=2",
                       "--num-replicas=2", PY)
    assert [e["POPDIST_AUTOREPORT_DIRECTORY"] for e in env] == ["/tmp/profiles"] * 2


@pytest.mark.parametrize("args,env", [
    ([], {"POPLAR_ENGINE_OPTIONS": '{"autoReport.directory":"/tmp/x"}'}),
    (["--mpi-local-args", '-x POPLAR_ENGINE_OPTIONS={"autoReport.directory":"/tmp/x"}'], None),
    # The guide's spelling: the shell has removed the inner quotes by the time poprun sees it.
    (["--instance-mpi-local-args",
      "0:-x POPLAR_ENGINE_OPTIONS={autoReport.directory:/tmp/training-profile-directory/0}"],
     None),
], ids=["environment", "mpi-local-args", "instance-mpi-local-args"])
def test_autoreport_dir_conflicts_with_a_fixed_directory(args, env):
    proc = run_poprun(*OFFLINE, "--autoreport-dir", "/tmp/p", "--num-instances=2",
                      "--num-replicas=2", *args, PY, "-c", "pass", env=env)
    assert_usage_error(proc, AUTOREPORT_CONFLICT)


def test_autoreport_dir_with_profiling_switched_off_is_accepted():
    env = instance_env("--autoreport-dir", "/tmp/p", PY,
                       env={"POPLAR_ENGINE_OPTIONS": '{"autoReport.all":"false"}'})
    assert env[0]["POPDIST_AUTOREPORT_DIRECTORY"] == "/tmp/p"


def test_options_of_later_sdks_parse_and_say_at_v_they_do_nothing():
    """(--host-subnet chooses the network now: tests/test_network.py.)"""
    proc = run_poprun(*OFFLINE, "-v", "--allow-run-as-root", "1",
                      "--synchronise-python-venv=yes", "--synchronise-poplar-sdk=no",
                      "--vipu-partition-attempts=3", "--version-format=json",
                      "--num-instances=2", "--num-replicas=2", PY, "-c", "pass")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    for name in ("allow-run-as-root", "synchronise-python-venv", "version-format"):
        assert f"--{name}: accepted for compatibility" in err, (name, err)
    assert "--vipu-partition-attempts: ignored with --offline-mode" in err
    assert "--synchronise-poplar-sdk" not in err  # given as "no": nothing to say


SHOW_ENGINE_OPTIONS = ("import os, popdist; "
                       "print(os.environ.get('POPLAR_ENGINE_OPTIONS', 'unset'))")


def engine_options_seen(*args: str, env: dict[str, str] | None = None) -> list[object]:
    proc = run_poprun(*OFFLINE, "--autoreport-dir", "/tmp/prof", "--num-instances=2",
                      "--num-replicas=4", "--tag-output", *args, PY, "-c", SHOW_ENGINE_OPTIONS,
                      env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    lines = sorted(proc.stdout.decode().splitlines())
    return [json.loads(line.split("<stdout>:", 1)[1]) for line in lines]


def test_popdist_gives_each_instance_its_own_report_directory_and_turns_profiling_on():
    assert engine_options_seen() == [
        {"autoReport.all": "true", "autoReport.directory": "/tmp/prof/0"},
        {"autoReport.all": "true", "autoReport.directory": "/tmp/prof/1"}]


def test_popdist_keeps_the_users_profiling_settings():
    seen = engine_options_seen(env={"POPLAR_ENGINE_OPTIONS":
                                    '{"autoReport.outputExecutionProfile":"true","x":"1"}'})
    assert seen[1] == {"autoReport.outputExecutionProfile": "true", "x": "1",
                       "autoReport.directory": "/tmp/prof/1"}  # no autoReport.all added


def test_profiling_switched_off_means_no_directory():
    off = {"autoReport.all": "false"}
    assert engine_options_seen(env={"POPLAR_ENGINE_OPTIONS": json.dumps(off)}) == [off, off]


def test_set_engine_options_applies_the_same_rules(monkeypatch):
    import popdist

    assert popdist.setEngineOptions({"a": "1"}) == {"a": "1"}  # not under --autoreport-dir
    monkeypatch.setenv("POPDIST_AUTOREPORT_DIRECTORY", "/r")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "6")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    assert popdist.setEngineOptions({}) == {"autoReport.all": "true",
                                            "autoReport.directory": "/r/3"}
