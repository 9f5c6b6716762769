"""End-to-end tests of normal runs: the real `poprun` starting real instances.

What instances see (docs/architecture.md, "The environment contract"), how their output reaches
the user ("Runtime guarantees": mpirun's tags, lines are atomic, `\\r`, invalid UTF-8 and huge
lines pass through), and that arguments arrive byte-for-byte (also "Runtime guarantees").
Every wait is bounded: subprocess timeouts, or deadline loops polling a real event.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import poprun_argv, poprun_env

# The real interpreter, not a pyenv shim (docs/architecture.md, "Measured reasons").
PY = sys.executable
TIMEOUT = 60  # far above anything here takes (each run is well under a few seconds)
OFF = "--offline-mode=yes"
# Variables that would change the cache mode or the contract under test if the outer
# environment happened to set them.
_FOREIGN = ("POPTORCH_CACHE_DIR", "POPART_CACHE_DIR", "TF_POPLAR_FLAGS", "IPUOF_CONFIG_PATH")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = poprun_env()
    for name in _FOREIGN:
        env.pop(name, None)
    env.update(extra or {})
    return env


def run(*args: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT,
        cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(poprun_argv(*args), env=clean_env(env), cwd=cwd,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout)


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def instance_lines(out: bytes, prefix: bytes = b"") -> list[bytes]:
    """Lines that instances wrote (poprun's own log lines start with a time, not `prefix`)."""
    return [line for line in out.splitlines() if line.startswith(prefix)]


# --- the guide's validation command ------------------------------------------------------


def test_hello_world_twice() -> None:
    proc = run("--num-instances", "2", "--num-replicas", "2", "--offline-mode=1",
               "echo", "Hello world!")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"Hello world!\nHello world!\n"


# --- the environment contract --------------------------------------------------------------

ENV_DUMP = r"""
import json, os, stat, sys
import popdist
cache = os.environ.get("POPDIST_EXECUTABLE_CACHE_PATH")
st = os.stat(cache) if cache and os.path.isdir(cache) else None
print(json.dumps({
    "rank": os.environ["RANK"],
    "env": dict(os.environ),
    "cache_is_dir": st is not None,
    "cache_mode": stat.S_IMODE(st.st_mode) if st else None,
    "popdist": {
        "set": popdist.isPopdistEnvSet(),
        "instance": popdist.getInstanceIndex(),
        "instances": popdist.getNumInstances(),
        "local_replicas": popdist.getNumLocalReplicas(),
        "total_replicas": popdist.getNumTotalReplicas(),
        "offset": popdist.getReplicaIndexOffset(),
        "local_instance": popdist.getLocalInstanceIndex(),
    },
}), flush=True)
"""


def test_instance_environment(tmp_path: Path) -> None:
    dump = script(tmp_path, "dump.py", ENV_DUMP)
    proc = run("--num-instances", "4", "--num-replicas", "8", "--ipus-per-replica", "2", OFF,
               "-x", "A=1", "-x", "B", "--env", "C=x y=z",
               PY, dump,
               env={"IPUOF_CONFIG_PATH": "/etc/ipuof.conf", "B": "from poprun's env"})
    assert proc.returncode == 0, proc.stderr
    records = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        records[int(record["rank"])] = record
    assert sorted(records) == [0, 1, 2, 3]

    ports = {r["env"]["MASTER_PORT"] for r in records.values()}
    caches = {r["env"]["POPDIST_EXECUTABLE_CACHE_PATH"] for r in records.values()}
    assert len(ports) == 1 and len(caches) == 1  # one per job (and per host)
    for rank, r in records.items():
        env = r["env"]
        assert {k: env.get(k) for k in (
            "POPDIST_NUM_TOTAL_REPLICAS", "POPDIST_NUM_IPUS_PER_REPLICA",
            "POPDIST_NUM_LOCAL_REPLICAS", "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE",
            "POPDIST_REPLICA_INDEX_OFFSET", "POPDIST_LOCAL_INSTANCE_INDEX",
            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "A", "B", "C")} == {
            "POPDIST_NUM_TOTAL_REPLICAS": "8", "POPDIST_NUM_IPUS_PER_REPLICA": "2",
            "POPDIST_NUM_LOCAL_REPLICAS": "2", "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
            "POPDIST_REPLICA_INDEX_OFFSET": str(2 * rank),
            "POPDIST_LOCAL_INSTANCE_INDEX": str(rank),
            "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
            "A": "1", "B": "from poprun's env", "C": "x y=z"}
        assert "IPUOF_CONFIG_PATH" not in env
        assert not env.get("POPDIST_AUTOREPORT_DIRECTORY")
        # The temporary cache: a private directory that exists while the instances run.
        assert r["cache_is_dir"] and r["cache_mode"] == 0o700
        assert r["popdist"] == {
            "set": True, "instance": rank, "instances": 4, "local_replicas": 2,
            "total_replicas": 8, "offset": 2 * rank, "local_instance": rank}

    (cache,) = caches
    assert os.path.isabs(cache)
    assert not os.path.exists(cache), "the temporary cache dir outlived the run"
    (port,) = ports
    port = int(port)
    assert 1024 <= port < 65536
    with socket.socket() as sock:  # nobody took the port: it is still free to bind
        sock.bind(("127.0.0.1", port))


def test_explicit_cache_path_is_kept(tmp_path: Path) -> None:
    dump = script(tmp_path, "dump.py", ENV_DUMP)
    cache = tmp_path / "cache" / "sub"
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF,
               f"--executable-cache-path={cache}", PY, dump)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["env"]["POPDIST_EXECUTABLE_CACHE_PATH"] for r in records] == [str(cache)] * 2
    assert all(r["cache_is_dir"] for r in records)
    assert cache.is_dir()  # an explicit cache is the user's: created, and kept


# --- arguments ---------------------------------------------------------------------------


def test_arguments_arrive_byte_for_byte() -> None:
    tricky = ["a b", "$HOME", ";rm -rf x", '"q"', "ü", "'", "`id`", "--help", "", "*", "\\n"]
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF,
               PY, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", *tricky)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert json.loads(line) == tricky


# --- output ------------------------------------------------------------------------------

NUMBERED = r"""
import itertools, os, sys
i = os.environ["RANK"]
data = "".join(f"{i} {n}\n" for n in range(100000)).encode()
# Raw writes of odd sizes cut lines anywhere (Python's own buffering would cut them only
# between lines), so poprun's reads end mid-line all the time.
sizes, at = itertools.cycle((4093, 1, 17, 65521, 3)), 0
while at < len(data):
    size = next(sizes)
    os.write(1, data[at:at + size])
    at += size
sys.stderr.write(f"err {i}\n")
"""


def test_tagged_output_lines_are_atomic(tmp_path: Path) -> None:
    prog = script(tmp_path, "numbered.py", NUMBERED)
    proc = run("--num-instances", "8", "--num-replicas", "8", OFF, "--tag-output", PY, prog)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.endswith(b"\n")
    lines = proc.stdout[:-1].split(b"\n")
    assert len(lines) == 800_000
    by_tag: dict[bytes, list[bytes]] = defaultdict(list)
    for line in lines:
        by_tag[line[:14]].append(line)  # b"[1,i]<stdout>:" is 14 bytes for one-digit i
    assert sorted(by_tag) == [b"[1,%d]<stdout>:" % i for i in range(8)]
    for i in range(8):
        # every line exactly once, whole, in the instance's order, with the matching tag
        assert by_tag[b"[1,%d]<stdout>:" % i] == [
            b"[1,%d]<stdout>:%d %d" % (i, i, n) for n in range(100000)]
    assert sorted(instance_lines(proc.stderr, b"[1,")) == [
        b"[1,%d]<stderr>:err %d" % (i, i) for i in range(8)]


PIPE_SIZES = r"""
import fcntl, os, sys, time
i = os.environ["RANK"]
print(i, fcntl.fcntl(1, fcntl.F_GETPIPE_SZ), fcntl.fcntl(2, fcntl.F_GETPIPE_SZ), flush=True)
if len(sys.argv) > 1:  # a directory: hold the pipes until every instance has its own
    open(os.path.join(sys.argv[1], i), "w").close()
    deadline = time.monotonic() + 30
    while len(os.listdir(sys.argv[1])) < int(os.environ["WORLD_SIZE"]):
        assert time.monotonic() < deadline, "not every instance started"
        time.sleep(0.01)
"""


def test_instance_pipes_are_grown_within_a_budget(tmp_path: Path) -> None:
    """Each instance's pipes are grown to PIPE_SIZE (fewer wake-ups and reads per byte)
    until the growth reaches PIPE_GROWTH_BUDGET; the pipes after that keep the default."""
    from spawner.local import DEFAULT_PIPE_SIZE, PIPE_GROWTH_BUDGET, PIPE_SIZE

    if os.geteuid() != 0 and int(Path("/proc/sys/fs/pipe-max-size").read_text()) < PIPE_SIZE:
        # no switch: a kernel setting (fs.pipe-max-size)
        pytest.skip("fs.pipe-max-size is below PIPE_SIZE for this unprivileged user")
    n = PIPE_GROWTH_BUDGET // (PIPE_SIZE - DEFAULT_PIPE_SIZE) // 2 + 2  # more than it covers
    prog = script(tmp_path, "sizes.py", PIPE_SIZES)
    started = tmp_path / "started"
    started.mkdir()
    proc = run("--num-instances", str(n), "--num-replicas", str(n), OFF, PY, prog, str(started))
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = [int(size) for line in proc.stdout.splitlines() for size in line.split()[1:]]
    assert len(sizes) == 2 * n
    assert set(sizes) == {PIPE_SIZE, DEFAULT_PIPE_SIZE}, sizes
    grown = sum(size - DEFAULT_PIPE_SIZE for size in sizes)
    assert PIPE_GROWTH_BUDGET - PIPE_SIZE < grown <= PIPE_GROWTH_BUDGET


REFUSED = r"""
import asyncio, os, sys
from spawner import local

# Above fs.pipe-max-size, which only CAP_SYS_RESOURCE may pass: the kernel refuses (EPERM).
local.PIPE_SIZE = 2 * int(open("/proc/sys/fs/pipe-max-size").read())


class Sink:
    def __init__(self, done):
        self.done, self.out = done, []

    def on_output(self, key, stream, data):
        self.out.append(data)

    def on_exit(self, key, returncode):
        self.done.set_result(returncode)


async def main():
    loop = asyncio.get_running_loop()
    sink = Sink(loop.create_future())
    spawner = local.LocalSpawner(sink, loop, cgroups=False)
    spawner.spawn(local.ProcessSpec(0, (sys.executable, "-c", sys.argv[1]),
                                    {**os.environ, "RANK": "0"}))
    returncode = await asyncio.wait_for(sink.done, 30)
    spawner.close()
    print(returncode, b"".join(sink.out).decode(), end="")

asyncio.run(main())
"""


def test_a_pipe_the_kernel_will_not_grow_keeps_its_size(tmp_path: Path) -> None:
    """Without CAP_SYS_RESOURCE (an unprivileged user; here root without it), a pipe above
    fs.pipe-max-size is refused: the instance runs with the default pipe, output intact."""
    from spawner.local import DEFAULT_PIPE_SIZE

    prog = script(tmp_path, "refused.py", REFUSED)
    proc = subprocess.run(["setpriv", "--bounding-set", "-sys_resource,-sys_admin", PY, prog,
                           PIPE_SIZES], env=clean_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == b"0 0 %d %d\n" % (DEFAULT_PIPE_SIZE, DEFAULT_PIPE_SIZE)


TWO_STREAMS = r"""
import os, sys
i = os.environ["RANK"]
print(f"out {i}", flush=True)
print(f"err {i}", file=sys.stderr, flush=True)
"""


def test_stderr_is_tagged(tmp_path: Path) -> None:
    prog = script(tmp_path, "two.py", TWO_STREAMS)
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, "--tag-output", PY, prog)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [b"[1,0]<stdout>:out 0", b"[1,1]<stdout>:out 1"]
    assert sorted(instance_lines(proc.stderr, b"[1,")) == [
        b"[1,0]<stderr>:err 0", b"[1,1]<stderr>:err 1"]


def test_mpi_args_spelling(tmp_path: Path) -> None:
    prog = script(tmp_path, "two.py", TWO_STREAMS + "print('C=' + os.environ['C'])\n")
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF,
               "--mpi-global-args=--tag-output", "--mpi-global-args", "-x C=3", PY, prog)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        b"[1,0]<stdout>:C=3", b"[1,0]<stdout>:out 0", b"[1,1]<stdout>:C=3",
        b"[1,1]<stdout>:out 1"]
    assert sorted(instance_lines(proc.stderr, b"[1,")) == [
        b"[1,0]<stderr>:err 0", b"[1,1]<stderr>:err 1"]


# C's ctime() without its newline: `Sun Nov  2 16:37:53 2026`
_CTIME = rb"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"


def test_timestamp_output(tmp_path: Path) -> None:
    prog = script(tmp_path, "two.py", TWO_STREAMS)
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, "--timestamp-output",
               "--tag-output", PY, prog)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:  # Open MPI's: <date>[1,0]<stdout>:line
        assert re.fullmatch(_CTIME + rb"\[1,(\d)\]<stdout>:out \1", line), line
    # without tags, as Open MPI prints it (the date was once glued to the line)
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, "--timestamp-output",
               PY, prog)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:  # <date><stdout>:line
        assert re.fullmatch(_CTIME + rb"<stdout>:out \d", line), line
    errors = [line for line in proc.stderr.splitlines() if b"<stderr>:" in line]
    assert len(errors) == 2, proc.stderr
    assert all(re.fullmatch(_CTIME + rb"<stderr>:err \d", line) for line in errors), errors


def test_only_output_from_instance(tmp_path: Path) -> None:
    prog = script(tmp_path, "two.py", TWO_STREAMS)
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF,
               "--only-output-from-instance=1", PY, prog)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"out 1\n"
    assert b"err 1\n" in proc.stderr and b"err 0" not in proc.stderr


EXACT_BYTES = r"""
import os, sys
i = os.environ["RANK"].encode()
sys.stdout.buffer.write(b"line " + i + b"\n\xff\xfe not utf-8 \xc3\x28\n10%\r50%\r100%\nno end " + i)
sys.stdout.flush()
sys.stderr.buffer.write(b"e " + i + b"\r\n\xe2\x82 half\nlast " + i)
"""


def test_output_filename_has_exact_bytes(tmp_path: Path) -> None:
    prog = script(tmp_path, "exact.py", EXACT_BYTES)
    out_dir = tmp_path / "logs"
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF,
               "--output-filename", str(out_dir), "--tag-output", PY, prog)
    assert proc.returncode == 0, proc.stderr
    for i in (0, 1):
        folder = out_dir / "1" / f"rank.{i}"
        assert (folder / "stdout").read_bytes() == (
            b"line %d\n\xff\xfe not utf-8 \xc3\x28\n10%%\r50%%\r100%%\nno end %d" % (i, i))
        assert (folder / "stderr").read_bytes() == b"e %d\r\n\xe2\x82 half\nlast %d" % (i, i)
    assert b"[1,0]<stdout>:line 0\n" in proc.stdout  # and a copy on the console
    assert b"[1,1]<stderr>:e 1" in proc.stderr


def test_merge_stderr_to_stdout(tmp_path: Path) -> None:
    prog = script(tmp_path, "interleave.py", r"""
import os, sys
i = os.environ["RANK"]
for k in range(3):
    print(f"out {i} {k}", flush=True)
    print(f"err {i} {k}", file=sys.stderr, flush=True)
""")
    for spelling in (("--merge-stderr-to-stdout",),
                     ("--mpi-global-args=--merge-stderr-to-stdout",)):
        proc = run("--num-instances", "2", "--num-replicas", "2", OFF, *spelling, PY, prog)
        assert proc.returncode == 0, proc.stderr
        for i in (0, 1):  # one pipe per instance: its own order is kept
            mine = [line for line in proc.stdout.splitlines() if line.split()[1] == b"%d" % i]
            assert mine == [b"%s %d %d" % (s, i, k) for k in range(3) for s in (b"out", b"err")]
        assert b"err 0" not in proc.stderr and b"err 1" not in proc.stderr


def test_invalid_utf8_passes_through(tmp_path: Path) -> None:
    payload = b"\xff\xfe\xfd bad \xc3\x28 \xed\xa0\x80 end\n"
    prog = script(tmp_path, "bad.py", f"""
import os, sys
if os.environ["RANK"] == "0":
    sys.stdout.buffer.write({payload!r})
    sys.stderr.buffer.write({payload!r})
""")
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, PY, prog)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == payload
    assert payload in proc.stderr
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, "--tag-output", PY, prog)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"[1,0]<stdout>:" + payload
    assert b"[1,0]<stderr>:" + payload in proc.stderr


def read_until(fd: int, marker: bytes, deadline: float) -> bytes:
    """Read from `fd` until `marker` has arrived; fails at `deadline` (time.monotonic)."""
    got = b""
    while marker not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {marker!r}; got {got!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"EOF before {marker!r}; got {got!r}"
            got += chunk
    return got


PROGRESS = r"""
import os, sys, time
if os.environ["RANK"] == "0":
    go = sys.argv[1]
    sys.stdout.write("step 1/3\rstep 2/3\r")
    sys.stdout.flush()
    deadline = time.monotonic() + 30
    while not os.path.exists(go):  # the test creates it once it has seen the update
        if time.monotonic() > deadline:
            sys.exit("the progress update was not seen in time")
        time.sleep(0.01)
    sys.stdout.write("step 3/3\rdone\n")
"""


def run_in_two_steps(go: Path, first: bytes, *args: str) -> bytes:
    """Two instances of `args` + `go`: once `first` has reached poprun's stdout, create `go`
    (which lets the program finish); all of stdout, after a successful exit."""
    proc = subprocess.Popen(
        poprun_argv("--num-instances", "2", "--num-replicas", "2", OFF, *args, str(go)),
        env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        head = read_until(proc.stdout.fileno(), first, time.monotonic() + TIMEOUT)
        go.touch()
        rest, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    return head + rest


@pytest.mark.parametrize("tagged", [False, True], ids=["plain", "tagged"])
def test_carriage_return_progress_streams_through(tmp_path: Path, tagged: bool) -> None:
    """A `\\r`-terminated update shows while the line is still unfinished, bytes intact."""
    prog = script(tmp_path, "progress.py", PROGRESS)
    tag = ("--tag-output",) if tagged else ()
    out = run_in_two_steps(tmp_path / "go", b"step 2/3\r", *tag, PY, prog)
    if tagged:  # tagged at the start, at most once per segment, bytes otherwise intact
        tag = b"[1,0]<stdout>:"
        assert out.startswith(tag) and tag + tag not in out, out
        assert re.fullmatch(rb"([^\r\n]*(\r|\n)(\[1,0\]<stdout>:)?)*", out), out
        out = out.replace(tag, b"")
    assert out == b"step 1/3\rstep 2/3\rstep 3/3\rdone\n"


CRLF = r"""
import os, sys, time
if os.environ["RANK"] == "0":
    go = sys.argv[1]
    sys.stdout.write("abc\r")
    sys.stdout.flush()
    deadline = time.monotonic() + 30
    while not os.path.exists(go):  # the test creates it once "abc\r" went through
        if time.monotonic() > deadline:
            sys.exit("the first half was not seen in time")
        time.sleep(0.01)
    sys.stdout.write("\ndef\r\n")
"""


def test_crlf_split_between_reads_is_tagged_as_one_line(tmp_path: Path) -> None:
    """`abc\\r` then `\\n` in a later read is one CRLF line: tagged as if read at once."""
    prog = script(tmp_path, "crlf.py", CRLF)
    out = run_in_two_steps(tmp_path / "go", b"abc\r", "--tag-output", PY, prog)
    assert out == b"[1,0]<stdout>:abc\r\n[1,0]<stdout>:def\r\n"


HUGE = r"""
import os, sys
if os.environ["RANK"] == "0":
    sys.stdout.buffer.write((bytes(range(32, 127)) * 210527)[:20_000_000])  # no newline
else:
    print("short", flush=True)
"""


def test_a_20mb_line_without_newline_arrives_in_1mib_tagged_pieces(tmp_path: Path) -> None:
    """Tagged, past the 1 MiB line cap a line is written in pieces, each a tagged line of its
    own, its bytes in order; the unterminated last piece is ended, so the other instance's
    line never joins it."""
    data = (bytes(range(32, 127)) * 210527)[:20_000_000]
    prog = script(tmp_path, "huge.py", HUGE)
    started = time.monotonic()
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, "--tag-output", PY, prog,
               timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 60
    lines = proc.stdout.split(b"\n")
    assert lines.pop() == b""  # the output ends with a line end
    prefix = {0: b"[1,0]<stdout>:", 1: b"[1,1]<stdout>:"}
    assert lines.count(prefix[1] + b"short") == 1
    lines.remove(prefix[1] + b"short")
    assert all(line.startswith(prefix[0]) for line in lines)
    pieces = [line[len(prefix[0]):] for line in lines]
    assert [len(p) for p in pieces] == [1 << 20] * 19 + [20_000_000 - 19 * (1 << 20)]
    assert b"".join(pieces) == data


def test_a_20mb_line_without_newline_goes_out_as_it_is_untagged(tmp_path: Path) -> None:
    """Untagged, an instance's bytes go out as they are (a line end was once added
    after every 1 MiB piece and after the last one). The other instance's line, when
    it comes in the middle, goes on a line of its own: poprun ends the unfinished line
    there, the one byte it adds."""
    data = (bytes(range(32, 127)) * 210527)[:20_000_000]
    prog = script(tmp_path, "huge.py", HUGE)
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, PY, prog, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count(b"short\n") == 1
    before, _, after = out.partition(b"short\n")
    if before:  # short came after some of the long line: that line was ended for it
        assert before.endswith(b"\n")
        before = before[:-1]
    assert before + after == data


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_one_instance_s_bytes_go_out_as_they_are(tmp_path: Path, stream: str) -> None:
    """3 MB of binary without a line end, then an unterminated tail: byte for byte."""
    data = bytes(range(256)).replace(b"\n", b"").replace(b"\r", b"") * 12000 + b"tail"
    blob = tmp_path / "blob"
    blob.write_bytes(data)
    prog = script(tmp_path, "cat.py", "import shutil, sys\n"
                  f"shutil.copyfileobj(open(sys.argv[1], 'rb'), sys.{stream}.buffer)\n")
    proc = run("--num-instances", "1", "--num-replicas", "2", OFF, PY, prog, str(blob))
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout if stream == "stdout" else proc.stderr) == data


def test_an_unterminated_last_line_never_joins_another_instance_s_line(tmp_path: Path
                                                                       ) -> None:
    """`tail-no-newline\xff` then `A\xff\xfeB` used to come out glued together: untagged,
    the unfinished line is ended where the other instance's line follows it, and only
    there (last in the output, it stays unterminated)."""
    prog = script(tmp_path, "tail.py", "import os, sys\n"
                  "sys.stdout.buffer.write(b'tail-no-newline\\xff' if os.environ['RANK'] == '0'"
                  " else b'A\\xff\\xfeB\\n')\n")
    proc = run("--num-instances", "2", "--num-replicas", "2", OFF, PY, prog)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout in (b"tail-no-newline\xff\nA\xff\xfeB\n",
                           b"A\xff\xfeB\ntail-no-newline\xff"), proc.stdout


def test_poprun_s_report_starts_a_line_of_its_own(tmp_path: Path) -> None:
    """stdout and stderr one pipe (2>&1): an instance's unfinished last line on stdout is
    ended before the failure report on stderr, not joined by it."""
    proc = subprocess.run(poprun_argv("--num-instances", "1", "--num-replicas", "2", OFF,
                                      "sh", "-c", "printf unfinished; exit 3"),
                          env=clean_env(None), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    assert proc.returncode == 3, proc.stdout
    assert proc.stdout.startswith(b"unfinished\npoprun: instance 0 "), proc.stdout


@pytest.mark.timeout(120)
def test_a_200mb_line_keeps_poprun_memory_bounded() -> None:
    """poprun's own peak RSS (VmHWM, its high-water mark, read while the line streams)
    stays far below the line's size; it was 398 MB for this line."""
    writer = "yes x | tr -d '\\n' | head -c 200000000"
    proc = subprocess.Popen(poprun_argv(OFF, "--num-instances", "1", "--num-replicas", "1",
                                        "sh", "-c", writer),
                            env=poprun_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    total = pieces = peak = 0
    while chunk := proc.stdout.read(1 << 20):
        total += len(chunk)
        pieces += chunk.count(b"\n")
        peak = max(peak, _high_water_kib(proc.pid))
    assert proc.wait(TIMEOUT) == 0
    assert total == 200_000_000 and pieces == 0  # as it is: no line end added
    assert 0 < peak < 100 * 1024, f"peak RSS {peak} KiB"


def _high_water_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # exited (or a zombie) meanwhile
        return 0
