"""Errors raised by the poprun library.

Hierarchy:

    PoprunError                 base of everything poprun raises on purpose
    ├── ConfigError             the configuration or command line is invalid (CLI exit 2)
    └── LaunchError             the job could not be started (CLI exit 2); nothing is left running
        ├── VipuError           (vipu.py) a V-IPU request failed; `.kind`, `.command`
        └── KeyDistributionError  (sshkeys.py) --distribute-ssh-key failed on some hosts

A LaunchError about several hosts has one line per host: the CLI prefixes each.

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
