"""An instance's uncaught exception, written where poprun looks for it.

Under poprun, `POPDIST_ERROR_FILE` names a per-instance file. `import popdist` then chains an
exception hook (`install`, called from popdist/__init__) that writes the exception there as
JSON before the previous hook prints it as usual: its type, message, the innermost frame of the
user's own code, the whole traceback and the time. poprun reads the file when the instance
exits: its failure report says *why* an instance failed, and the earliest exception among
instances that failed together names the root cause (poprun/rootcause.py).

A program that does not import popdist can opt in with `popdist.record`, a decorator for its
entry point (as torch elastic's `@record`). Outside poprun both do nothing. The first error
written wins: the hook does not overwrite what `record` wrote for the same exception.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from popdist import env

MAX_TRACEBACK = 32 * 1024  # characters of traceback kept: the head is the interesting part
# What poprun keeps of a file (`parse`): these fields only, text cut to these lengths.
_TEXT = {"type": 256, "module": 256, "message": 4096, "file": 4096, "function": 256,
         "traceback": MAX_TRACEBACK}
_NUMBERS = {"line": int, "pid": int, "time": float}


def install() -> None:
    """Chain the exception hook, under poprun only (idempotent)."""
    if not os.environ.get(env.ERROR_FILE) or getattr(sys.excepthook, "_popdist", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        write(value)
        previous(kind, value, tb)

    hook._popdist = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def record(fn):
    """Decorator: an exception escaping `fn` is written to poprun's error file, then raised
    on (a clean `sys.exit(0)` is not an error)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                write(exc)
            raise
        except BaseException as exc:
            write(exc)
            raise

    return wrapper


def write(error: BaseException) -> None:
    """Write `error` to the error file (if poprun set one and nothing is there yet). Never
    raises: an instance's failure must not become a failure to report it."""
    path = os.environ.get(env.ERROR_FILE)
    if not path or os.path.exists(path):
        return
    try:
        import json

        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as fh:
            json.dump(describe(error), fh)
        os.replace(temporary, path)
    except Exception:  # noqa: BLE001 - best effort, see above
        pass


def parse(data: bytes) -> dict | None:
    """The error file's bytes as poprun keeps them, or None for one that is not what `write`
    writes. The instance wrote it, so it is checked as hostile input: a JSON object, its
    known fields only, text of bounded length that can always be encoded again (a JSON
    `\\ud800` made `\\ud800`), numbers finite and of the right kind."""
    import json

    try:
        fields = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past the stack
        return None
    return checked(fields)


def checked(fields) -> dict | None:
    """What `parse` keeps of a decoded error file's object (an agent sends what it parsed
    there: the launcher checks it again, as another host's word)."""
    import math

    if not isinstance(fields, dict):
        return None
    kept: dict = {}
    for name, limit in _TEXT.items():
        value = fields.get(name)
        if isinstance(value, str):
            kept[name] = value[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    for name, kind in _NUMBERS.items():
        value = fields.get(name)
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and abs(value) < 2 ** 63):
            kept[name] = kind(value)
    return kept or None


def describe(error: BaseException) -> dict:
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    where = _innermost_user_frame(frames)
    text = "".join(traceback.format_exception(error))
    return {
        "type": type(error).__qualname__,
        "module": type(error).__module__,
        "message": str(error),
        "file": where.filename if where else None,
        "line": where.lineno if where else None,
        "function": where.name if where else None,
        "traceback": text[:MAX_TRACEBACK],
        "time": time.time(),
        "pid": os.getpid(),
    }


def _innermost_user_frame(frames: list):
    """The last frame in the user's code: not the standard library's, not an installed
    package's (site-packages, dist-packages), not an interpreter internal (`<frozen ...>`);
    the innermost frame of all when every frame is someone else's."""
    import sysconfig

    others = {os.path.realpath(p) for name, p in sysconfig.get_paths().items()
              if name in ("stdlib", "platstdlib", "purelib", "platlib")}
    for frame in reversed(frames):
        name = frame.filename
        if name.startswith("<") or "-packages" + os.sep in name:
            continue
        if not any(os.path.realpath(name).startswith(p + os.sep) for p in others):
            return frame
    return frames[-1] if frames else None
