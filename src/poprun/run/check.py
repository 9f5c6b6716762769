"""`poprun --check`: every host checked in parallel, nothing started, two tables.

For each host, opened as a launch opens it (run/fleet.py: over SSH or as a Slurm job step, its
agent brought where poprun is missing): reachable and authenticated (host key known), the
agent started, its Python and poprun versions against the launcher's, the working directory
present, the program found (when one is given), its NUMA nodes and CPUs. Failures are folded by
kind under the table ("permission denied: h[3,7-9]") so a 64-host pod's problems read in a few
lines. The second table is what the job depends on there (run/hostcheck.py: the instances'
Python, its distributions, the file the job runs, the SDK, free space, the clock), and under
it what differs among the hosts (plan/alike.py), as a launch would warn of it.

The exit status tells a script what to do next (`check_status`): READY, DIFFERENT,
UNREACHABLE (may pass on a retry) or CANNOT_RUN (a host must be fixed first).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from spawner.bootstrap import AgentNotInstalledError
from spawner.local import resolve_program
from spawner.remote import AgentVersionError, RemoteError
from spawner.ssh import FailureKind, HostFailure

from poprun._version import __version__
from poprun.plan.config import LaunchConfig
from poprun.errors import ConfigError, LaunchError
from poprun.plan import alike
from poprun.plan.jobhosts import JobHosts, transport_of
from poprun.plan.network import pick_or_fail
from poprun.plan.planner import cache_mode, explicit_cache
from poprun.run import hostcheck
from poprun.text import fold_hosts, size
from poprun.plan.topology import Topology, agent_topology, local_topology

OK = "ok"
REACH_TIMEOUT = 5.0  # seconds a host has to connect back and read the token
# --check's exit statuses, the worst found (a script retries, or fixes a host first).
READY = 0  # every host ready, and alike
DIFFERENT = 10  # every host ready, but they differ in what the job depends on
UNREACHABLE = 20  # a host unreachable, or timed out: may pass on a retry
CANNOT_RUN = 30  # a host that cannot run the job: no such Python, program or directory...
# Connection failures that may pass on a retry; the others (keys, login) need a fix.
_TRANSIENT = frozenset({FailureKind.TIMEOUT, FailureKind.CONNECTION_REFUSED,
                        FailureKind.CONNECTION_CLOSED, FailureKind.NAME_NOT_RESOLVED,
                        FailureKind.OTHER})


@dataclass
class HostCheck:
    host: str
    ssh: str = "-"
    python: str = "-"
    poprun: str = "-"
    cwd: str = "-"
    program: str = "-"
    numa: str = "-"
    reach: str = "-"  # whether instances there reach this machine back (the job's endpoints)
    problem: str | None = None  # the kind of the first failure, for the folded summary
    detail: str | None = None  # one line naming the host, when the table cannot say it
    # The launcher's variables a remote instance would lack or see with another value (not
    # a failure: said under the table so that a missing variable is no surprise).
    env_differences: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    retry: bool = False  # its problem may pass on a retry (UNREACHABLE), else CANNOT_RUN
    facts: alike.HostFacts | None = None  # what the job depends on there
    clock: float | None = None  # seconds its clock is ahead of this machine's


async def check_hosts(config: LaunchConfig, environ: Mapping[str, str], cwd: str,
                      program: str | None) -> tuple[CheckReport, int]:
    """The report and the exit status (`check_status`). `program`: the program's name,
    None when none was given (config.program is then a stand-in)."""
    if transport_of(config, environ) == "pod":  # the other pods' agents call a leader only
        raise ConfigError("--check does not run in pod mode: the other pods join a job's "
                          "leader, not a check (run the job; -v says what each pod read)")
    hosts = JobHosts.of(config, environ)
    local = [label for label in hosts.labels if label not in hosts.remote]
    argv = config.program if program else ()
    if program and config.container_spec is not None:  # the image has the program
        program = config.container_spec.program
    cache = explicit_cache(config, cache_mode(config, environ))
    here = hostcheck.gather_here(config, environ, argv, cwd, cache) if local else None
    checks = [_check_here(label, config, cwd, program, environ) for label in local]
    answers: dict[str, hostcheck.Answer] = {}
    if hosts.remote:
        ask = hostcheck.ask(config, environ, argv, cwd, cache)
        remote, answers = await _check_remote(hosts, config, cwd, program, environ, ask)
        checks += remote
    order = {label: i for i, label in enumerate(hosts.labels)}
    checks.sort(key=lambda c: order[c.host])
    facts, offsets = hostcheck.read_all(config, environ, hosts.labels, local, here, answers)
    for check in checks:
        check.facts, check.clock = facts.get(check.host), offsets.get(check.host)
    differences = () if config.compare_hosts == "off" else \
        alike.compare(facts, offsets, local)
    report = CheckReport(tuple(checks), differences)
    return report, check_status(report)


def check_status(report: CheckReport) -> int:
    """The worst of: a host that cannot run the job, one unreachable, hosts that differ."""
    problems = [c for c in report.checks if c.problem]
    if any(not c.retry for c in problems):
        return CANNOT_RUN
    if problems:
        return UNREACHABLE
    return DIFFERENT if report.differences else READY


def _check_here(label: str, config: LaunchConfig, cwd: str, program: str | None,
                environ: Mapping[str, str]) -> HostCheck:
    check = HostCheck(label, ssh="local", python=_python(sys.version_info),
                      poprun=__version__, cwd=OK if os.path.isdir(cwd) else "missing")
    if program:
        found = resolve_program(program, environ.get("PATH"), cwd)
        check.program = OK if found else "not found"
    check.numa = _numa(local_topology())
    if config.network.chosen:
        from spawner.netifs import interfaces

        _check_network(check, config, interfaces())
    _note_problem(check)
    return check


def _check_network(check: HostCheck, config: LaunchConfig, interfaces) -> None:
    """With a chosen network: the host has an interface on it (as the launch requires)."""
    if not config.network.chosen:
        return
    try:
        pick_or_fail(config.network.control, check.host, interfaces or {})
        pick_or_fail(config.network.data, check.host, interfaces or {})
    except ConfigError as exc:
        check.reach, check.problem, check.detail = "no", "not on the chosen network", str(exc)


async def _check_remote(hosts: JobHosts, config: LaunchConfig, cwd: str, program: str | None,
                        environ: Mapping[str, str], facts: dict
                        ) -> tuple[list[HostCheck], dict[str, hostcheck.Answer]]:
    """Each remote host opened as a launch opens it (run/fleet.py: the same transport, agent
    bootstrap and --remote-install), one row each whatever the others do; and the facts of
    each host whose agent started (`facts`: FACTS' fields)."""
    from poprun.log import Log
    from poprun.run.fleet import Fleet

    fleet = Fleet.of(hosts, config, Log(config.verbose))
    try:
        outcomes = await fleet.open_each(_NoEvents(), cwd=cwd, program=program,
                                         path=environ.get("PATH"), facts=facts)
        reached = OK if fleet.transport == "ssh" else "srun"  # a Slurm job step, not SSH
        checks = [_check_outcome(label, outcome, reached, config, program, environ)
                  for label, outcome in outcomes.items()]
        await _check_reach_back(fleet, config, checks)
        started = {label: fleet.spawners[label] for label, o in outcomes.items()
                   if not isinstance(o, (HostFailure, BaseException))}
        answers = await hostcheck.answers(started)
    finally:
        await fleet.close()
    return checks, answers


async def _check_reach_back(fleet, config: LaunchConfig, checks: list[HostCheck]) -> None:
    """Each host whose agent answered connects to this machine at the job's address (on
    the chosen network, if any) and reads a token back: a rendezvous that cannot happen is
    found before anything starts."""
    import asyncio
    import secrets

    ready = [c for c in checks if c.problem is None and c.host in fleet.spawners]
    if not ready:
        return
    address = fleet.reach_back_address()
    token = secrets.token_hex(8)

    async def echo(reader, writer) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(echo, address, 0)
    except OSError as exc:
        raise LaunchError(f"cannot listen on {address} to check the hosts reach it: "
                          f"{exc.strerror or exc}") from None
    port = server.sockets[0].getsockname()[1]
    try:
        answers = await asyncio.gather(
            *(fleet.spawners[c.host].probe(address, port, token, REACH_TIMEOUT)
              for c in ready), return_exceptions=True)
    finally:
        server.close()
    for check, answer in zip(ready, answers):
        if isinstance(answer, dict) and answer.get("ok"):
            check.reach = OK
            continue
        error = answer.get("error") if isinstance(answer, dict) else str(answer)
        check.reach, check.problem = "no", "cannot reach this machine back"
        check.detail = (f"{check.host}: cannot connect to {address}:{port}, where its "
                        f"instances would find the job ({error})")


def _check_outcome(label: str, outcome: object, reached: str, config: LaunchConfig,
                   program: str | None, environ: Mapping[str, str]) -> HostCheck:
    """One remote host's row from what opening it gave: its agent's answer, or why none."""
    if isinstance(outcome, HostFailure):
        return HostCheck(label, ssh=outcome.kind.value,
                         problem=outcome.kind.value.replace("_", " "), detail=outcome.message,
                         retry=outcome.kind in _TRANSIENT)
    check = HostCheck(label, ssh=reached)
    for kind, problem, retry in _AGENT_PROBLEMS:
        if isinstance(outcome, kind):
            check.problem, check.detail, check.retry = problem, str(outcome), retry
            return check
    if isinstance(outcome, BaseException):
        raise outcome  # not a host's problem: a bug, reported as one
    info = outcome
    check.python, check.poprun = _python(info.python), info.poprun
    check.cwd = OK if info.cwd_exists else "missing"
    if program:
        check.program = OK if info.program else "not found"
    check.numa = _numa(_remote_topology(info.raw))
    _check_network(check, config, info.raw.get("interfaces"))
    there = info.raw.get("environ")
    if isinstance(there, dict):
        from poprun.plan.planner import remote_differences

        missing, different = remote_differences(config, environ, there)
        check.env_differences = (tuple(missing), tuple(different))
    _note_problem(check)
    return check


# An agent that did not start, by why (the first class that matches), for the folded summary,
# and whether a retry may pass (an agent that did not answer in time, or was lost).
_AGENT_PROBLEMS = ((AgentVersionError, "different Python or poprun", False),
                   (AgentNotInstalledError, "poprun not installed", False),
                   (RemoteError, "agent did not start", True))


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

_COLUMNS = ("host", "ssh", "python", "poprun", "cwd", "program", "numa", "reach")


@dataclass(frozen=True)
class CheckReport:
    """The table and the folded problems: plain text (`str()`), or rich's table on a
    terminal (`for_console`)."""

    checks: tuple[HostCheck, ...]
    differences: tuple[alike.Difference, ...] = ()

    def __str__(self) -> str:
        return render(list(self.checks), self.differences)

    def for_console(self, stream, environ: Mapping[str, str]) -> str:
        """The report for the text stream `stream` (poprun's stdout): a rich table where rich
        would style it (a terminal, by its rules read from `environ`), else `str(self)`."""
        from poprun.view.console import rich_console

        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a test's StringIO)
            return str(self)
        console = rich_console(fd, environ)
        return str(self) if console is None else render_rich(list(self.checks),
                                                             self.differences, console)


def render(checks: list[HostCheck], differences: tuple[alike.Difference, ...] = ()) -> str:
    lines = _plain_table([h.upper() for h in _COLUMNS],
                         [[str(getattr(c, col)) for col in _COLUMNS] for c in checks])
    lines += [line for _, line in _footer(checks)]
    lines += ["", *_plain_table(list(_JOB_COLUMNS), [_job_row(c) for c in checks])]
    lines += [line for _, line in _differences(checks, differences)]
    lines.append(_count(checks)[1])
    return "\n".join(lines) + "\n"


def _plain_table(header: list[str], rows: list[list[str]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def render_rich(checks: list[HostCheck], differences: tuple[alike.Difference, ...],
                console) -> str:
    """The same report as rich Tables rendered for `console`: passes green, failures red.
    Every cell and line is rich Text (host names and remote messages are never markup)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for column in _COLUMNS:
        table.add_column(column.upper(), no_wrap=column == "host")
    for c in checks:
        cells = [str(getattr(c, col)) for col in _COLUMNS]
        style = "red" if c.problem else ""
        table.add_row(Text(cells[0], style=style),
                      *(Text(cell, style=_cell_style(col, cell))
                        for col, cell in zip(_COLUMNS[1:], cells[1:])))
    job = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for column in _JOB_COLUMNS:
        job.add_column(column, no_wrap=column == "HOST")
    for c in checks:
        job.add_row(*(Text(cell) for cell in _job_row(c)))
    with console.capture() as capture:
        console.print(table)
        for kind, line in _footer(checks):
            console.print(Text(line, style=_FOOTER_STYLES[kind]), soft_wrap=True)
        console.print(job)
        for kind, line in [*_differences(checks, differences), _count(checks)]:
            console.print(Text(line, style=_FOOTER_STYLES[kind]), soft_wrap=True)
    return capture.get()


# What the job depends on, per host (run/hostcheck.py): the instances' Python, how many
# distributions it has, the file the job runs (its digest's start), the Poplar SDK, the
# least free space of the cache's and temp files' places, the clock's offset.
_JOB_COLUMNS = ("HOST", "INSTANCES' PYTHON", "DISTRIBUTIONS", "RUNS", "SDK", "FREE", "CLOCK")


def _job_row(check: HostCheck) -> list[str]:
    f = check.facts
    if f is None:
        return [check.host, *["-"] * (len(_JOB_COLUMNS) - 1)]
    entry = f.entry
    runs = "-" if entry is None else f"{entry.name} " + (
        "missing" if entry.path is None else (entry.sha256 or "")[:12] or f"{entry.size} B")
    free = min((free for _, free in f.space), default=None)
    return [check.host, f.python or "none",
            "-" if f.distributions is None else str(len(f.distributions)), runs, f.sdk,
            "-" if free is None else size(free),
            "-" if check.clock is None else f"{check.clock * 1000:+.0f} ms"]


def _differences(checks: list[HostCheck], differences: tuple[alike.Difference, ...]
                 ) -> list[tuple[str, str]]:
    """Under the second table: what differs among the hosts (every difference), or that
    they are alike (said of two hosts or more that told)."""
    if not differences:
        told = sum(c.facts is not None for c in checks)
        return [("ready", "the hosts are alike in what the job depends on")] \
            if told > 1 else []
    return [("env", f"{len(differences)} difference(s) among the hosts:"),
            *(("env", f"  {line}") for line in alike.render(differences, len(differences)))]


def _cell_style(column: str, cell: str) -> str:
    if cell in (OK, "local", "srun"):
        return "green"
    if cell == "-":  # not checked (not asked for, or an earlier check failed)
        return "dim"
    if column in ("ssh", "cwd", "program", "reach"):  # a failure's kind, missing, not found
        return "red"
    return "yellow" if cell == "unknown" else ""  # versions, the NUMA summary


_FOOTER_STYLES = {"detail": "", "env": "yellow", "problem": "red", "ready": "bold green",
                  "not ready": "bold red"}


def _env_lines(checks: list[HostCheck]) -> list[str]:
    """Per group of hosts with the same differences: the variables their instances would
    lack, or see with another value, compared with poprun's environment here."""
    by_differences: dict[tuple, list[str]] = {}
    for c in checks:
        if any(c.env_differences):
            by_differences.setdefault(c.env_differences, []).append(c.host)
    lines = []
    for (missing, different), hosts in by_differences.items():
        parts = ([f"missing there: {', '.join(missing)}"] if missing else []) + (
            [f"other value there: {', '.join(different)}"] if different else [])
        lines.append(f"{fold_hosts(hosts)}: {len(missing) + len(different)} variable(s) of "
                     f"this environment differ in instances there ({'; '.join(parts)}); "
                     "forward them with -x NAME, -x 'PATTERN*' or --forward-env all")
    return lines


def _footer(checks: list[HostCheck]) -> list[tuple[str, str]]:
    """Under the table: each failure's detail, the hosts folded by problem, the count."""
    by_problem: dict[str, list[str]] = {}
    for c in checks:
        if c.problem:
            by_problem.setdefault(c.problem, []).append(c.host)
    lines = [("detail", c.detail) for c in checks if c.detail]
    lines += [("env", line) for line in _env_lines(checks)]
    lines += [("problem", f"{problem}: {fold_hosts(names)}")
              for problem, names in by_problem.items()]
    return lines


def _count(checks: list[HostCheck]) -> tuple[str, str]:
    """The report's last line: how many hosts are ready."""
    ready = sum(c.problem is None for c in checks)
    return ("ready" if ready == len(checks) else "not ready",
            f"{ready} of {len(checks)} host(s) ready")
