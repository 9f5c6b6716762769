"""The rule of tests/requires.py, made mechanical: a test skips for a missing dependency only
through its switch (so that CI, which sets the switches, sees a failure instead), and any
other skip says on its line, or the line above, why no switch applies (`# no switch: ...`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import requires
from requires import assert_skips_or_fails, needs, skip_or_fail

TESTS = Path(__file__).resolve().parent
SKIPS = re.compile(r"\bpytest\.skip\(|\.skipif\(|\bimportorskip\(|\bpytest\.mark\.skip\b")


def _sources() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py"))
            if p.name != "requires.py" and "standins" not in p.parts]


def test_every_skip_goes_through_a_switch_or_says_why_it_has_none():
    bare = []
    for path in _sources():
        lines = path.read_text().splitlines()
        for at, line in enumerate(lines):
            said = line + (lines[at - 1] if at else "")
            if SKIPS.search(line) and "# no switch: " not in said:
                bare.append(f"{path.relative_to(TESTS)}:{at + 1}: {line.strip()}")
    assert not bare, ("skips without a switch (use tests/requires.py, or say why none "
                      "applies with '# no switch: ...'):\n" + "\n".join(bare))


def test_every_switch_the_tests_name_is_one():
    named = {name for path in _sources() if path.name != "test_skips.py"  # its own: made up
             for name in re.findall(r"POPRUN_REQUIRE_[A-Z]+", path.read_text())}
    assert named and named <= set(requires.SWITCHES), named - set(requires.SWITCHES)


def test_a_missing_dependency_skips_or_fails_as_its_switch_says(monkeypatch):
    assert_skips_or_fails(lambda: skip_or_fail("no frobnicator", "POPRUN_REQUIRE_TOOLS"),
                          "POPRUN_REQUIRE_TOOLS", "^no frobnicator$", monkeypatch)
    with pytest.raises(ValueError, match="POPRUN_REQUIRE_FROBNICATOR is no test switch"):
        skip_or_fail("no frobnicator", "POPRUN_REQUIRE_FROBNICATOR")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_here is not installed"):
        requires.require_module("no_such_module_here", "POPRUN_REQUIRE_TOOLS")
    assert requires.require_module("json", "POPRUN_REQUIRE_TOOLS").dumps([]) == "[]"


def test_needs_runs_the_test_unless_its_dependency_is_missing(monkeypatch):
    ran = []

    def test(tmp_path):
        ran.append(tmp_path)

    assert needs("POPRUN_REQUIRE_TOOLS", "no frobnicator", False)(test) is test
    missing = needs("POPRUN_REQUIRE_TOOLS", "no frobnicator", True)(test)
    assert_skips_or_fails(lambda: missing("here"), "POPRUN_REQUIRE_TOOLS", "^no frobnicator$",
                          monkeypatch)
    assert ran == [] and missing.__wrapped__ is test  # pytest sees its fixtures
