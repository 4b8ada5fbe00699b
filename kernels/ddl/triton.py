"""DDL ops in Triton: the kernels, their torch.library custom ops (opaque to torch.compile, with fake
implementations) and autograd, and the functions that flatten the public functions' arguments for them.

The state is memory-bound work: each kernel reads and writes every [d, d_v] tile once and keeps all
arithmetic in registers (fp32, or float64 for float64 inputs so tests can be exact). The update needs
whole-token reductions over d (|k|, khat^T x; its backward, khat^T G), so one program owns whole tokens
(the forward stores rs and r for the backward to read); compressors and EC are per-channel, so their
programs take a block of d and a run of tokens. Weight gradients are reduced over
tokens inside a program into fp32 partials, summed by torch.
"""

import torch
import triton
import triton.language as tl

from ..common import acc_dtype

# Launch shapes (tokens per program, warps, channel block for the per-channel kernels), tuned on an H200
# by `python bench/bench_ddl.py` / `--sweeps`. An entry may hold a whole launch shape for one state dtype
# under that dtype's name ("bfloat16"), used instead of the entry's own for that dtype (`_cfg`). PIPELINE:
# the backward's loop over a program's tokens software-pipelined (two stages) or plain. Single-call timings
# of the small (d_v = 1, bf16) cases include the host's dispatch and vary between runs: compare launch
# shapes in a profile of a training step (bench_train.py --profile) before changing them.
LAUNCH = {
    "update_fwd": dict(TOKENS=1, num_warps=4),
    "update_bwd": dict(TOKENS=16, PIPELINE=True, num_warps=8),
    "update_row": dict(  # d_v = 1 without a fused read-out; ROWS=0: the general kernel
        ROWS=2, num_warps=4, bfloat16=dict(ROWS=4, num_warps=8)
    ),
    "chan_fwd": dict(TOKENS=4, BLOCK_D=256, num_warps=4),
    "chan_bwd": dict(TOKENS=64, BLOCK_D=256, num_warps=4),
    # the TC read-out's forward (_tc_fwd_kernel, one pass over the state in token order; the fused update +
    # TC read-out runs as the update kernel followed by it); STAGES: its loads in flight
    "tc_fwd": dict(
        TOKENS=128,
        BLOCK_D=128,
        STAGES=3,
        num_warps=4,
        bfloat16=dict(TOKENS=64, BLOCK_D=256, STAGES=2, num_warps=8),
    ),  # fmt: skip
    "tc_bwd": dict(TOKENS=1, num_warps=4),  # the fused update + TC read-out's backward (per token)
}
# Tests set this: every output starts as NaN, so that an element a kernel fails to write cannot pass.
_FILL_OUTPUTS_WITH_NAN = False


def _cfg(key, dtype):
    """The launch shape LAUNCH[key] holds for a state of this dtype (its per-dtype entry, else its own)."""
    cfg = LAUNCH[key]
    return cfg.get(str(dtype).removeprefix("torch."), cfg)


def _new(shape, like, dtype=None):
    dtype = like.dtype if dtype is None else dtype
    if _FILL_OUTPUTS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _ct(*tensors):
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


@triton.jit
def _token_tile(D, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    # the per-token kernels' tile, one token's [d, d_v] state: offsets, masks and the flat offset d*DV + v
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_V)
    return offs_d, offs_v, offs_d < D, offs_v < DV, offs_d[:, None] * DV + offs_v[None, :]


@triton.jit
def _vec_mask(ok, offs):
    # a scalar condition as a vector mask like offs (the interpreter rejects scalar & vector)
    return offs * 0 + ok.to(tl.int32) != 0


@triton.jit
def _token_update_terms(n, ok, okd, okv, x, Kd, V, BETA, D, eps, offs_d, offs_v, md, mv,
                        DV: tl.constexpr, ERASE: tl.constexpr, CT: tl.constexpr):  # fmt: skip
    """rs = 1 / sqrt(|k|^2 + eps^2), khat = k rs, beta and r = v - khat^T x (r = v without the erase) of
    token n's update of state x (zeros where ok, a scalar condition, is false): the forward's."""
    k = tl.load(Kd + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
    rs = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps * eps)
    kh = k * rs
    v = tl.load(V + n * DV + offs_v, mask=mv & okv, other=0.0).to(CT)
    b = tl.load(BETA + n, mask=ok, other=0.0).to(CT)
    if ERASE:
        r = v - tl.sum(kh[:, None] * x, axis=0)  # v^T - khat^T x
    else:
        r = v
    return rs, kh, b, r


@triton.jit
def _stored_update_terms(n, ok, Kd, BETA, RS, R, D, offs_d, offs_v, md, mv, DV: tl.constexpr,
                         CT: tl.constexpr):  # fmt: skip
    """rs, khat, beta and r of token n's update as _token_update_terms, from its k and beta and the rs [N]
    and r [N, DV] its forward stored: no reduction, and no need for x (zeros where ok, a scalar
    condition, is false). offs_d: all of d, or a block of it."""
    k = tl.load(Kd + n * D + offs_d, mask=md & _vec_mask(ok, offs_d), other=0.0).to(CT)
    rs = tl.load(RS + n, mask=ok, other=0.0).to(CT)
    b = tl.load(BETA + n, mask=ok, other=0.0).to(CT)
    r = tl.load(R + n * DV + offs_v, mask=mv & _vec_mask(ok, offs_v), other=0.0).to(CT)
    return rs, k * rs, b, r


@triton.jit
def _rebuilt_update(x, n, ok, Kd, BETA, RS, R, D, offs_d, offs_v, md, mv, DV: tl.constexpr,
                    CT: tl.constexpr):  # fmt: skip
    # x' = x + beta khat r^T of token n (x: all of d or a block of it), from the update's stored terms
    _, kh, b, r = _stored_update_terms(n, ok, Kd, BETA, RS, R, D, offs_d, offs_v, md, mv, DV, CT)
    return x + b * kh[:, None] * r[None, :]


@triton.jit
def _rebuilt_state(x, n, ok, CHAIN, D, offs_d, offs_v, md, mv, DV: tl.constexpr, CT: tl.constexpr,
                   OUT_T: tl.constexpr):  # fmt: skip
    """x0 (a tile of token n) through the updates of CHAIN = (ks, betas, rss, rr), each update's k, beta
    and stored rs and r: x + beta khat r^T each, rounded to the state's dtype OUT_T as the forward stored
    it (empty tuples: x unchanged)."""
    ks, bs, rss, rr = CHAIN
    for i in tl.static_range(len(ks)):
        x = _rebuilt_update(x, n, ok, ks[i], bs[i], rss[i], rr[i], D, offs_d, offs_v, md, mv, DV, CT)
        x = x.to(OUT_T).to(CT)
    return x


@triton.jit
def _update_bwd_inputs(
    n, ok, X, Kd, V, BETA, RS, R, CHAIN, D, offs_d, offs_v, md, mv, off2, DV: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    """What the backward of token n's update reads (zeros where ok, a scalar condition, is false): its
    masks, the state x (X holds x0 and x is rebuilt through CHAIN, see _rebuilt_state), the update's
    stored terms (_stored_update_terms) and its value v."""
    okd = _vec_mask(ok, offs_d)
    m2 = (md & okd)[:, None] & mv[None, :]
    x = tl.load(X + n * D * DV + off2, mask=m2, other=0.0).to(CT)
    x = _rebuilt_state(x, n, ok, CHAIN, D, offs_d, offs_v, md, mv, DV, CT, X.dtype.element_ty)
    rs, kh, b, r = _stored_update_terms(n, ok, Kd, BETA, RS, R, D, offs_d, offs_v, md, mv, DV, CT)
    v = tl.load(V + n * DV + offs_v, mask=mv & _vec_mask(ok, offs_v), other=0.0).to(CT)
    return okd, m2, rs, kh, x, b, r, v


@triton.jit
def _update_grads(g, x, kh, rs, b, r, v, ERASE: tl.constexpr):
    """The update's backward for one token, given G = dL/dx' (formulas in `_update_bwd_token`):
    dx, dk, dv, dbeta. One reduction over d (khat^T G): khat . dkhat follows from it and the stored r."""
    gk = tl.sum(kh[:, None] * g, axis=0)  # khat^T G  [d_v]
    gr = tl.sum(g * r[None, :], axis=1)  # G r  [d]
    if ERASE:
        dx = g - b * kh[:, None] * gk[None, :]
        dkh = b * (gr - tl.sum(x * gk[None, :], axis=1))
        # khat . dkhat = b (gk . r - (khat^T x) . gk), and khat^T x = v - r
        kdk = b * tl.sum(gk * (2.0 * r - v), axis=0)
    else:
        dx = g
        dkh = b * gr
        kdk = b * tl.sum(gk * r, axis=0)
    dk = rs * (dkh - kh * kdk)
    return dx, dk, b * gk, tl.sum(gk * r, axis=0)


@triton.jit
def _store_update_grads(n, ok, okd, m2, off2, dx, dk, dv, dbeta, DX, DK, DVo, DBETA, D, offs_d, offs_v, md,
                        mv, DV: tl.constexpr):  # fmt: skip
    tl.store(DX + n * D * DV + off2, dx.to(DX.dtype.element_ty), mask=m2)
    tl.store(DK + n * D + offs_d, dk.to(DK.dtype.element_ty), mask=md & okd)
    okv = _vec_mask(ok, offs_v)
    tl.store(DVo + n * DV + offs_v, dv.to(DVo.dtype.element_ty), mask=mv & okv)
    tl.store(DBETA + n, dbeta.to(DBETA.dtype.element_ty), mask=ok)


@triton.jit
def _update_fwd_kernel(
    X, Kd, V, BETA, W, XOUT, H, RS, R, N, D, eps,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
    ERASE: tl.constexpr, COMPRESS: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # x' and the update's rs and r (which the backward reads instead of recomputing them; 20 bytes a token
    # at d_v = 4 against the state's 12 KB), with COMPRESS also the next sublayer's CC read-out of x'
    pid = tl.program_id(0).to(tl.int64)
    offs_d, offs_v, md, mv, off2 = _token_tile(D, DV, BLOCK_D, BLOCK_V)
    if COMPRESS:
        w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
    for tt in tl.static_range(TOKENS):
        n = pid * TOKENS + tt
        ok = n < N
        okd = _vec_mask(ok, offs_d)
        okv = _vec_mask(ok, offs_v)
        m2 = (md & okd)[:, None] & mv[None, :]
        x = tl.load(X + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        rs, kh, b, r = _token_update_terms(
            n, ok, okd, okv, x, Kd, V, BETA, D, eps, offs_d, offs_v, md, mv, DV, ERASE, CT
        )
        xn = (x + b * kh[:, None] * r[None, :]).to(XOUT.dtype.element_ty)
        tl.store(XOUT + n * D * DV + off2, xn, mask=m2)
        tl.store(R + n * DV + offs_v, r, mask=mv & okv)
        tl.store(RS + n, rs, mask=ok)
        if COMPRESS:  # the next sublayer's CC read-out of the state just written (as stored)
            h = tl.sum(xn.to(CT) * w, axis=1)
            tl.store(H + n * D + offs_d, h.to(H.dtype.element_ty), mask=md & okd)


@triton.jit
def _update_bwd_token(
    n, X, Kd, V, BETA, RS, R, CHAIN, w, G, DH, DX, DK, DVo, DBETA, N, D, offs_d, offs_v, md, mv, off2,
    DV: tl.constexpr, ERASE: tl.constexpr, COMPRESS: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # One token of the backward; returns its contribution dh xn^T to the CC weight gradient.
    # x' = x + b khat r^T, r = v - x^T khat.  With G = dL/dx' (+ dh w^T from the fused read-out):
    # dx = G - b khat (khat^T G);  dv = b G^T khat;  dbeta = r . (G^T khat);
    # dkhat = b (G r - x G^T khat);  dk = (dkhat - khat (khat . dkhat)) / sqrt(|k|^2 + eps^2).
    ok = n < N
    okd, m2, rs, kh, x, b, r, v = _update_bwd_inputs(
        n, ok, X, Kd, V, BETA, RS, R, CHAIN, D, offs_d, offs_v, md, mv, off2, DV, CT
    )
    g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
    dw = w * 0.0
    if COMPRESS:
        dh = tl.load(DH + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
        xn = (x + b * kh[:, None] * r[None, :]).to(X.dtype.element_ty).to(CT)
        dw = dh[:, None] * xn
        g = g + dh[:, None] * w
    dx, dk, dv, dbeta = _update_grads(g, x, kh, rs, b, r, v, ERASE)
    _store_update_grads(
        n, ok, okd, m2, off2, dx, dk, dv, dbeta, DX, DK, DVo, DBETA, D, offs_d, offs_v, md, mv, DV
    )
    return dw


@triton.jit
def _update_bwd_kernel(
    X, Kd, V, BETA, RS, R, CHAIN, W, G, DH, DX, DK, DVo, DBETA, DWP, N, D,
    TOKENS: tl.constexpr, PIPELINE: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr, ERASE: tl.constexpr, COMPRESS: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # TOKENS tokens per program (the CC weight gradient is summed over them in registers), in a plain loop
    # (one token's loads in flight at a time) or, PIPELINE, a software-pipelined one (num_stages 2).
    pid = tl.program_id(0).to(tl.int64)
    offs_d, offs_v, md, mv, off2 = _token_tile(D, DV, BLOCK_D, BLOCK_V)
    if COMPRESS:
        w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
    else:
        w = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
    dw = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
    if PIPELINE:
        for tt in tl.range(0, TOKENS, num_stages=2):
            dw += _update_bwd_token(
                pid * TOKENS + tt, X, Kd, V, BETA, RS, R, CHAIN, w, G, DH, DX, DK, DVo, DBETA, N, D,
                offs_d, offs_v, md, mv, off2, DV, ERASE, COMPRESS, CT,
            )  # fmt: skip
    else:
        for tt in range(TOKENS):
            dw += _update_bwd_token(
                pid * TOKENS + tt, X, Kd, V, BETA, RS, R, CHAIN, w, G, DH, DX, DK, DVo, DBETA, N, D,
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
def _row_tile(X, Kd, BETA, N, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CT: tl.constexpr):
    # d_v = 1 row kernels: ROWS tokens as a [ROWS, d] tile; the loaded k, x and beta
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mr = rows < N
    m2 = mr[:, None] & (cols < D)[None, :]
    off = rows[:, None] * D + cols[None, :]
    k = tl.load(Kd + off, mask=m2, other=0.0).to(CT)
    x = tl.load(X + off, mask=m2, other=0.0).to(CT)
    b = tl.load(BETA + rows, mask=mr, other=0.0).to(CT)
    return rows, mr, m2, off, k, x, b


@triton.jit
def _update_row_fwd_kernel(
    X, Kd, V, BETA, XOUT, RS, R, N, D, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ERASE: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # d_v = 1: the state is a d-vector per token, so a program takes ROWS tokens as a [ROWS, d] tile
    # (like a layer norm) instead of one [d, 1] tile per token; rs and r stored as _update_fwd_kernel's.
    rows, mr, m2, off, k, x, b = _row_tile(X, Kd, BETA, N, D, ROWS, BLOCK_D, CT)
    rs = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + eps * eps)
    kh = k * rs[:, None]
    r = tl.load(V + rows, mask=mr, other=0.0).to(CT)
    if ERASE:
        r = r - tl.sum(kh * x, axis=1)
    tl.store(XOUT + off, (x + (b * r)[:, None] * kh).to(XOUT.dtype.element_ty), mask=m2)
    tl.store(RS + rows, rs, mask=mr)
    tl.store(R + rows, r, mask=mr)


@triton.jit
def _update_row_bwd_kernel(
    X, Kd, V, BETA, RS, R, G, DX, DK, DVo, DBETA, N, D,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ERASE: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # _update_bwd_token with d_v = 1 (r, gk scalars per token), ROWS tokens per program.
    rows, mr, m2, off, k, x, b = _row_tile(X, Kd, BETA, N, D, ROWS, BLOCK_D, CT)
    rs = tl.load(RS + rows, mask=mr, other=0.0).to(CT)
    r = tl.load(R + rows, mask=mr, other=0.0).to(CT)
    kh = k * rs[:, None]
    g = tl.load(G + off, mask=m2, other=0.0).to(CT)
    gk = tl.sum(kh * g, axis=1)
    if ERASE:  # khat . dkhat from gk as in _update_grads
        v = tl.load(V + rows, mask=mr, other=0.0).to(CT)
        dx = g - (b * gk)[:, None] * kh
        dkh = b[:, None] * (g * r[:, None] - x * gk[:, None])
        kdk = b * gk * (2.0 * r - v)
    else:
        dx = g
        dkh = (b * r)[:, None] * g
        kdk = b * gk * r
    dk = rs[:, None] * (dkh - kh * kdk[:, None])
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
    X, WT, H, N, T, D, TOKENS,
    KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    STAGES: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # h[n] = sum_j sum_v WT[j] * x[n - (KW-1) + j] within the token's sequence (WT = conv * read), reading
    # each x once: a program goes through its TOKENS tokens (and the KW-1 before them) in order. Token s
    # reaches the read-outs of s .. s+KW-1, s+i through tap KW-1-i; after adding it, acc[i] holds the
    # partial read-out of token s+i, so acc[0] is complete, and acc moves down one slot. At a sequence's
    # first token nothing earlier reaches on: acc starts from zeros there.
    pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
    rev = (KW - 1 - offs_j)[:, None, None] * D * DV + off2[None]
    w_rev = tl.load(WT + rev, mask=mj[:, None, None] & m2[None], other=0.0).to(CT)  # w_rev[i] = WT[KW-1-i]
    acc = tl.zeros([KP, BLOCK_D], dtype=CT)
    for i in tl.range(0, TOKENS + KW - 1, num_stages=STAGES):  # STAGES > 1: the next loads in flight
        s = pid * TOKENS - (KW - 1) + i
        inside = offs_d * 0 + ((s >= 0) & (s < N)).to(tl.int32) != 0  # vector masks, as elsewhere
        starts = offs_d * 0 + (s % T == 0).to(tl.int32) != 0
        acc = tl.where(starts[None, :], 0.0, acc)
        x = tl.load(X + s * D * DV + off2, mask=(md & inside)[:, None] & mv[None, :], other=0.0).to(CT)
        acc += tl.sum(w_rev * x[None, :, :], axis=2)
        h = tl.sum(tl.where(offs_j[:, None] == 0, acc, 0.0), axis=0)
        own = md & inside & (offs_d * 0 + i >= KW - 1)  # the KW-1 tokens before the run only feed it
        tl.store(H + s * D + offs_d, h.to(H.dtype.element_ty), mask=own)
        down = offs_j[:, None, None] + 1 == offs_j[None, :, None]  # acc[i] <- acc[i+1]
        acc = tl.sum(tl.where(down, acc[None, :, :], 0.0), axis=1)


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
        dh2 = tl.load(DH + dst[:, None] * D + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
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
def _update_tc_bwd_kernel(
    X, Kd, V, BETA, RS, R, CHAIN, WT, G, DH, DX, DK, DVo, DBETA, N, T, D,
    TOKENS: tl.constexpr, KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    ERASE: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # As _update_bwd_kernel, with G += sum_j WT[j] * dh[n + KW-1 - j] (x'[n] feeds the read-outs of
    # tokens n .. n+KW-1 of its sequence); TOKENS consecutive tokens per program, which read the same taps,
    # unrolled: as a loop (even of one token) ptxas spills up to 4 KB of registers per thread on sm_90
    # (bench/compile_check.py), unrolled next to none.
    pid = tl.program_id(0).to(tl.int64)
    offs_d, offs_v, md, mv, off2 = _token_tile(D, DV, BLOCK_D, BLOCK_V)
    for tt in tl.static_range(TOKENS):
        n = pid * TOKENS + tt
        t = n % T
        ok = n < N
        okd, m2, rs, kh, x, b, r, v = _update_bwd_inputs(
            n, ok, X, Kd, V, BETA, RS, R, CHAIN, D, offs_d, offs_v, md, mv, off2, DV, CT
        )
        g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        for j in tl.static_range(KW):
            okj = md & okd & (offs_d * 0 + t + (KW - 1) - j < T)
            dh = tl.load(DH + (n + (KW - 1) - j) * D + offs_d, mask=okj, other=0.0).to(CT)
            w = tl.load(WT + j * D * DV + off2, mask=m2, other=0.0).to(CT)
            g += w * dh[:, None]
        dx, dk, dv, dbeta = _update_grads(g, x, kh, rs, b, r, v, ERASE)
        _store_update_grads(
            n, ok, okd, m2, off2, dx, dk, dv, dbeta, DX, DK, DVo, DBETA, D, offs_d, offs_v, md, mv, DV
        )


@triton.jit
def _update_tc_wgrad_kernel(
    X, Kd, BETA, RS, R, CHAIN, DH, DWP, N, T, D, TOKENS,
    KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    CT: tl.constexpr,
):  # fmt: skip
    # dWT[j] = sum_n dh[n + KW-1 - j] x'[n], x'[n] = x + beta khat r^T rebuilt per channel block from the
    # stored terms (from x0 through the updates of CHAIN first)
    pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
    acc = tl.zeros([KP, BLOCK_D, BLOCK_V], dtype=CT)
    for tt in range(TOKENS):
        n = pid * TOKENS + tt
        ok = n < N
        okd = _vec_mask(ok, offs_d)
        dst, valid = _window(n, T, N, offs_j, mj, KW, False)
        dh2 = tl.load(DH + dst[:, None] * D + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        x = tl.load(X + n * D * DV + off2, mask=m2 & okd[:, None], other=0.0).to(CT)
        x = _rebuilt_state(x, n, ok, CHAIN, D, offs_d, offs_v, md, mv, DV, CT, X.dtype.element_ty)
        xn = _rebuilt_update(x, n, ok, Kd, BETA, RS, R, D, offs_d, offs_v, md, mv, DV, CT)
        acc += dh2.to(CT)[:, :, None] * xn.to(X.dtype.element_ty).to(CT)[None, :, :]
    off3 = offs_j[:, None, None] * D * DV + off2[None]
    tl.store(DWP + pid * KW * D * DV + off3, acc, mask=mj[:, None, None] & m2[None])


# ----------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with autograd. They take flat, contiguous
# tensors: state [N, d, d_v], vectors [N, d]; T (sequence length) for the token convolutions.


def _pow2(n):
    return triton.next_power_of_2(max(int(n), 1))


def _use_rows(DV, weight, dtype):
    """d_v = 1 and no fused read-out: the [tokens, d] row kernels (unless LAUNCH turns them off)."""
    rows = _cfg("update_row", dtype)["ROWS"]
    if rows and rows != _pow2(rows):
        raise ValueError(f"LAUNCH['update_row'] ROWS for {dtype} must be 0 or a power of two, got {rows}")
    return DV == 1 and weight is None and rows > 0


def _chan_grid(N, D, cfg):
    return (triton.cdiv(N, cfg["TOKENS"]), triton.cdiv(D, cfg["BLOCK_D"]))


def _chain(ks, betas, rss, rr):
    """The backward kernels' CHAIN argument (see _rebuilt_state): the updates (ks[i], betas[i], rss[i],
    rr[i]) that made their state x from x0 (rebuild_from), as Triton tuples."""
    return (tuple(ks), tuple(betas), tuple(rss), tuple(rr))


def _update_forward(x, k, v, beta, weight, eps, erase):
    """(x_new, h, rs, r): the update, with weight also h = the CC read-out of x_new (else empty), and the
    terms rs [N], r [N, d_v] (fp32) that its backward and a later rebuild_from read."""
    N, D, DV = x.shape
    x_new = _new((N, D, DV), x)
    h = _new((N, D) if weight is not None else (0,), x)
    rs, r = _new((N,), x, dtype=acc_dtype(x)), _new((N, DV), x, dtype=acc_dtype(x))
    ct = _ct(x, k, v, beta)
    if _use_rows(DV, weight, x.dtype):
        cfg = _cfg("update_row", x.dtype)
        _update_row_fwd_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
            x, k, v, beta, x_new, rs, r, N, D, eps, ROWS=cfg["ROWS"], BLOCK_D=_pow2(D), ERASE=erase, CT=ct,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
        return x_new, h, rs, r
    cfg = LAUNCH["update_fwd"]
    _update_fwd_kernel[(triton.cdiv(N, cfg["TOKENS"]),)](
        x, k, v, beta, weight if weight is not None else x, x_new, h, rs, r, N, D, eps,
        DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV), TOKENS=cfg["TOKENS"], ERASE=erase,
        COMPRESS=weight is not None, CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return x_new, h, rs, r


def _fake_update_forward(x, weight):
    N, D, DV = x.shape
    ft = acc_dtype(x)
    h = x.new_empty((N, D) if weight is not None else (0,))
    return torch.empty_like(x), h, x.new_empty((N,), dtype=ft), x.new_empty((N, DV), dtype=ft)


@torch.library.custom_op("ddl::update", mutates_args=())
def _update_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor | None,
    eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _update_forward(x, k, v, beta, weight, eps, erase)


@_update_op.register_fake
def _(x, k, v, beta, weight, eps, erase):
    return _fake_update_forward(x, weight)


# The backward ops read the update's stored rs and r instead of recomputing them, and v (khat^T x = v - r:
# one reduction over d a token, not two). They take the chain (ks, betas, rss, rr) of updates that made
# their state x from x0 (rebuild_from): given one, x is x0 and the kernels rebuild x in registers as they
# load it, elementwise.
@torch.library.custom_op("ddl::update_bwd", mutates_args=())
def _update_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rs: torch.Tensor, r: torch.Tensor,
    weight: torch.Tensor | None, g: torch.Tensor, dh: torch.Tensor | None, erase: bool,
    ks: list[torch.Tensor], betas: list[torch.Tensor], rss: list[torch.Tensor], rr: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    cfg = _cfg("update_bwd", x.dtype)
    nprog = triton.cdiv(N, cfg["TOKENS"])
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    ct = _ct(x, k, v, beta, g)
    if _use_rows(DV, weight, x.dtype) and not ks:
        rcfg = _cfg("update_row", x.dtype)
        _update_row_bwd_kernel[(triton.cdiv(N, rcfg["ROWS"]),)](
            x, k, v, beta, rs, r, g, dx, dk, dv, dbeta, N, D, ROWS=rcfg["ROWS"], BLOCK_D=_pow2(D),
            ERASE=erase, CT=ct, num_warps=rcfg["num_warps"],
        )  # fmt: skip
        return dx, dk, dv, dbeta, x.new_empty(0)
    compress = weight is not None
    dwp = _new((nprog, D, DV) if compress else (0,), x, dtype=acc_dtype(x))
    _update_bwd_kernel[(nprog,)](
        x, k, v, beta, rs, r, _chain(ks, betas, rss, rr), weight if compress else x, g, dh if compress else g,
        dx, dk, dv, dbeta, dwp, N, D,
        TOKENS=cfg["TOKENS"], PIPELINE=cfg.get("PIPELINE", False), DV=DV, BLOCK_D=_pow2(D),
        BLOCK_V=_pow2(DV), ERASE=erase, COMPRESS=compress, CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    dw = dwp.sum(0).to(weight.dtype) if compress else x.new_empty(0)
    return dx, dk, dv, dbeta, dw


@_update_bwd_op.register_fake
def _(x, k, v, beta, rs, r, weight, g, dh, erase, ks, betas, rss, rr):
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta), dw


def _update_setup(ctx, inputs, output):
    x, k, v, beta, weight, eps, erase = inputs
    ctx.save_for_backward(x, k, v, beta, output[2], output[3], weight)
    ctx.erase = erase


NO_CHAIN = ((), (), (), ())


def _update_grads_of(x, k, v, beta, rs, r, weight, gx, gh, erase, chain=NO_CHAIN):
    """(dx, dk, dv, dbeta, dweight or None) of ddl::update at x (or at x rebuilt from x0 = x by the updates
    chain = (ks, betas, rss, rr)), for the output gradients gx, gh."""
    gx = torch.zeros_like(x) if gx is None else gx.contiguous()
    if weight is not None:
        gh = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device) if gh is None else gh.contiguous()
    dx, dk, dv, dbeta, dw = _update_bwd_op(
        x, k, v, beta, rs, r, weight, gx, gh if weight is not None else None, erase, *map(list, chain)
    )
    return dx, dk, dv, dbeta, (dw if weight is not None else None)


def _update_backward(ctx, gx, gh, _grs, _gr):
    x, k, v, beta, rs, r, weight = ctx.saved_tensors
    return *_update_grads_of(x, k, v, beta, rs, r, weight, gx, gh, ctx.erase), None, None


torch.library.register_autograd("ddl::update", _update_backward, setup_context=_update_setup)


@torch.library.custom_op("ddl::cc", mutates_args=())
def _cc_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    N, D, DV = x.shape
    h = _new((N, D), x)
    cfg = LAUNCH["chan_fwd"]
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
    cfg = LAUNCH["chan_bwd"]
    grid = _chan_grid(N, D, {**cfg, "BLOCK_D": min(cfg["BLOCK_D"], _pow2(D))})
    dx = _new(x.shape, x)
    dwp = _new((grid[0], D, DV), x, dtype=acc_dtype(x))
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


def _chan_launch(a, wt, key):
    """(N, D, launch shape, grid, constexprs) of a per-channel kernel over a [N, d(, d_v)] with taps wt."""
    N, D = a.shape[0], a.shape[1]
    KW, DV = wt.shape[0], wt.shape[2]
    cfg = _cfg(key, a.dtype)
    bd = min(cfg["BLOCK_D"], _pow2(D))
    consts = dict(KW=KW, KP=_pow2(KW), DV=DV, BLOCK_D=bd, BLOCK_V=_pow2(DV), num_warps=cfg["num_warps"])
    return N, D, cfg, _chan_grid(N, D, {**cfg, "BLOCK_D": bd}), consts


def _tc_forward(x, wt, T):
    """h [N, d], the TC read-out of x [N, d, d_v] through taps wt [K, d, d_v]."""
    h = _new((x.shape[0], x.shape[1]), x)
    N, D, cfg, grid, consts = _chan_launch(x, wt, "tc_fwd")
    tokens, stages = cfg["TOKENS"], cfg["STAGES"]
    _tc_fwd_kernel[grid](x, wt, h, N, T, D, TOKENS=tokens, STAGES=stages, CT=_ct(x, wt), **consts)
    return h


def _ec_forward(emb, wt, T):
    """X0 [N, d, d_v], the EC expansion of emb [N, d] through taps wt [K, d, d_v]."""
    x0 = _new((emb.shape[0], emb.shape[1], wt.shape[2]), emb)
    N, D, cfg, grid, consts = _chan_launch(emb, wt, "chan_fwd")
    _ec_fwd_kernel[grid](emb, wt, x0, N, T, D, TOKENS=cfg["TOKENS"], CT=_ct(emb, wt), **consts)
    return x0


def _token_conv_op(name, forward, bwd_kernel, out_shape):
    """Registers `ddl::{name}(a, wt, T)` (a [N, d] or [N, d, d_v], wt [K, d, d_v] taps, T the sequence
    length), its backward op and its autograd, for the two causal depthwise convolutions over tokens,
    TC (a = the state, out [N, d]) and EC (a = the embedding, out [N, d, d_v]; out_shape(a, wt)):
    forward(a, wt, T) runs the forward; their backward kernels share a signature, a launch grid (a block
    of d by a run of tokens) and the weight gradient summed from per-program partials. Returns the
    forward op."""

    @torch.library.custom_op(f"ddl::{name}", mutates_args=())
    def op(a: torch.Tensor, wt: torch.Tensor, T: int) -> torch.Tensor:
        return forward(a, wt, T)

    @op.register_fake
    def _(a, wt, T):
        return a.new_empty(out_shape(a, wt))

    @torch.library.custom_op(f"ddl::{name}_bwd", mutates_args=())
    def op_bwd(
        a: torch.Tensor, wt: torch.Tensor, g: torch.Tensor, T: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        N, D, cfg, grid, consts = _chan_launch(a, wt, "chan_bwd")
        da = _new(a.shape, a)
        dwp = _new((grid[0],) + tuple(wt.shape), a, dtype=acc_dtype(a))  # weight-gradient partials
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


_tc_op = _token_conv_op("tc", _tc_forward, _tc_bwd_kernel, lambda x, wt: (x.shape[0], x.shape[1]))
_ec_op = _token_conv_op(
    "ec", _ec_forward, _ec_bwd_kernel, lambda emb, wt: (emb.shape[0], emb.shape[1], wt.shape[2])
)


@torch.library.custom_op("ddl::update_tc", mutates_args=())
def _update_tc_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, wt: torch.Tensor, T: int,
    eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _update_with_read(x, k, v, beta, None, wt, T, eps, erase)


@_update_tc_op.register_fake
def _(x, k, v, beta, wt, T, eps, erase):
    return _fake_update_with_read(x, None, wt)


@torch.library.custom_op("ddl::update_tc_bwd", mutates_args=())
def _update_tc_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rs: torch.Tensor, r: torch.Tensor,
    wt: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, T: int, erase: bool, ks: list[torch.Tensor],
    betas: list[torch.Tensor], rss: list[torch.Tensor], rr: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    KW = wt.shape[0]
    chain = _chain(ks, betas, rss, rr)
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    ct = _ct(x, k, v, beta, g)
    bcfg = LAUNCH["tc_bwd"]
    _update_tc_bwd_kernel[(triton.cdiv(N, bcfg["TOKENS"]),)](
        x, k, v, beta, rs, r, chain, wt, g, dh, dx, dk, dv, dbeta, N, T, D, TOKENS=bcfg["TOKENS"], KW=KW,
        DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV), ERASE=erase, CT=ct, num_warps=bcfg["num_warps"],
    )  # fmt: skip
    cfg = LAUNCH["chan_bwd"]
    bd = min(cfg["BLOCK_D"], _pow2(D))
    grid = _chan_grid(N, D, {**cfg, "BLOCK_D": bd})
    dwp = _new((grid[0], KW, D, DV), x, dtype=rs.dtype)
    _update_tc_wgrad_kernel[grid](
        x, k, beta, rs, r, chain, dh, dwp, N, T, D, cfg["TOKENS"], KW=KW, KP=_pow2(KW), DV=DV, BLOCK_D=bd,
        BLOCK_V=_pow2(DV), CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dx, dk, dv, dbeta, dwp.sum(0).to(wt.dtype)


@_update_tc_bwd_op.register_fake
def _(x, k, v, beta, rs, r, wt, g, dh, T, erase, ks, betas, rss, rr):
    return (
        torch.empty_like(x),
        torch.empty_like(k),
        torch.empty_like(v),
        torch.empty_like(beta),
        torch.empty_like(wt),
    )


def _update_tc_setup(ctx, inputs, output):
    x, k, v, beta, wt, T, eps, erase = inputs
    ctx.save_for_backward(x, k, v, beta, output[2], output[3], wt)
    ctx.T, ctx.erase = T, erase


def _update_tc_grads_of(x, k, v, beta, rs, r, wt, gx, gh, T, erase, chain=NO_CHAIN):
    """(dx, dk, dv, dbeta, dwt) of ddl::update_tc at x (or rebuilt from it, as _update_grads_of), for the
    output gradients gx, gh."""
    gx = torch.zeros_like(x) if gx is None else gx.contiguous()
    gh = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device) if gh is None else gh.contiguous()
    return _update_tc_bwd_op(x, k, v, beta, rs, r, wt, gx, gh, T, erase, *map(list, chain))


def _update_tc_backward(ctx, gx, gh, _grs, _gr):
    x, k, v, beta, rs, r, wt = ctx.saved_tensors
    return *_update_tc_grads_of(x, k, v, beta, rs, r, wt, gx, gh, ctx.T, ctx.erase), None, None, None


torch.library.register_autograd("ddl::update_tc", _update_tc_backward, setup_context=_update_tc_setup)


def _update_with_read(x, k, v, beta, weight, wt, T, eps, erase):
    """The forward of ddl::update (wt None; weight: the CC read-out or None) or of ddl::update_tc (wt: the
    TC taps), as plain code for the ops to share: (x_new, h, rs, r); h is empty without a read-out."""
    x_new, h, rs, r = _update_forward(x, k, v, beta, weight, eps, erase)
    if wt is not None:
        h = _tc_forward(x_new, wt, T)
    return x_new, h, rs, r


def _fake_update_with_read(x, weight, wt):
    x_new, h, rs, r = _fake_update_forward(x, weight)
    return x_new, (x.new_empty(x.shape[:2]) if wt is not None else h), rs, r


# An update on a state x that earlier updates made from x0 (rebuild_from): the same forward as ddl::update
# (wt None) or ddl::update_tc, but autograd keeps x0 and the earlier updates' (k, beta, rs, r), which their
# own ops keep anyway, instead of x: the backward kernels rebuild x in registers as they load it (the same
# reads of the state, plus each earlier update's k). Fewer states stay alive for the backward.
@torch.library.custom_op("ddl::update_rebuilt", mutates_args=())
def _update_rebuilt_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor | None,
    wt: torch.Tensor | None, T: int, x0: torch.Tensor, ks: list[torch.Tensor], betas: list[torch.Tensor],
    rss: list[torch.Tensor], rr: list[torch.Tensor], eps: float, erase: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _update_with_read(x, k, v, beta, weight, wt, T, eps, erase)


@_update_rebuilt_op.register_fake
def _(x, k, v, beta, weight, wt, T, x0, ks, betas, rss, rr, eps, erase):
    return _fake_update_with_read(x, weight, wt)


def _update_rebuilt_setup(ctx, inputs, output):
    x, k, v, beta, weight, wt, T, x0, ks, betas, rss, rr, eps, erase = inputs
    ctx.save_for_backward(k, v, beta, output[2], output[3], weight, wt, x0, *ks, *betas, *rss, *rr)
    ctx.T, ctx.erase, ctx.steps = T, erase, len(ks)


def _update_rebuilt_backward(ctx, gx, gh, _grs, _gr):
    k, v, beta, rs, r, weight, wt, x0, *saved = ctx.saved_tensors
    n = ctx.steps
    chain = tuple(saved[i * n : (i + 1) * n] for i in range(4))
    if wt is not None:
        dx, dk, dv, dbeta, dwt = _update_tc_grads_of(
            x0, k, v, beta, rs, r, wt, gx, gh, ctx.T, ctx.erase, chain
        )
        dw = None
    else:
        dx, dk, dv, dbeta, dw = _update_grads_of(x0, k, v, beta, rs, r, weight, gx, gh, ctx.erase, chain)
        dwt = None
    no_grads = [None] * n  # the earlier updates get theirs from their own ops
    return dx, dk, dv, dbeta, dw, dwt, None, None, no_grads, no_grads, no_grads, no_grads, None, None


torch.library.register_autograd(
    "ddl::update_rebuilt", _update_rebuilt_backward, setup_context=_update_rebuilt_setup
)


# ----------------------------------------------------------------------------------------------------
# The public functions' Triton branch (kernels/ddl/__init__.py checks the arguments): flatten, call the op.


def _flat(x, k, v, beta):
    """The update's arguments as the ops take them: x [N, d, d_v], k [N, d], v [N, d_v], beta [N]."""
    d, dv = x.shape[-2:]
    return (
        x.reshape(-1, d, dv).contiguous(),
        k.reshape(-1, d).contiguous(),
        v.reshape(-1, dv).contiguous(),
        beta.reshape(-1).contiguous(),
    )


def _tap_weights(conv_weight, read=None):
    """A [d, d_v, K] conv weight as [K, d, d_v] taps, with the read-out [d_v] folded in (a tiny tensor;
    autograd carries its gradient to conv_weight and read)."""
    if read is not None:
        conv_weight = conv_weight * read[None, :, None]
    return conv_weight.permute(2, 0, 1).contiguous()


def _update_any(x, k, v, beta, weight, wt, T, eps, erase, rebuild_from):
    """(x_new, h, step) of the update (+ CC read-out with weight, + TC read-out with taps wt), through the op
    that keeps x for the backward, or, given rebuild_from = (x0, steps) with x made from x0 by the updates
    steps = ((k0, beta0, rs0, r0), ...), the op that rebuilds x there; step = (k, beta, rs, r), this
    update's for a later rebuild_from."""
    flat, eps, erase = _flat(x, k, v, beta), float(eps), bool(erase)
    d, dv = x.shape[-2:]
    if rebuild_from is not None:
        x0, steps = rebuild_from
        shapes = ((-1, d), (-1,), (-1,), (-1, dv))  # a step's k, beta, rs and r, flat
        chain = [[s[i].reshape(shape).contiguous() for s in steps] for i, shape in enumerate(shapes)]
        out = _update_rebuilt_op(*flat, weight, wt, T, x0.reshape(-1, d, dv).contiguous(), *chain, eps, erase)
    else:
        out = (
            _update_tc_op(*flat, wt, T, eps, erase)
            if wt is not None
            else _update_op(*flat, weight, eps, erase)
        )
    lead = x.shape[:-2]
    return out[0].view(x.shape), out[1], (k, beta, out[2].view(lead), out[3].view(*lead, dv))


def update(x, k, v, beta, eps, erase, rebuild_from=None):
    x_new, _, step = _update_any(x, k, v, beta, None, None, 0, eps, erase, rebuild_from)
    return x_new, step


def update_compress_cc(x, k, v, beta, weight, eps, erase, rebuild_from=None):
    B, T, d, _ = x.shape
    x_new, h, step = _update_any(x, k, v, beta, weight.contiguous(), None, T, eps, erase, rebuild_from)
    return x_new, h.view(B, T, d), step


def update_compress_tc(x, k, v, beta, conv_weight, read, eps, erase, rebuild_from=None):
    B, T, d, _ = x.shape
    wt = _tap_weights(conv_weight, read)
    x_new, h, step = _update_any(x, k, v, beta, None, wt, T, eps, erase, rebuild_from)
    return x_new, h.view(B, T, d), step


def compress_cc(x, weight):
    B, T, d, dv = x.shape
    return _cc_op(x.reshape(-1, d, dv).contiguous(), weight.contiguous()).view(B, T, d)


def compress_tc(x, conv_weight, read):
    B, T, d, dv = x.shape
    return _tc_op(x.reshape(-1, d, dv).contiguous(), _tap_weights(conv_weight, read), T).view(B, T, d)


def expand_ec(emb, conv_weight):
    B, T, d = emb.shape
    x0 = _ec_op(emb.reshape(-1, d).contiguous(), _tap_weights(conv_weight), T)
    return x0.view(B, T, d, conv_weight.shape[1])
