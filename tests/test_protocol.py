"""spawner.protocol: frames round-trip whatever the slicing of the byte stream."""

from __future__ import annotations

import os

import pytest

from spawner.local import Stream
from spawner.protocol import (MAGIC, MAX_NOISE, Control, FrameDecoder, Kind, Output,
                              ProtocolError, SpawnRequest, encode, encode_output)

FRAMES = [
    (Control(Kind.HELLO, {"id": 1, "cwd": "/tmp", "program": "python3"}),
     encode(Kind.HELLO, id=1, cwd="/tmp", program="python3")),
    (Output(7, Stream.STDOUT, b"line 1\nline 2\r\n"),
     encode_output(7, Stream.STDOUT, b"line 1\nline 2\r\n")),
    (Output(2**32 - 1, Stream.STDERR, b"\xff\xfe not utf-8\n"),
     encode_output(2**32 - 1, Stream.STDERR, b"\xff\xfe not utf-8\n")),
    (Output(0, Stream.STDOUT, b""), encode_output(0, Stream.STDOUT, b"")),
    (Control(Kind.EXIT, {"key": 3, "returncode": -15}), encode(Kind.EXIT, key=3, returncode=-15)),
]
STREAM = b"".join(raw for _, raw in FRAMES)
EXPECTED = [frame for frame, _ in FRAMES]


def feed_in_pieces(decoder: FrameDecoder, data: bytes, size: int) -> list:
    frames = []
    for i in range(0, len(data), size):
        frames += decoder.feed(data[i:i + size])
    return frames


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, len(STREAM)])
def test_frames_round_trip_however_the_stream_is_cut(size):
    decoder = FrameDecoder()
    assert feed_in_pieces(decoder, STREAM, size) == EXPECTED
    assert decoder.pending == 0


def test_a_partial_frame_waits_for_its_rest():
    raw = encode_output(1, Stream.STDOUT, b"x" * 100)
    decoder = FrameDecoder()
    assert decoder.feed(raw[:-1]) == []
    assert decoder.pending == len(raw) - 1
    assert decoder.feed(raw[-1:]) == [Output(1, Stream.STDOUT, b"x" * 100)]


def test_a_many_megabyte_block_arrives_whole():
    block = os.urandom(5 << 20)
    frames = feed_in_pieces(FrameDecoder(), encode_output(4, Stream.STDERR, block), 32768)
    assert frames == [Output(4, Stream.STDERR, block)]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_noise_before_the_magic_is_set_aside(size):
    noise = b"Welcome to h2! \0poprun\0 is not the magic\n"
    decoder = FrameDecoder(expect_magic=True)
    assert feed_in_pieces(decoder, noise + MAGIC + STREAM, size) == EXPECTED
    assert decoder.noise == noise


def test_without_magic_too_much_noise_is_an_error():
    decoder = FrameDecoder(expect_magic=True)
    with pytest.raises(ProtocolError, match="no agent greeting"):
        feed_in_pieces(decoder, b"x" * (MAX_NOISE + len(MAGIC)), 4096)


@pytest.mark.parametrize("raw, message", [
    (b"\0\0\0\2\x63{}", "unknown frame kind 99"),
    (b"\0\0\0\3\x10[1]", "not a JSON object"),
    (b"\0\0\0\2\x10{x", "not JSON"),
    (b"\0\0\0\3\x14\0\0\0", "shorter than its header"),
    (b"\0\0\0\5\x14\0\0\0\1\x09", "unknown stream 9"),
])
def test_malformed_frames_are_protocol_errors(raw, message):
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(raw)


def test_spawn_request_round_trips_bytes_that_are_not_utf8():
    weird = os.fsdecode(b"caf\xe9 \xff")  # surrogate-escaped, as os.environ/argv hold them
    request = SpawnRequest(key=3, argv=("prog", "a b", "'\"$HOME;", weird),
                           env_set={"X": weird, "Y": ""}, env_unset=("IPUOF_CONFIG_PATH",),
                           cwd="/tmp", merge_stderr=True, cpus=(0, 2, 3), mems=(1,))
    [frame] = FrameDecoder().feed(encode(Kind.SPAWN, **request.to_fields()))
    decoded = SpawnRequest.from_fields(frame.fields)
    assert decoded == request
    assert os.fsencode(decoded.argv[3]) == b"caf\xe9 \xff"


@pytest.mark.parametrize("fields", [
    {"key": 1, "argv": []},
    {"key": 1, "argv": ["ok", 3]},
    {"key": 1, "argv": ["ok"], "env_set": {"A": 1}},
    {"argv": ["ok"]},
    {"key": "one", "argv": ["ok"]},
])
def test_malformed_spawn_requests_are_rejected(fields):
    with pytest.raises((KeyError, TypeError, ValueError)):
        SpawnRequest.from_fields(fields)
