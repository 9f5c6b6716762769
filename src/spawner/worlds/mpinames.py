"""MPI's published names (MPI_Publish_name, MPI_Lookup_name, MPI_Unpublish_name) for PMI-1,
scoped to one job: pure, no I/O (docs/architecture.md, "The instances' worlds").

MPICH's PMI-1 client sends ``cmd=publish_name service=<s> port=<p>``, ``cmd=lookup_name
service=<s>`` and ``cmd=unpublish_name service=<s>`` and expects ``publish_result``,
``lookup_result port=<p>`` and ``unpublish_result`` (pmodels/mpich src/pmi/maint/pmi-1.1.txt);
any ``rc`` other than 0 makes the call fail with MPI_ERR_NAME (its mpir_pmi1.inc). As in
Hydra's name server, publishing a name already published is refused, and so is unpublishing
or looking up one that is not.

Every world of the job (its instances' and the ones they spawn) shares one table, held by the
launcher; an agent asks the launcher over its connection (NAME, answered by NAMED:
spawner/protocol.py). What an instance sends is hostile input: a name or a port longer than
the PMI limits, or one name more than NAMES_MAX, is refused (rc=1), not stored.
"""

from __future__ import annotations

import asyncio

from ..within import within

# The most names a job holds at once (Hydra's name server has no bound; a program publishes a
# handful of service names, one per server it runs).
NAMES_MAX = 1024
# The longest service name and port name taken: MPICH's MPI_MAX_PORT_NAME is 1024 and its
# PMI-1 values are at most vallen_max (spawner/worlds/pmi1.py's VALLEN_MAX, 1024) long.
SERVICE_MAX = 256
PORT_MAX = 1024

# PMIx's names (Open MPI's MPI_Publish_name, and its connect/accept, whose roots exchange
# their members' list, `nspace.rank` each, through a published name): longer values, and
# lookups that wait for the name (PMIX_WAIT), each at most LOOKUP_WAIT_MAX seconds (Open
# MPI's connect/accept asks 600), at most WAITING_MAX at once. The whole table holds at
# most BYTES_MAX.
PMIX_PORT_MAX = 64 << 10
LOOKUP_WAIT_MAX = 600.0
WAITING_MAX = 1024
BYTES_MAX = 8 << 20

OPS = ("publish", "unpublish", "lookup", "context")
# PMIx group context IDs (Open MPI 5's MPI_Comm_create_from_group asks one per group): each
# group's key gets the next number, the same for every host asking with that key; at most
# CONTEXTS_MAX groups per job (Open MPI's own communicators take 0).
CONTEXTS_MAX = 1 << 16


class NameService:
    """The job's published names: `service` -> `port`."""

    def __init__(self, names_max: int = NAMES_MAX) -> None:
        self._names: dict[str, str] = {}
        self._once: set[str] = set()  # names that go with their first lookup
        self._waiting: dict[str, list[asyncio.Future]] = {}  # lookups waiting for a name
        self._bytes = 0
        self._contexts: dict[str, int] = {}
        self.names_max = names_max

    def answer(self, op: str, service: str, port: str = "", once: bool = False,
               port_max: int = PORT_MAX) -> tuple[int, str]:
        """(0, the port for a lookup, else "") on success; (1, why) when refused. `once`:
        the name goes with its first lookup (PMIx's PMIX_PERSIST_FIRST_READ)."""
        if op not in OPS:
            return 1, "unknown_name_operation"
        if not service or len(service) > SERVICE_MAX or "\n" in service:
            return 1, "bad_service_name"
        if op == "context":
            if service not in self._contexts:
                if len(self._contexts) >= CONTEXTS_MAX:
                    return 1, "too_many_groups"
                self._contexts[service] = len(self._contexts) + 1
            return 0, str(self._contexts[service])
        if op == "lookup":
            found = self._names.get(service)
            if found is not None and service in self._once:
                self._remove(service)
            return (0, found) if found is not None else (1, "service_not_found")
        if op == "unpublish":
            return (0, "") if self._remove(service) else (1, "service_not_found")
        if not port or len(port) > port_max or "\n" in port:
            return 1, "bad_port_name"
        if service in self._names:
            return 1, "service_already_published"
        if len(self._names) >= self.names_max or self._bytes + len(port) > BYTES_MAX:
            return 1, "too_many_names"
        self._names[service] = port
        self._bytes += len(port)
        if once:
            self._once.add(service)
        self._wake(service)
        return 0, ""

    def _remove(self, service: str) -> bool:
        port = self._names.pop(service, None)
        self._once.discard(service)
        if port is not None:
            self._bytes -= len(port)
        return port is not None

    def _wake(self, service: str) -> None:
        """The lookups waiting for `service`, in their order, while it is there (a `once`
        name goes to the first of them)."""
        waiting = self._waiting.get(service, [])
        while waiting and service in self._names:
            future = waiting.pop(0)
            if not future.done():
                future.set_result(self.answer("lookup", service))

    async def name(self, op: str, service: str, port: str = "", wait: float = 0.0,
                   once: bool = False, port_max: int = PORT_MAX) -> tuple[int, str]:
        """What spawner.worlds.pmi1.PmiServer awaits (an agent's upstream asks the launcher); a
        lookup with `wait` waits that long (at most LOOKUP_WAIT_MAX) for the name."""
        rc, value = self.answer(op, service, port, once, port_max)
        if rc == 0 or op != "lookup" or wait <= 0 or value != "service_not_found":
            return rc, value
        if self.waiting() >= WAITING_MAX:
            return 1, "too_many_waiting_lookups"
        future = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(service, [])
        waiting.append(future)
        try:
            return await within(future, min(wait, LOOKUP_WAIT_MAX))  # never wait_for
        except TimeoutError:
            return 1, "lookup_timed_out"
        finally:
            if future in waiting:
                waiting.remove(future)
            if not waiting:
                self._waiting.pop(service, None)

    def waiting(self) -> int:
        """How many lookups wait for a name."""
        return sum(map(len, self._waiting.values()))

    def __len__(self) -> int:
        return len(self._names)
