"""The per-channel DDL kernels: the CC read-out, the TC read-out (a causal depthwise conv over tokens, then
the read over d_v) and the EC expansion, forward and backward. A program takes a block of d by a run of
tokens; weight gradients go to per-program fp32 partials. Launched from triton.py."""

import triton
import triton.language as tl

from .triton_common import (
    _chan_tile,
    _store_taps,
    _tap_token,
    _taps,
    _tc_read_out_grads,
    _tc_read_out_keeps,
    _tc_read_out_start,
    _tc_read_out_step,
    _vec_mask,
    _zeros_each,
)


@triton.jit
def _cc_fwd_kernel(
    X, W, H, N, D,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
    CT: tl.constexpr,
):  # fmt: skip
    pid, offs_d, offs_v, md, mv, m2, off2 = _chan_tile(D, DV, BLOCK_D, BLOCK_V)
    w = tl.load(W + off2, mask=m2, other=0.0).to(CT)
    for tt in tl.static_range(TOKENS):
        n = pid * TOKENS + tt
        okd = _vec_mask(n < N, offs_d)
        x = tl.load(X + n * D * DV + off2, mask=(md & okd)[:, None] & mv[None, :], other=0.0).to(CT)
        tl.store(H + n * D + offs_d, tl.sum(x * w, axis=1).to(H.dtype.element_ty), mask=md & okd)


@triton.jit
def _cc_bwd_kernel(
    X, W, DH, DX, DWP, N, D, TOKENS,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    pid, offs_d, offs_v, md, mv, m2, off2 = _chan_tile(D, DV, BLOCK_D, BLOCK_V)
    w = tl.load(W + off2, mask=m2, other=0.0).to(CT)
    dw = tl.zeros([BLOCK_D, BLOCK_V], dtype=CT)
    for tt in range(TOKENS):
        n = pid * TOKENS + tt
        okd = _vec_mask(n < N, offs_d)
        mn = (md & okd)[:, None] & mv[None, :]
        dh = tl.load(DH + n * D + offs_d, mask=md & okd, other=0.0).to(CT)
        x = tl.load(X + n * D * DV + off2, mask=mn, other=0.0).to(CT)
        tl.store(DX + n * D * DV + off2, (dh[:, None] * w).to(DX.dtype.element_ty), mask=mn)
        dw += dh[:, None] * x
    tl.store(DWP + pid * D * DV + off2, dw, mask=m2)


@triton.jit
def _tc_fwd_kernel(
    X, WT, H, DS, N, T, D, TOKENS,
    KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, STAGES: tl.constexpr,
    DOC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # h[n] = sum_j sum_v WT[j] * x[n - (KW-1) + j] within the token's sequence (WT = conv * read), reading
    # each x once: a program goes through its TOKENS tokens (and the KW-1 before them) in order. Token s
    # reaches the read-outs of s .. s+KW-1, s+i through tap KW-1-i. acc[i] holds the partial read-out of
    # token s+i from the tokens before s, so with s added acc[0] is h[s] and the rest move down one slot. At
    # a sequence's first token nothing earlier reaches on: acc starts from zeros there. DOC: DS [N] holds each
    # token's doc_start, and s's terms go only to the read-outs of its own document.
    pid, offs_d, offs_v, md, mv, m2, off2 = _chan_tile(D, DV, BLOCK_D, BLOCK_V)
    taps = _taps(WT, off2, m2, D, DV, KW, CT)
    acc = _tc_read_out_start(BLOCK_D, KW, CT)
    for i in tl.range(0, TOKENS + KW - 1, num_stages=STAGES):  # STAGES > 1: the next loads in flight
        s = pid * TOKENS - (KW - 1) + i
        inside = _vec_mask((s >= 0) & (s < N), offs_d)
        starts = _vec_mask(s % T == 0, offs_d)
        x = tl.load(X + s * D * DV + off2, mask=(md & inside)[:, None] & mv[None, :], other=0.0).to(CT)
        keeps = _tc_read_out_keeps(s, DS, T, N, KW, DOC)
        h, acc = _tc_read_out_step(taps, acc, x, starts, keeps, DOC)
        own = md & inside & _vec_mask(s >= pid * TOKENS, offs_d)  # the KW-1 before the run only feed it
        tl.store(H + s * D + offs_d, h.to(H.dtype.element_ty), mask=own)


@triton.jit
def _ec_fwd_kernel(
    E, WT, X0, DS, N, T, D,
    KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
    DOC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # X0[n] = sum_j WT[j] * emb[n - (KW-1) + j][:, None] (DOC: the taps within n's document, DS [N])
    pid, offs_d, offs_v, md, mv, m2, off2 = _chan_tile(D, DV, BLOCK_D, BLOCK_V)
    taps = _taps(WT, off2, m2, D, DV, KW, CT)
    for tt in tl.static_range(TOKENS):
        n = pid * TOKENS + tt
        out = tl.zeros_like(taps[0])
        for j in tl.static_range(KW):
            src, reads = _tap_token(n, j, T, N, KW, True, DS, DOC)
            e = tl.load(E + src * D + offs_d, mask=md & _vec_mask(reads, offs_d), other=0.0).to(CT)
            out += taps[j] * e[:, None]
        mn = m2 & _vec_mask(n < N, offs_d)[:, None]
        tl.store(X0 + n * D * DV + off2, out.to(X0.dtype.element_ty), mask=mn)


@triton.jit
def _conv_bwd_kernel(
    A, WT, G, DA, DWP, DS, N, T, D, TOKENS,
    KW: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, EC: tl.constexpr,
    DOC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # The backward of the two causal depthwise convs over tokens (same sequence only; DOC: same document,
    # DS [N] the doc_start of each token), taps WT [KW, d, d_v]:
    # TC (A = x [N, d, d_v], G = dh [N, d]):  dx[n] = sum_j WT[j] dh[n + KW-1 - j];
    #     dWT[j] = sum_n dh[n + KW-1 - j] x[n]
    # EC (A = emb [N, d], G = dX0 [N, d, d_v]):  demb[n] = sum_j sum_v WT[j] G[n + KW-1 - j];
    #     dWT[j] = sum_n emb[n - (KW-1) + j][:, None] G[n]
    pid, offs_d, offs_v, md, mv, m2, off2 = _chan_tile(D, DV, BLOCK_D, BLOCK_V)
    taps = _taps(WT, off2, m2, D, DV, KW, CT)
    acc = _zeros_each(taps)
    for tt in range(TOKENS):
        n = pid * TOKENS + tt
        mn = m2 & _vec_mask(n < N, offs_d)[:, None]
        acc_next = ()
        if EC:
            g = tl.load(G + n * D * DV + off2, mask=mn, other=0.0).to(CT)
            de = tl.zeros([BLOCK_D], dtype=CT)
            for j in tl.static_range(KW):
                dst, reads = _tap_token(n, j, T, N, KW, False, DS, DOC)  # the output that reads token n
                gj = tl.load(G + dst * D * DV + off2, mask=m2 & _vec_mask(reads, offs_d)[:, None], other=0.0)
                de += tl.sum(taps[j] * gj.to(CT), axis=1)
                src, read = _tap_token(n, j, T, N, KW, True, DS, DOC)  # the input that output n reads
                e = tl.load(A + src * D + offs_d, mask=md & _vec_mask(read, offs_d), other=0.0).to(CT)
                acc_next = acc_next + (acc[j] + e[:, None] * g,)
            tl.store(DA + n * D + offs_d, de.to(DA.dtype.element_ty), mask=md & _vec_mask(n < N, offs_d))
        else:
            x = tl.load(A + n * D * DV + off2, mask=mn, other=0.0).to(CT)
            dx, acc_next = _tc_read_out_grads(taps, acc, x, n, G, T, N, D, offs_d, md, KW, CT, DS, DOC)
            tl.store(DA + n * D * DV + off2, dx.to(DA.dtype.element_ty), mask=mn)
        acc = acc_next
    _store_taps(DWP + pid * KW * D * DV, acc, off2, m2, D, DV)
