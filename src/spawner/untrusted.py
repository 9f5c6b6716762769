"""Files an instance can replace: popdist's error, progress and stacks files (in the spawner's
private directory, but the instance runs as the same user and is told their names). A FIFO
there blocks open() itself, a link points anywhere, a device or a huge file is not what
popdist writes; the launcher's one thread must never wait on any of them. So such a file is
opened without blocking and without following a link, refused unless it is a regular file
of at most the size expected, and read with that bound. Pure I/O helpers; a leaf."""

from __future__ import annotations

import errno
import os
import stat

_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


def open_regular(path: str, flags: int = os.O_RDONLY, limit: int | None = None) -> int:
    """A descriptor of `path` if it is a regular file (of at most `limit` bytes); OSError
    otherwise (ELOOP for a link, EINVAL for anything else, EFBIG for a larger file)."""
    fd = os.open(path, flags | _FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        if limit is not None and info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int, *, cut: bool = False) -> bytes | None:
    """The bytes of `path` (at most `limit`), or None where it is not there or is not a
    regular file of at most `limit` bytes (with `cut`, a larger one gives its first
    `limit`)."""
    try:
        fd = open_regular(path, limit=None if cut else limit)
    except OSError:
        return None
    try:
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
