"""DDL ops in Triton: the launch table, the torch.library custom ops (opaque to torch.compile, with fake
implementations) and their autograd around the kernels (triton_update.py: the update; triton_channel.py: CC,
TC, EC), and the functions that flatten the public functions' arguments for them.

The state is memory-bound work: each kernel reads and writes every [d, d_v] tile once and keeps all
arithmetic in registers (fp32, or float64 for float64 inputs so tests can be exact). The update needs
whole-token reductions over d (|k|, khat^T x; its backward, khat^T G), so one program owns whole tokens
(the forward stores rs and r for the backward to read), except the TC backward, which runs split: khat^T G
per token, then per-channel programs; compressors and EC are per-channel, so their programs take a block of
d and a run of tokens. Weight gradients are reduced over tokens inside a program into fp32 partials, summed
by torch.
"""

import torch
import triton
import triton.language as tl

from ..common import acc_dtype
from .triton_channel import (
    _cc_bwd_kernel,
    _cc_fwd_kernel,
    _conv_bwd_kernel,
    _ec_fwd_kernel,
    _tc_fwd_kernel,
)
from .triton_update import (
    _update_bwd_kernel,
    _update_fwd_kernel,
    _update_row_bwd_kernel,
    _update_row_fwd_kernel,
    _update_tc_bwd_kernel,
    _update_tc_fwd_kernel,
    _update_tc_gk_kernel,
)

# Launch shapes (tokens per program, warps, channel block for the per-channel kernels), tuned on an H200
# (update_bwd, tc_fwd, update_tc_fwd, tc_bwd: `python bench/bench_ddl.py --sweeps`, CUDA-graph GPU time; the
# other entries' sweeps: git history). An entry may hold a whole launch shape for one state dtype under that
# dtype's name ("bfloat16"), used instead of the entry's own for that dtype (`_cfg`). STAGES: a kernel's loop
# over a program's tokens software-pipelined (the next tokens' loads in flight) or, 1, plain. maxnreg
# (update_tc_fwd): the registers a thread may take (fewer: more programs an SM).
LAUNCH = {
    "update_fwd": dict(TOKENS=1, num_warps=4),
    "update_bwd": dict(TOKENS=32, STAGES=2, num_warps=4),
    "update_row": dict(  # d_v = 1 without a fused read-out; ROWS=0: the general kernel
        ROWS=2, num_warps=4, bfloat16=dict(ROWS=4, num_warps=8)
    ),
    # d_v = 1 with the next sublayer's norm and logits (triton_norm.py); the backward: STEPS tiles of ROWS
    # tokens a program, so that the weight-gradient partials stay small (untuned)
    "update_norm": dict(ROWS=2, num_warps=4),
    "update_norm_bwd": dict(ROWS=2, STEPS=16, num_warps=4),
    "chan_fwd": dict(TOKENS=4, BLOCK_D=256, num_warps=4),
    "chan_bwd": dict(TOKENS=64, BLOCK_D=256, num_warps=4),
    # the TC read-out's forward (_tc_fwd_kernel, one pass over the state in token order; also the update +
    # TC read-out's second kernel where update_tc_fwd is not FUSED); STAGES: its loads in flight
    "tc_fwd": dict(TOKENS=128, BLOCK_D=128, STAGES=3, num_warps=4),
    # FUSED: one kernel on runs of TOKENS whole tokens, not the update then _tc_fwd_kernel (a pass fewer)
    "update_tc_fwd": dict(  # a bf16 state: the two kernels (faster there)
        FUSED=True, TOKENS=32, STAGES=3, num_warps=8, maxnreg=128, bfloat16=dict(FUSED=False)
    ),
    # the fused update + TC read-out's backward, split: the gk reduction's shape (GK_*: one token a program,
    # [GK_BLOCK_D, d_v] at a time, 128 at 4 warps: a row per thread), then the per-channel kernel's, a run of
    # TOKENS by a block of d (128 at 4 warps: each thread holds a [4]-vector of the tile, the taps and their
    # gradient; 256 takes up to 255 registers, bench/compile_check.py); GK_STAGES, STAGES: their loops (over
    # d, over the run)
    "tc_bwd": dict(GK_BLOCK_D=128, GK_WARPS=4, GK_STAGES=1, TOKENS=32, BLOCK_D=128, STAGES=1, num_warps=4),
}
# Tests set this: every output starts as NaN, so that an element a kernel fails to write cannot pass.
_FILL_OUTPUTS_WITH_NAN = False


def _cfg(key, dtype):
    """The launch shape LAUNCH[key] holds for a state of this dtype (its per-dtype entry, else its own)."""
    cfg = LAUNCH[key]
    return cfg.get(str(dtype).removeprefix("torch."), cfg)


def _new(shape, like, dtype=None):
    dtype = like.dtype if dtype is None else dtype
    if _FILL_OUTPUTS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _ct(*tensors):
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


# ----------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with autograd. They take flat, contiguous
# tensors: state [N, d, d_v], vectors [N, d]; T (sequence length) for the token convolutions.


def _pow2(n):
    return triton.next_power_of_2(max(int(n), 1))


def _or(t, stand_in):
    """t, or where it is None a tensor that stands in for it in a kernel's arguments (its constexprs say
    that the kernel does not read it)."""
    return stand_in if t is None else t


def _use_rows(DV, weight, dtype):
    """d_v = 1 and no fused read-out: the [tokens, d] row kernels (unless LAUNCH turns them off)."""
    rows = _cfg("update_row", dtype)["ROWS"]
    if rows and rows != _pow2(rows):
        raise ValueError(f"LAUNCH['update_row'] ROWS for {dtype} must be 0 or a power of two, got {rows}")
    return DV == 1 and weight is None and rows > 0


def _chan_grid(N, D, cfg):
    return (triton.cdiv(N, cfg["TOKENS"]), triton.cdiv(D, cfg["BLOCK_D"]))


def _chain(ks, betas, rss, rr, seeds):
    """The backward kernels' CHAIN argument (see _rebuilt_state): the updates (ks[i], betas[i], rss[i],
    rr[i], seeds[i]) that made their state x from x0 (rebuild_from), as Triton tuples (no seeds: the states
    were rounded to nearest, and ks stand in for the seeds, unread)."""
    return (tuple(ks), tuple(betas), tuple(rss), tuple(rr), tuple(seeds or ks))


def _update_outputs(x, read_out):
    """The outputs of an update of x [N, d, d_v], unwritten: x_new, h [N, d] (read_out; else empty), and the
    terms rs [N], r [N, d_v] (fp32 or float64) that its backward and a later rebuild_from read."""
    (N, D, DV), ft = x.shape, acc_dtype(x)
    h = _new((N, D) if read_out else (0,), x)
    return _new(x.shape, x), h, _new((N,), x, dtype=ft), _new((N, DV), x, dtype=ft)


def _update_forward(x, k, v, beta, weight, eps, erase, seed):
    """(x_new, h, rs, r): the update, with weight also h = the CC read-out of x_new (else empty), and the
    terms rs, r (_update_outputs). seed: x_new rounded stochastically (triton_common._stored), else to
    nearest."""
    N, D, DV = x.shape
    x_new, h, rs, r = _update_outputs(x, weight is not None)
    ct = _ct(x, k, v, beta)
    if _use_rows(DV, weight, x.dtype):
        cfg = _cfg("update_row", x.dtype)
        _update_row_fwd_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
            x, k, v, beta, x_new, rs, r, x, x, x, x, x, _or(seed, x), N, D, eps, 0.0, ROWS=cfg["ROWS"],
            BLOCK_D=_pow2(D), ERASE=erase, NORM=False, SR=seed is not None, CT=ct, num_warps=cfg["num_warps"],
        )  # fmt: skip
        return x_new, h, rs, r
    cfg = LAUNCH["update_fwd"]
    _update_fwd_kernel[(triton.cdiv(N, cfg["TOKENS"]),)](
        x, k, v, beta, _or(weight, x), x_new, h, rs, r, _or(seed, x), N, D, eps,
        DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV), TOKENS=cfg["TOKENS"], ERASE=erase,
        COMPRESS=weight is not None, SR=seed is not None, CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return x_new, h, rs, r


def _fake_update_forward(x, weight):
    N, D, DV = x.shape
    ft = acc_dtype(x)
    h = x.new_empty((N, D) if weight is not None else (0,))
    return torch.empty_like(x), h, x.new_empty((N,), dtype=ft), x.new_empty((N, DV), dtype=ft)


@torch.library.custom_op("ddl::update", mutates_args=())
def _update_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor | None,
    eps: float, erase: bool, seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _update_forward(x, k, v, beta, weight, eps, erase, seed)


@_update_op.register_fake
def _(x, k, v, beta, weight, eps, erase, seed):
    return _fake_update_forward(x, weight)


# The backward ops read the update's stored rs and r instead of recomputing them, and v (khat^T x = v - r:
# one reduction over d a token, not two). They take the chain (ks, betas, rss, rr, seeds) of updates that
# made their state x from x0 (rebuild_from): given one, x is x0 and the kernels rebuild x in registers as
# they load it, elementwise. seed(s): the states were rounded stochastically, so the rebuild and x' (for the
# read-out's weight gradient) draw the forward's bits.
@torch.library.custom_op("ddl::update_bwd", mutates_args=())
def _update_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rs: torch.Tensor, r: torch.Tensor,
    weight: torch.Tensor | None, g: torch.Tensor, dh: torch.Tensor | None, erase: bool,
    seed: torch.Tensor | None, ks: list[torch.Tensor], betas: list[torch.Tensor], rss: list[torch.Tensor],
    rr: list[torch.Tensor], seeds: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D, DV = x.shape
    cfg = _cfg("update_bwd", x.dtype)
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    ct = _ct(x, k, v, beta, g)
    if _use_rows(DV, weight, x.dtype) and not ks:
        rcfg = _cfg("update_row", x.dtype)
        _update_row_bwd_kernel[(triton.cdiv(N, rcfg["ROWS"]),)](
            x, k, v, beta, rs, r, g, dx, dk, dv, dbeta, x, x, x, x, x, x, x, x, N, D, ROWS=rcfg["ROWS"],
            STEPS=1, BLOCK_D=_pow2(D), ERASE=erase, NORM=False, SR=False, CT=ct, num_warps=rcfg["num_warps"],
        )  # fmt: skip
        return dx, dk, dv, dbeta, x.new_empty(0)
    compress, chain = weight is not None, _chain(ks, betas, rss, rr, seeds)
    nprog = triton.cdiv(N, cfg["TOKENS"])
    dwp = _new((nprog, D, DV) if compress else (0,), x, dtype=acc_dtype(x))
    _update_bwd_kernel[(nprog,)](
        x, k, v, beta, rs, r, chain, _or(weight, x), g, _or(dh, g), dx, dk, dv, dbeta, dwp, _or(seed, x), N,
        D, TOKENS=cfg["TOKENS"], STAGES=cfg["STAGES"], DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV),
        ERASE=erase, COMPRESS=compress, SR=seed is not None, CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    dw = dwp.sum(0).to(weight.dtype) if compress else x.new_empty(0)
    return dx, dk, dv, dbeta, dw


@_update_bwd_op.register_fake
def _(x, k, v, beta, rs, r, weight, g, dh, erase, seed, ks, betas, rss, rr, seeds):
    dw = torch.empty_like(weight) if weight is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta), dw


def _update_setup(ctx, inputs, output):
    x, k, v, beta, weight, eps, erase, seed = inputs
    ctx.save_for_backward(x, k, v, beta, output[2], output[3], weight, seed)
    ctx.erase = erase


NO_CHAIN = ((), (), (), (), ())


def _update_grads_of(x, k, v, beta, rs, r, weight, gx, gh, erase, seed, chain=NO_CHAIN):
    """(dx, dk, dv, dbeta, dweight or None) of ddl::update at x (or at x rebuilt from x0 = x by the updates
    chain = (ks, betas, rss, rr, seeds)), for the output gradients gx, gh."""
    gx = torch.zeros_like(x) if gx is None else gx.contiguous()
    if weight is not None:
        gh = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device) if gh is None else gh.contiguous()
    dx, dk, dv, dbeta, dw = _update_bwd_op(
        x, k, v, beta, rs, r, weight, gx, gh if weight is not None else None, erase, seed, *map(list, chain)
    )
    return dx, dk, dv, dbeta, (dw if weight is not None else None)


def _update_backward(ctx, gx, gh, _grs, _gr):
    x, k, v, beta, rs, r, weight, seed = ctx.saved_tensors
    return *_update_grads_of(x, k, v, beta, rs, r, weight, gx, gh, ctx.erase, seed), None, None, None


torch.library.register_autograd("ddl::update", _update_backward, setup_context=_update_setup)


@torch.library.custom_op("ddl::cc", mutates_args=())
def _cc_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    N, D, DV = x.shape
    h = _new((N, D), x)
    cfg = LAUNCH["chan_fwd"]
    _cc_fwd_kernel[_chan_grid(N, D, cfg)](
        x, weight, h, N, D, DV=DV, BLOCK_D=min(cfg["BLOCK_D"], _pow2(D)), BLOCK_V=_pow2(DV),
        TOKENS=cfg["TOKENS"], CT=_ct(x, weight), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return h


@_cc_op.register_fake
def _(x, weight):
    return x.new_empty(x.shape[:2])


@torch.library.custom_op("ddl::cc_bwd", mutates_args=())
def _cc_bwd_op(x: torch.Tensor, weight: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, D, DV = x.shape
    cfg = LAUNCH["chan_bwd"]
    grid = _chan_grid(N, D, {**cfg, "BLOCK_D": min(cfg["BLOCK_D"], _pow2(D))})
    dx = _new(x.shape, x)
    dwp = _new((grid[0], D, DV), x, dtype=acc_dtype(x))
    _cc_bwd_kernel[grid](
        x, weight, dh, dx, dwp, N, D, cfg["TOKENS"], DV=DV, BLOCK_D=min(cfg["BLOCK_D"], _pow2(D)),
        BLOCK_V=_pow2(DV), CT=_ct(x, weight, dh), num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dx, dwp.sum(0).to(weight.dtype)


@_cc_bwd_op.register_fake
def _(x, weight, dh):
    return torch.empty_like(x), torch.empty_like(weight)


def _cc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _cc_backward(ctx, dh):
    x, weight = ctx.saved_tensors
    return _cc_bwd_op(x, weight, dh.contiguous())


torch.library.register_autograd("ddl::cc", _cc_backward, setup_context=_cc_setup)


def _chan_launch(a, wt, key):
    """(N, D, launch shape, grid, constexprs) of a per-channel kernel over a [N, d(, d_v)] with taps wt."""
    N, D = a.shape[0], a.shape[1]
    KW, DV = wt.shape[0], wt.shape[2]
    cfg = _cfg(key, a.dtype)
    bd = min(cfg["BLOCK_D"], _pow2(D))
    consts = dict(KW=KW, DV=DV, BLOCK_D=bd, BLOCK_V=_pow2(DV), num_warps=cfg["num_warps"])
    return N, D, cfg, _chan_grid(N, D, {**cfg, "BLOCK_D": bd}), consts


def _tc_forward(x, wt, T, ds=None):
    """h [N, d], the TC read-out of x [N, d, d_v] through taps wt [K, d, d_v] (ds [N]: doc_start, or
    None)."""
    h = _new((x.shape[0], x.shape[1]), x)
    N, D, cfg, grid, consts = _chan_launch(x, wt, "tc_fwd")
    tokens, stages, doc = cfg["TOKENS"], cfg["STAGES"], ds is not None
    _tc_fwd_kernel[grid](
        x, wt, h, _or(ds, x), N, T, D, TOKENS=tokens, STAGES=stages, DOC=doc, CT=_ct(x, wt), **consts
    )
    return h


def _ec_forward(emb, wt, T, ds=None):
    """X0 [N, d, d_v], the EC expansion of emb [N, d] through taps wt [K, d, d_v] (ds [N]: doc_start, or
    None)."""
    x0 = _new((emb.shape[0], emb.shape[1], wt.shape[2]), emb)
    N, D, cfg, grid, consts = _chan_launch(emb, wt, "chan_fwd")
    _ec_fwd_kernel[grid](
        emb, wt, x0, _or(ds, emb), N, T, D, TOKENS=cfg["TOKENS"], DOC=ds is not None, CT=_ct(emb, wt),
        **consts,
    )  # fmt: skip
    return x0


def _token_conv_op(name, forward, out_shape):
    """Registers `ddl::{name}(a, wt, T, ds)` (a [N, d] or [N, d, d_v], wt [K, d, d_v] taps, T the sequence
    length, ds [N] each token's doc_start or None), its backward op and its autograd, for the two causal
    depthwise convolutions over tokens, TC (a = the state, out [N, d]) and EC (a = the embedding, out
    [N, d, d_v]; out_shape(a, wt)): forward(a, wt, T, ds) runs the forward; the backward is one kernel for
    both (_conv_bwd_kernel, EC a constexpr), on a grid of a block of d by a run of tokens, the weight
    gradient summed from per-program partials. Returns the forward op."""

    @torch.library.custom_op(f"ddl::{name}", mutates_args=())
    def op(a: torch.Tensor, wt: torch.Tensor, T: int, ds: torch.Tensor | None) -> torch.Tensor:
        return forward(a, wt, T, ds)

    @op.register_fake
    def _(a, wt, T, ds):
        return a.new_empty(out_shape(a, wt))

    @torch.library.custom_op(f"ddl::{name}_bwd", mutates_args=())
    def op_bwd(
        a: torch.Tensor, wt: torch.Tensor, g: torch.Tensor, T: int, ds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        N, D, cfg, grid, consts = _chan_launch(a, wt, "chan_bwd")
        da = _new(a.shape, a)
        dwp = _new((grid[0],) + tuple(wt.shape), a, dtype=acc_dtype(a))  # weight-gradient partials
        ec, doc = name == "ec", ds is not None
        _conv_bwd_kernel[grid](
            a, wt, g, da, dwp, _or(ds, a), N, T, D, cfg["TOKENS"], EC=ec, DOC=doc, CT=_ct(a, wt, g), **consts
        )
        return da, dwp.sum(0).to(wt.dtype)

    @op_bwd.register_fake
    def _(a, wt, g, T, ds):
        return torch.empty_like(a), torch.empty_like(wt)

    def setup(ctx, inputs, output):
        a, wt, T, ds = inputs
        ctx.save_for_backward(a, wt, ds)
        ctx.T = T

    def backward(ctx, g):
        a, wt, ds = ctx.saved_tensors
        da, dwt = op_bwd(a, wt, g.contiguous(), ctx.T, ds)
        return da, dwt, None, None

    torch.library.register_autograd(f"ddl::{name}", backward, setup_context=setup)
    return op


_tc_op = _token_conv_op("tc", _tc_forward, lambda x, wt: (x.shape[0], x.shape[1]))
_ec_op = _token_conv_op("ec", _ec_forward, lambda emb, wt: (emb.shape[0], emb.shape[1], wt.shape[2]))


@torch.library.custom_op("ddl::update_tc", mutates_args=())
def _update_tc_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, wt: torch.Tensor, T: int,
    eps: float, erase: bool, seed: torch.Tensor | None, ds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _update_with_read(x, k, v, beta, None, wt, T, eps, erase, seed, ds)


@_update_tc_op.register_fake
def _(x, k, v, beta, wt, T, eps, erase, seed, ds):
    return _fake_update_with_read(x, None, wt)


@torch.library.custom_op("ddl::update_tc_bwd", mutates_args=())
def _update_tc_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rs: torch.Tensor, r: torch.Tensor,
    wt: torch.Tensor, g: torch.Tensor, dh: torch.Tensor, T: int, erase: bool, seed: torch.Tensor | None,
    ks: list[torch.Tensor], betas: list[torch.Tensor], rss: list[torch.Tensor], rr: list[torch.Tensor],
    seeds: list[torch.Tensor], ds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dk, dv, dbeta, dwt): the backward of ddl::update_tc (taps wt; T the sequence length; ds [N] each
    token's doc_start, or None) at LAUNCH['tc_bwd']'s shape, in two kernels: gk = khat^T G per token, with
    dv and dbeta (_update_tc_gk_kernel), then dx, dk and the taps' gradient partials on runs of tokens by
    blocks of d, x' rebuilt in registers."""
    N, D, DV = x.shape
    KW, cfg, ct, doc = wt.shape[0], _cfg("tc_bwd", x.dtype), _ct(x, k, v, beta, g), ds is not None
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    gk = _new((N, DV), x, dtype=acc_dtype(x))
    _update_tc_gk_kernel[(N,)](
        k, beta, rs, r, wt, g, dh, gk, dv, dbeta, _or(ds, k), N, T, D, DV=DV,
        BLOCK_D=min(cfg["GK_BLOCK_D"], _pow2(D)), BLOCK_V=_pow2(DV), KW=KW, STAGES=cfg["GK_STAGES"], DOC=doc,
        CT=ct, num_warps=cfg["GK_WARPS"],
    )  # fmt: skip
    bd = min(cfg["BLOCK_D"], _pow2(D))
    grid = (triton.cdiv(N, cfg["TOKENS"]), triton.cdiv(D, bd))
    dwp = _new((grid[0], *wt.shape), x, dtype=acc_dtype(x))
    _update_tc_bwd_kernel[grid](
        x, k, v, beta, rs, r, _chain(ks, betas, rss, rr, seeds), wt, g, dh, gk, dx, dk, dwp, _or(seed, x),
        _or(ds, x), N, T, D, cfg["TOKENS"], DV=DV, BLOCK_D=bd, BLOCK_V=_pow2(DV), ERASE=erase, KW=KW,
        SR=seed is not None, STAGES=cfg["STAGES"], DOC=doc, CT=ct, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return dx, dk, dv, dbeta, dwp.sum(0).to(wt.dtype)


@_update_tc_bwd_op.register_fake
def _(x, k, v, beta, rs, r, wt, g, dh, T, erase, seed, ks, betas, rss, rr, seeds, ds):
    return tuple(torch.empty_like(t) for t in (x, k, v, beta, wt))


def _update_tc_setup(ctx, inputs, output):
    x, k, v, beta, wt, T, eps, erase, seed, ds = inputs
    ctx.save_for_backward(x, k, v, beta, output[2], output[3], wt, seed, ds)
    ctx.T, ctx.erase = T, erase


def _update_tc_grads_of(x, k, v, beta, rs, r, wt, gx, gh, T, erase, seed, chain=NO_CHAIN, ds=None):
    """(dx, dk, dv, dbeta, dwt) of ddl::update_tc at x (or rebuilt from it, as _update_grads_of), for the
    output gradients gx, gh."""
    gx = torch.zeros_like(x) if gx is None else gx.contiguous()
    gh = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device) if gh is None else gh.contiguous()
    return _update_tc_bwd_op(x, k, v, beta, rs, r, wt, gx, gh, T, erase, seed, *map(list, chain), ds)


def _update_tc_backward(ctx, gx, gh, _grs, _gr):
    x, k, v, beta, rs, r, wt, seed, ds = ctx.saved_tensors
    grads = _update_tc_grads_of(x, k, v, beta, rs, r, wt, gx, gh, ctx.T, ctx.erase, seed, ds=ds)
    return *grads, None, None, None, None, None


torch.library.register_autograd("ddl::update_tc", _update_tc_backward, setup_context=_update_tc_setup)


def _update_with_read(x, k, v, beta, weight, wt, T, eps, erase, seed, ds=None):
    """The forward of ddl::update (wt None; weight: the CC read-out or None) or of ddl::update_tc (wt: the
    TC taps, ds [N] each token's doc_start or None; one kernel with LAUNCH['update_tc_fwd'] FUSED), as plain
    code for the ops to share: (x_new, h, rs, r); h is empty without a read-out."""
    cfg = _cfg("update_tc_fwd", x.dtype)
    if wt is None or not cfg["FUSED"]:
        x_new, h, rs, r = _update_forward(x, k, v, beta, weight, eps, erase, seed)
        return x_new, (h if wt is None else _tc_forward(x_new, wt, T, ds)), rs, r
    N, D, DV = x.shape
    x_new, h, rs, r = _update_outputs(x, True)
    _update_tc_fwd_kernel[(triton.cdiv(N, cfg["TOKENS"]),)](
        x, k, v, beta, wt, x_new, h, rs, r, _or(seed, x), _or(ds, x), N, T, D, eps, cfg["TOKENS"],
        KW=wt.shape[0], DV=DV, BLOCK_D=_pow2(D), BLOCK_V=_pow2(DV), ERASE=erase, SR=seed is not None,
        STAGES=cfg["STAGES"], DOC=ds is not None, CT=_ct(x, k, v, beta, wt), num_warps=cfg["num_warps"],
        maxnreg=cfg.get("maxnreg"),
    )  # fmt: skip
    return x_new, h, rs, r


def _fake_update_with_read(x, weight, wt):
    x_new, h, rs, r = _fake_update_forward(x, weight)
    return x_new, (x.new_empty(x.shape[:2]) if wt is not None else h), rs, r


# An update on a state x that earlier updates made from x0 (rebuild_from): the same forward as ddl::update
# (wt None) or ddl::update_tc, but autograd keeps x0 and the earlier updates' (k, beta, rs, r, seed), which
# their own ops keep anyway, instead of x: the backward kernels rebuild x in registers as they load it (the
# same reads of the state, plus each earlier update's k). Fewer states stay alive for the backward.
@torch.library.custom_op("ddl::update_rebuilt", mutates_args=())
def _update_rebuilt_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor | None,
    wt: torch.Tensor | None, T: int, x0: torch.Tensor, ks: list[torch.Tensor], betas: list[torch.Tensor],
    rss: list[torch.Tensor], rr: list[torch.Tensor], seeds: list[torch.Tensor], eps: float, erase: bool,
    seed: torch.Tensor | None, ds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _update_with_read(x, k, v, beta, weight, wt, T, eps, erase, seed, ds)


@_update_rebuilt_op.register_fake
def _(x, k, v, beta, weight, wt, T, x0, ks, betas, rss, rr, seeds, eps, erase, seed, ds):
    return _fake_update_with_read(x, weight, wt)


def _update_rebuilt_setup(ctx, inputs, output):
    x, k, v, beta, weight, wt, T, x0, ks, betas, rss, rr, seeds, eps, erase, seed, ds = inputs
    ctx.save_for_backward(
        k, v, beta, output[2], output[3], weight, wt, x0, seed, ds, *ks, *betas, *rss, *rr, *seeds
    )
    ctx.T, ctx.erase, ctx.steps = T, erase, len(ks)


def _update_rebuilt_backward(ctx, gx, gh, _grs, _gr):
    k, v, beta, rs, r, weight, wt, x0, seed, ds, *saved = ctx.saved_tensors
    n = ctx.steps
    chain = tuple(saved[i * n : (i + 1) * n] for i in range(5))  # seeds: empty without stochastic rounding
    if wt is not None:
        dx, dk, dv, dbeta, dwt = _update_tc_grads_of(
            x0, k, v, beta, rs, r, wt, gx, gh, ctx.T, ctx.erase, seed, chain, ds
        )
        dw = None
    else:
        dx, dk, dv, dbeta, dw = _update_grads_of(
            x0, k, v, beta, rs, r, weight, gx, gh, ctx.erase, seed, chain
        )
        dwt = None
    no_grads = [None] * n  # the earlier updates get theirs from their own ops
    return dx, dk, dv, dbeta, dw, dwt, None, None, *[no_grads] * 4, [None] * len(chain[4]), *[None] * 4


torch.library.register_autograd(
    "ddl::update_rebuilt", _update_rebuilt_backward, setup_context=_update_rebuilt_setup
)


# ----------------------------------------------------------------------------------------------------
# The public functions' Triton branch (ops/ddl/__init__.py checks the arguments): flatten, call the op.


def _flat(x, k, v, beta):
    """The update's arguments as the ops take them: x [N, d, d_v], k [N, d], v [N, d_v], beta [N]."""
    d, dv = x.shape[-2:]
    return (
        x.reshape(-1, d, dv).contiguous(),
        k.reshape(-1, d).contiguous(),
        v.reshape(-1, dv).contiguous(),
        beta.reshape(-1).contiguous(),
    )


def _flat_seed(seed):
    return None if seed is None else seed.reshape(1).contiguous()


def _tap_weights(conv_weight, read=None):
    """A [d, d_v, K] conv weight as [K, d, d_v] taps, with the read-out [d_v] folded in (a tiny tensor;
    autograd carries its gradient to conv_weight and read)."""
    if read is not None:
        conv_weight = conv_weight * read[None, :, None]
    return conv_weight.permute(2, 0, 1).contiguous()


def _flat_doc_start(doc_start):
    """doc_start [B, T] as the ops take it, [N] (its dtype kept), or None."""
    return None if doc_start is None else doc_start.reshape(-1).contiguous()


def _update_any(
    x, k, v, beta, weight, wt, T, eps, erase, rebuild_from, seed, doc_start=None, return_step=True
):
    """(x_new, h, step) of the update (+ CC read-out with weight, + TC read-out with taps wt, within the
    documents of doc_start [B, T] where given), through the op that keeps x for the backward, or, given
    rebuild_from = (x0, steps) with x made from x0 by the updates steps = ((k0, beta0, rs0, r0, seed0), ...),
    the op that rebuilds x there; step = (k, beta, rs, r, seed), this update's for a later rebuild_from (None
    unless return_step: no views made for nothing)."""
    flat, eps, erase, seed = _flat(x, k, v, beta), float(eps), bool(erase), _flat_seed(seed)
    ds = _flat_doc_start(doc_start)
    d, dv = x.shape[-2:]
    if rebuild_from is not None:
        x0, steps = rebuild_from
        shapes = ((-1, d), (-1,), (-1,), (-1, dv), (1,))  # a step's k, beta, rs, r and seed, flat
        chain = [
            [s[i].reshape(shape).contiguous() for s in steps if s[i] is not None]
            for i, shape in enumerate(shapes)
        ]
        out = _update_rebuilt_op(
            *flat, weight, wt, T, x0.reshape(-1, d, dv).contiguous(), *chain, eps, erase, seed, ds
        )
    else:
        out = (
            _update_tc_op(*flat, wt, T, eps, erase, seed, ds)
            if wt is not None
            else _update_op(*flat, weight, eps, erase, seed)
        )
    lead = x.shape[:-2]
    step = (k, beta, out[2].view(lead), out[3].view(*lead, dv), seed) if return_step else None
    return out[0].view(x.shape), out[1], step


def update(x, k, v, beta, eps, erase, rebuild_from=None, seed=None, return_step=True):
    args = (eps, erase, rebuild_from, seed)
    x_new, _, step = _update_any(x, k, v, beta, None, None, 0, *args, return_step=return_step)
    return x_new, step


def update_compress_cc(x, k, v, beta, weight, eps, erase, rebuild_from=None, seed=None, return_step=True):
    B, T, d, _ = x.shape
    args = (weight.contiguous(), None, T, eps, erase, rebuild_from, seed)
    x_new, h, step = _update_any(x, k, v, beta, *args, return_step=return_step)
    return x_new, h.view(B, T, d), step


def update_compress_tc(
    x, k, v, beta, conv_weight, read, eps, erase, rebuild_from=None, seed=None, doc_start=None,
    return_step=True,
):  # fmt: skip
    B, T, d, _ = x.shape
    wt = _tap_weights(conv_weight, read)
    args = (None, wt, T, eps, erase, rebuild_from, seed, doc_start)
    x_new, h, step = _update_any(x, k, v, beta, *args, return_step=return_step)
    return x_new, h.view(B, T, d), step


def compress_cc(x, weight):
    B, T, d, dv = x.shape
    return _cc_op(x.reshape(-1, d, dv).contiguous(), weight.contiguous()).view(B, T, d)


def compress_tc(x, conv_weight, read, doc_start=None):
    B, T, d, dv = x.shape
    wt, ds = _tap_weights(conv_weight, read), _flat_doc_start(doc_start)
    return _tc_op(x.reshape(-1, d, dv).contiguous(), wt, T, ds).view(B, T, d)


def expand_ec(emb, conv_weight, doc_start=None):
    B, T, d = emb.shape
    x0 = _ec_op(emb.reshape(-1, d).contiguous(), _tap_weights(conv_weight), T, _flat_doc_start(doc_start))
    return x0.view(B, T, d, conv_weight.shape[1])
