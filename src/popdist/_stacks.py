"""Under poprun, the instance answers "where are you?" with the Python stacks of its threads.

poprun (`poprunctl stacks`, `poprun --stall-timeout`) sends the instance `POPDIST_STACKS_SIGNAL`
(default `SIGRTMIN+7`); `import popdist` has registered the standard library's
`faulthandler` for it, which writes every thread's stack to `POPDIST_STACKS_FILE` (a
per-instance file poprun reads, never the instance's own output). faulthandler's handler is C
code run in the signal handler itself, so it answers while the program is stuck in
`time.sleep`, on a lock, in a blocking socket read or in a C call that holds no Python code.

Nothing happens outside poprun (neither variable set): no import, no handler. Under poprun
the cost is `faulthandler` and `signal` (both built into the interpreter) and one open file;
no thread. A handler the program had for that signal before is chained (called after the
dump); a program that sets its own afterwards takes the signal over, and poprun then reads
its stacks with py-spy where it can (spawner/stackdump.py).
"""

from __future__ import annotations

import os

from popdist import env

_file = None  # the open dump file: faulthandler writes to its descriptor, keep it alive


def signal_number(text: str | None) -> int | None:
    """`SIGRTMIN+7`, `SIGUSR2`, `USR2`, `41` -> the signal's number; None when `text` is not
    one (or is a signal faulthandler cannot take: SIGKILL, SIGSTOP, SIGSEGV...)."""
    import signal

    if not text:
        return None
    text = text.strip().upper()
    try:
        number = int(text)
    except ValueError:
        name = text if text.startswith("SIG") else "SIG" + text
        base, plus, offset = name.partition("+")
        if base in ("SIGRTMIN", "SIGRTMAX") and (not plus or offset.isdigit()):
            number = getattr(signal, base) + int(offset or 0)
        else:
            number = getattr(signal.Signals, name, None) if name.isidentifier() else None
            if number is None:
                return None
            number = int(number)
    # Not these: they cannot be caught, or faulthandler keeps them for fatal errors.
    unusable = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGFPE, signal.SIGBUS,
                signal.SIGILL, signal.SIGABRT}
    if number in unusable or not 0 < number < signal.NSIG:
        return None
    return number


def install() -> None:
    """Register the dump, under poprun only (idempotent). Never raises: an instance must not
    fail because its stacks cannot be offered."""
    global _file
    path = os.environ.get(env.STACKS_FILE)
    if not path or _file is not None:
        return
    number = signal_number(os.environ.get(env.STACKS_SIGNAL) or env.DEFAULT_STACKS_SIGNAL)
    if number is None:
        return
    try:
        import faulthandler
        import signal

        previous = signal.getsignal(number)
        handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open on purpose
        # Chaining the default action (terminate, for real-time signals and SIGUSR2) would
        # kill the instance after the dump: chain only a handler of the program's own.
        faulthandler.register(number, file=handle, all_threads=True,
                              chain=previous not in (signal.SIG_DFL, signal.SIG_IGN, None))
        _file = handle
    except (OSError, RuntimeError, ValueError):
        pass
