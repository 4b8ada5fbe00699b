"""Tests for kernels/ddl.py: the references against the equations (float64, naive loops) and every
Triton kernel against the references, values and gradients (on CPU through TRITON_INTERPRET=1)."""

import pytest
import torch

from kernels import ddl
from kernels.ddl import (
    compress_cc,
    compress_cc_ref,
    compress_tc,
    compress_tc_ref,
    ddl_update,
    ddl_update_ref,
    ec_identity_weight,
    expand_ec,
    expand_ec_ref,
)

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


def naive_tc(x, w, read):
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
                        if s >= 0:
                            acc += float(read[c]) * float(w[i, c, j]) * float(x[b, s, i, c])
                out[b, t, i] = acc
    return out


def naive_ec(emb, w):
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
                        if t - (K - 1) + j >= 0
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
    w = ec_identity_weight(8, 4, 3, dtype=F64)
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
        ddl.set_auto_backend("cuda")
