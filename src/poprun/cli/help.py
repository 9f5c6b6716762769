"""Where people meet the command line: `--help`/`-h` and shell completion, by typer.

typer renders `options.OPTIONS` (one typer option per entry, grouped into panels under the
`options.SECTIONS` headings) and speaks the shells' completion protocol; it never parses a launch.
`options.parse_args` stays the parser: typer cannot express option prefixes, boolean words and
repeated options, and a typer app takes ~250 ms to start here. So only `--help`, `-h`,
`--show-completion`, `--install-completion` and the shells' completion requests import this
module (measured: `--help` ~220 ms in all, most of it typer's rich renderer; a bash completion
~100 ms, which never imports that renderer); a launch and `--version` (~50 ms) never do
(tests/test_importtime.py). It reaches into typer's completion classes and scripts (private
modules of typer 0.29, whose vendored click has no public path to them): tests/test_help.py
drives each shell's protocol, so a typer that moves them fails there.

Completion follows the Boost rules, not click's: a word starting with `-` before the program
completes poprun's long options (`--num-i` to `--num-instances`); the word after an option that
takes a value completes that value (choices where the option has them, else the shell's own
file completion); the program name and everything after it get the shell's file completion.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer._completion_classes import BashComplete, FishComplete, ZshComplete
from typer._completion_shared import _get_shell_name, install

from poprun.cli.options import (BOOL_WORDS, OPTIONS, Kind, Opt, Parsed, resolve_long, sections,
                                short_option)
from poprun.plan.config import (COMPARE_HOSTS, FORWARD_ENV_MODES, SSH_KEY_TYPES, STALL_ACTIONS,
                                field_defaults)
from poprun.errors import ConfigError

PROG = "poprun"
COMPLETE_VAR = "_POPRUN_COMPLETE"  # what the completion scripts set; cli._main looks for it
SHELLS = ("bash", "zsh", "fish")

USAGE = "[options] program [program args]"
DESCRIPTION = (
    "Launch instances of a program (with replicas divided among them) on this host or, over "
    "SSH, on others, without MPI. Everything after the program name is passed to it untouched."
    "\n\n"
    "Values: --opt=value or --opt value; BOOL options take yes/no, true/false, on/off, 1/0 (a "
    "bare one means yes); switches (no value shown: --dry-run, --check...) take no value, so "
    "the word after one is the program; any unambiguous prefix of an option works.")
EPILOG = (
    "Exit status: 0 when every instance exits 0 (success; --result-json's exit_class names "
    "each case, for a scheduler to act on); otherwise the status of the instance that failed "
    "first (its root cause; 128+N for signal N: program), 255 when that was a lost host and "
    "no spare host was left (host_lost); with --max-restarts, the last attempt's "
    "(restarts_spent), but 78 when every attempt failed the same way or the last made no "
    "progress (popdist.progress) beyond an earlier one: do not requeue (do_not_requeue); "
    "128+N when poprun is stopped by signal N (signal), 74 when output could not be written "
    "(a full disk: output_error), 124 when --stall-action kill ended a stalled job (stall), "
    "2 for a usage error or a job that could not start (usage_error), 70 for an internal "
    "error (a bug: see the crash file named: internal_error). --check: 0 ready and alike, "
    "10 different, 20 unreachable, 30 cannot run the job. In pod mode, a follower pod "
    "exits 69 when its leader was lost (docs/kubernetes.md).")


def _placements() -> list[str]:
    from poprun.plan.placement import Strategy

    return [s.value for s in Strategy]


def _offline_targets() -> list[str]:
    from poprun.plan.poplar import OFFLINE_TARGETS

    return list(OFFLINE_TARGETS)


# Values completed after an option, from the definitions the launch checks them against.
_CHOICES: dict[str, Callable[[], list[str]]] = {
    "process-placement": _placements,
    "offline-target": _offline_targets,
    "distribute-ssh-key-type": lambda: list(SSH_KEY_TYPES),
    "forward-env": lambda: list(FORWARD_ENV_MODES),
    "stall-action": lambda: list(STALL_ACTIONS),
    "compare-hosts": lambda: list(COMPARE_HOSTS),
    "show-completion": lambda: list(SHELLS),
    "install-completion": lambda: list(SHELLS),
}
_ACTION_METAVARS = {"show-completion": "[SHELL]", "install-completion": "[SHELL]"}
_TYPES = {Kind.INT: int, Kind.FLOAT: float, Kind.STR: str, Kind.BOOL: bool, Kind.SWITCH: bool,
          Kind.LIST: list[str], Kind.COUNT: int, Kind.ACTION: bool}


# --- the typer app ------------------------------------------------------------------------


class _Command(typer.core.TyperCommand):
    """poprun's usage line: the program and its arguments are not typer's to describe."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        return [USAGE]


def _complete_choices(long: str) -> Callable[[str], list[str]]:
    def complete(incomplete: str) -> list[str]:
        return [c for c in _CHOICES[long]() if c.startswith(incomplete)]
    return complete


def shown_default(opt: Opt, defaults: dict[str, object]) -> str | None:
    """The default `--help` shows for `opt` (man poprun too), as a user writes it; None where
    it shows none (no default, an empty one, a count)."""
    default = defaults.get(opt.name, opt.default)
    if default in (None, (), False, 0) or opt.kind is Kind.COUNT:
        return None
    return "yes" if default is True else str(default)  # typer would show "True"


def metavar(opt: Opt) -> str:
    """How `--help` (and man poprun) shows the option's value: "" for none."""
    return _ACTION_METAVARS.get(opt.long, opt.kind.metavar)


def _parameter(opt: Opt, panel: str, defaults: dict[str, object]) -> inspect.Parameter:
    shown = shown_default(opt, defaults) is not None
    default = defaults.get(opt.name, opt.default)
    option = typer.Option(
        f"--{opt.long}", *([f"-{opt.short}"] if opt.short else []),
        help=escape(opt.help),  # help texts are plain text, not rich markup: `[1,<i>]`
        rich_help_panel=panel,
        metavar=metavar(opt),  # "": no value
        show_default=shown,
        count=opt.kind is Kind.COUNT,
        autocompletion=_complete_choices(opt.long) if opt.long in _CHOICES else None,
    )
    return inspect.Parameter(opt.long.replace("-", "_"), inspect.Parameter.KEYWORD_ONLY,
                             annotation=Annotated[_TYPES[opt.kind], option],
                             default=("yes" if default is True else default) if shown else None)


def app() -> typer.Typer:
    """The typer app of poprun's options, for help and completion only (its command does
    nothing: options.parse_args parses)."""
    defaults = field_defaults()
    parameters = [_parameter(opt, panel, defaults)
                  for panel, opts in sections() for opt in opts]

    def poprun(**_: Any) -> None:
        """Never called."""

    poprun.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    poprun.__annotations__ = {p.name: p.annotation for p in parameters}
    typer_app = typer.Typer(add_completion=False, rich_markup_mode="rich")
    typer_app.command(PROG, cls=_Command, help=DESCRIPTION, epilog=EPILOG,
                      add_help_option=False)(poprun)
    return typer_app


def command() -> typer.core.TyperCommand:
    return typer.main.get_command(app())  # type: ignore[return-value]


# --- the actions ---------------------------------------------------------------------------


def action(parsed: Parsed) -> int:
    """Carry out the command line's action: --help/-h, --show-completion, --install-completion
    (the shell may follow as `--show-completion=zsh` or as the next word)."""
    if parsed.action == "help":
        return show_help()
    inline = parsed.values.get(parsed.action.replace("-", "_"))
    words = ([str(inline)] if inline else []) + parsed.program
    if len(words) > 1:
        raise ConfigError(f"--{parsed.action} takes one shell name, got {' '.join(words)!r}")
    return completion_action(parsed.action, words[0] if words else None)


# --- help ---------------------------------------------------------------------------------


def show_help() -> int:
    """`poprun --help`: typer's rich panels on a terminal (its width; colour by rich's rules:
    NO_COLOR, FORCE_COLOR, TERM=dumb); elsewhere the same layout as plain text: no ANSI, no
    trailing spaces, $COLUMNS or 80 columns wide."""
    from rich.console import Console

    if Console().is_terminal:
        cmd = command()
        cmd.format_help(_context(cmd), None)  # type: ignore[arg-type]
    else:
        sys.stdout.write(help_text(encoding=sys.stdout.encoding))
    return 0


def help_text(width: int | None = None, encoding: str | None = "utf-8") -> str:
    """The help as plain text, `width` columns wide (default: $COLUMNS, else 80); box lines in
    ASCII unless `encoding` is a UTF one."""
    from typer import rich_utils

    cmd = command()
    saved = rich_utils.COLOR_SYSTEM, rich_utils.FORCE_TERMINAL, rich_utils.MAX_WIDTH
    out = _Buffer(encoding or "ascii")
    try:
        rich_utils.COLOR_SYSTEM, rich_utils.FORCE_TERMINAL = None, False
        rich_utils.MAX_WIDTH = width or _columns()
        with contextlib.redirect_stdout(out):
            cmd.format_help(_context(cmd), None)  # type: ignore[arg-type]
    finally:
        rich_utils.COLOR_SYSTEM, rich_utils.FORCE_TERMINAL, rich_utils.MAX_WIDTH = saved
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    while lines and not lines[0]:
        del lines[0]
    return "\n".join(lines).rstrip("\n") + "\n"


class _Buffer(io.StringIO):
    """A string buffer that tells rich which encoding the text is for (boxes: UTF or ASCII)."""

    def __init__(self, encoding: str) -> None:
        super().__init__()
        self._encoding = encoding

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding


def _columns() -> int:
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else 80


def _context(cmd: typer.core.TyperCommand) -> typer.Context:
    return cmd.context_class(cmd, info_name=PROG)  # type: ignore[return-value]


# --- completion ---------------------------------------------------------------------------


class _BoostResolution:
    """Completions for poprun's command line as options.parse_args reads it (mixed into typer's
    per-shell classes, which read the shell's words and format the answer)."""

    cli: typer.core.TyperCommand

    def get_completions(self, args: list[str], incomplete: str) -> list[Any]:
        state = _state(args)
        if state is None:  # the program or its arguments: the shell completes files
            return []
        if isinstance(state, Opt):  # the value of the option before
            return self._values(state, incomplete, inline=False)
        if incomplete.startswith("--") and "=" in incomplete:  # `--opt=val`
            name, _, value = incomplete.partition("=")
            opt = _option(name)
            return [] if opt is None else [
                _item(f"{name}={i.value}") for i in self._values(opt, value, inline=True)]
        if incomplete.startswith("-"):
            return [_item(f"-{o.short}" if f"-{o.short}" == incomplete else f"--{o.long}",
                          escape(o.help)) for o in OPTIONS
                    if f"--{o.long}".startswith(incomplete) or f"-{o.short}" == incomplete]
        return []  # the program name: the shell completes files

    def _values(self, opt: Opt, incomplete: str, inline: bool) -> list[Any]:
        """Values of `opt` starting with `incomplete`; none where the shell should complete
        file names (paths, free text)."""
        if opt.kind in (Kind.BOOL, Kind.SWITCH):  # only inline: `--offline-mode yes` may be
            # a program (and after a switch, the word is the program)
            return [_item(w) for w in BOOL_WORDS if inline and w.startswith(incomplete)]
        param = next(p for p in self.cli.params if p.opts[0] == f"--{opt.long}")
        return [item for item in param.shell_complete(_context(self.cli), incomplete)
                if item.type == "plain"]


def _item(value: str, help: str | None = None) -> Any:
    from typer._click.shell_completion import CompletionItem

    return CompletionItem(value, help=help)


def _option(token: str) -> Opt | None:
    """The option a word names, as the parser resolves it (prefixes too), if it names one."""
    if not token.startswith("-") or len(token) < 2:
        return None
    try:
        return resolve_long(token[2:]) if token.startswith("--") else short_option(token)[0]
    except ConfigError:
        return None


def _takes_value(opt: Opt) -> bool:
    """Whether the word after `opt` is its value: as the parser reads it, or (the completion
    actions) the shell it names."""
    return opt.kind in (Kind.INT, Kind.FLOAT, Kind.STR, Kind.LIST) or opt.long in _CHOICES


def _state(args: list[str]) -> Opt | bool | None:
    """After the complete words `args`: the option whose value comes next, None once the
    program has started, else True (an option or the program may come next)."""
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--" or not tok.startswith("-") or tok == "-":
            return None
        opt = _option(tok.partition("=")[0])
        if opt is None:
            return True  # an unknown option: poprun will say so; keep offering options
        inline = "=" in tok or (len(tok) > 2 and not tok.startswith("--"))
        if _takes_value(opt) and not inline:
            if i + 1 == len(args):
                return opt
            i += 1
        elif (opt.kind is Kind.BOOL and not inline and i + 1 < len(args)
              and args[i + 1].lower() in BOOL_WORDS):
            i += 1
        i += 1
    return True


class _Bash(_BoostResolution, BashComplete):
    """bash splits words at `=` too (`-x A=1` comes as `-x` `A` `=` `1`) and replaces only the
    text after the last `=` of the word being completed: join the words again, complete the
    whole word, answer the part after its last `=`."""

    def get_completions(self, args: list[str], incomplete: str) -> list[Any]:
        words: list[str] = []
        glue = False
        for word in [*args, incomplete]:
            if word == "=" and words:
                words[-1] += word
                glue = True
            elif glue:
                words[-1] += word
                glue = False
            else:
                words.append(word)
        incomplete = words.pop()
        cut = incomplete.rfind("=") + 1
        return [_item(item.value[cut:], item.help)
                for item in super().get_completions(words, incomplete)
                if item.value.startswith(incomplete[:cut])]


class _Zsh(_BoostResolution, ZshComplete):
    pass


class _Fish(_BoostResolution, FishComplete):
    pass


_COMPLETERS = {cls.name: cls for cls in (_Bash, _Zsh, _Fish)}


def complete(instruction: str) -> int:
    """Answer a completion script's request: `complete_<shell>` (the words come in the
    environment variables the script sets) or `source_<shell>` (the script)."""
    what, _, shell = instruction.partition("_")
    cls = _COMPLETERS.get(shell)
    if cls is None or what not in ("complete", "source"):
        sys.stderr.write(f"poprun: error: unsupported completion request {instruction!r}\n")
        return 1
    completer = cls(command(), {}, PROG, COMPLETE_VAR)
    try:
        with _unwrapped_help(shell):
            answer = completer.source() if what == "source" else completer.complete()
    except SystemExit as exc:  # fish's "is-args" question is answered by the exit status
        return exc.code if isinstance(exc.code, int) else 1
    sys.stdout.write(answer + "\n")
    return 0


@contextlib.contextmanager
def _unwrapped_help(shell: str) -> Iterator[None]:
    """zsh and fish show each option's help beside it, passed through rich, which would wrap it
    at 80 columns. (bash shows none: its answers skip importing rich's help renderer.)"""
    if shell == "bash":
        yield
        return
    from typer import rich_utils

    saved, rich_utils.MAX_WIDTH = rich_utils.MAX_WIDTH, 100_000
    try:
        yield
    finally:
        rich_utils.MAX_WIDTH = saved


def completion_script(shell: str) -> str:
    return _COMPLETERS[shell](command(), {}, PROG, COMPLETE_VAR).source().strip() + "\n"


def completion_action(action: str, shell: str | None) -> int:
    """`--show-completion [SHELL]` prints the script; `--install-completion [SHELL]` installs it
    where the shell reads it. Without SHELL, the shell poprun runs under."""
    shell = shell or _get_shell_name()
    if shell not in SHELLS:
        what = f"{shell} is not a shell poprun completes" if shell else "no shell detected"
        raise ConfigError(f"--{action}: {what}; name one: bash, zsh or fish")
    if action == "show-completion":
        sys.stdout.write(completion_script(shell))
        return 0
    _, path = install(shell=shell, prog_name=PROG, complete_var=COMPLETE_VAR)
    sys.stdout.write(f"poprun: {shell} completion installed in {path}; it takes effect in "
                     "new shells\n")
    return 0
