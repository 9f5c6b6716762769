"""What `launch()` returns: how every instance ended, and why the job ended."""

from __future__ import annotations

from dataclasses import dataclass

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


def _outcome(inst: InstanceResult) -> str:
    if inst.lost:
        return f"lost with its host ({inst.lost})"
    if inst.stopped_by_poprun and inst.returncode < 0:
        return f"terminated by poprun ({signal_name(-inst.returncode)})"
    return describe_status(inst.returncode)
