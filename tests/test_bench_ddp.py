"""bench/bench_ddp.py: the report's loss differences and scaling, from run folders made here."""

import argparse
import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_ddp  # noqa: E402


def fake_run(work, name, losses, rates, ranks, peak):
    d = os.path.join(work, name)
    os.makedirs(d)
    with open(os.path.join(d, "log.jsonl"), "w") as f:
        f.write(json.dumps({"iter": 0, "val_loss": 11.0}) + "\n")
        for i, (loss, rate) in enumerate(zip(losses, rates)):
            f.write(json.dumps({"iter": i, "train_loss": loss, "tok_per_s": rate, "dt_ms": 1.0}) + "\n")
    with open(os.path.join(d, "stdout.txt"), "w") as f:
        f.write(f"{ranks} rank(s) on cuda:0, ...\npeak memory {peak} GiB\ndone\n")
    with open(os.path.join(d, "command.txt"), "w") as f:
        f.write(f"python train.py # {name}\n")


def test_report(tmp_path, capsys):
    rng = random.Random(0)
    n = 12
    base = [10 - 0.1 * i + rng.random() * 1e-3 for i in range(n)]
    multi = list(base)
    multi[7] += 3e-3  # the largest difference, planted
    multi[3] -= 1e-3
    yard = [x + 5e-4 for x in base]
    work = str(tmp_path / "work")
    fake_run(work, "additive-single", base, [100.0] * 3 + [1000.0, 1010.0, 990.0] * 3, 1, 40.0)
    fake_run(work, "additive-multi", multi, [50.0] * 3 + [1900.0, 1950.0, 1800.0] * 3, 2, 30.0)
    fake_run(work, "additive-yardstick", yard, [1000.0] * n, 1, 41.0)
    args = argparse.Namespace(
        work=work,
        variants=["additive", "ddl-cc"],
        iters=n,
        skip=3,
        warmup=2,
        batch_size=4,
        grad_accum=8,
        out=str(tmp_path / "out"),
    )
    summary = bench_ddp.report(args)
    assert summary[("additive", "multi")] == pytest.approx(3e-3, rel=1e-6)
    assert summary[("additive", "yardstick")] == pytest.approx(5e-4, rel=1e-6)
    assert summary[("additive", "scaling")] == pytest.approx(1900.0 / 1000.0 / 2)  # medians, iters >= skip
    text = open(tmp_path / "out" / "bench_ddp.md").read()
    assert "(iter 7)" in text and "| 2 x 4 x 4 |" in text and "| 1 x 8 x 4 |" in text
    assert "| ddl-cc | single | not run |" in text
    losses = json.load(open(tmp_path / "out" / "bench_ddp_losses.json"))
    assert losses["additive-multi"] == multi and losses["ddl-cc-single"] is None


def test_max_difference_needs_enough_losses():
    assert bench_ddp.max_difference([1.0, 2.0], [1.5, 2.0], 2) == (0.5, 0)
    with pytest.raises(ValueError, match="need 3 losses"):
        bench_ddp.max_difference([1.0, 2.0], [1.0, 2.0, 3.0], 3)
