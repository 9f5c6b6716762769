"""Small text renderings shared by the report, the dashboard, poprunctl and the record: index
sets, exit statuses, signal names. Pure; a leaf."""

from __future__ import annotations

import signal
from collections.abc import Iterable

from spawner.cpulist import format_cpu_list


def fold_indices(indices: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "[0-2,5,7-8]"."""
    return f"[{format_cpu_list(indices)}]"


def describe_status(returncode: int) -> str:
    """`exited with status 3` / `killed by SIGKILL (signal 9)`."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    return f"killed by {signal_name(-returncode)} (signal {-returncode})"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
