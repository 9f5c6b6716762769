"""poprun: launch instances of a program with replicas divided among them, without MPI.

    from poprun import launch, LaunchConfig
    result = await launch(LaunchConfig(program=("python3", "train.py"), num_instances=2,
                                       num_replicas=2, offline_mode=True))

Everything but the version and the errors is imported on first use: `poprun --version` and
the per-host agent (which only needs `poprun._version`) stay fast.
"""

from poprun._version import __version__
from poprun.errors import ConfigError, InternalError, LaunchError, PoprunError

__all__ = [
    "ConfigError",
    "InstanceResult",
    "InternalError",
    "LaunchConfig",
    "LaunchError",
    "LaunchResult",
    "PoprunError",
    "__version__",
    "launch",
]


def __getattr__(name: str):
    if name == "launch":
        from poprun.run.session import launch

        return launch
    if name == "LaunchConfig":
        from poprun.plan.config import LaunchConfig

        return LaunchConfig
    if name in ("LaunchResult", "InstanceResult"):
        from poprun import result

        return getattr(result, name)
    raise AttributeError(f"module 'poprun' has no attribute {name!r}")
