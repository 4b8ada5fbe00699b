"""Deltaformer attention: reference, chunked PyTorch path, cached decoding step, Triton path.

Math (q, k, v, w: [B, H, T, D]; beta: [B, H, T]; s = scale, default 1/sqrt(D)):

    stage 1 (delta rule over the past):  u_i = v_i - beta_i * sum_{j<i} kappa(w_i, k_j) u_j,  u_0 = v_0
    stage 2 (causal softmax attention):  o_i = sum_{j<=i} softmax_{j<=i}(s q_i.k_j) u_j

kappa is the first-stage kernel: "softmax" = softmax over j<i of s w_i.k_j, "relu" = relu(s w_i.k_j),
"linear" = s w_i.k_j. In matrix form stage 1 is a unit lower-triangular solve,
U = (I + diag(beta) A)^-1 V with A_ij = kappa(w_i, k_j) for j < i and 0 elsewhere.

Three implementations of the same function:
- `deltaformer_reference`: the per-token loop, the spec in code (any dtype; tests use float64).
- the PyTorch path (`backend="torch"`): chunked and vectorised: for each chunk of rows, subtract what the
  earlier chunks' u contribute (one matmul), then solve the small in-chunk triangular system. Autograd
  gives the backward.
- the Triton path (`backend="triton"`): see the second half of this file.
"""

import math

import torch
import torch.nn.functional as F

KERNELS = ("softmax", "relu", "linear")
BACKENDS = ("auto", "torch", "triton")


def _check_inputs(q, k, v, w, beta, kernel):
    if kernel not in KERNELS:
        raise ValueError(f"deltaformer: kernel must be one of {KERNELS}, got {kernel!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w)):
        if x.dim() != 4:
            raise ValueError(f"deltaformer: {name} must be [B, H, T, D], got shape {tuple(x.shape)}")
    if not (q.shape == k.shape == v.shape == w.shape):
        raise ValueError(
            "deltaformer: q, k, v, w must have the same shape [B, H, T, D], got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, w {tuple(w.shape)}"
        )
    if tuple(beta.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"deltaformer: beta must be [B, H, T] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}"
        )


def _kappa_rows(scores, valid, kernel):
    """kappa applied to a block of scores (already scaled); entries where `valid` is False are 0.

    For softmax the normalisation runs over the valid entries of each row; a row with none (token 0)
    gives zeros, not NaN.
    """
    if kernel == "softmax":
        scores = scores.masked_fill(~valid, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(scores - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        return p / torch.where(denom > 0, denom, torch.ones_like(denom))
    a = torch.relu(scores) if kernel == "relu" else scores
    return a.masked_fill(~valid, 0.0)


def deltaformer_reference(q, k, v, w, beta, kernel="softmax", scale=None):
    """Per-token loop over T: u_i from all earlier u_j, then causal softmax attention of q over (k, u)."""
    _check_inputs(q, k, v, w, beta, kernel)
    T, D = q.shape[-2], q.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    us = []
    for i in range(T):
        if i == 0:
            us.append(v[:, :, 0])
            continue
        scores = s * torch.einsum("bhd,bhjd->bhj", w[:, :, i], k[:, :, :i])
        if kernel == "softmax":
            a = torch.softmax(scores, dim=-1)
        elif kernel == "relu":
            a = torch.relu(scores)
        else:
            a = scores
        past = torch.stack(us, dim=2)  # [B, H, i, D]
        us.append(v[:, :, i] - beta[:, :, i, None] * torch.einsum("bhj,bhjd->bhd", a, past))
    u = torch.stack(us, dim=2)
    outs = []
    for i in range(T):
        p = torch.softmax(s * torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]), dim=-1)
        outs.append(torch.einsum("bhj,bhjd->bhd", p, u[:, :, : i + 1]))
    return torch.stack(outs, dim=2)


def deltaformer_u_torch(k, v, w, beta, kernel="softmax", scale=None, chunk=64):
    """Stage 1 in PyTorch, chunk by chunk: U = (I + diag(beta) A)^-1 V. Returns u [B, H, T, D]."""
    T, D = k.shape[-2], k.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    out_dtype = v.dtype
    # bf16/fp16 run in fp32 (solve_triangular has no half-precision kernels; the recurrence wants fp32).
    acc = torch.promote_types(v.dtype, torch.float32)
    k, v, w, beta = (x.to(acc) for x in (k, v, w, beta))
    pos = torch.arange(T, device=k.device)
    u_chunks = []
    for r0 in range(0, T, chunk):
        r1 = min(r0 + chunk, T)
        # Rows r0..r1 need kappa against every key before them: all lie in [0, r1).
        scores = s * (w[:, :, r0:r1] @ k[:, :, :r1].transpose(-1, -2))  # [B, H, C, r1]
        valid = pos[None, :r1] < pos[r0:r1, None]
        a = _kappa_rows(scores, valid, kernel)
        b = beta[:, :, r0:r1, None]
        rhs = v[:, :, r0:r1]
        if r0 > 0:
            rhs = rhs - b * (a[..., :r0] @ torch.cat(u_chunks, dim=2))
        eye = torch.eye(r1 - r0, dtype=a.dtype, device=a.device)
        lower = eye + b * a[..., r0:r1]  # unit lower triangular
        u_chunks.append(torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True))
    return torch.cat(u_chunks, dim=2).to(out_dtype)


def deltaformer_step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel="softmax", scale=None):
    """One decoding step with a cache of the S earlier keys and u's (S may be 0).

    q_t, k_t, v_t, w_t: [B, H, 1, D]; beta_t: [B, H, 1]; k_cache, u_cache: [B, H, S, D].
    Returns (o_t, u_t), both [B, H, 1, D]; the caller appends k_t and u_t to its caches.
    """
    _check_inputs(q_t, k_t, v_t, w_t, beta_t, kernel)
    if q_t.shape[2] != 1:
        raise ValueError(
            f"deltaformer_step: q_t etc. must hold one token [B, H, 1, D], got {tuple(q_t.shape)}"
        )
    if (
        k_cache.shape != u_cache.shape
        or k_cache.shape[:2] != q_t.shape[:2]
        or k_cache.shape[3] != q_t.shape[3]
    ):
        raise ValueError(
            f"deltaformer_step: k_cache and u_cache must be [B, H, S, D] matching q_t {tuple(q_t.shape)}, "
            f"got {tuple(k_cache.shape)} and {tuple(u_cache.shape)}"
        )
    D = q_t.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    if k_cache.shape[2] == 0:
        u_t = v_t
    else:
        acc = torch.promote_types(v_t.dtype, torch.float32)  # bf16/fp16 caches: accumulate in fp32
        scores = s * (w_t.to(acc) @ k_cache.to(acc).transpose(-1, -2))  # [B, H, 1, S]
        if kernel == "softmax":
            a = torch.softmax(scores, dim=-1)
        elif kernel == "relu":
            a = torch.relu(scores)
        else:
            a = scores
        u_t = (v_t.to(acc) - beta_t.to(acc)[..., None] * (a @ u_cache.to(acc))).to(v_t.dtype)
    keys = torch.cat([k_cache, k_t], dim=2)
    values = torch.cat([u_cache, u_t], dim=2)
    # The new token attends to everything in the cache and itself: no mask.
    o_t = F.scaled_dot_product_attention(q_t, keys, values, scale=s)
    return o_t, u_t


def deltaformer_attention(q, k, v, w, beta, kernel="softmax", scale=None, backend="auto"):
    """Deltaformer attention, differentiable in q, k, v, w, beta. Returns o [B, H, T, D]."""
    if backend not in BACKENDS:
        raise ValueError(f"deltaformer_attention: backend must be one of {BACKENDS}, got {backend!r}")
    _check_inputs(q, k, v, w, beta, kernel)
    D = q.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    if backend == "auto":
        backend = "triton" if (q.is_cuda and _TRITON_PATH_WRITTEN and _triton_available()) else "torch"
    if backend == "triton":
        u = deltaformer_u_triton(k, v, w, beta, kernel=kernel, scale=s)
    else:
        u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, scale=s)
    return F.scaled_dot_product_attention(q, k, u, is_causal=True, scale=s)


# ----------------------------------------------------------------------------------------------------
# Triton path

_TRITON_PATH_WRITTEN = False


def _triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def deltaformer_u_triton(k, v, w, beta, kernel="softmax", scale=None):
    raise NotImplementedError("deltaformer: the Triton path is not written yet; use backend='torch'")
