"""Training throughput of every residual x attention variant: tokens/s, step time, peak memory and MFU,
each against additive + softmax attention of the same size measured in the same run.

    python bench/bench_train.py                       # gpt2-small and gpt2-medium, every variant
    python bench/bench_train.py --models gpt2-small --variants additive,ddl-cc --batches 64
    python bench/bench_train.py --gpus 0,1 --batches "gpt2-small=64,32;gpt2-medium=32,16"
                                                      # one job per GPU at a time
    CUDA_VISIBLE_DEVICES=1 python bench/bench_train.py --models gpt2-small --variants additive --profile
                                                      # + where one step's GPU and host time go
    python bench/bench_train.py --models gpt2-small --variants additive --nanogpt ../nanoGPT/model.py
                                                      # + nanoGPT's own GPT-2 124M, timed the same way

Variants: additive, ddl (d_v = 1), ddl-tc, ddl-cc (EC on), each with softmax attention, and additive /
ddl-cc with Deltaformer; a "-bf16" suffix (ddl-bf16, ddl-tc-bf16, ddl-cc-bf16, ddl-cc-bf16+deltaformer)
is the same model with the DDL state stored in bf16 (GPTConfig.ddl_state_dtype="bfloat16"); "+keepN" keeps
the DDL state for the backward at every N-th block's input (GPTConfig.ddl_keep_state_every). additive is
always run (added to --variants when missing): every ratio is against it, in the same run. The DDL kernels
alone: bench/bench_ddl.py.

For each (model, variant): bf16 autocast, torch.compile, fused AdamW, seq 1024, random tokens, the largest
micro-batch of --batches that fits (OOM is caught and the next smaller one tried); tokens/s and step time
(median of the timed steps), compile time (the first step) apart from it, peak memory, and
MFU = tokens/s * GPT.flops_per_token(seq) / --peak-tflops. Ratios to additive: tokens/s, and peak memory
where both ran at the same micro-batch (pass --batches 32 to force one).

Each (model, variant) runs in its own fresh process, compiled with static shapes at the batch it is timed
at (a smaller batch after an OOM compiles again): one after another on the caller's GPU, or with --gpus one
process per GPU at a time, from one queue that starts the baselines and the longest jobs first (job_order).
--time-limit bounds the whole run (a job starts only while 30 s are left and is killed when time is up),
--job-timeout one job. Compiling dominates: ~30-50 s per gpt2-small row on an H200.

Prints the command, the GPU and versions, and the table (markdown); with --out also writes
bench_train.json (every row's numbers) and bench_train.md (the printed text) there, updated after each row.
Each row also keeps host_ms: the host's median time to issue a timed step's forward, backward and optimizer,
and then to wait for the GPU (near 0: the host, not the GPU, sets the step time).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from common import atomic_write, versions  # noqa: E402  (bench/common.py, this script's folder)

BF16 = dict(ddl_state_dtype="bfloat16")  # the "-bf16" rows: the DDL state stored in bf16
VARIANTS = {
    "additive": dict(residual="additive"),
    "ddl": dict(residual="ddl"),
    "ddl-bf16": dict(residual="ddl", **BF16),
    "ddl-tc": dict(residual="ddl-tc"),
    "ddl-tc-bf16": dict(residual="ddl-tc", **BF16),
    "ddl-cc": dict(residual="ddl-cc"),
    # the state kept for the backward at every N-th block's input (GPTConfig.ddl_keep_state_every)
    "ddl+keep1": dict(residual="ddl", ddl_keep_state_every=1),
    "ddl-cc+keep1": dict(residual="ddl-cc", ddl_keep_state_every=1),
    "ddl-cc+keep6": dict(residual="ddl-cc", ddl_keep_state_every=6),
    "ddl-tc+keep1": dict(residual="ddl-tc", ddl_keep_state_every=1),
    "ddl-cc-bf16": dict(residual="ddl-cc", **BF16),
    "additive+deltaformer": dict(residual="additive", attention="deltaformer"),
    "ddl-cc+deltaformer": dict(residual="ddl-cc", attention="deltaformer"),
    "ddl-cc-bf16+deltaformer": dict(residual="ddl-cc", attention="deltaformer", **BF16),
    "nanogpt": None,  # nanoGPT's own GPT (its model.py, given by --nanogpt) at the preset's depth and width
}


# ---------------------------------------------------------------------------------------------------------
# One (model, variant): runs in its own process.


def train_steps(model, opt, B, T, steps, vocab, device, host=None):
    """Run `steps` optimizer steps on random tokens; return per-step times (s) measured with CUDA events.
    host: a list to append, per step, the host's seconds to issue the forward, the backward and the
    optimizer, and then to wait for the GPU (a step whose host never waits is bound by the host)."""
    times = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (B, T), device=device)
        tgt = torch.randint(0, vocab, (B, T), device=device)
        cuda = device == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        marks = [time.perf_counter()]
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(marks[-1] - marks[0])
        marks.append(time.perf_counter())
        if host is not None:
            host.append([b - a for a, b in zip(marks, marks[1:])])
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()}")
    return times


def empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gb():
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def measure(model, compiled, cfg, B, args, row):
    """Warm up (compiles at this batch) and time; fills row. Raises torch.OutOfMemoryError."""
    device = args.device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device == "cuda")
    reset_peak()
    t0 = time.time()
    train_steps(compiled, opt, B, args.seq, 1, cfg.vocab_size, device)
    row["compile_s"] = round(time.time() - t0, 1)  # the first step: compile (forward and backward) + 1 step
    # a row prints nothing until it ends: say where a slow one is
    first = f"{row['model']} {row['variant']} micro-batch {B}: first step {row['compile_s']} s"
    print(first, file=sys.stderr)
    t0 = time.time()
    train_steps(compiled, opt, B, args.seq, max(args.warmup - 1, 0), cfg.vocab_size, device)
    row["warmup_s"] = round(time.time() - t0, 1)
    host = []
    times = train_steps(compiled, opt, B, args.seq, args.steps, cfg.vocab_size, device, host)
    step = statistics.median(times)
    # the host's median seconds to issue the forward, the backward and the optimizer, and to wait for the GPU
    row["host_ms"] = [round(statistics.median(part) * 1e3, 2) for part in zip(*host)]
    tok_s = B * args.seq / step
    row.update(
        batch=B,
        step_ms=step * 1e3,
        tok_s=tok_s,
        peak_GB=peak_gb(),
        mfu=tok_s * model.flops_per_token(args.seq) / (args.peak_tflops * 1e12),
        step_ms_min=min(times) * 1e3,
        step_ms_max=max(times) * 1e3,
    )
    if args.profile:
        profile_step(compiled, opt, B, cfg, args, row)


def profile_step(compiled, opt, B, cfg, args, row):
    """torch.profiler over --profile-steps training steps: the top GPU kernels by total time, the time by
    kind (matmul, attention, Triton kernels of Inductor, the DDL kernels, optimizer, other), and the top
    host ops by self CPU time (ms/step, calls/step).
    Printed, and kept in the row (profile_kinds_ms, profile_top, profile_host_top) of bench_train.json."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        train_steps(compiled, opt, B, args.seq, args.profile_steps, cfg.vocab_size, args.device)
    events = prof.key_averages()

    def gpu_us(e):  # the attribute was renamed (cuda -> device) across torch versions; CPU: a smoke test
        names = ("self_device_time_total", "self_cuda_time_total") if args.device == "cuda" else ()
        for name in names + ("self_cpu_time_total",):
            if hasattr(e, name):
                return getattr(e, name)
        return 0.0

    # On the GPU only the kernels themselves (device events): an aten op's self device time repeats the
    # time of the kernels it launched, and Inductor's Triton kernels have no aten op above them.
    from torch.autograd import DeviceType

    device_events = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    kernels = [(e.key, gpu_us(e), e.count) for e in (device_events or events) if gpu_us(e) > 0]
    total = sum(us for _, us, _ in kernels) or 1.0
    kernels.sort(key=lambda r: -r[1])
    kinds = {}
    for name, us, _ in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    n = args.profile_steps
    fwd, bwd, optim, wait = row["host_ms"]
    lines = [
        f"profile {row['model']} {row['variant']} micro-batch {B}: {n} step(s), kernels busy "
        f"{total / 1e3 / n:.1f} ms/step (timed step {row['step_ms']:.1f} ms); the timed steps' host issued "
        f"the forward, backward and optimizer in {fwd:.1f} + {bwd:.1f} + {optim:.1f} ms, then waited "
        f"{wait:.1f} ms for the GPU (medians)"
    ]
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:40s} {us / 1e3 / n:8.2f} ms/step  {100 * us / total:5.1f}%")
    lines.append(f"  top {args.profile_top} kernels (ms/step, share, calls/step, name):")
    for name, us, count in kernels[: args.profile_top]:
        lines.append(f"  {us / 1e3 / n:8.3f} {100 * us / total:5.1f}% {count // n:4d}  {name[:150]}")
    # the host: where the CPU time goes (self time of each op, Python-level ops included), for steps whose
    # GPU sits idle between kernels (timed step > kernels busy): what launches them is then the bound
    host = [
        e for e in events if getattr(e, "device_type", None) != DeviceType.CUDA and e.self_cpu_time_total > 0
    ]
    host.sort(key=lambda e: -e.self_cpu_time_total)
    host_total = sum(e.self_cpu_time_total for e in host)
    lines.append(
        f"  host: {host_total / 1e3 / n:.1f} ms/step of CPU time in ops (profiled); the top by self time:"
    )
    for e in host[: args.profile_top]:
        lines.append(f"  {e.self_cpu_time_total / 1e3 / n:8.3f} {e.count // n:5d}  {e.key[:150]}")
    text = "\n".join(lines)
    print(text, flush=True)
    row["profile_kinds_ms"] = {k: round(us / 1e3 / args.profile_steps, 3) for k, us in kinds.items()}
    row["profile_top"] = [
        [name[:200], round(us / 1e3 / args.profile_steps, 3), count // args.profile_steps]
        for name, us, count in kernels[: args.profile_top]
    ]
    row["profile_host_top"] = [
        [e.key[:200], round(e.self_cpu_time_total / 1e3 / n, 3), e.count // n]
        for e in host[: args.profile_top]
    ]


def kernel_kind(name):
    """A coarse label for a GPU kernel's name (cuBLAS/CUTLASS GEMMs, flash attention, Triton, ...)."""
    n = name.lower()
    if "_update_" in n or "_cc_" in n or "_tc_" in n or "_ec_" in n:
        return "DDL kernels"
    if "deltaformer" in n or "_u_" in n:
        return "Deltaformer kernels"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "matmul" in n or "xmma" in n:
        return "matmul"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer / grad clip"
    if n.startswith("triton_"):
        return "inductor (fused elementwise/reductions)"
    if "memcpy" in n or "memset" in n or "copy" in n or "fill" in n:
        return "copies / fills"
    if "elementwise" in n or "reduce" in n or "softmax" in n or "nll" in n:
        return "eager aten kernels"
    return "other"


def nanogpt_model(path, size, seq, overrides):
    """nanoGPT's GPT from its model.py at `path`, at the preset's depth and width with its own 64-wide
    heads, no biases, vocab 50304 (its GPT-2 124M recipe at gpt2-small); flops_per_token = 6 N + 12 L d T,
    the count of GPT.flops_per_token for a softmax model."""
    import importlib.util

    from model import PRESETS

    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shape = {**PRESETS[size], "vocab_size": 50304, **overrides}
    L, d = shape["n_layer"], shape["n_embd"]
    cfg = mod.GPTConfig(
        n_layer=L, n_embd=d, n_head=d // 64, block_size=seq,
        vocab_size=shape["vocab_size"], dropout=0.0, bias=False,
    )  # fmt: skip
    model = mod.GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.flops_per_token = lambda T: 6 * n + 12 * L * d * T
    model.num_params = lambda: n
    return model, cfg


def worker(job, results):
    """One (model, variant) in a fresh process: static shapes, compiled at the batch it is timed at."""
    name, size, overrides, args = job["variant"], job["model"], job["overrides"], job["args"]
    row = dict(model=size, variant=name)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch._dynamo.config.automatic_dynamic_shapes = False  # a smaller batch after an OOM: static again
    try:
        from kernels.common import set_auto_backend
        from model import GPT, GPTConfig

        if args.ddl_backend != "auto":
            set_auto_backend(args.ddl_backend)
        torch.manual_seed(0)
        if name == "nanogpt":
            if args.compile and args.compile_scope != "model":
                raise ValueError("the nanogpt row compiles the whole model (--compile-scope model)")
            model, cfg = nanogpt_model(args.nanogpt, size, args.seq, args.model_overrides)
            model = model.to(args.device)
        else:
            cfg = GPTConfig.preset(size, block_size=args.seq, **overrides, **args.model_overrides)
            model = GPT(cfg).to(args.device)
        row["params_M"] = model.num_params() / 1e6
        for B in job["batches"]:
            compiled = model
            if args.compile and args.compile_scope == "model":
                compiled = torch.compile(model, dynamic=False)
            elif args.compile:  # regional: each Block (one compile serves all, they share code) + the loss
                for block in model.blocks:
                    block.compile(dynamic=False)
                model.logits_and_loss = torch.compile(GPT.logits_and_loss.__get__(model), dynamic=False)
            try:
                measure(model, compiled, cfg, B, args, row)
                break
            except torch.OutOfMemoryError:
                row.setdefault("oom_batches", []).append(B)
            except Exception as e:
                if not args.compile or "compile_error" in row:
                    raise
                # a variant torch.compile cannot handle is measured eagerly rather than not at all
                row["compile_error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
                args.compile = 0
                for block in model.blocks:
                    block._compiled_call_impl = None  # undo Module.compile
                model.__dict__.pop("logits_and_loss", None)
                try:
                    measure(model, model, cfg, B, args, row)
                    break
                except torch.OutOfMemoryError:
                    row.setdefault("oom_batches", []).append(B)
            model.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            empty_cache()
        else:
            raise RuntimeError(f"no micro-batch of {job['batches']} fits")
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    results.put(row)


def job_order(models, variants):
    """The queue: medium before small, each model's additive baseline first (every ratio needs it, so a
    run cut short must not lose it), then the longest jobs (Deltaformer, then the TC/CC read-outs, then
    the rest), so that the last jobs to start on several GPUs are short ones; the "-bf16" state rows last."""

    def key(job):
        model, variant = job
        kind = 2 if "deltaformer" in variant else 1 if ("-tc" in variant or "-cc" in variant) else 0
        return ("-bf16" in variant, "medium" not in model, variant != "additive", -kind)

    return sorted(((m, v) for m in models for v in variants), key=key)


def run_jobs(
    jobs, gpus, start, time_limit, job_timeout, report=print, min_left=30, ctx=None, poll_s=0.2,
    clock=time.time, sleep=time.sleep,
):  # fmt: skip
    """Run jobs (dicts with model, variant; in queue order) in fresh processes, one per GPU of `gpus` at a
    time, each GPU taking the next job when its last one has ended. start(job, queue) is the process
    target and must put exactly one row (a dict) on the queue. A job starts only while >= min_left s of
    time_limit remain, and is killed after min(job_timeout, what was left when it started) s, so the
    whole run ends within time_limit (+ a few s to reap). Returns one row per job, in the jobs' order;
    report(row) is called as each finishes. The GPU (a CUDA_VISIBLE_DEVICES value; None: the caller's
    own device) is set in the environment the child is spawned with, before it can initialise CUDA.
    clock and sleep measure and pass the time limits (a test passes a fake pair)."""
    import multiprocessing as mp
    import queue

    ctx = ctx or mp.get_context("spawn")
    t0, todo, running, rows = clock(), list(jobs), {}, {}

    def finish(gpu, row):
        job = running[gpu]["job"]
        row.update(model=job["model"], variant=job["variant"], gpu=gpu, t_done_s=round(clock() - t0, 1))
        rows[id(job)] = row
        report(row)
        running[gpu]["row_at"] = clock()  # the process gets a few s to exit and free the GPU

    while todo or running:
        for gpu in gpus:
            if gpu in running or not todo or time_limit - (clock() - t0) < min_left:
                continue
            job, q = todo.pop(0), ctx.Queue()
            p = ctx.Process(target=start, args=(job, q))
            old = os.environ.get("CUDA_VISIBLE_DEVICES")
            if gpu is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
            try:
                p.start()
            finally:
                if old is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = old
            left = time_limit - (clock() - t0)
            running[gpu] = dict(job=job, p=p, q=q, t=clock(), budget=min(left, job_timeout), row_at=None)
        if not running:  # the time limit leaves no room for another job
            for job in todo:
                rows[id(job)] = dict(
                    model=job["model"], variant=job["variant"], error="not run: --time-limit reached"
                )
            break
        sleep(poll_s)
        for gpu, r in list(running.items()):
            p = r["p"]
            if r["row_at"] is None:
                try:
                    finish(gpu, r["q"].get(timeout=0.01 if p.is_alive() else 1.0))
                except queue.Empty:
                    if not p.is_alive():  # died without a row (crash, killed for memory, ...)
                        finish(gpu, dict(error=f"worker exited with code {p.exitcode}, no result"))
                    elif clock() - r["t"] > r["budget"]:
                        p.kill()
                        finish(gpu, dict(error=f"no result within {r['budget']:.0f} s (killed)"))
            if r["row_at"] is not None and (not p.is_alive() or clock() - r["row_at"] > 10):
                if p.is_alive():
                    p.kill()
                p.join()
                del running[gpu]
    return [rows[id(job)] for job in jobs]


def run_table(args):
    """Every (model, variant) in its own process: one after another on the caller's GPU, or with --gpus
    one at a time on each listed GPU, from one queue (job_order). Rows come back in the table's order."""
    order = job_order(args.models, args.variants)
    jobs = [
        dict(model=m, variant=v, overrides=VARIANTS[v], batches=args.batches[m], args=args) for m, v in order
    ]
    done = []

    def on_row(row):
        print(json.dumps(row), flush=True)
        done.append(row)
        save(args, table_order(done, args))

    rows = run_jobs(jobs, args.gpus, worker, args.time_limit, args.job_timeout, on_row)
    return table_order(rows, args)


def table_order(rows, args):
    pos = {(m, v): i for i, (m, v) in enumerate((m, v) for m in args.models for v in args.variants)}
    return sorted(rows, key=lambda r: pos[(r["model"], r["variant"])])


# ---------------------------------------------------------------------------------------------------------
# Output


def table(rows):
    """Markdown table; ratios against additive + softmax of the same model size (peak memory only
    where both ran at the same micro-batch)."""
    base = {r["model"]: r for r in rows if r["variant"] == "additive" and "tok_s" in r}
    lines = [
        "| model | variant | micro-batch | tokens/s | ×additive | step ms | peak GB | ×additive | MFU "
        "| compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "tok_s" not in r:
            lines.append(f"| {r['model']} | {r['variant']} | not measured: {r.get('error', '?')} |||||||")
            continue
        b = base.get(r["model"])
        ratio = f"{r['tok_s'] / b['tok_s']:.3f}" if b else "-"
        mem_ratio = f"{r['peak_GB'] / b['peak_GB']:.3f}" if b and b["batch"] == r["batch"] else "-"
        variant = r["variant"] + (" (eager: compile failed)" if "compile_error" in r else "")
        cells = [r["model"], variant, r["batch"], f"{r['tok_s']:,.0f}", ratio, f"{r['step_ms']:.1f}"]
        cells += [f"{r['peak_GB']:.1f}", mem_ratio, f"{100 * r['mfu']:.1f}%", r.get("compile_s", "-")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def settings(args):
    scope = "whole model" if args.compile_scope == "model" else "each block + the loss"
    compiled = f"torch.compile ({scope}, static shapes)" if args.compile else "eager"
    return (
        f"seq {args.seq}, bf16 autocast, {compiled}, {'fused ' if args.device == 'cuda' else ''}AdamW, "
        f"random tokens; {args.warmup} warm-up (the first compiles) and "
        f"{args.steps} timed steps, step time their median; MFU = tokens/s x GPT.flops_per_token / "
        f"{args.peak_tflops:g} TFLOP/s; ×additive: against additive + softmax of the same model in this run"
    )


def report(args, rows):
    """The printed text: command, GPU and versions, settings, the table."""
    return "\n".join([f"Command: `{args.command}`", versions(), settings(args), "", table(rows)])


def save(args, rows):
    """bench_train.json and bench_train.md in --out (after every row: a run cut short keeps its rows)."""
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    run = dict(command=args.command, versions=versions(), settings=settings(args), rows=rows)
    atomic_write(os.path.join(args.out, "bench_train.json"), json.dumps(run, indent=1))
    atomic_write(os.path.join(args.out, "bench_train.md"), report(args, rows) + "\n")


def parse_batches(text, models):
    """--batches: '64,32' (every model) or 'gpt2-small=64,32;gpt2-medium=32,16' (an entry without a model
    name serves the models not named) -> {model: sizes, largest first}."""
    default, per_model = None, {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        model, _, sizes = part.rpartition("=")
        try:
            batch = sorted({int(b) for b in sizes.split(",") if b.strip()}, reverse=True)
        except ValueError:
            batch = []
        if not batch or batch[-1] < 1:
            raise SystemExit(f"--batches: {part!r}: expected positive integers like 64,32 (or model=64,32)")
        if model:
            per_model[model.strip()] = batch
        else:
            default = batch
    out = {}
    for m in models:
        if m not in per_model and default is None:
            raise SystemExit(
                f"--batches {text!r}: no micro-batch sizes for {m} (add {m}=... or a plain list)"
            )
        out[m] = per_model.get(m, default)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-small,gpt2-medium")
    p.add_argument("--variants", default=",".join(VARIANTS), help="additive is added when missing")
    p.add_argument(
        "--batches",
        default="64,32,16,8",
        help="micro-batch sizes to try, largest first: '64,32' for every model, or per model "
        "'gpt2-small=64,32;gpt2-medium=32,16'",
    )
    p.add_argument(
        "--gpus",
        default="",
        help="e.g. 0,1: run the jobs on these GPUs at once (CUDA_VISIBLE_DEVICES of each worker), one job "
        "per GPU at a time from one queue; default: one job at a time on the caller's GPU",
    )
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument(
        "--compile-scope",
        default="model",
        choices=["model", "blocks"],
        help="model: torch.compile(model); blocks: each Block and the LM head + loss (compiles ~L times "
        "faster; the embedding runs eagerly; every block call runs its own wrapper on the host, which can "
        "leave the GPU waiting: --profile shows kernels busy against the step)",
    )
    p.add_argument(
        "--ddl-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="what backend='auto' means for the DDL and Deltaformer ops (kernels.common.set_auto_backend)",
    )
    p.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU (H100/H200 dense bf16: 989)")
    p.add_argument("--time-limit", type=float, default=540, help="seconds for the whole table")
    p.add_argument("--job-timeout", type=float, default=420, help="seconds for one (model, variant)")
    p.add_argument(
        "--profile", action="store_true", help="after timing each row, profile --profile-steps steps"
    )
    p.add_argument("--profile-steps", type=int, default=1)
    p.add_argument("--profile-top", type=int, default=30, help="kernels listed by the profile")
    p.add_argument(
        "--device", default="cuda", help="cpu: a smoke test of this script (tiny --model-overrides)"
    )
    p.add_argument("--model-overrides", default="", help="GPTConfig overrides, e.g. n_layer=2,n_embd=64")
    p.add_argument(
        "--nanogpt",
        default="",
        help="nanoGPT's model.py (github.com/karpathy/nanoGPT): adds the row 'nanogpt', its GPT at the "
        "same depth and width (64-wide heads), timed like the others",
    )
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for bench_train.json / .md")
    args = p.parse_args()
    args.command = "python bench/bench_train.py " + " ".join(sys.argv[1:])
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r}; allowed: {', '.join(VARIANTS)}")
    if "additive" not in args.variants:
        args.variants.insert(0, "additive")
    if args.nanogpt and "nanogpt" not in args.variants:
        args.variants.append("nanogpt")
    if "nanogpt" in args.variants and not os.path.isfile(args.nanogpt):
        raise SystemExit(f"--nanogpt: the row 'nanogpt' needs nanoGPT's model.py, got {args.nanogpt!r}")
    args.batches = parse_batches(args.batches, args.models)
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] or [None]
    if len(set(args.gpus)) != len(args.gpus):
        raise SystemExit(f"--gpus: a GPU is listed twice in {args.gpus}")
    args.model_overrides = {
        key: (int(val) if val.isdigit() else val)
        for key, val in (kv.split("=", 1) for kv in args.model_overrides.split(",") if kv)
    }
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU (or --device cpu for a smoke test)")
    print(f"Command: `{args.command}`", versions(), sep="\n", flush=True)
    rows = run_table(args)
    save(args, rows)
    print("\n" + report(args, rows), flush=True)


if __name__ == "__main__":
    main()
