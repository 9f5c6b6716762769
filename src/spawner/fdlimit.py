"""The open-file limit (RLIMIT_NOFILE): raised to the hard limit at start, and what a job
holds open checked against it before anything starts.

The common soft limit is 1,024 (systemd's default, whatever the hard limit), which a flat
launch passes at a few hundred hosts or instances. The launcher and each agent raise their
soft limit to the hard one as they start, as clush and OpenSSH's multiplexing master do; the
instances inherit the raised limit. What even the hard limit cannot hold is refused before the
first connection (the launcher's own need) or before the first instance (an agent's, which
the agent reports in its HELLO reply).

The needs are floors counted from the code, not guesses with a margin: what the job surely
holds at once (measured: /proc/<pid>/fd of a launcher at 8, 32 and 64 SSH hosts, and of an
agent and a local launch at 1, 16 and 64 instances). A host reached through a ProxyCommand
holds that command's pipes too; those are not counted.
"""

from __future__ import annotations

import resource

from .uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

__all__ = ["LAUNCHER_BASE", "AGENT_BASE", "PER_CONNECTION", "PER_INSTANCE", "PER_OUTPUT_FILES",
           "Limits", "agent_need", "launcher_need", "limits", "raise_soft_limit", "shortfall"]

# The launcher without any host or instance: the standard streams, the event loop's epoll and
# self-pipe, the lifeline, the output ring (10-12 measured, as the job's record, control
# socket and dashboard are there or not).
LAUNCHER_BASE = 8
# An agent without instances: its streams, epoll and self-pipe, the lifeline (9 measured).
AGENT_BASE = 8
# An SSH host: its connection's socket; the agent's channels are multiplexed over it.
PER_CONNECTION = 1
# An instance, where it runs (the launcher for local ones, an agent for remote ones): its
# stdout and stderr pipes, its pidfd, its end of the PMI socket.
PER_INSTANCE = 4
# With --output-filename the launcher writes each instance's stdout and stderr file, remote
# instances' too.
PER_OUTPUT_FILES = 2


@dataclass(frozen=True)
class Limits:
    soft: int
    hard: int  # resource.RLIM_INFINITY where there is none

    def describe(self) -> str:
        hard = "unlimited" if self.hard == resource.RLIM_INFINITY else str(self.hard)
        return f"{self.soft} (hard limit {hard})"


def limits() -> Limits:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return Limits(soft, hard)


def raise_soft_limit() -> Limits:
    """Raise this process's soft limit to its hard limit; the limits in force after. Where
    the hard limit is unlimited (not on Linux: fs.nr_open bounds it) or the raise is refused,
    the soft limit stays as it was."""
    now = limits()
    if now.soft < now.hard and now.hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (now.hard, now.hard))
        except (ValueError, OSError):  # a seccomp filter, a limit above fs.nr_open
            return now
        return Limits(now.hard, now.hard)
    return now


def launcher_need(remote_hosts: int, local_instances: int, output_files: int = 0) -> int:
    """Descriptors the launcher holds at once: its own, a connection per remote host, each
    local instance's, and `output_files` instances' files (--output-filename)."""
    return (LAUNCHER_BASE + PER_CONNECTION * remote_hosts + PER_INSTANCE * local_instances
            + PER_OUTPUT_FILES * output_files)


def agent_need(instances: int) -> int:
    """Descriptors an agent running `instances` holds at once."""
    return AGENT_BASE + PER_INSTANCE * instances


def shortfall(need: int, limit: int) -> bool:
    """True when `need` descriptors cannot be open under `limit`."""
    return limit != resource.RLIM_INFINITY and need > limit
