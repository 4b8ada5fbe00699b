"""Training throughput of every residual x attention variant: tokens/s, step time, peak memory and MFU,
each against additive + softmax attention of the same size measured in the same run.

    python bench/bench_train.py --models gpt2-small --batches 32 --variants additive,ddl-cc
    python bench/bench_train.py ... --accum 8        # 8 micro-batches an optimizer step, as train.py
    python bench/bench_train.py ... --profile        # + where one step's GPU and host time go
    python bench/bench_train.py ... --nanogpt ../nanoGPT/model.py   # + nanoGPT's GPT, timed the same way
    python bench/bench_train.py ... --against ../other-checkout      # + each variant on that tree's model
    python bench/bench_train.py ... --doc-mask      # + each variant with GPTConfig.doc_mask, on documents

additive is always run (added to --variants when missing): every ratio is against it. Each (model, variant)
runs in a fresh process, one after another: bf16 autocast, torch.compile with static shapes, fused AdamW,
random tokens, the largest micro-batch of --batches that fits. Step time: the timed steps' median on the
GPU's clock; compile time: the first step; MFU = tokens/s * GPT.flops_per_token / 989 TFLOP/s (H100/H200
dense bf16); host_ms: the host's median time to issue the forward, backward and optimizer, then to wait for
the GPU (near 0: the host sets the step time). --time-limit bounds the run (a job 420 s at most).

--doc-mask: each variant also runs with GPTConfig.doc_mask (row VARIANT+doc_mask, right after VARIANT's;
its ×additive against additive+doc_mask), and every row's batches are documents, the same tokens in every
row: EOT (50256) at each document's start, the other tokens drawn uniformly below it; a document starts at
each position with probability 1/512 (seeded), so lengths are geometric with mean 512 tokens and a row
starts mid-document, as a window of the shards does. ×unmasked: the masked row's tokens/s over the same
variant's unmasked row's, in this run.
"""

import os
import runpy
import statistics
import sys
import time

import common  # bench/common.py
import torch

PEAK_TFLOPS = 989.0  # for MFU: H100/H200 dense bf16
JOB_TIMEOUT = 420  # seconds for one (model, variant)
DOC_LEN = 512  # --doc-mask: the documents' mean length in tokens (geometric)
EOT = 50256  # model.EOT, which starts a document; not imported: a row of --against imports its own model.py
VARIANTS = {
    **{r: dict(residual=r) for r in ("additive", "ddl", "ddl-tc", "ddl-cc")},
    # one state per block kept for the backward (GPTConfig.ddl_keep_state_every; the default keeps fewer)
    **{f"{r}+keep1": dict(residual=r, ddl_keep_state_every=1) for r in ("ddl-cc", "ddl-tc")},
    "ddl-cc-bf16": dict(residual="ddl-cc", ddl_state_dtype="bfloat16"),  # the state stored in bf16
    "ddl-cc-bf16-sr": dict(residual="ddl-cc", ddl_state_dtype="bfloat16", ddl_state_rounding="stochastic"),
    "additive+deltaformer": dict(residual="additive", attention="deltaformer"),
    "nanogpt": None,  # nanoGPT's own GPT (its model.py, given by --nanogpt) at the preset's depth and width
}


def micro_batches(gen, accum, B, T, vocab, doc_len=0):
    """accum (idx, tgt) pairs [B, T] of random tokens from the generator gen (on their device), tgt the
    tokens after idx's (as the loader's). doc_len: documents of mean length doc_len, EOT first (docstring
    above); 0: tokens drawn uniformly below vocab."""
    x = torch.randint(0, min(vocab, EOT) if doc_len else vocab, (accum, B, T + 1), generator=gen,
                      device=gen.device)  # fmt: skip
    if doc_len:  # a start at each position with probability 1/doc_len: geometric lengths of that mean
        x = x.masked_fill(torch.rand(x.shape, generator=gen, device=gen.device) < 1 / doc_len, EOT)
    return [(x[i, :, :-1].contiguous(), x[i, :, 1:].contiguous()) for i in range(accum)]


def train_steps(model, opt, B, T, steps, vocab, device, host=None, accum=1, doc_len=0, gen=None):
    """Run `steps` optimizer steps of `accum` micro-batches (gradient accumulation, as train.py) on random
    tokens (micro_batches; gen: their generator, default one seeded 0); return each step's seconds on the
    device's clock (Span). host: a list to append, per step, the host's seconds to issue the forwards, the
    backwards and the optimizer, and then to wait for the GPU (a step whose host never waits is bound by
    the host)."""
    times, gen = [], torch.Generator(device).manual_seed(0) if gen is None else gen
    for _ in range(steps):
        batches = micro_batches(gen, accum, B, T, vocab, doc_len)
        with common.Span(cuda=device == "cuda") as step:
            # the host's marks (part, its end); parts: 0 forward, 1 backward, 2 optimizer, 3 wait for the GPU
            marks = [(None, time.perf_counter())]
            for idx, tgt in batches:  # the host runs ahead of the GPU from one micro-batch into the next
                with torch.autocast(device, dtype=torch.bfloat16):
                    _, loss = model(idx, tgt)
                marks.append((0, time.perf_counter()))
                (loss / accum).backward()
                marks.append((1, time.perf_counter()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            marks.append((2, time.perf_counter()))
        times.append(step.seconds)
        marks.append((3, time.perf_counter()))
        if host is not None:  # each interval between marks goes to the part that ends it
            host.append([sum(b - a for (_, a), (p, b) in zip(marks, marks[1:]) if p == i) for i in range(4)])
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()}")
    return times


def measure(model, cfg, B, args, row):
    """Compile at micro-batch B (static shapes), warm up and time; fills row. Raises
    torch.OutOfMemoryError."""
    compiled = torch.compile(model, dynamic=False) if args.compile else model
    device, cuda = args.device, torch.cuda.is_available()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device == "cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    # the batches' own generator: every row sees the same tokens, whatever its model's init drew
    gen, doc_len = torch.Generator(device).manual_seed(0), DOC_LEN if args.doc_mask else 0

    def run(n, host=None):  # n steps at this micro-batch
        return train_steps(compiled, opt, B, args.seq, n, cfg.vocab_size, device, host, args.accum, doc_len,
                           gen)  # fmt: skip

    with common.Span() as first:
        run(1)
    row["compile_s"] = round(first.seconds, 1)  # the first step: compile (forward and backward) + 1 step
    # a row prints nothing until it ends: say where a slow one is
    print(row["model"], row["variant"], f"micro-batch {B}: first step {row['compile_s']} s", file=sys.stderr)
    with common.Span() as warm:
        run(max(args.warmup - 1, 0))
    row["warmup_s"] = round(warm.seconds, 1)
    times = run(args.steps, host := [])
    step = statistics.median(times)
    # the host's median seconds to issue the forward, the backward and the optimizer, and to wait for the GPU
    row["host_ms"] = [round(statistics.median(part) * 1e3, 2) for part in zip(*host)]
    tok_s = B * args.accum * args.seq / step
    row.update(batch=B, step_ms=step * 1e3, tok_s=tok_s, step_ms_min=min(times) * 1e3,
               step_ms_max=max(times) * 1e3, mfu=tok_s * model.flops_per_token(args.seq) / PEAK_TFLOPS / 1e12,
               peak_GB=torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"))  # fmt: skip
    if args.profile:
        profile_step(run, B, args, row)


def profile_step(run, B, args, row):
    """torch.profiler over --profile-steps training steps (run(n): n of them): the time by kind (kernel_kind),
    the top GPU kernels and the top host ops by self CPU time (ms/step, calls/step). Printed, and kept in the
    row (profile_kinds_ms, profile_top, profile_host_top) of bench_train.json."""
    n, top = args.profile_steps, args.profile_top
    # the host's ops: where the CPU time goes, for steps whose GPU sits idle between kernels (timed step >
    # kernels busy): what launches them is then the bound
    kernels, host = common.profiled(lambda: run(n), cuda=args.device == "cuda")
    total, kinds = sum(us for _, us, _ in kernels) or 1.0, {}
    for name, us, _ in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    fwd, bwd, optim, wait = row["host_ms"]
    per = lambda us: us / 1e3 / n  # noqa: E731  (ms per step)
    lines = [
        f"profile {row['model']} {row['variant']} micro-batch {B}: {n} step(s), kernels busy "
        f"{per(total):.1f} ms/step (timed step {row['step_ms']:.1f} ms); the timed steps' host issued "
        f"the forward, backward and optimizer in {fwd:.1f} + {bwd:.1f} + {optim:.1f} ms, then waited "
        f"{wait:.1f} ms for the GPU (medians)",
        *(f"  {k:40s} {per(us):8.2f} ms/step  {100 * us / total:5.1f}%"
          for k, us in sorted(kinds.items(), key=lambda kv: -kv[1])),
        f"  top {top} kernels (ms/step, share, calls/step, name):",
        *(f"  {per(us):8.3f} {100 * us / total:5.1f}% {c // n:4d}  {k[:150]}" for k, us, c in kernels[:top]),
        f"  host: {per(sum(us for _, us, _ in host)):.1f} ms/step of CPU time in ops (profiled); "
        "the top by self time:",
        *(f"  {per(us):8.3f} {c // n:5d}  {k[:150]}" for k, us, c in host[:top]),
    ]  # fmt: skip
    print("\n".join(lines), flush=True)
    listed = lambda ops: [[k[:200], round(per(us), 3), c // n] for k, us, c in ops[:top]]
    row.update(profile_kinds_ms={k: round(per(us), 3) for k, us in kinds.items()},
               profile_top=listed(kernels), profile_host_top=listed(host))  # fmt: skip


KINDS = [  # (label, substrings of a GPU kernel's lowercased name), the first match wins
    ("DDL kernels", ("_update_", "_cc_", "_tc_", "_ec_")),
    ("Deltaformer kernels", ("deltaformer", "_u_")),
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "cutlass", "sm90", "nvjet", "matmul", "xmma")),
    ("optimizer / grad clip", ("adam", "foreach", "multi_tensor")),
    ("inductor (fused elementwise/reductions)", ()),  # names starting with triton_
    ("copies / fills", ("memcpy", "memset", "copy", "fill")),
    ("eager aten kernels", ("elementwise", "reduce", "softmax", "nll")),
]


def kernel_kind(name):
    """A coarse label for a GPU kernel's name (cuBLAS/CUTLASS GEMMs, flash attention, Triton, ...)."""
    n = name.lower()
    hit = lambda parts: any(p in n for p in parts) or not parts and n.startswith("triton_")  # noqa: E731
    return next((label for label, parts in KINDS if hit(parts)), "other")


def nanogpt_model(path, size, seq, overrides):
    """nanoGPT's GPT from its model.py at `path`, at the preset's depth and width with its own 64-wide
    heads, no biases, vocab 50304 (its GPT-2 124M recipe at gpt2-small); flops_per_token = 6 N + 12 L d T,
    the count of GPT.flops_per_token for a softmax model."""
    from model import PRESETS

    mod = runpy.run_path(path)
    shape = {**PRESETS[size], "vocab_size": 50304, **overrides}
    L, d = shape["n_layer"], shape["n_embd"]
    cfg = mod["GPTConfig"](n_layer=L, n_embd=d, n_head=d // 64, block_size=seq,
                           vocab_size=shape["vocab_size"], dropout=0.0, bias=False)  # fmt: skip
    model = mod["GPT"](cfg)
    n = sum(p.numel() for p in model.parameters())
    model.flops_per_token = lambda T: 6 * n + 12 * L * d * T
    model.num_params = lambda: n
    return model, cfg


def worker(job, row):
    """One (model, variant) in a fresh process (common.job_main): static shapes, compiled at the batch it is
    timed at."""
    args, variant = job["args"], job["variant"]
    if job["against"]:  # the model and kernels of the other checkout
        sys.path.insert(0, args.against)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch._dynamo.config.automatic_dynamic_shapes = False  # a smaller batch after an OOM: static again
    if variant == "nanogpt":
        model, cfg = nanogpt_model(args.nanogpt, row["model"], args.seq, args.model_overrides)
        model = model.to(args.device)
    else:
        overrides = dict(VARIANTS[variant])
        if job["doc_mask"]:  # only when on: a checkout of --against without the field runs its unmasked rows
            overrides["doc_mask"] = True
        model, cfg = common.gpt(args, row["model"], overrides)
    row["params_M"] = model.num_params() / 1e6
    at = lambda B: measure(model, cfg, B, args, row)
    common.largest_batch(args.batches, row, at, reset=lambda: model.zero_grad(set_to_none=True))


def main():
    p = common.row_parser(__doc__, [v for v in VARIANTS if v != "nanogpt"])  # its row: --nanogpt
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient "
                   "accumulation, as train.py: the GPU waits for the host at a step's start)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="after timing each row, profile --profile-steps")
    p.add_argument("--profile-steps", type=int, default=1)
    p.add_argument("--profile-top", type=int, default=30, help="kernels listed by the profile")
    p.add_argument("--nanogpt", default="", help="nanoGPT's model.py: adds the row 'nanogpt', its GPT at the "
                   "same depth and width (64-wide heads), timed like the others")  # fmt: skip
    p.add_argument("--against", default="", help="another checkout: every variant but additive and nanogpt "
                   "also runs on its model.py and ops/, just before this one's: VARIANT@against")  # fmt: skip
    p.add_argument("--doc-mask", action="store_true", help="each variant but nanogpt also with "
                   f"GPTConfig.doc_mask (VARIANT{common.MASKED}); every row's batch: documents")  # fmt: skip
    if common.job_main(worker):  # one row, in its own process
        return
    args = common.parse_row_flags(p, __file__, VARIANTS)
    if args.nanogpt and "nanogpt" not in args.variants:
        args.variants.append("nanogpt")
    if "nanogpt" in args.variants and not os.path.isfile(args.nanogpt):
        raise SystemExit(f"--nanogpt: the row 'nanogpt' needs nanoGPT's model.py, got {args.nanogpt!r}")
    if args.against and not os.path.isfile(os.path.join(args.against, "model.py")):
        raise SystemExit(f"--against: expected a checkout of this repo (its model.py), got {args.against!r}")
    args.against = os.path.abspath(args.against) if args.against else ""
    if args.accum < 1:
        raise SystemExit(f"--accum {args.accum}: expected a positive number of micro-batches")
    from model import GPTConfig  # (here, not at the top: a row of --against imports its own model.py)

    vocab = args.model_overrides.get("vocab_size", GPTConfig.vocab_size)
    if args.doc_mask and vocab <= EOT:
        raise SystemExit(f"--doc-mask: documents start with EOT ({EOT}), which needs vocab_size > {EOT}, "
                         f"got {vocab}")  # fmt: skip
    if args.doc_mask and "doc_mask" in args.model_overrides:  # it would set every row's mask alike
        raise SystemExit("--doc-mask: leave doc_mask out of --model-overrides (the flag sets it per row)")
    # every (model, variant) in a fresh process, one after another, additive first; --doc-mask: its masked
    # row right after; --against: the other checkout's row just before this one's (nanoGPT's model is the
    # same in both, and has no document mask)
    sides = lambda v: (True, False) if args.against and v not in ("additive", "nanogpt") else (False,)
    masks = lambda v: (False, True) if args.doc_mask and v != "nanogpt" else (False,)
    specs = [dict(row=dict(model=m, variant=v + common.MASKED * d + ("@against" if a else "")), variant=v,
                  against=a, doc_mask=d)
             for m in args.models for v in args.variants for d in masks(v) for a in sides(v)]  # fmt: skip
    tables = lambda rows: [common.throughput_table(rows)]
    compiled = "torch.compile (whole model, static shapes)" if args.compile else "eager"
    fused = "fused " if args.device == "cuda" else ""
    tokens = (f"random tokens in documents (EOT first; lengths geometric, mean {DOC_LEN}, seeded: the same "
              "tokens in every row)" if args.doc_mask else "random tokens")  # fmt: skip
    settings = (f"seq {args.seq}, bf16 autocast, {compiled}, {fused}AdamW, {tokens}; {args.warmup} "
                f"warm-up (the first compiles) and {args.steps} timed steps of {args.accum} micro-batch(es), "
                f"step time their median; MFU = tokens/s x GPT.flops_per_token / {PEAK_TFLOPS:g} TFLOP/s; "
                "×additive: against additive + softmax of the same model in this run")  # fmt: skip
    if args.doc_mask:
        settings += (f" (a {common.MASKED} row: against additive{common.MASKED}); ×unmasked: a "
                     f"{common.MASKED} row's tokens/s over the same variant's without the mask")  # fmt: skip
    common.run_rows(args, __file__, specs, settings, tables, JOB_TIMEOUT)


if __name__ == "__main__":
    main()
