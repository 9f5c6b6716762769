"""Run the real `poprun` on a pseudo-terminal (stdin, stdout and stderr all the pty) and
collect everything it draws, with a bounded wait."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios

from conftest import poprun_argv, poprun_env


def run_on_a_terminal(*args: str, env: dict[str, str] | None = None,
                      command: list[str] | None = None, rows: int = 30, columns: int = 100,
                      timeout: float = 30) -> tuple[int, bytes]:
    """(exit status, bytes written to the terminal). `command`: what runs instead of
    `python -m poprun` (e.g. a `python -c` prologue), followed by `args`."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    argv = [*command, *args] if command else poprun_argv(*args)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                            env=poprun_env(env), close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while select.select([master], [], [], timeout)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not data:
                break
            out += data
    finally:
        os.close(master)
        proc.wait(timeout=timeout)
    return proc.returncode, bytes(out)
