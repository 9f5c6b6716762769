"""Nothing to install on the other hosts: poprun brings its agent and popdist.

The hosts are real sshd servers (tests/sshd_hosts.py) whose sessions use a Python with none of
the project: a venv made with `--without-pip` from this interpreter, its site-packages empty
(sshd's login environment sets no PYTHONPATH; `test_the_test_hosts_have_no_poprun` checks it
over ssh). Each host has its own ~/.cache (XDG_CACHE_HOME through sshd's SetEnv), as separate
machines would. The launcher runs without PYTHONPATH (it finds this checkout by sys.path), so
the instances get nothing of the checkout either: what popdist they import is the carried one.
"""

from __future__ import annotations

import fcntl
import functools
import io
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import OFFLINE, SRC
from poprun import __version__
from requires import skip_or_fail
from spawner import bootstrap, carried
from sshd_hosts import SshHosts, instances_with, start_ssh_hosts, wait_until

pytestmark = pytest.mark.timeout(120)
PY = sys.executable
TIMEOUT = 60
LAUNCHER = [PY, "-c", f"import sys; sys.path.insert(0, {SRC!r}); "
                      "from poprun.cli.command import run; run()"]
BROUGHT = re.compile(r"(h\d+): no poprun there for .* brought the poprun agent")
REPORT = "import popdist; print(popdist.getInstanceIndex(), popdist.getNumInstances(), " \
         "popdist.__file__)"


def _venv(path: Path) -> str:
    subprocess.run([PY, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    return str(path / "bin" / "python")


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> str:
    """A Python without the project (nor asyncssh, rich, numa...)."""
    return _venv(tmp_path_factory.mktemp("bare") / "venv")


@pytest.fixture
def hosts(tmp_path: Path):
    caches = tmp_path / "caches"
    with start_ssh_hosts(2, tmp_path, setenv=lambda h: {
            "XDG_CACHE_HOME": str(caches / h.alias)}) as h:
        yield h


def cache_root(hosts: SshHosts, i: int) -> Path:
    return hosts.hosts[i].dir.parent.parent / "caches" / hosts.hosts[i].alias / "poprun"


def run(hosts: SshHosts, *args: str, cwd: Path, timeout: float = TIMEOUT
        ) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCHER, *OFFLINE, *args], env=_env(hosts), cwd=cwd,
                          capture_output=True, timeout=timeout)


def start(hosts: SshHosts, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*LAUNCHER, *OFFLINE, *args], env=_env(hosts), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _env(hosts: SshHosts) -> dict[str, str]:
    env = hosts.env()
    for name in ("PYTHONPATH", "CI"):
        env.pop(name, None)
    return env


def reports(stdout: bytes) -> dict[int, tuple[int, str]]:
    """{instance: (getNumInstances(), popdist's file)} from REPORT's tagged lines."""
    seen = {}
    for line in stdout.decode().splitlines():
        index, count, path = line.partition("<stdout>:")[2].split()
        seen[int(index)] = (int(count), path)
    return seen


def state(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry of a cache root, with its inode and mtime (and its __main__.py's)."""
    out = {}
    for entry in sorted(os.listdir(root)):
        st = os.stat(root / entry)
        main = os.stat(root / entry / "__main__.py")
        out[entry] = (st.st_ino, st.st_mtime_ns, main.st_ino, main.st_mtime_ns)
    return out


def test_the_test_hosts_have_no_poprun(hosts, bare):
    for module in ("spawner", "popdist", "poprun"):
        proc = subprocess.run(hosts.ssh_argv(0, shlex.join([bare, "-c", f"import {module}"])),
                              capture_output=True, timeout=TIMEOUT)
        assert proc.returncode == 1, proc
        assert f"No module named '{module}'" in proc.stderr.decode()


def test_never_keeps_the_error_phrased_per_host(hosts, bare, tmp_path):
    proc = run(hosts, "--remote-install=never", f"--remote-python={bare}", "-H", "h1,h2",
               "--num-instances=2", "--num-replicas=2", bare, "-c", "pass", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr.decode()
    assert proc.stderr.decode().splitlines() == [
        f"poprun: error: poprun is not installed for {bare} on {h} (install it, or let poprun "
        f"bring its agent: --remote-install=auto)" for h in ("h1", "h2")]
    assert proc.stdout == b""
    assert not cache_root(hosts, 0).exists() and not cache_root(hosts, 1).exists()


def test_the_agent_is_brought_once_then_reused(hosts, bare, tmp_path):
    args = ("-v", f"--remote-python={bare}", "-H", "h1,h2", "--num-instances=4",
            "--num-replicas=4", "--tag-output", bare, "-c", REPORT)
    first = run(hosts, *args, cwd=tmp_path)
    err = first.stderr.decode()
    assert first.returncode == 0, err
    assert sorted(BROUGHT.findall(err)) == ["h1", "h2"], err  # one transfer per host
    name = bootstrap.payload().name
    assert name.startswith(f"{__version__}-")
    before = []
    for i in range(2):
        root = cache_root(hosts, i)
        assert os.listdir(root) == [name]  # nothing else: no temporary leftovers
        assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o700
        before.append(state(root))
    # popdist works in every instance, from its own host's cache.
    seen = reports(first.stdout)
    assert sorted(seen) == [0, 1, 2, 3]
    for index, (count, path) in seen.items():
        assert count == 4
        assert path == str(cache_root(hosts, index // 2) / name / "lib/popdist/__init__.py")

    again = run(hosts, *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr.decode()
    assert not BROUGHT.findall(again.stderr.decode())  # no transfer
    assert [state(cache_root(hosts, i)) for i in range(2)] == before  # the same files
    assert reports(again.stdout) == seen


def test_two_launches_at_once_both_succeed_with_one_cache(hosts, bare, tmp_path):
    args = ("-v", f"--remote-python={bare}", "-H", "h1,h2", "--num-instances=2",
            "--num-replicas=2", "--tag-output", bare, "-c", REPORT)
    procs = [start(hosts, *args, cwd=tmp_path) for _ in range(2)]
    outcomes = [p.communicate(timeout=TIMEOUT) for p in procs]
    for proc, (out, err) in zip(procs, outcomes):
        assert proc.returncode == 0, err.decode()
        assert sorted(reports(out)) == [0, 1]
    transfers = sum(len(BROUGHT.findall(err.decode())) for _, err in outcomes)
    assert transfers >= 2  # each host's cache was brought at least once
    for i in range(2):
        assert os.listdir(cache_root(hosts, i)) == [bootstrap.payload().name]


def test_a_cache_that_cannot_be_written_is_one_clear_error(bare, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with start_ssh_hosts(1, tmp_path, setenv=lambda h: {
            "XDG_CACHE_HOME": str(blocker / "cache")}) as hosts:
        proc = run(hosts, f"--remote-python={bare}", "-H", "h1", "--num-instances=1",
                   "--num-replicas=1", bare, "-c", "pass", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr.decode()
    assert proc.stderr.decode().splitlines() == [
        f"poprun: error: h1: cannot bring the poprun agent there: [Errno 20] Not a directory: "
        f"'{blocker / 'cache'}'"]


def test_a_host_whose_python_has_popdist_keeps_its_own(hosts, tmp_path):
    own = _venv(tmp_path / "own")
    site = next((tmp_path / "own" / "lib").glob("python3*/site-packages"))
    (site / "popdist").mkdir()
    (site / "popdist" / "__init__.py").write_text(
        "import os\ngetInstanceIndex = lambda: int(os.environ['RANK'])\n"
        "getNumInstances = lambda: int(os.environ['WORLD_SIZE'])\n")
    proc = run(hosts, f"--remote-python={own}", "-H", "h1", "--num-instances=1",
               "--num-replicas=1", "--tag-output", own, "-c", REPORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    assert reports(proc.stdout) == {0: (1, str(site / "popdist" / "__init__.py"))}
    assert os.listdir(cache_root(hosts, 0)) == [bootstrap.payload().name]  # agent brought


def test_a_host_with_another_poprun_version_gets_the_launchers_agent(hosts, tmp_path):
    """poprun installed there, in another version: `auto` brings this one's agent (the
    protocol may differ) and the instances import the carried popdist."""
    other = _venv(tmp_path / "other")
    site = next((tmp_path / "other" / "lib").glob("python3*/site-packages"))
    (site / "poprun").mkdir()
    (site / "poprun" / "__init__.py").write_text("")
    (site / "poprun" / "_version.py").write_text('__version__ = "0.0.1"\n')
    proc = run(hosts, "-v", f"--remote-python={other}", "-H", "h1", "--num-instances=1",
               "--num-replicas=1", "--tag-output", other, "-c", REPORT, cwd=tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert re.search(rf"h1: poprun 0\.0\.1 there for {re.escape(other)}: brought the poprun "
                     "agent", err), err
    name = bootstrap.payload().name
    assert reports(proc.stdout) == {
        0: (1, str(cache_root(hosts, 0) / name / "lib/popdist/__init__.py"))}


def test_the_launchers_python_path_is_preferred_to_python3_on_the_path(tmp_path):
    """No --remote-python: the launcher's interpreter path, where it exists there, wins over
    a `python3` earlier on that host's PATH (which here would fail loudly)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    decoy = bin_dir / "python3"
    decoy.write_text("#!/bin/sh\necho decoy python3 ran >&2\nexit 97\n")
    decoy.chmod(0o755)
    command = bootstrap.agent_command(None, "never", own=PY)
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:{os.defpath}", "HOME": str(tmp_path),
                               "PYTHONPATH": SRC},
                          stdin=subprocess.PIPE)  # the agent: MAGIC, then EOF ends it
    assert proc.returncode == 0, proc.stderr
    assert "decoy" not in proc.stderr and proc.stdout.startswith("\0poprun-agent\0")


@functools.cache
def _pythons() -> dict[tuple[int, int], str]:
    """Real interpreters on this machine, by version (pyenv's, /usr/bin's), no shims."""
    candidates = [*Path("/usr/bin").glob("python[23].*"), *Path("/usr/local/bin").glob(
        "python[23].*")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += pyenv.glob("*/bin/python")
    found = {}
    for path in sorted(candidates):
        if not re.fullmatch(r"python(\d(\.\d+)?)?", path.name) or not os.access(path, os.X_OK):
            continue
        try:
            out = subprocess.run([str(path), "-c", "import sys; sys.stdout.write("
                                  "'%d %d' % tuple(sys.version_info[:2]))"],
                                 capture_output=True, text=True, timeout=10,
                                 env={"PATH": os.defpath})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            found.setdefault(tuple(map(int, out.stdout.split())), str(path))
    return found


def _too_old_python(tmp_path: Path, bare: str, kind: str) -> tuple[str, str]:
    """(the --remote-python to give, the version its error names): "real", the newest Python
    older than the agent's minimum on this machine (pyenv's 3.9 here; skip without one);
    "shim", `bare` behind a sitecustomize that makes it report 3.8.18 (the shim drops the
    agent command's `-S`, which would skip sitecustomize: a real old Python needs no site
    to be old)."""
    old = {v: p for v, p in _pythons().items() if v < carried.MIN_PYTHON}
    if kind == "real":
        if not old:
            skip_or_fail("no Python older than the agent's minimum on this machine",
                         "POPRUN_REQUIRE_PYTHONS")
        version = max(old)
        full = subprocess.run([old[version], "-c", "import sys; print('.'.join(map(str, "
                               "sys.version_info[:3])))"], capture_output=True, text=True,
                              check=True).stdout.strip()
        return old[version], full
    shim_dir = tmp_path / "old-python"
    shim_dir.mkdir()
    (shim_dir / "sitecustomize.py").write_text(
        "import sys\nsys.version_info = (3, 8, 18, 'final', 0)\n")
    shim = shim_dir / "python3"
    shim.write_text(f"#!/bin/sh\n[ \"$1\" = -S ] && shift\n"
                    f"PYTHONPATH={shlex.quote(str(shim_dir))} exec {shlex.quote(bare)} \"$@\"\n")
    shim.chmod(0o755)
    return str(shim), "3.8.18"


@pytest.mark.parametrize("kind", ["real", "shim"])
def test_a_too_old_remote_python_is_one_clear_error_per_host(hosts, bare, tmp_path, kind):
    python, version = _too_old_python(tmp_path, bare, kind)
    proc = run(hosts, f"--remote-python={python}", "-H", "h1,h2", "--num-instances=2",
               "--num-replicas=2", bare, "-c", "pass", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr.decode()
    shown = python if "old-python" not in python else bare  # a shim's sys.executable
    minimum = ".".join(map(str, carried.MIN_PYTHON))
    assert proc.stderr.decode().splitlines() == [
        f"poprun: error: {h}: {shown} is Python {version}; the poprun agent needs Python "
        f"{minimum} or later (choose another with --remote-python)" for h in ("h1", "h2")]
    assert not cache_root(hosts, 0).exists()


def test_the_agent_runs_on_its_oldest_python(hosts, tmp_path):
    python = _pythons().get(carried.MIN_PYTHON)
    if python is None:
        skip_or_fail(f"no Python {carried.MIN_PYTHON} on this machine", "POPRUN_REQUIRE_PYTHONS")
    proc = run(hosts, f"--remote-python={python}", "-H", "h1,h2", "--num-instances=2",
               "--num-replicas=2", "--tag-output", python, "-c", REPORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(reports(proc.stdout)) == [0, 1]


@pytest.mark.parametrize("version", [(2, 7), (3, 6), (3, 8), (3, 9)])
def test_the_probe_speaks_to_old_pythons(version, tmp_path):
    """The probe runs first in whatever Python is found: it must parse there to say it is too
    old (run here through sh, as sshd's shell would)."""
    python = _pythons().get(version)
    if python is None:
        skip_or_fail(f"no Python {version} on this machine", "POPRUN_REQUIRE_PYTHONS")
    command = bootstrap.agent_command(python, "auto")
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                          env={"PATH": os.defpath, "HOME": str(tmp_path)}, stdin=subprocess.PIPE)
    answer = bootstrap._answer(proc.stderr)
    assert answer is not None, proc.stderr
    assert (answer["status"], answer["version"][:2]) == ("too-old", list(version))


def test_a_python_found_on_the_path_when_the_launchers_is_missing(tmp_path):
    """No --remote-python and no launcher's path there: `python3` on that host's PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(PY)
    command = bootstrap.agent_command(None, "never", own="/no/such/python")
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:{os.defpath}", "HOME": str(tmp_path),
                               "PYTHONPATH": SRC},
                          stdin=subprocess.PIPE)  # the agent: MAGIC, then EOF ends it
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("\0poprun-agent\0")


@pytest.mark.parametrize("shell", ["sh", "bash", "zsh", "fish", "tcsh", "csh"])
def test_every_login_shell_passes_the_commands_intact(shell, tmp_path):
    """sshd runs a command with the user's login shell: the agent command and the carried
    module's one-line `python -c` form must reach sh and Python unchanged."""
    path = shutil.which(shell)
    if path is None:
        skip_or_fail(f"no {shell} here", "POPRUN_REQUIRE_TOOLS")
    env = {"PATH": os.defpath, "HOME": str(tmp_path), "PYTHONPATH": SRC}
    agent = subprocess.run([path, "-c", bootstrap.agent_command(PY, "never")], env=env,
                           capture_output=True, text=True, timeout=30, stdin=subprocess.PIPE)
    assert agent.returncode == 0, agent.stderr
    assert agent.stdout.startswith("\0poprun-agent\0")
    clear = subprocess.run([path, "-c", "exec " + shlex.join(
        [PY, "-c", bootstrap._carried_cli(), "clear", "keep-this"])], env=env,
        capture_output=True, text=True, timeout=30)
    assert clear.returncode == 0, clear.stderr
    assert json.loads(clear.stdout) == {"removed": [], "in_use": []}


def test_old_caches_are_cleared_except_the_current_and_those_in_use(tmp_path):
    root = tmp_path / "poprun"
    current = bootstrap.payload().name
    for name in (current, "0.0.1-0123456789abcdef", "0.0.2-0123456789abcdef"):
        (root / name).mkdir(parents=True)
        (root / name / "__main__.py").write_text("")
    (root / "notes").mkdir()  # not a cache: left alone
    stale, fresh = root / ".0.0.3-0123456789abcdef.x.tmp", root / ".0.0.4-0123456789abcdef.y.tmp"
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 2 * carried.STALE_TEMP,) * 2)
    busy = os.open(root / "0.0.2-0123456789abcdef" / "__main__.py", os.O_RDONLY)
    fcntl.flock(busy, fcntl.LOCK_SH)  # as an agent running from it holds it
    try:
        done = carried.clear_caches((current,), str(root))
    finally:
        os.close(busy)
    assert done == {"removed": ["0.0.1-0123456789abcdef"], "in_use": ["0.0.2-0123456789abcdef"]}
    assert sorted(os.listdir(root)) == sorted(
        [current, "0.0.2-0123456789abcdef", "notes", fresh.name])


def test_caches_are_cleared_over_ssh_and_a_running_agent_keeps_its_own(hosts, bare, tmp_path):
    marker = f"marker-{os.getpid()}-{time.monotonic_ns()}"
    proc = start(hosts, f"--remote-python={bare}", "-H", "h1", "--num-instances=1",
                 "--num-replicas=1", "sh", "-c", f"sleep 60 # {marker}", cwd=tmp_path)
    try:
        wait_until(lambda: instances_with(marker), "the instance to start", timeout=TIMEOUT)
        root = cache_root(hosts, 0)
        old = root / "0.0.1-0123456789abcdef"
        old.mkdir()
        (old / "__main__.py").write_text("")
        clear = subprocess.run(
            [PY, "-m", "spawner.bootstrap", "--clear-caches", "--all", "--remote-python", bare,
             "h1"], env={**_env(hosts), "PYTHONPATH": SRC}, capture_output=True, text=True,
            timeout=TIMEOUT)
        assert clear.returncode == 0, clear.stderr
        name = bootstrap.payload().name
        assert clear.stdout.splitlines() == ["h1: removed 0.0.1-0123456789abcdef",
                                             f"h1: kept {name} (in use)"]
        assert os.listdir(root) == [name]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=TIMEOUT)
    # Not in use any more: the cache's own entry point removes it (by hand on a host).
    cleared = subprocess.run([bare, str(root / name), "--clear-caches", "--all"],
                             capture_output=True, text=True, timeout=TIMEOUT)
    assert cleared.returncode == 0, cleared.stderr
    assert cleared.stdout.splitlines() == [f"removed {name}"]
    assert os.listdir(root) == []


def test_the_payload_is_deterministic_and_checked(tmp_path):
    carried_payload = bootstrap.payload()
    bootstrap.payload.cache_clear()
    again = bootstrap.payload()
    assert again.zip == carried_payload.zip and again.digest == carried_payload.digest
    names = zipfile.ZipFile(io.BytesIO(again.zip)).namelist()
    assert names == sorted(names) and "__main__.py" in names
    assert "spawner/agent.py" in names and "lib/popdist/__init__.py" in names
    assert not any(n.startswith("spawner/") and n.endswith(("remote.py", "ssh.py"))
                   for n in names)  # launcher-only: never carried

    damaged = bytearray(again.zip)
    damaged[len(damaged) // 2] ^= 0xFF  # inside some member's compressed bytes
    with pytest.raises(ValueError, match="damaged"):
        carried.install(again.name, again.digest, bytes(damaged), str(tmp_path))
    other = dict(again.entries, **{"spawner/agent.py": b"print('not the agent')\n"})
    altered = bootstrap.Payload(other, again.digest)  # a valid zip, another content
    with pytest.raises(ValueError, match="does not match its digest"):
        carried.install(again.name, again.digest, altered.zip, str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing half-made left
    path = carried.install(again.name, again.digest, again.zip, str(tmp_path))
    assert path == str(tmp_path / again.name) and os.listdir(tmp_path) == [again.name]


def test_installs_racing_for_one_cache_leave_one_complete_copy(tmp_path):
    """Eight processes unpacking the same agent into the same place at once."""
    carried_payload = bootstrap.payload()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from spawner import carried; "
            "print(carried.install(sys.argv[2], sys.argv[3], sys.stdin.buffer.read(), "
            "sys.argv[4]))")
    procs = [subprocess.Popen([PY, "-c", code, SRC, carried_payload.name,
                               carried_payload.digest, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for _ in range(8)]
    for proc in procs:
        proc.stdin.write(carried_payload.zip)
        proc.stdin.close()
    paths = {proc.stdout.read().decode().strip() for proc in procs}
    assert all(proc.wait(TIMEOUT) == 0 for proc in procs)
    assert paths == {str(tmp_path / carried_payload.name)}
    assert os.listdir(tmp_path) == [carried_payload.name]
    home = tmp_path / carried_payload.name
    files = {p.relative_to(home).as_posix(): p.read_bytes() for p in home.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files == carried_payload.entries
    compiled = {p.relative_to(home).parent.parent / (p.name.split(".")[0] + ".py")
                for p in home.rglob("__pycache__/*.pyc")}
    assert {Path(n) for n in files} == compiled  # bytecode made once, by the installer


def test_the_answer_line_is_read_from_the_agents_stderr():
    tail = ("Welcome\npoprun-bootstrap: " + json.dumps({"status": "need", "python": "/p"})
            + "\n")
    assert bootstrap._answer(tail) == {"status": "need", "python": "/p"}
    assert bootstrap._answer("sh: 1: exec: python3: not found\n") is None


def test_the_zip_follows_a_need_split_across_packets():
    class Spawner:
        written: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.written.append(data)

    spawner = Spawner()
    bringer = bootstrap._Bringer(spawner)
    line = ("poprun-bootstrap: " + json.dumps({"status": "need", "python": "/p", "found": None})
            + "\n").encode()
    for part in (b"Welcome to h1\npoprun-boot", line[len(b"poprun-boot"):20], line[20:],
                 line):  # a second answer is ignored
        bringer(part)
    carried_zip = bootstrap.payload().zip
    assert spawner.written == [len(carried_zip).to_bytes(8, "big") + carried_zip]
    assert bringer.answer == {"status": "need", "python": "/p", "found": None}
