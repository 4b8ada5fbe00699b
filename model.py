"""GPT with switchable residual (additive | Deep Delta Learning) and attention (softmax | Deltaformer).
The defaults build the model of the DDL authors' released code (arXiv 2601.00417); where the paper's text
differs, the text is a named option. Read top to bottom: config, small pieces, the attentions and the
residual rules (the variant-specific code, each a registered class: an attention's attend(q, k, v, ...), a
rule per sublayer, rule(stream, F) -> stream, with its RuleSpec), Block, GPT. The stream is a vector
x [B, T, d] (additive) or, for DDL, a state X [B, T, d, d_v] per token in a DDLStream:

    additive:  x <- x + F(RMSNorm(x))
    DDL:       x_in = compress(X);  c = RMSNorm(x_in);  h = F(c);  khat = h / sqrt(|h|^2 + eps^2)
               v = 4 sigmoid(W_v x_in + b_v)        (ddl_v="linear": v = W_v c, the paper's text)
               beta = 2 sigmoid(W_beta c + b_beta)  (in (0, 2): identity .. reflection)
               X <- X + beta khat (v^T - khat^T X)  (ddl_erase=False: X <- X + beta khat v^T)

compress: a Compressor per block and one before the final norm. X0: the embedding d_v times, or with EC a
causal conv of it. Norms, gates and updates compute in fp32; X is stored in `ddl_state_dtype`.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from ops.attn import softmax_attention
from ops.common import BACKENDS, EOT, acc_dtype, doc_starts, fp32_linear, left_padding
from ops.ddl import expand_ec
from ops.ddl.stream import Compressor, DDLStream, history_doc_start, identity_conv
from ops.deltaformer import deltaformer_attention
from ops.rope import rms_norm, rope_norm, rope_tables

RESIDUALS = {}  # residual name -> its rule, a module class per sublayer (filled below, after the rules)
ATTENTIONS = {}  # attention name -> its module class (filled below, after the attentions)
CHOICES = {  # GPTConfig fields with a fixed set of values
    "residual": RESIDUALS, "attention": ATTENTIONS, "deltaformer_w": ("q", "k", "proj"),
    "deltaformer_kernel": ("softmax", "relu", "linear"), "backend": BACKENDS, "init": ("scaled", "nanogpt"),
    "ddl_v": ("sigmoid", "linear"), "ddl_state_dtype": ("float32", "bfloat16"),
    "ddl_state_rounding": ("nearest", "stochastic"),
}  # fmt: skip
DDL_EPS = 1e-5  # khat = h / sqrt(|h|^2 + eps^2)
DDL_V_SCALE = 4.0  # v = 4 sigmoid(.) in (0, 4)
INIT_STD_FACTOR = 0.5  # init="scaled": std = 0.5 / sqrt(d)
EMBED_STD = 0.02

PRESETS = {
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=6, head_dim=128),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=8, head_dim=128),
}


@dataclass
class GPTConfig:
    n_layer: int = 12  # blocks (each: attention and MLP sublayers)
    n_head: int = 6  # attention heads (n_head * head_dim need not equal n_embd)
    n_embd: int = 768  # width d of the residual stream
    head_dim: int = 128  # width of each attention head (even: RoPE rotates pairs)
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
    mlp_hidden: int | None = None  # None -> floor(8 n_embd / 3)
    rope_base: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-5  # epsilon of every RMSNorm
    init: str = "scaled"  # "scaled" (the DDL code's, every row) | "nanogpt"
    dropout: float = 0.0  # in training: on the embeddings, attention weights and sublayer outputs
    doc_mask: bool = False  # True: a document begins at each EOT; no token sees an earlier one (README)
    residual: str = "additive"  # a name in RESIDUALS: "additive" | DDL: "ddl" (d_v = 1), "ddl-tc", "ddl-cc"
    ddl_dv: int | None = None  # None -> the rule's d_v (1 for "ddl") or 4; None for a vector-stream rule
    ddl_ec: bool = True  # EC expansion of the embedding (rules whose spec has ec: "ddl-tc", "ddl-cc")
    ddl_erase: bool = True  # False: the write-only control X <- X + beta khat v^T
    ddl_beta_init: float = 1.0  # b_beta = logit(beta0 / 2): beta starts near beta0 (exactly, if W_beta = 0)
    ddl_v: str = "sigmoid"  # "sigmoid": 4 sigmoid(W_v x_in + b_v) (the code) | "linear": W_v c (the text)
    ddl_conv_size: int = 4  # K of the TC compressor and of EC
    ddl_state_dtype: str = "float32"  # dtype X is stored in: "float32" (= parameter dtype) | "bfloat16"
    ddl_state_rounding: str = "nearest"  # a bf16 X's: "nearest" | "stochastic" (unbiased, ops/ddl)
    # autograd keeps the state entering every Nth block, the backward rebuilds the others from it (less
    # memory, more backward work). None: 0 at d_v = 1 (kept anyway as input), else 4
    ddl_keep_state_every: int | None = None  # N: keep the state entering every Nth block; 0: every sublayer's
    attention: str = "softmax"  # a name in ATTENTIONS: "softmax" (causal attention) | "deltaformer"
    deltaformer_w: str = "k"  # w of kappa(w_i, k_j): "k" | "q" | "proj" (its own projection)
    deltaformer_kernel: str = "softmax"  # kappa: "softmax" | "relu" | "linear" (of unit w, k)
    # beta = beta_max sigmoid(.) in (0, beta_max). <= 1 bounds stage 1 for every softmax kappa (rows sum to 1,
    # so |u| <= T max|v|); up to 2 (reflections) is bounded only for linear kappa with w = k (README)
    deltaformer_beta_max: float = 1.0  # beta_i = deltaformer_beta_max * sigmoid(Linear(c)), per head
    backend: str = "auto"  # kernels' backend: "auto" | "torch" | "triton" (not an architecture choice)

    def __post_init__(self):
        def check(name, ok, what):
            if not ok(getattr(self, name)):
                raise ValueError(f"GPTConfig.{name} must be {what}, got {getattr(self, name)!r}")

        def number(ok, kind=(int, float)):
            return lambda x: isinstance(x, kind) and not isinstance(x, bool) and ok(x)

        positive_int = number(lambda x: x >= 1, int)
        for name, allowed in CHOICES.items():
            check(name, lambda x, allowed=allowed: x in allowed, f"one of {tuple(allowed)}")
        for name in ("n_layer", "n_head", "n_embd", "head_dim", "block_size", "vocab_size", "ddl_conv_size"):
            check(name, positive_int, "a positive int")
        check("mlp_hidden", lambda x: x is None or positive_int(x), "a positive int or None")
        for name in ("ddl_ec", "ddl_erase", "doc_mask"):
            check(name, lambda x: isinstance(x, bool), "True or False")
        check("head_dim", lambda x: x % 2 == 0, "even (RoPE rotates pairs)")
        check("dropout", number(lambda x: 0 <= x < 1), "a number in [0, 1)")
        for name in ("rope_base", "norm_eps", "deltaformer_beta_max"):
            check(name, number(lambda x: x > 0), "a number > 0")
        check("ddl_beta_init", number(lambda x: 0 < x < 2), "a number in (0, 2) (beta = 2 sigmoid(.))")
        spec, has = self.spec, f"; {self.residual!r} ({RESIDUALS[self.residual].__name__}) has {self.spec!r}"
        check("residual", lambda _: isinstance(spec, RuleSpec), f"a rule whose spec is a RuleSpec{has}")
        for key, ok, what in (  # the rule's spec: each field known, the fields consistent
            ("stream", spec.stream == "ddl" or spec == RuleSpec(), "'ddl', or 'vector' with no other field"),
            ("dv", spec.dv == 1 if spec.compressor is None and self.is_ddl else spec.dv is None
             or positive_int(spec.dv), "None or a positive int (1 with compressor=None: x_in = X[..., 0])"),
            ("compressor", spec.compressor in (None, "cc", "tc"), "one of (None, 'cc', 'tc')"),
            ("ec", isinstance(spec.ec, bool), "True or False"),
            ("gate", spec.gate in (None, "2sigmoid"), "None or '2sigmoid'"),
        ):  # fmt: skip
            check("residual", lambda _, ok=ok: ok, f"a rule whose spec.{key} is {what}{has}")
        if self.is_ddl and self.ddl_dv is None:  # resolved here so that asdict() -> GPTConfig(**) round-trips
            self.ddl_dv = spec.dv or 4
        want = f"{spec.dv} or None" if spec.dv else "a positive int" if self.is_ddl else "None"
        ok_dv = lambda x: positive_int(x) and x == (spec.dv or x) if self.is_ddl else x is None
        check("ddl_dv", ok_dv, f"{want} for residual={self.residual!r}")
        if self.ddl_keep_state_every is None:
            self.ddl_keep_state_every = 0 if self.ddl_dv in (None, 1) else 4
        check("ddl_keep_state_every", number(lambda x: x >= 0, int), "an int >= 0")
        bf16 = self.ddl_state_dtype == "bfloat16"
        check("ddl_state_rounding", lambda x: x == "nearest" or bf16, "'nearest' for a float32 state")

    @classmethod
    def preset(cls, name, **overrides):
        """Paper Table 6 shapes: "gpt2-small" (12L, d 768, 6x128), "gpt2-medium" (24L, d 1024, 8x128)."""
        if name not in PRESETS:
            raise ValueError(f"GPTConfig.preset: name must be one of {tuple(PRESETS)}, got {name!r}")
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"GPTConfig.preset: unknown field(s) {unknown}; the fields are GPTConfig's")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def spec(self):  # the residual rule's RuleSpec (checked in __post_init__); is_ddl: its stream is DDL's
        return getattr(RESIDUALS[self.residual], "spec", Additive.spec)

    is_ddl = property(lambda self: self.spec.stream == "ddl")

    @property
    def hidden(self):
        return self.mlp_hidden if self.mlp_hidden is not None else (8 * self.n_embd) // 3


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (or float64), returned in x's dtype."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dt = acc_dtype(x)
        return rms_norm(x.to(dt), self.weight.to(dt), self.eps).to(x.dtype)

    def inv_rms(self, xf):  # 1 / rms(x) [..., 1]
        return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)


class MLP(nn.Module):
    """SwiGLU: c_proj(silu(gate) * up), gate/up from one fused d -> 2*hidden matrix."""

    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 2 * cfg.hidden, bias=False)
        self.c_proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)

    def forward(self, x):  # on x as [B*T, d]: the same matmuls, fewer ops than on [B, T, d]
        gate, up = self.c_fc(x.flatten(0, -2)).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up).view_as(x)


class Attention(nn.Module):
    """Causal self-attention's shared part: c_attn projects c to q, k, v (and w, with own_w) per head, RoPE
    then a learnable RMSNorm per head on q and k (and w), c_proj mixes the heads. A subclass is how the heads
    attend, attend(c, q, k, v, w, cache) -> y [B, H, T, D], with what cache; its init_weights(scaled), if
    any, runs after GPT drew every matrix. `shared`: GPT's module of the parameters every block shares."""

    stages = 1  # its T x T products, in units of softmax attention's (GPT.flops_per_token)

    def __init__(self, cfg, shared, own_w=False):
        super().__init__()
        self.cfg, self.__dict__["shared"] = cfg, shared  # not a submodule: GPT saves shared.<name> once
        self.n_head, self.head_dim, width = cfg.n_head, cfg.head_dim, cfg.n_head * cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, (4 if own_w else 3) * width, bias=False)  # q, k, v (, w)
        self.c_proj = nn.Linear(width, cfg.n_embd, bias=False)
        self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps), RMSNorm(cfg.head_dim, cfg.norm_eps)
        if own_w:
            self.w_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        # RoPE angles of positions < block_size, once (recomputed in the compiled q/k kernels they cost 12% of
        # a GPT-2 small training step, measured). Not saved in checkpoints.
        cos, sin = rope_tables(cfg.block_size, cfg.head_dim, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, c, pos=0, cache=None, doc_start=None):
        B, T, _ = c.shape
        heads = self.c_attn(c.flatten(0, 1)).view(B, T, -1, self.n_head, self.head_dim)  # matmuls on [B*T, d]
        heads = heads.permute(2, 0, 3, 1, 4)  # [n, B, H, T, D], n = q, k, v (, w)
        at = slice(pos, pos + T) if isinstance(pos, int) else pos + torch.arange(T, device=c.device)
        if doc_start is not None:  # positions restart at each document: QK-norm after RoPE is not relative
            at = (pos + torch.arange(T, device=c.device) - doc_start)[:, None]  # [B, 1, T]
        cos, sin = self.rope_cos[at], self.rope_sin[at]  # pos + T <= block_size (a tensor: StaticCache)
        own_w = heads.shape[0] == 4  # roped and normed as k, in the same pass as q and k
        norms = (self.q_norm, self.k_norm, self.w_norm) if own_w else (self.q_norm, self.k_norm)
        q, k, *w = rope_norm(heads[[0, 1, 3]] if own_w else heads[:2], cos, sin, norms)
        y = self.attend(c, q, k, heads[2], w[0] if w else None, cache, doc_start)
        return self.c_proj(y.transpose(1, 2).reshape(B * T, -1)).view(B, T, -1)


class SoftmaxAttention(Attention):
    """softmax(q k^T / sqrt(D) + causal mask) v (ops/attn); a cache keeps the keys and values."""

    def attend(self, c, q, k, v, w, cache, doc_start=None):
        if cache is not None:  # the cached keys/values with the T new ones (static: the whole buffer)
            k, v = cache.extend(self, k, v)
        dropout, pos = self.cfg.dropout if self.training else 0.0, 0 if cache is None else cache.pos
        return softmax_attention(q, k, v, pos, doc_start, dropout)


class DeltaformerAttention(Attention):
    """u_i = v_i - beta_i sum_{j<i} kappa(w_i, k_j) u_j, then softmax attention over the u's; w = k, q or its
    own (deltaformer_w), beta = deltaformer_beta_max sigmoid(W_beta c + b_beta) per head; cached: k, u."""

    stages = 2  # stage 1 (the u's) and stage 2
    beta_logit = True  # False: no W_beta, b_beta (a subclass whose gate() gives beta without them)

    def __init__(self, cfg, shared):
        super().__init__(cfg, shared, own_w=cfg.deltaformer_w == "proj")
        if self.beta_logit:
            self.beta = nn.Linear(cfg.n_embd, cfg.n_head, bias=True)  # per-head gate

    def gate(self, c):  # beta [B, H, T] in fp32
        beta = self.cfg.deltaformer_beta_max * torch.sigmoid(fp32_linear(c, self.beta.weight, self.beta.bias))
        return beta.transpose(1, 2)

    def attend(self, c, q, k, v, w, cache, doc_start=None):
        cfg, kernel = self.cfg, self.cfg.deltaformer_kernel
        w, beta = {"q": q, "k": k}.get(cfg.deltaformer_w, w), self.gate(c)
        if cache is None:
            return deltaformer_attention(q, k, v, w, beta, kernel, backend=cfg.backend, doc_start=doc_start)
        return cache.deltaformer(self, q, k, v, w, beta, kernel, doc_start)

    def init_weights(self, scaled):  # b_beta = 0: beta starts near beta_max / 2
        if self.beta_logit:
            nn.init.zeros_(self.beta.bias)


ATTENTIONS.update({"softmax": SoftmaxAttention, "deltaformer": DeltaformerAttention})


# ---- The residual rules: a module per sublayer, rule(stream, F) -> the stream after F read and wrote it.
# The stream is what the rule's spec chooses: a tensor x [B, T, d] (additive), or a DDLStream around X (DDL).


@dataclass(frozen=True)
class RuleSpec:  # what a rule needs around it, its `spec` (RuleSpec() if none): read instead of its name
    stream: str = "vector"  # "vector": x [B, T, d] | "ddl": a DDLStream around X [B, T, d, d_v]
    dv: int | None = None  # d_v, if the rule fixes it; None: GPTConfig.ddl_dv's (4 if None)
    compressor: str | None = None  # how sublayers read X: None (X[..., 0], d_v = 1) | "cc" | "tc"
    ec: bool = False  # with ddl_ec, X0 is EC's causal conv of the embedding (else the embedding d_v times)
    gate: str | None = None  # "2sigmoid": beta = 2 sigmoid(W_beta c + b_beta) (DDL's formula tests apply)


class Additive(nn.Module):
    """x <- x + F(RMSNorm(x)). `shared`: GPT's module of parameters every block shares."""

    spec = RuleSpec()

    def __init__(self, cfg, shared):
        super().__init__()
        self.__dict__["shared"] = shared  # not a submodule: GPT saves shared.<name> once
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, sublayer):
        return x + self.drop(sublayer(self.norm(x)))


class Residual(Additive):
    """DDL: x_in = compress(X); c = RMSNorm(x_in); h = F(c); X <- X + beta khat (v^T - khat^T X); d_v = 1."""

    spec = RuleSpec(stream="ddl", dv=1, gate="2sigmoid")
    beta_logit = True  # False: no W_beta, b_beta (a rule whose value_and_gate gives beta without them)

    def __init__(self, cfg, shared):
        super().__init__(cfg, shared)  # the norm and the dropout
        self.cfg = cfg
        self.v_proj = nn.Linear(cfg.n_embd, cfg.ddl_dv, bias=cfg.ddl_v == "sigmoid")  # W_v (, b_v)
        if self.beta_logit:
            self.beta = nn.Linear(cfg.n_embd, 1, bias=True)  # W_beta, b_beta

    def forward(self, stream, sublayer):
        W, norm = self.logit_weight(), self.norm  # c = RMSNorm(x_in); z = W x_in: v's and beta's logits
        c, z, inv_rms = stream.read_normed(norm.weight, norm.eps, W) or self.normed(stream.read(), W)
        h = self.drop(sublayer(c))  # F(c); khat = h / sqrt(|h|^2 + eps^2), in the update
        # deferred: the update runs at the next read, fused with it (d_v = 1: and its norm), one pass over X
        return stream.write(h, *self.value_and_gate(z, inv_rms))

    def normed(self, x_in, W):  # (c, z, inv_rms) of x_in, as the stream's read_normed gives them
        x_in = x_in.to(self.norm.weight.dtype)  # a bf16 state's read joins the parameter dtype
        return self.norm(x_in), fp32_linear(x_in, W), self.norm.inv_rms(x_in)

    def logit_weight(self):  # v's rows, then beta's if the rule has W_beta: all from one product of x_in
        g, linear = self.norm.weight, self.cfg.ddl_v == "linear"  # W c = (W g) x_in / rms(x_in), g c's norm
        v = self.v_proj.weight * g if linear else self.v_proj.weight
        return torch.cat([v, self.beta.weight * g]) if self.beta_logit else v

    def value_and_gate(self, z, inv_rms):  # (v [B, T, d_v], beta [B, T]) in fp32 from z and 1 / rms(x_in)
        z, z_beta = z.split([z.shape[-1] - 1, 1], -1)
        return self.value(z, inv_rms), (2.0 * torch.sigmoid(z_beta * inv_rms + self.beta.bias))[..., 0]

    def value(self, z, inv_rms):  # v [B, T, d_v] in fp32 from its logits z [B, T, d_v]
        linear = self.cfg.ddl_v == "linear"
        return z * inv_rms if linear else DDL_V_SCALE * torch.sigmoid(z + self.v_proj.bias)

    def init_weights(self, scaled):  # by GPT._init_weights, after it drew every matrix: b_beta, W_beta, b_v
        beta0, bound = self.cfg.ddl_beta_init, 1 / math.sqrt(self.cfg.n_embd) if scaled else 0.0
        if self.beta_logit:
            self.beta.bias.fill_(math.log(beta0 / (2 - beta0)))  # logit(beta0 / 2)
            if not scaled:
                nn.init.zeros_(self.beta.weight)
        if self.v_proj.bias is not None:
            nn.init.uniform_(self.v_proj.bias, -bound, bound)


class ResidualCC(Residual):  # DDL-CC: read through a conv along d_v, then a read over d_v; EC
    spec = RuleSpec(stream="ddl", compressor="cc", ec=True, gate="2sigmoid")


class ResidualTC(Residual):  # DDL-TC: read through a causal conv over the last K tokens, then a read; EC
    spec = RuleSpec(stream="ddl", compressor="tc", ec=True, gate="2sigmoid")


RESIDUALS.update({"additive": Additive, "ddl": Residual, "ddl-tc": ResidualTC, "ddl-cc": ResidualCC})


class Block(nn.Module):
    def __init__(self, cfg, shared):
        super().__init__()
        if cfg.is_ddl:  # one compressor per block: it reads the stream before attention and before the MLP
            self.compress = Compressor(cfg)
        rule = RESIDUALS[cfg.residual]
        self.res_attn, self.attn = rule(cfg, shared), ATTENTIONS[cfg.attention](cfg, shared)
        self.res_mlp, self.mlp = rule(cfg, shared), MLP(cfg)

    def forward(self, x, pos=0, cache=None, doc_start=None):
        x = self.res_attn(x, lambda c: self.attn(c, pos, cache, doc_start))
        return self.res_mlp(x, self.mlp)


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.ddl_ec and cfg.spec.ec:  # EC
            self.ec_conv = nn.Parameter(identity_conv(cfg.n_embd, cfg.ddl_dv, cfg.ddl_conv_size))
        self.shared = nn.Module()  # the parameters every block shares: a rule or attention sets each once
        self.blocks = nn.ModuleList(Block(cfg, self.shared) for _ in range(cfg.n_layer))
        if cfg.is_ddl:
            self.readout = Compressor(cfg)
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        """init="scaled" (the DDL code's): matrices N(0, 0.5/sqrt(d)), output projections N(0, 0.5/sqrt(d L)),
        b_v ~ U(+-1/sqrt(d)); "nanogpt": N(0, 0.02), N(0, 0.02/sqrt(2 L)), W_beta = b_v = 0, identity convs.
        Both: embedding N(0, 0.02), EC identity, b_beta = logit(ddl_beta_init / 2)."""
        cfg = self.config
        if self.wte.weight.is_meta:  # built on the meta device (to count or to materialise later): no data
            return
        scaled = cfg.init == "scaled"
        d, L = cfg.n_embd, cfg.n_layer
        std = INIT_STD_FACTOR / math.sqrt(d) if scaled else EMBED_STD
        out_std = std / math.sqrt(L) if scaled else EMBED_STD / math.sqrt(2 * L)
        for name, p in self.named_parameters():
            # the convs are built as identities: EC stays one, and under "nanogpt" the compressors' too
            identity = name == "ec_conv" or (name.endswith(".conv") and not scaled)
            if p.dim() >= 2 and not identity:
                nn.init.normal_(p, mean=0.0, std=std)
        nn.init.normal_(self.wte.weight, mean=0.0, std=EMBED_STD)
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=out_std)
            for m in (block.attn, block.res_attn, block.res_mlp):  # each one's own init, if it has one
                getattr(m, "init_weights", lambda scaled: None)(scaled)

    def embed(self, idx, cache=None, doc_start=None):
        """The initial stream: emb [B, T, d] (additive) or X0 [B, T, d, d_v] (DDL)."""
        cfg = self.config
        emb = self.drop(self.wte(idx))
        if not cfg.is_ddl:
            return emb
        emb = emb.to(torch.bfloat16 if cfg.ddl_state_dtype == "bfloat16" else emb.dtype)  # X's dtype
        if not hasattr(self, "ec_conv"):
            return emb[..., None].expand(*emb.shape, cfg.ddl_dv).contiguous()
        T, n = emb.shape[1], cfg.ddl_conv_size - 1
        if cache is not None:
            emb, doc_start = cache.history(self, emb, n), history_doc_start(doc_start, cache.pos, n)
        return expand_ec(emb, self.ec_conv, backend=cfg.backend, doc_start=doc_start)[:, emb.shape[1] - T :]

    def hidden_states(self, idx, cache=None, attention_mask=None):
        """Final-normed features [B, T, d] of tokens idx; with a cache (sample.py), idx continues the cached
        sequence (a StaticCache's pos is a tensor, checked by its owner: no sync in a compiled step).
        attention_mask [B, T] (1: token, 0: left padding, its own document): with a cache, the prompt's."""
        cfg = self.config
        T, pos = idx.shape[1], 0 if cache is None else cache.pos
        if isinstance(pos, int) and pos + T > cfg.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size {cfg.block_size}")
        doc = None  # doc_start [B, T] (ops/common.py) where documents or padding split a row
        if cfg.doc_mask or attention_mask is not None or getattr(cache, "documents", False):
            doc = doc_starts(idx, EOT if cfg.doc_mask else None, pos, left_padding(attention_mask, idx))
            doc = doc if cache is None else cache.doc_start(doc)
        x = self.embed(idx, cache, doc)  # [B, T, d], or X0 [B, T, d, d_v] for the stream of the DDL ops
        if cfg.is_ddl:
            sr = cfg.ddl_state_rounding == "stochastic"
            x = DDLStream(x, DDL_EPS, cfg.ddl_erase, cfg.backend, cfg.ddl_keep_state_every, cache, sr, doc)
        for block in self.blocks:  # a DDLStream reads through each block's compressor, then the readout
            x = block(x.enter(block.compress) if isinstance(x, DDLStream) else x, pos, cache, doc)
        x = (x.enter(self.readout).read() if isinstance(x, DDLStream) else x).to(self.ln_f.weight.dtype)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x)

    def forward(self, idx, targets=None, attention_mask=None):
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"idx must be int64 [B, T], got {idx.dtype} {tuple(idx.shape)}")
        if targets is not None and (targets.shape != idx.shape or targets.dtype != torch.long):
            raise ValueError(f"targets must be int64 {tuple(idx.shape)}, got {targets.dtype} {targets.shape}")
        x = self.hidden_states(idx, attention_mask=attention_mask)
        if targets is None:  # inference: only the last position (nanoGPT convention)
            return self.lm_head(x[:, -1:]), None
        return self.logits_and_loss(x, targets)

    def logits_and_loss(self, x, targets):
        """LM head and mean cross-entropy (-1 ignored) of final-normed x [B, T, d]."""
        logits = self.lm_head(x)  # (autocast runs cross_entropy in fp32)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def num_params(self, non_embedding=False):
        """Parameter count (the tied embedding / LM head once); non_embedding=True leaves it out."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def flops_per_token(self, T):
        """Forward + backward FLOPs per token at sequence length T (PaLM-style, as nanoGPT's MFU): 6 N for
        the weights + 12 L H D T for attention (Deltaformer's stage 1 doubles it) + the DDL updates,
        ~4 d d_v + 3 d per sublayer forward, x3 with the backward."""
        cfg = self.config
        stages = ATTENTIONS[cfg.attention].stages
        flops = 6 * self.num_params() + stages * 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
        if cfg.is_ddl:
            flops += 3 * 2 * cfg.n_layer * (4 * cfg.n_embd * cfg.ddl_dv + 3 * cfg.n_embd)
        return flops
