"""python tests/rank_dump.py DUMP_DIR [train.py's arguments]: train.py (also under torchrun), writing to
DUMP_DIR/rank<RANK>.jsonl, as they happen, what decides each rank's share of a training iteration: for each
micro-batch its rows and tokens with the digest of the rank's RNG states when it is drawn (every
micro-batch of an iteration is drawn before its first forward), and every stochastic-rounding seed a
training forward draws. A resumed run appends to the same files."""

import hashlib
import json
import os
import runpy
import sys

import torch

import checkpoint as ck
from data.loader import ShardLoader
from ops.ddl.stream import DDLStream

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
dump = open(os.path.join(sys.argv.pop(1), f"rank{os.environ.get('RANK', '0')}.jsonl"), "a")  # noqa: SIM115


def write(**record):
    dump.write(json.dumps(record) + "\n")
    dump.flush()  # a rank the launcher ends keeps what it wrote


def rng_digest():
    state = ck.rng_state()
    parts = [
        repr(state["python"]).encode(),
        state["numpy"][1].numpy().tobytes(),
        state["torch"].numpy().tobytes(),
    ]
    return hashlib.sha256(b"".join(parts)).hexdigest()


get_batch, seed = ShardLoader.get_batch, DDLStream._seed


def get_batch_dumped(self, step, row_start, row_count, global_rows):
    x, y = get_batch(self, step, row_start, row_count, global_rows)
    if os.path.basename(self.files[0]).startswith("train"):
        write(iter=step, rows=[row_start, row_count], x=x.tolist(), rng=rng_digest())
    return x, y


def seed_dumped(self):
    s = seed(self)
    if s is not None and torch.is_grad_enabled():  # a training forward's (evaluations run without grad)
        write(seed=int(s))
    return s


ShardLoader.get_batch, DDLStream._seed = get_batch_dumped, seed_dumped
sys.argv[0] = os.path.join(REPO, "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
