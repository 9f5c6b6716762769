"""The stop signals (SIGINT/SIGTERM/SIGHUP, spawner.stopsignals) from the command's first
instruction to the end of a launch: before a launch takes them, a stop raises `Stopped`
(EarlyStop) or, once asyncio's loop runs, is only remembered (hold_stops); a launch routes
them to its job (install_signal_handlers) and acts on one remembered before.

Imported by the command before anything slow: the standard library's `signal`, `sys` and
`threading` only."""

from __future__ import annotations

import signal
import sys
import threading

from spawner.stopsignals import STOP_SIGNALS


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


def install_signal_handlers(loop, handler):
    """Route SIGINT/SIGTERM/SIGHUP to `handler`; returns a function restoring the old ones.
    Only the main thread can own signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)
    # A handler before ours that saw a signal it could not act on (the poprun command's
    # EarlyStop, whose exception Python swallows inside an at-fork hook): act on it now.
    missed = next((old.received for old in previous.values()
                   if getattr(old, "received", None)), None)
    if missed:
        loop.call_soon(handler, missed)

    def restore() -> None:
        for sig, old in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, old if old is not None else signal.SIG_DFL)

    return restore
