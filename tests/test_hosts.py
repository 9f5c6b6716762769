"""Host-list syntax (pure)."""

import pytest

from poprun.errors import ConfigError
from poprun.plan.hosts import (Host, expand_brackets, is_local, job_hosts, parse_host_file,
                          parse_host_list)


def names(hosts):
    return [str(h) for h in hosts]


def test_comma_list_and_ranges():
    assert names(parse_host_list("h1,h2")) == ["h1", "h2"]
    assert names(parse_host_list("pod[1-4]")) == ["pod1", "pod2", "pod3", "pod4"]


def test_zero_padding_is_kept_and_lists_mix_with_ranges():
    assert expand_brackets("node[01-03,15]") == ["node01", "node02", "node03", "node15"]
    assert names(parse_host_list("a,node[08-10],b")) == ["a", "node08", "node09", "node10", "b"]


def test_several_bracket_groups_multiply_as_in_slurm():
    assert expand_brackets("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]


def test_user_and_port():
    """A port is written ssh://[user@]host:port (`host:N` gives slots, see below)."""
    assert parse_host_list("ssh://alice@h1:2222,h2") == (Host("h1", "alice", 2222), Host("h2"))
    assert parse_host_list("ssh://[::1]:22") == (Host("::1", None, 22),)
    assert str(Host("h", "u", 1)) == "ssh://u@h:1"


@pytest.mark.parametrize("bad, words", [
    ("h1,h1", "listed twice"),
    ("pod[1-2],pod2", "listed twice"),
    ("h1,,h2", "empty host name"),
    ("pod[3-1]", "backwards"),
    ("pod[a-b]", "not a number"),
    ("pod[1-2", "unbalanced"),
    ("h1:99999", "for an SSH port write ssh://h1:99999"),
    ("ssh://h1:99999", "not a port"),
])
def test_bad_lists_say_what_is_wrong(bad, words):
    with pytest.raises(ConfigError, match=words):
        parse_host_list(bad)


def test_host_file_comments_and_blank_lines():
    text = "# the pod\nh1  # first\n\nnode[1-2]\n"
    assert names(parse_host_file(text, "hosts.txt")) == ["h1", "node1", "node2"]
    with pytest.raises(ConfigError, match="no hosts"):
        parse_host_file("# nothing\n", "hosts.txt")


def test_job_hosts_prefer_the_given_ones_then_slurm_then_none():
    slurm = {"SLURM_JOB_NODELIST": "n[1-2],m7"}
    assert job_hosts((Host("a"),), slurm) == (Host("a"),)
    assert job_hosts((), slurm) == (Host("n1"), Host("n2"), Host("m7"))
    assert job_hosts((), {}) == ()
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        job_hosts((), {"SLURM_JOB_NODELIST": "n[1-"})


def test_only_names_of_this_machine_are_local():
    assert is_local(Host("localhost"), "gc01.example.com")
    assert is_local(Host("gc01"), "gc01.example.com")
    assert is_local(Host("gc01.example.com"), "gc01.example.com")
    assert not is_local(Host("gc02"), "gc01.example.com")
    assert not is_local(Host("127.0.0.2"), "gc01")  # an address may be a test sshd
    assert not is_local(Host("localhost", port=2222), "gc01")  # a port means an sshd
