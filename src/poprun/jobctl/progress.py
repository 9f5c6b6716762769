"""The progress watch: an observer of the job's events (poprun/events.py) that
measures each instance's progress, about once a second, into the pure `Tracker`
(poprun/progress.py: the rates, the straggler rule, the ETA) and reports what it finds
(`report`: the job publishes it to every observer as the `progress` event, so the
dashboard, the record and `poprunctl` show one and the same report).

Progress is, in this order: the step `--progress-pattern` captures from an instance's lines
(the pattern is only matched when given: `PatternWatch`); else the step instances give
`popdist.progress()` once any has (sampled here for local instances, `local()`, and sent by
the agents for theirs, the `stepped` event); else the lines each writes (counted already by
the output path: nothing more per line).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from poprun.events import JobObserver

EVERY = 1.0  # seconds between samples (a fifth of a shorter --straggler-after)


def progress_watch(loop: asyncio.AbstractEventLoop, count: int, *, pattern: str | None,
                   hold: float, local: Callable[..., Mapping[int, tuple[int, int | None]]],
                   report: Callable[..., None],
                   note: Callable[[str], None] = lambda text: None) -> ProgressWatch:
    """The watch for this launch: with a pattern, one that matches it (`note`: what it says
    at -v)."""
    if pattern is None:
        return ProgressWatch(loop, count, hold=hold, local=local, report=report)
    from poprun.progress import compile_pattern

    return PatternWatch(loop, count, hold=hold, local=local, report=report,
                        pattern=compile_pattern(pattern), note=note)


class ProgressWatch(JobObserver):
    """Given the loop, the instance count, the hold time (0: no stragglers), `local(keys=
    None)` (the local running instances' popdist.progress, or these instances', exited or
    not; none for a remote one) and `report(Report)`."""

    source = "lines"

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, *, hold: float,
                 local: Callable[..., Mapping[int, tuple[int, int | None]]],
                 report: Callable[..., None]) -> None:
        self.loop, self.count, self.hold = loop, count, hold
        self._local, self._report = local, report
        self.every = min(EVERY, hold / 5) if hold else EVERY
        self._new_attempt()
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def _new_attempt(self) -> None:
        self._tracker = None  # made when first needed: off a launch's start-up path
        self.lines = [0] * self.count
        # The steps of `source` (step, total, when an agent sent it; None: true until
        # another comes): an agent's is sampled at the time it came, not at the next tick,
        # as they come once a second (the ticks' times made rates over a 2 s window swing
        # by half).
        self.steps: dict[int, tuple[int, int | None, float | None]] = {}
        self._sampled: dict[int, float] = {}  # per instance, the last step's time sampled
        self.running: set[int] = set()

    @property
    def tracker(self):
        """The attempt's poprun.progress.Tracker."""
        if self._tracker is None:
            from poprun.progress import DEFAULT_HOLD, Tracker  # ~1 ms: a second after start

            self._tracker = Tracker(self.count, self.source, hold=self.hold or DEFAULT_HOLD,
                                    flag=bool(self.hold))
        return self._tracker

    # --- the job's events ---------------------------------------------------------------

    def started(self, key: int, host: str, pid: int, now: float, *, local: bool,
                start_ticks: int | None) -> None:
        self.running.add(key)
        if self._timer is None and not self.closed:
            self._timer = self.loop.call_later(self.every, self._tick)

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        self.lines[key] += lines

    def stepped(self, key: int, step: int, total: int | None, now: float) -> None:
        self._popdist(key, step, total, now)  # an agent's sample: as of when it came

    def exited(self, key: int, returncode: int, now: float, error) -> None:
        self._end(key, now)

    def host_lost(self, host: str, keys: Sequence[int], now: float) -> None:
        for key in keys:
            self._end(key, now)

    def stopping(self, reason: str, now: float) -> None:
        """Instances being stopped slow down for that: compare no more (one last report)."""
        self.close()

    def restarted(self, attempt: int, attempts: int) -> None:
        self.closed = False
        self._new_attempt()

    # --- sampling -----------------------------------------------------------------------

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._sample()  # the result keeps where each instance got to
        self.closed = True

    def _end(self, key: int, now: float) -> None:
        """Its last count is kept, and the job's when it was the last one running."""
        if key not in self.running:
            return
        for step, total in self._local([key]).values():  # its last popdist.progress() here
            self._popdist(key, step, total, None)
        self._sample_one(key, now)
        self.running.discard(key)
        self.tracker.ended(key, now)
        if not self.running and self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._report(self.tracker.report(now))

    def _popdist(self, key: int, step: int, total: int | None, now: float | None) -> None:
        """A popdist.progress() sample: from then on it is the job's progress."""
        if self.source == "lines":
            self.source = "popdist"
            self.tracker.switch(self.source, self.loop.time())
        if self.source == "popdist":
            self.steps[key] = (step, total, now)

    def _tick(self) -> None:
        self._timer = None
        if self.closed:
            return
        self._sample()
        self._timer = self.loop.call_later(self.every, self._tick)

    def _sample(self) -> None:
        for key, (step, total) in self._local().items():  # read now: true until the next
            self._popdist(key, step, total, None)
        now = self.loop.time()
        for key in self.running:
            self._sample_one(key, now)
        self._report(self.tracker.report(now))

    def _sample_one(self, key: int, now: float) -> None:
        if self.source == "lines":
            if self.lines[key]:  # a silent instance shows no progress (only rank 0 logs)
                self.tracker.sample(key, self.lines[key], None, now)
        elif key in self.steps:
            step, total, seen = self.steps[key]
            if seen is None:
                self.tracker.sample(key, step, total, now)
            elif seen > self._sampled.get(key, -1.0):
                self._sampled[key] = seen
                self.tracker.sample(key, step, total, seen)


class PatternWatch(ProgressWatch):
    """`--progress-pattern`: each block's last match gives its instance's step (and total)."""

    source = "pattern"

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, *, hold: float,
                 local: Callable[..., Mapping[int, tuple[int, int | None]]],
                 report: Callable[..., None], pattern,
                 note: Callable[[str], None] = lambda text: None) -> None:
        from poprun.progress import holds  # imported already: the pattern was compiled there

        self.pattern, self._note, self._holds = pattern, note, holds
        self._noted = False
        super().__init__(loop, count, hold=hold, local=local, report=report)

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        match = None
        for match in self.pattern.finditer(data):
            pass
        if match is None:
            return
        try:
            step = int(match.group(1))
            total = int(match.group(2)) if self.pattern.groups == 2 else None
        except (TypeError, ValueError):  # a group that matched no digits: not a step
            return
        if not self._holds(step, total):
            self._too_large(key)
            return
        self.steps[key] = (step, total, None)

    def _too_large(self, key: int) -> None:
        from poprun.progress import MAX_STEP

        if not self._noted:  # once: a program that prints such numbers prints them often
            self._noted = True
            self._note(f"--progress-pattern: instance {key} printed a step or total beyond "
                       f"{MAX_STEP}: ignored (as every such number from now on)")

    def _popdist(self, key: int, step: int, total: int | None, now: float | None) -> None:
        """The pattern asked for wins over popdist.progress()."""
