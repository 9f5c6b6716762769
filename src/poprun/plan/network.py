"""The network the user chose for the instances' worlds, and what it means on each host.

Graphcore's PopRun handed the choice to mpirun: `--mca oob_tcp_if_include/exclude` for the
control plane, `--mca btl_tcp_if_include/exclude` for the data plane (PopRun guide, 2.2.3;
values are Open MPI's: comma-separated interface names or CIDR subnets), and later SDKs'
`--host-subnet` (a name or a subnet) for both. Without mpirun, poprun honours them itself:

- the control plane is how instances find each other: MASTER_ADDR (the first host's address)
  and Horovod's rendezvous (the launcher's); PMI needs no address (it crosses hosts over the
  agents' connections);
- the data plane is where the collectives' bytes go: each host's interface is named to the
  libraries that move them (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, HOROVOD_GLOO_IFACE,
  UCX_NET_DEVICES, FI_TCP_IFACE for MPICH over OFI, and OMPI_MCA_btl_tcp_if_include for
  Open MPI's TCP transport, which would otherwise stripe over every interface, a down or
  slower one included), unless the user set the variable. Open MPI's out-of-band (oob_tcp)
  is not named: its MPI processes, served PMIx by poprun, open no oob connections.

A user who names only one plane means that network for both: each falls back on the other,
then on `--host-subnet`. With no choice at all, nothing here applies (addresses are those the
hosts are reached at, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from popdist import env as E

from poprun.errors import ConfigError

# Open MPI's parameters, by plane.
CONTROL_KEYS = ("oob_tcp_if_include", "oob_tcp_if_exclude")
DATA_KEYS = ("btl_tcp_if_include", "btl_tcp_if_exclude")
# What names the data plane's interface to the libraries that move the bytes.
INTERFACE_VARIABLES = (E.GLOO_SOCKET_IFNAME, E.NCCL_SOCKET_IFNAME, E.HOROVOD_GLOO_IFACE,
                       E.UCX_NET_DEVICES, E.FI_TCP_IFACE, E.OMPI_BTL_TCP_IF_INCLUDE)
# A variable the user set that keeps one of ours out (Open MPI: include or exclude, not both).
_EXCLUDED_BY = {E.OMPI_BTL_TCP_IF_INCLUDE: E.OMPI_BTL_TCP_IF_EXCLUDE}


# Plain classes, not dataclasses: every launch imports this module (the config reads the mpi
# args through it), and making a dataclass costs ~1 ms.
class Selector:
    """One plane's choice: interfaces (by name or subnet) to use, or to avoid."""

    __slots__ = ("items", "exclude", "source")

    def __init__(self, items: tuple[str, ...], exclude: bool, source: str) -> None:
        self.items, self.exclude = items, exclude
        self.source = source  # the option that said it, for messages

    def matches(self, name: str, address: str) -> bool:
        """Whether interface `name` with `address` ("a.b.c.d/prefix") is named."""
        import ipaddress  # here, as below: every launch reads this module, few choose

        ip = ipaddress.ip_interface(address).ip
        return any(item == name or _in_subnet(ip, item) for item in self.items)

    def pick(self, interfaces: Mapping[str, Sequence[str]]) -> tuple[str, str] | None:
        """(interface, address) on this host: the first that is named (include), or the
        first that is not, loopback aside (exclude); IPv4 before IPv6, as Open MPI."""
        import ipaddress

        for family in (4, 6):
            for name, addresses in interfaces.items():
                for address in addresses:
                    ip = ipaddress.ip_interface(address).ip
                    if ip.version != family or ip.is_link_local:
                        continue
                    named = self.matches(name, address)
                    if named != self.exclude and not (self.exclude and ip.is_loopback):
                        return name, str(ip)
        return None


class NetworkChoice:
    """Each plane's selector; both None without a choice."""

    __slots__ = ("control", "data")

    def __init__(self, control: Selector | None = None, data: Selector | None = None) -> None:
        self.control, self.data = control, data

    @property
    def chosen(self) -> bool:
        return self.control is not None


def _in_subnet(ip, item: str) -> bool:
    import ipaddress

    if "/" not in item:
        return False
    try:
        return ip in ipaddress.ip_network(item, strict=False)
    except ValueError:
        return False


def _selector(option: str, value: str, exclude: bool) -> Selector:
    import ipaddress

    items = tuple(part.strip() for part in value.split(",") if part.strip())
    if not items:
        raise ConfigError(f"{option}: no interface or subnet given")
    for item in items:
        if "/" in item:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ConfigError(f"{option}: {item!r} is not a subnet (a.b.c.d/n) nor an "
                                  "interface name") from None
    return Selector(items, exclude, f"{option} {value}")


def choose(host_subnet: str | None, mca: Iterable[tuple[str, str]]) -> NetworkChoice:
    """The choice from `--host-subnet` and the `--mca KEY VALUE` pairs of the mpi args."""
    planes: dict[str, Selector] = {}
    for key, value in mca:
        plane = "control" if key in CONTROL_KEYS else "data" if key in DATA_KEYS else None
        if plane is None:
            continue
        selector = _selector(f"--mca {key}", value, key.endswith("exclude"))
        if plane in planes and planes[plane].exclude != selector.exclude:
            raise ConfigError(f"{planes[plane].source} and {selector.source}: give an "
                              "interface list to include or one to exclude, not both "
                              "(as Open MPI)")
        planes[plane] = selector
    subnet = _selector("--host-subnet", host_subnet, False) if host_subnet else None
    control = planes.get("control") or planes.get("data") or subnet
    data = planes.get("data") or planes.get("control") or subnet
    return NetworkChoice(control, data)


def pick_or_fail(selector: Selector, host: str,
                 interfaces: Mapping[str, Sequence[str]]) -> tuple[str, str]:
    """(interface, address) of `host` on the chosen network; one clear error when it has none."""
    found = selector.pick(interfaces)
    if found is None:
        have = ", ".join(f"{name} {' '.join(a) or '(no address)'}"
                         for name, a in interfaces.items())
        raise ConfigError(f"{host}: no interface matches {selector.source} (it has: {have})")
    return found


def interface_variables(interface: str, environ: Mapping[str, str],
                        user_set: Iterable[str] = ()) -> dict[str, str]:
    """The data plane's interface for the libraries, but for the variables the user set
    (in poprun's environment or with -x)."""
    taken = set(environ) | set(user_set)
    return {name: interface for name in INTERFACE_VARIABLES
            if name not in taken and _EXCLUDED_BY.get(name) not in taken}


class HostNetwork:
    """One host on the chosen network."""

    __slots__ = ("address", "interface")

    def __init__(self, address: str, interface: str) -> None:
        self.address = address  # where it is reached (control plane): MASTER_ADDR if first
        self.interface = interface  # what its instances' collectives use (data plane)


def resolve(choice: NetworkChoice,
            host_interfaces: Mapping[str, Mapping[str, Sequence[str]]]) -> dict[str, HostNetwork]:
    """Each host (label -> its interfaces, spawner/netifs.py) on the chosen network."""
    assert choice.control is not None and choice.data is not None
    return {host: HostNetwork(pick_or_fail(choice.control, host, interfaces)[1],
                              pick_or_fail(choice.data, host, interfaces)[0])
            for host, interfaces in host_interfaces.items()}


def address_here(choice: NetworkChoice,
                 interfaces: Callable[[], Mapping[str, Sequence[str]]]) -> str | None:
    """This machine's address on the chosen network (`interfaces()` lists its own, read
    only when there is a choice); None without a choice or an interface there."""
    if not choice.chosen:
        return None
    found = choice.control.pick(interfaces())
    return found[1] if found else None
