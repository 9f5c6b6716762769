"""The network the user chose: `--host-subnet` and `--mca
btl_tcp_if_include/exclude`, `oob_tcp_if_include/exclude` read from the mpi args
(plan/network.py), resolved on each host's interfaces (spawner/netifs.py) and planned into the
instances' variables. The pure parts here; real hosts with networks of their own, in network
namespaces, in tests/test_netns_network.py.
"""

from __future__ import annotations

import socket
import sys

import pytest

from conftest import OFFLINE, run_poprun
from popdist import env as E
from poprun.errors import ConfigError
from poprun.plan.config import LaunchConfig
from poprun.plan.network import (INTERFACE_VARIABLES, address_here, choose,
                                 interface_variables, resolve)
from poprun.plan.planner import plan
from spawner.netifs import interfaces

HOST = {"lo": ["127.0.0.1/8", "::1/128"], "eth0": ["192.0.2.2/24", "fe80::1/64"],
        "eth1": ["10.1.0.7/16", "fd00::7/64"], "ib0": []}

pytestmark = pytest.mark.timeout(60)


def test_a_subnet_or_a_name_picks_the_interface_and_its_address():
    assert choose("10.1.0.0/16", ()).control.pick(HOST) == ("eth1", "10.1.0.7")
    assert choose("eth0", ()).control.pick(HOST) == ("eth0", "192.0.2.2")
    assert choose("fd00::/64", ()).control.pick(HOST) == ("eth1", "fd00::7")
    assert choose("10.9.0.0/16", ()).control.pick(HOST) is None


def test_exclude_takes_the_first_other_interface_never_loopback_ipv4_first():
    choice = choose(None, [("btl_tcp_if_exclude", "eth0")])
    assert choice.data.pick(HOST) == ("eth1", "10.1.0.7")
    assert choose(None, [("btl_tcp_if_exclude", "eth0,10.1.0.0/16")]).data.pick(HOST) == (
        "eth1", "fd00::7")  # its IPv4 address is excluded by subnet, its IPv6 one is not


def test_each_plane_falls_back_on_the_other_then_on_host_subnet():
    only_data = choose(None, [("btl_tcp_if_include", "eth1")])
    assert only_data.control.source == only_data.data.source == "--mca btl_tcp_if_include eth1"
    both = choose("eth0", [("oob_tcp_if_include", "eth1")])
    assert (both.control.items, both.data.items) == (("eth1",), ("eth1",))
    assert choose("eth0", []).data.items == ("eth0",)
    assert not choose(None, [("btl_tcp_if_foo", "x")]).chosen


def test_include_and_exclude_of_one_plane_are_refused_as_open_mpi_does():
    with pytest.raises(ConfigError, match="include or one to exclude, not both"):
        choose(None, [("btl_tcp_if_include", "eth1"), ("btl_tcp_if_exclude", "eth0")])
    with pytest.raises(ConfigError, match="not a subnet"):
        choose("10.0.0.0/99", ())


def test_a_host_without_an_interface_there_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"^h2: no interface matches --host-subnet "
                                          r"10.1.0.0/16 \(it has: lo 127.0.0.1/8"):
        resolve(choose("10.1.0.0/16", ()), {"h1": HOST, "h2": {"lo": ["127.0.0.1/8"]}})
    assert address_here(choose(None, ()), lambda: pytest.fail("read without a choice")) is None


def test_variables_name_the_interface_except_those_the_user_set():
    assert interface_variables("eth1", {}) == dict.fromkeys(INTERFACE_VARIABLES, "eth1")
    got = interface_variables("eth1", {E.NCCL_SOCKET_IFNAME: "ib0"}, [E.UCX_NET_DEVICES])
    assert E.NCCL_SOCKET_IFNAME not in got and E.UCX_NET_DEVICES not in got
    assert got[E.GLOO_SOCKET_IFNAME] == got[E.FI_TCP_IFACE] == "eth1"
    assert got[E.OMPI_BTL_TCP_IF_INCLUDE] == "eth1"  # Open MPI's TCP transport, as mpirun's


def test_open_mpi_s_include_list_stays_out_beside_the_user_s_exclude_list():
    """Open MPI refuses both at once (MPI_Init fails): the user's exclude wins, in poprun's
    environment or given with -x."""
    for environ, user_set in (({E.OMPI_BTL_TCP_IF_EXCLUDE: "docker0"}, ()),
                              ({}, [E.OMPI_BTL_TCP_IF_EXCLUDE])):
        got = interface_variables("eth1", environ, user_set)
        assert E.OMPI_BTL_TCP_IF_INCLUDE not in got and got[E.NCCL_SOCKET_IFNAME] == "eth1"


def test_the_plan_gives_each_host_s_instances_their_interface_and_x_wins():
    config = LaunchConfig(program=("p",), num_instances=4, num_replicas=4, offline_mode=True,
                          host_subnet="10.1.0.0/16", env=(f"{E.GLOO_SOCKET_IFNAME}=mine",))
    launch_plan = plan(config, {}, program=("p",), master_port=1, hosts=("h1", "h2"),
                       rendezvous=("10.1.0.1", 5), interfaces={"h1": "eth1", "h2": "bond0"})
    got = [(i.env[E.HOROVOD_GLOO_IFACE], i.env[E.UCX_NET_DEVICES], i.env[E.GLOO_SOCKET_IFNAME])
           for i in launch_plan.instances]
    assert got == [("eth1", "eth1", "mine")] * 2 + [("bond0", "bond0", "mine")] * 2


def test_mca_network_keys_are_read_and_others_still_ignored():
    config = LaunchConfig(program=("p",), num_instances=2, num_replicas=2, offline_mode=True,
                          mpi_global_args=("--mca btl_tcp_if_include eth1 --mca btl ^openib",))
    assert config.mpi.mca == (("btl_tcp_if_include", "eth1"),)
    assert config.mpi.ignored == ("--mca btl ^openib",)
    assert config.network.data.items == ("eth1",)
    with pytest.raises(ConfigError, match="give it in --mpi-global-args"):
        LaunchConfig(program=("p",), num_instances=2, num_replicas=2, offline_mode=True,
                     instance_mpi_local_args=("1:--mca oob_tcp_if_include eth1",)).instance_mpi


def test_this_host_s_interfaces_are_read_with_their_addresses():
    found = interfaces()
    assert "127.0.0.1/8" in found["lo"]
    assert sorted(found) == sorted(name for _, name in socket.if_nameindex())


def test_a_launch_on_the_chosen_network_and_a_bad_choice():
    program = (f"import os; print(os.environ['{E.MASTER_ADDR}'], "
               f"os.environ['{E.FI_TCP_IFACE}'], os.environ['{E.HOROVOD_RENDEZVOUS_ADDR}'])")
    proc = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--host-subnet=lo",
                      sys.executable, "-c", program)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines() == ["127.0.0.1 lo 127.0.0.1"] * 2
    bad = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2",
                     "--mpi-global-args=--mca btl_tcp_if_include nosuch0", "true")
    assert bad.returncode == 2
    assert bad.stderr.decode().startswith(
        "poprun: error: localhost: no interface matches --mca btl_tcp_if_include nosuch0")
