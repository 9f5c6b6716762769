"""`poprun --host ...` end to end against real OpenSSH servers on loopback (tests/sshd_hosts.py).

Every instance prints `$POPRUN_SSH_CONNECTION` (its agent's SSH_CONNECTION), whose server
address (127.0.77.k) says which "host" it ran on. Orphan checks look for the instances' marked command lines in /proc: all the hosts
are this machine, so a survivor on any host is visible here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, poprun_argv, poprun_env
from poprun import LaunchConfig, __version__, launch
from poprun.errors import LaunchError
from requires import require_module
from sshd_hosts import SshHosts, processes_with, start_ssh_hosts, wait_until
from sshd_hosts import instances_with, kill_marked

pytestmark = pytest.mark.timeout(90)
PY = sys.executable
TIMEOUT = 60


@pytest.fixture
def hosts(tmp_path: Path):
    with start_ssh_hosts(2, tmp_path) as h:
        yield h


def run(hosts: SshHosts, *args: str, env: dict[str, str] | None = None, cwd=None,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(poprun_argv(*OFFLINE, *args), env=poprun_env({**hosts.env(),
                          **(env or {})}), cwd=cwd, capture_output=True, timeout=timeout)


def start(hosts: SshHosts, *args: str, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(poprun_argv(*OFFLINE, *args), env=poprun_env(hosts.env()), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def lines_by_instance(stdout: bytes) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in stdout.decode().splitlines():
        tag, _, text = line.partition("<stdout>:")
        out.setdefault(int(tag[1:-1].split(",")[1]), []).append(text)
    return out


def test_instances_run_in_contiguous_blocks_on_each_host_with_their_environment(hosts, tmp_path):
    report = ('import json, os; print(json.dumps({k: os.environ.get(k) for k in ('
              '"POPRUN_SSH_CONNECTION", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",'
              ' "MASTER_PORT", "PYTHONPATH", "POPDIST_EXECUTABLE_CACHE_PATH", "FROM_X", "UNRELATED", "IPUOF_CONFIG_PATH")}'
              '| {"cwd": os.getcwd()}))')
    proc = run(hosts, "--host", "h1,h2", "--num-instances=4", "--num-replicas=8",
               "--tag-output", "-x", "FROM_X=1", PY, "-c", report, cwd=tmp_path,
               env={"UNRELATED": "not forwarded", "IPUOF_CONFIG_PATH": "/x"})
    assert proc.returncode == 0, proc.stderr.decode()
    seen = {i: json.loads(lines[0]) for i, lines in lines_by_instance(proc.stdout).items()}
    assert sorted(seen) == [0, 1, 2, 3]
    for i, env in seen.items():
        assert env["POPRUN_SSH_CONNECTION"].split()[2] == f"127.0.77.{i // 2 + 1}"
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(i), str(i % 2), "4")
        assert env["MASTER_ADDR"] == "127.0.77.1"  # the first host, as the others reach it
        assert env["PYTHONPATH"] and env["FROM_X"] == "1"
        assert env["UNRELATED"] is None and env["IPUOF_CONFIG_PATH"] is None
        assert env["cwd"] == str(tmp_path)
    assert len({seen[i]["MASTER_PORT"] for i in seen}) == 1
    caches = {seen[i]["POPDIST_EXECUTABLE_CACHE_PATH"] for i in seen}
    assert len(caches) == 2  # one temporary cache per host, shared by its instances
    assert not any(os.path.exists(c) for c in caches)  # removed at exit


def test_arguments_arrive_byte_for_byte_on_a_remote_host(hosts):
    tricky = ["a b", "$HOME", ";rm -rf x", "it's \"quoted\"", "`id`", "", "*"]
    proc = run(hosts, "-H", "h2", PY, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))",
               *tricky)
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout) == tricky


def test_first_failure_anywhere_stops_every_host(hosts):
    marker = f"m{uuid.uuid4().hex}"
    program = ("import os, sys, time; i = int(os.environ['RANK']); "
               "print('up', flush=True); "
               "sys.exit(3) if i == 3 else time.sleep(300)")
    proc = run(hosts, "--host=h[1-2]", "--num-instances=4", "--num-replicas=4",
               "--kill-timeout=2", PY, "-c", program, marker)
    err = proc.stderr.decode()
    assert proc.returncode == 3, err
    assert "instance 3" in err and "on h2" in err and "exited with status 3" in err, err
    assert not processes_with(marker)


def wait_for_instances(marker: str, count: int) -> list[int]:
    wait_until(lambda: len(instances_with(marker)) >= count, f"{count} instances running")
    return instances_with(marker)


def test_sigkill_of_poprun_leaves_no_instance_on_any_host(hosts):
    marker = f"m{uuid.uuid4().hex}"
    proc = start(hosts, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4", PY, "-c",
                 "import time; time.sleep(300)", marker)
    try:
        assert len(wait_for_instances(marker, 4)) == 4
        proc.kill()
        proc.wait(timeout=10)
        # (a zombie has no command line: the instances have exited once none matches)
        wait_until(lambda: not processes_with(marker), "the instances to die", timeout=15)
    finally:
        proc.kill()
        kill_marked(marker)  # what poprun's watchdog left, if the test failed


def test_ctrl_c_reaches_every_remote_instance(hosts):
    marker = f"m{uuid.uuid4().hex}"
    proc = start(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2", PY, "-c",
                 "import time; time.sleep(300)", marker)
    try:
        wait_for_instances(marker, 2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err.decode()
        assert not processes_with(marker)
    finally:
        proc.kill()
        kill_marked(marker)


@pytest.mark.usefixtures("dead_host_leftovers")
def test_a_host_lost_mid_run_ends_the_job_naming_it_and_stops_the_others(hosts):
    marker = f"m{uuid.uuid4().hex}"
    proc = start(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
                 "--kill-timeout=2", "--tag-output", PY, "-c",
                 "import os, time; print(os.environ['POPDIST_EXECUTABLE_CACHE_PATH'], "
                 "flush=True); time.sleep(300)", marker)
    caches: dict[int, list[str]] = {}
    try:
        # Each instance prints its cache dir once it runs (the test's timeout bounds this).
        caches = lines_by_instance(proc.stdout.readline() + proc.stdout.readline())
        assert sorted(caches) == [0, 1] and all(os.path.isdir(c[0]) for c in caches.values())
        hosts.kill_host(1)
        _, err = proc.communicate(timeout=30)
        text = err.decode()
        assert proc.returncode != 0
        assert "h2: lost the connection to the host" in text, text
        wait_until(lambda: not processes_with(marker), "no instance left", timeout=15)
        assert not os.path.exists(caches[0][0])  # the surviving host's agent cleaned up
    finally:
        proc.kill()


def test_unknown_host_key_fails_fast_naming_the_host_and_starts_nothing(hosts, tmp_path):
    hosts.known_hosts.write_text("")
    marker = tmp_path / "started"
    proc = run(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2", "--ssh-timeout=5",
               "touch", str(marker), timeout=20)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("poprun: error: h") for line in lines), err
    assert all("host key" in line for line in lines), err
    assert not marker.exists()


async def test_a_working_directory_missing_on_a_host_is_named(hosts, monkeypatch):
    # All "hosts" share this file system, so the directory is missing for the launcher too:
    # the Python API takes the working directory as an argument, the CLI could not start.
    config = LaunchConfig(program=(PY, "-c", "pass"), hosts=("h1",), offline_mode=True,
                          num_instances=1, num_replicas=2)
    monkeypatch.setenv("HOME", str(hosts.home))  # where asyncssh finds the ssh config
    with pytest.raises(LaunchError, match=r"h1: the working directory /no/such/dir does not "
                                          r"exist there"):
        await launch(config, cwd="/no/such/dir", environ=poprun_env(hosts.env()))


def test_a_program_missing_on_a_host_is_named(hosts):
    proc = run(hosts, "-H", "h1", "no-such-program-anywhere")
    assert_usage_error(proc, "h1: program 'no-such-program-anywhere' not found")


def test_a_remote_python_that_does_not_exist_is_a_clear_error(hosts):
    proc = run(hosts, "-H", "h1", "--remote-python=/no/such/python", PY, "-c", "pass")
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "poprun: error: h1:" in err and "/no/such/python" in err, err
    assert "Traceback" not in err


# no switch: the machine's CPUs
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_remote_instances_are_bound_from_the_hosts_own_topology(hosts):
    """The agent reports its host's sysfs and cpuset; the plan binds from them and the agent
    binds each instance before it starts: its grandchild shows the same single CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    proc = run(hosts, "-H", "h1", "--num-instances=2", "--num-replicas=2", "--tag-output",
               "--process-placement=close", "sh", "-c",
               "sh -c 'grep Cpus_allowed_list /proc/self/status'")
    assert proc.returncode == 0, proc.stderr.decode()
    seen = lines_by_instance(proc.stdout)
    assert seen == {i: [f"Cpus_allowed_list:\t{cpus[i]}"] for i in (0, 1)}


def test_check_reports_every_host_in_one_table(hosts):
    proc = run(hosts, "--check", "-H", "h1,h2")
    out = proc.stdout.decode()
    assert proc.returncode == 0, (out, proc.stderr.decode())
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:3]}
    for host in ("h1", "h2"):
        assert rows[host][1:6] == ["ok", ".".join(map(str, sys.version_info[:3])),
                                   __version__, "ok", "-"], out
    assert "2 of 2 host(s) ready" in out


def test_check_folds_failures_by_kind_and_exits_30(hosts):
    lines = hosts.known_hosts.read_text().splitlines()
    hosts.known_hosts.write_text(lines[0] + "\n")  # h2's key unknown
    proc = run(hosts, "--check", "-H", "h1,h2", "--ssh-timeout=5", "no-such-program-x")
    out = proc.stdout.decode()
    assert proc.returncode == 30, out  # hosts that cannot run the job (no retry helps)
    assert "unknown host key: h2" in out and "program not found: h1" in out, out
    assert "0 of 2 host(s) ready" in out


def test_distribute_ssh_key_without_a_terminal_is_a_clear_error(hosts, tmp_path):
    """The password is read from the terminal only (never echoed from a pipe): with none,
    one error line and nothing launched. (Installing keys is tested in test_sshkeys.py.)"""
    marker = tmp_path / "started"
    (tmp_path / "keys").mkdir()  # a folder, as in PopRun's guide
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "--distribute-ssh-key", "--distribute-ssh-key-type=ed25519",
                    f"--distribute-ssh-key-path={tmp_path / 'keys'}", "-H", "h1", "touch",
                    str(marker)),
        env=poprun_env(hosts.env()), stdin=subprocess.DEVNULL, capture_output=True,
        timeout=TIMEOUT, start_new_session=True)  # no controlling terminal
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.count("poprun: error:") == 1 and "terminal" in err, err
    assert (tmp_path / "keys" / "id_ed25519.pub").exists()  # the key asked for was made
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_torch_ddp_example_trains_across_two_hosts(hosts):
    """examples/torch_ddp.py, one instance per host: gloo meets at MASTER_ADDR (h1's address)
    and both instances end with the same parameters only if every all-reduce crossed hosts."""
    require_module("torch", "POPRUN_REQUIRE_TOOLS", "pip install torch==2.13.0")
    example = Path(__file__).resolve().parent.parent / "examples" / "torch_ddp.py"
    proc = run(hosts, "--host", "h1,h2", "--num-instances=2", "--num-replicas=2",
               "--tag-output", PY, str(example), "--epochs", "2", "--samples", "512",
               timeout=110)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    finals = {i: [line for line in lines if ": final loss " in line]
              for i, lines in lines_by_instance(proc.stdout).items()}
    assert sorted(finals) == [0, 1] and all(len(f) == 1 for f in finals.values()), finals
    assert finals[0][0].split(": ", 1)[1] == finals[1][0].split(": ", 1)[1]  # loss + checksum


def test_an_explicit_cache_path_is_used_as_given_on_every_host(hosts, tmp_path):
    cache = tmp_path / "shared-cache"
    proc = run(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
               f"--executable-cache-path={cache}", "--tag-output", PY, "-c",
               "import os; print(os.environ['POPDIST_EXECUTABLE_CACHE_PATH'])")
    assert proc.returncode == 0, proc.stderr.decode()
    assert {i: lines for i, lines in lines_by_instance(proc.stdout).items()} == {
        0: [str(cache)], 1: [str(cache)]}
    assert cache.is_dir()  # created there (by the agents: no instance runs locally), and kept


def test_result_json_has_each_hosts_launch_phases(hosts, tmp_path):
    proc = run(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2",
               "--result-json", str(tmp_path / "r.json"), PY, "-c", "print('x')")
    assert proc.returncode == 0, proc.stderr.decode()
    phases = json.loads((tmp_path / "r.json").read_text())["phases"]
    for host in ("h1", "h2"):
        p = phases[host]
        assert 0 < p["connected"] <= p["agent_ready"] <= p["first_started"] <= p["first_output"]


# no switch: the machine's CPUs
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_report_bindings_covers_remote_instances(hosts):
    """The agent reads each instance's binding from /proc on its host when it starts it."""
    cpus = sorted(os.sched_getaffinity(0))
    proc = run(hosts, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4",
               "--process-placement=close", "--report-bindings", PY, "-c",
               "import time; time.sleep(0.3)")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    for index in range(4):
        host = "h1" if index < 2 else "h2"
        assert re.search(rf"instance {index} \(pid \d+\) on {host}: cpus {cpus[index % 2]}, "
                         r"memory \w+", err), (index, err)
    assert "POPRUN [W]" not in err  # every binding is the planned one


# --- a stop that reaches every host at once -----------------------------------------------------

YES = 'while 1: print("y" * 100)'


def piped_to_head(hosts: SshHosts, *args: str) -> tuple[float, int, str]:
    """`poprun ... | head -1`: seconds from head's exit to poprun's, poprun's status, stderr."""
    proc = subprocess.Popen(poprun_argv(*OFFLINE, "--kill-timeout=15", *args),
                            env=poprun_env(hosts.env()), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    with proc:
        head = subprocess.run(["head", "-1"], stdin=proc.stdout, stdout=subprocess.DEVNULL,
                              timeout=TIMEOUT)
        proc.stdout.close()
        gone = time.monotonic()
        err = proc.stderr.read().decode()  # EOF: poprun has ended
        proc.wait(timeout=TIMEOUT)
    assert head.returncode == 0
    return time.monotonic() - gone, proc.returncode, err


@pytest.mark.timeout(240)
def test_a_broken_pipe_stops_every_remote_instance_at_once(hosts):
    """`poprun --host h1,h2 ... | head -1`, 30 times: every run ends long before the kill
    timeout (15 s). In 4 of 13 runs the instances never got SIGTERM: the first line came
    while h2 was still starting, the stop reached no host, and spawn_remote then forwarded
    SIGPIPE, which Python ignores."""
    for run_index in range(30):
        seconds, status, err = piped_to_head(hosts, "--host", "h1,h2", "--num-instances=2",
                                             "--num-replicas=2", PY, "-c", YES)
        assert status == 128 + signal.SIGPIPE, (run_index, err)
        assert seconds < 2.5, (run_index, seconds, err)
        assert "SIGKILL" not in err, (run_index, err)


@pytest.mark.timeout(120)
def test_a_broken_pipe_while_a_host_still_starts_reaches_every_instance(hosts):
    """The race made certain: h1's one instance prints while h2 still starts its 31, so
    poprun's stdout breaks before spawn_remote knows them all. SIGTERM reaches h1's at once
    and h2's as they start; none waits for the kill timeout."""
    for run_index in range(3):
        seconds, status, err = piped_to_head(hosts, "--host", "h1:1,h2:31",
                                             "--num-instances=32", "--num-replicas=32",
                                             PY, "-c", YES)
        assert status == 128 + signal.SIGPIPE, (run_index, err)
        assert seconds < 8, (run_index, seconds, err)
        assert "terminated by poprun (SIGTERM)" in err and "SIGKILL" not in err, err


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ancestors(pid: int) -> list[int]:
    chain = [_parent(pid)]
    while chain[-1] > 1:
        chain.append(_parent(chain[-1]))
    return chain


def _environ_and_cmdline(pid: int) -> bytes | None:
    try:
        return b"\0".join(Path(f"/proc/{pid}/{part}").read_bytes()
                          for part in ("environ", "cmdline"))
    except PermissionError:  # pid 1 of a container, as root of its namespace
        return None


def test_no_ancestor_of_a_remote_instance_holds_a_secret_of_the_launch(hosts):
    """Over SSH: the agent's stream is the SSH channel itself, so no secret of
    the launch (the Slurm callback's, POPRUN_AGENT_*) is ever handed to an agent. Every
    ancestor of every instance up to pid 1 (the agent, sshd's session, sshd...) whose files
    can be read has none in its environment or command line."""
    marker = f"m{uuid.uuid4().hex}"
    proc = start(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2", PY, "-c",
                 "import time; time.sleep(300)", marker)
    try:
        instances = wait_for_instances(marker, 2)
        agents = {_parent(pid) for pid in instances}
        walked = {ancestor for pid in instances for ancestor in _ancestors(pid)}
        seen = {pid: _environ_and_cmdline(pid) for pid in walked}
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    read = {pid: text for pid, text in seen.items() if text is not None}
    assert 1 in walked and agents <= set(read)  # up to pid 1; the agents' files were read
    assert any(b"sshd" in text for text in read.values())
    assert not [pid for pid, text in read.items() if b"POPRUN_AGENT_" in text]
