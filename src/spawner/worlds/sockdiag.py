"""The kernel's word on a TCP socket of this network namespace: its owner's uid and its inode,
looked up by its addresses with sock_diag (netlink's NETLINK_SOCK_DIAG, an exact lookup:
what `ss` asks), for spawner/worlds/pmixgate.py.

/proc/net/tcp says the same (both are the kernel's sock_i_uid), but reading it walks every
bucket of the machine's TCP hash tables: 30-170 ms a read on a loaded 2-core machine here,
once per round of the gate's accepts, on the path of every instance's MPI_Init. An exact
lookup is one hash probe. Where sock_diag is missing (a kernel without tcp_diag, a sandbox
that filters netlink), `lookup` raises Unavailable and the gate reads the table instead.
Layouts: linux/inet_diag.h, linux/sock_diag.h, linux/netlink.h.
"""

from __future__ import annotations

import errno
import itertools
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
NLMSG = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
# inet_diag_req_v2: family, protocol, extensions, pad, states; then inet_diag_sockid:
# source and destination ports (big-endian), addresses (16 bytes each), interface, cookie.
REQUEST = struct.Struct("=BBBBI")
SOCKID = struct.Struct(">HH16s16s")
SOCKID_TAIL = struct.Struct("=III")  # interface, cookie (INET_DIAG_NOCOOKIE: not checked)
NOCOOKIE = 0xFFFFFFFF
# inet_diag_msg: family, state, timer, retransmits, the sockid (48 bytes), expires,
# receive and send queues, uid, inode.
MESSAGE = struct.Struct("=BBBB48sIIIII")
_seq = itertools.count(1)


class Unavailable(OSError):
    """sock_diag cannot answer here: read /proc/net/tcp instead."""


def request(local: tuple, remote: tuple, family: int, seq: int) -> bytes:
    """The exact lookup of the TCP socket whose own address is `local` and whose peer's is
    `remote` ((host, port, ...) as socket.getsockname gives them)."""
    def packed(host: str) -> bytes:
        return socket.inet_pton(family, host).ljust(16, b"\0")

    body = (REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            + SOCKID.pack(local[1], remote[1], packed(local[0]), packed(remote[0]))
            + SOCKID_TAIL.pack(0, NOCOOKIE, NOCOOKIE))
    return NLMSG.pack(NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_answer(data: bytes, seq: int) -> tuple[int, int] | None:
    """(uid, inode) from the kernel's answer to request `seq`; None where it has no such
    socket (gone meanwhile). Raises Unavailable where it cannot look."""
    if len(data) < NLMSG.size:
        raise Unavailable(errno.EPROTO, "sock_diag: a short answer")
    length, kind, _, got_seq, _ = NLMSG.unpack_from(data)
    if got_seq != seq or length > len(data):
        raise Unavailable(errno.EPROTO, "sock_diag: an answer to another request")
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", data, NLMSG.size)
        if -code == errno.ENOENT:
            return None
        raise Unavailable(-code, f"sock_diag: {errno.errorcode.get(-code, -code)}")
    if kind != SOCK_DIAG_BY_FAMILY or length < NLMSG.size + MESSAGE.size:
        raise Unavailable(errno.EPROTO, f"sock_diag: an answer of type {kind}")
    *_, uid, inode = MESSAGE.unpack_from(data, NLMSG.size)
    return uid, inode


class Diag:
    """A sock_diag netlink socket, for lookups one at a time (the gate's thread)."""

    def __init__(self) -> None:
        try:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        except (OSError, AttributeError) as exc:
            raise Unavailable(errno.EAFNOSUPPORT, f"sock_diag: {exc}") from None
        self._sock.settimeout(1.0)  # the kernel answers at once; never the gate's stall

    def lookup(self, local: tuple, remote: tuple, family: int) -> tuple[int, int] | None:
        """(uid, inode) of the TCP socket at `local` connected to `remote`, or None."""
        seq = next(_seq) & 0xFFFFFFFF
        try:
            self._sock.send(request(local, remote, family, seq))
            data = self._sock.recv(8192)
        except OSError as exc:
            raise Unavailable(exc.errno or errno.EIO, f"sock_diag: {exc}") from None
        return parse_answer(data, seq)

    def close(self) -> None:
        self._sock.close()
