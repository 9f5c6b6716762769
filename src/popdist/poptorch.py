"""PopTorch adapter: `popdist.poptorch.Options`, a `poptorch.Options` configured by poprun.

    import popdist.poptorch
    opts = popdist.poptorch.Options(ipus_per_replica=4)   # instead of poptorch.Options()
    opts.deviceIterations(100)                            # everything else works as before

The replication factor (this instance's replicas), the process id and count (PopTorch's
distributed options), the executable cache and the device come from poprun. The device is
the one spanning this instance's replicas (`popdist.getDeviceId(ipus_per_replica)`, each
replica `ipus_per_replica` IPUs, checked against poprun's --ipus-per-replica); where nothing
says which device (offline mode, outside poprun) none is chosen and PopTorch decides, as
Graphcore's popdist does since SDK 2.1 ("offline mode with PopTorch without attaching to
device"). Changing these afterwards would make this instance disagree with the others, so
those setters raise RuntimeError, as Graphcore's popdist does (PopTorch's
tests/popdist_test.py). PopTorch ships with the Poplar SDK; without it, importing this
module raises an ImportError that says so.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NoReturn

from popdist import env, popdist_core
from popdist._frameworks import import_framework

poptorch = import_framework(
    "poptorch", "popdist.poptorch",
    "install the PopTorch wheel from the Poplar SDK (pip install <sdk>/poptorch-*.whl)")

__all__ = ["Options"]

# `Options.Distributed` setters whose values poprun decides (the two on Options itself are
# overridden below).
_LOCKED_DISTRIBUTED = ("disable", "setEnvVarNames", "configureProcessId")


def _refuse(name: str) -> NoReturn:
    raise RuntimeError(f"Cannot call `{name}` with popdist.poptorch.Options")


class Options(poptorch.Options):
    """`poptorch.Options` for an instance launched by poprun (Graphcore-compatible).

    It adds no attribute of its own: PopTorch's `OptionsDict.__setattr__` (2.4 and later)
    refuses a private attribute added after its `_values`, and any public one that is not
    an option. The locks are methods of this class, and of the class the `Distributed`
    options are given (an object's `__class__` is the one attribute PopTorch lets change,
    for this: its options_test.py's test_wrap_options)."""

    def __init__(self, ipus_per_replica: int | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        base = poptorch.Options
        base.replicationFactor(self, popdist_core.getNumLocalReplicas())
        self.Distributed.configureProcessId(popdist_core.getInstanceIndex(),
                                            popdist_core.getNumInstances())
        cache = popdist_core.getExecutableCachePath()
        if cache is not None:
            self.enableExecutableCaching(cache)
        device = _device_of_this_instance(ipus_per_replica)
        if device is not None:
            base.useIpuId(self, device)
        distributed = self.Distributed
        distributed.__class__ = _locked(type(distributed))

    def useIpuId(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse("useIpuId")

    def replicationFactor(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse("replicationFactor")


def _device_of_this_instance(ipus_per_replica: int | None) -> int | None:
    """The device spanning this instance's replicas, when poprun says which; None outside
    poprun (PopTorch's own popdist_test builds Options(ipus_per_replica=2) there) and where
    there is no partition (offline mode): PopTorch then chooses."""
    if not popdist_core.isPopdistEnvSet():
        return None
    ipus = popdist_core.checked_ipus_per_replica(ipus_per_replica, "popdist.poptorch.Options")
    if env.read_str(os.environ, env.NODE_DEVICE_ID) is None:
        return None
    return popdist_core.getDeviceId(ipus)


@functools.cache
def _locked(distributed: type) -> type:
    """`distributed` (PopTorch's `_DistributedOptions`) with the setters poprun owns refused;
    reading `processId`, `numProcesses` and the option values works as before."""
    def refusing(name: str):
        def method(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
            _refuse(f"Distributed.{name}")
        method.__name__ = name
        return method

    return type(distributed.__name__, (distributed,),
                {"__module__": __name__, "__qualname__": distributed.__qualname__,
                 **{name: refusing(name) for name in _LOCKED_DISTRIBUTED}})
