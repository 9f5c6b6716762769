"""What a job depends on, on one host: read by its agent when its HELLO asks (`facts`), as
soon as its reply is out, and collected by FACTS (and read by the launcher for its own host), so that poprun can compare the hosts before anything starts
(poprun/plan/alike.py compares; docs/architecture.md, "Hosts that differ").

Cheap by design, since it rides on every multi-host launch: files are read, nothing is run or
imported of the user's, no tree is hashed. Every file is read as an untrusted one
(spawner/untrusted.py): without blocking, regular files only, bounded. A FIFO where the
script should be would block the agent's one thread for good (and with it the launch); it is
a fact instead (`entry.kind`), compared like any other (docs/architecture.md, "Hosts that
differ").

- The instances' Python: the program itself when it is an interpreter (`python3 train.py`),
  the one a script's `#!` line names, else `python3` on the instances' PATH for a shell
  script (which likely runs it); an ELF program other than Python has none. Its version
  and site directories come from its layout (pyvenv.cfg, `<prefix>/lib/pythonX.Y`), not
  from running it.
- Its installed distributions: name and version from each `*.dist-info/METADATA` or
  `*.egg-info` on its path (PYTHONPATH, user site, site-packages), the first of a name
  winning as on import; only the head of each file is read.
- The file the job runs: the script (or the `-m` module's file) an interpreter is given,
  else the program; its SHA-256 (files up to MAX_DIGEST_BYTES), size and mtime.
- The working directory, the Poplar SDK enabled in the instances' environment (its
  `*_SDK_ENABLED` variables, and the version its path names), free space where the
  executable cache and temporary files go, and this host's clock.

Standard library only, and Python 3.10 (the agent runs on the host's Python).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .local import resolve_program
from .untrusted import NotRegular, open_regular, read_regular

MAX_DIGEST_BYTES = 64 << 20  # a bigger file is compared by size (and shown by mtime) only
MAX_ARGS = 64  # of the job's argv: the script or module is among the first words
MAX_DISTRIBUTIONS = 10_000  # per host: beyond any real environment, bounds the reply
METADATA_HEAD = 4096  # bytes of METADATA read: Name and Version are among its first lines
PATCHLEVEL_HEAD = 64 << 10  # bytes of patchlevel.h read (CPython's is ~1 KB)
_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?$")
# Graphcore's SDK directories name their version: poplar_sdk-ubuntu_20_04-3.3.0+1403-208993bbb7
_SDK_VERSION = re.compile(r"(?<![\d.])(\d+\.\d+\.\d+(?:-EA\.\d+)?(?:\+\d+)?)")
_FULL_VERSION = re.compile(r"(?<![\d.])(\d+\.\d+\.\d+)(?![\d.])")
# Interpreter options that take a value (`-W ignore`), so the script is the word after it.
_VALUED_FLAGS = frozenset("cmWX")
_VALUED_LONG = frozenset({"--check-hash-based-pycs"})


class Reading:
    """The facts HELLO's `facts` asked for, read by the agent on its loop's next turn (once
    HELLO's reply, queued before, is out: the launcher goes on starting meanwhile), for FACTS
    to collect (`then`): the reading starts one round trip before FACTS comes."""

    def __init__(self, loop: Any, ask: object,
                 environ_of: Callable[[Mapping[str, str], tuple], dict[str, str]]) -> None:
        self.facts: dict[str, Any] | None = None
        self._then: list[Callable[[dict[str, Any]], None]] = []
        loop.call_soon(self._read, ask if isinstance(ask, dict) else {}, environ_of)

    def _read(self, ask: dict, environ_of: Callable) -> None:
        self.facts = answer(ask, environ_of)
        for callback in self._then:
            self._hand(callback)
        self._then.clear()

    def then(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """`callback(facts)` once they are read (at once if they are)."""
        if self.facts is None:
            self._then.append(callback)
        else:
            self._hand(callback)

    def _hand(self, callback: Callable[[dict[str, Any]], None]) -> None:
        # The clock read as they are handed over (sent), not as they were read: the
        # launcher takes the time they arrive for the same moment (the clock's offset).
        callback({**self.facts, "time": time.time()})


def answer(request: Mapping[str, Any],
           environ_of: Callable[[Mapping[str, str], tuple], dict[str, str]]) -> dict[str, Any]:
    """The facts HELLO's `facts` {argv, env, cache, cwd} asks for: the job's argv, the
    variables poprun sets on instances here, an explicit cache path, the working directory.
    `environ_of(env_set, env_unset)`: the environment instances get here."""
    argv = [str(a) for a in request.get("argv") or ()][:MAX_ARGS]
    env = request.get("env") if isinstance(request.get("env"), dict) else {}
    cache, cwd = request.get("cache"), request.get("cwd")
    return gather(argv, environ_of({str(k): str(v) for k, v in env.items()}, ()),
                  str(cwd) if cwd else os.getcwd(), str(cache) if cache else None)


def gather(argv: Sequence[str], env: Mapping[str, str], cwd: str,
           cache: str | None = None) -> dict[str, Any]:
    """The facts of this host for a job running `argv` in `cwd` with the instances'
    environment `env` (the host's, with what poprun sets there); `cache`: an explicit
    executable cache path (else the temporary one, in the temp dir)."""
    path = env.get("PATH", os.defpath)
    program = _which(argv[0], path, cwd) if argv else None
    python, script, module = _interpreter(program, argv, path, cwd)
    layout = _layout(python, env, cwd) if python else None
    entry = script  # an interpreter's script; `-c` and stdin have none
    if module and layout:
        entry = _module_file(module, [cwd, *layout["paths"], layout["stdlib"]])
    elif python != program:  # the program is the file it runs (a binary, a script)
        entry = program
    return {
        "program": program,
        "python": None if layout is None else
        {"path": python, "version": layout["version"], "prefix": layout["prefix"]},
        "distributions": None if layout is None else _distributions(layout["paths"]),
        "entry": None if entry is None and script is None and module is None else
        _file_facts(entry, module or _shown(entry or script, argv)),
        "cwd": cwd, "cwd_exists": os.path.isdir(cwd),
        "sdk": _sdk(env),
        "space": _space(cache, env),
        "time": time.time(),
    }


def _which(name: str, path: str, cwd: str) -> str | None:
    """The absolute path `name` runs as (where spawner.local.resolve_program finds it)."""
    found = resolve_program(name, path, cwd)
    if found is not None and os.sep not in found:  # found on PATH: where
        found = shutil.which(found, path=path)
    return None if found is None else os.path.normpath(os.path.join(cwd, found))


def _interpreter(program: str | None, argv: Sequence[str], path: str, cwd: str
                 ) -> tuple[str | None, str | None, str | None]:
    """(the instances' Python, the script it runs, the module it runs with -m)."""
    if program is None:
        return _which("python3", path, cwd), None, None  # no program (--check): PATH's
    if _PYTHON_NAME.match(os.path.basename(program)):
        script, module = _python_target(argv[1:], cwd)
        return program, script, module
    words = _shebang(program)
    if not words:
        return None, None, None  # a binary: no Python of its own
    interpreter = words[0]
    if os.path.basename(interpreter) == "env":  # #!/usr/bin/env [-S] python3 -u
        named = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        interpreter = _which(named[0], path, cwd) if named else None
    if interpreter and _PYTHON_NAME.match(os.path.basename(interpreter)):
        return interpreter, program, None
    return _which("python3", path, cwd), None, None  # a shell script: likely runs python3


def _python_target(args: Sequence[str], cwd: str) -> tuple[str | None, str | None]:
    """(script, module) of a Python command line's arguments: a script, `-m pkg.mod`, or
    neither (`-c`, stdin)."""
    words, i = list(args), 0
    while i < len(words):
        word = words[i]
        i += 1
        if word in _VALUED_LONG:
            i += 1
        elif word == "-":
            return None, None
        elif not word.startswith("-"):
            return os.path.normpath(os.path.join(cwd, word)), None
        elif not word.startswith("--"):
            for j, flag in enumerate(word[1:], 1):
                if flag not in _VALUED_FLAGS:
                    continue  # -u, -O, -I...: flags without a value
                value = word[j + 1:]
                if not value and i < len(words):
                    value, i = words[i], i + 1
                if flag in "cm":
                    return None, value if flag == "m" else None
                break  # -W/-X took its value
    return None, None


def _shebang(program: str) -> list[str]:
    head = read_regular(program, 256, cut=True, follow=True)
    if head is None or not head.startswith(b"#!"):
        return []
    return head[2:].split(b"\n", 1)[0].decode(errors="replace").split()


def _layout(python: str, env: Mapping[str, str], cwd: str) -> dict[str, Any]:
    """The version, prefix and import path of `python`, from its files: a venv's
    pyvenv.cfg (its version, home and whether the system site is seen), else the prefix
    above its real `bin/`; site directories as `site` would add them, after PYTHONPATH."""
    bindir = os.path.dirname(python)
    cfg = _pyvenv_cfg(os.path.dirname(bindir)) or _pyvenv_cfg(bindir)
    real = os.path.realpath(python)
    if cfg is not None:
        prefix = os.path.dirname(bindir)
        home = cfg.get("home", "")
        base = os.path.dirname(home) if os.path.basename(home) == "bin" else home
        system_site = cfg.get("include-system-site-packages", "").lower() == "true"
        version = _dotted(cfg.get("version") or cfg.get("version_info") or "")
    else:
        prefix = base = os.path.dirname(os.path.dirname(real))
        system_site, version = True, None
    short = _short_version(real, version)
    version = version or _version_of(real, base, short)
    paths = [os.path.normpath(os.path.join(cwd, p))
             for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    prefixes = [prefix] + ([base] if system_site and base != prefix else [])
    if short and (cfg is None or system_site):
        home_dir = env.get("HOME")
        if home_dir:
            paths.append(os.path.join(home_dir, ".local", "lib", f"python{short}",
                                      "site-packages"))
    for p in prefixes:
        paths += [os.path.join(p, "lib", f"python{short}", "site-packages"),
                  os.path.join(p, "local", "lib", f"python{short}", "dist-packages"),
                  os.path.join(p, "lib", "python3", "dist-packages")]
    stdlib = os.path.join(base, "lib", f"python{short}")
    return {"version": version or short or "unknown", "prefix": prefix,
            "paths": list(dict.fromkeys(paths)), "stdlib": stdlib}


def _pyvenv_cfg(directory: str) -> dict[str, str] | None:
    raw = read_regular(os.path.join(directory, "pyvenv.cfg"), 8192, cut=True, follow=True)
    if raw is None:
        return None
    out = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        key, eq, value = line.partition("=")
        if eq:
            out[key.strip().lower()] = value.strip()
    return out


def _dotted(version: str) -> str | None:
    """"3.11.7" of "3.11.7" or "3.11.7.final.0"."""
    found = _FULL_VERSION.search(version) or re.search(r"\d+\.\d+\.\d+", version)
    return found.group(0) if found else None


def _short_version(real: str, version: str | None) -> str | None:
    """X.Y: from the full version, else from the executable's name (python3.11)."""
    if version:
        return ".".join(version.split(".")[:2])
    found = re.search(r"python(\d+\.\d+)$", os.path.basename(real))
    return found.group(1) if found else _own_short(real)


def _own_short(real: str) -> str | None:
    if real == os.path.realpath(sys.executable):
        return f"{sys.version_info[0]}.{sys.version_info[1]}"
    return None


def _version_of(real: str, base: str, short: str | None) -> str | None:
    """The full version of a Python that is not a venv: this process's own when it is
    the same file, else its headers' PY_VERSION, else a version its prefix names
    (pyenv's versions/3.11.7)."""
    if real == os.path.realpath(sys.executable):
        return "%d.%d.%d" % sys.version_info[:3]
    if short:
        header = read_regular(os.path.join(base, "include", f"python{short}", "patchlevel.h"),
                              PATCHLEVEL_HEAD, cut=True, follow=True)
        found = header and re.search(rb'#define\s+PY_VERSION\s+"([^"]+)"', header)
        if found:
            return found.group(1).decode("utf-8", "replace")
    named = _FULL_VERSION.search(base)
    if named and short and named.group(1).startswith(short + "."):
        return named.group(1)
    return None


def _distributions(paths: Sequence[str]) -> dict[str, str]:
    """{normalized name: version} of every distribution on `paths`, the first of each
    name winning (as importlib.metadata finds it)."""
    found: dict[str, str] = {}
    for directory in paths:
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        for entry in entries:
            if entry.endswith(".dist-info"):
                meta = os.path.join(directory, entry, "METADATA")
            elif entry.endswith(".egg-info"):
                meta = os.path.join(directory, entry)
                if os.path.isdir(meta):
                    meta = os.path.join(meta, "PKG-INFO")
            else:
                continue
            head = _metadata_head(meta)
            if head is None:
                continue
            name = _normalize(head[0])
            if name not in found:
                found[name] = head[1]
                if len(found) >= MAX_DISTRIBUTIONS:
                    return found
    return found


def _metadata_head(path: str) -> tuple[str, str] | None:
    """(Name, Version) from a METADATA/PKG-INFO file's headers. Raw reads and byte searches:
    a host has hundreds of these, and `open()` with `splitlines()` cost twice as much."""
    raw = read_regular(path, METADATA_HEAD, cut=True, follow=True)
    if raw is None:
        return None
    head = b"\n" + raw
    end = head.find(b"\n\n", 1)  # the headers end there; the description follows
    if end > 0:
        head = head[:end + 1]
    name, version = _header(head, b"\nName:"), _header(head, b"\nVersion:")
    return (name, version) if name and version else None


def _header(head: bytes, key: bytes) -> str | None:
    start = head.find(key)
    if start < 0:
        return None
    start += len(key)
    return head[start:head.find(b"\n", start)].decode("utf-8", "replace").strip()


def _normalize(name: str) -> str:
    """PEP 503's normalized name: Foo_Bar and foo.bar are foo-bar."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _module_file(module: str, paths: Sequence[str]) -> str | None:
    """The file `python -m module` runs: module.py, or a package's __main__.py."""
    parts = module.split(".")
    for directory in paths:
        base = os.path.join(directory, *parts)
        for candidate in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def _shown(script: str | None, argv: Sequence[str]) -> str:
    """The entry as the user named it (`train.py`), for the report."""
    for word in argv[1:]:
        if script and os.path.basename(word) == os.path.basename(script):
            return word
    return os.path.basename(script) if script else os.path.basename(argv[0])


def _file_facts(path: str | None, shown: str) -> dict[str, Any]:
    """Name, path, size, mtime and SHA-256 of the file the job runs (None for a missing
    one's path, size and digest); `kind` for one that is there but is no regular file (a
    FIFO, a directory, a device: spawner.untrusted.kind_of), which is never read."""
    facts: dict[str, Any] = {"name": shown, "path": path, "size": None, "mtime": None,
                             "sha256": None}
    if path is None:
        return facts
    try:
        fd = open_regular(path, follow=True)
    except NotRegular as exc:
        facts["kind"] = exc.kind
        return facts
    except OSError:
        facts["path"] = None
        return facts
    try:
        st = os.fstat(fd)
        facts.update(size=st.st_size, mtime=st.st_mtime)
        if st.st_size <= MAX_DIGEST_BYTES:
            facts["sha256"] = _digest(fd, st.st_size)
    except OSError:
        facts["path"] = None
    finally:
        os.close(fd)
    return facts


def _digest(fd: int, size: int) -> str:
    """SHA-256 of the first `size` bytes of `fd` (its size as fstat saw it: a file that
    grows meanwhile is read no further)."""
    digest, offset = _sha256(), 0
    while offset < size:
        block = os.pread(fd, min(1 << 20, size - offset), offset)
        if not block:
            break
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def _sha256():
    """The standard library's own SHA-256: hashlib loads OpenSSL's libcrypto first, 10-20 ms
    of a start here, while the builtin module takes ~0.5 ms."""
    try:
        from _sha2 import sha256  # 3.12 and later
    except ImportError:
        try:
            from _sha256 import sha256  # 3.10, 3.11
        except ImportError:  # a build without them
            from hashlib import sha256
    return sha256()


def _sdk(env: Mapping[str, str]) -> dict[str, Any]:
    """The Poplar SDK the instances would have enabled: the `*_SDK_ENABLED` variables its
    enable scripts set (POPLAR_SDK_ENABLED, POPART_SDK_ENABLED...) and the version their
    paths name."""
    enabled = {k: v for k, v in sorted(env.items()) if k.endswith("_SDK_ENABLED")}
    version = None
    for name in ("POPLAR_SDK_ENABLED", *enabled):
        found = _SDK_VERSION.search(enabled.get(name, ""))
        if found:
            version = found.group(1)
            break
    return {"enabled": enabled, "version": version}


def _space(cache: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """Free bytes where the executable cache (an explicit path: its nearest existing
    directory) and the temporary files (TMPDIR, else /tmp) go."""
    temp = env.get("TMPDIR") or "/tmp"
    out = {}
    for what, where in (("cache", cache), ("temp", temp)):
        if not where:
            continue
        probe = where
        while probe and not os.path.isdir(probe):
            parent = os.path.dirname(probe)
            probe = "" if parent == probe else parent
        try:
            st = os.statvfs(probe or "/")
        except OSError:
            continue
        out[what] = {"path": where, "free": st.f_bavail * st.f_frsize}
    return out
