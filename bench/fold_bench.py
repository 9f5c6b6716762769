#!/usr/bin/env python3
"""What `--fold-output` costs (issue 27 point 1): poprun with and without it, interleaved.

* **Throughput**: 8 instances × 200k lines of `seq` (as the output scenario), `--tag-output`,
  stdout to a file: wall time and the launcher's own CPU. Every instance writes the same
  lines, so folding folds them all: 200k lines of `[1,0-7]<stdout>:` come out instead of
  1.6M. Output checked: each instance's lines, in order, whatever set they were printed with.
* **Latency**: each instance writes a line every `period` on a shared schedule (line k at
  t0 + k·period, by the system's monotonic clock), poprun's stdout is a pipe read here, and
  a line's latency is its arrival minus its scheduled time (what poprun and the pipe add).
  Three workloads: *common* (every instance writes the same `tick k`: folded, it waits for
  the last instance's copy), *distinct* (each writes its own `i tick k`: nothing folds, a
  line waits until every instance has written past it), *rank 0 only* (the others write
  nothing on stdout: nothing can say they will not write the same line, so each waits the
  100 ms bound: the worst case, and a common one, logging from rank 0 only).

    python bench/fold_bench.py [--reps 5] [--lines 200000] [--poprun PATH] [--out FILE]

run_all.py runs it as its `fold` scenario.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch_bench as lb  # noqa: E402

FOLD = "--fold-output"
WORKLOADS = ("common", "distinct", "rank0")
LATENCY_LINES = 200  # per instance and run
LATENCY_PERIOD = 0.005  # seconds between an instance's lines
START_MARGIN = 0.2  # seconds from the instances' release to the first scheduled line
# Each instance says it is ready, waits for the lock the benchmark holds until all are, then
# reads the schedule's start (so that how long instances take to start is not measured).
WRITER = r"""
import fcntl, os, sys, time
mode, count, period, where = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rank, out = int(os.environ["RANK"]), sys.stdout.buffer
open(os.path.join(where, f"ready.{rank}"), "w").close()
with open(os.path.join(where, "go")) as go:
    fcntl.flock(go, fcntl.LOCK_SH)
with open(os.path.join(where, "t0")) as f:
    t0 = float(f.read())
for k in range(count):
    wait = t0 + k * period - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    if mode == "rank0" and rank:
        continue
    out.write(b"tick %d\n" % k if mode != "distinct" else b"%d tick %d\n" % (rank, k))
    out.flush()
"""
# a set with gaps is braced: [1,{0-5,7}]<stdout>: (poprun/fold.py tag_label)
FOLDED_LINE = re.compile(rb"^\[1,\{?([0-9,-]+)\}?\]<stdout>:(.*)$", re.M)


def instances_of(label: bytes) -> tuple[int, ...]:
    """`0-2,5` -> (0, 1, 2, 5): the CPU-list format (spawner/cpulist.py)."""
    from spawner.cpulist import parse_cpu_list

    return parse_cpu_list(label.decode())


def verify_folded(path: Path, n: int, lines: int) -> str:
    """Every instance's `lines` lines of seq, in order, each printed once for it."""
    seen = [0] * n
    count = 0
    for match in FOLDED_LINE.finditer(path.read_bytes()):
        count += 1
        value = int(match.group(2))
        for key in instances_of(match.group(1)):
            if value != seen[key] + 1:
                return f"instance {key}: line {value} after {seen[key]}"
            seen[key] = value
    if seen != [lines] * n:
        return f"lines per instance {seen}, expected {lines} each"
    return ""


def console_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def throughput_run(cmd: list[str], n: int, lines: int, fold: bool, timeout: float,
                   scratch: Path, env: dict | None) -> lb.Run:
    out = scratch / "out"
    run = lb.run_to_file("fold" if fold else "plain", cmd, out, timeout, scratch, env, True)
    run = lb.checked(run, lambda: verify_folded(out, n, lines))
    if run.status == "ok":
        run.extra["console_lines"] = console_lines(out)
    return run


def latency_run(poprun: str, n: int, mode: str, fold: bool, timeout: float,
                env: dict | None, scratch: Path, count: int = LATENCY_LINES) -> dict:
    """One run: each console line's latency (s) against its schedule, and the line count."""
    scratch.mkdir(parents=True, exist_ok=True)
    for old in scratch.iterdir():
        old.unlink()
    (scratch / "go").touch()
    cmd = [poprun, "--num-instances", str(n), "--num-replicas", str(n), "--offline-mode=1",
           "--tag-output", *([FOLD] if fold else []), sys.executable, "-c", WRITER, mode,
           str(count), str(LATENCY_PERIOD), str(scratch)]
    latencies, rest = [], b""
    deadline = time.monotonic() + timeout
    with open(scratch / "go") as go:
        fcntl.flock(go, fcntl.LOCK_EX)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=env)
        while len(list(scratch.glob("ready.*"))) < n and proc.poll() is None and (
                time.monotonic() < deadline):
            time.sleep(0.01)
        t0 = time.monotonic() + START_MARGIN
        (scratch / "t0.tmp").write_text(repr(t0))
        (scratch / "t0.tmp").rename(scratch / "t0")
    try:
        while time.monotonic() < deadline:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            now = time.monotonic()
            if not chunk:
                break
            rest += chunk
            *done, rest = rest.split(b"\n")
            for line in done:
                k = int(line.rsplit(b" ", 1)[1])
                latencies.append(now - (t0 + k * LATENCY_PERIOD))
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait()
    return {"latencies": latencies, "lines": len(latencies), "returncode": proc.returncode}


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "p99": ordered[int(0.99 * (len(ordered) - 1))], "max": ordered[-1]}


def bench_fold(poprun: str, reps: int, lines: int, tmp: Path, n: int = 8,
               env: dict | None = None, timeout: float = 120.0,
               latency_lines: int = LATENCY_LINES) -> dict:
    """Both parts, poprun without and with --fold-output alternating (A B A B ...)."""
    program = lb.writer_cmd(lines)
    sides = {}
    contenders = []
    for fold in (False, True):
        cmd = [poprun, "--num-instances", str(n), "--num-replicas", str(n), "--offline-mode=1",
               "--tag-output", *([FOLD] if fold else []), *program]
        side = lb.Side("poprun" + (" " + FOLD if fold else ""), cmd)
        sides[fold] = side
        contenders.append(lb.Contender(side, lambda d, c=cmd, f=fold: throughput_run(
            c, n, lines, f, timeout, d, env)))
    lb.interleave(contenders, reps, tmp, f"fold n={n}", cleanup=True)
    throughput = []
    for fold, side in sides.items():
        entry = side.to_json()
        entry["console_lines"] = [r.extra.get("console_lines") for r in side.runs
                                  if r.status == "ok"]
        throughput.append(entry)
    latency = {}
    for mode in WORKLOADS:
        runs = {False: [], True: []}
        for _ in range(reps):
            for fold in (False, True):
                runs[fold].append(latency_run(poprun, n, mode, fold, timeout, env,
                                              tmp / "latency", latency_lines))
        latency[mode] = {("fold" if fold else "plain"): {
            "lines": [r["lines"] for r in got], "returncodes": [r["returncode"] for r in got],
            **summary([x for r in got for x in r["latencies"]])} for fold, got in runs.items()}
    return {"n": n, "lines": lines, "reps": reps, "writer": " ".join(program),
            "throughput": throughput,
            "latency": {"lines_per_instance": latency_lines, "period_s": LATENCY_PERIOD,
                        "workloads": latency}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--poprun", default=str(Path(sys.executable).with_name("poprun")))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fold_bench.") as tmp:
        result = bench_fold(args.poprun, args.reps, args.lines, Path(tmp), args.n)
    result["load"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    import report

    print("\n".join(report.fold_section(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
