"""`poprunctl`: see and handle poprun jobs from anywhere on the launching host.

    poprunctl list                      running and recent jobs
    poprunctl show JOB                  per-instance rows, live (or as the job ended)
    poprunctl stacks JOB [-i I ...]     every instance's Python stacks, folded
    poprunctl kill JOB [--signal SIG]   as Ctrl-C to that job (or that signal)
    poprunctl logs JOB [-i I] [-f] [--fold]  the job's output (folded: identical lines once)
    poprunctl reap [--dry-run]          clean up after jobs whose launcher died
    poprunctl hosts [--release HOST]    hosts your jobs quarantined (left out of later jobs)

A typer application: rich tables on a terminal, `--json` on every command, shell completion
(`--install-completion`; job ids complete too). JOB is a job id or an unambiguous prefix of
one. Its exit statuses are EXIT_STATUS below (the epilog of `--help`, and man poprunctl's).

It reads the per-user job records (poprun/jobctl/records.py) and talks to a running job's launcher on
its control socket (poprun/jobctl/control.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated, Any, NoReturn

import typer

from poprun.jobctl import joblog
from poprun.jobctl import records as jobs
from poprun.jobctl.control import ControlError, ask, connect
from poprun.progress import progress_line
from poprun.text import cut, duration, fold_indices, percent, shown, size, visible

ASK_TIMEOUT = 10.0  # seconds for a launcher to answer (stacks: its timeout more)
COMMAND_WIDTH = 48
LIST_LATEST = 20  # jobs `list` shows without --all, the most recent (a shared account keeps 100)

EXIT_STATUS = ("Exit status: 0 done; 1 it could not be done (no such job, the job has ended, "
               "its launcher does not answer, reap left something behind); 2 a usage error.")
app = typer.Typer(name="poprunctl", no_args_is_help=True, add_completion=True, epilog=EXIT_STATUS,
                  rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="See and handle poprun jobs from anywhere on the launching host: list "
                       "them, show their instances, fold their Python stacks, stop them, read "
                       "their output, clean up after a launcher that died. JOB is a job id "
                       "(or a prefix of one): poprun prints it at -v and in its dashboard.")


# --- helpers -----------------------------------------------------------------------------

def _complete_job(incomplete: str) -> list[tuple[str, str]]:
    try:
        records = jobs.scan().records
    except Exception:  # noqa: BLE001 - completion never fails loudly
        return []
    return [(r["id"], f"{jobs.state_of(r)}: {_command(r, 40)}")
            for r in reversed(records) if r["id"].startswith(incomplete)]


JobArg = Annotated[str, typer.Argument(help="The job: its id, or a prefix of it",
                                       autocompletion=_complete_job, show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]


def _fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"poprunctl: error: {message}\n")
    raise typer.Exit(code)


def _scan(quiet: bool = False) -> jobs.Scan:
    from poprun.crash import state_dir_problem

    unsafe = state_dir_problem()  # another user could have written what it would act on
    if unsafe:
        _fail(unsafe, 2)
    found = jobs.scan()
    if not quiet:
        for path, why in found.problems:
            sys.stderr.write(f"poprunctl: skipped {path}: {why}\n")
    return found


def _job(query: str) -> dict[str, Any]:
    try:
        return dict(jobs.find(_scan().records, query))
    except LookupError as exc:
        _fail(str(exc).strip("'\""))


def _console():
    """rich's console; not on a terminal, wide enough that no table cuts a job id."""
    from rich.console import Console

    wide = None if sys.stdout.isatty() else 200
    return Console(highlight=False, soft_wrap=False, width=wide)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _ask(record: dict[str, Any], request: dict[str, Any], timeout: float = ASK_TIMEOUT):
    """The running job's launcher's answer; exit 1 when the job is not running."""
    status = jobs.launcher_status(record)
    if status == "ended":
        _fail(f"job {record['id']} has ended (exit status {record.get('exit_code')})")
    if status == "gone":
        _fail(f"job {record['id']}'s launcher is gone without cleaning up: poprunctl reap "
              "cleans up after it")
    if status == "elsewhere":
        _fail(f"job {record['id']} runs on {record.get('launcher', {}).get('host')}: run "
              "poprunctl there")
    if not record.get("control"):
        _fail(f"job {record['id']} has no control socket (its path was too long)")
    try:
        return ask(record["control"], request, timeout)
    except ControlError as exc:
        _fail(f"job {record['id']}: {exc}")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _state_label(record: dict[str, Any]) -> str:
    state = jobs.state_of(record)
    if state == jobs.ENDED:
        reason = record.get("exit_reason")
        code = record.get("exit_code")
        return f"ended: {reason}" + (f" ({code})" if code not in (None, 0) else "")
    return state


def _command(record: dict[str, Any], width: int | None = None) -> str:
    """The program and its arguments on one line (control characters made visible)."""
    words = [str(a) for a in record.get("program") or []]
    if width is not None:  # cut: absolute paths by their last part (`python3 train.py`)
        words = [os.path.basename(w) if w.startswith("/") and len(w) > 1 else w
                 for w in words]
    raw = " ".join(words).encode("utf-8", "replace")
    text = visible(raw, len(raw) + 1)
    return text if width is None else cut(text, width)


def _hosts(record: dict[str, Any]) -> str:
    return ",".join(h.get("label", "?") for h in record.get("hosts") or [])


# --- list --------------------------------------------------------------------------------

def summary(record: dict[str, Any], now: float) -> dict[str, Any]:
    """One job as `list` shows it."""
    instances = record.get("instances") or []
    states = jobs.instance_states(record) if record.get("state") != jobs.ENDED else []
    return {"id": record["id"], "state": jobs.state_of(record),
            "label": _state_label(record),
            "age": now - float(record.get("start_time") or now),
            "running": sum(s in ("running", "starting") for s in states),
            "unknown": states.count("unknown"),  # on other hosts of a gone launcher's job
            "instances": record.get("num_instances") or len(instances),
            "hosts": [h.get("label") for h in record.get("hosts") or []],
            "program": record.get("program") or [], "exit_code": record.get("exit_code"),
            "exit_reason": record.get("exit_reason"), "cwd": record.get("cwd"),
            "launcher_pid": (record.get("launcher") or {}).get("pid"),
            # While it runs: its stragglers now, and the slowest instance's step and ETA.
            "slow": _slow(record) if states else [],
            "progress": progress_line(record.get("progress")) if states else ""}


def _slow(record: dict[str, Any]) -> list[int]:
    """The instances the record has slow (poprun/progress.py's rule)."""
    progress = record.get("progress")
    slow = progress.get("slow") if isinstance(progress, dict) else None
    return [i for i in slow if isinstance(i, int)] if isinstance(slow, list) else []


@app.command("list")
def list_jobs(as_json: JsonOpt = False,
              running: Annotated[bool, typer.Option("--running", "-r",
                                                    help="Only jobs that run")] = False,
              every: Annotated[bool, typer.Option(
                  "--all", "-a", help=f"Every job kept, not only the latest {LIST_LATEST}")
              ] = False) -> None:
    """Running and recent jobs, the latest first: id, state, age, instances running/total,
    hosts, command. Only the latest, and how many there are, unless --all."""
    found = _scan(quiet=as_json)
    now = time.time()
    records = [r for r in reversed(found.records)
               if not running or jobs.state_of(r) in jobs.ACTIVE]
    total = len(records)
    rows = [summary(r, now) for r in (records if every else records[:LIST_LATEST])]
    if as_json:
        _print_json({"jobs": rows, "total": total,
                     "skipped": [{"path": p, "reason": why} for p, why in found.problems]})
        return
    if not rows:
        sys.stdout.write("no jobs\n")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("JOB", "STATE", "AGE", "RUNNING", "PROGRESS", "HOSTS", "COMMAND"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("AGE", "RUNNING")
                         else "left")
    styles = {"running": "green", "stalled": "bold magenta", "stopping": "yellow",
              "starting": "yellow", "gone": "bold red"}
    for row in rows:
        table.add_row(row["id"], row["label"], _age(row["age"]),
                      f"{row['running']}/{row['instances']}"
                      + (f" ({row['unknown']}?)" if row["unknown"] else ""),
                      " ".join(filter(None, (row["progress"], row["slow"] and
                                             f"slow: {fold_indices(row['slow'])}"))),
                      cut(",".join(row["hosts"]), 24),
                      _command(row, COMMAND_WIDTH),
                      style=styles.get(row["state"], "dim" if row["state"] == jobs.ENDED
                                       else ""))
    _console().print(table)
    if len(rows) < total:
        sys.stdout.write(f"the latest {len(rows)} of {total} jobs (poprunctl list --all: "
                         "every one)\n")


# --- show --------------------------------------------------------------------------------

def _ended_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a job whose launcher does not answer: from its record, each instance's
    state as far as this host can tell (records.instance_states)."""
    rows = []
    states = jobs.instance_states(record)
    slow = _slow(record)
    for inst, state in zip(record.get("instances") or [], states):
        start, end = inst.get("start_time"), inst.get("end_time")
        rows.append({"index": inst.get("index"), "host": inst.get("host"),
                     "pid": inst.get("pid"),
                     "state": inst.get("outcome")
                     or ("slow" if state == "running" and inst.get("index") in slow else state),
                     "uptime": end - start if start and end else None, "cpu_percent": None,
                     "rss": None, "lines": inst.get("lines"), "idle": None, "last_line": ""})
    return rows


@app.command()
def show(job: JobArg, as_json: JsonOpt = False) -> None:
    """The job's instances, as the dashboard shows them: live from a running job (remote
    instances included), from the record for one that has ended."""
    record = _job(job)
    if jobs.launcher_status(record) == "alive":
        reply = _ask(record, {"op": "show"})
        rows, state = reply["instances"], "stalled" if reply.get("stalled") else reply["state"]
        note = reply.get("stop_reason")
        for row in rows:
            if row.get("slow"):
                row["state"] = "slow"
        progress = {k: reply.get(k) for k in ("progress", "stragglers")}
    else:
        rows, state, note = _ended_rows(record), _state_label(record), None
        progress = {k: record.get(k) for k in ("progress", "stragglers")}
        reply = {"spawned": record.get("spawned")}
    spawned = [c for c in reply.get("spawned") or () if isinstance(c, dict)]
    differences = _host_differences(record)
    quarantined = _quarantined(record)
    if as_json:
        _print_json({"job": record["id"], "state": state, "stop_reason": note,
                     "program": record.get("program"), "hosts": _hosts(record),
                     "host_differences": differences, "quarantined": quarantined,
                     "instances": rows, "spawned": spawned, **progress})
        return
    from rich.table import Table

    console = _console()
    console.print(f"job {record['id']}  {state}" + (f" ({note})" if note else "")
                  + f"   hosts: {_hosts(record)}   command: {_command(record)}",
                  markup=False, highlight=False)
    ahead = progress_line(progress["progress"] if isinstance(progress["progress"], dict)
                          else None)
    if ahead:
        console.print(f"progress: {ahead}", markup=False, highlight=False)
    for difference in differences:  # as the launch warned of them (--compare-hosts)
        console.print(f"hosts differ: {_printable(difference)}", markup=False,
                      highlight=False)
    for entry in quarantined:
        console.print(f"quarantined: {_printable(entry['host'])} "
                      f"{time.strftime('%H:%M:%S', time.localtime(entry['at']))} "
                      f"({_printable(entry['reason'])})", markup=False, highlight=False)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("#", "host", "pid", "state", "up", "cpu", "rss", "lines", "idle",
                 "last line"):
        table.add_column(name, no_wrap=True, overflow="ellipsis",
                         justify="left" if name in ("host", "state", "last line") else "right")
    for row in rows:
        table.add_row(str(row["index"]), row.get("host") or "",
                      "" if row.get("pid") is None else str(row["pid"]), str(row["state"]),
                      duration(row.get("uptime")), percent(row.get("cpu_percent")),
                      size(row.get("rss")), "" if row.get("lines") is None
                      else str(row["lines"]), duration(row.get("idle")),
                      _printable(row.get("last_line") or ""))
    console.print(table)
    for child in spawned:  # MPI_Comm_spawn's processes (run/worlds/spawn.py)
        status = child.get("exit_status")
        console.print(_printable(
            f"spawned [{child.get('tag')}] by instance {child.get('spawned_by')}: pid "
            f"{child.get('pid')}" + (f" on {child['host']}" if child.get("host") else "")
            + ", " + ("running" if status is None else f"exited {status}")),
            markup=False, highlight=False)


def _host_differences(record: dict[str, Any]) -> list[str]:
    """The differences among the job's hosts that its launch reported, each one line."""
    found = record.get("host_differences") or []
    return [d["text"] for d in found if isinstance(d, dict) and isinstance(d.get("text"), str)]


def _quarantined(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The hosts the job quarantined ({host, reason, at}), those of them that are whole."""
    found = record.get("quarantined") or []
    return [{"host": q["host"], "reason": q["reason"], "at": q["at"]} for q in found
            if isinstance(q, dict) and isinstance(q.get("host"), str)
            and isinstance(q.get("reason"), str) and isinstance(q.get("at"), (int, float))
            and not isinstance(q.get("at"), bool)]


def _printable(text: str) -> str:
    return visible(text.encode("utf-8", "replace"), 200)


# --- stacks ------------------------------------------------------------------------------

@app.command()
def stacks(job: JobArg,
           instance: Annotated[list[int] | None, typer.Option(
               "--instance", "-i", help="Only this instance (repeatable)")] = None,
           timeout: Annotated[float, typer.Option(
               help="Seconds to wait for the stacks")] = 5.0,
           as_json: JsonOpt = False) -> None:
    """The Python stacks of every thread of every instance (local and remote), gathered in
    parallel and folded: identical stacks once with their instances, the odd ones out
    first. A program that imported popdist answers poprun's signal; any other Python program
    is read with py-spy where it is installed (pip install 'poprun[stacks]')."""
    from poprun.jobctl.stacks import fold, render

    if timeout <= 0:
        _fail("--timeout must be positive", 2)
    record = _job(job)
    reply = _ask(record, {"op": "stacks", "instances": instance, "timeout": timeout},
                 ASK_TIMEOUT + timeout)
    found = {int(k): v for k, v in reply["stacks"].items()}
    folded = fold(found)
    if as_json:
        _print_json({"job": record["id"], **folded.to_json(),
                     "by_instance": {str(k): v for k, v in found.items()}})
        return
    title = (f"job {record['id']}: the stacks of {len(found)} instance(s) "
             f"{fold_indices(found)}, most recent call first, the odd ones out first:")
    sys.stdout.write(render(folded, title, base=record.get("cwd")))


# --- kill --------------------------------------------------------------------------------

@app.command()
def kill(job: JobArg,
         signal: Annotated[str, typer.Option("--signal", "-s", help="The signal (name or "
                                             "number): SIGINT is Ctrl-C")] = "SIGINT",
         as_json: JsonOpt = False) -> None:
    """Stop the job as Ctrl-C to its poprun would (or with this signal): forwarded to every
    instance on every host, SIGKILL after its --kill-timeout, its cleanup as for any stop."""
    from popdist._stacks import signal_number

    if signal_number(signal) is None:
        _fail(f"--signal {signal!r} is not a signal poprun can send", 2)
    record = _job(job)
    reply = _ask(record, {"op": "kill", "signal": signal})
    if as_json:
        _print_json({"job": record["id"], "signal": reply["signal"]})
        return
    sys.stdout.write(f"job {record['id']}: {reply['signal']} sent (as to its poprun: every "
                     "instance gets it)\n")


# --- logs --------------------------------------------------------------------------------

@app.command()
def logs(job: JobArg,
         instance: Annotated[list[int] | None, typer.Option(
             "--instance", "-i", help="Only this instance's output (repeatable)")] = None,
         follow: Annotated[bool, typer.Option("--follow", "-f",
                                              help="Go on printing as the job writes, "
                                                   "until it ends")] = False,
         fold: Annotated[bool, typer.Option(
             "--fold", help="A line that several instances wrote identically on the same "
                            "stream once, tagged with their set ([1,0-62]<stdout>:), as "
                            "poprun --fold-output prints it")] = False,
         as_json: JsonOpt = False) -> None:
    """The job's output, each line tagged [1,<instance>]<stdout|stderr>: as --tag-output
    does: what poprun kept of it (the most recent 2 to 4 MiB, or every line when it ran with
    --output-filename), then with --follow each new line until the job ends."""
    record = _job(job)
    wanted = set(instance) if instance else None
    out = sys.stdout.buffer

    def show(keys: int | tuple[int, ...], stream: str, data: bytes) -> None:
        if as_json:
            who = ({"instances": list(keys)} if isinstance(keys, tuple)
                   else {"instance": keys})
            for line in data.splitlines():
                out.write(json.dumps({**who, "stream": stream,
                                      "line": shown(line)}).encode()
                          + b"\n")
        else:
            out.write(joblog.tagged(keys, stream, data))

    folder = None
    if fold:  # the same core as the console's; after the fact, no bound but --follow's
        from poprun.fold import BOUND, Folder

        everyone = range(int(record.get("num_instances") or 0))
        folder = Folder(wanted if wanted is not None else everyone,
                        bound=BOUND if follow else float("inf"))

    def emit(key: int, stream: str, data: bytes) -> None:
        if wanted is not None and key not in wanted:
            return
        if folder is None:
            show(key, stream, data)
        else:
            now = time.monotonic()
            for released in folder.add(key, stream, data, now) + folder.expire(now):
                show(*released)

    def idle() -> None:  # --follow --fold: nothing came for a while
        for released in folder.expire(time.monotonic()) if folder is not None else ():
            show(*released)

    try:
        if jobs.launcher_status(record) == "alive" and record.get("control"):
            try:
                _stream_logs(record, follow, emit, idle if folder is not None else None)
                return
            except ControlError:
                record = _job(job)  # it ended meanwhile: its files have it all
        for key, stream, data in joblog.records(_kept_output(record)):
            emit(key, stream, data)
    finally:
        for released in folder.flush() if folder is not None else ():
            show(*released)
        out.flush()


def _stream_logs(record: dict[str, Any], follow: bool, emit, idle=None) -> None:
    """The job's output from its launcher; `idle` is called when nothing came for
    fold.BOUND (held folded lines are due)."""
    _, sock, rest = connect(record["control"], {"op": "logs", "follow": follow}, ASK_TIMEOUT)
    if idle is not None:
        from poprun.fold import BOUND

        sock.settimeout(BOUND)
    else:
        sock.settimeout(None)
    buffer = bytearray(rest)
    try:
        while True:
            consumed = 0
            for key, stream, data in joblog.records(bytes(buffer)):
                emit(key, stream, data)
                consumed += len(joblog.encode(key, stream, data))
            del buffer[:consumed]
            sys.stdout.buffer.flush()
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                idle()
                sys.stdout.buffer.flush()
                continue
            if not chunk:
                break
            buffer += chunk
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        sys.stdout.buffer.flush()


def _kept_output(record: dict[str, Any]) -> bytes:
    if record.get("output_dir"):
        return joblog.from_output_files(record["output_dir"],
                                        range(int(record.get("num_instances") or 0)))
    return joblog.read_ring(record.get("dir") or record["_dir"])


# --- reap --------------------------------------------------------------------------------

@app.command()
def reap(dry_run: Annotated[bool, typer.Option("--dry-run", "-n",
                                               help="Only say what would be done")] = False,
         as_json: JsonOpt = False) -> None:
    """Clean up after jobs whose launcher is gone without doing it (its host rebooted, poprun
    and its watchdog were SIGKILLed, a remote host died and came back): kill their leftover
    instances (pid and start time must match: never a recycled pid), remove their
    poprun-cache-* directories on every recorded host (over SSH for remote ones), release
    the partitions poprun created; host by host, what was done. Exit status 1 when a host
    could not be reached or a partition not removed: the record is kept for the next reap."""
    import asyncio

    from poprun.run import reap as reaping

    found = _scan(quiet=as_json)
    orphans = reaping.orphans(found.records)
    reports = [asyncio.run(reaping.reap(r, dry_run=dry_run)) for r in orphans]
    if as_json:
        _print_json({"dry_run": dry_run, "jobs": [r.to_json() for r in reports]})
    elif not reports:
        sys.stdout.write("nothing to reap: every job's launcher is alive or has cleaned up\n")
    for record, report in zip(orphans, reports):
        if not as_json:
            sys.stdout.write(reaping.render(report, record))
    if not all(r.complete for r in reports):
        raise typer.Exit(1)  # something is left that a later reap must finish


# --- hosts -------------------------------------------------------------------------------

@app.command()
def hosts(release: Annotated[list[str] | None, typer.Option(
              "--release", help="Let this host back into your jobs now (repeatable)",
              show_default=False)] = None,
          as_json: JsonOpt = False) -> None:
    """The hosts your jobs quarantined (lost, frozen: silent for --host-timeout, an instance
    OOM-killed there, or failing their checks at the start): left out of your later jobs
    until the time shown (poprun --quarantine-for), their instances run on a spare; with
    --release, let hosts back now."""
    from poprun.crash import state_dir_problem
    from poprun.jobctl import quarantine

    unsafe = state_dir_problem()  # another user could have written what it would act on
    if unsafe:
        _fail(unsafe, 2)
    now = time.time()
    if release:
        try:
            found = quarantine.release(release, now)
        except OSError as exc:
            _fail(f"cannot rewrite {quarantine.path()}: {exc.strerror or exc}")
        unknown = [h for h in release if h not in found]
        for host in found:
            sys.stdout.write(f"released {host}\n")
        if unknown:
            _fail(f"not quarantined: {', '.join(unknown)}")
        return
    entries, problem = quarantine.read()
    current = sorted(quarantine.active(entries, now).values(), key=lambda e: e.at)
    if problem and not as_json:
        sys.stderr.write(f"poprunctl: {problem}\n")
    if as_json:
        _print_json({"hosts": [e.to_json() for e in current], "problem": problem})
        return
    if not current:
        sys.stdout.write("no quarantined hosts\n")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("HOST", "SINCE", "LEFT", "JOB", "REASON"):
        table.add_column(name, no_wrap=name != "REASON",
                         justify="right" if name in ("SINCE", "LEFT") else "left")
    for entry in current:
        table.add_row(_printable(entry.host), _age(now - entry.at), duration(entry.until - now),
                      entry.job or "", _printable(entry.reason))
    _console().print(table)


def main() -> None:
    """The console script."""
    app(prog_name="poprunctl")


if __name__ == "__main__":
    main()
