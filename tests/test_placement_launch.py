"""NUMA placement through the real command: the plan (--dry-run over recorded sysfs trees) and
live instances whose binding is read back from /proc (this machine: 2 CPUs, 1 NUMA node)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import OFFLINE, assert_usage_error, run_poprun
from sysfs_machines import EPYC_NPS4, XEON_2S

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
# An instance that starts a grandchild which prints its own binding: a binding set on the
# running instance (taskset -p) would not reach a child started before it; one in force
# from the first instruction does.
GRANDCHILD = ("sh", "-c", "sh -c 'grep -E \"^(Cpus|Mems)_allowed_list\" /proc/self/status; "
              "head -1 /proc/self/numa_maps'")


def dry_run_plan(*args: str, env: dict[str, str] | None = None) -> list[dict]:
    proc = run_poprun(*OFFLINE, "--dry-run", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)["instances"]


def test_dry_run_spreads_instances_over_a_recorded_machines_numa_nodes():
    env = {"POPRUN_SYSFS_ROOT": str(EPYC_NPS4.root)}
    plan = dry_run_plan("--num-instances=4", "--num-replicas=4", PY, env=env)
    for inst, node in zip(plan, EPYC_NPS4.nodes):
        assert inst["mems"] == [node]
        assert inst["cpus"] == EPYC_NPS4.node_cpus(node)


def test_dry_run_one_core_strategies_and_disabled():
    env = {"POPRUN_SYSFS_ROOT": str(XEON_2S.root)}
    close = dry_run_plan("--num-instances=2", "--num-replicas=2", "--process-placement=close",
                         PY, env=env)
    first_cores = XEON_2S.first[XEON_2S.nodes[0]]
    assert [i["cpus"] for i in close] == [[first_cores[0]], [first_cores[1]]]
    scatter = dry_run_plan("--num-instances=2", "--num-replicas=2",
                           "--process-placement=scatternuma", PY, env=env)
    assert [i["mems"] for i in scatter] == [[n] for n in XEON_2S.nodes]
    off = dry_run_plan("--num-instances=2", "--num-replicas=2", "--numa-aware=no", PY, env=env)
    assert all(i["cpus"] is None and i["mems"] is None for i in off)
    single = dry_run_plan("--num-instances=1", "--num-replicas=2", PY, env=env)
    assert single[0]["cpus"] is None  # one instance per host: not bound unless asked


def bindings_by_instance(stdout: bytes) -> dict[int, str]:
    out: dict[int, list[str]] = {}
    for line in stdout.decode().splitlines():
        tag, _, text = line.partition("<stdout>:")
        out.setdefault(int(tag.split(",")[1].rstrip("]")), []).append(text)
    return {k: "\n".join(v) for k, v in out.items()}


# no switch: the machine's CPUs
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_close_binds_each_instance_and_its_grandchild_to_one_cpu():
    cpus = sorted(os.sched_getaffinity(0))
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--tag-output",
                      "--process-placement=close", *GRANDCHILD)
    assert proc.returncode == 0, proc.stderr.decode()
    seen = bindings_by_instance(proc.stdout)
    for index in (0, 1):
        assert f"Cpus_allowed_list:\t{cpus[index]}" in seen[index], seen[index]
        assert " bind:" in seen[index], seen[index]  # memory policy MPOL_BIND inherited


def test_spreadnuma_binds_memory_to_the_nodes_of_this_machine():
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--tag-output",
                      *GRANDCHILD)
    assert proc.returncode == 0, proc.stderr.decode()
    nodes = os.listdir("/sys/devices/system/node") if os.path.isdir(
        "/sys/devices/system/node") else []
    if not any(n.startswith("node") for n in nodes):
        # no switch: the machine's NUMA topology
        pytest.skip("no NUMA nodes in sysfs")
    for text in bindings_by_instance(proc.stdout).values():
        assert " bind:" in text, text


# no switch: the machine's CPUs
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_report_bindings_prints_what_proc_says():
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                      "--process-placement=close", "--report-bindings", PY, "-c",
                      "import time; time.sleep(0.5)")
    assert proc.returncode == 0, proc.stderr.decode()
    err = proc.stderr.decode()
    cpus = sorted(os.sched_getaffinity(0))
    for index in (0, 1):
        assert f"instance {index} (pid " in err and f"cpus {cpus[index]}," in err, err
    assert "POPRUN [W]" not in err  # the binding is the planned one


def test_more_single_core_instances_than_cpus_is_a_usage_error(tmp_path):
    marker = tmp_path / "started"
    n = len(os.sched_getaffinity(0)) + 1
    proc = run_poprun(*OFFLINE, f"--num-instances={n}", f"--num-replicas={n}",
                      "--process-placement=close", "touch", str(marker))
    assert_usage_error(proc, "--process-placement=close")
    assert not marker.exists()


def test_contradictory_placement_options_are_a_usage_error():
    proc = run_poprun(*OFFLINE, "--numa-aware=no", "--process-placement=close", PY)
    assert_usage_error(proc, "--numa-aware=no", "--process-placement=close")


@pytest.mark.parametrize("bind_to,map_by,expected", [
    ("core", None, "close"), ("core", "numa", "scatternuma"), ("core", "socket:PE=2",
                                                                 "scattersocket"),
    ("numa", None, "spreadnuma"), ("none", None, "disabled"), ("board", None, None),
    (None, "numa", None),
])
def test_mpirun_bind_to_and_map_by_as_strategies(bind_to, map_by, expected):
    from poprun.plan.placement import strategy_from_mpi

    got = strategy_from_mpi(bind_to, map_by)
    assert (got.value if got else None) == expected


# no switch: the machine's CPUs
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_bind_to_core_in_mpi_args_binds_when_placement_is_disabled():
    cpus = sorted(os.sched_getaffinity(0))
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--numa-aware=no",
                      "--mpi-global-args=--bind-to core", "--tag-output", *GRANDCHILD)
    assert proc.returncode == 0, proc.stderr.decode()
    seen = bindings_by_instance(proc.stdout)
    assert all(f"Cpus_allowed_list:\t{cpus[i]}\n" in seen[i] + "\n" for i in (0, 1)), seen
