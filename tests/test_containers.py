"""`--container`: the argv poprun plans for each runtime (spawner/containers.py, pure), from
each runtime's documented command line; what reaches the instance (binds, PMI_FD, the
environment); the option's validation, its TOML round trip, the SPAWN frame's field, and
the one-line errors before anything starts. Apptainer/Singularity, Charliecloud and enroot
cannot be installed here (no package in Debian 12, no registry to reach): their argv is
checked as planning only. bubblewrap and podman are run for real in
tests/test_container_runs.py."""

from __future__ import annotations

import os
import shlex
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import OFFLINE, assert_usage_error, run_poprun
from poprun.errors import ConfigError
from poprun.plan.config import LaunchConfig, load_toml
from popdist.env import (ERROR_FILE, EXECUTABLE_CACHE_PATH, PROGRESS_FILE, STACKS_FILE)
from spawner import containers as C
from spawner.lifeline import _apply, _joined
from spawner.protocol import SpawnRequest

ENV = {ERROR_FILE: "/tmp/poprun-errors-ab/3.json",
       PROGRESS_FILE: "/tmp/poprun-errors-ab/3.progress",
       STACKS_FILE: "/tmp/poprun-errors-ab/3.stacks", EXECUTABLE_CACHE_PATH: "/scratch/cache",
       "PMIX_SERVER_TMPDIR": "/tmp/poprun-x-pmix-1", "PMIX_SYSTEM_TMPDIR": "/tmp/poprun-x-pmix-1",
       "PMIX_NAMESPACE": "poprun-x-0", "PMI_FD": "12", "PATH": "/usr/bin", "HOME": "/root"}
ARGV = ("python3", "train.py", "--epochs", "2")


def wrap(runtime: str, image: str | None = None, args: tuple[str, ...] = (), **kw):
    return C.wrap(C.Container(runtime, image, args), ARGV, ENV, "/work/job", name="poprun-1-3-x",
                  python="/usr/bin/python3", **kw)


def pairs(argv: list[str], flag: str) -> list[str]:
    """Every value given to `flag` in `argv`."""
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


def test_binds_are_the_working_directory_shm_and_the_directories_the_environment_names():
    assert C.binds(ENV, "/work/job") == ("/dev/shm", "/scratch/cache", "/tmp/poprun-errors-ab",
                                        "/tmp/poprun-x-pmix-1", "/work/job")
    # one below another is bound with it; relative values and other variables are not paths
    assert C.binds({"PMIX_A": "/work/job/sub", "PMIX_B": "rel/dir", "OTHER": "/etc"},
                   "/work/job") == ("/dev/shm", "/work/job")
    assert C.binds({"TMPDIR": "/scratch/me/tmp"}, "/w") == ("/w", "/dev/shm", "/scratch/me/tmp")


def test_bwrap_binds_the_host_root_read_only_and_the_job_s_directories_writable():
    argv, env = wrap("bwrap", args=("--unshare-net",))
    assert argv[:3] == ["bwrap", "--die-with-parent", "--ro-bind"] and argv[3:5] == ["/", "/"]
    assert "--new-session" not in argv  # the instance stays in poprun's process group
    assert pairs(argv, "--bind")[:1] == ["/proc"]
    for path in ("/work/job", "/scratch/cache", "/tmp/poprun-errors-ab", "/tmp/poprun-x-pmix-1"):
        assert path in pairs(argv, "--bind")
    assert argv.index("--tmpfs") < argv.index("/tmp/poprun-errors-ab")  # bound over the tmpfs
    assert pairs(argv, "--chdir") == ["/work/job"]
    assert argv[-len(ARGV) - 2:] == ["--unshare-net", "--", *ARGV]  # the user's before the program
    assert env == ENV  # bwrap passes the environment and descriptors on as they are


def test_bwrap_with_an_image_uses_it_as_the_root():
    argv, _ = wrap("bwrap", "/images/rootfs")
    assert argv[2:5] == ["--ro-bind", "/images/rootfs", "/"]


def test_podman_passes_the_environment_by_name_and_moves_the_pmi_socket_to_3():
    argv, env = wrap("podman", "localhost/sdk:3.4", ("--device", "/dev/ipu0"))
    assert argv[:5] == ["/usr/bin/python3", "-S", "-c", C.MOVE_TO_3, "12"]
    podman = argv[5:]
    assert podman[:2] == ["podman", "run"]
    for flag in ("--rm", "--network=host", "--ipc=host", "--pid=host", "--preserve-fds=1"):
        assert flag in podman
    assert pairs(podman, "--name") == ["poprun-1-3-x"] and pairs(podman, "-w") == ["/work/job"]
    assert sorted(pairs(podman, "-e")) == sorted(ENV)  # names only: no value on the command line
    assert not any("=" in e for e in pairs(podman, "-e"))
    assert "/work/job:/work/job" in pairs(podman, "-v")
    assert "/tmp/poprun-x-pmix-1:/tmp/poprun-x-pmix-1" in pairs(podman, "-v")
    assert "/dev/shm:/dev/shm" not in pairs(podman, "-v")  # --ipc=host brings it
    assert podman[-len(ARGV) - 1:] == ["localhost/sdk:3.4", *ARGV]
    assert podman[-len(ARGV) - 3:-len(ARGV) - 1] == ["--device", "/dev/ipu0"]
    assert env["PMI_FD"] == "3" and ENV["PMI_FD"] == "12"


def test_podman_without_a_pmi_socket_or_with_it_at_3_needs_no_move():
    no_pmi = {k: v for k, v in ENV.items() if k != "PMI_FD"}
    argv, _ = C.wrap(C.Container("podman", "img"), ARGV, no_pmi, "/w", name="n")
    assert argv[0] == "podman" and "--preserve-fds=1" not in argv
    argv, env = C.wrap(C.Container("podman", "img"), ARGV, {**ENV, "PMI_FD": "3"}, "/w",
                       name="n", interactive=True)
    assert argv[0] == "podman" and "--preserve-fds=1" in argv and "-i" in argv
    assert env["PMI_FD"] == "3"


def test_the_move_to_3_runs(tmp_path):
    """MOVE_TO_3 itself, run: the descriptor it is given is 3 in the program it starts."""
    import subprocess

    read, write = os.pipe()
    high = os.dup2(write, max(read, write) + 20, inheritable=True)
    os.close(write)
    try:
        out = subprocess.run([sys.executable, "-S", "-c", C.MOVE_TO_3, str(high), sys.executable,
                              "-c", "import os; os.write(3, b'via 3'); "
                              "print(os.get_inheritable(3))"],
                             pass_fds=(high,), capture_output=True, text=True, timeout=30)
    finally:
        os.close(high)
    assert out.stdout.strip() == "True", out.stderr
    assert os.read(read, 100) == b"via 3"
    os.close(read)


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_apptainer_and_singularity_exec_with_binds_and_the_working_directory(runtime):
    argv, env = wrap(runtime, "/images/sdk.sif", ("--nv",))
    assert argv[:4] == [runtime, "exec", "--pwd", "/work/job"]
    assert "/tmp/poprun-errors-ab:/tmp/poprun-errors-ab" in pairs(argv, "--bind")
    assert argv[-len(ARGV) - 2:] == ["--nv", "/images/sdk.sif", *ARGV]
    assert env == ENV  # Apptainer passes the environment and descriptors on (PMI_FD as it is)


def test_charliecloud_runs_ch_run_with_binds_and_the_working_directory():
    argv, env = wrap("charliecloud", "/var/tmp/sdk")
    assert argv[:3] == ["ch-run", "-c", "/work/job"]
    assert "/scratch/cache:/scratch/cache" in pairs(argv, "-b")
    assert argv[-len(ARGV) - 2:] == ["/var/tmp/sdk", "--", *ARGV] and env == ENV


def test_enroot_starts_with_mounts_the_environment_by_name_and_env_chdir():
    argv, env = wrap("enroot", "sdk")
    assert argv[:2] == ["enroot", "start"]
    assert "/work/job:/work/job" in pairs(argv, "--mount")
    assert sorted(pairs(argv, "--env")) == sorted(ENV)
    assert argv[-len(ARGV) - 3:] == ["sdk", "env", "--chdir=/work/job", *ARGV] and env == ENV


def test_podman_s_128_plus_n_is_a_signal_as_for_a_bare_instance():
    podman = C.Container("podman", "img")
    assert [C.exit_status(podman, code) for code in (0, 1, 125, 128, 137, 143, 192, 255)] == [
        0, 1, 125, 128, -9, -15, -64, 255]
    for other in (C.Container("bwrap"), C.Container("apptainer", "i"), None):
        assert C.exit_status(other, 143) == 143 and C.exit_status(other, -15) == -15


def test_only_podman_writes_the_program_s_pid_for_the_spawner_to_signal_it():
    argv, _ = C.wrap(C.Container("podman", "img"), ARGV, {}, "/w", name="n", pidfile="/e/n.pid")
    assert "--pidfile=/e/n.pid" in argv[:argv.index("img")]
    assert not any(a.startswith("--pidfile") for a in C.wrap(
        C.Container("podman", "img"), ARGV, {}, "/w", name="n")[0])
    assert C.SIGNALLED_INSIDE == {"podman"}


def test_the_program_inside_is_told_by_its_environment(tmp_path):
    """spawner/inside.py with real processes: the pid file names nothing yet (WAITING), a
    live process without the instance's entry (runc's init: WAITING), the program (RUNNING),
    a process that has exited (ENDED); a signal reaches the program's group."""
    import signal
    import subprocess

    from spawner import inside

    identity = b"POPDIST_ERROR_FILE=/e/3.json"
    pidfile = tmp_path / "n.pid"
    assert inside.state(str(pidfile), identity) == (inside.WAITING, None)
    pidfile.write_text("")
    assert inside.state(str(pidfile), identity) == (inside.WAITING, None)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    init = subprocess.Popen(sleep, env={}, start_new_session=True)
    program = subprocess.Popen(sleep, env={"POPDIST_ERROR_FILE": "/e/3.json"},
                               start_new_session=True)
    try:
        pidfile.write_text(f"{init.pid}\n")
        assert inside.state(str(pidfile), identity) == (inside.WAITING, None)
        pidfile.write_text(str(program.pid))
        assert inside.state(str(pidfile), identity) == (inside.RUNNING, program.pid)
        inside.signal_program(program.pid, signal.SIGTERM)
        assert program.wait(timeout=30) == -signal.SIGTERM
        assert inside.state(str(pidfile), identity) == (inside.ENDED, None)
    finally:
        for proc in (init, program):
            proc.kill()
            proc.wait()
    pidfile.write_text(str(init.pid))  # reaped: gone
    assert inside.state(str(pidfile), identity) == (inside.ENDED, None)


def test_only_podman_leaves_a_container_to_remove():
    assert C.cleanup(C.Container("podman", "img"), "poprun-1-3-x") == [
        "podman", "rm", "--force", "--ignore", "--time", "0", "poprun-1-3-x"]
    for runtime in ("bwrap", "apptainer", "singularity", "charliecloud", "enroot"):
        assert C.cleanup(C.Container(runtime, "img"), "n") is None


def test_the_lifeline_keeps_cleanup_commands_until_they_are_discarded():
    commands: set[bytes] = set()
    argv = ["podman", "rm", "--force", "a b"]
    message = b"r" + _joined(argv) + b"\0" + b"r" + _joined(["x"]) + b"\0s" + _joined(["x"])
    assert _apply(message + b"\0r" + b"partial", set(), set(), set(), [], set(), [], [],
                  commands) == b"rpartial"
    assert commands == {_joined(argv)}


@pytest.mark.parametrize("config, error", [
    ({"container": "docker"}, "--container=docker: not a runtime poprun knows (one of bwrap, "
     "podman, apptainer, singularity, charliecloud, enroot)"),
    ({"container": "podman"}, "--container=podman needs --container-image"),
    ({"container": "enroot", "container_image": ""}, "--container=enroot needs --container-image"),
    ({"container_image": "img"}, "--container-image and --container-args need --container"),
    ({"container_args": ("--nv",)}, "--container-image and --container-args need --container"),
    ({"container": "bwrap", "container_args": ("'unclosed",)}, "--container-args: No closing"),
    ({"container": "bwrap", "container_args": ("x" * 5000,)}, "too long"),
])
def test_bad_container_options_are_config_errors(config, error):
    with pytest.raises(ConfigError, match=__import__("re").escape(error)):
        LaunchConfig(program=("true",), **config)


def test_container_args_are_split_as_a_shell_would_and_accumulate():
    config = LaunchConfig(program=("true",), container="podman", container_image="img",
                          container_args=("--device /dev/ipu0 -v '/a b:/c'", "--nv"))
    assert config.container_spec == C.Container("podman", "img",
                                                ("--device", "/dev/ipu0", "-v", "/a b:/c", "--nv"))
    assert LaunchConfig(program=("true",)).container_spec is None
    assert LaunchConfig(program=("true",), container="bwrap").container_spec.image is None


def test_the_container_options_round_trip_through_toml(tmp_path):
    config = LaunchConfig(program=("true",), container="apptainer", container_image="/i.sif",
                          container_args=("--nv",))
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml())
    assert LaunchConfig(**load_toml(str(path))) == config


def test_a_spawn_frame_carries_the_container_and_refuses_a_bad_one():
    request = SpawnRequest(key=1, argv=("true",), container=C.Container("podman", "img", ("-i",)))
    fields = request.to_fields()
    assert SpawnRequest.from_fields(fields) == request
    assert SpawnRequest.from_fields({**fields, "container": None}).container is None
    for bad, kind in (({"runtime": "docker"}, ValueError), ({"runtime": "podman"}, ValueError),
                      ({"runtime": "bwrap", "args": [1]}, TypeError), ("bwrap", TypeError),
                      ({"runtime": "bwrap", "args": ["x"] * (C.MAX_ARGS + 1)}, ValueError)):
        with pytest.raises(kind):
            SpawnRequest.from_fields({**fields, "container": bad})


@pytest.mark.parametrize("args, fragment", [
    (("--container", "docker"), "--container=docker: not a runtime poprun knows"),
    (("--container", "podman"), "--container=podman needs --container-image"),
    (("--container-args", "--nv"), "--container-image and --container-args need --container"),
])
def test_bad_container_options_are_one_line_exit_2(args, fragment):
    assert_usage_error(run_poprun(*OFFLINE, *args, "true"), fragment)


def test_a_runtime_missing_on_this_host_is_one_line_exit_2_and_nothing_starts(tmp_path):
    marker = tmp_path / "ran"
    proc = run_poprun(*OFFLINE, "--container", "podman", "--container-image", "img",
                      "sh", "-c", f"touch {shlex.quote(str(marker))}",
                      env={"PATH": os.path.dirname(sys.executable)})
    assert_usage_error(proc, "--container=podman: podman not found on PATH on this host")
    assert not marker.exists()


def test_a_dry_run_names_the_container(tmp_path):
    """Apptainer is not installable here: a stand-in on PATH (a dry run never runs it; the
    pre-flight only looks for it)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "apptainer").write_text("#!/bin/sh\nexit 99\n")
    (tmp_path / "bin" / "apptainer").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    args = (*OFFLINE, "--dry-run", "--container", "apptainer", "--container-image", "sdk.sif",
            "--container-args", "--nv", "python3", "x.py")
    text = run_poprun(*args, cwd=tmp_path, env=env)
    assert text.returncode == 0, text.stderr
    assert text.stdout.decode().startswith(
        "container: apptainer sdk.sif --nv: each argv below runs inside it")
    import json

    shown = json.loads(run_poprun(*args[:-2], "--json", *args[-2:], cwd=tmp_path, env=env).stdout)
    assert shown["container"] == {"runtime": "apptainer", "image": "sdk.sif", "args": ["--nv"]}
    assert "container" not in json.loads(run_poprun(*OFFLINE, "--dry-run", "--json", "true",
                                                    cwd=tmp_path).stdout)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "runtime": st.sampled_from(C.RUNTIMES) | JSON, "image": st.text(max_size=50) | JSON,
    "args": st.lists(st.text(max_size=50), max_size=300) | JSON})


@settings(max_examples=200, deadline=None, database=None)
@given(fields=FIELDS | JSON)
def test_any_container_field_is_a_valid_container_or_refused(fields):
    """A SPAWN frame's `container` (the agent's side): whatever it holds, a Container that
    passes the same check as the launcher's options, or TypeError/ValueError, which the
    agent answers with SPAWN_FAILED (never an exception that ends it)."""
    try:
        container = C.Container.from_fields(fields)
    except (TypeError, ValueError):
        return
    if container is not None:
        assert container.problem() is None and len(container.args) <= C.MAX_ARGS
        argv, _ = C.wrap(container, ARGV, ENV, "/w", name="n")
        assert argv[-len(ARGV):] == list(ARGV)
