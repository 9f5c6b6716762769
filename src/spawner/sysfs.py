"""Reading the sysfs files a NUMA topology is parsed from (poprun.plan.topology parses them).
Here, in the spawner layer, so that a host's agent can send its files to the launcher."""

from __future__ import annotations

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
    names = [f"{NODE_DIR}/online", f"{CPU_DIR}/online"]
    # Each directory listed once, not globbed once per file name (~1.5 ms of a launch).
    for directory, prefix, leaves in (
            (NODE_DIR, "node", ("cpulist", "meminfo")),
            (CPU_DIR, "cpu", tuple(f"topology/{name}" for name in TOPOLOGY_FILES))):
        try:
            entries = os.listdir(os.path.join(root, directory))
        except OSError:  # no NUMA (no node directory)
            continue
        names += [f"{directory}/{entry}/{leaf}" for entry in entries
                  if entry.startswith(prefix) and entry[len(prefix):].isdigit()
                  for leaf in leaves]
    files: dict[str, str] = {}
    for name in names:
        try:
            with open(os.path.join(root, name)) as f:
                files[name] = f.read()
        except OSError:  # absent; or a CPU going offline while we read: not usable anyway
            continue
    return files
