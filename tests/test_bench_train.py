"""bench/bench_train.py: --batches checking, and CPU smoke runs of the real worker (the table, the nanoGPT
row, the profile). The job queue itself: tests/test_bench_common.py."""

import json
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import GPT, GPTConfig  # noqa: E402


def test_batches_must_be_positive_integers():
    for bad in ("64,x", "0"):
        p = subprocess.run([sys.executable, "bench/bench_train.py", "--variants", "ddl", "--batches", bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
        assert p.returncode != 0 and "expected positive integers" in p.stderr, p.stderr[-2000:]


def test_cpu_smoke(tmp_path):
    """The real worker, spawned (CPU device): additive added as the baseline, first, one JSON with both
    rows, and the printed table with the command and versions, also in bench_train.md."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "bench/bench_train.py", "--device", "cpu", "--compile", "0", "--models", "gpt2-small",
        "--variants", "ddl", "--batches", "2", "--seq", "16",
        "--warmup", "1", "--steps", "1", "--model-overrides", "n_layer=1,n_embd=32,n_head=2,vocab_size=64",
        "--out", str(out),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads((out / "bench_train.json").read_text())
    assert [r["variant"] for r in run["rows"]] == ["additive", "ddl"]  # the baseline, always in the run
    tiny = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    for r in run["rows"]:
        assert r["tok_s"] > 0 and r["batch"] == 2 and "error" not in r, r
        with torch.device("meta"):  # MFU from the model's own FLOP count (default peak 989 TFLOP/s)
            model = GPT(GPTConfig.preset("gpt2-small", residual=r["variant"], **tiny))
        assert math.isclose(r["mfu"], r["tok_s"] * model.flops_per_token(16) / 989e12, rel_tol=1e-9), r
    text = (out / "bench_train.md").read_text()
    assert text.startswith("Command: `python bench/bench_train.py --device cpu")
    assert run["versions"] in text and "torch " in run["versions"]
    assert "| gpt2-small | additive | 2 |" in text and "| 1.000 |" in text
    ddl_row = next(line for line in text.splitlines() if line.startswith("| gpt2-small | ddl | 2 |"))
    ratio = ddl_row.split("|")[5].strip()  # tokens/s against the additive row above, as printed
    assert ratio == f"{run['rows'][1]['tok_s'] / run['rows'][0]['tok_s']:.3f}", (ratio, run["rows"])
    assert text.strip() in p.stdout  # printed as written


def test_against_runs_each_variant_on_the_other_checkout_first(tmp_path):
    """--against DIR: every variant but additive also on DIR's model.py and ops/ (a copy whose GPT counts
    7M parameters), just before this tree's; one additive baseline; a DIR without model.py is refused."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(os.path.join(ROOT, "ops"), other / "ops")
    text = open(os.path.join(ROOT, "model.py")).read()
    (other / "model.py").write_text(text + "\nGPT.num_params = lambda self, non_embedding=False: 7e6\n")
    cmd = [
        sys.executable, "bench/bench_train.py", "--device", "cpu", "--compile", "0", "--models", "gpt2-small",
        "--variants", "ddl", "--batches", "2", "--seq", "16", "--warmup", "1", "--steps", "1",
        "--model-overrides", "n_layer=1,n_embd=32,n_head=2,vocab_size=64", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    p = subprocess.run(
        cmd + ["--against", str(other)], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "bench_train.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["additive", "ddl@against", "ddl"]
    assert rows[1]["params_M"] == 7.0 and rows[0]["params_M"] != 7.0 and rows[2]["params_M"] != 7.0, rows
    assert all(r["tok_s"] > 0 and "error" not in r for r in rows), rows
    p = subprocess.run(
        cmd + ["--against", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert p.returncode != 0 and "--against: expected a checkout" in p.stderr, p.stderr[-2000:]


NANOGPT_STANDIN = """
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:  # the fields of nanoGPT's GPTConfig
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):  # nanoGPT's interface: GPT(config), forward(idx, targets) -> (logits, loss)
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0 and not config.bias and config.dropout == 0.0
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        d = config.n_embd
        self.h = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        for layer in self.h:
            x = x + layer(x)
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
"""


def test_cpu_smoke_nanogpt_row(tmp_path):
    """--nanogpt adds the row 'nanogpt': nanoGPT's GPT (here a stand-in with its interface) built at the
    preset's depth and width with 64-wide heads, timed like the others, MFU from 6 N + 12 L d T."""
    (tmp_path / "nanogpt_model.py").write_text(NANOGPT_STANDIN)
    out = tmp_path / "out"
    cmd = [
        sys.executable, "bench/bench_train.py", "--device", "cpu", "--compile", "0", "--models", "gpt2-small",
        "--variants", "additive", "--batches", "2", "--seq", "16", "--warmup", "1", "--steps", "1",
        "--model-overrides", "n_layer=2,n_embd=128,n_head=2,vocab_size=64",
        "--nanogpt", str(tmp_path / "nanogpt_model.py"), "--out", str(out),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((out / "bench_train.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["additive", "nanogpt"]
    nano = rows[1]
    assert "error" not in nano and nano["tok_s"] > 0, nano
    n = 64 * 128 + 2 * 128 * 128  # tied embedding + two layers of the stand-in
    assert math.isclose(nano["params_M"], n / 1e6) and math.isclose(
        nano["mfu"], nano["tok_s"] * (6 * n + 12 * 2 * 128 * 16) / 989e12, rel_tol=1e-9
    )
    assert "| gpt2-small | nanogpt | 2 |" in (out / "bench_train.md").read_text()
    bad = subprocess.run(
        cmd[:-4] + ["--nanogpt", str(tmp_path / "missing.py")], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode != 0 and "--nanogpt" in bad.stderr


def test_cpu_smoke_profile(tmp_path):
    """--profile on the CPU device: the row keeps the op times by kind, the host's top ops by self CPU time
    and its time to issue each part of a step, and the printed profile lists them per step."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "bench/bench_train.py", "--device", "cpu", "--compile", "0", "--models", "gpt2-small",
        "--variants", "additive", "--batches", "2", "--seq", "16", "--warmup", "1", "--steps", "1",
        "--profile", "--profile-steps", "2", "--profile-top", "5",
        "--model-overrides", "n_layer=1,n_embd=32,n_head=2,vocab_size=64", "--out", str(out),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = json.loads((out / "bench_train.json").read_text())["rows"]
    host = row["profile_host_top"]
    assert len(host) == 5 and all(ms > 0 and calls >= 1 for _, ms, calls in host), host
    assert [ms for _, ms, _ in host] == sorted((ms for _, ms, _ in host), reverse=True)
    assert any(name.startswith("aten::") for name, _, _ in host), host
    assert "host: " in p.stdout and "ms/step of CPU time in ops" in p.stdout
    # the host's time to issue the timed step's forward, backward and optimizer: on the CPU, the step itself
    fwd, bwd, optim, wait = row["host_ms"]
    assert min(fwd, bwd, optim, wait) >= 0 and fwd > 0 and bwd > 0, row["host_ms"]
    assert math.isclose(fwd + bwd + optim, row["step_ms"], abs_tol=0.05), (row["host_ms"], row["step_ms"])
    assert f"forward, backward and optimizer in {fwd:.1f} + {bwd:.1f} + {optim:.1f} ms" in p.stdout


def test_train_steps_accumulates_the_mean_gradient():
    """--accum: each optimizer step sees the mean of its micro-batches' gradients (loss / accum summed by
    backward, as train.py), and the step count and the host's times are the optimizer's steps."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_train import train_steps

    # loss = w . mean of (idx, targets) / 100: a known gradient, of norm < 1 (the clip leaves it alone)
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.seen = torch.nn.Parameter(torch.zeros(2)), []

        def forward(self, idx, tgt):
            self.seen.append(torch.stack([idx.double().mean(), tgt.double().mean()]))
            return None, (self.w * self.seen[-1].float()).sum() / 100

    class Recorder(torch.optim.SGD):  # records the gradient each step applies
        grads = []

        def step(self):
            self.grads.append(model.w.grad.clone())

    torch.manual_seed(0)
    model, host = Model(), []
    times = train_steps(model, Recorder(model.parameters(), lr=0.0), 3, 5, 2, 50, "cpu", host, accum=4)
    assert len(times) == 2 and len(model.seen) == 8 and len(Recorder.grads) == 2
    for step, grad in enumerate(Recorder.grads):
        expect = torch.stack(model.seen[4 * step : 4 * step + 4]).mean(0).float() / 100
        torch.testing.assert_close(grad, expect)
    assert len(host) == 2 and all(len(h) == 4 and min(h) >= 0 for h in host)


def test_doc_mask_batches_are_documents_of_the_documented_length():
    """--doc-mask's batches: each (idx, tgt) one stream, tgt the tokens after idx's; EOT (model.EOT) at each
    document's start and nowhere else, the other tokens below it; starts at each position with probability
    1/DOC_LEN, so the mean document is DOC_LEN tokens and lengths are geometric (P(length > DOC_LEN) = (1 -
    1/DOC_LEN)^DOC_LEN ~ 1/e); a row may begin mid-document. Without documents: tokens below vocab."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_train

    from model import EOT

    assert bench_train.EOT == EOT and bench_train.DOC_LEN == 512
    gen = torch.Generator().manual_seed(3)
    pairs = bench_train.micro_batches(gen, 8, 32, 1024, 50304, bench_train.DOC_LEN)
    assert len(pairs) == 8 and all(i.shape == t.shape == (32, 1024) for i, t in pairs)
    assert all(torch.equal(i[:, 1:], t[:, :-1]) for i, t in pairs)
    x = torch.cat([torch.cat([i, t[:, -1:]], 1) for i, t in pairs])  # the rows' streams [256, 1025]
    starts = x == EOT
    assert int(x[~starts].max()) < EOT and int(starts.sum()) > 0
    # ~512 starts in 262,400 positions: the mean length within 15% (3.4 standard deviations)
    mean = x.numel() / int(starts.sum())
    assert abs(mean / 512 - 1) < 0.15, mean
    # the rows back to back: one stream of starts (independent per position), the gaps its documents
    gaps = starts.flatten().nonzero().flatten().diff()
    assert abs(float((gaps > 512).double().mean()) - (1 - 1 / 512) ** 512) < 0.08
    assert int(starts[:, 0].sum()) < 8  # a row starts with a document 1 time in 512: 0.5 of 256 rows
    again = bench_train.micro_batches(torch.Generator().manual_seed(3), 8, 32, 1024, 50304, 512)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(pairs, again))  # seeded: the same documents
    plain = bench_train.micro_batches(gen, 2, 4, 16, 64)
    assert all(int(i.max()) < 64 and int(t.max()) < 64 for i, t in plain)


def test_every_row_trains_on_the_same_documents(monkeypatch):
    """measure() draws a row's batches from a generator of its own: two rows (masked and unmasked, whatever
    their models' init drew from the global generator) see the same tokens, with EOTs under --doc-mask; a
    masked tiny GPT trains on them."""
    import argparse

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_train

    class Recorder(torch.nn.Module):  # records what it is fed
        def __init__(self):
            super().__init__()
            self.w, self.seen = torch.nn.Parameter(torch.zeros(1)), []

        def forward(self, idx, tgt):
            self.seen.append((idx.clone(), tgt.clone()))
            return None, self.w.sum() * 0

        def flops_per_token(self, T):
            return 1.0

    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, head_dim=16, block_size=64)
    # (AdamW itself would import torch._dynamo: seconds)
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: torch.optim.SGD(params, lr=0.0))
    fed = []
    for seed, doc_mask in ((1, True), (2, True), (1, False)):
        torch.manual_seed(seed)  # another model init
        args = argparse.Namespace(compile=0, device="cpu", warmup=2, steps=2, seq=64, accum=2, profile=False,
                                  doc_mask=doc_mask)  # fmt: skip
        model = Recorder()
        bench_train.measure(model, cfg, 4, args, dict(model="gpt2-small", variant="x"))
        fed.append(torch.stack([torch.stack(pair) for pair in model.seen]))
    assert fed[0].shape == (8, 2, 4, 64) and torch.equal(fed[0], fed[1])  # 4 steps x 2 micro-batches
    assert int((fed[0] == bench_train.EOT).sum()) > 0 and not torch.equal(fed[0], fed[2])  # plain tokens
    assert not torch.equal(fed[0][:2], fed[0][2:4])  # each step draws its own (steps 0 and 1 here)
    # a masked tiny GPT (vocab 50304: EOT is a token) through the real step
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, head_dim=16, block_size=64, doc_mask=True))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times = bench_train.train_steps(model, opt, 2, 64, 1, model.config.vocab_size, "cpu", doc_len=8)
    assert len(times) == 1 and any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
