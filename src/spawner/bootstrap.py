"""Nothing to install on the other hosts: the launcher brings its agent over the connection.

mpirun needs the same Open MPI on every node, torchrun its package; poprun's agent and popdist
are pure Python with no third-party import, so the launcher carries them. With
`--remote-install=auto` (the default) the agent starts on a host as follows, all in the one
remote command `agent_command()` builds (a POSIX `sh` line, whatever the login shell):

1. The Python: `--remote-python` if given, else the launcher's own interpreter path if it is
   executable there, else `python3` on the remote PATH.
2. The launcher's cache there (`~/.cache/poprun/<version>-<digest>/`, spawner/carried.py) is
   complete: the agent runs from it. No round trip, no transfer: a cached launch costs one
   `test -f` in the shell.
3. Else a small probe (`STUB`, `python -S -c`) runs: a Python older than `MIN_PYTHON` is one
   clear error; the launcher's own installation, where the host has it for that Python in
   this version, runs its agent without `site` (`OWN_HOME`); else, `site` loaded, a poprun
   installed for that Python in the launcher's version runs its agent
   (with `--remote-install=never`, in any version: its HELLO then names the difference, as
   before; without one, the error below).
4. Else the probe reads the launcher's HELLO (sent, as always, without waiting), answers
   "need" on stderr, and the launcher (`_Bringer`) sends the zip on the same channel
   (`payload()`: the installed sources of `spawner` and `popdist` and poprun's version,
   deterministic, ~50 KiB). The probe runs `spawner.carried` out of it: the digest is
   checked, the zip unpacked and compiled beside the cache and renamed into place atomically,
   and the agent runs from the cache in the same process, answering the HELLO it was handed.

So a host where poprun is installed in the launcher's version costs what it did (the probe is
the agent's own process), a fresh host one round trip, the zip and its unpacking in the
agent's own session, a cached host nothing.
`--remote-install=never` keeps the probe's error: `poprun is not installed for /usr/bin/python3
on h1 (install it, or let poprun bring its agent: --remote-install=auto)`.

The instances on a host running a carried agent get its `lib` (popdist) at the end of their
PYTHONPATH, unless that host's Python has a popdist of its own.

Old caches: `clear_caches()` here (this machine), `clear_remote_caches(conn)` over a
connection, or `python -m spawner.bootstrap --clear-caches [--all] [HOST...]`.

Every piece of Python sent as `python -c` is one line of base64 (`_one_line`), so any login
shell (sh, bash, zsh, fish, csh) passes it intact; every argument is quoted with shlex.

Errors (all AgentStartError, so each is one line per host before anything starts):

    AgentStartError (spawner.remote)
    ├── AgentNotInstalledError  --remote-install=never and no poprun for that Python there
    ├── AgentPythonError        that Python is older than MIN_PYTHON
    └── AgentInstallError       the transfer failed (disk full, no home directory...)
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.util
import io
import json
import shlex
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poprun._version import __version__

from .carried import LIB, MAIN, MIN_PYTHON, cache_root, clear_caches, content_digest
from .remote import OWN_HOME, AgentInfo, AgentStartError, RemoteError, RemoteSpawner

__all__ = ["INSTALL_MODES", "MIN_PYTHON", "AgentInstallError", "AgentNotInstalledError",
           "AgentPythonError", "Payload", "agent_command", "clear_caches",
           "clear_remote_caches", "payload", "start_agent"]

INSTALL_MODES = ("auto", "never")
MARKER = "poprun-bootstrap: "  # the probe's answer, one JSON object on a stderr line
# Answers after which the agent does not start (any other: its stderr says why it did not).
ANSWERED_ERRORS = ("too-old", "missing", "install-failed")
# Modules of `spawner` only the launcher uses: not carried.
LAUNCHER_ONLY = frozenset({"bootstrap.py", "remote.py", "ssh.py"})
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed, so the zip is the same bytes for the same sources

# The Python check, first thing in the probe and in a cache's __main__.py: old syntax only
# (it must parse on the Pythons it rejects, 2.7 included).
_CHECK = """import sys
def _tell(status, found=None, stop=True):
    import json
    sys.stderr.write(%(marker)r + json.dumps({"status": status, "python": sys.executable,
        "version": list(sys.version_info[:3]), "found": found}) + "\\n")
    sys.stderr.flush()
    if stop:
        sys.exit(3)
if tuple(sys.version_info[:2]) < %(min)r:
    _tell("too-old")
""" % {"marker": MARKER, "min": MIN_PYTHON}

# argv: mode (auto/never), the launcher's version, the cache's name and content digest, and
# `<major>.<minor>:<OWN_HOME>` (the launcher's Python and where its packages are).
# Needing the agent, it reads the launcher's first frame (HELLO, sent without waiting), says
# "need" and reads the zip (8-byte length first), then hands both to spawner.carried's
# install_and_run, run out of the zip.
STUB = _CHECK + """mode, version, name, digest, own = sys.argv[1:6]
import os
python, _, home = own.partition(":")
def _installed():
    try:
        from poprun._version import __version__
        return __version__
    except Exception:
        return None
# Run with -S: the launcher's own installation, where this host has it for this Python in
# this version, without `site`; else what `site` finds, as `python` alone would.
found = None
if python == "%d.%d" % sys.version_info[:2] and \\
        os.path.isfile(os.path.join(home, "spawner", "agent.py")):
    sys.path.insert(0, home)
    found = _installed()
    if found != version:
        del sys.path[0]
        for module in [m for m in sys.modules if m == "poprun" or m.startswith("poprun.")]:
            del sys.modules[module]
        found = None
if found is None:
    import site
    site.main()
    found = _installed()
if found == version or (mode == "never" and found is not None):
    from spawner.agent import main
    sys.exit(main())
if mode == "never":
    _tell("missing")
import io, struct, zipfile
def _read(size):
    parts = []
    while size:
        part = os.read(0, size)
        if not part:
            sys.exit(1)
        parts.append(part)
        size -= len(part)
    return b"".join(parts)
hello = _read(5)
hello += _read(struct.unpack(">IB", hello)[0])
_tell("need", found, stop=False)
data = _read(struct.unpack(">Q", _read(8))[0])
carried = {"__name__": "poprun_carried"}
exec(zipfile.ZipFile(io.BytesIO(data)).read("spawner/carried.py"), carried)
sys.exit(carried["install_and_run"](name, digest, data, hello))
"""

MAIN_PY = ("# The poprun agent, brought by the launcher (spawner/bootstrap.py): "
           "python3 <this dir>\n" + _CHECK + """import os
home = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.join(home, %r))  # popdist, which the agent imports too
from spawner.carried import main
sys.exit(main(home, sys.argv[1:]))
""" % LIB)

POPRUN_INIT = ('"""poprun\'s version, for the carried agent (spawner/bootstrap.py)."""\n\n'
               "from ._version import __version__  # noqa: F401\n")

# The probe runs the agent from the launcher's own installation (remote.OWN_HOME) where the
# host has the same (a shared or identical installation), `site` left out (`-S`: its .pth
# files cost ~50 ms per agent on the machine of bench/README.md, "Remote launches";
# spawner.agent loads site's directories on demand).

# $1 python, $2 "1" when given by --remote-python, $3 cache name ("" : never use a cache);
# the rest is the probe's argv (-c STUB mode version name digest).
SHELL = ('p=$1 c=; [ -n "$2" ] || [ -x "$p" ] || p=python3; '
         '[ -z "$3" ] || c=${XDG_CACHE_HOME:-$HOME/.cache}/poprun/$3; '
         'if [ -n "$c" ] && [ -f "$c/__main__.py" ]; then exec "$p" -S "$c"; fi; '
         'shift 3; exec "$p" -S "$@"')


class AgentNotInstalledError(AgentStartError):
    """--remote-install=never and that host's Python has no poprun."""

    def __init__(self, host: str, python: str) -> None:
        super().__init__(host, f"poprun is not installed for {python} there")
        self.python = python
        self.args = (f"poprun is not installed for {python} on {host} (install it, or let "
                     f"poprun bring its agent: --remote-install=auto)",)


class AgentPythonError(AgentStartError):
    """The chosen Python there is older than the agent supports."""

    def __init__(self, host: str, python: str, version: tuple[int, ...]) -> None:
        self.python, self.version = python, tuple(version)
        super().__init__(host, f"{python} is Python {_dotted(version)}; the poprun agent needs "
                               f"Python {_dotted(MIN_PYTHON)} or later (choose another with "
                               f"--remote-python)")


class AgentInstallError(AgentStartError):
    """The agent could not be brought to that host."""


def _dotted(version) -> str:
    return ".".join(map(str, version))


def _one_line(source: str) -> str:
    """A `python -c` program that any login shell passes intact inside single quotes: no
    newline, quote, backslash (fish reads `\\'` there) or `!` (csh's history); compressed,
    base64 ([A-Za-z0-9+/=]). It runs on any Python, 2.7 included."""
    encoded = base64.b64encode(zlib.compress(source.encode(), 9)).decode()
    return (f'exec(__import__("zlib").decompress(__import__("base64").b64decode("{encoded}")))')


# --- what is carried -------------------------------------------------------------------------

@dataclass(frozen=True)
class Payload:
    """The carried files: `entries` {zip name: bytes}, their `digest`, the cache `name`."""

    entries: dict[str, bytes]
    digest: str

    @property
    def name(self) -> str:
        return f"{__version__}-{self.digest[:16]}"

    @functools.cached_property
    def zip(self) -> bytes:
        """Deterministic: sorted names, fixed times and modes."""
        import zipfile

        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            for name in sorted(self.entries):
                info = zipfile.ZipInfo(name, ZIP_DATE)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                archive.writestr(info, self.entries[name])
        return buffer.getvalue()


def _package_dir(name: str) -> Path:
    """Where a package's sources are, without importing it (popdist's import installs an
    exception hook)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise AgentInstallError("localhost", f"cannot carry the agent: no package {name} here")
    return Path(next(iter(spec.submodule_search_locations)))


def _sources(package: Path, prefix: str, skip: frozenset[str] = frozenset()) -> dict[str, bytes]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if "__pycache__" in relative.parts or str(relative) in skip:
            continue
        found[f"{prefix}{relative.as_posix()}"] = path.read_bytes()
    if f"{prefix}__init__.py" not in found:
        raise AgentInstallError("localhost", f"cannot carry the agent: no sources in {package}")
    return found


@functools.cache
def payload() -> Payload:
    """The agent and popdist as this launcher has them installed (read once per process)."""
    spawner_dir = _package_dir("spawner")
    entries = {
        **_sources(spawner_dir, "spawner/", LAUNCHER_ONLY),
        **_sources(_package_dir("popdist"), f"{LIB}/popdist/"),
        "poprun/__init__.py": POPRUN_INIT.encode(),
        "poprun/_version.py": (_package_dir("poprun") / "_version.py").read_bytes(),
        MAIN: MAIN_PY.encode(),
    }
    return Payload(entries, content_digest(entries))


# --- the remote command ----------------------------------------------------------------------

def agent_command(python: str | None, install: str, own: str = sys.executable) -> str:
    """The remote command that starts the agent (the module docstring's steps 1-3).
    `python`: --remote-python, or None for `own` (the launcher's path) if it is there, else
    python3."""
    if install not in INSTALL_MODES:
        raise ValueError(f"install must be one of {INSTALL_MODES}, got {install!r}")
    cache, digest = (payload().name, payload().digest) if install == "auto" else ("", "")
    return "exec " + shlex.join(["/bin/sh", "-c", SHELL, "poprun-agent", python or own,
                                 "1" if python else "", cache, "-c", _one_line(STUB), install,
                                 __version__, cache, digest,
                                 # --remote-python: poprun installed for it, or brought
                                 "" if python else "%d.%d:%s" % (*sys.version_info[:2], OWN_HOME)])


def _answer(stderr: str) -> dict[str, Any] | None:
    """The probe's answer in the agent's stderr, if it gave one."""
    for line in reversed(stderr.splitlines()):
        if line.startswith(MARKER):
            try:
                answer = json.loads(line[len(MARKER):])
            except ValueError:
                return None
            return answer if isinstance(answer, dict) else None
    return None


async def start_agent(spawner: RemoteSpawner, install: str | None, *,
                      python: str | None = None, log: Callable[[str], None] | None = None,
                      **hello: Any) -> AgentInfo:
    """`spawner.start(**hello)` with the agent brought over when the host lacks it
    (`install` "auto"), or the probe's errors (`install` "never"). `install` None: the
    spawner's own command, unchanged (Slurm job steps). `python`: --remote-python."""
    if install is None:
        return await spawner.start(**hello)
    spawner.command = agent_command(python, install)
    spawner.command_label = (python or f"{sys.executable}, else python3") + " -m spawner.agent"
    brought = _Bringer(spawner) if install == "auto" else None
    spawner.on_stderr = brought
    try:
        info = await spawner.start(**hello)
    except AgentStartError:
        answer = _answer(spawner.stderr_tail)
        if answer is None or answer.get("status") not in ANSWERED_ERRORS:
            raise
        raise _start_error(spawner.host, answer) from None
    finally:
        spawner.on_stderr = None
    if brought is not None and brought.answer is not None and log is not None:
        found = brought.answer.get("found")
        log(f"{spawner.host}: {f'poprun {found}' if found else 'no poprun'} there for "
            f"{brought.answer.get('python')}: brought the poprun agent "
            f"({len(payload().zip) // 1024} KiB, cache {payload().name}): asked for "
            f"{(brought.asked - brought.started) * 1000:.0f} ms after the start, ready "
            f"{(time.monotonic() - brought.asked) * 1000:.0f} ms later")
    return info


class _Bringer:
    """Watches the agent's stderr for the probe's "need": sends the zip on its stdin then."""

    def __init__(self, spawner: RemoteSpawner) -> None:
        self.spawner, self.started = spawner, time.monotonic()
        self.answer: dict[str, Any] | None = None
        self.asked = 0.0
        self._seen = bytearray()

    def __call__(self, data: bytes) -> None:
        if self.answer is not None:
            return
        self._seen += data
        end = self._seen.rfind(b"\n") + 1
        if not end:
            return
        answer = _answer(self._seen[:end].decode(errors="replace"))  # whole lines only
        del self._seen[:end]
        if answer is None or answer.get("status") != "need":
            return
        self.answer, self.asked = answer, time.monotonic()
        carried = payload().zip
        try:
            self.spawner.write(len(carried).to_bytes(8, "big") + carried)
        except RemoteError:
            pass  # the agent is gone: its start fails and says why


def _start_error(host: str, answer: dict[str, Any]) -> AgentStartError:
    """The error for the probe's last answer (one of ANSWERED_ERRORS)."""
    there, status = str(answer.get("python")), answer.get("status")
    if status == "too-old":
        return AgentPythonError(host, there, tuple(answer.get("version") or ()))
    if status == "missing":
        return AgentNotInstalledError(host, there)
    return AgentInstallError(host, f"cannot bring the poprun agent there: {answer.get('error')}")


@functools.cache
def _carried_cli() -> str:
    """spawner/carried.py as one `python -c` line calling its cli() with the argv."""
    source = (Path(__file__).with_name("carried.py")).read_text()
    return _one_line(source + "\nsys.exit(cli(sys.argv[1:]))\n")


# --- old caches ------------------------------------------------------------------------------

async def clear_remote_caches(conn: Any, python: str = "python3", *,
                              keep_current: bool = True) -> dict[str, list[str]]:
    """`clear_caches` on the host at the other end of `conn` (an asyncssh connection), with
    `python` there; keeps this launcher's cache unless `keep_current` is false."""
    keep = [payload().name] if keep_current else []
    command = "exec " + shlex.join([python, "-c", _carried_cli(), "clear", *keep])
    result = await conn.run(command, encoding=None, check=False)
    if result.exit_status != 0:
        err = (result.stderr or b"").decode(errors="replace").strip().splitlines()
        raise RuntimeError(err[-1] if err else f"exit status {result.exit_status}")
    return json.loads(result.stdout.decode())


def _main(argv: list[str]) -> int:
    """python -m spawner.bootstrap --clear-caches [--all] [--remote-python P] [HOST...]"""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m spawner.bootstrap",
        description="Remove the poprun agents cached on this machine, or on HOSTs over SSH "
                    "(~/.cache/poprun): every version but this poprun's, and none in use.")
    parser.add_argument("--clear-caches", action="store_true", required=True)
    parser.add_argument("--all", action="store_true", help="this poprun's version too")
    parser.add_argument("--remote-python", default="python3", help="Python on the HOSTs")
    parser.add_argument("hosts", nargs="*", metavar="HOST", help="[user@]host as in ssh")
    options = parser.parse_args(argv)
    if not options.hosts:
        keep = () if options.all else (payload().name,)
        _print_cleared("localhost", clear_caches(keep, cache_root()))
        return 0
    return asyncio.run(_clear_hosts(options.hosts, options.remote_python, not options.all))


async def _clear_hosts(hosts: list[str], python: str, keep_current: bool) -> int:
    from .ssh import Target, close_all, connect_each

    targets = [Target(h.split("@", 1)[1], h.split("@", 1)[0]) if "@" in h else Target(h)
               for h in hosts]
    results = await connect_each(targets)
    status = 0
    for failure in results.failures:
        print(failure.message, file=sys.stderr)
        status = 1
    try:
        for target, conn in results.connections.items():
            try:
                _print_cleared(str(target), await clear_remote_caches(
                    conn, python, keep_current=keep_current))
            except (OSError, RuntimeError, ValueError) as exc:
                print(f"{target}: {exc}", file=sys.stderr)
                status = 1
    finally:
        await close_all(results.connections.values())
    return status


def _print_cleared(host: str, done: dict[str, list[str]]) -> None:
    for name in done["removed"]:
        print(f"{host}: removed {name}")
    for name in done["in_use"]:
        print(f"{host}: kept {name} (in use)")
    if not done["removed"] and not done["in_use"]:
        print(f"{host}: nothing to remove")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
