"""What the benchmark scripts share: the timers, a table's header (command, versions) and markdown, safe file
writes, running commands a few at a time, and a table of rows each measured in its own process. Imported
first, it puts the repository root on sys.path (model.py, ops/, data/)."""

import argparse
import ast
import contextlib
import fcntl
import json
import math
import os
import pickle
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# ---------------------------------------------------------------------------------------------------------
# Timing: the median of many calls (do_bench), a CUDA graph's replay, or one span (a training step, a job).


def median_ms(fn, grad_to_none=None):
    """Median ms of fn() by triton.testing.do_bench (25 ms of warm-up, 100 ms of calls, CUDA events around
    each): where the host's launch work per call exceeds the GPU's, this is the host's time."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def graph_ms(fn):
    """Median ms of a CUDA graph's replay of fn(): the GPU's time for its kernels without the host's launch
    gaps (what a compiled, GPU-bound training step sees). NaN, with a line saying why, if capture fails."""
    import torch

    try:  # warm-up on a side stream, then capture, as in PyTorch's whole-network capture example
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay)
    except Exception as e:  # noqa: BLE001  (a capture that fails must not end the run)
        print(f"CUDA graph failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return math.nan


def profiled(fn, cuda=True):
    """torch.profiler over fn(): (kernels, host ops), each [(name, self us, calls)], largest first. Kernels:
    on the GPU only the kernels themselves (device events): an aten op's self device time repeats the time of
    the kernels it launched, and Inductor's Triton kernels have no aten op above them; cuda False (a CPU
    smoke test): every op, by self CPU time. Host ops: the rest, by self CPU time (Python-level ops too)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
    events = prof.key_averages()
    names = ("self_device_time_total", "self_cuda_time_total") if cuda else ()  # renamed across versions
    us = lambda e: next((getattr(e, a) for a in names + ("self_cpu_time_total",) if hasattr(e, a)), 0.0)
    on_gpu = lambda e: getattr(e, "device_type", None) == DeviceType.CUDA
    kernels = [(e.key, us(e), e.count) for e in ([e for e in events if on_gpu(e)] or events)]
    host = [(e.key, e.self_cpu_time_total, e.count) for e in events if not on_gpu(e)]
    return [sorted((k for k in ks if k[1] > 0), key=lambda k: -k[1]) for ks in (kernels, host)]


def cpu_seconds():
    """User + system CPU time of this process (all threads) and of its children that have exited."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Span:
    """`with Span(cuda) as s:` times its body into s.seconds. cuda: on the GPU's clock, by CUDA events on the
    current stream at entry and exit (the exit waits for the GPU), so it is the GPU's time from the first
    work queued to the last; else the host's clock, with s.cpu_seconds (cpu_seconds() over the body)."""

    def __init__(self, cuda=False):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            import torch

            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.events[0].record()
        else:
            self.c0 = cpu_seconds()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        if self.cuda:
            self.events[1].record()
            self.events[1].synchronize()
            self.seconds = self.events[0].elapsed_time(self.events[1]) / 1e3
        else:
            self.cpu_seconds = cpu_seconds() - self.c0


def command(script, argv=None):
    """The command as typed from the repository root: 'python bench/<script> <argv>' (default sys.argv)."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "bench/" + os.path.basename(script), *argv])


def versions():
    """'GPU <n x name>; torch ...; triton ...; Python ...' for a results table."""
    import torch

    try:
        from triton import __version__ as triton_version
    except ImportError:
        triton_version = "none"
    gpu = "none (CPU)"
    if torch.cuda.is_available():
        n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        gpu = name if n == 1 else f"{n} x {name}"
    python = platform.python_version()
    return f"GPU {gpu}; torch {torch.__version__}; triton {triton_version}; Python {python}"


def markdown(head, rows, align=None):
    """A markdown table's lines: the head, the alignment line (align: '---' or '---:' per column; default
    '---'), then one line per row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align or ["---"] * len(head)) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def atomic_write(path, text):
    """Write text to path (its folder made if missing) through a temp file and os.replace: a crash leaves the
    old file or the new one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_json(path, obj):
    atomic_write(path, json.dumps(obj, indent=1))


def read_jsonl(path):
    """The records of a JSON-lines file such as train.py's log.jsonl: [] if it is missing; a line that does
    not parse (cut short by a crash) is skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def run_commands(jobs, slots, time_limit=0.0, job_timeout=0.0, min_left=0.0, on_end=None, poll_s=1.0):
    """Run each job (a dict: name, cmd; optional log: a file for its output, else this console's; cwd; env:
    more environment variables) as its own process, in order, one per entry of `slots` at a time: a GPU (the
    child's CUDA_VISIBLE_DEVICES) or None (the caller's device). With time_limit (s from the first start; 0:
    none) a job starts only while min_left s remain, and whatever runs at the limit is stopped (SIGTERM, then
    SIGKILL after 10 s), as is a job past job_timeout s (0: none). Each job gets status ('exit N', 'killed at
    the deadline', 'killed after N s', 'not run: time limit'), seconds, slot; on_end(job) as it ends. A slot
    may also be a dict: environment variables of its own for the job. Returns the jobs."""
    pending, running, t0 = list(jobs), {}, time.time()
    on_end = on_end or (lambda job: None)
    left = lambda: time_limit - (time.time() - t0) if time_limit else math.inf
    while pending or running:
        for i, slot in enumerate(slots):
            if i in running or not pending or left() < min_left:
                continue
            job = pending.pop(0)
            env = dict(os.environ, **job.get("env", {}))
            if isinstance(slot, dict):  # environment variables of its own (cpu_slots)
                env.update(slot)
            elif slot is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            log = open(job["log"], "w") if job.get("log") else None  # noqa: SIM115 (the child keeps a copy)
            proc = subprocess.Popen(job["cmd"], stdout=log, stderr=log and subprocess.STDOUT,
                                    cwd=job.get("cwd"), env=env)  # fmt: skip
            if log:
                log.close()
            running[i] = (job, proc, time.time())
            job["slot"] = slot
            where = f" on GPU(s) {slot}" if slot is not None and not isinstance(slot, dict) else ""
            print(f"started {job['name']}{where}", flush=True)
        if not running:  # the time limit leaves no room for another job
            for job in pending:
                job.update(status="not run: time limit", seconds=0.0)
                on_end(job)
            return jobs
        time.sleep(poll_s)
        for i, (job, proc, start) in list(running.items()):
            late = left() <= 0
            over = job_timeout and time.time() - start > job_timeout
            if proc.poll() is None and (late or over):
                proc.terminate()  # torchrun passes SIGTERM on to its workers
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                status = "killed at the deadline" if late else f"killed after {job_timeout:.0f} s"
            elif proc.poll() is None:
                continue
            else:
                status = f"exit {proc.returncode}"
            del running[i]
            job.update(status=status, seconds=time.time() - start)
            print(f"finished {job['name']}: {status} after {job['seconds']:.0f} s", flush=True)
            on_end(job)
    return jobs


# ---------------------------------------------------------------------------------------------------------
# A table of rows, each measured in its own process (bench_train.py, bench_infer.py): the flags they share,
# the runner, the GPU's turns when rows run side by side, the largest micro-batch that fits, the report.


def row_parser(doc, variants):
    """An argument parser (doc: its description) with the flags of a table of (model, variant) rows."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-small,gpt2-medium")
    p.add_argument("--variants", default=",".join(variants), help="additive is added when missing")
    p.add_argument("--batches", default="64,32,16,8", help="micro-batch sizes to try, e.g. 64,32")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--ddl-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="what backend='auto' means for the DDL and Deltaformer ops")  # fmt: skip
    p.add_argument("--time-limit", type=float, default=540, help="seconds for the whole table")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test (tiny --model-overrides)")
    p.add_argument("--model-overrides", default="", help="GPTConfig overrides, e.g. n_layer=2,ddl_ec=False")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for the run's .json and .md")
    return p


def parse_row_flags(p, script, variants):
    """The arguments of row_parser's parser p, parsed (lists, ints; additive first among the variants), with
    the command; a clear SystemExit on a bad one."""
    import torch

    args = p.parse_args()
    args.command = command(script)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in args.variants if v not in variants]:
        raise SystemExit(f"--variants: unknown variant {unknown[0]!r}; allowed: {', '.join(variants)}")
    args.variants = ["additive"] + [v for v in args.variants if v != "additive"]  # the baseline runs first
    args.batches = positive_ints(args.batches, "--batches", "64,32")
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: expected at least one timed step")
    pairs = [kv.split("=", 1) for kv in args.model_overrides.split(",") if kv]
    if bad := [kv for kv in pairs if len(kv) != 2]:
        raise SystemExit(f"--model-overrides: expected KEY=VALUE pairs like n_layer=2, got {bad[0][0]!r}")
    args.model_overrides = {key: literal(val) for key, val in pairs}
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(script)} needs a CUDA GPU (or --device cpu for a smoke test)")
    return args


def literal(text):
    """A --model-overrides value: a Python literal (2, False, 0.1), else the text itself (ddl-cc)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def positive_ints(text, flag, example):
    """'64,32' -> [64, 32] (largest first, no repeats); a SystemExit naming flag otherwise."""
    try:
        values = sorted({int(b) for b in text.split(",") if b.strip()}, reverse=True)
    except ValueError:
        values = []
    if not values or values[-1] < 1:
        raise SystemExit(f"{flag} {text!r}: expected positive integers like {example}")
    return values


def job_main(worker):
    """In a row's own process (`SCRIPT --job FILE`, run_rows): worker(job, row) fills row (the job's labels,
    copied; an exception becomes row["error"]), seeded, then FILE.json gets the row; returns True. Elsewhere
    False. BENCH_CPUS: the cores this process (and what it starts) may use."""
    if sys.argv[1:2] != ["--job"]:
        return False
    import torch

    if os.environ.get("BENCH_CPUS"):
        os.sched_setaffinity(0, [int(c) for c in os.environ["BENCH_CPUS"].split(",")])
    with open(sys.argv[2], "rb") as f:
        job = pickle.load(f)
    row = dict(job["row"])
    try:
        torch.manual_seed(0)
        worker(job, row)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    write_json(sys.argv[2] + ".json", row)
    return True


def gpt(args, size, overrides):
    """(GPT on --device, its config): the preset `size` with block_size --seq, the variant's overrides, then
    --model-overrides; --ddl-backend sets what backend='auto' means."""
    from model import GPT, GPTConfig
    from ops.common import set_auto_backend

    if args.ddl_backend != "auto":
        set_auto_backend(args.ddl_backend)
    cfg = GPTConfig.preset(size, block_size=args.seq, **{**overrides, **args.model_overrides})
    return GPT(cfg).to(args.device), cfg


def run_rows(args, script, specs, settings, tables, job_timeout, parallel=1):
    """Each spec (a dict: `row`, the labels its row starts with, and what the worker needs) measured by its
    own process, `python SCRIPT --job FILE` (job_main), one after another or `parallel` at a time (cpu_slots,
    gpu_turn); args.time_limit bounds the run (run_commands). Prints the command and versions, each row as it
    ends, and last the run's text (command, versions, settings, tables(rows)), which is saved after each row
    (a run cut short keeps its rows) as SCRIPT's NAME.md, with NAME.json (command, versions, settings, rows),
    in args.out when given."""
    t0, done = time.time(), {}
    print(f"Command: `{args.command}`", versions(), sep="\n", flush=True)

    def job(i, spec):
        path = os.path.join(tmp, f"{i}.pkl")
        with open(path, "wb") as f:
            pickle.dump(dict(spec, args=args), f)
        name = " ".join(str(v) for v in spec["row"].values())
        return dict(name=name, i=i, row=spec["row"], cmd=[sys.executable, script, "--job", path])

    def save():
        rows = [done[i] for i in sorted(done)]
        text = "\n".join([f"Command: `{args.command}`", versions(), settings, "", *tables(rows)])
        if args.out:
            path = os.path.join(args.out, os.path.basename(script)[:-3])
            run = dict(command=args.command, versions=versions(), settings=settings, rows=rows)
            write_json(path + ".json", run)
            atomic_write(path + ".md", text + "\n")
        return text

    def on_end(job):
        path = job["cmd"][-1] + ".json"
        if os.path.exists(path):
            with open(path) as f:
                row = json.load(f)
        elif job["status"].startswith("exit"):  # died without a row (crash, killed for memory, ...)
            row = dict(error=f"worker {job['status']}, no result")
        elif job["status"].startswith("not run"):
            row = dict(error="not run: --time-limit reached")
        else:
            row = dict(error=f"no result: {job['status']}")
        row.update(job["row"])
        if "slot" in job:
            row["t_done_s"] = round(time.time() - t0, 1)
            print(json.dumps(row), flush=True)
        done[job["i"]] = row
        save()

    with tempfile.TemporaryDirectory(prefix="bench-", ignore_cleanup_errors=True) as tmp:
        jobs = [job(i, spec) for i, spec in enumerate(specs)]
        slots = cpu_slots(parallel, os.path.join(tmp, "gpu.lock")) if parallel > 1 else [None]
        run_commands(jobs, slots, args.time_limit, job_timeout, min_left=30, on_end=on_end, poll_s=0.2)
    print("\n" + save(), flush=True)


def cpu_slots(n, lock):
    """n slots for run_commands whose jobs run side by side: each gets its share of this process's CPU cores
    (BENCH_CPUS, and as many Inductor compile workers) and the lock file gpu_turn takes (BENCH_GPU_LOCK)."""
    cores = sorted(os.sched_getaffinity(0))
    k = max(1, len(cores) // n)
    shares = [cores[i * k : (i + 1) * k] or cores for i in range(n)]
    env = lambda c: dict(BENCH_CPUS=",".join(map(str, c)), TORCHINDUCTOR_COMPILE_THREADS=str(len(c)))
    return [dict(env(c), BENCH_GPU_LOCK=lock) for c in shares]


@contextlib.contextmanager
def gpu_turn():
    """The GPU to this job alone while the body runs: rows run side by side (run_rows, parallel > 1) take
    turns for their timed parts by an exclusive lock on the file BENCH_GPU_LOCK, and compile meanwhile.
    Nothing to wait for when the variable is unset (one row at a time)."""
    path = os.environ.get("BENCH_GPU_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the OS too if this process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def largest_batch(batches, row, measure, reset=lambda: None):
    """measure(B) for the first B of batches (largest first) that does not run out of GPU memory; the ones
    that did are row["oom_batches"] (reset() and a fresh compile after each). Returns what measure does."""
    import torch

    for B in batches:
        try:
            return measure(B)
        except torch.OutOfMemoryError:
            row.setdefault("oom_batches", []).append(B)
        reset()
        torch._dynamo.reset()
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialized
    raise RuntimeError(f"no micro-batch of {batches} fits")


MASKED = "+doc_mask"  # in a row's variant label: that variant trained with GPTConfig.doc_mask (bench_train)


def throughput_table(rows, ms="step ms"):
    """Markdown of rows with tok_s, step_ms, peak_GB, mfu: ratios against additive + softmax of the same model
    size and the same mask (peak memory only where both ran at the same micro-batch). With masked rows
    (MASKED in the label) a column ×unmasked: tokens/s over the same variant's unmasked row."""
    got = {(r["model"], r["variant"]): r for r in rows if "tok_s" in r}
    with_masked = any(MASKED in r["variant"] for r in rows)
    head = ["model", "variant", "micro-batch", "tokens/s", "×additive", *["×unmasked"] * with_masked, ms,
            "peak GB", "×additive", "MFU", "compile s"]  # fmt: skip
    cells = []
    for r in rows:
        if "tok_s" not in r:
            cells.append(
                [r["model"], r["variant"], f"not measured: {r.get('error', '?')}"] + [""] * (len(head) - 3)
            )
            continue
        masked = MASKED in r["variant"]
        b = got.get((r["model"], "additive" + MASKED * masked))
        ratio = f"{r['tok_s'] / b['tok_s']:.3f}" if b else "-"
        mem_ratio = f"{r['peak_GB'] / b['peak_GB']:.3f}" if b and b["batch"] == r["batch"] else "-"
        cells.append([r["model"], r["variant"], r["batch"], f"{r['tok_s']:,.0f}", ratio])
        if with_masked:  # empty on an unmasked row; "-": its unmasked row was not measured
            u = got.get((r["model"], r["variant"].replace(MASKED, ""))) if masked else None
            cells[-1].append(f"{r['tok_s'] / u['tok_s']:.3f}" if u else "-" if masked else "")
        cells[-1] += [f"{r['step_ms']:.1f}", f"{r['peak_GB']:.1f}", mem_ratio, f"{100 * r['mfu']:.1f}%"]
        cells[-1].append(r.get("compile_s", "-"))
    return "\n".join(markdown(head, cells, ["---"] * 2 + ["---:"] * (len(head) - 2)))
