"""Pod mode's process side: the job's secret kept out of every environment block an instance
can read, and a follower pod's run (docs/architecture.md, "Pod mode").

The secret comes from a Kubernetes Secret, as POPRUN_POD_SECRET or a mounted file
(--pod-secret-file). An environment variable stays in /proc/PID/environ for the process's
life whatever os.environ later drops (that file shows the block the process was started
with), and an instance may read its ancestors' blocks: so poprun, seeing the variable,
starts itself again at once (`hide_secret`: execve of the same command) without it, the
value handed over on a pipe (POPRUN_POD_SECRET_FD). Nothing poprun starts inherits it.

A follower (every pod but 0) dials the leader's port, retrying while the leader's name does
not resolve yet and its port does not answer (pods start in any order), within
--pod-timeout; proves the secret as a Slurm node's agent does (spawner/callback.py), then
becomes the leader's agent on that connection (spawner/agent.py). It exits with the agent's
status: 0 when the leader ended the job (it says goodbye first), 69 (LAUNCHER_LOST_STATUS)
when the leader went without that, or fell silent for --host-timeout (the agent killed
what ran here), 69 as well when the leader could not be reached, 2 when it did not hold the
secret.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

from poprun.errors import ConfigError
from poprun.plan.config import LaunchConfig
from poprun.plan.pods import SECRET_FD_VARIABLE, SECRET_VARIABLE, Pod

MIN_SECRET = 16  # bytes: less is guessable
MAX_SECRET = 4096  # bytes read (a pipe holds at least as much: the write never blocks)
REFUSED_STATUS = 2  # a follower whose leader does not hold the secret: nothing ran

_secret: bytes | None = None  # the key, once read (load_secret)


def hide_secret() -> None:
    """Start this command again without POPRUN_POD_SECRET in its environment, the value on
    a pipe (the module docstring); returns only where the variable is not set."""
    value = os.environ.get(SECRET_VARIABLE)
    if value is None:
        return
    read_end, write_end = os.pipe()
    os.write(write_end, value.encode(errors="surrogateescape")[:MAX_SECRET])
    os.close(write_end)
    os.set_inheritable(read_end, True)
    env = {k: v for k, v in os.environ.items() if k != SECRET_VARIABLE}
    env[SECRET_FD_VARIABLE] = str(read_end)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def load_secret(config: LaunchConfig, environ: Mapping[str, str]) -> bytes:
    """The job's key, from the pipe `hide_secret` left, POPRUN_POD_SECRET (a caller in
    this process: the Python API), or --pod-secret-file; ConfigError (one line) if none."""
    global _secret
    text = _from_pipe(environ) or environ.get(SECRET_VARIABLE, "").encode()
    if config.pod_secret_file:
        from poprun.plan.files import read_small_file

        text = read_small_file(config.pod_secret_file, "--pod-secret-file", MAX_SECRET,
                               "a secret").encode()
    text = text.strip()
    if not text:
        raise ConfigError("pod mode needs the job's shared secret: set POPRUN_POD_SECRET "
                          "from a Kubernetes Secret, or give --pod-secret-file "
                          "(docs/kubernetes.md)")
    if len(text) < MIN_SECRET:
        raise ConfigError(f"the pod secret is {len(text)} bytes: pod mode needs at least "
                          f"{MIN_SECRET} (e.g. `openssl rand -hex 32`)")
    from _blake2 import blake2b

    _secret = blake2b(text, digest_size=32).digest()  # callback.proof's key: <= 64 bytes
    return _secret


def pod_secret() -> bytes:
    """The key load_secret read (the leader's listener proves it)."""
    if _secret is None:
        raise RuntimeError("pod mode without a secret loaded")
    return _secret


def _from_pipe(environ: Mapping[str, str]) -> bytes:
    fd_text = environ.get(SECRET_FD_VARIABLE, "")
    if not fd_text.isdigit():
        return b""
    fd = int(fd_text)
    try:
        data = os.read(fd, MAX_SECRET)
        os.close(fd)
    except OSError:
        return b""
    os.environ.pop(SECRET_FD_VARIABLE, None)
    return data


# --- a follower ---------------------------------------------------------------------------

def follow(pod: Pod, secret: bytes, config: LaunchConfig,
           say: Callable[[str], None]) -> int:
    """Serve the leader as its agent for pod `pod.index`; the exit status (module docstring).
    `say`: a line for -v."""
    from spawner.callback import CallbackError

    try:
        sock = dial(pod, secret, config.pod_timeout, say)
    except CallbackError as exc:
        sys.stderr.write(f"poprun: error: pod {pod.index}: {exc}: refused, nothing runs here\n")
        return REFUSED_STATUS
    except OSError as exc:
        from spawner.agent import LAUNCHER_LOST_STATUS

        sys.stderr.write(f"poprun: error: pod {pod.index}: cannot reach the leader at "
                         f"{pod.leader}:{pod.port} within --pod-timeout "
                         f"{config.pod_timeout:g} s: {exc}\n")
        return LAUNCHER_LOST_STATUS
    say(f"pod {pod.index}: connected to the leader at {pod.leader}:{pod.port}; serving it")
    # The agent speaks on stdin/stdout; a socket there is its launcher's stream.
    os.dup2(sock.fileno(), 0)
    os.dup2(sock.fileno(), 1)
    sock.close()
    from spawner import agent

    agent.main(farewell=True)  # exits with the agent's status


def dial(pod: Pod, secret: bytes, timeout: float, say: Callable[[str], None]) -> socket.socket:
    """The proven connection to the leader; retried while its name does not resolve or its
    port does not answer, within `timeout` seconds. Raises CallbackError (the leader does
    not hold the secret: no retry) or the last OSError."""
    from spawner.callback import CALLBACK_VARIABLE, STEP_VARIABLE, connect_back
    from spawner.podagents import STEP

    host = f"[{pod.leader}]" if ":" in pod.leader else pod.leader
    deadline, said = time.monotonic() + timeout, set()

    def retrying(exc: BaseException) -> None:
        if str(exc) not in said:  # once per kind of failure, not once per try
            said.add(str(exc))
            left = deadline - time.monotonic()
            say(f"pod {pod.index}: the leader at {pod.leader}:{pod.port} is not there "
                f"yet ({exc}); trying again for up to {left:.0f} s")

    # connect_back's identity: the node's name and its task, as under Slurm; taken from
    # this mapping, never from the environment an instance inherits. Pods start in any
    # order: the leader's name may resolve, and its port answer, only later.
    ask = {CALLBACK_VARIABLE: f"{host}:{pod.port}", STEP_VARIABLE: STEP,
           "SLURMD_NODENAME": pod.label, "SLURM_PROCID": str(pod.index)}
    return connect_back(ask, secret, deadline, retrying)
