"""PopDist core API: what an instance learns about itself from the environment poprun set.

Names follow Graphcore's `popdist.popdist_core` so existing applications run unchanged.
Every function reads `os.environ` when called (not at import), so tests and launchers can
change the environment after `import popdist`. Outside poprun the documented defaults apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from popdist import env

__all__ = [
    "isPopdistEnvSet",
    "getNumTotalReplicas",
    "getNumLocalReplicas",
    "getNumIpusPerReplica",
    "getReplicaIndexOffset",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getInstanceIndex",
    "isUniformReplicasPerInstance",
    "checkNumIpusPerReplica",
    "getExecutableCachePath",
    "getDeviceId",
    "init",
    "execute_on_instances",
]

T = TypeVar("T")

# The variables poprun always sets; their presence is what "inside poprun" means.
_CONTRACT = (
    env.NUM_TOTAL_REPLICAS,
    env.NUM_IPUS_PER_REPLICA,
    env.NUM_LOCAL_REPLICAS,
    env.REPLICA_INDEX_OFFSET,
)


def _read_count(name: str, default: int, minimum: int) -> int:
    # A count below its minimum (e.g. 0 local replicas) is as unusable as "abc": fall back
    # to the default rather than let a later division or index computation blow up.
    value = env.read_int(os.environ, name, default)
    return value if value >= minimum else default


def isPopdistEnvSet() -> bool:
    """True when poprun's contract variables are all present in the environment."""
    return all(os.environ.get(name) for name in _CONTRACT)


def getNumTotalReplicas() -> int:
    """Total number of replicas across all instances (1 outside poprun)."""
    return _read_count(env.NUM_TOTAL_REPLICAS, 1, 1)


def getNumLocalReplicas() -> int:
    """Number of replicas run by this instance (1 outside poprun)."""
    return _read_count(env.NUM_LOCAL_REPLICAS, 1, 1)


def getNumIpusPerReplica() -> int:
    """Number of IPUs per replica (1 when it cannot be inferred)."""
    return _read_count(env.NUM_IPUS_PER_REPLICA, 1, 1)


def getReplicaIndexOffset() -> int:
    """Index of this instance's first replica (0 outside poprun)."""
    return _read_count(env.REPLICA_INDEX_OFFSET, 0, 0)


def getLocalInstanceIndex() -> int:
    """Index of this instance among the instances on its host (0 outside poprun)."""
    return _read_count(env.LOCAL_INSTANCE_INDEX, 0, 0)


def isUniformReplicasPerInstance() -> bool:
    """True when every instance runs the same number of replicas, or when no env is set."""
    value = env.read_str(os.environ, env.UNIFORM_REPLICAS_PER_INSTANCE)
    if value is None:
        return True
    return value.strip() == "1"


def _require_uniform(what: str) -> None:
    if not isUniformReplicasPerInstance():
        raise RuntimeError(
            f"{what} can only be used with a uniform number of replicas per instance, "
            f"but {env.UNIFORM_REPLICAS_PER_INSTANCE} is "
            f"{os.environ.get(env.UNIFORM_REPLICAS_PER_INSTANCE)!r}"
        )


def getNumInstances() -> int:
    """Total number of instances (= total replicas / local replicas); uniform runs only."""
    _require_uniform("getNumInstances()")
    return getNumTotalReplicas() // getNumLocalReplicas()


def getInstanceIndex() -> int:
    """Index of this instance in [0, getNumInstances()); uniform runs only."""
    _require_uniform("getInstanceIndex()")
    return getReplicaIndexOffset() // getNumLocalReplicas()


def checkNumIpusPerReplica(expected: int) -> bool:
    """True when the IPUs per replica in force (env value, else the inferred 1) equal `expected`."""
    # As the guide says: a set variable must match; when unset the inferred number (1) is
    # what gets compared, so asking for more than 1 IPU outside poprun reports a mismatch.
    return getNumIpusPerReplica() == expected


def getExecutableCachePath() -> str | None:
    """The executable cache directory poprun chose, or None outside poprun."""
    return env.read_str(os.environ, env.EXECUTABLE_CACHE_PATH)


def getDeviceId(ipus_per_replica: int | None = None) -> int:
    """The id of an IPU device suitable for this instance (needs the Poplar SDK)."""
    if ipus_per_replica is not None:
        if ipus_per_replica < 1:
            raise ValueError(f"ipus_per_replica must be at least 1, got {ipus_per_replica}")
        # Only a value poprun actually set can contradict the caller; the default of 1
        # outside poprun says nothing about the device the application wants.
        env_set = bool(os.environ.get(env.NUM_IPUS_PER_REPLICA))
        if env_set and not checkNumIpusPerReplica(ipus_per_replica):
            raise ValueError(
                f"getDeviceId(ipus_per_replica={ipus_per_replica}) does not match the "
                f"{getNumIpusPerReplica()} IPUs per replica poprun was started with "
                f"({env.NUM_IPUS_PER_REPLICA})"
            )
    try:
        import poplar  # noqa: F401  (only probing whether the SDK is installed)
    except ImportError:
        raise RuntimeError(
            "popdist.getDeviceId() needs the Poplar SDK (an IPU device) and the Poplar "
            "Python bindings are not importable here; offline mode and CPU runs should "
            "not call getDeviceId()"
        ) from None
    # Choosing a device means asking Poplar's device manager about the partition; this
    # re-implementation does not do that, and inventing an id would mislead the caller.
    raise RuntimeError(
        "popdist.getDeviceId(): device selection through Poplar is not implemented by this "
        "popdist; attach to the device with your framework (PopTorch/PopART) instead"
    )


def _parse_int(name: str, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        raise RuntimeError(f"popdist.init(): {name} is not set (was this started by poprun?)")
    try:
        value = int(raw)
    except ValueError:
        raise RuntimeError(f"popdist.init(): {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise RuntimeError(f"popdist.init(): {name}={value} must be at least {minimum}")
    return value


def init() -> None:
    """Check the environment poprun set; a no-op outside poprun. Safe to call repeatedly."""
    # Stateless on purpose: validating again is cheap and keeps it idempotent even when the
    # environment changes between calls (as it does in tests).
    if not any(os.environ.get(name) for name in _CONTRACT):
        return None
    total = _parse_int(env.NUM_TOTAL_REPLICAS, 1)
    _parse_int(env.NUM_IPUS_PER_REPLICA, 1)
    local = _parse_int(env.NUM_LOCAL_REPLICAS, 1)
    offset = _parse_int(env.REPLICA_INDEX_OFFSET, 0)
    if os.environ.get(env.LOCAL_INSTANCE_INDEX):
        _parse_int(env.LOCAL_INSTANCE_INDEX, 0)

    uniform = os.environ.get(env.UNIFORM_REPLICAS_PER_INSTANCE)
    if uniform and uniform.strip() not in ("0", "1"):
        raise RuntimeError(
            f"popdist.init(): {env.UNIFORM_REPLICAS_PER_INSTANCE}={uniform!r} must be 0 or 1"
        )
    if local > total:
        raise RuntimeError(
            f"popdist.init(): {env.NUM_LOCAL_REPLICAS}={local} exceeds "
            f"{env.NUM_TOTAL_REPLICAS}={total}"
        )
    if offset + local > total:
        raise RuntimeError(
            f"popdist.init(): replicas {offset}..{offset + local - 1} of this instance "
            f"({env.REPLICA_INDEX_OFFSET}={offset}, {env.NUM_LOCAL_REPLICAS}={local}) lie "
            f"outside the {total} total replicas"
        )
    if isUniformReplicasPerInstance():
        # The instance count and index are derived by division, so they must be exact.
        if total % local:
            raise RuntimeError(
                f"popdist.init(): {env.NUM_LOCAL_REPLICAS}={local} does not divide "
                f"{env.NUM_TOTAL_REPLICAS}={total}"
            )
        if offset % local:
            raise RuntimeError(
                f"popdist.init(): {env.REPLICA_INDEX_OFFSET}={offset} is not a multiple of "
                f"{env.NUM_LOCAL_REPLICAS}={local}"
            )
    return None


def execute_on_instances(
    instances: int | Iterable[int], func: Callable[..., T], *args: Any, **kwargs: Any
) -> T | None:
    """Call `func(*args, **kwargs)` only on the given instance index(es); None elsewhere.

    There is no cross-instance barrier (no MPI here): other instances do not wait for the
    call to finish, so synchronise through the framework if they depend on its effects.
    """
    chosen = {instances} if isinstance(instances, int) else set(instances)
    if getInstanceIndex() in chosen:
        return func(*args, **kwargs)
    return None
