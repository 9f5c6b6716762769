"""How an instance is started inside a container: pure planning, no I/O.

`wrap(container, argv, env, cwd, ...)` turns an instance's argv into the argv that runs it
inside `container` (`--container RUNTIME --container-image IMAGE --container-args ARGS`),
one function per runtime, each from the runtime's documented command line. The spawner
calls it as it starts the instance (spawner/local.py), on this host or, through the agent,
on another: only then is the instance's whole environment known (its error, progress and
stacks files, its PMI descriptor, the PMIx server's directory), and the agent starts what
it is told the same way (docs/architecture.md, "Containers").

What every runtime gets, so that a contained instance behaves as a bare one:
- the instance's environment (popdist's variables, `-x`, the worlds', the watchdog's mark);
- its working directory, bound at the same path, and started in it;
- the directories that variables of the environment name for the job's own use (`binds`):
  the error, progress and stacks files, the executable cache, the autoreport directory,
  `TMPDIR`, every `PMIX_*` path (the PMIx server's rendezvous directory), /dev/shm
  (MPICH's shared memory between instances) — each at the same path inside;
- `PMI_FD`, the PMI-1 socket: inherited as it is, except by podman, which passes on only
  descriptors 3.. (`--preserve-fds N`): the socket is moved to 3 on the way in;
- the host's network (torch.distributed's and the PMIx server's loopback addresses) and,
  where the runtime makes namespaces of its own, the host's IPC and pid namespaces (MPICH's
  shared memory and its ranks' process_vm_readv of each other by pid).

CPU and memory binding are not the runtime's business: the spawner starts the runtime
bound, and everything it starts inherits the binding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from popdist.env import (AUTOREPORT_DIRECTORY, ERROR_FILE, EXECUTABLE_CACHE_PATH,
                         PROGRESS_FILE, STACKS_FILE)

# The runtimes, each with the program that runs it (looked for on PATH on every host
# before anything starts) and whether it needs an image. bubblewrap without one runs the
# instance in the host's own root, read-only.
PROGRAMS = {"bwrap": "bwrap", "podman": "podman", "apptainer": "apptainer",
            "singularity": "singularity", "charliecloud": "ch-run", "enroot": "enroot"}
NEEDS_IMAGE = frozenset(PROGRAMS) - {"bwrap"}
# The runtimes whose process is not the program's ancestor (podman's is conmon's child): the
# spawner signals the program itself, found by the pid file the runtime writes
# (spawner/inside.py says why a signal to the runtime's process is not enough).
SIGNALLED_INSIDE = frozenset({"podman"})
RUNTIMES = tuple(PROGRAMS)
PMI_FD = "PMI_FD"
SHM = "/dev/shm"
# Variables naming a file of the job's: the directory holding it is bound.
FILE_VARIABLES = (ERROR_FILE, PROGRESS_FILE, STACKS_FILE)
# Variables naming a directory of the job's (TMPDIR: where the user's temporary files go;
# bwrap's /tmp is private).
DIRECTORY_VARIABLES = (EXECUTABLE_CACHE_PATH, AUTOREPORT_DIRECTORY, "TMPDIR")
# Bounds on what a SPAWN request may carry (spawner/protocol.py): a container is a few
# words, never a place to smuggle megabytes into an agent.
MAX_ARGS = 256
# argv[1]: a descriptor; it becomes 3, then argv[2:] runs.
MOVE_TO_3 = ("import os,sys;fd=int(sys.argv[1]);os.dup2(fd,3);os.close(fd);"
             "os.execvp(sys.argv[2],sys.argv[2:])")
MAX_TEXT = 4096


@dataclass(frozen=True)
class Container:
    """What `--container`, `--container-image` and `--container-args` ask for."""

    runtime: str
    image: str | None = None
    args: tuple[str, ...] = ()

    @property
    def program(self) -> str:
        """The executable that runs this runtime."""
        return PROGRAMS[self.runtime]

    def problem(self) -> str | None:
        """What is wrong with it, in one line; None: nothing."""
        if self.runtime not in PROGRAMS:
            return (f"--container={self.runtime}: not a runtime poprun knows (one of "
                    f"{', '.join(RUNTIMES)})")
        if self.runtime in NEEDS_IMAGE and not self.image:
            return f"--container={self.runtime} needs --container-image"
        if len(self.args) > MAX_ARGS or any(len(a) > MAX_TEXT or "\0" in a
                                            for a in (*self.args, self.image or "")):
            return "--container-args/--container-image: too long, or a NUL in them"
        return None

    def to_fields(self) -> dict:
        return {"runtime": self.runtime, "image": self.image, "args": list(self.args)}

    @classmethod
    def from_fields(cls, fields: object) -> Container | None:
        """From a SPAWN request's `container` (None: none). Raises TypeError/ValueError for
        a malformed one."""
        if fields is None:
            return None
        if not isinstance(fields, Mapping):
            raise TypeError("container must be a map")
        runtime, image, args = fields.get("runtime"), fields.get("image"), fields.get("args")
        args = () if args is None else tuple(args) if isinstance(args, list) else args
        if (not isinstance(runtime, str) or not (image is None or isinstance(image, str))
                or not isinstance(args, tuple) or not all(isinstance(a, str) for a in args)):
            raise TypeError("container: runtime, image and args must be strings")
        container = cls(runtime, image, args)
        problem = container.problem()
        if problem:
            raise ValueError(problem)
        return container


def binds(env: Mapping[str, str], cwd: str) -> tuple[str, ...]:
    """The host directories the instance needs at the same path inside: its working
    directory, /dev/shm, and those its environment names for the job (the module's
    docstring). Outermost first, each once, none below another already bound."""
    wanted = {os.path.normpath(cwd), SHM}
    for name in FILE_VARIABLES:
        if env.get(name, "").startswith("/"):
            wanted.add(os.path.dirname(os.path.normpath(env[name])))
    for name, value in env.items():
        if (name in DIRECTORY_VARIABLES or name.startswith("PMIX_")) and value.startswith("/"):
            wanted.add(os.path.normpath(value))
    out: list[str] = []
    for path in sorted(wanted, key=lambda p: (p.count("/"), p)):
        if path != "/" and not any(path.startswith(b.rstrip("/") + "/") for b in out):
            out.append(path)
    return tuple(out)


def wrap(container: Container, argv: Sequence[str], env: Mapping[str, str], cwd: str, *,
         name: str, interactive: bool = False, python: str = "python3",
         pidfile: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start `argv` inside `container`, in `cwd`. `name`
    names the container where the runtime keeps one (podman), unique per start;
    `interactive`: the instance reads poprun's stdin; `python`: an interpreter on this
    host (the spawner's own) for the one step a shell cannot do; `pidfile`: where a runtime
    of SIGNALLED_INSIDE writes the program's pid."""
    env = dict(env)
    mounts = binds(env, cwd)
    args = list(container.args)
    if container.runtime == "bwrap":
        return _bwrap(container.image, args, argv, cwd, mounts), env
    if container.runtime == "podman":
        return _podman(container.image or "", args, argv, env, cwd, mounts, name,
                       interactive, python, pidfile), env
    if container.runtime in ("apptainer", "singularity"):
        return _apptainer(container.runtime, container.image or "", args, argv, cwd,
                          mounts), env
    if container.runtime == "charliecloud":
        return _charliecloud(container.image or "", args, argv, cwd, mounts), env
    if container.runtime == "enroot":
        return _enroot(container.image or "", args, argv, env, cwd, mounts), env
    raise ValueError(f"unknown container runtime {container.runtime!r}")


def _bwrap(image: str | None, args: list[str], argv: Sequence[str], cwd: str,
           mounts: tuple[str, ...]) -> list[str]:
    """bubblewrap: the image directory (else the host's root) read-only, the host's /dev
    (devices, /dev/shm), /proc and /sys, a private /tmp, then the job's directories
    writable. `--die-with-parent`: the instance dies with what started it; bwrap does not
    make a session of its own, so the instance's process group stays poprun's to signal."""
    out = ["bwrap", "--die-with-parent", "--ro-bind", image or "/", "/",
           "--dev-bind", "/dev", "/dev", "--bind", "/proc", "/proc", "--ro-bind", "/sys", "/sys",
           "--tmpfs", "/tmp"]
    for path in mounts:
        out += ["--dev-bind" if path == SHM else "--bind", path, path]
    return [*out, "--chdir", cwd, *args, "--", *argv]


def _podman(image: str, args: list[str], argv: Sequence[str], env: dict[str, str], cwd: str,
            mounts: tuple[str, ...], name: str, interactive: bool, python: str,
            pidfile: str | None) -> list[str]:
    """podman: removed at its end (`--rm`), in the host's network, IPC (/dev/shm) and pid
    namespaces (MPICH's ranks read each other's memory by pid, process_vm_readv; the
    instance is no pid 1, which would ignore SIGTERM; the stacks signal finds it), the
    environment passed by name (`-e NAME`: the values stay off the command line), the job's
    directories bound. Its PMI socket is moved to descriptor 3 on the way in (by `python`:
    a POSIX shell cannot name a descriptor above 9), the one place `--preserve-fds` can
    pass it. `--pidfile`: where the spawner finds the program to signal."""
    out = ["podman", "run", "--rm", "--name", name, "--network=host", "--ipc=host",
           "--pid=host", "--log-driver=none", "-w", cwd]
    if pidfile:
        out.append(f"--pidfile={pidfile}")
    if interactive:
        out.append("-i")
    for path in mounts:
        if path != SHM:  # --ipc=host brings the host's
            out += ["-v", f"{path}:{path}"]
    for variable in sorted(env):
        out += ["-e", variable]
    prefix: list[str] = []
    fd = env.get(PMI_FD)
    if fd is not None and fd.isdigit():
        out.append("--preserve-fds=1")
        if fd != "3":
            env[PMI_FD] = "3"
            prefix = [python, "-S", "-c", MOVE_TO_3, fd]
    return [*prefix, *out, *args, image, *argv]


def _apptainer(program: str, image: str, args: list[str], argv: Sequence[str], cwd: str,
               mounts: tuple[str, ...]) -> list[str]:
    """Apptainer / Singularity `exec`: it passes the environment and open descriptors on
    by default and binds /dev (so /dev/shm) and /tmp itself; the job's directories are
    bound (`--bind`), and the instance starts in `cwd` (`--pwd`)."""
    out = [program, "exec", "--pwd", cwd]
    for path in mounts:
        if path != SHM:
            out += ["--bind", f"{path}:{path}"]
    return [*out, *args, image, *argv]


def _charliecloud(image: str, args: list[str], argv: Sequence[str], cwd: str,
                  mounts: tuple[str, ...]) -> list[str]:
    """Charliecloud `ch-run`: it passes the environment and descriptors on and binds /dev
    itself; the job's directories are bound (`-b SRC:DST`, which must exist in the image)
    and the instance starts in `cwd` (`-c`)."""
    out = ["ch-run", "-c", cwd]
    for path in mounts:
        if path != SHM:
            out += ["-b", f"{path}:{path}"]
    return [*out, *args, image, "--", *argv]


def _enroot(image: str, args: list[str], argv: Sequence[str], env: Mapping[str, str],
            cwd: str, mounts: tuple[str, ...]) -> list[str]:
    """enroot `start` (pyxis's runtime): the environment passed by name (`--env NAME`), the
    job's directories mounted (`--mount SRC:DST`); enroot has no working-directory option,
    so `env --chdir` (coreutils, in the image) starts the instance in `cwd`."""
    out = ["enroot", "start"]
    for path in mounts:
        if path != SHM:
            out += ["--mount", f"{path}:{path}"]
    for variable in sorted(env):
        out += ["--env", variable]
    return [*out, *args, image, "env", f"--chdir={cwd}", *argv]


def exit_status(container: Container | None, returncode: int) -> int:
    """The instance's exit as subprocess gives a bare one's (negative: a signal), from its
    runtime's. `podman run` exits with its container's status, 128+N where a signal N ended
    it (a shell's convention: a program's own `exit(128+N)` reads the same); the other
    runtimes' processes die of the signal themselves (they are in the instance's process
    group) or exec the instance."""
    if container is not None and container.runtime == "podman" and 128 < returncode < 128 + 65:
        return 128 - returncode
    return returncode


def cleanup(container: Container, name: str) -> list[str] | None:
    """The command that removes the container `name` of `container`'s runtime whatever
    became of its processes, for the runtimes that keep one beside them (podman's record,
    its mounts and its conmon, which outlive a SIGKILLed `podman run`, and which a
    `podman run` signalled while it makes the container leaves behind, exiting 0); None:
    nothing to remove once the processes are gone. A no-op for one already removed."""
    if container.runtime == "podman":
        return ["podman", "rm", "--force", "--ignore", "--time", "0", name]
    return None
