"""The job's name table as PMIx uses it (spawner/worlds/mpinames.py,
spawner/worlds/pmixserver.py; docs/architecture.md, "The instances' worlds"): Open MPI's
connect/accept publishes each side's members under a name read once
(PMIX_PERSIST_FIRST_READ) and looks up the other side's with PMIX_WAIT; its MPI-4 groups ask
for a context ID. Pure: the real Open MPIs over it are in
tests/test_openmpi_dynproc.py."""

from __future__ import annotations

import asyncio

import pytest

from spawner.worlds import mpinames
from spawner.worlds.pmixserver import (BYTES_MARK, ERR_NOT_FOUND, SUCCESS, NameRequest,
                                       _published_bytes, name_requests, name_status)

pytestmark = pytest.mark.timeout(30)


def test_a_name_read_once_goes_with_its_first_lookup():
    names = mpinames.NameService()
    assert names.answer("publish", "port:accept", "0.0:1", once=True) == (0, "")
    assert names.answer("lookup", "port:accept") == (0, "0.0:1")
    assert names.answer("lookup", "port:accept") == (1, "service_not_found")
    assert len(names) == 0


def test_a_lookup_that_waits_gets_the_name_once_it_is_published():
    async def main():
        names = mpinames.NameService()
        first = asyncio.ensure_future(names.name("lookup", "s", wait=5))
        second = asyncio.ensure_future(names.name("lookup", "s", wait=5))
        await asyncio.sleep(0)
        assert names.waiting() == 2
        assert await names.name("publish", "s", "p", once=True) == (0, "")
        # a name read once goes to the first lookup; the second waits on, for the next
        assert await first == (0, "p")
        await asyncio.sleep(0)
        assert not second.done() and names.waiting() == 1
        await names.name("publish", "s", "q")
        assert await second == (0, "q")
        assert names.waiting() == 0

    asyncio.run(main())


def test_a_lookup_waits_no_longer_than_asked_and_waiting_lookups_are_bounded(monkeypatch):
    monkeypatch.setattr(mpinames, "WAITING_MAX", 2)

    async def main():
        names = mpinames.NameService()
        assert await names.name("lookup", "never", wait=0.01) == (1, "lookup_timed_out")
        held = [asyncio.ensure_future(names.name("lookup", "never", wait=60)) for _ in "ab"]
        await asyncio.sleep(0)
        assert await names.name("lookup", "never", wait=60) == (1, "too_many_waiting_lookups")
        assert await names.name("lookup", "never") == (1, "service_not_found")  # no wait
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert names.waiting() == 0

    asyncio.run(main())


def test_pmix_ports_are_longer_and_the_table_s_bytes_are_bounded(monkeypatch):
    monkeypatch.setattr(mpinames, "BYTES_MAX", 3000)
    names = mpinames.NameService()
    long = "m" * 2000  # a connect/accept side's members: past PMI-1's 1,024
    assert names.answer("publish", "a", long) == (1, "bad_port_name")
    assert names.answer("publish", "a", long, port_max=mpinames.PMIX_PORT_MAX) == (0, "")
    assert names.answer("publish", "b", long, port_max=mpinames.PMIX_PORT_MAX) == (
        1, "too_many_names")
    assert names.answer("unpublish", "a") == (0, "")
    assert names.answer("publish", "b", long, port_max=mpinames.PMIX_PORT_MAX) == (0, "")


def test_a_group_s_context_id_is_the_same_for_each_host_asking_and_new_for_each_group(
        monkeypatch):
    monkeypatch.setattr(mpinames, "CONTEXTS_MAX", 2)
    names = mpinames.NameService()
    assert names.answer("context", "group:a") == (0, "1")
    assert names.answer("context", "group:a") == (0, "1")  # another host of that group
    assert names.answer("context", "group:b") == (0, "2")
    assert names.answer("context", "group:c") == (1, "too_many_groups")
    assert len(names) == 0  # not names: MPI_Lookup_name never finds them


def test_an_upcall_s_names_are_its_data_its_directives_set_once_and_wait():
    infos = [("port:connect", "0.0:2"), ("pmix.persist", 1), ("pmix.euid", 0),
             ("cid", b"\x00\x01")]
    assert name_requests("publish", 3, infos) == [
        NameRequest(3, "publish", "port:connect", "0.0:2", once=True),
        NameRequest(3, "publish", "cid", BYTES_MARK + "AAE=", once=True)]
    with pytest.raises(ValueError):
        name_requests("publish", 3, [("n", 7)])  # ports are strings (or bytes)
    assert name_requests("lookup", 0, [("pmix.wait", True), ("pmix.timeout", 10)],
                         ["port:accept"]) == [NameRequest(0, "lookup", "port:accept", wait=10)]
    assert name_requests("lookup", 0, [("pmix.wait", True), ("pmix.timeout", 10**6)],
                         ["k"])[0].wait == mpinames.LOOKUP_WAIT_MAX
    assert name_requests("lookup", 0, [], ["k"])[0].wait == 0
    # past the table's bounds: refused in the server's process, before any link
    with pytest.raises(ValueError):
        name_requests("publish", 0, [("n", "p" * (mpinames.PMIX_PORT_MAX + 1))])
    with pytest.raises(ValueError):
        name_requests("lookup", 0, [], ["s" * (mpinames.SERVICE_MAX + 1)])


@pytest.mark.parametrize("answer, status", [
    ((0, "p"), (SUCCESS, "p")), ((1, "service_not_found"), (ERR_NOT_FOUND, "")),
    ((1, "lookup_timed_out"), (-24, "")), ((1, "service_already_published"), (-53, "")),
    ((1, "too_many_names"), (-1, ""))])
def test_the_table_s_answers_are_pmix_statuses(answer, status):
    assert name_status(*answer) == status


@pytest.mark.parametrize("port, value", [
    (BYTES_MARK + "AAE=", b"\x00\x01"), ("0.0:2", None),
    # only looks marked (another instance's value, PMI-1's too): a string, no exception
    (BYTES_MARK + "AAE", None), (BYTES_MARK + "A*E=", None), (BYTES_MARK + "\u00e9", None),
    (BYTES_MARK + "A" * (4 * mpinames.PMIX_PORT_MAX // 3 + 8), None)])
def test_a_published_byte_object_is_read_strictly(port, value):
    """What a lookup answers as a byte object: only strict base64 within the bound."""
    assert _published_bytes(port) == value
