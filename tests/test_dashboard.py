"""poprun.view.dashboard: the state model, the panel's content, and what
reaches a real pseudo-terminal around raw instance output."""

from __future__ import annotations

import fcntl
import math
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from rich.cells import cell_len

from conftest import poprun_env
from poprun.events import LAST_LINE_KEEP, InstanceState, last_line
from poprun.view.dashboard import (
    FOLD_ABOVE, HIDE_CURSOR, QUIET_LISTED, SHOW_CURSOR, Dashboard, DashboardState, JobState,
    Phase, erase_sequence, panel_budget, wants_dashboard)
from poprun.text import signal_name
from spawner.procstat import ProcSampler, Usage, cpu_seconds, rss_bytes

pytestmark = pytest.mark.timeout(20)


def started(n: int, hosts=("h1",), now: float = 0.0, **kw) -> DashboardState:
    """A state with `n` instances dealt in contiguous blocks over `hosts`, all started."""
    state = DashboardState(n, hosts, now, **kw)
    per_host = math.ceil(n / len(hosts))
    state.plan((i, hosts[i // per_host]) for i in range(n))
    for i in range(n):
        state.instance_started(i, hosts[i // per_host], 1000 + i, now)
    return state


def plain(state: DashboardState, now: float, width: int = 100, rows: int = 60) -> str:
    return Dashboard(state, color_system=None).render(now, width, rows)


# --- the model ------------------------------------------------------------------------------

def test_an_instance_goes_from_starting_to_its_outcome():
    state = DashboardState(4, ["h1"], 0.0)
    assert {i.status for i in state.instances.values()} == {"starting"}
    for i in range(4):
        state.instance_started(i, "h1", 100 + i, 1.0)
    for index, code in ((0, 0), (1, 3), (2, -15)):
        state.instance_exited(index, code, 5.0)
    statuses = [state.instances[i].status for i in range(4)]
    assert statuses == ["exited 0", "failed 3", f"killed {signal_name(15)}", "running"]
    assert state.instances[1].uptime(100.0) == 4.0  # ended: its clock stopped
    assert state.instances[3].uptime(100.0) == 99.0


def test_an_exit_reported_before_the_start_is_kept():
    state = DashboardState(1, ["h2"], 0.0)
    state.instance_exited(0, 1, 2.0)  # a remote instance can exit before spawn_all returns
    state.instance_started(0, "h2", 55, 1.0)
    assert state.instances[0].status == "failed 1"
    assert state.instances[0].pid == 55


def test_job_state_follows_the_launch_and_the_outcomes():
    state = DashboardState(2, ["h1", "h2"], 0.0, remote_hosts=1)
    state.instance_started(0, "h1", 10, 0.5)
    assert state.job_state is JobState.LAUNCHING
    state.host_connected("h2")
    state.agent_ready("h2")
    assert state.job_state is JobState.LAUNCHING  # instance 1 has no pid yet
    state.instance_started(1, "h2", 11, 1.0)
    assert state.job_state is JobState.RUNNING
    assert state.launched == 1.0
    state.instance_exited(1, 2, 3.0)
    state.stopping("instance 1 failed")
    assert state.job_state is JobState.STOPPING
    assert state.alive() == [0]
    state.instance_exited(0, -15, 4.0)
    assert state.job_state is JobState.FAILED


def test_a_job_whose_instances_all_exit_zero_finished():
    state = started(3)
    for i in range(3):
        state.instance_exited(i, 0, 1.0)
    assert state.job_state is JobState.FINISHED


def test_a_lost_host_takes_only_its_unfinished_instances():
    state = started(4, hosts=("h1", "h2"))
    state.instance_exited(2, 0, 1.0)
    state.host_lost("h2", 2.0)
    assert [state.instances[i].state for i in range(4)] == [
        InstanceState.RUNNING, InstanceState.RUNNING, InstanceState.EXITED, InstanceState.LOST]


def test_phases_count_hosts_agents_and_instances():
    state = DashboardState(4, ["h1", "h2", "h3"], 0.0, remote_hosts=2)
    state.host_connected("h2")
    state.host_connected("h2")  # the same host twice is one host
    state.host_connected("h3")
    state.agent_ready("h3")
    state.instance_started(0, "h1", 1, 1.0)
    counts = {phase: (state.count(phase), state.totals[phase]) for phase in Phase}
    assert counts == {Phase.CONNECT: (2, 2), Phase.AGENTS: (1, 2), Phase.START: (1, 4)}
    assert state.launching


def test_output_counts_lines_and_keeps_the_last_one_progress_included():
    state = started(1)
    state.output(0, b"one\ntwo\n", 1.0)
    assert (state.instances[0].lines, state.instances[0].last_line) == (2, b"two")
    state.output(0, b"10%\r20%\r", 2.0)
    assert (state.instances[0].lines, state.instances[0].last_line) == (2, b"20%")
    state.output(0, b"\n", 3.0)  # the `\n` of a `\r\n` split between blocks
    assert (state.instances[0].lines, state.instances[0].last_line) == (3, b"20%")
    assert state.instances[0].last_output == 3.0


def test_last_line_of_a_huge_line_is_cut():
    assert last_line(b"x" * (LAST_LINE_KEEP * 3) + b"\n") == b"x" * LAST_LINE_KEEP
    assert last_line(b"a\r\nb\r\n") == b"b"
    assert last_line(b"partial at EOF") == b"partial at EOF"


def test_rows_fold_per_host_beyond_the_limit_or_the_height():
    assert not started(FOLD_ABOVE).folded(max_rows=100)
    assert started(FOLD_ABOVE + 1).folded(max_rows=100)
    assert started(10).folded(max_rows=5)


def test_a_folded_host_lists_its_quietest_running_instances_first():
    state = started(8, hosts=("h1", "h2"))
    for index, when in ((0, 9.0), (1, 2.0), (2, 5.0)):
        state.output(index, b"x\n", when)
    state.instance_exited(4, 1, 3.0)  # h2's: ended instances are not "silent"
    h1, h2 = state.by_host(10.0)
    assert h1.indices == (0, 1, 2, 3)
    # 3 never wrote (silent since its start at 0), then the oldest last lines
    assert h1.quiet == ((3, 10.0), (1, 8.0), (2, 5.0))[:QUIET_LISTED]
    assert h1.lines == 3
    assert dict(h2.statuses) == {"running": 3, "failed 1": 1}
    assert (h1.bad, h2.bad) == (0, 1)
    assert 4 not in [i for i, _ in h2.quiet]


def test_host_usage_sums_what_its_instances_reported():
    state = started(3)
    state.set_usage(0, Usage(50.0, 100))
    state.set_usage(1, Usage(None, 200))  # first sample: no rate yet
    (h1,) = state.by_host(1.0)
    assert (h1.cpu_percent, h1.rss) == (50.0, 300)


# --- the panel ------------------------------------------------------------------------------

def test_panel_shows_header_phases_and_one_row_per_instance():
    state = DashboardState(3, ["h1", "h2"], 0.0, remote_hosts=1, cache_dir="/tmp/cache-x")
    state.plan([(0, "h1"), (1, "h1"), (2, "h2")])
    state.set_partition("pt-7")
    state.host_connected("h2")
    state.instance_started(0, "h1", 4242, 1.0)
    state.instance_started(1, "h1", 4343, 1.0)
    state.output(0, b"epoch 1 loss 0.5\n", 2.0)
    state.set_usage(0, Usage(95.4, 300 * 2**20))
    state.instance_exited(1, 3, 4.0)
    text = plain(state, 10.0, width=80)
    lines = text.split("\n")
    assert lines[0].startswith(f"poprun {JobState.LAUNCHING.value} 10s")
    assert lines[1].startswith("hosts: 2 (h1,h2)")
    assert "partition: pt-7" in lines[1] and "cache: /tmp/cache-x" in lines[1]
    assert re.search(r"hosts connected .* 1/1$", text, re.M)
    assert re.search(r"agents ready .* 0/1$", text, re.M)
    assert re.search(r"instances started .* 2/3$", text, re.M)
    rows = {line.split()[0]: line for line in lines if re.match(r"\s*\d+ ", line)}
    assert rows.keys() == {"0", "1", "2"}
    assert re.match(r"0 h1 +4242 running +9s +95% +300M +1 +8s epoch 1 loss 0.5$", rows["0"])
    assert re.match(r"1 h1 +4343 failed 3 +3s +0$", rows["1"])
    assert re.match(r"2 h2 +starting +0$", rows["2"])
    assert all(cell_len(line) <= 80 for line in lines)


def test_phases_give_way_to_rows_once_launched_and_offline_is_said():
    state = DashboardState(2, ["h1"], 0.0, offline=True)
    state.instance_started(0, "h1", 10, 0.5)
    assert "instances started" in plain(state, 1.0)
    state.instance_started(1, "h1", 11, 1.5)
    text = plain(state, 2.0)
    assert "instances started" not in text
    assert text.startswith("poprun running 2s (launched in 1.5s)")
    assert "partition: offline" in text


def test_child_text_is_never_markup_nor_escape_codes():
    state = started(2)
    state.output(0, b"[bold]x[/bold] [red]y\n", 1.0)
    state.output(1, b"\x1b[31mred\x1b[0m \x1b[2J\x07done\n", 1.0)
    text = plain(state, 2.0)
    assert "[bold]x[/bold] [red]y" in text
    assert "\x1b" not in text and "\x07" not in text  # no colour asked: no escape at all
    assert "␛[31mred␛[0m ␛[2J␇done" in text
    coloured = Dashboard(state, color_system="truecolor").render(2.0, 100, 40)
    assert "[bold]x[/bold] [red]y" in coloured and "␛[31mred␛[0m" in coloured


def test_last_line_is_cut_to_the_width_and_invalid_utf8_is_shown_escaped():
    state = started(1)
    state.output(0, b"\xff\xfe " + b"z" * 500 + b"\n", 1.0)
    lines = plain(state, 2.0, width=60).split("\n")
    row = next(line for line in lines if line.startswith("0 "))
    assert cell_len(row) <= 60 and row.endswith("…") and "\\xff\\xfe zzz" in row


def test_many_instances_fold_into_host_rows():
    hosts = ("alpha", "beta")
    state = started(40, hosts=hosts)
    state.instance_exited(25, 2, 3.0)
    text = plain(state, 10.0)
    rows = [line for line in text.split("\n") if line.lstrip().startswith("[")]
    assert [row.split()[:2] for row in rows] == [["[0-19]", "alpha"], ["[20-39]", "beta"]]
    assert "running (20)" in rows[0]
    assert "running (19), failed 2 (1)" in rows[1]
    assert "quietest: 0 (10s)" in rows[0]
    # under `pid` a folded row has nothing (a count there once read as a pid)
    heading = next(line for line in text.split("\n") if " pid " in line)
    pid = slice(heading.index("pid"), heading.index("pid") + 3)
    assert [row[pid].strip() for row in rows] == ["", ""], rows


def test_the_panel_never_outgrows_its_share_of_the_terminal():
    hosts = tuple(f"h{i}" for i in range(30))
    state = started(60, hosts=hosts)
    for rows in (10, 24, 40):
        lines = plain(state, 1.0, rows=rows).split("\n")
        assert len(lines) <= panel_budget(rows)
        assert "more hosts" in lines[-1]
    assert "more hosts" not in plain(state, 1.0, rows=200)


def test_a_second_stop_replaces_the_reason_and_alive_ones_are_named():
    state = started(4)
    state.instance_exited(1, 1, 1.0)
    state.stopping("instance 1 failed")
    state.stopping("SIGINT again: SIGKILL")
    text = plain(state, 2.0)
    assert "stopping… (SIGINT again: SIGKILL): 3 still alive [0,2-3]" in text
    assert "instance 1 failed" not in text


def test_stopping_says_when_sigkill_comes_and_what_ctrl_c_does():
    """While stopping, the panel says when SIGKILL comes (or that it was sent) and what Ctrl-C
    does."""
    state = started(3, kill_timeout=5.0)
    state.stopping("SIGINT", 1.0)
    assert "stopping… (SIGINT): 3 still alive [0-2]; SIGKILL in 4s (Ctrl-C again: kill now)" \
        in plain(state, 2.0)
    assert "SIGKILL in 1s" in plain(state, 5.5)
    assert "; SIGKILL sent" in plain(state, 6.5)
    failed = started(2, kill_timeout=5.0)
    failed.instance_exited(0, 1, 1.0)
    failed.stopping("instance 0 failed", 1.0)
    assert "; SIGKILL in 5s (Ctrl-C: kill now)" in plain(failed, 1.0)
    failed.stopping("SIGINT again: SIGKILL", 2.0)
    text = plain(failed, 2.0)
    assert "(SIGINT again: SIGKILL): 1 still alive [1]; SIGKILL sent" in text
    assert "Ctrl-C" not in text


def test_the_cache_label_of_the_first_frame_stays_until_a_directory_is_made(tmp_path):
    from poprun.view.dashboard import expected_cache
    from poprun.plan.config import LaunchConfig
    from poprun.plan.planner import CacheMode

    config = LaunchConfig(program=("p",), executable_cache_path="rel")
    assert expected_cache(config, CacheMode.EXPLICIT, {}) == os.path.abspath("rel")
    assert expected_cache(config, CacheMode.NONE, {}) is None
    assert expected_cache(config, CacheMode.FRAMEWORK, {"POPTORCH_CACHE_DIR": "/t"}) == \
        "POPTORCH_CACHE_DIR=/t"
    label = expected_cache(config, CacheMode.TEMPORARY, {})
    state = started(2, cache_dir=label)
    assert f"cache: {label}" in plain(state, 0.0)
    state.set_cache_dir(None)  # a framework's own cache: poprun made none
    assert f"cache: {label}" in plain(state, 0.0)
    state.set_cache_dir("/tmp/poprun-cache-x")
    assert "cache: /tmp/poprun-cache-x" in plain(state, 0.0)


# --- on a real pseudo-terminal --------------------------------------------------------------

class Screen:
    """Just enough of a terminal for what the dashboard sends: text, CR, LF, cursor up,
    erase below, cursor visibility, SGR (ignored). Anything else fails the test."""

    _CSI = re.compile(r"\x1b\[(\??)(\d*)([A-Za-z])")

    def __init__(self) -> None:
        self.lines, self.row, self.col, self.cursor_visible = [""], 0, 0, True
        self.cleared_from_home = 0  # "erase below" from the top-left corner (row 0 = top)

    def feed(self, data: bytes) -> None:
        text, i = data.decode(), 0
        while i < len(text):
            match = self._CSI.match(text, i)
            if match:
                self._control(*match.groups())
                i = match.end()
                continue
            assert text[i] != "\x1b", f"unexpected escape {text[i:i + 8]!r}"
            self._char(text[i])
            i += 1

    def _control(self, private: str, number: str, final: str) -> None:
        if final == "A":
            self.row = max(0, self.row - int(number or 1))
            while len(self.lines) > self.row + 1 and not self.lines[-1]:
                self.lines.pop()  # blank rows below the cursor are no rows at all
        elif final == "B":  # down, never past the last line, never scrolling
            self.row = min(len(self.lines) - 1, self.row + int(number or 1))
        elif final == "J":
            if self.row == self.col == 0:  # tmux's scroll-on-clear: the screen to history
                self.cleared_from_home += 1
            self.lines[self.row] = self.lines[self.row][:self.col]
            del self.lines[self.row + 1:]
        elif final == "K" and number == "2":
            self.lines[self.row] = ""
        elif private and number == "25":
            self.cursor_visible = final == "h"
        else:
            assert final == "m", (private, number, final)

    def _char(self, ch: str) -> None:
        if ch == "\r":
            self.col = 0
        elif ch == "\n":  # the tty's ONLCR would make it CR LF
            self.row, self.col = self.row + 1, 0
            if self.row == len(self.lines):
                self.lines.append("")
        else:
            line = self.lines[self.row].ljust(self.col)
            self.lines[self.row] = line[:self.col] + ch + line[self.col + 1:]
            self.col += 1


class Pty:
    """A pseudo-terminal with output post-processing off, so the bytes read are the bytes
    written; `sync()` returns everything written since the last call."""

    def __init__(self, columns: int = 100, rows: int = 40) -> None:
        self.master, self.slave = os.openpty()
        attrs = termios.tcgetattr(self.slave)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(self.slave, termios.TCSANOW, attrs)
        self.resize(columns, rows)
        self._marks = 0

    def resize(self, columns: int, rows: int) -> None:
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def sync(self, timeout: float = 5.0) -> bytes:
        """A pty passes data on asynchronously: write a marker and read up to it."""
        self._marks += 1
        mark = b"\x00sync %d\x00" % self._marks
        os.write(self.slave, mark)
        got, deadline = b"", time.monotonic() + timeout
        while not got.endswith(mark):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; read {got!r}"
            if select.select([self.master], [], [], left)[0]:
                got += os.read(self.master, 65536)
        return got[:-len(mark)]

    def close(self) -> None:
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def pty():
    terminal = Pty()
    yield terminal
    terminal.close()


class Soon:
    """A stand-in for loop.call_soon: callbacks wait until `run()`, the loop's next turn."""

    def __init__(self) -> None:
        self.pending: list = []

    def __call__(self, callback) -> None:
        self.pending.append(callback)

    def run(self) -> None:
        pending, self.pending = self.pending, []
        for callback in pending:
            callback()


@pytest.fixture(params=["each block", "each loop turn"])
def soon(request):
    """Both ways of redrawing: after each block (no scheduler), once per loop turn."""
    return Soon() if request.param == "each loop turn" else None


def turn(soon: Soon | None) -> None:
    if soon is not None:
        soon.run()


def test_output_passes_intact_between_erase_and_panel(pty):
    dash = Dashboard(started(3), pty.slave, color_system=None)
    dash.emit(pty.slave, b"[1,0]<stdout>:before\n")
    assert pty.sync() == b"[1,0]<stdout>:before\n"  # nothing drawn yet: nothing around it
    dash.tick(0.0)
    drawn = pty.sync()
    assert drawn.startswith(HIDE_CURSOR)
    panel = drawn[len(HIDE_CURSOR):]
    assert b"poprun running" in panel and b"1000 running" in panel
    height = panel.count(b"\r\n") + 1
    lines = (b"[1,1]<stdout>:[bold]b[/bold]\n", b"[1,1]<stdout>:\x1b[31mc\n")
    dash.emit(pty.slave, *lines)
    assert pty.sync() == erase_sequence(height) + b"".join(lines) + panel
    dash.close()
    assert pty.sync() == erase_sequence(height) + SHOW_CURSOR


def test_a_screen_keeps_output_above_the_panel_and_is_clean_after_close(pty, soon):
    screen = Screen()
    state = started(2)
    dash = Dashboard(state, pty.slave, color_system="truecolor", schedule=soon)
    out = os.dup(pty.slave)  # instance stdout: the same terminal through another fd
    try:
        dash.emit(out, b"a1\n")
        dash.tick(0.0)
        for fd, data in ((out, b"a2\n"), (pty.slave, b"e1\n"), (out, b"b3\nb4\n")):
            dash.emit(fd, data)
            state.output(0, data, 0.1)
        turn(soon)
        screen.feed(pty.sync())
        assert screen.lines[:5] == ["a1", "a2", "e1", "b3", "b4"]
        assert screen.lines[5].startswith("poprun running")
        assert not screen.cursor_visible
        dash.tick(0.5)  # rendered again: the new last line is in the row
        screen.feed(pty.sync())
        assert screen.lines[:5] == ["a1", "a2", "e1", "b3", "b4"]
        assert any(re.match(r"0 h1 .* b4$", line) for line in screen.lines[5:])
        dash.close()
        screen.feed(pty.sync())
        assert screen.lines == ["a1", "a2", "e1", "b3", "b4", ""]
        assert screen.cursor_visible
    finally:
        os.close(out)


def test_a_progress_line_updates_in_place_above_the_panel(pty, soon):
    screen = Screen()
    dash = Dashboard(started(1), pty.slave, color_system=None, schedule=soon)
    dash.emit(pty.slave, b"start\n")
    dash.emit(pty.slave, b"10%\r")
    dash.tick(0.0)
    for update in (b"20%\r", b"30%\r"):
        dash.emit(pty.slave, update)
        turn(soon)
        screen.feed(pty.sync())
        assert screen.lines[:2] == ["start", update[:-1].decode()]
        assert screen.lines[2].startswith("poprun running")
    dash.tick(0.5)  # a redraw without output leaves the progress line alone
    dash.emit(pty.slave, b"\ndone\n")  # the `\n` of the last `\r\n` comes on its own
    dash.close()
    screen.feed(pty.sync())
    assert screen.lines == ["start", "30%", "done", ""]


def test_an_unterminated_last_line_is_not_overdrawn(pty, soon):
    screen = Screen()
    dash = Dashboard(started(1), pty.slave, color_system=None, schedule=soon)
    dash.tick(0.0)
    dash.emit(pty.slave, b"no newline at EOF")
    turn(soon)
    dash.emit(pty.slave, b"next\n")
    turn(soon)
    dash.close()
    screen.feed(pty.sync())
    assert screen.lines == ["no newline at EOF", "next", ""]


def test_one_loop_turn_erases_once_and_redraws_once(pty):
    soon = Soon()
    dash = Dashboard(started(3), pty.slave, color_system=None, schedule=soon)
    dash.tick(0.0)
    panel = pty.sync()[len(HIDE_CURSOR):]
    erase = erase_sequence(panel.count(b"\r\n") + 1)
    blocks = [b"[1,%d]<stdout>:line\n" % i for i in range(3)]
    for block in blocks:
        dash.emit(pty.slave, block)
    assert pty.sync() == erase + b"".join(blocks)
    assert len(soon.pending) == 1
    soon.run()
    assert pty.sync() == panel


def test_close_while_a_redraw_is_due_shows_the_cursor_and_draws_nothing_more(pty):
    soon = Soon()
    dash = Dashboard(started(1), pty.slave, color_system=None, schedule=soon)
    dash.tick(0.0)
    pty.sync()
    dash.emit(pty.slave, b"last words\n")
    dash.close()
    soon.run()
    dash.tick(10.0)
    data = pty.sync()
    assert data.endswith(b"last words\n" + SHOW_CURSOR)


def test_output_to_another_file_leaves_the_terminal_alone(pty):
    dash = Dashboard(started(1), pty.slave, color_system=None)
    dash.tick(0.0)
    pty.sync()
    read_end, write_end = os.pipe()
    try:
        dash.emit(write_end, b"to a file\n")
        assert os.read(read_end, 100) == b"to a file\n"
        assert pty.sync() == b""
    finally:
        os.close(read_end)
        os.close(write_end)
        dash.close()


def test_renders_at_most_every_refresh_and_idle_once_a_second(pty):
    dash = Dashboard(started(1), pty.slave, color_system=None, refresh=0.25)
    dash.tick(0.0)
    assert pty.sync()
    dash.emit(pty.slave, b"x\n")
    pty.sync()
    dash.tick(0.1)  # too soon, though there is news
    assert pty.sync() == b""
    dash.tick(0.3)
    assert pty.sync()
    dash.tick(0.8)  # nothing new, and the clocks have not moved a second
    assert pty.sync() == b""
    dash.tick(1.35)
    assert b"poprun running 1s" in pty.sync()


def test_a_narrowed_terminal_gets_its_rewrapped_panel_erased(pty):
    screen = Screen()
    state = started(2)
    state.output(0, b"w" * 200 + b"\n", 0.0)
    dash = Dashboard(state, pty.slave, color_system=None)
    dash.tick(0.0)
    screen.feed(pty.sync())
    drawn = [line for line in screen.lines if line]
    assert max(len(line) for line in drawn) == 100
    pty.resize(40, 40)
    dash.tick(1.0)
    data = pty.sync()
    rows = sum(max(1, math.ceil(len(line) / 40)) for line in drawn)
    assert rows > len(drawn)
    assert data.startswith(erase_sequence(rows))
    panel = data[len(erase_sequence(rows)):].decode().split("\r\n")
    assert max(cell_len(line) for line in panel) <= 40
    dash.close()


def test_after_a_resize_signal_output_erases_the_rewrapped_panel(pty):
    state = started(1)
    state.output(0, b"w" * 200 + b"\n", 0.0)
    dash = Dashboard(state, pty.slave, color_system=None)
    dash.tick(0.0)
    widths = [cell_len(line) for line in pty.sync()[len(HIDE_CURSOR):].decode().split("\r\n")]
    pty.resize(30, 40)
    dash.resized()
    dash.emit(pty.slave, b"after\n")
    rows = sum(max(1, math.ceil(w / 30)) for w in widths)
    assert rows > len(widths)
    assert pty.sync().startswith(erase_sequence(rows) + b"after\n")
    dash.close()


def test_no_erase_from_the_top_left_corner_after_clear(pty, soon):
    """After `clear` the panel starts at the top-left corner: an "erase below" there is a
    clear of the whole screen to tmux, which pushes the frame into its scrollback."""
    screen = Screen()  # row 0 is the top of a cleared screen
    state = started(3)
    dash = Dashboard(state, pty.slave, color_system="truecolor", schedule=soon)
    dash.tick(0.0)
    for step in range(1, 6):
        dash.emit(pty.slave, b"line %d\n" % step)
        state.output(0, b"x\n", step)
        turn(soon)
        dash.tick(step)
    dash.emit(pty.slave, b"progress\r")
    turn(soon)
    dash.tick(10.0)
    dash.close()
    screen.feed(pty.sync())
    assert screen.cleared_from_home == 0
    assert screen.lines[:6] == [f"line {i}" for i in range(1, 6)] + ["progress"]


def test_a_success_leaves_a_one_line_summary_and_a_failure_none(pty):
    state = started(2, hosts=("h1", "h2"))
    for i in range(2):
        state.instance_exited(i, 0, 3.0)
    dash = Dashboard(state, pty.slave, color_system=None)
    dash.tick(0.0)
    dash.emit(pty.slave, b"out\n")
    dash.close()
    screen = Screen()
    screen.feed(pty.sync())
    assert screen.lines[0] == "out"
    assert screen.lines[1].startswith("poprun: 2 instance(s) on 2 host(s) finished, all with "
                                      "status 0, in ")
    assert screen.lines[2:] == [""]
    failed = started(2)
    failed.instance_exited(0, 0, 1.0)
    failed.instance_exited(1, 3, 1.0)
    dash = Dashboard(failed, pty.slave, color_system=None)
    dash.tick(0.0)
    dash.close()
    assert b"poprun:" not in pty.sync()  # the failure report follows instead


def test_close_without_a_drawn_panel_writes_nothing(pty):
    dash = Dashboard(started(1), pty.slave, color_system=None)
    dash.emit(pty.slave, b"only\n")
    dash.close()
    dash.tick(5.0)  # closed: no more drawing
    assert pty.sync() == b"only\n"


# --- when there is a dashboard at all -------------------------------------------------------

@pytest.mark.parametrize(("environ", "flag", "expected"), [
    ({}, False, True),
    ({}, True, False),
    ({"POPRUN_NO_DASHBOARD": "1"}, False, False),
    ({"POPRUN_NO_DASHBOARD": "0"}, False, True),
    ({"CI": "true"}, False, False),
    ({"CI": "false"}, False, True),
    ({"TERM": "dumb"}, False, False),
])
def test_wants_dashboard_on_a_terminal(pty, environ, flag, expected):
    assert wants_dashboard(pty.slave, environ, flag) is expected
    assert wants_dashboard(pty.slave, environ, flag, stdout_fd=pty.slave) is expected


def test_no_dashboard_when_stdout_goes_elsewhere_unless_forced(pty):
    """`poprun ... | tee log` with stderr a terminal: tee writes the lines
    to the screen, where the panel would erase them."""
    read_end, write_end = os.pipe()
    other = Pty()
    try:
        assert wants_dashboard(pty.slave, {}, False, stdout_fd=write_end) is False
        assert wants_dashboard(pty.slave, {}, False, stdout_fd=other.slave) is False
        assert wants_dashboard(pty.slave, {}, False, stdout_fd=os.dup2(pty.slave, 99)) is True
        for environ in ({}, {"CI": "1"}, {"POPRUN_NO_DASHBOARD": "1"}):
            assert wants_dashboard(pty.slave, environ, False, stdout_fd=write_end,
                                   force=True) is True
        assert wants_dashboard(pty.slave, {"TERM": "dumb"}, False, force=True) is False
        assert wants_dashboard(write_end, {}, False, force=True) is False  # no terminal
    finally:
        for fd in (read_end, write_end, 99):
            os.close(fd)
        other.close()


def test_no_dashboard_on_a_pipe_or_a_closed_fd():
    read_end, write_end = os.pipe()
    os.close(read_end)
    assert wants_dashboard(write_end, {}, False) is False
    os.close(write_end)
    assert wants_dashboard(write_end, {}, False) is False


def test_importing_the_module_does_not_import_rich():
    code = ("import sys, poprun.view.dashboard as d; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))")
    proc = subprocess.run([sys.executable, "-c", code], env=poprun_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- /proc sampling -------------------------------------------------------------------------

def test_stat_and_statm_parsing():
    fields = ["S"] + [str(n) for n in range(4, 14)] + ["250", "50"] + ["0"] * 30
    stat = b"123 (a (b) c) " + " ".join(fields).encode()
    assert cpu_seconds(stat, 100) == 3.0
    assert rss_bytes(b"1000 25 10 1 0 50 0\n", 4096) == 25 * 4096


def test_sampler_reads_this_process_and_gives_none_for_a_gone_one():
    sampler = ProcSampler()
    first = sampler.sample(os.getpid(), time.monotonic())
    assert first.cpu_percent is None  # a rate needs two samples
    spin_until = time.process_time() + 0.1
    while time.process_time() < spin_until:
        pass
    second = sampler.sample(os.getpid(), time.monotonic())
    assert second.cpu_percent > 0
    with open("/proc/self/status") as f:  # the kernel's own figure, in kB
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(second.rss - vm_rss) < 4 * 2**20  # pages may come and go between the reads
    child = subprocess.Popen(["true"])
    child.wait(timeout=10)
    assert sampler.sample(child.pid, time.monotonic()) is None


def test_tick_samples_local_instances(pty):
    state = DashboardState(2, ["here", "there"], 0.0)
    state.instance_started(0, "here", os.getpid(), 0.0, local=True)
    state.instance_started(1, "there", 1, 0.0)  # remote: its pid is not ours to read
    dash = Dashboard(state, pty.slave, color_system=None)
    dash.tick(0.0)
    assert state.instances[0].usage.rss > 0
    assert state.instances[1].usage is None
    dash.close()


def test_a_failed_instance_s_row_shows_its_exception():
    state = DashboardState(2, ["h1"], 0.0)
    state.plan([(0, "h1"), (1, "h1")])
    state.instance_started(1, "h1", 4343, 1.0)
    state.output(1, b"step 88\n", 2.0)
    state.instance_exited(1, 1, 3.0, {"type": "ValueError", "message": "loss is NaN",
                                      "file": "/work/train.py", "line": 88, "function": "step"})
    row = next(line for line in plain(state, 4.0, width=120).split("\n")
               if line.startswith("1 "))
    assert re.match(r"1 h1 +4343 failed 1 +2s +1 +ValueError: loss is NaN \(train.py:88, "
                    r"in step\)$", row), row
