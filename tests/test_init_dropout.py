"""Init and regularisation as documented: each init option's per-matrix standard deviations against the
formula of GPT._init_weights' docstring (written out here), within the chi-square spread of each matrix's
sample variance; ddl_beta_init as the initial beta; dropout where GPTConfig.dropout says it acts, on the
embeddings, the attention weights and the sublayers' outputs (not their inputs, not the stream)."""

import dataclasses
import math

import pytest
import torch
from scipy import stats

from model import DDL_EPS, GPT, DDLStream, GPTConfig, Residual, SoftmaxAttention
from ops.ddl.stream import identity_conv

ALPHA = 1e-6  # per matrix: the chance that a correct init fails a bound below


def expected_init(name, p, cfg):
    """(kind, value) of parameter `name` from the docstring: "normal" std, "const" value, "uniform" bound,
    "identity" (a conv that passes its input through)."""
    scaled, d, L = cfg.init == "scaled", cfg.n_embd, cfg.n_layer
    beta0 = cfg.ddl_beta_init
    if name == "wte.weight":
        return "normal", 0.02
    if name == "ec_conv":
        return "identity", None
    if name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight"):  # output projections
        return "normal", 0.5 / math.sqrt(d * L) if scaled else 0.02 / math.sqrt(2 * L)
    if name.endswith(".conv"):  # the compressors' convs
        return ("normal", 0.5 / math.sqrt(d)) if scaled else ("identity", None)
    if name.endswith("res_attn.beta.weight") or name.endswith("res_mlp.beta.weight"):  # W_beta
        return ("normal", 0.5 / math.sqrt(d)) if scaled else ("const", 0.0)
    if name.endswith("beta.bias") and ".res_" in name:  # b_beta = logit(beta0 / 2)
        return "const", math.log(beta0 / (2 - beta0))
    if name.endswith("v_proj.bias"):  # b_v
        return ("uniform", 1 / math.sqrt(d)) if scaled else ("const", 0.0)
    if name.endswith("attn.beta.bias"):  # Deltaformer's gate
        return "const", 0.0
    if name.endswith("norm.weight") or name == "ln_f.weight":
        return "const", 1.0
    if name.endswith(".read"):
        return "const", 1.0 / cfg.ddl_dv
    if p.dim() >= 2:  # every other matrix
        return "normal", 0.5 / math.sqrt(d) if scaled else 0.02
    raise AssertionError(f"{name}: no documented init")


def variance_bounds(n):
    """(lo, hi) of mean(x^2) / sigma^2 for n draws of N(0, sigma): n mean(x^2) / sigma^2 is chi-square(n)."""
    return stats.chi2.ppf(ALPHA / 2, n) / n, stats.chi2.isf(ALPHA / 2, n) / n


@pytest.mark.parametrize("init", ["scaled", "nanogpt"])
def test_init_stds_follow_the_docstring(init):
    cfg = GPTConfig(
        n_layer=2, n_head=4, head_dim=64, n_embd=256, block_size=16, vocab_size=128, residual="ddl-tc",
        attention="deltaformer", deltaformer_w="proj", ddl_beta_init=0.4, init=init,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg)
    kinds, uniform = set(), []
    for name, p in model.named_parameters():
        kind, value = expected_init(name, p, cfg)
        kinds.add(kind)
        p = p.detach().double()
        if kind == "normal":
            n = p.numel()
            lo, hi = variance_bounds(n)
            assert lo > 0.5 and hi < 2, name  # the bounds tell sigma from sigma * sqrt(2) and sigma / sqrt(2)
            ratio = p.pow(2).mean().item() / value**2
            assert lo <= ratio <= hi, f"{name}: std {p.pow(2).mean().sqrt():.5f}, want {value:.5f}"
            assert abs(p.mean().item()) <= stats.norm.isf(ALPHA / 2) * value / math.sqrt(n), name
        elif kind == "const":
            torch.testing.assert_close(p, torch.full_like(p, value), rtol=1e-7, atol=0, msg=name)
        elif kind == "identity":
            tap = (cfg.ddl_dv - 1) // 2 if cfg.spec.compressor == "cc" and name != "ec_conv" else None
            assert torch.equal(p, identity_conv(*p.shape, tap=tap).double()), name
        else:
            assert p.abs().max().item() <= value, name
            uniform.append(p.flatten() / value)
    if init == "scaled":  # b_v: 16 draws of U(-1, 1) (scaled), not all in half the range
        assert kinds == {"normal", "const", "identity", "uniform"}
        assert torch.cat(uniform).abs().max() > 0.5 and torch.cat(uniform).numel() == 2 * 2 * 4
    else:
        assert kinds == {"normal", "const", "identity"}


@pytest.mark.parametrize("init", ["scaled", "nanogpt"])
@pytest.mark.parametrize("beta0", [0.3, 1.0, 1.7])
def test_ddl_beta_init_is_the_initial_beta(beta0, init, monkeypatch):
    # nanogpt: W_beta = 0, so every token's beta is beta0; scaled: W_beta ~ N(0, 0.5 / sqrt(d)) spreads it
    # around, its logit centred on logit(beta0 / 2)
    betas = []
    value_and_gate = Residual.value_and_gate

    def spy(self, z, inv_rms):
        v, beta = value_and_gate(self, z, inv_rms)
        betas.append(beta)
        return v, beta

    monkeypatch.setattr(Residual, "value_and_gate", spy)
    cfg = GPTConfig(
        n_layer=2, n_head=2, head_dim=16, n_embd=32, block_size=16, vocab_size=64, residual="ddl-cc",
        ddl_beta_init=beta0, init=init, backend="torch",
    )  # fmt: skip
    model = GPT(cfg)
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 16)))
    assert len(betas) == 2 * 2
    beta = torch.stack(betas).double()
    if init == "nanogpt":
        torch.testing.assert_close(beta, torch.full_like(beta, beta0), rtol=1e-6, atol=0)
    else:
        logit = torch.log(beta / (2 - beta))
        assert beta.std() > 0.01 and abs(logit.median() - math.log(beta0 / (2 - beta0))) < 0.2


# ---- dropout: on the embeddings, the attention weights and the sublayers' outputs ----

P = 0.5


def two_valued(t, value, what):
    """t is 0 or value (dropped, or kept and scaled by 1 / (1 - P)) everywhere, and dropped about P of the
    time (5 binomial standard deviations)."""
    dropped = t.abs() < 1e-6
    kept = (t - value).abs() < 1e-5 * (1 + value.abs() if isinstance(value, torch.Tensor) else 1)
    assert (dropped | kept).all(), f"{what}: values other than 0 and the kept ones"
    n = t.numel()
    assert abs(dropped.double().mean().item() - P) < 5 * math.sqrt(P * (1 - P) / n), f"{what}: drop rate"


def small(residual, **overrides):
    return GPTConfig(
        n_layer=1, n_head=2, head_dim=16, n_embd=64, block_size=32, vocab_size=64, residual=residual,
        dropout=P, backend="torch", **overrides,
    )  # fmt: skip


@pytest.mark.parametrize("residual", ["additive", "ddl", "ddl-cc"])
def test_dropout_on_the_sublayer_output_not_its_input(residual):
    # a sublayer that records its input and returns ones (or zeros): the input must be the normed read
    # untouched, its output dropped (0, or 1 / (1 - P) = 2), the stream itself never
    torch.manual_seed(0)
    model = GPT(small(residual)).train()
    block, res = model.blocks[0], model.blocks[0].res_attn
    seen = []

    def sublayer(value):
        def f(c):
            seen.append(c)
            return torch.full_like(c, value)

        return f

    if residual == "additive":
        x = torch.randn(4, 32, 64)
        out = res(x, sublayer(1.0))
        torch.testing.assert_close(seen[-1], res.norm(x), rtol=0, atol=0)
        two_valued(out - x, 2.0, "the sublayer's output")
        assert torch.equal(res(x, sublayer(0.0)), x)  # a zero output: the stream passes untouched
        return
    X = torch.randn(4, 32, 64, model.config.ddl_dv)
    for value in (1.0, 0.0):
        stream = DDLStream(X, DDL_EPS, backend="torch").enter(block.compress)
        writes = []
        stream.write = lambda h, v, beta, w=stream.write, seen=writes: seen.append(h) or w(h, v, beta)
        res(stream, sublayer(value))
        torch.testing.assert_close(seen[-1], res.norm(block.compress(X)), rtol=0, atol=0)  # the normed read
        stream.read()  # the pending update
        if value == 1.0:
            two_valued(writes[-1], 2.0, "h, the sublayer's output")
        else:
            assert torch.equal(stream.X, X)  # khat = 0: the state passes untouched


@pytest.mark.parametrize("residual", ["additive", "ddl-cc"])
def test_dropout_on_the_embedding(residual):
    torch.manual_seed(0)
    model = GPT(small(residual, ddl_ec=False) if residual != "additive" else small(residual))
    idx = torch.randint(0, 64, (4, 32))
    emb = model.wte(idx).detach()
    with torch.no_grad():
        X0 = model.train().embed(idx)
        assert torch.equal(
            model.eval().embed(idx), emb if residual == "additive" else emb[..., None].expand_as(X0)
        )
    if residual == "additive":
        two_valued(X0, 2 * emb, "the embedding")
    else:  # the embedding is dropped once, then copied d_v times
        two_valued(X0[..., 0], 2 * emb, "the embedding")
        assert all(torch.equal(X0[..., j], X0[..., 0]) for j in range(1, X0.shape[-1]))
    # nowhere else: one dropout on the embedding and one per sublayer, at the configured rate
    drops = {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert drops == {"drop": P, "blocks.0.res_attn.drop": P, "blocks.0.res_mlp.drop": P}


def test_dropout_on_the_attention_weights():
    # v = 1 for every token and c_proj the identity: each output row is the sum of its (dropped) attention
    # weights, the same in every feature of a head. Dropped weights: the first token's row is 0 or 2 (its
    # one weight, 1), later rows take values in between; dropping the output instead would differ per feature
    cfg = small("additive")
    H, D = cfg.n_head, cfg.head_dim
    attn = SoftmaxAttention(dataclasses.replace(cfg, n_embd=H * D), torch.nn.Module())
    with torch.no_grad():
        v = attn.c_attn.weight[2 * H * D :]
        v.zero_()
        v[:, 0] = 1.0  # v = c[..., 0] = 1
        attn.c_proj.weight.copy_(torch.eye(H * D))
    torch.manual_seed(0)
    c = torch.randn(64, 32, H * D)
    c[..., 0] = 1.0
    with torch.no_grad():
        torch.testing.assert_close(attn.eval()(c), torch.ones(64, 32, H * D), rtol=1e-6, atol=1e-6)
        y = attn.train()(c).view(64, 32, H, D)
    assert torch.equal(y, y[..., :1].expand_as(y))  # one value per head and token: weights, not features
    two_valued(y[:, 0, :, 0], torch.tensor(2.0), "the first token's one weight")
    later = y[:, 8:, :, 0]
    assert ((later - later.round()).abs() > 0.01).float().mean() > 0.5  # sums of some of the weights
