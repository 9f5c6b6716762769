"""Fuzzing every surface an instance or a neighbour reaches (Hypothesis): the PMI-1 wire, the
Horovod rendezvous's HTTP, popdist's progress and error files, the output bytes and
`--progress-pattern`. Each surface has a fast property over the code that parses it, many
examples, and a few real launches fed generated input, where poprun must end as the instances'
own doing says (never 70, the internal error; never a signal it did not get), within its
timeout (never hung), with its peak memory bounded. Every test is bounded in time: a fixed
number of examples, each with its own timeout. (The PMIx server has its own.)"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import OFFLINE, run_poprun_peak

pytestmark = pytest.mark.timeout(300)

FAST = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])
# A launch takes seconds: a few examples, and no shrinking (a failure's example is shown as
# generated), so that a failing run is as bounded as a passing one.
LAUNCHES = settings(max_examples=4, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))
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


def wire(words: list[bytes]):
    """Byte strings made of random bytes and the protocol's own words, in any order."""
    return st.lists(st.one_of(st.binary(max_size=40), st.sampled_from(words)),
                    max_size=30).map(b"".join)


# --- the PMI-1 wire ---------------------------------------------------------------------------

PMI_WORDS = [b"cmd=", b"init", b"pmi_version=1", b"pmi_subversion=1", b"put", b"get",
             b"barrier_in", b"finalize", b"abort", b"exitcode=", b"message=", b"key=",
             b"value=", b"kvsname=", b" ", b"\\", b"=", b"\n", b"\r", b"\x00", b"\xff"]
pmi_lines = wire(PMI_WORDS)


@FAST
@given(pmi_lines)
def test_any_pmi_line_parses_or_is_refused(line):
    from spawner import pmi

    try:
        cmd, args = pmi.parse(line)
    except pmi.PmiError:
        return
    assert cmd and all(isinstance(k, str) for k in args)


@FAST
@given(st.lists(pmi_lines, max_size=12))
def test_a_pmi_server_survives_any_lines(lines):
    """What an instance writes to its PMI socket, straight into the server: it answers or
    drops the connection, and reports an abort's code as the number it was given."""
    from spawner import pmi

    aborts, lost = [], []

    async def main():
        server = pmi.PmiServer("poprun-fuzz-0", 1, on_abort=lambda *a: aborts.append(a),
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
    from poprun.run.rendezvous import MAX_VALUE, BadRequest, parse_head

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
    from poprun.run.rendezvous import Store, _cost

    store = Store({"global": 2}, limit=20_000)
    for op, scope, key, value in operations:
        if op == "put":
            store.put(scope, key, value)
        else:
            store.delete(scope, key)
        assert store.used == sum(_cost(s, k, v) for s, values in store.values.items()
                                 for k, v in values.items()) <= store.limit


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


# --- popdist's progress and error files --------------------------------------------------------

FILES = """
import os, sys
kind, content, code = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
for name in ("POPDIST_PROGRESS_FILE", "POPDIST_ERROR_FILE"):
    path = os.environ[name]
    if os.path.lexists(path):
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        os.symlink("/dev/zero", path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    else:
        with open(path, "wb") as f:
            f.write(content)
import time
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


@FAST
@given(st.lists(output_bytes, max_size=5),
       st.sampled_from([rb"step (\d+)/(\d+)", rb"(\d+)", rb"(\d*)x(\d*)", rb"([0-9]+)\s+of"]))
def test_the_progress_pattern_takes_any_output(blocks, pattern):
    """Whatever the instances print, the watch reports (numbers beyond what the tracker
    holds are left out)."""
    import re

    from poprun.jobctl.progress import PatternWatch

    async def main():
        reports = []
        watch = PatternWatch(asyncio.get_running_loop(), 2, hold=1.0, local=lambda keys=None: {},
                             report=reports.append, pattern=re.compile(pattern))
        for key in (0, 1):
            watch.started(key, "h", 1, 0.0, local=True, start_ticks=None)
        for i, data in enumerate(blocks):
            watch.output(i % 2, None, data, float(i), data.count(b"\n"))
        watch.close()
        assert reports and all(r is not None for r in reports)

    asyncio.run(asyncio.wait_for(main(), 20))


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
