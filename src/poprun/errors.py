"""Errors raised by the poprun library.

Hierarchy:

    PoprunError                 base of everything poprun raises on purpose
    ├── ConfigError             the configuration or command line is invalid (CLI exit 2)
    ├── LaunchError             the job could not be started (CLI exit 2); nothing is left running
    │   ├── VipuError           (vipu.py) a V-IPU request failed; `.kind`, `.command`
    │   └── KeyDistributionError  (sshkeys.py) --distribute-ssh-key failed on some hosts
    └── InternalError           a bug: an unexpected exception stopped the job (CLI exit 70);
                                `.crash_file` holds the traceback, `__cause__` the exception

A LaunchError about several hosts has one line per host: the CLI prefixes each.

Whatever ends a launch, nothing it started is left running and its caches and partition are
cleaned up first; an internal error is never reported as a job's success.

A failed *job* (an instance exiting non-zero) is not an error: `launch()` returns a
`LaunchResult` that says so.
"""

from __future__ import annotations


class PoprunError(Exception):
    """Base of every error poprun raises on purpose; `str()` is the one-line message."""


class ConfigError(PoprunError):
    """Invalid configuration: bad option value, inconsistent counts, missing program..."""


class LaunchError(PoprunError):
    """The job could not be started; whatever had been started was stopped and cleaned up."""


class InternalError(PoprunError):
    """An unexpected exception (a bug in poprun, or in an agent on `host`) stopped the job.
    The instances were killed and the caches and partition cleaned up before it was raised;
    `str()` is `<Type>: <message>` (`<host>: agent: <Type>: <message>` for an agent's)."""

    def __init__(self, message: str, crash_file: str | None = None,
                 host: str | None = None) -> None:
        self.crash_file, self.host = crash_file, host
        super().__init__(message)


def describe(error: BaseException) -> str:
    """`<Type>: <message>` on one line, as an internal error is reported."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
