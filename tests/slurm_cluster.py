"""A real Slurm cluster on this one machine, for tests that run poprun under Slurm.

``start_slurm_cluster(n)`` starts, in a private temporary directory, a ``munged`` with a
freshly generated key on its own socket, one ``slurmctld`` and one ``slurmd -N nodeK`` per node
(node1 .. noden, all on 127.0.0.1, each on its own free port), and waits until every node is
idle. Every client command must run with ``cluster.env`` (SLURM_CONF names the private
slurm.conf, whose AuthInfo names the private MUNGE socket)::

    with start_slurm_cluster(2) as cluster:
        cluster.run(["srun", "-N2", "hostname"])
        cluster.run(["salloc", "-N2", "--ntasks-per-node=1", "poprun", ...])

On exit every process that belongs to the cluster is killed (the daemons, every slurmstepd,
every task and every client started with ``cluster.env``) and the directory is removed.

The session-scoped fixture ``slurm_cluster`` yields one 2-node cluster for the whole session
and skips (with the reason and the daemons' log tails) when Slurm is missing or does not
start -- or fails instead where POPRUN_REQUIRE_SLURM=1 (CI). Tests share it: call
``slurm_cluster.reset()`` first to start from an idle cluster.

Why this configuration (Debian 12: Slurm 22.05.8, MUNGE 0.5.15; no systemd, no cgroup
delegation in a container; it works as root and as an ordinary user):

* Debian's slurmd honours ``-N nodeK``, so several slurmd share one host: each NodeName
  line has ``NodeAddr=127.0.0.1`` and its own ``Port``; ``SlurmdSpoolDir``/``SlurmdPidFile``/
  ``SlurmdLogFile`` use ``%n``. All ports are picked free (several test sessions may run at
  once), so no fixed ``Port=[17001-17002]``.
* ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, ``JobAcctGatherType=
  jobacct_gather/none``: nothing needs cgroups. No accounting (``sacct`` does not work: use
  ``job_info()``/``scontrol show job``, which keeps finished jobs for MinJobAge=300 s).
* ``SlurmdParameters=config_overrides``: the configured CPUs per node need not match this
  machine (else a node configured with more CPUs than it has registers as INVALID).
* ``SlurmctldHost=<short hostname>(127.0.0.1)``: slurmctld refuses to serve elsewhere ("This
  host not a valid controller"); the address means the hostname need not resolve (checked
  with an unresolvable and with a dotted hostname).
* ``SchedulerParameters=batch_sched_delay=0``: a batch job starts on the scheduler's next
  one-second tick, not up to 3 s later. ``sbatch --wait`` still polls after 2 s, then every
  8 s: it takes >= 2 s.
* ``KillWait=2``: a cancelled step gets SIGKILL 2 s after SIGTERM (default 30 s).
* ``PlugStackConfig`` and every other file are private: /etc/slurm, /etc/munge and a system
  munged (Debian's service, if something started it) are neither read nor disturbed.
* Time limits are whole minutes and slurmctld checks them every 30 s: a ``--time=1`` job ends
  after ~60-90 s.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from requires import skip_or_fail
from sshd_hosts import kill_trees

__all__ = ["SlurmCluster", "SlurmClusterError", "require_slurm", "slurm_cluster",
           "start_slurm_cluster"]

START_TIMEOUT = 30.0  # all daemons up and every node idle
STOP_TIMEOUT = 10.0  # every process of the cluster gone after SIGKILL
POLL = 0.05
START_ATTEMPTS = 3  # a free port can be taken by someone else before the daemon binds it
LOG_TAIL_LINES = 15

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "scancel", "squeue", "sinfo", "scontrol")
SBIN = ("/usr/sbin", "/sbin")  # not on a non-root PATH
INSTALL_HINT = "apt-get install slurmctld slurmd slurm-client munge"
# If pytest is killed outright (no teardown), don't leave the daemons running forever.
_DIE_WITH_US = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
# Variables that would make a client think it runs inside some other job (e.g. pytest run
# under an outer Slurm allocation) or override slurm.conf.
_CLIENT_ENV_PREFIXES = ("SLURM_", "SLURMD_", "SALLOC_", "SBATCH_", "SRUN_", "SQUEUE_",
                        "SINFO_", "SCANCEL_", "SCONTROL_", "MUNGE_")


class SlurmClusterError(RuntimeError):
    """The cluster could not be started; the message includes the daemons' log tails."""


def find_slurm() -> dict[str, str] | str:
    """Absolute paths of the daemons and client commands, or the reason they are missing."""
    paths: dict[str, str] = {}
    missing = []
    search = os.pathsep.join([os.environ.get("PATH", ""), *SBIN, "/usr/bin"])
    for name in (*DAEMONS, *CLIENTS):
        path = shutil.which(name, path=search)
        if path:
            paths[name] = os.path.abspath(path)
        else:
            missing.append(name)
    if missing:
        return f"Slurm/MUNGE not installed: {', '.join(missing)} not found ({INSTALL_HINT})"
    return paths


def require_slurm() -> dict[str, str]:
    """``find_slurm()``'s paths; skip the test if missing, or fail where CI demands it."""
    found = find_slurm()
    if isinstance(found, str):
        _skip_or_fail(found)
    return found  # type: ignore[return-value]


def _skip_or_fail(reason: str) -> None:
    skip_or_fail(reason, "POPRUN_REQUIRE_SLURM")


@dataclass
class SlurmCluster:
    """A running cluster: its directory, nodes, config and daemons."""

    dir: Path
    nodes: list[str]  # ["node1", "node2", ...]
    conf: Path  # slurm.conf
    munge_socket: Path
    bin: dict[str, str]  # name -> absolute path, daemons and clients
    cpus_per_node: int
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # by log name
    start_seconds: float = 0.0  # how long start_slurm_cluster took to get every node idle

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (a fresh copy each time).

        os.environ without any inherited SLURM_*/SALLOC_*/SBATCH_*/SRUN_*/MUNGE_* variable,
        plus SLURM_CONF, and PATH with the Slurm binaries' directories appended. Tasks inherit
        it (srun's default --export=ALL), so srun inside a job reaches the same cluster.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf)
        dirs = env.get("PATH", "").split(os.pathsep)
        for d in dict.fromkeys(os.path.dirname(p) for p in self.bin.values()):
            if d not in dirs:
                dirs.append(d)
        env["PATH"] = os.pathsep.join(d for d in dirs if d)
        return env

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = self.env
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], *, timeout: float = 60, input: str | bytes | None = None,
            env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
            check: bool = False, text: bool = True) -> subprocess.CompletedProcess:
        """Run a client command (``srun``, ``salloc``, ``sbatch``, ``scancel``, ``squeue``,
        ``sinfo``, ``scontrol`` or anything under them) to completion with ``env`` added to
        ``self.env``; stdout/stderr captured (str unless text=False). ``timeout`` is required
        in spirit: a job that never starts must not hang the test."""
        if input is None:
            stdin = subprocess.DEVNULL
        else:
            stdin = None
        return subprocess.run(list(argv), env=self._env(env), cwd=cwd, input=input,
                              stdin=stdin, capture_output=True, text=text, timeout=timeout,
                              check=check)

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start a client command in the background with ``env`` added to ``self.env``.
        The caller waits for it (with a timeout); ``stop()`` kills any it leaves running."""
        return subprocess.Popen(list(argv), env=self._env(env), **kwargs)

    # -- state ---------------------------------------------------------------------------

    def jobs(self) -> dict[str, str]:
        """``{job id: state}`` of every job slurmctld still lists in squeue (pending, running,
        completing...); finished jobs drop out of it."""
        out = self.run(["squeue", "-h", "-o", "%i %T"], timeout=20, check=True).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def node_states(self) -> dict[str, str]:
        """``{node name: state}`` as sinfo reports it (``idle``, ``mixed``, ``allocated``,
        ``completing``, ``down*``...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20, check=True).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...); works for
        finished jobs for MinJobAge (300 s) after they end."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=20,
                       check=True).stdout
        info: dict[str, str] = {}
        for word in out.split():
            key, sep, value = word.partition("=")
            if sep:
                info[key] = value
        return info

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until no job is listed and every node is idle; SlurmClusterError if not."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_daemons()
            jobs, states = self.jobs(), self.node_states()
            if not jobs and set(states) == set(self.nodes) and all(
                    s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"cluster not idle after {timeout}s: jobs {jobs}, nodes {states}\n"
                    + self.log_tails())
            time.sleep(POLL)

    def reset(self, timeout: float = 30) -> None:
        """Cancel every job (a previous test's leftovers) and wait until the cluster is idle."""
        self.check_daemons()
        if self.jobs():
            self.run(["scancel", "--user", _user()], timeout=20, check=True)
        self.wait_idle(timeout)

    def check_daemons(self) -> None:
        """SlurmClusterError (with log tails) if any daemon has exited."""
        dead = {name: p.returncode for name, p in self.daemons.items() if p.poll() is not None}
        if dead:
            raise SlurmClusterError(f"daemons exited: {dead}\n" + self.log_tails())

    def log_tails(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of every daemon log, for failure messages."""
        parts = []
        log_dir = self.dir / "log"
        for path in sorted(log_dir.glob("*")) if log_dir.is_dir() else []:
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name} ---\n" + "\n".join(text))
        return "\n".join(parts) or "(no daemon logs)"

    # -- teardown ------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every process of the cluster and wait until all are gone.

        A slurmstepd outlives its slurmd by design, and tasks/clients are not children of
        the daemons, so the daemons alone are not enough: every process whose environment
        carries this cluster's SLURM_CONF (daemons, slurmstepds, tasks, clients run with
        ``env``) or that holds a file in ``dir`` open, and all their descendants, is killed.
        """
        for p in self.daemons.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        _kill_trees(self._own_processes)
        for p in self.daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(STOP_TIMEOUT)
        deadline = time.monotonic() + STOP_TIMEOUT
        while (left := self._own_processes()) and time.monotonic() < deadline:
            _kill_trees(self._own_processes)
            time.sleep(POLL)
        if left:
            raise SlurmClusterError(f"processes of the cluster survived SIGKILL: {left}")

    def _own_processes(self) -> list[int]:
        """Pids (not ours, nor our ancestors') that carry SLURM_CONF=<conf> in their
        environment or have a file under ``dir`` open."""
        marker = f"SLURM_CONF={self.conf}".encode()
        prefix = f"{self.dir}/"
        mine = _ancestors(os.getpid())
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in mine:
                continue
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry))
                    continue
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(prefix):
                            pids.append(int(entry))
                            break
            except OSError:
                continue  # exited meanwhile, or not ours to read
        return pids


@contextlib.contextmanager
def start_slurm_cluster(n: int = 2, *, cpus_per_node: int = 4,
                        timeout: float = START_TIMEOUT) -> Iterator[SlurmCluster]:
    """Start a cluster of ``n`` nodes; stop it and remove its directory on exit.

    Raises SlurmClusterError (message with the daemons' log tails) if it does not get every
    node idle within ``timeout``; ``find_slurm()`` tells beforehand whether Slurm is there.
    """
    if not 1 <= n <= 64:
        raise ValueError(f"n must be in 1..64, got {n}")
    found = find_slurm()
    if isinstance(found, str):
        raise SlurmClusterError(found)
    # Directly under /tmp, not pytest's deep tmp_path: AF_UNIX socket paths are <108 bytes.
    root = Path(tempfile.mkdtemp(prefix="slurm-cluster-"))
    cluster = SlurmCluster(
        dir=root, nodes=[f"node{k}" for k in range(1, n + 1)], conf=root / "slurm.conf",
        munge_socket=root / "munge" / "munge.socket", bin=found, cpus_per_node=cpus_per_node,
    )
    try:
        t0 = time.monotonic()
        _start(cluster, timeout)
        cluster.start_seconds = time.monotonic() - t0
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _start(cluster: SlurmCluster, timeout: float) -> None:
    root = cluster.dir
    for sub in ("munge", "state", "log", "spool"):
        (root / sub).mkdir(mode=0o700)
    (root / "plugstack.conf").write_text("")  # not Debian's /etc/slurm/plugstack.conf
    _start_munged(cluster, timeout)
    for attempt in range(1, START_ATTEMPTS + 1):
        _write_slurm_conf(cluster)
        env = cluster.env
        _spawn(cluster, "slurmctld", [cluster.bin["slurmctld"], "-D", "-i"], env)
        for node in cluster.nodes:
            _spawn(cluster, f"slurmd-{node}", [cluster.bin["slurmd"], "-D", "-N", node], env)
        try:
            _wait_ready(cluster, timeout)
            return
        except SlurmClusterError:
            if attempt == START_ATTEMPTS or "Address already in use" not in cluster.log_tails():
                raise
        # Someone took one of the ports since we picked it: start slurm afresh on new ones.
        for name in [k for k in cluster.daemons if k != "munged"]:
            proc = cluster.daemons.pop(name)
            proc.kill()
            proc.wait(STOP_TIMEOUT)
        shutil.rmtree(root / "state")
        (root / "state").mkdir(mode=0o700)
        for log in (root / "log").glob("slurm*"):
            log.unlink()


def _start_munged(cluster: SlurmCluster, timeout: float) -> None:
    d = cluster.dir / "munge"
    key = d / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(1024))
    # --force: as root, and with the socket under a world-writable /tmp (sticky bit), munged
    # otherwise refuses to start. Its own socket, key, pid, seed and log: a system munged
    # (Debian's service, if running) is neither used nor disturbed.
    _spawn(cluster, "munged", [
        cluster.bin["munged"], "--foreground", "--force", f"--socket={cluster.munge_socket}",
        f"--key-file={key}", f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
        f"--log-file={cluster.dir / 'log' / 'munged.log'}", "--num-threads=4",
    ], cluster.env)
    deadline = time.monotonic() + timeout
    while True:
        cluster.check_daemons()
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(cluster.munge_socket))
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            raise SlurmClusterError(f"munged not listening after {timeout}s\n"
                                    + cluster.log_tails())
        time.sleep(POLL)


def _spawn(cluster: SlurmCluster, name: str, argv: list[str], env: dict[str, str]) -> None:
    with open(cluster.dir / "log" / f"{name}.stderr", "wb") as err:
        cluster.daemons[name] = subprocess.Popen(
            [*_DIE_WITH_US, *argv], env=env, cwd=cluster.dir, stdin=subprocess.DEVNULL,
            stdout=err, stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C aimed at pytest must not hit them first
        )


def _wait_ready(cluster: SlurmCluster, timeout: float) -> None:
    """Poll until slurmctld answers and sinfo shows every node idle."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        cluster.check_daemons()
        try:
            out = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            last = (out.stdout + out.stderr).strip()
            if set(states) == set(cluster.nodes) and all(s == "idle" for s in states.values()):
                return
        except subprocess.TimeoutExpired:
            last = "sinfo timed out"
        if time.monotonic() > deadline:
            raise SlurmClusterError(
                f"Slurm cluster not ready (every node idle) after {timeout}s; last sinfo: "
                f"{last!r}\n" + cluster.log_tails())
        time.sleep(POLL)


def _write_slurm_conf(cluster: SlurmCluster) -> None:
    root = cluster.dir
    user = _user()
    host = socket.gethostname().split(".")[0]
    ctld_port = _free_port()
    lines = [
        "ClusterName=poprun-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={cluster.munge_socket}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'spool' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        # slurmstepd logs here too (it has no stderr of its own).
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        f"PlugStackConfig={root / 'plugstack.conf'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        # Start a batch job at once, not up to 3 s later (the default batch_sched_delay).
        "SchedulerParameters=batch_sched_delay=0",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "KillWait=2",
        "InactiveLimit=0",
        "MailProg=/bin/true",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for node in cluster.nodes:
        lines.append(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
            f"CPUs={cluster.cpus_per_node} State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    cluster.conf.write_text("\n".join(lines) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return seen


def _kill_trees(find_roots) -> None:
    """SIGKILL every process ``find_roots()`` returns and all their descendants, never this
    test process or its ancestors (sshd_hosts.kill_trees)."""
    kill_trees(find_roots, spare=frozenset(_ancestors(os.getpid())))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One 2-node cluster (node1, node2; 4 CPUs each) for the whole session.

    Skips with the reason when Slurm is missing or the cluster does not start; fails instead
    where POPRUN_REQUIRE_SLURM=1. Tests share it: ``slurm_cluster.reset()`` first.
    """
    with required_slurm_cluster(2) as cluster:
        yield cluster


@contextlib.contextmanager
def required_slurm_cluster(n: int) -> Iterator[SlurmCluster]:
    """``start_slurm_cluster(n)`` for a test that needs one: skipped with the reason when
    Slurm is missing or the cluster does not start, failed instead where
    POPRUN_REQUIRE_SLURM=1."""
    require_slurm()
    stack = contextlib.ExitStack()
    try:
        cluster = stack.enter_context(start_slurm_cluster(n))
    except SlurmClusterError as e:
        _skip_or_fail(f"Slurm cluster failed to start: {e}")
    with stack:
        yield cluster
