"""The Triton helpers the DDL kernels share: the two tiles (a token's [d, d_v] state; a run of tokens by a
block of d), the causal conv's taps (a tuple of tiles) and the token each tap links, the TC read-out's
gradient and its forward in token order, a scalar condition as a vector mask, and the state's rounding to
its stored dtype (to nearest, or stochastic: `_stored`)."""

import triton
import triton.language as tl


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
def _chan_tile(D, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr):
    # the per-channel kernels' tile: a run of tokens (program 0) x a block of d (program 1) x d_v
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_V)
    md = offs_d < D
    mv = offs_v < DV
    m2 = md[:, None] & mv[None, :]
    off2 = offs_d[:, None] * DV + offs_v[None, :]
    return tl.program_id(0).to(tl.int64), offs_d, offs_v, md, mv, m2, off2


@triton.jit
def _taps(WT, off2, m2, D, DV: tl.constexpr, KW: tl.constexpr, CT: tl.constexpr):
    # the KW conv taps of the tile as a tuple of [BLOCK_D, BLOCK_V] tiles: sums over taps and each tap's
    # gradient stay in the tile's own layout (a [KW, BLOCK_D, BLOCK_V] tensor's reductions and broadcasts
    # go through shared memory, with barriers, at every token)
    taps = ()
    for j in tl.static_range(KW):
        taps = taps + (tl.load(WT + j * D * DV + off2, mask=m2, other=0.0).to(CT),)
    return taps


@triton.jit
def _zeros_each(tiles):
    zeros = ()
    for j in tl.static_range(len(tiles)):
        zeros = zeros + (tl.zeros_like(tiles[j]),)
    return zeros


@triton.jit
def _store_taps(P, tiles, off2, m2, D, DV: tl.constexpr):
    # a tuple of per-tap [BLOCK_D, BLOCK_V] tiles (e.g. the taps' gradient) to P [KW, d, d_v]
    for j in tl.static_range(len(tiles)):
        tl.store(P + j * D * DV + off2, tiles[j], mask=m2)


@triton.jit
def _in_doc(src, dst, ok, DS, T):
    # whether output token dst's tap reading input token src stays in dst's document: src's position in the
    # sequence >= DS[dst] (its document's first token, in the same frame); ok: dst is a token
    return src % T >= tl.load(DS + dst, mask=ok, other=0)


@triton.jit
def _tap_token(n, j: tl.constexpr, T, N, KW: tl.constexpr, PAST: tl.constexpr, DS, DOC: tl.constexpr):
    # the token tap j links to token n within its sequence of T (rows of N), and whether there is one:
    # PAST, the input n - (KW-1) + j that the causal conv's output n reads; else the output
    # n + (KW-1) - j that reads input n. DOC: and within the output's document (DS [N], doc_start)
    t = n % T
    if PAST:
        tok, ok = n - (KW - 1) + j, (n < N) & (t - (KW - 1) + j >= 0)
        if DOC:
            ok = ok & _in_doc(tok, n, ok, DS, T)
    else:
        tok, ok = n + (KW - 1) - j, (n < N) & (t + (KW - 1) - j < T)
        if DOC:
            ok = ok & _in_doc(n, tok, ok, DS, T)
    return tok, ok


@triton.jit
def _read_out_grad(n, j: tl.constexpr, DH, T, N, D, offs_d, md, KW: tl.constexpr, CT: tl.constexpr, DS,
                   DOC: tl.constexpr):  # fmt: skip
    # the gradient (of DH [N, d]) of the TC read-out that reads token n through tap j, token n + KW-1-j's
    # (zeros past the end of n's sequence, or, DOC, where n is before that token's document), as a
    # [BLOCK_D, 1] column
    dst, reads = _tap_token(n, j, T, N, KW, False, DS, DOC)
    return tl.load(DH + dst * D + offs_d, mask=md & _vec_mask(reads, offs_d), other=0.0).to(CT)[:, None]


@triton.jit
def _tc_read_out_grads(taps, dw, x, n, DH, T, N, D, offs_d, md, KW: tl.constexpr, CT: tl.constexpr, DS,
                       DOC: tl.constexpr):  # fmt: skip
    # the TC read-outs that read token n's state tile x: the gradient they send x, sum_j taps[j] dh_j, and
    # the taps' gradients so far, dw[j] + dh_j x
    gx = tl.zeros_like(x)
    dw_next = ()
    for j in tl.static_range(KW):
        dh = _read_out_grad(n, j, DH, T, N, D, offs_d, md, KW, CT, DS, DOC)
        gx += taps[j] * dh
        dw_next = dw_next + (dw[j] + dh * x,)
    return gx, dw_next


@triton.jit
def _tc_read_out_start(BLOCK_D: tl.constexpr, KW: tl.constexpr, CT: tl.constexpr):
    # the TC read-out's partial sums in token order (_tc_read_out_step) before the first token: KW-1 zeros
    acc = ()
    for _ in tl.static_range(KW - 1):
        acc = acc + (tl.zeros([BLOCK_D], dtype=CT),)
    return acc


@triton.jit
def _tc_read_out_keeps(s, DS, T, N, KW: tl.constexpr, DOC: tl.constexpr):
    # DOC: whether token s is in the documents of the outputs s .. s+KW-1 that read it (scalars, not masks
    # over the tile: fewer registers; tokens past the end: True, as the sequence's start resets their sums)
    keeps = ()
    if DOC:
        for i in tl.static_range(KW):
            dst = s + i
            keeps = keeps + (_in_doc(s, dst, (dst >= 0) & (dst < N), DS, T),)
    return keeps


@triton.jit
def _tc_read_out_step(taps, acc, x, starts, keeps, DOC: tl.constexpr):
    # the TC read-out in token order, token s's state tile x: h[s] = acc[0] + sum_v taps[KW-1] x, and
    # acc[i], the partial read-out of token s+1+i from the tokens before it, with s's term added (through
    # tap KW-2-i); starts (s is its sequence's first token): nothing earlier reaches on. DOC: s's term only
    # where s is in the reading token's document (keeps, _tc_read_out_keeps)
    KW: tl.constexpr = len(taps)
    h = tl.sum(taps[KW - 1] * x, axis=1)
    if DOC:
        h = tl.where(keeps[0], h, 0.0)
    if KW > 1:
        h += tl.where(starts, 0.0, acc[0])
    acc_next = ()
    for i in tl.static_range(KW - 1):
        part = tl.sum(taps[KW - 2 - i] * x, axis=1)
        if DOC:
            part = tl.where(keeps[i + 1], part, 0.0)
        if i + 1 < KW - 1:
            part += tl.where(starts, 0.0, acc[i + 1])
        acc_next = acc_next + (part,)
    return h, acc_next


@triton.jit
def _mix32(h):
    # murmur3's 32-bit finaliser: a bijection of uint32 in which every output bit depends on every input bit
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _stored(x, SEED, idx, OUT_T: tl.constexpr, SR: tl.constexpr):
    """x (fp32) as the state stores it in OUT_T: rounded to nearest, or, SR (a bf16 state), stochastically:
    16 random bits added below bf16's last bit, then cut off, so x goes to its bf16 neighbour away from zero
    with probability equal to the fraction of that step it lies beyond the one toward zero. The bits are a
    hash of the update's seed (SEED, one integer) and the element's index idx in the [N, d, d_v] state (mod
    2^32), so that a backward rebuilding the state draws the forward's. The same rounding:
    naive.round_state."""
    if SR:
        bits = _mix32(idx.to(tl.uint32) ^ _mix32(tl.load(SEED).to(tl.uint32)))
        u = (x.to(tl.float32).to(tl.uint32, bitcast=True) + (bits & 0xFFFF)) & 0xFFFF0000
        x = tl.where(x == x, u.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    return x.to(OUT_T)
