"""The Triton helpers Deltaformer's stage-1 kernels share: the wavefront's tickets, progress counters and
tiles, the matrix products at the precision each needs (split hi + lo operands for the recurrence), the
kappa scores and their derivatives, the in-chunk unit lower-triangular inverse, online log-sum-exps, the
document starts of packed rows."""

import triton
import triton.language as tl

from .naive import NORM_EPS as _EPS

NORM_EPS = tl.constexpr(_EPS)  # relu / linear keys: x / max(|x|, NORM_EPS)
CLAMPED = tl.constexpr(1.0 / _EPS)  # the inverse norm of a key at or below NORM_EPS


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
def _scores(a, B, mask, scale, ra, rb, PREC: tl.constexpr, NORM: tl.constexpr):
    """The scores of a against the block b loaded at pointers B (masked rows 0 unless mask is None), scaled
    as `_scaled` does."""
    if mask is None:
        b = tl.load(B)
    else:
        b = tl.load(B, mask=mask, other=0.0)
    return _scaled(tl.dot(a, tl.trans(b), input_precision=PREC), scale, ra, rb, NORM)


@triton.jit
def _scaled(s, scale, r, c, NORM: tl.constexpr):
    """Raw scores w_i.k_j as kappa takes them: scale * s (softmax), or (NORM: relu, linear) the scores of
    the unit vectors, s_ij r_i c_j with r, c the rows' and columns' inverse norms (`_inv_norms`). Scaling
    the fp32 product, not the operands, keeps the scores exact: unit vectors rounded to bf16 have
    kappa(k, k) = 1 +- ~1e-3, which the reflection regime amplifies."""
    if NORM:
        s = s * r[:, None] * c[None, :]
    else:
        s = s * scale
    return s


@triton.jit
def _inv_norms(N, offs, mask, NORM: tl.constexpr):
    """NORM: 1 / max(|x|, NORM_EPS) of the rows at offs, from their norms |x| (fp32, `_row_norms`); else
    unused zeros."""
    r = (offs * 0).to(tl.float32)
    if NORM:
        r = 1.0 / tl.maximum(tl.load(N + offs, mask=mask, other=1.0), NORM_EPS)
    return r


@triton.jit
def _key_grad(acc, x, c, scale, NORM: tl.constexpr):
    """The gradient of a block of raw keys x (k_j, or w_i) from what the dK / dW loops summed over the other
    side: softmax, acc = sum dS_ij (the other side's key): scale * acc. NORM, acc the same with dS_ij times
    the other side's inverse norm: with c = 1 / max(|x|, eps) the keys' inverse norms (`_inv_norms`; no
    gradient through the clamp), d(c x.y)/dx = c y - c^3 (x.y) x, so the gradient is c acc - c^3 (x.acc) x
    (x.acc = sum dS_ij S_ij / c: no sum over the score blocks of its own)."""
    if NORM:
        xf = x.to(tl.float32)
        radial = tl.where(c < CLAMPED, c * c * c * tl.sum(xf * acc, axis=1), 0.0)
        acc = c[:, None] * acc - radial[:, None] * xf
    else:
        acc = acc * scale
    return acc


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
def _wavefront_tile(Ticket, T, NC, BH, D: tl.constexpr, C: tl.constexpr, REVERSED: tl.constexpr):
    """The wavefront tile this program's ticket names (module docstring): chunk c (REVERSED: counted from
    the last, for the backward) of head bh; (c, bh, bh as int64, offsets in the chunk and in D, the chunk's
    rows, their mask, the tile's [C, D] offsets)."""
    ticket = tl.atomic_add(Ticket, 1)
    c = ticket // BH
    if REVERSED:
        c = NC - 1 - c
    bh = ticket % BH
    bh64 = bh.to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    rows = c * C + offs_c
    rmask = rows < T
    return c, bh, bh64, offs_c, offs_d, rows, rmask, bh64 * T * D + rows[:, None] * D + offs_d[None, :]


@triton.jit
def _doc_starts(DS, bh, H, T, rows, rmask):
    """doc_start [B, T] of these rows of head bh's sequence (batch bh // H); 0 past T."""
    return tl.load(DS + (bh // H) * T + rows, mask=rmask, other=0)


@triton.jit
def _first_chunk(DS, bh, H, T, c, C: tl.constexpr):
    """The first chunk of keys a row of chunk c can see: its first row's document's (doc_start is
    non-decreasing along the rows, so no later row sees an earlier key), at least 0."""
    return tl.maximum(tl.load(DS + (bh // H) * T + c * C) // C, 0)
