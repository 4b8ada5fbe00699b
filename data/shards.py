"""Token shards in llm.c's format (also read by modded-nanogpt).

A shard is a header of 256 little-endian int32, [MAGIC, VERSION, n_tokens, 0, ...] (1024 bytes), then
n_tokens little-endian uint16 token ids. Readers check magic, version and that the file is exactly
1024 + 2 * n_tokens bytes, so a truncated or foreign file fails loudly instead of training on garbage.
"""

import os
import re

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


class ShardError(ValueError):
    """A file that is not a valid shard; the message names the file."""


def write_shard(path, tokens):
    """Write `tokens` (ints in [0, 65535]) as a shard at `path`, atomically (temp file + os.replace)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype != np.uint16:
        if tokens.size and (tokens.min() < 0 or tokens.max() > 65535):
            raise ValueError(f"{path}: token ids must lie in [0, 65535] to fit uint16")
        tokens = tokens.astype(np.uint16)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, len(tokens))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2", copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the name says the shard is complete
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_header(path):
    """Validate the shard at `path` and return its token count; ShardError naming the file otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror or e})") from e
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, n_tokens = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise ShardError(f"{path}: magic number {magic}, expected {MAGIC} (not an llm.c token shard)")
    if version != VERSION:
        raise ShardError(f"{path}: shard version {version}, expected {VERSION}")
    if n_tokens < 0:
        raise ShardError(f"{path}: negative token count {n_tokens} in header")
    expected = HEADER_BYTES + 2 * n_tokens
    if size != expected:
        raise ShardError(
            f"{path}: {size} bytes but the header says {n_tokens} tokens, i.e. {expected} bytes "
            "(truncated or corrupted file)"
        )
    return n_tokens


def read_shard(path):
    """Validated read-only view of the shard's tokens: np.memmap of uint16, shape [n_tokens]."""
    n_tokens = read_header(path)
    if n_tokens == 0:  # mmap cannot map zero bytes
        empty = np.zeros(0, dtype=np.uint16)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def find_shards(directory, split):
    """Sorted shard paths of `split` in `directory`: `{split}.bin` or `*_{split}_<index>.bin`."""
    if not re.fullmatch(r"[A-Za-z0-9]+", split):
        raise ValueError(f"split must be alphanumeric (e.g. 'train', 'val'), got {split!r}")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"shard directory {directory} does not exist")
    pattern = re.compile(rf"(?:{split}|.+_{split}_\d+)\.bin")
    names = sorted(n for n in os.listdir(directory) if pattern.fullmatch(n))
    if not names:
        raise FileNotFoundError(
            f"no '{split}' shards in {directory} (looked for {split}.bin or *_{split}_NNNNNN.bin)"
        )
    return [os.path.join(directory, n) for n in names]
