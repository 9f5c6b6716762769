"""The live panel in a real launch on a real pseudo-terminal: instance lines pass through intact
above it, it is gone (cursor shown) at the end, and without a terminal (or with CI set) there
is no panel and no escape code at all."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import OFFLINE, run_poprun
from terminal import run_on_a_terminal

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
    assert raw.rstrip().endswith(b"\x1b[?25h")  # erased at the end, cursor shown again


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
