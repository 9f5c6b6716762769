"""Folded output: the pure core (poprun/fold.py) and real runs of
`poprun --fold-output` and `poprunctl logs --fold`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spawner.cpulist import parse_cpu_list

from conftest import (SRC, OFFLINE, assert_usage_error, poprun_argv, poprun_env, reaped,
                      run_poprunctl)
from poprun.fold import BOUND, Folder
from poprun.jobctl import records as jobs
from poprun.run.folding import TEST_BOUND_VARIABLE
from sshd_hosts import wait_until
from terminal import run_on_a_terminal

OUT, ERR = "stdout", "stderr"


def lines_of(released, stream=OUT):
    """[(keys, line)] in print order."""
    return [(keys, line) for keys, s, data in released if s == stream
            for line in data.splitlines(keepends=True)]


# --- the core ---------------------------------------------------------------------------

def test_a_line_every_instance_wrote_is_printed_once_when_the_last_writes_it():
    folder = Folder(range(3))
    assert folder.add(0, OUT, b"warning\n", 0.0) == []
    assert folder.add(1, OUT, b"warning\n", 0.001) == []
    assert folder.add(2, OUT, b"warning\n", 0.002) == [((0, 1, 2), OUT, b"warning\n")]
    assert folder.held == 0 and folder.deadline() is None


def test_the_64_instance_case_one_warning_and_every_own_loss():
    folder = Folder(range(64))
    out = []
    for i in range(64):
        out += folder.add(i, OUT, b"warning: deprecated\nloss %d\n" % i, i * 1e-4)
    out += folder.flush()
    printed = lines_of(out)
    assert printed[0] == (tuple(range(64)), b"warning: deprecated\n")
    assert sorted(printed[1:]) == sorted((i, b"loss %d\n" % i) for i in range(64))


def test_own_lines_are_released_once_every_instance_went_past_them():
    folder = Folder(range(2))
    assert folder.add(0, OUT, b"loss 0\n", 0.0) == []
    # Instance 1 writes something else: it cannot write `loss 0` before its own line any more.
    out = folder.add(1, OUT, b"loss 1\n", 0.0)
    assert lines_of(out) == [(0, b"loss 0\n")]
    assert folder.held == 1  # loss 1: instance 0 may still write it


def test_no_line_waits_more_than_the_bound():
    folder = Folder(range(4))
    folder.add(0, OUT, b"a\n", 0.0)
    folder.add(1, OUT, b"a\n", 0.05)
    assert folder.deadline() == BOUND
    assert folder.expire(BOUND - 0.001) == []
    assert folder.expire(BOUND) == [((0, 1), OUT, b"a\n")]
    # A late identical line prints on its own (its run was printed).
    folder.add(2, OUT, b"a\n", 0.2)
    assert folder.expire(0.2 + BOUND) == [(2, OUT, b"a\n")]


def test_an_exited_instance_no_longer_counts():
    folder = Folder(range(3))
    folder.add(0, OUT, b"x\n", 0.0)
    folder.add(1, OUT, b"x\n", 0.0)
    assert folder.exited(2) == [((0, 1), OUT, b"x\n")]


def test_an_instance_that_exits_after_writing_releases_what_waited_for_it():
    folder = Folder(range(2))
    folder.add(0, OUT, b"only 0\n", 0.0)
    assert folder.exited(1) == [(0, OUT, b"only 0\n")]
    assert folder.exited(0) == []


def test_each_instances_order_holds_when_lines_come_in_another_order():
    folder = Folder(range(2))
    out = folder.add(0, OUT, b"A\nB\n", 0.0)
    out += folder.add(1, OUT, b"B\nA\n", 0.0)
    out += folder.flush()
    for key in (0, 1):
        mine = [line for keys, line in lines_of(out)
                if keys == key or (isinstance(keys, tuple) and key in keys)]
        assert mine == ([b"A\n", b"B\n"] if key == 0 else [b"B\n", b"A\n"])
    assert len(lines_of(out)) == 3  # one of the two folds, the other cannot


def test_a_held_line_is_not_overtaken_by_its_instances_next_line():
    folder = Folder(range(3))
    out = folder.add(0, OUT, b"common\n", 0.0)
    out += folder.add(0, OUT, b"mine\n", 0.01)
    out += folder.add(1, OUT, b"common\n", 0.02)
    out += folder.expire(BOUND)  # 2 never wrote: the bound lets it go...
    assert lines_of(out) == [((0, 1), b"common\n")]
    out += folder.expire(BOUND + 0.01)  # ... and the next line at its own
    assert lines_of(out) == [((0, 1), b"common\n"), (0, b"mine\n")]


def test_blocks_cut_at_different_lines_fold_whole():
    """seq-like output read in blocks of different sizes by each instance: every line once."""
    text = b"".join(b"%058d\n" % i for i in range(5000))
    rng = random.Random(7)
    folder = Folder(range(4))
    cursors = [0] * 4
    out = []
    while any(c < len(text) for c in cursors):
        key = rng.randrange(4)
        if cursors[key] >= len(text):
            continue
        end = text.rfind(b"\n", cursors[key], cursors[key] + rng.randrange(100, 9000)) + 1
        end = end or text.index(b"\n", cursors[key]) + 1
        if end <= cursors[key]:
            end = text.index(b"\n", cursors[key]) + 1
        out += folder.add(key, OUT, text[cursors[key]:end], 0.0)
        cursors[key] = end
    out += folder.flush()
    assert all(keys == (0, 1, 2, 3) for keys, _, _ in out)
    assert b"".join(data for _, _, data in out) == text
    assert len(out) < 5000 // 20  # consecutive folded runs come out as blocks, not lines


def test_lines_that_part_inside_a_block_fold_where_they_agree():
    folder = Folder(range(2))
    out = folder.add(0, OUT, b"a\nb\nmine 0\nc\nd\n", 0.0)
    out += folder.add(1, OUT, b"a\nb\nmine 1\nc\nd\n", 0.0)
    out += folder.flush()
    assert lines_of(out) == [((0, 1), b"a\n"), ((0, 1), b"b\n"), (0, b"mine 0\n"),
                             (1, b"mine 1\n"), ((0, 1), b"c\n"), ((0, 1), b"d\n")]


def test_streams_fold_apart():
    folder = Folder(range(2))
    out = folder.add(0, ERR, b"w\n", 0.0) + folder.add(1, OUT, b"w\n", 0.0)
    out += folder.flush()
    assert sorted(out) == [(0, ERR, b"w\n"), (1, OUT, b"w\n")]


def test_an_unterminated_piece_never_folds_and_keeps_its_place():
    folder = Folder(range(2))
    out = folder.add(0, OUT, b"x\n50%\r", 0.0)
    out += folder.add(1, OUT, b"x\n50%\r", 0.0)
    out += folder.add(0, OUT, b"\ndone\n", 0.0)
    out += folder.add(1, OUT, b"\ndone\n", 0.0)
    out += folder.flush()
    assert [(k, d) for k, _, d in out][0] == ((0, 1), b"x\n")
    mine = [d for k, _, d in out if k == 0]
    assert mine[0] == b"50%\r" and mine[1].startswith(b"\n")
    assert ((0, 1), OUT, b"done\n") in out


def test_repeated_lines_join_the_earliest_run_they_can():
    folder = Folder(range(2))
    out = folder.add(0, OUT, b"---\nx\n---\n", 0.0)
    out += folder.add(1, OUT, b"---\n", 0.0)
    out += folder.add(1, OUT, b"x\n---\n", 0.0)
    assert lines_of(out) == [((0, 1), b"---\nx\n---\n")] or lines_of(out) == [
        ((0, 1), b"---\n"), ((0, 1), b"x\n"), ((0, 1), b"---\n")]


def test_random_interleavings_keep_every_line_and_every_order():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randrange(2, 6)
        words = [b"w%d\n" % rng.randrange(6) for _ in range(30)]
        outputs = {k: [rng.choice(words) for _ in range(rng.randrange(0, 12))]
                   for k in range(n)}
        pending = {k: list(v) for k, v in outputs.items()}
        folder, out, now = Folder(range(n)), [], 0.0
        while any(pending.values()):
            key = rng.choice([k for k, v in pending.items() if v])
            take = rng.randrange(1, 4)
            block, pending[key] = b"".join(pending[key][:take]), pending[key][take:]
            now += rng.random() * 0.03
            out += folder.add(key, OUT, block, now) + folder.expire(now)
            if not pending[key] and rng.random() < 0.5:
                out += folder.exited(key)
        out += folder.flush()
        for key, expected in outputs.items():
            mine = [line for keys, line in lines_of(out)
                    if keys == key or (isinstance(keys, tuple) and key in keys)]
            assert mine == expected, (outputs, out)


# --- real runs --------------------------------------------------------------------------
# Each instance says it is ready, waits for a shared lock the test holds, then prints the
# same warning and its own loss: released together, their warnings come within the bound
# (instances that start over a second, on a loaded machine or another host, would not).
# After the lock only shell builtins run: 64 execs would take longer than the bound here.

TRAIN = ('exec 9<"$FOLD_DIR/go"; touch "$FOLD_DIR/ready.$RANK"; flock -s 9; '
         'echo "warning: deprecated"; echo "loss $RANK"')
N = 64
# The bound, for these tests only: their instances, released together, still write over
# more than 100 ms on a loaded 2-core machine (the bound's own tests keep 100 ms).
SLOW_MACHINE = {TEST_BOUND_VARIABLE: "10"}


@contextlib.contextmanager
def held_start(tmp_path: Path, count: int):
    """The lock the instances wait on, held until `count` of them are ready (then the
    context's body ends by releasing it: `ready()` waits for that)."""
    go = tmp_path / "go"
    go.touch()
    with open(go) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)

        def release(proc=None) -> None:
            """(Or `proc` ended: it says why.)"""
            wait_until(lambda: len(list(tmp_path.glob("ready.*"))) >= count or (
                proc is not None and proc.poll() is not None), f"{count} instances ready",
                timeout=120)
            fcntl.flock(lock, fcntl.LOCK_UN)
        yield release


def fold_run(tmp_path: Path, *args: str, count: int = N, env: dict | None = None,
             argv_prefix: tuple = (), popen=None) -> tuple[int, bytes, bytes]:
    """poprun (`args` before the program) with TRAIN in `count` instances, released together."""
    env = {**(env or {}), "FOLD_DIR": str(tmp_path), **SLOW_MACHINE}
    argv = [*argv_prefix, *poprun_argv(*OFFLINE, f"--num-instances={count}",
                                       f"--num-replicas={count}", *args, "sh", "-c", TRAIN)]
    with held_start(tmp_path, count) as release:
        start = popen or (lambda: subprocess.Popen(argv, env=poprun_env(env), cwd=tmp_path,
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE))
        with reaped(start()) as proc:
            release(proc)
            out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err






def expected_console(tagged: bool) -> list[bytes]:
    if tagged:
        return [b"[1,0-63]<stdout>:warning: deprecated"] + [
            b"[1,%d]<stdout>:loss %d" % (i, i) for i in range(N)]
    return [b"[0-63] warning: deprecated"] + [b"[%d] loss %d" % (i, i) for i in range(N)]


@pytest.mark.timeout(240)
def test_64_instances_one_warning_and_64_losses_on_the_console_all_128_kept(job_state,
                                                                            tmp_path):
    code, out, err = fold_run(tmp_path, "--tag-output", "--fold-output",
                              "--output-filename", "files", env=job_state)
    assert code == 0, err.decode()[-2000:]
    console = out.splitlines()
    assert console[0] == expected_console(True)[0]
    assert sorted(console) == sorted(expected_console(True))  # 1 + 64 lines
    for i in range(N):  # the files keep each instance's own lines
        assert (tmp_path / "files" / "1" / f"rank.{i}" / "stdout").read_bytes() == \
            b"warning: deprecated\nloss %d\n" % i


@pytest.mark.timeout(240)
def test_the_job_log_keeps_every_line_and_logs_fold_folds_it(job_state, tmp_path):
    code, out, err = fold_run(tmp_path, "--fold-output", env=job_state)
    assert code == 0, err.decode()[-2000:]
    assert sorted(out.splitlines()) == sorted(expected_console(False))
    (record,) = jobs.scan(job_state).records
    kept = run_poprunctl("logs", record["id"], env=job_state)
    assert kept.returncode == 0, kept.stderr
    assert sorted(kept.stdout.splitlines()) == sorted(
        [b"[1,%d]<stdout>:warning: deprecated" % i for i in range(N)]
        + [b"[1,%d]<stdout>:loss %d" % (i, i) for i in range(N)])  # all 128
    folded = run_poprunctl("logs", record["id"], "--fold", env=job_state)
    assert folded.returncode == 0, folded.stderr
    assert sorted(folded.stdout.splitlines()) == sorted(expected_console(True))
    one = run_poprunctl("logs", record["id"], "--fold", "-i", "3", "-i", "5", "--json",
                        env=job_state)
    first, *losses = [json.loads(line) for line in one.stdout.splitlines()]
    assert first == {"instances": [3, 5], "stream": "stdout", "line": "warning: deprecated"}
    assert sorted(losses, key=str) == [{"instance": 3, "stream": "stdout", "line": "loss 3"},
                                       {"instance": 5, "stream": "stdout", "line": "loss 5"}]


def test_the_variable_turns_it_on_and_a_bad_value_is_one_line(poprun, tmp_path):
    code, out, err = fold_run(tmp_path, count=4, env={"POPRUN_FOLD_OUTPUT": "1"})
    assert code == 0, err.decode()
    assert out.splitlines()[0] == b"[0-3] warning: deprecated" and len(out.splitlines()) == 5
    # The option given on the command line wins over the variable.
    proc = poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--fold-output=no",
                  "echo", "same", env={"POPRUN_FOLD_OUTPUT": "1"})
    assert proc.stdout == b"same\nsame\n"
    bad = poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "true",
                 env={"POPRUN_FOLD_OUTPUT": "maybe"})
    assert_usage_error(bad, "POPRUN_FOLD_OUTPUT='maybe' is not a boolean")


def test_lines_that_differ_print_as_today_and_a_failure_flushes_what_is_held(poprun,
                                                                            tmp_path):
    program = ("import os, pathlib, sys, time\n"
               "rank, here = int(os.environ['RANK']), pathlib.Path(sys.argv[1])\n"
               "if rank == 1:  # fails once the others have written\n"
               "    while not all((here / f'wrote.{i}').exists() for i in (0, 2)):\n"
               "        time.sleep(0.01)\n"
               "print('same', flush=True)\n"
               "print('own', rank, flush=True)\n"
               "(here / f'wrote.{rank}').touch()\n"
               "if rank == 1:\n"
               "    print('bad', file=sys.stderr, flush=True)\n"
               "    sys.exit(3)\n"
               "time.sleep(30)\n")
    proc = poprun(*OFFLINE, "--num-instances=3", "--num-replicas=3", "--tag-output",
                  "--fold-output", "--kill-timeout=5", sys.executable, "-c", program,
                  str(tmp_path))
    assert proc.returncode == 3, proc.stderr.decode()
    lines = proc.stdout.splitlines()
    # Every instance's lines are there, in its order, whatever set `same` was printed with.
    for rank in range(3):
        mine = [line.partition(b":")[2] for line in lines
                if rank in instances(line.partition(b"]")[0][3:])]
        assert mine == [b"same", b"own %d" % rank], proc.stdout
    assert b"[1,1]<stderr>:bad\n" in proc.stderr


def instances(label: bytes) -> tuple[int, ...]:
    """A tag's set (`0-2,5`, braced or not) as instance indices: the CPU-list format."""
    return parse_cpu_list(label.strip(b"{}").decode())


def test_timestamps_and_one_instance_only_keep_working(poprun, tmp_path):
    code, out, err = fold_run(tmp_path, "--fold-output", "--timestamp-output", "--tag-output",
                              count=2)
    assert code == 0, err.decode()
    date = rb"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    assert re.fullmatch(date + rb"\[1,0-1\]<stdout>:warning: deprecated\n(" + date
                        + rb"\[1,[01]\]<stdout>:loss [01]\n){2}", out), out
    only = poprun(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--fold-output",
                  "--only-output-from-instance=1", "sh", "-c", "echo same $RANK")
    assert only.stdout == b"same 1\n"


@pytest.mark.timeout(180)
def test_across_two_ssh_hosts(tmp_path):
    from sshd_hosts import start_ssh_hosts

    with start_ssh_hosts(2, tmp_path) as hosts:
        code, out, err = fold_run(tmp_path, "--host", "h1,h2", "-x", "FOLD_DIR", "--tag-output",
                                  "--fold-output", count=8, env={"HOME": hosts.env()["HOME"]})
    assert code == 0, err.decode()[-2000:]
    console = out.splitlines()
    assert console[0] == b"[1,0-7]<stdout>:warning: deprecated"
    assert sorted(console[1:]) == sorted(b"[1,%d]<stdout>:loss %d" % (i, i) for i in range(8))


@pytest.mark.timeout(240)
def test_under_slurm(slurm_cluster, tmp_path):
    slurm_cluster.reset()
    argv = ["salloc", "-N2", "--ntasks-per-node=4", *poprun_argv(
        *OFFLINE, "--num-replicas=8", "--tag-output", "--fold-output", "sh", "-c", TRAIN)]
    env = {"PYTHONPATH": SRC, "POPRUN_NO_DASHBOARD": "1", "FOLD_DIR": str(tmp_path),
           **SLOW_MACHINE}
    with held_start(tmp_path, 8) as release:
        with reaped(slurm_cluster.popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)) as proc:
            release(proc)
            out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()[-2000:]
    console = out.splitlines()
    assert console[0] == b"[1,0-7]<stdout>:warning: deprecated", out
    assert sorted(console[1:]) == sorted(b"[1,%d]<stdout>:loss %d" % (i, i) for i in range(8))


ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def test_with_the_dashboard_on_a_terminal(tmp_path):
    """The panel shows, the folded line passes above it once (its set grey), every loss
    once; a held line's timer writes through the panel as instance output does (the last
    `late` line: the others, asleep, write nothing after it, so only the bound lets it go;
    0.8 s here, for the warnings of 8 instances on a loaded machine)."""
    result = {}
    argv = (*OFFLINE, "--num-instances=8", "--num-replicas=8", "--tag-output", "--fold-output",
            "sh", "-c", TRAIN + '; sleep 0.3; echo "late $RANK"; sleep 2')
    with held_start(tmp_path, 8) as release:
        worker = threading.Thread(target=lambda: result.update(zip(
            ("code", "raw"), run_on_a_terminal(*argv, env={"FOLD_DIR": str(tmp_path),
                                                           TEST_BOUND_VARIABLE: "0.8"},
                                               timeout=90))))
        worker.start()
        try:
            release()
        finally:
            worker.join(120)
    code, raw = result["code"], result["raw"]
    assert code == 0, raw[-3000:]
    assert b"instances: 8" in raw  # the panel was drawn
    lines = [line.decode() for line in re.split(rb"\r*\n|\r", ANSI.sub(b"", raw))]
    assert lines.count("[1,0-7]<stdout>:warning: deprecated") == 1
    for i in range(8):
        assert lines.count(f"[1,{i}]<stdout>:loss {i}") == 1
        assert lines.count(f"[1,{i}]<stdout>:late {i}") == 1
    assert b"\x1b[90m[1,0-7]<stdout>:" in raw  # grey, apart from the instances' colours


def test_a_line_no_other_instance_writes_comes_out_at_the_bound_not_at_the_end(tmp_path):
    """Instance 0 writes a line, instance 1 nothing: nothing says 1 will not write it too, so
    the line waits for the bound (the loop's timer), not for the job's end 5 s later."""
    argv = poprun_argv(*OFFLINE, "--num-instances=2", "--num-replicas=2", "--fold-output",
                       "sh", "-c", '[ "$RANK" = 0 ] && echo alone && touch wrote; sleep 5')
    with reaped(subprocess.Popen(argv, env=poprun_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL)) as proc:
        wait_until(lambda: (tmp_path / "wrote").exists(), "instance 0's line", timeout=60)
        written = time.monotonic()
        line = proc.stdout.readline()
        waited = time.monotonic() - written
        assert line == b"[0] alone\n"
        assert waited < 2.5 and proc.poll() is None, waited  # well before the end
        proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_folded_set_with_gaps_is_braced_so_it_is_never_read_as_one_instance_s_tag():
    from poprun.fold import tag_label
    from poprun.run.output import render_tag
    from spawner.local import Stream
    assert tag_label(3) == "3"
    assert tag_label((0, 1, 2)) == "0-2"
    # `[1,1,3]` reads as three fields, `[1,3]` as instance 3's own tag
    assert tag_label((1, 3)) == "{1,3}"
    assert tag_label((0, 1, 2, 5)) == "{0-2,5}"
    assert render_tag((1, 3), Stream.STDOUT) == b"[1,{1,3}]<stdout>:"


SLOW_COPY = """
[ "$RANK" = 2 ] && while [ ! -e go ]; do sleep 0.01; done
echo "epoch step 10"
[ "$RANK" = 2 ] && printf 'progress 50%%\\r' && echo "own end"
exit 0
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tagged", [False, True])
def test_every_line_says_who_wrote_it_the_slow_instances_copy_too(tmp_path, tagged):
    """Instances 0 and 1 write `epoch step 10`, which prints with their set at the bound;
    instance 2 writes it only once that line is out (the test lets it go when it reads
    it), so its copy prints on its own: with its instance, never bare. Its unterminated
    `\\r` piece and the line that ends it carry it too."""
    tag = "--tag-output" if tagged else "--tag-output=no"
    argv = poprun_argv(*OFFLINE, "--num-instances=3", "--num-replicas=3", "--fold-output", tag,
                       "sh", "-c", SLOW_COPY)
    folded, own = ((b"[1,0-1]<stdout>:", b"[1,2]<stdout>:") if tagged else (b"[0-1] ", b"[2] "))
    with reaped(subprocess.Popen(argv, env=poprun_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)) as proc:
        assert proc.stdout.readline() == folded + b"epoch step 10\n"
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert out == own + b"epoch step 10\n" + own + b"progress 50%\r" + own + b"own end\n"
