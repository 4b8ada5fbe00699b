"""The per-channel DDL kernels: the CC read-out, the TC read-out (a causal depthwise conv over tokens, then
the read over d_v) and the EC expansion, forward and backward. A program takes a block of d by a run of
tokens; weight gradients go to per-program fp32 partials. Launched from triton.py."""

import triton
import triton.language as tl

from .triton_common import _chan_tile, _taps, _vec_mask, _window


@triton.jit
def _cc_fwd_kernel(
    X, W, H, N, D,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, TOKENS: tl.constexpr,
    CT: tl.constexpr,
):  # fmt: skip
    pid, offs_d, offs_v, _, md, mv, _, m2, off2 = _chan_tile(D, 1, 1, DV, BLOCK_D, BLOCK_V)  # no taps
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
    pid, offs_d, offs_v, _, md, mv, _, m2, off2 = _chan_tile(D, 1, 1, DV, BLOCK_D, BLOCK_V)  # no taps
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
def _conv_bwd_kernel(
    A, WT, G, DA, DWP, N, T, D, TOKENS,
    KW: tl.constexpr, KP: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    EC: tl.constexpr, CT: tl.constexpr,
):  # fmt: skip
    # The backward of the two causal depthwise convs over tokens (same sequence only), taps WT [KW, d, d_v]:
    # TC (A = x [N, d, d_v], G = dh [N, d]):  dx[n] = sum_j WT[j] dh[n + KW-1 - j];
    #     dWT[j] = sum_n dh[n + KW-1 - j] x[n]
    # EC (A = emb [N, d], G = dX0 [N, d, d_v]):  demb[n] = sum_j sum_v WT[j] G[n + KW-1 - j];
    #     dWT[j] = sum_n emb[n - (KW-1) + j][:, None] G[n]
    pid, offs_d, offs_v, offs_j, md, mv, mj, m2, off2 = _chan_tile(D, KW, KP, DV, BLOCK_D, BLOCK_V)
    off3, m3, w3 = _taps(WT, offs_j, off2, mj, m2, D, DV, CT)
    acc = tl.zeros([KP, BLOCK_D, BLOCK_V], dtype=CT)
    for tt in range(TOKENS):
        n = pid * TOKENS + tt
        okd = offs_d * 0 + n < N  # vector masks (the interpreter rejects scalar & vector)
        dst, valid = _window(n, T, N, offs_j, mj, KW, False)  # the outputs that read token n
        if EC:
            g3 = tl.load(
                G + dst[:, None, None] * D * DV + off2[None], mask=valid[:, None, None] & m2[None], other=0.0
            )
            de = tl.sum(tl.sum(w3 * g3.to(CT), axis=0), axis=1)
            tl.store(DA + n * D + offs_d, de.to(DA.dtype.element_ty), mask=md & okd)
            src, vp = _window(n, T, N, offs_j, mj, KW, True)
            e2 = tl.load(A + src[:, None] * D + offs_d[None, :], mask=vp[:, None] & md[None, :], other=0.0)
            g = tl.load(G + n * D * DV + off2, mask=m2 & okd[:, None], other=0.0).to(CT)
            acc += e2.to(CT)[:, :, None] * g[None, :, :]
        else:
            dh2 = tl.load(
                G + dst[:, None] * D + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0
            )
            dh2 = dh2.to(CT)
            x = tl.load(A + n * D * DV + off2, mask=m2 & okd[:, None], other=0.0).to(CT)
            dx = tl.sum(w3 * dh2[:, :, None], axis=0)
            tl.store(DA + n * D * DV + off2, dx.to(DA.dtype.element_ty), mask=m2 & okd[:, None])
            acc += dh2[:, :, None] * x[None, :, :]
    tl.store(DWP + pid * KW * D * DV + off3, acc, mask=m3)
