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
"""

from __future__ import annotations

__all__ = ["device_id", "whole_device_id", "ipus_of"]


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


def whole_device_id(num_ipus: int) -> int:
    """The id of the device that spans all `num_ipus` IPUs (2n - 2)."""
    return device_id(num_ipus, num_ipus, 0)


def ipus_of(whole_id: int) -> int:
    """How many IPUs there are, given the id of the device that spans them all."""
    num_ipus = (whole_id + 2) // 2
    if whole_id < 0 or whole_id % 2 or not _power_of_two(num_ipus):
        raise ValueError(f"device {whole_id} does not span every IPU of a partition (those "
                         "are 0, 2, 6, 14, 30, 62, 126, ...: 2n-2 for n IPUs)")
    return num_ipus
