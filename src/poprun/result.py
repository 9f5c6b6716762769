"""What `launch()` returns: how every instance ended, and why the job ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from .render import describe_status, fold_indices, signal_name


@dataclass(frozen=True)
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

    @property
    def exit_status(self) -> int:
        """The shell's view: 128+N for signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None


@dataclass(frozen=True)
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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def failure_report(self) -> str:
        """The root cause in full, the collateral outcomes folded (empty for a success)."""
        if self.ok:
            return ""
        lines = []
        if self.stop_signal is not None:
            lines.append(f"poprun: stopped by {signal_name(self.stop_signal)}")
        if self.root_cause is not None:
            first = next(i for i in self.instances if i.index == self.root_cause)
            lines.append(f"poprun: instance {first.index} (pid {first.pid} on {first.host}) "
                         f"failed first: {_outcome(first)}")
            if first.returncode == -9 and not first.stopped_by_poprun:
                lines.append("poprun: poprun did not send that SIGKILL: perhaps the kernel's "
                             "out-of-memory killer (see `dmesg`) or another user")
            if first.stderr_tail:
                lines.append(f"poprun: last {len(first.stderr_tail)} line(s) of its stderr:")
                lines += ["    " + raw.decode("utf-8", "replace") for raw in first.stderr_tail]
        by_outcome: dict[str, list[InstanceResult]] = {}
        for inst in self.instances:
            if inst.index != self.root_cause:
                by_outcome.setdefault(_outcome(inst), []).append(inst)
        for outcome, group in by_outcome.items():
            hosts = ",".join(dict.fromkeys(i.host for i in group))
            lines.append(f"poprun: instances {fold_indices(i.index for i in group)} on "
                         f"{hosts}: {outcome}")
        return "\n".join(lines) + "\n"


    def summary(self) -> str:
        """One line per host for a job that went well (shown at -v)."""
        by_host: dict[str, list[InstanceResult]] = {}
        for inst in self.instances:
            by_host.setdefault(inst.host, []).append(inst)
        lines = []
        for host, group in by_host.items():
            seconds = max(i.end_time for i in group) - min(i.start_time for i in group)
            outcomes = ", ".join(sorted({_outcome(i) for i in group}))
            lines.append(f"poprun: {host}: instances {fold_indices(i.index for i in group)} "
                         f"{outcomes} in {seconds:.1f} s, {sum(i.lines for i in group)} lines")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        """`--result-json`: the job and every instance, as plain JSON values."""
        return {
            "exit_code": self.exit_code,
            "root_cause": self.root_cause,
            "stop_signal": signal_name(self.stop_signal) if self.stop_signal else None,
            "start_time": self.start_time,
            "phases": self.phases,
            "instances": [{
                "index": i.index, "host": i.host, "pid": i.pid, "start_time": i.start_time,
                "end_time": i.end_time, "first_output_time": i.first_output_time,
                "exit_status": i.exit_status,
                "signal": signal_name(i.signal) if i.signal else None,
                "outcome": _outcome(i), "lines": i.lines, "lost": i.lost,
                "stopped_by_poprun": i.stopped_by_poprun,
            } for i in self.instances],
        }


def _outcome(inst: InstanceResult) -> str:
    if inst.lost:
        return f"lost with its host ({inst.lost})"
    if inst.stopped_by_poprun and inst.returncode < 0:
        return f"terminated by poprun ({signal_name(-inst.returncode)})"
    return describe_status(inst.returncode)
