"""Remote environments are not a surprise: PopRun's `-x` semantics, plus
glob patterns (`-x 'WANDB_*'`) and `--forward-env all` (every variable but the host- and
session-specific ones, popdist.env.NOT_FORWARDED); `--check` lists the variables a remote
instance would lack or see with another value.

The plan is pure, so what reaches a remote instance is checked there; one end-to-end run per
feature against real sshd hosts (tests/sshd_hosts.py) shows it arrives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, poprun_argv, poprun_env, run_poprun
from popdist import env as E
from poprun import ConfigError, LaunchConfig
from poprun.cli import options as cli
from poprun.plan.planner import forwarded, plan, remote_differences

PY = sys.executable
ENVIRON = {"PATH": "/bin", "HOME": "/home/me", "HOSTNAME": "here", "SSH_AUTH_SOCK": "/tmp/a",
           "WANDB_PROJECT": "p", "WANDB_KEY": "k", "HF_HOME": "/hf", "SLURM_PROCID": "0",
           "POPRUN_LIFELINE": "tok", "IPUOF_CONFIG_PATH": "/x", "LANG": "C.UTF-8",
           "CUDA_VISIBLE_DEVICES": "0"}


def remote_env(**kw) -> dict[str, str]:
    config = LaunchConfig(program=("p",), num_instances=2, num_replicas=2,
                          hosts=("here-too", "far"), **kw)
    launch_plan = plan(config, ENVIRON, program=("p",), master_port=1,
                       hosts=("localhost", "far"), remote_hosts=frozenset({"far"}))
    local, remote = launch_plan.instances
    if not config.env_entries(0):  # local instances inherit everything: nothing added
        assert not set(local.env) & {"WANDB_PROJECT", "HF_HOME", "PATH"}
    return remote.env


class TestPlan:
    def test_by_default_only_the_documented_variables_and_x(self):
        env = remote_env(env=("LANG",))
        assert env["PATH"] == "/bin" and env["LANG"] == "C.UTF-8"
        assert not set(env) & {"WANDB_PROJECT", "HF_HOME", "HOME"}

    def test_a_pattern_forwards_every_match(self):
        env = remote_env(env=("WANDB_*",))
        assert (env["WANDB_PROJECT"], env["WANDB_KEY"]) == ("p", "k")
        assert "HF_HOME" not in env

    def test_patterns_in_mpi_args_too(self):
        env = remote_env(mpi_local_args=("-x 'HF_*' -x WANDB_?EY",))
        assert env["HF_HOME"] == "/hf" and env["WANDB_KEY"] == "k"
        assert "WANDB_PROJECT" not in env

    def test_a_pattern_that_matches_nothing_warns(self):
        config = LaunchConfig(program=("p",), env=("NOPE_*",))
        launch_plan = plan(config, ENVIRON, program=("p",), master_port=1)
        assert launch_plan.warnings == (
            "-x NOPE_*: no variable of poprun's environment matches it",)

    def test_all_forwards_everything_but_the_host_and_session_names(self):
        env = remote_env(forward_env="all")
        assert {"WANDB_PROJECT", "WANDB_KEY", "HF_HOME", "LANG", "PATH"} <= set(env)
        assert not set(env) & {"HOME", "HOSTNAME", "SSH_AUTH_SOCK", "SLURM_PROCID",
                               "POPRUN_LIFELINE", "IPUOF_CONFIG_PATH",
                               "CUDA_VISIBLE_DEVICES"}

    def test_x_still_forwards_a_denied_name(self):
        assert remote_env(forward_env="all", env=("CUDA_VISIBLE_DEVICES",))[
            "CUDA_VISIBLE_DEVICES"] == "0"

    def test_the_deny_list_is_in_help(self):
        help_of = next(o.help for o in cli.OPTIONS if o.long == "forward-env")
        assert all(name in help_of for name in E.NOT_FORWARDED)

    @pytest.mark.parametrize("entry", ["WANDB_*", "HF_[A-Z]*", "A?"])
    def test_patterns_are_valid_entries(self, entry):
        LaunchConfig(program=("p",), env=(entry,))

    @pytest.mark.parametrize("entry", ["W*=1", "a b*", ""])
    def test_a_pattern_cannot_set(self, entry):
        with pytest.raises(ConfigError, match="is not VAR, VAR=VALUE or a pattern"):
            LaunchConfig(program=("p",), env=(entry,))

    def test_an_unknown_mode_is_a_usage_error(self):
        assert_usage_error(run_poprun(*OFFLINE, "--forward-env", "most", PY, timeout=30),
                           "--forward-env must be one of default, all", stdout_empty=True)

    def test_remote_differences(self):
        there = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "HOME": "/home/other"}
        config = LaunchConfig(program=("p",))
        missing, different = remote_differences(config, ENVIRON, there)
        assert "WANDB_PROJECT" in missing and "HF_HOME" in missing
        assert different == []  # PATH is forwarded; HOME is host-specific, not compared
        assert not set(missing) & {"HOME", "HOSTNAME", "PATH", "LANG"}
        config = LaunchConfig(program=("p",), env=("WANDB_*",))
        missing, _ = remote_differences(config, ENVIRON, {**there, "HF_HOME": "/elsewhere"})
        assert "WANDB_PROJECT" not in missing
        assert remote_differences(config, ENVIRON, {**there, "HF_HOME": "/elsewhere"})[1] == [
            "HF_HOME"]
        assert remote_differences(LaunchConfig(program=("p",), forward_env="all"), ENVIRON,
                                  there) == ([], [])


def test_forwarded_default_is_the_documented_list():
    assert set(forwarded(ENVIRON)) == {"PATH"}


# --- against real sshd hosts ------------------------------------------------------------------

REPORT = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
          "('WANDB_PROJECT', 'HF_HOME', 'HOSTNAME_HERE')}))")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    from sshd_hosts import start_ssh_hosts

    with start_ssh_hosts(2, tmp_path_factory.mktemp("fwd")) as h:
        yield h


def run(hosts, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    extra = {"WANDB_PROJECT": "proj", "HF_HOME": "/hf-home", "HOSTNAME_HERE": "x"}
    return subprocess.run(poprun_argv(*OFFLINE, *args), env=poprun_env({**hosts.env(), **extra}),
                          cwd=cwd, capture_output=True, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,expected", [
    ((), {"WANDB_PROJECT": None, "HF_HOME": None}),
    (("-x", "WANDB_*"), {"WANDB_PROJECT": "proj", "HF_HOME": None}),
    (("--forward-env", "all"), {"WANDB_PROJECT": "proj", "HF_HOME": "/hf-home"}),
], ids=["default", "pattern", "all"])
def test_what_reaches_remote_instances(hosts, tmp_path, args, expected):
    proc = run(hosts, "-H", "h1,h2", "--num-instances=2", "--num-replicas=2", *args, PY, "-c",
               REPORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    for line in proc.stdout.splitlines():
        seen = json.loads(line)
        assert {k: seen[k] for k in expected} == expected


@pytest.mark.timeout(120)
def test_check_lists_the_variables_that_differ(hosts, tmp_path):
    proc = run(hosts, "--check", "-H", "h1,h2", cwd=tmp_path)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()  # a difference is not a failure
    (line,) = [line for line in out.splitlines() if "differ in instances there" in line]
    assert line.startswith("h[1-2]: ")
    missing = line.partition("missing there: ")[2].partition(";")[0].partition(")")[0]
    assert {"WANDB_PROJECT", "HF_HOME", "HOSTNAME_HERE"} <= set(missing.split(", ")), line
    assert "PATH" not in missing.split(", ")  # forwarded
    assert "--forward-env all" in line
    proc = run(hosts, "--check", "-H", "h1,h2", "--forward-env=all", cwd=tmp_path)
    assert "differ in instances there" not in proc.stdout.decode(), proc.stdout.decode()
