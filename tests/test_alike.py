"""The hosts compared (poprun/plan/alike.py, pure) and what each host reports of itself
(spawner/hostfacts.py), read from real files made here: a venv's layout, METADATA files,
scripts with `#!` lines. End to end, on sshd hosts with files of their own:
tests/test_compare_hosts.py."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import pytest

from poprun.plan import alike
from spawner import hostfacts

OURS = "%d.%d.%d" % sys.version_info[:3]


def facts(**changes) -> dict:
    """One host's answer as an agent gives it, with `changes`."""
    base = {"program": "/usr/bin/python3",
            "python": {"path": "/usr/bin/python3", "version": "3.11.2", "prefix": "/usr"},
            "distributions": {"torch": "2.13.0", "numpy": "2.1.0"},
            "entry": {"name": "train.py", "path": "/w/train.py", "size": 10, "mtime": 1000.0,
                      "sha256": "aa"},
            "cwd": "/w", "cwd_exists": True,
            "sdk": {"enabled": {}, "version": None},
            "space": {"temp": {"path": "/tmp", "free": 50 << 30}},
            "time": 1720.0}
    base.update(changes)
    return json.loads(json.dumps(base))  # as it arrives: JSON


def texts(by_host: dict[str, dict], variables: dict | None = None, offsets=None,
          local=()) -> list[str]:
    read = {h: alike.read(f, (variables or {}).get(h, {})) for h, f in by_host.items()}
    return [d.text for d in alike.compare(read, offsets, local)]


# --- compare -------------------------------------------------------------------------------

def test_hosts_that_agree_have_no_difference():
    assert texts({f"h{i}": facts() for i in range(1, 5)}) == []


def test_a_distribution_is_named_with_the_hosts_on_each_side_the_most_common_first():
    hosts = {f"h{i}": facts() for i in range(1, 4)}
    hosts["h4"] = facts(distributions={"torch": "2.12.1", "numpy": "2.1.0"})
    assert texts(hosts) == ["torch 2.13.0 on h[1-3], 2.12.1 on h4"]
    hosts["h2"] = facts(distributions={"torch": "2.13.0"})
    assert texts(hosts) == ["numpy 2.1.0 on h[1,3-4], not installed on h2",
                            "torch 2.13.0 on h[1-3], 2.12.1 on h4"]


def test_a_script_that_differs_is_named_with_its_age_there():
    changed = facts(entry={"name": "train.py", "path": "/w/train.py", "size": 11,
                           "mtime": 1000.0, "sha256": "bb"})
    assert texts({"h1": facts(), "h2": facts(), "h3": facts(), "h4": changed}) == [
        "train.py differs on h4 (modified 12 min ago)"]
    gone = facts(entry={"name": "train.py", "path": None})
    assert texts({"h1": facts(), "h2": facts(), "h3": gone}) == ["train.py missing on h3"]


def test_a_script_copied_at_another_time_is_alike():
    later = facts(entry={"name": "train.py", "path": "/w/train.py", "size": 10,
                         "mtime": 1500.0, "sha256": "aa"})
    assert texts({"h1": facts(), "h2": later}) == []


def test_python_program_sdk_and_working_directory():
    other = facts(python={"path": "/opt/venv/bin/python", "version": OURS},
                  program="/opt/venv/bin/python", cwd_exists=False,
                  sdk={"enabled": {"POPLAR_SDK_ENABLED": "/opt/poplar_sdk-ubuntu_20_04-"
                                                         "3.3.0+1403-208993bbb7/poplar"},
                       "version": "3.3.0+1403"})
    assert texts({"h1": facts(), "h2": other}) == [
        f"Python /usr/bin/python3 3.11.2 on h1, /opt/venv/bin/python {OURS} on h2",
        "program /usr/bin/python3 on h1, /opt/venv/bin/python on h2",
        "working directory /w missing on h2",
        "Poplar SDK none on h1, 3.3.0+1403 on h2"]


def test_variables_of_the_remote_hosts_sessions_are_compared_not_the_launchers():
    hosts = {"here": facts(), "h1": facts(), "h2": facts()}
    variables = {"here": {"LANG": "en_GB.UTF-8", "EDITOR": "vi"}, "h1": {"LANG": "C.UTF-8"},
                 "h2": {"LANG": "C.UTF-8", "OMP_NUM_THREADS": "4"}}
    assert texts(hosts, variables, local=["here"]) == [
        "$OMP_NUM_THREADS unset on h1, '4' on h2"]


def test_variables_that_differ_by_design_are_not_compared():
    given = {"HOSTNAME": "h1", "HOME": "/home/a", "SSH_CLIENT": "x", "XDG_CACHE_HOME": "/c",
             "SLURM_JOB_ID": "7", "SHLVL": "2", "POPLAR_SDK_ENABLED": "/opt/sdk",
             "PATH": "/bin", "LANG": "C"}
    assert alike.host_variables(given, {"PATH"}) == {"LANG": "C"}


def test_low_free_space_and_a_skewed_clock_are_named_per_host():
    small = facts(space={"cache": {"path": "/scratch/cache", "free": 300 << 20},
                         "temp": {"path": "/tmp", "free": 50 << 30}})
    assert texts({"h1": facts(), "h2": small}, offsets={"h1": 0.002, "h2": -4.5}) == [
        "free space 300M in /scratch/cache on h2 (less than 1.0G)",
        "clock of h2 4.5 s behind this machine's"]


def test_render_shows_a_bounded_table_and_the_record_a_bounded_list():
    many = {"h1": facts(distributions={f"d{i}": "1" for i in range(150)}),
            "h2": facts(distributions={f"d{i}": "2" for i in range(150)})}
    found = alike.compare({h: alike.read(f) for h, f in many.items()})
    lines = alike.render(found)
    assert len(lines) == alike.SHOWN + 1
    assert lines[-1] == "... and 138 more (poprun --check shows them all)"
    kept = alike.recorded(found)
    assert len(kept) == alike.RECORDED + 1 and kept[-1]["text"].startswith("... and 50 more")
    assert kept[0] == {"kind": "distribution", "name": "d0", "text": "d0 1 on h1, 2 on h2",
                       "sides": [{"value": "1", "hosts": ["h1"]},
                                 {"value": "2", "hosts": ["h2"]}]}


# --- another host's words ------------------------------------------------------------------

@pytest.mark.parametrize("raw", [None, [], "facts", 7, {"python": "x", "entry": [1],
                                                        "distributions": ["torch"],
                                                        "space": {"temp": "full"},
                                                        "sdk": "on", "time": "now"}])
def test_nonsense_reads_as_nothing_or_as_unknown_never_raises(raw):
    found = alike.read(raw)
    assert (found is None) == (not isinstance(raw, dict))
    if found is not None:
        assert found.python is None and found.entry is None and found.distributions is None
        assert found.space == () and found.time is None and found.sdk == "none"
        alike.compare({"h1": found, "h2": alike.read(facts())})


def test_what_a_host_sends_is_bounded():
    huge = facts(cwd="x" * 1_000_000, time=math.inf,
                 distributions={f"d{i}": "1" * 5000 for i in range(11_000)})
    found = alike.read(huge)
    assert len(found.cwd) == alike.MAX_TEXT and found.time is None
    assert len(found.distributions) == alike.MAX_ITEMS
    assert all(len(v) == alike.MAX_TEXT for v in found.distributions.values())
    assert alike.read(facts(time=True)).time is None  # a bool is no number


# --- what a host reports of itself ---------------------------------------------------------

@pytest.mark.parametrize("args, script, module", [
    (["train.py", "--lr", "1"], "/w/train.py", None),
    (["-u", "-W", "ignore", "sub/t.py"], "/w/sub/t.py", None),
    (["-Wignore", "-X", "dev", "t.py"], "/w/t.py", None),
    (["-um", "pkg.main", "x"], None, "pkg.main"),
    (["-m", "pkg"], None, "pkg"),
    (["-c", "import x", "t.py"], None, None),
    (["-"], None, None),
    (["--check-hash-based-pycs", "always", "t.py"], "/w/t.py", None),
])
def test_an_interpreter_s_script_or_module_is_found_in_its_arguments(args, script, module):
    assert hostfacts._python_target(args, "/w") == (script, module)


def _venv_layout(root: Path, version: str, site_packages: bool = False) -> Path:
    """A venv's files as `python -m venv` lays them out, its python a link to ours."""
    major_minor = ".".join(version.split(".")[:2])
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    (root / "pyvenv.cfg").write_text(
        f"home = {os.path.dirname(sys.executable)}\n"
        f"include-system-site-packages = {'true' if site_packages else 'false'}\n"
        f"version = {version}\n")
    site = root / "lib" / f"python{major_minor}" / "site-packages"
    site.mkdir(parents=True)
    return site


def _dist(site: Path, name: str, version: str, directory: str | None = None) -> None:
    info = site / (directory or f"{name}-{version}.dist-info")
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   "\nName: not-a-header\n")


def test_a_venv_s_version_and_distributions_come_from_its_files(tmp_path):
    site = _venv_layout(tmp_path / "venv", "3.99.1")
    _dist(site, "Demo_Pkg", "1.0")
    _dist(site, "other", "2.0", directory="other-9.9.dist-info")  # METADATA wins
    (site / "legacy.egg-info").write_text("Metadata-Version: 1.0\nName: legacy\nVersion: 0.3\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    _dist(extra, "demo.pkg", "5.0")  # earlier on the path: it shadows the venv's
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "train.py").write_text("print(1)\n")
    python = str(tmp_path / "venv" / "bin" / "python")
    found = hostfacts.gather([python, "train.py"], {"PATH": "/bin", "PYTHONPATH": str(extra)},
                             str(tmp_path / "w"))
    assert found["python"] == {"path": python, "version": "3.99.1",
                               "prefix": str(tmp_path / "venv")}
    assert found["distributions"] == {"demo-pkg": "5.0", "other": "2.0", "legacy": "0.3"}
    assert found["entry"]["name"] == "train.py" and found["entry"]["size"] == 9
    assert found["entry"]["sha256"] == hashlib.sha256(b"print(1)\n").hexdigest()


def test_a_script_s_shebang_names_its_python_and_a_binary_has_none(tmp_path):
    script = tmp_path / "run"
    script.write_text("#!/usr/bin/env -S python3 -u\nprint(1)\n")
    script.chmod(0o755)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    env = {"PATH": str(bindir)}
    found = hostfacts.gather([str(script)], env, str(tmp_path))
    assert found["python"]["path"] == str(bindir / "python3")
    assert found["python"]["version"] == OURS
    assert found["entry"]["path"] == str(script)
    assert hostfacts.gather(["/bin/true"], env, str(tmp_path))["python"] is None


def test_the_sdk_version_is_read_from_its_enabled_path(tmp_path):
    env = {"PATH": "/bin",
           "POPLAR_SDK_ENABLED": "/opt/poplar_sdk-ubuntu_20_04-3.3.0+1403-208993bbb7/"
                                 "poplar-ubuntu_20_04-3.3.0+7857-b67b751185",
           "POPART_SDK_ENABLED": "/opt/x/popart"}
    found = hostfacts.gather(["/bin/true"], env, str(tmp_path))
    assert found["sdk"] == {"enabled": {"POPART_SDK_ENABLED": "/opt/x/popart",
                                        "POPLAR_SDK_ENABLED": env["POPLAR_SDK_ENABLED"]},
                            "version": "3.3.0+1403"}


def test_free_space_is_read_where_the_cache_would_be_made(tmp_path):
    found = hostfacts.gather(["/bin/true"], {"PATH": "/bin", "TMPDIR": str(tmp_path)},
                             str(tmp_path), cache=str(tmp_path / "not" / "yet"))
    st = os.statvfs(tmp_path)  # the nearest directory that exists
    assert found["space"]["cache"]["path"] == str(tmp_path / "not" / "yet")
    for where in ("cache", "temp"):  # others write meanwhile: within 64 MiB
        assert abs(found["space"][where]["free"] - st.f_bavail * st.f_frsize) < 64 << 20


# --- files that are not files -------------------------------------------------------

def test_a_script_that_is_no_regular_file_is_named_with_what_it_is():
    fifo = {"name": "train.py", "path": "/w/train.py", "size": None, "mtime": None,
            "sha256": None, "kind": "FIFO"}
    assert texts({"h1": facts(), "h2": facts(), "h3": facts(entry=fifo)}) == [
        "train.py is a FIFO on h3"]
    assert texts({"h1": facts(entry=fifo), "h2": facts(entry=fifo), "h3": facts()}) == [
        "train.py is a FIFO on h[1-2]; a file on h3 (modified 12 min ago)"]
    long = {**fifo, "kind": "x" * 10_000}  # another host's words: bounded
    assert len(texts({"h1": facts(), "h2": facts(entry=long)})[0]) < 200


def test_a_host_whose_facts_did_not_arrive_differs():
    assert [d.text for d in alike.unknown(["h2", "h3"])] == [
        "no facts from h[2-3]: its agent did not send them (lost, or too slow), so it "
        "cannot be compared"]
    assert alike.unknown([]) == ()


@pytest.mark.timeout(10)
def test_a_fifo_a_device_or_a_directory_is_reported_never_opened_for_reading(tmp_path):
    """Guards a defect: the agent read the script with a plain open(), which blocks on a FIFO for
    as long as nobody writes to it (the agent's one thread, and with it the launch). Each is
    now reported by what it is, at once; a link to a file is still followed."""
    os.mkfifo(tmp_path / "fifo.py")
    (tmp_path / "dir.py").mkdir()
    (tmp_path / "real.py").write_text("print(1)\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "real.py")
    env = {"PATH": os.defpath}
    for script, kind in (("fifo.py", "FIFO"), ("dir.py", "directory"),
                         ("/dev/null", "character device")):
        entry = hostfacts.gather([sys.executable, script], env, str(tmp_path))["entry"]
        assert entry["kind"] == kind and entry["sha256"] is None, entry
        assert alike.read(hostfacts.gather([sys.executable, script], env, str(tmp_path))
                          ).entry.kind == kind
    entry = hostfacts.gather([sys.executable, "link.py"], env, str(tmp_path))["entry"]
    assert "kind" not in entry and entry["sha256"] == hashlib.sha256(b"print(1)\n").hexdigest()
    os.mkfifo(tmp_path / "prog")  # a FIFO as the program, and as a METADATA file
    os.chmod(tmp_path / "prog", 0o755)
    assert hostfacts.gather(["./prog"], env, str(tmp_path))["program"] is None
    site = tmp_path / "site"
    (site / "fifo_pkg-1.0.dist-info").mkdir(parents=True)
    os.mkfifo(site / "fifo_pkg-1.0.dist-info" / "METADATA")
    assert "fifo-pkg" not in hostfacts.gather(
        [sys.executable, "real.py"], {**env, "PYTHONPATH": str(site)},
        str(tmp_path))["distributions"]


@pytest.mark.timeout(20)
def test_a_huge_sparse_script_is_compared_by_size_without_reading_it(tmp_path):
    big = tmp_path / "big.py"
    with open(big, "wb") as f:
        f.truncate(2 << 30)
    entry = hostfacts.gather([sys.executable, "big.py"], {"PATH": os.defpath},
                             str(tmp_path))["entry"]
    assert entry["size"] == 2 << 30 and entry["sha256"] is None and "kind" not in entry


def test_a_launch_compares_a_host_without_facts_as_differing():
    """hostcheck.compare, as a launch calls it: h2's agent sent no facts (hostcheck.py let
    such a host through, so --compare-hosts=error started the job)."""
    from poprun.plan.config import LaunchConfig
    from poprun.run import hostcheck

    answer, config = hostcheck.Answer(facts(), 1720.0, {}), LaunchConfig(program=["python3"])
    found = hostcheck.compare(config, {}, ["h1", "h2"], [], None, {"h1": answer})
    assert [d.kind for d in found] == ["facts"] and "no facts from h2" in found[0].text
    both = hostcheck.compare(config, {}, ["h1", "h2"], [], None, {"h1": answer, "h2": answer})
    assert both == ()
