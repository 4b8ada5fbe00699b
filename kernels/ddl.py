"""Deep Delta Learning (DDL) residual ops: the state update, the compressors and the EC expansion.

The residual stream of a DDL model is a matrix state X [B, T, d, d_v] per token (d_v = 1: a vector).
Each sublayer reads a vector out of it (a compressor), computes F, and writes back with a rank-1
delta-rule update along a learned direction k:

    khat = k / sqrt(|k|^2 + eps^2)                      (eps keeps k = 0 finite)
    X'   = X + beta * khat (v^T - khat^T X)              (erase=True: read-compare-write)
    X'   = X + beta * khat v^T                           (erase=False: the write-only control)

With beta = 1 and |khat| = 1 the new state satisfies khat^T X' = v^T exactly: the old content along
khat is erased and replaced by v.

Compressors turn X into the [B, T, d] input of the next sublayer:
    CC (channel):  h[b,t,i] = sum_v weight[i,v] * X[b,t,i,v]
    TC (temporal): h[b,t,i] = sum_v read[v] * sum_j conv_weight[i,v,j] * X[b, t-(K-1)+j, i, v]
                   (a causal depthwise conv over tokens, zero before t = 0; tap K-1 is the current token)
EC (expansion) builds the initial state from the token embedding:
    X0[b,t,i,v] = sum_j conv_weight[i,v,j] * emb[b, t-(K-1)+j, i]
With the identity init (tap K-1 = 1, the rest 0) X0 is emb repeated d_v times.

Every public function takes backend = "auto" | "torch" | "triton"; "auto" picks Triton for CUDA
tensors (and for CPU tensors when TRITON_INTERPRET=1 is set, which is how the tests run the kernels)
and the PyTorch reference otherwise. `set_auto_backend("torch")` makes "auto" mean the reference,
for benchmarking one against the other. Numerics: the normalisation, the contractions and the update
run in fp32 (float64 stays float64); results come back in x's dtype, so bf16 state is stored in bf16.
"""

import os

import torch

BACKENDS = ("auto", "torch", "triton")
_auto_backend = None  # None: Triton on CUDA, torch elsewhere; or a fixed "torch" / "triton"


def set_auto_backend(backend):
    """Fix what backend="auto" means: None (default rule), "torch" or "triton"."""
    global _auto_backend
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"set_auto_backend: backend must be None, 'torch' or 'triton', got {backend!r}")
    _auto_backend = backend


def _compute_dtype(*tensors):
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_float(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_update_args(x, k, v, beta):
    for name, t in (("x", x), ("k", k), ("v", v), ("beta", beta)):
        _check_float(name, t)
    if x.dim() < 2:
        raise ValueError(f"ddl_update: x must be [..., d, d_v], got shape {tuple(x.shape)}")
    lead, d, dv = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    if tuple(k.shape) != lead + (d,):
        raise ValueError(
            f"ddl_update: k must have shape {lead + (d,)} (x is {tuple(x.shape)}), got {tuple(k.shape)}"
        )
    if tuple(v.shape) != lead + (dv,):
        raise ValueError(
            f"ddl_update: v must have shape {lead + (dv,)} (x is {tuple(x.shape)}), got {tuple(v.shape)}"
        )
    if tuple(beta.shape) != lead:
        raise ValueError(
            f"ddl_update: beta must have shape {lead} (x is {tuple(x.shape)}), got {tuple(beta.shape)}"
        )


def _check_state(fn, x):
    _check_float("x", x)
    if x.dim() != 4:
        raise ValueError(f"{fn}: x must be [B, T, d, d_v], got shape {tuple(x.shape)}")


def _check_conv(fn, name, w, d, dv=None):
    _check_float(name, w)
    if w.dim() != 3 or w.shape[0] != d or (dv is not None and w.shape[1] != dv) or w.shape[2] < 1:
        want = f"[{d}, {dv if dv is not None else 'd_v'}, K >= 1]"
        raise ValueError(f"{fn}: {name} must be {want}, got shape {tuple(w.shape)}")


# ----------------------------------------------------------------------------------------------------
# PyTorch references: the definitions. Short, vectorised, any dtype, differentiable by autograd.


def ddl_update_ref(x, k, v, beta, eps=1e-5, erase=True):
    """x + beta*khat*(v^T - khat^T x) (or x + beta*khat*v^T with erase=False); khat = k/sqrt(|k|^2+eps^2)."""
    _check_update_args(x, k, v, beta)
    ct = _compute_dtype(x, k, v, beta)
    xf, kf, vf, bf = x.to(ct), k.to(ct), v.to(ct), beta.to(ct)
    khat = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + eps * eps)
    target = vf
    if erase:
        target = vf - torch.einsum("...i,...iv->...v", khat, xf)  # v^T - khat^T x
    x_new = xf + bf[..., None, None] * khat[..., :, None] * target[..., None, :]
    return x_new.to(x.dtype)


def compress_cc_ref(x, weight):
    """h[b,t,i] = sum_v weight[i,v] * x[b,t,i,v]."""
    _check_state("compress_cc", x)
    _check_float("weight", weight)
    if tuple(weight.shape) != tuple(x.shape[-2:]):
        raise ValueError(
            f"compress_cc: weight must be {tuple(x.shape[-2:])} (= [d, d_v]), got {tuple(weight.shape)}"
        )
    ct = _compute_dtype(x, weight)
    return torch.einsum("btiv,iv->bti", x.to(ct), weight.to(ct)).to(x.dtype)


def _causal_shift(x, s):
    """x shifted s >= 0 steps later along dim 1 with zeros in front: out[:, t] = x[:, t - s]."""
    if s == 0:
        return x
    pad = torch.zeros_like(x[:, :s])
    return torch.cat([pad, x[:, : x.shape[1] - s]], dim=1) if s < x.shape[1] else torch.zeros_like(x)


def compress_tc_ref(x, conv_weight, read):
    """h[b,t,i] = sum_v read[v] * sum_j conv_weight[i,v,j] * x[b, t-(K-1)+j, i, v] (zeros before t=0)."""
    _check_state("compress_tc", x)
    d, dv = x.shape[-2:]
    _check_conv("compress_tc", "conv_weight", conv_weight, d, dv)
    _check_float("read", read)
    if tuple(read.shape) != (dv,):
        raise ValueError(f"compress_tc: read must be [{dv}] (= [d_v]), got {tuple(read.shape)}")
    ct = _compute_dtype(x, conv_weight, read)
    xf, wf = x.to(ct), conv_weight.to(ct)
    K = conv_weight.shape[-1]
    y = sum(wf[:, :, j] * _causal_shift(xf, K - 1 - j) for j in range(K))  # [B, T, d, d_v]
    return torch.einsum("btiv,v->bti", y, read.to(ct)).to(x.dtype)


def expand_ec_ref(emb, conv_weight):
    """X0[b,t,i,v] = sum_j conv_weight[i,v,j] * emb[b, t-(K-1)+j, i] (zeros before t=0)."""
    _check_float("emb", emb)
    if emb.dim() != 3:
        raise ValueError(f"expand_ec: emb must be [B, T, d], got shape {tuple(emb.shape)}")
    _check_conv("expand_ec", "conv_weight", conv_weight, emb.shape[-1])
    ct = _compute_dtype(emb, conv_weight)
    ef, wf = emb.to(ct), conv_weight.to(ct)
    K = conv_weight.shape[-1]
    out = sum(wf[:, :, j] * _causal_shift(ef, K - 1 - j)[..., None] for j in range(K))
    return out.to(emb.dtype)


def ec_identity_weight(d, dv, K, device=None, dtype=torch.float32):
    """The EC identity init: tap K-1 (the current token) = 1, others 0, so X0 = emb repeated d_v times."""
    w = torch.zeros(d, dv, K, device=device, dtype=dtype)
    w[:, :, K - 1] = 1.0
    return w


# ----------------------------------------------------------------------------------------------------
# Dispatch.


def _resolve(backend, *tensors):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if _auto_backend is not None:
            return _auto_backend
        on_cuda = all(t.is_cuda for t in tensors)
        interpret = os.environ.get("TRITON_INTERPRET") == "1" and not any(t.is_cuda for t in tensors)
        return "triton" if (on_cuda or interpret) and _triton_ok() else "torch"
    return backend


def _triton_ok():
    return False  # Triton kernels land in the next commit


def ddl_update(x, k, v, beta, eps=1e-5, erase=True, backend="auto"):
    """x + beta*khat*(v^T - khat^T x), or x + beta*khat*v^T (erase=False); x [..., d, d_v], k [..., d]."""
    _check_update_args(x, k, v, beta)
    if _resolve(backend, x, k, v, beta) == "torch":
        return ddl_update_ref(x, k, v, beta, eps=eps, erase=erase)
    raise NotImplementedError("ddl_update: backend='triton' is not available yet")


def compress_cc(x, weight, backend="auto"):
    """h[b,t,i] = sum_v weight[i,v] * x[b,t,i,v]; x [B, T, d, d_v], weight [d, d_v]."""
    if _resolve(backend, x, weight) == "torch":
        return compress_cc_ref(x, weight)
    raise NotImplementedError("compress_cc: backend='triton' is not available yet")


def compress_tc(x, conv_weight, read, backend="auto"):
    """Causal depthwise conv over tokens of each (i, v) channel, then a read-out over v."""
    if _resolve(backend, x, conv_weight, read) == "torch":
        return compress_tc_ref(x, conv_weight, read)
    raise NotImplementedError("compress_tc: backend='triton' is not available yet")


def expand_ec(emb, conv_weight, backend="auto"):
    """X0 [B, T, d, d_v] from emb [B, T, d] by a causal depthwise conv per (i, v)."""
    if _resolve(backend, emb, conv_weight) == "torch":
        return expand_ec_ref(emb, conv_weight)
    raise NotImplementedError("expand_ec: backend='triton' is not available yet")
