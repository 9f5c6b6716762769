"""Signalling an instance that runs beside its runtime's process, not below it (podman).

`podman run` is not its container's parent: the program is conmon's child, in a session of
its own (runc's init calls setsid), and a signal to `podman run`'s group reaches it only
through podman's signal proxy. That proxy misreports both ends of the instance's life:
- before it is set up (while podman makes the container, a few 100 ms, seconds under load),
  SIGTERM runs podman's shutdown handler instead: `podman run` exits 0 (1 for SIGINT) and
  leaves its container behind, made, started or not;
- after the container has exited, while `podman run` reads its status and removes it, the
  proxy cannot forward the signal and raises it on itself: `podman run` dies of it, and the
  program's own status (an exception's 1) reads as poprun's SIGTERM.

So the spawner signals the program's own process group, found by the pid file podman writes
(`--pidfile`, in the spawner's private directory), and holds a signal that comes before the
program runs until it does (looking again every `POLL` seconds), or drops it once the
program has ended: `podman run` then ends with the program's own status. Only SIGKILL goes
to `podman run` (it cannot be proxied, and ends the instance at once; its container is then
removed, spawner/local.py).

The pid file names runc's init from the container's creation on, and the program once runc
has exec'd it: the program is told from runc by its environment, which carries the
instance's own error file (`identity`), as no other process does; a pid reused after the
program's end does not carry it either. (A program that replaces its environment, `env -i`,
is not recognised: its stop waits for poprun's --kill-timeout.)
"""

from __future__ import annotations

import contextlib
import os

from . import procid
from .untrusted import read_regular

WAITING, RUNNING, ENDED = "waiting", "running", "ended"
POLL = 0.02  # seconds between looks for the program a held signal waits for
MAX_PIDFILE = 32  # bytes: a decimal pid and a newline


def state(pidfile: str, identity: bytes) -> tuple[str, int | None]:
    """(WAITING, None): the program does not run yet; (RUNNING, pid): it runs, as `pid`;
    (ENDED, None): it ran and has exited. `identity`: an entry of the instance's
    environment (b"NAME=value") no other process has."""
    data = read_regular(pidfile, MAX_PIDFILE)
    if not data or not data.strip().isdigit():
        return WAITING, None  # podman has not made the container yet
    pid = int(data)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:  # gone: it ran and ended (runc's init that failed: podman run says so)
        return ENDED, None
    if identity in environ.split(b"\0"):
        return RUNNING, pid
    # A zombie (its environment reads empty) has ended; a live process without it is the
    # runtime's init, not exec'd yet (runc's `runc:[2:INIT]`), or one that reused the pid
    # after the program's end, which `podman run`'s own exit will end the wait for.
    return (ENDED, None) if procid.has_exited(pid) else (WAITING, None)


def signal_program(pid: int, sig: int) -> None:
    """`sig` to the program's process group (it leads one: runc's setsid), as a bare
    instance's group gets it."""
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)
