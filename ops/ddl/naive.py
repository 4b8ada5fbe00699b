"""Deep Delta Learning (DDL) residual ops, the definitions: short, vectorised PyTorch, any dtype,
differentiable by autograd (the equations: the package docstring)."""

import functools

import torch

from ..common import acc_dtype


def _check_float(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def _check_update_args(x, k, v, beta):
    for name, t in (("x", x), ("k", k), ("v", v), ("beta", beta)):
        _check_float(name, t)
    if x.dim() < 2:
        raise ValueError(f"ddl_update: x must be [..., d, d_v], got shape {tuple(x.shape)}")
    lead, d, dv = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    if tuple(k.shape) != lead + (d,):
        raise ValueError(
            f"ddl_update: k must have shape {lead + (d,)} (x is {tuple(x.shape)}), got {tuple(k.shape)}"
        )
    if tuple(v.shape) != lead + (dv,):
        raise ValueError(
            f"ddl_update: v must have shape {lead + (dv,)} (x is {tuple(x.shape)}), got {tuple(v.shape)}"
        )
    if tuple(beta.shape) != lead:
        raise ValueError(
            f"ddl_update: beta must have shape {lead} (x is {tuple(x.shape)}), got {tuple(beta.shape)}"
        )


def _check_state(fn, x):
    _check_float("x", x)
    if x.dim() != 4:
        raise ValueError(f"{fn}: x must be [B, T, d, d_v], got shape {tuple(x.shape)}")


def _check_conv(fn, name, w, d, dv=None):
    _check_float(name, w)
    if w.dim() != 3 or w.shape[0] != d or (dv is not None and w.shape[1] != dv) or w.shape[2] < 1:
        want = f"[{d}, {dv if dv is not None else 'd_v'}, K >= 1]"
        raise ValueError(f"{fn}: {name} must be {want}, got shape {tuple(w.shape)}")


def _check_cc_weight(fn, x, weight):
    if tuple(weight.shape) != tuple(x.shape[-2:]):
        raise ValueError(
            f"{fn}: weight must be {tuple(x.shape[-2:])} (= [d, d_v]), got {tuple(weight.shape)}"
        )


def _check_read(fn, x, read):
    dv = x.shape[-1]
    if tuple(read.shape) != (dv,):
        raise ValueError(f"{fn}: read must be [{dv}] (= [d_v]), got {tuple(read.shape)}")


def _check_norm_args(x, norm_weight, logit_weight):
    _check_float("norm_weight", norm_weight)
    _check_float("logit_weight", logit_weight)
    if x.dim() < 2 or x.shape[-1] != 1:
        raise ValueError(f"ddl_update_norm: x must be [..., d, 1] (d_v = 1), got shape {tuple(x.shape)}")
    d = x.shape[-2]
    if tuple(norm_weight.shape) != (d,) or tuple(logit_weight.shape) not in ((1, d), (2, d)):
        raise ValueError(
            f"ddl_update_norm: norm_weight must be [{d}] and logit_weight [1 or 2, {d}], got "
            f"{tuple(norm_weight.shape)} and {tuple(logit_weight.shape)}"
        )


def _check_seed(fn, x, seed):
    if seed is None:
        return
    if not (isinstance(seed, torch.Tensor) and seed.numel() == 1 and not seed.is_floating_point()):
        raise TypeError(f"{fn}: seed must be None or an integer tensor of one element, got {seed!r:.80}")
    if x.dtype != torch.bfloat16:
        raise ValueError(
            f"{fn}: seed (stochastic rounding) is for a bfloat16 state, got x of dtype {x.dtype}"
        )


def _mix32_ref(h):
    """murmur3's 32-bit finaliser on int64 tensors of uint32 values (products split so none overflows)."""

    def mul(h, c):
        return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    h = mul(h ^ (h >> 16), 0x85EBCA6B)
    h = mul(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def round_state(x, dtype, seed=None):
    """x, computed in fp32 (or float64), as a state stored in dtype: rounded to nearest, or, given seed (a
    bf16 state), stochastically, so that its expectation is x: the element at flat index i of x gets 16
    random bits h(seed, i) added below bf16's last bit, which are then cut off (h = murmur3's finaliser of i
    xor that of the seed, i and the seed mod 2^32). The gradient passes straight through, as a cast's."""
    if seed is None:
        return x.to(dtype)
    x32 = x.to(torch.float32)
    key = _mix32_ref(seed.reshape(()).to(device=x.device, dtype=torch.int64) & 0xFFFFFFFF)
    bits = _mix32_ref((torch.arange(x32.numel(), device=x.device).view(x32.shape) & 0xFFFFFFFF) ^ key)
    u = ((x32.detach().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) + (bits & 0xFFFF)) & 0xFFFF0000
    y = ((u ^ 0x80000000) - 0x80000000).to(torch.int32).view(torch.float32)  # back to int32's range
    y = torch.where(torch.isnan(x32), x32, y)
    # y, with x32's gradient: x32 + (y - x32) is y exactly (both differences exact); x32 itself where they
    # are equal (bf16 values, -0.0 and infinities included)
    return torch.where(y == x32, x32, x32 + (y - x32).detach()).to(dtype)


def update_terms_ref(x, k, v, eps=1e-5, erase=True):
    """(rs, r) of the update in the compute dtype: rs = 1/sqrt(|k|^2+eps^2) [...] and r = v - khat^T x
    (erase) or v [..., d_v], so that the update is x + beta * (k rs) r^T."""
    _, rs, r = _update_terms(x, k, v, eps, erase)
    return rs[..., 0], r


def _update_terms(x, k, v, eps, erase):  # (khat, rs [..., 1], r) in the compute dtype: few ops, no matmul
    ct = acc_dtype(x, k, v)
    kf = k.to(ct)
    rs = torch.rsqrt((kf * kf).sum(-1, keepdim=True) + eps * eps)
    khat, r = kf * rs, v.to(ct)
    if erase:
        r = r - (khat[..., None] * x.to(ct)).sum(-2)  # v^T - khat^T x
    return khat, rs, r


def ddl_update_ref(x, k, v, beta, eps=1e-5, erase=True, seed=None):
    """x + beta*khat*(v^T - khat^T x) (or x + beta*khat*v^T with erase=False); khat = k/sqrt(|k|^2+eps^2);
    stored in x's dtype by round_state (seed: stochastically)."""
    _check_update_args(x, k, v, beta)
    _check_seed("ddl_update", x, seed)
    ct = acc_dtype(x, k, v, beta)
    khat, _, r = (t.to(ct) for t in _update_terms(x, k, v, eps, erase))
    x_new = torch.addcmul(x.to(ct), (beta.to(ct)[..., None] * khat)[..., None], r[..., None, :])
    return round_state(x_new, x.dtype, seed)


def ddl_update_norm_ref(
    x, k, v, beta, norm_weight, logit_weight, eps=1e-5, norm_eps=1e-5, erase=True, c_dtype=None, seed=None
):
    """d_v = 1: (x_new, c, z, inv_rms), the update and the read of x_in = x_new[..., 0] by the next sublayer:
    inv_rms = 1 / sqrt(mean(x_in^2) + norm_eps) [..., 1], c = x_in inv_rms norm_weight (in c_dtype, default
    the compute dtype) and z = x_in logit_weight^T [..., m], computed as x_new is stored."""
    _check_norm_args(x, norm_weight, logit_weight)
    x_new = ddl_update_ref(x, k, v, beta, eps=eps, erase=erase, seed=seed)
    ct = acc_dtype(x, k, v, beta, norm_weight, logit_weight)
    x_in = x_new[..., 0].to(ct)
    inv_rms = torch.rsqrt(x_in.pow(2).mean(-1, keepdim=True) + norm_eps)
    c = (x_in * inv_rms * norm_weight.to(ct)).to(c_dtype or ct)
    return x_new, c, x_in @ logit_weight.to(ct).T, inv_rms


def cc_read_weight(conv, read):
    """DDL-CC's depthwise conv along d_v (conv [d, d_v], centred) followed by its read over d_v (read [d_v])
    as the one linear map compress_cc applies: W [d, d_v], W[i, v] = sum_j read[j] conv[i, v - j + (d_v-1)//2]
    (taps outside the kernel are 0)."""
    dv = read.shape[0]
    tap, inside = (_cc_taps if torch.compiler.is_compiling() else _cc_taps_kept)(dv, conv.device, conv.dtype)
    return (conv[:, tap] * inside) @ read


def _cc_taps(dv, device, dtype):  # [v, j]: the tap of conv that read[j] weighs in W[:, v], and 1 if inside
    ar = torch.arange(dv, device=device)
    tap = ar[:, None] - ar[None, :] + (dv - 1) // 2
    return tap.clamp(0, dv - 1), ((tap >= 0) & (tap < dv)).to(dtype)


@functools.lru_cache
def _cc_taps_kept(dv, device, dtype):  # eager calls (decoding: every read) build them once, as plain tensors
    with torch.inference_mode(False):
        return _cc_taps(dv, device, dtype)


def compress_cc_ref(x, weight):
    """h[b,t,i] = sum_v weight[i,v] * x[b,t,i,v]."""
    _check_state("compress_cc", x)
    _check_float("weight", weight)
    _check_cc_weight("compress_cc", x, weight)
    ct = acc_dtype(x, weight)
    return (x.to(ct) * weight.to(ct)).sum(-1).to(x.dtype)


def _check_doc_start(fn, doc_start, x):
    """doc_start: None, or an int32/int64 tensor [B, T] on x's device (x [B, T, ...]): token t's document
    starts at doc_start[b, t] (the same frame as t)."""
    if doc_start is None:
        return
    want = f"an int32/int64 tensor {tuple(x.shape[:2])} on {x.device}"
    if not isinstance(doc_start, torch.Tensor):
        raise ValueError(f"{fn}: doc_start must be None or {want}, got {type(doc_start).__name__}")
    if doc_start.dtype not in (torch.int32, torch.int64) or tuple(doc_start.shape) != tuple(x.shape[:2]):
        raise ValueError(f"{fn}: doc_start must be {want}, got {doc_start.dtype} {tuple(doc_start.shape)}")
    if doc_start.device != x.device:
        raise ValueError(f"{fn}: doc_start must be {want}, got it on {doc_start.device}")


def _windows(x, K, doc_start=None):
    """The K-step windows [B, T, ..., K] of x [B, S, ...] along dim 1, one for each of its last T = S - (K-1)
    steps (its step t - (K-1) + j at j); given doc_start [B, T] (x's frame), the steps before each one's
    document zero."""
    w = x.unfold(1, K, 1)
    if doc_start is None:
        return w
    at = torch.arange(w.shape[1], device=x.device)[:, None] + torch.arange(K, device=x.device)  # [T, K]
    keep = at >= doc_start[..., None]  # [B, T, K]
    return torch.where(keep.view(keep.shape[:2] + (1,) * (w.dim() - 3) + (K,)), w, 0.0)


def _pad_front(x, n):
    """x [B, T, ...] with n zero steps in front along dim 1 (a causal conv's padding at t < 0)."""
    return torch.cat([x.new_zeros((x.shape[0], n) + tuple(x.shape[2:])), x], dim=1) if n else x


def compress_tc_ref(x, conv_weight, read, doc_start=None):
    """h[b,t,i] = sum_v read[v] * sum_j conv_weight[i,v,j] * x[b, t-(K-1)+j, i, v] (zeros before t=0, and
    given doc_start [B, T], before doc_start[b, t])."""
    _check_state("compress_tc", x)
    _check_doc_start("compress_tc", doc_start, x)
    d, dv = x.shape[-2:]
    _check_conv("compress_tc", "conv_weight", conv_weight, d, dv)
    _check_float("read", read)
    _check_read("compress_tc", x, read)
    K = conv_weight.shape[-1]
    doc_start = None if doc_start is None else doc_start + (K - 1)  # in the padded frame
    return tc_windows_ref(_pad_front(x, K - 1), conv_weight, read, doc_start)


def tc_windows_ref(x, conv_weight, read, doc_start=None):
    """compress_tc's h of the last T = S - (K-1) tokens of x [B, S, d, d_v], each from the K states up to it
    (x's first K-1 steps: the states before them, or zeros); doc_start [B, T] (x's frame): each token's
    window within its document."""
    ct, K = acc_dtype(x, conv_weight, read), conv_weight.shape[-1]
    y = (_windows(x.to(ct), K, doc_start) * conv_weight.to(ct)).sum(-1)  # [B, T, d, d_v]
    return (y * read.to(ct)).sum(-1).to(x.dtype)


def expand_ec_ref(emb, conv_weight, doc_start=None):
    """X0[b,t,i,v] = sum_j conv_weight[i,v,j] * emb[b, t-(K-1)+j, i] (zeros before t=0, and given doc_start
    [B, T], before doc_start[b, t])."""
    _check_float("emb", emb)
    if emb.dim() != 3:
        raise ValueError(f"expand_ec: emb must be [B, T, d], got shape {tuple(emb.shape)}")
    _check_conv("expand_ec", "conv_weight", conv_weight, emb.shape[-1])
    _check_doc_start("expand_ec", doc_start, emb)
    ct, K = acc_dtype(emb, conv_weight), conv_weight.shape[-1]
    doc_start = None if doc_start is None else doc_start + (K - 1)  # in the padded frame
    windows = _windows(_pad_front(emb.to(ct), K - 1), K, doc_start)  # [B, T, d, K]
    return (windows[..., None, :] * conv_weight.to(ct)).sum(-1).to(emb.dtype)


def ddl_update_compress_cc_ref(x, k, v, beta, weight, eps=1e-5, erase=True, seed=None):
    x_new = ddl_update_ref(x, k, v, beta, eps=eps, erase=erase, seed=seed)
    return x_new, compress_cc_ref(x_new, weight)


def ddl_update_compress_tc_ref(
    x, k, v, beta, conv_weight, read, eps=1e-5, erase=True, seed=None, doc_start=None
):
    _check_state("ddl_update_compress_tc", x)
    _check_doc_start("ddl_update_compress_tc", doc_start, x)
    x_new = ddl_update_ref(x, k, v, beta, eps=eps, erase=erase, seed=seed)
    return x_new, compress_tc_ref(x_new, conv_weight, read, doc_start)
