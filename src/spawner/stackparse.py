"""Python stacks as text and JSON, parsed into one shape; pure (no I/O but `linecache`).

Two producers (spawner/stackdump.py chooses):

- `faulthandler`, which `import popdist` registers under poprun (popdist/_stacks.py)::

      Thread 0x00007f1e6756f6c0 (most recent call first):
        File "/tmp/x.py", line 6 in worker
        File "/usr/lib/python3.11/threading.py", line 982 in run

      Current thread 0x00007f1e683beb80 (most recent call first):
        File "/tmp/x.py", line 9 in <module>

  (`  ...` marks a stack cut at 100 frames, a last `...` line more than 100 threads,
  `  <no Python frame>` a thread without one);
- `py-spy dump --json`: a list of threads, each with `thread_name`, `os_thread_id`, `active`
  and `frames` [{name, filename, line}], innermost first.

The shape: a list of threads, each `{"thread": str, "frames": [[file, line, function, code],
...], "truncated": bool}`, frames innermost first (where the thread is now, then its callers),
`code` the source line as the instance's host reads it ("" when it cannot).
"""

from __future__ import annotations

import json
import re
from typing import Any

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[dict[str, Any]]:
    """faulthandler's dump (one or several) as threads; lines it does not know are skipped."""
    threads: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            current = {"thread": head.group(2), "frames": [], "truncated": False}
            threads.append(current)
            continue
        if current is None:
            continue
        frame = _FRAME.match(line)
        if frame:
            current["frames"].append([frame.group(1), int(frame.group(2)), frame.group(3), ""])
        elif line.strip() == "...":
            current["truncated"] = True
    return threads


def parse_pyspy(text: str) -> list[dict[str, Any]]:
    """`py-spy dump --json`'s output as threads. Raises ValueError when it is not that."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy's output is not a list of threads")
    threads = []
    for thread in data:
        name = thread.get("thread_name") or f"0x{thread.get('thread_id', 0):x}"
        label = f"{name} ({'active' if thread.get('active') else 'idle'})"
        frames = [[str(f.get("filename")), int(f.get("line") or 0), str(f.get("name")), ""]
                  for f in thread.get("frames") or ()]
        threads.append({"thread": label, "frames": frames, "truncated": False})
    return threads


def with_source(threads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each frame's source line, read here (run this on the instance's host)."""
    import linecache

    for thread in threads:
        for frame in thread["frames"]:
            if not frame[3] and frame[1] > 0 and not frame[0].startswith("<"):
                frame[3] = linecache.getline(frame[0], frame[1]).strip()
    return threads
