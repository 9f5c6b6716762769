"""PopDist core API: what an instance learns about itself from the environment poprun set.

Names follow Graphcore's `popdist.popdist_core` so existing applications run unchanged.
Every function reads `os.environ` when called (not at import), so tests and launchers can
change the environment after `import popdist`. Outside poprun the documented defaults apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from popdist import devices, env

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
    "isBackendInitialized",
    "finalizeBackend",
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
    """The id of the Poplar device this instance's replicas run on: the one spanning its
    replicas' IPUs (local replicas x IPUs per replica), in Poplar's numbering of the IPUs
    it sees (popdist/devices.py). Computed from POPDIST_NODE_DEVICE_ID, which poprun sets
    when the job runs on a reconfigurable V-IPU partition: the device spanning the job's IPUs
    (its GCD's, with one GCD per instance), the whole partition or, on a larger one, a part
    of it; on any other partition the instance is given its GCD (IPUOF_VIPU_API_GCD_ID) and
    no node device, and its device is the whole GCD. Raises RuntimeError where nothing says
    which device (offline mode, outside poprun)."""
    ipus = checked_ipus_per_replica(ipus_per_replica, "getDeviceId")
    node = env.read_str(os.environ, env.NODE_DEVICE_ID)
    gcd = env.read_str(os.environ, env.VIPU_API_GCD_ID)
    if node is None and gcd is not None:
        return _whole_gcd(getNumLocalReplicas() * ipus)
    if node is None:
        raise RuntimeError(
            f"popdist.getDeviceId(): no IPU device to select: {env.NODE_DEVICE_ID} is not "
            f"set, nor {env.VIPU_API_GCD_ID} (poprun sets one for a job on a V-IPU "
            "partition, not with --offline-mode nor outside poprun). To compile without a "
            "device, do not select one: with TensorFlow, call popdist.tensorflow.set_ipu_config(config, ipus_per_replica, "
            "configure_device=False)")
    try:
        mine = getNumLocalReplicas() * ipus
        offset = getReplicaIndexOffset() * ipus
        if gcd is None:  # the node device spans every instance's replicas
            spanned = getNumTotalReplicas() * ipus
        else:  # its own GCD, numbered on its own: the node device spans this instance's
            spanned, offset = mine, offset - int(gcd) * mine
        return devices.child_device(int(node), spanned, mine, offset)
    except ValueError as error:
        raise RuntimeError(f"popdist.getDeviceId(): {env.NODE_DEVICE_ID}={node}: {error}") \
            from None


def _whole_gcd(ipus: int) -> int:
    """The device of an instance that drives a GCD of its own and was given no node device
    (a partition that is not reconfigurable, plan/partition.py's `Attachment`): all the IPUs
    it sees, its replicas'."""
    try:
        return devices.device_id(ipus, ipus, 0)
    except ValueError as error:
        raise RuntimeError(f"popdist.getDeviceId(): the GCD {env.VIPU_API_GCD_ID} names: "
                           f"{error}") from None


def checked_ipus_per_replica(asked: int | None, caller: str) -> int:
    """IPUs per replica: the caller's, checked against poprun's when poprun set it."""
    if asked is None:
        return getNumIpusPerReplica()
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise ValueError(f"{caller}: ipus_per_replica must be a positive integer, got {asked!r}")
    # Only a value poprun actually set can contradict the caller; the default of 1
    # outside poprun says nothing about the device the application wants.
    if os.environ.get(env.NUM_IPUS_PER_REPLICA) and not checkNumIpusPerReplica(asked):
        raise ValueError(
            f"{caller}(ipus_per_replica={asked}) does not match the {getNumIpusPerReplica()} "
            f"IPUs per replica poprun was started with ({env.NUM_IPUS_PER_REPLICA})")
    return asked


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
    """Check the environment poprun set and initialise the backend: join the job's MPI
    world, where poprun serves one (popdist/backend.py); a no-op outside poprun. Safe to
    call repeatedly."""
    # Validating again is cheap and keeps it idempotent even when the environment changes
    # between calls (as it does in tests); joining the world happens once.
    if not any(os.environ.get(name) for name in _CONTRACT):
        return None
    _check_environment()
    from popdist import backend

    backend.initialize()
    return None


def isBackendInitialized() -> bool:
    """Whether this instance's host-side collectives backend is up: it joined the job's MPI
    world (popdist.init()) and has not left it (popdist.finalizeBackend())."""
    from popdist import backend

    return backend.initialized()


def finalizeBackend() -> None:
    """Leave the job's MPI world (done at exit otherwise); a no-op when not in it."""
    from popdist import backend

    backend.finalize()


def _check_environment() -> None:
    """The contract's variables are there and agree with each other, else RuntimeError."""
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
