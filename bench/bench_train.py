"""End-to-end training throughput of every residual x attention variant (one GPU per job, one or several
GPUs per run), and micro-benchmarks of the DDL kernels.

    python bench/bench_train.py                       # the table: gpt2-small and gpt2-medium, every variant
    python bench/bench_train.py --gpus 0,1 --batches "gpt2-small=64,32;gpt2-medium=32,16"
                                                      # the same on two GPUs at once (one job per GPU)
    python bench/bench_train.py --kernels-only        # DDL kernel timings and bytes moved
    python bench/bench_train.py --models gpt2-small --variants additive,ddl-cc --out /tmp/b
    python bench/bench_train.py --merge /tmp/b/bench_train.json   # into bench/RESULTS.md (no GPU)
    CUDA_VISIBLE_DEVICES=1 python bench/bench_train.py --models gpt2-small --variants additive --profile
                                                      # + where one step's GPU time goes (torch.profiler)

Variants: additive, ddl (d_v = 1), ddl-tc, ddl-cc (EC on), each with softmax attention, and additive /
ddl-cc with Deltaformer; a "-bf16" suffix (ddl-bf16, ddl-tc-bf16, ddl-cc-bf16, ddl-cc-bf16+deltaformer)
is the same model with the DDL state stored in bf16 (GPTConfig.ddl_state_dtype="bfloat16").
Without --gpus a job runs on whichever CUDA_VISIBLE_DEVICES the caller gives (device 0 of the process).

For each (model, variant): bf16 autocast, torch.compile, fused AdamW, seq 1024, the largest micro-batch of
--batches that fits (OOM is caught and the next smaller one tried); tokens/s, step time (median of the
timed steps), compile time (the first step) apart from it, peak memory,
MFU = tokens/s * (6 N + 12 L H Q T) / 989e12 (N: the variant's parameters,
H heads of width Q), and ratios to additive + softmax of the same size (peak memory only where both ran
at the same micro-batch; pass --batches 32 to force one).

Each (model, variant) runs in its own fresh process, compiled with static shapes at the batch it is timed
at (a smaller batch after an OOM compiles again): one after another, or with --gpus 0,1 one process per
GPU at a time, from one queue that starts the longest jobs first (job_order); each row records its GPU,
the table keeps the model/variant order. Compiling dominates the run time (~30-50 s per gpt2-small row
on the H200 machines), so a 10-minute device call holds ~8 rows per GPU: run the rest in parts
(--models / --variants) and merge the parts' JSON into bench/RESULTS.md on this machine with --merge
(rows are keyed by model and variant; a later run replaces a row).
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

PEAK_FLOPS = 989e12  # H100/H200 dense bf16
BF16 = dict(ddl_state_dtype="bfloat16")  # the "-bf16" rows: the DDL state stored in bf16
VARIANTS = {
    "additive": dict(residual="additive"),
    "ddl": dict(residual="ddl"),
    "ddl-bf16": dict(residual="ddl", **BF16),
    "ddl-tc": dict(residual="ddl-tc"),
    "ddl-tc-bf16": dict(residual="ddl-tc", **BF16),
    "ddl-cc": dict(residual="ddl-cc"),
    "ddl-cc-bf16": dict(residual="ddl-cc", **BF16),
    "additive+deltaformer": dict(residual="additive", attention="deltaformer"),
    "ddl-cc+deltaformer": dict(residual="ddl-cc", attention="deltaformer"),
    "ddl-cc-bf16+deltaformer": dict(residual="ddl-cc", attention="deltaformer", **BF16),
}


# ---------------------------------------------------------------------------------------------------------
# One (model, variant): runs in its own process.


def issue_flops_per_token(model, T):
    cfg = model.config
    return 6 * model.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T


def train_steps(model, opt, B, T, steps, vocab, device):
    """Run `steps` optimizer steps on random tokens; return per-step times (s) measured with CUDA events."""
    times = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (B, T), device=device)
        tgt = torch.randint(0, vocab, (B, T), device=device)
        cuda = device == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - t0)
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
    t0 = time.time()
    train_steps(compiled, opt, B, args.seq, max(args.warmup - 1, 0), cfg.vocab_size, device)
    row["warmup_s"] = round(time.time() - t0, 1)
    times = train_steps(compiled, opt, B, args.seq, args.steps, cfg.vocab_size, device)
    step = statistics.median(times)
    tok_s = B * args.seq / step
    row.update(
        batch=B,
        step_ms=step * 1e3,
        tok_s=tok_s,
        peak_GB=peak_gb(),
        mfu=tok_s * issue_flops_per_token(model, args.seq) / PEAK_FLOPS,
        mfu_model_flops=tok_s * model.flops_per_token(args.seq) / PEAK_FLOPS,
        step_ms_min=min(times) * 1e3,
        step_ms_max=max(times) * 1e3,
    )
    if args.profile:
        profile_step(compiled, opt, B, cfg, args, row)


def profile_step(compiled, opt, B, cfg, args, row):
    """torch.profiler over --profile-steps training steps: the top GPU kernels by total time, and the
    time by kind (matmul, attention, Triton kernels of Inductor, the DDL kernels, optimizer, other).
    Printed, and kept in the row (profile_kinds_ms, profile_top) of bench_train.json."""
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
    lines = [
        f"profile {row['model']} {row['variant']} micro-batch {B}: {n} step(s), kernels busy "
        f"{total / 1e3 / n:.1f} ms/step (timed step {row['step_ms']:.1f} ms)"
    ]
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:40s} {us / 1e3 / n:8.2f} ms/step  {100 * us / total:5.1f}%")
    lines.append(f"  top {args.profile_top} kernels (ms/step, share, calls/step, name):")
    for name, us, count in kernels[: args.profile_top]:
        lines.append(f"  {us / 1e3 / n:8.3f} {100 * us / total:5.1f}% {count // n:4d}  {name[:150]}")
    text = "\n".join(lines)
    print(text, flush=True)
    row["profile_kinds_ms"] = {k: round(us / 1e3 / args.profile_steps, 3) for k, us in kinds.items()}
    row["profile_top"] = [
        [name[:200], round(us / 1e3 / args.profile_steps, 3), count // args.profile_steps]
        for name, us, count in kernels[: args.profile_top]
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


def worker(job, results):
    """One (model, variant) in a fresh process: static shapes, compiled at the batch it is timed at."""
    name, size, overrides, args = job["variant"], job["model"], job["overrides"], job["args"]
    row = dict(model=size, variant=name)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch._dynamo.config.automatic_dynamic_shapes = False  # a smaller batch after an OOM: static again
    try:
        from kernels import ddl
        from model import GPT, GPTConfig

        if args.ddl_backend != "auto":
            ddl.set_auto_backend(args.ddl_backend)
        cfg = GPTConfig.preset(size, block_size=args.seq, **overrides, **args.model_overrides)
        torch.manual_seed(0)
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
    """The queue: the issue's rows before the extra "-bf16" ones, and within each, medium before small,
    each model's additive baseline first (every ratio needs it, so a run cut short must not lose it), then
    the longest jobs (Deltaformer, then the TC/CC read-outs, then the rest), so that the last jobs to start
    on several GPUs are short ones."""

    def key(job):
        model, variant = job
        kind = 2 if "deltaformer" in variant else 1 if ("-tc" in variant or "-cc" in variant) else 0
        return ("-bf16" in variant, "medium" not in model, variant != "additive", -kind)

    return sorted(((m, v) for m in models for v in variants), key=key)


def run_jobs(jobs, gpus, start, time_limit, job_timeout, report=print, min_left=30, ctx=None, poll_s=0.2):
    """Run jobs (dicts with model, variant; in queue order) in fresh processes, one per GPU of `gpus` at a
    time, each GPU taking the next job when its last one has ended. start(job, queue) is the process
    target and must put exactly one row (a dict) on the queue. A job starts only while >= min_left s of
    time_limit remain, and is killed after min(job_timeout, what was left when it started) s, so the
    whole run ends within time_limit (+ a few s to reap). Returns one row per job, in the jobs' order;
    report(row) is called as each finishes. The GPU (a CUDA_VISIBLE_DEVICES value; None: the caller's
    own device) is set in the environment the child is spawned with, before it can initialise CUDA."""
    import multiprocessing as mp
    import queue

    ctx = ctx or mp.get_context("spawn")
    t0, todo, running, rows = time.time(), list(jobs), {}, {}

    def finish(gpu, row):
        job = running[gpu]["job"]
        row.update(model=job["model"], variant=job["variant"], gpu=gpu, t_done_s=round(time.time() - t0, 1))
        rows[id(job)] = row
        report(row)
        running[gpu]["row_at"] = time.time()  # the process gets a few s to exit and free the GPU

    while todo or running:
        for gpu in gpus:
            if gpu in running or not todo or time_limit - (time.time() - t0) < min_left:
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
            left = time_limit - (time.time() - t0)
            running[gpu] = dict(job=job, p=p, q=q, t=time.time(), budget=min(left, job_timeout), row_at=None)
        if not running:  # the time limit leaves no room for another job
            for job in todo:
                rows[id(job)] = dict(
                    model=job["model"], variant=job["variant"], error="not run: --time-limit reached"
                )
            break
        time.sleep(poll_s)
        for gpu, r in list(running.items()):
            p = r["p"]
            if r["row_at"] is None:
                try:
                    finish(gpu, r["q"].get(timeout=0.01 if p.is_alive() else 1.0))
                except queue.Empty:
                    if not p.is_alive():  # died without a row (crash, killed for memory, ...)
                        finish(gpu, dict(error=f"worker exited with code {p.exitcode}, no result"))
                    elif time.time() - r["t"] > r["budget"]:
                        p.kill()
                        finish(gpu, dict(error=f"no result within {r['budget']:.0f} s (killed)"))
            if r["row_at"] is not None and (not p.is_alive() or time.time() - r["row_at"] > 10):
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

    def report(row):
        print(json.dumps(row), flush=True)
        done.append(row)
        save(args, table_order(done, args))

    rows = run_jobs(jobs, args.gpus, worker, args.time_limit, args.job_timeout, report)
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


def section(runs):
    """The '## Training throughput' section from runs = [{command, versions, rows}], later runs' rows
    replacing earlier ones of the same (model, variant); the rows are kept in a comment for --merge."""
    merged = {}
    for run in runs:
        for r in run["rows"]:
            if "tok_s" in r or (r["model"], r["variant"]) not in merged:
                merged[(r["model"], r["variant"])] = r
    for m in ("gpt2-small", "gpt2-medium"):
        for v in VARIANTS:
            merged.setdefault((m, v), dict(model=m, variant=v, error="no run yet"))
    order = {v: i for i, v in enumerate(VARIANTS)}
    sizes = {"gpt2-small": 0, "gpt2-medium": 1}
    rows = sorted(
        merged.values(), key=lambda r: (sizes.get(r["model"], 9), r["model"], order.get(r["variant"], 99))
    )
    cmds = [
        f"- `{run['command']}` — {run['versions']}" + (f" ({run['note']})" if run.get("note") else "")
        for run in runs
    ]
    return "\n".join(
        [
            "## Training throughput",
            "",
            "Seq 1024, bf16 autocast, torch.compile (static shapes; --compile-scope as in the command, "
            "default the whole model), fused AdamW, random tokens; step time "
            "is the median of the timed steps; MFU = tokens/s × (6N + 12·L·H·Q·T) / 989 TF (N: the variant's "
            "parameters). Made by:",
            "",
            *cmds,
            "",
            table(rows),
            "",
            "<!-- bench_train runs: " + json.dumps(runs) + " -->",
        ]
    )


def runs_in_results(path):
    if not os.path.exists(path):
        return []
    text = open(path).read()
    tag = "<!-- bench_train runs: "
    if tag not in text:
        return []
    return json.loads(text.split(tag, 1)[1].split(" -->", 1)[0])


def save(args, rows):
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        run = dict(command=args.command, versions=versions(), rows=rows)
        atomic_write(os.path.join(args.out, "bench_train.json"), json.dumps(run, indent=1))


def write_results_section(path, text):
    """Replace (or append) the '## Training throughput' section of path, leaving other sections alone."""
    head = "## Training throughput"
    old = open(path).read() if os.path.exists(path) else ""
    if head in old:
        before, rest = old.split(head, 1)
        nxt = rest.find("\n## ")
        after = rest[nxt + 1 :] if nxt >= 0 else ""
        new = before + text.rstrip() + "\n" + ("\n" + after if after else "")
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "# Benchmark results\n\n") + text.rstrip() + "\n"
    atomic_write(path, new)


# ---------------------------------------------------------------------------------------------------------
# Kernel micro-benchmarks: time per call and the bytes it must move, against the copy bandwidth.


def bench_kernels(args):
    from triton.testing import do_bench

    out = []

    def report(name, ms, nbytes):
        line = f"{name:60s} {ms * 1e3:9.1f} us  {nbytes / 1e9:7.3f} GB  {nbytes / ms / 1e6:7.0f} GB/s"
        print(line, flush=True)
        out.append(dict(name=name, us=ms * 1e3, GB=nbytes / 1e9, GBps=nbytes / ms / 1e6))

    bufs = [torch.randint(0, 255, (2**30,), dtype=torch.uint8, device="cuda"), None]
    bufs[1] = torch.empty_like(bufs[0])
    ms = do_bench(lambda: bufs[1].copy_(bufs[0]), return_mode="median")
    report("copy 1 GiB (read + write)", ms, 2 * 2**30)
    bufs.clear()
    if args.kernel_sweeps:  # only these (the device script's budget)
        bench_kernel_sweeps(args, do_bench, report)
        return out
    for dtype in (torch.float32,) if args.kernels_quick else (torch.float32, torch.bfloat16):
        bench_kernels_dtype(args, dtype, do_bench, report)
        torch.cuda.empty_cache()
    bench_kernels_dv1(args, do_bench, report)
    return out


def bench_kernel_sweeps(args, do_bench, report):
    """Launch choices of the update kernels, bf16 and fp32 state, N tokens, d 768, forward + backward
    (autograd.grad: no accumulation into .grad). Each line names the _CFG entry it sets; the shipped
    one is marked. Bytes: the minimal passes (update: 5 S + 3 V; fused CC: 5 S + 5 V; S a state pass)."""
    for dtype in (torch.bfloat16, torch.float32):
        for dv in (4, 1):
            sweep_update(args, do_bench, report, dtype, dv)
            torch.cuda.empty_cache()


def sweep_update(args, do_bench, report, dtype, dv):
    from kernels import ddl

    N, d = args.kernel_tokens, 768
    shipped = {key: dict(val) for key, val in ddl._CFG.items()}
    # what ships for this state dtype (an entry's per-dtype shape, else its own, without the sub-entries)
    ship = {
        key: {n: c for n, c in ddl._cfg(key, dtype).items() if not isinstance(c, dict)} for key in shipped
    }
    es = torch.finfo(dtype).bits // 8
    tag = f"{str(dtype).replace('torch.', '')}, N={N}"
    x = torch.randn(N // 1024, 1024, d, dv, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(N // 1024, 1024, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(N // 1024, 1024, dv, device="cuda", requires_grad=True)  # fp32, as in the model
    beta = torch.rand(N // 1024, 1024, device="cuda", requires_grad=True)
    w = torch.randn(d, dv, device="cuda", requires_grad=True)
    gx, gh = torch.randn_like(x), torch.randn_like(k)
    S, V = N * d * dv * es, N * d * es

    def timed(name, fn, nbytes):
        try:
            fn()
            report(f"{name} [{tag}]", do_bench(fn, return_mode="median"), nbytes)
        except Exception as e:
            print(f"{name} [{tag}] FAILED: {type(e).__name__}: {e}"[:300], flush=True)

    def upd(update=ddl.ddl_update):
        return torch.autograd.grad(update(x, k, v, beta, backend="triton"), (x, k, v, beta), gx)

    def fused():
        out = ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton")
        return torch.autograd.grad(out, (x, k, v, beta, w), (gx, gh))

    if dv == 1 and dtype == torch.bfloat16:  # compiling the reference costs ~15 s: once
        ref_c = torch.compile(ddl.ddl_update_ref)
        timed(
            "d_v=1 update f+b torch.compile(ref)",
            lambda: torch.autograd.grad(ref_c(x, k, v, beta), (x, k, v, beta), gx),
            5 * S + 3 * V,
        )
    if dv == 1:
        row_cfgs = [dict(ROWS=0, num_warps=4)]
        row_cfgs += [
            dict(ROWS=r, num_warps=nw) for r, nw in ((1, 4), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8))
        ]
        for cfg in row_cfgs:
            ddl._CFG["update_row"] = cfg
            mark = " (shipped)" if cfg == ship["update_row"] else ""
            timed(f"d_v=1 update f+b update_row={cfg}{mark}", upd, 5 * S + 3 * V)
        ddl._CFG.update(shipped)
        return
    bwd_cfgs = [
        dict(TOKENS=32, LOOP=0, num_warps=4),
        dict(TOKENS=8, LOOP=0, num_warps=4),
        dict(TOKENS=4, LOOP=1, num_warps=4),
        dict(TOKENS=8, LOOP=1, num_warps=4),
        dict(TOKENS=8, LOOP=1, num_warps=8),
        dict(TOKENS=16, LOOP=1, num_warps=8),
        dict(TOKENS=16, LOOP=2, num_warps=4),
        dict(TOKENS=32, LOOP=2, num_warps=4),
    ]
    for tok, nw in ((1, 4), (1, 2), (2, 4), (4, 4)):  # forward: 1 token/program looked latency-bound in bf16
        cfg = dict(TOKENS=tok, num_warps=nw)
        ddl._CFG["update_fwd"] = cfg
        mark = " (shipped)" if cfg == ship["update_fwd"] else ""
        timed(
            f"update+cc fwd update_fwd={cfg}{mark}",
            lambda: ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton"),
            2 * S + 2 * V,
        )
    ddl._CFG.update(shipped)
    for cfg in bwd_cfgs:
        ddl._CFG["update_bwd"] = cfg
        mark = " (shipped)" if cfg == ship["update_bwd"] else ""
        timed(f"update f+b update_bwd={cfg}{mark}", upd, 5 * S + 3 * V)
        timed(f"update+cc f+b update_bwd={cfg}{mark}", fused, 5 * S + 5 * V)
    ddl._CFG.update(shipped)


def bench_kernels_dv1(args, do_bench, report):
    """Scalar DDL (d_v = 1): the state is one d-vector per token, like the additive stream."""
    from kernels import ddl

    N, d = args.kernel_tokens, 768
    x = torch.randn(N // 1024, 1024, d, 1, device="cuda", requires_grad=True)
    k = torch.randn(N // 1024, 1024, d, device="cuda", requires_grad=True)
    v = torch.randn(N // 1024, 1024, 1, device="cuda", requires_grad=True)
    beta = torch.rand(N // 1024, 1024, device="cuda", requires_grad=True)
    gx = torch.randn_like(x)
    S = N * d * 4
    upd_c = torch.compile(ddl.ddl_update_ref)
    cases = [("triton", lambda: ddl.ddl_update(x, k, v, beta, backend="triton"))]
    if not args.kernels_quick:
        cases.append(("torch.compile(ref)", lambda: upd_c(x, k, v, beta)))
    for name, fn in cases:
        fn()
        report(f"update fwd  {name} [float32, d_v=1, N={N}]", do_bench(fn, return_mode="median"), 3 * S)

        def fb(fn=fn):
            torch.autograd.grad(fn(), (x, k, v, beta), gx)

        fb()
        report(f"update f+b  {name} [float32, d_v=1, N={N}]", do_bench(fb, return_mode="median"), 8 * S)


def bench_kernels_dtype(args, dtype, do_bench, report):
    from kernels import ddl

    dev = "cuda"
    N, d, dv, K = args.kernel_tokens, 768, 4, 4
    B, T = N // 1024, 1024
    es = torch.finfo(dtype).bits // 8
    S = N * d * dv * es  # bytes of one pass over the state
    V = N * d * es  # bytes of one pass over a [N, d] vector
    tag = f"{str(dtype).replace('torch.', '')}, N={N}"
    x = torch.randn(B, T, d, dv, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, dv, device=dev, dtype=dtype, requires_grad=True)
    beta = torch.rand(B, T, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(d, dv, device=dev, dtype=dtype, requires_grad=True)
    cw = torch.randn(d, dv, K, device=dev, requires_grad=True)
    read = torch.randn(dv, device=dev, requires_grad=True)
    emb = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
    gx, gh = torch.randn_like(x), torch.randn_like(k)
    leaves = (x, k, v, beta, w, cw, read, emb)

    upd_c = torch.compile(ddl.ddl_update_ref)
    updcc_c = torch.compile(ddl.ddl_update_compress_cc_ref)
    tc_c = torch.compile(ddl.compress_tc_ref)

    def fb(fn, grads):
        """forward + backward; autograd.grad returns fresh gradients (no accumulation into .grad,
        which would add a read-modify-write of the state to every timing)"""

        def run():
            outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            ins = [t for t in leaves if t.requires_grad]
            torch.autograd.grad(outs, ins, grads[: len(outs)], allow_unused=True)

        return run

    def unfused():
        xn = ddl.ddl_update(x, k, v, beta, backend="triton")
        return xn, ddl.compress_cc(xn, w, backend="triton")

    cases = [
        ("update fwd  triton", lambda: ddl.ddl_update(x, k, v, beta, backend="triton"), 2 * S + V),
        ("update fwd  torch.compile(ref)", lambda: upd_c(x, k, v, beta), 2 * S + V),
        (
            "update f+b  triton",
            fb(lambda: ddl.ddl_update(x, k, v, beta, backend="triton"), (gx,)),
            5 * S + 3 * V,
        ),
        ("update f+b  torch.compile(ref)", fb(lambda: upd_c(x, k, v, beta), (gx,)), 5 * S + 3 * V),
        (
            "update+cc f+b  fused triton",
            fb(lambda: ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton"), (gx, gh)),
            5 * S + 5 * V,
        ),
        (
            "update+cc fwd  fused triton",
            lambda: ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton"),
            2 * S + 2 * V,
        ),
        ("update+cc f+b  triton, unfused", fb(unfused, (gx, gh)), 5 * S + 5 * V),
        ("update+cc f+b  torch.compile(ref)", fb(lambda: updcc_c(x, k, v, beta, w), (gx, gh)), 5 * S + 5 * V),
        (
            "update+tc f+b  fused triton",
            fb(lambda: ddl.ddl_update_compress_tc(x, k, v, beta, cw, read, backend="triton"), (gx, gh)),
            6 * S + 6 * V,
        ),
        (
            "update+tc fwd  fused triton",
            lambda: ddl.ddl_update_compress_tc(x, k, v, beta, cw, read, backend="triton"),
            2 * S + 2 * V,
        ),
        ("cc f+b  triton", fb(lambda: ddl.compress_cc(x, w, backend="triton"), (gh,)), 3 * S + 2 * V),
        ("tc f+b  triton", fb(lambda: ddl.compress_tc(x, cw, read, backend="triton"), (gh,)), 3 * S + 2 * V),
        ("tc f+b  torch.compile(ref)", fb(lambda: tc_c(x, cw, read), (gh,)), 3 * S + 2 * V),
        ("ec f+b  triton", fb(lambda: ddl.expand_ec(emb, cw, backend="triton"), (gx,)), 2 * S + 3 * V),
    ]
    if (
        dtype != torch.float32 or args.kernels_quick
    ):  # torch.compile comparisons once, in fp32 (model's dtype)
        cases = [c for c in cases if "torch.compile" not in c[0]]
    for name, fn, nbytes in cases:
        try:
            fn()
            torch.cuda.synchronize()
            report(f"{name} [{tag}]", do_bench(fn, return_mode="median"), nbytes)
        except Exception as e:
            print(f"{name} [{tag}] FAILED: {type(e).__name__}: {e}"[:300], flush=True)
        for t in leaves:
            t.grad = None
    if dtype != torch.float32 or args.kernels_quick:
        return
    # launch shapes of the update kernels
    saved = {key: dict(val) for key, val in ddl._CFG.items()}
    for tok, nw in ((1, 4), (1, 8), (2, 4), (4, 8)):
        ddl._CFG["update_fwd"] = dict(TOKENS=tok, num_warps=nw)
        ms = do_bench(lambda: ddl.ddl_update(x, k, v, beta, backend="triton"), return_mode="median")
        report(f"  cfg update_fwd TOKENS={tok} warps={nw} [{tag}]", ms, 2 * S + V)
    ddl._CFG.update(saved)
    f = fb(lambda: ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton"), (gx, gh))
    for tok, nw in ((8, 4), (32, 4), (64, 4), (32, 8)):
        ddl._CFG["update_bwd"] = dict(TOKENS=tok, num_warps=nw)
        ms = do_bench(f, return_mode="median")
        report(f"  cfg update_bwd TOKENS={tok} warps={nw} (fused f+b) [{tag}]", ms, 5 * S + 5 * V)
    ddl._CFG.update(saved)
    f = fb(lambda: ddl.compress_tc(x, cw, read, backend="triton"), (gh,))
    for tok, bd, nw in ((4, 256, 4), (8, 128, 4), (16, 256, 8), (64, 256, 4)):
        ddl._CFG["chan_fwd"] = dict(TOKENS=min(tok, 8), BLOCK_D=bd, num_warps=nw)
        ddl._CFG["chan_bwd"] = dict(TOKENS=tok, BLOCK_D=bd, num_warps=nw)
        ms = do_bench(f, return_mode="median")
        report(f"  cfg chan TOKENS={tok} BLOCK_D={bd} warps={nw} (tc f+b) [{tag}]", ms, 3 * S + 2 * V)
    ddl._CFG.update(saved)


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
    p.add_argument("--variants", default=",".join(VARIANTS))
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
        help="model: torch.compile(model); blocks: each Block only (compiles ~L times faster; the embedding, "
        "LM head and loss then run eagerly)",
    )
    p.add_argument("--ddl-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--time-limit", type=float, default=540, help="seconds for the whole table")
    p.add_argument("--job-timeout", type=float, default=420, help="seconds for one (model, variant)")
    p.add_argument("--merge", nargs="+", default=None, help="bench_train.json files to merge into --results")
    p.add_argument(
        "--profile", action="store_true", help="after timing each row, profile --profile-steps steps"
    )
    p.add_argument("--profile-steps", type=int, default=1)
    p.add_argument("--profile-top", type=int, default=30, help="kernels listed by the profile")
    p.add_argument("--kernels", action="store_true", help="also run the DDL kernel micro-benchmarks first")
    p.add_argument("--kernels-only", action="store_true")
    p.add_argument(
        "--kernels-quick", action="store_true", help="kernel timings: Triton, fp32 only, no sweeps"
    )
    p.add_argument("--kernel-tokens", type=int, default=32768)
    p.add_argument(
        "--kernel-sweeps",
        action="store_true",
        help="kernel timings: only the update kernels' launch choices",
    )
    p.add_argument(
        "--device", default="cuda", help="cpu: a smoke test of this script (tiny --model-overrides)"
    )
    p.add_argument("--model-overrides", default="", help="GPTConfig overrides, e.g. n_layer=2,n_embd=64")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for bench_train.json / .md")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "RESULTS.md"), help="for --merge")
    args = p.parse_args()
    args.command = "python bench/bench_train.py " + " ".join(sys.argv[1:])
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    for v in args.variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r}; allowed: {', '.join(VARIANTS)}")
    args.batches = parse_batches(args.batches, args.models)
    args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] or [None]
    if len(set(args.gpus)) != len(args.gpus):
        raise SystemExit(f"--gpus: a GPU is listed twice in {args.gpus}")
    args.model_overrides = {
        key: (int(val) if val.isdigit() else val)
        for key, val in (kv.split("=", 1) for kv in args.model_overrides.split(",") if kv)
    }
    if args.merge is not None:  # on this machine: fold device runs' JSON into bench/RESULTS.md
        runs = runs_in_results(args.results)
        for path in args.merge:
            with open(path) as f:
                run = json.load(f)
            if run not in runs:  # merging the same file twice changes nothing
                runs.append(run)
        write_results_section(args.results, section(runs))
        print(section(runs).split("<!--")[0])
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU (or --device cpu for a smoke test)")
    print(versions(), flush=True)
    if args.kernels or args.kernels_only or args.kernels_quick:
        krows = bench_kernels(args)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
                json.dump(krows, f, indent=1)
        if args.kernels_only or args.kernels_quick:
            return
    rows = run_table(args)
    save(args, rows)
    text = section([dict(command=args.command, versions=versions(), rows=rows)])
    print("\n" + text.split("<!--")[0], flush=True)
    if args.out:
        with open(os.path.join(args.out, "bench_train.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
