"""Reading a running instance's Python stacks, on its own host (the launcher for local
instances, the agent for remote ones): `await collect(pid, timeout)`.

In order:

1. The instance imported `popdist` (popdist/_stacks.py): its environment names a dump file
   and a signal, and /proc says it catches that signal. The file is emptied, the signal sent
   to the process (not its group: forked workers inherit the handler), and the dump read once
   it has stopped growing. faulthandler writes from the signal handler, so this works while
   the program is stuck in a sleep, a lock, a socket read or a C call.
2. Any other Python program: `py-spy dump --json`, when py-spy is installed (on PATH, or
   beside this Python: `pip install 'poprun[stacks]'`).
3. Otherwise one line says why there is nothing (not a Python program, no py-spy, gone...).

Each step is bounded by `timeout`; nothing here can hang. The signal is only ever sent to a
process that catches it: poprun's default signal would otherwise terminate it. Standard
library only, Python 3.10 (the agent runs it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
from collections.abc import Mapping
from typing import Any

from popdist._stacks import signal_number
from popdist.env import DEFAULT_STACKS_SIGNAL, STACKS_FILE, STACKS_SIGNAL

from .procid import children
from .untrusted import open_regular, read_regular
from .within import bounded


POLL = 0.01  # seconds between looks at the dump file
SETTLED = 0.03  # the dump is complete once its size has not changed for this long
MAX_DUMP = 4 << 20  # bytes of a dump read at most
PYSPY_AT_ONCE = 8  # py-spy processes at a time (each attaches with ptrace)
_locks: dict[str, asyncio.Lock] = {}  # one dump at a time per file
_pyspy_slots: asyncio.Semaphore | None = None


def instance_env(error_file: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What the spawner adds to an instance's environment: its dump file (beside its error
    file, in the spawner's private directory) and the signal (`environ`'s own choice, else
    the default)."""
    stem = error_file[:-5] if error_file.endswith(".json") else error_file
    return {STACKS_FILE: stem + ".stacks",
            STACKS_SIGNAL: environ.get(STACKS_SIGNAL) or DEFAULT_STACKS_SIGNAL}


def result(pid: int, how: str | None = None, threads: list | None = None,
           error: str | None = None) -> dict[str, Any]:
    """One instance's answer, as it travels (the agent's STACKS reply)."""
    return {"pid": pid, "how": how, "threads": threads or [], "error": error}


async def collect(pid: int, timeout: float, pyspy: str | None = None) -> dict[str, Any]:
    """The stacks of the instance whose process is `pid` (or, when that is not Python, of
    its first Python descendant: a shell wrapper). Never raises, never waits past
    `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        target = _python_process(pid)
        if target is None:
            return result(pid, error=_not_python(pid))
        environ = _environ(target)
        number = signal_number(environ.get(STACKS_SIGNAL) or DEFAULT_STACKS_SIGNAL)
        path = environ.get(STACKS_FILE)
        if path and number and os.path.exists(path) and catches(target, number):
            return await _by_signal(target, path, number, deadline)
        pyspy = pyspy or find_pyspy()
        if pyspy is None:
            return result(target, error="a Python program that has not imported popdist, and "
                          "py-spy is not installed here (pip install 'poprun[stacks]')")
        return await _by_pyspy(target, pyspy, deadline)
    except ProcessLookupError:
        return result(pid, error="exited")
    except Exception as exc:  # noqa: BLE001 - one instance's problem is one line, not a bug
        return result(pid, error=f"cannot read its stacks: {type(exc).__name__}: {exc}")


def _size(path: str) -> int:
    """The dump's size so far (0: none, or not a file the instance may have made)."""
    try:
        info = os.lstat(path)
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def find_pyspy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def catches(pid: int, number: int) -> bool:
    """Whether `pid` has a handler for signal `number` (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (number - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


async def _by_signal(pid: int, path: str, number: int, deadline: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    lock = _locks.setdefault(path, asyncio.Lock())
    async with lock:
        try:  # the instance's to replace: never a FIFO's open or a link's target
            fd = open_regular(path, os.O_WRONLY | os.O_TRUNC)
        except OSError as exc:
            return result(pid, "popdist", error=f"its stacks file: {exc.strerror}")
        os.close(fd)  # truncated: popdist appends (O_APPEND), the dump starts at 0
        os.kill(pid, number)
        size, since = 0, loop.time()
        while True:
            await asyncio.sleep(POLL)
            now = loop.time()
            current = _size(path)
            if current != size:
                size, since = current, now
            elif size and now - since >= SETTLED:
                break
            if now >= deadline:
                if size:
                    break  # what came so far
                if not os.path.exists(f"/proc/{pid}"):
                    raise ProcessLookupError(pid)
                return result(pid, "popdist", error="no answer to its stacks signal in time "
                              "(stopped, or in an uninterruptible wait?)")
        text = (read_regular(path, MAX_DUMP, cut=True) or b"").decode("utf-8", "replace")
    from .stackparse import parse_faulthandler, with_source  # only when stacks are asked for

    threads = parse_faulthandler(text)
    return result(pid, "popdist", with_source(threads),
                  None if threads else "its stacks dump was empty")


async def _by_pyspy(pid: int, pyspy: str, deadline: float) -> dict[str, Any]:
    global _pyspy_slots
    loop = asyncio.get_running_loop()
    if _pyspy_slots is None:
        _pyspy_slots = asyncio.Semaphore(PYSPY_AT_ONCE)
    async with _pyspy_slots:
        proc = await asyncio.create_subprocess_exec(
            pyspy, "dump", "--json", "--pid", str(pid), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await bounded(proc.communicate(), max(0.1, deadline - loop.time()))
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return result(pid, "py-spy", error="py-spy did not answer in time")
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
    if proc.returncode != 0:
        lines = [line for line in err.decode("utf-8", "replace").splitlines()
                 if line.strip() and not line.startswith((" ", "Stack backtrace"))]
        return result(pid, "py-spy", error=f"py-spy: {lines[0] if lines else 'failed'}")
    from .stackparse import parse_pyspy, with_source

    try:
        threads = parse_pyspy(out.decode("utf-8", "replace"))
    except ValueError as exc:
        return result(pid, "py-spy", error=f"py-spy: {exc}")
    return result(pid, "py-spy", with_source(threads))


def _python_process(pid: int) -> int | None:
    """`pid` when it runs Python, else its first Python descendant (breadth first, a few
    levels: `sh -c 'python3 train.py'`); None when neither. ProcessLookupError: no `pid`."""
    if not os.path.exists(f"/proc/{pid}"):
        raise ProcessLookupError(pid)
    level = [pid]
    for _ in range(4):
        for candidate in level:
            if _is_python(candidate):
                return candidate
        level = [child for parent in level for child in sorted(children(parent))]
        if not level:
            break
    return _contained_python(pid)


def _contained_python(pid: int) -> int | None:
    """The instance's Python process when it is not below `pid`: a container runtime
    whose processes are another's children (podman's are conmon's) passes the instance
    its environment, so it is the Python process whose stacks file is `pid`'s
    (spawner/containers.py); the first of them, not a worker it forked."""
    path = _environ(pid).get(STACKS_FILE)
    if not path:
        return None
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid and _is_python(int(entry)) \
                and _environ(int(entry)).get(STACKS_FILE) == path:
            found.append(int(entry))
    from .procid import start_ticks

    return min(found, key=lambda p: start_ticks(p) or 0, default=None)


def _is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return exe.startswith(("python", "pypy"))


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (entry.partition(b"=") for entry in raw.split(b"\0") if entry)
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, _, v in pairs}


def _not_python(pid: int) -> str:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = "unknown"
    return f"not a Python program ({exe}): no Python stacks"


async def collect_all(pids: Mapping[int, int], timeout: float) -> dict[str, dict[str, Any]]:
    """`collect()` for every instance at once: {str(key): its result} (JSON's keys)."""
    found = await asyncio.gather(*(collect(pid, timeout) for pid in pids.values()))
    return {str(key): one for key, one in zip(pids, found)}


_answering: set[asyncio.Task] = set()  # running collections (the loop keeps weak refs only)


def answer(pids: Mapping[int, int], timeout: float, reply) -> None:
    """The agent's STACKS: collect in the background, then `reply(stacks)`."""
    task = asyncio.get_running_loop().create_task(collect_all(pids, timeout))
    _answering.add(task)

    def done(task: asyncio.Task) -> None:
        _answering.discard(task)
        if not task.cancelled():
            reply(task.result())

    task.add_done_callback(done)
