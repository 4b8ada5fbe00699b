"""Deltaformer stage 1, forward kernels (triton.py's docstring): `_fwd_kernel`, the wavefront: u chunk by
chunk, and what the backward needs (softmax kappa's log-sum-exps, the in-chunk inverses, h = sum_{j<i}
A_ij u_j); `_row_norms_kernel`, the norms relu and linear kappa scale their scores by."""

import triton
import triton.language as tl

from .triton_common import (
    _inv_norms,
    _kappa,
    _load_published,
    _lse_of,
    _lse_update,
    _mm_rec,
    _scores,
    _store_split,
    _unit_lower_inverse,
    _wait_progress,
    _wavefront_tile,
)


@triton.jit
def _fwd_kernel(
    W, K, NW, NK, V, Beta, U, ULO, Hs, LSE, Xinv, Prog, Ticket, scale, T, NC, BH, H, sv_b, sv_h, sv_t,
    KERNEL: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr, XPREC: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):  # fmt: skip
    """The wavefront tile of chunk c, head bh (module docstring); v read through its strides (sv_b, sv_h,
    sv_t; unit along D), as the attention's projection leaves it."""
    c, bh, bh64, offs_c, offs_d, rows, rmask, tile = _wavefront_tile(Ticket, T, NC, BH, D, C, False)
    w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
    rw, rk_c = _inv_norms(NW, bh64 * T + rows, rmask, NORM), _inv_norms(NK, bh64 * T + rows, rmask, NORM)
    lower = offs_c[:, None] > offs_c[None, :]
    everything = offs_c[:, None] >= 0  # earlier chunks: every j < i
    # softmax: the running max m and sum l of exp(s - m) of every row over j < i (online, as FlashAttention),
    # from its own chunk's columns first; acc holds sum_j exp(s_ij - m_i) u_j, rescaled as m grows
    m = tl.full((C,), -1e30, dtype=tl.float32)
    l = tl.zeros((C,), dtype=tl.float32)
    lse = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        s_cc = _scores(w, K + tile, rmask[:, None], scale, rw, rk_c, PREC, NORM)
        m, l = _lse_update(m, l, tl.where(lower, s_cc, float("-inf")))
    acc = tl.zeros((C, D), dtype=tl.float32)
    done = c * 0  # earlier chunks consumed
    ok = done + 1
    while done < c:  # consume chunks as they are published
        seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT)
        ok = ok & (seen > done).to(tl.int32)
        ready = tl.where(seen > done, tl.minimum(seen, c), c)
        for cp in range(done, ready):
            prev = bh64 * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
            rk = _inv_norms(NK, bh64 * T + cp * C + offs_c, offs_c < C, NORM)
            s = _scores(w, K + prev, None, scale, rw, rk, PREC, NORM)
            if KERNEL == 0:
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None]
                m = m_new
            else:
                p = _kappa(s, everything, lse, KERNEL)
            u_hi, u_lo = _load_published(U, ULO, prev, None, SPLIT)
            acc += _mm_rec(p, u_hi, u_lo, W, SPLIT, PREC)
        done = ready
    if KERNEL == 0:  # kappa's normaliser is known only now
        lse = _lse_of(m, l)
        acc = acc * tl.exp(m - lse)[:, None]  # / l (row 0: 0 * 1)
        tl.store(LSE + bh64 * T + rows, lse, mask=rmask)
    a_cc = _kappa(_scores(w, K + tile, rmask[:, None], scale, rw, rk_c, PREC, NORM), lower, lse, KERNEL)
    b = tl.load(Beta + bh64 * T + rows, mask=rmask, other=0.0).to(tl.float32)
    x = _unit_lower_inverse(b[:, None] * a_cc, C, XPREC)
    # v loaded only now: fewer registers live in the loop and the inverse
    v_tile = (bh64 // H) * sv_b + (bh64 % H) * sv_h + rows[:, None].to(tl.int64) * sv_t + offs_d[None, :]
    v = tl.load(V + v_tile, mask=rmask[:, None], other=0.0).to(tl.float32)
    u = tl.dot(x, v - b[:, None] * acc, input_precision=XPREC)
    u = tl.where(ok != 0, u, float("nan"))
    _store_split(U, ULO, tile, u, rmask[:, None], SPLIT)
    tl.debug_barrier()  # every thread's stores precede the release below
    tl.atomic_xchg(Prog + bh, c + 1, sem="release")
    # off the critical path: X_c and h = sum_{j<i} A_ij u_j, for the backward
    tl.store(Xinv + (bh64 * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :], x)
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
