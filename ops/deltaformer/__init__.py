"""Deltaformer attention: reference, chunked PyTorch path, cached decoding step, Triton path.

Math (q, k, v, w: [B, H, T, D]; beta: [B, H, T]; s = scale, default 1/sqrt(D)):

    stage 1 (delta rule over the past):  u_i = v_i - beta_i * sum_{j<i} kappa(w_i, k_j) u_j,  u_0 = v_0
    stage 2 (causal softmax attention):  o_i = sum_{j<=i} softmax_{j<=i}(s q_i.k_j) u_j

kappa is the first-stage kernel: "softmax" = softmax over j<i of s w_i.k_j; "relu" = relu(w^_i.k^_j) and
"linear" = w^_i.k^_j with unit vectors w^ = w / |w|, k^ = k / |k| (|.| guarded below by NORM_EPS) and scale 1.
In matrix form stage 1 is a unit lower-triangular solve, U = (I + diag(beta) A)^-1 V with
A_ij = kappa(w_i, k_j) for j < i and 0 elsewhere. Stage 2 always takes q and k as given, with scale s.

Bounds (the model's beta_max, README): softmax kappa's rows are >= 0 and sum to 1, so for beta <= 1,
max_{j<=i} |u_j|_inf <= |v_i|_inf + max_{j<i} |u_j|_inf: |u| <= T max|v|, for any keys. For beta in (1, 2]
keys that make kappa weigh the previous token give u_i ~ v_i - beta u_{i-1}, which grows like beta^T.

Why relu and linear are normalised: with S_i = sum_{j<=i} u_j k^_j^T, u_i = v_i - beta_i S_{i-1} w^_i and
S_i = S_{i-1} (I - beta_i w^_i k^_i^T) + v_i k^_i^T. For linear kappa and w = k this is DeltaNet; its
transition I - beta k^ k^^T has eigenvalues 1 and 1 - beta: norm <= 1 for beta in [0, 2], so
|S_i| <= |S_{i-1}| + |v_i| (no exponential growth). Unnormalised, the model's RMS-normed keys have
s k.k = sqrt(D): the eigenvalue along k is 1 - beta sqrt(D) (-7 at D = 64, beta = 1) and u overflows by
T = 512. With w != k nothing bounds u: the eigenvalue 1 - beta w^.k^ reaches 1 + beta where w and k point
apart (linear; relu's kappa >= 0 avoids that one). Unrelated w and k grow |u| about (1 + beta^2 / D)^(T / 2);
a 2-layer model at init with linear kappa and w a projection overflowed fp32 at T = 1024 on some inputs.

Packed documents: every public function takes doc_start (None, or an int tensor [B, T]: doc_start[b, t] the
index of the first token of token t's document, non-decreasing along t, <= t). Stage 1's kappa then ranges
over doc_start_i <= j < i (softmax kappa normalised over that set; an empty one gives u_i = v_i), stage 2's
softmax over doc_start_i <= j <= i: each document as if alone. None runs the unmasked code unchanged.

The public functions (`deltaformer_reference`, `deltaformer_u_torch`, `deltaformer_u_triton`,
`deltaformer_step`, `deltaformer_attention`) take the raw k and w; their `scale` is softmax kappa's score
scale (and stage 2's, where they have one), which relu and linear ignore in stage 1. `stage1_keys` forms
the unit vectors for the reference, the PyTorch path and the decoding step (PyTorch; autograd gives the
norms' backward); the Triton kernels take the raw k and w with their norms and scale each fp32 score by the
two inverse norms, the norms' gradient added in the dK / dW passes.

Three implementations of the same function:
- naive.py: `deltaformer_reference`, the per-token loop, the spec in code (any dtype; tests use float64),
  and `deltaformer_step`, one decoding step over a cache.
- chunk.py: `deltaformer_u_torch`, the PyTorch path (`backend="torch"`): chunked and vectorised, autograd
  gives the backward.
- triton.py: `deltaformer_u_triton`, the Triton path (`backend="triton"`); its kernels in triton_fwd.py and
  triton_bwd.py.

The Triton path in short: stage 1 in chunks of C = 64 rows, a wavefront over (chunk, batch*head) tiles for
the recurrence, a parallel prep kernel for the in-chunk inverses and softmax log-sum-exps, the reversed
wavefront plus dK / dW passes for the backward; stage 2 is SDPA. With half-precision inputs everything
accumulates in fp32; the recurrence's inter-chunk products take hi + lo half operands (~16 bits) and
the in-chunk inverse 3-pass tf32, because where updates are near reflections (beta kappa
~ 2, the regime state tracking needs) every rounding there is carried into all later u; the other O(T^2)
products take half operands (lowp, as FlashAttention), which costs dK and dW ~2e-2 in that regime
(tests/test_deltaformer.py; lowp=False removes it for +30% GPU time at 8,12,1024,64). Forward+backward
GPU time is 3.2-4.4x causal SDPA's on an H200 at B,H,T,D = 8,12,1024,64 .. 2,12,4096,64
(bench/RESULTS.md). Counted in [64, 64] @ [64, 64] products over the causal triangle's block pairs, stage 1
does ~14 (S re-formed per pass, the split's three products) and SDPA 7, so (14 + 7) / 7 = 3x SDPA even at
SDPA's efficiency; the wavefronts run at the SMs' throughput, so scheduling does not shorten that.
"""

import torch

from ..common import BACKENDS, default_scale, resolve_backend
from .chunk import deltaformer_u_torch
from .naive import (
    KERNELS,
    NORM_EPS,
    _check_inputs,
    _step,
    check_doc_start,
    deltaformer_reference,
    deltaformer_step,
    stage1_keys,
)
from .stage2 import attend

try:  # the Triton path: absent where Triton is not installed (CPU-only machines import the rest)
    from .triton import deltaformer_u_triton
except ImportError:

    def deltaformer_u_triton(*args, **kwargs):
        raise RuntimeError("deltaformer_u_triton needs the triton package; use deltaformer_u_torch")


__all__ = [
    "BACKENDS",
    "KERNELS",
    "NORM_EPS",
    "check_doc_start",
    "deltaformer_attention",
    "deltaformer_decode",
    "deltaformer_reference",
    "deltaformer_step",
    "deltaformer_u_torch",
    "deltaformer_u_triton",
    "stage1_keys",
]


def deltaformer_attention(q, k, v, w, beta, kernel="softmax", scale=None, backend="auto", doc_start=None):
    """Deltaformer attention, differentiable in q, k, v, w, beta. Returns o [B, H, T, D].
    scale: stage 2's and softmax kappa's (default 1/sqrt(D)). doc_start [B, T]: within documents only
    (module docstring); its values are checked where that costs no GPU sync (`check_doc_start`)."""
    backend = resolve_backend("deltaformer_attention", backend, q, k, v, w, beta)
    _check_inputs(q, k, v, w, beta, kernel)
    s = default_scale(q.shape[-1], scale)
    stage1 = deltaformer_u_triton if backend == "triton" else deltaformer_u_torch
    u = stage1(k, v, w, beta, kernel=kernel, scale=s, doc_start=doc_start)
    return attend(q, k, u, s, doc_start)


def deltaformer_decode(q, k, v, w, beta, past=None, kernel="softmax", doc_start=None):
    """Deltaformer attention of T new tokens after the cached `past` = (keys, u's) of the earlier ones
    (None: no earlier tokens): returns (o [B, H, T, D], the past including the new tokens). Without a
    past (a prompt) stage 1 runs at once, then causal attention; after one, tokens go one at a time
    through deltaformer_step. doc_start [B, T]: the new tokens' document starts, as indices counted from
    the first cached token (the whole sequence's frame)."""
    if past is None:
        u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, doc_start=doc_start)
        return attend(q, k, u, None, doc_start), (k, u)
    _check_inputs(q, k, v, w, beta, kernel)
    k_cache, u_cache = past
    check_doc_start(doc_start, q.shape[0], q.shape[2], q.device, "deltaformer_decode", k_cache.shape[2])
    T, outs = q.shape[2], []
    for t in range(T):
        if T == 1:  # the tensors themselves (no slices: fewer ops a decoded token)
            token, ds = (q, k, v, w, beta), doc_start
        else:
            token = (x[:, :, t : t + 1] for x in (q, k, v, w, beta))
            ds = None if doc_start is None else doc_start[:, t : t + 1]
        o_t, _, k_cache, u_cache = _step(*token, k_cache, u_cache, kernel, None, None, ds)
        outs.append(o_t)
    return (torch.cat(outs, dim=2) if T > 1 else outs[0]), (k_cache, u_cache)
