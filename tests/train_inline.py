"""train.py run inside the test process (no interpreter start, no torch import: a tiny run takes a fraction
of a second), with an optional fake clock; for the tests of what train.py accepts, refuses and reports.

    code, out, err, ns = run_train("--max_iters=2", ..., clock=0.25)

code is the exit status (0 for a run that ends normally), out and err what it printed, ns its globals
(the config, model_args, the model, ...). With clock=s, time.time() stands still except in each optimizer
step, which takes exactly s seconds: every iteration's measured time is s.
"""

import atexit
import contextlib
import io
import os
import signal
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")


class FakeClock:
    """time.time() of a process whose only passing time is `step` seconds per optimizer step."""

    def __init__(self, step, start=1000.0):
        self.now, self.step = start, step

    def time(self):
        return self.now

    def wrap(self, optimizer_step):
        def step(opt, *args, **kwargs):
            out = optimizer_step(opt, *args, **kwargs)
            self.now += self.step
            return out

        return step


def run_train(*argv, clock=None):
    """(exit status, stdout, stderr, globals) of `python train.py *argv`, run here."""
    with open(TRAIN, encoding="utf-8") as f:
        code_obj = compile(f.read(), TRAIN, "exec")
    ns = {"__name__": "__main__", "__file__": TRAIN}
    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved = sys.argv, time.time, torch.optim.AdamW.step, os.environ.pop("RANK", None)
    status = 0
    try:
        sys.argv = [TRAIN, *argv]
        if clock is not None:
            fake = FakeClock(clock)
            time.time, torch.optim.AdamW.step = fake.time, fake.wrap(torch.optim.AdamW.step)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(code_obj, ns)
            except SystemExit as e:
                if isinstance(e.code, str):  # sys.exit(message): printed, status 1
                    print(e.code, file=sys.stderr)
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv, time.time, torch.optim.AdamW.step = saved[:3]
        if saved[3] is not None:
            os.environ["RANK"] = saved[3]
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if "_run_dir_lock" in ns:  # the run folder's lock, which a process running train.py holds to its end
            os.close(ns["_run_dir_lock"])
            atexit.unregister(ns["remove_empty_dirs"])
        if ns.get("run_log") is not None:
            ns["run_log"].close()
    return status, out.getvalue(), err.getvalue(), ns


# a tiny run (2 layers of width 32, rows of 16 tokens, 2 micro-steps of 4 rows) on the CPU, in float32
TINY = [
    "--vocab_size=64", "--n_layer=2", "--n_head=2", "--head_dim=16", "--n_embd=32", "--block_size=16",
    "--batch_size=4", "--gradient_accumulation_steps=2", "--eval_iters=2", "--log_interval=1",
    "--learning_rate=3e-3", "--min_lr=3e-4", "--warmup_iters=2", "--lr_decay_iters=20", "--compile=False",
    "--device=cpu", "--dtype=float32", "--backend=torch",
]  # fmt: skip


def write_shards(directory, seed=0):
    """train.bin (20,000 tokens) and val.bin (4,000) of random ids < 64 in `directory`; returns it as str."""
    import numpy as np

    from data.shards import write_shard

    rng = np.random.default_rng(seed)
    write_shard(os.path.join(directory, "train.bin"), rng.integers(0, 64, 20_000))
    write_shard(os.path.join(directory, "val.bin"), rng.integers(0, 64, 4_000))
    return str(directory)
