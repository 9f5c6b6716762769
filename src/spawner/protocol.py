"""The framed protocol between the launcher and a per-host agent (`spawner.agent`).

The agent's stdin carries the launcher's requests, its stdout the agent's replies and events.
Before its first frame the agent writes `MAGIC`: a remote shell's start-up files may print to
stdout before the agent runs, and the launcher skips (and reports) whatever precedes it.

Every frame is a 5-byte header — payload length (u32, big-endian) and `Kind` (u8) — then the
payload. Output, the hot path (8 instances x 200k lines), is binary: a 5-byte sub-header
(instance key u32, stream u8) followed by the raw bytes, so nothing is parsed, escaped or copied
more than once. Every other frame is one JSON object: rare, small, and easy to extend.

The frame header, `MAGIC` and the HELLO exchange never change; anything else may change
with `PROTOCOL_VERSION`, which HELLO compares before anything else is sent.

Messages (JSON fields; `id` pairs a request with its REPLY or FAILED):

    launcher -> agent
      HELLO   {id, protocol, poprun, python: [major, minor], cwd, program, path, stats,
               heartbeat: [interval, timeout], interfaces, mktemp, facts, kill_timeout}
                                             both sides beat;
                                             silence past `timeout` ends it; interfaces:
                                             tell them (the agent beats its own watchdog
                                             too: one silent, frozen or stuck, that long
                                             is killed with its instances; no frame for
                                             it); mktemp: a prefix, MKTEMP's dir made at
                                             once (the launcher saves a round trip); facts:
                                             {argv, env, cache, cwd} to read (see FACTS);
                                             kill_timeout: what a SIGTERM of the agent
                                             gives its instances before SIGKILL
      MKTEMP  {id, prefix}                   a 0700 temp dir, removed when the agent ends
      MKDIR   {id, path}                     a directory (and parents) that is kept
      SPAWN   {key, argv, env_set, env_unset, cwd, merge_stderr, cpus, mems, world, rank,
               container: {runtime, image, args} or null (spawner/containers.py)}
                                             rank: its rank in `world` (absent: `key`; a
                                             spawned process's key is not its rank)
      SIGNAL  {key (null: every instance), signal (name, e.g. "SIGTERM")}
      HEARTBEAT {last?}                      every `interval` seconds; last: true, the launcher's
                                             goodbye before its stream ends (pod mode)
      STACKS  {id, keys (null: every instance), within}    their Python stacks (stackdump.py)
      WORLD   {kvsname, size, ranks, nodes, pmix}  an MPI world whose `ranks` run here (before
                                             their SPAWNs, which name it); nodes: each rank's
                                             host; pmix (absent: none): {names: the hosts'
                                             names, libpmix: a path the user gave or null,
                                             argv: the program's} Open MPI's world served too;
                                             appnums (absent: all 0): {rank: appnum} where
                                             they differ (MPI_Comm_spawn_multiple's worlds)
      WORLD_END {kvsname}                    the world's instances are gone: clean up after it
      VALUE   {kvsname, id, value}           answers GET (value null: absent)
      NAMED   {kvsname, id, rc, value}       answers NAME: rc 0 and the port (a lookup), or
                                             rc 1 and why
      SPAWNED_ANSWER {kvsname, id, reply}    answers SPAWN_ASK: spawn_result's fields
      FENCE_OUT {kvsname, ranks, seq, of, data | puts | error, sets}  a fence every host
                                             taking part entered is complete: PMIx's (`of`
                                             absent), all their data (base64); PMI-1's
                                             barrier (`of`: "pmi1"), the epoch's puts; sets
                                             (absent: one namespace's): as FENCE_IN's
      MODEX_ASK {kvsname, id, rank}          a rank of this host's: its PMIx data, please
      MODEX_DATA {kvsname, id, status, data} answers MODEX_WANT (data base64)
      PROBE   {id, address, port, token, within}  connect to the launcher there, send the
                                             token, read it back (poprun --check)
      FACTS   {id}                           what HELLO's `facts` asked to read: sent as
                                             HELLO's answer comes (the agent reads once that
                                             answer is out, the launcher goes on meanwhile)
      (closing the agent's stdin ends it: it kills its instances and removes its temp dirs)
    agent -> launcher
      REPLY   {id, result}                   result of HELLO: see agent.hello_reply(),
                                             and with mktemp, temp_dir: its path (or
                                             temp_dir_error: why there is none)
                                             result of MKTEMP, MKDIR: {path}
                                             result of STACKS: {stacks: {key: {pid, how,
                                             threads, error}}} within `within` seconds
                                             result of PROBE: {ok, error, seconds}
                                             result of FACTS: hostfacts.gather()
      FAILED  {id, error}                    a request failed (id null: a malformed frame)
      STARTED {key, pid, start, memory_binding_reason,
               binding: {cpus, mems, mempolicy},
               containment}                 containment: how escaped descendants are caught;
                                             memory_binding_reason: why the memory binding
                                             asked for was skipped, null when none was
                                             start: its start time (spawner/procid.py)
      SPAWN_FAILED {key, error}
      OUTPUT  key, stream, bytes             binary; blocks of whole lines, as LocalSpawner
      EXIT    {key, returncode, error, progress, oom_kills}
                                             after the last OUTPUT of that instance;
                                             error: its uncaught exception (popdist/
                                             errorfile.py); progress (optional): its last
                                             popdist.progress() [step, total];
                                             oom_kills (optional): it ended by SIGKILL
                                             while the kernel's OOM killer killed this
                                             many processes in its memory cgroup
                                             (spawner/oomkills.py)
      STATS   {usage: {key: [cpu %, rss]},   every `stats` seconds, when HELLO gave it;
               progress: {key: [step, total]}}  progress (optional): popdist.progress()
      ALIVE   {}                             every `interval` seconds (the agent's heartbeat)
      GET     {kvsname, id, key}             a PMI key this host has not seen
      MPI_ABORT {kvsname, key, exitcode, message}   an instance called MPI_Abort
      MPI_LOST {kvsname, key, initialized}   an instance's PMI connection closed unfinalized
      FENCE_IN {kvsname, ranks, seq, of, data | puts, sets}  every instance here entered
                                             this fence (once per host and fence: fences.py):
                                             PMIx's, data base64; PMI-1's barrier (of:
                                             "pmi1", ranks: all), puts: theirs since the last;
                                             sets (absent: one namespace's): [[namespace,
                                             [ranks]], ...] of a PMIx connect or group over
                                             several, `ranks` kvsname's, seq counted per sets
      MODEX_WANT {kvsname, id, rank}         an instance here wants another host's rank's data
      MODEX_GOT {kvsname, id, status, data}  answers MODEX_ASK
      PMIX_UNSERVED {kvsname, error}         Open MPI's world cannot be served here
      NAME    {kvsname, id, op, service, port}  publish, unpublish or look up a name in
                                             the job's table (spawner/worlds/mpinames.py);
              [wait, once, pmix]             PMIx's also: a lookup's wait (s, bounded), a
                                             name read once, a PMIx port (longer); op
                                             "context": a PMIx group's context ID (service:
                                             the group)
      SPAWN_ASK {kvsname, id, key, request}  rank `key` of that world, here, called
                                             MPI_Comm_spawn: request {commands: [{execname,
                                             nprocs, args, info}], preput}; the launcher
                                             starts them (on any of the job's hosts)
      PMI_UNSERVED {kvsname, key, cmd, why}  a PMI-1 command of instance `key` was answered
                                             with an error: why (for the launcher's -v)
      PMIX_LOST {kvsname, error}             this host's PMIx server died (error: how)
      (spawner/worlds/nodeworld.py: the agent's side of a world;
       poprun/run/worlds/pmi1.py the launcher's)
      INTERNAL {error, traceback}            a bug in the agent: it kills its instances,
                                             removes its temp dirs and exits with status 70
    spawner -> its PMIx server's process (a socket pair; spawner/worlds/pmixhost.py)
      PMIX_SERVE {id, libpmix, tmpdir, hostname, owner, mark}  start libpmix's server; who
                                             may connect: owner's descendants, and processes
                                             with mark (NAME=token) in their environment
      PMIX_OPEN {id, kvsname, nodes, names, here, appnums}  register a world's namespace
                                             and its ranks here; REPLY {id, result: {env: {rank: {...}}}}
      FENCE_OUT, MODEX_DATA, MODEX_ASK, NAMED, WORLD_END  as from the launcher to an agent
    PMIx server -> spawner
      REPLY / FAILED {id, ...}               answers PMIX_SERVE (result: {version}), PMIX_OPEN
      PMIX_CLIENT {kvsname, key, event}      connected or finalized, sent before the instance
                                             is released
      PMIX_REFUSED {uid, why}                a connection from outside the job, closed unread
      FENCE_IN, MODEX_WANT, MODEX_GOT, MPI_ABORT  as from an agent to the launcher
      NAME {kvsname, id, key, op, service, port, wait, once}  an instance's PMIx_Publish,
                                             _Lookup or _Unpublish (one frame a name), or a
                                             group's context ID: answered with NAMED
      PMI_UNSERVED {kvsname, key, cmd, why}  a PMIx request answered with an error at once
                                             (cmd "PMIx <request>"), for the launcher's -v
      (an agent sends the NAME on to the launcher, PMI_UNSERVED too)
"""

from __future__ import annotations

import enum
import json
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # local.py (~half of this module's import) only where OUTPUT is decoded:
    from .local import Stream  # the PMIx server's process never decodes one


def __getattr__(name: str):
    """SpawnRequest, from its own module on first use (spawner/spawnrequest.py: dataclasses
    and the containers' module are most of its import, which the PMIx server's process
    would otherwise pay at its start)."""
    if name == "SpawnRequest":
        from .spawnrequest import SpawnRequest

        return SpawnRequest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# 5: HELLO's mktemp; 6: PMIx (WORLD's pmix, FENCE_*, MODEX_*), FACTS, HELLO's open_files,
# STARTED's memory_binding_reason, the Slurm step's call-back (no StepAck); 7: SPAWN's
# container (an agent that ignored it would start the instance bare), HELLO's kill_timeout,
# NAME, NAMED, PMI_UNSERVED, SPAWN_ASK, SPAWNED_ANSWER (MPI's published names and spawns,
# PMI-1 commands not served), the PMIx server in a process of its own (PMIX_LOST;
# PMIX_SERVE..PMIX_REFUSED on its link), SPAWN's rank and WORLD's appnums (spawned processes
# on the agents' hosts); 8: FENCE_IN's and FENCE_OUT's sets (a PMIx connect or group over
# several namespaces: an agent that ignored it would take it for one namespace's fence);
# 9: PMI-1's barrier is a fence (FENCE_IN/FENCE_OUT's `of`, `puts`), BARRIER_IN and
# BARRIER_OUT gone
PROTOCOL_VERSION = 9
MAGIC = b"\0poprun-agent\0"
HEADER = struct.Struct(">IB")  # payload length, kind
OUTPUT_HEADER = struct.Struct(">IBIB")  # frame header + (instance key, stream)
_KEY_STREAM = struct.Struct(">IB")
# Bytes a remote shell may print before MAGIC before we give up on finding it.
MAX_NOISE = 65536
# The longest frame either side takes: far past any it sends (a SPAWN's environment, a STACKS
# reply of every instance of a host), and a bound on what one waits for and holds: bytes
# that are not a header (a stray print on the agent's stdout) announce gigabytes.
MAX_FRAME = 256 << 20


class Kind(enum.IntEnum):
    """What a frame is: the launcher's requests are < 16, and FACTS (the first request past
    them, numbered after the agent's messages); the agent's messages are 16-32 and 34-39; the
    PMIx server's link (a host's spawner and its server's process) adds 40-43."""

    HELLO = 1
    """Launcher: who are you? Agent answers with REPLY."""
    MKTEMP = 2
    """Launcher: create a private temp dir. Agent answers with REPLY {path}."""
    SPAWN = 3
    """Launcher: start one instance. Agent answers with STARTED or SPAWN_FAILED."""
    SIGNAL = 4
    """Launcher: signal one instance's process group, or every one's."""
    MKDIR = 5
    """Launcher: create a directory that is kept (an explicit executable cache)."""
    HEARTBEAT = 6
    """Launcher: I am here. An agent that hears nothing for the HELLO's timeout stops."""
    STACKS = 7
    """Launcher: the Python stacks of instances. Agent answers with REPLY {stacks}."""
    WORLD = 8
    """Launcher: serve an MPI world's PMI for the instances of it that will run here."""
    WORLD_END = 9
    """Launcher: that world is over (its instances are gone): clean up after it."""
    # 10: BARRIER_OUT until protocol 9 (PMI-1's barrier is a fence now)
    VALUE = 11
    """Launcher: the value of a key an agent asked for (GET)."""
    PROBE = 12
    """Launcher: can this host reach me back there? Agent answers with REPLY {ok, error}."""
    FENCE_OUT = 13
    """Launcher: a fence (PMIx's, or PMI-1's barrier) is complete on every host taking part;
    what all of them brought."""
    MODEX_ASK = 14
    """Launcher: another host wants the PMIx data of a rank here. Answered by MODEX_GOT."""
    MODEX_DATA = 15
    """Launcher: the PMIx data of another host's rank, that MODEX_WANT asked for."""
    REPLY = 16
    """Agent: the result of the request with the same id."""
    FAILED = 17
    """Agent: the request with the same id failed (id null: a frame it could not read)."""
    STARTED = 18
    """Agent: an instance runs, with this pid."""
    SPAWN_FAILED = 19
    """Agent: an instance could not be started."""
    OUTPUT = 20
    """Agent: a block of an instance's output (binary payload)."""
    EXIT = 21
    """Agent: an instance exited; no OUTPUT for it follows."""
    STATS = 22
    """Agent: CPU % and RSS of its running instances (and their popdist.progress() steps),
    every `stats` seconds HELLO asked for."""
    ALIVE = 24
    """Agent: I am here (its heartbeat). A launcher that hears nothing declares it lost."""
    INTERNAL = 23
    """Agent: it hit a bug (`error`, `traceback`), killed its instances and is exiting."""
    # 25: BARRIER_IN until protocol 9
    GET = 26
    """Agent: a world's key this host has not seen. Launcher answers with VALUE."""
    MPI_ABORT = 27
    """Agent: an instance called MPI_Abort."""
    MPI_LOST = 28
    """Agent: an instance's PMI connection closed before MPI_Finalize."""
    FENCE_IN = 29
    """Agent: every instance of a world here entered a fence (PMIx's, or PMI-1's barrier),
    once per host and fence."""
    MODEX_WANT = 30
    """Agent: an instance here wants another host's rank's PMIx data (direct modex)."""
    MODEX_GOT = 31
    """Agent: the PMIx data of a rank here, that MODEX_ASK asked for."""
    PMIX_UNSERVED = 32
    """Agent: Open MPI's world cannot be served on this host (no libpmix, or it failed)."""
    FACTS = 33
    """Launcher: what HELLO's `facts` asked you to read (the job's dependencies here)? Agent
    answers with REPLY once it is read (spawner/hostfacts.py)."""
    NAME = 34
    """Agent: publish, unpublish or look up an MPI name. Launcher answers with NAMED."""
    NAMED = 35
    """Launcher: the answer to NAME."""
    PMI_UNSERVED = 36
    """Agent: an instance's PMI-1 command was answered with an error (not served)."""
    SPAWN_ASK = 37
    """Agent: an instance here called MPI_Comm_spawn. Launcher answers with SPAWNED_ANSWER."""
    SPAWNED_ANSWER = 38
    """Launcher: the answer to SPAWN_ASK (spawn_result's fields)."""
    PMIX_LOST = 39
    """Agent: this host's PMIx server died while its instances ran (why: its signal)."""
    # The link between a host's spawner (poprun or an agent) and its PMIx server's process
    # (spawner/worlds/pmixhost.py, spawner/worlds/pmixproc.py). Also on it, as between
    # hosts: FENCE_IN, FENCE_OUT, MODEX_WANT, MODEX_DATA, MODEX_ASK, MODEX_GOT, MPI_ABORT,
    # WORLD_END, REPLY and FAILED.
    PMIX_SERVE = 40
    """Spawner: start libpmix's server. Answered by REPLY {version} or FAILED."""
    PMIX_OPEN = 41
    """Spawner: register a world's namespace and its ranks here. REPLY {env} or FAILED."""
    PMIX_CLIENT = 42
    """Server: an instance connected to it, or finalized (sent before it is released)."""
    PMIX_REFUSED = 43
    """Server: a connection that is not one of the job's instances was closed unread."""


_KINDS = {int(k): k for k in Kind}
# A host's node-level world's frames up its link to the world's root (spawner.worlds.nodeworld)
WORLD_KINDS = frozenset({Kind.GET, Kind.MPI_ABORT, Kind.MPI_LOST, Kind.FENCE_IN,
                         Kind.MODEX_WANT, Kind.MODEX_GOT, Kind.PMIX_UNSERVED, Kind.NAME,
                         Kind.PMI_UNSERVED, Kind.SPAWN_ASK, Kind.PMIX_LOST})
# ... and the root's frames down it, to a host's node-level world
DOWN_KINDS = (Kind.WORLD, Kind.WORLD_END, Kind.VALUE, Kind.NAMED, Kind.SPAWNED_ANSWER,
              Kind.FENCE_OUT, Kind.MODEX_ASK, Kind.MODEX_DATA)
_STREAMS: dict[int, Stream] = {}


def _streams() -> dict[int, Stream]:
    if not _STREAMS:
        from .local import Stream

        _STREAMS.update({int(s): s for s in Stream})
    return _STREAMS


class ProtocolError(Exception):
    """The byte stream is not this protocol: garbage, an unknown kind, or bad JSON. `frames`:
    the whole frames that came before it in what was fed (theirs to handle still)."""

    frames: list = []


class Output(NamedTuple):
    """A decoded OUTPUT frame."""

    key: int
    stream: Stream
    data: bytes


class Control(NamedTuple):
    """A decoded JSON frame."""

    kind: Kind
    fields: dict[str, Any]


Frame = Output | Control


# --- encoding ----------------------------------------------------------------------------

def encode(kind: Kind, **fields: Any) -> bytes:
    """A JSON frame. ASCII JSON round-trips str with surrogate escapes exactly, so argv and
    environment values that are not valid UTF-8 still arrive byte-for-byte."""
    payload = json.dumps(fields, separators=(",", ":")).encode("ascii")
    return HEADER.pack(len(payload), kind) + payload


def output_header(key: int, stream: Stream, size: int) -> bytes:
    """The header of an OUTPUT frame carrying `size` bytes; send the bytes after it as they
    are (the agent writes both with one writev, no concatenation)."""
    return OUTPUT_HEADER.pack(size + _KEY_STREAM.size, Kind.OUTPUT, key, stream)


def encode_output(key: int, stream: Stream, data: bytes) -> bytes:
    return output_header(key, stream, len(data)) + data


# --- decoding ----------------------------------------------------------------------------

class FrameDecoder:
    """Incremental: `feed()` any slice of the stream, get the frames it completes.

    With `expect_magic`, bytes before `MAGIC` are collected in `noise` (at most `MAX_NOISE`
    of them, then ProtocolError) instead of being parsed as frames.
    """

    def __init__(self, expect_magic: bool = False) -> None:
        self._buf = bytearray()
        self._synced = not expect_magic
        self.noise = b""

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        if not self._synced and not self._sync():
            return []
        return self._frames()

    def _sync(self) -> bool:
        buf = self._buf
        at = buf.find(MAGIC)
        if at < 0:
            keep = len(MAGIC) - 1  # MAGIC may be split across feeds
            self._take_noise(max(0, len(buf) - keep))
            return False
        self._take_noise(at)
        del buf[:len(MAGIC)]
        self._synced = True
        return True

    def _take_noise(self, n: int) -> None:
        self.noise += bytes(self._buf[:n])
        del self._buf[:n]
        if len(self.noise) > MAX_NOISE:
            raise ProtocolError(f"no agent greeting in the first {MAX_NOISE} bytes of output")

    def _frames(self) -> list[Frame]:
        buf, frames, pos = self._buf, [], 0
        end_of_data = len(buf)
        try:
            with memoryview(buf) as view:  # slices of a view copy once; released before del
                while end_of_data - pos >= HEADER.size:
                    length, kind = HEADER.unpack_from(view, pos)
                    if length > MAX_FRAME:
                        raise ProtocolError(f"a frame of {length} bytes announced, past the "
                                            f"protocol's {MAX_FRAME}")
                    start = pos + HEADER.size
                    end = start + length
                    if end > end_of_data:
                        break
                    frames.append(_decode(kind, view, start, end))
                    pos = end
        except ProtocolError as exc:
            exc.frames = frames
            raise
        del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


def _decode(kind: int, buf: memoryview, start: int, end: int) -> Frame:
    if kind == Kind.OUTPUT:
        if end - start < _KEY_STREAM.size:
            raise ProtocolError("OUTPUT frame shorter than its header")
        key, stream = _KEY_STREAM.unpack_from(buf, start)
        streams = _streams()
        if stream not in streams:
            raise ProtocolError(f"OUTPUT frame with unknown stream {stream}")
        return Output(key, streams[stream], bytes(buf[start + _KEY_STREAM.size:end]))
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    try:
        fields = json.loads(bytes(buf[start:end]))
    except ValueError as exc:
        raise ProtocolError(f"{_KINDS[kind].name} frame is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"{_KINDS[kind].name} frame is not a JSON object")
    return Control(_KINDS[kind], fields)
