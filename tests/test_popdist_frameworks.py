"""popdist's framework adapters: popdist.poptorch, popdist.popart, popdist.tensorflow (and how
every adapter, popdist.torch included, fails without its framework).

FAKES: PopTorch, PopART and Graphcore's TensorFlow come only with the Poplar SDK and cannot be
installed here, so the adapters are tested against small *fake* `poptorch`, `popart` and
`tensorflow` packages that this file writes to a temporary directory put first on sys.path.
They are stand-ins, not the frameworks: each implements only the documented API the adapter
uses (`poptorch.Options` and its `Distributed` options, `popart.SessionOptions` and
`DeviceManager.acquireDeviceById`, `tensorflow.python.ipu.config.IPUConfig` and the deprecated
`tensorflow.python.ipu.utils` functions) and records what was set, so the tests can check it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import popdist
from popdist import env, popdist_core

from conftest import SRC

FAKE_POPTORCH = '''
class _DistributedOptions:
    def __init__(self):
        self.processId, self.numProcesses = 0, 1
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")  # as PopTorch does

    def configureProcessId(self, process_id, num_processes):
        self.processId, self.numProcesses = process_id, num_processes
        return self

    def setEnvVarNames(self, var_num_processes, var_process_id):
        self.env_var_names = (var_num_processes, var_process_id)
        return self

    def disable(self):
        self.processId, self.numProcesses = 0, 1
        return self


class Options:
    def __init__(self):
        self._distributed = _DistributedOptions()
        self.replication_factor, self.device_iterations = 1, 1
        self.ipu_id, self.cache_path = None, None

    @property
    def Distributed(self):
        return self._distributed

    def replicationFactor(self, replication_factor):
        self.replication_factor = replication_factor
        return self

    def deviceIterations(self, device_iterations):
        self.device_iterations = device_iterations
        return self

    def useIpuId(self, ipu_id):
        self.ipu_id = ipu_id
        return self

    def enableExecutableCaching(self, path):
        self.cache_path = path
        return self
'''

FAKE_POPART = '''
import enum


class DeviceConnectionType(enum.Enum):
    Always = 0
    OnDemand = 1
    Never = 2


class SessionOptions:
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

    def acquireDeviceById(self, id, pattern=None, connectionType=DeviceConnectionType.Always):
        return None if id in DeviceManager.taken else DeviceInfo(id, connectionType)
'''

FAKE_TF_CONFIG = '''
class _MultiReplicaDistribution:
    def __init__(self):
        self.process_count, self.process_index = 0, 0


class _Experimental:
    def __init__(self):
        self.multi_replica_distribution = _MultiReplicaDistribution()


class IPUConfig:
    def __init__(self):
        self.experimental = _Experimental()
        self.select_ipus = []
'''

# The deprecated API returns a new IpuOptions from every call; a dict stands in for the
# protobuf, copied each time so that an adapter ignoring the return value gets caught.
FAKE_TF_UTILS = '''
def create_ipu_config():
    return {"device_config": [], "process_count": 0, "process_index": 0}


def select_ipus(opts, indices):
    return dict(opts, device_config=list(indices))


def set_experimental_multi_replica_distribution_options(opts, process_count, process_index):
    return dict(opts, process_count=process_count, process_index=process_index)
'''

FAKES = {
    "poptorch/__init__.py": FAKE_POPTORCH,
    "popart/__init__.py": FAKE_POPART,
    "tensorflow/__init__.py": "",
    "tensorflow/python/__init__.py": "",
    "tensorflow/python/ipu/__init__.py": "",
    "tensorflow/python/ipu/config.py": FAKE_TF_CONFIG,
    "tensorflow/python/ipu/utils.py": FAKE_TF_UTILS,
}
FRAMEWORKS = ("poptorch", "popart", "tensorflow")
ADAPTERS = ("poptorch", "popart", "tensorflow", "torch")
# Everything poprun sets that popdist reads; tests start from "outside poprun".
POPRUN_VARIABLES = tuple(env.instance_environment(env.InstanceIdentity(
    index=0, num_instances=1, local_index=0, local_size=1, num_total_replicas=1,
    ipus_per_replica=1, master_addr="x", master_port=1, executable_cache_path="x")))


def _is_ours(module: str) -> bool:
    top, _, rest = module.partition(".")
    return top in FRAMEWORKS or (top == "popdist" and rest in ADAPTERS)


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Each test imports the adapters afresh, against the frameworks it set up; afterwards the
    modules that were there before (a real torch, popdist.torch) are put back."""
    for name in POPRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    saved = {name: module for name, module in sys.modules.items() if _is_ours(name)}
    attributes = {name: popdist.__dict__.pop(name) for name in ADAPTERS if name in popdist.__dict__}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [name for name in sys.modules if _is_ours(name)]:
        del sys.modules[name]
    sys.modules.update(saved)
    for name in ADAPTERS:
        popdist.__dict__.pop(name, None)
    popdist.__dict__.update(attributes)


def write_packages(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """The fake frameworks, first on sys.path."""
    write_packages(tmp_path, FAKES)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def instance(monkeypatch):
    """Make this process look like instance `index` of a poprun job."""

    def become(index: int, num_instances: int, replicas: int, ipus_per_replica: int = 1,
               cache: str | None = "/tmp/poprun-cache-test") -> None:
        who = env.InstanceIdentity(
            index=index, num_instances=num_instances, local_index=index,
            local_size=num_instances, num_total_replicas=replicas,
            ipus_per_replica=ipus_per_replica, master_addr="127.0.0.1", master_port=29500,
            executable_cache_path=cache)
        for name, value in env.instance_environment(who).items():
            monkeypatch.setenv(name, value)

    return become


# --- no framework, or a broken one ---------------------------------------------------------


def test_import_popdist_imports_no_framework() -> None:
    code = ("import sys, popdist, popdist.popdist_core\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'poptorch', 'popart', 'tensorflow'}))")
    proc = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": SRC},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


@pytest.mark.parametrize("adapter, framework, hint", [
    ("poptorch", "poptorch", "Poplar SDK"),
    ("popart", "popart", "Poplar SDK"),
    ("tensorflow", "tensorflow", "Graphcore's TensorFlow"),
    ("torch", "torch", "pip install torch"),
])
def test_missing_framework_is_named(monkeypatch, adapter, framework, hint) -> None:
    monkeypatch.setitem(sys.modules, framework, None)  # as if not installed, even if it is
    with pytest.raises(ImportError) as raised:
        importlib.import_module(f"popdist.{adapter}")
    message = str(raised.value)
    assert f"popdist.{adapter} needs the '{framework}" in message
    assert "not installed" in message and hint in message
    assert raised.value.name.split(".")[0] == framework


def test_tensorflow_without_ipu_support_is_named(tmp_path, monkeypatch) -> None:
    write_packages(tmp_path, {"tensorflow/__init__.py": "", "tensorflow/python/__init__.py": ""})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"tensorflow\.python\.ipu.*Graphcore's TensorFlow"):
        importlib.import_module("popdist.tensorflow")


def test_broken_framework_is_not_called_missing(tmp_path, monkeypatch) -> None:
    # Installed, but one of its own imports fails: the message must not say "install it".
    write_packages(tmp_path, {"popart/__init__.py": "import _popart_native_library_missing\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as raised:
        importlib.import_module("popdist.popart")
    message = str(raised.value)
    assert "installed but failed to import" in message
    assert "_popart_native_library_missing" in message and "not installed" not in message


# --- popdist.poptorch ------------------------------------------------------------------------


def new_options():
    return importlib.import_module("popdist.poptorch").Options()


def test_poptorch_options_configured_by_poprun(fakes, instance) -> None:
    instance(index=1, num_instances=2, replicas=8, cache="/tmp/cache-1")
    opts = new_options()
    assert isinstance(opts, sys.modules["poptorch"].Options)
    assert opts.replication_factor == popdist.getNumLocalReplicas() == 4
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    assert opts.cache_path == "/tmp/cache-1"


def test_poptorch_options_outside_poprun(fakes) -> None:
    opts = new_options()
    assert opts.replication_factor == 1
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert opts.cache_path is None  # no cache chosen by poprun: PopTorch's own default stays


@pytest.mark.parametrize("name, args", [
    ("useIpuId", (3,)),
    ("replicationFactor", (2,)),
    ("Distributed.disable", ()),
    ("Distributed.setEnvVarNames", ("A", "B")),
    ("Distributed.configureProcessId", (0, 1)),
])
def test_poptorch_options_refuse_what_poprun_decides(fakes, instance, name, args) -> None:
    instance(index=1, num_instances=2, replicas=2)
    opts = new_options()
    *path, method = name.split(".")
    owner = opts.Distributed if path else opts
    setter = getattr(owner, method)  # looking it up is fine; calling it is not
    with pytest.raises(RuntimeError) as raised:
        setter(*args)
    assert str(raised.value) == f"Cannot call `{name}` with popdist.poptorch.Options"
    # Nothing changed behind the error.
    assert (opts.replication_factor, opts.ipu_id) == (1, None)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)


def test_poptorch_options_other_settings_still_work(fakes, instance) -> None:
    instance(index=0, num_instances=2, replicas=2)
    opts = new_options()
    assert opts.deviceIterations(16) is opts and opts.device_iterations == 16
    assert opts.Distributed.env_var_names == ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


# --- popdist.popart --------------------------------------------------------------------------


def test_popart_session_options(fakes, instance) -> None:
    instance(index=2, num_instances=4, replicas=8, cache="/tmp/cache-2")
    popart = importlib.import_module("popart")
    opts = popart.SessionOptions()
    assert importlib.import_module("popdist.popart").configureSessionOptions(opts) is None
    assert (opts.enableReplicatedGraphs, opts.replicatedGraphCount) == (True, 2)
    assert opts.enableDistributedReplicatedGraphs is True
    assert (opts.globalReplicationFactor, opts.globalReplicaOffset) == (8, 4)
    assert (opts.enableEngineCaching, opts.cachePath) == (True, "/tmp/cache-2")


def test_popart_session_options_keep_cache_default_without_poprun_cache(fakes, instance) -> None:
    instance(index=0, num_instances=1, replicas=1, cache=None)
    opts = importlib.import_module("popart").SessionOptions()
    importlib.import_module("popdist.popart").configureSessionOptions(opts)
    assert (opts.enableEngineCaching, opts.cachePath) == (False, "session_cache")


@pytest.fixture
def device_ids(monkeypatch):
    """popdist.getDeviceId stubbed (choosing a device needs Poplar); records its arguments."""
    asked = []

    def get_device_id(ipus_per_replica=None):
        asked.append(ipus_per_replica)
        return 5

    monkeypatch.setattr(popdist_core, "getDeviceId", get_device_id)
    return asked


def test_popart_get_device_attaches_to_the_popdist_device(fakes, device_ids) -> None:
    popart = importlib.import_module("popart")
    adapter = importlib.import_module("popdist.popart")
    device = adapter.getDevice(2, connectionType=popart.DeviceConnectionType.OnDemand)
    assert (device.id, device.connectionType) == (5, popart.DeviceConnectionType.OnDemand)
    assert device_ids == [2]
    assert adapter.getDevice().connectionType == popart.DeviceConnectionType.Always


def test_popart_get_device_taken(fakes, device_ids) -> None:
    importlib.import_module("popart").DeviceManager.taken.add(5)
    with pytest.raises(RuntimeError, match="could not attach to IPU device 5"):
        importlib.import_module("popdist.popart").getDevice(1)


def test_popart_get_device_without_poplar_says_so(fakes) -> None:
    with pytest.raises(RuntimeError, match="Poplar"):
        importlib.import_module("popdist.popart").getDevice(1)


# --- popdist.tensorflow ----------------------------------------------------------------------


def set_ipu_config(*args, **kwargs):
    return importlib.import_module("popdist.tensorflow").set_ipu_config(*args, **kwargs)


def test_tensorflow_ipu_config_without_device(fakes, instance) -> None:
    instance(index=1, num_instances=3, replicas=3)
    config = importlib.import_module("tensorflow.python.ipu.config").IPUConfig()
    assert set_ipu_config(config, 1, configure_device=False) is config
    distribution = config.experimental.multi_replica_distribution
    assert (distribution.process_count, distribution.process_index) == (3, 1)
    assert config.select_ipus == []


def test_tensorflow_ipu_config_selects_device(fakes, instance, device_ids) -> None:
    instance(index=0, num_instances=2, replicas=4, ipus_per_replica=2)
    config = importlib.import_module("tensorflow.python.ipu.config").IPUConfig()
    assert set_ipu_config(config, ipus_per_replica=2) is config
    assert config.select_ipus == [5] and device_ids == [2]


def test_tensorflow_deprecated_ipu_options(fakes, instance, device_ids) -> None:
    instance(index=1, num_instances=2, replicas=2)
    options = importlib.import_module("tensorflow.python.ipu.utils").create_ipu_config()
    configured = set_ipu_config(options, 1)
    assert configured == {"device_config": [5], "process_count": 2, "process_index": 1}
