"""What poprun does with a bug: one line for the user, the whole story in a crash file.

An internal error (an exception nobody meant to raise) is reported as

    poprun: internal error: <Type>: <message>
    poprun: the traceback is in <crash file>

with the traceback itself on stderr too at `-v`. The crash file is written under the per-user
state directory (`state_dir()`), so that a bug report can include it; the exit status is 70
(EX_SOFTWARE), which no instance status or usage error shares.
"""

from __future__ import annotations

import os
import sys
import time

from poprun._version import __version__
from poprun.errors import InternalError, describe

INTERNAL_ERROR_STATUS = 70  # EX_SOFTWARE (sysexits.h)


def state_dir(environ=os.environ) -> str:
    """poprun's per-user directory: `$XDG_RUNTIME_DIR/poprun`, else
    `~/.local/state/poprun` (created with mode 0700 by `ensure_state_dir`)."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "poprun")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "poprun")


def ensure_state_dir(environ=os.environ) -> str:
    path = state_dir(environ)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def write_crash_file(error: BaseException, extra: str = "") -> str | None:
    """The traceback and the context of `error` in a new file; its path, or None when no
    file could be written anywhere (the message on stderr then has to do)."""
    import tempfile
    import traceback

    text = "".join([
        f"poprun {__version__} internal error at {time.strftime('%Y-%m-%d %H:%M:%S')}\n",
        f"python {sys.version.split()[0]} ({sys.executable}), pid {os.getpid()}\n",
        f"command line: {sys.argv!r}\n",
        extra,
        "\n",
        *traceback.format_exception(error),
    ])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in (_writable_state_dir(), tempfile.gettempdir()):
        if folder is None:
            continue
        try:
            fd, path = tempfile.mkstemp(prefix=f"crash-{stamp}-", suffix=".txt", dir=folder)
        except OSError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as fh:
            fh.write(text)
        return path
    return None


def _writable_state_dir() -> str | None:
    try:
        return ensure_state_dir()
    except OSError:
        return None


def report_internal_error(error: BaseException, stderr_fd: int = 2,
                          verbose: int = 0) -> InternalError:
    """Tell the user about `error` (one line, the crash file's path, the traceback at -v) and
    return the InternalError to raise. An agent's error (spawner.remote.AgentInternalError)
    carries its host and the traceback as the agent formatted it."""
    import traceback

    host = getattr(error, "host", None)
    remote_traceback = getattr(error, "remote_traceback", "")
    message = str(error) if remote_traceback else describe(error)
    path = write_crash_file(error, f"on host {host}:\n{remote_traceback}\n"
                            if remote_traceback else "")
    lines = [f"poprun: internal error: {message}\n"]
    if verbose:
        lines.append(remote_traceback or "".join(traceback.format_exception(error)))
    if path:
        lines.append(f"poprun: the traceback is in {path}\n")
    try:
        os.write(stderr_fd, "".join(lines).encode("utf-8", "replace"))
    except OSError:
        pass
    return InternalError(message, path, host if remote_traceback else None)
