"""The DDL update's Triton kernels: forward (+ the fused CC read-out), backward (+ its weight gradient), the
d_v = 1 row kernels, and the update fused with the TC read-out (forward, backward). One program owns whole
tokens (the update reduces over d); the forward stores rs and r for the backward, and a state rebuilt from
an earlier one goes through the chain of the updates since (`_rebuilt_state`). The TC backward runs in two
kernels: the one reduction over d per token (`_update_tc_gk_kernel`), then programs of a run of tokens by
a block of d (`_update_tc_bwd_kernel`). Launched from triton.py."""

import triton
import triton.language as tl

from .triton_common import (
    _chan_tile,
    _read_out_grad,
    _store_taps,
    _stored,
    _taps,
    _tc_read_out_grads,
    _tc_read_out_keeps,
    _tc_read_out_start,
    _tc_read_out_step,
    _token_tile,
    _vec_mask,
    _zeros_each,
)


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
def _rebuilt_state(x, n, ok, CHAIN, D, offs_d, offs_v, md, mv, idx, DV: tl.constexpr, CT: tl.constexpr,
                   OUT_T: tl.constexpr, SR: tl.constexpr):  # fmt: skip
    """x0 (a tile of token n, its elements' state indices idx) through the updates of CHAIN = (ks, betas,
    rss, rr, seeds), each update's k, beta, stored rs and r, and seed: x + beta khat r^T each, rounded to the
    state's dtype OUT_T as the forward stored it (empty tuples: x unchanged)."""
    ks, bs, rss, rr, seeds = CHAIN
    for i in tl.static_range(len(ks)):
        x = _rebuilt_update(x, n, ok, ks[i], bs[i], rss[i], rr[i], D, offs_d, offs_v, md, mv, DV, CT)
        x = _stored(x, seeds[i], idx, OUT_T, SR).to(CT)
    return x


@triton.jit
def _update_bwd_inputs(
    n, ok, X, Kd, V, BETA, RS, R, CHAIN, D, offs_d, offs_v, md, mv, off2, DV: tl.constexpr, CT: tl.constexpr,
    SR: tl.constexpr,
):  # fmt: skip
    """What the backward of token n's update reads (zeros where ok, a scalar condition, is false): its
    masks, the state x (X holds x0 and x is rebuilt through CHAIN, see _rebuilt_state), the update's
    stored terms (_stored_update_terms) and its value v."""
    okd = _vec_mask(ok, offs_d)
    m2 = (md & okd)[:, None] & mv[None, :]
    x = tl.load(X + n * D * DV + off2, mask=m2, other=0.0).to(CT)
    idx = n * D * DV + off2
    x = _rebuilt_state(x, n, ok, CHAIN, D, offs_d, offs_v, md, mv, idx, DV, CT, X.dtype.element_ty, SR)
    rs, kh, b, r = _stored_update_terms(n, ok, Kd, BETA, RS, R, D, offs_d, offs_v, md, mv, DV, CT)
    v = tl.load(V + n * DV + offs_v, mask=mv & _vec_mask(ok, offs_v), other=0.0).to(CT)
    return okd, m2, rs, kh, x, b, r, v


@triton.jit
def _update_grads(g, x, kh, rs, b, r, v, ERASE: tl.constexpr):
    """The update's backward for one token, given G = dL/dx' (formulas in `_update_bwd_token`):
    dx, dk, dv, dbeta. One reduction over d (khat^T G): khat . dkhat follows from it and the stored r."""
    gk = tl.sum(kh[:, None] * g, axis=0)  # khat^T G  [d_v]
    dx, dk = _update_dx_dk(g, x, kh, rs, b, r, v, gk, ERASE)
    return dx, dk, b * gk, tl.sum(gk * r, axis=0)


@triton.jit
def _update_dx_dk(g, x, kh, rs, b, r, v, gk, ERASE: tl.constexpr):
    # dx and dk of one token given gk = khat^T G: elementwise in d (g, x, kh: all of d or a block of it)
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
    return dx, rs * (dkh - kh * kdk)


@triton.jit
def _store_update_grads(n, ok, okd, m2, off2, dx, dk, dv, dbeta, DX, DK, DVo, DBETA, D, offs_d, offs_v, md,
                        mv, DV: tl.constexpr):  # fmt: skip
    tl.store(DX + n * D * DV + off2, dx.to(DX.dtype.element_ty), mask=m2)
    tl.store(DK + n * D + offs_d, dk.to(DK.dtype.element_ty), mask=md & okd)
    okv = _vec_mask(ok, offs_v)
    tl.store(DVo + n * DV + offs_v, dv.to(DVo.dtype.element_ty), mask=mv & okv)
    tl.store(DBETA + n, dbeta.to(DBETA.dtype.element_ty), mask=ok)


@triton.jit
def _update_token(
    X, Kd, V, BETA, XOUT, RS, R, SEED, n, ok, store, D, eps, offs_d, offs_v, md, mv, off2,
    DV: tl.constexpr, ERASE: tl.constexpr, SR: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # token n's update (ok: n is a token): x' as stored, and where `store`, x', rs and r stored; returns x'
    # and `store` as a mask over d
    okd, okv = _vec_mask(ok, offs_d), _vec_mask(ok, offs_v)
    x = tl.load(X + n * D * DV + off2, mask=(md & okd)[:, None] & mv[None, :], other=0.0).to(CT)
    rs, kh, b, r = _token_update_terms(
        n, ok, okd, okv, x, Kd, V, BETA, D, eps, offs_d, offs_v, md, mv, DV, ERASE, CT
    )
    xn = _stored(x + b * kh[:, None] * r[None, :], SEED, n * D * DV + off2, XOUT.dtype.element_ty, SR)
    stored = _vec_mask(store, offs_d)
    tl.store(XOUT + n * D * DV + off2, xn, mask=(md & stored)[:, None] & mv[None, :])
    tl.store(R + n * DV + offs_v, r, mask=mv & _vec_mask(store, offs_v))
    tl.store(RS + n, rs, mask=store)
    return xn, stored


@triton.jit
def _update_fwd_kernel(
    X, Kd, V, BETA, W, XOUT, H, RS, R, SEED, N, D, eps,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
    ERASE: tl.constexpr, COMPRESS: tl.constexpr, SR: tl.constexpr, CT: tl.constexpr,
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
        xn, okd = _update_token(
            X, Kd, V, BETA, XOUT, RS, R, SEED, n, ok, ok, D, eps, offs_d, offs_v, md, mv, off2, DV, ERASE,
            SR, CT,
        )  # fmt: skip
        if COMPRESS:  # the next sublayer's CC read-out of the state just written (as stored)
            h = tl.sum(xn.to(CT) * w, axis=1)
            tl.store(H + n * D + offs_d, h.to(H.dtype.element_ty), mask=md & okd)


@triton.jit
def _update_tc_fwd_kernel(
    X, Kd, V, BETA, WT, XOUT, H, RS, R, SEED, DS, N, T, D, eps, TOKENS,
    KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, ERASE: tl.constexpr,
    SR: tl.constexpr, STAGES: tl.constexpr, DOC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # The update and the next sublayer's TC read-out of x' in one pass over the state: a program takes a run
    # of TOKENS whole tokens in order, as _update_fwd_kernel's, the read-outs in flight as _tc_fwd_kernel's.
    # The KW-1 tokens before the run only feed its read-outs: their updates are recomputed (the same
    # arithmetic, so the same x' as their own program stores), not stored. The taps stay in registers:
    # loaded at every token, the pipeliner would copy all of them from L2 to shared memory each time. DOC:
    # the read-outs within each token's document (DS [N], doc_start), as _tc_fwd_kernel's.
    pid = tl.program_id(0).to(tl.int64)
    offs_d, offs_v, md, mv, off2 = _token_tile(D, DV, BLOCK_D, BLOCK_V)
    m2w = md[:, None] & mv[None, :]
    taps = _taps(WT, off2, m2w, D, DV, KW, CT)
    acc = _tc_read_out_start(BLOCK_D, KW, CT)
    for i in tl.range(0, TOKENS + KW - 1, num_stages=STAGES):
        s = pid * TOKENS - (KW - 1) + i
        ok = (s >= 0) & (s < N)
        own = ok & (s >= pid * TOKENS)
        xn, ownd = _update_token(
            X, Kd, V, BETA, XOUT, RS, R, SEED, s, ok, own, D, eps, offs_d, offs_v, md, mv, off2, DV, ERASE,
            SR, CT,
        )  # fmt: skip
        keeps = _tc_read_out_keeps(s, DS, T, N, KW, DOC)
        h, acc = _tc_read_out_step(taps, acc, xn.to(CT), _vec_mask(s % T == 0, offs_d), keeps, DOC)
        tl.store(H + s * D + offs_d, h.to(H.dtype.element_ty), mask=md & ownd)


@triton.jit
def _cc_read_out_grads(g, x, kh, b, r, w, n, DH, SEED, idx, D, offs_d, md, okd, CT: tl.constexpr,
                       OUT_T: tl.constexpr, SR: tl.constexpr):  # fmt: skip
    # the fused CC read-out h = x' w of token n: G + dh w^T, and the token's dh x'^T for dw (x' as stored)
    dh = tl.load(DH + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
    xn = _stored(x + b * kh[:, None] * r[None, :], SEED, idx, OUT_T, SR).to(CT)
    return g + dh[:, None] * w, dh[:, None] * xn


@triton.jit
def _update_bwd_token(
    n, X, Kd, V, BETA, RS, R, CHAIN, w, G, DH, DX, DK, DVo, DBETA, SEED, N, D, offs_d, offs_v, md, mv, off2,
    DV: tl.constexpr, ERASE: tl.constexpr, COMPRESS: tl.constexpr, SR: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # One token of the backward; returns its contribution dh xn^T to the CC weight gradient.
    # x' = x + b khat r^T, r = v - x^T khat.  With G = dL/dx' (+ dh w^T from the fused read-out):
    # dx = G - b khat (khat^T G);  dv = b G^T khat;  dbeta = r . (G^T khat);
    # dkhat = b (G r - x G^T khat);  dk = (dkhat - khat (khat . dkhat)) / sqrt(|k|^2 + eps^2).
    ok = n < N
    okd, m2, rs, kh, x, b, r, v = _update_bwd_inputs(
        n, ok, X, Kd, V, BETA, RS, R, CHAIN, D, offs_d, offs_v, md, mv, off2, DV, CT, SR
    )
    g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
    dw = w * 0.0
    if COMPRESS:
        g, dw = _cc_read_out_grads(
            g, x, kh, b, r, w, n, DH, SEED, n * D * DV + off2, D, offs_d, md, okd, CT, X.dtype.element_ty, SR
        )
    dx, dk, dv, dbeta = _update_grads(g, x, kh, rs, b, r, v, ERASE)
    _store_update_grads(
        n, ok, okd, m2, off2, dx, dk, dv, dbeta, DX, DK, DVo, DBETA, D, offs_d, offs_v, md, mv, DV
    )
    return dw


@triton.jit
def _update_bwd_kernel(
    X, Kd, V, BETA, RS, R, CHAIN, W, G, DH, DX, DK, DVo, DBETA, DWP, SEED, N, D,
    TOKENS: tl.constexpr, STAGES: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr, ERASE: tl.constexpr, COMPRESS: tl.constexpr, SR: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # TOKENS tokens per program (the CC weight gradient is summed over them in registers), in a plain loop
    # (STAGES 1: one token's loads in flight at a time) or a software-pipelined one.
    pid = tl.program_id(0).to(tl.int64)
    offs_d, offs_v, md, mv, off2 = _token_tile(D, DV, BLOCK_D, BLOCK_V)
    if COMPRESS:
        w = tl.load(W + off2, mask=md[:, None] & mv[None, :], other=0.0).to(CT)
    else:
        w = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
    dw = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
    for tt in tl.range(0, TOKENS, num_stages=STAGES):
        dw += _update_bwd_token(
            pid * TOKENS + tt, X, Kd, V, BETA, RS, R, CHAIN, w, G, DH, DX, DK, DVo, DBETA, SEED, N, D,
            offs_d, offs_v, md, mv, off2, DV, ERASE, COMPRESS, SR, CT,
        )  # fmt: skip
    if COMPRESS:
        tl.store(DWP + pid * D * DV + off2, dw, mask=md[:, None] & mv[None, :])


@triton.jit
def _update_tc_gk_kernel(
    Kd, BETA, RS, R, WT, G, DH, GK, DVo, DBETA, DS, N, T, D,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, KW: tl.constexpr, STAGES: tl.constexpr,
    DOC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # The TC backward's reduction over d, one token n a program: gk = khat^T G [d_v] with G + sum_j WT[j]
    # dh[n + KW-1 - j] (the read-outs of tokens n .. n+KW-1 of n's sequence read x'[n]; DOC: of those
    # whose document n is in, DS [N]), a [BLOCK_D, d_v]
    # tile at a time, as _update_tc_bwd_kernel's (its [BLOCK_D] vectors in the tile's layout: no
    # shared-memory round trip); the sum over d waits for the end. It needs neither x nor the chain. With gk,
    # the token's dv = beta gk and dbeta = gk . r, stored here once.
    n = tl.program_id(0).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_V)
    mv = offs_v < DV
    rs = tl.load(RS + n).to(CT)
    acc = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        md = offs_d < D
        m2 = md[:, None] & mv[None, :]
        off2 = offs_d[:, None] * DV + offs_v[None, :]
        kh = tl.load(Kd + n * D + offs_d, mask=md, other=0.0).to(CT) * rs
        g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        for j in tl.static_range(KW):
            dh = _read_out_grad(n, j, DH, T, N, D, offs_d, md, KW, CT, DS, DOC)
            g += tl.load(WT + j * D * DV + off2, mask=m2, other=0.0).to(CT) * dh
        acc += kh[:, None] * g
    gk = tl.sum(acc, axis=0)
    b = tl.load(BETA + n).to(CT)
    r = tl.load(R + n * DV + offs_v, mask=mv, other=0.0).to(CT)
    tl.store(GK + n * DV + offs_v, gk.to(GK.dtype.element_ty), mask=mv)
    tl.store(DVo + n * DV + offs_v, (b * gk).to(DVo.dtype.element_ty), mask=mv)
    tl.store(DBETA + n, tl.sum(gk * r, axis=0).to(DBETA.dtype.element_ty))


@triton.jit
def _update_tc_bwd_kernel(
    X, Kd, V, BETA, RS, R, CHAIN, WT, G, DH, GK, DX, DK, DWP, SEED, DS, N, T, D, TOKENS,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, ERASE: tl.constexpr, KW: tl.constexpr,
    SR: tl.constexpr, STAGES: tl.constexpr, DOC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # The TC backward's elementwise part, after _update_tc_gk_kernel: a run of TOKENS tokens by a block of d
    # (x rebuilt through CHAIN per block), dx and dk from the stored gk without a reduction over d, so a
    # program's tile is BLOCK_D x d_v rather than a token's d x d_v; the taps' gradient as partials summed
    # over the run. STAGES > 1: the next tokens' loads in flight (software-pipelined). DOC: as the gk kernel.
    pid, offs_d, offs_v, md, mv, m2w, off2 = _chan_tile(D, DV, BLOCK_D, BLOCK_V)
    taps = _taps(WT, off2, m2w, D, DV, KW, CT)
    dw = _zeros_each(taps)
    for tt in tl.range(0, TOKENS, num_stages=STAGES):
        n = pid * TOKENS + tt
        ok = n < N
        okd, m2, rs, kh, x, b, r, v = _update_bwd_inputs(
            n, ok, X, Kd, V, BETA, RS, R, CHAIN, D, offs_d, offs_v, md, mv, off2, DV, CT, SR
        )
        g = tl.load(G + n * D * DV + off2, mask=m2, other=0.0).to(CT)
        xn = _stored(x + b * kh[:, None] * r[None, :], SEED, n * D * DV + off2, X.dtype.element_ty, SR)
        xn = xn.to(CT)  # x'[n] as stored
        gx, dw = _tc_read_out_grads(
            taps, dw, xn, n, DH, T, N, D, offs_d, md, KW, CT, DS, DOC
        )  # x'[n]'s reads
        g += gx
        gk = tl.load(GK + n * DV + offs_v, mask=mv & _vec_mask(ok, offs_v), other=0.0).to(CT)
        dx, dk = _update_dx_dk(g, x, kh, rs, b, r, v, gk, ERASE)
        tl.store(DX + n * D * DV + off2, dx.to(DX.dtype.element_ty), mask=m2)
        tl.store(DK + n * D + offs_d, dk.to(DK.dtype.element_ty), mask=md & okd)
    _store_taps(DWP + pid * KW * D * DV, dw, off2, m2w, D, DV)


@triton.jit
def _row_tile(X, Kd, BETA, N, D, start, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CT: tl.constexpr):
    # d_v = 1 row kernels: tokens start .. start + ROWS - 1 as a [ROWS, d] tile; the loaded k, x and beta
    rows = start + tl.arange(0, ROWS)
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
    X, Kd, V, BETA, XOUT, RS, R, NW, A, C, Z, INV, SEED, N, D, eps, norm_eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ERASE: tl.constexpr, NORM: tl.constexpr, SR: tl.constexpr,
    CT: tl.constexpr, M: tl.constexpr = 2,
):  # fmt: skip
    # d_v = 1: the state is a d-vector per token, so a program takes ROWS tokens as a [ROWS, d] tile
    # (like a layer norm) instead of one [d, 1] tile per token; rs and r stored as _update_fwd_kernel's.
    # NORM: also the next sublayer's read of x' (as stored): INV = 1 / rms(x') [N], C = x' INV NW [N, d] in
    # C's dtype, Z = x' A^T [N, M] for A [M, d], M = 1 or 2 (v's logit, and beta's where the rule has one).
    rows, mr, m2, off, k, x, b = _row_tile(X, Kd, BETA, N, D, tl.program_id(0).to(tl.int64) * ROWS, ROWS,
                                           BLOCK_D, CT)  # fmt: skip
    rs = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + eps * eps)
    kh = k * rs[:, None]
    r = tl.load(V + rows, mask=mr, other=0.0).to(CT)
    if ERASE:
        r = r - tl.sum(kh * x, axis=1)
    xn = _stored(x + (b * r)[:, None] * kh, SEED, off, XOUT.dtype.element_ty, SR)
    tl.store(XOUT + off, xn, mask=m2)
    tl.store(RS + rows, rs, mask=mr)
    tl.store(R + rows, r, mask=mr)
    if NORM:
        xn = xn.to(CT)
        cols = tl.arange(0, BLOCK_D)
        inv = 1.0 / tl.sqrt(tl.sum(xn * xn, axis=1) / D + norm_eps)
        w = tl.load(NW + cols, mask=cols < D, other=0.0).to(CT)
        tl.store(C + off, (xn * inv[:, None] * w[None, :]).to(C.dtype.element_ty), mask=m2)
        tl.store(INV + rows, inv, mask=mr)
        for m in tl.static_range(M):
            a = tl.load(A + m * D + cols, mask=cols < D, other=0.0).to(CT)
            tl.store(Z + rows * M + m, tl.sum(xn * a[None, :], axis=1), mask=mr)


@triton.jit
def _update_row_bwd_kernel(
    X, Kd, V, BETA, RS, R, G, DX, DK, DVo, DBETA, NW, A, INV, DC, DZ, DINV, DWP, SEED, N, D,
    ROWS: tl.constexpr, STEPS: tl.constexpr, BLOCK_D: tl.constexpr, ERASE: tl.constexpr, NORM: tl.constexpr,
    SR: tl.constexpr, CT: tl.constexpr, M: tl.constexpr = 2,
):  # fmt: skip
    # _update_bwd_token with d_v = 1 (r, gk scalars per token), STEPS tiles of ROWS tokens per program.
    # NORM: G also gets the gradient of the forward's read (DC, DZ, DINV of C, Z, INV), and DWP [programs,
    # 1 + M, d] the program's partial sums of NW's and A's gradients (A [M, d], M = 1 or 2).
    cols = tl.arange(0, BLOCK_D)
    mc = cols < D
    if NORM:
        w = tl.load(NW + cols, mask=mc, other=0.0).to(CT)
        a0 = tl.load(A + cols, mask=mc, other=0.0).to(CT)
        dw = tl.zeros([BLOCK_D], dtype=CT)
        da0 = tl.zeros([BLOCK_D], dtype=CT)
        if M == 2:
            a1 = tl.load(A + D + cols, mask=mc, other=0.0).to(CT)
            da1 = tl.zeros([BLOCK_D], dtype=CT)
    for step in range(STEPS):
        start = (tl.program_id(0).to(tl.int64) * STEPS + step) * ROWS
        rows, mr, m2, off, k, x, b = _row_tile(X, Kd, BETA, N, D, start, ROWS, BLOCK_D, CT)
        rs = tl.load(RS + rows, mask=mr, other=0.0).to(CT)
        r = tl.load(R + rows, mask=mr, other=0.0).to(CT)
        kh = k * rs[:, None]
        g = tl.load(G + off, mask=m2, other=0.0).to(CT)
        if NORM:  # d/dx' of C = x' inv w, Z = x' A^T and INV = 1 / sqrt(mean(x'^2) + norm_eps)
            xn = _stored(x + (b * r)[:, None] * kh, SEED, off, X.dtype.element_ty, SR).to(CT)  # x' as stored
            inv = tl.load(INV + rows, mask=mr, other=0.0).to(CT)
            dc = tl.load(DC + off, mask=m2, other=0.0).to(CT)
            dz0 = tl.load(DZ + rows * M, mask=mr, other=0.0).to(CT)
            dinv = tl.load(DINV + rows, mask=mr, other=0.0).to(CT)
            s = tl.sum(dc * w[None, :] * xn, axis=1) + dinv  # d/dinv of everything
            if M == 2:
                dz1 = tl.load(DZ + rows * 2 + 1, mask=mr, other=0.0).to(CT)
                g += inv[:, None] * w[None, :] * dc + dz0[:, None] * a0[None, :] + dz1[:, None] * a1[None, :]
                da1 += tl.sum(dz1[:, None] * xn, axis=0)
            else:
                g += inv[:, None] * w[None, :] * dc + dz0[:, None] * a0[None, :]
            g -= (inv * inv * inv * s / D)[:, None] * xn
            dw += tl.sum(dc * xn * inv[:, None], axis=0)
            da0 += tl.sum(dz0[:, None] * xn, axis=0)
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
    if NORM:
        base = DWP + tl.program_id(0).to(tl.int64) * (1 + M) * D + cols
        tl.store(base, dw, mask=mc)
        tl.store(base + D, da0, mask=mc)
        if M == 2:
            tl.store(base + 2 * D, da1, mask=mc)
