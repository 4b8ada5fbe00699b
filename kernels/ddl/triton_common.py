"""The Triton helpers the DDL kernels share: the two tiles (a token's [d, d_v] state; a run of tokens by a
block of d), the causal conv's taps and token windows, and a scalar condition as a vector mask."""

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
