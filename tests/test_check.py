"""`poprun --check` opens its hosts as a launch does (run/fleet.py): over SSH its
agent is brought where poprun is missing (`--remote-install`), and inside a Slurm allocation
it is a job step (`--launcher slurm`).

The SSH hosts are real sshd servers (tests/sshd_hosts.py) whose sessions run a Python without
the project (a `--without-pip` venv of this interpreter, as in tests/test_bootstrap.py), each
with its own ~/.cache; the launcher finds this checkout by sys.path, not PYTHONPATH.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, SRC
from poprun import __version__
from slurm_cluster import SlurmCluster
from sshd_hosts import SshHosts, start_ssh_hosts

pytestmark = pytest.mark.timeout(120)
PY = sys.executable
TIMEOUT = 60
LAUNCHER = [PY, "-c", f"import sys; sys.path.insert(0, {SRC!r}); "
                      "from poprun.cli.command import run; run()"]
VERSION = ".".join(map(str, sys.version_info[:3]))


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> str:
    """A Python without the project: `import spawner` fails there."""
    path = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    return str(path / "bin" / "python")


@pytest.fixture
def hosts(tmp_path: Path):
    with start_ssh_hosts(2, tmp_path, setenv=lambda h: {
            "XDG_CACHE_HOME": str(tmp_path / "caches" / h.alias)}) as h:
        yield h


def check(hosts: SshHosts, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in hosts.env().items() if k not in ("PYTHONPATH", "CI")}
    return subprocess.run([*LAUNCHER, *OFFLINE, "--check", *args], env=env, cwd=cwd,
                          capture_output=True, timeout=TIMEOUT)


def rows(out: str) -> dict[str, list[str]]:
    """The first table's rows by host: [ssh, python, poprun, cwd, program, numa...]."""
    first = out.split("\n\n", 1)[0]  # the second table is what the job depends on
    return {line.split()[0]: line.split()[1:] for line in first.splitlines()[1:]
            if line.split() and line.split()[0] in ("h1", "h2", "node1", "node2")}


def test_check_brings_the_agent_where_poprun_is_missing(hosts, bare, tmp_path):
    there = subprocess.run(hosts.ssh_argv(0, shlex.join([bare, "-c", "import spawner"])),
                           capture_output=True, timeout=TIMEOUT)
    assert b"No module named 'spawner'" in there.stderr, there  # the host lacks poprun
    proc = check(hosts, f"--remote-python={bare}", "-H", "h1,h2", cwd=tmp_path)
    out = proc.stdout.decode()
    assert proc.returncode == 0, (out, proc.stderr.decode())
    found = rows(out)
    for host in ("h1", "h2"):
        assert found[host][:5] == ["ok", VERSION, __version__, "ok", "-"], out
        assert os.listdir(tmp_path / "caches" / host / "poprun"), out  # brought and cached
    assert "2 of 2 host(s) ready" in out


def test_check_with_remote_install_never_says_poprun_is_not_installed_on_every_host(
        hosts, bare, tmp_path):
    proc = check(hosts, "--remote-install=never", f"--remote-python={bare}", "-H", "h1,h2",
                 cwd=tmp_path)
    out = proc.stdout.decode()
    assert proc.returncode == 30, (out, proc.stderr.decode())  # a host cannot run the job
    for host in ("h1", "h2"):  # every host's problem, not the first one's
        assert rows(out)[host][:3] == ["ok", "-", "-"], out
        assert (f"poprun is not installed for {bare} on {host} (install it, or let poprun "
                f"bring its agent: --remote-install=auto)") in out.splitlines(), out
    assert "poprun not installed: h[1-2]" in out and "0 of 2 host(s) ready" in out, out
    assert not (tmp_path / "caches").exists()  # nothing brought


def test_check_under_launcher_slurm_opens_each_node_as_a_job_step(
        slurm_cluster: SlurmCluster, tmp_path):
    """node1 and node2 are no SSH hosts (no sshd, no such names): only srun reaches their
    agents, and the table says so."""
    slurm_cluster.reset()
    done = slurm_cluster.run(
        ["salloc", "-N2", "--ntasks-per-node=1", PY, "-m", "poprun", *OFFLINE, "--check",
         "--launcher", "slurm"], env={"PYTHONPATH": SRC}, cwd=tmp_path, timeout=90)
    assert done.returncode == 0, (done.stdout, done.stderr)
    found = rows(done.stdout)
    assert sorted(found) == ["node1", "node2"], done.stdout
    for node in ("node1", "node2"):
        assert found[node][:5] == ["srun", VERSION, __version__, "ok", "-"], done.stdout
    assert "2 of 2 host(s) ready" in done.stdout
