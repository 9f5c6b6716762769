"""`--distribute-ssh-key`: make key-based SSH work on every host, asking the password once.

What PopRun did with `ssh-copy-id`, done over asyncssh: pick (or generate, when a key type is
given) a key pair, ask the password once without echo, connect to every host with it, and
append the public key to `~/.ssh/authorized_keys` where it is not there yet (creating `~/.ssh`
0700 and the file 0600 when missing; a key already present, with any options or comment, is
never added twice). Hosts are updated one after another: clusters often share home
directories, and two hosts appending to the same file at once would duplicate the key.

asyncssh is imported only inside the functions that use it (it costs ~250 ms).
"""

from __future__ import annotations

import asyncio
import enum
import getpass
import os
import shlex
import socket
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spawner import ssh

from poprun.errors import ConfigError, LaunchError

__all__ = [
    "HostKeyResult", "KeyDistributionError", "KeyStatus", "KeyType", "PublicKey",
    "distribute_ssh_key", "find_key_path", "install_key", "prepare_key", "read_password",
]


class KeyType(str, enum.Enum):
    """`--distribute-ssh-key-type`: the kind of key to generate."""

    DSA = "dsa"
    """DSA (1024 bit). OpenSSH servers refuse it by default since 7.0; 9.8 removed it."""
    ECDSA = "ecdsa"
    """ECDSA on NIST P-256."""
    ED25519 = "ed25519"
    """Ed25519: small, fast, what ssh-keygen generates by default."""
    RSA = "rsa"
    """RSA, 3072 bit (ssh-keygen's default size)."""


_ALGORITHMS = {
    KeyType.DSA: ("ssh-dss", {}),
    KeyType.ECDSA: ("ecdsa-sha2-nistp256", {}),
    KeyType.ED25519: ("ssh-ed25519", {}),
    KeyType.RSA: ("ssh-rsa", {"key_size": 3072}),
}
# Which existing key to use when no type is given: OpenSSH's own order of default identities.
_DEFAULT_ORDER = (KeyType.RSA, KeyType.ECDSA, KeyType.ED25519, KeyType.DSA)


class KeyStatus(str, enum.Enum):
    """What happened on one host."""

    ADDED = "added"
    """The key was appended to the host's authorized_keys."""
    PRESENT = "already present"
    """authorized_keys already held the key; the file was not changed."""
    FAILED = "failed"
    """The host could not be reached or updated; `HostKeyResult.message` says why."""


@dataclass(frozen=True)
class PublicKey:
    """The key pair being distributed."""

    path: Path  # the private key; the public one is path + ".pub"
    line: str  # "type base64 comment", as it goes into authorized_keys
    generated: bool  # created by this run

    @property
    def blob(self) -> str:
        """The base64 field: what identifies the key whatever its options and comment."""
        return self.line.split()[1]


@dataclass(frozen=True)
class HostKeyResult:
    """One host's outcome; `message` is one line naming the host."""

    target: Any
    status: KeyStatus
    message: str


class KeyDistributionError(LaunchError):
    """The key could not be installed on some hosts; `results` has every host's outcome."""

    def __init__(self, results: dict[Any, HostKeyResult]) -> None:
        self.results = results
        failed = [r for r in results.values() if r.status is KeyStatus.FAILED]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        super().__init__(f"--distribute-ssh-key: could not install the key on {len(failed)} "
                         f"of {len(results)} hosts: {failed[0].message}{more}")


# -- the key ----------------------------------------------------------------------------------


def find_key_path(path: str | os.PathLike[str] | None, key_type: KeyType | None) -> Path:
    """The private key file meant by `--distribute-ssh-key-path` (a key file, or the folder
    holding it as in PopRun's guide; default ~/.ssh) and `--distribute-ssh-key-type`."""
    where = Path(path or "~/.ssh").expanduser()
    # A folder when it is one or is spelled as one ("keys/"); the default ~/.ssh always is.
    if path is not None and not (where.is_dir() or os.fspath(path).endswith(os.sep)):
        return where
    if key_type is not None:
        return where / f"id_{key_type.value}"
    for candidate in _DEFAULT_ORDER:
        if (where / f"id_{candidate.value}").is_file():
            return where / f"id_{candidate.value}"
    raise ConfigError(f"--distribute-ssh-key: no key (id_rsa, id_ecdsa, id_ed25519, id_dsa) in "
                      f"{where}; give --distribute-ssh-key-type to generate one")


def prepare_key(path: str | os.PathLike[str] | None = None,
                key_type: KeyType | str | None = None) -> PublicKey:
    """The existing key at the path, or a new one of `key_type` when there is none."""
    key_type = _key_type(key_type)
    key_path = find_key_path(path, key_type)
    if key_path.exists():
        return PublicKey(key_path, _public_line(key_path), generated=False)
    if key_type is None:
        raise ConfigError(f"--distribute-ssh-key: {key_path} does not exist; give "
                          "--distribute-ssh-key-type to generate a key there")
    return _generate(key_path, key_type)


def _key_type(value: KeyType | str | None) -> KeyType | None:
    if value is None or isinstance(value, KeyType):
        return value
    try:
        return KeyType(value)
    except ValueError:
        choices = ", ".join(t.value for t in KeyType)
        raise ConfigError(f"--distribute-ssh-key-type: {value!r} is not one of {choices}") \
            from None


def _public_line(key_path: Path) -> str:
    pub = Path(f"{key_path}.pub")
    try:
        text = pub.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--distribute-ssh-key: cannot read the public key {pub}: "
                          f"{exc.strerror}") from None
    if len(text.split()) < 2 or "\n" in text:
        raise ConfigError(f"--distribute-ssh-key: {pub} is not a one-line OpenSSH public key")
    return text


def _generate(key_path: Path, key_type: KeyType) -> PublicKey:
    import asyncssh

    algorithm, params = _ALGORITHMS[key_type]
    comment = f"{getpass.getuser()}@{socket.gethostname()}"
    try:
        key = asyncssh.generate_private_key(algorithm, comment=comment, **params)
    except ValueError as exc:  # asyncssh.KeyGenerationError: algorithm not available
        raise ConfigError(f"--distribute-ssh-key-type {key_type.value}: this installation "
                          f"(asyncssh {asyncssh.__version__}) cannot generate such keys: "
                          f"{exc}") from None
    key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Unencrypted, like `ssh-keygen -N ''`: launches must not need a passphrase.
    _write_new(key_path, key.export_private_key(), 0o600)
    line = key.export_public_key().decode().strip()
    _write_new(Path(f"{key_path}.pub"), (line + "\n").encode(), 0o644)
    return PublicKey(key_path, line, generated=True)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL: never overwrite a key that appeared meanwhile; the mode applies at creation.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as exc:
        raise ConfigError(f"--distribute-ssh-key: cannot create {path}: {exc.strerror}") \
            from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# -- the password -----------------------------------------------------------------------------


def read_password(hosts: Iterable[Any], prompt: Callable[[str], str] = getpass.getpass) -> str:
    """Ask once, without echo. Fails rather than echo when there is no terminal."""
    names = [str(h) for h in hosts]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    with warnings.catch_warnings():
        # getpass falls back to reading stdin *with echo* when it has no terminal (it warns).
        warnings.simplefilter("error", getpass.GetPassWarning)
        try:
            return prompt(f"SSH password for {shown} (asked once): ")
        except (EOFError, getpass.GetPassWarning):
            raise ConfigError("--distribute-ssh-key: no terminal to ask the SSH password on") \
                from None


# -- the hosts ----------------------------------------------------------------------------------

# One line of POSIX sh (the login shell may be csh: no newline, no `!`). stdin: blob, then the
# key line. A key counts as present when any line has its base64 blob as a field.
_INSTALL = "; ".join([
    "umask 077",
    'f="$HOME/.ssh/authorized_keys"',
    'mkdir -p "$HOME/.ssh" && touch "$f" || exit 3',
    "read -r blob",
    "read -r key",
    'if awk -v b="$blob" \'{for (i = 1; i <= NF; i++) if ($i == b) f = 1} END {exit f ? 0 : 1}\''
    ' "$f"; then echo present; exit 0; fi',
    # A file not ending in a newline would glue the key onto its last line.
    'if [ -s "$f" ] && [ -n "$(tail -c 1 "$f")" ]; then echo >> "$f"; fi',
    "printf '%s\\n' \"$key\" >> \"$f\" && echo added",
])


async def install_key(targets: Iterable[Any], key: PublicKey, password: str, *,
                      fanout: int = ssh.DEFAULT_FANOUT,
                      timeout: float = ssh.DEFAULT_TIMEOUT) -> dict[Any, HostKeyResult]:
    """Connect to every target with `password` (concurrently), then add the key to each
    host's authorized_keys in turn. Never raises for one host's failure: see the results."""
    from poprun.run.fleet import connect  # the one place hosts are connected to

    connected = await connect(list(targets), fanout=fanout, timeout=timeout,
                              keep_going=True, password=password)
    results = {f.target: HostKeyResult(f.target, KeyStatus.FAILED, f.message)
               for f in connected.failures}
    conns = connected.connections
    try:
        for target, conn in conns.items():
            results[target] = await _install_on(target, conn, key, timeout)
    finally:
        await ssh.close_all(conns.values())
    return {t: results[t] for t in connected.outcomes}


async def _install_on(target: Any, conn: Any, key: PublicKey, timeout: float) -> HostKeyResult:
    import asyncssh

    try:
        async with asyncio.timeout(timeout):
            done = await conn.run(f"sh -c {shlex.quote(_INSTALL)}",
                                  input=f"{key.blob}\n{key.line}\n")
    except TimeoutError:
        return HostKeyResult(target, KeyStatus.FAILED,
                             f"{target}: updating authorized_keys took over {timeout:g}s")
    except (asyncssh.Error, OSError) as exc:  # connection lost, channel refused...
        return HostKeyResult(target, KeyStatus.FAILED, f"{target}: {exc}")
    said = str(done.stdout or "").strip()
    if done.exit_status == 0 and said in ("added", "present"):
        status = KeyStatus.ADDED if said == "added" else KeyStatus.PRESENT
        return HostKeyResult(target, status, f"{target}: key {status.value}")
    why = str(done.stderr or "").strip().replace("\n", " ") or f"exit status {done.exit_status}"
    return HostKeyResult(target, KeyStatus.FAILED,
                         f"{target}: could not update ~/.ssh/authorized_keys: {why}")


async def distribute_ssh_key(targets: Iterable[Any], *, path: str | os.PathLike[str] | None = None,
                             key_type: KeyType | str | None = None,
                             prompt: Callable[[str], str] = getpass.getpass,
                             fanout: int = ssh.DEFAULT_FANOUT,
                             timeout: float = ssh.DEFAULT_TIMEOUT
                             ) -> tuple[PublicKey, dict[Any, HostKeyResult]]:
    """The whole `--distribute-ssh-key` step. Raises `ConfigError` (no key, bad type, no
    terminal) or `KeyDistributionError` when any host failed; otherwise returns the key and
    every host's result, for a per-host report."""
    targets = list(targets)
    key = prepare_key(path, key_type)
    password = read_password(targets, prompt)
    results = await install_key(targets, key, password, fanout=fanout, timeout=timeout)
    if any(r.status is KeyStatus.FAILED for r in results.values()):
        raise KeyDistributionError(results)
    return key, results
