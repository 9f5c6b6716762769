"""The job's hosts compared before anything starts (a launch) or for `--check`: what each
agent's HELLO asks it to read (`facts`) and FACTS collects (spawner/hostfacts.py), this
host's own facts read the same way, and the comparison (plan/alike.py, pure) made of them.
Only a job on more than one host, one of them remote, compares: a single-host launch pays
nothing (docs/architecture.md, "Hosts that differ")."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from popdist.env import FORWARDED_TO_REMOTE
from spawner.uncompiled import dataclass

from poprun.plan import alike
from poprun.plan.config import LaunchConfig
from poprun.plan.jobhosts import JobHosts
from poprun.plan.planner import SET_BY_POPRUN, remote_env


def wanted(config: LaunchConfig, hosts: JobHosts) -> bool:
    """Whether a launch compares its hosts: more than one (spares count: each is compared
    with the job's hosts before it may take one's place), some remote, and not turned
    off."""
    return (config.compare_hosts != "off" and len(hosts.labels) + len(hosts.spares) > 1
            and bool(hosts.remote))


def ask(config: LaunchConfig, environ: Mapping[str, str], argv: Sequence[str], cwd: str,
        cache: str | None) -> dict[str, Any]:
    """HELLO's `facts` (spawner/protocol.py): the job's argv (none: --check without a
    program), what poprun sets on every remote instance from this environment (PATH,
    PYTHONPATH, -x...), the explicit cache path, if any, and the working directory."""
    return {"argv": list(argv), "env": remote_env(config, environ), "cache": cache,
            "cwd": cwd}


def gather_here(config: LaunchConfig, environ: Mapping[str, str], argv: Sequence[str],
                cwd: str, cache: str | None) -> dict[str, Any]:
    """This host's facts: its instances inherit this environment, with -x's additions."""
    from spawner.hostfacts import gather

    return gather(list(argv), {**environ, **remote_env(config, environ)}, cwd, cache)


@dataclass(frozen=True)
class Answer:
    """A remote host's answer to FACTS, when it came here, and what its instances inherit
    there (its HELLO's `environ`)."""

    facts: object
    received: float
    environ: object


async def answers(spawners: Mapping[str, Any]) -> dict[str, Answer]:
    """Each agent's answer to FACTS (spawner.remote.RemoteSpawner by label; started with
    `facts`). An agent lost meanwhile has none: its loss is the launch's to report."""
    import asyncio

    from spawner.remote import RemoteError

    found = await asyncio.gather(*(s.job_facts() for s in spawners.values()),
                                 return_exceptions=True)
    out = {}
    for (label, spawner), answer in zip(spawners.items(), found):
        if isinstance(answer, BaseException) and not isinstance(answer, RemoteError):
            raise answer  # a bug, not a host's problem
        if isinstance(answer, tuple):
            out[label] = Answer(answer[0], answer[1], spawner.info.raw.get("environ"))
    return out


def compare(config: LaunchConfig, environ: Mapping[str, str], labels: Collection[str],
            local: Collection[str], here: Mapping[str, Any] | None,
            remote: Mapping[str, Answer]) -> tuple[alike.Difference, ...]:
    """The differences among `labels`: the `local` ones read `here`, the others their
    agent's `answers`. A host whose facts did not arrive (its agent lost or silent
    meanwhile, or what it sent is no facts) cannot be said alike: it is a difference of its
    own, so --compare-hosts=error refuses the launch."""
    facts, offsets = read_all(config, environ, labels, local, here, remote)
    unknown = [label for label in labels if label not in facts]
    return alike.unknown(unknown) + alike.compare(facts, offsets, local=local)


def read_all(config: LaunchConfig, environ: Mapping[str, str], labels: Collection[str],
             local: Collection[str], here: Mapping[str, Any] | None,
             remote: Mapping[str, Answer]) -> tuple[dict[str, alike.HostFacts],
                                                   dict[str, float]]:
    """Every host's checked facts and clock offset (seconds ahead of this machine's: its
    clock when it answered less the time its answer arrived, late by at most the transit)."""
    poprun_sets = SET_BY_POPRUN | remote_env(config, environ).keys() | set(FORWARDED_TO_REMOTE)
    facts, offsets = {}, {}
    for label in labels:
        if label in local:
            found = alike.read(here, alike.host_variables(environ, poprun_sets))
            if found is not None:
                facts[label], offsets[label] = found, 0.0
            continue
        answer = remote.get(label)
        if answer is None:
            continue
        there = answer.environ if isinstance(answer.environ, dict) else {}
        found = alike.read(answer.facts, alike.host_variables(
            {str(k): str(v) for k, v in there.items()}, poprun_sets))
        if found is not None:
            facts[label] = found
            if found.time is not None:
                offsets[label] = found.time - answer.received
    return facts, offsets


def spare_differences(config: LaunchConfig, environ: Mapping[str, str],
                      labels: Sequence[str], local: Collection[str],
                      here: Mapping[str, Any] | None, remote: Mapping[str, Answer],
                      spares: Mapping[str, Answer]) -> dict[str, tuple[alike.Difference, ...]]:
    """Per spare that answered, how it differs from the job's hosts (`labels`, read as
    `compare` reads them): compared as they are among themselves, with one of them (a
    remote one where there is one: its variables count). A spare without facts is left
    out: it is not admitted."""
    facts, offsets = read_all(config, environ, labels, local, here, remote)
    known = [label for label in labels if label in facts]
    reference = next((label for label in known if label not in local), known[0] if known
                     else None)
    standby, standby_offsets = read_all(config, environ, list(spares), (), None, spares)
    out = {}
    for label, found in standby.items():
        if reference is None:  # nothing to compare with: the job's hosts sent nothing
            out[label] = ()
            continue
        pair = {reference: facts[reference], label: found}
        clocks = {k: v for k, v in {**offsets, **standby_offsets}.items() if k in pair}
        differences = alike.compare(pair, clocks, local=[reference] if reference in local
                                    else [])
        out[label] = tuple(d for d in differences
                           if any(label in hosts for _, hosts in d.sides))
    return out


def report_lines(differences: Collection[alike.Difference], mode: str) -> list[str]:
    """What a launch prints: a heading, then the table."""
    heading = ("the hosts differ in what the job depends on" +
               (" (--compare-hosts=error refuses to start, =off does not compare):"
                if mode == "warn" else " (--compare-hosts=error):"))
    return [heading, *(f"  {line}" for line in alike.render(differences))]
