"""The data of PMIx frames between the launcher and an agent (FENCE_IN/OUT, MODEX_GOT/DATA)
is decoded by one strict, bounded decoder on both ends (spawner/worlds/pmixplan.py, decode_data;
docs/architecture.md, "Runtime guarantees"). Guards a defect: the agent decoded the launcher's with
a lenient base64 and no bound, so data the launcher would refuse reached Open MPI as if it
were a fence's."""

from __future__ import annotations

import asyncio
import base64

import pytest

from spawner.worlds import pmixplan
from spawner.worlds.nodeworld import AgentWorld
from spawner.protocol import Kind

pytestmark = pytest.mark.timeout(10)


def test_the_decoder_is_strict_and_bounded():
    assert pmixplan.decode_data(base64.b64encode(b"abc").decode(), 3) == b"abc"
    assert pmixplan.decode_data("", 0) == b""
    for bad, limit in (("QUJD\nRA==", 100), ("QUJD RA==", 100), ("!!!!", 100),
                       ("QUJ", 100), (b"QUJD", 100), (None, 100), (3, 100),
                       (base64.b64encode(b"abcd").decode(), 3)):
        with pytest.raises(ValueError):
            pmixplan.decode_data(bad, limit)


def _world() -> tuple[AgentWorld, asyncio.AbstractEventLoop]:
    """A world of two ranks on two hosts, rank 0 here, no PMIx server (its answers are
    what is tested: they go to the callbacks the test puts where the server's would be)."""
    loop = asyncio.new_event_loop()
    fields = {"kvsname": "poprun-d-0", "size": 2, "nodes": [0, 1], "ranks": [0]}
    return AgentWorld(loop, fields, lambda frame: None, None), loop


@pytest.mark.parametrize("data", ["QUJD\nRA==", "QUJDRA=", "!!", "QUJD" * 3])
def test_an_agent_answers_data_it_cannot_decode_as_an_error(monkeypatch, data):
    """Lenient base64 took "QUJD\\nRA==" for b"ABCD" (status 0); the agent now answers its
    local server an error, as the launcher does for an agent's data. The last case is
    valid base64 past a (lowered) bound."""
    monkeypatch.setattr(pmixplan, "MAX_MODEX", 6, raising=False)
    monkeypatch.setattr(pmixplan, "MAX_FENCE_DATA", 3)  # x 2 hosts: 6 bytes
    world, loop = _world()
    try:
        answers = []
        world._uplink._fences[pmixplan.FenceId((0, 1), 4)] = lambda status, blob: \
            answers.append((status, blob))
        world._uplink._wants[9] = lambda status, blob: answers.append((status, blob))
        world.answered(Kind.FENCE_OUT, {"kvsname": "poprun-d-0", "ranks": [0, 1], "seq": 4,
                                        "data": data})
        world.answered(Kind.MODEX_DATA, {"kvsname": "poprun-d-0", "id": 9, "status": 0,
                                         "data": data})
        assert answers == [(-1, b""), (-1, b"")]
    finally:
        loop.close()


def test_an_agent_passes_good_data_and_the_launchers_status_on():
    world, loop = _world()
    try:
        answers = []
        world._uplink._fences[pmixplan.FenceId((0, 1), 1)] = lambda status, blob: \
            answers.append((status, blob))
        world._uplink._wants[2] = lambda status, blob: answers.append((status, blob))
        world.answered(Kind.FENCE_OUT, {"ranks": [0, 1], "seq": 1,
                                        "data": base64.b64encode(b"onetwo").decode()})
        world.answered(Kind.MODEX_DATA, {"id": 2, "status": -46, "data": ""})
        assert answers == [(0, b"onetwo"), (-46, b"")]
    finally:
        loop.close()


def test_a_connect_s_procs_of_several_namespaces_are_named_as_every_host_names_them():
    """pmixplan.connect_sets: namespaces in order, a wildcard expanded to its world's ranks,
    each set sorted; what this host's server cannot serve is said, never raised."""
    parents = pmixplan.world("job-0", ["h1", "h2"], "h1")
    children = pmixplan.world("job-0-spawn0", ["h2", "h2", "h1"], None)
    worlds = {"job-0": parents, "job-0-spawn0": children}
    assert children.local_ranks == [] and children.here == pmixplan.NONE_HERE
    assert pmixplan.connect_sets([("job-0-spawn0", pmixplan.WILDCARD), ("job-0", 1),
                                  ("job-0", 0), ("job-0", 1)], worlds) == (
        ("job-0", (0, 1)), ("job-0-spawn0", (0, 1, 2)))
    assert pmixplan.connect_sets([("job-0", 0), ("other", 0)], worlds) == \
        "namespace other is not served on this host"
    assert pmixplan.connect_sets([("job-0", 0), ("job-0-spawn0", 3)], worlds) == \
        "rank 3 is not one of namespace job-0-spawn0's"
    assert pmixplan.connect_sets([], worlds) == "0 namespaces (2 to 64 are served)"
    sets = pmixplan.connect_sets([("job-0", 0), ("job-0-spawn0", 2)], worlds)
    assert pmixplan.parse_sets(pmixplan.sets_json(sets), 10) == sets  # the frame's round trip
    for bad in ([["job-0", [0]]], [["b", [0]], ["a", [0]]], [["a", [1, 0]], ["b", [0]]],
                [["a", [0]], ["b", [True]]], [["a", [0, 1]], ["b", [0]]]):
        with pytest.raises(ValueError):
            pmixplan.parse_sets(bad, 2)
