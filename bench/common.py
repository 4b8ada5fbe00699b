"""What the benchmark scripts share: the timers, a table's header (command, versions) and markdown, safe file
writes, and running commands a few at a time."""

import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

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
    the deadline', 'killed after N s', 'not run: time limit'), seconds, slot; on_end(job) as it ends. Returns
    the jobs."""
    pending, running, t0 = list(jobs), {}, time.time()
    on_end = on_end or (lambda job: None)
    left = lambda: time_limit - (time.time() - t0) if time_limit else math.inf
    while pending or running:
        for i, slot in enumerate(slots):
            if i in running or not pending or left() < min_left:
                continue
            job = pending.pop(0)
            env = dict(os.environ, **job.get("env", {}))
            if slot is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            log = open(job["log"], "w") if job.get("log") else None  # noqa: SIM115 (the child keeps a copy)
            proc = subprocess.Popen(job["cmd"], stdout=log, stderr=log and subprocess.STDOUT,
                                    cwd=job.get("cwd"), env=env)  # fmt: skip
            if log:
                log.close()
            running[i] = (job, proc, time.time())
            job["slot"] = slot
            print(f"started {job['name']}" + (f" on GPU(s) {slot}" if slot is not None else ""), flush=True)
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
