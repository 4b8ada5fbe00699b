"""bench/bench_curves.py: three real train.py runs (this checkout as its own reference), and the table."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from bench import bench_curves as bc
from data.shards import write_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_diffs_over_common_iterations():
    assert bc.diffs({0: 1.0, 1: 2.0, 2: 3.0}, {1: 2.5, 2: 2.0, 5: 0.0}) == (1.0, 0.75)
    assert bc.diffs({0: 1.0}, {1: 1.0}) is None


def split_args(run, extra=()):
    """bench_curves' train.py arguments for one run of ddl as a dict."""
    return dict(a[2:].split("=", 1) for a in bc.run_args("ddl", run, 5, "d", extra))


def test_split_run_halves_the_rows_of_the_batch_it_is_given():
    this, split = split_args("this"), split_args("split")
    assert "gradient_accumulation_steps" not in this and this["residual"] == "ddl"
    assert split["batch_size"] == "4" and split["gradient_accumulation_steps"] == "2"  # the config's 8 x 1
    given = ["batch_size=16", "gradient_accumulation_steps=3"]
    this, split = split_args("this", given), split_args("split", given)
    assert this["batch_size"] == "16" and this["gradient_accumulation_steps"] == "3"
    assert split["batch_size"] == "8" and split["gradient_accumulation_steps"] == "6"
    with pytest.raises(ValueError, match="even"):
        split_args("split", ["batch_size=3"])


def test_runs_and_table(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 20_000), ("val.bin", 4_000)):
        write_shard(str(data / name), rng.integers(0, 64, n).astype(np.uint16))
    out = tmp_path / "runs"
    tiny = "n_layer=1 n_embd=32 n_head=2 head_dim=16 block_size=32 vocab_size=64 eval_iters=1 device=cpu"
    cmd = [sys.executable, "bench/bench_curves.py", "--ref", REPO, "--variants", "ddl", "--iters", "3"]
    cmd += ["--out", str(out), "--data-dir", str(data), "--set", *tiny.split(), "compile=False"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("| ddl |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "3"  # iterations logged
    assert float(cells[2]) == 0 and float(cells[3]) == 0  # the same code on CPU: the same losses
    assert 0 <= float(cells[4]) < 1e-3  # two micro-batches: the same sums in another order
    assert re.fullmatch(r"\d+\.\d{4} / \d+\.\d{4}", cells[6])
    with open(out / "ddl-split" / "log.jsonl") as f:
        assert any("train_loss" in json.loads(line) for line in f)
    assert (out / "curves.md").read_text().startswith("Command: `python bench/bench_curves.py")
