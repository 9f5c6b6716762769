"""The README is the landing page: what poprun is, the two commands (install and run the
validation job; install and run the tests, each in a fresh venv), the Python versions really
required, and a link to every page of the guide. The guide (docs/) tells what exists: the
dashboard and how to turn it off or force it, --result-json, --kill-timeout, every exit status
with its exit_reason, the variables --forward-env all keeps back, the mpirun arguments
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
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return (DOCS / name).read_text()


def guide() -> str:
    """Every page of the guide but the generated option reference (which says every option
    by construction: tests/test_docs.py) and the design page."""
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md"))
                     if p.name not in ("options.md", "architecture.md"))


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next heading of that level."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


VALIDATION = ('python3 -m venv venv && . venv/bin/activate && pip install . && '
              'poprun --num-instances 2 --num-replicas 2 --offline-mode=1 echo "Hello world!"')
TESTS = ("python3 -m venv venv-test && . venv-test/bin/activate && pip install -e '.[test]' && "
         "python -m pytest")
FIRST_RUN = "poprun --num-instances 2 --num-replicas 4 --offline-mode=yes python3 examples/hello.py"
SWITCH = re.compile(r"POPRUN_REQUIRE_[A-Z]+")


@pytest.mark.parametrize("command", [VALIDATION, TESTS, FIRST_RUN])
def test_the_readme_gives_the_commands_as_code(command):
    assert f"```sh\n{command}\n```" in README


def test_the_two_set_up_commands_make_venvs_of_their_own_which_git_ignores():
    """The tests' editable install into the first venv once removed its man pages."""
    made = [re.match(r"python3 -m venv (\S+) ", c)[1] for c in (VALIDATION, TESTS)]
    assert len(set(made)) == 2, made
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "venv*/" in ignored and all(re.fullmatch(r"venv.*", name) for name in made)


def test_the_first_program_to_run_is_the_example_it_names():
    assert FIRST_RUN in (ROOT / "examples" / "hello.py").read_text()  # its own usage line
    assert FIRST_RUN in page("install.md")


def test_ci_runs_the_test_command_from_a_clone_named_poprun():
    """.ci/run makes a fresh venv inside a clone whose path holds `poprun` (every instance's
    command line then does: tests/sshd_hosts.py's instance lookup must not care) and runs
    the README's test command there, venv and all."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert TESTS in ci
    assert re.search(r"git clone .* \"?\$\w+/poprun\"?", ci), "no clone named poprun"


def _switches(text: str) -> set[str]:
    return set(SWITCH.findall(text))


def test_every_switch_the_tests_read_is_named_and_ci_says_what_it_does_with_each():
    """Each test switch (tests/requires.py, which tests/test_skips.py checks the tests
    against), no more: in the README and the install page; .ci/run exports only those, and
    names every one (exported, or why not)."""
    from requires import SWITCHES

    read = set(SWITCHES)
    assert len(read) >= 9, read
    assert _switches(README) == read
    assert _switches(page("install.md")) == read
    ci = (ROOT / ".ci" / "run").read_text()
    exported = set(re.findall(r"^export (POPRUN_REQUIRE_[A-Z]+)=1$", ci, re.M))
    assert exported and exported <= read and _switches(ci) == read


def test_the_readme_links_every_page_of_the_guide():
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README))
    assert linked == {p.name for p in DOCS.glob("*.md")}, linked


def test_the_readme_is_a_landing_page():
    """The rest is in the guide: the README stays a page one reads whole."""
    assert len(README.splitlines()) < 120


@pytest.mark.parametrize("name", ["--no-dashboard", "--dashboard", "POPRUN_NO_DASHBOARD",
                                  "--result-json", "--kill-timeout", "--forward-env",
                                  "--timestamp-output", "--export-config", "--import-config",
                                  "--compare-hosts"])
def test_options_people_look_for_are_described(name):
    assert re.search(rf"`{re.escape(name)}[ =`]", guide()), name
    assert name.lstrip("-") in {o.long for o in cli.OPTIONS} or name.isupper()


def test_the_python_versions_are_the_ones_required():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = project["requires-python"].removeprefix(">=")
    assert f"Python ≥ {needed}" in README and f"Python {needed} or later" in README
    assert f"Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or later" in README  # remote hosts
    assert f"Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or later" in page("several-hosts.md")


def test_every_exit_status_and_reason_is_in_the_table():
    table = section(page("troubleshooting.md"), "Exit statuses")
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")}
    assert {"0", "2", "10", "20", "30", "70", "74", "255", "128+N",
            "the root cause's status"} <= rows
    from poprun.result import LaunchResult

    reasons = re.findall(r'"(\w+)"', LaunchResult.exit_reason.fget.__doc__)
    assert reasons and all(f"`{reason}`" in table for reason in reasons), reasons


def test_the_variables_forward_env_all_keeps_back_are_listed():
    text = section(page("several-hosts.md"), "The environment of remote instances")
    assert all(f"`{name}`" in text for name in NOT_FORWARDED)
