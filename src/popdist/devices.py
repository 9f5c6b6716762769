"""Poplar's device numbering, computed without Poplar: which device id names which IPUs.

The IPUs an instance sees (its V-IPU partition, or its GCD of one) form devices of every
power-of-two size, each a group aligned to its size: ids 0..n-1 are the n single IPUs, then
come the n/2 pairs, the n/4 quads, ..., and the last id, 2n-2, is all of them. So the
first device of s IPUs is 2n - 2n/s, and the one whose IPUs start at offset o is
(2n - 2n/s) + o/s. Sources (docs/architecture.md, "The environment contract"):

- gc-info's device list of a 4-IPU partition on an IPU-POD (Graphcore command-line tools
  guide, `gc-info --list-devices`): ids 0-3 single IPUs, 4 = IPUs 0-1, 5 = IPUs 2-3,
  6 = all four. A 16-IPU system (graphcore/tensorflow, python/ipu/config.py's
  `select_ipus` docstring): 0-15 single, 16-23 pairs, 24-27 quads, 28-29 eights, 30 all.
  (On C2 PCIe cards the order within one size follows the cards' IPU-Links instead; the
  partitions poprun runs on are IPU-over-Fabric, numbered as above.)
- A real PopRun log on a 4-IPU partition (argonne-lcf/user-guides, Graphcore example
  programs): "Attached to device 6 ... Preparing parent device 6".
- PopRun 3.1.0's `-vv` logs on ALCF's reconfigurable 64-IPU partition p64
  (BruceRayWilsonAtANL/CosmicTagger, branch Graphcore, `bfloat16_2x10_{1,2,4,8,16}_nvme.log`
  and `bfloat16_2x10_64.log`): with 1, 2, 4, 8, 16 and 64 one-IPU replicas it reports
  "Found 64 devices with 1 IPUs", "32 devices with 2", "16 devices with 4", "8 devices
  with 8", "4 devices with 16", "1 devices with 64" and attaches to 0, 64, 96, 112, 120 and
  126: the first of each size, 2n - 2n/s for n = 64. Every instance then gets that device
  as POPDIST_NODE_DEVICE_ID ("Found 16 children (expected 16) of device 120 with 1 IPUs
  each"): the device spanning the job's IPUs, which on a partition larger than the job is
  not the whole partition. `child_device` finds an instance's device from it.
"""

from __future__ import annotations

__all__ = ["device_id", "child_device"]


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def device_id(num_ipus: int, size: int, offset: int) -> int:
    """The id of the device of `size` IPUs starting at IPU `offset`, among `num_ipus`."""
    if not _power_of_two(num_ipus):
        raise ValueError(f"{num_ipus} IPUs do not form a Poplar device (not a power of two)")
    if not _power_of_two(size) or size > num_ipus:
        raise ValueError(f"no Poplar device has {size} IPUs among {num_ipus} (devices have "
                         f"1, 2, 4, ... up to {num_ipus})")
    if offset % size or not 0 <= offset <= num_ipus - size:
        raise ValueError(f"no Poplar device of {size} IPUs starts at IPU {offset} of "
                         f"{num_ipus} (they start at multiples of {size})")
    return 2 * num_ipus - 2 * num_ipus // size + offset // size


def child_device(node: int, node_ipus: int, size: int, offset: int) -> int:
    """The id of the device of `size` IPUs starting at IPU `offset` of device `node`, which
    spans `node_ipus` IPUs. The partition's own size is not needed: for a device of two or
    more IPUs, its id and size tell it (the ids of a size's devices, 2n - 2n/s up to
    2n - n/s, do not overlap from one n to the next), and a one-IPU device is its own only
    child."""
    if not _power_of_two(node_ipus):
        raise ValueError(f"{node_ipus} IPUs do not form a Poplar device (not a power of two)")
    if size == node_ipus and offset == 0:
        return node
    if node_ipus == 1:  # then size or offset is wrong: device_id says which
        return device_id(1, size, offset)
    num_ipus = node_ipus
    while device_id(num_ipus, node_ipus, 0) <= node:
        first = device_id(num_ipus, node_ipus, 0)
        if node < first + num_ipus // node_ipus:
            if not (_power_of_two(size) and size <= node_ipus) or offset % size or not (
                    0 <= offset <= node_ipus - size):
                raise ValueError(f"device {node} ({node_ipus} IPUs) has no device of {size} "
                                 f"IPUs starting at its IPU {offset}")
            return device_id(num_ipus, size, (node - first) * node_ipus + offset)
        num_ipus *= 2
    raise ValueError(f"device {node} is no device of {node_ipus} IPUs in Poplar's "
                     f"numbering (the first on n IPUs is 2n - 2n/{node_ipus})")
