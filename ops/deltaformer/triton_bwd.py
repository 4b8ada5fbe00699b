"""Deltaformer stage 1, backward kernels (triton.py's docstring): `_bwd_g_kernel`, the reversed wavefront for
G (dV) and dbeta (and dK at small head dims); `_dk_dw_kernel`, the dK and dW passes. DS (doc_start
[B, T], or None): A within each row's document; the pairs of chunks no row of which sees a column of the
other are skipped (ENDS [B, NC]: the row chunks from ENDS[b, c] on see no column of chunk c)."""

import triton
import triton.language as tl

from .triton_common import (
    _doc_starts,
    _dscores,
    _first_chunk,
    _inv_norms,
    _kappa,
    _key_grad,
    _load_published,
    _load_value,
    _mm,
    _mm_rec,
    _scaled,
    _store_split,
    _wait_progress,
    _wavefront_tile,
)


@triton.jit
def _bwd_g_kernel(
    W, K, NW, NK, DU, Beta, Hs, LSE, Xinv, GB, GBLO, DV, DBeta, RT, Prog, Ticket, U, ULO, DK, scale, T, NC,
    BH, DS, ENDS, H, KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr, SPIN_LIMIT: tl.constexpr, DKW: tl.constexpr,
    LOWP: tl.constexpr,
):  # fmt: skip
    """G_c for one column chunk c (module docstring). DKW (D <= 64, `_u_bwd`): also
    dK_c = s sum_{i >= c} dS_ic^T w_i, from the S and A of the pairs this program forms anyway (then
    the dK pass is not launched; a chunk's row term is stored before its release, as its readers are
    in this launch)."""
    c, bh, bh64, offs_c, offs_d, cols, cmask, tile = _wavefront_tile(Ticket, T, NC, BH, D, C, True)
    k_c = tl.load(K + tile, mask=cmask[:, None], other=0.0)
    rk = _inv_norms(NK, bh64 * T + cols, cmask, NORM)
    xt = Xinv + (bh64 * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :]
    x = tl.load(xt)
    du_c = tl.load(DU + tile, mask=cmask[:, None], other=0.0).to(tl.float32)
    b_c = tl.load(Beta + bh64 * T + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((C, D), dtype=tl.float32)  # sum_{i in later chunks} A_ij beta_i G_i
    dk = tl.zeros((C, D), dtype=tl.float32)
    if DKW:
        u_c = _load_value(U, ULO, tile, cmask[:, None], LOWP, SPLIT)
    done = c * 0  # later chunks consumed, counted from the end
    ok = done + 1
    skip = 0
    if DS is not None:  # the first later chunks consumed (the last rows) that see none of these columns
        skip = NC - tl.load(ENDS + (bh64 // H) * NC + c)
    while done < NC - 1 - c:
        seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT)
        ok = ok & (seen > done).to(tl.int32)
        ready = tl.where(seen > done, tl.minimum(seen, NC - 1 - c), NC - 1 - c)
        lo = done
        if DS is not None:  # (the skipped ones still waited for: tiles publish in order)
            lo = tl.maximum(done, skip)
        for it in range(lo, ready):
            rows = (NC - 1 - it) * C + offs_c  # a later chunk, in the order they were published
            rmask = rows < T
            later = bh64 * T * D + rows[:, None] * D + offs_d[None, :]
            valid = rmask[:, None]
            if DS is not None:
                valid = valid & (cols[None, :] >= _doc_starts(DS, bh64, H, T, rows, rmask)[:, None])
            w_r, rw, s, a = _later_scores(
                W, NW, LSE, later, bh64 * T + rows, rmask, valid, k_c, rk, scale, C, KERNEL, NORM, PREC
            )  # fmt: skip
            gb_hi, gb_lo = _load_published(GB, GBLO, later, rmask[:, None], SPLIT)
            acc += _mm_rec(tl.trans(a), gb_hi, gb_lo, W, SPLIT, PREC)
            if DKW:
                ds = _pair_ds(a, s, gb_hi, gb_lo, u_c, RT, bh64 * T + rows, rmask, valid, W,
                              C, KERNEL, LOWP, SPLIT, PREC)  # fmt: skip
                dk = _dk_terms(dk, ds, rw, w_r, W, LOWP, PREC, NORM)
        done = ready
    g_c = tl.dot(tl.trans(x), du_c - acc, input_precision=XPREC)
    g_c = tl.where(ok != 0, g_c, float("nan"))
    gb_c = g_c * b_c[:, None]
    _store_split(GB, GBLO, tile, gb_c, cmask[:, None], SPLIT)
    if DKW:  # the other tiles' dK reads this chunk's row term: before the release
        h_c, rt_c = _row_term(Hs, RT, tile, bh64 * T + cols, gb_c, cmask)
    tl.debug_barrier()
    tl.atomic_xchg(Prog + bh, NC - c, sem="release")
    # off the critical path
    tl.store(DV + tile, g_c.to(DV.dtype.element_ty), mask=cmask[:, None])
    if not DKW:
        h_c, rt_c = _row_term(Hs, RT, tile, bh64 * T + cols, gb_c, cmask)
    tl.store(DBeta + bh64 * T + cols, (-tl.sum(g_c * h_c, axis=1)).to(DBeta.dtype.element_ty), mask=cmask)
    if DKW:  # the diagonal block: rows and columns in chunk c, j < i
        w_c = tl.load(W + tile, mask=cmask[:, None], other=0.0)
        lse_c = tl.zeros((C,), dtype=tl.float32)
        if KERNEL == 0:
            lse_c = tl.load(LSE + bh64 * T + cols, mask=cmask, other=0.0)
        gb_own = gb_c
        if LOWP:  # as the dK pass reads it: the stored half
            gb_own = gb_c.to(W.dtype.element_ty)
        rw_c = _inv_norms(NW, bh64 * T + cols, cmask, NORM)
        starts = None
        if DS is not None:
            starts = _doc_starts(DS, bh64, H, T, cols, cmask)
        ds = _dscores_block(
            w_c, gb_own, lse_c, rt_c, rw_c, cols, starts, k_c, u_c, rk, cols, T, scale, W, KERNEL, NORM, LOWP,
            PREC,
        )  # fmt: skip
        dk = _dk_terms(dk, ds, rw_c, w_c, W, LOWP, PREC, NORM)
        dk = _key_grad(dk, k_c, rk, scale, NORM)
        tl.store(DK + tile, dk.to(DK.dtype.element_ty), mask=cmask[:, None])


@triton.jit
def _dk_terms(dk, ds, rw, w_r, W, LOWP: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr):
    """dK's sum over one block of rows (`_key_grad`): dk += dS^T w (NORM: dS scaled by the rows' inverse
    norms)."""
    if NORM:
        ds = ds * rw[:, None]
    return dk + _mm(tl.trans(ds), w_r, W, LOWP, PREC)


@triton.jit
def _later_scores(
    W, NW, LSE, later, rowoffs, rmask, valid, k_c, rk, scale,
    C: tl.constexpr, KERNEL: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """For a later row chunk of the backward wavefront: (w_r, its inverse norms, S, A) against this tile's
    columns k_c (A 0 where not valid)."""
    w_r = tl.load(W + later, mask=rmask[:, None], other=0.0)
    rw = _inv_norms(NW, rowoffs, rmask, NORM)
    lse_r = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        lse_r = tl.load(LSE + rowoffs, mask=rmask, other=0.0)
    s = _scaled(tl.dot(w_r, tl.trans(k_c), input_precision=PREC), scale, rw, rk, NORM)  # [rows i, cols j]
    return w_r, rw, s, _kappa(s, valid, lse_r, KERNEL)


@triton.jit
def _pair_ds(
    a, s, gb_hi, gb_lo, u_c, RT, rowoffs, rmask, valid, W,
    C: tl.constexpr, KERNEL: tl.constexpr, LOWP: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dS of one (later row chunk, chunk c) pair of the wavefront (DKW), dA = -(beta G_r) u_c^T; the row
    term read past L1."""
    rt_r = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        rt_r = tl.load(RT + rowoffs, mask=rmask, other=0.0, cache_modifier=".cg")
    gb_r = gb_hi
    if SPLIT and not LOWP:
        gb_r = gb_hi.to(tl.float32) + gb_lo.to(tl.float32)
    da = -_mm(gb_r, tl.trans(u_c), W, LOWP, PREC)
    return _dscores(a, s, da, rt_r, valid, KERNEL)


@triton.jit
def _row_term(Hs, RT, tile, rowoffs, gb_c, cmask):
    """Loads h of a chunk's rows, stores their row term beta_i <G_i, h_i>; returns (h, term)."""
    h_c = tl.load(Hs + tile, mask=cmask[:, None], other=0.0)
    rt_c = tl.sum(gb_c * h_c, axis=1)
    tl.store(RT + rowoffs, rt_c, mask=cmask)
    return h_c, rt_c


@triton.jit
def _load_rows(
    W, NW, GB, GBLO, LSE, RT, bh, T, rows,
    D: tl.constexpr, C: tl.constexpr, KERNEL: tl.constexpr, NORM: tl.constexpr, LOWP: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """What dS needs of a block of rows i: w_i, beta_i G_i, for softmax lse_i and the row term, and the
    inverse norms of w_i (NORM)."""
    rmask = rows < T
    tile = bh * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
    gb = _load_value(GB, GBLO, tile, rmask[:, None], LOWP, SPLIT)
    lse = tl.zeros((C,), dtype=tl.float32)
    rt = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        lse = tl.load(LSE + bh * T + rows, mask=rmask, other=0.0)
        rt = tl.load(RT + bh * T + rows, mask=rmask, other=0.0)
    return w, gb, lse, rt, _inv_norms(NW, bh * T + rows, rmask, NORM)


@triton.jit
def _load_cols(
    K, NK, U, ULO, bh, T, cols, D: tl.constexpr, NORM: tl.constexpr, LOWP: tl.constexpr, SPLIT: tl.constexpr
):  # fmt: skip
    """What dS needs of a block of columns j: k_j, u_j and the inverse norms of k_j (NORM)."""
    tile = bh * T * D + cols[:, None] * D + tl.arange(0, D)[None, :]
    cmask = (cols < T)[:, None]
    k, u = tl.load(K + tile, mask=cmask, other=0.0), _load_value(U, ULO, tile, cmask, LOWP, SPLIT)
    return k, u, _inv_norms(NK, bh * T + cols, cols < T, NORM)


@triton.jit
def _dscores_block(
    w_r, gb_r, lse_r, rt_r, rw, rows, starts, k_c, u_c, rk, cols, T, scale, W,
    KERNEL: tl.constexpr, NORM: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dS of a block of rows i against a block of columns j (0 unless j < i < T, and starts_i <= j where
    starts, the rows' doc_start, is not None): S and A recomputed, dA_ij = -beta_i <G_i, u_j>."""
    valid = (rows[:, None] > cols[None, :]) & (rows < T)[:, None]
    if starts is not None:
        valid = valid & (cols[None, :] >= starts[:, None])
    s = _scaled(tl.dot(w_r, tl.trans(k_c), input_precision=PREC), scale, rw, rk, NORM)
    a = _kappa(s, valid, lse_r, KERNEL)
    da = -_mm(gb_r, tl.trans(u_c), W, LOWP, PREC)
    return _dscores(a, s, da, rt_r, valid, KERNEL)


@triton.jit
def _dk_block(
    W, K, NW, NK, U, ULO, GB, GBLO, LSE, RT, DK, scale, T, NC, c, bh, DS, ENDS, H,
    KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """dK_j = s sum_{i > j} dS_ij w_i (NORM: `_key_grad`) for a block c of columns j, over the row blocks
    from its own on (DS: up to the last that sees one of these columns)."""
    cols = c * C + tl.arange(0, C)
    k_c, u_c, rk = _load_cols(K, NK, U, ULO, bh, T, cols, D, NORM, LOWP, SPLIT)
    dk = tl.zeros((C, D), dtype=tl.float32)
    end = NC
    if DS is not None:
        end = tl.load(ENDS + (bh // H) * NC + c)
    for cp in range(c, end):
        rows = cp * C + tl.arange(0, C)
        w_r, gb_r, lse_r, rt_r, rw = _load_rows(
            W, NW, GB, GBLO, LSE, RT, bh, T, rows, D, C, KERNEL, NORM, LOWP, SPLIT
        )  # fmt: skip
        starts = None
        if DS is not None:
            starts = _doc_starts(DS, bh, H, T, rows, rows < T)
        ds = _dscores_block(
            w_r, gb_r, lse_r, rt_r, rw, rows, starts, k_c, u_c, rk, cols, T, scale, W, KERNEL, NORM, LOWP,
            PREC,
        )  # fmt: skip
        dk = _dk_terms(dk, ds, rw, w_r, W, LOWP, PREC, NORM)
    tile = bh * T * D + cols[:, None] * D + tl.arange(0, D)[None, :]
    dk = _key_grad(dk, k_c, rk, scale, NORM)
    tl.store(DK + tile, dk.to(DK.dtype.element_ty), mask=(cols < T)[:, None])


@triton.jit
def _dw_block(
    W, K, NW, NK, U, ULO, GB, GBLO, LSE, RT, DW, scale, T, c, bh, DS, H,
    KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """dW_i = s sum_{j < i} dS_ij k_j (NORM: `_key_grad`) for one block c of rows i, over the column blocks
    up to its own (DS: from the first its rows' documents reach)."""
    rows = c * C + tl.arange(0, C)
    w_c, gb_c, lse_c, rt_c, rw = _load_rows(
        W, NW, GB, GBLO, LSE, RT, bh, T, rows, D, C, KERNEL, NORM, LOWP, SPLIT
    )  # fmt: skip
    dw = tl.zeros((C, D), dtype=tl.float32)
    first = 0
    starts = None
    if DS is not None:
        starts = _doc_starts(DS, bh, H, T, rows, rows < T)
        first = _first_chunk(DS, bh, H, T, c, C)
    for cp in range(first, c + 1):
        cols = cp * C + tl.arange(0, C)
        k_p, u_p, rk = _load_cols(K, NK, U, ULO, bh, T, cols, D, NORM, LOWP, SPLIT)
        ds = _dscores_block(
            w_c, gb_c, lse_c, rt_c, rw, rows, starts, k_p, u_p, rk, cols, T, scale, W, KERNEL, NORM, LOWP,
            PREC,
        )  # fmt: skip
        if NORM:
            ds = ds * rk[None, :]
        dw += _mm(ds, k_p, W, LOWP, PREC)
    tile = bh * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    dw = _key_grad(dw, w_c, rw, scale, NORM)
    tl.store(DW + tile, dw.to(DW.dtype.element_ty), mask=(rows < T)[:, None])


@triton.jit
def _dk_dw_kernel(
    W, K, NW, NK, U, ULO, GB, GBLO, LSE, RT, DK, DW, scale, T, NC, DS, ENDS, H,
    KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr, SPLIT: tl.constexpr, ROLE: tl.constexpr,
):  # fmt: skip
    """ROLE 0: dK over column blocks, 1: dW over row blocks; grid (NC, BH), the longest blocks first (dK's
    first columns, dW's last rows): a shorter tail. Two launches: both roles in one launch (programs
    interleaved) cost relu 90 us more at 8,6,1024,128 on an H200 (why is not known)."""
    i = tl.program_id(0)  # the i-th longest block of its role
    bh = tl.program_id(1).to(tl.int64)
    if ROLE == 0:
        _dk_block(
            W, K, NW, NK, U, ULO, GB, GBLO, LSE, RT, DK, scale, T, NC, i, bh, DS, ENDS, H,
            KERNEL, NORM, D, C, LOWP, PREC, SPLIT,
        )  # fmt: skip
    else:
        _dw_block(
            W, K, NW, NK, U, ULO, GB, GBLO, LSE, RT, DW, scale, T, NC - 1 - i, bh, DS, H,
            KERNEL, NORM, D, C, LOWP, PREC, SPLIT,
        )  # fmt: skip
