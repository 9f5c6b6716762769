"""`poprun.plan.placement`: every strategy, 1..16 instances, on every recorded machine.

Two kinds of expectation, neither computed by the code under test: explicit tables for the
counts where the layout matters, and for every count the strategy's definition applied to the
machine facts written out by hand in sysfs_machines.py.
"""

from __future__ import annotations

import functools

import pytest

from poprun import ConfigError
from poprun.plan.placement import Binding, Strategy, place, resolve_strategy
from poprun.plan.topology import Topology, format_cpu_list, parse_cpu_list, parse_topology
from sysfs_machines import (EPYC_2S_NPS4, EPYC_NPS4, MACHINES, XEON_2S, XEON_INTERLEAVED,
                            Machine, load_files)

COUNTS = range(1, 17)
SINGLE_CORE = (Strategy.SCATTERNUMA, Strategy.SCATTERSOCKET, Strategy.CLOSE)


def topology(machine: Machine) -> Topology:
    return _parsed(machine.name)


@functools.cache
def _parsed(name: str) -> Topology:
    return parse_topology(load_files(next(m for m in MACHINES if m.name == name)))


def bindings(machine: Machine, n: int, strategy: Strategy) -> list[tuple[str, tuple[int, ...]]]:
    """As ("0-3,16-19", (0,)) pairs, easy to write out by hand."""
    return [(format_cpu_list(b.cpus), b.mems) for b in place(topology(machine), n, strategy)]


# --- explicit tables -----------------------------------------------------------------------

TABLES = [
    # spreadnuma: nodes divided (the first instances get the spare nodes), then round-robin
    (EPYC_NPS4, Strategy.SPREADNUMA, 1, [("0-31", (0, 1, 2, 3))]),
    (EPYC_NPS4, Strategy.SPREADNUMA, 2, [("0-7,16-23", (0, 1)), ("8-15,24-31", (2, 3))]),
    (EPYC_NPS4, Strategy.SPREADNUMA, 3,
     [("0-7,16-23", (0, 1)), ("8-11,24-27", (2,)), ("12-15,28-31", (3,))]),
    (EPYC_NPS4, Strategy.SPREADNUMA, 6,
     [("0-3,16-19", (0,)), ("4-7,20-23", (1,)), ("8-11,24-27", (2,)), ("12-15,28-31", (3,)),
      ("0-3,16-19", (0,)), ("4-7,20-23", (1,))]),
    (EPYC_2S_NPS4, Strategy.SPREADNUMA, 2, [("0-15,32-47", (0, 1, 2, 3)),
                                            ("16-31,48-63", (4, 5, 6, 7))]),
    (EPYC_2S_NPS4, Strategy.SPREADNUMA, 3, [("0-11,32-43", (0, 1, 2)), ("12-23,44-55", (3, 4, 5)),
                                            ("24-31,56-63", (6, 7))]),
    (EPYC_2S_NPS4, Strategy.SPREADNUMA, 5,
     [("0-7,32-39", (0, 1)), ("8-15,40-47", (2, 3)), ("16-23,48-55", (4, 5)),
      ("24-27,56-59", (6,)), ("28-31,60-63", (7,))]),
    (XEON_2S, Strategy.SPREADNUMA, 3,
     [("0-7,16-23", (0,)), ("8-15,24-31", (1,)), ("0-7,16-23", (0,))]),
    (XEON_INTERLEAVED, Strategy.SPREADNUMA, 2,
     [("0,2,4,6,8,10,12,14", (0,)), ("1,3,5,7,9,11,13,15", (1,))]),
    # close: consecutive cores of a node, the next node's, and SMT siblings only when every
    # core has an instance
    (XEON_2S, Strategy.CLOSE, 4, [("0", (0,)), ("1", (0,)), ("2", (0,)), ("3", (0,))]),
    (XEON_INTERLEAVED, Strategy.CLOSE, 6,
     [("0", (0,)), ("2", (0,)), ("4", (0,)), ("6", (0,)), ("1", (1,)), ("3", (1,))]),
    (EPYC_NPS4, Strategy.CLOSE, 5,
     [("0", (0,)), ("1", (0,)), ("2", (0,)), ("3", (0,)), ("4", (1,))]),
    # scatternuma: round-robin over the nodes
    (EPYC_2S_NPS4, Strategy.SCATTERNUMA, 10,
     [("0", (0,)), ("4", (1,)), ("8", (2,)), ("12", (3,)), ("16", (4,)), ("20", (5,)),
      ("24", (6,)), ("28", (7,)), ("1", (0,)), ("5", (1,))]),
    (XEON_INTERLEAVED, Strategy.SCATTERNUMA, 4,
     [("0", (0,)), ("1", (1,)), ("2", (0,)), ("3", (1,))]),
    # scattersocket: round-robin over the sockets
    (EPYC_2S_NPS4, Strategy.SCATTERSOCKET, 4,
     [("0", (0,)), ("16", (4,)), ("1", (0,)), ("17", (4,))]),
    (EPYC_NPS4, Strategy.SCATTERSOCKET, 3, [("0", (0,)), ("1", (0,)), ("2", (0,))]),
    (XEON_2S, Strategy.SCATTERSOCKET, 3, [("0", (0,)), ("8", (1,)), ("1", (0,))]),
]


@pytest.mark.parametrize("machine, strategy, n, expected", TABLES,
                         ids=[f"{m.name}-{s.value}-{n}" for m, s, n, _ in TABLES])
def test_table(machine, strategy, n, expected):
    assert bindings(machine, n, strategy) == expected


def test_close_fills_every_core_before_any_sibling():
    assert [b.cpus[0] for b in place(topology(XEON_INTERLEAVED), 16, Strategy.CLOSE)] == \
        [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert [b.cpus[0] for b in place(topology(XEON_2S), 16, Strategy.CLOSE)] == list(range(16))


def test_scatternuma_takes_siblings_last_on_a_small_node():
    # 4 nodes of 4 cores: 16 instances take every core's first thread, no sibling
    cpus = [b.cpus[0] for b in place(topology(EPYC_NPS4), 16, Strategy.SCATTERNUMA)]
    assert sorted(cpus) == list(range(16))


# --- every count, from the definitions ------------------------------------------------------

CASES = [(m, n) for m in MACHINES for n in COUNTS]
CASE_IDS = [f"{m.name}-{n}" for m, n in CASES]


@pytest.mark.parametrize("machine, n", CASES, ids=CASE_IDS)
def test_spreadnuma(machine, n):
    nodes = machine.nodes
    if n <= len(nodes):
        # every node to exactly one instance, consecutive nodes together, sizes within one
        size, extra = len(nodes) // n, len(nodes) % n
        expected_groups, start = [], 0
        for i in range(n):
            width = size + (1 if i < extra else 0)
            expected_groups.append(nodes[start:start + width])
            start += width
    else:
        expected_groups = [[nodes[i % len(nodes)]] for i in range(n)]
    got = place(topology(machine), n, Strategy.SPREADNUMA)
    assert len(got) == n
    for binding, group in zip(got, expected_groups):
        assert binding.mems == tuple(group)
        assert binding.cpus == tuple(sorted(c for node in group for c in machine.node_cpus(node)))


def _dealt(groups: list[list[int]], i: int) -> int:
    """Round-robin: instance i takes the (i // len)-th CPU of group i % len (no group runs
    out within 16 instances on these machines)."""
    return groups[i % len(groups)][i // len(groups)]


def _expected_cpu(machine: Machine, strategy: Strategy, i: int) -> int:
    if strategy is Strategy.CLOSE:
        return machine.cores_first(machine.nodes)[i]
    if strategy is Strategy.SCATTERNUMA:
        return _dealt([machine.cores_first([n]) for n in machine.nodes], i)
    return _dealt([machine.cores_first(nodes) for _, nodes in sorted(machine.sockets.items())], i)


@pytest.mark.parametrize("strategy", SINGLE_CORE, ids=lambda s: s.value)
@pytest.mark.parametrize("machine, n", CASES, ids=CASE_IDS)
def test_single_core_strategies(machine, n, strategy):
    got = place(topology(machine), n, strategy)
    assert [b.cpus for b in got] == [(_expected_cpu(machine, strategy, i),) for i in range(n)]
    assert [b.mems for b in got] == [(machine.node_of(b.cpus[0]),) for b in got]
    assert len({b.cpus for b in got}) == n  # never two instances on one CPU
    cores = [machine.core_of(b.cpus[0]) for b in got]
    assert len(set(cores)) == min(n, len(set(machine.core_of(c) for c in range(machine.num_cpus))))


@pytest.mark.parametrize("machine, n", CASES, ids=CASE_IDS)
def test_disabled(machine, n):
    assert place(topology(machine), n, Strategy.DISABLED) == (None,) * n


def test_zero_instances():
    assert place(topology(XEON_2S), 0, Strategy.CLOSE) == ()


# --- cpusets, memory, errors ---------------------------------------------------------------


def test_cpuset_limits_single_core_strategies():
    topo = parse_topology(load_files(XEON_2S), allowed_cpus=frozenset({0, 1, 16}))
    assert [b.cpus for b in place(topo, 3, Strategy.CLOSE)] == [(0,), (1,), (16,)]
    with pytest.raises(ConfigError) as e:
        place(topo, 4, Strategy.CLOSE, host="pod1")
    assert str(e.value) == ("--process-placement=close gives each instance its own CPU, but 4 "
                            "instances are to run on pod1, which allows only 3 CPUs: start fewer "
                            "instances or use --process-placement=spreadnuma")


def test_cpuset_limits_spreadnuma_to_nodes_with_allowed_cpus():
    topo = parse_topology(load_files(EPYC_NPS4), allowed_cpus=frozenset(parse_cpu_list("4-11")),
                          allowed_mems=frozenset({1, 2}))
    assert place(topo, 2, Strategy.SPREADNUMA) == (Binding((4, 5, 6, 7), (1,)),
                                                   Binding((8, 9, 10, 11), (2,)))
    assert place(topo, 3, Strategy.SPREADNUMA)[2] == Binding((4, 5, 6, 7), (1,))


def test_cpus_without_allowed_memory_leave_memory_alone():
    topo = parse_topology(load_files(XEON_2S), allowed_mems=frozenset({0}))
    assert place(topo, 2, Strategy.SPREADNUMA)[1].mems == ()
    assert place(topo, 2, Strategy.SCATTERNUMA) == (Binding((0,), (0,)), Binding((8,), ()))
    assert place(topo, 1, Strategy.SPREADNUMA) == (Binding(tuple(range(32)), (0,)),)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name)
@pytest.mark.parametrize("strategy", SINGLE_CORE, ids=lambda s: s.value)
def test_more_single_core_instances_than_cpus(machine, strategy):
    assert len(place(topology(machine), machine.num_cpus, strategy)) == machine.num_cpus
    with pytest.raises(ConfigError, match=f"{machine.num_cpus + 1} instances .* only "
                                          f"{machine.num_cpus} CPUs"):
        place(topology(machine), machine.num_cpus + 1, strategy)


def test_spreadnuma_has_no_instance_limit():
    got = place(topology(XEON_INTERLEAVED), 40, Strategy.SPREADNUMA)
    assert [b.mems for b in got] == [(i % 2,) for i in range(40)]


def test_no_usable_cpu():
    topo = parse_topology(load_files(XEON_2S), allowed_cpus=frozenset())
    with pytest.raises(ConfigError, match="this host has no usable CPU"):
        place(topo, 1, Strategy.SPREADNUMA)
    assert place(topo, 2, Strategy.DISABLED) == (None, None)


def test_strategy_given_as_text():
    assert place(topology(XEON_2S), 1, "close") == (Binding((0,), (0,)),)
    with pytest.raises(ConfigError, match="unknown --process-placement 'closest'; choose one of "
                                          "spreadnuma, scatternuma, scattersocket, close, "
                                          "disabled"):
        place(topology(XEON_2S), 1, "closest")


def test_negative_count():
    with pytest.raises(ConfigError, match="must not be negative"):
        place(topology(XEON_2S), -1, Strategy.CLOSE)


# --- choosing the strategy -----------------------------------------------------------------


@pytest.mark.parametrize("placement, numa_aware, per_host, expected", [
    (None, None, 1, Strategy.DISABLED),  # one instance: binding it to everything buys nothing
    (None, None, 2, Strategy.SPREADNUMA),
    (None, None, 16, Strategy.SPREADNUMA),
    (None, True, 1, Strategy.SPREADNUMA),
    (None, False, 8, Strategy.DISABLED),
    ("spreadnuma", None, 1, Strategy.SPREADNUMA),
    ("close", None, 4, Strategy.CLOSE),
    ("scatternuma", None, 4, Strategy.SCATTERNUMA),
    ("scattersocket", None, 1, Strategy.SCATTERSOCKET),
    ("disabled", None, 8, Strategy.DISABLED),
    ("spreadnuma", True, 8, Strategy.SPREADNUMA),
    ("disabled", False, 8, Strategy.DISABLED),
])
def test_resolve_strategy(placement, numa_aware, per_host, expected):
    assert resolve_strategy(placement, numa_aware, per_host) is expected


@pytest.mark.parametrize("placement, numa_aware, message", [
    ("close", False, "--numa-aware=no contradicts --process-placement=close: give only one"),
    ("close", True, "--numa-aware=yes contradicts --process-placement=close: give only one"),
    ("disabled", True, "--numa-aware=yes contradicts --process-placement=disabled"),
    ("numa", None, "unknown --process-placement 'numa'; choose one of spreadnuma,"),
])
def test_resolve_strategy_errors(placement, numa_aware, message):
    with pytest.raises(ConfigError, match=message):
        resolve_strategy(placement, numa_aware, 4)

