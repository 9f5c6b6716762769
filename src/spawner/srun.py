"""Slurm as the transport: one job step starts every node's agent, and each agent calls back.

`SlurmAgents.start(nodes, command)` runs one

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=<nodes> --overlap --label
         --kill-on-bad-exit=0 --wait=0 --no-kill ... /bin/sh -c <agent>

for all `nodes` (as Open MPI's mpirun starts its daemons under Slurm), and gives one
`NodeLink` per node: it stands where an asyncssh connection stands for RemoteSpawner. Each
agent connects back to the launcher over TCP and proves it holds the job's secret
(spawner/callback.py), then speaks the agent protocol on that connection. So a job on N nodes
is one step creation at slurmctld and one `srun` on the launch node, whatever N (a step per
node cost N of each: bench/README.md, "One step for every node").

Why the options (checked on the real Slurm 22.05 of tests/slurm_cluster.py and srun(1)):
`--kill-on-bad-exit=0` and `--wait=0`: one agent's exit (its node lost, an agent killed)
ends neither the step nor the other nodes' agents: poprun decides. `--no-kill`: a node
Slurm declares failed does not end the job with it either. `--label`: the step's output
(what the agents write on stderr, and slurmstepd's `*** STEP ... CANCELLED ***`, which
names a scancel or a time limit in the report) comes one line at a time prefixed with the
task's number, which says whose it is (the protocol never goes through it, so splitting
lines costs nothing). `--input=all`: srun broadcasts its stdin to every task: the job's
secret, one line, then its end (spawner/callback.py, `read_secret`), so that the secret is in
no environment (srun's, the agent's) nor on a command line. `--export=ALL`: the agents have
the launcher's environment whatever SLURM_EXPORT_ENV says. `--mpi=none` whatever the
cluster's MpiDefault: the agent is no MPI task, and a PMIx or PMI-2 plugin would set up a
server for the step and put PMIX_*/PMI_* variables in the agents' environment, which
instances inherit. `--overlap`:
the step shares the nodes with the allocation's other steps.

The callback serves only the allocation: as a step starts, its nodes' addresses are looked up
(`node_addresses`: NodeAddr and NodeHostName as `scontrol show node` gives them, resolved),
and the listener closes at once a caller from any other address (spawner/callback.py).

A node whose slurmd and slurmstepd die leaves srun waiting for its task: srun stays until
the job ends. So closing waits `STEP_EXIT_GRACE` for srun to end once the agents are told
to, then SIGKILLs it, which cancels the step (its tasks gone within 0.5 s). A restart gives
the lost nodes a step of their own (`start` again), their agents calling back to the same
listener.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .callback import (CALLBACK_VARIABLE, STEP_VARIABLE, Caller, CallbackListener,
                       is_loopback, new_secret)
from .containment import MARK
from .within import bounded

STDERR_DATATYPE = 1  # asyncssh.EXTENDED_DATA_STDERR: how the session tells stderr apart
# Variables a job step sets that describe the agent's task of its step, not the instances.
STEP_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID",
                  "SLURM_GTIDS", "SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE",
                  "SLURM_CPU_BIND", "SLURM_DISTRIBUTION", "SLURM_LAUNCH_NODE_IPADDR",
                  "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT", "SLURM_UMASK",
                  "SLURM_LABELIO", "SLURM_NNODES", "SLURM_NODELIST")
SRUN_OPTIONS = ("--overlap", "--label", "--kill-on-bad-exit=0", "--wait=0", "--no-kill",
                "--input=all", "--export=ALL", "--mpi=none", "--job-name=poprun-agent")
CALLBACK_TIMEOUT = 60.0  # seconds from a step's start to its agent's call (a cold Python)
STEP_EXIT_GRACE = 2.0  # seconds srun has to end once its agents are told to
STEP_KILL_WAIT = 5.0  # ... and to be gone after SIGKILL
TASK_END_GRACE = 0.5  # seconds a node's last words may follow srun's word on its task's end
MAX_LINE = 4096  # bytes of one line of the step's output kept (the rest is cut)
HELD_STDERR = 4096  # bytes of a node's output kept before its agent's session takes it
LOOKUP_TIMEOUT = 10.0  # seconds scontrol has to say where a step's nodes are
MAX_LOOKUP_OUTPUT = 16 << 20  # bytes of scontrol's answer read (~1 KB a node)


# What slurmstepd writes on the step's stderr when Slurm ends it (scancel, a time limit).
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT [^*]*\*\*\*")
_LABELLED = re.compile(rb"\s*(\d+): ?(.*)", re.S)  # --label's "<task>: ", padded
_TASK_ENDED = re.compile(rb"srun: error: (\S+): tasks? (\d+): (.*)", re.S)


def cancellation(stderr: str) -> str | None:
    """slurmstepd's `*** STEP 12.0 ON node1 CANCELLED AT ... DUE TO TIME LIMIT ***` in an
    agent's stderr: Slurm ended the job (scancel, its time limit); None otherwise."""
    found = _CANCELLED.findall(stderr)
    return found[-1].strip() if found else None


def step_variables(environ: Mapping[str, str]) -> list[str]:
    """The names a job step set in `environ` (SLURM_STEP_* and STEP_VARIABLES): an agent
    started by srun does not pass them on to its instances."""
    if "SLURM_STEP_ID" not in environ:
        return []
    return [name for name in environ
            if name.startswith("SLURM_STEP") or name in STEP_VARIABLES]


_NODE_ADDRESS = re.compile(r"(?:^|\s)(?:NodeAddr|NodeHostName)=(\S+)")


def node_address_names(scontrol: str) -> list[str]:
    """Every NodeAddr and NodeHostName of `scontrol show node -o`'s lines, each once."""
    return list(dict.fromkeys(name for name in _NODE_ADDRESS.findall(scontrol)
                              if name not in ("(null)", "")))


async def node_addresses(scontrol: str, nodes: Sequence[str]) -> tuple[set[str], bool]:
    """The addresses `nodes` call from: their NodeAddr and NodeHostName resolved, and when
    one of them is this machine (a node that is the launch node; a test cluster's, all
    127.0.0.1), every address of this machine (then the second item is True: any loopback
    one too). Raises OSError or ValueError where they cannot be told."""
    proc = await asyncio.create_subprocess_exec(
        scontrol, "show", "node", "-o", ",".join(nodes), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        out = await bounded(proc.stdout.read(MAX_LOOKUP_OUTPUT), LOOKUP_TIMEOUT)
        status = await bounded(proc.wait(), LOOKUP_TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if status != 0:
        raise OSError(f"`scontrol show node` ended with status {status}")
    loop = asyncio.get_running_loop()
    found: set[str] = set()
    for name in node_address_names(out.decode(errors="replace")):
        try:
            found.update(info[4][0] for info in await loop.getaddrinfo(
                name, None, type=socket.SOCK_STREAM))
        except socket.gaierror:
            continue  # a NodeHostName only Slurm knows: its NodeAddr is the one
    if not found:
        raise ValueError("scontrol named no address that resolves")
    here = _own_addresses()
    local = bool(found & here) or any(is_loopback(a) for a in found)
    return (found | here if local else found), local


def _own_addresses() -> set[str]:
    from .netifs import interfaces

    return {address.split("/")[0] for found in interfaces().values() for address in found}


def srun_argv(srun: str, nodes: Sequence[str], command: str) -> list[str]:
    """One task on each of `nodes`, running `command` (see the module docstring)."""
    count = len(nodes)
    return [srun, f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", *SRUN_OPTIONS, "/bin/sh", "-c", command]


class SlurmAgents:
    """The job's steps and the listener their agents call back to (one per launch).
    `note(line)`: what srun says about the steps and every refused connection (for -v)."""

    def __init__(self, srun: str, address: str | None, note: Callable[[str], None]) -> None:
        self._srun, self._note = srun, note
        beside = os.path.join(os.path.dirname(srun), "scontrol")
        self._scontrol = beside if os.access(beside, os.X_OK) else shutil.which("scontrol")
        self._lookups: list[asyncio.Task] = []
        self._secret = new_secret()
        self._listener = CallbackListener(self._secret, self._on_agent,
                                          lambda why: note(f"refused a connection from {why}"))
        self._listener.bind(address)  # the port, before any agent needs it
        self._serving = asyncio.ensure_future(self._listener.serve())
        self._steps: list[_Step] = []

    def start(self, nodes: Sequence[str], command: str) -> dict[str, NodeLink]:
        """One step running `command` on every node of `nodes`; its link per node."""
        step = _Step(len(self._steps), nodes, command, self._note)
        self._steps.append(step)
        self._listener.learning()
        self._lookups.append(asyncio.ensure_future(self._learn(nodes)))
        # Without the launcher's helpers' mark: srun hands its environment to the agents
        # (--export=ALL), and the launcher's watchdog, which SIGKILLs what carries that mark
        # when the launcher dies, would kill every agent on its host, and the agent's own
        # watchdog with it, before they stop their instances (left running, in their own
        # sessions). srun itself is the launcher's child: its watchdog finds it all the same.
        env = {**{k: v for k, v in os.environ.items() if k != MARK},
               CALLBACK_VARIABLE: self._listener.target(), STEP_VARIABLE: str(step.number)}
        secret_line = self._secret.hex().encode() + b"\n"  # callback.read_secret's
        step.run(srun_argv(self._srun, nodes, command), env, secret_line)
        return dict(step.links)

    async def _learn(self, nodes: Sequence[str]) -> None:
        """The listener told where `nodes` call from (or, where that cannot be told, that
        any address may: the secret still decides)."""
        try:
            if self._scontrol is None:
                raise OSError("`scontrol` is not on PATH")
            addresses, loopback = await node_addresses(self._scontrol, nodes)
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            self._note(f"cannot tell the addresses of the job's nodes ({exc or 'timed out'}): "
                       "calls back are taken from any address")
            self._listener.learnt(None)
            return
        self._listener.learnt(addresses, loopback)

    def _on_agent(self, identity: dict[str, Any], caller: Caller) -> NodeLink | None:
        """A proven call: the link it belongs to, if that one still waits for it."""
        steps = {str(step.number): step for step in self._steps}
        step = steps.get(str(identity.get("step")))
        link = step.links.get(identity["node"]) if step is not None else None
        if link is None or not link.take(caller):
            self._note(f"an agent on {identity['node']} called back for no node waiting "
                       "for it: closed")
            return None
        step.learn(identity.get("task"), identity["node"])
        return link

    async def close(self) -> None:
        """No more calls; every link closed (its agent, if still there, sees the end of
        its connection and exits); every srun gone, SIGKILLed if still there after
        STEP_EXIT_GRACE."""
        self._listener.close()
        for task in (self._serving, *self._lookups):
            if not task.done():
                task.cancel()
        await asyncio.gather(self._serving, *self._lookups, return_exceptions=True)
        for step in self._steps:
            for link in step.links.values():
                link.close()
        await asyncio.gather(*(step.end() for step in self._steps))


class NodeLink:
    """One node's agent, reached through its call back: the connection RemoteSpawner
    asks for a session (`create_session`), and the channel it then writes to."""

    def __init__(self, node: str, command: str) -> None:
        self.node, self._command = node, command
        loop = asyncio.get_running_loop()
        self._called = loop.create_future()  # the agent's call, or why none will come
        self._called.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._caller: Caller | None = None
        self._session: Any = None
        self._held: list[tuple[str, tuple]] = []  # for the session, until it is there
        self._held_stderr = bytearray()  # the node's output, kept for a failure's reason
        self.end_reason: str | None = None  # srun said the node's task ended
        self.call_timeout = CALLBACK_TIMEOUT  # seconds create_session waits for the call
        self._closed = loop.create_future()

    # --- as the step's ---------------------------------------------------------------

    def take(self, caller: Caller) -> bool:
        """The agent's call, proven: False if the link no longer waits for one."""
        if self._called.done():
            return False
        self._caller = caller
        self._called.set_result(None)
        return True

    def fail(self, reason: str) -> None:
        """No call will come (the step or the node's task ended first): the reason, and
        the last line the node said itself (not srun about it)."""
        if not self._called.done():
            said = self._held_stderr.decode(errors="replace").strip().splitlines()
            last = [line for line in said if not line.startswith("srun: ")][-1:]
            self._called.set_exception(ConnectionError(
                f"{reason}: {last[0]}" if last else reason))
            self._finish()

    def ended(self, reason: str) -> None:
        """srun says the node's task ended, so no call will come. The node's last words
        may reach the step's output after srun's: they are waited for (TASK_END_GRACE, or
        srun's end, whichever comes first) to make the reason."""
        self.end_reason = reason
        asyncio.get_running_loop().call_later(TASK_END_GRACE, self.fail, reason)

    def stderr(self, data: bytes) -> None:
        """A line of the node's output, as the step carried it."""
        self._held_stderr += data
        del self._held_stderr[:-HELD_STDERR]
        self._pass("data_received", data, STDERR_DATATYPE)

    # --- as the connection's receiver (spawner.callback.Caller) ---------------------

    def data_received(self, data: bytes) -> None:
        self._pass("data_received", data, None)

    def eof_received(self) -> None:
        pass  # the agent has ended: the connection closes next

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish()
        self._pass("connection_lost", exc)

    def _pass(self, name: str, *args: Any) -> None:
        if self._session is not None:
            getattr(self._session, name)(*args)
        elif name != "data_received" or args[1] is None:  # output is in _held_stderr
            self._held.append((name, args))

    def _finish(self) -> None:
        if not self._closed.done():
            self._closed.set_result(None)

    # --- as the connection (RemoteSpawner's) --------------------------------------

    async def create_session(self, factory: Callable[[], Any], command: str,
                             encoding: str | None = None) -> tuple[NodeLink, Any]:
        if command != self._command:
            raise ValueError(f"the step runs {self._command!r}, not {command!r}")
        session = factory()
        try:
            await bounded(asyncio.shield(self._called), self.call_timeout)
        except TimeoutError:
            raise ConnectionError(f"its agent did not call back within "
                                  f"{self.call_timeout:g} s") from None
        self._session = session
        if self._held_stderr:
            session.data_received(bytes(self._held_stderr), STDERR_DATATYPE)
        held, self._held = self._held, []
        for name, args in held:
            getattr(session, name)(*args)
        return self, session

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """`sockname`: the launcher's address as the agent reached it. Not `peername`: a
        Slurm node's address for the others is its name (Fleet.address_of)."""
        if name == "sockname" and self._caller is not None:
            found = self._caller.transport.get_extra_info("sockname")
            if found:  # an IPv4 peer of the dual-stack listener: its IPv4 address
                return (found[0].removeprefix("::ffff:") if "." in found[0] else found[0],
                        *found[1:])
        return default

    def close(self) -> None:
        """Close the connection at once (the agent sees it end, and exits); no call is
        awaited any more."""
        self.fail("closed")
        if self._caller is not None:
            self._caller.transport.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    # --- as the channel ---------------------------------------------------------------

    def write(self, data: bytes) -> None:
        self._caller.transport.write(data)

    def write_eof(self) -> None:
        """The end of what the launcher says: it ends the agent."""
        transport = self._caller.transport
        if not transport.is_closing():
            transport.write_eof()

    def get_exit_status(self) -> int | None:
        return None  # srun tells it on the step's output: "task N: Exited with ..."

    def get_exit_signal(self) -> tuple[str, bool, str, str] | None:
        return None


class _Step(asyncio.SubprocessProtocol):
    """One `srun`: its links, and its output told apart by node (`--label`)."""

    def __init__(self, number: int, nodes: Sequence[str], command: str,
                 note: Callable[[str], None]) -> None:
        self.number, self._note = number, note
        self.links = {node: NodeLink(node, command) for node in nodes}
        # Which node each task runs on: learnt from its agent's call or srun's word on its
        # end; a one-node step's only task is known.
        self._tasks: dict[int, str] = {0: nodes[0]} if len(nodes) == 1 else {}
        self._unplaced: dict[int, list[bytes]] = {}  # lines of tasks not placed yet
        self._partial = bytearray()
        self._last = ""  # srun's last line of its own
        self._transport: asyncio.SubprocessTransport | None = None
        self._creating: asyncio.Future | None = None
        self._stdin = b""
        self._exited = self._read = False
        self._done = asyncio.get_running_loop().create_future()

    def run(self, argv: list[str], env: dict[str, str], stdin: bytes) -> None:
        """Start srun; `stdin`: what it broadcasts to the tasks (the secret's line)."""
        self._stdin = stdin
        self._creating = asyncio.ensure_future(self._create(argv, env))

    async def _create(self, argv: list[str], env: dict[str, str]) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.subprocess_exec(
                lambda: self, *argv, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=True)  # a Ctrl-C reaches poprun, which ends the step itself
        except OSError as exc:
            self._fail_all(f"cannot run srun: {exc}")
            self._done.set_result(None)

    def learn(self, task: object, node: str) -> None:
        try:
            task = int(task)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        self._tasks[task] = node
        for line in self._unplaced.pop(task, ()):
            self.links[node].stderr(line)

    # --- its output -------------------------------------------------------------------

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._partial += data
        *lines, rest = self._partial.split(b"\n")
        self._partial = bytearray(rest[:MAX_LINE])
        for line in lines:
            self._line(bytes(line[:MAX_LINE]) + b"\n")

    def _line(self, line: bytes) -> None:
        labelled = _LABELLED.fullmatch(line)
        if labelled:
            task, text = int(labelled[1]), labelled[2]
            node = self._tasks.get(task)
            if node in self.links:
                self.links[node].stderr(text)
            elif len(self._unplaced.setdefault(task, [])) < HELD_STDERR // 64:
                self._unplaced[task].append(text)
            return
        ended = _TASK_ENDED.fullmatch(line)
        node = ended[1].decode(errors="replace") if ended else None
        if node in self.links:
            self.learn(ended[2].decode(), node)
            self.links[node].stderr(line)
            self.links[node].ended(f"its task of the job step ended "
                                   f"({ended[3].decode().strip()})")
            return
        self._last = line.decode(errors="replace").strip()
        self._note(self._last)

    # --- its end ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        stdin = transport.get_pipe_transport(0)  # type: ignore[attr-defined]
        stdin.write(self._stdin)  # ~65 bytes: the pipe takes them at once
        stdin.close()  # its end: srun sends every task EOF after the line

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd != 1:
            return  # stdin's end (closed once written, or srun gone)
        if self._partial:
            self._line(bytes(self._partial) + b"\n")
            self._partial.clear()
        self._read = True
        self._maybe_done()

    def process_exited(self) -> None:
        self._exited = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self._exited and self._read and not self._done.done():
            code = self._transport.get_returncode()
            self._fail_all(f"srun ended (status {code}) before its agent called back"
                           + (f": {self._last}" if self._last else ""))
            self._done.set_result(None)

    def _fail_all(self, reason: str) -> None:
        for link in self.links.values():
            link.fail(link.end_reason or reason)

    async def end(self) -> None:
        """srun gone: within STEP_EXIT_GRACE of its own, else SIGKILLed (the step is
        cancelled with it)."""
        if self._creating is not None and not self._creating.done():
            self._creating.cancel()  # asyncio kills a process whose creation is cancelled
            await asyncio.gather(self._creating, return_exceptions=True)
        if self._transport is None:
            return
        try:
            await bounded(asyncio.shield(self._done), STEP_EXIT_GRACE)
            return
        except TimeoutError:
            pass
        if self._transport.get_returncode() is None:
            try:
                os.killpg(self._transport.get_pid(), signal.SIGKILL)
            except ProcessLookupError:
                pass
        await asyncio.wait([asyncio.shield(self._done)], timeout=STEP_KILL_WAIT)
