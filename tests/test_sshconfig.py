"""spawner.sshconfig: ~/.ssh/config split once, evaluated per host by asyncssh's own handlers.

Every test derives a host's connection options twice, as `asyncssh.connect` does (config=(),
then the reload it makes for `Match final`), once with asyncssh's own `SSHConfig.parse` and once
with the cached one, and compares every option, or the error, host by host. Real files in a
HOME of the test's own, real `Match exec` commands; no SSH server is needed: options are what
a connection is made from.
"""

from __future__ import annotations

import getpass
import shlex
import types
from pathlib import Path
from typing import Any

import pytest

from spawner import sshconfig
from spawner.ssh import load_asyncssh

asyncssh = load_asyncssh()
SSHConfig = asyncssh.config.SSHConfig
SSHClientConfig = asyncssh.config.SSHClientConfig

CONFIG = """\
# options for many hosts; the first value found for an option is the one kept
Include conf.d/*.conf
Include {home}/extra.conf

Host web* !web-bad
    HostName %h.example.com
    User alice
    Port 2201
    IdentityFile ~/.ssh/id_%r

Host db-? db-10
    HostName=10.1.0.%h
    User = carol
    Port=2202

Host jump
    HostName 192.0.2.1
    User jumper

Host behind-*
    ProxyJump jump
    User=bob

Host cmd
    ProxyCommand ssh -W "%h:%p" -o 'User=x y' jump
    RemoteCommand echo "%r@%h" '%%'

Match originalhost tagged-*
    Tag mytag
Match tagged mytag
    SendEnv LANG LC_*
    SendEnv EXTRA
Match exec "true" host *.example.com
    SetEnv FOO=bar BAZ="a b"
Match exec "exit 1"
    Port 9
Match !host *.example.com !originalhost db-*
    Compression yes
Match canonical host x*
    Port 2203
Match user root localuser *
    ConnectTimeout 17
Match final all
    ServerAliveInterval 7

Host *
    IdentityFile ~/.ssh/id_ed25519
    CertificateFile ~/.ssh/%u-cert.pub
    UserKnownHostsFile ~/.ssh/known_hosts ~/.ssh/known_hosts2
    GlobalKnownHostsFile none
    Ciphers aes128-ctr,aes256-ctr
    KexAlgorithms=curve25519-sha256
    ForwardAgent ${{SSHCONFIG_TEST_AGENT}}
    RekeyLimit 1G 1h
    AddressFamily inet
    RequestTTY no
    IdentitiesOnly yes
    PreferredAuthentications publickey
"""

INCLUDED = {
    "conf.d/10-early.conf": """\
Host early-*
    HostName early.%h.internal
    Port 2210
""",
    "conf.d/20-late.conf": """\
Host late
    User dave
    Match host late
""",
    "extra.conf": """\
Host extra
    HostName 203.0.113.9
    Port 2211
""",
}

HOSTS = ["web1", "web-bad", "db-1", "db-10", "db-22", "jump", "behind-a", "cmd", "tagged-1",
         "xhost", "early-3", "late", "extra", "plain", "10.1.0.7", "quoted name"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME whose ~/.ssh holds the config above, its includes and the keys it names."""
    home = tmp_path / "home"
    ssh = home / ".ssh"
    ssh.mkdir(parents=True, mode=0o700)
    for name in ("id_ed25519", "id_alice", "id_root"):
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(ssh / name)
    user_key = asyncssh.read_private_key(ssh / "id_ed25519")
    ca = asyncssh.generate_private_key("ssh-ed25519")
    ca.generate_user_certificate(user_key, "test").write_certificate(
        ssh / f"{getpass.getuser()}-cert.pub")
    for rel, text in INCLUDED.items():
        path = (home / rel) if rel == "extra.conf" else (ssh / rel)
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    (ssh / "config").write_text(CONFIG.format(home=home))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SSHCONFIG_TEST_AGENT", str(tmp_path / "agent.sock"))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def options(host: str, parse: Any, **kwargs: Any) -> Any:
    """What asyncssh.connect derives for `host` (prepare, then its reload for `Match final`),
    with `parse` as the client config's parse: the options made comparable, or the error."""
    saved = SSHClientConfig.parse
    SSHClientConfig.parse = parse
    try:
        opts = asyncssh.SSHClientConnectionOptions(config=(), host=host, **kwargs)
        if opts.config.has_match_final():
            opts.update(host=opts.orig_host, reload=True, canonical=False, final=True)
        return comparable(opts)
    except Exception as exc:  # the same failure, the same message
        return ("raised", type(exc), str(exc))
    finally:
        SSHClientConfig.parse = saved


def comparable(value: Any) -> Any:
    """Options as plain data: keys by their public data, configs by what they hold."""
    if isinstance(value, (str, bytes, int, float, type(None), type)):
        return value
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, SSHConfig):
        return ("config", comparable(value._options), dict(value._tokens),
                value.has_match_final(), value.loaded)
    if hasattr(value, "public_data"):
        return ("key", value.public_data)
    if isinstance(value, asyncssh.SSHClientConnectionOptions):
        return {k: comparable(v) for k, v in vars(value).items()}
    raise AssertionError(f"no way to compare {type(value).__name__}: {value!r}")


def raised(got: Any) -> bool:
    return isinstance(got, tuple) and got[0] == "raised"


def assert_same(host: str, **kwargs: Any) -> Any:
    theirs = options(host, SSHConfig.parse, **kwargs)
    ours = options(host, sshconfig._parse, **kwargs)
    assert ours == theirs, host
    return ours


def test_installed_for_this_asyncssh() -> None:
    """The cache is on for the asyncssh installed: were its parse to change, this fails until
    `_parse` is compared with the new code and its digest added."""
    assert sshconfig.install(asyncssh)
    assert SSHClientConfig.parse is sshconfig._parse
    assert asyncssh.config.SSHServerConfig.parse is SSHConfig.parse  # servers' parse untouched


def test_not_installed_over_a_parse_it_does_not_know() -> None:
    def parse(self: Any, path: Path) -> None:
        """Some other asyncssh's parse."""

    config = types.SimpleNamespace(logger=None, SSHConfig=type("C", (), {"parse": parse}))
    config.SSHClientConfig = type("D", (config.SSHConfig,), {})
    assert not sshconfig.install(types.SimpleNamespace(config=config))
    assert config.SSHClientConfig.parse is parse


@pytest.mark.parametrize("host", HOSTS)
def test_every_option_as_asyncssh_derives_it(home: Path, host: str) -> None:
    got = assert_same(host)
    assert not raised(got), got


def test_the_config_is_what_decides(home: Path) -> None:
    """The comparison above compares something: the options differ host by host as written."""
    web = options("web1", sshconfig._parse)
    assert (web["host"], web["port"], web["username"]) == ("web1.example.com", 2201, "alice")
    assert web["config"][1]["SetEnv"] == ["FOO=bar", "BAZ=a b"]
    assert web["config"][1]["ServerAliveInterval"] == 7  # Match final: the reload
    db = options("db-10", sshconfig._parse)
    assert (db["host"], db["port"], db["username"]) == ("10.1.0.db-10", 2202, "carol")
    assert "Compression" not in db["config"][1]  # Match !originalhost db-*
    assert options("jump", sshconfig._parse)["config"][1]["Compression"] is True
    assert options("behind-a", sshconfig._parse)["tunnel"] == "jump"
    cmd = options("cmd", sshconfig._parse)["config"][1]
    assert cmd["ProxyCommand"] == "ssh -W \"cmd:22\" -o 'User=x y' jump"
    assert cmd["RemoteCommand"] == f"echo \"{getpass.getuser()}@cmd\" '%'"
    assert options("tagged-1", sshconfig._parse)["config"][1]["SendEnv"] == \
        ["LANG", "LC_*", "EXTRA"]
    assert options("early-3", sshconfig._parse)["port"] == 2210
    assert options("extra", sshconfig._parse)["host"] == "203.0.113.9"
    assert options("late", sshconfig._parse)["username"] == "dave"


@pytest.mark.parametrize("host", ["web1", "xhost", "plain"])
def test_canonical_and_final_reloads(home: Path, host: str) -> None:
    assert_same(host, canonical=True, final=True)
    assert_same(host, canonical=True)


@pytest.mark.parametrize("host", ["web1", "db-1", "plain"])
def test_user_and_port_given_by_the_caller(home: Path, host: str) -> None:
    got = assert_same(host, username="root", port=2022)
    assert (got["username"], got["port"]) == ("root", 2022)


@pytest.mark.parametrize("line, where", [
    ('Port "22', "anywhere"),  # shlex fails: raised even in a block that does not match
    ("=", "anywhere"),  # asyncssh's own IndexError
    ("Port", "matching"),
    ("Port 22 23", "matching"),
    ("Compression maybe", "matching"),
    ("HostName %n.example", "matching"),
    ("Match nosuch x", "anywhere"),
    ("Match host", "anywhere"),
    ("IdentityFile ~/.ssh/missing", "matching"),
])
def test_errors_are_asyncssh_s(home: Path, line: str, where: str) -> None:
    config = home / ".ssh" / "config"
    config.write_text(f"Host nomatch\n    Port 1\n\n# a comment\nHost target\n    {line}\n")
    target = assert_same("target")
    assert raised(target), target
    other = assert_same("other")
    assert raised(other) == (where == "anywhere"), other


def test_an_edit_is_seen_at_once(home: Path) -> None:
    config = home / ".ssh" / "config"
    config.write_text("Host a\n    Port 2001\n")
    assert assert_same("a")["port"] == 2001
    config.write_text("Host a\n    Port 2002\n")  # same size, maybe the same mtime
    assert assert_same("a")["port"] == 2002


def test_lines_are_split_once_for_all_hosts(home: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    split = shlex.split
    calls: list[str] = []
    monkeypatch.setattr(sshconfig.shlex, "split", lambda line: calls.append(line) or split(line))
    sshconfig._cache.clear()
    for host in HOSTS:
        options(host, sshconfig._parse)
    lines = [line for path in [home / ".ssh" / "config", home / "extra.conf",
                               *(home / ".ssh" / "conf.d").iterdir()]
             for line in path.read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    assert sorted(calls) == sorted(line.strip() for line in lines)


def test_the_cache_stays_small(home: Path) -> None:
    config = home / ".ssh" / "config"
    for port in range(sshconfig.MAX_CACHED * 2):
        config.write_text(f"Host a\n    Port {port + 1}\n")
        assert options("a", sshconfig._parse)["port"] == port + 1
    assert len(sshconfig._cache) <= sshconfig.MAX_CACHED
