"""spawner/oomkills.py: reading the kernel's OOM-kill counts, and what is claimed of an
instance from them. The files are written by the test in the kernel's formats (cgroup v2's
memory.events, v1's memory.oom_control, /proc's cgroup and mountinfo): the real kernel's
counts are read in tests/test_spares_oom.py, where a real OOM kill happens."""

from __future__ import annotations

import signal

from spawner.oomkills import OomWatch, read_count, shared_counter

V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 3\noom_kill {n}\noom_group_kill 0\n"
V1_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"


def test_counts_are_read_from_either_format(tmp_path):
    (tmp_path / "v2").write_text(V2_EVENTS.format(n=4))
    (tmp_path / "v1").write_text(V1_CONTROL.format(n=7))
    (tmp_path / "odd").write_text("oom_kill x\noom_kills 3\n")
    assert read_count(str(tmp_path / "v2")) == 4
    assert read_count(str(tmp_path / "v1")) == 7
    assert read_count(str(tmp_path / "odd")) is None  # not a count: nothing claimed
    assert read_count(str(tmp_path / "missing")) is None


def mountinfo(*lines: str) -> str:
    return "".join(f"{n} 1 0:{n} / {line}\n" for n, line in enumerate(lines, 30))


def test_the_agent_s_memory_cgroup_v2_nearest_with_a_count(tmp_path):
    """cgroup v2: the agent's own cgroup has no memory.events (the controller not enabled
    for it), its parent has: the parent's count (hierarchical: it counts the agent's)."""
    mount = tmp_path / "unified"
    (mount / "job" / "step").mkdir(parents=True)
    (mount / "job" / "memory.events").write_text(V2_EVENTS.format(n=0))
    (tmp_path / "cgroup").write_text("0::/job/step\n")
    (tmp_path / "mountinfo").write_text(mountinfo(
        f"{mount} rw,nosuid - cgroup2 cgroup2 rw"))
    assert shared_counter(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) == \
        str(mount / "job" / "memory.events")


def test_the_agent_s_memory_cgroup_v1_in_a_hybrid_layout(tmp_path):
    """A hybrid layout: cgroup v2 without the memory controller, v1's memory controller
    elsewhere: v1's memory.oom_control of the agent's memory cgroup."""
    unified, memory = tmp_path / "unified", tmp_path / "memory"
    unified.mkdir()
    (memory / "slurm" / "job7").mkdir(parents=True)
    (memory / "slurm" / "job7" / "memory.oom_control").write_text(V1_CONTROL.format(n=2))
    (tmp_path / "cgroup").write_text("5:cpu:/\n4:memory:/slurm/job7\n0::/\n")
    (tmp_path / "mountinfo").write_text(mountinfo(
        f"{unified} rw - cgroup2 cgroup2 rw", f"{tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu",
        f"{memory} rw - cgroup cgroup rw,memory"))
    assert shared_counter(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) == \
        str(memory / "slurm" / "job7" / "memory.oom_control")
    (tmp_path / "cgroup").write_text("0::/\n")  # no memory cgroup at all: nothing to read
    assert shared_counter(str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")) is None


def test_only_a_sigkill_with_a_kill_counted_meanwhile_is_the_oom_killer_s(tmp_path):
    own = tmp_path / "i0"
    own.mkdir()
    events = own / "memory.events"
    events.write_text(V2_EVENTS.format(n=5))  # kills before it started are not its own
    watch = OomWatch()
    for key in (0, 1, 2):
        watch.started(key, str(own))
    events.write_text(V2_EVENTS.format(n=6))
    assert watch.killed(0, -signal.SIGKILL) == 1
    assert watch.killed(1, 1) == 0  # ended otherwise: no claim, whatever the count
    assert watch.killed(2, -signal.SIGTERM) == 0
    watch.started(3, str(own))
    assert watch.killed(3, -signal.SIGKILL) == 0  # a SIGKILL alone is no proof
    assert watch.killed(9, -signal.SIGKILL) == 0  # never started: nothing known
