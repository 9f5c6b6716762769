"""`poprun.plan.topology`: the Linux list format, recorded sysfs trees, cpusets, the wire form."""

from __future__ import annotations

import json
import os

import pytest

from poprun import ConfigError
from poprun.plan.topology import (Cpu, Node, Topology, format_cpu_list, local_topology, parse_allowed,
                             parse_cpu_list, parse_topology, read_sysfs)
from sysfs_machines import EPYC_NPS4, MACHINES, XEON_2S, XEON_INTERLEAVED, load_files

# --- the list format -----------------------------------------------------------------------


@pytest.mark.parametrize("text, ids", [
    ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
    ("0\n", (0,)),
    ("", ()),
    ("\n", ()),
    ("5,1-2", (1, 2, 5)),
    ("1,1-2", (1, 2)),
    ("0-1", (0, 1)),
    ("0,2,4,6", (0, 2, 4, 6)),
])
def test_parse_cpu_list(text, ids):
    assert parse_cpu_list(text) == ids


@pytest.mark.parametrize("ids, text", [
    ((0, 1, 2, 3, 8, 10, 11), "0-3,8,10-11"),
    ((), ""),
    ((7,), "7"),
    ((1, 0), "0-1"),
    ((0, 2, 4, 6), "0,2,4,6"),
    ((3, 3, 4), "3-4"),
])
def test_format_cpu_list(ids, text):
    assert format_cpu_list(ids) == text
    assert parse_cpu_list(text) == tuple(sorted(set(ids)))


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-2", "0-7:2", "1;2", "0x3"])
def test_parse_cpu_list_rejects(text):
    with pytest.raises(ValueError, match="is not a CPU list"):
        parse_cpu_list(text)


# --- recorded machines ---------------------------------------------------------------------


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_recorded_machine(machine):
    topo = parse_topology(load_files(machine))
    assert [n.id for n in topo.nodes] == machine.nodes
    for node in topo.nodes:
        assert list(node.cpus) == machine.node_cpus(node.id)
        assert node.memory_kib > 1_000_000  # every node of these machines has memory
    assert topo.mems == tuple(machine.nodes)
    assert [c.id for c in topo.cpus] == list(range(machine.num_cpus))
    for cpu in topo.cpus:
        assert cpu.node == machine.node_of(cpu.id)
        assert cpu.socket == machine.socket_of(cpu.node)
        assert cpu.core == machine.core_of(cpu.id)


def test_memtotal_is_read_from_its_line():
    topo = parse_topology(load_files(XEON_2S))
    assert [n.memory_kib for n in topo.nodes] == [47925628, 49519964]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_read_sysfs_reads_the_tree(machine, monkeypatch):
    assert read_sysfs(str(machine.root)) == load_files(machine)
    monkeypatch.setenv("POPRUN_SYSFS_ROOT", str(machine.root))
    assert read_sysfs() == load_files(machine)


def test_offline_cpus_are_left_out():
    files = load_files(XEON_2S)
    files["devices/system/cpu/online"] = "0-4,6-31\n"
    for name in ("physical_package_id", "core_id", "thread_siblings_list"):
        del files[f"devices/system/cpu/cpu5/topology/{name}"]  # gone with the CPU
    topo = parse_topology(files)
    assert 5 not in [c.id for c in topo.cpus]
    assert topo.nodes[0].cpus == (0, 1, 2, 3, 4, 6, 7, *range(16, 24))
    assert next(c for c in topo.cpus if c.id == 21).core == 5  # its sibling still names the core


def test_no_numa_means_one_node_with_every_cpu_and_no_memory_to_bind():
    files = {k: v for k, v in load_files(XEON_INTERLEAVED).items()
             if not k.startswith("devices/system/node")}
    topo = parse_topology(files)
    assert topo.nodes == (Node(0, tuple(range(16)), 0),)
    assert topo.mems == ()
    assert {c.node for c in topo.cpus} == {0}
    assert {c.socket for c in topo.cpus} == {0, 1}


def test_cores_fall_back_to_core_id_without_sibling_lists():
    files = {k: v for k, v in load_files(EPYC_NPS4).items()
             if not k.endswith(("core_cpus_list", "thread_siblings_list"))}
    topo = parse_topology(files)
    assert [c.core for c in topo.cpus] == [EPYC_NPS4.core_of(c.id) for c in topo.cpus]


def test_memoryless_node_is_not_a_memory_node():
    files = load_files(EPYC_NPS4)
    files["devices/system/node/node2/meminfo"] = "Node 2 MemTotal:       0 kB\n"
    topo = parse_topology(files)
    assert topo.mems == (0, 1, 3)
    assert topo.nodes[2].cpus == (8, 9, 10, 11, 24, 25, 26, 27)


def test_no_cpus_at_all_is_an_error():
    with pytest.raises(ConfigError, match="no CPUs found"):
        parse_topology({})


@pytest.mark.parametrize("path, text, message", [
    ("devices/system/node/node1/cpulist", "4-x\n", "node1/cpulist: '4-x' is not a CPU list"),
    ("devices/system/cpu/cpu3/topology/physical_package_id", "zero\n",
     "cpu3/topology/physical_package_id: 'zero' is not a number"),
])
def test_malformed_sysfs_names_the_file(path, text, message):
    files = load_files(EPYC_NPS4)
    files[path] = text
    with pytest.raises(ConfigError, match=message):
        parse_topology(files)


# --- the cpuset ----------------------------------------------------------------------------


def test_cpuset_restricts_cpus_and_memory_nodes():
    topo = parse_topology(load_files(EPYC_NPS4), allowed_cpus=frozenset({2, 3, 4, 20, 30}),
                          allowed_mems=frozenset({1, 3}))
    assert [c.id for c in topo.cpus] == [2, 3, 4, 20, 30]
    assert [(n.id, n.cpus) for n in topo.nodes] == [(0, (2, 3)), (1, (4, 20)), (2, ()), (3, (30,))]
    assert topo.mems == (1, 3)
    # a core keeps its name when its first thread is not allowed
    assert next(c for c in topo.cpus if c.id == 30).core == 14


STATUS = """Name:\tpython3
Umask:\t0022
State:\tR (running)
Cpus_allowed:\tff
Cpus_allowed_list:\t0-3,6
Mems_allowed:\t00000000,00000001
Mems_allowed_list:\t0,2-3
voluntary_ctxt_switches:\t1
"""


def test_parse_allowed():
    assert parse_allowed(STATUS) == (frozenset({0, 1, 2, 3, 6}), frozenset({0, 2, 3}))


def test_parse_allowed_without_the_fields():
    with pytest.raises(ValueError, match="no Mems_allowed_list"):
        parse_allowed("Name:\tx\nCpus_allowed_list:\t0\n")


def test_a_recorded_topology_is_not_cut_to_this_process_cpuset(monkeypatch):
    # The recording is another machine: this process's cpuset says nothing about its CPUs.
    monkeypatch.setenv("POPRUN_SYSFS_ROOT", str(EPYC_NPS4.root))
    topo = local_topology()
    assert [c.id for c in topo.cpus] == list(range(32))
    assert set(topo.mems) == {0, 1, 2, 3}


def test_local_topology_of_this_machine():
    topo = local_topology("/sys")
    assert {c.id for c in topo.cpus} == os.sched_getaffinity(0)
    assert topo.mems  # Linux with NUMA: at least node 0 has memory


# --- the wire form -------------------------------------------------------------------------


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
def test_round_trip_through_json(machine):
    topo = parse_topology(load_files(machine), allowed_cpus=frozenset(range(0, 40, 3)))
    wire = json.loads(json.dumps(topo.to_dict()))
    assert Topology.from_dict(wire) == topo


def test_wire_form_is_small_and_plain():
    topo = Topology((Cpu(0, 0, 0, 0), Cpu(1, 1, 0, 1)),
                    (Node(0, (0,), 1024), Node(1, (1,), 0)), (0,))
    assert topo.to_dict() == {"cpus": [[0, 0, 0, 0], [1, 1, 0, 1]],
                              "nodes": [[0, 1024], [1, 0]], "mems": [0]}


@pytest.mark.parametrize("data", [
    {},
    {"cpus": [[0, 0, 0]], "nodes": [[0, 1]], "mems": []},
    {"cpus": [["0", 0, 0, 0]], "nodes": [[0, 1]], "mems": []},
    {"cpus": [[0, 0, 0, True]], "nodes": [[0, 1]], "mems": []},
    {"cpus": [], "nodes": [[0]], "mems": []},
    {"cpus": [], "nodes": [], "mems": None},
])
def test_malformed_wire_form(data):
    with pytest.raises(ConfigError, match="malformed topology"):
        Topology.from_dict(data)


def test_wire_form_with_cpus_on_unlisted_nodes():
    data = {"cpus": [[0, 0, 0, 0], [1, 3, 0, 1], [2, 3, 0, 2]], "nodes": [[0, 1]], "mems": [0]}
    with pytest.raises(ConfigError, match="CPUs 1-2 are on nodes it does not list"):
        Topology.from_dict(data)
