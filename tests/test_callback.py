"""An agent calling its launcher back (spawner/callback.py), without Slurm: a real agent
process against the launcher's real listener, and each side against a counterpart that does
not hold the secret. Under Slurm, tests/test_slurm_launch.py runs the same through srun."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from conftest import SRC
from spawner import callback
from spawner.callback import (CALLBACK_VARIABLE, MAGIC, NONCE, PROOF, STEP_VARIABLE,
                              CallbackListener, new_secret)
from spawner.protocol import MAGIC as PROTOCOL_MAGIC

pytestmark = pytest.mark.timeout(60)


class _Receiver:
    def __init__(self) -> None:
        self.data = bytearray()
        self.lost = asyncio.get_running_loop().create_future()
        self.magic = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data
        if self.data.startswith(PROTOCOL_MAGIC) and not self.magic.done():
            self.magic.set_result(None)

    def eof_received(self) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


async def _listener(secret: bytes):
    calls, refused = [], []
    receiver = _Receiver()

    def on_agent(identity, caller):
        calls.append((identity, caller))
        return receiver

    listener = CallbackListener(secret, on_agent, refused.append)
    listener.bind("127.0.0.1")
    await listener.serve()
    return listener, calls, refused, receiver


async def _agent(target: str, secret_hex: str, **env: str) -> asyncio.subprocess.Process:
    """A real agent given the secret as srun gives it: the first line of its stdin."""
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spawner.agent", stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": SRC, CALLBACK_VARIABLE: target,
             STEP_VARIABLE: "3", "SLURMD_NODENAME": "n7", "SLURM_PROCID": "5", **env})
    agent.stdin.write(secret_hex.encode() + b"\n")
    agent.stdin.close()
    return agent


async def test_an_agent_with_the_secret_calls_back_and_speaks_the_protocol():
    """Proven both ways, the listener hands the connection on with the agent's identity;
    the agent protocol follows (its MAGIC first), and the launcher's EOF ends the agent."""
    secret = new_secret()
    listener, calls, refused, receiver = await _listener(secret)
    try:
        agent = await _agent(listener.target(), secret.hex())
        await asyncio.wait_for(receiver.magic, 30)
        (identity, caller), = calls
        assert identity == {"node": "n7", "step": "3", "task": "5"}
        caller.transport.write_eof()
        assert await asyncio.wait_for(agent.wait(), 30) == 0
        await asyncio.wait_for(receiver.lost, 10)
        assert not refused
    finally:
        listener.close()


async def test_the_agent_takes_the_launch_node_address_slurm_gives_without_one():
    secret = new_secret()
    listener, calls, _, receiver = await _listener(secret)
    try:
        agent = await _agent(f":{listener.port}", secret.hex(),
                             SLURM_LAUNCH_NODE_IPADDR="127.0.0.1")
        await asyncio.wait_for(receiver.magic, 30)
        calls[0][1].transport.write_eof()
        assert await asyncio.wait_for(agent.wait(), 30) == 0
    finally:
        listener.close()


async def test_an_agent_with_another_secret_runs_nothing_and_is_not_taken():
    """The launcher's proof does not match the agent's secret: the agent says so and exits
    (2) before reading one frame; the listener hands nothing on."""
    listener, calls, _, _ = await _listener(new_secret())
    try:
        agent = await _agent(listener.target(), new_secret().hex())
        _, err = await asyncio.wait_for(agent.communicate(), 30)
        assert agent.returncode == 2
        assert b"does not hold this job's secret" in err, err
        assert not calls
    finally:
        listener.close()


def test_an_agent_that_reaches_something_else_runs_nothing(tmp_path):
    """Whatever answers where the launcher was (another user's process on its port) cannot
    prove the secret: the agent exits without running what it is then sent."""
    touched = tmp_path / "touched"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        agent = subprocess.Popen(
            [sys.executable, "-m", "spawner.agent"], stderr=subprocess.PIPE,
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": SRC, CALLBACK_VARIABLE: f"127.0.0.1:{port}"})
        agent.stdin.write(new_secret().hex().encode() + b"\n")
        agent.stdin.flush()  # communicate() closes it
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            assert conn.recv(len(MAGIC) + NONCE).startswith(MAGIC)
            conn.sendall(os.urandom(NONCE + PROOF) + f"touch {touched}\n".encode())
            _, err = agent.communicate(timeout=30)
    assert agent.returncode == 2 and b"does not hold this job's secret" in err, err
    assert not touched.exists()


@pytest.mark.parametrize("sent", [b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64, "fake proof", b""],
                         ids=["not-an-agent", "fake-proof", "silent"])
async def test_a_caller_without_the_secret_is_refused(monkeypatch, sent):
    """Refused, said (`on_refused`), closed; never handed on. A silent one after
    HANDSHAKE_TIMEOUT (shortened here)."""
    monkeypatch.setattr(callback, "HANDSHAKE_TIMEOUT", 0.5)
    listener, calls, refused, _ = await _listener(new_secret())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        if sent == "fake proof":
            writer.write(MAGIC + os.urandom(NONCE))
            await reader.readexactly(NONCE + PROOF)
            writer.write(os.urandom(PROOF) + b"\x02{}" + b"SPAWN")
        else:
            writer.write(sent)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed on it
        writer.close()
        assert not calls
        assert len(refused) == 1
        assert refused[0].startswith("127.0.0.1:")
    finally:
        listener.close()


async def test_unproven_callers_are_bounded(monkeypatch):
    """Past MAX_UNPROVEN connections still proving, the oldest is closed to make room for
    the new one (issue 46: refusing the new one let idle connections keep agents out)."""
    monkeypatch.setattr(callback, "MAX_UNPROVEN", 2)
    listener, _, refused, _ = await _listener(new_secret())
    opened = []
    try:
        for _ in range(3):
            opened.append(await asyncio.open_connection("127.0.0.1", listener.port))
        assert await asyncio.wait_for(opened[0][0].read(), 10) == b""
        assert any("newer connections" in why for why in refused)
        await asyncio.sleep(0)  # the third's connection_made may follow its connect
        assert len(listener.unproven) == 2
    finally:
        for _, writer in opened:
            writer.close()
        listener.close()
