"""The live terminal dashboard: a panel kept at the bottom of stderr while the
instances' output scrolls above it.

Three layers, so that each can be tested alone:
- `DashboardState`: a pure model fed by the launcher's events; no I/O, and times are passed in.
- `panel_lines()`: the model as rich `Text` lines for a given width and height. Child output
  enters only as `Text` built from plain strings with control characters made visible, so it is
  never markup and can never move the cursor.
- `Dashboard`: the terminal driver. Instance output never goes through rich
  (docs/architecture.md, "Measured reasons": ~140 µs per line there against ~0.25 µs as
  bytes): `emit()` writes the raw bytes after the erase sequence and puts back the panel as
  last rendered, as bytes. Only `tick()` renders, at most every REFRESH seconds.

Nothing here imports rich at module level: `wants_dashboard()` is asked on every run, and only
runs that get a dashboard should pay for importing rich (~40-70 ms).
"""

from __future__ import annotations

import enum
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from spawner.procstat import ProcSampler, Usage

from poprun.events import BAD, InstanceRow, InstanceRows, InstanceState, JobObserver
from poprun.fdio import write_all
from poprun.progress import progress_line
from poprun.text import cut, duration, fold_indices, percent, size, visible

REFRESH = 0.25  # seconds between renders: "a few times per second"
IDLE_REFRESH = 1.0  # with nothing new, the clocks in the panel still move once a second
USAGE_EVERY = 1.0  # seconds between /proc samples of local instances
FOLD_ABOVE = 32  # more instances than this: one row per host
QUIET_LISTED = 3  # the quietest instances named in a folded host row
HOST_WIDTH = 24  # longer host names are cut in the table (the header has them in full)

HIDE_CURSOR = b"\x1b[?25l"
SHOW_CURSOR = b"\x1b[?25h"
_ERASE_BELOW = b"\x1b[J"
_ERASE_LINE = b"\x1b[2K"
_UP = b"\x1b[A"
_DOWN = b"\x1b[B"
_NEWLINE = b"\r\n"  # not bare \n: correct even when a child has put the tty in raw mode
_SGR = re.compile(r"\x1b\[[0-9;]*m")


# --- the model ----------------------------------------------------------------------------

class JobState(str, enum.Enum):
    """What the job as a whole is doing."""

    LAUNCHING = "launching"
    """Hosts connecting, agents starting, instances being started."""
    RUNNING = "running"
    """Every instance has started; none has failed and no stop was asked for."""
    STOPPING = "stopping…"
    """An instance failed or poprun got a signal: the others are being stopped."""
    FINISHED = "finished"
    """Every instance exited with status 0."""
    FAILED = "failed"
    """Every instance has ended, at least one of them badly."""


class Phase(str, enum.Enum):
    """A step of the launch, shown as a progress bar until every step is complete."""

    CONNECT = "hosts connected"
    """SSH connections to the remote hosts."""
    AGENTS = "agents ready"
    """The per-host agents started and answering."""
    START = "instances started"
    """Instances with a pid, on every host."""


@dataclass(frozen=True)
class HostSummary:
    """A host's instances folded into one row."""

    host: str
    indices: tuple[int, ...]
    statuses: tuple[tuple[str, int], ...]  # (status, how many), most common first
    lines: int
    cpu_percent: float | None  # the sum over instances that have a rate
    rss: int | None
    uptime: float | None  # the longest
    quiet: tuple[tuple[int, float], ...]  # running instances, longest silence first
    bad: int  # instances that failed, were killed or lost


class DashboardState:
    """Everything the panel shows, fed by the launcher's events. Times are the caller's
    monotonic clock (loop.time()); every event bumps `changes`, so the driver knows when a
    render is due."""

    def __init__(self, num_instances: int, hosts: Sequence[str], now: float | None = None, *,
                 remote_hosts: int = 0, offline: bool = False,
                 cache_dir: str | None = None, kill_timeout: float | None = None) -> None:
        self.began = _now(now)
        self.kill_timeout = kill_timeout  # seconds from the first stop to SIGKILL (shown)
        self.hosts = tuple(hosts)
        self.offline = offline
        self.partition: str | None = None
        self.cache_dir = cache_dir
        self.rows = InstanceRows([""] * num_instances, self.began)
        self.totals = {Phase.CONNECT: remote_hosts, Phase.AGENTS: remote_hosts,
                       Phase.START: num_instances}
        self._reached: dict[Phase, set[str]] = {Phase.CONNECT: set(), Phase.AGENTS: set()}
        self.launched: float | None = None  # when the last instance started
        self.attempt: tuple[int, int] | None = None  # (this attempt, of) once restarted
        self.stop_reason: str | None = None
        self.stop_began: float | None = None  # when the first stop came (SIGKILL's clock)
        self.job_id: str | None = None  # the job's id for poprunctl (poprun/jobctl/records.py)
        self.stalled = False  # --stall-timeout saw no output for that long (jobctl/stall.py)
        self.changes = 0

    @property
    def instances(self) -> dict[int, InstanceRow]:
        return self.rows.instances

    # --- events -----------------------------------------------------------------------

    def plan(self, assignments: Iterable[tuple[int, str]]) -> None:
        """(instance, host) pairs, once the plan is made: rows show their host before pids;
        the header's hosts are the plan's (a spare took a lost host's place)."""
        assignments = list(assignments)
        self.rows.planned(assignments)
        self.hosts = tuple(dict.fromkeys(host for _, host in assignments)) or self.hosts
        self.changes += 1

    def restarted(self, attempt: int, attempts: int) -> None:
        """A new attempt of a restarted job (`--max-restarts`): every row starts afresh."""
        self.attempt = (attempt, attempts)
        self.rows = InstanceRows([inst.host for inst in self.instances.values()], self.began)
        self.launched, self.stop_reason, self.stop_began = None, None, None
        self.changes += 1

    def set_partition(self, name: str | None) -> None:
        self.partition = name
        self.changes += 1

    def set_cache_dir(self, path: str | None) -> None:
        """The cache directory once made; None (no directory of poprun's: none, or a
        framework's own) keeps what the panel said from the start."""
        if path is not None:
            self.cache_dir = path
        self.changes += 1

    def host_connected(self, host: str) -> None:
        self._reached[Phase.CONNECT].add(host)
        self.changes += 1

    def agent_ready(self, host: str) -> None:
        self._reached[Phase.AGENTS].add(host)
        self.changes += 1

    def instance_started(self, index: int, host: str, pid: int, now: float | None = None, *,
                         local: bool = False) -> None:
        self.rows.started(index, host, pid, _now(now), local)
        if self.launched is None and self.count(Phase.START) == self.totals[Phase.START]:
            self.launched = self.instances[index].started
        self.changes += 1

    def output(self, index: int, data: bytes, now: float | None = None,
               lines: int | None = None) -> None:
        """A block of the instance's output (whole lines, or a `\\r` progress update): counts
        its lines (`lines`, when the caller counted them) and keeps the last one, so a
        progress bar shows as it moves."""
        self.rows.output(index, data, _now(now), lines)
        self.changes += 1

    def set_usage(self, index: int, usage: Usage | None) -> None:
        """CPU and memory of an instance: sampled here for local ones (see Dashboard.tick),
        reported by the agent for remote ones."""
        self.instances[index].usage = usage
        self.changes += 1

    def instance_exited(self, index: int, returncode: int, now: float | None = None,
                        error: Mapping | None = None) -> None:
        """`error`: its uncaught exception (popdist's error file), shown in place of its last
        line: `ValueError: loss is NaN (train.py:88, in step)`."""
        self.rows.exited(index, returncode, _now(now))
        if error:
            from poprun.rootcause import exception_text

            self.instances[index].last_line = exception_text(error).encode()
        self.changes += 1

    def host_lost(self, host: str, now: float | None = None) -> None:
        """Every instance of `host` that had not ended is lost with it."""
        self.rows.host_lost(host, _now(now))
        self.changes += 1

    def set_progress(self, report) -> None:
        """The progress watch's report (poprun.progress.Report): steps, rates, stragglers."""
        self.rows.progressed(report)
        self.changes += 1

    def set_stalled(self, stalled: bool) -> None:
        """--stall-timeout: no instance has written a line for that long (or, False, one
        has written again)."""
        if stalled != self.stalled:
            self.stalled = stalled
            self.changes += 1

    def stopping(self, reason: str, now: float | None = None) -> None:
        """The job is being stopped (e.g. "SIGINT", "instance 3 failed"); a later call,
        such as a second Ctrl-C, replaces the reason (SIGKILL's deadline stays the first's)."""
        self.stop_reason = reason
        if self.stop_began is None:
            self.stop_began = _now(now)
        self.changes += 1

    # --- views ------------------------------------------------------------------------

    def count(self, phase: Phase) -> int:
        if phase is Phase.START:
            return sum(1 for i in self.instances.values() if i.pid is not None)
        return len(self._reached[phase])

    @property
    def launching(self) -> bool:
        return any(self.count(p) < total for p, total in self.totals.items())

    @property
    def job_state(self) -> JobState:
        insts = self.instances.values()
        if insts and all(i.done for i in insts):
            return JobState.FAILED if any(i.state in BAD for i in insts) else JobState.FINISHED
        if self.stop_reason is not None:
            return JobState.STOPPING
        return JobState.LAUNCHING if self.launching else JobState.RUNNING

    def tally(self) -> Counter:
        """How many instances are in each InstanceState."""
        return Counter(i.state for i in self.instances.values())

    def alive(self) -> list[int]:
        return [i.index for i in self.instances.values() if i.state is InstanceState.RUNNING]

    def folded(self, max_rows: int) -> bool:
        return len(self.instances) > FOLD_ABOVE or len(self.instances) > max_rows

    def by_host(self, now: float) -> list[HostSummary]:
        groups: dict[str, list[InstanceRow]] = {}
        for inst in sorted(self.instances.values(), key=lambda i: i.index):
            groups.setdefault(inst.host, []).append(inst)
        return [_summarise(host, insts, now) for host, insts in groups.items()]


class PanelFeed(JobObserver):
    """The job's events, into the panel's state (the dashboard's observer)."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state

    def planned(self, hosts: Sequence[str]) -> None:
        self.state.plan(enumerate(hosts))

    def started(self, key: int, host: str, pid: int, now: float, *, local: bool,
                start_ticks: int | None) -> None:
        self.state.instance_started(key, host, pid, now, local=local)

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        self.state.output(key, data, now, lines)

    def usage(self, key: int, usage) -> None:
        self.state.set_usage(key, usage)

    def exited(self, key: int, returncode: int, now: float, error) -> None:
        self.state.instance_exited(key, returncode, now, error)

    def host_lost(self, host: str, keys: Sequence[int], now: float) -> None:
        self.state.host_lost(host, now)

    def stopping(self, reason: str, now: float) -> None:
        self.state.stopping(reason, now)

    def stalled(self, stall, ongoing: bool) -> None:
        if ongoing:
            self.state.set_stalled(True)

    def unstalled(self) -> None:
        self.state.set_stalled(False)

    def progress(self, report) -> None:
        self.state.set_progress(report)

    def restarted(self, attempt: int, attempts: int) -> None:
        self.state.restarted(attempt, attempts)


def _summarise(host: str, insts: list[InstanceRow], now: float) -> HostSummary:
    usages = [i.usage for i in insts if i.usage is not None]
    rates = [u.cpu_percent for u in usages if u.cpu_percent is not None]
    uptimes = [u for u in (i.uptime(now) for i in insts) if u is not None]
    silent = sorted(((i.index, i.idle(now)) for i in insts if i.idle(now) is not None),
                    key=lambda pair: -pair[1])
    return HostSummary(
        host=host, indices=tuple(i.index for i in insts),
        statuses=tuple(Counter(_status(i) for i in insts).most_common()),
        lines=sum(i.lines for i in insts), cpu_percent=sum(rates) if rates else None,
        rss=sum(u.rss for u in usages) if usages else None,
        uptime=max(uptimes) if uptimes else None, quiet=tuple(silent[:QUIET_LISTED]),
        bad=sum(1 for i in insts if i.state in BAD))


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now


# --- /proc sampling -------------------------------------------------------------------------

# --- rendering (pure: state -> rich Text lines) ---------------------------------------------

_COLUMNS = ("#", "host", "pid", "state", "up", "cpu", "rss", "lines", "idle", "last line")
_LEFT = {"host", "state", "last line"}
SLOW_STYLE = "bold yellow"
_STYLE = {
    InstanceState.STARTING: "yellow", InstanceState.RUNNING: "green",
    InstanceState.EXITED: "blue", InstanceState.FAILED: "bold red",
    InstanceState.KILLED: "red", InstanceState.LOST: "magenta",
    JobState.LAUNCHING: "yellow", JobState.RUNNING: "green", JobState.STOPPING: "bold yellow",
    JobState.FINISHED: "blue", JobState.FAILED: "bold red",
}


def panel_budget(rows: int) -> int:
    """Panel lines for a terminal of `rows` lines: a third is kept for scrolling output."""
    return max(3, rows * 2 // 3)


def panel_lines(state: DashboardState, now: float, width: int, height: int) -> list:
    """The panel as rich Text lines, at most `height` of them, none wider than `width`."""
    lines = _header(state, now, width)
    if state.launching:
        lines += _phases(state, width)
    room = max(1, height - len(lines) - 1)  # the table's heading takes one line
    folded = state.folded(room)
    if folded:
        rows = [_host_row(summary) for summary in state.by_host(now)]
    else:
        rows = [_instance_row(i, now, width) for i in state.instances.values()]
    if len(rows) > room:
        hidden = len(rows) - room + 1
        rows = rows[:room - 1] + [_more(hidden, "host" if folded else "instance")]
    return (lines + _table(rows, width))[:height]


def _text(*parts, width: int):
    from rich.text import Text

    line = Text.assemble(*parts, no_wrap=True, overflow="ellipsis", end="")
    line.truncate(width, overflow="ellipsis")
    line.rstrip()  # empty trailing cells would make every row as wide as the terminal
    return line


def _header(state: DashboardState, now: float, width: int) -> list:
    job = state.job_state
    tally = state.tally()
    failed = sum(tally[s] for s in BAD)
    launched = ("" if state.launched is None else
                f" (launched in {state.launched - state.began:.1f}s)")
    attempt = "" if state.attempt is None else f" (attempt {state.attempt[0]}/{state.attempt[1]})"
    label, style = (("stalled", "bold magenta") if state.stalled and job is JobState.RUNNING
                    else (job.value, _STYLE[job]))
    first = _text(("poprun ", "bold"), (f"{state.job_id} ", "bold") if state.job_id else "",
                  (label, style),
                  f"{attempt} {duration(now - state.began)}{launched}   "
                  f"instances: {len(state.instances)}  running {tally[InstanceState.RUNNING]}"
                  f"  finished {tally[InstanceState.EXITED]}  ",
                  ("failed", "red" if failed else ""), f" {failed}", width=width)
    partition = "offline" if state.offline else (state.partition or "…")
    second = _text(f"hosts: {len(state.hosts)} ({','.join(state.hosts)})   "
                   f"partition: {partition}   "
                   f"cache: {state.cache_dir or 'none'}", width=width)
    lines = [first, second]
    progress = _progress(state, width)
    if progress:
        lines.append(progress)
    if state.stop_reason is not None and job is JobState.STOPPING:
        alive = state.alive()
        lines.append(_text((f"stopping… ({state.stop_reason})", "bold yellow"),
                           f": {len(alive)} still alive {fold_indices(alive)}"
                           f"{_kill_note(state, now)}", width=width))
    return lines


def _progress(state: DashboardState, width: int):
    """The slowest instance's step of the total, its rate and the ETA; the stragglers."""
    report = state.rows.report
    if report is None:
        return None
    ahead = progress_line(report.to_json()["progress"])
    slow = [i for i, inst in state.instances.items() if inst.slow]
    if not ahead and not slow:
        return None
    return _text(f"progress: {ahead}   " if ahead else "",
                 (f"slow: {fold_indices(slow)}", SLOW_STYLE) if slow else "", width=width)


def _kill_note(state: DashboardState, now: float) -> str:
    """When SIGKILL comes, and what a Ctrl-C does meanwhile (job.py's policy: a second stop
    signal, or one while stopping after a failure, kills at once)."""
    if state.stop_reason.endswith("SIGKILL"):
        return "; SIGKILL sent"
    if state.kill_timeout is None or state.stop_began is None:
        return ""
    left = state.kill_timeout - (now - state.stop_began)
    when = f"SIGKILL in {math.ceil(left)}s" if left > 0 else "SIGKILL sent"
    again = " again" if state.stop_reason in ("SIGINT", "SIGTERM", "SIGHUP") else ""
    return f"; {when} (Ctrl-C{again}: kill now)"


def _phases(state: DashboardState, width: int) -> list:
    lines = []
    label = max(len(p.value) for p in Phase)
    for phase, total in state.totals.items():
        if total:
            done = state.count(phase)
            bar = min(30, max(5, width - label - 16))
            filled = bar * done // total
            lines.append(_text(f"{phase.value:<{label}} ", ("━" * filled, "green"),
                               ("─" * (bar - filled), "bright_black"), f" {done}/{total}",
                               width=width))
    return lines


def _status(inst: InstanceRow) -> str:
    """Its status, `slow` for a straggler (poprun/progress.py's rule)."""
    return "slow" if inst.slow else inst.status


def _instance_row(inst: InstanceRow, now: float, width: int) -> tuple:
    usage = inst.usage
    return ((str(inst.index), cut(inst.host, HOST_WIDTH),
             "" if inst.pid is None else str(inst.pid), _status(inst),
             duration(inst.uptime(now)), percent(usage and usage.cpu_percent),
             size(usage and usage.rss), str(inst.lines), duration(inst.idle(now)),
             visible(inst.last_line, width)), SLOW_STYLE if inst.slow else _STYLE[inst.state])


def _host_row(summary: HostSummary) -> tuple:
    # `running (20)`: a count first would read as the pid column's
    statuses = ", ".join(f"{status} ({n})" for status, n in summary.statuses)
    quiet = ", ".join(f"{i} ({duration(s)})" for i, s in summary.quiet)
    return ((fold_indices(summary.indices), cut(summary.host, HOST_WIDTH), "", statuses,
             duration(summary.uptime), percent(summary.cpu_percent), size(summary.rss),
             str(summary.lines), duration(summary.quiet[0][1] if summary.quiet else None),
             f"quietest: {quiet}" if quiet else ""), "bold red" if summary.bad else "")


def _more(hidden: int, what: str) -> tuple:
    return (("…", "", "", f"{hidden} more {what}s", "", "", "", "", "", ""), "")


def _table(rows: list[tuple], width: int) -> list:
    """Columns sized here from their contents: rich's Table measures every cell and costs
    ~15x more per render (27 ms against 1.6 ms for 32 rows, measured)."""
    widths = [max([len(name)] + [len(cells[c]) for cells, _ in rows])
              for c, name in enumerate(_COLUMNS[:-1])]

    def aligned(cells) -> list[str]:
        return [cell.ljust(w) if name in _LEFT else cell.rjust(w)
                for cell, w, name in zip(cells, widths, _COLUMNS)] + [cells[-1]]

    def line(cells, style):
        return _text(*((cell + " ", style if name == "state" else "")
                       for cell, name in zip(aligned(cells), _COLUMNS)), width=width)

    heading = _text((" ".join(aligned(_COLUMNS)), "bold"), width=width)
    return [heading] + [line(cells, style) for cells, style in rows]


def wants_dashboard(stderr_fd: int, environ: Mapping[str, str], no_dashboard: bool, *,
                    stdout_fd: int | None = None, force: bool = False) -> bool:
    """The panel is drawn on stderr's terminal only when the instances' output goes to that
    same terminal too: with stdout piped (`poprun ... | tee log`) another program writes to
    the screen, and the panel would erase its lines. Never with --no-dashboard or on a
    terminal that cannot move its cursor (TERM=dumb). `force` (--dashboard) draws it even
    when stdout goes elsewhere, in CI or with POPRUN_NO_DASHBOARD set."""
    if no_dashboard or environ.get("TERM") == "dumb":
        return False
    terminal = Dashboard._identity(stderr_fd)
    if terminal is None:
        return False
    if force:
        return True
    if environ.get("POPRUN_NO_DASHBOARD", "") not in ("", "0"):
        return False
    if environ.get("CI", "").lower() not in ("", "0", "false"):
        return False
    return stdout_fd is None or Dashboard._identity(stdout_fd) == terminal


def expected_cache(config, mode, environ: Mapping[str, str]) -> str | None:
    """What the panel says of the executable cache from its first frame: the explicit
    directory, the temporary one to come (its path replaces this once made), a framework's
    own (POPTORCH_CACHE_DIR=...), or None (no cache)."""
    from poprun.plan.planner import CacheMode, framework_cache_setting

    if mode is CacheMode.EXPLICIT:
        return os.path.abspath(config.executable_cache_path)
    if mode is CacheMode.TEMPORARY:
        return "a temporary directory (made at launch)"
    if mode is CacheMode.FRAMEWORK:
        return framework_cache_setting(environ)
    return None


def summary_line(state: DashboardState, now: float) -> str | None:
    """What a successful job leaves where the panel was: one line; None for any other end
    (a failure report follows instead)."""
    if state.job_state is not JobState.FINISHED:
        return None
    hosts = len(set(i.host for i in state.instances.values()))
    launched = ("" if state.launched is None else
                f" (launched in {state.launched - state.began:.1f}s)")
    attempt = "" if state.attempt is None else f", attempt {state.attempt[0]}"
    return (f"poprun: {len(state.instances)} instance(s) on {hosts} host(s) finished, all "
            f"with status 0, in {duration(now - state.began)}{launched}{attempt}")


def erase_sequence(rows: int) -> bytes:
    """From the end of a region `rows` lines tall: back to its first column, clear that
    line, and everything below it (which also clears what a narrowed terminal wrapped).

    Never "erase below" from the screen's top-left corner: after `clear` the panel's first
    line is there, and tmux (scroll-on-clear) takes an erase of the whole screen as a clear,
    pushing every frame into the scrollback. So the first line is cleared alone and the
    rest from the line below it."""
    if rows <= 1:
        return b"\r" + _ERASE_LINE
    return b"\r\x1b[%dA" % (rows - 1) + _ERASE_LINE + _DOWN + _ERASE_BELOW + _UP


class Dashboard:
    """The panel at the bottom of the terminal on `fd` (stderr). Every write to that terminal
    must go through `emit()` while the dashboard is open; `tick()` redraws; `close()` erases
    the panel and shows the cursor again.

    `schedule` (the loop's call_soon) lets the panel be redrawn once per loop iteration
    rather than after every block: the first block erases it, the blocks of the other
    instances read in the same iteration go out bare, and one redraw follows them. Without
    it, every block is written between an erase and a redraw, in one write."""

    def __init__(self, state: DashboardState, fd: int = 2, *, color_system: str | None = "auto",
                 refresh: float = REFRESH,
                 schedule: Callable[[Callable[[], None]], object] | None = None,
                 cgroup_of: Callable[[int], str | None] = lambda key: None) -> None:
        self.state = state
        self._fd = fd
        self._color_system = color_system
        self._refresh = refresh
        self._schedule = schedule
        self._console = None  # created at the first render: that is when rich is imported
        self._panel = b""  # the panel as last drawn, redrawn after every emit
        self._line_widths: tuple[int, ...] = ()  # its lines' widths in cells
        self._erase = b""  # from the end of the drawn panel to its first line
        self._erase_progress = b""  # the same, then up to the open progress line, kept
        self._drawn = False  # the panel is on the screen now
        self._cursor_hidden = False
        self._progress_open = False  # a `\r` progress line sits just above the panel
        self._tail = b"\n"  # the last byte the output left on the terminal
        self._rendered_at = -math.inf
        self._rendered_changes = -1
        self._dirty = False
        self._sampled_at = -math.inf
        self._sampler = ProcSampler()
        # A local instance's own cgroup, where it has one (LocalSpawner.cgroup_of): its CPU
        # and memory are then the whole instance's, escaped helpers included.
        self.cgroup_of = cgroup_of
        self._terminal = self._identity(fd)
        self._shares: dict[int, bool] = {}
        self._closed = False

    # --- the output path: no rendering here --------------------------------------------

    def emit(self, fd: int, *parts: bytes | memoryview) -> None:
        """Write instance output (tagged bytes) to `fd`. When `fd` is the panel's terminal the
        drawn panel is erased first and redrawn after (see `schedule`)."""
        shares = self._shares.get(fd)
        if shares is None:
            shares = self._shares[fd] = self._identity(fd) == self._terminal
        if not shares:
            write_all(fd, *parts)
            return
        tail = _last_byte(parts)
        if tail is None:
            return
        self._dirty = True
        if not self._drawn:
            self._tail = tail
            write_all(fd, *parts)
            return
        erase = self._erase_progress if self._progress_open else self._erase
        if self._schedule is None:
            write_all(fd, erase, *parts, self._separate(tail), self._panel)
            return
        self._drawn, self._tail = False, tail
        write_all(fd, erase, *parts)
        self._schedule(self._redraw)  # later blocks find the panel erased: no second call

    def _redraw(self) -> None:
        """The panel as last rendered, back under the output (no rendering)."""
        if self._drawn or self._closed:
            return
        try:
            write_all(self._fd, self._separate(self._tail), self._panel)
        except OSError:
            self._closed = True
            return
        self._drawn = True

    def _separate(self, tail: bytes) -> bytes:
        """What goes between output ending in `tail` and the panel. After `\\r` a progress
        line stays open above the panel: the next erase goes back up to its start without
        clearing it, so what comes next overwrites it (or, a `\\n`, keeps it) as it would
        without the panel."""
        self._tail = b"\n"
        self._progress_open = tail == b"\r"
        return b"" if tail == b"\n" else _NEWLINE

    # --- rendering ---------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Redraw if due: call it a few times a second (e.g. loop.call_later(REFRESH, ...)
        repeating). Renders at most every `refresh` seconds, and only when something changed
        or a second has passed (the clocks in the panel)."""
        now = _now(now)
        if self._closed or now - self._rendered_at < self._refresh:
            return
        self._sample_usage(now)
        if not self._dirty and self.state.changes == self._rendered_changes and (
                now - self._rendered_at < IDLE_REFRESH):
            return
        self._rendered_at, self._rendered_changes, self._dirty = now, self.state.changes, False
        try:
            self._draw(now)
        except OSError:  # the terminal went away: stop drawing rather than fail the job
            self._closed = True

    def _draw(self, now: float) -> None:
        width, rows = self._size()
        text = self.render(now, width, rows)
        lines = _SGR.sub("", text).split("\n")
        from rich.cells import cell_len

        if self._drawn:
            self._measure(width)
            lead = self._erase
        else:  # first drawing, or erased by emit() and not yet redrawn
            lead = (b"" if self._cursor_hidden else HIDE_CURSOR) + self._separate(self._tail)
            self._cursor_hidden = True
        self._panel = text.encode("utf-8", "replace").replace(b"\n", _NEWLINE)
        self._line_widths = tuple(cell_len(line) for line in lines)
        self._drawn = True
        self._measure(width)
        write_all(self._fd, lead, self._panel)

    def resized(self) -> None:
        """Call on SIGWINCH: the next erase then covers the panel as the terminal re-wrapped
        it (tick() does this itself; this is for the writes before the next tick)."""
        self._measure(self._size()[0])

    def _measure(self, width: int) -> None:
        """The erase sequences for the drawn panel on a terminal `width` wide: terminals that
        re-wrap on resize make a line wider than that take more rows."""
        rows = sum(max(1, -(-w // width)) for w in self._line_widths)
        self._erase = erase_sequence(rows)
        self._erase_progress = self._erase + _UP

    def render(self, now: float, width: int, rows: int) -> str:
        """The panel for a terminal `width` x `rows`, with ANSI styles, without a final
        newline."""
        console = self._console
        if console is None:
            console = self._console = _console(self._color_system)
        console.size = (width, rows)
        with console.capture() as captured:
            for line in panel_lines(self.state, now, width, panel_budget(rows)):
                console.print(line)
        return captured.get().rstrip("\n")

    def _size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self._fd)
        except OSError:
            return 80, 24
        return max(20, size.columns), max(4, size.lines)

    def _sample_usage(self, now: float) -> None:
        if now - self._sampled_at < USAGE_EVERY:
            return
        self._sampled_at = now
        for inst in self.state.instances.values():
            if inst.local and inst.pid is not None:
                if inst.done:
                    self._sampler.forget(inst.pid)
                elif (usage := self._sampler.sample(inst.pid, now,
                                                    self.cgroup_of(inst.index))) is not None:
                    self.state.set_usage(inst.index, usage)

    # --- the end -----------------------------------------------------------------------

    def close(self) -> None:
        """Erase the panel and show the cursor: the terminal is left as if there had been
        no dashboard (a failure report can follow). Safe to call twice."""
        self._closed = True
        if not self._cursor_hidden:  # never drawn: nothing to undo
            return
        summary = summary_line(self.state, _now(None))
        last = b""
        if summary:  # on a line of its own, where the panel was
            start = b"" if self._drawn or self._tail == b"\n" else _NEWLINE
            last = start + summary.encode("utf-8", "replace") + _NEWLINE
        try:
            if self._drawn:
                self._measure(self._size()[0])
            write_all(self._fd, self._erase if self._drawn else b"", SHOW_CURSOR, last)
        except OSError:
            pass  # the terminal is gone: nothing left to clean
        self._drawn = self._cursor_hidden = False

    @staticmethod
    def _identity(fd: int) -> int | None:
        """Which terminal `fd` is, if any: every fd on one tty has its device number."""
        try:
            return os.fstat(fd).st_rdev if os.isatty(fd) else None
        except OSError:
            return None


def _console(color_system: str | None):
    from rich.console import Console

    return Console(force_terminal=color_system is not None, color_system=color_system,
                   markup=False, emoji=False, highlight=False, legacy_windows=False,
                   soft_wrap=False, width=80, height=24)


def _last_byte(parts: Sequence[bytes | memoryview]) -> bytes | None:
    for part in reversed(parts):
        if len(part):
            return bytes(part[-1:])
    return None
