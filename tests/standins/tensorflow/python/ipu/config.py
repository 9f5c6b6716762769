"""Stand-in for `tensorflow.python.ipu.config` (Graphcore's TensorFlow), written from its
public source (graphcore/tensorflow, tensorflow/python/ipu/config.py): the IPUConfig
attributes popdist sets (`select_ipus`, an int or a list of device ids as `gc-info -l` lists
them; `experimental.multi_replica_distribution.process_count/process_index`) and the rule of
its `_ConfigBase.__setattr__`: attributes are created only in an `__init__`; setting one
that does not exist raises ValueError("'name' is not a valid attribute of this config.").
"""

import inspect


class _ConfigBase:
    def __setattr__(self, name, value):
        caller = inspect.currentframe().f_back
        creating = caller.f_code.co_name == "__init__" and caller.f_locals.get("self") is self
        if name not in self.__dict__ and not creating:
            raise ValueError(f"'{name}' is not a valid attribute of this config. ")
        super().__setattr__(name, value)


class _MultiReplicaDistributionConfig(_ConfigBase):
    def __init__(self):
        self.process_index = 0
        self.process_count = 0  # 0: multi-replica distribution is not used


class _ExperimentalConfig(_ConfigBase):
    def __init__(self):
        self.multi_replica_distribution = _MultiReplicaDistributionConfig()


class IPUConfig(_ConfigBase):
    def __init__(self):
        self.auto_select_ipus = []
        self.select_ipus = []
        self.experimental = _ExperimentalConfig()
