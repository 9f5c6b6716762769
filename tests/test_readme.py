"""The README tells what exists (issue 14 point 11): the dashboard and how to turn it off or
force it, --result-json, --kill-timeout, every exit status with its exit_reason, the Python
versions really required, the variables --forward-env all keeps back, the mpirun arguments
(tests/test_config.py compares that list)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from popdist.env import NOT_FORWARDED
from poprun.cli import options as cli
from spawner.carried import MIN_PYTHON

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", ["--no-dashboard", "--dashboard", "POPRUN_NO_DASHBOARD",
                                  "--result-json", "--kill-timeout", "--forward-env",
                                  "--timestamp-output", "--export-config", "--import-config",
                                  "--compare-hosts"])
def test_options_people_look_for_are_described(name):
    assert re.search(rf"`{re.escape(name)}[ =`]", README), name
    assert name.lstrip("-") in {o.long for o in cli.OPTIONS} or name.isupper()


def test_the_python_versions_are_the_ones_required():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = project["requires-python"].removeprefix(">=")
    assert f"Python ≥ {needed}" in README and f"Python {needed} or later" in README
    assert f"Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or later" in README  # remote hosts


def test_every_exit_status_and_reason_is_in_the_table():
    table = README[README.index("Exit statuses:"):README.index("### The live dashboard")]
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert {"0", "2", "10", "20", "30", "70", "74", "255", "128+N",
            "the root cause's status"} <= rows
    from poprun.result import LaunchResult

    reasons = re.findall(r'"(\w+)"', LaunchResult.exit_reason.fget.__doc__)
    assert reasons and all(f"`{reason}`" in table for reason in reasons), reasons


def test_the_variables_forward_env_all_keeps_back_are_listed():
    assert all(f"`{name}`" in README for name in NOT_FORWARDED)
