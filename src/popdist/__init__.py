"""popdist: what a poprun instance needs to know about itself (Graphcore-compatible API)."""

from popdist._stacks import install as _install_stacks
from popdist.autoreport import apply_to_environment as _apply_autoreport
from popdist.autoreport import setEngineOptions
from popdist.errorfile import install as _install_error_hook
from popdist.errorfile import record
from popdist._progress import progress
from popdist.popdist_core import (
    checkNumIpusPerReplica,
    execute_on_instances,
    finalizeBackend,
    getDeviceId,
    getExecutableCachePath,
    getInstanceIndex,
    getLocalInstanceIndex,
    getNumInstances,
    getNumIpusPerReplica,
    getNumLocalReplicas,
    getNumTotalReplicas,
    getReplicaIndexOffset,
    init,
    isBackendInitialized,
    isPopdistEnvSet,
    isUniformReplicasPerInstance,
)

__all__ = [
    "checkNumIpusPerReplica",
    "execute_on_instances",
    "finalizeBackend",
    "getDeviceId",
    "getExecutableCachePath",
    "getInstanceIndex",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getNumIpusPerReplica",
    "getNumLocalReplicas",
    "getNumTotalReplicas",
    "getReplicaIndexOffset",
    "init",
    "isBackendInitialized",
    "isPopdistEnvSet",
    "isUniformReplicasPerInstance",
    "progress",
    "record",
    "setEngineOptions",
]

# Poplar reads POPLAR_ENGINE_OPTIONS when an engine is made, and an application may never call
# popdist.init(): so the per-instance profiling directory is set as soon as popdist is imported
# (only under `poprun --autoreport-dir`; idempotent).
_apply_autoreport()
# Under poprun, an uncaught exception is also written where poprun reads it (errorfile.py).
_install_error_hook()
# Under poprun, the stacks of every thread on poprun's signal (`poprunctl stacks`: _stacks.py).
_install_stacks()
