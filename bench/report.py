#!/usr/bin/env python3
"""Render run_all.py's results: the targets, results.md and results.png, from results.json.

Pure functions of the results document (a dict, as run_all writes it), so the page and the
chart can be rendered again, and tested, without running anything:

    python bench/report.py bench/results.json      # rewrites results.md and results.png beside it
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path

# The targets of issue 18, point 4.
LAUNCH_FLOOR_N = 8
LAUNCH_FLOOR_MAX_S = 0.060  # poprun median - floor median, at 8 instances
LAUNCH_MPIRUN_FROM = 64  # from this N on, poprun faster than mpirun
TORCHRUN_MIN_X = 10.0  # torchrun median / poprun median, at every N
OUTPUT_FLOOR_MAX_X = 1.5  # poprun median / one-writer floor median
RSS_MAX_MIB = 80.0  # every run, at TARGET_N instances
TEARDOWN_MAX_S = 1.0  # every run, at TARGET_N instances
TARGET_N = 256
# Issue 24, point 6.
MPI_TARGET_N = 16  # local ranks
MPI_MPIEXEC_MAX_X = 1.5  # poprun median / MPICH mpiexec median
# Issue 28, point 3.
OUTPUT_NONE_MAX_X = 1.4  # poprun median / no launcher's (the writers each to its own file)

NAMES = {"baseline": "no launcher", "none": "no launcher", "floor": "floor",
         "series": "writers in series"}
FLOOR_NAMES = {"launch": '`python -c "import asyncio"`', "output": "one writer (dd)",
               "mpi": '`python -c "from mpi4py import MPI"`'}
COLOURS = {"floor": "#999999", "series": "#7f7f7f", "baseline": "#bbbbbb", "poprun": "#1f77b4", "mpirun": "#d62728",
           "torchrun": "#ff7f0e", "srun": "#2ca02c", "mpiexec": "#9467bd", "mpirun-flat": "#ff9896",
           "pdsh": "#8c564b", "clush": "#e377c2"}
QUICK_BANNER = ("**Quick run (`--quick`), machine shared: smoke-test figures, not the published "
                "ones.** Fewer sizes, one repetition, 20k lines.")


# ---------------------------------------------------------------------------- helpers


def side(sides: list[dict], name: str) -> dict | None:
    return next((s for s in sides if s["name"] == name), None)


def med(s: dict | None) -> float | None:
    return s.get("median_s") if s else None


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    return f"{seconds:.1f} s"


def fmt_range(lo: float | None, hi: float | None, unit=fmt_s) -> str:
    """' (62–102 ms)', ' (980 ms–1.02 s)'; '' for one value."""
    if lo is None or hi is None:
        return ""
    a, b = unit(lo), unit(hi)
    if a == b:
        return ""
    a_num, _, a_unit = a.partition(" ")
    b_num, _, b_unit = b.partition(" ")
    return f" ({a_num}–{b})" if a_unit == b_unit else f" ({a}–{b})"


def problems(s: dict) -> str:
    """'2 hung, 1 failed' etc.: what kept runs from being timed, and flagged output."""
    parts = [f"{s[k]} {k}" for k in ("hung", "failed", "skipped") if s.get(k)]
    malformed = sum(1 for r in s.get("runs", []) if r.get("status") == "ok" and r.get("verified") is False)
    if malformed:
        parts.append(f"{malformed} malformed output†")
    return ", ".join(parts)


def cell(s: dict | None) -> str:
    """'412 ms (398 ms–430 ms)', with what went wrong."""
    if s is None:
        return "—"
    text = fmt_s(s.get("median_s")) + fmt_range(s.get("min_s"), s.get("max_s"))
    if why := problems(s):
        text += f" · {why}"
    return text


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_x(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}×" if x < 10 else f"{x:.1f}×"


def mib(kib: float | None) -> str:
    return "—" if kib is None else f"{kib / 1024:.1f} MiB"


def poprun_problem(s: dict | None) -> str:
    """'' if every poprun run succeeded, else why a target cannot hold."""
    if s is None:
        return "poprun not run"
    bad = [r for r in s.get("runs", []) if r["status"] in ("failed", "hung")]
    if bad:
        return f"{len(bad)} of {len(s['runs'])} poprun runs {bad[0]['status']}: {bad[0]['detail'][:160]}"
    if s.get("median_s") is None:
        return "no successful poprun run"
    return ""


def cpu_per_line(s: dict | None, lines: int) -> str:
    """A launcher's own CPU (median) over the lines it passed on: '119 ns'; '' unmeasured."""
    cpu = (s or {}).get("cpu_s")
    if not cpu or not lines:
        return ""
    return f"{cpu['median'] / lines * 1e9:.0f} ns"


def target(name: str, description: str, status: str, detail: str) -> dict:
    return {"name": name, "description": description, "status": status, "detail": detail}


def competitor_target(name: str, desc: str, pop: dict | None, other: dict | None, other_name: str,
                      holds) -> dict:
    """A target comparing poprun's median with another side's: holds(ratio) decides."""
    if why := poprun_problem(pop):
        return target(name, desc, "fail", why)
    if other is None:
        return target(name, desc, "skip", f"{other_name} not run")
    if other.get("median_s") is None:
        hung = other.get("hung", 0)
        if hung and not other.get("failed"):
            # A launcher that never finished is slower than one that did.
            return target(name, desc, "pass", f"{other_name} completed none of its runs ({hung} hung)")
        return target(name, desc, "skip", f"{other_name} completed no run ({problems(other)})")
    x = pop["median_s"] / other["median_s"]
    return target(name, desc, "pass" if holds(x) else "fail",
                  f"poprun {fmt_s(pop['median_s'])} = {fmt_x(x)} {other_name}'s {fmt_s(other['median_s'])}")


# ---------------------------------------------------------------------------- targets


def targets(doc: dict) -> list[dict]:
    """Every target of the scenarios that ran, with pass / fail / skip and the figures."""
    out: list[dict] = []
    sc = doc.get("scenarios", {})
    launch = sc.get("launch", {})
    for case in launch.get("cases", []):
        n, sides = case["n"], case["sides"]
        pop = side(sides, "poprun")
        if n == LAUNCH_FLOOR_N:
            desc = (f"launch ×{n}: poprun within {LAUNCH_FLOOR_MAX_S * 1000:.0f} ms of "
                    '`python -c "import asyncio"`')
            floor = side(sides, "floor")
            if why := poprun_problem(pop):
                out.append(target(f"launch-{n}-floor", desc, "fail", why))
            elif med(floor) is None:
                out.append(target(f"launch-{n}-floor", desc, "skip", "no floor run"))
            else:
                gap = pop["median_s"] - floor["median_s"]
                out.append(target(f"launch-{n}-floor", desc, "pass" if gap <= LAUNCH_FLOOR_MAX_S else "fail",
                                  f"poprun {fmt_s(pop['median_s'])} − floor {fmt_s(floor['median_s'])} = "
                                  f"{gap * 1000:+.0f} ms"))
        if n >= LAUNCH_MPIRUN_FROM:
            out.append(competitor_target(f"launch-{n}-mpirun", f"launch ×{n}: poprun faster than mpirun",
                                         pop, side(sides, "mpirun"), "mpirun", lambda x: x < 1))
        out.append(competitor_target(
            f"launch-{n}-torchrun", f"launch ×{n}: poprun ≥ {TORCHRUN_MIN_X:.0f}× faster than torchrun",
            pop, side(sides, "torchrun"), "torchrun", lambda x: x <= 1 / TORCHRUN_MIN_X))
    for case in sc.get("output", {}).get("cases", []):
        n, sides = case["n"], case["sides"]
        pop = side(sides, "poprun")
        out.append(competitor_target(
            f"output-{n}-floor", f"output ×{n}: poprun within {OUTPUT_FLOOR_MAX_X:g}× the one-writer floor",
            pop, side(sides, "floor"), "floor", lambda x: x <= OUTPUT_FLOOR_MAX_X))
        none = competitor_target(
            f"output-{n}-none", f"output ×{n}: poprun within {OUTPUT_NONE_MAX_X:g}× no launcher",
            pop, side(sides, "baseline"), "no launcher", lambda x: x <= OUTPUT_NONE_MAX_X)
        if per_line := cpu_per_line(pop, n * case["lines"]):
            none["detail"] += f"; poprun's own CPU {per_line} a line"
        out.append(none)
        out.append(competitor_target(f"output-{n}-mpirun", f"output ×{n}: poprun faster than mpirun",
                                     pop, side(sides, "mpirun"), "mpirun", lambda x: x < 1))
    for case in sc.get("ssh", {}).get("cases", []):
        out.append(competitor_target(f"ssh-{case['case']}", f"ssh fan-out {case['case']}: poprun faster than mpirun",
                                     side(case["sides"], "poprun"), side(case["sides"], "mpirun"), "mpirun",
                                     lambda x: x < 1))
    for case in sc.get("mpi", {}).get("cases", []):
        if case["n"] == MPI_TARGET_N:
            out.append(competitor_target(
                f"mpi-{case['n']}-mpiexec", f"MPI world ×{case['n']}: poprun within {MPI_MPIEXEC_MAX_X:g}× "
                "MPICH's mpiexec", side(case["sides"], "poprun"), side(case["sides"], "mpiexec"), "mpiexec",
                lambda x: x <= MPI_MPIEXEC_MAX_X))
    for case in sc.get("ompi", {}).get("cases", []):
        if case["n"] == MPI_TARGET_N:
            out.append(competitor_target(
                f"ompi-{case['n']}-mpirun", f"Open MPI world ×{case['n']}: poprun within "
                f"{MPI_MPIEXEC_MAX_X:g}× Open MPI's mpirun", side(case["sides"], "poprun"),
                side(case["sides"], "mpirun"), "mpirun", lambda x: x <= MPI_MPIEXEC_MAX_X))
    td = sc.get("teardown", {})
    if td.get("sides"):
        pop = side(td["sides"], "poprun")
        at = "" if td["n"] == TARGET_N else f" (measured at {td['n']}; the target is at {TARGET_N})"
        reported = td.get("reported", ["rss", "teardown"])
        if "rss" in reported:
            desc = f"RSS: poprun's peak ≤ {RSS_MAX_MIB:g} MiB at {TARGET_N} instances"
            rss = (pop or {}).get("rss_kib")
            if why := poprun_problem(pop):
                out.append(target("rss", desc, "fail", why))
            elif td["n"] != TARGET_N or rss is None:
                out.append(target("rss", desc, "skip", f"max {mib(rss and rss['max'])}{at}"))
            else:
                out.append(target("rss", desc, "pass" if rss["max"] / 1024 <= RSS_MAX_MIB else "fail",
                                  f"max over runs {mib(rss['max'])} (median {mib(rss['median'])})"))
        if "teardown" in reported:
            desc = f"teardown: every poprun run ≤ {TEARDOWN_MAX_S:g} s at {TARGET_N} instances"
            if why := poprun_problem(pop):
                out.append(target("teardown", desc, "fail", why))
            elif td["n"] != TARGET_N:
                out.append(target("teardown", desc, "skip", f"max {fmt_s(pop['max_s'])}{at}"))
            else:
                out.append(target("teardown", desc, "pass" if pop["max_s"] <= TEARDOWN_MAX_S else "fail",
                                  f"max {fmt_s(pop['max_s'])} (median {fmt_s(pop['median_s'])})"))
    return out


# ---------------------------------------------------------------------------- results.md


def side_title(name: str, scenario: str = "") -> str:
    if name == "floor":
        return f"floor: {FLOOR_NAMES.get(scenario, 'floor')}"
    return NAMES.get(name, name)


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows] + [""])


def skipped_note(block: dict) -> list[str]:
    lines = []
    if block.get("skipped"):
        lines.append(f"Skipped: {block['skipped']}.\n")
    if block.get("error"):
        lines.append(f"**This scenario failed:** `{block['error']}`\n")
    for name, why in (block.get("not_applicable") or {}).items():
        lines.append(f"- {NAMES.get(name, name)}: not applicable ({why}).")
    if block.get("not_applicable"):
        lines.append("")
    return lines


def render_markdown(doc: dict) -> str:
    m = doc.get("machine", {})
    sides = doc.get("sides", {})
    sc = doc.get("scenarios", {})
    L: list[str] = ["# poprun benchmarks", ""]
    if doc.get("quick"):
        L += ["> " + QUICK_BANNER, ""]
    L += [f"Measured {m.get('timestamp', '?')} with `{doc.get('command', 'python bench/run_all.py')}` "
          f"({doc.get('seconds', 0):.0f} s in all). Every side of a scenario ran in the same invocation, "
          "alternating (A B C A B C …). Figures are the **median (min–max)** of the successful runs; "
          "ratios are medians divided.", ""]
    for later in doc.get("merged", []):
        L += [f"Measured later and merged into this page (`--merge`): {', '.join(later['scenarios'])}, "
              f"{later['timestamp']} with `{later['command']}` ({later['seconds']:.0f} s; load average before "
              + ", ".join(f"{x:.2f}" for x in later["load_before"]) + ", after "
              + ", ".join(f"{x:.2f}" for x in later["load_after"]) + ").", ""]
    load_b = m.get("load_before") or []
    load_a = m.get("load_after") or []
    L += ["## Machine", ""]
    L += md_table(["", ""], [
        ["CPU", f"{m.get('cpu_model', '?')}"],
        ["cores", f"{m.get('cpus', '?')} ({m.get('cpus_usable', '?')} usable)"],
        ["memory", m.get("memory", "?")],
        ["kernel", m.get("kernel", "?")],
        ["Python", f"{m.get('python', '?')} (`{m.get('python_path', '')}`)"],
        ["load average (1, 5, 15 min)", "before " + ", ".join(f"{x:.2f}" for x in load_b)
         + ("; after " + ", ".join(f"{x:.2f}" for x in load_a) if load_a else "")],
    ])
    L += ["## Sides", ""]
    rows = []
    for name in ("poprun", "mpirun", "torchrun", "mpiexec", "pdsh", "clush", "none"):
        info = sides.get(name)
        if not info:
            continue
        shown = "no launcher" if name == "none" else name
        if info.get("available"):
            rows.append([shown, info.get("version", ""), f"`{info['path']}`" if info.get("path") else ""])
        else:
            rows.append([shown, f"**skipped**: {info.get('reason', 'not installed')}", ""])
    L += md_table(["side", "version", "path"], rows)
    if doc.get("private_pycache"):
        L += ["PYTHONDONTWRITEBYTECODE was set, so poprun and the asyncio floor ran with a private, "
              "warmed bytecode cache (PYTHONPYCACHEPREFIX), as a user's installation would have.", ""]

    L += ["## Targets", ""]
    ts = doc.get("targets") or targets(doc)
    if ts:
        held = sum(t["status"] == "pass" for t in ts)
        missed = [t["name"] for t in ts if t["status"] == "fail"]
        L += [f"{held} of {len(ts)} hold" + (f"; missed: {', '.join(missed)}" if missed else "") + ".", ""]
        L += md_table(["target", "holds?", "measured"],
                      [[t["description"], {"pass": "yes", "fail": "**no**", "skip": "not judged"}[t["status"]],
                        t["detail"]] for t in ts])
    else:
        L += ["No scenario with a target ran.", ""]
    L += ["![side's time ÷ poprun's](results.png)", ""]

    if "launch" in sc:
        L += launch_section(sc["launch"])
    if "output" in sc:
        L += output_section(sc["output"])
    if "fold" in sc:
        L += fold_section(sc["fold"])
    if "ssh" in sc:
        L += ssh_section(sc["ssh"])
    if "fanout" in sc:
        L += fanout_section(sc["fanout"])
    if "teardown" in sc:
        L += teardown_section(sc["teardown"])
    if "slurm" in sc:
        L += slurm_section(sc["slurm"])
    if "mpi" in sc:
        L += mpi_section(sc["mpi"])
    if "ompi" in sc:
        L += ompi_section(sc["ompi"])
    if "profile" in doc:
        L += profile_section(doc["profile"])
    L += methods()
    return "\n".join(L).rstrip() + "\n"


def launch_section(block: dict) -> list[str]:
    L = ["## Launch latency", "",
         "`true` as N instances, stdout to /dev/null: from just before the launcher's `Popen` to "
         "the reaping of its exit. *No launcher*: the N `true` started at once by the benchmark "
         'itself. *Floor*: `python -c "import asyncio"`, once whatever N: what any launcher written '
         "with asyncio pays before it does anything.", ""]
    L += skipped_note(block)
    cases = block.get("cases", [])
    if not cases:
        return L
    names = [s["name"] for s in cases[0]["sides"]]
    header = ["N"] + [NAMES.get(n, n) for n in names]
    others = [n for n in names if n in ("mpirun", "torchrun")]
    gap = "poprun" in names and "floor" in names
    header += (["poprun − floor"] if gap else []) + [f"{n} ÷ poprun" for n in others]
    rows = []
    for case in cases:
        pop = side(case["sides"], "poprun")
        row = [str(case["n"])] + [cell(side(case["sides"], n)) for n in names]
        if gap:
            floor = side(case["sides"], "floor")
            row.append(f"{(med(pop) - med(floor)) * 1000:+.0f} ms" if med(pop) is not None and med(floor) is not None
                       else "—")
        row += [fmt_x(ratio(med(side(case["sides"], n)), med(pop))) for n in others]
        rows.append(row)
    L += md_table(header, rows)
    return L


def output_section(block: dict) -> list[str]:
    L = ["## Tagged output throughput", "",
         f"N instances of `{block.get('writer', 'seq')}` ({block.get('lines', 0):,} lines of "
         f"{block.get('line_bytes', 59)} bytes each), `--tag-output` (torchrun: `--tee 3`), the "
         "launcher's stdout to a file; every launcher's output is checked line by line. *No launcher*: "
         "the N writers each writing to a file of its own. *Floor*: one process (`dd`, 128 KiB "
         "blocks) writing exactly the tagged bytes a launcher must produce into the same kind of "
         "file: the least any launcher that serialises lines into one stream can take, the writers' "
         "own work not counted. *Writers in series*: the N writers one after the other, each writing "
         "its lines already tagged (`seq -f '[1,i]<stdout>:%058.0f'`) into one file: the writers' work "
         "plus one stream, with no launcher, no pipe and no concurrency (a launcher on several cores "
         "can beat it). *Launcher CPU*: the launcher process's own user+system time, its instances "
         "excluded (start-up included); *per line*: that time over the N × lines it passed on.", ""]
    L += skipped_note(block)
    for case in block.get("cases", []):
        pop = side(case["sides"], "poprun")
        floor = side(case["sides"], "floor")
        L += [f"**{case['n']} instances × {case['lines']:,} lines**", ""]
        rows = []
        for s in case["sides"]:
            cpu = s.get("cpu_s")
            rows.append([side_title(s["name"], "output"), cell(s),
                         fmt_x(ratio(med(s), med(floor))), fmt_x(ratio(med(s), med(pop))),
                         fmt_s(cpu["median"]) + fmt_range(cpu["min"], cpu["max"]) if cpu else "—",
                         cpu_per_line(s, case["n"] * case["lines"]) or "—"])
        L += md_table(["side", "wall time", "÷ floor", "÷ poprun", "launcher CPU (own)",
                       "launcher CPU per line"], rows)
    if any(problems(s).endswith("†") or "malformed" in problems(s)
           for c in block.get("cases", []) for s in c["sides"]):
        L += ["† timed anyway, output not as a launcher should write it: mpirun 4.1 tags each chunk it "
              "reads, not each line, so lines are torn and interleaved (bench/README.md).", ""]
    return L


def fold_section(block: dict) -> list[str]:
    """`--fold-output` against plain tagged output (bench/fold_bench.py)."""
    L = ["## Folded output (`--fold-output`)", ""]
    if "error" in block or "skipped" in block:
        return L + skipped_note(block)
    n, lines = block.get("n", 8), block.get("lines", 0)
    L += [f"{n} instances × {lines:,} lines of `{block.get('writer', 'seq')}`, `--tag-output`, "
          "stdout to a file, without and with `--fold-output`, alternating. Every instance writes "
          "the same lines, so folding prints each once (`[1,0-7]<stdout>:`); the output is checked "
          "instance by instance either way.", ""]
    rows = []
    for s in block.get("throughput", []):
        cpu = s.get("cpu_s")
        shown = sorted(x for x in s.get("console_lines", []) if x is not None)
        rows.append([f"`{s['name']}`", cell(s),
                     fmt_s(cpu["median"]) + fmt_range(cpu["min"], cpu["max"]) if cpu else "—",
                     f"{shown[len(shown) // 2]:,}" if shown else "—"])
    L += md_table(["side", "wall time", "launcher CPU (own)", "console lines"], rows)
    lat = block.get("latency", {})
    L += [f"**Latency**: each instance writes {lat.get('lines_per_instance', 0)} lines, one every "
          f"{lat.get('period_s', 0) * 1000:g} ms on a shared schedule; a line's latency is its arrival "
          "on poprun's stdout (a pipe) minus its scheduled time. *common*: every instance writes the "
          "same line; *distinct*: each its own; *rank 0 only*: the others write nothing on stdout "
          "(each line then waits the 100 ms bound).", ""]
    rows = []
    for mode, sides in lat.get("workloads", {}).items():
        for name in ("plain", "fold"):
            st = sides.get(name, {})
            counts = st.get("lines") or []
            rows.append([{"rank0": "rank 0 only"}.get(mode, mode),
                         "with `--fold-output`" if name == "fold" else "without",
                         *(f"{st[k] * 1000:.1f} ms" if st.get(k) is not None else "—"
                           for k in ("median", "p90", "p99", "max")),
                         f"{statistics.median(counts):g}" if counts else "—"])
    L += md_table(["workload", "", "median", "p90", "p99", "max", "console lines"], rows)
    return L


def ssh_section(block: dict) -> list[str]:
    L = ["## SSH fan-out", "",
         "`hostname` on loopback \"hosts\" (one real OpenSSH `sshd` per address, 127.0.77.x, "
         "tests/sshd_hosts.py), H hosts × I instances each: poprun `-H h1,...` (one asyncssh "
         "connection and one agent per host) against mpirun `--host h1:I,...` (an `orted` per host "
         "over OpenSSH). Output checked: exactly H×I lines, each this machine's name. Between runs "
         "the benchmark waits until nothing runs under the sshd listeners.", ""]
    if block.get("openssh"):
        L += [f"OpenSSH: {block['openssh']}." + (" ~/.bashrc hidden (`--without-bashrc`)."
                                                  if block.get("rc_file_hidden") else
                                                  " Every ssh session ran the login shell's rc file as it is."), ""]
    L += skipped_note(block)
    rows = []
    for case in block.get("cases", []):
        pop = side(case["sides"], "poprun")
        mpi = side(case["sides"], "mpirun")
        rows.append([f"{case['hosts']} × {case['per_host']}", cell(pop), cell(mpi), fmt_x(ratio(med(mpi), med(pop)))])
    if rows:
        L += md_table(["hosts × instances", "poprun", "mpirun", "mpirun ÷ poprun"], rows)
    return L


FANOUT_TITLES = {"mpirun": "mpirun (tree spawn, its default)", "mpirun-flat": "mpirun flat (no tree spawn)",
                 "connect": "connect only (reference)",
                 "connect-direct": "connect only, no ~/.ssh/config (reference)"}


def run_median(s: dict, key: str) -> float | None:
    """Median of extra[key] over a side's successful runs."""
    vals = sorted(r["extra"][key] for r in s.get("runs", [])
                  if r.get("status") == "ok" and key in (r.get("extra") or {}))
    return vals[len(vals) // 2] if vals else None


def fanout_figures(s: dict) -> dict[str, float | None]:
    """A side's medians in seconds (RSS in KiB): wall, own and tree CPU, remote CPU, peak RSS."""
    return {"wall": med(s), "own": (s.get("cpu_s") or {}).get("median"),
            "tree": (s.get("tree_cpu_s") or {}).get("median"), "remote": run_median(s, "remote_cpu_s"),
            "rss": (s.get("rss_kib") or {}).get("median")}


def per_host(seconds: float | None, hosts: int) -> str:
    return "—" if seconds is None else f"{seconds / hosts * 1000:.1f} ms"


def fanout_slopes(cases: list[dict]) -> dict[str, dict[str, tuple[float, float]]]:
    """{side: {figure: (fixed s, per host s)}}: least squares a + b·H over the one-instance
    cases (needs two host counts or more): what each side pays once, and per host."""
    import statistics

    ones = [c for c in cases if c["per_host"] == 1]
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for name in dict.fromkeys(s["name"] for c in ones for s in c["sides"]):
        for key in ("wall", "own", "tree", "remote"):
            pts = [(c["hosts"], fanout_figures(s)[key]) for c in ones if (s := side(c["sides"], name))]
            pts = [(h, v) for h, v in pts if v is not None]
            if len({h for h, _ in pts}) >= 2:
                slope, icpt = statistics.linear_regression([h for h, _ in pts], [v for _, v in pts])
                out.setdefault(name, {})[key] = (icpt, slope)
    return out


def fanout_section(block: dict) -> list[str]:
    L = ["## SSH fan-out to 64 hosts", "",
         "`hostname` on H loopback sshd hosts × I instances each (tests/sshd_hosts.py; every host is "
         "reached over SSH, none runs locally), bench/fanout_bench.py: poprun (`-H`, one asyncssh "
         "connection and agent per host, all at once), Open MPI's mpirun as it runs by default (tree "
         "spawn: orteds started over ssh start further orteds) and flat (`--mca plm_rsh_no_tree_spawn 1`), "
         "`pdsh -R ssh -f H` and `clush -f H` (one OpenSSH client per host, all at once; for I > 1 they "
         "run `hostname & … & wait`), and *connect only*: poprun's own connect (spawner.ssh.connect_all) "
         "opening the H connections and closing them, nothing else (*no ~/.ssh/config*: asyncssh.connect "
         "with HostName, Port, user, key and known_hosts given directly, `config=[]`). Output checked (H×I lines of this machine's "
         "name). *Own CPU*: the launcher process's utime+stime; *tree*: with every child it reaped "
         "(the ssh clients of mpirun, pdsh and clush); *remote*: what the sshd listeners reaped "
         "during the run (sshd's session processes, the login shell and its rc file, agents or "
         "orteds, instances). All per host. Every host shares this machine's cores with the "
         "launcher, so wall time here is bounded by the CPU all hosts together need.", ""]
    if block.get("openssh"):
        L += [f"OpenSSH: {block['openssh']}; {block.get('hosts_up_s', 0):.1f} s to start the sshd hosts."
              + (f" `{block['rc_file_hidden']}` was /dev/null for every ssh session (a private mount "
                 "namespace): here it runs `pyenv init -`, whose rehash lock serialises concurrent sessions, "
                 "so at 64 hosts it measured pyenv rather than the launchers." if block.get("rc_file_hidden")
                 else " Every ssh session ran the login shell's rc file as it is."), ""]
    L += skipped_note(block)
    for case in block.get("cases", []):
        h = case["hosts"]
        pop = side(case["sides"], "poprun")
        rows = []
        for s in case["sides"]:
            f = fanout_figures(s)
            rows.append([FANOUT_TITLES.get(s["name"], s["name"]), cell(s), fmt_x(ratio(med(s), med(pop))),
                         per_host(f["own"], h), per_host(f["tree"], h), per_host(f["remote"], h), mib(f["rss"])])
        L += [f"**{h} hosts × {case['per_host']}**", ""]
        L += md_table(["side", "wall time", "÷ poprun", "own CPU / host", "tree CPU / host",
                       "remote CPU / host", "peak RSS"], rows)
        untimed = [(s["name"], s["runs"][0]["detail"]) for s in case["sides"] if s.get("median_s") is None and s.get("runs")]
        if untimed:  # a warm-up hang leaves only "skipped" in the counts: say what happened
            L += [f"- {FANOUT_TITLES.get(n, n)}: {why[:200]}" for n, why in untimed] + [""]
    slopes = fanout_slopes(block.get("cases", []))
    if slopes:
        hs = sorted({c["hosts"] for c in block["cases"] if c["per_host"] == 1})
        L += [f"Fixed cost and cost per host, least squares `a + b·H` over the one-instance cases "
              f"(H = {', '.join(map(str, hs))}):", ""]
        rows = []
        for name, fits in slopes.items():
            rows.append([FANOUT_TITLES.get(name, name)] + [
                (f"{fits[k][0] * 1000:.0f} + {fits[k][1] * 1000:.1f}·H ms" if k in fits else "—")
                for k in ("wall", "own", "tree", "remote")])
        L += md_table(["side", "wall", "own CPU", "tree CPU", "remote CPU"], rows)
    ph = block.get("phases")
    if ph and ph.get("hosts"):
        def spread(key: str) -> str:
            vals = [t[key] for t in ph["hosts"].values() if key in t]
            return f"{min(vals)}–{max(vals)} ms" if vals else "—"
        L += [f"One `poprun -v` run at {ph['case']} ({fmt_s(ph.get('seconds'))}): hosts connected "
              f"{spread('connect')} after poprun's start, each agent ready {spread('agent_ready')} after "
              "its own start; time line (ms after the launch): "
              + ", ".join(f"{k} {v:.0f}" for k, v in ph.get("timeline", {}).items()) + ".", ""]
    return L


def teardown_section(block: dict) -> list[str]:
    n = block.get("n", TARGET_N)
    reported = block.get("reported", ["rss", "teardown"])
    if not block.get("sides"):
        return ["## Launcher peak RSS and teardown", ""] + skipped_note(block)
    L = []
    rows_rss, rows_td = [], []
    pop = side(block["sides"], "poprun")
    for s in block["sides"]:
        rss = s.get("rss_kib")
        hwm = [r["extra"].get("hwm_kib") for r in s["runs"] if r["status"] == "ok" and r.get("extra")]
        hwm = [h for h in hwm if h]
        start = [r["extra"].get("start_s") for r in s["runs"] if r["status"] == "ok" and r.get("extra")]
        pop_rss = ((pop or {}).get("rss_kib") or {}).get("median")
        rows_rss.append([s["name"], (mib(rss["median"]) + fmt_range(rss["min"], rss["max"], mib)) if rss else "—",
                         mib(sorted(hwm)[len(hwm) // 2]) if hwm else "—",
                         fmt_x(ratio(rss and rss["median"], pop_rss))])
        rows_td.append([s["name"], cell(s), fmt_x(ratio(med(s), med(pop))),
                        fmt_s(sorted(start)[len(start) // 2]) if start else "—"])
    if "rss" in reported:
        L += [f"## Launcher peak RSS, {n} local instances", "",
              f"In the teardown runs below ({n} `sleep` instances started, all running, then SIGTERM): "
              "the launcher process's own peak resident set, its instances excluded: `VmHWM` from "
              "/proc/<pid>/status, a high-water mark of its address space, read every 20 ms while the "
              "instances start and every 10 ms during the teardown until it exits (so only growth in "
              "its last 10 ms could be missed). Not `wait4`'s `ru_maxrss`: the kernel carries that "
              "across exec, so a child of this benchmark starts with the benchmark's own peak (~50 MB).",
              ""]
        L += skipped_note(block)
        L += md_table(["side", "peak RSS", "VmHWM when all run", "÷ poprun"], rows_rss)
    if "teardown" in reported:
        L += [f"## Teardown, {n} running instances", "",
              f"{n} `sleep` instances under the launcher; once all {n} run (found by a marker unique to "
              "the run in /proc/*/cmdline), SIGTERM to the launcher, and the time until the launcher and "
              "every instance have exited (a pidfd each: exact wake-up, no polling).", ""]
        if "rss" not in reported:
            L += skipped_note(block)
        L += md_table(["side", "SIGTERM → all exited", "÷ poprun", "start → all running"], rows_td)
    return L


def slurm_section(block: dict) -> list[str]:
    L = ["## Slurm", "", "`srun` against `poprun --launcher slurm`, each inside its own allocation "
         "(`salloc -N 2 -n N`) on a local two-node Slurm (tests/slurm_cluster.py).", ""]
    L += skipped_note(block)
    rows = []
    for case in block.get("cases", []):
        pop, srun = side(case["sides"], "poprun"), side(case["sides"], "srun")
        rows.append([str(case["n"]), cell(pop), cell(srun), fmt_x(ratio(med(srun), med(pop)))])
    if rows:
        L += md_table(["N", "poprun", "srun", "srun ÷ poprun"], rows)
    return L


def mpi_section(block: dict) -> list[str]:
    L = ["## MPI world wire-up", "",
         f"An MPI world of N local ranks of `python -c \"{block.get('program', '')}\"` (mpi4py: `MPI_Init`, "
         "one `Barrier`, `Finalize`), start to the launcher's exit: poprun serving the world itself "
         "(PMI-1 over a socket pair per rank) against MPICH's own `mpiexec` (Hydra) from the same "
         "`mpich` wheel"
         + (f", `{block['mpiexec']}` (found by the wheel's file list, so Open MPI's `mpirun` cannot "
            "stand in for it)" if block.get("mpiexec") else "")
         + ". Rank 0 prints the world's size, which must be N. *Floor*: one "
         f"`python -c \"{block.get('floor_program', 'from mpi4py import MPI')}\"`, an MPI singleton: what "
         "the interpreter and the import cost one rank. *No launcher*: N such singletons at once, the "
         "ranks' own start-up on this machine's cores without any wire-up. *Launcher CPU*: the "
         "launcher's own user+system time, its ranks excluded (and for mpiexec its `hydra_pmi_proxy`, "
         "the child that forks the ranks and answers their PMI).", ""]
    env = block.get("env")
    if env is not None:
        L += [("Both launchers ran with " + ", ".join(f"`{k}={v}`" for k, v in env.items()) + "."
               if env else "No MPICH variable set: the wheel's defaults, shared memory between ranks on "
               "one host, for both launchers."), ""]
    L += skipped_note(block)
    rows = []
    for case in block.get("cases", []):
        s = {n: side(case["sides"], n) for n in ("floor", "baseline", "poprun", "mpiexec")}
        cpu = [(s[n] or {}).get("cpu_s") for n in ("poprun", "mpiexec")]
        rows.append([str(case["n"])] + [cell(s[n]) for n in s]
                    + [fmt_x(ratio(med(s["poprun"]), med(s["mpiexec"])))]
                    + [fmt_s(c["median"]) + fmt_range(c["min"], c["max"]) if c else "—" for c in cpu])
    if rows:
        L += md_table(["N", side_title("floor", "mpi"), "no launcher (N singletons)", "poprun", "mpiexec",
                       "poprun ÷ mpiexec", "poprun CPU (own)", "mpiexec CPU (own)"], rows)
    return L


def ompi_section(block: dict) -> list[str]:
    """Open MPI's world: poprun serving PMIx against Open MPI's own mpirun (run_all.run_ompi)."""
    L = ["## Open MPI world wire-up", "",
         f"The same program as above (`python -c \"{block.get('program', '')}\"`), N local ranks of "
         f"`{block.get('python', 'python3')}` with Debian's python3-mpi4py over Debian's Open MPI 4.1: "
         "poprun serving the world itself (its PMIx server over the system's libpmix) against Open "
         f"MPI's own `{block.get('mpirun', 'mpirun')}` (`--oversubscribe`; found by path, so the "
         "test extra's wheels cannot stand in for it). Rank 0 prints the world's size, which must "
         "be N. *Floor*: one singleton of the same program.", ""]
    L += skipped_note(block)
    rows = []
    for case in block.get("cases", []):
        s = {n: side(case["sides"], n) for n in ("floor", "poprun", "mpirun")}
        rows.append([str(case["n"])] + [cell(s[n]) for n in s]
                    + [fmt_x(ratio(med(s["poprun"]), med(s["mpirun"])))])
    if rows:
        L += md_table(["N", side_title("floor", "mpi"), "poprun", "mpirun", "poprun ÷ mpirun"], rows)
    return L


def profile_section(prof: dict) -> list[str]:
    L = ["## Profile of the output path", ""]
    if prof.get("skipped"):
        return L + [f"Skipped: {prof['skipped']}.", ""]
    if prof.get("error"):
        return L + [f"py-spy failed: `{prof['error']}`", ""]
    files = prof.get("files", {})
    L += ["py-spy (250 samples/s) on one poprun run of the output scenario, "
          f"`{' '.join(Path(prof['command'][0]).name if i == 0 else a for i, a in enumerate(prof['command']))}`: "
          + ", ".join(f"[{f}]({f})" for f in files.values())
          + " (flame graph; folded stacks for speedscope or flamegraph.pl). Start-up and imports are in "
            "it too.", ""]
    top = prof.get("top") or {}
    if top.get("self"):
        L += [f"Most samples ({top['total']} in all), by function: *own* = in the function itself, "
              "*total* = with what it called.", ""]
        rows = [[f"`{f}`", f"{100 * c / top['total']:.0f}%", f"{100 * top['inclusive'].get(f, c) / top['total']:.0f}%"]
                for f, c in top["self"]]
        L += md_table(["function", "own", "total"], rows)
    return L


def methods() -> list[str]:
    return ["## How it is measured", "",
            "- Wall time: `time.perf_counter()` from just before the first `Popen` to the reaping of the "
            "last process, woken by a pidfd (not `Popen.wait(timeout)`, which polls in steps of up to 50 ms). "
            "Every process has stdin `/dev/null` and a session of its own.",
            "- Hangs are bounded: a run still going at its timeout is SIGKILLed with its whole tree and "
            "counted as *hung*, never timed; after one hang at a size (two in the ssh scenario), a "
            "competitor's remaining runs there are *skipped*. Failures are counted and never timed; "
            "a competitor's wrong output is timed and flagged (†), poprun's is a failure.",
            "- Launcher CPU (own): read from `/proc/<pid>/stat` (utime+stime) of the launcher after it has "
            "exited and before it is reaped: a zombie keeps its final figures, its own time apart from its "
            "reaped children's (cutime+cstime). `wait4`'s rusage would add the instances' CPU in. "
            "Resolution: one clock tick (10 ms).",
            "- Peak RSS: the launcher's own `VmHWM`, sampled (see that section).",
            "- One untimed warm-up run per side first (page cache, bytecode caches); the sides then "
            "alternate, so drift on the machine hits every side alike.",
            "- Code: bench/run_all.py drives bench/launch_bench.py and bench/multihost_bench.py; "
            "bench/report.py renders this page from results.json.", ""]


# ---------------------------------------------------------------------------- profile


def top_frames(folded: str, limit: int = 12) -> dict:
    """py-spy's folded stacks ('frame;frame;... count' per line): the functions with the most
    samples of their own, and each one's samples including its callees."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in folded.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_function(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return {"total": total, "self": own.most_common(limit),
            "inclusive": {f: inclusive[f] for f, _ in own.most_common(limit)}}


def _function(frame: str) -> str:
    """'LocalSpawner._on_readable (spawner/local.py:197)' -> '... (spawner/local.py)': one
    function's samples together, whichever line they were on."""
    name, sep, where = frame.rpartition(" (")
    if not sep:
        return frame
    return f"{name} ({where.rstrip(')').rsplit(':', 1)[0]})"


# ---------------------------------------------------------------------------- results.png


def chart_groups(doc: dict) -> list[tuple[str, list[str], list[tuple[str, dict[str, float | str | None]]]]]:
    """(panel title, sides, [(group label, {side: ratio, or why there is none})]): each ratio
    is the side's median ÷ poprun's (above 1: poprun is faster)."""
    sc = doc.get("scenarios", {})
    panels = []

    def ratios(sides: list[dict], names: list[str], key=med) -> dict:
        pop = side(sides, "poprun")
        out: dict[str, float | str | None] = {}
        for n in names:
            s = side(sides, n)
            out[n] = ratio(key(s), key(pop))
            if out[n] is None:
                hung = s and (s.get("hung") or any(r.get("detail", "").startswith("warm-up hung")
                                                   for r in s.get("runs", [])))
                out[n] = ("hung" if hung else "failed" if s and s.get("failed")
                          else "no poprun" if s else None)
        return out

    if sc.get("launch", {}).get("cases"):
        names = [s["name"] for s in sc["launch"]["cases"][0]["sides"] if s["name"] != "poprun"]
        panels.append(("Launch latency: true × N", names,
                       [(f"N={c['n']}", ratios(c["sides"], names)) for c in sc["launch"]["cases"]]))
    if sc.get("output", {}).get("cases"):
        names = [s["name"] for s in sc["output"]["cases"][0]["sides"] if s["name"] != "poprun"]
        panels.append(("Tagged output, wall time", names,
                       [(f"{c['n']}×{c['lines'] // 1000}k lines", ratios(c["sides"], names))
                        for c in sc["output"]["cases"]]))
    if sc.get("ssh", {}).get("cases"):
        panels.append(("SSH fan-out (hosts × instances)", ["mpirun"],
                       [(c["case"], ratios(c["sides"], ["mpirun"])) for c in sc["ssh"]["cases"]]))
    if sc.get("fanout", {}).get("cases"):
        names = [s["name"] for s in sc["fanout"]["cases"][0]["sides"]
                 if s["name"] != "poprun" and not s["name"].startswith("connect")]
        panels.append(("SSH fan-out, `hostname` (hosts × instances)", names,
                       [(c["case"], ratios(c["sides"], names)) for c in sc["fanout"]["cases"]]))
    if sc.get("mpi", {}).get("cases"):
        names = [s["name"] for s in sc["mpi"]["cases"][0]["sides"] if s["name"] != "poprun"]
        panels.append(("MPI world: mpi4py Init + Barrier", names,
                       [(f"{c['n']} ranks", ratios(c["sides"], names)) for c in sc["mpi"]["cases"]]))
    td = sc.get("teardown", {})
    if td.get("sides"):
        names = [s["name"] for s in td["sides"] if s["name"] != "poprun"]
        groups = []
        if "rss" in td.get("reported", ["rss"]):
            groups.append((f"peak RSS ×{td['n']}", ratios(td["sides"], names,
                                                          lambda s: s and (s.get("rss_kib") or {}).get("median"))))
        if "teardown" in td.get("reported", ["teardown"]):
            groups.append((f"teardown ×{td['n']}", ratios(td["sides"], names)))
        panels.append(("Launcher memory and teardown", names, groups))
    return panels


def render_png(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = chart_groups(doc)
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, (len(panels) + cols - 1) // cols)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows + 0.9), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, names, groups) in zip(axes.flat, panels):
        width = min(0.8 / max(1, len(names)), 0.35)
        values = [v for _, g in groups for v in g.values() if isinstance(v, float)]
        lo = min(values + [1.0]) / 1.8
        hi = max(values + [1.0]) * 2.2
        for i, name in enumerate(names):
            xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(groups))]
            ys = [g.get(name) for _, g in groups]
            label = NAMES.get(name, name)
            if name == "floor":
                label = "floor: " + ("python -c 'import asyncio'" if "Launch" in title
                                     else "one mpi4py singleton" if "MPI" in title else "one writer (dd)")
            # Bars grow from 1 (as fast as poprun): up where poprun is faster, down where slower.
            bars = [(x, y) for x, y in zip(xs, ys) if isinstance(y, float)]
            ax.bar([x for x, _ in bars], [y - 1 for _, y in bars], width * 0.92, bottom=1,
                   color=COLOURS.get(name, "#777777"), label=label, edgecolor="white", linewidth=0.5)
            for x, y in zip(xs, ys):
                if isinstance(y, float):
                    up = y >= 1
                    ax.annotate(fmt_x(y), (x, y), ha="center", va="bottom" if up else "top", fontsize=7,
                                xytext=(0, 2 if up else -2), textcoords="offset points")
                elif y:  # a side that ran but has no median: say why
                    ax.annotate(f"{name}:\n{y}", (x, 1.0), ha="center", va="bottom", fontsize=7,
                                color=COLOURS.get(name, "#777777"), xytext=(0, 2), textcoords="offset points")
        ax.axhline(1.0, color="#1f77b4", linewidth=1.2, linestyle="--")
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("side's median ÷ poprun's", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.legend(fontsize=7, loc="upper left", frameon=False)
        ax.grid(axis="y", which="both", alpha=0.25)
    m = doc.get("machine", {})
    head = "Each side's median time (or memory) ÷ poprun's: above the dashed line poprun is faster, below slower"
    sub = (f"{m.get('cpu_model', '?')}, {m.get('cpus', '?')} cores, Python {m.get('python', '?')}, "
           f"{m.get('timestamp', '')[:10]}")
    for later in doc.get("merged", []):
        sub += f"; {', '.join(later['scenarios'])} {later['timestamp'][:10]}"
    if doc.get("quick"):
        sub += "  —  QUICK RUN on a shared machine: not the published figures"
    fig.suptitle(f"{head}\n{sub}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python bench/report.py RESULTS.json  (writes results.md and results.png beside it)",
              file=sys.stderr)
        return 2
    src = Path(args[0])
    doc = json.loads(src.read_text())
    doc["targets"] = targets(doc)
    (src.parent / "results.md").write_text(render_markdown(doc))
    render_png(doc, src.parent / "results.png")
    print(f"{src.parent / 'results.md'} and results.png written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
