"""Writing to a bare file descriptor: every byte, in as few system calls as possible, and a
file object over an fd for rich. A leaf (the output path, the dashboard and the report use it)."""

from __future__ import annotations

import os
import select


class FdFile:
    """What rich's Console asks of its file (isatty, encoding, writes), over a bare fd that it
    must not close."""

    def __init__(self, fd: int) -> None:
        import locale

        self._fd = fd
        self.encoding = locale.getpreferredencoding(False)

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def write(self, text: str) -> int:
        write_all(self._fd, text.encode(self.encoding, "replace"))
        return len(text)

    def flush(self) -> None:
        pass


def write_all(fd: int, *parts: bytes | memoryview) -> None:
    """Write all parts in order with as few system calls as possible, waiting when `fd` is
    non-blocking and full (a slow reader)."""
    try:  # usually one writev takes all (called for every block of output: kept lean)
        done = os.writev(fd, parts)
    except BlockingIOError:
        done = 0
    if done == sum(map(len, parts)):
        return
    views = []  # what is left
    for part in parts:
        if done >= len(part):
            done -= len(part)
        elif len(part):
            views.append(memoryview(part)[done:])
            done = 0
    while views:
        try:
            done = os.writev(fd, views)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        while done:
            if done >= len(views[0]):
                done -= len(views.pop(0))
            else:
                views[0] = views[0][done:]
                done = 0
