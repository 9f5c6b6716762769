"""Starting, binding, watching and killing processes: locally, and (later) over SSH."""

from .lifeline import Lifeline
from .local import LocalSpawner, ProcessSpec, Sink, Stream, resolve_program

__all__ = ["Lifeline", "LocalSpawner", "ProcessSpec", "Sink", "Stream", "resolve_program"]
