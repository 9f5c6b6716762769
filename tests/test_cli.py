"""The `poprun` command line: Boost-style parsing, usage errors, --help/--version, dry runs.

Parsing is tested in-process through `poprun.cli.options.parse_args` / `build_config`; whatever depends
on the real command (exit status, stderr, "no traceback", what a dry run does not do) runs
`python -m poprun` in a subprocess through conftest's `run_poprun`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, assert_usage_error, run_poprun
from poprun import ConfigError, __version__
from poprun.cli import options as cli
from poprun.cli.help import help_text
from poprun.plan.config import LaunchConfig
from poprun.plan.hosts import Host

# A program that exists everywhere the suite runs and is not a boolean word (`true` is one:
# `--offline-mode true` would take it as the option's value).
PY = sys.executable
SINGLE_WARNING = ("Using --num-instances=1 and --num-replicas=1 together is not supported and "
                  "might give additional overhead and/or raise other issues.")


def parse(*argv: str) -> cli.Parsed:
    return cli.parse_args(list(argv))


def config(*argv: str) -> LaunchConfig:
    return cli.build_config(cli.parse_args(list(argv)))


def dry_run_json(*args: str, env: dict[str, str] | None = None, cwd=None) -> dict:
    proc = run_poprun(*OFFLINE, "--dry-run", "--json", *args, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


# --- Boost-style values -------------------------------------------------------------------


class TestValues:
    def test_equals_and_separate_value_are_the_same(self):
        a = parse("--num-instances=4", "--num-replicas=8", "--executable-cache-path=/c", "prog")
        b = parse("--num-instances", "4", "--num-replicas", "8", "--executable-cache-path", "/c",
                  "prog")
        assert a.values == b.values == {"num_instances": 4, "num_replicas": 8,
                                        "executable_cache_path": "/c"}
        assert a.program == b.program == ["prog"]

    def test_string_option_is_a_string_not_a_list(self):
        values = parse("--executable-cache-path=/c", "--output-filename", "out",
                       "--export-config=f.toml", "prog").values
        assert values["executable_cache_path"] == "/c"
        assert values["output_filename"] == "out"
        assert values["export_config"] == "f.toml"

    def test_empty_value_after_equals(self):
        assert parse("--executable-cache-path=", "prog").values["executable_cache_path"] == ""
        assert config("--executable-cache-path=", "prog").executable_cache_path == ""

    def test_value_that_looks_like_an_option(self):
        values = parse("--output-filename", "--weird-dir", "prog").values
        assert values["output_filename"] == "--weird-dir"

    def test_float_option(self):
        assert parse("--kill-timeout=2.5", "prog").values["kill_timeout"] == 2.5
        assert parse("--kill-timeout", "3", "prog").values["kill_timeout"] == 3.0

    @pytest.mark.parametrize("word,expected", [
        ("yes", True), ("no", False), ("true", True), ("false", False), ("on", True),
        ("off", False), ("1", True), ("0", False), ("YES", True), ("No", False),
        ("TRUE", True), ("False", False), ("On", True), ("OFF", False),
    ])
    def test_bool_words_inline(self, word, expected):
        assert parse(f"--offline-mode={word}", "prog").values["offline_mode"] is expected

    @pytest.mark.parametrize("word,expected", [
        ("yes", True), ("no", False), ("True", True), ("off", False), ("1", True), ("0", False),
    ])
    def test_bool_words_as_next_token(self, word, expected):
        parsed = parse("--numa-aware", word, "prog")  # real scripts: `--numa-aware 1`
        assert parsed.values["numa_aware"] is expected
        assert parsed.program == ["prog"]

    @pytest.mark.parametrize("switch", ["--dry-run", "--json", "--check", "--no-dashboard",
                                        "--dashboard", "--overwrite-config", "--tag-output",
                                        "--timestamp-output", "--merge-stderr-to-stdout",
                                        "--report-bindings"])
    def test_our_switches_never_take_the_next_word(self, switch):
        """A switch never takes the next word: `poprun --dry-run true` once said "no program
        given"."""
        parsed = parse(switch, "true", "yes")
        assert parsed.values[switch[2:].replace("-", "_")] is True
        assert parsed.program == ["true", "yes"]
        assert parse(f"{switch}=no", "prog").values[switch[2:].replace("-", "_")] is False

    def test_switches_and_poprun_booleans_are_marked_in_the_table(self):
        switches = {o.long for o in cli.OPTIONS if o.kind is cli.Kind.SWITCH}
        booleans = {o.long for o in cli.OPTIONS if o.kind is cli.Kind.BOOL}
        assert {"dry-run", "json", "check", "no-dashboard", "dashboard"} <= switches
        # PopRun's own: real scripts write `--numa-aware 1`, `--update-partition yes`
        assert {"numa-aware", "offline-mode", "print-topology", "update-partition",
                "reset-partition", "remove-partition", "distribute-ssh-key"} <= booleans

    def test_dry_run_true_runs_true(self, poprun):
        proc = poprun(*OFFLINE, "--dry-run", "true", timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        assert re.search(rb"argv: \S*true\n", proc.stdout), proc.stdout

    def test_a_newline_in_a_value_does_not_split_the_error_line(self, poprun):
        for args, fragment in ((["--num-instances=2\n3", PY], "'2\\n3'"),
                               (["--bogus\nline", PY], "'--bogus\\nline'"),
                               (["--host-file", "/no/such\nfile", PY], "/no/such\\nfile")):
            assert_usage_error(poprun(*args, timeout=30), fragment)

    def test_bare_bool_flag_means_yes(self):
        parsed = parse("--print-topology", "--offline-mode", "prog", "no")
        assert parsed.values == {"print_topology": True, "offline_mode": True}
        assert parsed.program == ["prog", "no"]

    def test_bool_takes_a_following_bool_word_as_its_value(self):
        parsed = parse("--offline-mode", "true")
        assert parsed.values["offline_mode"] is True
        assert parsed.program == []
        with pytest.raises(ConfigError, match="no program given"):
            cli.build_config(parsed)

    def test_bool_does_not_take_a_non_bool_word(self):
        parsed = parse("--offline-mode", "maybe", "x")
        assert parsed.values["offline_mode"] is True
        assert parsed.program == ["maybe", "x"]

    def test_a_single_valued_option_given_twice_is_an_error_as_in_boost(self):
        # Boost.Program_options refuses it; real scripts that do it (an upstream typo giving
        # --vipu-server-host the partition name) would otherwise run with a silently wrong value.
        for argv in (("--num-instances=2", "--num-instances=4"), ("--offline-mode=no",
                                                                   "--offline-mode")):
            with pytest.raises(ConfigError, match="cannot be specified more than once"):
                parse(*argv, "prog")

    def test_given_records_the_options_on_the_command_line(self):
        assert parse("--num-inst=2", "-v", "--tag-output", "prog").given == {
            "num_instances", "verbose", "tag_output"}


class TestVerbosity:
    @pytest.mark.parametrize("argv,count", [
        (["-v"], 1), (["-vv"], 2), (["-vvv"], 3), (["--vv"], 2), (["--verbose"], 1),
        (["-v", "-v"], 2), (["-v", "-vv", "--vv", "--verbose"], 6), ([], None),
    ])
    def test_counts(self, argv, count):
        assert parse(*argv, "prog").values.get("verbose") == count

    def test_verbosity_reaches_the_config(self):
        assert config("-vv", "prog").verbose == 2
        assert config("prog").verbose == 0

    @pytest.mark.parametrize("tok", ["-vx", "--verbose=3", "-v3"])
    def test_count_takes_no_value(self, tok):
        with pytest.raises(ConfigError, match="takes no value"):
            parse(tok, "prog")


class TestPrefixes:
    def test_unambiguous_prefix(self):
        assert parse("--num-instance", "4", "prog").values == {"num_instances": 4}
        assert parse("--num-inst=4", "prog").values == {"num_instances": 4}
        assert parse("--offline-m", "prog").values == {"offline_mode": True}
        assert parse("--only", "1", "prog").values == {"only_output_from_instance": 1}
        assert parse("--exec=/c", "prog").values == {"executable_cache_path": "/c"}

    def test_exact_name_wins_over_longer_names_it_prefixes(self):
        # `--vv` is exact; `--env` is exact though --executable-cache-path/--export-config
        # also start with "e".
        assert parse("--vv", "prog").values == {"verbose": 2}
        assert parse("--env", "A=1", "prog").values == {"env": ["A=1"]}

    def test_ambiguous_prefix_lists_the_candidates(self):
        with pytest.raises(ConfigError) as info:
            parse("--num", "4", "prog")
        message = str(info.value)
        assert "'--num' is ambiguous" in message
        for candidate in ("--num-instances", "--num-replicas", "--num-ilds"):
            assert candidate in message
        assert "--ipus-per-replica" not in message

    def test_prefix_error_names_the_full_option(self):
        with pytest.raises(ConfigError, match="'--num-instances' needs a value"):
            parse("--num-inst")


class TestRepeatedLists:
    def test_mpi_args_and_env_accumulate_in_order(self):
        values = parse(
            "--mpi-global-args=--tag-output", "--mpi-global-args", "-x A=1",
            "--mpi-local-args=-x B", "--mpi-local-args", "--timestamp-output",
            "-x", "C=3", "-xD", "--env=E", "--env", "F=6",
            "--instance-mpi-local-args=0:-x G=1", "--instance-mpi-local-args", "1:-x H=2",
            "prog").values
        assert values["mpi_global_args"] == ["--tag-output", "-x A=1"]
        assert values["mpi_local_args"] == ["-x B", "--timestamp-output"]
        assert values["env"] == ["C=3", "D", "E", "F=6"]
        assert values["instance_mpi_local_args"] == ["0:-x G=1", "1:-x H=2"]

    def test_lists_become_tuples_in_the_config(self):
        cfg = config("--num-instances=2", "--num-replicas=2", "--mpi-global-args=-x A=1",
                     "--mpi-global-args=--tag-output", "-x", "B=2", "prog", "arg")
        assert cfg.mpi_global_args == ("-x A=1", "--tag-output")
        assert cfg.env == ("B=2",)
        assert cfg.program == ("prog", "arg")
        assert cfg.effective_tag_output is True
        assert cfg.env_entries(0) == ("B=2", "A=1")


class TestProgramBoundary:
    def test_everything_after_the_program_is_untouched(self):
        parsed = parse("--num-instances=2", "prog", "--help", "-v", "--num-instances", "5",
                       "--version", "--", "-x", "A", "--num")
        assert parsed.program == ["prog", "--help", "-v", "--num-instances", "5", "--version",
                                  "--", "-x", "A", "--num"]
        assert parsed.values == {"num_instances": 2}
        assert parsed.action is None

    def test_double_dash_ends_the_options(self):
        parsed = parse("-v", "--", "--looks-like-an-option", "--help")
        assert parsed.program == ["--looks-like-an-option", "--help"]
        assert parsed.values == {"verbose": 1}
        assert parsed.action is None

    def test_only_the_first_double_dash_is_poprun_s(self):
        assert parse("--", "prog", "--", "x").program == ["prog", "--", "x"]

    def test_lone_dash_is_a_program(self):
        assert parse("-").program == ["-"]

    def test_help_and_version_before_the_program_are_actions(self):
        assert parse("--num-instances=2", "--help", "prog").action == "help"
        assert parse("--version").action == "version"
        assert parse("--he").action == "help"  # a prefix, like any option
        assert parse("-h", "prog").action == "help"
        assert parse("prog", "-h").action is None

    def test_an_action_keeps_its_inline_value(self):
        parsed = parse("--show-completion=zsh")
        assert (parsed.action, parsed.values, parsed.program) == (
            "show-completion", {"show_completion": "zsh"}, [])
        assert parse("--show-completion", "zsh").program == ["zsh"]


# --- usage errors from the real command ---------------------------------------------------


USAGE_ERRORS = {
    "replicas not divisible": (
        ["--num-instances=3", "--num-replicas=8", PY],
        ["--num-replicas=8", "not divisible", "--num-instances=3"]),
    "zero instances": (["--num-instances=0", PY], ["--num-instances", "positive", "0"]),
    "negative replicas": (["--num-replicas", "-4", PY], ["--num-replicas", "positive", "-4"]),
    "zero ipus per replica": (["--ipus-per-replica=0", PY], ["--ipus-per-replica"]),
    "zero ilds": (["--num-ilds=0", PY], ["--num-ilds"]),
    "replicas not divisible by ilds": (
        ["--num-replicas=3", "--num-ilds=2", "--num-instances=1", PY], ["--num-ilds=2"]),
    "unknown option": (["--no-such-option", PY], ["unrecognised option '--no-such-option'"]),
    "unknown option with value": (["--bogus=3", PY], ["'--bogus'"]),
    "unknown short option": (["-q", PY], ["unrecognised option '-q'"]),
    "ambiguous prefix": (["--num", "2", PY],
                         ["ambiguous", "--num-instances", "--num-replicas", "--num-ilds"]),
    "missing program": ([], ["no program given"]),
    "only a double dash": (["--"], ["no program given"]),
    "bool swallowed the program": (["--print-topology", "true"], ["no program given"]),
    "program not found": (["no-such-program-for-poprun-tests", "arg"],
                          ["'no-such-program-for-poprun-tests'", "not found"]),
    "program path not found": (["./no/such/prog"], ["'./no/such/prog'", "not found"]),
    "export with import": (["--export-config=a.toml", "--import-config=b.toml", PY],
                           ["--export-config", "--import-config", "cannot be used together"]),
    "bad bool": (["--tag-output=maybe", PY], ["--tag-output", "'maybe'", "not a boolean"]),
    "bad int": (["--num-instances=two", PY], ["--num-instances", "integer", "'two'"]),
    "bad float": (["--kill-timeout=soon", PY], ["--kill-timeout", "'soon'"]),
    "negative kill timeout": (["--kill-timeout=-1", PY], ["--kill-timeout", "negative"]),
    "missing value": (["--num-instances"], ["'--num-instances' needs a value"]),
    "missing value of short option": (["-x"], ["'--env' needs a value"]),
    "count with value": (["--verbose=2", PY], ["'--verbose=2' takes no value"]),
    "only-output-from-instance too big": (
        ["--num-instances=2", "--num-replicas=2", "--only-output-from-instance=2", PY],
        ["--only-output-from-instance=2", "0..1"]),
    "only-output-from-instance negative": (
        ["--only-output-from-instance", "-1", PY], ["--only-output-from-instance=-1"]),
    "instance args name a missing instance": (
        ["--num-instances=2", "--num-replicas=2", "--instance-mpi-local-args=2:-x A=1", PY],
        ["--instance-mpi-local-args", "instance 2", "only 2"]),
    "instance args without index": (
        ["--instance-mpi-local-args=-x A=1", PY],
        ["--instance-mpi-local-args", "'<instance index>:<args>'", "'-x A=1'"]),
    "instance args with a bad index": (
        ["--instance-mpi-local-args=one:-x A=1", PY], ["'one:-x A=1'"]),
    "instance args with a bad token": (
        ["--num-instances=2", "--num-replicas=2", "--instance-mpi-local-args=1:--frobnicate",
         PY], ["--instance-mpi-local-args=1:--frobnicate", "'--frobnicate'"]),
    "unsupported mpirun token": (["--mpi-global-args=--foo", PY],
                                 ["--mpi-global-args", "unsupported mpirun argument '--foo'"]),
    "unsupported local mpirun token": (
        ["--mpi-local-args", "-x A=1 --hostfile h", PY], ["--mpi-local-args", "'--hostfile'"]),
    "unbalanced quote in mpi args": (["--mpi-global-args=-x 'A=1", PY],
                                     ["--mpi-global-args", "cannot split"]),
    "bad env name": (["-x", "1BAD=2", PY], ["'1BAD=2'", "VAR=VALUE"]),
    "bad env name in mpi args": (["--mpi-global-args=-x A-B=1", PY], ["-x", "'A-B=1'"]),
    "instances not divisible by hosts": (
        ["-H", "h[1-2],h3", "--num-instances=4", "--num-replicas=4", PY],
        ["--num-instances=4", "3 hosts"]),
    "duplicate host": (["--host", "h1,h[1-2]", "--num-instances=3", "--num-replicas=3", PY],
                       ["--host", "h1", "twice"]),
    "duplicate host across repeats": (["-H", "h1", "-H", "h1", PY], ["h1", "twice"]),
    "bad host range": (["--host=pod[4-1]", PY], ["--host", "'4-1'", "backwards"]),
    "host and host file": (["-H", "h1", "--host-file", "/dev/null", PY],
                           ["--host and --host-file"]),
    "missing host file": (["--host-file", "/no/such/file", PY],
                          ["--host-file", "/no/such/file", "No such file"]),
    "host file not a file": (["--host-file", "/dev/null", PY],
                             ["--host-file", "not a regular file"]),
    "zero ssh fanout": (["--ssh-fanout=0", PY], ["--ssh-fanout", "positive"]),
    "zero ssh timeout": (["--ssh-timeout=0", PY], ["--ssh-timeout", "positive"]),
    # Heartbeats every 0.7 s: a loaded host's pause would pass for its loss.
    "host timeout under 2 s": (["--host-timeout=1.5", PY], ["--host-timeout", "at least 2 s"]),
    "repeated single-valued option": (["--num-replicas=2", "--num-replicas=4", PY],
                                      ["'--num-replicas' cannot be specified more than once"]),
    "bad key type": (["--distribute-ssh-key-type=rsa4096", PY],
                     ["--distribute-ssh-key-type='rsa4096'", "ed25519"]),
}


@pytest.mark.parametrize("args,fragments", USAGE_ERRORS.values(), ids=USAGE_ERRORS.keys())
def test_usage_error_is_one_line_and_status_2(args, fragments, tmp_path):
    proc = run_poprun(*OFFLINE, *args, cwd=tmp_path, timeout=30)
    assert_usage_error(proc, *fragments)


def test_program_without_execute_permission(poprun, tmp_path):
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho should-not-run\n")
    script.chmod(0o644)
    for spelling in ("./not-executable.sh", "not-executable.sh", str(script)):
        proc = poprun(*OFFLINE, spelling, cwd=tmp_path, timeout=30)
        assert_usage_error(proc, repr(spelling), "not executable")


class TestMessagesThatSayWhatToDo:
    """Messages that say what to do: the closest option, where a misplaced option goes, how
    to run a script, what a default is, which file and key are wrong."""

    def test_an_unknown_option_suggests_the_closest(self, poprun):
        proc = poprun("--num-instnaces", "2", PY, timeout=30)
        assert_usage_error(proc, "unrecognised option '--num-instnaces'",
                           "did you mean --num-instances?")
        assert "did you mean" not in assert_usage_error(poprun("--frobnicate", PY, timeout=30))

    def test_a_poprun_option_after_the_program_is_hinted(self, poprun, tmp_path):
        proc = poprun(*OFFLINE, "--dry-run", PY, "train.py", "--num-instances", "2",
                      "--config=x", cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stderr.decode() == (
            f"poprun: warning: --num-instances after the program ({PY}) goes to the program, "
            "not to poprun: poprun's options come before the program\n")
        for quiet in ((*OFFLINE, "--dry-run", "--", PY, "--num-instances", "2"),  # meant so
                      (*OFFLINE, "--dry-run", "--num-replicas=2", PY, "--num-replicas", "4"),
                      (*OFFLINE, "--dry-run", PY, "--help", "--verbose", "--host", "h")):
            assert poprun(*quiet, cwd=tmp_path, timeout=30).stderr == b"", quiet

    def test_an_existing_script_without_execute_permission_says_how_to_run_it(self, poprun,
                                                                            tmp_path):
        (tmp_path / "train.py").write_text("print('hi')\n")
        for spelling in ("./train.py", "train.py"):
            proc = poprun(*OFFLINE, spelling, cwd=tmp_path, timeout=30)
            assert_usage_error(proc, f"program '{spelling}' exists but is not executable",
                               f"python3 {spelling}", f"chmod +x {spelling}")

    def test_instances_alone_say_that_replicas_default_to_1(self, poprun):
        proc = poprun(*OFFLINE, "--num-instances", "2", PY, timeout=30)
        assert_usage_error(proc, "--num-instances=2 needs --num-replicas", "defaults to 1",
                           "--num-replicas=2")

    def test_the_single_instance_warning_needs_one_of_the_two(self, poprun):
        """Given neither: no warning (PopRun's warning is about an explicit choice)."""
        proc = poprun(*OFFLINE, "true", timeout=60)
        assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()
        proc = poprun(*OFFLINE, "--num-replicas=1", "true", timeout=60)
        assert proc.stderr.decode().count(SINGLE_WARNING) == 1

    @pytest.mark.parametrize("content,key,fragment", [
        ('program = ["x"]\nnum-instances = "2"\n', "num-instances", "positive integer"),
        ('program = ["x"]\nkill-timeout = "x"\n', "kill-timeout", "a number of seconds"),
        ('program = "x y"\n', "program", "sequence of strings"),
        ('program = ["x"]\nnum-instances = 2\n', "num-instances", "defaults to 1"),
        ('program = ["x"]\nenv = ["1BAD"]\n', "env", "is not VAR, VAR=VALUE or a pattern"),
    ])
    def test_import_config_errors_name_the_file_and_key(self, poprun, tmp_path, content, key,
                                                        fragment):
        conf = tmp_path / "job.toml"
        conf.write_text(content)
        proc = poprun(*OFFLINE, "--import-config", str(conf), "--dry-run", cwd=tmp_path,
                      timeout=30)
        assert_usage_error(proc, f"--import-config {conf}: key '{key}': ", fragment)

    def test_import_config_without_a_program_says_so(self, poprun, tmp_path):
        conf = tmp_path / "job.toml"
        conf.write_text("num-replicas = 2\n")
        proc = poprun(*OFFLINE, "--import-config", str(conf), cwd=tmp_path, timeout=30)
        assert_usage_error(proc, "no program given", f"nor in --import-config {conf}")

    @pytest.mark.parametrize("args,warning", [
        (["--json"], "--json only changes what --dry-run prints"),
        (["--distribute-ssh-key-type=ed25519"],
         "--distribute-ssh-key-type has no effect without --distribute-ssh-key"),
        (["--distribute-ssh-key-path=/k"],
         "--distribute-ssh-key-path has no effect without --distribute-ssh-key"),
    ])
    def test_options_without_the_option_they_modify_warn(self, poprun, args, warning):
        proc = poprun(*OFFLINE, *args, "true", timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stderr.decode() == f"poprun: warning: {warning}" + (
            ": without --dry-run it is ignored\n" if "json" in warning else "\n")

    def test_counts_from_slurm_say_where_they_came_from(self, poprun):
        env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "3",
               "SLURM_TASKS_PER_NODE": ""}
        proc = poprun(*OFFLINE, "--dry-run", PY, env=env, timeout=30)
        assert_usage_error(proc, "counted from SLURM_NTASKS=3", "defaults to 1")
        proc = poprun(*OFFLINE, "--dry-run", "--num-instances=3", "--num-replicas=3", PY,
                      env=env, timeout=30)
        assert_usage_error(proc, "the Slurm allocation (SLURM_JOB_NODELIST=n[1-2])")


def test_framework_cache_conflict_names_both(poprun, tmp_path):
    proc = poprun(*OFFLINE, "--executable-cache-path=/x", PY, cwd=tmp_path, timeout=30,
                  env={"POPTORCH_CACHE_DIR": "/torch-cache"})
    assert_usage_error(proc, "--executable-cache-path=/x", "POPTORCH_CACHE_DIR=/torch-cache")


def test_error_before_program_is_reported_even_with_help_after_program(poprun, tmp_path):
    # `--help` after the program is the program's: the usage error still applies.
    proc = poprun(*OFFLINE, "--num-instances=3", "--num-replicas=4", PY, "--help",
                  cwd=tmp_path, timeout=30)
    assert_usage_error(proc, "not divisible")


# --- --help, --version --------------------------------------------------------------------


class TestHelpVersion:
    def test_help_lists_every_option(self, poprun):
        proc = poprun("--help", timeout=30)
        assert proc.returncode == 0
        assert proc.stderr == b""
        out = proc.stdout.decode()  # typer's layout (tests/test_help.py checks it closely)
        assert out.lstrip().startswith("Usage: poprun [options] program [program args]\n")
        for opt in cli.OPTIONS:
            assert f"--{opt.long}" in out, opt.long
            if opt.short:
                assert re.search(rf"--{opt.long}\s+-{opt.short}\s", out), opt.long
        # the value placeholder of each kind (regression: STR options once parsed as lists)
        assert re.search(r"--num-instances\s+INT\s", out)
        assert re.search(r"--kill-timeout\s+SECONDS\s", out)
        assert re.search(r"--executable-cache-path\s+ARG\s", out)
        assert re.search(r"--offline-mode\s+BOOL\s", out)

    def test_help_wins_over_an_invalid_configuration(self, poprun):
        proc = poprun("--num-instances=3", "--num-replicas=4", "--help", timeout=30)
        assert proc.returncode == 0
        assert b"--num-instances" in proc.stdout
        assert proc.stderr == b""

    def test_version(self, poprun):
        proc = poprun("--version", timeout=30)
        assert proc.returncode == 0
        assert proc.stdout.decode() == f"poprun {__version__}\n"
        assert proc.stderr == b""

    def test_help_text_matches_the_in_process_rendering(self, poprun):
        out = poprun("--help", timeout=30, env={"COLUMNS": "100"}).stdout.decode()
        assert out == help_text(100)


# --- real short runs ----------------------------------------------------------------------


class TestShortRuns:
    def test_single_instance_single_replica_warns(self, poprun):
        proc = poprun(*OFFLINE, "--num-instances=1", "--num-replicas=1", "true", timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout == b""
        err = proc.stderr.decode()
        assert err.count(SINGLE_WARNING) == 1
        warning_line = next(line for line in err.splitlines() if SINGLE_WARNING in line)
        assert warning_line.endswith("POPRUN [W] " + SINGLE_WARNING)

    def test_no_warning_with_more_replicas(self, poprun):
        proc = poprun(*OFFLINE, "--num-instances=1", "--num-replicas=2", "true", timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert b"not supported" not in proc.stderr

    def test_program_in_current_directory_runs_without_dot_slash(self, poprun, tmp_path):
        script = tmp_path / "my-local-prog"
        script.write_text('#!/bin/sh\necho "local-marker-7f3a $*"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                               if p not in ("", ".", str(tmp_path)))
        proc = poprun(*OFFLINE, "--num-replicas=2", "my-local-prog", "a b", cwd=tmp_path,
                      env={"PATH": path}, timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout.decode() == "local-marker-7f3a a b\n"

    def test_ignored_mpirun_args_are_mentioned_once_at_v(self, poprun):
        args = (*OFFLINE, "--num-replicas=2",
                "--mpi-global-args=--allow-run-as-root --mca btl openib", "true")
        quiet = poprun(*args, timeout=60)
        assert quiet.returncode == 0, quiet.stderr.decode()
        assert b"ignoring" not in quiet.stderr
        loud = poprun("-v", *args, timeout=60)
        assert loud.returncode == 0, loud.stderr.decode()
        lines = loud.stderr.decode().splitlines()
        root = [line for line in lines if "ignoring mpirun argument '--allow-run-as-root'" in line]
        mca = [line for line in lines
               if "ignoring mpirun argument '--mca btl openib'" in line]
        assert len(root) == 1 and len(mca) == 1, lines


# --- dry run ------------------------------------------------------------------------------


class TestDryRun:
    def test_dry_run_starts_nothing_and_creates_nothing(self, poprun, tmp_path):
        work = tmp_path / "work"
        work.mkdir()
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        cache = work / "explicit-cache"
        for extra in ([], [f"--executable-cache-path={cache}"]):
            proc = poprun(*OFFLINE, "--dry-run", "--num-instances=2", "--num-replicas=2",
                          *extra, "touch", "marker", cwd=work, env={"TMPDIR": str(tmp)},
                          timeout=30)
            assert proc.returncode == 0, proc.stderr.decode()
            assert "instance 1 on localhost" in proc.stdout.decode()
        assert sorted(os.listdir(work)) == []  # no marker, no explicit cache dir
        assert sorted(os.listdir(tmp)) == []  # no poprun-cache-* temporary dir

    def test_a_real_run_does_use_tmpdir_for_its_temporary_cache(self, poprun, tmp_path):
        # Shows the check above would see a temporary cache dir if a dry run made one.
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        proc = poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "sh", "-c",
                      'echo "$POPDIST_EXECUTABLE_CACHE_PATH"', env={"TMPDIR": str(tmp)},
                      timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        paths = set(proc.stdout.decode().split())
        assert len(paths) == 1
        (path,) = paths
        assert Path(path).parent == tmp and Path(path).name.startswith("poprun-cache-")
        assert os.listdir(tmp) == []  # removed at exit

    def test_dry_run_json_is_one_object_with_the_instances(self, poprun, tmp_path):
        proc = poprun(*OFFLINE, "--dry-run", "--json", "--print-topology", "--num-instances=2",
                      "--num-replicas=4", PY, "-c", "pass", cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        data = json.loads(proc.stdout)  # the whole of stdout: one object, no table
        assert isinstance(data, dict)
        assert [i["index"] for i in data["instances"]] == [0, 1]
        required = {"index", "host", "local_index", "replicas", "env", "argv", "cpus", "mems"}
        for inst, replicas in zip(data["instances"], ([0, 1], [2, 3])):
            # `ild` is the only extra key today
            assert required <= set(inst) and set(inst) - required <= {"ild"}, set(inst)
            assert inst["host"] == "localhost"
            assert inst["local_index"] == inst["index"]
            assert inst["replicas"] == replicas
            assert inst["argv"] == [PY, "-c", "pass"]
            assert isinstance(inst["env"], dict)
            assert inst["env"]["POPDIST_REPLICA_INDEX_OFFSET"] == str(replicas[0])
            # bound by the default spreadnuma placement, to CPUs this process may use
            assert inst["cpus"] and set(inst["cpus"]) <= os.sched_getaffinity(0)

    def test_dry_run_text_shows_topology_and_plan(self, poprun, tmp_path):
        proc = poprun(*OFFLINE, "--dry-run", "--print-topology=yes", "--num-instances=2",
                      "--num-replicas=8", PY, "it's", cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        out = proc.stdout.decode()
        assert out.startswith(" " + "=" * 43 + "\n|              poprun topology              |\n")
        assert "| instances |       0       |       1       |\n" in out
        assert "instance 0 on localhost (local index 0), replicas [0-3], ILD 0\n" in out
        assert "instance 1 on localhost (local index 1), replicas [4-7], ILD 0\n" in out
        assert "  argv: " + shlex.join([PY, "it's"]) + "\n" in out  # shell-quoted
        assert "  env:  POPDIST_NUM_LOCAL_REPLICAS=4\n" in out
        assert "removed from every instance's environment: IPUOF_CONFIG_PATH\n" in out
        assert "executable cache: temporary" in out

    def test_program_args_reach_the_plan_untouched(self, tmp_path):
        data = dry_run_json("--num-replicas=2", PY, "--help", "-v", "--num-instances", "9",
                            "--", "a b", "$HOME", cwd=tmp_path)
        assert [i["argv"] for i in data["instances"]] == [
            [PY, "--help", "-v", "--num-instances", "9", "--", "a b", "$HOME"]]

    def test_double_dash_before_the_program(self, tmp_path):
        data = dry_run_json("--num-replicas=2", "--", PY, "x", cwd=tmp_path)
        assert data["instances"][0]["argv"] == [PY, "x"]

    def test_prefix_and_bool_words_through_the_real_command(self, tmp_path):
        data = dry_run_json("--num-instance", "2", "--num-rep=4", "--print-topology", "off",
                            PY, cwd=tmp_path)
        assert len(data["instances"]) == 2
        assert data["instances"][1]["replicas"] == [2, 3]


def test_hosts_accumulate_and_host_file_fills_them(tmp_path):
    assert config("-H", "a,b[1-2]", "--host=c", "--num-instances=4", "--num-replicas=4",
                  PY).host_list == tuple(map(Host, ("a", "b1", "b2", "c")))
    listing = tmp_path / "hosts"
    listing.write_text("# the pod\nnode[01-02]   # two\n\nssh://alice@node03:2222\n")
    got = config("--host-file", str(listing), "--num-instances=3", "--num-replicas=3", PY)
    assert got.host_list == (Host("node01"), Host("node02"), Host("node03", "alice", 2222))


def test_dry_run_divides_instances_among_hosts_in_contiguous_blocks():
    plan = dry_run_json("-H", "h[1-2]", "--num-instances=4", "--num-replicas=8", PY)
    assert plan["hosts"] == ["h1", "h2"]
    assert [(i["host"], i["local_index"], i["replicas"]) for i in plan["instances"]] == [
        ("h1", 0, [0, 1]), ("h1", 1, [2, 3]), ("h2", 0, [4, 5]), ("h2", 1, [6, 7])]


def test_slurm_nodelist_gives_the_hosts_when_none_are_named():
    env = {"SLURM_JOB_NODELIST": "gc-[001-002]"}
    plan = dry_run_json("--num-instances=2", "--num-replicas=2", PY, env=env)
    assert plan["hosts"] == ["gc-001", "gc-002"]
    plan = dry_run_json("-H", "x", "--num-instances=2", "--num-replicas=2", PY, env=env)
    assert plan["hosts"] == ["x"]


def test_remote_instances_get_the_forwarded_variables_local_ones_inherit_them():
    env = {**os.environ, "PYTHONPATH": "/site", "POPLAR_ENGINE_OPTIONS": '{"a": 1}',
           "UNRELATED": "x"}
    plan = dry_run_json("-H", "localhost,far", "--num-instances=2", "--num-replicas=2", PY,
                        env=env)
    local, remote = (i["env"] for i in plan["instances"])
    assert "PYTHONPATH" not in local  # a local instance inherits the whole environment
    assert remote["PYTHONPATH"] == "/site" and remote["PATH"] == env["PATH"]
    assert remote["POPLAR_ENGINE_OPTIONS"] == '{"a": 1}'
    assert "UNRELATED" not in remote
    # The launcher's address as far's instance reaches it: only a launch knows it.
    assert remote["MASTER_ADDR"] == local["MASTER_ADDR"] == (
        "<localhost's address as the other hosts reach it, known at launch>")


def test_dry_run_shows_the_partition_step_and_the_interface_variables(tmp_path):
    """Without --offline-mode, the plan has the V-IPU step and IPUOF_VIPU_* variables (what
    only the server knows marked as known at launch); a chosen network gives the instances
    their interface variables, as a launch does."""
    args = ("--dry-run", "--vipu-partition=p1", "--num-instances=2", "--num-replicas=2",
            "--host-subnet=127.0.0.0/8")
    text = run_poprun(*args, PY, cwd=tmp_path)
    assert text.returncode == 0, text.stderr.decode()
    out = text.stdout.decode()
    assert "V-IPU partition p1 (2 IPUs, 2 GCDs) on the server <" in out
    assert "  created when missing: vipu create partition p1 --size 2 --num-gcds 2\n" in out
    assert out.count("  env:  IPUOF_VIPU_API_PARTITION_ID=p1\n") == 2
    assert out.count("  env:  GLOO_SOCKET_IFNAME=lo\n") == 2
    plan = json.loads(run_poprun(*args, "--json", PY, cwd=tmp_path).stdout)
    assert plan["partition"]["name"] == "p1" and plan["partition"]["size"] == 2
    for index, inst in enumerate(plan["instances"]):
        env = inst["env"]
        assert env["IPUOF_VIPU_API_HOST"].endswith(", known at launch>")
        assert env["IPUOF_VIPU_API_GCD_ID"] == (
            f"<{index} on a partition of 2 IPUs, 2 GCDs, known at launch>")
        assert env["NCCL_SOCKET_IFNAME"] == "lo"
