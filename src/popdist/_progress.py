"""`popdist.progress(step, total=None)`: an instance tells poprun how far it is.

poprun compares the instances' rates (stragglers) and shows the slowest one's step, the
total and an ETA (poprun/progress.py). Cheap enough to call every step: the first call maps
the small file poprun names in `POPDIST_PROGRESS_FILE` (made here: `LAYOUT`, step and total,
-1 for no total), every later one is one `struct.pack_into` into that mapping, no system
call (~0.3-1 µs). poprun's spawner reads the file where the instance runs, about once a
second (spawner/local.py), and an agent sends it to the launcher with its STATS.
Outside poprun (no variable), or when the file cannot be made, it does nothing.
"""

from __future__ import annotations

import os
import struct

from popdist import env

LAYOUT = struct.Struct("<qq")  # step, total (-1: none)
NO_TOTAL = -1

_map = None  # the mapping, once made
_off = False  # outside poprun, or the file could not be made: every call returns at once
_pack = LAYOUT.pack_into


def progress(step: int, total: int | None = None) -> None:
    """This instance has done `step` steps (of `total`, when known). A no-op outside poprun,
    and for a step or total beyond a signed 64-bit count (what poprun's tracker holds)."""
    target = _map
    if target is None:
        if _off:
            return
        target = _open()
        if target is None:
            return
    try:
        _pack(target, 0, int(step), NO_TOTAL if total is None else int(total))
    except struct.error:  # past a signed 64-bit count: poprun could not hold it either
        pass


def _open():
    global _map, _off
    path = os.environ.get(env.PROGRESS_FILE)
    if not path:
        _off = True
        return None
    try:
        import mmap

        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, LAYOUT.size)
            _map = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
    except (OSError, ValueError):  # its directory is gone (poprun ended), no room...
        _off = True
    return _map


def unpack(data: bytes) -> tuple[int, int | None] | None:
    """What an instance last gave `progress()` (step, total), from the file's bytes as poprun
    read them (spawner/untrusted.py); None if it never called it."""
    if len(data) != LAYOUT.size:
        return None
    step, total = LAYOUT.unpack(data)
    return step, None if total == NO_TOTAL else total
