"""Slurm as the transport: each node's agent runs as a job step of the allocation.

`SrunConnection(node)` stands where an asyncssh connection stands for RemoteSpawner: its
`create_session()` runs the agent command as `srun --nodes=1 --ntasks=1 --nodelist=<node>
--overlap --unbuffered ...` and hands the step's stdin/stdout/stderr to the session, so the
agent protocol, and everything built on it, is the same as over SSH.

Why one step per node rather than one step for all (measured on a real Slurm 22.05, tests/
slurm_cluster.py): one srun for every node cannot give each agent its own stdin (`--input`
feeds one task or all of them the same bytes) and `--label` prefixes output line by line, which
breaks binary frames; addressed messages over a broadcast stdin took 24-39 ms per round trip.
Steps per node, started in parallel, were all up in 115-130 ms for 2 nodes (310-350 ms for 8),
carry bytes unchanged (NUL, 0xff, 20 MiB echoed intact), and end with EOF on stdin.
`--unbuffered` passes partial lines at once (slurmstepd otherwise waits for a newline);
`--overlap` lets the step share the nodes with the allocation's other steps. `--mpi=none`
whatever the cluster's MpiDefault: the agent is no MPI task, and a PMIx or PMI-2 plugin would
set up a server for its step (time on every launch) and put its PMIX_*/PMI_* variables in the
agent's environment, which instances inherit (poprun serves their world itself). SIGKILL of the
srun cancels the step (its task gone within 0.5 s); a cancelled or timed-out job's steps end
with slurmstepd's `*** STEP ... CANCELLED ... ***` on stderr, which becomes the lost host's
reason.

A step's I/O travels between srun and slurmstepd over TCP with Nagle's algorithm on, in
messages of at most 1 KiB: a message is sent only once the last one is acknowledged, and the
receiver delays its acknowledgement up to 40 ms unless it has something to send back. So an
agent's HELLO reply (~6 KiB) came in two parts 40 ms apart, STARTED frames and an EXIT right
after them the same, and a 1.3 KiB SPAWN likewise. `StepAck` gives the other side something to
send back: the launcher answers what an agent sends with a HEARTBEAT, the agent what the
launcher sends with an ALIVE (neither answers those two, so they never answer each other), at
most one every `ACK_INTERVAL`; the acknowledgement rides on it and the rest follows at once
(bench/README.md, "Remote launches").
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Callable, Mapping
from typing import Any

STDERR_DATATYPE = 1  # asyncssh.EXTENDED_DATA_STDERR: how the session tells stderr apart
# Variables a job step sets that describe the agent's one-task step, not the instances.
STEP_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID",
                  "SLURM_GTIDS", "SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE",
                  "SLURM_CPU_BIND", "SLURM_DISTRIBUTION", "SLURM_LAUNCH_NODE_IPADDR",
                  "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT", "SLURM_UMASK")


ACK_INTERVAL = 0.01  # seconds: at most this often a StepAck sends


class StepAck:
    """Over a job step's I/O, `send()` (a frame the other side ignores) when the other side
    has sent something and more may follow: at once, or once ACK_INTERVAL has passed since
    the last (see the module docstring)."""

    def __init__(self, send: Callable[[], None]) -> None:
        self._send = send
        self._last = float("-inf")
        self._due = False

    def __call__(self) -> None:
        if self._due:
            return
        loop = asyncio.get_running_loop()
        delay = self._last + ACK_INTERVAL - loop.time()
        if delay <= 0:
            self._fire(loop)
        else:
            self._due = True
            loop.call_later(delay, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = False
        self._last = loop.time()
        self._send()


# What slurmstepd writes on the step's stderr when Slurm ends it (scancel, a time limit).
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT [^*]*\*\*\*")


def cancellation(stderr: str) -> str | None:
    """slurmstepd's `*** STEP 12.0 ON node1 CANCELLED AT ... DUE TO TIME LIMIT ***` in an
    agent step's stderr: Slurm ended the job (scancel, its time limit); None otherwise."""
    found = _CANCELLED.findall(stderr)
    return found[-1].strip() if found else None


def step_variables(environ: Mapping[str, str]) -> list[str]:
    """The names a job step set in `environ` (SLURM_STEP_* and STEP_VARIABLES): an agent
    started by srun does not pass them on to its instances."""
    if "SLURM_STEP_ID" not in environ:
        return []
    return [name for name in environ
            if name.startswith("SLURM_STEP") or name in STEP_VARIABLES]


class SrunConnection:
    """One node of the allocation, reached by `srun` (see the module docstring).

    `start(command)` creates the step before anyone asks for it: the launcher does it as soon
    as it knows the nodes, so that slurmctld's step creation and the agent's interpreter start
    overlap what the launcher still has to do (its job record, control socket...: bench/
    README.md, "Remote launches"). What the step sends meanwhile is kept for the session
    that `create_session` then gives it, in order."""

    def __init__(self, node: str, srun: str = "srun") -> None:
        self.node, self._srun = node, srun
        self._steps: list[_Step] = []
        self._early: tuple[str, asyncio.Future] | None = None  # start()'s command and step

    def start(self, command: str) -> None:
        self._early = (command, asyncio.ensure_future(self._run(_Held(), command)))

    async def create_session(self, factory: Callable[[], Any], command: str,
                             encoding: str | None = None) -> tuple[_Step, Any]:
        session = factory()
        early, self._early = self._early, None
        if early is not None and early[0] == command:
            step = await early[1]
            step.attach(session)
        else:
            if early is not None:  # another command after all: that step is not wanted
                _end_held(early[1])
            step = await self._run(session, command)
        return step, session

    async def _run(self, session: Any, command: str) -> _Step:
        argv = [self._srun, "--nodes=1", "--ntasks=1", f"--nodelist={self.node}", "--overlap",
                "--unbuffered", "--kill-on-bad-exit=1", "--mpi=none",
                "--job-name=poprun-agent", "/bin/sh", "-c", command]
        loop = asyncio.get_running_loop()
        _, step = await loop.subprocess_exec(
            lambda: _Step(session), *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)  # a Ctrl-C reaches poprun, which closes the step itself
        self._steps.append(step)
        return step

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: addresses come from the agent (its hostname)

    def close(self) -> None:
        """Cancel the steps (SIGKILL of srun). A step started ahead that no session took (the
        launch stopped first) is ended by its agent instead: EOF on its stdin, as a launcher
        that is done does; cancelled only if still there after HELD_EOF_GRACE."""
        held = _end_held(self._early[1]) if self._early is not None else None
        for step in self._steps:
            if step is not held:
                step.close()

    async def wait_closed(self) -> None:
        if self._early is not None:  # its creation, if close() came while it went on
            await asyncio.gather(self._early[1], return_exceptions=True)
            self._early = None
        await asyncio.gather(*(step.wait_closed() for step in self._steps))


HELD_EOF_GRACE = 2.0  # seconds an unused step's agent has to end at EOF before srun's SIGKILL


def _end_held(creating: asyncio.Future) -> _Step | None:
    """End a step started ahead that no session took; the step, if it was created."""
    if not creating.done():
        creating.cancel()  # asyncio kills a process whose creation is cancelled
        return None
    if creating.cancelled() or creating.exception() is not None:
        return None
    step = creating.result()
    step.write_eof()
    asyncio.get_running_loop().call_later(HELD_EOF_GRACE, step.close)
    return step


class _Held:
    """A step's session until create_session gives it the real one: what srun sends, kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def data_received(self, data: bytes, datatype: int | None) -> None:
        self.calls.append(("data_received", (data, datatype)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append(("connection_lost", (exc,)))


class _Step(asyncio.SubprocessProtocol):
    """A running `srun`, as the channel RemoteSpawner writes to and reads from."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self._transport: asyncio.SubprocessTransport | None = None
        self._open = {1, 2}  # stdout and stderr until each reaches EOF
        self._exited = False
        self._done = asyncio.get_running_loop().create_future()

    def attach(self, session: Any) -> None:
        """The session from now on, told first what the step sent before (SrunConnection)."""
        held, self._session = self._session, session
        for name, args in held.calls:
            getattr(session, name)(*args)

    # --- as the session's channel -------------------------------------------------------

    def write(self, data: bytes) -> None:
        self._transport.get_pipe_transport(0).write(data)

    def write_eof(self) -> None:
        """EOF on the agent's stdin, through the step: it ends the agent."""
        stdin = self._transport.get_pipe_transport(0)
        if stdin is not None:
            stdin.close()

    def close(self) -> None:
        """Cancel the step: SIGKILL of srun, which slurmstepd answers by killing the task."""
        if self._transport is not None and self._transport.get_returncode() is None:
            try:
                os.killpg(self._transport.get_pid(), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def get_exit_status(self) -> int | None:
        code = self._transport.get_returncode() if self._transport else None
        return code if code is None or code >= 0 else None

    def get_exit_signal(self) -> tuple[str, bool, str, str] | None:
        code = self._transport.get_returncode() if self._transport else None
        if code is None or code >= 0:
            return None
        return signal.Signals(-code).name.removeprefix("SIG"), False, "", ""

    async def wait_closed(self) -> None:
        await asyncio.shield(self._done)

    # --- as asyncio's subprocess protocol ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._session.data_received(data, STDERR_DATATYPE if fd == 2 else None)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open.discard(fd)
        self._maybe_done()

    def process_exited(self) -> None:
        self._exited = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        """The session hears of the end once srun has exited and its output is all read."""
        if self._exited and not self._open and not self._done.done():
            self._done.set_result(None)
            self._session.connection_lost(None)
