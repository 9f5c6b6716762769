"""PMI-1's wire words shared by the server (spawner/worlds/pmi1.py) and the spawn message's parser
(spawner/worlds/pmi1spawn.py): the error a malformed command raises, and MPICH's escaping of
values. A leaf, so that neither module imports the other for them.
"""

from __future__ import annotations


class PmiError(ValueError):
    """A malformed or unexpected PMI command."""


def escape(value: str) -> str:
    """Escape a value for a reply so MPICH's ``unescape_val`` restores it.

    MPICH's v1 parser ends a value at an unescaped space and turns ``\\x``
    into ``x``.  Values MPICH itself stores are hex or plain words, so this
    is a no-op for them.
    """
    if " " not in value and "\\" not in value:
        return value
    return value.replace("\\", "\\\\").replace(" ", "\\ ")


def unescape(value: str) -> str:
    """Inverse of :func:`escape` (``\\x`` -> ``x``), like pmi_wire.c."""
    if "\\" not in value:
        return value
    out = []
    i = 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            out.append(value[i + 1])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)
