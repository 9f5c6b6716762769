"""Say who this instance is, from popdist (works with and without poprun).

    poprun --num-instances 2 --num-replicas 4 --offline-mode=yes python3 examples/hello.py
"""

import socket

import popdist


def identity() -> str:
    first = popdist.getReplicaIndexOffset()
    last = first + popdist.getNumLocalReplicas() - 1
    return (
        f"hello from instance {popdist.getInstanceIndex()} of {popdist.getNumInstances()} "
        f"(local index {popdist.getLocalInstanceIndex()}) on {socket.gethostname()}: "
        f"replicas {first}..{last} of {popdist.getNumTotalReplicas()}, "
        f"{popdist.getNumIpusPerReplica()} IPU(s) per replica, "
        f"launched by poprun: {'yes' if popdist.isPopdistEnvSet() else 'no'}"
    )


if __name__ == "__main__":
    popdist.init()
    print(identity(), flush=True)
