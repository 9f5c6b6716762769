"""popdist's framework adapters: popdist.poptorch, popdist.popart, popdist.tensorflow (and how
every adapter, popdist.torch included, fails without its framework), called as real
applications call them (graphcore/examples, PopTorch's tests/popdist_test.py, PopART's
sessions, graphcore/tensorflow's tests), outside poprun and under it.

STAND-INS: PopTorch, PopART and Graphcore's TensorFlow come only with the Poplar SDK and
cannot be installed here, so the adapters are tested against stand-ins in tests/standins/,
put first on sys.path (and on the instances' PYTHONPATH under poprun). Each is written from
its framework's public source and says so in its docstring; each keeps the rules the adapter
must live within (PopTorch's OptionsDict attribute and freezing rules, PopART's declared
session options and its 3.1 sessions' isBackendInitialized() check, TensorFlow's IPUConfig
that refuses unknown attributes).
"""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import popdist
from popdist import env

from conftest import OFFLINE, SRC, run_poprun
from vipu_harness import sim  # noqa: F401 (a fixture)

STANDINS = Path(__file__).resolve().parent / "standins"
FRAMEWORKS = ("poptorch", "popart", "tensorflow")
ADAPTERS = ("poptorch", "popart", "tensorflow", "torch")
# Everything poprun sets that popdist reads; tests start from "outside poprun".
POPRUN_VARIABLES = tuple(env.instance_environment(env.InstanceIdentity(
    index=0, num_instances=1, local_index=0, local_size=1, num_total_replicas=1,
    ipus_per_replica=1, master_addr="x", master_port=1, executable_cache_path="x"))) + (
    env.NODE_DEVICE_ID, env.VIPU_API_GCD_ID, env.PMI_FD, "POPTORCH_CACHE_DIR")


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
def fakes(monkeypatch):
    """The stand-ins, first on sys.path."""
    monkeypatch.syspath_prepend(str(STANDINS))


@pytest.fixture
def instance(monkeypatch):
    """Make this process look like instance `index` of a poprun job; with `partition_ipus`,
    one on a V-IPU partition of that many IPUs (one GCD per instance with `gcds`), as
    run/vipu.Partition.environment sets it."""

    def become(index: int, num_instances: int, replicas: int, ipus_per_replica: int = 1,
               cache: str | None = "/tmp/poprun-cache-test", partition_ipus: int | None = None,
               gcds: bool = False) -> None:
        who = env.InstanceIdentity(
            index=index, num_instances=num_instances, local_index=index,
            local_size=num_instances, num_total_replicas=replicas,
            ipus_per_replica=ipus_per_replica, master_addr="127.0.0.1", master_port=29500,
            executable_cache_path=cache)
        for name, value in env.instance_environment(who).items():
            monkeypatch.setenv(name, value)
        if partition_ipus:
            from poprun.plan.partition import node_device

            node = node_device(partition_ipus, num_instances if gcds else 1)
            monkeypatch.setenv(env.NODE_DEVICE_ID, str(node))
            if gcds:
                monkeypatch.setenv(env.VIPU_API_GCD_ID, str(index))

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


def poptorch_options(*args, **kwargs):
    return importlib.import_module("popdist.poptorch").Options(*args, **kwargs)


def options_values(opts) -> dict:
    """Every option PopTorch would hand its backend (Options.toDict)."""
    return opts.toDict()


def test_poptorch_options_configured_by_poprun(fakes, instance) -> None:
    instance(index=1, num_instances=2, replicas=8, cache="/tmp/cache-1")
    opts = poptorch_options()
    assert isinstance(opts, sys.modules["poptorch"].Options)
    values = options_values(opts)
    assert values["replication_factor"] == popdist.getNumLocalReplicas() == 4
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    assert (values["cachePath"], values["enableEngineCaching"]) == ("/tmp/cache-1", True)
    assert "ipu_id" not in values  # offline: no device to choose, PopTorch decides


def test_poptorch_options_outside_poprun(fakes) -> None:
    opts = poptorch_options()
    values = options_values(opts)
    assert values["replication_factor"] == 1
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert "cachePath" not in values and "ipu_id" not in values  # PopTorch's defaults stay


@pytest.mark.parametrize("call", [
    "Options(ipus_per_replica=config.ipus_per_replica)",  # nlp/bert/pytorch/ipu_options.py
    "Options(ipus_per_replica=len(args.pipeline_splits) + 1)",  # vision/cnns/pytorch
    "Options(ipu_per_replica)",  # vision/dino/pytorch/options.py: positional
    "Options()",  # vision/swin/pytorch/options.py
])
def test_poptorch_options_as_graphcore_examples_call_it(fakes, instance, call) -> None:
    """45 of 59 real calls pass the IPUs per replica. Instance 2 of 4, 8
    replicas of 2 IPUs on a 16-IPU partition: its device is the quad of its two replicas."""
    instance(index=2, num_instances=4, replicas=8, ipus_per_replica=2, partition_ipus=16)
    namespace = {"Options": importlib.import_module("popdist.poptorch").Options,
                 "config": type("config", (), {"ipus_per_replica": 2}),
                 "args": type("args", (), {"pipeline_splits": [3]}), "ipu_per_replica": 2}
    opts = eval(call, namespace)
    values = options_values(opts)
    assert values["ipu_id"] == popdist.getDeviceId(2) == 26  # quads of 16 IPUs: 24..27
    assert values["replication_factor"] == 2
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (2, 4)


def test_poptorch_options_with_a_gcd_per_instance(fakes, instance) -> None:
    instance(index=3, num_instances=4, replicas=8, ipus_per_replica=2, partition_ipus=16,
             gcds=True)
    assert options_values(poptorch_options(2))["ipu_id"] == 6  # the whole of its 4-IPU GCD


@pytest.mark.parametrize("partition_ipus", [None, 16])
def test_poptorch_options_check_the_ipus_per_replica(fakes, instance, partition_ipus) -> None:
    instance(index=0, num_instances=4, replicas=8, ipus_per_replica=2,
             partition_ipus=partition_ipus)
    with pytest.raises(ValueError, match=r"popdist.poptorch.Options\(ipus_per_replica=4\) "
                                         r"does not match the 2 IPUs per replica"):
        poptorch_options(ipus_per_replica=4)


def test_poptorch_options_as_poptorchs_own_popdist_test(fakes) -> None:
    """graphcore/poptorch tests/popdist_test.py (test_blocked_options, test_getters), run
    outside poprun without an IPU: Options(ipus_per_replica=2) is built, its getters read
    the defaults, and what poprun decides cannot be changed (whatever the arguments)."""
    opts = poptorch_options(ipus_per_replica=2)
    assert opts.Distributed.processId == 0 and opts.Distributed.numProcesses == 1
    for call, name in [(lambda: opts.useIpuId(1), "useIpuId"),
                       (lambda: opts.replicationFactor(1), "replicationFactor"),
                       (lambda: opts.Distributed.disable(), "Distributed.disable"),
                       (lambda: opts.Distributed.setEnvVarNames("A", "B"),
                        "Distributed.setEnvVarNames"),
                       (lambda: opts.Distributed.configureProcessId(1),
                        "Distributed.configureProcessId")]:
        with pytest.raises(RuntimeError,
                           match=rf"^Cannot call `{name}` with popdist\.poptorch\.Options$"):
            call()
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert options_values(opts)["replication_factor"] == 1


def test_poptorch_options_keep_poptorchs_attribute_rules(fakes, instance) -> None:
    """PopTorch 2.4-3.4 refuse a private attribute added after `_values`
    ("Invalid private attribute _popdist_locked" in the old adapter) and public ones that
    are not options. The stand-in keeps those rules, and the adapter adds nothing."""
    instance(index=0, num_instances=2, replicas=2)
    poptorch = importlib.import_module("poptorch")
    opts = poptorch_options()
    assert set(vars(opts)) == set(vars(poptorch.Options()))
    assert set(vars(opts.Distributed)) == set(vars(poptorch.Options().Distributed))
    with pytest.raises(AttributeError, match="Invalid private attribute _extra"):
        opts._extra = True
    with pytest.raises(AssertionError, match="Invalid option not_an_option"):
        opts.not_an_option = 1
    with pytest.raises(AttributeError, match="Invalid private attribute _extra"):
        opts.Distributed._extra = True


def test_poptorch_options_frozen_and_copied(fakes, instance) -> None:
    """PopTorch freezes options once a model uses them and copies come back unfrozen
    (PopTorch's popdist_test test_to_dict, options_test test_copied_options_unfrozen); a
    copy of popdist's options keeps poprun's values and its locks."""
    instance(index=1, num_instances=2, replicas=4)
    opts = poptorch_options()
    opts.toDict()
    opts.checkIsFrozen()  # not frozen by reading
    opts._freeze()
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.deviceIterations(2)
    with pytest.raises(RuntimeError, match="Cannot call `useIpuId`"):
        opts.useIpuId(1)
    copied = copy.deepcopy(opts)
    copied.deviceIterations(5)
    assert options_values(copied)["device_iterations"] == 5
    with pytest.raises(RuntimeError, match="Cannot call `Distributed.disable`"):
        copied.Distributed.disable()
    assert (copied.Distributed.processId, copied.Distributed.numProcesses) == (1, 2)


def test_poptorch_options_other_settings_still_work(fakes, instance) -> None:
    """What graphcore/examples do next: device iterations, seed, gradient accumulation,
    their own cache directory (vision/dino/pytorch/options.py)."""
    instance(index=0, num_instances=2, replicas=2)
    opts = poptorch_options(1)
    assert opts.deviceIterations(16) is opts
    opts.randomSeed(42).autoRoundNumIPUs(True)
    opts.Training.gradientAccumulation(4)
    opts.enableExecutableCaching("./cachedir")
    values = options_values(opts)
    assert (values["device_iterations"], values["random_seed"]) == (16, 42)
    assert (values["gradient_accumulation"], values["cachePath"]) == (4, "./cachedir")


def test_poptorch_cache_dir_the_same_as_poprun_s(fakes, instance, monkeypatch) -> None:
    """As balewski/neuron_inverter_benchmark's run-slurm.sh does: POPTORCH_CACHE_DIR=X and
    --executable-cache-path=X."""
    instance(index=0, num_instances=2, replicas=2, cache="/localdata/ci/exec_cache")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", "/localdata/ci/exec_cache")
    assert options_values(poptorch_options(1))["cachePath"] == "/localdata/ci/exec_cache"


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


def test_popart_get_device_attaches_to_the_instance_s_device(fakes, instance) -> None:
    """Instance 1 of 2, 4 replicas on a 4-IPU partition: its pair of IPUs is device 5
    (gc-info's listing: 4 = IPUs 0-1, 5 = IPUs 2-3)."""
    instance(index=1, num_instances=2, replicas=4, partition_ipus=4)
    popart = importlib.import_module("popart")
    adapter = importlib.import_module("popdist.popart")
    device = adapter.getDevice(1, connectionType=popart.DeviceConnectionType.OnDemand)
    assert (device.id, device.connectionType) == (5, popart.DeviceConnectionType.OnDemand)
    # PopXL's call (popxl/utils.py): no IPUs per replica, poprun's are used.
    assert adapter.getDevice(connectionType=popart.DeviceConnectionType.OnDemand).id == 5
    assert adapter.getDevice().connectionType == popart.DeviceConnectionType.Always


def test_popart_get_device_taken(fakes, instance) -> None:
    instance(index=0, num_instances=1, replicas=4, partition_ipus=4)
    importlib.import_module("popart").DeviceManager.taken.add(6)
    try:
        with pytest.raises(RuntimeError, match="could not attach to IPU device 6"):
            importlib.import_module("popdist.popart").getDevice(1)
    finally:
        importlib.import_module("popart").DeviceManager.taken.clear()


def test_popart_get_device_offline_says_there_is_none(fakes, instance) -> None:
    instance(index=0, num_instances=2, replicas=2)
    with pytest.raises(RuntimeError, match="POPDIST_NODE_DEVICE_ID is not set"):
        importlib.import_module("popdist.popart").getDevice(1)


def test_popart_3_1_sessions_initialise_the_backend_once(fakes, instance) -> None:
    """PopART 3.1's sessions with distributed replicated graphs ask
    popdist.isBackendInitialized() and call popdist.init() themselves when it is False
    (here: no world to join, in-process), once per process."""
    instance(index=0, num_instances=2, replicas=2)
    popart = importlib.import_module("popart")
    opts = popart.SessionOptions()
    importlib.import_module("popdist.popart").configureSessionOptions(opts)
    popart.TrainingSession(fnModel=b"", dataFlow={}, deviceInfo=None, userOptions=opts)
    popart.InferenceSession(fnModel=b"", dataFlow={}, deviceInfo=None, userOptions=opts)
    assert popart.calls == ["isBackendInitialized", "init"]
    assert popdist.isBackendInitialized() is False  # this process is in no world


# --- popdist.tensorflow ----------------------------------------------------------------------


def set_ipu_config(*args, **kwargs):
    return importlib.import_module("popdist.tensorflow").set_ipu_config(*args, **kwargs)


def ipu_config():
    return importlib.import_module("tensorflow.python.ipu.config").IPUConfig()


def test_tensorflow_ipu_config_without_device(fakes, instance) -> None:
    instance(index=1, num_instances=3, replicas=3)
    config = ipu_config()
    assert set_ipu_config(config, 1, configure_device=False) is config
    distribution = config.experimental.multi_replica_distribution
    assert (distribution.process_count, distribution.process_index) == (3, 1)
    assert config.select_ipus == []


@pytest.mark.parametrize("call", [
    "set_ipu_config(config)",  # tutorials/feature_examples/tensorflow2/popdist
    "set_ipu_config(config, ipus_per_replica=2, configure_device=True)",  # nlp/bert/tf2
    "set_ipu_config(config=config, ipus_per_replica=2, configure_device=True)",  # cnns/tf2
])
def test_tensorflow_ipu_config_selects_the_device(fakes, instance, call) -> None:
    """The default configure_device=True works on a partition. Instance
    1 of 2, 4 replicas of 2 IPUs on 8 IPUs: its 4 IPUs start at 4, the second quad, 13."""
    instance(index=1, num_instances=2, replicas=4, ipus_per_replica=2, partition_ipus=8)
    config = ipu_config()
    assert eval(call, {"set_ipu_config": set_ipu_config, "config": config}) is config
    assert config.select_ipus == [13]


def test_tensorflow_ipu_config_offline_tells_about_configure_device(fakes, instance) -> None:
    instance(index=0, num_instances=2, replicas=2)
    with pytest.raises(RuntimeError, match="configure_device=False"):
        set_ipu_config(ipu_config())


def test_tensorflow_ipu_config_refuses_unknown_attributes(fakes) -> None:
    """The stand-in keeps IPUConfig's rule (config.py's _ConfigBase.__setattr__)."""
    with pytest.raises(ValueError, match="'select_ipu' is not a valid attribute"):
        ipu_config().select_ipu = [0]


def test_tensorflow_deprecated_ipu_options(fakes, instance) -> None:
    instance(index=1, num_instances=2, replicas=2, partition_ipus=2)
    options = importlib.import_module("tensorflow.python.ipu.utils").create_ipu_config()
    configured = set_ipu_config(options, 1)
    assert configured == {"device_config": [1], "process_count": 2, "process_index": 1}


# --- under poprun: the calls as real applications write them ---------------------------------

APP = r"""
import json, os
import popdist, popdist.poptorch, popdist.popart, popdist.tensorflow
import popart
from tensorflow.python import ipu

popdist.init()  # bert/pytorch args.py, vit, dino, mae, cnns: before anything else
opts = popdist.poptorch.Options(ipus_per_replica=int(os.environ["IPR"]))
session_options = popart.SessionOptions()
popdist.popart.configureSessionOptions(session_options)
popart.TrainingSession(fnModel=b"", dataFlow={}, deviceInfo=None, userOptions=session_options)
config = ipu.config.IPUConfig()
try:
    popdist.tensorflow.set_ipu_config(config, ipus_per_replica=int(os.environ["IPR"]))
    device = popdist.getDeviceId()
except RuntimeError as error:  # offline: no device
    popdist.tensorflow.set_ipu_config(config, int(os.environ["IPR"]), configure_device=False)
    device = str(error)
values = opts.toDict()
print(json.dumps({
    "instance": popdist.getInstanceIndex(), "replication": values["replication_factor"],
    "process": [opts.Distributed.processId, opts.Distributed.numProcesses],
    "ipu_id": values.get("ipu_id"), "cache": values.get("cachePath"),
    "global": [session_options.globalReplicationFactor, session_options.globalReplicaOffset],
    "tf": [config.experimental.multi_replica_distribution.process_index,
           config.experimental.multi_replica_distribution.process_count, config.select_ipus],
    "device": device, "popart_asked": popart.calls,
    "backend": popdist.isBackendInitialized()}), flush=True)
"""


def run_app(*options: str, ipus_per_replica: int = 1) -> list[dict]:
    proc = run_poprun(*options, "--num-instances=4", "--num-replicas=8",
                      f"--ipus-per-replica={ipus_per_replica}", sys.executable, "-c", APP,
                      env={"PYTHONPATH": f"{STANDINS}:{SRC}", "IPR": str(ipus_per_replica)},
                      timeout=90)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    found = [json.loads(line) for line in proc.stdout.decode().splitlines()
             if line.startswith("{")]
    return sorted(found, key=lambda seen: seen["instance"])


@pytest.mark.timeout(120)
def test_real_calls_under_poprun_offline(tmp_path) -> None:
    seen = run_app(*OFFLINE, f"--executable-cache-path={tmp_path / 'cache'}")
    assert [s["instance"] for s in seen] == [0, 1, 2, 3]
    for index, s in enumerate(seen):
        assert s["replication"] == 2 and s["process"] == [index, 4]
        assert s["ipu_id"] is None and s["cache"] == str(tmp_path / "cache")
        assert s["global"] == [8, 2 * index]
        assert s["tf"] == [index, 4, []]
        assert "configure_device=False" in s["device"]
        # popdist.init() joined the job's world first, so PopART only asked.
        assert s["backend"] is True and s["popart_asked"] == ["isBackendInitialized"]


@pytest.mark.timeout(120)
def test_real_calls_under_poprun_on_a_partition(sim) -> None:  # noqa: F811
    """A reconfigurable partition of 16 IPUs, one GCD: instances share it, each its quad."""
    sim.add("p16", size=16, gcds=1, ilds=1, reconfigurable=True)
    seen = run_app("--vipu-server-host=localhost", "--vipu-partition=p16",
                   "--vipu-server-timeout=5", ipus_per_replica=2)
    for index, s in enumerate(seen):
        assert s["ipu_id"] == s["device"] == 24 + index
        assert s["tf"] == [index, 4, [24 + index]]
        assert s["replication"] == 2 and s["process"] == [index, 4]
