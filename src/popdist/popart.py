"""PopART adapter: session options and the device for an instance launched by poprun.

    import popdist.popart
    opts = popart.SessionOptions()
    popdist.popart.configureSessionOptions(opts)
    device = popdist.popart.getDevice(ipusPerReplica=1)

PopART ships with the Poplar SDK; without it, importing this module raises an ImportError
that says so.
"""

from __future__ import annotations

from typing import Any

from popdist import popdist_core
from popdist._frameworks import import_framework

popart = import_framework(
    "popart", "popdist.popart",
    "install the Poplar SDK and source its enable.sh (PopART comes with it)")

__all__ = ["configureSessionOptions", "getDevice"]


def configureSessionOptions(opts: Any) -> None:
    """Set the replication and executable-cache fields of a `popart.SessionOptions`."""
    # This instance replicates its local share; PopART stitches the instances' replicas into
    # one distributed replicated graph of the total size, starting at this one's offset.
    opts.enableReplicatedGraphs = True
    opts.replicatedGraphCount = popdist_core.getNumLocalReplicas()
    opts.enableDistributedReplicatedGraphs = True
    opts.globalReplicationFactor = popdist_core.getNumTotalReplicas()
    opts.globalReplicaOffset = popdist_core.getReplicaIndexOffset()
    cache = popdist_core.getExecutableCachePath()
    if cache is not None:
        opts.enableEngineCaching = True
        opts.cachePath = cache


def getDevice(ipusPerReplica: int | None = None, connectionType: Any = None) -> Any:
    """Attach to this instance's device (`popdist.getDeviceId`) and return its DeviceInfo."""
    device_id = popdist_core.getDeviceId(ipusPerReplica)
    options = {} if connectionType is None else {"connectionType": connectionType}
    device = popart.DeviceManager().acquireDeviceById(device_id, **options)
    if device is None:
        # PopART returns None rather than raising when the device is taken.
        raise RuntimeError(f"popdist.popart.getDevice(): could not attach to IPU device "
                           f"{device_id} (is another process using it?)")
    return device
