"""`dataclass`, with the methods it adds written once, here, instead of compiled per class.

The standard decorator writes each class's `__init__`, `__repr__`, `__eq__`, `__hash__` (and a
frozen class's `__setattr__`, `__delattr__`) as source text and compiles it at import: 135
methods for the 24 classes a local launch imported, ~100 M of the ~190 M instructions the
launcher ran beyond `python -c "import asyncio"` (callgrind; docs/architecture.md, "Measured
reasons"). Here the same methods are generic ones that read the class's fields, so nothing is
compiled; `dataclasses.fields`, `replace`, `asdict` and `is_dataclass` work as before: the
fields are recorded as the standard decorator records them (with init, repr and eq off), by
`_record_fields` in the common case, else by that decorator itself. Equality, hashing,
repr and frozenness behave as the standard ones do; `__init__` takes the same arguments,
positional or by name, and calls `__post_init__`. No InitVar fields.

The price is per object made: ~5 us more than a compiled `__init__`. A class made once per
instance (its plan, spec, result) or more often writes its `__init__` by hand, in its body,
where it is compiled with the module's bytecode (a frozen class fills `self.__dict__`): the
decorator keeps it, after checking that its parameters are the fields
`__init__` takes, in order, so that a field added later cannot be missed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import MISSING, FrozenInstanceError

_FIELDS = "__dataclass_fields__"
# Annotations that the standard decorator treats specially: a class with one goes to it.
_SPECIAL = re.compile(r"\b(?:ClassVar|InitVar|KW_ONLY)\b")
# What the standard decorator records of `dataclass(init=False, repr=False, eq=False)`, for
# `_record_fields` (a class deriving from ours reads it); taken from it, whatever its shape.
# (With a docstring: else the decorator makes one with inspect's tokenizer, ~3 ms.)
_PARAMS = dataclasses.dataclass(type("_Params", (), {"__doc__": "-"}), init=False, repr=False,
                                eq=False).__dataclass_params__


def dataclass(cls=None, /, *, frozen: bool = False):
    """`@dataclass` or `@dataclass(frozen=True)`, as the standard decorator with its defaults
    (init, repr, eq); methods the class defines itself are kept."""
    def wrap(cls: type) -> type:
        own = dict(cls.__dict__)
        if not own.get("__doc__"):
            # Else the standard decorator makes one from the signature of object.__init__,
            # which runs inspect's tokenizer: its regex, ~3 ms to compile, at import.
            cls.__doc__ = f"{cls.__name__}({', '.join(own.get('__annotations__', ()))})"
        if not _record_fields(cls):
            cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False)
        _add_methods(cls, own, frozen)
        return cls

    return wrap if cls is None else wrap(cls)


def _record_fields(cls: type) -> bool:
    """Record the class's fields as `dataclasses.dataclass(init=False, repr=False,
    eq=False)` would, in the common case: every annotation a field (a string, from `from
    __future__ import annotations`), no dataclass among the bases. False, nothing done,
    otherwise. The standard decorator's field processing (each annotation's string matched
    against ClassVar and InitVar through its module) was ~5 M instructions of a launch."""
    annotations = cls.__dict__.get("__annotations__", {})
    if any(hasattr(base, _FIELDS) for base in cls.__mro__[1:]) or any(
            not isinstance(kind, str) or _SPECIAL.search(kind) for kind in annotations.values()):
        return False
    fields = {}
    for name, kind in annotations.items():
        given = cls.__dict__.get(name, MISSING)
        made = given if isinstance(given, dataclasses.Field) else dataclasses.field(default=given)
        made.name, made.type, made._field_type = name, kind, dataclasses._FIELD
        if made.kw_only is MISSING:
            made.kw_only = False
        if made.default.__class__.__hash__ is None:  # as the standard decorator refuses it
            raise ValueError(f"mutable default {type(made.default)} for field {name} is not "
                             "allowed: use default_factory")
        if isinstance(given, dataclasses.Field):  # the class attribute: the default, or none
            if made.default is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, made.default)
        fields[name] = made
    setattr(cls, _FIELDS, fields)
    cls.__dataclass_params__ = _PARAMS
    if "__match_args__" not in cls.__dict__:
        cls.__match_args__ = tuple(name for name, f in fields.items() if f.init)
    return True


def _add_methods(cls: type, own: dict, frozen: bool) -> None:
    fields = dataclasses.fields(cls)
    if len(fields) != sum(f._field_type is not dataclasses._FIELD_CLASSVAR
                          for f in getattr(cls, _FIELDS).values()):
        raise TypeError(f"{cls.__qualname__}: InitVar fields need dataclasses.dataclass")
    setter = object.__setattr__ if frozen else setattr
    # (name, default, factory) of each __init__ argument, in order; then the fields __init__
    # sets without an argument (init=False with a default_factory).
    arguments = tuple((f.name, f.default, f.default_factory) for f in fields if f.init)
    names = tuple(name for name, _, _ in arguments)
    made = tuple((f.name, f.default_factory) for f in fields
                 if not f.init and f.default_factory is not MISSING)
    post_init = hasattr(cls, "__post_init__")
    if "__init__" in own:
        _check_own_init(cls, own["__init__"], arguments)

    def __init__(self, *args, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"{cls.__qualname__}.__init__() takes {len(names) + 1} positional "
                            f"arguments but {len(args) + 1} were given")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{cls.__qualname__}.__init__() got multiple values for "
                                f"argument {name!r}")
            kwargs[name] = value
        for name, default, factory in arguments:
            value = kwargs.pop(name, MISSING)
            if value is MISSING:
                if default is not MISSING:
                    value = default
                elif factory is not MISSING:
                    value = factory()
                else:
                    raise TypeError(f"{cls.__qualname__}.__init__() missing required argument: "
                                    f"{name!r}")
            setter(self, name, value)
        if kwargs:
            raise TypeError(f"{cls.__qualname__}.__init__() got an unexpected keyword argument "
                            f"{next(iter(kwargs))!r}")
        for name, factory in made:
            setter(self, name, factory())
        if post_init:
            self.__post_init__()

    every = frozenset(f.name for f in fields)
    shown = tuple(f.name for f in fields if f.repr)
    compared = tuple(f.name for f in fields if f.compare)
    hashed = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))

    def __repr__(self):
        return (f"{self.__class__.__qualname__}("
                + ", ".join(f"{name}={getattr(self, name)!r}" for name in shown) + ")")

    def __eq__(self, other):
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (tuple(getattr(self, name) for name in compared)
                == tuple(getattr(other, name) for name in compared))

    def __hash__(self):
        return hash(tuple(getattr(self, name) for name in hashed))

    def __setattr__(self, name, value):
        if type(self) is cls or name in every:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self, name):
        if type(self) is cls or name in every:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    added = {"__init__": __init__, "__repr__": __repr__, "__eq__": __eq__}
    if frozen:
        added.update(__setattr__=__setattr__, __delattr__=__delattr__)
    for name, method in added.items():
        if name not in own:
            method.__qualname__ = f"{cls.__qualname__}.{name}"
            setattr(cls, name, method)
    # As the standard decorator does: with eq, a frozen class hashes its fields and another
    # one is unhashable, unless it has a __hash__ of its own (one that Python set to None
    # for an __eq__ of the class's own does not count).
    if "__hash__" not in own or own["__hash__"] is None and "__eq__" in own:
        if frozen:
            __hash__.__qualname__ = f"{cls.__qualname__}.__hash__"
        cls.__hash__ = __hash__ if frozen else None


def _check_own_init(cls: type, init, arguments: tuple) -> None:
    """A hand-written `__init__` takes the fields, in order, nothing else, and has the same
    defaults (a field with a default factory: any default, standing for it)."""
    code = init.__code__
    given = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    optional = [(default, factory) for _, default, factory in arguments
                if default is not MISSING or factory is not MISSING]
    defaults = (init.__defaults__ or ()) + tuple((init.__kwdefaults__ or {}).values())
    if given != tuple(name for name, _, _ in arguments) or len(defaults) != len(optional) or \
            any(factory is MISSING and value != default
                for (default, factory), value in zip(optional, defaults)):
        raise TypeError(f"{cls.__qualname__}.__init__ does not take its fields "
                        f"({', '.join(given)}) with their defaults")
