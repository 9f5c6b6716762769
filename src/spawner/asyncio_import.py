"""asyncio for poprun's own processes (the `poprun` command, the per-host agent): imported
with `ssl` hidden, which asyncio then leaves out.

Each asyncio module that uses ssl has `try: import ssl except ImportError: ssl = None`, and
ssl is ~4 of asyncio's ~19 ms of import on the 2-core machine of docs/architecture.md, paid
by every launch and every agent. Neither process speaks TLS over asyncio: asyncssh brings its
own crypto, and `vipu` and `srun` are processes. Only asyncio is told: a later `import ssl`
works. A caller's program that runs `launch()` imports asyncio as it is.
"""

from __future__ import annotations

import sys


def asyncio_without_tls():
    """The asyncio module; imported without TLS when this process has imported neither."""
    if "asyncio" not in sys.modules and "ssl" not in sys.modules:
        sys.modules["ssl"] = None  # type: ignore[assignment]: import ssl -> ImportError
        try:
            import asyncio  # noqa: F401
        finally:
            del sys.modules["ssl"]
    import asyncio

    return asyncio
