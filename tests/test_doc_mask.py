"""GPTConfig.doc_mask and left padding, every residual x attention row, float64, both backends (Triton
through the interpreter): a document packed after others gets the logits and gradients it gets alone; a row
of one document is unchanged by the flag; cached decoding across a boundary equals the full forward; a
left-padded row equals itself alone. The ops' own tests cover boundaries at their chunk and tile edges. On
Triton (slow through the interpreter) the model has one layer, and the gradients are compared for the rows
whose tokens mix through a Triton kernel (TC, EC, Deltaformer); softmax attention runs no Triton kernel."""

import pytest
import torch

from cache import Cache, StaticCache
from model import EOT, GPT, GPTConfig
from ops.common import doc_starts

ROWS = [dict(residual=r) for r in ("additive", "ddl", "ddl-cc", "ddl-tc")]
ROWS += [dict(residual=r, ddl_ec=False) for r in ("ddl-cc", "ddl-tc")]
ROWS += [dict(attention="deltaformer", deltaformer_kernel=k) for k in ("softmax", "relu", "linear")]
ROWS += [dict(residual="ddl-cc", attention="deltaformer", deltaformer_w="proj")]
DOCS = (0, 5, 6, 13)  # where documents begin: at 0, two EOTs in a row (a 1-token document), one later
T = 20


def row_id(row):
    return "-".join(f"{v}" for v in row.values())


def make(row, backend="torch", doc_mask=True):
    torch.manual_seed(0)
    shape = dict(n_layer=1 if backend == "triton" else 2, n_head=2, n_embd=32, head_dim=16, block_size=32)
    cfg = GPTConfig(**shape, vocab_size=EOT + 1, backend=backend, doc_mask=doc_mask, **row)
    model = GPT(cfg).to(dtype(row, backend))
    with torch.no_grad():  # off the identity-like init, so that the convs and gates mix tokens
        for name, p in model.named_parameters():
            p.add_((0.05 if name == "wte.weight" else 0.3) * torch.randn_like(p))
    return model


def dtype(row, backend):  # the Triton Deltaformer computes in fp32 (its tests: tests/test_deltaformer.py)
    return torch.float32 if backend == "triton" and row.get("attention") == "deltaformer" else torch.float64


def close(a, b, row, backend, msg=""):
    if dtype(row, backend) == torch.float64:
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=msg)
    else:  # fp32 sums over 50K-row gradients: the error relative to the tensor's norm (a leak gives ~1)
        error = ((a - b).norm() / b.norm()).item()
        assert error < 1e-5, f"{msg}: relative error {error:.2e}"


def packed(docs=DOCS, T=T, B=2):
    idx = torch.randint(0, 200, (B, T))
    idx[:, list(docs)] = EOT
    return idx


def spans(docs=DOCS, T=T):
    ends = list(docs[1:]) + [T]
    return list(zip(docs, ends))


def mixes_on_triton(row):  # a Triton kernel mixes its tokens: TC, EC or Deltaformer
    ec = row.get("ddl_ec", True) and row.get("residual") in ("ddl-cc", "ddl-tc")
    return ec or row.get("residual") == "ddl-tc" or row.get("attention") == "deltaformer"


# On Triton, TC without EC runs the TC kernels of the TC row with EC (20 s in the interpreter): left out
TC_NO_EC = dict(residual="ddl-tc", ddl_ec=False)
PACKED = [(r, b) for r in ROWS for b in ("torch", "triton") if b == "torch" or r != TC_NO_EC]


@pytest.mark.parametrize("row,backend", PACKED, ids=[f"{row_id(r)}-{b}" for r, b in PACKED])
def test_packed_document_equals_it_alone(row, backend):
    model = make(row, backend)
    B = 1 if backend == "triton" else 2  # the interpreter's time grows with the programs, rows are alike
    idx, grads = packed(B=B), backend == "torch" or mixes_on_triton(row)
    weights = torch.randn(B, T, model.config.vocab_size, dtype=dtype(row, backend))
    with torch.set_grad_enabled(grads):
        logits = model(idx, torch.zeros_like(idx))[0]
        alone = [model(idx[:, a:b], torch.zeros_like(idx[:, a:b]))[0] for a, b in spans()]
    close(logits, torch.cat(alone, dim=1), row, backend)
    if not grads:
        return
    (logits * weights).sum().backward()
    together = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for (a, b), part in zip(spans(), alone):
        (part * weights[:, a:b]).sum().backward()
    for n, p in model.named_parameters():
        close(together[n], p.grad, row, backend, msg=n)


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_one_document_is_unchanged_by_the_flag(row):
    idx = packed(docs=(0,))
    masked, plain = make(row, doc_mask=True), make(row, doc_mask=False)
    torch.testing.assert_close(masked(idx, idx)[0], plain(idx, idx)[0], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(masked(packed())[0], plain(packed())[0])  # the flag does something


@pytest.mark.parametrize("kind", ["cache", "static"])
@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_cached_decoding_across_documents_equals_the_full_forward(row, kind):
    model = make(row).eval()
    idx = packed()
    with torch.no_grad():
        full = model.lm_head(model.hidden_states(idx))
        cache = Cache() if kind == "cache" else StaticCache(model.config.block_size, idx.device)
        steps = [model.lm_head(model.hidden_states(idx[:, :4], cache))]  # the prompt, then one token a step
        cache.prompt = False
        steps += [model.lm_head(model.hidden_states(idx[:, t : t + 1], cache)) for t in range(4, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_left_padded_rows_equal_each_row_alone(row, backend):
    model = make(row, backend, doc_mask=False).eval()
    lengths = (9, 4)
    rows = [torch.randint(0, 200, (1, n)) for n in lengths]
    idx = torch.zeros(2, max(lengths), dtype=torch.long)
    mask = torch.zeros(2, max(lengths), dtype=torch.long)
    for b, r in enumerate(rows):
        idx[b, -r.shape[1] :], mask[b, -r.shape[1] :] = r, 1
    with torch.no_grad():
        batch = model.lm_head(model.hidden_states(idx, attention_mask=mask))
        for b, r in enumerate(rows):
            alone = model.lm_head(model.hidden_states(r))
            close(batch[b, -r.shape[1] :], alone[0], row, backend)


def test_doc_starts_from_eot_and_padding():
    idx = torch.tensor([[EOT, 3, 4, EOT, EOT, 7], [1, 2, 3, 4, 5, 6]])
    assert doc_starts(idx, EOT).tolist() == [[0, 0, 0, 3, 4, 4], [0, 0, 0, 0, 0, 0]]
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]).bool()
    assert doc_starts(idx, None, real=real).tolist() == [[0] * 6, [0, 0, 0, 3, 3, 3]]
    assert doc_starts(idx, EOT, pos=10).tolist() == [[10, 10, 10, 13, 14, 14], [0] * 6]  # a cache goes on
    cache = Cache()
    cache.doc_start(torch.tensor([[0, 0, 2]]))
    assert cache.doc_start(torch.tensor([[0, 4]])).tolist() == [[2, 4]]


def test_attention_mask_refusals():
    model = make(ROWS[0], doc_mask=False)
    idx = torch.randint(0, 200, (2, 5))
    with pytest.raises(ValueError, match="only left padding"):
        model(idx, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        model(idx, attention_mask=torch.ones(2, 4))
