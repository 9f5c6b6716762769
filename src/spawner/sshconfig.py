"""~/.ssh/config and known_hosts parsed once per text, not per connection; asyncssh still
evaluates them for each host.

`asyncssh.connect(config=())` loads `~/.ssh/config` for every connection: `SSHConfig.parse`
reads the file and runs `shlex.split` on every line of it, for every host, because `Host` and
`Match` are evaluated while parsing (a block's lines count only where its condition held for
*that* host). With a config that names each host of a cluster, every connection splits the
lines of every host's block: ~18 ms per connection for 64 hosts' blocks, a launch's CPU
growing with the square of its hosts (bench/README.md, "SSH fan-out to 64 hosts").

`install(asyncssh)` puts `_parse` in place of `SSHClientConfig.parse`: the same loop as
asyncssh's over the same lines, the same handlers evaluating `Host`, `Match` (exec, final,
canonical...), `Include`, `%` tokens and `${VAR}` for this host, the same errors at the same
line numbers. Only the host-independent part (the file's lines, stripped, comments dropped,
split as shlex does, `=` separated, the option's name lower-cased) comes from a cache keyed by
the file's text: each parse still reads the file, so an edit is seen at once.

The loop is a copy of asyncssh's own (2.19 to 2.24 have the same `parse`): `install` puts it
in place only where asyncssh's `SSHConfig.parse` is that code, byte for byte; with any other
asyncssh, connections parse as asyncssh does, slower but the same.

known_hosts is the same story: every connection reads the files its config names and decodes
every key in them (1.5 ms per connection with 64 entries). `install` also puts
`_read_known_hosts` where asyncssh's `match_known_hosts` finds `read_known_hosts`: the files
are still read each time, in order, and the loaded entries come from a cache keyed by their
texts (asyncssh's own SSHKnownHosts, only matched against afterwards); again only over the
`read_known_hosts` it stands for (unchanged from asyncssh 2.14 to 2.24).
"""

from __future__ import annotations

import functools
import hashlib
import linecache
import shlex
from pathlib import Path
from typing import Any, NamedTuple

# sha256 of asyncssh's SSHConfig.parse source (asyncssh 2.19.0 to 2.24.1), the code `_parse`
# copies. When asyncssh changes it, compare the new code with `_parse` and `_split` before
# adding its digest here.
KNOWN_PARSE_SHA256 = frozenset({
    "8809c434443397c9df04e87dd30d9188e2dde502b7d88c61d65f8f5dd10488cf",
})
# sha256 of asyncssh's SSHClientConfig._match_host source (asyncssh 2.19.0 to 2.24.1), which
# `_parse` does itself for a `Host` line (`_host_matches`).
KNOWN_MATCH_HOST_SHA256 = frozenset({
    "8c64d71b506808f371c1f06f2dec92e06be6933a5dac920b16028d4f325e912f",
})
# sha256 of asyncssh's read_known_hosts source (asyncssh 2.14.0 to 2.24.1).
KNOWN_READ_KNOWN_HOSTS_SHA256 = frozenset({
    "bb015e1b0fded2a98fa8e2f73fbe07f270bb246cf09ebb1a59905bcc84c21184",
})
# Distinct texts kept (config files per SSHConfig class; known_hosts file lists): a launch has
# one or a few (Include, UserKnownHostsFile with several files).
MAX_CACHED = 32
# Distinct `Host` patterns kept (a config's wildcard lines: `*`, `*.cluster`, `gpu-??`...).
MAX_PATTERNS = 4096


class _Line(NamedTuple):
    """One line that is neither blank nor a comment, as asyncssh's parse splits it."""

    number: int  # in the file, counting every line, for the error messages
    option: str  # the keyword, lower case ('' if the line failed to split)
    args: tuple[str, ...]
    error: str | BaseException | None  # what splitting it raised: asyncssh raises it there
    # Where the next line that must be looked at is (a condition, or an error): the lines
    # up to it belong to this line's block, which a host it does not apply to skips whole.
    skip: int = 0
    # A `Host` line's names when none is a pattern (no `*`, `?`, `!`): those it matches.
    hosts: frozenset[str] | None = None


_cache: dict[tuple[type, str], tuple[_Line, ...]] = {}
_logger: Any = None  # asyncssh's config logger, set by install
_match_host: Any = None  # asyncssh's SSHClientConfig._match_host, where it is the known code
_host_patterns: Any = None  # asyncssh's WildcardPatternList, made once per pattern (install)


def install(asyncssh: Any) -> bool:
    """Make asyncssh's client config parse and its known_hosts reading use the caches, each
    where asyncssh's code is the known one; True if both do (now or already)."""
    return _install_config(asyncssh) & _install_known_hosts(asyncssh)


def _install_config(asyncssh: Any) -> bool:
    config = asyncssh.config
    if config.SSHClientConfig.parse is _parse:
        return True
    if config.SSHClientConfig.parse is not config.SSHConfig.parse or \
            _source_sha256(config.SSHConfig.parse) not in KNOWN_PARSE_SHA256:
        return False
    global _logger, _match_host, _host_patterns
    _logger = config.logger
    if _source_sha256(config.SSHClientConfig._match_host) in KNOWN_MATCH_HOST_SHA256:
        _match_host = config.SSHClientConfig._match_host
        _host_patterns = functools.lru_cache(maxsize=MAX_PATTERNS)(config.WildcardPatternList)
    config.SSHClientConfig.parse = _parse
    return True


def _source_sha256(function: Any) -> str | None:
    """The digest of a function's source, from its first line to its last with code (what
    inspect.getsource gives, at a tenth of its cost); None without the source."""
    code = function.__code__
    lines = linecache.getlines(code.co_filename)
    last = max((line for *_, line in code.co_lines() if line is not None), default=0)
    if not lines or last < code.co_firstlineno:
        return None
    text = "".join(lines[code.co_firstlineno - 1:last])
    return hashlib.sha256(text.encode()).hexdigest()


def _lines(cls: type, path: Path) -> tuple[_Line, ...]:
    """The file's lines split for `cls` (its conditionals and no-split options decide how),
    from the cache while the file's text is the same."""
    with open(path) as file:  # asyncssh's own open: its errors, its decoding, its newlines
        text = file.read()
    key = (cls, text)
    lines = _cache.get(key)
    if lines is None:
        lines = _indexed(cls, tuple(_split(cls, text)))
        if len(_cache) >= MAX_CACHED:
            _cache.clear()
        _cache[key] = lines
    return lines


def _split(cls: type, text: str) -> Any:
    """asyncssh's SSHConfig.parse up to the matching check, line by line (its code)."""
    for line_no, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line or line[0] == "#":
            continue
        try:
            split_args = shlex.split(line)
        except ValueError as exc:
            yield _Line(line_no, "", (), str(exc))
            continue
        args: list[str] = []
        loption = ""
        allow_equal = True
        try:
            for i, arg in enumerate(split_args, 1):
                if arg.startswith("="):
                    if len(arg) > 1:
                        args.append(arg[1:])
                elif not allow_equal:
                    args.extend(split_args[i - 1:])
                    break
                elif arg.endswith("="):
                    args.append(arg[:-1])
                elif "=" in arg:
                    arg, val = arg.split("=", 1)
                    args.append(arg)
                    args.append(val)
                else:
                    args.append(arg)

                if i == 1:
                    loption = args.pop(0).lower()
                    allow_equal = loption in cls._conditionals  # type: ignore[attr-defined]
        except IndexError as exc:  # a line that is only "=": asyncssh's pop fails there
            yield _Line(line_no, "", (), exc)
            continue
        if loption in cls._no_split:  # type: ignore[attr-defined]
            args = [line.lstrip()[len(loption):].strip()]
        yield _Line(line_no, loption, tuple(args), None)


def _indexed(cls: type, lines: tuple[_Line, ...]) -> tuple[_Line, ...]:
    """The lines with what spares work per host: where each block ends (`skip`), and the
    names of each `Host` line without patterns (`hosts`)."""
    conditionals = cls._conditionals  # type: ignore[attr-defined]
    out: list[_Line] = []
    stop = len(lines)
    for index in range(len(lines) - 1, -1, -1):  # from the end: each line's next stop
        line = lines[index]
        hosts = None
        if line.option == "host" and line.error is None and not any(
                c in arg for arg in line.args for c in "*?!"):
            hosts = frozenset(",".join(line.args).split(","))
        out.append(line._replace(skip=stop, hosts=hosts))
        if line.option in conditionals or line.error is not None:
            stop = index
    return tuple(reversed(out))


def _host_matches(self: Any, line: _Line) -> None:
    """asyncssh's SSHClientConfig._match_host for a `Host` line: names without a pattern
    match only themselves (fnmatch, once `[` and `]` are escaped as asyncssh does), the
    others through asyncssh's own pattern list, made once per pattern."""
    if line.hosts is not None:
        self._matching = self._orig_host in line.hosts
    else:
        self._matching = _host_patterns(",".join(line.args)).matches(self._orig_host)


def _parse(self: Any, path: Path) -> None:
    """asyncssh's SSHConfig.parse (2.19-2.24), its lines split by `_lines`; a block that
    does not apply to this host skipped whole, `Host` lines matched by `_host_matches`."""
    self._path = path
    self._line_no = 0
    self._matching = True
    self._tokens = {"%": "%"}

    _logger.debug1('Reading config from "%s"', path)

    lines = _lines(type(self), path)
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        self._line_no = line.number
        if isinstance(line.error, str):
            self._error(line.error)
        if line.error is not None:
            raise type(line.error)(*line.error.args)

        if not self._matching and line.option not in self._conditionals:
            index = line.skip  # the rest of its block: no condition, no error
            continue

        try:
            option, handler = self._handlers[line.option]
        except KeyError:
            continue

        args = list(line.args)  # the handlers consume it
        if not args:
            self._error(f"Missing {option} value")

        if handler is _match_host and _match_host is not None:
            _host_matches(self, line)
            continue

        handler(self, option, args)

        if args:
            self._error(f'Extra data at end: {" ".join(args)}')

    self._set_tokens()

    for option in self._percent_expand:
        try:
            value = self._options[option]
        except KeyError:
            pass
        else:
            if isinstance(value, list):
                value = [self._expand_val(item) for item in value]
            elif isinstance(value, str):
                value = self._expand_val(value)

            self._options[option] = value


# -- known_hosts ---------------------------------------------------------------------------

_known_hosts_cache: dict[tuple[str, ...], Any] = {}
_known_hosts_module: Any = None  # asyncssh.known_hosts, set by install


def _install_known_hosts(asyncssh: Any) -> bool:
    global _known_hosts_module
    module = asyncssh.known_hosts
    if module.read_known_hosts is _read_known_hosts:
        return True
    if _source_sha256(module.read_known_hosts) not in KNOWN_READ_KNOWN_HOSTS_SHA256:
        return False
    _known_hosts_module = module
    module.read_known_hosts = _read_known_hosts  # what match_known_hosts calls
    return True


def _read_known_hosts(filelist: Any) -> Any:
    """asyncssh's read_known_hosts: the files read in order, their entries loaded once per
    text. A file that cannot be read raises after the files before it were loaded, as there
    (a bad entry in those is the error asyncssh raises first)."""
    if isinstance(filelist, str):
        filelist = [filelist]
    texts: list[str] = []
    for filename in filelist:
        try:
            texts.append(_known_hosts_module.read_file(filename, "r"))
        except BaseException:
            _loaded(tuple(texts))
            raise
    return _loaded(tuple(texts))


def _loaded(texts: tuple[str, ...]) -> Any:
    known = _known_hosts_cache.get(texts)
    if known is None:
        known = _known_hosts_module.SSHKnownHosts()
        for text in texts:
            known.load(text)
        if len(_known_hosts_cache) >= MAX_CACHED:
            _known_hosts_cache.clear()
        _known_hosts_cache[texts] = known
    return known
