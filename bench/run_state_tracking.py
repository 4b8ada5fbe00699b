"""Train the state-tracking configs (swaps of n = 5; DAG reachability) with train.py; print result tables.

    python bench/run_state_tracking.py --seconds 210                 # on the GPU: every task and config
    python bench/run_state_tracking.py --tasks swap --only df-linear-k,tf-1 --seconds 20 --extra=--device=cpu

Runs <task>/<model>: configs/state_tracking.py with the task's overrides (TASKS) and the model's (MODELS:
1-layer Deltaformers over the first-stage kernels x w in {k, q, proj}; softmax Transformers of 1, 2, 4
layers); --only takes model or run names. All runs at once, one process each, each training --seconds, then
train.py's held-out per-position accuracy; one still going --deadline s after the start is killed. The runs
use the Triton Deltaformer path only if a subprocess (CHECK_TRITON) finds it agrees with PyTorch's and is
faster. To --out: results.md, logs.jsonl (every run's log records), stdout.txt; checkpoints stay in --work.
Setup and results: bench/STATE_TRACKING.md.
"""

import argparse
import json
import os
import subprocess
import sys

from common import REPO, atomic_write, command, markdown, read_jsonl, run_commands, versions

DF = ["--attention=deltaformer", "--n_layer=1"]
MODELS = [  # (name, overrides of configs/state_tracking.py)
    *[(f"df-{kernel}-{w}", [*DF, f"--deltaformer_kernel={kernel}", f"--deltaformer_w={w}"])
      for kernel in ("softmax", "relu", "linear") for w in ("k", "q", "proj")],
    *[(f"tf-{n}", ["--attention=softmax", f"--n_layer={n}"]) for n in (1, 2, 4)],
]  # fmt: skip
TASKS = {  # name: (title, overrides of configs/state_tracking.py, the curriculum's target length or None)
    "swap": ("swap, n = 5", [], 256),
    "dag": ("DAG reachability, 32 nodes", ["--st_task=dag", "--st_n_nodes=32", "--vocab_size=33",
            "--st_length=93", "--st_curriculum=False", "--st_eval_lengths=(93,189)"], None),
}  # fmt: skip

CHECK_TRITON = r"""
import time, torch
from ops.deltaformer import deltaformer_attention
torch.manual_seed(0)
B, H, D = 256, 2, 64
rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
emb = torch.randn(10, D, device="cuda")
for kernel in ("softmax", "relu", "linear"):
    for T in (32, 256):
        # inputs as in the model: RMS-normed keys of 10 token types, w = k, and beta near 2 (softmax rows
        # sum to 1; relu / linear kappa(k, k) = 1 on unit keys), where one token's update is a reflection:
        # the regime swap tracking needs
        k = rms(emb[torch.randint(0, 10, (B, H, T), device="cuda")])
        q, v = rms(torch.randn_like(k)), torch.randn_like(k)
        x = [t.bfloat16() for t in (q, k, v, k)]
        beta = 1.8 + 0.2 * torch.rand(B, H, T, device="cuda")
        grads, times = [], []
        for backend in ("torch", "triton"):
            ins = [t.clone().requires_grad_() for t in x] + [beta.clone().requires_grad_()]
            o = deltaformer_attention(*ins, kernel=kernel, backend=backend)
            o.float().square().sum().backward()
            grads.append([o.float()] + [t.grad.float() for t in ins])
            torch.cuda.synchronize(); t0 = time.time()
            for _ in range(5):
                o = deltaformer_attention(*ins, kernel=kernel, backend=backend)
                o.float().square().sum().backward()
            torch.cuda.synchronize(); times.append((time.time() - t0) / 5)
        errs = [((a - b).norm() / b.norm().clamp(min=1e-6)).item() for a, b in zip(*grads)]
        print(f"{kernel} T={T}: torch {1e3 * times[0]:.1f} ms, triton {1e3 * times[1]:.1f} ms (fwd+bwd); "
              "triton vs torch rel. error, o dq dk dv dw dbeta: " + ", ".join(f"{e:.1e}" for e in errs))
        assert all(e == e and e < 3e-2 for e in errs), f"{kernel} T={T}: triton disagrees with torch"
        assert T < 256 or times[1] < times[0], "triton slower than torch at T=256"
print("TRITON_OK")
"""


def check_triton(timeout):
    """(use_triton, note) from running CHECK_TRITON in a subprocess (a hang or crash means: no)."""
    try:
        cmd = [sys.executable, "-c", CHECK_TRITON]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"Triton check timed out after {timeout} s"
    out = (r.stdout + r.stderr).strip().splitlines()
    print("\n".join(out), flush=True)
    if r.returncode == 0 and out and out[-1] == "TRITON_OK":
        return True, "Triton stage 1 (agrees with the PyTorch path and is faster)"
    return False, f"PyTorch stage 1 (Triton check failed: {out[-1] if out else 'no output'})"


def summarise(job, records, target):
    """A run's row of the table from its job (run_commands: status, seconds) and its log records."""
    train = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_acc" in r]
    final = next((r for r in reversed(records) if r.get("final")), {})
    config = job["name"] + ("" if job["status"] == "exit 0" else f" ({job['status']})")
    row = dict(config=config, iters=final.get("iter", len(train)), wall_s=f"{job['seconds']:.0f}")
    row["command"] = job["shown"]
    row["train_s"] = f"{sum(r['dt_ms'] for r in train) / 1000:.0f}"
    if target:  # the curriculum: the last training length, and the iteration that reached the target
        reached = [r["iter"] for r in evals if r.get("st_length", 0) >= target]
        row["len"] = str(max((r["st_length"] for r in evals), default="-"))
        row["target_at"] = str(reached[0]) if reached else "-"
    for key, value in final.items():  # val_acc@256, val_acc_last@512, ...: accuracies in %
        if key.startswith("val_acc"):
            row[key[len("val_") :]] = f"{100 * value:.1f}"
    return row


def table(rows, target):
    columns = [("config", "config"), ("iters", "iters"), ("train_s", "train s"), ("wall_s", "wall s")]
    if target:
        columns += [("len", "final train len"), ("target_at", f"iter len {target} reached")]
    for L in sorted({int(k.split("@")[1]) for r in rows for k in r if k.startswith("acc@")}):
        columns += [(f"acc@{L}", f"acc@{L} %"), (f"acc_last@{L}", f"last-pos acc@{L} %")]
    lines = markdown([h for _, h in columns], [[r.get(k, "-") for k, _ in columns] for r in rows])
    lines += ["", "Commands (from the repository root; the bench adds --out_dir):", ""]
    lines += [f"- {r['config']}: `{r['command']}`" for r in rows]
    return "\n".join(lines)


def select(tasks, only):
    """[(run name, task, train.py overrides)] of the selected tasks and models."""
    wanted = {n for n in only.split(",") if n}
    runs = [(f"{task}/{model}", task, [*TASKS[task][1], *overrides]) for task in tasks for model, overrides
            in MODELS if not wanted or model in wanted or f"{task}/{model}" in wanted]  # fmt: skip
    known = {m for m, _ in MODELS} | {f"{t}/{m}" for t in tasks for m, _ in MODELS}
    unknown = sorted(wanted - known)
    if unknown:
        sys.exit(f"run_state_tracking: unknown config(s) {unknown}; known models: {[m for m, _ in MODELS]}")
    return runs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="swap,dag", help=f"comma-separated, of {list(TASKS)}")
    p.add_argument("--seconds", type=float, default=180.0, help="training time budget per config")
    p.add_argument("--deadline", type=float, default=0.0, help="kill runs after this (0: seconds + 300)")
    p.add_argument("--only", default="", help="comma-separated model or run names (default: all)")
    p.add_argument("--extra", default="", help="more train.py overrides for every run, space-separated")
    p.add_argument("--out", default=os.environ.get("OUT") or "out-state-tracking-bench")
    p.add_argument("--work", default="out-state-tracking-runs", help="out_dir parent of the runs")
    p.add_argument("--check-timeout", type=float, default=60.0, help="seconds for the Triton check")
    args = p.parse_args()

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or any(t not in TASKS for t in tasks):
        sys.exit(f"run_state_tracking: --tasks must name some of {list(TASKS)}, got {args.tasks!r}")
    if args.seconds < 0 or args.deadline < 0:
        sys.exit(f"run_state_tracking: --seconds {args.seconds:g}, --deadline {args.deadline:g}: need >= 0")
    runs = select(tasks, args.only)
    deadline = args.deadline or args.seconds + 300

    import torch

    header = [f"Command: `{command(__file__)}`", versions()]
    deltaformer = lambda overrides: "--attention=deltaformer" in overrides  # noqa: E731
    backend = []
    if not torch.cuda.is_available():
        backend = ["--backend=torch"]
        header.append("Deltaformer stage 1: PyTorch path (no CUDA)")
    elif any(deltaformer(overrides) for _, _, overrides in runs):
        use_triton, note = check_triton(timeout=args.check_timeout)
        backend = ["--backend=triton" if use_triton else "--backend=torch"]
        header.append(f"Deltaformer stage 1: {note}")
    header.append(f"{len(runs)} runs at once on one device, {args.seconds:g} s training budget each, "
                  f"killed after {deadline:g} s")  # fmt: skip
    print("\n".join(header), flush=True)

    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    jobs = []
    for name, _, overrides in runs:
        out_dir = os.path.join(args.work, name)
        os.makedirs(out_dir, exist_ok=True)
        cmd = ["python", "train.py", "configs/state_tracking.py", *overrides]
        cmd += backend if deltaformer(overrides) else []
        cmd += [f"--max_seconds={args.seconds:g}", *args.extra.split()]
        full = [sys.executable, *cmd[1:], f"--out_dir={out_dir}", "--overwrite=True"]
        jobs.append(dict(name=name, cmd=full, shown=" ".join(cmd), cwd=REPO, env=env,
                         log=os.path.join(out_dir, "stdout.txt")))  # fmt: skip
    done = {job["name"]: job for job in run_commands(jobs, [None] * len(jobs), time_limit=deadline)}

    sections, all_records, stdout = [], [], []
    for task in tasks:
        title, _, target = TASKS[task]
        rows = []
        for name in (name for name, run_task, _ in runs if run_task == task):
            job, out_dir = done[name], os.path.join(args.work, name)
            with open(os.path.join(out_dir, "stdout.txt")) as f:
                stdout.append(f"===== {name} ({job['status']}): {job['shown']}\n{f.read()}")
            records = read_jsonl(os.path.join(out_dir, "log.jsonl"))
            all_records += [json.dumps({"config": name, **r}) for r in records]
            rows.append(summarise(job, records, target))
        sections += [f"## {title}", "", table(rows, target), ""]

    result = "\n".join(["# State tracking", "", *[f"- {h}" for h in header], "", *sections])
    for name, text in (("results.md", result), ("logs.jsonl", "\n".join(all_records) + "\n"),
                       ("stdout.txt", "\n".join(stdout))):  # fmt: skip
        atomic_write(os.path.join(args.out, name), text)
    print("\n" + result, flush=True)


if __name__ == "__main__":
    main()
