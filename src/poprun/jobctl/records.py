"""The per-user record of every job: what `poprunctl` lists, shows, signals and reaps.

Each launch (the command and `launch()`) makes a directory `<state>/jobs/<id>/` (`<state>` is
crash.state_dir(): `$XDG_RUNTIME_DIR/poprun`, else `~/.local/state/poprun`; every directory
mode 0700) holding:

- `job.json`: the record, rewritten whole (a temporary file renamed over it) as the job goes;
- `control.sock`: the launcher's control socket while it runs (poprun/jobctl/control.py);
- `output.ring`: the job's most recent output, a ring of fixed size (poprun/jobctl/joblog.py),
  unless `--output-filename` writes it already;
- `stall-<n>.txt`: the folded stacks of each stall `--stall-timeout` saw.

The record has one schema, `result.JOB_SCHEMA`, shared with `--result-json`: an ended job's record *is*
its `LaunchResult.to_json()`; while the job runs the same keys are there, the result's own
(`exit_code`, `exit_reason`, ...) null. See `LaunchResult.to_json` for the keys.

Records are kept, bounded by count and so by bytes whatever state a job was left in: the
`KEEP_ENDED` most recent of the jobs that do not run (ended, reaped, or gone: its launcher
died without ending the record, which `poprunctl reap` needs meanwhile), none older than
`KEEP_SECONDS`; the output logs of the `KEEP_LOGS` most recent. A record that cannot be read
(damaged, another schema, another user's) is reported and skipped by the readers here, never
a crash.

Pure helpers and small I/O functions; the launcher's side is poprun/jobctl/watch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Mapping
from typing import Any

from spawner import procid
from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.crash import ensure_state_dir, state_dir
from poprun.result import JOB_SCHEMA as SCHEMA

RECORD = "job.json"
SOCKET = "control.sock"
OUTPUT = "output.ring"  # the output ring (poprun/jobctl/joblog.py)
KEEP_ENDED = 100  # ended records kept
KEEP_SECONDS = 7 * 86400  # ... and none older than this
KEEP_LOGS = 20  # ended jobs whose output log is kept
MAX_RECORD = 16 << 20  # bytes of a record read at most
PRUNE_READS = 20  # records read at most by one prune()
ID_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # no 0/o, 1/l/i: ids are read and typed
ID_LENGTH = 6
ACTIVE = ("starting", "running", "stalled", "stopping")  # states of a job that runs
ENDED = "ended"
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the last a NUL


class RecordError(Exception):
    """A record that cannot be used: `str()` says why."""


def jobs_dir(environ: Mapping[str, str] = os.environ) -> str:
    return os.path.join(state_dir(environ), "jobs")


def create(environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """A new job's id and directory (mode 0700). Raises OSError."""
    ensure_state_dir(environ)
    parent = jobs_dir(environ)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    for _ in range(100):
        job_id = "".join(ID_ALPHABET[b % len(ID_ALPHABET)] for b in os.urandom(ID_LENGTH))
        path = os.path.join(parent, job_id)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return job_id, path
    raise OSError(f"no free job id in {parent}")


def socket_path(directory: str) -> str | None:
    """The control socket's path, or None where it would not fit in a socket address."""
    path = os.path.join(directory, SOCKET)
    return path if len(os.fsencode(path)) <= MAX_SOCKET_PATH else None


def write(directory: str, record: Mapping[str, Any]) -> None:
    """Replace the record atomically: readers see the old one or the new one, whole."""
    # Compact: with `indent`, json runs its pure-Python encoder (~10x slower than the C one);
    # a 256-instance record is rewritten as the job goes (`poprunctl show` pretty-prints).
    replace_file(directory, RECORD, json.dumps(record, default=str,
                                               separators=(",", ":")).encode())


def replace_file(directory: str, name: str, data: bytes) -> None:
    """`name` in `directory` replaced by `data` atomically (a temporary file renamed over
    it, mode 0600): readers see the old file or the new one, whole."""
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(temporary, os.path.join(directory, name))


def load(directory: str) -> dict[str, Any]:
    """The record in `directory`. Raises FileNotFoundError where there is none (a job
    directory being made, or being removed by a prune), RecordError where it cannot be used:
    not ours, not JSON, not this schema."""
    path = os.path.join(directory, RECORD)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise RecordError(f"cannot read it: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RecordError("not a regular file")
        if info.st_uid != os.getuid():
            raise RecordError(f"owned by another user (uid {info.st_uid})")
        data = os.read(fd, MAX_RECORD + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_RECORD:
        raise RecordError(f"larger than {MAX_RECORD} bytes")
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        found = record.get("schema") if isinstance(record, dict) else type(record).__name__
        raise RecordError(f"not a {SCHEMA} record (schema {found!r})")
    if record.get("id") != os.path.basename(directory):
        raise RecordError("its id is missing or wrong")
    wrong = _wrong_fields(record)
    if wrong:
        raise RecordError(f"damaged: {', '.join(wrong)} of the wrong type")
    record["_dir"] = directory  # where it was read from; never written back
    return record


_NUMBER, _TEXT, _LIST, _MAPPING = (int, float), (str,), (list,), (dict,)
# What the readers here and in ctl.py/reap.py rely on; None is allowed for every key but
# `instances` (a running job's result keys are null until it ends).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "state": _TEXT, "start_time": _NUMBER, "end_time": _NUMBER, "exit_code": (int,),
    "exit_reason": _TEXT, "program": _LIST, "argv": _LIST, "cwd": _TEXT, "hosts": _LIST,
    "num_instances": (int,), "launcher": _MAPPING, "lifeline": _MAPPING,
    "partition": _MAPPING, "control": _TEXT, "caches": _MAPPING, "error_dirs": _MAPPING,
    "pythons": _MAPPING, "agents": _MAPPING, "cgroup": _TEXT, "output_dir": _TEXT, "log": _TEXT,
    "host_differences": _LIST, "quarantined": _LIST}
INSTANCE_TYPES: dict[str, tuple[type, ...]] = {
    "index": (int,), "host": _TEXT, "pid": (int,), "start": (int,), "state": _TEXT,
    "start_time": _NUMBER, "end_time": _NUMBER}


def _wrong_fields(record: Mapping[str, Any]) -> list[str]:
    """The keys whose values the readers could not use (a hand-edited or damaged record)."""
    def wrong(value: Any, types: tuple[type, ...]) -> bool:
        return value is not None and (not isinstance(value, types) or isinstance(value, bool)
                                      and bool not in types)

    found = [key for key, types in FIELD_TYPES.items() if wrong(record.get(key), types)]
    if not isinstance(record.get("instances"), list):
        return [*found, "instances"]
    for i, inst in enumerate(record["instances"]):
        if not isinstance(inst, dict):
            found.append(f"instances[{i}]")
            continue
        found += [f"instances[{i}].{key}" for key, types in INSTANCE_TYPES.items()
                  if wrong(inst.get(key), types)]
    if isinstance(record.get("hosts"), list) and not all(
            isinstance(h, dict) and isinstance(h.get("label"), str) for h in record["hosts"]):
        found.append("hosts[]")
    return found


@dataclass(frozen=True)
class Scan:
    """Every readable record, oldest first, and what could not be read: (path, why)."""

    records: tuple[dict[str, Any], ...]
    problems: tuple[tuple[str, str], ...]


def scan(environ: Mapping[str, str] = os.environ) -> Scan:
    parent = jobs_dir(environ)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return Scan((), ())
    except OSError as exc:
        return Scan((), ((parent, exc.strerror or str(exc)),))
    records, problems = [], []
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith("."):
            continue
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                problems.append((path, "not a job directory"))
                continue
            records.append(load(path))
        except FileNotFoundError:  # removed since the listing (pruned by another poprun), or
            continue  # a job that has not written its first record yet: not a problem
        except RecordError as exc:
            if os.path.exists(path):
                problems.append((path, str(exc)))
    records.sort(key=lambda r: (_number(r.get("start_time")), r["id"]))
    return Scan(tuple(records), tuple(problems))


def find(records: Iterable[Mapping[str, Any]], query: str) -> Mapping[str, Any]:
    """The record whose id is `query`, or starts with it (one only). Raises LookupError."""
    records = list(records)
    exact = [r for r in records if r["id"] == query]
    if exact:
        return exact[0]
    matches = [r for r in records if query and r["id"].startswith(query)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise LookupError(f"job id {query!r} is ambiguous: "
                          f"{', '.join(r['id'] for r in matches)}")
    raise LookupError(f"no job {query!r} (poprunctl list shows them)")


def launcher_status(record: Mapping[str, Any]) -> str:
    """"alive": its launcher still runs; "gone": it died without ending the record (what
    `reap` cleans up after); "elsewhere": it ran on another host (a home directory shared
    between hosts), which cannot be checked from here; "ended": the record is final."""
    if record.get("state") not in ACTIVE:
        return "ended"
    launcher = record.get("launcher") or {}
    if launcher.get("host") != socket.gethostname():
        return "elsewhere"
    if launcher.get("boot_id") and launcher.get("boot_id") != procid.boot_id():
        return "gone"  # this host has rebooted since
    pid, start = launcher.get("pid"), launcher.get("start")
    if isinstance(pid, int) and procid.is_running(pid, start):  # a zombie has died
        return "alive"
    return "gone"


def state_of(record: Mapping[str, Any]) -> str:
    """The state to show: the record's, or "gone" for a job whose launcher died."""
    status = launcher_status(record)
    return "gone" if status == "gone" else str(record.get("state"))


def instance_states(record: Mapping[str, Any]) -> list[str]:
    """Each instance's state, in the record's order, as far as this host can tell. The
    record's own while its launcher runs (it keeps the record true) or once it has ended;
    for a job whose launcher is gone, the record says what was running when it died, so
    it is checked against what is alive: "running" only for an instance on this host whose
    pid still has its recorded start time, "gone" for any other here (its watchdog or reap
    killed it, or the host rebooted), "unknown" for one on another host (only `reap` looks
    there)."""
    instances = record.get("instances") or []
    if launcher_status(record) != "gone":
        return [str(inst.get("state")) for inst in instances]
    hosts = {h.get("label"): h for h in record.get("hosts") or ()}
    here = procid.boot_id()
    states = []
    for inst in instances:
        host = hosts.get(inst.get("host")) or {}
        if inst.get("state") not in ("running", "starting"):
            states.append(str(inst.get("state")))
        elif not host.get("local"):
            states.append("unknown")
        elif host.get("boot_id") in (None, here) and isinstance(inst.get("pid"), int) \
                and procid.is_running(inst["pid"], inst.get("start")):
            states.append("running")
        else:
            states.append("gone")
    return states


def prune(environ: Mapping[str, str] = os.environ, now: float | None = None,
          keep: int = KEEP_ENDED, keep_seconds: float = KEEP_SECONDS,
          keep_logs: int = KEEP_LOGS) -> list[str]:
    """Remove the jobs beyond the bounds (the `keep` most recent, none older than
    `keep_seconds`) and the output logs of all but the `keep_logs` most recent, whatever
    state a job was left in: ended, reaped, or gone (its launcher died without ending the
    record: `reap` has `keep` later jobs' time to clean up after it). Only a job whose
    launcher runs, or may run (on another host sharing this directory, until
    `keep_seconds`), is never touched. Returns the ids removed. Most recent by the record's
    last write; only the records beyond a bound are read, at most `PRUNE_READS` of them
    (every launch runs this, on a thread beside its job: it must stay cheap; the next
    launch goes on). Damaged records are never removed."""
    now = time.time() if now is None else now
    removed, reads = [], 0
    for rank, (mtime, path) in enumerate(_by_recency(environ)):
        expired = now - mtime > keep_seconds
        whole = rank >= keep or expired
        logs = [] if whole or rank < keep_logs else _logs_in(path)
        if not whole and not logs:
            continue
        if reads >= PRUNE_READS:
            break
        reads += 1
        try:
            record = load(path)
        except (RecordError, OSError):
            continue
        status = launcher_status(record)
        if status == "alive" or status == "elsewhere" and not expired:
            continue
        if whole:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(record["id"])
        for name in logs:
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass
    return removed


def _by_recency(environ: Mapping[str, str]) -> list[tuple[float, str]]:
    """(last write, directory) of every job directory, the most recent first."""
    try:
        entries = [e for e in os.scandir(jobs_dir(environ)) if not e.name.startswith(".")]
    except OSError:
        return []
    dated = []
    for entry in entries:
        try:
            dated.append((os.stat(os.path.join(entry.path, RECORD)).st_mtime, entry.path))
        except OSError:
            continue
    return sorted(dated, reverse=True)


def _logs_in(path: str) -> list[str]:
    # A stat, not a listing: every launch ends with this, for ~KEEP_ENDED directories.
    return [OUTPUT] if os.path.exists(os.path.join(path, OUTPUT)) else []


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0
