"""End-to-end tests of train.py (run as a subprocess, as users run it) and plot_logs.py, on CPU.

Tiny models (2 layers, d 32) on tiny shards written here: a token stream that mostly counts up modulo 64
with random restarts, so a model can learn it within a few dozen iterations.
"""

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from readme_code import pasted, readme_blocks
from train_inline import run_train

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


def script(dump):
    """train.py, or with dump=DIR train.py through tests/rank_dump.py, which writes each rank's RNG digests,
    rows and stochastic-rounding seeds to DIR."""
    return ["train.py"] if dump is None else ["tests/rank_dump.py", str(dump)]


# train.py with code pasted at the end of model.py (argv: the code, then train.py's)
PASTED = (
    "import runpy, sys, model; exec(sys.argv[1], vars(model)); sys.argv = sys.argv[2:]; "
    "runpy.run_path(sys.argv[0])"
)


def train(out_dir, data_dir, *args, nproc=1, check=True, extra_env=None, file_size_limit=None, dump=None,
          paste=None):  # fmt: skip
    """train.py's run (returncode, stdout, stderr): in a process of its own where the test needs one (ranks,
    a changed model, an environment or file size limit of its own, the rank dump), else in this process
    (train_inline: no interpreter start and torch import, seconds a run), on one thread as a process."""
    if nproc == 1 and extra_env is file_size_limit is dump is paste is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 (env()): the same sums as a run in a process
        try:
            code, out, err, _ = run_train(*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args)
        finally:
            torch.set_num_threads(threads)
        if check and code != 0:
            raise AssertionError(f"train.py {' '.join(args)} failed:\n{out}\n{err}")
        return subprocess.CompletedProcess(["train.py", *args], code, out, err)
    launcher = [sys.executable] if paste is None else [sys.executable, "-c", PASTED, paste]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + [*script(dump), *TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *args]
    limit = None
    if file_size_limit is not None:  # RLIMIT_FSIZE: writing past it fails with EFBIG, as a full disk would

        def limit():
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    result = subprocess.run(
        cmd,
        cwd=REPO,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=1800,  # a guard against a hang, not a measurement: a slow machine must not fail a test
        preexec_fn=limit,
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
    # lr 1e-2: under the default init (matrices 0.5 / sqrt(d)) the tiny model learns too slowly at 3e-3
    args = ["--max_iters=30", "--eval_interval=15", "--lr_decay_iters=30", "--learning_rate=1e-2"]
    result = train(out, data_dir, *args)
    assert "iter 25: loss" in result.stdout and "tok/s" in result.stdout and "eta" in result.stdout
    records, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(30))  # one record per iteration
    assert sorted(val_loss) == [0, 15, 30]
    for r in records:
        if "train_loss" in r:
            assert {"iter", "train_loss", "lr", "tok_per_s"} <= set(r) and r["tok_per_s"] > 0
            assert r["lr"] == pytest.approx(expected_lr(r["iter"], lr=1e-2, decay=30), rel=1e-12)
    # it learns: the counting stream has ~0.4 nats of entropy per token, uniform guessing ln 64 = 4.16
    assert val_loss[0] == pytest.approx(math.log(64), abs=0.3)
    assert val_loss[30] < val_loss[0] - 1.0
    assert np.mean([train_loss[i] for i in range(25, 30)]) < np.mean([train_loss[i] for i in range(5)]) - 1.0

    ckpt = torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "model_args", "config", "iter_num", "best_val_loss", "rng"} <= set(ckpt)
    assert ckpt["iter_num"] == 30 and ckpt["best_val_loss"] == pytest.approx(val_loss[30], rel=1e-12)
    assert not any(k.startswith("_orig_mod.") or k.startswith("module.") for k in ckpt["model"])
    assert ckpt["config"]["n_embd"] == 32 and ckpt["config"]["learning_rate"] == 1e-2
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])  # the checkpoint contract of model.py
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]  # no temp files left behind


@pytest.mark.parametrize("state", [[], ["--ddl_state_dtype=bfloat16", "--ddl_state_rounding=stochastic"]])
def test_resume_is_bit_exact(tmp_path, data_dir, state):
    # dropout > 0 (and stochastic rounding's seeds) make the losses depend on the RNG state too, so the
    # checkpoint must restore it
    args = ["--eval_interval=10", "--dropout=0.1", "--residual=ddl-cc", *state]
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


def test_a_parameter_shared_by_every_block_trains_and_resumes_bit_exactly(tmp_path, data_dir):
    """The README's DDL-CC with one beta for the whole model, pasted into model.py: train.py saves its beta
    once (shared.beta), moved by training, resumes the run bit-exactly, and hands it to AdamW once, without
    weight decay (a scalar, as the vectors)."""
    code = readme_blocks("Add your own residual")[-1]
    with pasted(code) as (name,):
        args = ["--eval_interval=4", f"--residual={name}", "--weight_decay=0.3"]
        straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
        train(straight, data_dir, "--max_iters=8", *args, paste=code)
        train(split, data_dir, "--max_iters=4", *args, paste=code)
        train(split, data_dir, "--max_iters=8", "--init_from=resume", *args, paste=code)
        a, b = (torch.load(os.path.join(out, "ckpt.pt"), weights_only=True) for out in (straight, split))
        n_params = len(list(GPT(GPTConfig(**a["model_args"])).parameters()))
    assert read_log(straight)[1] == read_log(split)[1]  # every iteration's loss, exactly
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert [k for k in a["model"] if "beta" in k] == ["shared.beta"] and a["model"]["shared.beta"].item() != 0
    state, groups = a["optimizer"]["state"], a["optimizer"]["param_groups"]
    assert len(state) == n_params  # each parameter once, the shared one too
    (scalar,) = [i for i, s in state.items() if s["exp_avg"].dim() == 0]
    assert [g["weight_decay"] for g in groups if scalar in g["params"]] == [0.0]


@pytest.mark.parametrize("nproc", [2, 4])
def test_n_ranks_match_one_rank(tmp_path, data_dir, nproc):
    # gradient_accumulation_steps=4 is global: 1 rank does 4 micro-steps, N ranks 4/N each, same batch
    one, two = str(tmp_path / "one"), str(tmp_path / "many")
    args = ["--max_iters=8", "--eval_interval=4", "--gradient_accumulation_steps=4", "--batch_size=2"]
    train(one, data_dir, *args)
    result = train(two, data_dir, *args, nproc=nproc)
    assert f"{nproc} rank(s)" in result.stdout
    records_1, loss_1, val_1 = read_log(one)
    records_2, loss_2, val_2 = read_log(two)
    assert sorted(loss_1) == sorted(loss_2) == list(range(8))
    # tokens/s counts the global batch (8 rows of 16 tokens, all ranks and micro-steps) in the step's time
    for r in records_1 + records_2:
        if "train_loss" in r:
            assert r["tok_per_s"] * r["dt_ms"] / 1000 == pytest.approx(8 * 16, rel=1e-12), r
    assert ", 128 tokens per iteration" in result.stdout
    # the memory line: DDP's gradient buckets double the gradients' share of weights, gradients and AdamW
    import checkpoint as ck

    model_args = torch.load(os.path.join(two, "ckpt.pt"), weights_only=True)["model_args"]
    n = GPT(GPTConfig(**model_args)).num_params()
    assert f"weights, gradients and AdamW {ck.size_text((4 + 2 * 4 + 8) * n)}," in result.stdout
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
        (["--dtype=float16"], "dtype must be one of float32, bfloat16; got 'float16'"),
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
    assert c["doc_mask"] is False  # the papers' recipe, the switch shown (medium's from gpt2_small.py)


@pytest.mark.parametrize(
    "config, millions",
    [("shakespeare.py", (17, 18)), ("gpt2_small.py", (123, 125)), ("gpt2_medium.py", (353, 355))],
)
def test_config_files_are_valid_for_train_py(config, millions):
    # every key the file sets is a train.py key of the right type and the model config is accepted;
    # the dry run builds the model on the meta device and prints its size (papers: 124M and 354M)
    code, out, err, _ = run_train(os.path.join(REPO, "configs", config), "--device=cpu", "--dry_run=True")
    assert code == 0, err
    assert f"dataset = {read_config(config)['dataset']!r}" in out
    params = int(out.split("parameters: ")[1].split()[0].replace(",", ""))
    assert millions[0] * 1e6 <= params <= millions[1] * 1e6


def test_shakespeare_config_header_states_the_readme_figures():
    import re

    with open(os.path.join(REPO, "configs", "shakespeare.py"), encoding="utf-8") as f:
        header = " ".join(line.lstrip("# ").strip() for line in f if line.startswith("#"))
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    speed = re.search(r"~([\d.]+) s per iteration", header)
    loss = re.search(r"val loss of ~([\d.]+) at iteration (\d+)", header)
    assert speed and loss, f"the header gives no time per iteration or val loss at an iteration: {header}"
    (seconds,), (loss, at) = speed.groups(), loss.groups()
    assert f"an iteration takes about {seconds} s" in readme, seconds
    assert f"{loss} at {at} (torch" in readme and int(at) == read_config("shakespeare.py")["max_iters"]


def readme_variant_overrides():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## The paper recipes", 1)[1].split("\n## ", 1)[0]  # up to the next heading
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))  # 1st table
    rows = [line for line in lines[start:end] if "---" not in line][1:]
    overrides = [row.strip("|").split("|")[-1].strip() for row in rows]
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


# ---- what a user hits: previous runs, bad files, full disks (each error one line, nothing lost) ----


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], result.stderr


def test_fresh_run_refuses_a_previous_run_and_overwrite_replaces_it(tmp_path, data_dir):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=3", "--eval_interval=3")
    ckpt, log = file_bytes(os.path.join(out, "ckpt.pt")), file_bytes(os.path.join(out, "log.jsonl"))
    refused = train(out, data_dir, "--max_iters=3", "--eval_interval=3", check=False)
    assert_one_line_error(refused, "holds a previous run", "--init_from=resume", "--overwrite=True")
    # asked to overwrite, a run that fails before logging anything (a shard with ids >= vocab_size at
    # the first batch) still leaves the previous run as it was
    crashed = train(out, data_dir, "--overwrite=True", "--vocab_size=32", check=False)
    assert_one_line_error(crashed, "val.bin", "token id", ">= vocab_size 32")
    assert file_bytes(os.path.join(out, "ckpt.pt")) == ckpt
    assert file_bytes(os.path.join(out, "log.jsonl")) == log
    train(out, data_dir, "--max_iters=2", "--eval_interval=100", "--overwrite=True")
    records, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == [0, 1] and sorted(val_loss) == [0, 2] and len(records) == 4
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 2


def test_help_lists_every_key_and_no_arguments_prints_usage(tmp_path):
    def run(*args):
        cmd = [sys.executable, os.path.join(REPO, "train.py"), *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=1800)

    for flag in ("--help", "-h"):
        result = run(flag)
        assert result.returncode == 0, result.stderr
        assert "usage: python train.py" in result.stdout and "configs/shakespeare.py" in result.stdout
        lines = {line.split()[0]: line for line in result.stdout.splitlines() if " = " in line}
        assert "eval_interval = 250" in lines["eval_interval"]
        assert "evaluate and checkpoint" in lines["eval_interval"]  # the key's comment in train.py
        assert "vocab_size = 50304" in lines["vocab_size"] and "GPT-2" in lines["vocab_size"]
        assert "overwrite = False" in lines["overwrite"]
        assert {"learning_rate", "dry_run", "residual", "ddl_dv", "attention"} <= set(lines)
        keys = result.stdout.split("config keys (default, meaning):\n")[1].splitlines()
        assert len(keys) == len(lines) > 60
        undescribed = [line.split()[0] for line in keys if "  # " not in line or not line.split("  # ")[1]]
        assert not undescribed, f"keys without a description: {undescribed}"
    bare = run()
    assert bare.returncode != 0 and "usage: python train.py" in bare.stderr and "--help" in bare.stderr
    assert "Traceback" not in bare.stderr
    assert os.listdir(tmp_path) == []  # no run started, no ./out


def test_resume_takes_block_size_from_the_checkpoint(tmp_path, data_dir):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=3", "--eval_interval=3")
    result = train(out, data_dir, "--max_iters=5", "--init_from=resume", "--block_size=8")
    assert "block_size=16 (not 8)" in result.stdout
    assert "micro-steps of 4 x 16" in result.stdout  # the loaders cut rows of the model's length
    _, train_loss, _ = read_log(out)
    assert sorted(train_loss) == list(range(5))


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
def test_corrupt_checkpoint_is_one_line_naming_it(tmp_path, data_dir, damage):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    path = os.path.join(out, "ckpt.pt")
    good = file_bytes(path)
    bad = {"truncated": good[: len(good) // 2], "random": os.urandom(4096), "empty": b""}[damage]
    with open(path, "wb") as f:
        f.write(bad)
    result = train(out, data_dir, "--max_iters=4", "--init_from=resume", check=False)
    assert_one_line_error(result, path)
    assert "weights_only" not in result.stderr


def test_torn_last_log_line_is_dropped_and_other_bad_lines_are_named(tmp_path, data_dir):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=4", "--eval_interval=2")
    log_path = os.path.join(out, "log.jsonl")
    good = file_bytes(log_path)
    with open(log_path, "ab") as f:
        f.write(b'{"iter": 4, "train_lo')  # a crash in the middle of writing a record
    result = train(out, data_dir, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    assert "log.jsonl:8: dropped a cut-short last line" in result.stdout
    records, train_loss, _ = read_log(out)  # every line parses again
    assert sorted(train_loss) == list(range(6))
    lines = good.split(b"\n")
    lines[2] = b"garbage"
    with open(log_path, "wb") as f:
        f.write(b"\n".join(lines))
    result = train(out, data_dir, "--max_iters=8", "--eval_interval=2", "--init_from=resume", check=False)
    assert_one_line_error(result, "log.jsonl:3: not a log record")


def test_token_ids_beyond_vocab_size_name_the_shard(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    tokens = counting_tokens(4_000, 0)
    tokens[1234] = 65535  # a shard of another tokenizer
    write_shard(str(d / "train.bin"), tokens)
    write_shard(str(d / "val.bin"), counting_tokens(2_000, 1))
    result = train(str(tmp_path / "out"), str(d), "--max_iters=2", check=False)
    assert_one_line_error(result, "train.bin: token id 65535 >= vocab_size 64")


def test_missing_val_shards_hint_once_and_dry_run_shows_resolved_values(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_shard(str(d / "train.bin"), counting_tokens(2_000, 0))
    result = train(str(tmp_path / "out"), str(d), "--max_iters=2", check=False)
    assert result.returncode != 0 and "no 'val' shards" in result.stderr
    assert result.stderr.count("prepare") == 1, result.stderr
    cmd = [sys.executable, "train.py", "--residual=ddl-cc", "--dry_run=True", "--device=cpu"]
    dry = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=1800)
    assert dry.returncode == 0 and "ddl_dv = 4" in dry.stdout and "ddl_dv = None" not in dry.stdout


def test_config_file_errors_name_the_file_and_line(tmp_path, data_dir):
    cases = [("a = 1\nif True\n", "line 2: syntax error"), ("x = 1\ny = 1 / 0\n", "line 2: ZeroDivision")]
    for source, message in cases:
        path = tmp_path / "config.py"
        path.write_text(source)
        result = train(str(tmp_path / "out"), data_dir, str(path), check=False)
        assert_one_line_error(result, f"config file '{path}', {message}")


def test_eta_leaves_out_the_first_iterations(tmp_path, data_dir):
    result = train(str(tmp_path / "out"), data_dir, "--max_iters=6", "--log_interval=1")
    etas = [line.split("eta ")[1] for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert etas[:2] == ["-", "-"]  # compilation and warm-up would make it meaningless
    assert all(e.count(":") == 2 for e in etas[2:]) and len(etas) == 6


@pytest.mark.parametrize("micro_steps", [2, 4])
def test_accumulated_gradients_equal_one_step_over_the_global_batch(tmp_path, data_dir, micro_steps):
    # the global batch of 8 rows as 2 x 4 or 4 x 2 micro-steps: the first update's gradient (read back from
    # Adam's first moment, m = (1 - beta1) g) and the logged norm must be those of the mean loss over all 8
    out = str(tmp_path / "out")
    args = [f"--batch_size={8 // micro_steps}", f"--gradient_accumulation_steps={micro_steps}"]
    train(out, data_dir, "--max_iters=1", "--eval_interval=1", "--grad_clip=0", *args)
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    grad_norm = [r["grad_norm"] for r in read_log(out)[0] if "grad_norm" in r][0]

    from data.loader import ShardLoader

    torch.manual_seed(1337)  # train.py's seed: the same initial weights
    model = GPT(GPTConfig(**ckpt["model_args"]))
    loader = ShardLoader([os.path.join(data_dir, "train.bin")], 16, seed=1337)
    x, y = loader.get_batch(0, 0, 8, 8)
    model(x, y)[1].backward()
    params = [p for p in model.parameters() if p.requires_grad]
    expected_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    assert grad_norm == pytest.approx(expected_norm, rel=1e-5)
    state = ckpt["optimizer"]["state"]  # indexed in the order of train.py's two parameter groups
    order = [p for p in params if p.dim() >= 2] + [p for p in params if p.dim() < 2]
    assert len(state) == len(order)
    for index, p in enumerate(order):
        torch.testing.assert_close(state[index]["exp_avg"] / (1 - 0.9), p.grad, rtol=1e-4, atol=1e-8)


def test_checkpoint_over_the_file_size_limit_keeps_the_previous_one(tmp_path, data_dir):
    pytest.importorskip("resource")
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    ckpt_path = os.path.join(out, "ckpt.pt")
    good = file_bytes(ckpt_path)
    for stale in ("ckpt.pt.tmp", "log.jsonl.tmp"):  # left by a run killed while writing them
        with open(os.path.join(out, stale), "wb") as f:
            f.write(b"partial")
    args = ["--max_iters=4", "--eval_interval=2", "--init_from=resume"]
    result = train(out, data_dir, *args, file_size_limit=len(good) // 2, check=False)
    assert_one_line_error(result, ckpt_path, "file size limit", "need ~", "previous ckpt.pt is kept")
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]  # no temp file left behind
    assert file_bytes(ckpt_path) == good
    train(out, data_dir, *args)  # the kept checkpoint resumes
    _, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(4)) and sorted(val_loss) == [0, 2, 4]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (a real full disk); skipped where mounting one is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]
    try:
        mounted = subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0
    except OSError:
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True, timeout=300)


def fill(directory, leave):
    """Grow directory/filler until at most `leave` bytes are free."""
    with open(os.path.join(directory, "filler"), "ab") as f:
        try:
            while shutil.disk_usage(directory).free > leave:
                f.write(b"\0" * min(4096, shutil.disk_usage(directory).free - leave))
                f.flush()
        except OSError:
            pass


def test_full_disk_is_one_line_and_the_last_checkpoint_stays(small_disk, data_dir):
    out = str(small_disk / "out")
    train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    ckpt_path, log_path = os.path.join(out, "ckpt.pt"), os.path.join(out, "log.jsonl")
    good, log = file_bytes(ckpt_path), file_bytes(log_path)
    fill(small_disk, leave=len(good) // 4)
    args = ["--max_iters=4", "--eval_interval=2", "--init_from=resume"]
    result = train(out, data_dir, *args, check=False)  # the log fits; the checkpoint at 4 does not
    assert_one_line_error(result, f"no space left on {out}: need ~", "for ckpt.pt", "free")
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"] and file_bytes(ckpt_path) == good
    fill(small_disk, leave=0)
    result = train(out, data_dir, *args, check=False)  # now not even the log's first record fits
    assert_one_line_error(result, f"no space left on {out}", "log.jsonl")
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"] and file_bytes(ckpt_path) == good
    assert file_bytes(log_path).startswith(log)  # what the previous run logged up to its checkpoint
    os.remove(small_disk / "filler")
    train(out, data_dir, *args)
    _, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(4)) and sorted(val_loss) == [0, 2, 4]


def test_plot_logs_missing_output_folder_and_torn_last_line(tmp_path, capsys):
    import plot_logs

    log = tmp_path / "log.jsonl"
    log.write_text('{"iter": 0, "train_loss": 2.0}\n{"iter": 1, "train_loss": 1.9}\n{"iter": 2, "train_l')
    assert plot_logs.read_log(str(log)) == ([(0, 2.0), (1, 1.9)], [])  # a run still writing, or crashed
    assert "log.jsonl:3: skipped a cut-short last line" in capsys.readouterr().err
    missing = tmp_path / "missing" / "loss.png"
    with pytest.raises(SystemExit):
        plot_logs.main([str(log), "-o", str(missing)])
    err = capsys.readouterr().err
    assert f"folder {tmp_path / 'missing'} does not exist" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == ["log.jsonl"]


def test_a_live_run_holds_its_out_dir_and_a_killed_run_leaves_it_free(tmp_path, data_dir):
    pytest.importorskip("fcntl")
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    cmd = [sys.executable, "train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}",
           "--init_from=resume", "--max_iters=1000000", "--eval_interval=1000000"]  # fmt: skip
    with open(tmp_path / "stderr", "w") as stderr:
        live = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        for line in live.stdout:  # the model line comes after the folder is held: no waiting on a clock
            if line.startswith("model:"):
                break
        live.send_signal(signal.SIGSTOP)  # alive, holding the folder, using no CPU
        assert live.poll() is None, (tmp_path / "stderr").read_text()
        for args in ([], ["--overwrite=True"], ["--init_from=resume"]):
            refused = train(out, data_dir, "--max_iters=4", *args, check=False)
            assert_one_line_error(refused, f"{out} is in use by another training run", "another --out_dir")
        assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 2
    finally:
        live.kill()  # kill -9: the OS drops its lock
        live.wait()
        live.stdout.close()
    train(out, data_dir, "--max_iters=4", "--eval_interval=2", "--init_from=resume")
    _, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(4)) and sorted(val_loss) == [0, 2, 4]


def test_out_dir_that_is_a_file_is_one_line(tmp_path, data_dir):
    path = tmp_path / "out"
    path.write_text("notes\n")
    result = train(str(path), data_dir, "--max_iters=2", check=False)
    assert_one_line_error(result, f"out_dir {path} is a file, not a folder")
    assert path.read_text() == "notes\n"


def test_max_iters_0_checkpoints_the_initial_model_it_names(tmp_path, data_dir):
    out = str(tmp_path / "out")
    result = train(out, data_dir, "--max_iters=0")
    _, train_loss, val_loss = read_log(out)
    assert train_loss == {} and list(val_loss) == [0]
    assert f"done: 0 iterations, best val loss {val_loss[0]:.4f}, checkpoint {out}/ckpt.pt" in result.stdout
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 0 and ckpt["best_val_loss"] == val_loss[0]
    torch.manual_seed(1337)  # train.py's seed: the same initial weights
    model = GPT(GPTConfig(**ckpt["model_args"]))
    assert all(torch.equal(t, ckpt["model"][k]) for k, t in model.state_dict().items())
    train(out, data_dir, "--max_iters=2", "--init_from=resume")  # and it resumes
    assert sorted(read_log(out)[1]) == [0, 1]


def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_its_folder(tmp_path, data_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    tokens = counting_tokens(20_000, 0)
    tokens[0] = 65535  # the first training batch fails, after the evaluation at iteration 0 was logged
    write_shard(str(bad / "train.bin"), tokens)
    shutil.copy(os.path.join(data_dir, "val.bin"), bad / "val.bin")
    out = str(tmp_path / "out")
    failed = train(out, str(bad), "--max_iters=4", "--eval_interval=2", check=False)
    assert_one_line_error(failed, "token id 65535 >= vocab_size 64")
    assert os.listdir(out) == ["log.jsonl"]
    log = file_bytes(os.path.join(out, "log.jsonl"))
    resumed = train(out, data_dir, "--max_iters=4", "--init_from=resume", check=False)
    assert_one_line_error(resumed, "no checkpoint", "stopped before its first checkpoint", "start afresh")
    for n in (1, 2):  # each rerun keeps the log it finds, under the first free name
        data = str(bad) if n == 1 else data_dir  # the first rerun fails the same way
        result = train(out, data, "--max_iters=4", "--eval_interval=2", check=n == 2)
        assert f"kept as {out}/log.{n}.jsonl" in result.stdout
    assert file_bytes(os.path.join(out, "log.1.jsonl")) == log
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.1.jsonl", "log.2.jsonl", "log.jsonl"]
    _, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(4)) and sorted(val_loss) == [0, 2, 4]


# ---- the optimizer: what it was given, read back from the checkpoint ----


def test_lr_is_min_lr_from_lr_decay_iters_on(tmp_path, data_dir):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=7", "--eval_interval=7", "--warmup_iters=1", "--lr_decay_iters=4")
    lrs = {r["iter"]: r["lr"] for r in read_log(out)[0] if "lr" in r}
    assert sorted(lrs) == list(range(7))
    for it, lr in lrs.items():
        assert lr == pytest.approx(expected_lr(it, warmup=1, decay=4), rel=1e-12), (it, lr)
    assert [lrs[it] for it in (4, 5, 6)] == [3e-4] * 3  # min_lr, exactly, at and after lr_decay_iters
    groups = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [3e-4] * len(groups)  # what the last update used


def test_the_optimizer_gets_the_clipped_gradient_and_decays_only_matrices(tmp_path, data_dir):
    # one update from zero moments: Adam's first moment is (1 - beta1) g, g the gradient the optimizer got
    out = str(tmp_path / "out")
    args = ["--max_iters=1", "--eval_interval=1", "--grad_clip=0.01", "--weight_decay=0.3"]
    train(out, data_dir, *args, "--residual=ddl-cc")
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    (grad_norm,) = [r["grad_norm"] for r in read_log(out)[0] if "grad_norm" in r]
    assert grad_norm > 0.1  # the logged norm is the gradient's before clipping: far above grad_clip
    state = ckpt["optimizer"]["state"]
    g = [s["exp_avg"] / (1 - 0.9) for s in state.values()]
    assert torch.stack([t.norm() for t in g]).norm().item() == pytest.approx(0.01, rel=1e-4)  # grad_clip
    # weight decay on matrices, embeddings and convolutions, not on vectors (norm weights, biases, reads)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    params = [p for p in model.parameters() if p.requires_grad]
    vectors = sum(p.dim() < 2 for p in params)
    assert vectors >= 2 * 2 + 2  # per block a norm and a read at least, and the final norm
    groups = ckpt["optimizer"]["param_groups"]
    decay_of = {i: group["weight_decay"] for group in groups for i in group["params"]}
    assert sorted(decay_of) == sorted(state) == list(range(len(params)))  # every parameter, once
    for i, s in state.items():
        assert decay_of[i] == (0.3 if s["exp_avg"].dim() >= 2 else 0.0), (i, s["exp_avg"].shape)
    assert sum(decay_of[i] == 0.0 for i in state) == vectors


# ---- what a run keeps: the stop before a bad update, the best evaluation, the run settings on resume ----


def test_a_non_finite_gradient_norm_with_a_finite_loss_stops_before_the_update(tmp_path, data_dir):
    import re

    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    ckpt_path, log_path = os.path.join(out, "ckpt.pt"), os.path.join(out, "log.jsonl")
    ckpt = torch.load(ckpt_path, weights_only=True)
    # logits ~1e22: the loss (~1e21) stays finite in float32, the gradients' norm overflows it (each gradient
    # is finite, so clipping would scale them all to 0 and step on, silently)
    ckpt["model"]["ln_f.weight"] *= 1e22
    torch.save(ckpt, ckpt_path)
    good, log = file_bytes(ckpt_path), file_bytes(log_path)
    for clip in ("--grad_clip=1.0", "--grad_clip=0"):  # clipped, or only measured
        args = ["--max_iters=4", "--eval_interval=2", "--init_from=resume", clip]
        result = train(out, data_dir, *args, check=False)
        assert_one_line_error(result, "iteration 2: train loss", "stopping before the update", "last good")
        loss, norm = re.search(r"train loss (\S+), gradient norm (\S+):", result.stderr).groups()
        assert math.isfinite(float(loss)) and not math.isfinite(float(norm)), result.stderr
        assert file_bytes(ckpt_path) == good and file_bytes(log_path) == log  # no update, no record of one


def test_best_val_loss_is_the_minimum_over_evaluations(tmp_path, data_dir):
    # down over a first run, then up after a resume at a learning rate far too high: the best evaluation
    # is one of the first run's, neither the latest nor the resumed run's own best
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=4", "--eval_interval=2", "--learning_rate=1e-2", "--lr_decay_iters=4")
    high = ["--learning_rate=0.3", "--min_lr=0.3", "--warmup_iters=0"]
    result = train(out, data_dir, "--max_iters=8", "--eval_interval=2", "--init_from=resume", *high)
    _, _, val = read_log(out)
    assert sorted(val) == [0, 2, 4, 6, 8]
    best = min(val.values())
    assert val[4] < val[0] and best in (val[2], val[4]) and best < min(val[6], val[8]), val
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["best_val_loss"] == best
    assert f"best val loss {best:.4f}," in result.stdout


def test_overwrite_drops_the_earlier_checkpoint_with_the_new_runs_first_record(tmp_path, data_dir):
    # the new run crashes after logging its evaluation at 0, before its first checkpoint: the earlier run's
    # ckpt.pt must not survive next to the new log, where a resume would continue the earlier run
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=3", "--eval_interval=3")
    bad = tmp_path / "bad"
    bad.mkdir()
    tokens = counting_tokens(20_000, 0)
    tokens[0] = 65535  # the first training batch fails, after the evaluation at 0 is logged
    write_shard(str(bad / "train.bin"), tokens)
    shutil.copy(os.path.join(data_dir, "val.bin"), bad / "val.bin")
    crashed = train(out, str(bad), "--overwrite=True", "--max_iters=4", "--eval_interval=2", check=False)
    assert_one_line_error(crashed, "token id 65535 >= vocab_size 64")
    records, _, _ = read_log(out)
    assert [set(r) for r in records] == [{"iter", "val_loss"}] and records[0]["iter"] == 0  # the new run's
    ckpt_path = os.path.join(out, "ckpt.pt")
    if os.path.exists(ckpt_path):  # replaced, by the new run's initial state, is fine too
        assert torch.load(ckpt_path, weights_only=True)["iter_num"] == 0
        return
    assert os.listdir(out) == ["log.jsonl"]
    resumed = train(out, data_dir, "--max_iters=4", "--init_from=resume", check=False)
    assert_one_line_error(resumed, "no checkpoint", "stopped before its first checkpoint")


def test_resume_takes_dropout_and_backend_from_this_run(tmp_path, data_dir):
    # both directions: a checkpoint of dropout 0.1 and the Triton kernels (as a GPU run writes it) resumed
    # on the CPU with 0.0 and torch, and one of 0.0 and torch resumed with 0.3 and auto; without Triton's
    # interpreter, backend='triton' would fail on the CPU
    from data.loader import ShardLoader

    args = ["--residual=ddl", "--eval_interval=2"]
    base = tmp_path / "base"
    train(str(base), data_dir, "--max_iters=2", "--dropout=0.0", "--backend=torch", *args)
    runs = {"a": ({"dropout": 0.1, "backend": "triton"}, 0.0, "torch"), "b": ({}, 0.3, "auto")}
    for name, (in_checkpoint, dropout, backend) in runs.items():
        shutil.copytree(base, tmp_path / name)
        path = str(tmp_path / name / "ckpt.pt")
        ckpt = torch.load(path, weights_only=True)
        ckpt["model_args"].update(in_checkpoint)
        torch.save(ckpt, path)
        resume = ["--max_iters=3", "--init_from=resume", f"--dropout={dropout}", f"--backend={backend}"]
        train(str(tmp_path / name), data_dir, *resume, *args, extra_env={"TRITON_INTERPRET": "0"})
        saved = torch.load(path, weights_only=True)["model_args"]
        assert (saved["dropout"], saved["backend"]) == (dropout, backend), name
    # the dropout in effect: without it, iteration 2's loss is the checkpoint model's plain loss
    ckpt = torch.load(os.path.join(base, "ckpt.pt"), weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    x, y = ShardLoader([os.path.join(data_dir, "train.bin")], 16, seed=1337).get_batch(2, 0, 8, 8)
    with torch.no_grad():
        plain = model.eval()(x, y)[1].item()
    loss = {name: read_log(str(tmp_path / name))[1][2] for name in runs}
    assert loss["a"] == pytest.approx(plain, rel=1e-5), (loss, plain)
    assert abs(loss["b"] - plain) > 1e-4 * plain, (loss, plain)  # 10x the tolerance above


# ---- Ctrl-C and SIGTERM: the step finishes, a checkpoint, one line, a non-zero exit; resumable ----


def start(out_dir, data_dir, *args, nproc=1, dump=None):
    """train.py running in the background, its stdout and stderr piped (rank 0 logs every iteration)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + [*script(dump), *TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}"]
    cmd += ["--log_interval=1"]
    pipe = subprocess.PIPE
    return subprocess.Popen([*cmd, *args], cwd=REPO, env=env(), stdout=pipe, stderr=pipe, text=True)


def wait_for(stream, prefix):
    """Read lines until one starts with prefix (the process has got that far: no clock involved)."""
    for line in stream:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the stream ended before a line starting with {prefix!r}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_checkpoints_after_the_step_and_the_run_resumes_bit_exactly(tmp_path, data_dir, sig):
    args = ["--eval_interval=10", "--dropout=0.1"]  # dropout: the checkpoint must hold the RNG state too
    split, straight = str(tmp_path / "split"), str(tmp_path / "straight")
    run = start(split, data_dir, "--max_iters=1000000", *args)
    wait_for(run.stdout, "iter 3:")  # iteration 3 is done and logged
    run.send_signal(sig)
    out, err = run.communicate(timeout=1800)
    assert run.returncode == 128 + sig, err
    assert "Traceback" not in err, err
    stopped = torch.load(os.path.join(split, "ckpt.pt"), weights_only=True)["iter_num"]
    assert stopped >= 4  # the step under way when the signal came finished first
    line = f"{signal.Signals(sig).name}: interrupted at iteration {stopped}; resume with --init_from=resume"
    assert out.strip().splitlines()[-1].startswith(line), out
    assert sorted(os.listdir(split)) == ["ckpt.pt", "log.jsonl"]
    end = f"--max_iters={stopped + 3}"
    train(split, data_dir, end, "--init_from=resume", *args)
    train(straight, data_dir, end, *args)
    (_, loss_a, val_a), (records_b, loss_b, val_b) = read_log(straight), read_log(split)
    assert sorted(loss_a) == sorted(loss_b) == list(range(stopped + 3))
    assert all(loss_a[i] == loss_b[i] for i in loss_a), (loss_a, loss_b)  # identical, not just close
    assert val_a == val_b and len(records_b) == len(read_log(straight)[0])
    a = torch.load(os.path.join(straight, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(split, "ckpt.pt"), weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_second_sigint_aborts_at_once_and_the_last_checkpoint_stays(tmp_path, data_dir):
    out = str(tmp_path / "out")
    train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    ckpt_path = os.path.join(out, "ckpt.pt")
    good = file_bytes(ckpt_path)
    run = start(out, data_dir, "--init_from=resume", "--max_iters=1000000", "--eval_interval=1000000")
    wait_for(run.stdout, "iter 3:")
    # the checkpoint's temp file as a FIFO: writing the checkpoint blocks until someone reads it, never
    # here, so the run can only end by the second SIGINT, inside that call (as in a slow write or a long step)
    os.mkfifo(ckpt_path + ".tmp")
    run.send_signal(signal.SIGINT)
    assert "stopping after this step; Ctrl-C again aborts at once" in wait_for(run.stderr, "train.py: SIGINT")
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=1800)
    assert run.returncode == -signal.SIGINT and "Traceback" not in err, err
    assert file_bytes(ckpt_path) == good
    train(out, data_dir, "--max_iters=4", "--eval_interval=2", "--init_from=resume")  # removes the FIFO
    _, train_loss, val_loss = read_log(out)
    assert sorted(train_loss) == list(range(4)) and sorted(val_loss) == [0, 2, 4]
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]


def rank_pid(parent, rank):
    """The pid of torchrun's worker of this rank (Linux: /proc), waiting for it to exist."""
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and f"RANK={rank}".encode() in environ:
                return int(pid)


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_iteration(tmp_path, data_dir):
    if not os.path.isdir("/proc/self"):
        pytest.skip("finds the workers in /proc")
    # dropout and stochastic rounding draw from each rank's RNG: its state must come back to each rank
    args = ["--eval_interval=10", "--gradient_accumulation_steps=4", "--batch_size=2", "--dropout=0.1"]
    args += ["--residual=ddl-cc", "--ddl_state_dtype=bfloat16", "--ddl_state_rounding=stochastic"]
    split, straight = str(tmp_path / "split"), str(tmp_path / "straight")
    dumps = {name: tmp_path / f"{name}.dump" for name in ("split", "straight")}
    for d in dumps.values():
        d.mkdir()
    run = start(split, data_dir, "--max_iters=1000000", *args, nproc=2, dump=dumps["split"])
    wait_for(run.stdout, "iter 3:")
    os.kill(rank_pid(run.pid, 1), signal.SIGTERM)  # rank 1 only: rank 0 learns it through the flag
    out, err = run.communicate(timeout=1800)
    assert run.returncode != 0  # torchrun reports its workers' exit status, 143
    # no rank failed otherwise: each exits 143, unless the launcher ends it (-15) as it winds down, after the
    # barrier that holds every rank until rank 0 has written the checkpoint and the log
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert "143" in codes and set(codes) <= {"143", "-15"}, err
    stopped = torch.load(os.path.join(split, "ckpt.pt"), weights_only=True)["iter_num"]
    assert f"SIGTERM: interrupted at iteration {stopped}; resume with --init_from=resume" in out
    end = f"--max_iters={stopped + 2}"
    train(split, data_dir, end, "--init_from=resume", *args, nproc=2, dump=dumps["split"])
    train(straight, data_dir, end, *args, nproc=2, dump=dumps["straight"])

    # per rank, iteration by iteration, across the resume: the same RNG states, rows and rounding seeds as
    # the straight run's; each rank its own RNG stream, its own seeds and its own rows of the global batch
    from data.loader import ShardLoader

    split_ranks, straight_ranks = rank_dumps(dumps["split"], 2), rank_dumps(dumps["straight"], 2)
    assert all(sorted(ranks) == list(range(stopped + 2)) for ranks in split_ranks + straight_ranks)
    loader = ShardLoader([os.path.join(data_dir, "train.bin")], 16, seed=1337)
    for it in range(stopped + 2):
        x = loader.get_batch(it, 0, 8, 8)[0]  # the global batch: 2 ranks x 2 micro-steps x 2 rows
        for r in range(2):
            mine = straight_ranks[r][it]
            assert split_ranks[r][it] == mine, (it, r)
            assert len(set(mine["rng"])) == 1  # one state per iteration: its micro-batches come first
            assert len(mine["seeds"]) == 2 * 2 * 2  # one per update: 2 micro-steps x 2 blocks x 2 sublayers
            for m, (rows, tokens) in enumerate(mine["batches"]):
                first = (m * 2 + r) * 2
                assert rows == [first, 2] and tokens == x[first : first + 2].tolist(), (it, r, m)
        a, b = straight_ranks[0][it], straight_ranks[1][it]
        assert a["rng"][0] != b["rng"][0] and not set(a["seeds"]) & set(b["seeds"]), it
    rng_a, rng_b = (
        torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)["rng"] for d in (straight, split)
    )
    for r in range(2):  # the states the checkpoints hold at the end, rank by rank
        assert torch.equal(rng_a[r]["torch"], rng_b[r]["torch"]) and rng_a[r]["python"] == rng_b[r]["python"]
        assert torch.equal(rng_a[r]["numpy"][1], rng_b[r]["numpy"][1])
    assert not torch.equal(rng_a[0]["torch"], rng_a[1]["torch"])
    (_, loss_a, val_a), (_, loss_b, val_b) = read_log(straight), read_log(split)
    assert sorted(loss_a) == sorted(loss_b) == list(range(stopped + 2))
    assert all(loss_a[i] == loss_b[i] for i in loss_a) and val_a == val_b, (loss_a, loss_b)


def rank_dumps(directory, ranks):
    """Per rank, {iteration: {"rng": digests, "batches": [(rows, tokens)], "seeds": [...]}} from the files
    tests/rank_dump.py writes (a resumed run appends to them)."""
    out = []
    for r in range(ranks):
        iters, last = {}, None
        with open(os.path.join(directory, f"rank{r}.jsonl")) as f:
            for e in map(json.loads, f):
                if "iter" in e:
                    last = iters.setdefault(e["iter"], {"rng": [], "batches": [], "seeds": []})
                    last["rng"].append(e["rng"])
                    last["batches"].append((e["rows"], e["x"]))
                else:  # a seed of the iteration's forwards, which follow its micro-batches
                    last["seeds"].append(e["seed"])
        out.append(iters)
    return out


# ---- memory: the step's estimate in the header; a step that cannot fit is refused before any work ----


def test_a_step_that_cannot_fit_is_refused_in_one_line_before_any_work(tmp_path):
    import checkpoint as ck

    cfg = read_config("shakespeare.py")
    shape = {k: cfg[k] for k in ("n_layer", "n_embd", "n_head", "head_dim")}
    big = GPTConfig(**shape, block_size=100_000)
    need = sum(ck.step_memory(big, cfg["batch_size"], 100_000, bf16=False).values())
    if need <= (ck.available_memory("cpu") or 0):
        pytest.skip("this machine has the memory for it")
    out = tmp_path / "new" / "out"  # two folders that the run makes, and takes back
    cmd = [sys.executable, "train.py", "configs/shakespeare.py", "--block_size=100000", "--device=cpu"]
    result = subprocess.run([*cmd, f"--out_dir={out}"], cwd=REPO, env=env(), capture_output=True, text=True)
    assert_one_line_error(result, "a training step needs ~", "logits", "available on cpu")
    assert "batch_size=8 x block_size=100000 x vocab_size=50304" in result.stderr
    assert result.stdout == ""  # refused before the data and the model (no header)
    assert os.listdir(tmp_path) == []


def test_the_header_states_the_estimate_and_the_first_step(tmp_path, data_dir):
    result = train(str(tmp_path / "out"), data_dir, "--max_iters=1", "--eval_interval=1")
    lines = result.stdout.splitlines()
    (estimate,) = [line for line in lines if line.startswith("a step needs ~")]
    assert "activations" in estimate and "logits" in estimate and "available on cpu" in estimate
    assert lines[lines.index(estimate) + 1] == "first step: iteration 0 ..."  # before the evaluation and step


def saved_bytes(model, x, y):
    """(bytes of the tensors autograd saves in one forward, those of the logits and their gradient): each
    storage once, the parameters left out; the logits' are those whose last dimension is the vocabulary."""
    cfg, params = model.config, {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = (storage.nbytes(), t.shape[-1:] == (cfg.vocab_size,))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, loss = model(x, y)
    pack(logits)
    logits.register_hook(lambda g: None if pack(g) is None else None)
    loss.backward()
    activations = sum(n for n, of_logits in seen.values() if not of_logits)
    return activations, sum(n for n, of_logits in seen.values() if of_logits)


@pytest.mark.parametrize(
    "shape, variant",
    [
        (dict(n_layer=2, n_embd=64, vocab_size=512), {}),
        (dict(n_layer=4, n_embd=128, vocab_size=80), {}),  # activations ~30x the logits
        (dict(n_layer=1, n_embd=32, vocab_size=4096), {}),  # logits ~10x the activations
        (dict(n_layer=2, n_embd=64, vocab_size=512), dict(residual="ddl")),
        (dict(n_layer=2, n_embd=64, vocab_size=512), dict(residual="ddl-cc")),
        (dict(n_layer=2, n_embd=64, vocab_size=512), dict(attention="deltaformer")),
    ],
)
def test_the_memory_estimate_against_the_tensors_a_step_keeps(shape, variant):
    import checkpoint as ck

    B, T = 3, 96
    cfg = GPTConfig(**shape, n_head=2, head_dim=32, block_size=T, **variant)
    model = GPT(cfg)
    x, y = torch.randint(0, cfg.vocab_size, (2, B, T))
    activations, logits = saved_bytes(model, x, y)
    est = ck.step_memory(cfg, B, T, bf16=False)
    n = model.num_params()
    assert (est["weights"], est["gradients"], est["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert est["logits"] == logits  # the logits, the log-probabilities, the gradient: fp32 each
    if not variant:  # the paths the estimate counts (as the GPU kernels keep them): within 25%
        assert 0.8 < activations / est["activations"] < 1.25, (activations, est["activations"])
        assert ck.step_memory(cfg, 2 * B, T, bf16=True)["activations"] == est["activations"]  # bf16: 2 bytes
    else:  # the PyTorch paths of DDL and Deltaformer keep more: the estimate is a floor, within 2.5x
        assert 1 <= activations / est["activations"] < 2.5, (activations, est["activations"])
