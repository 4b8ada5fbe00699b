"""End-to-end tests of train.py (run as a subprocess, as users run it) and plot_logs.py, on CPU.

Tiny models (2 layers, d 32) on tiny shards written here: a token stream that mostly counts up modulo 64
with random restarts, so a model can learn it within a few dozen iterations.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from data.shards import write_shard
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--vocab_size=64",
    "--n_layer=2",
    "--n_head=2",
    "--head_dim=16",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=4",
    "--gradient_accumulation_steps=2",
    "--eval_iters=2",
    "--log_interval=5",
    "--learning_rate=3e-3",
    "--min_lr=3e-4",
    "--warmup_iters=2",
    "--lr_decay_iters=20",
    "--compile=False",
    "--device=cpu",
    "--dtype=float32",
]


def counting_tokens(n, seed):
    rng = np.random.default_rng(seed)
    restart = rng.random(n) < 0.05
    tokens = np.empty(n, dtype=np.int64)
    v = 0
    for i in range(n):
        v = int(rng.integers(64)) if restart[i] else (v + 1) % 64
        tokens[i] = v
    return tokens


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_shard(str(d / "train.bin"), counting_tokens(20_000, 0))
    write_shard(str(d / "val.bin"), counting_tokens(4_000, 1))
    return str(d)


def env():
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"  # the same thread count in every run (torchrun sets 1 for its workers)
    e["PYTHONPATH"] = REPO
    e.pop("RANK", None)
    return e


def train(out_dir, data_dir, *args, nproc=1, check=True, extra_env=None):
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + ["train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args]
    result = subprocess.run(
        cmd, cwd=REPO, env={**env(), **(extra_env or {})}, capture_output=True, text=True, timeout=240
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_loss = {r["iter"]: r["train_loss"] for r in records if "train_loss" in r}
    val_loss = {r["iter"]: r["val_loss"] for r in records if "val_loss" in r}
    return records, train_loss, val_loss


def expected_lr(it, lr=3e-3, min_lr=3e-4, warmup=2, decay=20):
    # independent restatement of the documented schedule: linear warmup, cosine to min_lr, then flat
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= decay:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (it - warmup) / (decay - warmup)))


def test_tiny_run_learns_logs_and_checkpoints(tmp_path, data_dir):
    out = str(tmp_path / "out")
    result = train(out, data_dir, "--max_iters=30", "--eval_interval=15", "--lr_decay_iters=30")
    assert "iter 25: loss" in result.stdout and "tok/s" in result.stdout and "eta" in result.stdout
    records, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(30))  # one record per iteration
    assert sorted(val_loss) == [0, 15, 30]
    for r in records:
        if "train_loss" in r:
            assert {"iter", "train_loss", "lr", "tok_per_s"} <= set(r) and r["tok_per_s"] > 0
            assert r["lr"] == pytest.approx(expected_lr(r["iter"], decay=30), rel=1e-12)
    # it learns: the counting stream has ~0.4 nats of entropy per token, uniform guessing ln 64 = 4.16
    assert val_loss[0] == pytest.approx(math.log(64), abs=0.3)
    assert val_loss[30] < val_loss[0] - 1.0
    assert np.mean([train_loss[i] for i in range(25, 30)]) < np.mean([train_loss[i] for i in range(5)]) - 1.0

    ckpt = torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "model_args", "config", "iter_num", "best_val_loss", "rng"} <= set(ckpt)
    assert ckpt["iter_num"] == 30 and ckpt["best_val_loss"] == pytest.approx(val_loss[30], rel=1e-12)
    assert not any(k.startswith("_orig_mod.") or k.startswith("module.") for k in ckpt["model"])
    assert ckpt["config"]["n_embd"] == 32 and ckpt["config"]["learning_rate"] == 3e-3
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])  # the checkpoint contract of model.py
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]  # no temp files left behind


def test_resume_is_bit_exact(tmp_path, data_dir):
    # dropout > 0 makes the losses depend on the RNG state too, so the checkpoint must restore it
    args = ["--eval_interval=10", "--dropout=0.1", "--residual=ddl-cc"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    train(straight, data_dir, "--max_iters=20", *args)
    train(split, data_dir, "--max_iters=10", *args)
    result = train(split, data_dir, "--max_iters=20", "--init_from=resume", *args)
    assert "eval iter 10" not in result.stdout  # the checkpoint's evaluation is not repeated
    _, loss_a, val_a = read_log(straight)
    records_b, loss_b, val_b = read_log(split)
    assert sorted(loss_a) == sorted(loss_b) == list(range(20))
    assert all(loss_a[i] == loss_b[i] for i in range(20)), (loss_a, loss_b)  # identical, not just close
    assert val_a == val_b
    assert len(records_b) == 20 + 3  # the resumed log continues without duplicates
    a = torch.load(os.path.join(straight, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(split, "ckpt.pt"), weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_two_ranks_match_one_rank(tmp_path, data_dir):
    # gradient_accumulation_steps=2 is global: 1 rank does 2 micro-steps, 2 ranks 1 each, same batch
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    args = ["--max_iters=8", "--eval_interval=4"]
    train(one, data_dir, *args)
    result = train(two, data_dir, *args, nproc=2)
    assert "2 rank(s)" in result.stdout
    _, loss_1, val_1 = read_log(one)
    _, loss_2, val_2 = read_log(two)
    assert sorted(loss_1) == sorted(loss_2) == list(range(8))
    for i in range(8):
        assert abs(loss_1[i] - loss_2[i]) <= 1e-5 * abs(loss_1[i]), (i, loss_1[i], loss_2[i])
    for i in val_1:
        assert abs(val_1[i] - val_2[i]) <= 1e-5 * abs(val_1[i])
    assert loss_1[7] < loss_1[0] - 0.2  # they really trained (the same way)


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, data_dir):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=6", "--eval_interval=3")
    ckpt_path = os.path.join(out, "ckpt.pt")
    with open(ckpt_path, "rb") as f:
        good = f.read()
    # an absurd learning rate makes the weights overflow float32 after one update: a real divergence
    result = train(
        out,
        data_dir,
        "--max_iters=30",
        "--eval_interval=3",
        "--init_from=resume",
        "--learning_rate=1e30",
        "--min_lr=0.0",
        "--warmup_iters=0",
        check=False,
    )
    assert result.returncode != 0
    assert "stopping before the update" in result.stderr and "last good checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    with open(ckpt_path, "rb") as f:
        assert f.read() == good
    assert not os.path.exists(ckpt_path + ".tmp")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--learnig_rate=1e-3"], "unknown config key 'learnig_rate'. Did you mean learning_rate"),
        (["--dataset=wikitext"], "dataset must be one of shakespeare, fineweb_edu"),
        (["--residual=ddl-xx"], "GPTConfig.residual must be one of"),
        (["--dtype=float16"], "dtype must be 'float32' or 'bfloat16'"),
        (["--max_iters=2", "--data_dir=/nonexistent"], "does not exist"),
    ],
)
def test_config_errors(tmp_path, data_dir, args, message):
    result = train(str(tmp_path / "out"), data_dir, *args, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_gradient_accumulation_must_divide_among_ranks(tmp_path, data_dir):
    result = train(str(tmp_path / "out"), data_dir, "--gradient_accumulation_steps=3", nproc=2, check=False)
    assert result.returncode != 0
    assert (
        "gradient_accumulation_steps=3 (global) must be divisible by the number of ranks (2)" in result.stderr
    )


def test_wandb_offline(tmp_path, data_dir):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    extra = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    args = ["--max_iters=3", "--eval_interval=3", "--wandb_log=True", "--wandb_run_name=t"]
    train(str(tmp_path / "out"), data_dir, *args, extra_env=extra)
    runs = [p for p in (wandb_dir / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.suffix == ".wandb" for f in runs[0].iterdir())


def test_plot_logs(tmp_path):
    import plot_logs

    logs = []
    for name, scale in (("a", 1.0), ("b", 0.9)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "log.jsonl", "w") as f:
            for i in range(20):
                f.write(
                    json.dumps({"iter": i, "train_loss": scale * (5 - i / 10), "lr": 1e-3, "tok_per_s": 1})
                )
                f.write("\n")
            f.write(json.dumps({"iter": 20, "val_loss": scale * 3.0}) + "\n")
        logs.append(str(d / "log.jsonl"))
    train_a, val_a = plot_logs.read_log(logs[0])
    assert len(train_a) == 20 and val_a == [(20, 3.0)]
    assert plot_logs.smooth([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected
    png = str(tmp_path / "loss.png")
    plot_logs.main([*logs, "-o", png, "--smooth=0.5"])
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"iter": 1, "train_loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        plot_logs.read_log(str(bad))


def read_config(name):
    namespace = {}
    with open(os.path.join(REPO, "configs", name)) as f:
        exec(f.read(), namespace)
    return namespace


@pytest.mark.parametrize("name, preset", [("gpt2_small.py", "gpt2-small"), ("gpt2_medium.py", "gpt2-medium")])
def test_gpt2_configs_follow_the_paper_recipe(name, preset):
    c = read_config(name)
    shape = GPTConfig.preset(preset)
    assert all(c[k] == getattr(shape, k) for k in ("n_layer", "n_embd", "n_head", "head_dim"))
    assert c["block_size"] == 1024 and c["batch_size"] * c["gradient_accumulation_steps"] == 480
    assert c["gradient_accumulation_steps"] % 8 == 0  # runs unchanged on 1, 2, 4 or 8 GPUs
    assert (c["learning_rate"], c["betas"], c["weight_decay"], c["grad_clip"]) == (
        1e-3,
        (0.9, 0.95),
        0.1,
        1.0,
    )
    assert (c["warmup_iters"], c["lr_decay_iters"], c["max_iters"]) == (2000, 100_000, 100_000)
    assert c["dataset"] == "fineweb_edu"


@pytest.mark.parametrize(
    "config, millions",
    [("shakespeare.py", (17, 18)), ("gpt2_small.py", (123, 125)), ("gpt2_medium.py", (353, 355))],
)
def test_config_files_are_valid_for_train_py(config, millions):
    # every key the file sets is a train.py key of the right type and the model config is accepted;
    # the dry run builds the model on the meta device and prints its size (papers: 124M and 354M)
    cmd = [sys.executable, "train.py", f"configs/{config}", "--device=cpu", "--dry_run=True"]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"dataset = {read_config(config)['dataset']!r}" in result.stdout
    params = int(result.stdout.split("parameters: ")[1].split()[0].replace(",", ""))
    assert millions[0] * 1e6 <= params <= millions[1] * 1e6


def readme_variant_overrides():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Variants", 1)[1].split("\n## ", 1)[0]  # up to the next heading
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    overrides = [row.split("|")[4].strip() for row in rows]
    return [o.replace("`", "").split() if o != "(none)" else [] for o in overrides]


def test_readme_variant_table_overrides_are_valid():
    from configurator import load_config

    overrides = readme_variant_overrides()
    assert len(overrides) >= 12
    model_defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    tiny = dict(n_layer=1, n_embd=32, n_head=2, head_dim=16, block_size=8, vocab_size=64)
    seen = set()
    for args in overrides:
        model_args = {**load_config(model_defaults, args), **tiny}
        cfg = GPTConfig(**model_args)
        seen.add(repr(sorted(dataclasses.asdict(cfg).items())))  # the whole resolved model config
        _, loss = GPT(cfg)(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
        assert torch.isfinite(loss)
    assert len(seen) == len(overrides)  # every row is a different model
