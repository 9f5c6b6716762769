"""Reading the sysfs files a NUMA topology is parsed from (poprun.plan.topology parses them).
Here, in the spawner layer, so that a host's agent can send its files to the launcher."""

from __future__ import annotations

import glob
import os

SYSFS_ROOT_ENV = "POPRUN_SYSFS_ROOT"

NODE_DIR = "devices/system/node"
CPU_DIR = "devices/system/cpu"
# Newer kernels name the SMT siblings `core_cpus_list`; `thread_siblings_list` is the old
# (still present) name of the same set.
SIBLING_FILES = ("core_cpus_list", "thread_siblings_list")
TOPOLOGY_FILES = ("physical_package_id", "core_id", *SIBLING_FILES)


def sysfs_root() -> str:
    """`$POPRUN_SYSFS_ROOT`, or `/sys`."""
    return os.environ.get(SYSFS_ROOT_ENV) or "/sys"


def read_sysfs(root: str | None = None) -> dict[str, str]:
    """The files `parse_topology` reads, keyed by their path under `root` (default
    `sysfs_root()`). Files that do not exist are simply absent."""
    root = root or sysfs_root()
    patterns = [f"{NODE_DIR}/online", f"{NODE_DIR}/node[0-9]*/cpulist",
                f"{NODE_DIR}/node[0-9]*/meminfo", f"{CPU_DIR}/online"]
    patterns += [f"{CPU_DIR}/cpu[0-9]*/topology/{name}" for name in TOPOLOGY_FILES]
    files: dict[str, str] = {}
    for pattern in patterns:
        for path in glob.glob(os.path.join(root, pattern)):
            try:
                with open(path) as f:
                    files[os.path.relpath(path, root)] = f.read()
            except OSError:  # a CPU going offline while we read: it is not usable anyway
                continue
    return files
