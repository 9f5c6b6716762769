"""Host-list syntax: `h1,h2`, `pod[1-4]`, `node[01-10,15]`, `user@host`, `host:port`,
host files, and Slurm's `SLURM_JOB_NODELIST` (the same bracket syntax, several groups allowed:
`rack[1-2]-n[1-3]`). Pure: text in, `Host` tuples out.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
# `[::1]:22` or `user@[fe80::1]`: brackets around an IPv6 address, not a range to expand.
_IPV6 = re.compile(r"^(?:[^@\[]+@)?\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?$")


@dataclass(frozen=True)
class Host:
    """One host as the user named it; `name` is what ~/.ssh/config is looked up with."""

    name: str
    user: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        text = f"{self.user}@{self.name}" if self.user else self.name
        return f"{text}:{self.port}" if self.port else text


SLURM_NODELIST = "SLURM_JOB_NODELIST"
LOCAL_NAMES = ("localhost",)


def job_hosts(hosts: tuple[Host, ...], environ: Mapping[str, str]) -> tuple[Host, ...]:
    """The hosts a job runs on: those given, else a Slurm allocation's nodes, else none
    (meaning this host only)."""
    if hosts:
        return hosts
    nodelist = environ.get(SLURM_NODELIST, "").strip()
    return parse_host_list(nodelist, SLURM_NODELIST) if nodelist else ()


def is_local(host: Host, this_host: str) -> bool:
    """Whether `host` names this machine, so its instances start without SSH (as mpirun
    does). Only names count, not addresses: `127.0.0.2` may well be an sshd in a test."""
    if host.user or host.port:
        return False
    short = this_host.split(".", 1)[0]
    return host.name in LOCAL_NAMES or host.name in (this_host, short)


def parse_host_list(text: str, source: str = "--host") -> tuple[Host, ...]:
    """Parse a comma-separated host list with bracket ranges; duplicates are an error."""
    hosts: list[Host] = []
    for item in _split_top_level(text, source):
        expanded = [item] if _IPV6.match(item) else expand_brackets(item, source)
        hosts += [_parse_host(name, source) for name in expanded]
    return _unique(hosts, source)


def parse_host_file(content: str, source: str) -> tuple[Host, ...]:
    """One host (or host list) per line; `#` starts a comment; blank lines are skipped."""
    hosts: list[Host] = []
    for line in content.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            hosts += parse_host_list(line, source)
    if not hosts:
        raise ConfigError(f"{source}: no hosts in the file")
    return _unique(hosts, source)


def expand_brackets(item: str, source: str = "--host") -> list[str]:
    """`node[01-03,7]` -> node01 node02 node03 node7 (zero padding of each bound kept)."""
    parts = re.split(r"(\[[^\]]*\])", item)
    choices: list[list[str]] = []
    for part in parts:
        if part.startswith("["):
            choices.append(_expand_range_list(part[1:-1], item, source))
        elif "[" in part or "]" in part:
            raise ConfigError(f"{source}: unbalanced brackets in {item!r}")
        else:
            choices.append([part])
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_range_list(body: str, item: str, source: str) -> list[str]:
    out: list[str] = []
    for piece in body.split(","):
        match = _RANGE.match(piece.strip())
        if not match:
            raise ConfigError(f"{source}: {piece!r} in {item!r} is not a number or a range a-b")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ConfigError(f"{source}: range {piece!r} in {item!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return out


def _split_top_level(text: str, source: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, current = [], 0, []
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ConfigError(f"{source}: unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    items.append("".join(current))
    stripped = [i.strip() for i in items]
    if any(not i for i in stripped):
        raise ConfigError(f"{source}: empty host name in {text!r}")
    return stripped


def _parse_host(text: str, source: str) -> Host:
    user, _, rest = text.rpartition("@")
    port = None
    if rest.startswith("["):  # [::1]:22 style
        name, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = _port(tail[1:], text, source)
    elif rest.count(":") == 1:
        name, port_text = rest.split(":")
        port = _port(port_text, text, source)
    else:
        name = rest
    if not name or any(c.isspace() for c in name):
        raise ConfigError(f"{source}: {text!r} is not a host name")
    return Host(name=name, user=user or None, port=port)


def _port(text: str, item: str, source: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(f"{source}: {text!r} in {item!r} is not a port number")
    return int(text)


def _unique(hosts: list[Host], source: str) -> tuple[Host, ...]:
    seen: set[Host] = set()
    for host in hosts:
        if host in seen:
            raise ConfigError(f"{source}: host {host} is listed twice")
        seen.add(host)
    return tuple(hosts)
