"""Train every state-tracking config (swap, n = 5) with train.py and print one results table.

    python bench/run_state_tracking.py --seconds 180            # on the GPU: all configs at once
    python bench/run_state_tracking.py --seconds 20 --only df-softmax-k,tf-1 --extra="--device=cpu"

Configs: configs/state_tracking.py plus the overrides in CONFIGS below (1-layer Deltaformers over the
first-stage kernels x w in {k, q}; softmax Transformers with 1, 2, 4 layers; same width). Every run gets
the same training time budget (train.py's max_seconds), then train.py evaluates per-position accuracy on
held-out sequences of length 256 and 512 (512: the curriculum stops at 256, so that is extrapolation).

The models are tiny, so one of them leaves an H200 mostly idle (launch-bound): by default all runs go at
once, one process each, sharing the GPU; the table says so. --parallel 1 runs them one after another.

Before training, a subprocess checks the Triton Deltaformer path against the PyTorch path (bf16 inputs
as under autocast, forward and backward, every first-stage kernel, keys RMS-normed as in the model and
beta in the reflection regime) and times both; the Deltaformer runs use Triton only if it agrees and is
faster, else --backend=torch (--backend forces one). The outcome is in the table header.

Writes to --out (default $OUT, else out-state-tracking-bench): results.md (the table), logs.jsonl (every
log.jsonl record, tagged with its config), stdout.txt (every run's console output). Checkpoints stay in
--work.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common import atomic_write, versions  # noqa: E402  (bench/common.py, this script's folder)

CONFIGS = [  # (name, overrides of configs/state_tracking.py)
    ("df-softmax-k", ["--attention=deltaformer", "--deltaformer_kernel=softmax", "--deltaformer_w=k"]),
    ("df-softmax-q", ["--attention=deltaformer", "--deltaformer_kernel=softmax", "--deltaformer_w=q"]),
    ("df-relu-k", ["--attention=deltaformer", "--deltaformer_kernel=relu", "--deltaformer_w=k"]),
    ("df-relu-q", ["--attention=deltaformer", "--deltaformer_kernel=relu", "--deltaformer_w=q"]),
    ("df-linear-k", ["--attention=deltaformer", "--deltaformer_kernel=linear", "--deltaformer_w=k"]),
    ("df-linear-q", ["--attention=deltaformer", "--deltaformer_kernel=linear", "--deltaformer_w=q"]),
    ("tf-1", ["--attention=softmax", "--n_layer=1"]),
    ("tf-2", ["--attention=softmax", "--n_layer=2"]),
    ("tf-4", ["--attention=softmax", "--n_layer=4"]),
]

CHECK_TRITON = r"""
import time, torch
from kernels.deltaformer import deltaformer_attention
torch.manual_seed(0)
B, H, D = 256, 2, 64
rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
emb = torch.randn(10, D, device="cuda")
for kernel in ("softmax", "relu", "linear"):
    for T in (32, 256):
        # inputs as in the model: RMS-normed keys of 10 token types, w = k, and beta near 2 / (s |k|^2)
        # = 0.25, where one token's update is a reflection: the regime swap tracking needs
        k = rms(emb[torch.randint(0, 10, (B, H, T), device="cuda")])
        q, v = rms(torch.randn_like(k)), torch.randn_like(k)
        x = [t.bfloat16() for t in (q, k, v, k)]
        beta = 0.2 + 0.1 * torch.rand(B, H, T, device="cuda")
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
        r = subprocess.run(
            [sys.executable, "-c", CHECK_TRITON], cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"Triton check timed out after {timeout} s"
    out = (r.stdout + r.stderr).strip().splitlines()
    print("\n".join(out), flush=True)
    if r.returncode == 0 and out and out[-1] == "TRITON_OK":
        return True, "Triton stage 1 (agrees with the PyTorch path and is faster)"
    return False, f"PyTorch stage 1 (Triton check failed: {out[-1] if out else 'no output'})"


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(name, command, records, wall):
    train = [r for r in records if "train_loss" in r]
    evals = [r for r in records if "val_acc" in r]
    final = next((r for r in reversed(records) if r.get("final")), {})
    reached = [r["iter"] for r in evals if r.get("st_length", 0) >= 256]
    row = {
        "config": name,
        "iters": final.get("iter", len(train)),
        "train_s": f"{sum(r['dt_ms'] for r in train) / 1000:.0f}",
        "wall_s": f"{wall:.0f}",
        "len": str(max((r["st_length"] for r in evals), default="-")),
        "256_at": str(reached[0]) if reached else "-",
        "command": command,
    }
    for key, value in final.items():  # val_acc@256, val_acc_last@512, ...: accuracies in %
        if key.startswith("val_acc"):
            row[key[len("val_") :]] = f"{100 * value:.1f}"
    return row


COLUMNS = [
    ("config", "config"),
    ("iters", "iters"),
    ("train_s", "train s"),
    ("wall_s", "wall s"),
    ("len", "final train len"),
    ("256_at", "iter len 256 reached"),
]


def table(rows):
    lengths = sorted({int(k.split("@")[1]) for r in rows for k in r if k.startswith("acc@")})
    columns = COLUMNS + [
        c for L in lengths for c in ((f"acc@{L}", f"acc@{L} %"), (f"acc_last@{L}", f"last-pos acc@{L} %"))
    ]
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(k, "-")) for k, _ in columns) + " |" for r in rows]
    lines += ["", "Commands (from the repository root):", ""]
    lines += [f"- {r['config']}: `{r['command']}`" for r in rows]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=180.0, help="training time budget per config")
    p.add_argument("--parallel", type=int, default=0, help="runs at once (0 = all)")
    p.add_argument("--only", default="", help="comma-separated config names (default: all)")
    p.add_argument("--extra", default="", help="more train.py overrides for every run, space-separated")
    p.add_argument("--out", default=os.environ.get("OUT") or "out-state-tracking-bench")
    p.add_argument("--work", default="out-state-tracking-runs", help="out_dir parent of the runs")
    p.add_argument(
        "--backend", choices=("check", "torch", "triton"), default="check", help="Deltaformer stage 1"
    )
    p.add_argument("--check-timeout", type=float, default=60.0, help="seconds for the Triton check")
    args = p.parse_args()

    known = dict(CONFIGS)
    names = [n for n in args.only.split(",") if n] or [n for n, _ in CONFIGS]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"run_state_tracking: unknown config(s) {unknown}; known: {list(known)}")
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)

    import torch

    header = [versions()]
    backend = [f"--backend={args.backend}"]
    if args.backend != "check":
        header.append(f"Deltaformer stage 1: --backend={args.backend} (forced)")
    elif not torch.cuda.is_available():
        backend = ["--backend=torch"]
        header.append("Deltaformer stage 1: PyTorch path (no CUDA)")
    elif any(known[n][0] == "--attention=deltaformer" for n in names):
        use_triton, note = check_triton(timeout=args.check_timeout)
        backend = ["--backend=triton" if use_triton else "--backend=torch"]
        header.append(f"Deltaformer stage 1: {note}")
    parallel = args.parallel or len(names)
    header.append(
        f"{len(names)} configs, {parallel} at a time on one device, {args.seconds:.0f} s training budget each"
    )
    print("\n".join(header), flush=True)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    pending, running, done = list(names), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            out_dir = os.path.join(args.work, name)
            os.makedirs(out_dir, exist_ok=True)
            cmd = ["python", "train.py", "configs/state_tracking.py", *known[name]]
            cmd += backend if known[name][0] == "--attention=deltaformer" else []
            cmd += [f"--max_seconds={args.seconds:g}", *args.extra.split()]
            log = open(os.path.join(out_dir, "stdout.txt"), "w")  # noqa: SIM115 (closed when it ends)
            proc = subprocess.Popen(
                [sys.executable, *cmd[1:], f"--out_dir={out_dir}"], cwd=REPO, stdout=log, stderr=log, env=env
            )
            running[name] = (proc, log, time.time(), " ".join(cmd))
            print(f"started {name}: {' '.join(cmd)}", flush=True)
        time.sleep(1.0)
        for name, (proc, log, t0, command) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                done[name] = (proc.returncode, time.time() - t0, command)
                del running[name]
                print(f"finished {name}: exit {proc.returncode} after {time.time() - t0:.0f} s", flush=True)

    rows, all_records, stdout = [], [], []
    for name in names:
        rc, wall, command = done[name]
        out_dir = os.path.join(args.work, name)
        with open(os.path.join(out_dir, "stdout.txt")) as f:
            text = f.read()
        stdout.append(f"===== {name} (exit {rc}): {command}\n{text}")
        log_path = os.path.join(out_dir, "log.jsonl")
        records = read_log(log_path) if os.path.exists(log_path) else []
        all_records += [json.dumps({"config": name, **r}) for r in records]
        row = summarise(name, command, records, wall)
        if rc != 0:
            row["config"] += f" (exit {rc})"
        rows.append(row)

    result = "\n".join(["# State tracking: swap, n = 5", "", *[f"- {h}" for h in header], "", table(rows)])
    atomic_write(os.path.join(args.out, "results.md"), result + "\n")
    atomic_write(os.path.join(args.out, "logs.jsonl"), "\n".join(all_records) + "\n")
    atomic_write(os.path.join(args.out, "stdout.txt"), "\n".join(stdout))
    print("\n" + result, flush=True)


if __name__ == "__main__":
    main()
