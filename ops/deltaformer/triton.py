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
     launch, shortening the chain with extra products, or forming the log-sum-exps online and X_c in the
     tile without prep, all added time: bench/RESULTS.md).
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
relu and linear score unit vectors, S_ij = r_i (w_i.k_j) c_j with r, c the inverse norms of w_i and k_j
(`_scaled`; the norms by one small kernel in the forward, `_row_norms`): with
acc_j = sum_i dS_ij r_i w_i, dK_j = c_j acc_j - c_j^3 (k_j . acc_j) k_j, and dW likewise (`_key_grad`).

Packed documents (doc_start, a [B, T] int tensor, passed to the kernels as DS; None: the kernels compile
without any of it): A_ij = 0 unless doc_start_i <= j, in every block the kernels form, and the softmax
log-sum-exps run over the row's document. doc_start is non-decreasing, so the rows of chunk c see no key
before its first row's document start: the prep kernel, the forward wavefront and the dW pass start at that
key chunk; the backward wavefront and the dK pass stop at the first row chunk that sees none of the column
chunk (`_row_chunk_ends`). The wavefronts still wait for the chunks they skip: tiles publish in chunk order.
"""

import contextlib

import torch
import triton

from ..common import default_scale
from .naive import KERNELS, check_doc_start
from .triton_bwd import _bwd_g_kernel, _dk_dw_kernel
from .triton_fwd import _fwd_kernel, _prep_kernel, _row_norms_kernel

_KERNEL_IDS = {"softmax": 0, "relu": 1, "linear": 2}
_SPIN_LIMIT = 20_000_000  # ~10 s of spinning: only a bug gets there


# Launch options; the measurements are forward+backward on an H200 at B,H,T,D = 8,12,1024,64.
LAUNCH = {
    "num_warps": {
        16: 4,
        32: 4,
        64: 4,
        128: 8,
    },  # by chunk (at D = 128 and chunk 64, 8 warps: 1.19 vs 0.78 ms)
    "num_stages_large_tiles": 2,  # fp32 operands or D = 128: three stages overflow shared memory
    # the backward wavefront's at D = 128 (its loads not pipelined, less shared memory a program): the model's
    # Deltaformer step (bench/RESULTS.md); at D = 64 it keeps the stages above
    "num_stages_bwd_g": 1,
    "num_stages_dk": 2,  # the dK pass: 131 -> 104 us, where two stages cost the wavefronts 4%
    "norm_rows": 16,  # rows a program of `_row_norms_kernel` takes (untuned; 64 holds 32-48 registers)
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


def _row_norms(k, w, same):
    """relu / linear: the fp32 norms [|w_i|, |k_j|] [2, B, H, T] of contiguous k, w the kernels scale the
    scores by (`_scaled`), k read once when w is k (same); made by the forward, saved for the backward."""
    B, H, T, D = k.shape
    norms = torch.empty(2, B, H, T, device=k.device, dtype=torch.float32)
    rows = B * H * T
    _row_norms_kernel[(triton.cdiv(rows, LAUNCH["norm_rows"]),)](
        w, k, norms, rows, D=D, ROWS=LAUNCH["norm_rows"], SAME=same, num_warps=4
    )
    return norms


def _row_chunk_ends(doc_start, chunk, NC):
    """[B, NC] int32: the row chunks from ends[b, c] on hold no row i with doc_start_i < (c + 1) chunk, so
    none of them sees a key of chunk c (the rows are sorted by doc_start)."""
    bounds = (torch.arange(1, NC + 1, device=doc_start.device, dtype=doc_start.dtype) * chunk).expand(
        doc_start.shape[0], NC
    )
    rows = torch.searchsorted(doc_start, bounds.contiguous())  # rows with doc_start < (c + 1) chunk
    return ((rows + chunk - 1) // chunk).to(torch.int32)


def _device_guard(x):
    """Launch on the inputs' device, whatever the current one is."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# The kernels are wrapped as torch.library custom ops (forward and backward each one op, the autograd
# formula registered on the forward) so that torch.compile treats them as opaque calls with known output
# shapes (register_fake) instead of tracing into the Triton launches, which broke Inductor before.
# u_lo (the low half of u, `_store_split`) is empty for fp32 inputs.


def _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp, doc_start=None):
    """Launch the forward kernels: (u, u_lo, h, lse, xinv, norms), what the backward needs."""
    B, H, T, D = v.shape
    BH, NC, C = B * H, triton.cdiv(T, chunk), chunk
    prec, xprec, lowp, split, launch = _triton_cfg(v, chunk, lowp)
    kid, norm, same = _KERNEL_IDS[kernel], kernel != "softmax", w is k
    k, w, beta = (x.contiguous() for x in (k, w, beta))
    # (doc_start, H) of the masked kernels; without a mask, constexpr Nones: the kernels as they were
    doc = (None, None) if doc_start is None else (doc_start.contiguous(), H)
    v = v if v.stride(-1) == 1 else v.contiguous()  # read through its strides: no copy of a view
    f32 = dict(device=v.device, dtype=torch.float32)
    u = v.new_empty(v.shape)  # contiguous, as the fake says
    u_lo = v.new_empty(v.shape) if split else v.new_empty(0)
    h = torch.empty(B, H, T, D, **f32)
    lse = torch.empty(B, H, T, **f32) if kernel == "softmax" else torch.zeros(1, **f32)  # placeholder
    xinv = torch.empty(BH, NC, C, C, **f32)
    counters = torch.zeros(BH + 1, device=v.device, dtype=torch.int32)  # progress per (b, h); the ticket
    with _device_guard(v):
        norms = _row_norms(k, w, same) if norm else v.new_empty(0, dtype=torch.float32)  # softmax: unused
        nw, nk = norms if norm else (norms, norms)
        _prep_kernel[(NC, BH)](
            w, k, nw, nk, beta, lse, xinv, scale, T, NC, *doc,
            KERNEL=kid, NORM=norm, D=D, C=C, PREC=prec, XPREC=xprec, **launch,
        )  # fmt: skip
        _fwd_kernel[(BH * NC,)](
            w, k, nw, nk, v, beta, u, u_lo if split else u, h, lse, xinv, counters, counters[BH:],
            scale, T, NC, BH, H, *v.stride()[:3], doc[0], KERNEL=kid, NORM=norm, D=D, C=C, SPLIT=split,
            PREC=prec, XPREC=xprec, SPIN_LIMIT=_SPIN_LIMIT, **launch,
        )  # fmt: skip
    return u, u_lo, h, lse, xinv, norms


@torch.library.custom_op("deltaformer::u_fwd", mutates_args=())
def _u_fwd_op(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
    kernel: str, scale: float, chunk: int, lowp: bool, doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp, doc_start)


@_u_fwd_op.register_fake
def _(k, v, w, beta, kernel, scale, chunk, lowp, doc_start=None):
    B, H, T, D = v.shape
    NC = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    return (  # contiguous, like the real outputs (empty_like would copy the strides of a permuted v)
        v.new_empty((B, H, T, D)),
        v.new_empty((B, H, T, D) if v.dtype != torch.float32 else (0,)),
        torch.empty(B, H, T, D, **f32),
        torch.empty((B, H, T) if kernel == "softmax" else (1,), **f32),
        torch.empty(B * H, NC, chunk, chunk, **f32),
        torch.empty((2, B, H, T) if kernel != "softmax" else (0,), **f32),
    )


def _u_bwd(du, k, w, beta, u, u_lo, h, lse, xinv, norms, kernel, scale, chunk, lowp, doc_start=None):
    """Launch the backward kernels: (dk, dv, dw, dbeta)."""
    B, H, T, D = k.shape
    BH, NC, C = B * H, triton.cdiv(T, chunk), chunk
    prec, xprec, lowp, split, launch = _triton_cfg(k, chunk, lowp)
    kid, norm = _KERNEL_IDS[kernel], kernel != "softmax"
    nw, nk = norms if norm else (norms, norms)
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
    g_launch = {**launch, "num_stages": LAUNCH["num_stages_bwd_g"]} if D == 128 else launch
    doc = (None, None, None)  # (doc_start, row chunk ends, H) of the masked kernels: as in `_u_fwd`
    if doc_start is not None:
        doc = (doc_start.contiguous(), _row_chunk_ends(doc_start.contiguous(), C, NC), H)
    with _device_guard(k):
        _bwd_g_kernel[(BH * NC,)](
            w, k, nw, nk, du, beta, h, lse, xinv, gb, gb_lo, dv, dbeta, rowterm, counters, counters[BH:], u,
            u_lo, dk, scale, T, NC, BH, *doc, KERNEL=kid, NORM=norm, D=D, C=C, SPLIT=split,
            PREC=prec, XPREC=xprec, SPIN_LIMIT=_SPIN_LIMIT, DKW=dkw, LOWP=lowp, **g_launch,
        )  # fmt: skip
        args = (w, k, nw, nk, u, u_lo, gb, gb_lo, lse, rowterm, dk, dw, scale, T, NC, *doc)
        consts = dict(KERNEL=kid, NORM=norm, D=D, C=C, LOWP=lowp, PREC=prec, SPLIT=split)
        if not dkw:  # dK not already done by the wavefront
            dk_launch = {"num_stages": LAUNCH["num_stages_dk"], **launch}
            _dk_dw_kernel[(NC, BH)](*args, **consts, ROLE=0, **dk_launch)
        _dk_dw_kernel[(NC, BH)](*args, **consts, ROLE=1, **launch)
    return dk, dv, dw, dbeta


@torch.library.custom_op("deltaformer::u_bwd", mutates_args=())
def _u_bwd_op(
    du: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, u: torch.Tensor,
    u_lo: torch.Tensor, h: torch.Tensor, lse: torch.Tensor, xinv: torch.Tensor, norms: torch.Tensor,
    kernel: str, scale: float, chunk: int, lowp: bool, doc_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _u_bwd(du, k, w, beta, u, u_lo, h, lse, xinv, norms, kernel, scale, chunk, lowp, doc_start)


@_u_bwd_op.register_fake
def _(du, k, w, beta, u, u_lo, h, lse, xinv, norms, kernel, scale, chunk, lowp, doc_start=None):
    return k.new_empty(k.shape), k.new_empty(k.shape), w.new_empty(w.shape), beta.new_empty(beta.shape)


def _u_setup(ctx, inputs, output):
    k, v, w, beta, kernel, scale, chunk, lowp, doc_start = inputs
    u, u_lo, h, lse, xinv, norms = output
    ctx.save_for_backward(k, w, beta, u, u_lo, h, lse, xinv, norms, doc_start)
    ctx.cfg = (kernel, scale, chunk, lowp)


def _u_grads(ctx, du, bwd):
    """The gradients of (k, v, w, beta, and the five other arguments) by bwd (`_u_bwd` or its op)."""
    *saved, doc_start = ctx.saved_tensors
    return *bwd(du, *saved, *ctx.cfg, doc_start), None, None, None, None, None


def _u_backward(ctx, du, *_unused):  # u_lo, h, lse, xinv, norms are saved state, not differentiated
    return _u_grads(ctx, du, _u_bwd_op)


torch.library.register_autograd("deltaformer::u_fwd", _u_backward, setup_context=_u_setup)


class _UStage(torch.autograd.Function):
    """The same forward and backward outside torch.compile, for eager calls: a custom op call costs
    ~0.1-0.2 ms of host time per forward+backward (dispatch, its autograd wrapper, Dynamo guards), as much as
    the GPU time of small inputs."""

    @staticmethod
    def forward(ctx, k, v, w, beta, kernel, scale, chunk, lowp, doc_start):
        out = _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp, doc_start)
        _u_setup(ctx, (k, v, w, beta, kernel, scale, chunk, lowp, doc_start), out)
        return out[0]

    @staticmethod
    def backward(ctx, du):
        return _u_grads(ctx, du, _u_bwd)


def deltaformer_u_triton(k, v, w, beta, kernel="softmax", scale=None, chunk=64, lowp=None, doc_start=None):
    """Stage 1 by the Triton kernels: u [B, H, T, D] in v's dtype, differentiable in k, v, w, beta.

    chunk: rows per tile (power of two, 16..128). lowp: half-precision operands in the non-recurrent
    O(T^2) products of the backward (default: when the inputs are bf16/fp16; lowp=False costs ~30% more GPU
    time and removes their error, see the package docstring); fp32 inputs ignore it. scale: softmax kappa's
    (default 1/sqrt(D)); relu and linear ignore it: their kappa is that of unit k, w at scale 1, which the
    kernels form by scaling the raw scores by the rows' inverse norms (`_scaled`, `_key_grad`). doc_start
    [B, T] (int32 / int64): A_ij over doc_start_i <= j < i only (module docstring).
    """
    if kernel not in KERNELS:
        raise ValueError(f"deltaformer: kernel must be one of {KERNELS}, got {kernel!r}")
    if not (k.dtype == v.dtype == w.dtype):
        raise ValueError(
            f"deltaformer (triton): k, v, w must share a dtype, got {k.dtype}, {v.dtype}, {w.dtype}"
        )
    _triton_cfg(v, chunk, lowp)  # clear errors before any launch
    check_doc_start(doc_start, k.shape[0], k.shape[2], k.device, "deltaformer_u_triton")
    s = float(default_scale(k.shape[-1], scale))
    half = v.dtype != torch.float32
    lowp = half if lowp is None else bool(lowp) and half
    return _u_stage(k, v, w, beta, kernel, s if kernel == "softmax" else 1.0, chunk, lowp, doc_start)


def _u_stage(k, v, w, beta, kernel, scale, chunk, lowp, doc_start=None):
    """The Triton stage 1 of exactly these inputs (`scale * w.k` scores), differentiable: the custom op
    under torch.compile, `_UStage` in eager mode."""
    if torch.compiler.is_compiling():
        return _u_fwd_op(k, v, w, beta, kernel, scale, chunk, lowp, doc_start)[0]
    return _UStage.apply(k, v, w, beta, kernel, scale, chunk, lowp, doc_start)
