"""What poprun does with a bug: one line for the user, the whole story in a crash file.

An internal error (an exception nobody meant to raise) is reported as

    poprun: internal error: <Type>: <message>
    poprun: the traceback is in <crash file>

with the traceback itself on stderr too at `-v`. The crash file is written under the per-user
state directory (`state_dir()`), so that a bug report can include it; the exit status is 70
(EX_SOFTWARE), which no instance status or usage error shares.
"""

from __future__ import annotations

import errno
import os
import stat
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
    """The state directory, made if needed. Raises OSError, PermissionError where another
    user could read or steer it (`state_dir_problem`)."""
    path = state_dir(environ)
    os.makedirs(path, mode=0o700, exist_ok=True)
    problem = state_dir_problem(environ)
    if problem:
        raise PermissionError(errno.EACCES, problem, path)
    return path


def state_dir_problem(environ=os.environ) -> str | None:
    """Why the state directory must not be used, or None. It holds every job's command line
    (`-x SECRET=value` too) and control socket, and `poprunctl reap` acts on what it says:
    as tmux does for its socket directory, it must be this user's own and open to nobody
    else; as ssh does for ~/.ssh, its parent must be this user's or root's and
    writable by nobody else, unless sticky (/tmp), so that nobody can replace it. Where it
    does not exist yet, poprun makes it so. (Something of this user's that is not a
    directory is no danger: the launch goes on without a record, as for a full disk.)"""
    path = state_dir(environ)
    advice = "set XDG_RUNTIME_DIR to a directory of your own"
    try:
        info = os.lstat(path)
    except OSError:  # not there yet; or unreachable, so unusable: no record, no danger
        info = None
    if info is not None:
        if info.st_uid != os.getuid():  # a link too: lstat names who planted it
            return (f"the state directory {path} belongs to another user (uid "
                    f"{info.st_uid}): {advice}, or remove it")
        if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o077:
            return (f"the state directory {path} is open to other users (mode "
                    f"{stat.S_IMODE(info.st_mode):04o}): chmod 700 {path}")
    parent = os.path.dirname(path)
    try:
        above = os.stat(parent)
    except OSError:
        return None  # made with the state directory, 0700
    if above.st_uid not in (0, os.getuid()) or (above.st_mode & 0o022 and not
                                                 above.st_mode & stat.S_ISVTX):
        return (f"the state directory's parent {parent} can be changed by other users "
                f"(owner uid {above.st_uid}, mode {stat.S_IMODE(above.st_mode):04o}): "
                f"{advice}")
    return None


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
