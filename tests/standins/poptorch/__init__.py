"""A stand-in for PopTorch's options, for testing popdist.poptorch (PopTorch comes only with
the Poplar SDK). Written from PopTorch's public source (graphcore/poptorch, SDK 3.x):
python/_options_impl.py (OptionsDict) and python/options.py (_DistributedOptions,
_PopartOptions, _TrainingOptions, Options). Only what the tests use is here, but the rules
an options object keeps are PopTorch's, since popdist.poptorch must live within them:

- `OptionsDict.__setattr__` (PopTorch 2.4 and later): a private attribute may be added only
  before `_values` is set in `__init__` ("Invalid private attribute ..."), a public one must
  be a declared option (set through `set`, which asserts it exists and has the option's
  type); `__class__` may be changed (`_hasattr` says it exists: PopTorch's options_test.py
  test_wrap_options, "Popdist wraps poptorch Options using something similar").
- Options are frozen once used (`_freeze`): every change then raises
  AttributeError("Can't modify frozen Options"); `__deepcopy__` gives an unfrozen copy.
- `Options.__init__` reads POPTORCH_CACHE_DIR (executable caching there), and the
  distributed options read OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK.
"""

import copy
import os

__all__ = ["Options"]


class OptionsDict:
    """PopTorch's `_options_impl.OptionsDict`: only keys passed to the constructor can be
    set later."""

    def __init__(self, **default_values):
        self._warnings = {}
        self._is_frozen = False
        self._values = default_values  # the last attribute set here (see __setattr__)

    def set(self, **kwargs):
        self.checkIsFrozen()
        for option, value in kwargs.items():
            assert self.exists(option), f"Invalid option {option}"
            assert isinstance(value, type(self._values[option])), \
                f"Unexpected type {type(value)} for option {option}"
            self._values[option] = value

    def createOrSet(self, **kwargs):
        self.checkIsFrozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value

    def exists(self, option):
        return option in self._values

    def _hasattr(self, option):
        if option == "__class__":
            return True
        if option.startswith("_"):
            return option in self.__dict__
        return self.exists(option)

    def _changeFreezeState(self, new_state):
        self._is_frozen = new_state
        for value in self.__dict__.values():
            if hasattr(value, "_is_frozen"):
                value._is_frozen = new_state

    def _freeze(self):
        self._changeFreezeState(True)

    def _unfreeze(self):
        self._changeFreezeState(False)

    def checkIsFrozen(self, option=None):
        if self._hasattr("_is_frozen") and option != "_is_frozen" and self._is_frozen:
            raise AttributeError("Can't modify frozen Options")

    def __deepcopy__(self, memory):
        copied = self.__class__.__new__(self.__class__)
        memory[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, False if key == "_is_frozen" else copy.deepcopy(value, memory))
        return copied

    def __setattr__(self, option, value):
        self.checkIsFrozen(option)
        if option.startswith("_"):
            if self._hasattr("_values") and not self._hasattr(option):
                raise AttributeError(f"Invalid private attribute {option}. "
                                     f"Valid attributes: {list(self.__dict__)}")
            super().__setattr__(option, value)
        else:
            self.set(**{option: value})

    def __getattr__(self, option):
        if not self._hasattr(option):
            raise AttributeError(f"Invalid attribute {option}.")
        if option.startswith("_"):
            return self.__dict__[option]
        return self._values[option]

    def update(self, other):
        assert not set(self._values).intersection(other), "keys in common"
        other.update(self._values)
        return other

    def toDict(self):
        return self.update({})


class _PopartOptions:
    """PopTorch's `_PopartOptions`: a plain dictionary of PopART session options."""

    def __init__(self):
        self._is_frozen = False
        self.options = {}

    def checkIsFrozen(self):
        if self._is_frozen:
            raise AttributeError("Can't modify frozen Options")

    def set(self, key, value):
        self.checkIsFrozen()
        self.options[key] = value
        return self


class _DistributedOptions(OptionsDict):
    def __init__(self):
        self._gcd_mappings = {}
        super().__init__(num_distributed_processes=1, distributed_process_id=0,
                         ipuof_configs={})
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def disable(self):
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes, var_process_id):
        return self.configureProcessId(int(os.environ.get(var_process_id, "0")),
                                       int(os.environ.get(var_num_processes, "1")))

    def configureProcessId(self, process_id, num_processes):
        self.set(distributed_process_id=process_id)
        self.set(num_distributed_processes=num_processes)
        return self

    @property
    def processId(self):
        return self.distributed_process_id

    @property
    def numProcesses(self):
        return self.num_distributed_processes


class _TrainingOptions(OptionsDict):
    def __init__(self, popart_options):
        self._popart_options = popart_options
        super().__init__(gradient_accumulation=1)

    def gradientAccumulation(self, gradient_accumulation):
        self.set(gradient_accumulation=gradient_accumulation)
        return self


class Options(OptionsDict):
    def __init__(self):
        self._popart = _PopartOptions()
        self._training = _TrainingOptions(self._popart)
        self._distributed = _DistributedOptions()
        super().__init__(replication_factor=1, device_iterations=1,
                         auto_round_num_ipus=False)
        path = os.environ.get("POPTORCH_CACHE_DIR", "")
        if path:
            self.enableExecutableCaching(path)

    @property
    def Distributed(self):
        return self._distributed

    @property
    def Training(self):
        return self._training

    @property
    def _Popart(self):
        return self._popart

    def replicationFactor(self, replication_factor):
        self.set(replication_factor=replication_factor)
        return self

    def deviceIterations(self, device_iterations):
        self.set(device_iterations=device_iterations)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus=True):
        self.set(auto_round_num_ipus=auto_round_num_ipus)
        return self

    def randomSeed(self, random_seed):
        assert isinstance(random_seed, int)
        self.createOrSet(random_seed=random_seed)
        return self

    def useIpuId(self, ipu_id):
        assert isinstance(ipu_id, int)
        self.createOrSet(ipu_id=ipu_id)
        return self

    def enableExecutableCaching(self, path):
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    def toDict(self):
        out = dict(self._popart.options)
        out = self.update(out)
        out = self._training.update(out)
        return self._distributed.update(out)
