"""Deltaformer stage 1, forward kernels (triton.py's docstring): `_prep_kernel`, parallel over (chunk, head):
the softmax rows' log-sum-exps and each chunk's in-chunk inverse; `_fwd_kernel`, the wavefront: u chunk by
chunk, and h = sum_{j<i} A_ij u_j for the backward. DS (doc_start [B, T], or None): kappa within each
row's document; the chunks of keys before the document of a chunk's first row are skipped."""

import triton
import triton.language as tl

from .triton_common import (
    _doc_starts,
    _first_chunk,
    _inv_norms,
    _kappa,
    _load_published,
    _lse_of,
    _lse_update,
    _mm_rec,
    _scaled,
    _scores,
    _store_split,
    _unit_lower_inverse,
    _wait_progress,
    _wavefront_tile,
)


@triton.jit
def _prep_kernel(
    W, K, NW, NK, Beta, LSE, Xinv, scale, T, NC, DS, H,
    KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
    XPREC: tl.constexpr,
):  # fmt: skip
    """Chunk c of head bh: the softmax lse of its rows over every j < i (in the row's document), and X_c
    (module docstring)."""
    c = NC - 1 - tl.program_id(0)  # the longest rows (most earlier chunks) first: a shorter tail
    bh = tl.program_id(1).to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    rows = c * C + offs_c
    rmask = rows < T
    tile = bh * T * D + rows[:, None] * D + offs_d[None, :]
    w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
    k_c = tl.load(K + tile, mask=rmask[:, None], other=0.0)
    b = tl.load(Beta + bh * T + rows, mask=rmask, other=0.0).to(tl.float32)
    lower = offs_c[:, None] > offs_c[None, :]
    first = 0
    if DS is not None:
        starts = _doc_starts(DS, bh, H, T, rows, rmask)
        lower = lower & (rows[None, :] >= starts[:, None])
        first = _first_chunk(DS, bh, H, T, c, C)
    rw, rk = _inv_norms(NW, bh * T + rows, rmask, NORM), _inv_norms(NK, bh * T + rows, rmask, NORM)
    s_cc = _scaled(tl.dot(w, tl.trans(k_c), input_precision=PREC), scale, rw, rk, NORM)
    lse = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        m = tl.full((C,), -1e30, dtype=tl.float32)
        l = tl.zeros((C,), dtype=tl.float32)
        m, l = _lse_update(m, l, tl.where(lower, s_cc, float("-inf")))
        for cp in range(first, c):
            keys = K + bh * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
            s = _scores(w, keys, None, scale, rw, rk, PREC, False)
            if DS is not None:
                s = tl.where((cp * C + offs_c)[None, :] >= starts[:, None], s, float("-inf"))
            m, l = _lse_update(m, l, s)
        lse = _lse_of(m, l)
        tl.store(LSE + bh * T + rows, lse, mask=rmask)
    a_cc = _kappa(s_cc, lower, lse, KERNEL)
    x = _unit_lower_inverse(b[:, None] * a_cc, C, XPREC)
    tl.store(Xinv + (bh * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :], x)


@triton.jit
def _fwd_kernel(
    W, K, NW, NK, V, Beta, U, ULO, Hs, LSE, Xinv, Prog, Ticket, scale, T, NC, BH, H, sv_b, sv_h, sv_t, DS,
    KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr, XPREC: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):  # fmt: skip
    """The wavefront tile of chunk c, head bh (module docstring); v read through its strides (sv_b, sv_h,
    sv_t; unit along D), as the attention's projection leaves it."""
    c, bh, bh64, offs_c, offs_d, rows, rmask, tile = _wavefront_tile(Ticket, T, NC, BH, D, C, False)
    w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
    rw = _inv_norms(NW, bh64 * T + rows, rmask, NORM)
    lse = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        lse = tl.load(LSE + bh64 * T + rows, mask=rmask, other=0.0)
    everything = offs_c[:, None] >= 0  # earlier chunks: every j < i
    first = 0
    if DS is not None:  # the rows' documents: earlier chunks from `first` on, masked
        starts = _doc_starts(DS, bh64, H, T, rows, rmask)
        first = _first_chunk(DS, bh64, H, T, c, C)
    xt = Xinv + (bh64 * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :]
    # loaded before the waits: off the critical path (but live in registers through them)
    b = tl.load(Beta + bh64 * T + rows, mask=rmask, other=0.0).to(tl.float32)
    v_tile = (bh64 // H) * sv_b + (bh64 % H) * sv_h + rows[:, None].to(tl.int64) * sv_t + offs_d[None, :]
    v = tl.load(V + v_tile, mask=rmask[:, None], other=0.0).to(tl.float32)
    x = tl.load(xt)
    acc = tl.zeros((C, D), dtype=tl.float32)
    done = c * 0  # earlier chunks consumed
    ok = done + 1
    while done < c:  # consume chunks as they are published
        seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT)
        ok = ok & (seen > done).to(tl.int32)
        ready = tl.where(seen > done, tl.minimum(seen, c), c)
        lo = done
        if DS is not None:  # (the chunks before still waited for: tiles publish in chunk order)
            lo = tl.maximum(done, first)
        for cp in range(lo, ready):
            prev = bh64 * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
            rk = _inv_norms(NK, bh64 * T + cp * C + offs_c, offs_c < C, NORM)
            valid = everything
            if DS is not None:
                valid = (cp * C + offs_c)[None, :] >= starts[:, None]
            p = _kappa(_scores(w, K + prev, None, scale, rw, rk, PREC, NORM), valid, lse, KERNEL)
            u_hi, u_lo = _load_published(U, ULO, prev, None, SPLIT)
            acc += _mm_rec(p, u_hi, u_lo, W, SPLIT, PREC)
        done = ready
    u = tl.dot(x, v - b[:, None] * acc, input_precision=XPREC)
    u = tl.where(ok != 0, u, float("nan"))
    _store_split(U, ULO, tile, u, rmask[:, None], SPLIT)
    tl.debug_barrier()  # every thread's stores precede the release below
    tl.atomic_xchg(Prog + bh, c + 1, sem="release")
    # off the critical path: h = sum_{j<i} A_ij u_j, for the backward
    k_c = tl.load(K + tile, mask=rmask[:, None], other=0.0)
    rk = _inv_norms(NK, bh64 * T + rows, rmask, NORM)
    s_cc = _scaled(tl.dot(w, tl.trans(k_c), input_precision=PREC), scale, rw, rk, NORM)
    lower = offs_c[:, None] > offs_c[None, :]
    if DS is not None:
        lower = lower & (rows[None, :] >= starts[:, None])
    a_cc = _kappa(s_cc, lower, lse, KERNEL)
    h = acc + tl.dot(a_cc, u, input_precision=PREC)
    tl.store(Hs + tile, h, mask=rmask[:, None])


@triton.jit
def _row_norms_kernel(W, K, NORMS, R, D: tl.constexpr, ROWS: tl.constexpr, SAME: tl.constexpr):
    # relu / linear: the fp32 norms of ROWS rows of w and k into NORMS [2, R] (|w_i|, then |k_j|); SAME: w is
    # k, read once
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m = rows < R
    tile = rows[:, None] * D + tl.arange(0, D)[None, :]
    k = tl.load(K + tile, mask=m[:, None], other=0.0).to(tl.float32)
    nk = tl.sqrt(tl.sum(k * k, axis=1))
    if SAME:
        nw = nk
    else:
        w = tl.load(W + tile, mask=m[:, None], other=0.0).to(tl.float32)
        nw = tl.sqrt(tl.sum(w * w, axis=1))
    tl.store(NORMS + rows, nw, mask=m)
    tl.store(NORMS + R + rows, nk, mask=m)
