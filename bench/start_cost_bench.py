#!/usr/bin/env python3
"""What starting an instance costs the launcher's host: a `LocalSpawner` starts N `/bin/true`
in one process (wall time of the N spawn() calls; CPU of that process and its children: the
session leader and the instances, docs/architecture.md "One session per host and attempt"),
and whole launches, `poprun --num-instances N --num-replicas N true` (Popen -> reap).

Each tree is a `src` directory (this checkout's by default; pass another, e.g. main's, to
compare); the trees alternate within each rep, after one untimed warm-up each:

    python bench/start_cost_bench.py
    python bench/start_cost_bench.py --tree main=/work/main/src --tree this=src -n 8 -n 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")

# Run with the tree's src first on sys.path; prints "<wall s> <cpu s>" for N spawns.
IN_PROCESS = """
import asyncio, os, resource, sys, time
from spawner.local import LocalSpawner, ProcessSpec

class Sink:
    def on_output(self, *args): pass
    def on_exit(self, *args): pass

def cpu():
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))

async def main(n):
    spawner = LocalSpawner(Sink(), asyncio.get_running_loop(), cgroups=False)
    env = dict(os.environ)
    start = time.perf_counter()
    for key in range(n):
        spawner.spawn(ProcessSpec(key, ("/bin/true",), env))
    took = time.perf_counter() - start
    while not spawner.idle:
        await asyncio.sleep(0.005)
    spawner.close()
    return took

before = cpu()
wall = asyncio.run(main(int(sys.argv[1])))
print(wall, cpu() - before)
"""


def measure(src: str, n: int, launch: bool) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": src}
    if launch:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "poprun", "--offline-mode=yes",
                        f"--num-instances={n}", f"--num-replicas={n}", "true"], env=env,
                       stdout=subprocess.DEVNULL, check=True, timeout=600)
        return time.perf_counter() - start, 0.0
    out = subprocess.run([sys.executable, "-c", IN_PROCESS, str(n)], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    return float(out[0]), float(out[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="NAME=SRC",
                   help="a src directory to measure (default: this checkout's)")
    p.add_argument("-n", action="append", type=int, default=[], help="instances (8, 64)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": SRC}
    for n in args.n or [8, 64]:
        for launch in (False, True):
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
            for rep in range(args.reps + 1):
                for name, src in trees.items():
                    took = measure(src, n, launch)
                    if rep:
                        got[name].append(took)
            what = f"poprun ... true x{n}" if launch else f"LocalSpawner, {n} starts"
            for name, runs in got.items():
                wall = statistics.median(r[0] for r in runs)
                line = f"{what:28} {name:8} wall {wall * 1e3:7.1f} ms"
                if not launch:
                    cpu = statistics.median(r[1] for r in runs)
                    line += f", CPU {cpu / n * 1e3:.2f} ms a start (with its children)"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
