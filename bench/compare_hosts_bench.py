#!/usr/bin/env python3
"""What comparing the hosts costs a launch (`--compare-hosts`; docs/architecture.md, "Hosts
that differ"): 8 instances on 2 loopback sshd hosts (tests/sshd_hosts.py), and 8 on this host
alone, each launched by two poprun trees in turn (interleaved: drift on the machine hits both):
`--before` (a checkout without the comparison, e.g. main's src/) and this one.

The program is a Python script, so each host reads its Python's distributions (the launch's
most expensive fact); `--program true` measures a binary, which has none. Prints the median
and quartiles of each side's wall time and the difference of the medians; on a loaded
machine those spread by hundreds of ms, so it also prints what the comparison held the
launch up, from the launch's own -vv line: the wait for the hosts' facts, and the comparing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO / "tests"))

from sshd_hosts import start_ssh_hosts  # noqa: E402


def wall(src: str, env: dict[str, str], argv: list[str], cwd: str) -> float:
    return launch(src, env, argv, cwd)[0]


def launch(src: str, env: dict[str, str], argv: list[str], cwd: str) -> tuple[float, str]:
    """Seconds the launch took, and its stderr."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "poprun", "--offline-mode=yes", *argv],
                          env={**env, "PYTHONPATH": src}, cwd=cwd, capture_output=True,
                          timeout=120)
    took = time.perf_counter() - started
    if done.returncode != 0 or b"differ in" in done.stderr:
        raise SystemExit(f"{src}: {argv} exited {done.returncode}:\n{done.stderr.decode()}")
    return took, done.stderr.decode()


def on_the_path(src: str, env: dict[str, str], argv: list[str], cwd: str, rounds: int) -> str:
    """What the comparison itself held the launch up, from its -vv line: the wait for the
    hosts' facts (read while the launch went on) and the comparing."""
    waited, comparing = [], []
    for _ in range(rounds):
        err = launch(src, env, ["-vv", *argv], cwd)[1]
        found = re.search(r"waited ([\d.]+) ms for their facts, ([\d.]+) ms comparing", err)
        if found is None:
            raise SystemExit(f"no comparison in -vv's output:\n{err[-2000:]}")
        waited.append(float(found[1]))
        comparing.append(float(found[2]))
    return (f"waited for the facts: median {statistics.median(waited):.2f} ms (max "
            f"{max(waited):.2f}); comparing: median {statistics.median(comparing):.2f} ms")


def summary(times: list[float]) -> str:
    q1, med, q3 = statistics.quantiles(times, n=4)
    return f"median {med * 1000:7.1f} ms (quartiles {q1 * 1000:.1f}-{q3 * 1000:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="src/ of the tree to compare with")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--program", default="script", help="'script' or a program name")
    args = parser.parse_args()
    after = str(REPO / "src")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text("pass\n")
        program = [sys.executable, str(script)] if args.program == "script" else [args.program]
        cases = {"2 hosts": ["-H", "h1,h2", "--num-instances=8", "--num-replicas=8", *program],
                 "1 host": ["--num-instances=8", "--num-replicas=8", *program]}
        with start_ssh_hosts(2, tmp) as hosts:
            env = {k: v for k, v in hosts.env().items() if k != "CI"}
            for argv in cases.values():  # warm: bytecode, the hosts' agent caches
                wall(args.before, env, argv, tmp)
                wall(after, env, argv, tmp)
            for name, argv in cases.items():
                times: dict[str, list[float]] = {"before": [], "after": []}
                for i in range(args.rounds):
                    order = ("before", "after") if i % 2 == 0 else ("after", "before")
                    for side in order:
                        src = args.before if side == "before" else after
                        times[side].append(wall(src, env, argv, tmp))
                delta = statistics.median(times["after"]) - statistics.median(times["before"])
                print(f"{name}, {args.program}, {args.rounds} rounds:")
                for side in ("before", "after"):
                    print(f"  {side:6} {summary(times[side])}")
                print(f"  after - before: {delta * 1000:+.1f} ms (medians)")
                if name == "2 hosts":
                    print(f"  on the launch's path: {on_the_path(after, env, argv, tmp, 10)}")


if __name__ == "__main__":
    main()
