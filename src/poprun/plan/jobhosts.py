"""Where a job runs: its hosts in instance order, which need a connection, how many instances
each runs, over which transport. Pure but for this host's name (socket.gethostname)."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace

from spawner import fdlimit
from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError
from poprun.plan.config import LaunchConfig
from poprun.plan.hosts import (SLURM_JOB_ID, Host, instance_counts, is_local,
                               job_hosts_and_source, nodes_beyond_need, spare_nodes)
from poprun.plan.planner import LOCALHOST
from poprun.plan.pods import SECRET_FD_VARIABLE, SECRET_VARIABLE, Pod, contract_in, read_pod


@dataclass(frozen=True)
class JobHosts:
    """Where a job runs: host labels in instance order, which of them need SSH, how many
    instances each runs, and where the list came from (for messages)."""

    hosts: tuple[Host, ...]  # empty: this host only
    remote: frozenset[str]
    counts: tuple[int, ...]
    source: str = "--host"
    transport: str = "ssh"  # how remote hosts are reached: "ssh", "slurm" or "pod"
    spares: tuple[Host, ...] = ()  # standing by, each remote: `substituted` puts them in
    pod: Pod | None = None  # in pod mode, this (leading) pod's place: plan/pods.py

    @classmethod
    def of(cls, config: LaunchConfig, environ: Mapping[str, str]) -> JobHosts:
        transport = transport_of(config, environ)
        if transport == "pod":
            return cls._pods(config, read_pod(environ))
        explicit = config.given is None or "num_instances" in config.given
        hosts, source = job_hosts_and_source(config.host_list, environ,
                                             config.num_instances if explicit else None)
        hosts, standby = spare_nodes(hosts, config.spare_nodes, source)
        beyond = beyond_need(config, environ) if explicit else None
        if beyond is not None:
            hosts, standby, source = beyond
        if transport == "slurm" and not environ.get(SLURM_JOB_ID):
            raise ConfigError("--launcher slurm runs inside a Slurm allocation: start poprun "
                              "with `salloc -N <nodes> poprun ...` or from an `sbatch` script "
                              "(or use --launcher ssh)")
        this = socket.gethostname()
        # Over Slurm every node's instances start as a job step, this node's too.
        remote = frozenset(str(h) for h in hosts if transport == "slurm"
                           or not is_local(h, this))
        counts = instance_counts(hosts, config.num_instances, source, config.mpi.npernode)
        spares = config.spare_list or standby
        local = [str(h) for h in spares if transport != "slurm" and is_local(h, this)]
        if local:  # a spare runs what a remote host ran: through its own agent
            raise ConfigError(f"--spare-hosts: {', '.join(local)} is this host: a spare is "
                              "a remote host")
        if spares and not remote:
            raise ConfigError("--spare-hosts: the job runs on this host only: a spare "
                              "replaces a remote host (give --host)")
        return cls(hosts, remote, counts, source, transport, spares)

    def substituted(self, replaced: Mapping[str, Host]) -> JobHosts:
        """The hosts with each of `replaced` (label -> spare) in the place of the host it
        replaces: the same position, so the same instance indices and count, and placement
        (plan/planner.py plans by position and count); the spares left are the others."""
        hosts = tuple(replaced.get(str(h), h) for h in self.hosts)
        used = {str(h) for h in replaced.values()}
        remote = (self.remote - replaced.keys()) | used
        return replace(self, hosts=hosts, remote=frozenset(remote),
                       spares=tuple(h for h in self.spares if str(h) not in used))

    @classmethod
    def _pods(cls, config: LaunchConfig, pod: Pod) -> JobHosts:
        """Pod 0's view: every pod a host, itself local, divided among as hosts are; with
        --spare-nodes K, the last K pods stand by (docs/kubernetes.md, "Spare pods")."""
        if config.host_list:
            raise ConfigError("--launcher pod takes its hosts from the pod contract: "
                              "--host cannot be given with it")
        if config.spare_list:
            raise ConfigError("--spare-hosts: in pod mode the spares are pods of the job: "
                              "give --spare-nodes K (its last K pods stand by)")
        source = f"the pods ({pod.contract})"
        hosts, spares = spare_nodes(tuple(Host(label) for label in pod.labels),
                                    config.spare_nodes, source)
        if spares and len(hosts) < 2:  # a spare takes a follower's place, never pod 0's
            raise ConfigError(f"--spare-nodes {config.spare_nodes}: {source} has "
                              f"{pod.count} pod(s): a spare pod replaces a follower, and "
                              "this leaves none (pod 0 leads, it is never replaced)")
        counts = instance_counts(hosts, config.num_instances, source, config.mpi.npernode)
        remote = frozenset(str(h) for h in hosts[1:])
        return cls(hosts, remote, counts, source, "pod", spares, pod=pod)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(str(h) for h in self.hosts) or (LOCALHOST,)

    def count(self, label: str) -> int:
        """Instances on the host labelled `label`."""
        return self.counts[self.labels.index(label)]

    def describe(self) -> str:
        """`h1 (4), h2 (2) from --host, over ssh; spare hosts: h3`, for -v."""
        listed = ", ".join(f"{label} ({n})" for label, n in zip(self.labels, self.counts))
        over = f", over {self.transport}" if self.remote else ""
        spares = f"; spare hosts: {', '.join(map(str, self.spares))}" if self.spares else ""
        return f"{listed} from {self.source}{over}{spares}"

    def open_files_here(self, output_files: bool) -> int:
        """Descriptors the launcher holds at once for this job (spawner/fdlimit.py): a
        connection per remote host, each local instance's, with `output_files` every
        instance's files."""
        return fdlimit.launcher_need(len(self.remote), self.local_instances,
                                     sum(self.counts) if output_files else 0)

    @property
    def local_instances(self) -> int:
        return sum(n for label, n in zip(self.labels, self.counts) if label not in self.remote)

    @property
    def any_local(self) -> bool:
        return len(self.remote) < len(self.labels)

    @property
    def first_is_local(self) -> bool:
        return self.labels[0] not in self.remote


def leave_out(hosts: JobHosts, quarantined: Mapping[str, str]) -> tuple[JobHosts, list[str]]:
    """`hosts` without those `quarantined` (label -> why, said as is): a spare among them
    dropped; a job host's instances given to a spare (its position, so its instances); the
    warnings to say. ConfigError when a job host has no spare left to take its place."""
    spares = tuple(h for h in hosts.spares if str(h) not in quarantined)
    warnings = [f"spare host {h} left out: quarantined ({quarantined[str(h)]})"
                for h in hosts.spares if str(h) not in {str(s) for s in spares}]
    out = [label for label in hosts.labels if label in quarantined]
    pairs = pair_spares(out, [str(h) for h in spares])
    missing = [label for label in out if label not in pairs]
    if missing:
        label = missing[0]
        raise ConfigError(
            f"{label} is quarantined ({quarantined[label]}) and no spare host is left to run "
            f"its instances: give one (--spare-hosts), run without {label}, or let it back "
            f"(poprunctl hosts --release {' '.join(missing)})")
    by_label = {str(h): h for h in spares}
    warnings += [f"{old} left out: quarantined ({quarantined[old]}); spare host {new} runs "
                 "its instances" for old, new in pairs.items()]
    return replace(hosts, spares=spares).substituted({old: by_label[new] for old, new in pairs.items()}), warnings


def pair_spares(failed: Sequence[str], available: Sequence[str]) -> dict[str, str]:
    """Which spare takes each failed host's place: in host order, the first available
    spares in theirs (the user's order is their preference). Failed hosts beyond the
    spares are left out: the caller ends the job on them."""
    return dict(zip(failed, available))


def beyond_need(config: LaunchConfig, environ: Mapping[str, str]
                ) -> tuple[tuple[Host, ...], tuple[Host, ...], str] | None:
    """Under Slurm, the allocation's nodes beyond those the job's --num-instances fill stand
    by as spares without --spare-nodes (plan/hosts.py, nodes_beyond_need): where a spare could
    be used (--max-restarts) and the user named no hosts, spares or spare count of their own
    (`--spare-nodes 0` keeps every node in the job, as before)."""
    if (not config.max_restarts or config.host_list or config.spare_list
            or config.given is None or "spare_nodes" in config.given  # None: all given
            or config.mpi.npernode is not None
            or not environ.get(SLURM_JOB_ID)):
        return None
    return nodes_beyond_need(environ, config.num_instances)


def transport_of(config: LaunchConfig, environ: Mapping[str, str]) -> str:
    """--launcher, or where it is not given: slurm inside an allocation, pod where a pod
    contract is in the environment (and a secret for it: else each pod runs a job of its
    own, as without pod mode; main says so), else ssh. --host given means ssh."""
    if config.launcher:
        return config.launcher
    if config.host_list:
        return "ssh"
    if environ.get(SLURM_JOB_ID):
        return "slurm"
    if contract_in(environ) and has_pod_secret(config, environ):
        return "pod"
    return "ssh"


def has_pod_secret(config: LaunchConfig, environ: Mapping[str, str]) -> bool:
    return bool(config.pod_secret_file or environ.get(SECRET_VARIABLE)
                or environ.get(SECRET_FD_VARIABLE))
