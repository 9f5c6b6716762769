"""Open MPI's spawn request (PMIx_Spawn's apps and job info), as poprun reads it: copied out
of libpmix's structures by the server's process (spawner/worlds/pmixserver.spawn_request),
checked and bounded as hostile input where the launcher takes it
(spawner/worlds/pmi1spawn.request_from_pmix: a client or an agent's host may send anything),
and its answer back (pmixuplink.spawn_status).
Fuzzed with Hypothesis. The real Open MPI programs are tests/test_openmpi_spawn.py's.
"""

from __future__ import annotations

import ctypes
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spawner.worlds import pmi1spawn, pmixserver
from spawner.worlds.pmi1 import PmiError
from spawner.worlds.pmixuplink import ERROR, spawn_status

T = pytest.mark.timeout

# What Open MPI 5's ompi_dpm_spawn sends for MPI_Comm_spawn_multiple of two commands, the
# first with the `wdir` and `host` info keys (ompi/dpm/dpm.c), as spawn_request copies it.
OPEN_MPI = {"apps": [
    {"cmd": "python3", "argv": ["python3", "child.py", "a b"], "maxprocs": 2, "cwd": "",
     "env": ["OMPI_PARENT_PORT=2914582529.0:1234", "OMPI_MCA_btl=self,tcp", "NOVALUE"],
     "info": {"pmix.wdir": "/tmp", "pmix.host": "h2:2"}},
    {"cmd": "python3", "argv": ["python3", "other.py"], "maxprocs": 1, "cwd": "/work",
     "env": ["OMPI_PARENT_PORT=2914582529.0:1234"], "info": {"pmix.mapby": ""}}],
    "job_info": {"pmix.pers": "ompi5"}}


@T(5)
def test_open_mpi_s_request_is_read_as_its_commands():
    request = pmi1spawn.request_from_pmix(OPEN_MPI)
    assert request.pmix and request.preput == {} and request.total == 3
    first, second = request.commands
    assert (first.execname, first.nprocs, first.args) == ("python3", 2, ["child.py", "a b"])
    assert first.info == {"wdir": "/tmp", "host": "h2:2"}
    assert first.env == {"OMPI_PARENT_PORT": "2914582529.0:1234", "OMPI_MCA_btl": "self,tcp"}
    # the app's cwd is its working directory where no wdir says otherwise; keys poprun does
    # not act on are kept to be said ignored
    assert second.info == {"pmix.mapby": "", "wdir": "/work"} and second.args == ["other.py"]
    placed, ignored = pmi1spawn.place(request, [("h1", 1), ("h2", 1)],
                                     lambda name: name if name in ("h1", "h2") else None)
    assert [(p.host, p.rank, p.appnum, p.wdir) for p in placed] == [
        ("h2", 0, 0, "/tmp"), ("h2", 1, 0, "/tmp"), ("h1", 2, 1, "/work")]
    assert placed[0].env["OMPI_PARENT_PORT"] == "2914582529.0:1234" and ignored == ["pmix.mapby"]


@T(5)
def test_it_crosses_an_agent_s_link_as_it_is():
    """An agent's instance's PMIx_Spawn reaches the launcher as SPAWN_ASK {"pmix": ...}
    (pmixuplink.Uplink.spawn), read by the same check."""
    assert pmi1spawn.request_from_json({"pmix": OPEN_MPI}).total == 3


def _with(**app) -> dict:
    return {"apps": [{**OPEN_MPI["apps"][0], **app}], "job_info": {}}


@pytest.mark.parametrize("fields, why", [
    (_with(maxprocs=10000), "spawn of 10000 processes refused: poprun starts at most 256"),
    (_with(maxprocs=0), "a command of no process"),
    ({"apps": [], "job_info": {}}, r"0 commands refused \(1..64 taken\)"),
    ({"apps": [OPEN_MPI["apps"][1]] * 65}, r"65 commands refused"),
    (_with(cmd=""), "commands refused"),
    (_with(cmd=7), "a bad string"),
    (_with(argv=["a\0b"]), "a bad string"),
    (_with(env="X=1"), "a bad list"),
    (_with(info=[]), "a bad mapping"),
    (_with(maxprocs="2"), "a bad app"),
    ({"apps": "x"}, "no apps"),
    ([], "no apps"),
])
@T(5)
def test_what_open_mpi_could_not_have_sent_is_refused(fields, why):
    with pytest.raises(PmiError, match=why):
        pmi1spawn.request_from_pmix(fields)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20)
APP = st.fixed_dictionaries({"cmd": JSON | st.text(max_size=8), "argv": JSON,
                             "env": JSON | st.lists(st.text(max_size=12), max_size=4),
                             "cwd": JSON, "maxprocs": JSON | st.integers(-2, 300),
                             "info": JSON | st.dictionaries(st.text(max_size=12),
                                                            st.text(max_size=12), max_size=3)})


@settings(max_examples=400, deadline=None, database=None)
@given(st.one_of(JSON, st.fixed_dictionaries({"apps": st.lists(APP, max_size=3),
                                              "job_info": JSON})))
def test_any_request_is_a_bounded_spawn_or_refused(fields):
    """Whatever arrives (hostile input): a request within the bounds, or PmiError."""
    try:
        request = pmi1spawn.request_from_json({"pmix": fields})
    except PmiError:
        return
    assert request.pmix and 1 <= len(request.commands) <= pmi1spawn.COMMANDS_MAX
    assert 1 <= request.total <= pmi1spawn.SPAWN_MAX
    assert all(isinstance(c.execname, str) and c.execname for c in request.commands)


@pytest.mark.parametrize("text, hosts", [
    ("h1 slots=2\n# comment\n\nh2  # the second\n", "h1:2,h2"),
    ("h3", "h3"),
])
@T(5)
def test_a_hostfile_is_read_as_the_hosts_it_names(text, hosts):
    assert pmi1spawn.hostfile_hosts(text) == hosts


@pytest.mark.parametrize("text", ["", "# nothing\n", "h1 max_slots=4\n", "h1 slots=1 slots=2"])
@T(5)
def test_a_hostfile_poprun_cannot_read_is_refused(text):
    with pytest.raises(PmiError):
        pmi1spawn.hostfile_hosts(text)


@pytest.mark.parametrize("reply, status", [
    ({"rc": 0, "errcodes": "0,0", "world": "poprun-ab-0-spawn1"}, (0, "poprun-ab-0-spawn1")),
    ({"rc": 1, "msg": "spawn of 10000 processes refused"}, (ERROR, "")),
    ({"rc": 0, "errcodes": "0"}, (ERROR, "")),  # no world named: not an answer to give
    ({"rc": 0, "world": "x" * 256}, (ERROR, "")),  # longer than a PMIx namespace
    ({"rc": 0, "world": 5}, (ERROR, "")),
    ("rc=0", (ERROR, "")),
])
@T(5)
def test_a_spawn_s_reply_is_pmix_s_answer(reply, status):
    assert spawn_status(reply) == status


def _c_strings(*values: bytes):
    array = (ctypes.c_char_p * (len(values) + 1))(*values, None)
    return ctypes.cast(array, ctypes.POINTER(ctypes.c_char_p)), array


def _string_info(key: bytes, value: bytes):
    """A pmix_info_t holding a string, laid out as libpmix lays it (pmix_value_t: the type
    at 0, the char* at 8)."""
    info, data = pmixserver.Info(), ctypes.c_char_p(value)
    info.key = key
    address = ctypes.addressof(info) + pmixserver.Info.value.offset
    ctypes.c_uint16.from_address(address).value = pmixserver.PMIX_STRING
    ctypes.c_void_p.from_address(address + 8).value = ctypes.cast(data, ctypes.c_void_p).value
    return info, data


@T(5)
def test_the_server_copies_open_mpi_s_apps_out_of_libpmix_s_structures():
    """pmix_app_t and pmix_info_t as the spawn upcall gets them (4.2 and 5.0's layout)."""
    argv, keep_argv = _c_strings(b"python3", b"child.py")
    env, keep_env = _c_strings(b"OMPI_PARENT_PORT=1.0:7")
    wdir, keep_wdir = _string_info(b"pmix.wdir", b"/tmp")
    infos = (pmixserver.Info * 1)(wdir)
    app = pmixserver.App(cmd=b"python3", argv=argv, env=env, cwd=None, maxprocs=2,
                         info=infos, ninfo=1)
    apps = (pmixserver.App * 1)(app)
    copied = pmixserver.spawn_request(None, 0, apps, 1)
    assert copied == {"apps": [{"cmd": "python3", "argv": ["python3", "child.py"],
                                "env": ["OMPI_PARENT_PORT=1.0:7"], "cwd": "", "maxprocs": 2,
                                "info": {"pmix.wdir": "/tmp"}}], "job_info": {}}
    assert pmi1spawn.request_from_pmix(copied).commands[0].info == {"wdir": "/tmp"}
    del keep_argv, keep_env, keep_wdir


@T(5)
def test_the_server_refuses_an_upcall_past_its_bounds_before_copying_it():
    many, _keep = _c_strings(*[b"x"] * (pmixserver.MAX_STRINGS + 1))
    apps = (pmixserver.App * 1)(pmixserver.App(cmd=b"a", argv=many, maxprocs=1))
    with pytest.raises(ValueError, match="too many strings"):
        pmixserver.spawn_request(None, 0, apps, 1)
    with pytest.raises(ValueError, match="apps"):
        pmixserver.spawn_request(None, 0, apps, pmixserver.MAX_APPS + 1)


@T(5)
def test_each_command_s_processes_are_registered_with_its_app_number():
    """MPI_Comm_spawn_multiple's world: PMIX_APPNUM per rank (as PMIX_PROC_DATA, its rank
    first, with the keys libpmix then no longer derives from the maps), and the job's count
    of apps; a world of one app registers none of it."""
    from spawner.worlds import pmixplan

    w = pmixplan.world("ns", ["h1", "h2", "h1"], "h1", [0, 0, 1])
    keys = pmixplan.job_keys(w, "nmap", "pmap", "/tmp/x")
    assert {k.key: k.value for k in keys}["pmix.job.napps"] == 2
    data = [[(k.key, k.value) for k in key.value] for key in keys if key.key == "pmix.pdata"]
    assert data == [
        [("pmix.rank", 0), ("pmix.appnum", 0), ("pmix.nodeid", 0), ("pmix.lrank", 0),
         ("pmix.nrank", 0)],
        [("pmix.rank", 1), ("pmix.appnum", 0), ("pmix.nodeid", 1), ("pmix.lrank", 0),
         ("pmix.nrank", 0)],
        [("pmix.rank", 2), ("pmix.appnum", 1), ("pmix.nodeid", 0), ("pmix.lrank", 1),
         ("pmix.nrank", 1)]]
    one = pmixplan.world("ns", ["h1", "h1"], "h1", [0, 0])
    assert one.appnums == () and not [k for k in pmixplan.job_keys(one, "n", "p", "/t")
                                      if k.key == "pmix.pdata"]
    for bad in ([0], [0, 2], [0, -1]):
        with pytest.raises(ValueError, match="appnums"):
            pmixplan.world("ns", ["h1", "h1"], "h1", bad)


@T(10)
def test_a_hostfile_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path):
    """An instance names the hostfile: a FIFO nobody writes (an open that would block the
    launcher), a directory, a file past the bound: each refused at once; a regular file is
    read."""
    from poprun.run.worlds.spawn import read_hostfile

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"h1\n" * (pmi1spawn.HOSTFILE_MAX_BYTES // 3 + 1))
    for path, why in [(fifo, "not a regular file"), (tmp_path, "not a regular file"),
                      (big, "too long"), (tmp_path / "none", "No such file")]:
        with pytest.raises(PmiError, match=why):
            read_hostfile(str(path), path.name)
    good = tmp_path / "hosts"
    good.write_text("h1 slots=2\n")
    assert pmi1spawn.hostfile_hosts(read_hostfile(str(good), "hosts")) == "h1:2"
