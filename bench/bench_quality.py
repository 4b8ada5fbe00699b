"""Quality side by side: the README's variant rows trained with one recipe and token budget, >= 2 seeds.

    python bench/bench_quality.py --setting shakespeare --seeds 1 2 --out DIR        # every row, 8L x 512
    python bench/bench_quality.py --setting corpus --seeds 1 --out DIR --data-dir D   # main rows, GPT-2 small
    python bench/bench_quality.py --table DIR [DIR ...] [--plot loss.png]   # the table of finished runs

Each (row, seed) is one `train.py` run in DIR/<setting>/<row>-s<seed> (its log.jsonl, ckpt.pt and console
output train.out); --parallel runs share the GPU. The table gives, per row, the mean and spread (max - min)
over seeds of the best and of the final validation loss, and the best's difference from the additive
baseline of the same table; a run that stopped early (non-finite loss, crash, --max-seconds) is marked.

Settings (lr 1e-3, AdamW (0.9, 0.95), wd 0.1, clip 1.0, warmup + cosine to 1e-4, as the papers):
  shakespeare: 8 layers x d 512 (4 heads x 128), block 512, 800 iterations x 16 x 512 = 8K tokens,
               eager (no compile); data/shakespeare (python data/shakespeare.py).
  corpus:      GPT-2 small (12 x 768, 6 x 128), block 1024, 384 iterations x 64 x 1024 = 25.2M tokens,
               compiled; shards of data/fineweb_edu.py in --data-dir (e.g. from data/package_corpus.py).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import atomic_write, versions  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = dict(
    learning_rate=1e-3, min_lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, dropout=0.0
)
SETTINGS = {
    "shakespeare": dict(
        dataset="shakespeare", n_layer=8, n_embd=512, n_head=4, head_dim=128, block_size=512, batch_size=16,
        gradient_accumulation_steps=1, max_iters=800, warmup_iters=80, lr_decay_iters=800,
        eval_interval=100, eval_iters=8, log_interval=100, compile=False,
    ),
    "corpus": dict(
        dataset="fineweb_edu", n_layer=12, n_embd=768, n_head=6, head_dim=128, block_size=1024, batch_size=16,
        gradient_accumulation_steps=4, max_iters=384, warmup_iters=40, lr_decay_iters=384,
        eval_interval=128, eval_iters=8, log_interval=32, compile=True,
    ),
}  # fmt: skip
ROWS = {  # name -> GPTConfig overrides; the README's variant table
    "additive": dict(residual="additive"),
    "ddl": dict(residual="ddl"),
    "ddl-tc": dict(residual="ddl-tc"),
    "ddl-cc": dict(residual="ddl-cc"),
    "ddl-cc-no-ec": dict(residual="ddl-cc", ddl_ec=False),
    "ddl-cc-bf16-state": dict(residual="ddl-cc", ddl_state_dtype="bfloat16"),
    "ddl-cc-write-only": dict(residual="ddl-cc", ddl_erase=False),
    "deltaformer-softmax": dict(attention="deltaformer", deltaformer_kernel="softmax"),
    "deltaformer-relu": dict(attention="deltaformer", deltaformer_kernel="relu"),
    "deltaformer-linear": dict(attention="deltaformer", deltaformer_kernel="linear"),
    "ddl-cc+deltaformer": dict(residual="ddl-cc", attention="deltaformer"),
}
PARALLEL = {"shakespeare": 10, "corpus": 6}  # runs at a time: ~9-11 GB and ~12-20 GB each on the GPU
DEFAULT_ROWS = {
    "shakespeare": [r for r in ROWS if r != "ddl-cc-bf16-state"],
    "corpus": ["additive", "ddl", "ddl-tc", "ddl-cc", "ddl-cc-bf16-state", "deltaformer-softmax"],
}


def run_args(setting, row, seed, out_dir, data_dir=None, max_seconds=0.0, extra=()):
    keys = {**RECIPE, **SETTINGS[setting], **ROWS[row], "seed": seed, "out_dir": out_dir, "overwrite": True}
    if data_dir:
        keys["data_dir"] = data_dir
    if max_seconds:
        keys["max_seconds"] = max_seconds
    args = [f"--{k}={v}" for k, v in keys.items()] + [f"--{kv}" for kv in extra]
    return [sys.executable, os.path.join(REPO, "train.py"), *args]


def launch_all(jobs, parallel, on_finish=lambda: None):
    """Run (cmd, out_dir) jobs, `parallel` at a time; each writes its console output to out_dir/train.out.
    on_finish() runs after each job ends (the table so far, so that a run cut short keeps it)."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            cmd, out_dir = pending.pop(0)
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "train.out"), "w") as f:
                running.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO), out_dir))
            print(f"started {out_dir}", flush=True)
        time.sleep(2)
        for proc, out_dir in list(running):
            if proc.poll() is not None:
                running.remove((proc, out_dir))
                print(f"finished {out_dir} (exit {proc.returncode})", flush=True)
                on_finish()


def read_run(out_dir):
    """(val losses by iteration, the last iteration logged, finished?) from out_dir/log.jsonl, train.out."""
    path = os.path.join(out_dir, "log.jsonl")
    vals, last_iter, final = {}, -1, False
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                last_iter = max(last_iter, rec.get("iter", -1))
                if "val_loss" in rec:
                    vals[rec["iter"]] = rec["val_loss"]
    console = os.path.join(out_dir, "train.out")
    if os.path.exists(console):
        with open(console, errors="replace") as f:
            final = any(line.startswith("done:") for line in f)
    return vals, last_iter, final


def stat(xs):
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "—"
    mean = sum(xs) / len(xs)
    return f"{mean:.4f} ± {(max(xs) - min(xs)) / 2:.4f}" if len(xs) > 1 else f"{mean:.4f}"


def table(dirs):
    """Markdown table over every <row>-s<seed> run found under dirs (grouped by setting folder)."""
    runs = {}  # (setting, row) -> [(seed, best, final, note)]
    for top in dirs:
        top = os.path.normpath(top)
        if os.path.basename(top) in SETTINGS:  # a setting's own folder
            top, settings = os.path.dirname(top), [os.path.basename(top)]
        else:
            settings = sorted(os.listdir(top)) if os.path.isdir(top) else []
        for setting in settings:
            if setting not in SETTINGS or not os.path.isdir(os.path.join(top, setting)):
                continue
            for name in sorted(os.listdir(os.path.join(top, setting))):
                row, _, seed = name.rpartition("-s")
                if row not in ROWS:
                    continue
                vals, last_iter, final = read_run(os.path.join(top, setting, name))
                finite = [v for v in vals.values() if math.isfinite(v)]
                best = min(finite) if finite else float("nan")
                last = vals[max(vals)] if vals else float("nan")
                note = (
                    "" if final and all(map(math.isfinite, vals.values())) else f"stopped at iter {last_iter}"
                )
                runs.setdefault((setting, row), []).append((seed, best, last, note))
    if not runs:
        raise ValueError(f"no runs (<setting>/<row>-s<seed> folders) under {', '.join(dirs)}")
    lines = []
    for setting in SETTINGS:
        rows = [r for r in ROWS if (setting, r) in runs]
        if not rows:
            continue
        base = runs.get((setting, "additive"))
        base_best = sum(r[1] for r in base) / len(base) if base else float("nan")
        lines += [
            f"\n**{setting}** ({SETTINGS[setting]['max_iters']} iterations; best and final validation loss, "
            "mean ± half-range over seeds)\n",
            "| row | seeds | best val | final val | best − additive | runs |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            rs = runs[(setting, r)]
            bests = [x[1] for x in rs if math.isfinite(x[1])]
            mean_best = sum(bests) / len(bests) if bests else float("nan")
            notes = "; ".join(f"s{x[0]} {x[3]}" for x in rs if x[3]) or "ok"
            seeds, best, final = (
                ",".join(x[0] for x in rs),
                stat([x[1] for x in rs]),
                stat([x[2] for x in rs]),
            )
            lines.append(f"| {r} | {seeds} | {best} | {final} | {mean_best - base_best:+.4f} | {notes} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=tuple(SETTINGS))
    p.add_argument("--rows", nargs="+", choices=tuple(ROWS), help="default: the setting's rows")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--out", default="out-quality", help="runs go to OUT/<setting>/<row>-s<seed>")
    p.add_argument("--data-dir", help="corpus: the shard folder (data/fineweb_edu.py --out)")
    p.add_argument("--parallel", type=int, help="runs at a time on the one GPU (default: what fits an H200)")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop each run after this training time")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more train.py config keys")
    p.add_argument("--table", nargs="*", help="only print the table of the runs under these folders")
    p.add_argument("--plot", help="also plot every run's losses (plot_logs.py) into this PNG")
    args = p.parse_args(argv)
    dirs = args.table if args.table is not None else [args.out]
    if args.table is None:
        if args.setting is None:
            p.error("--setting is required (or --table DIR ...)")
        rows = args.rows or DEFAULT_ROWS[args.setting]
        jobs = []
        for seed in args.seeds:
            for row in rows:
                out_dir = os.path.join(args.out, args.setting, f"{row}-s{seed}")
                jobs.append(
                    (
                        run_args(args.setting, row, seed, out_dir, args.data_dir, args.max_seconds, args.set),
                        out_dir,
                    )
                )
    command = f"command: `python bench/bench_quality.py {' '.join(sys.argv[1:] if argv is None else argv)}`"

    def write_table(show=False):
        try:
            text = "\n".join([command, versions(), table(dirs)])
        except ValueError as e:
            if show:
                p.error(str(e))
            return
        if show:
            print(text)
        atomic_write(os.path.join(dirs[0], "quality.md"), text + "\n")

    if args.table is None:
        launch_all(jobs, args.parallel or PARALLEL[args.setting], on_finish=write_table)
    write_table(show=True)
    if args.plot:
        logs = sorted(
            os.path.join(root, name, "log.jsonl")
            for top in dirs
            for root, names, _ in os.walk(top)
            for name in names
            if os.path.exists(os.path.join(root, name, "log.jsonl"))
        )
        cmd = [sys.executable, os.path.join(REPO, "plot_logs.py"), *logs, "-o", args.plot, "--ymax", "8"]
        subprocess.run(cmd, check=False)


if __name__ == "__main__":
    main()
