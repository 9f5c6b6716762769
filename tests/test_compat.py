"""Real poprun command lines (tests/data/poprun_commands.txt: 76 of them, each with its source in
the file) run through `poprun --dry-run --json`: every valid one is accepted with the plan its
options ask for; the ones that are wrong upstream fail with one clear line, exit 2.

The expected plan is read from the command text here, independently of poprun's parser: the
instance and replica counts, the hosts, and every `-x VAR=VALUE` of the mpi-args.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import assert_usage_error, run_poprun

pytestmark = pytest.mark.timeout(60)
DATA = Path(__file__).resolve().parent / "data" / "poprun_commands.txt"
# Interpreters some scripts name that this machine may not have: stand-ins on PATH.
STAND_INS = ("python3.8", "python3.9", "python3.10")


@dataclass
class Entry:
    line: str
    source: str = ""
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def wrong_upstream(self) -> bool:
        return any(n.startswith("wrong upstream") for n in self.notes)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.line)[1:]


def load() -> list[Entry]:
    entries, pending = [], Entry("")
    for line in DATA.read_text().splitlines():
        if line.startswith("# source:"):
            pending.source = line[len("# source:"):].strip()
        elif line.startswith("# note:"):
            pending.notes.append(line[len("# note:"):].strip())
        elif line.startswith("# env:"):
            name, _, value = line[len("# env:"):].strip().partition("=")
            pending.env[name] = shlex.split(value)[0] if value else ""
        elif line.startswith("poprun"):
            pending.line = line
            entries.append(pending)
            pending = Entry("")
    return entries


ENTRIES = load()


# Valid upstream, refused here on purpose, with the reason.
REFUSED_HERE = {
    "--num-instances=2 --num-ilds=2 --host pod[1-4]":
        "2 instances on 4 hosts: mpirun would leave hosts idle; our hosts each run the same "
        "number of instances, so this is a clear usage error instead",
}


def test_the_collection_is_big_enough():
    assert len({e.line for e in ENTRIES}) >= 40
    assert all(e.source for e in ENTRIES)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bin")
    for name in STAND_INS:
        path = folder / name
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def option_value(argv: list[str], name: str) -> str | None:
    """The last value given to `--name` (either `--name=v` or `--name v`), before the
    program. Good enough for these scripts: they never use prefixes of these names."""
    value = None
    for i, tok in enumerate(argv):
        if tok.startswith(f"--{name}="):
            value = tok.split("=", 1)[1]
        elif tok == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def expected_hosts(argv: list[str]) -> list[str] | None:
    text = option_value(argv, "host")
    if text is None:
        return None
    hosts = []
    for item in text.split(","):
        m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", item)
        hosts += ([f"{m[1]}{n}" for n in range(int(m[2]), int(m[3]) + 1)] if m else [item])
    return hosts


def expected_env(argv: list[str]) -> dict[str, str]:
    """`-x VAR=VALUE` pairs of the global and local mpi-args."""
    out = {}
    for name in ("mpi-global-args", "mpi-local-args"):
        for i, tok in enumerate(argv):
            value = (tok.split("=", 1)[1] if tok.startswith(f"--{name}=") else
                     argv[i + 1] if tok == f"--{name}" and i + 1 < len(argv) else None)
            if value is None:
                continue
            words = shlex.split(value)
            for flag, pair in zip(words, words[1:]):
                if flag == "-x" and "=" in pair:
                    var, _, val = pair.partition("=")
                    out[var] = val
    return out


def refused_here(entry: Entry) -> bool:
    return any(key in entry.line for key in REFUSED_HERE)


VALID = [e for e in ENTRIES if not e.wrong_upstream and not refused_here(e)]
WRONG = [e for e in ENTRIES if e.wrong_upstream or refused_here(e)]


@pytest.fixture
def stored_config(tmp_path):
    """The file the guide's `--import-config training.conf` lines read, written by poprun's
    own --export-config (as the guide's preceding command does)."""
    proc = run_poprun("--export-config", "training.conf", "--num-instances=2",
                      "--num-replicas=8", "--offline-mode=yes", "--dry-run", "python3",
                      "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    return tmp_path / "training.conf"


@pytest.mark.parametrize("entry", VALID, ids=[e.source[:70] for e in VALID])
def test_valid_command_is_accepted_with_its_plan(entry: Entry, stand_ins: Path, tmp_path,
                                                stored_config):
    # A framework cache of the tester's own must not meet the entries' --executable-cache-path.
    env = {"POPTORCH_CACHE_DIR": "", **entry.env,
           "PATH": f"{stand_ins}{os.pathsep}{os.environ['PATH']}"}
    proc = run_poprun("--dry-run", "--json", *entry.argv, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (entry.line, proc.stderr.decode())
    plan = json.loads(proc.stdout)
    argv = entry.argv
    if "--import-config" in argv:  # the stored options count unless the line overrides them
        argv = ["--num-instances=2", "--num-replicas=8"] + argv
    instances = int(option_value(argv, "num-instances") or 1)
    replicas = int(option_value(argv, "num-replicas") or 1)
    assert len(plan["instances"]) == instances
    assert sorted(r for i in plan["instances"] for r in i["replicas"]) == list(range(replicas))
    hosts = expected_hosts(argv)
    if hosts is not None:
        assert plan["hosts"] == hosts
    for inst in plan["instances"]:
        for var, value in expected_env(argv).items():
            assert inst["env"][var] == value, (var, entry.line)


@pytest.mark.parametrize("entry", WRONG, ids=[e.source[:70] for e in WRONG])
def test_command_wrong_upstream_fails_with_one_clear_line(entry: Entry, stand_ins: Path,
                                                          tmp_path):
    env = {**entry.env, "PATH": f"{stand_ins}{os.pathsep}{os.environ['PATH']}"}
    proc = run_poprun("--dry-run", "--json", *entry.argv, env=env, cwd=tmp_path)
    if proc.returncode == 0:
        # Only remote hosts: the program is looked up there, at launch, so a dry run cannot
        # refuse it. It must then be one that no host can run.
        plan = json.loads(proc.stdout)
        assert "localhost" not in plan["hosts"], entry.line
        program = plan["instances"][0]["argv"][0]
        assert shutil.which(program) is None, (program, entry.line)
        return
    assert_usage_error(proc)
