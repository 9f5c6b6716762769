"""Where each instance on a host runs: the `--process-placement` strategies (guide §2.5).

Pure functions of a host's `Topology`: `place(topology, n, strategy)` gives every instance on
the host its CPUs and memory nodes, or None when it is not bound. The single-core strategies
lay the usable CPUs out in the order instances take them; they mirror the mpirun mappings the
original PopRun delegated to (`--map-by numa|socket|core --bind-to core`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby, zip_longest

from spawner import uncompiled

from poprun.errors import ConfigError
from poprun.plan.topology import Cpu, Topology


class Strategy(str, enum.Enum):
    """A `--process-placement` value."""

    SPREADNUMA = "spreadnuma"
    """The host's NUMA nodes divided among its instances, each bound to the CPUs and memory of
    its nodes; when instances outnumber nodes they share nodes round-robin. The default."""
    SCATTERNUMA = "scatternuma"
    """One core per instance, dealt round-robin across the NUMA nodes."""
    SCATTERSOCKET = "scattersocket"
    """One core per instance, dealt round-robin across the sockets."""
    CLOSE = "close"
    """One core per instance, consecutive cores (a node's cores before the next node's)."""
    DISABLED = "disabled"
    """No binding: instances run wherever the OS puts them."""


@uncompiled.dataclass(frozen=True)
class Binding:
    """What one instance is bound to."""

    cpus: tuple[int, ...]
    mems: tuple[int, ...]  # memory nodes; () leaves the memory policy alone (none to bind to)

    def __init__(self, cpus, mems):  # by hand: one per instance (spawner/uncompiled.py)
        self.__dict__.update(cpus=cpus, mems=mems)


def resolve_strategy(process_placement: str | None, numa_aware: bool | None,
                     instances_on_host: int) -> Strategy:
    """The strategy for a host from `--process-placement` and the older `--numa-aware`
    (None: not given). `--numa-aware=yes` is spreadnuma, `no` is disabled.

    Given neither, a host with several instances gets spreadnuma, and a host with one instance
    is not bound: spreadnuma would give it every node, which restricts it to nothing but turns
    the kernel's local-first memory allocation into a strict binding that can only hurt. Asking
    for spreadnuma explicitly still binds it."""
    if process_placement is not None:
        strategy = _parse_strategy(process_placement)
        implied = {True: Strategy.SPREADNUMA, False: Strategy.DISABLED}.get(numa_aware, strategy)
        if implied is not strategy:
            raise ConfigError(f"--numa-aware={'yes' if numa_aware else 'no'} contradicts "
                              f"--process-placement={strategy.value}: give only one of them")
        return strategy
    if numa_aware is not None:
        return Strategy.SPREADNUMA if numa_aware else Strategy.DISABLED
    return Strategy.SPREADNUMA if instances_on_host > 1 else Strategy.DISABLED


# mpirun's --bind-to/--map-by in the mpi-args, where they say something a strategy can do:
# (bind-to, map-by) -> strategy; map-by None matches any. Others are ignored (said at -v).
_MPI_BINDINGS = {
    ("none", None): Strategy.DISABLED,
    ("core", "numa"): Strategy.SCATTERNUMA,
    ("core", "socket"): Strategy.SCATTERSOCKET,
    ("core", None): Strategy.CLOSE,
    ("hwthread", None): Strategy.CLOSE,
    ("numa", None): Strategy.SPREADNUMA,
    ("socket", None): Strategy.SPREADNUMA,
}


def strategy_from_mpi(bind_to: str | None, map_by: str | None) -> Strategy | None:
    """What mpirun's `--bind-to X [--map-by Y]` asks for, as a strategy; None when they are
    absent or mean nothing here (e.g. `--map-by ppr:2:node`)."""
    if not bind_to:
        return None
    bind = bind_to.split(":", 1)[0].lower()  # `core:overload-allowed` and the like
    mapped = (map_by or "").split(":", 1)[0].lower() or None
    return _MPI_BINDINGS.get((bind, mapped)) or _MPI_BINDINGS.get((bind, None))


def _parse_strategy(value: str) -> Strategy:
    try:
        return Strategy(value)
    except ValueError:
        choices = ", ".join(s.value for s in Strategy)
        raise ConfigError(f"unknown --process-placement {value!r}; "
                          f"choose one of {choices}") from None


def place(topology: Topology, num_instances: int, strategy: Strategy | str,
          host: str | None = None) -> tuple[Binding | None, ...]:
    """The binding of each of the `num_instances` instances on one host (`host` only names it
    in errors). Raises ConfigError when the host cannot hold them."""
    strategy = _parse_strategy(strategy)
    if num_instances < 0:
        raise ConfigError(f"the number of instances must not be negative, not {num_instances}")
    if strategy is Strategy.DISABLED or num_instances == 0:
        return (None,) * num_instances
    where = host or "this host"
    if not topology.cpus:
        raise ConfigError(f"--process-placement={strategy.value}: {where} has no usable CPU "
                          f"(all are offline or outside the cpuset)")
    if strategy is Strategy.SPREADNUMA:
        return _spread(topology, num_instances)
    order = _CPU_ORDERS[strategy](topology.cpus)
    if num_instances > len(order):
        raise ConfigError(
            f"--process-placement={strategy.value} gives each instance its own CPU, but "
            f"{num_instances} instances are to run on {where}, which allows only "
            f"{len(order)} CPUs: start fewer instances or use --process-placement=spreadnuma")
    node_of = {cpu.id: cpu.node for cpu in topology.cpus}
    return tuple(Binding((cpu,), _mems(topology, [node_of[cpu]])) for cpu in order[:num_instances])


# --- spreadnuma ----------------------------------------------------------------------------


def _spread(topology: Topology, n: int) -> tuple[Binding, ...]:
    nodes = [node for node in topology.nodes if node.cpus]
    if n <= len(nodes):
        # Consecutive nodes stay together (node numbers follow the sockets), and no node is
        # left unused: the first len(nodes) % n instances get one node more than the rest.
        size, extra = divmod(len(nodes), n)
        bounds = [i * size + min(i, extra) for i in range(n + 1)]
        groups = [nodes[a:b] for a, b in zip(bounds, bounds[1:])]
    else:
        groups = [[nodes[i % len(nodes)]] for i in range(n)]
    return tuple(Binding(tuple(sorted(c for node in g for c in node.cpus)),
                         _mems(topology, [node.id for node in g])) for g in groups)


def _mems(topology: Topology, nodes: Iterable[int]) -> tuple[int, ...]:
    # A node without (allowed) memory is left out; with none left the instance keeps the
    # kernel's default policy, which allocates from the nearest node that has memory.
    return tuple(n for n in nodes if n in topology.mems)


# --- one core per instance ----------------------------------------------------------------
#
# "One core" is one hardware thread (one Linux CPU), but the order fills physical cores first:
# every core's first thread is taken before any core's second thread. So two instances never
# share a core while another core is idle, and a host can still take as many instances as it
# has CPUs. Binding to the whole core (both threads, as mpirun's
# `--bind-to core` does) would halve that limit on SMT machines for single-threaded instances
# — the only kind these strategies suit (guide §2.5).


def _thread_major(cpus: Iterable[Cpu]) -> list[int]:
    """The first thread of every core (cores in node order), then every core's second, ..."""
    ordered = sorted(cpus, key=lambda c: (c.node, c.core, c.id))
    return _deal([c.id for c in threads] for _, threads in groupby(ordered, key=lambda c: c.core))


def _deal(groups: Iterable[Sequence[int]]) -> list[int]:
    """Round-robin over the groups: the first of each, then the second of each, ..."""
    return [x for rank in zip_longest(*groups) for x in rank if x is not None]


def _scatter(key: Callable[[Cpu], int]) -> Callable[[Sequence[Cpu]], list[int]]:
    def order(cpus: Sequence[Cpu]) -> list[int]:
        ordered = sorted(cpus, key=key)
        return _deal(_thread_major(group) for _, group in groupby(ordered, key=key))
    return order


_CPU_ORDERS: dict[Strategy, Callable[[Sequence[Cpu]], list[int]]] = {
    Strategy.SCATTERNUMA: _scatter(lambda c: c.node),
    Strategy.SCATTERSOCKET: _scatter(lambda c: c.socket),
    Strategy.CLOSE: _thread_major,
}
