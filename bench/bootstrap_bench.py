#!/usr/bin/env python3
"""What bringing the agent costs (issue 19, point 3): first launch on fresh hosts vs later ones.

16 loopback "hosts" (real sshd servers, tests/sshd_hosts.py), each with its own cache
(XDG_CACHE_HOME through sshd's SetEnv, as separate machines would have), whose Python is a bare
venv (`--without-pip`: none of the project). Agents are started the way a launch starts them
(spawner.bootstrap.start_agent on one asyncssh connection per host), timed from the start of
the agent's channel to its HELLO answer, per host, in four ways:

    installed    today's command, `exec <python> -m spawner.agent`, the launcher's Python
                 (poprun installed): the reference
    probe        --remote-install=auto with the launcher's Python: the cache test and the probe
                 find the installed agent (what auto costs where poprun is installed)
    fresh        auto with the bare venv and empty caches: probe, zip, unpack, agent
    cached       auto with the bare venv, caches present: the agent from the cache

each with one host alone (the per-host cost, uncontended) and with 16 at once (a launch; on
this 2-core machine the 16 sessions share the CPUs, so these are totals, not per-host costs).
Then the whole command, `poprun -H h1..h16 --num-instances 16 true`, on fresh caches vs
cached ones. The target: fresh minus cached under 150 ms per host; cached no slower than
installed.

    python bench/bootstrap_bench.py                    # 5 reps, ~1 min on 2 cores
    python bench/bootstrap_bench.py --reps 2 --hosts 4
    python bench/bootstrap_bench.py --without-bashrc   # ~/.bashrc hidden from every session

Prints a table and writes bench/results/bootstrap-<timestamp>.json. A benchmark, not a test:
it exits 0 whatever the figures (1 only with --check when the target is missed).
See bench/README.md, "Bringing the agent".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path[:0] = [str(BENCH_DIR), str(REPO / "tests"), str(REPO / "src")]

from launch_bench import results_path  # noqa: E402
from multihost_bench import NAMESPACE_MARK, reexec_without_rc  # noqa: E402
from sshd_hosts import start_ssh_hosts  # noqa: E402

TARGET_MS = 150.0  # fresh minus cached, per host (issue 19)
MODES = ("installed", "probe", "fresh", "cached")


class _Sink:
    def on_output(self, key, stream, data):
        pass

    def on_exit(self, key, returncode):
        pass


async def _start(conn, host: str, mode: str, bare: str) -> tuple[float, dict[str, float]]:
    """Start one agent (and close it); returns (ms to HELLO answered, bootstrap phases)."""
    from spawner import bootstrap
    from spawner.remote import RemoteSpawner

    notes: list[str] = []
    spawner = RemoteSpawner(conn, host, _Sink())
    started = time.perf_counter()
    if mode == "installed":
        await spawner.start(cwd="/")
    else:
        python = None if mode == "probe" else bare
        await bootstrap.start_agent(spawner, "auto", python=python, log=notes.append,
                                    cwd="/")
    elapsed = (time.perf_counter() - started) * 1000
    await spawner.close()
    phases = {}
    for note in notes:  # "...: asked for N ms after the start, ready M ms later"
        found = re.search(r"asked for (\d+) ms after the start, ready (\d+) ms later", note)
        phases = {"ask": float(found[1]), "bring": float(found[2])}
    return elapsed, phases


def _clear(caches: Path) -> None:
    for host_dir in caches.iterdir():
        shutil.rmtree(host_dir / "poprun", ignore_errors=True)


async def bench_agents(hosts, caches: Path, bare: str, reps: int) -> dict:
    from spawner.ssh import Target, close_all, connect_all

    conns = await connect_all([Target(h.alias) for h in hosts.hosts])
    out: dict = {}
    try:
        for width in (1, len(hosts.hosts)):
            chosen = list(conns.items())[:width]
            for mode in MODES:  # warm-up: bytecode, page cache, the first cache made
                _clear(caches)
                await asyncio.gather(*(_start(c, t.name, mode, bare) for t, c in chosen))
            runs: dict[str, list] = {m: [] for m in MODES}
            for _ in range(reps):
                for mode in MODES:  # interleaved, so drift hits every mode alike
                    if mode == "fresh":
                        _clear(caches)
                    t0 = time.perf_counter()
                    per_host = await asyncio.gather(*(_start(c, t.name, mode, bare)
                                                      for t, c in chosen))
                    runs[mode].append({"all_ms": (time.perf_counter() - t0) * 1000,
                                       "hosts": [{"ready_ms": ms, **ph} for ms, ph in per_host]})
            out[f"{width} host" + ("s" if width > 1 else "")] = runs
    finally:
        await close_all(conns.values())
    return out


def bench_command(hosts, caches: Path, bare: str, reps: int, tmp: Path) -> dict:
    """poprun itself over every host: fresh caches vs cached, medians of `reps`."""
    aliases = ",".join(h.alias for h in hosts.hosts)
    env = {**os.environ, "HOME": str(hosts.home), "PYTHONPYCACHEPREFIX": str(tmp / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, "-m", "poprun", "--offline-mode=yes", "-H", aliases,
           f"--num-instances={len(hosts.hosts)}", f"--num-replicas={len(hosts.hosts)}",
           f"--remote-python={bare}", "true"]
    runs: dict[str, list[float]] = {"fresh": [], "cached": []}
    for rep in range(reps + 1):  # the first pair is a warm-up
        for mode in runs:
            if mode == "fresh":
                _clear(caches)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
            elapsed = (time.perf_counter() - t0) * 1000
            if proc.returncode:
                raise RuntimeError(f"poprun failed ({proc.returncode}): {proc.stderr.decode()}")
            if rep:
                runs[mode].append(elapsed)
    return runs


def _median(values) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(agents: dict, command: dict) -> dict:
    summary: dict = {}
    for width, runs in agents.items():
        row = {}
        for mode, reps in runs.items():
            per_host = [h["ready_ms"] for r in reps for h in r["hosts"]]
            row[mode] = {"per_host_ready_ms": _median(per_host),
                         "all_ready_ms": _median([r["all_ms"] for r in reps])}
            if mode == "fresh":
                row[mode]["ask_ms"] = _median([h["ask"] for r in reps for h in r["hosts"]])
                row[mode]["bring_ms"] = _median([h["bring"] for r in reps for h in r["hosts"]])
        hosts = len(runs["fresh"][0]["hosts"])
        # What a first launch adds, per host: with several hosts at once, the added time to
        # all agents ready shared out (each host's own time there is mostly waiting for CPU).
        row["extra_first_ms"] = row["fresh"]["all_ready_ms"] - row["cached"]["all_ready_ms"]
        row["extra_first_per_host_ms"] = row["extra_first_ms"] / hosts
        row["cached_minus_installed_ms"] = (row["cached"]["all_ready_ms"]
                                            - row["installed"]["all_ready_ms"])
        summary[width] = row
    summary["command"] = {mode: _median(v) for mode, v in command.items()}
    return summary


def print_table(summary: dict, hosts: int) -> None:
    print(f"{'':10} {'mode':10} {'per host':>10} {'all ready':>10}  (ms, medians)")
    for width, row in summary.items():
        if width == "command":
            continue
        for mode in MODES:
            r = row[mode]
            extra = (f"   need at {r['ask_ms']:.0f}, then ready in {r['bring_ms']:.0f}"
                     if mode == "fresh" else "")
            print(f"{width:10} {mode:10} {r['per_host_ready_ms']:10.0f} "
                  f"{r['all_ready_ms']:10.0f}{extra}")
        print(f"{width:10} first launch: +{row['extra_first_ms']:.0f} ms to all ready, "
              f"{row['extra_first_per_host_ms']:.0f} ms per host; cached vs installed "
              f"{row['cached_minus_installed_ms']:+.0f} ms")
    cmd = summary["command"]
    print(f"poprun -H h1..h{hosts} --num-instances {hosts} true: fresh {cmd['fresh']:.0f} ms, "
          f"cached {cmd['cached']:.0f} ms ({(cmd['fresh'] - cmd['cached']) / hosts:.0f} ms per "
          f"host)")


def _machine() -> dict:
    import datetime
    import platform

    load = os.getloadavg()
    return {"timestamp": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": sys.version.split()[0], "loadavg": [round(x, 2) for x in load]}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hosts", type=int, default=16)
    p.add_argument("--without-bashrc", action="store_true",
                   help="run in a private mount namespace where ~/.bashrc is empty")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 unless the first launch costs < {TARGET_MS:g} ms more per host")
    p.add_argument("--results-dir", default=str(BENCH_DIR / "results"))
    p.add_argument("--tmpdir", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.without_bashrc and not os.environ.get(NAMESPACE_MARK):
        return reexec_without_rc(argv, Path(__file__).resolve())
    tmp = Path(tempfile.mkdtemp(prefix="bootstrap-bench-", dir=args.tmpdir))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "bare")],
                       check=True)
        bare = str(tmp / "bare" / "bin" / "python")
        caches = tmp / "caches"
        with start_ssh_hosts(args.hosts, tmp, setenv=lambda h: {
                "XDG_CACHE_HOME": str(caches / h.alias)}) as hosts:
            for h in hosts.hosts:
                (caches / h.alias).mkdir(parents=True, exist_ok=True)
            os.environ["HOME"] = str(hosts.home)  # asyncssh's ~/.ssh/config
            agents = asyncio.run(bench_agents(hosts, caches, bare, args.reps))
            command = bench_command(hosts, caches, bare, args.reps, tmp)
        summary = summarise(agents, command)
        print_table(summary, args.hosts)
        from spawner import bootstrap

        result = {"machine": _machine(), "hosts": args.hosts, "reps": args.reps,
                  "bashrc_hidden": os.environ.get(NAMESPACE_MARK),
                  "payload_bytes": len(bootstrap.payload().zip),
                  "summary": summary, "agents": agents, "command": command}
        out_dir = Path(args.results_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = results_path(out_dir, "bootstrap-")
        path.write_text(json.dumps(result, indent=1))
        print(f"results: {path}")
        worst = max(row["extra_first_per_host_ms"] for key, row in summary.items()
                    if key != "command")
        return 1 if args.check and worst >= TARGET_MS else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
