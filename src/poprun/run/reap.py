"""`poprunctl reap`: clean up after jobs whose launcher died without doing it.

That is a job whose record still says it runs while its launcher (pid and start time) is gone
from this host: its host rebooted, poprun and its lifeline were both SIGKILLed, a remote host
really died and came back; or a job that ended here having declared hosts lost, for those
hosts only (what its agents started there may have outlived them: `lost_hosts`). For each
such job, host by host:

- this host: the leftover instances (pid *and* start time must match the record: never a
  recycled pid), every process still carrying the job's lifeline mark, its cgroups, its
  temporary directories (`poprun-cache-*`, `poprun-errors-*`);
- every other recorded host, over SSH (the user's ~/.ssh/config and keys, as a launch):
  the same for what each agent the job had there made (its instances, their mark and cgroups,
  its error dir: the agent's HELLO named them, `agents` in the record) and the temporary
  caches, by spawner/reaphere.py run there on the host's Python (arguments as base64 JSON:
  nothing is pasted into a shell);
- the V-IPU partition, when poprun created it (and --remove-partition allowed removing it);

then the record is marked ended (`exit_reason` "reaped", with what was done) — but only when
every host answered and the partition (if any) is gone: otherwise the record keeps its state,
with this attempt noted (`last_reap`), so a later `reap`, once the host is back, finishes the
job. `dry_run` only says what would be done.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spawner import reaphere

from poprun.jobctl import records as jobs

SSH_TIMEOUT = 10.0
REMOTE_TIMEOUT = 30.0


@dataclass
class HostReport:
    """What was done (or found) on one host: reaphere's entries, or why nothing could be."""

    host: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "entries": self.entries, "error": self.error}


@dataclass
class JobReport:
    id: str
    hosts: list[HostReport]
    partition: str | None = None  # what became of it, in words
    partition_left: bool = False  # poprun created it and it could not be removed
    dry_run: bool = False

    @property
    def complete(self) -> bool:
        """Nothing is left that another reap could still clean up."""
        return not self.partition_left and all(h.error is None for h in self.hosts)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "dry_run": self.dry_run, "partition": self.partition,
                "complete": self.complete, "hosts": [h.to_json() for h in self.hosts]}


def orphans(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The jobs to reap: their launcher is gone from this host, their record not ended; or
    it ended here having lost hosts that no reap has finished with yet."""
    return [r for r in records if jobs.launcher_status(r) == "gone" or lost_hosts(r)]


def lost_hosts(record: Mapping[str, Any]) -> list[str]:
    """The hosts a job that ended here declared lost, until a reap has finished with them.
    What their agents started may still run there: a host frozen whole, a watchdog that
    could not act; their instances are in the record as `lost`, with pid and
    start, and their caches as the others'."""
    if (jobs.launcher_status(record) != "ended" or record.get("reaped")
            or (record.get("launcher") or {}).get("host") != socket.gethostname()):
        return []
    return sorted({inst["host"] for inst in record.get("instances") or ()
                   if inst.get("lost") and isinstance(inst.get("host"), str)})


def parts_to_reap(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """host_parts: of every host, or of its lost hosts only for a job that ended."""
    parts, lost = host_parts(record), lost_hosts(record)
    return {label: part for label, part in parts.items() if label in lost} if lost else parts


def host_parts(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per host label, reaphere's input: its instances, temporary dirs, the marks its
    processes carry, its cgroup trees and boot id. This host's mark and cgroups are the
    launcher's lifeline's; another host's, those of every agent the job had there."""
    parts: dict[str, dict[str, Any]] = {}
    for host in record.get("hosts") or ():
        parts[host["label"]] = {"boot_id": host.get("boot_id"), "instances": [], "dirs": [],
                                "marks": [], "cgroups": [], "local": bool(host.get("local"))}
    token = (record.get("lifeline") or {}).get("token")
    for part in parts.values():
        if part["local"]:
            _add_leaves(part, {"mark": token, "cgroup": record.get("cgroup")})
    for label, agents in (record.get("agents") or {}).items():
        for leaves in agents if label in parts and isinstance(agents, list) else ():
            _add_leaves(parts[label], leaves)
    for inst in record.get("instances") or ():
        label = inst.get("host")
        if label in parts and isinstance(inst.get("pid"), int) and inst.get("state") in (
                "running", "starting", "lost", None):
            parts[label]["instances"].append([inst["index"], inst["pid"], inst.get("start")])
    for key in ("caches", "error_dirs"):
        for label, path in (record.get(key) or {}).items():
            if label in parts and isinstance(path, str):
                parts[label]["dirs"].append(path)
    for label, names in (record.get("mpi_worlds") or {}).items():
        if label in parts and isinstance(names, list):
            parts[label]["kvsnames"] = [n for n in names if isinstance(n, str)]
    return parts


def _add_leaves(part: dict[str, Any], leaves: Any) -> None:
    """One lifeline's leftovers (spawner.local.LocalSpawner.leaves) into a host's part."""
    if not isinstance(leaves, dict):
        return
    for key, into in (("mark", "marks"), ("cgroup", "cgroups"), ("error_dir", "dirs")):
        if isinstance(leaves.get(key), str) and leaves[key] and leaves[key] not in part[into]:
            part[into].append(leaves[key])


async def reap(record: Mapping[str, Any], dry_run: bool = False,
               environ: Mapping[str, str] = os.environ) -> JobReport:
    parts = parts_to_reap(record)
    local = {label: part for label, part in parts.items() if part["local"]}
    remote = {label: part for label, part in parts.items() if not part["local"]}
    reports = [_reap_local(label, part, dry_run) for label, part in local.items()]
    if remote:
        reports += await _reap_remote(record, remote, dry_run)
    report = JobReport(record["id"], reports, dry_run=dry_run)
    report.partition, report.partition_left = await _release_partition(record, dry_run,
                                                                       environ)
    if not dry_run:
        _write_outcome(record, report)
    return report


def _reap_local(label: str, part: dict[str, Any], dry_run: bool) -> HostReport:
    return HostReport(label, reaphere.reap_here({**part, "dry_run": dry_run}))


REMOTE_MODULES = ("procid.py", "containment.py", "reaphere.py")  # standard library only


def remote_script() -> str:
    """spawner/reaphere.py and the modules it imports as one `python -c` program for any
    shell: their sources one after the other (their imports of each other dropped), under
    one `from __future__` line (it must come first; their annotations need it on 3.10)."""
    from spawner.bootstrap import _one_line

    here = Path(reaphere.__file__).parent
    source = ["from __future__ import annotations"]
    for name in REMOTE_MODULES:
        source += [line for line in (here / name).read_text().splitlines()
                   if line != "from __future__ import annotations"
                   and not line.startswith("from .")]
    source.append("import sys")
    source.append("sys.exit(main(sys.argv[1:]))")
    return _one_line("\n".join(source) + "\n")


async def _reap_remote(record: Mapping[str, Any], parts: dict[str, dict[str, Any]],
                       dry_run: bool) -> list[HostReport]:
    from spawner.ssh import close_all

    from poprun.plan.hosts import parse_host_list
    from poprun.run.fleet import connect

    targets = {}
    reports = {label: HostReport(label) for label in parts}
    for label in parts:
        try:
            targets[label] = parse_host_list(label)[0]
        except Exception as exc:  # noqa: BLE001 - a label from a damaged record
            reports[label].error = f"cannot read the host name: {exc}"
    # Over SSH whatever the job's transport: reaphere runs as a plain remote command, and a
    # dead launcher's Slurm allocation has usually ended with it.
    results = await connect(list(targets.values()), timeout=SSH_TIMEOUT, keep_going=True)
    try:
        by_label = {label: results.outcomes.get(host) for label, host in targets.items()}

        async def one(label: str, conn) -> None:
            report = reports[label]
            if conn is None or not hasattr(conn, "run"):
                report.error = getattr(conn, "message", None) or "not reachable"
                return
            payload = base64.b64encode(json.dumps({**parts[label], "dry_run": dry_run})
                                       .encode()).decode()
            python = (record.get("pythons") or {}).get(label) or "python3"
            command = "exec " + shlex.join([python, "-c", remote_script(), payload])
            try:
                async with asyncio.timeout(REMOTE_TIMEOUT):  # not wait_for: spawner/within.py
                    done = await conn.run(command, check=False, encoding=None)
            except (asyncio.TimeoutError, OSError) as exc:
                report.error = f"no answer: {exc or 'timed out'}"
                return
            if done.exit_status != 0:
                err = (done.stderr or b"").decode(errors="replace").strip().splitlines()
                report.error = err[-1] if err else f"exit status {done.exit_status}"
                return
            try:
                report.entries = json.loads(done.stdout.decode())
            except ValueError:
                report.error = "its answer is not JSON"

        await asyncio.gather(*(one(label, conn) for label, conn in by_label.items()))
    finally:
        await close_all(results.connections.values())
    return [reports[label] for label in parts]


async def _release_partition(record: Mapping[str, Any], dry_run: bool,
                             environ: Mapping[str, str]) -> tuple[str | None, bool]:
    """What became of the partition poprun created (in words), and whether it is left."""
    if jobs.launcher_status(record) == "ended":  # a lost host's reap: it released it
        return None, False
    found = record.get("partition")
    if not isinstance(found, dict) or not found.get("created"):
        return None, False
    name = found.get("name")
    if not found.get("remove"):
        return f"{name}: kept (--remove-partition=no)", False
    if dry_run:
        return f"{name}: would remove it (poprun created it)", False
    from poprun.log import Log
    from poprun.run.vipu import Partition, PartitionInfo, release

    partition = Partition(name=name, host=found.get("host"), port=found.get("port"),
                          timeout=float(found.get("timeout") or 30), info=PartitionInfo(name),
                          created=True, remove_on_release=True, target_options="",
                          executable=found.get("executable") or "vipu")
    removed = await release(partition, Log(0), environ)
    if removed:
        return f"{name}: removed", False
    return f"{name}: could not remove it (see above); reap again", True


def _write_outcome(record: Mapping[str, Any], report: JobReport) -> None:
    """A complete reap ends the record; a partial one only notes itself in it (the job
    stays `gone`, for the next reap)."""
    if lost_hosts(record):
        _write_lost_outcome(record, report)
        return
    final = {k: v for k, v in record.items() if not k.startswith("_")}
    if report.complete:
        final.update(state=jobs.ENDED, exit_reason="reaped", reaped=report.to_json())
        for inst in final.get("instances") or ():
            if inst.get("state") in ("running", "starting"):
                inst["state"] = "reaped"
        final["end_time"] = final.get("end_time") or time.time()
    else:
        final["last_reap"] = {**report.to_json(), "time": time.time()}
    try:
        jobs.write(record["_dir"], final)
        if report.complete:  # its launcher died with it bound: nothing serves it
            os.unlink(os.path.join(record["_dir"], jobs.SOCKET))
    except OSError:
        pass


def _write_lost_outcome(record: Mapping[str, Any], report: JobReport) -> None:
    """A job that ended having lost hosts keeps how it ended; a complete reap of those hosts
    is noted (`reaped`), so the next reap passes it by; a partial one as `last_reap`."""
    final = {k: v for k, v in record.items() if not k.startswith("_")}
    final["reaped" if report.complete else "last_reap"] = {**report.to_json(),
                                                           "time": time.time()}
    try:
        jobs.write(record["_dir"], final)
    except OSError:
        pass


def render(report: JobReport, record: Mapping[str, Any]) -> str:
    """Host by host, what was done: for the terminal."""
    launcher = record.get("launcher") or {}
    lost = lost_hosts(record)
    why = (f"it ended having lost {', '.join(lost)}" if lost else
           f"its launcher (pid {launcher.get('pid')} on {launcher.get('host')}) is gone")
    lines = [f"job {report.id} ({' '.join(record.get('program') or [])[:60]}): {why}"
             + (" — dry run, nothing done" if report.dry_run else "")]
    for host in report.hosts:
        if host.error:
            lines.append(f"  {host.host}: nothing done: {host.error}")
            continue
        if not host.entries:
            lines.append(f"  {host.host}: nothing recorded there")
        for entry in host.entries:
            if entry["what"] == "instance":
                lines.append(f"  {host.host}: instance {entry['index']} (pid {entry['pid']}): "
                             f"{entry['note']}")
            elif entry["what"] == "dir":
                lines.append(f"  {host.host}: {entry['path']}: {entry['note']}")
            else:
                lines.append(f"  {host.host}: {entry['note']}")
    if report.partition:
        lines.append(f"  partition {report.partition}")
    if not report.dry_run and not report.complete:
        lines.append("  not finished: the record is kept; run poprunctl reap again once the "
                     "host(s) above can be reached")
    return "\n".join(lines) + "\n"
