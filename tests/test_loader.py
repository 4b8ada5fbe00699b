"""data/loader.py: windows come from the shards, batches are a pure function of (seed, step, rows)."""

import numpy as np
import pytest
import torch

from data.loader import ShardLoader
from data.shards import write_shard

T = 8


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(1)
    sizes = [101, 57, 6, 203]  # the 6-token shard is too short for one window of T + 1 and is skipped
    files, arrays = [], []
    for i, n in enumerate(sizes):
        tokens = rng.integers(0, 50257, size=n).astype(np.uint16)
        path = str(tmp_path / f"s_train_{i:06d}.bin")
        write_shard(path, tokens)
        files.append(path)
        arrays.append(tokens.astype(np.int64))
    return files, arrays


def all_windows(arrays, block_size):
    """Independent enumeration: every (T+1)-window starting at a multiple of T inside one shard."""
    out = []
    for a in arrays:
        for start in range(0, len(a) - block_size, block_size):
            out.append(tuple(a[start : start + block_size + 1]))
    return out


def test_rows_are_shard_windows_and_y_is_x_shifted(shards):
    files, arrays = shards
    loader = ShardLoader(files, T, seed=3)
    windows = set(all_windows(arrays, T))
    assert loader.num_windows == len(all_windows(arrays, T)) == 12 + 7 + 0 + 25
    x, y = loader.get_batch(5, 0, 16, 16)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16, T)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for xr, yr in zip(x.tolist(), y.tolist()):
        assert tuple(xr + yr[-1:]) in windows


def test_one_epoch_visits_every_window_once(shards):
    files, arrays = shards
    loader = ShardLoader(files, T, seed=0)
    n = loader.num_windows  # 44 = 4 batches of 11
    rows = []
    for step in range(4):
        x, y = loader.get_batch(step, 0, 11, 11)
        rows += [tuple(xr + yr[-1:]) for xr, yr in zip(x.tolist(), y.tolist())]
    assert len(rows) == n and sorted(rows) == sorted(all_windows(arrays, T))
    # the next epoch is a different permutation of the same windows
    second = loader.get_batch(4, 0, 11, 11)[0]
    assert not torch.equal(second, loader.get_batch(0, 0, 11, 11)[0])


def test_deterministic_and_seed_dependent(shards):
    files, _ = shards
    a, b, c = ShardLoader(files, T, seed=7), ShardLoader(files, T, seed=7), ShardLoader(files, T, seed=8)
    for step in (0, 3, 100):
        assert all(torch.equal(u, v) for u, v in zip(a.get_batch(step, 0, 6, 6), b.get_batch(step, 0, 6, 6)))
    assert not torch.equal(a.get_batch(0, 0, 6, 6)[0], c.get_batch(0, 0, 6, 6)[0])


def test_resume_gives_the_same_batches(shards):
    files, _ = shards
    run = ShardLoader(files, T, seed=1)
    straight = [run.get_batch(step, 0, 10, 10) for step in range(12)]  # crosses epoch boundaries
    resumed = ShardLoader(files, T, seed=1)
    for step in range(7, 12):
        x, y = resumed.get_batch(step, 0, 10, 10)
        assert torch.equal(x, straight[step][0]) and torch.equal(y, straight[step][1])


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_rank_slices_concatenate_to_the_global_batch(shards, ranks):
    files, _ = shards
    loader = ShardLoader(files, T, seed=2)
    global_rows = 15
    for step in (0, 2, 9):
        full_x, full_y = loader.get_batch(step, 0, global_rows, global_rows)
        bounds = np.linspace(0, global_rows, ranks + 1).astype(int)
        parts = [
            ShardLoader(files, T, seed=2).get_batch(step, s, e - s, global_rows)
            for s, e in zip(bounds, bounds[1:])
        ]
        assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), full_y)


def test_no_memmap_kept_between_batches(shards):
    files, _ = shards
    loader = ShardLoader(files, T)
    loader.get_batch(0, 0, 4, 4)
    assert not any(isinstance(v, np.memmap) for v in vars(loader).values())


def test_validation_errors(shards, tmp_path):
    files, _ = shards
    with pytest.raises(ValueError, match="at least 204 tokens"):
        ShardLoader(files, 203)
    assert ShardLoader(files, 202).num_windows == 1
    with pytest.raises(ValueError, match="empty list"):
        ShardLoader([], T)
    with pytest.raises(ValueError, match="block_size"):
        ShardLoader(files, 0)
    loader = ShardLoader(files, T)
    with pytest.raises(ValueError, match="exceed"):
        loader.get_batch(0, 3, 4, 6)
    with pytest.raises(ValueError, match="step"):
        loader.get_batch(-1, 0, 1, 1)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"junk")
    with pytest.raises(ValueError, match="bad.bin"):
        ShardLoader(files + [str(bad)], T)


def test_token_ids_are_checked_against_vocab_size_once_per_shard(tmp_path, monkeypatch):
    from data import loader as loader_module
    from data.shards import ShardError

    good, bad = str(tmp_path / "a_train_000000.bin"), str(tmp_path / "a_train_000001.bin")
    write_shard(good, np.arange(100) % 50)
    tokens = np.arange(100) % 50
    tokens[57] = 65535  # e.g. a shard written with another tokenizer
    write_shard(bad, tokens)
    ShardLoader([good, bad], T).get_batch(0, 0, 24, 24)  # no vocab_size: no check
    loader = ShardLoader([good, bad], T, vocab_size=50)
    with pytest.raises(ShardError, match=r"a_train_000001.bin: token id 65535 >= vocab_size 50"):
        loader.get_batch(0, 0, 24, 24)  # one epoch: every window, both shards
    loader = ShardLoader([good], T, vocab_size=50)
    maxima = []
    real_read = loader_module.read_shard

    def counting_read(path):
        tokens = real_read(path)
        real_max = tokens.max
        tokens.max = lambda *a, **k: maxima.append(path) or real_max(*a, **k)
        return tokens

    monkeypatch.setattr(loader_module, "read_shard", counting_read)
    for step in range(5):
        loader.get_batch(step, 0, 4, 4)
    assert maxima == [good]  # the range of a shard is checked the first time it is read, and only then
