"""spawner.sshconfig: ~/.ssh/config split once, evaluated per host by asyncssh's own handlers.

Every test derives a host's connection options twice, as `asyncssh.connect` does (config=(),
then the reload it makes for `Match final`), once with asyncssh's own `SSHConfig.parse` and once
with the cached one, and compares every option, or the error, host by host. Real files in a
HOME of the test's own, real `Match exec` commands; no SSH server is needed: options are what
a connection is made from.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import hmac
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

Host one two,three [four]
    Port 2204

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
         "xhost", "early-3", "late", "extra", "plain", "10.1.0.7", "quoted name", "one",
         "three", "[four]", "four", "on"]


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
    assert sshconfig._match_host is SSHClientConfig._match_host  # its Host lines: ours too
    assert asyncssh.config.SSHServerConfig.parse is SSHConfig.parse  # servers' parse untouched


def test_not_installed_over_code_it_does_not_know() -> None:
    def parse(self: Any, path: Path) -> None:
        """Some other asyncssh's parse."""

    def read_known_hosts(filelist: Any) -> None:
        """Some other asyncssh's read_known_hosts."""

    config = types.SimpleNamespace(logger=None, SSHConfig=type("C", (), {"parse": parse}))
    config.SSHClientConfig = type("D", (config.SSHConfig,), {})
    known_hosts = types.SimpleNamespace(read_known_hosts=read_known_hosts)
    assert not sshconfig.install(types.SimpleNamespace(config=config, known_hosts=known_hosts))
    assert config.SSHClientConfig.parse is parse
    assert known_hosts.read_known_hosts is read_known_hosts


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
    # Behind a line of its block: a host the block does not apply to skips up to it only.
    config.write_text(f"Host nomatch\n    Port 1\n\n# a comment\nHost target\n    User u\n"
                      f"    {line}\n    Port 3\n")
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


def test_host_lines_are_matched_without_a_pattern_per_host(home: Path) -> None:
    """A config naming every host of a cluster: each host's options as asyncssh derives
    them, its `Host` lines matched by name, the wildcard ones' patterns made once."""
    names = [f"n{k}" for k in range(64)]
    (home / ".ssh" / "config").write_text("".join(
        f"Host {name} alias-{name}\n    Port {2000 + k}\n    User u{k}\n"
        for k, name in enumerate(names)) + "Host n1? !n13\n    Compression yes\n"
        "Host *\n    ConnectTimeout 5\n")
    sshconfig._host_patterns.cache_clear()
    for k, name in enumerate(names):
        got = assert_same(name)
        assert (got["port"], got["username"]) == (2000 + k, f"u{k}")
    made = sshconfig._host_patterns.cache_info()
    assert made.misses == 2  # "n1? !n13" and "*", not one per host and line
    assert options("n12", sshconfig._parse)["config"][1]["Compression"] is True
    assert "Compression" not in options("n13", sshconfig._parse)["config"][1]


def test_the_cache_stays_small(home: Path) -> None:
    config = home / ".ssh" / "config"
    for port in range(sshconfig.MAX_CACHED * 2):
        config.write_text(f"Host a\n    Port {port + 1}\n")
        assert options("a", sshconfig._parse)["port"] == port + 1
    assert len(sshconfig._cache) <= sshconfig.MAX_CACHED


# -- known_hosts ---------------------------------------------------------------------------

KNOWN_HOSTS = asyncssh.known_hosts


def matched(files: Any, host: str, addr: str, port: int | None, reader: Any) -> Any:
    """match_known_hosts as a connection calls it, with `reader` as its read_known_hosts:
    the keys it returns (by public data), or the error."""
    saved = KNOWN_HOSTS.read_known_hosts
    KNOWN_HOSTS.read_known_hosts = reader
    try:
        result = KNOWN_HOSTS.match_known_hosts(files, host, addr, port)
        return [[getattr(k, "public_data", k) for k in part] for part in result]
    except Exception as exc:
        return ("raised", type(exc), str(exc))
    finally:
        KNOWN_HOSTS.read_known_hosts = saved


@pytest.fixture
def known_hosts(tmp_path: Path) -> list[str]:
    """Two known_hosts files: exact names, [addr]:port, patterns, a negation, hashed names,
    a CA and a revoked key."""
    keys = [asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
            for _ in range(6)]
    salt = b"0123456789abcdefghij"  # a hashed name, as ssh-keygen -H writes it
    digest = hmac.new(salt, b"secret-host", hashlib.sha1).digest()
    hashed_name = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"
    first = tmp_path / "known_hosts"
    first.write_text(f"# comment\n\nalpha,10.0.0.1 {keys[0]}\n[10.0.0.2]:2222 {keys[1]}\n"
                     f"*.example.com,!bad.example.com {keys[2]}\n{hashed_name} {keys[3]}\n")
    second = tmp_path / "known_hosts2"
    second.write_text(f"@cert-authority *.example.com {keys[4]}\n@revoked alpha {keys[5]}\n"
                      f"alpha {keys[2]}\n")
    return [str(first), str(second)]


@pytest.mark.parametrize("host, addr, port", [
    ("alpha", "10.0.0.1", None), ("beta", "10.0.0.2", 2222), ("beta", "10.0.0.2", 22),
    ("web.example.com", "192.0.2.5", None), ("bad.example.com", "192.0.2.6", None),
    ("secret-host", "192.0.2.7", None), ("nobody", "192.0.2.8", 2200),
])
def test_known_hosts_as_asyncssh_matches_them(known_hosts: list[str], host: str, addr: str,
                                              port: int | None) -> None:
    ours = matched(known_hosts, host, addr, port, sshconfig._read_known_hosts)
    assert ours == matched(known_hosts, host, addr, port, asyncssh.read_known_hosts)
    assert not raised(ours)
    assert matched(known_hosts[0], host, addr, port, sshconfig._read_known_hosts) == \
        matched(known_hosts[0], host, addr, port, asyncssh.read_known_hosts)


def test_known_hosts_matches_are_what_the_files_say(known_hosts: list[str]) -> None:
    alpha = matched(known_hosts, "alpha", "10.0.0.1", None, sshconfig._read_known_hosts)
    assert [len(part) for part in alpha[:3]] == [3, 0, 1]  # by name, by address; CA; revoked
    assert len(matched(known_hosts, "web.example.com", "192.0.2.5", None,
                       sshconfig._read_known_hosts)[1]) == 1
    assert matched(known_hosts, "bad.example.com", "192.0.2.6", None,
                   sshconfig._read_known_hosts)[0] == []


@pytest.mark.parametrize("broken", ["missing second", "bad entry first", "both", "bad marker"])
def test_known_hosts_errors_are_asyncssh_s(known_hosts: list[str], broken: str) -> None:
    first, second = map(Path, known_hosts)
    if broken in ("bad entry first", "both"):
        first.write_text(first.read_text() + "lonely-field\n")
    if broken in ("missing second", "both"):
        second.unlink()
    if broken == "bad marker":
        second.write_text("@nonsense alpha ssh-ed25519 AAAA\n")
    ours = matched(known_hosts, "alpha", "10.0.0.1", None, sshconfig._read_known_hosts)
    assert raised(ours)
    assert ours == matched(known_hosts, "alpha", "10.0.0.1", None, asyncssh.read_known_hosts)


def test_known_hosts_edits_are_seen_and_each_text_loaded_once(
        known_hosts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sshconfig._known_hosts_cache.clear()
    loads: list[str] = []
    load = KNOWN_HOSTS.SSHKnownHosts.load
    monkeypatch.setattr(KNOWN_HOSTS.SSHKnownHosts, "load",
                        lambda self, text: loads.append(text) or load(self, text))
    for _ in range(5):
        matched(known_hosts, "alpha", "10.0.0.1", None, sshconfig._read_known_hosts)
    assert len(loads) == 2  # each file's text once
    Path(known_hosts[1]).write_text("")
    assert matched(known_hosts, "alpha", "10.0.0.1", None, sshconfig._read_known_hosts)[2] == []
    assert len(loads) == 4


def test_known_hosts_reader_installed_for_this_asyncssh() -> None:
    assert sshconfig.install(asyncssh)
    assert KNOWN_HOSTS.read_known_hosts is sshconfig._read_known_hosts
