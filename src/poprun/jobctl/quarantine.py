"""Hosts quarantined across jobs (docs/several-hosts.md, "Spare hosts"): a host a job lost
(or saw freeze) is remembered for `--quarantine-for` in `quarantine.json` in the state
directory (crash.state_dir: this user's, mode 0700), so that the user's next jobs leave it out
(plan/jobhosts.py, JobHosts.without) and `poprunctl hosts` lists it.

The file is rewritten whole (a temporary file renamed over it) under an flock of
`quarantine.lock`, so that jobs ending together lose no entry. It is read defensively: bounded
in size and entries, each entry checked, a damaged file read as empty (and said by poprunctl).
What to keep is pure (`merged`, `active`, `released`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spawner.uncompiled import dataclass

from poprun.crash import ensure_state_dir, state_dir

FILE = "quarantine.json"
LOCK = "quarantine.lock"
SCHEMA = "poprun.quarantine/1"
MAX_FILE = 1 << 20  # bytes: ~5000 entries; more is not a file poprun wrote
MAX_ENTRIES = 4096  # the newest are kept
MAX_TEXT = 500  # characters of a host label or reason kept


@dataclass(frozen=True)
class Entry:
    """A host left out until `until` (time.time()), since `at`, for `reason`, by `job`."""

    host: str
    reason: str
    at: float
    until: float
    job: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "reason": self.reason, "at": self.at, "until": self.until,
                "job": self.job}

    @classmethod
    def of(cls, raw: object) -> Entry | None:
        """An entry as the file holds it; None when it is not one."""
        if not isinstance(raw, Mapping):
            return None
        host, reason, at, until, job = (raw.get(k) for k in ("host", "reason", "at",
                                                                "until", "job"))
        numbers = [v for v in (at, until) if isinstance(v, (int, float))
                   and not isinstance(v, bool) and v == v]
        if not (isinstance(host, str) and host and isinstance(reason, str)
                and len(numbers) == 2 and (job is None or isinstance(job, str))):
            return None
        return cls(host[:MAX_TEXT], reason[:MAX_TEXT], float(at), float(until),
                   job[:MAX_TEXT] if job else None)


def active(entries: Iterable[Entry], now: float) -> dict[str, Entry]:
    """The hosts quarantined at `now`, each by its latest entry."""
    out: dict[str, Entry] = {}
    for entry in entries:
        if entry.until > now and (entry.host not in out or entry.until > out[entry.host].until):
            out[entry.host] = entry
    return out


def merged(entries: Iterable[Entry], new: Iterable[Entry], now: float) -> list[Entry]:
    """The file's entries with `new` added: the expired dropped, one per host (the one
    that lasts longest), the newest MAX_ENTRIES."""
    kept = sorted(active([*entries, *new], now).values(), key=lambda e: e.at)
    return kept[-MAX_ENTRIES:]


def released(entries: Iterable[Entry], hosts: Iterable[str], now: float
             ) -> tuple[list[Entry], list[str]]:
    """The entries without `hosts`' (and the expired), and which of `hosts` were there."""
    gone, current = set(hosts), active(entries, now)
    return ([e for e in current.values() if e.host not in gone],
            [h for h in current if h in gone])


def path(environ: Mapping[str, str] = os.environ) -> str:
    return os.path.join(state_dir(environ), FILE)


def read(environ: Mapping[str, str] = os.environ) -> tuple[list[Entry], str | None]:
    """The file's entries, and why some or all could not be read (None: it is whole)."""
    try:
        fd = os.open(path(environ), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return [], None
    except OSError as exc:
        return [], f"cannot read {path(environ)}: {exc.strerror or exc}"
    try:
        data = os.read(fd, MAX_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE:
        return [], f"{path(environ)} is larger than {MAX_FILE} bytes: not read"
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return [], f"{path(environ)} is not JSON: not read"
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA \
            or not isinstance(raw.get("hosts"), list):
        return [], f"{path(environ)} is not a {SCHEMA} file: not read"
    found = [Entry.of(item) for item in raw["hosts"][:MAX_ENTRIES]]
    entries = [e for e in found if e is not None]
    problem = (f"{path(environ)}: {len(found) - len(entries)} damaged entries skipped"
               if len(entries) < len(found) else None)
    return entries, problem


def add(new: Sequence[Entry], now: float, environ: Mapping[str, str] = os.environ) -> None:
    """Remember `new` (raises OSError)."""
    _rewrite(lambda entries: merged(entries, new, now), environ)


def release(hosts: Sequence[str], now: float,
            environ: Mapping[str, str] = os.environ) -> list[str]:
    """Forget `hosts`; which of them were quarantined (raises OSError)."""
    found: list[str] = []

    def without(entries: list[Entry]) -> list[Entry]:
        kept, gone = released(entries, hosts, now)
        found.extend(gone)
        return kept

    _rewrite(without, environ)
    return found


def _rewrite(change, environ: Mapping[str, str]) -> None:
    """The file replaced by `change(its entries)`, under the lock: one writer at a time."""
    import fcntl

    from poprun.jobctl.records import replace_file

    directory = ensure_state_dir(environ)
    lock = os.open(os.path.join(directory, LOCK),
                   os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries, _ = read(environ)
        replace_file(directory, FILE, json.dumps(
            {"schema": SCHEMA, "hosts": [e.to_json() for e in change(entries)]},
            separators=(",", ":")).encode())
    finally:
        os.close(lock)
