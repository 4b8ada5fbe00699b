"""Does this code train like another checkout of it? The same short runs, loss for loss, beside a yardstick.

    git worktree add ../ref COMMIT        # the code to compare against
    python bench/bench_curves.py --ref ../ref --variants ddl,ddl-cc,ddl-tc --iters 200 --out DIR
    python bench/bench_curves.py --table DIR                # the table of finished runs

For each variant, three `train.py configs/shakespeare.py` runs at once (same seed, data and recipe) in
DIR/<variant>-<run>: this (this checkout), ref (the --ref checkout's train.py and model.py on this
checkout's data) and split (this checkout, each batch as two micro-batches of half the rows: the same sums
in another order, so |split - this| is what bf16 rounding alone moves). The table: the largest and mean
|train loss difference| over the iterations, ref and split (the yardstick) against this; the final losses.
"""

import argparse
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, Span, atomic_write, command, markdown, read_jsonl, run_commands, versions  # noqa: E402

CONFIG = "configs/shakespeare.py"
VARIANTS = ("additive", "ddl", "ddl-cc", "ddl-tc")  # GPTConfig.residual
RUNS = ("this", "ref", "split")


def run_args(variant, run, iters, data_dir, extra=()):
    """train.py's arguments (after the config file) for one run; extra: more KEY=VALUE config keys."""
    args = dict(max_iters=iters, lr_decay_iters=iters, eval_interval=iters, log_interval=max(iters // 10, 1))
    args |= dict(data_dir=os.path.abspath(data_dir), overwrite=True, residual=variant)
    args |= dict(kv.split("=", 1) for kv in extra)
    if run == "split":  # the batch of the others as twice the micro-steps of half the rows
        config = runpy.run_path(os.path.join(REPO, CONFIG))
        rows = int(args.get("batch_size", config["batch_size"]))
        steps = int(args.get("gradient_accumulation_steps", config["gradient_accumulation_steps"]))
        if rows % 2:
            raise ValueError(f"the split run halves batch_size, which must be even, got {rows}")
        args |= dict(batch_size=rows // 2, gradient_accumulation_steps=2 * steps)
    return [f"--{k}={v}" for k, v in args.items()]


def train_losses(run_dir):
    """{iteration: train loss} from a run's log.jsonl ({} if it has none)."""
    records = read_jsonl(os.path.join(run_dir, "log.jsonl"))
    return {r["iter"]: r["train_loss"] for r in records if "train_loss" in r}


def diffs(a, b):
    """(max, mean) |a - b| over the iterations both have, or None if they share none."""
    d = [abs(a[i] - b[i]) for i in sorted(set(a) & set(b))]
    return (max(d), sum(d) / len(d)) if d else None


def table(out, variants):
    fmt = lambda d: ["n/a", "n/a"] if d is None else [f"{d[0]:.2e}", f"{d[1]:.2e}"]  # noqa: E731
    head = ["variant", "iters", "ref - this: max", "mean", "split - this (yardstick): max", "mean"]
    rows = []
    for v in variants:
        losses = {run: train_losses(os.path.join(out, f"{v}-{run}")) for run in RUNS}
        this = losses["this"]
        last = max(this) if this else None
        final = f"{this[last]:.4f} / {losses['ref'].get(last, float('nan')):.4f}" if this else "n/a"
        ref, split = diffs(losses["ref"], this), diffs(losses["split"], this)
        rows.append([v, len(this), *fmt(ref), *fmt(split), final])
    return "\n".join(markdown(head + ["final this / ref"], rows, ["---"] + ["---:"] * 5 + ["---"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", help="the other checkout (its train.py is run)")
    p.add_argument("--variants", default="ddl,ddl-cc,ddl-tc", help=f"comma-separated, of {tuple(VARIANTS)}")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default="out-curves")
    p.add_argument("--data-dir", default=os.path.join(REPO, "data", "shakespeare"), help="train.bin, val.bin")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more train.py config keys")
    p.add_argument("--table", metavar="DIR", help="only print the table of the runs in DIR")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {tuple(VARIANTS)}")
    bad = [kv for kv in args.set if "=" not in kv]
    if bad:
        p.error(f"--set takes KEY=VALUE, got {bad}")
    if args.table:
        print(table(args.table, variants))
        return
    if not args.ref or not os.path.exists(os.path.join(args.ref, "train.py")):
        p.error(f"--ref must be a checkout holding train.py, got {args.ref!r}")
    jobs = []
    for v in variants:
        for run in RUNS:
            run_dir = os.path.abspath(os.path.join(args.out, f"{v}-{run}"))
            os.makedirs(run_dir, exist_ok=True)
            cmd = [sys.executable, "train.py", CONFIG, f"--out_dir={run_dir}"]
            cmd += run_args(v, run, args.iters, args.data_dir, args.set)
            cwd = os.path.abspath(args.ref) if run == "ref" else REPO
            jobs.append(dict(name=run_dir, cmd=cmd, cwd=cwd, log=os.path.join(run_dir, "train.out")))
    with Span() as took:
        failed = [j["name"] for j in run_commands(jobs, [None] * len(jobs)) if j["status"] != "exit 0"]
    report = f"Command: `{command(__file__, argv)}`\n{versions()}\n{len(jobs)} runs in {took.seconds:.0f} s"
    report += f"; failed (see train.out): {failed}\n\n" if failed else "\n\n"
    report += table(args.out, variants)
    print(report)
    atomic_write(os.path.join(args.out, "curves.md"), report + "\n")


if __name__ == "__main__":
    main()
