"""eval.py: the lm-eval wrapper's scores against direct computations, checkpoint loading, the local
shakespeare_cloze task end to end, and the command line's one-line errors."""

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

import eval as ev  # noqa: E402
from data.tokenizer import EOT, get_encoding  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from sample import generate  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 32
WORDS = (
    "the king queen lord my thy thee and of to a in that is not with his be your for this but have he "
    "love heaven night death sweet good come go speak hear what shall will would sir madam grace blood "
    "crown sword fair true false O alas, nay! yea; here there now then honour fortune. Enter Exit"
).split()


def tiny(residual="additive", attention="softmax", seed=0, block_size=BLOCK):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=2,
        n_embd=64,
        head_dim=32,
        n_head=2,
        block_size=block_size,
        residual=residual,
        attention=attention,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # larger logits than the init's: peaked distributions, clear greedy choices
        model.wte.weight.mul_(10)
    return model


@pytest.fixture(scope="module")
def model64():
    """A tiny random model in float64: the wrapper and the direct computations agree to rounding."""
    return tiny().double()


def random_text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def direct_loglikelihood(model, ctx, cont):
    """(sum log p(cont | ctx), cont is the argmax everywhere): one plain forward of the last block_size + 1
    tokens of ctx + cont (the context cut from the left), log_softmax over the full logits."""
    bs = model.config.block_size
    ids = (ctx + cont)[-(bs + 1) :]
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    with torch.no_grad():
        logits, _ = model(x, targets=y)  # with targets: logits at every position
    logp = torch.log_softmax(logits[0], dim=-1)[-len(cont) :]
    tgt = y[0, -len(cont) :]
    return logp.gather(-1, tgt[:, None]).sum().item(), bool((logp.argmax(-1) == tgt).all())


def token_requests(gen, vocab=50257):
    """Token-level requests whose inputs are shorter than, equal to and longer than the block size."""
    reqs = []
    for n_ctx, n_cont in [(1, 1), (3, 5), (20, 8), (27, 5), (28, 5), (29, 5), (31, 1), (32, 1), (33, 2)]:
        reqs.append((n_ctx, n_cont))
    reqs += [
        (60, 7),
        (100, 1),
        (1, BLOCK),
        (9, BLOCK),
    ]  # context cut from the left; a block-long continuation
    out = []
    for n_ctx, n_cont in reqs:
        ctx = torch.randint(0, vocab, (n_ctx,), generator=gen).tolist()
        cont = torch.randint(0, vocab, (n_cont,), generator=gen).tolist()
        out.append((None, ctx, cont))
    return out


@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_loglikelihood_tokens_equal_direct(model64, batch_size):
    gen = torch.Generator().manual_seed(batch_size)
    reqs = token_requests(gen)
    random.Random(batch_size).shuffle(reqs)
    lm = ev.CheckpointLM(model=model64, device="cpu", batch_size=batch_size)
    got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert len(got) == len(reqs)
    for (_, ctx, cont), (lp, greedy) in zip(reqs, got):
        ref_lp, ref_greedy = direct_loglikelihood(model64, ctx, cont)
        assert abs(lp - ref_lp) < 1e-5, (len(ctx), len(cont), lp, ref_lp)
        assert greedy == ref_greedy


def test_greedy_flag(model64):
    """A continuation that is the model's own argmax chain is greedy; changing one token makes it not."""
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 50257, (10,), generator=gen).tolist()
    seq = list(ctx)
    with torch.no_grad():
        for _ in range(6):
            logits, _ = model64(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
    cont = seq[len(ctx) :]
    wrong = cont[:3] + [(cont[3] + 1) % 50257] + cont[4:]
    lm = ev.CheckpointLM(model=model64, device="cpu", batch_size=2)
    (lp, greedy), (lp_wrong, greedy_wrong) = lm._loglikelihood_tokens(
        [(None, ctx, cont), (None, ctx, wrong)], disable_tqdm=True
    )
    assert greedy and not greedy_wrong
    assert lp > lp_wrong


@pytest.mark.parametrize(
    "residual,attention", [("ddl-tc", "softmax"), ("ddl-cc", "deltaformer"), ("ddl", "softmax")]
)
def test_loglikelihood_tokens_variants(residual, attention):
    model = tiny(residual, attention, seed=1).double()
    gen = torch.Generator().manual_seed(7)
    reqs = [r for k, r in enumerate(token_requests(gen)) if k % 2 == 0]
    lm = ev.CheckpointLM(model=model, device="cpu", batch_size=3)
    for (_, ctx, cont), (lp, greedy) in zip(reqs, lm._loglikelihood_tokens(reqs, disable_tqdm=True)):
        ref_lp, ref_greedy = direct_loglikelihood(model, ctx, cont)
        assert abs(lp - ref_lp) < 1e-5, (residual, attention, len(ctx), len(cont))
        assert greedy == ref_greedy


def test_loglikelihood_strings(model64):
    """The string API: context / continuation split as lm-eval does (trailing whitespace of the context
    moves to the continuation, whose tokens are those of context + continuation after the context's); an
    empty context is conditioned on EOT."""
    enc = get_encoding()
    rng = random.Random(11)
    pairs = [
        (random_text(rng, rng.randint(1, 40)), " " + random_text(rng, rng.randint(1, 6))) for _ in range(6)
    ]
    pairs += [("", random_text(rng, 5)), ("ROMEO:\n", "But soft, what light")]
    reqs = [Instance("loglikelihood", {}, pair, k) for k, pair in enumerate(pairs)]
    got = ev.CheckpointLM(model=model64, device="cpu", batch_size=3).loglikelihood(reqs, disable_tqdm=True)
    for (ctx, cont), (lp, _) in zip(pairs, got):
        if ctx:
            n = len(ctx) - len(ctx.rstrip())
            ctx, cont = ctx[: len(ctx) - n], ctx[len(ctx) - n :] + cont
            ctx_ids = enc.encode_ordinary(ctx)
            cont_ids = enc.encode_ordinary(ctx + cont)[len(ctx_ids) :]
        else:
            ctx_ids, cont_ids = [EOT], enc.encode_ordinary(cont)
        assert abs(lp - direct_loglikelihood(model64, ctx_ids, cont_ids)[0]) < 1e-5


def test_loglikelihood_rolling_equals_windowed_nll(model64):
    """A text of several block_size windows: the sum over its tokens of log p, each chunk of block_size
    tokens scored from the block_size inputs that end just before the chunk's last token (EOT first)."""
    enc = get_encoding()
    rng = random.Random(5)
    texts = [random_text(rng, 90), random_text(rng, 7), random_text(rng, 60)]
    lengths = [len(enc.encode_ordinary(t)) for t in texts]
    assert lengths[0] > 2 * BLOCK and lengths[0] % BLOCK and lengths[1] < BLOCK  # partial last window
    got = ev.CheckpointLM(model=model64, device="cpu", batch_size=2).loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), k) for k, t in enumerate(texts)], disable_tqdm=True
    )
    for text, lp in zip(texts, got):
        tokens = enc.encode_ordinary(text)
        seq = torch.tensor([EOT] + tokens)  # seq[i] precedes tokens[i]
        total = 0.0
        for a in range(0, len(tokens), BLOCK):
            b = min(a + BLOCK, len(tokens))
            start = max(0, b - BLOCK)
            with torch.no_grad():
                logits, _ = model64(seq[None, start:b], targets=seq[None, start + 1 : b + 1])
            logp = torch.log_softmax(logits[0], dim=-1)[a - start :]
            total += logp.gather(-1, seq[a + 1 : b + 1, None]).sum().item()
        assert abs(lp - total) < 1e-5


def test_loglikelihood_rolling_within_one_window_is_the_mean_loss(model64):
    enc = get_encoding()
    tokens = enc.encode_ordinary(random_text(random.Random(9), 12))
    assert len(tokens) <= BLOCK
    (lp,) = ev.CheckpointLM(model=model64, device="cpu").loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (enc.decode(tokens),), 0)], disable_tqdm=True
    )
    seq = torch.tensor([[EOT] + tokens])
    with torch.no_grad():
        _, loss = model64(seq[:, :-1], targets=seq[:, 1:])  # mean cross-entropy
    assert abs(lp - (-loss.item() * len(tokens))) < 1e-5


def test_generate_until_is_greedy_and_stops(monkeypatch):
    model = tiny(seed=2)
    enc = get_encoding()
    lm = ev.CheckpointLM(model=model, device="cpu", batch_size=4)
    prompts = ["ROMEO:\nBut soft", "The king is", "The queen was", "HAMLET:\n"]

    def greedy(prompt, n):
        x = torch.tensor([enc.encode_ordinary(prompt)])
        y = generate(model, x, n, top_k=1)[0, x.shape[1] :].tolist()
        return y, enc.decode([t for t in y if t < enc.n_vocab])

    reqs, expected = [], []
    for k, prompt in enumerate(prompts):
        ids, text = greedy(prompt, 12)
        if k % 2 == 0:  # stop at the text of a token from the middle of the greedy output
            stop = enc.decode(ids[5:6])
            assert stop and stop in text
            until, want = [stop, "@@never@@"], text.split(stop)[0]
            assert len(want) < len(text)
        else:  # a stop string that never comes: all max_gen_toks tokens
            until, want = ["@@never@@"], text
        reqs.append(Instance("generate_until", {}, (prompt, {"until": until, "max_gen_toks": 12}), k))
        expected.append(want)
    # the same prompt length twice: those two share a batch of generate
    assert len(enc.encode_ordinary(prompts[1])) == len(enc.encode_ordinary(prompts[2]))
    assert lm.generate_until(reqs, disable_tqdm=True) == expected
    # a batch ends once every row holds a stop string: far fewer than max_gen_toks tokens here
    lengths = []

    def counting_generate(*args, **kwargs):
        y = generate(*args, **kwargs)
        lengths.append(y.shape[1] - args[1].shape[1])
        return y

    monkeypatch.setattr(ev, "generate", counting_generate)
    ids, text = greedy(prompts[0], 12)
    stop = enc.decode(ids[2:3])
    req = Instance("generate_until", {}, (prompts[0], {"until": [stop], "max_gen_toks": 200}), 0)
    assert lm.generate_until([req], disable_tqdm=True) == [text.split(stop)[0]]
    first = next(t for t in range(1, 13) if stop in enc.decode(ids[:t]))  # <= 3: token 2 decodes to it
    assert lengths == [first]
    short = lm.generate_until(
        [Instance("generate_until", {}, (prompts[1], {"until": [], "max_gen_toks": 3}), 0)], disable_tqdm=True
    )
    assert short == [greedy(prompts[1], 3)[1]]
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"do_sample": True, "temperature": 1.0}), 0)])


def test_generate_until_cuts_at_eot(monkeypatch):
    """EOT's text is a stop string, as for lm-eval's own models; the first stop string that occurs wins."""
    enc = get_encoding()
    model = tiny(seed=4)
    made = enc.encode_ordinary(" Good night, sweet prince") + [EOT] + enc.encode_ordinary(" And flights")

    def fake_generate(
        model, idx, max_new_tokens, temperature=1.0, top_k=None, stop=None, attention_mask=None
    ):
        assert top_k == 1 and max_new_tokens == len(made)
        return torch.cat([idx, torch.tensor([made] * idx.shape[0])], dim=1)

    monkeypatch.setattr(ev, "generate", fake_generate)
    lm = ev.CheckpointLM(model=model, device="cpu")
    gen = {"until": [], "max_gen_toks": len(made)}
    out = lm.generate_until(
        [
            Instance("generate_until", {}, ("Hello.\n", gen), 0),
            Instance("generate_until", {}, ("Hello.\n", dict(gen, until=["And"])), 1),
            Instance("generate_until", {}, ("Hello.\n", dict(gen, until=[","])), 2),
        ],
        disable_tqdm=True,
    )
    assert out == [" Good night, sweet prince"] * 2 + [" Good night"]


def test_generate_until_keeps_the_last_block_size_tokens_of_a_long_prompt():
    """A prompt longer than block_size is cut to its last block_size tokens, those next to the
    continuation (as loglikelihood cuts a context): the output is greedy decoding by plain forward passes
    over the last block_size tokens of the growing sequence, not that of another cut of the prompt."""
    block = 8  # short, and sublayers that weigh the context: one token less often changes the first choice
    model = tiny(seed=6, block_size=block)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("blocks") and p.dim() == 2:
                p.mul_(3)
    lm = ev.CheckpointLM(model=model, device="cpu", batch_size=4)
    eos = lm.tok_decode([EOT])
    rng = random.Random(9)

    def greedy_from(ids, n=6):
        seq = list(ids)
        with torch.no_grad():
            for _ in range(n):
                logits, _ = model(torch.tensor([seq[-block:]]))
                seq.append(int(logits[0, -1].argmax()))
        return lm.tok_decode(seq[len(ids) :]).split(eos)[0]

    prompts, wanted, told_apart = [], [], set()
    for n_words in range(12, 36, 2):
        prompt = random_text(rng, n_words)
        ids = lm.tok_encode(prompt)
        assert len(ids) > block + 2
        prompts.append(prompt)
        wanted.append(greedy_from(ids[-block:]))
        for name, other in (("head", ids[:block]), ("one short", ids[1 - block :])):
            told_apart |= {name} if greedy_from(other) != wanted[-1] else set()
    assert told_apart == {"head", "one short"}  # the test tells those cuts from the right one
    gen = {"until": ["@@never@@"], "max_gen_toks": 6}
    reqs = [Instance("generate_until", {}, (p, gen), k) for k, p in enumerate(prompts)]
    assert lm.generate_until(reqs, disable_tqdm=True) == wanted


ROWS = [(r, a) for r in ("additive", "ddl", "ddl-tc", "ddl-cc") for a in ("softmax", "deltaformer")]


@pytest.mark.parametrize("residual,attention", ROWS)
def test_generate_until_batches_prompts_of_different_lengths(residual, attention, monkeypatch):
    """Prompts of different lengths share a batch, the shorter left-padded: each request's text is its
    unbatched one (batch_size 1) and greedy decoding of its prompt alone (float64, every parameter off its
    init). The longest prompt is cut to block_size, so the batch's window slides over the padding."""
    model = tiny(residual, attention, seed=3).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    enc = get_encoding()
    rng = random.Random(4)
    prompts = [random_text(rng, n) for n in (3, 40, 9, 1, 5, 14)]
    gen = {"until": ["@@never@@"], "max_gen_toks": 6}
    reqs = [Instance("generate_until", {}, (p, gen), k) for k, p in enumerate(prompts)]
    calls = []

    def spy(model, idx, *args, attention_mask=None, **kwargs):
        calls.append((tuple(idx.shape), None if attention_mask is None else attention_mask.sum(1).tolist()))
        return generate(model, idx, *args, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(ev, "generate", spy)
    batched = ev.CheckpointLM(model=model, device="cpu", batch_size=4).generate_until(reqs, disable_tqdm=True)
    lengths = sorted((min(len(enc.encode_ordinary(p)), BLOCK) for p in prompts), reverse=True)
    assert calls == [((4, BLOCK), lengths[:4]), ((2, lengths[4]), lengths[4:])]  # longest first, padded
    lm = ev.CheckpointLM(model=model, device="cpu", batch_size=1)
    one = lm.generate_until(reqs, disable_tqdm=True)
    assert all(mask is None for _, mask in calls[2:])  # one prompt a batch: no padding
    alone = []
    for p in prompts:
        x = torch.tensor([enc.encode_ordinary(p)[-BLOCK:]])
        text = lm.tok_decode(generate(model, x, 6, top_k=1)[0, x.shape[1] :].tolist())
        alone.append(text.split(lm.tok_decode([EOT]))[0])
    assert batched == one == alone


# ---- checkpoints ----
def write_checkpoint(out_dir, model):
    """ckpt.pt with the keys train.py's save_checkpoint writes."""
    cfg = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "model_args": dataclasses.asdict(cfg),
        "config": {"out_dir": str(out_dir), "learning_rate": 1e-3},
        "iter_num": 42,
        "best_val_loss": 3.5,
        "st_length": None,
        "rng": [{"torch": torch.get_rng_state(), "python": [1, 2, 3]}],
    }
    os.makedirs(out_dir, exist_ok=True)
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))


@pytest.mark.parametrize("residual,attention", [("additive", "softmax"), ("ddl-tc", "softmax")])
def test_checkpoint_loads_the_same_model(tmp_path, residual, attention):
    model = tiny(residual, attention, seed=6)
    write_checkpoint(tmp_path, model)
    lm = ev.CheckpointLM(out_dir=str(tmp_path), device="cpu")
    assert lm.model.config == model.config
    loaded = lm.model.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k
    assert lm.get_model_info()["iter_num"] == 42
    gen = torch.Generator().manual_seed(8)
    reqs = token_requests(gen)[:5]
    for (_, ctx, cont), (lp, _) in zip(reqs, lm._loglikelihood_tokens(reqs, disable_tqdm=True)):
        assert lp == pytest.approx(direct_loglikelihood(model, ctx, cont)[0], rel=1e-5, abs=1e-4)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ev.CheckpointError, match="no checkpoint at"):
        ev.load_checkpoint(str(tmp_path / "nowhere"))
    write_checkpoint(tmp_path, tiny())
    path = tmp_path / "ckpt.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut short, as by a crash mid-copy
    with pytest.raises(ev.CheckpointError, match="truncated or corrupt") as e:
        ev.load_checkpoint(str(tmp_path))
    assert "\n" not in str(e.value)
    path.write_bytes(b"")
    with pytest.raises(ev.CheckpointError, match="empty file"):
        ev.load_checkpoint(str(tmp_path))
    path.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(1000)))
    with pytest.raises(ev.CheckpointError, match=r"not a checkpoint \(1,000 bytes") as e:
        ev.load_checkpoint(str(tmp_path))
    assert "weights_only" not in str(e.value)
    torch.save({"weights": torch.zeros(2)}, str(path))
    with pytest.raises(ev.CheckpointError, match="no 'model', 'model_args'"):
        ev.load_checkpoint(str(tmp_path))
    model = tiny()
    state = model.state_dict()
    del state["lm_head.weight"], state["wte.weight"]
    torch.save({"model": state, "model_args": dataclasses.asdict(model.config)}, str(path))
    with pytest.raises(ev.CheckpointError, match="weights do not fit") as e:
        ev.load_checkpoint(str(tmp_path))
    assert "\n" not in str(e.value)


# ---- the local task ----
def cloze_items():
    with open(os.path.join(ev.LOCAL_TASKS, "shakespeare_cloze", "test.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_cloze_files_are_what_the_generator_writes(tmp_path):
    """The committed task is data/shakespeare_cloze.py's output (deterministic), and its items are sound."""
    from data import shakespeare_cloze

    shakespeare_cloze.main(["--out", str(tmp_path)])
    here = os.path.join(ev.LOCAL_TASKS, "shakespeare_cloze")
    for name in ("test.jsonl", "fewshot.jsonl", "shakespeare_cloze.yaml", "shakespeare_cloze_gen.yaml"):
        with (
            open(os.path.join(here, name), encoding="utf-8") as a,
            open(tmp_path / name, encoding="utf-8") as b,
        ):
            assert a.read() == b.read(), name
    items = cloze_items()
    assert len(items) == 4 * shakespeare_cloze.TEST_PER_PLAY
    assert sum(os.path.getsize(os.path.join(here, n)) for n in os.listdir(here)) < 300_000
    from data.shakespeare import VAL_PLAYS, load_plays

    scripts = {name: text for name, text in load_plays() if name in VAL_PLAYS}
    for item in items:
        script = scripts[item["play"]]
        target = item["choices"][item["label"]]
        line = script.split("\n")[item["line"]]
        assert line.endswith(target) and len(target.split()) == shakespeare_cloze.TAIL_WORDS
        assert item["context"].endswith(line[: -len(target)])  # the line's head ends the context
        assert item["context"] + target + "\n" in script  # a verbatim slice of the play
        assert len(set(item["choices"])) == 4 and len(line.split()) >= shakespeare_cloze.MIN_WORDS
        assert all(
            c.startswith(" ") and len(c.split()) == shakespeare_cloze.TAIL_WORDS for c in item["choices"]
        )
    assert {item["label"] for item in items} == {0, 1, 2, 3}


def test_local_task_end_to_end():
    lm = ev.CheckpointLM(model=tiny(block_size=64), device="cpu", batch_size=16)
    results = ev.evaluate(lm, ["shakespeare_cloze"], num_fewshot=1, limit=12, builtin=False)
    r = results["results"]["shakespeare_cloze"]
    assert 0 <= r["acc,none"] <= 1 and 0 <= r["acc_norm,none"] <= 1
    assert results["n-samples"]["shakespeare_cloze"] == {"original": 500, "effective": 12}
    assert results["n-shot"]["shakespeare_cloze"] == 1


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="unknown task.*no_such_task"):
        ev.task_manager(["shakespeare_cloze", "no_such_task"], ev.include_paths(), builtin=False)


def test_a_name_in_no_task_file_fails_before_lm_evals_index():
    said = []
    with pytest.raises(ValueError, match="unknown task.*no_such_task: named in none of lm-eval"):
        ev.task_manager(["shakespeare_cloze", "no_such_task"], ev.include_paths(), say=said.append)
    assert said == []  # lm-eval's built-in tasks were not indexed
    assert ev.named_in_task_files(["shakespeare_cloze", "no_such_task"], ev.include_paths()) == {
        "shakespeare_cloze"
    }


# ---- command line ----
def run_eval(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, os.path.join(REPO, "eval.py"), "--device=cpu", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)


def test_cli_local_task(tmp_path):
    write_checkpoint(tmp_path / "out", tiny(block_size=64))
    out = tmp_path / "results.json"
    r = run_eval(f"--out_dir={tmp_path / 'out'}", "--tasks=shakespeare_cloze", "--limit=8", f"--output={out}")
    assert r.returncode == 0, r.stderr
    assert "|shakespeare_cloze|" in r.stdout and "acc_norm" in r.stdout
    results = json.loads(out.read_text())
    assert 0 <= results["results"]["shakespeare_cloze"]["acc,none"] <= 1
    assert results["n-samples"]["shakespeare_cloze"]["effective"] == 8
    assert results["config"]["iter_num"] == 42 and results["config"]["model_args"]["block_size"] == 64
    assert not os.path.exists(str(out) + ".tmp")


def test_results_are_written_before_the_table(tmp_path, monkeypatch):
    """The JSON (with the timing) is on disk before lm-eval's table printer runs, so a failure there (a
    missing optional dependency of its table writer, say) loses no evaluation."""
    import lm_eval.utils

    write_checkpoint(tmp_path / "out", tiny(block_size=64))
    out = tmp_path / "results.json"

    def broken_table(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'pytz'")

    monkeypatch.setattr(lm_eval.utils, "make_table", broken_table)
    with pytest.raises(ModuleNotFoundError, match="pytz"):
        ev.main(
            [f"--out_dir={tmp_path / 'out'}", "--tasks=shakespeare_cloze", "--limit=4", f"--output={out}"]
        )
    results = json.loads(out.read_text())
    assert results["n-samples"]["shakespeare_cloze"]["effective"] == 4 and results["eval_seconds"] > 0


@pytest.mark.slow
def test_lm_eval_command_line(tmp_path):
    """`python eval.py lm_eval ...` is lm-eval's own command line with the model registered and data/tasks
    included."""
    write_checkpoint(tmp_path / "out", tiny(block_size=64))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, os.path.join(REPO, "eval.py"), "lm_eval", "--model", ev.MODEL_NAME]
    cmd += ["--model_args", f"out_dir={tmp_path / 'out'}", "--tasks", "shakespeare_cloze", "--device", "cpu"]
    cmd += ["--limit", "4", "--batch_size", "8", "--output_path", str(tmp_path / "lm")]
    r = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "|shakespeare_cloze|" in r.stdout
    (results_file,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "lm") for f in fs]
    with open(results_file, encoding="utf-8") as f:
        assert json.load(f)["n-samples"]["shakespeare_cloze"]["effective"] == 4


def test_cli_checks_the_task_names_first(tmp_path):
    r = run_eval(f"--out_dir={tmp_path}", "--tasks=shakespeare_cloze,no_such_task")  # and no checkpoint
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("eval.py: error: unknown task(s) no")


def test_cli_missing_checkpoint_one_line(tmp_path):
    r = run_eval(f"--out_dir={tmp_path}", "--tasks=shakespeare_cloze")
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("eval.py: error: no checkpoint at")


@pytest.mark.slow
def test_quickstart_model_beats_chance_on_cloze():
    """README quick start (python data/shakespeare.py; python train.py configs/shakespeare.py), then this
    test: the out-shakespeare checkpoint (or EVAL_OUT_DIR's) scores above chance (25%) on the cloze."""
    out_dir = os.environ.get("EVAL_OUT_DIR", os.path.join(REPO, "out-shakespeare"))
    if not os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
        pytest.skip(f"no checkpoint in {out_dir}: train the quick-start model first")
    lm = ev.CheckpointLM(out_dir=out_dir, batch_size=32)
    results = ev.evaluate(lm, ["shakespeare_cloze"], num_fewshot=1, builtin=False)
    r = results["results"]["shakespeare_cloze"]
    # 500 items, chance 0.25: more than two standard errors above it (measured: acc_norm 0.34 +- 0.02)
    assert r["acc_norm,none"] > 0.25 + 2 * r["acc_norm_stderr,none"], r


def test_lm_eval_command_line_unknown_model_arg_is_one_line(tmp_path):
    write_checkpoint(tmp_path / "out", tiny(block_size=64))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, os.path.join(REPO, "eval.py"), "lm_eval", "--model", ev.MODEL_NAME, "--model_args"]
    for model_args, message in [
        (f"out_dir={tmp_path / 'out'},residual=ddl-cc", "ddl-gpt: unknown model_args residual; it takes "),
        (f"out_dir={tmp_path / 'none'}", f"no checkpoint at {tmp_path / 'none'}"),
    ]:
        args = [model_args, "--tasks", "shakespeare_cloze", "--device", "cpu", "--limit", "1"]
        r = subprocess.run(cmd + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith(f"eval.py: error: {message}"), errors
    with pytest.raises(ev.ModelArgsError, match="takes out_dir, batch_size, device, dtype, max_gen_toks"):
        ev.CheckpointLM(model=tiny(), wrong=1)
