"""Each instance's progress, its rate, the stragglers and the ETA; pure.

The progress watch (poprun/jobctl/progress.py) samples every running instance's count about
once a second into a `Tracker` and publishes the `Report` it makes (the `progress` event):
the dashboard, the job's record (`poprunctl list/show`, `--result-json`) and the control
socket all show that one report, so they never disagree. Times are passed in (the
launcher's loop clock); nothing here reads a clock or does I/O.

What counts as progress (`source`): the lines an instance writes (the default); the step
that `--progress-pattern` captures from its lines; the step it gives `popdist.progress()`.

The straggler rule, for a hold time S (`--straggler-after`, 10 s by default):

- An instance's rate is its progress over the last S seconds (known S/2 after its first
  progress); one that reports less often than every S seconds (a line every 20 steps) is
  read at the rate of its last interval, falling once it is overdue (`Tracker.rate`). Only running instances that have shown progress at all are compared: in a job
  where only rank 0 logs, the silent ranks are not stragglers (the stall watch is for a job
  that goes silent).
- With three or more compared: slow when its rate is below median - 3*MAD and below half
  the median (MAD: the median absolute deviation of the rates); with two: below half the
  other's rate; alone: never.
- It is flagged `slow` once the rule has held for S seconds in a row, and cleared once the
  rule has not held for S seconds in a row. A straggler's entry keeps when it was flagged,
  its rate and the median then, and when it was cleared (null while it is slow).

So an instance that is slow from its start is flagged about 1.5*S after its first progress
(2*S at most: the samples come every S/5, or every second for S over 5 s), one that slows
down later within about 2*S.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

SOURCES = ("lines", "pattern", "popdist")
DEFAULT_HOLD = 10.0  # --straggler-after's default: seconds a rule must hold
# The largest step or total held: popdist's file holds signed 64-bit counts, and a rate or an
# ETA of a larger one would not fit a float. A pattern that captures more is not a step.
MAX_STEP = 2 ** 63 - 1
MAD_FACTOR = 3.0
SLOW_FRACTION = 0.5  # and below half the median


def holds(step: int, total: int | None) -> bool:
    """Whether the tracker can hold this step and total (both within MAX_STEP)."""
    return abs(step) <= MAX_STEP and (total is None or abs(total) <= MAX_STEP)


def compile_pattern(text: str):
    """`--progress-pattern` as it is matched (on bytes: output is bytes end to end); a
    ValueError that says what is wrong with it."""
    import re

    try:
        pattern = re.compile(text.encode("utf-8", "surrogateescape"))
    except re.error as exc:
        raise ValueError(f"{text!r} is not a regular expression: {exc}") from None
    if pattern.groups not in (1, 2):
        raise ValueError(f"{text!r} has {pattern.groups} capture groups; it needs one (the "
                         "step) or two (the step and the total), e.g. 'step (\\d+)/(\\d+)'")
    return pattern


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def slow_rule(rates: Mapping[int, float]) -> tuple[set[int], float | None]:
    """Which of these rates (instance -> rate) the straggler rule calls slow right now, and
    the median it compared them with (None: fewer than two rates, nothing to compare)."""
    if len(rates) < 2:
        return set(), None
    values = list(rates.values())
    middle = median(values)
    if len(rates) == 2:  # the MAD of two rates is their half-distance: the rule says nothing
        return {i for i, r in rates.items() if r < SLOW_FRACTION * max(values)}, middle
    mad = median([abs(r - middle) for r in values])
    bound = min(middle - MAD_FACTOR * mad, SLOW_FRACTION * middle)
    return {i for i, r in rates.items() if r < bound}, middle


# Plain classes, not dataclasses: every launch imports this module, and making a dataclass
# costs ~1-3 ms of start-up each (plan/network.py made the same choice).
class _Instance:
    __slots__ = ("samples", "step", "total", "first", "min_rate", "running", "ended",
                 "held_since", "slow")

    def __init__(self, running: bool = True) -> None:
        self.samples: deque = deque()  # (time, count), oldest first
        self.step: int | None = None  # its latest count (None: no progress shown yet)
        self.total: int | None = None
        self.first: tuple[float, int] | None = None  # its first sample: the mean rate
        self.min_rate: float | None = None
        self.running = running
        self.ended: float | None = None  # when it stopped running: its rate stays as then
        self.held_since: float | None = None  # the rule holds since (flagged: holds not)
        self.slow: dict[str, Any] | None = None  # its open straggler entry


class Report:
    """What every view shows: per instance (index -> dict: step, total, rate, mean_rate,
    min_rate, slow), the median rate, the slowest instance (its step, total, rate, ETA: with
    a total) and every straggler entry so far (times: the loop clock). Not to be changed."""

    __slots__ = ("source", "instances", "median", "slowest", "eta", "stragglers")

    def __init__(self, source: str, instances: Mapping[int, Mapping[str, Any]],
                 median: float | None, slowest: int | None, eta: float | None,
                 stragglers: tuple[Mapping[str, Any], ...]) -> None:
        self.source, self.instances, self.median = source, instances, median
        self.slowest, self.eta, self.stragglers = slowest, eta, stragglers

    @property
    def slow(self) -> list[int]:
        return [i for i, p in self.instances.items() if p["slow"]]

    def to_json(self, wall: float = 0.0) -> dict[str, Any]:
        """As the record keeps it (`wall`: time.time() minus the loop clock, so that times are
        the epoch's): `progress` and `stragglers`."""
        slowest = self.instances.get(self.slowest) if self.slowest is not None else None
        return {
            "progress": {
                "source": self.source, "median_rate": _round(self.median),
                "slowest": self.slowest, "step": slowest and slowest["step"],
                "total": slowest and slowest["total"], "rate": slowest and slowest["rate"],
                "eta": _round(self.eta), "slow": self.slow,
                "instances": [{"index": i, **p} for i, p in sorted(self.instances.items())]},
            "stragglers": [{**s, "when": round(s["when"] + wall, 3),
                            "cleared": None if s["cleared"] is None
                            else round(s["cleared"] + wall, 3)} for s in self.stragglers]}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class Tracker:
    """Every instance's samples over the last `hold` seconds, and the stragglers so far."""

    def __init__(self, count: int, source: str = "lines", hold: float = DEFAULT_HOLD, *,
                 flag: bool = True) -> None:
        self.source, self.hold, self.flag = source, hold, flag
        self._instances = {i: _Instance() for i in range(count)}
        self._stragglers: list[dict[str, Any]] = []
        self._median: float | None = None  # the last median compared with

    def switch(self, source: str, now: float) -> None:
        """Progress is measured otherwise from now on (popdist.progress() was called): every
        count starts again; the stragglers so far stay, their flags closed."""
        self.source = source
        for index, inst in self._instances.items():
            running = inst.running
            self.ended(index, now)
            self._instances[index] = _Instance(running=running)

    def sample(self, index: int, step: int | None, total: int | None, now: float) -> None:
        """Instance `index`'s count now (None: none shown yet)."""
        inst = self._instances[index]
        if step is None or not holds(step, total):
            return
        if inst.step is not None and step < inst.step:  # its counter started again
            inst.samples.clear()
            inst.first = None
        inst.step, inst.total = step, total
        if inst.first is None:
            inst.first = (now, step)
        # Only changes are kept: a program that reports every few seconds (a pattern on a
        # line every 20 steps) must not read as stopped between its reports (see `rate`).
        if not inst.samples or step != inst.samples[-1][1]:
            inst.samples.append((now, step))
        # The window: from the last change at or before `hold` seconds ago; two changes at
        # least (the newest may be older than the window).
        while len(inst.samples) > 2 and inst.samples[1][0] <= now - self.hold:
            inst.samples.popleft()

    def ended(self, index: int, now: float) -> None:
        """It exited (or its host was lost): no longer compared; a flag it had is closed."""
        inst = self._instances[index]
        inst.running = False
        if inst.ended is None:
            inst.ended = now
        if inst.slow is not None:
            inst.slow["cleared"] = now
            inst.slow = None

    def rate(self, index: int, now: float) -> float | None:
        """Its progress over the last `hold` seconds, from the last change before them to
        its newest; None until `hold`/2 has passed since its first progress.

        A sparse reporter's newest change may be older than the window: then the rate is
        that of its last interval (newest change against the one before), until more time
        than that interval has gone by without a change, after which it decays (divided by
        the time since the earlier change). So a program logging every 6 s reads at its
        true rate between its lines, and one that stops reads as slowing down."""
        inst = self._instances[index]
        if inst.ended is not None:
            now = min(now, inst.ended)
        if inst.first is None or now - inst.first[0] < self.hold / 2:
            return None
        samples = inst.samples
        t1, c1 = samples[-1]
        if len(samples) < 2:  # one count: how fast it came is unknown, until a whole window
            return 0.0 if now - t1 >= self.hold else None  # passes without a change
        ref = 0  # the last change at or before the window's start, else the first
        for i in range(1, len(samples)):
            if samples[i][0] <= now - self.hold:
                ref = i
        t0, c0 = samples[min(ref, len(samples) - 2)]
        return (c1 - c0) / max(t1 - t0, now - t1)

    def report(self, now: float) -> Report:
        """Apply the rule at `now` (call it after each round of samples)."""
        rates = {i: self.rate(i, now) for i in self._instances}
        compared = {i: r for i, r in rates.items()
                    if r is not None and self._instances[i].running}
        for index, rate in compared.items():
            inst = self._instances[index]
            inst.min_rate = rate if inst.min_rate is None else min(inst.min_rate, rate)
        slow, middle = slow_rule(compared)
        # Fewer than two to compare (the others have ended): flags stay as they are, so the
        # one the job waits for at its end is still shown slow.
        for index in compared if self.flag and middle is not None else ():
            self._hold(index, index in slow, rates[index], middle, now)
        if middle is not None:
            self._median = middle
        return Report(self.source, {i: self._row(i, rates[i], now)
                                    for i in self._instances},
                      self._median, *self._slowest(rates),
                      tuple(dict(s) for s in self._stragglers))

    def _hold(self, index: int, breaks: bool, rate: float, middle: float, now: float) -> None:
        """The rule must hold (or, once flagged, not hold) for `hold` seconds in a row."""
        inst = self._instances[index]
        if breaks == (inst.slow is not None):  # as it stands: nothing to wait for
            inst.held_since = None
            return
        if inst.held_since is None:
            inst.held_since = now
        if now - inst.held_since < self.hold:
            return
        inst.held_since = None
        if inst.slow is None:
            inst.slow = {"instance": index, "when": now, "rate": round(rate, 3),
                         "median": round(middle, 3), "cleared": None}
            self._stragglers.append(inst.slow)
        else:
            inst.slow["cleared"] = now
            inst.slow = None

    def _row(self, index: int, rate: float | None, now: float) -> dict[str, Any]:
        inst = self._instances[index]
        mean = None
        if inst.first is not None and inst.samples and inst.samples[-1][0] > inst.first[0]:
            (t0, c0), (t1, c1) = inst.first, inst.samples[-1]
            mean = round((c1 - c0) / (t1 - t0), 3)
        return {"step": inst.step, "total": inst.total, "rate": _round(rate),
                "mean_rate": mean, "min_rate": _round(inst.min_rate),
                "slow": inst.slow is not None}

    def _slowest(self, rates: Mapping[int, float | None]) -> tuple[int | None, float | None]:
        """The running instance furthest behind (once none runs, the one that was), and its
        ETA at its own rate (with a total)."""
        counted = [(not inst.running, inst.step, i) for i, inst in self._instances.items()
                   if inst.step is not None]
        if not counted:
            return None, None
        _, step, index = min(counted)
        total, rate = self._instances[index].total, rates[index]
        eta = (max(0, total - step) / rate if total is not None and rate
               else 0.0 if total is not None and step >= total else None)
        return index, eta


def progress_line(progress: Mapping[str, Any] | None) -> str:
    """The job's progress in one line, as the dashboard's header, `poprunctl list` and
    `show` say it (from the record's `progress`): the slowest instance's step of the total,
    its rate and the ETA; "" while no instance counts steps."""
    if not progress or progress.get("source") == "lines" or progress.get("step") is None:
        return ""
    from poprun.text import duration

    total, rate, eta = progress.get("total"), progress.get("rate"), progress.get("eta")
    text = f"step {progress['step']}" + (f"/{total}" if total is not None else "")
    text += f" (instance {progress['slowest']})"
    if rate is not None:
        text += f" {rate:.3g}/s"
    if eta is not None:
        text += f" ETA {duration(eta)}"
    return text
