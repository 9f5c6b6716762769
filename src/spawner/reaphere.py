"""What `poprunctl reap` does on one host for a job whose launcher died without cleaning up:
kill the job's leftover instances, remove its leftover temporary directories.

It runs here for this host's part of the job, and on every other recorded host over SSH, on
that host's Python (3.10 or later), sent with the sources of procid.py and containment.py as
one `python -c` line (poprun/run/reap.py): standard library only. Its input is one JSON object:

    {"boot_id": the host's boot id when the job ran (None: unknown),
     "instances": [[index, pid, start ticks], ...], "dirs": [path, ...],
     "marks": [the lifeline tokens its instances carry (containment.MARK), ...],
     "cgroups": [the cgroup trees of those lifelines, ...],
     "kvsnames": [the MPI worlds poprun served there, ...], "dry_run": bool}

and it prints one JSON list of what it did (or would do), one entry each:
{"what": "instance" | "marked" | "dir" | "shm", "index", "pid", "pids", "path",
 "done": bool, "note": str}.

A pid is acted on only when it is still the process that was recorded (same start time): a
pid the system has given to an unrelated process since is left alone, and a host that has
rebooted since (another boot id) has nothing of the job left to kill. A directory is removed
only when it is one of poprun's temporary ones (`poprun-cache-*`, `poprun-errors-*`, a PMIx
world's, found by its kvsname: `pmix_leftovers`), a real
directory (not a link) owned by this user; a cgroup tree only when it is named as poprun names
them (`poprun-<token>`) and is a cgroup, its processes killed first (`cgroup.kill`).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat

from .containment import CGROUP_PREFIX, MARK, helpers_mark, kill_marked, marked, remove_tree
from .procid import boot_id, start_ticks

PREFIXES = ("poprun-cache-", "poprun-errors-")


def reap_here(job: dict) -> list[dict]:
    dry = bool(job.get("dry_run"))
    recorded_boot = job.get("boot_id")
    rebooted = bool(recorded_boot) and boot_id() not in (None, recorded_boot)
    done = []
    for index, pid, start in job.get("instances") or ():
        entry = {"what": "instance", "index": index, "pid": pid}
        done.append(entry)
        if rebooted:
            entry.update(done=False, note="gone (the host has rebooted since)")
            continue
        now = start_ticks(pid)
        if now is not None and (start is None or now != start):
            entry.update(done=False, note="its pid is another process's now: not touched")
            continue
        if now is None and not _group_exists(pid):
            entry.update(done=False, note="gone")
            continue
        what = "its process group" if now is not None else "what is left of its process group"
        if dry:
            entry.update(done=False, note=f"would kill {what}")
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            entry.update(done=False, note="gone")
            continue
        except PermissionError:
            entry.update(done=False, note="not allowed to kill it")
            continue
        entry.update(done=True, note=f"killed {what}")
    if not rebooted:  # a reboot took the marked processes and the cgroups with it
        for token in job.get("marks") or ():
            found = marked(token, helpers_mark(token), exclude=os.getpid()) \
                if isinstance(token, str) and token else []
            if found:
                done.append(_kill_marked(token, found, dry))
        for path in job.get("cgroups") or ():
            if os.path.isdir(path):  # named where cgroups might be made: maybe never made
                done.append({"what": "dir", "path": path, **_remove_cgroup(path, dry)})
    for path in job.get("dirs") or ():
        entry = {"what": "dir", "path": path}
        done.append(entry)
        entry.update(_remove(path, dry))
    for kvsname in job.get("kvsnames") or ():
        done += remove_mpich_shm(kvsname, dry)
        for path in pmix_leftovers(kvsname):
            done.append({"what": "dir", "path": path, **_remove(path, dry, own=True)})
    return done


def pmix_prefixes(kvsname: str) -> tuple[str, str]:
    """Where a PMIx world of poprun's keeps its files (worlds/pmixhost.py), as path prefixes:
    the job's server directory in the temp dir (`poprun-<job>-pmix-*`, the kvsname being
    `poprun-<job>-<attempt>`) and the world's segment directory (`/dev/shm/<kvsname>-pmix-*`)."""
    import tempfile

    job = kvsname.rsplit("-", 1)[0]
    return (os.path.join(tempfile.gettempdir(), f"{job}-pmix-"),
            os.path.join("/dev/shm", f"{kvsname}-pmix-"))


def pmix_leftovers(kvsname: str) -> list[str]:
    """What the PMIx world `kvsname` left here (its job's server directory included)."""
    import glob

    return [path for prefix in pmix_prefixes(kvsname) for path in glob.glob(prefix + "*")]


def mpich_world_ids(kvsname: str, max_init_count: int = 4) -> list[int]:
    """The ids MPICH names a job's shared memory by: the 32-bit FNV-1a hash of its kvsname
    (MPICH 5.0, the PyPI wheel: src/util/mpir_pmi.c), or of `<kvsname>-<n>` for its n-th
    MPI initialisation (MPICH's development branch since 338496d7c7)."""
    def fnv1a(text: str) -> int:
        value = 2166136261
        for byte in text.encode():
            value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
        return value

    return [fnv1a(kvsname)] + [fnv1a(f"{kvsname}-{n}") for n in range(1, max_init_count + 1)]


def mpich_shm_leftovers(kvsname: str, shm_dir: str = "/dev/shm") -> list[str]:
    """MPICH's shared-memory segments of the job `kvsname` on this host:
    `mpich_shm_<id hex>_<node>` (one per node, made at MPI_Init) and `mpich_vci_<id>_<node>`
    (src/mpid/ch4/shm/posix/posix_init.c). The last rank to finalize removes them; an
    aborted or killed job leaves them, and a kvsname used again would find them. One
    listing of `shm_dir`, not a glob per id and kind: every world's close runs this on
    the launcher's loop, and a /dev/shm of 1,000 entries made those ten globs ~65 ms."""
    wanted = {f"mpich_{kind}_{world:x}" for world in mpich_world_ids(kvsname)
              for kind in ("shm", "vci")}
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    found = []
    for name in names:
        prefix, _, node = name.rpartition("_")
        if prefix in wanted and node.isdigit():
            found.append(os.path.join(shm_dir, name))
    return found


def remove_mpich_shm(kvsname: str, dry: bool = False) -> list[dict]:
    """Remove MPICH's leftovers of `kvsname` here (reap's entries)."""
    done = []
    for path in mpich_shm_leftovers(kvsname):
        entry = {"what": "shm", "path": path, "done": False}
        done.append(entry)
        if dry:
            entry["note"] = "would remove it"
            continue
        try:
            os.unlink(path)
            entry.update(done=True, note="removed")
        except FileNotFoundError:
            entry["note"] = "already gone"
        except OSError as exc:
            entry["note"] = f"cannot remove it: {exc.strerror}"
    return done


def _kill_marked(token: str, found: list[int], dry: bool) -> dict:
    """The processes still carrying the job's mark (`found`: a helper that left its
    instance's group, an instance nobody recorded): killed."""
    if not dry:
        kill_marked(token, helpers_mark(token))
    return {"what": "marked", "pids": found, "done": not dry,
            "note": f"{'would kill' if dry else 'killed'} {len(found)} process(es) still "
                    f"carrying the job's mark ({MARK})"}


def _remove_cgroup(path: str, dry: bool) -> dict:
    """A cgroup tree of the job's (`poprun-<token>`): what is in it killed, then removed."""
    if not os.path.basename(path.rstrip("/")).startswith(CGROUP_PREFIX):
        return {"done": False, "note": "not a poprun cgroup: kept"}
    if not os.path.exists(os.path.join(path, "cgroup.procs")):
        return {"done": False, "note": "not a cgroup: kept"}
    if dry:
        return {"done": False, "note": "would remove it"}
    try:
        with open(os.path.join(path, "cgroup.kill"), "wb", buffering=0) as f:
            f.write(b"1")
    except OSError:
        pass  # emptied meanwhile: nothing left to kill
    remove_tree(path)
    if os.path.exists(path):
        return {"done": False, "note": "could not remove all of it"}
    return {"done": True, "note": "removed"}


def _group_exists(pgid: int) -> bool:
    """A process group whose leader has exited, but not all its members: its id cannot have
    been reused meanwhile (the kernel keeps it while the group exists)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _remove(path: str, dry: bool, own: bool = False) -> dict:
    """`own`: a path reap named itself (pmix_leftovers), not one from the record."""
    if not own and not os.path.basename(path.rstrip("/")).startswith(PREFIXES):
        return {"done": False, "note": "not a poprun temporary directory: kept"}
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return {"done": False, "note": "already gone"}
    except OSError as exc:
        return {"done": False, "note": f"cannot look at it: {exc.strerror}"}
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return {"done": False, "note": "not a directory of this user's: kept"}
    if dry:
        return {"done": False, "note": "would remove it"}
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        return {"done": False, "note": "could not remove all of it"}
    return {"done": True, "note": "removed"}


def main(argv: list[str]) -> int:
    """`python -c <this> <base64 JSON>`: the input, then the report on stdout."""
    import base64
    import json
    import sys

    sys.stdout.write(json.dumps(reap_here(json.loads(base64.b64decode(argv[0])))) + "\n")
    return 0
