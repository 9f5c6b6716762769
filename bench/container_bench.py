"""The container's own start: `poprun --num-instances 8 true`, bare, in bubblewrap and in
podman (bench/README.md, "Containers").

    python bench/container_bench.py [--reps 5] [--instances 8]

The sides alternate within each repetition (bare, bwrap, podman, bare, ...) after one untimed
warm-up each; each run is Popen -> reap of poprun, its output to /dev/null. podman's image
is tests/container_runtimes.py's (built once per machine from its own files), and its options
those the tests use. A side that cannot run here is skipped, saying why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def sides() -> dict[str, list[str]]:
    import pytest

    from container_runtimes import runtime_options

    out = {"bare": []}
    for runtime in ("bwrap", "podman"):
        try:
            out[runtime] = runtime_options(runtime)
        except (pytest.skip.Exception, pytest.fail.Exception) as exc:
            print(f"{runtime}: skipped: {exc}", file=sys.stderr)
    return out


def one(options: list[str], instances: int) -> float:
    argv = [sys.executable, "-m", "poprun", "--offline-mode=yes", *options,
            f"--num-instances={instances}", f"--num-replicas={instances}", "true"]
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.decode()}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--instances", type=int, default=8)
    args = parser.parse_args()
    chosen = sides()
    for options in chosen.values():  # warm-up: page cache, podman's storage
        one(options, args.instances)
    times: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(args.reps):
        for name, options in chosen.items():
            times[name].append(one(options, args.instances))
    load = os.getloadavg()[0]
    print(f"{args.instances} instances of `true`, {args.reps} reps, {os.cpu_count()} cores, "
          f"load {load:.1f}")
    bare = statistics.median(times["bare"])
    print("| side | median s | min-max s | per instance over bare, ms |")
    print("|---|---|---|---|")
    for name, runs in times.items():
        median = statistics.median(runs)
        extra = (median - bare) / args.instances * 1000
        print(f"| {name} | {median:.3f} | {min(runs):.3f}-{max(runs):.3f} | "
              f"{extra:+.0f} |")


if __name__ == "__main__":
    main()
