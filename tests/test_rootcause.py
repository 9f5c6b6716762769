"""The real root cause of a failure: the exception and its line, not just the exit
status; the cause, not the first victim to exit. Real processes, locally and over sshd hosts,
and a real torch.distributed (gloo) job; plus the verdict rules on plain records."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import OFFLINE, run_poprun
from poprun.rootcause import analyze, exception_text
from requires import require_module
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(120)
PY = sys.executable
RAISES = """
import os, time
import popdist

def step(loss):
    if os.environ["RANK"] == "1":
        raise ValueError(f"loss is {loss}")
    time.sleep(300)

step(float("nan"))
"""


def script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def test_the_report_names_the_exception_and_its_line(tmp_path):
    result_json = tmp_path / "result.json"
    proc = run_poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                      f"--result-json={result_json}", PY, script(tmp_path, RAISES))
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert ("poprun: instance 1 (pid " in err and "failed first: ValueError: loss is nan "
            "(train.py:7, in step)" in err), err
    record = json.loads(result_json.read_text())
    assert record["root_cause"] == 1
    error = record["instances"][1]["error"]
    assert (error["type"], error["message"], error["line"], error["function"]) == \
        ("ValueError", "loss is nan", 7, "step")
    assert error["file"] == str(tmp_path / "train.py") and "Traceback" in error["traceback"]
    others = [record["instances"][i] for i in (0, 2)]
    assert all(i["collateral"] == "stopped by poprun after the root cause" for i in others)


def test_a_remote_instances_exception_comes_back(tmp_path):
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = run_poprun(*OFFLINE, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                          PY, script(tmp_path, RAISES), env=hosts.env())
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "instance 1 (pid" in err and "on h2) failed first: ValueError: loss is nan " \
        "(train.py:7, in step)" in err, err


def test_record_opts_in_without_the_hook_and_no_popdist_falls_back(tmp_path):
    """`popdist.record` writes the error for its function; a program that never imports
    popdist gets today's report: the exit status and its stderr tail."""
    # The import installs the hook too: put the interpreter's back, so only @record writes.
    recorded = script(tmp_path, "import sys\nfrom popdist.errorfile import record\n"
                      "sys.excepthook = sys.__excepthook__\n"
                      "@record\ndef main():\n    raise KeyError('missing')\nmain()\n")
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", PY, recorded)
    assert "failed first: KeyError: 'missing' (train.py:6, in main)" in proc.stderr.decode()
    plain = tmp_path / "plain.py"
    plain.write_text("raise KeyError('missing')\n")
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", PY, str(plain))
    err = proc.stderr.decode()
    assert "failed first: exited with status 1" in err and "KeyError: 'missing'" in err


def test_the_hook_is_chained_to_the_program_s_own(tmp_path):
    """A hook the program set before `import popdist` still runs; poprun still gets the
    exception."""
    own = script(tmp_path, "import sys\n"
                 "def mine(kind, value, tb):\n    print('own hook saw', kind.__name__, "
                 "file=sys.stderr)\n"
                 "sys.excepthook = mine\nimport popdist\nraise OSError('disk gone')\n")
    proc = run_poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", PY, own)
    err = proc.stderr.decode()
    assert "failed first: OSError: disk gone (train.py:6, in <module>)" in err, err
    assert "own hook saw OSError" in err


GLOO = """
import os, sys
import popdist, popdist.torch
import torch, torch.distributed as dist

popdist.torch.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("bad batch")
dist.all_reduce(torch.ones(1))  # the others wait here for a peer that is gone
"""


@pytest.mark.timeout(600)
def test_in_a_gloo_job_the_raising_instance_is_the_root_cause_every_time(tmp_path):
    require_module("torch", "POPRUN_REQUIRE_TOOLS", "pip install torch==2.13.0")
    program = script(tmp_path, GLOO)
    for run in range(10):
        result_json = tmp_path / f"result-{run}.json"
        proc = run_poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                          f"--result-json={result_json}", PY, program, timeout=120)
        record = json.loads(result_json.read_text())
        assert record["root_cause"] == 1, (run, proc.stderr.decode()[-3000:])
        assert record["instances"][1]["error"]["type"] == "ValueError"
        for other in (0, 2):
            assert record["instances"][other]["collateral"], (run, record["instances"][other])


# --- the verdict on plain records ---------------------------------------------------------------

@dataclass
class End:
    index: int
    returncode: int
    end_time: float
    stopped_by_poprun: bool = False
    lost: str | None = None
    error: dict[str, Any] | None = None


def err(kind: str, message: str, at: float) -> dict[str, Any]:
    return {"type": kind, "message": message, "time": at, "file": "/x/train.py", "line": 3,
            "function": "f"}


def test_a_victim_that_exits_first_is_not_the_root_cause():
    ends = [End(0, 1, 10.0, error=err("RuntimeError", "[pair.cc:534] Connection closed by "
                                      "peer [127.0.0.1]:4242", 9.9)),
            End(1, 1, 10.2, error=err("ValueError", "bad batch", 9.5)),
            End(2, -15, 10.3, stopped_by_poprun=True)]
    root, collateral = analyze(ends, first=0)
    assert root == 1
    assert collateral == {0: "RuntimeError when a peer went away",
                          2: "stopped by poprun after the root cause"}


def test_the_earliest_own_exception_wins_and_outside_the_window_does_not_count():
    ends = [End(0, 1, 10.0, error=err("KeyError", "a", 9.0)),
            End(1, 1, 10.1, error=err("ValueError", "b", 8.0)),
            End(2, 1, 30.0, error=err("TypeError", "c", 1.0))]  # 20 s later: not weighed
    assert analyze(ends, first=0)[0] == 1


def test_an_exception_crossed_by_poprun_s_signal_is_still_its_own():
    ends = [End(0, 1, 10.0, error=err("ConnectionResetError", "x", 9.9)),
            End(1, 1, 10.1, stopped_by_poprun=True, error=err("ValueError", "own", 9.5))]
    assert analyze(ends, first=0)[0] == 1


def test_without_evidence_the_first_failure_stays_the_root_cause():
    ends = [End(0, 2, 10.0), End(1, 3, 10.1)]
    assert analyze(ends, first=0) == (0, {1: "failed after instance 0"})
    assert analyze([End(0, 0, 1.0)], first=None) == (None, {})


def test_exception_text_names_file_line_and_function():
    assert exception_text(err("ValueError", "loss is NaN", 1.0)) == \
        "ValueError: loss is NaN (train.py:3, in f)"
    assert exception_text({"type": "SystemExit", "message": ""}) == "SystemExit"
