"""Deltaformer stage 1 in PyTorch, chunked and vectorised: for each chunk of rows, subtract what the earlier
chunks' u contribute (one matmul), then solve the small in-chunk unit lower-triangular system. Autograd
gives the backward. Any dtype; bf16 / fp16 inputs are computed in fp32. With doc_start, kappa's entries
outside a row's document are masked (no tile skipped: no host sync)."""

import torch

from ..common import acc_dtype, default_scale
from .naive import check_doc_start, stage1_keys


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


def deltaformer_u_torch(k, v, w, beta, kernel="softmax", scale=None, chunk=64, doc_start=None):
    """Stage 1 in PyTorch, chunk by chunk: U = (I + diag(beta) A)^-1 V. Returns u [B, H, T, D].
    scale: softmax kappa's (default 1/sqrt(D)); relu and linear ignore it (`stage1_keys`). doc_start
    [B, T] (int): A_ij over doc_start_i <= j < i only (naive.py)."""
    T, D = k.shape[-2], k.shape[-1]
    check_doc_start(doc_start, k.shape[0], T, k.device, "deltaformer_u_torch")
    s = default_scale(D, scale)
    out_dtype = v.dtype
    # bf16/fp16 run in fp32 (solve_triangular has no half-precision kernels; the recurrence wants fp32).
    acc = acc_dtype(v)
    k, w, s = stage1_keys(k, w, kernel, s, acc)
    v, beta = v.to(acc), beta.to(acc)
    pos = torch.arange(T, device=k.device)
    u_chunks = []
    for r0 in range(0, T, chunk):
        r1 = min(r0 + chunk, T)
        # Rows r0..r1 need kappa against every key before them: all lie in [0, r1).
        scores = s * (w[:, :, r0:r1] @ k[:, :, :r1].transpose(-1, -2))  # [B, H, C, r1]
        valid = pos[None, :r1] < pos[r0:r1, None]
        if doc_start is not None:  # [B, 1, C, r1]: the row's own document only
            valid = valid & (pos[None, None, None, :r1] >= doc_start[:, None, r0:r1, None])
        a = _kappa_rows(scores, valid, kernel)
        b = beta[:, :, r0:r1, None]
        rhs = v[:, :, r0:r1]
        if r0 > 0:
            rhs = rhs - b * (a[..., :r0] @ torch.cat(u_chunks, dim=2))
        eye = torch.eye(r1 - r0, dtype=a.dtype, device=a.device)
        lower = eye + b * a[..., r0:r1]  # unit lower triangular
        u_chunks.append(torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True))
    return torch.cat(u_chunks, dim=2).to(out_dtype)
