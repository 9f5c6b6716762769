"""Data-parallel training with torch.distributed (gloo, on CPU) under poprun.

    poprun --num-instances 2 --num-replicas 2 --offline-mode=yes python3 examples/torch_ddp.py

Every instance builds the same synthetic regression problem and trains on its own shard of it
(`popdist.torch.DistributedSampler`); after each backward pass the gradients are averaged over
all instances with a gloo all-reduce, so all instances take the same step. Each prints the loss
of every epoch (averaged over all instances), then the loss of its final model on the whole data
set and a checksum of its parameters: with the all-reduce working, these are equal everywhere.

The all-reduce is written out here. DistributedDataParallel does the same, but with torch 2.13
on CPU it keeps the gloo group alive past `destroy_process_group()`, and such a process
sometimes aborts at exit ("terminate called without an active exception", about one run in
ten, under torchrun as under poprun).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import popdist
import popdist.torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048, help="whole data set")
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32, help="per instance")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def synthetic_data(samples: int, features: int, seed: int) -> TensorDataset:
    # The same seed on every instance: they all hold the same data set, and the sampler
    # hands each a disjoint shard of it.
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    weights = torch.randn(features, 1, generator=generator)
    y = torch.tanh(x @ weights) + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def make_model(features: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, 1))


def broadcast_parameters(model: nn.Module) -> None:
    """Start from instance 0's weights everywhere, whatever the seeds did."""
    for parameter in model.parameters():
        dist.broadcast(parameter.data, src=0)


def average_gradients(model: nn.Module) -> None:
    """The mean of every gradient over all instances (what DistributedDataParallel does)."""
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)  # gloo: the sum over instances, the same on each
        parameter.grad /= dist.get_world_size()


def train_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer) -> float:
    """One pass over this instance's shard; the mean loss over all instances' samples."""
    total = torch.zeros(2, dtype=torch.float64)  # (sum of losses, number of samples)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        average_gradients(model)
        optimizer.step()
        total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def full_loss(model: nn.Module, data: TensorDataset) -> float:
    """This instance's own model on the whole data set: equal everywhere only if the weights are."""
    x, y = data.tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for parameter in model.parameters():
        values = parameter.detach().flatten().tolist()
        digest.update(struct.pack(f"{len(values)}d", *values))
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The instances on one host share its cores; more threads than that only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // popdist.torch.get_local_world_size()))
    tag = f"instance {popdist.getInstanceIndex()}/{popdist.getNumInstances()}"
    data = synthetic_data(args.samples, args.features, args.seed)
    sampler = popdist.torch.DistributedSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = make_model(args.features, args.seed)
    # Before the process group on purpose: torch 2.13's first optimizer imports torch._dynamo,
    # and imported after init_process_group() that too keeps the group alive (see above).
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    popdist.torch.init_process_group("gloo")
    broadcast_parameters(model)
    print(f"{tag}: training on {len(sampler)} of {len(data)} samples", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every instance
        print(f"{tag}: epoch {epoch} loss {train_epoch(model, loader, optimizer):.6f}", flush=True)
    print(f"{tag}: final loss {full_loss(model, data):.6f} params {checksum(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
