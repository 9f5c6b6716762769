"""`poprun`'s main: from the parsed command line to an exit status. A launch, `--check`,
`--dry-run`, `--export-config`, `--distribute-ssh-key`, or typer's `--help` and completion;
usage errors as one line (exit 2), internal errors with a crash file (exit 70).

Everything slow is imported where it is needed: `--version` and a launch import only what
they use (docs/architecture.md, "Measured reasons": import what a run needs, when it
needs it)."""

from __future__ import annotations

import os
import sys
import time

from poprun._version import __version__
from poprun.cli.options import (BY_LONG, Parsed, build_config, listed_hosts, npernode,
                                parse_args, read_host_file_entries)
from poprun.crash import INTERNAL_ERROR_STATUS, report_internal_error
from poprun.errors import ConfigError, InternalError, PoprunError
from poprun.plan.config import LaunchConfig
from spawner import fdlimit


def export_config(config: LaunchConfig, path: str, overwrite: bool) -> str:
    """Write the config as TOML; an existing `train.toml` is kept and the config goes to
    `train-<timestamp>.toml` unless `overwrite`. The file appears whole or not at all (written
    beside it, then renamed), mode 0600. Raises ConfigError: one line naming the path."""
    import tempfile

    where = f"--export-config {path}"
    try:
        text = config.to_toml().encode("utf-8")
    except UnicodeEncodeError as exc:  # a surrogate from an argument that is not UTF-8
        raise ConfigError(f"{where}: cannot store {exc.object[exc.start:exc.end]!r}: not "
                          "UTF-8 text") from None
    try:
        existing = os.stat(path)
    except FileNotFoundError:
        existing = None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot write it: {_reason(exc)}") from None
    if existing is not None:
        import stat

        if stat.S_ISDIR(existing.st_mode):
            raise ConfigError(f"{where}: is a directory (name a file in it)")
        if not stat.S_ISREG(existing.st_mode):
            raise ConfigError(f"{where}: exists and is not a regular file")
        if not overwrite:
            stem, suffix = os.path.splitext(path)
            if not stem or stem.endswith(os.sep):  # `.toml`: the name is all suffix
                stem, suffix = path, ""
            path = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"
            where = f"--export-config {path}"
    folder = os.path.dirname(path) or "."
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=".poprun-export-", dir=folder)
        with os.fdopen(fd, "wb") as fh:  # mkstemp's 0600: it may hold -x SECRET=value
            fh.write(text)
        os.replace(temporary, path)
    except (OSError, ValueError) as exc:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        raise ConfigError(f"{where}: cannot write it: {_reason(exc)}") from None
    return path


def _reason(exc: Exception) -> str:
    return (exc.strerror or str(exc)) if isinstance(exc, OSError) else "not a file name"


def main(argv: list[str] | None = None) -> int:
    """The command's exit status: the job's, 2 for a usage error or a job that could not
    start, 70 for an internal error (a bug: reported with a crash file, never as success)."""
    if argv is None:  # the command itself: no environment block of it holds a pod secret
        from poprun.run.podmode import hide_secret

        hide_secret()
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except InternalError:  # launch() has stopped the job and told the user
        return INTERNAL_ERROR_STATUS
    except ConfigError as exc:  # a usage error: one line, whatever the values in it hold
        sys.stderr.write(f"poprun: error: {one_line(str(exc))}\n")
        return 2
    except PoprunError as exc:  # several hosts may each have their own problem: a line each
        sys.stderr.write("".join(f"poprun: error: {line}\n" for line in str(exc).splitlines()))
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the launch took the signals over
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug outside a launch (parsing, --check...)
        from poprun.run.signals import interruption_behind

        if interruption_behind(exc) is not None:
            raise  # a stop signal, surfaced as another exception: the caller's to report
        sys.stdout.flush()
        report_internal_error(exc, verbose=argv.count("-v") + 2 * argv.count("-vv"))
        return INTERNAL_ERROR_STATUS


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)}
_CONTROL.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def one_line(text: str) -> str:
    """`text` with its control characters escaped (a newline in an option's value shows as
    \\n): a usage error is one line whatever it quotes."""
    return text.translate(_CONTROL)


def _main(argv: list[str]) -> int:
    if os.environ.get("_POPRUN_COMPLETE"):  # a shell completing a poprun command line asks
        from poprun.cli.help import complete

        return complete(os.environ["_POPRUN_COMPLETE"])
    parsed = parse_args(argv)
    if parsed.action == "version":  # before anything imports typer: ~50 ms in all
        sys.stdout.write(f"poprun {__version__}\n")
        return 0
    if parsed.action:  # --help, -h, --show-completion, --install-completion: typer's
        from poprun.cli.help import action

        return action(parsed)
    values = parsed.values
    # Each host and instance holds descriptors here: the soft limit (often 1,024) must not
    # be what stops a large job when the hard one can hold it (spawner/fdlimit.py).
    fdlimit.raise_soft_limit()
    for name in ("export_config", "import_config", "host_file", "result_json"):
        if values.get(name) == "":
            raise ConfigError(f"--{name.replace('_', '-')} needs a file name, got \"\"")
    if values.get("check"):
        return _check(parsed)
    if values.get("export_config") and values.get("import_config"):
        raise ConfigError("--export-config and --import-config cannot be used together")
    config = build_config(parsed)
    # The plan is made first: a launch makes the same one, so a configuration that cannot
    # launch (a program not found...) is an error before --export-config writes anything.
    launch_plan = _plan(config) if values.get("dry_run") or values.get("export_config") else None
    result_file = None if values.get("dry_run") else _open_result_json(config.result_json)
    if values.get("export_config"):
        written = export_config(config, str(values["export_config"]),
                                bool(values.get("overwrite_config")))
        sys.stderr.write(f"poprun: configuration written to {written}\n")
    for warning in _warnings(parsed):
        sys.stderr.write(f"poprun: warning: {one_line(warning)}\n")
    if values.get("dry_run"):
        return _dry_run(config, launch_plan, bool(values.get("json")))
    config, following = _pod_mode(config)
    if following is not None:
        return following
    try:
        result = _launch(config)
    except PoprunError as exc:  # nothing ran: --result-json still says why (main reports it)
        if result_file is not None:
            from poprun.result import not_run_json

            internal = isinstance(exc, InternalError)
            result_file.write(not_run_json(INTERNAL_ERROR_STATUS if internal else 2,
                                           "internal_error" if internal else "usage_error",
                                           str(exc)))
        raise
    if result_file is not None:
        result_file.write(result.to_json())
    return result.exit_code


def _pod_mode(config: LaunchConfig) -> tuple[LaunchConfig, int | None]:
    """In pod mode (plan/pods.py), a pod other than 0 serves the leader as its agent: its
    exit status (run/podmode.py). None: this process launches the job (pod 0, its config
    saying --launcher pod once the secret is read, or no pods)."""
    from poprun.plan.jobhosts import transport_of
    from poprun.plan.pods import contract_in, read_pod

    transport = transport_of(config, os.environ)
    if transport != "pod":
        contract = contract_in(os.environ) if transport == "ssh" and not (
            config.launcher or config.host_list) else None
        if contract is not None:
            sys.stderr.write(f"poprun: warning: a pod contract ({contract}) is in the "
                             "environment but no pod secret (POPRUN_POD_SECRET, "
                             "--pod-secret-file): no pod mode, this pod runs a job of its own\n")
        return config, None
    from poprun.run.podmode import follow, load_secret

    pod = read_pod(os.environ)
    secret = load_secret(config, os.environ)

    def say(line: str) -> None:
        if config.verbose:
            sys.stderr.write(f"poprun: {line}\n")

    say(f"pod mode: {pod.describe()}")
    if pod.leads:
        from dataclasses import replace

        return replace(config, launcher="pod"), None
    return config, follow(pod, secret, config, say)


def _launch(config: LaunchConfig):
    from spawner.asyncio_import import asyncio_without_tls

    asyncio = asyncio_without_tls()  # the command's own process never speaks TLS
    from poprun.run.session import launch

    if config.distribute_ssh_key:
        _distribute_ssh_key(config)
    from poprun.run.signals import hold_stops

    hold_stops()  # a stop signal now is the launch's to act on, not an exception
    return asyncio.run(launch(config))


# Options a program may well have of its own: after the program, no hint that they are
# poprun's (the others, `--num-instances`..., are poprun's own words).
_COMMON_WORDS = {"help", "version", "verbose", "vv", "host", "env", "check", "json", "dry-run",
                 "launcher", "dashboard", "no-dashboard", "show-completion",
                 "install-completion"}


def _warnings(parsed: Parsed) -> list[str]:
    """What the command line asked that will not happen as written: options without the
    option they modify, poprun's options after the program (they go to the program)."""
    values, out = parsed.values, []
    if values.get("json") and not values.get("dry_run"):
        out.append("--json only changes what --dry-run prints: without --dry-run it is "
                   "ignored")
    for name in ("distribute_ssh_key_path", "distribute_ssh_key_type"):
        if name in parsed.given and not values.get("distribute_ssh_key"):
            out.append(f"--{name.replace('_', '-')} has no effect without "
                       "--distribute-ssh-key")
    if parsed.separated:  # `poprun ... -- prog --num-instances 2`: meant for the program
        return out
    after = []
    for tok in parsed.program[1:]:
        opt = BY_LONG.get(tok[2:].partition("=")[0]) if tok.startswith("--") else None
        if opt and opt.long not in _COMMON_WORDS and opt.name not in parsed.given:
            after.append(f"--{opt.long}")
    if after:
        out.append(f"{', '.join(dict.fromkeys(after))} after the program ({parsed.program[0]}) "
                   f"{'goes' if len(after) == 1 else 'go'} to the program, not to poprun: "
                   "poprun's options come before the program")
    return out


class _ResultFile:
    """--result-json, opened before anything starts (as --output-filename is checked): a path
    that cannot be written is a usage error then, not a warning after the job. A new file is
    created 0600 (it may hold `-x SECRET=value`); an existing one keeps its mode and its old
    content until the end. A FIFO or a device (/dev/stdout) is only checked now: opening one
    for writing can wait for a reader."""

    def __init__(self, path: str) -> None:
        import stat

        self.path, self._fd = path, None
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise self._refused(exc.strerror) from None
        if mode is not None and stat.S_ISDIR(mode):
            raise self._refused("is a directory (name a file in it)")
        if mode is not None and not stat.S_ISREG(mode):
            if not os.access(path, os.W_OK):
                raise self._refused("permission denied")
            return
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise self._refused(exc.strerror) from None

    def _refused(self, why: str) -> ConfigError:
        return ConfigError(f"--result-json {self.path}: cannot write it: {why}")

    def write(self, data: dict) -> None:
        import json

        text = (json.dumps(data, indent=2) + "\n").encode()
        try:
            if self._fd is None:
                with open(self.path, "wb") as fh:
                    fh.write(text)
            else:
                from poprun.fdio import write_all

                os.ftruncate(self._fd, 0)
                write_all(self._fd, text)
        except OSError as exc:  # the job has run (a full disk): say so, keep its status
            sys.stderr.write(f"poprun: warning: cannot write --result-json {self.path}: "
                             f"{exc.strerror}\n")


def _open_result_json(path: str | None) -> _ResultFile | None:
    return _ResultFile(path) if path else None


def _check(parsed: Parsed) -> int:
    """--check: no program needed; instance counts default to one per host."""
    import asyncio

    from poprun.plan.hosts import counted_instances, instance_counts
    from poprun.run.check import check_hosts

    program = tuple(parsed.program)
    entries = tuple(parsed.values.get("hosts") or ())
    if parsed.values.get("host_file"):
        entries = read_host_file_entries(str(parsed.values["host_file"]))
    hosts, source = listed_hosts(entries)
    # As a launch counts them (the hosts' slots, SLURM_NTASKS), else one per host.
    instances = parsed.values.get("num_instances") \
        or counted_instances(hosts, source, os.environ, listed=bool(entries),
                             per_host=npernode(parsed.values))[0] \
        or sum(instance_counts(hosts, None, source))
    defaults = {n: instances for n in ("num_instances", "num_replicas")
                if n not in parsed.given}
    config = build_config(_with(parsed, program=program or ("true",), **defaults))
    report, status = asyncio.run(check_hosts(config, os.environ, os.getcwd(),
                                             program[0] if program else None))
    sys.stdout.write(report.for_console(sys.stdout, os.environ))
    return status


def _with(parsed: Parsed, program: tuple[str, ...], **values: object) -> Parsed:
    return Parsed(values={**parsed.values, **values}, given=parsed.given | set(values),
                  program=list(program), action=parsed.action)


def _distribute_ssh_key(config: LaunchConfig) -> None:
    """--distribute-ssh-key: install the key on every remote host (password asked once)."""
    import asyncio

    from poprun.plan.jobhosts import JobHosts
    from poprun.run.sshkeys import distribute_ssh_key

    hosts = JobHosts.of(config, os.environ)
    remote = [h for h in hosts.hosts if str(h) in hosts.remote]
    if not remote:
        raise ConfigError("--distribute-ssh-key needs remote hosts (--host or --host-file)")
    _, results = asyncio.run(distribute_ssh_key(
        remote, path=config.distribute_ssh_key_path, key_type=config.distribute_ssh_key_type,
        fanout=config.ssh_fanout, timeout=config.ssh_timeout))
    for result in results.values():
        sys.stderr.write(f"poprun: {result.message}\n")


def _plan(config: LaunchConfig):
    """The plan a dry run shows (every check a launch makes before contacting a host)."""
    from poprun.run.session import make_plan

    return make_plan(config, os.environ, os.getcwd())


def _dry_run(config: LaunchConfig, launch_plan, as_json: bool) -> int:
    from poprun.view.render import dry_run_text, topology_table

    spec = config.container_spec
    if as_json:
        import json

        shown = launch_plan.to_json()
        if spec is not None:  # only then: the plan's schema is otherwise unchanged
            shown["container"] = spec.to_fields()
        sys.stdout.write(json.dumps(shown, indent=2) + "\n")
        return 0
    if config.print_topology:
        sys.stdout.write(topology_table(launch_plan))
    if spec is not None:
        import shlex

        sys.stdout.write(f"container: {shlex.join([spec.runtime, *filter(None, [spec.image])])}"
                         f"{' ' + shlex.join(spec.args) if spec.args else ''}: each argv below "
                         "runs inside it, started bound as shown\n")
    sys.stdout.write(dry_run_text(launch_plan))
    return 0
