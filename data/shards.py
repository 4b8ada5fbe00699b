"""Token shards in llm.c's format (also read by modded-nanogpt).

A shard is a header of 256 little-endian int32, [MAGIC, VERSION, n_tokens, 0, ...] (1024 bytes), then
n_tokens little-endian uint16 token ids. Readers check magic, version and that the file is exactly
1024 + 2 * n_tokens bytes, so a truncated or foreign file fails loudly instead of training on garbage.

hold_dir locks an output folder for one writer (a data preparation here, a training run in train.py), and
remove_empty_dirs takes back the folders it made when the writer stops before writing anything there.
"""

import contextlib
import errno
import os
import re

try:
    import fcntl
except ImportError:  # not on Windows: folders there are not locked
    fcntl = None

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


def lock_holder(path):
    """' (pid N)' of the process holding a lock on the file or folder `path`, from /proc/locks (Linux);
    '' where that is not known."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        st = os.stat(path)
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if where in fields and fields[fields.index(where) - 1] not in ("0", "-1"):
                    return f" (pid {fields[fields.index(where) - 1]})"
    return ""


def hold_dir(path):
    """Create the folder `path` if needed and lock it: flock on the folder itself, which the OS drops when the
    descriptor is closed or the process ends, even by kill -9, so a dead writer never leaves it stuck, and no
    file is added to the folder. Returns (the descriptor holding the lock, the folders made for it, deepest
    first). NotADirectoryError if `path` is a file, BlockingIOError if a live process holds it (lock_holder
    names it), another OSError if it cannot be created."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", path)
    made, parent = [], os.path.abspath(path)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(path, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return fd, made  # a file system without locks (ENOLCK): unlocked, as before locks
            os.close(fd)
            raise BlockingIOError(e.errno, "in use", path) from None
    return fd, made


def remove_empty_dirs(made):
    """Remove the folders hold_dir made (deepest first) that are still empty: only what it created."""
    for d in made:
        with contextlib.suppress(OSError):
            os.rmdir(d)
