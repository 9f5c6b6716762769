"""The environment contract between poprun and its instances.

This module is the one place where the variable names live: the launcher formats them with
`instance_environment`, the instance side (`popdist`) reads them with `read_int`/`read_str`.
Names are Graphcore's (real applications read them directly), plus the ones mpirun used to set
(PopTorch reads them) and the ones torch.distributed reads.
"""

from __future__ import annotations

from collections.abc import Mapping

# --- PopDist (Graphcore) ---------------------------------------------------------------
NUM_TOTAL_REPLICAS = "POPDIST_NUM_TOTAL_REPLICAS"
NUM_IPUS_PER_REPLICA = "POPDIST_NUM_IPUS_PER_REPLICA"
NUM_LOCAL_REPLICAS = "POPDIST_NUM_LOCAL_REPLICAS"
UNIFORM_REPLICAS_PER_INSTANCE = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
REPLICA_INDEX_OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
LOCAL_INSTANCE_INDEX = "POPDIST_LOCAL_INSTANCE_INDEX"
EXECUTABLE_CACHE_PATH = "POPDIST_EXECUTABLE_CACHE_PATH"
AUTOREPORT_DIRECTORY = "POPDIST_AUTOREPORT_DIRECTORY"
# Where an instance writes its uncaught exception (popdist/errorfile.py); set by the spawner
# that starts it (spawner.local), on every host.
ERROR_FILE = "POPDIST_ERROR_FILE"
# Where `import popdist` has the instance dump the Python stacks of its threads when it gets
# STACKS_SIGNAL (popdist/_stacks.py; `poprunctl stacks`, `poprun --stall-timeout`); set by
# the spawner that starts it (spawner.stackdump), on every host. STACKS_SIGNAL is a name
# (`SIGRTMIN+7`, `SIGUSR2`) or a number; set it in poprun's environment to choose another
# (`-x POPDIST_STACKS_SIGNAL` for remote hosts).
STACKS_FILE = "POPDIST_STACKS_FILE"
# Where `popdist.progress(step, total)` keeps the instance's step for poprun to sample
# (popdist/_progress.py: its layout); set by the spawner that starts it (spawner.local), on
# every host. popdist makes the file on the first call.
PROGRESS_FILE = "POPDIST_PROGRESS_FILE"
STACKS_SIGNAL = "POPDIST_STACKS_SIGNAL"
DEFAULT_STACKS_SIGNAL = "SIGRTMIN+7"  # real-time: no program or library we know uses it
# The Poplar device spanning every IPU the instance sees (its partition, or its GCD when it
# has one), by Poplar's numbering (popdist/devices.py); set where poprun knows the partition.
# popdist.getDeviceId() computes this instance's own device from it.
NODE_DEVICE_ID = "POPDIST_NODE_DEVICE_ID"
# Which attempt this is, from 0 (`poprun --max-restarts`); torch elastic's name too.
RESTART_COUNT = "POPDIST_RESTART_COUNT"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

# --- IPU over fabric / V-IPU ------------------------------------------------------------
IPUOF_CONFIG_PATH = "IPUOF_CONFIG_PATH"  # removed from every instance's environment
VIPU_API_HOST = "IPUOF_VIPU_API_HOST"
VIPU_API_PORT = "IPUOF_VIPU_API_PORT"
VIPU_API_PARTITION_ID = "IPUOF_VIPU_API_PARTITION_ID"
VIPU_API_TIMEOUT = "IPUOF_VIPU_API_TIMEOUT"
VIPU_API_GCD_ID = "IPUOF_VIPU_API_GCD_ID"
# PopRun gives its instances IPUOF_LOG_LEVEL=WARN (`-x IPUOF_LOG_LEVEL=WARN` in real -vv logs'
# mpirun command lines); a value in poprun's environment is kept.
IPUOF_LOG_LEVEL = "IPUOF_LOG_LEVEL"
DEFAULT_IPUOF_LOG_LEVEL = "WARN"

# --- Poplar -----------------------------------------------------------------------------
POPLAR_TARGET_OPTIONS = "POPLAR_TARGET_OPTIONS"
POPLAR_ENGINE_OPTIONS = "POPLAR_ENGINE_OPTIONS"

# Framework variables that choose an executable cache of their own (guide §2.3): they
# conflict with an explicit --executable-cache-path.
FRAMEWORK_CACHE_VARIABLES = ("POPTORCH_CACHE_DIR", "POPART_CACHE_DIR")
TF_POPLAR_FLAGS = "TF_POPLAR_FLAGS"  # conflicts when it holds --executable_cache_path

# --- What mpirun used to set (PopTorch reads these) -------------------------------------
OMPI_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"

# --- An MPI world over PMI-1 (spawner/worlds/pmi1.py), as MPICH's Hydra sets it ------------------
PMI_FD = "PMI_FD"  # the instance's end of a socket to poprun's PMI server
PMI_RANK = "PMI_RANK"
# Set (with the other PMIX_* variables) where poprun serves the instance Open MPI's world.
PMIX_NAMESPACE = "PMIX_NAMESPACE"
PMI_SIZE = "PMI_SIZE"
PMI_HOSTNAME = "PMI_HOSTNAME"  # MPICH's ofi netmod picks its network card by it
MPI_LOCALRANKID = "MPI_LOCALRANKID"
MPI_LOCALNRANKS = "MPI_LOCALNRANKS"
PMI_SPAWNED = "PMI_SPAWNED"  # 1: a process MPI_Comm_spawn started (run/worlds/spawn.py)

# --- Horovod's Gloo world, as `horovodrun --gloo` sets it (horovod/runner/gloo_run.py) -------
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"  # the same for every instance of a host (its scope)
HOROVOD_RANK = "HOROVOD_RANK"
HOROVOD_SIZE = "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"  # the host's index among those with this local rank
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
# poprun's rendezvous (run/worlds/horovod.py)
HOROVOD_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
HOROVOD_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
HOROVOD_CONTROLLER = "HOROVOD_CONTROLLER"
HOROVOD_CPU_OPERATIONS = "HOROVOD_CPU_OPERATIONS"  # else a Gloo-only build defaults to MPI's
HOROVOD_GLOO_IFACE = "HOROVOD_GLOO_IFACE"

# --- The data plane's interface, for the libraries that move the bytes (plan/network.py) ---
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"  # torch.distributed's Gloo
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
UCX_NET_DEVICES = "UCX_NET_DEVICES"  # MPICH over UCX (the mpich wheel's default)
FI_TCP_IFACE = "FI_TCP_IFACE"  # MPICH over OFI's tcp provider
# Open MPI's TCP transport (4.1 and 5), as mpirun's --mca would set it; it refuses an include
# list beside an exclude list, so the user's exclude keeps ours out.
OMPI_BTL_TCP_IF_INCLUDE = "OMPI_MCA_btl_tcp_if_include"
OMPI_BTL_TCP_IF_EXCLUDE = "OMPI_MCA_btl_tcp_if_exclude"

# --- torch.distributed ------------------------------------------------------------------
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# Variables forwarded to remote hosts without being asked for (`-x` names the others).
# SHLVL: a remote instance sees the shell level a local child of poprun would (the agent
# drops the one its SSH login gave it).
FORWARDED_TO_REMOTE = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", POPLAR_ENGINE_OPTIONS, "SHLVL")

# Set by the agent on remote instances: its own SSH_CONNECTION ("client-ip client-port
# server-ip server-port"), which instances do not get themselves (spawner/agent.py:
# instance_environ). POPRUN_LIFELINE, on every instance, is defined where it is set
# (spawner.containment.MARK): `poprun --version` imports that module, and not popdist.
SSH_CONNECTION_COPY = "POPRUN_SSH_CONNECTION"

# `poprun --forward-env all` forwards every variable of the launcher's to remote instances but
# these (glob patterns), which describe the launcher's host, login session or scheduler step
# rather than the job: on another host they would be wrong. `-x NAME` still forwards any of
# them. (What a remote instance has of its own for them comes from its host's login.)
NOT_FORWARDED = (
    "HOSTNAME", "HOST", "HOME", "USER", "LOGNAME", "MAIL", "SHELL", "PWD", "OLDPWD", "_",
    "SSH_*", "DISPLAY", "XAUTHORITY", "WINDOWID", "XDG_RUNTIME_DIR", "XDG_SESSION_*",
    "XDG_SEAT", "XDG_VTNR", "DBUS_SESSION_BUS_ADDRESS", "SESSION_MANAGER", "TMUX", "TMUX_PANE",
    "STY", "WINDOW", "KRB5CCNAME", "SLURM_*", "SLURMD_*", "PMI_*", "PMIX_*",
    "OMPI_COMM_WORLD_*", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "POPRUN_LIFELINE", SSH_CONNECTION_COPY, IPUOF_CONFIG_PATH,
)


def forwarded_by_all(name: str) -> bool:
    """Whether `--forward-env all` forwards `name` (not in NOT_FORWARDED)."""
    from fnmatch import fnmatchcase

    return not any(fnmatchcase(name, pattern) for pattern in NOT_FORWARDED)


class InstanceIdentity:
    """Who one instance is: the facts poprun hands to it through the environment. A plain
    class, not a dataclass: the launcher makes one per instance and imports this module on
    every launch, where a dataclass's methods are compiled at import (spawner/uncompiled.py)."""

    __slots__ = ("index", "num_instances", "local_index", "local_size", "num_total_replicas",
                 "ipus_per_replica", "master_addr", "master_port", "executable_cache_path",
                 "autoreport_dir", "restart_count", "host", "cross_rank", "cross_size",
                 "rendezvous")

    def __init__(self, index: int, num_instances: int, local_index: int, local_size: int,
                 num_total_replicas: int, ipus_per_replica: int, master_addr: str,
                 master_port: int, executable_cache_path: str | None = None,
                 autoreport_dir: str | None = None,
                 restart_count: int | None = None,  # this attempt (from 0) with restarts
                 host: str = "",  # its host's label
                 cross_rank: int = 0,  # its host's index among those running its local index
                 cross_size: int = 1,  # how many hosts run its local index
                 rendezvous: tuple[str, int] | None = None,  # Horovod's Gloo (address, port)
                 ) -> None:
        self.index, self.num_instances = index, num_instances
        self.local_index, self.local_size = local_index, local_size
        self.num_total_replicas, self.ipus_per_replica = num_total_replicas, ipus_per_replica
        self.master_addr, self.master_port = master_addr, master_port
        self.executable_cache_path, self.autoreport_dir = executable_cache_path, autoreport_dir
        self.restart_count, self.host = restart_count, host
        self.cross_rank, self.cross_size, self.rendezvous = cross_rank, cross_size, rendezvous

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"InstanceIdentity({shown})"

    @property
    def num_local_replicas(self) -> int:
        return self.num_total_replicas // self.num_instances

    @property
    def replica_index_offset(self) -> int:
        return self.index * self.num_local_replicas


def instance_environment(who: InstanceIdentity) -> dict[str, str]:
    """The variables poprun adds to one instance's environment (docs/architecture.md,
    "The environment contract")."""
    env = {
        NUM_TOTAL_REPLICAS: str(who.num_total_replicas),
        NUM_IPUS_PER_REPLICA: str(who.ipus_per_replica),
        NUM_LOCAL_REPLICAS: str(who.num_local_replicas),
        UNIFORM_REPLICAS_PER_INSTANCE: "1",
        REPLICA_INDEX_OFFSET: str(who.replica_index_offset),
        LOCAL_INSTANCE_INDEX: str(who.local_index),
        OMPI_RANK: str(who.index),
        OMPI_SIZE: str(who.num_instances),
        OMPI_LOCAL_RANK: str(who.local_index),
        OMPI_LOCAL_SIZE: str(who.local_size),
        RANK: str(who.index),
        WORLD_SIZE: str(who.num_instances),
        LOCAL_RANK: str(who.local_index),
        LOCAL_WORLD_SIZE: str(who.local_size),
        MASTER_ADDR: who.master_addr,
        MASTER_PORT: str(who.master_port),
    }
    if who.executable_cache_path is not None:
        env[EXECUTABLE_CACHE_PATH] = who.executable_cache_path
    if who.autoreport_dir is not None:
        env[AUTOREPORT_DIRECTORY] = who.autoreport_dir
    if who.restart_count is not None:
        env[RESTART_COUNT] = env[TORCHELASTIC_RESTART_COUNT] = str(who.restart_count)
    if who.rendezvous is not None:
        env.update(horovod_environment(who))
    return env


def horovod_environment(who: InstanceIdentity) -> dict[str, str]:
    """Horovod's Gloo world: what `horovodrun --gloo` gives each process, the rendezvous
    poprun's (instances are ranks; hosts fill ranks in order, as horovodrun's -H does)."""
    address, port = who.rendezvous
    env = {
        HOROVOD_HOSTNAME: who.host, HOROVOD_RANK: str(who.index),
        HOROVOD_SIZE: str(who.num_instances), HOROVOD_LOCAL_RANK: str(who.local_index),
        HOROVOD_LOCAL_SIZE: str(who.local_size), HOROVOD_CROSS_RANK: str(who.cross_rank),
        HOROVOD_CROSS_SIZE: str(who.cross_size), HOROVOD_RENDEZVOUS_ADDR: address,
        HOROVOD_RENDEZVOUS_PORT: str(port), HOROVOD_CONTROLLER: "gloo",
        HOROVOD_CPU_OPERATIONS: "gloo",
    }
    if address.startswith("127."):  # every instance on this host: Gloo's TCP over loopback
        env[HOROVOD_GLOO_IFACE] = "lo"
    return env


def read_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """An integer variable, or `default` when it is unset, empty or not a number."""
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return default


def read_str(environ: Mapping[str, str], name: str) -> str | None:
    """A string variable, or None when it is unset or empty."""
    return environ.get(name) or None
