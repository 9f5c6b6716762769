"""SSH configurations that work with `ssh` work with poprun: a host reached
through a `ProxyCommand` (here `ssh -W %h:%p` through another loopback sshd, as a jump host
would be) has no peer address on the launcher's side. poprun crashed on it
(`TypeError: 'NoneType' object is not subscriptable`) when it needed this machine's address,
and gave the host's name as MASTER_ADDR when it needed that host's: now the host's agent says
where it was reached (its SSH_CONNECTION), and this machine's address is its route's source.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env
from sshd_hosts import SshHosts, require_tool, start_ssh_hosts

pytestmark = pytest.mark.timeout(120)
PY = sys.executable
REPORT = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
          "('RANK', 'MASTER_ADDR', 'POPRUN_SSH_CONNECTION')}))")


def add_proxied_alias(hosts: SshHosts, alias: str, target: int, via: int) -> None:
    """`alias` reaches host `target` only through a ProxyCommand tunnelled by host `via`."""
    h = hosts.hosts[target]
    ssh = require_tool("ssh")
    with open(hosts.ssh_config, "a") as config:
        config.write(f"Host {alias}\n"
                     f"    HostName {h.addr}\n"
                     f"    Port {h.port}\n"
                     f"    User {hosts.user}\n"
                     f"    IdentityFile {hosts.user_key}\n"
                     f"    IdentitiesOnly yes\n"
                     f"    UserKnownHostsFile {hosts.known_hosts}\n"
                     f"    GlobalKnownHostsFile /dev/null\n"
                     f"    StrictHostKeyChecking yes\n"
                     f"    BatchMode yes\n"
                     f"    ProxyCommand {ssh} -F {hosts.ssh_config} -W %h:%p "
                     f"{hosts.hosts[via].alias}\n")


@pytest.fixture
def hosts(tmp_path: Path):
    with start_ssh_hosts(2, tmp_path) as h:
        add_proxied_alias(h, "hp", target=1, via=0)
        yield h


def run(hosts: SshHosts, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(poprun_argv(*OFFLINE, *args), env=poprun_env(hosts.env()), cwd=cwd,
                          capture_output=True, timeout=90)


def reports(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"Traceback" not in proc.stderr and b"internal error" not in proc.stderr
    return sorted((json.loads(line) for line in proc.stdout.splitlines()),
                  key=lambda r: int(r["RANK"]))


def test_plain_ssh_reaches_the_proxied_host(hosts):
    proc = subprocess.run(["ssh", "-F", str(hosts.ssh_config), "hp", "echo $SSH_CONNECTION"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[2] == hosts.hosts[1].addr.encode()


def test_a_proxied_first_host_gives_its_own_address_as_master(hosts, tmp_path):
    """Was: MASTER_ADDR=<the host's name>, which the others may not resolve."""
    found = reports(run(hosts, "-H", "hp,h1", "--num-instances=2", "--num-replicas=2", PY,
                        "-c", REPORT, cwd=tmp_path))
    assert [r["MASTER_ADDR"] for r in found] == [hosts.hosts[1].addr] * 2
    assert found[0]["POPRUN_SSH_CONNECTION"].split()[2] == hosts.hosts[1].addr


def test_this_machine_first_and_a_proxied_host_after_it(hosts, tmp_path):
    """Was: poprun: internal error: TypeError: 'NoneType' object is not subscriptable."""
    found = reports(run(hosts, "-H", "localhost,hp", "--num-instances=2", "--num-replicas=2",
                        PY, "-c", REPORT, cwd=tmp_path))
    addresses = {r["MASTER_ADDR"] for r in found}
    assert len(addresses) == 1 and addresses != {None}, found
    assert addresses <= {"127.0.0.1", hosts.hosts[1].addr, *_local_addresses()}, found


def test_check_passes_on_the_proxied_host(hosts, tmp_path):
    proc = run(hosts, "--check", "-H", "hp", cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
    assert b"1 of 1 host(s) ready" in proc.stdout


def _local_addresses() -> set[str]:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True)
    return set(out.stdout.split())


# Fails in attempt 0 on this machine (instance 0), succeeds in attempt 1.
FAILS_ONCE_HERE = ("import os, sys; sys.exit(3 if os.environ['POPDIST_RESTART_COUNT'] == '0' "
                   "and os.environ['RANK'] == '0' else 0)")


def test_a_proxied_host_keeps_its_connection_when_the_job_restarts(hosts, tmp_path):
    """Was: the sweep after attempt 0 killed the ProxyCommand with the instances' leftovers
    (it carried their mark), so hp was lost between attempts: `internal error: KeyError:
    'hp'`. The launcher's helpers carry a mark of their own, which that sweep spares."""
    result = tmp_path / "result.json"
    proc = run(hosts, "-H", "localhost,hp", "--num-instances=2", "--num-replicas=2",
               "--max-restarts=1", "--restart-delay=0", f"--result-json={result}", PY, "-c",
               FAILS_ONCE_HERE, cwd=tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "lost the connection" not in err and "quarantined" not in err, err
    record = json.loads(result.read_text())
    assert [a["exit_code"] for a in record["attempts"]] == [3]


def test_no_stray_line_from_asyncio_about_the_proxy_process(hosts, tmp_path):
    """The ProxyCommand is asyncio's child, and the command's final sweep reaped it before
    asyncio's own watcher could: `Unknown child process pid N, will report returncode 255`
    on stderr (about 1 run in 9, more often with a ProxyCommand that fails). The session
    now waits for asyncio to reap its helpers before its loop ends."""
    with open(hosts.ssh_config, "a") as config:
        config.write("Host hfails\n    HostName 127.0.0.1\n    ProxyCommand false\n"
                     "    BatchMode yes\n")
    for args in (["-H", "hp,h1", "--num-instances=2", "--num-replicas=2", "true"],
                 ["-H", "hfails", "--num-instances=1", "--num-replicas=1", "true"]) * 6:
        proc = run(hosts, *args, cwd=tmp_path)
        err = proc.stderr.decode()
        assert proc.returncode == (2 if "hfails" in args else 0), err
        assert "Unknown child process" not in err and "Loop " not in err, err
        assert "Traceback" not in err, err
