"""train.py's run files, out_dir/ckpt.pt and log.jsonl: read and written with one-line errors naming the file.

    from checkpoint import CheckpointError, load_checkpoint, load_model
    model, ckpt = load_model("out/ckpt.pt", device="cuda")   # GPT in eval mode, the checkpoint dict
    ckpt = load_checkpoint("out/ckpt.pt")   # model, optimizer, model_args, config, iter_num, ...

Imports torch and model.py only (no training code), so evaluation scripts can use it too.

load_checkpoint unpickles tensors and plain containers only (torch.load with weights_only=True): a
truncated, empty, random or foreign file raises CheckpointError saying so, never a raw traceback or the
advice to load it unsafely. save_checkpoint is atomic (temp file, fsync, rename): ckpt.pt is always the
last complete checkpoint, a failed write removes its temp file, and a full disk is reported in one line
with the space needed. On resume, log_lines_before keeps the log up to the checkpoint; RunLog writes
the log, its first record replacing the previous log (by the kept lines and itself) atomically too.
hold_run_dir locks the run folder for one live run; keep_log renames the log of a run that stopped before
its first checkpoint, so a new run can start there without deleting it. step_memory estimates what a
training step holds in memory, and available_memory what the device has, for train.py to check before
its first step.
"""

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import pickle
import random
import shutil
import warnings
import zipfile

import numpy as np
import torch

from data.shards import hold_dir, lock_holder
from model import ATTENTIONS, GPT, DeltaformerAttention, GPTConfig


class CheckpointError(Exception):
    """A checkpoint that cannot be read or written; the message (one line) names the file."""


def looks_saved_by_torch(path):
    """Whether the file starts like one torch.save wrote: a zip archive, or (the legacy format) a pickle,
    whose first opcode is PROTO with a protocol of 2 to 5."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def load_checkpoint(path, required=("model", "model_args")):
    """The checkpoint dict at `path` (tensors on the CPU); CheckpointError if it is missing or unreadable."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a checkpoint")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of foreign files
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if not looks_saved_by_torch(path):  # random or foreign bytes, not a pickle of unsafe objects
            what = f"{size:,} bytes in no format torch.save writes"
            raise CheckpointError(f"{path}: not a checkpoint ({what})") from None
        raise CheckpointError(
            f"{path}: holds objects other than tensors and plain containers; not a checkpoint of train.py "
            "(refused: unpickling arbitrary objects can run code)"
        ) from None
    except EOFError:
        raise CheckpointError(f"{path}: ends early ({size:,} bytes): truncated or corrupt") from None
    except RuntimeError as e:  # torch's zip reader: "PytorchStreamReader failed reading zip archive: ..."
        first = str(e).split(". ")[0].splitlines()[0]
        raise CheckpointError(f"{path}: truncated or corrupt ({size:,} bytes): {first}") from None
    except (ValueError, KeyError, IndexError, OSError, zipfile.BadZipFile):  # not torch.save's format
        raise CheckpointError(f"{path}: not a checkpoint ({size:,} bytes torch.load cannot read)") from None
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path}: holds a {type(ckpt).__name__}, not a checkpoint dict")
    missing = [k for k in required if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path}: not a checkpoint of train.py (no {', '.join(map(repr, missing))})")
    return ckpt


# GPTConfig fields whose meaning or default changed since checkpoints were first written: a checkpoint
# without them was built by an older model.py (QK-norm before RoPE, eps 1e-6, a compressor per sublayer).
CHECKPOINT_FIELDS = ("init", "norm_eps")


def model_config(model_args, path="checkpoint"):
    """The GPTConfig of a checkpoint's model_args; CheckpointError naming `path` if model.py rejects them."""
    if not isinstance(model_args, dict):
        raise CheckpointError(f"{path}: model_args is a {type(model_args).__name__}, not a dict")
    missing = [name for name in CHECKPOINT_FIELDS if name not in model_args]
    if missing:
        raise CheckpointError(
            f"{path}: model_args do not fit this model.py: they lack the field(s) {missing}, so an older "
            "model.py wrote them (QK-norm before RoPE, RMSNorm eps 1e-6, a DDL compressor per sublayer), "
            "which this one does not build; load it with the model.py of its commit"
        )
    unknown = sorted(set(model_args) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise CheckpointError(f"{path}: model_args do not fit this model.py: unknown field(s) {unknown}")
    try:
        return GPTConfig(**model_args)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: model_args do not fit this model.py: {e}") from None


def load_for_resume(path, model_args, run_fields):
    """(checkpoint, model_args) of a run resumed from `path`: the architecture from the checkpoint, the
    run_fields (e.g. dropout, the kernel backend) from this run's `model_args`; CheckpointError when the
    checkpoint is unreadable or its model_args do not fit model.py."""
    ckpt = load_checkpoint(path, required=("model", "model_args", "optimizer", "iter_num"))
    resumed = {**ckpt["model_args"], **{k: model_args[k] for k in run_fields if k in model_args}}
    return ckpt, dataclasses.asdict(model_config(resumed, path))


def load_model(path, device="cpu"):
    """(GPT with the checkpoint's weights, in eval mode on `device`; the checkpoint dict)."""
    ckpt = load_checkpoint(path)
    model = GPT(model_config(ckpt["model_args"], path))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise CheckpointError(f"{path}: its weights do not fit its model_args: {first}") from None
    return model.eval().to(device), ckpt


def tensor_bytes(obj):
    """Bytes of all tensors in a nest of dicts, lists and tuples (about the size torch.save writes)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def size_text(n):
    """Bytes as '1.2 GB', '345 MB', '3.4 MB', '12 KB' or '0 bytes'."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if n >= scale:
            return f"{n / scale:.{0 if n >= 10 * scale else 1}f} {unit}"
    return f"{round(n / 2**10)} KB" if n >= 2**10 else f"{n} bytes"


def write_error(path, e, need_bytes):
    """One line for an OSError `e` raised while writing `path` (about need_bytes long)."""
    directory, name = os.path.split(os.path.abspath(path))
    need = f"need ~{size_text(need_bytes)} for {name}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            need += f" ({size_text(shutil.disk_usage(directory).free)} free)"
        return f"no space left on {directory}: {need}"
    if e.errno == errno.EFBIG:
        return f"cannot write {path}: over the file size limit (ulimit -f): {need}"
    return f"cannot write {path}: {e.strerror or e}"


def save_checkpoint(ckpt, path):
    """Write `ckpt` to `path` atomically; on failure remove the temp file and raise CheckpointError."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name says the checkpoint is complete
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        cause = e  # torch.save's zip writer can raise a RuntimeError while handling the write's OSError
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        kept = f"the previous {os.path.basename(path)} is kept" if os.path.exists(path) else "nothing written"
        raise CheckpointError(f"{write_error(path, cause, tensor_bytes(ckpt))}; {kept}") from None


def hold_run_dir(path):
    """Create the run folder `path` if needed and lock it for as long as this process lives (data/shards.py's
    hold_dir: flock on the folder, dropped by the OS when the process ends, even by kill -9); return (the
    descriptor that holds the lock: keep it open, the folders made for it). CheckpointError if `path` is a
    file, cannot be created, or a live process holds it."""
    try:
        return hold_dir(path)
    except NotADirectoryError:
        raise CheckpointError(f"out_dir {path} is a file, not a folder; choose another --out_dir") from None
    except BlockingIOError:
        raise CheckpointError(
            f"{path} is in use by another training run{lock_holder(path)}: wait for it to end, or choose "
            "another --out_dir (--overwrite=True does not replace a live run)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"cannot create the run folder {path}: {e.strerror or e}") from None


def keep_log(path):
    """Rename the log at `path` (dir/log.jsonl) to the first free dir/log.N.jsonl, N = 1, 2, ...; return
    the new path. For the log of a run that stopped before its first checkpoint: nothing to resume, but
    not deleted."""
    stem, ext = os.path.splitext(path)
    kept = next(f"{stem}.{n}{ext}" for n in itertools.count(1) if not os.path.exists(f"{stem}.{n}{ext}"))
    try:
        os.rename(path, kept)
    except OSError as e:
        raise CheckpointError(f"cannot rename {path} to {kept}: {e.strerror or e}") from None
    return kept


def step_memory(cfg, batch_size, length, bf16, ddp=False):
    """Bytes a training step of the GPTConfig `cfg` holds at its peak, estimated, by part: weights,
    gradients (twice under DDP: its buckets), AdamW's two moments (fp32), activations autograd keeps for the
    backward of a micro-step of batch_size x length tokens, and the logits. Activations per token and block,
    in the autocast dtype (bf16: 2 bytes, else 4): the sublayers' normed inputs and their norms (6 d), q, k, v
    with their roped and normed forms and the attention output (9 H D), the MLP's (4 hidden); Deltaformer's u
    (2 H D); DDL's per-sublayer vectors (2 d) and the kept states (d x d_v, every ddl_keep_state_every-th
    block). Logits: 3 values per token and vocabulary entry (the logits, the loss's log-probabilities, their
    gradient). On GPT-2 small/medium with the GPU kernels this is within 2% of the measured peaks
    (bench/RESULTS.md); the PyTorch paths of DDL and Deltaformer (the CPU's) keep up to ~2x more."""
    with torch.device("meta"):  # shapes only: instant, whatever the size
        n = GPT(cfg).num_params()
    a = 2 if bf16 else 4
    d, hd = cfg.n_embd, cfg.n_head * cfg.head_dim
    per_block = 6 * d + 9 * hd + 4 * cfg.hidden
    per_block += 2 * hd if issubclass(ATTENTIONS[cfg.attention], DeltaformerAttention) else 0
    per_block += 2 * d if cfg.is_ddl else 0
    states = 0  # DDL at d_v = 1: the state is the sublayer's input, counted above
    if cfg.is_ddl and cfg.ddl_dv > 1:
        every = cfg.ddl_keep_state_every
        kept = 2 * cfg.n_layer if every == 0 else -(-cfg.n_layer // every)
        states = kept * d * cfg.ddl_dv * (2 if cfg.ddl_state_dtype == "bfloat16" else 4)
    tokens = batch_size * length
    return {
        "weights": 4 * n,
        "gradients": 4 * n * (2 if ddp else 1),
        "optimizer": 8 * n,
        "activations": tokens * (a * (cfg.n_layer * per_block + 3 * d) + states),  # 3 d: the final norm's
        "logits": tokens * cfg.vocab_size * 3 * a,
    }


def available_memory(device):
    """Bytes `device` ("cpu", "cuda", "cuda:N") has for this process now: the GPU's free memory, or the
    RAM the kernel counts as available (MemAvailable, else the free pages); None where not known."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def rng_state(cuda_device=None):
    """Python, numpy, torch (and this rank's CUDA device's) RNG states, loadable with weights_only=True."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),  # as a tensor
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None,
    }


def set_rng_state(state, cuda_device=None):
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if cuda_device is not None and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], cuda_device)


def log_lines_before(path, iter_num, warn=print):
    """The lines of the log at `path` that a run resumed at `iter_num` keeps: every record before it
    and the evaluation at it (a crashed run's later records run again). A cut-short last line (the run
    stopped while writing it) is dropped with warn(message); any other bad line raises CheckpointError."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    kept = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
            keep = rec["iter"] < iter_num or ("val_loss" in rec and rec["iter"] == iter_num)
        except (ValueError, KeyError, TypeError) as e:
            if not line.strip():
                continue
            if n == len(lines) and not line.endswith(b"\n"):
                warn(f"warning: {path}:{n}: dropped a cut-short last line (a run stopped while writing it)")
                continue
            raise CheckpointError(f"{path}:{n}: not a log record ({e}); fix or delete that line") from None
        if keep:
            kept.append(line.decode())
    return kept


def start_log(path, lines):
    """Replace the file at `path` by `lines` atomically; return it opened for appending. On an OSError the
    temp file is removed and the previous file left as it was."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return open(path, "a")  # noqa: SIM115 (the caller keeps it open)


class RunLog:
    """log.jsonl of a run, one JSON record a line. Until the first record a previous run's files stay as
    they were: that record replaces the log by `kept` (the lines a resumed run keeps) and itself, and
    removes the file `replaces` (the checkpoint of a run being overwritten) first. A failed write raises
    CheckpointError."""

    def __init__(self, path, kept=(), replaces=None):
        self.path, self.kept, self.replaces, self.file = path, list(kept), replaces, None

    def write(self, record):
        line = json.dumps(record) + "\n"
        try:
            if self.file is None:
                if self.replaces and os.path.exists(self.replaces):
                    os.remove(self.replaces)
                self.file = start_log(self.path, self.kept + [line])
            else:
                self.file.write(line)
                self.file.flush()
        except OSError as e:
            raise CheckpointError(write_error(self.path, e, len(line) + sum(map(len, self.kept)))) from None

    def close(self):
        if self.file is not None:
            self.file.close()
