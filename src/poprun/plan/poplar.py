"""What poprun tells Poplar: target options for offline compilation (`--offline-target`) and
the profiling directory (`--autoreport-dir`), guide §2.6 and §2.7. Pure: values in, values out.

Target options are the JSON object Poplar reads from `POPLAR_TARGET_OPTIONS`. For a real
partition the V-IPU server supplies them; offline, `--offline-target` names the system the
program is compiled for. The values below are those PopRun passes for a partition of that
shape (seen in its `-vv` log for a POD64: `{"ipuLinkDomainSize":"64","ipuLinkConfiguration":
"slidingWindow","ipuLinkTopology":"torus","gatewayMode":"true","instanceSize":"64"}`):

| target                | IPUs | ipuLinkDomainSize | ipuLinkConfiguration | ipuLinkTopology | gatewayMode |
|-----------------------|------|-------------------|----------------------|-----------------|-------------|
| pod4 (one IPU-M2000)  | 4    | 4                 | default              | mesh            | false       |
| pod16                 | 16   | 16                | slidingWindow        | torus           | true        |
| pod64                 | 64   | 64                | slidingWindow        | torus           | true        |
| pod128, pod256        | N    | 64 (one ILD per 64 IPUs, joined by GW-Links) | slidingWindow | torus | true |

`bow-podN` is the same as `podN`: a Bow-2000 has the IPU-M2000's IPU-Link layout. A V-IPU
partition's topology is its own, not its size's (plan/partition.py, `link_topology`): PopRun
3.1.0 on a reconfigurable 64-IPU partition gives "mesh".
`instanceSize` is the IPUs one instance drives (replicas per instance x IPUs per replica).
Values already in the environment's `POPLAR_TARGET_OPTIONS` win over the target's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from spawner.uncompiled import dataclass  # nothing compiled at import (spawner/uncompiled.py)

from poprun.errors import ConfigError

ILD_SIZE = 64  # IPUs in one IPU-Link domain of a POD64 and larger
MESH_MAX = 4  # IPUs of the largest IPU-Link domain that is a mesh (one IPU-M2000)


@dataclass(frozen=True)
class OfflineTarget:
    """One system `--offline-target` can name."""

    name: str
    ipus: int

    def options(self, ipus_per_instance: int) -> dict[str, str]:
        # One IPU-M2000 (4 IPUs) is used without its gateway; anything bigger goes through it.
        return link_options(min(self.ipus, ILD_SIZE), ipus_per_instance,
                            gateway=self.ipus > MESH_MAX)


TOPOLOGIES = ("mesh", "torus")  # Poplar's values of ipuLinkTopology


def link_options(domain_size: int, ipus_per_instance: int, gateway: bool,
                 topology: str | None = None) -> dict[str, str]:
    """The target options of an IPU-Link domain of `domain_size` IPUs (an offline target's or
    a V-IPU partition's): up to MESH_MAX IPUs a mesh, above that a sliding window, a torus
    unless `topology` (a V-IPU partition's own, plan/partition.py) says otherwise."""
    ring = domain_size > MESH_MAX
    return {
        "ipuLinkDomainSize": str(domain_size),
        "ipuLinkConfiguration": "slidingWindow" if ring else "default",
        "ipuLinkTopology": topology or ("torus" if ring else "mesh"),
        "gatewayMode": "true" if gateway else "false",
        "instanceSize": str(ipus_per_instance),
    }


def merged_target_options(implied: Mapping[str, str], own: Mapping[str, str]) -> str:
    """`POPLAR_TARGET_OPTIONS` as instances get it: what the system implies, overridden by the
    environment's own values (the user set those on purpose), as compact JSON."""
    return json.dumps({**implied, **own}, separators=(",", ":"))


OFFLINE_TARGETS = {t.name: t for t in (
    *(OfflineTarget(f"pod{n}", n) for n in (4, 16, 64, 128, 256)),
    *(OfflineTarget(f"bow-pod{n}", n) for n in (4, 16, 64, 128, 256)),
)}

AUTOREPORT_CONFLICT = ("autoreport-dir command line argument cannot be specified when "
                       "POPLAR_ENGINE_OPTIONS contains autoReport.directory setting.")


def offline_target(name: str) -> OfflineTarget:
    try:
        return OFFLINE_TARGETS[name.lower()]
    except KeyError:
        raise ConfigError(f"--offline-target={name!r}: use one of "
                          f"{', '.join(OFFLINE_TARGETS)}") from None


def target_options(target: OfflineTarget, ipus_per_instance: int,
                   from_environment: str | None) -> str:
    """The `POPLAR_TARGET_OPTIONS` instances get: the target's, overridden by the
    environment's own (the user set those on purpose)."""
    return merged_target_options(target.options(ipus_per_instance),
                                 parse_options(from_environment, "POPLAR_TARGET_OPTIONS"))


def parse_options(text: str | None, name: str) -> dict[str, str]:
    """A Poplar options variable: a JSON object (empty when unset)."""
    if not text or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {text!r}")
    return value


def check_autoreport(engine_options: list[str | None]) -> None:
    """`--autoreport-dir` with a `POPLAR_ENGINE_OPTIONS` that already sets autoReport.directory
    (from the environment or an `-x` in the mpi-args) is an error (guide §2.7.3): PopDist gives
    every instance its own directory, which a fixed one would defeat. Found as text, not by
    parsing JSON: the guide's own `--instance-mpi-local-args '0:-x
    POPLAR_ENGINE_OPTIONS='{"autoReport.directory":"..."}''` reaches poprun with the shell's
    quote removal done, `{autoReport.directory:...}`, and must still be refused."""
    if any(text and "autoReport.directory" in text for text in engine_options):
        raise ConfigError(AUTOREPORT_CONFLICT)
