"""Every number train.py reports, computed a second way on a tiny run: tokens/s and the step time (a fake
clock: each optimizer step takes 0.25 s), the ETA, MFU, the memory estimate, the logged losses, the gradient
norm and what AdamW was given. train.py runs in this process (tests/train_inline.py). The multi-rank
throughput and memory lines are checked in tests/test_train.py's gloo runs."""

import json
import math
import os
import re

import pytest
import torch
from train_inline import TINY, run_train, write_shards

import checkpoint as ck
from data.loader import ShardLoader
from model import GPT, GPTConfig


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("data"))


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def unique_params(model):
    """The model's parameters, each storage once (the tied embedding and LM head are one)."""
    return list({p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())


def test_throughput_eta_and_max_seconds_under_a_fake_clock(tmp_path, data_dir, monkeypatch):
    tokens = []  # the tokens of every training forward, counted as the model sees them
    forward = GPT.forward

    def spy(self, idx, targets=None):
        if self.training:
            tokens.append(idx.numel())
        return forward(self, idx, targets)

    monkeypatch.setattr(GPT, "forward", spy)
    out = str(tmp_path / "out")
    args = [
        "--max_iters=10",
        "--max_seconds=1.0",
        "--log_interval=2",
        "--eval_interval=3",
        f"--out_dir={out}",
    ]
    status, stdout, err, ns = run_train(*TINY, f"--data_dir={data_dir}", *args, clock=0.25)
    assert status == 0, err
    records = read_log(out)
    steps = [r for r in records if "train_loss" in r]
    # 1.0 s of training is up after the 4th step (4 x 0.25 s): the run evaluates, checkpoints and stops there
    assert [r["iter"] for r in steps] == [0, 1, 2, 3]
    assert [r["iter"] for r in records if "val_loss" in r] == [0, 3, 4]
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["iter_num"] == 4
    per_step = sum(tokens) / len(steps)  # every rank's rows of every micro-step: 2 x 4 rows of 16 tokens
    assert per_step == 2 * 4 * 16
    for r in steps:
        assert r["dt_ms"] == 250.0 and r["tok_per_s"] == per_step / 0.25 and r["mfu"] is None  # no GPU peak
    printed = [line for line in stdout.splitlines() if line.startswith("iter ")]
    assert [line.split(":")[0] for line in printed] == ["iter 0", "iter 2"]  # log_interval=2
    assert all(", 512 tok/s, mfu -, 250 ms, eta " in line for line in printed), printed
    # the ETA: the iterations left (10 - 2 - 1, max_iters before time ran out) x 0.25 s; none before iter 2
    assert printed[0].endswith("eta -") and printed[1].endswith("eta 0:00:01"), printed
    assert "1 rank(s) on cpu, 2 micro-steps of 4 x 16 per rank, 128 tokens per iteration" in stdout

    # the memory line: weights, gradients and AdamW's two moments (fp32) of the parameters counted here,
    # the logits (their values, log-probabilities and gradient: 3 fp32 per token and vocabulary entry)
    n = sum(p.numel() for p in unique_params(ns["raw_model"]))
    parts = (
        r"a step needs ~(.+) \(estimated: weights, gradients and AdamW (.+), activations (.+), logits (.+)\)"
    )
    total, static, activations, logits = re.search(parts, stdout).groups()
    assert static == ck.size_text(4 * n + 4 * n + 8 * n) and logits == ck.size_text(4 * 16 * 64 * 3 * 4)
    est = ck.step_memory(GPTConfig(**ns["model_args"]), 4, 16, bf16=False)
    assert activations == ck.size_text(est["activations"])  # (against the tensors kept: test_train.py)
    assert total == ck.size_text(16 * n + est["activations"] + 4 * 16 * 64 * 3 * 4)


@pytest.mark.parametrize("variant", [{}, dict(residual="ddl-cc", attention="deltaformer")])
def test_memory_estimate_of_weights_gradients_and_adamw_is_what_a_step_allocates(variant):
    cfg = GPTConfig(n_layer=2, n_head=2, head_dim=16, n_embd=32, block_size=16, vocab_size=64, **variant)
    model = GPT(cfg)
    params = [p for p in model.parameters() if p.requires_grad]  # train.py's two groups
    groups = [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    idx = torch.randint(0, 64, (2, 16))
    model(idx, idx)[1].backward()
    optimizer.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    weights = nbytes(unique_params(model))
    gradients = nbytes(p.grad for p in unique_params(model))
    moments = nbytes(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    est = ck.step_memory(cfg, 2, 16, bf16=False)
    assert (est["weights"], est["gradients"], est["optimizer"]) == (weights, gradients, moments)
    assert ck.step_memory(cfg, 2, 16, bf16=False, ddp=True)["gradients"] == 2 * gradients  # DDP's buckets


def mean_loss(model, loader, steps, rows):
    """The mean cross-entropy over every target of global batches `steps` (rows each), in float64."""
    total, count = 0.0, 0
    for step in steps:
        x, y = loader.get_batch(step, 0, rows, rows)
        logits = model(x, y)[0].double()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def test_logged_losses_and_adam_moments_recomputed(tmp_path, data_dir):
    # seed, eval_iters and betas set away from their defaults: each is seen in what is recomputed
    out = str(tmp_path / "out")
    args = ["--max_iters=1", "--eval_interval=1", "--eval_iters=3", "--seed=5", "--betas=(0.8, 0.99)"]
    status, _, err, ns = run_train(
        *TINY, f"--data_dir={data_dir}", *args, "--grad_clip=0", f"--out_dir={out}"
    )
    assert status == 0, err
    records = read_log(out)
    val = {r["iter"]: r["val_loss"] for r in records if "val_loss" in r}
    (step,) = [r for r in records if "train_loss" in r]
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)

    torch.manual_seed(5)  # the seed: the initial weights, and the order of the data below
    initial = GPT(GPTConfig(**ckpt["model_args"]))
    train = ShardLoader([os.path.join(data_dir, "train.bin")], 16, seed=5)
    valid = ShardLoader([os.path.join(data_dir, "val.bin")], 16, seed=5)
    with torch.no_grad():
        assert val[0] == pytest.approx(mean_loss(initial, valid, range(3), 8), rel=1e-6)
    x, y = train.get_batch(0, 0, 8, 8)  # the global batch of iteration 0: 2 micro-steps of 4 rows
    loss = initial(x, y)[1]
    assert step["train_loss"] == pytest.approx(loss.item(), rel=1e-6)
    loss.backward()
    params = [p for p in initial.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.dim() >= 2] + [p.grad for p in params if p.dim() < 2]  # its groups
    assert step["grad_norm"] == pytest.approx(math.sqrt(sum(g.pow(2).sum().item() for g in grads)), rel=1e-5)
    state = ckpt["optimizer"]["state"]
    for i, g in enumerate(grads):  # one step from zero moments: m = (1 - beta1) g, v = (1 - beta2) g^2
        torch.testing.assert_close(state[i]["exp_avg"], 0.2 * g, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(state[i]["exp_avg_sq"], 0.01 * g * g, rtol=1e-4, atol=1e-12)

    final = GPT(GPTConfig(**ckpt["model_args"]))
    final.load_state_dict(ckpt["model"])
    with torch.no_grad():
        assert val[1] == pytest.approx(mean_loss(final, valid, range(3), 8), rel=1e-6)
    assert ckpt["best_val_loss"] == min(val.values())


@pytest.mark.gpu
def test_mfu_against_counted_flops_on_a_gpu(tmp_path, data_dir):
    # MFU = FLOPs per token x tokens/s / the GPU's bf16 dense peak; the FLOPs counted by torch's
    # FlopCounterMode on one forward + backward (every matmul) plus 6 per parameter no matmul sees
    from test_model import counted_step_flops

    out = str(tmp_path / "out")
    args = ["--device=cuda", "--dtype=bfloat16", "--max_iters=3", f"--out_dir={out}"]
    status, _, err, ns = run_train(*TINY, f"--data_dir={data_dir}", *args, clock=0.25)
    assert status == 0, err
    torch.manual_seed(0)
    model = GPT(GPTConfig(**ns["model_args"]))
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    flops = counted_step_flops(model, 2, 16) / (2 * 16) + 6 * vectors
    name = torch.cuda.get_device_name()
    peak = next((f for k, f in (("H100", 989e12), ("H200", 989e12), ("A100", 312e12)) if k in name), None)
    for r in (r for r in read_log(out) if "train_loss" in r):
        assert r["tok_per_s"] == 2 * 4 * 16 / 0.25
        if peak is None:
            assert r["mfu"] is None, name
        else:
            assert r["mfu"] == pytest.approx(flops * r["tok_per_s"] / peak, rel=1e-12)
