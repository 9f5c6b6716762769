"""Starting, watching and stopping processes on this host.

Each process gets its own session (so its own process group: a signal to the group reaches the
dataloader workers it starts), pipes for stdout and stderr, and a pidfd that tells the event
loop when it exits. Nothing runs in Python between fork and exec, which keeps spawning on the
fast vfork path (docs/architecture.md, "Measured reasons"); the lifeline (see lifeline.py) does the orphan duty instead.

Output is delivered as blocks of whole lines: a block always ends with `\\n` or `\\r`, so a
consumer can tag or interleave blocks without splitting a line. Two kinds of block end without
one: the last bytes before EOF, and a piece of a line longer than `LINE_CAP` (memory stays
bounded whatever the line length; the consumer decides: poprun's router writes such a block
as it is, or as a tagged line).
The exit of a process is reported only after both of its pipes are drained, so no output
arrives after its exit event.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from popdist.env import ERROR_FILE, PROGRESS_FILE

from . import containment
from .binding import bound, memory_binding_unavailable
from .containment import Cgroups
from .lifeline import Lifeline
from .oomkills import OomWatch
from .uncompiled import dataclass
from .untrusted import read_regular

if TYPE_CHECKING:  # imported where an instance has one
    from .containers import Container

# Each instance's pipes are grown to this (F_SETPIPE_SZ; the kernel's default is 64 KiB): per
# byte, a busy writer waits, and poprun wakes and reads, less often
# (docs/architecture.md, "Output plumbing").
PIPE_SIZE = 1 << 20
# ...but poprun adds at most this much pipe memory in all: an unprivileged user's pipes past
# fs.pipe-user-pages-soft (64 MiB by default) leave every new pipe of that user, another
# program's too, 8 KiB. Past it, pipes keep their default size.
PIPE_GROWTH_BUDGET = 16 << 20
DEFAULT_PIPE_SIZE = 65536  # Linux's, for a user within fs.pipe-user-pages-soft
# One pipe's worth.
READ_SIZE = PIPE_SIZE
# An instance's error file (popdist/errorfile.py) is read up to this size.
MAX_ERROR_FILE = 256 * 1024
# The longest line kept whole; a longer one is delivered in pieces of this size (--help says so).
LINE_CAP = 1 << 20
# After an instance exits, its group's leftovers are SIGKILLed; a process that escaped the
# group (setsid) may still hold the pipes: stop waiting for their EOF after this long.
PIPE_DRAIN_TIMEOUT = 2.0


class Stream(enum.IntEnum):
    """Which of a process's output streams a block came from."""

    STDOUT = 1
    """The process's standard output."""
    STDERR = 2
    """The process's standard error."""


@dataclass(frozen=True)
class ProcessSpec:
    """How to start one process."""

    key: int  # the caller's name for it (the instance index)
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None = None
    merge_stderr: bool = False  # stderr into the stdout pipe
    inherit_stdin: bool = False  # otherwise stdin is /dev/null
    cpus: tuple[int, ...] | None = None  # CPU binding (None: not bound)
    mems: tuple[int, ...] | None = None  # memory node binding (None: not bound)
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (its PMI socket: spawner/pmi.py)
    container: Container | None = None  # run inside it (spawner/containers.py)

    def __init__(self, key, argv, env, cwd=None, merge_stderr=False, inherit_stdin=False,
                 cpus=None, mems=None, pass_fds=(), container=None):  # by hand (uncompiled)
        self.__dict__.update(key=key, argv=argv, env=env, cwd=cwd, merge_stderr=merge_stderr,
                             inherit_stdin=inherit_stdin, cpus=cpus, mems=mems,
                             pass_fds=pass_fds, container=container)


class EventLoop(Protocol):
    """What the spawner needs of an event loop: asyncio's (the agent narrows it with a gate
    that can pause the pipes' readers)."""

    def add_reader(self, fd: int, callback: Callable[..., Any], *args: Any) -> None: ...

    def remove_reader(self, fd: int) -> bool: ...

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Any: ...

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any: ...


class Sink(Protocol):
    """Receives what processes do. Called on the event loop's thread."""

    def on_output(self, key: int, stream: Stream, data: bytes) -> None: ...

    def on_exit(self, key: int, returncode: int) -> None:
        """`returncode` as subprocess gives it: negative for a signal."""


def resolve_program(name: str, path: str | None, cwd: str) -> str | None:
    """The executable `name` runs as, or None. Like mpirun, a program in the current directory
    runs without `./` when it is not found on PATH."""
    if os.sep in name:
        full = os.path.join(cwd, name)
        return name if os.path.isfile(full) and os.access(full, os.X_OK) else None
    found = shutil.which(name, path=path)
    if found:
        return name
    local = os.path.join(cwd, name)
    return local if os.path.isfile(local) and os.access(local, os.X_OK) else None


# What a start needs once prepared (LocalSpawner._prepare): argv, environment, the command
# that removes its container, and where its program is found inside the container.
_Prepared = tuple[Sequence[str], dict[str, str], "list[str] | None", "tuple[str, bytes] | None"]


class _Child:
    __slots__ = ("spec", "proc", "pidfd", "open_fds", "pending", "grown", "returncode",
                 "reported", "removal", "inside", "held")

    def __init__(self, spec: ProcessSpec, proc: subprocess.Popen) -> None:
        self.spec = spec
        self.proc = proc
        self.pidfd = -1
        self.open_fds: dict[int, Stream] = {}
        self.pending: dict[int, bytearray] = {}
        self.grown: dict[int, int] = {}  # fd -> bytes its pipe was grown by (LocalSpawner._grow)
        self.returncode: int | None = None
        self.reported = False
        self.removal: list[str] | None = None  # removes its container (spawner/containers.py)
        # Where the runtime writes the program's pid, and the entry of the program's
        # environment that tells it: for a runtime whose process is not the program's
        # ancestor (spawner/inside.py); None: signals go to the runtime's group.
        self.inside: tuple[str, bytes] | None = None
        self.held: int | None = None  # a signal held until the program runs (inside.py)


class LocalSpawner:
    """Owns every process it starts: `close()` leaves none of them (or their groups) alive."""

    def __init__(self, sink: Sink, loop: EventLoop, lifeline: Lifeline | None = None, *,
                 cgroups: bool = True) -> None:
        self._sink = sink
        self._loop = loop
        self._lifeline = lifeline
        self._children: dict[int, _Child] = {}
        # Each instance in a cgroup of its own where possible (containment.py); decided on
        # the first spawn. False: not possible here, or not wanted.
        # Each instance's uncaught exception, from the file popdist writes (read at its exit):
        # {type, message, file, line, function, traceback, time}.
        self.errors: dict[int, dict[str, Any]] = {}
        # Each instance the kernel's OOM killer ended: how many processes it killed in the
        # instance's memory cgroup while it ran (oomkills.py: the evidence, not the SIGKILL).
        self.oom_kills: dict[int, int] = {}
        self._oom = OomWatch()
        self._error_dir: str | None = None
        wanted = cgroups and os.environ.get(containment.CGROUPS_SWITCH) != "0"
        self._cgroups: Cgroups | bool | None = None if wanted and lifeline else False
        self._tracking = False  # the lifeline learns the instances' descendants (no cgroups)
        self._pipe_growth = 0  # bytes the grown pipes hold above the default (PIPE_GROWTH_BUDGET)
        self._read_buffer = bytearray(READ_SIZE)  # every pipe is read into it (_on_readable)
        self._removals: list[tuple[subprocess.Popen, list[str]]] = []  # containers going
        # A memory binding was asked for but this host cannot do it: why (binding.py's
        # memory_binding_unavailable), for the caller's one warning; the CPU binding is in
        # force regardless. None: nothing skipped.
        self.memory_binding_skipped: str | None = None

    # --- starting ---------------------------------------------------------------------

    def spawn(self, spec: ProcessSpec) -> int:
        """Start one process; returns its pid. Raises OSError when it cannot be started."""
        argv, env, removal, inside = self._prepare(spec)
        return self._register(spec, *_popen(spec, argv, env), removal, inside)

    async def spawn_many(self, specs: Sequence[ProcessSpec]) -> list[int | OSError]:
        """Start these processes at once; for each, its pid or why it could not start.
        Popen returns only once its child has exec'd (vfork): one after another, each start
        waits for the one before to be scheduled, which a loaded host makes slow; in threads
        they overlap, as Hydra's proxy forks every process before any of them runs
        (MPI_Comm_spawn's children: bench/spawn_bench.py)."""
        import asyncio

        loop = asyncio.get_running_loop()
        prepared: list[_Prepared | OSError] = []
        for spec in specs:
            try:
                prepared.append(self._prepare(spec))
            except OSError as exc:
                prepared.append(exc)
        started = await asyncio.gather(*(
            loop.run_in_executor(None, _popen, spec, ready[0], ready[1])
            for spec, ready in zip(specs, prepared) if not isinstance(ready, OSError)),
            return_exceptions=True)
        outcomes: list[int | OSError] = []
        for spec, ready in zip(specs, prepared):
            if isinstance(ready, OSError):
                outcomes.append(ready)
                continue
            done = started.pop(0)
            if isinstance(done, BaseException):
                if not isinstance(done, OSError):
                    raise done
                outcomes.append(done)
            else:
                outcomes.append(self._register(spec, *done, ready[2], ready[3]))
        return outcomes

    def _prepare(self, spec: ProcessSpec) -> _Prepared:
        """`spec`'s argv and environment as they start it (contained, in its container),
        what removes its container, and where to find the program inside it (`_Child.
        inside`, for a runtime that is not its ancestor); OSError where its program cannot
        run."""
        env = dict(spec.env)
        if self._lifeline:
            env[containment.MARK] = self._lifeline.token
        env[ERROR_FILE] = self._error_file(spec.key)
        env[PROGRESS_FILE] = env[ERROR_FILE][:-len("json")] + "progress"  # popdist makes it
        # Imported here: stackdump needs asyncio, which `poprun --version` must not import.
        from . import stackdump

        env.update(stackdump.instance_env(env[ERROR_FILE], env))  # popdist/_stacks.py
        argv, env, removal, pidfile = _in_container(spec, env, self._make_error_dir)
        argv = self._contained(spec, env, argv)
        if self._lifeline and not self._tracking and not self._has_cgroups():
            # its helpers are found by their ancestry only
            self._lifeline.track_descendants(containment.is_subreaper())
            self._tracking = True
        inside = (pidfile, f"{ERROR_FILE}={env[ERROR_FILE]}".encode()) if pidfile else None
        return argv, env, removal, inside

    def _register(self, spec: ProcessSpec, proc: subprocess.Popen, memory_bound: bool,
                  removal: list[str] | None, inside: tuple[str, bytes] | None) -> int:
        """Watch a started process: its group for the lifeline, its pipes, its exit."""
        if spec.mems and not memory_bound:
            self.memory_binding_skipped = memory_binding_unavailable() or "not possible here"
        if self._lifeline:
            self._lifeline.add_group(proc.pid)
        child = _Child(spec, proc)
        self._oom.started(spec.key, self.cgroup_of(spec.key))
        self._watch_removal(child, removal)
        child.inside = inside
        self._children[spec.key] = child
        for pipe, stream in ((proc.stdout, Stream.STDOUT), (proc.stderr, Stream.STDERR)):
            if pipe is None:
                continue
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            self._grow(child, fd)
            child.open_fds[fd] = stream
            child.pending[fd] = bytearray()
            self._loop.add_reader(fd, self._on_readable, child, fd)
        self._watch_exit(child)
        return proc.pid

    def _grow(self, child: _Child, fd: int) -> None:
        """Grow a new pipe to PIPE_SIZE, within the budget; where the kernel refuses (above
        fs.pipe-max-size, past the user's pipe pages: unprivileged users only), it stays."""
        if self._pipe_growth + PIPE_SIZE - DEFAULT_PIPE_SIZE > PIPE_GROWTH_BUDGET:
            return  # spent (a new pipe is never above the default): no system call
        try:
            before = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
            if self._pipe_growth + PIPE_SIZE - before > PIPE_GROWTH_BUDGET:
                return
            grown = fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE) - before
        except OSError:
            return
        child.grown[fd] = grown
        self._pipe_growth += grown

    def _error_file(self, key: int) -> str:
        return os.path.join(self._make_error_dir(), f"{key}.json")

    def _make_error_dir(self) -> str:
        if self._error_dir is None:  # private (0700), removed at close (or by the lifeline)
            self._error_dir = (self._lifeline.make_temp_dir("poprun-errors-") if self._lifeline
                               else tempfile.mkdtemp(prefix="poprun-errors-"))
        return self._error_dir

    def leaves(self) -> dict[str, str | None]:
        """What this spawner may leave on its host if it and its lifeline are both SIGKILLed,
        named before any instance starts (the error dir is made now for that): the mark its
        instances carry, the root of their cgroups (where cgroups may be used) and the error
        dir. The job's record keeps it; `poprunctl reap` removes it (spawner/reaphere.py)."""
        token = self._lifeline.token if self._lifeline else None
        return {"mark": token, "error_dir": self._make_error_dir(),
                "cgroup": containment.cgroup_root(token)
                if token and self._cgroups is not False else None}

    def _read_error(self, key: int) -> None:
        if self._error_dir is None:
            return
        from popdist.errorfile import parse  # only for an instance that failed

        data = read_regular(os.path.join(self._error_dir, f"{key}.json"), MAX_ERROR_FILE)
        error = parse(data) if data is not None else None
        if error is not None:  # else none written (or a broken one)
            self.errors[key] = error

    def reserve(self, keys: Iterable[int]) -> None:
        """Get ready to spawn the processes `keys` (the caller's batch, before its first
        spawn): their cgroups are made now, none while an earlier one of them moves itself
        into its own (Cgroups.make says why that costs)."""
        keys = list(keys)
        if keys and self._has_cgroups():  # none here (every instance remote): no tree
            self._cgroups.make(keys)

    def _has_cgroups(self) -> bool:
        if self._cgroups is None:  # the first time: can this host give us cgroups?
            self._cgroups = Cgroups.create(self._lifeline.token) or False
            if self._cgroups:
                self._lifeline.add_cgroup(self._cgroups.root)
        return bool(self._cgroups)

    def _contained(self, spec: ProcessSpec, env: dict[str, str],
                   argv: Sequence[str] | None = None) -> Sequence[str]:
        """The argv that starts `argv` (default `spec`'s) in a cgroup of its own, where this
        host allows: it enters it before its first instruction (containment.entering). A
        program that cannot be run is refused here, as Popen would refuse it, not by the
        shell later."""
        argv = spec.argv if argv is None else argv
        procs = self._cgroups.prepare(spec.key) if self._has_cgroups() else None
        if procs is None:
            return argv
        _check_runnable(argv[0], env.get("PATH", os.defpath), spec.cwd)
        return containment.entering(procs, argv)

    @property
    def error_dir(self) -> str | None:
        """Where popdist writes its instances' uncaught exceptions, once one has started
        (the job's record names it, for reap)."""
        return self._error_dir

    def cgroup_of(self, key: int) -> str | None:
        """Instance `key`'s own cgroup, once it is in it (its usage is then the whole
        instance's: spawner/procstat.py)."""
        return self._cgroups.members.get(key) if self._cgroups else None

    @property
    def containment(self) -> str:
        """How escaped descendants are caught here, in words (for -v)."""
        ways = []
        if self._cgroups:
            ways.append(f"a cgroup per instance under {self._cgroups.root}")
        elif self._lifeline:
            ways.append(f"the {containment.MARK} environment mark")
        if containment.is_subreaper():
            ways.append("child subreaper")
        return ", ".join(ways) or "process groups only"

    def _watch_exit(self, child: _Child) -> None:
        try:
            child.pidfd = os.pidfd_open(child.proc.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): one waiting thread instead
            threading.Thread(target=self._wait_in_thread, args=(child,), daemon=True).start()
            return
        self._loop.add_reader(child.pidfd, self._on_exit, child)

    def _wait_in_thread(self, child: _Child) -> None:
        os.waitid(os.P_PID, child.proc.pid, os.WEXITED | os.WNOWAIT)
        self._loop.call_soon_threadsafe(self._on_exit, child)

    # --- output -----------------------------------------------------------------------

    def _on_readable(self, child: _Child, fd: int) -> None:
        # Into one buffer, reused: a fresh bytes of READ_SIZE per read would be above malloc's
        # mmap threshold, a new mapping and its page faults at every read.
        read = self._read_buffer
        try:
            size = os.readv(fd, (read,))
        except BlockingIOError:
            return
        except OSError:
            size = 0
        if not size:
            self._close_pipe(child, fd)
            return
        buf = child.pending[fd]
        cut = read.rfind(b"\n", 0, size)
        cut = max(cut, read.rfind(b"\r", cut + 1, size))  # a \r after it (progress) ends there
        data = memoryview(read)
        if cut < 0:  # no line end yet: keep collecting, up to LINE_CAP
            buf += data[:size]
            while len(buf) >= LINE_CAP:
                piece = bytes(memoryview(buf)[:LINE_CAP])
                del buf[:LINE_CAP]
                self._sink.on_output(child.spec.key, child.open_fds[fd], piece)
            return
        # The block is copied out once (with the line it ends, if one was pending).
        if buf:
            block = b"".join((buf, data[:cut + 1]))
            buf.clear()
        else:
            block = bytes(data[:cut + 1])
        buf += data[cut + 1:size]
        self._sink.on_output(child.spec.key, child.open_fds[fd], block)

    def _close_pipe(self, child: _Child, fd: int) -> None:
        stream, rest = self._drop_pipe(child, fd)
        if rest:  # the last line had no newline: deliver it as it is
            self._sink.on_output(child.spec.key, stream, bytes(rest))
        self._maybe_report(child)

    def _drop_pipe(self, child: _Child, fd: int) -> tuple[Stream, bytearray]:
        """Stop reading `fd` and close it; returns its stream and the unterminated rest."""
        self._loop.remove_reader(fd)
        self._pipe_growth -= child.grown.pop(fd, 0)
        stream = child.open_fds.pop(fd)
        rest = child.pending.pop(fd)
        # Close through Popen's file object, which owns the fd: after a bare os.close() it
        # would close the same number again when garbage-collected, by then maybe another
        # pipe's (a later launch in the same process then never sees that pipe's EOF).
        (child.proc.stdout if stream is Stream.STDOUT else child.proc.stderr).close()
        return stream, rest

    # --- exit -------------------------------------------------------------------------

    def _on_exit(self, child: _Child) -> None:
        if child.returncode is not None:  # reaped meanwhile (close())
            return
        self._reap(child)
        if child.open_fds:
            self._loop.call_later(PIPE_DRAIN_TIMEOUT, self._abandon_pipes, child)
        self._maybe_report(child)

    def _unwatch_exit(self, child: _Child) -> None:
        if child.pidfd >= 0:
            self._loop.remove_reader(child.pidfd)
            os.close(child.pidfd)
            child.pidfd = -1

    def _reap(self, child: _Child) -> None:
        self._unwatch_exit(child)
        pid = child.proc.pid
        # The exited leader is still a zombie, so its group id cannot have been reused: kill
        # whatever it left behind in its group before reaping it.
        _killpg(pid, signal.SIGKILL)
        if self._cgroups:  # and whatever left the group but not its cgroup
            self._cgroups.kill(child.spec.key)
        if self._lifeline:
            self._lifeline.discard_group(pid)
        child.returncode = child.proc.wait()
        child.held = None
        if child.inside:
            with contextlib.suppress(OSError):
                os.unlink(child.inside[0])
        self._remove_container(child)
        if child.spec.container is not None:
            from .containers import exit_status

            child.returncode = exit_status(child.spec.container, child.returncode)
        if child.returncode != 0:
            self._read_error(child.spec.key)
        killed = self._oom.killed(child.spec.key, child.returncode)
        if killed:
            self.oom_kills[child.spec.key] = killed

    # --- containers that outlive their runtime's process (spawner/containers.py) ---------

    def _watch_removal(self, child: _Child, removal: list[str] | None) -> None:
        """Remember how `child`'s container is removed, and tell the lifeline, which
        removes it if this process dies first."""
        child.removal = removal
        if removal and self._lifeline:
            self._lifeline.add_command(removal)

    def _remove_container(self, child: _Child) -> None:
        """After its runtime's process exited, whatever its status: it may have left its
        container behind (killed by a signal; or `podman run` signalled while it made the
        container, which exits 0 without removing it), and nothing cheaper than the removal
        itself tells (`podman rm --ignore`: ~30 ms of CPU where it is gone). In the
        background; close() waits for it."""
        removal, child.removal = child.removal, None
        if removal:
            self._removals.append((subprocess.Popen(
                removal, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True), removal))

    def _wait_removals(self) -> None:
        """Wait for the containers being removed, trying again where the first try failed
        (bounded: lifeline.run_command); one that still is not removed stays the lifeline's
        to remove at its end."""
        from .lifeline import COMMAND_TIMEOUT, run_command

        removals, self._removals = self._removals, []
        for proc, removal in removals:
            try:
                done = proc.wait(COMMAND_TIMEOUT) == 0
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                done = False
            if (done or run_command(removal)) and self._lifeline:
                self._lifeline.discard_command(removal)

    def _abandon_pipes(self, child: _Child) -> None:
        for fd in list(child.open_fds):
            self._close_pipe(child, fd)

    def _maybe_report(self, child: _Child) -> None:
        if child.returncode is None or child.open_fds or child.reported:
            return
        child.reported = True
        self._sink.on_exit(child.spec.key, child.returncode)

    # --- stopping ---------------------------------------------------------------------

    def running(self) -> list[int]:
        """Keys of the processes that have not exited yet."""
        return [k for k, c in self._children.items() if c.returncode is None]

    def forget(self, key: int) -> None:
        """Drop an exited (and reported) process, so that `key` can be used again (the next
        attempt of a restarted job). Raises ValueError while it runs."""
        child = self._children.get(key)
        if child is not None and not child.reported:
            raise ValueError(f"key {key} already in use: it still runs")
        self._children.pop(key, None)
        self.errors.pop(key, None)
        self.oom_kills.pop(key, None)
        if self._error_dir is not None:  # the next attempt starts from no progress
            try:
                os.unlink(self._progress_file(key))
            except OSError:
                pass

    def _progress_file(self, key: int) -> str:
        return os.path.join(self._error_dir or "", f"{key}.progress")

    def progress(self, key: int) -> tuple[int, int | None] | None:
        """What instance `key` last gave `popdist.progress()` (step, total); None if it never
        called it (popdist/_progress.py)."""
        if self._error_dir is None:
            return None
        from popdist._progress import LAYOUT, unpack  # only when a watch samples it

        return unpack(read_regular(self._progress_file(key), LAYOUT.size) or b"")

    def pid(self, key: int) -> int:
        return self._children[key].proc.pid

    def signal(self, key: int, sig: int) -> None:
        """Send `sig` to one process's whole group (if it is still running); for a program
        beside its runtime's process, to the program's group (inside.py)."""
        child = self._children[key]
        if child.returncode is None:
            if child.inside is None or sig == signal.SIGKILL:
                _killpg(child.proc.pid, sig)
            if child.inside is not None:
                self._signal_inside(child, sig)

    def _signal_inside(self, child: _Child, sig: int) -> None:
        """`sig` to the program of `child`'s container once it runs (held until then,
        looked for every inside.POLL s; dropped once it has ended, or `child` has)."""
        from . import inside

        child.held = None if sig == signal.SIGKILL else sig
        state, pid = inside.state(*child.inside)
        if state == inside.RUNNING:
            child.held = None
            inside.signal_program(pid, sig)
        elif state == inside.ENDED:
            child.held = None
        elif child.held is not None:
            self._loop.call_later(inside.POLL, self._deliver_held, child, sig)

    def _deliver_held(self, child: _Child, sig: int) -> None:
        if child.returncode is None and child.held == sig:  # not superseded, not ended
            self._signal_inside(child, sig)

    def signal_all(self, sig: int) -> None:
        for key in self.running():
            self.signal(key, sig)

    @property
    def idle(self) -> bool:
        """Every process started so far has exited and been reported."""
        return all(c.reported for c in self._children.values())

    def close(self) -> None:
        """SIGKILL whatever still runs, reap it, close its pipes (output still in them is
        dropped) and report its exit, without waiting for the loop: for the paths that end a
        job early (an error, a cancelled launch). Every process is killed and reaped before
        the sink hears of any, so an exception from the sink (raised after the others have
        been told) cannot leave one running."""
        pending = [c for c in self._children.values() if not c.reported]
        for child in pending:
            if child.returncode is None:
                _killpg(child.proc.pid, signal.SIGKILL)
                self._reap(child)
            for fd in list(child.open_fds):
                self._drop_pipe(child, fd)
        self._sweep()
        errors = []
        for child in pending:
            try:
                self._maybe_report(child)
            except Exception as exc:  # noqa: BLE001 - raised once every exit is reported
                errors.append(exc)
        if errors:
            raise errors[0]

    def _sweep(self) -> None:
        """The final sweep: whatever the instances started that outlived them, even outside
        their process groups, is killed (and reaped, where orphans come to us)."""
        if self._error_dir is not None:
            shutil.rmtree(self._error_dir, ignore_errors=True)
            if self._lifeline:
                self._lifeline.discard_dir(self._error_dir)
            self._error_dir = None
        if not self._children:
            return
        if self._cgroups:
            self._cgroups.close()
            self._cgroups = False  # a late move must not make the tree again
        if self._lifeline:  # with cgroups too: an instance whose cgroup could not be made
            containment.kill_marked(self._lifeline.token)
        self._wait_removals()
        if containment.is_subreaper():  # the launcher's helpers serve the next attempt
            containment.reap_children(
                keep=frozenset([self._lifeline.pid] if self._lifeline else []),
                spare=containment.helpers_mark(self._lifeline.token) if self._lifeline else None)


def _popen(spec: ProcessSpec, argv: Sequence[str], env: dict[str, str]
           ) -> tuple[subprocess.Popen, bool]:
    """Start `argv` as `spec` says (on any thread); and whether its memory binding held.
    The binding is set on the calling thread around the fork, so the child has it before
    its first instruction without a pre-exec hook (which would force the slow fork path)."""
    with bound(spec.cpus, spec.mems) as memory_bound:
        proc = subprocess.Popen(
            argv, env=env, cwd=spec.cwd,
            stdin=None if spec.inherit_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if spec.merge_stderr else subprocess.PIPE,
            start_new_session=True, close_fds=True, pass_fds=spec.pass_fds, bufsize=0)
    return proc, memory_bound


def _in_container(spec: ProcessSpec, env: dict[str, str], private_dir: Callable[[], str]
                  ) -> tuple[Sequence[str], dict[str, str], list[str] | None, str | None]:
    """`spec`'s argv and environment as they start it: inside its container, if it has
    one (spawner/containers.py), under a name no other start of this host has; the command
    that removes that container (None: nothing to remove); and where the runtime writes the
    program's pid (in `private_dir()`), for a runtime whose process is not its ancestor."""
    if spec.container is None:
        return spec.argv, env, None, None
    from .containers import SIGNALLED_INSIDE, cleanup, wrap

    name = f"poprun-{os.getpid()}-{spec.key}-{os.urandom(4).hex()}"
    pidfile = (os.path.join(private_dir(), f"{name}.pid")
               if spec.container.runtime in SIGNALLED_INSIDE else None)
    argv, env = wrap(spec.container, spec.argv, env, spec.cwd or os.getcwd(), name=name,
                     interactive=spec.inherit_stdin, python=sys.executable, pidfile=pidfile)
    return argv, env, cleanup(spec.container, name), pidfile


def _check_runnable(program: str, path: str, cwd: str | None) -> None:
    """Raise the OSError exec would for `program` (looked up on `path` without a slash)."""
    if "/" not in program:
        if shutil.which(program, path=path) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        return
    full = os.path.join(cwd or os.getcwd(), program)
    if not os.path.exists(full):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if os.path.isdir(full) or not os.access(full, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
