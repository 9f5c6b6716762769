"""This host's network interfaces and their addresses, for the network the user chose
(`--host-subnet`, `--mca btl_tcp_if_include ...`: poprun/plan/network.py).

Read with libc's getifaddrs(3) through ctypes: the standard library names interfaces
(socket.if_nameindex) but not their addresses, and an agent brought to a host
(spawner/bootstrap.py) can only carry pure Python. Only asked for when the user chose a
network (the HELLO's `interfaces`), so a plain launch does not import ctypes.
"""

from __future__ import annotations

import ipaddress
import socket


def interfaces() -> dict[str, list[str]]:
    """{interface name: [its addresses as "address/prefix"]}, IPv4 and IPv6, up or not."""
    import ctypes
    import ctypes.util

    class Sockaddr(ctypes.Structure):
        _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]

    class Ifaddrs(ctypes.Structure):
        pass

    Ifaddrs._fields_ = [("next", ctypes.POINTER(Ifaddrs)), ("name", ctypes.c_char_p),
                        ("flags", ctypes.c_uint), ("addr", ctypes.POINTER(Sockaddr)),
                        ("netmask", ctypes.POINTER(Sockaddr))]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found: dict[str, list[str]] = {}
    try:
        entry = head
        while entry:
            item = entry.contents
            name = item.name.decode(errors="replace")
            found.setdefault(name, [])
            address = _address(item.addr, item.netmask)
            if address is not None:
                found[name].append(address)
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def _address(addr, netmask) -> str | None:
    """"address/prefix" of a sockaddr and its netmask, None when not IPv4 or IPv6."""
    if not addr:
        return None
    family = addr.contents.family
    if family == socket.AF_INET:
        start, size = 2, 4  # sockaddr_in: port, then the address
    elif family == socket.AF_INET6:
        start, size = 6, 16  # sockaddr_in6: port, flow info, then the address
    else:
        return None
    raw = bytes(addr.contents.data[start:start + size])
    mask = bytes(netmask.contents.data[start:start + size]) if netmask else b"\xff" * size
    prefix = bin(int.from_bytes(mask, "big")).count("1")
    return f"{ipaddress.ip_address(raw)}/{prefix}"
