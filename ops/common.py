"""What the DDL and Deltaformer ops share: the backend rule, the accumulation dtype, the default scale; and
the fp32 logits of the gates (and DDL's v) where no kernel forms them."""

import importlib.util
import math
import os

import torch

BACKENDS = ("auto", "torch", "triton")
# A constant, so that torch.compile does not trace an import.
HAS_TRITON = importlib.util.find_spec("triton") is not None
_auto_backend = None  # None: the rule in resolve_backend; or a fixed "torch" / "triton"


def set_auto_backend(backend):
    """Fix what backend="auto" means for every op: None (the default rule), "torch" or "triton"."""
    global _auto_backend
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"set_auto_backend: backend must be None, 'torch' or 'triton', got {backend!r}")
    _auto_backend = backend


def resolve_backend(fn, backend, *tensors):
    """ "torch" or "triton" for a call of `fn` on these tensors. "auto": Triton when they are all on CUDA and
    Triton is importable, else PyTorch (so CPU runs take PyTorch, even under TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        backend = _auto_backend or ("triton" if HAS_TRITON and on_cuda else "torch")
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{fn}: backend='triton' needs the triton package; use backend='torch'")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{fn}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return backend


def acc_dtype(*tensors):
    """The dtype the ops compute in: float64 if any input is float64, else float32 (bf16 / fp16 too)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def default_scale(head_dim, scale=None):
    """scale, or 1 / sqrt(head_dim) when it is None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def autocast_dtype(device_type):
    """The dtype autocast computes matmuls in on this device type, or None where it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def fp32_linear(x, weight, bias=None):
    """x W^T + b in fp32 (float64 stays float64) even under autocast: the logits of DDL's v and beta and of
    Deltaformer's beta where no kernel forms them."""
    dt = acc_dtype(x)
    lp = (autocast_dtype(x.device.type) if dt == torch.float32 else None) or dt
    y = _Logits.apply(x.to(dt), weight.to(dt), lp)
    return y if bias is None else y + bias.to(dt)


class _Logits(torch.autograd.Function):
    """x W^T. Compiled: one product summed over d per output, which the compiler fuses into x's producer (the
    norm), and so dx in the backward; eager: matmuls (the summed form would hold [.., outputs, d]).
    dW = dy^T x: one GEMM of operands in lp, autocast's dtype (the precision every other weight's gradient
    has), x saved in lp (the copy the next matmul saves). Against a GEMV and autograd's backward:
    bench/RESULTS.md, Training throughput."""

    @staticmethod
    def forward(ctx, x, weight, lp):
        ctx.save_for_backward(x.to(lp), weight)
        if torch.compiler.is_compiling():
            return torch.stack([(x * w).sum(-1) for w in weight], -1)
        with torch.autocast(x.device.type, enabled=False):
            return x @ weight.T

    @staticmethod
    def backward(ctx, dy):
        x_lp, weight = ctx.saved_tensors
        dw = dy.flatten(0, -2).T.to(x_lp.dtype) @ x_lp.flatten(0, -2)
        if torch.compiler.is_compiling():  # one elementwise kernel for any number of outputs: as .sum(-2),
            dx = dy[..., 0, None] * weight[0]  # 8 outputs became a slow reduction kernel (RESULTS.md)
            for i in range(1, weight.shape[0]):
                dx = dx + dy[..., i, None] * weight[i]
        else:
            dx = dy @ weight
        return dx, dw.to(weight.dtype), None


EOT = 50256  # GPT-2's <|endoftext|>, before every document of the corpora (data/tokenizer.py)


def doc_starts(idx, eot=None, pos=0, real=None):
    """doc_start [B, T] of tokens idx [B, T] at positions pos.. of their sequence: for each token, the
    position of the first token of its document, the representation every op's doc_start takes. A document
    begins at each `eot` token (None: none does), and at the first real token after left padding (real
    [B, T] bool, False on the padding, which is a document of its own); 0 where none began among idx (a
    cache continues the earlier tokens' document: cache.Cache.doc_start)."""
    t = pos + torch.arange(idx.shape[1], device=idx.device)
    begins = torch.zeros_like(idx, dtype=torch.bool) if eot is None else idx == eot
    if real is not None:
        begins = begins | (real & ~torch.nn.functional.pad(real, (1, -1), value=True))
    return torch.where(begins, t, 0).cummax(dim=1).values


def left_padding(attention_mask, idx):
    """attention_mask [B, T] (1: a token, 0: padding) of tokens idx as bool, or None; only left padding (a
    row's 0s before its 1s) is taken: a 0 after a 1 is refused."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(idx.shape):
        shape = tuple(attention_mask.shape)
        raise ValueError(f"attention_mask must be [B, T] = {tuple(idx.shape)} as the tokens, got {shape}")
    real = attention_mask.bool()
    if not torch.compiler.is_compiling() and bool((real[:, :-1] & ~real[:, 1:]).any()):
        raise ValueError("attention_mask: only left padding is supported (each row's 0s before its 1s)")
    return real
