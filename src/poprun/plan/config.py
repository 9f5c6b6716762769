"""`LaunchConfig`: everything a launch needs to know, validated on construction.

The CLI builds one from the command line (and `--import-config`); Python callers build one
directly. It is frozen: planning and launching only read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.plan import mpiargs
from poprun.errors import ConfigError
from poprun.plan.hosts import Host, instance_counts, parse_host_list
from poprun.plan.mpiargs import MpiArgs
from poprun.plan.network import NetworkChoice, choose

if TYPE_CHECKING:  # imported where a job has one
    from spawner.containers import Container

DEFAULT_KILL_TIMEOUT = 5.0
DEFAULT_SSH_FANOUT = 64
DEFAULT_SSH_TIMEOUT = 10.0
# Seconds of silence after which the launcher declares a remote host lost and the host's
# agent stops its instances (heartbeats go both ways three times as often). At most 10 s: a
# lost host is a restart (on a spare) within seconds, not minutes of a job's time. Not under
# MIN_HOST_TIMEOUT: heartbeats then come every 0.7 s, and a loaded host's pause (a fork of a
# large process, a swap storm) would pass for its loss.
DEFAULT_HOST_TIMEOUT = 10.0
MIN_HOST_TIMEOUT = 2.0
# How long a host a job lost is left out of this user's later jobs (jobctl/quarantine.py):
# long enough for someone to look at it, short enough that a host repaired comes back alone.
DEFAULT_QUARANTINE_FOR = 3600.0
DEFAULT_RESTART_DELAY = 1.0  # seconds between a failed attempt's cleanup and the next start
SSH_KEY_TYPES = ("dsa", "ecdsa", "ed25519", "rsa")
LAUNCHERS = ("ssh", "slurm", "pod")  # how agents reach remote hosts (--launcher)
# Seconds pods of a Kubernetes job wait for each other (pods start as their images come).
DEFAULT_POD_TIMEOUT = 300.0
REMOTE_INSTALL = ("auto", "never")
# --mpi-worlds: auto serves PMI-1 (MPICH) always and PMIx (Open MPI) where a libpmix is found
# (run/worlds/pmi1.py); pmi1: PMI-1 only; none: no world (each MPI instance is a world of one) and
# no Horovod rendezvous (run/session.py).
MPI_WORLDS = ("auto", "pmi1", "none")
MAX_COUNT = 1 << 20  # replicas, IPUs per replica, ILDs, SSH fan-out: beyond any IPU system
MAX_INSTANCES = 1 << 16  # instances (a dry run plans 65,536 in ~6 s here)
FORWARD_ENV_MODES = ("default", "all")  # --forward-env (popdist.env.NOT_FORWARDED for all)
STALL_ACTIONS = ("report", "kill")  # --stall-action (poprun/jobctl/watch.py)
COMPARE_HOSTS = ("warn", "error", "off")  # --compare-hosts (poprun/plan/alike.py)


@dataclass(frozen=True)
class LaunchConfig:
    """One job: the program, how many instances and replicas, and how to run them."""

    program: tuple[str, ...]
    num_instances: int = 1
    num_replicas: int = 1
    ipus_per_replica: int = 1
    num_ilds: int = 1
    offline_mode: bool = False
    print_topology: bool = False
    only_output_from_instance: int | None = None
    # None: automatic (a temporary dir with more than one instance); "": caching disabled.
    executable_cache_path: str | None = None
    env: tuple[str, ...] = ()  # `VAR` (forward the launcher's value), `PATTERN*`, `VAR=VALUE`
    forward_env: str = "default"  # what remote instances inherit: "default" or "all"
    tag_output: bool = False
    timestamp_output: bool = False
    # A line several instances write identically printed once, with their set (run/folding.py);
    # not given: POPRUN_FOLD_OUTPUT decides (wants_fold).
    fold_output: bool = False
    output_filename: str | None = None
    merge_stderr_to_stdout: bool = False
    mpi_global_args: tuple[str, ...] = ()
    mpi_local_args: tuple[str, ...] = ()
    instance_mpi_local_args: tuple[str, ...] = ()
    kill_timeout: float = DEFAULT_KILL_TIMEOUT
    verbose: int = 0
    # Host-list entries as given (`h1,h2`, `pod[1-4]`, `user@host:port`); empty: this host
    # (or the Slurm allocation's nodes, see hosts.job_hosts).
    hosts: tuple[str, ...] = ()
    # Hosts that stand by (same syntax as `hosts`): a host lost or frozen in an attempt is
    # replaced by one of them in the next (plan/jobhosts.py).
    spare_hosts: tuple[str, ...] = ()
    spare_nodes: int = 0  # under Slurm: the allocation's last this many nodes stand by
    # Seconds a host lost by this job stays out of later ones (0: not remembered); the CLI
    # and --import-config also take a duration (`30m`, `2h`, `1d`: parse_duration).
    quarantine_for: float = DEFAULT_QUARANTINE_FOR
    ssh_fanout: int = DEFAULT_SSH_FANOUT
    ssh_timeout: float = DEFAULT_SSH_TIMEOUT
    host_timeout: float = DEFAULT_HOST_TIMEOUT
    # "ssh", "slurm" or "pod"; None: slurm inside an allocation, pod where a pod contract
    # is in the environment (plan/pods.py), else ssh
    launcher: str | None = None
    pod_secret_file: str | None = None  # pod mode's secret (else POPRUN_POD_SECRET)
    pod_timeout: float = DEFAULT_POD_TIMEOUT
    max_restarts: int = 0  # a failed job is started again this many times at most
    restart_delay: float = DEFAULT_RESTART_DELAY
    remote_python: str | None = None  # None: the launcher's own interpreter path
    remote_install: str = "auto"  # bring the agent where poprun is missing (spawner.bootstrap)
    # Hosts that differ in what the job depends on (poprun/plan/alike.py): warn and go on,
    # refuse to start (an error), or do not compare them.
    compare_hosts: str = "warn"
    mpi_worlds: str = "auto"  # MPI_WORLDS: which worlds the instances are served
    libpmix: str | None = None  # the libpmix to serve PMIx with; None: found (worlds.pmixfind)
    distribute_ssh_key: bool = False
    distribute_ssh_key_path: str | None = None  # the key's folder; None: ~/.ssh
    distribute_ssh_key_type: str | None = None  # set: generate a key of this type first
    process_placement: str | None = None  # a placement.Strategy value; None: automatic
    numa_aware: bool | None = None  # the older spelling: yes = spreadnuma, no = disabled
    report_bindings: bool = False
    offline_target: str | None = None  # poplar.OFFLINE_TARGETS; needs offline_mode
    autoreport_dir: str | None = None
    # V-IPU (guide §2.8): used when offline_mode is off.
    vipu_server_host: str | None = None
    vipu_server_port: int | None = None
    vipu_server_timeout: int | None = None
    vipu_partition: str | None = None
    vipu_allocation: str | None = None
    vipu_cluster: str | None = None  # the deprecated name of --vipu-allocation
    update_partition: bool = False
    reset_partition: bool | None = None  # None: reset non-reconfigurable partitions only
    remove_partition: bool = True
    sync_type: str | None = None
    ipu_link_routing_type: str | None = None
    gw_link_routing_type: str | None = None
    vipu_partition_attempts: int | None = None
    result_json: str | None = None  # write the LaunchResult here as JSON (CLI only)
    no_dashboard: bool = False  # never show the live panel, even on a terminal
    dashboard: bool = False  # show it on stderr's terminal even when stdout goes elsewhere
    # No line from any instance for this many seconds: print their folded stacks (and, with
    # stall_action "kill", stop the job). None: never (poprun/jobctl/watch.py).
    stall_timeout: float | None = None
    stall_action: str = "report"
    # Progress (poprun/progress.py): the step (and total) captured from each line, instead of
    # the lines themselves or popdist.progress(); the stragglers' hold time (0: none).
    progress_pattern: str | None = None
    straggler_after: float = 10.0
    # Accepted from later SDKs' scripts; nothing to do without IPUs or MPI (logged at -v).
    host_subnet: str | None = None
    allow_run_as_root: bool = False
    synchronise_python_venv: bool = False
    synchronise_poplar_sdk: bool = False
    version_format: str | None = None
    # Each instance inside a container (spawner/containers.py): the runtime, its image, and
    # the runtime's own options (split shell-wise; tuples are one string each, as given).
    container: str | None = None
    container_image: str | None = None
    container_args: tuple[str, ...] = ()
    # The options the user gave (the CLI: on the command line or in --import-config), by
    # field name; None: not known (a Python caller), as if every option were given.
    given: frozenset[str] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in _STR_TUPLE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"{name} must be a sequence of strings, not one string")
            if not isinstance(value, Iterable):
                raise ConfigError(f"{name} must be a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if isinstance(self.quarantine_for, str):
            object.__setattr__(self, "quarantine_for",
                               parse_duration(self.quarantine_for, "--quarantine-for"))
        self._validate()

    def _validate(self) -> None:
        self._check_types()
        if not self.program or not self.program[0]:
            raise ConfigError("no program given: usage is poprun [options] program [program args]")
        for name in ("num_instances", "num_replicas", "ipus_per_replica", "num_ilds",
                     "ssh_fanout"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, "
                                  f"got {value!r}")
            top = MAX_INSTANCES if name == "num_instances" else MAX_COUNT
            if value > top:
                raise ConfigError(f"--{name.replace('_', '-')}={value} is more than poprun "
                                  f"handles (at most {top})")
        if self.num_replicas % self.num_instances:
            raise ConfigError(
                f"--num-replicas={self.num_replicas} is not divisible by "
                f"--num-instances={self.num_instances}: every instance needs the same number "
                "of replicas")
        if self.num_replicas % self.num_ilds:
            raise ConfigError(f"--num-replicas={self.num_replicas} is not divisible by "
                              f"--num-ilds={self.num_ilds}")
        only = self.only_output_from_instance
        if only is not None and not 0 <= only < self.num_instances:
            raise ConfigError(f"--only-output-from-instance={only} is not an instance index "
                              f"(0..{self.num_instances - 1})")
        if self.kill_timeout < 0:
            raise ConfigError(f"--kill-timeout must not be negative, got {self.kill_timeout}")
        if self.ssh_timeout <= 0:
            raise ConfigError(f"--ssh-timeout must be positive, got {self.ssh_timeout}")
        if self.host_timeout < MIN_HOST_TIMEOUT:
            raise ConfigError(f"--host-timeout must be at least {MIN_HOST_TIMEOUT:g} s, got "
                              f"{self.host_timeout:g}")
        if self.quarantine_for < 0:
            raise ConfigError(f"--quarantine-for must not be negative, got "
                              f"{self.quarantine_for:g}")
        if self.pod_timeout <= 0:
            raise ConfigError(f"--pod-timeout must be positive, got {self.pod_timeout}")
        if self.restart_delay < 0:
            raise ConfigError(f"--restart-delay must not be negative, got {self.restart_delay}")
        if self.dashboard and self.no_dashboard:
            raise ConfigError("--dashboard and --no-dashboard cannot be used together")
        if self.launcher not in (None, *LAUNCHERS):
            raise ConfigError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got "
                              f"{self.launcher!r}")
        if self.forward_env not in FORWARD_ENV_MODES:
            raise ConfigError(f"--forward-env must be one of {', '.join(FORWARD_ENV_MODES)}, "
                              f"got {self.forward_env!r}")
        if self.compare_hosts not in COMPARE_HOSTS:
            raise ConfigError(f"--compare-hosts must be one of {', '.join(COMPARE_HOSTS)}, "
                              f"got {self.compare_hosts!r}")
        if self.stall_action not in STALL_ACTIONS:
            raise ConfigError(f"--stall-action must be one of {', '.join(STALL_ACTIONS)}, "
                              f"got {self.stall_action!r}")
        if self.stall_timeout is not None and self.stall_timeout <= 0:
            raise ConfigError(f"--stall-timeout must be positive, got {self.stall_timeout}")
        if self.straggler_after < 0:
            raise ConfigError(f"--straggler-after must not be negative, got "
                              f"{self.straggler_after}")
        if self.progress_pattern is not None:
            from poprun.progress import compile_pattern  # only when one is given

            try:
                compile_pattern(self.progress_pattern)
            except ValueError as exc:
                raise ConfigError(f"--progress-pattern: {exc}") from None
        if self.mpi_worlds not in MPI_WORLDS:
            raise ConfigError(f"--mpi-worlds must be one of {', '.join(MPI_WORLDS)}, "
                              f"got {self.mpi_worlds!r}")
        if self.remote_install not in REMOTE_INSTALL:
            raise ConfigError(f"--remote-install must be one of {', '.join(REMOTE_INSTALL)}, "
                              f"got {self.remote_install!r}")
        if self.host_list:  # slots that disagree with --num-instances, or an uneven split
            instance_counts(self.host_list, self.num_instances, per_host=self.mpi.npernode)
        self._check_spares()
        from poprun.plan.placement import resolve_strategy

        resolve_strategy(self.process_placement, self.numa_aware, 1)  # unknown or contradictory
        if self.offline_target is not None:
            from poprun.plan.poplar import offline_target

            offline_target(self.offline_target)  # an unknown target is an error now
            if not self.offline_mode:
                raise ConfigError("--offline-target needs --offline-mode=yes")
        key_type = self.distribute_ssh_key_type
        if key_type is not None and key_type not in SSH_KEY_TYPES:
            raise ConfigError(f"--distribute-ssh-key-type={key_type!r}: use one of "
                              f"{', '.join(SSH_KEY_TYPES)}")
        for entry in self.env:
            _check_env_entry(entry, "--env")
        self.container_spec  # an unknown runtime or a missing image is an error now
        # Parsing here reports a bad mpi-args token or network at construction, not mid-launch.
        self.network
        for index, extra in self.instance_mpi.items():
            if extra.npernode is not None:
                raise ConfigError("--instance-mpi-local-args: --npernode counts the instances "
                                  "of every host, it cannot be given for one instance")
            if index >= self.num_instances:
                raise ConfigError(f"--instance-mpi-local-args names instance {index}, but there "
                                  f"are only {self.num_instances}")

    def _check_spares(self) -> None:
        """Spares that can never be used, or that are the job's own hosts: one line."""
        if self.spare_nodes and self.spare_list:
            raise ConfigError("--spare-nodes and --spare-hosts cannot be used together")
        if self.spare_nodes and self.host_list:
            raise ConfigError("--spare-nodes: the spares are the Slurm allocation's last "
                              "nodes, and --host names the job's hosts: use --spare-hosts")
        if not self.spare_list and not self.spare_nodes:
            return
        option = "--spare-nodes" if self.spare_nodes else "--spare-hosts"
        if not self.max_restarts:
            raise ConfigError(f"{option}: nothing could use them: a spare takes a lost "
                              "host's place in the next attempt; give --max-restarts N")
        job = {str(h) for h in self.host_list}
        both = [str(h) for h in self.spare_list if str(h) in job]
        if both:
            raise ConfigError(f"--spare-hosts: {', '.join(both)} "
                              f"{'is' if len(both) == 1 else 'are'} also in --host: a spare "
                              "stands by, it runs nothing until a host is lost")

    def _check_types(self) -> None:
        """Values from Python callers and --import-config files arrive untyped: a wrong type
        is a ConfigError here, not a TypeError somewhere later."""
        def bad(name: str, what: str) -> ConfigError:
            label = name if name == "program" else "--" + name.replace("_", "-")
            return ConfigError(f"{label} must be {what}, got {getattr(self, name)!r}")

        for name in _STR_TUPLE_FIELDS:
            if not all(isinstance(v, str) for v in getattr(self, name)):
                raise bad(name, "a sequence of strings")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a boolean")
        for name in _OPTIONAL_STR_FIELDS:
            if not isinstance(getattr(self, name), (str, type(None))):
                raise bad(name, "a string")
        for name in ("numa_aware", "reset_partition"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise bad(name, "a boolean")
        for name in ("vipu_server_port", "vipu_server_timeout", "vipu_partition_attempts"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise bad(name, "a positive integer")
        if self.vipu_server_port is not None and self.vipu_server_port > 65535:
            raise bad("vipu_server_port", "a TCP port (1-65535)")
        only = self.only_output_from_instance
        if only is not None and (not isinstance(only, int) or isinstance(only, bool)):
            raise bad("only_output_from_instance", "an integer")
        for name in ("verbose", "max_restarts", "spare_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, "a non-negative integer")
        for name in ("kill_timeout", "ssh_timeout", "host_timeout", "pod_timeout",
                     "restart_delay", "quarantine_for", "stall_timeout", "straggler_after"):
            seconds = getattr(self, name)
            if seconds is None and name == "stall_timeout":
                continue
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) \
                    or not math.isfinite(seconds):
                raise bad(name, "a number of seconds")

    # --- derived views ----------------------------------------------------------------

    @cached_property
    def host_list(self) -> tuple[Host, ...]:
        """The hosts named by `hosts`, expanded; duplicates are an error."""
        return parse_host_list(",".join(self.hosts)) if self.hosts else ()

    @cached_property
    def spare_list(self) -> tuple[Host, ...]:
        """The hosts named by `spare_hosts`, expanded; duplicates are an error."""
        return parse_host_list(",".join(self.spare_hosts), "--spare-hosts") \
            if self.spare_hosts else ()

    @cached_property
    def mpi(self) -> MpiArgs:
        """The global and local mpi-args together."""
        merged = merged_mpi_args(self.mpi_global_args, self.mpi_local_args)
        for entry in merged.env:
            _check_env_entry(entry, "-x")
        return merged

    @cached_property
    def network(self) -> NetworkChoice:
        """The network the user chose for the instances' worlds (plan/network.py)."""
        return choose(self.host_subnet, self.mpi.mca)

    @cached_property
    def instance_mpi(self) -> dict[int, MpiArgs]:
        """Per-instance mpi-args from --instance-mpi-local-args."""
        by_index: dict[int, list[MpiArgs]] = {}
        for text in self.instance_mpi_local_args:
            index, parsed = mpiargs.parse_instance_args(text)
            if parsed.mca:  # one network for the whole job: its world spans every instance
                key, value = parsed.mca[0]
                raise ConfigError(f"--instance-mpi-local-args: --mca {key} {value} chooses "
                                  "the job's network: give it in --mpi-global-args")
            by_index.setdefault(index, []).append(parsed)
        return {i: mpiargs.merge(parts) for i, parts in by_index.items()}

    @cached_property
    def container_spec(self) -> Container | None:
        """The container every instance runs in (spawner/containers.py); None: none. A
        runtime poprun does not know, a missing image or an image or arguments without a
        runtime are errors."""
        import shlex

        from spawner.containers import Container

        if self.container is None:
            if self.container_image is not None or self.container_args:
                raise ConfigError("--container-image and --container-args need --container")
            return None
        try:
            args = tuple(word for text in self.container_args for word in shlex.split(text))
        except ValueError as exc:
            raise ConfigError(f"--container-args: {exc}") from None
        spec = Container(self.container, self.container_image or None, args)
        problem = spec.problem()
        if problem:
            raise ConfigError(problem)
        return spec

    @property
    def warns_single_instance(self) -> bool:
        """PopRun's warning that one instance with one replica is not supported: shown when
        the user asked for that, not when both are merely the defaults."""
        asked = self.given is None or bool(self.given & {"num_instances", "num_replicas"})
        return self.num_instances == 1 and self.num_replicas == 1 and asked

    @property
    def effective_tag_output(self) -> bool:
        return self.tag_output or self.mpi.tag_output

    @property
    def effective_timestamp_output(self) -> bool:
        return self.timestamp_output or self.mpi.timestamp_output

    @property
    def effective_merge_stderr(self) -> bool:
        return self.merge_stderr_to_stdout or self.mpi.merge_stderr_to_stdout

    @property
    def effective_report_bindings(self) -> bool:
        return self.report_bindings or self.mpi.report_bindings

    @property
    def effective_output_filename(self) -> str | None:
        return self.output_filename or self.mpi.output_filename

    def env_entries(self, instance: int) -> tuple[str, ...]:
        """`-x` entries for one instance: native, then mpi-args, then per-instance."""
        extra = self.instance_mpi.get(instance)
        return self.env + self.mpi.env + (extra.env if extra else ())

    # --- TOML import / export ---------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The options that differ from their defaults, keyed by CLI name, plus the program."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "given":
                continue
            if f.name == "program" or value != f.default:
                out[f.name.replace("_", "-")] = list(value) if isinstance(value, tuple) else value
        return out

    def to_toml(self) -> str:
        import tomli_w  # only export needs it

        return tomli_w.dumps(self.to_dict())


_STR_TUPLE_FIELDS = ("program", "env", "mpi_global_args", "mpi_local_args",
                     "instance_mpi_local_args", "hosts", "container_args", "spare_hosts")
_BOOL_FIELDS = ("offline_mode", "print_topology", "tag_output", "timestamp_output",
                "fold_output", "merge_stderr_to_stdout", "distribute_ssh_key", "report_bindings",
                "update_partition", "remove_partition", "allow_run_as_root",
                "synchronise_python_venv", "synchronise_poplar_sdk", "no_dashboard",
                "dashboard")
_OPTIONAL_STR_FIELDS = (
    "executable_cache_path", "output_filename", "remote_python", "distribute_ssh_key_path",
    "distribute_ssh_key_type", "process_placement", "offline_target", "autoreport_dir",
    "vipu_server_host", "vipu_partition", "vipu_allocation", "vipu_cluster", "sync_type",
    "ipu_link_routing_type", "gw_link_routing_type", "host_subnet", "version_format",
    "result_json",
    "progress_pattern", "libpmix", "container", "container_image")
# Options that parse (later SDKs' scripts pass them) and do nothing here: said at -v.
INERT_FIELDS = ("allow_run_as_root", "synchronise_python_venv",
                "synchronise_poplar_sdk", "version_format")
# Options that only matter when poprun talks to a V-IPU server (not with --offline-mode).
VIPU_FIELDS = ("vipu_server_host", "vipu_server_port", "vipu_server_timeout", "vipu_partition",
               "vipu_allocation", "vipu_cluster", "update_partition", "reset_partition",
               "sync_type", "ipu_link_routing_type", "gw_link_routing_type",
               "vipu_partition_attempts")


# Boolean words, in options (Boost.Program_options' set) and variables.
BOOL_WORDS = {"yes": True, "true": True, "on": True, "1": True,
              "no": False, "false": False, "off": False, "0": False}
FOLD_VARIABLE = "POPRUN_FOLD_OUTPUT"


def wants_fold(config: LaunchConfig, environ) -> bool:
    """--fold-output when given (or set by a Python caller), else POPRUN_FOLD_OUTPUT (a
    boolean word; empty: unset). Raises ConfigError for another value."""
    if config.fold_output or (config.given is not None and "fold_output" in config.given):
        return config.fold_output
    value = environ.get(FOLD_VARIABLE, "")
    if value.strip().lower() in BOOL_WORDS:
        return BOOL_WORDS[value.strip().lower()]
    if not value.strip():
        return False
    raise ConfigError(f"{FOLD_VARIABLE}={value!r} is not a boolean (use 1 or 0, yes or no, "
                      "true or false, on or off)")


def merged_mpi_args(global_args: Iterable[str], local_args: Iterable[str]) -> MpiArgs:
    """--mpi-global-args and --mpi-local-args read together (later values win)."""
    parts = [mpiargs.parse_mpi_args(t, "--mpi-global-args") for t in global_args]
    parts += [mpiargs.parse_mpi_args(t, "--mpi-local-args") for t in local_args]
    return mpiargs.merge(parts)


def field_defaults() -> dict[str, Any]:
    """Default of every option field, by field name (the one definition of the defaults)."""
    return {f.name: f.default for f in dataclasses.fields(LaunchConfig)
            if f.name not in ("program", "given")}


def load_toml(path: str) -> dict[str, Any]:
    """Options stored by --export-config, keyed by field name; unknown keys are an error.
    The file is read bounded (a regular file of at most files.MAX_CONFIG_FILE bytes, UTF-8):
    a wrong one is one line naming it, never a traceback or a hang."""
    import tomllib  # here: only --import-config pays for it

    from poprun.plan.files import MAX_CONFIG_FILE, read_small_file

    where = f"--import-config {path}"
    text = read_small_file(path, where, MAX_CONFIG_FILE, "a configuration file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nested array or table
        raise ConfigError(f"{where}: not valid TOML: nested too deeply") from None
    known = {f.name for f in dataclasses.fields(LaunchConfig)} - {"given"}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"{where}: unknown option {key!r}")
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def missing_program(name: str, cwd: str) -> ConfigError:
    """The error for a program that does not resolve (spawner.local.resolve_program: PATH,
    then the working directory): one that exists but cannot run says why and what to do."""
    import os
    import shlex

    candidate = os.path.join(cwd, name)
    if os.path.isdir(candidate):
        return ConfigError(f"program {name!r} is a directory ({os.path.abspath(candidate)})")
    if os.path.exists(candidate) and not os.path.isfile(candidate):
        return ConfigError(f"program {name!r} is not a regular file")
    if os.path.exists(candidate):
        with_interpreter = _interpreter_for(candidate)
        how = (f"run it with its interpreter: {shlex.join([with_interpreter, name])}"
               if with_interpreter else "")
        chmod = f"chmod +x {shlex.quote(name)}"
        return ConfigError(f"program {name!r} exists but is not executable: "
                           f"{how + ', or ' if how else ''}make it executable "
                           f"({chmod})")
    return ConfigError(f"program {name!r} not found or not executable "
                       f"(looked in PATH and in {cwd})")


def _interpreter_for(path: str) -> str | None:
    """What runs a script that lacks its execute bit: its `#!` line, else by its suffix."""
    import os

    try:
        with open(path, "rb") as fh:
            first = fh.readline(256)
    except OSError:
        first = b""
    if first.startswith(b"#!"):
        words = first[2:].decode("utf-8", "replace").split()
        if words and os.path.basename(words[0]) == "env" and len(words) > 1:
            return words[1]
        return os.path.basename(words[0]) if words else None
    return {".py": "python3", ".sh": "sh", ".bash": "bash"}.get(os.path.splitext(path)[1])


def _check_env_entry(entry: str, source: str) -> None:
    name, eq, _ = entry.partition("=")
    if not eq and name and set(name) & set("*?["):  # a pattern: `WANDB_*`, `HF_[A-Z]*`
        if all(c.isalnum() or c in "_*?[]!-" for c in name):
            return
    if not name or not (name[0].isalpha() or name[0] == "_") or not all(
            c.isalnum() or c == "_" for c in name):
        raise ConfigError(f"{source}: {entry!r} is not VAR, VAR=VALUE or a pattern like "
                          "'WANDB_*'")


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, option: str) -> float:
    """Seconds of `30`, `90s`, `30m`, `2h`, `1d` (ConfigError naming `option` otherwise)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise ConfigError(f"{option}: {text!r} is not a duration (seconds, or a number "
                          "followed by s, m, h or d: 30m, 2h)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
