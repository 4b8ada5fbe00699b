"""GPT with switchable residual (additive | Deep Delta Learning) and attention (softmax | Deltaformer).

One file, read top to bottom: config -> small pieces (RMSNorm, RoPE, MLP, attention) -> the residual
interface (the only place the residual variants differ) -> Block -> GPT (forward, generate, counts).

Architecture shared by every variant (the DDL paper's GPT-2 setup):
- pre-norm RMSNorm with a weight and no bias; RoPE (base 10000) on queries and keys; QK-RMSNorm per head;
  SwiGLU MLP; no biases in the linear layers; head_dim 128; tied token embedding / LM head; vocab 50304.
- SwiGLU hidden size: floor(8 d / 3), the size that gives the MLP the 8 d^2 parameters of GPT-2's 4x MLP
  (d 768 -> 2048 exactly; d 1024 -> 2730) and matches the paper's counts: 123.6M (small) and 353.4M
  (medium) for additive + softmax. `mlp_hidden` overrides it (e.g. 2752 = a multiple of 64).
- The attention width n_head * head_dim is its own number; n_embd need not equal it (presets: equal).

Residual variants (cfg.residual). The stream is either a vector x [B, T, d] ("additive") or, for DDL, a
matrix state X [B, T, d, d_v] per token. Every sublayer F (attention or MLP) runs as

    additive:  x <- x + F(RMSNorm(x))
    DDL:       x_in = compress(X);  c = RMSNorm(x_in);  h = F(c)
               k = h (ddl_update normalises it: khat = h / sqrt(|h|^2 + eps^2))
               v = W_v c  (d -> d_v, no bias; ddl_v="sigmoid": v = 4 sigmoid(W_v c + b_v))
               beta = 2 sigmoid(w_beta . c + b_beta)          (fp32; in (0, 2): identity .. reflection)
               X <- X + beta khat (v^T - khat^T X)             (ddl_erase=False: X <- X + beta khat v^T)

    compress:  "ddl"    (d_v = 1)  x_in = X[..., 0]
               "ddl-cc" (channel)  x_in[i] = sum_v weight[i, v] X[i, v]              weight init 1/d_v
               "ddl-tc" (temporal) causal depthwise conv over tokens (K = ddl_conv_size) then a read
                                   over v; conv init = identity (last tap 1), read init 1/d_v
    The embedding becomes X0 = emb repeated d_v times, or with EC (ddl_ec, "ddl-cc"/"ddl-tc" only) a
    causal depthwise conv of the embeddings (identity init = the repetition). A last compressor reads
    X out before the final norm and the LM head. For DDL-CC each update is fused with the CC read that
    follows it (kernels.ddl.ddl_update_compress_cc: one pass over the state instead of two).

    The value v. The spec (DEVELOPERS.md, from the paper) is the plain projection v = W_v c, and that is
    the default. The DDL authors' code (deep-delta-learning) instead uses v = 4 sigmoid(W_v c + b_v), here
    ddl_v="sigmoid". Why it may matter: h only sets the direction khat; the amount written along it is
    beta (v - khat^T X). With a zero-mean v that amount has a random sign per token, so what F computed
    reaches the stream with a random sign; a positive v keeps it. `python bench/copy_task.py` (2-layer d=64
    models learning to copy; loss floor 2.08, chance 4.16), loss at step 100 / 200: additive 2.33 / 2.06;
    v = W_v c: ddl 4.16 / 3.98, ddl-cc 4.17 / 2.93; v = 4 sigmoid(.): ddl 2.31 / 2.16, ddl-cc 2.27 / 2.14,
    ddl-tc 2.25 / 2.10. One small task, 200 steps: a lead for pretraining runs, not a verdict.

Attention variants (cfg.attention): "softmax" = causal SDPA. "deltaformer" = the Deltaformer paper's
two-stage attention (kernels/deltaformer.py): u_i = v_i - beta_i sum_{j<i} kappa(w_i, k_j) u_j, then causal
softmax attention of q over (k, u). w is q, k (default: the delta rule as in DeltaNet, where each token
reads the memory with its own key and erases what that key reads back) or a separate projection. w is
treated as a query: it gets the same per-head RMSNorm and RoPE as q (with w = q or k it *is* the normed,
rotated q or k), so w_i . k_j depends on content and relative position only. beta_i per head =
deltaformer_beta_max * sigmoid(Linear(c)) (fp32). Default max 2: beta in (0, 2) lets a head reflect
(eigenvalue 1 - beta < 0), which parity and permutation (swap) tracking need; deltaformer_beta_max=1
gives the classic (0, 1) delta rule.

Init (nanoGPT): linear and embedding weights N(0, 0.02); the two output projections of every block
(attention c_proj, MLP c_proj) N(0, 0.02 / sqrt(2 n_layer)); norm weights 1. DDL: W_v N(0, 0.02) (an input
projection of c like q/k/v; with ddl_v="sigmoid" also b_v = 0, so v starts near 2); w_beta = 0 and
b_beta = logit(ddl_beta_init / 2), so beta starts at exactly ddl_beta_init for every token.
ddl_beta_init defaults to 0.5: halfway between identity (0: the sublayer is silent and k, v get no
gradient) and a full projection (1: every sublayer erases the stream's component along khat from the
first step). Deltaformer beta projection:
N(0, 0.02) weight, zero bias (beta ~ max/2).

Mixed precision: training runs under bf16 autocast; the norms and both betas are computed in fp32, the
additive stream x stays in the parameter dtype (fp32); the DDL kernels normalise h and update X in fp32
whatever dtype X, h and v come in (bf16 h from the autocast matmuls) and store the result in X's dtype.
ddl_state_dtype chooses that dtype for DDL: "float32" (default: the parameter dtype, i.e. fp32, or float64
for a .double() model) or "bfloat16": X0 (EC or the repetition), every X between sublayers, the fused CC
reads and the last read-out are stored in bf16 (each update still computes in fp32 and rounds once). The
state is the DDL model's dominant memory traffic (d_v numbers per channel, read and written by every
sublayer), so bf16 halves it (bench/NOTES_ddl.md); the default stays fp32 because rounding X to 8 bits of
mantissa after every sublayer is a numerical change of the architecture (the additive baseline keeps an
fp32 stream), to be validated by a training run before it becomes the default.

Decoding (`generate`) keeps a cache per module: keys/values for softmax attention (RoPE at absolute
positions); keys/u's for Deltaformer (the prompt's u from stage 1 at once, then deltaformer_step per
token); the last K-1 states each DDL-TC compressor saw; the last K-1 embeddings for EC. Beyond block_size
it crops like nanoGPT: the logits come from a plain forward over the last block_size tokens (there is no
cache to reuse once the window slides).
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.ddl import compress_cc, compress_tc, ddl_update, ddl_update_compress_cc, expand_ec
from kernels.deltaformer import deltaformer_attention, deltaformer_step, deltaformer_u_torch

RESIDUALS = ("additive", "ddl", "ddl-tc", "ddl-cc")
ATTENTIONS = ("softmax", "deltaformer")
DELTAFORMER_WS = ("q", "k", "proj")
DELTAFORMER_KERNELS = ("softmax", "relu", "linear")
BACKENDS = ("auto", "torch", "triton")
DDL_EPS = 1e-5  # khat = h / sqrt(|h|^2 + eps^2)
DDL_V_SCALE = 4.0  # v = 4 sigmoid(.) in (0, 4), as in the DDL authors' code
DDL_VS = ("linear", "sigmoid")
DDL_STATE_DTYPES = ("float32", "bfloat16")
NORM_EPS = 1e-6

PRESETS = {
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=6, head_dim=128),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=8, head_dim=128),
}


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 768
    head_dim: int = 128
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    mlp_hidden: int | None = None  # None -> floor(8 n_embd / 3)
    rope_base: float = 10000.0
    dropout: float = 0.0
    residual: str = "additive"
    ddl_dv: int | None = None  # None -> 1 for "ddl", 4 for "ddl-tc"/"ddl-cc"; must be None for additive
    ddl_ec: bool = True  # EC expansion of the embedding ("ddl-tc"/"ddl-cc" only)
    ddl_erase: bool = True  # False: the write-only control X <- X + beta khat v^T
    ddl_beta_init: float = 0.5  # in (0, 2)
    ddl_v: str = "linear"  # v = W_v c (the spec); "sigmoid": 4 sigmoid(W_v c + b_v) (authors' code)
    ddl_conv_size: int = 4  # K of the TC compressor and of EC
    ddl_state_dtype: str = "float32"  # dtype X is stored in: "float32" (= parameter dtype) | "bfloat16"
    attention: str = "softmax"
    deltaformer_w: str = "k"
    deltaformer_kernel: str = "softmax"
    deltaformer_beta_max: float = 2.0
    backend: str = "auto"  # kernels' backend: "auto" | "torch" | "triton" (not an architecture choice)

    def __post_init__(self):
        def choice(name, allowed):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {value!r}")

        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")

        def boolean(name):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")

        choice("residual", RESIDUALS)
        choice("attention", ATTENTIONS)
        choice("deltaformer_w", DELTAFORMER_WS)
        choice("deltaformer_kernel", DELTAFORMER_KERNELS)
        choice("backend", BACKENDS)
        choice("ddl_v", DDL_VS)
        choice("ddl_state_dtype", DDL_STATE_DTYPES)
        for name in ("n_layer", "n_head", "n_embd", "head_dim", "block_size", "vocab_size", "ddl_conv_size"):
            positive_int(name)
        for name in ("ddl_ec", "ddl_erase"):
            boolean(name)
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.mlp_hidden is not None:
            positive_int("mlp_hidden")

        def number(name, ok, allowed):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"GPTConfig.{name} must be a number {allowed}, got {value!r}")

        number("dropout", lambda x: 0 <= x < 1, "in [0, 1)")
        number("rope_base", lambda x: x > 0, "> 0")
        number("ddl_beta_init", lambda x: 0 < x < 2, "in (0, 2) (beta = 2 sigmoid(.))")
        number("deltaformer_beta_max", lambda x: x > 0, "> 0")
        # d_v: resolved here so that asdict() -> GPTConfig(**) round-trips to the same model.
        if self.residual == "additive":
            if self.ddl_dv is not None:
                raise ValueError(
                    f"GPTConfig.ddl_dv must be None for residual='additive' (DDL only), got {self.ddl_dv!r}"
                )
        elif self.residual == "ddl":
            if self.ddl_dv not in (None, 1):
                raise ValueError(
                    f"GPTConfig.ddl_dv must be 1 (or None) for residual='ddl' (the d_v = 1 variant; use "
                    f"'ddl-cc' or 'ddl-tc' for a matrix state), got {self.ddl_dv!r}"
                )
            self.ddl_dv = 1
        else:
            if self.ddl_dv is None:
                self.ddl_dv = 4
            positive_int("ddl_dv")

    @classmethod
    def preset(cls, name, **overrides):
        """Paper Table 6 shapes: "gpt2-small" (12L, d 768, 6x128), "gpt2-medium" (24L, d 1024, 8x128)."""
        if name not in PRESETS:
            raise ValueError(f"GPTConfig.preset: name must be one of {tuple(PRESETS)}, got {name!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"GPTConfig.preset: unknown field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def is_ddl(self):
        return self.residual != "additive"

    @property
    def uses_ec(self):
        return self.ddl_ec and self.residual in ("ddl-tc", "ddl-cc")

    @property
    def hidden(self):
        return self.mlp_hidden if self.mlp_hidden is not None else (8 * self.n_embd) // 3


class Cache:
    """Decoding state: `pos` tokens seen so far, and per-module tensors (keyed by the module)."""

    def __init__(self):
        self.pos = 0
        self.store = {}


def with_history(cache, module, x, n):
    """x [B, T, ...] with the module's last n cached steps in front (zeros at the start of the sequence,
    i.e. the same zero padding a causal conv uses at t < 0); remembers the last n steps for next time."""
    if n == 0:
        return x
    past = cache.store.get(module)
    if past is None:
        past = x.new_zeros((x.shape[0], n) + tuple(x.shape[2:]))
    full = torch.cat([past, x], dim=1)
    cache.store[module] = full[:, -n:]
    return full


# ---------------------------------------------------------------------------------------------------------
# Small pieces


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (or float64), returned in x's dtype."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight.to(xf.dtype)
        return y.to(x.dtype)


def rope_tables(length, D, base):
    """cos, sin [length, D/2] of the angles t / base^(2i/D), t < length, in float64."""
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [B, H, T, D] by the angles of cos, sin [T, D/2]."""
    dt = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.to(dt), sin.to(dt)
    x1, x2 = x.to(dt).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def fp32_linear(x, weight, bias=None):
    """F.linear in fp32 (float64 stays float64) even under autocast: for the gates' and v's logits."""
    dt = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt))


class MLP(nn.Module):
    """SwiGLU: c_proj(silu(gate) * up), gate/up from one fused d -> 2*hidden matrix."""

    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 2 * cfg.hidden, bias=False)
        self.c_proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Causal self-attention: softmax (SDPA) or Deltaformer, with RoPE and QK-RMSNorm per head."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        width = cfg.n_head * cfg.head_dim
        self.deltaformer = cfg.attention == "deltaformer"
        n_proj = 4 if (self.deltaformer and cfg.deltaformer_w == "proj") else 3  # q, k, v (, w)
        self.c_attn = nn.Linear(cfg.n_embd, n_proj * width, bias=False)
        self.c_proj = nn.Linear(width, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim)
        self.k_norm = RMSNorm(cfg.head_dim)
        if n_proj == 4:
            self.w_norm = RMSNorm(cfg.head_dim)
        if self.deltaformer:
            self.beta = nn.Linear(cfg.n_embd, cfg.n_head, bias=True)  # per-head gate, a bias like b_beta
        # RoPE angles of positions 0..block_size-1, computed once (recomputing the sines inside the compiled
        # q/k kernels cost 12% of a GPT-2 small training step, measured). Not saved in checkpoints.
        for name, table in zip(
            ("rope_cos", "rope_sin"), rope_tables(cfg.block_size, cfg.head_dim, cfg.rope_base)
        ):
            self.register_buffer(name, table, persistent=False)

    def rope(self, pos, T):
        """cos, sin [T, D/2] for positions pos..pos+T-1 (GPT.forward keeps pos + T <= block_size)."""
        return self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]

    def forward(self, c, pos=0, cache=None):
        B, T, _ = c.shape
        heads = self.c_attn(c).view(B, T, -1, self.n_head, self.head_dim)
        heads = heads.permute(2, 0, 3, 1, 4)  # [n, B, H, T, D], n = q, k, v (, w)
        cos, sin = self.rope(pos, T)
        q = apply_rope(self.q_norm(heads[0]), cos, sin)
        k = apply_rope(self.k_norm(heads[1]), cos, sin)
        v = heads[2]
        if self.deltaformer:
            y = self._deltaformer(c, q, k, v, heads, (cos, sin), cache)
        else:
            y = self._softmax(q, k, v, cache)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _softmax(self, q, k, v, cache):
        if cache is not None:  # append to the key/value cache; the T new queries see all of it
            if self in cache.store:
                k_past, v_past = cache.store[self]
                k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
            cache.store[self] = (k, v)
        T, S = q.shape[2], k.shape[2]
        dropout = self.cfg.dropout if self.training else 0.0
        if S == T:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # query t sits at S - T + t
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)

    def _deltaformer(self, c, q, k, v, heads, rope, cache):
        cfg = self.cfg
        if cfg.deltaformer_w == "q":
            w = q
        elif cfg.deltaformer_w == "k":
            w = k
        else:
            w = apply_rope(self.w_norm(heads[3]), *rope)
        beta = cfg.deltaformer_beta_max * torch.sigmoid(fp32_linear(c, self.beta.weight, self.beta.bias))
        beta = beta.transpose(1, 2)  # [B, H, T], fp32
        if cache is None:
            return deltaformer_attention(q, k, v, w, beta, kernel=cfg.deltaformer_kernel, backend=cfg.backend)
        if self not in cache.store:  # prefill: stage 1 for the whole prompt at once, then plain attention
            u = deltaformer_u_torch(k, v, w, beta, kernel=cfg.deltaformer_kernel)
            cache.store[self] = (k, u)
            return F.scaled_dot_product_attention(q, k, u, is_causal=True)
        # Decoding: token by token with the cached keys and u's (a chunk of T tokens loops T times).
        k_cache, u_cache = cache.store[self]
        outs = []
        for t in range(q.shape[2]):
            s = slice(t, t + 1)
            o_t, u_t = deltaformer_step(
                q[:, :, s], k[:, :, s], v[:, :, s], w[:, :, s], beta[:, :, s], k_cache, u_cache,
                kernel=cfg.deltaformer_kernel,
            )  # fmt: skip
            k_cache, u_cache = torch.cat([k_cache, k[:, :, s]], dim=2), torch.cat([u_cache, u_t], dim=2)
            outs.append(o_t)
        cache.store[self] = (k_cache, u_cache)
        return torch.cat(outs, dim=2)


# ---------------------------------------------------------------------------------------------------------
# The residual interface: how a sublayer reads from and writes to the stream. The only variant-specific code.


class Compressor(nn.Module):
    """DDL: reads the d-vector a sublayer (or the LM head) sees out of the state X [B, T, d, d_v]."""

    def __init__(self, cfg):
        super().__init__()
        self.kind, d, dv, K = cfg.residual, cfg.n_embd, cfg.ddl_dv, cfg.ddl_conv_size
        self.backend = cfg.backend
        if self.kind == "ddl-cc":
            self.weight = nn.Parameter(torch.full((d, dv), 1.0 / dv))
        elif self.kind == "ddl-tc":
            self.conv = nn.Parameter(identity_conv(d, dv, K))
            self.read = nn.Parameter(torch.full((dv,), 1.0 / dv))

    def forward(self, X, cache=None):
        if self.kind == "ddl":
            return X[..., 0]
        if self.kind == "ddl-cc":
            return compress_cc(X, self.weight, backend=self.backend)
        T, K = X.shape[1], self.conv.shape[-1]
        if cache is not None:  # the conv needs the K-1 states before the new ones
            X = with_history(cache, self, X, K - 1)
        return compress_tc(X, self.conv, self.read, backend=self.backend)[:, X.shape[1] - T :]


def identity_conv(d, dv, K):
    """[d, d_v, K] causal conv weight that passes the current token through (last tap 1, others 0)."""
    w = torch.zeros(d, dv, K)
    w[:, :, K - 1] = 1.0
    return w


class Residual(nn.Module):
    """One sublayer's residual connection: pre-norm, run F, write the result into the stream."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.is_ddl:
            self.compress = Compressor(cfg)
            self.v_proj = nn.Linear(cfg.n_embd, cfg.ddl_dv, bias=cfg.ddl_v == "sigmoid")  # W_v (, b_v)
            self.beta = nn.Linear(cfg.n_embd, 1, bias=True)  # w_beta, b_beta

    def forward(self, X, sublayer, cache=None, x_in=None, next_read=None):
        """Returns (new stream, the next sublayer's input if this write computed it already, else None).

        x_in: this sublayer's compressed input when the previous write produced it; next_read: the
        Compressor that reads the stream after this sublayer (DDL-CC fuses that read into the update).
        """
        if not self.cfg.is_ddl:
            return X + self.drop(sublayer(self.norm(X))), None
        if x_in is None:
            x_in = self.compress(X, cache)
        c = self.norm(x_in.to(self.norm.weight.dtype))  # a bf16 state's read joins the parameter dtype
        h = self.drop(sublayer(c))
        return self.ddl_write(X, c, h, next_read)

    def value_and_gate(self, c):
        """(v [B, T, d_v], beta [B, T]), fp32: v = W_v c (ddl_v="sigmoid": 4 sigmoid(W_v c + b_v)) and
        beta = 2 sigmoid(w_beta . c + b_beta). One fp32 matmul with W_v and w_beta stacked, so that c is
        read once (forward and backward), not twice: these thin matmuls are memory-bound."""
        dv = self.cfg.ddl_dv
        weight = torch.cat([self.v_proj.weight, self.beta.weight])
        v_bias = self.v_proj.bias if self.v_proj.bias is not None else self.beta.bias.new_zeros(dv)
        logits = fp32_linear(c, weight, torch.cat([v_bias, self.beta.bias]))
        v, beta_logit = logits[..., :dv], logits[..., dv]
        if self.cfg.ddl_v == "sigmoid":
            v = DDL_V_SCALE * torch.sigmoid(v)
        return v, 2.0 * torch.sigmoid(beta_logit)

    def ddl_write(self, X, c, h, next_read=None):
        """X + beta khat (v^T - khat^T X) with k = h, (v, beta) = value_and_gate(c): where the update runs.

        The kernels normalise h and do the update in fp32 whatever the input dtypes; the new state comes
        back in X's dtype. When the next reader is a CC compressor, one fused kernel also returns its read
        (saves a pass over the d x d_v state). Returns (X_new, next x_in or None).
        """
        v, beta = self.value_and_gate(c)
        kw = dict(eps=DDL_EPS, erase=self.cfg.ddl_erase, backend=self.cfg.backend)
        if next_read is not None and next_read.kind == "ddl-cc":
            return ddl_update_compress_cc(X, h, v, beta, next_read.weight, **kw)
        return ddl_update(X, h, v, beta, **kw), None


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.res_attn = Residual(cfg)
        self.attn = Attention(cfg)
        self.res_mlp = Residual(cfg)
        self.mlp = MLP(cfg)

    def forward(self, X, x_in=None, pos=0, cache=None, next_read=None):
        """(stream, precomputed input or None) -> the same after attention and MLP (see Residual)."""
        mlp_read = getattr(self.res_mlp, "compress", None)
        X, x_in = self.res_attn(X, lambda c: self.attn(c, pos, cache), cache, x_in, mlp_read)
        return self.res_mlp(X, self.mlp, cache, x_in, next_read)


# ---------------------------------------------------------------------------------------------------------
# The model


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.uses_ec:
            self.ec_conv = nn.Parameter(identity_conv(cfg.n_embd, cfg.ddl_dv, cfg.ddl_conv_size))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        if cfg.is_ddl:
            self.readout = Compressor(cfg)
        self.ln_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        cfg = self.config
        if self.wte.weight.is_meta:  # built on the meta device (to count or to materialise later): no data
            return
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
            if cfg.is_ddl:
                for res in (block.res_attn, block.res_mlp):
                    nn.init.zeros_(res.beta.weight)
                    p = cfg.ddl_beta_init / 2
                    res.beta.bias.fill_(math.log(p / (1 - p)))

    def embed(self, idx, cache=None):
        """The initial stream: emb [B, T, d] (additive) or X0 [B, T, d, d_v] (DDL)."""
        cfg = self.config
        emb = self.drop(self.wte(idx))
        if not cfg.is_ddl:
            return emb
        emb = emb.to(self.state_dtype)  # EC then writes X0 in that dtype (it computes in fp32)
        if not cfg.uses_ec:
            return emb[..., None].expand(*emb.shape, cfg.ddl_dv).contiguous()
        T = emb.shape[1]
        if cache is not None:
            emb = with_history(cache, self, emb, cfg.ddl_conv_size - 1)
        return expand_ec(emb, self.ec_conv, backend=cfg.backend)[:, emb.shape[1] - T :]

    @property
    def state_dtype(self):
        """The dtype the DDL state X is stored in (cfg.ddl_state_dtype; "float32" = the parameters')."""
        if self.config.ddl_state_dtype == "bfloat16":
            return torch.bfloat16
        return self.wte.weight.dtype

    def reader_after(self, i):
        """The Compressor that reads the DDL state after block i (None for additive)."""
        if not self.config.is_ddl:
            return None
        return self.blocks[i + 1].res_attn.compress if i + 1 < len(self.blocks) else self.readout

    def hidden_states(self, idx, cache=None):
        """Final-normed features [B, T, d] of tokens idx; with a cache, idx continues the cached sequence."""
        cfg = self.config
        B, T = idx.shape
        pos = 0 if cache is None else cache.pos
        if pos + T > cfg.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size {cfg.block_size}")
        X, x_in = self.embed(idx, cache), None
        if cfg.is_ddl:  # the first read here, so every Block gets an x_in (one compiled Block serves all)
            x_in = self.blocks[0].res_attn.compress(X, cache)
        for i, block in enumerate(self.blocks):
            X, x_in = block(X, x_in, pos, cache, next_read=self.reader_after(i))
        if not cfg.is_ddl:
            x = X
        else:
            x = (x_in if x_in is not None else self.readout(X, cache)).to(self.ln_f.weight.dtype)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx, targets=None):
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be int64 [B, T], got {idx.dtype} {tuple(idx.shape)}")
        if targets is not None and (targets.shape != idx.shape or targets.dtype != torch.long):
            raise ValueError(
                f"targets must be int64 {tuple(idx.shape)}, got {targets.dtype} {tuple(targets.shape)}"
            )
        x = self.hidden_states(idx)
        if targets is None:  # inference: only the last position (nanoGPT convention)
            return self.lm_head(x[:, -1:]), None
        return self.logits_and_loss(x, targets)

    def logits_and_loss(self, x, targets):
        """LM head and mean cross-entropy (-1 ignored) of final-normed features x [B, T, d]. A method of
        its own so that a regional compile (bench_train.py --compile-scope blocks) can compile it too."""
        logits = self.lm_head(x)
        # (autocast runs cross_entropy in fp32)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx [B, T]. top_k=1 is greedy (argmax).

        Uses the cache while the sequence fits in block_size; after that it crops like nanoGPT (plain
        forward over the last block_size tokens per new token: the window slides, no cache applies).
        """
        block_size = self.config.block_size
        cache = None
        for _ in range(max_new_tokens):
            if idx.size(1) > block_size:
                cache = None
                logits = self.lm_head(self.hidden_states(idx[:, -block_size:])[:, -1])
            elif cache is None:
                cache = Cache()
                logits = self.lm_head(self.hidden_states(idx, cache)[:, -1])
            else:
                logits = self.lm_head(self.hidden_states(idx[:, -1:], cache)[:, -1])
            idx = torch.cat([idx, self.sample(logits, temperature, top_k)], dim=1)
        return idx

    @staticmethod
    def sample(logits, temperature=1.0, top_k=None):
        """logits [B, V] -> token ids [B, 1]."""
        if top_k == 1:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)

    def num_params(self, non_embedding=False):
        """Parameter count (the tied embedding / LM head once); non_embedding=True leaves it out."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def flops_per_token(self, T):
        """Forward + backward FLOPs per token at sequence length T (PaLM-style estimate, as nanoGPT's MFU).

        6 N for the weights (N = all parameters: every one is used once per token in a multiply-add,
        including the tied LM head, the DDL gates, W_v, the compressors and EC, whose work is linear in
        their weights too) + 12 L H D T for attention scores and values (softmax; full T, as PaLM).
        Deltaformer adds stage 1 (w.k scores and kappa @ u: the same size again), so 24 L H D T.
        DDL adds ddl_update per sublayer, not a matmul: ~4 d d_v (khat^T X and the rank-1 write) + 3 d
        (normalising h) forward, times 3 for forward + backward.
        """
        cfg = self.config
        flops = 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
        if cfg.attention == "deltaformer":
            flops += 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
        if cfg.is_ddl:
            flops += 3 * 2 * cfg.n_layer * (4 * cfg.n_embd * cfg.ddl_dv + 3 * cfg.n_embd)
        return flops
