#!/usr/bin/env python3
"""The cost of wiring up an MPI world (issue 24, point 6): N local ranks of an mpi4py program
(MPI_Init, one Barrier, Finalize) under poprun, which serves the world itself over PMI-1
(src/poprun/run/worlds/pmi1.py), against MPICH's own `mpiexec` (Hydra) from the same `mpich` wheel.

    python bench/mpi_bench.py                  # 15 reps, 4 and 16 ranks
    python bench/mpi_bench.py --sizes 16 --reps 5

bench/run_all.py runs the same scenario as `mpi` (and puts it on the page); run alone, this
prints the medians. Sides, interleaved after one warm-up each:
  floor     one `python -c "from mpi4py import MPI"`: an MPI singleton, what the interpreter
            and the import (MPI_Init with no launcher) cost one rank
  baseline  N such singletons started at once, no launcher: the ranks' own start-up on this
            machine's cores, without any wire-up
  poprun / mpiexec   the N-rank world; rank 0 prints the world's size, which must be N (N
            singletons would print 1 each)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import launch_bench as lb  # noqa: E402

# Rank 0 prints the size so a run proves one world of N formed: if the launcher's PMI were
# not found, MPICH would start N singletons and print "1" N times.
PROGRAM = "from mpi4py import MPI; c = MPI.COMM_WORLD; c.Barrier(); c.rank or print(c.size)"
FLOOR_PROGRAM = "from mpi4py import MPI"
SIDES = ("floor", "baseline", "poprun", "mpiexec")
TIMEOUT_S = 60.0  # a wire-up still going after this is a hang (16 ranks take ~2 s here)
# MPICH variables given to every side alike. None is needed: the wheel's default device
# (ch4, UCX netmod) puts ranks on one host on shared memory, and 16 ranks form their world
# with both launchers as installed. Were one needed (e.g. MPIR_CVAR_CH4_NETMOD=ofi,
# FI_PROVIDER=tcp), it would go here, so that the sides stay comparable.
TRANSPORT_ENV: dict[str, str] = {}


def wheel_file(dist: str, name: str) -> str | None:
    """The installed file `bin/<name>` of the distribution `dist`, by its RECORD: the wheel's
    own, never one that comes first on PATH (Open MPI's /usr/bin/mpirun, a pyenv shim)."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.parts[-2:] == ("bin", name):
            path = str(f.locate().resolve())
            return path if os.access(path, os.X_OK) else None
    return None


def find_mpiexec() -> tuple[str | None, str]:
    """(path of the mpich wheel's mpiexec, '') or (None, why the scenario cannot run)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install mpi4py mpich)"
    path = wheel_file("mpich", "mpiexec")
    if path is None:
        return None, "the mpich wheel (with its mpiexec) is not installed (pip install mpich)"
    return path, ""


def hydra_version(mpiexec: str) -> str | None:
    """'5.0.2' if `mpiexec` is MPICH's Hydra, else None."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "HYDRA" not in out:
        return None
    version = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.strip().startswith("Version:")), "")
    return version or "?"


def mpi_versions(python: str, mpiexec: str, env: dict[str, str] | None) -> tuple[str, str]:
    """(version text, '') or ('', why not): Hydra's version, and the MPI library mpi4py loads,
    which must be MPICH's (an mpi4py built against Open MPI would not read PMI_FD)."""
    hydra = hydra_version(mpiexec)
    if hydra is None:
        return "", f"{mpiexec} is not MPICH's Hydra"
    probe = "import mpi4py; from mpi4py import MPI; print(mpi4py.__version__); print(MPI.Get_library_version())"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60,
                             env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"mpi4py does not start: {exc}"
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) < 2:
        return "", f"mpi4py does not start: {out.stderr.strip()[-300:]}"
    if "MPICH" not in lines[1]:
        return "", f"mpi4py loads {lines[1].strip()[:80]!r}, not MPICH"
    wheel = importlib.metadata.version("mpich")
    return f"Hydra {hydra} (mpich wheel {wheel}); mpi4py {lines[0]} on {' '.join(lines[1].split())}", ""


def mpi_env(base: dict[str, str] | None) -> dict[str, str]:
    return {**(base if base is not None else os.environ), **TRANSPORT_ENV}


def world_size_check(out: Path, n: int):
    def verify() -> str:
        text = out.read_text(errors="replace") if out.exists() else ""
        return "" if text == f"{n}\n" else f"rank 0 printed {text[:80]!r}, expected the world size {n}"
    return verify


def world_run(side: str, cmd: list[str], n: int, env: dict[str, str], scratch: Path) -> lb.Run:
    """One N-rank world under a launcher, its own CPU measured; wrong output is a failure for
    either launcher (a world that did not form did not do the work being timed)."""
    out = scratch / "out"
    run = lb.run_to_file(side, cmd, out, TIMEOUT_S, scratch, env, measure=True)
    return lb.checked(run, world_size_check(out, n))


def contenders(tools: lb.Tools, mpiexec: str | None, n: int, sides: tuple[str, ...]) -> list[lb.Contender]:
    env = mpi_env(tools.env)
    rank = [tools.python, "-c", PROGRAM]
    floor = [tools.python, "-c", FLOOR_PROGRAM]
    out = []
    for name in sides:
        if name == "floor":
            out.append(lb.Contender(lb.Side("floor", floor), lambda d: lb.run_quiet("floor", floor, TIMEOUT_S, d, env)))
        elif name == "baseline":
            out.append(lb.Contender(lb.Side("baseline", floor), lambda d: lb.run_timed(
                "baseline", [floor] * n, [subprocess.DEVNULL] * n, TIMEOUT_S, d, env)))
        elif name == "poprun":
            pop = tools.poprun_cmd(n, rank)
            out.append(lb.Contender(lb.Side("poprun", pop), lambda d: world_run("poprun", pop, n, env, d)))
        elif name == "mpiexec" and mpiexec:
            hydra = [mpiexec, "-n", str(n), *rank]
            out.append(lb.Contender(lb.Side("mpiexec", hydra), lambda d: world_run("mpiexec", hydra, n, env, d),
                                    max_hangs=1))
    return out


def bench_mpi(tools: lb.Tools, mpiexec: str | None, reps: int, sizes: list[int], tmp: Path,
              sides: tuple[str, ...] = SIDES) -> list[lb.LaunchResult]:
    """For each N in sizes, the sides interleaved (A B C A B C ...), one warm-up each at the
    first size (it also fills the private bytecode cache, see lb.python_env)."""
    results = []
    for k, n in enumerate(sizes):
        group = contenders(tools, mpiexec, n, sides)
        lb.interleave(group, reps, tmp / f"n{n}", f"mpi n={n}", warmup=(k == 0))
        results.append(lb.LaunchResult(n, [c.side for c in group]))
    return results


# ---------------------------------------------------------------------------- alone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sizes", default="4,16")
    p.add_argument("--poprun", default=None)
    args = p.parse_args(argv)
    mpiexec, why = find_mpiexec()
    if mpiexec is None:
        print(f"mpi_bench: skipped: {why}", file=sys.stderr)
        return 0
    print(f"mpiexec: {mpiexec}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mpi_bench.") as name:
        tmp = Path(name)
        pycache = tmp / "pycache" if os.environ.get(lb.BYTECODE_VAR) else None
        tools = lb.Tools(args.poprun or lb.default_poprun() or "poprun", None, TIMEOUT_S, TIMEOUT_S,
                         env=lb.python_env(dict(os.environ), pycache))
        results = bench_mpi(tools, mpiexec, args.reps, [int(s) for s in args.sizes.split(",")], tmp)
    for res in results:
        for s in res.sides:
            print(f"N={res.instances:<3} {s.name:9} median {lb.ms(s.median)} ({lb.ms(s.min)}-{lb.ms(s.max)}) "
                  f"{lb.counts(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
