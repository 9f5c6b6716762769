#!/usr/bin/env python3
"""Benchmark poprun's multi-host fan-out against OpenMPI's mpirun over loopback sshd hosts.

Issue 3, point 9: 16 loopback "hosts" (real OpenSSH sshd servers on 127.0.77.1..16, started
with tests/sshd_hosts.py) x 4 instances running `hostname`, poprun against
`mpirun --host h1:4,... --mca plm_rsh_args "-F <ssh config>"`, in one run; plus a smaller
4 hosts x 2 case. poprun must be the faster. One more poprun run per case at `-v` gives the
per-host phase timings (connected, agent started, agent ready, first instance started).

The sides run interleaved (poprun, mpirun, poprun, ...) so drift on the machine hits both
alike. The script prints a table and writes JSON to bench/results/multihost-<timestamp>.json.
It is a benchmark, not a test: it exits 0 even when poprun loses (1 only with --check).
See bench/README.md, "Multi-host fan-out".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_RESULTS_DIR = BENCH_DIR / "results"
sys.path[:0] = [str(BENCH_DIR), str(REPO / "tests")]

# The timing, process-tree and reporting plumbing is launch_bench's, so both benchmarks measure
# the same way (pidfd wake-up, own session per run, SIGKILL of the whole tree on a hang).
from launch_bench import (BYTECODE_VAR, Run, Side, checked, counts, default_poprun,  # noqa: E402
                          open_mpi_mpirun,
                          descendants, kill_pids, kill_unfinished, machine_info, ms, python_env,
                          results_path, tail, wait_all)
from sshd_hosts import SshHosts, start_ssh_hosts  # noqa: E402

# Between two runs, the sshd session processes of the last one (and, after a hang, mpirun's
# orteds) must be gone, or they would load the next run. A clean run leaves nothing within
# ~100 ms; what is still there after this long is killed and noted.
SETTLE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Case:
    hosts: int
    per_host: int

    @property
    def instances(self) -> int:
        return self.hosts * self.per_host

    @property
    def name(self) -> str:
        return f"{self.hosts}x{self.per_host}"


def parse_case(text: str) -> Case:
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"a case is HOSTSxINSTANCES_PER_HOST, e.g. 16x4; got {text!r}")
    return Case(int(m[1]), int(m[2]))


@dataclass
class Phases:
    """One poprun run at -v: per-host phase times (ms, as poprun reports them: connect from its
    start, the agent's phases from the start of that host's agent) and a timeline of the whole
    run (ms from the launcher's start, from the log lines' wall-clock stamps, +-1 ms)."""

    command: list[str]
    seconds: float | None
    status: str
    hosts: dict[str, dict[str, int]] = field(default_factory=dict)
    timeline: dict[str, float] = field(default_factory=dict)
    log: str = ""  # poprun's stderr


@dataclass
class CaseResult:
    case: Case
    sides: list[Side]
    phases: Phases | None = None


@dataclass
class Component:
    """A piece of the launch measured on its own (median of a few runs)."""

    name: str
    command: str
    median_ms: float | None  # wall
    min_ms: float | None  # wall
    cpu_ms: float | None  # median user+sys CPU time
    note: str = ""


# PYTHONDONTWRITEBYTECODE: the launcher runs get a private bytecode cache (launch_bench's
# python_env). The agents are started by sshd with a clean environment and are not affected.


# ---------------------------------------------------------------------------- processes


def under_sshd(hosts: SshHosts) -> list[int]:
    """Every process below the sshd listeners: sessions, agents, orteds, instances."""
    pids = []
    for host in hosts.hosts:
        if host.proc is not None and host.proc.poll() is None:
            pids += descendants(host.proc.pid)
    return pids


def settle(hosts: SshHosts, timeout: float = SETTLE_TIMEOUT) -> str:
    """Wait until nothing runs under the sshd listeners; kill what is left after `timeout`.
    '' if it all went by itself, else a note for the run's detail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not under_sshd(hosts):
            return ""
        time.sleep(0.02)
    left = under_sshd(hosts)
    names = sorted({_comm(pid) for pid in left})
    kill_pids(left)
    return f"{len(left)} process(es) still under sshd {timeout:g} s after the run ({', '.join(names)}); killed"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def run_one(side: str, cmd: list[str], env: dict[str, str], timeout: float, scratch: Path,
            hosts: SshHosts) -> tuple[Run, float]:
    """Run `cmd` once, stdout to scratch/out, stderr to scratch/err; time it like launch_bench
    (perf_counter from just before Popen to the reap, pidfd wake-up). On a hang the local tree
    is SIGKILLed and so is everything under the sshd listeners: the remote half of the job
    (orteds, agents, instances) is not in the launcher's process tree. Returns the Run and the
    wall-clock start (time.time()), to place log stamps on the run's time line."""
    err_path = scratch / "err"
    with open(scratch / "out", "wb") as out, open(err_path, "wb") as err:
        wall = time.time()
        start = time.perf_counter()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                    close_fds=True, start_new_session=True)
        except OSError as exc:
            return Run(side, None, "failed", None, f"could not start: {exc}"), wall
        finished = wait_all([proc], start + timeout)
        elapsed = time.perf_counter() - start
        if not finished:
            kill_unfinished([proc])
            kill_pids(under_sshd(hosts))
            return Run(side, None, "hung", None,
                       f"no exit within {timeout:g} s; killed with its remote processes"), wall
    if proc.returncode != 0:
        return Run(side, None, "failed", proc.returncode, tail(err_path)), wall
    return Run(side, elapsed, "ok", 0), wall


def verify_hostname_lines(path: Path, n: int) -> str:
    """'' if the file is exactly n lines, each this machine's hostname (every loopback host is
    this machine), else what is wrong."""
    want = socket.gethostname()
    lines = path.read_text(errors="replace").splitlines()
    problems = []
    if len(lines) != n:
        problems.append(f"{len(lines)} lines, expected {n}")
    other = [line for line in lines if line != want]
    if other:
        problems.append(f"{len(other)} lines are not {want!r}, e.g. {other[0][:100]!r}")
    return "; ".join(problems)


# ---------------------------------------------------------------------------- commands


@dataclass
class Tools:
    poprun: str
    mpirun: str | None
    mpirun_extra: list[str]
    poprun_timeout: float
    mpirun_timeout: float

    def poprun_cmd(self, hosts: list[str], case: Case, verbose: bool = False) -> list[str]:
        return [self.poprun, *(["-v"] if verbose else []), "--offline-mode=1", "-H", ",".join(hosts),
                "--num-instances", str(case.instances), "--num-replicas", str(case.instances),
                "hostname"]

    def mpirun_cmd(self, hosts: list[str], case: Case, ssh_config: Path) -> list[str]:
        # Root needs --allow-run-as-root; more ranks than the host's cores --oversubscribe.
        # OpenSSH takes ~ from passwd, not $HOME, so it must be pointed at the harness's
        # ssh_config; mpirun passes plm_rsh_args on to the orteds of its spawn tree as well.
        return [self.mpirun, "--allow-run-as-root", "--oversubscribe",
                "--host", ",".join(f"{h}:{case.per_host}" for h in hosts),
                "-n", str(case.instances), "--mca", "plm_rsh_args", f"-F {ssh_config}",
                *self.mpirun_extra, "hostname"]


# ---------------------------------------------------------------------------- the cases


def bench_case(tools: Tools, ssh: SshHosts, case: Case, reps: int, max_hangs: int, tmp: Path,
               scratch_n: list[int], pycache: Path | None, phases: bool = True) -> CaseResult:
    names = ssh.aliases[:case.hosts]
    env = python_env(ssh.env(), pycache)

    def scratch() -> Path:
        scratch_n[0] += 1
        path = tmp / f"run{scratch_n[0]}"
        path.mkdir(parents=True)
        return path

    def poprun_run() -> Run:
        d = scratch()
        run, _ = run_one("poprun", pop.command, env, tools.poprun_timeout, d, ssh)
        run = checked(run, lambda: verify_hostname_lines(d / "out", case.instances), strict=True)
        return _settled(run, ssh)

    def mpirun_run() -> Run:
        d = scratch()
        run, _ = run_one("mpirun", mpi.command, env, tools.mpirun_timeout, d, ssh)
        run = checked(run, lambda: verify_hostname_lines(d / "out", case.instances), strict=False)
        return _settled(run, ssh)

    pop = Side("poprun", tools.poprun_cmd(names, case))
    sides = [pop]
    mpi = None
    if tools.mpirun:
        mpi = Side("mpirun", tools.mpirun_cmd(names, case, ssh.ssh_config))
        sides.append(mpi)

    # One untimed warm-up per side: first sshd sessions, page cache, .pyc files.
    progress(f"{case.name} warm-up poprun", poprun_run())
    if mpi:
        progress(f"{case.name} warm-up mpirun", mpirun_run())
    for rep in range(reps):
        run = poprun_run()
        pop.runs.append(run)
        progress(f"{case.name} rep {rep + 1}/{reps} poprun", run)
        if mpi is None:
            continue
        if max_hangs and mpi.count("hung") >= max_hangs:
            mpi.runs.append(Run("mpirun", None, "skipped", None, f"{max_hangs} hang(s) already"))
            continue
        run = mpirun_run()
        mpi.runs.append(run)
        progress(f"{case.name} rep {rep + 1}/{reps} mpirun", run)

    result = CaseResult(case, sides)
    if phases:
        result.phases = phase_run(tools, ssh, case, names, env, scratch())
    return result


def _settled(run: Run, ssh: SshHosts) -> Run:
    note = settle(ssh)
    if note:
        return dataclasses.replace(run, detail=(run.detail + "; " if run.detail else "") + note)
    return run


def progress(label: str, run: Run) -> None:
    if run.status != "ok":
        shown = f"{run.status.upper()} {run.detail[:200]}"
    else:
        shown = f"{run.seconds * 1000:.0f} ms" + (" (output malformed)" if run.verified is False else "")
        if run.detail:
            shown += f" [{run.detail[:200]}]"
    print(f"  {label}: {shown}   (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- phases at -v

# `06:43:18.499 4048 POPRUN [I] h1: connected in 55 ms`
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \d+ POPRUN \[\w\] (\S+): (.*)$")
EXITED = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \d+ POPRUN \[\w\] instance \d+ \(pid \d+\) exited with")
PHASE = re.compile(r"(connected in|agent started|agent ready|first instance started) (\d+) ms")


def phase_run(tools: Tools, ssh: SshHosts, case: Case, names: list[str], env: dict[str, str],
              d: Path) -> Phases:
    cmd = tools.poprun_cmd(names, case, verbose=True)
    run, wall = run_one("poprun -v", cmd, env, tools.poprun_timeout, d, ssh)
    run = checked(run, lambda: verify_hostname_lines(d / "out", case.instances), strict=True)
    settle(ssh)
    log = (d / "err").read_text(errors="replace")
    phases = Phases(cmd, run.seconds, run.status, log=log)
    day = datetime.datetime.fromtimestamp(wall).replace(hour=0, minute=0, second=0, microsecond=0)
    stamps: dict[str, list[float]] = {}
    wanted = set(names)

    def at(m: re.Match) -> float:
        return (day.timestamp() + int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) + int(m[4]) / 1000 - wall) * 1000

    for line in log.splitlines():
        if m := EXITED.match(line):
            stamps.setdefault("exited", []).append(at(m))
            continue
        m = LOG_LINE.match(line)
        if not m or m[5] not in wanted:
            continue
        host, text = m[5], m[6]
        for what, value in PHASE.findall(text):
            key = "connect" if what == "connected in" else what.replace(" ", "_")
            phases.hosts.setdefault(host, {})[key] = int(value)
            stamps.setdefault(key, []).append(at(m))
    # When poprun printed each kind of line (it prints each kind once all hosts got there).
    # Connecting began roughly when the slowest host's connect started: before that, the
    # launcher was starting up (interpreter, imports, asyncssh).
    if "connect" in stamps:
        slowest = max(t["connect"] for t in phases.hosts.values() if "connect" in t)
        phases.timeline["connecting began (est.)"] = round(min(stamps["connect"]) - slowest, 1)
    for key, label in (("connect", "all connected"), ("agent_ready", "all agents ready"),
                       ("first_instance_started", "all instances started")):
        if key in stamps:
            phases.timeline[label] = round(min(stamps[key]), 1)
    if "exited" in stamps:
        phases.timeline["last instance exited"] = round(max(stamps["exited"]), 1)
    if run.seconds is not None:
        phases.timeline["exit"] = round(run.seconds * 1000, 1)
    print(f"  {case.name} phase run (-v): {ms(run.seconds)} {run.status}"
          + (f" {run.detail[:200]}" if run.status != "ok" else ""), file=sys.stderr, flush=True)
    return phases


# ---------------------------------------------------------------------------- components


def time_cmd(cmd: list[str], reps: int, env: dict[str, str] | None = None,
             concurrent: int = 1) -> tuple[float, float, float]:
    """`concurrent` copies of cmd started at once, timed until all exit, `reps` times: median
    and min wall time, and median CPU time (user+sys of all copies and their children), ms.
    CPU time is the steadier figure when other work shares the machine."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    walls, cpus = [], []
    for _ in range(reps):
        cpu0, start = cpu(), time.perf_counter()
        procs = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=env, close_fds=True)
                 for _ in range(concurrent)]
        try:
            for p in procs:
                p.wait(60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        walls.append((time.perf_counter() - start) * 1000)
        cpus.append((cpu() - cpu0) * 1000)
    return statistics.median(walls), min(walls), statistics.median(cpus)


def bench_components(tools: Tools, ssh: SshHosts, reps: int, pycache: Path | None) -> list[Component]:
    """What each hop of a launch costs here, to explain the totals. sshd runs a command as
    `$SHELL -c CMD` (root's shell is bash), and bash started by sshd reads ~/.bashrc although
    it is not interactive (it sees SSH_CLIENT and SHLVL < 2); locally the same happens with
    SSH_CLIENT set and SHLVL=0, which is how the rc file's cost is measured without ssh."""
    py = sys.executable
    home = os.path.expanduser("~" + ssh.user)  # the HOME sshd gives the session (from passwd)
    shell = _login_shell(ssh.user)
    local = python_env(dict(os.environ), pycache)
    base = {k: v for k, v in local.items() if not k.startswith("SSH_")}
    plain = {**base, "HOME": home, "SHLVL": "0"}
    as_ssh = {**plain, "SSH_CLIENT": "127.0.77.1 1 2"}
    agent = f"exec {py} -m spawner.agent"
    rc = f"{home}/.bashrc"
    ssh_true = ["ssh", "-F", str(ssh.ssh_config), "h1", "true"]
    rows = [
        ("python -c pass", [py, "-c", "pass"], None, 1, "interpreter start-up with site and its .pth files"),
        ("python -S -c pass", [py, "-S", "-c", "pass"], None, 1, "the same without site (.pth files)"),
        ("poprun --version", [tools.poprun, "--version"], None, 1, "interpreter + poprun's CLI imports"),
        ("import poprun.run.fleet (asyncssh)", [py, "-c", "import poprun.run.fleet"], None, 1,
         "what a multi-host poprun imports, and its exit"),
        ("  the same, gc.freeze() before exit", [py, "-c", "import poprun.run.fleet, gc; gc.freeze()"], None, 1,
         "difference = the final garbage collection over asyncssh's objects"),
        (f"{shell} -c true", [shell, "-c", "true"], plain, 1, "the remote shell, no rc file"),
        (f"{shell} -c true as sshd runs it", [shell, "-c", "true"], as_ssh, 1, f"+ {rc}"),
        ("  4 of them at once", [shell, "-c", "true"], as_ssh, 4,
         "concurrent sessions (pyenv rehash takes a lock, polled every 0.1 s)"),
        ("  16 of them at once", [shell, "-c", "true"], as_ssh, 16, ""),
        ("agent start+EOF", [py, "-m", "spawner.agent"], plain, 1,
         "python -m spawner.agent, stdin at EOF: interpreter + agent imports + exit"),
        ("16 agents at once, no rc file", [shell, "-c", agent], plain, 16,
         "16 loopback hosts' agents on this machine's CPUs, without ssh"),
        ("16 agents at once as sshd runs them", [shell, "-c", agent], as_ssh, 16, f"the same + {rc}"),
        ("ssh h1 true (OpenSSH)", ssh_true, None, 1,
         "connection + session + rc file, as for each orted (CPU: the client's only)"),
        ("  16 of them at once", ssh_true, None, 16, "mpirun's 16 orted launches, ssh alone"),
    ]
    out = []
    for name, cmd, env, conc, note in rows:
        try:
            time_cmd(cmd, 1, env or local, 1)  # warm-up: fills the private bytecode cache
            med, low, cpu = time_cmd(cmd, reps, env or local, conc)
        except (OSError, subprocess.SubprocessError) as exc:
            med = low = cpu = None
            note = f"failed: {exc}"
        out.append(Component(name, " ".join(cmd) + (f"  (x{conc} at once)" if conc > 1 else ""),
                             med, low, cpu, note))
        shown = "-" if med is None else f"{med:.0f} ms wall, {cpu:.0f} ms CPU"
        print(f"  component {name.strip()}: {shown}", file=sys.stderr, flush=True)
    settle(ssh)
    return out


def _login_shell(user: str) -> str:
    import pwd
    try:
        return pwd.getpwnam(user).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


# ---------------------------------------------------------------------------- reporting


def print_case(res: CaseResult) -> None:
    c = res.case
    print(f"\n{c.name}: {c.hosts} loopback sshd hosts x {c.per_host} instances = {c.instances} x `hostname`")
    print(f"  {'side':8} {'median':>9} {'min':>9} {'max':>9}  runs")
    for side in res.sides:
        ok = side.ok_seconds()
        low = min(ok) if ok else None
        print(f"  {side.name:8} {ms(side.median):>9} {ms(low):>9} {ms(side.max):>9}  {counts(side)}")
    pop, mpi = res.sides[0], (res.sides[1] if len(res.sides) > 1 else None)
    if mpi is not None:
        print(f"  poprun faster than mpirun: {verdict(pop, mpi)}")
    for side in res.sides:
        bad = [r for r in side.runs if r.status in ("failed", "hung") or r.verified is False]
        if bad:
            print(f"    {side.name} {bad[0].status} (rc={bad[0].returncode}): {bad[0].detail[:400]}")
    if res.phases:
        print_phases(res.phases)


def verdict(pop: Side, mpi: Side) -> str:
    if pop.median is None:
        return "no (no successful poprun run)"
    if any(r.status in ("failed", "hung") for r in pop.runs):
        return f"no ({pop.count('failed')} poprun runs failed, {pop.count('hung')} hung)"
    if mpi.median is None:
        return f"yes by default (mpirun completed no run: {mpi.count('hung')} hung, {mpi.count('failed')} failed)"
    ratio = pop.median / mpi.median
    return f"{'yes' if ratio < 1 else 'NO'} (poprun median = {ratio:.3f}x mpirun median)"


def print_phases(ph: Phases) -> None:
    print(f"  per-host phases of one `poprun -v` run ({ms(ph.seconds)}, {ph.status}); "
          "connect from poprun's start, agent phases from that host's agent start:")
    keys = ("connect", "agent_started", "agent_ready", "first_instance_started")
    print(f"    {'host':6} {'connected':>10} {'agent started':>14} {'agent ready':>12} {'1st instance':>13}")
    for host, t in sorted(ph.hosts.items(), key=lambda kv: int(re.sub(r"\D", "", kv[0]) or 0)):
        cells = [f"{t[k]} ms" if k in t else "-" for k in keys]
        print(f"    {host:6} {cells[0]:>10} {cells[1]:>14} {cells[2]:>12} {cells[3]:>13}")
    if ph.hosts:
        def spread(k):
            vals = [t[k] for t in ph.hosts.values() if k in t]
            return f"{min(vals)}..{max(vals)} ms" if vals else "-"
        print(f"    range: connected {spread('connect')}, agent ready {spread('agent_ready')}, "
              f"first instance {spread('first_instance_started')}")
    if ph.timeline:
        print("    time line (ms after launch, from the log stamps): "
              + ", ".join(f"{k} {v:.0f}" for k, v in ph.timeline.items()))


def print_components(rows: list[Component]) -> None:
    print("\nComponents (this machine, loopback; wall median / min, and median CPU time)")
    print(f"  {'':40} {'wall med':>9} {'min':>6} {'CPU':>7}")
    for r in rows:
        if r.median_ms is None:
            print(f"  {r.name:40} {'-':>9} {'-':>6} {'-':>7}  {r.note}")
        else:
            print(f"  {r.name:40} {r.median_ms:6.0f} ms {r.min_ms:6.0f} {r.cpu_ms:4.0f} ms  {r.note}")


def write_json(path: Path, args: argparse.Namespace, tools: Tools, results: list[CaseResult],
               components: list[Component], load: dict, source: dict) -> None:
    def encode(obj):
        if isinstance(obj, Side):
            ok = obj.ok_seconds()
            return {"name": obj.name, "command": obj.command, **obj.summary(),
                    "min_s": min(ok) if ok else None,
                    "runs": [dataclasses.asdict(r) for r in obj.runs]}
        if isinstance(obj, Path):
            return str(obj)
        if dataclasses.is_dataclass(obj):
            return {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, list):
            return [encode(x) for x in obj]
        if isinstance(obj, dict):
            return {k: encode(v) for k, v in obj.items()}
        return obj

    cases = {}
    for res in results:
        entry = encode(res)
        pop = res.sides[0]
        mpi = res.sides[1] if len(res.sides) > 1 else None
        entry["poprun_faster"] = (pop.median is not None and mpi is not None and mpi.median is not None
                                  and not any(r.status in ("failed", "hung") for r in pop.runs)
                                  and pop.median < mpi.median)
        entry["verdict"] = verdict(pop, mpi) if mpi else None
        cases[res.case.name] = entry
    doc = {
        "benchmark": "multihost",
        **machine_info(tools),
        "git": _git_state(REPO),
        "poprun_source": source,
        "load": load,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k != "cases"} | {"cases": [c.name for c in args.cases]},
        "cases": cases,
        "components": [dataclasses.asdict(c) for c in components],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _git_state(repo: Path) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"path": str(repo), "commit": git("rev-parse", "HEAD"), "modified": dirty.splitlines()}


def poprun_source(poprun: str) -> dict:
    """Where the poprun under test imports its code from (an editable install may point at
    another checkout than this one) and that checkout's git state."""
    try:
        with open(poprun, "rb") as f:
            first = f.readline().decode(errors="replace")
    except OSError:
        return {}
    python = first[2:].strip().split()[0] if first.startswith("#!") else sys.executable
    try:
        out = subprocess.run([python, "-c", "import poprun; print(poprun.__file__)"], capture_output=True,
                             text=True, timeout=30, cwd="/").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    checkout = Path(out).resolve().parent.parent.parent  # <checkout>/src/poprun/__init__.py
    return {"module": out, "git": _git_state(checkout) if (checkout / ".git").exists() else None}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per side and case (default 5; 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="2 reps, 3-run components, 30 s mpirun timeout")
    p.add_argument("--cases", type=parse_case, nargs="+", default=None, metavar="HxI",
                   help="hosts x instances per host (default: 16x4 4x2)")
    p.add_argument("--poprun", default=None, help="poprun executable (default: next to sys.executable, else PATH)")
    p.add_argument("--mpirun", default=open_mpi_mpirun(), help="Open MPI's mpirun executable")
    p.add_argument("--no-mpirun", action="store_true", help="leave the mpirun side out")
    p.add_argument("--mpirun-arg", action="append", default=[], dest="mpirun_extra", metavar="ARG",
                   help="extra mpirun argument, repeatable, e.g. --mpirun-arg=--mca "
                        "--mpirun-arg=plm_rsh_no_tree_spawn --mpirun-arg=1")
    p.add_argument("--mpirun-timeout", type=float, default=None,
                   help="seconds before an mpirun run counts as hung (default 60; 30 with --quick)")
    p.add_argument("--poprun-timeout", type=float, default=60.0, help="the same for poprun")
    p.add_argument("--mpirun-max-hangs", type=int, default=2,
                   help="stop running mpirun in a case after this many hangs there (0: never stop)")
    p.add_argument("--without-bashrc", action="store_true",
                   help="run everything in a private mount namespace where ~/.bashrc is empty "
                        "(/dev/null bind-mounted over it): what the launchers cost without the rc "
                        "file every ssh session runs; needs root; changes no file")
    p.add_argument("--no-components", action="store_true", help="skip the per-component timings")
    p.add_argument("--check", action="store_true", help="exit 1 unless poprun is faster in every case")
    p.add_argument("--tmpdir", default=None, help="where sshd dirs and outputs go (default: system temp dir)")
    p.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR), help="where the JSON goes")
    args = p.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 5)
    args.cases = args.cases or [Case(16, 4), Case(4, 2)]
    args.mpirun_timeout = args.mpirun_timeout or (30.0 if args.quick else 60.0)
    return args


NAMESPACE_MARK = "MULTIHOST_BENCH_RC_HIDDEN"


def rc_file() -> Path:
    """The rc file bash reads for a command run by sshd: ~/.bashrc of the user's passwd home."""
    import pwd
    return Path(pwd.getpwuid(os.getuid()).pw_dir) / ".bashrc"


def reexec_without_rc(argv: list[str] | None, script: Path | None = None) -> int:
    """Run this script again in a private mount namespace where ~/.bashrc is /dev/null, so
    every ssh session (poprun's agents, mpirun's orteds) starts without it. Changes no file
    and nothing outside the namespace (other work on the machine still sees the real one).
    `script`: the script to run again with `argv` (default: this one; run_all.py passes itself)."""
    rc = rc_file()
    if not can_hide_rc():
        print("multihost_bench: --without-bashrc needs root and unshare(1)", file=sys.stderr)
        return 2
    if not rc.exists():
        print(f"multihost_bench: {rc} does not exist; nothing to hide", file=sys.stderr)
    args = sys.argv[1:] if argv is None else argv
    cmd, env = without_rc([sys.executable, str(script or Path(__file__).resolve()), *args])
    return subprocess.run(cmd, env=env).returncode


def without_rc(cmd: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `cmd` in a private mount namespace where the rc file is
    /dev/null (root and unshare(1) needed: see can_hide_rc)."""
    rc = rc_file()
    return (["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             'mount --bind /dev/null "$1" && shift && exec "$@"', "sh", str(rc), *cmd],
            {**os.environ, NAMESPACE_MARK: str(rc)})


def can_hide_rc() -> bool:
    return os.getuid() == 0 and shutil.which("unshare") is not None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.without_bashrc and not os.environ.get(NAMESPACE_MARK):
        return reexec_without_rc(argv)
    args.bashrc_hidden = os.environ.get(NAMESPACE_MARK) or None
    poprun = args.poprun or default_poprun()
    if not poprun or not os.access(poprun, os.X_OK):
        print(f"multihost_bench: no poprun executable found ({poprun or 'not on PATH'})", file=sys.stderr)
        return 2
    mpirun = None
    if not args.no_mpirun:
        if os.access(args.mpirun, os.X_OK):
            mpirun = args.mpirun
        else:
            print(f"multihost_bench: mpirun not found at {args.mpirun}; mpirun side left out", file=sys.stderr)
    tools = Tools(poprun, mpirun, args.mpirun_extra, args.poprun_timeout, args.mpirun_timeout)
    missing = [t for t, where in (("sshd", "/usr/sbin/sshd"), ("ssh-keygen", None), ("ssh", None))
               if not shutil.which(t) and not (where and os.access(where, os.X_OK))]
    if missing:  # the harness would raise pytest's Skipped instead
        print(f"multihost_bench: {', '.join(missing)} not found (install openssh-server and "
              "openssh-client)", file=sys.stderr)
        return 2
    n_hosts = max(c.hosts for c in args.cases)
    load = {"before": uptime()}
    source = poprun_source(poprun)
    print(f"poprun: {poprun} (imports {source.get('module', '?')})\n"
          + (f"~/.bashrc hidden: {args.bashrc_hidden} is /dev/null in this run\n" if args.bashrc_hidden else "")
          + f"mpirun: {mpirun or '(not run)'} {' '.join(args.mpirun_extra)}\n"
          f"reps {args.reps}, cases {' '.join(c.name for c in args.cases)}, {os.cpu_count()} CPUs\n"
          f"{load['before']}", file=sys.stderr, flush=True)

    results: list[CaseResult] = []
    components: list[Component] = []
    with tempfile.TemporaryDirectory(prefix="multihost_bench.", dir=args.tmpdir) as tmp_name:
        tmp = Path(tmp_name)
        started = time.perf_counter()
        with start_ssh_hosts(n_hosts, tmp) as ssh:
            print(f"{n_hosts} sshd hosts up in {time.perf_counter() - started:.1f} s "
                  f"({ssh.hosts[0].addr}..{ssh.hosts[-1].addr}); ssh config {ssh.ssh_config}",
                  file=sys.stderr, flush=True)
            counter = [0]
            pycache = tmp / "pycache" if os.environ.get(BYTECODE_VAR) else None
            args.private_pycache = pycache is not None
            if pycache is not None:
                print(f"{BYTECODE_VAR} is set: launcher runs use a private bytecode cache "
                      f"(PYTHONPYCACHEPREFIX={pycache})", file=sys.stderr, flush=True)
            for case in args.cases:
                results.append(bench_case(tools, ssh, case, args.reps, args.mpirun_max_hangs,
                                          tmp / "runs", counter, pycache))
                load[f"after {case.name}"] = uptime()
            if not args.no_components:
                components = bench_components(tools, ssh, 3 if args.quick else 5, pycache)
            leftover = under_sshd(ssh)
        # Leaving the with-block stopped every sshd and whatever still ran under it.
    load["after"] = uptime()

    if args.bashrc_hidden:
        print(f"\n(--without-bashrc: {args.bashrc_hidden} was empty for every ssh session of this run)")
    for res in results:
        print_case(res)
    if components:
        print_components(components)
    print("\nLoad: " + "; ".join(f"{k}: {v.split('load average:')[-1].strip()}" for k, v in load.items()))
    if leftover:
        print(f"(stopped {len(leftover)} leftover processes under sshd at the end)")

    json_path = results_path(Path(args.results_dir), prefix="multihost-")
    write_json(json_path, args, tools, results, components, load, source)
    print(f"\nJSON: {json_path}")
    if args.check:
        lost = [r.case.name for r in results
                if len(r.sides) < 2 or not verdict(r.sides[0], r.sides[1]).startswith("yes")]
        if lost:
            print(f"--check: poprun not faster in {', '.join(lost)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
