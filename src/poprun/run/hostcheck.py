"""The job's hosts compared before anything starts (a launch) or for `--check`: what each
agent's HELLO asks and reports (spawner/hostfacts.py), this host's own facts read the same
way, and the comparison (plan/alike.py, pure) made of them. Only a job on more than one host,
one of them remote, compares: a single-host launch pays nothing."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from popdist.env import FORWARDED_TO_REMOTE

from poprun.plan import alike
from poprun.plan.config import LaunchConfig
from poprun.plan.jobhosts import JobHosts
from poprun.plan.planner import SET_BY_POPRUN, remote_env


def wanted(config: LaunchConfig, hosts: JobHosts) -> bool:
    """Whether a launch compares its hosts: more than one, some remote, and not turned off."""
    return config.compare_hosts != "off" and len(hosts.labels) > 1 and bool(hosts.remote)


def ask(config: LaunchConfig, environ: Mapping[str, str], argv: Sequence[str],
        cache: str | None) -> dict[str, Any]:
    """HELLO's `facts` request: the job's argv (none: --check without a program), what
    poprun sets on every remote instance from this environment (PATH, PYTHONPATH, -x...),
    the explicit cache path, if any."""
    return {"argv": list(argv), "env": remote_env(config, environ), "cache": cache}


def gather_here(config: LaunchConfig, environ: Mapping[str, str], argv: Sequence[str],
                cwd: str, cache: str | None) -> dict[str, Any]:
    """This host's facts: its instances inherit this environment, with -x's additions."""
    from spawner.hostfacts import gather

    return gather(list(argv), {**environ, **remote_env(config, environ)}, cwd, cache)


def compare(config: LaunchConfig, environ: Mapping[str, str], labels: Collection[str],
            local: Collection[str], here: Mapping[str, Any] | None,
            infos: Mapping[str, Any]) -> tuple[alike.Difference, ...]:
    """The differences among `labels`: the `local` ones read `here`, the others their
    agent's HELLO (`infos`: label -> spawner.remote.AgentInfo). A host without facts (an
    agent that predates them) is left out of the comparison."""
    return alike.compare(*read_all(config, environ, labels, local, here, infos),
                         local=local)


def read_all(config: LaunchConfig, environ: Mapping[str, str], labels: Collection[str],
             local: Collection[str], here: Mapping[str, Any] | None,
             infos: Mapping[str, Any]) -> tuple[dict[str, alike.HostFacts], dict[str, float]]:
    """Every host's checked facts and clock offset (seconds ahead of this machine's: its
    clock when it answered less the time its answer arrived, late by at most the transit)."""
    poprun_sets = SET_BY_POPRUN | remote_env(config, environ).keys() | set(FORWARDED_TO_REMOTE)
    facts, offsets = {}, {}
    for label in labels:
        if label in local:
            found = alike.read(here, alike.host_variables(environ, poprun_sets))
            offset = 0.0
        else:
            info = infos.get(label)
            raw = info.raw if info is not None else {}
            there = raw.get("environ")
            found = alike.read(raw.get("facts"), alike.host_variables(
                {str(k): str(v) for k, v in there.items()} if isinstance(there, dict) else {},
                poprun_sets))
            offset = (found.time - info.received if found is not None and found.time
                      is not None and info.received is not None else None)
        if found is not None:
            facts[label] = found
            if offset is not None:
                offsets[label] = offset
    return facts, offsets


def report_lines(differences: Collection[alike.Difference], mode: str) -> list[str]:
    """What a launch prints: a heading, then the table."""
    heading = ("the hosts differ in what the job depends on" +
               (" (--compare-hosts=error refuses to start, =off does not compare):"
                if mode == "warn" else " (--compare-hosts=error):"))
    return [heading, *(f"  {line}" for line in alike.render(differences))]
