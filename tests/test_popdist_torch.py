"""popdist.torch: rank and size from poprun's environment, the sampler, the process group, and
a job whose instance dies before the rendezvous (the others must not wait for it forever).

Needs PyTorch (the CPU wheel: pip install torch==2.13.0); without it these tests skip.
"""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import pytest

from requires import require_module

require_module("torch", "POPRUN_REQUIRE_TOOLS", "pip install torch==2.13.0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import popdist.torch  # noqa: E402
from popdist import env  # noqa: E402

from conftest import OFFLINE, run_poprun  # noqa: E402

# Everything poprun sets that these helpers read, cleared so each test starts outside poprun.
_VARIABLES = tuple(env.instance_environment(env.InstanceIdentity(
    index=0, num_instances=1, local_index=0, local_size=1, num_total_replicas=1,
    ipus_per_replica=1, master_addr="x", master_port=1)))


@pytest.fixture(autouse=True)
def outside_poprun(monkeypatch):
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)


def set_environment(monkeypatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def as_poprun_instance(monkeypatch, index: int, num_instances: int, port: int = 29500) -> None:
    """The environment poprun gives instance `index` of `num_instances` on one host."""
    set_environment(monkeypatch, env.instance_environment(env.InstanceIdentity(
        index=index, num_instances=num_instances, local_index=index,
        local_size=num_instances, num_total_replicas=2 * num_instances, ipus_per_replica=1,
        master_addr="127.0.0.1", master_port=port)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shape() -> tuple[int, int, int, int]:
    return (popdist.torch.get_rank(), popdist.torch.get_world_size(),
            popdist.torch.get_local_rank(), popdist.torch.get_local_world_size())


# --- rank and size -----------------------------------------------------------------------------


def test_rank_and_size_under_poprun(monkeypatch) -> None:
    as_poprun_instance(monkeypatch, index=2, num_instances=3)
    assert shape() == (2, 3, 2, 3)


def test_rank_and_size_outside_any_launcher() -> None:
    assert shape() == (0, 1, 0, 1)


def test_rank_and_size_from_popdist_alone(monkeypatch) -> None:
    # Only the POPDIST_* contract (an older launcher): the instance index and count still hold.
    as_poprun_instance(monkeypatch, index=1, num_instances=2)
    for name in (env.RANK, env.WORLD_SIZE, env.LOCAL_RANK):
        monkeypatch.delenv(name)
    assert shape()[:3] == (1, 2, 1)


def test_rank_and_size_under_torchrun(monkeypatch) -> None:
    set_environment(monkeypatch, {env.RANK: "5", env.WORLD_SIZE: "8", env.LOCAL_RANK: "1",
                                  env.LOCAL_WORLD_SIZE: "4"})
    assert shape() == (5, 8, 1, 4)


def test_sampler_gives_each_instance_its_own_shard(monkeypatch) -> None:
    data = list(range(12))
    shards = []
    for index in range(3):
        as_poprun_instance(monkeypatch, index=index, num_instances=3)
        shards.append(list(popdist.torch.DistributedSampler(data, shuffle=True, seed=1)))
    assert sorted(sum(shards, [])) == data  # disjoint, and together the whole data set
    assert all(len(shard) == 4 for shard in shards)


def test_sampler_explicit_shard_wins(monkeypatch) -> None:
    as_poprun_instance(monkeypatch, index=0, num_instances=2)
    sampler = popdist.torch.DistributedSampler(list(range(8)), num_replicas=4, rank=3,
                                               shuffle=False)
    assert list(sampler) == [3, 7]


# --- init_process_group --------------------------------------------------------------------------


@pytest.fixture
def process_group():
    """Whatever a test initialised is destroyed afterwards (one default group per process)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: float) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return tensor.item()


@pytest.mark.timeout(60)
def test_init_alone_outside_poprun(process_group) -> None:
    popdist.torch.init_process_group()
    assert (dist.get_backend(), dist.get_rank(), dist.get_world_size()) == ("gloo", 0, 1)
    assert all_reduce_sum(3.0) == 3.0


@pytest.mark.timeout(60)
def test_init_rendezvous_at_master_addr_and_port(monkeypatch, process_group) -> None:
    port = free_port()
    as_poprun_instance(monkeypatch, index=0, num_instances=1, port=port)
    popdist.torch.init_process_group("gloo")
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    # Instance 0 serves the rendezvous store on poprun's MASTER_PORT.
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass


@pytest.fixture
def recorded(monkeypatch):
    """torch.distributed.init_process_group replaced by a recorder of its arguments."""
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    return calls


def test_init_arguments_from_poprun(monkeypatch, recorded) -> None:
    as_poprun_instance(monkeypatch, index=1, num_instances=4)
    popdist.torch.init_process_group()
    assert recorded == [{"backend": "gloo", "rank": 1, "world_size": 4, "init_method": "env://"}]


def test_init_keywords_win(monkeypatch, recorded) -> None:
    as_poprun_instance(monkeypatch, index=1, num_instances=4)
    popdist.torch.init_process_group("mpi", init_method="tcp://10.0.0.1:1234", timeout=7)
    assert recorded == [{"backend": "mpi", "rank": 1, "world_size": 4,
                         "init_method": "tcp://10.0.0.1:1234", "timeout": 7}]


def test_init_without_rendezvous_address(monkeypatch, recorded) -> None:
    set_environment(monkeypatch, {env.RANK: "0", env.WORLD_SIZE: "2", env.MASTER_PORT: "1"})
    with pytest.raises(RuntimeError, match="MASTER_ADDR not set for a world of 2 processes"):
        popdist.torch.init_process_group()
    assert recorded == []


def test_init_rejects_a_broken_popdist_environment(monkeypatch, recorded) -> None:
    as_poprun_instance(monkeypatch, index=0, num_instances=2)
    monkeypatch.setenv(env.NUM_LOCAL_REPLICAS, "abc")
    with pytest.raises(RuntimeError, match="not an integer"):
        popdist.torch.init_process_group()
    assert recorded == []


# --- a dead instance under poprun -----------------------------------------------------------------

DIES_BEFORE_RENDEZVOUS = """
import os, signal
import popdist.torch
if popdist.torch.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # never joins: instance 0 would wait 30 min for it
popdist.torch.init_process_group()
print("rendezvous complete", flush=True)
"""


@pytest.mark.timeout(90)
def test_dead_instance_ends_the_job_instead_of_a_hung_rendezvous(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text(DIES_BEFORE_RENDEZVOUS)
    proc = run_poprun("--num-instances", "2", "--num-replicas", "2", *OFFLINE,
                      sys.executable, str(script), timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert b"rendezvous complete" not in proc.stdout
    assert b"instance 1" in proc.stderr and b"failed first" in proc.stderr
