"""Folded output (issue 27 point 1): the pure core (poprun/fold.py) and real runs of
`poprun --fold-output` and `poprunctl logs --fold`."""

from __future__ import annotations

import random

from poprun.fold import BOUND, Folder, fold_records

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


def test_a_log_folded_after_the_fact():
    records = [(i, OUT, b"warning\nloss %d\n" % i) for i in range(8)]
    out = fold_records(records, range(8))
    assert lines_of(out)[0] == (tuple(range(8)), b"warning\n")
    assert len(lines_of(out)) == 9
