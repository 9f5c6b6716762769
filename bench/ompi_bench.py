#!/usr/bin/env python3
"""The cost of wiring up Open MPI's world: N local ranks of an mpi4py program (MPI_Init, one
Barrier, Finalize) under poprun, which serves their PMIx itself (src/spawner/worlds/pmixserver.py),
against Open MPI's own `mpirun` on the same program, with the same Open MPI: Debian's 4.1
(`/usr/bin/mpirun`, `/usr/bin/python3` with python3-mpi4py).

    python bench/ompi_bench.py                 # 15 reps, 4 and 8 ranks
    python bench/ompi_bench.py --sizes 4 --reps 5
    python bench/ompi_bench.py --poprun ./a/poprun --other ./b/poprun   # two trees, A/B

Sides, interleaved after one warm-up each (mpi_bench.py's way): floor (one singleton
`from mpi4py import MPI`), poprun, mpirun; rank 0 prints the world's size, which must be N.
mpirun runs as it must here: `--oversubscribe` (2 cores), and as root where we are root.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import launch_bench as lb  # noqa: E402
import mpi_bench as mb  # noqa: E402

PYTHON = "/usr/bin/python3"
MPIRUN = "/usr/bin/mpirun"
SIDES = ("floor", "poprun", "mpirun")


def contenders(poprun: str, n: int, env: dict[str, str],
               other: str | None = None) -> list[lb.Contender]:
    rank = [PYTHON, "-c", mb.PROGRAM]
    floor = [PYTHON, "-c", mb.FLOOR_PROGRAM]
    pop = [poprun, "--num-instances", str(n), "--num-replicas", str(n), "--offline-mode=1", *rank]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    mpirun = [MPIRUN, *root, "--oversubscribe", "-n", str(n), *rank]
    # Another poprun (another tree), interleaved with the rest: on a loaded machine only
    # sides measured in one round compare.
    others = [] if other is None else [[other, *pop[1:]]]
    return [
        lb.Contender(lb.Side("floor", floor), lambda d: lb.run_quiet("floor", floor, mb.TIMEOUT_S, d, env)),
        *[lb.Contender(lb.Side("other", argv), lambda d, argv=argv: mb.world_run(
            "other", argv, n, env, d)) for argv in others],
        lb.Contender(lb.Side("poprun", pop), lambda d: mb.world_run("poprun", pop, n, env, d)),
        lb.Contender(lb.Side("mpirun", mpirun), lambda d: mb.world_run("mpirun", mpirun, n, env, d),
                     max_hangs=1),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sizes", default="4,8")
    p.add_argument("--poprun", default=None)
    p.add_argument("--other", default=None, help="a second poprun, measured beside the first")
    args = p.parse_args(argv)
    if not (os.access(MPIRUN, os.X_OK) and os.access(PYTHON, os.X_OK)):
        print(f"ompi_bench: skipped: needs {MPIRUN} and {PYTHON} (apt-get install openmpi-bin "
              "python3-mpi4py)", file=sys.stderr)
        return 0
    poprun = args.poprun or lb.default_poprun() or "poprun"
    with tempfile.TemporaryDirectory(prefix="ompi_bench.") as name:
        tmp = Path(name)
        for k, n in enumerate(int(s) for s in args.sizes.split(",")):
            group = contenders(poprun, n, dict(os.environ), args.other)
            lb.interleave(group, args.reps, tmp / f"n{n}", f"ompi n={n}", warmup=(k == 0))
            sides = {c.side.name: c.side for c in group}
            for side in sides.values():
                print(f"N={n:<3} {side.name:7} median {lb.ms(side.median)} "
                      f"({lb.ms(side.min)}-{lb.ms(side.max)}) {lb.counts(side)}")
            for name in ("poprun", "other"):
                if name in sides and sides[name].median and sides["mpirun"].median:
                    print(f"N={n:<3} {name} / mpirun: "
                          f"{sides[name].median / sides['mpirun'].median:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
