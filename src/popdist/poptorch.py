"""PopTorch adapter: `popdist.poptorch.Options`, a `poptorch.Options` configured by poprun.

    import popdist.poptorch
    opts = popdist.poptorch.Options()      # instead of poptorch.Options()
    opts.deviceIterations(100)             # everything else works as before

The replication factor (this instance's replicas), the process id and count (PopTorch's
distributed options) and the executable cache come from poprun. Changing them afterwards
would make this instance disagree with the others, so those setters raise RuntimeError,
as Graphcore's popdist does. PopTorch ships with the Poplar SDK; without it, importing this
module raises an ImportError that says so.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

from popdist import popdist_core
from popdist._frameworks import import_framework

poptorch = import_framework(
    "poptorch", "popdist.poptorch",
    "install the PopTorch wheel from the Poplar SDK (pip install <sdk>/poptorch-*.whl)")

__all__ = ["Options"]

# `Options.Distributed` setters whose values poprun decides (the two on Options itself are
# overridden below).
_LOCKED_DISTRIBUTED = ("disable", "setEnvVarNames", "configureProcessId")


def _refuse(name: str, *args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError(f"Cannot call `{name}` with popdist.poptorch.Options")


class _LockedDistributed:
    """`poptorch.Options.Distributed` with the setters that poprun owns disabled.

    Everything else (reading `processId`, `numProcesses`, the option values) goes to the
    real object, so PopTorch itself sees the configured options unchanged.
    """

    def __init__(self, distributed: Any) -> None:
        object.__setattr__(self, "_distributed", distributed)

    def __getattr__(self, name: str) -> Any:
        if name in _LOCKED_DISTRIBUTED:
            # Refuse the call, not the lookup: `hasattr` and introspection keep working.
            return functools.partial(_refuse, f"Distributed.{name}")
        return getattr(self._distributed, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._distributed, name, value)


class Options(poptorch.Options):
    """`poptorch.Options` for an instance launched by poprun (Graphcore-compatible)."""

    _popdist_locked = False  # the class default: setters are free while the base class builds

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        super().replicationFactor(popdist_core.getNumLocalReplicas())
        super().Distributed.configureProcessId(popdist_core.getInstanceIndex(),
                                               popdist_core.getNumInstances())
        cache = popdist_core.getExecutableCachePath()
        if cache is not None:
            self.enableExecutableCaching(cache)
        self._popdist_locked = True

    @property
    def Distributed(self) -> Any:
        distributed = super().Distributed
        return _LockedDistributed(distributed) if self._popdist_locked else distributed

    def useIpuId(self, *args: Any, **kwargs: Any) -> Any:
        return self._unless_locked("useIpuId", args, kwargs)

    def replicationFactor(self, *args: Any, **kwargs: Any) -> Any:
        return self._unless_locked("replicationFactor", args, kwargs)

    def _unless_locked(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self._popdist_locked:
            _refuse(name)
        return getattr(super(), name)(*args, **kwargs)
