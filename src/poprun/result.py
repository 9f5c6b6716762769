"""What `launch()` returns: how every instance ended, and why the job ended."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

from spawner import uncompiled

from poprun.text import describe_status, fold_indices, shown, signal_name

# The one schema of `--result-json` and of the job records poprunctl reads (poprun/jobctl/records.py).
JOB_SCHEMA = "poprun.job/1"
STALL_STATUS = 124  # a job ended by --stall-action kill (as timeout(1) exits)
OUTPUT_ERROR_STATUS = 74  # EX_IOERR: output could not be written (a full disk...): job stopped
LOST_HOST_STATUS = 255  # the status of an instance whose host was lost (ssh's own 255)
# Restarts would not help: every attempt failed the same way, or made no progress
# (`LaunchResult.requeue_verdict`). EX_CONFIG: what a scheduler's requeue must not retry
# (docs/troubleshooting.md, "Exit statuses": the contract).
DO_NOT_REQUEUE_STATUS = 78
OOM_KILLED = "killed by the kernel's out-of-memory killer (SIGKILL)"


def end_reason(*, output_error: str | None, stop_signal: int | None,
               stall: Mapping[str, Any] | None, root_cause: int | None,
               scheduler_stop: str | None = None) -> str:
    """Why a job ended, the strongest reason first: the one precedence behind poprun's exit
    status (`exit_status`) and `LaunchResult.exit_reason`. A running job's `Job.stop_reason`
    is this too ("success": nothing has stopped it). Slurm ending the job does not change the
    exit status (the instances' statuses stand) but names the reason."""
    if output_error is not None:
        return "output_error"
    if scheduler_stop is not None:
        return "scheduler"
    if stop_signal is not None:
        return "signal"
    if stall is not None:
        return "stall"
    return "success" if root_cause is None else "instance"


def exit_status(reason: str, stop_signal: int | None, root_status: int | None) -> int:
    """poprun's exit status for `end_reason`'s answer (before a scheduler's stop)."""
    if reason == "output_error":
        return OUTPUT_ERROR_STATUS
    if reason == "signal":
        return 128 + stop_signal
    if reason == "stall":
        return STALL_STATUS
    return root_status if reason == "instance" else 0


@uncompiled.dataclass(frozen=True)
class InstanceResult:
    """One instance's life."""

    index: int
    host: str
    pid: int
    returncode: int  # as subprocess gives it: negative for a signal
    start_time: float  # time.time()
    end_time: float
    lines: int  # lines it wrote (stdout and stderr)
    stderr_tail: tuple[bytes, ...] = ()
    stopped_by_poprun: bool = False  # poprun signalled it before it exited
    lost: str | None = None  # its host was lost (connection or agent gone): why
    first_output_time: float | None = None  # time.time() of its first output, if any
    # Its uncaught exception, as popdist wrote it (popdist/errorfile.py): type, message,
    # file, line, function, traceback, time. None: none written (no popdist, or no error).
    error: Mapping[str, Any] | None = None
    collateral: str | None = None  # why its failure looks like the root cause's consequence
    start_ticks: int | None = None  # its start in /proc's clock (spawner/procid.py)
    # The kernel's OOM killer ended it: its SIGKILL came with a kill counted in its memory
    # cgroup (spawner/oomkills.py). A host-level cause: its host is quarantined.
    oom_killed: bool = False

    def __init__(self, index, host, pid, returncode, start_time, end_time, lines,
                 stderr_tail=(), stopped_by_poprun=False, lost=None, first_output_time=None,
                 error=None, collateral=None, start_ticks=None, oom_killed=False):
        # by hand: one per instance (spawner/uncompiled.py)
        self.__dict__.update(
            index=index, host=host, pid=pid, returncode=returncode, start_time=start_time,
            end_time=end_time, lines=lines, stderr_tail=stderr_tail,
            stopped_by_poprun=stopped_by_poprun, lost=lost,
            first_output_time=first_output_time, error=error, collateral=collateral,
            start_ticks=start_ticks, oom_killed=oom_killed)

    @property
    def exit_status(self) -> int:
        """The shell's view: 128+N for signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


@uncompiled.dataclass(frozen=True)  # one per launch
class LaunchResult:
    """The job. `exit_code` is what `poprun` exits with."""

    instances: tuple[InstanceResult, ...]
    exit_code: int
    root_cause: int | None = None  # index of the first instance to fail, by time
    stop_signal: int | None = None  # the signal that stopped poprun itself, if any
    # Per host, seconds from the launch's start to each phase reached there: "connected",
    # "agent_ready", "first_started", "first_output" (remote hosts have all four).
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    start_time: float = 0.0  # time.time() when the launch began
    output_error: str | None = None  # output that could not be written stopped the job
    scheduler_stop: str | None = None  # the scheduler ended the job (Slurm: scancel, time)
    # The failed attempts before this one (`--max-restarts`), oldest first; the fields above
    # are the last attempt's.
    attempts: tuple[LaunchResult, ...] = ()
    # --stall-action kill ended the job: {idle, timeout, stacks_file, stacks} (stacks.Folded's
    # JSON). The stall is then the root cause (exit status STALL_STATUS).
    stall: Mapping[str, Any] | None = None
    # The job's record (poprun/jobctl/records.py): id, argv, cwd, hosts, launcher, caches, partition...
    # (jobctl/watch.JobRecord.meta); None for a launch that was not registered.
    job: Mapping[str, Any] | None = None
    # Hosts never used again in the job, in order: {host, reason, at (time.time())}
    # (run/session.py, _quarantine).
    quarantined: tuple[Mapping[str, Any], ...] = ()
    # The highest step any instance gave popdist.progress() in this attempt; None: none did.
    highest_step: int | None = None
    # The processes the instances started with MPI_Comm_spawn (run/worlds/spawn.py), in order:
    # {tag: "2,0", spawned_by: instance, host, pid, exit_status (null: still running),
    # kvsname}.
    spawned: tuple[Mapping[str, Any], ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def exit_reason(self) -> str:
        """Why `exit_code` is what it is: "success", "instance" (the root cause's status),
        "host_lost" (255, as ssh), "signal" (poprun stopped by signal N: 128+N),
        "output_error" (74: output could not be written), "scheduler" (Slurm ended the job:
        the instances' statuses) or "stall" (124: --stall-action kill). A job that ended
        before any instance ran has no LaunchResult; its --result-json (`not_run_json`) says
        "usage_error" (2) or "internal_error" (70)."""
        reason = end_reason(output_error=self.output_error, stop_signal=self.stop_signal,
                            stall=self.stall, root_cause=self.root_cause,
                            scheduler_stop=self.scheduler_stop)
        if reason != "instance":
            return reason
        cause = next(i for i in self.instances if i.index == self.root_cause)
        return "host_lost" if cause.lost else "instance"

    @property
    def exit_class(self) -> str:
        """What a scheduler should do with the exit status (docs/troubleshooting.md, "Exit
        statuses"): "success"; "program" (the program's own status); "host_lost" (255: a
        host lost, no spare left); "restarts_spent" (--max-restarts used up, the last
        attempt's status); "do_not_requeue" (DO_NOT_REQUEUE_STATUS: `requeue_verdict`);
        "signal", "stall", "output_error", "scheduler" as `exit_reason`. (A job that never
        ran: "usage_error" or "internal_error", `not_run_json`.)"""
        reason = self.exit_reason
        if reason not in ("instance", "stall"):
            return reason
        if self.requeue_verdict() is not None:
            return "do_not_requeue"
        if self.attempts:
            return "restarts_spent"
        return "program" if reason == "instance" else reason

    def requeue_verdict(self) -> str | None:
        """Why running the job again would not help, or None: every attempt (two or more)
        failed the same way (the same reason, status and root cause's error), or the last
        one got no further than an earlier one (the highest popdist.progress() step, where
        each attempt reported one)."""
        if not self.attempts or self.exit_reason not in ("instance", "stall"):
            return None
        every = (*self.attempts, self)
        if len({a.failure_signature() for a in every}) == 1:
            return f"every attempt ({len(every)}) failed the same way"
        steps = [a.highest_step for a in every]
        if None not in steps and steps[-1] <= max(steps[:-1]):
            return (f"no progress between attempts: the last reached step {steps[-1]}, "
                    f"an earlier one {max(steps[:-1])}")
        return None

    def host_faults(self) -> dict[str, tuple[str, float]]:
        """The hosts this attempt failed on through a fault of the host, not the program's
        (quarantined: run/session.py): host -> (why, when), the first fault of each. Lost
        ("lost: ...": its connection or agent gone, or silent for --host-timeout), or an
        instance there killed by the kernel's OOM killer ("oom: instance N ...")."""
        found: dict[str, tuple[str, float]] = {}
        for inst in sorted(self.instances, key=lambda i: i.end_time):
            if inst.host in found:
                continue
            if inst.lost:
                found[inst.host] = (f"lost: {inst.lost}", inst.end_time)
            elif inst.oom_killed:
                found[inst.host] = (f"oom: instance {inst.index} {OOM_KILLED}", inst.end_time)
        return found

    def failure_signature(self) -> tuple:
        """How this attempt failed, for `requeue_verdict`: the reason, the root cause's exit
        status and error (its type and message, where it reported one)."""
        cause = next((i for i in self.instances if i.index == self.root_cause), None)
        error = dict(cause.error) if cause is not None and cause.error else {}
        return (self.exit_reason, cause.exit_status if cause is not None else None,
                error.get("type"), error.get("message"))

    def failure_report(self) -> str:
        """The root cause in full, the collateral outcomes folded (empty for a success)."""
        return "" if self.ok else _plain(self.failure_lines())

    def summary(self) -> str:
        """One line per host for a job that went well (shown at -v)."""
        return _plain(self.summary_lines())

    def failure_lines(self) -> list[tuple[str, str]]:
        """The failure report's lines, each with its part (a _STYLES key)."""
        if self.ok:
            return []
        lines = []
        total = len(self.attempts) + 1
        for number, earlier in enumerate(self.attempts, 1):
            cause = next((i for i in earlier.instances if i.index == earlier.root_cause), None)
            what = (f"instance {cause.index} on {cause.host}: {_outcome(cause)}" if cause
                    else f"exit status {earlier.exit_code}")
            lines.append(("collateral", f"poprun: attempt {number} of {total} failed: {what}"))
        if self.attempts:
            lines.append(("stopped", f"poprun: attempt {total} of {total} (the last):"))
        verdict = self.requeue_verdict()
        if verdict is not None:
            lines.append(("hint", f"poprun: {verdict}: exit status {DO_NOT_REQUEUE_STATUS}, "
                                  "do not requeue (fix the cause first)"))
        if self.scheduler_stop is not None:
            lines.append(("stopped", f"poprun: stopped by Slurm: {self.scheduler_stop}"))
        if self.output_error is not None:
            lines.append(("stopped", f"poprun: stopped: {self.output_error}"))
        if self.stop_signal is not None:
            lines.append(("stopped", f"poprun: stopped by {signal_name(self.stop_signal)}"))
        if self.stall is not None:
            lines += _stall_lines(self.stall)
        if self.root_cause is not None:
            first = next(i for i in self.instances if i.index == self.root_cause)
            lines.append(("root", f"poprun: instance {first.index} (pid {first.pid} on "
                                  f"{first.host}) failed first: {_outcome(first)}"))
            if first.returncode == -9 and not first.stopped_by_poprun and not first.oom_killed:
                lines.append(("hint", "poprun: poprun did not send that SIGKILL: perhaps the "
                                      "kernel's out-of-memory killer (see `dmesg`) or another "
                                      "user"))
            if first.stderr_tail:
                lines.append(("text", f"poprun: last {len(first.stderr_tail)} line(s) of its "
                                      "stderr:"))
                lines += [("tail", "    " + shown(raw))
                          for raw in first.stderr_tail]
        by_outcome: dict[str, list[InstanceResult]] = {}
        for inst in self.instances:
            if inst.index != self.root_cause:
                outcome = _outcome(inst)
                if inst.collateral:  # why it is not the root cause
                    outcome += f" (collateral: {inst.collateral})"
                by_outcome.setdefault(outcome, []).append(inst)
        for outcome, group in by_outcome.items():
            hosts = ",".join(dict.fromkeys(i.host for i in group))
            indices = fold_indices(i.index for i in group)
            lines.append(("collateral", f"poprun: instances {indices} on {hosts}: {outcome}"))
        return lines

    def summary_lines(self) -> list[tuple[str, str]]:
        by_host: dict[str, list[InstanceResult]] = {}
        for inst in self.instances:
            by_host.setdefault(inst.host, []).append(inst)
        lines = []
        for host, group in by_host.items():
            seconds = max(i.end_time for i in group) - min(i.start_time for i in group)
            outcomes = ", ".join(sorted({_outcome(i) for i in group}))
            lines.append(("summary", f"poprun: {host}: instances "
                                     f"{fold_indices(i.index for i in group)} {outcomes} in "
                                     f"{seconds:.1f} s, {sum(i.lines for i in group)} lines"))
        return lines

    def to_json(self) -> dict:
        """`--result-json`, and the final record of the job (poprun/jobctl/records.py: one schema,
        JOB_SCHEMA): the job's own keys (`job`: id, argv, cwd, hosts...), why it ended, and
        every instance, as plain JSON values."""
        return job_json(
            "ended", self.job, stall=self.stall, exit_code=self.exit_code,
            exit_reason=self.exit_reason, exit_class=self.exit_class,
            highest_step=self.highest_step, root_cause=self.root_cause,
            stop_signal=signal_name(self.stop_signal) if self.stop_signal else None,
            output_error=self.output_error, scheduler_stop=self.scheduler_stop,
            attempts=[earlier.to_json() for earlier in self.attempts],
            quarantined=[dict(q) for q in self.quarantined],
            spawned=[dict(child) for child in self.spawned],
            start_time=self.start_time, phases=self.phases, instances=[instance_json(
                i.index, i.host, i.pid, i.returncode, _state(i), lines=i.lines,
                start_time=i.start_time, end_time=i.end_time,
                first_output_time=i.first_output_time, outcome=_outcome(i), lost=i.lost,
                stopped_by_poprun=i.stopped_by_poprun, error=i.error,
                collateral=i.collateral, start=i.start_ticks) for i in self.instances])


# A record's keys, as a job that has not ended has them (the result's own null): the one
# schema (JOB_SCHEMA) of --result-json, of the running job's record and of a job that never
# ran. `job_json` is the only writer of it.
_UNENDED = {"stall": None, "exit_code": None, "exit_reason": None, "exit_class": None,
            "highest_step": None, "root_cause": None,
            "stop_signal": None, "output_error": None, "scheduler_stop": None, "attempts": [],
            "quarantined": [],
            "start_time": None, "phases": {}, "instances": [], "spawned": []}


def job_json(state: str, job: Mapping[str, Any] | None = None, **fields: Any) -> dict:
    """The record in `state` ("starting", "running"..., "ended"): the job's own keys (`job`:
    id, argv, cwd, hosts...; records.py) and `fields` (the result's keys) over the unended
    record's."""
    unknown = fields.keys() - _UNENDED.keys() - {"error"}
    if unknown:  # a key nobody reads would be a schema of its own
        raise ValueError(f"not a key of {JOB_SCHEMA}: {sorted(unknown)}")
    return {"schema": JOB_SCHEMA, **_UNENDED, **(job or {}), "state": state, **fields}


def instance_json(index: int, host: str | None, pid: int | None, returncode: int | None,
                  state: str, *, lines: int, start: int | None, start_time: float | None = None,
                  end_time: float | None = None, first_output_time: float | None = None,
                  outcome: str | None = None, lost: str | None = None,
                  stopped_by_poprun: bool | None = None, error: Mapping[str, Any] | None = None,
                  collateral: str | None = None) -> dict:
    """One instance in a record: `returncode` as subprocess gives it (None: still running),
    shown as the shell's exit status and the signal's name."""
    signalled = returncode is not None and returncode < 0
    return {
        "index": index, "host": host, "pid": pid, "start_time": start_time,
        "end_time": end_time, "first_output_time": first_output_time,
        "exit_status": None if returncode is None else 128 - returncode if signalled
        else returncode,
        "signal": signal_name(-returncode) if signalled else None,
        "outcome": outcome, "lines": lines, "lost": lost,
        "stopped_by_poprun": stopped_by_poprun, "error": error, "collateral": collateral,
        "start": start, "state": state}


def not_run_json(exit_code: int, exit_reason: str, error: str) -> dict:
    """`--result-json` for a job that ended before any instance ran: a usage error or a job
    that could not start (2, "usage_error"), an internal error (70, "internal_error")."""
    return job_json("ended", exit_code=exit_code, exit_reason=exit_reason,
                    exit_class=exit_reason, error=error)


def _state(inst: InstanceResult) -> str:
    """As the dashboard names it: exited (status 0), failed, killed (a signal) or lost."""
    if inst.lost:
        return "lost"
    return "exited" if inst.returncode == 0 else "failed" if inst.returncode > 0 else "killed"


def _stall_lines(stall: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The root cause of a job --stall-action kill ended: the silence, where each group of
    instances was (the innermost frame of each folded stack, the odd ones out first)."""
    lines = [("root", f"poprun: stalled: no instance wrote a line for "
                      f"{float(stall.get('idle') or 0):.0f} s (--stall-timeout "
                      f"{float(stall.get('timeout') or 0):g}); stopped by --stall-action kill")]
    groups = (stall.get("stacks") or {}).get("groups") or []
    for group in groups[:6]:
        frames = group.get("frames") or []
        where = "no Python frame" if not frames else (
            f"{frames[0]['file']}:{frames[0]['line']} in {frames[0]['function']}"
            + (f": {frames[0]['code']}" if frames[0].get("code") else ""))
        lines.append(("text", f"poprun:   instances {fold_indices(group['instances'])} at "
                              f"{where}"))
    if len(groups) > 6:
        lines.append(("text", f"poprun:   ... and {len(groups) - 6} more stacks"))
    if stall.get("stacks_file"):
        lines.append(("text", f"poprun: every stack: {stall['stacks_file']}"))
    return lines


def _outcome(inst: InstanceResult) -> str:
    if inst.lost:
        return f"lost with its host ({inst.lost})"
    if inst.oom_killed:
        return OOM_KILLED
    if inst.stopped_by_poprun and inst.returncode < 0:
        return f"terminated by poprun ({signal_name(-inst.returncode)})"
    if inst.error and inst.returncode != 0:
        from poprun.rootcause import exception_text  # only for a failed instance's report

        return exception_text(inst.error)
    return describe_status(inst.returncode)


def _plain(lines: list[tuple[str, str]]) -> str:
    return "\n".join(line for _, line in lines) + "\n"

