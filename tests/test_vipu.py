"""poprun.run.vipu against a simulator of the `vipu` CLI (tests/vipu_sim/vipu) first on PATH.

Each part of poprun's use of `vipu` in its own numbered section. Tests assert the exact `vipu`
invocations (the simulator logs every argv) and the simulator's final state: no partition leaked.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from popdist import env as E
from poprun.errors import ConfigError
from vipu_harness import sim  # noqa: F401 (a fixture)
from poprun.run.vipu import (Failure, PartitionInfo, PartitionState, Requirements, VipuError,
                         VipuSettings, mismatches, parse_partition_details,
                         parse_partition_table, parse_server_version, partition_target_options)
from poprun.run import vipu

TIMEOUT = 5
ADDR = ["--api-host", "localhost", "--api-port", "8090", "--server-timeout", str(TIMEOUT)]
LIST = ADDR + ["list", "partitions"]
SETTINGS = VipuSettings(server_host="localhost", server_timeout=TIMEOUT, poll_interval=0.02)
# The guide's example (§2.8.3): 32 replicas over 2 instances on 2 ILDs.
JOB = Requirements.of(num_replicas=32, ipus_per_replica=1, num_instances=2, num_ilds=2)


def acquire(*args, **kwargs):
    """vipu.acquire to its end (it runs `vipu` as asyncio subprocesses)."""
    return asyncio.run(vipu.acquire(*args, **kwargs))


def release(*args, **kwargs):
    return asyncio.run(vipu.release(*args, **kwargs))


def get(name: str) -> list[str]:
    return ADDR + ["get", "partition", name]


def remove(name: str) -> list[str]:
    return ADDR + ["remove", "partition", name]


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text, text
    return text


# --- 1. server address, port and timeout ----------------------------------------------------

@pytest.mark.timeout(30)
def test_the_host_option_wins_and_vipu_is_not_asked(sim, monkeypatch):
    sim.add("p1")
    monkeypatch.setenv(E.VIPU_API_HOST, "wrong.example")
    partition = acquire(SETTINGS, JOB, log=sim.log)
    assert sim.calls() == [LIST, get("p1"), ADDR + ["reset", "partition", "p1"], get("p1")]
    assert partition.host == "localhost"


@pytest.mark.timeout(30)
def test_the_environment_host_and_port_come_next(sim, monkeypatch):
    state = sim.state()
    state["server"]["port"] = 9001
    sim.write(state)
    sim.add("p1", reconfigurable=True, gcds=1, size=64)
    monkeypatch.setenv(E.VIPU_API_HOST, "localhost")
    monkeypatch.setenv(E.VIPU_API_PORT, "9001")
    partition = acquire(replace(SETTINGS, server_host=None), JOB, log=sim.log)
    address = ["--api-host", "localhost", "--api-port", "9001", "--server-timeout", "5"]
    assert sim.calls() == [address + ["list", "partitions"], address + ["get", "partition", "p1"]]
    assert (partition.host, partition.port) == ("localhost", 9001)


@pytest.mark.timeout(30)
def test_without_option_or_environment_the_local_vipu_configuration_names_the_server(sim):
    state = sim.state()
    state["server"] = {"host": "10.1.3.101", "port": 9000, "version": "1.18.0"}
    state["config"] = {"host": "10.1.3.101", "port": 9000}
    sim.write(state)
    sim.add("p1", reconfigurable=True)
    partition = acquire(replace(SETTINGS, server_host=None), JOB, log=sim.log)
    address = ["--api-host", "10.1.3.101", "--api-port", "9000", "--server-timeout", "5"]
    assert sim.calls() == [["--server-timeout", "5", "--server-version"],
                           address + ["list", "partitions"], address + ["get", "partition", "p1"]]
    assert (partition.host, partition.port) == ("10.1.3.101", 9000)
    assert "V-IPU server address picked up from 'vipu': 10.1.3.101:9000" in sim.messages()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("option, environment, used", [
    (9001, "9002", 9001),   # --vipu-server-port wins
    (None, "9002", 9002),   # then IPUOF_VIPU_API_PORT
    (None, None, 8090),     # then the default
])
def test_port_precedence(sim, monkeypatch, option, environment, used):
    state = sim.state()
    state["server"]["port"] = used  # any other port is unreachable
    sim.write(state)
    sim.add("p1", reconfigurable=True)
    if environment:
        monkeypatch.setenv(E.VIPU_API_PORT, environment)
    partition = acquire(replace(SETTINGS, server_port=option), JOB, log=sim.log)
    assert partition.port == used
    assert sim.calls()[0][:4] == ["--api-host", "localhost", "--api-port", str(used)]


@pytest.mark.timeout(30)
def test_a_bad_environment_port_is_a_config_error_before_any_request(sim, monkeypatch):
    monkeypatch.setenv(E.VIPU_API_PORT, "http")
    with pytest.raises(ConfigError, match="IPUOF_VIPU_API_PORT='http' is not a port number"):
        acquire(SETTINGS, JOB, log=sim.log)
    assert sim.calls() == []


@pytest.mark.timeout(30)
def test_the_timeout_goes_with_every_request_and_to_the_instances(sim):
    sim.add("p1")
    partition = acquire(replace(SETTINGS, server_timeout=7), JOB, log=sim.log)
    assert all(call[call.index("--server-timeout") + 1] == "7" for call in sim.calls())
    assert partition.environment(0)[E.VIPU_API_TIMEOUT] == "7"


def test_settings_from_a_launch_config_use_its_field_names():
    config = SimpleNamespace(
        vipu_server_host="h", vipu_server_port=9000, vipu_server_timeout=30,
        vipu_partition="p", vipu_allocation="a", vipu_cluster="c", update_partition=True,
        reset_partition=False, remove_partition=False, sync_type="s",
        ipu_link_routing_type="r", gw_link_routing_type="g", vipu_partition_attempts=4)
    assert VipuSettings.from_config(config) == VipuSettings(
        server_host="h", server_port=9000, server_timeout=30, partition="p", allocation="a",
        cluster="c", update_partition=True, reset_partition=False, remove_partition=False,
        sync_type="s", ipu_link_routing_type="r", gw_link_routing_type="g",
        partition_attempts=4)
    assert VipuSettings.from_config(SimpleNamespace()).server_timeout == 120


@pytest.mark.parametrize("fields, message", [
    ({"server_timeout": 0}, "--vipu-server-timeout must be positive"),
    ({"server_port": 70000}, "--vipu-server-port=70000 is not a port number"),
    ({"partition_attempts": 0}, "--vipu-partition-attempts must be at least 1"),
])
def test_settings_are_validated(fields, message):
    with pytest.raises(ConfigError, match=message):
        VipuSettings(**fields)


# --- 2. which partition -----------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_the_partition_option_wins_over_the_environment(sim, monkeypatch):
    sim.add("p1", reconfigurable=True)
    sim.add("p2", reconfigurable=True)
    monkeypatch.setenv(E.VIPU_API_PARTITION_ID, "p2")
    assert acquire(replace(SETTINGS, partition="p1"), JOB, log=sim.log).name == "p1"
    assert sim.calls() == [LIST, get("p1")]


@pytest.mark.timeout(30)
def test_the_environment_names_the_partition_next(sim, monkeypatch):
    sim.add("p1", reconfigurable=True)
    sim.add("p2", reconfigurable=True)
    monkeypatch.setenv(E.VIPU_API_PARTITION_ID, "p2")
    assert acquire(SETTINGS, JOB, log=sim.log).name == "p2"


@pytest.mark.timeout(30)
def test_the_only_partition_is_used(sim):
    sim.add("solo", reconfigurable=True)
    assert acquire(SETTINGS, JOB, log=sim.log).name == "solo"
    assert "Using V-IPU partition solo as it is the only one available" in sim.messages()


@pytest.mark.timeout(30)
def test_the_only_partition_counts_within_the_allocation_asked_for(sim):
    sim.add("other", allocation="alloc1", reconfigurable=True)
    sim.add("mine", allocation="alloc2", cluster="cluster2", reconfigurable=True)
    settings = replace(SETTINGS, allocation="alloc2")
    assert acquire(settings, JOB, log=sim.log).name == "mine"


@pytest.mark.timeout(30)
def test_several_partitions_and_none_named_is_an_error_listing_them(sim):
    sim.add("p1")
    sim.add("p2")
    before = sim.state()
    with pytest.raises(ConfigError) as caught:
        acquire(SETTINGS, JOB, log=sim.log)
    assert one_line(caught.value) == ("2 V-IPU partitions exist (p1, p2): choose one with "
                                      "--vipu-partition")
    assert sim.calls() == [LIST]
    assert sim.state() == before


@pytest.mark.timeout(30)
def test_no_partition_and_none_named_is_an_error(sim):
    with pytest.raises(ConfigError, match="no V-IPU partition exists and none was named"):
        acquire(SETTINGS, JOB, log=sim.log)
    assert sim.calls() == [LIST]
    assert sim.partitions() == {}


# --- 3. the partition table, read by header names ------------------------------------------

GUIDE_TABLE = """\
Cluster     | Allocation | Partition | ILDs | GW Routing | ILD Routing | Size | GCDs | State
example     | example    | part1     | 1    | DEFAULT    | DNC         | 16   | 1    | ACTIVE
example     | example    | part2     | 1    | DEFAULT    | DNC         | 16   | 1    | ACTIVE
example     | example    | part3     | 2    | DEFAULT    | DNC         | 32   | 2    | ACTIVE
"""
OLDER_TABLE = """\
 Partition   | Cluster  | ILDs | GW Routing | ILD Routing | Size | GCDs | State
---------------------------------------------------------------------------------
 p64         | c64_1-16 | 1    | DEFAULT    | RINGSWNC    | 64   | 1    | ACTIVE
---------------------------------------------------------------------------------
"""


def test_the_guide_table_is_read():
    rows = parse_partition_table(GUIDE_TABLE)
    assert [row.name for row in rows] == ["part1", "part2", "part3"]
    assert rows[2] == PartitionInfo(
        name="part3", state=PartitionState.ACTIVE, state_text="ACTIVE", size=32, num_gcds=2,
        num_ilds=2, ild_routing="DNC", gw_routing="DEFAULT", allocation="example",
        cluster="example")


def test_the_older_column_order_is_read_by_name():
    (row,) = parse_partition_table(OLDER_TABLE)
    assert (row.name, row.cluster, row.allocation, row.size, row.num_gcds, row.ild_routing,
            row.state) == ("p64", "c64_1-16", None, 64, 1, "RINGSWNC", PartitionState.ACTIVE)


def table_in_order(columns: list[str]) -> str:
    values = {"Cluster": "c1", "Allocation": "a1", "Partition": "px", "ILDs": "2",
              "GW Routing": "DEFAULT", "ILD Routing": "RINGSWNC", "Size": "128", "GCDs": "4",
              "State": "PENDING"}
    return " | ".join(columns) + "\n" + " | ".join(values[c] for c in columns) + "\n"


def test_any_column_order_gives_the_same_partition():
    columns = ["Cluster", "Allocation", "Partition", "ILDs", "GW Routing", "ILD Routing",
               "Size", "GCDs", "State"]
    expected = parse_partition_table(table_in_order(columns))
    assert expected[0].size == 128 and expected[0].num_gcds == 4
    for order in (columns[::-1], columns[2:] + columns[:2], sorted(columns)):
        assert parse_partition_table(table_in_order(order)) == expected


@pytest.mark.parametrize("text, message", [
    ("Cluster | Size\nc | 4\n", "no Partition column"),
    ("Partition | Size\np | 4 | 5\n", "3 columns"),
    ("Partition | Size\np | four\n", "size 'four' is not a number"),
])
def test_an_unreadable_table_is_an_error(text, message):
    with pytest.raises(VipuError, match=message) as caught:
        parse_partition_table(text)
    assert caught.value.kind is Failure.FAILED


def test_no_table_lists_no_partitions():
    assert parse_partition_table("") == ()


def test_server_version_and_states_are_read():
    assert parse_server_version("version: 1.18.0\nhost: localhost:8090\n") == \
        parse_server_version("host: localhost:8090\nversion: 1.18.0")
    reported = parse_server_version("version: 1.18.0\nhost: localhost:8090\n")
    assert (reported.version, reported.host, reported.port) == ("1.18.0", "localhost", 8090)
    assert parse_server_version("version: 1.18.0\n").host is None
    assert PartitionState.parse("PS_ACTIVE") is PartitionState.ACTIVE
    assert PartitionState.parse("ERROR") is PartitionState.ERROR
    assert PartitionState.parse("PS_RESETTING") is PartitionState.UNKNOWN


def test_get_partition_lines_are_read_by_key():
    info = parse_partition_details("p", "State: PS_PENDING\nReconfigurable: true\n"
                                        "Sync Type: c2-compatible\nGCDs: 1\nnoise line\n")
    assert (info.name, info.state, info.reconfigurable, info.sync_type, info.num_gcds) == \
        ("p", PartitionState.PENDING, True, "c2-compatible", 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("table", ["allocation", "cluster"])
def test_both_table_formats_work_end_to_end(sim, table):
    sim.fail(table=table)
    sim.add("p1")
    partition = acquire(SETTINGS, JOB, log=sim.log)
    assert (partition.name, partition.info.size, partition.num_gcds) == ("p1", 32, 2)


# --- 4. requirements, checking, updating and creating -----------------------------------------

def test_requirements_follow_the_guide_example():
    assert (JOB.size, JOB.num_gcds, JOB.num_ilds) == (32, 2, 2)
    wide = Requirements.of(num_replicas=16, ipus_per_replica=8, num_instances=2)
    assert (wide.size, wide.num_gcds, wide.num_ilds, wide.ipus_per_instance) == (128, 2, None, 64)
    with pytest.raises(ConfigError, match="cannot be divided evenly among 3 instances"):
        Requirements.of(num_replicas=4, ipus_per_replica=1, num_instances=3)


def test_mismatches_name_each_difference_and_ignore_what_is_unreported():
    required = Requirements(size=32, num_gcds=2, num_ilds=2, sync_type="pod-native-default",
                            ipu_link_routing_type="ring-swnc", gw_link_routing_type="default")
    found = PartitionInfo(name="p", size=16, num_gcds=1, num_ilds=1, sync_type="c2-compatible",
                          ild_routing="DNC", gw_routing="DEFAULT", reconfigurable=False)
    assert mismatches(required, found) == [
        "size is 16 IPUs, the job needs 32", "1 GCDs, the job needs 2 (one per instance)",
        "ILDs is 1, the job needs 2", "sync type is c2-compatible, the job needs "
        "pod-native-default", "IPU-Link routing is DNC, the job needs ring-swnc"]
    assert mismatches(required, replace(found, size=32, num_gcds=2, num_ilds=2,
                                        sync_type=None, ild_routing="RINGSWNC")) == []
    # A reconfigurable partition is split per instance: room for the job is enough.
    roomy = PartitionInfo(name="p", size=64, num_gcds=1, reconfigurable=True)
    assert mismatches(JOB, roomy) == []
    assert mismatches(JOB, replace(roomy, size=16)) == ["size is 16 IPUs, the job needs 32"]


@pytest.mark.timeout(30)
def test_an_unfit_partition_is_an_error_naming_each_mismatch(sim):
    sim.add("p1", size=16, gcds=1, ilds=1)
    before = sim.state()
    with pytest.raises(ConfigError) as caught:
        acquire(replace(SETTINGS, partition="p1"), JOB, log=sim.log)
    assert one_line(caught.value) == (
        "V-IPU partition p1 does not fit the job: size is 16 IPUs, the job needs 32; 1 GCDs, "
        "the job needs 2 (one per instance); ILDs is 1, the job needs 2 "
        "(--update-partition=yes re-creates it)")
    assert sim.calls() == [LIST, get("p1")]
    assert sim.state() == before


@pytest.mark.timeout(30)
def test_update_partition_removes_and_recreates_it_under_the_same_name(sim):
    sim.add("p1", size=16, gcds=1, ilds=1)
    settings = replace(SETTINGS, partition="p1", update_partition=True, allocation="alloc1")
    partition = acquire(settings, JOB, log=sim.log)
    create = ADDR + ["create", "partition", "p1", "--allocation", "alloc1", "--size", "32",
                     "--num-gcds", "2", "--num-ilds", "2"]
    assert sim.calls() == [LIST, get("p1"), remove("p1"), create, get("p1")]
    assert (sim.partitions()["p1"]["size"], sim.partitions()["p1"]["gcds"]) == (32, 2)
    assert partition.created and partition.remove_on_release
    assert release(partition, sim.log)
    assert sim.calls()[-1] == remove("p1")
    assert sim.partitions() == {}


@pytest.mark.timeout(30)
def test_a_missing_partition_is_created_never_reconfigurable(sim):
    settings = replace(SETTINGS, partition="job", allocation="alloc2",
                       sync_type="pod-native-default", ipu_link_routing_type="ringswnc",
                       gw_link_routing_type="default")
    job = Requirements.of(32, 1, 2, num_ilds=2, settings=settings)
    partition = acquire(settings, job, log=sim.log)
    create = ADDR + ["create", "partition", "job", "--allocation", "alloc2", "--size", "32",
                     "--num-gcds", "2", "--num-ilds", "2", "--sync-type", "pod-native-default",
                     "--routing", "ringswnc", "--gw-routing", "default"]
    assert sim.calls() == [LIST, create, get("job")]
    created = sim.partitions()["job"]
    assert (created["allocation"], created["reconfigurable"]) == ("alloc2", False)
    assert partition.created and partition.info.state is PartitionState.ACTIVE
    release(partition, sim.log)
    assert sim.partitions() == {}


@pytest.mark.timeout(30)
def test_the_deprecated_cluster_option_creates_in_that_cluster(sim):
    partition = acquire(replace(SETTINGS, partition="job", cluster="cluster2"), JOB,
                        log=sim.log)
    assert sim.calls()[1] == ADDR + ["create", "partition", "job", "--cluster", "cluster2",
                                     "--size", "32", "--num-gcds", "2", "--num-ilds", "2"]
    assert sim.partitions()["job"]["allocation"] == "alloc2"
    release(partition, sim.log)


@pytest.mark.timeout(30)
def test_routing_names_match_in_any_spelling(sim):
    sim.add("p1", ild_routing="RINGSWNC")
    settings = replace(SETTINGS, ipu_link_routing_type="ring-swnc")
    job = Requirements.of(32, 1, 2, num_ilds=2, settings=settings)
    assert acquire(settings, job, log=sim.log).name == "p1"
    assert "create" not in sim.verbs()


# --- 5. reset and polling ---------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("reconfigurable, reset_partition, resets", [
    (False, None, True),    # unset: non-reconfigurable partitions are reset
    (True, None, False),    # ... reconfigurable ones are not
    (False, False, False),
    (True, True, True),
])
def test_the_reset_rule(sim, reconfigurable, reset_partition, resets):
    sim.add("p1", reconfigurable=reconfigurable)
    acquire(replace(SETTINGS, reset_partition=reset_partition), JOB, log=sim.log)
    expected = [LIST, get("p1")] + ([ADDR + ["reset", "partition", "p1"], get("p1")]
                                    if resets else [])
    assert sim.calls() == expected


@pytest.mark.timeout(30)
def test_a_new_partition_is_not_reset_even_when_asked(sim):
    partition = acquire(replace(SETTINGS, partition="job", reset_partition=True), JOB,
                        log=sim.log)
    assert sim.verbs() == ["list", "create", "get"]
    release(partition, sim.log)


@pytest.mark.timeout(30)
def test_polling_waits_until_active(sim):
    sim.fail(pending_polls=2)
    partition = acquire(replace(SETTINGS, partition="job"), JOB, log=sim.log)
    assert sim.verbs() == ["list", "create", "get", "get", "get"]
    assert partition.info.state is PartitionState.ACTIVE
    assert "Done polling, final state of job: PS_ACTIVE" in sim.messages()
    release(partition, sim.log)


@pytest.mark.timeout(30)
def test_polling_gives_up_after_the_attempts_and_removes_what_it_created(sim):
    sim.fail(pending_polls=10)
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, partition="job", partition_attempts=3), JOB, log=sim.log)
    assert caught.value.kind is Failure.NOT_READY
    assert one_line(caught.value).startswith(
        "V-IPU partition job was not ACTIVE after creation (3 polls in 5 s, last state "
        "PS_PENDING)")
    assert sim.verbs() == ["list", "create", "get", "get", "get", "remove"]
    assert sim.partitions() == {}


@pytest.mark.timeout(30)
def test_polling_is_bounded_by_the_timeout(sim):
    sim.fail(pending_polls=10_000)
    settings = replace(SETTINGS, partition="job", server_timeout=1, poll_interval=0.1)
    start = time.monotonic()
    with pytest.raises(VipuError) as caught:
        acquire(settings, JOB, log=sim.log)
    assert caught.value.kind is Failure.NOT_READY
    assert time.monotonic() - start < 4
    assert sim.partitions() == {}


# --- 6. removing what poprun created, on every exit path --------------------------------------

@pytest.mark.timeout(30)
def test_release_keeps_a_created_partition_when_asked(sim):
    partition = acquire(replace(SETTINGS, partition="job", remove_partition=False), JOB,
                        log=sim.log)
    assert partition.created and not partition.remove_on_release
    assert release(partition, sim.log) is False
    assert "remove" not in sim.verbs()
    assert "job" in sim.partitions()


@pytest.mark.timeout(30)
def test_release_never_removes_a_partition_poprun_did_not_create(sim):
    sim.add("theirs")
    partition = acquire(SETTINGS, JOB, log=sim.log)
    assert not partition.created
    assert release(partition, sim.log) is False
    assert "remove" not in sim.verbs()
    assert "theirs" in sim.partitions()


@pytest.mark.timeout(30)
def test_a_failed_release_warns_and_does_not_raise(sim):
    partition = acquire(replace(SETTINGS, partition="job"), JOB, log=sim.log)
    sim.fail(unreachable=1)
    assert release(partition, sim.log) is False
    assert "could not remove V-IPU partition job" in sim.messages()
    assert "`vipu remove partition job`" in sim.messages()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_removes_the_created_partition(sim):
    sim.fail(pending_polls=100_000)
    script = ("import asyncio\nfrom poprun.run.vipu import *\nfrom poprun.log import Log\n"
              "asyncio.run(acquire(VipuSettings(server_host='localhost', server_timeout=60, "
              "poll_interval=0.05, partition='job'), Requirements.of(32, 1, 2, 2), "
              "log=Log(0)))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        wait_for(lambda: sim.verbs().count("get") >= 2, 20, "polling to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert b"KeyboardInterrupt" in err
    assert sim.calls()[-1] == ["--api-host", "localhost", "--api-port", "8090",
                               "--server-timeout", "60", "remove", "partition", "job"]
    assert sim.partitions() == {}


# --- 7. what instances get ------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_instances_get_the_server_partition_and_their_gcd(sim):
    sim.add("p1")
    partition = acquire(SETTINGS, JOB, log=sim.log)
    options = json.dumps({"ipuLinkDomainSize": "16", "ipuLinkConfiguration": "slidingWindow",
                          "ipuLinkTopology": "torus", "gatewayMode": "true",
                          "instanceSize": "16"}, separators=(",", ":"))
    common = {E.VIPU_API_HOST: "localhost", E.VIPU_API_PORT: "8090",
              E.VIPU_API_PARTITION_ID: "p1", E.VIPU_API_TIMEOUT: "5",
              E.POPLAR_TARGET_OPTIONS: options}
    # Not reconfigurable: each instance drives its GCD, and no node device is given.
    assert partition.environment(0) == {**common, E.VIPU_API_GCD_ID: "0"}
    assert partition.environment(1) == {**common, E.VIPU_API_GCD_ID: "1"}
    with pytest.raises(ValueError):
        partition.environment(2)


@pytest.mark.timeout(30)
def test_a_single_gcd_partition_sets_no_gcd_and_the_environment_options_win(sim, monkeypatch):
    sim.add("p1", size=4, gcds=1, ilds=1, reconfigurable=True)
    monkeypatch.setenv(E.POPLAR_TARGET_OPTIONS, '{"gatewayMode":"false","extra":"1"}')
    partition = acquire(SETTINGS, Requirements.of(4, 1, 1), log=sim.log)
    env = partition.environment(0)
    assert E.VIPU_API_GCD_ID not in env
    assert env[E.NODE_DEVICE_ID] == "6"  # 4 IPUs: real PopRun's "Preparing parent device 6"
    assert json.loads(env[E.POPLAR_TARGET_OPTIONS]) == {
        "ipuLinkDomainSize": "4", "ipuLinkConfiguration": "default", "ipuLinkTopology": "mesh",
        "gatewayMode": "false", "instanceSize": "4", "extra": "1"}


@pytest.mark.parametrize("size, gcds, node", [
    (1, 1, 0), (4, 1, 6), (16, 1, 30), (64, 1, 126), (64, 4, 30), (64, 64, 0),
    (None, 1, None), (12, 1, None), (16, 3, None),  # unknown, or no Poplar device
])
def test_the_node_device_is_the_whole_of_what_an_instance_sees(size, gcds, node):
    from poprun.plan.partition import node_device

    assert node_device(size, gcds) == node


@pytest.mark.parametrize("size, gcds, job, node", [
    # PopRun 3.1.0 on the reconfigurable 64-IPU partition p64 (popdist/devices.py's sources)
    (64, 1, 1, 0), (64, 1, 2, 64), (64, 1, 4, 96), (64, 1, 8, 112), (64, 1, 16, 120),
    (64, 1, 32, 124), (64, 1, 64, 126),
    (64, 4, 16, 24),  # 4 GCDs of 16 IPUs, 4 of each the job's: the first quad of a GCD
    (64, 1, 12, None), (64, 1, 128, None),  # no device of 12 IPUs; more than there are
])
def test_on_a_partition_larger_than_the_job_the_node_device_spans_the_jobs_ipus(size, gcds,
                                                                                job, node):
    from poprun.plan.partition import node_device

    assert node_device(size, gcds, job) == node


@pytest.mark.timeout(30)
def test_a_job_on_a_larger_reconfigurable_partition_gets_the_device_of_its_first_ipus(sim):
    """16 one-IPU instances on a reconfigurable 64-IPU partition: as PopRun 3.1.0 did, every
    instance gets device 120 (the first 16 IPUs), not 126 (all 64)."""
    sim.add("p64", size=64, gcds=1, ilds=1, reconfigurable=True)
    partition = acquire(replace(SETTINGS, partition="p64"), Requirements.of(16, 1, 16),
                        log=sim.log)
    assert "create" not in sim.verbs()
    for index in (0, 15):
        env = partition.environment(index)
        assert env[E.NODE_DEVICE_ID] == "120" and E.VIPU_API_GCD_ID not in env
    assert "node device 120 (the first 16 of its 64 IPUs) on partition p64" in sim.messages()


@pytest.mark.timeout(30)
def test_bad_environment_target_options_stop_before_anything_is_created(sim, monkeypatch):
    monkeypatch.setenv(E.POPLAR_TARGET_OPTIONS, "gatewayMode=false")
    with pytest.raises(ConfigError, match="POPLAR_TARGET_OPTIONS is not valid JSON"):
        acquire(replace(SETTINGS, partition="job"), JOB, log=sim.log)
    assert sim.calls() == []


def test_target_options_match_poprun_logs():
    # PopRun -vv, a 64-IPU partition with one instance and a 4-IPU one (module docstring).
    pod64 = PartitionInfo(name="p", size=64, num_gcds=1, num_ilds=1)
    assert partition_target_options(pod64, Requirements.of(16, 4, 1)) == {
        "ipuLinkDomainSize": "64", "ipuLinkConfiguration": "slidingWindow",
        "ipuLinkTopology": "torus", "gatewayMode": "true", "instanceSize": "64"}
    pod4 = PartitionInfo(name="p", size=4, num_gcds=1, reconfigurable=True)
    assert partition_target_options(pod4, Requirements.of(4, 1, 1)) == {
        "ipuLinkDomainSize": "4", "ipuLinkConfiguration": "default", "ipuLinkTopology": "mesh",
        "gatewayMode": "true", "instanceSize": "4"}


@pytest.mark.parametrize("instances, size", [(1, "64"), (2, "32"), (4, "16"), (8, "8"),
                                             (16, "4")])
def test_on_a_larger_partition_the_instance_size_is_the_partitions_share(instances, size):
    """PopRun 3.1.0's "Target options from V-IPU partition" on the reconfigurable 64-IPU p64
    with 1-16 one-IPU instances (popdist/devices.py's sources): instanceSize is the
    partition's IPUs per instance."""
    p64 = PartitionInfo(name="p64", size=64, num_gcds=1, num_ilds=1, reconfigurable=True)
    options = partition_target_options(p64, Requirements.of(instances, 1, instances))
    assert (options["ipuLinkDomainSize"], options["instanceSize"]) == ("64", size)


# The two real 64-IPU partitions whose logs are public (plan/partition.py, `Attachment` and
# `link_topology`): ALCF's reconfigurable p64 under PopRun 3.1.0 ("ipuLinkTopology":"mesh",
# a node device), and another under SDK 3.3 ("torus", IPUOF_VIPU_API_GCD_ID=0, no node device).
P64_RECONFIGURABLE = {"size": 64, "gcds": 1, "ilds": 1, "reconfigurable": True}
P64_OTHER = {"size": 64, "gcds": 1, "ilds": 1, "reconfigurable": False}


def test_the_simulator_describes_each_64_ipu_partition_as_the_real_ones_are(sim):
    sim.add("p64", **P64_RECONFIGURABLE)
    sim.add("other", **P64_OTHER)
    described = {name: subprocess.run(["vipu", *ADDR, "get", "partition", name],
                                      capture_output=True, text=True, timeout=30).stdout
                 for name in ("p64", "other")}
    assert "IPU-Link Topology: mesh\n" in described["p64"]
    assert "Reconfigurable: true\n" in described["p64"]
    assert "IPU-Link Topology: torus\n" in described["other"]
    assert parse_partition_details("p64", described["p64"]).ipu_link_topology == "mesh"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fields, topology, gcd, node", [
    (P64_RECONFIGURABLE, "mesh", None, "120"),  # 16 one-IPU instances: the first 16 IPUs
    (P64_OTHER, "torus", "0", None),
])
def test_the_topology_gcd_and_node_device_are_the_partitions_own(sim, fields, topology, gcd,
                                                                  node):
    """Same size, same job shape where each allows it: what the instances get follows the
    partition's description, not its size."""
    sim.add("p64", **fields)
    instances = 16 if fields["reconfigurable"] else 1
    partition = acquire(replace(SETTINGS, partition="p64"),
                        Requirements.of(64 if instances == 1 else 16, 1, instances),
                        log=sim.log)
    env = partition.environment(0)
    assert json.loads(env[E.POPLAR_TARGET_OPTIONS])["ipuLinkTopology"] == topology
    assert (env.get(E.VIPU_API_GCD_ID), env.get(E.NODE_DEVICE_ID)) == (gcd, node)
    assert f'"ipuLinkTopology":"{topology}"' in sim.messages()  # "from V-IPU partition"


def test_a_partition_that_does_not_say_its_gcds_gets_the_node_device():
    """Not reconfigurable, but how many GCDs is not reported: naming a GCD per instance
    could name one that is not there; the node device needs none."""
    from poprun.run.vipu import Partition

    partition = Partition(name="p", host="h", port=8090, timeout=5,
                          info=PartitionInfo("p", size=4, reconfigurable=False), created=False,
                          remove_on_release=False, target_options="{}", executable="vipu",
                          job_ipus=4)
    assert [(e.get(E.VIPU_API_GCD_ID), e[E.NODE_DEVICE_ID])
            for e in map(partition.environment, range(2))] == [(None, "6"), (None, "6")]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reported, used", [("mesh", "mesh"), ("TORUS", "torus"),
                                            ("ring", "torus")])
def test_the_topology_a_partition_reports_wins_over_its_size(sim, reported, used):
    """A description that names its topology is followed; one Poplar does not know is
    named in a warning and the size's is used."""
    sim.add("p64", **P64_OTHER, topology=reported)
    partition = acquire(replace(SETTINGS, partition="p64"), Requirements.of(64, 1, 1),
                        log=sim.log)
    assert json.loads(partition.target_options)["ipuLinkTopology"] == used
    assert ("which Poplar does not know" in sim.messages()) == (reported == "ring")


# --- 8. failures: each its own message, nothing left behind -----------------------------------

@pytest.mark.timeout(30)
def test_an_unreachable_server(sim):
    sim.fail(unreachable=1)
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, partition="job"), JOB, log=sim.log)
    assert caught.value.kind is Failure.UNREACHABLE
    assert one_line(caught.value) == (
        "cannot reach the V-IPU server at localhost:8090 (vipu: unable to connect to "
        "VIRM/V-IPU Controller at context deadline exceeded); check that the server runs there "
        "(`systemctl status vipu-server` on its host) or name the right one with "
        "--vipu-server-host/--vipu-server-port")
    assert sim.calls() == [LIST]
    assert sim.partitions() == {}


@pytest.mark.timeout(30)
def test_a_wrong_server_host_is_unreachable(sim):
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, server_host="vipu.example"), JOB, log=sim.log)
    assert caught.value.kind is Failure.UNREACHABLE
    assert "cannot reach the V-IPU server at vipu.example:8090" in one_line(caught.value)


@pytest.mark.timeout(30)
def test_an_allocation_too_small(sim):
    sim.fail(free_ipus=16)
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, partition="job", allocation="alloc1"), JOB, log=sim.log)
    assert caught.value.kind is Failure.CREATE_FAILED
    assert one_line(caught.value) == (
        "could not create V-IPU partition job (32 IPUs, 2 GCDs, allocation alloc1): "
        "`vipu create partition job --allocation alloc1 --size 32 --num-gcds 2 --num-ilds 2` "
        "failed: create partition (job): failed: not enough free IPUs in allocation alloc1: "
        "32 requested, 16 available.; the allocation may not have enough free IPUs matching "
        "the requirements: remove some partitions or ask for fewer IPUs")
    assert sim.verbs() == ["list", "create"]
    assert sim.partitions() == {}


@pytest.mark.timeout(30)
def test_a_created_partition_in_error_state_is_removed(sim):
    sim.fail(end_state="ERROR", pending_polls=1)
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, partition="job"), JOB, log=sim.log)
    assert caught.value.kind is Failure.ERROR_STATE
    assert one_line(caught.value) == (
        "V-IPU partition job is in an error state (PS_ERROR) after creation; reset it with "
        "`vipu reset partition job` or run with --reset-partition=yes")
    assert sim.verbs() == ["list", "create", "get", "get", "remove"]
    assert sim.partitions() == {}


@pytest.mark.timeout(30)
def test_an_existing_partition_in_error_state_is_reported_and_left_alone(sim):
    sim.add("theirs", state="ERROR", reconfigurable=True)  # not reset by default
    with pytest.raises(VipuError) as caught:
        acquire(SETTINGS, JOB, log=sim.log)
    assert caught.value.kind is Failure.ERROR_STATE
    assert "V-IPU partition theirs is in an error state (PS_ERROR);" in one_line(caught.value)
    assert sim.calls() == [LIST, get("theirs")]
    assert sim.partitions()["theirs"]["state"] == "ERROR"


@pytest.mark.timeout(30)
def test_the_default_reset_repairs_a_partition_in_error_state(sim):
    sim.add("p1", state="ERROR")
    partition = acquire(SETTINGS, JOB, log=sim.log)
    assert sim.verbs() == ["list", "get", "reset", "get"]
    assert partition.info.state is PartitionState.ACTIVE


@pytest.mark.timeout(30)
def test_vipu_not_installed_suggests_offline_mode(sim, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(VipuError) as caught:
        acquire(SETTINGS, JOB, log=sim.log)
    assert caught.value.kind is Failure.NOT_INSTALLED
    assert "--offline-mode=yes" in one_line(caught.value)
    assert sim.calls() == []


@pytest.mark.timeout(30)
def test_a_request_that_outlives_the_timeout_is_killed(sim):
    sim.fail(delay=30)
    start = time.monotonic()
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, server_timeout=1), JOB, log=sim.log)
    assert time.monotonic() - start < 6
    assert caught.value.kind is Failure.TIMED_OUT
    assert caught.value.command == ("list", "partitions")
    assert one_line(caught.value) == (
        "the V-IPU server at localhost:8090 did not answer `vipu list partitions` within 1 s "
        "(raise --vipu-server-timeout if it is just slow)")


@pytest.mark.timeout(30)
def test_a_create_that_times_out_is_removed_in_case_it_happened(sim):
    sim.fail(delay=30, delay_on="create")
    with pytest.raises(VipuError) as caught:
        acquire(replace(SETTINGS, partition="job", server_timeout=1), JOB, log=sim.log)
    assert caught.value.kind is Failure.TIMED_OUT
    # The killed create never reached the state; removing it fails, with advice.
    assert sim.verbs() == ["list", "create", "remove"]
    assert sim.partitions() == {}
    assert "`vipu remove partition job`" in sim.messages()
