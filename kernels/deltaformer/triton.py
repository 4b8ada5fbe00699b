"""Triton path: stage 1 (u) forward and backward in Triton; stage 2 stays SDPA (FlashAttention on CUDA).

The rows are cut into chunks of C. Chunk c of one (batch, head) needs the u of every earlier chunk, so
chunks are sequential; but the in-chunk matrices and the softmax row statistics depend only on w, k and
beta, and most of a chunk's remaining work (scores against earlier keys, A @ u) only needs chunks that
finished long before. Hence, forward:
  1. `_prep_kernel`, fully parallel over (chunk, batch*head): the softmax log-sum-exp of every row over
     j < i, and X_c = (I + diag(beta_c) A_cc)^-1 for every chunk.
  2. `_fwd_kernel`, a wavefront: every (chunk, batch*head) tile is its own program; it takes whatever
     earlier chunks are already published in a loop with no synchronisation inside (which the compiler
     may software-pipeline safely), then waits for the next one. Once all are in,
     u_c = X_c (v_c - beta_c * sum_{j < chunk} A_cj u_j); it publishes u_c, then computes
     h_c = sum_{j<i} A_ij u_j for the backward. The critical path per chunk is one block of scores and
     A @ u plus one product with X_c; but most tiles find their earlier chunks already published, so the
     wavefront runs at the SMs' throughput for its work (measured: running prep beside it in the same
     launch, or shortening the chain with extra products, only added time).
Each program takes a ticket from an atomic counter and maps it to (chunk, batch*head) in chunk order, so
a tile only waits on tiles holding smaller tickets, which are already running: no deadlock, whatever the
number of resident programs. Each (batch, head) has a progress counter (chunks published): a tile
publishes with a release after a barrier; readers spin on an acquire. A spin that never ends (a bug)
gives up and writes NaN.

In-chunk inverse: N = diag(beta_c) A_cc is strictly lower triangular (nilpotent), so (I + N)^-1 by
doubling the block size in the parallel prep kernel (`_unit_lower_inverse`, which says why not the Neumann
series by squaring nor forward substitution); X_c is saved for the backward.

Precision (half-precision inputs): products take half operands with fp32 accumulation, as in
FlashAttention, except the recurrence's inter-chunk products, whose rounding every later u inherits: those
take hi + lo half operands (`_mm_rec`, ~16 bits). fp32 inputs: exact fp32 products.

Backward, with M = I + diag(beta) A, U = M^-1 V, G = M^-T dU:
  dV = G, found anti-causally: G_j = dU_j - sum_{i>j} A_ij beta_i G_i: the same wavefront, reversed
  (`_bwd_g_kernel`), with G_c = X_c^T (dU_c - ...);
  dA_ij = -beta_i <G_i, u_j>;  dbeta_i = -<G_i, h_i>;
  softmax: dS_ij = A_ij (dA_ij - sum_j' A_ij' dA_ij') = A_ij (dA_ij + beta_i <G_i, h_i>);
  relu: dS = dA [S > 0];  linear: dS = dA;  then dK = s dS^T W (`_dk_block`, parallel over column
  chunks) and dW = s dS K (`_dw_block`, parallel over row chunks), launched by `_dk_dw_kernel`.
"""

import contextlib

import torch
import triton
import triton.language as tl

from ..common import default_scale
from .naive import KERNELS, _inv_norm

_KERNEL_IDS = {"softmax": 0, "relu": 1, "linear": 2}
_SPIN_LIMIT = 20_000_000  # ~10 s of spinning: only a bug gets there


@triton.jit
def _read_progress(ptr):
    """*ptr with acquire semantics: an atomic read-modify-write (add 0), portable, also in the interpreter."""
    return tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _wait_progress(ptr, target, SPIN_LIMIT: tl.constexpr):
    """Spin until *ptr >= target (acquire); returns the last value seen (< target after SPIN_LIMIT)."""
    seen = _read_progress(ptr)
    tries = seen * 0
    while (seen < target) & (tries < SPIN_LIMIT):
        seen = _read_progress(ptr)
        tries += 1
    return seen


@triton.jit
def _mm(a, b, like, LOWP: tl.constexpr, PREC: tl.constexpr):
    """a @ b, fp32 accumulation; operands in the inputs' dtype (LOWP, as in FlashAttention) or fp32."""
    if LOWP:
        return tl.dot(a.to(like.dtype.element_ty), b.to(like.dtype.element_ty))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _mm_rec(a, b_hi, b_lo, like, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """a @ b for the recurrence's inter-chunk products (A @ u forward, A^T (beta G) backward), fp32
    accumulation; a is fp32 (kappa values), b comes as the halves its producer stored (`_store_split`).
    Their rounding errors are fed back into every later u (or G), and where updates are near reflections
    |u| grows and the errors with it (tests/test_deltaformer.py, reflection regime; plain bf16 operands
    miss 1e-2 there). SPLIT (half inputs): a_hi b_hi + a_hi b_lo + a_lo b_hi with hi + lo halves of each
    operand in the inputs' half dtype (~16 mantissa bits at half-precision tensor-core speed); b's halves
    are split once by its producer, not again by every consumer. Else (fp32 inputs): fp32 operands at PREC."""
    if SPLIT:
        a_hi = a.to(like.dtype.element_ty)
        a_lo = (a - a_hi.to(tl.float32)).to(like.dtype.element_ty)
        return tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)))
    else:
        return tl.dot(a.to(tl.float32), b_hi.to(tl.float32), input_precision=PREC)


@triton.jit
def _store_split(HI, LO, offs, x, mask, SPLIT: tl.constexpr):
    """fp32 x stored as hi = x in HI's dtype and, with SPLIT, lo = (x - hi) in LO's: for half dtypes
    hi + lo keeps ~16 mantissa bits, read by `_mm_rec` (split) and by fp32 operands (`_load_value`)."""
    hi = x.to(HI.dtype.element_ty)
    tl.store(HI + offs, hi, mask=mask)
    if SPLIT:
        tl.store(LO + offs, (x - hi.to(tl.float32)).to(LO.dtype.element_ty), mask=mask)


@triton.jit
def _load_value(HI, LO, offs, mask, LOWP: tl.constexpr, SPLIT: tl.constexpr):
    """A value operand of dK / dW (u or beta G) as stored by `_store_split`: hi for half operands (LOWP),
    else fp32 hi + lo."""
    x = tl.load(HI + offs, mask=mask, other=0.0)
    if SPLIT and not LOWP:  # (one return statement: Triton 3.6 rejects returns of two dtypes)
        x = x.to(tl.float32) + tl.load(LO + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _load_cg(ptr, mask):
    """A load past the (incoherent) L1, of data another program of this launch wrote; masked (0) unless
    mask is None."""
    if mask is None:
        x = tl.load(ptr, cache_modifier=".cg")
    else:
        x = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    return x


@triton.jit
def _scores(a, B, mask, scale, PREC: tl.constexpr):
    """scale * a @ b^T with the block b loaded at pointers B (masked rows 0 unless mask is None)."""
    if mask is None:
        b = tl.load(B)
    else:
        b = tl.load(B, mask=mask, other=0.0)
    return tl.dot(a, tl.trans(b), input_precision=PREC) * scale


@triton.jit
def _load_published(HI, LO, offs, mask, WITH_LO: tl.constexpr):
    """A block another tile of this launch published (u, or beta G) as (hi, lo); lo only WITH_LO (else
    hi again)."""
    hi = _load_cg(HI + offs, mask)
    lo = hi
    if WITH_LO:
        lo = _load_cg(LO + offs, mask)
    return hi, lo


@triton.jit
def _kappa(s, valid, lse, KERNEL: tl.constexpr):
    """The first-stage kernel on a block of scaled scores; 0 where not valid. lse: [rows] (softmax)."""
    if KERNEL == 0:
        return tl.exp(tl.where(valid, s - lse[:, None], float("-inf")))
    elif KERNEL == 1:
        return tl.where(valid, tl.maximum(s, 0.0), 0.0)
    else:
        return tl.where(valid, s, 0.0)


@triton.jit
def _dscores(a, s, da, rowterm, valid, KERNEL: tl.constexpr):
    """dS from dA for one block: softmax A (dA + rowterm), relu dA [S > 0], linear dA; 0 if not valid."""
    if KERNEL == 0:
        return a * (da + rowterm[:, None])
    elif KERNEL == 1:
        return tl.where(valid & (s > 0), da, 0.0)
    else:
        return tl.where(valid, da, 0.0)


@triton.jit
def _unit_lower_inverse(n, C: tl.constexpr, PREC: tl.constexpr):
    """(I + n)^-1 for strictly lower triangular n [C, C] (C a power of two), by doubling the block size: let
    Y_b be the inverse of the block-diagonal part of I + n in [b, b] blocks (Y_1 = I). A [2b, 2b] block is
    [[A, 0], [E, B]], with inverse [[A^-1, 0], [-B^-1 E A^-1, B^-1]], so Y_2b = Y_b - Y_b E_b Y_b with E_b the
    entries of n in the lower-left quarter of every [2b, 2b] block: log2(C) steps of two [C, C] products
    (tensor cores). Like forward substitution, it only multiplies by final entries of the inverse (with its
    fp32 or 3-pass tf32 products as accurate in the tests; with plain tf32 products its error was ~2x
    substitution's in a float64 emulation of the roundings); not the Neumann series by squaring ((I - n)(I +
    n^2)(I + n^4)...), exact in exact arithmetic but where beta * kappa ~ 1-2 (a token's update is a
    reflection, the regime state tracking needs) the powers of n grow huge and cancel: fp32 lost up to 7e-2 of
    u at C = 64 (tests/test_deltaformer.py, reflection regime). Forward substitution row by row and by 16-row
    blocks is as accurate but slow: C - 1 or 15 dependent steps of cross-warp reductions, measured 123 of the
    prep kernel's 179 us at 8,12,1024,64 on an H200. The levels b < 16 only touch the [16, 16] diagonal
    blocks, so they run as batched [C / 16, 16, 16] products (C / 16 times fewer MACs; f+b -55 us at
    8,12,1024,64 and -30 us at 8,6,1024,128 against [C, C] products)."""
    if C > 16:  # levels b < 16 on the [16, 16] diagonal blocks alone, then the rest
        d = _diagonal_blocks(n, C)
        y = _block_diagonal(_doubling_levels(d, d, 16, 0, PREC, True), C)
        y = _doubling_levels(n, y, C, 4, PREC, False)
    else:
        y = _doubling_levels(n, n, C, 0, PREC, False)
    return y


@triton.jit
def _doubling_levels(
    n, y, C: tl.constexpr, FIRST: tl.constexpr, PREC: tl.constexpr, BATCHED: tl.constexpr
):  # fmt: skip
    """Y_2b = Y_b - Y_b E_b Y_b for b = 2^FIRST, ... < C, on [C, C] tiles or (BATCHED) [G, C, C]; y is
    the inverse for b = 2^FIRST. FIRST 0: y is ignored; Y_2 = I - E_1 (Y_1 = I: no products) and the
    products start at b = 2."""
    offs = tl.arange(0, C)
    if BATCHED:
        r, c = offs[None, :, None], offs[None, None, :]
    else:
        r, c = offs[:, None], offs[None, :]
    if FIRST == 0:
        y = tl.where(r == c, 1.0, 0.0) - tl.where((r % 2 == 1) & (c == r - 1), n, 0.0)
    for level in tl.static_range(1, 7):  # block size b = 2^level; C <= 128
        if (1 << level) < C and level >= FIRST:
            same = r >> (level + 1) == c >> (level + 1)  # in the same [2b, 2b] block
            quarter = same & ((r >> level) % 2 == 1) & ((c >> level) % 2 == 0)
            e = tl.where(quarter, n, 0.0)
            y = y - tl.dot(y, tl.dot(e, y, input_precision=PREC), input_precision=PREC)
    return y


@triton.jit
def _diagonal_blocks(n, C: tl.constexpr):
    """The [16, 16] diagonal blocks of n [C, C] as [C // 16, 16, 16]."""
    G: tl.constexpr = C // 16
    n4 = tl.reshape(n, (G, 16, G, 16))  # n4[g, r, h, c] = n[16 g + r, 16 h + c]
    g = tl.arange(0, G)
    same = g[:, None, None, None] == g[None, None, :, None]
    return tl.sum(tl.where(same, n4, 0.0), axis=2)


@triton.jit
def _block_diagonal(y3, C: tl.constexpr):
    """[C, C] with the blocks y3 [C // 16, 16, 16] on the diagonal, 0 elsewhere."""
    G: tl.constexpr = C // 16
    g = tl.arange(0, G)
    same = g[:, None, None, None] == g[None, None, :, None]
    y4 = tl.where(same, tl.expand_dims(y3, 2), 0.0)  # [G, 16, G, 16]
    return tl.reshape(y4, (C, C))


@triton.jit
def _prep_kernel(
    W, K, Beta, LSE, Xinv, scale, T, NC,
    KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr,
):  # fmt: skip
    """Chunk c of head bh: the softmax lse of its rows over every j < i, and X_c (module docstring)."""
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
    s_cc = tl.dot(w, tl.trans(k_c), input_precision=PREC) * scale
    lse = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        m = tl.full((C,), -1e30, dtype=tl.float32)
        l = tl.zeros((C,), dtype=tl.float32)
        m, l = _lse_update(m, l, tl.where(lower, s_cc, float("-inf")))
        for cp in range(0, c):
            keys = K + bh * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
            m, l = _lse_update(m, l, _scores(w, keys, None, scale, PREC))
        lse = _lse_of(m, l)
        tl.store(LSE + bh * T + rows, lse, mask=rmask)
    a_cc = _kappa(s_cc, lower, lse, KERNEL)
    x = _unit_lower_inverse(b[:, None] * a_cc, C, XPREC)
    tl.store(Xinv + (bh * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :], x)


@triton.jit
def _lse_update(m, l, s):
    """Online softmax statistics: the running row max m (finite) and sum l of exp(s - m) after one more
    block of scores s (-inf where not a j < i)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    return m_new, l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)


@triton.jit
def _lse_of(m, l):
    """The log-sum-exp from the online statistics; -1e30 for a row with no j < i (row 0)."""
    return m + tl.log(tl.where(l > 0, l, 1.0))


@triton.jit
def _fwd_kernel(
    W, K, V, Beta, U, ULO, Hs, LSE, Xinv, Prog, Ticket, scale, T, NC, BH,
    KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    XPREC: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):  # fmt: skip
    """The wavefront tile of chunk c, head bh (module docstring)."""
    ticket = tl.atomic_add(Ticket, 1)
    c = ticket // BH
    bh = ticket % BH
    bh64 = bh.to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    rows = c * C + offs_c
    rmask = rows < T
    tile = bh64 * T * D + rows[:, None] * D + offs_d[None, :]
    w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
    lse = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        lse = tl.load(LSE + bh64 * T + rows, mask=rmask, other=0.0)
    everything = offs_c[:, None] >= 0  # earlier chunks: every j < i
    xt = Xinv + (bh64 * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :]
    # loaded before the waits: off the critical path (but live in registers through them)
    b = tl.load(Beta + bh64 * T + rows, mask=rmask, other=0.0).to(tl.float32)
    v = tl.load(V + tile, mask=rmask[:, None], other=0.0).to(tl.float32)
    x = tl.load(xt)
    acc = tl.zeros((C, D), dtype=tl.float32)
    done = c * 0  # earlier chunks consumed
    ok = done + 1
    while done < c:  # consume chunks as they are published
        seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT)
        ok = ok & (seen > done).to(tl.int32)
        ready = tl.where(seen > done, tl.minimum(seen, c), c)
        for cp in range(done, ready):
            prev = bh64 * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
            p = _kappa(_scores(w, K + prev, None, scale, PREC), everything, lse, KERNEL)
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
    s_cc = tl.dot(w, tl.trans(k_c), input_precision=PREC) * scale
    a_cc = _kappa(s_cc, offs_c[:, None] > offs_c[None, :], lse, KERNEL)
    h = acc + tl.dot(a_cc, u, input_precision=PREC)
    tl.store(Hs + tile, h, mask=rmask[:, None])


@triton.jit
def _bwd_g_kernel(
    W, K, DU, Beta, Hs, LSE, Xinv, GB, GBLO, DV, DBeta, RT, Prog, Ticket, U, ULO, DK, scale, T, NC, BH,
    KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    XPREC: tl.constexpr, SPIN_LIMIT: tl.constexpr, DKW: tl.constexpr, LOWP: tl.constexpr,
):  # fmt: skip
    """G_c for one column chunk c (module docstring). DKW (D <= 64, `_u_bwd`): also
    dK_c = s sum_{i >= c} dS_ic^T w_i, from the S and A of the pairs this program forms anyway (then
    the dK pass is not launched; a chunk's row term is stored before its release, as its readers are
    in this launch)."""
    ticket = tl.atomic_add(Ticket, 1)
    c = NC - 1 - ticket // BH  # last chunk first
    bh = ticket % BH
    bh64 = bh.to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    cols = c * C + offs_c
    cmask = cols < T
    tile = bh64 * T * D + cols[:, None] * D + offs_d[None, :]
    k_c = tl.load(K + tile, mask=cmask[:, None], other=0.0)
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
    while done < NC - 1 - c:
        seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT)
        ok = ok & (seen > done).to(tl.int32)
        ready = tl.where(seen > done, tl.minimum(seen, NC - 1 - c), NC - 1 - c)
        for it in range(done, ready):
            rows = (NC - 1 - it) * C + offs_c  # a later chunk, in the order they were published
            rmask = rows < T
            later = bh64 * T * D + rows[:, None] * D + offs_d[None, :]
            w_r, s, a = _later_scores(W, LSE, later, bh64 * T + rows, rmask, k_c, scale, C, KERNEL, PREC)
            gb_hi, gb_lo = _load_published(GB, GBLO, later, rmask[:, None], SPLIT)
            acc += _mm_rec(tl.trans(a), gb_hi, gb_lo, W, SPLIT, PREC)
            if DKW:
                ds = _pair_ds(a, s, gb_hi, gb_lo, u_c, RT, bh64 * T + rows, rmask, W,
                              C, KERNEL, LOWP, SPLIT, PREC)  # fmt: skip
                dk += _mm(tl.trans(ds), w_r, W, LOWP, PREC)
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
        ds = _dscores_block(
            w_c, gb_own, lse_c, rt_c, cols, k_c, u_c, cols, T, scale, W, KERNEL, LOWP, PREC
        )  # fmt: skip
        dk += _mm(tl.trans(ds), w_c, W, LOWP, PREC)
        tl.store(DK + tile, (dk * scale).to(DK.dtype.element_ty), mask=cmask[:, None])


@triton.jit
def _later_scores(
    W, LSE, later, rowoffs, rmask, k_c, scale,
    C: tl.constexpr, KERNEL: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """For a later row chunk of the backward wavefront: (w_r, S, A) against this tile's columns k_c."""
    w_r = tl.load(W + later, mask=rmask[:, None], other=0.0)
    lse_r = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        lse_r = tl.load(LSE + rowoffs, mask=rmask, other=0.0)
    s = tl.dot(w_r, tl.trans(k_c), input_precision=PREC) * scale  # [rows i, cols j]
    return w_r, s, _kappa(s, rmask[:, None], lse_r, KERNEL)


@triton.jit
def _pair_ds(
    a, s, gb_hi, gb_lo, u_c, RT, rowoffs, rmask, W,
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
    return _dscores(a, s, da, rt_r, rmask[:, None], KERNEL)


@triton.jit
def _row_term(Hs, RT, tile, rowoffs, gb_c, cmask):
    """Loads h of a chunk's rows, stores their row term beta_i <G_i, h_i>; returns (h, term)."""
    h_c = tl.load(Hs + tile, mask=cmask[:, None], other=0.0)
    rt_c = tl.sum(gb_c * h_c, axis=1)
    tl.store(RT + rowoffs, rt_c, mask=cmask)
    return h_c, rt_c


@triton.jit
def _load_rows(
    W, GB, GBLO, LSE, RT, bh, T, rows,
    D: tl.constexpr, C: tl.constexpr, KERNEL: tl.constexpr, LOWP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """What dS needs of a block of rows i: w_i, beta_i G_i and, for softmax, lse_i and the row term."""
    rmask = rows < T
    tile = bh * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
    gb = _load_value(GB, GBLO, tile, rmask[:, None], LOWP, SPLIT)
    lse = tl.zeros((C,), dtype=tl.float32)
    rt = tl.zeros((C,), dtype=tl.float32)
    if KERNEL == 0:
        lse = tl.load(LSE + bh * T + rows, mask=rmask, other=0.0)
        rt = tl.load(RT + bh * T + rows, mask=rmask, other=0.0)
    return w, gb, lse, rt


@triton.jit
def _load_cols(K, U, ULO, bh, T, cols, D: tl.constexpr, LOWP: tl.constexpr, SPLIT: tl.constexpr):
    """What dS needs of a block of columns j: k_j and u_j."""
    tile = bh * T * D + cols[:, None] * D + tl.arange(0, D)[None, :]
    cmask = (cols < T)[:, None]
    return tl.load(K + tile, mask=cmask, other=0.0), _load_value(U, ULO, tile, cmask, LOWP, SPLIT)


@triton.jit
def _dscores_block(
    w_r, gb_r, lse_r, rt_r, rows, k_c, u_c, cols, T, scale, W,
    KERNEL: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """dS of a block of rows i against a block of columns j (0 unless j < i < T): S and A recomputed,
    dA_ij = -beta_i <G_i, u_j>."""
    valid = (rows[:, None] > cols[None, :]) & (rows < T)[:, None]
    s = tl.dot(w_r, tl.trans(k_c), input_precision=PREC) * scale
    a = _kappa(s, valid, lse_r, KERNEL)
    da = -_mm(gb_r, tl.trans(u_c), W, LOWP, PREC)
    return _dscores(a, s, da, rt_r, valid, KERNEL)


@triton.jit
def _dk_block(
    W, K, U, ULO, GB, GBLO, LSE, RT, DK, scale, T, NC, c, bh,
    KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """dK_j = s sum_{i > j} dS_ij w_i for a block c of columns j, over the row blocks from its own on."""
    cols = c * C + tl.arange(0, C)
    k_c, u_c = _load_cols(K, U, ULO, bh, T, cols, D, LOWP, SPLIT)
    dk = tl.zeros((C, D), dtype=tl.float32)
    for cp in range(c, NC):
        rows = cp * C + tl.arange(0, C)
        w_r, gb_r, lse_r, rt_r = _load_rows(W, GB, GBLO, LSE, RT, bh, T, rows, D, C, KERNEL, LOWP, SPLIT)
        ds = _dscores_block(w_r, gb_r, lse_r, rt_r, rows, k_c, u_c, cols, T, scale, W, KERNEL, LOWP, PREC)
        dk += _mm(tl.trans(ds), w_r, W, LOWP, PREC)
    tile = bh * T * D + cols[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(DK + tile, (dk * scale).to(DK.dtype.element_ty), mask=(cols < T)[:, None])


@triton.jit
def _dw_block(
    W, K, U, ULO, GB, GBLO, LSE, RT, DW, scale, T, c, bh,
    KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """dW_i = s sum_{j < i} dS_ij k_j for one block c of rows i, over the column blocks up to its own."""
    rows = c * C + tl.arange(0, C)
    w_c, gb_c, lse_c, rt_c = _load_rows(W, GB, GBLO, LSE, RT, bh, T, rows, D, C, KERNEL, LOWP, SPLIT)
    dw = tl.zeros((C, D), dtype=tl.float32)
    for cp in range(0, c + 1):
        cols = cp * C + tl.arange(0, C)
        k_p, u_p = _load_cols(K, U, ULO, bh, T, cols, D, LOWP, SPLIT)
        ds = _dscores_block(w_c, gb_c, lse_c, rt_c, rows, k_p, u_p, cols, T, scale, W, KERNEL, LOWP, PREC)
        dw += _mm(ds, k_p, W, LOWP, PREC)
    tile = bh * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(DW + tile, (dw * scale).to(DW.dtype.element_ty), mask=(rows < T)[:, None])


@triton.jit
def _dk_dw_kernel(
    W, K, U, ULO, GB, GBLO, LSE, RT, DK, DW, scale, T, NC,
    KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr, ROLE: tl.constexpr,
):  # fmt: skip
    """ROLE 0: dK over column blocks, 1: dW over row blocks; grid (NC, BH), the longest blocks first (dK's
    first columns, dW's last rows): a shorter tail. Two launches: both roles in one launch (programs
    interleaved) cost relu 90 us more at 8,6,1024,128 on an H200 (why is not known)."""
    i = tl.program_id(0)  # the i-th longest block of its role
    bh = tl.program_id(1).to(tl.int64)
    if ROLE == 0:
        _dk_block(
            W, K, U, ULO, GB, GBLO, LSE, RT, DK, scale, T, NC, i, bh, KERNEL, D, C, LOWP, PREC, SPLIT,
        )  # fmt: skip
    else:
        _dw_block(
            W, K, U, ULO, GB, GBLO, LSE, RT, DW, scale, T, NC - 1 - i, bh,
            KERNEL, D, C, LOWP, PREC, SPLIT,
        )  # fmt: skip


# Launch options; the measurements are forward+backward on an H200 at B,H,T,D = 8,12,1024,64.
LAUNCH = {
    "num_warps": {
        16: 4,
        32: 4,
        64: 4,
        128: 8,
    },  # by chunk (at D = 128 and chunk 64, 8 warps: 1.19 vs 0.78 ms)
    "num_stages_large_tiles": 2,  # fp32 operands or D = 128: three stages overflow shared memory
    "num_stages_dk": 2,  # the dK pass: 131 -> 104 us, where two stages cost the wavefronts 4%
}
# dK accumulated by the backward wavefront (`_bwd_g_kernel` DKW) instead of its own pass up to this head dim:
# -49 us softmax, -32 us relu at D = 64; at D = 128 it cost +80 and +77 us (the extra [C, D] accumulator).
DK_IN_WAVEFRONT_MAX_D = 64


def _triton_cfg(x, chunk, lowp):
    """Validated settings: (prec, xprec, lowp, split, launch options).

    fp32 inputs: every product in exact fp32. Half-precision inputs: fp32 accumulation; half operands in the
    non-recurrent O(T^2) products (dK, dW) as FlashAttention (unless lowp=False: tf32 operands from the
    stored hi + lo halves); the recurrence's products split (`_mm_rec`); the in-chunk inverse and its
    products in 3-pass tf32 (~fp32), so that they do not undo the split's accuracy."""
    D = x.shape[-1]
    if D not in (16, 32, 64, 128):
        raise ValueError(f"deltaformer (triton): head dim D must be 16, 32, 64 or 128, got {D}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"deltaformer (triton): dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if chunk not in (16, 32, 64, 128):
        raise ValueError(f"deltaformer (triton): chunk must be 16, 32, 64 or 128, got {chunk}")
    if x.dtype == torch.float32:
        return "ieee", "ieee", False, False, _launch(D, chunk, lowp=False)
    return "tf32", "tf32x3", lowp, True, _launch(D, chunk, lowp)


def _launch(D, chunk, lowp):
    """Launch options of every kernel."""
    launch = dict(num_warps=LAUNCH["num_warps"][chunk])
    if D == 128 or not lowp:
        launch["num_stages"] = LAUNCH["num_stages_large_tiles"]
    return launch


def _device_guard(x):
    """Launch on the inputs' device, whatever the current one is."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# The kernels are wrapped as torch.library custom ops (forward and backward each one op, the autograd
# formula registered on the forward) so that torch.compile treats them as opaque calls with known output
# shapes (register_fake) instead of tracing into the Triton launches, which broke Inductor before.
# u_lo (the low half of u, `_store_split`) is empty for fp32 inputs.


def _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp):
    """Launch the forward kernels: (u, u_lo, h, lse, xinv), what the backward needs."""
    B, H, T, D = v.shape
    BH, NC, C = B * H, triton.cdiv(T, chunk), chunk
    prec, xprec, lowp, split, launch = _triton_cfg(v, chunk, lowp)
    k, v, w, beta = (x.contiguous() for x in (k, v, w, beta))
    f32 = dict(device=v.device, dtype=torch.float32)
    u = v.new_empty(v.shape)  # contiguous (v is, here), as the fake says
    u_lo = v.new_empty(v.shape) if split else v.new_empty(0)
    h = torch.empty(B, H, T, D, **f32)
    lse = torch.empty(B, H, T, **f32) if kernel == "softmax" else torch.zeros(1, **f32)  # placeholder
    xinv = torch.empty(BH, NC, C, C, **f32)
    kid = _KERNEL_IDS[kernel]
    counters = torch.zeros(BH + 1, device=v.device, dtype=torch.int32)  # progress per (b, h); the ticket
    with _device_guard(v):
        _prep_kernel[(NC, BH)](
            w, k, beta, lse, xinv, scale, T, NC, KERNEL=kid, D=D, C=C, PREC=prec, XPREC=xprec, **launch,
        )  # fmt: skip
        _fwd_kernel[(BH * NC,)](
            w, k, v, beta, u, u_lo if split else u, h, lse, xinv, counters, counters[BH:],
            scale, T, NC, BH, KERNEL=kid, D=D, C=C, SPLIT=split, PREC=prec, XPREC=xprec,
            SPIN_LIMIT=_SPIN_LIMIT, **launch,
        )  # fmt: skip
    return u, u_lo, h, lse, xinv


@torch.library.custom_op("deltaformer::u_fwd", mutates_args=())
def _u_fwd_op(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
    kernel: str, scale: float, chunk: int, lowp: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp)


@_u_fwd_op.register_fake
def _(k, v, w, beta, kernel, scale, chunk, lowp):
    B, H, T, D = v.shape
    NC = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    return (  # contiguous, like the real outputs (empty_like would copy the strides of a permuted v)
        v.new_empty((B, H, T, D)),
        v.new_empty((B, H, T, D) if v.dtype != torch.float32 else (0,)),
        torch.empty(B, H, T, D, **f32),
        torch.empty((B, H, T) if kernel == "softmax" else (1,), **f32),
        torch.empty(B * H, NC, chunk, chunk, **f32),
    )


def _u_bwd(du, k, w, beta, u, u_lo, h, lse, xinv, kernel, scale, chunk, lowp):
    """Launch the backward kernels: (dk, dv, dw, dbeta)."""
    B, H, T, D = k.shape
    BH, NC, C = B * H, triton.cdiv(T, chunk), chunk
    prec, xprec, lowp, split, launch = _triton_cfg(k, chunk, lowp)
    kid = _KERNEL_IDS[kernel]
    k, w, beta, du = (x.contiguous() for x in (k, w, beta, du))
    gb = k.new_empty(k.shape)  # beta G, read by the backward recurrence and by dK / dW (+ its low half)
    gb_lo = k.new_empty(k.shape) if split else gb
    u_lo = u_lo if split else u
    dv = torch.empty(B, H, T, D, device=k.device, dtype=k.dtype)
    dk, dw = k.new_empty(k.shape), w.new_empty(w.shape)  # contiguous, as the fake says
    dbeta = torch.empty(B, H, T, device=k.device, dtype=beta.dtype)  # stored in beta's dtype: no cast kernel
    rowterm = torch.empty(B, H, T, device=k.device, dtype=torch.float32)
    counters = torch.zeros(BH + 1, device=k.device, dtype=torch.int32)
    dkw = D <= DK_IN_WAVEFRONT_MAX_D
    with _device_guard(k):
        _bwd_g_kernel[(BH * NC,)](
            w, k, du, beta, h, lse, xinv, gb, gb_lo, dv, dbeta, rowterm, counters, counters[BH:], u, u_lo, dk,
            scale, T, NC, BH, KERNEL=kid, D=D, C=C, SPLIT=split, PREC=prec, XPREC=xprec,
            SPIN_LIMIT=_SPIN_LIMIT, DKW=dkw, LOWP=lowp, **launch,
        )  # fmt: skip
        args = (w, k, u, u_lo, gb, gb_lo, lse, rowterm, dk, dw, scale, T, NC)
        consts = dict(KERNEL=kid, D=D, C=C, LOWP=lowp, PREC=prec, SPLIT=split)
        if not dkw:  # dK not already done by the wavefront
            dk_launch = {"num_stages": LAUNCH["num_stages_dk"], **launch}
            _dk_dw_kernel[(NC, BH)](*args, **consts, ROLE=0, **dk_launch)
        _dk_dw_kernel[(NC, BH)](*args, **consts, ROLE=1, **launch)
    return dk, dv, dw, dbeta


@torch.library.custom_op("deltaformer::u_bwd", mutates_args=())
def _u_bwd_op(
    du: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, u: torch.Tensor,
    u_lo: torch.Tensor, h: torch.Tensor, lse: torch.Tensor, xinv: torch.Tensor,
    kernel: str, scale: float, chunk: int, lowp: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _u_bwd(du, k, w, beta, u, u_lo, h, lse, xinv, kernel, scale, chunk, lowp)


@_u_bwd_op.register_fake
def _(du, k, w, beta, u, u_lo, h, lse, xinv, kernel, scale, chunk, lowp):
    return k.new_empty(k.shape), k.new_empty(k.shape), w.new_empty(w.shape), beta.new_empty(beta.shape)


def _u_setup(ctx, inputs, output):
    k, v, w, beta, kernel, scale, chunk, lowp = inputs
    u, u_lo, h, lse, xinv = output
    ctx.save_for_backward(k, w, beta, u, u_lo, h, lse, xinv)
    ctx.cfg = (kernel, scale, chunk, lowp)


def _u_grads(ctx, du, bwd):
    """The gradients of (k, v, w, beta, and the four non-tensor arguments) by bwd (`_u_bwd` or its op)."""
    return *bwd(du, *ctx.saved_tensors, *ctx.cfg), None, None, None, None


def _u_backward(ctx, du, *_unused):  # u_lo, h, lse, xinv are saved state, not differentiated
    return _u_grads(ctx, du, _u_bwd_op)


torch.library.register_autograd("deltaformer::u_fwd", _u_backward, setup_context=_u_setup)


class _UStage(torch.autograd.Function):
    """The same forward and backward outside torch.compile, for eager calls: a custom op call costs
    ~0.1-0.2 ms of host time per forward+backward (dispatch, its autograd wrapper, Dynamo guards), as much as
    the GPU time of small inputs."""

    @staticmethod
    def forward(ctx, k, v, w, beta, kernel, scale, chunk, lowp):
        out = _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp)
        _u_setup(ctx, (k, v, w, beta, kernel, scale, chunk, lowp), out)
        return out[0]

    @staticmethod
    def backward(ctx, du):
        return _u_grads(ctx, du, _u_bwd)


def deltaformer_u_triton(k, v, w, beta, kernel="softmax", scale=None, chunk=64, lowp=None):
    """Stage 1 by the Triton kernels: u [B, H, T, D] in v's dtype, differentiable in k, v, w, beta.

    chunk: rows per tile (power of two, 16..128). lowp: half-precision operands in the non-recurrent
    O(T^2) products of the backward (default: when the inputs are bf16/fp16; lowp=False costs ~30% more GPU
    time and removes their error, see the package docstring); fp32 inputs ignore it. scale: softmax kappa's
    (default 1/sqrt(D)); relu and linear ignore it: their kappa is that of unit k, w at scale 1, the norms
    folded into beta, v and u in PyTorch around the kernels (below).
    """
    if kernel not in KERNELS:
        raise ValueError(f"deltaformer: kernel must be one of {KERNELS}, got {kernel!r}")
    if not (k.dtype == v.dtype == w.dtype):
        raise ValueError(
            f"deltaformer (triton): k, v, w must share a dtype, got {k.dtype}, {v.dtype}, {w.dtype}"
        )
    _triton_cfg(v, chunk, lowp)  # clear errors before any launch
    s = float(default_scale(k.shape[-1], scale))
    half = v.dtype != torch.float32
    lowp = half if lowp is None else bool(lowp) and half
    if kernel == "softmax":
        return _u_stage(k, v, w, beta, kernel, s, chunk, lowp)
    # relu / linear: kappa(w_i, k_j) = r_i kappa(w_i.k_j) c_j with r = 1 / |w|, c = 1 / |k| (`_inv_norm`),
    # so u = U~ / c with U~ the solution for the raw k, w at scale 1, v~ = c v and beta~ = beta r c (fp32):
    # the kernels score the inputs exactly. Unit vectors rounded to bf16 instead have kappa(k, k) =
    # 1 +- ~1e-3, which the reflection regime amplified to ~8e-3 of u at T = 512 (vs 1.7e-3 here: u's own
    # rounding); what remains is the rounding of v~, ~4e-4 of u before its final rounding.
    c = _inv_norm(k)
    r = c if w is k else _inv_norm(w)
    v_t = (v.to(c.dtype) * c).to(v.dtype)
    beta_t = beta.to(c.dtype) * (r * c)[..., 0]
    u_t = _u_stage(k, v_t, w, beta_t, kernel, 1.0, chunk, lowp)
    return (u_t.to(c.dtype) / c).to(v.dtype)


def _u_stage(k, v, w, beta, kernel, scale, chunk, lowp):
    """The Triton stage 1 of exactly these inputs (`scale * w.k` scores), differentiable: the custom op
    under torch.compile, `_UStage` in eager mode."""
    if torch.compiler.is_compiling():
        return _u_fwd_op(k, v, w, beta, kernel, scale, chunk, lowp)[0]
    return _UStage.apply(k, v, w, beta, kernel, scale, chunk, lowp)
