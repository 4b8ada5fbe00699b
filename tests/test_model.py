"""model.py: shapes and loss, the DDL sublayer math against an independent float64 formula, EC, config
validation, checkpoints, parameter/FLOP counts. Cached decoding lives in tests/test_generate.py.

Tiny models in float64 with every parameter perturbed away from its init (identity convs, zero gates and
1/d_v reads would otherwise hide wiring mistakes). The kernels run on their PyTorch backend here, except
one test that runs the whole model on the Triton kernels (the interpreter on CPU) against it; the kernels
themselves are tested in tests/test_ddl.py and tests/test_deltaformer.py.
"""

import dataclasses
import io
import math

import pytest
import torch
import torch.nn.functional as F
from readme_code import pasted, readme_blocks

import model as model_module
from cache import Cache
from model import ATTENTIONS, DDL_EPS, GPT, RESIDUALS, DDLStream, GPTConfig, Residual
from sample import generate

COMBOS = [(r, a) for r in RESIDUALS for a in ATTENTIONS]  # the generic tests: every registered rule
DDL_RESIDUALS = [r for r in RESIDUALS if GPTConfig(residual=r).is_ddl]  # the rules on a DDLStream
# the tests of DDL's formula (beta = 2 sigmoid(W_beta c + b_beta), v, the update): the rules that declare it
DDL_FORMULA = [r for r in DDL_RESIDUALS if GPTConfig(residual=r).spec.gate == "2sigmoid"]
V = 67


def tiny(**overrides):
    base = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=24, vocab_size=V, backend="torch")
    return GPTConfig(**{**base, **overrides})


def perturbed(cfg, noise=0.1, seed=0, double=False):
    """A model (float64 if double) with every parameter moved off its init by N(0, noise): unit norm
    weights, zero biases and identity convs would hide wiring mistakes."""
    torch.manual_seed(seed)
    model = GPT(cfg).double() if double else GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model


def make(cfg, noise=0.1, seed=0):
    """A float64 model in eval mode, moved off its init (perturbed)."""
    return perturbed(cfg, noise, seed, double=True).eval()


def tokens(B=2, T=11, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------
# Forward, loss, gradients


@pytest.mark.parametrize("residual,attention", COMBOS)
def test_forward_loss_shapes_and_ignore_index(residual, attention):
    model = make(tiny(residual=residual, attention=attention))
    idx = tokens()
    targets = tokens(T=12, seed=2)[:, 1:]  # a non-contiguous slice, as x[:, 1:] of a longer row would be
    targets[0, :4] = -1
    targets[1, -1] = -1
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 11, V) and loss.shape == ()
    keep = targets != -1
    logp = F.log_softmax(logits, dim=-1)
    want = -logp[keep].gather(-1, targets[keep][:, None]).mean()
    torch.testing.assert_close(loss, want.float() if loss.dtype == torch.float32 else want)

    last, none = model(idx)
    assert none is None and last.shape == (2, 1, V)
    torch.testing.assert_close(last, logits[:, -1:], rtol=1e-12, atol=1e-12)

    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} gets no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_causal():
    """Changing a later token never changes earlier logits (every variant's mixing is causal)."""
    for residual, attention in COMBOS:
        model = make(tiny(residual=residual, attention=attention))
        idx = tokens(B=1, T=9)
        other = idx.clone()
        other[0, 6] = (other[0, 6] + 1) % V
        a, _ = model(idx, idx)
        b, _ = model(other, other)
        torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-12, msg=f"{residual} {attention}")
        assert (a[:, 6] - b[:, 6]).abs().max() > 1e-6


def test_bad_inputs_raise():
    model = make(tiny(block_size=8))
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(T=9))
    with pytest.raises(ValueError, match="idx"):
        model(tokens(T=4).int())
    with pytest.raises(ValueError, match="targets"):
        model(tokens(T=4), tokens(T=3))


def test_dropout_only_in_training():
    model = make(tiny(residual="ddl-tc", dropout=0.2))
    idx = tokens()
    model.train()
    assert not torch.equal(model(idx, idx)[0], model(idx, idx)[0])
    model.eval()
    assert torch.equal(model(idx, idx)[0], model(idx, idx)[0])


def test_bf16_autocast_close_to_fp32():
    """The training setting: bf16 autocast, fp32 parameters; the stream and the betas stay fp32."""
    torch.manual_seed(0)
    cfg = tiny(residual="ddl-tc", attention="deltaformer", deltaformer_w="proj")
    model = GPT(cfg)
    idx, targets = tokens(), tokens(seed=2)
    _, loss32 = model(idx, targets)
    seen = {}
    res = model.blocks[0].res_attn
    hook = res.register_forward_hook(lambda m, args, out: seen.update(X=out.X.dtype))
    orig = res.value_and_gate
    res.value_and_gate = lambda z, inv_rms: seen.setdefault("v_beta", orig(z, inv_rms))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss16 = model(idx, targets)
    hook.remove()
    assert seen["X"] == torch.float32 and {t.dtype for t in seen["v_beta"]} == {torch.float32}
    assert torch.isfinite(loss16) and abs(loss16.item() - loss32.item()) < 0.05 * loss32.item()


BACKEND_CASES = [
    dict(residual="ddl-cc", attention="softmax"),  # fused update + CC read, EC
    dict(residual="ddl-tc", attention="deltaformer", deltaformer_kernel="relu"),
    dict(residual="ddl", attention="deltaformer", deltaformer_w="proj", ddl_erase=False),
    dict(residual="ddl", ddl_v="linear"),  # the update fused with the norm and logits (linear v)
]
BACKEND_CASES += [dict(residual=r) for r in RESIDUALS if r not in {c["residual"] for c in BACKEND_CASES}]


@pytest.mark.parametrize("overrides", BACKEND_CASES)
def test_triton_backend_matches_torch_backend(overrides):
    """The model wired to the Triton kernels (CUDA, or the interpreter on CPU) gives the reference's loss
    and gradients: float32, so the tolerance is float32 rounding."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    for backend in ("torch", "triton"):
        model = perturbed(tiny(backend=backend, **overrides)).to(device)
        idx, targets = tokens(T=9).to(device), tokens(T=9, seed=2).to(device)
        logits, loss = model(idx, targets)
        loss.backward()
        results[backend] = logits, {n: p.grad for n, p in model.named_parameters()}
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_ddl_reads_through_the_fused_norm(monkeypatch):
    """d_v = 1 on the Triton backend: each read after an update (every sublayer's but the first) is one
    ddl_update_norm, with c in autocast's dtype; with every 2nd state kept, or at d_v = 4, none is; the loss
    under bf16 autocast matches the torch backend's."""
    pytest.importorskip("triton")
    import ops.ddl.stream as stream

    calls = []
    fused = stream.ddl_update_norm
    monkeypatch.setattr(
        stream, "ddl_update_norm", lambda *a, **kw: calls.append(kw["c_dtype"]) or fused(*a, **kw)
    )
    cases = {  # name: (backend, overrides, fused reads)
        "torch": ("torch", {}, 0),
        "fused": ("triton", {}, 3),
        "keep2": ("triton", dict(ddl_keep_state_every=2), 0),
        "cc": ("triton", dict(residual="ddl-cc"), 0),
    }
    losses = {}
    for name, (backend, extra, fuses) in cases.items():
        calls.clear()
        model = perturbed(tiny(**{"residual": "ddl", "backend": backend, **extra}))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[name] = model(tokens(), tokens(seed=2))[1]
        assert calls == [torch.bfloat16] * fuses, name
    for name in ("fused", "keep2"):
        torch.testing.assert_close(losses[name], losses["torch"], rtol=2e-3, atol=0)


# ---------------------------------------------------------------------------------------------------------
# The DDL sublayer, checked against the formula with values captured at run time


def naive_compress(kind, comp, X):
    """x_in = compress(X) by the compressor `kind` (a rule's spec.compressor), written out independently of
    ops/ddl/ and of Compressor.cc_weight."""
    if kind is None:
        return X[..., 0]
    if kind == "cc":  # conv along d_v (kernel d_v, left pad (d_v-1)//2, zeros outside), then read
        dv = X.shape[-1]
        conv_out = torch.zeros_like(X)
        for out in range(dv):
            for tap in range(dv):
                src = out + tap - (dv - 1) // 2
                if 0 <= src < dv:
                    conv_out[..., out] += comp.conv[:, tap] * X[..., src]
        return (conv_out * comp.read).sum(-1)
    K, T = comp.conv.shape[-1], X.shape[1]
    out = torch.zeros_like(X)
    for t in range(T):
        for j in range(K):
            s = t - (K - 1) + j
            if s >= 0:
                out[:, t] += comp.conv[:, :, j] * X[:, s]
    return (out * comp.read).sum(-1)


class StatesRead:
    """Records the state X every read of a DDLStream sees (a sublayer's input; the last, the readout's),
    by wrapping DDLStream.read; .remove() puts it back."""

    def __init__(self):
        self.states, self.orig = [], DDLStream.read

        def read(stream):
            x_in = self.orig(stream)
            self.states.append(stream.X)
            return x_in

        DDLStream.read = read

    def remove(self):
        DDLStream.read = self.orig


def capture(model):
    """Per DDL sublayer: X in, X out, the norm's input x_in and output c, the sublayer output h (records
    complete after the forward; call .remove() on each hook)."""
    records, states = [], StatesRead()
    hooks = [states, Completes(records, states)]
    for block in model.blocks:
        for m in (block.res_attn, block.res_mlp):
            rec = {"module": m, "compress": block.compress}
            records.append(rec)
            hooks.append(
                m.norm.register_forward_hook(lambda mod, args, out, r=rec: r.update(x_in=args[0], c=out))
            )
            hooks.append(m.drop.register_forward_hook(lambda mod, args, out, r=rec: r.update(h=out)))
    return records, hooks


class Completes:
    """On .remove(): each record's X and X_new from the states read (sublayer j reads X_j, writes X_j+1)."""

    def __init__(self, records, states):
        self.records, self.states = records, states

    def remove(self):
        for j, rec in enumerate(self.records):
            rec.update(X=self.states.states[j], X_new=self.states.states[j + 1])


def value(m, x_in, c):
    """v = 4 sigmoid(W_v x_in + b_v) of the norm's input, or W_v c for ddl_v="linear" (no bias then)."""
    if m.cfg.ddl_v == "linear":
        assert m.v_proj.bias is None
        return c @ m.v_proj.weight.T
    return 4 * torch.sigmoid(x_in @ m.v_proj.weight.T + m.v_proj.bias)


@pytest.mark.parametrize("rows", [1, 2, 3, 6])
def test_fp32_linear_against_float64(rows):
    """x W^T + b in fp32 under bf16 autocast against float64, values and gradients: dx in fp32, dW from
    bf16 operands (as autocast gives every weight); float64 inputs stay float64 throughout, also under
    autocast (values and gradients to float64 rounding)."""
    torch.manual_seed(rows)
    x, w, b = torch.randn(3, 5, 48), torch.randn(rows, 48), torch.randn(rows)
    dy = torch.randn(3, 5, rows, dtype=torch.float64)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    want = xd @ wd.T + bd
    want.backward(dy)
    cases = (((x, w, b), 1e-5, 1e-2), ((x.double(), w.double(), b.double()), 1e-13, 1e-13))
    for inputs, tol, dw_tol in cases:
        xg, wg, bg = (t.clone().requires_grad_() for t in inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, no_bias = model_module.fp32_linear(xg, wg, bg), model_module.fp32_linear(xg, wg)
        assert got.dtype == no_bias.dtype == inputs[0].dtype and got.shape == (3, 5, rows)
        torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(no_bias.double(), (want - bd).detach(), rtol=tol, atol=tol)
        got.backward(dy.to(got.dtype))
        torch.testing.assert_close(xg.grad.double(), xd.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(bg.grad.double(), bd.grad, rtol=tol, atol=tol)
        dw_err = (wg.grad.double() - wd.grad).abs().max() / wd.grad.abs().max()
        assert dw_err < dw_tol and (dw_tol < 1e-3 or dw_err > 1e-5)  # under autocast: bf16 operands, not fp32


@pytest.mark.parametrize("rows", [1, 6, 8])
def test_fp32_linear_compiled_against_float64(rows):
    """The compiled form (the products summed over d forward, dx written out as a sum of products, no
    reduction over the outputs) against float64 under bf16 autocast; its backward graph has one matmul
    (dW) where the eager form has two."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def grab(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(rows)
    x, w, b = torch.randn(3, 5, 48), torch.randn(rows, 48), torch.randn(rows)
    dy = torch.randn(3, 5, rows)
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    (xd @ wd.T + bd).backward(dy.double())
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    linear = torch.compile(model_module.fp32_linear, backend=aot_autograd(fw_compiler=grab, bw_compiler=grab))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear(xg, wg, bg)
    got.backward(dy)
    torch.testing.assert_close(got.double(), (xd @ wd.T + bd).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xg.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bg.grad.double(), bd.grad, rtol=1e-5, atol=1e-5)
    assert (wg.grad.double() - wd.grad).abs().max() / wd.grad.abs().max() < 1e-2  # bf16 operands
    backward = [n for n in graphs[-1].graph.nodes if n.op == "call_function"]
    assert [n.target for n in backward].count(torch.ops.aten.mm.default) == 1, backward
    sums = [n.args[1] for n in backward if n.target == torch.ops.aten.sum.dim_IntList]
    assert sums == [[0, 1]], sums  # the bias's gradient over the tokens; none over the outputs


@pytest.mark.parametrize(
    "residual,erase,ddl_v",
    [(r, e, "sigmoid") for r in DDL_FORMULA for e in (True, False)]
    + [("ddl-cc", True, "linear"), ("ddl", True, "linear")],
)
def test_ddl_sublayer_matches_formula(residual, erase, ddl_v):
    """Every sublayer: x_in = compress(X), c = RMSNorm(x_in), X' = X + beta khat (v^T - khat^T X) with
    khat = h/sqrt(|h|^2+eps^2), v = value(x_in, c), beta = 2 sigmoid(w.c + b); erase=False: X' = X + beta
    khat v. The two sublayers of a block read through the same compressor."""
    model = make(tiny(residual=residual, ddl_erase=erase, ddl_v=ddl_v, attention="deltaformer"))
    records, hooks = capture(model)
    with torch.no_grad():
        model(tokens(), tokens(seed=2))
    for h in hooks:
        h.remove()
    assert len(records) == 4
    for r in records:
        m, X, X_new, c, h = r["module"], r["X"], r["X_new"], r["c"], r["h"]
        assert X.shape == (2, 11, 32, model.config.ddl_dv)
        torch.testing.assert_close(
            r["x_in"], naive_compress(model.config.spec.compressor, r["compress"], X), rtol=1e-12, atol=1e-12
        )
        rms = torch.sqrt((r["x_in"] ** 2).mean(-1, keepdim=True) + model.config.norm_eps)
        torch.testing.assert_close(c, r["x_in"] / rms * m.norm.weight, rtol=1e-12, atol=1e-12)
        khat = h / torch.sqrt((h * h).sum(-1, keepdim=True) + DDL_EPS**2)
        v = value(m, r["x_in"], c)
        beta = 2 * torch.sigmoid(c @ m.beta.weight[0] + m.beta.bias[0])
        assert beta.std() > 0.01  # the gates really differ per token
        target = v - torch.einsum("btiv,bti->btv", X, khat) if erase else v
        want = X + beta[..., None, None] * khat[..., :, None] * target[..., None, :]
        torch.testing.assert_close(X_new, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("residual", DDL_FORMULA)
def test_ddl_beta_zero_is_identity(residual):
    """b_beta very negative -> beta = 0 exactly: every sublayer returns X unchanged, so the logits are
    those of the embedding read straight out."""
    model = make(tiny(residual=residual))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Residual):
                m.beta.bias.fill_(-1e4)
    records, hooks = capture(model)
    idx = tokens()
    with torch.no_grad():
        logits, _ = model(idx, idx)
        direct = model.lm_head(model.ln_f(model.readout(model.embed(idx))))
    for h in hooks:
        h.remove()
    for r in records:
        assert torch.equal(r["X_new"], r["X"])
    torch.testing.assert_close(logits, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("residual", DDL_FORMULA)
def test_ddl_beta_one_overwrites(residual):
    """w_beta = 0, b_beta = 0 -> beta = 1: khat^T X' = v^T (up to |khat|^2 = 1 - eps^2/(|h|^2+eps^2))."""
    model = make(tiny(residual=residual))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Residual):
                m.beta.weight.zero_()
                m.beta.bias.zero_()
    records, hooks = capture(model)
    with torch.no_grad():
        model(tokens(), tokens(seed=2))
    for h in hooks:
        h.remove()
    for r in records:
        m, X_new, h, c = r["module"], r["X_new"], r["h"], r["c"]
        assert (h * h).sum(-1).min() > 1e-4  # so eps^2/|h|^2 < 1e-6
        khat = h / torch.sqrt((h * h).sum(-1, keepdim=True) + DDL_EPS**2)
        read = torch.einsum("bti,btiv->btv", khat, X_new)
        v = value(m, r["x_in"], c)
        torch.testing.assert_close(read, v, rtol=0, atol=1e-8)
        assert (r["X"] - X_new).abs().max() > 1e-3  # it did write


def test_write_only_differs_from_erase():
    a = make(tiny(residual="ddl-cc", ddl_erase=True))
    b = make(tiny(residual="ddl-cc", ddl_erase=False))
    b.load_state_dict(a.state_dict())
    idx = tokens()
    assert (a(idx, idx)[0] - b(idx, idx)[0]).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------------
# EC


@pytest.mark.parametrize("residual", ["ddl-cc", "ddl-tc"])
def test_ec_identity_init_is_repetition(residual):
    torch.manual_seed(0)
    with_ec = GPT(tiny(residual=residual, ddl_ec=True)).double()
    without = GPT(tiny(residual=residual, ddl_ec=False)).double()
    assert "ec_conv" in dict(with_ec.named_parameters()) and "ec_conv" not in dict(without.named_parameters())
    missing, unexpected = without.load_state_dict(with_ec.state_dict(), strict=False)
    assert missing == [] and unexpected == ["ec_conv"]
    idx = tokens()
    emb = with_ec.wte(idx)
    X0 = with_ec.embed(idx)
    assert X0.shape == (2, 11, 32, 4)
    assert torch.equal(X0, emb[..., None].expand(-1, -1, -1, 4))
    assert torch.equal(without.embed(idx), X0)
    torch.testing.assert_close(with_ec(idx, idx)[0], without(idx, idx)[0], rtol=0, atol=0)


def test_ec_perturbed_is_causal_conv():
    model = make(tiny(residual="ddl-tc", ddl_conv_size=3))
    idx = tokens()
    emb = model.wte(idx)
    w = model.ec_conv  # [d, d_v, K]
    want = torch.zeros(2, 11, 32, 4, dtype=torch.float64)
    for t in range(11):
        for j in range(3):
            if t - 2 + j >= 0:
                want[:, t] += w[:, :, j] * emb[:, t - 2 + j, :, None]
    torch.testing.assert_close(model.embed(idx), want, rtol=1e-12, atol=1e-12)


def test_ddl_dv1_has_no_ec_and_vector_state():
    model = make(tiny(residual="ddl"))
    assert model.config.ddl_dv == 1 and not hasattr(model, "ec_conv")
    idx = tokens()
    torch.testing.assert_close(model.embed(idx)[..., 0], model.wte(idx), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(residual="ddl-xx"), "residual"),
        (dict(attention="linear"), "attention"),
        (dict(deltaformer_w="v"), "deltaformer_w"),
        (dict(residual="ddl", ddl_v="relu"), "ddl_v"),
        (dict(deltaformer_kernel="gelu"), "deltaformer_kernel"),
        (dict(backend="cuda"), "backend"),
        (dict(residual="ddl", ddl_dv=4), "ddl_dv"),
        (dict(residual="additive", ddl_dv=4), "ddl_dv"),
        (dict(residual="ddl-cc", ddl_dv=0), "ddl_dv"),
        (dict(residual="ddl-tc", ddl_dv=2.5), "ddl_dv"),
        (dict(ddl_beta_init=0.0), "ddl_beta_init"),
        (dict(ddl_beta_init=2.0), "ddl_beta_init"),
        (dict(ddl_conv_size=0), "ddl_conv_size"),
        (dict(ddl_ec="yes"), "ddl_ec"),
        (dict(ddl_erase=1), "ddl_erase"),
        (dict(deltaformer_beta_max=0.0), "deltaformer_beta_max"),
        (dict(head_dim=15), "head_dim"),
        (dict(n_head=0), "n_head"),
        (dict(n_layer=-1), "n_layer"),
        (dict(n_embd=32.0), "n_embd"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(block_size=0), "block_size"),
        (dict(mlp_hidden=0), "mlp_hidden"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout="0.1"), "dropout"),
        (dict(ddl_beta_init=float("nan")), "ddl_beta_init"),
        (dict(rope_base=0), "rope_base"),
        (dict(residual="ddl-cc", ddl_state_dtype="fp16"), "ddl_state_dtype"),
        (dict(ddl_state_dtype=torch.bfloat16), "ddl_state_dtype"),
        (dict(residual="ddl-cc", ddl_state_rounding="stochastic"), "ddl_state_rounding"),  # fp32 state
        (dict(residual="ddl-cc", ddl_state_dtype="bfloat16", ddl_state_rounding="up"), "ddl_state_rounding"),
    ],
)
def test_invalid_config_raises_naming_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_preset_and_defaults():
    with pytest.raises(ValueError, match="gpt2-small"):
        GPTConfig.preset("gpt2-large")
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig.preset("gpt2-small", n_layers=3)
    small = GPTConfig.preset("gpt2-small", residual="ddl-tc")
    assert (small.n_layer, small.n_embd, small.n_head, small.head_dim, small.block_size) == (
        12,
        768,
        6,
        128,
        1024,
    )
    assert small.ddl_dv == 4 and small.vocab_size == 50304 and small.hidden == 2048
    medium = GPTConfig.preset("gpt2-medium", residual="ddl")
    assert (medium.n_layer, medium.n_embd, medium.n_head, medium.ddl_dv, medium.hidden) == (
        24,
        1024,
        8,
        1,
        2730,
    )


@pytest.mark.parametrize(
    "overrides",
    [
        dict(residual="ddl-tc", attention="deltaformer", deltaformer_w="proj", ddl_conv_size=3),
        dict(residual="ddl-cc", ddl_state_dtype="bfloat16"),
        dict(residual="ddl-cc", ddl_ec=False, ddl_erase=False, ddl_dv=3, mlp_hidden=40, ddl_v="linear"),
        dict(
            residual="additive", attention="deltaformer", deltaformer_kernel="relu", deltaformer_beta_max=1.0
        ),
    ],
)
def test_checkpoint_round_trip(overrides):
    model = make(tiny(**overrides))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "model_args": dataclasses.asdict(model.config)}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert GPTConfig(**ckpt["model_args"]) == model.config
    loaded = GPT(GPTConfig(**ckpt["model_args"])).double().eval()
    loaded.load_state_dict(ckpt["model"])
    idx = tokens()
    torch.testing.assert_close(loaded(idx, idx)[0], model(idx, idx)[0], rtol=0, atol=0)
    assert loaded.lm_head.weight is loaded.wte.weight  # still tied after loading


# ---------------------------------------------------------------------------------------------------------
# Parameter and FLOP counts (presets built on the meta device: nothing is allocated)


def expected_params(cfg):
    """Written out from the architecture description, independently of the modules."""
    d, L, H, D, dv, K = cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.ddl_dv, cfg.ddl_conv_size
    hidden = (8 * d) // 3
    attn = d * 3 * H * D + H * D * d + 2 * D  # qkv, out, q/k norm weights
    if cfg.attention == "deltaformer":
        attn += d * H + H  # beta projection with bias
        if cfg.deltaformer_w == "proj":
            attn += d * H * D + D
    per_sublayer = d  # pre-norm weight
    compressor = 0  # one per block (read before attention and before the MLP) and the readout
    if cfg.residual != "additive":
        compressor = {"ddl": 0, "ddl-cc": d * dv + dv, "ddl-tc": d * dv * K + dv}[cfg.residual]
        b_v = dv if cfg.ddl_v == "sigmoid" else 0
        per_sublayer += d * dv + b_v + d + 1  # + W_v, b_v, w_beta, b_beta
    layer = attn + 3 * d * hidden + 2 * per_sublayer + compressor
    total = cfg.vocab_size * d + L * layer + d  # tied embedding, blocks, final norm
    if cfg.residual != "additive":
        total += compressor  # the readout before the final norm
        if cfg.residual in ("ddl-cc", "ddl-tc") and cfg.ddl_ec:
            total += d * dv * K
    return total


def preset_variants():
    for size in ("gpt2-small", "gpt2-medium"):
        for residual, extra in [
            ("additive", {}),
            ("ddl", {}),
            ("ddl-cc", {}),
            ("ddl-cc", dict(ddl_ec=False)),
            ("ddl-tc", {}),
            ("ddl-tc", dict(ddl_ec=False)),
        ]:
            for attention, w in [("softmax", "k"), ("deltaformer", "k"), ("deltaformer", "proj")]:
                yield size, dict(residual=residual, attention=attention, deltaformer_w=w, **extra)


def test_preset_param_counts():
    with torch.device("meta"):
        for size, overrides in preset_variants():
            cfg = GPTConfig.preset(size, **overrides)
            model = GPT(cfg)
            n = model.num_params()
            assert n == expected_params(cfg), (size, overrides)
            assert model.num_params(non_embedding=True) == n - cfg.vocab_size * cfg.n_embd
    with torch.device("meta"):
        small = GPT(GPTConfig.preset("gpt2-small")).num_params()
        medium = GPT(GPTConfig.preset("gpt2-medium")).num_params()
    assert 123e6 < small < 124e6 and 353e6 < medium < 354e6  # the paper's 123-124M / 353-354M


def dense_deltaformer(q, k, v, w, beta, kernel="softmax", scale=None, backend="auto", doc_start=None):
    """Deltaformer attention with stage 1 as two full [T, D] x [D, T]-sized products, the work that
    flops_per_token counts (like SDPA, the whole T x T block, not the causal half): the scores W K^T and
    A @ U in u = v - diag(beta) A u. U itself comes from a triangular solve (FlopCounterMode does not
    count it); the second product re-forms u from it, equal in exact arithmetic. The solve's matrix is
    detached, so the backward has the four products of stage 1's (dA, A^T (beta G), dW, dK) and no
    fifth for the matrix: its values are right, its gradients are not (only counted here)."""
    from ops.deltaformer import stage1_keys
    from ops.deltaformer.chunk import _kappa_rows

    assert doc_start is None  # counted on one document

    T, D = q.shape[-2], q.shape[-1]
    s = D**-0.5 if scale is None else scale
    k1, w1, s1 = stage1_keys(k, w, kernel, s)
    below = torch.ones(T, T, dtype=torch.bool, device=q.device).tril(-1)  # j < i
    a = _kappa_rows(s1 * (w1 @ k1.transpose(-1, -2)), below, kernel)
    b = beta[..., None].to(a.dtype)
    eye = torch.eye(T, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular((eye + b * a).detach(), v.to(a.dtype), upper=False, unitriangular=True)
    u = (v - b * (a @ u)).to(v.dtype)
    return F.scaled_dot_product_attention(q, k, u, is_causal=True, scale=s)


def counted_step_flops(model, B, T):
    """FLOPs of one forward + backward as torch's FlopCounterMode counts them: every matmul (linears,
    the LM head, attention's products through SDPA's math backend) at 2 per multiply-add, its backward
    at twice the forward; elementwise work (norms, activations, biases, the loss) is not counted."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, model.config.vocab_size, (B, T), generator=g) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(idx, targets)
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_flops_per_token_against_counted_matmuls(attention, monkeypatch):
    """flops_per_token = 6 N + attention against FlopCounterMode's count of a training step, at two
    sequence lengths (the T-linear term) and with head_dim * n_head != n_embd (which width the
    attention term takes). The only parameters no matmul sees are the vectors (RMSNorm weights, the
    beta gate's bias), so the count must equal (flops_per_token - 6 * their number) * B * T exactly.
    Deltaformer's stage 1 is counted through dense_deltaformer (checked against the model's own path
    first). The DDL residuals' update term is elementwise work the counter does not see: not checked."""
    cfg = tiny(attention=attention, n_head=3, head_dim=8, block_size=32)  # 3 heads of 8 in a width of 32
    if attention == "deltaformer":
        m = make(cfg)
        idx = tokens(T=12)
        want = m(idx)[0]
        monkeypatch.setattr(model_module, "deltaformer_attention", dense_deltaformer)
        torch.testing.assert_close(m(idx)[0], want, rtol=1e-9, atol=1e-9)
    for T in (16, 32):
        torch.manual_seed(0)
        m = GPT(cfg)
        unseen = sum(p.numel() for p in m.parameters() if p.dim() < 2)
        assert unseen < 0.01 * m.num_params()
        B = 2
        assert counted_step_flops(m, B, T) == (m.flops_per_token(T) - 6 * unseen) * B * T, T


def test_flops_per_token_gpt2_small():
    """Order of magnitude against nanoGPT's: GPT-2 small ~6 * 124M + attention ~0.87 GFLOP per token."""
    with torch.device("meta"):
        base = GPT(GPTConfig.preset("gpt2-small"))
    assert math.isclose(base.flops_per_token(1024) / 1e9, 0.87, rel_tol=0.05)


# ---------------------------------------------------------------------------------------------------------
# The bf16 DDL state (ddl_state_dtype="bfloat16")


@pytest.mark.parametrize("residual", DDL_RESIDUALS)
def test_bf16_state_close_to_fp32_state(residual):
    """The same fp32 weights with X stored in bf16: loss and every gradient agree to bf16 rounding (X is
    rounded once per sublayer, 8 bits of mantissa), and the state really is bf16 (not a silent no-op)."""
    results = {}
    for state in ("float32", "bfloat16"):
        model = perturbed(tiny(residual=residual, ddl_state_dtype=state))
        idx, targets = tokens(T=9), tokens(T=9, seed=2)
        seen = StatesRead()  # every state a read sees
        logits, loss = model(idx, targets)
        seen.remove()
        assert {X.dtype for X in seen.states} == {torch.bfloat16 if state == "bfloat16" else torch.float32}
        assert logits.dtype == torch.float32 and loss.dtype == torch.float32
        loss.backward()
        results[state] = loss, {n: p.grad for n, p in model.named_parameters()}
    loss32, grads32 = results["float32"]
    loss16, grads16 = results["bfloat16"]
    assert loss16.item() != loss32.item()  # the rounding happened
    assert abs(loss16.item() - loss32.item()) < 1e-2 * abs(loss32.item())
    for name, g32 in grads32.items():
        g16 = grads16[name]
        assert g16.dtype == torch.float32, name
        # relative, plus an absolute floor for the gate biases: sums over tokens that nearly cancel
        # (measured: <= 1.4% relative on the weights, 4e-4 absolute on a bias of gradient 0.016)
        err = (g16 - g32).norm()
        assert err < 3e-2 * g32.norm() + 1e-3, f"{name}: gradient error {err:.3g} of {g32.norm():.3g}"


def test_bf16_state_under_autocast():
    """The training setting: autocast + bf16 state trains (finite loss, every parameter gets gradient)."""
    torch.manual_seed(0)
    model = GPT(tiny(residual="ddl-tc", ddl_state_dtype="bfloat16"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(tokens(), tokens(seed=2))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("residual", DDL_RESIDUALS)
def test_bf16_state_generate_equals_full_forward(residual):
    """Cached decoding with a bf16 state emits the tokens of greedy decoding by full forward passes."""
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, ddl_state_dtype="bfloat16", block_size=16)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.1 if name == "wte.weight" else 0.5) * torch.randn_like(p))
    prompt = tokens(B=2, T=5, seed=3)
    out = generate(model, prompt, 8, top_k=1)
    want = prompt
    for _ in range(8):
        logits, _ = model(want)
        want = torch.cat([want, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", DDL_RESIDUALS)
def test_bf16_state_triton_matches_torch(residual):
    """The bf16 state on the Triton kernels against the reference backend: both compute in fp32 and round
    X to bf16 once per sublayer, so they differ only where a different fp32 summation order moves a
    rounding (1 bf16 ulp): bf16-level tolerance. GPU only: Triton's CPU interpreter casts fp32 to bf16
    toward zero (test_interpreter_bf16_cast_truncates), a bias the GPU's round-to-nearest does not have."""
    pytest.importorskip("triton")
    bf16_backends_agree("cuda", residual=residual, ddl_state_dtype="bfloat16")


def bf16_backends_agree(device, **overrides):
    """The same perturbed tiny model (a bf16 state) on the torch and the triton backend, each forward after
    torch.manual_seed(1): the losses within 1e-3 and every gradient to bf16 level. Returns the last model,
    the batch and its loss."""
    results, idx, targets = {}, tokens(T=9).to(device), tokens(T=9, seed=2).to(device)
    for backend in ("torch", "triton"):
        model = perturbed(tiny(backend=backend, **overrides)).to(device)
        torch.manual_seed(1)
        _, loss = model(idx, targets)
        loss.backward()
        results[backend] = loss, {n: p.grad for n, p in model.named_parameters()}
    assert abs(results["triton"][0].item() - results["torch"][0].item()) < 1e-3 * results["torch"][0].item()
    for name, g in results["torch"][1].items():
        err = (results["triton"][1][name] - g).norm()
        assert err < 3e-2 * g.norm() + 1e-3, f"{name}: gradient error {err:.3g} of {g.norm():.3g}"
    return model, idx, targets, results["triton"][0]


def test_interpreter_bf16_cast_truncates():
    """Why the bf16-state Triton test is GPU only: on CPU (TRITON_INTERPRET=1) an fp32 -> bf16 cast in a
    kernel rounds toward zero, so every stored state shrinks by ~half an ulp, a bias that accumulates over
    the layers. If a Triton release rounds to nearest there too, this fails and that test can run on CPU."""
    triton = pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU rounds to nearest")
    import triton.language as tl

    @triton.jit
    def cast(X, Y, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs).to(tl.bfloat16))

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    y = torch.empty(1024, dtype=torch.bfloat16)
    cast[(1,)](x, y, N=1024)
    assert torch.all(y.float().abs() <= x.abs()) and (y != x.to(torch.bfloat16)).float().mean() > 0.3


SR = dict(ddl_state_dtype="bfloat16", ddl_state_rounding="stochastic")


@pytest.mark.parametrize("residual", DDL_RESIDUALS)
def test_stochastic_bf16_state_triton_matches_torch(residual):
    """ddl_state_rounding="stochastic": each update draws its seed from torch's generator, so the Triton
    kernels (also in the interpreter: a stochastically rounded value is a bf16 value, which its cast keeps)
    and the reference draw the same seeds and round alike but where their fp32 sums differ; the same
    generator state gives the same loss, a fresh draw another, and rounding to nearest another."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, idx, targets, loss = bf16_backends_agree(device, residual=residual, **SR)
    with torch.no_grad():
        torch.manual_seed(1)
        again = model(idx, targets)[1]
        fresh = model(idx, targets)[1]
        model.config.ddl_state_rounding = "nearest"
        nearest = model(idx, targets)[1]
    assert again.item() == loss.item()
    assert fresh.item() != again.item() and nearest.item() != again.item()


@pytest.mark.parametrize("residual", DDL_RESIDUALS)
def test_stochastic_bf16_state_decodes(residual):
    """Cached decoding with stochastic rounding runs (TC: its conv through the cached states), each update's
    seed drawn as in training, so a generator state repeats the tokens."""
    torch.manual_seed(0)
    model = GPT(tiny(residual=residual, block_size=16, **SR)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.1 if name == "wte.weight" else 0.5) * torch.randn_like(p))
    prompt = tokens(B=2, T=5, seed=3)
    outs = []
    for _ in range(2):
        torch.manual_seed(4)
        outs.append(generate(model, prompt, 8, top_k=1))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (2, 13)


@pytest.mark.parametrize("residual,state", [("ddl-tc", {}), ("ddl-cc", SR)])
def test_inductor_compile_of_the_triton_deltaformer_model(residual, state):
    # Inductor (not only aot_eager) checks the custom ops' outputs against their fake strides; the model
    # feeds the Deltaformer op permuted views, which once made the GPU training benchmark fall back to eager.
    # Two layers: the second update of each block rebuilds its input state (and TC fuses its read-out).
    # Stochastic rounding: the updates' seeds drawn in the graph (eager's generator, fallback_random), the
    # rounding moved by a bf16 step where compiled fp32 sums differ from eager's: bf16-level tolerance.
    # (CC's kernels at fp32 are those of the SR row less the rounding; each row is a minute of Inductor here.)
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=32, vocab_size=64,
        attention="deltaformer", residual=residual, backend="triton", **state,
    )  # fmt: skip
    model = GPT(cfg)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))  # (B > 1: strides of its own)
    torch.manual_seed(1)
    _, loss = model(x, y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(1)
    with torch._inductor.config.patch(fallback_random=True):
        _, loss_c = torch.compile(model, fullgraph=True)(x, y)
    loss_c.backward()
    if not state:
        torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
        return
    assert abs(loss_c.item() - loss.item()) < 1e-3 * loss.item()
    for p, g in zip(model.parameters(), grads):
        assert (p.grad - g).norm() < 3e-2 * g.norm() + 1e-3


@pytest.mark.parametrize("residual", ["ddl-cc", "ddl-tc"])
def test_kept_states_follow_ddl_keep_state_every(residual):
    """Autograd keeps the [B, T, d, d_v] state at every N-th block's input and rebuilds the others in the
    backward: the gradients are those of keeping every state (0), and fewer states stay alive."""
    idx = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))  # B = 1: interpreted
    grads, kept = {}, {}
    for every in (0, 3):  # (every block's input at 1: the same path, each rebuild one sublayer deep)
        torch.manual_seed(0)
        cfg = GPTConfig(
            n_layer=3, n_head=2, n_embd=32, head_dim=16, block_size=16, vocab_size=64, residual=residual,
            ddl_dv=3, backend="triton", ddl_keep_state_every=every,
        )  # fmt: skip
        model, states = GPT(cfg), set()

        def pack(t, states=states):
            if tuple(t.shape) in ((1, 16, 32, 3), (16, 32, 3)):  # as the model or as the ops see it
                states.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(idx, idx)
        loss.backward()
        grads[every] = [p.grad for p in model.parameters()]
        kept[every] = len(states)
    for a, b in zip(grads[3], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kept == {0: 6, 3: 1}  # 2 per block, 1 per 3 blocks


def test_ddl_keep_state_every_default():
    # d_v = 1: the state is the sublayer's input, which autograd keeps anyway, so nothing to rebuild
    assert GPTConfig(residual="ddl").ddl_keep_state_every == 0
    assert GPTConfig(residual="ddl-cc").ddl_keep_state_every == 4
    assert GPTConfig(residual="additive").ddl_keep_state_every == 0
    with pytest.raises(ValueError, match="ddl_keep_state_every"):
        GPTConfig(residual="ddl-tc", ddl_keep_state_every=-1)


# ---------------------------------------------------------------------------------------------------------
# What a rule declares (its RuleSpec), and the README's worked examples of new rules


@pytest.mark.parametrize(
    "spec,field",
    [
        (dict(stream="matrix"), "spec.stream"),
        (dict(stream="vector", ec=True), "spec.stream"),  # a vector stream has no DDL state to expand
        (dict(stream="ddl"), "spec.dv"),  # no compressor: x_in = X[..., 0] needs d_v = 1
        (dict(stream="ddl", dv=4), "spec.dv"),
        (dict(stream="ddl", dv=0, compressor="cc"), "spec.dv"),
        (dict(stream="ddl", dv=1, compressor="xc"), "spec.compressor"),
        (dict(stream="ddl", compressor="tc", ec="yes"), "spec.ec"),
        (dict(stream="ddl", compressor="cc", gate="sigmoid"), "spec.gate"),
        ({"stream": "ddl", "compressor": "cc"}, "spec is a RuleSpec"),  # a dict, not a RuleSpec
    ],
)
def test_unknown_or_inconsistent_spec_names_the_rule_and_the_field(spec, field, monkeypatch):
    as_dict = field == "spec is a RuleSpec"
    rule = type("OddRule", (Residual,), {"spec": spec if as_dict else model_module.RuleSpec(**spec)})
    monkeypatch.setitem(RESIDUALS, "odd", rule)
    with pytest.raises(ValueError, match=rf"GPTConfig.residual .*{field}.*'odd' \(OddRule\)"):
        tiny(residual="odd")


@pytest.mark.parametrize("residual", DDL_RESIDUALS)
def test_the_spec_not_the_name_builds_the_model(residual, monkeypatch):
    """A built-in rule's class registered under another name builds the same parameters, d_v, EC and
    compressors and gives the same logits: nothing reads the residual's name."""
    monkeypatch.setitem(RESIDUALS, "renamed", RESIDUALS[residual])
    a, b = make(tiny(residual=residual)), make(tiny(residual="renamed"))
    assert a.config.ddl_dv == b.config.ddl_dv and a.state_dict().keys() == b.state_dict().keys()
    idx = tokens()
    torch.testing.assert_close(b(idx, idx)[0], a(idx, idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["softmax", "deltaformer"])
def test_the_class_not_the_name_builds_the_attention(attention, monkeypatch):
    """A built-in attention's class registered under another name builds the same parameters and gives the
    same logits and FLOP count: nothing reads the attention's name."""
    monkeypatch.setitem(ATTENTIONS, "renamed", ATTENTIONS[attention])
    a, b = make(tiny(attention=attention)), make(tiny(attention="renamed"))
    assert a.state_dict().keys() == b.state_dict().keys()
    idx = tokens()
    torch.testing.assert_close(b(idx, idx)[0], a(idx, idx)[0], rtol=0, atol=0)
    assert a.flops_per_token(16) == b.flops_per_token(16)


def cached_logits_equal_full_forward(model, idx, tol):
    """Logits from the decoding cache (a prefill of 5 tokens, then one at a time) against the full
    forward's at every position."""
    with torch.no_grad():
        full = model.lm_head(model.hidden_states(idx))
        cache = Cache()
        got = [model.lm_head(model.hidden_states(idx[:, :5], cache))]
        got += [model.lm_head(model.hidden_states(idx[:, t : t + 1], cache)) for t in range(5, idx.shape[1])]
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=tol, atol=tol)


def trains_and_decodes(model, new):
    """A few AdamW steps on one repeated batch lower the loss and move each of the parameters `new`; then,
    moved off its weights, cached decoding gives the full forward's logits on the torch backend (float64)
    and on the Triton kernels (float32; on CPU through Triton's interpreter)."""
    idx = tokens(B=2, T=12)
    start = [p.detach().clone() for p in new]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(not torch.equal(p, s) for p, s in zip(new, start))
    with torch.no_grad():  # strong enough that each rule's parameters, alpha too, matter
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    cached_logits_equal_full_forward(model.eval(), idx, 1e-10)
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_triton = GPT(dataclasses.replace(model.config, backend="triton")).to(device).eval()
    on_triton.load_state_dict(model.float().state_dict())
    cached_logits_equal_full_forward(on_triton, idx.to(device), 1e-5)


def updates_with_beta(model, beta):
    """Every sublayer of the float64 model: X' = X + beta khat (v^T - khat^T X), khat = h / sqrt(|h|^2 +
    eps^2), v = value(x_in, c), beta the number given (the rules whose beta is not 2 sigmoid(W_beta c +
    b_beta))."""
    records, hooks = capture(model)
    with torch.no_grad():
        model(tokens(), tokens(seed=2))
    for h in hooks:
        h.remove()
    for r in records:
        X, h = r["X"], r["h"]
        khat = h / torch.sqrt((h * h).sum(-1, keepdim=True) + DDL_EPS**2)
        target = value(r["module"], r["x_in"], r["c"]) - torch.einsum("btiv,bti->btv", X, khat)
        want = X + beta * khat[..., :, None] * target[..., None, :]
        torch.testing.assert_close(r["X_new"], want, rtol=1e-12, atol=1e-12)


README_RULES = ["vector-stream", "ddl-stream", "no-gate", "shared"]


@pytest.mark.parametrize("example", range(len(README_RULES)), ids=README_RULES)
def test_readme_residual_example_trains_and_decodes(example, monkeypatch):
    """Each example as written (at most 30 lines), pasted into model.py's namespace: it registers its rule
    (one class, one registry line), every sublayer uses it, it trains and decodes (trains_and_decodes), its
    new parameters moving. ReZero starts as the identity (alpha = 0: X stays X0). The rules without a
    learned gate have no W_beta, b_beta (nothing touches them: the init, the reads) and update with their
    beta: 2 (at d_v = 1 through the fused read, one logit row, on the Triton backend as on the torch one),
    or 2 sigmoid(b) of the one b the whole model shares, saved once as shared.beta."""
    code = readme_blocks("Add your own residual")[example]
    assert len(code.strip().splitlines()) <= 30
    with pasted(code) as (name,):
        torch.manual_seed(0)
        cfg = tiny(residual=name, block_size=12)
        model = GPT(cfg).double()
        rule = RESIDUALS[name]
        assert all(type(b.res_attn) is rule and type(b.res_mlp) is rule for b in model.blocks)
        params = dict(model.named_parameters())
        rules = [f"blocks.{i}.{r}" for i in range(cfg.n_layer) for r in ("res_attn", "res_mlp")]
        new = {"vector-stream": [f"{r}.gate" for r in rules], "ddl-stream": [f"{r}.alpha" for r in rules],
               "no-gate": [], "shared": ["shared.beta"]}[README_RULES[example]]  # fmt: skip
        assert sorted(n for n in params if n.endswith((".gate", ".alpha")) or n.startswith("shared.")) == new
        if cfg.is_ddl:
            assert cfg.spec.gate is None  # not beta = 2 sigmoid(.): the tests of DDL's formula leave it out
        if README_RULES[example] == "ddl-stream":  # every block the identity at init: the embedding read out
            idx = tokens(B=2, T=12)
            with torch.no_grad():
                direct = model.lm_head(model.ln_f(model.readout(model.embed(idx))))
                torch.testing.assert_close(model(idx, idx)[0], direct, rtol=1e-12, atol=1e-12)
        if README_RULES[example] in ("no-gate", "shared"):
            # no W_beta, b_beta of its own; the shared b saved once
            assert [k for k in model.state_dict() if "beta" in k] == new
            perturbed_model = make(cfg)
            shared = perturbed_model.shared
            assert all(m.shared is shared for b in perturbed_model.blocks for m in (b.res_attn, b.res_mlp))
            beta = 2 * torch.sigmoid(shared.beta).item() if hasattr(shared, "beta") else 2.0
            updates_with_beta(perturbed_model, beta)
        if README_RULES[example] == "no-gate":
            fused_read_takes_one_logit_row(cfg, monkeypatch)
        trains_and_decodes(model, [params[n] for n in new])


def fused_read_takes_one_logit_row(cfg, monkeypatch):
    """d_v = 1 on the Triton backend: each read after an update is one ddl_update_norm with a logit weight
    of one row (v's), and the loss and gradients are the torch backend's."""
    pytest.importorskip("triton")
    import ops.ddl.stream as stream

    rows, fused = [], stream.ddl_update_norm
    monkeypatch.setattr(
        stream, "ddl_update_norm", lambda *a, **kw: rows.append(a[5].shape[0]) or fused(*a, **kw)
    )
    results = {}
    for backend in ("torch", "triton"):
        model = perturbed(dataclasses.replace(cfg, backend=backend))
        logits, loss = model(tokens(T=9), tokens(T=9, seed=2))
        loss.backward()
        results[backend] = logits, {n: p.grad for n, p in model.named_parameters()}
    assert rows == [1] * (2 * cfg.n_layer - 1)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_readme_attention_example_is_deltaformer_at_beta_1_trains_and_decodes():
    """The example as written (at most 30 lines), pasted into model.py's namespace: it registers its
    attention (one class, one registry line) and every block uses it; it has no W_beta, b_beta, and gives
    the logits of the built-in Deltaformer whose gate is 1 exactly (beta_max = 2, W_beta = b_beta = 0:
    2 sigmoid(0)), at its FLOPs and activation memory; it trains and decodes (trains_and_decodes)."""
    from checkpoint import step_memory

    (code,) = readme_blocks("Add your own attention")
    assert len(code.strip().splitlines()) <= 30
    with pasted(code) as (name,):
        cfg = tiny(residual="ddl", attention=name, block_size=12)
        model = make(cfg)
        assert all(type(b.attn) is ATTENTIONS[name] for b in model.blocks)
        assert not any(".attn.beta." in n for n in model.state_dict())
        gated_cfg = dataclasses.replace(cfg, attention="deltaformer", deltaformer_beta_max=2.0)
        gated = GPT(gated_cfg).double().eval()
        with torch.no_grad():
            for b in gated.blocks:
                b.attn.beta.weight.zero_()
                b.attn.beta.bias.zero_()
        missing, unexpected = gated.load_state_dict(model.state_dict(), strict=False)
        assert unexpected == [] and all(".attn.beta." in k for k in missing) and len(missing) == 4
        idx = tokens()
        torch.testing.assert_close(model(idx, idx)[0], gated(idx, idx)[0], rtol=1e-12, atol=1e-12)
        # its cost is Deltaformer's, read from its class: two stages; u among the activations of a step
        betas = sum(p.numel() for b in gated.blocks for p in b.attn.beta.parameters())
        assert model.flops_per_token(12) == gated.flops_per_token(12) - 6 * betas
        activations = [step_memory(c, 2, 12, bf16=False)["activations"] for c in (cfg, gated_cfg)]
        assert activations[0] == activations[1]
        torch.manual_seed(0)
        model = GPT(cfg).double()
        trains_and_decodes(model, [b.attn.c_attn.weight for b in model.blocks])


# The parameter names checkpoints of this model have been written with (one block, Deltaformer with its own
# w): a renamed module would break loading them, so a rename must map these names or fail naming the change.
EARLIER_KEYS_COMMON = (
    "wte.weight ln_f.weight lm_head.weight blocks.0.mlp.c_fc.weight blocks.0.mlp.c_proj.weight "
    "blocks.0.attn.c_attn.weight blocks.0.attn.c_proj.weight blocks.0.attn.q_norm.weight "
    "blocks.0.attn.k_norm.weight blocks.0.attn.w_norm.weight blocks.0.attn.beta.weight "
    "blocks.0.attn.beta.bias blocks.0.res_attn.norm.weight blocks.0.res_mlp.norm.weight"
)
DDL_KEYS = " ".join(
    f"blocks.0.{res}.{p}"
    for res in ("res_attn", "res_mlp")
    for p in ("beta.bias", "beta.weight", "v_proj.bias", "v_proj.weight")
)
COMPRESSOR_KEYS = "blocks.0.compress.conv blocks.0.compress.read readout.conv readout.read ec_conv"
EARLIER_KEYS = {
    "additive": "",
    "ddl": DDL_KEYS,
    "ddl-tc": f"{DDL_KEYS} {COMPRESSOR_KEYS}",
    "ddl-cc": f"{DDL_KEYS} {COMPRESSOR_KEYS}",
}


@pytest.mark.parametrize("residual", list(EARLIER_KEYS))
def test_checkpoints_of_the_earlier_layout_load(residual, tmp_path):
    """A checkpoint written under the earlier names (random tensors of the right shapes) loads through
    checkpoint.load_model into exactly those tensors."""
    from checkpoint import load_model

    cfg = tiny(n_layer=1, residual=residual, attention="deltaformer", deltaformer_w="proj")
    shapes = {k: v.shape for k, v in GPT(cfg).state_dict().items()}
    keys = (EARLIER_KEYS_COMMON + " " + EARLIER_KEYS[residual]).split()
    torch.manual_seed(0)
    earlier = {k: torch.randn(shapes[k]) for k in keys}
    earlier["lm_head.weight"] = earlier["wte.weight"]  # tied
    torch.save({"model": earlier, "model_args": dataclasses.asdict(cfg)}, tmp_path / "ckpt.pt")
    model, _ = load_model(tmp_path / "ckpt.pt")
    assert set(model.state_dict()) == set(keys)
    for k, v in model.state_dict().items():
        assert torch.equal(v, earlier[k]), k


def init_rows():
    """Every residual x attention row (Deltaformer with w = k and its own w) under both inits, and the
    options that change the init's parameters or values: GPTConfig overrides of tiny(), with a name."""
    rows = [
        dict(residual=r, attention=a, deltaformer_w=w, init=init)
        for r in ("additive", "ddl", "ddl-tc", "ddl-cc")
        for a, w in (("softmax", "k"), ("deltaformer", "k"), ("deltaformer", "proj"))
        for init in ("scaled", "nanogpt")
    ]
    rows += [
        dict(residual="ddl-cc", attention="softmax", deltaformer_w="k", init="scaled", ddl_v="linear"),
        dict(residual="ddl", attention="softmax", deltaformer_w="k", init="nanogpt", ddl_v="linear"),
        dict(residual="ddl-tc", attention="softmax", deltaformer_w="k", init="scaled", ddl_ec=False,
             ddl_beta_init=0.5),
    ]  # fmt: skip
    for row in rows:
        extra = [
            f"{k}={v}" for k, v in row.items() if k not in ("residual", "attention", "deltaformer_w", "init")
        ]
        w = [f"w={row['deltaformer_w']}"] if row["attention"] == "deltaformer" else []
        yield " ".join([row["residual"], row["attention"], *w, row["init"], *extra]), row


def expected_keys(cfg):
    """A model's state_dict keys in order, written out from the architecture: the names its checkpoints
    have been saved under, in the order the parameters are made (which the init's draws follow)."""
    rule = ["norm.weight"]
    if cfg.residual != "additive":
        rule += ["v_proj.weight", "v_proj.bias", "beta.weight", "beta.bias"]
        if cfg.ddl_v == "linear":  # v = W_v c: no b_v
            rule.remove("v_proj.bias")
    attn = ["c_attn.weight", "c_proj.weight", "q_norm.weight", "k_norm.weight"]
    if cfg.attention == "deltaformer":
        attn += (["w_norm.weight"] if cfg.deltaformer_w == "proj" else []) + ["beta.weight", "beta.bias"]
    compressor = ["conv", "read"] if cfg.residual in ("ddl-cc", "ddl-tc") else []  # ddl (d_v = 1): none
    keys = (["ec_conv"] if compressor and cfg.ddl_ec else []) + ["wte.weight"]  # GPT's own parameter first
    for i in range(cfg.n_layer):
        keys += [f"blocks.{i}.compress.{n}" for n in compressor] + [f"blocks.{i}.res_attn.{n}" for n in rule]
        keys += [f"blocks.{i}.attn.{n}" for n in attn] + [f"blocks.{i}.res_mlp.{n}" for n in rule]
        keys += [f"blocks.{i}.mlp.c_fc.weight", f"blocks.{i}.mlp.c_proj.weight"]
    return keys + [f"readout.{n}" for n in compressor] + ["ln_f.weight", "lm_head.weight"]


@pytest.mark.parametrize("name,row", list(init_rows()), ids=[name for name, _ in init_rows()])
def test_state_dict_keys_of_every_row(name, row):
    with torch.device("meta"):
        model = GPT(tiny(**row))
    assert list(model.state_dict()) == expected_keys(model.config)


# The init of each row of init_rows() after torch.manual_seed(0), as the code before the attentions became
# classes drew it (tiny(); the first two sums of fingerprint(state_dict)): a changed draw, order, scale or
# bias of any row must show. The tolerance, 1e-6 relative, admits only last-bit differences of a platform's
# vectorised random normals.
INIT_FINGERPRINTS = {
    "additive softmax scaled": (1865.7449445376608, -1080.0425414222934),
    "additive softmax nanogpt": (623.2128953733928, -1089.3489903227705),
    "additive deltaformer w=k scaled": (1877.44147854224, 1235.8815664597796),
    "additive deltaformer w=k nanogpt": (625.8545141188197, 1804.6108990225516),
    "additive deltaformer w=proj scaled": (2053.5910809488287, -1497.430117058966),
    "additive deltaformer w=proj nanogpt": (689.938535871856, -1556.9736369813277),
    "ddl softmax scaled": (1874.346251893609, 459.86758169014774),
    "ddl softmax nanogpt": (622.368908250001, 307.0979614073467),
    "ddl deltaformer w=k scaled": (1886.1547060254766, 1419.0639749977108),
    "ddl deltaformer w=k nanogpt": (625.6660825502307, 1049.2948996728323),
    "ddl deltaformer w=proj scaled": (2062.067872401444, -4052.826596278369),
    "ddl deltaformer w=proj nanogpt": (691.051369315373, -4260.781526844505),
    "ddl-tc softmax scaled": (2149.485083696314, -142.09658983455847),
    "ddl-tc softmax nanogpt": (1144.3140096751877, -401.80137132925836),
    "ddl-tc deltaformer w=k scaled": (2156.9289492257435, 498.2639513187578),
    "ddl-tc deltaformer w=k nanogpt": (1146.2265517848973, 322.502655368451),
    "ddl-tc deltaformer w=proj scaled": (2332.0406680250735, 1651.8437769066013),
    "ddl-tc deltaformer w=proj nanogpt": (1213.3760030719122, 1324.1814787027324),
    "ddl-cc softmax scaled": (2065.2528389452873, -1376.9606931851945),
    "ddl-cc softmax nanogpt": (856.3140096751875, -1457.6298580123303),
    "ddl-cc deltaformer w=k scaled": (2067.3305000118366, -491.8399769533844),
    "ddl-cc deltaformer w=k nanogpt": (858.2265517848974, -799.5910768461086),
    "ddl-cc deltaformer w=proj scaled": (2251.6331588067105, 796.4668596587044),
    "ddl-cc deltaformer w=proj nanogpt": (925.3760030719121, 915.8044558389107),
    "ddl-cc softmax scaled ddl_v=linear": (2066.8790200546155, -777.4660823387597),
    "ddl softmax nanogpt ddl_v=linear": (624.2179433687006, 79.12479034463723),
    "ddl-tc softmax scaled ddl_ec=False ddl_beta_init=0.5": (2025.8795329303227, 911.5483097945387),
}


def fingerprint(state):
    """(sum |x_i|, sum x_i w_i, sum |x_i w_i|) over the concatenation of every tensor in order, w_i = i mod 97
    - 48, in exactly rounded float64 (math.fsum: independent of the order of summation)."""
    flat = torch.cat([t.detach().flatten().double() for t in state.values()])
    w = (torch.arange(flat.numel()) % 97 - 48).double()
    return (
        math.fsum(flat.abs().tolist()),
        math.fsum((flat * w).tolist()),
        math.fsum((flat * w).abs().tolist()),
    )


def test_init_of_every_row_is_unchanged():
    names = []
    for name, row in init_rows():
        torch.manual_seed(0)
        abs_sum, weighted, weighted_abs = fingerprint(GPT(tiny(**row)).state_dict())
        want_abs, want_weighted = INIT_FINGERPRINTS[name]
        assert abs(abs_sum - want_abs) <= 1e-6 * want_abs, (name, abs_sum, want_abs)
        assert abs(weighted - want_weighted) <= 1e-6 * weighted_abs, (name, weighted, want_weighted)
        names.append(name)
    assert sorted(names) == sorted(INIT_FINGERPRINTS)
