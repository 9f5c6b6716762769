"""A PMIx server for this host's instances, through libpmix's public server API with ctypes
(docs/architecture.md, "The instances' worlds"): Open MPI's MPI_Init finds its world only
through one. Nothing of ours is compiled; the layouts and signatures below are OpenPMIx's
include/pmix_common.h and include/pmix_server.h (4.2 and 5.0: checked with sizeof/offsetof
against Debian's libpmix-dev 4.2.2 headers: pmix_proc_t 260 bytes, rank at 256;
pmix_info_t 552, flags at 512, value (32 bytes) at 520; the module's abort, fence_nb,
direct_modex and job_control at 16, 24, 32 and 152).

This runs only in the PMIx server's own process (spawner/worlds/pmixproc.py), never in poprun or
an agent: libpmix allows one server per process, once (PMIx_server_init again, after
PMIx_server_finalize or beside a running server, aborts the whole process), its thread can
wedge, and its fence tracker can be freed twice (docs/architecture.md). It runs its own
progress thread, and every upcall (the module's functions) arrives there: connected,
finalized and abort are told to the owner at once, by `post` on that thread (before the
client is released: its exit can never overtake them); fence, direct modex, publish, lookup,
unpublish, connect, disconnect and group copy what they need and are handed to the process's
main thread (`submit`), and the answer goes back later through the callback libpmix gave
(names go to the job's table, connect, disconnect and group are fences: docs/architecture.md,
"The instances' worlds"), and spawn goes to the launcher (pmi1spawn.request_from_pmix). Data
we hand libpmix (a fence's or a direct modex's result) must live until libpmix calls our
release function, so it is kept in `_held` until then. The process never calls
PMIx_server_finalize: it is killed instead.

What a namespace's keys are is planned in spawner/worlds/pmixplan.py (pure); what crosses hosts
is the owner's (spawner/worlds/pmixhost.py, and through it poprun/run/worlds/pmix.py and
spawner/worlds/nodeworld.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_int, c_size_t,
                    c_uint16, c_uint32, c_void_p)

from . import mpinames, pmixplan

from .pmixplan import (ERR_BAD_PARAM, ERR_NOT_FOUND, ERR_NOT_SUPPORTED, ERROR,
                       OPERATION_SUCCEEDED, SUCCESS)

# 28 functions in 4.2, 29 in 5.0; the table only grows at its end. Safe because only those
# versions are served: start() refuses any other before PMIx_server_init reads the table
# (spawner/worlds/pmixcheck.TESTED; a later one may have outgrown it).
MODULE_SLOTS = 32
# Indices in pmix_server_module_t.
_CONNECTED, _FINALIZED, _ABORT, _FENCE, _DMODEX, _SPAWN, _JOB_CONTROL = 0, 1, 2, 3, 4, 8, 19
_PUBLISH, _LOOKUP, _UNPUBLISH, _CONNECT, _DISCONNECT, _GROUP = 5, 6, 7, 9, 10, 25
# Upcalls not served, answered ERR_NOT_SUPPORTED at once and said to the owner (`unserved`,
# for poprun's -v): where the slot is left empty libpmix answers the same, but nobody hears
# of it. Only slots where an empty one means exactly that are here (an empty `query` slot,
# say, lets libpmix answer some queries itself).
UNSERVED_SLOTS: dict[int, str] = {}
GROUP_CONSTRUCT, GROUP_DESTRUCT = 0, 1  # pmix_group_operation_t


class Proc(Structure):
    _fields_ = [("nspace", c_char * 256), ("rank", c_uint32)]


class Info(Structure):
    # value: pmix_value_t (type u16 + a union), filled by PMIx_Info_load, never by us
    _fields_ = [("key", c_char * 512), ("flags", c_uint32), ("_pad", c_uint32),
                ("value", c_char * 32)]


class App(Structure):
    """pmix_app_t: one command of a PMIx_Spawn (its argv[0] is the command, as Open MPI's
    ompi_dpm_spawn fills it; env: "NAME=value" strings; both NULL-terminated)."""
    _fields_ = [("cmd", c_char_p), ("argv", POINTER(c_char_p)), ("env", POINTER(c_char_p)),
                ("cwd", c_char_p), ("maxprocs", c_int), ("info", POINTER(Info)),
                ("ninfo", c_size_t)]


assert ctypes.sizeof(Proc) == 260 and ctypes.sizeof(Info) == 552 and ctypes.sizeof(App) == 56

OP_CB = CFUNCTYPE(None, c_int, c_void_p)
RELEASE_CB = CFUNCTYPE(None, c_void_p)
MODEX_CB = CFUNCTYPE(None, c_int, c_void_p, c_size_t, c_void_p, RELEASE_CB, c_void_p)
INFO_CB = CFUNCTYPE(None, c_int, c_void_p, c_size_t, c_void_p, c_void_p, c_void_p)
DMODEX_RESPONSE = CFUNCTYPE(None, c_int, c_void_p, c_size_t, c_void_p)  # 4 arguments
LOOKUP_CB = CFUNCTYPE(None, c_int, c_void_p, c_size_t, c_void_p)

CONNECTED_FN = CFUNCTYPE(c_int, POINTER(Proc), c_void_p, c_void_p, c_void_p)
FINALIZED_FN = CFUNCTYPE(c_int, POINTER(Proc), c_void_p, c_void_p, c_void_p)
ABORT_FN = CFUNCTYPE(c_int, POINTER(Proc), c_void_p, c_int, c_char_p, POINTER(Proc), c_size_t,
                     c_void_p, c_void_p)
FENCE_FN = CFUNCTYPE(c_int, POINTER(Proc), c_size_t, POINTER(Info), c_size_t, c_void_p,
                     c_size_t, c_void_p, c_void_p)
DMODEX_FN = CFUNCTYPE(c_int, POINTER(Proc), POINTER(Info), c_size_t, c_void_p, c_void_p)
SPAWN_CB = CFUNCTYPE(None, c_int, c_char_p, c_void_p)  # status, the new namespace, cbdata
SPAWN_FN = CFUNCTYPE(c_int, POINTER(Proc), POINTER(Info), c_size_t, POINTER(App), c_size_t,
                     c_void_p, c_void_p)
JOB_CONTROL_FN = CFUNCTYPE(c_int, POINTER(Proc), POINTER(Proc), c_size_t, POINTER(Info),
                           c_size_t, c_void_p, c_void_p)
PUBLISH_FN = CFUNCTYPE(c_int, POINTER(Proc), POINTER(Info), c_size_t, c_void_p, c_void_p)
LOOKUP_FN = CFUNCTYPE(c_int, POINTER(Proc), POINTER(c_char_p), POINTER(Info), c_size_t,
                      c_void_p, c_void_p)  # unpublish's too
CONNECT_FN = CFUNCTYPE(c_int, POINTER(Proc), c_size_t, POINTER(Info), c_size_t, c_void_p,
                       c_void_p)  # disconnect's too
GROUP_FN = CFUNCTYPE(c_int, c_int, c_char_p, POINTER(Proc), c_size_t, POINTER(Info), c_size_t,
                     c_void_p, c_void_p)
# An upcall answered unserved reads none of its arguments: declared without them (the
# caller cleans up its arguments in the x86-64 and aarch64 C conventions).
UNSERVED_FN = CFUNCTYPE(c_int)


class DataArray(Structure):
    """pmix_data_array_t: its elements' type, their count, the array."""
    _fields_ = [("type", c_uint16), ("size", c_size_t), ("array", c_void_p)]


PMIX_INFO = 24  # pmix_data_type_t of an array of pmix_info_t


class Value(Structure):
    """pmix_value_t: its type, then an 8-aligned union (a string is a char *)."""
    _fields_ = [("type", c_uint16), ("_pad", c_char * 6), ("data", c_char * 24)]


class Pdata(Structure):
    """pmix_pdata_t (lookup's answer): proc, key[PMIX_MAX_KEYLEN + 1], value."""
    _fields_ = [("proc", Proc), ("key", c_char * 512), ("_pad", c_uint32), ("value", Value)]


assert ctypes.sizeof(Pdata) == 808 and Pdata.value.offset == 776

MAX_PROCS_IN_UPCALL = 1 << 20  # a fence over more procs than that is not one of ours
# What one spawn upcall is read for (a client's request, so hostile input): past these it is
# refused before anything is copied. Generous: spawner/worlds/pmi1spawn.py bounds it again.
MAX_APPS, MAX_STRINGS, MAX_STRING = 65, 8192, 1 << 20
MAX_INFOS_IN_UPCALL = 256  # a publish's data and directives (Open MPI's: 2 to 5)
MAX_KEYS_IN_UPCALL = 64  # the keys of a lookup or unpublish (Open MPI's: 1)
# Integer types an info's value may have (pmix_common.h: their width in bytes, signed)
_INTS = {4: (8, False), 6: (4, True), 7: (1, True), 8: (2, True), 9: (4, True),
         10: (8, True), 11: (4, False), 12: (1, False), 13: (2, False), 14: (4, False),
         15: (8, False), 30: (1, False), 33: (1, False)}  # 30: persistence, 33: range
PMIX_STRING, PMIX_BOOL, PMIX_BYTE_OBJECT, PMIX_SIZE, PMIX_PROC, PMIX_DATA_ARRAY = (
    3, 1, 27, 4, 22, 39)
# A published byte object (Open MPI's intercommunicator CID exchange) is kept in the job's
# table as this mark and its base64: a C string, which a string value is, never holds a NUL.
BYTES_MARK = "\0b64:"


def _published_bytes(port: str) -> bytes | None:
    """A table value's bytes where it is a byte object published through PMIx (the mark,
    then strict base64 of at most PMIX_PORT_MAX bytes); None for a string. The table is the
    job's, filled by any instance (PMI-1's too): a value that only looks marked is a string,
    never an exception on libpmix's callback."""
    if not port.startswith(BYTES_MARK):
        return None
    try:
        return pmixplan.decode_data(port[len(BYTES_MARK):], mpinames.PMIX_PORT_MAX)
    except ValueError:
        return None


PERSIST_FIRST_READ = 1  # pmix_persistence_t: the name goes with its first lookup


class PmixError(RuntimeError):
    pass


class Handler:
    """What a namespace's owner answers: fence and direct_modex in the main thread, the
    events (`event`) on libpmix's thread, at once."""

    def event(self, what: str, rank: int, *args) -> None:
        """"connected", "finalized" (rank), or "abort" (rank, status, message): an instance
        here called MPI_Abort (it is released at once and exits)."""

    def fence(self, fence: pmixplan.FenceId, data: bytes,
              done: Callable[[int, bytes], None]) -> None:
        """This host's instances all entered `fence` with `data`; call `done(status, all
        hosts' data)` once every host taking part has."""

    def direct_modex(self, rank: int, done: Callable[[int, bytes], None]) -> None:
        """An instance here wants `rank`'s data, which is on another host."""

    def spawn(self, rank: int, request: dict, done: Callable[[int, str], None]) -> None:
        """Rank `rank` here called PMIx_Spawn (MPI_Comm_spawn[_multiple]): `request` is
        `spawn_request`'s; `done(status, the new namespace)` once its processes started."""

    def name(self, request: NameRequest, done: Callable[[int, str], None]) -> None:
        """Publish, unpublish or look up one name in the job's table: `done(status, the
        port found)`."""

    def unserved(self, rank: int, what: str, why: str) -> None:
        """Rank `rank`'s request `what` was answered with an error at once (main thread)."""


class NameRequest(NamedTuple):
    """One name of an instance's PMIx_Publish, PMIx_Lookup or PMIx_Unpublish."""
    rank: int
    op: str  # "publish", "lookup" or "unpublish"
    service: str
    port: str = ""
    wait: float = 0.0  # a lookup waits this long for the name to be published
    once: bool = False  # a publish whose name goes with its first lookup


def info_items(array, count: int) -> list[tuple[str, object]]:
    """(key, value) of an info array from libpmix: strings, booleans, integers and byte
    objects; a value of another type is None. Raises ValueError for more than
    MAX_INFOS_IN_UPCALL, or a byte object past what the job's table takes."""
    if not array or count <= 0:
        return []
    if count > MAX_INFOS_IN_UPCALL:
        raise ValueError(f"{count} infos")
    items = []
    for i in range(count):
        info = array[i]
        value = Value.from_address(ctypes.addressof(info) + Info.value.offset)
        address = ctypes.addressof(value) + Value.data.offset
        if value.type == PMIX_STRING:
            raw = c_char_p.from_address(address).value
            data: object = raw.decode("utf-8", "replace") if raw is not None else ""
        elif value.type == PMIX_BOOL:
            data = bool(ctypes.c_bool.from_address(address).value)
        elif value.type == PMIX_BYTE_OBJECT:
            start, size = ctypes.c_void_p.from_address(address).value, c_size_t.from_address(
                address + 8).value
            if size > mpinames.PMIX_PORT_MAX:
                raise ValueError(f"{info.key[:64]!r}: a byte object of {size} bytes")
            data = ctypes.string_at(start, size) if start and size else b""
        elif value.type in _INTS:
            width, signed = _INTS[value.type]
            data = int.from_bytes(ctypes.string_at(address, width), "little", signed=signed)
        else:
            data = None
        items.append((info.key.decode("utf-8", "replace"), data))
    return items


def name_requests(op: str, rank: int, infos: list[tuple[str, object]],
                  keys: Sequence[str] = ()) -> list[NameRequest]:
    """The names an upcall asks about: a publish's data are its infos whose keys are not
    PMIx's own (`pmix.*`: its directives, and the uid libpmix adds); a lookup waits where
    PMIX_WAIT asks (PMIX_TIMEOUT long, or as long as the table allows). Raises ValueError
    for a value that is not a string (MPI's ports are)."""
    directives = {key: value for key, value in infos if key.startswith("pmix.")}
    if op == "publish":
        once = directives.get("pmix.persist") == PERSIST_FIRST_READ
        out = []
        for key, value in infos:
            if key.startswith("pmix."):
                continue
            if isinstance(value, bytes):
                value = BYTES_MARK + pmixplan.b64(value)
            elif not isinstance(value, str):
                raise ValueError(f"{key}: published values are strings or bytes here")
            out.append(NameRequest(rank, op, key, value, once=once))
        return _bounded(out)
    wait = 0.0
    if op == "lookup" and directives.get("pmix.wait") not in (None, False):
        timeout = directives.get("pmix.timeout")
        wait = (min(float(timeout), mpinames.LOOKUP_WAIT_MAX)
                if isinstance(timeout, int) and timeout > 0 else mpinames.LOOKUP_WAIT_MAX)
    return _bounded([NameRequest(rank, op, key, wait=wait) for key in keys])


def _bounded(requests: list[NameRequest]) -> list[NameRequest]:
    """Refused here, before anything crosses a link: a name or a value past the table's
    bounds (spawner/mpinames.py), which it would refuse."""
    for request in requests:
        if len(request.service) > mpinames.SERVICE_MAX or len(
                request.port) > mpinames.PMIX_PORT_MAX:
            raise ValueError(f"a name or a value past {mpinames.PMIX_PORT_MAX} characters")
    return requests


# Why the job's table refused a name (spawner/mpinames.py) -> the PMIx status the client gets
_NAME_STATUSES = {"service_not_found": ERR_NOT_FOUND, "lookup_timed_out": -24,  # TIMEOUT
                  "service_already_published": -53}  # PMIX_ERR_DUPLICATE_KEY


def name_status(rc: int, value: str) -> tuple[int, str]:
    """(PMIx status, the port) of the table's answer (rc 0 or 1, the port or why)."""
    if rc == 0:
        return SUCCESS, value
    return _NAME_STATUSES.get(value, ERROR), ""


def _string(ptr) -> str:
    raw = ctypes.string_at(ptr) if ptr else b""
    if len(raw) > MAX_STRING:
        raise ValueError("a string too long")
    return raw.decode("utf-8", "surrogateescape")


def _strings(array) -> list[str]:
    """A NULL-terminated char** as strings (at most MAX_STRINGS)."""
    out: list[str] = []
    while array and array[len(out)]:
        if len(out) >= MAX_STRINGS:
            raise ValueError("too many strings")
        out.append(_string(array[len(out)]))
    return out


def spawn_request(job_info, ninfo: int, apps, napps: int) -> dict:
    """A PMIx_Spawn's job info and apps, copied out of libpmix's memory: the JSON an agent's
    SPAWN_ASK carries (spawner/worlds/pmi1spawn.request_from_pmix checks it). Raises ValueError past
    the bounds above."""
    if napps > MAX_APPS:
        raise ValueError(f"{napps} apps")
    commands = []
    for i in range(napps if apps else 0):
        app = apps[i]
        commands.append({"cmd": _string(app.cmd), "argv": _strings(app.argv),
                         "env": _strings(app.env), "cwd": _string(app.cwd),
                         "maxprocs": int(app.maxprocs),
                         "info": _strings_of(info_items(app.info, int(app.ninfo)))})
    return {"apps": commands, "job_info": _strings_of(info_items(job_info, ninfo))}


def _strings_of(items: list[tuple[str, object]]) -> dict[str, str]:
    """The string-valued infos; others kept with an empty value (said ignored at -v, never
    acted on)."""
    return {key: value if isinstance(value, str) else "" for key, value in items}


class _Lib:
    """libpmix's server functions, with their C signatures."""

    def __init__(self, path: str) -> None:
        lib = self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # its plugins bind to it
        sig = {
            "PMIx_server_init": (c_int, [c_void_p, POINTER(Info), c_size_t]),
            "PMIx_server_finalize": (c_int, []),
            "PMIx_Info_load": (c_int, [POINTER(Info), c_char_p, c_void_p, c_uint16]),
            "PMIx_generate_regex": (c_int, [c_char_p, POINTER(c_void_p)]),
            "PMIx_generate_ppn": (c_int, [c_char_p, POINTER(c_void_p)]),
            "PMIx_server_register_nspace": (c_int, [c_char_p, c_int, POINTER(Info), c_size_t,
                                                    c_void_p, c_void_p]),
            "PMIx_server_deregister_nspace": (None, [c_char_p, c_void_p, c_void_p]),
            "PMIx_server_register_client": (c_int, [POINTER(Proc), c_uint32, c_uint32,
                                                    c_void_p, c_void_p, c_void_p]),
            "PMIx_server_setup_fork": (c_int, [POINTER(Proc), POINTER(POINTER(c_char_p))]),
            "PMIx_server_dmodex_request": (c_int, [POINTER(Proc), DMODEX_RESPONSE, c_void_p]),
            "PMIx_Get_version": (c_char_p, []),
        }
        for name, (restype, argtypes) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)


def _checked_lib(path: str) -> _Lib:
    """libpmix loaded, every function there, of a version whose layouts and module table
    are those above (the user-facing check ran earlier, in a process of its own:
    spawner/worlds/pmixcheck.py)."""
    from . import pmixcheck

    try:
        lib = _Lib(path)
    except (OSError, AttributeError) as exc:
        raise PmixError(f"{path}: not a libpmix to serve with: {exc}") from None
    problem = pmixcheck.version_problem(lib.PMIx_Get_version().decode("ascii", "replace"))
    if problem is not None:
        raise PmixError(f"{path}: {problem}")
    return lib


def _infos(keys: Sequence[pmixplan.Key], lib: _Lib):
    """An array of pmix_info_t holding `keys`, filled by libpmix itself (its strings are
    libpmix's copies, released with the namespace's data or never: a few hundred bytes per
    namespace, where 4.2 exports no destructor)."""
    array = (Info * max(1, len(keys)))()
    for info, key in zip(array, keys):
        if key.type == PMIX_DATA_ARRAY:  # of infos or of procs (libpmix copies it whole)
            data = ctypes.cast(ctypes.pointer(_data_array(key.value, lib)), c_void_p)
        elif key.type == pmixplan.PMIX_STRING:
            data = ctypes.cast(c_char_p(str(key.value).encode()), c_void_p)
        elif key.type == pmixplan.PMIX_BOOL:
            data = ctypes.cast(ctypes.pointer(ctypes.c_bool(bool(key.value))), c_void_p)
        elif key.type == PMIX_SIZE:
            data = ctypes.cast(ctypes.pointer(c_size_t(int(key.value))), c_void_p)
        elif key.type == pmixplan.PMIX_UINT16:
            data = ctypes.cast(ctypes.pointer(c_uint16(int(key.value))), c_void_p)
        else:  # every other type we use is 32-bit unsigned
            data = ctypes.cast(ctypes.pointer(c_uint32(int(key.value))), c_void_p)
        rc = lib.PMIx_Info_load(ctypes.byref(info), key.key.encode(), data, key.type)
        if rc != SUCCESS:
            raise PmixError(f"PMIx_Info_load({key.key}): status {rc}")
    return array


def _data_array(values: Sequence, lib: _Lib) -> DataArray:
    """A pmix_data_array_t of `values`: keys (pmixplan.Key, a spawned world's per-rank data)
    as infos, else (namespace, rank) pairs (a group's members) as procs."""
    if values and isinstance(values[0], pmixplan.Key):
        kind, backing = PMIX_INFO, _infos(values, lib)
    else:
        kind, backing = PMIX_PROC, (Proc * max(1, len(values)))(*(_proc(*p) for p in values))
    array = DataArray(kind, len(values), ctypes.cast(backing, c_void_p))
    array.backing = backing  # alive until libpmix has copied it (the caller's Info_load)
    return array


def _proc(nspace: str, rank: int) -> Proc:
    return Proc(nspace.encode(), rank)


def _procs(array, count: int) -> list[tuple[str, int]]:
    if not array or count > MAX_PROCS_IN_UPCALL:
        return []
    return [(array[i].nspace.decode("utf-8", "replace"), array[i].rank) for i in range(count)]


def _guarded(upcall):
    """An upcall that answers PMIX_ERROR where it fails: ctypes would print the exception
    and return 0, SUCCESS, and the client would wait for a callback that never comes."""
    def guarded(*args):
        try:
            return upcall(*args)
        except Exception:  # noqa: BLE001 - nothing can be raised into C
            return ERROR
    return guarded


class PmixServer:
    """This process's PMIx server: started with `start()` before the instances that use it
    are spawned, one `Namespace` per world. `submit(fn, *args)` runs fn in the process's
    main thread, where every other call of this class is made."""

    def __init__(self, path: str, tmpdir: str, hostname: str,
                 submit: Callable[..., None]) -> None:
        self.path, self.tmpdir, self.hostname, self.submit = path, tmpdir, hostname, submit
        self._lib: _Lib | None = None
        self._namespaces: dict[str, Namespace] = {}
        self._held: dict[int, object] = {}  # what libpmix still reads, until it releases it
        self._ids = itertools.count(1)
        self._crossings = pmixplan.FenceCounter()  # connects over several namespaces, by sets
        self._callbacks = self._make_callbacks()
        self._module = (c_void_p * MODULE_SLOTS)()
        for slot, fn in ((_CONNECTED, "connected"), (_FINALIZED, "finalized"),
                         (_ABORT, "abort"), (_FENCE, "fence"), (_DMODEX, "dmodex"),
                         (_SPAWN, "spawn"), (_JOB_CONTROL, "job_control"),
                         (_PUBLISH, "publish"), (_LOOKUP, "lookup"), (_UNPUBLISH, "unpublish"),
                         (_CONNECT, "connect"), (_DISCONNECT, "disconnect"),
                         (_GROUP, "group"),
                         *UNSERVED_SLOTS.items()):
            self._module[slot] = ctypes.cast(self._callbacks[fn], c_void_p)

    @property
    def version(self) -> str:
        return self._lib.PMIx_Get_version().decode() if self._lib else ""

    def start(self) -> None:
        """Load libpmix and start its server (its progress thread: the process must not
        fork Python after this). SERVER_MCA must be in the environment: libpmix reads its
        parameters there."""
        lib = _checked_lib(self.path)
        infos = _infos([pmixplan.Key("pmix.srvr.tmpdir", pmixplan.PMIX_STRING, self.tmpdir),
                        pmixplan.Key("pmix.sys.tmpdir", pmixplan.PMIX_STRING, self.tmpdir),
                        pmixplan.Key("pmix.hname", pmixplan.PMIX_STRING, self.hostname)], lib)
        rc = lib.PMIx_server_init(ctypes.cast(self._module, c_void_p), infos, len(infos))
        if rc != SUCCESS:
            raise PmixError(f"PMIx_server_init: status {rc}")
        self._lib = lib

    def open(self, world: pmixplan.World, handler: Handler) -> Namespace:
        """Register `world`'s namespace (its ranks on this host are served here)."""
        if self._lib is None:
            raise PmixError("the PMIx server is not started")
        ns = Namespace(self, world, handler)
        self._namespaces[world.nspace] = ns
        ns.register()
        return ns

    # --- libpmix's thread -> the main thread ---------------------------------------------

    def _hold(self, obj: object) -> int:
        key = next(self._ids)
        self._held[key] = obj
        return key

    def _make_callbacks(self) -> dict[str, object]:
        # Each runs on libpmix's progress thread: copy, hand over, return. An exception
        # here could not be raised into C; every path returns a status.
        def connected(proc, _obj, _cb, _cbdata):
            self._event("connected", proc[0].nspace.decode(), proc[0].rank)
            return OPERATION_SUCCEEDED  # done now (5.0 waits for a callback after SUCCESS)

        def finalized(proc, _obj, _cb, _cbdata):
            self._event("finalized", proc[0].nspace.decode(), proc[0].rank)
            return OPERATION_SUCCEEDED

        def abort(proc, _obj, status, msg, _targets, _ntargets, _cb, _cbdata):
            self._event("abort", proc[0].nspace.decode(), proc[0].rank,
                        int(status), (msg or b"")[:4096].decode("utf-8", "replace"))
            return OPERATION_SUCCEEDED  # the client is released; Open MPI then exits

        def fence(procs, nprocs, _info, _ninfo, data, ndata, cb, cbdata):
            blob = ctypes.string_at(data, ndata) if data and ndata else b""
            self.submit(self._fence, _procs(procs, nprocs), blob, cb, cbdata)
            return SUCCESS

        def dmodex(proc, _info, _ninfo, cb, cbdata):
            self.submit(self._dmodex, proc[0].nspace.decode(), proc[0].rank, cb, cbdata)
            return SUCCESS

        def spawn(proc, job_info, ninfo, apps, napps, cb, cbdata):
            try:  # copied now: libpmix frees them when we return
                request = spawn_request(job_info, ninfo, apps, napps)
            except ValueError as exc:  # refused at once, and said (-v)
                self.submit(self._unserved, proc[0].nspace.decode(), proc[0].rank, "spawn",
                            f"refused unread: {exc}")
                return ERR_BAD_PARAM
            self.submit(self._spawn, proc[0].nspace.decode(), proc[0].rank, request, cb,
                        cbdata)
            return SUCCESS

        def job_control(*_args):
            # Present so libpmix accepts its clients' cleanup registrations (Open MPI 5's
            # /dev/shm segments are removed at their exit); the control itself: not ours.
            return ERR_NOT_SUPPORTED

        def publish(proc, info, ninfo, cb, cbdata):
            try:
                requests = name_requests("publish", proc[0].rank, info_items(info, ninfo))
            except ValueError as exc:
                self.submit(self._unserved, proc[0].nspace.decode(), proc[0].rank,
                            "publish", str(exc))
                return ERR_BAD_PARAM
            self.submit(self._names, proc[0].nspace.decode(), requests, OP_CB(cb), cbdata)
            return SUCCESS

        def lookup_or_unpublish(op):
            def upcall(proc, keys, info, ninfo, cb, cbdata):
                names = []
                while keys and keys[len(names)] is not None:
                    if len(names) == MAX_KEYS_IN_UPCALL:
                        return ERR_BAD_PARAM
                    names.append(keys[len(names)].decode("utf-8", "replace"))
                try:
                    requests = name_requests(op, proc[0].rank, info_items(info, ninfo), names)
                except ValueError:
                    return ERR_BAD_PARAM
                answer = LOOKUP_CB(cb) if op == "lookup" else OP_CB(cb)
                self.submit(self._names, proc[0].nspace.decode(), requests, answer, cbdata)
                return SUCCESS
            return upcall

        def connect_or_disconnect(op):
            def upcall(procs, nprocs, _info, _ninfo, cb, cbdata):
                self.submit(self._connect, op, _procs(procs, nprocs), cb, cbdata)
                return SUCCESS
            return upcall

        def group(op, grp, procs, nprocs, info, ninfo, cb, cbdata):
            members = _procs(procs, nprocs)
            try:
                flags = {key for key, value in info_items(info, ninfo)
                         if key in ("pmix.grp.lcl", "pmix.grp.actxid") and value is not False}
            except ValueError:
                flags = set()
            assign = "pmix.grp.actxid" in flags and op == GROUP_CONSTRUCT
            if op == GROUP_DESTRUCT and ("pmix.grp.lcl" in flags or self._all_here(members)):
                return OPERATION_SUCCEEDED  # libpmix holds this host's group itself
            self.submit(self._group, int(op), (grp or b"").decode("utf-8", "replace"),
                        members, assign, cb, cbdata)
            return SUCCESS

        def unserved(what):
            def upcall():
                self.submit(self._unserved, None, None, what, "poprun does not serve it")
                return ERR_NOT_SUPPORTED
            return upcall

        def op_done(_status, _cbdata):
            pass

        def release(cbdata):
            self._held.pop(cbdata or 0, None)

        def dmodex_response(status, data, size, cbdata):
            blob = ctypes.string_at(data, size) if data and size else b""  # freed on return
            done = self._held.pop(cbdata or 0, None)
            if done is not None:
                self.submit(done, int(status), blob)

        return {"connected": CONNECTED_FN(connected), "finalized": FINALIZED_FN(finalized),
                "abort": ABORT_FN(abort), "fence": FENCE_FN(fence),
                "dmodex": DMODEX_FN(dmodex), "spawn": SPAWN_FN(spawn),
                "job_control": JOB_CONTROL_FN(job_control),
                "release": RELEASE_CB(release), "dmodex_response": DMODEX_RESPONSE(dmodex_response),
                "op_done": OP_CB(op_done), "publish": PUBLISH_FN(_guarded(publish)),
                "lookup": LOOKUP_FN(_guarded(lookup_or_unpublish("lookup"))),
                "unpublish": LOOKUP_FN(_guarded(lookup_or_unpublish("unpublish"))),
                "connect": CONNECT_FN(_guarded(connect_or_disconnect("connect"))),
                "disconnect": CONNECT_FN(_guarded(connect_or_disconnect("disconnect"))),
                "group": GROUP_FN(_guarded(group)),
                **{what: UNSERVED_FN(unserved(what)) for what in UNSERVED_SLOTS.values()}}

    def _event(self, what: str, nspace: str, rank: int, *args) -> None:
        ns = self._namespaces.get(nspace)  # a dict read: safe beside the main thread's writes
        if ns is not None:
            ns.handler.event(what, rank, *args)

    # --- in the main thread -------------------------------------------------------------

    def _fence(self, procs: list[tuple[str, int]], data: bytes, cb: int, cbdata: int) -> None:
        self._collective(procs, "fence", lambda status, _fence, blob: self._modex_answer(
            cb, cbdata, status, blob), data)

    def _unserved(self, nspace: str | None, rank: int | None, what: str, why: str) -> None:
        """Said to the namespace's owner (the first one's where the upcall names none)."""
        ns = self._namespaces.get(nspace) if nspace is not None else next(
            iter(self._namespaces.values()), None)
        if ns is not None:
            ns.handler.unserved(rank if rank is not None else ns.world.local_ranks[0],
                                what, why)

    def _names(self, nspace: str, requests: list[NameRequest], answer, cbdata: int) -> None:
        """Each name asked of the job's table in turn; the first failure is the answer (a
        lookup's: what was found, NOT_FOUND where nothing was)."""
        ns = self._namespaces.get(nspace)
        found: list[tuple[str, str]] = []
        pending = list(requests)

        def finish(status: int) -> None:
            if isinstance(answer, LOOKUP_CB):
                if status == SUCCESS and not found:
                    status = ERR_NOT_FOUND
                self._lookup_answer(answer, cbdata, status, nspace, found)
            else:
                answer(status, cbdata)

        def next_one(status: int = SUCCESS, port: str = "") -> None:
            if status != SUCCESS:
                finish(status)
                return
            if port and request.op == "lookup":
                found.append((request.service, port))
            if not pending:
                finish(SUCCESS)
                return
            step(pending.pop(0))

        def step(this: NameRequest) -> None:
            nonlocal request
            request = this
            ns.handler.name(this, next_one)

        request = None
        if ns is None or not requests:
            finish(ERR_NOT_FOUND if ns is None else ERR_BAD_PARAM)
            return
        next_one()

    def _lookup_answer(self, answer, cbdata: int, status: int, nspace: str,
                       found: list[tuple[str, str]]) -> None:
        """libpmix packs the answer before the callback returns: what it reads lives that
        long. Each pdata's proc is the asker's namespace (the table keeps no publisher)."""
        data = (Pdata * max(1, len(found)))()
        keep = []
        for pdata, (service, port) in zip(data, found):
            pdata.proc = _proc(nspace, pmixplan.WILDCARD)
            pdata.key = service.encode()[:511]
            address = ctypes.addressof(pdata) + Pdata.value.offset + Value.data.offset
            raw = _published_bytes(port)
            if raw is not None:
                pdata.value.type = PMIX_BYTE_OBJECT
                c_size_t.from_address(address + 8).value = len(raw)
            else:
                raw = port.replace("\0", "").encode() + b"\0"
                pdata.value.type = PMIX_STRING
            text = ctypes.create_string_buffer(raw, max(1, len(raw)))
            keep.append(text)
            c_void_p.from_address(address).value = ctypes.addressof(text)
        answer(status, ctypes.cast(data, c_void_p) if found else None, len(found), cbdata)
        del keep

    def _connect(self, op: str, procs: list[tuple[str, int]], cb: int, cbdata: int) -> None:
        """PMIx_Connect and PMIx_Disconnect whose procs are on several hosts (libpmix
        completes those of one host itself): a fence with no data over their ranks, once
        this host's are all in; over several namespaces, the job's (docs/architecture.md,
        "The instances' worlds"). One naming a namespace this host's server does not hold
        is not served here."""
        self._collective(procs, op, lambda status, _fence, _blob: OP_CB(cb)(status, cbdata))

    def _collective(self, procs: list[tuple[str, int]], what: str,
                    done: Callable[[int, pmixplan.FenceId | None, bytes], None],
                    data: bytes = b"") -> None:
        """A fence over `procs` (a connect's or group's: with no data), of one namespace or
        several (Open MPI 4.1's MPI_Comm_disconnect is a fence over both sides):
        `done(status, the fence, every host's data)` once every host holding one of them
        has entered it (an error at once, said for -v, where it cannot be served here)."""
        ns = self._namespaces.get(procs[0][0]) if procs else None
        ranks = pmixplan.fence_ranks(procs, ns.world) if ns is not None else None
        if ranks is not None:
            fence = ns.upcoming(ranks)
            ns.fence(ranks, data, lambda status, blob: done(status, fence, blob))
            return
        sets = pmixplan.connect_sets(procs, {name: served.world for name, served
                                             in self._namespaces.items()})
        if isinstance(sets, str):
            self._unserved(*self._member_here(procs), what,
                           f"its {len(procs)} processes: {sets}")
            done(ERR_NOT_SUPPORTED, None, b"")
            return
        fence = pmixplan.FenceId((), self._crossings.next(sets).seq, sets)
        hosts = {self._namespaces[name].world.names[self._namespaces[name].world.nodes[r]]
                 for name, ranks in sets for r in ranks}
        if len(hosts) == 1:  # every participant is here: nobody else takes part
            done(SUCCESS, fence, data)
            return
        link = self._link_of(sets)
        fence = fence._replace(ranks=dict(sets)[link])
        self._namespaces[link].handler.fence(fence, data,
                                             lambda status, blob: done(status, fence, blob))

    def _link_of(self, sets) -> str:
        """The namespace whose link a connect over `sets` goes up: the first with a
        participant here (the launcher checks that it has one)."""
        return next(name for name, ranks in sets if any(
            self._namespaces[name].world.nodes[r] == self._namespaces[name].world.here
            for r in ranks))

    def _member_here(self, procs: list[tuple[str, int]]) -> tuple[str | None, int | None]:
        """The first of `procs` (a wildcard: its namespace's ranks) that is an instance of
        this host (who asked, for -v and a group's context ID), or (None, None)."""
        for nspace, rank in procs:
            ns = self._namespaces.get(nspace)
            if ns is None:
                continue
            w = ns.world
            for r in range(w.size) if rank == pmixplan.WILDCARD else (rank,):
                if 0 <= r < w.size and w.nodes[r] == w.here:
                    return nspace, r
        return None, None

    def _all_here(self, procs: list[tuple[str, int]]) -> bool:
        """Whether every one of `procs` is an instance of this host (a dict read: safe on
        libpmix's thread)."""
        for nspace, rank in procs:
            ns = self._namespaces.get(nspace)
            if ns is None or (rank != pmixplan.WILDCARD and not (
                    0 <= rank < ns.world.size and ns.world.nodes[rank] == ns.world.here)):
                return False
            if rank == pmixplan.WILDCARD and len(set(ns.world.nodes)) > 1:
                return False
        return bool(procs)

    def _group(self, op: int, grp: str, procs: list[tuple[str, int]], assign: bool, cb: int,
               cbdata: int) -> None:
        """A PMIx group of one namespace's instances (MPI_Comm_create_from_group,
        MPI_Intercomm_create_from_groups): a fence with no data over their ranks (the
        hosts holding none of them take no part), then, where asked, the group's context
        ID, one per group of the job, from the launcher's table (spawner/worlds/mpinames.py).
        Over several namespaces, the job's fence (`_collective`). One that cannot be served
        here is answered with an error through the callback, which every local member
        waiting gets at once (an error the upcall returned would reach only the last to
        arrive, the others waiting for good)."""
        def answer(status: int, ctxid: int | None = None) -> None:
            # A construct's answer names its members (libpmix's client cannot read one
            # without them) and its context ID where one was asked for
            keys = [] if status != SUCCESS or op != GROUP_CONSTRUCT else [
                pmixplan.Key("pmix.grp.mbrs", PMIX_DATA_ARRAY, procs),
                *([pmixplan.Key("pmix.grp.ctxid", PMIX_SIZE, ctxid)] if ctxid else [])]
            infos = _infos(keys, self._lib) if keys and self._lib is not None else None
            key = self._hold(infos)  # libpmix reads them on its thread, then releases them
            INFO_CB(cb)(status, ctypes.cast(infos, c_void_p) if infos is not None else None,
                        len(keys) if infos is not None else 0, cbdata,
                        self._callbacks["release"], key)

        asker = self._member_here(procs)

        def fenced(status: int, fence: pmixplan.FenceId | None, _blob: bytes) -> None:
            if status != SUCCESS or not assign:
                answer(status)
                return
            # The same on every host of the group: its namespaces, tag, members and number
            same = fence._replace(ranks=()) if fence.sets else fence  # not the link's
            key = hashlib.sha1(repr((sorted({n for n, _ in procs}), grp, same)).encode()
                               ).hexdigest()
            if asker[0] is None:
                answer(ERROR)
                return
            self._namespaces[asker[0]].handler.name(
                NameRequest(asker[1], "context", f"group:{key}"),
                lambda status, port: answer(status, int(port) if status == SUCCESS else None))

        self._collective(procs, "group construct" if op == GROUP_CONSTRUCT
                         else "group destruct", fenced)

    def _dmodex(self, nspace: str, rank: int, cb: int, cbdata: int) -> None:
        ns = self._namespaces.get(nspace)
        if ns is None or not 0 <= rank < ns.world.size:
            self._modex_answer(cb, cbdata, ERR_NOT_FOUND, b"")
            return
        ns.handler.direct_modex(rank, lambda status, blob: self._modex_answer(cb, cbdata,
                                                                             status, blob))

    def _spawn(self, nspace: str, rank: int, request: dict, cb: int, cbdata: int) -> None:
        ns = self._namespaces.get(nspace)

        def done(status: int, child: str) -> None:
            if self._lib is not None:  # libpmix copies the name
                SPAWN_CB(cb)(status, child.encode() if status == SUCCESS else None, cbdata)

        if ns is None or not 0 <= rank < ns.world.size:
            done(ERR_NOT_SUPPORTED, "")
            return
        ns.handler.spawn(rank, request, done)

    def _modex_answer(self, cb: int, cbdata: int, status: int, blob: bytes) -> None:
        if self._lib is None:
            return
        buf = ctypes.create_string_buffer(blob, len(blob)) if blob else None
        key = self._hold(buf)
        MODEX_CB(cb)(status, ctypes.cast(buf, c_void_p) if buf else None, len(blob), cbdata,
                     self._callbacks["release"], key)

    def dmodex_request(self, nspace: str, rank: int,
                       done: Callable[[int, bytes], None]) -> None:
        """Another host asks for local `rank`'s data: `done(status, data)` once libpmix has
        it (when that instance has put it: the request waits)."""
        if self._lib is None:
            done(ERROR, b"")
            return
        proc = _proc(nspace, rank)
        key = self._hold(done)
        rc = self._lib.PMIx_server_dmodex_request(ctypes.byref(proc),
                                                  self._callbacks["dmodex_response"], key)
        if rc != SUCCESS:
            self._held.pop(key, None)
            done(rc, b"")


# The server's own security mode: "native" (over TCP it trusts the uid a client claims: who
# may connect at all is spawner/worlds/pmixgate.py's); under munge libpmix would otherwise offer a
# mode the wheel's client complains about. Its data store: "hash" only, not the shared
# memory one (ds21/ds12, 4.2's default) under which a rank's get for a peer on its host that
# committed just then could be answered "not found" (docs/architecture.md, "The instances'
# worlds"). Set in the server process's environment (spawner/worlds/pmixproc.py): libpmix reads its
# MCA parameters there, and tells its clients which stores it has (setup_fork).
SERVER_MCA = {"PMIX_MCA_psec": "native", "PMIX_MCA_gds": "hash"}


class Namespace:
    """One world's namespace on this host's server: its clients' environments and fences."""

    def __init__(self, server: PmixServer, world: pmixplan.World, handler: Handler) -> None:
        self.server, self.world, self.handler = server, world, handler
        self._fences = pmixplan.FenceCounter()
        self._open = False

    def register(self) -> None:
        lib = self.server._lib
        node_map = self._generate(lib.PMIx_generate_regex, pmixplan.regex_input(self.world))
        proc_map = self._generate(lib.PMIx_generate_ppn, pmixplan.ppn_input(self.world))
        infos = _infos(pmixplan.job_keys(self.world, node_map, proc_map,
                                          self.server.tmpdir), lib)
        rc = lib.PMIx_server_register_nspace(self.world.nspace.encode(),
                                             len(self.world.local_ranks), infos, len(infos),
                                             None, None)  # no callback: it blocks, briefly
        if rc not in (SUCCESS, OPERATION_SUCCEEDED):
            raise PmixError(f"PMIx_server_register_nspace: status {rc}")
        self._open = True

    def _generate(self, fn, text: str) -> str:
        out = c_void_p()
        rc = fn(text.encode(), ctypes.byref(out))
        if rc != SUCCESS or not out.value:
            raise PmixError(f"{fn.__name__}: status {rc}")
        return ctypes.string_at(out.value).decode()

    def client_env(self, rank: int) -> dict[str, str]:
        """Register `rank` as a client of this user and the variables that lead it here
        (setup_fork's PMIX_*), for an instance about to be spawned."""
        lib = self.server._lib
        proc = _proc(self.world.nspace, rank)
        rc = lib.PMIx_server_register_client(ctypes.byref(proc), os.getuid(), os.getgid(),
                                             None, None, None)
        if rc not in (SUCCESS, OPERATION_SUCCEEDED):
            raise PmixError(f"PMIx_server_register_client: status {rc}")
        env = POINTER(c_char_p)()
        rc = lib.PMIx_server_setup_fork(ctypes.byref(proc), ctypes.byref(env))
        if rc != SUCCESS:
            raise PmixError(f"PMIx_server_setup_fork: status {rc}")
        out: dict[str, str] = {}
        i = 0
        while env and env[i]:
            key, _, value = env[i].decode().partition("=")
            out[key] = value
            i += 1
        return out

    def upcoming(self, ranks: tuple[int, ...]) -> pmixplan.FenceId:
        """What the next fence over `ranks` is called, on every host."""
        return self._fences.peek(ranks)

    def fence(self, ranks: tuple[int, ...], data: bytes,
              done: Callable[[int, bytes], None]) -> None:
        """A fence (or a connect, a disconnect, a group: one with no data) over `ranks`,
        numbered as every host numbers it."""
        fence = self._fences.next(ranks)
        if pmixplan.hosts_of(ranks, self.world) == {self.world.here}:
            done(SUCCESS, data)  # nobody else takes part: this host's data is all of it
        else:
            self.handler.fence(fence, data, done)

    def close(self) -> None:
        if self._open and self.server._lib is not None:
            self._open = False
            # With a callback it does not wait for libpmix's thread (~10-20 ms otherwise).
            self.server._lib.PMIx_server_deregister_nspace(
                self.world.nspace.encode(), ctypes.cast(self.server._callbacks["op_done"],
                                                        c_void_p), None)
        self.server._namespaces.pop(self.world.nspace, None)
