"""The container runtimes the tests run for real: bubblewrap and podman (runc, the cgroupfs
manager), and a podman image built on this machine (no registry is reachable).

The image is a root filesystem from this machine's own files: /usr and /etc (less what no
test runs: documentation, the JVM, LLVM, the Cloud SDK...), imported with `podman import`.
Building it takes ~50 s (1.7 GB, on a 2-core machine); it is kept in podman's storage under
a tag naming its recipe, so a machine builds it once. The instances' Python (this
interpreter's prefix, its base installation's) and poprun's sources are bound into the
container at the same paths, as a user binds a data set.

Where a runtime cannot run, the tests skip, or fail where POPRUN_REQUIRE_CONTAINERS=1 (CI).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

import requires

from conftest import SRC

# What of this machine the image holds (relative to /), and what it leaves out.
IMAGE_PATHS = ("usr", "etc", "bin", "lib", "lib64", "sbin")
IMAGE_EXCLUDED = ("usr/lib/google-cloud-sdk", "usr/lib/jvm", "usr/lib/llvm-*",
                  "usr/lib/postgresql", "usr/share/doc", "usr/share/man", "usr/share/locale",
                  "usr/local", "usr/include", "usr/lib/gcc", "etc/containers/storage.conf")
IMAGE_RECIPE = hashlib.sha256(repr((IMAGE_PATHS, IMAGE_EXCLUDED)).encode()).hexdigest()[:12]
IMAGE = f"localhost/poprun-test-rootfs:{IMAGE_RECIPE}"
IMAGE_BUILD_TIMEOUT = 600
CAP_SYS_RESOURCE = 24


def skip_or_fail(reason: str) -> None:
    """Skip, or fail where POPRUN_REQUIRE_CONTAINERS=1 (tests/requires.py)."""
    requires.skip_or_fail(reason, "POPRUN_REQUIRE_CONTAINERS")


def has_capability(number: int) -> bool:
    with open("/proc/self/status") as f:
        effective = next(line for line in f if line.startswith("CapEff:")).split()[1]
    return bool(int(effective, 16) >> number & 1)


def limits_args() -> list[str]:
    """podman sets RLIMIT_NOFILE and RLIMIT_NPROC in the container (its defaults: over a
    million files for root); runc's prlimit of them is refused where the process lacks
    CAP_SYS_RESOURCE (this sandbox: `error setting rlimit type 7: operation not permitted`)
    above the limits runc itself runs under. There the tests ask for the limits in force
    (nproc: conmon's, at most 32768), as a user of such a machine must (docs/containers.md,
    "podman")."""
    if has_capability(CAP_SYS_RESOURCE):
        return []
    import resource

    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    procs = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return [f"--ulimit=nofile={files}:{files}", f"--ulimit=nproc={procs}:{procs}"]


def python_paths() -> list[str]:
    """This interpreter, its base installation and poprun's sources: bound at the same paths
    (podman's image has none of them; bwrap's /tmp is private, and a clone or venv may be
    there, as CI's is)."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, SRC)}
    return sorted(paths | {sys.prefix, SRC})


def podman_image() -> str:
    """The test image, built now if this machine has none of this recipe."""
    exists = subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True,
                            timeout=120)
    if exists.returncode == 0:
        return IMAGE
    excludes = [f"--exclude={p}" for p in IMAGE_EXCLUDED]
    tar = subprocess.Popen(["tar", "-C", "/", *excludes, "-cf", "-", *IMAGE_PATHS],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        imported = subprocess.run(["podman", "import", "-", IMAGE], stdin=tar.stdout,
                                  capture_output=True, text=True, timeout=IMAGE_BUILD_TIMEOUT)
    finally:
        tar.stdout.close()
        tar.wait(timeout=60)
    if imported.returncode != 0:
        skip_or_fail(f"podman import of this machine's root filesystem failed: "
                f"{imported.stderr.strip()[-300:]}")
    return IMAGE


def podman_probe(image: str) -> str | None:
    """Why podman cannot run a container here, or None."""
    try:
        ran = subprocess.run(["podman", "run", "--rm", *limits_args(), image, "true"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"podman run: {exc}"
    return None if ran.returncode == 0 else f"podman run: {ran.stderr.strip()[-300:]}"


def bwrap_probe() -> str | None:
    try:
        ran = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev",
                              "--die-with-parent", "true"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap: {exc}"
    return None if ran.returncode == 0 else f"bwrap: {ran.stderr.strip()[-300:]}"


def runtime_options(runtime: str) -> list[str]:
    """poprun's options that run each instance in `runtime` here (skips where it cannot)."""
    if shutil.which({"bwrap": "bwrap", "podman": "podman"}[runtime]) is None:
        skip_or_fail(f"{runtime} is not installed (apt-get install bubblewrap podman runc)")
    if runtime == "bwrap":
        problem = bwrap_probe()
        if problem:
            skip_or_fail(problem)
        binds = " ".join(f"--ro-bind {p} {p}" for p in python_paths())
        return ["--container=bwrap", f"--container-args={binds}"]
    image = podman_image()
    problem = podman_probe(image)
    if problem:
        skip_or_fail(problem)
    args = " ".join([*limits_args(), *(f"--volume={p}:{p}:ro" for p in python_paths())])
    return ["--container=podman", f"--container-image={image}", f"--container-args={args}"]


def podman_containers(prefix: str = "poprun-") -> list[str]:
    """The names of podman's containers (any state) that start with `prefix`."""
    listed = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"],
                            capture_output=True, text=True, timeout=60, check=True)
    return [n for n in listed.stdout.split() if n.startswith(prefix)]
