"""Cached decoding (sample.generate) against full forward passes, for every residual x attention variant.

Three checks per variant, float64, every parameter strongly perturbed off its init (so the TC/EC
convolutions really mix in earlier tokens and the gates differ per token):
- the logits from the cache (prefill, a chunk of 3, then one token at a time) equal the full forward's
  logits at every position;
- generate(top_k=1) emits exactly the tokens of greedy decoding by full forward passes, including past
  block_size, where both crop to the last block_size tokens (nanoGPT);
- the same for sampling with the same RNG seed (diverse tokens, unlike greedy decoding of a random model).
Each with both caches: Cache (grows) and StaticCache (preallocated buffers written in place); generate's
decode="compiled" (torch.compile of the StaticCache step) on a few variants, "none" (no cache) once.
Left-padded prompts of different lengths in one batch (attention_mask): each row's greedy tokens are those
of its prompt alone, on every decode mode, the window crossing block_size.
"""

import os
import re
import sys

import pytest
import torch

import cache as cache_module
import sample
from cache import Cache
from model import ATTENTIONS, GPT, RESIDUALS, GPTConfig
from sample import DECODES, generate, sample_token, static_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_infer import VARIANTS  # noqa: E402

V = 67

CASES = [dict(residual=r, attention=a) for r in RESIDUALS for a in ATTENTIONS]  # the 8 combinations
CASES += [  # every Deltaformer kernel and every choice of w at least once
    dict(residual="ddl-tc", attention="deltaformer", deltaformer_kernel="relu", deltaformer_w="q"),
    dict(residual="ddl-cc", attention="deltaformer", deltaformer_kernel="linear", deltaformer_w="proj"),
    dict(residual="additive", attention="deltaformer", deltaformer_kernel="softmax", deltaformer_w="proj"),
    dict(residual="ddl", attention="deltaformer", deltaformer_kernel="relu", deltaformer_w="k"),
    dict(residual="ddl-tc", attention="softmax", ddl_ec=False, ddl_conv_size=2, ddl_dv=3),
]


def make(overrides, block_size=16):
    torch.manual_seed(0)
    shape = dict(n_layer=2, n_head=2, n_embd=32, head_dim=16, block_size=block_size, vocab_size=V)
    cfg = GPTConfig(**{**shape, "backend": "torch", **overrides})
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # strong enough that greedy decoding does not just repeat a token
        for name, p in model.named_parameters():
            p.add_((0.1 if name == "wte.weight" else 0.5) * torch.randn_like(p))
    return model


def case_id(case):
    return "-".join(str(v) for v in case.values())


@pytest.mark.parametrize("kind", ["cache", "static"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cached_logits_equal_full_forward(case, kind):
    model = make(case)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.lm_head(model.hidden_states(idx))  # [B, T, V]
        cache = Cache() if kind == "cache" else static_cache(model, idx)
        prefill = model.lm_head(model.hidden_states(idx[:, :5], cache))
        cache.prompt = False  # (a StaticCache: past the prompt, every call writes in place)
        torch.testing.assert_close(prefill, full[:, :5], rtol=1e-10, atol=1e-10)
        chunk = model.lm_head(model.hidden_states(idx[:, 5:8], cache))  # a chunk continuing the cache
        torch.testing.assert_close(chunk, full[:, 5:8], rtol=1e-10, atol=1e-10)
        for t in range(8, 16):
            step = model.lm_head(model.hidden_states(idx[:, t : t + 1], cache))
            torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-10, atol=1e-10, msg=f"position {t}")
        assert cache.pos == 16
        if kind == "cache":  # (a StaticCache's owner keeps to block_size: no check, no sync, in its step)
            with pytest.raises(ValueError, match="block_size"):
                model.hidden_states(idx[:, :1], cache)


def decode_by_full_forward(model, idx, n, **sampling):
    """nanoGPT's loop: a full forward over the last block_size tokens for every new token."""
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat([idx, sample_token(logits[:, -1], **sampling)], dim=1)
    return idx


@pytest.mark.parametrize("decode", ["cache", "static"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generate_greedy_equals_full_forward(case, decode):
    model = make(case)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompt, 15, top_k=1, decode=decode)  # 5 + 15 = 20 > block_size 16: crosses the crop
    want = prompt
    for _ in range(15):  # greedy by argmax, written out
        logits, _ = model(want[:, -16:])
        want = torch.cat([want, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out.shape == (2, 20) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, want)


def test_generate_stops_when_told():
    """stop sees only the new tokens, after each step; the tokens up to the stop are the same as without."""
    model = make(dict(residual="ddl-cc", attention="softmax"))
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    full = generate(model, prompt, 10, top_k=1)
    seen = []

    def stop(new):
        seen.append(new.shape[1])
        return new.shape[1] >= 4

    out = generate(model, prompt, 10, top_k=1, stop=stop)
    assert seen == [1, 2, 3, 4] and torch.equal(out, full[:, :9])
    assert torch.equal(generate(model, prompt, 10, top_k=1, stop=lambda new: False), full)


@pytest.mark.parametrize("decode", ["cache", "static"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_generate_sampled_equals_full_forward(case, decode):
    """Sampling (same RNG seed) instead of argmax: random tokens keep the sequence from settling into a
    repetition, so the cache sees many different inputs (greedy decoding of a random model often repeats)."""
    model = make(case)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    out = generate(model, prompt, 15, temperature=1.5, decode=decode)
    torch.manual_seed(7)
    want = decode_by_full_forward(model, prompt, 15, temperature=1.5)
    assert torch.equal(out, want)
    assert min(len(set(row.tolist())) for row in out[:, 5:]) > 5  # not a degenerate repetition


def test_generate_sampling_runs_and_respects_top_k():
    model = make(dict(residual="ddl-tc", attention="deltaformer"))
    prompt = torch.zeros(3, 1, dtype=torch.long)
    torch.manual_seed(0)
    out = generate(model, prompt, 20, temperature=0.8, top_k=5)
    assert out.shape == (3, 21) and out.min() >= 0 and out.max() < V
    # top_k: every sampled token is among the 5 most likely given its prefix (full forward)
    for t in range(1, 21):
        logits, _ = model(out[:, max(0, t - 16) : t])
        top5 = logits[:, -1].topk(5).indices
        assert (top5 == out[:, t : t + 1]).any(-1).all()
    out = generate(model, prompt, 4)  # plain sampling, no top_k
    assert out.shape == (3, 5)


def test_generate_none_and_bad_decode():
    """decode="none" is nanoGPT's loop (a forward over the whole window per token); a bad decode says so."""
    model = make(dict(residual="ddl-tc", attention="deltaformer"))
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    out = generate(model, prompt, 15, temperature=1.5, decode="none")
    torch.manual_seed(7)
    assert torch.equal(out, decode_by_full_forward(model, prompt, 15, temperature=1.5))
    with pytest.raises(ValueError, match=re.escape(f"decode must be one of {DECODES}, got 'fast'")):
        generate(model, prompt, 1, decode="fast")


def test_static_cache_is_reused_in_place():
    """A model's StaticCache serves its next call of the same batch size again (the same buffers, so the
    same addresses, zeroed: a shorter prompt after a longer one gives a fresh cache's tokens) and is made
    anew for another batch size."""
    model = make(dict(residual="ddl-tc", attention="deltaformer"))
    long, short, three = (torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(T))
                          for B, T in ((2, 5), (2, 2), (3, 5)))  # fmt: skip
    assert torch.equal(generate(model, long, 8, top_k=1, decode="static"), generate(model, long, 8, top_k=1))
    cache = static_cache(model, long)
    buffers = [t for v in cache.store.values() for t in (v if isinstance(v, tuple) else (v,))]
    assert len(buffers) == 2 * 2 + 2 * 2 + 1 + 1  # k and u of 2 layers; TC: 2 reads a block and 1; EC
    ptrs = [t.data_ptr() for t in buffers]
    assert torch.equal(
        generate(model, short, 8, top_k=1, decode="static"), generate(model, short, 8, top_k=1)
    )
    assert static_cache(model, short) is cache and [t.data_ptr() for t in buffers] == ptrs
    assert torch.equal(
        generate(model, three, 8, top_k=1, decode="static"), generate(model, three, 8, top_k=1)
    )
    assert static_cache(model, three) is not cache


@pytest.mark.slow
def test_generate_compiled_equals_cache():
    """decode="compiled" (the StaticCache step through torch.compile; on the CPU Inductor's C++, the CUDA
    graphs only on a GPU): the tokens of decode="cache", greedy and sampled, from one graph for every
    position (no recompile as the position moves, none for the next call) without graph breaks."""
    from torch._dynamo.utils import counters

    for case in (
        dict(residual="ddl-tc", attention="deltaformer"),
        dict(residual="ddl-cc", attention="softmax"),
    ):
        torch._dynamo.reset()
        counters.clear()
        model = make(case)
        prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
        out = generate(model, prompt, 10, top_k=1, decode="compiled")
        assert torch.equal(out, generate(model, prompt, 10, top_k=1)), case
        outs = []
        for decode in ("compiled", "cache"):
            torch.manual_seed(7)
            outs.append(generate(model, prompt, 10, temperature=1.5, decode=decode))
        assert torch.equal(outs[0], outs[1]), case
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (case, dict(counters))


# Every row of bench_infer on the ops' PyTorch path; on their Triton path (interpreted here) the DDL rows
# whose ops differ: d_v = 1 (the fused norm), CC, TC with EC (the EC kernel in the step)
COMPILED_ROWS = [(row, "torch") for row in VARIANTS]
COMPILED_ROWS += [(row, "triton") for row in ("ddl", "ddl-cc-noec", "ddl-tc")]


@pytest.mark.slow
@pytest.mark.parametrize("row,backend", COMPILED_ROWS, ids=lambda x: x)
def test_compiled_step_is_one_graph_without_recompiles(row, backend, monkeypatch):
    """decode="compiled" for every bench_infer row (float64): dynamo traces the step (torch.compile with
    backend "aot_eager": the graph capture and AOT trace Inductor would get, without its slow CPU code
    generation) into one graph with no break, which every position and the next prompt (another length,
    the same batch) replay without a recompile (error_on_recompile), emitting decode="cache"'s tokens,
    greedy and sampled."""
    from torch._dynamo.utils import counters

    if backend == "triton":
        pytest.importorskip("triton")
    torch._dynamo.reset()
    counters.clear()
    aot_eager = cache_module.compiled_next_logits("aot_eager")
    monkeypatch.setattr(sample, "compiled_next_logits", lambda: aot_eager)
    model = make({**VARIANTS[row], "n_layer": 1, "backend": backend})
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = generate(model, prompt, 6, top_k=1, decode="compiled")
        torch.manual_seed(7)
        sampled = generate(model, prompt[:, :3], 4, temperature=1.5, decode="compiled")
    assert torch.equal(out, generate(model, prompt, 6, top_k=1))
    torch.manual_seed(7)
    assert torch.equal(sampled, generate(model, prompt[:, :3], 4, temperature=1.5))
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters)


@pytest.mark.gpu
def test_generate_compiled_on_cuda_replays_cuda_graphs():
    """On a GPU, decode="compiled" runs its steps as CUDA graphs (none skipped: the cache's buffers are
    static inputs, which a graph may write) on the Triton kernels, and gives the tokens of "cache" (fp32)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for case in (
        dict(residual="ddl-tc", attention="deltaformer"),
        dict(residual="ddl-cc"),
        dict(residual="ddl"),
    ):
        model = make(dict(case, backend="auto")).float().cuda()
        prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(2)).cuda()
        want = generate(model, prompt, 12, top_k=1)
        assert torch.equal(generate(model, prompt, 12, top_k=1, decode="compiled"), want), case
        assert torch.equal(generate(model, prompt, 12, top_k=1, decode="compiled"), want), case  # replayed
    assert counters["inductor"]["cudagraph_skips"] == 0 and counters["stats"]["unique_graphs"] == 3, counters


# ---- left-padded batches ----
ROWS = [pytest.param(dict(residual=r, attention=a), id=f"{r}-{a}") for r in RESIDUALS for a in ATTENTIONS]


def left_padded(prompts, gen):
    """The prompts (1-D) left-padded with random tokens to the longest's length, and their attention_mask."""
    T = max(len(p) for p in prompts)
    idx = torch.randint(0, V, (len(prompts), T), generator=gen)
    mask = torch.zeros_like(idx)
    for b, p in enumerate(prompts):
        idx[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
    return idx, mask


def check_padded_generate(case, decode):
    """Prompts of 7, 2 and 4 tokens, left-padded, and 12 new tokens: the batch crosses block_size (16) while
    the short rows alone do not, so the window it slides holds padding; each row's tokens are greedy decoding
    of its prompt alone by full forward passes."""
    model = make(case)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=gen) for n in (7, 2, 4)]
    idx, mask = left_padded(prompts, gen)
    out = generate(model, idx, 12, top_k=1, decode=decode, attention_mask=mask)
    assert torch.equal(out[:, :7], idx)
    for b, p in enumerate(prompts):
        alone = decode_by_full_forward(model, p[None], 12, top_k=1)[0, len(p) :]
        assert torch.equal(out[b, 7:], alone), (b, out[b, 7:].tolist(), alone.tolist())


@pytest.mark.parametrize("decode", ["cache", "static", "none"])
@pytest.mark.parametrize("case", ROWS)
def test_generate_left_padded_rows_equal_each_alone(case, decode):
    check_padded_generate(case, decode)


@pytest.mark.slow
@pytest.mark.parametrize("case", [dict(residual="ddl-tc", attention="softmax")], ids=case_id)
def test_generate_compiled_left_padded_rows_equal_each_alone(case):
    torch._dynamo.reset()
    check_padded_generate(case, "compiled")


def test_generate_refuses_a_row_without_tokens():
    model = make(dict(residual="additive", attention="softmax"))
    idx = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(3))
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    for mask in (right, torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])):
        with pytest.raises(ValueError, match="must end every row with a token"):
            generate(model, idx, 2, top_k=1, attention_mask=mask)
    with pytest.raises(ValueError, match="only left padding"):  # a 0 after a 1 before the last token
        generate(model, idx, 2, top_k=1, attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
