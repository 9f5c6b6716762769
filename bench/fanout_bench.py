#!/usr/bin/env python3
"""SSH fan-out up to 64 hosts (issue 28, point 4): poprun against Open MPI's mpirun, pdsh and
clush, each running `hostname` on H loopback sshd hosts x I instances.

run_all.py's `fanout` scenario drives it (a sweep of host counts, then 64 x 4); alone it prints
a table:

    python bench/fanout_bench.py                        # 8x1 16x1 32x1 64x1 64x4, 3 reps
    python bench/fanout_bench.py --cases 64x1 --reps 5

Sides, alternating within each repetition, every one reaching every host over SSH (none runs
its first host locally: mpirun's `--host h1:I,...` names no local host either):

  poprun       `poprun -H h1,...,hH --num-instances H*I`: one asyncssh connection and one
               agent per host, all opened at once by the launcher itself (a flat fan-out)
  mpirun       Open MPI's mpirun (by path: bench/launch_bench.open_mpi_mpirun), as it runs by
               default: its rsh launcher's *tree spawn* (mpirun starts orteds over ssh on a few
               hosts, and those orteds start the rest)
  mpirun-flat  the same with `--mca plm_rsh_no_tree_spawn 1`: mpirun runs every ssh itself
  pdsh         `pdsh -R ssh -f H -w h1,...`, one OpenSSH client per host, all at once
  clush        ClusterShell's `clush -f H -w h1,...`, the same (Python, like poprun)
  connect      not a launcher: poprun's own connect (spawner.ssh.connect_all) opening H
               connections at once and closing them (no session, no remote command): the
               launcher's share of connection set-up (config, key exchange, auth) on its own
  connect-direct  asyncssh.connect with HostName, Port, user, key and known_hosts passed
               directly and no ~/.ssh/config read: set-up without any config

For I > 1, pdsh and clush run `hostname & ... & wait` (I at once) through their one session
per host. pdsh and clush are skipped, saying so, where they are not installed (Debian:
`apt-get install pdsh clustershell`).

Per run: wall time (Popen to reap), the launcher's own CPU (utime+stime of its process, read
from its zombie) and its tree's (wait4: with every child it reaped, e.g. the ssh clients of
mpirun, pdsh and clush), its peak RSS (VmHWM, sampled every 20 ms), and the CPU the remote
side cost: what the sshd listeners reaped during the run (cutime+cstime of each listener:
sshd's session processes, the login shell with its rc file, the agents or orteds, the
instances). Output is checked: exactly H*I lines, each this machine's hostname (pdsh and
clush: `hK: <hostname>`, I per host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent / "tests")]

import launch_bench as lb  # noqa: E402
import multihost_bench as mh  # noqa: E402

SIDES = ("poprun", "mpirun", "mpirun-flat", "pdsh", "clush", "connect", "connect-direct")
REFERENCES = ("connect", "connect-direct")  # not launchers
CASES = ("8x1", "16x1", "32x1", "64x1", "64x4")
FLAT = ["--mca", "plm_rsh_no_tree_spawn", "1"]

# poprun's interpreter opening every connection with poprun's own connect (spawner.ssh:
# HOME's .ssh/config, key and known_hosts, each file parsed once) and closing it, nothing else.
CONNECT_PROGRAM = """\
import asyncio, sys
from spawner.ssh import Target, connect_all

async def main(hosts):
    conns = await connect_all([Target(h) for h in hosts])
    await conns.close()

asyncio.run(main(sys.argv[1:]))
"""
# asyncssh.connect with everything the config gives passed directly and no config read
# (config=[]): connection set-up without any config (bench/README.md).
CONNECT_DIRECT_PROGRAM = """\
import asyncio, sys
import asyncssh

async def main(user, key, known_hosts, targets):
    key, known_hosts = asyncssh.read_private_key(key), asyncssh.read_known_hosts(known_hosts)
    conns = await asyncio.gather(*(
        asyncssh.connect(addr, port=int(port), username=user, client_keys=[key], known_hosts=known_hosts,
                         config=[])
        for addr, port in (t.rsplit(":", 1) for t in targets)))
    for c in conns:
        c.close()
    await asyncio.gather(*(c.wait_closed() for c in conns))

asyncio.run(main(*sys.argv[1:4], sys.argv[4:]))
"""


@dataclass(frozen=True)
class Tools:
    """The sides' executables; None: not installed (the side is skipped)."""

    poprun: str | None
    mpirun: str | None  # Open MPI's, by path
    pdsh: str | None
    clush: str | None
    python: str  # poprun's interpreter, for the connect reference
    poprun_timeout: float = 60.0
    mpirun_timeout: float = 30.0

    @property
    def multihost(self) -> mh.Tools:
        return mh.Tools(self.poprun or "poprun", self.mpirun, [], self.poprun_timeout, self.mpirun_timeout)


def find_tools(poprun: str | None, mpirun: str | None, python: str = sys.executable,
               poprun_timeout: float = 60.0, mpirun_timeout: float = 30.0) -> Tools:
    return Tools(poprun, mpirun, shutil.which("pdsh"), shutil.which("clush"), python,
                 poprun_timeout, mpirun_timeout)


def versions(tools: Tools) -> dict[str, dict]:
    """pdsh's and clush's version or why they are skipped (run_all names the other sides)."""
    out = {}
    for name, path, flag, package in (("pdsh", tools.pdsh, "-V", "pdsh"),
                                      ("clush", tools.clush, "--version", "clustershell")):
        if path is None:
            out[name] = {"available": False, "reason": f"{name} not installed (apt-get install {package})"}
            continue
        try:
            text = subprocess.run([path, flag], capture_output=True, text=True, timeout=30)
            line = (text.stdout or text.stderr).strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError) as exc:
            out[name] = {"available": False, "reason": f"{path} {flag} failed: {exc}"}
            continue
        out[name] = {"available": True, "path": path, "version": line}
    return out


# ---------------------------------------------------------------------------- commands


def remote_command(per_host: int) -> str:
    """What pdsh and clush run per host: `hostname`, or I of them at once."""
    return "hostname" if per_host == 1 else " & ".join(["hostname"] * per_host) + " & wait"


def command(tools: Tools, side: str, ssh, case: mh.Case) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one side (HOME: the harness's, for asyncssh's .ssh/config)."""
    names = ssh.aliases[:case.hosts]
    env = ssh.env()
    if side == "poprun":
        return tools.multihost.poprun_cmd(names, case), env
    if side in ("mpirun", "mpirun-flat"):
        cmd = tools.multihost.mpirun_cmd(names, case, ssh.ssh_config)
        return (cmd[:-1] + FLAT + cmd[-1:] if side == "mpirun-flat" else cmd), env
    if side == "pdsh":
        # pdsh's ssh module runs `ssh $PDSH_SSH_ARGS`; -F: OpenSSH takes ~ from passwd, not $HOME.
        return ([tools.pdsh, "-R", "ssh", "-f", str(case.hosts), "-w", ",".join(names),
                 remote_command(case.per_host)],
                {**env, "PDSH_SSH_ARGS": f"-F {ssh.ssh_config} -x %h"})
    if side == "clush":
        return ([tools.clush, "-f", str(case.hosts), "-w", ",".join(names), "-o", f"-F {ssh.ssh_config}",
                 "--nostdin", remote_command(case.per_host)], env)
    if side == "connect":
        return [tools.python, "-c", CONNECT_PROGRAM, *names], env
    if side == "connect-direct":
        return ([tools.python, "-c", CONNECT_DIRECT_PROGRAM, ssh.user, str(ssh.user_key), str(ssh.known_hosts),
                 *(f"{h.addr}:{h.port}" for h in ssh.hosts[:case.hosts])], env)
    raise ValueError(side)


def available(tools: Tools, side: str) -> bool:
    path = {"poprun": tools.poprun, "mpirun": tools.mpirun, "mpirun-flat": tools.mpirun,
            "pdsh": tools.pdsh, "clush": tools.clush, "connect": tools.python,
            "connect-direct": tools.python}[side]
    return bool(path) and os.access(path, os.X_OK)


# ---------------------------------------------------------------------------- checks


def verify_prefixed(path: Path, aliases: list[str], per_host: int) -> str:
    """'' if every line is `<alias>: <this machine's hostname>`, per_host of them for each
    alias (pdsh's and clush's output), else what is wrong."""
    want = socket.gethostname()
    counts = dict.fromkeys(aliases, 0)
    bad = []
    for line in path.read_text(errors="replace").splitlines():
        alias, sep, rest = line.partition(": ")
        if sep and alias in counts and rest == want:
            counts[alias] += 1
        else:
            bad.append(line)
    wrong = [a for a, n in counts.items() if n != per_host]
    problems = []
    if bad:
        problems.append(f"{len(bad)} lines are not '<host>: {want}', e.g. {bad[0][:100]!r}")
    if wrong:
        problems.append(f"{len(wrong)} hosts without {per_host} lines, e.g. {wrong[0]}: {counts[wrong[0]]}")
    return "; ".join(problems)


def verifier(side: str, aliases: list[str], case: mh.Case):
    if side in ("pdsh", "clush"):
        return lambda path: verify_prefixed(path, aliases, case.per_host)
    if side in REFERENCES:
        return lambda path: ""  # they print nothing; the exit status says all connected
    return lambda path: mh.verify_hostname_lines(path, case.instances)


# ---------------------------------------------------------------------------- one run


def reaped_cpu(pids: list[int]) -> float:
    """cutime+cstime of these processes: the CPU of every child they have reaped so far."""
    return sum(lb.zombie_cpu(pid)[1] or 0.0 for pid in pids)


def fanout_run(side: str, cmd: list[str], env: dict[str, str], timeout: float, d: Path, ssh,
               verify, strict: bool) -> lb.Run:
    """One timed run (launch_bench's run_timed: pidfd wake-up, own and tree CPU, peak RSS);
    on a hang, what runs under the sshd listeners is killed too (the remote half of the job is
    not in the launcher's tree). Then wait until nothing runs under sshd, and record what the
    listeners reaped meanwhile as the remote side's CPU (extra["remote_cpu_s"])."""
    listeners = [h.proc.pid for h in ssh.hosts if h.alive]
    before = reaped_cpu(listeners)
    with open(d / "out", "wb") as out:
        run = lb.run_timed(side, [cmd], [out], timeout, d, env, measure=True, peak_rss=True)
    if run.status == "hung":
        lb.kill_pids(mh.under_sshd(ssh))
    run = lb.checked(run, lambda: verify(d / "out"), strict=strict)
    note = mh.settle(ssh)
    if note:
        run = dataclasses.replace(run, detail=(run.detail + "; " if run.detail else "") + note)
    if run.status == "ok":
        run.extra["remote_cpu_s"] = reaped_cpu(listeners) - before
    return run


def bench_case(tools: Tools, ssh, case: mh.Case, sides: tuple[str, ...], reps: int, tmp: Path,
               pycache: Path | None) -> list[lb.Side]:
    """Every available side of `sides` on the first case.hosts hosts, interleaved."""
    aliases = ssh.aliases[:case.hosts]
    contenders = []
    for name in sides:
        if not available(tools, name):
            continue
        cmd, env = command(tools, name, ssh, case)
        if name == "poprun" or name in REFERENCES:
            env = lb.python_env(env, pycache)
        timeout = tools.mpirun_timeout if name.startswith("mpirun") else tools.poprun_timeout

        def run(d: Path, name=name, cmd=cmd, env=env, timeout=timeout) -> lb.Run:
            return fanout_run(name, cmd, env, timeout, d, ssh, verifier(name, aliases, case),
                              strict=name == "poprun" or name in REFERENCES)

        # mpirun hangs now and then here (bench/README.md): one hang in a case is enough.
        contenders.append(lb.Contender(lb.Side(name, cmd), run, max_hangs=0 if name == "poprun" else 1))
    lb.interleave(contenders, reps, tmp, f"fanout {case.name}")
    return [c.side for c in contenders]


def phases(tools: Tools, ssh, case: mh.Case, tmp: Path, pycache: Path | None) -> dict:
    """One `poprun -v` run: when each host was connected and its agent ready (multihost_bench)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ph = mh.phase_run(tools.multihost, ssh, case, ssh.aliases[:case.hosts],
                      lb.python_env(ssh.env(), pycache), tmp)
    return {"case": case.name, "status": ph.status, "seconds": ph.seconds, "hosts": ph.hosts,
            "timeline": ph.timeline}


def bench_fanout(tools: Tools, cases: list[mh.Case], sides: tuple[str, ...], reps: int, tmp: Path,
                 pycache: Path | None, phase_case: mh.Case | None = None, log=print) -> dict:
    """Start max(hosts) sshd hosts once; run every case on the first H of them."""
    from sshd_hosts import start_ssh_hosts

    tmp.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    out: dict = {"cases": []}
    with start_ssh_hosts(max(c.hosts for c in cases), tmp) as ssh:
        out["hosts_up_s"] = round(time.perf_counter() - started, 2)
        log(f"fanout: {len(ssh.hosts)} sshd hosts up in {out['hosts_up_s']:.1f} s")
        for case in cases:
            res = bench_case(tools, ssh, case, sides, reps, tmp / case.name, pycache)
            out["cases"].append({"case": case.name, "hosts": case.hosts, "per_host": case.per_host,
                                 "sides": [s.to_json() for s in res]})
        if phase_case is not None and available(tools, "poprun"):
            out["phases"] = phases(tools, ssh, phase_case, tmp / "phases", pycache)
    return out


def bench_fanout_rc_hidden(tools: Tools, cases: list[mh.Case], sides: tuple[str, ...], reps: int, tmp: Path,
                           pycache: Path | None, phase_case: mh.Case | None = None, log=print) -> dict:
    """bench_fanout with the login shell's rc file hidden from every ssh session: run again in
    a child in a private mount namespace where ~/.bashrc is /dev/null (multihost_bench's
    --without-bashrc). Here that rc file runs `pyenv init -`, whose rehash lock serialises the
    sessions: at 64 hosts pdsh took 43 s and poprun's agents missed its 30 s HELLO timeout, a
    measure of pyenv, not of the launchers. In-process where it is hidden already or cannot be
    (not root, no unshare): "rc_file_hidden" says which."""
    hidden = os.environ.get(mh.NAMESPACE_MARK)
    if hidden or not mh.can_hide_rc():
        return {**bench_fanout(tools, cases, sides, reps, tmp, pycache, phase_case, log), "rc_file_hidden": hidden}
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "fanout.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--cases", *(c.name for c in cases),
            "--sides", ",".join(sides), "--reps", str(reps), "--tmpdir", str(tmp), "--json", str(out),
            "--poprun-timeout", str(tools.poprun_timeout), "--mpirun-timeout", str(tools.mpirun_timeout),
            *(["--phases", phase_case.name] if phase_case else []),
            *(["--poprun", tools.poprun] if tools.poprun else []), *(["--mpirun", tools.mpirun] if tools.mpirun else [])]
    cmd, env = mh.without_rc(argv)
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"fanout_bench in a namespace without the rc file exited {proc.returncode}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------- alone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=mh.parse_case, nargs="+", default=[mh.parse_case(c) for c in CASES],
                   metavar="HxI", help=f"hosts x instances per host (default: {' '.join(CASES)})")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per side and case")
    p.add_argument("--poprun", default=None, help="poprun executable (default: next to sys.executable, else PATH)")
    p.add_argument("--mpirun", default=None, help="Open MPI's mpirun (default: found by what it is, not by name)")
    p.add_argument("--mpirun-timeout", type=float, default=30.0, help="seconds before an mpirun run is a hang")
    p.add_argument("--poprun-timeout", type=float, default=60.0, help="seconds before a poprun run is a hang")
    p.add_argument("--phases", type=mh.parse_case, default=None, metavar="HxI",
                   help="after the cases, one `poprun -v` run of this case for the per-host phases")
    p.add_argument("--tmpdir", default=None, help="where sshd dirs and outputs go")
    p.add_argument("--with-rc", action="store_true",
                   help="leave ~/.bashrc as it is for every ssh session (default: hidden where root can)")
    p.add_argument("--json", default=None, help="write the results (run_all's fanout scenario) to this file")
    args = p.parse_args(argv)
    sides = tuple(s for s in args.sides.split(",") if s)
    if bad := [s for s in sides if s not in SIDES]:
        p.error(f"unknown side(s) {', '.join(bad)}")
    tools = find_tools(args.poprun or lb.default_poprun(), args.mpirun or lb.open_mpi_mpirun(),
                       poprun_timeout=args.poprun_timeout, mpirun_timeout=args.mpirun_timeout)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="fanout_bench.", dir=args.tmpdir) as tmp_name:
        tmp = Path(tmp_name)
        pycache = tmp / "pycache" if os.environ.get(lb.BYTECODE_VAR) else None
        if args.with_rc or os.environ.get(mh.NAMESPACE_MARK):
            res = {**bench_fanout(tools, args.cases, sides, args.reps, tmp, pycache, args.phases, log),
                   "rc_file_hidden": os.environ.get(mh.NAMESPACE_MARK)}
        else:
            res = bench_fanout_rc_hidden(tools, args.cases, sides, args.reps, tmp, pycache, args.phases, log)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    else:
        import report
        print("\n".join(report.fanout_section(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
