"""TensorFlow (IPU) adapter: `set_ipu_config` for an instance launched by poprun.

    import popdist.tensorflow
    from tensorflow.python import ipu
    config = popdist.tensorflow.set_ipu_config(ipu.config.IPUConfig(), ipus_per_replica=1)
    config.configure_ipu_system()

Needs Graphcore's TensorFlow build (the one with `tensorflow.python.ipu`, from the Poplar SDK);
without it, importing this module raises an ImportError that says so.
"""

from __future__ import annotations

from typing import TypeVar

from popdist import popdist_core
from popdist._frameworks import import_framework

_INSTALL = "install Graphcore's TensorFlow wheel from the Poplar SDK (tensorflow-*+gc*.whl)"
ipu_config = import_framework("tensorflow.python.ipu.config", "popdist.tensorflow", _INSTALL)
ipu_utils = import_framework("tensorflow.python.ipu.utils", "popdist.tensorflow", _INSTALL)

__all__ = ["set_ipu_config"]

C = TypeVar("C")


def set_ipu_config(config: C, ipus_per_replica: int | None = None,
                   configure_device: bool = True) -> C:
    """Set PopDist's options on `config` and return it.

    `config` is an `IPUConfig`, or the deprecated `IpuOptions` protobuf from
    `create_ipu_config()`. The process count and index tell TensorFlow how the replicas are
    split between instances; with `configure_device`, the config also selects this
    instance's device (`popdist.getDeviceId(ipus_per_replica)`).
    """
    count, index = popdist_core.getNumInstances(), popdist_core.getInstanceIndex()
    device = [popdist_core.getDeviceId(ipus_per_replica)] if configure_device else None
    if isinstance(config, ipu_config.IPUConfig):
        distribution = config.experimental.multi_replica_distribution
        distribution.process_count = count
        distribution.process_index = index
        if device is not None:
            config.select_ipus = device
        return config
    # The deprecated protobuf is changed through the utils functions, which return it.
    config = ipu_utils.set_experimental_multi_replica_distribution_options(
        config, process_count=count, process_index=index)
    if device is not None:
        config = ipu_utils.select_ipus(config, device)
    return config
