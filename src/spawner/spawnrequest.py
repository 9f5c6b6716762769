"""The fields of a SPAWN frame (spawner/protocol.py): one instance to start on an agent's
host. Apart from the framing, so that what only frames (the PMIx server's process:
spawner/worlds/pmixproc.py) starts without dataclasses and the containers' module; protocol.py
still names it (`from spawner.protocol import SpawnRequest`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .containers import Container


@dataclass(frozen=True)
class SpawnRequest:
    """The fields of a SPAWN frame: one instance to start on the agent's host."""

    key: int  # the launcher's name for the instance (its index)
    argv: tuple[str, ...]
    env_set: Mapping[str, str] = field(default_factory=dict)  # over the agent's environment
    env_unset: tuple[str, ...] = ()  # removed from it (before env_set is applied)
    cwd: str | None = None
    merge_stderr: bool = False
    cpus: tuple[int, ...] | None = None  # CPU binding there (None: not bound)
    mems: tuple[int, ...] | None = None  # memory node binding there (None: not bound)
    world: str | None = None  # the kvsname of the MPI world it joins (a WORLD frame's)
    rank: int | None = None  # its rank in `world` (None: `key`, as for the instances)
    container: Container | None = None  # run inside it (spawner/containers.py)

    def to_fields(self) -> dict[str, Any]:
        return {"key": self.key, "argv": list(self.argv), "env_set": dict(self.env_set),
                "env_unset": list(self.env_unset), "cwd": self.cwd,
                "merge_stderr": self.merge_stderr,
                "cpus": _list_or_none(self.cpus), "mems": _list_or_none(self.mems),
                "world": self.world, "rank": self.rank,
                "container": None if self.container is None else self.container.to_fields()}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> SpawnRequest:
        """Raises KeyError/TypeError/ValueError for a malformed request."""
        argv = tuple(fields["argv"])
        env_set = dict(fields.get("env_set") or {})
        env_unset = tuple(fields.get("env_unset") or ())
        strings = (*argv, *env_set, *env_set.values(), *env_unset)
        if not argv or not all(isinstance(s, str) for s in strings):
            raise TypeError("argv and environment must be non-empty lists/maps of strings")
        return cls(key=int(fields["key"]), argv=argv, env_set=env_set, env_unset=env_unset,
                   cwd=fields.get("cwd"), merge_stderr=bool(fields.get("merge_stderr")),
                   cpus=_ints_or_none(fields.get("cpus")), mems=_ints_or_none(fields.get("mems")),
                   world=fields.get("world"),
                   rank=None if fields.get("rank") is None else int(fields["rank"]),
                   container=Container.from_fields(fields.get("container")))


def _list_or_none(values: tuple[int, ...] | None) -> list[int] | None:
    return None if values is None else list(values)


def _ints_or_none(values: Any) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)
