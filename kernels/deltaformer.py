"""Deltaformer attention: reference, chunked PyTorch path, cached decoding step, Triton path.

Math (q, k, v, w: [B, H, T, D]; beta: [B, H, T]; s = scale, default 1/sqrt(D)):

    stage 1 (delta rule over the past):  u_i = v_i - beta_i * sum_{j<i} kappa(w_i, k_j) u_j,  u_0 = v_0
    stage 2 (causal softmax attention):  o_i = sum_{j<=i} softmax_{j<=i}(s q_i.k_j) u_j

kappa is the first-stage kernel: "softmax" = softmax over j<i of s w_i.k_j; "relu" = relu(w^_i.k^_j) and
"linear" = w^_i.k^_j with unit vectors w^ = w / |w|, k^ = k / |k| (|.| guarded below by NORM_EPS) and scale 1.
In matrix form stage 1 is a unit lower-triangular solve, U = (I + diag(beta) A)^-1 V with
A_ij = kappa(w_i, k_j) for j < i and 0 elsewhere. Stage 2 always takes q and k as given, with scale s.

Why relu and linear are normalised: with S_i = sum_{j<=i} u_j k^_j^T, u_i = v_i - beta_i S_{i-1} w^_i and
S_i = S_{i-1} (I - beta_i w^_i k^_i^T) + v_i k^_i^T. For linear kappa and w = k this is DeltaNet; its
transition I - beta k^ k^^T has eigenvalues 1 and 1 - beta: norm <= 1 for beta in [0, 2], so
|S_i| <= |S_{i-1}| + |v_i| (no exponential growth). Unnormalised, the model's RMS-normed keys have
s k.k = sqrt(D): the eigenvalue along k is 1 - beta sqrt(D) (-7 at D = 64, beta = 1) and u overflows by
T = 512. With w != k nothing bounds u: the eigenvalue 1 - beta w^.k^ reaches 1 + beta where w and k point
apart (linear; relu's kappa >= 0 avoids that one). Unrelated w and k grow |u| about (1 + beta^2 / D)^(T / 2);
a 2-layer model at init with linear kappa and w a projection overflowed fp32 at T = 1024 on some inputs.

The public functions (`deltaformer_reference`, `deltaformer_u_torch`, `deltaformer_u_triton`,
`deltaformer_step`, `deltaformer_attention`) take the raw k and w; their `scale` is softmax kappa's score
scale (and stage 2's, where they have one), which relu and linear ignore in stage 1. The normalisation
(`_inv_norm`) is PyTorch, autograd gives its backward: `stage1_keys` forms the unit vectors for the
reference, the PyTorch path and the decoding step; `deltaformer_u_triton` folds the same norms into beta,
v and u around the kernels, which score `scale * w.k` of whatever they are given.

Three implementations of the same function:
- `deltaformer_reference`: the per-token loop, the spec in code (any dtype; tests use float64).
- the PyTorch path (`backend="torch"`): chunked and vectorised: for each chunk of rows, subtract what the
  earlier chunks' u contribute (one matmul), then solve the small in-chunk triangular system. Autograd
  gives the backward.
- the Triton path (`backend="triton"`): see the second half of this file.

The Triton path in short: stage 1 in chunks of C = 64 rows, a wavefront over (chunk, batch*head) tiles for
the recurrence, a parallel prep kernel for the in-chunk inverses and softmax log-sum-exps, the reversed
wavefront plus dK / dW passes for the backward; stage 2 is SDPA. With half-precision inputs everything
accumulates in fp32; the recurrence's inter-chunk products take hi + lo half operands (~16 bits,
rec="split") and the in-chunk inverse 3-pass tf32, because where updates are near reflections (beta kappa
~ 2, the regime state tracking needs) every rounding there is carried into all later u; the other O(T^2)
products take half operands (lowp, as FlashAttention), which costs dK and dW ~2e-2 in that regime
(tests/test_deltaformer.py; lowp=False removes it for +30% GPU time at 8,12,1024,64). Forward+backward
GPU time is 3.2-4.4x causal SDPA's on an H200 at B,H,T,D = 8,12,1024,64 .. 2,12,4096,64
(bench/RESULTS.md). Counted in [64, 64] @ [64, 64] products over the causal triangle's block pairs, stage 1
does ~14 (S re-formed per pass, the split's three products) and SDPA 7, so (14 + 7) / 7 = 3x SDPA even at
SDPA's efficiency; the wavefronts run at the SMs' throughput, so scheduling does not shorten that.
"""

import math

import torch
import torch.nn.functional as F

KERNELS = ("softmax", "relu", "linear")
BACKENDS = ("auto", "torch", "triton")
NORM_EPS = 1e-6  # relu / linear stage 1: x^ = x / max(|x|, NORM_EPS)


def _inv_norm(x):
    """1 / max(|x|, NORM_EPS) over the last dim, [..., 1], in fp32 (or x's wider dtype)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return 1.0 / x.to(acc).norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


def stage1_keys(k, w, kernel, scale, dtype=None):
    """(k, w, s) as stage 1 scores them, in dtype (default k's): softmax kappa takes k and w as given with
    s = scale; relu and linear take unit vectors k^, w^ with s = 1 (w^ is k^ itself when w is k)."""
    dtype = k.dtype if dtype is None else dtype
    if kernel == "softmax":
        return k.to(dtype), w.to(dtype), scale
    k_hat = _unit(k, dtype)
    return k_hat, (k_hat if w is k else _unit(w, dtype)), 1.0


def _unit(x, dtype):
    r = _inv_norm(x)
    return (x.to(r.dtype) * r).to(dtype)


def _check_inputs(q, k, v, w, beta, kernel):
    if kernel not in KERNELS:
        raise ValueError(f"deltaformer: kernel must be one of {KERNELS}, got {kernel!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("w", w)):
        if x.dim() != 4:
            raise ValueError(f"deltaformer: {name} must be [B, H, T, D], got shape {tuple(x.shape)}")
    if not (q.shape == k.shape == v.shape == w.shape):
        raise ValueError(
            "deltaformer: q, k, v, w must have the same shape [B, H, T, D], got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, w {tuple(w.shape)}"
        )
    if tuple(beta.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"deltaformer: beta must be [B, H, T] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}"
        )


def _kappa_rows(scores, valid, kernel):
    """kappa applied to a block of scores (already scaled); entries where `valid` is False are 0.

    For softmax the normalisation runs over the valid entries of each row; a row with none (token 0)
    gives zeros, not NaN.
    """
    if kernel == "softmax":
        scores = scores.masked_fill(~valid, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(scores - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        return p / torch.where(denom > 0, denom, torch.ones_like(denom))
    a = torch.relu(scores) if kernel == "relu" else scores
    return a.masked_fill(~valid, 0.0)


def deltaformer_reference(q, k, v, w, beta, kernel="softmax", scale=None):
    """Per-token loop over T: u_i from all earlier u_j, then causal softmax attention of q over (k, u).
    scale: stage 2's and softmax kappa's (default 1/sqrt(D))."""
    _check_inputs(q, k, v, w, beta, kernel)
    T, D = q.shape[-2], q.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    k1, w1, s1 = stage1_keys(k, w, kernel, s)
    us = []
    for i in range(T):
        if i == 0:
            us.append(v[:, :, 0])
            continue
        scores = s1 * torch.einsum("bhd,bhjd->bhj", w1[:, :, i], k1[:, :, :i])
        if kernel == "softmax":
            a = torch.softmax(scores, dim=-1)
        elif kernel == "relu":
            a = torch.relu(scores)
        else:
            a = scores
        past = torch.stack(us, dim=2)  # [B, H, i, D]
        us.append(v[:, :, i] - beta[:, :, i, None] * torch.einsum("bhj,bhjd->bhd", a, past))
    u = torch.stack(us, dim=2)
    outs = []
    for i in range(T):
        p = torch.softmax(s * torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]), dim=-1)
        outs.append(torch.einsum("bhj,bhjd->bhd", p, u[:, :, : i + 1]))
    return torch.stack(outs, dim=2)


def deltaformer_u_torch(k, v, w, beta, kernel="softmax", scale=None, chunk=64):
    """Stage 1 in PyTorch, chunk by chunk: U = (I + diag(beta) A)^-1 V. Returns u [B, H, T, D].
    scale: softmax kappa's (default 1/sqrt(D)); relu and linear ignore it (`stage1_keys`)."""
    T, D = k.shape[-2], k.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    out_dtype = v.dtype
    # bf16/fp16 run in fp32 (solve_triangular has no half-precision kernels; the recurrence wants fp32).
    acc = torch.promote_types(v.dtype, torch.float32)
    k, w, s = stage1_keys(k, w, kernel, s, acc)
    v, beta = v.to(acc), beta.to(acc)
    pos = torch.arange(T, device=k.device)
    u_chunks = []
    for r0 in range(0, T, chunk):
        r1 = min(r0 + chunk, T)
        # Rows r0..r1 need kappa against every key before them: all lie in [0, r1).
        scores = s * (w[:, :, r0:r1] @ k[:, :, :r1].transpose(-1, -2))  # [B, H, C, r1]
        valid = pos[None, :r1] < pos[r0:r1, None]
        a = _kappa_rows(scores, valid, kernel)
        b = beta[:, :, r0:r1, None]
        rhs = v[:, :, r0:r1]
        if r0 > 0:
            rhs = rhs - b * (a[..., :r0] @ torch.cat(u_chunks, dim=2))
        eye = torch.eye(r1 - r0, dtype=a.dtype, device=a.device)
        lower = eye + b * a[..., r0:r1]  # unit lower triangular
        u_chunks.append(torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True))
    return torch.cat(u_chunks, dim=2).to(out_dtype)


def deltaformer_step(q_t, k_t, v_t, w_t, beta_t, k_cache, u_cache, kernel="softmax", scale=None):
    """One decoding step with a cache of the S earlier keys and u's (S may be 0).

    q_t, k_t, v_t, w_t: [B, H, 1, D]; beta_t: [B, H, 1]; k_cache, u_cache: [B, H, S, D].
    Returns (o_t, u_t), both [B, H, 1, D]; the caller appends k_t and u_t to its caches (raw k_t: stage 1
    normalises the keys itself for relu and linear). scale: stage 2's and softmax kappa's (default 1/sqrt(D)).
    """
    _check_inputs(q_t, k_t, v_t, w_t, beta_t, kernel)
    if q_t.shape[2] != 1:
        raise ValueError(
            f"deltaformer_step: q_t etc. must hold one token [B, H, 1, D], got {tuple(q_t.shape)}"
        )
    if (
        k_cache.shape != u_cache.shape
        or k_cache.shape[:2] != q_t.shape[:2]
        or k_cache.shape[3] != q_t.shape[3]
    ):
        raise ValueError(
            f"deltaformer_step: k_cache and u_cache must be [B, H, S, D] matching q_t {tuple(q_t.shape)}, "
            f"got {tuple(k_cache.shape)} and {tuple(u_cache.shape)}"
        )
    D = q_t.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    if k_cache.shape[2] == 0:
        u_t = v_t
    else:
        acc = torch.promote_types(v_t.dtype, torch.float32)  # bf16/fp16 caches: accumulate in fp32
        k1, w1, s1 = stage1_keys(k_cache, w_t, kernel, s, acc)
        scores = s1 * (w1 @ k1.transpose(-1, -2))  # [B, H, 1, S]
        if kernel == "softmax":
            a = torch.softmax(scores, dim=-1)
        elif kernel == "relu":
            a = torch.relu(scores)
        else:
            a = scores
        u_t = (v_t.to(acc) - beta_t.to(acc)[..., None] * (a @ u_cache.to(acc))).to(v_t.dtype)
    keys = torch.cat([k_cache, k_t], dim=2)
    values = torch.cat([u_cache, u_t], dim=2)
    # The new token attends to everything in the cache and itself: no mask.
    o_t = F.scaled_dot_product_attention(q_t, keys, values, scale=s)
    return o_t, u_t


def deltaformer_attention(q, k, v, w, beta, kernel="softmax", scale=None, backend="auto"):
    """Deltaformer attention, differentiable in q, k, v, w, beta. Returns o [B, H, T, D].
    scale: stage 2's and softmax kappa's (default 1/sqrt(D))."""
    if backend not in BACKENDS:
        raise ValueError(f"deltaformer_attention: backend must be one of {BACKENDS}, got {backend!r}")
    _check_inputs(q, k, v, w, beta, kernel)
    D = q.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else scale
    if backend == "auto":
        backend = "triton" if (q.is_cuda and _HAS_TRITON) else "torch"
    if backend == "triton":
        u = deltaformer_u_triton(k, v, w, beta, kernel=kernel, scale=s)
    else:
        u = deltaformer_u_torch(k, v, w, beta, kernel=kernel, scale=s)
    return F.scaled_dot_product_attention(q, k, u, is_causal=True, scale=s)


# ----------------------------------------------------------------------------------------------------
# Triton path: stage 1 (u) forward and backward in Triton; stage 2 stays SDPA (FlashAttention on CUDA).
#
# The rows are cut into chunks of C. Chunk c of one (batch, head) needs the u of every earlier chunk, so
# chunks are sequential; but the in-chunk matrices and the softmax row statistics depend only on w, k and
# beta, and most of a chunk's remaining work (scores against earlier keys, A @ u) only needs chunks that
# finished long before. Hence, forward:
#   1. `_prep_kernel`, fully parallel over (chunk, batch*head): the softmax log-sum-exp of every row over
#      j < i, and X_c = (I + diag(beta_c) A_cc)^-1 for every chunk.
#   2. `_fwd_kernel`, a wavefront: every (chunk, batch*head) tile is its own program; it takes whatever
#      earlier chunks are already published in a loop with no synchronisation inside (which the compiler
#      may software-pipeline safely), then waits for the next one. Once all are in,
#      u_c = X_c (v_c - beta_c * sum_{j < chunk} A_cj u_j); it publishes u_c, then computes
#      h_c = sum_{j<i} A_ij u_j for the backward. The critical path per chunk is one block of scores and
#      A @ u plus one product with X_c; but most tiles find their earlier chunks already published, so the
#      wavefront runs at the SMs' throughput for its work (measured: running prep beside it in the same
#      launch, or shortening the chain with extra products, only added time).
# Each program takes a ticket from an atomic counter and maps it to (chunk, batch*head) in chunk order, so
# a tile only waits on tiles holding smaller tickets, which are already running: no deadlock, whatever the
# number of resident programs. Each (batch, head) has a progress counter (chunks published): a tile
# publishes with a release after a barrier; readers spin on an acquire. A spin that never ends (a bug)
# gives up and writes NaN.
#
# In-chunk inverse: N = diag(beta_c) A_cc is strictly lower triangular (nilpotent), so (I + N)^-1 by
# doubling the block size in the parallel prep kernel (`_unit_lower_inverse`, which says why not the Neumann
# series by squaring nor forward substitution); X_c is saved for the backward.
#
# Precision (half-precision inputs): products take half operands with fp32 accumulation, as in
# FlashAttention, except the recurrence's inter-chunk products, whose rounding every later u inherits:
# those are chosen by `rec` (`_mm_rec`; default: hi/lo split, ~16 bits). fp32 inputs: exact fp32 products.
#
# Backward, with M = I + diag(beta) A, U = M^-1 V, G = M^-T dU:
#   dV = G, found anti-causally: G_j = dU_j - sum_{i>j} A_ij beta_i G_i: the same wavefront, reversed
#   (`_bwd_g_kernel`), with G_c = X_c^T (dU_c - ...);
#   dA_ij = -beta_i <G_i, u_j>;  dbeta_i = -<G_i, h_i>;
#   softmax: dS_ij = A_ij (dA_ij - sum_j' A_ij' dA_ij') = A_ij (dA_ij + beta_i <G_i, h_i>);
#   relu: dS = dA [S > 0];  linear: dS = dA;  then dK = s dS^T W (`_dk_block`, parallel over column
#   chunks) and dW = s dS K (`_dw_block`, parallel over row chunks), launched by `_dk_dw_kernel`.

_KERNEL_IDS = {"softmax": 0, "relu": 1, "linear": 2}
_SPIN_LIMIT = 20_000_000  # ~10 s of spinning: only a bug gets there


def _triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_HAS_TRITON = _triton_available()  # a constant, so torch.compile does not trace an import

if _HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _read_progress(ptr, POLL: tl.constexpr):
        """*ptr with acquire semantics. POLL 0: an atomic read-modify-write (add 0), portable, also in the
        interpreter; POLL 1: a plain acquire load (PTX ld.acquire.gpu), which does not queue behind the
        other waiters' atomics on the same counter (a speed candidate, NVIDIA only)."""
        if POLL == 0:
            return tl.atomic_add(ptr, 0, sem="acquire")
        else:
            return tl.inline_asm_elementwise(
                "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
            )

    @triton.jit
    def _wait_progress(ptr, target, SPIN_LIMIT: tl.constexpr, POLL: tl.constexpr):
        """Spin until *ptr >= target (acquire); returns the last value seen (< target after SPIN_LIMIT)."""
        seen = _read_progress(ptr, POLL)
        tries = seen * 0
        while (seen < target) & (tries < SPIN_LIMIT):
            seen = _read_progress(ptr, POLL)
            tries += 1
        return seen

    @triton.jit
    def _mm(a, b, like, LOWP: tl.constexpr, PREC: tl.constexpr):
        """a @ b, fp32 accumulation; operands in the inputs' dtype (LOWP, as in FlashAttention) or fp32."""
        if LOWP:
            return tl.dot(a.to(like.dtype.element_ty), b.to(like.dtype.element_ty))
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)

    @triton.jit
    def _mm_rec(a, b_hi, b_lo, like, REC: tl.constexpr, PREC: tl.constexpr):
        """a @ b for the recurrence's inter-chunk products (A @ u forward, A^T (beta G) backward), fp32
        accumulation; a is fp32 (kappa values), b comes as the halves its producer stored (`_store_split`).
        Their rounding errors are fed back into every later u (or G), and where updates are near reflections
        |u| grows and the errors with it (tests/test_deltaformer.py, reflection regime), hence a choice:
        REC 0 ("lowp"): half operands a_hi b_hi (cheapest; bf16 misses 1e-2 there);
        REC 1: fp32 operands at PREC (fp32 inputs: b_hi is fp32);
        REC 2 ("split", default): a_hi b_hi + a_hi b_lo + a_lo b_hi with hi + lo halves of each operand in
        the inputs' half dtype (~16 mantissa bits at half-precision tensor-core speed). b's halves are
        split once by its producer, not again by every consumer."""
        if REC == 0:
            return tl.dot(a.to(like.dtype.element_ty), b_hi)
        elif REC == 1:
            return tl.dot(a.to(tl.float32), b_hi.to(tl.float32), input_precision=PREC)
        else:
            a_hi = a.to(like.dtype.element_ty)
            a_lo = (a - a_hi.to(tl.float32)).to(like.dtype.element_ty)
            return tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)))

    @triton.jit
    def _store_split(HI, LO, offs, x, mask, STORE_LO: tl.constexpr):
        """fp32 x stored as hi = x in HI's dtype and, with STORE_LO, lo = (x - hi) in LO's: for half dtypes
        hi + lo keeps ~16 mantissa bits, read by `_mm_rec` (split) and by fp32 operands (`_load_value`)."""
        hi = x.to(HI.dtype.element_ty)
        tl.store(HI + offs, hi, mask=mask)
        if STORE_LO:
            tl.store(LO + offs, (x - hi.to(tl.float32)).to(LO.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_value(HI, LO, offs, mask, LOWP: tl.constexpr, HAS_LO: tl.constexpr):
        """A value operand of dK / dW (u or beta G) as stored by `_store_split`: hi for half operands (LOWP),
        else fp32 hi + lo."""
        x = tl.load(HI + offs, mask=mask, other=0.0)
        if HAS_LO and not LOWP:  # (one return statement: Triton 3.6 rejects returns of two dtypes)
            x = x.to(tl.float32) + tl.load(LO + offs, mask=mask, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _load_cg(ptr, mask):
        """A load past the (incoherent) L1, of data another program of this launch wrote; masked (0) unless
        mask is None."""
        if mask is None:
            x = tl.load(ptr, cache_modifier=".cg")
        else:
            x = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
        return x

    @triton.jit
    def _scores(a, B, mask, scale, PREC: tl.constexpr):
        """scale * a @ b^T with the block b loaded at pointers B (masked rows 0 unless mask is None)."""
        if mask is None:
            b = tl.load(B)
        else:
            b = tl.load(B, mask=mask, other=0.0)
        return tl.dot(a, tl.trans(b), input_precision=PREC) * scale

    @triton.jit
    def _load_published(HI, LO, offs, mask, WITH_LO: tl.constexpr):
        """A block another tile of this launch published (u, or beta G) as (hi, lo); lo only WITH_LO (else
        hi again)."""
        hi = _load_cg(HI + offs, mask)
        lo = hi
        if WITH_LO:
            lo = _load_cg(LO + offs, mask)
        return hi, lo

    @triton.jit
    def _kappa(s, valid, lse, KERNEL: tl.constexpr):
        """The first-stage kernel on a block of scaled scores; 0 where not valid. lse: [rows] (softmax)."""
        if KERNEL == 0:
            return tl.exp(tl.where(valid, s - lse[:, None], float("-inf")))
        elif KERNEL == 1:
            return tl.where(valid, tl.maximum(s, 0.0), 0.0)
        else:
            return tl.where(valid, s, 0.0)

    @triton.jit
    def _dscores(a, s, da, rowterm, valid, KERNEL: tl.constexpr):
        """dS from dA for one block: softmax A (dA + rowterm), relu dA [S > 0], linear dA; 0 if not valid."""
        if KERNEL == 0:
            return a * (da + rowterm[:, None])
        elif KERNEL == 1:
            return tl.where(valid & (s > 0), da, 0.0)
        else:
            return tl.where(valid, da, 0.0)

    @triton.jit
    def _dot_x(a, b, PREC: tl.constexpr):
        """fp32 a @ b for the in-chunk inverse and its products: tl.dot at PREC ("ieee", "tf32", "tf32x3"), or
        PREC "bf16x3": a_hi b_hi + a_hi b_lo + a_lo b_hi with bf16 halves (~16 mantissa bits, like the
        recurrence's split; half-precision tensor-core rate and operand traffic, a speed candidate)."""
        if PREC == "bf16x3":
            a_hi = a.to(tl.bfloat16)
            b_hi = b.to(tl.bfloat16)
            a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
            b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
            return tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)))
        else:
            return tl.dot(a, b, input_precision=PREC)

    @triton.jit
    def _unit_lower_inverse(n, C: tl.constexpr, PREC: tl.constexpr):
        """(I + n)^-1 for strictly lower triangular n [C, C] (C a power of two), by doubling the block size:
        let Y_b be the inverse of the block-diagonal part of I + n in [b, b] blocks (Y_1 = I). A [2b, 2b]
        block is [[A, 0], [E, B]], with inverse [[A^-1, 0], [-B^-1 E A^-1, B^-1]], so Y_2b = Y_b - Y_b E_b Y_b
        with E_b the entries of n in the lower-left quarter of every [2b, 2b] block: log2(C) steps of two
        [C, C] products (tensor cores). Like forward substitution, it only multiplies by final entries of
        the inverse (with fp32 or 3-pass tf32 products, the default, as accurate in the tests; with plain
        tf32 products, rec="lowp", its error is ~2x substitution's in a float64 emulation of the roundings);
        not the Neumann series by squaring ((I - n)(I + n^2)(I + n^4)...), exact in exact
        arithmetic but where beta * kappa ~ 1-2 (a token's update is a reflection, the regime state
        tracking needs) the powers of n grow huge and cancel: fp32 lost up to 7e-2 of u at C = 64
        (tests/test_deltaformer.py, reflection regime). Forward substitution row by row and by 16-row
        blocks is as accurate but slow: C - 1 or 15 dependent steps of cross-warp reductions, measured 123
        of the prep kernel's 179 us at 8,12,1024,64 on an H200. The levels b < 16 only touch the [16, 16]
        diagonal blocks, so they run as batched [C / 16, 16, 16] products (C / 16 times fewer MACs; f+b
        -55 us at 8,12,1024,64 and -30 us at 8,6,1024,128 against [C, C] products)."""
        if C > 16:  # levels b < 16 on the [16, 16] diagonal blocks alone, then the rest
            d = _diagonal_blocks(n, C)
            y = _block_diagonal(_doubling_levels(d, d, 16, 0, PREC, True), C)
            y = _doubling_levels(n, y, C, 4, PREC, False)
        else:
            y = _doubling_levels(n, n, C, 0, PREC, False)
        return y

    @triton.jit
    def _doubling_levels(
        n, y, C: tl.constexpr, FIRST: tl.constexpr, PREC: tl.constexpr, BATCHED: tl.constexpr
    ):  # fmt: skip
        """Y_2b = Y_b - Y_b E_b Y_b for b = 2^FIRST, ... < C, on [C, C] tiles or (BATCHED) [G, C, C]; y is
        the inverse for b = 2^FIRST. FIRST 0: y is ignored; Y_2 = I - E_1 (Y_1 = I: no products) and the
        products start at b = 2."""
        offs = tl.arange(0, C)
        if BATCHED:
            r, c = offs[None, :, None], offs[None, None, :]
        else:
            r, c = offs[:, None], offs[None, :]
        if FIRST == 0:
            y = tl.where(r == c, 1.0, 0.0) - tl.where((r % 2 == 1) & (c == r - 1), n, 0.0)
        for level in tl.static_range(1, 7):  # block size b = 2^level; C <= 128
            if (1 << level) < C and level >= FIRST:
                same = r >> (level + 1) == c >> (level + 1)  # in the same [2b, 2b] block
                quarter = same & ((r >> level) % 2 == 1) & ((c >> level) % 2 == 0)
                e = tl.where(quarter, n, 0.0)
                y = y - _dot_x(y, _dot_x(e, y, PREC), PREC)
        return y

    @triton.jit
    def _diagonal_blocks(n, C: tl.constexpr):
        """The [16, 16] diagonal blocks of n [C, C] as [C // 16, 16, 16]."""
        G: tl.constexpr = C // 16
        n4 = tl.reshape(n, (G, 16, G, 16))  # n4[g, r, h, c] = n[16 g + r, 16 h + c]
        g = tl.arange(0, G)
        same = g[:, None, None, None] == g[None, None, :, None]
        return tl.sum(tl.where(same, n4, 0.0), axis=2)

    @triton.jit
    def _block_diagonal(y3, C: tl.constexpr):
        """[C, C] with the blocks y3 [C // 16, 16, 16] on the diagonal, 0 elsewhere."""
        G: tl.constexpr = C // 16
        g = tl.arange(0, G)
        same = g[:, None, None, None] == g[None, None, :, None]
        y4 = tl.where(same, tl.expand_dims(y3, 2), 0.0)  # [G, 16, G, 16]
        return tl.reshape(y4, (C, C))

    @triton.jit
    def _prep_kernel(
        W, K, Beta, LSE, Xinv, scale, T, NC,
        KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr,
        LSE_READY: tl.constexpr,
    ):  # fmt: skip
        """Chunk c of head bh: the softmax lse of its rows over every j < i (unless LSE_READY: then
        `_lse_kernel` stored it), and X_c (section comment)."""
        c = NC - 1 - tl.program_id(0)  # the longest rows (most earlier chunks) first: a shorter tail
        bh = tl.program_id(1).to(tl.int64)
        offs_c = tl.arange(0, C)
        offs_d = tl.arange(0, D)
        rows = c * C + offs_c
        rmask = rows < T
        tile = bh * T * D + rows[:, None] * D + offs_d[None, :]
        w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
        k_c = tl.load(K + tile, mask=rmask[:, None], other=0.0)
        b = tl.load(Beta + bh * T + rows, mask=rmask, other=0.0).to(tl.float32)
        lower = offs_c[:, None] > offs_c[None, :]
        s_cc = tl.dot(w, tl.trans(k_c), input_precision=PREC) * scale
        lse = tl.zeros((C,), dtype=tl.float32)
        if KERNEL == 0 and LSE_READY:
            lse = tl.load(LSE + bh * T + rows, mask=rmask, other=0.0)
        elif KERNEL == 0:
            m = tl.full((C,), -1e30, dtype=tl.float32)
            l = tl.zeros((C,), dtype=tl.float32)
            m, l = _lse_update(m, l, tl.where(lower, s_cc, float("-inf")))
            for cp in range(0, c):
                keys = K + bh * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
                m, l = _lse_update(m, l, _scores(w, keys, None, scale, PREC))
            lse = _lse_of(m, l)
            tl.store(LSE + bh * T + rows, lse, mask=rmask)
        a_cc = _kappa(s_cc, lower, lse, KERNEL)
        x = _unit_lower_inverse(b[:, None] * a_cc, C, XPREC)
        tl.store(Xinv + (bh * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :], x)

    @triton.jit
    def _lse_update(m, l, s):
        """Online softmax statistics: the running row max m (finite) and sum l of exp(s - m) after one more
        block of scores s (-inf where not a j < i)."""
        m_new = tl.maximum(m, tl.max(s, axis=1))
        return m_new, l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)

    @triton.jit
    def _lse_of(m, l):
        """The log-sum-exp from the online statistics; -1e30 for a row with no j < i (row 0)."""
        return m + tl.log(tl.where(l > 0, l, 1.0))

    @triton.jit
    def _lse_kernel(
        W, K, LSE, scale, T, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """The softmax lse of every row i over j < i on its own, FlashAttention-style (TUNING["lse_kernel"],
        a speed candidate: in prep it costs 63 us at 8,12,1024,64, more than cuDNN's whole forward): BM rows
        per program, keys in blocks of BN, the longest rows first."""
        mb = tl.cdiv(T, BM) - 1 - tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        rows = mb * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        w = tl.load(W + bh * T * D + rows[:, None] * D + offs_d[None, :], mask=(rows < T)[:, None], other=0.0)
        m = tl.full((BM,), -1e30, dtype=tl.float32)
        l = tl.zeros((BM,), dtype=tl.float32)
        for start in range(0, mb * BM, BN):  # keys before the block's first row: every j < i
            keys = K + bh * T * D + (start + tl.arange(0, BN))[:, None] * D + offs_d[None, :]
            m, l = _lse_update(m, l, _scores(w, keys, None, scale, PREC))
        for start in range(mb * BM, tl.minimum(mb * BM + BM, T), BN):  # the diagonal blocks: masked
            cols = start + tl.arange(0, BN)
            keys = K + bh * T * D + cols[:, None] * D + offs_d[None, :]
            s = _scores(w, keys, (cols < T)[:, None], scale, PREC)
            m, l = _lse_update(m, l, tl.where(cols[None, :] < rows[:, None], s, float("-inf")))
        tl.store(LSE + bh * T + rows, _lse_of(m, l), mask=rows < T)

    @triton.jit
    def _fwd_kernel(
        W, K, V, Beta, U, ULO, Hs, LSE, Xinv, Prog, Ticket, scale, T, NC, BH,
        KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, REC: tl.constexpr, PREC: tl.constexpr,
        XPREC: tl.constexpr, STORE_LO: tl.constexpr, SPIN_LIMIT: tl.constexpr, POLL: tl.constexpr,
        LATE: tl.constexpr,
    ):  # fmt: skip
        """The wavefront tile of chunk c, head bh (see the section comment)."""
        ticket = tl.atomic_add(Ticket, 1)
        c = ticket // BH
        bh = ticket % BH
        bh64 = bh.to(tl.int64)
        offs_c = tl.arange(0, C)
        offs_d = tl.arange(0, D)
        rows = c * C + offs_c
        rmask = rows < T
        tile = bh64 * T * D + rows[:, None] * D + offs_d[None, :]
        w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
        lse = tl.zeros((C,), dtype=tl.float32)
        if KERNEL == 0:
            lse = tl.load(LSE + bh64 * T + rows, mask=rmask, other=0.0)
        everything = offs_c[:, None] >= 0  # earlier chunks: every j < i
        xt = Xinv + (bh64 * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :]
        if not LATE:  # loaded before the waits (off the critical path, but live in registers through them)
            b = tl.load(Beta + bh64 * T + rows, mask=rmask, other=0.0).to(tl.float32)
            v = tl.load(V + tile, mask=rmask[:, None], other=0.0).to(tl.float32)
            x = tl.load(xt)
        acc = tl.zeros((C, D), dtype=tl.float32)
        SPLIT: tl.constexpr = REC == 2
        done = c * 0  # earlier chunks consumed
        ok = done + 1
        while done < c:  # consume chunks as they are published
            seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT, POLL)
            ok = ok & (seen > done).to(tl.int32)
            ready = tl.where(seen > done, tl.minimum(seen, c), c)
            for cp in range(done, ready):
                prev = bh64 * T * D + (cp * C + offs_c)[:, None] * D + offs_d[None, :]
                p = _kappa(_scores(w, K + prev, None, scale, PREC), everything, lse, KERNEL)
                u_hi, u_lo = _load_published(U, ULO, prev, None, SPLIT)
                acc += _mm_rec(p, u_hi, u_lo, W, REC, PREC)
            done = ready
        if LATE:
            b = tl.load(Beta + bh64 * T + rows, mask=rmask, other=0.0).to(tl.float32)
            v = tl.load(V + tile, mask=rmask[:, None], other=0.0).to(tl.float32)
            x = tl.load(xt)
        u = _dot_x(x, v - b[:, None] * acc, XPREC)
        u = tl.where(ok != 0, u, float("nan"))
        _store_split(U, ULO, tile, u, rmask[:, None], STORE_LO)
        tl.debug_barrier()  # every thread's stores precede the release below
        tl.atomic_xchg(Prog + bh, c + 1, sem="release")
        # off the critical path: h = sum_{j<i} A_ij u_j, for the backward
        k_c = tl.load(K + tile, mask=rmask[:, None], other=0.0)
        s_cc = tl.dot(w, tl.trans(k_c), input_precision=PREC) * scale
        a_cc = _kappa(s_cc, offs_c[:, None] > offs_c[None, :], lse, KERNEL)
        h = acc + tl.dot(a_cc, u, input_precision=PREC)
        tl.store(Hs + tile, h, mask=rmask[:, None])

    @triton.jit
    def _bwd_g_kernel(
        W, K, DU, Beta, Hs, LSE, Xinv, GB, GBLO, DV, DBeta, RT, Prog, Ticket, U, ULO, DK, scale, T, NC, BH,
        KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, REC: tl.constexpr, PREC: tl.constexpr,
        XPREC: tl.constexpr, STORE_LO: tl.constexpr, SPIN_LIMIT: tl.constexpr, POLL: tl.constexpr,
        LATE: tl.constexpr, DKW: tl.constexpr, LOWP: tl.constexpr, HAS_LO: tl.constexpr,
    ):  # fmt: skip
        """G_c for one column chunk c (see the section comment). DKW (TUNING["dk_in_wavefront"]): also
        dK_c = s sum_{i >= c} dS_ic^T w_i, from the S and A of the pairs this program forms anyway (then
        the dK pass is not launched; a chunk's row term is stored before its release, as its readers are
        in this launch)."""
        ticket = tl.atomic_add(Ticket, 1)
        c = NC - 1 - ticket // BH  # last chunk first
        bh = ticket % BH
        bh64 = bh.to(tl.int64)
        offs_c = tl.arange(0, C)
        offs_d = tl.arange(0, D)
        cols = c * C + offs_c
        cmask = cols < T
        tile = bh64 * T * D + cols[:, None] * D + offs_d[None, :]
        k_c = tl.load(K + tile, mask=cmask[:, None], other=0.0)
        xt = Xinv + (bh64 * NC + c) * C * C + offs_c[:, None] * C + offs_c[None, :]
        if not LATE:
            x = tl.load(xt)
            du_c = tl.load(DU + tile, mask=cmask[:, None], other=0.0).to(tl.float32)
            b_c = tl.load(Beta + bh64 * T + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros((C, D), dtype=tl.float32)  # sum_{i in later chunks} A_ij beta_i G_i
        dk = tl.zeros((C, D), dtype=tl.float32)
        if DKW:
            u_c = _load_value(U, ULO, tile, cmask[:, None], LOWP, HAS_LO)
        WITH_LO: tl.constexpr = REC == 2 or (DKW and HAS_LO and not LOWP)  # the split, or dA's fp32 operand
        done = c * 0  # later chunks consumed, counted from the end
        ok = done + 1
        while done < NC - 1 - c:
            seen = _wait_progress(Prog + bh, done + 1, SPIN_LIMIT, POLL)
            ok = ok & (seen > done).to(tl.int32)
            ready = tl.where(seen > done, tl.minimum(seen, NC - 1 - c), NC - 1 - c)
            for it in range(done, ready):
                rows = (NC - 1 - it) * C + offs_c  # a later chunk, in the order they were published
                rmask = rows < T
                later = bh64 * T * D + rows[:, None] * D + offs_d[None, :]
                w_r, s, a = _later_scores(W, LSE, later, bh64 * T + rows, rmask, k_c, scale, C, KERNEL, PREC)
                gb_hi, gb_lo = _load_published(GB, GBLO, later, rmask[:, None], WITH_LO)
                acc += _mm_rec(tl.trans(a), gb_hi, gb_lo, W, REC, PREC)
                if DKW:
                    ds = _pair_ds(a, s, gb_hi, gb_lo, u_c, RT, bh64 * T + rows, rmask, W,
                                  C, KERNEL, LOWP, HAS_LO, PREC)  # fmt: skip
                    dk += _mm(tl.trans(ds), w_r, W, LOWP, PREC)
            done = ready
        if LATE:
            x = tl.load(xt)
            du_c = tl.load(DU + tile, mask=cmask[:, None], other=0.0).to(tl.float32)
            b_c = tl.load(Beta + bh64 * T + cols, mask=cmask, other=0.0).to(tl.float32)
        g_c = _dot_x(tl.trans(x), du_c - acc, XPREC)
        g_c = tl.where(ok != 0, g_c, float("nan"))
        gb_c = g_c * b_c[:, None]
        _store_split(GB, GBLO, tile, gb_c, cmask[:, None], STORE_LO)
        if DKW:  # the other tiles' dK reads this chunk's row term: before the release
            h_c, rt_c = _row_term(Hs, RT, tile, bh64 * T + cols, gb_c, cmask)
        tl.debug_barrier()
        tl.atomic_xchg(Prog + bh, NC - c, sem="release")
        # off the critical path
        tl.store(DV + tile, g_c.to(DV.dtype.element_ty), mask=cmask[:, None])
        if not DKW:
            h_c, rt_c = _row_term(Hs, RT, tile, bh64 * T + cols, gb_c, cmask)
        tl.store(DBeta + bh64 * T + cols, (-tl.sum(g_c * h_c, axis=1)).to(DBeta.dtype.element_ty), mask=cmask)
        if DKW:  # the diagonal block: rows and columns in chunk c, j < i
            w_c = tl.load(W + tile, mask=cmask[:, None], other=0.0)
            lse_c = tl.zeros((C,), dtype=tl.float32)
            if KERNEL == 0:
                lse_c = tl.load(LSE + bh64 * T + cols, mask=cmask, other=0.0)
            gb_own = gb_c
            if LOWP:  # as the dK pass reads it: the stored half
                gb_own = gb_c.to(W.dtype.element_ty)
            ds = _dscores_block(
                w_c, gb_own, lse_c, rt_c, cols, k_c, u_c, cols, T, scale, W, KERNEL, LOWP, PREC
            )  # fmt: skip
            dk += _mm(tl.trans(ds), w_c, W, LOWP, PREC)
            tl.store(DK + tile, (dk * scale).to(DK.dtype.element_ty), mask=cmask[:, None])

    @triton.jit
    def _later_scores(
        W, LSE, later, rowoffs, rmask, k_c, scale,
        C: tl.constexpr, KERNEL: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """For a later row chunk of the backward wavefront: (w_r, S, A) against this tile's columns k_c."""
        w_r = tl.load(W + later, mask=rmask[:, None], other=0.0)
        lse_r = tl.zeros((C,), dtype=tl.float32)
        if KERNEL == 0:
            lse_r = tl.load(LSE + rowoffs, mask=rmask, other=0.0)
        s = tl.dot(w_r, tl.trans(k_c), input_precision=PREC) * scale  # [rows i, cols j]
        return w_r, s, _kappa(s, rmask[:, None], lse_r, KERNEL)

    @triton.jit
    def _pair_ds(
        a, s, gb_hi, gb_lo, u_c, RT, rowoffs, rmask, W,
        C: tl.constexpr, KERNEL: tl.constexpr, LOWP: tl.constexpr, HAS_LO: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """dS of one (later row chunk, chunk c) pair of the wavefront (DKW), dA = -(beta G_r) u_c^T; the row
        term read past L1."""
        rt_r = tl.zeros((C,), dtype=tl.float32)
        if KERNEL == 0:
            rt_r = tl.load(RT + rowoffs, mask=rmask, other=0.0, cache_modifier=".cg")
        gb_r = gb_hi
        if HAS_LO and not LOWP:
            gb_r = gb_hi.to(tl.float32) + gb_lo.to(tl.float32)
        da = -_mm(gb_r, tl.trans(u_c), W, LOWP, PREC)
        return _dscores(a, s, da, rt_r, rmask[:, None], KERNEL)

    @triton.jit
    def _row_term(Hs, RT, tile, rowoffs, gb_c, cmask):
        """Loads h of a chunk's rows, stores their row term beta_i <G_i, h_i>; returns (h, term)."""
        h_c = tl.load(Hs + tile, mask=cmask[:, None], other=0.0)
        rt_c = tl.sum(gb_c * h_c, axis=1)
        tl.store(RT + rowoffs, rt_c, mask=cmask)
        return h_c, rt_c

    @triton.jit
    def _load_rows(
        W, GB, GBLO, LSE, RT, bh, T, rows,
        D: tl.constexpr, C: tl.constexpr, KERNEL: tl.constexpr, LOWP: tl.constexpr, HAS_LO: tl.constexpr,
    ):  # fmt: skip
        """What dS needs of a block of rows i: w_i, beta_i G_i and, for softmax, lse_i and the row term."""
        rmask = rows < T
        tile = bh * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
        w = tl.load(W + tile, mask=rmask[:, None], other=0.0)
        gb = _load_value(GB, GBLO, tile, rmask[:, None], LOWP, HAS_LO)
        lse = tl.zeros((C,), dtype=tl.float32)
        rt = tl.zeros((C,), dtype=tl.float32)
        if KERNEL == 0:
            lse = tl.load(LSE + bh * T + rows, mask=rmask, other=0.0)
            rt = tl.load(RT + bh * T + rows, mask=rmask, other=0.0)
        return w, gb, lse, rt

    @triton.jit
    def _load_cols(K, U, ULO, bh, T, cols, D: tl.constexpr, LOWP: tl.constexpr, HAS_LO: tl.constexpr):
        """What dS needs of a block of columns j: k_j and u_j."""
        tile = bh * T * D + cols[:, None] * D + tl.arange(0, D)[None, :]
        cmask = (cols < T)[:, None]
        return tl.load(K + tile, mask=cmask, other=0.0), _load_value(U, ULO, tile, cmask, LOWP, HAS_LO)

    @triton.jit
    def _dscores_block(
        w_r, gb_r, lse_r, rt_r, rows, k_c, u_c, cols, T, scale, W,
        KERNEL: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """dS of a block of rows i against a block of columns j (0 unless j < i < T): S and A recomputed,
        dA_ij = -beta_i <G_i, u_j>."""
        valid = (rows[:, None] > cols[None, :]) & (rows < T)[:, None]
        s = tl.dot(w_r, tl.trans(k_c), input_precision=PREC) * scale
        a = _kappa(s, valid, lse_r, KERNEL)
        da = -_mm(gb_r, tl.trans(u_c), W, LOWP, PREC)
        return _dscores(a, s, da, rt_r, valid, KERNEL)

    @triton.jit
    def _dk_block(
        W, K, U, ULO, GB, GBLO, LSE, RT, DK, scale, T, NC, c, bh,
        KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
        HAS_LO: tl.constexpr,
    ):  # fmt: skip
        """dK_j = s sum_{i > j} dS_ij w_i for a block c of columns j, over the row blocks from its own on."""
        cols = c * C + tl.arange(0, C)
        k_c, u_c = _load_cols(K, U, ULO, bh, T, cols, D, LOWP, HAS_LO)
        dk = tl.zeros((C, D), dtype=tl.float32)
        for cp in range(c, NC):
            rows = cp * C + tl.arange(0, C)
            w_r, gb_r, lse_r, rt_r = _load_rows(W, GB, GBLO, LSE, RT, bh, T, rows, D, C, KERNEL, LOWP, HAS_LO)
            ds = _dscores_block(w_r, gb_r, lse_r, rt_r, rows, k_c, u_c, cols, T, scale, W, KERNEL, LOWP, PREC)
            dk += _mm(tl.trans(ds), w_r, W, LOWP, PREC)
        tile = bh * T * D + cols[:, None] * D + tl.arange(0, D)[None, :]
        tl.store(DK + tile, (dk * scale).to(DK.dtype.element_ty), mask=(cols < T)[:, None])

    @triton.jit
    def _dw_block(
        W, K, U, ULO, GB, GBLO, LSE, RT, DW, scale, T, c, bh,
        KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
        HAS_LO: tl.constexpr,
    ):  # fmt: skip
        """dW_i = s sum_{j < i} dS_ij k_j for one block c of rows i, over the column blocks up to its own."""
        rows = c * C + tl.arange(0, C)
        w_c, gb_c, lse_c, rt_c = _load_rows(W, GB, GBLO, LSE, RT, bh, T, rows, D, C, KERNEL, LOWP, HAS_LO)
        dw = tl.zeros((C, D), dtype=tl.float32)
        for cp in range(0, c + 1):
            cols = cp * C + tl.arange(0, C)
            k_p, u_p = _load_cols(K, U, ULO, bh, T, cols, D, LOWP, HAS_LO)
            ds = _dscores_block(w_c, gb_c, lse_c, rt_c, rows, k_p, u_p, cols, T, scale, W, KERNEL, LOWP, PREC)
            dw += _mm(ds, k_p, W, LOWP, PREC)
        tile = bh * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
        tl.store(DW + tile, (dw * scale).to(DW.dtype.element_ty), mask=(rows < T)[:, None])

    @triton.jit
    def _dk_dw_kernel(
        W, K, U, ULO, GB, GBLO, LSE, RT, DK, DW, scale, T, NC,
        KERNEL: tl.constexpr, D: tl.constexpr, C: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
        HAS_LO: tl.constexpr, ROLE: tl.constexpr,
    ):  # fmt: skip
        """ROLE 0: dK over column blocks, 1: dW over row blocks; grid (NC, BH), the longest blocks first (dK's
        first columns, dW's last rows): a shorter tail. Two launches: both roles in one launch (programs
        interleaved) cost relu 90 us more at 8,6,1024,128 on an H200 (why is not known)."""
        i = tl.program_id(0)  # the i-th longest block of its role
        bh = tl.program_id(1).to(tl.int64)
        if ROLE == 0:
            _dk_block(
                W, K, U, ULO, GB, GBLO, LSE, RT, DK, scale, T, NC, i, bh, KERNEL, D, C, LOWP, PREC, HAS_LO,
            )  # fmt: skip
        else:
            _dw_block(
                W, K, U, ULO, GB, GBLO, LSE, RT, DW, scale, T, NC - 1 - i, bh,
                KERNEL, D, C, LOWP, PREC, HAS_LO,
            )  # fmt: skip


RECS = ("lowp", "split")  # precision of the recurrence's inter-chunk products for half inputs (`_mm_rec`)
DEFAULT_REC = "split"  # fp32 inputs always get exact fp32 products


def _triton_cfg(x, chunk, lowp, rec):
    """Validated settings: (prec, xprec, lowp, rec id, store_lo, launch options)."""
    D = x.shape[-1]
    if D not in (16, 32, 64, 128):
        raise ValueError(f"deltaformer (triton): head dim D must be 16, 32, 64 or 128, got {D}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"deltaformer (triton): dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if chunk not in (16, 32, 64, 128):
        raise ValueError(f"deltaformer (triton): chunk must be 16, 32, 64 or 128, got {chunk}")
    if rec not in RECS:
        raise ValueError(f"deltaformer (triton): rec must be one of {RECS}, got {rec!r}")
    # fp32 inputs: every product in exact fp32. Half-precision inputs: fp32 accumulation; half operands in
    # the non-recurrent O(T^2) products (dK, dW) as FlashAttention (unless lowp=False: tf32 operands from
    # the stored hi + lo halves); the recurrence's products as `rec` says; the in-chunk inverse and its
    # products in tf32, or in 3-pass tf32 (~fp32) with rec="split", so that they do not undo its accuracy.
    if x.dtype == torch.float32:
        return "ieee", "ieee", False, 1, False, _launch(D, chunk, lowp=False)
    xprec = (TUNING["xprec"] or "tf32x3") if rec == "split" else "tf32"
    store_lo = rec == "split" or not lowp  # u and beta G stored as hi + lo halves (`_store_split`)
    return "tf32", xprec, lowp, RECS.index(rec) * 2, store_lo, _launch(D, chunk, lowp)


# Benchmark switches (bench/bench_attention.py --variants sets them; read at launch time, not traced):
# poll: 0 atomic / 1 acquire-load polling (`_read_progress`); num_warps / num_stages: None = the defaults;
# late_loads: 1 = the wavefronts load their own chunk's X, v / dU, beta after the waits (fewer registers
# held through the consumption loop, one more load latency on the critical path); xprec: the in-chunk
# inverse's products and X @ rhs with half inputs and rec="split" (None = "tf32x3", or "bf16x3": `_dot_x`);
# dk_in_wavefront: 1 = dK accumulated by the backward wavefront (`_bwd_g_kernel` DKW), no dK pass; 0 = the
# dK pass; None = 1 at D <= 64 (f+b -49 us softmax, -32 relu at 8,12,1024,64), 0 at D = 128 (+80 and +77 us
# there: the wavefront's extra [C, D] accumulator and u tile; bench_attention.py --graph-variants).
# lse_kernel: 64 or 128 = the softmax lse by `_lse_kernel` with that many rows per program (64 / 128 rows:
# 4 / 8 warps) before prep, which then only forms X; 0 = inside prep.
TUNING = {
    "poll": 0, "num_warps": None, "num_stages": None, "late_loads": 0, "xprec": None,
    "dk_in_wavefront": None, "lse_kernel": 0,
}  # fmt: skip


def _launch(D, chunk, lowp):
    """Launch options of every kernel (the dK kernel defaults to num_stages=2: 131 -> 104 us at 8,12,1024,64,
    where two stages cost the wavefronts 4%; bench_attention.py --kernel-profile)."""
    launch = dict(num_warps=4 if chunk <= 64 else 8)  # D = 128 too: 8 warps cost 1.19 vs 0.78 ms f+b
    if D == 128 or not lowp:
        launch["num_stages"] = 2  # fp32 or D = 128 tiles: three stages overflow shared memory
    launch.update({key: TUNING[key] for key in ("num_warps", "num_stages") if TUNING[key] is not None})
    return launch


def _device_guard(x):
    """Launch on the inputs' device, whatever the current one is."""
    import contextlib

    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# The kernels are wrapped as torch.library custom ops (forward and backward each one op, the autograd
# formula registered on the forward) so that torch.compile treats them as opaque calls with known output
# shapes (register_fake) instead of tracing into the Triton launches, which broke Inductor before.
# u_lo (the low half of u, `_store_split`) is empty unless rec="split" or lowp=False with half inputs.


def _has_lo(dtype, rec, lowp):
    return dtype != torch.float32 and (rec == "split" or not lowp)


def _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp, rec):
    """Launch the forward kernels: (u, u_lo, h, lse, xinv), what the backward needs."""
    B, H, T, D = v.shape
    BH, NC, C = B * H, triton.cdiv(T, chunk), chunk
    prec, xprec, lowp, rec_id, store_lo, launch = _triton_cfg(v, chunk, lowp, rec)
    k, v, w, beta = (x.contiguous() for x in (k, v, w, beta))
    f32 = dict(device=v.device, dtype=torch.float32)
    u = v.new_empty(v.shape)  # contiguous (v is, here), as the fake says
    u_lo = v.new_empty(v.shape) if store_lo else v.new_empty(0)
    h = torch.empty(B, H, T, D, **f32)
    lse = torch.empty(B, H, T, **f32) if kernel == "softmax" else torch.zeros(1, **f32)  # placeholder
    xinv = torch.empty(BH, NC, C, C, **f32)
    kid = _KERNEL_IDS[kernel]
    counters = torch.zeros(BH + 1, device=v.device, dtype=torch.int32)  # progress per (b, h); the ticket
    lse_block = TUNING["lse_kernel"] if kernel == "softmax" else 0
    with _device_guard(v):
        if lse_block:
            _lse_kernel[(triton.cdiv(T, lse_block), BH)](
                w, k, lse, scale, T, BM=lse_block, BN=64, D=D, PREC=prec, num_warps=lse_block // 16,
            )  # fmt: skip
        _prep_kernel[(NC, BH)](
            w, k, beta, lse, xinv, scale, T, NC, KERNEL=kid, D=D, C=C, PREC=prec, XPREC=xprec,
            LSE_READY=bool(lse_block), **launch,
        )  # fmt: skip
        _fwd_kernel[(BH * NC,)](
            w, k, v, beta, u, u_lo if store_lo else u, h, lse, xinv, counters, counters[BH:],
            scale, T, NC, BH, KERNEL=kid, D=D, C=C, REC=rec_id, PREC=prec, XPREC=xprec, STORE_LO=store_lo,
            SPIN_LIMIT=_SPIN_LIMIT, POLL=TUNING["poll"], LATE=TUNING["late_loads"], **launch,
        )  # fmt: skip
    return u, u_lo, h, lse, xinv


@torch.library.custom_op("deltaformer::u_fwd", mutates_args=())
def _u_fwd_op(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
    kernel: str, scale: float, chunk: int, lowp: bool, rec: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp, rec)


@_u_fwd_op.register_fake
def _(k, v, w, beta, kernel, scale, chunk, lowp, rec):
    B, H, T, D = v.shape
    NC = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    return (  # contiguous, like the real outputs (empty_like would copy the strides of a permuted v)
        v.new_empty((B, H, T, D)),
        v.new_empty((B, H, T, D) if _has_lo(v.dtype, rec, lowp) else (0,)),
        torch.empty(B, H, T, D, **f32),
        torch.empty((B, H, T) if kernel == "softmax" else (1,), **f32),
        torch.empty(B * H, NC, chunk, chunk, **f32),
    )


def _u_bwd(du, k, w, beta, u, u_lo, h, lse, xinv, kernel, scale, chunk, lowp, rec):
    """Launch the backward kernels: (dk, dv, dw, dbeta)."""
    B, H, T, D = k.shape
    BH, NC, C = B * H, triton.cdiv(T, chunk), chunk
    prec, xprec, lowp, rec_id, store_lo, launch = _triton_cfg(k, chunk, lowp, rec)
    kid = _KERNEL_IDS[kernel]
    k, w, beta, du = (x.contiguous() for x in (k, w, beta, du))
    gb = k.new_empty(k.shape)  # beta G, read by the backward recurrence and by dK / dW (+ its low half)
    gb_lo = k.new_empty(k.shape) if store_lo else gb
    u_lo = u_lo if store_lo else u
    dv = torch.empty(B, H, T, D, device=k.device, dtype=k.dtype)
    dk, dw = k.new_empty(k.shape), w.new_empty(w.shape)  # contiguous, as the fake says
    dbeta = torch.empty(B, H, T, device=k.device, dtype=beta.dtype)  # stored in beta's dtype: no cast kernel
    rowterm = torch.empty(B, H, T, device=k.device, dtype=torch.float32)
    counters = torch.zeros(BH + 1, device=k.device, dtype=torch.int32)
    dkw = D <= 64 if TUNING["dk_in_wavefront"] is None else bool(TUNING["dk_in_wavefront"])
    with _device_guard(k):
        _bwd_g_kernel[(BH * NC,)](
            w, k, du, beta, h, lse, xinv, gb, gb_lo, dv, dbeta, rowterm, counters, counters[BH:], u, u_lo, dk,
            scale, T, NC, BH, KERNEL=kid, D=D, C=C, REC=rec_id, PREC=prec, XPREC=xprec, STORE_LO=store_lo,
            SPIN_LIMIT=_SPIN_LIMIT, POLL=TUNING["poll"], LATE=TUNING["late_loads"], DKW=dkw, LOWP=lowp,
            HAS_LO=store_lo, **launch,
        )  # fmt: skip
        args = (w, k, u, u_lo, gb, gb_lo, lse, rowterm, dk, dw, scale, T, NC)
        consts = dict(KERNEL=kid, D=D, C=C, LOWP=lowp, PREC=prec, HAS_LO=store_lo)
        if not dkw:  # dK not already done by the wavefront
            _dk_dw_kernel[(NC, BH)](*args, **consts, ROLE=0, **{"num_stages": 2, **launch})
        _dk_dw_kernel[(NC, BH)](*args, **consts, ROLE=1, **launch)
    return dk, dv, dw, dbeta


@torch.library.custom_op("deltaformer::u_bwd", mutates_args=())
def _u_bwd_op(
    du: torch.Tensor, k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, u: torch.Tensor,
    u_lo: torch.Tensor, h: torch.Tensor, lse: torch.Tensor, xinv: torch.Tensor,
    kernel: str, scale: float, chunk: int, lowp: bool, rec: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _u_bwd(du, k, w, beta, u, u_lo, h, lse, xinv, kernel, scale, chunk, lowp, rec)


@_u_bwd_op.register_fake
def _(du, k, w, beta, u, u_lo, h, lse, xinv, kernel, scale, chunk, lowp, rec):
    return k.new_empty(k.shape), k.new_empty(k.shape), w.new_empty(w.shape), beta.new_empty(beta.shape)


def _u_setup(ctx, inputs, output):
    k, v, w, beta, kernel, scale, chunk, lowp, rec = inputs
    u, u_lo, h, lse, xinv = output
    ctx.save_for_backward(k, w, beta, u, u_lo, h, lse, xinv)
    ctx.cfg = (kernel, scale, chunk, lowp, rec)


def _u_grads(ctx, du, bwd):
    """The gradients of (k, v, w, beta, and the five non-tensor arguments) by bwd (`_u_bwd` or its op)."""
    return *bwd(du, *ctx.saved_tensors, *ctx.cfg), None, None, None, None, None


def _u_backward(ctx, du, *_unused):  # u_lo, h, lse, xinv are saved state, not differentiated
    return _u_grads(ctx, du, _u_bwd_op)


if _HAS_TRITON:
    torch.library.register_autograd("deltaformer::u_fwd", _u_backward, setup_context=_u_setup)


class _UStage(torch.autograd.Function):
    """The same forward and backward outside torch.compile: a custom op call costs ~0.1-0.2 ms of host time
    per forward+backward (dispatch, its autograd wrapper, Dynamo guards), as much as the GPU time of
    small inputs (bench_attention.py --overhead)."""

    @staticmethod
    def forward(ctx, k, v, w, beta, kernel, scale, chunk, lowp, rec):
        out = _u_fwd(k, v, w, beta, kernel, scale, chunk, lowp, rec)
        _u_setup(ctx, (k, v, w, beta, kernel, scale, chunk, lowp, rec), out)
        return out[0]

    @staticmethod
    def backward(ctx, du):
        return _u_grads(ctx, du, _u_bwd)


# Eager calls take _UStage unless this is set (bench_attention.py --overhead compares the two).
EAGER_CUSTOM_OP = False


def deltaformer_u_triton(k, v, w, beta, kernel="softmax", scale=None, chunk=64, lowp=None, rec=None):
    """Stage 1 by the Triton kernels: u [B, H, T, D] in v's dtype, differentiable in k, v, w, beta.

    chunk: rows per tile (power of two, 16..128). lowp: half-precision operands in the non-recurrent
    O(T^2) products of the backward (default: when the inputs are bf16/fp16). rec: precision of the
    recurrence's inter-chunk products for half inputs, one of RECS (default DEFAULT_REC). Both are
    benchmark knobs (bench/bench_attention.py --variants); fp32 inputs ignore them. scale: softmax kappa's
    (default 1/sqrt(D)); relu and linear ignore it: their kappa is that of unit k, w at scale 1, the norms
    folded into beta, v and u in PyTorch around the kernels (below).
    """
    if not _HAS_TRITON:
        raise ValueError("deltaformer: backend='triton' needs the triton package; use backend='torch'")
    if kernel not in KERNELS:
        raise ValueError(f"deltaformer: kernel must be one of {KERNELS}, got {kernel!r}")
    if not (k.dtype == v.dtype == w.dtype):
        raise ValueError(
            f"deltaformer (triton): k, v, w must share a dtype, got {k.dtype}, {v.dtype}, {w.dtype}"
        )
    rec = DEFAULT_REC if rec is None else rec
    _triton_cfg(v, chunk, lowp, rec)  # clear errors before any launch
    s = 1.0 / math.sqrt(k.shape[-1]) if scale is None else float(scale)
    half = v.dtype != torch.float32
    lowp = half if lowp is None else bool(lowp) and half
    if kernel == "softmax":
        return _u_stage(k, v, w, beta, kernel, s, chunk, lowp, rec)
    # relu / linear: kappa(w_i, k_j) = r_i kappa(w_i.k_j) c_j with r = 1 / |w|, c = 1 / |k| (`_inv_norm`),
    # so u = U~ / c with U~ the solution for the raw k, w at scale 1, v~ = c v and beta~ = beta r c (fp32):
    # the kernels score the inputs exactly. Unit vectors rounded to bf16 instead have kappa(k, k) =
    # 1 +- ~1e-3, which the reflection regime amplified to ~8e-3 of u at T = 512 (vs 1.7e-3 here: u's own
    # rounding); what remains is the rounding of v~, ~4e-4 of u before its final rounding.
    c = _inv_norm(k)
    r = c if w is k else _inv_norm(w)
    v_t = (v.to(c.dtype) * c).to(v.dtype)
    beta_t = beta.to(c.dtype) * (r * c)[..., 0]
    u_t = _u_stage(k, v_t, w, beta_t, kernel, 1.0, chunk, lowp, rec)
    return (u_t.to(c.dtype) / c).to(v.dtype)


def _u_stage(k, v, w, beta, kernel, scale, chunk, lowp, rec):
    """The Triton stage 1 of exactly these inputs (`scale * w.k` scores), differentiable."""
    if EAGER_CUSTOM_OP or torch.compiler.is_compiling():
        return _u_fwd_op(k, v, w, beta, kernel, scale, chunk, lowp, rec)[0]
    return _UStage.apply(k, v, w, beta, kernel, scale, chunk, lowp, rec)
