"""Where the bf16 error of the Triton Deltaformer u-stage comes from (issue 5), on the CPU.

    python bench/bf16_error_attribution.py                      # the tables in NOTES_deltaformer.md
    python bench/bf16_error_attribution.py --T 256 --kernels relu

A float64 emulation of what kernels/deltaformer.py (Triton path, bf16 inputs) plus stage 2 (SDPA,
FlashAttention-style) compute, forward and backward, written out by hand (not autograd) so that a bf16 /
tf32 rounding can be injected at any one point. Each point is named in ROUNDINGS. With no rounding the
emulation equals autograd on the float64 chunked path (checked at start, printed as "exact"); with the
rounding points the kernel has (KERNEL_POINTS) it reproduces the H200 errors of device run 4 (o, dq, dk,
dv, all rec values, to two digits). Inputs: the tests' reflection regime (tests/test_deltaformer.py,
reflection_inputs), rounded to bf16 for both sides; the error of o and of every gradient is
||ours - ref|| / ||ref|| against the float64 result on those inputs.

tf32 is modelled as truncation of fp32 to 10 explicit mantissa bits (the tensor cores' use of fp32
registers fed to a tf32 MMA; it reproduces the H200's rec="tf32" errors to two digits, round-to-nearest,
--tf32-round, does not); fp32 accumulation errors (~1e-7) are ignored: products are float64.
--triton: the Triton u-stage itself in the interpreter, patched to GPU-like dots (patch_interpreter_dots).
--key-noise 0.02: keys of one type no longer identical (which of a two-product split's halves matters
depends on it: rec_split_a / rec_split_b, NOTES_deltaformer.md V6). --digits 3: more digits.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():  # --triton runs the kernels in the interpreter (set before they load)
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch.nn.functional as F  # noqa: E402

from kernels.deltaformer import deltaformer_u_torch  # noqa: E402

NAMES = ("o", "q", "k", "v", "w", "beta")

ROUNDINGS = {
    "out": "o and the gradients stored in bf16 (dk: dk1 + dk2 summed, then rounded)",
    "acc_grads": "dk of stage 1 and of stage 2 each rounded to bf16 before autograd sums them (bf16)",
    "u_bf16": "u stored in bf16 for stage 2 (SDPA reads bf16 q, k, u)",
    "p2": "stage 2's P rounded to bf16 before P @ u (forward) and P^T dO (backward), as FlashAttention",
    "o_delta": "stage 2 backward's row term Delta = rowsum(dO * O) from the bf16 O",
    "ds2": "stage 2's dS rounded to bf16 before dQ = dS K, dK = dS^T Q",
    "du": "du (stage 2's gradient of u, SDPA's output) in bf16",
    "rec_lowp": "recurrence products A @ u, A^T (beta G): bf16 operands (rec='lowp')",
    "rec_tf32": "recurrence products: tf32 operands (rec='tf32')",
    "rec_split": "recurrence products: hi/lo bf16 split, 3 products (rec='split', the default)",
    "rec_split_b": "recurrence products: A bf16, value operand (u, beta G) split: a_hi b_hi + a_hi b_lo",
    "rec_split_a": "recurrence products: A split, value operand bf16: a_hi b_hi + a_lo b_hi",
    "x_tf32": "in-chunk products X @ rhs, X^T @ rhs with tf32 operands (rec lowp / tf32)",
    "xinv_tf32": "the blocked in-chunk inverse's block products in tf32 (prep kernel; rec lowp / tf32)",
    "h_tf32": "h = sum_j<i A_ij u_j: in-chunk part with tf32 operands (h feeds dbeta and softmax dS)",
    "gb_dA": "beta G rounded to bf16 in dA = -(beta G) u^T",
    "u_dA": "u rounded to bf16 in dA",
    "ds1": "stage 1's dS rounded to bf16 before dK = s dS^T W, dW = s dS K",
    "ds1_tf32": "stage 1's dS (and beta G, u) tf32 in dA, dK, dW (lowp=False)",
    "sdpa_out": "stage 2's outputs o, dq and its dk in bf16 (what a bf16 SDPA returns)",
    "s_tf32": "S = s W K^T with tf32 operands (bf16 inputs: exact, a check)",
    "x_bf16": "X (in-chunk inverse) rounded to bf16 (a stress point, not what the kernel does)",
}

SDPA_POINTS = ("out", "acc_grads", "u_bf16", "p2", "o_delta", "ds2", "du")  # stage 2 = SDPA, bf16
CUSTOM_STAGE2 = ("out", "acc_grads", "p2", "o_delta", "ds2")  # a fused stage 2 reading fp32 u
STAGE1_BWD = ("gb_dA", "u_dA", "ds1")
KERNEL_POINTS = {  # what the Triton path does for bf16 inputs, per `rec` (lowp=True, the default)
    "split": SDPA_POINTS + ("rec_split", "h_tf32") + STAGE1_BWD,
    "tf32": SDPA_POINTS + ("rec_tf32", "x_tf32", "xinv_tf32", "h_tf32") + STAGE1_BWD,
    "lowp": SDPA_POINTS + ("rec_lowp", "x_tf32", "xinv_tf32", "h_tf32") + STAGE1_BWD,
    # two-product splits (no kernel yet): as split (tf32x3 in-chunk products), one product fewer
    "split_b": SDPA_POINTS + ("rec_split_b", "h_tf32") + STAGE1_BWD,
    "split_a": SDPA_POINTS + ("rec_split_a", "h_tf32") + STAGE1_BWD,
}


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


TF32_MODE = {"round": False}  # --tf32-round: round to nearest instead of truncating


def tf32(x):
    """fp32 truncated (or rounded, TF32_MODE) to tf32 (10 explicit mantissa bits)."""
    bits = x.to(torch.float32).view(torch.int32)
    if TF32_MODE["round"]:
        bits = bits + 0xFFF + ((bits >> 13) & 1)
    return (bits & ~0x1FFF).view(torch.float32).to(torch.float64)


def split_mm(a, b):
    """a @ b as the kernel's rec='split': a_hi b_hi + a_hi b_lo + a_lo b_hi, halves in bf16 (fp32 a, b)."""
    a, b = a.float().double(), b.float().double()
    a_hi, b_hi = bf16(a), bf16(b)
    a_lo, b_lo = bf16(a - a_hi), bf16(b - b_hi)
    return a_hi @ b_hi + a_hi @ b_lo + a_lo @ b_hi


def split2_mm(a, b, half):
    """a @ b with two bf16 products: half "b" splits b only (a_hi b_hi + a_hi b_lo), "a" a only
    (a_hi b_hi + a_lo b_hi); the other operand is rounded to bf16 once (fp32 a, b)."""
    a, b = a.float().double(), b.float().double()
    a_hi, b_hi = bf16(a), bf16(b)
    if half == "b":
        return a_hi @ b_hi + a_hi @ bf16(b - b_hi)
    return a_hi @ b_hi + bf16(a - a_hi) @ b_hi


def blocked_inverse_tf32(n):
    """(I + n)^-1 as the prep kernel's `_unit_lower_inverse` with tf32 products: the block size doubles,
    Y_2b = Y_b - Y_b E_b Y_b (E_b: n in the lower-left quarter of every [2b, 2b] block), operands in tf32."""
    C = n.shape[-1]
    idx = torch.arange(C)
    r, c = idx[:, None], idx[None, :]
    y = torch.eye(C, dtype=n.dtype).expand_as(n).clone()
    b = 1
    while b < C:
        quarter = (r // (2 * b) == c // (2 * b)) & ((r // b) % 2 == 1) & ((c // b) % 2 == 0)
        e = torch.where(quarter, n, 0.0)
        y = y - tf32(y) @ tf32(tf32(e) @ tf32(y))
        b *= 2
    return y


def emulate(q, k, v, w, beta, do, kernel, pts, chunk=64, u_stage_only=False):
    """o and (dq, dk, dv, dw, dbeta) of Deltaformer attention with the roundings `pts` (float64 inputs).
    u_stage_only: stage 1 alone, `do` taken as du: returns u and (dk, dv, dw, dbeta)."""
    pts = set(pts)
    unknown = pts - set(ROUNDINGS)
    if unknown:
        raise ValueError(f"unknown rounding points {sorted(unknown)}; known: {sorted(ROUNDINGS)}")
    r = lambda name, x: bf16(x) if name in pts else x  # noqa: E731
    T, D = q.shape[-2], q.shape[-1]
    s = 1.0 / math.sqrt(D)
    idx = torch.arange(T)
    strict = idx[None, :] < idx[:, None]  # j < i
    if "rec_lowp" in pts:
        rec_mm, rec_store = (lambda a, b: bf16(a) @ bf16(b)), bf16
    elif "rec_tf32" in pts:
        rec_mm, rec_store = (lambda a, b: tf32(a) @ tf32(b)), (lambda x: x.float().double())
    elif "rec_split" in pts:
        rec_mm, rec_store = split_mm, (lambda x: x.float().double())
    elif "rec_split_b" in pts or "rec_split_a" in pts:  # the value operand read as fp32 (u32, beta G)
        half = "b" if "rec_split_b" in pts else "a"  # and rounded in the product (= reading bf16 u)
        rec_mm, rec_store = (lambda a, b: split2_mm(a, b, half)), (lambda x: x.float().double())
    else:
        rec_mm, rec_store = (lambda a, b: a @ b), (lambda x: x)
    xmm = (lambda a, b: tf32(a) @ tf32(b)) if "x_tf32" in pts else (lambda a, b: a @ b)
    hmm = (lambda a, b: tf32(a) @ tf32(b)) if "h_tf32" in pts else (lambda a, b: a @ b)

    # ---- stage 1 forward, chunk by chunk as _fwd_kernel
    S = s * ((tf32(w) @ tf32(k).transpose(-1, -2)) if "s_tf32" in pts else (w @ k.transpose(-1, -2)))
    if kernel == "softmax":
        lse = torch.logsumexp(S.masked_fill(~strict, -math.inf), dim=-1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        A = torch.exp(S - lse).masked_fill(~strict, 0.0)
    elif kernel == "relu":
        A = torch.relu(S).masked_fill(~strict, 0.0)
    else:
        A = S.masked_fill(~strict, 0.0)
    U = torch.zeros_like(v)
    Urec = torch.zeros_like(v)  # what the recurrence reads (u32 or the bf16 u)
    Hs = torch.zeros_like(v)
    Xs = []
    for r0 in range(0, T, chunk):
        r1 = min(r0 + chunk, T)
        b = beta[..., r0:r1, None]
        a_cc = A[..., r0:r1, r0:r1]
        eye = torch.eye(r1 - r0, dtype=v.dtype).expand_as(a_cc)
        if "xinv_tf32" in pts:
            X = blocked_inverse_tf32(b * a_cc)
        else:
            X = torch.linalg.solve_triangular(eye + b * a_cc, eye, upper=False, unitriangular=True)
        X = bf16(X) if "x_bf16" in pts else X
        Xs.append(X)
        acc = rec_mm(A[..., r0:r1, :r0], Urec[..., :r0, :]) if r0 > 0 else torch.zeros_like(v[..., r0:r1, :])
        u_c = xmm(X, v[..., r0:r1, :] - b * acc)
        U[..., r0:r1, :] = u_c
        Urec[..., r0:r1, :] = rec_store(u_c)
        Hs[..., r0:r1, :] = acc + hmm(a_cc, u_c)
    U2 = r("u_bf16", U)  # what stage 2 reads
    if u_stage_only:
        do_u, do = do, torch.zeros_like(do)  # stage 2 below computes nothing useful

    # ---- stage 2 forward (FlashAttention-like: unnormalised P in bf16, normalised at the end)
    causal = idx[None, :] <= idx[:, None]
    S2 = (s * q @ k.transpose(-1, -2)).masked_fill(~causal, -math.inf)
    m = S2.amax(-1, keepdim=True)
    Pt = torch.exp(S2 - m)
    ell = Pt.sum(-1, keepdim=True)
    O = (r("p2", Pt) @ U2) / ell
    Ost = bf16(O) if pts & {"out", "sdpa_out"} else O
    # ---- stage 2 backward (FlashAttention-2)
    P = Pt / ell
    dU = r("du", r("p2", P).transpose(-1, -2) @ do)
    dP = do @ U2.transpose(-1, -2)
    delta = (do * (bf16(O) if "o_delta" in pts else O)).sum(-1, keepdim=True)
    dS2 = r("ds2", P * (dP - delta))
    if u_stage_only:
        dU = do_u
    dq = r("sdpa_out", s * dS2 @ k)
    dk2 = r("sdpa_out", s * dS2.transpose(-1, -2) @ q)

    # ---- stage 1 backward: G anti-causally (_bwd_g_kernel), then dA, dS, dK, dW (_dk/_dw_kernel)
    G = torch.zeros_like(v)
    GBrec = torch.zeros_like(v)
    starts = list(range(0, T, chunk))
    for ci in reversed(range(len(starts))):
        r0 = starts[ci]
        r1 = min(r0 + chunk, T)
        if r1 < T:
            acc = rec_mm(A[..., r1:, r0:r1].transpose(-1, -2), GBrec[..., r1:, :])
        else:
            acc = torch.zeros_like(v[..., r0:r1, :])
        g_c = xmm(Xs[ci].transpose(-1, -2), dU[..., r0:r1, :] - acc)
        G[..., r0:r1, :] = g_c
        GBrec[..., r0:r1, :] = rec_store(beta[..., r0:r1, None] * g_c)
    GB = beta[..., None] * G
    dv = G
    dbeta = -(G * Hs).sum(-1)
    rowterm = (GB * Hs).sum(-1, keepdim=True)
    if "ds1_tf32" in pts:
        dA = -(tf32(GB) @ tf32(U).transpose(-1, -2))
    else:
        dA = -(r("gb_dA", GB) @ r("u_dA", U).transpose(-1, -2))
    if kernel == "softmax":
        dS1 = A * (dA + rowterm)
    elif kernel == "relu":
        dS1 = torch.where(strict & (S > 0), dA, 0.0)
    else:
        dS1 = torch.where(strict, dA, 0.0)
    dS1 = tf32(dS1) if "ds1_tf32" in pts else r("ds1", dS1)
    dk1 = s * dS1.transpose(-1, -2) @ w
    dw = s * dS1 @ k
    if u_stage_only:
        return r("out", U), [r("out", g) for g in (dk1, dv, dw, dbeta)]
    dk = r("acc_grads", dk1) + r("acc_grads", dk2)
    grads = [r("out", g) for g in (dq, dk, dv, dw, dbeta)]
    return Ost, grads


def patch_interpreter_dots(setattr=setattr):
    """Make Triton's CPU interpreter (3.9) round and multiply as an H100/H200 does (for this study only).
    Its create_dot multiplies bfloat16 operands as their raw uint16 bit patterns (garbage) and ignores
    input_precision (fp32 operands always exact); its fp32 -> bf16 cast truncates (the GPU rounds to
    nearest even). Patched: bf16 operands decoded to fp32; fp32 operands truncated to tf32 for "tf32",
    split hi + lo (tf32 each, three products) for "tf32x3"; fp32 accumulation; fp32 -> bf16 casts
    round to nearest even. Must run before any kernel is launched. setattr: pytest's
    monkeypatch.setattr in tests (undone after the test); the builtin (permanent) here."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    cast_impl = InterpreterBuilder.cast_impl

    def decode(h):
        if h.dtype.scalar.name == "bf16":  # stored as uint16
            return (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return h.data.astype(np.float32)

    def trunc_tf32(x):  # or rounded to nearest, as TF32_MODE says (the emulation's tf32 too)
        bits = x.view(np.uint32)
        if TF32_MODE["round"]:
            bits = bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))
        return (bits & np.uint32(0xFFFFE000)).view(np.float32)

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


def reference(q, k, v, w, beta, do, kernel):
    """Autograd through the float64 chunked path (the tests' 'chunked' reference)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, w, beta)]
    u = deltaformer_u_torch(*leaves[1:], kernel=kernel)
    o = F.scaled_dot_product_attention(leaves[0], leaves[1], u, is_causal=True)
    o.backward(do)
    return o.detach(), [x.grad for x in leaves]


def reflection_inputs(B, H, T, D, kernel, gen, key_noise=0.0):
    """As tests/test_deltaformer.py's reflection_inputs (RMS-normed keys of 10 types, w = k, beta ~ 2 /
    (s |k|^2)), from a given generator; returned already rounded to bf16 (as float64). key_noise > 0 adds
    key_noise * N(0, 1) to every key before the norm (drawn last: the other inputs stay the same), so that
    keys of one type, and the kernel values between them, are no longer identical."""
    rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # noqa: E731
    types = torch.randn(10, D, dtype=torch.float64, generator=gen)
    k = rms(types[torch.randint(0, 10, (B, H, T), generator=gen)])
    q = rms(torch.randn(k.shape, dtype=torch.float64, generator=gen))
    v = torch.randn(k.shape, dtype=torch.float64, generator=gen)
    center = 2.0 if kernel == "softmax" else 2 / D**0.5
    beta = center * (0.9 + 0.2 * torch.rand(B, H, T, dtype=torch.float64, generator=gen))
    do = torch.randn(k.shape, dtype=torch.float64, generator=gen)
    if key_noise > 0:
        k = rms(k + key_noise * torch.randn(k.shape, dtype=torch.float64, generator=gen))
    return [bf16(x) for x in (q, k, v, k.clone(), beta, do)]


DIGITS = {"n": 2}  # significant digits printed (--digits)


def fmt(e):
    return f"{e:.{DIGITS['n'] - 1}e}"


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def errors(out, ref):
    o, g = out
    o_ref, g_ref = ref
    return [rel(o, o_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]


SAME_SDPA_REF = ("u_bf16", "p2", "o_delta", "ds2", "du", "sdpa_out")
FP32_DKDW = SDPA_POINTS + ("rec_split", "h_tf32")  # kernel split with fp32 operands in dA, dK, dW


def kernel_rows():
    rows = [(f"kernel rec={rec}", pts) for rec, pts in KERNEL_POINTS.items()]
    rows.append(("kernel split, dA/dS in tf32 (lowp=False)", FP32_DKDW + ("ds1_tf32",)))
    for rec in ("split_b", "split_a"):  # the two-product splits with lowp=False
        rows.append((f"kernel {rec}, lowp=False", SDPA_POINTS + (f"rec_{rec}", "h_tf32", "ds1_tf32")))
    rows.append(("kernel split, dA/dS in fp32", FP32_DKDW))
    # stage 2 in fp32 (SDPA on fp32 q, k, u32; o and the gradients still returned in bf16)
    rows.append(
        ("kernel split, lowp=False, fp32 stage 2", ("out", "acc_grads", "rec_split", "h_tf32", "ds1_tf32"))
    )
    return rows


def configs():
    """(label, points): no rounding, each point alone, the kernel per rec, the kernel minus each point,
    and the floors: what an SDPA-based stage 2 forces, and bf16 outputs alone."""
    rows = [("exact (no rounding)", ())]
    rows += [(f"only {p}", (p,)) for p in ROUNDINGS]
    rows += [("floor: bf16 outputs (out + acc_grads)", ("out", "acc_grads"))]
    rows += [("floor: SDPA stage 2 (" + " ".join(SDPA_POINTS) + ")", SDPA_POINTS)]
    rows += [(f"floor SDPA minus {p}", tuple(x for x in SDPA_POINTS if x != p)) for p in SDPA_POINTS[2:]]
    rows += [("floor: own stage 2, fp32 u and du (out acc_grads p2 o_delta ds2)", CUSTOM_STAGE2)]
    rows += [("floor: own stage 2, fp32 u, du, dS (out acc_grads p2 o_delta)", CUSTOM_STAGE2[:-1])]
    rows += kernel_rows()
    base = KERNEL_POINTS["split"]
    rows += [(f"kernel split minus {p}", tuple(x for x in base if x != p)) for p in base]
    return rows


U_NAMES = ("u", "k", "v", "w", "beta")
U_STAGE = ("out", "h_tf32")  # u-stage only: bf16 u and gradients, h in tf32
TRITON_VARIANTS = {  # (rec, lowp) -> the rounding points of the emulation that model it
    ("split", True): U_STAGE + ("rec_split",) + STAGE1_BWD,
    ("split", False): U_STAGE + ("rec_split", "ds1_tf32"),
    ("tf32", True): U_STAGE + ("rec_tf32", "x_tf32", "xinv_tf32") + STAGE1_BWD,
    ("lowp", True): U_STAGE + ("rec_lowp", "x_tf32", "xinv_tf32") + STAGE1_BWD,
}


def triton_u_stage(k, v, w, beta, du, kernel, chunk):
    """The u-stage alone, against float64 autograd of the chunked path with the same (bf16) du: the
    Triton kernels in the patched interpreter, and the emulation of each with its rounding points."""
    from kernels.deltaformer import RECS, deltaformer_u_triton

    leaves = [x.detach().clone().requires_grad_(True) for x in (k, v, w, beta)]
    u_ref = deltaformer_u_torch(*leaves, kernel=kernel)
    u_ref.backward(du)
    ref = (u_ref.detach(), [x.grad for x in leaves])
    print("| u-stage (rec, lowp) | " + " | ".join(U_NAMES) + " | max |")
    print("|---" * (len(U_NAMES) + 2) + "|")
    for (rec, lowp), pts in TRITON_VARIANTS.items():
        if rec not in RECS:  # rec="tf32" was removed from the kernel (session 3); its emulation stays
            continue
        low = [x.detach().to(torch.bfloat16).requires_grad_(True) for x in (k, v, w, beta)]
        u = deltaformer_u_triton(*low, kernel=kernel, chunk=chunk, rec=rec, lowp=lowp)
        u.backward(du.to(torch.bfloat16))
        ours = errors((u.detach().double(), [x.grad.double() for x in low]), ref)
        emul = errors(emulate(k, k, v, w, beta, du, kernel, pts, chunk, u_stage_only=True), ref)
        for label, errs in ((f"Triton {rec}, {lowp}", ours), (f"emulation {rec}, {lowp}", emul)):
            print(f"| {label} | " + " | ".join(fmt(e) for e in errs) + f" | {fmt(max(errs))} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="256,512,1024", help="comma-separated sequence lengths")
    ap.add_argument("--kernels", default="relu,linear,softmax")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--H", type=int, default=3)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated config labels (substring match)")
    ap.add_argument(
        "--triton",
        action="store_true",
        help="the Triton u-stage in the interpreter (bf16 dots fixed) instead",
    )
    ap.add_argument("--key-noise", type=float, default=0.0, help="noise added to the keys' types")
    ap.add_argument("--digits", type=int, default=2, help="significant digits printed")
    ap.add_argument("--tf32-round", action="store_true", help="tf32 as round-to-nearest, not truncation")
    args = ap.parse_args()
    TF32_MODE["round"] = args.tf32_round
    DIGITS["n"] = args.digits
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.triton:
        patch_interpreter_dots()
    rows = configs()
    if args.only:
        keys = args.only.split(",")
        rows = [row for row in rows if any(key in row[0] for key in keys)]
    for kernel in args.kernels.split(","):
        for T in (int(t) for t in args.T.split(",")):
            gen = torch.Generator().manual_seed(args.seed)
            q, k, v, w, beta, do = reflection_inputs(args.B, args.H, T, args.D, kernel, gen, args.key_noise)
            t0 = time.time()
            if args.triton:
                print(f"\n### {kernel}, T = {T} (B,H,D = {args.B},{args.H},{args.D}, C = {args.chunk})\n")
                triton_u_stage(k, v, w, beta, do, kernel, args.chunk)
                print(f"\n({time.time() - t0:.0f} s)")
                continue
            ref = reference(q, k, v, w, beta, do, kernel)
            u_ref = deltaformer_u_torch(k, v, w, beta, kernel=kernel)
            print(
                f"\n### {kernel}, T = {T} (B,H,D = {args.B},{args.H},{args.D}, C = {args.chunk}; "
                f"|u - v| / |v| = {rel(u_ref, v):.2f}, |u| / |v| = {(u_ref.norm() / v.norm()).item():.1f})\n"
            )
            print("| rounding | " + " | ".join(NAMES) + " | max |")
            print("|---" * (len(NAMES) + 2) + "|")
            for label, pts in rows:
                errs = errors(emulate(q, k, v, w, beta, do, kernel, pts, args.chunk), ref)
                print(f"| {label} | " + " | ".join(fmt(e) for e in errs) + f" | {fmt(max(errs))} |")
            # against a reference that has the same bf16 stage 2 (SDPA) and a float64 stage 1: roundings at
            # the same points of (nearly) the same values coincide, so this shows what the u-stage adds
            ref2 = emulate(q, k, v, w, beta, do, kernel, SAME_SDPA_REF, args.chunk)
            print(f"\nAgainst the same-SDPA reference ({' '.join(SAME_SDPA_REF)}; float64 stage 1):\n")
            print("| ours | " + " | ".join(NAMES) + " | max |")
            print("|---" * (len(NAMES) + 2) + "|")
            for label, pts in kernel_rows():
                errs = errors(emulate(q, k, v, w, beta, do, kernel, pts, args.chunk), ref2)
                print(f"| {label} | " + " | ".join(fmt(e) for e in errs) + f" | {fmt(max(errs))} |")
            print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
