"""The benchmark's one command in quick mode (issue 18): `python bench/run_all.py --quick`
writes results.md and results.png (and results.json) naming every side that is installed and
saying "skipped" for those that are not. Timings are not judged here: that is the page's job,
on a quiet machine. Quick mode keeps the SSH fan-out small (4 loopback hosts x 2 instances).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN_ALL = REPO / "bench" / "run_all.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Quick mode takes ~1 min here; bound it generously for a loaded CI machine.
TIMEOUT = 400


def installed_sides() -> dict[str, bool]:
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return {
        "poprun": True,  # the package under test; run_all finds its script beside the interpreter
        "mpirun": shutil.which("mpirun") is not None,
        "torchrun": os.access(beside, os.X_OK) or importlib.util.find_spec("torch") is not None,
    }


@pytest.mark.timeout(TIMEOUT + 30)
def test_quick_run_writes_page_and_chart_with_every_side(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        reason = "matplotlib not installed (pip install -e '.[test]' brings the bench extra)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must run this test", pytrace=False)
        pytest.skip(reason)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(RUN_ALL), "--quick", "--out", str(out), "--tmpdir", str(tmp_path)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]

    page = (out / "results.md").read_text()
    png = (out / "results.png").read_bytes()
    doc = json.loads((out / "results.json").read_text())
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000

    assert doc["quick"] is True and "Quick run" in page
    # Every scenario ran to the end (the slurm one may say it is skipped, not fail).
    for name in ("launch", "output", "ssh", "teardown", "slurm"):
        assert name in doc["scenarios"], name
        assert "error" not in doc["scenarios"][name], doc["scenarios"][name].get("traceback")

    rows = {line.split("|")[1].strip(): line for line in page.splitlines()
            if line.startswith("| ") and line.count("|") == 4}
    for name, here in installed_sides().items():
        assert doc["sides"][name]["available"] is here, (name, doc["sides"][name])
        assert name in rows, f"the Sides table has no row for {name}"
        if here:
            assert "skipped" not in rows[name], rows[name]
            # It ran: it has runs in the launch scenario and in the teardown/RSS one.
            for sides in ([s for c in doc["scenarios"]["launch"]["cases"] for s in c["sides"]],
                          doc["scenarios"]["teardown"]["sides"]):
                assert any(s["name"] == name and s["runs"] for s in sides), name
            assert f"| {name} |" in page.split("## Launcher peak RSS")[1]
        else:
            assert "**skipped**" in rows[name], rows[name]
    assert "**skipped**" not in rows["no launcher"]

    # The launch and output tables name each launcher that ran, and the targets are on the page.
    launch_header = page.split("## Launch latency")[1].split("\n| N |")[1].split("\n")[0]
    for name, here in installed_sides().items():
        assert (name in launch_header) is here, launch_header
    assert "## Targets" in page and "launch ×8" in page
    assert (out / "results.png").name in page
