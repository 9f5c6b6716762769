"""The `poprun` command's first and last instructions, around `cli.main()`.

First, before any import that takes time (the console script and `python -m poprun` land
here): standard descriptors that are closed get /dev/null, so nothing poprun opens later
becomes fd 0, 1 or 2 by accident (`poprun ... >&-`, as cron and some schedulers run it); and
SIGINT/SIGTERM/SIGHUP end poprun cleanly until the launch takes them over (one line, exit
128+N, never a `KeyboardInterrupt` traceback from an import); and poprun becomes the child
subreaper, so what its instances leave behind comes back to it.

Last: every child still there is killed and reaped (the instances are long gone by then:
this is for what a stop in the middle of something left, e.g. an SSH `ProxyCommand`), then
the process exits without the interpreter's teardown (40-70 ms of asyncssh's and asyncio's
modules, bench/multihost_bench.py); everything poprun owns is closed by then.
"""

from __future__ import annotations

import os
import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal came while no launch was taking signals (BaseException: nothing on
    the way may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interruption_behind(error: BaseException | None) -> BaseException | None:
    """The signal's exception (a Stopped, a KeyboardInterrupt: not an Exception) behind
    `error`, if any: Python wraps one raised while a class is being made (`__set_name__`,
    during an import) in a RuntimeError."""
    seen = set()
    while error is not None and id(error) not in seen:
        if not isinstance(error, Exception):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class EarlyStop:
    """The handler of the stop signals until a launch takes them over: raises Stopped, and
    remembers the signal (`received`) for when the exception cannot propagate — raised
    inside an at-fork hook or a finalizer, Python only prints it — so that the launch that
    takes the signals over acts on it (job.install_signal_handlers)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raising = True  # False once the launch's loop runs (hold_stops)

    def __call__(self, signum: int, frame: object) -> None:
        self.received = signum
        if self.raising:
            raise Stopped(signum)


def hold_stops() -> None:
    """From here until the launch takes the stop signals, one is only remembered: the
    launch acts on it then (job.install_signal_handlers). Raised while asyncio's loop runs,
    Stopped can land in the loop's own code between taking a callback and running it: the
    loop swallows it and that callback, and when the callback was the launch's next step
    the launch waits forever (seen once: stuck in create_unix_server's sleep(0))."""
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if isinstance(handler, EarlyStop):
            handler.raising = False


def install_early_stop() -> EarlyStop:
    """Stop signals raise Stopped from here on; one raised where Python can only print it
    (a finalizer, a weakref callback such as the import system's module-lock cleanup, an
    at-fork hook) is not printed: EarlyStop remembered it and the launch acts on it."""
    early = EarlyStop()
    for sig in STOP_SIGNALS:
        signal.signal(sig, early)
    default = sys.unraisablehook

    def quiet_stops(unraisable) -> None:
        if not isinstance(unraisable.exc_value, Stopped):
            default(unraisable)

    sys.unraisablehook = quiet_stops
    return early


def run() -> None:
    claim_standard_fds()
    install_early_stop()
    code = _run()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def _run() -> int:
    try:
        from spawner.containment import become_subreaper, reap_children

        become_subreaper()
        from .cli import main

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
