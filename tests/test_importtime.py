"""What a start imports: a launch and `--version` never import typer, click, rich, pydantic,
asyncssh or numa when nothing needs them (a local job, output to a pipe, no placement).
Each runs the real command under `python -X importtime`, which lists every module imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env
from requires import skip_or_fail

pytestmark = pytest.mark.timeout(60)
# Imported only where a person waits (help, completion), a remote host or the dashboard needs
# them; asyncio is not here: every launch runs on it.
HEAVY = ("typer", "click", "rich", "pydantic", "pydantic_core", "shellingham", "asyncssh",
         "cryptography", "numa")


def imported(*args: str, env: dict[str, str] | None = None) -> set[str]:
    """The modules `poprun args` imports, stdout and stderr not terminals, no remote host."""
    environ = poprun_env({"POPRUN_NO_DASHBOARD": "1", **(env or {})})
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "_POPRUN_COMPLETE"):
        environ.pop(name, None)
    argv = poprun_argv(*args)
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], env=environ,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=30)
    lines = proc.stderr.decode().splitlines()
    modules = {line.rpartition("|")[2].strip() for line in lines
               if line.startswith("import time:")}
    assert "poprun.cli.options" in modules, proc.stderr.decode()[-2000:]
    return modules


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.partition(".")[0] in HEAVY)


@pytest.mark.parametrize("args", [
    # one instance: no placement, no memory binding (that one needs numa: see below)
    ["--num-instances", "1", "--num-replicas", "2", "--offline-mode=1", "true"],
    [*OFFLINE, "--num-instances=2", "--num-replicas=2", "--tag-output", "--process-placement",
     "disabled", sys.executable, "-c", "print('x')"],
    [*OFFLINE, "--num-instances=2", "--num-replicas=4", "--dry-run", "true"],
    ["--version"],
    ["--num-instances=0", "true"],  # a usage error
], ids=["launch", "tagged-launch", "dry-run", "version", "usage-error"])
def test_a_start_imports_nothing_heavy(args):
    assert heavy(imported(*args)) == []


# poprun's own modules a clean local launch has no use for: the root cause of a failure
# (imported when an instance fails), a stacks dump's parsers (when stacks are asked for), the
# usage samples of remote agents, the node-level MPI world and the agent protocol its link
# speaks (when an instance first speaks PMI: run/worlds/pmi1.MpiWorld.attach).
NOT_FOR_A_CLEAN_LAUNCH = ("poprun.rootcause", "spawner.stackparse", "spawner.procstat",
                          "spawner.worlds.nodeworld", "spawner.protocol")


def test_a_clean_launch_leaves_out_what_only_failures_and_remote_hosts_need():
    modules = imported("--num-instances=2", "--num-replicas=2", *OFFLINE, "true")
    assert "poprun.run.job" in modules  # it did launch
    assert sorted(set(NOT_FOR_A_CLEAN_LAUNCH) & modules) == []


def test_a_failed_launch_imports_the_root_cause():  # the check above can see it
    modules = imported("--num-instances=2", "--num-replicas=2", *OFFLINE, "false")
    assert "poprun.rootcause" in modules


def test_an_mpi_launch_imports_the_node_level_world():  # the check above can see it
    probe = subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True,
                           timeout=60)
    if probe.returncode != 0:
        skip_or_fail("no mpi4py over MPICH here", "POPRUN_REQUIRE_MPI")
    modules = imported("--num-instances=2", "--num-replicas=2", *OFFLINE, sys.executable,
                       "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()")
    assert {"spawner.worlds.nodeworld", "spawner.protocol"} <= modules


def test_py_libnuma_is_imported_without_running_ldconfig():
    """py-libnuma's import looks libnuma up with ctypes.util.find_library, which runs
    `ldconfig -p`; spawner.binding answers it from the loader instead (no process started),
    and leaves find_library as it was."""
    script = ("import ctypes.util, subprocess, sys\n"
              "ran = []\n"
              "init = subprocess.Popen.__init__\n"
              "def recording(self, args, *a, **k):\n"
              "    ran.append(args)\n"
              "    init(self, args, *a, **k)\n"
              "subprocess.Popen.__init__ = recording\n"
              "before = ctypes.util.find_library\n"
              "from spawner.binding import memory_binding_available\n"
              "available = memory_binding_available()\n"
              "print(available, 'numa' in sys.modules, ran, ctypes.util.find_library is before)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=poprun_env({}),
                          capture_output=True, text=True, timeout=30)
    available, numa, ran, same = proc.stdout.split(maxsplit=3)[:4] if proc.stdout else [""] * 4
    if available != "True":
        skip_or_fail(f"no libnuma or no NUMA support here: {proc.stdout}{proc.stderr}",
                     "POPRUN_REQUIRE_TOOLS")
    assert proc.stdout.strip() == "True True [] True", proc.stderr


def test_help_does_import_typer():  # the check above can see typer when it is there
    modules = imported("--help")
    assert {"typer", "rich"} <= {m.partition(".")[0] for m in modules}
    assert not any(m.startswith("pydantic") for m in modules)  # typer only coerces with it


def test_numa_is_imported_when_memory_is_bound():
    """spreadnuma binds each of two instances' memory: py-libnuma is needed then, and only
    then (the check above can see numa when it is there)."""
    modules = imported("--num-instances", "2", "--num-replicas", "2", "--offline-mode=1",
                       "--process-placement=spreadnuma", "true")
    assert "numa" in modules
    assert not {"typer", "rich", "asyncssh"} & {m.partition(".")[0] for m in modules}


@pytest.mark.parametrize("args", [["--version"], ["--num-instances=0", "true"]],
                         ids=["version", "usage-error"])
def test_what_launches_nothing_does_not_import_asyncio(args):
    """`--version` and a usage error run no loop: asyncio (~25 ms here) stays out of them."""
    assert "asyncio" not in imported(*args)


def test_a_launch_does_import_asyncio():  # the check above can see asyncio when it is there
    assert "asyncio" in imported("--num-instances=1", "--num-replicas=1", *OFFLINE, "true")


def test_the_command_and_the_agent_run_asyncio_without_ssl():
    """poprun's own processes import asyncio with ssl hidden (spawner/asyncio_import.py):
    neither the command's launch nor an agent imports ssl (a real agent, ended by stdin's
    EOF, as when its launcher goes)."""
    # importtime lists the refused `import ssl` too: the real one always loads `_ssl`.
    launch = imported("--num-instances=1", "--num-replicas=1", *OFFLINE, "true")
    assert "asyncio" in launch and "_ssl" not in launch
    agent = subprocess.run([sys.executable, "-X", "importtime", "-m", "spawner.agent"],
                           env=poprun_env({}), input=b"", capture_output=True, timeout=30)
    modules = {line.rpartition("|")[2].strip() for line in agent.stderr.decode().splitlines()
               if line.startswith("import time:")}
    assert "spawner.lifeline" in modules and "asyncio" in modules, agent.stderr.decode()[-2000:]
    assert "_ssl" not in modules


@pytest.mark.parametrize("first", ["", "import asyncio\n"], ids=["hidden", "already-there"])
def test_hiding_ssl_from_asyncio_leaves_ssl_to_everyone_else(first):
    """After the hidden import, `import ssl` works, and only asyncio's own TLS is off; in a
    process that imported asyncio already (a caller's program), nothing changes."""
    script = (first + "from spawner.asyncio_import import asyncio_without_tls\n"
              "aio = asyncio_without_tls()\n"
              "import asyncio.sslproto, ssl\n"
              "print(ssl.SSLContext.__name__, aio.sslproto.ssl is None)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=poprun_env({}),
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout.split() == ["SSLContext", "False" if first else "True"], proc.stderr
