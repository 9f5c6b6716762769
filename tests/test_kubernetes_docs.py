"""docs/kubernetes.md's example manifests, checked offline.

kubernetes-validate carries the Kubernetes API's JSON schemas (strict: unknown fields are
errors), not those of the JobSet, TrainJob and LeaderWorkerSet CRDs (asked for, they raise
SchemaNotFoundError: checked below, so that a release that bundles them shows up here). What
embeds a core kind is validated as that kind: a JobSet's Job templates as batch/v1 Jobs, a
LeaderWorkerSet's pod template as a v1 PodTemplate, a TrainJob's trainer as a pod's
container. Each example's contract is then read as poprun reads it in its pods.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from poprun.plan.pods import DEFAULT_PORT, read_pod

PAGE = Path(__file__).resolve().parent.parent / "docs" / "kubernetes.md"
VERSION = kubernetes_validate.latest_version()


def manifests() -> dict[str, dict]:
    """The page's YAML documents, by kind."""
    blocks = re.findall(r"```yaml\n(.*?)```", PAGE.read_text(), re.S)
    found: dict[str, dict] = {}
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            found[doc["kind"]] = doc
    return found


def valid(doc: dict) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def poprun_container(pod_spec: dict) -> dict:
    (container,) = [c for c in pod_spec["containers"] if c["command"][0] == "poprun"]
    return container


def secret_from_the_secret(container: dict) -> None:
    """POPRUN_POD_SECRET comes from the page's Secret, never a literal."""
    (entry,) = [e for e in container["env"] if e["name"] == "POPRUN_POD_SECRET"]
    ref = entry["valueFrom"]["secretKeyRef"]
    secret = manifests()["Secret"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def test_the_page_has_every_example():
    assert {"Secret", "JobSet", "TrainJob", "LeaderWorkerSet"} <= set(manifests())


@pytest.mark.parametrize("kind", ["JobSet", "TrainJob", "LeaderWorkerSet"])
def test_the_crds_are_not_bundled(kind):
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        valid(manifests()[kind])


def test_the_secret():
    valid(manifests()["Secret"])


def test_the_jobset():
    jobset = manifests()["JobSet"]
    rules = jobset["spec"]["failurePolicy"]["rules"]
    assert rules == [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    job = jobset_job(jobset)
    valid(job)
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    exit_rules = {r["action"]: r["onExitCodes"]["values"]
                  for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r}
    assert exit_rules == {"FailJob": [2, 70], "Ignore": [69]}
    container = poprun_container(spec["template"]["spec"])
    secret_from_the_secret(container)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert int(env["POPRUN_PODS"]) == spec["parallelism"] == spec["completions"]
    assert {"containerPort": DEFAULT_PORT, "name": "poprun"} in container["ports"]
    for i in range(spec["parallelism"]):  # what Kubernetes sets, and what poprun makes of it
        pod = read_pod({**env, "JOB_COMPLETION_INDEX": str(i),
                        "HOSTNAME": f"{job['metadata']['name']}-{i}"})
        assert (pod.count, pod.index, pod.leader) == (4, i, "train-node-0-0.train")


def jobset_job(jobset: dict) -> dict:
    """The JobSet's (one) Job, as a batch/v1 Job the bundled schemas know."""
    (replicated,) = jobset["spec"]["replicatedJobs"]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{jobset['metadata']['name']}-{replicated['name']}-0"},
            **replicated["template"]}


def test_the_spare_pods_failure_policy():
    """The "Spare pods" section's podFailurePolicy, in the JobSet's Job with backoffLimit K
    (1 spare pod), is valid; a follower killed (137) is counted, any other failure of the
    leader's ends the Job (the leader decided the restarts already)."""
    section = PAGE.read_text().split("\n## Spare pods\n")[1].split("\n## ")[0]
    (block,) = re.findall(r"```text\n(podFailurePolicy:.*?)```", section, re.S)
    policy = yaml.safe_load(block)["podFailurePolicy"]
    job = jobset_job(manifests()["JobSet"])
    job["spec"] = {**job["spec"], "podFailurePolicy": policy, "backoffLimit": 1}
    valid(job)
    exits = [(r["action"], r["onExitCodes"]["operator"], r["onExitCodes"]["values"])
             for r in policy["rules"] if "onExitCodes" in r]
    assert exits == [("FailJob", "In", [2, 70]), ("Ignore", "In", [69]),
                     ("Count", "In", [137]), ("FailJob", "NotIn", [0])]


def test_the_trainjob():
    trainjob = manifests()["TrainJob"]
    trainer = trainjob["spec"]["trainer"]
    container = {"name": "node", "image": trainer["image"], "command": trainer["command"],
                 "env": trainer["env"], "resources": trainer["resourcesPerNode"]}
    valid({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train-node-0-0"},
           "spec": {"containers": [container], "restartPolicy": "Never"}})
    secret_from_the_secret(container)
    pod = read_pod({"PET_NNODES": str(trainer["numNodes"]), "PET_NODE_RANK": "3",
                    "PET_MASTER_ADDR": "train-node-0-0.train", "PET_MASTER_PORT": "29400"})
    assert (pod.count, pod.index, pod.port) == (4, 3, 29400)


def test_the_leaderworkerset():
    lws = manifests()["LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    valid({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "train"},
           "template": template["workerTemplate"]})
    container = poprun_container(template["workerTemplate"]["spec"])
    secret_from_the_secret(container)
    assert {"containerPort": DEFAULT_PORT, "name": "poprun"} in container["ports"]
    pod = read_pod({"LWS_GROUP_SIZE": str(template["size"]), "LWS_WORKER_INDEX": "1",
                    "LWS_LEADER_ADDRESS": "train-0.train"})
    assert (pod.count, pod.index, pod.port) == (4, 1, DEFAULT_PORT)


def test_a_broken_manifest_is_caught():
    """The check can fail: a misspelt field in the JobSet's pod template."""
    job = manifests()["JobSet"]["spec"]["replicatedJobs"][0]["template"]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        valid({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **job})
