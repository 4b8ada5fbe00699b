"""bench/bench_infer.py: a CPU smoke run of the real workers (forward and decode sections), the cache sizes
against their formulas, the tables' ratios and ops per layer against the JSON and a count here, and the
flags' checks. The job queue and the GPU's turns: tests/test_bench_common.py."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import torch

from model import GPT, GPTConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_infer import VARIANTS, ops_per_layer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64)  # head_dim 128 (the preset's), K = 4, d_v = 4


def run(out, *extra):
    overrides = ",".join(f"{k}={v}" for k, v in TINY.items())
    cmd = [
        sys.executable, "bench/bench_infer.py", "--device", "cpu", "--compile", "0", "--models", "gpt2-small",
        "--decode-models", "gpt2-small", "--batches", "2", "--seq", "16", "--warmup", "1", "--steps", "2",
        "--model-overrides", overrides, "--decode-batches", "1,2", "--prompt", "4", "--new", "6",
        "--none-new", "3", "--out", str(out), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)


def cells(text, *first):
    """The cells of the markdown line that starts with the cells `first`."""
    start = "| " + " | ".join(first) + " |"
    line = next(line for line in text.splitlines() if line.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def test_cpu_smoke(tmp_path):
    """Both sections, additive added first, two rows at a time (their rows still in order); every decode mode
    gives tokens/s; the cache's KB per token is the keys and values (bf16 under autocast) of every layer, the
    fixed KB the TC and EC histories (fp32)."""
    out = tmp_path / "out"
    p = run(
        out,
        "--variants",
        "ddl-tc,additive+deltaformer",
        "--decode-modes",
        "cache,static,none",
        "--parallel",
        "2",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run_ = json.loads((out / "bench_infer.json").read_text())
    rows = run_["rows"]
    variants, df = ["additive", "ddl-tc", "additive+deltaformer"], "additive+deltaformer"
    assert [(r["section"], r["variant"]) for r in rows] == [
        (s, v) for s in ("forward", "decode") for v in variants
    ]
    for r in rows[:3]:
        assert "error" not in r and r["tok_s"] > 0 and r["batch"] == 2, r
        assert math.isclose(r["tok_s"], 2 * 16 / (r["step_ms"] / 1e3), rel_tol=1e-9)
    kv = TINY["n_layer"] * 2 * TINY["n_head"] * 128 * 2 / 1e3  # keys and values (Deltaformer: u's), bf16
    d, K, dv = TINY["n_embd"], 4, 4
    histories = (2 * TINY["n_layer"] + 1) * (K - 1) * d * dv * 4 + (K - 1) * d * 4  # TC reads and EC, fp32
    for r in rows[3:]:
        modes = [(B, m) for B in (1, 2) for m in ("cache", "static", "none")]
        assert [(e["batch"], e["mode"]) for e in r["decode"]] == modes
        for e in r["decode"]:
            assert "error" not in e and e["tok_s"] > 0 and e["new"] == (3 if e["mode"] == "none" else 6), e
            assert math.isclose(e["tok_s"] * e["ms_token"] / 1e3, e["batch"]), e  # batch x new / seconds
            assert math.isclose(e["kb_token"], kv), e
            assert math.isclose(e["kb_fixed"], histories / 1e3 if r["variant"] == "ddl-tc" else 0.0), e
    text = (out / "bench_infer.md").read_text()
    assert text.startswith("Command: `python bench/bench_infer.py --device cpu") and run_["versions"] in text
    assert text.strip() in p.stdout  # printed as written
    fwd = cells(text, "gpt2-small", "ddl-tc", "2")
    assert math.isclose(float(fwd[4]), rows[1]["tok_s"] / rows[0]["tok_s"], abs_tol=1e-3)
    by = {(r["variant"], e["batch"], e["mode"]): e for r in rows[3:] for e in r["decode"]}
    dec, e = cells(text, "gpt2-small", df, "2", "static"), by[df, 2, "static"]
    against = [("additive", 2, "static"), (df, 2, "cache"), (df, 2, "none")]
    want = [e["tok_s"] / by[key]["tok_s"] for key in against]  # ×additive, ×cache, ×none
    assert [float(c) for c in dec[6:9]] == [round(w, 3) for w in want], (dec, want)
    # ops per token per layer, on the "cache" lines: those of the worker's model (bf16 autocast), counted here
    for r in rows[3:]:
        cfg = GPTConfig.preset("gpt2-small", block_size=16, **{**VARIANTS[r["variant"]], **TINY})
        make = lambda n, cfg=cfg: GPT(dataclasses.replace(cfg, n_layer=n)).eval()  # noqa: E731
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            ops = ops_per_layer(make, torch.randint(0, 64, (1, 4)))
        assert r["ops_layer"] == sum(ops.values()) == sum(r["ops_layer_by_op"].values()) > 20, r["variant"]
        for B, mode in ((1, "cache"), (2, "cache"), (2, "static")):
            assert cells(text, "gpt2-small", r["variant"], str(B), mode)[14] == (
                str(r["ops_layer"]) if mode == "cache" else ""
            )


def test_flags_are_checked(tmp_path):
    for extra, message in [
        (["--decode-modes", "cache,fast"], "--decode-modes: expected some of cache, static, compiled, none"),
        (["--sections", "train"], "--sections: expected some of forward, decode"),
        (["--new", "13"], "prompt + new <= --seq 16"),
        (["--decode-batches", "0"], "--decode-batches '0': expected positive integers"),
        (["--variants", "ddl-xx"], "--variants: unknown variant 'ddl-xx'"),
        (["--parallel", "0"], "--parallel 0: expected a positive number"),
    ]:
        p = run(tmp_path / "out", *extra)
        assert p.returncode != 0 and message in p.stderr, (extra, p.stderr[-2000:])
