"""The live panel in a real launch on a real pseudo-terminal: instance lines pass through intact
above it, it is gone (cursor shown) at the end, and without a terminal (or with CI set) there
is no panel and no escape code at all."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import OFFLINE, run_poprun
from terminal import run_on_a_terminal, run_with_stdout_piped
from test_dashboard import Screen

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
PROGRAM = ("import os, time\n"
           "for i in range(6):\n"
           "    print(f\"out-{os.environ['RANK']}-{i}\", flush=True); time.sleep(0.15)\n")
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def plain_lines(raw: bytes) -> list[str]:
    return [line.decode() for line in re.split(rb"\r*\n|\r", ANSI.sub(b"", raw))]


def test_panel_shows_while_lines_pass_through_intact():
    code, raw = run_on_a_terminal(*OFFLINE, "--num-instances=2", "--num-replicas=2", PY, "-c",
                                  PROGRAM)
    assert code == 0, raw[-2000:]
    assert b"instances: 2" in raw and b"partition: offline" in raw  # the panel was drawn
    lines = plain_lines(raw)
    for rank in (0, 1):
        for i in range(6):
            assert lines.count(f"out-{rank}-{i}") == 1, (rank, i)  # once, whole, unprefixed
    # erased at the end, cursor shown again, and a one-line summary of the success
    end = raw.rstrip().rpartition(b"\x1b[?25h")[2]
    assert re.fullmatch(rb"poprun: 2 instance\(s\) on 1 host\(s\) finished, all with status 0,"
                        rb" in \ds \(launched in \d\.\ds\)", end), end


@pytest.mark.parametrize("how", [{"CI": "true"}, {"POPRUN_NO_DASHBOARD": "1"}, "--no-dashboard"])
def test_no_panel_when_told_so(how):
    args, env = ((how,), None) if isinstance(how, str) else ((), how)
    code, raw = run_on_a_terminal(*OFFLINE, *args, "--num-instances=2", "--num-replicas=2", PY,
                                  "-c", PROGRAM, env=env)
    assert code == 0
    assert b"\x1b[" not in raw
    assert sorted(plain_lines(raw))[-12:] == sorted(f"out-{r}-{i}" for r in (0, 1)
                                                    for i in range(6))


def test_no_panel_and_no_escape_codes_when_stderr_is_not_a_terminal():
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", PY, "-c", PROGRAM)
    assert proc.returncode == 0
    assert b"\x1b" not in proc.stdout + proc.stderr


# --- the dashboard never hides output ---------------------------------------------------------


def test_no_panel_when_stdout_is_piped_and_stderr_a_terminal():
    """`poprun ... | tee log`: tee writes the program's lines to the screen; a panel on
    stderr erased them (every program line vanished from the screen)."""
    code, terminal, piped = run_with_stdout_piped(*OFFLINE, "--num-instances=2",
                                                  "--num-replicas=2", PY, "-c", PROGRAM)
    assert code == 0, terminal
    assert b"\x1b[" not in terminal and b"instances:" not in terminal
    assert sorted(piped.decode().splitlines()) == sorted(f"out-{r}-{i}" for r in (0, 1)
                                                         for i in range(6))


def test_dashboard_forces_the_panel_with_stdout_piped():
    code, terminal, piped = run_with_stdout_piped(*OFFLINE, "--dashboard", "--num-instances=2",
                                                  "--num-replicas=2", PY, "-c", PROGRAM,
                                                  env={"CI": "true"})
    assert code == 0, terminal
    assert b"instances: 2" in terminal and terminal.rstrip().count(b"\x1b[?25h") == 1
    assert len(piped.decode().splitlines()) == 12


def test_after_clear_no_frame_is_pushed_into_tmux_scrollback():
    """After `clear` the panel's first line is the screen's top-left corner, where tmux takes
    "erase below" for a clear and keeps the frame in its scrollback: every redraw left one."""
    code, raw = run_on_a_terminal(*OFFLINE, "--num-instances=2", "--num-replicas=2", PY, "-c",
                                  PROGRAM, rows=40)
    assert code == 0, raw[-2000:]
    screen = Screen()  # a fresh terminal: the first byte lands at the top-left corner
    screen.feed(raw.replace(b"\r\n", b"\n"))
    assert screen.cleared_from_home == 0
    shown = [line for line in screen.lines if line]
    assert sorted(shown[:-1]) == sorted(f"out-{r}-{i}" for r in (0, 1) for i in range(6))
    assert shown[-1].startswith("poprun: 2 instance(s) on 1 host(s) finished")


def test_the_first_frame_shows_the_cache_that_will_exist(tmp_path):
    cache = tmp_path / "exe-cache"
    code, raw = run_on_a_terminal(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                  f"--executable-cache-path={cache}", PY, "-c", PROGRAM,
                                  columns=250)
    assert code == 0, raw[-2000:]
    first = re.split(rb"\x1b\[\d+A", raw.split(b"\x1b[?25l", 1)[1], 1)[0]  # to an erase
    assert f"cache: {cache}".encode() in ANSI.sub(b"", first), first


def test_the_topology_table_is_not_erased_by_the_panel():
    """--print-topology wrote past the panel, which then erased the table's lines."""
    code, raw = run_on_a_terminal(*OFFLINE, "--print-topology=yes", "--num-instances=2",
                                  "--num-replicas=2", PY, "-c", PROGRAM, rows=40)
    assert code == 0, raw[-2000:]
    screen = Screen()
    screen.feed(raw.replace(b"\r\n", b"\n"))
    shown = [line for line in screen.lines if line]
    assert shown[:11] == [" ===================", "|  poprun topology  |",
                          "|===================|", "| hosts     |  [0]  |",
                          "|-----------|-------|", "| ILDs      |   0   |",
                          "|-----------|-------|", "| instances | 0 | 1 |",
                          "|-----------|-------|", "| replicas  | 0 | 1 |",
                          " -------------------"], shown
    assert sorted(shown[12:-1]) == sorted(f"out-{r}-{i}" for r in (0, 1) for i in range(6))


def test_the_panel_names_a_failed_instance_s_exception(tmp_path):
    """Instance 1 raises; instance 0 holds out through the kill timeout, so the panel is
    drawn while the job stops: the failed row shows the exception, not a status alone.
    Instance 1 raises only once instance 0 ignores SIGTERM (it says so with a file): on a
    loaded machine, the stop could otherwise reach instance 0 before its own first line."""
    script = tmp_path / "train.py"
    ready = tmp_path / "holding-out"
    script.write_text("import os, signal, sys, time\nimport popdist\n"
                      "def step():\n    raise ValueError('loss is NaN')\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    deadline = time.monotonic() + 20\n"
                      "    while not os.path.exists(sys.argv[1]):\n"
                      "        assert time.monotonic() < deadline, 'instance 0 never ready'\n"
                      "        time.sleep(0.01)\n"
                      "    step()\n"
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "open(sys.argv[1], 'w').close()\ntime.sleep(60)\n")
    code, raw = run_on_a_terminal(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                  "--kill-timeout=1.5", PY, str(script), str(ready))
    assert code == 1, raw[-2000:]
    rows = [line for line in plain_lines(raw) if re.match(r"\s*1 +localhost +\d+ +failed 1 ",
                                                          line)]
    assert rows and all(row.rstrip().endswith("ValueError: loss is NaN (train.py:4, in step)")
                        for row in rows), rows
