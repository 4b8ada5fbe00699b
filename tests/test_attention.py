"""model.SoftmaxAttention against an independent float64 formula written here, and RoPE's promise that
attention scores depend on relative positions only.

The formula, per head of dimension D (the DDL authors' order: the QK-RMSNorm after RoPE):
    q = RMSNorm(RoPE(W_q c)),  k = RMSNorm(RoPE(W_k c)),  v = W_v c
    RoPE at position t rotates each pair (x[i], x[i + D/2]), i < D/2, by the angle t / base^(2i/D)
    RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight  (eps: GPTConfig.norm_eps)
    y = c_proj(softmax(q k^T / sqrt(D) + causal mask) v)
"""

import math

import pytest
import torch

from model import GPTConfig, SoftmaxAttention

F64 = torch.float64


def make_attention(tie_pairs=False):
    cfg = GPTConfig(n_layer=1, n_head=2, head_dim=8, n_embd=16, block_size=32, vocab_size=64)
    attn = SoftmaxAttention(cfg, torch.nn.Module()).to(F64)
    with torch.no_grad():  # random, non-unit norm weights: the order of RMSNorm and RoPE matters
        for norm in (attn.q_norm, attn.k_norm):
            w = torch.empty(cfg.head_dim, dtype=F64).uniform_(0.5, 1.5)
            if tie_pairs:  # the same weight for both members of each rotated pair (see below)
                w[cfg.head_dim // 2 :] = w[: cfg.head_dim // 2]
            norm.weight.copy_(w)
    return attn.eval()


def reference(attn, c, pos):
    cfg = attn.cfg
    H, D, half = cfg.n_head, cfg.head_dim, cfg.head_dim // 2
    eps = getattr(cfg, "norm_eps", 1e-5)
    B, T, _ = c.shape
    qkv = (c @ attn.c_attn.weight.T).reshape(B, T, 3, H, D)
    q, k, v = (qkv[:, :, n].transpose(1, 2) for n in range(3))  # [B, H, T, D]
    t = torch.arange(pos, pos + T, dtype=F64)[:, None]
    angle = t / cfg.rope_base ** (2 * torch.arange(half, dtype=F64) / D)  # [T, D/2]

    def rope(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)

    def rms_norm(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    q, k = rms_norm(rope(q), attn.q_norm.weight), rms_norm(rope(k), attn.k_norm.weight)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return y.transpose(1, 2).reshape(B, T, H * D) @ attn.c_proj.weight.T


@pytest.mark.parametrize("pos", [0, 7])
@torch.no_grad()
def test_attention_matches_the_formula(pos):
    attn = make_attention()
    c = torch.randn(2, 12, attn.cfg.n_embd, dtype=F64)
    torch.testing.assert_close(attn(c, pos=pos), reference(attn, c, pos), rtol=1e-10, atol=1e-12)


@torch.no_grad()
def test_scores_depend_on_relative_positions_only():
    # Shifting every position by the same s rotates q and k alike: q.k, hence the output, must not change.
    # (With a free RMSNorm weight per dimension after RoPE, the two members of a rotated pair would be
    # scaled differently and the scores would depend on absolute positions; tied pairs keep the promise.)
    attn = make_attention(tie_pairs=True)
    c = torch.randn(2, 12, attn.cfg.n_embd, dtype=F64)
    out = attn(c, pos=0)
    for shift in (1, 5, 20):
        torch.testing.assert_close(attn(c, pos=shift), out, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(attn(c.flip(1), pos=0), out.flip(1))  # the test can tell positions apart
