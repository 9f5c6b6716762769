"""The `poprun` console script's module ([project.scripts] in pyproject.toml; `python -m
poprun` comes here too). It lies outside the `poprun` package so that its first statement runs
before any of poprun's imports: from there on a stop signal (SIGINT, SIGTERM, SIGHUP) is only
remembered, never a KeyboardInterrupt raised in the middle of an import, and `cli/command.py`
acts on it once its own handler is in place (`poprun: stopped by SIGINT`, exit 130).

What comes before this statement is the interpreter's: its start-up, where a SIGINT kills it
silently until Python installs its own handler, then `site` and the `import re` of the wrapper
pip writes, where Python raises KeyboardInterrupt (docs/architecture.md, "Stop signals at
start-up", has the measured window)."""

import _signal  # built in and loaded by the interpreter: `signal` costs ~1 ms (its enums)

# spawner.stopsignals.STOP_SIGNALS, by number (importing it would widen the window;
# tests/test_signals_at_start.py checks the two agree).
STOP_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
received: list[int] = []  # what came before cli/command.py took the signals over


def _remember(signum: int, frame: object) -> None:
    received.append(signum)


for _stop in STOP_SIGNALS:
    _signal.signal(_stop, _remember)


def run() -> None:
    from poprun.cli.command import run as command

    command(received)
