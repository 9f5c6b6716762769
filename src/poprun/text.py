"""Small text renderings shared by the report, the dashboard, poprunctl and the record: index
sets, exit statuses, signal names, durations and sizes, child bytes and text made safe to show
(undecodable bytes escaped, controls visible), the dry run's stand-ins. Pure; a leaf."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable

from spawner.cpulist import format_cpu_list


def fold_indices(indices: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "[0-2,5,7-8]"."""
    return f"[{format_cpu_list(indices)}]"


def at_launch(what: str) -> str:
    """A dry run's stand-in for a value only the launch learns: `<what, known at launch>`."""
    return f"<{what}, known at launch>"


def fold_hosts(names: list[str]) -> str:
    """["h3", "h7", "h8", "h9", "x"] -> "h[3,7-9],x": names sharing a prefix and ending in
    numbers without leading zeros fold into one range list."""
    groups: dict[str, list[int]] = {}
    rest = []
    for name in names:
        match = re.fullmatch(r"(.*?)([1-9]\d*|0)", name)
        if match:
            groups.setdefault(match[1], []).append(int(match[2]))
        else:
            rest.append(name)
    parts = [f"{p}{n[0]}" if len(n) == 1 else f"{p}{fold_indices(n)}" for p, n in groups.items()]
    return ",".join(parts + rest)


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


# C0 controls and DEL shown as their Unicode pictures (ESC as ␛), C1 as U+FFFD: a child's
# escape sequences show as text and never move the cursor or change colours in the panel.
_VISIBLE = {c: 0x2400 + c for c in range(32)}
_VISIBLE.update({0x7F: 0x2421, 0x09: 0x20, **{c: 0xFFFD for c in range(0x80, 0xA0)}})


def visible(raw: bytes, limit: int) -> str:
    """Child bytes as display text: decoded as `shown` does, controls made visible, at most
    `limit` characters (a row never shows more)."""
    return shown(raw[:limit * 4])[:limit].translate(_VISIBLE)


def shown(raw: bytes) -> str:
    """An instance's bytes as text: UTF-8, each byte that is not shown as `\\xNN` (nothing
    lost, nothing that cannot be written again)."""
    return raw.decode("utf-8", "backslashreplace")


def shown_text(text: str) -> str:
    """Text an instance gave that may hold surrogates (PMI's bytes decoded with
    surrogateescape, a JSON `\\ud800`) as `shown` would show its bytes: it can always be
    encoded."""
    try:
        return shown(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def percent(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}%"


def size(value: int | None) -> str:
    if value is None:
        return ""
    if value < 1024:
        return f"{value}B"
    for unit in ("K", "M", "G"):
        value /= 1024
        if value < 1024 or unit == "G":
            break
    return f"{value:.0f}{unit}" if value >= 10 else f"{value:.1f}{unit}"


# --- the terminal driver --------------------------------------------------------------------


def cut(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, an ellipsis marking a cut."""
    return text if len(text) <= limit else text[:limit - 1] + "…"
