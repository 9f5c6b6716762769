"""The remote hosts of a job: one SSH connection and one agent on each, opened before anything
starts and closed on every exit path.

Opening checks everything that can be checked before the first instance starts, on all hosts
at once, and reports every host's problem (one line each) rather than the first: SSH failures
(unknown/changed host key, permission denied, name, refused, timeout), an agent that does not
start, a different Python/poprun version, a missing working directory, a program not found.

This is the one module that opens connections to hosts: a launch's agents (`Fleet.open`),
`poprun --check`'s (`Fleet.open_each`: the same bootstrap, --remote-install and transport),
and `poprunctl reap`'s SSH connections (`connect`), so all of them connect the same way.

Over SSH it imports asyncssh (~250 ms; spawner.ssh and spawner.remote import it when they
connect); only runs with remote hosts load this module, and a Slurm launch never asyncssh.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from spawner import fdlimit
from spawner.local import Sink
from spawner.remote import RemoteError, RemoteSpawner, agent_command
from spawner.ssh import DEFAULT_FANOUT, ConnectResults, HostFailure, close_all, connect_each

from poprun.plan.config import LaunchConfig
from poprun.errors import ConfigError, LaunchError
from poprun.plan.hosts import Host
from poprun.plan.jobhosts import JobHosts
from poprun.plan.network import address_here
from poprun.log import Log
from poprun.plan.topology import Topology, agent_topology
from poprun.run.podmode import pod_secret

CACHE_PREFIX = "poprun-cache-"
STATS_INTERVAL = 1.0  # seconds between the agents' samples: CPU/RSS, popdist.progress()


class Fleet:
    """Connections and agents, by host label (`str(host)`)."""

    def __init__(self, hosts: Sequence[Host], config: LaunchConfig, log: Log,
                 transport: str = "ssh", counts: Mapping[str, int] | None = None,
                 pod: tuple | None = None) -> None:
        self.hosts, self.config, self.log = tuple(hosts), config, log
        self._labels = [str(h) for h in self.hosts]
        self.counts = dict(counts or {})  # instances per host label, when known
        # "ssh"; "slurm": agents as job steps (spawner.srun); "pod": agents of the other
        # pods of a Kubernetes job, calling this leader (spawner.podagents)
        self.transport = transport
        self.pod = pod  # in pod mode: (plan.pods.Pod, the job's secret)
        self.connections: dict[Host, object] = {}
        self._slurm = None  # over Slurm: spawner.srun.SlurmAgents, the steps and listener
        self._pods = None  # in pod mode: spawner.podagents.PodAgents
        self._pods_of = self  # the fleet whose PodAgents listens (standby: the job's)
        self._pods_out: set[str] = set()  # pods not in the job: their agents told goodbye
        self.spawners: dict[str, RemoteSpawner] = {}
        self._timings: dict[Host, object] = {}  # per host: how its connection went
        self._opened_at = 0.0  # time.monotonic(), for phases()
        self._agent_started: dict[Host, float] = {}  # ... and when each agent's start began
        # Each agent makes temp_dirs()'s directory as it answers HELLO (open(temp_dirs=True)).
        self._temp_prefix: str | None = None
        # Agents and connections of hosts replaced by spares (take_over): closed with the
        # rest, not on the way to the next attempt (a frozen host's close only times out).
        self._retired: list[tuple[RemoteSpawner, object]] = []

    @classmethod
    def of(cls, hosts: JobHosts, config: LaunchConfig, log: Log) -> Fleet:
        """The job's hosts that need a connection, over the transport JobHosts chose."""
        fleet = cls([h for h in hosts.hosts if str(h) in hosts.remote], config, log,
                    hosts.transport, dict(zip(hosts.labels, hosts.counts)),
                    (hosts.pod, pod_secret()) if hosts.pod is not None else None)
        if hosts.pod is not None:  # pods left out (quarantined by an earlier job)
            fleet._pods_out = set(hosts.pod.labels) - {*hosts.labels, *map(str, hosts.spares)}
        return fleet

    def standby(self, hosts: Sequence[Host]) -> Fleet:
        """A fleet for the spare `hosts`, over this one's transport. In pod mode it shares
        this fleet's listener: every pod's agent calls the leader's one port."""
        fleet = Fleet(hosts, self.config, self.log, self.transport, pod=self.pod)
        fleet._pods_of = self
        return fleet

    def start_steps(self) -> None:
        """Over Slurm, the job step that starts every node's agent created now, before
        `open` greets the agents: the launcher's own start-up goes on meanwhile."""
        if self.transport != "slurm":
            return
        self.connections.update(self._node_links(self.hosts))  # closed by close() whatever

    async def open(self, sink: Sink, on_lost: Callable[[str, str], None], *, cwd: str,
                   program: str, path: str | None, view=None, temp_dirs: bool = False,
                   facts: dict | None = None, keep_going: bool = False) -> dict[str, str]:
        """Connect to every host and start its agent, each as soon as its host is connected
        (the others still connecting); raises LaunchError (every failing host named, one
        line each) with nothing started; the caller closes what was opened. `temp_dirs`:
        the launch will ask for `temp_dirs()`; each agent makes
        its directory as it answers HELLO, which spares a round trip per host. `facts`: what
        each agent is asked to report of the job's dependencies (run/hostcheck.py).
        `keep_going` (spares stand by to take a failing host's place): no host's failure
        stops the others', and none is raised: per host that failed, why (one line naming
        it), in host order; what it opened stays until `take_over` or `close`."""
        self._opened_at = time.monotonic()
        self._temp_prefix = CACHE_PREFIX if temp_dirs else None
        starting: dict[Host, asyncio.Task] = {}

        def start(host: Host, conn: object) -> None:
            starting[host] = asyncio.ensure_future(self._start_agents(
                [host], sink, on_lost, cwd=cwd, program=program, path=path, view=view,
                facts=facts))

        try:
            failures = await self._connect(self.hosts, view, keep_going=keep_going,
                                           on_open=start)
        except BaseException:
            _cancel(starting.values())
            raise
        if failures and not keep_going:  # at once: agents still starting are closed too
            _cancel(starting.values())
            _raise_failures(failures)
        started = [h for h in self.hosts if h in starting]
        outcomes = await asyncio.gather(*(starting[h] for h in started),  # host order
                                        return_exceptions=True)
        for outcome in outcomes:  # a bug, or a cancellation, is not a host's problem
            if isinstance(outcome, BaseException) and not isinstance(outcome, LaunchError):
                raise outcome
        problems = {**{str(f.target): f.message for f in failures},
                    **{str(h): str(o) for h, o in zip(started, outcomes)
                       if isinstance(o, LaunchError)}}
        if problems and not keep_going:
            raise LaunchError("\n".join(problems.values()))
        return {label: problems[label] for label in self._labels if label in problems}

    async def open_each(self, sink: Sink, *, cwd: str, program: str | None,
                        path: str | None, facts: dict | None = None) -> dict[str, object]:
        """Every host connected and given its agent as `open` does, none failing the others
        (`poprun --check` reports them all). Per host label, in host order: the agent's
        AgentInfo, or why there is none (the connection's HostFailure, or the exception
        the agent's start raised); the caller closes what was opened."""
        failed = {str(f.target): f for f in await self._connect(self.hosts, None,
                                                                 keep_going=True)}
        connected = [h for h in self.hosts if h in self.connections]
        started = await self._agents(connected, sink, None, cwd=cwd, program=program,
                                     path=path, view=None, facts=facts)
        outcomes = {**failed, **{str(h): o for h, o in zip(connected, started)}}
        return {str(h): outcomes[str(h)] for h in self.hosts}

    async def open_standby(self, sink: Sink, on_lost: Callable[[str, str], None], *,
                           cwd: str, program: str, path: str | None,
                           facts: dict | None = None) -> dict[str, str]:
        """Spare hosts (this fleet's): each connected and given its agent as `open` does,
        none failing the launch. Per host that could not be, why (one line naming it); its
        connection is closed then. The others stand by, running nothing."""
        failed = {str(f.target): f.message
                  for f in await self._connect(self.hosts, None, keep_going=True)}
        connected = [h for h in self.hosts if h in self.connections]
        outcomes = await self._agents(connected, sink, on_lost, cwd=cwd, program=program,
                                      path=path, view=None, facts=facts)
        for host, outcome in zip(connected, outcomes):
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # a cancellation: the launch's, not the spare's
            problem = _problem(self.spawners[str(host)], outcome, cwd, program, 0)
            if problem:
                failed[str(host)] = problem
        for label in failed:
            self.retire(label)
        return failed

    def retire(self, label: str) -> None:
        """A host's agent and connection out of the fleet: closed with it (close())."""
        host = next((h for h in self.hosts if str(h) == label), None)
        if host is None:  # retired already
            return
        spawner, conn = self.spawners.pop(label, None), self.connections.pop(host, None)
        self._retired.append((spawner, conn))
        self.hosts = tuple(h for h in self.hosts if h != host)
        self._labels = [str(h) for h in self.hosts]

    def take_over(self, lost: str, standby: Fleet, spare: str) -> None:
        """The spare's agent and connection (from the `standby` fleet) take the place of
        the host labelled `lost`, whose are retired: the same position among the hosts, so
        the same instances (plan/jobhosts.py, JobHosts.substituted)."""
        new = next(h for h in standby.hosts if str(h) == spare)
        spawner, conn = standby.spawners.pop(spare), standby.connections.pop(new)
        standby.hosts = tuple(h for h in standby.hosts if h != new)
        standby._labels = [str(h) for h in standby.hosts]
        old = next(h for h in self.hosts if str(h) == lost)
        if self._pods is not None:  # the lost pod's replacement, should it call, is not used
            self._pods.retire(lost)
        # (a host that failed at the start may have no agent, or no connection)
        self._retired.append((self.spawners.pop(lost, None), self.connections.pop(old, None)))
        self.hosts = tuple(new if h == old else h for h in self.hosts)
        self._labels = [str(h) for h in self.hosts]
        self.counts[spare] = self.counts.pop(lost, 0)
        self.connections[new] = conn
        for mine, theirs in ((self._timings, standby._timings),
                             (self._agent_started, standby._agent_started)):
            if new in theirs:
                mine[new] = theirs.pop(new)
        self.spawners[spare] = spawner
        self.spawners = {label: self.spawners[label] for label in self._labels
                         if label in self.spawners}

    async def _connect(self, hosts: Sequence[Host], view, *, keep_going: bool,
                       on_open: Callable[[Host, object], None] | None = None
                       ) -> list[HostFailure]:
        """Connections to `hosts` (those opened are kept, for close()); the failures.
        `keep_going` False: once one host failed, the hosts still queued are not tried.
        `on_open(host, connection)` as each opens (it is in `connections` by then)."""
        def opened(host: Host, conn: object) -> None:
            self.connections[host] = conn
            if on_open is not None:
                on_open(host, conn)

        if self.transport != "ssh":  # a step started ahead (start_steps) is taken as it is
            new = self._node_links([h for h in hosts if h not in self.connections])
            for host in hosts:
                opened(host, self.connections.get(host) or new[host])
            return []
        results = await connect(hosts, fanout=self.config.ssh_fanout,
                                timeout=self.config.ssh_timeout, keep_going=keep_going,
                                progress=_connected_to(view), on_open=opened)
        self.connections.update(results.connections)
        self._timings.update(results.timings)
        for host in results.connections:
            self.log.info(f"{host}: connected in {results.timings[host].connect * 1000:.0f} ms")
        return results.failures

    async def _start_agents(self, hosts: Sequence[Host], sink: Sink,
                            on_lost: Callable[[str, str], None], *, cwd: str, program: str,
                            path: str | None, view, facts: dict | None = None) -> None:
        outcomes = await self._agents(hosts, sink, on_lost, cwd=cwd, program=program,
                                      path=path, view=view, facts=facts)
        spawners = [self.spawners[str(h)] for h in hosts]
        problems = [_problem(spawner, outcome, cwd, program, self.counts.get(spawner.host, 0))
                    for spawner, outcome in zip(spawners, outcomes)]
        if any(problems):
            raise LaunchError("\n".join(p for p in problems if p))
        for spawner in spawners:
            self.log.info(f"{spawner.host}: agent ready ({spawner.timings.describe()})")

    async def _agents(self, hosts: Sequence[Host], sink: Sink,
                      on_lost: Callable[[str, str], None] | None, *, cwd: str,
                      program: str | None, path: str | None, view,
                      facts: dict | None = None) -> list[object]:
        """An agent started on each of `hosts` (connected); per host, its AgentInfo or the
        exception its start raised."""
        spawners = [RemoteSpawner(self.connections[h], str(h), sink, on_lost,
                                  python=self.config.remote_python) for h in hosts]
        self._agent_started.update((h, time.monotonic()) for h in hosts)
        self.spawners.update((s.host, s) for s in spawners)
        # In host order, as planned. Agents start one host at a time as each connects, so
        # this runs once per host: over labels made once, not a label per host each time.
        self.spawners = {label: self.spawners[label] for label in self._labels
                         if label in self.spawners}
        stats = STATS_INTERVAL  # the dashboard shows them; the progress watch needs steps
        # Over SSH, the agent is brought where poprun is missing; a Slurm step runs it as is.
        install = self.config.remote_install if self.transport == "ssh" else None
        return await asyncio.gather(
            *(_start_agent(s, view, install, self.config.remote_python, self.log.info,
                           cwd=cwd, program=program, path=path, stats=stats,
                           host_timeout=self.config.host_timeout,
                           kill_timeout=self.config.kill_timeout,
                           interfaces=self.config.network.chosen, temp_dir=self._temp_prefix,
                           facts=facts)
              for s in spawners), return_exceptions=True)

    async def temp_dirs(self, labels: Iterable[str] | None = None) -> dict[str, str]:
        """A unique temporary cache directory on each host (or on those of `labels`),
        removed by its agent at exit: the one its agent made with HELLO where `open` asked
        for it, else made now."""
        labels = list(self.spawners if labels is None else labels)
        paths = await asyncio.gather(*(self.spawners[h].make_temp_dir(CACHE_PREFIX)
                                       for h in labels), return_exceptions=True)
        failed = [f"{h}: cannot create a temporary executable cache: {p}"
                  for h, p in zip(labels, paths) if isinstance(p, BaseException)]
        if failed:
            raise LaunchError("\n".join(failed))
        return dict(zip(labels, paths))

    async def make_dirs(self, path: str, labels: Iterable[str] | None = None) -> None:
        """An explicit executable cache: created on every host (or on those of `labels`)
        where it is missing."""
        labels = list(self.spawners if labels is None else labels)
        outcomes = await asyncio.gather(*(self.spawners[h].make_dir(path) for h in labels),
                                        return_exceptions=True)
        failed = [f"{h}: cannot create the executable cache {path}: "
                  f"{getattr(o, 'reason', o)}" for h, o in zip(labels, outcomes)
                  if isinstance(o, BaseException)]
        if failed:
            raise LaunchError("\n".join(failed))

    def phases(self, since: float) -> dict[str, dict[str, float]]:
        """Per host, seconds from `since` (time.monotonic()) to connected and agent ready."""
        opened = self._opened_at
        out = {}
        timings = self._timings  # a Slurm step has no connect
        for host in self.connections:
            spawner = self.spawners[str(host)]
            out[str(host)] = {}
            if host in timings:
                connected = opened + timings[host].queued + timings[host].connect - since
                out[str(host)]["connected"] = round(connected, 6)
            if spawner.timings.ready is not None:
                ready = self._agent_started[host] + spawner.timings.ready - since
                out[str(host)]["agent_ready"] = round(ready, 6)
        return out

    def topologies(self) -> dict[str, Topology]:
        """Each host's NUMA topology as its agent read it, cut to the agent's cpuset."""
        out = {}
        for label, spawner in self.spawners.items():
            try:
                out[label] = agent_topology(spawner.info.raw)
            except ConfigError as exc:
                raise ConfigError(f"{label}: cannot read its NUMA topology: {exc}") from None
        return out

    def interfaces(self) -> dict[str, dict[str, list[str]]]:
        """Each host's network interfaces as its agent listed them (HELLO's `interfaces`,
        asked for when the user chose a network)."""
        out = {}
        for label, spawner in self.spawners.items():
            listed = spawner.info.raw.get("interfaces")
            if not isinstance(listed, dict):
                raise LaunchError(f"{label}: its agent could not list its network interfaces "
                                  "(--host-subnet, --mca ..._if_include/exclude need them)")
            out[label] = listed
        return out

    def address_of(self, label: str) -> str:
        """The address the other hosts reach `label` at (MASTER_ADDR): the one the launcher
        connected to (a name from ~/.ssh/config may mean nothing to them); through a
        ProxyCommand there is no such address here, and the host's agent says where it was
        reached (its SSH_CONNECTION); a Slurm node's is the host name its agent reports
        (Slurm's nodes know each other by name)."""
        host = next(h for h in self.hosts if str(h) == label)
        peer = self.connections[host].get_extra_info("peername")
        if peer:
            return peer[0]
        info = self.spawners[label].info
        return info.raw.get("address") or info.hostname

    def own_address(self) -> str:
        """This machine's address on the way to the remote hosts, for a MASTER_ADDR that
        is local: the other hosts reach it there. Through ProxyCommands only (no socket of
        ours faces the hosts), the source address of this machine's route to the first
        host, else its name."""
        for conn in self.connections.values():
            sock = conn.get_extra_info("sockname")
            if sock:
                return sock[0]
        import socket

        target = self.address_of(str(self.hosts[0]))
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))  # UDP: nothing is sent, the route is chosen
                return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()

    def reach_back_address(self) -> str:
        """Where the hosts reach this machine for the job's endpoints (Horovod's
        rendezvous): on the network the user chose where it has an interface there, else
        `own_address()`."""
        return self.reach_back_choice() or self.own_address()

    def _node_links(self, hosts: Sequence[Host]) -> dict[Host, object]:
        """One job step for all `hosts` (nodes), their agents calling back: a link per
        node, standing where an SSH connection stands (spawner.srun)."""
        if not hosts:
            return {}
        if self.transport == "pod":
            return self._pod_links(hosts)
        if self._slurm is None:
            self._slurm = _slurm_agents(self.reach_back_choice(), self.log.info)
        command = agent_command(self.config.remote_python)  # as RemoteSpawner will ask
        links = self._slurm.start([h.name for h in hosts], command)
        return {host: links[host.name] for host in hosts}

    def _pod_links(self, hosts: Sequence[Host]) -> dict[Host, object]:
        """The other pods' links: each waits for its pod's agent to call (a host lost and
        reopened waits for its pod's next agent)."""
        return {host: self._pods_of._pod_agents().link(host.name) for host in hosts}

    def _pod_agents(self):
        """This (the job's) fleet's listener for the other pods' agents, opened once."""
        pod, secret = self.pod
        if self._pods is None:
            from spawner.podagents import PodAgents

            try:
                self._pods = PodAgents(secret, pod.port,
                                       {label: i for i, label in enumerate(pod.labels) if i},
                                       agent_command(self.config.remote_python),
                                       self.config.pod_timeout, self.log.info)
            except OSError as exc:
                raise LaunchError(f"--launcher pod: cannot listen on port {pod.port} for the "
                                  f"other pods' agents: {exc.strerror or exc}") from None
            self.log.info(f"waiting for {pod.count - 1} pod(s)' agents on port {pod.port}")
            for label in self._pods_out:
                self._pods.retire(label)
        return self._pods

    def reach_back_choice(self) -> str | None:
        """This machine's address on the network the user chose, if any: where agents
        called back to reach it (none: the address Slurm gives them for the launch node)."""
        from spawner.netifs import interfaces

        return address_here(self.config.network, interfaces)

    async def close(self) -> None:
        """Close every agent (each kills what it still runs and removes its temp dirs),
        then the connections (over Slurm: then the steps, cancelled if still there)."""
        retired = [s for s, _ in self._retired if s is not None]
        await asyncio.gather(*(s.close() for s in (*self.spawners.values(), *retired)),
                             return_exceptions=True)
        await close_all([*self.connections.values(),
                         *(c for _, c in self._retired if c is not None)])
        if self._slurm is not None:
            await self._slurm.close()
        if self._pods is not None:
            await self._pods.close()


async def connect(hosts: Sequence, *, fanout: int = DEFAULT_FANOUT, timeout: float,
                  keep_going: bool, progress=None, password: str | None = None,
                  on_open=None) -> ConnectResults:
    """SSH connections to `hosts`, at most `fanout` opening at once, each within `timeout`,
    never prompting (the user's ~/.ssh/config and keys; `password`: the one the user typed
    for --distribute-ssh-key); a host's failure is data; `on_open(host, connection)` as each
    opens. The caller closes the connections (spawner.ssh.close_all)."""
    return await connect_each(hosts, fanout=fanout, timeout=timeout, keep_going=keep_going,
                              progress=progress, password=password, on_open=on_open)


def _cancel(tasks: Iterable[asyncio.Task]) -> None:
    """Stop agents still starting. Each one's outcome is taken as it ends: an exception
    never retrieved would reach the loop's exception handler, which takes it for a bug."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(lambda done: done.cancelled() or done.exception())


def _raise_failures(failures: Sequence[HostFailure]) -> None:
    """A launch starts nothing unless every host is connected: one line per failed host."""
    if failures:
        raise LaunchError("\n".join(f.message for f in failures))


def _slurm_agents(address: str | None, note: Callable[[str], None]):
    """The launch's Slurm steps and the listener their agents call back to."""
    import shutil

    from spawner.srun import SlurmAgents

    srun = shutil.which("srun")
    if srun is None:
        raise LaunchError("--launcher slurm: `srun` is not on PATH (is the Slurm client "
                          "installed here?)")
    try:
        return SlurmAgents(srun, address, note)
    except OSError as exc:
        where = address or "this machine's addresses"
        raise LaunchError(f"--launcher slurm: cannot listen on {where} for the agents' "
                          f"calls: {exc.strerror or exc}") from None


def _connected_to(view):
    """connect's progress callback: the dashboard's "hosts connected" phase."""
    if view is None:
        return None
    return lambda host, timing, failure: failure is None and view.host_connected(str(host))


async def _start_agent(spawner: RemoteSpawner, view, install, python, log, **hello):
    if install is None:  # a Slurm step: the agent runs as is (no bootstrap, no zip to build)
        info = await spawner.start(**hello)
    else:
        from spawner import bootstrap

        info = await bootstrap.start_agent(spawner, install, python=python, log=log, **hello)
    if view is not None:
        view.agent_ready(spawner.host)
    return info


def _problem(spawner: RemoteSpawner, outcome: object, cwd: str, program: str,
             instances: int) -> str | None:
    if isinstance(outcome, RemoteError):
        return str(outcome)
    if isinstance(outcome, BaseException):
        return f"{spawner.host}: {outcome!r}"
    info = spawner.info
    if not info.cwd_exists:
        return f"{spawner.host}: the working directory {cwd} does not exist there"
    if info.program is None:
        return (f"{spawner.host}: program {program!r} not found or not executable there "
                f"(looked in PATH and in {cwd})")
    return _open_files_problem(spawner.host, info.raw.get("open_files"), instances)


def _open_files_problem(host: str, reported: object, instances: int) -> str | None:
    """The agent's open-file limit (HELLO's `open_files`: soft, hard, the soft one raised
    already) against what its instances need; an agent that did not say is not checked."""
    if not (isinstance(reported, list) and len(reported) == 2
            and all(type(n) is int for n in reported)):
        return None
    need, (soft, hard) = fdlimit.agent_need(instances), reported
    if not fdlimit.shortfall(need, soft):
        return None
    return (f"{host}: its {instances} instances need at least {need} open files in the "
            f"poprun agent there ({fdlimit.PER_INSTANCE} each), but its open-file limit "
            f"(ulimit -n) is {fdlimit.Limits(soft, hard).describe()}: raise the hard limit "
            f"there (limits.conf nofile, or sshd's), or run fewer instances per host")
