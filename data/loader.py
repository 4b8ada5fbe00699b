"""Batches of (x, y) token windows from a list of shards, as a pure function of the batch position.

Each shard is cut into non-overlapping windows of block_size + 1 tokens starting at multiples of
block_size (x = window[:-1], y = window[1:], so consecutive windows share one token and no window
straddles two shards). All windows of all shards are numbered 0..N-1, and row g of the infinite stream
of rows is window perm_e[g % N] with e = g // N the epoch and perm_e a permutation drawn from (seed, e).
Global batch `step` with `global_rows` rows holds stream rows step*global_rows ... +global_rows-1, so

  * a batch depends only on (files, block_size, seed, step, global_rows): resume = remember `step`;
  * DDP ranks ask for disjoint row ranges of the same global batch, so the sequence of global batches
    does not depend on the number of ranks (or on gradient accumulation);
  * for evaluation, get_batch(k, 0, B, B) for k in range(eval_iters) is the same fixed set of windows
    every time (the first eval_iters * B windows of epoch 0's permutation).

Shards are memory-mapped afresh on every call and dropped afterwards: a memmap kept open for a whole
run makes the resident memory grow with every page touched (karpathy/nanoGPT#287).
"""

import numpy as np
import torch

from data.shards import ShardError, find_shards, read_header, read_shard


class ShardLoader:
    """vocab_size: every token id of a shard must be below it, checked when the shard is first read
    (its max, once; a shard of another tokenizer would otherwise fail deep inside the model)."""

    def __init__(self, files, block_size, seed=0, vocab_size=None):
        files = [str(f) for f in files]
        if not files:
            raise ValueError("ShardLoader needs at least one shard file, got an empty list")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.files = files
        self.block_size = block_size
        self.seed = int(seed)
        self.vocab_size = vocab_size
        self._checked = set()  # shards whose token range has been checked
        self.shard_tokens = [read_header(f) for f in files]  # validates every shard up front
        # A shard of n tokens holds (n - 1) // block_size windows; shorter ones (e.g. a small last shard)
        # hold none and are skipped, but there must be at least one window in all.
        windows = [max(0, (n - 1) // block_size) for n in self.shard_tokens]
        self.num_windows = int(sum(windows))
        if self.num_windows == 0:
            sizes = ", ".join(f"{f} ({n} tokens)" for f, n in zip(files, self.shard_tokens))
            raise ValueError(
                f"block_size={block_size} needs shards of at least {block_size + 1} tokens; got {sizes}"
            )
        self._window_start = np.concatenate([[0], np.cumsum(windows)]).astype(np.int64)  # per shard
        self._perms = {}  # epoch -> permutation; at most two kept (a batch can straddle two epochs)

    def __repr__(self):
        return (
            f"ShardLoader({len(self.files)} shards, {sum(self.shard_tokens):,} tokens, "
            f"{self.num_windows:,} windows of {self.block_size}+1, seed={self.seed})"
        )

    def _permutation(self, epoch):
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def windows(self, rows):
        """Window ids (into 0..num_windows-1) of the given stream rows (int array)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty_like(rows)
        epochs = rows // self.num_windows
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(int(epoch))[rows[sel] % self.num_windows]
        return out

    def get_batch(self, step, row_start, row_count, global_rows):
        """Rows [row_start, row_start + row_count) of global batch `step` (of `global_rows` rows).

        Returns (x, y), int64 tensors of shape [row_count, block_size], y[:, t] = x[:, t + 1] shifted.
        """
        if step < 0 or global_rows < 1 or row_count < 0 or row_start < 0:
            raise ValueError(
                f"need step >= 0, global_rows >= 1, row_start >= 0, row_count >= 0; got step={step}, "
                f"global_rows={global_rows}, row_start={row_start}, row_count={row_count}"
            )
        if row_start + row_count > global_rows:
            raise ValueError(
                f"rows [{row_start}, {row_start + row_count}) exceed the global batch of {global_rows} rows"
            )
        rows = step * global_rows + row_start + np.arange(row_count, dtype=np.int64)
        win = self.windows(rows)
        shard = np.searchsorted(self._window_start, win, side="right") - 1
        offset = (win - self._window_start[shard]) * self.block_size
        buf = np.empty((row_count, self.block_size + 1), dtype=np.int64)
        for s in np.unique(shard):
            tokens = read_shard(self.files[s])  # fresh memmap, released when this loop moves on
            if self.vocab_size is not None and s not in self._checked:
                top = int(tokens.max()) if len(tokens) else -1
                if top >= self.vocab_size:
                    raise ShardError(
                        f"{self.files[s]}: token id {top} >= vocab_size {self.vocab_size} (a shard of "
                        "another tokenizer? prepare the data again, or raise vocab_size)"
                    )
                self._checked.add(s)
            for r in np.nonzero(shard == s)[0]:
                buf[r] = tokens[offset[r] : offset[r] + self.block_size + 1]
            del tokens
        buf = torch.from_numpy(buf)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def shard_loaders(directory, block_size, seed=0, vocab_size=None):
    """(train, val) ShardLoaders of the shards in `directory` (FileNotFoundError when there are none)."""
    train_files, val_files = find_shards(directory, "train"), find_shards(directory, "val")
    return tuple(ShardLoader(f, block_size, seed, vocab_size) for f in (train_files, val_files))
