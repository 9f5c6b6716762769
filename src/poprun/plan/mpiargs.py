"""Reading the mpirun arguments real poprun scripts pass, without running mpirun.

`--mpi-global-args`, `--mpi-local-args` and `--instance-mpi-local-args` used to be handed to
mpirun. We start the instances ourselves, so we read them instead: the options that change what
the user sees are honoured, transport tuning is accepted and ignored, anything else is an error
naming the token (silently dropping an option would hide a behaviour change).
"""

from __future__ import annotations

from dataclasses import field

from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError
from poprun.plan.network import CONTROL_KEYS, DATA_KEYS

NETWORK_KEYS = frozenset(CONTROL_KEYS + DATA_KEYS)


@dataclass(frozen=True)
class MpiArg:
    """One mpirun argument poprun reads. mpirun accepts each with one dash or two."""

    name: str  # without dashes
    field: str | None  # the MpiArgs field it sets; None: accepted and ignored
    value: str = ""  # how --help shows its value(s): "" none, "DIR", "KEY VALUE" (two words)
    note: str = ""  # said after it in the summary

    @property
    def words(self) -> int:
        """How many words follow it (0, 1, or 2 for `--mca key value`)."""
        return len(self.value.split())

    def __str__(self) -> str:
        dashes = "-" if len(self.name) == 1 else "--"
        return f"{dashes}{self.name}" + (f" {self.value}" if self.value else "") + self.note


# The one list of the mpirun arguments poprun reads: the parser below, `--help` (through
# summary()) and the guide (docs/migrating.md; tests/test_config.py compares) all come from
# it. Honoured: what changes what the user sees; ignored: transport tuning and privileges,
# which do not exist without MPI. Anything else is an error naming the token.
ARGS = (
    MpiArg("x", "env", "VAR[=VALUE]"),
    MpiArg("tag-output", "tag_output"),
    MpiArg("timestamp-output", "timestamp_output"),
    MpiArg("output-filename", "output_filename", "DIR[:nocopy]"),
    MpiArg("merge-stderr-to-stdout", "merge_stderr_to_stdout"),
    MpiArg("report-bindings", "report_bindings"),
    MpiArg("bind-to", "bind_to", "WHAT"),
    MpiArg("map-by", "map_by", "WHAT", " (these two with --process-placement disabled)"),
    # Open MPI's spellings of processes per node (mpirun(1): -npernode, -N, -pernode).
    MpiArg("npernode", "npernode", "N"),
    MpiArg("N", "npernode", "N"),
    MpiArg("pernode", "npernode", "", " (instances per host, as slots say)"),
    MpiArg("mca", None, "KEY VALUE", " (but btl_tcp_if_include/exclude and "
           "oob_tcp_if_include/exclude, which choose the network)"),
    MpiArg("gmca", None, "KEY VALUE"),
    MpiArg("allow-run-as-root", None),
    MpiArg("oversubscribe", None),
    MpiArg("display-map", None),
    MpiArg("display-allocation", None),
    MpiArg("quiet", None),
    MpiArg("q", None),
)
_BY_NAME = {a.name: a for a in ARGS}


def summary() -> str:
    """The honoured and the ignored arguments, in words (for --help, errors, the guide)."""
    honoured = ", ".join(str(a) for a in ARGS if a.field)
    ignored = ", ".join(str(a) for a in ARGS if not a.field)
    return f"honoured: {honoured}; accepted and ignored: {ignored}"


@dataclass(frozen=True)
class MpiArgs:
    """What a set of mpirun arguments asks of poprun."""

    env: tuple[str, ...] = ()  # `-x VAR` / `-x VAR=VALUE`, in order
    tag_output: bool = False
    timestamp_output: bool = False
    merge_stderr_to_stdout: bool = False
    report_bindings: bool = False
    output_filename: str | None = None
    bind_to: str | None = None
    map_by: str | None = None
    npernode: int | None = None  # instances on every host (`--npernode N`, `-N N`, `--pernode`)
    # `--mca KEY VALUE` that choose the network (plan/network.py), in order
    mca: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = field(default=())  # tokens accepted but without effect


def parse_mpi_args(text: str, source: str) -> MpiArgs:
    """Parse one mpi-args string; `source` names the option for error messages."""
    import shlex  # here: most launches give no mpi-args (its import: ~0.3 ms)

    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: cannot split {text!r}: {exc}") from None
    values: dict[str, object] = {}
    env: list[str] = []
    mca: list[tuple[str, str]] = []
    ignored: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        name, eq, inline = tok.lstrip("-").partition("=")
        arg = _BY_NAME.get(name) if tok.startswith("-") else None

        def value() -> str:
            nonlocal i
            if eq:
                return inline
            if i + 1 >= len(tokens):
                raise ConfigError(f"{source}: {tok!r} needs a value")
            i += 1
            return tokens[i]

        if arg is None and tok.startswith("-x") and not tok.startswith("--"):
            env.append(tok[2:])  # `-xVAR`
        elif not tok.startswith("-"):
            raise ConfigError(f"{source}: unexpected argument {tok!r}")
        elif arg is None or (eq and not arg.words):
            raise ConfigError(
                f"{source}: unsupported mpirun argument {tok!r} (poprun starts instances "
                f"without MPI; of mpirun's arguments it reads these: {summary()})")
        elif arg.words == 2:  # `--mca <key> <value>`
            key = value()
            if i + 1 >= len(tokens):
                raise ConfigError(f"{source}: {tok} {key} needs a value")
            i += 1
            if key in NETWORK_KEYS:  # the network the user chose (plan/network.py)
                mca.append((key, tokens[i]))
            else:
                ignored.append(f"{tok} {key} {tokens[i]}")
        elif arg.field is None:
            ignored.append(tok)
        elif arg.field == "env":
            env.append(value())
        elif arg.field == "npernode":
            values["npernode"] = _per_host(value() if arg.words else "1", tok, source)
        else:
            values[arg.field] = value() if arg.words else True
        i += 1
    return MpiArgs(env=tuple(env), mca=tuple(mca), ignored=tuple(ignored),
                   **values)  # type: ignore[arg-type]


def _per_host(text: str, tok: str, source: str) -> int:
    # Bounded before int(): Python refuses to convert more than 4300 digits (a traceback).
    if not (text.isdigit() and len(text) <= 6 and int(text) >= 1):
        raise ConfigError(f"{source}: {tok} {text!r} is not a number of instances per host")
    return int(text)


def parse_instance_args(text: str) -> tuple[int, MpiArgs]:
    """`<instance>:<mpi args>` from --instance-mpi-local-args."""
    index, sep, rest = text.partition(":")
    if not sep or not index.strip().isdigit():
        raise ConfigError(
            f"--instance-mpi-local-args: expected '<instance index>:<args>', got {text!r}")
    return int(index), parse_mpi_args(rest, f"--instance-mpi-local-args={text}")


def merge(parts: list[MpiArgs]) -> MpiArgs:
    """Several mpi-args strings together (repeated options accumulate)."""
    out = MpiArgs()
    for p in parts:
        out = MpiArgs(
            env=out.env + p.env,
            tag_output=out.tag_output or p.tag_output,
            timestamp_output=out.timestamp_output or p.timestamp_output,
            merge_stderr_to_stdout=out.merge_stderr_to_stdout or p.merge_stderr_to_stdout,
            report_bindings=out.report_bindings or p.report_bindings,
            output_filename=p.output_filename or out.output_filename,
            bind_to=p.bind_to or out.bind_to,
            map_by=p.map_by or out.map_by,
            npernode=p.npernode or out.npernode,
            mca=out.mca + p.mca,
            ignored=out.ignored + p.ignored,
        )
    return out
