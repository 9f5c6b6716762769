"""A command-line fuzzer: command lines generated from the
option table that `--help` shows (cli.OPTIONS) — bad values, repeats, empty values, unicode,
control characters, prefixes, poprun's options after the program, bad files (binary, deeply
nested TOML, /dev/zero, a FIFO, a directory, /dev/full) — must each exit 0 or 2, never with a
traceback, a usage error in exactly one `poprun: error: ...` line, and write no file outside a
temporary directory.

The lines run in-process (`poprun.cli.main.main`), with the working directory, HOME and TMPDIR in a
temporary directory. An audit hook records every file this process opens for writing,
creates, renames or removes while a line runs: each must lie inside that directory (other
tests running beside this one cannot make that flaky, as a listing of /tmp would). Every line
starts with `--dry-run`, which nothing before it can swallow, so nothing is ever launched;
lines that would `--check` (SSH) are not generated.
"""

from __future__ import annotations

import os
import random
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from poprun.cli import main as cli_main
from poprun.cli import options as cli

SEED = 14  # fixed: a failure reproduces; print(case) shows the command line
LINES = 600
PY = sys.executable

# Never generated: --check contacts hosts over SSH; the rest is covered by other values.
SKIPPED = {"check"}
OPTIONS = [o for o in cli.OPTIONS if o.long not in SKIPPED]

UNICODE = ["ünïcödé", "日本語", "\u200b", "e\u0301", "🙂", "\udcff"]  # \udcff: a non-UTF-8 byte
CONTROL = ["a\nb", "tab\there", "\r", "\x1b[2J", "nul\x7f"]
INTS = ["0", "1", "2", "4", "-1", "", "x", "1e3", "٣", "99999999999999999999", " 4", "4\n",
        "0x10", "2.0"]
FLOATS = ["0", "0.5", "3", "-1", "", "nan", "inf", "-inf", "1e400", "soon", "1_000"]
BOOLS = ["yes", "no", "true", "false", "on", "off", "1", "0", "YES", "maybe", "", "2"]


def files(root: Path) -> dict[str, str]:
    """Files the generated lines name: good ones and bad ones."""
    made = {}

    def write(name: str, data: bytes) -> None:
        (root / name).write_bytes(data)
        made[name] = str(root / name)

    write("good.toml", f'program = ["{PY}"]\nnum-instances = 2\nnum-replicas = 4\n'
                       'offline-mode = true\n'.encode())
    write("types.toml", b'program = ["x"]\nnum-instances = "2"\nenv = "A=1"\n')
    write("unknown.toml", b'program = ["x"]\nbogus = 1\n')
    write("binary.toml", bytes(range(256)) * 4)
    write("deep.toml", b"a = " + b"[" * 5000 + b"\n")
    write("broken.toml", b"program = [\n")
    write("table.toml", b'[program]\nx = 1\n')
    write("hosts.txt", b"# hosts\nh1 slots=2\nh2 slots=2\n")
    write("bad-hosts.txt", b"h1 slots=x\n")
    write("empty.txt", b"")
    write("nonexec.py", b"print('x')\n")
    os.mkfifo(root / "fifo")
    made["fifo"] = str(root / "fifo")
    (root / "dir").mkdir()
    made["dir"] = str(root / "dir")
    return made


def generate(rng: random.Random, named: dict[str, str]) -> list[str]:
    paths = list(named.values()) + ["/dev/zero", "/dev/full", "/dev/null", "/dev/stdin", "/",
                                    "/nonexistent/x", "", "-", "relative/missing.toml",
                                    "out.toml", "sub/dir/out.toml"]

    def value(opt: cli.Opt) -> str:
        pick = rng.random()
        if pick < 0.08:
            return rng.choice(UNICODE)
        if pick < 0.14:
            return rng.choice(CONTROL)
        if opt.kind is cli.Kind.INT:
            return rng.choice(INTS)
        if opt.kind is cli.Kind.FLOAT:
            return rng.choice(FLOATS)
        if opt.kind is cli.Kind.BOOL:
            return rng.choice(BOOLS)
        if opt.long in ("import-config", "host-file", "export-config", "result-json",
                        "output-filename", "executable-cache-path", "autoreport-dir",
                        "distribute-ssh-key-path"):
            return rng.choice(paths)
        if opt.long == "env":
            return rng.choice(["A=1", "A", "1BAD=2", "W*", "A=\n", "=x", "PATH", "HF_[A-Z]*",
                               "A B"])
        if opt.long == "host":
            return rng.choice(["h1", "h[1-3]", "h[3-1]", "", ",", "ssh://x:99999", "h1:4",
                               "h1,h1", "localhost", "[::1]:2", "a@b", "h[01-02]:2", "h[1"])
        if opt.long in ("mpi-global-args", "mpi-local-args"):
            return rng.choice(["-x A", "--tag-output", "--foo", "'unbalanced", "--mca a",
                               "--mca a b", "-x", "--output-filename", "stray", "-xB",
                               "--bind-to core --map-by x", "--timestamp-output=yes"])
        if opt.long == "instance-mpi-local-args":
            return rng.choice(["0:-x A=1", "x:y", "9:-x A", ":", "0:", "1:--foo"])
        return rng.choice(["", "x", "auto", "never", "all", "default", "ssh", "slurm",
                           "spreadnuma", "close", "disabled", "pod16", "bogus", "ed25519",
                           "zsh", "-", "--", "=", "v" * 300] + paths[:4])

    def option() -> list[str]:
        opt = rng.choice(OPTIONS)
        name = f"--{opt.long}"
        r = rng.random()
        if r < 0.1 and len(opt.long) > 4:  # a prefix, possibly ambiguous
            name = name[:rng.randint(4, len(name) - 1)]
        elif r < 0.15 and opt.short:
            name = f"-{opt.short}"
        elif r < 0.2:  # a typo
            i = rng.randrange(2, len(name))
            name = name[:i] + rng.choice("xq-") + name[i + 1:]
        if opt.kind in (cli.Kind.ACTION, cli.Kind.COUNT):
            return [name] if rng.random() < 0.9 else [f"{name}={value(opt)}"]
        if opt.kind is cli.Kind.SWITCH:
            return [name] if rng.random() < 0.8 else [f"{name}={rng.choice(BOOLS)}"]
        if opt.kind is cli.Kind.BOOL and rng.random() < 0.3:
            return [name]
        if rng.random() < 0.5:
            return [f"{name}={value(opt)}"]
        return [name, value(opt)]

    argv: list[str] = []
    for _ in range(rng.randint(0, 6)):
        argv += option()
        if rng.random() < 0.05:
            argv += argv[-2:]  # a repeat
    if rng.random() < 0.1:
        argv.append(rng.choice(["-", "---", "-vv", "-xA=1", "--=", "--nüm", "-\u00e9", "--",
                                "-h", "--version"]))
    if rng.random() < 0.5:
        argv.insert(rng.randint(0, len(argv)), "--offline-mode=yes")
    program = rng.choice([[PY, "-c", "pass"], ["true"], ["./nonexec.py"], ["nonexec.py"],
                          ["no-such-program-for-poprun"], [""], [], ["ünï"], ["dir"],
                          [PY, "train.py", "--num-instances", "2"]])
    after = option() if rng.random() < 0.15 else []
    return ["--dry-run", *argv, *program, *after]


def launches_nothing(argv: list[str]) -> bool:
    """Whether the line, as poprun parses it, is a dry run or an action (never a launch, a
    --check over SSH, or a key distribution)."""
    try:
        parsed = cli.parse_args(argv)
    except Exception:  # noqa: BLE001 - a usage error: nothing runs
        return True
    if parsed.values.get("check"):
        return False
    return parsed.action is not None or parsed.values.get("dry_run") is True


class WriteRecorder:
    """An audit hook recording what this process writes to the file system while on: each
    path, and whether it existed just before (the hook runs before the operation)."""

    WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.link", "os.symlink", "os.remove",
              "os.rmdir", "os.truncate", "shutil.rmtree", "shutil.copyfile", "shutil.move"}

    def __init__(self) -> None:
        self.on = False
        self.writes: list[tuple[str, str, bool]] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on:
            return
        if event == "open":
            path, mode, flags = (list(args) + [None, None])[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & self.WRITES)
            if writing and isinstance(path, (str, bytes, os.PathLike)):
                self._record(event, path)
        elif event in self.EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)):
                    self._record(event, path)

    def _record(self, event: str, path) -> None:
        path = os.fsdecode(path)
        try:
            existed = os.path.lexists(path)
        except (OSError, ValueError):
            existed = False
        self.writes.append((event, path, existed))

    @staticmethod
    def changed(event: str, path: str, existed: bool) -> bool:
        """Whether the file system changed there: a file or directory made, an existing
        regular file opened for writing, something removed or renamed away."""
        try:
            exists = os.path.lexists(path)
            regular = stat.S_ISREG(os.lstat(path).st_mode) if exists else False
        except (OSError, ValueError):
            exists = regular = False
        if event == "open":
            return (exists and not existed) or (existed and regular)
        return exists != existed


_RECORDER: WriteRecorder | None = None


def recorder() -> WriteRecorder:
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = WriteRecorder()
    return _RECORDER


def inside(path: str, root: Path) -> bool:
    full = os.path.realpath(os.path.join(os.getcwd(), path))
    return full == str(root) or full.startswith(str(root) + os.sep)


@pytest.mark.timeout(120)
def test_generated_command_lines_exit_0_or_2_in_one_line_and_write_only_where_told(
        tmp_path, monkeypatch, capfd):
    root = Path(os.path.realpath(tmp_path))
    work, home, temp = root / "work", root / "home", root / "tmp"
    for d in (work, home, temp):
        d.mkdir()
    named = files(work)
    os.chmod(named["nonexec.py"], stat.S_IRUSR | stat.S_IWUSR)
    monkeypatch.chdir(work)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "POPRUN_", "IPUOF_", "XDG_")) or name in (
                "CI", "POPTORCH_CACHE_DIR", "POPART_CACHE_DIR", "TF_POPLAR_FLAGS"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    rng = random.Random(SEED)
    watch = recorder()
    ran, outcomes = 0, {0: 0, 2: 0}
    while ran < LINES:
        argv = generate(rng, named)
        if not launches_nothing(argv):
            continue
        ran += 1
        watch.writes.clear()
        watch.on = True
        try:
            code = cli_main.main(argv)
        finally:
            watch.on = False
        out, err = capfd.readouterr()
        case = f"poprun {argv!r}: exit {code}\n{err}"
        assert code in (0, 2), case
        outcomes[code] += 1
        assert "Traceback" not in err + out, case
        if code == 2:
            lines = err.splitlines()
            errors = [line for line in lines if line.startswith("poprun: error: ")]
            assert len(errors) == 1 and lines[-1] == errors[0], case
            assert all(line.startswith(("poprun: warning: ", "poprun: configuration "
                                        "written to ")) for line in lines[:-1]), case
        outside = [w for w in watch.writes
                   if not inside(w[1], root) and WriteRecorder.changed(*w)]
        assert not outside, f"{case}\nwrote outside {root}: {outside}"
        monkeypatch.chdir(work)  # in case a line changed it
    print(f"{LINES} lines: {outcomes}")
    assert outcomes[0] > 20 and outcomes[2] > 200, outcomes  # both paths exercised
