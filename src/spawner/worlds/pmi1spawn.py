"""MPI_Comm_spawn[_multiple] over PMI-1: the request MPICH sends, read and checked; pure, no
I/O (docs/architecture.md, "The instances' worlds"). run/worlds/spawn.py starts what it asks for.

MPICH's client (pmodels/mpich src/pmi/src/pmi_wire.c PMIU_msg_set_query_spawn and
PMIU_cmd_output_v1_mcmd) sends one message of several lines, one ``key=value`` a line, one
segment per command, each starting with ``mcmd=spawn`` and ending with ``endcmd``::

    mcmd=spawn
    nprocs=2
    execname=python3
    totspawns=2          (commands in the message)
    spawnssofar=1        (this one's number, from 1)
    argcnt=2
    arg1=-c
    arg2=print(1)
    preput_num=1         (first segment only)
    preput_key_0=PARENT_ROOT_PORT_NAME
    preput_val_0=<the port the parent accepts on>
    info_num=1
    info_key_0=wdir
    info_val_0=/tmp
    endcmd
    mcmd=spawn
    ...                  (spawnssofar=2 ... endcmd)

The message ends at the ``endcmd`` of the segment whose ``spawnssofar`` equals
``totspawns`` (MPICH's PMIU_check_full_cmd). Values run to the end of their line and are
un-escaped (``\\x`` -> ``x``). The reply is ``cmd=spawn_result rc=0 errcodes=0,0,...`` (one
code per process), or ``rc=1 msg=...``: MPICH's MPI_Comm_spawn then fails with an MPI error.

Everything in it is hostile input: the message is bounded in lines and bytes while it is
read, and the processes it asks for in count (SPAWN_MAX per call, SPAWNED_MAX alive in a
job at once): a spawn storm is refused with an error, never a fork bomb.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .pmi1wire import PmiError, unescape

# A spawn message's lines and bytes: a command's argv and info keys fit many times over
# (Hydra has no bound; MPICH's own limit on one PMI message is its 1 MiB read buffer).
MCMD_MAX_LINES = 8192
MCMD_MAX_BYTES = 1 << 20
# The most commands of one MPI_Comm_spawn_multiple, processes one spawn may ask for, and
# spawned processes a job may have alive at once (its instances not counted): MPI pools and
# task farms spawn a worker per core; more than this many is a storm, refused with rc=1.
COMMANDS_MAX = 64
SPAWN_MAX = 256
SPAWNED_MAX = 1024
# Info keys poprun acts on (Hydra's: wdir, path, host/hosts; Open MPI's, as named below);
# others are ignored, said at -v.
INFO_KEYS = ("wdir", "path", "host", "hosts", "hostfile", "add-host")
# Open MPI's spawn (PMIx_Spawn's app info, OpenPMIx include/pmix_common.h) in those terms:
# PMIX_WDIR, PMIX_HOST, PMIX_HOSTFILE, PMIX_ADD_HOST.
PMIX_INFO_KEYS = {"pmix.wdir": "wdir", "pmix.host": "host", "pmix.hostfile": "hostfile",
                  "pmix.addhost": "add-host"}
HOSTFILE_MAX_BYTES = 64 << 10  # a hostfile that names the job's hosts is far smaller


class McmdReader:
    """Collects the lines of one ``mcmd=spawn`` message until its last ``endcmd``."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._bytes = 0
        self._total: str | None = None
        self._sofar: str | None = None

    def feed(self, line: bytes) -> bool:
        """Add one line (with its newline); True once the message is complete. Raises
        PmiError past the bounds."""
        self._bytes += len(line)
        if len(self.lines) >= MCMD_MAX_LINES or self._bytes > MCMD_MAX_BYTES:
            raise PmiError("spawn message too long")
        text = line.decode("utf-8", "surrogateescape").rstrip("\r\n")
        self.lines.append(text)
        if text.startswith("totspawns="):
            self._total = text[len("totspawns="):]
        elif text.startswith("spawnssofar="):
            self._sofar = text[len("spawnssofar="):]
        return text == "endcmd" and self._sofar is not None and self._sofar == self._total


class Command:
    """One command of a spawn: `nprocs` copies of `execname` with `args`, its `info`, and
    variables for its processes' environment (Open MPI's app env: its OMPI_PARENT_PORT)."""

    __slots__ = ("execname", "nprocs", "args", "info", "env")

    def __init__(self, execname: str, nprocs: int, args: list[str],
                 info: dict[str, str], env: dict[str, str] | None = None) -> None:
        self.execname, self.nprocs, self.args, self.info = execname, nprocs, args, info
        self.env = env or {}

    def __repr__(self) -> str:
        return f"Command({self.execname!r}, {self.nprocs}, {self.args!r}, {self.info!r})"


class SpawnRequest:
    """A whole MPI_Comm_spawn[_multiple]: its commands and the keys put for the children;
    `pmix`: Open MPI's (PMIx_Spawn), whose children get a PMIx namespace, not PMI-1 keys."""

    __slots__ = ("commands", "preput", "pmix")

    def __init__(self, commands: list[Command], preput: dict[str, str],
                 pmix: bool = False) -> None:
        self.commands, self.preput, self.pmix = commands, preput, pmix

    @property
    def total(self) -> int:
        return sum(c.nprocs for c in self.commands)


def _segments(lines: list[str]) -> list[dict[str, str]]:
    segments: list[dict[str, str]] = []
    for line in lines:
        if line == "mcmd=spawn":
            segments.append({})
        elif line == "endcmd" or not line:
            continue
        elif not segments:
            raise PmiError("spawn message does not start with mcmd=spawn")
        else:
            key, sep, value = line.partition("=")
            if not sep or not key:
                raise PmiError(f"bad spawn line {line[:60]!r}")
            segments[-1][key] = unescape(value)
    return segments


def _count(fields: dict[str, str], key: str, low: int, high: int) -> int:
    try:
        value = int(fields.get(key, "0"))
    except ValueError:
        raise PmiError(f"spawn: {key} is not a number") from None
    if not low <= value <= high:
        raise PmiError(f"spawn: {key}={value} is not in {low}..{high}")
    return value


def _pairs(fields: dict[str, str], count: str, key: str, value: str) -> dict[str, str]:
    n = _count(fields, count, 0, MCMD_MAX_LINES)
    try:
        return {fields[f"{key}{i}"]: fields[f"{value}{i}"] for i in range(n)}
    except KeyError as exc:
        raise PmiError(f"spawn: {exc.args[0]} missing") from None


def parse_spawn(lines: list[str]) -> SpawnRequest:
    """The request in a complete message (McmdReader.lines); PmiError when it is malformed
    or asks for more than the bounds allow in one call."""
    segments = _segments(lines)
    if not 1 <= len(segments) <= COMMANDS_MAX:
        raise PmiError(f"spawn: {len(segments)} commands (1..{COMMANDS_MAX} taken)")
    commands = []
    for fields in segments:
        execname = fields.get("execname", "")
        if not execname:
            raise PmiError("spawn: no execname")
        nprocs = _count(fields, "nprocs", 1, 1 << 30)
        argc = _count(fields, "argcnt", 0, MCMD_MAX_LINES)
        try:
            args = [fields[f"arg{i}"] for i in range(1, argc + 1)]
        except KeyError as exc:
            raise PmiError(f"spawn: {exc.args[0]} missing") from None
        info = _pairs(fields, "info_num", "info_key_", "info_val_")
        commands.append(Command(execname, nprocs, args, info))
    preput = _pairs(segments[0], "preput_num", "preput_key_", "preput_val_")
    request = SpawnRequest(commands, preput)
    if request.total > SPAWN_MAX:
        raise PmiError(f"spawn of {request.total} processes refused: poprun starts at most "
                       f"{SPAWN_MAX} in one spawn")
    return request


def spawn_reply(rc: int, errcodes: int = 0, msg: str | None = None) -> dict[str, object]:
    """The fields of ``spawn_result``: rc=0 with one code per process, or rc and why."""
    if rc == 0:
        return {"rc": 0, "errcodes": ",".join(["0"] * errcodes)}
    return {"rc": rc, "msg": msg or "spawn_failed"}


class Placed:
    """One process to start: its host (the job's name for it), argv, working directory
    (None: the job's), appnum, rank in the new world, and its command's variables."""

    __slots__ = ("host", "argv", "wdir", "appnum", "rank", "env")

    def __init__(self, host: str, argv: list[str], wdir: str | None, appnum: int,
                 rank: int, env: dict[str, str] | None = None) -> None:
        self.host, self.argv, self.wdir, self.appnum, self.rank = host, argv, wdir, appnum, rank
        self.env = env or {}


def place(request: SpawnRequest, slots: Sequence[tuple[str, int]],
          resolve: Callable[[str], str | None]) -> tuple[list[Placed], list[str]]:
    """The processes of `request` as Hydra places them (its pmiserv_spawn.c: `path` before
    the execname, `wdir`; HYDU_create_proxy_list: each host's slots filled in turn, round
    and round), and the info keys ignored (said at -v).

    `slots`: the job's hosts in order, each with its count of instances (the node list and
    cores mpiexec would have had): the default. A command's `host`/`hosts` info key names
    others: a comma list of the job's hosts, each ``name`` or ``name:n`` (n slots, Hydra's
    host-file syntax); `resolve` gives the job's name for one (None: not one of the job's
    hosts, refused with PmiError: poprun starts processes only where its agents run). The
    placement over one list goes on from one command to the next."""
    placed: list[Placed] = []
    ignored: list[str] = []
    cursors: dict[tuple[str, ...], int] = {}
    for appnum, command in enumerate(request.commands):
        info = command.info
        asked = ",".join(info[k] for k in ("host", "hosts") if k in info)
        ring = _ring(_host_slots(asked, resolve) if asked.strip() else slots)
        if info.get("add-host", "").strip():  # poprun adds no hosts: the job's are there
            _host_slots(info["add-host"], resolve)
        ignored += [key for key in info if key not in INFO_KEYS]
        execname = command.execname
        if info.get("path") and "/" not in execname:
            execname = info["path"].rstrip("/") + "/" + execname
        for _ in range(command.nprocs):
            at = cursors.get(ring, 0)
            cursors[ring] = at + 1
            placed.append(Placed(ring[at % len(ring)], [execname, *command.args],
                                 info.get("wdir") or None, appnum, len(placed), command.env))
    return placed, ignored


def _host_slots(asked: str, resolve: Callable[[str], str | None]) -> list[tuple[str, int]]:
    """A `host` info value as (the job's host, slots) pairs; PmiError where it names a host
    that is not the job's or slots that are not 1..SPAWN_MAX."""
    found = []
    for entry in asked.split(",")[:SPAWN_MAX]:
        name, sep, count = entry.strip().partition(":")
        if not name:
            continue
        host = resolve(name)
        if host is None:
            raise PmiError(f"spawn on {name[:64]}: not one of the job's hosts")
        if sep and not (count.isdigit() and 1 <= int(count) <= SPAWN_MAX):
            raise PmiError(f"spawn on {entry.strip()[:80]}: slots are 1..{SPAWN_MAX}")
        found.append((host, int(count) if sep else 1))
    if not found:
        raise PmiError("spawn: the host info key names no host")
    return found


def _ring(slots: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """Each slot's host, in order: the k-th process goes to slot k, round and round."""
    return tuple(host for host, count in slots for _ in range(count))


def hostfile_hosts(text: str) -> str:
    """An Open MPI hostfile (``name [slots=n]`` a line, ``#`` comments) as a `host` info
    value (``name:n,...``); PmiError for a line that is not one."""
    hosts = []
    for line in text.splitlines()[:SPAWN_MAX]:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = [w for w in words[1:] if w.startswith("slots=")]
        if len(words) > 1 + len(slots) or len(slots) > 1:
            raise PmiError(f"spawn: hostfile line {line.strip()[:80]!r}: poprun reads "
                           "'name [slots=n]' only")
        hosts.append(words[0] + (":" + slots[0][len("slots="):] if slots else ""))
    if not hosts:
        raise PmiError("spawn: the hostfile names no host")
    return ",".join(hosts)


def request_from_pmix(fields: object) -> SpawnRequest:
    """Open MPI's PMIx_Spawn as the PMIx server's process copied it (spawner/worlds/pmixserver.
    spawn_request: its apps' cmd, argv with the command first, env as NAME=value, cwd,
    maxprocs, string info keys; the job's info), checked as an agent's request is: PmiError
    where it is not one Open MPI could have sent, or past the bounds."""
    if not isinstance(fields, dict) or not isinstance(fields.get("apps"), list):
        raise PmiError("spawn: no apps")
    commands = []
    for app in fields["apps"][:COMMANDS_MAX + 1]:
        if not isinstance(app, dict) or type(app.get("maxprocs")) is not int:
            raise PmiError("spawn: a bad app")
        argv = _text_list(app.get("argv"), lines=True)
        env = dict(entry.split("=", 1) for entry in _text_list(app.get("env"), lines=True)
                   if "=" in entry)
        info = {PMIX_INFO_KEYS.get(k, k): v for k, v in _texts(app.get("info"), True).items()}
        cwd = _text(app.get("cwd") or "")
        if cwd and not info.get("wdir"):
            info["wdir"] = cwd
        commands.append(Command(_text(app.get("cmd")), app["maxprocs"], argv[1:], info, env))
    request = SpawnRequest(commands, {}, pmix=True)
    _check_counts(request)
    return request


def _text(value: object, lines: bool = False) -> str:
    """A string one of the requests could hold: never a NUL (C's), nor a newline where
    PMI-1's line protocol carried it (`lines`: PMIx's, where argv and env may hold one)."""
    if not isinstance(value, str) or "\0" in value or (not lines and "\n" in value) or len(
            value) > MCMD_MAX_BYTES:
        raise PmiError("spawn: a bad string")
    return value


def _texts(value: object, lines: bool = False) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MCMD_MAX_LINES:
        raise PmiError("spawn: a bad mapping")
    return {_text(k): _text(v, lines) for k, v in value.items()}


def _text_list(value: object, lines: bool = False) -> list[str]:
    if not isinstance(value, list) or len(value) > MCMD_MAX_LINES:
        raise PmiError("spawn: a bad list")
    return [_text(v, lines) for v in value]


def _check_counts(request: SpawnRequest) -> None:
    commands = request.commands
    if not 1 <= len(commands) <= COMMANDS_MAX or not all(c.execname for c in commands):
        raise PmiError(f"spawn: {len(commands)} commands refused (1..{COMMANDS_MAX} taken)")
    if not all(c.nprocs >= 1 for c in commands):
        raise PmiError("spawn: a command of no process")
    if request.total > SPAWN_MAX:
        raise PmiError(f"spawn of {request.total} processes refused: poprun starts at most "
                       f"{SPAWN_MAX} in one spawn")


def request_json(request: SpawnRequest) -> dict:
    """The request as an agent sends it to the launcher (SPAWN_ASK)."""
    return {"commands": [{"execname": c.execname, "nprocs": c.nprocs, "args": c.args,
                          "info": c.info} for c in request.commands],
            "preput": request.preput}


def request_from_json(fields: object) -> SpawnRequest:
    """An agent's SPAWN_ASK request, checked again (an agent's host is hostile input too):
    PmiError where it is not one parse_spawn (or, under ``pmix``, Open MPI: request_from_pmix)
    could have made."""
    if isinstance(fields, dict) and "pmix" in fields:
        return request_from_pmix(fields["pmix"])
    if not isinstance(fields, dict) or not isinstance(fields.get("commands"), list):
        raise PmiError("spawn: no commands")
    commands = []
    for c in fields["commands"][:COMMANDS_MAX + 1]:
        if not isinstance(c, dict) or type(c.get("nprocs")) is not int:
            raise PmiError("spawn: a bad command")
        commands.append(Command(_text(c.get("execname")), c["nprocs"],
                                _text_list(c.get("args")), _texts(c.get("info"))))
    request = SpawnRequest(commands, _texts(fields.get("preput")))
    _check_counts(request)
    return request
