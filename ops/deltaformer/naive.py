"""Deltaformer attention, the definition: the per-token reference and the cached decoding step.

Math (q, k, v, w: [B, H, T, D]; beta: [B, H, T]; s = scale, default 1/sqrt(D)):

    stage 1 (delta rule over the past):  u_i = v_i - beta_i * sum_{j<i} kappa(w_i, k_j) u_j,  u_0 = v_0
    stage 2 (causal softmax attention):  o_i = sum_{j<=i} softmax_{j<=i}(s q_i.k_j) u_j

kappa is the first-stage kernel: "softmax" = softmax over j<i of s w_i.k_j; "relu" = relu(w^_i.k^_j) and
"linear" = w^_i.k^_j with unit vectors w^ = w / |w|, k^ = k / |k| (|.| guarded below by NORM_EPS) and scale 1
(why: the package docstring). Stage 2 always takes q and k as given, with scale s.
"""

import torch
import torch.nn.functional as F

from ..common import acc_dtype, default_scale

KERNELS = ("softmax", "relu", "linear")
NORM_EPS = 1e-6  # relu / linear stage 1: x^ = x / max(|x|, NORM_EPS)


def _inv_norm(x):
    """1 / max(|x|, NORM_EPS) over the last dim, [..., 1], in fp32 (or x's wider dtype)."""
    acc = acc_dtype(x)
    return 1.0 / x.to(acc).norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


def stage1_keys(k, w, kernel, scale, dtype=None):
    """(k, w, s) as stage 1 scores them, in dtype (default k's): softmax kappa takes k and w as given with
    s = scale; relu and linear take unit vectors k^, w^ with s = 1 (w^ is k^ itself when w is k)."""
    dtype = k.dtype if dtype is None else dtype
    if kernel == "softmax":
        return k.to(dtype), w.to(dtype), scale
    k_hat = _unit(k, dtype)
    return k_hat, (k_hat if w is k else _unit(w, dtype)), 1.0


def _unit(x, dtype):
    r = _inv_norm(x)
    return (x.to(r.dtype) * r).to(dtype)


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


def _kappa(scores, kernel):
    """kappa of scaled scores, each row over all its entries (the earlier tokens j < i)."""
    if kernel == "softmax":
        return torch.softmax(scores, dim=-1)
    return torch.relu(scores) if kernel == "relu" else scores


def deltaformer_reference(q, k, v, w, beta, kernel="softmax", scale=None):
    """Per-token loop over T: u_i from all earlier u_j, then causal softmax attention of q over (k, u).
    scale: stage 2's and softmax kappa's (default 1/sqrt(D))."""
    _check_inputs(q, k, v, w, beta, kernel)
    T, D = q.shape[-2], q.shape[-1]
    s = default_scale(D, scale)
    k1, w1, s1 = stage1_keys(k, w, kernel, s)
    us = []
    for i in range(T):
        if i == 0:
            us.append(v[:, :, 0])
            continue
        scores = s1 * torch.einsum("bhd,bhjd->bhj", w1[:, :, i], k1[:, :, :i])
        a = _kappa(scores, kernel)
        past = torch.stack(us, dim=2)  # [B, H, i, D]
        us.append(v[:, :, i] - beta[:, :, i, None] * torch.einsum("bhj,bhjd->bhd", a, past))
    u = torch.stack(us, dim=2)
    outs = []
    for i in range(T):
        p = torch.softmax(s * torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]), dim=-1)
        outs.append(torch.einsum("bhj,bhjd->bhd", p, u[:, :, : i + 1]))
    return torch.stack(outs, dim=2)


def deltaformer_step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel="softmax", scale=None, pos=None):
    """One decoding step with a cache of the S earlier keys and u's (S may be 0).

    q_t, k_t, v_t, w_t: [B, H, 1, D]; beta_t: [B, H, 1]; k_cache, u_cache: [B, H, S, D].
    Returns (o_t, u_t), both [B, H, 1, D]; the caller appends k_t and u_t to its caches (raw k_t: stage 1
    normalises the keys itself for relu and linear). scale: stage 2's and softmax kappa's (default 1/sqrt(D)).
    pos (a static cache): a long tensor [1], the number of earlier tokens; the caches are then buffers of
    S > pos slots, the first pos holding them. The step writes k_t and u_t at slot pos itself and masks the
    slots after it: the same o_t and u_t, with the same shapes at every position (what a CUDA graph replays).
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
    return _step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel, scale, pos)[:2]


def _step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel, scale, pos):
    """deltaformer_step's (o_t, u_t), then the keys and u's its attention read (pos None: the caches with
    k_t and u_t appended), in few ops: a sum of products for the scores, one bmm for a @ u."""
    s = default_scale(q_t.shape[-1], scale)
    if k_cache.shape[2] == 0:
        u_t = v_t
    else:
        acc = acc_dtype(v_t)  # bf16/fp16 caches: accumulate in fp32
        k1, w1, s1 = stage1_keys(k_cache, w_t, kernel, s, acc)
        scores = (w1 * k1).sum(-1)  # [B, H, S]
        scores = scores * s1 if s1 != 1.0 else scores
        if pos is not None:  # only the first pos slots are earlier tokens (softmax: none of them, 0 too)
            later = torch.arange(k_cache.shape[2], device=q_t.device) >= pos
            a = _kappa(scores.masked_fill(later, -torch.inf), kernel).masked_fill(later, 0.0)
        else:
            a = _kappa(scores, kernel)
        S, D = u_cache.shape[2:]  # a @ u as one bmm: its sums do not change with masked slots appended
        past = torch.bmm(a.reshape(-1, 1, S), u_cache.to(acc).reshape(-1, S, D)).view(v_t.shape)
        u_t = (v_t.to(acc) - beta_t.to(acc)[..., None] * past).to(v_t.dtype)
    if pos is None:
        keys, values, mask = torch.cat([k_cache, k_t], dim=2), torch.cat([u_cache, u_t], dim=2), None
    else:
        k_cache.index_copy_(2, pos, k_t)
        u_cache.index_copy_(2, pos, u_t)
        keys, values = k_cache, u_cache
        mask = (torch.arange(k_cache.shape[2], device=q_t.device) <= pos)[None]  # [1, S]: itself and before
    # The new token attends to everything before it and itself.
    o_t = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=mask, scale=s)
    return o_t, u_t, keys, values
