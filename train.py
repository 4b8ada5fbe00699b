"""
Train a GPT with any residual x attention variant, on one CPU/GPU or with DDP.

usage: python train.py [CONFIG.py ...] [--key=value ...]   (config files and overrides apply left to right)

    python data/shakespeare.py && python train.py configs/shakespeare.py    # start here: 2 CPU cores, ~8 min
    python train.py configs/gpt2_small.py --residual=ddl-cc                 # one GPU
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_small.py
    python train.py --help                                   # every config key, its default and meaning

Every module-level name in the "config keys" section below, and every GPTConfig field, is a config key:
set it in a config file (plain Python) or with --key=value (see configurator.py). A fresh run refuses an
out_dir that holds a previous run (ckpt.pt or log.jsonl): --init_from=resume continues it,
--overwrite=True replaces it (its files go when the new run writes its first log record).

Reproducibility contract:
  * global batch `iter_num` is a pure function of (data, seed, iter_num) and holds
    G = batch_size * gradient_accumulation_steps rows; rank r, micro-step m takes rows
    (m * world_size + r) * batch_size ... of it, so the global batches do not depend on the number of ranks;
  * the loss of each micro-step is weighted so that the summed gradient is that of the mean loss over all
    valid (!= -1) targets of the global batch, whatever the number of ranks;
  * a checkpoint holds everything that decides the future (model, optimizer, iteration = data position,
    RNG states), so init_from="resume" continues bit-exactly on CPU.
"""

import contextlib
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint as ck
from configurator import ConfigError, key_help, load_config
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
# compile + DDP: let Dynamo split the graph at DDP's gradient buckets so the all-reduce overlaps the
# backward (DDPOptimizer). Off: one graph, all-reduce after the backward. Measured on 2 H200s
# (bench/bench_ddp.py, gpt2-small): the split cost ddl-cc 0.98 -> 0.73 of linear scaling, additive nothing
ddp_split_graph = False  # compile + DDP: split the graph at DDP's buckets (see above)
dry_run = False  # print the resolved config and the model size, then exit (needs no data)
# -----------------------------------------------------------------------------
_train_keys = [k for k in globals() if k not in _names_before_config and not k.startswith("_")]
_model_fields = [f for f in dataclasses.fields(GPTConfig) if f.name not in _train_keys]
_defaults = {k: globals()[k] for k in _train_keys}
_defaults.update({f.name: f.default for f in _model_fields})
DATASETS = ("shakespeare", "fineweb_edu", "state_tracking")
RUN_FIELDS = ("dropout", "backend")  # GPTConfig fields that a resumed run may change
USAGE = __doc__.split("Reproducibility")[0].strip()  # printed by --help and without arguments


def fail(message):
    """Stop with a clear message and a non-zero exit status (on every rank)."""
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1)


if not sys.argv[1:] or {"-h", "--help"} & set(sys.argv[1:]):  # usage, not a 124M-parameter run on a CPU
    if not sys.argv[1:]:
        sys.exit(USAGE)
    sources = [(__file__, None), (inspect.getsourcefile(GPTConfig), "GPTConfig")]
    print(f"{USAGE}\n\nconfig keys (default, meaning):\n{key_help(_defaults, sources)}")
    sys.exit(0)
try:
    config = load_config(_defaults, sys.argv[1:])
except ConfigError as e:
    fail(str(e))
globals().update(config)

# ---- validate early, before any data or model work ----
if init_from not in ("scratch", "resume"):
    fail(f"init_from must be 'scratch' or 'resume', got {init_from!r}")
if dataset not in DATASETS:
    fail(f"dataset must be one of {', '.join(DATASETS)}; got {dataset!r}")
if dtype not in ("float32", "bfloat16"):
    fail(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
_positive = ("batch_size", "block_size", "gradient_accumulation_steps", "eval_interval", "eval_iters")
for _key in (*_positive, "log_interval"):
    if config[_key] < 1:
        fail(f"{_key} must be >= 1, got {config[_key]}")
for _key in ("max_iters", "warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip"):
    if config[_key] < 0:
        fail(f"{_key} must be >= 0, got {config[_key]}")
if not 0 <= min_lr <= learning_rate:
    fail(f"need 0 <= min_lr <= learning_rate, got min_lr={min_lr}, learning_rate={learning_rate}")
if not (device == "cpu" or device.startswith("cuda")):
    fail(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
if device.startswith("cuda") and not torch.cuda.is_available():
    fail(f"device={device!r} but CUDA is not available (use --device=cpu)")
try:  # resolved (e.g. ddl_dv=None -> 4), so model_args round-trips through the checkpoint
    model_args = dataclasses.asdict(
        GPTConfig(**{f.name: config[f.name] for f in dataclasses.fields(GPTConfig)})
    )
except (ValueError, TypeError) as e:
    fail(f"model config: {e}")

# ---- the run directory: resume from it, or refuse to start over a previous run ----
ckpt_path = os.path.join(out_dir, "ckpt.pt")
log_path = os.path.join(out_dir, "log.jsonl")
checkpoint = None
if init_from == "resume":
    try:
        checkpoint = ck.load_checkpoint(ckpt_path, required=("model", "model_args", "optimizer", "iter_num"))
        # the architecture comes from the checkpoint; dropout and the kernel backend from this run's config
        resumed = {**checkpoint["model_args"], **{k: model_args[k] for k in RUN_FIELDS if k in model_args}}
        resumed = dataclasses.asdict(ck.model_config(resumed, ckpt_path))
    except ck.CheckpointError as e:
        fail(f"init_from='resume': {e}")
    changed = {k: (v, resumed[k]) for k, v in model_args.items() if k in resumed and resumed[k] != v}
    if changed and os.environ.get("RANK", "0") == "0":
        _values = ", ".join(f"{k}={new!r} (not {old!r})" for k, (old, new) in changed.items())
        print(f"resume: the model comes from {ckpt_path}: {_values}", flush=True)
    model_args = resumed
    block_size = model_args["block_size"]  # the loaders cut rows of the model's length
elif not dry_run:
    previous = [p for p in (ckpt_path, log_path) if os.path.isfile(p) and os.path.getsize(p) > 0]
    if previous and not overwrite:
        fail(
            f"{out_dir} holds a previous run ({', '.join(map(os.path.basename, previous))}); continue it "
            "with --init_from=resume, replace it with --overwrite=True, or choose another --out_dir"
        )

if dry_run:
    with torch.device("meta"):  # shapes only: instant, even for the large presets
        meta_model = GPT(GPTConfig(**model_args))
    print("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in {**config, **model_args}.items()))
    print(f"parameters: {meta_model.num_params():,}")
    print(f"forward+backward FLOPs per token at T={block_size}: {meta_model.flops_per_token(block_size):,}")
    sys.exit(0)

# ---- distributed setup: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE ----
ddp = "RANK" in os.environ
if ddp:
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
else:
    rank, local_rank, world_size = 0, 0, 1
master = rank == 0
if gradient_accumulation_steps % world_size:
    fail(
        f"gradient_accumulation_steps={gradient_accumulation_steps} (global) must be divisible by the "
        f"number of ranks ({world_size})"
    )
micro_steps = gradient_accumulation_steps // world_size  # per rank
global_rows = batch_size * gradient_accumulation_steps
tokens_per_iter = global_rows * block_size
device_type = "cuda" if device.startswith("cuda") else "cpu"
if device_type == "cuda":
    torch.set_float32_matmul_precision("high")  # TF32 matmuls (only on CUDA: CPU stays exact float32)
    torch.backends.cudnn.allow_tf32 = True
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        fail("dtype='bfloat16' but this GPU does not support bfloat16; use --dtype=float32")
cuda_device = device if device_type == "cuda" else None  # for the CUDA RNG state
bf16 = dtype == "bfloat16"
autocast = torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def log(*args):
    if master:
        print(*args, flush=True)


if master:  # temp files of a run killed while writing them
    os.makedirs(out_dir, exist_ok=True)
    for _tmp in (ckpt_path + ".tmp", log_path + ".tmp"):
        if os.path.exists(_tmp):
            os.remove(_tmp)


# ---- data ----
def make_loaders():
    """(train_loader, val_loader) for `dataset`, each with get_batch(step, row_start, row_count, global_rows).

    A new data source is one more branch here returning two objects with that method."""
    if dataset == "state_tracking":  # generated on the fly; train and val use disjoint seed streams
        from data.state_tracking import StateTrackingLoader

        args = dict(task=st_task, length=st_length, seed=seed, n=st_n, n_nodes=st_n_nodes)
        try:
            train, val = StateTrackingLoader(split="train", **args), StateTrackingLoader(split="val", **args)
        except ValueError as e:
            fail(f"dataset='state_tracking': {e}")
        need = max(st_length, st_max_length, *st_eval_lengths)  # set vocab_size small in the config
        if model_args["vocab_size"] < train.vocab_size or model_args["block_size"] < need:
            fail(
                f"st_task={st_task!r} needs vocab_size >= {train.vocab_size} and block_size >= {need} "
                f"for its lengths; got vocab_size {model_args['vocab_size']}, block_size {block_size}"
            )
        return train, val
    from data.loader import shard_loaders

    prepare = {"shakespeare": "python data/shakespeare.py", "fineweb_edu": "python data/fineweb_edu.py"}
    try:  # every token id must be < vocab_size (checked when a shard is first used)
        directory = data_dir or os.path.join(REPO, "data", dataset)
        return shard_loaders(directory, block_size, seed=seed, vocab_size=model_args["vocab_size"])
    except FileNotFoundError as e:
        fail(f"{e}\n  dataset={dataset!r}: prepare it first with `{prepare[dataset]}` (or set data_dir)")
    except ValueError as e:
        fail(f"dataset={dataset!r}: {e}")


def micro_batch(loader, step, m):
    """This rank's m-th micro-batch of global batch `step`, on the CPU."""
    try:
        return loader.get_batch(step, (m * world_size + rank) * batch_size, batch_size, global_rows)
    except ValueError as e:  # e.g. a shard with token ids >= vocab_size, named in the message
        fail(f"dataset={dataset!r}: {e}")


def to_device(t):
    if device_type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def all_reduce_sum(t):
    if ddp:
        dist.all_reduce(t)
    return t


# ---- model, optimizer, resume ----
random.seed(seed)
np.random.seed(seed)
torch.manual_seed(seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
raw_model = GPT(GPTConfig(**model_args))
if checkpoint is not None:
    try:
        raw_model.load_state_dict(checkpoint["model"])
    except RuntimeError as e:
        fail(f"{ckpt_path}: its weights do not fit its model_args: {str(e).splitlines()[0]}")
raw_model.to(device)
train_loader, val_loader = make_loaders()

params = [p for p in raw_model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(
    [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ],
    lr=learning_rate,
    betas=betas,
    fused=True if device_type == "cuda" else None,
)
iter_num, best_val_loss = 0, float("inf")
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    if checkpoint.get("st_length"):  # the curriculum's current training length
        train_loader.length = val_loader.length = checkpoint["st_length"]

if compile:
    torch._dynamo.config.optimize_ddp = ddp_split_graph
model = torch.compile(raw_model) if compile else raw_model
eval_model = model  # evaluation skips DDP: no gradients to sync
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)

random.seed(seed + rank)
np.random.seed(seed + rank)
torch.manual_seed(seed + rank)  # per-rank randomness from here on (dropout)
if checkpoint is not None:
    if len(checkpoint["rng"]) == world_size:
        ck.set_rng_state(checkpoint["rng"][rank], cuda_device)
    else:
        log(
            f"resume: checkpoint has RNG states of {len(checkpoint['rng'])} ranks, not {world_size}: reseeded"
        )
    del checkpoint


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
        "st_length": getattr(train_loader, "length", None),  # state-tracking curriculum position
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
    hits = torch.zeros(3, dtype=torch.float64, device=device)  # state tracking: correct, correct last, n last
    for step in range(eval_iters):
        for m in range(micro_steps):
            x, y = micro_batch(val_loader, step, m)
            n = int((y != -1).sum())
            if n == 0:
                continue
            with autocast:
                logits, loss = eval_model(to_device(x), to_device(y))
            loss_sum += loss.double() * n
            count += n
            if dataset == "state_tracking":  # per-position accuracy; a target of -1 never equals an argmax
                hit = logits.argmax(-1) == to_device(y)
                hits += torch.stack([hit.sum(), hit[:, -1].sum(), (y[:, -1] != -1).sum().to(device)])
    eval_model.train()
    all_reduce_sum(loss_sum)
    all_reduce_sum(count)
    all_reduce_sum(hits)
    metrics = {"val_loss": (loss_sum / count).item()}
    if dataset == "state_tracking":
        metrics["val_acc"] = (hits[0] / count).item()  # over all labelled positions
        metrics["val_acc_last"] = (hits[1] / hits[2].clamp(min=1)).item()  # the last position only
    return metrics


def evaluate_lengths(lengths):
    """State tracking: evaluate() at each length (the same fixed val batches, drawn at that length)."""
    metrics = {}
    for length in lengths:
        val_loader.length = length
        metrics.update({f"{k}@{length}": v for k, v in evaluate().items()})
    val_loader.length = train_loader.length
    return metrics


def grow_curriculum(val_acc, it):
    """Double the training length once val_acc >= st_curriculum_acc, up to st_max_length; return it.
    Only at iterations on the eval_interval grid: a run stopped and resumed elsewhere, or stopped by
    max_seconds, follows the same curriculum."""
    if st_curriculum and it % eval_interval == 0 and val_acc >= st_curriculum_acc:
        if train_loader.length < st_max_length:
            train_loader.length = val_loader.length = min(2 * train_loader.length, st_max_length)
            log(f"curriculum: training length now {train_loader.length}")
    return train_loader.length


def train_iteration(step):
    """Forward/backward over this rank's micro-batches of global batch `step`; returns the mean loss
    over all valid targets of the global batch (all ranks, all micro-steps). Gradients end up as those
    of that same mean, independent of the number of ranks."""
    batches = [micro_batch(train_loader, step, m) for m in range(micro_steps)]
    counts = [int((y != -1).sum()) for _, y in batches]
    total = all_reduce_sum(torch.tensor(float(sum(counts)), dtype=torch.float64, device=device)).item()
    if total == 0:
        fail(f"global batch {step} has no valid targets (all -1)")
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, ((x, y), n) in enumerate(zip(batches, counts)):
        last = m == micro_steps - 1
        with model.no_sync() if ddp and not last else contextlib.nullcontext():
            with autocast:
                logits, loss = model(to_device(x), to_device(y))
            if n == 0:  # mean over zero targets is NaN; still run a backward so DDP's sync happens
                logits.float().sum().mul(0.0).backward()
                continue
            # DDP averages gradients over ranks, hence * world_size
            (loss * (n * world_size / total)).backward()
        loss_sum += loss.detach().double() * n
    return all_reduce_sum(loss_sum).item() / total


# ---- logging ----
def peak_flops():
    """bf16 dense peak of one GPU from its name, or None when unknown (then MFU is not reported)."""
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H100", 989e12), ("H200", 989e12), ("A100", 312e12)):
        if key in name:
            return flops
    return None


log_file, log_kept = None, []  # the previous log's lines that a resumed run keeps
if master and init_from == "resume":
    try:
        log_kept = ck.log_lines_before(log_path, iter_num, warn=log)
    except ck.CheckpointError as e:
        fail(f"{e} to resume")
wandb = None
if wandb_log and master:
    try:
        import wandb
    except ImportError:
        fail("wandb_log=True but wandb is not installed (pip install wandb)")
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)


def write_log(record):
    """Append a record to log.jsonl; until the first one, a previous run's files stay as they were."""
    global log_file
    if not master:
        return
    line = json.dumps(record) + "\n"
    try:
        if log_file is None:  # the first record: only now is a previous run's log replaced
            if init_from == "scratch" and os.path.exists(ckpt_path):
                os.remove(ckpt_path)  # --overwrite=True: the previous run's checkpoint goes with its log
            log_file = ck.start_log(log_path, log_kept + [line])
        else:
            log_file.write(line)
            log_file.flush()
    except OSError as e:
        fail(ck.write_error(log_path, e, len(line) + sum(map(len, log_kept))))
    if wandb is not None:
        wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])


def hms(seconds):
    return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"


peak = peak_flops()
flops_per_token = functools.cache(raw_model.flops_per_token)  # per training length (it counts parameters)
log(
    f"model: {raw_model.num_params() / 1e6:.2f}M parameters, {model_args['residual']} residual, "
    f"{model_args['attention']} attention"
)
log(
    f"{world_size} rank(s) on {device}, {micro_steps} micro-steps of {batch_size} x {block_size} per rank, "
    f"{tokens_per_iter:,} tokens per iteration"
)

# ---- training loop ----
resumed_at = iter_num if init_from == "resume" else None
timed_from = iter_num + 2  # the ETA leaves out this process's first iterations (compilation, warm-up)
dt_avg = None
train_start = time.time()  # for max_seconds (counts this process only, not earlier resumed runs)
while True:
    if (iter_num % eval_interval == 0 or iter_num == max_iters) and iter_num != resumed_at:
        metrics = evaluate()
        if not all(math.isfinite(v) for v in metrics.values()):
            fail(f"iteration {iter_num}: non-finite evaluation {metrics}; last good checkpoint left as is")
        best_val_loss = min(best_val_loss, metrics["val_loss"])
        if dataset == "state_tracking":  # st_length: the training length from this iteration on
            metrics["st_length"] = grow_curriculum(metrics["val_acc"], iter_num)
        log(f"eval iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        write_log({"iter": iter_num, **metrics})
        if iter_num > 0:
            save()
    if iter_num >= max_iters:
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
    # state tracking trains at the curriculum's length, not block_size
    length = train_loader.length if dataset == "state_tracking" else block_size
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
    if max_seconds:
        # rank 0's clock decides, so that every rank stops at the same iteration
        time_up = torch.tensor(float(time.time() - train_start >= max_seconds), device=device)
        if ddp:
            dist.broadcast(time_up, 0)
        if time_up.item():
            max_iters = min(max_iters, iter_num)  # time is up: the loop evaluates, checkpoints and stops

if dataset == "state_tracking":
    metrics = evaluate_lengths(st_eval_lengths)
    if not all(math.isfinite(v) for v in metrics.values()):
        fail(f"final evaluation: non-finite metrics {metrics}")
    log("final: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    write_log({"iter": iter_num, "final": True, **metrics})
if device_type == "cuda":
    log(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
log(f"done: {iter_num} iterations, best val loss {best_val_loss:.4f}, checkpoint {ckpt_path}")
if master:
    if log_file is not None:
        log_file.close()
    if wandb is not None:
        wandb.finish()
if ddp:
    dist.destroy_process_group()
