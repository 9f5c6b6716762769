"""Spares and quarantine, the pure parts: which spare takes which host (plan/jobhosts.py), what
the quarantine file keeps (poprun/jobctl/quarantine.py) and how it is read when damaged, and
--quarantine-for's durations (plan/config.py)."""

from __future__ import annotations

import json
import os
import random

import pytest

from poprun.errors import ConfigError
from poprun.jobctl import quarantine
from poprun.jobctl.quarantine import Entry
from poprun.plan.config import parse_duration
from poprun.plan.hosts import Host
from poprun.plan.jobhosts import JobHosts, leave_out, pair_spares


def job(*labels: str, spares: tuple[str, ...] = (), counts: tuple[int, ...] = ()) -> JobHosts:
    return JobHosts(tuple(Host(h) for h in labels), frozenset(labels),
                    counts or (2,) * len(labels), spares=tuple(Host(h) for h in spares))


def test_spares_are_paired_in_host_order_with_the_first_spares_left():
    assert pair_spares(["h2", "h4"], ["s1", "s2", "s3"]) == {"h2": "s1", "h4": "s2"}
    assert pair_spares(["h2", "h4"], ["s1"]) == {"h2": "s1"}
    assert pair_spares(["h2"], []) == {}


def test_a_substituted_spare_takes_the_hosts_position_and_count():
    hosts = job("h1", "h2", "h3", spares=("s1", "s2"), counts=(1, 3, 2))
    after = hosts.substituted({"h2": Host("s2")})
    assert after.labels == ("h1", "s2", "h3")
    assert after.counts == (1, 3, 2)  # the same instances: 1..3 on s2
    assert after.remote == {"h1", "s2", "h3"}
    assert [str(h) for h in after.spares] == ["s1"]


def test_quarantined_hosts_are_left_out_for_spares_or_refused():
    hosts = job("h1", "h2", spares=("s1", "s2"))
    after, warnings = leave_out(hosts, {"h2": "lost: x", "s1": "lost: y"})
    assert after.labels == ("h1", "s2") and after.spares == ()
    assert warnings == ["spare host s1 left out: quarantined (lost: y)",
                        "h2 left out: quarantined (lost: x); spare host s2 runs its instances"]
    with pytest.raises(ConfigError, match=r"h1 is quarantined \(lost: z\) and no spare host "
                                          r"is left.*--release h1 h2\)"):
        leave_out(job("h1", "h2"), {"h1": "lost: z", "h2": "lost: z"})
    assert leave_out(hosts, {}) == (hosts, [])


def test_the_file_keeps_one_entry_per_host_the_longest_and_drops_the_expired():
    old, new = Entry("h2", "lost: a", 10, 100, "j1"), Entry("h2", "lost: b", 50, 200, "j2")
    gone = Entry("h3", "lost: c", 1, 20)
    assert quarantine.merged([old, gone], [new], now=30) == [new]
    assert quarantine.active([old, new, gone], now=150) == {"h2": new}
    kept, released = quarantine.released([old, gone, Entry("h4", "r", 1, 500)], ["h2", "h9"],
                                          now=30)
    assert [e.host for e in kept] == ["h4"] and released == ["h2"]
    many = [Entry(f"h{i}", "r", i, 10**9) for i in range(quarantine.MAX_ENTRIES + 5)]
    assert quarantine.merged(many, [], now=0)[0].host == "h5"  # the newest kept


def test_add_and_release_round_trip_in_a_private_file(job_state):
    quarantine.add([Entry("h2", "lost: x", 1.0, 2e9, "j")], now=10)
    entries, problem = quarantine.read()
    assert problem is None and entries == [Entry("h2", "lost: x", 1.0, 2e9, "j")]
    assert os.stat(quarantine.path()).st_mode & 0o777 == 0o600
    assert quarantine.release(["h2", "h3"], now=10) == ["h2"]
    assert quarantine.read() == ([], None)


@pytest.mark.parametrize("content,problem", [
    (b"{", "is not JSON"),
    (b"[]", "is not a poprun.quarantine/1 file"),
    (b'{"schema": "poprun.quarantine/1", "hosts": {}}', "is not a poprun.quarantine/1 file"),
    (b"x" * (quarantine.MAX_FILE + 1), "is larger than"),
    (b"\xff\xfe", "is not JSON"),
])
def test_a_damaged_file_reads_as_empty_and_says_so(job_state, content, problem):
    os.makedirs(os.path.dirname(quarantine.path()), mode=0o700, exist_ok=True)
    with open(quarantine.path(), "wb") as fh:
        fh.write(content)
    entries, said = quarantine.read()
    assert entries == [] and problem in said


def test_damaged_entries_are_skipped_and_counted(job_state):
    """Fuzzed entries: whatever they hold, reading never raises, keeps only whole entries
    (host and reason text, finite-typed times, a job id or none) and counts the others."""
    rng = random.Random(47)
    values = [None, True, 1, 1.5, float("nan"), "", "h", [], {}, "x" * 600, -1e308]
    good = {"host": "h2", "reason": "lost: x", "at": 1.0, "until": 2e9, "job": None}
    raw = [good] + [{k: rng.choice(values) for k in good} for _ in range(300)]
    os.makedirs(os.path.dirname(quarantine.path()), mode=0o700, exist_ok=True)
    with open(quarantine.path(), "w") as fh:
        json.dump({"schema": quarantine.SCHEMA, "hosts": raw}, fh)
    entries, problem = quarantine.read()
    assert Entry("h2", "lost: x", 1.0, 2e9) in entries
    for entry in entries:
        assert isinstance(entry.host, str) and entry.host and len(entry.host) <= 500
        assert isinstance(entry.reason, str) and isinstance(entry.at, float)
        assert entry.at == entry.at and entry.until == entry.until
    skipped = len(raw) - len(entries)
    assert (problem is None) == (skipped == 0)
    if skipped:
        assert f"{skipped} damaged entries skipped" in problem


@pytest.mark.parametrize("text,seconds", [("0", 0), ("90", 90), ("90s", 90), ("30m", 1800),
                                          ("2h", 7200), ("1d", 86400), (" 1.5h ", 5400)])
def test_durations(text, seconds):
    assert parse_duration(text, "--quarantine-for") == seconds


@pytest.mark.parametrize("text", ["", "h", "-1h", "1w", "1 h m", "1e3"])
def test_bad_durations_name_the_option(text):
    with pytest.raises(ConfigError, match="--quarantine-for: .* is not a duration"):
        parse_duration(text, "--quarantine-for")


def test_spare_nodes_are_the_allocations_last():
    from poprun.plan.config import LaunchConfig

    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x3)"}
    config = LaunchConfig(program=("x",), num_instances=4, num_replicas=4, spare_nodes=1,
                          max_restarts=1)
    hosts = JobHosts.of(config, env)
    assert hosts.labels == ("n1", "n2") and hosts.counts == (2, 2)
    assert [str(h) for h in hosts.spares] == ["n3"] and hosts.transport == "slurm"
    with pytest.raises(ConfigError, match=r"--spare-nodes 3: .* has 3 node\(s\)"):
        JobHosts.of(LaunchConfig(program=("x",), spare_nodes=3, max_restarts=1), env)
