"""The Triton helpers the DDL kernels share: the two tiles (a token's [d, d_v] state; a run of tokens by a
block of d), the causal conv's taps and token windows, a scalar condition as a vector mask, and the state's
rounding to its stored dtype (to nearest, or stochastic: `_stored`)."""

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
