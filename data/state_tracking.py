"""State-tracking tasks from the Deltaformer paper: swaps of n elements, and DAG reachability.

Both tasks are sequence labelling: x is int64 [num, length] of input tokens, y is int64 [num, length]
of per-position targets (-1 where a position has no label; the model's loss ignores -1).

Swap task (fixed encoding, so outside evaluations can check it):
    n positions 0..n-1; element p starts at position p. Token x_t in [0, n(n-1)/2) is the index of
    the swapped position pair (i < j) in lexicographic order: (0,1)=0, (0,2)=1, ..., (0,n-1)=n-2,
    (1,2)=n-1, ... . y_t is the element at position 0 after applying swaps x_0..x_t. Tracking it
    needs the composition of the whole prefix of permutations, which for n >= 5 is NC1-complete.

DAG reachability (our encoding; the paper gives the graph, not the tokens):
    n_nodes nodes (default 32) are split at random into two sets of n_nodes // 2 and n_nodes - n_nodes // 2,
    node 0 in the first. Each set is a random recursive tree with edges directed parent -> child;
    node 0 is the root of its tree, so "reachable from node 0" means "in node 0's set" and the answer
    for a node depends on the whole chain of edges up to the root.
    Tokens: node v is token v (0..n_nodes-1), QUERY = n_nodes.
        x = u_1 v_1 u_2 v_2 ... u_E v_E  QUERY  q_1 q_2 ... q_Q
    i.e. the E = n_nodes - 2 edges (u -> v) in random order, one separator, then Q = length - 2E - 1
    query nodes drawn uniformly with replacement. y = -1 on edge tokens and on QUERY; at query q_k,
    y = 1 if q_k is reachable from node 0 else 0 (classes 0/1 reuse the first two logits).

Loader: `StateTrackingLoader(task, split, length, seed, **task_args).get_batch(step, row_start,
row_count, global_rows)` has the data-contract interface of data/loader.py: global batch `step` is a
pure function of (task, task args, split, length, seed, step), ranks take disjoint row ranges of it.
Train and val draw from disjoint seed streams; val steps 0..k-1 are a fixed held-out set.

Training helpers (train.py): `loaders` checks that the model can take the task, `Curriculum`
doubles the loaders' length as validation accuracy reaches a threshold, `accuracy_counts` and
`accuracy` give per-position accuracy summed over batches and ranks, `at_lengths` evaluates at
several lengths.

CLI: python data/state_tracking.py swap --n 5 --length 32 --num 4 [--out x.npy]
     python data/state_tracking.py dag --n_nodes 32 --length 93 --num 2
"""

import argparse
import os
import sys

import numpy as np
import torch

TASKS = ("swap", "dag")
SPLITS = ("train", "val")
_STREAM = {"train": 0, "val": 1}  # seed streams: train and val never share a generator state


def swap_pairs(n):
    """The position pairs (i, j), i < j, in lexicographic order; token t swaps swap_pairs(n)[t]."""
    if n < 2:
        raise ValueError(f"swap task: n must be >= 2, got {n}")
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def vocab_size(task, n=5, n_nodes=32):
    """Smallest vocabulary that covers the task's input tokens and target classes."""
    if task == "swap":
        return max(len(swap_pairs(n)), n)
    if task == "dag":
        return n_nodes + 1  # nodes + QUERY (targets 0/1 are < n_nodes)
    raise ValueError(f"state tracking: task must be one of {TASKS}, got {task!r}")


def _swap_from_rng(rng, n, length, num):
    pairs = np.array(swap_pairs(n), dtype=np.int64)
    x = rng.integers(0, len(pairs), size=(num, length), dtype=np.int64)
    state = np.tile(np.arange(n, dtype=np.int64), (num, 1))  # state[b, pos] = element at pos
    y = np.empty((num, length), dtype=np.int64)
    rows = np.arange(num)
    for t in range(length):
        i, j = pairs[x[:, t], 0], pairs[x[:, t], 1]
        a, b = state[rows, i].copy(), state[rows, j].copy()
        state[rows, i], state[rows, j] = b, a
        y[:, t] = state[:, 0]
    return x, y


def swap_task(n, length, num, seed):
    """(x, y) int64 numpy arrays [num, length]: random swaps of n elements and the element at position 0."""
    if length < 1 or num < 1:
        raise ValueError(f"swap task: length and num must be >= 1, got length={length}, num={num}")
    return _swap_from_rng(np.random.default_rng(seed), n, length, num)


def dag_min_length(n_nodes):
    return 2 * (n_nodes - 2) + 2  # edges, QUERY, at least one query


def _dag_from_rng(rng, n_nodes, length, num):
    if n_nodes < 4:
        raise ValueError(f"dag task: n_nodes must be >= 4, got {n_nodes}")
    if length < dag_min_length(n_nodes):
        raise ValueError(
            f"dag task: length must be >= {dag_min_length(n_nodes)} for n_nodes={n_nodes} "
            f"(2 tokens per edge, QUERY, >= 1 query), got {length}"
        )
    n_edges = n_nodes - 2
    n_query = length - 2 * n_edges - 1
    x = np.empty((num, length), dtype=np.int64)
    y = np.full((num, length), -1, dtype=np.int64)
    for b in range(num):
        others = rng.permutation(np.arange(1, n_nodes))
        first = np.concatenate([[0], others[: n_nodes // 2 - 1]])  # node 0 is the root of this tree
        second = others[n_nodes // 2 - 1 :]
        edges = []
        for tree in (first, second):
            for k in range(1, len(tree)):  # random recursive tree: parent among the earlier nodes
                edges.append((tree[rng.integers(0, k)], tree[k]))
        edges = np.array(edges, dtype=np.int64)[rng.permutation(n_edges)]
        reachable = np.zeros(n_nodes, dtype=np.int64)
        reachable[first] = 1
        queries = rng.integers(0, n_nodes, size=n_query)
        x[b, : 2 * n_edges] = edges.reshape(-1)
        x[b, 2 * n_edges] = n_nodes  # QUERY
        x[b, 2 * n_edges + 1 :] = queries
        y[b, 2 * n_edges + 1 :] = reachable[queries]
    return x, y


def dag_task(n_nodes, length, num, seed):
    """(x, y) int64 numpy arrays [num, length] of the DAG reachability task (encoding in the module doc)."""
    return _dag_from_rng(np.random.default_rng(seed), n_nodes, length, num)


class StateTrackingLoader:
    """Per-position (x, y) batches of a state-tracking task with the data-contract get_batch interface.

    `length` is a plain attribute so a curriculum can change it between steps; a global batch is a
    function of the length in force when it is drawn.
    """

    def __init__(self, task="swap", split="train", length=32, seed=0, n=5, n_nodes=32):
        if task not in TASKS:
            raise ValueError(f"state tracking: task must be one of {TASKS}, got {task!r}")
        if split not in SPLITS:
            raise ValueError(f"state tracking: split must be one of {SPLITS}, got {split!r}")
        self.task, self.split, self.length, self.seed = task, split, length, seed
        self.n, self.n_nodes = n, n_nodes
        self.vocab_size = vocab_size(task, n=n, n_nodes=n_nodes)
        if task == "swap":
            swap_pairs(n)  # validates n
        else:
            _dag_from_rng(np.random.default_rng(0), n_nodes, length, 1)  # validates n_nodes, length

    def global_batch(self, step, global_rows, length=None):
        length = self.length if length is None else length
        # seeded by (seed, stream, step, length): batches don't depend on the order they are drawn in
        rng = np.random.default_rng([self.seed, _STREAM[self.split], step, length])
        if self.task == "swap":
            return _swap_from_rng(rng, self.n, length, global_rows)
        return _dag_from_rng(rng, self.n_nodes, length, global_rows)

    def get_batch(self, step, row_start, row_count, global_rows, length=None):
        if row_start < 0 or row_count < 1 or row_start + row_count > global_rows:
            raise ValueError(
                f"state tracking: rows [{row_start}, {row_start + row_count}) outside a global batch "
                f"of {global_rows} rows"
            )
        x, y = self.global_batch(step, global_rows, length)
        sl = slice(row_start, row_start + row_count)
        return torch.from_numpy(x[sl].copy()), torch.from_numpy(y[sl].copy())


def loaders(task, length, seed, lengths, model_args, **task_args):
    """(train, val) loaders of `task` starting at `length`; ValueError when a model of model_args'
    vocab_size and block_size cannot take the task's tokens or sequences of every length in `lengths`."""
    train, val = (StateTrackingLoader(task, split, length, seed, **task_args) for split in SPLITS)
    vocab_size, block_size, need = model_args["vocab_size"], model_args["block_size"], max((length, *lengths))
    if vocab_size < train.vocab_size or block_size < need:
        raise ValueError(
            f"task {task!r} needs vocab_size >= {train.vocab_size} and block_size >= {need} for its "
            f"lengths; got vocab_size {vocab_size}, block_size {block_size}"
        )
    return train, val


def per_position_accuracy(logits, y):
    """(correct, counted) per position: int64 [T] each, over rows, ignoring targets of -1."""
    mask = y >= 0
    correct = (logits.argmax(-1) == y) & mask
    return correct.sum(0), mask.sum(0)


def accuracy_counts(logits, y):
    """float64 [4] to sum over batches and ranks: correct and labelled positions (targets of -1 are not
    labelled), then the same at the last position only. accuracy() turns the sums into metrics."""
    correct, counted = per_position_accuracy(logits, y)
    return torch.stack([correct.sum(), counted.sum(), correct[-1], counted[-1]]).double()


def accuracy(counts):
    """{"val_acc": over all labelled positions, "val_acc_last": at the last position} from summed counts."""
    return {
        "val_acc": (counts[0] / counts[1]).item(),
        "val_acc_last": (counts[2] / counts[3].clamp(min=1)).item(),
    }


class Curriculum:
    """The training length of a run, kept on the loaders it drives (train and val): update(acc) doubles it
    when acc >= threshold, up to max_length; with enabled=False it stays where it is."""

    def __init__(self, loaders, max_length, threshold, enabled=True):
        self.loaders, self.max_length, self.threshold, self.enabled = loaders, max_length, threshold, enabled

    @property
    def length(self):
        return self.loaders[0].length

    @length.setter
    def length(self, value):
        for loader in self.loaders:
            loader.length = value

    def update(self, acc):
        """Double the length (at most max_length) if acc >= threshold; True when it changed."""
        if not (self.enabled and acc >= self.threshold and self.length < self.max_length):
            return False
        self.length = min(2 * self.length, self.max_length)
        return True


def at_lengths(evaluate, loader, lengths):
    """evaluate()'s metrics with `loader` drawing at each of `lengths`, keys suffixed "@length"; the
    loader's length is restored afterwards."""
    metrics, restore = {}, loader.length
    for length in lengths:
        loader.length = length
        metrics.update({f"{k}@{length}": v for k, v in evaluate().items()})
    loader.length = restore
    return metrics


def main(argv=None):
    p = argparse.ArgumentParser(description="Print (and optionally save) state-tracking examples.")
    p.add_argument("task", choices=TASKS)
    p.add_argument("--n", type=int, default=5, help="swap: number of elements")
    p.add_argument("--n_nodes", type=int, default=32, help="dag: number of nodes")
    p.add_argument("--length", type=int, default=None, help="sequence length (dag default: 2*E+1+n_nodes)")
    p.add_argument("--num", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write x and y as <out>.x.npy and <out>.y.npy")
    args = p.parse_args(argv)
    if args.num < 1:
        p.error(f"--num must be >= 1, got {args.num}")
    try:  # the tasks' own checks, as one-line errors (an explicit --length 0 is refused, not the default)
        if args.task == "swap":
            x, y = swap_task(args.n, 32 if args.length is None else args.length, args.num, args.seed)
            print(f"swap n={args.n}: pairs (token: (i, j)) {dict(enumerate(swap_pairs(args.n)))}")
        else:
            length = dag_min_length(args.n_nodes) - 1 + args.n_nodes if args.length is None else args.length
            x, y = dag_task(args.n_nodes, length, args.num, args.seed)
            print(f"dag n_nodes={args.n_nodes}: QUERY token = {args.n_nodes}, y = -1 where unlabelled")
    except ValueError as e:
        p.error(str(e))
    np.set_printoptions(linewidth=200)
    for b in range(args.num):
        print(f"x[{b}] = {x[b].tolist()}")
        print(f"y[{b}] = {y[b].tolist()}")
    if args.out:
        for name, arr in (("x", x), ("y", y)):
            path = f"{args.out}.{name}.npy"
            tmp = path + ".tmp.npy"
            np.save(tmp, arr)
            os.replace(tmp, path)
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
