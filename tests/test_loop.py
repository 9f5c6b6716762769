"""spawner.loop.SelectLoop: the asyncio-free loop that drives local runs and the agent."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from spawner.loop import SelectLoop

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def loop():
    loop = SelectLoop()
    yield loop
    loop.close()


def test_timers_run_in_deadline_order_and_cancelled_ones_never(loop):
    ran = []
    loop.call_later(0.02, ran.append, "late")
    loop.call_later(0.0, ran.append, "early")
    loop.call_later(0.01, ran.append, "cancelled").cancel()
    loop.run_until(lambda: "late" in ran)
    assert ran == ["early", "late"]


def test_reader_gets_data_and_removing_it_drops_an_event_already_collected(loop):
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    seen = []

    def first(fd):
        seen.append(os.read(fd, 10))
        loop.remove_reader(r2)  # both pipes are ready in the same round

    loop.add_reader(r1, first, r1)
    loop.add_reader(r2, lambda: seen.append("second must not run"))
    os.write(w1, b"x")
    os.write(w2, b"y")
    loop.run_until(lambda: bool(seen))
    loop.call_later(0.01, seen.append, "tick")
    loop.run_until(lambda: "tick" in seen)
    assert seen == [b"x", "tick"]
    assert loop.remove_reader(r2) is False
    for fd in (r1, w1, r2, w2):
        os.close(fd)


def test_call_soon_threadsafe_wakes_a_blocked_select(loop):
    got = []
    threading.Timer(0.05, loop.call_soon_threadsafe, (got.append, "from thread")).start()
    loop.run_until(lambda: bool(got))  # no timer or fd: only the wake-up can end the select
    assert got == ["from thread"]


def test_signal_handler_runs_on_the_loop_and_is_removed_on_close():
    loop = SelectLoop()
    before = signal.getsignal(signal.SIGUSR1)
    wakeup_before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_before)
    got = []
    loop.add_signal_handler(signal.SIGUSR1, got.append, "usr1")
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    loop.run_until(lambda: bool(got))
    loop.close()
    assert got == ["usr1"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert signal.set_wakeup_fd(wakeup_before) == wakeup_before  # the old wake-up fd is back
    signal.signal(signal.SIGUSR1, before)
