"""Tests for ops/ddl/: the references (naive.py) against the equations (float64, naive loops) and every
Triton kernel (triton.py) against the references, values and gradients (on CPU through TRITON_INTERPRET=1)."""

import itertools
import math

import pytest
import torch

from model import identity_conv
from ops import ddl
from ops.common import resolve_backend, set_auto_backend
from ops.ddl import (
    compress_cc,
    compress_cc_ref,
    compress_tc,
    compress_tc_ref,
    ddl_update,
    ddl_update_ref,
    expand_ec,
    expand_ec_ref,
)
from ops.ddl import triton as ddl_triton

F64 = torch.float64


def rand_update_args(lead=(2, 3), d=16, dv=4, dtype=F64, beta_range=(0.0, 2.0)):
    x = torch.randn(*lead, d, dv, dtype=dtype)
    k = torch.randn(*lead, d, dtype=dtype)
    v = torch.randn(*lead, dv, dtype=dtype)
    beta = torch.empty(lead, dtype=dtype).uniform_(*beta_range)
    return x, k, v, beta


# ---------------------------------------------------------------------------------------------------
# The reference against the equations.


def naive_update(x, k, v, beta, eps, erase):
    """Per-token loops in float64, straight from X' = X + beta khat (v^T - khat^T X)."""
    lead = x.shape[:-2]
    d, dv = x.shape[-2:]
    xf, kf, vf, bf = (t.double().reshape(-1, *t.shape[len(lead) :]) for t in (x, k, v, beta))
    out = torch.empty_like(xf)
    for n in range(xf.shape[0]):
        norm = sum(float(kf[n, i]) ** 2 for i in range(d))
        khat = [float(kf[n, i]) / (norm + eps * eps) ** 0.5 for i in range(d)]
        for c in range(dv):
            read = sum(khat[i] * float(xf[n, i, c]) for i in range(d)) if erase else 0.0
            for i in range(d):
                out[n, i, c] = xf[n, i, c] + float(bf[n]) * khat[i] * (float(vf[n, c]) - read)
    return out.reshape(x.shape)


@pytest.mark.parametrize("erase", [True, False])
def test_update_ref_matches_naive_loops(erase):
    x, k, v, beta = rand_update_args(lead=(2, 3), d=7, dv=3)
    got = ddl_update_ref(x, k, v, beta, eps=1e-3, erase=erase)
    torch.testing.assert_close(got, naive_update(x, k, v, beta, 1e-3, erase), rtol=1e-12, atol=1e-12)


def naive_norm_read(x_new, norm_weight, logit_weight, norm_eps):
    """(c, z, inv_rms) of x_in = x_new[..., 0] by per-token loops in float64: RMSNorm and a dot product per
    logit row."""
    x_in = x_new[..., 0].double().reshape(-1, x_new.shape[-2])
    (N, d), M = x_in.shape, logit_weight.shape[0]
    c, z, inv = torch.empty(N, d, dtype=F64), torch.empty(N, M, dtype=F64), torch.empty(N, 1, dtype=F64)
    for n in range(N):
        row = [float(x_in[n, i]) for i in range(d)]
        inv[n, 0] = 1.0 / math.sqrt(sum(a * a for a in row) / d + norm_eps)
        for i in range(d):
            c[n, i] = row[i] * float(inv[n, 0]) * float(norm_weight[i])
        for m in range(M):
            z[n, m] = sum(row[i] * float(logit_weight[m, i]) for i in range(d))
    lead = x_new.shape[:-2]
    return c.reshape(*lead, d), z.reshape(*lead, M), inv.reshape(*lead, 1)


@pytest.mark.parametrize("logits", [2, 1])  # v's and beta's logit; v's alone (a rule without W_beta)
@pytest.mark.parametrize("erase", [True, False])
def test_update_norm_ref_matches_naive_loops(erase, logits):
    x, k, v, beta = rand_update_args(lead=(2, 3), d=7, dv=1)
    nw, lw = torch.randn(7, dtype=F64), torch.randn(logits, 7, dtype=F64)
    x_new, c, z, inv = ddl.ddl_update_norm_ref(x, k, v, beta, nw, lw, eps=1e-3, norm_eps=1e-4, erase=erase)
    want_x = naive_update(x, k, v, beta, 1e-3, erase)
    torch.testing.assert_close(x_new, want_x, rtol=1e-12, atol=1e-12)
    for got, want in zip((c, z, inv), naive_norm_read(want_x, nw, lw, 1e-4)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_beta_zero_is_identity():
    x, k, v, _ = rand_update_args()
    beta = torch.zeros(x.shape[:-2], dtype=F64)
    for erase in (True, False):
        assert torch.equal(ddl_update(x, k, v, beta, erase=erase, backend="torch"), x)


def test_beta_one_writes_v_along_khat():
    # With beta = 1, khat^T X' = v^T exactly when |khat| = 1 (eps = 0): the old content along khat is
    # replaced; orthogonal directions are untouched.
    x, k, v, _ = rand_update_args(d=32, dv=4)
    beta = torch.ones(x.shape[:-2], dtype=F64)
    x_new = ddl_update(x, k, v, beta, eps=0.0, backend="torch")
    khat = k / k.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(torch.einsum("...i,...iv->...v", khat, x_new), v, rtol=0, atol=1e-12)
    ortho = torch.randn_like(k)
    ortho = ortho - (ortho * khat).sum(-1, keepdim=True) * khat
    torch.testing.assert_close(
        torch.einsum("...i,...iv->...v", ortho, x_new),
        torch.einsum("...i,...iv->...v", ortho, x),
        rtol=0,
        atol=1e-12,
    )


def test_write_only_control():
    x, k, v, beta = rand_update_args()
    got = ddl_update(x, k, v, beta, eps=0.0, erase=False, backend="torch")
    khat = k / k.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(got, x + beta[..., None, None] * khat[..., :, None] * v[..., None, :])
    # and it differs from the erasing update whenever khat^T x != 0
    assert not torch.allclose(got, ddl_update(x, k, v, beta, eps=0.0, erase=True, backend="torch"))


def test_eps_handling():
    x, k, v, beta = rand_update_args(lead=(4,))
    # k = 0 gives khat = 0 (no NaN) and leaves x unchanged
    k[0] = 0.0
    out = ddl_update(x, k, v, beta, eps=1e-5, backend="torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], x[0], rtol=0, atol=0)
    # eps enters as sqrt(|k|^2 + eps^2): a tiny k is shrunk, not blown up to unit length
    k_small = torch.full_like(k[1], 1e-3 / k.shape[-1] ** 0.5)  # |k| = 1e-3 = eps
    xs = ddl_update(
        x[1:2], k_small[None], v[1:2], torch.ones(1, dtype=F64), eps=1e-3, erase=False, backend="torch"
    )
    khat = k_small / (2**0.5 * 1e-3)
    torch.testing.assert_close(xs[0], x[1] + khat[:, None] * v[1][None, :], rtol=1e-12, atol=1e-12)


def test_update_ref_bf16_computes_in_fp32():
    x, k, v, beta = rand_update_args(lead=(64,), d=256, dv=4, dtype=torch.bfloat16)
    out = ddl_update_ref(x, k, v, beta)
    assert out.dtype == torch.bfloat16
    ref = ddl_update_ref(x.double(), k.double(), v.double(), beta.double())
    # one bf16 rounding of the result, nothing accumulated in bf16
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-2)


def naive_cc(x, w):
    B, T, d, dv = x.shape
    out = torch.zeros(B, T, d, dtype=F64)
    for b in range(B):
        for t in range(T):
            for i in range(d):
                out[b, t, i] = sum(float(w[i, c]) * float(x[b, t, i, c]) for c in range(dv))
    return out


def naive_tc(x, w, read, doc_start=None):
    """The TC read-out by loops; doc_start [B, T]: tap j reads s = t-(K-1)+j only if s >= doc_start[b, t]."""
    B, T, d, dv = x.shape
    K = w.shape[-1]
    out = torch.zeros(B, T, d, dtype=F64)
    for b in range(B):
        for t in range(T):
            for i in range(d):
                acc = 0.0
                for c in range(dv):
                    for j in range(K):
                        s = t - (K - 1) + j
                        if s >= 0 and (doc_start is None or s >= doc_start[b, t]):
                            acc += float(read[c]) * float(w[i, c, j]) * float(x[b, s, i, c])
                out[b, t, i] = acc
    return out


def naive_ec(emb, w, doc_start=None):
    """The EC expansion by loops; doc_start [B, T]: as naive_tc's."""
    B, T, d = emb.shape
    dv, K = w.shape[1:]
    out = torch.zeros(B, T, d, dv, dtype=F64)
    for b in range(B):
        for t in range(T):
            for i in range(d):
                for c in range(dv):
                    out[b, t, i, c] = sum(
                        float(w[i, c, j]) * float(emb[b, t - (K - 1) + j, i])
                        for j in range(K)
                        if t - (K - 1) + j >= 0 and (doc_start is None or t - (K - 1) + j >= doc_start[b, t])
                    )
    return out


def test_compress_cc_ref_matches_loops():
    x = torch.randn(2, 5, 6, 3, dtype=F64)
    w = torch.randn(6, 3, dtype=F64)
    torch.testing.assert_close(compress_cc_ref(x, w), naive_cc(x, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("K", [1, 3, 6])  # K = 6 > T: the whole window reaches before t = 0
def test_compress_tc_ref_matches_loops(K):
    x = torch.randn(2, 5, 4, 3, dtype=F64)
    w = torch.randn(4, 3, K, dtype=F64)
    read = torch.randn(3, dtype=F64)
    torch.testing.assert_close(compress_tc_ref(x, w, read), naive_tc(x, w, read), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("K", [1, 3, 6])
def test_expand_ec_ref_matches_loops(K):
    emb = torch.randn(2, 5, 4, dtype=F64)
    w = torch.randn(4, 3, K, dtype=F64)
    torch.testing.assert_close(expand_ec_ref(emb, w), naive_ec(emb, w), rtol=1e-12, atol=1e-12)


def test_ec_identity_init_is_repetition():
    emb = torch.randn(2, 7, 8, dtype=F64)
    w = identity_conv(8, 4, 3).double()
    for backend in ("torch", "auto"):
        assert torch.equal(expand_ec(emb, w, backend=backend), emb[..., None].expand(2, 7, 8, 4))


def test_reference_gradients_gradcheck():
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2,), d=5, dv=3))
    for erase in (True, False):
        assert torch.autograd.gradcheck(
            lambda *a, e=erase: ddl_update_ref(*a, eps=1e-2, erase=e), (x, k, v, beta)
        )
    xs = torch.randn(2, 4, 5, 3, dtype=F64, requires_grad=True)
    w = torch.randn(5, 3, dtype=F64, requires_grad=True)
    cw = torch.randn(5, 3, 2, dtype=F64, requires_grad=True)
    read = torch.randn(3, dtype=F64, requires_grad=True)
    emb = torch.randn(2, 4, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(compress_cc_ref, (xs, w))
    assert torch.autograd.gradcheck(compress_tc_ref, (xs, cw, read))
    assert torch.autograd.gradcheck(expand_ec_ref, (emb, cw))


def test_bad_inputs_raise_naming_the_argument():
    x, k, v, beta = rand_update_args()
    with pytest.raises(ValueError, match="k must have shape"):
        ddl_update(x, k[..., :-1], v, beta)
    with pytest.raises(ValueError, match="v must have shape"):
        ddl_update(x, k, v[..., :-1], beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        ddl_update(x, k, v, beta[..., None])
    with pytest.raises(ValueError, match="backend must be one of"):
        ddl_update(x, k, v, beta, backend="cuda")
    with pytest.raises(ValueError, match="weight must be"):
        compress_cc(torch.randn(1, 2, 3, 4), torch.randn(4, 3))
    with pytest.raises(ValueError, match="read must be"):
        compress_tc(torch.randn(1, 2, 3, 4), torch.randn(3, 4, 2), torch.randn(3))
    with pytest.raises(ValueError, match="conv_weight must be"):
        expand_ec(torch.randn(1, 2, 3), torch.randn(4, 4, 2))
    with pytest.raises(ValueError, match="set_auto_backend"):
        set_auto_backend("cuda")


# ---------------------------------------------------------------------------------------------------
# Triton kernels against the references: values and gradients, float64 (the kernels compute in float64
# for float64 inputs, so the comparison is exact up to summation order), outputs poisoned with NaN,
# launch shapes shrunk so that several programs, partial weight-gradient sums and ragged tails occur.


# The TC backward's small launch shape: d = 20 spans three d-blocks of 8 (the last ragged) and 10 tokens
# end in a ragged run (3 a run); runs of 3 start before, at and after a sequence's first token (T = 5).
TC_BWD_SMALL = dict(GK_BLOCK_D=8, GK_WARPS=4, GK_STAGES=2, TOKENS=3, BLOCK_D=8, STAGES=2, num_warps=4)


@pytest.fixture
def triton_small(monkeypatch):
    monkeypatch.setattr(ddl_triton, "_FILL_OUTPUTS_WITH_NAN", True)
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_fwd", dict(TOKENS=2, num_warps=4))
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_bwd", dict(TOKENS=3, STAGES=1, num_warps=4))
    monkeypatch.setitem(ddl_triton.LAUNCH, "chan_fwd", dict(TOKENS=2, BLOCK_D=8, num_warps=4))
    monkeypatch.setitem(ddl_triton.LAUNCH, "chan_bwd", dict(TOKENS=3, BLOCK_D=8, num_warps=4))
    # the TC forward takes 3 tokens per run, so that runs start before, at and after a sequence's first
    # token (T = 5) and the last run is ragged
    monkeypatch.setitem(ddl_triton.LAUNCH, "tc_fwd", dict(TOKENS=3, BLOCK_D=8, STAGES=2, num_warps=4))
    monkeypatch.setitem(ddl_triton.LAUNCH, "tc_bwd", TC_BWD_SMALL)
    # off, as shipped; the tests of the fused TC forward turn it on at this shape (runs of 3 tokens)
    monkeypatch.setitem(
        ddl_triton.LAUNCH, "update_tc_fwd", dict(FUSED=False, TOKENS=3, STAGES=2, num_warps=4)
    )


def compare(fn_triton, fn_ref, inputs, rtol=1e-10, atol=1e-10):
    """Values and gradients (random upstream gradients) of two implementations of the same function."""
    out_t, out_r = fn_triton(*inputs), fn_ref(*inputs)
    out_t = out_t if isinstance(out_t, tuple) else (out_t,)
    out_r = out_r if isinstance(out_r, tuple) else (out_r,)
    ups = [torch.randn_like(o) for o in out_r]
    for a, b in zip(out_t, out_r):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    grads_t = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out_t, ups)), inputs)
    grads_r = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out_r, ups)), inputs)
    for a, b in zip(grads_t, grads_r):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dv", [1, 3, 4])
@pytest.mark.parametrize("erase", [True, False])
def test_triton_update_matches_reference(triton_small, dv, erase):
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=dv))
    compare(
        lambda *a: ddl_update(*a, eps=1e-3, erase=erase, backend="triton"),
        lambda *a: ddl_update_ref(*a, eps=1e-3, erase=erase),
        (x, k, v, beta),
    )


@pytest.mark.parametrize("dv", [1, 4])
def test_triton_update_default_launch_shapes(dv, monkeypatch):
    # the shipped launch configuration: many tokens per tile for small tiles, ragged last tile
    monkeypatch.setattr(ddl_triton, "_FILL_OUTPUTS_WITH_NAN", True)
    check_update_and_cc(lead=(2, 5), dv=dv)


def check_update_and_cc(lead, dv, d=20):
    """ddl_update and the fused update + CC read-out (Triton) against the references, values and grads."""
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=lead, d=d, dv=dv))
    w = torch.randn(d, dv, dtype=F64, requires_grad=True)
    compare(
        lambda *a: ddl.ddl_update_compress_cc(*a, backend="triton"),
        ddl.ddl_update_compress_cc_ref,
        (x, k, v, beta, w),
    )
    compare(lambda *a: ddl_update(*a, backend="triton"), ddl_update_ref, (x, k, v, beta))


def test_launch_shape_per_state_dtype(monkeypatch):
    """_cfg reads an entry's per-dtype launch shape for that dtype only, and the ops launch with the one of
    the state's dtype (a bad ROWS stored for float64 alone must fail float64 and nothing else)."""
    bf16 = ddl_triton.LAUNCH["update_row"]["bfloat16"]
    assert ddl_triton._cfg("update_row", torch.bfloat16) is bf16
    assert ddl_triton._cfg("update_row", torch.float32) is ddl_triton.LAUNCH["update_row"]
    assert (
        ddl_triton._cfg("update_fwd", torch.bfloat16) is ddl_triton.LAUNCH["update_fwd"]
    )  # no per-dtype entry
    monkeypatch.setitem(
        ddl_triton.LAUNCH, "update_row", dict(ROWS=4, num_warps=4, float64=dict(ROWS=3, num_warps=4))
    )
    x, k, v, beta = rand_update_args(lead=(2, 5), d=20, dv=1)
    with pytest.raises(ValueError, match="float64 must be 0 or a power of two, got 3"):
        ddl_update(x, k, v, beta, backend="triton")
    x32, k32, v32, beta32 = (t.float() for t in (x, k, v, beta))
    torch.testing.assert_close(
        ddl_update(x32, k32, v32, beta32, backend="triton"), ddl_update_ref(x32, k32, v32, beta32)
    )


@pytest.mark.parametrize("dv", [1, 4])
def test_triton_update_bf16_launch_shapes_exact(dv, monkeypatch):
    """The launch shapes shipped for a bf16 state, run on float64 inputs (exact comparison): 42 tokens
    give several programs of the pipelined 32-token backward and a ragged last one."""
    monkeypatch.setattr(ddl_triton, "_FILL_OUTPUTS_WITH_NAN", True)
    for key in ("update_bwd", "update_row"):
        entry = ddl_triton.LAUNCH[key]
        monkeypatch.setitem(
            ddl_triton.LAUNCH, key, {**entry, "float64": ddl_triton._cfg(key, torch.bfloat16)}
        )
    assert (
        ddl_triton._cfg("update_bwd", F64)["TOKENS"] == 32
        and ddl_triton._cfg("update_bwd", F64)["STAGES"] == 2
    )
    check_update_and_cc(lead=(2, 21), dv=dv)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_triton_update_backward_loop_kinds(triton_small, monkeypatch, stages, fused):
    """Both ways of emitting the backward's loop over a program's tokens (plain, pipelined)."""
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_bwd", dict(TOKENS=3, STAGES=stages, num_warps=4))
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=3))
    if fused:
        w = torch.randn(20, 3, dtype=F64, requires_grad=True)
        fn = lambda *a: ddl.ddl_update_compress_cc(*a, backend="triton")  # noqa: E731
        compare(fn, ddl.ddl_update_compress_cc_ref, (x, k, v, beta, w))
    else:
        compare(lambda *a: ddl_update(*a, backend="triton"), ddl_update_ref, (x, k, v, beta))


@pytest.mark.parametrize("rows", [0, 4, 16])  # 0: the general [d, d_v] kernel; 16 > the 10 tokens
@pytest.mark.parametrize("erase", [True, False])
def test_triton_update_dv1_row_kernels(triton_small, monkeypatch, rows, erase):
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_row", dict(ROWS=rows, num_warps=4))
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=1))
    compare(
        lambda *a: ddl_update(*a, eps=1e-3, erase=erase, backend="triton"),
        lambda *a: ddl_update_ref(*a, eps=1e-3, erase=erase),
        (x, k, v, beta),
    )


# ROWS x STEPS tokens a backward program: one token; a ragged last tile and program (10 tokens); more rows
# than tokens
@pytest.mark.parametrize("rows,steps", [(1, 1), (2, 3), (4, 2), (16, 1)])
@pytest.mark.parametrize("erase", [True, False])
def test_triton_update_norm_matches_reference(triton_small, monkeypatch, rows, steps, erase):
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_norm", dict(ROWS=rows, num_warps=4))
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_norm_bwd", dict(ROWS=rows, STEPS=steps, num_warps=4))
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=1))
    nw, lw = torch.randn(20, dtype=F64, requires_grad=True), torch.randn(2, 20, dtype=F64, requires_grad=True)
    compare(
        lambda *a: ddl.ddl_update_norm(*a, eps=1e-3, norm_eps=1e-4, erase=erase, backend="triton"),
        lambda *a: ddl.ddl_update_norm_ref(*a, eps=1e-3, norm_eps=1e-4, erase=erase),
        (x, k, v, beta, nw, lw),
    )


@pytest.mark.parametrize("erase", [True, False])
def test_triton_update_norm_of_v_logit_alone(triton_small, monkeypatch, erase):
    """logit_weight [1, d]: the read of a rule without beta's logit; a ragged last tile and program."""
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_norm", dict(ROWS=4, num_warps=4))
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_norm_bwd", dict(ROWS=2, STEPS=3, num_warps=4))
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=1))
    nw, lw = torch.randn(20, dtype=F64, requires_grad=True), torch.randn(1, 20, dtype=F64, requires_grad=True)
    out = ddl.ddl_update_norm(x, k, v, beta, nw, lw, backend="triton")
    assert out[2].shape == (2, 5, 1)
    compare(
        lambda *a: ddl.ddl_update_norm(*a, eps=1e-3, norm_eps=1e-4, erase=erase, backend="triton"),
        lambda *a: ddl.ddl_update_norm_ref(*a, eps=1e-3, norm_eps=1e-4, erase=erase),
        (x, k, v, beta, nw, lw),
    )


def test_triton_update_norm_gradcheck(triton_small):
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(1, 3), d=5, dv=1))
    nw, lw = torch.randn(5, dtype=F64, requires_grad=True), torch.randn(2, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: ddl.ddl_update_norm(*a, eps=1e-2, norm_eps=1e-2, backend="triton"),
        (x, k, v, beta, nw, lw),
        fast_mode=True,
    )


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_triton_update_norm_low_precision(triton_small, state):
    """Training's dtypes: a fp32 or bf16 state, bf16 k, c in bf16 (autocast's), the rest fp32. The state
    against the reference's (a bf16 state rounds the same sum, in another order); c, z and inv_rms against
    float64 loops over the state the kernel stored, as the next sublayer reads it."""
    x, k, v, beta = rand_update_args(lead=(2, 5), d=40, dv=1, dtype=torch.float32)
    x, k = x.to(state), k.bfloat16()
    nw, lw = torch.randn(40), torch.randn(2, 40)
    x_new, c, z, inv = ddl.ddl_update_norm(x, k, v, beta, nw, lw, c_dtype=torch.bfloat16, backend="triton")
    assert [t.dtype for t in (x_new, c, z, inv)] == [state, torch.bfloat16, torch.float32, torch.float32]
    tol = 1e-5 if state == torch.float32 else 1e-2
    torch.testing.assert_close(x_new.float(), ddl_update_ref(x, k, v, beta).float(), rtol=tol, atol=tol)
    want_c, want_z, want_inv = naive_norm_read(x_new, nw, lw, 1e-5)
    torch.testing.assert_close(c.double(), want_c.bfloat16().double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(z.double(), want_z, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inv.double(), want_inv, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("logits", [2, 1])
def test_update_norm_ops_pass_opcheck(triton_small, logits):
    """torch.library's own checks of ddl::update_norm and its backward: the fakes match the kernels' outputs
    (shapes, dtypes, no aliasing), and the autograd registration under AOT dispatch."""
    from ops.ddl.triton_norm import _update_norm_bwd_op, _update_norm_op

    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(7,), d=20, dv=1))
    nw = torch.randn(20, dtype=F64, requires_grad=True)
    lw = torch.randn(logits, 20, dtype=F64, requires_grad=True)
    args = (x[..., 0], k, v[..., 0], beta, nw, lw, 1e-3, 1e-4, True, torch.float32, None)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_update_norm_op, args, test_utils=checks)
    _, _, _, inv, rs, r = (t.detach() for t in _update_norm_op(*args))
    plain = [t.detach() for t in args[:6]]
    grads = (torch.randn(7, 20, dtype=F64), torch.randn(7, 20, dtype=F64), torch.randn(7, logits, dtype=F64),
             torch.randn(7, dtype=F64))  # fmt: skip
    torch.library.opcheck(
        _update_norm_bwd_op, (*plain[:4], rs, r, *plain[4:], inv, *grads, True, None), test_utils=checks[:2]
    )
    seeded = (
        x[..., 0].detach().bfloat16(),
        *plain[1:],
        *args[6:10],
        torch.tensor([5]),
    )  # stochastic rounding
    torch.library.opcheck(_update_norm_op, seeded, test_utils=checks[:2])


def test_update_norm_bad_inputs():
    x, k, v, beta = rand_update_args(lead=(2,), d=6, dv=1)
    nw, lw = torch.randn(6, dtype=F64), torch.randn(2, 6, dtype=F64)
    with pytest.raises(ValueError, match="d_v = 1"):
        ddl.ddl_update_norm(*rand_update_args(lead=(2,), d=6, dv=2), nw, lw)
    with pytest.raises(ValueError, match="norm_weight must be"):
        ddl.ddl_update_norm(x, k, v, beta, nw[:-1], lw)
    for bad in (lw[:0], torch.randn(3, 6, dtype=F64), lw[:, :-1]):  # 1 or 2 rows of d
        with pytest.raises(ValueError, match="logit_weight"):
            ddl.ddl_update_norm(x, k, v, beta, nw, bad)
    with pytest.raises(TypeError, match="norm_weight"):
        ddl.ddl_update_norm(x, k, v, beta, [1.0] * 6, lw)


@pytest.mark.parametrize("dv", [1, 4])
@pytest.mark.parametrize("erase", [True, False])
def test_triton_update_compress_cc_matches_reference(triton_small, dv, erase):
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=dv))
    w = torch.randn(20, dv, dtype=F64, requires_grad=True)
    compare(
        lambda *a: ddl.ddl_update_compress_cc(*a, erase=erase, backend="triton"),
        lambda *a: ddl.ddl_update_compress_cc_ref(*a, erase=erase),
        (x, k, v, beta, w),
    )


def second_update(
    kind, x1, k, v, beta, extra, erase, rebuild_from=None, backend="triton", seed=None, eps=1e-5,
    doc_start=None,
):  # fmt: skip
    """A block's second update of kind "plain" | "cc" | "tc" (the read-out of the next block fused; TC's
    within the documents of doc_start)."""
    kw = dict(erase=erase, backend=backend, rebuild_from=rebuild_from, seed=seed, eps=eps)
    if kind == "plain":
        return ddl_update(x1, k, v, beta, **kw)
    if kind == "cc":
        return ddl.ddl_update_compress_cc(x1, k, v, beta, *extra, **kw)
    return ddl.ddl_update_compress_tc(x1, k, v, beta, *extra, doc_start=doc_start, **kw)


def earlier_updates(n, dv, dtype=F64, lead=(2, 5)):
    """x0 and n updates' (k, v, beta), the chain a later update rebuilds its input state from."""
    x0 = rand_update_args(lead=lead, d=20, dv=dv, dtype=dtype)[0]
    return x0, [rand_update_args(lead=lead, d=20, dv=dv, dtype=dtype)[1:] for _ in range(n)]


def run_chain(x0, kvbs, erase, backend, seeds=None):
    """x0 through the updates kvbs = ((k, v, beta), ...): the state and each update's step (return_step);
    seeds: each update's (stochastic rounding)."""
    x, steps = x0, []
    for i, kvb in enumerate(kvbs):
        seed = seeds[i] if seeds else None
        x, step = ddl_update(x, *kvb, erase=erase, backend=backend, return_step=True, seed=seed)
        steps.append(step)
    return x, steps


@pytest.mark.parametrize("kind,dv", [("plain", 1), ("plain", 4), ("cc", 4), ("tc", 3), ("tc", 1)])
@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("n_steps", [1, 3])
def test_triton_update_rebuilt_matches_reference(triton_small, kind, dv, erase, n_steps):
    """n_steps updates, then one that rebuilds its input state from their input in the backward: values
    and gradients of every input (the earlier updates' too) against the reference chain."""
    inputs = chain_inputs(kind, dv, n_steps)
    compare(
        chained_update(kind, n_steps, erase, "triton", True), chained_update(kind, n_steps, erase), inputs
    )


def chain_inputs(kind, dv, n_steps, dtype=F64, K=3, lead=(2, 5)):
    """The inputs of chained_update, requiring grad: x0, n_steps updates' (k, v, beta), the last update's
    (k, v, beta) and its read-out's weights (TC: K taps)."""
    x0, kvbs = earlier_updates(n_steps, dv, dtype, lead)
    k, v, b = rand_update_args(lead=lead, d=20, dv=dv, dtype=dtype)[1:]
    extra = [w.to(dtype) for w in read_out_weights(kind, dv, K=K)]
    return tuple(t.requires_grad_() for t in (x0, *(t for s in kvbs for t in s), k, v, b, *extra))


def chained_update(kind, n_steps, erase, backend="torch", rebuild=False, doc_start=None):
    """f(*chain_inputs(...)): n_steps updates from x0, then one of kind (second_update), which rebuilds its
    input state from x0 when rebuild is true (and there is a chain)."""

    def f(x0, *rest):
        kvbs = [rest[3 * i : 3 * i + 3] for i in range(n_steps)]
        k, v, b, *extra = rest[3 * n_steps :]
        x, steps = run_chain(x0, kvbs, erase, backend)
        rebuild_from = (x0, steps) if rebuild and steps else None
        return second_update(kind, x, k, v, b, extra, erase, rebuild_from, backend, doc_start=doc_start)

    return f


# The TC backward (two kernels: gk per token, then runs of tokens by blocks of d) at TC_BWD_SMALL.


@pytest.mark.parametrize("dv", [1, 3, 4])
@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("n_steps", [0, 2])
def test_triton_update_tc_backward_matches_reference(triton_small, dv, erase, n_steps):
    """Against the reference, float64, outputs NaN-filled; with n_steps > 0 the state rebuilt from x0 per
    d-block."""
    inputs = chain_inputs("tc", dv, n_steps)
    compare(
        chained_update("tc", n_steps, erase, "triton", True), chained_update("tc", n_steps, erase), inputs
    )


@pytest.mark.parametrize("K", [1, 6])  # one tap; more taps (6) than tokens in a sequence (5)
def test_triton_update_tc_taps(triton_small, K):
    inputs = chain_inputs("tc", 4, 1, K=K)
    compare(chained_update("tc", 1, True, "triton", True), chained_update("tc", 1, True), inputs)


@pytest.mark.parametrize(
    "dv,K,erase,stages", [(1, 3, True, 2), (4, 6, True, 1), (3, 1, False, 2), (4, 4, True, 1)]
)
@pytest.mark.parametrize("n_steps", [0, 2])
def test_triton_update_tc_forward_fused(triton_small, monkeypatch, dv, K, erase, stages, n_steps):
    """LAUNCH['update_tc_fwd'] FUSED: the update + TC read-out forward as one kernel over runs of 3 whole
    tokens (10 tokens: runs start before, at and after a sequence's first token, T = 5, the last ragged),
    against the reference, float64, NaN-filled; K = 6 taps reach past a sequence; n_steps > 0: the op that
    rebuilds its state in the backward. The two-kernel forward must not run."""
    cfg = {**ddl_triton.LAUNCH["update_tc_fwd"], "FUSED": True, "STAGES": stages}
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_tc_fwd", cfg)
    monkeypatch.setattr(ddl_triton, "_tc_forward", None)  # calling it fails
    inputs = chain_inputs("tc", dv, n_steps, K=K)
    compare(
        chained_update("tc", n_steps, erase, "triton", True), chained_update("tc", n_steps, erase), inputs
    )


def test_triton_update_tc_shipped_shapes(monkeypatch):
    """The shipped TC backward shape (d-blocks wider than d = 20, 42 tokens), float64, NaN-filled."""
    monkeypatch.setattr(ddl_triton, "_FILL_OUTPUTS_WITH_NAN", True)
    inputs = chain_inputs("tc", 4, 0)
    compare(chained_update("tc", 0, True, "triton"), chained_update("tc", 0, True), inputs)


@pytest.mark.parametrize("kind", ["plain", "cc", "tc"])
def test_triton_update_bf16_state_against_fp32(triton_small, kind):
    """A bf16 state through the backward (rebuilt from x0 by two updates, rounded to bf16 after each)
    against the fp32 reference at the same inputs: within the bf16 tolerance of the GPU tests."""
    inputs = chain_inputs(kind, 4, 2, torch.float32)
    inputs = tuple(
        t.detach().to(torch.bfloat16 if i == 0 else t.dtype).requires_grad_() for i, t in enumerate(inputs)
    )
    out = chained_update(kind, 2, True, "triton", True)(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    ups = [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in out]
    grads = torch.autograd.grad(out, inputs, ups)
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    out = chained_update(kind, 2, True)(*ref_in)
    out = out if isinstance(out, tuple) else (out,)
    ref = torch.autograd.grad(out, ref_in, [u.float() for u in ups])
    for i, (a, b) in enumerate(zip(grads, ref)):
        assert rel_err(a, b) < 1e-2, i


@pytest.mark.parametrize("kind", ["plain", "cc", "tc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_update_rebuilt_gradients_equal_kept(triton_small, kind, dtype):
    """The rebuilt state is the one the forward stored (rounded to the state's dtype after each update), so
    the gradients equal those of the op that keeps it, up to fp32 reduction order."""
    x0, kvbs = earlier_updates(2, 4, torch.float32)
    k, v, b = rand_update_args(lead=(2, 5), d=20, dv=4, dtype=torch.float32)[1:]
    extra = [w.float() for w in read_out_weights(kind, 4)]
    for kept, rebuilt in zip(*kept_and_rebuilt_grads(kind, x0.to(dtype), kvbs, (k, v, b), extra)):
        torch.testing.assert_close(rebuilt.float(), kept.float(), rtol=1e-5, atol=1e-5)


def kept_and_rebuilt_grads(kind, x0, kvbs, kvb, extra, seeds=None):
    """Gradients of every input of the updates kvbs, then an update of `kind`, at x0: the last update
    keeping its input state, then rebuilding it (the same random upstream gradients); seeds: the n + 1
    updates' (stochastic rounding). Also the outputs, ([kept], [rebuilt])."""
    grads, outs, ups, n = [], [], None, len(kvbs)
    for rebuild in (False, True):
        inputs = [t.detach().clone().requires_grad_() for t in (x0, *(t for s in kvbs for t in s), *kvb)]
        kvbs_in = [inputs[1 + 3 * i : 4 + 3 * i] for i in range(n)]
        x, steps = run_chain(inputs[0], kvbs_in, True, "triton", seeds)
        out = second_update(
            kind, x, *inputs[1 + 3 * n :], extra, True, (inputs[0], steps) if rebuild else None,
            seed=seeds[n] if seeds else None,
        )  # fmt: skip
        out = out if isinstance(out, tuple) else (out,)
        ups = ups or [torch.randn_like(o, dtype=torch.float32).to(o.dtype) for o in out]
        grads.append(torch.autograd.grad(out, inputs, ups))
        outs.append(out)
    return grads if seeds is None else (grads, outs)


def read_out_weights(kind, dv, d=20, K=3):
    """The fused read-out's weights of a second update: none, CC's [d, d_v], TC's conv and read."""
    if kind == "plain":
        return []
    if kind == "cc":
        return [torch.randn(d, dv, dtype=F64)]
    return [torch.randn(d, dv, K, dtype=F64), torch.randn(dv, dtype=F64)]


def kept_by_autograd(fn, *args):
    """fn(*args) and the data pointers of the tensors autograd saved for its backward."""
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.data_ptr()) or t, lambda t: t):
        out = fn(*args)
    return out, kept


@pytest.mark.parametrize("kind", ["plain", "cc", "tc"])
def test_triton_update_rebuilt_keeps_no_input_state(kind):
    """The point of rebuild_from: autograd keeps x0 (the first update keeps it anyway), never the states
    the later updates ran on."""
    x0, kvbs = earlier_updates(2, 4)
    x0.requires_grad_()
    k, v, b = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=4)[1:])
    extra = read_out_weights(kind, 4)
    for rebuild in (False, True):
        x1, s1 = ddl_update(x0, *kvbs[0], backend="triton", return_step=True)
        upd = (x0, [s1]) if rebuild else None
        x2, s2 = ddl_update(x1, *kvbs[1], backend="triton", rebuild_from=upd, return_step=True)
        upd = (x0, [s1, s2]) if rebuild else None
        _, kept = kept_by_autograd(second_update, kind, x2, k, v, b, extra, True, upd)
        assert (x2.data_ptr() in kept) != rebuild
        assert x1.data_ptr() not in kept
        assert (x0.data_ptr() in kept) == rebuild


def test_rebuild_from_must_be_a_state_and_steps():
    x, k, v, b = rand_update_args(lead=(2, 5), d=20, dv=4)
    _, step = ddl_update(x, k, v, b, backend="torch", return_step=True)
    for bad in ((x, k, v, b), (x, ()), (x, [(k, v, b)])):
        with pytest.raises(ValueError, match="rebuild_from must be"):
            ddl_update(x, k, v, b, backend="triton", rebuild_from=bad)
    with pytest.raises(ValueError, match="x0 must be like x"):
        ddl_update(x, k, v, b, backend="triton", rebuild_from=(x[:1], [step]))
    with pytest.raises(ValueError, match=r"step 1: r must be \(2, 5, 4\)"):
        ddl_update(
            x, k, v, b, backend="triton", rebuild_from=(x, [step, (*step[:3], step[3][..., :1], None)])
        )
    seed = torch.tensor([3])
    with pytest.raises(ValueError, match="each have a seed if this update has one"):
        ddl_update(x.bfloat16(), k, v, b, backend="triton", rebuild_from=(x.bfloat16(), [step]), seed=seed)
    with pytest.raises(ValueError, match="seed .stochastic rounding. is for a bfloat16 state"):
        ddl_update(x, k, v, b, backend="triton", seed=seed)
    with pytest.raises(TypeError, match="seed must be None or an integer tensor of one element"):
        ddl_update(x.bfloat16(), k, v, b, seed=torch.tensor([1.0]))


def update_terms_loops(x, k, v, eps, erase):
    """(rs, r) of the update by plain loops over d and d_v (float64), from its definition."""
    lead, (d, dv) = x.shape[:-2], x.shape[-2:]
    rs, r = torch.zeros(lead, dtype=F64), torch.zeros(*lead, dv, dtype=F64)
    for idx in itertools.product(*map(range, lead)):
        norm2 = sum(float(k[idx][i]) ** 2 for i in range(d))
        rs[idx] = 1.0 / math.sqrt(norm2 + eps * eps)
        for j in range(dv):
            read = sum(float(k[idx][i]) * float(rs[idx]) * float(x[idx][i, j]) for i in range(d))
            r[idx][j] = float(v[idx][j]) - (read if erase else 0.0)
    return rs, r


@pytest.mark.parametrize("kind,dv", [("plain", 1), ("plain", 4), ("cc", 4), ("tc", 3)])
@pytest.mark.parametrize("erase", [True, False])
def test_return_step_is_the_update_and_its_terms(triton_small, kind, dv, erase):
    """return_step's (k, beta, rs, r), from the kernels and the reference: the terms by their definition
    (loops), and the update they make, x + beta (k rs) r^T."""
    x, k, v, b = rand_update_args(lead=(2, 3), d=20, dv=dv)
    extra = read_out_weights(kind, dv)
    want = update_terms_loops(x, k, v, 1e-5, erase)
    for backend in ("triton", "torch"):
        kw = dict(erase=erase, backend=backend, return_step=True)
        if kind == "plain":
            x_new, step = ddl_update(x, k, v, b, **kw)
        else:
            fused = ddl.ddl_update_compress_cc if kind == "cc" else ddl.ddl_update_compress_tc
            x_new, _, step = fused(x, k, v, b, *extra, **kw)
        assert step[0] is k and step[1] is b
        torch.testing.assert_close(step[2], want[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(step[3], want[1], rtol=1e-12, atol=1e-12)
        rebuilt = x + b[..., None, None] * (k * step[2][..., None])[..., :, None] * step[3][..., None, :]
        torch.testing.assert_close(x_new, rebuilt, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dv,K,erase", [(1, 3, True), (3, 1, False), (4, 6, True), (3, 3, False)])
def test_triton_update_compress_tc_matches_reference(triton_small, dv, K, erase):
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(2, 5), d=20, dv=dv))
    cw = torch.randn(20, dv, K, dtype=F64, requires_grad=True)
    read = torch.randn(dv, dtype=F64, requires_grad=True)
    compare(
        lambda *a: ddl.ddl_update_compress_tc(*a, erase=erase, backend="triton"),
        lambda *a: ddl.ddl_update_compress_tc_ref(*a, erase=erase),
        (x, k, v, beta, cw, read),
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes (eps = 0)
def test_triton_update_edge_cases(triton_small):
    # k = 0 row, beta = 0 row, one token, and the exact-write property through the kernel
    x, k, v, beta = rand_update_args(lead=(3,), d=33, dv=4)
    k[0] = 0.0
    beta[1] = 0.0
    out = ddl_update(x, k, v, beta, backend="triton")
    torch.testing.assert_close(out[0], x[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], x[1], rtol=0, atol=0)
    one = ddl_update(x[2:], k[2:], v[2:], torch.ones(1, dtype=F64), eps=0.0, backend="triton")
    khat = k[2] / k[2].norm()
    torch.testing.assert_close(khat @ one[0], v[2], rtol=0, atol=1e-12)


def test_triton_update_gradcheck(triton_small):
    x, k, v, beta = (t.requires_grad_() for t in rand_update_args(lead=(1, 3), d=5, dv=2))
    w = torch.randn(5, 2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: ddl.ddl_update_compress_cc(*a, eps=1e-2, backend="triton"),
        (x, k, v, beta, w),
        fast_mode=True,
    )


@pytest.mark.parametrize("K", [1, 3, 6])
@pytest.mark.parametrize("dv", [1, 3])
def test_triton_compressors_and_ec_match_reference(triton_small, K, dv):
    x = torch.randn(2, 5, 20, dv, dtype=F64, requires_grad=True)
    w = torch.randn(20, dv, dtype=F64, requires_grad=True)
    cw = torch.randn(20, dv, K, dtype=F64, requires_grad=True)
    read = torch.randn(dv, dtype=F64, requires_grad=True)
    emb = torch.randn(2, 5, 20, dtype=F64, requires_grad=True)
    compare(lambda *a: compress_cc(*a, backend="triton"), compress_cc_ref, (x, w))
    compare(lambda *a: compress_tc(*a, backend="triton"), compress_tc_ref, (x, cw, read))
    compare(lambda *a: expand_ec(*a, backend="triton"), expand_ec_ref, (emb, cw))


def test_triton_bf16_and_fp32_inputs(triton_small):
    # storage dtypes of training: fp32 math inside, result in x's dtype
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, k, v, beta = rand_update_args(lead=(2, 3), d=40, dv=4, dtype=dtype)
        w = torch.randn(40, 4, dtype=dtype)
        out, h = ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton")
        ref = ddl_update_ref(x, k, v, beta)
        assert out.dtype == dtype and h.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(h.float(), compress_cc_ref(ref, w).float(), rtol=tol, atol=tol * 4)


def test_auto_backend_rule():
    x, k, v, beta = rand_update_args()
    assert (
        resolve_backend("f", "auto", x) == "torch"
    )  # CPU tensors: the reference, even under the interpreter
    try:
        set_auto_backend("triton")
        assert resolve_backend("f", "auto", x) == "triton"
    finally:
        set_auto_backend(None)


# ---------------------------------------------------------------------------------------------------
# GPU: realistic shapes (d 768, d_v 4, 8192 tokens), bf16 state / fp32 state, against the reference run
# in float64 on the same inputs.

cuda = pytest.mark.gpu


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused_forward", [False, True])  # LAUNCH['update_tc_fwd'] FUSED
def test_gpu_update_compress_tc_realistic(dtype, fused_forward, monkeypatch):
    shape = {k: v for k, v in ddl_triton.LAUNCH["update_tc_fwd"].items() if not isinstance(v, dict)}
    monkeypatch.setitem(ddl_triton.LAUNCH, "update_tc_fwd", {**shape, "FUSED": fused_forward})  # both dtypes
    dev = "cuda"
    B, T, d, dv, K = 8, 1024, 768, 4, 4
    x = torch.randn(B, T, d, dv, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, dv, device=dev, dtype=dtype, requires_grad=True)
    beta = (2 * torch.rand(B, T, device=dev)).to(dtype).requires_grad_()
    cw = torch.randn(d, dv, K, device=dev, requires_grad=True)
    read = torch.randn(dv, device=dev, requires_grad=True)
    inputs = (x, k, v, beta, cw, read)
    out = ddl.ddl_update_compress_tc(*inputs, backend="triton")
    ins64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = ddl.ddl_update_compress_tc_ref(*ins64)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(out, ref):
        assert rel_err(a, b) < tol
    ups = [torch.randn_like(o) for o in out]
    g = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out, ups)), inputs)
    g_ref = torch.autograd.grad(sum((o * u.double()).sum() for o, u in zip(ref, ups)), ins64)
    for name, a, b in zip("x k v beta conv read".split(), g, g_ref):
        assert rel_err(a, b) < tol, name


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dv", [1, 4])
@pytest.mark.parametrize(
    "cfg",
    [
        {},  # the shipped launch shapes
        {"update_bwd": dict(TOKENS=8, STAGES=1, num_warps=4), "update_row": dict(ROWS=0, num_warps=4)},
        {"update_bwd": dict(TOKENS=16, STAGES=2, num_warps=8), "update_row": dict(ROWS=8, num_warps=8)},
    ],
    ids=["shipped", "plain-general", "pipelined-rows8"],
)
def test_gpu_update_realistic(dtype, fused, dv, cfg, monkeypatch):
    for key, val in cfg.items():
        monkeypatch.setitem(ddl_triton.LAUNCH, key, val)
    monkeypatch.setattr(ddl_triton, "_FILL_OUTPUTS_WITH_NAN", True)
    dev = "cuda"
    B, T, d = 8, 1024, 768
    x = torch.randn(B, T, d, dv, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, dv, device=dev, dtype=dtype, requires_grad=True)
    beta = (2 * torch.rand(B, T, device=dev)).to(dtype).requires_grad_()
    w = torch.randn(d, dv, device=dev, dtype=dtype, requires_grad=True)
    inputs = (x, k, v, beta, w) if fused else (x, k, v, beta)
    if fused:
        out = ddl.ddl_update_compress_cc(*inputs, backend="triton")
        ref = ddl.ddl_update_compress_cc_ref(*(t.double() for t in inputs))
    else:
        out = (ddl_update(*inputs, backend="triton"),)
        ref = (ddl_update_ref(*(t.double() for t in inputs)),)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(out, ref):
        assert rel_err(a, b) < tol
    ups = [torch.randn_like(o) for o in out]
    g = torch.autograd.grad(sum((o * u).sum() for o, u in zip(out, ups)), inputs)
    ins64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = ddl.ddl_update_compress_cc_ref(*ins64) if fused else (ddl_update_ref(*ins64),)
    g_ref = torch.autograd.grad(sum((o * u.double()).sum() for o, u in zip(ref, ups)), ins64)
    for name, a, b in zip("x k v beta w".split(), g, g_ref):
        assert rel_err(a, b) < tol, name


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_compressors_realistic(dtype, monkeypatch):
    dev = "cuda"
    B, T, d, dv, K = 8, 1024, 768, 4, 4
    x = torch.randn(B, T, d, dv, device=dev, dtype=dtype, requires_grad=True)
    emb = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(d, dv, device=dev, requires_grad=True)
    cw = torch.randn(d, dv, K, device=dev, requires_grad=True)
    read = torch.randn(dv, device=dev, requires_grad=True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for fn, ref_fn, inputs in (
        (compress_cc, compress_cc_ref, (x, w)),
        (compress_tc, compress_tc_ref, (x, cw, read)),
        (expand_ec, expand_ec_ref, (emb, cw)),
    ):
        out = fn(*inputs, backend="triton")
        ins64 = [t.detach().double().requires_grad_() for t in inputs]
        ref = ref_fn(*ins64)
        assert rel_err(out, ref) < tol, fn.__name__
        up = torch.randn_like(out)
        g = torch.autograd.grad((out * up).sum(), inputs)
        g_ref = torch.autograd.grad((ref * up.double()).sum(), ins64)
        for a, b in zip(g, g_ref):
            assert rel_err(a, b) < tol, fn.__name__


@cuda
@pytest.mark.parametrize("kind", ["plain", "cc", "tc"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_update_rebuilt_realistic(dtype, kind):
    """A state rebuilt by 3 updates in the backward kernels gives the gradients of keeping it (GPT-2 small
    width, 4 sequences of 1024; the state dtype's rounding after each update as in the forward)."""
    dev, B, T, d, dv = "cuda", 4, 1024, 768, 4
    gen = torch.Generator(dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=dev, generator=gen)).to(dtype)

    x0 = rnd(B, T, d, dv)
    steps = [(rnd(B, T, d), rnd(B, T, dv), (2 * torch.rand(B, T, device=dev, generator=gen)).to(dtype))
             for _ in range(3)]  # fmt: skip
    k, v, b = rnd(B, T, d), rnd(B, T, dv), (2 * torch.rand(B, T, device=dev, generator=gen)).to(dtype)
    extra = [w.to(dev).float() for w in read_out_weights(kind, dv, d=d, K=4)]
    for i, (kept, rebuilt) in enumerate(zip(*kept_and_rebuilt_grads(kind, x0, steps, (k, v, b), extra))):
        assert rel_err(rebuilt, kept) < 1e-5, i


# ---------------------------------------------------------------------------------------------------
# Stochastic rounding of a bf16 state (seed=...): the reference's rounding against its definition, the
# kernels' against the reference's, and the backward's rebuild drawing the forward's bits.


def fmix32(h):
    """murmur3's 32-bit finaliser on a Python int (its published definition)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def bf16_neighbours(x):
    """(lo, hi, f): the bf16 values next to fp32 x toward zero and away from it, and x's fraction of the
    step between them (0 where x is a bf16 value)."""
    bits = x.view(torch.int32)
    lo = (bits & ~0xFFFF).view(torch.float32)  # the low 16 bits cut: toward zero
    hi = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return lo, hi, (x - lo) / (hi - lo)


def test_round_state_is_unbiased_stochastic_rounding():
    from ops.ddl.naive import _mix32_ref, round_state

    vals = torch.tensor([0, 1, 2**31, 2**32 - 1] + torch.randint(0, 2**32, (60,)).tolist())
    assert _mix32_ref(vals).tolist() == [fmix32(int(h)) for h in vals]
    x = torch.randn(4096) * torch.logspace(-3, 3, 4096)
    lo, hi, f = bf16_neighbours(x)
    ys = torch.stack([round_state(x, torch.bfloat16, torch.tensor([s])).float() for s in range(400)])
    assert ((ys == lo) | (ys == hi)).all()  # one of the two neighbours
    up = (ys == hi).float()
    err = ((ys - x) / (hi - lo)).mean()  # in steps: rounding to nearest or toward zero gives ~0.25
    assert abs(err) < 3e-3, err
    for b in range(4):  # P(up) = f, by fraction bins (~400k draws each, s.d. < 1e-3)
        m = (f >= b / 4) & (f < (b + 1) / 4)
        assert abs(up[:, m].mean() - f[m].mean()) < 5e-3, b
    assert ((up.mean(0) - f).abs() < 0.2).all()  # per element over 400 seeds (s.d. <= 0.025)
    assert not torch.equal(ys[0], ys[1])
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), -float("inf"), float("nan")])
    out = round_state(special, torch.bfloat16, torch.tensor([7])).float()
    assert torch.equal(out[:6], special[:6]) and out[6].isnan()  # bf16 values kept, NaN stays NaN
    g = torch.randn(4096)
    xg = x.clone().requires_grad_()
    (round_state(xg, torch.bfloat16, torch.tensor([1])).float() * g).sum().backward()
    assert torch.equal(xg.grad, g.bfloat16().float())  # straight through, as a cast to bf16


EPS_EXACT = 2.0**-12  # eps^2 = 2^-24 vanishes next to |k|^2 = 4 in fp32 (its step there is 2^-21)


def exact_update_args(lead, d, dv, gen):
    """An update whose fp32 arithmetic is exact in any order (bf16 x, v, beta; k with four entries of +-1,
    so |k| = 2 and, with eps = EPS_EXACT, khat = k / 2): the kernels' x' before rounding is the
    reference's, bit for bit, so their stochastic rounding must agree bit for bit too."""
    x = torch.randn(*lead, d, dv, generator=gen).bfloat16()
    pick = torch.rand(*lead, d, generator=gen).argsort(-1)[..., :4]
    sign = torch.randint(0, 2, (*lead, 4), generator=gen).float() * 2 - 1
    k = torch.zeros(*lead, d).scatter_(-1, pick, sign)
    v = torch.randn(*lead, dv, generator=gen).bfloat16().float()
    beta = (2 * torch.rand(lead, generator=gen)).bfloat16().float()
    return x, k, v, beta


@pytest.mark.parametrize(
    "kind,dv", [("plain", 1), ("plain", 4), ("cc", 4), ("tc", 4), ("tc-fused", 4), ("norm", 1)]
)
@pytest.mark.parametrize("erase", [True, False])
def test_triton_stochastic_rounding_matches_reference(triton_small, monkeypatch, kind, dv, erase):
    """With a seed, every kernel's x' is the reference's bit for bit (exact_update_args), and differs from
    another seed's and from rounding to nearest; read-outs and gradients to bf16 precision. tc-fused: the
    TC forward as one kernel (LAUNCH['update_tc_fwd'] FUSED)."""
    if kind == "tc-fused":
        monkeypatch.setitem(ddl_triton.LAUNCH["update_tc_fwd"], "FUSED", True)
        monkeypatch.setattr(ddl_triton, "_tc_forward", None)  # calling it fails
        kind = "tc"
    gen = torch.Generator().manual_seed(0)
    x, k, v, beta = exact_update_args((2, 5), 20, dv, gen)
    extra = [w.float() for w in read_out_weights(kind, dv)] if kind != "norm" else []
    inputs = tuple(t.requires_grad_() for t in (x, k, v, beta, *extra))

    def run(backend, seed):
        def f(x, k, v, beta, *extra):
            if kind == "norm":
                nw, lw = torch.linspace(0.5, 1.5, 20), torch.linspace(-1, 1, 40).view(2, 20)
                out = ddl.ddl_update_norm(
                    x, k, v, beta, nw, lw, eps=EPS_EXACT, erase=erase, backend=backend, seed=seed
                )
                return out[0], out[1], out[2]
            return second_update(kind, x, k, v, beta, extra, erase, backend=backend, seed=seed, eps=EPS_EXACT)

        return f

    seed = torch.tensor([12345])
    out = run("triton", seed)(*inputs)
    out_ref = run("torch", seed)(*inputs)
    x_new = out[0] if isinstance(out, tuple) else out
    x_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
    assert x_new.dtype == torch.bfloat16 and torch.equal(x_new, x_ref)
    other = run("triton", torch.tensor([54321]))(*inputs)
    nearest = run("torch", None)(*inputs)
    for y in (other, nearest):
        y = y[0] if isinstance(y, tuple) else y
        assert (y != x_new).float().mean() > 0.01  # k moves 4 of the 20 rows
    outs = [o if isinstance(o, tuple) else (o,) for o in (out, out_ref)]
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-2
    ups = [torch.randn_like(o) for o in outs[1]]
    grads = [torch.autograd.grad(sum((o * u).sum() for o, u in zip(os, ups)), inputs) for os in outs]
    for name, a, b in zip("x k v beta w w2".split(), *grads):  # the reference's dX' is bf16, as X'
        assert rel_err(a, b) < 1e-2, name


@pytest.mark.parametrize("kind", ["plain", "cc", "tc"])
def test_triton_stochastic_rebuild_draws_the_forwards_bits(triton_small, kind):
    """A bf16 state rebuilt in the backward through 3 stochastically rounded updates is the state the
    forward stored, bit for bit: values and every gradient equal to keeping it (rounding the rebuild to
    nearest instead moves the gradients by bf16 steps)."""
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 5, 20, 4, generator=gen).bfloat16()
    kvbs = [rand_update_args(lead=(2, 5), d=20, dv=4, dtype=torch.float32)[1:] for _ in range(4)]
    extra = [w.float() for w in read_out_weights(kind, 4)]
    seeds = [torch.tensor([s]) for s in (11, 22, 33, 44)]
    (kept, rebuilt), (out_kept, out_rebuilt) = kept_and_rebuilt_grads(
        kind, x0, kvbs[:3], kvbs[3], extra, seeds
    )
    for a, b in zip(out_kept, out_rebuilt):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(kept, rebuilt)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"input {i}")


@pytest.mark.parametrize("dv", [1, 4])
def test_triton_stochastic_rounding_does_not_stall(triton_small, dv):
    """80 updates of a tenth of a bf16 step each (write-only, so the increment does not depend on x): the
    stochastically rounded state follows the fp32 sum (its mean over 640 elements within 5 s.d., a stall
    is 45 s.d. off), where rounding to nearest never leaves the start (the reference, as the GPU rounds)."""
    N, d = 16, 40 // dv
    x0 = torch.ones(N, d, dv, dtype=torch.bfloat16)
    k = torch.ones(N, d)  # khat = 1 / sqrt(d) everywhere
    step = 2.0**-7 / 10  # a bf16 step at 1.0 is 2^-7
    v = torch.full((N, dv), step * math.sqrt(d))
    beta = torch.ones(N)
    x_sr, x_rn = x0, x0
    for i in range(80):
        x_sr = ddl_update(x_sr, k, v, beta, eps=0.0, erase=False, backend="triton", seed=torch.tensor([i]))
        x_rn = ddl_update_ref(x_rn, k, v, beta, eps=0.0, erase=False)
    assert torch.equal(x_rn, x0)
    want = 1.0 + 80 * step  # the fp32 sum, 1.0625
    sd = math.sqrt(80 * 0.25) * 2.0**-7 / math.sqrt(x_sr.numel())  # each rounding's variance <= step^2 / 4
    assert abs(x_sr.float().mean().item() - want) < 5 * sd


@pytest.mark.parametrize("kind", ["cc", "tc", "norm"])
def test_triton_stochastic_read_out_weight_grads_see_the_stored_state(triton_small, kind):
    """The fused read-out's weight gradients are sums of the upstream gradients times x' as stored: the
    backward kernels recompute x' with the forward's bits (rounding to nearest instead is off by ~0.3%)."""
    gen = torch.Generator().manual_seed(2)
    dv = 1 if kind == "norm" else 4
    x, k, v, beta = rand_update_args(lead=(2, 5), d=20, dv=dv, dtype=torch.float32)
    x = x.bfloat16()
    if kind == "norm":
        weights = [torch.rand(20, generator=gen) + 0.5, torch.randn(2, 20, generator=gen)]
    else:
        weights = [w.float() for w in read_out_weights(kind, dv)]
    weights = [w.requires_grad_() for w in weights]
    seed = torch.tensor([99])
    if kind == "norm":
        x_new, *reads, _ = ddl.ddl_update_norm(x, k, v, beta, *weights, backend="triton", seed=seed)
    else:
        x_new, *reads = second_update(kind, x, k, v, beta, weights, True, seed=seed)
    ups = [torch.randn_like(r) for r in reads]
    got = torch.autograd.grad(reads, weights, ups)
    ws64 = [w.detach().double().requires_grad_() for w in weights]
    xs = x_new.detach().double()  # the stored state
    if kind == "norm":
        zero = (torch.zeros_like(t, dtype=F64) for t in (k, v, beta))
        reads64 = ddl.ddl_update_norm_ref(xs, *zero, *ws64)[1:3]  # c, z of a zero update: xs's read
    elif kind == "cc":
        reads64 = (compress_cc_ref(xs, ws64[0]),)
    else:
        reads64 = (compress_tc_ref(xs, *ws64),)
    want = torch.autograd.grad(reads64, ws64, [u.double() for u in ups])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# A model's updates with ddl_state_rounding="stochastic": each draws its own rounding noise.


def model_roundings(monkeypatch, passes, **cfg):
    """Runs the tiny model `passes` times on the same tokens (with gradients, so kept states and rebuilds
    are in play) and returns, per DDL update in call order, (f, up): the fraction f of a bf16 step that the
    update's fp32 result lies past the bf16 value toward zero (0 where it is one), and whether the stored
    bf16 state went up (away from zero). The updates are seen where the model hands them to ops/ddl."""
    import ops.ddl.stream as stream
    from model import GPT, GPTConfig

    calls = []

    def spy(op):
        def run(X, h, v, beta, *args, **kw):
            out = op(X, h, v, beta, *args, **kw)
            x_new = out[0] if isinstance(out, tuple) else out
            calls.append((X, h, v, beta, kw["eps"], kw["erase"], x_new))
            return out

        return run

    for name in ("ddl_update", "ddl_update_compress_cc", "ddl_update_compress_tc"):
        monkeypatch.setattr(stream, name, spy(getattr(stream, name)))
    torch.manual_seed(0)
    shape = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=32, vocab_size=64, backend="torch")
    model = GPT(GPTConfig(**shape, ddl_state_dtype="bfloat16", ddl_state_rounding="stochastic", **cfg))
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(passes):
        model(idx, idx)[1].backward()
    out = []
    for X, h, v, beta, eps, erase, x_new in calls:
        with torch.no_grad():  # the fp32 result before rounding: the same arithmetic on X in fp32
            x32 = ddl_update_ref(X.float(), h, v, beta, eps=eps, erase=erase)
        lo, hi, f = bf16_neighbours(x32)
        stored = x_new.detach().float()
        assert x_new.dtype == torch.bfloat16 and ((stored == lo) | (stored == hi)).all()
        out.append((f.double(), (stored == hi).double()))
    return out


@pytest.mark.parametrize(
    "cfg", [dict(residual="ddl"), dict(residual="ddl-cc"), dict(residual="ddl-tc", ddl_keep_state_every=1)]
)
def test_a_models_updates_round_with_independent_noise(monkeypatch, cfg):
    """Two updates' rounding decisions are independent (each layer's, each sublayer's, each forward
    pass's, the same first update of two passes on the same state included), and unbiased. With shared
    noise, up = [u >= 1 - f] with the same u for both, so (up_a - f_a)(up_b - f_b) has the mean
    min(f_a, f_b) - f_a f_b (~1/12) instead of 0."""
    rounded = model_roundings(monkeypatch, passes=2, **cfg)
    assert len(rounded) == 2 * 2 * 2  # 2 passes x 2 layers x 2 sublayers
    for (a, (fa, ua)), (b, (fb, ub)) in itertools.combinations(enumerate(rounded), 2):
        m = (fa > 0) & (fb > 0)
        fa, fb, ra, rb = fa[m], fb[m], ua[m] - fa[m], ub[m] - fb[m]
        sd = (fa * (1 - fa) * fb * (1 - fb)).sum().sqrt() / m.sum()  # of the mean of ra * rb, independent
        shared = (torch.minimum(fa, fb) - fa * fb).mean()  # its mean, were the noise shared
        assert shared > 10 * sd, (a, b)  # the test can tell
        assert abs((ra * rb).mean()) < 5 * sd, (a, b, (ra * rb).mean().item(), shared.item())
    f = torch.cat([f.flatten() for f, _ in rounded])
    up = torch.cat([u.flatten() for _, u in rounded])
    assert abs((up - f).mean()) < 5 * (f * (1 - f)).sum().sqrt() / f.numel()  # E[stored] = the fp32 value
    assert (f > 0).float().mean() > 0.9  # nearly every element's update is not a bf16 value already


# ---------------------------------------------------------------------------------------------------
# Packed documents (doc_start [B, T]): TC's and EC's convs over tokens within each token's document, on
# both backends, against loops from the equation, each document run alone, and no mask.

# Two rows of 10 tokens (20 flat: the small launch shapes' runs of 3 tokens start at 0, 3, ..., 18, of 2 at
# the even tokens). Row 0: documents from 0 (a row's start), at a run edge (3), two in a row there (3, 4: a
# 1-token document), from 8 and 9 (two 1-token documents at the row's end, 9 a run edge); row 1: from 0, at
# a run edge (t = 5, token 15) and just after it (6). With K = 4 taps, documents shorter and longer than K.
DOCS = ([0, 3, 4, 8, 9], [0, 5, 6])
DOC_T = 10


def doc_start_rows(rows=DOCS, T=DOC_T, dtype=torch.int64):
    """doc_start [B, T] of rows whose documents start at the given positions (each row's list from 0)."""
    ds = torch.zeros(len(rows), T, dtype=dtype)
    for b, starts in enumerate(rows):
        for s in starts:
            ds[b, s:] = s
    return ds


def doc_op(kind, backend, doc_start):
    """The masked op as f(*inputs): "tc" (x, conv, read), "ec" (emb, conv), "update_tc" (x, k, v, beta,
    conv, read: the update with the TC read-out)."""
    if kind == "tc":
        return lambda x, cw, rd: compress_tc(x, cw, rd, backend=backend, doc_start=doc_start)
    if kind == "ec":
        return lambda e, cw: expand_ec(e, cw, backend=backend, doc_start=doc_start)
    return lambda *a: ddl.ddl_update_compress_tc(*a, backend=backend, doc_start=doc_start)


def doc_inputs(kind, T=DOC_T, d=8, dv=3, K=4):
    """(inputs requiring grad, how many lead with [B, T]) of doc_op(kind): two rows of T tokens."""
    cw = torch.randn(d, dv, K, dtype=F64)
    if kind == "ec":
        tokens, weights = [torch.randn(2, T, d, dtype=F64)], [cw]
    elif kind == "tc":
        tokens, weights = [torch.randn(2, T, d, dv, dtype=F64)], [cw, torch.randn(dv, dtype=F64)]
    else:
        tokens, weights = list(rand_update_args(lead=(2, T), d=d, dv=dv)), [cw, torch.randn(dv, dtype=F64)]
    return tuple(t.requires_grad_() for t in tokens + weights), len(tokens)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.fixture(params=["tc", "ec", "update_tc", "update_tc_fused"])
def doc_kind(request, triton_small, monkeypatch):
    """The masked ops at the small launch shapes; update_tc_fused: the update + TC read-out forward as one
    kernel (LAUNCH['update_tc_fwd'] FUSED, runs of 3 tokens), the two-kernel forward made to fail."""
    if request.param == "update_tc_fused":
        monkeypatch.setitem(ddl_triton.LAUNCH["update_tc_fwd"], "FUSED", True)
        monkeypatch.setattr(ddl_triton, "_tc_forward", None)
        return "update_tc"
    return request.param


@pytest.mark.parametrize("K", [1, 4, 6])
def test_doc_start_references_match_loops(K):
    """The references' masked convs against loops over t and taps (K = 6: wider than most documents)."""
    ds = doc_start_rows()
    x, emb = torch.randn(2, DOC_T, 4, 3, dtype=F64), torch.randn(2, DOC_T, 4, dtype=F64)
    w, read = torch.randn(4, 3, K, dtype=F64), torch.randn(3, dtype=F64)
    torch.testing.assert_close(
        compress_tc_ref(x, w, read, ds), naive_tc(x, w, read, ds), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(expand_ec_ref(emb, w, ds), naive_ec(emb, w, ds), rtol=1e-12, atol=1e-12)
    xk, k, v, beta = rand_update_args(lead=(2, DOC_T), d=4, dv=3)
    x_new, h = ddl.ddl_update_compress_tc_ref(xk, k, v, beta, w, read, doc_start=ds)
    torch.testing.assert_close(h, naive_tc(x_new, w, read, ds), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(h, naive_tc(x_new, w, read)) or K == 1  # the mask matters


def test_triton_doc_start_matches_loops_and_reference(doc_kind):
    """The Triton kernels with doc_start: forward against the loops, values and gradients (conv, read, and
    the update's inputs) against the reference, float64, outputs NaN-filled; doc_start int32 for EC."""
    ds = doc_start_rows(dtype=torch.int32 if doc_kind == "ec" else torch.int64)
    inputs, _ = doc_inputs(doc_kind)
    out = as_tuple(doc_op(doc_kind, "triton", ds)(*inputs))
    with torch.no_grad():
        if doc_kind == "ec":
            want = naive_ec(*inputs, ds)
        elif doc_kind == "tc":
            want = naive_tc(*inputs, ds)
        else:
            want = naive_tc(ddl_update_ref(*inputs[:4]), *inputs[4:], ds)
    torch.testing.assert_close(out[-1], want, rtol=1e-12, atol=1e-12)
    compare(doc_op(doc_kind, "triton", ds), doc_op(doc_kind, "torch", ds), inputs, rtol=1e-12, atol=1e-12)


def check_packed_equals_alone(fn_of, inputs, n_tok, rows=DOCS, T=DOC_T):
    """fn_of(doc_start) on rows of packed documents against fn_of(None) on each document alone: its outputs
    and the gradients of its token inputs (the first n_tok: [B, T, ...]) for the same upstream gradients, and
    the weights' gradients summed over the documents."""
    out = as_tuple(fn_of(doc_start_rows(rows, T))(*inputs))
    ups = [torch.randn_like(o) for o in out]
    grads = torch.autograd.grad(out, inputs, ups)
    summed = [torch.zeros_like(w) for w in inputs[n_tok:]]
    for b, starts in enumerate(rows):
        for s, e in zip(starts, starts[1:] + [T]):
            alone = [t.detach()[b : b + 1, s:e].requires_grad_() for t in inputs[:n_tok]]
            alone += inputs[
                n_tok:
            ]  # the weights themselves (fn_of may hold them, as a module its parameters)
            out_a = as_tuple(fn_of(None)(*alone))
            for a, p in zip(out_a, out):
                torch.testing.assert_close(p[b : b + 1, s:e], a, rtol=1e-12, atol=1e-12, msg=f"{b} {s}")
            g = torch.autograd.grad(out_a, alone, [u[b : b + 1, s:e] for u in ups])
            for a, p in zip(g[:n_tok], grads[:n_tok]):
                torch.testing.assert_close(p[b : b + 1, s:e], a, rtol=1e-12, atol=1e-12, msg=f"{b} {s}")
            for acc, a in zip(summed, g[n_tok:]):
                acc += a
    for acc, p in zip(summed, grads[n_tok:]):
        torch.testing.assert_close(p, acc, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_doc_start_packed_equals_each_document_alone(doc_kind, backend):
    inputs, n_tok = doc_inputs(doc_kind)
    check_packed_equals_alone(lambda ds: doc_op(doc_kind, backend, ds), inputs, n_tok)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_doc_start_one_document_is_no_mask(doc_kind, backend):
    """A row of one document (doc_start all 0) gives what doc_start=None gives, bit for bit."""
    inputs, _ = doc_inputs(doc_kind)
    outs = [as_tuple(doc_op(doc_kind, backend, ds)(*inputs)) for ds in (None, torch.zeros(2, DOC_T).long())]
    ups = [torch.randn_like(o) for o in outs[0]]
    grads = [torch.autograd.grad(out, inputs, ups) for out in outs]
    for a, b in zip(outs[0] + grads[0], outs[1] + grads[1]):
        assert torch.equal(a, b)


def test_triton_update_tc_rebuilt_with_doc_start(triton_small, monkeypatch):
    """The update + TC read-out rebuilding its state from x0 through 2 updates in the backward, with
    doc_start: values and every gradient against the reference chain (the one-kernel forward; the stream's
    test below runs the two-kernel one)."""
    monkeypatch.setitem(ddl_triton.LAUNCH["update_tc_fwd"], "FUSED", True)
    ds = doc_start_rows()
    inputs = chain_inputs("tc", 3, 2, K=4, lead=(2, DOC_T))
    triton_fn = chained_update("tc", 2, True, "triton", True, doc_start=ds)
    compare(triton_fn, chained_update("tc", 2, True, doc_start=ds), inputs, rtol=1e-12, atol=1e-12)


def stream_parts(d=8, dv=3, K=4, blocks=2, backend="torch"):
    """A DDLStream's readers, blocks + 1 TC Compressors (random conv and read), and each block's mixing
    weights (a [d] a sublayer scales its read by to make h)."""
    from types import SimpleNamespace

    from ops.ddl.stream import Compressor

    cfg = SimpleNamespace(spec=SimpleNamespace(compressor="tc"), backend=backend, n_embd=d, ddl_dv=dv,
                          ddl_conv_size=K)  # fmt: skip
    comps = [Compressor(cfg).double() for _ in range(blocks + 1)]
    for c in comps:
        with torch.no_grad():
            c.conv.normal_()
            c.read.normal_()
    return comps, [torch.randn(d, dtype=F64, requires_grad=True) for _ in range(blocks)]


def run_stream(X0, comps, mix, doc_start, keep_every=0, cache=None):
    """X0 through a DDLStream of len(mix) blocks of two sublayers (each writes h = read * a, v = its read's
    first d_v entries, beta = sigmoid(mean of its read)), then the last compressor's read."""
    from ops.ddl.stream import DDLStream

    s = DDLStream(X0, 1e-5, True, comps[0].backend, keep_every, cache, doc_start=doc_start)
    for comp, a in zip(comps, mix):
        s.enter(comp)
        for _ in range(2):
            x_in = s.read()
            s.write(x_in * a, x_in[..., : X0.shape[-1]], torch.sigmoid(x_in.mean(-1)))
    return s.enter(comps[-1]).read()


def stream_inputs(comps, mix, T=DOC_T):
    X0 = torch.randn(2, T, 8, 3, dtype=F64, requires_grad=True)
    return (X0, *mix, *(p for c in comps for p in (c.conv, c.read)))


def test_stream_doc_start_packed_equals_each_document_alone():
    """Every TC read of a DDLStream (the first, of X0, and those fused with the updates) stays in its
    document: a row of packed documents gives each document's outputs and gradients (X0, the mixing
    weights, the compressors' conv and read) as run alone. (The reference ops: the stream passes doc_start
    the same way to either backend, whose ops the tests above check.)"""
    comps, mix = stream_parts()
    inputs = stream_inputs(comps, mix)
    check_packed_equals_alone(lambda ds: lambda X0, *_: run_stream(X0, comps, mix, ds), inputs, 1)


def test_stream_doc_start_rebuild_keeps_the_gradients(triton_small):
    """keep_every = 1 (the block's second update rebuilds its input state in the backward, the mask in the
    rebuilding op) against the reference, with doc_start: outputs and every gradient."""
    comps, mix = stream_parts(blocks=1)
    inputs = stream_inputs(comps, mix)
    ds = doc_start_rows()
    ups = None
    results = []
    for backend, every in (("torch", 0), ("triton", 1)):
        for c in comps:
            c.backend = backend
        out = run_stream(inputs[0], comps, mix, ds, keep_every=every)
        ups = torch.randn_like(out) if ups is None else ups
        results.append((out, torch.autograd.grad(out, inputs, ups)))
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-12, atol=1e-12)
        for i, (a, b) in enumerate(zip(grads, results[0][1])):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"input {i}")


def test_stream_doc_start_decoding_in_chunks():
    """With a cache, doc_start is in the whole sequence's frame (history_doc_start moves it to the window):
    a prompt of 6 tokens then 4 more give the full sequence's reads. Each row's token 6 continues a
    document that began K-1 = 3 or more tokens before it (the cached steps are in it); both chunks hold a
    boundary of their own."""
    from cache import Cache
    from ops.ddl.stream import history_doc_start

    rows = ([0, 2, 8], [0, 1, 7])
    comps, mix = stream_parts()
    X0 = torch.randn(2, DOC_T, 8, 3, dtype=F64)
    with torch.no_grad():
        full = run_stream(X0, comps, mix, doc_start_rows(rows))
        cache = Cache()
        first = run_stream(X0[:, :6], comps, mix, doc_start_rows(rows)[:, :6], cache=cache)
        cache.pos += 6  # as GPT.hidden_states advances it
        ds_new = doc_start_rows(rows)[:, 6:]  # tokens 6..9
        second = run_stream(X0[:, 6:], comps, mix, ds_new, cache=cache)
    torch.testing.assert_close(first, full[:, :6], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second, full[:, 6:], rtol=1e-12, atol=1e-12)
    assert history_doc_start(ds_new, 6, 3).tolist() == [[0, 0, 0, 0, 0, 5, 5], [0, 0, 0, 0, 4, 4, 4]]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_doc_start_bad_inputs_name_it(backend):
    x, k, v, beta = rand_update_args(lead=(2, 5), d=4, dv=3)
    cw, read, emb = (
        torch.randn(4, 3, 2, dtype=F64),
        torch.randn(3, dtype=F64),
        torch.randn(2, 5, 4, dtype=F64),
    )
    calls = {
        "compress_tc": lambda ds: compress_tc(x, cw, read, backend=backend, doc_start=ds),
        "expand_ec": lambda ds: expand_ec(emb, cw, backend=backend, doc_start=ds),
        "ddl_update_compress_tc": lambda ds: ddl.ddl_update_compress_tc(
            x, k, v, beta, cw, read, backend=backend, doc_start=ds
        ),
    }
    from ops.ddl.stream import DDLStream

    calls["DDLStream"] = lambda ds: DDLStream(x, backend=backend, doc_start=ds)
    bad = {  # what the message must say it got
        r"got torch.int64 \(2, 4\)": torch.zeros(2, 4, dtype=torch.long),
        r"got torch.float32 \(2, 5\)": torch.zeros(2, 5),
        "got list": [[0] * 5] * 2,
        "got it on meta": torch.zeros(2, 5, dtype=torch.long, device="meta"),
    }
    for fn, call in calls.items():
        for got, ds in bad.items():
            with pytest.raises(ValueError, match=rf"^{fn}: doc_start must be .*\(2, 5\).*{got}") as err:
                call(ds)
            assert "\n" not in str(err.value)
