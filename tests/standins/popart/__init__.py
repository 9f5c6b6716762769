"""A stand-in for PopART, for testing popdist.popart and popdist's backend as PopART uses
them (PopART comes only with the Poplar SDK). Written from PopART's public source
(graphcore/popart, SDK 3.x): the session options popdist sets (popart_core's SessionOptions,
whose pybind11 class takes no attribute it does not declare), DeviceManager's
`acquireDeviceById(id, pattern, connectionType)` (popart.cpp), and, from
python/popart/session.py and python/popart/_popdist_backend_manager.py, what a session does
when its options ask for distributed replicated graphs: once per process, unless
`popdist.isBackendInitialized()`, it calls `popdist.init()` itself (with a deprecation
warning from a session built from a model). `calls` records what was asked of popdist.
"""

import enum
import threading

__all__ = ["DeviceConnectionType", "DeviceManager", "InferenceSession", "SessionOptions",
           "TrainingSession", "getLogger"]


class DeviceConnectionType(enum.Enum):
    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.Enum):
    Full = 0


class SessionOptions:
    __slots__ = ("enableReplicatedGraphs", "replicatedGraphCount",
                 "enableDistributedReplicatedGraphs", "globalReplicationFactor",
                 "globalReplicaOffset", "enableEngineCaching", "cachePath")

    def __init__(self):  # PopART's defaults for the fields popdist sets
        self.enableReplicatedGraphs, self.replicatedGraphCount = False, 1
        self.enableDistributedReplicatedGraphs = False
        self.globalReplicationFactor, self.globalReplicaOffset = 1, 0
        self.enableEngineCaching, self.cachePath = False, "session_cache"


class DeviceInfo:
    def __init__(self, id, connectionType):
        self.id, self.connectionType = id, connectionType


class DeviceManager:
    taken = set()  # ids of devices another process holds

    def acquireDeviceById(self, id, pattern=SyncPattern.Full,
                          connectionType=DeviceConnectionType.Always):
        return None if id in DeviceManager.taken else DeviceInfo(id, connectionType)


class _Logger:
    def __init__(self):
        self.warnings = []

    def warn(self, message):
        self.warnings.append(message)


_LOGGER = _Logger()


def getLogger():
    return _LOGGER


# python/popart/_popdist_backend_manager.py
_LOCK = threading.Lock()
_REGISTERED = False
calls = []  # what the sessions asked of popdist, in order


def _popdist_backend_init(print_deprecation=False):
    global _REGISTERED
    import popdist

    with _LOCK:
        if _REGISTERED:
            return
        calls.append("isBackendInitialized")
        if not popdist.isBackendInitialized():
            if print_deprecation:
                getLogger().warn("Deprecation warning: Detected running a multi-instance "
                                 "PopART application. Automatically initialising the default "
                                 "PopDist backend ...")
            calls.append("init")
            popdist.init()
        _REGISTERED = True


class _Session:
    def __init__(self, fnModel, dataFlow, deviceInfo, userOptions=None, **kwargs):
        self.options = userOptions or SessionOptions()
        if self.options.enableDistributedReplicatedGraphs:
            _popdist_backend_init(print_deprecation=True)
        self.deviceInfo = deviceInfo


class InferenceSession(_Session):
    pass


class TrainingSession(_Session):
    pass
