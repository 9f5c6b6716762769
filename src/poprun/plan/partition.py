"""The V-IPU partition as planning sees it, pure: the job's settings and requirements, the
command that creates its partition, which server and partition the options and environment
name, the device an instance attaches to, and the variables an instance gets. A launch
(run/vipu.py, which talks to `vipu`) and `--dry-run` (which does not) use these same
definitions; what only `vipu` can tell (the server of the local vipu configuration, the only
partition listed, the partition's size and GCDs) the dry run shows as known at launch.
"""

from __future__ import annotations

from collections.abc import Mapping

from popdist import devices
from popdist import env as E
from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError
from poprun.plan.poplar import TOPOLOGIES, link_options, merged_target_options, parse_options
from poprun.text import at_launch

DEFAULT_PORT = 8090
# Seconds. The 2.2 guide's table says 10; later PopRun passes IPUOF_VIPU_API_TIMEOUT=120 when
# not told otherwise (seen in its -vv log), and creating a large partition can take a while.
DEFAULT_TIMEOUT = 120
DEFAULT_POLL_INTERVAL = 1.0


# --- settings and requirements ------------------------------------------------------------

@dataclass(frozen=True)
class VipuSettings:
    """The V-IPU options of one launch (guide §2.8). None means "not given": the lifecycle then
    falls back to the environment, the local vipu configuration, or the server's own choice."""

    server_host: str | None = None
    server_port: int | None = None
    server_timeout: float = DEFAULT_TIMEOUT
    partition: str | None = None
    allocation: str | None = None
    cluster: str | None = None  # the deprecated --vipu-cluster: used when no allocation
    update_partition: bool = False
    reset_partition: bool | None = None  # None: reset non-reconfigurable partitions only
    remove_partition: bool = True
    sync_type: str | None = None
    ipu_link_routing_type: str | None = None
    gw_link_routing_type: str | None = None
    partition_attempts: int | None = None  # None: poll until the timeout
    poll_interval: float = DEFAULT_POLL_INTERVAL

    def __post_init__(self) -> None:
        if not self.server_timeout > 0:
            raise ConfigError(f"--vipu-server-timeout must be positive, got {self.server_timeout}")
        if self.server_port is not None:
            _check_port(self.server_port, "--vipu-server-port")
        if self.partition_attempts is not None and self.partition_attempts < 1:
            raise ConfigError("--vipu-partition-attempts must be at least 1, got "
                              f"{self.partition_attempts}")

    @classmethod
    def from_config(cls, config: object) -> VipuSettings:
        """From anything with LaunchConfig's V-IPU field names (vipu_server_host, ...)."""
        timeout = getattr(config, "vipu_server_timeout", None)
        return cls(
            server_host=getattr(config, "vipu_server_host", None),
            server_port=getattr(config, "vipu_server_port", None),
            server_timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
            partition=getattr(config, "vipu_partition", None),
            allocation=getattr(config, "vipu_allocation", None),
            cluster=getattr(config, "vipu_cluster", None),
            update_partition=getattr(config, "update_partition", False),
            reset_partition=getattr(config, "reset_partition", None),
            remove_partition=getattr(config, "remove_partition", True),
            sync_type=getattr(config, "sync_type", None),
            ipu_link_routing_type=getattr(config, "ipu_link_routing_type", None),
            gw_link_routing_type=getattr(config, "gw_link_routing_type", None),
            partition_attempts=getattr(config, "vipu_partition_attempts", None),
        )

    @property
    def allocation_or_cluster(self) -> str | None:
        return self.allocation or self.cluster


@dataclass(frozen=True)
class Requirements:
    """What the job needs of its partition. None: not asked for, so neither checked nor
    passed to `vipu create partition` (the server decides)."""

    size: int
    num_gcds: int
    num_ilds: int | None = None
    sync_type: str | None = None
    ipu_link_routing_type: str | None = None
    gw_link_routing_type: str | None = None

    @classmethod
    def of(cls, num_replicas: int, ipus_per_replica: int, num_instances: int,
           num_ilds: int | None = None, settings: VipuSettings | None = None) -> Requirements:
        """Size = replicas x IPUs per replica. One GCD per instance: each instance attaches to
        a device of its own (guide §2.1 "each instance can run on a separate GCD"; §2.8.3:
        32 replicas over 2 instances need a 32-IPU partition of 2 GCDs, 16 IPUs each)."""
        size = num_replicas * ipus_per_replica
        if num_instances < 1 or size % num_instances:
            raise ConfigError(f"{size} IPUs cannot be divided evenly among {num_instances} "
                              "instances (one GCD each)")
        settings = settings or VipuSettings()
        return cls(size=size, num_gcds=num_instances, num_ilds=num_ilds,
                   sync_type=settings.sync_type,
                   ipu_link_routing_type=settings.ipu_link_routing_type,
                   gw_link_routing_type=settings.gw_link_routing_type)

    @classmethod
    def of_config(cls, config: object, settings: VipuSettings) -> Requirements:
        """From a LaunchConfig: its replicas, IPUs per replica, instances and (when more than
        one) ILDs."""
        ilds = config.num_ilds if config.num_ilds > 1 else None
        return cls.of(config.num_replicas, config.ipus_per_replica, config.num_instances,
                      ilds, settings)

    @property
    def ipus_per_instance(self) -> int:
        return self.size // self.num_gcds


def create_command(name: str, required: Requirements, settings: VipuSettings) -> list[str]:
    """`vipu create partition ...` for the job, never `--reconfigurable` (guide §2.8.3)."""
    argv = ["create", "partition", name]
    if settings.allocation:
        argv += ["--allocation", settings.allocation]
    elif settings.cluster:
        argv += ["--cluster", settings.cluster]
    argv += ["--size", str(required.size), "--num-gcds", str(required.num_gcds)]
    optional = (("--num-ilds", required.num_ilds), ("--sync-type", required.sync_type),
                ("--routing", required.ipu_link_routing_type),
                ("--gw-routing", required.gw_link_routing_type))
    for flag, value in optional:
        if value is not None:
            argv += [flag, str(value)]
    return argv


def should_reset(reset_partition: bool | None, reconfigurable: bool | None) -> bool:
    """Guide §2.8.3: unset means non-reconfigurable partitions are reset, reconfigurable ones
    not. (A partition poprun has just created is never reset; the caller knows that.)"""
    if reset_partition is not None:
        return reset_partition
    return not reconfigurable


# --- what the options and the environment name ----------------------------------------------

def named_server(settings: VipuSettings,
                 environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    """(host, port) as far as the options and the environment say: host --vipu-server-host >
    IPUOF_VIPU_API_HOST, port --vipu-server-port > IPUOF_VIPU_API_PORT; None: the local vipu
    configuration decides (`vipu --server-version`), and 8090 is the port of a host named
    without one."""
    port = settings.server_port or _environ_port(environ)
    host = settings.server_host or environ.get(E.VIPU_API_HOST, "").strip() or None
    if host is not None and port is None:
        port = DEFAULT_PORT
    return host, port


def _environ_port(environ: Mapping[str, str]) -> int | None:
    text = environ.get(E.VIPU_API_PORT, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(f"{E.VIPU_API_PORT}={text!r} is not a port number")
    return _check_port(int(text), E.VIPU_API_PORT)


def named_partition(settings: VipuSettings, environ: Mapping[str, str]) -> str | None:
    """--vipu-partition > IPUOF_VIPU_API_PARTITION_ID; None: the only partition listed."""
    return settings.partition or environ.get(E.VIPU_API_PARTITION_ID, "").strip() or None


def _check_port(port: int, source: str) -> int:
    if not 0 < port < 65536:
        raise ConfigError(f"{source}={port} is not a port number (1-65535)")
    return port


def seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# --- what an instance gets ------------------------------------------------------------------

def node_device(size: int | None, num_gcds: int, job_ipus: int | None = None) -> int | None:
    """The Poplar device every instance is given as its node device: the one spanning the
    IPUs the job uses of what an instance sees (the partition, or its GCD when each instance
    has one), the first such when the partition is larger than the job. PopRun 3.1.0 on a
    reconfigurable 64-IPU partition attaches to 0, 64, 96, 112, 120 for jobs of 1, 2, 4, 8,
    16 IPUs (popdist/devices.py gives the source). `job_ipus` None: the whole partition. None
    when the size is unknown, or the IPUs form no Poplar device."""
    if not size or size % num_gcds or (job_ipus or size) % num_gcds:
        return None
    try:
        return devices.device_id(size // num_gcds, (job_ipus or size) // num_gcds, 0)
    except ValueError:
        return None


@dataclass(frozen=True)
class Attachment:
    """How instances find their IPUs on a partition, from its own description (whether it is
    reconfigurable), as real PopRun sets them:

    - a reconfigurable partition, which Poplar splits into devices of every size: every
      instance is given the device spanning the job's IPUs (`node`, POPDIST_NODE_DEVICE_ID:
      PopRun 3.1.0 on ALCF's p64), and its GCD only where there are several;
    - any other (what poprun creates, guide §2.8.3, and one the server does not call
      reconfigurable): instance i drives GCD i, named even when it is the only one, and no
      node device (an SDK 3.3 log on a 64-IPU partition: IPUOF_VIPU_API_GCD_ID=0 and no
      POPDIST_NODE_DEVICE_ID); popdist's device is then the instance's whole GCD. Where
      the description does not say how many GCDs there are, the node device, which needs
      no GCD, is given instead.
    """

    every_gcd: bool  # every instance gets its GCD id, even on a one-GCD partition
    node: int | None  # the node device every instance gets, if any

    @classmethod
    def of(cls, size: int | None, num_gcds: int | None, job_ipus: int | None,
           reconfigurable: bool | None) -> Attachment:
        if reconfigurable or num_gcds is None:
            return cls(every_gcd=False, node=node_device(size, num_gcds or 1, job_ipus))
        return cls(every_gcd=True, node=None)


def link_topology(reported: str | None, reconfigurable: bool | None) -> str | None:
    """The `ipuLinkTopology` of a partition: the one its description reports; else a mesh for
    a reconfigurable one (PopRun 3.1.0 on ALCF's reconfigurable 64-IPU partition set "mesh"
    in all 31 instance blocks of five published logs, "Target options from V-IPU
    partition"), else None: by the IPU-Link domain's size (plan/poplar.py: a torus above 4
    IPUs, as an SDK 3.3 log on another 64-IPU partition says)."""
    if reported and reported.lower() in TOPOLOGIES:
        return reported.lower()
    return "mesh" if reconfigurable else None


def instance_environment(index: int, *, host: str, port: int | str, name: str,
                         timeout: float, target_options: str, num_gcds: int,
                         attachment: Attachment) -> dict[str, str]:
    """The variables instance `index` gets from its partition (guide §2.8.2): the server,
    the partition, the timeout, the target options; instance i drives GCD i (named as
    `attachment` says); the node device when there is one."""
    env = {
        E.VIPU_API_HOST: host,
        E.VIPU_API_PORT: str(port),
        E.VIPU_API_PARTITION_ID: name,
        E.VIPU_API_TIMEOUT: seconds(timeout),
        E.POPLAR_TARGET_OPTIONS: target_options,
    }
    if num_gcds > 1 or attachment.every_gcd:
        if not 0 <= index < num_gcds:
            raise ValueError(f"instance {index} has no GCD in partition {name} ({num_gcds} "
                             "GCDs)")
        env[E.VIPU_API_GCD_ID] = str(index)
    if attachment.node is not None:
        env[E.NODE_DEVICE_ID] = str(attachment.node)
    return env


# --- the dry run's view ---------------------------------------------------------------------

def implied_target_options(size: int, num_ilds: int | None, required: Requirements,
                           topology: str | None = None) -> dict[str, str]:
    """The target options a partition of `size` IPUs implies (values as PopRun logs them,
    run/vipu.py's docstring): gateway mode always (the IPUs are reached through V-IPU), the
    IPU-Link domain's size and shape (`topology`: the partition's own, `link_topology`), and
    the instance size: the partition's IPUs per instance, which on a partition larger than
    the job is more than the instance's own (PopRun 3.1.0 on a 64-IPU partition:
    "instanceSize" 64, 32, 16, 8, 4 for 1, 2, 4, 8, 16 one-IPU instances; CosmicTagger's
    logs, popdist/devices.py)."""
    return link_options(size // (num_ilds or 1), size // required.num_gcds, gateway=True,
                        topology=topology)


@dataclass(frozen=True)
class PartitionStep:
    """What a launch will do about its partition, as far as it is known without `vipu`:
    the values only the server can give are stand-ins (`text.at_launch`)."""

    name: str
    host: str
    port: str
    required: Requirements
    create: tuple[str, ...]  # the `vipu` argv that creates it when it is missing
    reset: str  # "yes", "no", or "when not reconfigurable"
    update: bool  # re-created when it exists and does not fit
    remove: bool  # removed at the end when poprun created it
    timeout: float
    target_options: str  # what a partition of exactly the job's shape gives

    @property
    def server(self) -> str:
        return self.host if self.host.startswith("<") else f"{self.host}:{self.port}"

    def to_json(self) -> dict:
        return {"name": self.name, "server": self.server, "size": self.required.size,
                "num_gcds": self.required.num_gcds, "create": ["vipu", *self.create],
                "reset": self.reset, "update": self.update, "remove": self.remove}

    def lines(self) -> list[str]:
        import shlex

        gcds = self.required.num_gcds
        return [
            f"V-IPU partition {self.name} ({self.required.size} IPUs, {gcds} "
            f"GCD{'s' if gcds > 1 else ''}) on the server {self.server}:",
            "  used when it exists and fits (a reconfigurable one may be larger: the job "
            "then runs on the device of its first IPUs); "
            + ("else re-created" if self.update else "else an error (--update-partition)"),
            f"  created when missing: {shlex.join(['vipu', *self.create])}",
            f"  reset before the job: {self.reset}",
            "  removed at the end when poprun created it: "
            + ("yes" if self.remove else "no (--remove-partition=no)"),
        ]

    def environment(self, index: int) -> dict[str, str]:
        """Instance `index`'s variables, as `instance_environment` gives them on a partition
        of exactly the job's shape (what poprun creates: not reconfigurable); those that
        depend on the partition found are marked as known at launch."""
        size, gcds = self.required.size, self.required.num_gcds
        env = instance_environment(
            index, host=self.host, port=self.port, name=self.name, timeout=self.timeout,
            target_options=self.target_options, num_gcds=gcds,
            attachment=Attachment.of(size, gcds, size, reconfigurable=False))
        shape = f"{size} IPUs, {gcds} GCD{'s' if gcds > 1 else ''}"
        for variable in (E.VIPU_API_GCD_ID, E.NODE_DEVICE_ID, E.POPLAR_TARGET_OPTIONS):
            if variable in env:
                env[variable] = at_launch(f"{env[variable]} on a partition of {shape}")
        return env


def partition_step(settings: VipuSettings, required: Requirements,
                   environ: Mapping[str, str]) -> PartitionStep:
    """The dry run's view of the partition step (run/vipu.py's `acquire` does it)."""
    host, port = named_server(settings, environ)
    name = named_partition(settings, environ) or at_launch("the only partition listed")
    reset = {True: "yes", False: "no", None: "when not reconfigurable"}[settings.reset_partition]
    own = parse_options(environ.get(E.POPLAR_TARGET_OPTIONS), E.POPLAR_TARGET_OPTIONS)
    implied = implied_target_options(required.size, required.num_ilds, required)
    return PartitionStep(
        name=name,
        host=host or at_launch("the server of the local vipu configuration"),
        port=str(port) if port is not None else at_launch(
            f"the port of the local vipu configuration, else {DEFAULT_PORT}"),
        required=required, create=tuple(create_command(name, required, settings)),
        reset=reset, update=settings.update_partition, remove=settings.remove_partition,
        timeout=settings.server_timeout,
        target_options=merged_target_options(implied, own))
