"""The benchmark's one command in quick mode: `python bench/run_all.py --quick`
writes results.md and results.png (and results.json) naming every side that is installed and
saying "skipped" for those that are not. Timings are not judged here: that is the page's job,
on a quiet machine. Quick mode keeps the SSH fan-out small (4 loopback hosts x 2 instances).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from requires import skip_or_fail

REPO = Path(__file__).resolve().parent.parent
RUN_ALL = REPO / "bench" / "run_all.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Quick mode takes ~1 min here; bound it generously for a loaded CI machine.
TIMEOUT = 400


def installed_sides() -> dict[str, bool]:
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return {
        "poprun": True,  # the package under test; run_all finds its script beside the interpreter
        "mpirun": os.access(_bench("launch_bench").open_mpi_mpirun(), os.X_OK),
        "torchrun": os.access(beside, os.X_OK) or importlib.util.find_spec("torch") is not None,
    }


@pytest.mark.timeout(TIMEOUT + 30)
def test_quick_run_writes_page_and_chart_with_every_side(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        skip_or_fail("matplotlib not installed (pip install -e '.[test]' brings the bench extra)",
                     "POPRUN_REQUIRE_TOOLS")
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
    for name in ("launch", "output", "fold", "ssh", "fanout", "teardown", "slurm", "mpi", "ompi"):
        assert name in doc["scenarios"], name
        assert "error" not in doc["scenarios"][name], doc["scenarios"][name].get("traceback")
    # Where mpi4py and the mpich wheel are installed, both launchers formed the world.
    if doc["sides"]["mpiexec"]["available"]:
        mpi_sides = doc["scenarios"]["mpi"]["cases"][0]["sides"]
        assert {s["name"] for s in mpi_sides if s["ok"]} >= {"poprun", "mpiexec"}, mpi_sides
        assert "## MPI world wire-up" in page
    # Where Debian's Open MPI and its mpi4py are, poprun's PMIx and Open MPI's mpirun formed it.
    if "skipped" not in doc["scenarios"]["ompi"]:
        ompi_sides = doc["scenarios"]["ompi"]["cases"][0]["sides"]
        assert {s["name"] for s in ompi_sides if s["ok"]} >= {"poprun", "mpirun"}, ompi_sides
        assert "## Open MPI world wire-up" in page
    elif os.environ.get("POPRUN_REQUIRE_OPENMPI") == "1":
        pytest.fail(f"ompi: {doc['scenarios']['ompi']['skipped']}", pytrace=False)

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
    assert "## Folded output (`--fold-output`)" in page
    assert (out / "results.png").name in page


# ---------------------------------------------------------------------------- the renderer alone


def _side(name: str, *seconds: float, hung: int = 0, **extra) -> dict:
    runs = [{"status": "ok", "seconds": s, "detail": "", "verified": True} for s in seconds]
    runs += [{"status": "hung", "seconds": None, "detail": "no exit within 10 s; killed"}] * hung
    ok = sorted(seconds)
    return {"name": name, "command": [name], "runs": runs, "ok": len(ok), "hung": hung, "failed": 0,
            "skipped": 0, "median_s": ok[len(ok) // 2] if ok else None, "min_s": ok[0] if ok else None,
            "max_s": ok[-1] if ok else None, **extra}


def _bench(name: str):
    """A module of bench/, imported as run_all imports it."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def _report():
    return _bench("report")


def test_report_judges_targets_and_renders_a_page_from_a_document():
    report = _report()
    doc = {
        "quick": False, "command": "python bench/run_all.py", "seconds": 600,
        "machine": {"cpu_model": "Test CPU", "cpus": 2, "python": "3.11.7", "timestamp": "2026-01-01T00:00:00"},
        "sides": {"poprun": {"available": True, "path": "/bin/poprun", "version": "poprun 0.1.0"},
                  "mpirun": {"available": True, "path": "/usr/bin/mpirun", "version": "mpirun 4.1.4"},
                  "torchrun": {"available": False, "reason": "torch not installed"},
                  "none": {"available": True, "path": "", "version": "directly"}},
        "scenarios": {
            "launch": {"cases": [
                {"n": 8, "sides": [_side("floor", 0.070), _side("poprun", 0.120, 0.125, 0.150),
                                   _side("mpirun", 0.050)]},
                {"n": 64, "sides": [_side("floor", 0.070), _side("poprun", 0.200), _side("mpirun", hung=1)]},
                {"n": 256, "sides": [_side("floor", 0.070), _side("poprun", 0.500), _side("mpirun", 0.400)]},
            ]},
            "output": {"lines": 200_000, "cases": [
                {"n": 8, "lines": 200_000, "sides": [
                    _side("floor", 0.100), _side("baseline", 0.090),
                    _side("poprun", 0.140, cpu_s={"median": 0.19, "min": 0.18, "max": 0.21}),
                    _side("mpirun", 3.5)]}]},
            "mpi": {"mpiexec": "/venv/bin/mpiexec", "env": {}, "cases": [
                {"n": 4, "sides": [_side("poprun", 0.700), _side("mpiexec", 0.400)]},
                {"n": 16, "sides": [_side("poprun", 2.0), _side("mpiexec", 1.6)]}]},
            "teardown": {"n": 256, "reported": ["rss", "teardown"], "sides": [
                _side("poprun", 0.05, rss_kib={"median": 30_000, "min": 29_000, "max": 31_000}),
                _side("mpirun", 2.0, rss_kib={"median": 15_000, "min": 15_000, "max": 15_000})]},
        },
    }
    got = {t["name"]: t["status"] for t in report.targets(doc)}
    assert got == {
        "launch-8-floor": "pass",  # 125 ms - 70 ms = 55 ms <= 60 ms
        "launch-8-torchrun": "skip",  # not installed
        "launch-64-mpirun": "pass",  # mpirun hung in every run: it never finished
        "launch-64-torchrun": "skip",
        "launch-256-mpirun": "fail",  # 500 ms vs 400 ms
        "launch-256-torchrun": "skip",
        "output-8-floor": "pass",  # 1.4x
        "output-8-none": "fail",  # 1.56x the writers alone
        "output-8-mpirun": "pass",
        "mpi-16-mpiexec": "pass",  # 1.25x; 4 ranks have no target
        "rss": "pass",  # 31 000 KiB < 80 MiB
        "teardown": "pass",
    }
    doc["targets"] = report.targets(doc)
    page = report.render_markdown(doc)
    assert "**skipped**: torch not installed" in page
    assert "125 ms (120–150 ms)" in page
    assert "— · 1 hung" in page
    assert "+55 ms" in page
    # poprun's own CPU over 8 x 200k lines, in the output table and in the target's figures.
    assert "| 190 ms (180–210 ms) | 119 ns |" in page
    assert "poprun 140 ms = 1.56× no launcher's 90 ms; poprun's own CPU 119 ns a line" in page
    assert "`/venv/bin/mpiexec`" in page and "| 16 | — | — | 2.00 s | 1.60 s | 1.25× |" in page
    assert "Quick run" not in page
    panels = report.chart_groups(doc)
    launch = dict(panels[0][2])
    assert launch["N=64"]["mpirun"] == "hung" and launch["N=256"]["mpirun"] == pytest.approx(0.8)


def test_report_top_frames_of_folded_stacks():
    report = _report()
    folded = ("main (poprun/cli/command.py:10);run (asyncio/runners.py:5);_on_readable (spawner/local.py:197) 6\n"
              "main (poprun/cli/command.py:10);run (asyncio/runners.py:5);_on_readable (spawner/local.py:201) 2\n"
              "main (poprun/cli/command.py:10);write_all (poprun/run/output.py:50) 2\n")
    top = report.top_frames(folded)
    assert top["total"] == 10
    assert top["self"][0] == ("_on_readable (spawner/local.py)", 8)
    assert top["inclusive"]["write_all (poprun/run/output.py)"] == 2


def test_merge_keeps_the_scenarios_a_run_left_out():
    run_all = _bench("run_all")
    machine = {"timestamp": "t", "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 2.0, 2.0]}
    previous = {"quick": False, "command": "full", "machine": {**machine, "cpu_model": "Old"},
                "sides": {"poprun": {"available": True, "version": "old"}},
                "scenarios": {"launch": {"reps": 5}, "mpi": {"reps": 1}}, "profile": {"skipped": "old"}}
    doc = {"quick": False, "command": "--scenarios mpi --merge", "seconds": 9, "machine": machine,
           "sides": {"poprun": {"available": True, "version": "new"}, "mpiexec": {"available": True}},
           "scenarios": {"mpi": {"reps": 15}}}
    merged = run_all.merge(previous, doc)
    assert merged["scenarios"] == {"launch": {"reps": 5}, "mpi": {"reps": 15}}
    assert merged["machine"]["cpu_model"] == "Old" and merged["profile"] == {"skipped": "old"}
    assert merged["sides"]["poprun"]["version"] == "old" and "mpiexec" in merged["sides"]
    assert [m["scenarios"] for m in merged["merged"]] == [["mpi"]]
    # Measured again: the older merge entry gives way.
    assert [m["command"] for m in run_all.merge(merged, doc)["merged"]] == ["--scenarios mpi --merge"]
    assert "merged into this page" in _report().render_markdown(merged)


# ---------------------------------------------------------------------------- which mpirun


HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.2.0\n"


def _hydra_dirs(tmp_path: Path) -> list[Path]:
    """Directories whose `mpirun` is MPICH's Hydra: the mpich wheel's (the test extra installs
    it beside the interpreter), and a stand-in answering --version as Hydra does, so the check
    runs where the wheel is absent too."""
    dirs = []
    wheel = _bench("mpi_bench").wheel_file("mpich", "mpirun")
    if wheel:
        dirs.append(Path(wheel).parent)
    standin = tmp_path / "hydra" / "mpirun"
    standin.parent.mkdir()
    standin.write_text(f"#!/bin/sh\nprintf '{HYDRA_VERSION}'\n")
    standin.chmod(0o755)
    return dirs + [standin.parent]


@pytest.mark.timeout(120)
def test_the_mpirun_side_is_open_mpi_by_path_with_hydra_first_on_path(tmp_path, monkeypatch):
    """With MPICH's wheel installed, `mpirun` on PATH is Hydra; every
    scenario's mpirun side (run_all's sides, launch_bench's and multihost_bench's defaults)
    must still be Open MPI's, and the page must name it by path."""
    lb = _bench("launch_bench")
    open_mpi = lb.open_mpi_mpirun()
    if not os.access(open_mpi, os.X_OK):
        skip_or_fail("Open MPI's mpirun is not installed (apt-get install openmpi-bin)",
                     "POPRUN_REQUIRE_OPENMPI")
    run_all, mh, report = _bench("run_all"), _bench("multihost_bench"), _report()
    for hydra in _hydra_dirs(tmp_path):
        monkeypatch.setenv("PATH", f"{hydra}{os.pathsep}{os.environ['PATH']}")
        first = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
        assert "HYDRA" in first, (hydra, first)  # the trap is set: Hydra answers to `mpirun`
        assert lb.open_mpi_mpirun() == open_mpi
        version = subprocess.run([open_mpi, "--version"], capture_output=True, text=True, timeout=30).stdout
        # Debian's /usr/bin/mpirun links to orterun, which says "OpenRTE" and open-mpi.org.
        assert "open-mpi" in version.lower() and "HYDRA" not in version, (open_mpi, version)
        assert not Path(open_mpi).is_relative_to(hydra), open_mpi
        assert lb.parse_args([]).mpirun == open_mpi and mh.parse_args([]).mpirun == open_mpi
        args = run_all.parse_args(["--sides", "poprun,mpirun"])
        sides = run_all.discover(args)
        assert sides["mpirun"]["path"] == open_mpi and "HYDRA" not in sides["mpirun"]["version"]
        assert run_all.make_tools(sides, run_all.QUICK, None).mpirun == open_mpi
        page = report.render_markdown({"sides": sides, "scenarios": {}, "machine": {}})
        assert f"`{open_mpi}`" in page.split("## Sides")[1].split("\n## ")[0]
