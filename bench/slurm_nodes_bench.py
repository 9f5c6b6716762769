"""poprun --launcher slurm on 2, 8 and 16 node daemons: what one launch costs the launch node.

For each node count, one local Slurm (tests/slurm_cluster.py) and one allocation of all its
nodes; inside it, interleaved, `srun -n 16 true` and `poprun --launcher slurm --num-instances
16 true` for each poprun tree given (`--tree name=src_dir`: PYTHONPATH=src_dir), so every side
meets the same machine load. Per run: wall time and the CPU time of the launch node's side
(the process and the children it reaped: srun, poprun's watchdog; not the nodes' agents and
instances); for poprun, its peak RSS (VmHWM, read until it exits) and the most `srun`
processes it had at once (its own children). One more run per
tree, untimed, polls `squeue -s` for the job steps it creates.

    python bench/slurm_nodes_bench.py --tree before=/work/main/src --tree after=src \
        --nodes 2,8,16 --reps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

INSTANCES = 16
POLL = 0.005  # seconds between samples of a running poprun


def _sruns_of(pid: int) -> int:
    """The sruns `pid` started: its children named srun that lead a session of their own
    (poprun starts each so). Not what an srun forked and left to poprun, a subreaper."""
    count = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() != "srun":
                continue
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and int(fields[3]) == int(entry):
                count += 1
        except (OSError, IndexError, ValueError):
            pass
    return count


def _hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def timed(argv: list[str], env: dict[str, str], watch: bool) -> dict:
    """One run: wall seconds and the CPU seconds of the launch node's side (the process and
    every child it reaped: srun, poprun's watchdog); with `watch`, the peak RSS and the most
    sruns at once."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    hwm, sruns = 0, 0
    while watch:
        hwm = max(hwm, _hwm_kib(proc.pid) or 0)
        sruns = max(sruns, _sruns_of(proc.pid))
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break  # exited, not reaped yet: its rusage comes with wait4
        time.sleep(POLL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {proc.returncode}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_kib": hwm,
            "sruns": sruns}


def steps_of_one_run(argv: list[str], env: dict[str, str], squeue_env: dict[str, str]) -> int:
    """The job steps one run creates, polling `squeue -s` while it runs."""
    seen: set[str] = set()
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            out = subprocess.run(["squeue", "-s", "-h", "-o", "%i"], env=squeue_env,
                                 capture_output=True, text=True).stdout
            seen.update(line.strip() for line in out.splitlines() if line.strip())
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True, timeout=300)
    finally:
        done.set()
        poller.join()
    return len(seen)


def inside_allocation(args: argparse.Namespace) -> None:
    """Run inside `salloc`: the interleaved rounds; JSON on stdout."""
    trees = dict(t.split("=", 1) for t in args.tree)
    base = {k: v for k, v in os.environ.items()}
    nodes = int(os.environ["SLURM_NNODES"])
    sides = {"srun": (["srun", "-n", str(INSTANCES), "true"], base, False)}
    for name, src in trees.items():
        env = {**base, "PYTHONPATH": os.path.abspath(src), "POPRUN_NO_DASHBOARD": "1"}
        sides[f"poprun {name}"] = ([sys.executable, "-m", "poprun", "--launcher", "slurm",
                                    "--num-instances", str(INSTANCES), "--num-replicas",
                                    str(INSTANCES), "--offline-mode=1", "true"], env, True)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for name, (argv, env, watch) in sides.items():  # warm-up: page cache, .pyc
        timed(argv, env, watch)
    for _ in range(args.reps):
        for name, (argv, env, watch) in sides.items():
            runs[name].append(timed(argv, env, watch))
    steps = {name: steps_of_one_run(argv, env, base)
             for name, (argv, env, _) in sides.items() if name != "srun"}
    summary = {}
    for name, got in runs.items():
        walls = sorted(r["wall"] for r in got)
        summary[name] = {"wall_median": statistics.median(walls), "wall_min": walls[0],
                         "wall_max": walls[-1],
                         "cpu_median": statistics.median(r["cpu"] for r in got),
                         "rss_mib_median": statistics.median(r["rss_kib"] for r in got) / 1024,
                         "sruns_max": max(r["sruns"] for r in got),
                         "steps": steps.get(name, 1)}
    json.dump({"nodes": nodes, "reps": args.reps, "sides": summary, "runs": runs},
              sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="name=src_dir of a poprun to run (PYTHONPATH)")
    parser.add_argument("--nodes", default="2,8,16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        inside_allocation(args)
        return
    from slurm_cluster import start_slurm_cluster

    results = []
    for n in map(int, args.nodes.split(",")):
        with start_slurm_cluster(n, cpus_per_node=max(INSTANCES // n, 1)) as cluster:
            argv = ["salloc", "--quiet", f"-N{n}", f"-n{INSTANCES}", sys.executable, __file__,
                    "--inside", "--reps", str(args.reps),
                    *(f"--tree={t}" for t in args.tree)]
            done = cluster.run(argv, timeout=3600)
            if done.returncode != 0:
                raise SystemExit(f"{n} nodes: {done.stderr[-3000:]}")
            result = json.loads(done.stdout)
            results.append(result)
            for name, s in result["sides"].items():
                print(f"{n:>3} nodes  {name:<14} wall median {s['wall_median'] * 1000:6.0f} ms "
                      f"(min {s['wall_min'] * 1000:.0f}, max {s['wall_max'] * 1000:.0f})  "
                      f"CPU {s['cpu_median'] * 1000:5.0f} ms  "
                      f"RSS {s['rss_mib_median']:5.1f} MiB  sruns {s['sruns_max']:>2}  "
                      f"steps {s['steps']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
