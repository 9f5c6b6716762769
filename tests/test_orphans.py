"""No orphan at any instant, no escaped descendant, on every host.

Real processes throughout, and real OpenSSH servers for the remote cases (tests/sshd_hosts.py:
every "host" is this machine, so a survivor anywhere is visible in this /proc). Each process
worth watching carries a unique marker in its command line.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from spawner.local import ProcessSpec

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprun, wait_started
from sshd_hosts import (freeze, instances_with, kill_marked, processes_with, start_ssh_hosts,
                        thaw, wait_until, watchdog_of)

PY = sys.executable
SLEEPER = "import time; print('ready', flush=True); time.sleep(300)"
GONE = 10.0  # seconds survivors get to disappear after poprun's end


def marker() -> str:
    return f"orphan-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tmp(tmp_path: Path) -> dict[str, str]:
    """The job's own TMPDIR, so its local cache dirs can be counted."""
    (tmp_path / "tmp").mkdir()
    return {"TMPDIR": str(tmp_path / "tmp")}


@pytest.fixture
def hosts(tmp_path: Path):
    with start_ssh_hosts(2, tmp_path, setenv=lambda h: {"TMPDIR": str(_remote_tmp(h.dir))}) as h:
        yield h


def _remote_tmp(host_dir: Path) -> Path:
    """The hosts' sessions' own TMPDIR (sshd's SetEnv), beside the hosts' directories: other
    poprun runs on this machine (tests in parallel, benchmarks) make caches in /tmp too, and a
    before/after count there would see theirs come and go. Made here: tempfile falls back to
    /tmp where TMPDIR does not exist."""
    path = host_dir.parent / "remote-tmp"
    path.mkdir(exist_ok=True)
    return path


def remote_caches(hosts) -> set[Path]:
    """The caches agents made in the hosts' sessions' TMPDIR."""
    return set(_remote_tmp(hosts.hosts[0].dir).glob("poprun-cache-*"))


def assert_all_gone(mark: str, tmpdir: str | None = None, before: set[Path] | None = None,
                    hosts=None):
    wait_until(lambda: not processes_with(mark), f"every process marked {mark} to die", GONE)
    if tmpdir is not None:
        assert not list(Path(tmpdir).glob("poprun-cache-*"))
    if before is not None:
        wait_until(lambda: not (remote_caches(hosts) - before), "the hosts' caches to go", GONE)


# --- 1. SIGKILL of poprun at any moment of the start-up ----------------------------------------

def kill_at_random_moments(runs: int, args: list[str], env: dict[str, str], seed: int):
    """`runs` launches, each SIGKILLed after a random 0-0.5 s; yields each run's marker
    once poprun is dead (the survivors are then the watchdogs' business)."""
    rng = random.Random(seed)
    for _ in range(runs):
        mark = marker()
        proc = subprocess.Popen(poprun_argv(*OFFLINE, *args, PY, "-c", SLEEPER, mark),
                                env=poprun_env(env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0, 0.5))  # the moment of death is the test's input
        proc.kill()
        proc.wait()
        yield mark


@pytest.mark.timeout(300)
def test_sigkill_during_start_up_leaves_nothing_locally(tmp):
    for mark in kill_at_random_moments(50, ["--num-instances=8", "--num-replicas=8"], tmp,
                                       seed=13):
        assert_all_gone(mark, tmp["TMPDIR"])


@pytest.mark.timeout(300)
def test_sigkill_during_start_up_leaves_nothing_on_remote_hosts(hosts, tmp):
    before = remote_caches(hosts)
    for mark in kill_at_random_moments(50, ["-H", "localhost,h1,h2", "--num-instances=6",
                                            "--num-replicas=6"], {**hosts.env(), **tmp},
                                       seed=31):
        assert_all_gone(mark, tmp["TMPDIR"], before, hosts)


# --- 2. descendants that leave the process group ---------------------------------------------

def escaping_program(mark: str, then: str) -> list[str]:
    """Starts a `setsid` helper and a double-forked daemon (both marked), says so, then
    `then` (Python: exit 0, exit 3, or sleep). The helpers' markers are built at run time,
    so that poprun's own command line (which holds this script) does not carry them."""
    script = f"""
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{mark}" + "-setsid"],
                 start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)",
                                  "{mark}" + "-daemon"])
    os._exit(0)
os.wait()
print("helpers started", flush=True)
{then}
"""
    return [PY, "-c", script]


def helpers_running(mark: str) -> bool:
    return bool(processes_with(f"{mark}-setsid")) and bool(processes_with(f"{mark}-daemon"))


ENDINGS = {"success": ("sys.exit(0)", 0), "failure": ("sys.exit(3)", 3),
           "ctrl-c": ("time.sleep(300)", 130)}


def run_escaping_job(args: list[str], ending: str, env: dict[str, str], mark: str) -> int:
    then, _ = ENDINGS[ending]
    proc = subprocess.Popen(poprun_argv(*OFFLINE, *args, *escaping_program(mark, then)),
                            env=poprun_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        if ending == "ctrl-c":
            wait_until(lambda: helpers_running(mark), "the helpers to start", 30)
            proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cgroups", ["1", "0"], ids=["cgroups", "mark-and-subreaper"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_escaped_helpers_die_with_a_local_job(ending, cgroups, tmp):
    """With a cgroup per instance (where writable, as here), and without (POPRUN_CGROUPS=0:
    the environment mark and the child subreaper)."""
    mark = marker()
    code = run_escaping_job(["--num-instances=2", "--num-replicas=2"], ending,
                            {**tmp, "POPRUN_CGROUPS": cgroups}, mark)
    assert code == ENDINGS[ending][1]
    assert_all_gone(mark, tmp["TMPDIR"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_escaped_helpers_die_with_a_remote_job(ending, hosts, tmp):
    mark = marker()
    before = remote_caches(hosts)
    code = run_escaping_job(["-H", "h1,h2", "--num-instances=2", "--num-replicas=2"], ending,
                            {**hosts.env(), **tmp}, mark)
    assert code == ENDINGS[ending][1]
    assert_all_gone(mark, before=before, hosts=hosts)


def cgroups_here() -> bool:
    """Whether this host gives poprun a cgroup v2 subtree (what LocalSpawner tries)."""
    from spawner.containment import Cgroups

    found = Cgroups.create(f"probe-{uuid.uuid4().hex[:8]}")
    if found is None:
        return False
    os.rmdir(found.root)
    return True


# Waits (bounded) until it is in its own cgroup, as poprun moves it there right after its
# spawn, then prints that cgroup.
IN_CGROUP = ("import sys, time\n"
             "deadline = time.monotonic() + 10\n"
             "while '/poprun-' not in open('/proc/self/cgroup').read().splitlines()[-1]:\n"
             "    if time.monotonic() > deadline: sys.exit('never moved into a cgroup')\n"
             "    time.sleep(0.01)\n"
             "print(open('/proc/self/cgroup').read().splitlines()[-1])\n")


def test_verbose_names_the_containment_in_force(tmp):
    """-v says which mechanism holds; where this host allows cgroups, each instance really
    is in a cgroup of its own."""
    proc = subprocess.run(poprun_argv(*OFFLINE, "-v", "--num-instances=2", "--num-replicas=2",
                                      PY, "-c", IN_CGROUP if cgroups_here() else "pass"),
                          env=poprun_env(tmp), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    line = next(l for l in proc.stderr.decode().splitlines() if "containment:" in l)
    assert "child subreaper" in line
    if cgroups_here():
        assert "a cgroup per instance under " in line
        root = line.split("a cgroup per instance under ")[1].split(",")[0]
        assert sorted(proc.stdout.decode().split()) == [
            f"0::/{Path(root).name}/i0", f"0::/{Path(root).name}/i1"]
        assert not Path(root).exists()  # removed with the job
    else:
        assert "the POPRUN_LIFELINE environment mark" in line


# The instance: a helper of its own session (escaped from the process group) that holds
# 200 MiB, while the instance itself only waits.
HOLDER = f"""\
import subprocess, sys, time
exec({IN_CGROUP!r})
subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(200 << 20); "
                  "open(sys.argv[1], 'w').close(); time.sleep(300)", sys.argv[2]],
                 start_new_session=True)
time.sleep(300)
"""


def test_an_instance_s_memory_counts_its_escaped_helpers_where_it_has_a_cgroup(tmp, tmp_path):
    """`poprunctl show` (and the dashboard, which samples the same way) gives an instance's
    whole memory from its cgroup: a helper in a session of its own counts."""
    if not cgroups_here():
        # no switch: cgroup v2 delegation, the machine's
        pytest.skip("no writable cgroup v2 subtree here: usage is the leader process's")
    env = {**tmp, "XDG_RUNTIME_DIR": str(tmp_path)}
    mark = marker()
    holding = tmp_path / "holding"
    proc = subprocess.Popen(poprun_argv(*OFFLINE, "--num-instances=1", "--num-replicas=1",
                                        PY, "-c", HOLDER, mark, str(holding)),
                            env=poprun_env(env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_until(holding.exists, "the helper to hold its memory", 30)
        show = subprocess.run([PY, "-m", "poprun.cli.ctl", "show", "--json",
                               _only_job(env)], env=poprun_env(env), capture_output=True,
                              text=True, timeout=60)
        (row,) = __import__("json").loads(show.stdout)["instances"]
        assert row["rss"] >= 200 << 20, row  # the leader alone holds ~10 MiB
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_all_gone(mark)


def _only_job(env: dict[str, str]) -> str:
    from poprun.jobctl import records as jobs

    (record,) = jobs.scan(env).records
    return record["id"]


# --- 3. signals before poprun is ready ---------------------------------------------------------

def handlers_installed(pid: int) -> bool:
    """poprun catches SIGTERM (the interpreter does not): its first instructions ran."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone already
    caught = int(next(l for l in status.splitlines() if l.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_in_the_first_100_ms_is_one_clean_line(sig, tmp):
    """From poprun's first instruction on, through its imports and the start of the job."""
    rng = random.Random(sig)
    for delay in sorted(rng.uniform(0, 0.1) for _ in range(8)):
        mark = marker()
        # The instances are shells: a Python instance's own start-up can print a
        # KeyboardInterrupt traceback when the forwarded SIGINT meets it.
        proc = subprocess.Popen(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                            "sh", "-c", "sleep 300; :", mark),
                                env=poprun_env(tmp), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            wait_until(lambda: handlers_installed(proc.pid), "poprun's first instructions",
                       10)
            time.sleep(delay)  # the moment of the signal is the test's input
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:  # a poprun that did not stop, and its instances, end with the test
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
                kill_marked(mark)
        assert proc.returncode == 128 + sig, (delay, err.decode())
        assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()
        assert_all_gone(mark, tmp["TMPDIR"])


def test_closed_standard_descriptors_are_not_reused(tmp_path):
    """`poprun ... >&-` (and with stdin or stderr closed): the job runs, its output goes
    nowhere rather than into poprun's own pipes, and poprun exits 0."""
    out = tmp_path / "witness"
    script = f"import os; print('out'); open({str(out)!r} + os.environ['RANK'], 'w').write('ran')"
    command = shlex.join(poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                                     PY, "-c", script))
    for closes in ("1>&-", "0<&- 1>&- 2>&-", "2>&-", "0<&-"):
        done = subprocess.run(["sh", "-c", f"{command} {closes}"], env=poprun_env(),
                              capture_output=True, timeout=60)
        assert done.returncode == 0, (closes, done.stderr.decode())
        assert b"Traceback" not in done.stderr, done.stderr.decode()
        for name in ("witness0", "witness1"):
            assert (tmp_path / name).read_text() == "ran"
            (tmp_path / name).unlink()


# --- ProxyCommand: children poprun owns ----------------------------------------------------

def slow_proxy_host(hosts, mark: str) -> str:
    """An alias reached through a ProxyCommand that hangs (marked): the connection is under
    way for as long as the test likes."""
    h1 = hosts.hosts[0]
    block = (f"Host slowproxy\n    HostName {h1.addr}\n    Port {h1.port}\n"
             f"    User {hosts.user}\n    IdentityFile {hosts.user_key}\n"
             f"    UserKnownHostsFile {hosts.known_hosts}\n    BatchMode yes\n"
             f"    ProxyCommand {PY} -c \"import time; time.sleep(60)\" {mark}\n")
    hosts.ssh_config.write_text(block + hosts.ssh_config.read_text())
    return "slowproxy"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stop_during_a_proxycommand_connect_leaves_no_proxy(sig, hosts, tmp):
    mark = marker()
    alias = slow_proxy_host(hosts, mark)
    proc = subprocess.Popen(poprun_argv(*OFFLINE, "-H", alias, "--ssh-timeout=50",
                                        "--num-instances=1", "--num-replicas=1", "true"),
                            env=poprun_env({**hosts.env(), **tmp}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_until(lambda: processes_with(mark), "the ProxyCommand to run", 30)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == (128 + sig if sig != signal.SIGKILL else -sig), err.decode()
    if sig != signal.SIGKILL:
        assert b"Traceback" not in err, err.decode()
    assert_all_gone(mark, tmp["TMPDIR"])


# --- 4. a host that stops answering ----------------------------------------------------------

def start_frozen_host_job(env: dict[str, str], mark: str, host_timeout: float,
                          instances: int) -> subprocess.Popen:
    """A job of sleepers on h1 and h2 with a short --host-timeout, for freezing h2."""
    return subprocess.Popen(poprun_argv(*OFFLINE, "-H", "h1,h2",
                                        f"--host-timeout={host_timeout}",
                                        f"--num-instances={instances}",
                                        f"--num-replicas={instances}", PY, "-c", SLEEPER, mark),
                            env=poprun_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.timeout(90)
def test_a_frozen_path_ends_the_hosts_instances_within_the_host_timeout(hosts, tmp):
    """h2's sshd processes are frozen (SIGSTOP): its agent lives on but hears nothing. Its
    instances are gone within --host-timeout + 2 s, its cache too (the agent removes it on
    its own), and poprun reports h2 lost."""
    mark = marker()
    timeout = 4.0
    before = remote_caches(hosts)
    proc = start_frozen_host_job({**hosts.env(), **tmp}, mark, timeout, 2)
    frozen: list[int] = []
    try:
        wait_started(proc.pid, 2)
        assert len(instances_with(mark)) == 2  # what "gone" below is checked against
        frozen = hosts.sshd_pids(1)
        assert len(frozen) >= 2  # the listener, and the launcher's connection
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # h1's instance is stopped by poprun; h2's by its own agent, on hearing nothing.
        wait_until(lambda: not instances_with(mark), "both instances to be gone",
                   timeout + 2 + 1)
        assert time.monotonic() - stopped_at <= timeout + 2
        # h2's sshd is still frozen: only its agent can have removed its cache.
        wait_until(lambda: not (remote_caches(hosts) - before), "the hosts' caches to go", 5)
        _, err = proc.communicate(timeout=30)
    finally:
        thaw(frozen)
        proc.kill()
        proc.wait()
        kill_marked(mark)  # what a failed test left: h2's instances
    assert proc.returncode == 255, err.decode()
    assert "h2: lost the connection to the host (no word from the agent" in err.decode()


def agent_and_session(hosts, i: int) -> tuple[int, list[int]]:
    """Host `i`'s agent (the one child of its sshd session: `exec` made it so; its watchdog
    is detached: sshd_hosts.watchdog_of) and the sshd session processes it runs under (not the listener)."""
    session = [pid for pid in hosts.sshd_pids(i) if pid != hosts.hosts[i].proc.pid]
    agents = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
              if _parent(pid) in session and not _comm(pid).startswith("sshd")]
    assert len(agents) == 1, (agents, session)
    return agents[0], session


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


@pytest.mark.timeout(90)
def test_a_frozen_agent_s_instances_and_cache_go_within_the_host_timeout(hosts, tmp):
    """h2's agent and its sshd session are frozen (SIGSTOP): nothing there answers, and the
    agent cannot act on the launcher's silence. Its watchdog, beaten by the agent until then,
    kills it and what it started, and removes its cache, within --host-timeout + 3 s; poprun
    reports h2 lost (they once lived until SIGCONT, the cache stayed)."""
    mark = marker()
    timeout = 4.0
    before = remote_caches(hosts)
    proc = start_frozen_host_job({**hosts.env(), **tmp}, mark, timeout, 4)
    frozen: list[int] = []
    try:
        wait_started(proc.pid, 4)
        assert len(instances_with(mark)) == 4  # what "gone" below is checked against
        agent, session = agent_and_session(hosts, 1)
        frozen = [agent, *session]
        freeze(frozen)
        stopped_at = time.monotonic()
        wait_until(lambda: not instances_with(mark), "every instance to be gone", timeout + 5)
        assert time.monotonic() - stopped_at <= timeout + 3
        wait_until(lambda: not (remote_caches(hosts) - before), "the hosts' caches to go", 5)
        _, err = proc.communicate(timeout=30)
    finally:
        thaw(frozen)
        proc.kill()
        proc.wait()
        kill_marked(mark)  # what a failed test left: h2's instances
    assert proc.returncode == 255, err.decode()
    assert "h2: lost the connection to the host (no word from the agent" in err.decode()


@pytest.mark.timeout(120)
def test_reap_ends_what_a_lost_host_kept_when_nothing_there_could(hosts, tmp, tmp_path):
    """h2's agent, its watchdog and its sshd session all frozen: nothing on h2 can end its
    instances. poprun declares h2 lost and ends (255); its record keeps h2's lost instances
    and cache, so `poprunctl reap` (a new SSH session: h2's listener is not frozen) kills them
    and removes the cache; a second reap has nothing to do ("nothing to reap")."""
    (tmp_path / "run").mkdir()
    env = {**hosts.env(), **tmp, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    mark = marker()
    before = remote_caches(hosts)
    proc = start_frozen_host_job(env, mark, 3.0, 4)
    frozen: list[int] = []
    try:
        wait_started(proc.pid, 4, environ=env)
        agent, session = agent_and_session(hosts, 1)
        frozen = [agent, watchdog_of(agent), *session]
        freeze(frozen)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 255, err.decode()
        assert len(instances_with(mark)) == 2 and remote_caches(hosts) - before  # h2's are left
        done = ctl("reap", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ended having lost h2" in done.stdout, done.stdout
        wait_until(lambda: not instances_with(mark), "reap to end h2's instances", GONE)
        assert not (remote_caches(hosts) - before)
        assert ctl("reap", env=env).stdout.startswith("nothing to reap")
    finally:
        thaw(frozen)
        proc.kill()
        proc.wait()
        kill_marked(mark)  # what reap left, if the test failed


def ctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "poprun.cli.ctl", *args], env=poprun_env(env),
                          capture_output=True, text=True, timeout=60)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- 7. remote instances are not remote shells -------------------------------------------------

def test_a_remote_bash_instance_does_not_read_bashrc(hosts, tmp_path):
    """bash sources ~/.bashrc when SSH_CLIENT is set and SHLVL < 2, as in an SSH login whose
    shell sets no SHLVL (dash); an instance is not a login. `-x HOME`/`-x SHLVL=0` make that
    case here without touching the real ~/.bashrc."""
    home = tmp_path / "home"
    home.mkdir()
    witness = home / "bashrc-was-read"
    (home / ".bashrc").write_text(f"touch {witness}\n")
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-H", "h1", "--num-instances=1", "--num-replicas=1",
                    "-x", f"HOME={home}", "-x", "SHLVL=0",
                    "bash", "-c", "echo SSH_CLIENT=${SSH_CLIENT-unset} SSH_TTY=${SSH_TTY-unset}"),
        env=poprun_env(hosts.env()), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"SSH_CLIENT=unset SSH_TTY=unset\n"
    assert not witness.exists()


def test_a_remote_instance_has_the_shell_level_of_a_local_child_and_no_ssh_login(hosts):
    """No SSH_CONNECTION (POPRUN_SSH_CONNECTION says where the agent was reached) and the
    launcher's SHLVL, as a local instance would have, not the SSH login's."""
    show = ("echo SHLVL=${SHLVL-unset} SSH_CONNECTION=${SSH_CONNECTION-unset} "
            "copy=${POPRUN_SSH_CONNECTION:+set}")
    proc = subprocess.run(
        poprun_argv(*OFFLINE, "-H", "h1", "--num-instances=1", "--num-replicas=1",
                    "sh", "-c", show),
        env=poprun_env({**hosts.env(), "SHLVL": "7"}), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"SHLVL=7 SSH_CONNECTION=unset copy=set\n"


def _cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text().splitlines()[-1]




@pytest.mark.timeout(60)
def test_an_instance_is_in_its_cgroup_from_its_first_instruction(tmp):
    """Each reads its own cgroup within a millisecond of its start (a shell's builtins: no
    fork, no interpreter start-up), where a move made from outside after the spawn had most
    of 8 still in poprun's cgroup (containment.entering)."""
    if not cgroups_here():
        # no switch: cgroup v2 delegation, the machine's
        pytest.skip("no writable cgroup v2 subtree here")
    for _ in range(3):
        proc = run_poprun(*OFFLINE, "--num-instances=8", "--num-replicas=8", "sh", "-c",
                          'while read -r l; do last=$l; done </proc/self/cgroup; echo "$last"',
                          env=tmp)
        assert proc.returncode == 0, proc.stderr.decode()
        cgroups = proc.stdout.decode().split()
        assert sorted(line.rsplit("/", 1)[-1] for line in cgroups) == [f"i{i}" for i in range(8)]
        assert all("/poprun-" in line for line in cgroups)


@pytest.mark.timeout(60)
def test_a_batch_s_cgroups_are_made_before_its_first_spawn():
    """LocalSpawner.reserve makes the cgroups of every key of the batch at once (a cgroup
    made between two spawns waited out the previous instance's move: Cgroups.make), and a
    spawn then enters the one made for its key; the lifeline removes them."""
    if not cgroups_here():
        # no switch: cgroup v2 delegation, the machine's
        pytest.skip("no writable cgroup v2 subtree here")
    from spawner.containment import cgroup_root
    from spawner.lifeline import Lifeline
    from spawner.local import LocalSpawner

    lifeline = Lifeline()
    root = cgroup_root(lifeline.token)
    try:
        spawner = LocalSpawner(sink=None, loop=None, lifeline=lifeline)
        spawner.reserve([])  # nothing to start here (every instance remote): no tree
        assert not os.path.exists(root)
        spawner.reserve([0, 1, 2])
        assert sorted(p.name for p in Path(root).iterdir() if p.is_dir()) == ["i0", "i1", "i2"]
        entering = spawner._contained(ProcessSpec(2, ("true",), {}), {"PATH": os.defpath})
        assert entering[3] == os.path.join(root, "i2", "cgroup.procs")
        assert spawner.cgroup_of(2) == os.path.join(root, "i2") and spawner.cgroup_of(1) is None
    finally:
        lifeline.close()
    assert not os.path.exists(root)


@pytest.mark.timeout(60)
def test_a_batch_started_at_once_is_contained_and_watched_as_one_started_alone():
    """LocalSpawner.spawn_many (MPI_Comm_spawn's children, their starts overlapping in
    threads): each process in its own cgroup from its start (where this host gives cgroups),
    its output and exit reach the sink; one that cannot start is its OSError, the others
    run; the lifeline removes the cgroups."""
    import asyncio

    from spawner.containment import cgroup_root
    from spawner.lifeline import Lifeline
    from spawner.local import LocalSpawner

    show = 'while read -r l; do last=$l; done </proc/self/cgroup; echo "$last"; exit "$1"'
    outputs: dict[int, bytes] = {}
    exits: dict[int, int] = {}

    class Sink:
        def __init__(self):
            self.all_exited = asyncio.Event()

        def on_output(self, key, stream, data):
            outputs[key] = outputs.get(key, b"") + data

        def on_exit(self, key, returncode):
            exits[key] = returncode
            if len(exits) == 3:
                self.all_exited.set()

    async def main():
        sink = Sink()
        spawner = LocalSpawner(sink, asyncio.get_running_loop(), lifeline)
        keys = [10, 11, 12, 13]
        spawner.reserve(keys)
        outcomes = await spawner.spawn_many([
            ProcessSpec(key, ("/nonexistent/program",) if key == 12 else
                        ("sh", "-c", show, "sh", str(key - 10)), dict(os.environ))
            for key in keys])
        await asyncio.wait_for(sink.all_exited.wait(), 30)
        spawner.close()
        return outcomes

    lifeline = Lifeline()
    root = cgroup_root(lifeline.token)
    try:
        outcomes = asyncio.run(main())
    finally:
        lifeline.close()
    assert [type(o) for o in outcomes] == [int, int, FileNotFoundError, int]
    assert exits == {10: 0, 11: 1, 13: 3}
    for key in (10, 11, 13):
        if cgroups_here():
            assert outputs[key].decode().strip().endswith(f"/i{key}")
        else:
            assert outputs[key].startswith(b"0::")
    assert root is None or not os.path.exists(root)


@pytest.mark.timeout(120)
def test_a_helper_that_escapes_at_once_dies_with_a_sigkilled_poprun(tmp):
    """The instance's first act is a helper in a new session with an empty
    environment (no mark), then poprun is SIGKILLed. Forked before a move made from outside,
    it once stayed in poprun's own cgroup and lived on (7 runs of 7); in its cgroup from
    the first instruction, the watchdog's cgroup.kill ends it (10 runs of 8 instances)."""
    if not cgroups_here():
        # no switch: cgroup v2 delegation, the machine's
        pytest.skip("no writable cgroup v2 subtree here")
    for _ in range(10):
        sigkill_with_escaped_helpers(8, tmp)


def sigkill_with_escaped_helpers(count: int, env: dict[str, str], age: float = 0.0) -> None:
    """`count` instances whose first act is a `setsid env -i` helper; poprun SIGKILLed once
    every helper has run for `age` seconds; every helper must then die."""
    mark = marker()
    # `-hel''per`: the shell makes the helper's marker, which poprun's own command line
    # (holding this script) then does not carry.
    helper = f"{shlex.join(['env', '-i', PY, '-c', SLEEPER])} {mark}-hel''per"
    script = f"( setsid {helper} & ); exec {shlex.join([PY, '-c', SLEEPER, mark])}"
    job = subprocess.Popen(poprun_argv(*OFFLINE, f"--num-instances={count}",
                                       f"--num-replicas={count}", "sh", "-c", script),
                           env=poprun_env(env), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(processes_with(f"{mark}-helper")) == count, "the helpers", 30)
        time.sleep(age)
    finally:
        job.kill()
        job.wait()
    wait_until(lambda: not processes_with(mark), "the helpers to die with the job", 20)


@pytest.mark.timeout(120)
def test_without_cgroups_a_helper_that_left_group_and_mark_dies_with_a_sigkilled_poprun(tmp):
    """No cgroup (POPRUN_CGROUPS=0, as for a user without a delegated subtree): a helper in a
    new session with an empty environment carries neither the group nor the mark, and once
    poprun is SIGKILLed its ancestry is gone too. The watchdog learnt it while poprun lived
    (every TRACK_EVERY seconds) and kills it (it lived on in 4 of 4 runs before)."""
    from spawner.lifeline import TRACK_EVERY

    for _ in range(3):
        # The documented window: a helper younger than one walk of the tree may escape.
        sigkill_with_escaped_helpers(4, {**tmp, "POPRUN_CGROUPS": "0"}, age=3 * TRACK_EVERY)


# An owner that is no subreaper (a program that called launch()): one "instance" (a group it
# registers) whose helper leaves group and environment (but keeps its parent: without a
# subreaper an orphan is init's at once, found by no one), and a child of its own that is not
# the job's. The owner then dies by SIGKILL.
NOT_A_SUBREAPER = """
import os, shlex, subprocess, sys, time
from spawner.lifeline import Lifeline, TRACK_EVERY
mark, sleeper = sys.argv[1], sys.argv[2]
python, code = shlex.quote(sys.executable), shlex.quote(sleeper)
lifeline = Lifeline()
own = subprocess.Popen([sys.executable, "-c", sleeper, mark + "-own"])
instance = subprocess.Popen(
    ["sh", "-c", f"setsid env -i {python} -c {code} {mark}-hel''per & "
                 f"exec {python} -c {code} {mark}-inst''ance"],
    start_new_session=True)
lifeline.add_group(instance.pid)
lifeline.track_descendants(whole_tree=False)
print(own.pid, flush=True)
sys.stdin.readline()  # the helper runs: the test says so
time.sleep(3 * TRACK_EVERY)  # the documented window: one walk of the tree
os.kill(os.getpid(), 9)
"""


@pytest.mark.timeout(60)
def test_a_watchdog_whose_owner_is_no_subreaper_kills_the_instances_helpers_only():
    mark = marker()
    owner = subprocess.Popen([PY, "-c", NOT_A_SUBREAPER, mark, SLEEPER], env=poprun_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    own = None
    try:
        own = int(owner.stdout.readline())
        wait_until(lambda: processes_with(f"{mark}-helper"), "the helper", 30)
        owner.stdin.write(b"go\n")
        owner.stdin.flush()
        assert owner.wait(timeout=30) == -9
        wait_until(lambda: not processes_with(f"{mark}-helper")
                   and not processes_with(f"{mark}-instance"), "the job's processes to die", 20)
        assert processes_with(f"{mark}-own") == [own]  # the owner's own child is not the job's
    finally:
        owner.kill()
        owner.wait()
        if own is not None and processes_with(f"{mark}-own"):
            os.kill(own, signal.SIGKILL)


def test_a_stop_signal_inside_a_finalizer_is_acted_on_not_printed():
    """A stop signal whose Stopped lands where Python can only print it (here a weakref
    callback, as the import system's module-lock cleanup is: seen once as "Exception ignored
    in ... _get_module_lock" on a poprun's stderr) prints nothing; the signal is remembered
    for the launch to act on. A real signal, sent by the process to itself."""
    script = ("import os, signal, sys, weakref\n"
              "from poprun.run.signals import install_early_stop\n"
              "early = install_early_stop()\n"
              "class Thing: pass\n"
              "def callback(ref):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    sum(range(100000))  # the handler runs here, inside the callback\n"
              "thing = Thing(); ref = weakref.ref(thing, callback)\n"
              "del thing\n"
              "print('remembered', early.received)\n")
    proc = subprocess.run([PY, "-c", script], env=poprun_env({}), capture_output=True,
                          text=True, timeout=30)
    assert proc.stdout.split() == ["remembered", str(int(signal.SIGTERM))], proc.stderr
    assert proc.stderr == ""


def test_a_stop_signal_once_the_launch_loop_runs_is_remembered_and_acted_on(tmp):
    """From the launch's asyncio.run until the launch takes the signals, a stop signal is
    only remembered (run/signals.hold_stops): raised in there, it was swallowed by asyncio with
    the launch's next step, and poprun waited forever (seen once in a test loop). The
    launch then acts on it: a real SIGTERM, then a real launch, which stops at once."""
    mark = marker()
    script = ("import os, signal, sys\n"
              "from poprun.run.signals import install_early_stop, hold_stops\n"
              "early = install_early_stop()\n"
              "hold_stops()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "sum(range(100000))  # the handler runs here: it must not raise\n"
              "print('held', early.received, flush=True)\n"
              "from poprun.cli import main as cli\n"
              f"sys.exit(cli.main([*{OFFLINE!r}, '--num-instances=2', '--num-replicas=2',\n"
              f"                   'sh', '-c', 'sleep 300; :', {mark!r}]))\n")
    proc = subprocess.run([PY, "-c", script],
                          env=poprun_env({**tmp, "POPRUN_NO_DASHBOARD": "1"}),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["held", str(int(signal.SIGTERM))], proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SIGTERM received: stopping" in proc.stderr and "Traceback" not in proc.stderr
    assert_all_gone(mark, tmp["TMPDIR"])


def test_the_session_does_not_wait_for_zombies_no_watcher_reaps():
    """At its end the session waits for asyncio to reap the helpers it started (an SSH
    ProxyCommand), before the final sweep. A zombie nobody waits for (srun forks helpers that
    come to poprun, the subreaper, when they exit) is the sweep's: waiting for it held every
    Slurm launch 2 s (the bounds). With bounds of 60 s, the wait must still end at once. In a
    process of its own: this one's other children (fixtures') are not the point."""
    program = """
import asyncio, os, time
from spawner import containment, procid
containment.HELPERS_REAPED_TIMEOUT = 60.0
pid = os.fork()
if pid == 0:
    os._exit(0)
while open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
    time.sleep(0.01)  # bounded by the test's timeout
asyncio.run(asyncio.wait_for(containment.helpers_reaped(), 30))
print(pid in procid.children())
"""
    proc = subprocess.run([PY, "-c", program], capture_output=True, text=True, timeout=60,
                          env=poprun_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "True\n"  # left to the sweep
