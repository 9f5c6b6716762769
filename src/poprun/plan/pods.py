"""Pod mode's facts, read from a pod's environment: which contract put it there, how many pods
the job has, which one this is, where pod 0 (the leader) listens, and a label for each pod.
Pure: an environment mapping in, a `Pod` out (docs/architecture.md, "Pod mode").

Kubernetes' job controllers run the same command in every pod and tell each its place:

    contract           variables read
    Trainer v2         PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
    LeaderWorkerSet    LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS
    Volcano            VC_TASK_INDEX, VC_<task>_HOSTS (one task)
    JobSet             JOB_COMPLETION_INDEX, HOSTNAME (<jobset>-<job>-<j>-<index>),
                       POPRUN_PODS (the Job's parallelism), POPRUN_POD_SUBDOMAIN (JobSet's
                       headless service: the JobSet's name unless its network says otherwise)

They are tried in that order: a TrainJob's pods are JobSet pods, and carry JobSet's
variables too. POPRUN_POD_PORT overrides the leader's port where the contract names none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from spawner.uncompiled import dataclass

from poprun.errors import ConfigError

SECRET_VARIABLE = "POPRUN_POD_SECRET"  # the job's secret (a Kubernetes Secret's value)
SECRET_FD_VARIABLE = "POPRUN_POD_SECRET_FD"  # ... once poprun moved it to a pipe (run/podmode.py)
DEFAULT_PORT = 29455  # the leader's listener, where the contract names no port
PORT_VARIABLE = "POPRUN_POD_PORT"
PODS_VARIABLE = "POPRUN_PODS"  # JobSet: the pods of the Job (its parallelism)
SUBDOMAIN_VARIABLE = "POPRUN_POD_SUBDOMAIN"
MAX_PODS = 10_000
# Each pod's place, set by its contract: they differ from pod to pod by design (so hosts
# compared, a spare pod among them, are not told apart by them: plan/alike.py, PER_HOST).
INDEX_VARIABLES = ("PET_NODE_RANK", "LWS_WORKER_INDEX", "VC_TASK_INDEX",
                   "JOB_COMPLETION_INDEX")
_VOLCANO_HOSTS = re.compile(r"VC_([A-Z0-9_]+)_HOSTS")
_JOBSET_HOSTNAME = re.compile(r"(.+-\d+)-(\d+)")  # <jobset>-<job>-<job index>-<pod index>
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # a DNS name or address


@dataclass(frozen=True)
class Pod:
    """This pod's place in the job, as its contract says it."""

    contract: str  # which one was read, in words (for -v)
    count: int  # pods in the job
    index: int  # this pod's: 0 leads
    leader: str  # pod 0's name or address, as the others dial it
    port: int  # where pod 0 listens for the others' agents
    labels: tuple[str, ...]  # each pod's host label, in index order

    @property
    def leads(self) -> bool:
        return self.index == 0

    @property
    def label(self) -> str:
        return self.labels[self.index]

    def describe(self) -> str:
        """For -v: `pod 1 of 4 (LeaderWorkerSet: LWS_*), leader lws-0.lws:29455`."""
        return (f"pod {self.index} of {self.count} ({self.contract}), leader "
                f"{self.leader}:{self.port}")


def contract_in(environ: Mapping[str, str]) -> str | None:
    """The name of the contract whose variables are in `environ`, or None."""
    for name, test in _DETECT:
        if test(environ):
            return name
    return None


def read_pod(environ: Mapping[str, str]) -> Pod:
    """This pod's place; ConfigError (one line) when no contract is there or it is broken."""
    name = contract_in(environ)
    if name is None:
        raise ConfigError("--launcher pod: no pod contract in the environment (Trainer v2's "
                          "PET_*, LeaderWorkerSet's LWS_*, Volcano's VC_*, or JobSet's "
                          "JOB_COMPLETION_INDEX with POPRUN_PODS)")
    return _READERS[name](environ)


def _trainer(env: Mapping[str, str]) -> Pod:
    count = _int(env, "PET_NNODES", 1, MAX_PODS)
    index = _int(env, "PET_NODE_RANK", 0, count - 1)
    leader = _name(env, "PET_MASTER_ADDR")
    port = _int(env, "PET_MASTER_PORT", 1, 65535) if "PET_MASTER_PORT" in env else _port(env)
    return Pod("Kubeflow Trainer v2: PET_*", count, index, leader, port, _numbered(count))


def _lws(env: Mapping[str, str]) -> Pod:
    count = _int(env, "LWS_GROUP_SIZE", 1, MAX_PODS)
    index = _int(env, "LWS_WORKER_INDEX", 0, count - 1)
    leader = _name(env, "LWS_LEADER_ADDRESS")
    return Pod("LeaderWorkerSet: LWS_*", count, index, leader, _port(env), _numbered(count))


def _volcano(env: Mapping[str, str]) -> Pod:
    lists = sorted(k for k in env if _VOLCANO_HOSTS.fullmatch(k))
    if len(lists) != 1:
        raise ConfigError(f"Volcano: pod mode needs a job of one task, found {len(lists)} "
                          f"host lists ({', '.join(lists)})")
    names = tuple(h.strip() for h in env[lists[0]].split(",") if h.strip())
    if not 0 < len(names) <= MAX_PODS or not all(_NAME.fullmatch(h) for h in names) \
            or len(set(names)) < len(names):
        raise ConfigError(f"{lists[0]} is not a comma-separated list of distinct host names")
    index = _int(env, "VC_TASK_INDEX", 0, len(names) - 1)
    return Pod(f"Volcano: VC_TASK_INDEX, {lists[0]}", len(names), index, names[0],
               _port(env), names)


def _jobset(env: Mapping[str, str]) -> Pod:
    count = _int(env, PODS_VARIABLE, 1, MAX_PODS)
    index = _int(env, "JOB_COMPLETION_INDEX", 0, count - 1)
    hostname = env.get("HOSTNAME", "")
    found = _NAME.fullmatch(hostname) and _JOBSET_HOSTNAME.fullmatch(hostname)
    if not found or int(found[2]) != index:
        raise ConfigError(f"JobSet: HOSTNAME={hostname!r} is not <jobset>-<job>-<j>-{index}")
    subdomain = env.get(SUBDOMAIN_VARIABLE, "")
    if subdomain and not _NAME.fullmatch(subdomain):
        raise ConfigError(f"{SUBDOMAIN_VARIABLE}={subdomain!r} is not a DNS name")
    suffix = f".{subdomain}" if subdomain else ""
    labels = tuple(f"{found[1]}-{i}{suffix}" for i in range(count))
    return Pod("JobSet: JOB_COMPLETION_INDEX, HOSTNAME, POPRUN_PODS", count, index, labels[0],
               _port(env), labels)


def _numbered(count: int) -> tuple[str, ...]:
    """Labels where the contract names the leader only: `pod0`..."""
    return tuple(f"pod{i}" for i in range(count))


def _int(env: Mapping[str, str], name: str, low: int, high: int) -> int:
    text = env.get(name, "").strip()
    if not text.isascii() or not text.isdigit() or not low <= int(text) <= high:
        raise ConfigError(f"{name}={env.get(name, '')!r}: expected a whole number from {low} "
                          f"to {high}")
    return int(text)


def _name(env: Mapping[str, str], variable: str) -> str:
    value = env.get(variable, "").strip().strip("[]")
    if not (_NAME.fullmatch(value) or (":" in value and all(
            c in "0123456789abcdefABCDEF:." for c in value))):
        raise ConfigError(f"{variable}={env.get(variable, '')!r} is not a host name or address")
    return value


def _port(env: Mapping[str, str]) -> int:
    return _int(env, PORT_VARIABLE, 1, 65535) if PORT_VARIABLE in env else DEFAULT_PORT


_DETECT = (
    ("trainer", lambda env: "PET_NNODES" in env and "PET_NODE_RANK" in env),
    ("lws", lambda env: "LWS_GROUP_SIZE" in env and "LWS_WORKER_INDEX" in env),
    ("volcano", lambda env: "VC_TASK_INDEX" in env
     and any(_VOLCANO_HOSTS.fullmatch(k) for k in env)),
    ("jobset", lambda env: "JOB_COMPLETION_INDEX" in env and PODS_VARIABLE in env),
)
_READERS = {"trainer": _trainer, "lws": _lws, "volcano": _volcano, "jobset": _jobset}
