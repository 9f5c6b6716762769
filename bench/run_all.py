#!/usr/bin/env python3
"""Every launcher benchmark in one command: poprun, mpirun, torchrun and no launcher, side by side.

    python bench/run_all.py                 # the full run (~15 min on 2 cores)
    python bench/run_all.py --quick         # smoke run, < 2 min: fewer sizes and reps
    python bench/run_all.py --sides poprun,mpirun --scenarios launch,teardown --out /tmp/b

Scenarios (bench/README.md says how each figure is measured):
  launch    `true` as N instances, N = 1, 8, 64, 256, 1024, and the interpreter-plus-asyncio
            floor `python -c "import asyncio"`
  output    tagged output, 8 and 16 instances x 200k lines: wall time and launcher CPU, against
            no launcher and against one writer of the same tagged bytes (the floor)
  ssh       16 loopback sshd hosts x 4 instances of `hostname` (and 4 x 2), poprun vs mpirun
  fanout    8, 16, 32 and 64 loopback sshd hosts x 1 instance of `hostname`, and 64 x 4: poprun
            vs mpirun (tree spawn and flat), pdsh and clush; wall time, launcher CPU per host,
            peak RSS (fanout_bench.py)
  rss       the launcher's peak RSS with 256 local instances (measured in the teardown runs)
  teardown  SIGTERM to the launcher with 256 running instances, until every one has exited
  slurm     srun vs poprun --launcher slurm on a local Slurm (skipped, saying why, without one)
  mpi       an MPI world of 4 and 16 local ranks (mpi4py: MPI_Init, Barrier, Finalize): poprun
            against MPICH's own mpiexec (Hydra) from the mpich wheel, and the singleton floor

Sides alternate within each repetition (A B C A B C ...); a side that is not installed is
skipped and the page says so. Writes <out>/results.json, results.md (machine, versions,
medians with min-max, ratios and the targets) and results.png (the ratios), and a py-spy
profile of poprun's output path beside them. The timing plumbing is launch_bench's and
multihost_bench's; this script chooses, runs and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path[:0] = [str(BENCH_DIR), str(REPO / "tests")]

import launch_bench as lb  # noqa: E402
import mpi_bench as mb  # noqa: E402
import ompi_bench as ob  # noqa: E402
import report  # noqa: E402

SIDES = ("poprun", "mpirun", "torchrun", "mpiexec", "pdsh", "clush", "none")
SCENARIOS = ("launch", "output", "fold", "ssh", "fanout", "rss", "teardown", "slurm", "mpi",
             "ompi")
# launch_bench's name for the no-launcher side
BASELINE = {"none": "baseline"}


@dataclass(frozen=True)
class Plan:
    """How much of each scenario to run."""

    reps: int
    launch_sizes: tuple[int, ...]
    output_sizes: tuple[int, ...]
    lines: int
    ssh_cases: tuple[str, ...]
    teardown_n: int
    mpirun_timeout: float  # a run still going after this is a hang (mpirun hangs here)
    torchrun_timeout: float
    poprun_timeout: float
    ssh_phases: bool  # one poprun -v run per ssh case, for the per-host phases
    mpi_sizes: tuple[int, ...]
    mpi_reps: int  # more than reps: 16 Python ranks on 2 cores vary by a few hundred ms
    fanout_cases: tuple[str, ...]  # hosts x instances, fanout scenario
    fanout_reps: int  # fewer than reps: a 64-host run of every side takes ~20 s on 2 cores
    fanout_flat_mpirun: bool  # mpirun without tree spawn too (it hangs now and then: not in quick)


FULL = Plan(reps=5, launch_sizes=(1, 8, 64, 256, 1024), output_sizes=(8, 16), lines=200_000,
            ssh_cases=("16x4", "4x2"), teardown_n=256, mpirun_timeout=30.0, torchrun_timeout=120.0,
            poprun_timeout=60.0, ssh_phases=True, mpi_sizes=(4, 16), mpi_reps=15,
            fanout_cases=("8x1", "16x1", "32x1", "64x1", "64x4"), fanout_reps=3, fanout_flat_mpirun=True)
QUICK = Plan(reps=1, launch_sizes=(1, 8, 64), output_sizes=(8,), lines=20_000, ssh_cases=("4x2",),
             teardown_n=256, mpirun_timeout=10.0, torchrun_timeout=60.0, poprun_timeout=60.0,
             ssh_phases=False, mpi_sizes=(4,), mpi_reps=1, fanout_cases=("4x1",), fanout_reps=1,
             fanout_flat_mpirun=False)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- machine and sides


def first_line(cmd: list[str], timeout: float = 30) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, close_fds=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip() if lines else ""


def deb_version(package: str) -> str | None:
    if not shutil.which("dpkg-query"):
        return None
    out = first_line(["dpkg-query", "-W", "-f", "${Version}", package])
    return out if out and "no packages" not in out and not out.startswith("unavailable") else None


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f"{kib / 1024 / 1024:.1f} GiB"
    return {
        "timestamp": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": cpu or platform.processor() or "unknown",
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory": mem,
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_path": sys.executable,
        "load_before": os.getloadavg(),
    }


def find_torchrun() -> list[str] | None:
    # The script beside this interpreter, not a pyenv shim on PATH (a shim is a bash script
    # that adds ~60 ms to every start); else the module, if torch is installed.
    beside = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.access(beside, os.X_OK):
        return [beside]
    if importlib.util.find_spec("torch") is not None:
        return [sys.executable, "-m", "torch.distributed.run"]
    return None


def discover(args) -> dict[str, dict]:
    """Which sides are here, with their versions; a missing one says why."""
    sides: dict[str, dict] = {}
    poprun = args.poprun or lb.default_poprun()
    if poprun and os.access(poprun, os.X_OK):
        sides["poprun"] = {"available": True, "path": poprun, "version": first_line([poprun, "--version"])}
    else:
        sides["poprun"] = {"available": False, "reason": "no poprun executable (pip install .)"}
    # By what it is, not by name on PATH: the mpich wheel puts a Hydra `mpirun` beside the
    # interpreter, which pyenv's shim puts first on PATH.
    mpirun = args.mpirun or lb.open_mpi_mpirun()
    if os.access(mpirun, os.X_OK):
        deb = deb_version("openmpi-bin")
        sides["mpirun"] = {"available": True, "path": mpirun, "version": first_line([mpirun, "--version"])
                           + (f" (Debian openmpi-bin {deb})" if deb else "")}
    else:
        sides["mpirun"] = {"available": False, "reason": "mpirun not installed (apt-get install openmpi-bin)"}
    torchrun = find_torchrun()
    if torchrun:
        try:
            version = "torch " + importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            version = "torch (version unknown)"
        sides["torchrun"] = {"available": True, "path": " ".join(torchrun), "argv": torchrun, "version": version}
    else:
        sides["torchrun"] = {"available": False, "reason": "torch not installed (pip install '.[torch]')"}
    sides["mpiexec"] = discover_mpiexec()
    sides.update(discover_fanout())
    sides["none"] = {"available": True, "path": "", "version": "the same programs started directly "
                     f"(seq/dd from {first_line(['seq', '--version'])})"}
    for name in SIDES:
        if name not in args.sides:
            sides[name] = {**sides[name], "available": False, "reason": "left out with --sides"}
    return sides


def discover_mpiexec() -> dict:
    """MPICH's mpiexec, by the mpich wheel's own file list (Open MPI's mpirun must never
    stand in for it), and the MPI library mpi4py loads."""
    path, why = mb.find_mpiexec()
    if path is None:
        return {"available": False, "reason": why}
    version, why = mb.mpi_versions(sys.executable, path, None)
    if not version:
        return {"available": False, "reason": why}
    return {"available": True, "path": path, "version": version}


def discover_fanout() -> dict[str, dict]:
    """The sides only the fanout scenario has (pdsh, clush), with their versions."""
    try:
        import fanout_bench as fb
    except ImportError as exc:  # the sshd harness it uses (tests/sshd_hosts.py) needs pytest
        return {n: {"available": False, "reason": f"bench/fanout_bench.py: {exc}"} for n in ("pdsh", "clush")}
    return fb.versions(fb.find_tools(None, None))


def make_tools(sides: dict, plan: Plan, pycache: Path | None) -> lb.Tools:
    return lb.Tools(
        poprun=sides["poprun"].get("path") or "poprun",
        mpirun=sides["mpirun"]["path"] if sides["mpirun"]["available"] else None,
        mpirun_timeout=plan.mpirun_timeout,
        poprun_timeout=plan.poprun_timeout,
        torchrun=sides["torchrun"]["argv"] if sides["torchrun"]["available"] else None,
        torchrun_timeout=plan.torchrun_timeout,
        python=sys.executable,
        env=lb.python_env(dict(os.environ), pycache),
    )


def chosen(sides: dict, *names: str) -> tuple[str, ...]:
    """launch_bench side names for the available ones among `names` (the references, floor
    and series, always)."""
    out = []
    for name in names:
        if name in ("floor", "series") or sides.get(name, {}).get("available"):
            out.append(BASELINE.get(name, name))
    return tuple(out)


# ---------------------------------------------------------------------------- scenarios


def side_list(sides: list[lb.Side]) -> list[dict]:
    return [s.to_json() for s in sides]


def run_launch(tools, sides, plan, tmp) -> dict:
    res = lb.bench_launch(tools, plan.reps, list(plan.launch_sizes), 1, tmp,
                          sides=chosen(sides, "floor", "none", "poprun", "mpirun", "torchrun"), measure=True)
    return {"sizes": list(plan.launch_sizes), "reps": plan.reps,
            "cases": [{"n": r.instances, "sides": side_list(r.sides)} for r in res]}


def run_output(tools, sides, plan, tmp) -> dict:
    cases = []
    for n in plan.output_sizes:
        res = lb.bench_output(tools, plan.reps, plan.lines, "seq", tmp / f"n{n}", n,
                              sides=chosen(sides, "floor", "series", "none", "poprun", "mpirun", "torchrun"),
                              measure=True, max_hangs=1)
        cases.append({"n": n, "lines": plan.lines, "sides": side_list(res.sides)})
    return {"reps": plan.reps, "lines": plan.lines, "line_bytes": lb.LINE_BYTES,
            "writer": " ".join(lb.writer_cmd(plan.lines)), "cases": cases}


def run_fold(tools, sides, plan, tmp) -> dict:
    """--fold-output against plain tagged output: throughput (8 x the output scenario's
    lines) and the latency a line gets (bench/fold_bench.py)."""
    if not sides["poprun"]["available"]:
        return {"skipped": "poprun is not available"}
    import fold_bench

    return fold_bench.bench_fold(tools.poprun, plan.reps, plan.lines, tmp, n=8, env=tools.env,
                                 timeout=plan.poprun_timeout,
                                 latency_lines=fold_bench.LATENCY_LINES if plan.reps > 1 else 40)


def run_ssh(tools, sides, plan, tmp, pycache) -> dict:
    import multihost_bench as mh

    not_here = {"torchrun": "torchrun starts no process on another host (one torchrun runs per node, "
                            "started by something else)",
                "none": "without a launcher nothing starts on another host"}
    if not sides["poprun"]["available"] and not sides["mpirun"]["available"]:
        return {"skipped": "neither poprun nor mpirun is available", "not_applicable": not_here}
    missing = [t for t, where in (("sshd", "/usr/sbin/sshd"), ("ssh-keygen", None), ("ssh", None))
               if not shutil.which(t) and not (where and os.access(where, os.X_OK))]
    if missing:
        return {"skipped": f"{', '.join(missing)} not installed (apt-get install openssh-server)",
                "not_applicable": not_here}
    from sshd_hosts import start_ssh_hosts

    cases = [mh.parse_case(c) for c in plan.ssh_cases]
    mtools = mh.Tools(tools.poprun, tools.mpirun, [], plan.poprun_timeout, plan.mpirun_timeout)
    out = []
    started = time.perf_counter()
    tmp.mkdir(parents=True, exist_ok=True)
    with start_ssh_hosts(max(c.hosts for c in cases), tmp) as ssh:
        log(f"ssh: {len(ssh.hosts)} sshd hosts up in {time.perf_counter() - started:.1f} s")
        counter = [0]
        for case in cases:
            res = mh.bench_case(mtools, ssh, case, plan.reps, 2, tmp / "runs", counter, pycache,
                                phases=plan.ssh_phases)
            res.sides = [s for s in res.sides if sides[s.name]["available"]]
            entry = {"case": case.name, "hosts": case.hosts, "per_host": case.per_host,
                     "sides": side_list(res.sides)}
            if res.phases is not None:
                entry["phases"] = {"hosts": res.phases.hosts, "timeline": res.phases.timeline}
            out.append(entry)
    return {"reps": plan.reps, "cases": out, "not_applicable": not_here,
            "rc_file_hidden": os.environ.get(mh.NAMESPACE_MARK) or None,
            "openssh": first_line(["ssh", "-V"])}


def run_fanout(tools, sides, plan, tmp, pycache) -> dict:
    """H loopback sshd hosts x I instances of `hostname`: poprun, Open MPI's mpirun (tree spawn,
    its default, and flat), pdsh, clush, and connection set-up alone (fanout_bench)."""
    import fanout_bench as fb
    import multihost_bench as mh

    not_here = {"torchrun": "torchrun starts no process on another host",
                "none": "without a launcher nothing starts on another host"}
    if not shutil.which("sshd") and not os.access("/usr/sbin/sshd", os.X_OK):
        return {"skipped": "sshd not installed (apt-get install openssh-server)", "not_applicable": not_here}
    ftools = fb.find_tools(sides["poprun"].get("path"), sides["mpirun"].get("path"),
                           poprun_timeout=plan.poprun_timeout, mpirun_timeout=plan.mpirun_timeout)
    wanted = {"poprun": "poprun", "mpirun": "mpirun", "mpirun-flat": "mpirun", "pdsh": "pdsh", "clush": "clush"}
    chosen_sides = tuple(s for s in fb.SIDES if (s in fb.REFERENCES or sides[wanted[s]]["available"])
                         and (s != "mpirun-flat" or plan.fanout_flat_mpirun))
    cases = [mh.parse_case(c) for c in plan.fanout_cases]
    largest = max((c for c in cases if c.per_host == 1), key=lambda c: c.hosts, default=None)
    res = fb.bench_fanout_rc_hidden(ftools, cases, chosen_sides, plan.fanout_reps, tmp, pycache,
                                    phase_case=largest if plan.ssh_phases else None, log=log)
    return {**res, "reps": plan.fanout_reps, "not_applicable": not_here, "openssh": first_line(["ssh", "-V"])}


def run_teardown(tools, sides, plan, tmp) -> dict:
    res = lb.bench_teardown(tools, plan.reps, plan.teardown_n, tmp,
                            sides=chosen(sides, "poprun", "mpirun", "torchrun"),
                            start_timeout=120.0, stop_timeout=30.0)
    return {"n": res.instances, "reps": plan.reps, "sides": side_list(res.sides),
            "not_applicable": {"none": "no launcher to signal"}}


def slurm_skip_reason(sides: dict) -> str | None:
    if not sides["poprun"]["available"]:
        return "poprun is not available"
    if not shutil.which("srun"):
        return "Slurm is not installed (no srun)"
    help_text = subprocess.run([sides["poprun"]["path"], "--help"], capture_output=True, text=True,
                               timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    if "--launcher" not in help_text:
        return "this poprun has no --launcher option (an older one: see --poprun)"
    if importlib.util.find_spec("slurm_cluster") is None:
        return "tests/slurm_cluster.py (the local Slurm harness) is missing"
    return None


def run_slurm(tools, sides, plan, tmp) -> dict:
    """srun against poprun --launcher slurm, each inside an allocation of its own on a local
    two-node Slurm (tests/slurm_cluster.py)."""
    reason = slurm_skip_reason(sides)
    if reason:
        return {"skipped": reason}
    from slurm_cluster import start_slurm_cluster

    sizes = (8,) if plan.reps == 1 else (8, 64)
    cases = []
    with start_slurm_cluster(2, cpus_per_node=max(sizes) // 2) as cluster:
        env = cluster.env
        penv = lb.python_env(env, Path(tools.env["PYTHONPYCACHEPREFIX"])) \
            if tools.env and "PYTHONPYCACHEPREFIX" in tools.env else env
        for n in sizes:
            alloc = ["salloc", "--quiet", "-N", "2", "-n", str(n)]
            srun = [*alloc, "srun", "true"]
            pop = [*alloc, tools.poprun, "--launcher", "slurm", "--num-instances", str(n),
                   "--num-replicas", str(n), "--offline-mode=1", "true"]
            contenders = [
                lb.Contender(lb.Side("srun", srun), lambda d, c=srun: lb.run_quiet(
                    "srun", c, plan.mpirun_timeout * 3, d, env), max_hangs=1),
                lb.Contender(lb.Side("poprun", pop), lambda d, c=pop: lb.run_quiet(
                    "poprun", c, plan.poprun_timeout, d, penv)),
            ]
            lb.interleave(contenders, plan.reps, tmp / f"n{n}", f"slurm n={n}")
            cases.append({"n": n, "sides": side_list([c.side for c in contenders])})
    return {"reps": plan.reps, "cases": cases, "slurm": first_line(["srun", "--version"])}


def run_mpi(tools, sides, plan, tmp) -> dict:
    """An MPI world of N local ranks: poprun against the mpich wheel's mpiexec (mpi_bench)."""
    info = sides["mpiexec"]
    if not info.get("path"):  # not found at all, as opposed to left out with --sides
        return {"skipped": info["reason"]}
    res = mb.bench_mpi(tools, info["path"] if info["available"] else None, plan.mpi_reps,
                       list(plan.mpi_sizes), tmp, chosen(sides, "floor", "none", "poprun", "mpiexec"))
    return {"sizes": list(plan.mpi_sizes), "reps": plan.mpi_reps, "program": mb.PROGRAM,
            "floor_program": mb.FLOOR_PROGRAM, "mpiexec": info["path"], "env": mb.TRANSPORT_ENV,
            "cases": [{"n": r.instances, "sides": side_list(r.sides)} for r in res]}


def run_ompi(tools, sides, plan, tmp) -> dict:
    """Open MPI's world of N local ranks: poprun serving its PMIx against Open MPI's own
    `mpirun`, the same program and Open MPI (Debian's 4.1: ompi_bench)."""
    if not sides["poprun"]["available"]:
        return {"skipped": "poprun is not available"}
    missing = [p for p in (ob.MPIRUN, ob.PYTHON) if not os.access(p, os.X_OK)]
    if missing:
        return {"skipped": f"no {', '.join(missing)} (apt-get install openmpi-bin python3-mpi4py)"}
    cases = []
    for k, n in enumerate(plan.mpi_sizes):
        group = ob.contenders(tools.poprun, n, dict(tools.env or os.environ))
        lb.interleave(group, plan.mpi_reps, tmp / f"n{n}", f"ompi n={n}", warmup=(k == 0))
        cases.append({"n": n, "sides": side_list([c.side for c in group])})
    return {"sizes": list(plan.mpi_sizes), "reps": plan.mpi_reps, "program": mb.PROGRAM,
            "floor_program": mb.FLOOR_PROGRAM, "mpirun": ob.MPIRUN, "python": ob.PYTHON,
            "cases": cases}


# ---------------------------------------------------------------------------- profile


def profile_output(tools, sides, plan, out_dir: Path, tmp: Path) -> dict:
    """py-spy samples one poprun run of the output scenario (8 instances, --tag-output): a
    flame graph (SVG) and the folded stacks (text, for speedscope or flamegraph.pl), beside
    the results; the page lists the functions with the most samples."""
    if not sides["poprun"]["available"]:
        return {"skipped": "poprun is not available"}
    pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not pyspy:
        return {"skipped": "py-spy is not installed (pip install '.[bench]')"}
    n = plan.output_sizes[0]
    cmd = tools.poprun_cmd(n, lb.writer_cmd(plan.lines), tag_output=True)
    result = {"command": cmd, "files": {}}
    for fmt, name in (("raw", "profile-output.txt"), ("flamegraph", "profile-output.svg")):
        target = out_dir / name
        tmp.mkdir(parents=True, exist_ok=True)
        with open(tmp / "profile.out", "wb") as out, open(tmp / "profile.err", "wb") as err:
            try:
                proc = subprocess.run([pyspy, "record", "--rate", "250", "--format", fmt, "--output",
                                       str(target), "--", *cmd], stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=err, env=tools.env, timeout=300)
            except subprocess.TimeoutExpired:
                return {**result, "error": "py-spy did not finish within 300 s"}
        if proc.returncode != 0 or not target.exists():
            return {**result, "error": f"py-spy exited {proc.returncode}: {lb.tail(tmp / 'profile.err', 400)}"}
        result["files"][fmt] = name
        log(f"profile: {target}")
    result["top"] = report.top_frames((out_dir / "profile-output.txt").read_text())
    return result


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="smoke run (< 2 min): 1 rep, launch N = 1, 8, 64, output 8 x 20k lines, "
                        "ssh 4 hosts x 2, fanout 4 hosts x 1, teardown/RSS at 256, 10 s mpirun timeout")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated subset of {','.join(SIDES)} (the floors always run)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--out", default=str(BENCH_DIR), help="where results.{md,png,json} and the profile go")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions per side (default 5, the mpi scenario 15, fanout 3; 1 with --quick)")
    p.add_argument("--poprun", default=None, help="poprun executable (default: next to sys.executable, else PATH)")
    p.add_argument("--mpirun", default=None,
                   help="mpirun executable (default: the first Open MPI mpirun on PATH, else /usr/bin/mpirun)")
    p.add_argument("--without-bashrc", action="store_true",
                   help="run in a private mount namespace where ~/.bashrc is empty, which every ssh "
                        "session reads (see bench/README.md, multihost); needs root")
    p.add_argument("--no-profile", action="store_true", help="leave out the py-spy profile")
    p.add_argument("--tmpdir", default=None, help="where outputs and sshd dirs go (default: system temp dir)")
    p.add_argument("--merge", action="store_true",
                   help="keep the scenarios of <out>/results.json that this run leaves out, and replace "
                        "those it runs (the page says when each was measured)")
    args = p.parse_args(argv)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for what, given, allowed in (("side", args.sides, SIDES), ("scenario", args.scenarios, SCENARIOS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            p.error(f"unknown {what}(s) {', '.join(bad)}; choose from {', '.join(allowed)}")
    return args


def previous_results(out_dir: Path, quick: bool) -> dict | None:
    """The results --merge adds to: None if there are none yet; a quick run and a full one
    never share a page (the page is either smoke-test figures or the published ones)."""
    path = out_dir / "results.json"
    if not path.exists():
        return None
    previous = json.loads(path.read_text())
    if bool(previous.get("quick")) != quick:
        raise SystemExit(f"run_all: --merge: {path} is {'a quick' if previous.get('quick') else 'a full'} run "
                         f"and this one is not; a page holds one or the other")
    return previous


def merge(previous: dict, doc: dict) -> dict:
    """previous with doc's scenarios (and profile) in place of its own: the rest of the page
    keeps its figures, and "merged" says what was measured later, when and how."""
    merged = {**previous, "scenarios": {**previous.get("scenarios", {}), **doc["scenarios"]}}
    # The page's sides are those of the run it was measured in; a side new here is added (this
    # run's own are in its "merged" entry).
    merged["sides"] = {**doc["sides"], **previous.get("sides", {})}
    if "profile" in doc:
        merged["profile"] = doc["profile"]
    again = set(doc["scenarios"]) | ({"profile"} if "profile" in doc else set())
    earlier = [{**m, "scenarios": [x for x in m["scenarios"] if x not in again]} for m in previous.get("merged", [])]
    merged["merged"] = [m for m in earlier if m["scenarios"]] + [{
        "scenarios": sorted(again), "timestamp": doc["machine"]["timestamp"], "command": doc["command"],
        "seconds": doc["seconds"], "load_before": doc["machine"]["load_before"],
        "load_after": doc["machine"]["load_after"], "sides": doc["sides"]}]
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.without_bashrc:
        import multihost_bench as mh
        if not os.environ.get(mh.NAMESPACE_MARK):
            return mh.reexec_without_rc(argv, script=Path(__file__).resolve())
    plan = QUICK if args.quick else FULL
    if args.reps:
        plan = Plan(**{**plan.__dict__, "reps": args.reps, "mpi_reps": args.reps, "fanout_reps": args.reps})
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = previous_results(out_dir, args.quick) if args.merge else None
    started = time.perf_counter()
    doc: dict = {
        "benchmark": "run_all",
        "quick": args.quick,
        "command": " ".join(["python", "bench/run_all.py", *(sys.argv[1:] if argv is None else argv)]),
        "plan": plan.__dict__,
        "machine": machine(),
        "scenarios": {},
    }
    sides = discover(args)
    doc["sides"] = sides
    for name, info in sides.items():
        log(f"{name}: " + (f"{info['path'] or '-'} ({info['version']})" if info["available"]
                           else f"skipped: {info['reason']}"))
    with tempfile.TemporaryDirectory(prefix="run_all.", dir=args.tmpdir) as tmp_name:
        tmp = Path(tmp_name)
        pycache = tmp / "pycache" if os.environ.get(lb.BYTECODE_VAR) else None
        doc["private_pycache"] = pycache is not None
        tools = make_tools(sides, plan, pycache)
        steps = [
            ("launch", lambda: run_launch(tools, sides, plan, tmp / "launch")),
            ("output", lambda: run_output(tools, sides, plan, tmp / "output")),
            ("fold", lambda: run_fold(tools, sides, plan, tmp / "fold")),
            ("ssh", lambda: run_ssh(tools, sides, plan, tmp / "ssh", pycache)),
            ("fanout", lambda: run_fanout(tools, sides, plan, tmp / "fanout", pycache)),
            ("teardown", lambda: run_teardown(tools, sides, plan, tmp / "teardown")),
            ("slurm", lambda: run_slurm(tools, sides, plan, tmp / "slurm")),
            ("mpi", lambda: run_mpi(tools, sides, plan, tmp / "mpi")),
            ("ompi", lambda: run_ompi(tools, sides, plan, tmp / "ompi")),
        ]
        for name, step in steps:
            wanted = name in args.scenarios or (name == "teardown" and "rss" in args.scenarios)
            if not wanted:
                continue
            t0 = time.perf_counter()
            log(f"== {name} (load {os.getloadavg()[0]:.2f})")
            try:
                doc["scenarios"][name] = step()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # one broken scenario must not lose the others' figures
                # (BaseException: the test harnesses it borrows raise pytest's Skipped/Failed)
                import traceback
                doc["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                          "traceback": traceback.format_exc()[-3000:]}
                log(f"{name} failed: {exc}")
            doc["scenarios"].get(name, {})["seconds"] = round(time.perf_counter() - t0, 1)
        if "teardown" in doc["scenarios"]:
            doc["scenarios"]["teardown"]["reported"] = [s for s in ("rss", "teardown") if s in args.scenarios]
        if not args.no_profile and "output" in args.scenarios:
            doc["profile"] = profile_output(tools, sides, plan, out_dir, tmp / "profile")
    doc["machine"]["load_after"] = os.getloadavg()
    doc["seconds"] = round(time.perf_counter() - started, 1)
    if previous is not None:
        doc = merge(previous, doc)
    doc["targets"] = report.targets(doc)

    (out_dir / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out_dir / "results.md").write_text(report.render_markdown(doc))
    try:
        report.render_png(doc, out_dir / "results.png")
    except ImportError as exc:
        log(f"results.png not written: {exc} (pip install '.[bench]')")
        return 1
    log(f"\n{out_dir / 'results.md'}, results.png, results.json written; this run took "
        f"{time.perf_counter() - started:.0f} s")
    for t in doc["targets"]:
        log(f"  [{t['status'].upper():4}] {t['description']}: {t['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
