"""Pod mode against SSH: one job of 2 hosts x 4 `true` instances, launched both ways.

    sudo python bench/pods_bench.py [--reps 10]

Two network namespaces on a bridge (tests/netns_hosts.py) stand for two pods or two hosts:

- *pods*: every pod runs the same `poprun --num-instances 8 ... true` (LeaderWorkerSet's
  variables, a shared secret), all started at once, as a job controller starts them; timed
  from the first start to the last pod's exit (the leader's, as a rule);
- *ssh*: `poprun -H h1,h2 --num-instances 8 ... true` run inside h1, each host reached over SSH
  (each connection an sshd of its own, `sshd -i` through the host alias's ProxyCommand): both
  hosts remote, as the launcher's own host is only by name; Popen to exit.

The sides alternate (A B A B ...) after one untimed warm-up each; medians, min and max are
printed. Root is needed for the namespaces (as for tests/test_pods.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "src")]

from conftest import OFFLINE, poprun_argv, poprun_env  # noqa: E402
from netns_hosts import start_netns_hosts  # noqa: E402

SECRET = "pods-bench-secret-0123456789abcdef"
JOB = (*OFFLINE, "--num-instances=8", "--num-replicas=8", "true")
TIMEOUT = 120


def pods_once(hosts) -> float:
    start = time.perf_counter()
    procs = []
    for i in range(2):
        env = poprun_env({**hosts.env(), "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(i),
                          "LWS_LEADER_ADDRESS": hosts.addr(1, "a"),
                          "POPRUN_POD_SECRET": SECRET})
        procs.append(subprocess.Popen(hosts.exec_argv(i + 1, *poprun_argv(*JOB)), env=env,
                                      stdout=subprocess.DEVNULL))
    for proc in procs:
        if proc.wait(timeout=TIMEOUT) != 0:
            raise RuntimeError(f"a pod exited with {proc.returncode}")
    return time.perf_counter() - start


def ssh_once(hosts) -> float:
    start = time.perf_counter()
    subprocess.run(hosts.exec_argv(1, *poprun_argv("-H", "h1,h2", *JOB)),
                   env=poprun_env(hosts.env()), stdout=subprocess.DEVNULL, check=True,
                   timeout=TIMEOUT)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    sides = {"pods": pods_once, "ssh": ssh_once}
    times: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp, start_netns_hosts(2, tmp, ("a",)) as hosts:
        for run in sides.values():
            run(hosts)  # warm-up: page cache, __pycache__
        for _ in range(args.reps):
            for side, run in sides.items():
                times[side].append(run(hosts))
    for side, seconds in times.items():
        print(f"{side:5} median {statistics.median(seconds) * 1000:6.0f} ms "
              f"(min {min(seconds) * 1000:.0f}, max {max(seconds) * 1000:.0f}, "
              f"{len(seconds)} runs)")
    ratio = statistics.median(times["pods"]) / statistics.median(times["ssh"])
    print(f"pods / ssh: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
