"""A job's output, kept for `poprunctl logs`: the most recent of it, in a ring file.

The launcher keeps every block of instance output as it routes it, as a record: a header
line `@<instance> <o|e> <bytes>\\n`, then the block's bytes as they came. The records go to
`output.ring`, a file of `HEADER_SIZE + cap` bytes mapped into memory: its data area is a
circle in which byte `s` of the record stream lives at `HEADER_SIZE + s % cap`, and its
header says where the stream ends and where its oldest whole record starts. So the file
always holds the newest `cap` bytes' worth of whole records: `DEFAULT_CAP` (4 MiB) unless
`POPRUN_JOB_LOG_BYTES` says otherwise (0: no log). A block longer than the whole ring keeps
its end.

Why a mapped file (8 x 200k tagged lines, ~300 ms, on the 2-core machine of
docs/architecture.md): writing each block to a file cost +57 ms; keeping the blocks in
memory to write every half second still cost ~15-25 ms (4 MiB of blocks held back from the
allocator, whose reuse of hot memory the output path relies on, and a 4 MiB write at the
end); a copy into the mapping costs ~4 ms and nothing at the end. The kernel writes the pages
back by itself, so a launcher killed outright loses none of what it had routed. The space
is reserved when the file is made (`posix_fallocate`): a store into a mapped page that the
filesystem could not back would be SIGBUS, so a full disk turns the log off at the start.

With `--output-filename`, poprun writes every instance's output to files already: no ring is
kept, and `poprunctl logs` reads those files (`rank.<i>/stdout`, `rank.<i>/stderr`).

Reading is pure: `unwind(file bytes)` gives the records' bytes oldest first, and
`records(data)` splits them into (instance, stream, bytes); a torn last record is dropped.
The launcher's own reads (`poprunctl logs` of a live job, through its control socket) are
never torn: it writes and serves from one thread.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections import deque
from collections.abc import Iterable, Iterator, Mapping

from spawner.local import Stream

from poprun.events import JobObserver
from poprun.fold import tag_label
from poprun.jobctl.records import OUTPUT as LOG

DEFAULT_CAP = 4 << 20
MIN_CAP = 256  # smaller asks get this much: room for a header and a little output
CAP_VARIABLE = "POPRUN_JOB_LOG_BYTES"
# magic, cap, start (the oldest whole record's stream offset), end (the stream's length)
_FILE_HEADER = struct.Struct("<8sQQQ")
HEADER_SIZE = _FILE_HEADER.size
_U64 = struct.Struct("<Q")
_START_AT, _END_AT = 16, 24  # the header's start and end fields
_MAGIC = b"poprunR1"
_RECORD_HEADER_MAX = 48  # "@<instance> o <bytes>\n" is shorter whatever the numbers
_HEADER = rb"@(\d+) ([oe]) (\d+)\n"  # compiled when read (poprunctl), not at each launch
_STREAM = {Stream.STDOUT: b"o", Stream.STDERR: b"e"}
_NAME = {b"o": "stdout", b"e": "stderr"}
MAX_FOLLOWER_BACKLOG = 8 << 20  # bytes a slow `logs --follow` may lag before it is dropped


def cap_from(environ: Mapping[str, str]) -> int:
    try:
        return max(0, int(environ.get(CAP_VARIABLE, DEFAULT_CAP)))
    except ValueError:
        return DEFAULT_CAP


class RingLog:
    """The writer. Raises OSError at its making where the file cannot be made and backed
    (the job goes on without a log); never after."""

    def __init__(self, directory: str, cap: int = DEFAULT_CAP) -> None:
        self.path = os.path.join(directory, LOG)
        self._cap = cap = max(MIN_CAP, cap)
        self._room = cap - _RECORD_HEADER_MAX  # the most of one block a record can hold
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER_SIZE + cap)
            self._map: mmap.mmap | None = mmap.mmap(fd, HEADER_SIZE + cap)
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)  # the mapping keeps the file
        _FILE_HEADER.pack_into(self._map, 0, _MAGIC, cap, 0, 0)
        self._starts: deque[int] = deque()  # stream offsets of the records in the ring
        self._end = 0

    def write(self, key: int, stream: Stream, data: bytes) -> None:
        """Keep a record, overwriting the oldest ones it needs the room of. (Called for
        every block of output: written for speed, the usual case inline.)"""
        ring = self._map
        if ring is None:
            return
        if len(data) > self._room:
            data = data[len(data) - self._room:]
        header = b"@%d %s %d\n" % (key, _STREAM[stream], len(data))
        start, cap = self._end, self._cap
        end = start + len(header) + len(data)
        starts = self._starts
        starts.append(start)
        if starts[0] < end - cap:
            while starts[0] < end - cap:  # overwritten by this record
                starts.popleft()
            # Said before the bytes go in (and the end after): read at any moment, the
            # file holds whole records only.
            _U64.pack_into(ring, _START_AT, starts[0])
        at = HEADER_SIZE + start % cap
        if at + end - start <= HEADER_SIZE + cap:
            ring[at:at + len(header)] = header
            ring[at + len(header):at + end - start] = data
        else:  # wraps around
            self._put(start, header)
            self._put(start + len(header), data)
        self._end = end
        _U64.pack_into(ring, _END_AT, end)

    def _put(self, offset: int, data: bytes) -> None:
        at = offset % self._cap
        first = min(len(data), self._cap - at)
        view = memoryview(data)
        self._map[HEADER_SIZE + at:HEADER_SIZE + at + first] = view[:first]
        if first < len(data):
            self._map[HEADER_SIZE:HEADER_SIZE + len(data) - first] = view[first:]

    def close(self) -> None:
        """Stop writing; the file keeps what was written (the kernel writes it back)."""
        if self._map is not None:
            self._map.close()
            self._map = None


def read_ring(directory: str) -> bytes:
    """The ring's records, oldest first; b"" when there is none (or it is not a ring)."""
    try:
        with open(os.path.join(directory, LOG), "rb") as f:
            return unwind(f.read())
    except OSError:
        return b""


def unwind(ring: bytes) -> bytes:
    """A ring file's records in stream order (pure)."""
    if len(ring) < HEADER_SIZE:
        return b""
    magic, cap, start, end = _FILE_HEADER.unpack_from(ring)
    if magic != _MAGIC or len(ring) != HEADER_SIZE + cap or not 0 <= end - start <= cap:
        return b""
    area = memoryview(ring)[HEADER_SIZE:]
    first, length = start % cap, end - start
    if first + length <= cap:
        return bytes(area[first:first + length])
    return bytes(area[first:]) + bytes(area[:first + length - cap])  # wrapped around


def records(data: bytes) -> Iterator[tuple[int, str, bytes]]:
    """(instance, "stdout" | "stderr", bytes) for each whole record in `data`."""
    pos, end = 0, len(data)
    header = re.compile(_HEADER)
    while pos < end:
        head = header.match(data, pos)
        if head is None:
            return  # not a record boundary: nothing more can be trusted
        start = head.end()
        stop = start + int(head.group(3))
        if stop > end:
            return  # torn: being written
        yield int(head.group(1)), _NAME[head.group(2)], data[start:stop]
        pos = stop


def encode(key: int, stream: str, data: bytes) -> bytes:
    """One record (what the control socket streams to `poprunctl logs --follow`)."""
    return b"@%d %s %d\n" % (key, b"o" if stream == "stdout" else b"e", len(data)) + data


def from_output_files(directory: str, instances: Iterable[int]) -> bytes:
    """`--output-filename DIR`'s files (DIR/1/rank.<i>/stdout, stderr) as records, instance
    by instance (those files keep no order between instances)."""
    out = []
    for index in instances:
        for stream in ("stdout", "stderr"):
            try:
                with open(os.path.join(directory, "1", f"rank.{index}", stream), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if data:
                out.append(encode(index, stream, data))
    return b"".join(out)


def tagged(key: int | tuple[int, ...], stream: str, data: bytes) -> bytes:
    """A record as `poprunctl logs` prints it: each line tagged as mpirun's --tag-output
    (`key`: a set of instances for a folded line, `[1,0-62]<stdout>:`)."""
    tag = b"[1,%s]<%s>:" % (tag_label(key).encode(), stream.encode())
    lines = data.splitlines(keepends=True)
    return b"".join(tag + (line if line.endswith((b"\n", b"\r")) else line + b"\n")
                    for line in lines)


class JobLog(JobObserver):
    """The running job's output for `poprunctl logs` (an observer of its events): every
    block into the ring (`ring`: None with --output-filename, whose files keep it, or where
    the ring could not be made), and to the clients following it live."""

    def __init__(self, ring: RingLog | None, directory: str, output_dir: str | None,
                 num_instances: int) -> None:
        self.ring, self.dir = ring, directory
        self.output_dir, self.num_instances = output_dir, num_instances
        self.followers: set = set()  # asyncio.StreamWriter of each `logs --follow`

    @property
    def source(self) -> str:
        return "ring" if self.ring is not None else "files" if self.output_dir else "none"

    def output(self, key: int, stream, data: bytes, now: float, lines: int) -> None:
        if self.ring is not None:
            self.ring.write(key, stream, data)
        if self.followers:
            self._forward(encode(key, stream.name.lower(), data))

    def history(self) -> bytes:
        """What was kept so far, as records."""
        if self.ring is not None:
            return read_ring(self.dir)
        if self.output_dir:
            return from_output_files(self.output_dir, range(self.num_instances))
        return b""

    def _forward(self, record: bytes) -> None:
        for writer in list(self.followers):
            if writer.transport.get_write_buffer_size() > MAX_FOLLOWER_BACKLOG:
                self.followers.discard(writer)
                writer.close()  # too slow a reader: it may reconnect
                continue
            writer.write(record)

    def close(self) -> None:
        for writer in list(self.followers):
            writer.close()
        self.followers.clear()
        if self.ring is not None:
            self.ring.close()
