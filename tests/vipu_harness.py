"""The `vipu` simulator (tests/vipu_sim/vipu) for one test: first on PATH, with its state
file, invocation log and failure switches. A fake because no V-IPU server can exist here."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from popdist import env as E
from poprun.log import Log

SIM = Path(__file__).resolve().parent / "vipu_sim" / "vipu"


def fitting(**fields) -> dict:
    """A partition that fits JOB."""
    return {"allocation": "alloc1", "cluster": "cluster1", "size": 32, "gcds": 2, "ilds": 2,
            "gw_routing": "DEFAULT", "ild_routing": "DNC", "sync_type": "pod-native-default",
            "reconfigurable": False, "state": "ACTIVE", **fields}


class VipuSim:
    """The simulator's state file, invocation log and failure switches, for one test."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        # A wrapper, so the simulator runs on this interpreter (python3 on PATH may be a slow
        # pyenv shim); `exec` keeps one process, which a timeout kills outright.
        wrapper = bin_dir / "vipu"
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} '
                           f'{shlex.quote(str(SIM))} "$@"\n')
        wrapper.chmod(0o755)
        self.state_path = tmp_path / "vipu-state.json"
        self.log_path = tmp_path / "vipu-calls.jsonl"
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("VIPU_SIM_STATE", str(self.state_path))
        monkeypatch.setenv("VIPU_SIM_LOG", str(self.log_path))
        for name in list(os.environ):
            if name.startswith(("IPUOF_", "VIPU_SIM_")) and name not in (
                    "VIPU_SIM_STATE", "VIPU_SIM_LOG"):
                monkeypatch.delenv(name)
        monkeypatch.delenv(E.POPLAR_TARGET_OPTIONS, raising=False)
        self.write({"server": {"host": "localhost", "port": 8090, "version": "1.18.0"},
                    "allocations": {"alloc1": {"cluster": "cluster1", "ipus": 64},
                                    "alloc2": {"cluster": "cluster2", "ipus": 64}},
                    "partitions": {}})
        self.log_file = open(tmp_path / "poprun.log", "w+")
        self.log = Log(verbosity=2, fd=self.log_file.fileno())

    def write(self, state: dict) -> None:
        self.state_path.write_text(json.dumps(state))

    def state(self) -> dict:
        return json.loads(self.state_path.read_text())

    def partitions(self) -> dict:
        return self.state()["partitions"]

    def add(self, name: str, **fields) -> None:
        state = self.state()
        state["partitions"][name] = fitting(**fields)
        self.write(state)

    def calls(self) -> list[list[str]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]

    def verbs(self) -> list[str]:
        """The command of each call: `list`, `get`, `create`... (`--server-version` too)."""
        commands = ("list", "get", "create", "remove", "reset", "--server-version")
        return [next(word for word in call if word in commands) for call in self.calls()]

    def fail(self, **switches) -> None:
        """`fail(unreachable=1)` sets VIPU_SIM_UNREACHABLE=1, and so on."""
        for name, value in switches.items():
            self.monkeypatch.setenv(f"VIPU_SIM_{name.upper()}", str(value))

    def messages(self) -> str:
        self.log_file.seek(0)
        return self.log_file.read()


@pytest.fixture
def sim(tmp_path, monkeypatch):
    simulator = VipuSim(tmp_path, monkeypatch)
    yield simulator
    simulator.log_file.close()


