"""spawner/srun.py without Slurm: the step's output told apart by node (`--label`), srun's
word on a task's end, the bounds on what is held for a node, and the kill of an srun that
does not end. The parsing is fed the step's output as srun writes it; the rest runs real
agents (spawner.agent) through a stand-in `srun` (tests/standins/slurm/srun, written from
srun(1): Slurm cannot run everywhere the tests do). Where it can, tests/test_slurm_launch.py
runs the same through the real srun."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
from pathlib import Path

import pytest

from conftest import SRC
from spawner import srun
from spawner.protocol import MAGIC as PROTOCOL_MAGIC
from spawner.srun import (HELD_STDERR, MAX_LINE, STDERR_DATATYPE, SlurmAgents, _Step,
                          cancellation, srun_argv, step_variables)
from sshd_hosts import processes_with

pytestmark = pytest.mark.timeout(60)
STANDIN = str(Path(__file__).resolve().parent / "standins" / "slurm" / "srun")
COMMAND = "exec agent"  # what a _Step fed by hand runs (nothing: it is never started)


class _Session:
    """What RemoteSpawner's session gets from a link: the agent's stream and its stderr."""

    def __init__(self) -> None:
        self.stream, self.stderr = bytearray(), bytearray()
        loop = asyncio.get_running_loop()
        self.lost, self.magic = loop.create_future(), loop.create_future()

    def data_received(self, data: bytes, datatype: int | None) -> None:
        if datatype == STDERR_DATATYPE:
            self.stderr += data
            return
        self.stream += data
        if self.stream.startswith(PROTOCOL_MAGIC) and not self.magic.done():
            self.magic.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def _said(step: _Step, node: str) -> bytes:
    """What `node`'s session is handed once its agent has called (a call taken by hand)."""
    link = step.links[node]
    assert link.take(object())
    _, session = await asyncio.wait_for(link.create_session(_Session, COMMAND), 10)
    return bytes(session.stderr)


# --- the step's output, as srun writes it -----------------------------------------------------

async def test_labelled_lines_reach_their_nodes_once_each_task_is_placed():
    """A task's lines wait until its node is known (its agent's call, `learn`), then go to
    that node's link, in order; a line may come in pieces, and labels are padded."""
    notes: list[str] = []
    step = _Step(0, ["node1", "node2"], COMMAND, notes.append)
    step.pipe_data_received(1, b"0: one\n1: two\n0: thr")
    step.pipe_data_received(1, b"ee\n 1: four\n")
    step.learn("1", "node2")
    step.learn(0, "node1")
    assert await _said(step, "node1") == b"one\nthree\n"
    assert await _said(step, "node2") == b"two\nfour\n"
    assert notes == []


async def test_a_one_node_steps_lines_are_placed_at_once_and_srun_s_own_are_notes():
    notes: list[str] = []
    step = _Step(0, ["node1"], COMMAND, notes.append)
    step.pipe_data_received(1, b"0: here\nsrun: Job step created\n")
    assert await _said(step, "node1") == b"here\n"
    assert notes == ["srun: Job step created"]


async def test_a_line_is_cut_at_max_line_and_no_more_of_it_is_kept():
    step = _Step(0, ["node1"], COMMAND, lambda text: None)
    for _ in range(64):  # 1 MiB with no newline: what is kept stays bounded meanwhile
        step.pipe_data_received(1, b"0: " + b"x" * 16384)
        assert len(step._partial) <= MAX_LINE
    step.pipe_data_received(1, b"tail\n")
    assert await _said(step, "node1") == b"x" * (MAX_LINE - len(b"0: ")) + b"\n"


async def test_an_unplaced_tasks_lines_are_held_up_to_a_bound():
    """Lines of a task whose node is not known yet: the first HELD_STDERR // 64 are kept."""
    step = _Step(0, ["node1", "node2"], COMMAND, lambda text: None)
    step.pipe_data_received(1, b"".join(b"1: line %d\n" % i for i in range(1000)))
    step.learn(1, "node2")
    assert await _said(step, "node2") == \
        b"".join(b"line %d\n" % i for i in range(HELD_STDERR // 64))


async def test_a_nodes_output_before_its_session_is_held_up_to_a_bound():
    """Before the session takes it, a node's output is held for a failure's reason: its
    last HELD_STDERR bytes."""
    step = _Step(0, ["node1"], COMMAND, lambda text: None)
    lines = b"".join(b"0: line %d\n" % i for i in range(2000))
    step.pipe_data_received(1, lines)
    held = await _said(step, "node1")
    assert len(held) == HELD_STDERR
    assert re.sub(rb"(?m)^0: ", b"", lines).endswith(held)


async def test_srun_s_word_on_a_tasks_end_fails_its_node_with_the_nodes_last_words():
    """`srun: error: node2: task 1: Exited with exit code 127` places task 1 on node2 and
    ends the wait for its call; the node's own last line, which may come after srun's, makes
    the reason (srun's lines do not)."""
    notes: list[str] = []
    step = _Step(0, ["node1", "node2"], COMMAND, notes.append)
    step.pipe_data_received(1, b"1: starting\n"
                               b"srun: error: node2: task 1: Exited with exit code 127\n"
                               b"1: /bin/sh: 1: exec: /nonexistent/python: not found\n")
    link = step.links["node2"]
    assert link.end_reason == "its task of the job step ended (Exited with exit code 127)"
    with pytest.raises(ConnectionError) as failed:
        await asyncio.wait_for(link.create_session(_Session, COMMAND), 10)
    assert str(failed.value) == ("its task of the job step ended (Exited with exit code 127): "
                                 "/bin/sh: 1: exec: /nonexistent/python: not found")
    assert step.links["node1"].end_reason is None and notes == []


def test_slurmstepd_s_cancellation_is_found_in_a_nodes_output():
    said = ("something\nslurmstepd: error: *** STEP 12.0 ON node1 CANCELLED AT "
            "2026-11-29T08:00:00 DUE TO TIME LIMIT ***\n")
    assert cancellation(said) == \
        "*** STEP 12.0 ON node1 CANCELLED AT 2026-11-29T08:00:00 DUE TO TIME LIMIT ***"
    assert cancellation("*** STEP 12.0 ON node1 RUNNING ***\n") is None


def test_the_steps_variables_are_named_only_inside_a_step():
    environ = {"SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node1", "SLURM_PROCID": "0",
               "SLURM_JOB_ID": "12", "HOME": "/root"}
    assert sorted(step_variables(environ)) == ["SLURM_PROCID", "SLURM_STEP_ID",
                                               "SLURM_STEP_NODELIST"]
    assert step_variables({"SLURM_PROCID": "0", "SLURM_JOB_ID": "12"}) == []


def test_one_srun_asks_for_one_task_on_each_node():
    argv = srun_argv("/usr/bin/srun", ["node1", "node3"], "exec agent")
    assert argv[:5] == ["/usr/bin/srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                        "--nodelist=node1,node3"]
    assert argv[-3:] == ["/bin/sh", "-c", "exec agent"]
    assert {"--label", "--kill-on-bad-exit=0", "--wait=0", "--no-kill", "--overlap",
            "--input=none", "--export=ALL", "--mpi=none"} <= set(argv)


# --- real agents through the stand-in srun ----------------------------------------------------

@pytest.fixture
def agent_path(monkeypatch):
    """The agents' PYTHONPATH (this checkout's): srun's environment is the step's."""
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


def _sruns() -> list[int]:
    """The stand-in srun processes this test process started."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rpartition(") ")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if STANDIN.encode() in argv[:2] and parent == os.getpid():
            found.append(int(entry))
    return found


async def test_every_nodes_agent_calls_back_through_one_srun(agent_path):
    """Each node's agent calls back and speaks the protocol on its connection; what the node
    wrote first reaches its own session as stderr; EOF ends every agent, and srun with them
    (no kill needed)."""
    notes: list[str] = []
    agents = SlurmAgents(STANDIN, "127.0.0.1", notes.append)
    command = f"echo hello from $SLURMD_NODENAME >&2; exec {sys.executable} -m spawner.agent"
    try:
        links = agents.start(["node1", "node2"], command)
        sessions = {}
        for node, link in links.items():
            _, sessions[node] = await asyncio.wait_for(
                link.create_session(_Session, command), 30)
        (pid,) = _sruns()
        for node, session in sessions.items():
            await asyncio.wait_for(session.magic, 30)
            links[node].write_eof()
            assert await asyncio.wait_for(session.lost, 30) is None
            assert session.stderr == f"hello from {node}\n".encode()
    finally:
        await asyncio.wait_for(agents.close(), 30)
    assert not Path(f"/proc/{pid}").exists()  # ended and reaped
    assert notes == [], notes


async def test_a_node_whose_task_ends_before_its_call_is_named_with_its_words(agent_path):
    command = (f'if [ "$SLURMD_NODENAME" = node2 ]; then echo no python here >&2; exit 3; fi; '
               f"exec {sys.executable} -m spawner.agent")
    agents = SlurmAgents(STANDIN, "127.0.0.1", lambda text: None)
    try:
        links = agents.start(["node1", "node2"], command)
        _, session = await asyncio.wait_for(links["node1"].create_session(_Session, command), 30)
        with pytest.raises(ConnectionError) as failed:
            await asyncio.wait_for(links["node2"].create_session(_Session, command), 30)
        assert str(failed.value) == \
            "its task of the job step ended (Exited with exit code 3): no python here"
        await asyncio.wait_for(session.magic, 30)
    finally:
        await asyncio.wait_for(agents.close(), 30)


async def test_srun_ending_before_a_call_fails_the_wait_with_the_nodes_words(agent_path):
    agents = SlurmAgents(STANDIN, "127.0.0.1", lambda text: None)
    try:
        links = agents.start(["node1"], "echo bye >&2")
        with pytest.raises(ConnectionError, match=r"^srun ended \(status 0\) before its agent "
                                                  r"called back: bye$"):
            await asyncio.wait_for(links["node1"].create_session(_Session, "echo bye >&2"), 30)
    finally:
        await asyncio.wait_for(agents.close(), 30)


async def test_an_srun_that_cannot_run_fails_every_node():
    agents = SlurmAgents("/nonexistent/srun", "127.0.0.1", lambda text: None)
    try:
        links = agents.start(["node1", "node2"], "exec agent")
        for link in links.values():
            with pytest.raises(ConnectionError, match="^cannot run srun: .*No such file"):
                await asyncio.wait_for(link.create_session(_Session, "exec agent"), 10)
    finally:
        await asyncio.wait_for(agents.close(), 30)


async def test_an_srun_that_does_not_end_is_killed_with_its_tasks(monkeypatch, agent_path):
    """Its tasks never call back and never end (a node whose agent hangs; a lost node's task
    also leaves srun waiting): the wait for the call ends at CALLBACK_TIMEOUT (shortened
    here), and closing kills srun after STEP_EXIT_GRACE, its tasks with it."""
    monkeypatch.setattr(srun, "CALLBACK_TIMEOUT", 0.5)
    marker = f"poprun-test-{uuid.uuid4().hex}"
    command = f"exec {sys.executable} -c 'import time; time.sleep(300)' {marker}"
    agents = SlurmAgents(STANDIN, "127.0.0.1", lambda text: None)
    pids: list[int] = []
    try:
        links = agents.start(["node1", "node2"], command)
        with pytest.raises(ConnectionError, match="did not call back within 0.5 s"):
            await asyncio.wait_for(links["node1"].create_session(_Session, command), 10)
        await asyncio.wait_for(_until(lambda: len(processes_with(marker)) == 3), 30)  # srun
        # and both its tasks
        pids = _sruns()
        await asyncio.wait_for(agents.close(), 30)
        assert len(pids) == 1 and not Path(f"/proc/{pids[0]}").exists()  # killed, reaped
        # Its tasks were killed with it (its process group): gone as they finish dying.
        await asyncio.wait_for(_until(lambda: not processes_with(marker)), 10)
    finally:
        for pid in [*pids, *processes_with(marker)]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
