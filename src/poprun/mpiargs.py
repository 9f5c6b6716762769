"""Reading the mpirun arguments real poprun scripts pass, without running mpirun.

`--mpi-global-args`, `--mpi-local-args` and `--instance-mpi-local-args` used to be handed to
mpirun. We start the instances ourselves, so we read them instead: the options that change what
the user sees are honoured, transport tuning is accepted and ignored, anything else is an error
naming the token (silently dropping an option would hide a behaviour change).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from .errors import ConfigError

# mpirun accepts these with one dash or two.
_FLAGS = {
    "tag-output": "tag_output",
    "timestamp-output": "timestamp_output",
    "merge-stderr-to-stdout": "merge_stderr_to_stdout",
    "report-bindings": "report_bindings",
}
_VALUED = {"output-filename": "output_filename", "bind-to": "bind_to", "map-by": "map_by"}
# Accepted and ignored: they tune MPI's own transport or privileges, which do not exist here.
_IGNORED_FLAGS = {"allow-run-as-root", "oversubscribe", "display-map", "display-allocation",
                  "quiet", "q"}
_IGNORED_PAIRS = {"mca", "gmca"}  # `--mca <key> <value>`


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
    ignored: tuple[str, ...] = field(default=())  # tokens accepted but without effect


def parse_mpi_args(text: str, source: str) -> MpiArgs:
    """Parse one mpi-args string; `source` names the option for error messages."""
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: cannot split {text!r}: {exc}") from None
    values: dict[str, object] = {}
    env: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        name, eq, inline = tok.lstrip("-").partition("=")

        def value() -> str:
            nonlocal i
            if eq:
                return inline
            if i + 1 >= len(tokens):
                raise ConfigError(f"{source}: {tok!r} needs a value")
            i += 1
            return tokens[i]

        if tok in ("-x", "--x"):
            env.append(value())
        elif tok.startswith("-x") and not tok.startswith("--"):
            env.append(tok[2:])  # `-xVAR`
        elif not tok.startswith("-"):
            raise ConfigError(f"{source}: unexpected argument {tok!r}")
        elif name in _FLAGS and not eq:
            values[_FLAGS[name]] = True
        elif name in _VALUED:
            values[_VALUED[name]] = value()
        elif name in _IGNORED_FLAGS and not eq:
            ignored.append(tok)
        elif name in _IGNORED_PAIRS:
            key = value()
            if i + 1 >= len(tokens):
                raise ConfigError(f"{source}: {tok} {key} needs a value")
            i += 1
            ignored.append(f"{tok} {key} {tokens[i]}")
        else:
            raise ConfigError(
                f"{source}: unsupported mpirun argument {tok!r} (poprun starts instances "
                "without MPI; it honours -x, --tag-output, --timestamp-output, "
                "--output-filename, --merge-stderr-to-stdout and ignores --mca, "
                "--allow-run-as-root)")
        i += 1
    return MpiArgs(env=tuple(env), ignored=tuple(ignored), **values)  # type: ignore[arg-type]


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
            ignored=out.ignored + p.ignored,
        )
    return out
