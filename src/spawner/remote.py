"""The launcher's end of a per-host agent: `RemoteSpawner`, on asyncio over one connection
(SSH's, or the one a Slurm job step's agent made back to the launcher).

    spawner = RemoteSpawner(conn, "h2", sink, on_lost=job.on_host_lost)
    info = await spawner.start(cwd=os.getcwd(), program="python3")  # versions differ: raises
    cache = await spawner.make_temp_dir("poprun-cache-")  # removed however the agent ends
    pids = await spawner.spawn_all([SpawnRequest(key=4, argv=(...), env_set={...}), ...])
    spawner.signal_all(signal.SIGTERM)
    await spawner.close()

Events reach `sink` exactly as from a LocalSpawner (`on_output(key, stream, data)`, then
`on_exit(key, returncode)`), on the event loop's thread. If the agent or the connection ends
before `close()` was called, `on_lost(host, reason)` is called once; no event follows, and the
instances that had not exited are in `unaccounted()` (the agent, or its lifeline, has killed
them — or the host is gone).

The agent's stdout is read through an `SSHClientSession` rather than `create_process`
streams: each SSH data packet is decoded and dispatched in the callback that receives it, with
no task switch or extra buffer per read on the output path.

The connection is an asyncssh connection or a Slurm node's (`spawner.srun.NodeLink`).
asyncssh (~250 ms to import) is imported only when the connection is SSH's: a launch under
Slurm never loads it.

Errors (connection failures are spawner.ssh's SshConnectError):

    SshError                    spawner.ssh's base
    └── RemoteError             base of this module's; every one names the host (`.host`)
        ├── AgentStartError     the agent did not start or did not answer HELLO
        ├── AgentVersionError   protocol or poprun version differs on that host, or its Python
        │                       is older than the agent supports (carried.MIN_PYTHON)
        ├── AgentLostError      the agent or connection ended while a request was pending
        ├── AgentRequestError   the agent could not do what was asked (e.g. MKTEMP)
        ├── AgentInternalError  the agent hit a bug (it stopped its instances and exited);
        │                       reported through the loop's exception handler, not raised
        └── RemoteSpawnError    some instances could not be started (`.failures`, `.started`)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import signal as signals
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field
from functools import cache
from typing import TYPE_CHECKING, Any

from poprun._version import __version__

from .carried import MIN_PYTHON
from .local import Sink
from .protocol import (PROTOCOL_VERSION, Control, FrameDecoder, Kind, Output, ProtocolError,
                       SpawnRequest, WORLD_KINDS, encode)
from .srun import STDERR_DATATYPE, NodeLink
from .ssh import SshError
from .uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

if TYPE_CHECKING:
    import asyncssh

AGENT_MODULE = "spawner.agent"
HELLO_TIMEOUT = 30.0  # a cold Python start on a loaded host can take seconds
REQUEST_TIMEOUT = 60.0
CLOSE_TIMEOUT = 5.0
HEARTBEATS_PER_TIMEOUT = 3  # heartbeats each way within one --host-timeout
DEADLINE_SLACK = 0.005  # seconds past a silence's deadline at which it is looked at
STDERR_TAIL = 4096  # bytes of the agent's stderr kept for error messages


# The fields the launcher reads of the agent's frames, and the types they must have.
_INT, _TEXT, _MAP, _OPTIONAL_MAP = (int,), (str,), (dict,), (dict, type(None))
_SHAPES: dict[Kind, dict[str, tuple[type, ...]]] = {
    Kind.EXIT: {"key": _INT, "returncode": _INT, "error": _OPTIONAL_MAP,
                "oom_kills": (int, type(None))},
    Kind.STARTED: {"key": _INT, "pid": _INT, "binding": _OPTIONAL_MAP,
                   "start": (int, type(None))},
    Kind.SPAWN_FAILED: {"key": _INT, "error": _TEXT},
    Kind.REPLY: {"id": _INT, "result": _MAP},
    Kind.FAILED: {"id": (int, type(None)), "error": _TEXT},
    Kind.INTERNAL: {"error": _TEXT, "traceback": (str, type(None))},
    Kind.STATS: {"usage": _MAP, "progress": _OPTIONAL_MAP},
    **{kind: {"kvsname": _TEXT} for kind in WORLD_KINDS},
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_pair(value: Any) -> bool:
    """[cpu %, rss] of STATS' usage: numbers, or null (no CPU % at the first sample)."""
    return (isinstance(value, list) and len(value) == 2
            and all(v is None or _is_number(v) for v in value))


def _is_step(value: Any) -> bool:
    """[step, total] of popdist.progress(): integers (total null: none)."""
    return (_is_pair(value) and isinstance(value[0], int) and not isinstance(value[0], bool)
            and (value[1] is None or isinstance(value[1], int)))


def _stack_answer(found: Any) -> dict[str, Any]:
    """An agent's stacks of one instance ({pid, how, threads, error}: spawner/stackdump.py)
    in that shape whatever it sent: what is not a thread or a frame is left out."""
    found = found if isinstance(found, dict) else {}
    threads = []
    for thread in found.get("threads") if isinstance(found.get("threads"), list) else ():
        if not isinstance(thread, dict) or not isinstance(thread.get("frames"), list):
            continue
        frames = [[str(f[0]), f[1], str(f[2]), str(f[3])] for f in thread["frames"]
                  if isinstance(f, list) and len(f) == 4 and type(f[1]) is int]
        threads.append({"thread": str(thread.get("thread", "")), "frames": frames,
                        "truncated": bool(thread.get("truncated"))})
    error = found.get("error")
    return {"pid": found.get("pid") if type(found.get("pid")) is int else None,
            "how": str(found.get("how")), "threads": threads,
            "error": None if error is None else str(error)}


# --- errors ----------------------------------------------------------------------------------

class RemoteError(SshError):
    """Base of the errors of this module; `str()` is one line naming the host."""

    def __init__(self, host: str, reason: str) -> None:
        self.host, self.reason = host, reason
        super().__init__(f"{host}: {reason}")


class AgentStartError(RemoteError):
    """The agent did not start or did not answer (no Python there, poprun not installed...)."""


class AgentVersionError(RemoteError):
    """The agent's host runs another protocol, poprun or Python version than the launcher.
    `differences` holds (what, here, there) triples."""

    def __init__(self, host: str, differences: Iterable[tuple[str, str, str]]) -> None:
        self.differences = tuple(differences)
        super().__init__(host, "; ".join(f"{what} {there} there, {here} here"
                                         for what, here, there in self.differences)
                         + " (use the same poprun on every host, or let poprun bring its "
                           "agent: --remote-install=auto)")


class AgentLostError(RemoteError):
    """The agent or its connection ended while a request was waiting for an answer."""


class AgentRequestError(RemoteError):
    """The agent answered a request with an error."""


class AgentInternalError(RemoteError):
    """An unexpected exception in the agent: `error` is its `<Type>: <message>`,
    `remote_traceback` its traceback as the agent formatted it."""

    def __init__(self, host: str, error: str, remote_traceback: str = "") -> None:
        self.error, self.remote_traceback = error, remote_traceback
        super().__init__(host, f"agent: {error}")


class RemoteSpawnError(RemoteError):
    """Some instances could not be started. `failures` {key: error}; `started` {key: pid}
    holds those that did, which the caller must stop."""

    def __init__(self, host: str, failures: Mapping[int, str], started: Mapping[int, int]):
        self.failures, self.started = dict(failures), dict(started)
        key, error = next(iter(self.failures.items()))
        more = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        super().__init__(host, f"cannot start instance {key}: {error}{more}")


# --- what the agent reports --------------------------------------------------------------

@dataclass(frozen=True)
class Versions:
    """What must match between the launcher and an agent."""

    protocol: int
    poprun: str
    python: tuple[int, int]  # major, minor

    @classmethod
    def here(cls) -> Versions:
        return cls(PROTOCOL_VERSION, __version__, sys.version_info[:2])


@dataclass(frozen=True)
class AgentInfo:
    """The agent's HELLO reply, for one host. `raw` is the whole reply (it may hold more
    than the fields below); `noise` is what the remote shell printed before the agent."""

    host: str
    protocol: int
    poprun: str
    python: tuple[int, ...]
    python_executable: str
    hostname: str
    pid: int
    cwd: str
    cwd_exists: bool
    program: str | None  # the program as instances will run it there; None: not found
    raw: Mapping[str, Any] = field(repr=False)
    noise: bytes = b""

    @classmethod
    def from_reply(cls, host: str, reply: Mapping[str, Any], noise: bytes) -> AgentInfo:
        """Another host's word: a field of another type reads as unknown (a protocol of -1,
        no Python version: AgentVersionError says so)."""
        python = reply.get("python") if isinstance(reply.get("python"), dict) else {}
        version = python.get("version") if isinstance(python.get("version"), list) else []
        program = reply.get("program")
        return cls(host=host, protocol=_int_or(reply.get("protocol"), -1),
                   poprun=str(reply.get("poprun")),
                   python=tuple(v for v in version[:3] if type(v) is int),  # major, minor, micro
                   python_executable=str(python.get("executable")),
                   hostname=str(reply.get("hostname")), pid=_int_or(reply.get("pid"), 0),
                   cwd=str(reply.get("cwd")), cwd_exists=bool(reply.get("cwd_exists")),
                   program=program if isinstance(program, str) else None, raw=dict(reply),
                   noise=noise)

    def versions(self) -> Versions:
        return Versions(self.protocol, self.poprun, self.python[:2])


def _int_or(value: Any, default: int) -> int:
    return value if type(value) is int else default


def check_versions(info: AgentInfo, expect: Versions) -> None:
    """Raise AgentVersionError naming every version that differs. The protocol and poprun
    must be the launcher's; the agent's Python need only be MIN_PYTHON or later (it runs
    nothing of the launcher's Python: spawner/bootstrap.py finds it)."""
    there = info.versions()
    differences = []
    if there.protocol != expect.protocol:
        differences.append(("agent protocol", str(expect.protocol), str(there.protocol)))
    if there.poprun != expect.poprun:
        differences.append(("poprun", expect.poprun, there.poprun))
    if there.python < MIN_PYTHON:
        differences.append(("Python", f"{_dotted(MIN_PYTHON)} or later",
                            f"{_dotted(info.python)} ({info.python_executable})"))
    if differences:
        raise AgentVersionError(info.host, differences)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass
class AgentTimings:
    """Seconds from `start()` to each phase on this host, for `-v`."""

    session: float | None = None  # the SSH channel runs the agent's command
    ready: float | None = None  # HELLO answered: the agent is up
    first_started: float | None = None  # the first instance runs

    def describe(self) -> str:
        phases = (("agent started", self.session), ("agent ready", self.ready),
                  ("first instance started", self.first_started))
        return ", ".join(f"{name} {at * 1000:.0f} ms" for name, at in phases if at is not None)


# The directory that holds this launcher's `spawner` and `poprun` (its installation).
OWN_HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The agent under `python -S`, from the directory that holds this launcher's `spawner`
# (agent_command): sys.path[0] ('' under -c) becomes that directory. Where the host has no
# such directory, `site` runs after all and the agent is imported as `-m` would find it.
_OWN_AGENT = ('import sys,os.path as p;d={home};sys.path.__setitem__(0,d) if p.isfile('
              'p.join(d,"spawner","agent.py")) else __import__("site").main();'
              'from spawner.agent import main;main()')


def agent_command(python: str | None) -> str:
    """The remote command line. `exec` makes the agent sshd's direct child (no shell left
    in between holding its pipes); the interpreter path is quoted for the remote shell.

    `python` None: the launcher's own interpreter, started with `-S` and told where this
    launcher's `spawner` is (`_OWN_AGENT`): `site` (its .pth files; ~50 ms per agent on the
    machine of bench/README.md, "Remote launches") is left out, and loaded by the agent only
    if an import needs it (spawner.agent: site on demand). An interpreter named by
    --remote-python runs `-m spawner.agent`, whatever poprun is installed for it."""
    if python is not None:
        return "exec " + shlex.join([python, "-m", AGENT_MODULE])
    # JSON's quotes are double: no single quote for the shell to escape (csh, fish).
    return "exec " + shlex.join([sys.executable, "-S", "-c",
                                 _OWN_AGENT.format(home=json.dumps(OWN_HOME))])


# --- the spawner -------------------------------------------------------------------------

class _AgentSession:
    """Hands the channel's bytes and its end to the RemoteSpawner (a Slurm node's link
    calls these two; over SSH, `_ssh_session` adds asyncssh's session around them)."""

    def __init__(self, owner: RemoteSpawner) -> None:
        self._owner = owner

    def data_received(self, data: bytes, datatype: int | None) -> None:
        try:
            if datatype == STDERR_DATATYPE:
                self._owner._on_stderr(data)
            else:
                self._owner._on_data(data)
        except Exception as exc:  # noqa: BLE001 - a bug on our side of the channel
            # asyncssh would close the connection and the host would look lost: hand it to
            # the loop's exception handler, where the launcher treats it as the bug it is.
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"exception handling the agent's output from {self._owner.host}",
                 "exception": exc})

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._on_closed(exc)


@cache
def _ssh_session() -> type:
    """_AgentSession as an asyncssh session (its other callbacks asyncssh's defaults), the
    class made on first use: asyncssh is imported only for connections that are SSH's."""
    import asyncssh

    return type("_SshAgentSession", (_AgentSession, asyncssh.SSHClientSession), {})


def _channel_errors() -> tuple[type[BaseException], ...]:
    """What opening or writing to a channel raises: OSError, and asyncssh's errors once
    asyncssh is loaded (before, no channel can be SSH's)."""
    asyncssh = sys.modules.get("asyncssh")
    return (OSError, asyncssh.Error) if asyncssh is not None else (OSError,)


class RemoteSpawner:
    """The agent on one host: starts, signals and watches that host's instances.

    `python`: the interpreter to run the agent with on that host (default: the launcher's
    own). `expect`: the versions the agent must report (default: the launcher's). The
    connection stays the caller's: closing the spawner does not close it.
    """

    def __init__(self, conn: asyncssh.SSHClientConnection | NodeLink, host: str,
                 sink: Sink, on_lost: Callable[[str, str], None] | None = None, *,
                 python: str | None = None, expect: Versions | None = None) -> None:
        self.host, self.conn, self._sink, self._on_lost = host, conn, sink, on_lost
        self.command = agent_command(python)
        self.command_label: str | None = None  # how errors name it (else `command`)
        # Called with each block of the agent's stderr (spawner.bootstrap answers its probe).
        self.on_stderr: Callable[[bytes], None] | None = None
        self._expect = expect or Versions.here()
        self._chan: asyncssh.SSHClientChannel | None = None
        self._decoder = FrameDecoder(expect_magic=True)
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future] = {}
        self._facts: asyncio.Future | None = None  # FACTS' answer (start(facts=...))
        self._facts_received = 0.0
        self._spawning: dict[int, asyncio.Future] = {}
        self._pids: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        self._stderr = bytearray()
        self._last_heard = time.monotonic()
        self._closed = asyncio.Event()
        self._closing = False
        self._t0 = 0.0
        # (prefix, path, error) of the temp dir HELLO asked for, until make_temp_dir takes it.
        self._made_temp_dir: tuple[str, str | None, str | None] | None = None
        self.timings = AgentTimings()
        self.info: AgentInfo | None = None
        # Per instance, its binding as the agent read it at start: {cpus, mems, mempolicy}.
        self.bindings: dict[int, dict[str, Any] | None] = {}
        self.lost: str | None = None  # why the agent ended before close(), if it did
        # A memory binding was asked for but that host cannot do it: why (as
        # LocalSpawner.memory_binding_skipped), None when nothing was skipped.
        self.memory_binding_skipped: str | None = None
        self.containment = "unknown"  # how the agent catches escaped descendants (for -v)
        self.errors: dict[int, dict[str, Any]] = {}  # as LocalSpawner.errors, from EXIT
        self.oom_kills: dict[int, int] = {}  # as LocalSpawner.oom_kills, from EXIT
        self.start_ticks: dict[int, int | None] = {}  # per instance, its start (procid.py)
        # Per instance, when its STARTED came (time.monotonic()): spawn_all returns only
        # once every instance of the host has started, and one may have printed before.
        self.started_at: dict[int, float] = {}
        # The launcher's side of each MPI world served here (poprun/run/worlds/pmi1.py), by
        # kvsname: the instances' and those of their spawns (run/worlds/spawn.py). Called with
        # each of the agent's frames about that world (WORLD_KINDS).
        self._worlds: dict[str, Callable[[RemoteSpawner, Control], None]] = {}
        # Its world requests refused for naming a rank that does not run there (the first
        # is said: poprun/run/worlds/pmi1.py's MpiWorld._refuse)
        self.refused = 0

    # --- starting ---------------------------------------------------------------------

    async def start(self, *, cwd: str, program: str | None = None, path: str | None = None,
                    timeout: float = HELLO_TIMEOUT, stats: float | None = None,
                    host_timeout: float | None = None, interfaces: bool = False,
                    temp_dir: str | None = None, facts: dict | None = None,
                    kill_timeout: float | None = None) -> AgentInfo:
        """Start the agent and greet it. `program` is resolved there as instances will run
        it (in `cwd`, on `path`: the PATH they will get). With `host_timeout`, both sides
        send heartbeats and each declares the other gone after that long without a word.
        With `interfaces`, the agent lists the host's network interfaces (spawner/netifs.py).
        With `temp_dir` (a prefix), the agent makes the first `make_temp_dir(temp_dir)`'s
        directory as it answers: no round trip of its own. With `facts` ({argv, env, cache,
        cwd}: spawner/hostfacts.py), the agent reads what the job depends on there once its
        answer is out, and FACTS, sent as that answer comes, collects it: `job_facts()` awaits
        it, the caller going on meanwhile. `kill_timeout`: what a SIGTERM of the agent gives
        its instances before SIGKILL (Agent.terminate). Raises AgentStartError, or
        AgentVersionError after stopping the agent: then nothing was started."""
        self._t0 = time.monotonic()
        session = _AgentSession if isinstance(self.conn, NodeLink) else _ssh_session()
        try:
            self._chan, _ = await self.conn.create_session(
                lambda: session(self), self.command, encoding=None)
        except _channel_errors() as exc:
            raise AgentStartError(self.host, f"cannot run the poprun agent: {exc}") from None
        self.timings.session = self._elapsed()
        major, minor = self._expect.python
        try:
            reply = await self._request(
                Kind.HELLO, timeout, protocol=self._expect.protocol, poprun=self._expect.poprun,
                python=[major, minor], cwd=cwd, program=program, path=path, stats=stats,
                interfaces=interfaces, mktemp=temp_dir, facts=facts,
                kill_timeout=kill_timeout,
                heartbeat=[host_timeout / HEARTBEATS_PER_TIMEOUT, host_timeout]
                if host_timeout else None)
        except RemoteError as exc:
            await self.close()
            shown = self.command_label or self.command
            raise AgentStartError(self.host, f"the poprun agent ({shown}) did not start: "
                                  f"{exc.reason}") from None
        self.timings.ready = self._elapsed()
        self.info = AgentInfo.from_reply(self.host, reply, self._decoder.noise)
        if temp_dir is not None:
            self._made_temp_dir = (temp_dir, reply.get("temp_dir"), reply.get("temp_dir_error"))
        try:
            check_versions(self.info, self._expect)
        except AgentVersionError:
            await self.close()
            raise
        if facts is not None:  # read there since HELLO's reply went out: collect them
            self._facts = self._ask(Kind.FACTS)
            self._facts.add_done_callback(self._facts_came)
        if host_timeout:
            self._beat(host_timeout / HEARTBEATS_PER_TIMEOUT, host_timeout)
        return self.info

    def _beat(self, interval: float, timeout: float) -> None:
        """Send a heartbeat; declare the agent lost once it has been silent past `timeout`
        (a frozen host or a stalled path: SSH itself may take much longer to notice)."""
        if self._closed.is_set() or self._closing:
            return
        silent = time.monotonic() - self._last_heard
        if silent > timeout:
            self._give_up(f"no word from the agent for {silent:.1f} s (--host-timeout "
                          f"{timeout:g})")
            return
        self._send_quietly(encode(Kind.HEARTBEAT))
        # The next look no later than the silence's deadline (a few ms past it): a host
        # silent since just after a beat is declared lost at `timeout`, not up to one
        # interval later (--host-timeout is the bound users plan a restart around).
        due = min(interval, timeout - silent + DEADLINE_SLACK)
        asyncio.get_running_loop().call_later(due, self._beat, interval, timeout)

    def _give_up(self, reason: str) -> None:
        """The agent is gone as far as the job is concerned, now: the channel may take its
        time to close over a stalled path."""
        self.lost = reason
        self._on_closed(None)
        if self._chan is not None:
            self._chan.close()

    async def make_temp_dir(self, prefix: str, timeout: float = REQUEST_TIMEOUT) -> str:
        """A new 0700 directory there, removed by the agent however it ends: the one HELLO
        made, for the first call with its prefix (see `start`), else MKTEMP's."""
        made = self._made_temp_dir
        if made is not None and made[0] == prefix:
            self._made_temp_dir = None
            _, path, error = made
            if path is None:
                raise AgentRequestError(self.host, error or "no temporary directory made")
            return path
        return (await self._request(Kind.MKTEMP, timeout, prefix=prefix))["path"]

    async def make_dir(self, path: str, timeout: float = REQUEST_TIMEOUT) -> str:
        """Create `path` (and its parents) there if missing; it is kept."""
        return (await self._request(Kind.MKDIR, timeout, path=path))["path"]

    async def spawn(self, request: SpawnRequest, timeout: float = REQUEST_TIMEOUT) -> int:
        return (await self.spawn_all([request], timeout))[request.key]

    async def spawn_all(self, requests: Iterable[SpawnRequest],
                        timeout: float = REQUEST_TIMEOUT) -> dict[int, int]:
        """Start instances, all requests sent at once; returns {key: pid}. Raises
        RemoteSpawnError when some could not start (the others keep running)."""
        waiting = {}
        for request in requests:
            self._send(encode(Kind.SPAWN, **request.to_fields()))
            waiting[request.key] = self._spawning[request.key] = self._new_future()
        outcomes = await self._wait(asyncio.gather(*waiting.values(), return_exceptions=True),
                                    timeout, "SPAWN")
        for outcome in outcomes:
            if isinstance(outcome, BaseException):  # the agent was lost meanwhile
                raise outcome
        started = {k: pid for k, (pid, _) in zip(waiting, outcomes) if pid is not None}
        failures = {k: error for k, (_, error) in zip(waiting, outcomes) if error is not None}
        if failures:
            raise RemoteSpawnError(self.host, failures, started)
        return started

    # --- running ----------------------------------------------------------------------

    def signal(self, key: int, sig: int) -> None:
        """Send `sig` to one instance's process group there (if it is still running). An
        instance whose SPAWN is still on its way gets it too: the agent reads in order."""
        if (key in self._pids or key in self._spawning) and key not in self._exited:
            self._send_quietly(encode(Kind.SIGNAL, key=key, signal=signals.Signals(sig).name))

    async def stacks(self, keys: Iterable[int] | None, timeout: float) -> dict[int, Any]:
        """The Python stacks of these instances there (every one: None), gathered by the
        agent within `timeout` (STACKS; spawner/stackdump.py): {key: {pid, how, threads,
        error}}."""
        reply = await self._request(Kind.STACKS, timeout + CLOSE_TIMEOUT, within=timeout,
                                    keys=None if keys is None else list(keys))
        stacks = reply.get("stacks")
        if not isinstance(stacks, dict):
            raise AgentRequestError(self.host, "its answer to STACKS holds no stacks")
        return {int(key): _stack_answer(found) for key, found in stacks.items()
                if key.isdigit()}

    async def probe(self, address: str, port: int, token: str, within: float) -> dict[str, Any]:
        """Whether the agent's host reaches `address`:`port` (a listener that echoes the
        token): {ok, error, seconds}."""
        return await self._request(Kind.PROBE, within + CLOSE_TIMEOUT, address=address,
                                   port=port, token=token, within=within)

    def open_world(self, on_world: Callable[[RemoteSpawner, Control], None],
                   **fields: Any) -> None:
        """WORLD: the agent serves an MPI world's PMI for its ranks here (spawner.worlds.nodeworld);
        its requests go to `on_world`. Send before the SPAWNs that join it."""
        self._worlds[fields["kvsname"]] = on_world
        self._send(encode(Kind.WORLD, **fields))

    def end_world(self, kvsname: str) -> None:
        """WORLD_END: the world's processes are gone; what the agent still says of it is
        dropped."""
        if self._worlds.pop(kvsname, None) is not None:
            self.tell(Kind.WORLD_END, kvsname=kvsname)

    def tell(self, kind: Kind, **fields: Any) -> None:
        """A frame that needs no answer (a world's WORLD_END, FENCE_OUT, VALUE): dropped
        when the agent is gone or going, as nothing there needs it any more."""
        self._send_quietly(encode(kind, **fields))

    def write(self, data: bytes) -> None:
        """Raw bytes on the agent's stdin, outside the protocol (spawner.bootstrap's zip)."""
        self._send(data)

    def signal_all(self, sig: int) -> None:
        self._send_quietly(encode(Kind.SIGNAL, key=None, signal=signals.Signals(sig).name))

    def pid(self, key: int) -> int:
        return self._pids[key]

    def running(self) -> list[int]:
        """Keys of the instances started (or being started) whose exit has not been
        reported yet; none once the agent is gone."""
        return [] if self._closed.is_set() else self._unreported()

    def unaccounted(self) -> list[int]:
        """Instances whose exit will never be reported: the agent was lost or closed first."""
        return self._unreported() if self._closed.is_set() else []

    def _unreported(self) -> list[int]:
        keys = [*self._pids, *(k for k in self._spawning if k not in self._pids)]
        return [k for k in keys if k not in self._exited]

    @property
    def idle(self) -> bool:
        """Nothing more will be reported: every started instance's exit was, or the agent
        is gone."""
        return not self.running()

    @property
    def stderr_tail(self) -> str:
        return self._stderr.decode(errors="replace")

    def new_attempt(self, sink: Sink, on_lost: Callable[[str, str], None] | None) -> None:
        """Forget the instances of a finished attempt (a restarted job reuses their keys) and
        report the next attempt's events to `sink`."""
        if self.running():
            raise RuntimeError(f"{self.host}: instances of the last attempt still run")
        for record in (self._pids, self._exited, self.errors, self.oom_kills, self.bindings,
                       self._spawning,
                       self.start_ticks, self.started_at):
            record.clear()
        self._sink, self._on_lost = sink, on_lost

    # --- stopping ---------------------------------------------------------------------

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the agent's stdin and wait (at most `timeout`) for it to end: it kills
        whatever of its instances still runs and removes its temp dirs."""
        self._closing = True
        if self._chan is None or self._closed.is_set():
            return
        try:
            self._chan.write_eof()
        except _channel_errors():
            pass  # the channel is going anyway
        try:
            async with asyncio.timeout(timeout):  # launcher-only: 3.11's; not wait_for
                await self._closed.wait()
        except asyncio.TimeoutError:
            self._chan.close()  # the agent still sees EOF; stop waiting for its exit

    # --- protocol plumbing ------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    def _new_future(self) -> asyncio.Future:
        return asyncio.get_running_loop().create_future()

    def _send(self, frame: bytes) -> None:
        if self._chan is None or self._closed.is_set() or self.lost is not None:
            raise AgentLostError(self.host, f"the agent is gone ({self.lost or 'closed'})")
        self._chan.write(frame)

    def _send_quietly(self, frame: bytes) -> None:
        """For signals: an agent that is gone has no instance left to signal."""
        if (self._chan is not None and not self._closed.is_set() and not self._closing
                and self.lost is None):  # given up on: its channel is closing
            self._chan.write(frame)

    async def _request(self, kind: Kind, timeout: float, **fields: Any) -> dict[str, Any]:
        return await self._wait(self._ask(kind, **fields), timeout, kind.name)

    def _ask(self, kind: Kind, **fields: Any) -> asyncio.Future:
        """Send a request; the future of its answer."""
        request_id = next(self._ids)
        self._send(encode(kind, id=request_id, **fields))  # first: raises when it is gone
        future = self._replies[request_id] = self._new_future()
        return future

    def _facts_came(self, future: asyncio.Future) -> None:
        """When FACTS' answer came (for the host's clock offset); its error taken, so that
        one nobody awaits (the launch failed meanwhile) is never reported as a bug."""
        self._facts_received = time.time()
        if not future.cancelled():
            future.exception()

    async def job_facts(self, timeout: float = REQUEST_TIMEOUT
                        ) -> tuple[dict[str, Any], float] | None:
        """The answer to the FACTS sent with HELLO (None: none was) and when it came
        (time.time()). Raises AgentLostError."""
        if self._facts is None:
            return None
        facts = await self._wait(asyncio.shield(self._facts), timeout, Kind.FACTS.name)
        return facts, self._facts_received

    async def _wait(self, awaitable: Any, timeout: float, what: str) -> Any:
        try:
            # not wait_for, which can drop a cancellation (spawner/within.py); this module
            # runs only in the launcher (Python 3.11+: bootstrap.LAUNCHER_ONLY)
            async with asyncio.timeout(timeout):
                return await awaitable
        except asyncio.TimeoutError:
            raise AgentLostError(self.host, f"the agent did not answer {what} within "
                                 f"{timeout:g} s") from None

    def _on_data(self, data: bytes) -> None:
        self._last_heard = time.monotonic()
        if self.lost is not None:  # given up on: nothing it says counts any more
            return
        broken = None
        try:
            frames = self._decoder.feed(data)
        except ProtocolError as exc:  # what came whole before it is the agent's word still
            frames, broken = exc.frames, exc
        sink = self._sink
        for frame in frames:
            if type(frame) is Output:  # the hot path first
                if frame.key not in self._pids or frame.key in self._exited:
                    self._abort(f"the agent's output is not the agent protocol (OUTPUT of "
                                f"instance {frame.key}, which is not running)")
                    return
                sink.on_output(frame.key, frame.stream, frame.data)
                continue
            why = self._malformed(frame)
            if why is None:
                try:
                    self._on_control(frame)
                except ProtocolError as exc:  # a world's frame that is not one (on_world)
                    why = str(exc)
            if why is not None:
                self._abort(f"the agent's output is not the agent protocol ({frame.kind.name} "
                            f"frame: {why})")
                return
        if broken is not None:
            self._abort(f"the agent's output is not the agent protocol ({broken})")

    def _on_control(self, frame: Control) -> None:
        fields = frame.fields
        if frame.kind is Kind.EXIT:
            self._exited[fields["key"]] = fields["returncode"]
            if fields.get("error"):
                from popdist.errorfile import checked  # only for an instance that failed

                error = checked(fields["error"])
                if error is not None:
                    self.errors[fields["key"]] = error
            if (fields.get("oom_kills") or 0) > 0 and fields["returncode"] == -signals.SIGKILL:
                self.oom_kills[fields["key"]] = fields["oom_kills"]  # a count: only its sign
            on_progress = getattr(self._sink, "on_progress", None)
            if fields.get("progress") and on_progress:  # its last step, for the result
                on_progress(fields["key"], *fields["progress"])
            self._sink.on_exit(fields["key"], fields["returncode"])
        elif frame.kind is Kind.STARTED:
            self._pids[fields["key"]] = fields["pid"]
            self.bindings[fields["key"]] = fields.get("binding")
            self.start_ticks[fields["key"]] = fields.get("start")
            self.started_at[fields["key"]] = time.monotonic()
            reason = fields.get("memory_binding_reason")  # another host's words: bounded
            if reason is not None:
                self.memory_binding_skipped = (reason[:400] if isinstance(reason, str) else
                                               "py-libnuma, libnuma or NUMA support is missing")
            self.containment = fields.get("containment", self.containment)
            if self.timings.first_started is None:
                self.timings.first_started = self._elapsed()
            self._resolve(self._spawning.pop(fields["key"], None), (fields["pid"], None))
        elif frame.kind is Kind.ALIVE:
            pass  # its arrival is the news (_on_data noted the time)
        elif frame.kind in WORLD_KINDS:
            on_world = self._worlds.get(fields["kvsname"])
            if on_world is not None:
                on_world(self, frame)
            else:  # a world that has ended, or none this agent serves
                from .worlds.nodeworld import answer_no_world

                answer_no_world(self.tell, frame)
        elif frame.kind is Kind.STATS:  # for a sink that shows them (the dashboard)
            on_usage = getattr(self._sink, "on_usage", None)
            # (an instance of an attempt before this one is no longer the sink's)
            for key, (cpu, rss) in fields["usage"].items() if on_usage else ():
                if int(key) in self._pids:
                    on_usage(int(key), cpu, rss)
            on_progress = getattr(self._sink, "on_progress", None)
            for key, (step, total) in (fields.get("progress") or {}).items() \
                    if on_progress else ():
                if int(key) in self._pids:
                    on_progress(int(key), step, total)
        elif frame.kind is Kind.SPAWN_FAILED:
            self._resolve(self._spawning.pop(fields["key"], None), (None, fields["error"]))
        elif frame.kind is Kind.REPLY:
            self._resolve(self._replies.pop(fields["id"], None), fields["result"])
        elif frame.kind is Kind.INTERNAL:  # the agent is stopping its instances and exits
            self._closing = True
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"internal error in the poprun agent on {self.host}",
                 "exception": AgentInternalError(self.host, fields["error"],
                                                 fields.get("traceback", ""))})
        elif frame.kind is Kind.FAILED and fields.get("id") in self._replies:
            future = self._replies.pop(fields["id"])
            if not future.done():
                future.set_exception(AgentRequestError(self.host, fields["error"]))
        else:  # a FAILED without request: it could not read what we sent
            self._abort(f"the agent rejected a message: {fields.get('error', frame.kind.name)}")

    def _malformed(self, frame: Control) -> str | None:
        """Why the frame is not what the agent protocol says (None: it is): the agent's
        output is another host's, read as hostile input. Its fields must have their types,
        an instance's frames come in order (STARTED or SPAWN_FAILED for an instance being
        started, then EXIT once) and a report names only instances that run there."""
        fields, kind = frame.fields, frame.kind
        if kind in _SHAPES:
            for name, types in _SHAPES[kind].items():
                value = fields.get(name)
                if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
                    return f"its {name} is {type(value).__name__}"
        if kind in (Kind.STARTED, Kind.SPAWN_FAILED) and fields["key"] not in self._spawning:
            return f"instance {fields['key']} is not being started"
        if kind is Kind.EXIT:
            key, progress = fields["key"], fields.get("progress")
            if key not in self._pids or key in self._exited:
                return f"instance {key} is not running"
            if progress is not None and not _is_step(progress):
                return "its progress is not [step, total]"
        if kind is Kind.STATS:
            for name, pair in (("usage", _is_pair), ("progress", _is_step)):
                for key, value in (fields.get(name) or {}).items():
                    if not (key.isdigit() and pair(value)):
                        return f"its {name} of {key[:20]!r} is not an instance's pair"
        return None

    @staticmethod
    def _resolve(future: asyncio.Future | None, result: Any) -> None:
        if future is not None and not future.done():
            future.set_result(result)

    def _on_stderr(self, data: bytes) -> None:
        self._stderr += data
        del self._stderr[:-STDERR_TAIL]
        if self.on_stderr is not None:
            self.on_stderr(data)

    def _abort(self, reason: str) -> None:
        self.lost = self.lost or reason
        if self._chan is not None:
            self._chan.close()

    def _on_closed(self, exc: Exception | None) -> None:
        if self._closed.is_set():  # already given up on (heartbeat), now really closed
            return
        reason = self.lost or self._end_reason(exc)
        self._closed.set()
        error = AgentLostError(self.host, reason)
        for future in (*self._replies.values(), *self._spawning.values()):
            if not future.done():
                future.set_exception(error)
        self._replies.clear()
        self._spawning.clear()
        if self._closing:
            return
        self.lost = reason
        if self._on_lost is not None and self.info is not None:
            # Through the loop: asyncssh calls this from its connection cleanup, where an
            # exception is swallowed (the job then waited forever for the lost instances);
            # a loop callback's goes to the loop's exception handler (launcher._Guard).
            asyncio.get_running_loop().call_soon(self._on_lost, self.host, reason)

    def _end_reason(self, exc: Exception | None) -> str:
        if exc is not None:
            detail = str(exc)
            return "the SSH connection was lost" + (
                "" if detail.lower() == "connection lost" else f" ({detail})")
        assert self._chan is not None
        status = self._chan.get_exit_status()
        name, *_ = self._chan.get_exit_signal() or (None,)
        reason = (f"the agent was killed by SIG{name}" if name
                  else f"the agent exited with status {status}" if status is not None
                  else "the agent's connection closed")
        last = self.stderr_tail.strip().splitlines()[-1:] if self._stderr else []
        return f"{reason}: {last[0]}" if last else reason
