"""Host-list syntax: `h1,h2`, `pod[1-4]`, `node[01-10,15]`, `user@host`, slots as mpirun and
horovodrun write them (`h1:4,h2:2`: four instances on h1, two on h2), `ssh://[user@]host:port`
for an SSH port, host files (ours, and MPI hostfiles: `node1 slots=4`), and Slurm's
`SLURM_JOB_NODELIST` (the same bracket syntax, several groups allowed: `rack[1-2]-n[1-3]`) with
`SLURM_TASKS_PER_NODE` (`2(x3),1`). Pure: text in, `Host` tuples out.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import field, replace

from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError
from poprun.plan.files import MAX_HOST_FILE

# Patterns compiled on first use (re's cache), not at import: a launch on this host alone
# parses no host list, and each compile costs 0.1-0.25 ms.
_RANGE = r"^(\d+)(?:-(\d+))?$"
# `[::1]:22` or `user@[fe80::1]`: brackets around an IPv6 address, not a range to expand.
_IPV6 = r"^(?:ssh://)?(?:[^@\[]+@)?\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?$"


@dataclass(frozen=True)
class Host:
    """One host as the user named it; `name` is what ~/.ssh/config is looked up with.
    `slots`: how many instances run there, when the list says (None: an even share)."""

    name: str
    user: str | None = None
    port: int | None = None
    slots: int | None = field(default=None, compare=False)

    @property
    def entry(self) -> str:
        """Host-list text that parses back to this host, slots included."""
        return f"{self}:{self.slots}" if self.slots and not self.port else str(self)

    def __str__(self) -> str:
        """The host's label (slots are not part of it)."""
        text = f"{self.user}@{self.name}" if self.user else self.name
        return f"ssh://{text}:{self.port}" if self.port else text


SLURM_NODELIST = "SLURM_JOB_NODELIST"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
SLURM_NTASKS = "SLURM_NTASKS"
# Where Open MPI (and the Kubeflow MPI Operator, which mounts /etc/mpi/hostfile) names its
# default hostfile.
OMPI_HOSTFILE = "OMPI_MCA_orte_default_hostfile"
LOCAL_NAMES = ("localhost",)
SLOTS_PORT_FLOOR = 1024  # `host:N` with N this large is probably meant as a port


def job_hosts(hosts: tuple[Host, ...], environ: Mapping[str, str]) -> tuple[Host, ...]:
    """The hosts a job runs on: those given, else a Slurm allocation's nodes (with their
    task counts as slots), else Open MPI's default hostfile, else none (this host only)."""
    return hosts or job_hosts_and_source(hosts, environ)[0]


def job_hosts_and_source(hosts: tuple[Host, ...], environ: Mapping[str, str],
                         num_instances: int | None = None) -> tuple[tuple[Host, ...], str]:
    """`job_hosts`, and where they came from in words (for -v and error messages).
    `num_instances`: the count the user gave, which wins over Slurm's task counts."""
    if hosts:
        return hosts, "--host"
    nodelist = environ.get(SLURM_NODELIST, "").strip()
    if nodelist:
        where = f"the Slurm allocation ({SLURM_NODELIST}={nodelist})"
        found = parse_host_list(nodelist, where)
        counts = environ.get(SLURM_TASKS_PER_NODE, "").strip()
        if counts:
            per_node = parse_tasks_per_node(counts, found, SLURM_TASKS_PER_NODE)
            where += f" with {SLURM_TASKS_PER_NODE}={counts}"
            if num_instances is None or num_instances == sum(per_node):
                found = tuple(replace(h, slots=n) for h, n in zip(found, per_node))
            else:
                # Inside a job step (`srun ... poprun --num-instances=2`, as ALCF's guide
                # runs it) the allocation gives the hosts, the step's task count (often
                # one: poprun itself) says nothing of the instances: the user's count wins.
                where += (f" ({sum(per_node)} task(s); --num-instances={num_instances} "
                          "given wins)")
        return found, where
    hostfile = environ.get(OMPI_HOSTFILE, "").strip()
    if hostfile:
        where = f"{OMPI_HOSTFILE}={hostfile}"
        return parse_host_file(read_host_file(hostfile, where), where), where
    return (), "this host"


def spare_nodes(hosts: tuple[Host, ...], count: int, source: str
                ) -> tuple[tuple[Host, ...], tuple[Host, ...]]:
    """The allocation's nodes as the job's and `count` spares (its last nodes: Slurm lists
    them in order, and a user asking for N+K nodes runs on the first N)."""
    if not count:
        return hosts, ()
    if count >= len(hosts):
        raise ConfigError(f"--spare-nodes {count}: {source} has {len(hosts)} node(s): "
                          "at least one must run the job")
    return hosts[:-count], hosts[-count:]


def nodes_beyond_need(environ: Mapping[str, str], num_instances: int
                      ) -> tuple[tuple[Host, ...], tuple[Host, ...], str] | None:
    """A Slurm allocation's nodes split into the job's and the spares: where its first nodes
    hold exactly `num_instances` at Slurm's tasks per node, those run the job (each its task
    count) and the nodes beyond stand by (docs/slurm.md, "Spare nodes and the stop window").
    With where that came from, in words; None where no such split exists."""
    nodelist = environ.get(SLURM_NODELIST, "").strip()
    counts = environ.get(SLURM_TASKS_PER_NODE, "").strip()
    if not nodelist or not counts:
        return None
    where = f"the Slurm allocation ({SLURM_NODELIST}={nodelist})"
    found = parse_host_list(nodelist, where)
    per_node = parse_tasks_per_node(counts, found, SLURM_TASKS_PER_NODE)
    filled = list(itertools.accumulate(per_node))[:-1]  # all nodes: no spare
    if num_instances not in filled:
        return None
    need = filled.index(num_instances) + 1
    hosts = tuple(replace(h, slots=n) for h, n in zip(found, per_node))
    return hosts[:need], hosts[need:], (
        f"{where} with {SLURM_TASKS_PER_NODE}={counts} (--num-instances={num_instances} "
        f"fills its first {need} node(s); the other {len(found) - need} stand by)")


def read_host_file(path: str, source: str) -> str:
    """A host file's text: a regular file, at most MAX_HOST_FILE bytes, UTF-8."""
    from poprun.plan.files import read_small_file

    return read_small_file(path, source, MAX_HOST_FILE, "a host file")


def parse_tasks_per_node(text: str, hosts: tuple[Host, ...], source: str) -> tuple[int, ...]:
    """Slurm's `2(x3),1` -> (2, 2, 2, 1), one count per host of the node list."""
    counts: list[int] = []
    for piece in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if not match or int(match.group(1)) < 1:
            raise ConfigError(f"{source}={text!r}: {piece!r} is not a count like 2 or 2(x3)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != len(hosts):
        raise ConfigError(f"{source}={text!r} gives {len(counts)} count(s) for "
                          f"{len(hosts)} node(s)")
    return tuple(counts)


def instance_counts(hosts: tuple[Host, ...], num_instances: int | None,
                    source: str = "--host", per_host: int | None = None) -> tuple[int, ...]:
    """How many instances each host runs, in host order: `per_host` on every host when
    mpirun's --npernode gives it (it overrides slots, as in Open MPI), else its slots where
    the list gives any (1 where a host has none, as mpirun), else an even share.
    `num_instances` None: the slots' total. Raises ConfigError when they disagree."""
    if per_host is not None:
        return _per_host_counts(hosts, num_instances, source, per_host)
    if not hosts:
        return (num_instances or 1,)
    if any(h.slots for h in hosts):
        counts = tuple(h.slots or 1 for h in hosts)
        if num_instances is not None and num_instances != sum(counts):
            raise ConfigError(f"--num-instances={num_instances} does not match the "
                              f"{sum(counts)} slots of {source} "
                              f"({' + '.join(f'{h}:{n}' for h, n in zip(hosts, counts))})")
        return counts
    total = num_instances or len(hosts)
    if total % len(hosts):
        raise ConfigError(f"--num-instances={total} is not divisible by the {len(hosts)} hosts "
                          f"of {source}: give each host its count (h1:3,h2:1)")
    return (total // len(hosts),) * len(hosts)


def _per_host_counts(hosts: tuple[Host, ...], num_instances: int | None, source: str,
                     per_host: int) -> tuple[int, ...]:
    counts = (per_host,) * max(len(hosts), 1)  # no hosts: this host alone
    if num_instances is not None and num_instances != sum(counts):
        where = f"the {len(hosts)} host(s) of {source}" if hosts else "this host"
        raise ConfigError(f"--num-instances={num_instances} does not match mpirun's "
                          f"--npernode {per_host} on {where} ({sum(counts)} instances)")
    return counts


def counted_instances(hosts: tuple[Host, ...], source: str, environ: Mapping[str, str], *,
                      listed: bool, per_host: int | None = None
                      ) -> tuple[int | None, str | None]:
    """--num-instances when it is not given, and where it was counted from (for messages):
    mpirun's --npernode on every host, the hosts' slots (`h1:4,h2:2`, an MPI hostfile,
    SLURM_TASKS_PER_NODE), or for hosts not `listed` on the command line SLURM_NTASKS;
    (None, None) when nothing counts them."""
    if per_host is not None:
        return sum(instance_counts(hosts, None, source, per_host)), f"--npernode {per_host}"
    if any(h.slots for h in hosts):
        return sum(instance_counts(hosts, None, source)), f"the slots of {source}"
    tasks = environ.get(SLURM_NTASKS, "")
    if not listed and tasks.isdigit():
        return int(tasks), f"{SLURM_NTASKS}={tasks}"
    return None, None


def is_local(host: Host, this_host: str) -> bool:
    """Whether `host` names this machine, so its instances start without SSH (as mpirun
    does). Only names count, not addresses: `127.0.0.2` may well be an sshd in a test."""
    if host.user or host.port:
        return False
    short = this_host.split(".", 1)[0]
    return host.name in LOCAL_NAMES or host.name in (this_host, short)


def parse_host_list(text: str, source: str = "--host") -> tuple[Host, ...]:
    """Parse a comma-separated host list with bracket ranges; duplicates are an error."""
    hosts: list[Host] = []
    for item in _split_top_level(text, source):
        expanded = [item] if re.match(_IPV6, item) else expand_brackets(item, source)
        hosts += [_parse_host(name, source) for name in expanded]
    return _unique(hosts, source)


SPARE_WORD = "spare"  # a host file's line `node9 spare`: a spare host (--spare-hosts)


def parse_host_file(content: str, source: str, spares: bool = False) -> tuple[Host, ...]:
    """One host (or host list) per line; `#` starts a comment; blank lines are skipped. MPI
    hostfiles too: `node1 slots=4 max_slots=8` (max_slots is ignored). A line with the word
    `spare` names spare hosts: they are left out, or with `spares`, the only ones given."""
    hosts: list[Host] = []
    standby: list[Host] = []
    for number, line in enumerate(content.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        entry, options = words[0], words[1:]
        slots, spare = None, False
        for option in options:
            key, eq, value = option.partition("=")
            if key in ("slots", "slot") and eq and value.isdigit() and int(value) > 0:
                slots = int(value)
            elif option == SPARE_WORD:
                spare = True
            elif key != "max_slots" or not eq:
                raise ConfigError(f"{source}, line {number}: {option!r} is not slots=N, "
                                  f"max_slots=N or {SPARE_WORD}")
        listed = parse_host_list(entry, f"{source}, line {number}")
        listed = [replace(h, slots=slots) for h in listed] if slots else listed
        (standby if spare else hosts).extend(listed)
    if spares:
        return _unique(standby, source)
    if not hosts:
        raise ConfigError(f"{source}: no hosts in the file" + (
            " (only spares)" if standby else ""))
    _unique(hosts + standby, source)  # a host both in the job and a spare
    return _unique(hosts, source)


def expand_brackets(item: str, source: str = "--host") -> list[str]:
    """`node[01-03,7]` -> node01 node02 node03 node7 (zero padding of each bound kept)."""
    parts = re.split(r"(\[[^\]]*\])", item)
    choices: list[list[str]] = []
    for part in parts:
        if part.startswith("["):
            choices.append(_expand_range_list(part[1:-1], item, source))
        elif "[" in part or "]" in part:
            raise ConfigError(f"{source}: unbalanced brackets in {item!r}")
        else:
            choices.append([part])
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_range_list(body: str, item: str, source: str) -> list[str]:
    out: list[str] = []
    for piece in body.split(","):
        match = re.match(_RANGE, piece.strip())
        if not match:
            raise ConfigError(f"{source}: {piece!r} in {item!r} is not a number or a range a-b")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ConfigError(f"{source}: range {piece!r} in {item!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return out


def _split_top_level(text: str, source: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ConfigError(f"{source}: unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    stripped = [i.strip() for i in items]
    if any(not i for i in stripped):
        raise ConfigError(f"{source}: empty host name in {text!r}")
    return stripped


def _parse_host(text: str, source: str) -> Host:
    """`[user@]host[:slots]`, `[user@][v6addr][:slots]`, or `ssh://[user@]host[:port]`."""
    ssh = text.startswith("ssh://")
    user, _, rest = text[6 if ssh else 0:].rpartition("@")
    number = None
    if rest.startswith("["):  # [::1]:4 style
        name, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            number = tail[1:]
    elif rest.count(":") == 1:
        name, number = rest.split(":")
    else:
        name = rest
    if not name or any(c.isspace() for c in name):
        raise ConfigError(f"{source}: {text!r} is not a host name")
    if ssh:
        port = _number(number, text, source, "port", 65535) if number is not None else None
        return Host(name=name, user=user or None, port=port)
    slots = _number(number, text, source, "number of slots", None) if number else None
    if slots is not None and slots >= SLOTS_PORT_FLOOR:
        raise ConfigError(f"{source}: {text!r}: `host:N` gives the host N slots (instances); "
                          f"for an SSH port write ssh://{text} or set Port in ~/.ssh/config")
    return Host(name=name, user=user or None, slots=slots)


def _number(text: str | None, item: str, source: str, what: str, top: int | None) -> int:
    if not text or not text.isdigit() or int(text) < 1 or (top and int(text) > top):
        raise ConfigError(f"{source}: {text!r} in {item!r} is not a {what}")
    return int(text)


def _unique(hosts: list[Host], source: str) -> tuple[Host, ...]:
    seen: set[Host] = set()
    for host in hosts:
        if host in seen:
            raise ConfigError(f"{source}: host {host} is listed twice")
        seen.add(host)
    return tuple(hosts)
