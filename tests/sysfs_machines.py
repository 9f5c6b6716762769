"""Recorded sysfs trees (tests/data/sysfs/<name>) and, written out by hand, what each machine is.

Each tree holds only the files poprun parses. The facts below come from the machines' layouts
(the CPU vendors' enumeration order), not from poprun's code, so tests can check the parser and
the placement strategies against them.

- xeon-silver-4108-2s: Supermicro SYS-4029GP-TRT2, 2 x Xeon Silver 4108 (8 cores, HT), one
  NUMA node per socket (the machine of hwloc's test 32intel64-2p8co2t); kernel 3.10, so only
  `thread_siblings_list`.
- epyc-7302p-nps4: 1 x AMD EPYC 7302P (16 cores, SMT) in NPS4 mode: 4 nodes of 4 cores.
- epyc-7302-2s-nps4: 2 x AMD EPYC 7302 in NPS4 mode: 8 nodes of 4 cores, 64 CPUs.
- xeon-e5-2623v4-2s-interleaved: 2 x Xeon E5-2623 v4 (4 cores, HT) whose firmware numbers
  CPUs alternately by socket (even CPUs on socket 0), as many Dell/HP servers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SYSFS = Path(__file__).resolve().parent / "data" / "sysfs"


@dataclass(frozen=True)
class Machine:
    name: str
    sockets: dict[int, tuple[int, ...]]  # socket -> its NUMA nodes
    first: dict[int, list[int]]  # node -> the first hardware thread of each core, core order
    second: dict[int, list[int]]  # node -> each core's SMT sibling, same order

    @property
    def root(self) -> Path:
        return SYSFS / self.name

    @property
    def nodes(self) -> list[int]:
        return sorted(self.first)

    def node_cpus(self, node: int) -> list[int]:
        return sorted(self.first[node] + self.second[node])

    def cores_first(self, nodes: list[int]) -> list[int]:
        """The CPUs of `nodes`: every core's first thread, then every core's sibling."""
        return [c for n in nodes for c in self.first[n]] + [c for n in nodes for c in self.second[n]]

    def socket_of(self, node: int) -> int:
        return next(s for s, nodes in self.sockets.items() if node in nodes)

    def node_of(self, cpu: int) -> int:
        return next(n for n in self.nodes if cpu in self.node_cpus(n))

    def core_of(self, cpu: int) -> int:
        """The core's first hardware thread."""
        for node in self.nodes:
            for first, second in zip(self.first[node], self.second[node]):
                if cpu in (first, second):
                    return first
        raise KeyError(cpu)

    @property
    def num_cpus(self) -> int:
        return sum(len(self.node_cpus(n)) for n in self.nodes)


def _r(a: int, b: int) -> list[int]:
    return list(range(a, b))


XEON_2S = Machine("xeon-silver-4108-2s", sockets={0: (0,), 1: (1,)},
                  first={0: _r(0, 8), 1: _r(8, 16)}, second={0: _r(16, 24), 1: _r(24, 32)})
EPYC_NPS4 = Machine("epyc-7302p-nps4", sockets={0: (0, 1, 2, 3)},
                    first={k: _r(4 * k, 4 * k + 4) for k in range(4)},
                    second={k: _r(16 + 4 * k, 20 + 4 * k) for k in range(4)})
EPYC_2S_NPS4 = Machine("epyc-7302-2s-nps4", sockets={0: (0, 1, 2, 3), 1: (4, 5, 6, 7)},
                       first={k: _r(4 * k, 4 * k + 4) for k in range(8)},
                       second={k: _r(32 + 4 * k, 36 + 4 * k) for k in range(8)})
XEON_INTERLEAVED = Machine("xeon-e5-2623v4-2s-interleaved", sockets={0: (0,), 1: (1,)},
                           first={0: [0, 2, 4, 6], 1: [1, 3, 5, 7]},
                           second={0: [8, 10, 12, 14], 1: [9, 11, 13, 15]})

MACHINES = (XEON_2S, EPYC_NPS4, EPYC_2S_NPS4, XEON_INTERLEAVED)


def load_files(machine: Machine) -> dict[str, str]:
    """The tree as `parse_topology` takes it, read without poprun's reader."""
    return {str(p.relative_to(machine.root)): p.read_text()
            for p in machine.root.rglob("*") if p.is_file()}
