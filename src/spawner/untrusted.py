"""Files an instance can replace: popdist's error, progress and stacks files (in the spawner's
private directory, but the instance runs as the same user and is told their names). A FIFO
there blocks open() itself, a link points anywhere, a device or a huge file is not what
popdist writes; the launcher's one thread must never wait on any of them. So such a file is
opened without blocking and without following a link, refused unless it is a regular file
of at most the size expected, and read with that bound. The files of a job a host's facts read
(spawner/hostfacts.py) are opened the same way, links followed. Pure I/O helpers; a leaf."""

from __future__ import annotations

import errno
import os
import stat

_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class NotRegular(OSError):
    """`path` is there but is not a regular file: `kind` says what it is (kind_of)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file: {kind}", path)
        self.kind = kind


_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISDIR, "directory"),
          (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link"))


def kind_of(mode: int) -> str:
    """What a file of `mode` is, in words: "FIFO", "directory", "character device"..."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "regular file" if stat.S_ISREG(mode) else "special file"


def open_regular(path: str, flags: int = os.O_RDONLY, limit: int | None = None, *,
                 follow: bool = False) -> int:
    """A descriptor of `path` if it is a regular file (of at most `limit` bytes); OSError
    otherwise (ELOOP for a link, NotRegular (EINVAL) for anything else, EFBIG for a larger
    file). `follow`: a link is followed (a file of the job's, which a user may well link),
    and what it points to is looked at before it is opened, so that a device is never
    opened (opening some has effects); fstat after the open still decides."""
    if follow:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(path, kind_of(info.st_mode))
    fd = os.open(path, flags | (_FLAGS & ~os.O_NOFOLLOW if follow else _FLAGS))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(path, kind_of(info.st_mode))
        if limit is not None and info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int, *, cut: bool = False, follow: bool = False
                 ) -> bytes | None:
    """The bytes of `path` (at most `limit`), or None where it is not there or is not a
    regular file of at most `limit` bytes (with `cut`, a larger one gives its first
    `limit`; `follow`: as open_regular's)."""
    try:
        fd = open_regular(path, limit=None if cut else limit, follow=follow)
    except OSError:
        return None
    try:
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
