"""Deep Delta Learning (DDL) residual ops: the state update, the compressors and the EC expansion.

The residual stream of a DDL model is a matrix state X [B, T, d, d_v] per token (d_v = 1: a vector).
Each sublayer reads a vector out of it (a compressor), computes F, and writes back with a rank-1
delta-rule update along a learned direction k:

    khat = k / sqrt(|k|^2 + eps^2)                      (eps keeps k = 0 finite)
    X'   = X + beta * khat (v^T - khat^T X)              (erase=True: read-compare-write)
    X'   = X + beta * khat v^T                           (erase=False: the write-only control)

With beta = 1 and |khat| = 1 the new state satisfies khat^T X' = v^T exactly: the old content along
khat is erased and replaced by v.

Compressors turn X into the [B, T, d] input of the next sublayer:
    CC (channel):  h[b,t,i] = sum_v weight[i,v] * X[b,t,i,v]
    TC (temporal): h[b,t,i] = sum_v read[v] * sum_j conv_weight[i,v,j] * X[b, t-(K-1)+j, i, v]
                   (a causal depthwise conv over tokens, zero before t = 0; tap K-1 is the current token)
EC (expansion) builds the initial state from the token embedding:
    X0[b,t,i,v] = sum_j conv_weight[i,v,j] * emb[b, t-(K-1)+j, i]
With the identity init (tap K-1 = 1, the rest 0) X0 is emb repeated d_v times.
Packed documents (doc_start, an int32/int64 tensor [B, T]: the position in its row of the first token of
the document that token t belongs to): TC and EC's tap reading token s = t-(K-1)+j is used only if
s >= doc_start[b, t], else it reads zero, the padding the conv has before t = 0. None: no mask (the kernels
compile without it). The values are trusted, not checked (a check would sync the GPU).

Fused entry points (fewer passes over the state than the separate ops):
    ddl_update_compress_cc(x, k, v, beta, weight)          -> (x_new, compress_cc(x_new, weight))
    ddl_update_compress_tc(x, k, v, beta, conv_weight, read) -> (x_new, compress_tc(x_new, conv_weight, read))
    ddl_update_norm(x, k, v, beta, norm_weight, logit_weight) -> (x_new, c, z, inv_rms)   (d_v = 1)
i.e. one sublayer's update together with the next sublayer's read-out (d_v = 1: its RMSNorm and logits).

Every public function takes backend = "auto" | "torch" | "triton" (ops/common.py): "auto" picks
Triton for CUDA tensors and the PyTorch reference otherwise (tests run the kernels on CPU with
backend="triton" and TRITON_INTERPRET=1). The references (*_ref) are in naive.py, the kernels in
triton_update.py and triton_channel.py, their custom ops in triton.py (ddl_update_norm's in
triton_norm.py). Numerics: the normalisation, the contractions and the update run in fp32 (float64 stays
float64); results come back in x's dtype, so bf16 state is stored in bf16: rounded to nearest, or, given
seed (an integer tensor of one element, a fresh one per update), stochastically (naive.round_state): each
element rounds up with probability equal to its fraction of a bf16 step, so the stored state's expectation is
the fp32 update's, and a run of small updates does not stall as rounding to nearest does. The random bits
are a hash of the seed and the element's index, so that a backward that rebuilds the state draws them again.

The Triton kernels in short: the work is memory-bound (~1 FLOP per byte of state), so they minimise passes
over the [B, T, d, d_v] state. One program owns whole tokens ([d, d_v] tiles; d_v = 1: [tokens, d] rows): the
forward reads x and writes x' once (and stores the update's rs and r, 20 bytes a token at d_v = 4, so that the
backward need not recompute them), the backward reads x and dL/dx' and writes dx once, and the fused entry
points add the next sublayer's read-out: CC's from x' in registers (5 passes per sublayer where update then
compressor take 11), TC's forward reading x' once more in token order (its conv spans tokens). All are
torch.library custom ops with fake implementations, so torch.compile keeps them in its graph. An update can
rebuild its input state in the backward from an earlier state and the updates since (rebuild_from, from their
stored terms, elementwise), so that autograd keeps one state per run of updates. Their speed against the
bytes they must move: bench/bench_ddl.py and bench/RESULTS.md.
"""

import torch

from ..common import BACKENDS, acc_dtype, resolve_backend
from .naive import (
    _check_cc_weight,
    _check_conv,
    _check_doc_start,
    _check_norm_args,
    _check_read,
    _check_seed,
    _check_state,
    _check_update_args,
    cc_read_weight,
    compress_cc_ref,
    compress_tc_ref,
    ddl_update_compress_cc_ref,
    ddl_update_compress_tc_ref,
    ddl_update_norm_ref,
    ddl_update_ref,
    expand_ec_ref,
    tc_windows_ref,
    update_terms_ref,
)

try:  # the kernels: absent where Triton is not installed (then only backend="torch" runs)
    from . import triton as _triton
    from . import triton_norm as _triton_norm
except ImportError:
    _triton = _triton_norm = None

__all__ = [
    "BACKENDS",
    "cc_read_weight",
    "compress_cc",
    "compress_cc_ref",
    "compress_tc",
    "compress_tc_ref",
    "ddl_update",
    "ddl_update_compress_cc",
    "ddl_update_compress_cc_ref",
    "ddl_update_compress_tc",
    "ddl_update_compress_tc_ref",
    "ddl_update_norm",
    "ddl_update_norm_ref",
    "ddl_update_ref",
    "expand_ec",
    "expand_ec_ref",
    "tc_windows_ref",
    "update_terms_ref",
]


# return_step=True (every update below): also return the update's step = (k, beta, rs, r, seed), what
# rebuilding its output from its input takes: the direction and gate, rs = 1/sqrt(|k|^2+eps^2) [...] and
# r = v - khat^T x (erase) or v [..., d_v] (compute dtype, fp32 for a bf16 state) as its forward computed
# them, and its seed (None: rounded to nearest).
# rebuild_from=(x0, steps): x was made from x0 by the updates whose steps are given, in order (each from that
# update's return_step; all with a seed or none, as this update). The Triton path then keeps x0 for the
# backward instead of x and its backward kernels rebuild x as they read it, x <- x + beta (k rs) r^T rounded
# as stored, with no reduction: a run of updates keeps one state alive, not one each. The reference ignores
# rebuild_from.


def _check_rebuild_from(fn, x, rebuild_from, seed):
    _check_seed(fn, x, seed)
    if rebuild_from is None:
        return
    ok = isinstance(rebuild_from, (tuple, list)) and len(rebuild_from) == 2
    steps = rebuild_from[1] if ok else None
    if not (ok and isinstance(steps, (tuple, list)) and steps and all(len(s) == 5 for s in steps)):
        raise ValueError(
            f"{fn}: rebuild_from must be (x0, ((k0, beta0, rs0, r0, seed0), ...)), the earlier updates' "
            f"steps (return_step=True), got {rebuild_from!r:.80}"
        )
    if any((s[4] is None) != (seed is None) for s in steps):
        raise ValueError(
            f"{fn}: rebuild_from's steps must each have a seed if this update has one, else none"
        )
    x0 = rebuild_from[0]
    if x0.shape != x.shape or x0.dtype != x.dtype:
        raise ValueError(
            f"{fn}: rebuild_from's x0 must be like x ({x.dtype} {tuple(x.shape)}), got "
            f"{x0.dtype} {tuple(x0.shape)}"
        )
    lead, d, dv = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    for i, step in enumerate(steps):
        for name, t, shape in zip(
            ("k", "beta", "rs", "r"), step[:4], (lead + (d,), lead, lead, lead + (dv,))
        ):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{fn}: rebuild_from's step {i}: {name} must be {shape}, got {got}")
        _check_seed(f"{fn}: rebuild_from's step {i}", x, step[4])


def _ref_step(x, k, v, beta, eps, erase, return_step, seed):
    """The reference's step (k, beta, rs, r, seed) when asked for, else None."""
    return (k, beta, *update_terms_ref(x, k, v, eps, erase), seed) if return_step else None


def _returned(out, step, return_step):
    """out (x_new, or a tuple (x_new, h)) with the step appended when asked for."""
    if not return_step:
        return out
    return (*out, step) if isinstance(out, tuple) else (out, step)


def ddl_update(
    x, k, v, beta, eps=1e-5, erase=True, backend="auto", rebuild_from=None, return_step=False, seed=None
):
    """x + beta*khat*(v^T - khat^T x), or x + beta*khat*v^T (erase=False); x [..., d, d_v], k [..., d].
    seed: a bf16 x' rounded stochastically (the module docstring)."""
    _check_update_args(x, k, v, beta)
    _check_rebuild_from("ddl_update", x, rebuild_from, seed)
    if resolve_backend("ddl_update", backend, x, k, v, beta) == "torch":
        step = _ref_step(x, k, v, beta, eps, erase, return_step, seed)
        return _returned(ddl_update_ref(x, k, v, beta, eps=eps, erase=erase, seed=seed), step, return_step)
    x_new, step = _triton.update(x, k, v, beta, eps, erase, rebuild_from, seed, return_step)
    return _returned(x_new, step, return_step)


def ddl_update_compress_cc(
    x, k, v, beta, weight, eps=1e-5, erase=True, backend="auto", rebuild_from=None, return_step=False,
    seed=None,
):  # fmt: skip
    """(x_new, compress_cc(x_new, weight)) in one pass over the state: the update of one sublayer fused
    with the CC read-out of the next; x [B, T, d, d_v], weight [d, d_v]. Saves a read of x_new forward
    and a read+write of its gradient backward."""
    _check_update_args(x, k, v, beta)
    _check_state("ddl_update_compress_cc", x)
    _check_cc_weight("ddl_update_compress_cc", x, weight)
    _check_rebuild_from("ddl_update_compress_cc", x, rebuild_from, seed)
    if resolve_backend("ddl_update_compress_cc", backend, x, k, v, beta, weight) == "torch":
        step = _ref_step(x, k, v, beta, eps, erase, return_step, seed)
        out = ddl_update_compress_cc_ref(x, k, v, beta, weight, eps, erase, seed)
        return _returned(out, step, return_step)
    args = (eps, erase, rebuild_from, seed, return_step)
    *out, step = _triton.update_compress_cc(x, k, v, beta, weight, *args)
    return _returned(tuple(out), step, return_step)


def ddl_update_compress_tc(
    x,
    k,
    v,
    beta,
    conv_weight,
    read,
    eps=1e-5,
    erase=True,
    backend="auto",
    rebuild_from=None,
    return_step=False,
    seed=None,
    doc_start=None,
):
    """(x_new, compress_tc(x_new, conv_weight, read, doc_start=doc_start)): the update of one sublayer and
    the TC read-out of the next as one op, whose backward takes both gradients in one pass over the state
    (the forward writes x_new and reads it once, in token order). x [B, T, d, d_v], conv_weight [d, d_v, K],
    read [d_v]."""
    _check_update_args(x, k, v, beta)
    _check_state("ddl_update_compress_tc", x)
    _check_conv("ddl_update_compress_tc", "conv_weight", conv_weight, *x.shape[-2:])
    _check_read("ddl_update_compress_tc", x, read)
    _check_rebuild_from("ddl_update_compress_tc", x, rebuild_from, seed)
    _check_doc_start("ddl_update_compress_tc", doc_start, x)
    if resolve_backend("ddl_update_compress_tc", backend, x, k, v, beta, conv_weight, read) == "torch":
        step = _ref_step(x, k, v, beta, eps, erase, return_step, seed)
        kw = dict(eps=eps, erase=erase, seed=seed, doc_start=doc_start)
        out = ddl_update_compress_tc_ref(x, k, v, beta, conv_weight, read, **kw)
        return _returned(out, step, return_step)
    args = (eps, erase, rebuild_from, seed, doc_start, return_step)
    *out, step = _triton.update_compress_tc(x, k, v, beta, conv_weight, read, *args)
    return _returned(tuple(out), step, return_step)


def ddl_update_norm(
    x,
    k,
    v,
    beta,
    norm_weight,
    logit_weight,
    eps=1e-5,
    norm_eps=1e-5,
    erase=True,
    c_dtype=None,
    backend="auto",
    seed=None,
):
    """d_v = 1: (x_new, c, z, inv_rms), the update fused with the next sublayer's read of x_in = x_new[..., 0]
    (x [..., d, 1]): its RMSNorm c = x_in inv_rms norm_weight in c_dtype (default: the compute dtype),
    inv_rms = 1 / sqrt(mean(x_in^2) + norm_eps) [..., 1], and the logits z = x_in logit_weight^T [..., m]
    (logit_weight [m, d], m = 1 or 2: v's logit, and beta's where the rule has one) in the compute dtype.
    The read takes no pass over the state of its own."""
    _check_update_args(x, k, v, beta)
    _check_norm_args(x, norm_weight, logit_weight)
    _check_seed("ddl_update_norm", x, seed)
    args = (x, k, v, beta, norm_weight, logit_weight, eps, norm_eps, erase, c_dtype)
    if resolve_backend("ddl_update_norm", backend, x, k, v, beta, norm_weight, logit_weight) == "torch":
        return ddl_update_norm_ref(*args, seed=seed)
    return _triton_norm.update_norm(*args[:-1], c_dtype or acc_dtype(*args[:6]), seed)


def compress_cc(x, weight, backend="auto"):
    """h[b,t,i] = sum_v weight[i,v] * x[b,t,i,v]; x [B, T, d, d_v], weight [d, d_v]."""
    if resolve_backend("compress_cc", backend, x, weight) == "torch":
        return compress_cc_ref(x, weight)
    _check_state("compress_cc", x)
    _check_cc_weight("compress_cc", x, weight)
    return _triton.compress_cc(x, weight)


def compress_tc(x, conv_weight, read, backend="auto", doc_start=None):
    """Causal depthwise conv over tokens of each (i, v) channel, then a read-out over v; given doc_start
    [B, T] (the module docstring), within each token's document."""
    if resolve_backend("compress_tc", backend, x, conv_weight, read) == "torch":
        return compress_tc_ref(x, conv_weight, read, doc_start)
    _check_state("compress_tc", x)
    _check_conv("compress_tc", "conv_weight", conv_weight, *x.shape[-2:])
    _check_read("compress_tc", x, read)
    _check_doc_start("compress_tc", doc_start, x)
    return _triton.compress_tc(x, conv_weight, read, doc_start)


def expand_ec(emb, conv_weight, backend="auto", doc_start=None):
    """X0 [B, T, d, d_v] from emb [B, T, d] by a causal depthwise conv per (i, v); given doc_start [B, T],
    within each token's document."""
    if resolve_backend("expand_ec", backend, emb, conv_weight) == "torch":
        return expand_ec_ref(emb, conv_weight, doc_start)
    if emb.dim() != 3:
        raise ValueError(f"expand_ec: emb must be [B, T, d], got shape {tuple(emb.shape)}")
    _check_conv("expand_ec", "conv_weight", conv_weight, emb.shape[-1])
    _check_doc_start("expand_ec", doc_start, emb)
    return _triton.expand_ec(emb, conv_weight, doc_start)
