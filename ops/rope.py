"""RoPE and RMSNorm as functions of few ops: every decoded token dispatches them in every layer (model.py's
RMSNorm and attention call them; tests/test_decode_ops.py counts the ops)."""

import torch
import torch.nn.functional as F

from .common import acc_dtype


def rms_norm(xf, weight, eps):
    """xf * rsqrt(mean(xf^2) + eps) * weight (None: no weight) over the last dim of xf in its compute dtype
    (fp32, float64). On CUDA where nothing is differentiated (decoding), F.rms_norm: one fused op for these
    six; elsewhere the six, as training has always run them (its autograd, its compiled kernels)."""
    if xf.is_cuda and not torch.is_grad_enabled():
        return F.rms_norm(xf, xf.shape[-1:], weight, eps)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rope_tables(length, D, base):
    """cos, sin [length, D] of the angles t / base^(2i/D), t < length, i < D/2, in float64: each angle at
    columns i and i + D/2 (the pair it rotates), sin's first half negated (apply_rope)."""
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [..., T, D] by the angles of rope_tables' cos, sin
    [..., T, D]: x cos + (x, halves swapped) sin = (x1 cos - x2 sin, x2 cos + x1 sin), rounded as written."""
    dt = acc_dtype(x)
    xf = x.to(dt)
    return (xf * cos.to(dt) + xf.roll(x.shape[-1] // 2, -1) * sin.to(dt)).to(x.dtype)


def rope_norm(x, cos, sin, norms):
    """[norms[i](RoPE(x[i])) for each i] of x [n, ..., T, D] (q, k, and an attention's own w): RoPE and the
    norm in one pass over all n, then each its weight."""
    r = apply_rope(x, cos, sin)
    dt = acc_dtype(r)
    return [(y * n.weight.to(dt)).to(x.dtype) for y, n in zip(rms_norm(r.to(dt), None, norms[0].eps), norms)]
