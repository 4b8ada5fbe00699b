"""ops/deltaformer/: the chunked PyTorch path, the Triton path and the decoding step against the float64
per-token reference (naive.py): values and gradients of every input."""

import pytest
import torch
import torch.nn.functional as F

from ops.deltaformer import (
    KERNELS,
    NORM_EPS,
    deltaformer_attention,
    deltaformer_reference,
    deltaformer_step,
    deltaformer_u_torch,
)

DEFS = "the definition (ops/deltaformer/naive.py): relu / linear score unit w, k with scale 1"


def rel_err(a, b):
    """||a - b|| / ||b||; where b is exactly zero (dq, dw at T = 1) the error is measured against 1."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1.0 if b.norm() == 0 else 0.0)).item()


def make_inputs(B, H, T, D, dtype=torch.float64, device="cpu", beta_max=1.0, seed=None):
    g = torch.Generator(device="cpu")
    g.manual_seed(torch.seed() if seed is None else seed)
    q, k, v, w = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    beta = beta_max * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, w, beta)]


def grads_of(fn, inputs, grad_out):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    # An input that does not reach the output (w at T = 1) has gradient zero.
    return out.detach(), [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("T,chunk", [(1, 4), (5, 4), (13, 4), (16, 8), (9, 64)])
def test_torch_path_matches_reference(kernel, T, chunk):
    B, H, D = 2, 3, 8
    inputs = make_inputs(B, H, T, D)
    grad_out = torch.randn(B, H, T, D, dtype=torch.float64)

    def chunked(q, k, v, w, beta):
        u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, chunk=chunk)
        return torch.nn.functional.scaled_dot_product_attention(q, k, u, is_causal=True)

    out_ref, g_ref = grads_of(lambda *x: deltaformer_reference(*x, kernel=kernel), inputs, grad_out)
    out, g = grads_of(chunked, inputs, grad_out)
    assert rel_err(out, out_ref) < 1e-12
    for name, a, b in zip("q k v w beta".split(), g, g_ref):
        assert rel_err(a, b) < 1e-11, name


@pytest.mark.parametrize("kernel", KERNELS)
def test_public_torch_backend_and_scale(kernel):
    inputs = make_inputs(1, 2, 11, 16)
    ref = deltaformer_reference(*inputs, kernel=kernel, scale=0.3)
    out = deltaformer_attention(*inputs, kernel=kernel, scale=0.3, backend="torch")
    assert rel_err(out, ref) < 1e-12
    # w really enters: changing it changes the output (T > 1, beta > 0)
    q, k, v, w, beta = inputs
    other = deltaformer_attention(q, k, v, w + 1.0, beta, kernel=kernel, scale=0.3, backend="torch")
    assert rel_err(other, ref) > 1e-3


def test_reference_by_hand():
    # T = 2, D = 1, softmax: u_0 = v_0; u_1 = v_1 - beta_1 * u_0 (the only earlier token gets weight 1).
    q = torch.tensor([0.5, -1.0], dtype=torch.float64).view(1, 1, 2, 1)
    k = torch.tensor([2.0, 1.0], dtype=torch.float64).view(1, 1, 2, 1)
    v = torch.tensor([3.0, 5.0], dtype=torch.float64).view(1, 1, 2, 1)
    w = torch.tensor([1.0, 7.0], dtype=torch.float64).view(1, 1, 2, 1)
    beta = torch.tensor([0.9, 0.25], dtype=torch.float64).view(1, 1, 2)
    u0, u1 = 3.0, 5.0 - 0.25 * 3.0
    p = torch.softmax(torch.tensor([-1.0 * 2.0, -1.0 * 1.0], dtype=torch.float64), 0)
    expected = torch.tensor([u0, p[0] * u0 + p[1] * u1], dtype=torch.float64)
    out = deltaformer_reference(q, k, v, w, beta, scale=1.0)
    torch.testing.assert_close(out.view(2), expected)
    # relu / linear: unit w and k (D = 1: their signs), scale 1: kappa = relu(1 * 1) = 1, whatever the
    # scale argument (it is stage 2's: p stays as above)
    for kernel in ("relu", "linear"):
        out = deltaformer_reference(q, k, v, w, beta, kernel=kernel, scale=1.0)
        torch.testing.assert_close(out.view(2)[1], p[0] * u0 + p[1] * (5.0 - 0.25 * 1.0 * 3.0))
    # w_1 = -7: linear kappa = -1, relu 0
    out = deltaformer_reference(q, k, v, -w, beta, kernel="linear", scale=1.0)
    torch.testing.assert_close(out.view(2)[1], p[0] * u0 + p[1] * (5.0 + 0.25 * 3.0))
    out = deltaformer_reference(q, k, v, -w, beta, kernel="relu", scale=1.0)
    torch.testing.assert_close(out.view(2)[1], p[0] * u0 + p[1] * 5.0)
    # D = 2: w_1 = (3, 4) -> (0.6, 0.8); k_0 = (2, 0) -> (1, 0): kappa = 0.6 for relu and linear
    k2 = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64).view(1, 1, 2, 2)
    w2 = torch.tensor([[1.0, 1.0], [3.0, 4.0]], dtype=torch.float64).view(1, 1, 2, 2)
    v2 = torch.tensor([[3.0, -1.0], [5.0, 2.0]], dtype=torch.float64).view(1, 1, 2, 2)
    for kernel in ("relu", "linear"):
        u = deltaformer_u_torch(k2, v2, w2, beta, kernel=kernel)
        torch.testing.assert_close(u[0, 0, 1], v2[0, 0, 1] - 0.25 * 0.6 * v2[0, 0, 0])


def naive_deltaformer(q, k, v, w, beta, kernel, scale, doc_start=None):
    """(o, u) from the equations, written out with scalar loops (not the module's code): stage 1 with
    kappa on unit w, k and scale 1 for relu / linear (s w.k softmax-normalised over j < i for softmax),
    stage 2 causal softmax attention of q over (k, u) with scale s. doc_start [B, T]: token i's sums run
    over j >= doc_start[b, i] only (stage 1: lo <= j < i, none for i = lo; stage 2: lo <= j <= i)."""
    B, H, T, D = q.shape

    def dot(a, b):
        return sum(a[d] * b[d] for d in range(D))

    def unit(a):
        return a / dot(a, a).sqrt()

    outs, us = [], []
    for b in range(B):
        for h in range(H):
            u = []
            for i in range(T):
                lo = 0 if doc_start is None else int(doc_start[b, i])
                if kernel == "softmax":
                    e = {j: (scale * dot(w[b, h, i], k[b, h, j])).exp() for j in range(lo, i)}
                    kappa = {j: x / sum(e.values()) for j, x in e.items()}
                else:
                    c = {j: dot(unit(w[b, h, i]), unit(k[b, h, j])) for j in range(lo, i)}
                    kappa = {j: x.clamp_min(0.0) if kernel == "relu" else x for j, x in c.items()}
                u.append(
                    v[b, h, i]
                    - beta[b, h, i] * sum((kappa[j] * u[j] for j in range(lo, i)), 0.0 * v[b, h, i])
                )
            for i in range(T):
                lo = 0 if doc_start is None else int(doc_start[b, i])
                e = {j: (scale * dot(q[b, h, i], k[b, h, j])).exp() for j in range(lo, i + 1)}
                outs.append(sum(e[j] / sum(e.values()) * u[j] for j in range(lo, i + 1)))
            us += u
    return torch.stack(outs).view(B, H, T, D), torch.stack(us).view(B, H, T, D)


@pytest.mark.parametrize("kernel", KERNELS)
def test_reference_matches_naive_equations(kernel):
    # the reference is the spec: values and gradients against scalar loops written from the equations,
    # with k and w of very different norms (relu / linear must not see them) and beta up to 2
    B, H, T, D = 2, 1, 6, 4
    q, k, v, w, beta = make_inputs(B, H, T, D, beta_max=2.0, seed=1)
    k = k * torch.linspace(0.2, 5.0, T, dtype=torch.float64)[:, None]
    w = w * torch.linspace(7.0, 0.3, T, dtype=torch.float64)[:, None]
    inputs, scale = [q, k, v, w, beta], 0.7
    grad_out = torch.randn(B, H, T, D, dtype=torch.float64)
    out, g = grads_of(lambda *x: deltaformer_reference(*x, kernel=kernel, scale=scale), inputs, grad_out)
    out_n, g_n = grads_of(lambda *x: naive_deltaformer(*x, kernel, scale)[0], inputs, grad_out)
    assert rel_err(out, out_n) < 1e-12, DEFS
    for name, a, b in zip("q k v w beta".split(), g, g_n):
        assert rel_err(a, b) < 1e-11, name
    u_n = naive_deltaformer(*inputs, kernel, scale)[1]
    assert rel_err(deltaformer_u_torch(k, v, w, beta, kernel=kernel, scale=scale), u_n) < 1e-12
    assert rel_err(u_n, v) > 0.1  # stage 1 does something


@pytest.mark.parametrize("kernel", ["relu", "linear"])
def test_relu_linear_stage1_normalised(kernel):
    # stage 1 sees only the directions of w and k: positive rescaling of either (per token) and the scale
    # argument leave u unchanged; a zero key or w contributes nothing and stays finite (eps guard)
    q, k, v, w, beta = make_inputs(2, 2, 19, 8, beta_max=2.0)
    u = deltaformer_u_torch(k, v, w, beta, kernel=kernel)
    c1, c2 = (torch.rand(2, 2, 19, 1, dtype=torch.float64) * 10 + 0.01 for _ in range(2))
    assert rel_err(deltaformer_u_torch(c1 * k, v, c2 * w, beta, kernel=kernel, scale=5.0), u) < 1e-13
    ref = deltaformer_reference(q, k, v, w, beta, kernel=kernel)
    assert rel_err(deltaformer_reference(q, k, v, c2 * w, beta, kernel=kernel), ref) < 1e-13
    # linear kappa is odd in w: flipping w flips kappa, which changes u
    if kernel == "linear":
        assert rel_err(deltaformer_u_torch(k, v, -w, beta, kernel=kernel), u) > 0.05
    k0, w0 = k.clone(), w.clone()
    k0[:, :, 3] = 0.0
    w0[:, :, 7] = 0.0
    out, g = grads_of(
        lambda *x: deltaformer_attention(*x, kernel=kernel, backend="torch"), [q, k0, v, w0, beta], q
    )
    assert all(torch.isfinite(x).all() for x in [out, *g])
    u0 = deltaformer_u_torch(k0, v, w0, beta, kernel=kernel)
    assert torch.equal(u0[:, :, 7], v[:, :, 7])  # w_7 = 0: kappa(w_7, .) = 0
    assert rel_err(u0[:, :, :4], u[:, :, :4]) < 1e-13  # k_3 is only read by later rows...
    assert rel_err(u0[:, :, 4:7], u[:, :, 4:7]) > 1e-3  # ...which lose its term


@pytest.mark.parametrize("kernel", KERNELS)
def test_step_chained_equals_full_forward(kernel):
    B, H, T, D = 2, 2, 9, 8
    q, k, v, w, beta = make_inputs(B, H, T, D)
    full = deltaformer_attention(q, k, v, w, beta, kernel=kernel, backend="torch")
    k_cache = torch.zeros(B, H, 0, D, dtype=torch.float64)
    u_cache = torch.zeros(B, H, 0, D, dtype=torch.float64)
    outs = []
    for t in range(T):
        sl = slice(t, t + 1)
        o_t, u_t = deltaformer_step(
            q[:, :, sl],
            k[:, :, sl],
            v[:, :, sl],
            w[:, :, sl],
            beta[:, :, sl],
            k_cache,
            u_cache,
            kernel=kernel,
        )
        assert o_t.shape == (B, H, 1, D) and u_t.shape == (B, H, 1, D)
        outs.append(o_t)
        k_cache = torch.cat([k_cache, k[:, :, sl]], dim=2)
        u_cache = torch.cat([u_cache, u_t], dim=2)
    assert rel_err(torch.cat(outs, dim=2), full) < 1e-12
    assert rel_err(u_cache, deltaformer_u_torch(k, v, w, beta, kernel=kernel)) < 1e-12


@pytest.mark.parametrize("kernel", KERNELS)
def test_step_in_static_buffers_equals_chained(kernel):
    """pos (a static cache): buffers of S slots, the first pos holding the earlier tokens and the rest
    garbage (a longer earlier sequence's); the step writes k_t and u_t at slot pos and gives the o_t and u_t
    of the step over the exact caches, at every position, the garbage masked out."""
    B, H, T, D, S = 2, 2, 9, 8, 12
    q, k, v, w, beta = make_inputs(B, H, T, D)
    k_buf, u_buf = (10 * torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(2))
    k_buf[:, :, :1], u_buf[:, :, :1] = k[:, :, :1], v[:, :, :1]  # the first token: u_0 = v_0
    for t in range(1, T):
        sl = slice(t, t + 1)
        args = [x[:, :, sl] for x in (q, k, v, w, beta)]
        want = deltaformer_step(*args, k_buf[:, :, :t].clone(), u_buf[:, :, :t].clone(), kernel=kernel)
        got = deltaformer_step(*args, k_buf, u_buf, kernel=kernel, pos=torch.tensor([t]))
        for g, e in zip(got, want):
            assert rel_err(g, e) < 1e-13, t
        assert torch.equal(k_buf[:, :, t], k[:, :, t]) and torch.equal(u_buf[:, :, t : t + 1], want[1])
    assert rel_err(u_buf[:, :, :T], deltaformer_u_torch(k, v, w, beta, kernel=kernel)) < 1e-12


def test_bad_inputs_raise():
    q, k, v, w, beta = make_inputs(1, 2, 5, 8)
    with pytest.raises(ValueError, match="kernel"):
        deltaformer_attention(q, k, v, w, beta, kernel="tanh")
    with pytest.raises(ValueError, match="backend"):
        deltaformer_attention(q, k, v, w, beta, backend="cuda")
    with pytest.raises(ValueError, match="beta"):
        deltaformer_attention(q, k, v, w, beta[..., :4])
    with pytest.raises(ValueError, match="same shape"):
        deltaformer_attention(q, k, v[..., :4], w, beta)
    with pytest.raises(ValueError, match=r"\[B, H, T, D\]"):
        deltaformer_attention(q[0], k, v, w, beta)


def test_torch_path_bf16():
    # bf16 inputs: the torch path computes stage 1 in fp32 and returns bf16; error as bf16 operands give.
    inputs = make_inputs(2, 2, 37, 16)
    ref = deltaformer_reference(*inputs)
    out = deltaformer_attention(*[x.to(torch.bfloat16) for x in inputs], backend="torch")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


# ---------------------------------------------------------------------------------------------------
# Triton path. On CPU it runs through TRITON_INTERPRET=1 (set by conftest.py) at small shapes; the
# interpreter computes bf16 matrix products wrongly (and tf32 as fp32), so CPU covers fp32 and fp16, and
# bf16 only with the `gpu_like_bf16_interpreter` fixture (reflection regime below); the rest on the GPU.
# Inputs keep the recurrence moderate: with random (unrelated) w and k, relu and linear kappa of unit
# vectors grow u exponentially in T (~(1 + beta^2 / D)^(T / 2) for linear: 6x at T = 1024, D = 64,
# beta_max 1), so their beta shrinks with T (each case still changes u by 10-50%, see u_change).


def beta_max_for(kernel, T):
    return {"softmax": 1.0, "relu": min(1.0, 256.0 / T), "linear": min(1.0, 8.0 * T**-0.5)}[kernel]


def check_triton_against_reference(
    kernel, B, H, T, D, dtype, device, chunk, tol, reference="loop", lowp=None, inputs=None
):
    """Values and all gradients of the Triton path against float64; inputs (q, k, v, w, beta in float64)
    default to make_inputs' random ones."""
    from ops.deltaformer import deltaformer_u_triton

    if inputs is None:
        inputs = make_inputs(B, H, T, D, device=device, beta_max=beta_max_for(kernel, T))
    grad_out = torch.randn(B, H, T, D, dtype=torch.float64, device=device)

    def ours(q, k, v, w, beta):
        u = deltaformer_u_triton(k, v, w, beta, kernel=kernel, chunk=chunk, lowp=lowp)
        return torch.nn.functional.scaled_dot_product_attention(q, k, u, is_causal=True)

    if reference == "loop":
        ref_fn = lambda *x: deltaformer_reference(*x, kernel=kernel)
    elif reference == "chunked":  # the float64 chunked path, checked against the loop above (faster)
        ref_fn = lambda q, k, v, w, beta: torch.nn.functional.scaled_dot_product_attention(
            q, k, deltaformer_u_torch(k, v, w, beta, kernel=kernel), is_causal=True
        )
    else:  # "same_stage2": float64 stage 1, then the very stage 2 ours runs (SDPA on dtype q, k, u)
        ref_fn = lambda q, k, v, w, beta: torch.nn.functional.scaled_dot_product_attention(
            q.to(dtype),
            k.to(dtype),
            deltaformer_u_torch(k, v, w, beta, kernel=kernel).to(dtype),
            is_causal=True,
        ).double()
    # the reference sees the same (rounded) inputs as ours: we check the function, not the rounding
    low = [x.to(dtype) for x in inputs]
    out_ref, g_ref = grads_of(ref_fn, [x.double() for x in low], grad_out.to(dtype).double())
    if device == "cuda":  # poison the allocator's free blocks: an unwritten output shows up as NaN
        torch.full((64 << 20,), float("nan"), device=device)
    out, g = grads_of(ours, low, grad_out.to(dtype))
    assert out.dtype == dtype
    errs = {"o": rel_err(out, out_ref)}
    errs.update({name: rel_err(a, b) for name, a, b in zip("q k v w beta".split(), g, g_ref)})
    assert all(e < tol for e in errs.values()), errs
    return errs


@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_fp32_matches_reference(kernel):
    # T = 37 with chunk 16: three chunks, the last one partial
    check_triton_against_reference(kernel, 1, 2, 37, 16, torch.float32, "cpu", chunk=16, tol=1e-5)


def test_triton_t1_and_head_dim_64():
    check_triton_against_reference("softmax", 2, 1, 1, 16, torch.float32, "cpu", chunk=16, tol=1e-5)
    check_triton_against_reference("relu", 1, 1, 21, 64, torch.float32, "cpu", chunk=16, tol=1e-5)


@pytest.mark.parametrize("lowp", [False, True])
def test_triton_fp16(lowp):
    # both ways u and beta G are read: hi + lo halves by the split recurrence, and as half (lowp) or fp32
    # (lowp=False) operands of dK / dW
    check_triton_against_reference(
        "softmax", 1, 2, 29, 16, torch.float16, "cpu", chunk=16, tol=1e-2, lowp=lowp
    )


@pytest.mark.parametrize("kernel", ["relu", "linear"])
def test_triton_fp16_relu_linear(kernel):
    # the split recurrence over several chunks of 32 with a partial last one (relu / linear: with the norms
    # folded around the kernels, `deltaformer_u_triton`)
    errs = check_triton_against_reference(kernel, 1, 2, 45, 16, torch.float16, "cpu", chunk=32, tol=1e-2)
    print({n: f"{e:.1e}" for n, e in errs.items()})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_w_is_k_one_tensor(kernel, backend):
    # the model passes w = k as one tensor (relu / linear normalise it once): its gradient must be the sum
    # of the key's and the first-stage query's, as the reference with w and k as separate inputs gives
    q, k, v, _, beta = make_inputs(1, 2, 37, 16, beta_max=2.0)
    grad_out = torch.randn_like(q)
    out, (dq, dk, dv, dbeta) = grads_of(
        lambda q, k, v, beta: deltaformer_attention(q, k, v, k, beta, kernel=kernel, backend=backend),
        [q.float(), k.float(), v.float(), beta.float()],
        grad_out.float(),
    )
    out_ref, g_ref = grads_of(
        lambda *x: deltaformer_reference(*x, kernel=kernel), [q, k, v, k, beta], grad_out
    )
    tol = 1e-5
    assert rel_err(out, out_ref) < tol
    for name, a, b in [("q", dq, g_ref[0]), ("k", dk, g_ref[1] + g_ref[3]), ("v", dv, g_ref[2])]:
        assert rel_err(a, b) < tol, name
    assert rel_err(dbeta, g_ref[4]) < tol


@pytest.mark.parametrize("kernel", KERNELS)
def test_dk_in_wavefront_more_cases(kernel):
    # dK accumulated by the backward wavefront (D <= 64) beyond the tests above: every kernel in the
    # reflection regime (fp32, several chunks, a partial last one) and fp32 operands for dK (lowp=False)
    # with fp16 inputs (the low half of beta G read for dK)
    check_reflection(kernel, 1, 2, 90, 16, 32, torch.float32, "cpu", tol=1e-5, reference="loop")
    check_triton_against_reference(kernel, 1, 2, 45, 16, torch.float16, "cpu", chunk=16, tol=1e-2, lowp=False)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
def test_triton_head_dim_128_dk_pass(kernel):
    # D = 128: dK by its own pass after the backward wavefront (`_u_bwd`), fp32 and fp16 (both lowp)
    check_triton_against_reference(kernel, 1, 1, 45, 128, torch.float32, "cpu", chunk=16, tol=1e-5)
    for lowp in (True, False):
        check_triton_against_reference(
            kernel, 1, 1, 45, 128, torch.float16, "cpu", chunk=32, tol=1e-2, lowp=lowp
        )


@pytest.mark.parametrize("kernel", ["relu", "linear"])
@pytest.mark.parametrize("D", [16, 128])  # dK in the backward wavefront, and by its own pass
def test_triton_norms_in_kernels(kernel, D):
    # relu / linear: the kernels scale raw scores by the rows' inverse norms and add the norms' gradient
    # (`_scaled`, `_key_grad`): w rescaled over four decades and keys over one (stage 2 takes k as it is:
    # much longer keys make its softmax too sharp for fp32), a key and a w below NORM_EPS, where the clamp
    # passes no gradient through the norm; stage 2 as ours runs it (SDPA in fp32)
    q, k, v, w, beta = make_inputs(1, 2, 37, D, beta_max=beta_max_for(kernel, 37))
    k, w = (x * 10.0 ** (n * torch.rand(1, 2, 37, 1, dtype=x.dtype) - n / 2) for x, n in ((k, 1), (w, 4)))
    for x, i in ((k, 5), (w, 20)):
        x[:, :, i] *= 0.5 * NORM_EPS / x[:, :, i].norm(dim=-1, keepdim=True)
    inputs = [q, k, v, w, beta]
    check_triton_against_reference(
        kernel, 1, 2, 37, D, torch.float32, "cpu", chunk=16, tol=1e-5, reference="same_stage2", inputs=inputs
    )


def reflection_inputs(B, H, T, D, kernel, device="cpu"):
    """Model-like inputs where one token's update is (nearly) a reflection: RMS-normed keys of a few token
    types, w = k, beta ~ 2 (softmax rows sum to 1; relu / linear kappa(k, k) = 1 on unit keys). Swap
    tracking lives here. softmax: beta in (1.8, 2.2); relu / linear: (1.8, 2.0), the model's range, where
    linear is DeltaNet with contractive transitions (beyond 2 |u| grows: 4x -> 16x at T = 1024)."""
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    k = rms(torch.randn(10, D, dtype=torch.float64)[torch.randint(0, 10, (B, H, T))])
    q, v = rms(torch.randn_like(k)), torch.randn_like(k)
    spread = 0.2 if kernel == "softmax" else 0.1
    beta = 2.0 * (0.9 + spread * torch.rand(B, H, T, dtype=torch.float64))
    return [x.to(device) for x in (q, k, v, k.clone(), beta)]  # w = k, as its own input


def check_reflection(kernel, B, H, T, D, C, dtype, device, tol, reference):
    inputs = reflection_inputs(B, H, T, D, kernel, device)
    q, k, v, w, beta = [x.to(dtype).double() for x in inputs]
    # the inputs must exercise the recurrence (u far from v), not leave u ~ v
    assert rel_err(deltaformer_u_torch(k, v, w, beta, kernel=kernel), v) > 0.3
    return check_triton_against_reference(
        kernel, B, H, T, D, dtype, device, chunk=C, tol=tol, reference=reference, inputs=inputs
    )


@pytest.mark.parametrize("kernel,C", [(kernel, 32) for kernel in KERNELS] + [("linear", 64), ("relu", 16)])
def test_triton_reflection_regime(kernel, C):
    # A Neumann-series in-chunk inverse lost up to 7e-2 of u in fp32 here while the random inputs passed.
    # C = 16, 32, 64: 4, 5, 6 doublings of the block size in the in-chunk inverse.
    check_reflection(kernel, 1, 2, 96, 16, C, torch.float32, "cpu", tol=1e-5, reference="loop")


@pytest.mark.parametrize("C", [16, 32, 64, 128])
def test_in_chunk_inverse_against_torch(C):
    # the in-chunk inverse itself, through the forward at T = C (one chunk: u = X v exactly), in the
    # reflection regime (where the Neumann series by squaring lost accuracy): compared with the float64
    # chunked solve (C = 16: the doubling on one block; larger C: its first levels on the [16, 16] diagonal
    # blocks)
    import ops.deltaformer as df

    q, k, v, w, beta = reflection_inputs(1, 1, C, 16, "linear")
    u = df.deltaformer_u_triton(*(x.float() for x in (k, v, w, beta)), kernel="linear", chunk=C)
    u_ref = deltaformer_u_torch(k, v, w, beta, kernel="linear")
    assert rel_err(u_ref, v) > 0.3
    assert rel_err(u, u_ref) < 1e-5


def patch_interpreter_dots(setattr):
    """Make Triton's CPU interpreter (3.9) round and multiply as an H100/H200 does. Its create_dot
    multiplies bfloat16 operands as their raw uint16 bit patterns (garbage) and ignores input_precision
    (fp32 operands always exact); its fp32 -> bf16 cast truncates (the GPU rounds to nearest even).
    Patched: bf16 operands decoded to fp32; fp32 operands truncated to tf32 (10 explicit mantissa bits)
    for "tf32", split hi + lo (tf32 each, three products) for "tf32x3"; fp32 accumulation; fp32 -> bf16
    casts round to nearest even. Must run before any kernel is launched; setattr: pytest's
    monkeypatch.setattr (undone after the test)."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    cast_impl = InterpreterBuilder.cast_impl

    def decode(h):
        if h.dtype.scalar.name == "bf16":  # stored as uint16
            return (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return h.data.astype(np.float32)

    def trunc_tf32(x):
        return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        both32 = a.dtype.scalar.name == "fp32" and b.dtype.scalar.name == "fp32"
        x, y = decode(a), decode(b)
        mode = str(input_precision).rsplit(".", 1)[-1].upper()
        if both32 and mode == "TF32":
            out = np.matmul(trunc_tf32(x), trunc_tf32(y))
        elif both32 and mode == "TF32X3":
            x_hi, y_hi = trunc_tf32(x), trunc_tf32(y)
            x_lo, y_lo = trunc_tf32(x - x_hi), trunc_tf32(y - y_hi)
            out = np.matmul(x_hi, y_lo) + np.matmul(x_lo, y_hi) + np.matmul(x_hi, y_hi)
        else:
            out = np.matmul(x, y)
        return TensorHandle(out.astype(d.data.dtype) + d.data, d.dtype.scalar)

    def rne_cast(self, src, dst_type):
        if src.dtype.scalar.name == "fp32" and dst_type.scalar.name == "bf16":
            bits = src.data.astype(np.float32).view(np.uint32)
            bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return TensorHandle(bits.astype(np.uint16), dst_type.scalar)  # (no NaN/inf inputs here)
        return cast_impl(self, src, dst_type)

    setattr(InterpreterBuilder, "create_dot", create_dot)
    setattr(InterpreterBuilder, "cast_impl", rne_cast)
    setattr(InterpreterBuilder, "create_fp_trunc", rne_cast)


@pytest.fixture
def gpu_like_bf16_interpreter(monkeypatch):
    """The CPU interpreter with tl.dot and bf16 casts as on an H100/H200 (`patch_interpreter_dots`).
    Undone after the test."""
    if torch.cuda.is_available():
        pytest.skip("interpreter only")
    patch_interpreter_dots(monkeypatch.setattr)


def test_gpu_like_interpreter_dots(gpu_like_bf16_interpreter):
    # the patch itself: bf16 dots exact (fp32 accumulation), tf32 dots of fp32 operands ~1e-3 off, tf32x3
    # and ieee ~fp32; the cast to bf16 rounds to nearest (a truncating cast is ~2x further off on average)
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(A, B, O, R, P: tl.constexpr):
        r = tl.arange(0, 16)
        tile = r[:, None] * 16 + r[None, :]
        a, b = tl.load(A + tile), tl.load(B + tile)
        tl.store(O + tile, tl.dot(a, b, input_precision=P))
        tl.store(R + tile, a.to(tl.float32).to(tl.bfloat16))

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    out, rounded = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    for dtype, prec, lo, hi in [
        (torch.bfloat16, "tf32", 0.0, 1e-6),
        (torch.float32, "tf32", 1e-4, 3e-3),
        (torch.float32, "tf32x3", 0.0, 1e-6),
        (torch.float32, "ieee", 0.0, 1e-6),
    ]:
        x, y = a.to(dtype), b.to(dtype)
        dot_kernel[(1,)](x, y, out, rounded, P=prec)
        assert lo <= rel_err(out, x.double() @ y.double()) < hi, (dtype, prec)
    assert torch.equal(rounded, a.to(torch.bfloat16))


BF16_DKDW = "known defect: bf16 operands of dA, dK and dW (lowp=True) in the reflection regime"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lowp", [True, False])
def test_triton_bf16_u_stage_reflection(kernel, lowp, gpu_like_bf16_interpreter, request):
    # bf16 u-stage alone (its own outputs u, dk, dv, dw, dbeta; du given) in the reflection regime, on the
    # CPU with GPU-like dots (deterministic: the inputs come from the seeded generator). The known defect:
    # bf16 operands in dA = -(beta G) u^T and in dK = s dS^T W, dW = s dS K (lowp=True, the default) cost
    # relu/linear 2.2e-2..2.3e-2 in dk and dw here (T = 512), softmax 9.4e-3 (passes, close to the bound);
    # with tf32 operands (lowp=False) all are <= 4.3e-3.
    from ops.deltaformer import deltaformer_u_triton

    if lowp and kernel != "softmax":
        request.applymarker(pytest.mark.xfail(reason=BF16_DKDW, strict=True))
    q, k, v, w, beta = reflection_inputs(1, 1, 512, 64, kernel)
    k, v, w, beta = (x.to(torch.bfloat16).double() for x in (k, v, w, beta))
    du = torch.randn_like(v).to(torch.bfloat16)
    assert rel_err(deltaformer_u_torch(k, v, w, beta, kernel=kernel), v) > 0.3
    u_ref, g_ref = grads_of(lambda *x: deltaformer_u_torch(*x, kernel=kernel), [k, v, w, beta], du.double())
    fn = lambda *x: deltaformer_u_triton(*x, kernel=kernel, chunk=64, lowp=lowp)  # noqa: E731
    u, g = grads_of(fn, [x.to(torch.bfloat16) for x in (k, v, w, beta)], du)
    errs = {"u": rel_err(u, u_ref)}
    errs.update({name: rel_err(a, b) for name, a, b in zip("k v w beta".split(), g, g_ref)})
    print("bf16 u-stage reflection", kernel, lowp, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lowp", [True, False])
def test_triton_gpu_reflection_same_stage2(kernel, lowp, request):
    # bf16 in the reflection regime against a reference with a float64 stage 1 and the *same* bf16 stage 2
    # (SDPA on bf16 q, k, u): what our u-stage adds, without the rounding any bf16 SDPA stage 2 costs (bf16
    # u and du, FlashAttention's bf16 dS). lowp=True (default): relu/linear fail through the bf16 dK/dW
    # operands (dk and dw 2.2e-2..2.3e-2 at T = 512 in the CPU u-stage test above); softmax passed at
    # 8.7e-3 on an H200 in every run. lowp=False: relu 5.5e-3, linear 5.8e-3, softmax 2.2e-3 on the H200
    # before relu / linear were normalised; normalised, they round v / |k| to bf16 before the kernels
    # (`deltaformer_u_triton`'s fold), ~4e-4 of u, which the shared bf16 stage 2 amplifies: the CPU twin
    # (GPU-like dots, B = 1, H = 2, T = 1024, lowp=False) gives dq 9.0e-3 (relu), 8.6e-3 (linear), near
    # the bound; o 3.9e-3 / 3.1e-3; softmax dq 3.8e-4, o 1.0e-4.
    if lowp and kernel != "softmax":
        request.applymarker(pytest.mark.xfail(reason=BF16_DKDW, strict=True))
    inputs = reflection_inputs(2, 3, 1024, 64, kernel, "cuda")
    errs = check_triton_against_reference(
        kernel, 2, 3, 1024, 64, torch.bfloat16, "cuda", chunk=64, tol=1e-2, reference="same_stage2",
        lowp=lowp, inputs=inputs,
    )  # fmt: skip
    print("reflection same-stage2", kernel, lowp, {n: f"{e:.1e}" for n, e in errs.items()})


def test_triton_bf16_reflection_same_stage2_cpu(gpu_like_bf16_interpreter):
    # the GPU test above on the CPU (its reference path; PyTorch's CPU SDPA in bf16 as stage 2 on both
    # sides), lowp=False: o 3.6e-3, dq 8.0e-3 at T = 512 (before relu's normalisation o 5e-4, dq 2.0e-3:
    # the fold's bf16 v / |k|, see above; lowp=True: dw ~1.4e-2, the defect)
    inputs = reflection_inputs(1, 1, 512, 64, "relu")
    errs = check_triton_against_reference(
        "relu", 1, 1, 512, 64, torch.bfloat16, "cpu", chunk=64, tol=1e-2, reference="same_stage2",
        lowp=False, inputs=inputs,
    )  # fmt: skip
    print({n: f"{e:.1e}" for n, e in errs.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_triton_gpu_reflection_regime(kernel, dtype, request):
    # against float64 at T = 1024: fp32 passes at 1e-4 (measured 5e-6..1.2e-5). bf16 exceeds 1e-2: the
    # bf16 dK/dW operands alone cost relu/linear dk and dw > 2e-2 (the CPU u-stage test above), and softmax
    # had a gradient above 1e-2 on an H200 in every run (o 3.9e-3).
    if dtype == "bf16":
        request.applymarker(
            pytest.mark.xfail(reason="bf16 reflection regime above 1e-2 of float64", strict=True)
        )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    errs = check_reflection(kernel, 2, 3, 1024, 64, 64, dtype, "cuda", tol=tol, reference="chunked")
    print("reflection", kernel, dtype, {n: f"{e:.1e}" for n, e in errs.items()})


def test_triton_dispatch_and_errors():
    inputs = make_inputs(1, 2, 9, 16, dtype=torch.float32)
    ref = deltaformer_reference(*[x.double() for x in inputs])
    assert rel_err(deltaformer_attention(*inputs, backend="triton"), ref) < 1e-5
    # non-contiguous views ([B, T, H, D] transposed, as a model produces them) give the same result
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs[:4]] + [inputs[4]]
    assert not views[0].is_contiguous()
    assert rel_err(deltaformer_attention(*views, backend="triton"), ref) < 1e-5
    q, k, v, w, beta = make_inputs(1, 1, 9, 24, dtype=torch.float32)
    with pytest.raises(ValueError, match="head dim"):
        deltaformer_attention(q, k, v, w, beta, backend="triton")
    q, k, v, w, beta = inputs
    with pytest.raises(ValueError, match="share a dtype"):
        deltaformer_attention(q, k, v.half(), w, beta, backend="triton")


def test_triton_reads_v_through_its_strides(monkeypatch):
    # the model's v is a permuted view of the [B, T, 3, H, D] projection: the forward kernel gets that
    # storage itself (no copy) and gives the u of a contiguous v, forward and backward
    import ops.deltaformer.triton as tri

    launch, seen = tri._fwd_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def go(*args, **kw):
                seen.append(args[4])
                return launch[grid](*args, **kw)

            return go

    monkeypatch.setattr(tri, "_fwd_kernel", Spy())
    k, v, w, beta = make_inputs(2, 3, 37, 16, dtype=torch.float32)[1:]
    kvw = torch.stack([k, v, w]).permute(1, 3, 0, 2, 4).contiguous().permute(2, 0, 3, 1, 4)
    results = []
    for inputs in ((k, v, w), kvw):
        kk, vv, ww = (x.detach().requires_grad_() for x in inputs)
        u = tri.deltaformer_u_triton(kk, vv, ww, beta, chunk=16)
        u.backward(torch.linspace(-1, 1, u.numel()).view_as(u))
        results.append((u, kk.grad, vv.grad, ww.grad))
    assert not kvw[1].is_contiguous() and seen[-1].data_ptr() == kvw[1].data_ptr()
    assert seen[-1].stride() == kvw[1].stride()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_u_change_is_substantial():
    # the inputs above must exercise the recurrence, not leave u ~ v
    for kernel in KERNELS:
        for T in (37, 1024):
            q, k, v, w, beta = make_inputs(1, 1, T, 64, torch.float32, beta_max=beta_max_for(kernel, T))
            u = deltaformer_u_torch(k, v, w, beta, kernel=kernel)
            assert rel_err(u, v) > (0.05 if kernel == "softmax" else 0.1), (kernel, T)


GPU_SHAPES = [(2, 3, 1024, 64), (1, 2, 1000, 128), (3, 2, 1, 64)]
GPU_CASES = [
    (kernel, shape, dtype) for kernel in KERNELS for shape in GPU_SHAPES for dtype in ("fp32", "bf16")
]
GPU_CASES += [("softmax", (2, 3, 1024, 64), "fp16"), ("relu", (1, 4, 333, 64), "fp16")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,shape,dtype", GPU_CASES)
def test_triton_gpu_matches_reference(kernel, shape, dtype):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    errs = check_triton_against_reference(
        kernel, *shape, dtype, "cuda", chunk=64, tol=tol, reference="chunked"
    )
    print(kernel, shape, dtype, {n: f"{e:.1e}" for n, e in errs.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_gpu_repeatable(kernel):
    # a race shows up as run-to-run differences on identical inputs
    from ops.deltaformer import deltaformer_u_triton

    q, k, v, w, beta = make_inputs(4, 8, 2048, 64, dtype=torch.bfloat16, device="cuda")
    beta = beta * beta_max_for(kernel, 2048)
    first = deltaformer_u_triton(k, v, w, beta, kernel=kernel)
    assert torch.isfinite(first).all()
    for _ in range(5):
        assert torch.equal(deltaformer_u_triton(k, v, w, beta, kernel=kernel), first)


@pytest.mark.parametrize("kernel", ["softmax", "linear"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_triton_under_torch_compile(backend, kernel):
    # the custom ops must compile without graph breaks (fullgraph=True) and give the same values and
    # gradients; aot_eager traces the backward through the registered fake and autograd functions (linear:
    # with the norms folded around them)
    inputs = make_inputs(1, 2, 21, 16, dtype=torch.float32, beta_max=0.5)
    grad_out = torch.randn(1, 2, 21, 16)

    def fn(q, k, v, w, beta):
        return deltaformer_attention(q, k, v, w, beta, kernel=kernel, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    out, g = grads_of(compiled, inputs, grad_out)
    out_ref, g_ref = grads_of(fn, inputs, grad_out)
    assert rel_err(out, out_ref) < 1e-6
    for name, a, b in zip("q k v w beta".split(), g, g_ref):
        assert rel_err(a, b) < 1e-6, name
    ref = deltaformer_reference(*[x.double() for x in inputs], kernel=kernel)
    assert rel_err(out, ref) < 1e-5


def test_eager_calls_skip_the_custom_op_and_compile_uses_it(monkeypatch):
    # eager: the autograd.Function (a custom op call costs host time, see `_UStage`); torch.compile: the
    # custom op, opaque to Dynamo and Inductor
    from ops.deltaformer import triton as df_triton

    inputs = make_inputs(1, 2, 21, 16, dtype=torch.float32, beta_max=0.5)
    fn = lambda q, k, v, w, beta: deltaformer_attention(q, k, v, w, beta, backend="triton")  # noqa: E731
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    out_c = compiled(*inputs)
    assert any("deltaformer.u_fwd" in code for code in graphs), graphs

    def no_custom_op(*args):
        raise AssertionError("eager call went through the custom op")

    monkeypatch.setattr(df_triton, "_u_fwd_op", no_custom_op)
    out, g = grads_of(fn, inputs, torch.ones_like(out_c))
    assert rel_err(out, out_c.detach()) < 1e-6


def test_triton_custom_op_registration():
    # torch.library's own checks of the fake (meta) functions and the autograd registration
    from ops.deltaformer.triton import _u_bwd_op, _u_fwd_op

    k, v, w, beta = make_inputs(1, 2, 19, 16, dtype=torch.float32, beta_max=0.5)[1:]
    # also the model's layout: q, k, v, w are permuted views of one [B, T, n, H, D] projection and beta a
    # transposed [B, T, H]; the fake outputs must have the real outputs' strides (Inductor asserts them)
    kvw = torch.stack([k, v, w], dim=0).permute(1, 3, 0, 2, 4).contiguous().permute(2, 0, 3, 1, 4)
    beta_t = beta.transpose(1, 2).contiguous().transpose(1, 2)
    du = torch.randn_like(v).transpose(2, 3).contiguous().transpose(2, 3)  # a gradient in another layout
    for args in ((k, v, w, beta), (kvw[0], kvw[1], kvw[2], beta_t)):
        # fp32 (no low halves), and fp16 (low halves of u and beta G) with either operands for dK / dW
        for dtype, lowp in ((torch.float32, False), (torch.float16, True), (torch.float16, False)):
            cfg = ("relu", 0.25, 16, lowp)
            checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
            typed = [x.to(dtype) for x in args]
            torch.library.opcheck(_u_fwd_op, (*typed, *cfg), test_utils=checks)
            saved = _u_fwd_op(*typed, *cfg)
            torch.library.opcheck(
                _u_bwd_op, (du.to(dtype), typed[0], typed[2], typed[3], *saved, *cfg), test_utils=checks[:2]
            )


# ---------------------------------------------------------------------------------------------------
# Model level: a Deltaformer GPT at init trains at T = 1024 with every first-stage kernel and w.


def unnormalised_u(k, v, w, beta, kernel, scale):
    """Stage 1 with relu(s w.k) / s w.k on the raw w, k (the definition before normalisation), float64."""
    a = scale * w.double() @ k.double().transpose(-1, -2)
    a = a.relu() if kernel == "relu" else a
    lower = torch.eye(k.shape[-2], dtype=torch.float64, device=k.device) + beta.double()[..., None] * a.tril(
        -1
    )
    return torch.linalg.solve_triangular(lower, v.double(), upper=False, unitriangular=True)


def model_at_init(kernel, w, backend, device):
    from model import GPT, GPTConfig

    # beta up to 2, the state tracking config's (not the default 1): the widest range the unit vectors of
    # relu / linear kappa must keep finite
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=128, head_dim=64, block_size=1024, vocab_size=256,
        attention="deltaformer", deltaformer_kernel=kernel, deltaformer_w=w, backend=backend,
        deltaformer_beta_max=2.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def loss_and_grads_finite(m, idx, targets, device, autocast):
    m.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        _, loss = m(idx, targets)
    loss.backward()
    assert torch.isfinite(loss), (autocast, loss)
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), (autocast, name)
    return loss.item()


LINEAR_W_PROJ = (
    "linear kappa with w != k: the transition I - beta w^ k^^T has eigenvalue 1 - beta w^.k^, up to 1 + beta "
    "where w and k point apart; at init with w a projection, layer 1's u (4e5) aligns layer 2's tokens, "
    "whose u then reaches 1e50 at T = 1024 on the first input row (loss NaN in fp32 and under bf16 autocast)"
)


def model_inputs(B):
    """B rows of 1024 tokens (and targets) from a fixed generator: row 0 is the same for every B."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (B, 1024), generator=g) for _ in range(2)]


W_CASES = [(kernel, w) for kernel in KERNELS for w in ("q", "k", "proj")]


@pytest.mark.parametrize("kernel,w", [c for c in W_CASES if c != ("linear", "proj")])  # see below
def test_model_at_init_length_1024_finite(kernel, w, monkeypatch):
    # loss and every parameter gradient finite in fp32 and under bf16 autocast; and the inputs the first
    # layer's stage 1 gets here overflow fp32 under the unnormalised relu / linear definition, so a model
    # without the normalisation fails this test (it stopped on a non-finite loss at iteration 0)
    import model as model_module

    m = model_at_init(kernel, w, "torch", "cpu")
    seen = []
    attention = model_module.deltaformer_attention

    def spy(q, k, v, w_, beta, *args, **kwargs):
        seen.append([x.detach() for x in (k, v, w_, beta)])
        return attention(q, k, v, w_, beta, *args, **kwargs)

    monkeypatch.setattr(model_module, "deltaformer_attention", spy)
    idx, targets = model_inputs(1)
    loss_and_grads_finite(m, idx, targets, "cpu", autocast=False)
    k, v, w_, beta = seen[0]  # the first layer's, fp32
    loss_and_grads_finite(m, idx, targets, "cpu", autocast=True)
    assert len(seen) == 4  # two layers, two passes: the spy saw every call
    u = deltaformer_u_torch(k, v, w_, beta, kernel=kernel)
    print(kernel, w, f"max |u| {u.abs().max():.1e}, max |v| {v.abs().max():.1e}")
    if w == "k":  # the delta rule's bound (linear: DeltaNet's transitions of norm <= 1)
        assert u.abs().max() < 10 * v.abs().max()
    if kernel != "softmax":
        raw = unnormalised_u(k, v, w_, beta, kernel, 64**-0.5)
        assert not torch.isfinite(raw).all() or raw.abs().max() > 1e38, raw.abs().max()


def test_model_at_init_linear_w_proj_overflows():
    # the documented limit of linear kappa with w != k (LINEAR_W_PROJ): on this input the loss is not
    # finite, in fp32 and under bf16 autocast; the three other rows of model_inputs(4) stay finite
    m = model_at_init("linear", "proj", "torch", "cpu")
    idx, targets = model_inputs(4)
    with torch.no_grad():
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                assert not torch.isfinite(m(idx[:1], targets[:1])[1]), autocast
        assert all(torch.isfinite(m(idx[r : r + 1], targets[r : r + 1])[1]) for r in (1, 2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("w", ["q", "k", "proj"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_model_at_init_length_1024_finite_gpu(kernel, w, request):
    # the same on the GPU under bf16 autocast, with the Triton stage 1 and the PyTorch one: both finite, and
    # the same loss. linear-proj: row 0 of the batch is the input that overflows on the CPU
    # (test_model_at_init_linear_w_proj_overflows)
    if kernel == "linear" and w == "proj":
        request.applymarker(pytest.mark.xfail(reason=LINEAR_W_PROJ, strict=True))
    idx, targets = (x.cuda() for x in model_inputs(4))
    losses = {}
    for backend in ("torch", "triton"):
        m = model_at_init(kernel, w, backend, "cuda")
        losses[backend] = loss_and_grads_finite(m, idx, targets, "cuda", autocast=True)
    assert abs(losses["triton"] - losses["torch"]) < 1e-2, losses


# ---------------------------------------------------------------------------------------------------
# Boundedness at the model's default beta_max (README, "Why the default is bounded"): keys that make softmax
# kappa weigh the previous token (a slow random walk on the sphere, scaled up: the worst case for stage 1,
# u_i ~ v_i - beta u_{i-1}), beta at the supremum of beta_max sigmoid(.) for every token.


def previous_token_keys(T, D, dtype=torch.float64, seed=0):
    """k [1, 1, T, D]: k_i a slow random walk on the sphere of radius 7 sqrt(D), rounded to dtype, so that
    softmax kappa (w = k, scale 1/sqrt(D)) puts > 0.9 of each row on token i-1."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randn(T, D, generator=g, dtype=torch.float64) * 0.55 / D**0.5
    k = torch.empty(T, D, dtype=torch.float64)
    k[0] = F.normalize(torch.randn(D, generator=g, dtype=torch.float64), dim=0)
    for i in range(1, T):
        k[i] = F.normalize(k[i - 1] + steps[i], dim=0)
    return (7 * D**0.5 * k).to(dtype)[None, None]


def softmax_kappa_on_previous(k):
    """min over rows i >= 1 of softmax kappa's weight on token i-1 (w = k, scale 1/sqrt(D)), in float64."""
    k = k.double()[0, 0]
    T, D = k.shape
    scores = (k @ k.T) / D**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(), float("-inf"))
    kappa = torch.softmax(scores[1:], dim=-1)
    return kappa[torch.arange(T - 1), torch.arange(T - 1)].min().item()


def default_beta_max():
    from model import GPTConfig

    return GPTConfig().deltaformer_beta_max


def bounded_inputs(T, D, dtype, seed=0):
    """(q, k, v, w = k, beta = the default beta_max everywhere), with v's signs alternating along the
    sequence on top of noise (what u_i ~ v_i - u_{i-1} accumulates most)."""
    k = previous_token_keys(T, D, dtype, seed)
    assert softmax_kappa_on_previous(k) > 0.9
    g = torch.Generator().manual_seed(seed + 1)
    signs = (-1.0) ** torch.arange(T, dtype=torch.float64)[:, None]
    v = (signs + 0.3 * torch.randn(T, D, generator=g, dtype=torch.float64)).to(dtype)[None, None]
    q = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64).to(dtype)
    beta = torch.full((1, 1, T), default_beta_max(), dtype=torch.float64).to(dtype)
    return q, k, v, k, beta


def assert_linear_growth(o, v):
    """o finite and max |o_{<t}| <= t max |v| at every prefix length t (the README's bound)."""
    o, v = o.double().cpu()[0, 0], v.double().cpu()[0, 0]
    assert torch.isfinite(o).all(), "non-finite output"
    t = torch.arange(1, o.shape[0] + 1, dtype=torch.float64)
    grown = o.abs().amax(dim=-1).cummax(0).values / (v.abs().amax() * t)
    assert grown.max() <= 1.0, f"max |o| / (t max |v|) = {grown.max():.3g} at t = {grown.argmax() + 1}"
    return o.abs().max().item() / v.abs().max().item()


def test_default_beta_bounded_on_previous_token_keys_float64():
    # T = 1024 in float64 on the PyTorch path (the model's CPU path); the float64 loop agrees with it on a
    # prefix. At beta_max 2 the same keys grow u like 1.9^T: it overflows float64 (NaN) before T = 1024
    q, k, v, w, beta = bounded_inputs(1024, 64, torch.float64)
    o = deltaformer_attention(q, k, v, w, beta, kernel="softmax", backend="torch")
    growth = assert_linear_growth(o, v)
    ref = deltaformer_reference(*(x[:, :, :128] for x in (q, k, v, w, beta)))
    assert rel_err(o[:, :, :128], ref) < 1e-12
    print(f"softmax kappa, beta_max {default_beta_max()}: max |o| / max |v| = {growth:.2f}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_beta_bounded_on_previous_token_keys_triton(dtype, request):
    # the same on the Triton path: T = 1024 on a GPU, T = 512 through the interpreter (GPU-like dots for bf16)
    from ops.deltaformer import deltaformer_u_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        request.getfixturevalue("gpu_like_bf16_interpreter")
    T = 1024 if device == "cuda" else 512
    q, k, v, w, beta = (x.to(device) for x in bounded_inputs(T, 64, dtype))
    u = deltaformer_u_triton(k, v, w, beta, kernel="softmax", chunk=64)
    o = F.scaled_dot_product_attention(q, k, u, is_causal=True)
    assert_linear_growth(o, v)
    u_ref = deltaformer_u_torch(*(x.double() for x in (k, v, w, beta)), kernel="softmax")
    # u reaches ~1000 |v| here; fp32 on a GPU at T = 1024 within test_triton_gpu_reflection_regime's 1e-4
    assert rel_err(u, u_ref) < ({"cpu": 1e-5, "cuda": 1e-4}[device] if dtype == torch.float32 else 1e-2)


def test_linear_kappa_w_is_k_bounded_up_to_beta_2():
    # DeltaNet's bound (README): |u_i|_2 <= |v_i|_2 + beta sum_{j<i} |v_j|_2 for beta <= 2, on the same keys
    _, k, v, _, _ = bounded_inputs(1024, 64, torch.float64)
    beta = torch.full((1, 1, 1024), 2.0, dtype=torch.float64)
    u = deltaformer_u_torch(k, v, k, beta, kernel="linear")
    norms = v[0, 0].norm(dim=-1)
    bound = norms + 2.0 * (norms.cumsum(0) - norms)
    assert (u[0, 0].norm(dim=-1) <= bound * (1 + 1e-12)).all()


def test_softmax_kappa_beta_2_and_relu_kappa_grow_geometrically():
    # the named options the README says are not bounded: softmax kappa with beta_max 2 on the keys above,
    # and relu kappa at the default beta_max on keys rotating slowly in a plane (relu rows sum to ~5 here)
    _, k, v, w, _ = bounded_inputs(256, 64, torch.float64)
    u = deltaformer_u_torch(k, v, w, torch.full((1, 1, 256), 2.0, dtype=torch.float64), kernel="softmax")
    assert not torch.isfinite(u).all() or u.abs().max() > 1e50 * v.abs().max()
    T = 1024
    angle = 0.3 * torch.arange(T, dtype=torch.float64)
    k = torch.zeros(1, 1, T, 64, dtype=torch.float64)
    k[0, 0, :, 0], k[0, 0, :, 1] = angle.cos(), angle.sin()
    v = torch.randn(1, 1, T, 64, dtype=torch.float64)
    beta = torch.full((1, 1, T), default_beta_max(), dtype=torch.float64)
    u = deltaformer_u_torch(k, v, k, beta, kernel="relu")
    assert u.abs().max() > T * v.abs().max()


# ---------------------------------------------------------------------------------------------------
# Packed documents (doc_start [B, T]): a token sees only its own document's tokens, in stage 1 and stage 2,
# so each document's outputs and gradients are those of the document run alone.


def doc_starts(*rows):
    """doc_start [B, T] of rows given as their documents' lengths (every row's summing to T)."""
    out = []
    for lengths in rows:
        starts = [sum(lengths[:n]) for n in range(len(lengths))]
        out.append([start for start, n in zip(starts, lengths) for _ in range(n)])
    return torch.tensor(out)


# T = 43: two chunks of 16 and a partial third. Row 0's documents start at 0, at both chunk edges (16, 32),
# one after each (17, 33) and at 34: 1-token documents at 16, 32 and 33 (EOTs in a row); later chunks skip
# whole earlier ones. Row 1's second document starts inside chunk 0 and spans all three (blocks partly in
# a row's document, between chunks), its third is one token, the last.
EDGES = doc_starts([16, 1, 15, 1, 1, 9], [5, 37, 1])
W_MODES = ("k", "q", "sep")  # w = k (one tensor), w = q, w its own input


def with_w(fn, w_mode):
    """fn(q, k, v, w, beta) as a function of the inputs w_mode differentiates: w = k or q is that tensor."""
    if w_mode == "sep":
        return fn
    return lambda q, k, v, beta: fn(q, k, v, k if w_mode == "k" else q, beta)


def documents_alone(fn, doc_start):
    """fn over each document of each row on its own (slices of the inputs), the outputs put back in place."""

    def run(*inputs):
        rows = []
        for b, starts in enumerate(doc_start.tolist()):
            bounds = sorted(set(starts)) + [len(starts)]
            docs = [fn(*(x[b : b + 1, :, lo:hi] for x in inputs)) for lo, hi in zip(bounds, bounds[1:])]
            rows.append(torch.cat(docs, dim=2))
        return torch.cat(rows)

    return run


def packed(backend, kernel, doc_start, chunk=16, lowp=None):
    """Deltaformer attention of packed rows by one backend's stage 1 at this chunk, then stage 2 (what
    deltaformer_attention runs, there at chunk 64)."""
    from ops.deltaformer import deltaformer_u_triton
    from ops.deltaformer.stage2 import attend

    def fn(q, k, v, w, beta):
        if backend == "torch":
            u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, chunk=chunk, doc_start=doc_start)
        else:
            u = deltaformer_u_triton(
                k, v, w, beta, kernel=kernel, chunk=chunk, lowp=lowp, doc_start=doc_start
            )
        return attend(q, k, u, q.shape[-1] ** -0.5, doc_start)

    return fn


def check_documents(backend, kernel, w_mode, doc_start, D=16, dtype=torch.float64, tol=1e-12, **kw):
    """Values and every gradient of the packed rows against each document alone (the float64 reference,
    unmasked), on the same inputs rounded to dtype."""
    B, T = doc_start.shape
    inputs = make_inputs(B, 2, T, D, beta_max=beta_max_for(kernel, T))
    inputs = [x.to(dtype).double() for x in inputs]
    if w_mode != "sep":
        del inputs[3]
    grad_out = torch.randn(B, 2, T, D, dtype=torch.float64).to(dtype)
    ref = documents_alone(with_w(lambda *x: deltaformer_reference(*x, kernel=kernel), w_mode), doc_start)
    out_ref, g_ref = grads_of(ref, inputs, grad_out.double())
    out, g = grads_of(
        with_w(packed(backend, kernel, doc_start, **kw), w_mode), [x.to(dtype) for x in inputs], grad_out
    )
    names = ["o", *(n for n in "q k v w beta".split() if w_mode == "sep" or n != "w")]
    errs = {n: rel_err(a, b) for n, a, b in zip(names, [out, *g], [out_ref, *g_ref])}
    assert all(e < tol for e in errs.values()), errs
    # the documents really interact when packed without the mask
    unmasked = with_w(packed(backend, kernel, None, **kw), w_mode)(*[x.to(dtype) for x in inputs])
    assert rel_err(unmasked, out_ref) > 1e-2


@pytest.mark.parametrize("w_mode", W_MODES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_documents_alone_torch(kernel, w_mode):
    check_documents("torch", kernel, w_mode, EDGES)


@pytest.mark.parametrize("w_mode", W_MODES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_documents_alone_triton(kernel, w_mode):
    # fp32 (the interpreter's exact fp32 products): chunks of 16, dK in the backward wavefront (D = 16)
    check_documents("triton", kernel, w_mode, EDGES, dtype=torch.float32, tol=1e-5)


@pytest.mark.parametrize("kernel", ["softmax", "linear"])
def test_documents_alone_triton_dk_pass_and_fp16(kernel):
    # D = 128: dK by its own pass (`_dk_block`); fp16 with chunks of 32: the split recurrence and half
    # operands of dK / dW (the chunk edge at 32, the 1-token documents at 32 and 33)
    check_documents("triton", kernel, "sep", EDGES, D=128, dtype=torch.float32, tol=1e-5)
    check_documents("triton", kernel, "k", EDGES, dtype=torch.float16, tol=1e-2, chunk=32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_documents_match_naive_equations(kernel):
    # the reference and the PyTorch path (chunks of 4: documents across and at chunk edges) against the
    # scalar loops written from the equations with doc_start, values and gradients
    doc_start = doc_starts([3, 1, 4, 1], [1, 8], [9])
    B, T, scale = 3, 9, 0.7
    inputs = make_inputs(B, 2, T, 4, beta_max=2.0, seed=2)
    grad_out = torch.randn(B, 2, T, 4, dtype=torch.float64)
    out_n, g_n = grads_of(lambda *x: naive_deltaformer(*x, kernel, scale, doc_start)[0], inputs, grad_out)
    out_r, g_r = grads_of(
        lambda *x: deltaformer_reference(*x, kernel=kernel, scale=scale, doc_start=doc_start),
        inputs,
        grad_out,
    )
    from ops.deltaformer.stage2 import attend

    def chunked(q, k, v, w, beta):
        u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, scale=scale, chunk=4, doc_start=doc_start)
        return attend(q, k, u, scale, doc_start)

    out_c, g_c = grads_of(chunked, inputs, grad_out)
    for out, g in ((out_r, g_r), (out_c, g_c)):
        assert rel_err(out, out_n) < 1e-12
        for name, a, b in zip("q k v w beta".split(), g, g_n):
            assert rel_err(a, b) < 1e-11, name
    assert rel_err(out_n, naive_deltaformer(*inputs, kernel, scale)[0]) > 1e-2  # the mask matters
    public = deltaformer_attention(*inputs, kernel=kernel, scale=scale, backend="torch", doc_start=doc_start)
    assert rel_err(public, out_n) < 1e-12


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_one_document_equals_no_mask(kernel, backend):
    # doc_start all 0 (int32 here) is the unmasked op, values and gradients
    dtype, tol = (torch.float64, 1e-13) if backend == "torch" else (torch.float32, 1e-6)
    inputs = make_inputs(2, 2, 43, 16, dtype=dtype)
    grad_out = torch.randn(2, 2, 43, 16, dtype=dtype)
    zeros = torch.zeros(2, 43, dtype=torch.int32)
    out, g = grads_of(packed(backend, kernel, zeros), inputs, grad_out)
    out_ref, g_ref = grads_of(packed(backend, kernel, None), inputs, grad_out)
    for a, b in zip([out, *g], [out_ref, *g_ref]):
        assert rel_err(a, b) < tol


def test_doc_block_mask_tiles():
    # the flex_attention block mask against the dense mask, tile by tile: every tile a query tile sees in
    # part is listed, none it does not see, and "full" (no mask applied) exactly the tiles before the diagonal
    # that all its rows see whole
    from ops.deltaformer.stage2 import dense_doc_mask, doc_block_mask

    g = torch.Generator().manual_seed(0)
    cases = [EDGES, doc_starts([43]), doc_starts([1] * 43), doc_starts([48, 16, 17, 15])]
    for T in (40, 96):  # random documents, random lengths (many short ones)
        cuts = torch.rand(2, T, generator=g) < torch.tensor([[0.05], [0.3]])
        cuts[:, 0] = True
        pos = torch.arange(T).expand(2, T)
        cases.append(torch.where(cuts, pos, 0).cummax(dim=1).values)
    for doc_start in cases:
        B, T = doc_start.shape
        n = -(-T // 16)
        dense = torch.zeros(B, n * 16, n * 16, dtype=torch.bool)
        dense[:, :T, :T] = dense_doc_mask(doc_start)
        tiles = dense.view(B, n, 16, n, 16)
        seen = tiles.any(dim=(2, 4))
        whole = tiles[:, :, : 16 - (n * 16 - T)].all(dim=(2, 4))  # the rows < T of each query tile
        bm = doc_block_mask(doc_start, block=16)
        for b in range(B):
            for m in range(n):
                part = set(bm.kv_indices[b, 0, m, : bm.kv_num_blocks[b, 0, m]].tolist())
                full = set(bm.full_kv_indices[b, 0, m, : bm.full_kv_num_blocks[b, 0, m]].tolist())
                listed = part | full
                assert not part & full
                assert listed == set(seen[b, m].nonzero().flatten().tolist()), (b, m)
                assert full == {x for x in range(m) if whole[b, m, x]}, (b, m)
        assert torch.equal(bm.to_dense()[:, 0].bool(), seen)


def test_flex_stage2_equals_dense_mask():
    # stage 2 as CUDA runs it (flex_attention with the block mask; eager here, which has no backward on the
    # CPU: gradients in the GPU test below) against SDPA with the dense mask
    from ops.deltaformer.stage2 import dense_doc_mask, flex_in_documents

    q, k, u = make_inputs(2, 2, 43, 16)[:3]
    mask = dense_doc_mask(EDGES)[:, None]
    ref = F.scaled_dot_product_attention(q, k, u, attn_mask=mask, scale=0.3)
    assert rel_err(flex_in_documents(q, k, u, 0.3, EDGES), ref) < 1e-12


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_documents_gpu(kernel):
    # on the GPU: compiled flex_attention as stage 2 and the compiled Triton kernels, fp32 against the
    # float64 documents alone, at T = 1024 (random documents, many skipped tiles; also in bf16) and on the
    # edge rows above
    g = torch.Generator().manual_seed(0)
    cuts = torch.rand(3, 1024, generator=g) < torch.tensor([[0.002], [0.01], [0.05]])
    cuts[:, 0] = True
    pos = torch.arange(1024).expand(3, 1024)
    long_rows = torch.where(cuts, pos, 0).cummax(dim=1).values
    for doc_start, chunk, dtype, tol in (
        (long_rows, 64, torch.float32, 1e-4),
        (long_rows, 64, torch.bfloat16, 1e-2),
        (EDGES, 16, torch.float32, 1e-4),
    ):
        check_documents_gpu(kernel, doc_start.cuda(), dtype, tol, chunk)


def check_documents_gpu(kernel, doc_start, dtype, tol, chunk):
    B, T = doc_start.shape
    inputs = [
        x.to(dtype).double()
        for x in make_inputs(B, 2, T, 64, device="cuda", beta_max=beta_max_for(kernel, T))
    ]
    grad_out = torch.randn(B, 2, T, 64, dtype=torch.float64, device="cuda").to(dtype)
    ref = documents_alone(lambda *x: deltaformer_attention(*x, kernel=kernel, backend="torch"), doc_start)
    out_ref, g_ref = grads_of(ref, inputs, grad_out.double())
    out, g = grads_of(packed("triton", kernel, doc_start, chunk), [x.to(dtype) for x in inputs], grad_out)
    errs = {n: rel_err(a, b) for n, a, b in zip("o q k v w beta".split(), [out, *g], [out_ref, *g_ref])}
    print(kernel, T, dtype, {n: f"{e:.1e}" for n, e in errs.items()})
    assert all(e < tol for e in errs.values()), errs


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_in_documents_equals_full_forward(kernel):
    # a prompt of 6 tokens, then 1 and 3 new tokens, then one at a time (documents starting in the prompt,
    # at a new token, and two in a row), against the full masked forward; and the static cache's step (pos)
    from ops.deltaformer import deltaformer_decode

    doc_start = doc_starts([4, 5, 1, 1, 2], [12, 1])
    B, T, D = 2, 13, 8
    q, k, v, w, beta = make_inputs(B, 2, T, D)
    full = deltaformer_attention(q, k, v, w, beta, kernel=kernel, backend="torch", doc_start=doc_start)
    past, outs = None, []
    for lo, hi in [(0, 6), (6, 7), (7, 10)] + [(t, t + 1) for t in range(10, T)]:
        sl = slice(lo, hi)
        o, past = deltaformer_decode(
            *(x[:, :, sl] for x in (q, k, v, w, beta)), past, kernel, doc_start=doc_start[:, sl]
        )
        outs.append(o)
    assert rel_err(torch.cat(outs, dim=2), full) < 1e-12
    u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, doc_start=doc_start)
    assert rel_err(past[1], u) < 1e-12
    # static buffers of 16 slots, garbage past pos
    k_buf, u_buf = (10 * torch.randn(B, 2, 16, D, dtype=torch.float64) for _ in range(2))
    k_buf[:, :, :6], u_buf[:, :, :6] = k[:, :, :6], u[:, :, :6]
    for t in range(6, T):
        args = [x[:, :, t : t + 1] for x in (q, k, v, w, beta)]
        o_t, u_t = deltaformer_step(
            *args, k_buf, u_buf, kernel, pos=torch.tensor([t]), doc_start=doc_start[:, t : t + 1]
        )
        assert rel_err(o_t, full[:, :, t : t + 1]) < 1e-12 and rel_err(u_t, u[:, :, t : t + 1]) < 1e-12, t
    assert rel_err(deltaformer_decode(q, k, v, w, beta, None, kernel)[0], full) > 1e-2  # the mask matters


def test_doc_start_bad_inputs_raise():
    from ops.deltaformer import deltaformer_decode, deltaformer_u_triton

    q, k, v, w, beta = make_inputs(2, 2, 5, 16, dtype=torch.float32)
    good = doc_starts([2, 3], [5])
    bad = {
        "int32 or int64": good.float(),
        r"\[B, T\] = \(2, 5\)": good[:, :4],
        "non-decreasing": torch.tensor([[0, 0, 2, 2, 0], [0, 1, 1, 1, 1]]),
        r"lie in \[0, t\]": torch.tensor([[0, 0, 3, 3, 3], [0, 0, 0, 0, 0]]),  # 3 > t = 2
        r"lie in \[0,": torch.tensor([[-1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]),
    }
    for message, doc_start in bad.items():
        for backend in ("torch", "triton"):
            with pytest.raises(ValueError, match="doc_start.*" + message):
                deltaformer_attention(q, k, v, w, beta, backend=backend, doc_start=doc_start)
        with pytest.raises(ValueError, match="doc_start.*" + message):
            deltaformer_reference(q, k, v, w, beta, doc_start=doc_start)
    with pytest.raises(ValueError, match="doc_start"):
        deltaformer_u_triton(k, v, w, beta, doc_start=good.to("meta"))
    # decoding: the new tokens' starts count the cached ones (3 cached: token 0 of these is 3)
    o, past = deltaformer_decode(*(x[:, :, :3] for x in (q, k, v, w, beta)), None, doc_start=good[:, :3])
    new = [x[:, :, 3:] for x in (q, k, v, w, beta)]
    with pytest.raises(ValueError, match=r"doc_start\[b, t\] must lie in \[0, 3 \+ t\]"):
        deltaformer_decode(*new, past, doc_start=torch.tensor([[2, 5], [0, 0]]))
    deltaformer_decode(*new, past, doc_start=torch.tensor([[2, 4], [0, 0]]))
    with pytest.raises(ValueError, match=r"doc_start must be \[B, T\] = \(2, 1\)"):
        deltaformer_step(*(x[:, :, 3:4] for x in (q, k, v, w, beta)), *past, doc_start=good[:, :2])


def test_documents_under_torch_compile():
    # doc_start through the custom ops (an optional tensor argument): torch.library's checks, and the masked
    # op under torch.compile (aot_eager, fullgraph) equals eager, values and gradients; the flex stage 2
    # (its block mask built from doc_start) traces without graph breaks
    from ops.deltaformer.stage2 import _flex_compiled, dense_doc_mask, flex_in_documents
    from ops.deltaformer.triton import _u_bwd_op, _u_fwd_op

    inputs = make_inputs(2, 2, 43, 16, dtype=torch.float32, beta_max=0.5)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    cfg = ("relu", 1.0, 16, False, EDGES)
    torch.library.opcheck(_u_fwd_op, (*inputs[1:], *cfg), test_utils=checks)
    saved = _u_fwd_op(*inputs[1:], *cfg)
    du = torch.randn_like(inputs[0])
    torch.library.opcheck(
        _u_bwd_op, (du, inputs[1], inputs[3], inputs[4], *saved, *cfg), test_utils=checks[:2]
    )

    def fn(q, k, v, w, beta):
        return deltaformer_attention(q, k, v, w, beta, kernel="softmax", backend="triton", doc_start=EDGES)

    torch._dynamo.reset()
    out, g = grads_of(torch.compile(fn, fullgraph=True, backend="aot_eager"), inputs, du)
    out_ref, g_ref = grads_of(fn, inputs, du)
    for a, b in zip([out, *g], [out_ref, *g_ref]):
        assert rel_err(a, b) < 1e-6
    q, k, v = inputs[:3]
    # (the compiled flex_attention CUDA runs, inside a compiled model: traced through)
    flex = torch.compile(
        lambda q, k, v: flex_in_documents(q, k, v, 0.3, EDGES, _flex_compiled()),
        fullgraph=True,
        backend="eager",
    )
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_doc_mask(EDGES)[:, None], scale=0.3)
    assert rel_err(flex(q, k, v), ref) < 1e-6
