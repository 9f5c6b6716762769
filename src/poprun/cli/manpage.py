"""`man poprun`, `man poprunctl` and the guide's option reference, written from what `--help`
renders: poprun's option table (`options.OPTIONS`, its `SECTIONS`, `help.DESCRIPTION` and
`help.EPILOG`, the defaults `--help` shows) and poprunctl's typer app (each command's help and
the help record of each of its options). So neither page can say other than `--help`.

The pages are committed (`man/*.1`, `docs/options.md`), not made at build time: building a
wheel runs in an isolated environment without typer, which poprunctl's page is read from.
pyproject.toml installs `man/` into `<prefix>/share/man/man1`, where man-db looks beside each
`bin` directory on PATH (so a venv's pages are found once its `bin` is). tests/test_docs.py
checks that the committed files are what this module writes; `python -m poprun.cli.manpage`
rewrites them.
"""

from __future__ import annotations

import html
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import typer

from poprun.cli import ctl
from poprun.cli.help import DESCRIPTION, EPILOG, USAGE, metavar, shown_default
from poprun.cli.options import Kind, Opt, sections
from poprun.plan.config import field_defaults

NAMES = {
    "poprun": "launch instances of a program, replicas divided among them, without MPI",
    "poprunctl": "see and handle poprun jobs: list, show, stacks, kill, logs, reap",
}
GUIDE = ("The user's guide: docs/ in poprun's source (its index.md lists a page per task), "
         "or as a site: pip install '.[docs]' && mkdocs serve.")


# --- roff -----------------------------------------------------------------------------------


def _roff(text: str) -> str:
    """Plain text as roff: backslashes and hyphens escaped (a `\\-` copies as the `-` an
    option needs, where groff would print a plain `-` as a typographic hyphen), and a line
    that would start with `.` or `'` (a request) guarded."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line
                     for line in text.split("\n"))


def _paragraphs(text: str) -> str:
    """Paragraphs (blank-line separated) as roff paragraphs; each one's lines joined, for
    man to fill."""
    return "\n.PP\n".join(_roff(" ".join(p.split())) for p in text.split("\n\n") if p.strip())


def _option_term(opt: Opt) -> str:
    """How an option is written at the head of its entry: `--num-instances INT`,
    `--env, -x ARG`, `--offline-mode[=BOOL]`, `--dry-run`."""
    names = f"\\fB\\-\\-{_roff(opt.long)}\\fR"
    if opt.short:
        names += f", \\fB\\-{opt.short}\\fR"
    if opt.kind is Kind.BOOL:
        return names + "[=\\fIBOOL\\fR]"
    value = metavar(opt)
    if value.startswith("["):  # optional: `--show-completion [SHELL]`
        return f"{names} [\\fI{value[1:-1]}\\fR]"
    return f"{names} \\fI{value}\\fR" if value else names


def _header(name: str) -> list[str]:
    # No version or date: the page is the same text until an option changes. `.nh` and
    # `.ad l`: no hyphenation and a ragged right, so an option name is never broken in two.
    return [f'.TH {name.upper()} 1 "" "{name}" "User Commands"', ".nh", ".ad l", ".SH NAME",
            f"{name} \\- {_roff(NAMES[name])}"]


def poprun_page() -> str:
    defaults = field_defaults()
    out = _header("poprun")
    program = USAGE.replace("[options] ", "")
    out += [".SH SYNOPSIS", ".B poprun", f"[\\fIoptions\\fR] {_roff(program)}",
            ".SH DESCRIPTION", _paragraphs(DESCRIPTION), ".SH OPTIONS"]
    for heading, opts in sections():
        out.append(f".SS {_roff(heading)}")
        for opt in opts:
            text = opt.help
            default = shown_default(opt, defaults)
            if default is not None:
                text += f" [default: {default}]"
            out += [".TP", _option_term(opt), _roff(" ".join(text.split()))]
    out += [".SH EXIT STATUS", _paragraphs(EPILOG), ".SH SEE ALSO", ".BR poprunctl (1)",
            ".PP", _roff(GUIDE)]
    return "\n".join(out) + "\n"


def _ctl_commands() -> Iterator[tuple[str, typer.core.TyperCommand, typer.Context]]:
    group = typer.main.get_command(ctl.app)
    parent = typer.Context(group, info_name="poprunctl")
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        yield name, command, typer.Context(command, parent=parent, info_name=name)


def _usage(name: str, command: typer.core.TyperCommand) -> str:
    """`poprunctl stacks JOB [options]`, its arguments as `--help` names them."""
    arguments = [p.name.upper() for p in command.params if p.param_type_name == "argument"]
    return " ".join(["poprunctl", name, *arguments, "[options]"])


def poprunctl_page() -> str:
    group = typer.main.get_command(ctl.app)
    out = _header("poprunctl")
    out += [".SH SYNOPSIS", ".B poprunctl", "\\fICOMMAND\\fR [\\fIoptions\\fR]",
            ".SH DESCRIPTION", _paragraphs(group.help or ""), ".SH COMMANDS"]
    for name, command, context in _ctl_commands():
        out += [f".SS {_roff(_usage(name, command))}", _paragraphs(command.help or "")]
        for param in command.params:
            record = param.get_help_record(context)
            if record is None:
                continue
            term, text = record
            if param.param_type_name == "argument":
                term, text = param.name.upper(), param.help or ""  # type: ignore[attr-defined]
            out += [".TP", f"\\fB{_roff(term)}\\fR", _roff(" ".join(text.split()))]
    out += [".SH EXIT STATUS", _paragraphs(ctl.EXIT_STATUS), ".SH SEE ALSO",
            ".BR poprun (1)", ".PP", _roff(GUIDE)]
    return "\n".join(out) + "\n"


# --- the guide's option reference -------------------------------------------------------------


def _markdown(text: str) -> str:
    """Plain text inside a Markdown table cell: nothing in it read as markup or HTML."""
    text = html.escape(" ".join(text.split()), quote=False)
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text)


def _markdown_term(opt: Opt) -> str:
    names = f"--{opt.long}" + (f", -{opt.short}" if opt.short else "")
    if opt.kind is Kind.BOOL:
        return f"`{names}[=BOOL]`"
    value = metavar(opt)
    return f"`{names} {value}`" if value else f"`{names}`"


def options_markdown() -> str:
    defaults = field_defaults()
    out = ["# Option reference", "",
           "<!-- Written by `python -m poprun.cli.manpage` from the option table "
           "(src/poprun/cli/options.py); tests/test_docs.py checks it. Do not edit. -->", "",
           "Every option of `poprun`, as `poprun --help` and `man poprun` give them. "
           "Usage: `poprun " + USAGE + "`.", ""]
    out += [_markdown(p) + "\n" for p in DESCRIPTION.split("\n\n")]
    for heading, opts in sections():
        out += [f"## {_markdown(heading)}", "", "| option | what it does |", "|---|---|"]
        for opt in opts:
            text = opt.help
            default = shown_default(opt, defaults)
            if default is not None:
                text += f" [default: {default}]"
            out.append(f"| {_markdown_term(opt)} | {_markdown(text)} |")
        out.append("")
    out += ["## Exit status", "", _markdown(EPILOG), ""]
    return "\n".join(out)


# Each file, relative to the repository's root, and what writes it.
FILES: dict[str, Callable[[], str]] = {"man/poprun.1": poprun_page,
                                       "man/poprunctl.1": poprunctl_page,
                                       "docs/options.md": options_markdown}


def write(root: Path) -> list[Path]:
    """Write every file of FILES under `root`; return their paths."""
    written = []
    for relative, make in FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make(), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """`python -m poprun.cli.manpage [ROOT]`: rewrite the files under ROOT (default: the
    current directory, the repository's root)."""
    args = sys.argv[1:] if argv is None else argv
    for path in write(Path(args[0] if args else ".")):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
