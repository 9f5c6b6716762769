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

# The most names a job holds at once (Hydra's name server has no bound; a program publishes a
# handful of service names, one per server it runs).
NAMES_MAX = 1024
# The longest service name and port name taken: MPICH's MPI_MAX_PORT_NAME is 1024 and its
# PMI-1 values are at most vallen_max (spawner/worlds/pmi1.py's VALLEN_MAX, 1024) long.
SERVICE_MAX = 256
PORT_MAX = 1024

OPS = ("publish", "unpublish", "lookup")


class NameService:
    """The job's published names: `service` -> `port`."""

    def __init__(self, names_max: int = NAMES_MAX) -> None:
        self._names: dict[str, str] = {}
        self.names_max = names_max

    def answer(self, op: str, service: str, port: str = "") -> tuple[int, str]:
        """(0, the port for a lookup, else "") on success; (1, why) when refused."""
        if op not in OPS:
            return 1, "unknown_name_operation"
        if not service or len(service) > SERVICE_MAX or "\n" in service:
            return 1, "bad_service_name"
        if op == "lookup":
            found = self._names.get(service)
            return (0, found) if found is not None else (1, "service_not_found")
        if op == "unpublish":
            return (0, "") if self._names.pop(service, None) is not None else (
                1, "service_not_found")
        if not port or len(port) > PORT_MAX or "\n" in port:
            return 1, "bad_port_name"
        if service in self._names:
            return 1, "service_already_published"
        if len(self._names) >= self.names_max:
            return 1, "too_many_names"
        self._names[service] = port
        return 0, ""

    async def name(self, op: str, service: str, port: str = "") -> tuple[int, str]:
        """What spawner.worlds.pmi1.PmiServer awaits (an agent's upstream asks the launcher)."""
        return self.answer(op, service, port)

    def __len__(self) -> int:
        return len(self._names)
