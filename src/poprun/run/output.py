"""Where instance output goes: poprun's stdout/stderr (tagged or not), per-instance files.

Blocks arrive as whole lines (see spawner.local) and leave in one write each, so lines of
different instances never interleave. Output is handled as bytes end to end: it is never decoded
(invalid UTF-8 passes through untouched) and never goes through rich (docs/architecture.md,
"Measured reasons": ~140 µs per line there against well under 1 µs here).

Two kinds of block end without a line end: a stream's last bytes, and a 1 MiB piece of a
longer line. Tagged (or timestamped), every block is written as tagged lines, so those end
there. Untagged, an instance's bytes go out as they are: its unfinished line stays open on
that destination, and poprun adds a line end only where something else must be written there
first (another instance's or stream's block, poprun's own message: `write_own`), so that it
never joins that line.

On a terminal, tags are coloured (`tag_colour_system` asks rich whether and how, by its rules):
each (instance, stream) tag is rendered to ANSI bytes once, reset right after it, and the
instance's line bytes follow it raw. rich is imported only when a console fd may be a terminal.
"""

from __future__ import annotations

import collections
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import field

from spawner.local import Stream
from spawner.uncompiled import dataclass

from poprun.fdio import write_all
from poprun.fold import tag_label
from poprun.view.console import tag_colour_system

TAIL_LINES = 20  # stderr lines kept per instance for the failure report
# Compiled on first use (re's cache): only blocks with a `\r` need them.
_LINE_END = rb"\r\n|\r|\n"
_LINE_END_AT_END = rb"(?:\r\n|\r|\n)\Z"


@dataclass
class InstanceOutput:
    """What one instance has written, as far as the report needs it."""

    lines: int = 0
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    def __init__(self, lines=0, stderr_tail=None):  # by hand: one per instance (uncompiled)
        self.lines = lines
        self.stderr_tail = collections.deque(maxlen=TAIL_LINES) if stderr_tail is None \
            else stderr_tail


NOCOPY = ":nocopy"  # mpirun's `--output-filename DIR:nocopy`: files only, no console copy


def output_files(given: str | None, cwd: str) -> tuple[str | None, bool]:
    """`--output-filename DIR[:nocopy]` read once for every part that needs it: the
    directory (absolute) and whether output is copied to the console too. Open MPI takes
    the suffix in any case (`:NOCOPY`), so do we."""
    if not given:
        return None, True
    nocopy = given.lower().endswith(NOCOPY)
    directory = given[:-len(NOCOPY)] if nocopy else given
    return os.path.join(cwd, directory), not nocopy


@dataclass(frozen=True)
class OutputOptions:
    tag: bool = False
    timestamp: bool = False
    only_instance: int | None = None
    directory: str | None = None  # --output-filename: DIR/1/rank.<i>/{stdout,stderr}
    copy_to_console: bool = True  # False with mpirun's `--output-filename DIR:nocopy`
    # With `tag`: the environment (NO_COLOR, FORCE_COLOR, TERM, ...) from which rich's rules
    # decide, for each console fd on its own, whether tags are coloured; None: never coloured.
    colour_environ: Mapping[str, str] | None = None
    fold: bool = False  # --fold-output: identical lines of instances once (run/folding.py)


class OutputRouter:
    """Implements spawner.local.Sink's output half; the launcher adds the exit half."""

    def __init__(self, options: OutputOptions, stdout_fd: int = 1, stderr_fd: int = 2,
                 on_broken_pipe: Callable[[], None] = lambda: None,
                 on_write_error: Callable[[str, OSError], None] = lambda where, exc: None
                 ) -> None:
        self._options = options
        # Called once per destination that cannot be written (a full disk, a stdout opened
        # read-only): that destination is dropped, the others go on, and the job stops.
        self._on_write_error = on_write_error
        self._failed_files: set[tuple[int, Stream]] = set()
        # How console bytes are written: write_all, or a live dashboard's emit, which erases
        # its panel around them (set by the job when there is one).
        self.write = write_all
        self._fds = {Stream.STDOUT: stdout_fd, Stream.STDERR: stderr_fd}
        self._on_broken_pipe = on_broken_pipe
        self._closed: set[Stream] = set()  # console streams whose reader has gone
        self._files: dict[tuple[int, Stream], object] = {}
        self._one_fd: int | None = None  # --output-filename's DIR/1 (see _one)
        self.instances: dict[int, InstanceOutput] = collections.defaultdict(InstanceOutput)
        # Tags are rendered once per (instance, stream), not per line.
        self._tags: dict[tuple[int, Stream], bytes] = {}
        self._colours = {}  # stream -> rich ColorSystem of its terminal; absent: plain tags
        if options.tag and options.colour_environ is not None:
            self._colours = {stream: tag_colour_system(fd, options.colour_environ)
                             for stream, fd in self._fds.items()}
        self._after_cr: set[tuple[int, Stream]] = set()  # last block ended with `\r`
        # Untagged: per destination (stdout and stderr may be one file: a terminal, 2>&1),
        # the (instance, stream) whose last block left its line unfinished there.
        self._dests = {fd: _identity(fd) for fd in (stdout_fd, stderr_fd)}
        self._open: dict[object, tuple[int, Stream]] = {}
        # --fold-output: the console path goes through it (an observer the session adds);
        # moot when one instance or none reaches the console.
        self.fold = None
        if options.fold and options.copy_to_console and options.only_instance is None:
            from poprun.run.folding import ConsoleFold

            self.fold = ConsoleFold(self)

    def report_to(self, on_broken_pipe: Callable[[], None],
                  on_write_error: Callable[[str, OSError], None]) -> None:
        """Where a broken pipe and a write error go from now on (the current attempt's job)."""
        self._on_broken_pipe, self._on_write_error = on_broken_pipe, on_write_error

    def on_output(self, key: int, stream: Stream, data: bytes) -> None:
        record = self.instances[key]
        counted = None  # the block's line count, when the tagging write found it on the way
        if stream is Stream.STDERR:
            record.stderr_tail.extend(last_lines(data, TAIL_LINES))
        if self._options.directory is not None and (key, stream) not in self._failed_files:
            self._to_file(key, stream, data)
        only = self._options.only_instance
        if self._options.copy_to_console and (only is None or only == key) and (
                stream not in self._closed):
            if self.fold is None:
                counted = self.console(key, stream, data)
            else:  # it writes through console() and write_folded() as it releases lines
                self.fold.add(key, stream, data)
        # Counting newlines is a scan of its own (~15 % of poprun's CPU on 8 x 200k tagged
        # lines): the tagging replace's growth gives the count for free.
        record.lines += data.count(b"\n") if counted is None else counted

    def console(self, key: int | tuple[int, ...], stream: Stream, data: bytes) -> int | None:
        """Write a block to the console (the set of instances `key`, for a folded one: its
        tag `[1,0-62]<stdout>:`, or untagged `[0-62] `, _prefix); returns its number of
        `\\n` when that came for free."""
        if stream in self._closed:
            return None
        try:
            return self._write(key, stream, data)
        except BrokenPipeError:  # e.g. `poprun ... | head`: stop the job as SIGPIPE would
            self._closed.add(stream)
            self._on_broken_pipe()
        except OSError as exc:  # e.g. a stdout opened read-only, or on a full disk
            self._closed.add(stream)
            self._on_write_error(f"poprun's {stream.name.lower()}", exc)
        return None

    def _to_file(self, key: int, stream: Stream, data: bytes) -> None:
        try:
            self._file(key, stream).write(data)
        except OSError as exc:
            self._failed_files.add((key, stream))
            self._on_write_error(exc.filename or self._file_path(key, stream), exc)

    def _prefix(self, key: int | tuple[int, ...], stream: Stream) -> bytes:
        """What goes before each line: Open MPI's `<date>[1,<i>]<stdout>:` with tags and
        timestamps, `[1,<i>]<stdout>:` with tags, `<date><stdout>:` with timestamps (its
        iof_base_output.c; the date is C's ctime() without its newline). Folded and
        untagged, the instance or set that wrote the line follows: `[2] `, `[0-62] `."""
        prefix = b""
        if self._options.timestamp:
            prefix = time.ctime().encode()
            if not self._options.tag:
                prefix += b"<stdout>:" if stream is Stream.STDOUT else b"<stderr>:"
        if self._options.tag:
            tag = self._tags.get((key, stream))
            if tag is None:
                tag = self._tags[(key, stream)] = render_tag(key, stream,
                                                             self._colours.get(stream))
            prefix += tag
        elif self.fold is not None:
            # Folded, every line says who wrote it, one instance's too, as clubak and dshbak
            # do: else the slow instance's copy of a folded line reads as an anonymous one.
            prefix += b"[%s] " % tag_label(key).encode()
        return prefix

    def _write(self, key: int, stream: Stream, data: bytes) -> int | None:
        """Write one block; returns its number of `\\n` when that came for free."""
        fd = self._fds[stream]
        prefix = self._prefix(key, stream)
        if not prefix:
            self._write_as_is(fd, (key, stream), data)
            return
        # Progress updates are passed on as soon as their `\r` arrives, so a `\r\n` can be
        # split between two blocks: that `\n` ends the tagged line, it does not start one.
        after_cr = (key, stream) in self._after_cr
        self._after_cr.discard((key, stream))
        if data.endswith(b"\r"):
            self._after_cr.add((key, stream))
        ended = 0  # a `\n` already written
        if after_cr and data.startswith(b"\n"):
            self.write(fd, b"\n")
            data, ended = data[1:], 1
            if not data:
                return ended
        # Every block starts at a line start; a prefix also follows every inner line end.
        if b"\r" in data:  # progress updates: rare, so simple beats fast here
            last = re.search(_LINE_END_AT_END, data)
            core, end = (data[:last.start()], last.group(0)) if last else (data, b"\n")
            self.write(fd, prefix, re.sub(_LINE_END, lambda m: m.group(0) + prefix, core), end)
            return
        # One C-level replace does the work; the prefix it puts after the final newline is
        # left out of the write rather than sliced off (which would copy the block again).
        body = data.replace(b"\n", b"\n" + prefix)
        if data.endswith(b"\n"):
            self.write(fd, prefix, memoryview(body)[:len(body) - len(prefix)])
        else:  # the last line of a stream, unterminated: end it, or the next tag joins it
            self.write(fd, prefix, body, b"\n")
        return ended + (len(body) - len(data)) // len(prefix)

    def _write_as_is(self, fd: int, source: tuple[int, Stream], data: bytes) -> None:
        """An untagged block, its bytes as they are; after a line end only where another
        source left its line unfinished on this destination."""
        dest = self._dests[fd]
        unfinished = self._open.pop(dest, None)
        if unfinished is not None and unfinished != source:
            self.write(fd, b"\n", data)
        else:
            self.write(fd, data)
        if not data.endswith((b"\n", b"\r")):
            self._open[dest] = source

    def write_own(self, fd: int, data: bytes) -> None:
        """poprun's own message or report to `fd` (one of the console's): on a line of its own,
        after an instance's line left unfinished there, if any. Raises OSError."""
        dest = self._dests.get(fd, _identity(fd))
        if self._open.pop(dest, None) is not None:
            self.write(fd, b"\n", data)
        else:
            self.write(fd, data)

    def check_directory(self) -> None:
        """Before anything starts: the `--output-filename` directory is this user's and can
        be written (not a file, not on a read-only filesystem...), and nothing poprun will
        write there is a link another user could have planted. Raises OSError."""
        if self._options.directory is None:
            return
        one = self._one()
        probe = f".poprun-probe-{os.getpid()}-{os.urandom(4).hex()}"
        os.close(os.open(probe, _NEW_FILE | os.O_EXCL, 0o600, dir_fd=one))
        os.unlink(probe, dir_fd=one)
        for rank in os.scandir(one):  # a previous run's files, or something planted
            if rank.name.startswith("rank."):
                self._check_rank(one, rank.name)

    def _check_rank(self, one: int, name: str) -> None:
        path = os.path.join(self._options.directory, "1", name)
        owned(os.stat(name, dir_fd=one, follow_symlinks=False), path, directory=True)
        for stream in Stream:
            try:
                found = os.stat(f"{name}/{stream.name.lower()}", dir_fd=one,
                                follow_symlinks=False)
            except FileNotFoundError:
                continue
            owned(found, os.path.join(path, stream.name.lower()), directory=False)

    def _one(self) -> int:
        """DIR/1, opened once: every file is made below it through descriptors, so a path
        another user changes meanwhile leads nowhere else."""
        if self._one_fd is None:
            top = open_output_directory(self._options.directory)
            try:
                self._one_fd = own_subdirectory(top, "1",
                                                os.path.join(self._options.directory, "1"))
            finally:
                os.close(top)
        return self._one_fd

    def _file_path(self, key: int, stream: Stream) -> str:
        return os.path.join(self._options.directory, "1", f"rank.{key}", stream.name.lower())

    def _file(self, key: int, stream: Stream):
        handle = self._files.get((key, stream))
        if handle is None:
            rank_path = os.path.dirname(self._file_path(key, stream))
            rank = own_subdirectory(self._one(), f"rank.{key}", rank_path)
            try:
                fd = own_file(rank, stream.name.lower(), self._file_path(key, stream))
            finally:
                os.close(rank)
            # Unbuffered: a write error (a full disk) shows at the write, naming this file.
            handle = self._files[(key, stream)] = open(fd, "wb", buffering=0)
        return handle

    def close(self) -> None:
        if self.fold is not None:  # what it still holds, before poprun's report
            self.fold.flush()
        for handle in self._files.values():
            handle.close()
        self._files.clear()
        if self._one_fd is not None:
            os.close(self._one_fd)
            self._one_fd = None


def last_lines(data: bytes, count: int) -> list[bytes]:
    """`data.splitlines()[-count:]`, splitting only the end: a block is up to a pipe's worth
    (1 MiB) and splitting all of it for the last lines cost ~50 ns a line."""
    at = len(data)
    for _ in range(count + 1):  # a line start at or before the count-th last line
        at = data.rfind(b"\n", 0, at)
        if at < 0:
            return data.splitlines()[-count:]
    return data[at + 1:].splitlines()[-count:]


def _identity(fd: int) -> object:
    """What `fd` writes to: stdout and stderr are one destination when they are one file."""
    try:
        found = os.fstat(fd)
    except OSError:
        return ("fd", fd)
    return (found.st_dev, found.st_ino)


# --- the --output-filename directory ------------------------------------------------------
# poprun may run as root and write there: it never follows a symbolic link it did not make
# and writes only in directories and files of its own user (once, a link planted by
# another user made it overwrite a root-owned file, fs.protected_symlinks off).

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted there must not block the loop at the open (then refused).
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def owned(found: os.stat_result, path: str, directory: bool) -> None:
    """Raise OSError unless `found` (not followed) is a directory, or a regular file with one
    link (a hard link could name any file of this user), of poprun's own user."""
    if stat.S_ISLNK(found.st_mode):
        raise OSError(errno.ELOOP, "a symbolic link, which poprun does not follow there", path)
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(found.st_mode):
        raise OSError(errno.ENOTDIR if directory else errno.EEXIST,
                      f"not a {'directory' if directory else 'regular file'}", path)
    if found.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"owned by another user (uid {found.st_uid}): poprun "
                      "writes only in its own user's directories", path)
    if not directory and found.st_nlink != 1:
        raise OSError(errno.EMLINK, f"has {found.st_nlink} hard links", path)


def open_output_directory(path: str) -> int:
    """The directory the user named, made if missing, as a descriptor. It may be a symbolic
    link of the user's own (or root's), not another user's; where it leads must be the
    user's own directory."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        pass  # a file: the open below says "Not a directory"
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        owned(link, path, directory=True)  # raises: a link of another user's
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        owned(os.fstat(fd), path, directory=True)
    except OSError:
        os.close(fd)
        raise
    return fd


def own_subdirectory(parent: int, name: str, path: str) -> int:
    """`name` below `parent`, made if missing, as a descriptor: a real directory of this
    user."""
    try:
        os.mkdir(name, dir_fd=parent)
    except FileExistsError:
        pass
    return _open_owned(parent, name, path, _DIRECTORY, directory=True)


def own_file(parent: int, name: str, path: str) -> int:
    """`name` below `parent` opened for writing, emptied: made if missing, else this user's
    regular file with one link (checked before it is emptied)."""
    fd = _open_owned(parent, name, path, _NEW_FILE, directory=False)
    try:
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except OSError:
        os.close(fd)
        raise
    return fd


def _open_owned(parent: int, name: str, path: str, flags: int, directory: bool) -> int:
    """os.open, then `owned` on what was opened. An open that fails on what is there (a
    symbolic link: ELOOP, a FIFO: ENXIO) says what it found."""
    try:
        fd = os.open(name, flags, 0o666, dir_fd=parent)
    except OSError as error:
        try:
            found = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            raise error from None
        owned(found, path, directory)
        raise
    try:
        owned(os.fstat(fd), path, directory)
    except OSError:
        os.close(fd)
        raise
    return fd


# --- colour ------------------------------------------------------------------------------

# Instance i's tag colour is TAG_PALETTE[i % 9]: the terminal's own 16 colours, which its theme
# keeps legible on its background (blue, dark on most, only in its bright form); neighbours
# always differ in hue. Red is not among them: it marks `<stderr>:` after the instance's
# `[1,i]`. Every part of a tag's style is a colour, so where rich drops colours (NO_COLOR)
# nothing is left and the tag is plain.
TAG_PALETTE = ("cyan", "magenta", "green", "yellow", "bright_blue",
               "bright_cyan", "bright_magenta", "bright_green", "bright_yellow")
STDERR_COLOUR = "red"
# A folded line's instances: grey, apart from every instance's own colour, legible on dark
# and light backgrounds alike.
FOLDED_COLOUR = "bright_black"


def render_tag(key: int | tuple[int, ...], stream: Stream, colour_system=None) -> bytes:
    """`[1,<key>]<stdout>:` (mpirun's tag), styled for a rich ColorSystem when one is given:
    ANSI codes, the tag, a reset; the output's own colours after it are left alone. A
    folded line's tag has its set of instances in the same place, `[1,0-62]<stdout>:`."""
    name = "stdout" if stream is Stream.STDOUT else "stderr"
    # A spawned process's key is its whole label, `2,0` (run/worlds/spawn.py): Open MPI's tag.
    label = key if type(key) is str else "1," + tag_label(key)
    if colour_system is None:
        return b"[%s]<%s>:" % (label.encode(), name.encode())
    from rich.style import Style

    colour = Style(color=TAG_PALETTE[key % len(TAG_PALETTE)] if type(key) is int
                   else FOLDED_COLOUR)
    if stream is Stream.STDOUT:
        text = colour.render(f"[{label}]<stdout>:", color_system=colour_system)
    else:
        text = (colour.render(f"[{label}]", color_system=colour_system)
                + Style(color=STDERR_COLOUR).render("<stderr>:", color_system=colour_system))
    return text.encode()


