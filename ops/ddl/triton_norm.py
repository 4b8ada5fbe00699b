"""d_v = 1: the DDL update fused with the next sublayer's read of its output, as a torch.library custom op
around the row kernels of triton_update.py (NORM). The read is what a DDL sublayer computes from x_in = x':
its RMSNorm c = x' inv norm_weight, inv = 1 / sqrt(mean(x'^2) + norm_eps), and the logits z = x' A^T of its
value and gate (A [2, d]; [1, d], v's alone, for a rule without beta's). The forward writes c in the dtype
its matmuls read it in, and the backward adds the read's gradient to the update's in registers, so the read
takes no pass over the state of its own, forward or backward. The weight gradients are per-program partials
summed by torch."""

import torch
import triton

from ..common import acc_dtype
from .triton import LAUNCH, _cfg, _ct, _flat_seed, _new, _or, _pow2
from .triton_update import _update_row_bwd_kernel, _update_row_fwd_kernel


@torch.library.custom_op("ddl::update_norm", mutates_args=())
def _update_norm_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, norm_weight: torch.Tensor,
    logit_weight: torch.Tensor, eps: float, norm_eps: float, erase: bool, c_dtype: torch.dtype,
    seed: torch.Tensor | None, lead: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    (N, D), M = x.shape, logit_weight.shape[0]
    ft = acc_dtype(x)
    x_new, c, z, inv = (_new(shape, x, dtype=dt) for shape, dt in _read_shapes(N, D, M, lead, x, c_dtype))
    rs, r = (_new((N,), x, dtype=ft) for _ in range(2))
    cfg = _cfg("update_norm", x.dtype)
    _update_row_fwd_kernel[(triton.cdiv(N, cfg["ROWS"]),)](
        x, k, v, beta, x_new, rs, r, norm_weight, logit_weight, c, z, inv, _or(seed, x), N, D, eps, norm_eps,
        ROWS=cfg["ROWS"], BLOCK_D=_pow2(D), ERASE=erase, NORM=True, SR=seed is not None,
        CT=_ct(x, k, v, beta, norm_weight, logit_weight), M=M, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return x_new, c, z, inv, rs, r


@_update_norm_op.register_fake
def _(x, k, v, beta, norm_weight, logit_weight, eps, norm_eps, erase, c_dtype, seed, lead=None):
    (N, D), M, ft = x.shape, logit_weight.shape[0], acc_dtype(x)
    rs, r = (x.new_empty((N,), dtype=ft) for _ in range(2))  # two tensors, as the op returns
    return *(x.new_empty(s, dtype=dt) for s, dt in _read_shapes(N, D, M, lead, x, c_dtype)), rs, r


def _read_shapes(N, D, M, lead, x, c_dtype):
    """(shape, dtype) of x_new, c, z, inv: [N, D], [N, D], [N, M], [N]; given lead, the state's leading
    dims, [*lead, D, 1], [*lead, D], [*lead, M], [*lead, 1] (what the caller wants, with no views to make)."""
    ft = acc_dtype(x)
    if lead is None:
        return ((N, D), x.dtype), ((N, D), c_dtype), ((N, M), ft), ((N,), ft)
    lead = tuple(lead)
    return (lead + (D, 1), x.dtype), (lead + (D,), c_dtype), (lead + (M,), ft), (lead + (1,), ft)


@torch.library.custom_op("ddl::update_norm_bwd", mutates_args=())
def _update_norm_bwd_op(
    x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, rs: torch.Tensor, r: torch.Tensor,
    norm_weight: torch.Tensor, logit_weight: torch.Tensor, inv: torch.Tensor, gx: torch.Tensor,
    gc: torch.Tensor, gz: torch.Tensor, ginv: torch.Tensor, erase: bool, seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    N, D = x.shape
    cfg = LAUNCH["update_norm_bwd"]
    nprog = triton.cdiv(N, cfg["ROWS"] * cfg["STEPS"])
    dx, dk, dv, dbeta = _new(x.shape, x), _new(k.shape, k), _new(v.shape, v), _new(beta.shape, beta)
    partials = _new((nprog, 1 + logit_weight.shape[0], D), x, dtype=acc_dtype(x))
    _update_row_bwd_kernel[(nprog,)](
        x, k, v, beta, rs, r, gx, dx, dk, dv, dbeta, norm_weight, logit_weight, inv, gc, gz, ginv, partials,
        _or(seed, x), N, D, ROWS=cfg["ROWS"], STEPS=cfg["STEPS"], BLOCK_D=_pow2(D), ERASE=erase, NORM=True,
        SR=seed is not None, CT=_ct(x, k, v, beta, norm_weight, logit_weight, gx), M=logit_weight.shape[0],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    dnw, dlw = partials[:, 0].sum(0), partials[:, 1:].sum(0)  # two tensors: outputs may not alias
    return dx, dk, dv, dbeta, dnw.to(norm_weight.dtype), dlw.to(logit_weight.dtype)


@_update_norm_bwd_op.register_fake
def _(x, k, v, beta, rs, r, norm_weight, logit_weight, inv, gx, gc, gz, ginv, erase, seed):
    like = (x, k, v, beta, norm_weight, logit_weight)
    return tuple(torch.empty_like(t) for t in like)


def _setup(ctx, inputs, output):
    x, k, v, beta, norm_weight, logit_weight, eps, norm_eps, erase, c_dtype, seed, *_ = inputs
    inv = output[3].reshape(-1)
    ctx.save_for_backward(x, k, v, beta, norm_weight, logit_weight, inv, output[4], output[5], seed)
    ctx.erase = erase


def _backward(ctx, gx, gc, gz, ginv, _grs, _gr):
    x, k, v, beta, norm_weight, logit_weight, inv, rs, r, seed = ctx.saved_tensors
    z_shape = (x.shape[0], logit_weight.shape[0])
    grads = [  # flat, as the kernels read them
        torch.zeros(shape, dtype=dt, device=x.device) if g is None else g.reshape(shape).contiguous()
        for g, shape, dt in ((gx, x.shape, x.dtype), (gc, x.shape, x.dtype), (gz, z_shape, inv.dtype),
                             (ginv, inv.shape, inv.dtype))
    ]  # fmt: skip
    dx, dk, dv, dbeta, dnw, dlw = _update_norm_bwd_op(
        x, k, v, beta, rs, r, norm_weight, logit_weight, inv, *grads, ctx.erase, seed
    )
    return dx, dk, dv, dbeta, dnw, dlw, None, None, None, None, None, None


torch.library.register_autograd("ddl::update_norm", _backward, setup_context=_setup)


def update_norm(x, k, v, beta, norm_weight, logit_weight, eps, norm_eps, erase, c_dtype, seed=None):
    """The public function's Triton branch: x [..., d, 1] flat to [N, d]; (x_new, c, z, inv_rms [..., 1]),
    made by the op in these shapes."""
    lead, d = x.shape[:-2], x.shape[-2]
    flat = (x.reshape(-1, d), k.reshape(-1, d), v.reshape(-1), beta.reshape(-1), norm_weight, logit_weight)
    args = (float(eps), float(norm_eps), bool(erase), c_dtype, _flat_seed(seed), list(lead))
    return _update_norm_op(*(t.contiguous() for t in flat), *args)[:4]
