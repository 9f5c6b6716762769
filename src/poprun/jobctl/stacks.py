"""Where every instance is: their Python stacks gathered in parallel and *folded*.

Folding, as LLNL's STAT does across ranks: every thread of every instance whose stack is the
same (the same frames, file, line and function, thread ids aside) is printed once, with the set
of instances it was seen in; the groups seen in the fewest instances come first, so the one
rank that is somewhere else stands out. An instance that gave no stacks gets one line saying
why, folded the same way.

`fold()` and `render()` are pure. `gather()` asks each host: this host's instances through
spawner/stackdump.py, the others through their agents (RemoteSpawner.stacks), all at once,
bounded by one timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from poprun.text import fold_indices

DEFAULT_TIMEOUT = 5.0  # seconds to gather the stacks of a job

Frame = tuple[str, int, str, str]  # file, line, function, source line


@dataclass(frozen=True)
class Group:
    """Threads with the same stack, in these instances."""

    frames: tuple[Frame, ...]  # innermost first: where the threads are now, then callers
    instances: tuple[int, ...]
    threads: int  # how many threads in all (an instance may have several here)
    names: tuple[str, ...] = ()  # thread names where known (py-spy), a few

    def to_json(self) -> dict[str, Any]:
        return {"instances": list(self.instances), "threads": self.threads,
                "names": list(self.names),
                "frames": [{"file": f, "line": n, "function": fn, "code": code}
                           for f, n, fn, code in self.frames]}


@dataclass(frozen=True)
class NoStacks:
    """Instances that gave no stacks, for this reason."""

    reason: str
    instances: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"instances": list(self.instances), "reason": self.reason}


@dataclass(frozen=True)
class Folded:
    groups: tuple[Group, ...]
    missing: tuple[NoStacks, ...]
    instances: tuple[int, ...]  # every instance asked

    def to_json(self) -> dict[str, Any]:
        return {"instances": list(self.instances),
                "groups": [g.to_json() for g in self.groups],
                "no_stacks": [m.to_json() for m in self.missing]}


def fold(results: Mapping[int, Mapping[str, Any]]) -> Folded:
    """`results`: per instance, what stackdump.collect() answered ({pid, how, threads,
    error})."""
    by_stack: dict[tuple, list] = {}
    by_reason: dict[str, list[int]] = {}
    for index in sorted(results):
        answer = results[index] or {}
        threads = answer.get("threads") or []
        if not threads:
            reason = answer.get("error") or "no stacks"
            by_reason.setdefault(reason, []).append(index)
            continue
        for thread in threads:
            frames = tuple((str(f[0]), int(f[1]), str(f[2]), str(f[3]) if len(f) > 3 else "")
                           for f in thread.get("frames") or ())
            key = tuple(f[:3] for f in frames)
            entry = by_stack.setdefault(key, [frames, [], 0, []])
            entry[1].append(index)
            entry[2] += 1
            name = str(thread.get("thread") or "")
            if name and not name.startswith("0x") and name not in entry[3]:
                entry[3].append(name)
    groups = [Group(frames, tuple(sorted(set(indices))), count, tuple(names[:3]))
              for frames, indices, count, names in by_stack.values()]
    groups.sort(key=lambda g: (len(g.instances), g.instances, -len(g.frames)))
    missing = [NoStacks(reason, tuple(indices)) for reason, indices in by_reason.items()]
    missing.sort(key=lambda m: (len(m.instances), m.instances))
    return Folded(tuple(groups), tuple(missing), tuple(sorted(results)))


def render(folded: Folded, title: str | None = None, base: str | None = None) -> str:
    """The folded stacks as text: each group's instances, then its frames innermost first
    (`file:line in function` and the source line), the odd ones out first. Files under
    `base` (the job's working directory) are shown relative to it."""
    prefix = base.rstrip("/") + "/" if base else None
    total = len(folded.instances)
    lines = []
    if title:
        lines.append(title)
    if not folded.instances:
        lines.append("no instance is running")
    for group in folded.groups:
        seen = len(group.instances)
        threads = f", {group.threads} threads" if group.threads > seen else ""
        names = f" ({', '.join(group.names)})" if group.names else ""
        lines.append(f"instances {fold_indices(group.instances)} ({seen} of {total}"
                     f"{threads}){names}:")
        if not group.frames:
            lines.append("    (no Python frame)")
        where = [_where(f, prefix) for f in group.frames]
        width = max(map(len, where), default=0)
        for frame, place in zip(group.frames, where):
            code = f"   {frame[3]}" if frame[3] else ""
            lines.append(f"    {place:<{width}}{code}".rstrip())
    for missing in folded.missing:
        lines.append(f"instances {fold_indices(missing.instances)}: no stacks: "
                     f"{missing.reason}")
    return "\n".join(lines) + "\n"


def _where(frame: Frame, prefix: str | None = None) -> str:
    path = frame[0]
    if prefix and path.startswith(prefix):
        path = path[len(prefix):]
    return f"{path}:{frame[1]} in {frame[2]}"


async def gather(job, keys: Iterable[int] | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> dict[int, dict[str, Any]]:
    """The stacks of the job's running instances (`keys`: only these), from every host at
    once: {instance: {pid, how, threads, error}}. An instance asked for that does not run
    gets a reason; a host that cannot answer, one reason for each of its instances."""
    from spawner.stackdump import collect_all

    running = set(job.running())
    wanted = sorted(running if keys is None else set(keys))
    out: dict[int, dict[str, Any]] = {}
    local: dict[int, int] = {}
    remote: dict[object, list[int]] = {}
    for key in wanted:
        if key not in running:
            out[key] = {"pid": None, "how": None, "threads": [], "error": _not_running(job, key)}
        elif job.spawner_of[key] is job.local:
            local[key] = job.started[key].pid
        else:
            remote.setdefault(job.spawner_of[key], []).append(key)
    asks = [collect_all(local, timeout)] if local else []
    asks += [spawner.stacks(keys_there, timeout) for spawner, keys_there in remote.items()]
    answers = await asyncio.gather(*asks, return_exceptions=True)
    if local:
        found, answers = answers[0], answers[1:]
        out.update({int(k): v for k, v in found.items()})
    for (spawner, keys_there), answer in zip(remote.items(), answers):
        if isinstance(answer, BaseException):
            reason = f"{spawner.host}: {getattr(answer, 'reason', None) or answer}"
            answer = {k: {"pid": None, "how": None, "threads": [], "error": reason}
                      for k in keys_there}
        for key in keys_there:
            out[key] = answer.get(key) or {"pid": None, "how": None, "threads": [],
                                           "error": "its host did not answer for it"}
    return dict(sorted(out.items()))


def _not_running(job, key: int) -> str:
    if job.plan is None or not 0 <= key < len(job.plan.instances):
        return "no such instance"
    record = job.started.get(key)
    if record is None:
        return "not started"
    return "not running (it has ended)"
