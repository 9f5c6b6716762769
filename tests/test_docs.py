"""The user's guide and the man pages: the guide builds with MkDocs in strict mode (a broken link
or anchor fails it), and `man poprun` / `man poprunctl` are what the option table and poprunctl's
app say (poprun/cli/manpage.py writes them and docs/options.md), render without warnings, and are
found by man beside the bin directory of a venv poprun is installed in.

Without mkdocs (the docs extra) or man, these tests skip; POPRUN_REQUIRE_DOCS=1 (CI) makes them
fail instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from poprun.cli import manpage
from poprun.cli.options import OPTIONS
from requires import skip_or_fail

ROOT = Path(__file__).resolve().parent.parent
REQUIRE = "POPRUN_REQUIRE_DOCS"


def _missing(what: str) -> None:
    skip_or_fail(what, REQUIRE)


def _mkdocs() -> None:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        _missing("mkdocs is not installed (pip install -e '.[docs]')")


def _man() -> str:
    found = shutil.which("man")
    if found is None:
        _missing("man is not installed (apt-get install man-db)")
    return found  # type: ignore[return-value]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(config), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=120)


# --- the guide ---------------------------------------------------------------------------------


def test_the_guide_builds_in_strict_mode(tmp_path):
    _mkdocs()
    built = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    for page in sorted((ROOT / "docs").glob("*.md")):  # every page is in the site
        assert (tmp_path / "site" / page.stem / "index.html").exists() or page.stem == "index"
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize("broken, named", [("[a page](no-such-page.md)", "'no-such-page.md'"),
                                           ("[an anchor](slurm.md#no-such-heading)",
                                            "'#no-such-heading'")])
def test_a_broken_link_fails_the_build(tmp_path, broken, named):
    """What the strict build is for: a copy of the guide with one broken link does not build."""
    _mkdocs()
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as fh:
        fh.write(f"\n{broken}\n")
    built = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0 and named in built.stderr, built.stderr


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages and all(f": {page}" in config for page in pages), pages


# --- the man pages and the option reference ---------------------------------------------------


@pytest.mark.parametrize("relative", list(manpage.FILES))
def test_the_written_pages_are_what_the_option_table_says(relative, tmp_path):
    """Committed, not built: regenerate with `python -m poprun.cli.manpage`."""
    manpage.write(tmp_path)
    assert (ROOT / relative).read_text() == (tmp_path / relative).read_text(), (
        f"{relative} is out of date: run `python -m poprun.cli.manpage`")


def _render(page: Path) -> str:
    done = subprocess.run([_man(), "--warnings", "-l", str(page)], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "MANWIDTH": "200", "MANPAGER": "cat",
                               "LC_ALL": "C.UTF-8"})
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout


def test_man_poprun_renders_every_option():
    text = _render(ROOT / "man" / "poprun.1")
    for opt in OPTIONS:
        assert f"--{opt.long}" in text, opt.long  # `\-` renders as the `-` one types
    words = " ".join(text.split())
    assert "EXIT STATUS" in words and "74 when output could not be written" in words
    assert r"'step (\d+)/(\d+)'" in words  # backslashes survive roff (\e)


def test_man_poprunctl_renders_every_command():
    text = _render(ROOT / "man" / "poprunctl.1")
    for command in ("list", "show JOB", "stacks JOB", "kill JOB", "logs JOB", "reap"):
        assert f"poprunctl {command} [options]" in text, command
    assert "--signal" in text and "--follow" in text and "EXIT STATUS" in text


@pytest.mark.timeout(300)
def test_man_finds_the_pages_of_a_venv_on_path(tmp_path):
    """The README's route, as a user takes it: a fresh venv (`python3 -m venv`, with the pip
    and setuptools the base Python's ensurepip brings: on Python 3.11, setuptools 65.5 and
    no `wheel`, which cannot build a wheel itself), then `pip install .` from the source (not
    editable: an editable install has no data files) puts the pages in the venv's
    share/man/man1, and man-db finds them there from the venv's bin on PATH, with no MANPATH.
    pip builds in an isolated environment with the setuptools pyproject.toml asks for, from
    the index, as the README's test command installs the test extra."""
    man = _man()
    source = tmp_path / "source"  # what the build reads, so that it writes nothing here
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "src", "man"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, source / part, **({"ignore": shutil.ignore_patterns(
            "__pycache__", "*.egg-info")} if copy is shutil.copytree else {}))
    env_dir = tmp_path / "venv"
    # The user's shell, not the tests': nothing of this checkout on the new venv's path.
    user = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME",
                                                             "VIRTUAL_ENV")}
    for command in ([sys.executable, "-m", "venv", str(env_dir)],
                    [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "."]):
        done = subprocess.run(command, cwd=source, env=user, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, (command, done.stderr)
    env = {k: v for k, v in os.environ.items() if k not in ("MANPATH", "MANPAGER")}
    env["PATH"] = f"{env_dir / 'bin'}:/usr/local/bin:/usr/bin:/bin"
    found = subprocess.run([man, "-w", "poprun", "poprunctl"], capture_output=True, text=True,
                           timeout=60, env=env, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    share = (env_dir / "share" / "man" / "man1").resolve()
    assert [Path(p).resolve() for p in found.stdout.split()] == [
        share / "poprun.1", share / "poprunctl.1"], found.stdout
    assert (share / "poprun.1").read_text() == (ROOT / "man" / "poprun.1").read_text()
