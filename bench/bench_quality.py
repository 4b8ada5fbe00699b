"""Quality side by side: the README's variant rows trained with one recipe and token budget, >= 2 seeds.

    python bench/bench_quality.py --setting shakespeare --seeds 1 2 --out DIR        # every row, 8L x 512
    python bench/bench_quality.py --setting corpus --seeds 1 --out DIR --data-dir D   # main rows, GPT-2 small
    python bench/bench_quality.py --setting stability --seeds 1 2 3 4 --out DIR --data-dir D  # every run
    python bench/bench_quality.py --setting stability --lr 2e-3 --seeds 1 2 --out DIR --data-dir D
    python bench/bench_quality.py --setting corpus --rows additive additive-doc-mask ddl-cc ddl-cc-doc-mask \
        --seeds 1 2 --out DIR --data-dir D      # documents masked (GPTConfig.doc_mask) against not
    python bench/bench_quality.py --table DIR [DIR ...]   # the table of finished runs

Each (row, seed) is one `train.py` run in DIR/<setting>/<row>-s<seed> (log.jsonl, train.out; no checkpoint
kept), --parallel at a time; a run that ended there (finished, or stopped on a non-finite loss) is kept, so
rerunning a command reruns the others (cut short). Settings: SETTINGS, with RECIPE (AdamW, warmup + cosine to
lr / 10); --lr sets the peak lr (to DIR/<setting>-lr<lr>). The table: per row, the best and final validation
loss (mean and half-range over seeds) and the best's difference from additive; for stability, a line per run
(finished, stopped, failed or cut short; the largest loss spike over the running minimum; the best validation
loss). --probe N records every N iterations each Deltaformer layer's stage 1 (max |u| / max |v|, beta, softmax
kappa's weight on token i - 1) and the first non-finite u into probe.jsonl, summarised in the table.
"""

import argparse
import glob
import itertools
import json
import math
import os
import pathlib
import runpy
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, atomic_write, command, markdown, read_jsonl, run_commands, versions  # noqa: E402

RECIPE = dict(
    learning_rate=1e-3, min_lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, dropout=0.0
)
CORPUS = dict(dataset="fineweb_edu", n_layer=12, n_embd=768, n_head=6, head_dim=128, block_size=1024,
              batch_size=16, eval_iters=8, log_interval=32, compile=True)  # fmt: skip
SETTINGS = {
    "shakespeare": dict(
        dataset="shakespeare", n_layer=8, n_embd=512, n_head=4, head_dim=128, block_size=512, batch_size=16,
        gradient_accumulation_steps=1, max_iters=800, warmup_iters=80, lr_decay_iters=800,
        eval_interval=100, eval_iters=8, log_interval=100, compile=False,
    ),
    "corpus": dict(CORPUS, gradient_accumulation_steps=4, max_iters=384, warmup_iters=40,
                   lr_decay_iters=384, eval_interval=128),
    "stability": dict(CORPUS, gradient_accumulation_steps=2, max_iters=480, warmup_iters=48,
                      lr_decay_iters=480, eval_interval=96),
}  # fmt: skip
ROWS = {  # name -> GPTConfig overrides; the README's variant table
    "additive": dict(residual="additive"),
    # no token sees an earlier document of its row; in no default: the papers (and the other rows) train
    # without it. The corpus setting's shards hold one file a document, each after an EOT
    "additive-doc-mask": dict(residual="additive", doc_mask=True),
    **{r: dict(residual=r) for r in ("ddl", "ddl-tc", "ddl-cc")},
    "ddl-cc-doc-mask": dict(residual="ddl-cc", doc_mask=True),
    "ddl-cc-no-ec": dict(residual="ddl-cc", ddl_ec=False),
    "ddl-cc-bf16-state": dict(residual="ddl-cc", ddl_state_dtype="bfloat16"),
    "ddl-cc-bf16-sr-state": dict(
        residual="ddl-cc", ddl_state_dtype="bfloat16", ddl_state_rounding="stochastic"
    ),
    "ddl-cc-write-only": dict(residual="ddl-cc", ddl_erase=False),
    "deltaformer-softmax": dict(attention="deltaformer", deltaformer_kernel="softmax"),
    "deltaformer-softmax-beta2": dict(attention="deltaformer", deltaformer_beta_max=2.0),  # not bounded
    "deltaformer-relu": dict(attention="deltaformer", deltaformer_kernel="relu"),
    "deltaformer-linear": dict(attention="deltaformer", deltaformer_kernel="linear"),
    "ddl-cc+deltaformer": dict(residual="ddl-cc", attention="deltaformer"),
}
PARALLEL = {"shakespeare": 10, "corpus": 6, "stability": 6}  # runs at a time: ~9-11 GB, ~12-20 GB each
DEFAULT_ROWS = {
    "shakespeare": [r for r in ROWS if not any(x in r for x in ("bf16", "doc-mask", "softmax-beta2"))],
    "corpus": ["additive", "ddl", "ddl-tc", "ddl-cc", "ddl-cc-bf16-state", "deltaformer-softmax"],
    "stability": ["additive", "ddl", "ddl-cc", "ddl-tc",
                  "deltaformer-softmax", "deltaformer-relu", "deltaformer-linear"],
}  # fmt: skip


def run_args(setting, row, seed, out_dir, data_dir=None, max_seconds=0.0, lr=None, probe=0, extra=()):
    """train.py's command line for one run (extra: more KEY=VALUE config keys)."""
    keys = {**RECIPE, **SETTINGS[setting], **ROWS[row], "seed": seed, "out_dir": out_dir, "overwrite": True}
    if lr:
        keys |= dict(learning_rate=lr, min_lr=lr / 10)
    if data_dir:
        keys["data_dir"] = data_dir
    if max_seconds:
        keys["max_seconds"] = max_seconds
    args = [f"--{k}={v}" for k, v in keys.items()] + [f"--{kv}" for kv in extra]
    if probe and "deltaformer" in row:
        return [sys.executable, os.path.abspath(__file__), "--probe-run", str(probe), "--", *args]
    return [sys.executable, os.path.join(REPO, "train.py"), *args]


def probe_run(every, train_args):
    """train.py with train_args, each Deltaformer stage 1 watched (--probe), into out_dir/probe.jsonl."""
    import torch

    import ops.deltaformer as df
    from ops.common import default_scale

    keys = dict(a[2:].split("=", 1) for a in train_args if a.startswith("--") and "=" in a)
    n_layer, micro = int(keys["n_layer"]), int(keys["gradient_accumulation_steps"])
    path, calls, nonfinite_seen = os.path.join(keys["out_dir"], "probe.jsonl"), 0, False
    atomic_write(path, "")  # its folder made, any earlier probe.jsonl emptied

    @torch.compiler.disable
    def record(k, v, w, beta, u, kernel, scale):
        nonlocal calls, nonfinite_seen
        if not torch.is_grad_enabled():  # evaluation
            return
        call, calls = calls, calls + 1
        it, layer = call // (n_layer * micro), call % n_layer
        finite = bool(torch.isfinite(u).all())
        sampled = it % every == 0 and call // n_layer % micro == 0  # the first micro-step of every Nth
        if (finite and not sampled) or (not finite and nonfinite_seen):  # and the first non-finite u
            return
        nonfinite_seen |= not finite
        u0, v0, b0 = u[0].float(), v[0].float(), beta[0].float()  # batch row 0: [H, T, D], [H, T]
        rec = dict(iter=it, layer=layer, finite=finite, v_finite=bool(torch.isfinite(v).all()),
                   u_over_v=(u0.abs().amax() / v0.abs().amax()).item(), beta_mean=b0.mean().item(),
                   beta_max=b0.max().item(), beta_over_1=(b0 > 1).float().mean().item())  # fmt: skip
        if kernel == "softmax":  # kappa's weight on token i-1, the weight that makes u_i ~ v_i - beta u_{i-1}
            T = k.shape[2]
            scores = scale * (w[0].float() @ k[0].float().transpose(-1, -2))
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=k.device).triu(), -math.inf)
            prev = torch.softmax(scores[:, 1:], dim=-1).diagonal(dim1=-2, dim2=-1)  # [H, T - 1]
            rec["kappa_prev_mean"] = prev.mean().item()
            rec["kappa_prev_over_09"] = (prev > 0.9).float().mean().item()
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def watched(stage1):
        def run(k, v, w, beta, kernel="softmax", scale=None, **kwargs):
            u = stage1(k, v, w, beta, kernel=kernel, scale=scale, **kwargs)
            record(k, v, w, beta, u, kernel, default_scale(k.shape[-1], scale))
            return u

        return run

    df.deltaformer_u_torch = watched(df.deltaformer_u_torch)
    df.deltaformer_u_triton = watched(df.deltaformer_u_triton)
    sys.argv = [os.path.join(REPO, "train.py"), *train_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


def launch_all(jobs, parallel, on_finish=lambda: None):
    """Run (cmd, out_dir) jobs, `parallel` at a time; each writes its console output to out_dir/train.out.
    on_finish() runs after each job ends (the table so far, so that a run cut short keeps it)."""
    specs = []
    for cmd, out_dir in jobs:
        os.makedirs(out_dir, exist_ok=True)
        # compile caches of its own: runs of one model compiling into one cache at once died of SIGSEGV
        cache = tempfile.mkdtemp(prefix="bench_quality-")
        env = dict(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "t"))
        specs.append(dict(name=out_dir, cmd=cmd, cwd=REPO, log=os.path.join(out_dir, "train.out"), env=env))

    def end(job):  # the table reads log.jsonl; a checkpoint (1.5 GB at GPT-2 small) x 42 runs fills a disk
        shutil.rmtree(job["env"]["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
        pathlib.Path(job["name"], "ckpt.pt").unlink(missing_ok=True)
        on_finish()

    try:
        run_commands(specs, [None] * parallel, on_end=end, poll_s=2)
    finally:
        for job in specs:
            shutil.rmtree(job["env"]["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def read_run(out_dir):
    """dict(vals: val loss by iteration, train: train losses in order, lr: the peak learning rate, last_iter,
    final: finished?, diverged: stopped on a non-finite loss?, why) from log.jsonl and train.out."""
    run = dict(vals={}, train=[], lr=0.0, last_iter=-1, final=False, diverged=False, why="")
    for rec in read_jsonl(os.path.join(out_dir, "log.jsonl")):
        run["last_iter"] = max(run["last_iter"], rec.get("iter", -1))
        if "val_loss" in rec:
            run["vals"][rec["iter"]] = rec["val_loss"]
        if "train_loss" in rec:
            run["train"].append(rec["train_loss"])
            run["lr"] = max(run["lr"], rec.get("lr", 0.0))
    console = os.path.join(out_dir, "train.out")
    if os.path.exists(console):
        lines = pathlib.Path(console).read_text(errors="replace").splitlines()
        run["final"] = any(line.startswith("done:") for line in lines)
        errors = [line[:160] for line in lines if "Error" in line or ": error: " in line]  # the last: why
        run["diverged"] = any("stopping before the update" in line for line in lines)  # train.py's stop
        run["why"] = "non-finite loss" if run["diverged"] else errors[-1] if errors else ""
    return run


def mean(xs):
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def mean_spread(xs):
    xs = [x for x in xs if math.isfinite(x)]
    return (f"{mean(xs):.4f}" + (f" ± {(max(xs) - min(xs)) / 2:.4f}" if len(xs) > 1 else "")) if xs else "—"


def largest_spike(losses):
    """max over steps of the train loss minus its running minimum (0 for a loss that never rises)."""
    if not all(map(math.isfinite, losses)):
        return math.inf
    return max((x - low for x, low in zip(losses, itertools.accumulate(losses, min))), default=0.0)


def probe_summary(out_dir):
    """The probe's largest max |u| / max |v| (where, beta and kappa there) and the first non-finite u."""
    recs = read_jsonl(os.path.join(out_dir, "probe.jsonl"))
    out = []
    if finite := [r for r in recs if r["finite"]]:
        r = max(finite, key=lambda r: r["u_over_v"])
        kappa = f", kappa(i-1) {r['kappa_prev_mean']:.2f}" if "kappa_prev_mean" in r else ""
        out.append(f"u/v {r['u_over_v']:.3g} (iter {r['iter']}, layer {r['layer']}, beta mean "
                   f"{r['beta_mean']:.2f} max {r['beta_max']:.2f}{kappa})")  # fmt: skip
    out += [f"first non-finite u: iter {r['iter']} layer {r['layer']} (v finite: {r['v_finite']})"
            for r in recs if not r["finite"]]  # fmt: skip
    return "; ".join(out)


def setting_of(folder):
    """'corpus' -> 'corpus'; 'stability-lr0.002' (a --lr run's folder) -> 'stability'; else None."""
    base = folder.split("-lr")[0]
    return base if base in SETTINGS else None


def table(dirs):
    """Markdown tables over every <row>-s<seed> run found under dirs (grouped by setting folder): per row
    (mean and spread over seeds), or for the stability setting per run."""
    runs = {}  # (setting folder, row) -> [(seed, run dict, best, final)]
    for top in map(os.path.normpath, dirs):  # a setting's own folder, or one that holds setting folders
        pattern = "*-s*" if setting_of(os.path.basename(top)) else os.path.join("*", "*-s*")
        for path in sorted(glob.glob(os.path.join(glob.escape(top), pattern))):
            folder, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)
            row, _, seed = name.rpartition("-s")
            if not setting_of(folder) or row not in ROWS:
                continue
            run = read_run(path)
            run["probe"] = probe_summary(path)
            best = min((v for v in run["vals"].values() if math.isfinite(v)), default=float("nan"))
            last = run["vals"][max(run["vals"])] if run["vals"] else float("nan")
            runs.setdefault((folder, row), []).append((seed, run, best, last))
    if not runs:
        raise ValueError(f"no runs (<setting>/<row>-s<seed> folders) under {', '.join(dirs)}")
    lines = []
    for folder in sorted({f for f, _ in runs}, key=lambda f: (list(SETTINGS).index(setting_of(f)), f)):
        rows = [r for r in ROWS if (folder, r) in runs]
        if (setting := setting_of(folder)) == "stability":
            lines += stability_table(folder, rows, runs)
            continue
        base_best = mean([x[2] for x in runs.get((folder, "additive"), [])])
        cells = []
        for r in rows:
            rs = runs[(folder, r)]
            notes = "; ".join(f"s{x[0]} {status(x[1])}" for x in rs if not finished(x[1])) or "ok"
            best, final = mean_spread([x[2] for x in rs]), mean_spread([x[3] for x in rs])
            diff = f"{mean([x[2] for x in rs]) - base_best:+.4f}".replace("+nan", "—")  # "—": no additive run
            cells.append([r, ",".join(x[0] for x in rs), best, final, diff, notes])
        lines.append(
            f"\n**{folder}** ({SETTINGS[setting]['max_iters']} iterations; best and final validation loss, "
            "mean ± half-range over seeds)\n"
        )
        lines += markdown(["row", "seeds", "best val", "final val", "best − additive", "runs"], cells)
    return "\n".join(lines)


def finished(run):
    """A run (read_run) that ended normally with every validation loss finite."""
    return run["final"] and all(map(math.isfinite, run["vals"].values()))


def status(run):
    """'finished', or how it ended and where: stopped (a non-finite loss), failed (an error), cut short."""
    how = "stopped" if run["diverged"] else "failed" if run["why"] else "cut short"
    why = f" ({run['why']})" if run["why"] else ""
    return "finished" if finished(run) else f"{how} at iter {run['last_iter'] + 1}{why}"


def stability_table(folder, rows, runs):
    every = [x for r in rows for x in runs[(folder, r)]]
    lrs = sorted({f"{x[1]['lr']:g}" for x in every})
    done, stopped = sum(finished(x[1]) for x in every), sum(x[1]["diverged"] for x in every)
    cells = [[r, seed, status(run), f"{largest_spike(run['train']):.3f}", f"{best:.4f}", run["probe"]]
             for r in rows for seed, run, best, _ in runs[(folder, r)]]  # fmt: skip
    head = ["row", "seed", "run", "largest loss spike", "best val", "probe (u/v: max abs u / max abs v)"]
    rest = f", {len(every) - done - stopped} failed or cut short" if len(every) > done + stopped else ""
    return [
        f"\n**{folder}** ({SETTINGS['stability']['max_iters']} iterations, peak lr {', '.join(lrs)}): "
        f"{done} of {len(every)} runs finished, {stopped} stopped{rest}\n",
        *markdown(head, cells),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=tuple(SETTINGS))
    p.add_argument("--rows", nargs="+", choices=tuple(ROWS), help="default: the setting's rows")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--out", default="out-quality", help="runs go to OUT/<setting>/<row>-s<seed>")
    p.add_argument("--data-dir", help="corpus: the shard folder (data/fineweb_edu.py --out)")
    p.add_argument("--parallel", type=int, help="runs at a time on the one GPU (default: what fits an H200)")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop each run after this training time")
    p.add_argument("--lr", type=float, help="peak learning rate (min_lr = lr / 10); to <setting>-lr<lr>")
    p.add_argument("--probe", type=int, default=0, metavar="N", help="watch Deltaformer's stage 1 every N")
    p.add_argument("--table", nargs="*", help="only print the table of the runs under these folders")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe-run"]:  # one run under the probe (--probe's jobs): --probe-run N -- train args
        return probe_run(int(argv[1]), argv[3:])
    args = p.parse_args(argv)
    if args.parallel is not None and args.parallel < 1:
        p.error(f"--parallel {args.parallel}: expected a positive number of runs at a time")
    dirs = args.table if args.table is not None else [args.out]
    header = f"command: `{command(__file__, argv)}`"

    def write_table(show=False):
        try:
            text = "\n".join([header, versions(), table(dirs)])
        except ValueError as e:  # no runs yet: an error only when asked to show the table
            return p.error(str(e)) if show else None
        if show:
            print(text)
        atomic_write(os.path.join(dirs[0], "quality.md"), text + "\n")

    if args.table is None:
        if args.setting is None:
            p.error("--setting is required (or --table DIR ...)")
        folder = os.path.join(args.out, args.setting + (f"-lr{args.lr:g}" if args.lr else ""))
        runs = [(row, seed, os.path.join(folder, f"{row}-s{seed}"))
                for seed in args.seeds for row in args.rows or DEFAULT_ROWS[args.setting]]  # fmt: skip
        runs = [run for run in runs if not ((r := read_run(run[2]))["final"] or r["diverged"])]  # ended: kept
        extra = (args.data_dir, args.max_seconds, args.lr, args.probe)
        jobs = [(run_args(args.setting, row, seed, out_dir, *extra), out_dir) for row, seed, out_dir in runs]
        launch_all(jobs, args.parallel or PARALLEL[args.setting], on_finish=write_table)
    write_table(show=True)


if __name__ == "__main__":
    main()
