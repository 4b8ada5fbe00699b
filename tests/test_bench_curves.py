"""bench/bench_curves.py: three real train.py runs (this checkout as its own reference), the table from
hand-made runs, and what each flag changes (the job queue a stand-in)."""

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


def write_losses(out, name, losses):
    os.makedirs(os.path.join(out, name))
    with open(os.path.join(out, name, "log.jsonl"), "w") as f:
        for it, loss in losses.items():
            f.write(json.dumps({"iter": it, "train_loss": loss, "lr": 1e-3}) + "\n")
        f.write(json.dumps({"iter": max(losses), "val_loss": 99.0}) + "\n")


def test_table_labels_and_values_are_each_runs_own(tmp_path):
    """Each variant's line from its own three runs: ref's and split's |loss - this loss| (max, mean) over the
    iterations both have, this run's iteration count, the final loss of this and of ref."""
    out = str(tmp_path)
    write_losses(out, "ddl-this", {0: 4.0, 10: 3.0, 20: 2.5})
    write_losses(out, "ddl-ref", {0: 4.1, 10: 2.8, 20: 2.55})
    write_losses(out, "ddl-split", {0: 4.0, 10: 3.01, 20: 2.5, 30: 9.0})  # 30: not in this run
    write_losses(out, "ddl-cc-this", {0: 5.0, 5: 4.0})
    write_losses(out, "ddl-cc-ref", {0: 5.5, 5: 4.25})
    write_losses(out, "ddl-cc-split", {0: 5.0, 5: 4.002})
    lines = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in
             bc.table(out, ["ddl", "ddl-cc", "ddl-tc"]).splitlines()[2:]}  # fmt: skip
    e = lambda x: f"{x:.2e}"  # noqa: E731
    assert lines["ddl"] == ["ddl", "3", e(0.2), e(0.35 / 3), e(0.01), e(0.01 / 3), "2.5000 / 2.5500"]
    assert lines["ddl-cc"] == ["ddl-cc", "2", e(0.5), e(0.375), e(0.002), e(0.001), "4.0000 / 4.2500"]
    assert lines["ddl-tc"] == ["ddl-tc", "0", "n/a", "n/a", "n/a", "n/a", "n/a"]  # no runs


def test_main_flags_make_three_runs_per_variant(monkeypatch, tmp_path, capsys):
    """--variants x (this, ref, split) runs at once, each in --out/<variant>-<run>; ref's in the --ref
    checkout; --iters, --data-dir and --set reach train.py; --table prints the table of finished runs."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir()
    (ref / "train.py").write_text("")
    seen = {}

    def run_commands(jobs, slots):
        seen.update(jobs=jobs, slots=slots)
        for i, job in enumerate(jobs):
            job["status"] = "exit 1" if i == 1 else "exit 0"
        return jobs

    monkeypatch.setattr(bc, "run_commands", run_commands)
    argv = ["--ref", str(ref), "--variants", "additive,ddl-tc", "--iters", "7", "--out", str(out),
            "--data-dir", "dd", "--set", "batch_size=6", "n_layer=1"]  # fmt: skip
    bc.main(argv)
    jobs = seen["jobs"]
    assert [os.path.basename(j["name"]) for j in jobs] == [f"{v}-{r}" for v in ("additive", "ddl-tc")
                                                          for r in bc.RUNS]  # fmt: skip
    assert len(seen["slots"]) == 6 and [j["cwd"] for j in jobs[:3]] == [bc.REPO, str(ref), bc.REPO]
    for job in jobs:
        k = dict(a[2:].split("=", 1) for a in job["cmd"] if a.startswith("--"))
        variant, run = os.path.basename(job["name"]).rsplit("-", 1)
        assert job["cmd"][1:3] == ["train.py", bc.CONFIG] and k["out_dir"] == job["name"]
        got = (k["residual"], k["max_iters"], k["data_dir"], k["n_layer"])
        assert got == (variant, "7", os.path.abspath("dd"), "1")
        rows = (k["batch_size"], k.get("gradient_accumulation_steps"))
        assert rows == (("3", "2") if run == "split" else ("6", None))  # the config's 1 micro-step
    text = capsys.readouterr().out
    assert f"failed (see train.out): ['{jobs[1]['name']}']" in text
    assert (out / "curves.md").read_text().strip() == text.strip()
    monkeypatch.setattr(bc, "run_commands", lambda *a: pytest.fail("ran"))
    write_losses(str(tmp_path / "done"), "ddl-tc-this", {0: 5.0, 5: 4.0})
    bc.main(["--table", str(tmp_path / "done"), "--variants", "ddl-tc", "--out", str(out)])
    assert capsys.readouterr().out.splitlines()[2].startswith("| ddl-tc | 2 | n/a |")  # that folder's run


def test_main_refusals(capsys, tmp_path):
    for argv, message in [
        (["--variants", "ddl,ddl-xx", "--ref", REPO], "--variants: unknown ['ddl-xx']"),
        (["--set", "batch_size", "--ref", REPO], "--set takes KEY=VALUE, got ['batch_size']"),
        (["--ref", str(tmp_path)], "--ref must be a checkout holding train.py"),
        ([], "--ref must be a checkout holding train.py, got None"),
    ]:
        with pytest.raises(SystemExit):
            bc.main(argv + ["--out", str(tmp_path / "out")])
        assert message in capsys.readouterr().err, argv
    assert not os.path.exists(tmp_path / "out")
