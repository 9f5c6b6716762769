"""Pure planning: which instance runs where, with which replicas, environment and argv.

Nothing here touches the file system, the network or a process: every fact from the outside
(the launcher's environment, the hosts, the port picked for torch.distributed, the cache
directories) comes in as an argument, so `--dry-run` and the tests see exactly what a launch uses.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from dataclasses import asdict, field

from popdist import env as E
from spawner import uncompiled

from poprun.plan.config import LaunchConfig
from poprun.plan.network import interface_variables
from poprun.errors import ConfigError
from poprun.plan.placement import Binding, Strategy, place, resolve_strategy, strategy_from_mpi
from poprun.plan.poplar import check_autoreport, offline_target, target_options
from poprun.plan.topology import Topology

if TYPE_CHECKING:  # an offline launch never needs the partition's module
    from poprun.plan.partition import PartitionStep

LOCALHOST = "localhost"


class CacheMode(str, enum.Enum):
    """Which executable cache the instances use (guide §2.3, §2.4)."""

    NONE = "none"
    """No cache: one instance and no path given, or caching disabled with an empty path."""
    EXPLICIT = "explicit"
    """The user's --executable-cache-path: created when missing, kept afterwards."""
    TEMPORARY = "temporary"
    """A temporary directory on each host, shared by its instances, removed on every exit."""
    FRAMEWORK = "framework"
    """A framework cache variable (e.g. POPTORCH_CACHE_DIR) is set; poprun stays out of it."""


@uncompiled.dataclass(frozen=True)
class InstancePlan:
    """One instance: where it runs, what it controls and exactly how it is started."""

    index: int
    host: str
    local_index: int
    replicas: tuple[int, ...]
    ild: int
    env: Mapping[str, str]  # what poprun adds to (or overrides in) the launcher's environment
    argv: tuple[str, ...]
    cpus: tuple[int, ...] | None = None
    mems: tuple[int, ...] | None = None

    def __init__(self, index, host, local_index, replicas, ild, env, argv, cpus=None,
                 mems=None):  # by hand: one per instance (spawner/uncompiled.py)
        self.__dict__.update(index=index, host=host, local_index=local_index,
                             replicas=replicas, ild=ild, env=env, argv=argv, cpus=cpus,
                             mems=mems)


@uncompiled.dataclass(frozen=True)  # one per launch
class LaunchPlan:
    """The whole job, ready to start."""

    instances: tuple[InstancePlan, ...]
    hosts: tuple[str, ...]
    num_ilds: int
    cache_mode: CacheMode
    unset_env: tuple[str, ...] = (E.IPUOF_CONFIG_PATH,)
    warnings: tuple[str, ...] = field(default=())
    # What the launch will do about its V-IPU partition, as a dry run sees it (None: offline,
    # or a launch's plan, made once the partition is there).
    partition: PartitionStep | None = None
    # Hosts standing by to take a lost host's instances (--spare-hosts): none run here.
    spares: tuple[str, ...] = ()

    def on_host(self, host: str) -> list[InstancePlan]:
        return [i for i in self.instances if i.host == host]

    def to_json(self) -> dict:
        return {
            "hosts": list(self.hosts),
            "num_ilds": self.num_ilds,
            "cache_mode": self.cache_mode.value,
            "unset_env": list(self.unset_env),
            "warnings": list(self.warnings),
            "partition": None if self.partition is None else self.partition.to_json(),
            "spares": list(self.spares),
            "instances": [
                {k: (list(v) if isinstance(v, tuple) else dict(v) if k == "env" else v)
                 for k, v in asdict(inst).items()}
                for inst in self.instances
            ],
        }


def explicit_cache(config: LaunchConfig, mode: CacheMode) -> str | None:
    """The explicit executable cache's absolute path (the same on every host), if any."""
    if mode is CacheMode.EXPLICIT and config.executable_cache_path:
        return os.path.abspath(config.executable_cache_path)
    return None


def cache_mode(config: LaunchConfig, environ: Mapping[str, str]) -> CacheMode:
    """Decide the executable cache; an explicit path next to a framework variable is an error."""
    framework = framework_cache_setting(environ)
    path = config.executable_cache_path
    if path == "":
        return CacheMode.NONE
    if path is not None:
        # A framework variable naming the very same directory asks for what the option does
        # (balewski/neuron_inverter_benchmark's run-slurm.sh sets both): only another one
        # would split the instances' cache (guide §2.3).
        for setting, directory in _framework_caches(environ):
            if directory is None or os.path.normpath(directory) != os.path.normpath(path):
                raise ConfigError(
                    f"--executable-cache-path={path} conflicts with {setting} in the "
                    "environment: set only one of them (guide §2.3)")
        return CacheMode.EXPLICIT
    if config.num_instances == 1:
        return CacheMode.NONE
    return CacheMode.FRAMEWORK if framework else CacheMode.TEMPORARY


def framework_cache_setting(environ: Mapping[str, str]) -> str | None:
    """`NAME=value` of a framework's own executable-cache setting, if one is in force."""
    settings = _framework_caches(environ)
    return settings[0][0] if settings else None


def _framework_caches(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Each framework cache setting in force (`NAME=value`) and the directory it names
    (None: one we cannot read, such as a flag in another spelling)."""
    found: list[tuple[str, str | None]] = [
        (f"{name}={environ[name]}", environ[name])
        for name in E.FRAMEWORK_CACHE_VARIABLES if environ.get(name)]
    flags = environ.get(E.TF_POPLAR_FLAGS, "")
    if "--executable_cache_path" in flags:
        named = [value for flag, eq, value in (f.partition("=") for f in flags.split())
                 if flag == "--executable_cache_path" and eq]
        found.append((f"{E.TF_POPLAR_FLAGS}={flags}", named[-1] if named else None))
    return found


def plan(
    config: LaunchConfig,
    environ: Mapping[str, str],
    *,
    program: tuple[str, ...],
    master_port: int,
    hosts: tuple[str, ...] = (LOCALHOST,),
    master_addr: str = "127.0.0.1",
    cache_paths: Mapping[str, str] | None = None,
    remote_hosts: frozenset[str] = frozenset(),
    topologies: Mapping[str, Topology] | None = None,
    partition_env: Callable[[int], Mapping[str, str]] | None = None,
    partition_step: PartitionStep | None = None,
    restart_count: int | None = None,
    counts: tuple[int, ...] | None = None,
    rendezvous: tuple[str, int] | None = None,
    interfaces: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Plan the job. `program` is the argv with argv[0] resolved; `cache_paths` maps each host
    to its cache directory when `cache_mode()` is EXPLICIT or TEMPORARY. Instances on
    `remote_hosts` also get the variables forwarded there (docs/architecture.md, "The
    environment contract"). Instances on a host with a known topology are bound as
    `--process-placement` says (None: unknown, unbound). `restart_count`: the attempt, when
    restarts are enabled (instances then see it). `counts`: instances per host, in host order
    (None: the same on every host); instance indices run in contiguous blocks per host.
    `rendezvous`: the address and port of Horovod's Gloo rendezvous (run/worlds/horovod.py).
    `interfaces`: per host, its interface on the network the user chose (plan/network.py),
    named to the collectives' libraries. `partition_step`: a dry run's view of the partition
    (its variables then come from it, unless `partition_env` gives the real ones)."""
    if partition_env is None and partition_step is not None:
        partition_env = partition_step.environment
    mode = cache_mode(config, environ)
    counts = counts or even_counts(config.num_instances, len(hosts))
    if sum(counts) != config.num_instances or len(counts) != len(hosts):
        raise ConfigError(f"--num-instances={config.num_instances} does not match the hosts' "
                          f"instance counts {list(counts)}")
    local_replicas = config.num_replicas // config.num_instances
    replicas_per_ild = config.num_replicas // config.num_ilds
    warnings: list[str] = []
    bindings = {host: host_bindings(config, (topologies or {}).get(host), count, host)
                for host, count in zip(hosts, counts)}
    poplar_env = _poplar_env(config, environ)
    slots = [(host, local, count) for host, count in zip(hosts, counts)
             for local in range(count)]  # instance index -> (host, index there, count there)
    instances = []
    for index, (host, local_index, per_host) in enumerate(slots):
        binding = bindings[host][local_index]
        cache = (cache_paths or {}).get(host) if mode in (CacheMode.EXPLICIT,
                                                          CacheMode.TEMPORARY) else None
        # Horovod's cross rank: the host's place among the hosts with this local index.
        crossing = [h for h, count in zip(hosts, counts) if count > local_index]
        who = E.InstanceIdentity(
            index=index, num_instances=config.num_instances, local_index=local_index,
            local_size=per_host, num_total_replicas=config.num_replicas,
            ipus_per_replica=config.ipus_per_replica, master_addr=master_addr,
            master_port=master_port, executable_cache_path=cache,
            autoreport_dir=config.autoreport_dir, restart_count=restart_count, host=host,
            cross_rank=crossing.index(host), cross_size=len(crossing), rendezvous=rendezvous)
        added = forwarded(environ, config.forward_env) if host in remote_hosts else {}
        added.update(E.instance_environment(who))
        added[E.IPUOF_LOG_LEVEL] = environ.get(E.IPUOF_LOG_LEVEL) or E.DEFAULT_IPUOF_LOG_LEVEL
        added.update(poplar_env)
        if interfaces:
            added.update(interface_variables(
                interfaces[host], environ, (e.partition("=")[0]
                                            for e in config.env_entries(index))))
        if partition_env is not None:  # the V-IPU partition's: server, partition, GCD, target
            added.update(partition_env(index))
        added.update(_user_env(config.env_entries(index), environ, warnings))
        if config.autoreport_dir:
            check_autoreport([environ.get(E.POPLAR_ENGINE_OPTIONS),
                              added.get(E.POPLAR_ENGINE_OPTIONS)])
        first = index * local_replicas
        instances.append(InstancePlan(
            index=index, host=host, local_index=who.local_index,
            replicas=tuple(range(first, first + local_replicas)),
            ild=first // replicas_per_ild, env=added, argv=program,
            cpus=binding.cpus if binding else None,
            mems=(binding.mems or None) if binding else None))
    return LaunchPlan(instances=tuple(instances), hosts=hosts, num_ilds=config.num_ilds,
                      cache_mode=mode, warnings=tuple(dict.fromkeys(warnings)),
                      partition=partition_step)


def even_counts(num_instances: int, num_hosts: int) -> tuple[int, ...]:
    """Instances per host when the host list gives no slots: the same on every host."""
    if num_instances % num_hosts:
        raise ConfigError(f"--num-instances={num_instances} is not divisible by the "
                          f"{num_hosts} hosts: give each host its count (h1:3,h2:1)")
    return (num_instances // num_hosts,) * num_hosts


def host_bindings(config: LaunchConfig, topology: Topology | None, count: int,
                  host: str) -> tuple[Binding | None, ...]:
    """The bindings of one host's `count` instances; all None when its topology is unknown
    or placement is disabled for it."""
    strategy = host_strategy(config, count)
    if topology is None or strategy is Strategy.DISABLED:
        return (None,) * count
    return place(topology, count, strategy, host=host)


def host_strategy(config: LaunchConfig, count: int) -> Strategy:
    """The strategy for a host with `count` instances: --process-placement / --numa-aware, and
    when that is `disabled`, mpirun's --bind-to/--map-by from the mpi-args (guide §2.5)."""
    strategy = resolve_strategy(config.process_placement, config.numa_aware, count)
    if strategy is Strategy.DISABLED:
        return strategy_from_mpi(config.mpi.bind_to, config.mpi.map_by) or strategy
    return strategy


def needs_topology(config: LaunchConfig, instances_on_host: int) -> bool:
    """Whether placement needs the host's topology (reading it costs a few ms of sysfs)."""
    return host_strategy(config, instances_on_host) is not Strategy.DISABLED


def _poplar_env(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What `--offline-target` adds to every instance (guide §2.6)."""
    if not config.offline_target:
        return {}
    ipus_per_instance = config.num_replicas // config.num_instances * config.ipus_per_replica
    return {E.POPLAR_TARGET_OPTIONS: target_options(
        offline_target(config.offline_target), ipus_per_instance,
        environ.get(E.POPLAR_TARGET_OPTIONS))}


def forwarded(environ: Mapping[str, str], mode: str = "default") -> dict[str, str]:
    """What a remote instance inherits from the launcher's environment without `-x`: PATH,
    LD_LIBRARY_PATH, PYTHONPATH, POPLAR_ENGINE_OPTIONS (and SHLVL); with `--forward-env all`,
    everything but the host- and session-specific names (popdist.env.NOT_FORWARDED)."""
    if mode == "all":
        return {name: value for name, value in environ.items() if E.forwarded_by_all(name)}
    return {name: environ[name] for name in E.FORWARDED_TO_REMOTE if name in environ}


_GLOB = frozenset("*?[")


def _user_env(entries: tuple[str, ...], environ: Mapping[str, str],
              warnings: list[str]) -> dict[str, str]:
    """`-x VAR=VALUE` sets; `-x VAR` forwards the launcher's value (it matters on remote
    hosts); `-x 'WANDB_*'` forwards every variable of the launcher's the pattern matches."""
    from fnmatch import fnmatchcase

    out: dict[str, str] = {}
    for entry in entries:
        name, eq, value = entry.partition("=")
        if eq:
            out[name] = value
        elif _GLOB & set(name):
            matched = {k: v for k, v in environ.items() if fnmatchcase(k, name)}
            if not matched:
                warnings.append(f"-x {name}: no variable of poprun's environment matches it")
            out.update(sorted(matched.items()))
        elif name in environ:
            out[name] = environ[name]
        else:
            warnings.append(f"-x {name}: not set in poprun's environment, nothing to forward")
    return out


def remote_env(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What poprun gives a remote instance from the launcher's environment: what it
    forwards (`forwarded()`) and what `-x` sets or forwards (as for instance 0)."""
    return {**forwarded(environ, config.forward_env),
            **_user_env(config.env_entries(0), environ, [])}


def remote_differences(config: LaunchConfig, environ: Mapping[str, str],
                       there: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """For `--check`: the launcher's variables that a remote instance would not see as the
    launcher has them: (missing there, other value there). `there` is what instances on that
    host inherit (its agent's HELLO); what poprun forwards (`forwarded()`, `-x`) is added.
    Names that are host-specific anyway (NOT_FORWARDED) and those poprun sets are left out."""
    seen = {**there, **remote_env(config, environ)}
    missing, different = [], []
    for name in sorted(environ):
        if not E.forwarded_by_all(name) or name in SET_BY_POPRUN:
            continue
        if name not in seen:
            missing.append(name)
        elif seen[name] != environ[name]:
            different.append(name)
    return missing, different


# The names poprun sets on every instance (their values are its own, the same on every host).
SET_BY_POPRUN = frozenset(E.instance_environment(E.InstanceIdentity(
    0, 1, 0, 1, 1, 1, "", 0, "", "", 0, rendezvous=("", 0)))) | {E.IPUOF_LOG_LEVEL}


def instance_environ(base: Mapping[str, str], inst: InstancePlan,
                     launch_plan: LaunchPlan) -> dict[str, str]:
    """The complete environment of a local instance: the launcher's, less the unset names,
    plus what the plan adds."""
    env = {k: v for k, v in base.items() if k not in launch_plan.unset_env}
    env.update(inst.env)
    return env
