"""The examples, run for real: alone, and under the real poprun on this host.

`torch_ddp.py` trains data-parallel with gloo all-reduce; it needs PyTorch (the CPU wheel:
pip install torch==2.13.0) and skips without it. The two-host runs belong with the multi-host
tests.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, poprun_env, run_poprun
from requires import needs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PY = sys.executable


def outside_poprun_env() -> dict[str, str]:
    """This checkout's popdist importable, and nothing of an enclosing launcher's contract."""
    environ = poprun_env()
    for name in list(environ):
        if name.startswith("POPDIST_") or name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
            del environ[name]
    return environ


def launch(num_instances: int, num_replicas: int, *program: str) -> list[str]:
    """Run `program` under poprun on this host; its output lines (it must succeed)."""
    proc = run_poprun("--num-instances", str(num_instances), "--num-replicas",
                      str(num_replicas), *OFFLINE, *program, timeout=90)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout.decode().splitlines()


# --- hello.py ----------------------------------------------------------------------------------

HELLO = re.compile(r"hello from instance (\d+) of (\d+) \(local index (\d+)\) on \S+: "
                   r"replicas (\d+)\.\.(\d+) of (\d+), (\d+) IPU\(s\) per replica, "
                   r"launched by poprun: (yes|no)$")


def hellos(lines: list[str]) -> set[tuple]:
    matches = [HELLO.match(line) for line in lines]
    assert all(matches), lines
    return {tuple(int(g) if g.isdigit() else g for g in m.groups()) for m in matches}


@pytest.mark.timeout(30)
def test_hello_alone() -> None:
    proc = subprocess.run([PY, str(EXAMPLES / "hello.py")], env=outside_poprun_env(),
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert hellos(proc.stdout.splitlines()) == {(0, 1, 0, 0, 0, 1, 1, "no")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_instances, num_replicas", [(2, 4), (3, 3)])
def test_hello_under_poprun(num_instances: int, num_replicas: int) -> None:
    lines = launch(num_instances, num_replicas, PY, str(EXAMPLES / "hello.py"))
    local = num_replicas // num_instances
    assert hellos(lines) == {
        (i, num_instances, i, i * local, (i + 1) * local - 1, num_replicas, 1, "yes")
        for i in range(num_instances)
    }


# --- popdist_env.py ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_popdist_env_agrees_with_what_poprun_set() -> None:
    reports = [json.loads(line)
               for line in launch(2, 4, PY, str(EXAMPLES / "popdist_env.py"))]
    assert sorted(r["popdist"]["getInstanceIndex"] for r in reports) == [0, 1]
    for report in reports:
        api, environ = report["popdist"], report["environ"]
        assert api["isPopdistEnvSet"] is True
        assert str(api["getInstanceIndex"]) == environ["RANK"] == environ["OMPI_COMM_WORLD_RANK"]
        assert str(api["getNumInstances"]) == environ["WORLD_SIZE"] == "2"
        assert str(api["getNumLocalReplicas"]) == environ["POPDIST_NUM_LOCAL_REPLICAS"] == "2"
        assert api["getExecutableCachePath"] == environ["POPDIST_EXECUTABLE_CACHE_PATH"]
    # One temporary cache shared by the instances.
    assert len({r["popdist"]["getExecutableCachePath"] for r in reports}) == 1


# --- torch_ddp.py --------------------------------------------------------------------------------

needs_torch = needs("POPRUN_REQUIRE_TOOLS", "PyTorch is not installed (pip install torch==2.13.0)",
                    importlib.util.find_spec("torch") is None)

EPOCH = re.compile(r"instance (\d+)/(\d+): epoch (\d+) loss ([\d.]+)$")
FINAL = re.compile(r"instance (\d+)/(\d+): final loss ([\d.]+) params ([0-9a-f]+)$")
SHARD = re.compile(r"instance (\d+)/(\d+): training on (\d+) of (\d+) samples$")


def parse(pattern: re.Pattern, lines: list[str]) -> list[tuple[str, ...]]:
    return [m.groups() for m in map(pattern.match, lines) if m]


@needs_torch
@pytest.mark.timeout(120)
def test_torch_ddp_instances_end_identical() -> None:
    epochs = 4
    lines = launch(2, 2, PY, str(EXAMPLES / "torch_ddp.py"), "--epochs", str(epochs),
                   "--samples", "1024")
    assert sorted(parse(SHARD, lines)) == [("0", "2", "512", "1024"), ("1", "2", "512", "1024")]

    finals = parse(FINAL, lines)
    assert sorted(f[0] for f in finals) == ["0", "1"]
    # Each instance computed its final loss and checksum on its own copy of the model:
    # they agree only if the gradients were all-reduced at every step.
    assert len({f[2:] for f in finals}) == 1, finals

    losses = {}  # epoch -> {instance: loss}
    for instance, _, epoch, loss in parse(EPOCH, lines):
        losses.setdefault(int(epoch), {})[instance] = float(loss)
    assert sorted(losses) == list(range(epochs))
    assert all(len(set(per.values())) == 1 and len(per) == 2 for per in losses.values())
    assert losses[epochs - 1]["0"] < losses[0]["0"]  # it learns


@needs_torch
@pytest.mark.timeout(60)
def test_torch_ddp_alone() -> None:
    proc = subprocess.run([PY, str(EXAMPLES / "torch_ddp.py"), "--epochs", "1", "--samples",
                           "256"], env=outside_poprun_env(), capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert parse(SHARD, lines) == [("0", "1", "256", "256")]
    assert len(parse(FINAL, lines)) == 1
