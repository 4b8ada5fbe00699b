"""Parity with the DDL authors' released model (deep-delta-learning, model/*.py, the paper's App. A.2).

`authors_forward` is an independent transcription, in plain PyTorch, of the forward pass of their files:
gpt_base.py (the additive baseline), DDL-vdim1-gpt-mha-rope.py (d_v = 1), DDL-gpt-mha-rope-CC-EC.py /
-CC.py (DDL-CC with / without EC), DDL-gpt-mha-rope-EC.py / DDL-gpt-mha-rope.py (DDL-TC with / without
EC), with their rmsnorm.py, rotary.py, shortconv.py (causal_conv1d) and init_utils.py. It takes the
weights under the authors' parameter names, copied from this repo's model; float64 logits must agree to
1e-9 relative. `test_init_matches_authors` checks the initial weights against their init rules.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, Residual

V = 67
VARIANTS = {
    "additive": dict(residual="additive"),
    "ddl": dict(residual="ddl"),
    "ddl-cc+ec": dict(residual="ddl-cc"),
    "ddl-tc+ec": dict(residual="ddl-tc"),
    "ddl-cc": dict(residual="ddl-cc", ddl_ec=False),
    "ddl-tc": dict(residual="ddl-tc", ddl_ec=False),
}


def tiny(**overrides):
    base = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=24, vocab_size=V, backend="torch")
    return GPTConfig(**{**base, **overrides})


def perturbed(cfg, seed=0):
    """A float64 model with every parameter moved off its init (unit norm weights, zero biases and
    identity convs would hide wiring mistakes)."""
    torch.manual_seed(seed)
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------------------------------------------------
# This repo's weights under the authors' names


def authors_params(model):
    """{authors' name: tensor}; fails if any parameter of this model is left over (e.g. a compressor
    per sublayer, which their blocks do not have)."""
    cfg = model.config
    W, hidden = cfg.n_head * cfg.head_dim, cfg.hidden
    d, dv = cfg.n_embd, cfg.ddl_dv
    used, out = set(), {}

    def take(name, p, value=None):
        used.add(id(p))
        out[name] = p if value is None else value

    take("transformer.wte.weight", model.wte.weight)
    take("ln_f.weight", model.ln_f.weight)
    for i, blk in enumerate(model.blocks):
        pre = f"transformer.h.{i}."
        for j, name in enumerate(("c_q", "c_k", "c_v")):
            take(
                pre + f"attn.{name}.weight",
                blk.attn.c_attn.weight,
                blk.attn.c_attn.weight[j * W : (j + 1) * W],
            )
        take(pre + "attn.c_proj.weight", blk.attn.c_proj.weight)
        take(pre + "attn.q_rms.weight", blk.attn.q_norm.weight)
        take(pre + "attn.k_rms.weight", blk.attn.k_norm.weight)
        take(pre + "mlp.c_fc1.weight", blk.mlp.c_fc.weight, blk.mlp.c_fc.weight[:hidden])
        take(pre + "mlp.c_fc2.weight", blk.mlp.c_fc.weight, blk.mlp.c_fc.weight[hidden:])
        take(pre + "mlp.c_proj.weight", blk.mlp.c_proj.weight)
        take(pre + "ln_1.weight", blk.res_attn.norm.weight)
        take(pre + "ln_2.weight", blk.res_mlp.norm.weight)
        if not cfg.is_ddl:
            continue
        for ddl, res in (("ddl_attn", blk.res_attn), ("ddl_mlp", blk.res_mlp)):
            take(pre + f"{ddl}.beta.weight", res.beta.weight)
            take(pre + f"{ddl}.beta.bias", res.beta.bias)
            take(pre + f"{ddl}.v_proj.weight", res.v_proj.weight)
            take(pre + f"{ddl}.v_proj.bias", res.v_proj.bias)
    if cfg.residual in ("ddl-cc", "ddl-tc"):
        for pre, comp in [
            (f"transformer.h.{i}.compress.", b.compress) for i, b in enumerate(model.blocks)
        ] + [("readout.", model.readout)]:
            take(pre + "read", comp.read)
            if cfg.residual == "ddl-cc":
                take(pre + "weight", comp.conv)  # [d, K = d_v]
            else:
                take(pre + "shortconv.weight", comp.conv, comp.conv.reshape(d * dv, -1))  # [d * d_v, K]
        if cfg.ddl_ec:
            take("input_embed.conv.weight", model.ec_conv, model.ec_conv.reshape(d * dv, 1, -1))
    left = [n for n, p in model.named_parameters() if id(p) not in used]
    assert left == [], f"parameters the authors' model does not have: {left}"
    return out


# ---------------------------------------------------------------------------------------------------------
# The authors' forward pass, transcribed


def rms_norm(x, weight, eps=1e-5):  # rmsnorm.py: x * rsqrt(mean(x^2) + eps) * weight
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def rotary(x, base=10000.0):  # rotary.py: Rotary + apply_rotary_emb on x [B, T, H, D]
    T, D = x.shape[1], x.shape[3]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    cos, sin = freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=3)


def attention(P, pre, x, H, D):  # CausalSelfAttention.forward_with_past without a cache
    B, T, _ = x.shape
    q = (x @ P[pre + "c_q.weight"].T).view(B, T, H, D)
    k = (x @ P[pre + "c_k.weight"].T).view(B, T, H, D)
    v = (x @ P[pre + "c_v.weight"].T).view(B, T, H, D)
    q, k = rotary(q), rotary(k)
    q, k = rms_norm(q, P[pre + "q_rms.weight"]), rms_norm(k, P[pre + "k_rms.weight"])  # after RoPE
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, H * D) @ P[pre + "c_proj.weight"].T


def mlp(P, pre, x):  # SwiGLU: c_proj(silu(c_fc1 x) * c_fc2 x)
    return (F.silu(x @ P[pre + "c_fc1.weight"].T) * (x @ P[pre + "c_fc2.weight"].T)) @ P[
        pre + "c_proj.weight"
    ].T


def delta_update(P, pre, X, k_in, v_in, context, k_eps=1e-5):
    """DeepDeltaResidualExpanded / DeepDeltaResidualVdim1.forward (X [B, T, d, d_v]; d_v = 1 holds x)."""
    d = k_in.shape[-1]
    k_rms = rms_norm(k_in, None, eps=k_eps * k_eps / d)
    k_scale = 1.0 / math.sqrt(d)
    beta = 2.0 * torch.sigmoid(context @ P[pre + "beta.weight"].T + P[pre + "beta.bias"])  # [B, T, 1]
    proj = (k_rms.unsqueeze(-1) * X).sum(-2) * k_scale  # [B, T, d_v]
    v = 4.0 * torch.sigmoid(v_in @ P[pre + "v_proj.weight"].T + P[pre + "v_proj.bias"])
    delta_row = beta * (v - proj) * k_scale
    return X + k_rms.unsqueeze(-1) * delta_row.unsqueeze(-2)


def compress_cc(P, pre, X):
    """ResidualShortConvCompressor (CC): a depthwise conv along d_v built by pad/unfold, then the read."""
    B, T, d, dv = X.shape
    weight = P[pre + "weight"]
    K = weight.shape[1]
    pad_total, pad_left = K - 1, (K - 1) // 2
    padded = F.pad(weight, (pad_total, pad_total))
    b = torch.arange(pad_total + pad_left, pad_left - 1, -1)
    new_weight = padded.unfold(-1, K, 1)[:, b, :]
    x_conv = torch.einsum("bdv,dkv->bdk", X.reshape(B * T, d, dv), new_weight)
    return (x_conv.reshape(B, T, d, dv) * P[pre + "read"]).sum(-1)


def causal_conv1d(x, weight):
    """causal_conv1d_fn(x [B, C, T], weight [C, K]): out[t] = sum_k weight[k] x[t - (K - 1) + k]."""
    K = weight.shape[1]
    return F.conv1d(F.pad(x, (K - 1, 0)), weight.unsqueeze(1), groups=x.shape[1])


def compress_tc(P, pre, X):
    """ResidualShortConvCompressor (TC): causal depthwise conv over tokens of the d*d_v channels, read."""
    B, T, d, dv = X.shape
    x_conv = causal_conv1d(X.reshape(B, T, d * dv).transpose(1, 2), P[pre + "shortconv.weight"])
    return (x_conv.transpose(1, 2).reshape(B, T, d, dv) * P[pre + "read"]).sum(-1)


def expand_ec(P, emb, dv):
    """InputEmbedShortConvExpander: Conv1d(d, d*d_v, K, groups=d) after a left pad of K-1."""
    B, T, d = emb.shape
    weight = P["input_embed.conv.weight"]
    y = F.conv1d(F.pad(emb.transpose(1, 2), (weight.shape[-1] - 1, 0)), weight, groups=d)
    return y.transpose(1, 2).reshape(B, T, d, dv)


def authors_forward(P, idx, cfg):
    H, D, dv = cfg.n_head, cfg.head_dim, cfg.ddl_dv
    expanded = cfg.residual in ("ddl-cc", "ddl-tc")
    compress = compress_cc if cfg.residual == "ddl-cc" else compress_tc
    emb = P["transformer.wte.weight"][idx]
    if not expanded:
        x = emb
    else:
        x = expand_ec(P, emb, dv) if cfg.ddl_ec else emb.unsqueeze(-1).repeat(1, 1, 1, dv)
    for i in range(cfg.n_layer):
        pre = f"transformer.h.{i}."
        if cfg.residual == "additive":  # GPTBlock
            x = x + attention(P, pre + "attn.", rms_norm(x, P[pre + "ln_1.weight"]), H, D)
            x = x + mlp(P, pre + "mlp.", rms_norm(x, P[pre + "ln_2.weight"]))
        elif cfg.residual == "ddl":  # vdim1 Block: v from the raw stream, beta from the normed one
            x_norm = rms_norm(x, P[pre + "ln_1.weight"])
            k = attention(P, pre + "attn.", x_norm, H, D)
            x = delta_update(P, pre + "ddl_attn.", x.unsqueeze(-1), k, x, x_norm)[..., 0]
            x_norm = rms_norm(x, P[pre + "ln_2.weight"])
            k = mlp(P, pre + "mlp.", x_norm)
            x = delta_update(P, pre + "ddl_mlp.", x.unsqueeze(-1), k, x, x_norm)[..., 0]
        else:  # expanded Block: one compressor, read before each sublayer
            x_in = compress(P, pre + "compress.", x)
            x_norm = rms_norm(x_in, P[pre + "ln_1.weight"])
            x = delta_update(P, pre + "ddl_attn.", x, attention(P, pre + "attn.", x_norm, H, D), x_in, x_norm)
            x_in = compress(P, pre + "compress.", x)
            x_norm = rms_norm(x_in, P[pre + "ln_2.weight"])
            x = delta_update(P, pre + "ddl_mlp.", x, mlp(P, pre + "mlp.", x_norm), x_in, x_norm)
    if expanded:
        x = compress(P, "readout.", x)
    return rms_norm(x, P["ln_f.weight"]) @ P["transformer.wte.weight"].T  # tied LM head


def relative_gap(model, cfg, seed=1):
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours, _ = model(idx, idx)
        theirs = authors_forward(authors_params(model), idx, cfg)
    return ((ours - theirs).norm() / theirs.norm()).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_authors_model(variant):
    cfg = tiny(**VARIANTS[variant])
    assert relative_gap(perturbed(cfg), cfg) < 1e-9


# Each difference this repo once had, put back one at a time: the parity test must see it.
def v_from_normed_input(monkeypatch):
    """v's logit from c = RMSNorm(x_in) instead of x_in: (W_v g) x_in / rms(x_in)."""
    weight, gate = Residual.logit_weight, Residual.value_and_gate

    def logit_weight(self):
        W = weight(self)
        return torch.cat([W[:-1] * self.norm.weight, W[-1:]])

    def value_and_gate(self, z, inv_rms):
        return gate(self, torch.cat([z[..., :-1] * inv_rms, z[..., -1:]], -1), inv_rms)

    monkeypatch.setattr(Residual, "logit_weight", logit_weight)
    monkeypatch.setattr(Residual, "value_and_gate", value_and_gate)


def eps_1e6(model):
    for m in model.modules():
        if hasattr(m, "eps"):
            m.eps = 1e-6


def cc_direct_weight(monkeypatch):
    from model import Compressor

    monkeypatch.setattr(Compressor, "cc_weight", lambda self: self.conv)


@pytest.mark.parametrize("variant", ["ddl", "ddl-cc+ec"])
def test_parity_sees_each_difference(variant, monkeypatch):
    cfg = tiny(**VARIANTS[variant])
    model = perturbed(cfg)
    eps_1e6(model)
    assert relative_gap(model, cfg) > 1e-7
    with monkeypatch.context() as m:
        v_from_normed_input(m)
        assert relative_gap(perturbed(cfg), cfg) > 1e-3
    if variant == "ddl-cc+ec":
        with monkeypatch.context() as m:
            cc_direct_weight(m)
            assert relative_gap(perturbed(cfg), cfg) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# Init: the authors' rules (init_utils.init_gpt_weights after the modules' own constructors)


def authors_init_rule(name, cfg):
    """('normal', std) | ('const', value) | ('uniform', bound) | ('identity_ec', None) for a parameter."""
    d, L = cfg.n_embd, cfg.n_layer
    hidden_std = 0.5 / math.sqrt(d)
    if name == "transformer.wte.weight":
        return "normal", 0.02
    if name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
        return "normal", hidden_std / math.sqrt(L)
    if name == "input_embed.conv.weight":
        return "identity_ec", None  # reset_parameters_identity after init_gpt_weights
    if name.endswith("beta.bias"):
        return "const", math.log(0.5) - math.log(0.5)  # logit(ddl_beta_init / 2), ddl_beta_init = 1.0
    if name.endswith("v_proj.bias"):
        return "uniform", 1 / math.sqrt(d)  # nn.Linear's own bias init, untouched by init_gpt_weights
    if name.endswith(".read"):
        return "const", 1.0 / cfg.ddl_dv
    if name.endswith("rms.weight") or name.endswith("ln_1.weight") or name.endswith("ln_2.weight"):
        return "const", 1.0
    if name == "ln_f.weight":
        return "const", 1.0
    return "normal", hidden_std  # every other >= 2-D parameter (the CC/TC convs and W_beta included)


@pytest.mark.parametrize("variant", ["additive", "ddl", "ddl-cc+ec", "ddl-tc+ec"])
def test_init_matches_authors(variant):
    cfg = GPTConfig(
        n_layer=4, n_head=2, n_embd=256, head_dim=64, block_size=16, vocab_size=512, **VARIANTS[variant]
    )
    torch.manual_seed(0)
    P = authors_params(GPT(cfg))
    uniform = []
    for name, p in P.items():
        kind, value = authors_init_rule(name, cfg)
        p = p.detach()
        if kind == "normal":
            assert abs(p.mean().item()) < 4 * value / math.sqrt(p.numel()), name
            assert abs(p.std().item() / value - 1) < 0.15, (name, p.std().item(), value)
        elif kind == "const":
            assert torch.all(p == value), name
        elif kind == "identity_ec":
            want = torch.zeros_like(p)
            want[:, 0, -1] = 1.0
            assert torch.equal(p, want), name
        else:
            assert p.abs().max().item() <= value, name
            uniform.append(p / value)
    if uniform:  # U(-1, 1) after scaling: std 1/sqrt(3)
        u = torch.cat(uniform)
        assert abs(u.std().item() * math.sqrt(3) - 1) < 0.35 and u.abs().min() < 0.9
