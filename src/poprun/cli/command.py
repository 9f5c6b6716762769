"""The `poprun` command's first and last instructions, around `cli.main.main()`.

First, before any import that takes time (the console script and `python -m poprun` land
here, through `poprun_entry`, whose first statement takes the stop signals): standard
descriptors that are closed get /dev/null, so nothing poprun opens later becomes fd 0, 1 or 2
by accident (`poprun ... >&-`, as cron and some schedulers run it); and SIGINT/SIGTERM/SIGHUP
end poprun cleanly until the launch takes them over (one line, exit 128+N, never a
`KeyboardInterrupt` traceback from an import), one that came earlier included; and poprun
becomes the child subreaper, so what its instances leave behind comes back to it.

Last: every child still there is killed and reaped (the instances are long gone by then:
this is for what a stop in the middle of something left, e.g. an SSH `ProxyCommand`), then
the process exits without the interpreter's teardown (40-70 ms of asyncssh's and asyncio's
modules, bench/multihost_bench.py); everything poprun owns is closed by then.
"""

from __future__ import annotations

import os
import signal
import sys

from poprun.run.signals import Stopped, install_early_stop, interruption_behind


def run(received: list[int] | tuple[int, ...] = ()) -> None:
    """`received`: the stop signals that came before (poprun_entry remembered them)."""
    claim_standard_fds()
    code = _run(received)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def _run(received: list[int] | tuple[int, ...]) -> int:
    try:
        install_early_stop()  # in here: a signal right after it is a Stopped to report
        if received:
            raise Stopped(received[0])
        from spawner.containment import become_subreaper, reap_children

        become_subreaper()
        from poprun.cli.main import main

        try:
            return main()
        finally:
            reap_children()
    except BaseException as exc:  # noqa: BLE001 - a Stopped, perhaps wrapped (see below)
        stop = interruption_behind(exc)
        if not isinstance(stop, Stopped):
            raise
        name = signal.Signals(stop.signum).name
        try:
            os.write(2, f"poprun: stopped by {name}\n".encode())
        except OSError:
            pass
        return 128 + stop.signum


def claim_standard_fds() -> None:
    """Put /dev/null on fd 0, 1 and 2 where they are closed (Python then also left
    sys.stdin/stdout/stderr None: they get file objects on the new descriptors)."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # takes the lowest free number: `fd`
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))
