"""Multi-GPU check of train.py: one global batch on 1 and on N GPUs gives the same losses, N times faster.

    python bench/bench_ddp.py --stage single --gpus 0          # 1-GPU runs of every variant
    python bench/bench_ddp.py --stage multi --gpus 0,1         # torchrun on those N GPUs, same batch
    python bench/bench_ddp.py --stage yardstick --gpus 0,1     # 1 GPU, other micro-batch split (noise scale)
    python bench/bench_ddp.py --stage report --out $OUT        # the table (report needs no GPU)

Every run: `train.py configs/gpt2_small.py` on Shakespeare, a global batch of --batch-size x --grad-accum
rows of 1024 tokens (on N GPUs each rank takes --grad-accum / N of the micro-steps: the same data). The
yardstick runs 1 GPU with micro-steps twice as large: the same math in another summation order, so its loss
difference to the 1-GPU run is the scale of bf16 noise. Loss: train.py's train_loss; tokens/s: the median
over iterations --skip..; peak memory: rank 0's. Runs stay in --work: a stage can be rerun alone.
"""

import argparse
import json
import os
import pathlib
import re
import sys

from common import REPO, atomic_write, markdown, read_jsonl, run_commands, versions  # bench/common.py

CONFIG = "configs/gpt2_small.py"
STAGES = ("single", "multi", "yardstick")


def train_command(args, variant, stage):
    """(argv, env overrides) of one run; the global batch is the same in every stage."""
    batch, accum = args.batch_size, args.grad_accum
    if stage == "yardstick":  # same global batch, micro-steps twice as large
        if accum % 2:
            sys.exit(f"bench_ddp: --grad-accum must be even for the yardstick, got {accum}")
        batch, accum = 2 * batch, accum // 2
    # evaluate at iteration 0 and at the end only; overwrite: a stage can be rerun into its folder
    overrides = [
        f"--residual={variant}", "--dataset=shakespeare", f"--batch_size={batch}",
        f"--gradient_accumulation_steps={accum}", f"--max_iters={args.iters}",
        f"--warmup_iters={args.warmup}", f"--lr_decay_iters={10 * args.iters}", "--eval_interval=1000000",
        "--eval_iters=1", "--log_interval=10", "--overwrite=True",
        f"--out_dir={os.path.join(args.work, f'{variant}-{stage}')}",
    ]  # fmt: skip
    train = [os.path.join(REPO, "train.py"), os.path.join(REPO, CONFIG), *overrides]
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus.count(',') + 1}"]
    return [sys.executable, *(torchrun if stage == "multi" else []), *train]


def shown(arg):
    """An argument as a reader would type it: `python`, paths relative to the repository root."""
    return "python" if arg == sys.executable else os.path.relpath(arg, REPO) if arg.startswith(REPO) else arg


def run_stage(args, stage):
    """All variants of one stage: the single-GPU stages one run per GPU of --gpus at a time, the multi stage
    on all of them. Returns the variants that failed."""
    gpus = [g for g in args.gpus.split(",") if g] if stage != "multi" else [args.gpus]
    jobs = []
    for variant in args.variants:
        out_dir = os.path.join(args.work, f"{variant}-{stage}")
        os.makedirs(out_dir, exist_ok=True)
        jobs.append(dict(name=f"[{stage}] {variant}", cmd=train_command(args, variant, stage), cwd=REPO,
                         log=os.path.join(out_dir, "stdout.txt"), env=dict(PYTHONUNBUFFERED="1"),
                         variant=variant, out_dir=out_dir))  # fmt: skip

    def on_end(job):  # the command as run, with the GPU(s) it got
        with open(os.path.join(job["out_dir"], "command.txt"), "w") as f:
            f.write(f"CUDA_VISIBLE_DEVICES={job['slot']} " + " ".join(shown(c) for c in job["cmd"]) + "\n")

    run_commands(jobs, gpus, on_end=on_end)
    return [job["variant"] for job in jobs if job["status"] != "exit 0"]


def read_run(args, variant, stage):
    """{losses, tok_s (median), peak_gib, ranks, command} of a finished run, or None."""
    out_dir = os.path.join(args.work, f"{variant}-{stage}")
    if not os.path.exists(os.path.join(out_dir, "log.jsonl")):
        return None
    records = read_jsonl(os.path.join(out_dir, "log.jsonl"))
    train = sorted((r for r in records if "train_loss" in r), key=lambda r: r["iter"])
    rates = sorted(r["tok_per_s"] for r in train if r["iter"] >= args.skip)
    text = pathlib.Path(out_dir, "stdout.txt").read_text()
    peak = re.findall(r"peak memory ([0-9.]+) GiB", text)
    ranks = re.findall(r"(\d+) rank\(s\) on", text)
    return dict(losses=[r["train_loss"] for r in train], tok_s=rates[len(rates) // 2] if rates else None,
                peak_gib=float(peak[-1]) if peak else None, ranks=int(ranks[-1]) if ranks else None,
                command=pathlib.Path(out_dir, "command.txt").read_text().strip())  # fmt: skip


def max_difference(a, b, n):
    """(largest |a_i - b_i| over the first n iterations, its iteration); needs n values in both."""
    if len(a) < n or len(b) < n:
        raise ValueError(f"need {n} losses in both runs, got {len(a)} and {len(b)}")
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    i = max(range(n), key=diffs.__getitem__)
    return diffs[i], i


def report(args):
    head = ["variant", "run", "ranks x micro-batch x micro-steps", "tokens/s", "scaling vs 1 GPU"]
    head += ["peak GiB (rank 0)", f"max abs loss diff to 1 GPU, first {args.iters} iters (at iter)"]
    summary, commands, rows = {}, [], []
    every = {(v, s): read_run(args, v, s) for v in args.variants for s in STAGES}
    for variant in args.variants:
        runs = {s: every[variant, s] for s in STAGES}
        base = runs["single"]
        for stage, r in runs.items():
            if r is None:
                rows.append([variant, stage, "not run", "", "", "", ""])
                continue
            commands.append(f"- {variant} {stage}: `{r['command']}`")
            ranks, split = r["ranks"] or 1, 2 if stage == "yardstick" else 1  # yardstick: 2x micro-steps
            shape = f"{ranks} x {args.batch_size * split} x {args.grad_accum // split // ranks}"
            scaling = diff = ""
            if base and base["tok_s"] and r["tok_s"] and stage == "multi":
                s = r["tok_s"] / base["tok_s"]
                scaling = f"{s:.2f}x ({s / ranks:.2f} of {ranks}x)"
                summary[(variant, "scaling")] = s / ranks
            if base and stage != "single":
                try:
                    d, at = max_difference(base["losses"], r["losses"], args.iters)
                    diff = f"{d:.2e} (iter {at})"
                    summary[(variant, stage)] = d
                except ValueError as e:
                    diff = str(e)
            tok = f"{r['tok_s']:,.0f}" if r["tok_s"] else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] else "-"
            rows.append([variant, stage, shape, tok, scaling, peak, diff])
    text = "\n".join([
        f"Global batch {args.batch_size * args.grad_accum} rows of 1024 tokens, {args.iters} iterations of "
        f"{CONFIG} on Shakespeare (warmup {args.warmup}, lr 1e-3), bf16 autocast, compiled, "
        f"fused AdamW on GPU. tokens/s: median over iterations {args.skip}..{args.iters - 1}.",
        versions(), "", *markdown(head, rows, ["---"] * 3 + ["---:"] * 3 + ["---"]),
        "", "Commands:", "", *commands,
    ])  # fmt: skip
    print(text)
    if args.out:
        atomic_write(os.path.join(args.out, "bench_ddp.md"), text + "\n")
        losses = {f"{v}-{s}": (r or {}).get("losses") for (v, s), r in every.items()}
        atomic_write(os.path.join(args.out, "bench_ddp_losses.json"), json.dumps(losses))
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", required=True, choices=(*STAGES, "report"))
    p.add_argument("--variants", default="additive,ddl-cc", help="residual variants (softmax attention)")
    p.add_argument("--gpus", default="0", help="single/yardstick: one run per GPU at a time; multi: all")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--skip", type=int, default=10, help="iterations left out of the tokens/s median")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="rows per micro-step (single and multi)")
    p.add_argument("--grad-accum", type=int, default=8, help="GLOBAL micro-steps per iteration")
    p.add_argument("--work", default="out-bench-ddp")
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    nproc = len(args.gpus.split(","))
    if args.stage == "multi" and args.grad_accum % nproc:
        sys.exit(f"bench_ddp: --grad-accum {args.grad_accum} must be divisible by the {nproc} GPUs of --gpus")
    if args.stage == "report":
        return report(args)
    failed, stage = run_stage(args, args.stage), args.stage
    if failed:
        sys.exit(f"bench_ddp: {stage} failed for {failed}: see {args.work}/<variant>-{stage}/stdout.txt")


if __name__ == "__main__":
    main()
