"""Horovod's Gloo world: the rendezvous poprun serves (run/worlds/horovod.py) and
the variables `horovodrun --gloo` sets (popdist/env.py). The store and the ranks are pure
tests; the protocol is checked with a plain-Python HTTP client speaking as horovod's C++
client does (http_store.cc: a connection per request, 404 polled); real horovod
(`hvd.init()`, allreduce) runs on this host and on two sshd hosts × 2 where it is installed:
skipped without it, failed where POPRUN_REQUIRE_HOROVOD=1 (CI builds it).
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import subprocess
import sys

import pytest

from conftest import OFFLINE, poprun_argv, poprun_env, run_poprun
from popdist import env as E
from poprun.plan.config import LaunchConfig
from poprun.plan.planner import plan
from poprun.run.worlds.horovod import (ENTRY_COST, MAX_VALUE, BadRequest, Rendezvous, Store,
                                   parse_head, scope_sizes)
from requires import skip_or_fail
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(120)


def test_ranks_local_and_cross_as_horovodrun_fills_hosts():
    """-H h1:2,h2:1: ranks in host order; cross rank is the host's index among the hosts
    that have that local rank (horovod/runner/common/util/hosts.py)."""
    config = LaunchConfig(program=("p",), num_instances=3, num_replicas=3, offline_mode=True)
    launch_plan = plan(config, {}, program=("p",), master_port=1, hosts=("h1", "h2"),
                       counts=(2, 1), rendezvous=("10.0.0.1", 5))
    got = [(i.env[E.HOROVOD_HOSTNAME], i.env[E.HOROVOD_RANK], i.env[E.HOROVOD_SIZE],
            i.env[E.HOROVOD_LOCAL_RANK], i.env[E.HOROVOD_LOCAL_SIZE],
            i.env[E.HOROVOD_CROSS_RANK], i.env[E.HOROVOD_CROSS_SIZE])
           for i in launch_plan.instances]
    assert got == [("h1", "0", "3", "0", "2", "0", "2"), ("h1", "1", "3", "1", "2", "0", "1"),
                   ("h2", "2", "3", "0", "1", "1", "2")]
    env = launch_plan.instances[0].env
    assert (env[E.HOROVOD_RENDEZVOUS_ADDR], env[E.HOROVOD_RENDEZVOUS_PORT]) == ("10.0.0.1", "5")
    assert env[E.HOROVOD_CONTROLLER] == env[E.HOROVOD_CPU_OPERATIONS] == "gloo"
    assert E.HOROVOD_GLOO_IFACE not in env  # not loopback: Gloo picks the host's own


def planned(hosts: tuple[str, ...], counts: tuple[int, ...]) -> list[dict[str, str]]:
    """Each instance's variables, as a launch plans them."""
    n = sum(counts)
    config = LaunchConfig(program=("p",), num_instances=n, num_replicas=n, offline_mode=True)
    return [i.env for i in plan(config, {}, program=("p",), master_port=1, hosts=hosts,
                                counts=counts, rendezvous=("127.0.0.1", 5)).instances]


def test_the_store_empties_a_scope_of_known_size_once_every_rank_is_done():
    store = Store(scope_sizes(planned(("h1", "h2"), (2, 1))))
    assert store.sizes == {"global": 3, "local_h1": 2, "local_h2": 1, "cross_0": 2,
                           "cross_1": 1}
    for rank in range(3):
        store.put("global", str(rank), b"addr%d" % rank)
    assert store.get("global", "1") == b"addr1" and store.get("global", "9") is None
    store.delete("global", "0")
    store.delete("global", "1")
    assert store.get("global", "2") == b"addr2"  # one rank is not done yet
    store.delete("global", "2")
    assert store.get("global", "2") is None  # a later hvd.init() starts afresh
    store.put("global_process_set_hash_7d", "0", b"x")  # a process set: keys go one by one
    store.delete("global_process_set_hash_7d", "0")
    assert "global_process_set_hash_7d" not in store.values


def test_the_store_holds_a_bounded_number_of_bytes_and_frees_what_goes():
    store = Store({"global": 2}, limit=10 * ENTRY_COST)
    assert store.put("global", "0", b"x" * 100) and store.put("global", "1", b"")
    while store.put("p", str(len(store.values.get("p", {}))), b""):
        pass
    assert store.used <= store.limit and len(store.values["p"]) < 10
    assert not store.put("q", "k", b"")  # full: refused, nothing changed
    assert store.put("global", "0", b"")  # a smaller value in place of a larger one fits
    store.delete("global", "0")
    store.delete("global", "1")  # every rank done: the scope's bytes are free again
    for key in list(store.values["p"]):
        store.delete("p", key)
    assert store.used == 0 and store.values == {}


def test_the_request_head_is_parsed_strictly():
    assert parse_head(b"PUT /global/3 HTTP/1.1\r\nContent-Length: 136") == ("PUT", "global",
                                                                            "3", 136)
    assert parse_head(b"GET /global/3 HTTP/1.0") == ("GET", "global", "3", 0)
    for bad, status in ((b"PUT /a/b HTTP/1.1\r\nContent-Length: %d" % (MAX_VALUE + 1), 413),
                        (b"PUT /a/b HTTP/1.1\r\nContent-Length: -5", 400),
                        (b"PUT /a/b HTTP/1.1\r\nContent-Length: 1e3", 400),
                        (b"PUT /a/b HTTP/1.1\r\nno colon", 400),
                        (b"GET /a/b/c HTTP/1.1", 400), (b"GET /a/ HTTP/1.1", 400),
                        (b"get /a/b HTTP/1.1", 400), (b"GET /a/b HTTP/2", 400)):
        with pytest.raises(BadRequest) as refused:
            parse_head(bad)
        assert refused.value.status == status, bad


def http_request(address: tuple[str, int], method: str, path: str, body: bytes = b""
                 ) -> tuple[int, str | None, bytes]:
    """One request as Horovod's client makes it: (status, Content-Length, body)."""
    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request(method, path, body=body, headers={"Content-Length": str(len(body))})
    reply = conn.getresponse()
    answer = (reply.status, reply.getheader("Content-Length"), reply.read())
    conn.close()
    return answer


def test_the_protocol_as_horovods_client_speaks_it():
    async def main():
        rendezvous = Rendezvous("127.0.0.1", asyncio.get_running_loop())
        rendezvous.new_world(planned(("localhost",), (2,)))
        request = functools.partial(http_request, rendezvous.address)

        def session():
            assert request("GET", "/global/1") == (404, "0", b"")  # polled until it is there
            assert request("PUT", "/global/1", b"\x00\x01 raw") == (200, "0", b"")
            assert request("GET", "/global/1") == (200, "6", b"\x00\x01 raw")
            assert request("PUT", "/global/0", b"a") == (200, "0", b"")
            assert request("DELETE", "/global/0")[0] == 200
            assert request("DELETE", "/global/1")[0] == 200
            assert request("GET", "/global/1")[0] == 404  # both done: emptied
            assert request("GET", "/too/many/parts")[0] == 400
            assert request("PUT", "/global/2", b"x" * (MAX_VALUE + 1))[0] == 413
            return True

        assert await asyncio.to_thread(session)
        await rendezvous.close()
    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.fixture(scope="module")
def horovod():
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        skip_or_fail(f"horovod with PyTorch is not installed ({probe.stderr.strip()[-200:]})",
                     "POPRUN_REQUIRE_HOROVOD")


# The PopDist guide's Listing 4.2, with an allreduce: the sum of rank+1 over the world.
PROGRAM = """
import horovod.torch as hvd, torch
hvd.init()
total = hvd.allreduce(torch.full((2 << 20,), float(hvd.rank() + 1)), op=hvd.Sum)
print(f"hvd rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
      f"cross={hvd.cross_rank()}/{hvd.cross_size()} sum={total[0].item():g} "
      f"{bool((total == total[0]).all())}", flush=True)
hvd.shutdown()
"""


def test_horovod_instances_on_this_host_form_one_world(horovod):
    proc = run_poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3", sys.executable,
                      "-c", PROGRAM, timeout=100)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("hvd"))
    assert lines == [f"hvd rank={r} size=3 local={r}/3 cross=0/1 sum=6 True" for r in range(3)]


def test_horovod_across_two_hosts_of_two(horovod, tmp_path):
    with start_ssh_hosts(2, tmp_path) as hosts:
        proc = subprocess.run(
            poprun_argv(*OFFLINE, "-H", "h1,h2", "--num-instances=4", "--num-replicas=4",
                        sys.executable, "-c", PROGRAM),
            env=poprun_env(hosts.env()), capture_output=True, timeout=100)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = sorted(line for line in proc.stdout.decode().splitlines() if line.startswith("hvd"))
    assert lines == [f"hvd rank={r} size=4 local={r % 2}/2 cross={r // 2}/2 sum=10 True"
                     for r in range(4)]


def test_a_delete_of_a_key_the_scope_does_not_hold_costs_nothing():
    """Guards a defect: a DELETE counted toward its scope's size whatever key it named, so as many
    DELETEs of made-up names as the scope has ranks emptied it under the ranks still
    rendezvousing. Only a key the scope holds counts; a made-up one changes nothing."""
    store = Store({"global": 2})
    store.put("global", "0", b"addr0")
    store.put("global", "1", b"addr1")
    for name in ("x", "y", "2", "-1", "00", ""):
        store.delete("global", name)
    assert store.get("global", "0") == b"addr0" and store.get("global", "1") == b"addr1"
    store.delete("global", "0")
    store.delete("global", "0")  # twice: still one rank done
    store.delete("global", "nope")
    assert store.get("global", "1") == b"addr1"
    store.delete("global", "1")
    assert store.get("global", "1") is None and store.used == 0  # every rank done: emptied


def test_deletes_of_absent_keys_over_http_leave_the_scope_whole():
    """The same over the server, as a neighbour would send it."""
    async def main():
        rendezvous = Rendezvous("127.0.0.1", asyncio.get_running_loop())
        rendezvous.new_world(planned(("localhost",), (2,)))
        request = functools.partial(http_request, rendezvous.address)

        def session():
            assert request("PUT", "/global/0", b"a")[0] == 200
            for name in ("junk1", "junk2", "junk3"):
                assert request("DELETE", f"/global/{name}")[0] == 200
            return request("GET", "/global/0")

        assert await asyncio.to_thread(session) == (200, "1", b"a")
        await rendezvous.close()
    asyncio.run(asyncio.wait_for(main(), 30))
