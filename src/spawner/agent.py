"""The per-host agent: `python -m spawner.agent`, started by the launcher over SSH.

It speaks `spawner.protocol` on stdin/stdout (diagnostics go to stderr) and starts that host's
instances with the same `LocalSpawner` a local run uses, on asyncio like the launcher (one
runtime: docs/architecture.md, "One runtime").

How it ends, and what it leaves behind (nothing):
- stdin reaches EOF (the launcher closed it, died, or its connection dropped), or SIGTERM /
  SIGHUP / SIGINT arrives: SIGKILL every instance's process group, remove its temp dirs, exit.
- stdout is closed under it (EPIPE): the same.
- it is SIGKILLed itself: its `Lifeline` watchdog sees the pipe close and does the same.
- it hits a bug (an exception in any callback): it sends INTERNAL with the traceback, then
  does the same and exits with status 70; the launcher reports an internal error.

Backpressure: frames wait in an in-memory outbox and are written without ever blocking. When
the launcher reads slower than the instances write, the outbox passes `HIGH_WATER` and the
agent stops reading the instances' pipes (they block on their writes, as on a slow terminal)
until it drains below `LOW_WATER`. stdin is always read, so an EOF is seen at once even while
the launcher is not reading: shutdown never waits for a write.
"""

from __future__ import annotations

import sys

from .asyncio_import import asyncio_without_tls


class _SiteOnDemand:
    """Started with `python -S` (spawner.remote.agent_command), the agent has the standard
    library and its own packages only. A top-level module not found among them (py-libnuma,
    for a memory binding) is looked up in the directories `site` would add (_site_dirs) and,
    found, they join sys.path; their .pth files are not run (here they import certifi: most
    of the ~50 ms saved). What only a .pth file can reach (an editable install) is not found:
    the agent imports nothing of the sort. Not found, the import fails saying where it looked,
    so that what the agent reports names the module and the directories."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> object:
        if path is not None or name in sys.stdlib_module_names:
            return None  # a submodule (its package was found), or another platform's module
        from importlib.machinery import PathFinder

        added = [d for d in _site_dirs() if d not in sys.path]
        spec = PathFinder.find_spec(name, added)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} in sys.path nor in "
                                      f"{', '.join(added) or 'no site directory'}", name=name)
        sys.path.extend(added)  # for what it imports in turn
        return spec


def _site_dirs() -> list[str]:
    """The site directories `site` would add for this interpreter, without running `site`:
    under -S, sys.prefix is the *base* installation's even in a virtual environment, since
    site's venv() is what moves it. So the venv is found here as site.venv() finds it (a
    pyvenv.cfg beside the executable or one directory up; the prefix is the directory above
    the executable's), its site-packages first, then the user's and the base's only where
    the venv includes the system site packages. Order as site.main: venv, user, base. The
    venv's directories are named as venv lays them out and upstream's getsitepackages names
    them: a distribution's patched getsitepackages (Debian's dist-packages) answers for its
    own installation only, and under -S cannot tell it is in a venv."""
    import os.path
    import site

    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    venv_prefix = os.path.dirname(exe_dir)
    cfg = next((c for c in (os.path.join(exe_dir, "pyvenv.cfg"),
                            os.path.join(venv_prefix, "pyvenv.cfg")) if os.path.isfile(c)), None)
    system_site = cfg is None or _pyvenv_setting(
        cfg, "include-system-site-packages", "true") == "true"  # site.venv()'s default
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    venv = [] if cfg is None else [os.path.join(venv_prefix, libdir, version, "site-packages")
                                   for libdir in dict.fromkeys((sys.platlibdir, "lib"))]
    user = [site.getusersitepackages()] if system_site and site.check_enableusersite() else []
    base = site.getsitepackages() if system_site else []
    return list(dict.fromkeys((*venv, *user, *base)))


def _pyvenv_setting(cfg: str, key: str, default: str) -> str:
    """One setting of a pyvenv.cfg, lowercased, read as site.venv() reads it."""
    try:
        with open(cfg, encoding="utf-8") as f:
            for line in f:
                name, eq, value = line.partition("=")
                if eq and name.strip().lower() == key:
                    default = value.strip().lower()
    except (OSError, UnicodeDecodeError):
        pass
    return default


if sys.flags.no_site:
    sys.meta_path.append(_SiteOnDemand)

asyncio = asyncio_without_tls()  # before anything else imports it: an agent never speaks TLS
import os  # noqa: E402
import shutil
import signal
import stat
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any, NoReturn

from popdist.env import SSH_CONNECTION_COPY
from poprun._version import __version__

from . import fdlimit, hostfacts, procid, stackdump
from .binding import read_binding
from .containment import become_subreaper
from .lifeline import Lifeline
from .local import LocalSpawner, ProcessSpec, Stream, resolve_program
from .procstat import ProcSampler
from .protocol import (DOWN_KINDS, MAGIC, PROTOCOL_VERSION, Control, Frame, FrameDecoder,
                       Kind, ProtocolError, SpawnRequest, encode, output_header)
from .srun import step_variables
from .stopsignals import STOP_SIGNALS
from .sysfs import read_sysfs
from .within import bounded

if TYPE_CHECKING:
    from .worlds.nodeworld import AgentWorld, HostWorlds

READ_SIZE = 65536
HIGH_WATER = 1 << 20  # unsent bytes above which instances' pipes are no longer read
LOW_WATER = 256 << 10  # ... and below which they are read again
IOV_BATCH = 512  # buffers per writev (Linux allows 1024)
# What sshd sets for a login session; instances are not one (see instance_environ).
SSH_SESSION_VARIABLES = ("SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_ORIGINAL_COMMAND")
INTERNAL_ERROR_STATUS = 70  # EX_SOFTWARE, as the launcher's own internal errors
# The launcher went without saying goodbye (where it promises to: a pod follower's agent), or
# fell silent for --host-timeout: the agent killed what ran. A pod follower's exit status
# then (docs/kubernetes.md): EX_UNAVAILABLE.
LAUNCHER_LOST_STATUS = 69
# Set when the launcher brought this agent and the host's Python has no popdist of its own
# (spawner/carried.py): the carried popdist, at the end of the instances' PYTHONPATH.
CARRIED_PYTHONPATH: str | None = None


def hello_reply(request: dict[str, Any]) -> dict[str, Any]:
    """What the agent tells the launcher about this host. New keys may be added at any time
    (the launcher ignores those it does not know): keep it a flat, extensible dict."""
    cwd = request.get("cwd") or os.getcwd()
    program = request.get("program")
    path = request.get("path")  # the PATH instances will get; None: the agent's own
    if path is None:
        path = os.environ.get("PATH", os.defpath)
    return {
        "protocol": PROTOCOL_VERSION,
        "poprun": __version__,
        "python": {"version": list(sys.version_info), "executable": sys.executable,
                   "implementation": sys.implementation.name},
        "hostname": os.uname().nodename,
        "pid": os.getpid(),
        "cwd": cwd,
        "cwd_exists": os.path.isdir(cwd),
        "program": resolve_program(program, path, cwd) if program else None,
        # The raw NUMA topology: the launcher parses it (poprun.plan.topology) and plans binding.
        "sysfs": read_sysfs(),
        "status": _own_status(),
        # The address this host was reached at (SSH_CONNECTION's server address): the one
        # the other hosts reach it at too, even through a ProxyCommand (MASTER_ADDR).
        "address": _reached_at(os.environ.get("SSH_CONNECTION", "")),
        # What instances here inherit before the launcher's additions (poprun --check).
        "environ": instance_environ({}, ()),
        "boot_id": procid.boot_id(),  # with STARTED's start: which process a pid is
        # The open-file limit instances here are held under (raised to the hard one at the
        # agent's start): the launcher refuses a host it cannot hold (spawner/fdlimit.py).
        "open_files": _open_files(),
        # Asked for when the user chose a network (poprun/plan/network.py).
        "interfaces": _interfaces() if request.get("interfaces") else None,
    }


def _open_files() -> list[int]:
    limits = fdlimit.limits()
    return [limits.soft, limits.hard]


def _reached_at(ssh_connection: str) -> str | None:
    """SSH_CONNECTION's server address; sshd run on a pipe (`sshd -i` behind a
    ProxyCommand) says UNKNOWN there: no address."""
    address = (ssh_connection.split()[2:3] or [None])[0]
    return None if address == "UNKNOWN" else address


def _interfaces() -> dict[str, list[str]] | None:
    from .netifs import interfaces

    try:
        return interfaces()
    except OSError:  # no getifaddrs here: the launcher says which host could not tell
        return None


def _own_status() -> str:
    """This process's /proc status: its Cpus/Mems_allowed_list are the cpuset instances get."""
    try:
        with open("/proc/self/status") as f:
            return f.read()
    except OSError:
        return ""


def _binding_of(pid: int) -> dict[str, Any] | None:
    """What the kernel says the instance is bound to (for the launcher's --report-bindings):
    read at once, the binding being in force from the fork."""
    try:
        found = read_binding(pid)
    except OSError:  # already gone
        return None
    return {"cpus": list(found.cpus), "mems": list(found.mems), "mempolicy": found.mempolicy}


def instance_environ(env_set: Mapping[str, str], env_unset: Iterable[str]) -> dict[str, str]:
    """The agent's own environment (what sshd gave it: HOME, USER...) with the launcher's
    changes applied. Not what makes a process look like an SSH login: with `SSH_CLIENT` set
    and `SHLVL` < 2, `bash -c` sources ~/.bashrc (and whatever that runs, e.g. `pyenv
    rehash` holding a lock) in every instance. The connection stays visible to instances
    as `POPRUN_SSH_CONNECTION`. Started by srun, the agent does not pass on what describes
    its own one-task job step (SLURM_PROCID...: spawner.srun.step_variables)."""
    env = dict(os.environ)
    for name in (*env_unset, *SSH_SESSION_VARIABLES, "SHLVL", *step_variables(os.environ)):
        env.pop(name, None)
    if "SSH_CONNECTION" in os.environ:
        env[SSH_CONNECTION_COPY] = os.environ["SSH_CONNECTION"]
    env.update(env_set)
    if CARRIED_PYTHONPATH:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (env.get("PYTHONPATH"), CARRIED_PYTHONPATH) if p)
    return env


class _Gate:
    """The loop as the spawner sees it, with a switch: `pause()` stops dispatching the
    spawner's readers (pipes and pidfds), `resume()` restores them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._readers: dict[int, tuple[Callable[..., Any], tuple]] = {}
        self.paused = False

    def add_reader(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        self._readers[fd] = (callback, args)
        if not self.paused:
            self._loop.add_reader(fd, callback, *args)

    def remove_reader(self, fd: int) -> bool:
        self._readers.pop(fd, None)
        return self._loop.remove_reader(fd)

    def call_later(self, delay: float, callback: Callable[..., Any],
                   *args: Any) -> asyncio.TimerHandle:
        return self._loop.call_later(delay, callback, *args)

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> asyncio.Handle:
        return self._loop.call_soon_threadsafe(callback, *args)

    def pause(self) -> None:
        self.paused = True
        for fd in self._readers:
            self._loop.remove_reader(fd)

    def resume(self) -> None:
        self.paused = False
        for fd, (callback, args) in self._readers.items():
            self._loop.add_reader(fd, callback, *args)


class _Outbox:
    """Frames on their way to stdout, written with writev whenever stdout takes them.

    `on_pressure(True)` when more than HIGH_WATER bytes wait, `on_pressure(False)` when
    fewer than LOW_WATER do; `on_broken()` once when stdout fails (the reader is gone).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, on_broken: Callable[[], None],
                 on_pressure: Callable[[bool], None]) -> None:
        self._loop, self._fd = loop, fd
        self._on_broken, self._on_pressure = on_broken, on_pressure
        self._parts: deque[bytes | memoryview] = deque()
        self.size = 0
        self._scheduled = self._waiting = self._pressed = self.broken = False

    def send(self, *parts: bytes) -> None:
        if self.broken:
            return
        self._parts.extend(parts)
        self.size += sum(map(len, parts))
        if not (self._scheduled or self._waiting):
            # Not at once: everything sent in this loop round then goes out in one writev.
            self._scheduled = True
            self._loop.call_soon(self.flush)
        if self.size > HIGH_WATER and not self._pressed:
            self._pressed = True
            self._on_pressure(True)

    def flush(self) -> None:
        """Write what stdout takes now; wait for it to become writable for the rest."""
        self._scheduled = False
        try:
            self._write_some()
        except OSError:
            self._break()
            return
        if self._parts and not self._waiting:
            self._waiting = True
            self._loop.add_writer(self._fd, self.flush)
        elif not self._parts and self._waiting:
            self._waiting = False
            self._loop.remove_writer(self._fd)
        if self._pressed and self.size < LOW_WATER:
            self._pressed = False
            self._on_pressure(False)

    def _write_some(self) -> None:
        parts = self._parts
        while parts:
            try:
                written = os.writev(self._fd, list(islice(parts, IOV_BATCH)))
            except BlockingIOError:
                return
            self.size -= written
            while written:
                head = parts[0]
                if len(head) <= written:
                    written -= len(head)
                    parts.popleft()
                else:
                    parts[0] = memoryview(head)[written:]
                    written = 0

    def _break(self) -> None:
        self.broken = True
        self._parts.clear()
        self.size = 0
        if self._waiting:
            self._loop.remove_writer(self._fd)
            self._waiting = False
        self._on_broken()


class Agent:
    """One launcher's agent on this host: the spawner's sink and the request handlers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lifeline: Lifeline, in_fd: int,
                 out_fd: int, farewell: bool = False) -> None:
        self._loop, self._lifeline, self._in_fd = loop, lifeline, in_fd
        # With `farewell`, the launcher says goodbye (HEARTBEAT {last}) before its stream
        # ends: False until it does. None: no goodbye is expected (SSH, Slurm).
        self.farewell: bool | None = False if farewell else None
        self._gate = _Gate(loop)
        self._spawner = LocalSpawner(self, self._gate, lifeline)
        self._outbox = _Outbox(loop, out_fd, lambda: self.stop("stdout closed"),
                               self._on_pressure)
        self._decoder = FrameDecoder()
        self._temp_dirs: list[str] = []
        self._handlers = {Kind.HELLO: self._hello, Kind.MKTEMP: self._mktemp,
                          Kind.MKDIR: self._mkdir, Kind.HEARTBEAT: self._heartbeat,
                          Kind.SPAWN: self._spawn, Kind.SIGNAL: self._signal,
                          Kind.STACKS: self._stacks,
                          Kind.PROBE: self._probe, Kind.FACTS: self._facts}
        # This host's MPI worlds (the launcher's WORLD frames), served as on every host, made
        # when the first opens: an agent whose instances speak no MPI never imports them.
        self._host_worlds: HostWorlds | None = None
        self._handlers.update({kind: partial(self._world_frame, kind) for kind in DOWN_KINDS})
        # this host's PMIx service (spawner.worlds.pmixhost), once a world needs it
        self._pmix = None
        self._facts_read: hostfacts.Reading | None = None  # what HELLO's `facts` asked
        self._last_heard = time.monotonic()
        # The launcher's --kill-timeout (HELLO's `kill_timeout`): what a SIGTERM of this
        # agent gives the instances before SIGKILL; 0 (an older launcher): at once.
        self._kill_timeout = 0.0
        self._terminating = False  # a SIGTERM came: the instances have their stop window
        self._signalled: set[int] = set()  # instances the launcher had SIGTERMed already
        self.done, self.status = False, 0
        self.finished = loop.create_future()  # set by stop()
        self._outbox.send(MAGIC)
        loop.add_reader(in_fd, self._on_stdin)

    # --- requests ---------------------------------------------------------------------

    def _on_stdin(self) -> None:
        try:
            data = os.read(self._in_fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            lost = self.farewell is False  # expected, and not said: the launcher died
            self.stop("stdin closed", status=LAUNCHER_LOST_STATUS if lost else 0)
            return
        self.received(data)

    def received(self, data: bytes) -> None:
        """Bytes of the launcher's stream, in order (from stdin, or read before the agent ran:
        spawner.carried)."""
        self._last_heard = time.monotonic()
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:  # no way to find the next frame: give up
            self._outbox.send(encode(Kind.FAILED, id=None, error=str(exc)))
            self.stop(f"protocol error: {exc}", status=1)
            return
        for frame in frames:
            self._handle(frame)

    def _handle(self, frame: Frame) -> None:
        kind = frame.kind if isinstance(frame, Control) else Kind.OUTPUT
        handler = self._handlers.get(kind)
        if handler is None:
            self._outbox.send(encode(Kind.FAILED, id=None, error=f"unexpected {kind.name} frame"))
            return
        try:
            handler(frame.fields)
        except (KeyError, TypeError, ValueError) as exc:  # a field missing or of a bad type
            self._outbox.send(encode(Kind.FAILED, id=frame.fields.get("id"),
                                     error=f"bad {kind.name} request: {exc!r}"))

    def _reply(self, request: dict[str, Any], result: dict[str, Any]) -> None:
        self._outbox.send(encode(Kind.REPLY, id=request["id"], result=result))

    def _hello(self, request: dict[str, Any]) -> None:
        # What this agent may leave behind, for the job's record: reap must find it if the
        # agent, its lifeline and the launcher all die.
        reply = {**hello_reply(request), "leaves": self._spawner.leaves()}
        self._kill_timeout = _seconds(request.get("kill_timeout"))
        prefix = request.get("mktemp")
        if prefix is not None:  # MKTEMP's dir, in the reply: one round trip less per host
            try:
                reply["temp_dir"] = self._make_temp_dir(str(prefix))
            except OSError as exc:
                reply["temp_dir_error"] = _temp_dir_error(exc)
        self._reply(request, reply)
        if request.get("facts"):  # read once the reply is out, for FACTS to collect
            self._facts_read = hostfacts.Reading(self._loop, request["facts"], instance_environ)
        interval = request.get("stats")
        if interval:  # the launcher shows a dashboard: sample the instances periodically
            self._sampler = ProcSampler()
            self._loop.call_later(float(interval), self._send_stats, float(interval))
        if request.get("heartbeat"):
            interval, timeout = map(float, request["heartbeat"])
            # The launcher declares this host lost after `timeout` without a word from the
            # agent; should the agent be frozen or stuck meanwhile, its watchdog must then
            # end what it started, as nothing else on this host will.
            self._lifeline.expect_beats(timeout)
            self._loop.call_later(interval, self._beat, interval, timeout)

    def _heartbeat(self, fields: dict[str, Any]) -> None:
        if fields.get("last") is True and self.farewell is not None:
            self.farewell = True

    def _beat(self, interval: float, timeout: float) -> None:
        """The launcher's silence past `timeout` (a frozen or partitioned launcher host, a
        stalled SSH path) ends the agent as its EOF would: nobody would stop the instances.
        Each beat goes to the launcher (ALIVE) and to the agent's own watchdog."""
        silent = time.monotonic() - self._last_heard
        if silent > timeout:
            self.stop(f"no word from the launcher for {silent:.1f} s (--host-timeout "
                      f"{timeout:g})",
                      status=LAUNCHER_LOST_STATUS if self.farewell is not None else 0)
            return
        self._outbox.send(encode(Kind.ALIVE))
        self._lifeline.beat()
        self._loop.call_later(interval, self._beat, interval, timeout)

    def _send_stats(self, interval: float) -> None:
        now = time.monotonic()
        usage, progress = {}, {}
        for key in self._spawner.running():
            sample = self._sampler.sample(self._spawner.pid(key), now,
                                          self._spawner.cgroup_of(key))
            if sample is not None:
                usage[str(key)] = [sample.cpu_percent, sample.rss]
            steps = self._spawner.progress(key)  # popdist.progress(), if it was called
            if steps is not None:
                progress[str(key)] = list(steps)
        if usage or progress:  # `usage` always there: a launcher before `progress` needs it
            self._outbox.send(encode(Kind.STATS, usage=usage,
                                     **({"progress": progress} if progress else {})))
        self._loop.call_later(interval, self._send_stats, interval)

    def _mktemp(self, request: dict[str, Any]) -> None:
        try:
            path = self._make_temp_dir(request["prefix"])
        except OSError as exc:
            self._outbox.send(encode(Kind.FAILED, id=request["id"], error=_temp_dir_error(exc)))
            return
        self._reply(request, {"path": path})

    def _make_temp_dir(self, prefix: str) -> str:
        """A new 0700 directory, removed when the agent ends (close, or its lifeline)."""
        path = self._lifeline.make_temp_dir(prefix)
        self._temp_dirs.append(path)
        return path

    def _mkdir(self, request: dict[str, Any]) -> None:
        try:
            os.makedirs(request["path"], exist_ok=True)
        except OSError as exc:
            self._outbox.send(encode(Kind.FAILED, id=request["id"],
                                     error=f"cannot create {request['path']}: {exc.strerror}"))
            return
        self._reply(request, {"path": request["path"]})

    def _spawn(self, fields: dict[str, Any]) -> None:
        world = self._world(fields.get("world")) if isinstance(fields, dict) else None
        if world is not None and not world.ready.done():  # its PMIx namespace first
            world.ready.add_done_callback(lambda _: self._spawn(fields))  # in order
            return
        try:
            request = SpawnRequest.from_fields(fields)
            pid = self._start(request)
        except (KeyError, TypeError, ValueError) as exc:
            error = f"bad SPAWN request: {exc}"
        except OSError as exc:
            error = exc.strerror or str(exc)
            if exc.filename:
                error += f": {exc.filename}"
        else:
            self._outbox.send(encode(Kind.STARTED, key=request.key, pid=pid,
                                     start=procid.start_ticks(pid),
                                     memory_binding_reason=self._spawner.memory_binding_skipped,
                                     binding=_binding_of(pid),
                                     containment=self._spawner.containment))
            return
        self._outbox.send(encode(Kind.SPAWN_FAILED, key=fields.get("key"), error=error))

    def _start(self, request: SpawnRequest) -> int:
        self._spawner.forget(request.key)  # a restarted job reuses its keys; a running one
        env = instance_environ(request.env_set, request.env_unset)
        pmi_end = None
        if request.world is not None:
            rank = request.key if request.rank is None else request.rank
            world = self._world(request.world)
            if world is None:
                raise ValueError(f"no world {request.world!r} open here")
            world_env, pmi_end = world.attach(rank, env)
            env.update(world_env)
        try:
            return self._spawner.spawn(ProcessSpec(
                key=request.key, argv=request.argv, cwd=request.cwd, env=env,
                merge_stderr=request.merge_stderr, cpus=request.cpus, mems=request.mems,
                pass_fds=(pmi_end.fileno(),) if pmi_end is not None else (),
                container=request.container))
        finally:
            if pmi_end is not None:
                pmi_end.close()  # the instance has its copy

    def _facts(self, request: dict[str, Any]) -> None:
        """FACTS: what HELLO asked this host to read of the job's dependencies (for comparing
        the hosts), as soon as it is read."""
        if self._facts_read is None:
            self._outbox.send(encode(Kind.FAILED, id=request["id"],
                                     error="FACTS without HELLO's facts"))
            return
        self._facts_read.then(lambda facts: self._reply(request, facts))

    def _probe(self, request: dict[str, Any]) -> None:
        """PROBE: whether this host reaches the launcher back at an address (poprun --check)."""
        address, port = str(request["address"]), int(request["port"])
        token, within = str(request["token"]), float(request["within"])
        self._loop.create_task(self._reach(request, address, port, token, within))

    async def _reach(self, request: dict[str, Any], address: str, port: int, token: str,
                     within: float) -> None:
        started = time.monotonic()
        error = None
        try:
            reader, writer = await bounded(asyncio.open_connection(address, port), within)
            try:
                writer.write(token.encode() + b"\n")
                answer = await bounded(reader.readline(), within)
            finally:
                writer.close()
            if answer.strip() != token.encode():
                error = "something else answered there"
        except TimeoutError:
            error = f"no answer within {within:g} s"
        except OSError as exc:
            error = exc.strerror or str(exc)
        self._reply(request, {"ok": error is None, "error": error,
                              "seconds": round(time.monotonic() - started, 6)})

    # --- MPI worlds (spawner/worlds/nodeworld.py) -------------------------------------------

    def _world_frame(self, kind: Kind, fields: dict[str, Any]) -> None:
        if self._host_worlds is None:
            from .worlds.nodeworld import HostWorlds

            self._host_worlds = HostWorlds(self._loop, self._outbox.send, self._lifeline,
                                           self._pmix_host)
        self._host_worlds.handle(kind, fields)

    def _world(self, kvsname: Any) -> AgentWorld | None:
        """The node-level world `kvsname` (nodeworld.AgentWorld) open here, else None."""
        return self._host_worlds.get(kvsname) if self._host_worlds is not None else None

    def _pmix_host(self, pmix: dict[str, Any], hostname: str):
        """This host's PMIx service (a server process per world), with the libpmix the
        launcher's user named, else the one found here (spawner/worlds/pmixfind.py), once it passed
        its check (spawner/worlds/pmixcheck.py: ~10-20 ms, bounded). Raises LookupError where there
        is none to serve with."""
        if self._pmix is None:
            from .worlds import pmixcheck, pmixfind
            from .worlds.pmixhost import PmixHost

            argv = [str(a) for a in pmix.get("argv") or []]
            given = pmix.get("libpmix")
            path = pmixfind.find(os.environ, argv, given)
            if path is None:
                raise LookupError("no libpmix: looked for " + ", ".join(
                    pmixfind.candidates(os.environ, argv, given)))
            try:
                pmixcheck.Check(path).version()
            except pmixcheck.Unusable as exc:
                raise LookupError(f"{path}: {exc}") from None
            self._pmix = PmixHost(path, self._lifeline, hostname, self._loop, warn=_log)
        return self._pmix

    def _spawner_knows(self, key: int) -> bool:
        try:
            self._spawner.pid(key)
        except KeyError:
            return False
        return True

    def _signal(self, request: dict[str, Any]) -> None:
        sig = signal.Signals[request["signal"]]
        key = request.get("key")
        if key is None:
            self._spawner.signal_all(sig)
        elif self._spawner_knows(key):
            self._spawner.signal(key, sig)
        if sig == signal.SIGTERM:
            self._signalled.update(self._spawner.running() if key is None else [key])

    def _stacks(self, request: dict[str, Any]) -> None:
        """STACKS: the Python stacks of the instances asked for (spawner/stackdump.py)."""
        keys = request.get("keys")
        pids = {k: self._spawner.pid(k) for k in self._spawner.running()
                if keys is None or k in keys}
        stackdump.answer(pids, float(request["within"]),
                         lambda found: self._reply(request, {"stacks": found}))

    # --- spawner sink -----------------------------------------------------------------

    def on_output(self, key: int, stream: Stream, data: bytes) -> None:
        self._outbox.send(output_header(key, stream, len(data)), data)

    def on_exit(self, key: int, returncode: int) -> None:
        if self._host_worlds is not None:  # left Open MPI's world without MPI_Finalize?
            self._host_worlds.exited(key)
        error = self._spawner.errors.get(key)  # sent only when there is one
        steps = self._spawner.progress(key)  # its last popdist.progress(), if it called it
        oom = self._spawner.oom_kills.get(key)  # the kernel's OOM killer ended it (oomkills.py)
        self._outbox.send(encode(Kind.EXIT, key=key, returncode=returncode,
                                 **({"error": error} if error else {}),
                                 **({"oom_kills": oom} if oom else {}),
                                 **({"progress": list(steps)} if steps else {})))

    def _on_pressure(self, pressed: bool) -> None:
        if pressed:
            self._gate.pause()
        else:
            self._gate.resume()

    # --- ending -----------------------------------------------------------------------

    def stop(self, reason: str, status: int = 0) -> None:
        """End the loop; `close()` then does the killing and cleaning. `status`: the
        agent's exit status."""
        if self.done:
            return
        self.done, self.status = True, status
        self.finished.set_result(None)
        running = self._spawner.running()
        if running:
            _log(f"{reason}: killing {len(running)} running instance(s)")

    def terminate(self) -> None:
        """SIGTERM (Slurm's scancel or preemption reaches every step's tasks; a host's
        shutdown every process): the instances get the launcher's whole --kill-timeout, as
        when poprun is stopped, before `stop()` kills them: users checkpoint in it
        (docs/architecture.md, "Runtime guarantees"). Those not told by the launcher yet
        get SIGTERM now, once (a second one may mean "now" to a program). The agent goes on
        serving meanwhile: their exits reach the launcher, which ends the job as it does
        for any exit. A second SIGTERM, or none running, stops at once."""
        running = self._spawner.running()
        if self._terminating or not running or self._kill_timeout <= 0:
            self.stop("SIGTERM received")
            return
        self._terminating = True
        _log(f"SIGTERM received: {len(running)} running instance(s) have "
             f"{self._kill_timeout:g} s (--kill-timeout) before SIGKILL")
        for key in running:
            if key not in self._signalled:
                self._spawner.signal(key, signal.SIGTERM)
        self._loop.call_later(self._kill_timeout, self.stop,
                              f"--kill-timeout ({self._kill_timeout:g} s) after SIGTERM")

    def on_fault(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """The loop's exception handler: an exception in any callback is a bug. Tell the
        launcher (INTERNAL, with the traceback), then stop as for a closed stdin."""
        error = context.get("exception")
        if error is None:
            loop.default_exception_handler(context)
            return
        self.report_fault(error)

    def report_fault(self, error: BaseException) -> None:
        text = "".join(traceback.format_exception(error))
        _log(f"internal error: {text}")
        message = " ".join(str(error).split())
        self._outbox.send(encode(Kind.INTERNAL, traceback=text,
                                 error=f"{type(error).__name__}: {message}" if message
                                 else type(error).__name__))
        self.stop("internal error", status=INTERNAL_ERROR_STATUS)

    def close(self) -> None:
        """SIGKILL every instance's group and reap it, remove the temp dirs; then a last,
        non-blocking attempt to tell the launcher (if it still listens) how they ended."""
        self._spawner.close()
        if self._host_worlds is not None:
            self._host_worlds.remove_leftovers()  # its instances are dead now
        if self._pmix is not None:
            self._pmix.close()
        for path in self._temp_dirs:
            shutil.rmtree(path, ignore_errors=True)
            self._lifeline.discard_dir(path)
        self._temp_dirs.clear()
        self._outbox.flush()


def _seconds(value: object) -> float:
    """A duration the launcher sent: a finite, non-negative number, else 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value) if 0 <= value < float("inf") else 0.0


def _temp_dir_error(exc: OSError) -> str:
    return f"cannot create a temporary directory: {exc}"


def _log(message: str) -> None:
    os.write(2, f"poprun agent on {os.uname().nodename}: {message}\n".encode(errors="replace"))


def _claim(in_src: int, out_src: int) -> tuple[int, int]:
    """Private, non-blocking copies of the launcher's stream (stdin and stdout, or the
    connection it was called back on); fds 0 and 1 become /dev/null and stderr, so a stray
    print() can never corrupt the frame stream."""
    in_fd, out_fd = os.dup(in_src), os.dup(out_src)  # dup'ed fds are close-on-exec
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    os.set_blocking(in_fd, False)
    os.set_blocking(out_fd, False)
    return in_fd, out_fd


def _launcher_stream() -> tuple[int, int] | None:
    """The launcher's stream: stdin/stdout over SSH; under Slurm, where the step's
    environment says so, the connection the agent makes to the launcher (spawner/
    callback.py: the secret, read from stdin, proven both ways). None, said on stderr, if
    there is none."""
    from .callback import CALLBACK_VARIABLE

    if CALLBACK_VARIABLE in os.environ:
        from .callback import CONNECT_TIMEOUT, CallbackError, connect_back, read_secret

        deadline = time.monotonic() + CONNECT_TIMEOUT
        try:
            sock = connect_back(os.environ, read_secret(0, deadline), deadline)
        except (OSError, CallbackError) as exc:
            _log(f"cannot reach the launcher: {exc}")
            return None
        with sock:
            return _claim(sock.fileno(), sock.fileno())
    mode = os.fstat(0).st_mode
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(0)):  # epoll needs one
        _log("stdin must be a pipe or a socket: poprun starts the agent over SSH")
        return None
    return _claim(0, 1)


def main(initial: bytes = b"", farewell: bool = False) -> NoReturn:
    """Run the agent, then exit with its status. `initial`: the start of the launcher's
    stream, already read from stdin by whoever ran the agent (the bootstrap probe,
    spawner/carried.py). `farewell`: the launcher says goodbye before it closes the stream
    (a pod follower's, run/podmode.py): a stream that ends without it is a launcher lost.

    It exits with `os._exit` once its instances are gone, its temp dirs removed and its
    watchdog released: the interpreter's teardown (asyncio's modules) took another ~45 ms
    (EOF to exit ~55 ms, now ~10), and every launch waits for its agents' end before it
    exits itself (bench/README.md, "Remote launches")."""
    status = _run(initial, farewell)
    for stream in (sys.stdout, sys.stderr):  # fd 1 is stderr's by now (_claim)
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _run(initial: bytes, farewell: bool = False) -> int:
    stream = _launcher_stream()
    if stream is None:
        return 2
    in_fd, out_fd = stream
    fdlimit.raise_soft_limit()  # its hard limit is what the launcher checks (hello_reply)
    # Forked first (the watchdog copies the smallest process) and detached, before the
    # agent is a subreaper that would adopt it back: a job step killed whole must not take
    # the watchdog down with the agent (spawner/lifeline.py).
    lifeline = Lifeline(detached=True)
    become_subreaper()  # what an instance leaves behind comes back to the agent
    try:
        return asyncio.run(_serve(lifeline, in_fd, out_fd, initial, farewell))
    finally:
        lifeline.close()
        for fd in (in_fd, out_fd):  # the description may be shared (a terminal)
            os.set_blocking(fd, True)


async def _serve(lifeline: Lifeline, in_fd: int, out_fd: int, initial: bytes = b"",
                 farewell: bool = False) -> int:
    """Serve the launcher until stdin closes, a stop signal comes or a bug stops it; every
    instance is killed and every temp dir removed on the way out."""
    loop = asyncio.get_running_loop()
    agent = Agent(loop, lifeline, in_fd, out_fd, farewell)
    loop.set_exception_handler(agent.on_fault)
    if initial:
        loop.call_soon(agent.received, initial)
    try:
        for sig in STOP_SIGNALS:  # SIGHUP, SIGINT: at once; SIGTERM: the stop window
            if sig == signal.SIGTERM:
                loop.add_signal_handler(sig, agent.terminate)
            else:
                loop.add_signal_handler(sig, agent.stop, f"{signal.Signals(sig).name} received")
        await agent.finished
    except Exception as exc:  # noqa: BLE001 - a bug here is reported like one in a callback
        agent.report_fault(exc)
    finally:
        agent.close()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    return agent.status


if __name__ == "__main__":
    main()
