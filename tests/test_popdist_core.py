"""Tests for the instance-side popdist core API."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import popdist
from popdist import env, popdist_core

SRC = Path(__file__).resolve().parents[1] / "src"

ALL_VARS = (
    env.NUM_TOTAL_REPLICAS,
    env.NUM_IPUS_PER_REPLICA,
    env.NUM_LOCAL_REPLICAS,
    env.UNIFORM_REPLICAS_PER_INSTANCE,
    env.REPLICA_INDEX_OFFSET,
    env.LOCAL_INSTANCE_INDEX,
    env.EXECUTABLE_CACHE_PATH,
    env.AUTOREPORT_DIRECTORY,
    env.NODE_DEVICE_ID,
    env.VIPU_API_GCD_ID,
)


def _identity(**overrides) -> env.InstanceIdentity:
    fields = dict(
        index=1,
        num_instances=2,
        local_index=1,
        local_size=2,
        num_total_replicas=4,
        ipus_per_replica=1,
        master_addr="127.0.0.1",
        master_port=1234,
    )
    fields.update(overrides)
    return env.InstanceIdentity(**fields)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # Tests may run under a real poprun; start every test from "outside poprun".
    for name in ALL_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def inside(monkeypatch):
    """Set the environment poprun gives instance `index` of a run described by overrides."""

    def apply(**overrides) -> env.InstanceIdentity:
        who = _identity(**overrides)
        for name, value in env.instance_environment(who).items():
            monkeypatch.setenv(name, value)
        return who

    return apply


def test_defaults_outside_poprun():
    assert popdist.isPopdistEnvSet() is False
    assert popdist.getNumTotalReplicas() == 1
    assert popdist.getNumLocalReplicas() == 1
    assert popdist.getNumIpusPerReplica() == 1
    assert popdist.getReplicaIndexOffset() == 0
    assert popdist.getLocalInstanceIndex() == 0
    assert popdist.getNumInstances() == 1
    assert popdist.getInstanceIndex() == 0
    assert popdist.isUniformReplicasPerInstance() is True
    assert popdist.getExecutableCachePath() is None


def test_values_inside_poprun(inside):
    inside(
        index=3,
        num_instances=4,
        local_index=1,
        num_total_replicas=8,
        ipus_per_replica=2,
        executable_cache_path="/tmp/cache",
    )
    assert popdist.isPopdistEnvSet() is True
    assert popdist.getNumTotalReplicas() == 8
    assert popdist.getNumLocalReplicas() == 2
    assert popdist.getNumIpusPerReplica() == 2
    assert popdist.getReplicaIndexOffset() == 6
    assert popdist.getLocalInstanceIndex() == 1
    assert popdist.isUniformReplicasPerInstance() is True
    assert popdist.getExecutableCachePath() == "/tmp/cache"


def test_derived_instance_count_and_index(inside):
    inside(index=2, num_instances=3, num_total_replicas=6)
    assert popdist.getNumInstances() == 3
    assert popdist.getInstanceIndex() == 2


def test_reads_environment_at_call_time(monkeypatch):
    assert popdist.getNumTotalReplicas() == 1
    monkeypatch.setenv(env.NUM_TOTAL_REPLICAS, "16")
    assert popdist.getNumTotalReplicas() == 16


def test_partial_env_is_not_popdist_env(monkeypatch):
    monkeypatch.setenv(env.NUM_TOTAL_REPLICAS, "4")
    assert popdist.isPopdistEnvSet() is False


@pytest.mark.parametrize("raw", ["abc", "", "0", "-3", "1.5"])
def test_malformed_counts_fall_back_to_defaults(monkeypatch, raw):
    for name in (env.NUM_TOTAL_REPLICAS, env.NUM_LOCAL_REPLICAS, env.NUM_IPUS_PER_REPLICA):
        monkeypatch.setenv(name, raw)
    monkeypatch.setenv(env.REPLICA_INDEX_OFFSET, "x" if raw != "0" else "-1")
    monkeypatch.setenv(env.LOCAL_INSTANCE_INDEX, "-1")
    assert popdist.getNumTotalReplicas() == 1
    assert popdist.getNumLocalReplicas() == 1
    assert popdist.getNumIpusPerReplica() == 1
    assert popdist.getReplicaIndexOffset() == 0
    assert popdist.getLocalInstanceIndex() == 0
    assert popdist.getNumInstances() == 1


def test_non_uniform_raises(inside, monkeypatch):
    inside()
    monkeypatch.setenv(env.UNIFORM_REPLICAS_PER_INSTANCE, "0")
    assert popdist.isUniformReplicasPerInstance() is False
    with pytest.raises(RuntimeError, match="uniform number of replicas per instance"):
        popdist.getNumInstances()
    with pytest.raises(RuntimeError, match="uniform number of replicas per instance"):
        popdist.getInstanceIndex()
    with pytest.raises(RuntimeError, match="uniform"):
        popdist.execute_on_instances(0, lambda: "ran")


def test_check_num_ipus_per_replica_with_env(inside):
    inside(ipus_per_replica=4)
    assert popdist.checkNumIpusPerReplica(4) is True
    assert popdist.checkNumIpusPerReplica(2) is False


def test_check_num_ipus_per_replica_without_env():
    # Unset: the inferred number (1) is what is compared.
    assert popdist.checkNumIpusPerReplica(1) is True
    assert popdist.checkNumIpusPerReplica(2) is False


def test_get_device_id_mismatch_names_both_numbers(inside):
    inside(ipus_per_replica=2)
    with pytest.raises(ValueError) as info:
        popdist.getDeviceId(4)
    assert "4" in str(info.value) and "2" in str(info.value)


def test_get_device_id_rejects_non_positive():
    with pytest.raises(ValueError):
        popdist.getDeviceId(0)


@pytest.mark.parametrize("where", ["offline", "outside poprun"])
@pytest.mark.parametrize("ipus", [None, 2])
def test_get_device_id_where_nothing_says_which_device(inside, where, ipus):
    """No partition (offline mode) or no poprun: one error, which tells a TensorFlow user
    (popdist.tensorflow.set_ipu_config's default configure_device=True) what to do."""
    if where == "offline":
        inside(ipus_per_replica=2)
    with pytest.raises(RuntimeError) as info:
        popdist.getDeviceId(ipus)
    message = str(info.value)
    assert "POPDIST_NODE_DEVICE_ID is not set" in message and "--offline-mode" in message
    assert "configure_device=False" in message


def _on_partition(monkeypatch, ipus: int, instances: int, replicas: int,
                  ipus_per_replica: int, index: int, gcds: bool) -> None:
    """Instance `index` of a job on a partition of `ipus` IPUs (as large as the job's, or
    larger), as poprun and plan/partition.instance_environment set it: with `gcds`, one GCD
    per instance."""
    who = _identity(index=index, num_instances=instances, local_index=index,
                    local_size=instances, num_total_replicas=replicas,
                    ipus_per_replica=ipus_per_replica)
    for name, value in env.instance_environment(who).items():
        monkeypatch.setenv(name, value)
    from poprun.plan.partition import node_device

    node = node_device(ipus, instances if gcds else 1, replicas * ipus_per_replica)
    monkeypatch.setenv(env.NODE_DEVICE_ID, str(node))
    if gcds:
        monkeypatch.setenv(env.VIPU_API_GCD_ID, str(index))


# (partition IPUs, instances, replicas, IPUs per replica, one GCD per instance) -> the
# instances' devices. Poplar's numbering (popdist/devices.py): 0..n-1 single IPUs, then the
# pairs, the quads, ..., 2n-2 all of them.
NUMBERING = [
    ((1, 1, 1, 1, False), [0]),
    ((4, 1, 4, 1, False), [6]),  # a real PopRun log: "Attached to device 6" on 4 IPUs
    ((4, 2, 4, 1, False), [4, 5]),  # gc-info: 4 = IPUs 0-1, 5 = IPUs 2-3
    ((4, 4, 4, 1, False), [0, 1, 2, 3]),
    ((4, 2, 4, 1, True), [2, 2]),  # each its own GCD of 2 IPUs: the whole of it
    ((16, 4, 8, 2, False), [24, 25, 26, 27]),  # the quads of 16 IPUs
    ((16, 2, 8, 2, False), [28, 29]),  # the eights
    ((16, 4, 8, 2, True), [6, 6, 6, 6]),
    ((64, 1, 16, 4, False), [126]),  # POPDIST_NODE_DEVICE_ID=126 for 64 IPUs, one instance
    ((64, 8, 64, 1, False), list(range(112, 120))),
    ((64, 64, 64, 1, False), list(range(64))),
    ((64, 16, 16, 4, True), [6] * 16),
    # A reconfigurable 64-IPU partition larger than the job: PopRun 3.1.0 gives every
    # instance the device of the job's first IPUs, 0, 64, 96, 112, 120 for 1, 2, 4, 8, 16
    # one-IPU replicas (CosmicTagger's logs, popdist/devices.py), and each instance's replica
    # is then its own IPU.
    ((64, 1, 1, 1, False), [0]),
    ((64, 2, 2, 1, False), [0, 1]),
    ((64, 4, 4, 1, False), [0, 1, 2, 3]),
    ((64, 8, 8, 1, False), list(range(8))),
    ((64, 16, 16, 1, False), list(range(16))),
    ((64, 1, 16, 1, False), [120]),  # one instance drives all 16: the node device itself
    ((64, 2, 8, 1, False), [96, 97]),  # the quads of the node device 112
    ((64, 2, 4, 4, False), [112, 113]),  # 16 IPUs (node 120), 8 per instance
    ((64, 4, 16, 1, True), [24] * 4),  # 4 GCDs of 16 IPUs, the job's 4 of each: device 24
]


@pytest.mark.parametrize("replicas, node", [(1, 0), (2, 64), (4, 96), (8, 112), (16, 120),
                                            (64, 126)])
def test_the_node_device_on_a_64_ipu_partition_is_what_poprun_3_1_gave(replicas, node):
    """`POPDIST_NODE_DEVICE_ID` of CosmicTagger's PopRun 3.1.0 runs on p64, one-IPU replicas."""
    from poprun.plan.partition import node_device

    assert node_device(64, 1, replicas) == node


@pytest.mark.parametrize("job, devices", NUMBERING,
                         ids=[f"{j[0]}ipus-{j[1]}x{j[2]}x{j[3]}{'-gcds' if j[4] else ''}"
                              for j, _ in NUMBERING])
def test_get_device_id_follows_poplars_numbering(monkeypatch, job, devices):
    ipus, instances, replicas, per_replica, gcds = job
    found = []
    for index in range(instances):
        _on_partition(monkeypatch, ipus, instances, replicas, per_replica, index, gcds)
        found.append(popdist.getDeviceId())
        assert popdist.getDeviceId(per_replica) == found[-1]
    assert found == devices


GCDS = [(job, devices) for job, devices in NUMBERING if job[4] and job[0] == job[2] * job[3]]


@pytest.mark.parametrize("job, devices", GCDS)
def test_on_a_gcd_of_its_own_without_a_node_device_the_device_is_the_whole_gcd(
        monkeypatch, job, devices):
    """A partition that is not reconfigurable gives its GCD and no node device
    (plan/partition.py's `Attachment`, as an SDK 3.3 log shows): the same devices."""
    ipus, instances, replicas, per_replica, _ = job
    found = []
    for index in range(instances):
        _on_partition(monkeypatch, ipus, instances, replicas, per_replica, index, True)
        monkeypatch.delenv(env.NODE_DEVICE_ID)
        found.append(popdist.getDeviceId())
    assert found == devices


def test_a_gcd_of_ipus_that_form_no_device_is_one_error(monkeypatch):
    _on_partition(monkeypatch, 6, 2, 6, 1, 0, True)  # 3 IPUs per GCD are no Poplar device
    monkeypatch.delenv(env.NODE_DEVICE_ID)
    with pytest.raises(RuntimeError, match="the GCD IPUOF_VIPU_API_GCD_ID names: 3 IPUs do "
                                           "not form a Poplar device"):
        popdist.getDeviceId()


@pytest.mark.parametrize("node, message", [
    ("5", "device 5 is no device of 4 IPUs"),  # the job's 4 IPUs: 6, 12-13, 24-27, ...
    ("x", "invalid literal"),
])
def test_get_device_id_with_a_node_device_it_cannot_read(inside, monkeypatch, node, message):
    inside()
    monkeypatch.setenv(env.NODE_DEVICE_ID, node)
    with pytest.raises(RuntimeError, match=f"POPDIST_NODE_DEVICE_ID={node}: .*{message}"):
        popdist.getDeviceId()


def test_get_device_id_for_replicas_that_form_no_device(monkeypatch):
    _on_partition(monkeypatch, 8, 1, 3, 1, 0, False)  # 3 IPUs are no Poplar device
    monkeypatch.setenv(env.NODE_DEVICE_ID, "14")  # so poprun sets none: say so if one is set
    with pytest.raises(RuntimeError, match="3 IPUs do not form a Poplar device"):
        popdist.getDeviceId()


def test_init_outside_poprun_is_noop():
    assert popdist.init() is None
    assert popdist.init() is None


def test_init_accepts_poprun_env_and_is_idempotent(inside):
    inside(index=1, num_instances=2, num_total_replicas=4)
    assert popdist.init() is None
    assert popdist.init() is None
    assert popdist.getInstanceIndex() == 1


def test_init_local_must_divide_total(inside, monkeypatch):
    inside()
    monkeypatch.setenv(env.NUM_TOTAL_REPLICAS, "5")
    monkeypatch.setenv(env.NUM_LOCAL_REPLICAS, "2")
    monkeypatch.setenv(env.REPLICA_INDEX_OFFSET, "2")
    with pytest.raises(RuntimeError, match="does not divide"):
        popdist.init()


def test_init_rejects_non_integer(inside, monkeypatch):
    inside()
    monkeypatch.setenv(env.NUM_LOCAL_REPLICAS, "abc")
    with pytest.raises(RuntimeError, match="not an integer"):
        popdist.init()


def test_init_rejects_missing_variable(inside, monkeypatch):
    inside()
    monkeypatch.delenv(env.NUM_IPUS_PER_REPLICA)
    with pytest.raises(RuntimeError, match="not set"):
        popdist.init()


def test_init_rejects_zero_and_out_of_range(inside, monkeypatch):
    inside()
    monkeypatch.setenv(env.NUM_LOCAL_REPLICAS, "0")
    with pytest.raises(RuntimeError, match="at least 1"):
        popdist.init()
    monkeypatch.setenv(env.NUM_LOCAL_REPLICAS, "2")
    monkeypatch.setenv(env.REPLICA_INDEX_OFFSET, "4")
    with pytest.raises(RuntimeError, match="outside"):
        popdist.init()
    monkeypatch.setenv(env.REPLICA_INDEX_OFFSET, "1")
    with pytest.raises(RuntimeError, match="multiple"):
        popdist.init()


def test_init_rejects_bad_uniform_flag(inside, monkeypatch):
    inside()
    monkeypatch.setenv(env.UNIFORM_REPLICAS_PER_INSTANCE, "yes")
    with pytest.raises(RuntimeError, match="0 or 1"):
        popdist.init()


def test_init_allows_non_uniform_split(inside, monkeypatch):
    inside()
    monkeypatch.setenv(env.UNIFORM_REPLICAS_PER_INSTANCE, "0")
    monkeypatch.setenv(env.NUM_TOTAL_REPLICAS, "5")
    monkeypatch.setenv(env.NUM_LOCAL_REPLICAS, "3")
    monkeypatch.setenv(env.REPLICA_INDEX_OFFSET, "2")
    assert popdist.init() is None


def test_execute_on_instances_with_int(inside):
    inside(index=1)
    calls = []
    def record(x, y=0):
        calls.append((x, y))
        return "done"

    assert popdist.execute_on_instances(1, record, 5, y=6) == "done"
    assert calls == [(5, 6)]
    assert popdist.execute_on_instances(0, calls.append, "no") is None
    assert calls == [(5, 6)]


def test_execute_on_instances_with_set(inside):
    inside(index=2, num_instances=4, num_total_replicas=4)
    assert popdist.execute_on_instances({0, 2}, lambda: "ran") == "ran"
    assert popdist.execute_on_instances({0, 3}, lambda: "ran") is None
    assert popdist.execute_on_instances([2], lambda: "ran") == "ran"


def test_execute_on_instances_outside_poprun_is_instance_zero():
    assert popdist.execute_on_instances(0, lambda: 42) == 42
    assert popdist.execute_on_instances({1}, lambda: 42) is None


def test_public_api_is_reexported():
    from popdist import _progress, autoreport, errorfile

    assert set(popdist.__all__) == set(popdist_core.__all__) | {"setEngineOptions", "record",
                                                                 "progress"}
    for name in popdist_core.__all__:
        assert getattr(popdist, name) is getattr(popdist_core, name)
    assert popdist.setEngineOptions is autoreport.setEngineOptions
    assert popdist.record is errorfile.record
    assert popdist.progress is _progress.progress


def test_real_subprocess_sees_its_identity():
    child_env = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
    child_env.update(env.instance_environment(_identity()))
    child_env["PYTHONPATH"] = str(SRC)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import popdist; print(popdist.getInstanceIndex(), popdist.getNumInstances())",
        ],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1 2"


@pytest.mark.parametrize("replicas, node", [(1, 0), (2, 64), (4, 96), (8, 112), (16, 120)])
def test_get_device_id_from_what_real_poprun_gave_on_a_larger_partition(monkeypatch, replicas,
                                                                        node):
    """The variables PopRun 3.1.0 gave instance i of `replicas` one-IPU instances on the
    64-IPU partition p64 (CosmicTagger's logs): each one's device is its own IPU, i."""
    for index in range(replicas):
        for name, value in {env.NUM_TOTAL_REPLICAS: replicas, env.NUM_IPUS_PER_REPLICA: 1,
                            env.NUM_LOCAL_REPLICAS: 1, env.UNIFORM_REPLICAS_PER_INSTANCE: 1,
                            env.NODE_DEVICE_ID: node, env.REPLICA_INDEX_OFFSET: index,
                            env.LOCAL_INSTANCE_INDEX: index}.items():
            monkeypatch.setenv(name, str(value))
        assert popdist.getDeviceId() == index == popdist.getDeviceId(1)


def test_child_device_agrees_with_the_numbering_on_every_partition_size():
    from popdist.devices import child_device, device_id

    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        for size in (s for s in (1, 2, 4, 8, 16, 32, 64, 128) if s <= n):
            for at in range(0, n, size):
                node = device_id(n, size, at)
                for part in (s for s in (1, 2, 4, 8) if s <= size):
                    for offset in range(0, size, part):
                        assert child_device(node, size, part, offset) == \
                            device_id(n, part, at + offset), (n, size, at, part, offset)
    with pytest.raises(ValueError, match="device 64 .2 IPUs. has no device of 4 IPUs"):
        child_device(64, 2, 4, 0)
    with pytest.raises(ValueError, match="device 63 is no device of 2 IPUs"):
        child_device(63, 2, 1, 0)  # the last single IPU of 64, not a pair
