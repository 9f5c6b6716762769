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
    code, terminal, _ = _run(args, env, command, rows, columns, timeout, piped=False)
    return code, terminal


def run_with_stdout_piped(*args: str, env: dict[str, str] | None = None,
                          command: list[str] | None = None, rows: int = 30,
                          columns: int = 100, timeout: float = 30) -> tuple[int, bytes, bytes]:
    """As `poprun ... | tee log` runs it: stdin and stderr the terminal, stdout a pipe.
    (exit status, bytes written to the terminal, bytes written to the pipe)."""
    return _run(args, env, command, rows, columns, timeout, piped=True)


def _run(args, env, command, rows, columns, timeout, piped):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    argv = [*command, *args] if command else poprun_argv(*args)
    read_end, write_end = os.pipe() if piped else (None, slave)
    proc = subprocess.Popen(argv, stdin=slave, stdout=write_end, stderr=slave,
                            env=poprun_env(env), close_fds=True)
    os.close(slave)
    if piped:
        os.close(write_end)
    out, piped_out = bytearray(), bytearray()
    readers = [master] + ([read_end] if piped else [])
    try:
        while readers and (ready := select.select(readers, [], [], timeout)[0]):
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    data = b""
                if not data:
                    readers.remove(fd)
                (out if fd == master else piped_out).extend(data)
    finally:
        os.close(master)
        if piped:
            os.close(read_end)
        proc.wait(timeout=timeout)
    return proc.returncode, bytes(out), bytes(piped_out)
