"""spawner.uncompiled.dataclass behaves as dataclasses.dataclass: each check runs on the same
class made by both decorators."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import FrozenInstanceError, field

import pytest

from spawner import uncompiled

pytestmark = pytest.mark.timeout(30)


def both(frozen: bool):
    """The same class body, decorated by each decorator."""
    made = []
    for decorate in (dataclasses.dataclass(frozen=frozen), uncompiled.dataclass(frozen=frozen)):
        @decorate
        class Sample:
            """A class with every kind of field the launcher's classes use."""

            name: str
            count: int = 2
            items: list = field(default_factory=list)
            note: str = field(default="", compare=False)
            secret: str = field(default="s", repr=False)
            made: dict = field(default_factory=dict, init=False, compare=False)

            def __post_init__(self) -> None:
                if self.count < 0:
                    raise ValueError("negative")

        made.append(Sample)
    return made


@pytest.mark.parametrize("frozen", [False, True])
def test_the_same_instances_compare_print_and_hash_alike(frozen):
    for cls in both(frozen):
        a, b = cls("x", 3, [1], note="n"), cls(name="x", count=3, items=[1], note="other")
        assert a == b and a != cls("y") and a != ("x", 3)
        assert repr(a).endswith("Sample(name='x', count=3, items=[1], note='n', made={})")
        assert a.made == {} and a.made is not b.made
        assert cls("z").items is not cls("z").items
        assert dataclasses.replace(a, count=4).count == 4
        assert dataclasses.asdict(a)["items"] == [1]
        assert [f.name for f in dataclasses.fields(cls)] == [
            "name", "count", "items", "note", "secret", "made"]
        with pytest.raises(ValueError):
            cls("x", -1)
        if frozen:
            b = cls("x", 3, (1,))
            assert hash(b) == hash(cls("x", 3, (1,), note="other"))
            with pytest.raises(FrozenInstanceError):
                b.count = 1
            with pytest.raises(FrozenInstanceError):
                del b.count
        else:
            with pytest.raises(TypeError):
                hash(a)
            a.count = 5
            assert a.count == 5


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("args, kwargs", [((), {}), (("x",), {"name": "y"}),
                                          (("x",), {"other": 1}), (("x",) + (1,) * 9, {}),
                                          (("x",), {"made": {}})])
def test_the_same_calls_are_refused(frozen, args, kwargs):
    for cls in both(frozen):
        with pytest.raises(TypeError):
            cls(*args, **kwargs)


def test_methods_of_the_class_own_stay():
    @uncompiled.dataclass(frozen=True)
    class Own:
        value: int

        def __repr__(self) -> str:
            return "own"

        def __hash__(self) -> int:
            return 7

    assert repr(Own(1)) == "own" and hash(Own(1)) == 7 and Own(1) == Own(1)


def test_nothing_is_compiled(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(dataclasses, "_create_fn", refuse)
    # nor a signature read for a class without a docstring (inspect's tokenizer, ~3 ms)
    monkeypatch.setattr(inspect, "signature", refuse)
    both_made = []

    @uncompiled.dataclass(frozen=True)
    class Frozen:
        value: int = 0

    @uncompiled.dataclass
    class Plain:
        value: int = 0

    both_made += [Frozen(1), Plain(2)]
    assert [x.value for x in both_made] == [1, 2]
    assert Plain.__doc__ == "Plain(value)"


def test_an_init_written_by_hand_is_kept_when_it_takes_the_fields():
    @uncompiled.dataclass(frozen=True)
    class Made:
        name: str
        count: int = 2
        items: list = field(default_factory=list)

        def __init__(self, name, count=2, items=None):
            self.__dict__.update(name=name, count=count, items=[] if items is None else items)

    made = Made("x", items=[1])
    assert made == Made("x", 2, [1]) and made.count == 2
    assert dataclasses.replace(made, count=3) == Made("x", 3, [1])
    with pytest.raises(FrozenInstanceError):
        made.count = 1


@pytest.mark.parametrize("init", [
    "def __init__(self, name): pass",  # a field left out
    "def __init__(self, count, name=''): pass",  # another order
    "def __init__(self, name, count=3): pass",  # another default
    "def __init__(self, name, count): pass",  # a default missing
])
def test_an_init_written_by_hand_that_misses_a_field_is_refused(init):
    body = {}
    exec(init, body)  # noqa: S102 - the test's own source
    with pytest.raises(TypeError):
        uncompiled.dataclass(type("Wrong", (), {"__annotations__": {"name": "str", "count": "int"},
                                                "count": 2, "__init__": body["__init__"]}))


def test_the_fields_are_recorded_as_the_standard_decorator_records_them():
    standard, ours = both(frozen=True)
    for theirs, mine in zip(dataclasses.fields(standard), dataclasses.fields(ours)):
        assert [getattr(theirs, a) for a in theirs.__slots__ if a != "default_factory"] == \
            [getattr(mine, a) for a in mine.__slots__ if a != "default_factory"]
    assert ours.__match_args__ == standard.__match_args__
    assert ours.count == 2 and not hasattr(ours, "items")  # class attributes: the defaults

    @uncompiled.dataclass
    class Derived(ours):  # a dataclass base: the standard decorator records the fields
        extra: int = 0

    assert [f.name for f in dataclasses.fields(Derived)][-2:] == ["made", "extra"]
    with pytest.raises(ValueError):
        uncompiled.dataclass(type("Mutable", (), {"__annotations__": {"x": "list"}, "x": []}))
