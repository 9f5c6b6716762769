"""Folded output (`--fold-output`, `poprunctl logs --fold`): a line that several instances
write identically on the same stream comes out once, with the set of instances that wrote it.
Pure: bytes in, what to print out; times are passed in (the launcher's loop clock).

Per stream, the lines not yet printed wait in one queue of *runs*: a run is whole lines
(bytes) and the instances that wrote exactly them, in that order. An instance's block first
tries to join the runs already queued, a whole run at a time (one C-level compare for a run
of thousands of identical lines), splitting a run where the instance's lines stop agreeing
with it; what joins nothing becomes a run of its own, placed just before the next run the
instance joins (else at the end). Runs leave the queue from its head only, so:

- **Each instance's own order holds.** An instance joins a run only after its own last
  one (`_Lane.last`), and a new run goes after it: every line it wrote before is printed
  before, every line after, after.
- **A run is printed as soon as the instances that will write it are known**: when every
  instance still running has joined it or written something after it (an instance's last
  run lies at or beyond it: the queue's *watermark*). An instance that exited no longer
  counts; one that has written nothing on this stream yet might still write it.
- **No line waits more than `bound`** (100 ms): the head is printed by then with the
  instances that wrote it so far, and what waits behind it follows. A run is never younger
  than the one behind it (a run placed before another takes the other's age when it is
  older), so the head's bound is everyone's. An identical line written after its run was
  printed starts a run of its own (and prints on its own).

A block's trailing piece without a line end (a stream's last bytes, a 1 MiB piece of a
longer line, a `\\r` progress update) never folds: it waits in its instance's order and
prints as the instance's own, as does the `\\n` that ends a `\\r` (the router keeps that
line's state per instance).

The runs a line can join are found through an index, line -> the runs holding it (whole
dicts made at C speed), renewed every `bound`: a run still queued after two bounds (a loop
running late) is no longer found, so a late instance's line prints on its own rather than
being searched for. Consecutive runs printed with the same set of instances come out as one
block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

from poprun.text import fold_indices

BOUND = 0.1  # seconds a line may be held back at most
_GAP = 1 << 32  # between the order numbers of runs made one after another


class _Run:
    """Whole lines and the instances that wrote them; `order` places it in its queue."""

    __slots__ = ("data", "keys", "order", "born", "foldable", "next_part", "done")

    def __init__(self, data: bytes, keys: list, order: int, born: float,
                 foldable: bool = True) -> None:
        self.data, self.keys, self.order, self.born = data, keys, order, born
        self.foldable = foldable
        self.next_part: _Run | None = None  # the run split off its end, if any
        self.done = False  # printed


class _Lane:
    """One stream's queue."""

    __slots__ = ("fifo", "young", "old", "rotated", "last", "floor", "after_cr")

    def __init__(self, now: float) -> None:
        self.fifo: deque[_Run] = deque()
        # line (without its `\n`) -> the run made with it, or a tuple of such runs, in order
        self.young: dict[bytes, object] = {}
        self.old: dict[bytes, object] = {}
        self.rotated = now
        self.last: dict[Hashable, _Run] = {}  # each instance's last run
        self.floor = 0  # the order of the last run printed: every queued run's is above
        self.after_cr: set = set()  # instances whose last block ended with `\r`


# What comes out: (instances, stream, bytes): an instance's key alone, or a sorted tuple of
# two or more keys for a folded line.
Release = tuple[object, Hashable, bytes]


class Folder:
    """The folding of one job's console output (or of a log read after the fact)."""

    def __init__(self, instances: Iterable[Hashable] = (), bound: float = BOUND) -> None:
        self.bound = bound
        self._live = set(instances)
        self._lanes: dict[Hashable, _Lane] = {}

    def start(self, instances: Iterable[Hashable]) -> list[Release]:
        """A new set of instances (a new attempt): everything held is printed first."""
        out = self.flush()
        self._lanes.clear()
        self._live = set(instances)
        return out

    def add(self, key: Hashable, stream: Hashable, data: bytes, now: float) -> list[Release]:
        """A block of instance `key`'s output; returns what can be printed now."""
        lane = self._lanes.get(stream)
        if lane is None:
            lane = self._lanes[stream] = _Lane(now)
        if now - lane.rotated >= self.bound:
            lane.old, lane.young, lane.rotated = lane.young, {}, now
        pos, end = 0, len(data)
        if key in lane.after_cr:
            lane.after_cr.discard(key)
            if data.startswith(b"\n"):  # ends the instance's `\r` line: its own
                self._put_own(lane, key, b"\n", now)
                pos = 1
        if data.endswith(b"\r"):
            lane.after_cr.add(key)
        cut = data.rfind(b"\n") + 1
        if cut > pos:
            self._take(lane, key, data, pos, cut, now)
        if max(cut, pos) < end:
            self._put_own(lane, key, data[max(cut, pos):], now)
        return self._ripe(lane, stream)

    def exited(self, key: Hashable) -> list[Release]:
        """Instance `key` will write no more (exited, or lost with its host)."""
        self._live.discard(key)
        out: list[Release] = []
        for stream, lane in self._lanes.items():
            out += self._ripe(lane, stream)
        return out

    def expire(self, now: float) -> list[Release]:
        """What has waited `bound` (and what waits behind it, ripe)."""
        out: list[Release] = []
        for stream, lane in self._lanes.items():
            fifo, runs = lane.fifo, []
            while fifo and fifo[0].born + self.bound <= now:
                runs.append(_release(lane))
            out += _blocks(stream, runs) + self._ripe(lane, stream)
        return out

    def flush(self) -> list[Release]:
        """Everything held, now (the job's end)."""
        out: list[Release] = []
        for stream, lane in self._lanes.items():
            out += _blocks(stream, [_release(lane) for _ in range(len(lane.fifo))])
        return out

    def deadline(self) -> float | None:
        """When the oldest held line must be printed; None when none is held."""
        heads = [lane.fifo[0].born for lane in self._lanes.values() if lane.fifo]
        return min(heads) + self.bound if heads else None

    @property
    def held(self) -> int:
        """How many runs wait."""
        return sum(len(lane.fifo) for lane in self._lanes.values())

    # --- joining ------------------------------------------------------------------------

    def _take(self, lane: _Lane, key: Hashable, data: bytes, pos: int, cut: int,
              now: float) -> None:
        """The whole lines data[pos:cut] of instance `key`: joined to the runs they match,
        the rest made runs of their own."""
        while pos < cut:
            nl = data.index(b"\n", pos)
            target, offset = self._find(lane, data[pos:nl], key)
            if target is None:
                stop, target, offset = self._unmatched(lane, data, nl + 1, cut, key)
                if offset:  # the lines before this one go before it, not before the run
                    target, offset = self._split(lane, target, offset), 0
                self._put(lane, key, data[pos:stop], target, now)
                pos = stop
                if target is None:
                    return
            if offset:
                target = self._split(lane, target, offset)
            run = target.data
            if data.startswith(run, pos, cut):
                taken = len(run)
            else:  # they part at a line inside the run: it is split there
                taken = _common_lines(data, pos, cut, run)
                self._split(lane, target, taken)
            target.keys.append(key)
            lane.last[key] = target
            pos += taken

    def _find(self, lane: _Lane, line: bytes, key: Hashable) -> tuple[_Run | None, int]:
        """The first queued run after instance `key`'s last holding `line` at a line start,
        and the line's offset in it."""
        mine = lane.last.get(key)
        after = mine.order if mine is not None else lane.floor  # (a printed run's is lower)
        for index in (lane.old, lane.young):
            found = index.get(line)
            if found is None:
                continue
            for root in _runs(found):
                part = root
                while part is not None:
                    if not part.done and part.order > after:
                        data = part.data
                        if data.startswith(line) and data[len(line):len(line) + 1] == b"\n":
                            return part, 0
                        at = data.find(b"\n" + line + b"\n")
                        if at >= 0:
                            return part, at + 1
                    part = part.next_part
        return None, 0

    def _unmatched(self, lane: _Lane, data: bytes, pos: int, cut: int,
                   key: Hashable) -> tuple[int, _Run | None, int]:
        """From `pos`, the first line that joins a run: (its offset in data, the run, the
        line's offset in the run); (cut, None, 0) when none does."""
        if pos >= cut or not lane.fifo:
            return cut, None, 0
        lines = data[pos:cut].split(b"\n")
        lines.pop()
        known = set(lines)
        hits = (known & lane.young.keys()) | (known & lane.old.keys())
        if not hits:  # the usual case for lines that differ: no line-by-line work
            return cut, None, 0
        # Found by run, not by line (a late instance's lines are those of runs printed
        # already: searching each run for each line would cost per line).
        mine = lane.last.get(key)
        after = mine.order if mine is not None else lane.floor
        found = set(map(lane.young.get, hits)) | set(map(lane.old.get, hits))
        found.discard(None)
        live = {value for value in found
                if any(_open_after(root, after) for root in _runs(value))}
        if not live:
            return cut, None, 0
        young, old = lane.young.get, lane.old.get
        for line in lines:
            if young(line) in live or old(line) in live:
                target, offset = self._find(lane, line, key)
                if target is not None:
                    return pos, target, offset
            pos += len(line) + 1
        return cut, None, 0

    # --- the queue ----------------------------------------------------------------------

    def _put(self, lane: _Lane, key: Hashable, data: bytes, before: _Run | None,
             now: float, foldable: bool = True) -> _Run:
        """A new run of instance `key`, just before `before` (else at the end)."""
        fifo = lane.fifo
        if before is None:
            order = (fifo[-1].order if fifo else lane.floor) + _GAP
            run = _Run(data, [key], order, now, foldable)
            fifo.append(run)
        else:
            at = fifo.index(before)
            run = _Run(data, [key], self._between(lane, at), min(now, before.born), foldable)
            fifo.insert(at, run)
        lane.last[key] = run
        if foldable:
            _register(lane.young, data, run)
        return run

    def _put_own(self, lane: _Lane, key: Hashable, data: bytes, now: float) -> None:
        """A piece that never folds, right after the instance's last run: so placed, it
        keeps the instance from joining nothing queued after it."""
        fifo, mine = lane.fifo, lane.last.get(key)
        at = fifo.index(mine) + 1 if mine is not None and not mine.done else 0
        self._put(lane, key, data, fifo[at] if at < len(fifo) else None, now, foldable=False)

    def _split(self, lane: _Lane, run: _Run, at: int) -> _Run:
        """Cut `run` after its first `at` bytes (a line end); returns the second part, which
        follows it in the queue with the same instances."""
        rest = _Run(run.data[at:], list(run.keys), 0, run.born, run.foldable)
        run.data = run.data[:at]
        rest.next_part, run.next_part = run.next_part, rest
        fifo = lane.fifo
        after = fifo.index(run) + 1
        rest.order = self._between(lane, after)
        fifo.insert(after, rest)
        for key in rest.keys:  # its instances are past both parts
            if lane.last.get(key) is run:
                lane.last[key] = rest
        return rest

    def _between(self, lane: _Lane, at: int) -> int:
        """An order number for a run to be inserted at fifo position `at`."""
        fifo = lane.fifo
        low = fifo[at - 1].order if at else lane.floor
        high = fifo[at].order if at < len(fifo) else low + 2 * _GAP
        if high - low < 2:  # no room left between them: number the queue afresh
            for i, run in enumerate(fifo):
                run.order = lane.floor + (i + 1) * _GAP
            return self._between(lane, at)
        return (low + high) // 2

    def _ripe(self, lane: _Lane, stream: Hashable) -> list[Release]:
        """The head runs that every running instance has joined or gone past."""
        fifo = lane.fifo
        if not fifo:
            return []
        last, floor = lane.last, lane.floor
        low = min((last[k].order if k in last else floor for k in self._live),
                  default=None)
        runs = []
        while fifo and (low is None or fifo[0].order <= low):
            runs.append(_release(lane))
        return _blocks(stream, runs)


def _release(lane: _Lane) -> _Run:
    """The head run, printed."""
    run = lane.fifo.popleft()
    run.done = True
    lane.floor = run.order
    return run


def _blocks(stream: Hashable, runs: list[_Run]) -> list[Release]:
    """Printed runs as blocks: consecutive whole lines of the same instances together."""
    out: list[Release] = []
    parts: list[bytes] = []
    keys: object = None
    for run in runs:
        these = run.keys[0] if len(run.keys) == 1 else tuple(sorted(run.keys))
        if parts and (these != keys or not run.foldable or not parts[-1].endswith(b"\n")):
            out.append((keys, stream, b"".join(parts)))
            parts = []
        keys = these
        parts.append(run.data)
    if parts:
        out.append((keys, stream, b"".join(parts)))
    return out


def _runs(found: object) -> tuple:
    """An index's value as runs."""
    return () if found is None else found if type(found) is tuple else (found,)


def _open_after(root: _Run, after: int) -> bool:
    """Whether a part of `root` is still queued after order `after`."""
    return any(not part.done and part.order > after for part in _parts(root))


def _register(index: dict, data: bytes, run: _Run) -> None:
    """Every line of `run` found from now on through `index`, after the queued runs that
    hold it too (the runs already printed that held it are forgotten)."""
    lines = data.split(b"\n")
    lines.pop()
    new = dict.fromkeys(lines, run)
    again = new.keys() & index.keys()
    if again:  # by run, not by line: a late instance repeats every line of printed runs
        held = {value for value in set(map(index.get, again))
                if any(not part.done for root in _runs(value) for part in _parts(root))}
        for line in again if held else ():
            if index[line] in held:
                new[line] = _runs(index[line]) + (run,)
    index.update(new)


def _parts(root: _Run):
    part = root
    while part is not None:
        yield part
        part = part.next_part


def _common_lines(data: bytes, pos: int, cut: int, run: bytes) -> int:
    """How many bytes of whole lines data[pos:cut] and `run` share from their starts (their
    first line is known to be the same)."""
    view = memoryview(run)
    low = run.index(b"\n") + 1  # agreeing
    high = min(len(run), cut - pos)  # past the longest possible agreement... or at it
    while low < high:  # the longest agreeing prefix, by halves (each compare in C)
        mid = (low + high + 1) // 2
        if data.startswith(view[:mid], pos):
            low = mid
        else:
            high = mid - 1
    return run.rfind(b"\n", 0, low) + 1


def tag_label(key: Hashable) -> str:
    """Who wrote a line, in its tag: `3`, or `0-62` / `{1,3}` for a folded line's set. A set
    with a comma is braced: `[1,{1,3}]` could not be told from three fields, and `[1,1,3]`
    nor `[1,3]` from instance 3's own tag."""
    if type(key) is not tuple:
        return str(key)
    label = fold_indices(key)[1:-1]
    return "{%s}" % label if "," in label else label
