"""Inference speed of every residual x attention variant against additive + softmax attention of the same
size in the same run: forward-only throughput, and decoding by sample.generate.

    python bench/bench_infer.py --parallel 3     # both sections, every variant (decode: gpt2-small)
    python bench/bench_infer.py --sections decode --decode-modes cache,compiled --decode-batches 1

forward: no grad, bf16 autocast, the whole model compiled (static shapes), B x --seq random tokens, the
logits of every position (as scoring a text), the largest micro-batch of --batches that fits; the median
of --steps calls after --warmup. decode: sample.generate, greedy, bf16 autocast, a random prompt of --prompt
tokens then --new tokens, at each of --decode-batches, in each of --decode-modes (generate's decode); the
time from the prompt's pass to the last token, the median of 3 runs (1-2 where runs take over 2 s in all)
after a short warm-up (where "compiled" compiles). "none" (a forward over the whole sequence per token)
makes --none-new tokens only. Cache KB, per sequence: per token of what grows (keys and values, or u's),
and the fixed TC and EC histories.

Each (section, model, variant) runs in a fresh process, additive first; --parallel N runs N at a time on
their shares of the CPU cores, their timed parts taking turns on the GPU while the others compile
(common.run_rows). --time-limit bounds the run (a row 300 s at most); the tables are saved after each row.
"""

import collections
import dataclasses
import statistics
import sys
import traceback

import common  # bench/common.py
import torch

PEAK_TFLOPS = 989.0  # for the forward's MFU: H100/H200 dense bf16
JOB_TIMEOUT = 300  # seconds for one row
VARIANTS = {
    **{r: dict(residual=r) for r in ("additive", "ddl", "ddl-cc", "ddl-tc")},
    **{f"{r}-noec": dict(residual=r, ddl_ec=False) for r in ("ddl-cc", "ddl-tc")},  # without EC
    "additive+deltaformer": dict(residual="additive", attention="deltaformer"),
    "additive+deltaformer-relu": dict(attention="deltaformer", deltaformer_kernel="relu"),
    "additive+deltaformer-linear": dict(attention="deltaformer", deltaformer_kernel="linear"),
    "ddl-cc+deltaformer": dict(residual="ddl-cc", attention="deltaformer"),
}


def decode_ops(model, prompt):
    """The ATen ops (a Counter by name) that one token decoded by sample.generate (decode="cache", greedy)
    dispatches: those of generate(prompt, 2) less those of generate(prompt, 1), after a warm-up call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sample import generate

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    counts = []
    generate(model, prompt, 2, top_k=1, decode="cache")
    for n in (1, 2):
        seen = collections.Counter()
        with Ops():
            generate(model, prompt, n, top_k=1, decode="cache")
        counts.append(seen)
    return difference(*counts)


def ops_per_layer(make, prompt):
    """decode_ops per block: make(n_layer) builds the model; the ops of 2 blocks less those of 1, so the
    work outside the blocks (embedding, final norm, LM head, sampling) cancels."""
    return difference(*(decode_ops(make(n), prompt) for n in (1, 2)))


def difference(a, b):
    """b - a of two Counters, negative counts kept (Counter's own - drops them), zeros dropped."""
    return collections.Counter({k: b[k] - a[k] for k in a.keys() | b.keys() if b[k] != a[k]})


def forward_row(model, cfg, args, row):
    """Forward-only throughput at the largest micro-batch that fits; fills row."""
    cuda = args.device == "cuda"
    logits = lambda idx: model.lm_head(model.hidden_states(idx))  # noqa: E731

    def at(B):
        fwd = torch.compile(logits, dynamic=False) if args.compile else logits
        idx = torch.randint(0, cfg.vocab_size, (B, args.seq), device=args.device)
        with common.Span() as first:  # compiles
            fwd(idx)
        print(row["model"], row["variant"], f"B {B}: first call {first.seconds:.1f} s", file=sys.stderr)
        with common.gpu_turn():
            for _ in range(args.warmup):
                fwd(idx)
            torch.cuda.reset_peak_memory_stats() if cuda else None
            times = []
            for _ in range(args.steps):
                with common.Span(cuda) as s:
                    fwd(idx)
                times.append(s.seconds)
        step = statistics.median(times)
        row.update(batch=B, step_ms=step * 1e3, tok_s=B * args.seq / step, compile_s=round(first.seconds, 1),
                   peak_GB=torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"))  # fmt: skip
        row["mfu"] = row["tok_s"] * model.flops_per_token(args.seq) / 3 / PEAK_TFLOPS / 1e12

    common.largest_batch(args.batches, row, at)


def decode_row(model, cfg, args, row):
    """Each batch x decode mode: tokens/s of sample.generate; fills row["decode"] with one entry each."""
    from cache import Cache
    from model import GPT
    from sample import generate

    cuda, row["decode"] = args.device == "cuda", []
    make = lambda n: GPT(dataclasses.replace(cfg, n_layer=n)).to(args.device).eval()  # noqa: E731
    ops = ops_per_layer(make, torch.randint(0, cfg.vocab_size, (1, 4), device=args.device))
    row["ops_layer"], row["ops_layer_by_op"] = sum(ops.values()), dict(ops.most_common())
    for B in args.decode_batches:
        prompt = torch.randint(0, cfg.vocab_size, (B, args.prompt), device=args.device)
        cache = Cache()  # after the prompt: its tuples grow with the tokens (keys and values, or u's), its
        model.hidden_states(prompt, cache)  # tensors do not (the last inputs of the causal convs)
        kb = [sum(t.nbytes for t in v) / args.prompt for v in cache.store.values() if isinstance(v, tuple)]
        fixed = [v.nbytes for v in cache.store.values() if not isinstance(v, tuple)]
        for mode in args.decode_modes:
            new = args.none_new if mode == "none" else args.new
            row["decode"].append(r := dict(batch=B, mode=mode, new=new, kb_token=sum(kb) / B / 1e3))
            r["kb_fixed"] = sum(fixed) / B / 1e3
            try:
                with common.Span() as first:  # compiled: compiles, then records the CUDA graphs
                    generate(model, prompt, min(new, 8), top_k=1, decode=mode)
                r["first_s"] = round(first.seconds, 1)
                with common.gpu_turn():
                    if cuda:  # none of the warm-up still queued (the clock starts with this mode's work)
                        torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats()
                    times = []
                    while len(times) < 3 and sum(times) < 2:  # a slow (eager) mode: one or two runs
                        with common.Span(cuda) as s:
                            out = generate(model, prompt, new, top_k=1, decode=mode)
                        times.append(s.seconds)
                assert out.shape == (B, args.prompt + new), out.shape
                seconds = statistics.median(times)
                peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
                r.update(tok_s=B * new / seconds, ms_token=seconds / new * 1e3, runs=len(times), peak_GB=peak)
                r["cudagraph_skips"] = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]  # so far
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()


def worker(job, row):
    """One row in a fresh process (common.job_main): the model, then its section's measurements."""
    args = job["args"]
    model, cfg = common.gpt(args, row["model"], VARIANTS[row["variant"]])
    model.eval()
    row["params_M"] = model.num_params() / 1e6
    with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
        (forward_row if row["section"] == "forward" else decode_row)(model, cfg, args, row)


def tables(rows):
    """The forward rows' table (common.throughput_table), then the decode rows', one line per (model,
    variant, batch, mode): tokens/s against additive (the same model, batch and mode) and against the modes
    "cache" and "none" of the same variant; on the "cache" lines, the ATen ops one eager decoded token
    dispatches per layer (ops_per_layer: batch 1, the run's device and autocast)."""
    runs = {(r["model"], r["variant"], d["batch"], d["mode"]): d for r in rows for d in r.get("decode", [])}
    ops = {(r["model"], r["variant"]): r.get("ops_layer", "?") for r in rows if r["section"] == "decode"}
    cells = []
    for (m, v, B, mode), d in runs.items():
        if "tok_s" not in d:
            cells.append([m, v, B, mode, f"not measured: {d.get('error', '?')}"] + [""] * 10)
            continue
        against = [runs.get(key) for key in ((m, "additive", B, mode), (m, v, B, "cache"), (m, v, B, "none"))]
        ratios = [f"{d['tok_s'] / b['tok_s']:.3f}" if b and "tok_s" in b else "-" for b in against]
        cells.append([m, v, B, mode, d["new"], f"{d['tok_s']:,.1f}", *ratios, f"{d['ms_token']:.2f}"])
        cells[-1] += [f"{d['peak_GB']:.2f}", f"{d['kb_token']:.1f}", f"{d['kb_fixed']:.1f}", d["first_s"]]
        cells[-1].append(ops[m, v] if mode == "cache" else "")
    for r in (r for r in rows if r["section"] == "decode" and "decode" not in r):  # no decode results
        cells.append([r["model"], r["variant"], "", "", f"not measured: {r.get('error', '?')}"] + [""] * 10)
    head = ["model", "variant", "batch", "decode", "new tokens", "tokens/s", "×additive", "×cache", "×none"]
    head += ["ms/token", "peak GB", "cache KB/token", "fixed KB", "first call s", "ops/token/layer"]
    forward = common.throughput_table([r for r in rows if r["section"] == "forward"], ms="ms")
    decode = "\n".join(common.markdown(head, cells, ["---"] * 4 + ["---:"] * 11))
    return ["Forward:", "", forward, "", "Decode:", "", decode]


def main():
    p = common.row_parser(__doc__, VARIANTS)
    p.add_argument("--sections", default="forward,decode", help="forward, decode, or both (in this order)")
    p.add_argument("--decode-models", default="gpt2-small")
    p.add_argument("--decode-batches", default="1,32")
    p.add_argument("--decode-modes", default="cache,compiled,none", help="sample.generate's decode values")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=512, help="new tokens")
    p.add_argument("--none-new", type=int, default=64, help="new tokens of the mode 'none' (no cache)")
    p.add_argument("--parallel", type=int, default=1, help="rows at a time (their timed parts take turns)")
    if common.job_main(worker):
        return
    args = common.parse_row_flags(p, __file__, VARIANTS)
    from sample import DECODES

    lists = (args.sections, args.decode_models, args.decode_modes)
    args.sections, args.decode_models, args.decode_modes = ([x for x in a.split(",") if x] for a in lists)
    args.decode_batches = common.positive_ints(args.decode_batches, "--decode-batches", "1,32")[::-1]
    for flag, values, allowed in (("--sections", args.sections, ("forward", "decode")),
                                  ("--decode-modes", args.decode_modes, DECODES)):  # fmt: skip
        if not values or any(v not in allowed for v in values):
            raise SystemExit(f"{flag}: expected some of {', '.join(allowed)}, got {','.join(values)!r}")
    if not (args.prompt >= 1 and args.new >= 1 and args.none_new >= 1 and args.prompt + args.new <= args.seq):
        raise SystemExit(f"--prompt, --new, --none-new: >= 1, with prompt + new <= --seq {args.seq}")
    if args.parallel < 1:
        raise SystemExit(f"--parallel {args.parallel}: expected a positive number of rows at a time")
    models = dict(forward=args.models, decode=args.decode_models)
    specs = [dict(row=dict(section=s, model=m, variant=v)) for s in args.sections for m in models[s]
             for v in args.variants]  # fmt: skip
    compiled = "torch.compile (whole model, static shapes)" if args.compile else "eager"
    settings = (f"forward: B x {args.seq} random tokens, logits of every position, no grad, bf16 autocast, "
                f"{compiled}; {args.warmup} warm-up and {args.steps} timed calls, their median; MFU = "
                f"tokens/s x GPT.flops_per_token / 3 / {PEAK_TFLOPS:g} TFLOP/s. decode: sample.generate, "
                f"greedy, bf16 autocast, a prompt of {args.prompt} random tokens, then {args.new} new tokens "
                f"('none': {args.none_new}); tokens/s = batch x new tokens / the time from the prompt's pass "
                "to the last token (median of up to 3 runs). ×additive: against additive + softmax of the "
                "same model in this run")  # fmt: skip
    common.run_rows(args, __file__, specs, settings, tables, JOB_TIMEOUT, args.parallel)


if __name__ == "__main__":
    main()
