"""LaunchConfig validation, reading mpirun arguments, and TOML export/import (guide §2.9)."""

from __future__ import annotations

import functools

import dataclasses
import json
import os
import re
import sys

import pytest

from conftest import OFFLINE
from conftest import assert_usage_error as _usage_error
from poprun import ConfigError, LaunchConfig, PoprunError
from poprun.cli import main as cli_main
from poprun.cli import options as cli
from poprun.plan import mpiargs
from poprun.plan.config import DEFAULT_KILL_TIMEOUT, field_defaults, load_toml

import tomllib

PY = sys.executable


# These checks never required an empty stdout; keep them as they were.
assert_usage_error = functools.partial(_usage_error, stdout_empty=False)


def make(**kw) -> LaunchConfig:
    kw.setdefault("program", ("prog",))
    return LaunchConfig(**kw)


# --- LaunchConfig ---------------------------------------------------------------------------


class TestLaunchConfig:
    def test_defaults(self):
        cfg = make()
        assert (cfg.num_instances, cfg.num_replicas, cfg.ipus_per_replica, cfg.num_ilds) == (
            1, 1, 1, 1)
        assert cfg.executable_cache_path is None
        assert cfg.only_output_from_instance is None
        assert cfg.kill_timeout == DEFAULT_KILL_TIMEOUT
        assert cfg.env == cfg.mpi_global_args == cfg.mpi_local_args == ()
        assert field_defaults()["num_instances"] == 1
        assert "program" not in field_defaults()

    def test_sequences_become_tuples(self):
        cfg = make(program=["a", "b"], env=["X=1"], mpi_global_args=iter(["--tag-output"]))
        assert cfg.program == ("a", "b")
        assert cfg.env == ("X=1",)
        assert cfg.mpi_global_args == ("--tag-output",)

    def test_frozen(self):
        cfg = make()
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.num_instances = 2  # type: ignore[misc]

    def test_equal_configs_compare_equal(self):
        assert make(num_instances=2, num_replicas=4) == make(num_replicas=4, num_instances=2)
        assert make(num_instances=2, num_replicas=4) != make(num_instances=1, num_replicas=4)

    INVALID = {
        "no program": (dict(program=()), "no program given"),
        "empty program name": (dict(program=("",)), "no program given"),
        "program as one string": (dict(program="python3 train.py"), "not one string"),
        "program not a sequence": (dict(program=None), "program must be a sequence"),
        "program of non-strings": (dict(program=(1, 2)), "program must be a sequence of strings"),
        "env as one string": (dict(env="A=1"), "env must be a sequence of strings"),
        "env of non-strings": (dict(env=(1,)), "--env must be a sequence of strings"),
        "zero instances": (dict(num_instances=0), "--num-instances must be a positive integer"),
        "negative replicas": (dict(num_replicas=-2), "--num-replicas must be a positive"),
        "float instances": (dict(num_instances=2.0), "--num-instances must be a positive"),
        "bool instances": (dict(num_instances=True), "--num-instances must be a positive"),
        "string replicas": (dict(num_replicas="4"), "--num-replicas must be a positive"),
        "zero ipus": (dict(ipus_per_replica=0), "--ipus-per-replica"),
        "zero ilds": (dict(num_ilds=0), "--num-ilds"),
        "indivisible": (dict(num_instances=3, num_replicas=4),
                        "--num-replicas=4 is not divisible by --num-instances=3"),
        "indivisible ilds": (dict(num_replicas=3, num_ilds=2),
                             "--num-replicas=3 is not divisible by --num-ilds=2"),
        "only-output too big": (dict(num_instances=2, num_replicas=2,
                                     only_output_from_instance=2),
                                "--only-output-from-instance=2 is not an instance index (0..1)"),
        "only-output negative": (dict(only_output_from_instance=-1),
                                 "--only-output-from-instance=-1"),
        "only-output string": (dict(only_output_from_instance="0"),
                               "--only-output-from-instance must be an integer"),
        "negative kill timeout": (dict(kill_timeout=-0.5), "--kill-timeout must not be negative"),
        "string kill timeout": (dict(kill_timeout="5"), "--kill-timeout must be a number"),
        "nan kill timeout": (dict(kill_timeout=float("nan")), "--kill-timeout must be a number"),
        "string bool": (dict(offline_mode="yes"), "--offline-mode must be a boolean"),
        "int bool": (dict(tag_output=1), "--tag-output must be a boolean"),
        "non-string cache path": (dict(executable_cache_path=3),
                                  "--executable-cache-path must be a string"),
        "negative verbosity": (dict(verbose=-1), "--verbose must be a non-negative integer"),
        "bad env name": (dict(env=("1X=2",)), "--env: '1X=2' is not VAR, VAR=VALUE or a pattern"),
        "empty env name": (dict(env=("=2",)), "--env: '=2'"),
        "bad mpi token": (dict(mpi_global_args=("--foo",)),
                          "--mpi-global-args: unsupported mpirun argument '--foo'"),
        "bad local mpi token": (dict(mpi_local_args=("stray",)),
                                "--mpi-local-args: unexpected argument 'stray'"),
        "bad -x in mpi args": (dict(mpi_local_args=("-x A.B=1",)), "-x: 'A.B=1'"),
        "instance args: missing instance": (
            dict(num_instances=2, num_replicas=2, instance_mpi_local_args=("2:-x A=1",)),
            "--instance-mpi-local-args names instance 2, but there are only 2"),
        "instance args: no colon": (dict(instance_mpi_local_args=("-x A=1",)),
                                    "expected '<instance index>:<args>', got '-x A=1'"),
        "instance args: negative index": (dict(instance_mpi_local_args=("-1:-x A=1",)),
                                          "got '-1:-x A=1'"),
        "instance args: bad token": (dict(instance_mpi_local_args=("0:--nope",)),
                                     "--instance-mpi-local-args=0:--nope: unsupported"),
    }

    @pytest.mark.parametrize("kwargs,message", INVALID.values(), ids=INVALID.keys())
    def test_invalid_values_raise_config_error(self, kwargs, message):
        with pytest.raises(ConfigError) as info:
            make(**kwargs)
        assert message in str(info.value)
        assert isinstance(info.value, PoprunError)
        assert "\n" not in str(info.value)

    def test_valid_edge_values(self):
        assert make(kill_timeout=0).kill_timeout == 0
        assert make(executable_cache_path="").executable_cache_path == ""
        assert make(num_instances=4, num_replicas=8, only_output_from_instance=3,
                    num_ilds=2).only_output_from_instance == 3
        assert make(env=("_A1", "B=x=y", "C=")).env == ("_A1", "B=x=y", "C=")


class TestEffectiveSettings:
    def test_native_only(self):
        cfg = make(tag_output=True, timestamp_output=True, merge_stderr_to_stdout=True,
                   output_filename="native")
        assert cfg.effective_tag_output and cfg.effective_timestamp_output
        assert cfg.effective_merge_stderr
        assert cfg.effective_output_filename == "native"

    def test_nothing_set(self):
        cfg = make()
        assert not (cfg.effective_tag_output or cfg.effective_timestamp_output
                    or cfg.effective_merge_stderr)
        assert cfg.effective_output_filename is None

    def test_from_global_mpi_args(self):
        cfg = make(mpi_global_args=("--tag-output --timestamp-output",
                                    "--merge-stderr-to-stdout --output-filename from-mpi"))
        assert cfg.tag_output is False and cfg.effective_tag_output is True
        assert cfg.timestamp_output is False and cfg.effective_timestamp_output is True
        assert cfg.merge_stderr_to_stdout is False and cfg.effective_merge_stderr is True
        assert cfg.output_filename is None and cfg.effective_output_filename == "from-mpi"

    def test_from_local_mpi_args(self):
        cfg = make(mpi_local_args=("-tag-output", "--output-filename=local-dir"))
        assert cfg.effective_tag_output is True
        assert cfg.effective_timestamp_output is False
        assert cfg.effective_output_filename == "local-dir"

    def test_native_output_filename_wins(self):
        cfg = make(output_filename="native", mpi_global_args=("--output-filename mpi",))
        assert cfg.effective_output_filename == "native"

    def test_per_instance_args_do_not_change_global_settings(self):
        cfg = make(num_instances=2, num_replicas=2,
                   instance_mpi_local_args=("1:--tag-output -x A=1",))
        assert cfg.effective_tag_output is False
        assert cfg.instance_mpi[1].tag_output is True
        assert set(cfg.instance_mpi) == {1}

    def test_env_entries_order_native_mpi_instance(self):
        cfg = make(num_instances=3, num_replicas=3,
                   env=("N1=1", "N2"),
                   mpi_global_args=("-x G=1",),
                   mpi_local_args=("-x L=1 -xL2",),
                   instance_mpi_local_args=("1:-x I=1", "2:-x J=2", "1:-x K"))
        assert cfg.env_entries(0) == ("N1=1", "N2", "G=1", "L=1", "L2")
        assert cfg.env_entries(1) == ("N1=1", "N2", "G=1", "L=1", "L2", "I=1", "K")
        assert cfg.env_entries(2) == ("N1=1", "N2", "G=1", "L=1", "L2", "J=2")

    def test_ignored_tokens_collected(self):
        cfg = make(mpi_global_args=("--allow-run-as-root",),
                   mpi_local_args=("--mca btl_tcp_if_include lo --mca pml ob1",))
        assert cfg.mpi.ignored == ("--allow-run-as-root", "--mca pml ob1")
        assert cfg.mpi.mca == (("btl_tcp_if_include", "lo"),)  # the network (plan/network.py)


# --- mpirun arguments -------------------------------------------------------------------------


def mpi(text: str) -> mpiargs.MpiArgs:
    return mpiargs.parse_mpi_args(text, "--mpi-global-args")


class TestMpiArgs:
    def test_empty(self):
        assert mpi("") == mpiargs.MpiArgs()
        assert mpi("   ") == mpiargs.MpiArgs()

    @pytest.mark.parametrize("text,env", [
        ("-x VAR", ("VAR",)),
        ("-x VAR=VALUE", ("VAR=VALUE",)),
        ("-xVAR", ("VAR",)),
        ("-xVAR=1", ("VAR=1",)),
        ("-x A -x B=2 -xC", ("A", "B=2", "C")),
        ("-x 'A=two words'", ("A=two words",)),
        ('-x "B=it\'s $HOME"', ("B=it's $HOME",)),
        ("-x C=a=b", ("C=a=b",)),
    ])
    def test_env(self, text, env):
        parsed = mpi(text)
        assert parsed.env == env
        assert parsed.ignored == ()

    @pytest.mark.parametrize("text,attr", [
        ("--tag-output", "tag_output"), ("-tag-output", "tag_output"),
        ("--timestamp-output", "timestamp_output"), ("-timestamp-output", "timestamp_output"),
        ("--merge-stderr-to-stdout", "merge_stderr_to_stdout"),
        ("--report-bindings", "report_bindings"),
    ])
    def test_flags(self, text, attr):
        parsed = mpi(text)
        assert getattr(parsed, attr) is True
        others = {"tag_output", "timestamp_output", "merge_stderr_to_stdout",
                  "report_bindings"} - {attr}
        assert not any(getattr(parsed, o) for o in others)

    @pytest.mark.parametrize("text,attr,value", [
        ("--output-filename DIR", "output_filename", "DIR"),
        ("--output-filename=DIR", "output_filename", "DIR"),
        ("-output-filename 'my dir'", "output_filename", "my dir"),
        ("--bind-to core", "bind_to", "core"),
        ("--bind-to=socket", "bind_to", "socket"),
        ("--map-by ppr:2:socket", "map_by", "ppr:2:socket"),
    ])
    def test_valued(self, text, attr, value):
        assert getattr(mpi(text), attr) == value

    @pytest.mark.parametrize("text,ignored", [
        ("--mca oob_tcp_if_include eth0", ()),  # read: it chooses the network
        ("-mca btl ^openib", ("-mca btl ^openib",)),
        ("--allow-run-as-root", ("--allow-run-as-root",)),
        ("--allow-run-as-root --mca a b --oversubscribe",
         ("--allow-run-as-root", "--mca a b", "--oversubscribe")),
    ])
    def test_ignored(self, text, ignored):
        parsed = mpi(text)
        assert parsed.ignored == ignored
        assert parsed.env == () and parsed.tag_output is False

    def test_everything_together(self):
        parsed = mpi("--tag-output -x A=1 --mca pml ob1 --output-filename out "
                     "--allow-run-as-root -xB --bind-to none --map-by slot --report-bindings")
        assert parsed == mpiargs.MpiArgs(
            env=("A=1", "B"), tag_output=True, output_filename="out", bind_to="none",
            map_by="slot", report_bindings=True,
            ignored=("--mca pml ob1", "--allow-run-as-root"))

    @pytest.mark.parametrize("text,message", [
        ("--foo", "unsupported mpirun argument '--foo'"),
        ("-np 4", "unsupported mpirun argument '-np'"),
        ("--hostfile hosts", "unsupported mpirun argument '--hostfile'"),
        ("--tag-output=yes", "unsupported mpirun argument '--tag-output=yes'"),
        ("--allow-run-as-root=1", "unsupported mpirun argument '--allow-run-as-root=1'"),
        ("stray", "unexpected argument 'stray'"),
        ("-x", "'-x' needs a value"),
        ("--output-filename", "'--output-filename' needs a value"),
        ("--mca", "'--mca' needs a value"),
        ("--mca key", "--mca key needs a value"),
        ("-x 'A=1", "cannot split"),
    ])
    def test_errors_name_the_token_and_source(self, text, message):
        with pytest.raises(ConfigError) as info:
            mpiargs.parse_mpi_args(text, "--mpi-local-args")
        assert str(info.value).startswith("--mpi-local-args: ")
        assert message in str(info.value)

    def test_instance_args(self):
        index, parsed = mpiargs.parse_instance_args("3:-x A=B --tag-output")
        assert index == 3
        assert parsed.env == ("A=B",) and parsed.tag_output is True
        assert mpiargs.parse_instance_args("0:")[1] == mpiargs.MpiArgs()

    @pytest.mark.parametrize("text", ["", "-x A", ":-x A", "a:-x A", "-1:-x A", "1.5:-x A"])
    def test_instance_args_malformed(self, text):
        with pytest.raises(ConfigError, match="expected '<instance index>:<args>'"):
            mpiargs.parse_instance_args(text)

    @pytest.mark.parametrize("text,count", [  # mpirun(1)'s spellings of processes per node
        ("--npernode 16", 16), ("-npernode 4", 4), ("--npernode=3", 3), ("-N 2", 2),
        ("--pernode", 1), ("-pernode", 1), ("--tag-output --npernode 16", 16),
    ])
    def test_processes_per_node(self, text, count):
        assert mpi(text).npernode == count

    @pytest.mark.parametrize("text", ["--npernode 0", "-N x", "--npernode 9999999999",
                                      "--npernode -1"])
    def test_processes_per_node_must_be_a_count(self, text):
        with pytest.raises(ConfigError, match="is not a number of instances per host"):
            mpi(text)

    def test_merge_accumulates_and_later_values_win(self):
        merged = mpiargs.merge([mpi("-x A --output-filename first --mca a b"),
                                mpi("--tag-output -x B"),
                                mpi("--output-filename second --allow-run-as-root")])
        assert merged.env == ("A", "B")
        assert merged.tag_output is True
        assert merged.output_filename == "second"
        assert merged.ignored == ("--mca a b", "--allow-run-as-root")
        assert mpiargs.merge([]) == mpiargs.MpiArgs()


# --- TOML export / import (guide §2.9) ------------------------------------------------------


@pytest.mark.parametrize("kw,message", [
    (dict(num_replicas=99999999999999999999), "--num-replicas=99999999999999999999 is more "
                                              "than poprun handles"),
    (dict(num_instances=1 << 17, num_replicas=1 << 17), "--num-instances=131072 is more"),
    (dict(vipu_server_port=70000), "--vipu-server-port must be a TCP port"),
])
def test_counts_beyond_any_system_are_usage_errors(kw, message):
    """Found by tests/test_cli_fuzz.py: an OverflowError (exit 70) while planning."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        make(**kw)


def test_a_fifo_as_the_program_is_refused_unread(tmp_path):
    """Found by the fuzzer: asking a FIFO for its #! line waited for a writer."""
    from poprun.plan.config import missing_program

    os.mkfifo(tmp_path / "fifo")
    assert str(missing_program("fifo", str(tmp_path))) == "program 'fifo' is not a regular file"


def _words(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_mpirun_arguments_are_one_list_for_parser_help_and_readme():
    """One list for the parser, --help and the README (each once had its own)."""
    from pathlib import Path

    summary = mpiargs.summary()
    guide = (Path(__file__).resolve().parent.parent / "docs" / "migrating.md").read_text()
    assert summary in _words(guide)
    help_of = next(o.help for o in cli.OPTIONS if o.long == "mpi-global-args")
    assert summary in help_of
    with pytest.raises(ConfigError) as info:
        mpiargs.parse_mpi_args("--frobnicate", "--mpi-global-args")
    assert summary in str(info.value)
    for arg in mpiargs.ARGS:  # every listed argument parses, with its value words
        dash = "-" if len(arg.name) == 1 else "--"
        value = "2" if arg.field == "npernode" else "v"  # a count, not a word
        parsed = mpi(" ".join([dash + arg.name] + [value] * arg.words))
        if arg.field is None:
            assert parsed.ignored and parsed == mpiargs.MpiArgs(ignored=parsed.ignored)
        else:
            assert getattr(parsed, arg.field) in (True, "v", ("v",), 2), arg


def read_toml(path) -> dict:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


class TestTomlInProcess:
    def test_to_dict_has_program_and_non_defaults_in_cli_names(self):
        cfg = make(program=("python3", "train.py"), num_instances=2, num_replicas=32,
                   offline_mode=True, env=("A=1",), executable_cache_path="")
        assert cfg.to_dict() == {
            "program": ["python3", "train.py"], "num-instances": 2, "num-replicas": 32,
            "offline-mode": True, "env": ["A=1"], "executable-cache-path": ""}

    def test_round_trip(self, tmp_path):
        cfg = make(program=("python3", "train.py", "a b"), num_instances=2, num_replicas=4,
                   num_ilds=2, ipus_per_replica=2, offline_mode=True, print_topology=True,
                   only_output_from_instance=1, executable_cache_path="/cache",
                   env=("A=1", "B"), tag_output=True, timestamp_output=True,
                   output_filename="out", merge_stderr_to_stdout=True,
                   mpi_global_args=("--mca a b",), mpi_local_args=("-x C=1",),
                   instance_mpi_local_args=("1:-x D=2",), kill_timeout=1.5, verbose=2)
        path = tmp_path / "job.toml"
        path.write_text(cfg.to_toml())
        stored = load_toml(str(path))
        program = stored.pop("program")
        assert LaunchConfig(program=program, **stored) == cfg

    def test_load_unknown_key(self, tmp_path):
        path = tmp_path / "bad.toml"
        path.write_text('program = ["x"]\nnum-instance = 2\n')
        with pytest.raises(ConfigError, match="unknown option 'num-instance'"):
            load_toml(str(path))

    def test_load_invalid_toml(self, tmp_path):
        path = tmp_path / "bad.toml"
        path.write_text("num-instances = \n")
        with pytest.raises(ConfigError, match="not valid TOML"):
            load_toml(str(path))

    def test_load_missing_file(self, tmp_path):
        with pytest.raises(ConfigError, match="missing.toml: cannot read"):
            load_toml(str(tmp_path / "missing.toml"))

    def test_command_line_overrides_stored_options(self, tmp_path):
        path = tmp_path / "job.toml"
        path.write_text('program = ["python3", "train.py"]\nnum-instances = 2\n'
                        'num-replicas = 8\ntag-output = true\nenv = ["A=1"]\n')
        cfg = cli.build_config(cli.parse_args(
            [f"--import-config={path}", "--num-instances=4", "--tag-output=no", "-x", "B=2"]))
        assert cfg.num_instances == 4
        assert cfg.num_replicas == 8  # stored
        assert cfg.tag_output is False
        assert cfg.env == ("B=2",)  # the command line's value replaces the stored one
        assert cfg.program == ("python3", "train.py")

    def test_program_on_command_line_replaces_stored(self, tmp_path):
        path = tmp_path / "job.toml"
        path.write_text('program = ["python3", "train.py"]\n')
        cfg = cli.build_config(cli.parse_args(
            [f"--import-config={path}", "python3", "train.py", "--hyper-param=1"]))
        assert cfg.program == ("python3", "train.py", "--hyper-param=1")

    @pytest.mark.parametrize("content,message", [
        ('program = "python3 train.py"\n', "not one string"),
        ('program = ["x"]\nnum-instances = "2"\n', "--num-instances must be a positive"),
        ('program = ["x"]\nkill-timeout = "soon"\n', "--kill-timeout must be a number"),
        ('program = ["x"]\noffline-mode = "yes"\n', "--offline-mode must be a boolean"),
        ('program = ["x"]\nenv = "A=1"\n', "env must be a sequence of strings"),
        ('program = ["x"]\nmpi-global-args = [1]\n', "--mpi-global-args must be a sequence"),
    ])
    def test_wrongly_typed_stored_values(self, tmp_path, content, message):
        path = tmp_path / "job.toml"
        path.write_text(content)
        with pytest.raises(ConfigError, match=re.escape(message)):
            cli.build_config(cli.parse_args([f"--import-config={path}"]))


class TestTomlCommand:
    def test_export_writes_the_options_and_still_launches(self, poprun, tmp_path):
        conf = tmp_path / "training.conf"
        proc = poprun("--export-config", str(conf), *OFFLINE, "--num-replicas=4",
                      "--num-instances=2", "-x", "GREETING=hi", "--mpi-global-args=--tag-output",
                      "sh", "-c", 'echo "launched $RANK $GREETING"', cwd=tmp_path, timeout=60)
        assert proc.returncode == 0, proc.stderr.decode()
        assert sorted(proc.stdout.decode().splitlines()) == [
            "[1,0]<stdout>:launched 0 hi", "[1,1]<stdout>:launched 1 hi"]
        assert f"configuration written to {conf}" in proc.stderr.decode()
        assert read_toml(conf) == {
            "program": ["sh", "-c", 'echo "launched $RANK $GREETING"'],
            "num-instances": 2, "num-replicas": 4, "offline-mode": True,
            "env": ["GREETING=hi"], "mpi-global-args": ["--tag-output"]}

    def test_export_leaves_out_launch_only_options(self, poprun, tmp_path):
        conf = tmp_path / "job.toml"
        proc = poprun(f"--export-config={conf}", *OFFLINE, "--dry-run", "--json",
                      "--overwrite-config=no", "-vv", PY, cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        assert read_toml(conf) == {"program": [PY], "offline-mode": True, "verbose": 2}

    def test_existing_file_is_not_overwritten(self, poprun, tmp_path):
        conf = tmp_path / "training.conf"
        conf.write_text("# precious\n")
        proc = poprun("--export-config", str(conf), *OFFLINE, "--num-replicas=2", "--dry-run",
                      PY, cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        assert conf.read_text() == "# precious\n"
        siblings = [p for p in tmp_path.iterdir() if p != conf]
        assert len(siblings) == 1, siblings
        assert re.fullmatch(r"training-\d{8}-\d{6}\.conf", siblings[0].name)
        assert read_toml(siblings[0]) == {"program": [PY], "num-replicas": 2,
                                          "offline-mode": True}
        assert f"configuration written to {siblings[0]}" in proc.stderr.decode()

    def test_overwrite_config_yes_overwrites(self, poprun, tmp_path):
        conf = tmp_path / "training.conf"
        conf.write_text("# precious\n")
        proc = poprun("--export-config", str(conf), "--overwrite-config=yes", *OFFLINE,
                      "--dry-run", PY, cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        assert read_toml(conf) == {"program": [PY], "offline-mode": True}
        assert list(tmp_path.iterdir()) == [conf]

    def test_export_to_unwritable_place(self, poprun, tmp_path):
        proc = poprun("--export-config", str(tmp_path / "no" / "such" / "dir.toml"), *OFFLINE,
                      "--dry-run", PY, cwd=tmp_path, timeout=30)
        assert_usage_error(proc, "--export-config", "cannot write")

    def test_existing_train_toml_gets_a_timestamp_before_its_suffix(self, poprun, tmp_path):
        (tmp_path / "train.toml").write_text("# mine\n")
        proc = poprun("--export-config", "train.toml", *OFFLINE, "--dry-run", PY,
                      cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        names = sorted(p.name for p in tmp_path.iterdir())
        assert len(names) == 2 and names[1] == "train.toml", names
        assert re.fullmatch(r"train-\d{8}-\d{6}\.toml", names[0]), names

    @pytest.mark.parametrize("args,fragments", [
        (["no-such-program-for-poprun-tests"], ["no-such-program-for-poprun-tests",
                                                 "not found"]),
        (["--num-instances=3", "--num-replicas=4", PY], ["not divisible"]),
        (["--mpi-global-args=--frobnicate", PY], ["--frobnicate"]),
    ], ids=["program missing", "bad counts", "bad mpi args"])
    def test_nothing_is_written_for_an_invalid_configuration(self, poprun, tmp_path, args,
                                                             fragments):
        """Nothing is written: the file once was, before the program was found missing."""
        for extra in ((), ("--dry-run",)):
            proc = poprun("--export-config", "train.toml", *OFFLINE, *extra, *args,
                          cwd=tmp_path, timeout=30)
            assert_usage_error(proc, *fragments)
            assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize("target,fragments", [
        ("/dev/full", ["/dev/full", "not a regular file"]),
        ("/", ["--export-config /", "is a directory"]),
        ("{tmp}", ["is a directory"]),
        ("{tmp}/no/such/dir/x.toml", ["cannot write it", "No such file"]),
        ("", ["--export-config needs a file name"]),
    ], ids=["/dev/full", "root", "a directory", "missing folder", "empty"])
    def test_errors_writing_it_are_one_line_and_write_nothing_beside(self, poprun, tmp_path,
                                                                     target, fragments):
        """Was: /dev/full.<timestamp> and /.<timestamp> written."""
        target = target.format(tmp=tmp_path)
        before = set(os.listdir("/")), set(os.listdir("/dev"))
        proc = poprun("--export-config", target, *OFFLINE, "--dry-run", PY, cwd=tmp_path,
                      timeout=30)
        assert_usage_error(proc, *fragments)
        assert (set(os.listdir("/")), set(os.listdir("/dev"))) == before
        assert list(tmp_path.iterdir()) == []

    def test_a_disk_full_while_writing_leaves_no_file(self, tmp_path):
        cfg = make(offline_mode=True)
        target = tmp_path / "x.toml"
        import unittest.mock as mock

        real_fdopen = os.fdopen

        class Full:
            def __init__(self, fd, mode):
                self._fh = real_fdopen(fd, mode)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._fh.close()

            def write(self, data):
                raise OSError(28, "No space left on device")

        with mock.patch("os.fdopen", Full), pytest.raises(ConfigError) as err:
            cli_main.export_config(cfg, str(target), overwrite=False)
        assert str(err.value) == (f"--export-config {target}: cannot write it: No space left "
                                  "on device")
        assert list(tmp_path.iterdir()) == []

    def test_import_loads_the_stored_options(self, poprun, tmp_path):
        conf = tmp_path / "training.conf"
        conf.write_text(f'program = ["{PY}", "train.py"]\nnum-instances = 2\n'
                        'num-replicas = 8\noffline-mode = true\nenv = ["A=1"]\n')
        proc = poprun("--import-config", str(conf), "--dry-run", "--json", cwd=tmp_path,
                      timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        instances = json.loads(proc.stdout)["instances"]
        assert [i["replicas"] for i in instances] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert all(i["argv"] == [PY, "train.py"] for i in instances)
        assert all(i["env"]["A"] == "1" for i in instances)

    def test_guide_example_override_and_new_program(self, poprun, tmp_path):
        """§2.9: stored --num-instances=2 and `python3 train.py`; the command line gives
        --num-instances=4 and `python3 train.py --hyper-param=1`."""
        conf = tmp_path / "training.conf"
        proc = poprun("--export-config", str(conf), *OFFLINE, "--num-replicas=32",
                      "--num-instances=2", "--num-ilds=2", "--dry-run", PY, "train.py",
                      cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        proc = poprun("--import-config", str(conf), "--num-instances=4", "--dry-run", "--json",
                      PY, "train.py", "--hyper-param=1", cwd=tmp_path, timeout=30)
        assert proc.returncode == 0, proc.stderr.decode()
        data = json.loads(proc.stdout)
        assert len(data["instances"]) == 4
        assert [i["replicas"][0] for i in data["instances"]] == [0, 8, 16, 24]
        assert data["num_ilds"] == 2
        for inst in data["instances"]:
            assert inst["argv"] == [PY, "train.py", "--hyper-param=1"]
            assert inst["argv"].count("--hyper-param=1") == 1
        # overriding does not write the new value to the file
        assert read_toml(conf)["num-instances"] == 2

    @pytest.mark.parametrize("content,fragments", [
        ('program = ["x"]\nbogus = 1\n', ["--import-config", "unknown option 'bogus'"]),
        ("program = [\n", ["--import-config", "not valid TOML"]),
        ('program = ["x"]\n[section]\nkey = 1\n', ["unknown option 'section'"]),
        ('program = ["x"]\nkill-timeout = "x"\n', ["--kill-timeout must be a number"]),
        ('program = "x y"\n', ["program must be a sequence of strings"]),
    ])
    def test_bad_import_file_is_a_usage_error(self, poprun, tmp_path, content, fragments):
        conf = tmp_path / "job.toml"
        conf.write_text(content)
        proc = poprun("--import-config", str(conf), *OFFLINE, "--dry-run", cwd=tmp_path,
                      timeout=30)
        assert_usage_error(proc, *fragments)

    @pytest.mark.parametrize("make,fragments", [
        (lambda d: (d / "b.toml").write_bytes(b"\x80\x81 = 1\n") and d / "b.toml",
         ["b.toml", "not UTF-8"]),
        (lambda d: (d / "n.toml").write_text("a = " + "[" * 5000 + "\n") and d / "n.toml",
         ["n.toml", "not valid TOML", "nested too deeply"]),
        (lambda d: "/dev/zero", ["/dev/zero", "not a regular file"]),
        (lambda d: d, ["not a regular file (a directory)"]),
        (lambda d: os.mkfifo(d / "fifo") or d / "fifo", ["fifo", "not a regular file"]),
        (lambda d: (d / "big.toml").write_bytes(b"#" * (2 << 20)) and d / "big.toml",
         ["big.toml", "larger than 1 MiB"]),
    ], ids=["binary", "5000 brackets", "/dev/zero", "directory", "fifo", "too large"])
    def test_import_file_read_bounded_and_decoded_carefully(self, poprun, tmp_path, make,
                                                            fragments):
        """A bad file (not UTF-8, nested too deeply, not a regular file, too large) is one
        usage error line (was: a UnicodeDecodeError or RecursionError traceback, a hang on
        /dev/zero and on a FIFO)."""
        path = make(tmp_path)
        proc = poprun("--import-config", str(path), *OFFLINE, "--dry-run", PY, cwd=tmp_path,
                      timeout=20)
        assert_usage_error(proc, "--import-config", *fragments)

    @pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom"])
    def test_host_file_from_a_device_is_refused_unread(self, poprun, tmp_path, path):
        proc = poprun("--host-file", path, *OFFLINE, "--dry-run", PY, timeout=20)
        assert_usage_error(proc, "--host-file", path, "not a regular file")

    def test_missing_import_file_is_a_usage_error(self, poprun, tmp_path):
        proc = poprun("--import-config", str(tmp_path / "nope.toml"), *OFFLINE, "--dry-run",
                      cwd=tmp_path, timeout=30)
        assert_usage_error(proc, "--import-config", "nope.toml", "cannot read")


def test_the_line_cap_in_help_is_the_spawner_s():
    """--help states the cap a long line is cut at: the spawner's LINE_CAP."""
    from poprun.cli.options import OPTIONS
    from spawner.local import LINE_CAP

    text = next(o.help for o in OPTIONS if o.long == "tag-output")
    assert LINE_CAP % (1 << 20) == 0
    assert f"longer than {LINE_CAP >> 20} MiB is written in {LINE_CAP >> 20} MiB pieces" in text
