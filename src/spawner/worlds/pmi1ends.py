"""The spawner's ends of its instances' PMI sockets, watched until an instance speaks.

A job that does not use MPI must pay nothing measurable for the world poprun offers it
(docs/architecture.md, "The instances' worlds"): each instance gets one end of a socket pair,
and this host's end is only watched. The PMI server (worlds/pmi1.py, and the import of it)
is made when an instance first writes, on the launcher and on an agent alike; an end whose
instance exits without a word is closed and forgotten.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

from popdist.env import PMI_FD, PMI_HOSTNAME


def end_variables(theirs: socket.socket) -> dict[str, str]:
    """What points an instance at its end of its PMI socket (inherited as is), on any host."""
    return {PMI_FD: str(theirs.fileno()), PMI_HOSTNAME: os.uname().nodename}


class PmiEnds:
    """Our ends of the socket pairs of one world's instances on this host."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_first_word: Callable[[], None]) -> None:
        self._loop, self._on_first_word = loop, on_first_word
        self._waiting: dict[int, socket.socket] = {}  # rank -> our end, not served yet

    def attach(self, rank: int) -> socket.socket:
        """A new socket pair for `rank`: ours is watched; theirs (inheritable) is returned,
        for the instance to inherit and the caller to close once it has started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        ours.setblocking(False)
        self._waiting[rank] = ours
        self._loop.add_reader(ours.fileno(), self._readable, rank)
        return theirs

    def _readable(self, rank: int) -> None:
        """An instance wrote (the world starts) or ended without a word (forgotten)."""
        ours = self._waiting.get(rank)
        if ours is None:
            return
        try:
            spoke = ours.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return
        except OSError:
            spoke = False
        if spoke:
            self._on_first_word()
        else:
            self._loop.remove_reader(ours.fileno())
            ours.close()
            del self._waiting[rank]

    def hand_over(self) -> dict[int, socket.socket]:
        """Every end still waiting, no longer watched, for a server to adopt (what its
        instance wrote is still in it); ends attached later are the caller's to adopt."""
        waiting, self._waiting = self._waiting, {}
        for ours in waiting.values():
            self._loop.remove_reader(ours.fileno())
            ours.setblocking(True)  # asyncio's streams set their own mode
        return waiting

    def close(self) -> None:
        for ours in self.hand_over().values():
            ours.close()
