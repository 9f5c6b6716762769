"""popdist: what a poprun instance needs to know about itself (Graphcore-compatible API)."""

from popdist.popdist_core import (
    checkNumIpusPerReplica,
    execute_on_instances,
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
    isPopdistEnvSet,
    isUniformReplicasPerInstance,
)

__all__ = [
    "checkNumIpusPerReplica",
    "execute_on_instances",
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
    "isPopdistEnvSet",
    "isUniformReplicasPerInstance",
]
