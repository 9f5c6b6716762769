"""Hosts that differ in what the job depends on, found before anything starts (`--compare-hosts`,
`--check`; docs/architecture.md, "Hosts that differ").

The hosts are real sshd servers on loopback (tests/sshd_hosts.py). They share this machine's
files, so h2 gets files of its own at the same paths: its sshd runs in a mount namespace of
its own where these are mounted (sessions, and so the agent and the instances, inherit it):

- a venv's `demo_pkg-1.0.dist-info` covered by one whose METADATA says 2.0;
- `changed.py` covered by another script;
- a venv of Python 3.11 covered by a venv of Python 3.12 at the same path;
- `gone/`'s parent covered by an empty tmpfs: the working directory `gone/work` is missing;
- `small/`, where an explicit executable cache goes, covered by a 1 MiB tmpfs;
- `fifo.py`, a FIFO, covered by a file; `device.py` covered by /dev/null; `dirs/here/`,
  where `dir.py` is a file, covered by a directory where it is a directory.

Both hosts are remote (h1, h2), so every launch compares them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprunctl
from requires import skip_or_fail
from sshd_hosts import SshHosts, start_ssh_hosts

pytestmark = pytest.mark.timeout(180)
TIMEOUT = 90
PY = sys.executable
OTHER_PYTHON = "3.12"  # the Python of h2's venv (pyenv's, else the system's)


def _python(version: str) -> str | None:
    """An interpreter of `version` (pyenv's shims are scripts that may refuse: not those)."""
    for candidate in (*sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python3")),
                      shutil.which(f"python{version}")):
        if candidate and "/shims/" not in str(candidate) and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _venv(python: str, path: Path) -> Path:
    subprocess.run([python, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    return path


def _dist_info(site: Path, version: str) -> Path:
    info = site / "demo_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: demo_pkg\nVersion: {version}"
                                   "\nSummary: a distribution of the test's own\n\nText\n")
    return info


class World:
    """The files both hosts see, and those h2 sees instead."""

    def __init__(self, root: Path) -> None:
        self.root = root
        major, minor = sys.version_info[:2]
        self.pkg_venv = _venv(PY, root / "pkgvenv")
        site = self.pkg_venv / "lib" / f"python{major}.{minor}" / "site-packages"
        self.dist_info = _dist_info(site, "1.0")
        self.other_dist_info = _dist_info(root / "h2site", "2.0")
        self.py_venv = _venv(PY, root / "pyvenv")
        other = _python(OTHER_PYTHON)
        self.other_venv = _venv(other, root / "h2venv") if other else None
        self.scripts = root / "scripts"
        self.scripts.mkdir()
        for name in ("same.py", "changed.py"):
            (self.scripts / name).write_text("import sys; print('ran', sys.argv[1:])\n")
        self.h2_script = root / "h2-changed.py"
        self.h2_script.write_text("print('edited on h2 only')\n")
        (root / "gone" / "work").mkdir(parents=True)
        (root / "small").mkdir()
        # Guards a defect: the script as a FIFO here and on h1 (h2: a file bound over it), as a
        # device and as a directory on h2 only (a file everywhere else).
        os.mkfifo(self.scripts / "fifo.py")
        (self.scripts / "device.py").write_text("print('a file here')\n")
        self.h2_file = root / "h2-file.py"
        self.h2_file.write_text("print('a file on h2')\n")
        self.dir_here, self.dir_h2 = root / "dirs" / "here", root / "dirs" / "h2"
        self.dir_here.mkdir(parents=True)
        (self.dir_here / "dir.py").write_text("print('a file here')\n")
        (self.dir_h2 / "dir.py").mkdir(parents=True)

    def mounts(self, host) -> list[list[str]]:
        if host.alias != "h2":
            return []
        found = [["--bind", str(self.other_dist_info), str(self.dist_info)],
                 ["--bind", str(self.h2_script), str(self.scripts / "changed.py")],
                 ["-t", "tmpfs", "-o", "size=64k", "tmpfs", str(self.root / "gone")],
                 ["-t", "tmpfs", "-o", "size=1m", "tmpfs", str(self.root / "small")],
                 ["--bind", str(self.h2_file), str(self.scripts / "fifo.py")],
                 ["--bind", "/dev/null", str(self.scripts / "device.py")],
                 ["--bind", str(self.dir_h2), str(self.dir_here)]]
        if self.other_venv is not None:
            found.append(["--bind", str(self.other_venv), str(self.py_venv)])
        return found


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def hosts(world, tmp_path_factory):
    with start_ssh_hosts(2, tmp_path_factory.mktemp("sshd"), mounts=world.mounts) as h:
        yield h


def run(hosts: SshHosts, *args: str, cwd: Path, env: dict | None = None
        ) -> subprocess.CompletedProcess:
    return subprocess.run(poprun_argv(*OFFLINE, *args),
                          env=poprun_env({**hosts.env(), **(env or {})}), cwd=cwd,
                          capture_output=True, timeout=TIMEOUT, text=True)


def launch(hosts: SshHosts, *args: str, cwd: Path, env: dict | None = None):
    return run(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2", *args, cwd=cwd,
               env=env)


def differences(stderr: str) -> list[str]:
    """The table a launch warned with: the lines after its heading."""
    lines = [line.split("[W] ", 1)[1] for line in stderr.splitlines() if "[W] " in line]
    if not lines:
        return []
    assert lines[0].startswith("the hosts differ in what the job depends on"), stderr
    return [line.strip() for line in lines[1:]]


def check_differences(stdout: str) -> list[str]:
    """The differences --check listed under its second table."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "difference(s) among the hosts" in line),
                 None)
    return [] if start is None else [line.strip() for line in lines[start + 1:] if line.strip()]


def test_hosts_that_agree_report_nothing(hosts, world):
    proc = launch(hosts, PY, "same.py", "x", cwd=world.scripts)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ran ['x']") == 2, proc.stdout
    assert "differ" not in proc.stderr, proc.stderr
    check = run(hosts, "--check", "-H", "h1,h2", PY, "same.py", cwd=world.scripts)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "the hosts are alike in what the job depends on" in check.stdout, check.stdout


def test_a_distribution_at_another_version_is_named_and_the_launch_goes_on(
        hosts, world, tmp_path, job_state):
    python = str(world.pkg_venv / "bin" / "python")
    result = tmp_path / "result.json"
    proc = launch(hosts, f"--result-json={result}", python, "same.py", cwd=world.scripts,
                  env=job_state)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ran []") == 2, proc.stdout  # warned, and went on
    assert differences(proc.stderr) == ["demo-pkg 1.0 on h1, 2.0 on h2"], proc.stderr
    record = json.loads(result.read_text())
    assert [d["text"] for d in record["host_differences"]] == ["demo-pkg 1.0 on h1, 2.0 on h2"]
    assert record["host_differences"][0]["sides"] == [{"value": "1.0", "hosts": ["h1"]},
                                                      {"value": "2.0", "hosts": ["h2"]}]
    shown = run_poprunctl("show", record["id"], env=job_state, text=True)
    assert shown.returncode == 0, shown.stderr
    assert "hosts differ: demo-pkg 1.0 on h1, 2.0 on h2" in shown.stdout, shown.stdout
    as_json = json.loads(run_poprunctl("show", record["id"], "--json", env=job_state,
                                       text=True).stdout)
    assert as_json["host_differences"] == ["demo-pkg 1.0 on h1, 2.0 on h2"]


def test_a_script_changed_on_one_host_is_named_with_its_age(hosts, world):
    proc = launch(hosts, PY, "changed.py", cwd=world.scripts)
    assert proc.returncode == 0, proc.stderr
    found = differences(proc.stderr)
    assert len(found) == 1 and found[0].startswith("changed.py differs on h2 (modified "), found
    assert found[0].endswith(" ago)"), found


def test_the_strict_option_refuses_to_start_anything(hosts, world, tmp_path):
    marker = tmp_path / "ran"
    proc = launch(hosts, "--compare-hosts=error", PY, "changed.py", str(marker),
                  cwd=world.scripts)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert all(line.startswith("poprun: error: ") for line in lines), proc.stderr
    assert "(--compare-hosts=error)" in lines[0] and "changed.py differs on h2" in lines[1]
    assert "ran" not in proc.stdout and not marker.exists()


def test_the_comparison_can_be_turned_off(hosts, world):
    proc = launch(hosts, "--compare-hosts=off", PY, "changed.py", cwd=world.scripts)
    assert proc.returncode == 0, proc.stderr
    assert "differ" not in proc.stderr, proc.stderr


def test_a_different_python_is_named_and_check_exits_10(hosts, world):
    if world.other_venv is None:
        skip_or_fail(f"no Python {OTHER_PYTHON} here for h2's venv", "POPRUN_REQUIRE_PYTHONS")
    python = str(world.py_venv / "bin" / "python")
    proc = run(hosts, "--check", "-H", "h1,h2", python, "same.py", cwd=world.scripts)
    assert proc.returncode == 10, proc.stdout + proc.stderr
    ours = ".".join(map(str, sys.version_info[:3]))
    found = check_differences(proc.stdout)
    assert found[0].startswith(f"Python {python} {ours} on h1, {python} {OTHER_PYTHON}."), \
        proc.stdout
    assert found[0].endswith(" on h2"), found


def test_a_missing_directory_is_named_and_check_exits_30(hosts, world):
    cwd = world.root / "gone" / "work"
    proc = run(hosts, "--check", "-H", "h1,h2", PY, "-c", "pass", cwd=cwd)
    assert proc.returncode == 30, proc.stdout + proc.stderr
    assert "working directory missing: h2" in proc.stdout, proc.stdout
    assert f"working directory {cwd} missing on h2" in check_differences(proc.stdout)
    launched = launch(hosts, PY, "-c", "pass", cwd=cwd)
    assert launched.returncode == 2 and "does not exist there" in launched.stderr


def test_little_free_space_for_the_cache_is_named(hosts, world):
    cache = world.root / "small" / "cache"
    proc = run(hosts, "--check", "-H", "h1,h2", f"--executable-cache-path={cache}", PY,
               "same.py", cwd=world.scripts)
    assert proc.returncode == 10, proc.stdout + proc.stderr
    assert any(line.startswith(f"free space 1.0M in {cache} on h2 (less than 1.0G)")
               for line in check_differences(proc.stdout)), proc.stdout


def test_check_exits_20_for_a_host_it_cannot_reach(tmp_path):
    with start_ssh_hosts(2, tmp_path) as hosts:
        hosts.kill_host(1)  # h2's sshd gone: connection refused
        proc = run(hosts, "--check", "-H", "h1,h2", "--ssh-timeout=5", PY, "-c", "pass",
                   cwd=tmp_path)
    assert proc.returncode == 20, proc.stdout + proc.stderr
    assert "connection refused: h2" in proc.stdout, proc.stdout


def test_the_launchers_own_host_is_compared_too(hosts, world):
    """localhost's facts are read by the launcher itself (on a thread while the agents
    start): its script is the one h2 lacks."""
    proc = run(hosts, "-H", "localhost,h2", "--num-instances=2", "--num-replicas=2", PY,
               "changed.py", cwd=world.scripts)
    assert proc.returncode == 0, proc.stderr
    found = differences(proc.stderr)
    assert len(found) == 1 and found[0].startswith("changed.py differs on h2 (modified "), found


@pytest.mark.parametrize("script, cwd, line", [
    ("fifo.py", "scripts", "fifo.py is a FIFO on h1; a file on h2"),
    ("device.py", "scripts", "device.py is a character device on h2"),
    ("dir.py", "dir_here", "dir.py is a directory on h2")])
def test_a_script_that_is_no_file_is_named_and_check_exits_10(hosts, world, script, cwd,
                                                                line):
    """Guards a defect: the agent blocked opening a FIFO where the script should be, so --check said
    after 16 s that the host "cannot reach this machine back" (30) and a launch declared the
    host lost at --host-timeout (70, a crash file). Now it is a difference like any other,
    named with what the file is: 10 at once, and the launch with =error says so (2)."""
    where = getattr(world, cwd)
    check = run(hosts, "--check", "-H", "h1,h2", PY, script, cwd=where)
    assert check.returncode == 10, check.stdout + check.stderr
    found = check_differences(check.stdout)
    assert found[0].startswith(line), check.stdout
    assert "cannot reach this machine back" not in check.stdout, check.stdout
    assert "2 of 2 host(s) ready" in check.stdout, check.stdout
    launched = launch(hosts, "--compare-hosts=error", "--host-timeout=60", PY, script,
                      cwd=where)
    assert launched.returncode == 2, launched.stderr
    lines = launched.stderr.splitlines()
    assert all(line.startswith("poprun: error: ") for line in lines), launched.stderr
    assert any(line in text for text in lines), launched.stderr
    assert "lost" not in launched.stderr and "crash" not in launched.stderr


def test_the_launchers_own_fifo_is_named_without_blocking_it(hosts, world):
    """The launcher reads its own host's facts the same way: localhost's fifo.py is a FIFO
    (h2 has a file there); the launch warns, and with =error refuses, naming it."""
    proc = run(hosts, "-H", "localhost,h2", "--num-instances=2", "--num-replicas=2",
               "--compare-hosts=error", PY, "fifo.py", cwd=world.scripts)
    assert proc.returncode == 2, proc.stderr
    assert "fifo.py is a FIFO on localhost; a file on h2" in proc.stderr, proc.stderr
