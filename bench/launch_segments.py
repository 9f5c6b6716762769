"""Where the launcher's instructions go, by module import and by function (issue 28).

Runs one `poprun` launch under callgrind with a marker call (`os.getloadavg`, which poprun
never calls) before and after every module load and around the functions named in WRAP;
`--dump-before` on the marker's C function cuts the count into one segment per span between
two markers. Each segment is charged to the innermost module or function open at the time:
"self" is what ran there and nowhere deeper, "incl" adds what it loaded or called. Counts
are exact and do not depend on the load; the harness itself adds ~20 M (inspect, wrapping),
charged to `<start>` and to the modules that WRAP names.

    python bench/launch_segments.py                       # launch x8 of the installed poprun
    python bench/launch_segments.py --src /path/to/src --top 40 -- --num-instances 1 \\
        --num-replicas 1 --offline-mode=1 true

The bytecode cache must be warm for the figures to mean anything (PYTHONDONTWRITEBYTECODE
is set here): the script runs the launch once without callgrind first, with a private
PYTHONPYCACHEPREFIX.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import shutil
import subprocess
import sys
import tempfile

DEFAULT_ARGS = ["--num-instances", "8", "--num-replicas", "8", "--offline-mode=1", "true"]
MARKER = "os_getloadavg*"  # the C function behind os.getloadavg
WRAP = {  # module -> functions (Class.method) whose spans are segments of their own
    "poprun.cli.main": ["main", "_launch"],
    "poprun.cli.options": ["parse_args", "build_config"],
    "poprun.run.session": ["_Session.__aenter__", "_Session._plan", "_Session._run_attempt",
                           "_Session.__aexit__", "local_topologies"],
    "poprun.run.job": ["Job.start", "Job._spawn_local", "Job.on_exit"],
    "poprun.run.watching": ["JobControl.open"],
    "poprun.jobctl.watch": ["JobRecord.write"],
    "poprun.run.signals": ["install_signal_handlers"],
    "spawner.local": ["LocalSpawner.spawn", "LocalSpawner._sweep"],
    "spawner.lifeline": ["Lifeline.__init__", "Lifeline.make_temp_dir", "Lifeline.close"],
    "spawner.containment": ["become_subreaper", "kill_marked"],
    "subprocess": ["Popen._execute_child"],
}


def harness(events_path: str, argv: list[str]) -> None:
    """Inside callgrind: mark every module load and WRAP's functions, then run poprun."""
    import functools
    import importlib._bootstrap as bootstrap
    import inspect

    events: list[str] = []
    mark = os.getloadavg

    def wrapped(name: str, fn):
        if inspect.iscoroutinefunction(fn):
            async def span(*args, **kwargs):
                events.append(f"> {name}"), mark()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    events.append(f"< {name}"), mark()
        else:
            def span(*args, **kwargs):
                events.append(f"> {name}"), mark()
                try:
                    return fn(*args, **kwargs)
                finally:
                    events.append(f"< {name}"), mark()
        return functools.wraps(fn)(span)

    load = bootstrap._load_unlocked

    def wrap_functions(module) -> None:
        for qualname in WRAP.get(module.__name__, ()):
            *path, name = qualname.split(".")
            owner = functools.reduce(getattr, path, module)
            if isinstance(inspect.getattr_static(owner, name, None), (classmethod, staticmethod)):
                continue
            if callable(getattr(owner, name, None)):
                setattr(owner, name, wrapped(f"fn:{qualname}", getattr(owner, name)))

    def marked_load(spec):
        events.append(f"> {spec.name}"), mark()
        try:
            module = load(spec)
        finally:
            events.append(f"< {spec.name}"), mark()
        wrap_functions(module)
        return module

    for loaded in set(WRAP) & set(sys.modules):  # subprocess: imported at start-up
        wrap_functions(sys.modules[loaded])
    bootstrap._load_unlocked = marked_load
    me, real_exit = os.getpid(), os._exit

    def leave(code: int) -> None:
        if os.getpid() == me:  # not the lifeline's fork
            events.append("end"), mark()
            with open(events_path, "w") as f:
                f.write("\n".join(events) + "\n")
        real_exit(code)

    os._exit = leave
    sys.argv = ["poprun", *argv]
    from poprun_entry import run

    run()


def segments(directory: str) -> tuple[collections.Counter, collections.Counter, int]:
    """Self and inclusive instructions by name, and the total, from the dumps."""
    events = open(os.path.join(directory, "events")).read().split("\n")[:-1]
    files = glob.glob(os.path.join(directory, "cg.*"))
    pid = collections.Counter(os.path.basename(f).split(".")[1] for f in files).most_common(1)[0][0]
    cost = {}
    for path in files:
        parts = os.path.basename(path).split(".")
        if parts[1] == pid:  # cg.<pid>.<n>: the n-th dump; cg.<pid>: the rest, at exit
            with open(path) as f:
                total = next(int(line.split()[1]) for line in f
                             if line.startswith(("summary:", "totals:")))
            cost[int(parts[2]) if len(parts) > 2 else len(events) + 1] = total
    stack, own, incl = ["<start>"], collections.Counter(), collections.Counter()
    for n in range(1, len(events) + 2):  # dump n: from event n-2 to event n-1
        own[stack[-1]] += cost.get(n, 0)
        for name in set(stack):
            incl[name] += cost.get(n, 0)
        if n <= len(events):
            kind, _, name = events[n - 1].partition(" ")
            if kind == ">":
                stack.append(name)
            elif kind == "<":
                stack.pop()
            else:
                stack = ["<end>"]
    return own, incl, sum(cost.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", help="poprun's sources (default: the installed poprun's)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--harness", nargs=1, help=argparse.SUPPRESS)
    p.add_argument("args", nargs="*", help="poprun's arguments (after --)")
    a = p.parse_args()
    if a.harness:
        harness(a.harness[0], a.args)
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed")
    env = dict(os.environ, PYTHONPYCACHEPREFIX=os.environ.get(
        "PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "poprun-bench-pyc")))
    if a.src:
        env["PYTHONPATH"] = a.src
    args = a.args or DEFAULT_ARGS
    warm = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, __file__, "--harness", os.devnull, "--", *args], env=warm,
                   stdout=subprocess.DEVNULL, check=True)
    with tempfile.TemporaryDirectory(prefix="launch-segments-") as directory:
        subprocess.run(["valgrind", "--tool=callgrind", f"--dump-before={MARKER}",
                        f"--callgrind-out-file={directory}/cg.%p", sys.executable, __file__,
                        "--harness", os.path.join(directory, "events"), "--", *args],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        own, incl, total = segments(directory)
    print(f"total {total / 1e6:.1f} M instructions (the launcher; the harness included)")
    for name, count in own.most_common(a.top):
        print(f"{count / 1e6:8.2f} M self {incl[name] / 1e6:8.2f} M incl  {name}")


if __name__ == "__main__":
    main()
