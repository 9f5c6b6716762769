"""A stop signal while the `poprun` command is still importing itself: one
line `poprun: stopped by SIGINT` and exit 130, never a KeyboardInterrupt traceback from an
import. The command runs as pip's console script runs it (its wrapper, written from
pyproject.toml's entry point), on a real pseudo-terminal; the signal is real, sent by the
process to itself from the import system while it looks for one of poprun's modules."""

from __future__ import annotations

import signal
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from conftest import OFFLINE, SRC
from terminal import run_on_a_terminal

pytestmark = pytest.mark.timeout(60)
PYPROJECT = Path(SRC).parent / "pyproject.toml"


def console_script() -> str:
    """The wrapper pip writes for the `poprun` entry point (pip's own template)."""
    entry = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]["poprun"]
    module, _, function = entry.partition(":")
    return textwrap.dedent(f"""\
        import re
        import sys
        from {module} import {function}
        if __name__ == '__main__':
            sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
            sys.exit({function}())
        """)


def signalled_while_importing(module: str, signum: int) -> str:
    """A `python -c` program: the console script, with `signum` sent when the import system
    first looks for `module` (the handler runs at once, inside the import)."""
    return textwrap.dedent(f"""\
        import os, sys
        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), {signum})
                return None
        sys.meta_path.insert(0, Interrupt())
        """) + console_script()


@pytest.mark.parametrize("module", ["poprun", "poprun.cli.command", "poprun.run.signals",
                                    "spawner.stopsignals", "poprun.cli.main"])
def test_sigint_during_the_command_s_imports_is_one_line(module):
    """Every module on the way in, from the first one the wrapper imports to the one after
    the command's own handler is in place."""
    code, out = run_on_a_terminal(*OFFLINE, "--num-instances=1", "--num-replicas=1", "true",
                                  command=[sys.executable, "-c",
                                           signalled_while_importing(module, signal.SIGINT)])
    text = out.decode(errors="replace")
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.strip() == "poprun: stopped by SIGINT", text
    assert code == 128 + signal.SIGINT, text


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_other_stop_signals_during_the_imports_too(signum):
    code, out = run_on_a_terminal(*OFFLINE, "--num-instances=1", "--num-replicas=1", "true",
                                  command=[sys.executable, "-c",
                                           signalled_while_importing("poprun", signum)])
    text = out.decode(errors="replace")
    assert text.strip() == f"poprun: stopped by {signal.Signals(signum).name}", text
    assert code == 128 + signum, text


def test_the_entry_module_takes_the_job_s_stop_signals():
    """poprun_entry names the signals by number (importing spawner would widen the window):
    the same ones as spawner.stopsignals, the one definition."""
    import poprun_entry
    from spawner.stopsignals import STOP_SIGNALS

    assert poprun_entry.STOP_SIGNALS == tuple(int(s) for s in STOP_SIGNALS)
