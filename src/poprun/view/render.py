"""Text renderings of plans and results: the topology table, the dry run, the failure report
(plain, or styled with rich on a terminal).

Pure functions from data to str; the caller decides where the text goes.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from poprun.plan.planner import LaunchPlan
from poprun.result import LaunchResult
from poprun.text import fold_indices

_HEADERS = ("hosts", "ILDs", "instances", "replicas")


def topology_table(launch_plan: LaunchPlan) -> str:
    """The `--print-topology` table as PopRun prints it (with its borders: real logs and the
    guide's source, tests/data/real_topology_tables.txt); host names too long for their
    cells are listed in full after it (as PopRun 2.1 does)."""
    insts = launch_plan.instances
    per_instance = len(insts[0].replicas)
    num_replicas = per_instance * len(insts)
    per_ild = num_replicas // launch_plan.num_ilds
    on_host = collections.Counter(i.host for i in insts)
    cell = len(str(num_replicas - 1)) + 2
    rows = {
        "hosts": [(h, on_host[h] * per_instance) for h in launch_plan.hosts],
        "ILDs": [(str(i), per_ild) for i in range(launch_plan.num_ilds)],
        "instances": [(str(i.index), per_instance) for i in insts],
        "replicas": [(str(r), 1) for r in range(num_replicas)],
    }
    head = max(len(h) for h in _HEADERS) + 2
    content = num_replicas * cell + num_replicas - 1
    footnotes: list[str] = []
    lines = ["|" + _centred("poprun topology", head + 1 + content) + "|"]
    for name in _HEADERS:
        cells = []
        for label, span in rows[name]:
            width = span * cell + span - 1
            if len(label) > width:
                short = f"[{len(footnotes)}]"
                footnotes.append(f"{short} {label}")
                label = short if len(short) <= width else "*"
            cells.append(_centred(label, width))
        lines.append("|" + f" {name}".ljust(head) + "|" + "|".join(cells) + "|")
    return "\n".join(_bordered(lines, head) + footnotes) + "\n"


def _centred(text: str, width: int) -> str:
    # PopRun puts the odd space on the right (`| gc-poplar-02  |` in a real log);
    # str.center sometimes puts it on the left.
    return (" " * ((width - len(text)) // 2) + text).ljust(width)


def _bordered(lines: list[str], head: int) -> list[str]:
    """The title and rows with PopRun's rules: `=` above and below the title, `-` between
    rows (across the row's cells as one), `-` below the last, the corners left blank."""
    inner = len(lines[0]) - 2
    between = "|" + "-" * head + "|" + "-" * (inner - head - 1) + "|"
    rows = [line for row in lines[1:] for line in (between, row)][1:]
    return [" " + "=" * inner, lines[0], "|" + "=" * inner + "|", *rows, " " + "-" * inner]


def dry_run_text(launch_plan: LaunchPlan) -> str:
    insts = launch_plan.instances
    import shlex  # here, for --dry-run: a launch imports this module for its report

    lines = [
        f"poprun dry run: {len(insts)} instance(s) on {len(launch_plan.hosts)} host(s), "
        f"{sum(len(i.replicas) for i in insts)} replica(s), "
        f"executable cache: {launch_plan.cache_mode.value}",
        f"removed from every instance's environment: {' '.join(launch_plan.unset_env)}",
        *(launch_plan.partition.lines() if launch_plan.partition is not None else ()),
        *([f"spare hosts, standing by: {', '.join(launch_plan.spares)}"]
          if launch_plan.spares else []),
    ]
    for inst in insts:
        lines.append(f"instance {inst.index} on {inst.host} (local index {inst.local_index}), "
                     f"replicas {fold_indices(inst.replicas)}, ILD {inst.ild}")
        lines.append(f"  argv: {shlex.join(inst.argv)}")
        lines.append(f"  cpus: {_ints(inst.cpus)}  mems: {_ints(inst.mems)}")
        for name, value in inst.env.items():
            lines.append(f"  env:  {name}={value}")
    lines += [f"warning: {w}" for w in launch_plan.warnings]
    return "\n".join(lines) + "\n"


def _ints(values: tuple[int, ...] | None) -> str:
    return "not bound" if values is None else fold_indices(values)


def render_report(result: LaunchResult, fd: int, environ: Mapping[str, str],
                  verbose: bool = False) -> bytes:
    """What the launcher writes to `fd` (its stderr) after a job: the failure report, or at
    `verbose` the summary of a good one; empty for neither. Styled with rich where rich would
    style `fd` (a terminal, by its rules read from `environ`), else plain text exactly as
    failure_report()/summary() give it. The instances' stderr lines are rich Text, never
    markup."""
    if result.ok and not verbose:
        return b""
    from poprun.view.console import rich_console

    console = rich_console(fd, environ)
    if console is None:
        return _encoded(result.failure_report() if not result.ok else result.summary())
    lines = result.failure_lines() if not result.ok else result.summary_lines()
    from rich.text import Text

    with console.capture() as capture:
        for part, line in lines:
            console.print(Text(line, style=_STYLES[part]), soft_wrap=True)
    return _encoded(capture.get())


def _encoded(text: str) -> bytes:
    # An instance's text is escaped where it comes in (text.shown); this keeps a surrogate
    # that slipped by from ending the launch as an internal error.
    return text.encode("utf-8", "backslashreplace")


# The report's parts, as rich styles on a terminal: the root cause stands out, the instance's
# own stderr keeps the terminal's colour (its words matter most), the rest recedes.
_STYLES = {
    "stopped": "bold yellow",
    "root": "bold red",
    "hint": "yellow",
    "text": "dim",
    "tail": "",
    "collateral": "dim",
    "summary": "green",
}
