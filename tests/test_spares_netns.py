"""A host whose network link goes down mid-job is noticed within --host-timeout and replaced by
the spare (docs/several-hosts.md, "Spare hosts"). Hosts in network namespaces
(tests/netns_hosts.py) reached over SSH across their network a (NetnsHosts.ssh_over: sshd
listening on each host's address there, not the fixture's usual pipes), poprun running inside
h1's namespace as on a cluster's first host: taking h2's veth down cuts its agent's
connection, which neither end closes (no FIN, no RST: the packets just stop). Only the
heartbeats' silence can tell."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from attempt_notes import noting, notes
from conftest import OFFLINE, poprun_argv, poprun_env, reaped
from netns_hosts import start_netns_hosts
from sshd_hosts import wait_until

pytestmark = pytest.mark.timeout(180)
PY = sys.executable
HOST_TIMEOUT = 3.0  # seconds (--host-timeout)
SLACK = 3.0  # seconds past it the loss may be noticed on a loaded machine
# Notes, per attempt, the address its SSH connection reached (the host's on network a) and
# when it wrote the note; attempt 0 then waits to be cut off, attempt 1 ends 0 once all noted.
NOTES = noting('{"host": os.environ["POPRUN_SSH_CONNECTION"].split()[2], "at": time.time()}',
               "if attempt == 0:\n    time.sleep(300)\n")

def test_a_host_whose_link_goes_down_is_lost_within_the_host_timeout_and_replaced(tmp_path):
    """h1 and h2 run the job, h3 stands by; h2's link on a goes down once both instances
    run. h2 is lost within --host-timeout (and a little: the machine is shared), quarantined,
    and attempt 1 runs instance 1 on h3, instance 0 staying on h1."""
    where = tmp_path / "notes"
    where.mkdir()
    out_json = tmp_path / "result.json"
    with start_netns_hosts(3, tmp_path, networks=("a",)) as hosts, hosts.ssh_over("a"):
        job = subprocess.Popen(hosts.exec_argv(1, *poprun_argv(
            *OFFLINE, "-v", "-H", "h1,h2", "--spare-hosts", "h3", "--num-instances=2",
            "--num-replicas=2", "--max-restarts=1", "--restart-delay=0",
            f"--host-timeout={HOST_TIMEOUT:g}", f"--result-json={out_json}",
            PY, "-c", NOTES, str(where))), env=poprun_env(hosts.env()), stderr=subprocess.PIPE)
        with reaped(job):
            wait_until(lambda: len(notes(where)) == 2, "attempt 0's notes", 60)
            down = time.time()
            hosts.set_link(2, "a", False)
            _, err = job.communicate(timeout=120)
        err = err.decode()
        a = [hosts.addr(i, "a") for i in (1, 2, 3)]
    assert job.returncode == 0, err
    seen = notes(where)
    assert [seen["0-0"]["host"], seen["1-0"]["host"]] == [a[0], a[1]], seen
    assert [seen["0-1"]["host"], seen["1-1"]["host"]] == [a[0], a[2]], (seen, err)
    assert "h2: lost the connection to the host" in err, err
    assert "h2 quarantined for the rest of the job: lost (" in err, err
    assert "h2 replaced by spare host h3 for the next attempt (1 instance(s))" in err, err
    result = json.loads(out_json.read_text())
    [failed] = result["attempts"]
    [lost] = [i for i in failed["instances"] if i["lost"]]
    assert (lost["index"], lost["host"], failed["exit_reason"]) == (1, "h2", "host_lost")
    noticed = lost["end_time"] - down
    recovered = max(seen["0-1"]["at"], seen["1-1"]["at"]) - down
    print(f"link down to loss noticed: {noticed:.2f} s (--host-timeout {HOST_TIMEOUT:g}); "
          f"to every instance running again: {recovered:.2f} s")
    assert 0 < noticed <= HOST_TIMEOUT + SLACK, noticed
    assert [q["host"] for q in result["quarantined"]] == ["h2"]
    assert [i["host"] for i in result["instances"]] == ["h1", "h3"]
