"""Host slots, MPI hostfiles and Slurm allocations: uneven instance
counts per host, from `h1:4,h2:2`, `node1 slots=4`, or SLURM_JOB_NODELIST with
SLURM_TASKS_PER_NODE and SLURM_NTASKS; dry-run plans and real sshd hosts."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from conftest import OFFLINE, assert_usage_error, run_poprun
from poprun.errors import ConfigError
from poprun.plan.hosts import (Host, expand_brackets, instance_counts, parse_host_file,
                          parse_host_list, parse_tasks_per_node)
from sshd_hosts import start_ssh_hosts

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
SLURM_ONLY = {"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "", "SLURM_TASKS_PER_NODE": "",
              "SLURM_NTASKS": "", "OMPI_MCA_orte_default_hostfile": ""}


def dry_run(*args: str, env: dict[str, str] | None = None) -> dict:
    proc = run_poprun(*OFFLINE, "--dry-run", "--json", *args, env={**SLURM_ONLY, **(env or {})})
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def placed(plan: dict) -> list[tuple[str, int, str]]:
    return [(i["host"], i["local_index"], i["env"]["LOCAL_WORLD_SIZE"])
            for i in plan["instances"]]


# --- parsing (pure) ---------------------------------------------------------------------------

def test_slots_ports_and_the_port_looking_slot():
    assert parse_host_list("h1:4,h2:2,h3") == (Host("h1", slots=4), Host("h2", slots=2),
                                               Host("h3"))
    assert [h.slots for h in parse_host_list("alice@h1:4")] == [4]
    assert parse_host_list("ssh://bob@h9:2222") == (Host("h9", "bob", 2222),)
    with pytest.raises(ConfigError, match=r"'h1:2222': `host:N` gives the host N slots.*"
                                          r"ssh://h1:2222 or set Port in ~/.ssh/config"):
        parse_host_list("h1:2222")
    with pytest.raises(ConfigError, match="not a number of slots"):
        parse_host_list("h1:0")


def test_counts_follow_the_slots_and_must_match_num_instances():
    hosts = parse_host_list("h1:4,h2:2")
    assert instance_counts(hosts, None) == (4, 2) == instance_counts(hosts, 6)
    assert instance_counts(parse_host_list("h1:3,h2"), None) == (3, 1)  # 1 when unsaid
    assert instance_counts(parse_host_list("h1,h2"), 4) == (2, 2)
    with pytest.raises(ConfigError, match=r"--num-instances=5 does not match the 6 slots of "
                                          r"--host \(h1:4 \+ h2:2\)"):
        instance_counts(hosts, 5)
    with pytest.raises(ConfigError, match="not divisible by the 2 hosts"):
        instance_counts(parse_host_list("h1,h2"), 3)


def test_mpi_hostfiles():
    """The format Open MPI reads and the Kubeflow MPI Operator mounts at /etc/mpi/hostfile."""
    text = ("# generated\nworker-0.svc slots=4 max_slots=8\nworker-1.svc slots=2\n"
            "worker-2.svc\n\n")
    assert [(h.name, h.slots) for h in parse_host_file(text, "hostfile")] == [
        ("worker-0.svc", 4), ("worker-1.svc", 2), ("worker-2.svc", None)]
    with pytest.raises(ConfigError, match="hostfile, line 1: 'cpus=2' is not slots=N"):
        parse_host_file("n1 cpus=2\n", "hostfile")


@pytest.mark.parametrize("text, expected", [  # the forms in Slurm's own documentation
    ("2(x3),1", (2, 2, 2, 1)), ("1(x4)", (1, 1, 1, 1)), ("4,2,2,1", (4, 2, 2, 1)),
    ("16(x2),8(x2)", (16, 16, 8, 8)),
])
def test_slurm_tasks_per_node(text, expected):
    hosts = (Host("n"),) * len(expected)
    assert parse_tasks_per_node(text, hosts, "SLURM_TASKS_PER_NODE") == expected


def test_slurm_tasks_per_node_errors():
    with pytest.raises(ConfigError, match="gives 3 count"):
        parse_tasks_per_node("2(x3)", (Host("a"),) * 2, "SLURM_TASKS_PER_NODE")
    with pytest.raises(ConfigError, match="not a count"):
        parse_tasks_per_node("2(y3)", (Host("a"),), "SLURM_TASKS_PER_NODE")


@pytest.mark.parametrize("text, expected", [  # Slurm hostlist forms
    ("lx[10-12]", ["lx10", "lx11", "lx12"]),
    ("lx[10,12-13]", ["lx10", "lx12", "lx13"]),
    ("pod[01-04,07]", ["pod01", "pod02", "pod03", "pod04", "pod07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
])
def test_slurm_hostlists(text, expected):
    assert [h.name for h in parse_host_list(text)] == expected
    if "," not in text:
        assert expand_brackets(text) == expected


# --- plans ------------------------------------------------------------------------------------

def test_a_plan_follows_uneven_slots():
    plan = dry_run("-H", "h1:3,h2:1", "--num-replicas=8", PY)  # no --num-instances: 3 + 1
    assert placed(plan) == [("h1", 0, "3"), ("h1", 1, "3"), ("h1", 2, "3"), ("h2", 0, "1")]
    assert [i["replicas"] for i in plan["instances"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [i["env"]["POPDIST_LOCAL_INSTANCE_INDEX"] for i in plan["instances"]] == \
        ["0", "1", "2", "0"]


def test_print_topology_spans_follow_the_counts():
    proc = run_poprun(*OFFLINE, "--dry-run", "--print-topology", "-H", "h1:3,h2:1",
                      "--num-replicas=4", PY, env=SLURM_ONLY)
    table = proc.stdout.decode().splitlines()
    hosts_row = next(line for line in table if line.startswith("| hosts"))
    cells = hosts_row.strip("|").split("|")[1:]
    assert [c.strip() for c in cells] == ["h1", "h2"] and len(cells[0]) > 2 * len(cells[1])


def test_a_mismatch_with_num_instances_is_one_line():
    proc = run_poprun(*OFFLINE, "--dry-run", "-H", "h1:4,h2:2", "--num-instances=5",
                      "--num-replicas=5", PY, env=SLURM_ONLY)
    assert_usage_error(proc, "--num-instances=5 does not match the 6 slots")


def test_an_mpi_host_file_and_the_operators_default_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("w0 slots=2 max_slots=4\nw1 slots=1\n")
    by_option = dry_run("--host-file", str(hostfile), "--num-replicas=3", PY)
    by_environment = dry_run("--num-replicas=3", PY,
                             env={"OMPI_MCA_orte_default_hostfile": str(hostfile)})
    assert placed(by_option) == placed(by_environment) == [("w0", 0, "2"), ("w0", 1, "2"),
                                                           ("w1", 0, "1")]


def test_inside_a_slurm_allocation_hosts_and_counts_come_from_it():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NTASKS": "5"}
    plan = dry_run("--num-replicas=5", "--launcher=ssh", PY, env=env)
    assert [i["host"] for i in plan["instances"]] == ["node1", "node1", "node2", "node2", "node3"]
    # An explicit count wins over the task counts: an even share...
    plan = dry_run("--num-instances=6", "--num-replicas=6", "--launcher=ssh", PY, env=env)
    assert [i["host"] for i in plan["instances"]] == ["node1", "node1", "node2", "node2",
                                                      "node3", "node3"]
    # ... which must then divide evenly.
    proc = run_poprun(*OFFLINE, "--dry-run", "--num-instances=4", "--num-replicas=4",
                      "--launcher=ssh", PY, env={**SLURM_ONLY, **env})
    line = assert_usage_error(proc, "--num-instances=4 is not divisible by the 3 hosts")
    assert "the Slurm allocation (SLURM_JOB_NODELIST=node[1-3]" in line
    assert "(5 task(s); --num-instances=4 given wins)" in line


def test_with_restarts_the_allocation_s_nodes_beyond_the_instances_are_spares():
    """--num-instances filling the first nodes at Slurm's tasks per node, with --max-restarts:
    those run the job (each its task count), the others stand by (docs/slurm.md). Without
    restarts, with --spare-nodes 0, or where no first nodes hold exactly that many, as
    before."""
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-4]",
           "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_NTASKS": "8"}
    args = ("--num-instances=4", "--num-replicas=4", "--launcher=ssh")
    plan = dry_run(*args, "--max-restarts=1", PY, env=env)
    assert placed(plan) == [("node1", 0, "2"), ("node1", 1, "2"), ("node2", 0, "2"),
                            ("node2", 1, "2")]
    assert plan["spares"] == ["node3", "node4"]
    for before in ((), ("--max-restarts=1", "--spare-nodes=0")):  # an even share, as before
        plan = dry_run(*args, *before, PY, env=env)
        assert [i["host"] for i in plan["instances"]] == ["node1", "node2", "node3", "node4"]
        assert plan["spares"] == []
    uneven = dry_run(*args, "--max-restarts=1", PY,  # first nodes hold 2, 5, 8: none 4
                     env={**env, "SLURM_TASKS_PER_NODE": "2,3(x3)"})
    assert [i["host"] for i in uneven["instances"]] == ["node1", "node2", "node3", "node4"]
    assert uneven["spares"] == []


# The environment of `srun --ipus=4 poprun --num-instances=2 ...` inside a one-task step, as
# ALCF's Graphcore user guide runs it.
ONE_TASK_STEP = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "gc-poplar-02",
                 "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}


def test_a_one_task_step_asked_for_two_instances_runs_them_on_its_node():
    plan = dry_run("--num-instances=2", "--num-replicas=4", PY, env=ONE_TASK_STEP)
    assert placed(plan) == [("gc-poplar-02", 0, "2"), ("gc-poplar-02", 1, "2")]
    assert [i["replicas"] for i in plan["instances"]] == [[0, 1], [2, 3]]
    alone = dry_run("--num-replicas=4", PY, env=ONE_TASK_STEP)  # not given: the task count
    assert placed(alone) == [("gc-poplar-02", 0, "1")]


def test_verbose_says_the_given_instance_count_wins_over_the_task_count():
    node = socket.gethostname()  # this machine: its instances start here, over SSH's rules
    env = {**ONE_TASK_STEP, "SLURM_JOB_NODELIST": node}
    proc = run_poprun(*OFFLINE, "-v", "--launcher=ssh", "--num-instances=2",
                      "--num-replicas=2", "true", env={**SLURM_ONLY, **env})
    assert proc.returncode == 0, proc.stderr.decode()
    assert (f"hosts: {node} (2) from the Slurm allocation (SLURM_JOB_NODELIST={node}) with "
            "SLURM_TASKS_PER_NODE=1 (1 task(s); --num-instances=2 given wins)"
            in proc.stderr.decode())


# --- mpirun's --npernode -----------------------------------------------------------------------

def test_npernode_counts_the_instances_of_every_host():
    hosts = parse_host_list("h1:4,h2")
    assert instance_counts(hosts, None, per_host=2) == (2, 2)  # over the slots, as Open MPI
    assert instance_counts((), None, per_host=16) == (16,)  # no hosts: this one
    assert instance_counts(hosts, 4, per_host=2) == (2, 2)
    with pytest.raises(ConfigError, match=r"--num-instances=3 does not match mpirun's "
                                          r"--npernode 2 on the 2 host\(s\) of --host"):
        instance_counts(hosts, 3, per_host=2)
    with pytest.raises(ConfigError, match="--npernode 16 on this host"):
        instance_counts((), 64, per_host=16)


def test_npernode_in_the_mpi_args_gives_each_host_its_instances():
    """balewski/neuron_inverter_benchmark's run-slurm.sh: one host, 16 instances."""
    plan = dry_run("--mpi-global-args=--tag-output --npernode 16", "--num-replicas=16", PY)
    assert placed(plan) == [("localhost", i, "16") for i in range(16)]
    plan = dry_run("--mpi-local-args=-N 2", "-H", "h1,h2", "--num-replicas=4", PY)
    assert placed(plan) == [("h1", 0, "2"), ("h1", 1, "2"), ("h2", 0, "2"), ("h2", 1, "2")]
    in_slurm = dry_run("--mpi-global-args=--npernode 2", "--num-instances=4",
                       "--num-replicas=4", "--launcher=ssh", PY,
                       env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
                            "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS": "2"})
    assert placed(in_slurm) == [("n1", 0, "2"), ("n1", 1, "2"), ("n2", 0, "2"), ("n2", 1, "2")]


@pytest.mark.parametrize("args, message", [
    (("--mpi-global-args=--npernode 2", "--num-instances=3", "--num-replicas=3"),
     "--num-instances=3 does not match mpirun's --npernode 2 on this host (2 instances)"),
    (("--mpi-global-args=--npernode 2", "-H", "h1,h2", "--num-instances=2",
      "--num-replicas=2"), "--num-instances=2 does not match mpirun's --npernode 2 on the 2 "
                           "host(s) of --host (4 instances)"),
    (("--instance-mpi-local-args=0:--npernode 1", "--num-replicas=1"),
     "--npernode counts the instances of every host"),
])
def test_npernode_that_contradicts_the_instances_is_one_line(args, message):
    assert_usage_error(run_poprun(*OFFLINE, "--dry-run", *args, PY, env=SLURM_ONLY), message)


def test_verbose_says_where_hosts_and_counts_came_from():
    proc = run_poprun(*OFFLINE, "-v", "-H", "localhost:2", "--num-replicas=2", "true",
                      env=SLURM_ONLY)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "hosts: localhost (2) from --host" in proc.stderr.decode()


# --- real hosts -------------------------------------------------------------------------------

def test_slots_and_an_mpi_hostfile_on_real_hosts(tmp_path):
    show = ("import json, os; print(json.dumps([os.environ['RANK'], os.environ['LOCAL_RANK'],"
            " os.environ['LOCAL_WORLD_SIZE'], os.environ['POPRUN_SSH_CONNECTION'].split()[2]]))")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("h1 slots=2 max_slots=2\nh2 slots=1\n")
    with start_ssh_hosts(2, tmp_path) as hosts:
        for hosts_given in (["-H", "h1:2,h2:1"], ["--host-file", str(hostfile)]):
            proc = run_poprun(*OFFLINE, *hosts_given, "--num-replicas=3", PY, "-c", show,
                              env={**SLURM_ONLY, **hosts.env()})
            assert proc.returncode == 0, proc.stderr.decode()
            seen = sorted(json.loads(line) for line in proc.stdout.decode().splitlines())
            assert seen == [["0", "0", "2", "127.0.77.1"], ["1", "1", "2", "127.0.77.1"],
                            ["2", "0", "1", "127.0.77.2"]]


def test_numa_placement_follows_each_hosts_count_and_topology():
    """h1:3 on a 4-node EPYC spreads its 3 instances over its nodes (one takes two); h2:2 on
    a 2-socket Xeon puts one on each socket: each host placed from its own count and
    topology."""
    from poprun.plan.config import LaunchConfig
    from poprun.plan.planner import plan
    from poprun.plan.topology import parse_topology
    from sysfs_machines import EPYC_NPS4, XEON_2S, load_files

    config = LaunchConfig(program=("true",), num_instances=5, num_replicas=5, offline_mode=True)
    topologies = {"h1": parse_topology(load_files(EPYC_NPS4)),
                  "h2": parse_topology(load_files(XEON_2S))}
    launch_plan = plan(config, {}, program=("/bin/true",), master_port=29500, hosts=("h1", "h2"),
                       remote_hosts=frozenset({"h1", "h2"}), topologies=topologies,
                       counts=(3, 2))
    placed = [(i.host, tuple(i.mems), sorted(i.cpus)) for i in launch_plan.instances]
    assert [h for h, _, _ in placed] == ["h1"] * 3 + ["h2"] * 2
    for host, machine, count in (("h1", EPYC_NPS4, 3), ("h2", XEON_2S, 2)):
        nodes = [mems for h, mems, _ in placed if h == host]
        assert sorted(n for mems in nodes for n in mems) == sorted(machine.nodes)  # all, once
        for mems, cpus in ((m, c) for h, m, c in placed if h == host):
            assert cpus == sorted(c for n in mems for c in machine.node_cpus(n))
    assert [m for h, m, _ in placed if h == "h2"] == [(n,) for n in XEON_2S.nodes]


def test_an_ssh_url_gives_the_port_and_user_on_a_real_host(tmp_path):
    """`ssh://user@host:port`, with no ~/.ssh/config entry for it: the agent is reached on
    that port (its SSH_CONNECTION's server side says so)."""
    show = "import os; print(os.environ['POPRUN_SSH_CONNECTION'].split()[2:])"
    with start_ssh_hosts(1, tmp_path) as hosts:
        (host,) = hosts.hosts
        (hosts.home / ".ssh" / "config").unlink()  # the URL alone says where
        url = f"ssh://{hosts.user}@{host.addr}:{host.port}"
        proc = run_poprun(*OFFLINE, "-H", url, "--num-instances=1", "--num-replicas=1",
                          PY, "-c", show, env={**SLURM_ONLY, **hosts.env()})
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == str([host.addr, str(host.port)])
