"""poprun.run.sshkeys: `--distribute-ssh-key` (pick or generate a key, ask the password once,
install the key on every host).

Real: key generation (asyncssh), files and modes on disk, and the distribution end to end —
OpenSSH sshd servers accepting passwords (tests/password_sshd.py) for a real throwaway user
whose password sshd checks against /etc/shadow; the key is then used for a password-less login.
Simulated: the person typing the password (an injected prompt function), and, in one test, an
asyncssh that cannot generate the requested key type. The loopback "hosts" share one machine,
so they share the user's home — as NFS homes do on clusters — and the key is added once.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import asyncssh
import pytest

from password_sshd import LocalUser, start_password_hosts, throwaway_user
from poprun.errors import ConfigError
from poprun.run.sshkeys import (
    KeyDistributionError, KeyStatus, KeyType, PublicKey, distribute_ssh_key, find_key_path,
    install_key, prepare_key, read_password,
)
from sshd_hosts import SshHosts
from spawner.ssh import FailureKind, SshConnectError, Target, connect_all

TIMEOUT = 20


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- the key ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key_type", list(KeyType))
def test_generates_each_key_type_in_the_folder(key_type: KeyType, tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    folder.mkdir()
    key = prepare_key(folder, key_type.value)
    assert key.generated and key.path == folder / f"id_{key_type.value}"
    assert mode(key.path) == 0o600 and mode(Path(f"{key.path}.pub")) == 0o644
    private = asyncssh.read_private_key(str(key.path))  # unencrypted: no passphrase needed
    assert private.export_public_key().decode().split()[:2] == key.line.split()[:2]
    assert Path(f"{key.path}.pub").read_text() == key.line + "\n"


def test_default_path_is_home_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    key = prepare_key(None, KeyType.ED25519)
    assert key.path == tmp_path / ".ssh" / "id_ed25519"
    assert mode(tmp_path / ".ssh") == 0o700


def test_existing_key_is_used_not_overwritten(tmp_path: Path) -> None:
    first = prepare_key(tmp_path / "my_key", "ecdsa")
    again = prepare_key(tmp_path / "my_key", "ecdsa")
    assert not again.generated and again.line == first.line


def test_without_a_type_the_folder_must_hold_a_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no key .* give --distribute-ssh-key-type"):
        prepare_key(tmp_path)
    prepare_key(tmp_path, "ed25519")
    prepare_key(tmp_path, "ecdsa")
    # Several keys: OpenSSH's order of default identities picks ecdsa before ed25519.
    assert find_key_path(tmp_path, None) == tmp_path / "id_ecdsa"
    with pytest.raises(ConfigError, match="does not exist"):
        prepare_key(tmp_path / "absent")


def test_bad_type_and_unreadable_public_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'ed448' is not one of dsa, ecdsa, ed25519, rsa"):
        prepare_key(tmp_path, "ed448")
    (tmp_path / "id_rsa").write_text("private")
    with pytest.raises(ConfigError, match="cannot read the public key"):
        prepare_key(tmp_path)


def test_a_type_asyncssh_cannot_generate_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: an asyncssh/cryptography build without DSA (this one has it).
    def no_dsa(algorithm: str, **kwargs: object) -> None:
        raise asyncssh.KeyGenerationError(f"Unknown algorithm: {algorithm}")

    monkeypatch.setattr(asyncssh, "generate_private_key", no_dsa)
    with pytest.raises(ConfigError, match=r"dsa: this installation .* cannot generate such keys: "
                                          r"Unknown algorithm: ssh-dss"):
        prepare_key(tmp_path, "dsa")
    assert list(tmp_path.iterdir()) == []


# -- the password -----------------------------------------------------------------------------


def test_password_is_asked_once_naming_the_hosts() -> None:
    prompts: list[str] = []
    hosts = [Target(f"h{i}") for i in range(1, 6)]
    assert read_password(hosts, lambda text: prompts.append(text) or "secret") == "secret"
    assert prompts == ["SSH password for h1, h2, h3 and 2 more (asked once): "]


@pytest.mark.timeout(60)
def test_no_terminal_fails_instead_of_echoing() -> None:
    # Real getpass, no controlling terminal and stdin a pipe: it would read with echo.
    code = textwrap.dedent("""\
        from poprun.errors import ConfigError
        from poprun.run.sshkeys import read_password
        try:
            read_password(["h1"])
        except ConfigError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code], input="typed\n", capture_output=True,
                          text=True, timeout=TIMEOUT, start_new_session=True)
    assert done.stdout.strip() == "--distribute-ssh-key: no terminal to ask the SSH password on"
    assert "typed" not in done.stdout + done.stderr


def test_end_of_input_is_a_clear_error() -> None:
    def closed(text: str) -> str:
        raise EOFError

    with pytest.raises(ConfigError, match="no terminal"):
        read_password(["h1"], closed)


# -- the hosts --------------------------------------------------------------------------------


@pytest.fixture
def password_hosts(tmp_path: Path):
    with start_password_hosts(3, tmp_path) as hosts:
        yield hosts


@pytest.fixture
def user():
    with throwaway_user() as u:
        yield u


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, password_hosts: SshHosts,
         user: LocalUser) -> Path:
    """The launching user's HOME: an ssh config sending h1..h3 to the servers as `user`, the
    harness's known_hosts, and no key yet at ~/.ssh/id_ed25519 (the config names that file)."""
    home = tmp_path / "launcher-home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "config").write_text("".join(
        f"Host {h.alias}\n    HostName {h.addr}\n    Port {h.port}\n    User {user.name}\n"
        f"    IdentityFile {home / '.ssh' / 'id_ed25519'}\n    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {password_hosts.known_hosts}\n"
        for h in password_hosts.hosts))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def targets(hosts: SshHosts) -> list[Target]:
    return [Target(alias) for alias in hosts.aliases]


def authorized_keys(user: LocalUser) -> Path:
    return user.home / ".ssh" / "authorized_keys"


async def whoami_everywhere(hosts: SshHosts) -> list[tuple[str, str]]:
    """(user, server address) per host, over key-only connections."""
    async with await connect_all(targets(hosts), timeout=10) as conns:
        runs = [conns[t].run("id -un; echo $SSH_CONNECTION", check=True) for t in conns]
        done = await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT)
    return [(d.stdout.split("\n")[0], d.stdout.split()[3]) for d in done]


@pytest.mark.timeout(90)
async def test_distributes_the_key_once_then_key_login_works(
        password_hosts: SshHosts, user: LocalUser, home: Path) -> None:
    # Before: a key the hosts do not know yet: key-only SSH is refused.
    key = prepare_key(None, "ed25519")
    with pytest.raises(SshConnectError) as refused:
        await whoami_everywhere(password_hosts)
    assert set(refused.value.by_kind()) == {FailureKind.PERMISSION_DENIED}, str(refused.value)

    prompts: list[str] = []

    def prompt(text: str) -> str:
        prompts.append(text)
        return user.password

    # No path, no type: the key found in ~/.ssh is the one distributed.
    found, results = await distribute_ssh_key(targets(password_hosts), prompt=prompt,
                                              timeout=10)
    assert len(prompts) == 1
    assert found == PublicKey(home / ".ssh" / "id_ed25519", key.line, generated=False)
    # One home behind the three hosts: the first adds the key, the others find it.
    assert [r.status for r in results.values()] == \
        [KeyStatus.ADDED, KeyStatus.PRESENT, KeyStatus.PRESENT]
    assert [r.message for r in results.values()] == \
        ["h1: key added", "h2: key already present", "h3: key already present"]
    assert authorized_keys(user).read_text() == key.line + "\n"
    # Created by the remote login, as that user, with ssh's modes.
    assert mode(authorized_keys(user).parent) == 0o700 and mode(authorized_keys(user)) == 0o600
    assert authorized_keys(user).stat().st_uid == user.uid

    assert await whoami_everywhere(password_hosts) == \
        [(user.name, h.addr) for h in password_hosts.hosts]

    # Again: nothing to do, nothing duplicated.
    _, results = await distribute_ssh_key(targets(password_hosts), prompt=prompt, timeout=10)
    assert {r.status for r in results.values()} == {KeyStatus.PRESENT}
    assert authorized_keys(user).read_text() == key.line + "\n"


@pytest.mark.timeout(90)
async def test_existing_entries_are_respected(password_hosts: SshHosts, user: LocalUser,
                                              home: Path) -> None:
    key = prepare_key(home / ".ssh", "ed25519")
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    ssh_dir = authorized_keys(user).parent
    ssh_dir.mkdir(mode=0o700)
    os.chown(ssh_dir, user.uid, -1)
    # The last line lacks its newline: the key must not be glued onto it.
    authorized_keys(user).write_text(f"# keys\n{other}")
    os.chown(authorized_keys(user), user.uid, -1)  # the user's own file, as in life
    one = [Target("h1")]
    results = await install_key(one, key, user.password, timeout=10)
    assert results[one[0]].status is KeyStatus.ADDED
    assert authorized_keys(user).read_text() == f"# keys\n{other}\n{key.line}\n"

    # The same key with options and another comment counts as present.
    blob = key.line.split()[:2]
    authorized_keys(user).write_text(f'from="127.0.0.0/8" {blob[0]} {blob[1]} old-comment\n')
    results = await install_key(one, key, user.password, timeout=10)
    assert results[one[0]].status is KeyStatus.PRESENT
    assert authorized_keys(user).read_text().count(blob[1]) == 1


@pytest.mark.timeout(90)
async def test_wrong_password_fails_per_host_and_writes_nothing(
        password_hosts: SshHosts, user: LocalUser, home: Path) -> None:
    with pytest.raises(KeyDistributionError) as caught:
        await distribute_ssh_key(targets(password_hosts), key_type="ed25519",
                                 prompt=lambda text: user.password + "x", timeout=10)
    results = caught.value.results
    assert [r.status for r in results.values()] == [KeyStatus.FAILED] * 3
    for target, result in results.items():
        assert result.message.startswith(f"{target}: permission denied for user {user.name} "
                                         "(password and keys rejected)")
    assert str(caught.value).startswith("--distribute-ssh-key: could not install the key on "
                                        "3 of 3 hosts: h1: permission denied")
    assert not authorized_keys(user).parent.exists()


@pytest.mark.timeout(90)
async def test_unreachable_host_is_reported_and_the_others_still_get_the_key(
        password_hosts: SshHosts, user: LocalUser, home: Path) -> None:
    password_hosts.kill_host(1)
    with pytest.raises(KeyDistributionError) as caught:
        await distribute_ssh_key(targets(password_hosts), key_type="ed25519",
                                 prompt=lambda text: user.password, timeout=10)
    statuses = {str(t): r.status for t, r in caught.value.results.items()}
    assert statuses == {"h1": KeyStatus.ADDED, "h2": KeyStatus.FAILED, "h3": KeyStatus.PRESENT}
    assert "h2: connection refused" in caught.value.results[Target("h2")].message
    assert FailureKind.CONNECTION_REFUSED.value in str(caught.value)
