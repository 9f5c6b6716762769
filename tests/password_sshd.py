"""Loopback sshd hosts that accept passwords, and a throwaway local user to log in as.

What is real: the OpenSSH ``sshd`` servers of ``sshd_hosts.py``, with two lines of their config
changed — ``PasswordAuthentication yes`` and ``AuthorizedKeysFile .ssh/authorized_keys`` (the
logged-in user's own file, so a key installed over SSH is what authorises the next login) —
and a real local account (``useradd``, ``chpasswd``; removed with ``userdel``) whose password
sshd checks against /etc/shadow. Creating users needs root: without it the tests that need one
skip, or fail when POPRUN_REQUIRE_SSHD=1.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from requires import skip_or_fail
import sshd_hosts
from sshd_hosts import SshHosts, require_tool, start_ssh_hosts

__all__ = ["LocalUser", "require_root", "start_password_hosts", "throwaway_user"]


@dataclass(frozen=True)
class LocalUser:
    name: str
    password: str
    home: Path
    uid: int


def require_root(what: str) -> None:
    if os.getuid() == 0:
        return
    skip_or_fail(f"{what} needs root (it creates a throwaway user with useradd)",
                 "POPRUN_REQUIRE_SSHD")


@contextlib.contextmanager
def throwaway_user() -> Iterator[LocalUser]:
    """A new local user with a random password and an empty home; removed afterwards."""
    require_root("a password login")
    for tool in ("useradd", "chpasswd", "userdel"):
        require_tool(tool, f"/usr/sbin/{tool}")
    name = f"poprun-{secrets.token_hex(4)}"
    # Not under pytest's tmp dir: that is 0700 root, and sshd reads the user's files as them.
    home = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    _run("useradd", "-M", "-d", str(home), "-s", "/bin/sh", name)
    try:
        uid = int(_run("id", "-u", name).strip())
        os.chown(home, uid, -1)
        password = secrets.token_urlsafe(12)
        _run("chpasswd", input=f"{name}:{password}\n")
        yield LocalUser(name, password, home, uid)
    finally:
        _run("userdel", "-f", name)  # -f: even if a session of it is still ending
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def start_password_hosts(n: int, tmp_path: Path) -> Iterator[SshHosts]:
    """``start_ssh_hosts`` whose servers also accept passwords and read ~/.ssh/authorized_keys
    (instead of the harness's shared file: the harness key authorises nobody there)."""
    real_write = sshd_hosts._write_sshd_config

    def write_config(host: sshd_hosts.SshHost, authorized_keys: Path,
                     setenv: Mapping[str, str] | None = None, extra: Sequence[str] = ()) -> None:
        real_write(host, authorized_keys, setenv, extra)
        config = host.dir / "sshd_config"
        text = config.read_text()
        changed = text.replace("PasswordAuthentication no", "PasswordAuthentication yes").replace(
            f"AuthorizedKeysFile {authorized_keys}", "AuthorizedKeysFile .ssh/authorized_keys")
        # If the harness's config ever changes shape, fail here rather than test the wrong thing.
        assert changed.count("PasswordAuthentication yes") == 1, text
        assert "AuthorizedKeysFile .ssh/authorized_keys" in changed, text
        config.write_text(changed)

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setattr(sshd_hosts, "_write_sshd_config", write_config)
        hosts = stack.enter_context(start_ssh_hosts(n, tmp_path))
        patch.undo()
        yield hosts


def _run(*argv: str, input: str | None = None) -> str:
    done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout
