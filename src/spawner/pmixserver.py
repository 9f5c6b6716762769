"""A PMIx server for this host's instances, through libpmix's public server API with ctypes
(docs/architecture.md, "The instances' worlds"): Open MPI's MPI_Init finds its world only
through one. Nothing of ours is compiled; the layouts and signatures below are OpenPMIx's
include/pmix_common.h and include/pmix_server.h (4.2 and 5.0: checked with sizeof/offsetof
against Debian's libpmix-dev 4.2.2 headers: pmix_proc_t 260 bytes, rank at 256;
pmix_info_t 552, flags at 512, value (32 bytes) at 520; the module's abort, fence_nb,
direct_modex and job_control at 16, 24, 32 and 152).

This runs only in the PMIx server's own process (spawner/pmixproc.py), never in poprun or
an agent: libpmix allows one server per process, once (PMIx_server_init again, after
PMIx_server_finalize or beside a running server, aborts the whole process), its thread can
wedge, and its fence tracker can be freed twice (docs/architecture.md). It runs its own
progress thread, and every upcall (the module's functions) arrives there: connected,
finalized and abort are told to the owner at once, by `post` on that thread (before the
client is released: its exit can never overtake them); fence and direct modex copy what they
need and are handed to the process's main thread (`submit`), and the answer goes back later
through the callback libpmix gave. Data we hand libpmix (a fence's or a direct modex's
result) must live until libpmix calls our release function, so it is kept in `_held` until
then. The process never calls PMIx_server_finalize: it is killed instead.

What a namespace's keys are is planned in spawner/pmixplan.py (pure); what crosses hosts
is the owner's (spawner/pmixhost.py, and through it poprun/run/pmixworld.py and
spawner/agentworld.py).
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Callable, Sequence
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char, c_char_p, c_int, c_size_t,
                    c_uint16, c_uint32, c_void_p)

from . import pmixplan

SUCCESS, ERROR, ERR_NOT_SUPPORTED, ERR_NOT_FOUND, ERR_BAD_PARAM = 0, -1, -47, -46, -27
OPERATION_SUCCEEDED = -157  # an upcall that finished at once
# 28 functions in 4.2, 29 in 5.0; the table only grows at its end. Safe because only those
# versions are served: start() refuses any other before PMIx_server_init reads the table
# (spawner/pmixcheck.TESTED; a later one may have outgrown it).
MODULE_SLOTS = 32
# Indices in pmix_server_module_t.
_CONNECTED, _FINALIZED, _ABORT, _FENCE, _DMODEX, _SPAWN, _JOB_CONTROL = 0, 1, 2, 3, 4, 8, 19


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

MAX_PROCS_IN_UPCALL = 1 << 20  # a fence over more procs than that is not one of ours
# What one spawn upcall is read for (a client's request, so hostile input): past these it is
# refused before anything is copied. Generous: spawner/pmispawn.py bounds it again.
MAX_APPS, MAX_STRINGS, MAX_INFOS, MAX_STRING = 65, 8192, 256, 1 << 20
PMIX_STRING_TYPE = 3


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


def _info_strings(array, count: int) -> dict[str, str]:
    """The string-valued keys of a pmix_info_t array (pmix_value_t: its type, a uint16, at
    its start, the union 8 bytes in: a char* for PMIX_STRING); keys of other types are
    kept with an empty value (said ignored at -v, never acted on)."""
    if count > MAX_INFOS:
        raise ValueError("too many info keys")
    out: dict[str, str] = {}
    for i in range(count if array else 0):
        info = array[i]
        key = info.key.decode("utf-8", "replace")
        value = ctypes.addressof(info) + Info.value.offset
        kind = ctypes.c_uint16.from_address(value).value
        out[key] = (_string(c_char_p.from_address(value + 8).value)
                    if kind == PMIX_STRING_TYPE else "")
    return out


def spawn_request(job_info, ninfo: int, apps, napps: int) -> dict:
    """A PMIx_Spawn's job info and apps, copied out of libpmix's memory: the JSON an agent's
    SPAWN_ASK carries (spawner/pmispawn.request_from_pmix checks it). Raises ValueError past
    the bounds above."""
    if napps > MAX_APPS:
        raise ValueError(f"{napps} apps")
    commands = []
    for i in range(napps if apps else 0):
        app = apps[i]
        commands.append({"cmd": _string(app.cmd), "argv": _strings(app.argv),
                         "env": _strings(app.env), "cwd": _string(app.cwd),
                         "maxprocs": int(app.maxprocs),
                         "info": _info_strings(app.info, int(app.ninfo))})
    return {"apps": commands, "job_info": _info_strings(job_info, ninfo)}


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
    spawner/pmixcheck.py)."""
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
        if key.type == pmixplan.PMIX_STRING:
            data = ctypes.cast(c_char_p(str(key.value).encode()), c_void_p)
        elif key.type == pmixplan.PMIX_BOOL:
            data = ctypes.cast(ctypes.pointer(ctypes.c_bool(bool(key.value))), c_void_p)
        else:  # every other type we use is 32-bit unsigned
            data = ctypes.cast(ctypes.pointer(c_uint32(int(key.value))), c_void_p)
        rc = lib.PMIx_Info_load(ctypes.byref(info), key.key.encode(), data, key.type)
        if rc != SUCCESS:
            raise PmixError(f"PMIx_Info_load({key.key}): status {rc}")
    return array


def _proc(nspace: str, rank: int) -> Proc:
    return Proc(nspace.encode(), rank)


def _procs(array, count: int) -> list[tuple[str, int]]:
    if not array or count > MAX_PROCS_IN_UPCALL:
        return []
    return [(array[i].nspace.decode("utf-8", "replace"), array[i].rank) for i in range(count)]


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
        self._callbacks = self._make_callbacks()
        self._module = (c_void_p * MODULE_SLOTS)()
        for slot, fn in ((_CONNECTED, "connected"), (_FINALIZED, "finalized"),
                         (_ABORT, "abort"), (_FENCE, "fence"), (_DMODEX, "dmodex"),
                         (_SPAWN, "spawn"), (_JOB_CONTROL, "job_control")):
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
            except ValueError:
                return ERR_BAD_PARAM
            self.submit(self._spawn, proc[0].nspace.decode(), proc[0].rank, request, cb,
                        cbdata)
            return SUCCESS

        def job_control(*_args):
            # Present so libpmix accepts its clients' cleanup registrations (Open MPI 5's
            # /dev/shm segments are removed at their exit); the control itself: not ours.
            return ERR_NOT_SUPPORTED

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
                "op_done": OP_CB(op_done)}

    def _event(self, what: str, nspace: str, rank: int, *args) -> None:
        ns = self._namespaces.get(nspace)  # a dict read: safe beside the main thread's writes
        if ns is not None:
            ns.handler.event(what, rank, *args)

    # --- in the main thread -------------------------------------------------------------

    def _fence(self, procs: list[tuple[str, int]], data: bytes, cb: int, cbdata: int) -> None:
        ns = self._namespaces.get(procs[0][0]) if procs else None
        ranks = pmixplan.fence_ranks(procs, ns.world) if ns is not None else None
        if ranks is None:
            self._modex_answer(cb, cbdata, ERR_NOT_SUPPORTED, b"")
            return
        ns.fence(ranks, data, lambda status, blob: self._modex_answer(cb, cbdata, status, blob))

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
# may connect at all is spawner/pmixgate.py's); under munge libpmix would otherwise offer a
# mode the wheel's client complains about. Set in the server process's environment
# (spawner/pmixproc.py): libpmix reads its MCA parameters there.
SERVER_MCA = {"PMIX_MCA_psec": "native"}


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

    def fence(self, ranks: tuple[int, ...], data: bytes,
              done: Callable[[int, bytes], None]) -> None:
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
