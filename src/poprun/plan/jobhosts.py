"""Where a job runs: its hosts in instance order, which need a connection, how many instances
each runs, over which transport. Pure but for this host's name (socket.gethostname)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from spawner import fdlimit
from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError
from poprun.plan.config import LaunchConfig
from poprun.plan.hosts import SLURM_JOB_ID, Host, instance_counts, is_local, job_hosts_and_source
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
    pod: Pod | None = None  # in pod mode, this (leading) pod's place: plan/pods.py

    @classmethod
    def of(cls, config: LaunchConfig, environ: Mapping[str, str]) -> JobHosts:
        transport = transport_of(config, environ)
        if transport == "pod":
            return cls._pods(config, read_pod(environ))
        explicit = config.given is None or "num_instances" in config.given
        hosts, source = job_hosts_and_source(config.host_list, environ,
                                             config.num_instances if explicit else None)
        if transport == "slurm" and not environ.get(SLURM_JOB_ID):
            raise ConfigError("--launcher slurm runs inside a Slurm allocation: start poprun "
                              "with `salloc -N <nodes> poprun ...` or from an `sbatch` script "
                              "(or use --launcher ssh)")
        this = socket.gethostname()
        # Over Slurm every node's instances start as a job step, this node's too.
        remote = frozenset(str(h) for h in hosts if transport == "slurm"
                           or not is_local(h, this))
        counts = instance_counts(hosts, config.num_instances, source, config.mpi.npernode)
        return cls(hosts, remote, counts, source, transport)

    @classmethod
    def _pods(cls, config: LaunchConfig, pod: Pod) -> JobHosts:
        """Pod 0's view: every pod a host, itself local, divided among as hosts are."""
        if config.host_list:
            raise ConfigError("--launcher pod takes its hosts from the pod contract: "
                              "--host cannot be given with it")
        hosts = tuple(Host(label) for label in pod.labels)
        source = f"the pods ({pod.contract})"
        counts = instance_counts(hosts, config.num_instances, source, config.mpi.npernode)
        return cls(hosts, frozenset(pod.labels[1:]), counts, source, "pod", pod)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(str(h) for h in self.hosts) or (LOCALHOST,)

    def count(self, label: str) -> int:
        """Instances on the host labelled `label`."""
        return self.counts[self.labels.index(label)]

    def describe(self) -> str:
        """`h1 (4), h2 (2) from --host, over ssh`, for -v."""
        listed = ", ".join(f"{label} ({n})" for label, n in zip(self.labels, self.counts))
        over = f", over {self.transport}" if self.remote else ""
        return f"{listed} from {self.source}{over}"

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
