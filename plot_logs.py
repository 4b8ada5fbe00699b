"""
Plot loss curves from one or more train.py logs (out_dir/log.jsonl) into one PNG, to compare variants.

    python plot_logs.py out-baseline/log.jsonl out-ddl-cc/log.jsonl -o loss.png
    python plot_logs.py out-*/log.jsonl -o loss.png --smooth=0.9 --ymax=4 --labels base ddl-cc

Train loss (one point per iteration, optionally smoothed by an exponential moving average) is drawn as
a line, validation loss as markers of the same colour. A curve is labelled with its run directory.
"""

import argparse
import json
import os
import sys


def read_log(path):
    """(train, val): lists of (iter, loss) from a log.jsonl; a bad line raises ValueError naming it."""
    train, val = [], []
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "train_loss" in record:
                train.append((record["iter"], record["train_loss"]))
            if "val_loss" in record:
                val.append((record["iter"], record["val_loss"]))
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines) and not line.endswith(b"\n"):  # being written, or cut short by a crash
                print(f"warning: {path}:{n}: skipped a cut-short last line", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{n}: not a train.py log record ({e})") from None
    return train, val


def smooth(values, alpha):
    """Bias-corrected exponential moving average (alpha = weight of the past; 0 = raw)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = alpha * avg + (1 - alpha) * v
        out.append(avg / (1 - alpha ** (i + 1)) if alpha > 0 else v)
    return out


def plot(paths, output, labels=None, smoothing=0.0, ymax=None):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    labels = labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (path, label) in enumerate(zip(paths, labels)):
        train, val = read_log(path)
        color = f"C{i % 10}"
        if train:
            its, losses = zip(*train)
            ax.plot(its, smooth(losses, smoothing), color=color, lw=1, label=f"{label} train")
        if val:
            its, losses = zip(*val)
            ax.plot(its, losses, "o--", color=color, ms=4, lw=0.8, label=f"{label} val")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats/token)")
    if ymax is not None:
        ax.set_ylim(top=ymax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = output + ".tmp.png"
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, output)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):  # a failed write (a full disk) leaves nothing behind
            os.remove(tmp)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="log.jsonl files written by train.py")
    p.add_argument("-o", "--output", default="loss.png", help="PNG to write (default loss.png)")
    p.add_argument("--labels", nargs="+", help="one label per log (default: the run directory names)")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA weight of the past for train loss, [0, 1)")
    p.add_argument("--ymax", type=float, help="upper limit of the loss axis")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.logs):
        p.error(f"--labels has {len(args.labels)} entries for {len(args.logs)} logs")
    if not 0.0 <= args.smooth < 1.0:
        p.error(f"--smooth must be in [0, 1), got {args.smooth}")
    for path in args.logs:
        if not os.path.isfile(path):
            p.error(f"no such log file: {path}")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        p.error(f"-o {args.output}: folder {folder} does not exist")
    try:
        plot(args.logs, args.output, args.labels, args.smooth, args.ymax)
    except ValueError as e:
        p.error(str(e))
    except OSError as e:
        p.error(f"-o {args.output}: cannot write it ({e.strerror or e})")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
