"""torch.distributed for poprun instances: process group, rank and size from poprun's environment.

    import popdist.torch
    popdist.torch.init_process_group()               # gloo, rendezvous at MASTER_ADDR:MASTER_PORT
    sampler = popdist.torch.DistributedSampler(dataset, shuffle=True, seed=0)

poprun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT exactly as torchrun does,
so a torchrun script also runs unchanged; these helpers add the popdist defaults (a single
process outside any launcher) and a clear error when the environment is incomplete.
PyTorch is optional: importing this module without it raises an ImportError saying so.
"""

from __future__ import annotations

import os
from typing import Any

from popdist import env, popdist_core
from popdist._frameworks import import_framework

_INSTALL = "pip install torch (the CPU wheel is enough), or pip install 'poprun[torch]'"
torch = import_framework("torch", "popdist.torch", _INSTALL)
dist = import_framework("torch.distributed", "popdist.torch", _INSTALL)
torch_data = import_framework("torch.utils.data", "popdist.torch", _INSTALL)

__all__ = [
    "DistributedSampler",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
]


def get_rank() -> int:
    """This instance's rank: RANK (set by poprun and torchrun), else the popdist instance index."""
    return env.read_int(os.environ, env.RANK, popdist_core.getInstanceIndex())


def get_world_size() -> int:
    """Number of instances: WORLD_SIZE, else popdist's instance count (1 outside a launcher)."""
    return env.read_int(os.environ, env.WORLD_SIZE, popdist_core.getNumInstances())


def get_local_rank() -> int:
    """Index among the instances on this host: LOCAL_RANK, else popdist's local index."""
    return env.read_int(os.environ, env.LOCAL_RANK, popdist_core.getLocalInstanceIndex())


def get_local_world_size() -> int:
    """Number of instances on this host: LOCAL_WORLD_SIZE, else 1."""
    return env.read_int(os.environ, env.LOCAL_WORLD_SIZE, 1)


def init_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """`torch.distributed.init_process_group` for this instance, from poprun's environment.

    Rank and world size come from `get_rank()`/`get_world_size()`; the rendezvous is the
    TCP store at MASTER_ADDR:MASTER_PORT (on the first host, which poprun chose). Any keyword
    given here (`timeout=`, `init_method=`, `store=`, ...) wins over what poprun set.
    """
    popdist_core.init()  # a malformed POPDIST_* environment fails here, with its own message
    settings: dict[str, Any] = {"rank": get_rank(), "world_size": get_world_size()}
    if "init_method" not in kwargs and "store" not in kwargs:
        settings.update(_rendezvous(settings["world_size"]))
    settings.update(kwargs)
    dist.init_process_group(backend=backend, **settings)


def _rendezvous(world_size: int) -> dict[str, Any]:
    missing = [name for name in (env.MASTER_ADDR, env.MASTER_PORT)
               if not env.read_str(os.environ, name)]
    if not missing:
        return {"init_method": "env://"}  # torch reads MASTER_ADDR/PORT itself (IPv6 too)
    if world_size == 1:
        # Alone outside any launcher: an in-process store needs no address or port.
        return {"store": dist.HashStore()}
    raise RuntimeError(
        f"popdist.torch.init_process_group(): {' and '.join(missing)} not set for a world of "
        f"{world_size} processes (poprun sets them; was this started by poprun?)"
    )


class DistributedSampler(torch_data.DistributedSampler):
    """`torch.utils.data.DistributedSampler` whose shard defaults to this poprun instance's.

    Unlike torch's own, it does not need an initialised process group to know the rank and
    world size, so data loading can be set up before (or without) `init_process_group()`.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None,
                 rank: int | None = None, **kwargs: Any) -> None:
        super().__init__(
            dataset,
            num_replicas=get_world_size() if num_replicas is None else num_replicas,
            rank=get_rank() if rank is None else rank,
            **kwargs,
        )
