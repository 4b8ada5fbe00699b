"""data/shards.py: llm.c header round-trip, and every kind of bad file rejected with its name."""

import os
import struct

import numpy as np
import pytest

from data.shards import HEADER_BYTES, MAGIC, ShardError, find_shards, read_header, read_shard, write_shard


def raw_shard(magic=MAGIC, version=1, n_header=None, tokens=(1, 2, 3)):
    """Shard bytes built by hand with struct (independent of write_shard)."""
    n = len(tokens) if n_header is None else n_header
    header = struct.pack("<256i", magic, version, n, *([0] * 253))
    return header + struct.pack(f"<{len(tokens)}H", *tokens)


def test_round_trip_and_header_layout(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 65536, size=1001).astype(np.uint16)
    tokens[:2] = (0, 65535)
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    data = path.read_bytes()
    assert len(data) == HEADER_BYTES + 2 * len(tokens)
    header = struct.unpack("<256i", data[:HEADER_BYTES])
    assert header[:3] == (20240520, 1, 1001) and not any(header[3:])
    assert list(struct.unpack("<1001H", data[HEADER_BYTES:])) == tokens.tolist()
    view = read_shard(path)
    assert isinstance(view, np.memmap) and view.dtype == np.uint16 and not view.flags.writeable
    assert np.array_equal(view, tokens) and read_header(path) == 1001
    assert os.listdir(tmp_path) == ["s.bin"]  # no temporary file left


def test_reads_handmade_llmc_file(tmp_path):
    path = tmp_path / "llmc.bin"
    path.write_bytes(raw_shard(tokens=(50256, 15496, 995)))
    assert read_shard(path).tolist() == [50256, 15496, 995]


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.int64))
    assert read_header(tmp_path / "e.bin") == 0 and len(read_shard(tmp_path / "e.bin")) == 0


def test_int_tokens_converted_and_range_checked(tmp_path):
    write_shard(tmp_path / "a.bin", [5, 50256])
    assert read_shard(tmp_path / "a.bin").tolist() == [5, 50256]
    for bad in ([-1], [65536]):
        with pytest.raises(ValueError, match="b.bin"):
            write_shard(tmp_path / "b.bin", bad)
    assert not (tmp_path / "b.bin").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (raw_shard()[:-1], "truncated"),  # one byte short
        (raw_shard() + b"\0\0", "truncated or corrupted"),  # trailing bytes
        (raw_shard(n_header=10), "header says 10 tokens"),
        (raw_shard(magic=20240801), "magic number 20240801"),
        (raw_shard(version=2), "version 2"),
        (raw_shard(n_header=-5), "negative token count"),
        (b"\x93NUMPY" + bytes(2000), "magic number"),  # a foreign file
        (b"hello", "shorter than the 1024-byte shard header"),
        (b"", "shorter than"),
    ],
)
def test_bad_files_rejected_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad_shard.bin"
    path.write_bytes(content)
    for reader in (read_header, read_shard):
        with pytest.raises(ShardError, match=message) as info:
            reader(path)
        assert str(path) in str(info.value)
    assert issubclass(ShardError, ValueError)


def test_missing_file(tmp_path):
    with pytest.raises(ShardError, match="nope.bin"):
        read_shard(tmp_path / "nope.bin")


def test_find_shards(tmp_path):
    names = ["fineweb_edu_train_000002.bin", "fineweb_edu_val_000000.bin", "fineweb_edu_train_000001.bin"]
    for n in names + ["train.bin", "val.bin", "fineweb_edu_train_000003.bin.tmp.12", "notes.txt"]:
        (tmp_path / n).write_bytes(b"")
    assert find_shards(tmp_path, "train") == [
        str(tmp_path / n)
        for n in ["fineweb_edu_train_000001.bin", "fineweb_edu_train_000002.bin", "train.bin"]
    ]
    assert find_shards(str(tmp_path), "val") == [
        str(tmp_path / "fineweb_edu_val_000000.bin"),
        str(tmp_path / "val.bin"),
    ]
    with pytest.raises(FileNotFoundError, match="test"):
        find_shards(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_shards(tmp_path / "missing", "train")
    with pytest.raises(ValueError, match="alphanumeric"):
        find_shards(tmp_path, "../train")
