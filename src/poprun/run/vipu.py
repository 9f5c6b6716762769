"""The job's V-IPU partition, managed through the real `vipu` command-line tool (guide §2.8,
troubleshooting §2.10): find the server, choose the partition, check it against the job, create,
update (remove + create under the same name), reset, wait until it is ACTIVE, and remove it
afterwards when poprun created it.

Layers: pure parsers (`vipu` output text in, frozen dataclasses out) and pure rules
(`mismatches`, `partition_target_options`; the job's settings, requirements, create command
and instance variables are plan/partition.py's, which `--dry-run` shows); `VipuRunner`, the one
place that runs `vipu`; and the lifecycle, `acquire()` and `release()`.

What the real tools print, as far as public sources show (facts, not code, carried over):
- `vipu --server-version`: `version: 1.18.0` and `host: localhost:8090` lines.
- `vipu list partitions`: a `|`-separated table whose column order differs between versions:
  `Cluster | Allocation | Partition | ILDs | GW Routing | ILD Routing | Size | GCDs | State`
  (guide §2.10.1) and `Partition | Cluster | ILDs | GW Routing | ILD Routing | Size | GCDs |
  State` (an older V-IPU); states read `ACTIVE`. It is parsed by header names only.
- The server's own state names are `PS_ACTIVE` etc. (PopRun logs `Partition p already exists
  and is in state: PS_ACTIVE`); both spellings are accepted.
- An unreachable server: `unable to connect to VIRM/V-IPU Controller at ... context deadline
  exceeded` (guide §2.10.1).
- `vipu get partition NAME`: no public sample of its text was found. It is read as `Key: value`
  lines whose keys are matched by the same names as the table's headers (plus `Sync Type`,
  `Reconfigurable` and `IPU-Link Topology`); lines it does not know are ignored, and a value it
  does not report is not checked.

Target options: PopRun's `-vv` logs show what it derives from the partition, e.g. for a 64-IPU
partition `{"ipuLinkDomainSize":"64","ipuLinkConfiguration":"slidingWindow","ipuLinkTopology":
"torus","gatewayMode":"true","instanceSize":"64"}` and for a 4-IPU one `{"ipuLinkDomainSize":"4",
"ipuLinkConfiguration":"default","ipuLinkTopology":"mesh","gatewayMode":"true","instanceSize":
"4"}`; on a reconfigurable 64-IPU partition with 16 one-IPU instances, `"instanceSize":"4"`
(the partition's IPUs per instance, not the instance's own). `ipuLinkTopology` is the
partition's own, not its size's: "mesh" in all 31 instance blocks of PopRun 3.1.0's five
published logs on ALCF's reconfigurable 64-IPU partition, "torus" in an SDK 3.3 log on another
64-IPU one (plan/partition.py, `link_topology`; the GCD id and node device likewise follow the
partition, `Attachment`). The values already in the environment's `POPLAR_TARGET_OPTIONS` win.
"""

from __future__ import annotations

import enum
import os
import re
import shlex
import asyncio
import shutil
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from popdist import env as E

from poprun.errors import ConfigError, LaunchError, PoprunError
from poprun.log import Log
from poprun.plan.partition import (DEFAULT_PORT, Attachment, Requirements, VipuSettings,
                                   create_command, implied_target_options,
                                   instance_environment, link_topology, named_partition,
                                   named_server, seconds, should_reset)
from poprun.plan.poplar import TOPOLOGIES, merged_target_options, parse_options

UNREACHABLE_TEXT = "unable to connect to VIRM/V-IPU Controller"
# `vipu` honours --server-timeout itself; the extra second lets its own message ("context
# deadline exceeded") win over our kill, which is only for a client that hangs regardless.
_KILL_GRACE = 1.0


class Failure(str, enum.Enum):
    """Why talking to V-IPU failed; every kind has its own one-line message."""

    NOT_INSTALLED = "not installed"
    """No `vipu` on PATH: nothing can manage partitions (offline mode needs none)."""
    UNREACHABLE = "unreachable"
    """`vipu` could not connect to the V-IPU server (guide §2.10.1)."""
    TIMED_OUT = "timed out"
    """A `vipu` command took longer than --vipu-server-timeout and was killed."""
    FAILED = "failed"
    """A `vipu` command exited non-zero for another reason; the detail is its message."""
    CREATE_FAILED = "create failed"
    """The server refused to create the partition, typically too few free IPUs."""
    ERROR_STATE = "error state"
    """The partition is (or went) into the server's ERROR state."""
    NOT_READY = "not ready"
    """The partition did not become ACTIVE within the timeout or the polling attempts."""


class VipuError(LaunchError):
    """The partition could not be prepared; `kind` says why, `command` is the `vipu` argv
    (without the program) that failed, when one did. Whatever poprun created was removed."""

    def __init__(self, message: str, kind: Failure, command: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.kind = kind
        self.command = command


class PartitionState(str, enum.Enum):
    """A partition's state as the V-IPU server reports it (`PS_ACTIVE` or `ACTIVE`)."""

    ACTIVE = "ACTIVE"
    """Ready: instances can attach to its IPUs."""
    PENDING = "PENDING"
    """Being created or reset: poll again."""
    ERROR = "ERROR"
    """Broken; a reset may repair it (guide §2.10.2)."""
    UNKNOWN = "UNKNOWN"
    """Any other state the server names: treated like PENDING until the timeout."""

    @classmethod
    def parse(cls, text: str) -> PartitionState:
        word = text.strip().upper().removeprefix("PS_")
        return cls.__members__.get(word, cls.UNKNOWN)


# --- what the server reports ---------------------------------------------------------------

@dataclass(frozen=True)
class ServerVersion:
    """`vipu --server-version`: the server the local vipu configuration points at."""

    version: str | None = None
    host: str | None = None
    port: int | None = None


@dataclass(frozen=True)
class PartitionInfo:
    """One partition as the V-IPU server describes it; None: not reported."""

    name: str
    state: PartitionState = PartitionState.UNKNOWN
    state_text: str = ""
    size: int | None = None
    num_gcds: int | None = None
    num_ilds: int | None = None
    ild_routing: str | None = None
    gw_routing: str | None = None
    sync_type: str | None = None
    reconfigurable: bool | None = None
    ipu_link_topology: str | None = None  # "mesh" or "torus" (`get partition` only)
    allocation: str | None = None
    cluster: str | None = None

    def completed_by(self, other: PartitionInfo) -> PartitionInfo:
        """This description with the values it lacks taken from `other`."""
        missing = {f.name: getattr(other, f.name) for f in fields(self)
                   if getattr(self, f.name) in (None, "") and getattr(other, f.name) is not None}
        if "state_text" in missing:
            missing["state"] = other.state
        return replace(self, **missing)


# Header / key names (lower case, letters and digits only) -> PartitionInfo field.
_FIELD_NAMES = {
    "partition": "name", "partitionid": "name", "name": "name", "id": "name",
    "state": "state_text", "status": "state_text",
    "size": "size", "ipus": "size", "numipus": "size",
    "gcds": "num_gcds", "numgcds": "num_gcds",
    "ilds": "num_ilds", "numilds": "num_ilds", "numipulinkdomains": "num_ilds",
    "ildrouting": "ild_routing", "routing": "ild_routing", "ipulinkrouting": "ild_routing",
    "gwrouting": "gw_routing", "gwlinkrouting": "gw_routing",
    "synctype": "sync_type", "sync": "sync_type",
    "reconfigurable": "reconfigurable",
    "ipulinktopology": "ipu_link_topology", "topology": "ipu_link_topology",
    "ildtopology": "ipu_link_topology",
    "allocation": "allocation", "allocationid": "allocation",
    "cluster": "cluster", "clusterid": "cluster",
}
_INT_FIELDS = ("size", "num_gcds", "num_ilds")
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


def parse_server_version(text: str) -> ServerVersion:
    """`version: 1.18.0` / `host: localhost:8090` lines; others are ignored."""
    values = _key_values(text)
    host, port = _split_address(values.get("host", ""))
    return ServerVersion(version=values.get("version") or None, host=host, port=port)


def parse_partition_table(text: str) -> tuple[PartitionInfo, ...]:
    """`vipu list partitions`: columns found by their header names, never by position.
    Output without any `|` line lists no partitions."""
    lines = [line for line in text.splitlines() if "|" in line]
    if not lines:
        return ()
    header = [_FIELD_NAMES.get(_key(cell)) for cell in _cells(lines[0])]
    if "name" not in header:
        raise VipuError(f"cannot read `vipu list partitions`: no Partition column in "
                        f"{lines[0].strip()!r}", Failure.FAILED)
    rows = []
    for line in lines[1:]:
        cells = _cells(line)
        if all(not cell.strip("-=+ ") for cell in cells):
            continue  # a ruler line
        if len(cells) != len(header):
            raise VipuError(f"cannot read `vipu list partitions`: {len(cells)} columns in "
                            f"{line.strip()!r}, the header has {len(header)}", Failure.FAILED)
        values = {name: cell for name, cell in zip(header, cells) if name}
        if values.get("name"):
            rows.append(_partition_info(values))
    return tuple(rows)


def parse_partition_details(name: str, text: str) -> PartitionInfo:
    """`vipu get partition NAME`: `Key: value` lines (see the module docstring)."""
    values = {}
    for key, value in _key_values(text).items():
        field_name = _FIELD_NAMES.get(key)
        if field_name and field_name not in values:
            values[field_name] = value
    values["name"] = values.get("name") or name
    return _partition_info(values)


def _partition_info(values: dict[str, str]) -> PartitionInfo:
    converted: dict[str, object] = {}
    for name, text in values.items():
        text = text.strip()
        if not text:
            continue
        if name in _INT_FIELDS:
            converted[name] = _integer(text, name)
        elif name == "reconfigurable":
            converted[name] = _boolean(text)
        else:
            converted[name] = text
    state = PartitionState.parse(str(converted.get("state_text", "")))
    return PartitionInfo(state=state, **converted)  # type: ignore[arg-type]


def _integer(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise VipuError(f"cannot read vipu output: {name} {text!r} is not a number",
                        Failure.FAILED) from None


def _boolean(text: str) -> bool | None:
    word = text.lower()
    return True if word in _TRUE else False if word in _FALSE else None


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _cells(line: str) -> list[str]:
    line = line.strip()
    # `| a | b |` and `a | b` are the same row.
    line = line[1:] if line.startswith("|") else line
    line = line[:-1] if line.endswith("|") else line
    return [cell.strip() for cell in line.split("|")]


def _key_values(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and _key(key):
            values.setdefault(_key(key), value.strip())
    return values


def _split_address(text: str) -> tuple[str | None, int | None]:
    """`host:port` or `host`."""
    text = text.strip()
    host, colon, port = text.rpartition(":")
    if colon and port.isdigit() and host:
        return host, int(port)
    return text or None, None


# --- rules ------------------------------------------------------------------------------------

def mismatches(required: Requirements, found: PartitionInfo) -> list[str]:
    """Each way `found` fails the job, as `what is X, the job needs Y`. Values the server did
    not report cannot be checked and are skipped."""
    problems = []
    if found.reconfigurable:
        # poprun splits a reconfigurable partition into one device per instance when the job
        # attaches (guide §7.1), so it only needs room for the job's IPUs.
        if found.size is not None and found.size < required.size:
            problems.append(f"size is {found.size} IPUs, the job needs {required.size}")
    elif found.size is not None and found.size != required.size:
        problems.append(f"size is {found.size} IPUs, the job needs {required.size}")
    single_split = found.reconfigurable and found.num_gcds == 1
    if not single_split and found.num_gcds is not None and found.num_gcds != required.num_gcds:
        problems.append(f"{found.num_gcds} GCDs, the job needs {required.num_gcds} "
                        "(one per instance)")
    checks = (("ILDs", found.num_ilds, required.num_ilds),
              ("sync type", found.sync_type, required.sync_type),
              ("IPU-Link routing", found.ild_routing, required.ipu_link_routing_type),
              ("GW-Link routing", found.gw_routing, required.gw_link_routing_type))
    for what, have, want in checks:
        if want is not None and have is not None and not _same(have, want):
            problems.append(f"{what} is {have}, the job needs {want}")
    return problems


def _same(have: object, want: object) -> bool:
    """`RINGSWNC` (what the table shows) is `ring-swnc` / `ringswnc` (what a user types)."""
    return _key(str(have)) == _key(str(want))


def partition_target_options(found: PartitionInfo, required: Requirements) -> dict[str, str]:
    """The target options the partition found implies (plan/partition.py), its IPU-Link
    topology its own description's."""
    return implied_target_options(found.size or required.size, found.num_ilds, required,
                                  link_topology(found.ipu_link_topology, found.reconfigurable))


# --- running vipu ---------------------------------------------------------------------------

def find_vipu(environ: Mapping[str, str]) -> str:
    """The `vipu` executable on the environment's PATH."""
    found = shutil.which("vipu", path=environ.get("PATH", os.defpath))
    if found is None:
        raise VipuError("the `vipu` command is not on PATH: poprun needs it to manage the "
                        "V-IPU partition (install the V-IPU client, or run without IPUs "
                        "with --offline-mode=yes)", Failure.NOT_INSTALLED)
    return found


class VipuRunner:
    """Runs the real `vipu` against one server. Every call passes the server address and
    `--server-timeout`, is killed when it outlives the timeout, and is logged at -v."""

    def __init__(self, executable: str, timeout: float, log: Log,
                 environ: Mapping[str, str], host: str | None = None,
                 port: int | None = None) -> None:
        self.executable = executable
        self.timeout = timeout
        self.log = log
        self.environ = dict(environ)
        self.host = host
        self.port = port

    @property
    def where(self) -> str:
        if self.host is None:
            return "the V-IPU server of the local vipu configuration"
        return f"the V-IPU server at {self.host}:{self.port or DEFAULT_PORT}"

    async def server_version(self) -> ServerVersion:
        """What the local vipu configuration points at (asked without an address)."""
        return parse_server_version(await self._run(["--server-version"], []))

    async def run(self, *command: str) -> str:
        """`vipu [--api-host H --api-port P] --server-timeout T COMMAND...`; its stdout."""
        address = [] if self.host is None else ["--api-host", self.host]
        if self.port is not None:
            address += ["--api-port", str(self.port)]
        return await self._run(list(command), address)

    async def _run(self, command: list[str], address: list[str]) -> str:
        argv = [self.executable, *address, "--server-timeout", seconds(self.timeout),
                *command]
        self.log.info(f"running {shlex.join(argv)}")
        try:
            returncode, out, err = await _communicate(argv, self.environ,
                                                      self.timeout + _KILL_GRACE)
        except TimeoutError:
            raise VipuError(f"{self.where} did not answer `vipu {shlex.join(command)}` within "
                            f"{seconds(self.timeout)} s (raise --vipu-server-timeout if it is "
                            "just slow)", Failure.TIMED_OUT, tuple(command)) from None
        except OSError as exc:
            raise VipuError(f"cannot run {self.executable}: {exc.strerror}",
                            Failure.NOT_INSTALLED, tuple(command)) from None
        if returncode != 0:
            raise self._failure(command, returncode, out, err)
        said = "; ".join(line.strip() for line in out.splitlines() if line.strip())
        self.log.debug(f"vipu said: {said}")  # one log line, however many vipu printed
        return out

    def _failure(self, args: list[str], returncode: int, out: str, err: str) -> VipuError:
        said = (err.strip() or out.strip()).splitlines()
        detail = said[-1].strip() if said else f"exit status {returncode}"
        if UNREACHABLE_TEXT.lower() in (err + out).lower():
            return VipuError(
                f"cannot reach {self.where} (vipu: {detail}); check that the server runs there "
                "(`systemctl status vipu-server` on its host) or name the right one with "
                "--vipu-server-host/--vipu-server-port", Failure.UNREACHABLE, tuple(args))
        return VipuError(f"`vipu {shlex.join(args)}` failed: {detail}", Failure.FAILED,
                         tuple(args))


# --- the lifecycle --------------------------------------------------------------------------

@dataclass(frozen=True)
class Partition:
    """The partition a job runs on and what its instances need to reach it. `created`: poprun
    made it (then `release` removes it, unless --remove-partition=no)."""

    name: str
    host: str
    port: int
    timeout: float
    info: PartitionInfo
    created: bool
    remove_on_release: bool
    target_options: str  # the JSON instances get as POPLAR_TARGET_OPTIONS
    executable: str
    job_ipus: int | None = None  # the IPUs the job uses of it (None: all of them)

    @property
    def num_gcds(self) -> int:
        return self.info.num_gcds or 1

    @property
    def attachment(self) -> Attachment:
        return Attachment.of(self.info.size, self.info.num_gcds, self.job_ipus,
                             self.info.reconfigurable)

    def environment(self, instance_index: int) -> dict[str, str]:
        """The variables one instance gets (plan/partition.py's instance_environment): on a
        reconfigurable partition, a node device spanning the job's IPUs (the partition's
        first ones when it is larger); on any other, its GCD."""
        return instance_environment(
            instance_index, host=self.host, port=self.port, name=self.name,
            timeout=self.timeout, target_options=self.target_options, num_gcds=self.num_gcds,
            attachment=self.attachment)


async def _communicate(argv: list[str], environ: Mapping[str, str],
                       timeout: float) -> tuple[int, str, str]:
    """Run `argv` to its end without blocking the loop: (status, stdout, stderr). It runs in
    its own session, so a Ctrl-C reaches poprun only; when it outlives `timeout` (raises
    TimeoutError) or the caller is cancelled (Ctrl-C), its whole group is killed and reaped
    before this returns."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(environ), start_new_session=True)
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await asyncio.shield(proc.wait())
        raise
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def acquire(settings: VipuSettings, required: Requirements,
            environ: Mapping[str, str] | None = None, log: Log | None = None) -> Partition:
    """Find or make the job's partition and wait until it is ACTIVE. On any failure, or an
    interruption such as Ctrl-C, a partition poprun created here has been removed again."""
    environ = os.environ if environ is None else environ
    log = log or Log()
    own_options = parse_options(environ.get(E.POPLAR_TARGET_OPTIONS), E.POPLAR_TARGET_OPTIONS)
    executable = find_vipu(environ)
    host, port = await resolve_server(
        settings, environ, VipuRunner(executable, settings.server_timeout, log, environ), log)
    runner = VipuRunner(executable, settings.server_timeout, log, environ, host, port)
    log.debug(f"Connecting to {host}:{port}")
    listed = parse_partition_table(await runner.run("list", "partitions"))
    name = choose_partition(settings, environ, _in_allocation(listed, settings), log)
    existing = next((p for p in listed if p.name == name), None)
    work = _Preparation(runner, settings, required, name, log)
    try:
        info = await work.prepare(existing)
    except BaseException:
        await work.undo()
        raise
    partition = Partition(name=name, host=host, port=port, timeout=settings.server_timeout,
                          info=info, created=work.created,
                          remove_on_release=work.created and settings.remove_partition,
                          target_options=_target_options(info, required, own_options, log),
                          executable=executable, job_ipus=required.size)
    _log_node_device(partition, log)
    return partition


def _log_node_device(partition: Partition, log: Log) -> None:
    """-v: the device the instances are given, as PopRun logs "Attached to device N"; on a
    partition larger than the job, that it is the first of its size (README: jobs sharing a
    partition)."""
    node = partition.attachment.node
    if node is None:
        return
    size = partition.info.size
    larger = f" (the first {partition.job_ipus} of its {size} IPUs)" if (
        partition.job_ipus and size and size > partition.job_ipus) else ""
    log.info(f"node device {node}{larger} on partition {partition.name}")


async def release(partition: Partition, log: Log | None = None,
            environ: Mapping[str, str] | None = None) -> bool:
    """Remove the partition when poprun created it and --remove-partition allows; True when
    removed. Never raises a PoprunError: it runs in `finally` blocks, where a failure must not
    hide the job's own result (it is logged as a warning instead)."""
    log = log or Log()
    if not partition.remove_on_release:
        if partition.created:
            log.info(f"keeping V-IPU partition {partition.name} (--remove-partition=no)")
        return False
    runner = VipuRunner(partition.executable, partition.timeout, log,
                        os.environ if environ is None else environ,
                        partition.host, partition.port)
    try:
        await runner.run("remove", "partition", partition.name)
    except PoprunError as exc:
        log.warning(f"could not remove V-IPU partition {partition.name}: {exc}; remove it "
                    f"with `vipu remove partition {partition.name}`")
        return False
    log.info(f"removed V-IPU partition {partition.name}")
    return True


async def reset(partition: Partition, log: Log, environ: Mapping[str, str]) -> None:
    """Reset the partition between two attempts of a job (`--max-restarts`): the IPUs start
    the next attempt as the first one did. Raises VipuError."""
    runner = VipuRunner(partition.executable, partition.timeout, log, environ,
                        partition.host, partition.port)
    await runner.run("reset", "partition", partition.name)
    log.info(f"reset V-IPU partition {partition.name} for the next attempt")


async def resolve_server(settings: VipuSettings, environ: Mapping[str, str], runner: VipuRunner,
                   log: Log) -> tuple[str, int]:
    """Host: --vipu-server-host > IPUOF_VIPU_API_HOST > what the local vipu configuration
    names (`vipu --server-version`). Port: --vipu-server-port > IPUOF_VIPU_API_PORT > the
    configuration's port when the host came from there > 8090."""
    host, port = named_server(settings, environ)
    if host is None:
        reported = await runner.server_version()
        if not reported.host:
            raise VipuError("`vipu --server-version` names no server host; name the V-IPU "
                            "server with --vipu-server-host", Failure.FAILED,
                            ("--server-version",))
        host, port = reported.host, port or reported.port
        log.info(f"V-IPU server address picked up from 'vipu': {host}:{port or DEFAULT_PORT}")
    return host, port or DEFAULT_PORT


def choose_partition(settings: VipuSettings, environ: Mapping[str, str],
                     listed: tuple[PartitionInfo, ...], log: Log) -> str:
    """--vipu-partition > IPUOF_VIPU_API_PARTITION_ID > the only partition listed."""
    named = named_partition(settings, environ)
    if named:
        if not settings.partition:
            log.info(f"Using V-IPU partition {named} from {E.VIPU_API_PARTITION_ID}")
        return named
    if len(listed) == 1:
        log.info(f"Using V-IPU partition {listed[0].name} as it is the only one available")
        return listed[0].name
    allocation = settings.allocation_or_cluster
    where = f" in allocation {allocation}" if allocation else ""
    if not listed:
        raise ConfigError(f"no V-IPU partition exists{where} and none was named: name one with "
                          "--vipu-partition (poprun creates it when it is missing)")
    raise ConfigError(f"{len(listed)} V-IPU partitions exist{where} "
                      f"({', '.join(p.name for p in listed)}): choose one with --vipu-partition")


def _in_allocation(listed: tuple[PartitionInfo, ...],
                   settings: VipuSettings) -> tuple[PartitionInfo, ...]:
    """The partitions of the allocation (or deprecated cluster) asked for; rows from a table
    without that column are kept, as nothing says they are elsewhere."""
    if settings.allocation:
        return tuple(p for p in listed if p.allocation in (None, settings.allocation))
    if settings.cluster:
        return tuple(p for p in listed if p.cluster in (None, settings.cluster))
    return listed


def _target_options(info: PartitionInfo, required: Requirements, own: dict[str, str],
                    log: Log) -> str:
    """The partition's target options under the environment's own (the user set those on
    purpose), logged as PopRun logs them."""
    implied = partition_target_options(info, required)
    if info.ipu_link_topology and info.ipu_link_topology.lower() not in TOPOLOGIES:
        log.warning(f"V-IPU partition {info.name} reports IPU-Link topology "
                    f"{info.ipu_link_topology[:40]!r}, which Poplar does not know: using "
                    f"{implied['ipuLinkTopology']!r}")
    log.debug(f"Target options from environment: {merged_target_options({}, own)}")
    log.debug(f"Target options from V-IPU partition: {merged_target_options(implied, {})}")
    merged = merged_target_options(implied, own)
    log.debug(f"Using target options: {merged}")
    return merged


class _Preparation:
    """One acquisition's steps on partition `name`; remembers whether it created it, so that
    a failure part-way can remove it again (`undo`)."""

    def __init__(self, runner: VipuRunner, settings: VipuSettings, required: Requirements,
                 name: str, log: Log) -> None:
        self.runner, self.settings, self.required = runner, settings, required
        self.name, self.log = name, log
        self.created = False

    async def prepare(self, existing: PartitionInfo | None) -> PartitionInfo:
        if existing is None:
            return await self._create()
        found = (await self._get()).completed_by(existing)
        self.log.info(f"Partition {self.name} already exists and is in state: "
                      f"{found.state_text or found.state.value}")
        problems = mismatches(self.required, found)
        if problems:
            return await self._update(problems)
        if should_reset(self.settings.reset_partition, found.reconfigurable):
            await self._command("reset", "partition", self.name)
            return await self._wait_active("reset")
        if found.state is PartitionState.ERROR:
            raise self._error_state(found, "")
        if found.state is not PartitionState.ACTIVE:
            return await self._wait_active("being found")
        kind = "reconfigurable" if found.reconfigurable else "non-reconfigurable"
        self.log.debug(f"The {kind} partition {self.name} is OK")
        return found

    async def undo(self) -> None:
        """Remove what this preparation created (after a failure or an interruption)."""
        if not self.created:
            return
        try:
            await self.runner.run("remove", "partition", self.name)
            self.log.info(f"removed V-IPU partition {self.name}, which poprun had created")
        except PoprunError as exc:
            self.log.warning(f"could not remove V-IPU partition {self.name}: {exc}; remove "
                             f"it with `vipu remove partition {self.name}`")

    async def _update(self, problems: list[str]) -> PartitionInfo:
        listed = "; ".join(problems)
        if not self.settings.update_partition:
            raise ConfigError(f"V-IPU partition {self.name} does not fit the job: {listed} "
                              "(--update-partition=yes re-creates it)")
        self.log.info(f"re-creating V-IPU partition {self.name}: {listed}")
        await self._command("remove", "partition", self.name)
        return await self._create()

    async def _create(self) -> PartitionInfo:
        argv = create_command(self.name, self.required, self.settings)
        # From here a failure or Ctrl-C removes the partition: a create that timed out or was
        # interrupted may have happened all the same.
        self.created = True
        try:
            await self.runner.run(*argv)
        except VipuError as exc:
            if exc.kind is not Failure.TIMED_OUT:
                self.created = False  # refused, or never reached the server
            if exc.kind is not Failure.FAILED:
                raise
            where = self.settings.allocation_or_cluster
            raise VipuError(
                f"could not create V-IPU partition {self.name} ({self.required.size} IPUs, "
                f"{self.required.num_gcds} GCDs{', allocation ' + where if where else ''}): "
                f"{exc}; the allocation may not have enough free IPUs matching the "
                "requirements: remove some partitions or ask for fewer IPUs",
                Failure.CREATE_FAILED, exc.command) from None
        self.log.info(f"created V-IPU partition {self.name}")
        return await self._wait_active("creation")

    async def _command(self, *argv: str) -> None:
        await self.runner.run(*argv)
        self.log.info(f"{argv[0]} partition {self.name}: done")

    async def _get(self) -> PartitionInfo:
        return parse_partition_details(self.name, await self.runner.run("get", "partition",
                                                                        self.name))

    async def _wait_active(self, after: str) -> PartitionInfo:
        """Poll `get partition` until ACTIVE, at most --vipu-partition-attempts times and
        within --vipu-server-timeout."""
        deadline = time.monotonic() + self.settings.server_timeout
        attempts = self.settings.partition_attempts
        polls = 0
        while True:
            found = await self._get()
            polls += 1
            if found.state is PartitionState.ACTIVE:
                self.log.debug(f"Done polling, final state of {self.name}: "
                               f"{found.state_text}")
                return found
            if found.state is PartitionState.ERROR:
                raise self._error_state(found, f" after {after}")
            out_of_time = time.monotonic() + self.settings.poll_interval > deadline
            if out_of_time or (attempts is not None and polls >= attempts):
                raise VipuError(
                    f"V-IPU partition {self.name} was not ACTIVE after {after} ({polls} polls "
                    f"in {seconds(self.settings.server_timeout)} s, last state "
                    f"{found.state_text or 'unknown'}); raise --vipu-server-timeout or "
                    "--vipu-partition-attempts if the server is just slow", Failure.NOT_READY)
            await asyncio.sleep(self.settings.poll_interval)

    def _error_state(self, found: PartitionInfo, after: str) -> VipuError:
        return VipuError(f"V-IPU partition {self.name} is in an error state "
                         f"({found.state_text}){after}; reset it with `vipu reset partition "
                         f"{self.name}` or run with --reset-partition=yes",
                         Failure.ERROR_STATE)
