"""What an instance, another local user or another host can send poprun is hostile input:
real launches fed malformed HTTP on Horovod's rendezvous, idle connections, bytes that are
not UTF-8 in an MPI_Abort's message, out-of-range abort codes, a FIFO where popdist's files
belong and numbers too large for the progress tracker. Each ends the job as the instances'
own doing says (never as poprun's internal error, never hung). The fuzzed versions of these
surfaces are in tests/test_fuzz_surfaces.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, reaped, run_poprun, run_poprun_peak
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(120)


def n(count: int) -> tuple[str, ...]:
    return (*OFFLINE, f"--num-instances={count}", f"--num-replicas={count}")


# --- Horovod's rendezvous ---------------------------------------------------------------------

# An instance that sends the rendezvous one request and prints the status line it gets back.
SEND = """
import os, socket, sys
s = socket.create_connection((os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                              int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])), timeout=20)
s.sendall(sys.argv[1].encode("latin-1").decode("unicode_escape").encode("latin-1"))
reply = b""
while True:
    part = s.recv(4096)
    if not part:
        break
    reply += part
print("reply:", reply.split(b"\\r\\n")[0].decode())
"""

MALFORMED = [
    "PUT /a/b HTTP/1.1\\r\\nContent-Length: abc\\r\\n\\r\\n",
    "PUT /a/b HTTP/1.1\\r\\nContent-Length: -5\\r\\n\\r\\n",
    "PUT /a/b HTTP/1.1\\r\\nContent-Length: 99999999999999999999999\\r\\n\\r\\n",
    "PUT /a/b HTTP/1.1\\r\\nContent-Length: \\xb2\\r\\n\\r\\n",  # '²': isdigit() but no int
    "PUT /a/b HTTP/1.1\\r\\nContent-Length: 1\\r\\nContent-Length: 2\\r\\n\\r\\nab",
    "PUT /a/b HTTP/1.1\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n0\\r\\n\\r\\n",
    "GARBAGE\\r\\n\\r\\n",
    "GET /a/b HTTP/1.1 extra\\r\\n\\r\\n",
    "GET a/b HTTP/1.1\\r\\n\\r\\n",
    "\\x00\\xff\\r\\n\\r\\n",
]


@pytest.mark.parametrize("request_text", MALFORMED)
def test_a_malformed_request_to_the_rendezvous_gets_a_4xx_and_the_job_goes_on(request_text):
    proc = run_poprun(*n(2), sys.executable, "-c", SEND, request_text, timeout=60)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err[-2000:]
    replies = [line for line in proc.stdout.decode().splitlines() if line.startswith("reply:")]
    assert len(replies) == 2 and all(r.split()[2].startswith("4") for r in replies), replies


IDLE = """
import os, resource, socket, sys
address = (os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
           int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
held = []
for _ in range(int(sys.argv[1])):
    try:
        held.append(socket.create_connection(address, timeout=5))
        held[-1].sendall(b"GET")  # a request begun and never finished
    except OSError:
        break
# a real request still gets an answer while they are held
s = socket.create_connection(address, timeout=60)
s.sendall(b"GET /global/0 HTTP/1.1\\r\\nContent-Length: 0\\r\\n\\r\\n")
print("answer:", s.recv(100).split(b"\\r\\n")[0].decode(), "held:", len(held), flush=True)
"""


def test_idle_connections_cannot_use_up_the_launchers_descriptors():
    # poprun at a non-root user's soft limit of descriptors; 1,100 connections held open
    # would each cost it one without a bound (EMFILE in accept ends a job as exit 70)
    proc = subprocess.run(
        ["sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh",
         *poprun_argv(*n(1), sys.executable, "-c", IDLE, "1100")],
        env=poprun_env(), capture_output=True, timeout=100)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err[-2000:]
    assert b"answer: HTTP/1.1 404" in proc.stdout, proc.stdout[-500:]


# Ten PUTs of 60 MB (refused before their bodies are read), then 64 KiB values under new keys
# until the store is full: poprun's memory stays what it was, give or take the store.
FLOOD = """
import os, socket
address = (os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
           int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]))

def put(key, size, body=True):
    s = socket.create_connection(address, timeout=30)
    s.sendall(b"PUT /flood/%d HTTP/1.1\\r\\nContent-Length: %d\\r\\n\\r\\n" % (key, size))
    try:
        if body:
            s.sendall(b"x" * size)
    except OSError:  # refused and closed before the body was read
        pass
    reply = s.recv(100)
    s.close()
    return reply.split(b" ")[1] if reply else b""

refused = [put(i, 60_000_000, body=False) for i in range(10)]
stored = 0
while put(1000 + stored, 65536) == b"200":
    stored += 1
print("refused:", b",".join(sorted(set(refused))).decode(), "stored:", stored, flush=True)
"""


def test_what_the_rendezvous_stores_is_bounded():
    proc, peak = run_poprun_peak(*n(2), sys.executable, "-c",
                                 f"import os\nif os.environ['PMI_RANK'] == '0':\n"
                                 f"    exec({FLOOD!r})", timeout=90)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    flood = proc.stdout.decode().split()
    assert flood[:2] == ["refused:", "413"], flood
    assert 100 < int(flood[3]) <= (16 << 20) // 65536, flood  # MAX_STORE's worth at most
    assert peak < 100 * 1024, f"poprun's peak RSS {peak} KiB"  # ~24 MiB idle, 16 MiB stored


# --- MPI_Abort ----------------------------------------------------------------------------------

ABORT = """
import os, socket, sys
s = socket.socket(fileno=int(os.environ["PMI_FD"]))
s.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\\n" + sys.argv[1].encode("latin-1")
          .decode("unicode_escape").encode("latin-1") + b"\\n")
s.recv(100)
s.recv(100)  # poprun ends us
"""


def abort_run(line: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return run_poprun(*n(2), f"--result-json={tmp_path / 'r.json'}", *extra, sys.executable,
                      "-c", ABORT, line, timeout=60)


def test_an_abort_message_that_is_not_utf8_is_shown_escaped(tmp_path):
    proc = abort_run("cmd=abort exitcode=5 message=bad \\xff\\xfe bytes", tmp_path)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 5, err[-2000:]
    assert "bad \\xff\\xfe bytes" in err, err[-2000:]
    record = json.loads((tmp_path / "r.json").read_text())
    root = record["instances"][record["root_cause"]]
    assert root["outcome"] == "MPI_Abort: exit code 5: bad \\xff\\xfe bytes", root


def test_an_abort_message_from_a_remote_host_is_shown_escaped(tmp_path):
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = run_poprun(*n(2), "-H", "h1,h2", sys.executable, "-c", ABORT,
                          "cmd=abort exitcode=5 message=far \\xff bytes", env=hosts.env(),
                          timeout=100)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 5, err[-2000:]
    assert "MPI_Abort: exit code 5: far \\xff bytes" in err, err[-2000:]


@pytest.mark.parametrize("code, status", [("-3", 253), ("99999999999999999999", 255),
                                          ("300", 44)])
def test_an_abort_code_is_its_low_8_bits_said_as_the_aborts_code(code, status, tmp_path):
    proc = abort_run(f"cmd=abort exitcode={code} message=m", tmp_path)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == status, err[-2000:]
    root = next(line for line in err.splitlines() if "failed first" in line)
    assert root.endswith(f"MPI_Abort: exit code {code}: m"), err[-2000:]


# --- popdist's files ----------------------------------------------------------------------------

FIFO = """
import os, sys, time
if os.environ["PMI_RANK"] == "0":
    path = os.environ[sys.argv[1]]
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path)
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
sys.exit(3)  # a failure: poprun reads the error file
"""


def test_a_file_an_instance_can_replace_is_read_only_if_regular_and_small(tmp_path):
    from spawner.untrusted import read_regular

    (tmp_path / "file").write_bytes(b"x" * 100)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "file", tmp_path / "link")
    os.mkdir(tmp_path / "dir")
    assert read_regular(str(tmp_path / "file"), 100) == b"x" * 100
    assert read_regular(str(tmp_path / "file"), 99) is None  # larger than expected
    assert read_regular(str(tmp_path / "file"), 99, cut=True) == b"x" * 99
    for name in ("fifo", "link", "dir", "absent"):  # the FIFO's open() does not block
        assert read_regular(str(tmp_path / name), 100) is None, name
    assert read_regular("/dev/zero", 100) is None


@pytest.mark.parametrize("variable", ["POPDIST_PROGRESS_FILE", "POPDIST_ERROR_FILE"])
def test_a_fifo_for_popdists_file_never_blocks_the_launcher(variable):
    proc = run_poprun(*n(2), sys.executable, "-c", FIFO, variable, "3", timeout=40)
    assert proc.returncode == 3, proc.stderr.decode(errors="replace")[-2000:]


def test_sigterm_is_acted_on_with_a_fifo_for_the_progress_file():
    with reaped(subprocess.Popen(poprun_argv(*n(2), sys.executable, "-c", FIFO,
                                             "POPDIST_PROGRESS_FILE", "60"),
                                 env=poprun_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)) as proc:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, "poprun ended before its instances were ready"
            ready += line == b"ready\n"
        time.sleep(2.5)  # the progress watch samples once a second: let it reach the FIFO
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err.decode(errors="replace")[-2000:]


# --- progress numbers ------------------------------------------------------------------------

def test_progress_pattern_numbers_too_large_for_the_tracker_are_ignored(tmp_path):
    """Both instances print steps beyond what the tracker holds; instance 1 then one it
    holds: the job's progress (--result-json: the tracker's last report) has no step for 0
    and 1's last, and -v says so once."""
    program = ("import os, time\n"
               "for i in range(40):\n"
               "    print('step %d/%d' % (10**400 + i, 10**401), flush=True)\n"
               "    time.sleep(0.1)\n"
               "if os.environ['RANK'] == '1': print('step 3/9', flush=True)\n")
    result = tmp_path / "result.json"
    proc = run_poprun(*n(2), "-v", r"--progress-pattern=step (\d+)/(\d+)",
                      f"--result-json={result}", sys.executable, "-c", program, timeout=60)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err[-2000:]
    assert err.count("progress-pattern") == 1, err[-2000:]  # said once, at -v
    progress = json.loads(result.read_text())["progress"]
    assert progress["source"] == "pattern"
    steps = {i["index"]: (i["step"], i["total"]) for i in progress["instances"]}
    assert steps == {0: (None, None), 1: (3, 9)}, progress


def test_popdist_progress_of_a_huge_step_does_not_raise(tmp_path):
    program = "import popdist; popdist.progress(2**64, 5); popdist.progress(-2**70); print('ok')"
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60,
                          env=poprun_env({"POPDIST_PROGRESS_FILE": str(tmp_path / "p")}))
    assert proc.stdout == b"ok\n", proc.stderr.decode()[-2000:]


# --- the worlds a user does not use, turned off -----------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worlds", ["auto", "none"])
def test_mpi_worlds_none_serves_no_rendezvous_and_no_world(worlds):
    """`--mpi-worlds none` turns every world off, Horovod's rendezvous (the one port poprun
    listens on) included: the instances get neither its address nor a PMI socket, and poprun
    says so at -v. `auto` serves both."""
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "-v",
                      f"--mpi-worlds={worlds}", sys.executable, "-c",
                      "import os; print(os.environ.get('HOROVOD_GLOO_RENDEZVOUS_ADDR'), "
                      "os.environ.get('PMI_FD'), flush=True)")
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, err
    lines = [line.split() for line in out.splitlines() if line.strip()]
    assert len(lines) == 2, out
    if worlds == "none":
        assert all(words == ["None", "None"] for words in lines), out
        assert "no Horovod rendezvous: --mpi-worlds none" in err
    else:
        assert all(words[0] != "None" and words[1] != "None" for words in lines), out
        assert "Horovod's Gloo rendezvous:" in err
