"""The job's spare hosts (--spare-hosts; docs/several-hosts.md, "Spare hosts"): connected and
given an agent while the job's hosts are, compared with them once their facts came, and
standing by, running nothing, until an attempt fails because a host was lost (or froze): the
next attempt then runs that host's instances on a spare (`take`; which one is pure:
plan/jobhosts.py, pair_spares), and the host is quarantined for the rest of the job.

A spare is used only once admitted: it answered, its agent started as a job host's must
(working directory, program, open files), and its facts agree with the job's hosts
(run/hostcheck.py, spare_differences). One that is not is said at the start, once, and
never used; one lost while it stands by is said then, and skipped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from poprun.log import Log
from poprun.plan.jobhosts import JobHosts, pair_spares
from poprun.run.fleet import Fleet


class SparePool:
    """The spares' agents (a Fleet of their own), and which of them may take a place."""

    def __init__(self, hosts: JobHosts, jobs: Fleet, log: Log) -> None:
        self.fleet = jobs.standby(hosts.spares)  # `jobs`: the job hosts' fleet
        self.log = log
        self.ready: list[str] = []  # standing by and admitted, in the user's order
        self._compared = False  # ready only once compared (or when nothing compares)

    @property
    def labels(self) -> list[str]:
        return [str(h) for h in self.fleet.hosts]

    async def open(self, sink, *, cwd: str, program: str, path: str | None,
                   facts: dict | None) -> None:
        """Connect to every spare and start its agent; what fails is said and skipped."""
        problems = await self.fleet.open_standby(sink, self._lost, cwd=cwd, program=program,
                                                 path=path, facts=facts)
        for line in problems.values():
            self.log.warning(f"spare host skipped: {line}")
        self.ready = self.labels
        self._compared = facts is None

    def admit(self, differences: Mapping[str, Sequence]) -> None:
        """Keep the spares whose facts agree with the job's hosts (`differences`: per spare
        that answered, how it differs: run/hostcheck.py); the others are said and closed."""
        from poprun.plan.alike import render

        for label in self.labels:
            found = differences.get(label)
            if found is None:
                self._refuse(label, "it sent no facts to compare with the job's hosts")
            elif found:
                self._refuse(label, "it differs from the job's hosts in what the job "
                                    "depends on:", render(found))
        self._compared = True

    def _refuse(self, label: str, reason: str, table: Sequence[str] = ()) -> None:
        self.log.warning(f"spare host {label} refused: {reason}")
        for line in table:
            self.log.warning(f"  {line}")
        self._drop(label)

    def _drop(self, label: str) -> None:
        if label in self.ready:
            self.ready.remove(label)
        if label in self.labels:
            self.fleet.retire(label)

    def _lost(self, host: str, reason: str) -> None:
        """A spare's agent or connection ended while it stood by: skipped from now."""
        self.log.warning(f"spare host {host} lost while standing by ({reason}): skipped")
        self._drop(host)

    def take(self, failed: Sequence[str], fleet: Fleet) -> dict[str, str]:
        """Spares for the `failed` hosts (as many as there are ready), each put in its
        host's place in the job's `fleet`: failed label -> spare label."""
        if not self._compared:  # the first plan compares; a restart comes after it
            raise RuntimeError("spares taken before they were compared")
        pairs = pair_spares(failed, self.ready)
        for lost, spare in pairs.items():
            self.ready.remove(spare)
            fleet.take_over(lost, self.fleet, spare)
        return pairs

    async def close(self) -> None:
        await self.fleet.close()
