"""Deltaformer attention, the definition: the per-token reference and the cached decoding step.

Math (q, k, v, w: [B, H, T, D]; beta: [B, H, T]; s = scale, default 1/sqrt(D)):

    stage 1 (delta rule over the past):  u_i = v_i - beta_i * sum_{j<i} kappa(w_i, k_j) u_j,  u_0 = v_0
    stage 2 (causal softmax attention):  o_i = sum_{j<=i} softmax_{j<=i}(s q_i.k_j) u_j

kappa is the first-stage kernel: "softmax" = softmax over j<i of s w_i.k_j; "relu" = relu(w^_i.k^_j) and
"linear" = w^_i.k^_j with unit vectors w^ = w / |w|, k^ = k / |k| (|.| guarded below by NORM_EPS) and scale 1
(why: the package docstring). Stage 2 always takes q and k as given, with scale s.

Packed documents (doc_start [B, T], the first index of the document token i is in): stage 1's sums and
softmax normalisation run over doc_start_i <= j < i, stage 2's over doc_start_i <= j <= i, so no token sees
an earlier document; the first token of a document has u_i = v_i, as token 0 has.
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


def check_doc_start(doc_start, B, T, device, fn="deltaformer", first=0, values=None):
    """One-line ValueErrors for a doc_start that is not an int32 / int64 tensor [B, T] on device, or (values;
    default: when it is on the CPU and not under torch.compile, where checking costs no GPU sync) whose
    entries are not non-decreasing with first + t >= doc_start[b, t] >= 0 (first: the index of its token
    t = 0, the number of cached tokens before it when decoding)."""
    if doc_start is None:
        return
    if not isinstance(doc_start, torch.Tensor) or doc_start.dtype not in (torch.int32, torch.int64):
        what = doc_start.dtype if isinstance(doc_start, torch.Tensor) else type(doc_start).__name__
        raise ValueError(f"{fn}: doc_start must be an int32 or int64 tensor, got {what}")
    if tuple(doc_start.shape) != (B, T):
        raise ValueError(f"{fn}: doc_start must be [B, T] = {(B, T)}, got {tuple(doc_start.shape)}")
    if doc_start.device != torch.device(device):
        raise ValueError(f"{fn}: doc_start must be on {device}, got {doc_start.device}")
    if values is None:
        values = doc_start.device.type == "cpu" and not torch.compiler.is_compiling()
    if values and doc_start.numel():
        t = first + torch.arange(T, device=doc_start.device)
        if ((doc_start < 0) | (doc_start > t)).any():
            top = "t" if first == 0 else f"{first} + t"
            raise ValueError(f"{fn}: doc_start[b, t] must lie in [0, {top}] (a token's own document)")
        if (doc_start[:, 1:] < doc_start[:, :-1]).any():
            raise ValueError(f"{fn}: doc_start must be non-decreasing along T (documents back to back)")


def _kappa(scores, kernel):
    """kappa of scaled scores, each row over all its entries (the earlier tokens j < i)."""
    if kernel == "softmax":
        return torch.softmax(scores, dim=-1)
    return torch.relu(scores) if kernel == "relu" else scores


def deltaformer_reference(q, k, v, w, beta, kernel="softmax", scale=None, doc_start=None):
    """Per-token loop over T: u_i from all earlier u_j, then causal softmax attention of q over (k, u).
    scale: stage 2's and softmax kappa's (default 1/sqrt(D)). doc_start [B, T]: the loops run over each
    token's own document only (module docstring), its values always checked."""
    _check_inputs(q, k, v, w, beta, kernel)
    B, T, D = q.shape[0], q.shape[-2], q.shape[-1]
    check_doc_start(doc_start, B, T, q.device, "deltaformer_reference", values=True)
    s = default_scale(D, scale)
    k1, w1, s1 = stage1_keys(k, w, kernel, s)
    if doc_start is not None:
        return _reference_in_documents(q, k, v, w1, k1, beta, kernel, s, s1, doc_start.tolist())
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


def _reference_in_documents(q, k, v, w1, k1, beta, kernel, s, s1, doc_start):
    """The reference's loops over (row b, token i), stage 1 over j in [doc_start[b][i], i), stage 2 over
    j in [doc_start[b][i], i]: an empty stage-1 set sums to zero (u_i = v_i)."""
    rows = []
    for b, starts in enumerate(doc_start):
        us, outs = [], []
        for i, lo in enumerate(starts):
            scores = s1 * torch.einsum("hd,hjd->hj", w1[b, :, i], k1[b, :, lo:i])
            past = torch.stack(us[lo:i], dim=1) if i > lo else v.new_zeros(v.shape[1], 0, v.shape[3])
            us.append(
                v[b, :, i] - beta[b, :, i, None] * torch.einsum("hj,hjd->hd", _kappa(scores, kernel), past)
            )
        u = torch.stack(us, dim=1)  # [H, T, D]
        for i, lo in enumerate(starts):
            p = torch.softmax(s * torch.einsum("hd,hjd->hj", q[b, :, i], k[b, :, lo : i + 1]), dim=-1)
            outs.append(torch.einsum("hj,hjd->hd", p, u[:, lo : i + 1]))
        rows.append(torch.stack(outs, dim=1))
    return torch.stack(rows)


def deltaformer_step(
    q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel="softmax", scale=None, pos=None, doc_start=None
):
    """One decoding step with a cache of the S earlier keys and u's (S may be 0).

    q_t, k_t, v_t, w_t: [B, H, 1, D]; beta_t: [B, H, 1]; k_cache, u_cache: [B, H, S, D].
    Returns (o_t, u_t), both [B, H, 1, D]; the caller appends k_t and u_t to its caches (raw k_t: stage 1
    normalises the keys itself for relu and linear). scale: stage 2's and softmax kappa's (default 1/sqrt(D)).
    pos (a static cache): a long tensor [1], the number of earlier tokens; the caches are then buffers of
    S > pos slots, the first pos holding them. The step writes k_t and u_t at slot pos itself and masks the
    slots after it: the same o_t and u_t, with the same shapes at every position (what a CUDA graph replays).
    doc_start [B, 1]: the index (counted from the first cached token) of the new token's document's first
    token; the slots before it are masked too.
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
    if doc_start is not None:  # values unchecked with pos: a tensor, where reading it would sync
        check_doc_start(
            doc_start, q_t.shape[0], 1, q_t.device, "deltaformer_step", k_cache.shape[2],
            None if pos is None else False,
        )  # fmt: skip
    return _step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel, scale, pos, doc_start)[:2]


def _step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel, scale, pos, doc_start=None):
    """deltaformer_step's (o_t, u_t), then the keys and u's its attention read (pos None: the caches with
    k_t and u_t appended), in few ops: a sum of products for the scores, one bmm for a @ u."""
    (S, D), s = k_cache.shape[2:], default_scale(q_t.shape[-1], scale)
    slots = None if pos is None and doc_start is None else torch.arange(S, device=q_t.device)
    ds = None if doc_start is None else doc_start.view(-1, 1, 1, 1)  # [B, 1, 1, 1] against slots [S]
    if S == 0:
        u_t = v_t
    else:
        acc = acc_dtype(v_t)  # bf16/fp16 caches: accumulate in fp32
        k1, w1, s1 = stage1_keys(k_cache, w_t, kernel, s, acc)
        scores = (w1 * k1).sum(-1)  # [B, H, S]
        scores = scores * s1 if s1 != 1.0 else scores
        skip = None if pos is None else slots >= pos  # only the first pos slots are earlier tokens
        if ds is not None:  # and those in the new token's document
            skip = (slots < ds[..., 0]) if skip is None else skip | (slots < ds[..., 0])
        if skip is not None:  # (softmax: none of them, 0 too)
            a = _kappa(scores.masked_fill(skip, -torch.inf), kernel).masked_fill(skip, 0.0)
        else:
            a = _kappa(scores, kernel)
        # a @ u as one bmm: its sums do not change with masked slots appended
        past = torch.bmm(a.reshape(-1, 1, S), u_cache.to(acc).reshape(-1, S, D)).view(v_t.shape)
        u_t = (v_t.to(acc) - beta_t.to(acc)[..., None] * past).to(v_t.dtype)
    if pos is None:
        keys, values, mask = torch.cat([k_cache, k_t], dim=2), torch.cat([u_cache, u_t], dim=2), None
        if ds is not None:
            mask = torch.arange(S + 1, device=q_t.device) >= ds  # [B, 1, 1, S + 1]
    else:
        k_cache.index_copy_(2, pos, k_t)
        u_cache.index_copy_(2, pos, u_t)
        keys, values, mask = k_cache, u_cache, (slots <= pos)[None]  # [1, S]
        if ds is not None:
            mask = mask & (slots >= ds)  # [B, 1, 1, S]
    # The new token attends to everything before it (in its document) and itself.
    o_t = F.scaled_dot_product_attention(q_t, keys, values, attn_mask=mask, scale=s)
    return o_t, u_t, keys, values
