"""data/state_tracking.py against independent naive simulations (explicit lists, graph search)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.state_tracking import (
    Curriculum,
    StateTrackingLoader,
    accuracy,
    accuracy_counts,
    at_lengths,
    dag_min_length,
    dag_task,
    loaders,
    per_position_accuracy,
    swap_pairs,
    swap_task,
    vocab_size,
)


def naive_swap_labels(n, tokens):
    """Element at position 0 after each swap, with the pair table written out by hand-style loops."""
    table = {}
    k = 0
    for i in range(n):
        for j in range(n):
            if i < j:
                table[k] = (i, j)
                k += 1
    positions = list(range(n))  # positions[pos] = element
    out = []
    for tok in tokens:
        i, j = table[int(tok)]
        tmp = positions[i]
        positions[i] = positions[j]
        positions[j] = tmp
        out.append(positions[0])
    return out


def test_pair_encoding():
    assert swap_pairs(5)[:5] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 2)]
    assert swap_pairs(5)[-1] == (3, 4)
    assert len(swap_pairs(5)) == 10
    assert swap_pairs(3) == [(0, 1), (0, 2), (1, 2)]


def test_swap_hand_example():
    # (0,1) -> [1,0,2,...]; (1,2) -> [1,2,0]; (0,2) -> [0,2,1]; (0,1) -> [2,0,1]
    n = 5
    tokens = [0, 4, 1, 0]
    assert naive_swap_labels(n, tokens) == [1, 1, 0, 2]


@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_swap_matches_naive(n):
    x, y = swap_task(n, length=64, num=50, seed=n)
    assert x.shape == y.shape == (50, 64) and x.dtype == y.dtype == np.int64
    assert x.min() >= 0 and x.max() < n * (n - 1) // 2
    assert len(np.unique(x)) == n * (n - 1) // 2  # every swap occurs
    for b in range(50):
        assert y[b].tolist() == naive_swap_labels(n, x[b])


def test_swap_deterministic_and_seeded():
    a = swap_task(5, 32, 8, seed=1)
    b = swap_task(5, 32, 8, seed=1)
    c = swap_task(5, 32, 8, seed=2)
    assert all((u == v).all() for u, v in zip(a, b))
    assert not (a[0] == c[0]).all()


def test_swap_bad_args():
    with pytest.raises(ValueError, match="n must be"):
        swap_task(1, 8, 2, 0)
    with pytest.raises(ValueError, match="length"):
        swap_task(5, 0, 2, 0)


def naive_reachable(n_nodes, tokens):
    n_edges = n_nodes - 2
    children = {v: [] for v in range(n_nodes)}
    for e in range(n_edges):
        children[int(tokens[2 * e])].append(int(tokens[2 * e + 1]))
    seen, stack = {0}, [0]
    while stack:
        for c in children[stack.pop()]:
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


@pytest.mark.parametrize("n_nodes", [8, 32])
def test_dag_matches_graph_search(n_nodes):
    length = dag_min_length(n_nodes) + 20
    x, y = dag_task(n_nodes, length, num=30, seed=3)
    n_edges = n_nodes - 2
    assert x.shape == y.shape == (30, length)
    for b in range(30):
        # the edges form two trees: every node but the two roots has exactly one parent
        heads = x[b, 1 : 2 * n_edges : 2].tolist()
        assert len(set(heads)) == n_edges and 0 not in heads
        assert x[b, 2 * n_edges] == n_nodes  # QUERY
        seen = naive_reachable(n_nodes, x[b])
        assert len(seen) == n_nodes // 2
        assert (y[b, : 2 * n_edges + 1] == -1).all()
        for t in range(2 * n_edges + 1, length):
            assert y[b, t] == int(int(x[b, t]) in seen)
    labels = y[y >= 0]
    assert 0.3 < labels.mean() < 0.7  # roughly balanced


def test_dag_bad_length():
    with pytest.raises(ValueError, match="length must be >= 62"):
        dag_task(32, 61, 1, 0)


def test_vocab_size():
    assert vocab_size("swap", n=5) == 10
    assert vocab_size("swap", n=3) == 3
    assert vocab_size("dag", n_nodes=32) == 33
    with pytest.raises(ValueError, match="task must be one of"):
        vocab_size("sort")


def test_loader_rank_split_and_determinism():
    loader = StateTrackingLoader("swap", "train", length=16, seed=7)
    full_x, full_y = loader.get_batch(3, 0, 8, 8)
    parts = [loader.get_batch(3, r, 2, 8) for r in range(0, 8, 2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_y)
    assert full_x.dtype == torch.int64 and full_x.shape == (8, 16)
    # a fresh loader gives the same batch; another step, seed or split gives another one
    again = StateTrackingLoader("swap", "train", length=16, seed=7).get_batch(3, 0, 8, 8)
    assert torch.equal(again[0], full_x)
    assert not torch.equal(loader.get_batch(4, 0, 8, 8)[0], full_x)
    assert not torch.equal(StateTrackingLoader("swap", "train", 16, seed=8).get_batch(3, 0, 8, 8)[0], full_x)
    assert not torch.equal(StateTrackingLoader("swap", "val", 16, seed=7).get_batch(3, 0, 8, 8)[0], full_x)
    for b in range(8):
        assert full_y[b].tolist() == naive_swap_labels(5, full_x[b])


def test_loader_length_change_and_dag():
    loader = StateTrackingLoader("swap", "val", length=16, seed=0)
    loader.length = 64
    x, y = loader.get_batch(0, 0, 4, 4)
    assert x.shape == (4, 64)
    x2, _ = loader.get_batch(0, 0, 4, 4, length=128)
    assert x2.shape == (4, 128)
    dag = StateTrackingLoader("dag", "train", length=100, seed=0, n_nodes=32)
    x, y = dag.get_batch(0, 1, 3, 5)
    assert x.shape == (3, 100) and dag.vocab_size == 33
    assert int(x.max()) <= 32 and set(y.unique().tolist()) <= {-1, 0, 1}


def test_loader_bad_args():
    with pytest.raises(ValueError, match="split must be one of"):
        StateTrackingLoader("swap", "test")
    with pytest.raises(ValueError, match="task must be one of"):
        StateTrackingLoader("sort")
    with pytest.raises(ValueError, match="outside a global batch"):
        StateTrackingLoader("swap").get_batch(0, 6, 4, 8)
    with pytest.raises(ValueError, match="length must be"):
        StateTrackingLoader("dag", length=10)


def test_per_position_accuracy():
    y = torch.tensor([[0, 1, -1], [2, -1, 1]])
    logits = torch.full((2, 3, 4), -1.0)
    logits[0, 0, 0] = logits[0, 1, 3] = logits[0, 2, 2] = 1.0  # right, wrong, ignored
    logits[1, 0, 2] = logits[1, 1, 1] = logits[1, 2, 1] = 1.0  # right, ignored, right
    correct, counted = per_position_accuracy(logits, y)
    assert correct.tolist() == [2, 0, 1] and counted.tolist() == [2, 1, 1]


def test_curriculum_doubles_at_the_threshold_up_to_the_max_length():
    train, val = StateTrackingLoader("swap", "train", 32), StateTrackingLoader("swap", "val", 32)
    c = Curriculum((train, val), max_length=96, threshold=0.9)
    lengths = []
    for acc in (0.5, 0.89, 0.9, 0.3, 1.0, 1.0, 1.0):
        c.update(acc)
        lengths.append((train.length, val.length))
    assert lengths == [(32, 32), (32, 32), (64, 64), (64, 64), (96, 96), (96, 96), (96, 96)]
    assert not c.update(1.0) and c.length == 96
    off = Curriculum((train, val), max_length=1024, threshold=0.0, enabled=False)
    assert not off.update(1.0) and train.length == val.length == 96
    off.length = 48  # as a resumed run sets it from the checkpoint
    assert (train.length, val.length) == (48, 48)


def test_accuracy_counts_ignore_unlabelled_targets():
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        y = torch.from_numpy(rng.integers(-1, 3, size=(4, 6)))
        y[0, -1], y[1, -1] = -1, 2  # the last position labelled in some rows only
        batches.append((torch.from_numpy(rng.normal(size=(4, 6, 3))), y))
    correct = counted = correct_last = counted_last = 0
    for logits, y in batches:  # naive loops over every row and position
        for b in range(y.shape[0]):
            for t in range(y.shape[1]):
                if y[b, t] == -1:
                    continue
                hit = int(max(range(3), key=lambda c: logits[b, t, c]) == y[b, t])
                correct, counted = correct + hit, counted + 1
                if t == y.shape[1] - 1:
                    correct_last, counted_last = correct_last + hit, counted_last + 1
    totals = sum(accuracy_counts(logits, y) for logits, y in batches)
    assert totals.dtype == torch.float64
    assert totals.tolist() == [correct, counted, correct_last, counted_last]
    assert accuracy(totals) == pytest.approx(
        {"val_acc": correct / counted, "val_acc_last": correct_last / counted_last}
    )
    assert accuracy(torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=torch.float64))["val_acc_last"] == 0.0


def test_at_lengths_suffixes_the_keys_and_restores_the_length():
    val = StateTrackingLoader("swap", "val", 32)
    seen = []

    def evaluate():
        seen.append(val.length)
        return {"val_acc": val.length / 1000}

    assert at_lengths(evaluate, val, (64, 128)) == {"val_acc@64": 0.064, "val_acc@128": 0.128}
    assert seen == [64, 128] and val.length == 32


def test_loaders_check_the_model_size():
    train, val = loaders("swap", 32, 0, (256, 512), {"vocab_size": 16, "block_size": 512}, n=5)
    assert (train.split, val.split, train.length, val.length) == ("train", "val", 32, 32)
    with pytest.raises(ValueError, match="needs vocab_size >= 10 and block_size >= 512"):
        loaders("swap", 32, 0, (256, 512), {"vocab_size": 16, "block_size": 256}, n=5)
    with pytest.raises(ValueError, match="needs vocab_size >= 10"):
        loaders("swap", 32, 0, (), {"vocab_size": 8, "block_size": 64}, n=5)


def test_cli(tmp_path):
    out = tmp_path / "ex"
    r = subprocess.run(
        [sys.executable, "data/state_tracking.py", "swap", "--length", "12", "--num", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "x[2] =" in r.stdout
    x, y = np.load(f"{out}.x.npy"), np.load(f"{out}.y.npy")
    assert x.shape == (3, 12)
    for b in range(3):
        assert y[b].tolist() == naive_swap_labels(5, x[b])
    r = subprocess.run(
        [sys.executable, "data/state_tracking.py", "dag", "--n_nodes", "8", "--num", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "QUERY token = 8" in r.stdout


def _train(tmp_path, *overrides):
    cmd = [sys.executable, "train.py", "configs/state_tracking.py", "--device=cpu", "--dtype=float32"]
    cmd += ["--n_embd=32", "--n_head=1", "--head_dim=16", "--batch_size=4", "--eval_interval=4"]
    cmd += ["--eval_iters=1", "--st_curriculum_acc=0.0", "--st_max_length=96", "--st_eval_lengths=(96,128)"]
    cmd += ["--block_size=128", "--backend=torch", f"--out_dir={tmp_path}", *overrides]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    import json

    with open(tmp_path / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def test_train_curriculum_and_exact_resume(tmp_path):
    """train.py with dataset=state_tracking: the curriculum doubles the length at each regular eval
    (threshold 0 here) up to st_max_length, the final record has accuracy at st_eval_lengths, and a run
    stopped off the eval grid and resumed has the same losses and curriculum as an uninterrupted one."""
    full = _train(tmp_path / "full", "--max_iters=12")
    evals = [r for r in full if "val_acc" in r]
    assert [r["st_length"] for r in evals] == [64, 96, 96, 96]  # 32 -> 64 -> 96 (capped), at iters 0, 4
    final = full[-1]
    assert final["final"] and {"val_acc@96", "val_acc_last@96", "val_acc@128"} <= set(final)
    assert all(0.0 <= final[k] <= 1.0 for k in final if k.startswith("val_acc"))
    _train(tmp_path / "split", "--max_iters=6")  # stops at 6 with length 96: the checkpoint must keep it
    resumed = _train(tmp_path / "split", "--max_iters=12", "--init_from=resume")
    losses = lambda recs: [(r["iter"], r["train_loss"]) for r in recs if "train_loss" in r]  # noqa: E731
    assert losses(resumed) == losses(full)


def _bench(tmp_path, *args, extra=""):
    cmd = [
        sys.executable,
        "bench/run_state_tracking.py",
        f"--out={tmp_path / 'out'}",
        f"--work={tmp_path / 'w'}",
    ]
    extra = (
        "--device=cpu --dtype=float32 --n_embd=32 --n_head=1 --head_dim=16 --batch_size=4 --eval_iters=1 "
        + extra
    )
    r = subprocess.run([*cmd, *args, f"--extra={extra}"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, (tmp_path / "out" / "results.md").read_text()


def test_bench_configs():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import run_state_tracking as bench

    names = [m for m, _ in bench.MODELS]
    assert len(names) == 12 and len(set(names)) == 12  # 3 kernels x 3 w, and 1, 2, 4-layer Transformers
    for kernel in ("softmax", "relu", "linear"):
        for w in ("k", "q", "proj"):
            assert f"df-{kernel}-{w}" in names
    runs = bench.select(["swap", "dag"], "df-linear-k,dag/tf-4")
    assert [r[0] for r in runs] == ["swap/df-linear-k", "dag/df-linear-k", "dag/tf-4"]
    assert "--st_task=dag" in runs[1][2] and "--deltaformer_w=k" in runs[1][2]
    with pytest.raises(SystemExit, match="unknown config"):
        bench.select(["swap"], "df-linear-x")


@pytest.mark.slow
def test_bench_runs_both_tasks_on_cpu(tmp_path):
    # the GPU command's code path on the CPU at a tiny width: two iterations per run, both tasks' tables
    out, results = _bench(
        tmp_path, "--tasks=swap,dag", "--only=df-linear-k", "--seconds=0", extra="--max_iters=2"
    )
    assert out.rstrip().endswith(results.rstrip().splitlines()[-1])  # the tables are printed at the end
    assert "## swap, n = 5" in results and "## DAG reachability, 32 nodes" in results
    assert "Command: `python bench/run_state_tracking.py --out=" in results and "torch " in results
    for name in ("swap/df-linear-k", "dag/df-linear-k"):
        row = next(line for line in results.splitlines() if line.startswith(f"| {name} |"))
        assert "(exit" not in row and "killed" not in row
        assert row.split(" | ")[1] == "2"  # iterations
    dag_row = next(line for line in results.splitlines() if line.startswith("| dag/df-linear-k |"))
    assert len(dag_row.split(" | ")) == 8  # no curriculum columns; accuracy at 93 and 189 (all, last)
    records = [json.loads(line) for line in (tmp_path / "out" / "logs.jsonl").read_text().splitlines()]
    finals = {r["config"]: r for r in records if r.get("final")}
    assert set(finals) == {"swap/df-linear-k", "dag/df-linear-k"}
    assert {"val_acc@256", "val_acc@512"} <= set(finals["swap/df-linear-k"])
    assert {"val_acc@93", "val_acc_last@189"} <= set(finals["dag/df-linear-k"])


def test_bench_deadline_kills(tmp_path):
    out, results = _bench(
        tmp_path, "--tasks=swap", "--only=tf-1", "--seconds=0", "--deadline=1", extra="--max_iters=100000"
    )
    assert "| swap/tf-1 (killed at the deadline) |" in results
