"""The progress core (poprun/progress.py: rates, the straggler rule, the ETA), the progress
watch fed by real events on a real loop (poprun/jobctl/progress.py), and popdist.progress()
outside and inside a spawner's environment. Pure or in-process; the real runs are in
tests/test_stragglers.py."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import pytest

from conftest import poprun_env
from poprun.jobctl.progress import progress_watch
from poprun.progress import Tracker, compile_pattern, progress_line, slow_rule

pytestmark = pytest.mark.timeout(60)


# --- the rule ---------------------------------------------------------------------------------

def test_the_rule_with_three_or_more_is_median_minus_3_mad_and_half_the_median():
    # median 10, MAD 0.5: the bound is min(10 - 1.5, 5) = 5
    assert slow_rule({0: 10, 1: 10.5, 2: 9.5, 3: 10, 4: 4.9}) == ({4}, 10)
    assert slow_rule({0: 10, 1: 10.5, 2: 9.5, 3: 10, 4: 5.1})[0] == set()
    # widely spread rates: below half the median is not enough, median - 3 MAD rules
    assert slow_rule({0: 2, 1: 10, 2: 18, 3: 4, 4: 16})[0] == set()
    # every instance equally still: nobody is slower than the others
    assert slow_rule({0: 0.0, 1: 0.0, 2: 0.0})[0] == set()
    assert slow_rule({0: 5.0, 1: 5.0, 2: 0.0})[0] == {2}


def test_two_instances_compare_with_half_the_other_and_one_with_nobody():
    assert slow_rule({0: 10, 1: 4.9})[0] == {1}
    assert slow_rule({0: 10, 1: 5.1})[0] == set()
    assert slow_rule({0: 1.0}) == (set(), None)
    assert slow_rule({}) == (set(), None)


# --- the tracker ------------------------------------------------------------------------------

def run(tracker: Tracker, rates, seconds: float, start: float = 0.0, every: float = 0.5,
        noise: random.Random | None = None):
    """Samples each instance's count at `rates[i]` steps/s for `seconds`; the reports."""
    counts = {i: 0.0 for i in rates}
    reports, now = [], start
    while now < start + seconds:
        now += every
        for i, rate in rates.items():
            counts[i] += rate(now) * every * (noise.uniform(0.6, 1.4) if noise else 1)
            tracker.sample(i, int(counts[i]), 1000, now)
        reports.append(tracker.report(now))
    return reports


def const(value):
    return lambda now: value


def test_a_slow_instance_is_flagged_once_the_rule_held_for_the_hold_time():
    tracker = Tracker(4, "pattern", hold=4.0)
    reports = run(tracker, {0: const(10), 1: const(10), 2: const(10), 3: const(2)}, 12)
    flagged = [r for r in reports if r.slow]
    assert flagged and all(r.slow == [3] for r in flagged)
    (entry,) = flagged[-1].stragglers
    # its rate is known once its samples span hold/2 (2 s), then the rule holds 4 s
    assert entry["instance"] == 3 and entry["when"] == pytest.approx(6.0, abs=0.51)
    assert entry["rate"] == pytest.approx(2, abs=0.3) and entry["median"] == pytest.approx(10)
    assert entry["cleared"] is None
    assert flagged[-1].instances[3]["slow"] and not flagged[-1].instances[0]["slow"]


def test_a_flag_clears_after_the_hold_time_back_within_and_says_when():
    tracker = Tracker(3, "pattern", hold=2.0)
    slow_then_fast = lambda now: 1 if now < 6 else 10  # noqa: E731
    reports = run(tracker, {0: const(10), 1: const(10), 2: slow_then_fast}, 14)
    entry, = reports[-1].stragglers
    assert entry["instance"] == 2 and entry["when"] < 6
    assert entry["cleared"] is not None and entry["cleared"] > 6 + 2.0
    assert reports[-1].slow == []


def test_uniform_noisy_rates_never_raise_a_flag():
    noise = random.Random(27)
    for _ in range(20):
        tracker = Tracker(8, "lines", hold=2.0)
        reports = run(tracker, {i: const(20) for i in range(8)}, 20, noise=noise)
        assert reports[-1].stragglers == ()


def test_an_ended_or_silent_instance_is_not_compared():
    tracker = Tracker(4, "lines", hold=2.0)
    for now in (0.5 * k for k in range(1, 20)):
        for i in (0, 1):
            tracker.sample(i, int(20 * now), None, now)
        tracker.sample(2, 1, None, now)  # one line, then nothing: slow for real
        # instance 3 never writes a line: silent ranks (only rank 0 logs) are not stragglers
        report = tracker.report(now)
    assert report.slow == [2]
    assert report.instances[3] == {"step": None, "total": None, "rate": None,
                                   "mean_rate": None, "min_rate": None, "slow": False}
    tracker.ended(2, 10.0)  # its exit closes its flag and it leaves the comparison
    report = tracker.report(10.5)
    assert report.slow == [] and report.stragglers[0]["cleared"] == 10.0


def test_no_flags_with_flagging_off_but_progress_and_eta_go_on():
    tracker = Tracker(3, "pattern", hold=2.0, flag=False)
    reports = run(tracker, {0: const(10), 1: const(10), 2: const(1)}, 10)
    assert reports[-1].stragglers == () and reports[-1].slowest == 2
    assert reports[-1].eta == pytest.approx((1000 - 10) / 1, rel=0.1)


def test_eta_is_the_slowest_instances_steps_left_at_its_own_rate():
    tracker = Tracker(2, "popdist", hold=2.0)
    for now in (0.5 * k for k in range(1, 9)):
        tracker.sample(0, int(10 * now), 100, now)
        tracker.sample(1, int(5 * now), 100, now)
    report = tracker.report(4.0)
    assert report.slowest == 1 and report.instances[1]["step"] == 20
    assert report.eta == pytest.approx((100 - 20) / 5, rel=0.05)
    progress = report.to_json(1000.0)["progress"]
    assert progress["step"] == 20 and progress["total"] == 100 and progress["slowest"] == 1
    assert progress_line(progress) == "step 20/100 (instance 1) 5/s ETA 16s"
    assert progress["instances"][0]["mean_rate"] == pytest.approx(10, rel=0.1)


def test_a_sparse_reporter_reads_at_its_rate_between_reports_and_decays_once_it_stops():
    # a line every 20 steps: 20 steps every 6 s, the window (3 s) shorter than its interval
    tracker = Tracker(1, "pattern", hold=3.0)
    for now in range(0, 31):
        tracker.sample(0, 20 * (now // 6), 200, float(now))
    # t=30: its newest change at 30 (step 100), the window's start (27) after the one at 24
    assert tracker.rate(0, 30.0) == pytest.approx(20 / 6)
    # between its reports it keeps its last interval's rate, not 0
    for now in (32.0, 35.0):
        tracker.sample(0, 100, 200, now)
        assert tracker.rate(0, now) == pytest.approx(20 / 6)
    # it stops: after more than its interval without a change the rate falls
    tracker.sample(0, 100, 200, 42.0)
    assert tracker.rate(0, 42.0) == pytest.approx(20 / 12)


def test_sparse_reporters_alike_raise_no_alarm_and_a_slower_one_is_flagged():
    # lines every 20 steps, phases apart; instance 3 six times slower (pattern sampled 1/s)
    tracker = Tracker(4, "pattern", hold=3.0)
    period = {0: 1, 1: 1, 2: 1, 3: 6}
    phase = {0: 0.0, 1: 0.3, 2: 0.6, 3: 0.2}
    flagged_at = {}
    for tick in range(1, 41):
        now = float(tick)
        for i in range(4):
            tracker.sample(i, 20 * int((now + phase[i]) // period[i]), None, now)
        report = tracker.report(now)
        for i in report.slow:
            flagged_at.setdefault(i, now)
    assert set(flagged_at) == {3}
    assert flagged_at[3] <= 2 * 3.0 + 3.0  # its rate known at hold/2, then held for hold


def test_a_counter_that_starts_again_starts_its_rate_again():
    tracker = Tracker(1, "pattern", hold=2.0)
    for now, step in ((1, 100), (2, 110), (3, 120), (4, 5)):
        tracker.sample(0, step, None, now)
    assert tracker.rate(0, 4) is None and tracker.report(4).instances[0]["step"] == 5


def test_the_record_times_are_the_epochs_and_lines_show_no_progress_line():
    tracker = Tracker(3, "lines", hold=1.0)
    run(tracker, {0: const(10), 1: const(10), 2: const(0.5)}, 5)
    data = tracker.report(5).to_json(wall=1_000_000.0)
    assert data["stragglers"][0]["when"] > 1_000_000.0
    assert data["progress"]["source"] == "lines" and progress_line(data["progress"]) == ""


@pytest.mark.parametrize("pattern,why", [("step (", "not a regular expression"),
                                         ("step \\d+", "0 capture groups"),
                                         ("(a)(b)(c)", "3 capture groups")])
def test_a_pattern_needs_one_or_two_groups(pattern, why):
    with pytest.raises(ValueError, match=why.replace("(", "\\(")):
        compile_pattern(pattern)


# --- the watch, on a real loop ----------------------------------------------------------------

def test_the_pattern_watch_reads_steps_from_lines_and_reports_them():
    async def main():
        loop = asyncio.get_running_loop()
        reports = []
        watch = progress_watch(loop, 2, pattern=r"step (\d+)/(\d+)", hold=0.5,
                               local=lambda keys=None: {}, report=reports.append)
        for key in (0, 1):
            watch.started(key, "here", 1, loop.time(), local=True, start_ticks=None)
        for step in range(1, 13):
            for key in (0, 1):
                data = b"loss 1.0\nstep %d/100 loss 0.5\n" % (step * (2 - key))
                watch.output(key, None, data, loop.time(), 2)
            await asyncio.sleep(0.05)
        watch.exited(0, 0, loop.time(), None)
        watch.exited(1, 0, loop.time(), None)
        return watch, reports

    watch, reports = asyncio.run(main())
    assert watch.every == pytest.approx(0.1)
    last = reports[-1]
    assert last.source == "pattern"
    assert last.instances[0]["step"] == 24 and last.instances[1]["step"] == 12
    assert last.instances[0]["total"] == 100


def test_popdist_progress_replaces_lines_once_an_instance_calls_it():
    async def main():
        loop = asyncio.get_running_loop()
        reports = []
        watch = progress_watch(loop, 2, pattern=None, hold=0.5,
                               local=lambda keys=None: {0: (7, 50)}, report=reports.append)
        watch.started(0, "here", 1, loop.time(), local=True, start_ticks=None)
        watch.started(1, "there", 2, loop.time(), local=False, start_ticks=None)
        watch.stepped(1, 3, 50, loop.time())  # an agent's STATS
        await asyncio.sleep(0.25)
        watch.close()
        return reports

    last = asyncio.run(main())[-1]
    assert last.source == "popdist"
    assert (last.instances[0]["step"], last.instances[1]["step"]) == (7, 3)
    assert last.slowest == 1


# --- popdist.progress -------------------------------------------------------------------------

PROBE = ("import os, popdist, popdist._progress as p\n"
         "popdist.progress(3, 10)\n"
         "for i in range(1000): popdist.progress(i)\n"
         "print(p._map is not None, p._off)\n")


def test_popdist_progress_outside_poprun_does_nothing(tmp_path):
    env = poprun_env()
    env.pop("POPDIST_PROGRESS_FILE", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"] and os.listdir(tmp_path) == []


def test_popdist_progress_writes_where_poprun_reads(tmp_path):
    from popdist._progress import LAYOUT, unpack
    from spawner.untrusted import read_regular

    def read(path: str):  # as the spawner reads it (spawner/local.py)
        return unpack(read_regular(path, LAYOUT.size) or b"")

    path = tmp_path / "0.progress"
    assert read(str(path)) is None  # never called: nothing to read
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=poprun_env({"POPDIST_PROGRESS_FILE": str(path)}), timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
    assert read(str(path)) == (999, None)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
