"""Colour where a person reads: `--tag-output` tags, the failure report and the `--check`
table are styled on a terminal, by rich's rules (NO_COLOR, FORCE_COLOR, TERM=dumb, a
non-terminal), and plain text otherwise. Instance output is never styled, decoded or parsed as
markup: its bytes follow the tag's reset untouched. The launches run on real pseudo-terminals.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from rich.color import ColorSystem

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprun
from poprun.run.output import TAG_PALETTE, render_tag
from poprun.view.console import tag_colour_system
from spawner.local import Stream
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
SGR = re.compile(rb"\x1b\[[0-9;]*m")
RESET = b"\x1b[0m"
OUT_LINE = b"[bold]x[/bold] \xff\xfe ok"  # markup-looking text and invalid UTF-8
ERR_LINE = b"err [red]y[/red] \xc3\x28"
PROGRAM = ("import sys\n"
           f"sys.stdout.buffer.write({OUT_LINE!r} + b'\\n'); sys.stdout.flush()\n"
           f"sys.stderr.buffer.write({ERR_LINE!r} + b'\\n'); sys.stderr.flush()\n")
TAGGED = (*OFFLINE, "--tag-output", "--num-instances=2", "--num-replicas=2", PY, "-c", PROGRAM)
# What decides colour, cleared so that the caller's environment does not; a colour terminal.
CLEAR = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLORTERM", "COLUMNS")


def env(**extra: str) -> dict[str, str]:
    base = poprun_env({"POPRUN_NO_DASHBOARD": "1", "TERM": "xterm-256color"})
    for name in CLEAR:
        base.pop(name, None)
    base.update(extra)
    return base


def open_pty() -> tuple[int, int]:
    """A pseudo-terminal with output post-processing off (bytes read are bytes written)."""
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return master, slave


def run(*args: str, environ: dict[str, str], stdout_tty: bool = True, stderr_tty: bool = True,
        timeout: float = 30) -> tuple[int, bytes, bytes]:
    """poprun with its stdout and stderr each on its own pty (or a pipe): (status, out, err),
    each read until every writer has closed it."""
    ends = {}  # name -> (the fd we read, the fd poprun gets)
    for name, tty in (("out", stdout_tty), ("err", stderr_tty)):
        ends[name] = open_pty() if tty else os.pipe()
    proc = subprocess.Popen(poprun_argv(*args), stdin=subprocess.DEVNULL,
                            stdout=ends["out"][1], stderr=ends["err"][1], env=environ)
    for _, write_end in ends.values():
        os.close(write_end)
    got = {name: bytearray() for name in ends}
    reading = {ends[name][0]: name for name in ends}
    deadline = time.monotonic() + timeout
    try:
        while reading:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; read {got!r}"
            for fd in select.select(list(reading), [], [], left)[0]:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: a pty whose every writer has closed it
                    data = b""
                if data:
                    got[reading[fd]] += data
                else:
                    del reading[fd]
    finally:
        for read_end, _ in ends.values():
            os.close(read_end)
        proc.wait(timeout=timeout)
    return proc.returncode, bytes(got["out"]), bytes(got["err"])


def tags(raw: bytes, payload: bytes) -> dict[int, bytes]:
    """Each line is a tag then `payload`: {instance: its tag as written, escapes and all}."""
    found = {}
    for line in raw.splitlines():
        assert line.endswith(payload), line
        tag = line[:-len(payload)]
        index = int(re.fullmatch(rb"\[1,(\d+)\]<std(?:out|err)>:", SGR.sub(b"", tag))[1])
        found[index] = tag
    return found


def plain(stream: str) -> list[bytes]:
    """Today's plain tagged lines, sorted."""
    payload = OUT_LINE if stream == "stdout" else ERR_LINE
    return sorted(b"[1,%d]<%s>:%s" % (i, stream.encode(), payload) for i in (0, 1))


def test_tags_on_a_terminal_get_a_colour_per_instance_and_stream():
    code, out, err = run(*TAGGED, environ=env())
    assert code == 0, err
    out_tags, err_tags = tags(out, OUT_LINE), tags(err, ERR_LINE)
    assert sorted(out_tags) == sorted(err_tags) == [0, 1]
    for tag in (*out_tags.values(), *err_tags.values()):
        assert re.match(rb"\x1b\[(3\d|9\d|38;[25];[\d;]+)m", tag), tag  # starts with a colour
        assert tag.endswith(RESET), tag  # reset before the instance's own bytes
    assert out_tags[0] != out_tags[1] and err_tags[0] != err_tags[1]
    for i in (0, 1):  # same instance, other stream: marked differently
        assert SGR.findall(out_tags[i]) != SGR.findall(err_tags[i])
    # The instances' bytes arrive exactly: markup-looking text and invalid UTF-8 included.
    assert sorted(SGR.sub(b"", out).splitlines()) == plain("stdout")
    assert sorted(SGR.sub(b"", err).splitlines()) == plain("stderr")


@pytest.mark.parametrize("extra", [{"NO_COLOR": "1"}, {"TERM": "dumb"},
                                   {"TTY_COMPATIBLE": "0"}], ids=["NO_COLOR", "dumb", "TTY_0"])
def test_no_colour_where_rich_would_write_none(extra):
    code, out, err = run(*TAGGED, environ=env(**extra))
    assert code == 0, err
    assert sorted(out.splitlines()) == plain("stdout")
    assert sorted(err.splitlines()) == plain("stderr")


def test_not_a_terminal_gets_todays_plain_bytes_and_force_color_colours_it():
    proc = run_poprun(*TAGGED, env=env())
    assert proc.returncode == 0
    assert sorted(proc.stdout.splitlines()) == plain("stdout")
    assert sorted(proc.stderr.splitlines()) == plain("stderr")
    forced = run_poprun(*TAGGED, env=env(FORCE_COLOR="1"))  # rich: a terminal, colours on
    assert forced.returncode == 0
    assert SGR.search(forced.stdout) and SGR.search(forced.stderr)
    assert sorted(SGR.sub(b"", forced.stdout).splitlines()) == plain("stdout")


def test_each_console_stream_decides_on_its_own():
    """stdout to a file, stderr on the terminal: only the stderr tags are coloured."""
    code, out, err = run(*TAGGED, environ=env(), stdout_tty=False)
    assert code == 0, err
    assert sorted(out.splitlines()) == plain("stdout")
    assert SGR.search(err) and sorted(SGR.sub(b"", err).splitlines()) == plain("stderr")


def test_the_program_keeps_its_own_colours_and_timestamps_stay_plain():
    code, out, err = run(*OFFLINE, "--tag-output", "--timestamp-output", "--num-instances=1",
                         "--num-replicas=1", PY, "-c", r"print('\x1b[1;35mmine\x1b[0m')",
                         environ=env())
    assert code == 0, err
    line = out.rstrip(b"\n")
    assert line.endswith(RESET + b"\x1b[1;35mmine\x1b[0m"), line
    assert not line.startswith(b"\x1b"), line  # the timestamp first, uncoloured


def test_failure_report_is_styled_on_a_terminal_only():
    failing = ("import sys; sys.stderr.write('[bold]boom[/bold] \\u2603\\n'); sys.exit(3)",)
    args = (*OFFLINE, "--num-instances=1", "--num-replicas=2", PY, "-c", *failing)
    code, _, err = run(*args, environ=env())
    assert code == 3
    report = err[err.index(b"poprun: instance 0"):]
    assert SGR.search(report), report
    text = SGR.sub(b"", report)
    assert b"failed first: exited with status 3" in text
    assert b"    [bold]boom[/bold] \xe2\x98\x83\n" in text  # the stderr tail as text, not markup
    piped = run_poprun(*args, env=env())
    assert piped.returncode == 3 and b"\x1b" not in piped.stderr
    pids = re.compile(rb"pid \d+")
    assert pids.sub(b"pid N", piped.stderr).endswith(pids.sub(b"pid N", text))  # same words
    code, _, dumb = run(*args, environ=env(TERM="dumb"))
    assert code == 3 and b"\x1b" not in dumb


def test_summary_at_v_is_styled_on_a_terminal():
    code, _, err = run(*OFFLINE, "-v", "--num-instances=2", "--num-replicas=2", PY, "-c", "pass",
                       environ=env())
    assert code == 0
    line = err.splitlines()[-1]
    assert SGR.search(line) and b"poprun: localhost: instances [0-1] exited with status 0" in (
        SGR.sub(b"", line)), err


def test_check_table_is_rich_on_a_terminal_and_plain_otherwise():
    code, out, err = run(*OFFLINE, "--check", environ=env(), stderr_tty=False)
    assert code == 0, (out, err)
    assert SGR.search(out) and b"\xe2\x94\x80" in out  # styled, with a rich table's rule
    text = SGR.sub(b"", out).decode()
    assert re.search(r"HOST\s+SSH\s+PYTHON\s+POPRUN\s+CWD\s+PROGRAM\s+NUMA", text), text
    assert re.search(r"localhost\s+local\s+[\d.]+\s+\S+\s+ok\s+-\s+\d+ node", text), text
    assert "1 of 1 host(s) ready" in text
    piped = run_poprun(*OFFLINE, "--check", env=env())
    lines = piped.stdout.decode().splitlines()
    assert piped.returncode == 0 and b"\x1b" not in piped.stdout
    assert lines[0].split() == ["HOST", "SSH", "PYTHON", "POPRUN", "CWD", "PROGRAM", "NUMA",
                                "REACH"]
    assert lines[1].split()[:2] == ["localhost", "local"] and lines[-1] == "1 of 1 host(s) ready"


def test_check_table_of_remote_hosts_on_a_terminal(tmp_path):
    """Hosts over SSH, one failing (its key unknown): the table, the failure's detail and the
    folded problems, styled, with the same words as the plain report."""
    with start_ssh_hosts(2, tmp_path) as hosts:
        hosts.known_hosts.write_text(hosts.known_hosts.read_text().splitlines()[0] + "\n")
        args = (*OFFLINE, "--check", "-H", "h1,h2", "--ssh-timeout=5")
        code, out, err = run(*args, environ=env(**hosts.env()), stderr_tty=False)
        piped = run_poprun(*args, env=env(**hosts.env()))
    assert code == piped.returncode == 30, (out, err)  # a host that cannot run the job
    text = SGR.sub(b"", out).decode()
    assert SGR.search(out) and "unknown host key: h2" in text and "1 of 2 host(s) ready" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:4]}
    assert rows["h1"][1] == "ok" and rows["h2"][1:4] == ["unknown", "host", "key"], text
    plain_lines = piped.stdout.decode().splitlines()
    assert b"\x1b" not in piped.stdout
    for line in ("unknown host key: h2", "1 of 2 host(s) ready"):  # the same words
        assert line in text.splitlines() and line in plain_lines, (text, plain_lines)


# --- the decision and the tags, in process --------------------------------------------------

@pytest.fixture
def terminal():
    master, slave = open_pty()
    yield slave
    os.close(slave)
    os.close(master)


@pytest.mark.parametrize("environ, system", [
    ({"TERM": "xterm"}, ColorSystem.STANDARD),
    ({"TERM": "xterm-256color"}, ColorSystem.EIGHT_BIT),
    ({"TERM": "xterm", "COLORTERM": "truecolor"}, ColorSystem.TRUECOLOR),
    ({"TERM": "dumb"}, None),
    ({"TERM": "unknown"}, None),
    ({"TERM": "xterm", "NO_COLOR": "1"}, None),
    ({"TERM": "xterm", "TTY_COMPATIBLE": "0"}, None),
])
def test_colour_system_of_a_terminal_follows_rich(terminal, environ, system):
    assert tag_colour_system(terminal, environ) is system


def test_colour_system_of_a_pipe():
    read_end, write_end = os.pipe()
    try:
        assert tag_colour_system(write_end, {"TERM": "xterm-256color"}) is None
        assert tag_colour_system(write_end, {"FORCE_COLOR": "1"}) is not None
        assert tag_colour_system(write_end, {"TTY_COMPATIBLE": "1", "TERM": "xterm"}) is (
            ColorSystem.STANDARD)
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize("system", [ColorSystem.STANDARD, ColorSystem.EIGHT_BIT,
                                    ColorSystem.TRUECOLOR])
def test_tags_differ_between_neighbours_and_streams(system):
    out = [render_tag(i, Stream.STDOUT, system) for i in range(len(TAG_PALETTE) + 1)]
    assert len(set(out[:-1])) == len(TAG_PALETTE)  # every palette colour used once
    assert SGR.match(out[-1])[0] == SGR.match(out[0])[0]  # then it cycles
    for i in range(3):
        err = render_tag(i, Stream.STDERR, system)
        assert SGR.sub(b"", err) == b"[1,%d]<stderr>:" % i and err.endswith(RESET)
        assert SGR.findall(err) != SGR.findall(out[i])
    assert render_tag(3, Stream.STDOUT, None) == b"[1,3]<stdout>:"
