"""Fuzzing every surface an instance or a neighbour reaches (Hypothesis): the PMI-1 wire, the
Horovod rendezvous's HTTP, popdist's progress, error and stacks files, the output bytes and
`--progress-pattern`. Each surface has fast properties over the code that parses it, its
server run in-process over real sockets and fed input that reaches its limits (the
rendezvous's 8 KiB head, 64 KiB value and store bound; PMI's 1 MiB line and KEYS_PER_RANK x
size, at several ranks and through an agent-mode server), beside a tick that must keep
ticking (tests/fuzzing.py: reproducible, bounded by example counts), and a few real launches
fed generated input, where poprun must end as the instances' own doing says (never 70, the
internal error; never a signal it did not get), within its timeout (never hung), with its peak
memory bounded. The network's and the agents' surfaces are in tests/test_fuzz_peers.py; the
PMIx server has its own (tests/test_pmix_fuzz.py)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import struct
import sys

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conftest import OFFLINE, run_poprun_peak
from fuzzing import FAST, HEAVY, LAUNCHES, run, ticking

pytestmark = pytest.mark.timeout(300)

MAX_PEAK_KIB = 120 * 1024  # ~24 MiB idle here; a leak of what is sent would show
INTERNAL_ERROR = 70


def launch(count: int, program: str, *args: str, options: tuple[str, ...] = (),
           timeout: float = 60):
    """Run `program` (Python) as `count` instances; poprun's result and peak memory, checked
    for what every launch here must hold."""
    proc, peak = run_poprun_peak(*OFFLINE, f"--num-instances={count}",
                                 f"--num-replicas={count}", *options, sys.executable, "-c",
                                 program, *args, timeout=timeout)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode != INTERNAL_ERROR and "Traceback" not in err, err[-3000:]
    assert peak < MAX_PEAK_KIB, f"poprun's peak RSS {peak} KiB"
    return proc, err


def hexed(data: bytes) -> str:
    return data.hex()


def wire(words: list[bytes], reach: int = 0):
    """Byte strings made of random bytes and the protocol's own words, in any order; with
    `reach`, a word may also come repeated up to `reach` bytes' worth (so that a line or a
    head reaches the limits set on it, and goes past them)."""
    parts = st.one_of(st.binary(max_size=40), st.sampled_from(words))
    if reach:
        parts |= st.tuples(st.sampled_from(words), st.integers(0, reach)).map(
            lambda word_size: word_size[0] * (word_size[1] // len(word_size[0])))
    return st.lists(parts, max_size=30).map(b"".join)


# --- the PMI-1 wire ---------------------------------------------------------------------------

PMI_WORDS = [b"cmd=", b"init", b"pmi_version=1", b"pmi_subversion=1", b"put", b"get",
             b"barrier_in", b"finalize", b"abort", b"exitcode=", b"message=", b"key=",
             b"value=", b"kvsname=", b" ", b"\\", b"=", b"\n", b"\r", b"\x00", b"\xff"]
pmi_lines = wire(PMI_WORDS)


@FAST
@given(pmi_lines)
def test_any_pmi_line_parses_or_is_refused(line):
    from spawner.worlds import pmi1

    try:
        cmd, args = pmi1.parse(line)
    except pmi1.PmiError:
        return
    assert cmd and all(isinstance(k, str) for k in args)


@FAST
@given(st.lists(pmi_lines, max_size=12))
def test_a_pmi_server_survives_any_lines(lines):
    """What an instance writes to its PMI socket, straight into the server: it answers or
    drops the connection, and reports an abort's code as the number it was given."""
    from spawner.worlds import pmi1

    aborts, lost = [], []

    async def main():
        server = pmi1.PmiServer("poprun-fuzz-0", 1, on_abort=lambda *a: aborts.append(a),
                               on_lost=lambda *a: lost.append(a))
        ours = server.attach(0)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        writer.write(b"".join(line + b"\n" for line in lines))
        writer.write_eof()
        while await asyncio.wait_for(reader.read(65536), 10):
            pass
        writer.close()
        await server.close()

    asyncio.run(asyncio.wait_for(main(), 20))
    for rank, code, message in aborts:
        assert rank == 0 and isinstance(code, int) and isinstance(message, str)


# Several ranks, served by one server alone, or by the node-level servers of two hosts whose
# barriers go up to the world's root as one batch each (tests/pmi_root.py: the fence a host's
# FENCE_IN enters, without the wire between them, which the agent protocol's own fuzzing
# feeds). One rank is hostile: after its peers have put their keys it sends generated
# lines, lines up to and past PMI's 1 MiB, and puts until KEYS_PER_RANK x size is reached, then
# plays its part (init, put, barrier, finalize). The honest ranks must get each other's values
# exactly; a hostile line past 1 MiB drops its connection (reported lost: its peers then wait
# at the barrier, as for any rank that died); an abort among its lines is reported as its own.

HONEST_KEY = "honest-{}-c0ffee"  # never a name the generated lines can spell


@st.composite
def hostile_pmi(draw, flood: int):
    """What the hostile rank sends: generated lines (no barrier_in: a rank that enters more
    barriers than its peers waits for an epoch they never start, its job's own doing), put
    lines whose length is around PMI's line limit, and among them one flood of `flood` puts
    at most."""
    line_limit = 1 << 20
    item = st.one_of(
        wire(PMI_WORDS, reach=4096).filter(lambda line: b"barrier" not in line).map(
            lambda line: line.replace(b"\n", b" ") + b"\n"),
        st.sampled_from([line_limit - 1, line_limit, line_limit + 1]) | st.integers(
            0, 2 * line_limit).map(lambda size: ("line", size)))
    items = draw(st.lists(item, max_size=5))
    items.insert(draw(st.integers(0, len(items))),
                 ("puts", draw(st.just(flood) | st.integers(0, flood))))
    return items


def pmi_bytes(items, kvsname: str) -> tuple[bytes, bool]:
    """The hostile rank's bytes, and whether one of its lines is past PMI's line limit."""
    out, too_long = [], False
    for n, item in enumerate(items):
        if isinstance(item, int):
            item = ("line", item)
        if isinstance(item, bytes):
            out.append(item)
        elif item[0] == "line":
            head = b"cmd=put kvsname=%s key=long%d value=" % (kvsname.encode(), n)
            out.append(head + b"v" * max(0, item[1] - len(head)) + b"\n")
            too_long |= max(len(head), item[1]) > (1 << 20)
        else:
            out.append(b"".join(b"cmd=put kvsname=%s key=f%d.%d value=x\n"
                                % (kvsname.encode(), n, i) for i in range(item[1])))
    return b"".join(out), too_long


class PmiClient:
    """One rank's end of its PMI socket, speaking as MPICH does."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def on(cls, sock):
        return cls(*await asyncio.open_unix_connection(sock=sock))

    async def ask(self, line: str) -> dict:
        from spawner.worlds.pmi1 import parse

        self.writer.write(line.encode() + b"\n")
        reply = await self.reader.readline()
        assert reply.endswith(b"\n"), (line, reply)
        return parse(reply)[1]

    async def honest(self, rank: int, kvsname: str, ranks, ready: asyncio.Event,
                     go: asyncio.Event) -> None:
        assert (await self.ask("cmd=init pmi_version=1 pmi_subversion=1"))["rc"] == "0"
        put = await self.ask(f"cmd=put kvsname={kvsname} key={HONEST_KEY.format(rank)} "
                             f"value=v{rank}")
        assert put["rc"] == "0", put
        ready.set()
        await go.wait()
        assert (await self.ask("cmd=barrier_in"))["rc"] == "0"
        for other in ranks:
            got = await self.ask(f"cmd=get kvsname={kvsname} key={HONEST_KEY.format(other)}")
            assert got == {"rc": "0", "value": f"v{other}"}, (rank, other, got)
        assert (await self.ask("cmd=finalize"))["rc"] == "0"
        self.writer.close()

    async def hostile(self, rank: int, kvsname: str, data: bytes) -> None:
        self.writer.write(data + (f"cmd=init pmi_version=1 pmi_subversion=1\n"
                                  f"cmd=put kvsname={kvsname} key={HONEST_KEY.format(rank)} "
                                  f"value=v{rank}\ncmd=barrier_in\ncmd=finalize\n").encode())
        self.writer.write_eof()
        try:
            while await self.reader.read(1 << 16):  # its replies, until the server closes
                pass
        except ConnectionError:  # closed with what it sent unread: reset
            pass


@HEAVY
@given(st.integers(2, 4), st.data())
@pytest.mark.parametrize("mode", ["alone", "nodes"])
def test_pmi_ranks_get_their_values_whatever_one_rank_sends(mode, size, data):
    from pmi_root import RootUpstream
    from spawner.worlds.pmi1 import KEYS_PER_RANK, PmiServer, Root

    kvsname = "poprun-fuzz-7"
    hostile = data.draw(st.integers(0, size - 1), label="hostile rank")
    # Served here: every rank (alone) or rank 0, the others by another host's server.
    here = list(range(size)) if mode == "alone" else [0]
    keys_max = KEYS_PER_RANK * size
    # A flood reaches the world's bound where one server serves every rank; across hosts, it
    # stays within what the root can take as a host's batch beside rank 0's keys (a bound
    # with a test of its own, below: reaching it drops a whole host's ranks). The generated
    # lines' puts take a few keys more.
    flood = keys_max if mode == "alone" else keys_max - 40 * size
    items = data.draw(hostile_pmi(flood), label="hostile")
    sent, too_long = pmi_bytes(items, kvsname)
    aborts, lost = [], []

    async def main():
        root = None if mode == "alone" else Root(size, [0] + [1] * (size - 1))
        first = PmiServer(kvsname, size, local_ranks=here, on_abort=lambda *a: aborts.append(a),
                          on_lost=lambda *a: lost.append(a),
                          upstream=root and RootUpstream(root, 0))
        other = None if mode == "alone" else PmiServer(
            kvsname, size, local_ranks=range(1, size), upstream=RootUpstream(root, 1),
            on_abort=lambda *a: aborts.append(a), on_lost=lambda *a: lost.append(a))
        servers = [s for s in (first, other) if s is not None]
        clients = {rank: await PmiClient.on((first if rank in here else other).attach(rank))
                   for rank in range(size)}
        honest = [rank for rank in range(size) if rank != hostile]
        ready = {rank: asyncio.Event() for rank in honest}
        go, tasks = asyncio.Event(), []
        try:
            async with ticking():
                tasks = [asyncio.create_task(clients[r].honest(r, kvsname, honest, ready[r], go))
                         for r in honest]
                for put in ready.values():
                    await put.wait()
                go.set()
                await clients[hostile].hostile(hostile, kvsname, sent)
                if too_long:  # dropped at its long line: lost, its peers left waiting
                    assert [rank for rank, _ in lost] == [hostile], lost
                    assert not any(task.done() for task in tasks)
                else:
                    await asyncio.gather(*tasks)
                    assert not lost, lost
                assert all(rank == hostile for rank, _, _ in aborts), aborts
                for kvs in [s.kvs for s in servers] + ([root.kvs] if root else []):
                    assert len(kvs) <= keys_max
                    if len(kvs) == keys_max:
                        event("the world's keys all taken")
        finally:
            for server in servers:
                await server.close()
            for task in tasks:
                task.cancel()

    run(main())
    event(f"{'dropped' if too_long else 'served'}")


@HEAVY
@given(st.integers(0, 3), st.sampled_from([0, 1, -1]) | st.integers(-300, 300))
def test_a_hosts_barrier_batch_is_bounded_as_a_whole(before, past):
    """A host's barrier (FENCE_IN) carries every put of its instances since the last barrier:
    the world's bound (KEYS_PER_RANK x size) holds for the batch as a whole, as for the puts
    of one instance; a batch that would take the world past it is refused whole."""
    from spawner.worlds.fences import FenceId
    from spawner.worlds.pmi1 import KEYS_PER_RANK, Root

    size = 2
    keys_max = KEYS_PER_RANK * size
    root = Root(size, [0, 1])
    root.kvs.update({f"before{i}": "v" for i in range(before)})  # earlier barriers'
    batch = {f"b{i}": "v" for i in range(keys_max - before + past)}
    answers = []
    root.enter(FenceId((0, 1), 0), 0, batch, lambda *a: answers.append(a))
    if answers:  # refused at once
        assert answers[0][0] is None and "too_many_keys" in answers[0][1]
        assert before + len(batch) > keys_max  # refused only past the bound, and whole
        assert len(root.kvs) == before
    else:  # taken, waiting for the other host
        assert before + len(batch) <= keys_max
    assert len(root.kvs) <= keys_max


ABORTER = """
import os, socket, sys
s = socket.socket(fileno=int(os.environ["PMI_FD"]))
s.sendall(bytes.fromhex(sys.argv[1]))
s.shutdown(socket.SHUT_WR)
while s.recv(65536):
    pass
"""


@LAUNCHES
@given(st.lists(pmi_lines, max_size=20))
def test_a_launch_survives_any_pmi_lines(lines):
    """Without an abort among them, the job ends 0 (never spoke PMI, or finalized) or 1 (an
    MPI process that left without MPI_Finalize); never as poprun's own failure."""
    data = b"".join(line + b"\n" for line in lines if b"abort" not in line)
    proc, err = launch(2, ABORTER, hexed(data))
    assert proc.returncode in (0, 1), err[-3000:]


@LAUNCHES
@given(st.integers(min_value=-2**70, max_value=2**70), st.binary(max_size=200))
def test_an_abort_ends_the_job_with_its_low_8_bits(code, message):
    message = message.replace(b"\n", b" ")
    line = b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=abort exitcode=%d message=%s\n" % (
        code, message)
    proc, err = launch(2, ABORTER, hexed(line))
    assert proc.returncode == code & 0xFF, err[-3000:]
    if code & 0xFF:  # else a status of 0, as the MPI launchers give it: no failure to report
        assert f"MPI_Abort: exit code {code}" in err, err[-3000:]


# --- the rendezvous's HTTP --------------------------------------------------------------------

HTTP_WORDS = [b"GET", b"PUT", b"DELETE", b"POST", b" ", b"/", b"/global/0", b"HTTP/1.1",
              b"HTTP/1.0", b"\r\n", b"\r\n\r\n", b"Content-Length:", b"Transfer-Encoding:",
              b"-5", b"0", b"136", b"65537", b"99999999999999999999", b"abc", b"\xb2",
              b"\x00", b"\xff", b":"]
requests = wire(HTTP_WORDS)


@FAST
@given(requests)
def test_any_request_head_parses_or_is_a_4xx(head):
    from poprun.run.worlds.horovod import MAX_VALUE, BadRequest, parse_head

    try:
        method, scope, key, length = parse_head(head)
    except BadRequest as bad:
        assert 400 <= bad.status < 500
        return
    assert method and scope and key and 0 <= length <= MAX_VALUE


@FAST
@given(st.lists(st.tuples(st.sampled_from(["put", "delete"]), st.sampled_from(["global", "p"]),
                          st.sampled_from("0123"), st.binary(max_size=3000)), max_size=40))
def test_the_store_keeps_its_account_and_its_bound(operations):
    from poprun.run.worlds.horovod import Store, _cost

    store = Store({"global": 2}, limit=20_000)
    for op, scope, key, value in operations:
        if op == "put":
            store.put(scope, key, value)
        else:
            store.delete(scope, key)
        assert store.used == sum(_cost(s, k, v) for s, values in store.values.items()
                                 for k, v in values.items()) <= store.limit


@FAST
@given(st.lists(st.tuples(st.sampled_from(["global", "local_h"]),
                          st.sampled_from(["0", "1", "2", "00", "-1", " 1", "a", "k" * 64])),
                max_size=40))
def test_a_delete_counts_only_for_a_rank_of_its_scope(deletes):
    """Horovod's ranks each DELETE their own rank's key (its number) when done with a scope,
    and the last one empties it: a DELETE of any other name (from anyone who reaches the
    port) counts for nothing, and a rank's second counts once."""
    from poprun.run.worlds.horovod import Store

    sizes = {"global": 3, "local_h": 2}
    store, done = Store(sizes), {scope: set() for scope in sizes}
    for scope in sizes:
        store.put(scope, "0", b"address")
    for scope, key in deletes:
        store.delete(scope, key)
        if key in {str(rank) for rank in range(sizes[scope])}:
            done[scope].add(key)
        if len(done[scope]) == sizes[scope]:  # every rank is done: the scope is emptied
            done[scope].clear()
            store.put(scope, "0", b"address")  # the next hvd.init()'s
        assert store.get(scope, "0") == b"address", (scope, deletes)


CLIENT = """
import os, socket, sys
address = (os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
           int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]))
for request in sys.argv[1:]:
    s = socket.create_connection(address, timeout=30)
    try:
        s.sendall(bytes.fromhex(request))
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    reply = b""
    while part := s.recv(65536):
        reply += part
    status = reply.split(b" ")[1:2]
    assert not reply or status[0][:1] in (b"2", b"4"), reply[:200]
    s.close()
# the store still answers as Horovod expects
s = socket.create_connection(address, timeout=30)
s.sendall(b"PUT /fuzz/%d HTTP/1.1\\r\\nContent-Length: 3\\r\\n\\r\\nabc" % os.getpid())
assert s.recv(100).startswith(b"HTTP/1.1 200"), "PUT"
s = socket.create_connection(address, timeout=30)
s.sendall(b"GET /fuzz/%d HTTP/1.1\\r\\n\\r\\n" % os.getpid())
assert s.recv(100).endswith(b"\\r\\n\\r\\nabc"), "GET"
"""


@LAUNCHES
@given(st.lists(requests, min_size=1, max_size=20))
def test_a_launch_survives_any_requests_to_its_rendezvous(batch):
    """Every reply a 2xx or a 4xx (or none, for a request cut short), the store still
    serving, the job's status its instances'."""
    proc, err = launch(2, CLIENT, *map(hexed, batch))
    assert proc.returncode == 0, err[-3000:]


# The rendezvous's own server, in-process over real TCP, fed requests that reach its limits:
# heads around MAX_HEAD, bodies around MAX_VALUE, a store filled to its limit by many keys,
# DELETEs, and anything else a peer may send. The store's limit is made small (the same Store,
# bounded at STORE_LIMIT), so that a few hundred requests fill it.

STORE_LIMIT = 256 << 10
HONEST = {("global", "0"): b"rank 0's address", ("global", "1"): b"rank 1's address",
          ("set7", "0"): b"a process set's"}


def sizes_around(limit: int):
    """Sizes that sit at a limit, just under it, just past it, and anywhere up to twice it."""
    return st.sampled_from([0, 1, limit - 1, limit, limit + 1]) | st.integers(0, 2 * limit)


@st.composite
def http_requests(draw):
    """One request: a method, a path, headers (one padding header making the head
    `head_size` long), a Content-Length (none, several, any text) and a body that may be
    shorter or longer than it says."""
    from poprun.run.worlds.horovod import MAX_HEAD, MAX_VALUE

    method = draw(st.sampled_from([b"GET", b"PUT", b"DELETE", b"POST", b"get", b"PUT  "]))
    scope = draw(st.sampled_from([b"p", b"q", b"x" * 300, b"", b"a b", b"\xff", b"p/q"]))
    key = draw(st.sampled_from([b"k", b"kk", b"00", b"-1", b"key" * 100, b"\x00"]))
    size = draw(sizes_around(MAX_VALUE))
    lengths = draw(st.lists(st.sampled_from([b"%d" % size, b"%d" % (MAX_VALUE + 1), b"-1",
                                             b"99999999999999999999", b"\xb2", b" %d " % size]),
                            max_size=2))
    head = b"%s /%s/%s HTTP/1.1\r\n" % (method, scope, key) + b"".join(
        b"Content-Length: %s\r\n" % length for length in lengths)
    pad = draw(sizes_around(MAX_HEAD)) - len(head) - len(b"X-Pad: \r\n")
    head += b"X-Pad: %s\r\n" % (b"a" * max(0, pad)) if pad >= 0 else b""
    body = b"v" * draw(st.sampled_from([size, max(0, size - 1), size + 1, 0]))
    return head, body


async def ask(address, data: bytes) -> bytes:
    """Send one request (then EOF: a body cut short ends there) and read the whole reply;
    b"" when the server closed without one (or reset: it closes what it will not read)."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionError:
        return b""
    finally:
        writer.close()


def expected(head: bytes, body: bytes, store) -> set[int | None]:
    """The statuses the server may answer `head` + `body` with (None: no reply), from the
    pure parser and the store's state: the server's part is to apply them, bounded."""
    from poprun.run.worlds.horovod import MAX_HEAD, BadRequest, _cost, parse_head

    if len(head) > MAX_HEAD:  # refused before it is parsed: 400, unless reset first
        return {400, None}
    try:
        method, scope, key, length = parse_head(head)
    except BadRequest as bad:
        return {bad.status, None}
    if len(body) < length:
        return {None}  # cut short: nothing to answer
    if method == "GET":
        return {200 if store.get(scope, key) is not None else 404}
    if method == "DELETE":
        return {200}
    if method == "PUT":  # 413 only once the store would be past its limit
        old = store.get(scope, key)
        grown = _cost(scope, key, body[:length]) - (0 if old is None else _cost(scope, key, old))
        return {200 if store.used + grown <= store.limit else 413}
    return {405}


async def put_new(address, key: int, slots: asyncio.Semaphore) -> bytes:
    async with slots:  # the server's 128 at once, and its backlog's, are not the point here
        return await ask(address, b"PUT /flood/%d HTTP/1.1\r\nContent-Length: 1024\r\n\r\n"
                         % key + b"f" * 1024)


def status_of(reply: bytes) -> int | None:
    return int(reply.split(b" ", 2)[1]) if reply else None


@HEAVY
@given(st.lists(st.one_of(http_requests(), st.integers(1, 400)), min_size=1, max_size=12))
def test_the_rendezvous_holds_its_limits_and_its_store(batch):
    """Every request gets the status its head and the store's state call for (or none, when
    cut short or refused before it was read); an integer in the batch is a flood of that many
    1 KiB values under new keys, sent at once. Throughout, the loop keeps ticking, the store's
    account is what it holds and never past its limit, what honest ranks put is still there,
    and a request of Horovod's is answered as before."""
    from poprun.run.worlds.horovod import Rendezvous, Store, _cost

    async def main():
        loop = asyncio.get_running_loop()
        server = Rendezvous("127.0.0.1", loop)
        server.store = Store({"global": 2}, limit=STORE_LIMIT)
        for (scope, key), value in HONEST.items():
            server.store.put(scope, key, value)
        flooded, slots = 0, asyncio.Semaphore(64)
        try:
            async with ticking():
                for item in batch:
                    if isinstance(item, int):
                        replies = await asyncio.gather(*(put_new(server.address, flooded + i, slots)
                                                         for i in range(item)))
                        flooded += item
                        assert {status_of(r) for r in replies} <= {200, 413}
                        event(f"flood: {'full' if 413 in map(status_of, replies) else 'room'}")
                        continue
                    head, body = item
                    allowed = expected(head[:-2] if head.endswith(b"\r\n") else head, body,
                                       server.store)
                    status = status_of(await ask(server.address, head + b"\r\n" + body))
                    assert status in allowed, (status, allowed)
                    event(f"status {status}")
                store = server.store
                assert store.used == sum(_cost(s, k, v) for s, values in store.values.items()
                                         for k, v in values.items()) <= STORE_LIMIT
                for (scope, key), value in HONEST.items():
                    assert await ask(server.address, b"GET /%s/%s HTTP/1.1\r\n\r\n" % (
                        scope.encode(), key.encode())) == (
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n"
                        b"\r\n%s" % (len(value), value))
                assert not server._served or all(t.done() for t in server._served)
        finally:
            await server.close()

    run(main())


# --- popdist's progress and error files --------------------------------------------------------

def leave(path: str, kind: str, content: bytes, size: int) -> None:
    """What an instance may leave where poprun reads: `kind` of file; for a regular one,
    `content` grown with zeros to `size` bytes (sparse: nothing written past it)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        os.symlink("/dev/zero", path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "file":
        with open(path, "wb") as f:
            f.write(content)
            f.truncate(max(size, len(content)))


FILES = inspect.getsource(leave) + """
import os, sys, time
kind, content, code = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
for name in ("POPDIST_PROGRESS_FILE", "POPDIST_ERROR_FILE"):
    path = os.environ[name]
    if os.path.lexists(path):
        os.remove(path)
    if kind == "sparse":
        leave(path, "file", b"", 1 << 40)
    else:
        leave(path, kind, content, 0)
time.sleep(1.5)  # the progress watch samples once a second
sys.exit(code)
"""
error_json = st.dictionaries(
    st.sampled_from(["type", "module", "message", "file", "line", "function", "traceback",
                     "time", "pid", "other"]),
    st.one_of(st.text(max_size=50), st.integers(), st.floats(), st.none(), st.booleans(),
              st.lists(st.integers(), max_size=3)),
    max_size=10).map(lambda d: json.dumps(d).encode())


@FAST
@given(st.one_of(st.binary(max_size=300), error_json,
                 st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth)))
def test_an_error_file_parses_to_bounded_text_or_nothing(data):
    from popdist.errorfile import parse

    error = parse(data)
    if error is not None:
        for value in error.values():
            assert isinstance(value, (str, int, float)) and not isinstance(value, bool)
            if isinstance(value, str):
                value.encode("utf-8")  # never a surrogate left to fail the report


@LAUNCHES
@given(st.sampled_from(["file", "fifo", "link", "dir", "sparse"]),
       st.one_of(st.binary(max_size=64), error_json), st.integers(0, 9))
def test_a_launch_survives_any_progress_and_error_files(kind, content, code):
    proc, err = launch(2, FILES, kind, hexed(content), str(code), timeout=40)
    assert proc.returncode == code, err[-3000:]


# The launcher's (and an agent's) readers of popdist's files, in-process, fed files of every
# kind an instance can leave at those paths, with contents at and past what is read of them:
# the progress file (16 bytes), the error file (MAX_ERROR_FILE), the stacks dump (MAX_DUMP).

faulthandler_lines = st.sampled_from([
    b"Thread 0x00007f1e6756f6c0 (most recent call first):",
    b"Current thread 0x1 (most recent call first):", b'  File "/x.py", line 6 in worker',
    b'  File "/x.py", line 99999999999999999999999 in f', b'  File "<string>", line 1 in <m>',
    b'  File "' + b"d/" * 300 + b'x.py", line 0 in ' + b"f" * 300, b"  ...", b"...",
    b"  <no Python frame>", b"\xff\xfe", b"", b"Thread 0xzz (most recent call first):"])
dump_text = st.lists(faulthandler_lines, max_size=40).map(b"\n".join)
progress_bytes = st.builds(lambda step, total: struct.pack("<qq", step, total),
                           st.integers(-2**63, 2**63 - 1), st.sampled_from([-1, 0, 2**63 - 1]))


@settings(HEAVY, max_examples=120)
@given(st.sampled_from(["file", "file", "file", "fifo", "link", "dir", "absent"]),
       st.one_of(st.binary(max_size=40), error_json, progress_bytes, dump_text),
       st.sampled_from([0, 16, 17, 256 << 10, (256 << 10) + 1, 4 << 20, (4 << 20) + 1, 1 << 40]))
def test_the_launcher_reads_popdists_files_as_an_instance_left_them(kind, content, size):
    """The progress, error and stacks files are read without blocking the loop whatever is
    there; what comes of them is the content's own meaning where it is a regular file small
    enough to be one (the stacks dump cut at MAX_DUMP), and nothing otherwise."""
    import tempfile

    from popdist._progress import unpack
    from popdist.errorfile import parse
    from poprun.jobctl.stacks import fold, render
    from spawner.local import MAX_ERROR_FILE, LocalSpawner
    from spawner.stackdump import MAX_DUMP
    from spawner.stackparse import parse_faulthandler, with_source
    from spawner.untrusted import read_regular

    async def main():
        with tempfile.TemporaryDirectory() as tmp:
            spawner = LocalSpawner(None, asyncio.get_running_loop(), cgroups=False)
            spawner._error_dir = tmp
            for name in ("0.progress", "0.json", "0.stacks"):
                leave(os.path.join(tmp, name), kind, content, size)
            regular, length = kind == "file", max(size, len(content))

            def first(count: int) -> bytes:
                """The regular file's first `count` bytes (zeros after `content`)."""
                return content[:count] + bytes(min(count, length) - len(content[:count]))

            async with ticking():
                progress = spawner.progress(0)
                spawner._read_error(0)
                dump = read_regular(os.path.join(tmp, "0.stacks"), MAX_DUMP, cut=True)
            assert progress == (unpack(first(17)) if regular else None)
            if progress is not None:
                assert all(-2**63 <= v < 2**63 for v in progress if v is not None)
            error = parse(first(length)) if regular and length <= MAX_ERROR_FILE else None
            assert spawner.errors.get(0) == error
            assert dump == (first(MAX_DUMP) if regular else None)
            threads = with_source(parse_faulthandler((dump or b"").decode("utf-8", "replace")))
            text = render(fold({0: {"pid": 1, "how": "popdist", "threads": threads,
                                    "error": None if threads else "empty"}}))
            assert text.startswith("instances [0]") and len(text) < 8 * MAX_DUMP
            event(f"{kind}: {'progress' if progress else ''} {'error' if error else ''} "
                  f"{'stacks' if threads else ''}")

    run(main())


# --- output bytes and --progress-pattern -------------------------------------------------------

OUTPUT = """
import os, sys
os.write(1, bytes.fromhex(sys.argv[1]))
os.write(2, bytes.fromhex(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""
output_bytes = st.lists(st.one_of(st.binary(max_size=200), st.sampled_from(
    [b"\n", b"\r", b"\x1b[2J", b"\x1b]0;title\x07", b"\xff\xfe", b"\xc2\x85", b"step 10/20\n",
     b"step 99999999999999999999999999/1\n", b"\x00"])), max_size=20).map(b"".join)


@LAUNCHES
@given(output_bytes, st.integers(0, 9))
def test_a_launch_passes_any_output_bytes_and_reports_them(data, code):
    """The bytes come through exactly, the report of a failure shows them (escaped), and
    the status is the instance's."""
    proc, err = launch(1, OUTPUT, hexed(data), str(code),
                       options=(r"--progress-pattern=step (\d+)/(\d+)",))
    assert proc.returncode == code, err[-3000:]
    assert proc.stdout == data


MAX_STEP = 2 ** 63 - 1  # what the tracker holds (poprun/progress.py)
steps = st.sampled_from([0, 1, 7, MAX_STEP, MAX_STEP + 1, 10 ** 30]) | st.integers(0, 2 ** 64)
step_lines = st.builds(lambda step, total, sep: b"step %d/%d%s" % (step, total, sep), steps,
                       steps, st.sampled_from([b"\n", b"\r", b" of 3\n", b"x"]))


def last_step(pattern, blocks: list[bytes]) -> tuple[int, int | None] | None:
    """What --progress-pattern makes of an instance's blocks, as the guide says: each block's
    last match gives the step (and total), unless its groups are no numbers or beyond what
    the tracker holds; the last block that gives one wins."""
    found = None
    for data in blocks:
        matches = list(pattern.finditer(data))
        if not matches:
            continue
        try:
            step = int(matches[-1].group(1))
            total = int(matches[-1].group(2)) if pattern.groups == 2 else None
        except ValueError:
            continue
        if step <= MAX_STEP and (total is None or total <= MAX_STEP):
            found = (step, total)
    return found


@FAST
@given(st.lists(st.lists(st.one_of(output_bytes, step_lines), max_size=4).map(b"".join),
                max_size=6),
       st.sampled_from([rb"step (\d+)/(\d+)", rb"(\d+)", rb"(\d*)x(\d*)", rb"([0-9]+)\s+of"]))
def test_the_progress_pattern_takes_any_output(blocks, pattern):
    """Whatever the instances print, the watch's last report shows each instance at the step
    (and total) its last block with a match gave, and at none when none did (numbers
    beyond what the tracker holds are left out)."""
    import re

    from poprun.jobctl.progress import PatternWatch

    pattern = re.compile(pattern)

    async def main():
        reports = []
        watch = PatternWatch(asyncio.get_running_loop(), 2, hold=1.0, local=lambda keys=None: {},
                             report=reports.append, pattern=pattern)
        for key in (0, 1):
            watch.started(key, "h", 1, 0.0, local=True, start_ticks=None)
        for i, data in enumerate(blocks):
            watch.output(i % 2, None, data, float(i), data.count(b"\n"))
        watch.close()
        report = reports[-1]
        assert report.source == "pattern" and set(report.instances) == {0, 1}
        for key in (0, 1):
            shown = report.instances[key]
            want = last_step(pattern, blocks[key::2])
            assert (shown["step"], shown["total"]) == (want or (None, None)), (key, shown)
            event("a step shown" if want else "no step")

    run(main())


@FAST
@given(st.binary(max_size=200), st.text(max_size=50))
def test_the_report_shows_any_instance_text(tail, message):
    """A failure report of any stderr tail and any error text, plain and styled as on a
    terminal, is bytes (nothing an instance wrote can fail its encoding)."""
    from poprun.result import InstanceResult, LaunchResult
    from poprun.view.render import render_report

    inst = InstanceResult(0, "localhost", 1, 3, 0.0, 1.0, 1, stderr_tail=(tail,),
                          error={"type": message, "message": message + "\udcff\ud800"})
    result = LaunchResult(instances=(inst,), exit_code=3, root_cause=0)
    for environ in ({}, {"FORCE_COLOR": "1", "TERM": "xterm-256color",
                         "TTY_COMPATIBLE": "1"}):
        assert isinstance(render_report(result, 2, environ), bytes)
