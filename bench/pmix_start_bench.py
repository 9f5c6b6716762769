#!/usr/bin/env python3
"""What a PMIx server's process costs to start (src/spawner/worlds/pmixhost.py,
docs/architecture.md,
"The instances' worlds"): from `PmixHost.prestart` to its answer to PMIX_SERVE (libpmix's
server up, the gate in place), then to PMIX_OPEN's (a world of 4 ranks registered: what the
instances wait for), as wall time, and the process's own CPU (its rusage once reaped).

    python bench/pmix_start_bench.py                     # 15 reps, the system libpmix
    python bench/pmix_start_bench.py --reps 9 --libpmix /path/to/libpmix.so.2
    PYTHONPATH=/other/tree/src python bench/pmix_start_bench.py   # another tree's

Each rep is one fresh server in this process's event loop, killed after, as a launch's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--libpmix", default=None)
    args = p.parse_args(argv)
    from spawner.worlds import pmixfind, pmixhost, pmixplan

    path = args.libpmix or pmixfind.find(os.environ, [sys.executable])
    if path is None:
        print("pmix_start_bench: skipped: no libpmix here", file=sys.stderr)
        return 0
    served, opened, cpu = [], [], []
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory(prefix="pmix_start_bench.") as tmp:
        os.environ["TMPDIR"] = tmp  # the servers' directories
        for rep in range(args.reps + 1):  # the first: a warm-up
            host = pmixhost.PmixHost(path, None, "localhost", loop)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            host.prestart(f"poprun-bench{rep}-0")
            loop.run_until_complete(host._next.ready())
            up = time.perf_counter()
            world = pmixplan.world(f"poprun-bench{rep}-0", ["localhost"] * 4, "localhost")
            loop.run_until_complete(host.open(world, pmixhost.Handler()))
            done = time.perf_counter()
            host.close()
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if rep:
                served.append((up - start) * 1000)
                opened.append((done - start) * 1000)
                cpu.append((after.ru_utime + after.ru_stime - before.ru_utime
                            - before.ru_stime) * 1000)
    loop.close()

    def say(what: str, values: list[float]) -> str:
        return (f"{what} {statistics.median(values):.0f} ms "
                f"({min(values):.0f}-{max(values):.0f})")

    print(f"{path}, {args.reps} reps, medians (min-max): " + "; ".join(
        [say("to PMIX_SERVE's answer", served), say("to PMIX_OPEN's", opened),
         say("server's CPU", cpu)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
