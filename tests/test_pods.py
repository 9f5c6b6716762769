"""Pod mode (docs/kubernetes.md; docs/architecture.md, "Pod mode").

Kubernetes pods are faked as network namespaces on a bridge (tests/netns_hosts.py): each has
its own address, its own names (entries in the hosts file `ip netns exec` mounts over
/etc/hosts, as a headless service's DNS gives them) and its own environment (the contract's
variables a job controller sets), and every one runs the same poprun command. What a real
cluster adds (kubelet, DNS, images) cannot run here; the contracts' variables and the pods'
names are what poprun reads of it.

The contract readers' unit tests are at the top: they need no namespaces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import OFFLINE, assert_usage_error, poprun_argv, poprun_env, reaped, run_poprun
from poprun.errors import ConfigError
from poprun.plan.pods import DEFAULT_PORT, contract_in, read_pod

SECRET = "s3cret-for-the-test-pods-0123456789"
WAIT = 90  # seconds a whole pod job may take under load

# --- the contracts, read ------------------------------------------------------------------


def trainer_env(n: int, i: int) -> dict[str, str]:
    return {"PET_NNODES": str(n), "PET_NODE_RANK": str(i), "PET_MASTER_PORT": "29400",
            "PET_MASTER_ADDR": "tj-node-0-0.tj"}


def lws_env(n: int, i: int) -> dict[str, str]:
    return {"LWS_GROUP_SIZE": str(n), "LWS_WORKER_INDEX": str(i),
            "LWS_LEADER_ADDRESS": "lws-0.lws"}


def volcano_env(n: int, i: int) -> dict[str, str]:
    return {"VC_TASK_INDEX": str(i),
            "VC_WORKER_HOSTS": ",".join(f"vc-worker-{k}.vc" for k in range(n))}


def jobset_env(n: int, i: int) -> dict[str, str]:
    return {"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"js-node-0-{i}", "POPRUN_PODS": str(n),
            "POPRUN_POD_SUBDOMAIN": "js"}


CONTRACTS = {"trainer": trainer_env, "lws": lws_env, "volcano": volcano_env,
             "jobset": jobset_env}
# Each contract's name for pod k, as the pods resolve it (a headless service's DNS).
NAMES = {"trainer": "tj-node-0-{k}.tj", "lws": "lws-0.lws", "volcano": "vc-worker-{k}.vc",
         "jobset": "js-node-0-{k}.js"}


@pytest.mark.parametrize("contract", CONTRACTS)
def test_each_contract_read(contract):
    pod = read_pod(CONTRACTS[contract](4, 2))
    assert (contract_in(CONTRACTS[contract](4, 2)), pod.count, pod.index) == (contract, 4, 2)
    assert pod.leader == NAMES[contract].format(k=0)
    assert pod.port == (29400 if contract == "trainer" else DEFAULT_PORT)
    assert len(set(pod.labels)) == 4 and not pod.leads
    assert pod.contract in pod.describe()


def test_trainjob_pods_carry_jobset_variables_too_and_trainer_wins():
    env = {**jobset_env(2, 1), **trainer_env(2, 1)}
    assert contract_in(env) == "trainer"


@pytest.mark.parametrize("env, fragment", [
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "a"}, "PET_NODE_RANK='2'"),
    ({"PET_NNODES": "x", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "a"}, "PET_NNODES"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "a b"}, "PET_MASTER_ADDR"),
    ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "x",
      "POPRUN_POD_PORT": "70000"}, "POPRUN_POD_PORT"),
    ({"VC_TASK_INDEX": "0", "VC_A_HOSTS": "a", "VC_B_HOSTS": "b"}, "one task"),
    ({"JOB_COMPLETION_INDEX": "1", "POPRUN_PODS": "2", "HOSTNAME": "js-node-0-0"}, "HOSTNAME"),
    ({}, "no pod contract"),
])
def test_a_broken_contract_is_one_line(env, fragment):
    with pytest.raises(ConfigError) as raised:
        read_pod(env)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


CONTRACT_NAMES = ["PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                  "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS", "VC_TASK_INDEX",
                  "VC_WORKER_HOSTS", "VC_MASTER_HOSTS", "JOB_COMPLETION_INDEX", "HOSTNAME",
                  "POPRUN_PODS", "POPRUN_POD_SUBDOMAIN", "POPRUN_POD_PORT"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(CONTRACT_NAMES),
                       st.one_of(st.text(max_size=40), st.integers(-3, 70000).map(str),
                                 st.sampled_from(["a-0-1", "x-y-0-0", "h1,h2", "h1,h1", "[::1]"])),
                       max_size=8))
def test_any_environment_is_a_pod_or_one_line(env):
    """Whatever a pod's environment holds: a Pod that is consistent, or one ConfigError line."""
    try:
        pod = read_pod(env)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert 0 <= pod.index < pod.count == len(pod.labels) and 0 < pod.port < 65536
    assert pod.leader and len(set(pod.labels)) == pod.count


def test_a_plain_indexed_job_is_no_pod_contract():
    assert contract_in({"JOB_COMPLETION_INDEX": "0", "HOSTNAME": "j-0"}) is None


@pytest.mark.parametrize("args, fragment", [
    (("--launcher=pod", "--host=a,b", "--num-instances=2", "--num-replicas=2", "true"),
     "--host cannot be given"),
    (("--launcher=pod", "--check"), "--check does not run in pod mode"),
    (("--launcher=pod", "--pod-timeout=0", "true"), "--pod-timeout must be positive"),
    # Spare pods with nothing that could use them: no restarts, or no follower to replace.
    (("--launcher=pod", "--spare-nodes=1", "--num-instances=1", "true"),
     "--spare-nodes: nothing could use them"),
    (("--launcher=pod", "--spare-nodes=1", "--max-restarts=1", "--num-instances=1", "true"),
     "a spare pod replaces a follower"),
    (("--launcher=pod", "--spare-hosts=h9", "--max-restarts=1", "--num-instances=1", "true"),
     "give --spare-nodes K"),
])
def test_what_pod_mode_refuses_is_one_line(args, fragment):
    done = run_poprun(*OFFLINE, *args, env={**lws_env(2, 0), "POPRUN_POD_SECRET": SECRET})
    assert_usage_error(done, fragment, stdout_empty=False)


def test_a_short_secret_is_refused():
    done = run_poprun(*OFFLINE, "true", env={**lws_env(2, 0), "POPRUN_POD_SECRET": "short"})
    assert_usage_error(done, "the pod secret is 5 bytes")


# --- pods as network namespaces -------------------------------------------------------------

PODS = 4


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    from netns_hosts import start_netns_hosts

    with start_netns_hosts(PODS, tmp_path_factory.mktemp("pods"), networks=("a",)) as made:
        for i in range(1, PODS + 1):
            add_names(made, i, every=True)
        yield made


def add_names(hosts, i: int, *, every: bool = False, leader_only: bool = False) -> None:
    """Host i's hosts file gets the pods' names (appended: the file `ip netns exec` mounted
    over /etc/hosts stays the same file, so running resolvers see the new lines)."""
    lines = [f"{hosts.addr(k + 1, 'a')} {name.format(k=k)}\n"
             for name in NAMES.values() for k in range(PODS if "{k}" in name else 1)
             if every or (leader_only and k == 0)]
    with open(f"/etc/netns/{hosts.namespace(i)}/hosts", "a") as f:
        f.write("".join(lines))


INSTANCE = """
import os, subprocess, sys
secret = sys.argv[1].encode()
leaks, pid = [], os.getppid()
while pid > 1:  # every ancestor's environment block, as an instance may read them
    with open(f"/proc/{pid}/environ", "rb") as f:
        if secret in f.read():
            leaks.append(pid)
    with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])
where = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True).stdout
print("rank", os.environ["RANK"], "in", where.strip(), "leaks", leaks, flush=True)
"""


def start_pods(hosts, contract: str, n: int, *args: str, secrets=None, which=None,
               verbose: bool = True) -> list[subprocess.Popen]:
    """The pods of a job of n (or those of `which`), each in its namespace (pod k on host
    k+1), all running the same poprun command; stdout and stderr piped."""
    procs = []
    for i in which or range(n):
        env = poprun_env({**hosts.env(), **CONTRACTS[contract](n, i),
                          "POPRUN_POD_SECRET": (secrets or {}).get(i, SECRET)})
        argv = poprun_argv(*OFFLINE, *(["-v"] if verbose else []), "--host-timeout=4", *args)
        procs.append(subprocess.Popen(hosts.exec_argv(i + 1, *argv), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs) -> list[tuple[int, str, str]]:
    out = []
    for proc in procs:
        with reaped(proc):
            stdout, stderr = proc.communicate(timeout=WAIT)
        out.append((proc.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("contract", CONTRACTS)
def test_pods_make_one_job(hosts, contract, n):
    """Every pod runs the same command; one job of 2n instances comes of it, pod k's block
    of instances in pod k's namespace, the leader's output carrying all of them, and no
    instance finds the secret in its ancestors' environment blocks."""
    procs = start_pods(hosts, contract, n, f"--num-instances={2 * n}",
                       f"--num-replicas={2 * n}", sys.executable, "-c", INSTANCE, SECRET)
    (lead, *follow) = finish(procs)
    assert lead[0] == 0, lead[2]
    assert all(f[0] == 0 for f in follow), [f[2] for f in follow]
    assert f"pod mode: pod 0 of {n} (" in lead[2]  # -v names the contract read
    assert read_pod(CONTRACTS[contract](n, 0)).contract in lead[2]
    lines = sorted(line for line in lead[1].splitlines() if line.startswith("rank"))
    expected = sorted(f"rank {r} in {hosts.namespace(r // 2 + 1)} leaks []"
                      for r in range(2 * n))
    assert lines == expected
    assert all(not f[1] for f in follow)  # the output is the leader's to multiplex


def test_without_a_secret_there_is_no_pod_mode(hosts, tmp_path):
    env = poprun_env({**hosts.env(), **lws_env(2, 1)})
    env.pop("POPRUN_POD_SECRET", None)
    done = subprocess.run(hosts.exec_argv(2, *poprun_argv(*OFFLINE, "true")), env=env,
                          capture_output=True, text=True, timeout=WAIT)
    warnings = [line for line in done.stderr.splitlines() if "pod" in line]
    assert done.returncode == 0 and len(warnings) == 1 and "no pod mode" in warnings[0]
    explicit = subprocess.run(hosts.exec_argv(2, *poprun_argv(*OFFLINE, "--launcher=pod",
                                                              "true")),
                              env=env, capture_output=True, text=True, timeout=WAIT)
    assert explicit.returncode == 2
    assert explicit.stderr.count("\n") == 1 and "needs the job's shared secret" in explicit.stderr


def test_a_wrong_secret_is_refused_and_nothing_runs(hosts, tmp_path):
    marks = tmp_path / "ran"
    marks.mkdir()
    procs = start_pods(hosts, "jobset", 2, "--pod-timeout=6", "--num-instances=2",
                       "--num-replicas=2", "sh", "-c", f"touch {marks}/$RANK",
                       secrets={1: "another-secret-of-enough-length"})
    (lead, follower) = finish(procs)
    assert follower[0] == 2, follower[2]
    assert "does not hold this job's secret" in follower[2]
    assert lead[0] == 2 and "did not call back within 6 s" in lead[2], lead[2]
    # The leader proves itself first, so the follower is the one to refuse; a caller that
    # gets past that and proves the wrong secret is refused by the listener (test_callback).
    assert list(marks.iterdir()) == []


def test_a_leader_name_that_resolves_late(hosts, tmp_path):
    """The followers start before the leader's name resolves for them (its pod is not in
    the service yet); it is added once the leader listens, and the job runs."""
    n = 3
    for i in range(2, n + 1):  # a fresh hosts file without the pods' names
        path = Path(f"/etc/netns/{hosts.namespace(i)}/hosts")
        kept = [line for line in path.read_text().splitlines(True) if ".lws" not in line]
        with open(path, "r+") as f:  # in place: the mounted file is this inode
            f.write("".join(kept))
            f.truncate()
    try:
        followers = start_pods(hosts, "lws", n, "--num-instances=3", "--num-replicas=3",
                               "true", which=[1, 2])
        for proc in followers:  # each has failed to resolve it once: an event, not a sleep
            line = proc.stderr.readline()
            while line and "not there yet" not in line:
                line = proc.stderr.readline()
            assert "not there yet" in line and "lws-0.lws" in line
        (leader,) = start_pods(hosts, "lws", n, "--num-instances=3", "--num-replicas=3",
                               "true", which=[0])
        line = leader.stderr.readline()
        while line and "agents on port" not in line:
            line = leader.stderr.readline()
        assert "waiting for 2 pod(s)' agents" in line
        for i in range(2, n + 1):
            add_names(hosts, i, leader_only=True)
        results = finish([leader, *followers])
        assert [r[0] for r in results] == [0, 0, 0], [r[2] for r in results]
        assert "pod2: its agent called" in results[0][2]
    finally:
        for i in range(2, n + 1):
            add_names(hosts, i, every=True)


def test_the_leader_killed_followers_end_within_host_timeout(hosts, tmp_path):
    marks = tmp_path / "started"
    marks.mkdir()
    procs = start_pods(hosts, "trainer", 3, "--num-instances=3", "--num-replicas=3", "sh",
                       "-c", f"echo $$ > {marks}/$RANK.tmp && mv {marks}/$RANK.tmp "
                       f"{marks}/$RANK && exec sleep 600")
    leader, *followers = procs
    with reaped(leader):
        from sshd_hosts import wait_until

        wait_until(lambda: len(list(marks.glob("[0-9]"))) == 3, "every instance started",
                   timeout=WAIT)
        pids = {int(p.name): int(p.read_text()) for p in marks.glob("[0-9]")}
        leader.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        results = finish(followers)
        took = time.monotonic() - killed
    assert [r[0] for r in results] == [69, 69], [r[2] for r in results]
    assert took < 4 + 2, took  # --host-timeout=4, and a margin for the load
    for rank in (1, 2):
        assert not os.path.exists(f"/proc/{pids[rank]}"), f"instance {rank} outlived it"


def test_the_secret_from_a_file(hosts, tmp_path):
    """--pod-secret-file, as a mounted Kubernetes Secret gives it (a trailing newline is not
    part of it); no POPRUN_POD_SECRET anywhere."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    procs = []
    for i in range(2):
        env = poprun_env({**hosts.env(), **volcano_env(2, i)})
        env.pop("POPRUN_POD_SECRET", None)
        argv = poprun_argv(*OFFLINE, "-v", f"--pod-secret-file={secret}", "--num-instances=2",
                           "--num-replicas=2", sys.executable, "-c", INSTANCE, SECRET)
        procs.append(subprocess.Popen(hosts.exec_argv(i + 1, *argv), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    (lead, follower) = finish(procs)
    assert (lead[0], follower[0]) == (0, 0), (lead[2], follower[2])
    assert "pod mode: pod 1 of 2 (Volcano: VC_TASK_INDEX, VC_WORKER_HOSTS)" in follower[2]
    assert sorted(line for line in lead[1].splitlines() if line.startswith("rank")) == [
        f"rank {r} in {hosts.namespace(r + 1)} leaks []" for r in range(2)]


def test_spare_pods_are_the_contract_s_last():
    """--spare-nodes K in pod mode: the last K pods stand by; the job's instances are
    divided among the others (pure: JobHosts from a pod's environment)."""
    from poprun.plan.config import LaunchConfig
    from poprun.plan.jobhosts import JobHosts

    config = LaunchConfig(program=["true"], num_instances=4, num_replicas=4, launcher="pod",
                          spare_nodes=2,
                          max_restarts=1)
    hosts = JobHosts.of(config, volcano_env(4, 0))
    assert [str(h) for h in hosts.hosts] == ["vc-worker-0.vc", "vc-worker-1.vc"]
    assert [str(h) for h in hosts.spares] == ["vc-worker-2.vc", "vc-worker-3.vc"]
    assert hosts.remote == {"vc-worker-1.vc"} and hosts.counts == (2, 2)


def test_a_follower_killed_fails_over_to_a_spare_pod(hosts, tmp_path):
    """3 pods, the last a spare (--spare-nodes 1): pod 1's agent is SIGKILLed mid-job; the
    next attempt runs its instance (index 1) on pod 2, pod 1 quarantined, and the job ends 0.
    The spare's agent called the leader's one port at the start and stood by. A new pod 1
    (Kubernetes' replacement) calling meanwhile is told goodbye: it exits 0, unused."""
    marks = tmp_path / "started"
    marks.mkdir()
    go = tmp_path / "go"
    script = (f"n=${{POPDIST_RESTART_COUNT:-0}}; echo $$ $(ip netns identify) > "
              f"{marks}/$RANK-$n.tmp && mv {marks}/$RANK-$n.tmp {marks}/$RANK-$n; "
              f"[ $n = 0 ] && exec sleep 600; while [ ! -e {go} ]; do sleep 0.05; done")
    args = ("--num-instances=2", "--num-replicas=2", "--spare-nodes=1", "--max-restarts=1",
            "--quarantine-for=0", "sh", "-c", script)
    leader, lost, spare = start_pods(hosts, "volcano", 3, *args)
    from sshd_hosts import wait_until

    with reaped(leader), reaped(spare):
        with reaped(lost):
            wait_until(lambda: len(list(marks.glob("?-0"))) == 2, "attempt 0 started",
                       timeout=WAIT)
            first = {p.name: p.read_text().split() for p in marks.glob("?-0")}
            lost.send_signal(signal.SIGKILL)  # the pod's poprun: its agent (run/podmode.py)
            lost.communicate(timeout=WAIT)
        wait_until(lambda: len(list(marks.glob("?-1"))) == 2, "attempt 1 started",
                   timeout=WAIT)
        [(again, _, again_err)] = finish(start_pods(hosts, "volcano", 3, *args, which=[1]))
        go.touch()
        results = finish([leader, spare])
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    assert (lost.returncode, again) == (-signal.SIGKILL, 0), again_err
    seen = {p.name: p.read_text().split() for p in marks.glob("?-?")}
    assert sorted(seen) == ["0-0", "0-1", "1-0", "1-1"], results[0][2]
    assert [first["0-0"][1], first["1-0"][1]] == [hosts.namespace(1), hosts.namespace(2)]
    assert [seen["0-1"][1], seen["1-1"][1]] == [hosts.namespace(1), hosts.namespace(3)]
    lead_err = results[0][2]
    assert ("vc-worker-1.vc replaced by spare host vc-worker-2.vc for the next attempt "
            "(1 instance(s))") in lead_err
    assert "vc-worker-1.vc quarantined for the rest of the job: lost (" in lead_err
    assert "vc-worker-1.vc: its agent called, but the pod is quarantined" in lead_err
    wait_until(lambda: not os.path.exists(f"/proc/{first['1-0'][0]}"),
               "the lost pod's instance ended", timeout=10)


def test_a_pod_quarantined_earlier_is_left_out_for_a_spare_pod(hosts, job_state, tmp_path):
    """Pod 1 is quarantined by an earlier job (the state directory's file): the job runs its
    instance on the spare pod 2 from the start, and pod 1's agent is told goodbye (exit 0).
    The instances wait until the leader said so (its pod may call late under load)."""
    from poprun.jobctl import quarantine

    quarantine.add([quarantine.Entry("vc-worker-1.vc", "lost: earlier", 1.0, 2e9, "j")],
                   now=10)
    go = tmp_path / "go"
    procs = start_pods(hosts, "volcano", 3, "--num-instances=2", "--num-replicas=2",
                       "--spare-nodes=1", "--max-restarts=1", "sh", "-c",
                       f'while [ ! -e {go} ]; do sleep 0.05; done; exec "$0" -c "$1" "$2"',
                       sys.executable, INSTANCE, SECRET)
    said = []
    bound = threading.Timer(WAIT, go.touch)  # never said: the job goes on, the test fails
    bound.start()
    try:
        with reaped(procs[0]):
            while not said or ("quarantined, out of the job" not in said[-1] and said[-1]):
                said.append(procs[0].stderr.readline())
            go.touch()
            results = finish(procs)
    finally:
        bound.cancel()
    assert [r[0] for r in results] == [0, 0, 0], [r[2] for r in results]
    lead_err = "".join(said) + results[0][2]
    assert "vc-worker-1.vc left out: quarantined (lost: earlier; until " in lead_err
    assert "vc-worker-1.vc: its agent called, but the pod is quarantined" in lead_err
    assert sorted(line for line in results[0][1].splitlines() if line.startswith("rank")) == [
        f"rank 0 in {hosts.namespace(1)} leaks []", f"rank 1 in {hosts.namespace(3)} leaks []"]
