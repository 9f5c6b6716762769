"""The remote side of `spawner.bootstrap`: what runs on a host where poprun is not installed.

The launcher carries the agent (`spawner`, `popdist` and poprun's version) to such a host over
its SSH connection; it is cached there, one directory per version and content:

    ~/.cache/poprun/<version>-<digest>/     ($XDG_CACHE_HOME/poprun when that is set)  0700
        __main__.py                         `python3 <this dir>` runs the agent
        spawner/...                         this package (launcher-only modules left out)
        poprun/__init__.py, _version.py     poprun's version only (the agent's HELLO)
        lib/popdist/...                     popdist, for the instances (their PYTHONPATH)

This module runs there in three ways, all with the host's Python (3.10 or later: `MIN_PYTHON`,
checked before it is loaded), so it imports nothing but the standard library at the top and
depends on nothing else of the package:

- `install_and_run`: the launcher's probe (spawner.bootstrap.STUB) received the zip and runs
  this module out of it: `install` checks the zip's digest, unpacks it into a private temporary
  directory beside the cache and renames that into place, then the agent runs from the cache
  in the same process. The rename is atomic: two launches bringing the same agent at once both
  succeed, one directory wins and no one ever sees a partial one.
- `run_agent`: imported by the cache's `__main__.py`: the agent runs from the cache, its
  instances get `lib` at the end of their PYTHONPATH (unless the host's Python has a popdist of
  its own), and a shared lock on `__main__.py` marks the cache as in use while it runs.
- `clear_caches`: removes the caches of other versions that no agent is using; sent as
  `python -c` (`cli`), or by hand on a host: `python3 ~/.cache/poprun/<any cache>/
  --clear-caches`; from the launcher's machine: `python -m spawner.bootstrap --clear-caches
  HOST...` (docs/several-hosts.md, "Nothing to install on the other hosts").

The digest is over the zip's content (names and bytes, `content_digest`), not its compressed
bytes, so it does not depend on the launcher's zlib.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

MIN_PYTHON = (3, 10)  # the agent's oldest Python (tests/test_bootstrap.py runs it there)
LIB = "lib"  # the directory, in a cache, put on the instances' PYTHONPATH
MAIN = "__main__.py"
# A cache directory's name: <version>-<16 hex digits of the content digest>.
CACHE_NAME = re.compile(r"^[0-9A-Za-z.+!_-]+-[0-9a-f]{16}$")
STALE_TEMP = 3600.0  # seconds after which a transfer's leftover temporary dir is removed
_held_locks: list[int] = []  # the running agent's shared lock on its cache (run_agent)


def cache_root() -> str:
    """~/.cache/poprun, or $XDG_CACHE_HOME/poprun (as the agent command's shell finds it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "poprun")


def content_digest(entries: dict[str, bytes]) -> str:
    """sha256 over the sorted names and contents (hex)."""
    import hashlib  # here: an agent run from its cache never needs it (~2 ms, libcrypto)

    digest = hashlib.sha256()
    for name in sorted(entries):
        data = entries[name]
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def _safe_name(name: str) -> bool:
    parts = name.split("/")
    return (not name.startswith("/") and "\\" not in name
            and all(part not in ("", ".", "..") for part in parts))


def install(name: str, digest: str, data: bytes, root: str | None = None) -> str:
    """Unpack the zip `data` into `root`/`name` (atomically; see the module docstring) and
    return the cache's path. Raises ValueError when the content does not match `digest`."""
    import compileall
    import io
    import tempfile
    import zipfile
    import zlib

    if not CACHE_NAME.match(name):
        raise ValueError(f"not a cache name: {name!r}")
    root = root or cache_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    final = os.path.join(root, name)
    if os.path.isfile(os.path.join(final, MAIN)):
        return final  # another launch brought it meanwhile
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = {info.filename: archive.read(info) for info in archive.infolist()
                       if not info.is_dir()}
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ValueError(f"a damaged archive ({exc})") from None
    bad = [n for n in entries if not _safe_name(n)]
    if bad:
        raise ValueError(f"unsafe name in the archive: {bad[0]!r}")
    if content_digest(entries) != digest or not name.endswith(digest[:16]):
        raise ValueError("the archive does not match its digest (damaged on the way?)")
    temp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root)  # mode 0700
    try:
        for entry, content in entries.items():
            path = os.path.join(temp, *entry.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content)
        # Bytecode now, for this Python: agents then never write in a cache they run from.
        compileall.compile_dir(temp, quiet=2, ddir=final)
        try:
            os.rename(temp, final)
        except OSError:  # a concurrent launch renamed its copy first: the same content
            if not os.path.isfile(os.path.join(final, MAIN)):
                raise
    finally:
        if os.path.isdir(temp):
            shutil.rmtree(temp, ignore_errors=True)
    return final


def clear_caches(keep: tuple[str, ...] = (), root: str | None = None) -> dict[str, list[str]]:
    """Remove every cache under `root` but those named in `keep` and those an agent is
    running from (they hold a shared lock on their __main__.py); also temporary dirs left by
    transfers that were killed (older than STALE_TEMP). Returns {"removed": [...],
    "in_use": [...]} (names)."""
    import fcntl

    root = root or cache_root()
    removed: list[str] = []
    in_use: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return {"removed": removed, "in_use": in_use}
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".") and name.endswith((".tmp", ".trash")):
            try:
                if time.time() - os.lstat(path).st_mtime > STALE_TEMP:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass
            continue
        if name in keep or not CACHE_NAME.match(name) or os.path.islink(path):
            continue
        try:
            fd = os.open(os.path.join(path, MAIN), os.O_RDONLY)
        except OSError:
            continue  # not one of ours
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                in_use.append(name)
                continue
            # Out of the launchers' sight first (a new launch then brings a fresh copy), then
            # removed at leisure.
            trash = os.path.join(root, f".{name}.{os.getpid()}.trash")
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(name)
        finally:
            os.close(fd)
    return {"removed": removed, "in_use": in_use}


def run_agent(home: str, initial: bytes = b"") -> int:
    """Run the agent from the cache `home` (called by its __main__.py, or install_and_run
    with what the probe read of the launcher's stream)."""
    import fcntl
    from importlib.machinery import PathFinder

    lib = os.path.join(home, LIB)  # on sys.path already (__main__.py)
    own_path = [p for p in sys.path if p not in (home, lib)]
    fd = os.open(os.path.join(home, MAIN), os.O_RDONLY)  # not inherited by instances
    fcntl.flock(fd, fcntl.LOCK_SH)  # in use: clear_caches leaves it
    _held_locks.append(fd)
    from spawner import agent

    if PathFinder.find_spec("popdist", own_path) is None:  # the host has none of its own
        agent.CARRIED_PYTHONPATH = lib
    return agent.main(initial)


def main(home: str, args: list[str]) -> int:
    """The cache's __main__.py: run the agent, or `--clear-caches [--all]`."""
    if args[:1] == ["--clear-caches"]:
        keep = () if "--all" in args else (os.path.basename(home),)
        done = clear_caches(keep, os.path.dirname(home))
        for name in done["removed"]:
            print(f"removed {name}")
        for name in done["in_use"]:
            print(f"kept {name} (in use)")
        return 0
    if args:
        sys.stderr.write(f"usage: python3 {home} [--clear-caches [--all]]\n")
        return 2
    return run_agent(home)


def _tell(**answer: object) -> None:
    """One line for the launcher on stderr (spawner.bootstrap reads the last such line)."""
    import json

    sys.stderr.write("poprun-bootstrap: " + json.dumps(answer) + "\n")
    sys.stderr.flush()


def install_and_run(name: str, digest: str, data: bytes, initial: bytes) -> int:
    """The probe got the zip `data` (spawner.bootstrap): install it, then be the agent from
    the cache, in this process; `initial` is what the probe read of the launcher's stream."""
    try:
        path = install(name, digest, data)
    except (OSError, ValueError) as exc:
        _tell(status="install-failed", error=str(exc))
        return 1
    # As `python3 <path>` would run it: the cache and its lib first, no current directory.
    sys.path[:] = [path, os.path.join(path, LIB), *(p for p in sys.path if p)]
    # The probe imported that Python's own poprun (another version) to compare it: forget
    # it, or the agent's HELLO would report that version and be refused.
    for module in [m for m in sys.modules if m.partition(".")[0] in ("poprun", "spawner",
                                                                     "popdist")]:
        del sys.modules[module]
    from spawner.carried import run_agent as run  # the cache's copy of this module

    return run(path, initial)


def cli(args: list[str]) -> int:
    """`clear [KEEP...]`, as spawner.bootstrap sends it (`python -c`): clear_caches(KEEP),
    its result printed as one JSON line."""
    if args[:1] == ["clear"]:
        import json

        print(json.dumps(clear_caches(tuple(args[1:]))))
        return 0
    sys.stderr.write(f"poprun-bootstrap: unknown request {args!r}\n")
    return 2
