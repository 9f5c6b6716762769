"""Stacks folded as STAT folds them (poprun/jobctl/stacks.py) and read from faulthandler's and
py-spy's formats (spawner/stackparse.py): pure functions, no process."""

from __future__ import annotations

import json

from poprun.jobctl.stacks import fold, render
from spawner.stackparse import parse_faulthandler, parse_pyspy, with_source

FAULTHANDLER = """\
Thread 0x00007f1e6756f6c0 (most recent call first):
  File "/tmp/fh.py", line 6 in worker
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f1e683beb80 (most recent call first):
  File "/tmp/fh.py", line 9 in <module>
"""

WAIT = [["/job/train.py", 12, "wait_peer", "data = sock.recv(1)"],
        ["/job/train.py", 30, "main", "wait_peer(sock)"]]
ELSEWHERE = [["/job/train.py", 44, "save", "pickle.dump(state, f)"],
             ["/job/train.py", 31, "main", "save(state)"]]
LOADER = [["/usr/lib/python3.11/threading.py", 320, "wait", "waiter.acquire()"]]


def answer(*stacks, how="popdist"):
    return {"pid": 1, "how": how, "error": None,
            "threads": [{"thread": f"0x{i}", "frames": [list(f) for f in s], "truncated": False}
                        for i, s in enumerate(stacks)]}


def test_faulthandler_dumps_are_read_innermost_first():
    threads = parse_faulthandler(FAULTHANDLER)
    assert [t["thread"] for t in threads] == ["0x00007f1e6756f6c0", "0x00007f1e683beb80"]
    assert threads[0]["frames"] == [["/tmp/fh.py", 6, "worker", ""],
                                    ["/usr/lib/python3.11/threading.py", 982, "run", ""]]
    assert threads[1]["frames"] == [["/tmp/fh.py", 9, "<module>", ""]]


def test_a_cut_stack_and_noise_are_handled():
    text = ('garbage before\nThread 0x1 (most recent call first):\n  File "a.py", line 1 in f\n'
            '  ...\n\nCurrent thread 0x2 (most recent call first):\n  <no Python frame>\n...\n')
    first, second = parse_faulthandler(text)
    assert first["truncated"] and first["frames"] == [["a.py", 1, "f", ""]]
    assert second["frames"] == []
    assert parse_faulthandler("") == []


def test_py_spy_json_is_read_with_thread_names():
    data = [{"thread_id": 7, "thread_name": "MainThread", "active": False, "frames": [
        {"name": "inner", "filename": "/x.py", "line": 3},
        {"name": "<module>", "filename": "/x.py", "line": 6}]}]
    (thread,) = parse_pyspy(json.dumps(data))
    assert thread["thread"] == "MainThread (idle)"
    assert thread["frames"] == [["/x.py", 3, "inner", ""], ["/x.py", 6, "<module>", ""]]


def test_source_lines_are_read_where_the_instance_runs(tmp_path):
    source = tmp_path / "prog.py"
    source.write_text("import time\n\ndef f():\n    time.sleep(1)  # here\n")
    threads = with_source([{"thread": "t", "frames": [[str(source), 4, "f", ""],
                                                      ["<string>", 1, "<module>", ""]]}])
    assert threads[0]["frames"][0][3] == "time.sleep(1)  # here"
    assert threads[0]["frames"][1][3] == ""


def test_identical_stacks_fold_and_the_odd_one_out_comes_first():
    results = {i: answer(WAIT, LOADER) for i in range(8) if i != 7}
    results[7] = answer(ELSEWHERE, LOADER)
    folded = fold(results)
    assert [g.instances for g in folded.groups] == [(7,), tuple(range(7)), tuple(range(8))]
    assert folded.groups[0].frames[0][:3] == ("/job/train.py", 44, "save")
    text = render(folded, "title")
    lines = text.splitlines()
    assert lines[0] == "title"
    assert lines[1] == "instances [7] (1 of 8):"
    assert "/job/train.py:44 in save   pickle.dump(state, f)" in lines[2]
    assert "instances [0-6] (7 of 8):" in text and "instances [0-7] (8 of 8):" in text
    assert text.index("[7]") < text.index("[0-6]") < text.index("[0-7]")


def test_thread_ids_do_not_split_a_group_and_several_threads_are_counted():
    results = {0: answer(LOADER, LOADER), 1: answer(LOADER)}
    (group,) = fold(results).groups
    assert group.instances == (0, 1) and group.threads == 3
    assert "(2 of 2, 3 threads)" in render(fold(results))


def test_a_different_line_is_a_different_stack():
    moved = [["/job/train.py", 13, "wait_peer", ""], WAIT[1]]
    folded = fold({0: answer(WAIT), 1: answer(moved)})
    assert len(folded.groups) == 2


def test_instances_without_stacks_get_one_line_each_reason_folded():
    results = {0: answer(WAIT), 1: answer(WAIT),
               2: {"pid": 5, "how": None, "threads": [],
                   "error": "not a Python program (/usr/bin/sleep): no Python stacks"},
               3: {"pid": 6, "how": None, "threads": [],
                   "error": "not a Python program (/usr/bin/sleep): no Python stacks"},
               4: {"pid": None, "how": None, "threads": [], "error": "h2: the agent is gone"}}
    folded = fold(results)
    text = render(folded)
    assert "instances [4]: no stacks: h2: the agent is gone" in text
    assert "instances [2-3]: no stacks: not a Python program (/usr/bin/sleep)" in text
    data = folded.to_json()
    assert data["instances"] == [0, 1, 2, 3, 4]
    assert data["groups"][0]["frames"][0] == {"file": "/job/train.py", "line": 12,
                                              "function": "wait_peer",
                                              "code": "data = sock.recv(1)"}
    json.dumps(data)


def test_nothing_running_is_said():
    assert "no instance is running" in render(fold({}))


def test_files_under_the_jobs_directory_are_shown_relative_to_it():
    text = render(fold({0: answer(WAIT)}), base="/job")
    assert "    train.py:12 in wait_peer   data = sock.recv(1)" in text
    assert "/job/" not in text
