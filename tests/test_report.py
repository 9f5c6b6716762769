"""What a person reads after a job: the failure report, the -v summary, --result-json."""

from __future__ import annotations

import itertools
import json
import re
import sys

import pytest

from conftest import OFFLINE, run_poprun

pytestmark = pytest.mark.timeout(60)
PY = sys.executable
# Instance 1 writes to stderr and fails; the others wait to be stopped.
FAILING = ("import os, sys, time\n"
           "if os.environ['RANK'] == '1':\n"
           "    print('out of cheese', file=sys.stderr); sys.exit(3)\n"
           "print('waiting', flush=True); time.sleep(300)\n")


def test_report_names_the_root_cause_even_when_its_output_was_hidden(tmp_path):
    proc = run_poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3",
                      "--only-output-from-instance=0", "--kill-timeout=2",
                      "--result-json", str(tmp_path / "r.json"), PY, "-c", FAILING)
    err = proc.stderr.decode()
    assert proc.returncode == 3, err
    assert "instance 1 (pid" in err and "failed first: exited with status 3" in err, err
    assert "    out of cheese" in err  # its stderr tail, though --only-output hid it
    assert "instances [0,2] on localhost: terminated by poprun (SIGTERM)" in err, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["exit_code"] == 3 and result["root_cause"] == 1
    by_index = {i["index"]: i for i in result["instances"]}
    assert by_index[1]["exit_status"] == 3 and by_index[1]["signal"] is None
    assert by_index[0]["signal"] == "SIGTERM" and by_index[0]["stopped_by_poprun"]
    assert by_index[1]["lines"] == 1 and all(i["pid"] > 0 for i in by_index.values())
    assert all(i["start_time"] <= i["end_time"] for i in by_index.values())
    assert set(result["phases"]["localhost"]) == {"first_started", "first_output"}


def test_a_good_job_gets_one_summary_line_per_host_at_v():
    proc = run_poprun(*OFFLINE, "-v", "--num-instances=2", "--num-replicas=2", PY, "-c",
                      "print('a'); print('b')")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "poprun: localhost: instances [0-1] exited with status 0 in " in err, err
    assert ", 4 lines" in err
    quiet = run_poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", PY, "-c", "pass")
    assert quiet.stderr == b""  # nothing at all without -v


def test_a_result_file_that_fails_after_the_job_is_a_warning_not_a_different_exit():
    """A path that cannot be written is refused before the job (test_output_errors); one
    that fails only at the end (a full disk: /dev/full) is a warning, the job's status kept."""
    proc = run_poprun(*OFFLINE, "--result-json", "/dev/full", PY, "-c", "pass")
    assert proc.returncode == 0
    assert "cannot write --result-json /dev/full: No space left on device" in \
        proc.stderr.decode()


def test_v_shows_each_decision_and_vv_each_command():
    """-v: placement, cache dir (and, with hosts or V-IPU, their steps: see test_multihost and
    test_vipu); -vv: each instance's binding and exact command, in the original's shape."""
    proc = run_poprun(*OFFLINE, "-vv", "--num-instances=2", "--num-replicas=2", PY, "-c", "pass")
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    shape = r"^\d\d:\d\d:\d\d\.\d{3} \d+ POPRUN \[[IDWE]\] "
    for needle in (r"\[I\] process placement: spreadnuma \(2 instance\(s\) per host\)",
                   r"\[I\] executable cache \(temporary\): /",
                   r"\[D\] instance 1 on localhost: cpus \S+, memory nodes \S+",
                   r"\[D\] started instance 0 on localhost, pid \d+: \S*python\S* -c pass",
                   r"\[I\] removed temporary executable cache /"):
        assert any(re.match(shape, line) and re.search(needle, line)
                   for line in err.splitlines()), (needle, err)


def _failed_result():
    from poprun.result import InstanceResult, LaunchResult

    tail = (b"[bold]not markup[/bold]", b"bad \xff byte")
    return LaunchResult(instances=(
        InstanceResult(0, "localhost", 10, -15, 1.0, 2.0, 1, stopped_by_poprun=True),
        InstanceResult(1, "localhost", 11, 3, 1.0, 1.5, 2, stderr_tail=tail),
    ), exit_code=3, root_cause=1)


def test_the_report_is_plain_text_unless_rich_would_style_its_fd():
    """render_report (what the launcher writes): failure_report()'s bytes where rich would
    not style the fd; rich's styles around the same words where it would, the instance's
    stderr as text (its brackets are not markup)."""
    import os

    from poprun.result import LaunchResult

    from poprun.view.render import render_report

    result = _failed_result()
    read_end, write_end = os.pipe()
    try:
        assert render_report(result, write_end, {}) == result.failure_report().encode()
        styled = render_report(result, write_end, {"FORCE_COLOR": "1", "TERM": "xterm"})
        assert render_report(result, write_end, {"FORCE_COLOR": "1", "TERM": "dumb"}) == (
            result.failure_report().encode())
        good = LaunchResult(instances=result.instances[:1], exit_code=0)
        assert render_report(good, write_end, {}) == b""
        assert render_report(good, write_end, {}, verbose=True) == good.summary().encode()
    finally:
        os.close(read_end)
        os.close(write_end)
    assert b"\x1b[1;31mpoprun: instance 1 (pid 11 on localhost) failed first" in styled
    assert re.sub(rb"\x1b\[[\d;]*m", b"", styled) == result.failure_report().encode()
    assert b"    [bold]not markup[/bold]\n" in styled


# The report's stderr tail splits only a block's end (run/output.py last_lines): the same lines
# as splitting all of it, whatever the line ends (`\r` progress, `\r\n`, none at the end):
# every block of up to 7 such pieces.
def test_last_lines_are_the_block_s_last_lines():
    from poprun.run.output import last_lines

    pieces = (b"ab", b"\n", b"\r", b"\r\n")
    for size in range(8):
        for block in map(b"".join, itertools.product(pieces, repeat=size)):
            for count in (1, 2, 3):
                assert last_lines(block, count) == block.splitlines()[-count:], (block, count)
