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

from conftest import SRC, reaped
from spawner import callback
from spawner.callback import (CALLBACK_VARIABLE, MAGIC, NONCE, PROOF, STEP_VARIABLE,
                              CallbackListener, new_secret)
from spawner.protocol import MAGIC as PROTOCOL_MAGIC
from spawner.protocol import Kind, SpawnRequest, encode
from sshd_hosts import wait_until

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


async def _until(condition, timeout: float = 10.0) -> None:
    """Wait (turning the loop, which serves the listener) until `condition()` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


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
    prove the secret: the agent exits without running what it is then sent, a real SPAWN
    frame that an agent taking the answer for its launcher's would run at once."""
    touched = tmp_path / "touched"
    spawn = SpawnRequest(key=0, argv=(sys.executable, "-c", f"open({str(touched)!r}, 'w')"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with reaped(subprocess.Popen(
                [sys.executable, "-m", "spawner.agent"], stderr=subprocess.PIPE,
                stdin=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": SRC, CALLBACK_VARIABLE: f"127.0.0.1:{port}"})) as agent:
            agent.stdin.write(new_secret().hex().encode() + b"\n")
            agent.stdin.flush()  # communicate() closes it
            conn, _ = server.accept()
            with conn:
                conn.settimeout(30)
                assert conn.recv(len(MAGIC) + NONCE).startswith(MAGIC)
                conn.sendall(os.urandom(NONCE + PROOF) + encode(Kind.SPAWN, **spawn.to_fields()))
                wait_until(lambda: agent.poll() is not None or touched.exists(),
                           "the agent to exit (or run the SPAWN)", 30)
                assert not touched.exists()
                _, err = agent.communicate(timeout=30)
    assert agent.returncode == 2 and b"does not hold this job's secret" in err, err


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
    the new one (refusing the new one let idle connections keep agents out)."""
    monkeypatch.setattr(callback, "MAX_UNPROVEN", 2)
    listener, _, refused, _ = await _listener(new_secret())
    opened = []
    try:
        for _ in range(3):
            opened.append(await asyncio.open_connection("127.0.0.1", listener.port))
        assert await asyncio.wait_for(opened[0][0].read(), 10) == b""
        assert any("newer connections" in why for why in refused)
        await _until(lambda: len(listener.unproven) == 2)
    finally:
        for _, writer in opened:
            writer.close()
        listener.close()


# --- serving only the allocation ---------------------------------------------------


async def test_a_caller_from_no_node_of_the_job_is_closed_at_once():
    """Once the job's nodes' addresses are known, a caller from another address is closed
    without waiting for its proof; while they are being looked up it is held, and closed
    when they turn out not to include it. Said once."""
    listener, calls, refused, _ = await _listener(new_secret())
    try:
        listener.learning()
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        await _until(lambda: len(listener.unproven) == 1)  # held: it may yet be a node's
        listener.learnt({"192.0.2.7"})  # TEST-NET-1: no address of this machine
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # at once
            writer.close()
        assert not calls and not listener.unproven
        assert len(refused) == 1 and "not an address of the job's nodes" in refused[0]
    finally:
        listener.close()


def _flood(port: int, count: int, garbage: bool) -> list[socket.socket]:
    """`count` connections to `port` that never prove anything: silent, or sending noise."""
    opened = []
    for k in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if garbage:
            sock.sendall(os.urandom(1 + k % 100))
        opened.append(sock)
    return opened


@pytest.mark.parametrize("garbage", [False, True], ids=["idle", "garbage"])
async def test_a_thousand_callers_that_prove_nothing_cannot_keep_an_agent_out(garbage):
    """Guards a defect: 200 idle connections in the first 0.3 s locked the launch out (128 held for
    30 s each, then every agent refused, and an agent did not try again). Now the agent's
    call makes room for itself (the oldest unproven caller of its address goes), or tries
    again: it is taken, and the refusals are one line for the address."""
    secret = new_secret()
    listener, calls, refused, receiver = await _listener(secret)
    listener.learning()
    listener.learnt({"127.0.0.1"})
    flood: list[socket.socket] = []
    try:
        flood = await asyncio.to_thread(_flood, listener.port, 1000, garbage)
        agent = await _agent(listener.target(), secret.hex())
        await asyncio.wait_for(receiver.magic, 30)
        (identity, caller), = calls
        assert identity["node"] == "n7"
        assert len(listener.unproven) <= callback.MAX_UNPROVEN_PER_SOURCE
        caller.transport.write_eof()
        assert await asyncio.wait_for(agent.wait(), 30) == 0
        assert len(refused) == 1 and refused[0].startswith("127.0.0.1:"), refused
    finally:
        for sock in flood:
            sock.close()
        listener.close()


def test_an_agent_that_is_dropped_tries_again():
    """A launcher that closes the agent's first calls unanswered (busy with a flood): the
    agent calls again, with backoff, and is taken on the fourth."""
    secret = new_secret()
    identity_seen = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(30)
        port = server.getsockname()[1]
        agent = subprocess.Popen(
            [sys.executable, "-m", "spawner.agent"], stderr=subprocess.PIPE,
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": SRC, CALLBACK_VARIABLE: f"127.0.0.1:{port}",
                 "SLURMD_NODENAME": "n7"})
        agent.stdin.write(secret.hex().encode() + b"\n")
        agent.stdin.flush()
        for _ in range(3):
            dropped, _ = server.accept()
            dropped.close()
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            hello = _exactly(conn, len(MAGIC) + NONCE)
            assert hello.startswith(MAGIC)
            mine = os.urandom(NONCE)
            conn.sendall(mine + callback.proof(secret, b"launcher", hello[len(MAGIC):], mine))
            shown = _exactly(conn, PROOF + 1)
            raw = _exactly(conn, shown[PROOF])
            assert shown[:PROOF] == callback.proof(secret, b"agent", hello[len(MAGIC):],
                                                   mine, raw)
            identity_seen.append(raw)
            conn.shutdown(socket.SHUT_WR)  # the launcher's EOF: the agent ends
            _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert b'"node": "n7"' in identity_seen[0]


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        assert chunk, data
        data += chunk
    return data


def test_the_secret_comes_on_stdin_and_nothing_else_will_do():
    """No secret line (stdin empty, or not hex): the agent says so and exits 2 without
    calling; the secret is never looked for in the environment."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for given in (b"", b"zz" * 32 + b"\n", new_secret().hex().encode()):  # no newline
            agent = subprocess.run(
                [sys.executable, "-m", "spawner.agent"], input=given, capture_output=True,
                env={**os.environ, "PYTHONPATH": SRC, CALLBACK_VARIABLE: f"127.0.0.1:{port}",
                     callback.SECRET_VARIABLE: new_secret().hex()}, timeout=30)
            assert agent.returncode == 2, agent.stderr
            assert b"stdin does not start with the job's secret" in agent.stderr, agent.stderr


def test_the_nodes_addresses_are_read_from_scontrol_show_node():
    from spawner.srun import node_address_names

    shown = ("NodeName=node1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.5 "
             "NodeHostName=n1.cluster Version=22.05\n"
             "NodeName=node2 NodeAddr=node2 NodeHostName=node2 OS=Linux\n"
             "NodeName=node3 NodeAddr=(null) NodeHostName=10.0.0.5\n")
    assert node_address_names(shown) == ["10.0.0.5", "n1.cluster", "node2"]
    assert node_address_names("") == []
