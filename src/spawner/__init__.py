"""Starting, binding, watching and killing processes: on this host, and on others through an
agent (`python -m spawner.agent`).

Nothing is imported here: `import spawner.X` loads X alone (the agent's and the command's
start-up paths import only what they use); the names below load on first use."""

__all__ = ["Lifeline", "LocalSpawner", "ProcessSpec", "Sink", "Stream", "resolve_program"]


def __getattr__(name: str):
    if name == "Lifeline":
        from .lifeline import Lifeline

        return Lifeline
    if name in __all__:
        from . import local

        return getattr(local, name)
    raise AttributeError(f"module 'spawner' has no attribute {name!r}")
