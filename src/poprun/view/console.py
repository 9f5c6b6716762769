"""rich consoles over poprun's own descriptors, deciding as rich does but from the launch's
environment; rich is imported only when `fd` may be a terminal."""

from __future__ import annotations

import os
from collections.abc import Mapping

from poprun.fdio import FdFile


def may_be_terminal(fd: int, environ: Mapping[str, str]) -> bool:
    """False where rich would certainly not treat `fd` as a terminal, decided without importing
    it: only TTY_COMPATIBLE=1, a FORCE_COLOR or a tty make one (rich's Console.is_terminal)."""
    if environ.get("TTY_COMPATIBLE", "") == "1" or environ.get("FORCE_COLOR") is not None:
        return True
    try:
        return os.isatty(fd)
    except OSError:
        return False


def rich_console(fd: int, environ: Mapping[str, str]):
    """A rich Console for `fd` that decides as rich does, but from `environ` rather than
    os.environ (TTY_COMPATIBLE, FORCE_COLOR, NO_COLOR, TERM=dumb/unknown, COLORTERM, COLUMNS):
    or None where rich would write plain text to `fd` (not a terminal, or a dumb one)."""
    if not may_be_terminal(fd, environ):
        return None
    from rich.console import Console

    console = Console(file=FdFile(fd), _environ=dict(environ), force_jupyter=False,
                      markup=False, emoji=False, highlight=False, legacy_windows=False)
    return console if console.color_system is not None else None


def tag_colour_system(fd: int, environ: Mapping[str, str]):
    """The rich ColorSystem to colour tags with on `fd`, or None for plain tags (rich would
    write no colour there: not a terminal, TERM=dumb, NO_COLOR)."""
    console = rich_console(fd, environ)
    if console is None or console.no_color:
        return None
    from rich.console import COLOR_SYSTEMS

    return COLOR_SYSTEMS[console.color_system]
