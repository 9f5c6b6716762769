"""Print, as one JSON line, what popdist tells this instance and the variables poprun set.

    poprun --num-instances 2 --num-replicas 2 --offline-mode=yes python3 examples/popdist_env.py
"""

import json
import os

import popdist

# The poprun variables worth seeing besides POPDIST_*: what torch.distributed and PopTorch read.
_OTHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def report() -> dict:
    api = {name: getattr(popdist, name)() for name in (
        "isPopdistEnvSet", "getInstanceIndex", "getNumInstances", "getLocalInstanceIndex",
        "getNumTotalReplicas", "getNumLocalReplicas", "getReplicaIndexOffset",
        "getNumIpusPerReplica", "isUniformReplicasPerInstance", "getExecutableCachePath")}
    environ = {name: value for name, value in sorted(os.environ.items())
               if name.startswith(("POPDIST_", "OMPI_COMM_WORLD_", "IPUOF_")) or name in _OTHERS}
    return {"popdist": api, "environ": environ}


if __name__ == "__main__":
    popdist.init()
    print(json.dumps(report(), sort_keys=True), flush=True)
