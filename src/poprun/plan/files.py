"""Reading the small files a user names (`--import-config`, `--host-file`, an MPI hostfile):
bounded, and decoded carefully, so that a wrong file is one line, never a traceback or a hang.

A name that is not a regular file (`/dev/zero`, a directory, a FIFO with no writer) is refused
before a byte is read; a regular file is read up to its cap and no further; the text must be
UTF-8.
"""

from __future__ import annotations

import os
import stat

from poprun.errors import ConfigError

MAX_CONFIG_FILE = 1 << 20  # bytes: an --import-config file (what --export-config writes is ~1 KiB)
MAX_HOST_FILE = 1 << 20  # bytes: a host file (a 10,000-host file is ~200 KiB)


def read_small_file(path: str, source: str, limit: int, what: str) -> str:
    """The text of `path`: a regular file of at most `limit` bytes, UTF-8. `source` starts
    every error message (`--import-config train.toml`), `what` names the kind of file for a
    file that is too large ("a configuration file"). Raises ConfigError."""
    try:
        # O_NONBLOCK: opening a FIFO nobody writes to must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        reason = exc.strerror if isinstance(exc, OSError) else "not a file name"
        raise ConfigError(f"{source}: cannot read it: {reason}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode)
                    or stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "special")
            raise ConfigError(f"{source}: not a regular file ({kind})")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read it: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(f"{source}: larger than {_size(limit)}: not {what}")
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start + 1}, line {line})"
                          ) from None


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
