"""Do the hosts agree? What a job depends on, compared across its hosts before anything
starts (docs/architecture.md, "Hosts that differ"); pure.

Each host's facts come from its agent's HELLO (spawner/hostfacts.py; the launcher's own host
reads them the same way). They are another host's words, so `read` bounds and checks every
field before anything here uses it. `compare` names each difference with the hosts on each
side, the most common value first: `torch 2.13.0 on h[1-3], 2.12.1 on h4`.

Compared: the instances' Python (path and version), its distributions, the file the job
runs (by digest), the program's path, the working directory, the Poplar SDK, the variables
the hosts' sessions give the instances, and, against fixed bounds, free space where the
executable cache and temporary files go and the clock. Not compared: what differs by design
from host to host (HOSTNAME, HOME, SSH_*, XDG_*...: popdist.env.NOT_FORWARDED, PER_HOST), and
what poprun itself sets on every instance (it is the same everywhere).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from fnmatch import fnmatchcase
from functools import cache
from typing import Any

from popdist.env import NOT_FORWARDED
from spawner.uncompiled import dataclass

from poprun.plan.pods import INDEX_VARIABLES
from poprun.text import cut, fold_hosts, size

MIN_FREE = 1 << 30  # bytes: less free where the cache or temp files go is worth a warning
MAX_SKEW = 1.0  # seconds between a host's clock and the launcher's worth a warning
SHOWN = 12  # differences a launch prints before "... and N more" (--check prints them all)
RECORDED = 100  # differences the job's record keeps
VALUE_CHARS = 100  # a value longer than this is cut in the table
KIND_CHARS = 40  # of what a host says its file is, when no regular file ("FIFO")
MAX_TEXT = 4096  # characters of any string taken from a host
MAX_ITEMS = 10_000  # entries of any mapping taken from a host
# Variables that differ by design from host to host or session to session, besides
# NOT_FORWARDED: the user's base directories, the shell's level and terminal, a pod's place.
PER_HOST = (*NOT_FORWARDED, "XDG_*", "SHLVL", "TERM", "COLUMNS", "LINES", "*_SDK_ENABLED",
            *INDEX_VARIABLES)


@dataclass(frozen=True)
class Entry:
    """The file the job runs: as the user named it, where, its digest, size and mtime; what
    it is where it is there but no regular file (a FIFO, a directory, a device)."""

    name: str
    path: str | None  # None: missing there
    sha256: str | None
    size: int | None
    mtime: float | None
    kind: str | None = None  # None: a regular file (or missing)


@dataclass(frozen=True)
class HostFacts:
    """One host's facts, checked (`read`)."""

    program: str | None
    python: str | None  # "path version"
    distributions: Mapping[str, str] | None  # normalized name -> version
    entry: Entry | None
    cwd: str
    cwd_exists: bool
    sdk: str  # the SDK's version, else what enables it, else "none"
    space: tuple[tuple[str, int], ...]  # (where, free bytes)
    time: float | None  # the host's clock when it answered
    variables: Mapping[str, str]  # what its sessions give instances (host_variables)


@dataclass(frozen=True)
class Difference:
    """One fact on which the hosts disagree: `sides` are (value, hosts) pairs, the most
    common value first; `text` is its line in the table."""

    kind: str  # python, distribution, file, program, cwd, sdk, variable, space, clock, facts
    name: str
    sides: tuple[tuple[str, tuple[str, ...]], ...]
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "text": self.text,
                "sides": [{"value": v, "hosts": list(h)} for v, h in self.sides]}


def read(raw: object, variables: Mapping[str, str] | None = None) -> HostFacts | None:
    """A host's facts from its agent's answer (`variables`: host_variables() of what its
    instances inherit there); None when it sent none or nonsense."""
    if not isinstance(raw, Mapping):
        return None
    python = raw.get("python")
    python = (f"{_text(python.get('path'))} {_text(python.get('version'))}"
              if isinstance(python, Mapping) else None)
    dists = raw.get("distributions")
    sdk = raw.get("sdk") if isinstance(raw.get("sdk"), Mapping) else {}
    enabled = _strings(sdk.get("enabled"))
    space = raw.get("space") if isinstance(raw.get("space"), Mapping) else {}
    return HostFacts(
        program=_text(raw.get("program")) if raw.get("program") is not None else None,
        python=python,
        distributions=_strings(dists) if isinstance(dists, Mapping) else None,
        entry=_entry(raw.get("entry")),
        cwd=_text(raw.get("cwd")), cwd_exists=raw.get("cwd_exists") is True,
        sdk=(_text(sdk.get("version")) if sdk.get("version") else
             ", ".join(f"{k}={v}" for k, v in enabled.items()) or "none"),
        space=tuple((_text(s.get("path")), _count(s.get("free")))
                    for s in list(space.values())[:2] if isinstance(s, Mapping)
                    and _count(s.get("free")) is not None),
        time=_number(raw.get("time")), variables=dict(variables or {}))


def host_variables(environ: Mapping[str, str], set_by_poprun: Collection[str]
                   ) -> dict[str, str]:
    """What a host's instances get from the host rather than from poprun: `environ` (what
    they inherit there) less the names poprun sets on every instance and the per-host
    ones (PER_HOST)."""
    per_host = _per_host()
    return {k: v for k, v in environ.items() if k not in set_by_poprun
            and not per_host(k)}


@cache
def _per_host() -> Callable[[str], bool]:
    """PER_HOST as a test of a name: its names in a set, its `PREFIX*` and `*SUFFIX`
    patterns as tuples for one startswith/endswith each, any other pattern by fnmatch
    (fnmatch per pattern and name made the comparing of a launch 1.9 ms, now 0.4:
    bench/compare_hosts_bench.py)."""
    names = frozenset(p for p in PER_HOST if not _GLOB & set(p))
    prefixes = tuple(p[:-1] for p in PER_HOST if p.endswith("*") and not _GLOB & set(p[:-1]))
    suffixes = tuple(p[1:] for p in PER_HOST if p.startswith("*") and not _GLOB & set(p[1:]))
    others = [p for p in PER_HOST if _GLOB & set(p) and p[:-1] not in prefixes
              and p[1:] not in suffixes]
    return lambda name: (name in names or name.startswith(prefixes)
                         or name.endswith(suffixes)
                         or any(fnmatchcase(name, p) for p in others))


_GLOB = frozenset("*?[")


def compare(facts: Mapping[str, HostFacts], offsets: Mapping[str, float] | None = None,
            local: Collection[str] = ()) -> tuple[Difference, ...]:
    """Every difference among the hosts (in their order: `facts`' keys), and every host
    whose free space or clock (`offsets`: seconds ahead of the launcher) is out of bounds.
    `local`: the hosts that are the launcher's own (their variables are not compared)."""
    hosts = list(facts)
    out: list[Difference] = []
    out += _by_value("python", "Python", {h: f.python or "none" for h, f in facts.items()})
    out += _file(facts)
    out += _by_value("program", "program",
                     {h: f.program or "not found" for h, f in facts.items()})
    out += _cwd(facts)
    out += _by_value("sdk", "Poplar SDK", {h: f.sdk for h, f in facts.items()})
    out += _distributions(facts)
    out += _variables(facts, local)
    out += _space(facts, hosts)
    out += _clock(offsets or {}, hosts)
    return tuple(out)


def unknown(hosts: Collection[str]) -> tuple[Difference, ...]:
    """The hosts whose facts did not arrive, as one difference (none if there are none):
    nothing says they are alike."""
    if not hosts:
        return ()
    return (Difference("facts", "", (("unknown", tuple(hosts)),),
                       f"no facts from {fold_hosts(list(hosts))}: its agent did not send "
                       "them (lost, or too slow), so it cannot be compared"),)


def recorded(differences: Collection[Difference]) -> list[dict[str, Any]]:
    """The differences as the job's record keeps them (rewritten as the job goes): RECORDED
    at most, then one entry saying how many more."""
    kept = [d.to_json() for d in list(differences)[:RECORDED]]
    if len(differences) > RECORDED:
        more = len(differences) - RECORDED
        kept.append({"kind": "more", "name": "", "sides": [],
                     "text": f"... and {more} more (poprun --check shows them all)"})
    return kept


def render(differences: Collection[Difference], limit: int = SHOWN) -> list[str]:
    """The table's lines: one per difference, `limit` at most, then how many more."""
    shown = list(differences)[:limit]
    lines = [d.text for d in shown]
    if len(differences) > len(shown):
        lines.append(f"... and {len(differences) - len(shown)} more (poprun --check shows "
                     "them all)")
    return lines


# --- one kind each -----------------------------------------------------------------------

def _by_value(kind: str, name: str, values: Mapping[str, str], label: str | None = None
              ) -> list[Difference]:
    """`name` (shown as `label`) with each value and its hosts, when there is more than one
    value."""
    if len(set(values.values())) < 2:  # the common case, hundreds of times: alike
        return []
    sides = _sides(values)
    return [Difference(kind, name, sides, f"{label or name} " + ", ".join(
        f"{_short(value)} on {fold_hosts(list(group))}" for value, group in sides))]


def _sides(values: Mapping[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(value, its hosts), the most common value first (ties: the first host's)."""
    groups: dict[str, list[str]] = {}
    for host, value in values.items():
        groups.setdefault(value, []).append(host)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))  # stable: host order
    return tuple((value, tuple(group)) for value, group in ordered)


def _file(facts: Mapping[str, HostFacts]) -> list[Difference]:
    """The file the job runs, by digest (by size where it was too big to digest): `train.py
    differs on h4 (modified 12 min ago)`, `missing on h3`, `is a FIFO on h2`."""
    entries = {h: f.entry for h, f in facts.items() if f.entry is not None}
    if not entries:
        return []
    keys = {h: "missing" if e.path is None else f"a {e.kind}" if e.kind else
            e.sha256 or f"size {e.size}" for h, e in entries.items()}
    sides = _sides(keys)
    if len(sides) < 2:
        return []
    name = next(iter(entries.values())).name
    odd = {key for h, key in keys.items() if entries[h].kind or key == "missing"}
    parts = []
    for key, group in sides[1:]:
        if key in odd:
            parts.append(_odd_file(key, group))
            continue
        ages = [_age(facts[h].time, entries[h].mtime) for h in group]
        parts.append(f"differs on {fold_hosts(list(group))}"
                     + (f" (modified {ages[0]})" if ages[0] else ""))
    if sides[0][0] == "missing":  # most hosts lack it: name those that have it
        parts = [p.replace("differs on", "present on", 1) for p in parts]
    elif sides[0][0] in odd:  # most hosts have no file there: say what, then who has one
        parts = [_odd_file(*sides[0])] + [p.replace("differs on", "a file on", 1)
                                          for p in parts]
    return [Difference("file", name, sides, f"{_short(name)} {'; '.join(parts)}")]


def _odd_file(key: str, group: tuple[str, ...]) -> str:
    """`missing on h3`, `is a FIFO on h2`: where the file the job runs is not a file."""
    return f"{'missing' if key == 'missing' else 'is ' + key} on {fold_hosts(list(group))}"


def _cwd(facts: Mapping[str, HostFacts]) -> list[Difference]:
    values = {h: "present" if f.cwd_exists else "missing" for h, f in facts.items()}
    sides = _sides(values)
    if len(sides) < 2:
        return []
    missing = next(group for value, group in sides if value == "missing")
    cwd = next(iter(facts.values())).cwd
    return [Difference("cwd", cwd, sides,
                       f"working directory {_short(cwd)} missing on {fold_hosts(list(missing))}")]


def _distributions(facts: Mapping[str, HostFacts]) -> list[Difference]:
    """Each distribution whose version differs, or that some hosts lack; hosts with no
    Python of the job's are left out (their Python is the difference)."""
    having = {h: f.distributions for h, f in facts.items() if f.distributions is not None}
    if len(having) < 2:
        return []
    names = sorted(set().union(*having.values()))
    out = []
    for name in names:
        out += _by_value("distribution", name,
                         {h: d.get(name, "not installed") for h, d in having.items()})
    return out


def _variables(facts: Mapping[str, HostFacts], local: Collection[str]) -> list[Difference]:
    """The variables the remote hosts' sessions give their instances. The launcher's own
    host is not among them: its instances inherit poprun's whole environment, which
    `--check` compares with each remote host's on its own (run/check.py)."""
    remote = {h: f for h, f in facts.items() if h not in local}
    if len(remote) < 2:
        return []
    out = []
    for name in sorted(set().union(*(f.variables for f in remote.values()))):
        out += _by_value("variable", name, {h: _quoted(f.variables.get(name))
                                            for h, f in remote.items()}, label=f"${name}")
    return out


def _quoted(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def _space(facts: Mapping[str, HostFacts], hosts: list[str]) -> list[Difference]:
    """Each place (cache, temp) with less than MIN_FREE free, and its hosts."""
    low: dict[tuple[str, int], list[str]] = {}
    for host in hosts:
        for where, free in facts[host].space:
            if free < MIN_FREE:
                low.setdefault((where, free), []).append(host)
    return [Difference("space", where, ((size(free), tuple(group)),),
                       f"free space {size(free)} in {_short(where)} on "
                       f"{fold_hosts(group)} (less than {size(MIN_FREE)})")
            for (where, free), group in low.items()]


def _clock(offsets: Mapping[str, float], hosts: list[str]) -> list[Difference]:
    out = []
    for host in hosts:
        offset = offsets.get(host)
        if offset is not None and abs(offset) > MAX_SKEW:
            way = "ahead of" if offset > 0 else "behind"
            out.append(Difference("clock", host, ((f"{offset:+.1f} s", (host,)),),
                                  f"clock of {host} {abs(offset):.1f} s {way} this "
                                  "machine's"))
    return out


# --- reading another host's words --------------------------------------------------------

def _text(value: object) -> str:
    return str(value)[:MAX_TEXT] if value is not None else "unknown"


def _strings(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {_text(k): _text(v) for k, v in list(value.items())[:MAX_ITEMS]}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: object) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number >= 0 else None


def _entry(raw: object) -> Entry | None:
    if not isinstance(raw, Mapping):
        return None
    digest = raw.get("sha256")
    kind = raw.get("kind")
    return Entry(name=_text(raw.get("name")),
                 path=_text(raw.get("path")) if raw.get("path") is not None else None,
                 sha256=_text(digest) if isinstance(digest, str) else None,
                 size=_count(raw.get("size")), mtime=_number(raw.get("mtime")),
                 kind=_text(kind)[:KIND_CHARS] if kind is not None else None)


# --- shown -------------------------------------------------------------------------------

def _short(value: str) -> str:
    return cut(value, VALUE_CHARS)


def _age(now: float | None, mtime: float | None) -> str | None:
    """"12 min ago" of a file modified at `mtime` on a host whose clock said `now`."""
    if now is None or mtime is None:
        return None
    seconds = now - mtime
    if seconds < 0:
        return "in the future"
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if unit == 'day' and count > 1 else ''} ago"
    return f"{int(seconds)} s ago"
