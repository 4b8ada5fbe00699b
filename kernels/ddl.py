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

Fused entry points (one pass over the state where the separate ops take two or three):
    ddl_update_compress_cc(x, k, v, beta, weight)          -> (x_new, compress_cc(x_new, weight))
    ddl_update_compress_tc(x, k, v, beta, conv_weight, read) -> (x_new, compress_tc(x_new, conv_weight, read))
i.e. one sublayer's update together with the next sublayer's read-out.

Every public function takes backend = "auto" | "torch" | "triton"; "auto" picks Triton for CUDA
tensors and the PyTorch reference otherwise (tests run the kernels on CPU with backend="triton" and
TRITON_INTERPRET=1). `set_auto_backend("torch")` makes "auto" mean the reference,
for benchmarking one against the other. Numerics: the normalisation, the contractions and the update
run in fp32 (float64 stays float64); results come back in x's dtype, so bf16 state is stored in bf16.

The Triton kernels in short: the work is memory-bound (~1 FLOP per byte of state), so they minimise passes
over the [B, T, d, d_v] state. One program owns whole tokens ([d, d_v] tiles; d_v = 1: [tokens, d] rows):
the forward reads x and writes x' once, the backward reads x and dL/dx' and writes dx once, and the fused
entry points form the next sublayer's read-out from x' in registers: 5 passes per sublayer where update
then compressor take 11. All are torch.library custom ops with fake implementations, so torch.compile
keeps them in its graph. Measured on an H200 by bench/bench_ddl.py (N = 32768 tokens, d 768, d_v 4, fp32
state): the update's forward at the copy bandwidth (219 us, ~4.1 TB/s), the fused update + CC
forward+backward ~1.5x its bytes floor. End to end (bench/RESULTS.md): gpt2-small ddl 0.91x and ddl-cc
0.74x the additive model's tokens/s, ddl-cc at 1.47x its memory (autograd keeps every sublayer's state).
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
# Triton kernels. The state is memory-bound work: each kernel reads and writes every [d, d_v] tile once
# and keeps all arithmetic in registers (fp32, or float64 for float64 inputs so tests can be exact).
# The update needs whole-token reductions over d (|k|, khat^T x), so one program owns whole tokens;
# compressors and EC are per-channel, so their programs take a block of d and a run of tokens.
# Weight gradients are reduced over tokens inside a program into fp32 partials, summed by torch.

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a requirement on Linux
    triton = None

# Launch shapes (tokens per program, warps, channel block for the per-channel kernels); tuned on an H200
# by `python bench/bench_ddl.py` / `--sweeps`; tests shrink TOKENS to exercise partial sums and tails.
# An entry may hold a whole launch shape for one state dtype under that dtype's name ("bfloat16"), used
# instead of the entry's own for that dtype (read through _cfg). Measured on an H200 (N 32768, d 768,
# forward + backward): fused update + CC d_v 4, bf16 state 797 us at TOKENS 16 +
# pipelined loop vs 1087 us at the fp32 best (TOKENS 32, plain loop: 812 us in fp32); d_v = 1 rows, bf16
# 679 us at ROWS 4 / 8 warps vs 963 us at 4 warps, fp32 752 us at ROWS 2 / 4 warps vs 1076 us at ROWS 4.
_CFG = {
    "update_fwd": dict(TOKENS=1, num_warps=4),
    "update_bwd": dict(  # LOOP: see _update_bwd_kernel
        TOKENS=32, LOOP=0, num_warps=4, bfloat16=dict(TOKENS=16, LOOP=2, num_warps=4)
    ),
    "update_row": dict(  # d_v = 1 without a fused read-out; ROWS=0: the general kernel
        ROWS=2, num_warps=4, bfloat16=dict(ROWS=4, num_warps=8)
    ),
    "chan_fwd": dict(TOKENS=4, BLOCK_D=256, num_warps=4),
    "chan_bwd": dict(TOKENS=64, BLOCK_D=256, num_warps=4),
}
_POISON = False  # tests set True: outputs start as NaN so an unwritten element cannot pass


def _cfg(key, dtype):
    """The launch shape _CFG[key] holds for a state of this dtype (its per-dtype entry, else its own)."""
    cfg = _CFG[key]
    return cfg.get(str(dtype).removeprefix("torch."), cfg)


def _new(shape, like, dtype=None):
    dtype = like.dtype if dtype is None else dtype
    if _POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _ct(*tensors):
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


if triton is not None:

    @triton.jit
    def _update_token_inputs(
        n, X, Kd, V, BETA, N, D, eps, offs_d, offs_v, md, mv, off2,
        DV: tl.constexpr, ERASE: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        """What the update of token n reads, forward and backward: its masks, rs = 1 / sqrt(|k|^2 + eps^2)
        and khat = k rs, the state x, beta, and r = v - khat^T x (r = v without the erase)."""
        ok = n < N
        okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
        m2 = (md & okd)[:, None] & mv[None, :]
        k = tl.load(Kd + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
        rs = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps * eps)
        kh = k * rs
        x = tl.load(X + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        v = tl.load(V + n * DV + offs_v, mask=mv & (offs_v * 0 + n < N), other=0.0).to(CT)
        b = tl.load(BETA + n, mask=ok, other=0.0).to(CT)
        if ERASE:
            r = v - tl.sum(kh[:, None] * x, axis=0)  # v^T - khat^T x
        else:
            r = v
        return ok, okd, m2, rs, kh, x, b, r

    @triton.jit
    def _update_grads(g, x, kh, rs, b, r, ERASE: tl.constexpr):
        """The update's backward for one token, given G = dL/dx' (formulas in `_update_bwd_token`):
        dx, dk, dv, dbeta."""
        gk = tl.sum(kh[:, None] * g, axis=0)  # khat^T G  [d_v]
        gr = tl.sum(g * r[None, :], axis=1)  # G r  [d]
        if ERASE:
            dx = g - b * kh[:, None] * gk[None, :]
            dkh = b * (gr - tl.sum(x * gk[None, :], axis=1))
        else:
            dx = g
            dkh = b * gr
        dk = rs * (dkh - kh * tl.sum(kh * dkh, axis=0))
        return dx, dk, b * gk, tl.sum(gk * r, axis=0)

    @triton.jit
    def _update_fwd_kernel(
        X, Kd, V, BETA, W, XOUT, H, N, D, eps,
        DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
        ERASE: tl.constexpr, COMPRESS: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        md = offs_d < D
        mv = offs_v < DV
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        if COMPRESS:
            w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
        for tt in tl.static_range(TOKENS):
            n = pid * TOKENS + tt
            _, okd, m2, _, kh, x, b, r = _update_token_inputs(
                n, X, Kd, V, BETA, N, D, eps, offs_d, offs_v, md, mv, off2, DV, ERASE, CT
            )
            xn = (x + b * kh[:, None] * r[None, :]).to(XOUT.dtype.element_ty)
            tl.store(XOUT + n * D * DV + off2, xn, mask=m2)
            if COMPRESS:  # the next sublayer's CC read-out of the state just written (as stored)
                h = tl.sum(xn.to(CT) * w, axis=1)
                tl.store(H + n * D + offs_d, h.to(H.dtype.element_ty), mask=md & okd)

    @triton.jit
    def _update_bwd_token(
        n, X, Kd, V, BETA, w, G, DH, DX, DK, DVo, DBETA, N, D, eps, offs_d, offs_v, md, mv, off2,
        DV: tl.constexpr, ERASE: tl.constexpr, COMPRESS: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # One token of the backward; returns its contribution dh xn^T to the CC weight gradient.
        # x' = x + b khat r^T, r = v - x^T khat.  With G = dL/dx' (+ dh w^T from the fused read-out):
        # dx = G - b khat (khat^T G);  dv = b G^T khat;  dbeta = r . (G^T khat);
        # dkhat = b (G r - x G^T khat);  dk = (dkhat - khat (khat . dkhat)) / sqrt(|k|^2 + eps^2).
        ok, okd, m2, rs, kh, x, b, r = _update_token_inputs(
            n, X, Kd, V, BETA, N, D, eps, offs_d, offs_v, md, mv, off2, DV, ERASE, CT
        )
        g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        dw = w * 0.0
        if COMPRESS:
            dh = tl.load(DH + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
            xn = (x + b * kh[:, None] * r[None, :]).to(X.dtype.element_ty).to(CT)
            dw = dh[:, None] * xn
            g = g + dh[:, None] * w
        dx, dk, dv, dbeta = _update_grads(g, x, kh, rs, b, r, ERASE)
        tl.store(DX + n * D * DV + off2, dx.to(DX.dtype.element_ty), mask=m2)
        tl.store(DK + n * D + offs_d, dk.to(DK.dtype.element_ty), mask=md & okd)
        tl.store(DVo + n * DV + offs_v, dv.to(DVo.dtype.element_ty), mask=mv & (offs_v * 0 + n < N))
        tl.store(DBETA + n, dbeta.to(DBETA.dtype.element_ty), mask=ok)
        return dw

    @triton.jit
    def _update_bwd_kernel(
        X, Kd, V, BETA, W, G, DH, DX, DK, DVo, DBETA, DWP, N, D, eps,
        TOKENS: tl.constexpr, LOOP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_V: tl.constexpr, ERASE: tl.constexpr, COMPRESS: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # TOKENS tokens per program (the CC weight gradient is summed over them in registers). LOOP picks
        # how the loop over them is emitted: 0 a plain loop (one token's loads in flight at a time),
        # 1 unrolled (every token's loads independent, more registers), 2 software-pipelined (num_stages 2).
        pid = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        md = offs_d < D
        mv = offs_v < DV
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        if COMPRESS:
            w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
        else:
            w = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
        dw = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
        if LOOP == 1:
            for tt in tl.static_range(TOKENS):
                dw += _update_bwd_token(
                    pid * TOKENS + tt, X, Kd, V, BETA, w, G, DH, DX, DK, DVo, DBETA, N, D, eps,
                    offs_d, offs_v, md, mv, off2, DV, ERASE, COMPRESS, CT,
                )  # fmt: skip
        elif LOOP == 2:
            for tt in tl.range(0, TOKENS, num_stages=2):
                dw += _update_bwd_token(
                    pid * TOKENS + tt, X, Kd, V, BETA, w, G, DH, DX, DK, DVo, DBETA, N, D, eps,
                    offs_d, offs_v, md, mv, off2, DV, ERASE, COMPRESS, CT,
                )  # fmt: skip
        else:
            for tt in range(TOKENS):
                dw += _update_bwd_token(
                    pid * TOKENS + tt, X, Kd, V, BETA, w, G, DH, DX, DK, DVo, DBETA, N, D, eps,
                    offs_d, offs_v, md, mv, off2, DV, ERASE, COMPRESS, CT,
                )  # fmt: skip
        if COMPRESS:
            tl.store(DWP + pid * D * DV + off2, dw, mask=md[:, None] & mv[None, :])

    @triton.jit
    def _chan_tile(D, KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_V: tl.constexpr):  # fmt: skip
        # the per-channel kernels' tile: a run of tokens (program 0) x a block of d (program 1) x d_v,
        # and the KW taps of the token convolution (padded to KP)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        offs_j = tl.arange(0, KP)
        md = offs_d < D
        mv = offs_v < DV
        m2 = md[:, None] & mv[None, :]
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        return tl.program_id(0).to(tl.int64), offs_d, offs_v, offs_j, md, mv, offs_j < KW, m2, off2

    @triton.jit
    def _taps(WT, offs_j, off2, mj, m2, D, DV: tl.constexpr, CT: tl.constexpr):
        # the KW conv taps of the tile, [KP, BLOCK_D, BLOCK_V], with their offsets and mask
        off3 = offs_j[:, None, None] * D * DV + off2[None]
        m3 = mj[:, None, None] & m2[None]
        return off3, m3, tl.load(WT + off3, mask=m3, other=0.0).to(CT)

    @triton.jit
    def _window(n, T, N, offs_j, mj, KW: tl.constexpr, PAST: tl.constexpr):
        # the tokens tap j connects to token n within its sequence of T (rows of N): PAST, the inputs of
        # the causal conv, n - (KW-1) + j; else the outputs that read token n, n + (KW-1) - j
        t = n % T
        if PAST:
            return n - (KW - 1) + offs_j, mj & (t - (KW - 1) + offs_j >= 0) & (offs_j * 0 + n < N)
        else:
            return n + (KW - 1) - offs_j, mj & (t + (KW - 1) - offs_j < T) & (offs_j * 0 + n < N)

    @triton.jit
    def _row_tile(X, Kd, V, BETA, N, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CT: tl.constexpr):
        # d_v = 1 row kernels: ROWS tokens as a [ROWS, d] tile; the normalised k and the loaded x, v, beta
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        mr = rows < N
        m2 = mr[:, None] & (cols < D)[None, :]
        off = rows[:, None] * D + cols[None, :]
        k = tl.load(Kd + off, mask=m2, other=0.0).to(CT)
        rs = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + eps * eps)
        x = tl.load(X + off, mask=m2, other=0.0).to(CT)
        v = tl.load(V + rows, mask=mr, other=0.0).to(CT)
        b = tl.load(BETA + rows, mask=mr, other=0.0).to(CT)
        return rows, mr, m2, off, rs, k * rs[:, None], x, v, b

    @triton.jit
    def _update_row_fwd_kernel(
        X, Kd, V, BETA, XOUT, N, D, eps,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ERASE: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # d_v = 1: the state is a d-vector per token, so a program takes ROWS tokens as a [ROWS, d] tile
        # (like a layer norm) instead of one [d, 1] tile per token.
        rows, mr, m2, off, rs, kh, x, v, b = _row_tile(X, Kd, V, BETA, N, D, eps, ROWS, BLOCK_D, CT)
        if ERASE:
            r = v - tl.sum(kh * x, axis=1)
        else:
            r = v
        tl.store(XOUT + off, (x + (b * r)[:, None] * kh).to(XOUT.dtype.element_ty), mask=m2)

    @triton.jit
    def _update_row_bwd_kernel(
        X, Kd, V, BETA, G, DX, DK, DVo, DBETA, N, D, eps,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ERASE: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # _update_bwd_token with d_v = 1 (r, gk scalars per token), ROWS tokens per program.
        rows, mr, m2, off, rs, kh, x, v, b = _row_tile(X, Kd, V, BETA, N, D, eps, ROWS, BLOCK_D, CT)
        g = tl.load(G + off, mask=m2, other=0.0).to(CT)
        gk = tl.sum(kh * g, axis=1)
        if ERASE:
            r = v - tl.sum(kh * x, axis=1)
            dx = g - (b * gk)[:, None] * kh
            dkh = b[:, None] * (g * r[:, None] - x * gk[:, None])
        else:
            r = v
            dx = g
            dkh = (b * r)[:, None] * g
        dk = rs[:, None] * (dkh - kh * tl.sum(kh * dkh, axis=1)[:, None])
        tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=m2)
        tl.store(DK + off, dk.to(DK.dtype.element_ty), mask=m2)
        tl.store(DVo + rows, (b * gk).to(DVo.dtype.element_ty), mask=mr)
        tl.store(DBETA + rows, (gk * r).to(DBETA.dtype.element_ty), mask=mr)

    @triton.jit
    def _cc_fwd_kernel(
        X, W, H, N, D,
        DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
        CT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        md = offs_d < D
        mv = offs_v < DV
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
        for tt in tl.static_range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
            x = tl.load(X + n * D * DV + off2, mask=(md & okd)[:, None] & mv[None, :], other=0.0).to(CT)
            tl.store(H + n * D + offs_d, tl.sum(x * w, axis=1).to(H.dtype.element_ty), mask=md & okd)

    @triton.jit
    def _cc_bwd_kernel(
        X, W, DH, DX, DWP, N, D, TOKENS,
        DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        md = offs_d < D
        mv = offs_v < DV
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
        dw = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
        for tt in range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
            m2 = (md & okd)[:, None] & mv[None, :]
            dh = tl.load(DH + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
            x = tl.load(X + n * D * DV + off2, mask=m2, other=0.0).to(CT)
            tl.store(DX + n * D * DV + off2, (dh[:, None] * w).to(DX.dtype.element_ty), mask=m2)
            dw += dh[:, None] * x
        tl.store(DWP + pid * D * DV + off2, dw, mask=md[:, None] & mv[None, :])

    @triton.jit
    def _tc_fwd_kernel(
        X, WT, H, N, T, D,
        KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        TOKENS: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # h[n] = sum_j sum_v WT[j] * x[n - (KW-1) + j] within the token's sequence (WT = conv * read)
        pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
        _, _, w3 = _taps(WT, offs_j, off2, mj, m2, D, DV, CT)
        for tt in tl.static_range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
            src, valid = _window(n, T, N, offs_j, mj, KW, True)
            x3 = tl.load(
                X + src[:, None, None] * D * DV + off2[None], mask=valid[:, None, None] & m2[None], other=0.0
            )
            h = tl.sum(tl.sum(w3 * x3.to(CT), axis=0), axis=1)
            tl.store(H + n * D + offs_d, h.to(H.dtype.element_ty), mask=md & okd)

    @triton.jit
    def _tc_bwd_kernel(
        X, WT, DH, DX, DWP, N, T, D, TOKENS,
        KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        CT: tl.constexpr,
    ):  # fmt: skip
        # dx[n] = sum_j WT[j] dh[n + KW-1 - j];  dWT[j] = sum_n dh[n + KW-1 - j] x[n]  (same sequence only)
        pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
        off3, m3, w3 = _taps(WT, offs_j, off2, mj, m2, D, DV, CT)
        acc = tl.zeros([KP, BLOCK_D, BLOCK_V], dtype=CT)
        for tt in range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
            dst, valid = _window(n, T, N, offs_j, mj, KW, False)
            dh2 = tl.load(
                DH + dst[:, None] * D + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0
            )
            dh2 = dh2.to(CT)
            x = tl.load(X + n * D * DV + off2, mask=m2 & okd[:, None], other=0.0).to(CT)
            dx = tl.sum(w3 * dh2[:, :, None], axis=0)
            tl.store(DX + n * D * DV + off2, dx.to(DX.dtype.element_ty), mask=m2 & okd[:, None])
            acc += dh2[:, :, None] * x[None, :, :]
        tl.store(DWP + pid * KW * D * DV + off3, acc, mask=m3)

    @triton.jit
    def _ec_fwd_kernel(
        E, WT, X0, N, T, D,
        KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        TOKENS: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # X0[n] = sum_j WT[j] * emb[n - (KW-1) + j][:, None]
        pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
        _, _, w3 = _taps(WT, offs_j, off2, mj, m2, D, DV, CT)
        for tt in tl.static_range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
            src, valid = _window(n, T, N, offs_j, mj, KW, True)
            e2 = tl.load(E + src[:, None] * D + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
            out = tl.sum(w3 * e2.to(CT)[:, :, None], axis=0)
            tl.store(X0 + n * D * DV + off2, out.to(X0.dtype.element_ty), mask=m2 & okd[:, None])

    @triton.jit
    def _ec_bwd_kernel(
        E, WT, G, DE, DWP, N, T, D, TOKENS,
        KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        CT: tl.constexpr,
    ):  # fmt: skip
        # demb[n] = sum_j sum_v WT[j] G[n + KW-1 - j];  dWT[j] = sum_n emb[n - (KW-1) + j][:, None] G[n]
        pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
        off3, m3, w3 = _taps(WT, offs_j, off2, mj, m2, D, DV, CT)
        acc = tl.zeros([KP, BLOCK_D, BLOCK_V], dtype=CT)
        for tt in range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
            dst, vf = _window(n, T, N, offs_j, mj, KW, False)
            g3 = tl.load(
                G + dst[:, None, None] * D * DV + off2[None], mask=vf[:, None, None] & m2[None], other=0.0
            )
            de = tl.sum(tl.sum(w3 * g3.to(CT), axis=0), axis=1)
            tl.store(DE + n * D + offs_d, de.to(DE.dtype.element_ty), mask=md & okd)
            src, vp = _window(n, T, N, offs_j, mj, KW, True)
            e2 = tl.load(E + src[:, None] * D + offs_d[None, :], mask=vp[:, None] & md[None, :], other=0.0)
            g = tl.load(G + n * D * DV + off2, mask=m2 & okd[:, None], other=0.0).to(CT)
            acc += e2.to(CT)[:, :, None] * g[None, :, :]
        tl.store(DWP + pid * KW * D * DV + off3, acc, mask=m3)

    @triton.jit
    def _update_tc_fwd_kernel(
        X, Kd, V, BETA, WT, XOUT, H, RS, R, N, T, D, eps,
        KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        ERASE: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # x'[n] = update(x[n]) and the next sublayer's TC read-out h[n] = sum_j WT[j] . x'[n - (KW-1) + j]:
        # the K-1 earlier states are recomputed from their x, k, v, beta (reads that hit L2), so x' is
        # written once and never read back. RS = 1/sqrt(|k|^2 + eps^2) and R = v - khat^T x (erase) are
        # kept for the weight gradient, which needs x' again.
        n = tl.program_id(0).to(tl.int64)
        t = n % T
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        md = offs_d < D
        mv = offs_v < DV
        m2 = md[:, None] & mv[None, :]
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        acc = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
        for j in tl.static_range(KW):
            s = n - (KW - 1) + j
            okd = md & (offs_d * 0 + t - (KW - 1) + j >= 0)  # vector masks (the interpreter needs them)
            okv = mv & (offs_v * 0 + t - (KW - 1) + j >= 0)
            k = tl.load(Kd + s * D + offs_d, mask=okd, other=0.0).to(CT)
            rs = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps * eps)
            kh = k * rs
            x = tl.load(X + s * D * DV + off2, mask=okd[:, None] & mv[None, :], other=0.0).to(CT)
            v = tl.load(V + s * DV + offs_v, mask=okv, other=0.0).to(CT)
            b = tl.sum(tl.load(BETA + s + offs_v * 0, mask=okv & (offs_v == 0), other=0.0).to(CT), axis=0)
            if ERASE:
                r = v - tl.sum(kh[:, None] * x, axis=0)
            else:
                r = v
            xn = (x + b * kh[:, None] * r[None, :]).to(XOUT.dtype.element_ty)
            w = tl.load(WT + j * D * DV + off2, mask=m2, other=0.0).to(CT)
            acc += w * xn.to(CT)
            if j == KW - 1:
                tl.store(XOUT + n * D * DV + off2, xn, mask=m2)
                tl.store(R + n * DV + offs_v, r, mask=mv)
                tl.store(RS + n + offs_v * 0, rs + tl.zeros([BLOCK_V], dtype=CT), mask=offs_v == 0)
        tl.store(H + n * D + offs_d, tl.sum(acc, axis=1).to(H.dtype.element_ty), mask=md)

    @triton.jit
    def _update_tc_bwd_kernel(
        X, Kd, V, BETA, WT, G, DH, DX, DK, DVo, DBETA, N, T, D, eps,
        KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        ERASE: tl.constexpr, CT: tl.constexpr,
    ):  # fmt: skip
        # As _update_bwd_kernel, with G += sum_j WT[j] * dh[n + KW-1 - j] (x'[n] feeds the read-outs of
        # tokens n .. n+KW-1 of its sequence).
        n = tl.program_id(0).to(tl.int64)
        t = n % T
        offs_d = tl.arange(0, BLOCK_D)
        offs_v = tl.arange(0, BLOCK_V)
        md = offs_d < D
        mv = offs_v < DV
        m2 = md[:, None] & mv[None, :]
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        _, _, m2, rs, kh, x, b, r = _update_token_inputs(
            n, X, Kd, V, BETA, N, D, eps, offs_d, offs_v, md, mv, off2, DV, ERASE, CT
        )
        g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        for j in tl.static_range(KW):
            okd = md & (offs_d * 0 + t + (KW - 1) - j < T)
            dh = tl.load(DH + (n + (KW - 1) - j) * D + offs_d, mask=okd, other=0.0).to(CT)
            w = tl.load(WT + j * D * DV + off2, mask=m2, other=0.0).to(CT)
            g += w * dh[:, None]
        dx, dk, dv, dbeta = _update_grads(g, x, kh, rs, b, r, ERASE)
        tl.store(DX + n * D * DV + off2, dx.to(DX.dtype.element_ty), mask=m2)
        tl.store(DK + n * D + offs_d, dk.to(DK.dtype.element_ty), mask=md)
        tl.store(DVo + n * DV + offs_v, dv.to(DVo.dtype.element_ty), mask=mv)
        tl.store(DBETA + n, dbeta.to(DBETA.dtype.element_ty))

    @triton.jit
    def _update_tc_wgrad_kernel(
        X, Kd, BETA, RS, R, DH, DWP, N, T, D, TOKENS,
        KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
        CT: tl.constexpr,
    ):  # fmt: skip
        # dWT[j] = sum_n dh[n + KW-1 - j] x'[n], x'[n] = x + beta (k rs) r^T rebuilt per channel block
        pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
        acc = tl.zeros([KP, BLOCK_D, BLOCK_V], dtype=CT)
        for tt in range(TOKENS):
            n = pid * TOKENS + tt
            okd = offs_d * 0 + n < N
            okv = offs_v * 0 + n < N
            dst, valid = _window(n, T, N, offs_j, mj, KW, False)
            dh2 = tl.load(
                DH + dst[:, None] * D + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0
            )
            x = tl.load(X + n * D * DV + off2, mask=m2 & okd[:, None], other=0.0).to(CT)
            k = tl.load(Kd + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
            rs = tl.sum(tl.load(RS + n + offs_v * 0, mask=okv & (offs_v == 0), other=0.0), axis=0)
            b = tl.sum(tl.load(BETA + n + offs_v * 0, mask=okv & (offs_v == 0), other=0.0).to(CT), axis=0)
            r = tl.load(R + n * DV + offs_v, mask=mv & okv, other=0.0)
            xn = (x + b * (k * rs)[:, None] * r[None, :]).to(X.dtype.element_ty).to(CT)
            acc += dh2.to(CT)[:, :, None] * xn[None, :, :]
        off3 = offs_j[:, None, None] * D * DV + off2[None]
        tl.store(DWP + pid * KW * D * DV + off3, acc, mask=mj[:, None, None] & m2[None])


# ----------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with autograd. They take flat, contiguous
# tensors: state [N, d, d_v], vectors [N, d]; T (sequence length) for the token convolutions.


def _pow2(n):
    return triton.next_power_of_2(max(int(n), 1))


def _use_rows(DV, weight, dtype):
    """d_v = 1 and no fused read-out: the [tokens, d] row kernels (unless _CFG turns them off)."""
    rows = _cfg("update_row", dtype)["ROWS"]
    if rows and rows != _pow2(rows):
        raise ValueError(f"_CFG['update_row'] ROWS for {dtype} must be 0 or a power of two, got {rows}")
    return DV == 1 and weight is None and rows > 0


def _chan_grid(N, D, cfg):
    return (triton.cdiv(N, cfg["TOKENS"]), triton.cdiv(D, cfg["BLOCK_D"]))


@torch.library.custom_op("ddl::update", mutates_args=())
def _update_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor | None,
    eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    x_new = _new((N, D, DV), x)
    h = _new((N, D) if weight is not None else (0,), x)
    if _use_rows(DV, weight, x.dtype):
        cfg = _cfg("update_row", x.dtype)
        _update_row_fwd_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
            x, k, v, beta, x_new, N, D, eps, ROWS=cfg["ROWS"], BLOCK_D=_pow2(D), ERASE=erase,
            CT=_ct(x, k, v, beta), num_warps=cfg["num_warps"],
        )  # fmt: skip
        return x_new, h
    cfg = _CFG["update_fwd"]
    grid = (triton.cdiv(N, cfg["TOKENS"]),)
    _update_fwd_kernel[grid](
        x, k, v, beta, weight if weight is not None else x, x_new, h, N, D, eps,
        DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV), TOKENS=cfg["TOKENS"], ERASE=erase,
        COMPRESS=weight is not None, CT=_ct(x, k, v, beta), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return x_new, h


@_update_op.register_fake
def _(x, k, v, beta, weight, eps, erase):
    return torch.empty_like(x), x.new_empty((x.shape[0], x.shape[1]) if weight is not None else (0,))


@torch.library.custom_op("ddl::update_bwd", mutates_args=())
def _update_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor | None,
    g: torch.Tensor, dh: torch.Tensor | None, eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    cfg = _cfg("update_bwd", x.dtype)
    nprog = triton.cdiv(N, cfg["TOKENS"])
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    if _use_rows(DV, weight, x.dtype):
        rcfg = _cfg("update_row", x.dtype)
        _update_row_bwd_kernel[(triton.cdiv(N, rcfg["ROWS"]),)](
            x, k, v, beta, g, dx, dk, dv, dbeta, N, D, eps, ROWS=rcfg["ROWS"], BLOCK_D=_pow2(D),
            ERASE=erase, CT=_ct(x, k, v, beta, g), num_warps=rcfg["num_warps"],
        )  # fmt: skip
        return dx, dk, dv, dbeta, x.new_empty(0)
    compress = weight is not None
    dwp = _new(
        (nprog, D, DV) if compress else (0,),
        x,
        dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
    )
    _update_bwd_kernel[(nprog,)](
        x, k, v, beta, weight if compress else x, g, dh if compress else g, dx, dk, dv, dbeta, dwp,
        N, D, eps, TOKENS=cfg["TOKENS"], LOOP=cfg.get("LOOP", 0), DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV),
        ERASE=erase, COMPRESS=compress, CT=_ct(x, k, v, beta, g), num_warps=cfg["num_warps"],
    )  # fmt: skip
    dw = dwp.sum(0).to(weight.dtype) if compress else x.new_empty(0)
    return dx, dk, dv, dbeta, dw


@_update_bwd_op.register_fake
def _(x, k, v, beta, weight, g, dh, eps, erase):
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta), dw


def _update_setup(ctx, inputs, output):
    x, k, v, beta, weight, eps, erase = inputs
    ctx.save_for_backward(x, k, v, beta, weight)
    ctx.eps, ctx.erase = eps, erase


def _update_backward(ctx, gx, gh):
    x, k, v, beta, weight = ctx.saved_tensors
    gx = torch.zeros_like(x) if gx is None else gx.contiguous()
    if weight is not None:
        gh = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device) if gh is None else gh.contiguous()
    dx, dk, dv, dbeta, dw = _update_bwd_op(
        x, k, v, beta, weight, gx, gh if weight is not None else None, ctx.eps, ctx.erase
    )
    return dx, dk, dv, dbeta, (dw if weight is not None else None), None, None


torch.library.register_autograd("ddl::update", _update_backward, setup_context=_update_setup)


@torch.library.custom_op("ddl::cc", mutates_args=())
def _cc_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    N, D, DV = x.shape
    h = _new((N, D), x)
    cfg = _CFG["chan_fwd"]
    _cc_fwd_kernel[_chan_grid(N, D, cfg)](
        x, weight, h, N, D, DV=DV, BLOCK_D=min(cfg["BLOCK_D"], _pow2(D)), BLOCK_V=_pow2(DV),
        TOKENS=cfg["TOKENS"], CT=_ct(x, weight), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return h


@_cc_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[:2])


@torch.library.custom_op("ddl::cc_bwd", mutates_args=())
def _cc_bwd_op(x: torch.Tensor, weight: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, D, DV = x.shape
    cfg = _CFG["chan_bwd"]
    grid = _chan_grid(N, D, {**cfg, "BLOCK_D": min(cfg["BLOCK_D"], _pow2(D))})
    dx = _new(x.shape, x)
    dwp = _new((grid[0], D, DV), x, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    _cc_bwd_kernel[grid](
        x, weight, dh, dx, dwp, N, D, cfg["TOKENS"], DV=DV, BLOCK_D=min(cfg["BLOCK_D"], _pow2(D)),
        BLOCK_V=_pow2(DV), CT=_ct(x, weight, dh), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dx, dwp.sum(0).to(weight.dtype)


@_cc_bwd_op.register_fake
def _(x, weight, dh):
    return torch.empty_like(x), torch.empty_like(weight)


def _cc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _cc_backward(ctx, dh):
    x, weight = ctx.saved_tensors
    return _cc_bwd_op(x, weight, dh.contiguous())


torch.library.register_autograd("ddl::cc", _cc_backward, setup_context=_cc_setup)


def _acc_dtype(t):
    """Weight-gradient partials: fp32, or float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _token_conv_op(name, fwd_kernel, bwd_kernel, out_shape):
    """Registers `ddl::{name}(a, wt, T)` (a [N, d] or [N, d, d_v], wt [K, d, d_v] taps, T the sequence
    length), its backward op and its autograd, for the two causal depthwise convolutions over tokens,
    TC (a = the state, out [N, d]) and EC (a = the embedding, out [N, d, d_v]): their kernels share a
    signature, a launch grid (a block of d by a run of tokens) and the weight gradient summed from
    per-program partials. Returns the forward op."""

    def launch(a, wt, key):
        N, D = a.shape[0], a.shape[1]
        KW, DV = wt.shape[0], wt.shape[2]
        cfg = _CFG[key]
        bd = min(cfg["BLOCK_D"], _pow2(D))
        consts = dict(KW=KW, KP=_pow2(KW), DV=DV, BLOCK_D=bd, BLOCK_V=_pow2(DV), num_warps=cfg["num_warps"])
        return N, D, cfg, _chan_grid(N, D, {**cfg, "BLOCK_D": bd}), consts

    @torch.library.custom_op(f"ddl::{name}", mutates_args=())
    def op(a: torch.Tensor, wt: torch.Tensor, T: int) -> torch.Tensor:
        N, D, cfg, grid, consts = launch(a, wt, "chan_fwd")
        out = _new(out_shape(a, wt), a)
        fwd_kernel[grid](a, wt, out, N, T, D, TOKENS=cfg["TOKENS"], CT=_ct(a, wt), **consts)
        return out

    @op.register_fake
    def _(a, wt, T):
        return a.new_empty(out_shape(a, wt))

    @torch.library.custom_op(f"ddl::{name}_bwd", mutates_args=())
    def op_bwd(
        a: torch.Tensor, wt: torch.Tensor, g: torch.Tensor, T: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        N, D, cfg, grid, consts = launch(a, wt, "chan_bwd")
        da = _new(a.shape, a)
        dwp = _new((grid[0],) + tuple(wt.shape), a, dtype=_acc_dtype(a))
        bwd_kernel[grid](a, wt, g, da, dwp, N, T, D, cfg["TOKENS"], CT=_ct(a, wt, g), **consts)
        return da, dwp.sum(0).to(wt.dtype)

    @op_bwd.register_fake
    def _(a, wt, g, T):
        return torch.empty_like(a), torch.empty_like(wt)

    def setup(ctx, inputs, output):
        a, wt, T = inputs
        ctx.save_for_backward(a, wt)
        ctx.T = T

    def backward(ctx, g):
        a, wt = ctx.saved_tensors
        da, dwt = op_bwd(a, wt, g.contiguous(), ctx.T)
        return da, dwt, None

    torch.library.register_autograd(f"ddl::{name}", backward, setup_context=setup)
    return op


_tc_op = _token_conv_op("tc", _tc_fwd_kernel, _tc_bwd_kernel, lambda x, wt: (x.shape[0], x.shape[1]))
_ec_op = _token_conv_op(
    "ec", _ec_fwd_kernel, _ec_bwd_kernel, lambda emb, wt: (emb.shape[0], emb.shape[1], wt.shape[2])
)


@torch.library.custom_op("ddl::update_tc", mutates_args=())
def _update_tc_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, wt: torch.Tensor, T: int,
    eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    ft = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_new, h, rs, r = (
        _new((N, D, DV), x),
        _new((N, D), x),
        _new((N,), x, dtype=ft),
        _new((N, DV), x, dtype=ft),
    )
    _update_tc_fwd_kernel[(N,)](
        x, k, v, beta, wt, x_new, h, rs, r, N, T, D, eps, KW=wt.shape[0], DV=DV, BLOCK_D=_pow2(D),
        BLOCK_V=_pow2(DV), ERASE=erase, CT=_ct(x, k, v, beta), num_warps=_CFG["update_fwd"]["num_warps"],
    )  # fmt: skip
    return x_new, h, rs, r


@_update_tc_op.register_fake
def _(x, k, v, beta, wt, T, eps, erase):
    ft = torch.float64 if x.dtype == torch.float64 else torch.float32
    N, D, DV = x.shape
    return (
        torch.empty_like(x),
        x.new_empty((N, D)),
        x.new_empty((N,), dtype=ft),
        x.new_empty((N, DV), dtype=ft),
    )


@torch.library.custom_op("ddl::update_tc_bwd", mutates_args=())
def _update_tc_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, wt: torch.Tensor, rs: torch.Tensor,
    r: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, T: int, eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    KW = wt.shape[0]
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    ct = _ct(x, k, v, beta, g)
    _update_tc_bwd_kernel[(N,)](
        x, k, v, beta, wt, g, dh, dx, dk, dv, dbeta, N, T, D, eps, KW=KW, DV=DV, BLOCK_D=_pow2(D),
        BLOCK_V=_pow2(DV), ERASE=erase, CT=ct, num_warps=_CFG["update_fwd"]["num_warps"],
    )  # fmt: skip
    cfg = _CFG["chan_bwd"]
    bd = min(cfg["BLOCK_D"], _pow2(D))
    grid = _chan_grid(N, D, {**cfg, "BLOCK_D": bd})
    dwp = _new((grid[0], KW, D, DV), x, dtype=rs.dtype)
    _update_tc_wgrad_kernel[grid](
        x, k, beta, rs, r, dh, dwp, N, T, D, cfg["TOKENS"], KW=KW, KP=_pow2(KW), DV=DV, BLOCK_D=bd,
        BLOCK_V=_pow2(DV), CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dx, dk, dv, dbeta, dwp.sum(0).to(wt.dtype)


@_update_tc_bwd_op.register_fake
def _(x, k, v, beta, wt, rs, r, g, dh, T, eps, erase):
    return (
        torch.empty_like(x),
        torch.empty_like(k),
        torch.empty_like(v),
        torch.empty_like(beta),
        torch.empty_like(wt),
    )


def _update_tc_setup(ctx, inputs, output):
    x, k, v, beta, wt, T, eps, erase = inputs
    ctx.save_for_backward(x, k, v, beta, wt, output[2], output[3])
    ctx.T, ctx.eps, ctx.erase = T, eps, erase


def _update_tc_backward(ctx, gx, gh, _grs, _gr):
    x, k, v, beta, wt, rs, r = ctx.saved_tensors
    gx = torch.zeros_like(x) if gx is None else gx.contiguous()
    gh = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device) if gh is None else gh.contiguous()
    dx, dk, dv, dbeta, dwt = _update_tc_bwd_op(x, k, v, beta, wt, rs, r, gx, gh, ctx.T, ctx.eps, ctx.erase)
    return dx, dk, dv, dbeta, dwt, None, None, None


torch.library.register_autograd("ddl::update_tc", _update_tc_backward, setup_context=_update_tc_setup)


# ----------------------------------------------------------------------------------------------------
# Public functions: check, pick a backend, flatten for the kernels.


def _resolve(fn, backend, *tensors):
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if _auto_backend is not None:
            backend = _auto_backend
        else:  # the kernels are for the GPU; CPU runs (tests of other modules) take the reference
            backend = "triton" if triton is not None and all(t.is_cuda for t in tensors) else "torch"
    if backend == "triton":
        if triton is None:
            raise RuntimeError(f"{fn}: backend='triton' needs the triton package")
        if not all(t.is_cuda for t in tensors) and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{fn}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return backend


def ddl_update(x, k, v, beta, eps=1e-5, erase=True, backend="auto"):
    """x + beta*khat*(v^T - khat^T x), or x + beta*khat*v^T (erase=False); x [..., d, d_v], k [..., d]."""
    _check_update_args(x, k, v, beta)
    if _resolve("ddl_update", backend, x, k, v, beta) == "torch":
        return ddl_update_ref(x, k, v, beta, eps=eps, erase=erase)
    d, dv = x.shape[-2:]
    x_new, _ = _update_op(
        x.reshape(-1, d, dv).contiguous(), k.reshape(-1, d).contiguous(), v.reshape(-1, dv).contiguous(),
        beta.reshape(-1).contiguous(), None, float(eps), bool(erase),
    )  # fmt: skip
    return x_new.view(x.shape)


def ddl_update_compress_cc_ref(x, k, v, beta, weight, eps=1e-5, erase=True):
    x_new = ddl_update_ref(x, k, v, beta, eps=eps, erase=erase)
    return x_new, compress_cc_ref(x_new, weight)


def ddl_update_compress_cc(x, k, v, beta, weight, eps=1e-5, erase=True, backend="auto"):
    """(x_new, compress_cc(x_new, weight)) in one pass over the state: the update of one sublayer fused
    with the CC read-out of the next; x [B, T, d, d_v], weight [d, d_v]. Saves a read of x_new forward
    and a read+write of its gradient backward."""
    _check_update_args(x, k, v, beta)
    _check_state("ddl_update_compress_cc", x)
    if tuple(weight.shape) != tuple(x.shape[-2:]):
        raise ValueError(
            f"ddl_update_compress_cc: weight must be {tuple(x.shape[-2:])}, got {tuple(weight.shape)}"
        )
    if _resolve("ddl_update_compress_cc", backend, x, k, v, beta, weight) == "torch":
        return ddl_update_compress_cc_ref(x, k, v, beta, weight, eps=eps, erase=erase)
    B, T, d, dv = x.shape
    x_new, h = _update_op(
        x.reshape(-1, d, dv).contiguous(), k.reshape(-1, d).contiguous(), v.reshape(-1, dv).contiguous(),
        beta.reshape(-1).contiguous(), weight.contiguous(), float(eps), bool(erase),
    )  # fmt: skip
    return x_new.view(x.shape), h.view(B, T, d)


def ddl_update_compress_tc_ref(x, k, v, beta, conv_weight, read, eps=1e-5, erase=True):
    x_new = ddl_update_ref(x, k, v, beta, eps=eps, erase=erase)
    return x_new, compress_tc_ref(x_new, conv_weight, read)


def ddl_update_compress_tc(x, k, v, beta, conv_weight, read, eps=1e-5, erase=True, backend="auto"):
    """(x_new, compress_tc(x_new, conv_weight, read)) in one pass over the state: the update of one
    sublayer fused with the TC read-out of the next (the K-1 earlier tokens' new states are recomputed
    in registers, not re-read). x [B, T, d, d_v], conv_weight [d, d_v, K], read [d_v]."""
    _check_update_args(x, k, v, beta)
    _check_state("ddl_update_compress_tc", x)
    B, T, d, dv = x.shape
    _check_conv("ddl_update_compress_tc", "conv_weight", conv_weight, d, dv)
    if tuple(read.shape) != (dv,):
        raise ValueError(f"ddl_update_compress_tc: read must be [{dv}] (= [d_v]), got {tuple(read.shape)}")
    if _resolve("ddl_update_compress_tc", backend, x, k, v, beta, conv_weight, read) == "torch":
        return ddl_update_compress_tc_ref(x, k, v, beta, conv_weight, read, eps=eps, erase=erase)
    wt = (conv_weight * read[None, :, None]).permute(2, 0, 1).contiguous()  # [K, d, d_v], read folded in
    x_new, h, _, _ = _update_tc_op(
        x.reshape(-1, d, dv).contiguous(), k.reshape(-1, d).contiguous(), v.reshape(-1, dv).contiguous(),
        beta.reshape(-1).contiguous(), wt, T, float(eps), bool(erase),
    )  # fmt: skip
    return x_new.view(x.shape), h.view(B, T, d)


def compress_cc(x, weight, backend="auto"):
    """h[b,t,i] = sum_v weight[i,v] * x[b,t,i,v]; x [B, T, d, d_v], weight [d, d_v]."""
    if _resolve("compress_cc", backend, x, weight) == "torch":
        return compress_cc_ref(x, weight)
    _check_state("compress_cc", x)
    if tuple(weight.shape) != tuple(x.shape[-2:]):
        raise ValueError(
            f"compress_cc: weight must be {tuple(x.shape[-2:])} (= [d, d_v]), got {tuple(weight.shape)}"
        )
    B, T, d, dv = x.shape
    return _cc_op(x.reshape(-1, d, dv).contiguous(), weight.contiguous()).view(B, T, d)


def compress_tc(x, conv_weight, read, backend="auto"):
    """Causal depthwise conv over tokens of each (i, v) channel, then a read-out over v."""
    if _resolve("compress_tc", backend, x, conv_weight, read) == "torch":
        return compress_tc_ref(x, conv_weight, read)
    _check_state("compress_tc", x)
    B, T, d, dv = x.shape
    _check_conv("compress_tc", "conv_weight", conv_weight, d, dv)
    if tuple(read.shape) != (dv,):
        raise ValueError(f"compress_tc: read must be [{dv}] (= [d_v]), got {tuple(read.shape)}")
    # fold the read-out into the taps (tiny tensor; autograd carries its gradient to conv_weight and read)
    wt = (conv_weight * read[None, :, None]).permute(2, 0, 1).contiguous()  # [K, d, d_v]
    return _tc_op(x.reshape(-1, d, dv).contiguous(), wt, T).view(B, T, d)


def expand_ec(emb, conv_weight, backend="auto"):
    """X0 [B, T, d, d_v] from emb [B, T, d] by a causal depthwise conv per (i, v)."""
    if _resolve("expand_ec", backend, emb, conv_weight) == "torch":
        return expand_ec_ref(emb, conv_weight)
    if emb.dim() != 3:
        raise ValueError(f"expand_ec: emb must be [B, T, d], got shape {tuple(emb.shape)}")
    B, T, d = emb.shape
    _check_conv("expand_ec", "conv_weight", conv_weight, d)
    dv = conv_weight.shape[1]
    wt = conv_weight.permute(2, 0, 1).contiguous()
    return _ec_op(emb.reshape(-1, d).contiguous(), wt, T).view(B, T, d, dv)
