"""Train a GPT with any residual x attention variant, on one CPU/GPU or with DDP.

usage: python train.py [CONFIG.py ...] [--key=value ...]   (config files and overrides apply left to right)

    python data/shakespeare.py && python train.py configs/shakespeare.py    # start here: 2 CPU cores, ~9 min
    python train.py configs/gpt2_small.py --residual=ddl-cc                 # one GPU
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_small.py
    python train.py --help                                   # every config key, its default and meaning

Config keys: the names in the "config keys" section below and the GPTConfig fields (configurator.py). A
fresh run refuses an out_dir holding a run: --init_from=resume continues it, --overwrite=True replaces it
(the log of a run that stopped before its first checkpoint is kept as log.N.jsonl, not refused). A live run
holds its out_dir (a lock the OS drops when the process ends): a second run there is refused.
Ctrl-C (SIGINT) or SIGTERM finishes the optimizer step, checkpoints and exits (130 or 143); a second
Ctrl-C aborts at once. A step that cannot fit the device's memory (estimated) is refused before it starts.

Reproducibility: global batch `iter_num` (batch_size * gradient_accumulation_steps rows) is a function of
(data, seed, iter_num); rank r, micro-step m takes rows from (m * world_size + r) * batch_size; losses are
weighted to the mean over its valid (!= -1) targets, whatever the number of ranks; a checkpoint holds all
that decides the future (model, optimizer, iteration, RNG states), so a resume on CPU is bit-exact.
"""

import atexit
import contextlib
import dataclasses
import functools
import inspect
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint as ck
from configurator import ConfigError, check_values, command_line
from data import state_tracking as st
from data.shards import remove_empty_dirs
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.abspath(__file__))
_names_before_config = set(globals())
# -----------------------------------------------------------------------------
# config keys (defaults); every GPTConfig field is a key too (model shape and variant)
# I/O
out_dir = "out"  # checkpoint (ckpt.pt) and log (log.jsonl) of the run
init_from = "scratch"  # "scratch" or "resume" (from out_dir/ckpt.pt)
overwrite = False  # let a fresh run replace a previous run in out_dir (else it refuses to start)
eval_interval = 250  # evaluate and checkpoint every eval_interval iterations and at the end
eval_iters = 20  # val loss = mean over val global batches 0..eval_iters-1 (the same ones every time)
log_interval = 10  # console line every log_interval iterations; log.jsonl gets every iteration
wandb_log = False  # also log to Weights & Biases
wandb_project = "ddl"  # wandb project name
wandb_run_name = "run"  # wandb run name
# data
dataset = "shakespeare"  # "shakespeare" | "fineweb_edu" | "state_tracking"
data_dir = ""  # "" = data/<dataset> in the repo
batch_size = 8  # rows per micro-step per rank
block_size = 1024  # tokens per row (the model's context length; a resumed run keeps the checkpoint's)
gradient_accumulation_steps = 1  # GLOBAL micro-steps per iteration; divided among the ranks
# state tracking (dataset="state_tracking", data/state_tracking.py): per-position targets, accuracy
st_task = "swap"  # "swap" (track n elements under swaps) | "dag" (reachability from node 0)
st_n = 5  # swap: number of elements
st_n_nodes = 32  # dag: number of nodes
st_length = 32  # training sequence length (the curriculum's start)
st_curriculum = False  # double st_length when val_acc >= st_curriculum_acc, up to st_max_length
st_curriculum_acc = 0.99  # validation accuracy that doubles the curriculum's length
st_max_length = 256  # the curriculum's longest training length
st_eval_lengths = (256, 512)  # accuracy at these lengths at the end (512: extrapolation)
# AdamW, warmup + cosine schedule
learning_rate = 1e-3  # peak learning rate, after warmup
min_lr = 1e-4  # learning rate at and after lr_decay_iters
warmup_iters = 100  # linear warmup from ~0 to learning_rate
lr_decay_iters = 5000  # cosine from learning_rate (after warmup) to min_lr at lr_decay_iters, then flat
max_iters = 5000  # total training iterations
max_seconds = 0.0  # also stop (evaluate, checkpoint) after this much training wall time; 0 = off
weight_decay = 0.1  # only on >= 2-D parameters (matrices, embeddings, convolutions)
betas = (0.9, 0.95)  # AdamW betas
grad_clip = 1.0  # clip the global gradient norm to this; 0 = off
# system
seed = 1337  # initial weights, data order and dropout
device = "cuda" if torch.cuda.is_available() else "cpu"  # "cpu", "cuda", "cuda:1", ...
dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # autocast dtype: "bfloat16" | "float32"
compile = torch.cuda.is_available()  # torch.compile the model
ddp_split_graph = False  # compile + DDP: split the graph at DDP's buckets (bench/RESULTS.md: slower)
dry_run = False  # print the resolved config and the model size, then exit (needs no data)
# -----------------------------------------------------------------------------
_defaults = {k: v for k, v in globals().items() if k not in _names_before_config and not k.startswith("_")}
_fields = dataclasses.fields(GPTConfig)
_defaults |= {f.name: f.default for f in _fields if f.name not in _defaults}
DATASETS = ("shakespeare", "fineweb_edu", "state_tracking")
CHOICES = {"init_from": ("scratch", "resume"), "dataset": DATASETS, "dtype": ("float32", "bfloat16")}
_ones = "batch_size block_size gradient_accumulation_steps eval_interval eval_iters log_interval st_length"
_ones = _ones.split()
_zeros = "max_iters warmup_iters lr_decay_iters weight_decay grad_clip max_seconds seed".split()
AT_LEAST = {**dict.fromkeys(_ones, 1), **dict.fromkeys(_zeros, 0)}
RUN_FIELDS = ("dropout", "backend")  # GPTConfig fields that a resumed run may change
USAGE = __doc__.split("Reproducibility")[0].strip()  # printed by --help and without arguments


def fail(message):
    """Stop with a clear message and a non-zero exit status (on every rank)."""
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1)


class Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice). Before training they stop the run at once; once
    training, the first is only noted: the loop finishes its optimizer step, checkpoints and exits with
    128 + the signal, every rank at the same iteration (stop() agrees across ranks). Then SIGINT takes its
    default action, so a second Ctrl-C ends the process at once, even inside a long call (the last
    checkpoint stays), and a repeated SIGTERM is ignored."""

    def __init__(self):
        self.signum, self.training = 0, False
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.training:
            print(f"train.py: {name}: stopped before training started", file=sys.stderr, flush=True)
            sys.exit(128 + signum)  # atexit still takes back a run folder made for nothing
        self.signum = signum
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if master:  # os.write: print is not safe inside a handler
            os.write(2, f"train.py: {name}: stopping after this step; Ctrl-C again aborts at once\n".encode())

    def stop(self):
        """The signal to stop on, 0 for none: any rank's, so that all ranks stop at the same iteration."""
        if not ddp:
            return self.signum
        flag = torch.tensor(self.signum, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


interrupts = Interrupts()


# ---- config: defaults <- config files <- --key=value, checked before any data or model work ----
try:  # --help lists every key with the comment of its assignment here or in GPTConfig
    _sources = [(__file__, None), (inspect.getsourcefile(GPTConfig), "GPTConfig")]
    config = command_line(_defaults, sys.argv[1:], USAGE, _sources)
    check_values(config, CHOICES, AT_LEAST)
except ConfigError as e:
    fail(str(e))
globals().update(config)
if not 0 <= min_lr <= learning_rate:
    fail(f"need 0 <= min_lr <= learning_rate, got min_lr={min_lr}, learning_rate={learning_rate}")
if not all(0 <= b < 1 for b in betas):
    fail(f"betas must each be in [0, 1) (AdamW), got {betas}")
if seed > 2**32 - 2**16:  # numpy's seeds are < 2**32, and rank r seeds seed + r
    fail(f"seed must be <= 2**32 - 2**16, got {seed}")
if not (device == "cpu" or device.startswith("cuda")):
    fail(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
if device.startswith("cuda") and not torch.cuda.is_available():
    fail(f"device={device!r} but CUDA is not available (use --device=cpu)")
try:  # resolved (e.g. ddl_dv=None -> 4), so model_args round-trips through the checkpoint
    model_args = dataclasses.asdict(GPTConfig(**{f.name: config[f.name] for f in _fields}))
except (ValueError, TypeError) as e:
    fail(f"model config: {e}")

# ---- the run directory: one live run holds it; resume from it, or refuse to start over a previous run ----
ckpt_path = os.path.join(out_dir, "ckpt.pt")
log_path = os.path.join(out_dir, "log.jsonl")
checkpoint = None
if not dry_run and os.environ.get("RANK", "0") == "0":  # rank 0 writes the run's files
    try:  # held until this process ends; the checks below then see no other live run's files
        _run_dir_lock, _made = ck.hold_run_dir(out_dir)
    except ck.CheckpointError as e:
        fail(str(e))
    atexit.register(remove_empty_dirs, _made)  # a run stopped before its first file leaves no folder
# a log without a checkpoint: its run stopped before its first checkpoint, so there is nothing to resume
log_only = os.path.isfile(log_path) and os.path.getsize(log_path) > 0 and not os.path.exists(ckpt_path)
if init_from == "resume":
    if log_only:
        fail(
            f"init_from='resume': no checkpoint at {ckpt_path}: the run of its log.jsonl stopped before its "
            "first checkpoint; start afresh (without --init_from=resume), which keeps that log"
        )
    try:  # the architecture comes from the checkpoint, RUN_FIELDS from this run's config
        checkpoint, resumed = ck.load_for_resume(ckpt_path, model_args, RUN_FIELDS)
    except ck.CheckpointError as e:
        fail(f"init_from='resume': {e}")
    changed = [f"{k}={v!r} (not {model_args[k]!r})" for k, v in resumed.items() if v != model_args.get(k, v)]
    if changed and os.environ.get("RANK", "0") == "0":
        print(f"resume: the model comes from {ckpt_path}: {', '.join(changed)}", flush=True)
    model_args, block_size = resumed, resumed["block_size"]  # the loaders cut rows of the model's length
elif not dry_run:
    previous = [p for p in (ckpt_path, log_path) if os.path.isfile(p) and os.path.getsize(p) > 0]
    if previous and not overwrite and not log_only:
        fail(
            f"{out_dir} holds a previous run ({', '.join(map(os.path.basename, previous))}); continue it "
            "with --init_from=resume, replace it with --overwrite=True, or choose another --out_dir"
        )
    if log_only and not overwrite and os.environ.get("RANK", "0") == "0":
        try:
            kept_as = ck.keep_log(log_path)
        except ck.CheckpointError as e:
            fail(str(e))
        print(f"{log_path}: its run stopped before its first checkpoint; kept as {kept_as}", flush=True)

if dry_run:
    with torch.device("meta"):  # shapes only: instant, even for the large presets
        meta_model = GPT(GPTConfig(**model_args))
    print("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in {**config, **model_args}.items()))
    print(f"parameters: {meta_model.num_params():,}")
    print(f"forward+backward FLOPs per token at T={block_size}: {meta_model.flops_per_token(block_size):,}")
    sys.exit(0)

# ---- distributed setup: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE ----
ddp = "RANK" in os.environ
rank, local_rank, world_size = 0, 0, 1
if ddp:
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
master = rank == 0
if gradient_accumulation_steps % world_size:
    fail(f"{gradient_accumulation_steps=} (global) must be divisible by the number of ranks ({world_size})")
micro_steps = gradient_accumulation_steps // world_size  # per rank
global_rows = batch_size * gradient_accumulation_steps
device_type = "cuda" if device.startswith("cuda") else "cpu"
if device_type == "cuda":
    torch.set_float32_matmul_precision("high")  # TF32 matmuls (only on CUDA: CPU stays exact float32)
    torch.backends.cudnn.allow_tf32 = True
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        fail("dtype='bfloat16' but this GPU does not support bfloat16; use --dtype=float32")
cuda_device = device if device_type == "cuda" else None  # for the CUDA RNG state
bf16 = dtype == "bfloat16"
autocast = torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
log = functools.partial(print, flush=True) if master else lambda *args: None  # console: rank 0 only
to_device = lambda t: t.pin_memory().to(device, non_blocking=True) if device_type == "cuda" else t
if master:  # temp files of a run killed while writing them
    for _tmp in filter(os.path.exists, (ckpt_path + ".tmp", log_path + ".tmp")):
        os.remove(_tmp)

# ---- memory: a step that cannot fit the device is refused before any data or model work ----
_bytes = ck.step_memory(GPTConfig(**model_args), batch_size, block_size, bf16, ddp)
memory = {"weights, gradients and AdamW": sum(_bytes[k] for k in ("weights", "gradients", "optimizer"))}
memory |= {k: _bytes[k] for k in ("activations", "logits")}
available = ck.available_memory(device)
if available is not None and device_type == "cpu":
    available //= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks of one machine share its RAM
parts = ", ".join(f"{k} {ck.size_text(v)}" for k, v in memory.items())
memory_text = f"~{ck.size_text(sum(memory.values()))} (estimated: {parts})"
too_big = available is not None and sum(memory.values()) > available
if ddp:  # every rank stops, or none
    any_too_big = torch.tensor(int(too_big), device=device)
    dist.all_reduce(any_too_big, op=dist.ReduceOp.MAX)
    if any_too_big.item() and not too_big:
        fail(f"a training step needs {memory_text}, more than another rank's device has (see its error)")
if too_big:
    rows = f"batch_size={batch_size} x block_size={block_size}"
    grows = {"activations": f"{rows} x n_layer={model_args['n_layer']}"}
    grows["logits"] = f"{rows} x vocab_size={model_args['vocab_size']}"
    largest = max(memory, key=memory.get)
    driver = grows.get(largest, f"the {_bytes['weights'] // 4:,} parameters")
    fail(
        f"a training step needs {memory_text}, more than the {ck.size_text(available)} available on "
        f"{device}: the {largest} grow with {driver}; lower one (a smaller batch_size with more "
        "gradient_accumulation_steps keeps the batch)"
    )


# ---- data: loaders with get_batch(step, row_start, row_count, global_rows) ----
curriculum = None  # state tracking: the training length, kept on both loaders
if dataset == "state_tracking":  # generated on the fly; train and val use disjoint seed streams
    lengths, task_args = (st_max_length, *st_eval_lengths), dict(n=st_n, n_nodes=st_n_nodes)
    try:
        train_loader, val_loader = st.loaders(st_task, st_length, seed, lengths, model_args, **task_args)
    except ValueError as e:
        fail(f"dataset='state_tracking': {e}")
    curriculum = st.Curriculum((train_loader, val_loader), st_max_length, st_curriculum_acc, st_curriculum)
else:
    from data.loader import shard_loaders

    try:  # every token id must be < vocab_size (checked when a shard is first used)
        directory = data_dir or os.path.join(REPO, "data", dataset)
        train_loader, val_loader = shard_loaders(directory, block_size, seed, model_args["vocab_size"])
    except FileNotFoundError as e:
        fail(f"{e}\n  {dataset=}: prepare it first with `python data/{dataset}.py` (or set data_dir)")
    except ValueError as e:
        fail(f"dataset={dataset!r}: {e}")


def micro_batch(loader, step, m):
    """This rank's m-th micro-batch of global batch `step`, on the CPU."""
    try:
        return loader.get_batch(step, (m * world_size + rank) * batch_size, batch_size, global_rows)
    except ValueError as e:  # e.g. a shard with token ids >= vocab_size, named in the message
        fail(f"dataset={dataset!r}: {e}")


def all_reduce_sum(t):
    if ddp:
        dist.all_reduce(t)
    return t


# ---- model, optimizer, resume ----
seed_all = lambda s: [f(s) for f in (random.seed, np.random.seed, torch.manual_seed)]
seed_all(seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
raw_model = GPT(GPTConfig(**model_args))
if checkpoint is not None:
    try:
        raw_model.load_state_dict(checkpoint["model"])
    except RuntimeError as e:
        fail(f"{ckpt_path}: its weights do not fit its model_args: {str(e).splitlines()[0]}")
raw_model.to(device)

params = [p for p in raw_model.parameters() if p.requires_grad]
decay = {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay}
no_decay = {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}
fused = True if device_type == "cuda" else None
optimizer = torch.optim.AdamW([decay, no_decay], lr=learning_rate, betas=betas, fused=fused)
iter_num, best_val_loss = 0, float("inf")
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    if curriculum and checkpoint.get("st_length"):
        curriculum.length = checkpoint["st_length"]

if compile:
    torch._dynamo.config.optimize_ddp = ddp_split_graph
model = torch.compile(raw_model) if compile else raw_model
eval_model = model  # evaluation skips DDP: no gradients to sync
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)

seed_all(seed + rank)  # per-rank randomness from here on (dropout)
if checkpoint is not None and len(checkpoint["rng"]) == world_size:
    ck.set_rng_state(checkpoint["rng"][rank], cuda_device)
elif checkpoint is not None:
    log(f"resume: checkpoint has RNG states of {len(checkpoint['rng'])} ranks, not {world_size}: reseeded")
del checkpoint  # frees the loaded tensors


def save():
    """ckpt.pt, atomically; a failed write (full disk) stops the run and leaves the previous one intact."""
    states = [ck.rng_state(cuda_device)] * world_size
    if ddp:
        dist.all_gather_object(states, states[rank])
    if not master:
        return
    ckpt = {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_args": model_args,
        "config": config,
        "iter_num": iter_num,  # also the data position: global batch iter_num comes next
        "best_val_loss": best_val_loss,
        "st_length": curriculum.length if curriculum else None,
        "rng": states,
    }
    try:
        ck.save_checkpoint(ckpt, ckpt_path)
    except ck.CheckpointError as e:
        fail(f"iteration {iter_num}: {e}")


# ---- schedule, evaluation, one training iteration ----
def get_lr(it):
    """Linear warmup over warmup_iters, then cosine to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


@torch.no_grad()
def evaluate():
    """Metrics on val global batches 0..eval_iters-1 (fixed, so evals are comparable); all ranks agree."""
    eval_model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    hits = torch.zeros(4, dtype=torch.float64, device=device)  # state tracking: st.accuracy_counts
    for step in range(eval_iters):
        for m in range(micro_steps):
            x, y = micro_batch(val_loader, step, m)
            n = int((y != -1).sum())
            if n == 0:
                continue
            x, y = to_device(x), to_device(y)
            with autocast:
                logits, loss = eval_model(x, y)
            loss_sum += loss.double() * n
            count += n
            if curriculum:
                hits += st.accuracy_counts(logits, y)
    eval_model.train()
    metrics = {"val_loss": (all_reduce_sum(loss_sum) / all_reduce_sum(count)).item()}
    metrics |= st.accuracy(all_reduce_sum(hits)) if curriculum else {}
    if not all(math.isfinite(v) for v in metrics.values()):
        fail(f"iteration {iter_num}: non-finite evaluation {metrics}; last good checkpoint left as is")
    return metrics


def train_iteration(step):
    """Forward/backward over this rank's micro-batches of global batch `step`: the gradients and the
    returned loss are those of the mean loss over all valid targets of the global batch (all ranks)."""
    batches = [micro_batch(train_loader, step, m) for m in range(micro_steps)]
    counts = [int((y != -1).sum()) for _, y in batches]
    total = all_reduce_sum(torch.tensor(float(sum(counts)), dtype=torch.float64, device=device)).item()
    if total == 0:
        fail(f"global batch {step} has no valid targets (all -1)")
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, ((x, y), n) in enumerate(zip(batches, counts)):
        with model.no_sync() if ddp and m < micro_steps - 1 else contextlib.nullcontext():
            with autocast:
                logits, loss = model(to_device(x), to_device(y))
            if n == 0:  # mean over zero targets is NaN; still run a backward so DDP's sync happens
                logits.float().sum().mul(0.0).backward()
                continue
            (loss * (n * world_size / total)).backward()  # DDP averages over ranks: * world_size
        loss_sum += loss.detach().double() * n
    return all_reduce_sum(loss_sum).item() / total


# ---- logging ----
run_log = None  # rank 0 writes log.jsonl; a resumed run keeps the previous lines up to its checkpoint
if master:
    try:
        kept = ck.log_lines_before(log_path, iter_num, warn=log) if init_from == "resume" else []
    except ck.CheckpointError as e:
        fail(f"{e} to resume")
    run_log = ck.RunLog(log_path, kept, replaces=ckpt_path if init_from == "scratch" else None)
wandb = None
if wandb_log and master:
    try:
        import wandb
    except ImportError:
        fail("wandb_log=True but wandb is not installed (pip install wandb)")
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)


def write_log(record):
    """Append a record to log.jsonl (until the first, a previous run's files stay as they were), and wandb."""
    if not master:
        return
    try:
        run_log.write(record)
    except ck.CheckpointError as e:
        fail(str(e))
    if wandb is not None:
        wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])


hms = lambda s: f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{int(s % 60):02d}"  # the ETA
_gpu = torch.cuda.get_device_name(device) if device_type == "cuda" else ""  # bf16 dense peak, for MFU
peak = next((f for k, f in (("H100", 989e12), ("H200", 989e12), ("A100", 312e12)) if k in _gpu), None)
flops_per_token = functools.cache(raw_model.flops_per_token)  # per training length (it counts parameters)
log(
    f"model: {raw_model.num_params() / 1e6:.2f}M parameters, {model_args['residual']} residual, "
    f"{model_args['attention']} attention\n{world_size} rank(s) on {device}, {micro_steps} micro-steps of "
    f"{batch_size} x {block_size} per rank, {global_rows * block_size:,} tokens per iteration\na step needs "
    f"{memory_text}, {ck.size_text(available) if available is not None else 'unknown'} available on {device}"
)

# ---- training loop ----
resumed_at = iter_num if init_from == "resume" else None
timed_from, dt_avg = iter_num + 2, None  # the ETA leaves out this process's first iterations (compiling)
train_start = time.time()  # for max_seconds (counts this process only, not earlier resumed runs)
saved_at, stopped_by = resumed_at, 0  # the iteration of the last checkpoint; the signal that stopped the run
interrupts.training = True
log(f"first step: iteration {iter_num}{', compiling the model first (a minute or more)' * compile} ...")
while True:
    if (iter_num % eval_interval == 0 or iter_num == max_iters) and iter_num != resumed_at:
        metrics = evaluate()
        best_val_loss = min(best_val_loss, metrics["val_loss"])
        if curriculum:  # grows only on the eval_interval grid, so a resumed or time-stopped run agrees
            if iter_num % eval_interval == 0 and curriculum.update(metrics["val_acc"]):
                log(f"curriculum: training length now {curriculum.length}")
            metrics["st_length"] = curriculum.length  # the training length from this iteration on
        log(f"eval iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        write_log({"iter": iter_num, **metrics})
        if iter_num > 0 or iter_num >= max_iters:  # the initial model only as the result (max_iters=0)
            save()
            saved_at = iter_num
    if iter_num >= max_iters:
        break
    stopped_by = interrupts.stop()  # a signal during the last step: checkpoint (unless just done) and stop
    if stopped_by:
        if saved_at != iter_num:
            save()
        break

    t0 = time.time()
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    train_loss = train_iteration(iter_num)
    max_norm = grad_clip if grad_clip > 0 else math.inf  # inf: only measure the norm
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), max_norm).item()
    if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
        fail(
            f"iteration {iter_num}: train loss {train_loss}, gradient norm {grad_norm}: stopping before the "
            f"update. The last good checkpoint ({ckpt_path}) is left as is; try a lower learning_rate."
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device_type == "cuda":
        torch.cuda.synchronize()
    dt = time.time() - t0
    if iter_num >= timed_from:
        dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
    length = curriculum.length if curriculum else block_size
    tok_per_s = global_rows * length / dt
    mfu = flops_per_token(length) * tok_per_s / (peak * world_size) if peak else None
    record = dict(iter=iter_num, train_loss=train_loss, lr=lr, tok_per_s=tok_per_s, grad_norm=grad_norm)
    write_log({**record, "dt_ms": 1000 * dt, "mfu": mfu})
    if iter_num % log_interval == 0:
        eta = hms((max_iters - iter_num - 1) * dt_avg) if dt_avg is not None else "-"
        log(
            f"iter {iter_num}: loss {train_loss:.4f}, lr {lr:.2e}, {tok_per_s:,.0f} tok/s, "
            f"mfu {f'{100 * mfu:.1f}%' if mfu is not None else '-'}, {1000 * dt:.0f} ms, eta {eta}"
        )
    iter_num += 1
    if max_seconds:  # rank 0's clock decides, so that every rank stops at the same iteration
        time_up = torch.tensor(float(time.time() - train_start >= max_seconds), device=device)
        if ddp:
            dist.broadcast(time_up, 0)
        if time_up.item():
            max_iters = min(max_iters, iter_num)  # time is up: the loop evaluates, checkpoints and stops

if curriculum and not stopped_by:
    metrics = st.at_lengths(evaluate, val_loader, st_eval_lengths)
    log("final: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    write_log({"iter": iter_num, "final": True, **metrics})
if device_type == "cuda":
    log(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
if stopped_by:
    name = signal.Signals(stopped_by).name
    log(f"{name}: interrupted at iteration {iter_num}; resume with --init_from=resume ({ckpt_path})")
else:
    log(f"done: {iter_num} iterations, best val loss {best_val_loss:.4f}, checkpoint {ckpt_path}")
if master:
    run_log.close()
    if wandb is not None:
        wandb.finish()
if ddp:  # no rank leaves before rank 0 has written its checkpoint and log: a rank that exits first has the
    dist.barrier()  # launcher stop the others, and gloo aborts a peer torn down inside a collective
    dist.destroy_process_group()
if stopped_by:
    sys.exit(128 + stopped_by)
