"""`poprun --check`: every host checked in parallel, nothing started, one table.

For each host: reachable and authenticated (host key known), its Python and poprun versions
against the launcher's, the working directory present, the program found (when one is given),
its NUMA nodes and CPUs. Failures are folded by kind under the table ("permission denied:
h[3,7-9]") so a 64-host pod's problems read in a few lines.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from spawner.local import resolve_program
from spawner.remote import AgentVersionError, RemoteError, RemoteSpawner
from spawner.ssh import connect_each

from ._version import __version__
from .config import LaunchConfig
from .errors import ConfigError
from .launcher import JobHosts
from .render import fold_indices
from .topology import Topology, agent_topology, local_topology

OK = "ok"


@dataclass
class HostCheck:
    host: str
    ssh: str = "-"
    python: str = "-"
    poprun: str = "-"
    cwd: str = "-"
    program: str = "-"
    numa: str = "-"
    problem: str | None = None  # the kind of the first failure, for the folded summary
    detail: str | None = None  # one line naming the host, when the table cannot say it


async def check_hosts(config: LaunchConfig, environ: Mapping[str, str], cwd: str,
                      program: str | None) -> tuple[str, bool]:
    """The report and whether every host passed."""
    hosts = JobHosts.of(config, environ)
    checks = [_check_here(label, cwd, program, environ)
              for label in hosts.labels if label not in hosts.remote]
    remote = [h for h in hosts.hosts if str(h) in hosts.remote]
    if remote:
        checks += await _check_remote(remote, config, cwd, program, environ)
    order = {label: i for i, label in enumerate(hosts.labels)}
    checks.sort(key=lambda c: order[c.host])
    return render(checks), all(c.problem is None for c in checks)


def _check_here(label: str, cwd: str, program: str | None,
                environ: Mapping[str, str]) -> HostCheck:
    check = HostCheck(label, ssh="local", python=_python(sys.version_info),
                      poprun=__version__, cwd=OK if os.path.isdir(cwd) else "missing")
    if program:
        found = resolve_program(program, environ.get("PATH"), cwd)
        check.program = OK if found else "not found"
    check.numa = _numa(local_topology())
    _note_problem(check)
    return check


async def _check_remote(remote, config: LaunchConfig, cwd: str, program: str | None,
                        environ: Mapping[str, str]) -> list[HostCheck]:
    results = await connect_each(remote, fanout=config.ssh_fanout, timeout=config.ssh_timeout)
    checks = []
    for failure in results.failures:
        checks.append(HostCheck(str(failure.target), ssh=failure.kind.value,
                                problem=failure.kind.value.replace("_", " "),
                                detail=failure.message))
    for target in results.not_attempted:
        checks.append(HostCheck(str(target), ssh="not tried", problem="not tried"))
    try:
        checks += await asyncio.gather(*(
            _check_agent(conn, str(target), config, cwd, program, environ)
            for target, conn in results.connections.items()))
    finally:
        for conn in results.connections.values():
            conn.close()
    return checks


async def _check_agent(conn, label: str, config: LaunchConfig, cwd: str, program: str | None,
                       environ: Mapping[str, str]) -> HostCheck:
    check = HostCheck(label, ssh=OK)
    spawner = RemoteSpawner(conn, label, _NoEvents(), python=config.remote_python)
    try:
        info = await spawner.start(cwd=cwd, program=program, path=environ.get("PATH"))
    except AgentVersionError as exc:
        check.problem, check.detail = "different Python or poprun", str(exc)
        return check
    except RemoteError as exc:
        check.problem, check.detail = "agent did not start", str(exc)
        return check
    finally:
        await spawner.close()
    check.python, check.poprun = _python(info.python), info.poprun
    check.cwd = OK if info.cwd_exists else "missing"
    if program:
        check.program = OK if info.program else "not found"
    check.numa = _numa(_remote_topology(info.raw))
    _note_problem(check)
    return check


def _remote_topology(raw: Mapping) -> Topology | None:
    try:
        return agent_topology(raw)
    except ConfigError:  # shown as unknown in the table, not a crash
        return None


def _note_problem(check: HostCheck) -> None:
    if check.cwd != OK:
        check.problem = "working directory missing"
    elif check.program not in (OK, "-"):
        check.problem = "program not found"


def _python(version) -> str:
    return ".".join(str(v) for v in tuple(version)[:3])


def _numa(topology: Topology | None) -> str:
    if topology is None:
        return "unknown"
    return f"{len(topology.nodes)} node(s), {len(topology.cpus)} CPUs"


class _NoEvents:
    """The check starts no instance, so no output or exit ever arrives."""

    def on_output(self, key, stream, data) -> None: ...

    def on_exit(self, key, returncode) -> None: ...


# --- the report ---------------------------------------------------------------------------

_COLUMNS = ("host", "ssh", "python", "poprun", "cwd", "program", "numa")


def render(checks: list[HostCheck]) -> str:
    rows = [[h.upper() for h in _COLUMNS]]
    rows += [[str(getattr(c, col)) for col in _COLUMNS] for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    by_problem: dict[str, list[str]] = {}
    for c in checks:
        if c.problem:
            by_problem.setdefault(c.problem, []).append(c.host)
    lines += [c.detail for c in checks if c.detail]
    lines += [f"{problem}: {fold_hosts(names)}" for problem, names in by_problem.items()]
    lines.append(f"{len(checks) - sum(map(len, by_problem.values()))} of {len(checks)} "
                 "host(s) ready")
    return "\n".join(lines) + "\n"


def fold_hosts(names: list[str]) -> str:
    """["h3", "h7", "h8", "h9", "x"] -> "h[3,7-9],x": names sharing a prefix and ending in
    numbers without leading zeros fold into one range list."""
    groups: dict[str, list[int]] = {}
    rest = []
    for name in names:
        match = re.fullmatch(r"(.*?)([1-9]\d*|0)", name)
        if match:
            groups.setdefault(match[1], []).append(int(match[2]))
        else:
            rest.append(name)
    parts = [f"{p}{n[0]}" if len(n) == 1 else f"{p}{fold_indices(n)}" for p, n in groups.items()]
    return ",".join(parts + rest)
