"""Pure planning (`poprun.plan.planner`, `launcher.make_plan`) and the text renderings (`poprun.view.render`).

Every fact from outside comes in as an argument (environ dict, hosts, port, cache paths), so
these tests need no process, network or file-system state beyond a tmp_path for programs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poprun import ConfigError, LaunchConfig
from poprun.run.session import DRY_RUN_CACHE_DIR, make_plan
from poprun.plan.planner import CacheMode, LaunchPlan, cache_mode, instance_environ, plan
from poprun.text import describe_status, fold_indices, signal_name
from poprun.view.render import dry_run_text, \
    topology_table

# The --print-topology example of the PopRun user guide (§1.3), committed verbatim.
GUIDE_TOPOLOGY = Path(__file__).parent / "data" / "guide_topology_table.txt"
PROGRAM = ("/bin/prog", "--flag", "a b")


def cfg(**kw) -> LaunchConfig:
    kw.setdefault("program", PROGRAM)
    kw.setdefault("offline_mode", True)
    return LaunchConfig(**kw)


def do_plan(config: LaunchConfig, environ=None, **kw) -> LaunchPlan:
    kw.setdefault("program", config.program)
    kw.setdefault("master_port", 29500)
    return plan(config, environ or {}, **kw)


def executable(path: Path, mode: int = 0o755) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(mode)
    return path


# --- the environment contract (docs/architecture.md, "The environment contract") --------------


class TestInstanceEnvironment:
    def test_four_instances_eight_replicas_exact_environment(self):
        config = cfg(num_instances=4, num_replicas=8, ipus_per_replica=2)
        launch_plan = do_plan(config, cache_paths={"localhost": "/tmp/poprun-cache-x"},
                              master_addr="10.1.2.3", master_port=31337)
        assert launch_plan.cache_mode is CacheMode.TEMPORARY
        assert launch_plan.hosts == ("localhost",)
        assert len(launch_plan.instances) == 4
        for i, inst in enumerate(launch_plan.instances):
            assert inst.index == i
            assert inst.host == "localhost"
            assert inst.local_index == i
            assert inst.replicas == (2 * i, 2 * i + 1)
            assert inst.ild == 0
            assert inst.argv == PROGRAM
            assert inst.cpus is None and inst.mems is None
            assert dict(inst.env) == {
                "POPDIST_NUM_TOTAL_REPLICAS": "8",
                "POPDIST_NUM_IPUS_PER_REPLICA": "2",
                "POPDIST_NUM_LOCAL_REPLICAS": "2",
                "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
                "POPDIST_REPLICA_INDEX_OFFSET": str(2 * i),
                "POPDIST_LOCAL_INSTANCE_INDEX": str(i),
                "POPDIST_EXECUTABLE_CACHE_PATH": "/tmp/poprun-cache-x",
                "OMPI_COMM_WORLD_RANK": str(i),
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(i),
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "RANK": str(i),
                "WORLD_SIZE": "4",
                "LOCAL_RANK": str(i),
                "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "10.1.2.3",
                "MASTER_PORT": "31337",
                "IPUOF_LOG_LEVEL": "WARN",
            }
        assert launch_plan.warnings == ()

    def test_ipuof_log_level_is_warn_unless_the_user_set_it(self):
        """Real PopRun's mpirun lines carry -x IPUOF_LOG_LEVEL=WARN."""
        def level(environ=None, **kw):
            return {i.env["IPUOF_LOG_LEVEL"]
                    for i in do_plan(cfg(num_instances=2, num_replicas=2, **kw), environ,
                                     hosts=("h1", "h2"), remote_hosts=frozenset({"h2"}))
                    .instances}
        assert level() == {"WARN"}
        assert level({"IPUOF_LOG_LEVEL": "INFO"}) == {"INFO"}  # remote instances too
        assert level({"IPUOF_LOG_LEVEL": ""}) == {"WARN"}
        assert level({"IPUOF_LOG_LEVEL": "INFO"}, env=("IPUOF_LOG_LEVEL=DEBUG",)) == {"DEBUG"}

    def test_single_instance_has_no_cache_variable(self):
        (inst,) = do_plan(cfg(num_replicas=4), cache_paths={"localhost": "/c"}).instances
        assert "POPDIST_EXECUTABLE_CACHE_PATH" not in inst.env
        assert inst.env["POPDIST_NUM_LOCAL_REPLICAS"] == "4"
        assert inst.env["POPDIST_REPLICA_INDEX_OFFSET"] == "0"
        assert inst.env["WORLD_SIZE"] == inst.env["OMPI_COMM_WORLD_SIZE"] == "1"
        assert inst.replicas == (0, 1, 2, 3)

    def test_instances_are_contiguous_blocks_per_host(self):
        config = cfg(num_instances=4, num_replicas=8)
        launch_plan = do_plan(config, hosts=("h0", "h1"),
                              cache_paths={"h0": "/c0", "h1": "/c1"})
        assert [i.host for i in launch_plan.instances] == ["h0", "h0", "h1", "h1"]
        assert [i.local_index for i in launch_plan.instances] == [0, 1, 0, 1]
        assert [i.env["POPDIST_LOCAL_INSTANCE_INDEX"] for i in launch_plan.instances] == [
            "0", "1", "0", "1"]
        assert [i.env["OMPI_COMM_WORLD_LOCAL_RANK"] for i in launch_plan.instances] == [
            "0", "1", "0", "1"]
        assert [i.env["LOCAL_RANK"] for i in launch_plan.instances] == ["0", "1", "0", "1"]
        assert {i.env["LOCAL_WORLD_SIZE"] for i in launch_plan.instances} == {"2"}
        assert {i.env["OMPI_COMM_WORLD_LOCAL_SIZE"] for i in launch_plan.instances} == {"2"}
        assert [i.env["RANK"] for i in launch_plan.instances] == ["0", "1", "2", "3"]
        assert {i.env["WORLD_SIZE"] for i in launch_plan.instances} == {"4"}
        assert [i.env["POPDIST_EXECUTABLE_CACHE_PATH"] for i in launch_plan.instances] == [
            "/c0", "/c0", "/c1", "/c1"]
        assert [len(launch_plan.on_host(h)) for h in ("h0", "h1")] == [2, 2]
        assert launch_plan.on_host("h1")[0].index == 2

    def test_instances_must_divide_among_hosts(self):
        with pytest.raises(ConfigError, match="--num-instances=3 is not divisible by the 2 hosts"):
            do_plan(cfg(num_instances=3, num_replicas=3), hosts=("a", "b"))

    def test_ilds(self):
        launch_plan = do_plan(cfg(num_instances=4, num_replicas=8, num_ilds=2))
        assert [i.ild for i in launch_plan.instances] == [0, 0, 1, 1]
        assert launch_plan.num_ilds == 2

    def test_ipuof_config_path_is_removed(self):
        launch_plan = do_plan(cfg(num_instances=2, num_replicas=2))
        assert launch_plan.unset_env == ("IPUOF_CONFIG_PATH",)
        base = {"IPUOF_CONFIG_PATH": "/etc/ipuof.conf", "HOME": "/home/u", "RANK": "99",
                "PATH": "/usr/bin"}
        env = instance_environ(base, launch_plan.instances[1], launch_plan)
        assert "IPUOF_CONFIG_PATH" not in env
        assert env["HOME"] == "/home/u" and env["PATH"] == "/usr/bin"
        assert env["RANK"] == "1"  # the plan's value wins over the launcher's
        assert env == {**{k: v for k, v in base.items() if k != "IPUOF_CONFIG_PATH"},
                       **launch_plan.instances[1].env}
        assert base["IPUOF_CONFIG_PATH"] == "/etc/ipuof.conf"  # the input is not modified

    def test_program_is_the_given_resolved_argv(self):
        launch_plan = do_plan(cfg(num_instances=2, num_replicas=2, program=("prog", "x")),
                              program=("/resolved/prog", "x"))
        assert {i.argv for i in launch_plan.instances} == {("/resolved/prog", "x")}


class TestUserEnvironment:
    def test_x_var_forwards_the_launchers_value(self):
        config = cfg(num_instances=2, num_replicas=2, env=("FOO",))
        launch_plan = do_plan(config, {"FOO": "from launcher", "BAR": "not asked"})
        for inst in launch_plan.instances:
            assert inst.env["FOO"] == "from launcher"
            assert "BAR" not in inst.env
        assert launch_plan.warnings == ()

    def test_x_var_missing_from_launcher_warns_once(self):
        launch_plan = do_plan(cfg(num_instances=2, num_replicas=2, env=("NOPE",)), {})
        assert all("NOPE" not in i.env for i in launch_plan.instances)
        assert launch_plan.warnings == (
            "-x NOPE: not set in poprun's environment, nothing to forward",)

    def test_x_var_value_sets(self):
        config = cfg(num_instances=2, num_replicas=2, env=("FOO=set", "EMPTY=", "EQ=a=b"))
        for inst in do_plan(config, {"FOO": "launcher"}).instances:
            assert inst.env["FOO"] == "set"
            assert inst.env["EMPTY"] == ""
            assert inst.env["EQ"] == "a=b"

    def test_per_instance_args_only_reach_that_instance(self):
        config = cfg(num_instances=3, num_replicas=3, instance_mpi_local_args=("1:-x A=B",))
        a = [i.env.get("A") for i in do_plan(config).instances]
        assert a == [None, "B", None]

    def test_later_sources_win(self):
        config = cfg(num_instances=2, num_replicas=2, env=("V=native",),
                     mpi_global_args=("-x V=global -x W",), mpi_local_args=("-x V=local",),
                     instance_mpi_local_args=("1:-x V=instance1",))
        launch_plan = do_plan(config, {"W": "fwd"})
        assert [i.env["V"] for i in launch_plan.instances] == ["local", "instance1"]
        assert [i.env["W"] for i in launch_plan.instances] == ["fwd", "fwd"]


# --- executable cache (guide §2.3, §2.4) ------------------------------------------------------


class TestCacheMode:
    @pytest.mark.parametrize("kw,environ,mode", [
        (dict(num_instances=1, num_replicas=4), {}, CacheMode.NONE),
        (dict(num_instances=2, num_replicas=4), {}, CacheMode.TEMPORARY),
        (dict(num_instances=2, num_replicas=4, executable_cache_path=""), {}, CacheMode.NONE),
        (dict(num_instances=1, executable_cache_path="/c"), {}, CacheMode.EXPLICIT),
        (dict(num_instances=2, num_replicas=2, executable_cache_path="/c"), {},
         CacheMode.EXPLICIT),
        (dict(num_instances=2, num_replicas=2), {"POPTORCH_CACHE_DIR": "/t"},
         CacheMode.FRAMEWORK),
        (dict(num_instances=2, num_replicas=2), {"POPART_CACHE_DIR": "/p"},
         CacheMode.FRAMEWORK),
        (dict(num_instances=2, num_replicas=2),
         {"TF_POPLAR_FLAGS": "--executable_cache_path=/tf"}, CacheMode.FRAMEWORK),
        (dict(num_instances=2, num_replicas=2), {"TF_POPLAR_FLAGS": "--use_ipu_model"},
         CacheMode.TEMPORARY),
        (dict(num_instances=2, num_replicas=2), {"POPTORCH_CACHE_DIR": ""},
         CacheMode.TEMPORARY),
        (dict(num_instances=1), {"POPTORCH_CACHE_DIR": "/t"}, CacheMode.NONE),
        (dict(num_instances=2, num_replicas=2, executable_cache_path=""),
         {"POPTORCH_CACHE_DIR": "/t"}, CacheMode.NONE),
    ])
    def test_modes(self, kw, environ, mode):
        assert cache_mode(cfg(**kw), environ) is mode

    @pytest.mark.parametrize("environ,named", [
        ({"POPTORCH_CACHE_DIR": "/t"}, "POPTORCH_CACHE_DIR=/t"),
        ({"POPART_CACHE_DIR": "/p"}, "POPART_CACHE_DIR=/p"),
        ({"TF_POPLAR_FLAGS": "--max_compilation_threads=4 --executable_cache_path=/tf"},
         "TF_POPLAR_FLAGS=--max_compilation_threads=4 --executable_cache_path=/tf"),
    ])
    def test_explicit_path_conflicts_with_framework_setting(self, environ, named):
        with pytest.raises(ConfigError) as info:
            cache_mode(cfg(executable_cache_path="/x"), environ)
        assert "--executable-cache-path=/x" in str(info.value)
        assert named in str(info.value)
        with pytest.raises(ConfigError, match="--executable-cache-path=/x"):
            do_plan(cfg(executable_cache_path="/x"), environ)

    @pytest.mark.parametrize("environ", [
        {"POPTORCH_CACHE_DIR": "/x"}, {"POPTORCH_CACHE_DIR": "/x/"},
        {"POPART_CACHE_DIR": "/x", "POPTORCH_CACHE_DIR": "/x/./"},
        {"TF_POPLAR_FLAGS": "--max_compilation_threads=4 --executable_cache_path=/x"},
    ])
    def test_a_framework_variable_naming_the_same_directory_is_no_conflict(self, environ):
        """balewski/neuron_inverter_benchmark's run-slurm.sh exports
        POPTORCH_CACHE_DIR=X and passes --executable-cache-path=X."""
        assert cache_mode(cfg(executable_cache_path="/x"), environ) is CacheMode.EXPLICIT

    @pytest.mark.parametrize("environ,named", [
        ({"POPTORCH_CACHE_DIR": "/x", "POPART_CACHE_DIR": "/y"}, "POPART_CACHE_DIR=/y"),
        ({"TF_POPLAR_FLAGS": "--executable_cache_path /x"}, "TF_POPLAR_FLAGS="),
        ({"POPTORCH_CACHE_DIR": "x"}, "POPTORCH_CACHE_DIR=x"),  # relative: not known the same
    ])
    def test_a_different_or_unreadable_framework_directory_still_conflicts(self, environ,
                                                                           named):
        with pytest.raises(ConfigError, match=f"conflicts with {named}"):
            cache_mode(cfg(executable_cache_path="/x"), environ)

    def test_explicit_path_in_every_instance(self, tmp_path):
        executable(tmp_path / "prog")
        config = cfg(num_instances=2, num_replicas=2, program=("prog",),
                     executable_cache_path="/var/cache/my-exes")
        launch_plan = make_plan(config, {"PATH": "/nonexistent"}, str(tmp_path))
        assert launch_plan.cache_mode is CacheMode.EXPLICIT
        assert [i.env["POPDIST_EXECUTABLE_CACHE_PATH"] for i in launch_plan.instances] == [
            "/var/cache/my-exes"] * 2

    def test_explicit_path_single_instance(self, tmp_path):
        executable(tmp_path / "prog")
        config = cfg(program=("prog",), executable_cache_path="/c")
        (inst,) = make_plan(config, {"PATH": ""}, str(tmp_path)).instances
        assert inst.env["POPDIST_EXECUTABLE_CACHE_PATH"] == "/c"

    def test_explicit_relative_path_is_made_absolute(self, tmp_path, monkeypatch):
        executable(tmp_path / "prog")
        monkeypatch.chdir(tmp_path)  # as from the CLI: the launch cwd is the process's
        config = cfg(program=("prog",), executable_cache_path="rel/cache")
        (inst,) = make_plan(config, {"PATH": ""}, str(tmp_path)).instances
        assert inst.env["POPDIST_EXECUTABLE_CACHE_PATH"] == str(tmp_path / "rel" / "cache")

    def test_temporary_placeholder_in_a_dry_run_plan(self, tmp_path):
        executable(tmp_path / "prog")
        config = cfg(num_instances=2, num_replicas=2, program=("prog",))
        launch_plan = make_plan(config, {}, str(tmp_path))
        assert launch_plan.cache_mode is CacheMode.TEMPORARY
        assert {i.env["POPDIST_EXECUTABLE_CACHE_PATH"] for i in launch_plan.instances} == {
            DRY_RUN_CACHE_DIR}

    @pytest.mark.parametrize("kw,environ", [
        (dict(num_instances=2, num_replicas=2), {"POPTORCH_CACHE_DIR": "/t"}),
        (dict(num_instances=2, num_replicas=2, executable_cache_path=""), {}),
        (dict(num_instances=1), {}),
    ])
    def test_no_cache_variable_without_a_poprun_cache(self, tmp_path, kw, environ):
        executable(tmp_path / "prog")
        config = cfg(program=("prog",), **kw)
        launch_plan = make_plan(config, environ, str(tmp_path))
        assert launch_plan.cache_mode in (CacheMode.FRAMEWORK, CacheMode.NONE)
        assert all("POPDIST_EXECUTABLE_CACHE_PATH" not in i.env for i in launch_plan.instances)
        # nor when the caller hands plan() cache paths anyway
        direct = do_plan(config, environ, cache_paths={"localhost": "/c"})
        assert all("POPDIST_EXECUTABLE_CACHE_PATH" not in i.env for i in direct.instances)


class TestMakePlan:
    def test_program_on_path_keeps_its_name(self, tmp_path):
        bindir = tmp_path / "bin"
        bindir.mkdir()
        executable(bindir / "tool")
        config = cfg(program=("tool", "--x"), num_replicas=2)
        (inst,) = make_plan(config, {"PATH": str(bindir)}, str(tmp_path / "..")).instances
        assert inst.argv == ("tool", "--x")

    def test_program_in_cwd_without_dot_slash(self, tmp_path):
        executable(tmp_path / "local-prog")
        config = cfg(program=("local-prog", "arg"), num_replicas=2)
        (inst,) = make_plan(config, {"PATH": "/nonexistent"}, str(tmp_path)).instances
        assert inst.argv == (str(tmp_path / "local-prog"), "arg")

    def test_program_not_found(self, tmp_path):
        with pytest.raises(ConfigError, match="program 'missing-prog' not found"):
            make_plan(cfg(program=("missing-prog",)), {"PATH": "/nonexistent"}, str(tmp_path))

    def test_program_not_executable(self, tmp_path):
        executable(tmp_path / "plain", mode=0o644)
        for spelling in ("plain", "./plain", str(tmp_path / "plain")):
            with pytest.raises(ConfigError, match="not executable"):
                make_plan(cfg(program=(spelling,)), {"PATH": "/nonexistent"}, str(tmp_path))

    def test_master_port_is_a_real_port_shared_by_all(self, tmp_path):
        executable(tmp_path / "prog")
        launch_plan = make_plan(cfg(program=("prog",), num_instances=3, num_replicas=3), {},
                                str(tmp_path))
        ports = {i.env["MASTER_PORT"] for i in launch_plan.instances}
        assert len(ports) == 1
        assert 0 < int(ports.pop()) < 65536
        assert {i.env["MASTER_ADDR"] for i in launch_plan.instances} == {"127.0.0.1"}

    def test_conflict_reported_by_make_plan(self, tmp_path):
        executable(tmp_path / "prog")
        with pytest.raises(ConfigError, match="POPTORCH_CACHE_DIR=/t"):
            make_plan(cfg(program=("prog",), executable_cache_path="/x"),
                      {"POPTORCH_CACHE_DIR": "/t"}, str(tmp_path))


class TestJson:
    def test_shape(self):
        config = cfg(num_instances=2, num_replicas=4, env=("MISSING",))
        data = do_plan(config, cache_paths={"localhost": "/c"}).to_json()
        assert json.loads(json.dumps(data)) == data  # plain JSON types only
        assert data["hosts"] == ["localhost"]
        assert data["cache_mode"] == "temporary"
        assert data["unset_env"] == ["IPUOF_CONFIG_PATH"]
        assert data["num_ilds"] == 1
        assert data["warnings"] == [
            "-x MISSING: not set in poprun's environment, nothing to forward"]
        assert [i["index"] for i in data["instances"]] == [0, 1]
        inst = data["instances"][1]
        assert set(inst) == {"index", "host", "local_index", "ild", "replicas", "env", "argv",
                             "cpus", "mems"}
        assert inst["replicas"] == [2, 3]
        assert inst["argv"] == list(PROGRAM)
        assert inst["env"]["POPDIST_REPLICA_INDEX_OFFSET"] == "2"
        assert inst["cpus"] is None and inst["mems"] is None


# --- renderings -------------------------------------------------------------------------------


# The guide's example (GUIDE_TOPOLOGY): 8 replicas, 2 instances, one host, one ILD.
GUIDE_TABLE = """\
 ===========================================
|              poprun topology              |
|===========================================|
| hosts     |           localhost           |
|-----------|-------------------------------|
| ILDs      |               0               |
|-----------|-------------------------------|
| instances |       0       |       1       |
|-----------|-------------------------------|
| replicas  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
 -------------------------------------------
"""
# Tables real PopRun printed (logs and docs), with the plan each came from.
REAL_TABLES = Path(__file__).parent / "data" / "real_topology_tables.txt"


def real_tables() -> list[tuple[dict[str, str], str]]:
    """(the `# plan:` fields, the table's text) for each table in REAL_TABLES."""
    tables, plan_of, lines = [], {}, []
    for line in REAL_TABLES.read_text(encoding="utf-8").splitlines():
        if line.startswith("# plan:"):
            plan_of = dict(field.split("=") for field in line[len("# plan:"):].split())
        elif plan_of and not line.startswith("#") and line.strip():
            lines.append(line)
            if line.startswith(" -"):
                tables.append((plan_of, "\n".join(lines) + "\n"))
                plan_of, lines = {}, []
    return tables


def rows(table: str) -> list[str]:
    """The title and the rows, without the rules between them."""
    return [line for line in table.splitlines() if line.startswith("|")
            and not set(line) <= set("|=-")]


class TestTopologyTable:
    def test_guide_example(self):
        assert topology_table(do_plan(cfg(num_instances=2, num_replicas=8))) == GUIDE_TABLE

    def test_guide_example_is_the_guides_text(self):
        """The PDF of the guide lost the rules; its rows are ours."""
        text = GUIDE_TOPOLOGY.read_text(encoding="utf-8")
        start = text.index("|              poprun topology")
        table = [line for line in text[start:].splitlines()[:5]]
        assert all(line.startswith("|") and line.endswith("|") for line in table)
        assert table == rows(GUIDE_TABLE)

    @pytest.mark.parametrize("asked, real", real_tables(),
                             ids=[p["hosts"] + "-" + p["replicas"] for p, _ in real_tables()])
    def test_the_tables_real_poprun_printed(self, asked, real):
        """As real PopRun prints them: the borders, and the odd space of a centred name on the
        right."""
        launch_plan = do_plan(cfg(num_instances=int(asked["instances"]),
                                  num_replicas=int(asked["replicas"])),
                              hosts=(asked["hosts"],))
        ours = topology_table(launch_plan)
        if "[0]" in real:  # the docs quote the table without the footnote naming the host
            ours = ours.replace(f"[0] {asked['hosts']}\n", "")
        assert ours == real

    def test_the_real_tables_are_all_there(self):
        assert len(real_tables()) == 4

    def test_two_ilds(self):
        table = topology_table(do_plan(cfg(num_instances=4, num_replicas=8, num_ilds=2)))
        assert rows(table) == [
            "|              poprun topology              |",
            "| hosts     |           localhost           |",
            "| ILDs      |       0       |       1       |",
            "| instances |   0   |   1   |   2   |   3   |",
            "| replicas  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |"]

    def test_two_hosts_two_ilds(self):
        table = rows(topology_table(do_plan(cfg(num_instances=4, num_replicas=8, num_ilds=2),
                                            hosts=("pod1", "pod2"))))
        assert table[1] == "| hosts     |     pod1      |     pod2      |"
        assert table[2] == "| ILDs      |       0       |       1       |"

    def test_two_digit_replicas_widen_every_cell(self):
        lines = topology_table(do_plan(cfg(num_instances=2, num_replicas=12))).splitlines()
        assert rows("\n".join(lines))[-1] == (
            "| replicas  | 0  | 1  | 2  | 3  | 4  | 5  | 6  | 7  | 8  | 9  | 10 | 11 |")
        assert len({len(line.rstrip()) for line in lines if line.startswith("|")}) == 1

    def test_ten_replicas_keep_one_digit_cells(self):
        table = rows(topology_table(do_plan(cfg(num_instances=2, num_replicas=10))))
        assert table[-1] == "| replicas  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 |"
        assert table[3] == "| instances |         0         |         1         |"

    def test_long_host_name_becomes_a_footnote(self):
        table = topology_table(do_plan(cfg(num_instances=2, num_replicas=2),
                                       hosts=("a-very-long-host-name-indeed",)))
        assert table == (
            " ===================\n"
            "|  poprun topology  |\n"
            "|===================|\n"
            "| hosts     |  [0]  |\n"
            "|-----------|-------|\n"
            "| ILDs      |   0   |\n"
            "|-----------|-------|\n"
            "| instances | 0 | 1 |\n"
            "|-----------|-------|\n"
            "| replicas  | 0 | 1 |\n"
            " -------------------\n"
            "[0] a-very-long-host-name-indeed\n")

    def test_each_long_host_gets_its_own_marker(self):
        table = topology_table(do_plan(
            cfg(num_instances=2, num_replicas=2),
            hosts=("first-long-host.example.com", "second-long-host.example.com")))
        lines = table.splitlines()
        assert rows(table)[1] == "| hosts     |[0]|[1]|"
        assert lines[-2:] == ["[0] first-long-host.example.com",
                              "[1] second-long-host.example.com"]

    def test_short_host_names_have_no_footnotes(self):
        table = topology_table(do_plan(cfg(num_instances=2, num_replicas=8),
                                       hosts=("h1", "h2")))
        assert "[0]" not in table
        assert len(table.splitlines()) == 11


class TestTextRenderings:
    @pytest.mark.parametrize("indices,text", [
        ([0, 1, 2, 5, 7, 8], "[0-2,5,7-8]"), ([3], "[3]"), ([], "[]"),
        ([5, 4, 4, 0], "[0,4-5]"), (range(16), "[0-15]"),
    ])
    def test_fold_indices(self, indices, text):
        assert fold_indices(indices) == text

    def test_dry_run_text(self):
        config = cfg(num_instances=2, num_replicas=4, env=("MISSING", "A=x y"))
        text = dry_run_text(do_plan(config, cache_paths={"localhost": "/c"},
                                    master_port=4242))
        lines = text.splitlines()
        assert lines[0] == ("poprun dry run: 2 instance(s) on 1 host(s), 4 replica(s), "
                            "executable cache: temporary")
        assert lines[1] == "removed from every instance's environment: IPUOF_CONFIG_PATH"
        assert lines[2] == "instance 0 on localhost (local index 0), replicas [0-1], ILD 0"
        assert lines[3] == "  argv: /bin/prog --flag 'a b'"
        assert lines[4] == "  cpus: not bound  mems: not bound"
        assert "  env:  MASTER_PORT=4242" in lines
        assert "  env:  A=x y" in lines
        assert "instance 1 on localhost (local index 1), replicas [2-3], ILD 0" in lines
        assert lines[-1] == ("warning: -x MISSING: not set in poprun's environment, "
                             "nothing to forward")
        assert text.endswith("\n")

    @pytest.mark.parametrize("code,text", [
        (0, "exited with status 0"), (3, "exited with status 3"),
        (-9, "killed by SIGKILL (signal 9)"), (-15, "killed by SIGTERM (signal 15)"),
    ])
    def test_describe_status(self, code, text):
        assert describe_status(code) == text

    def test_unknown_signal_name(self):
        assert signal_name(250) == "signal 250"


class TestDryRunShowsEverything:
    """A dry run shows every step and variable a launch will give, values only the launch
    learns (from `vipu`, from the other hosts) as stand-ins marked as known at launch, made
    by the same definitions the launch uses."""

    def on_partition(self, tmp_path, environ=None, **kw):
        executable(tmp_path / "prog")
        kw = {"num_instances": 2, "num_replicas": 4, "program": ("prog",),
              "offline_mode": False, **kw}
        return make_plan(cfg(**kw), environ or {}, str(tmp_path))

    def test_the_partition_step_and_its_variables(self, tmp_path):
        launch_plan = self.on_partition(tmp_path, vipu_partition="p1")
        step = launch_plan.partition
        assert (step.name, step.required.size, step.required.num_gcds) == ("p1", 4, 2)
        text = dry_run_text(launch_plan)
        assert "V-IPU partition p1 (4 IPUs, 2 GCDs) on the server <the server of the local " \
               "vipu configuration, known at launch>:" in text
        assert "  created when missing: vipu create partition p1 --size 4 --num-gcds 2\n" in text
        assert "  reset before the job: when not reconfigurable\n" in text
        for inst in launch_plan.instances:
            env = inst.env
            assert env["IPUOF_VIPU_API_PARTITION_ID"] == "p1"
            assert env["IPUOF_VIPU_API_TIMEOUT"] == "120"
            assert env["IPUOF_VIPU_API_HOST"].endswith("known at launch>")
            assert env["IPUOF_VIPU_API_GCD_ID"] == (
                f"<{inst.index} on a partition of 4 IPUs, 2 GCDs, known at launch>")
            # What poprun creates is not reconfigurable: each instance drives its GCD.
            assert "POPDIST_NODE_DEVICE_ID" not in env
            assert f"  env:  IPUOF_VIPU_API_PARTITION_ID=p1\n" in text
        as_json = json.loads(json.dumps(launch_plan.to_json()))
        assert as_json["partition"]["create"] == [
            "vipu", "create", "partition", "p1", "--size", "4", "--num-gcds", "2"]
        assert as_json["instances"][1]["env"]["IPUOF_VIPU_API_PARTITION_ID"] == "p1"

    def test_what_the_options_and_the_environment_name_is_shown_as_it_is(self, tmp_path):
        environ = {"IPUOF_VIPU_API_PARTITION_ID": "from-env", "IPUOF_VIPU_API_PORT": "9000"}
        launch_plan = self.on_partition(
            tmp_path, environ, vipu_server_host="vh", vipu_allocation="a1",
            reset_partition=True, remove_partition=False, update_partition=True,
            num_instances=1, num_replicas=1)
        step = launch_plan.partition
        assert (step.name, step.server, step.reset, step.update, step.remove) == (
            "from-env", "vh:9000", "yes", True, False)
        assert step.create == ("create", "partition", "from-env", "--allocation", "a1",
                               "--size", "1", "--num-gcds", "1")
        (inst,) = launch_plan.instances
        assert (inst.env["IPUOF_VIPU_API_HOST"], inst.env["IPUOF_VIPU_API_PORT"]) == (
            "vh", "9000")
        # One instance, one GCD, named all the same (not reconfigurable: SDK 3.3's GCD 0).
        assert inst.env["IPUOF_VIPU_API_GCD_ID"] == (
            "<0 on a partition of 1 IPUs, 1 GCD, known at launch>")
        assert "removed at the end when poprun created it: no" in dry_run_text(launch_plan)

    def test_the_variables_are_those_a_launch_gives_on_the_partition_it_would_create(
            self, tmp_path):
        """One definition: the real partition's environment (run/vipu.py) on a partition of
        the job's shape has the values the dry run shows inside its stand-ins."""
        from poprun.run.vipu import Partition, PartitionInfo
        from poprun.text import at_launch

        launch_plan = self.on_partition(tmp_path, vipu_partition="p1", vipu_server_host="vh")
        step = launch_plan.partition
        real = Partition(name="p1", host="vh", port=8090, timeout=120,
                         info=PartitionInfo("p1", size=4, num_gcds=2), created=True,
                         remove_on_release=True, target_options=step.target_options,
                         executable="vipu", job_ipus=4)
        for inst in launch_plan.instances:
            wanted = real.environment(inst.index)
            shown = {k: v for k, v in inst.env.items() if k in wanted}
            assert shown.keys() == wanted.keys()
            for name, value in wanted.items():
                assert shown[name] in (value, at_launch(
                    f"{value} on a partition of 4 IPUs, 2 GCDs")), name

    def test_offline_there_is_no_partition_step(self, tmp_path):
        launch_plan = self.on_partition(tmp_path, offline_mode=True)
        assert launch_plan.partition is None and launch_plan.to_json()["partition"] is None
        assert "V-IPU" not in dry_run_text(launch_plan)
        assert not any(k.startswith("IPUOF_VIPU") for i in launch_plan.instances
                       for k in i.env)

    def test_a_bad_server_port_in_the_environment_is_the_launchs_error(self, tmp_path):
        with pytest.raises(ConfigError, match="IPUOF_VIPU_API_PORT='x' is not a port number"):
            self.on_partition(tmp_path, {"IPUOF_VIPU_API_PORT": "x"})

    @pytest.mark.parametrize("choice", [{"host_subnet": "127.0.0.0/8"},
                                        {"mpi_global_args": ("--mca btl_tcp_if_include lo",)}])
    def test_the_interface_variables_of_a_local_host(self, tmp_path, choice):
        launch_plan = self.on_partition(tmp_path, offline_mode=True, **choice)
        for inst in launch_plan.instances:
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE",
                         "UCX_NET_DEVICES", "FI_TCP_IFACE", "OMPI_MCA_btl_tcp_if_include"):
                assert inst.env[name] == "lo", name
            assert inst.env["MASTER_ADDR"] == "127.0.0.1"

    def test_a_remote_hosts_interface_and_address_are_known_at_launch(self, tmp_path):
        launch_plan = self.on_partition(tmp_path, offline_mode=True, hosts=("h1", "h2"),
                                        host_subnet="10.9.0.0/16")
        for inst in launch_plan.instances:
            assert inst.env["GLOO_SOCKET_IFNAME"] == (
                f"<{inst.host}'s interface matching --host-subnet 10.9.0.0/16, known at launch>")
            assert inst.env["MASTER_ADDR"] == (
                "<h1's address matching --host-subnet 10.9.0.0/16, known at launch>")
            assert inst.env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == (
                "<this machine's address as the hosts reach it, known at launch>")

    def test_no_local_interface_on_the_chosen_network_is_the_launchs_error_as_a_warning(self, tmp_path):
        import ipaddress

        from spawner.netifs import interfaces

        here = [ipaddress.ip_interface(a).ip for addresses in interfaces().values()
                for a in addresses]
        # A documentation network this machine is not on (some test machines use one).
        subnet = next(net for net in ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24")
                      if not any(ip in ipaddress.ip_network(net) for ip in here))
        # A command meant for another machine: the dry run says where a launch here stops.
        launch_plan = self.on_partition(tmp_path, offline_mode=True, host_subnet=subnet)
        (warning,) = launch_plan.warnings
        assert warning.startswith(f"localhost: no interface matches --host-subnet {subnet} ")
        assert warning.endswith(": a launch on this machine stops there")
        assert f"warning: {warning}" in dry_run_text(launch_plan)
        assert launch_plan.instances[0].env["GLOO_SOCKET_IFNAME"] == (
            f"<localhost's interface matching --host-subnet {subnet}, known at launch>")
