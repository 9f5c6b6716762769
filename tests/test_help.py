"""`poprun --help`/`-h` and shell completion, rendered by typer from the one option table.

Help runs the real command through a pipe (plain text) and on a pseudo-terminal (rich). The
completion tests speak each shell's protocol to the real command the way its script does
(environment variables in, candidates out), and where the shell is installed, source the script
printed by `--show-completion` in that shell and complete through it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, poprun_argv, poprun_env, run_poprun
from poprun.cli import options as cli
from poprun.cli.help import help_text
from requires import skip_or_fail

pytestmark = pytest.mark.timeout(60)
SGR = re.compile(rb"\x1b\[[0-9;]*m")
COLOUR = re.compile(rb"\x1b\[[0-9;]*(3[0-9]|9[0-7])[0-9;]*m")  # a foreground colour
HEADINGS = tuple(cli.SECTIONS.values())
# What decides layout and colour, cleared so that the caller's environment does not.
CLEAR = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLORTERM", "COLUMNS",
         "TERMINAL_WIDTH", "GITHUB_ACTIONS", "PY_COLORS", "_POPRUN_COMPLETE")


def env(**extra: str) -> dict[str, str]:
    base = poprun_env()
    for name in CLEAR:
        base.pop(name, None)
    base.update(extra)
    return base


def help_out(*args: str, **extra: str) -> str:
    proc = subprocess.run(poprun_argv(*args), env=env(**extra), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""
    return proc.stdout.decode()


# --- --help -------------------------------------------------------------------------------


class TestHelp:
    def test_lists_every_option_and_section_through_a_pipe_as_plain_text(self):
        out = help_out("--help", COLUMNS="100")
        assert out.startswith(" Usage: poprun [options] program [program args]\n")
        assert "\x1b" not in out
        for opt in cli.OPTIONS:
            assert f"--{opt.long}" in out, opt.long
            if opt.short:
                assert re.search(rf"--{opt.long}\s+-{opt.short}\s", out), opt.long
        for heading in HEADINGS:
            assert f"─ {heading} ─" in out, heading
        assert out.index("─ General ─") < out.index("─ The job ─") < out.index("─ Messages")
        assert "Exit status: 0 when every instance exits 0" in out
        assert not any(line != line.rstrip() for line in out.splitlines())

    def test_options_appear_in_their_sections_in_table_order(self):
        out = help_out("--help", COLUMNS="100")
        positions = [re.search(rf"^│ --{opt.long}\s", out, re.M).start()
                     for opt in cli.OPTIONS]
        assert positions == sorted(positions)
        for long, heading in cli.SECTIONS.items():
            before = out.rindex("╭─", 0, positions[[o.long for o in cli.OPTIONS].index(long)])
            assert out.startswith(f"╭─ {heading} ─", before), long

    def test_value_placeholders_and_defaults(self):
        out = help_out("--help", COLUMNS="100")
        assert re.search(r"--num-instances\s+INT\s", out)
        assert re.search(r"--kill-timeout\s+SECONDS\s", out)
        assert re.search(r"--executable-cache-path\s+ARG\s", out)
        assert re.search(r"--offline-mode\s+BOOL\s", out)
        assert re.search(r"--env\s+-x\s+ARG\s", out)
        assert re.search(r"--show-completion\s+\[SHELL\]\s", out)
        assert re.search(r"--help\s+-h\s+Show this help", out)  # no value: no placeholder
        assert re.search(r"--verbose\s+-v\s+Verbose output", out)
        assert "[default: 5.0]" in out  # --kill-timeout
        assert "[default: yes]" in out  # --remove-partition, as a user writes it
        assert "[1,<instance>]<stdout|stderr>:" in out  # help text is not rich markup

    @pytest.mark.parametrize("columns", [80, 100, 132])
    def test_wraps_at_the_width_of_columns(self, columns):
        out = help_out("--help", COLUMNS=str(columns))
        widths = [len(line) for line in out.splitlines()]
        assert max(widths) == columns
        # words are wrapped whole: every option's name is on one line
        for opt in cli.OPTIONS:
            assert re.search(rf"(^|\s)--{opt.long}(\s|$)", out, re.M), opt.long

    def test_wider_is_shorter(self):
        assert (len(help_out("--help", COLUMNS="80").splitlines())
                > len(help_out("--help", COLUMNS="100").splitlines()))

    def test_short_h_is_help_and_a_program_s_h_is_the_program_s(self, tmp_path):
        assert help_out("-h") == help_out("--help")
        assert cli.parse_args(["-h"]).action == "help"
        parsed = cli.parse_args(["--num-instances=2", "prog", "-h"])
        assert parsed.action is None and parsed.program == ["prog", "-h"]
        proc = run_poprun(*OFFLINE, "--dry-run", "--json", sys.executable, "-h", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr.decode()
        assert b'"-h"' in proc.stdout

    def test_in_process_rendering_is_what_a_pipe_gets(self):
        assert help_text(100) == help_out("--help", COLUMNS="100")

    def test_ascii_boxes_for_an_ascii_stream(self):
        out = help_out("--help", COLUMNS="100", PYTHONIOENCODING="ascii")
        out.encode("ascii")
        assert "+- General -" in out

    def test_rich_on_a_terminal_by_rich_s_rules(self):
        out = on_terminal("--help", columns=100)
        assert COLOUR.search(out)
        lines = SGR.sub(b"", out).decode().splitlines()
        assert max(len(line) for line in lines) == 100  # the terminal's width
        assert any("─ Hosts (over SSH) ─" in line for line in lines)
        no_colour = on_terminal("--help", columns=100, NO_COLOR="1")
        assert not COLOUR.search(no_colour)
        assert SGR.sub(b"", no_colour) == SGR.sub(b"", out)
        assert not SGR.search(on_terminal("-h", columns=100, TERM="dumb"))

    def test_help_beats_everything_after_it(self):
        assert help_out("--help", "--show-completion", "bash", COLUMNS="100") == help_out(
            "--help", COLUMNS="100")


def on_terminal(*args: str, columns: int, **extra: str) -> bytes:
    """Stdout on a pseudo-terminal `columns` wide; what poprun wrote there."""
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # bytes read are bytes written
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    environ = env(**{"TERM": "xterm-256color", **extra})
    proc = subprocess.Popen(poprun_argv(*args), stdout=slave, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=environ)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=30) == 0
    return out


# --- completion scripts -------------------------------------------------------------------


SHELLS = ("bash", "zsh", "fish")


class TestScripts:
    @pytest.mark.parametrize("shell", SHELLS)
    def test_show_completion_prints_the_shell_s_script(self, shell):
        out = help_out("--show-completion", shell)
        assert f"_POPRUN_COMPLETE=complete_{shell}" in out
        assert help_out(f"--show-completion={shell}") == out
        assert help_out("--show-c", shell) == out  # a prefix, like any option

    def test_show_completion_detects_the_shell_poprun_runs_under(self):
        bash = shutil.which("bash")
        if bash is None:
            skip_or_fail("no bash", "POPRUN_REQUIRE_TOOLS")
        proc = subprocess.run([bash, "-c", " ".join(poprun_argv("--show-completion")) + "; :"],
                              env=env(), stdout=subprocess.PIPE, timeout=30)
        assert b"_POPRUN_COMPLETE=complete_bash" in proc.stdout

    @pytest.mark.parametrize("args, fragment", [
        (["--show-completion", "tcsh"], "tcsh is not a shell poprun completes"),
        (["--show-completion", "bash", "zsh"], "takes one shell name"),
        (["--install-completion=csh"], "csh is not a shell"),
    ])
    def test_unknown_shell_is_a_usage_error(self, args, fragment):
        assert_usage_error(run_poprun(*args, env=env()), fragment)

    @pytest.mark.parametrize("shell, path", [
        ("bash", ".bash_completions/poprun.sh"), ("zsh", ".zfunc/_poprun"),
        ("fish", ".config/fish/completions/poprun.fish")])
    def test_install_completion_writes_the_script_where_the_shell_reads_it(
            self, shell, path, tmp_path):
        proc = run_poprun("--install-completion", shell, env=env(HOME=str(tmp_path)))
        assert proc.returncode == 0, proc.stderr.decode()
        assert str(tmp_path / path).encode() in proc.stdout
        assert (tmp_path / path).read_text().strip() == help_out("--show-completion",
                                                                 shell).strip()
        if shell == "bash":
            assert f"source '{tmp_path / path}'" in (tmp_path / ".bashrc").read_text()


# --- the completion protocol --------------------------------------------------------------


def complete_bash(line: str) -> list[str]:
    """Candidates for the last word of `line`, asked as the bash script asks: the words split
    as bash splits them (at `=` too), the cursor's word index."""
    words = line.replace("=", " = ").split()
    if line.endswith(" "):
        words.append("")
    proc = subprocess.run(poprun_argv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env(_POPRUN_COMPLETE="complete_bash", COMP_WORDS=" ".join(words),
                                  COMP_CWORD=str(len(words) - 1)), timeout=30)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
    return proc.stdout.decode().split()


BASH_CASES = {
    "poprun --num-i": ["--num-instances", "--num-ilds"],
    "poprun --num-in": ["--num-instances"],
    "poprun --ver": ["--version", "--version-format", "--verbose"],
    "poprun -x": ["-x"],
    "poprun --process-placement s": ["spreadnuma", "scatternuma", "scattersocket"],
    "poprun --proc c": ["close"],  # the option by its prefix, as the parser reads it
    "poprun --process-placement=sc": ["scatternuma", "scattersocket"],
    "poprun --offline-target bow-pod1": ["bow-pod16", "bow-pod128"],
    "poprun --distribute-ssh-key-type e": ["ecdsa", "ed25519"],
    "poprun --offline-mode=": ["yes", "true", "on", "1", "no", "false", "off", "0"],
    "poprun --offline-mode=y": ["yes"],
    "poprun --show-completion ": ["bash", "zsh", "fish"],
    "poprun --num-instances 2 -x A=1 --offline-mode yes --tag": ["--tag-output"],
    "poprun -v --vv -H h1,h2 --timestamp": ["--timestamp-output"],
    "poprun -x A=1 --env=B=2 --ta": ["--tag-output"],  # values with `=` in them
    # the shell's file completion: a path, free text, the program, the program's arguments
    "poprun --host-file ": [],
    "poprun --output-filename=": [],
    "poprun --num-instances ": [],
    "poprun ": [],
    "poprun --offline-mode ": [],  # a boolean word or the program: the shell's files
    "poprun prog --num": [],
    "poprun --offline-mode yes prog -": [],
    "poprun -- --num": [],
}


class TestProtocol:
    @pytest.mark.parametrize("line", BASH_CASES)
    def test_bash(self, line):
        assert complete_bash(line) == BASH_CASES[line]

    def test_zsh(self):
        def ask(line: str) -> str:
            proc = subprocess.run(poprun_argv(), stdout=subprocess.PIPE, timeout=30, env=env(
                _POPRUN_COMPLETE="complete_zsh", _TYPER_COMPLETE_ARGS=line))
            assert proc.returncode == 0
            return proc.stdout.decode()

        out = ask("poprun --num-in")
        assert out.startswith("_arguments '*: :((") and '"--num-instances":' in out
        assert "--num-ilds" not in out
        assert '"--process-placement=close"' in ask("poprun --process-placement=c")
        assert ask("poprun prog ").strip() == "_files"

    def test_fish(self):
        def ask(line: str, action: str) -> subprocess.CompletedProcess:
            return subprocess.run(poprun_argv(), stdout=subprocess.PIPE, timeout=30, env=env(
                _POPRUN_COMPLETE="complete_fish", _TYPER_COMPLETE_FISH_ACTION=action,
                _TYPER_COMPLETE_ARGS=line))

        out = ask("poprun --num-in", "get-args").stdout.decode()
        assert out == "--num-instances\tThe number of instances\n"
        assert ask("poprun --num-in", "is-args").returncode == 0  # poprun's candidates...
        assert ask("poprun prog ", "is-args").returncode == 1  # ...else fish's files


# --- through the real shells --------------------------------------------------------------


@pytest.fixture
def on_path(tmp_path) -> dict[str, str]:
    """An environment whose PATH finds this checkout's poprun as `poprun`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "poprun"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m poprun "$@"\n')
    script.chmod(0o755)
    environ = env()
    environ["PATH"] = f"{bin_dir}{os.pathsep}{environ['PATH']}"
    return environ


def need(shell: str) -> str:
    path = shutil.which(shell)
    if path is None:
        skip_or_fail(f"{shell} is not installed", "POPRUN_REQUIRE_TOOLS")
    return path


def script_file(shell: str, tmp_path: Path) -> Path:
    path = tmp_path / f"poprun.{shell}"
    path.write_text(help_out("--show-completion", shell))
    return path


class TestShells:
    def test_bash(self, on_path, tmp_path):
        script = script_file("bash", tmp_path)
        program = (f"source {script}\n"
                   "ask() { COMP_WORDS=(\"$@\"); COMP_CWORD=$(($# - 1)); COMPREPLY=();\n"
                   "        _poprun_completion poprun; echo \"${COMPREPLY[*]}\"; }\n"
                   "ask poprun --num-in\n"
                   "ask poprun --process-placement = s\n"
                   "ask poprun prog --num\n"
                   "complete -p poprun\n")
        proc = subprocess.run([need("bash"), "--norc", "-c", program], env=on_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout.decode().splitlines() == [
            "--num-instances", "spreadnuma scatternuma scattersocket", "",
            # -o default: with no candidates, bash completes file names
            "complete -o default -F _poprun_completion poprun"]

    def test_fish(self, on_path, tmp_path):
        script = script_file("fish", tmp_path)
        program = (f"source {script}\n"
                   "complete -C 'poprun --num-in'; echo .\n"
                   "complete -C 'poprun --process-placement=sc'; echo .\n"
                   "complete -C 'poprun --host-file bi'; echo .\n")
        proc = subprocess.run([need("fish"), "--no-config", "-c", program], env=on_path,
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout.decode().split(".\n") == [
            "--num-instances\tThe number of instances\n",
            "--process-placement=scatternuma\n--process-placement=scattersocket\n",
            "bin/\n",  # fish's own file completion
            ""]

    def test_zsh(self, on_path, tmp_path):
        # Outside an interactive completion widget zsh's _arguments and _files cannot run:
        # stand-ins print what the script's answer asks of them.
        script = script_file("zsh", tmp_path)
        program = ("compdef() { :; }\n"
                   "_arguments() { print -r -- \"$@\"; }\n"
                   "_files() { print FILES; }\n"
                   f"source {script}\n"
                   "words=(poprun --num-in); CURRENT=2; _poprun_completion\n"
                   "words=(poprun --process-placement ''); CURRENT=3; _poprun_completion\n"
                   "words=(poprun prog ''); CURRENT=3; _poprun_completion\n")
        proc = subprocess.run([need("zsh"), "-f", "-c", program], env=on_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout.decode().splitlines() == [
            '*: :(("--num-instances":"The number of instances"))',
            '*: :(("spreadnuma" "scatternuma" "scattersocket" "close" "disabled"))',
            "FILES"]
