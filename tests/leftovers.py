"""A pytest plugin (tests/conftest.py loads it): which test left poprun's temporary
directories behind.

poprun removes what it makes in the temporary directory and /dev/shm (`poprun-cache-*`,
`poprun-errors-*`, a PMIx world's `poprun-<job>-pmix-*`: spawner/reaphere.py), and its
watchdog does when poprun is killed. A test that kills both on purpose must remove them
itself. Found after whole CI runs, with no sign of the test that made them: so each test's
new ones are noted as it ends (two directory listings a test, well under a millisecond),
and those still there when the session ends are listed with their test in the terminal
summary. A report, not a failure: a watchdog may still be cleaning up as a test ends.
"""

from __future__ import annotations

import os
import tempfile

PREFIX = "poprun-"
PLACES = (tempfile.gettempdir(), "/dev/shm")

_seen: set[str] = set()
_made_by: dict[str, str] = {}  # path -> the test during which it appeared


def _listing() -> set[str]:
    found = set()
    for place in PLACES:
        try:
            found.update(os.path.join(place, name) for name in os.listdir(place)
                         if name.startswith(PREFIX))
        except OSError:
            pass
    return found


def _note(who: str) -> None:
    now = _listing()
    for path in now - _seen:
        _made_by.setdefault(path, who)
    _seen.clear()
    _seen.update(now)


def pytest_sessionstart(session) -> None:
    _note("before the session")
    _made_by.clear()


def pytest_runtest_logstart(nodeid, location) -> None:
    _note(f"between the tests, before {nodeid}")


def pytest_runtest_logfinish(nodeid, location) -> None:
    _note(nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    left = sorted((who, path) for path, who in _made_by.items() if os.path.lexists(path))
    if left:
        terminalreporter.section("poprun temporary directories the tests left")
        for who, path in left:
            terminalreporter.write_line(f"{path}: {who}")
