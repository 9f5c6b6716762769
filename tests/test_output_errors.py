"""Output that cannot be written: `--output-filename` on a regular file or a read-only
filesystem is refused before anything starts (exit 2, one line naming the path); a disk that
fills during the run, or a stdout that cannot be written, stops the job (exit 74, one line
naming the file) with the console output intact — locally and for instances on sshd hosts
(poprun writes every instance's files itself).

Real filesystems: small tmpfs mounts made for the test (root only; skipped otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, poprun_argv, poprun_env, run_poprun
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(90)
PY = sys.executable
OUTPUT_ERROR = 74
WRITER = ("import os, sys\n"
          "for i in range(3000):\n"
          "    print(f\"{os.environ['RANK']}:{i:05d}:\" + 'x' * 80)\n")
LINE = re.compile(rb"^[01]:\d{5}:x{80}$")


@contextlib.contextmanager
def tmpfs(path: Path, *options: str):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=64k", *options)),
                           "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        # no switch: a privilege (mounting a tmpfs), the machine's
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def hosts(tmp_path):
    with start_ssh_hosts(1, tmp_path) as h:
        yield h


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_regular_file_is_refused_before_anything_starts(where, tmp_path, request):
    target = tmp_path / "a-file"
    target.write_text("")
    witness = tmp_path / "ran"
    extra, env = [], {}
    if where == "remote":
        hosts = request.getfixturevalue("hosts")
        extra, env = ["-H", "h1"], hosts.env()
    proc = run_poprun(*OFFLINE, *extra, f"--output-filename={target}", "--num-instances=1",
                      "--num-replicas=1", "touch", str(witness), env=env)
    assert_usage_error(proc, str(target), "Not a directory", "on this host")
    assert not witness.exists()


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_read_only_filesystem_is_refused_before_anything_starts(where, tmp_path, request):
    extra, env = [], {}
    if where == "remote":  # not "lost the connection to the host" (exit 255)
        hosts = request.getfixturevalue("hosts")
        extra, env = ["-H", "h1"], hosts.env()
    with tmpfs(tmp_path / "ro", "ro") as ro:
        witness = tmp_path / "ran"
        proc = run_poprun(*OFFLINE, *extra, f"--output-filename={ro}/out", "--num-instances=1",
                          "--num-replicas=1", "touch", str(witness), env=env)
        assert_usage_error(proc, f"{ro}/out", "Read-only file system", "on this host")
        assert not witness.exists()


@pytest.mark.parametrize("path", ["/proc/poprun-output", "{tmp}/locked/out"],
                         ids=["proc", "no-permission"])
def test_an_uncreatable_path_is_refused_before_anything_starts(path):
    # Where another user can reach it: root would ignore the directory's mode, so the
    # no-permission case runs poprun as nobody.
    top = Path(tempfile.mkdtemp(prefix="poprun-test-"))
    try:
        _refused(path.format(tmp=top), top)
    finally:
        (top / "locked").chmod(0o700)
        shutil.rmtree(top)


def _refused(target: str, top: Path) -> None:
    top.chmod(0o755)
    (top / "locked").mkdir(mode=0o555)
    witness = top / "ran"
    prefix = [] if os.getuid() or "locked" not in target else [
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    proc = subprocess.run([*prefix, *poprun_argv(*OFFLINE, f"--output-filename={target}",
                                                 "--num-instances=1", "--num-replicas=1",
                                                 "touch", str(witness))],
                          env=poprun_env({"XDG_RUNTIME_DIR": "", "HOME": str(top)}),
                          capture_output=True,
                          timeout=60)
    assert_usage_error(proc, target, "on this host")
    assert not witness.exists() and not Path(target).exists()


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_disk_that_fills_stops_the_job_naming_the_file(where, tmp_path, request):
    extra, env = [], {}
    if where == "remote":
        hosts = request.getfixturevalue("hosts")
        extra, env = ["-H", "h1"], hosts.env()
    with tmpfs(tmp_path / "small") as small:
        proc = run_poprun(*OFFLINE, *extra, f"--output-filename={small}/out",
                          "--num-instances=2", "--num-replicas=2", PY, "-c", WRITER, env=env)
        err = proc.stderr.decode()
        assert proc.returncode == OUTPUT_ERROR, err
        assert "Traceback" not in err
        found = re.findall(r"^poprun: stopped: cannot write (\S+): No space left on device$",
                           err, re.M)
        assert len(found) == 1 and found[0].startswith(f"{small}/out/1/rank."), err
        lines = proc.stdout.splitlines()
        assert lines and all(LINE.match(line) for line in lines)  # every line whole


def test_a_stdout_that_cannot_be_written_stops_the_job():
    """A stdout opened read-only (`poprun ... 1</dev/null`): one line, exit 74."""
    command = shlex.join(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                     PY, "-c", "print('x')"))
    done = subprocess.run(["sh", "-c", f"{command} 1</dev/null"], env=poprun_env(),
                          stderr=subprocess.PIPE, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == OUTPUT_ERROR, err
    assert "Traceback" not in err
    assert re.search(r"^poprun: stopped: cannot write poprun's stdout: Bad file descriptor$",
                     err, re.M), err


STDERR_NEEDED = {  # what makes poprun write to its stderr
    "instance-stderr": ("import sys; print('out'); print('err', file=sys.stderr)",),
    "failure-report": ("print('out'); raise SystemExit(3)",),
    "verbose": ("print('out')", "-v"),
}


@pytest.mark.parametrize("case", STDERR_NEEDED)
def test_a_stderr_that_cannot_be_written_ends_with_74_like_stdout(case, tmp_path):
    """`poprun ... 2<file` was once an internal error: exit 70, a crash file,
    `OSError: [Errno 9]` in _print_report. Whatever needed stderr (an instance's stderr line,
    the failure report, -v's messages): exit 74, no crash file, stdout intact and the reason
    in --result-json, which is still written."""
    program, *options = STDERR_NEEDED[case]
    state, result = tmp_path / "state", tmp_path / "result.json"
    state.mkdir(mode=0o700)
    done = _with_read_only_stderr(tmp_path, *options, f"--result-json={result}", PY, "-c",
                                  program, env={"XDG_RUNTIME_DIR": str(state)})
    assert done.returncode == OUTPUT_ERROR, done.stdout
    assert done.stdout and set(done.stdout.splitlines()) == {b"out"}
    assert not list(state.rglob("crash-*"))
    data = json.loads(result.read_text())
    assert (data["exit_code"], data["exit_reason"]) == (OUTPUT_ERROR, "output_error")
    assert data["output_error"] == "cannot write poprun's stderr: Bad file descriptor"


def test_a_stderr_that_cannot_be_written_is_no_error_when_nothing_needs_it(tmp_path):
    done = _with_read_only_stderr(tmp_path, PY, "-c", "print('out')")
    assert (done.returncode, done.stdout) == (0, b"out\nout\n")


def test_a_read_only_terminal_as_stderr_ends_with_74_too():
    """The terminal opened read-only as stderr (stdout the same terminal, so the dashboard
    is drawn): rendering the report for the terminal failed as an internal error (70)."""
    import pty
    import select

    master, slave = pty.openpty()
    read_only = os.open(os.ttyname(slave), os.O_RDONLY | os.O_NOCTTY)
    proc = subprocess.Popen(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                        "sh", "-c", "echo out; exit 3"),
                            env=poprun_env(), stdin=slave, stdout=slave, stderr=read_only)
    os.close(slave)
    os.close(read_only)
    seen = bytearray()
    try:
        while select.select([master], [], [], 60)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            seen += data
    finally:
        os.close(master)
        code = proc.wait(timeout=60)
    assert code == OUTPUT_ERROR, bytes(seen)
    assert b"out" in seen and b"internal error" not in seen


def _with_read_only_stderr(tmp_path, *args: str, env: dict[str, str] | None = None):
    readable = tmp_path / "stderr"
    readable.write_text("")
    command = shlex.join(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2", *args))
    return subprocess.run(["sh", "-c", f"{command} 2<{shlex.quote(str(readable))}"],
                          env=poprun_env(env), stdout=subprocess.PIPE, timeout=60)


@pytest.mark.parametrize("target", ["{tmp}/missing/result.json", "{tmp}"])
def test_a_result_json_that_cannot_be_written_is_refused_before_anything_starts(target,
                                                                                tmp_path):
    """It was a warning after the job had run, exit 0: now a usage error,
    as --output-filename's, and nothing runs."""
    target, witness = target.format(tmp=tmp_path), tmp_path / "ran"
    proc = run_poprun(*OFFLINE, f"--result-json={target}", "--num-instances=1",
                      "--num-replicas=1", "touch", str(witness))
    assert_usage_error(proc, f"--result-json {target}: cannot write it")
    assert not witness.exists()


def test_write_all_waits_for_a_slow_reader_of_a_non_blocking_pipe():
    """A full non-blocking pipe (a slow reader of poprun's stdout): every part arrives, in
    order, whatever the partial writes split (a real pipe, its reader a thread)."""
    import threading

    from poprun.fdio import write_all

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    parts = [b"a" * 100_000, memoryview(b"b" * 150_001)[1:], b"", b"c" * 70_000, b"\n"]
    got = bytearray()
    reader = threading.Thread(target=lambda: [got.extend(chunk) for chunk in
                                              iter(lambda: os.read(read_fd, 4096), b"")])
    reader.start()
    try:
        write_all(write_fd, *parts)
    finally:
        os.close(write_fd)
        reader.join(timeout=30)
        os.close(read_fd)
    assert not reader.is_alive()
    assert bytes(got) == b"".join(bytes(p) for p in parts)
