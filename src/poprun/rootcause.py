"""Which failure is the cause and which are its victims (pure: the instances' ends in, a verdict
out).

When one instance of a distributed job fails, the others usually fail right after it: their
collectives lose a peer (gloo: `RuntimeError: ... Connection closed by peer`), poprun SIGTERMs
them. The first instance to *exit* is then often a victim. Among the instances that failed
within `WINDOW` seconds of the first failure, the root cause is the one whose own exception
came first (its error file's time: popdist/errorfile.py), not counting the ones whose failure
looks collateral; without such an exception, the first non-collateral exit; without any, the
first failure as before. Each other failed instance is labelled with why it looks collateral.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

WINDOW = 10.0  # seconds after the first failure in which failures are weighed together
# Exception types raised in an instance whose peer went away (socket level, torch.distributed).
PEER_GONE_TYPES = frozenset({
    "ConnectionResetError", "ConnectionAbortedError", "ConnectionRefusedError",
    "BrokenPipeError", "EOFError", "DistNetworkError", "DistBackendError",
})
# ... and what such messages say, whatever the type (gloo and NCCL raise RuntimeError).
PEER_GONE_TEXT = re.compile(
    r"connection (closed|reset|refused)( by peer)?|broken pipe|peer (closed|disconnected|"
    r"went away)|socket (closed|timeout)|timed out|NCCL communicator was aborted", re.I)
# What a stop signal raises in a Python program.
STOP_EXCEPTIONS = frozenset({"KeyboardInterrupt", "SystemExit"})


class Ended(Protocol):
    """What is weighed of one instance (poprun.result.InstanceResult has it)."""

    index: int
    returncode: int
    end_time: float
    stopped_by_poprun: bool
    lost: str | None
    error: Mapping[str, Any] | None


def exception_text(error: Mapping[str, Any]) -> str:
    """`ValueError: loss is NaN (train.py:88, in step)`: type, message, where."""
    text = f"{error.get('type', 'exception')}: {error.get('message', '')}".rstrip(": ")
    if error.get("file"):
        name = str(error["file"]).rsplit("/", 1)[-1]
        text += f" ({name}:{error.get('line')}, in {error.get('function')})"
    return text


def collateral_reason(inst: Ended) -> str | None:
    """Why this failure looks like another's consequence; None when it looks like its own."""
    if inst.lost:
        return None  # a lost host is a cause of its own
    error = inst.error
    if error and (error.get("type") in PEER_GONE_TYPES
                  or PEER_GONE_TEXT.search(str(error.get("message", "")))):
        return f"{error.get('type')} when a peer went away"
    # An exception of its own counts even when poprun's signal crossed it (its exit was
    # still on the way); the one a stop signal raises does not.
    if inst.stopped_by_poprun and (not error or error.get("type") in STOP_EXCEPTIONS):
        return "stopped by poprun after the root cause"
    return None


def analyze(instances: Sequence[Ended], first: int | None) -> tuple[int | None, dict[int, str]]:
    """(the root cause's index, {index: why it looks collateral} for the other failures).
    `first`: the first instance to fail by exit time (what the job reacted to)."""
    failed = [i for i in instances if i.returncode != 0]
    by_index = {i.index: i for i in failed}
    if first is None or first not in by_index:
        return first, {}
    horizon = by_index[first].end_time + WINDOW
    weighed = [i for i in failed if i.end_time <= horizon]
    own = [i for i in weighed if collateral_reason(i) is None]
    if own:
        root = min(own, key=lambda i: (_when(i), i.index)).index
    else:
        root = first
    collateral = {i.index: collateral_reason(i) or f"failed after instance {root}"
                  for i in failed if i.index != root}
    return root, collateral


def _when(inst: Ended) -> float:
    """When it failed: its exception's time, else its exit."""
    if inst.error and isinstance(inst.error.get("time"), (int, float)):
        return float(inst.error["time"])
    return inst.end_time
