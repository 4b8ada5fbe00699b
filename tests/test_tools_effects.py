"""What each option of sample.py, eval.py, export_hf.py, plot_logs.py and the exported model changes, each
refusal refused (and its bound accepted), and every number these tools print recomputed a second way:
sample.py's tokens/s and eval.py's items/s on a fake clock, eval.py's accuracies from log-likelihoods of
plain forward passes, plot_logs.py's curves from the Line2D data of the figure it draws.

Direct calls of main(argv) on tiny checkpoints; sample.generate / lm_eval.simple_evaluate replaced by
recorders where only what reaches them is checked."""

import dataclasses
import json
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch

import sample as sample_py
from data.tokenizer import EOT, get_encoding
from model import GPT, GPTConfig

HAS_CUDA = torch.cuda.is_available()


def tiny(seed=0, vocab_size=50304, block_size=32, n_layer=1, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=n_layer, n_head=2, head_dim=16, n_embd=32, block_size=block_size, vocab_size=vocab_size, **kw
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # larger logits than the init's: clear greedy choices
        model.wte.weight.mul_(10)
    return model


def write_ckpt(out_dir, model, iter_num=5):
    os.makedirs(out_dir, exist_ok=True)
    ckpt = {"model": model.state_dict(), "model_args": dataclasses.asdict(model.config), "iter_num": iter_num}
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    return str(out_dir)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """A checkpoint of tiny(seed=0), GPT-2's padded vocabulary."""
    return write_ckpt(tmp_path_factory.mktemp("ckpt"), tiny())


def last_error(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------- sample.py

PROMPT = "  ROMEO:\n\n<|endoftext|>\tBut soft  \n"  # whitespace at both ends, and the EOT token inside


class Recorder:
    """sample.generate's stand-in: records its arguments (and the RNG state it starts from) and appends
    row k's tokens rows[k] to row k."""

    def __init__(self, rows=((),)):
        self.rows, self.calls = rows, []

    def __call__(self, model, idx, max_new_tokens, **kwargs):
        self.calls.append(
            dict(
                model=model,
                idx=idx.clone(),
                max_new_tokens=max_new_tokens,
                rng=torch.get_rng_state(),
                **kwargs,
            )
        )
        new = torch.tensor(
            [list(self.rows[k % len(self.rows)]) for k in range(idx.shape[0])], dtype=idx.dtype
        )
        return torch.cat([idx, new.reshape(idx.shape[0], -1)], dim=1)


@pytest.mark.parametrize("how", ["text", "file"])
def test_sample_flags_reach_generate_and_the_prompt_is_tokenized_as_given(
    out_dir, tmp_path, monkeypatch, capsys, how
):
    enc = get_encoding()
    rows = [enc.encode_ordinary(" one two") + [50300], enc.encode_ordinary(" three!") + [50300], [0, 1, 2]]
    record = Recorder(rows)  # 50300: a vocabulary padding row, which has no text
    monkeypatch.setattr(sample_py, "generate", record)
    if how == "file":
        (tmp_path / "p.txt").write_bytes(PROMPT.encode())
    start = PROMPT if how == "text" else f"FILE:{tmp_path / 'p.txt'}"
    sample_py.main(
        [
            f"--out_dir={out_dir}",
            f"--start={start}",
            "--num_samples=3",
            "--max_new_tokens=7",
            "--temperature=0.65",
            "--top_k=17",
            "--seed=4242",
            "--decode=static",
            "--device=cpu",
        ]
    )
    (call,) = record.calls
    # the prompt's ids: nothing stripped, "<|endoftext|>" the EOT id, not its text
    want = enc.encode_ordinary("  ROMEO:\n\n") + [EOT] + enc.encode_ordinary("\tBut soft  \n")
    assert call["idx"].tolist() == [want] * 3
    assert (call["max_new_tokens"], call["temperature"], call["top_k"], call["decode"]) == (
        7,
        0.65,
        17,
        "static",
    )
    torch.manual_seed(4242)
    assert torch.equal(call["rng"], torch.get_rng_state())  # --seed seeds the sampling
    ref = tiny()
    for name, p in ref.state_dict().items():  # the model of --out_dir
        assert torch.equal(call["model"].state_dict()[name], p), name
    assert call["idx"].device.type == "cpu" and next(call["model"].parameters()).device.type == "cpu"
    texts = [enc.decode(want + [t for t in row if t < enc.n_vocab]) for row in rows]
    assert capsys.readouterr().out == "\n---------------\n".join(texts) + "\n"
    sample_py.main([f"--out_dir={out_dir}", "--start=x", "--top_k=0", "--num_samples=1", "--device=cpu"])
    assert record.calls[-1]["top_k"] is None and record.calls[-1]["idx"].shape[0] == 1  # 0: no top-k filter


def test_sample_reports_generated_tokens_over_the_generation_time(out_dir, monkeypatch, capsys):
    """The tokens/s line: every row's new tokens (not the prompt's, not one row's) over the seconds the
    generation took, on a fake clock that moves only while generate runs."""
    clock = [1000.0]
    monkeypatch.setattr(sample_py.time, "perf_counter", lambda: clock[0])
    real, shapes = sample_py.generate, []

    def timed(model, idx, *args, **kwargs):
        out = real(model, idx, *args, **kwargs)
        clock[0] += 0.8
        shapes.append((idx.shape, out.shape))
        return out

    monkeypatch.setattr(sample_py, "generate", timed)
    sample_py.main(
        [
            f"--out_dir={out_dir}",
            "--start=ROMEO: What",
            "--num_samples=3",
            "--max_new_tokens=6",
            "--device=cpu",
        ]
    )
    ((prompt, made),) = shapes
    assert prompt[0] == made[0] == 3 and made[1] - prompt[1] == 6
    line = re.search(r"^# (\S+) tokens generated in (\S+) s: (\S+) tokens/s$", capsys.readouterr().err, re.M)
    assert (line[1], line[2], line[3]) == ("18", "0.80", "22.5")  # 3 rows x 6 tokens / 0.8 s


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num_samples=0"], "--num_samples must be >= 1, got 0"),
        (["--temperature=0"], "--temperature must be > 0, got 0.0"),
        (["--temperature=-0.5"], "--temperature must be > 0, got -0.5"),
        (["--top_k=-1"], "--top_k must be >= 0 (0 = no top-k filter), got -1"),
        (["--device=gpu"], "--device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        (["--device=cuda:x"], "--device must be 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
        pytest.param(
            ["--device=cuda:0"],
            "but CUDA is not available",
            marks=pytest.mark.skipif(HAS_CUDA, reason="CUDA is here"),
        ),
        (["--start="], "--start is empty after tokenization"),
        (["--decode=fast"], "--decode: invalid choice: 'fast'"),
        (["--max_new_tokens=-1"], f"--max_new_tokens must be in 0..{sample_py.MAX_NEW_TOKENS:,}, got -1"),
        (["--start=FILE:LATIN1"], ": not UTF-8 text (byte 3: invalid continuation byte)"),
    ],
)
def test_sample_refusals(out_dir, tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "latin1.txt").write_bytes("café!".encode("latin-1"))
    args = [a.replace("LATIN1", str(tmp_path / "latin1.txt")) for a in args]
    record = Recorder()
    monkeypatch.setattr(sample_py, "generate", record)
    with pytest.raises(SystemExit) as e:
        sample_py.main([f"--out_dir={out_dir}", "--device=cpu", *args])
    assert e.value.code == 2 and message in last_error(capsys) and not record.calls


def test_sample_bounds_are_accepted_and_the_vocab_bound_is_exact(out_dir, tmp_path, monkeypatch, capsys):
    """Each refusal's bound itself is accepted; a prompt id equal to vocab_size - 1 is accepted, vocab_size
    refused (GPT-2 ids 63 and 64 are the texts '`' and 'a')."""
    record = Recorder()
    monkeypatch.setattr(sample_py, "generate", record)
    for arg in ("--num_samples=1", "--top_k=0", "--temperature=1e-3", "--max_new_tokens=0"):
        sample_py.main([f"--out_dir={out_dir}", "--device=cpu", arg])
    assert len(record.calls) == 4 and record.calls[2]["temperature"] == 1e-3
    small = write_ckpt(tmp_path / "v64", tiny(vocab_size=64))
    sample_py.main([f"--out_dir={small}", "--device=cpu", "--start=`"])
    assert record.calls[-1]["idx"][0].tolist() == [63]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        sample_py.main([f"--out_dir={small}", "--device=cpu", "--start=`a"])
    assert "the prompt has token ids >= the model's vocab_size (64): [63, 64]" in last_error(capsys)
    assert len(record.calls) == 5


def test_generate_appends_exactly_max_new_tokens():
    model = tiny(vocab_size=64, block_size=8)
    idx = torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_py.generate(model, idx, 0), idx)
    for n in (1, 5, 9):  # 3 + 9 > block_size 8: past the window too
        out = sample_py.generate(model, idx, n, top_k=1)
        assert out.shape == (2, 3 + n) and torch.equal(out[:, :3], idx)


# ---------------------------------------------------------------------------------------------- eval.py


@pytest.fixture(scope="module")
def ev():
    pytest.importorskip("lm_eval")
    import eval as ev

    return ev


class FakeEvaluate:
    """lm_eval.simple_evaluate's stand-in: records its arguments, takes `seconds` on the fake clock."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds, self.kwargs = clock, seconds, None

    def __call__(self, **kwargs):
        self.kwargs = kwargs
        self.clock[0] += self.seconds
        n = {
            "shakespeare_cloze": {"original": 500, "effective": 8},
            "other": {"original": 10, "effective": 4},
        }
        return {"results": {"shakespeare_cloze": {"acc,none": 0.5}}, "n-samples": n}


def test_eval_flags_reach_the_model_and_lm_eval(ev, out_dir, tmp_path, monkeypatch, capsys):
    import lm_eval.utils

    clock = [50.0]
    monkeypatch.setattr(ev.time, "perf_counter", lambda: clock[0])
    fake = FakeEvaluate(clock, 2.5)
    monkeypatch.setattr(ev.lm_eval, "simple_evaluate", fake)
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda results, column="results": f"TABLE {column}")
    output = tmp_path / "res.json"
    ev.main(
        [
            f"--out_dir={out_dir}",
            "--tasks=shakespeare_cloze",
            "--num_fewshot=3",
            "--batch_size=5",
            "--device=cpu",
            "--dtype=bfloat16",
            "--limit=7",
            "--max_gen_toks=11",
            f"--output={output}",
            "--seed=99",
        ]
    )
    kw, lm = fake.kwargs, fake.kwargs["model"]
    assert isinstance(lm, ev.CheckpointLM)
    assert (lm.batch_size, lm.dtype, lm.max_gen_toks, lm._device.type) == (5, "bfloat16", 11, "cpu")
    assert torch.equal(lm.model.wte.weight, tiny().wte.weight)  # --out_dir's model
    assert kw["tasks"] == ["shakespeare_cloze"] and kw["num_fewshot"] == 3
    assert kw["limit"] == 7 and isinstance(kw["limit"], int)
    assert [
        kw[k] for k in ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    ] == [99] * 4
    written = json.loads(output.read_text())
    assert written["eval_seconds"] == 2.5 and written["n-samples"]["other"]["effective"] == 4
    out, err = capsys.readouterr()
    assert "12 items in 2.5 s: 4.8 items/s on cpu" in err  # (8 + 4) items / 2.5 s
    assert out == "TABLE results\n"
    args = ev.parse_args([f"--out_dir={tmp_path / 'o'}", "--limit=0.25"])
    assert args.output == os.path.join(str(tmp_path / "o"), "eval.json") and args.limit == 0.25
    assert ev.parse_args(["--limit=3.0"]).limit == 3 and ev.parse_args(["--tasks= a, b ,"]).tasks == [
        "a",
        "b",
    ]


def test_eval_include_path_adds_task_folders(ev, out_dir, tmp_path, monkeypatch, capsys):
    import lm_eval.utils

    folder = tmp_path / "more" / "my_cloze"
    shutil.copytree(os.path.join(ev.LOCAL_TASKS, "shakespeare_cloze"), folder)
    yaml = folder / "shakespeare_cloze.yaml"
    (folder / "my_cloze.yaml").write_text(
        yaml.read_text().replace("task: shakespeare_cloze", "task: my_cloze")
    )
    yaml.unlink()
    fake = FakeEvaluate([0.0], 1.0)
    monkeypatch.setattr(ev.lm_eval, "simple_evaluate", fake)
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda *a, **k: "")
    args = [f"--out_dir={out_dir}", "--tasks=my_cloze", "--device=cpu", f"--output={tmp_path / 'r.json'}"]
    with pytest.raises(SystemExit) as e:
        ev.main(args)
    assert str(e.value).startswith("eval.py: error: unknown task(s) my_cloze") and fake.kwargs is None
    ev.main([*args, f"--include_path={tmp_path / 'nowhere'},{tmp_path / 'more'}"])
    assert fake.kwargs["tasks"] == ["my_cloze"] and fake.kwargs["task_manager"].match_tasks(["my_cloze"])
    with pytest.raises(
        ValueError, match=re.escape("unknown task(s) my_cloze: not among the task folders (1)")
    ):
        ev.task_manager(["my_cloze"], ev.include_paths(), builtin=False)  # named in a file, not a task here


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks=, ,"], "--tasks is empty"),
        (["--num_fewshot=-1"], "--num_fewshot must be >= 0, got -1"),
        (["--batch_size=0"], "--batch_size must be >= 1, got 0"),
        (["--limit=0"], "--limit must be > 0, got 0.0"),
        (["--limit=-2"], "--limit must be > 0, got -2.0"),
        (["--dtype=float16"], "--dtype: invalid choice: 'float16'"),
        pytest.param(
            ["--device=cuda"],
            "--device=cuda but CUDA is not available",
            marks=pytest.mark.skipif(HAS_CUDA, reason="CUDA is here"),
        ),
    ],
)
def test_eval_refusals(ev, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        ev.parse_args(args)
    assert e.value.code == 2 and message in last_error(capsys)


def test_eval_bounds_are_accepted(ev):
    args = ev.parse_args(["--num_fewshot=0", "--batch_size=1", "--limit=1e-6", "--dtype=bfloat16"])
    assert (args.num_fewshot, args.batch_size, args.limit, args.dtype) == (0, 1, 1e-6, "bfloat16")


def test_checkpoint_lm_options_and_refusals(ev, out_dir):
    model = tiny()
    with pytest.raises(ValueError, match="needs exactly one of out_dir"):
        ev.CheckpointLM()
    with pytest.raises(ValueError, match="needs exactly one of out_dir"):
        ev.CheckpointLM(out_dir=out_dir, model=model)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        ev.CheckpointLM(model=model, batch_size=0)
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'bfloat16'"):
        ev.CheckpointLM(model=model, dtype="float16")
    assert ev.CheckpointLM(model=model, batch_size=1).batch_size == 1
    assert ev.CheckpointLM(model=model, batch_size="auto:4", max_batch_size=64).batch_size == 32  # no search
    lm = ev.CheckpointLM(model=model, device="cpu", batch_size=3)
    with pytest.raises(ValueError, match="a continuation of 33 tokens exceeds block_size 32"):
        lm._loglikelihood_tokens([(None, [1], list(range(33)))], disable_tqdm=True)
    with pytest.raises(ValueError, match="needs a context of at least one token"):
        lm._loglikelihood_tokens([(None, [], [5])], disable_tqdm=True)
    # batch_size: rows per forward pass; an empty continuation is log p = 0, greedy
    sizes = []
    hidden = lm.model.hidden_states
    lm.model.hidden_states = lambda x, *a: sizes.append(x.shape[0]) or hidden(x, *a)
    try:
        reqs = [(None, [7] * (k + 1), [3, 4]) for k in range(7)] + [(None, [1], [])]
        got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    finally:
        del lm.model.hidden_states
    assert sizes == [3, 3, 1] and got[-1] == (0.0, True)
    from lm_eval.api.instance import Instance

    sampled = Instance("generate_until", {}, ("x", {"do_sample": True, "until": ["@@"]}), 0)
    with pytest.raises(ValueError, match=r"ddl-gpt decodes greedily only; got do_sample=True \({'do_sample'"):
        lm.generate_until([sampled], disable_tqdm=True)


def test_checkpoint_lm_bfloat16_autocasts(ev):
    model = tiny(seed=3)
    reqs = [(None, list(range(100, 120)), [5, 6, 7])]
    ((lp32, _),) = ev.CheckpointLM(model=model, device="cpu")._loglikelihood_tokens(reqs, disable_tqdm=True)
    lm16 = ev.CheckpointLM(model=model, device="cpu", dtype="bfloat16")
    ((lp16, _),) = lm16._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert lp16 != lp32 and abs(lp16 - lp32) < 0.05 * abs(lp32)  # bf16 rounding, same model
    with lm16._autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


def test_max_gen_toks_is_the_default_length_of_a_generation(ev, monkeypatch):
    from lm_eval.api.instance import Instance

    asked = []

    def fake_generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, stop=None):
        asked.append((max_new_tokens, idx.shape[0]))
        return torch.cat([idx, torch.zeros(idx.shape[0], max_new_tokens, dtype=idx.dtype)], 1)

    monkeypatch.setattr(ev, "generate", fake_generate)
    lm = ev.CheckpointLM(model=tiny(), device="cpu", max_gen_toks=7, batch_size=2)
    reqs = [Instance("generate_until", {}, ("The king", {"until": ["@@"], "max_gen_toks": 3}), 0)]
    reqs += [
        Instance("generate_until", {}, (p, {"until": ["@@"]}), k) for k, p in enumerate(["The queen"] * 5)
    ]
    lm.generate_until(reqs, disable_tqdm=True)
    assert sorted(asked) == [(3, 1), (7, 1), (7, 2), (7, 2)]  # batch_size: rows of one generate call


def test_generate_until_a_row_that_stops_does_not_end_the_others(ev):
    """A batch generates until every row holds a stop string: a row that meets one early keeps its cut
    text, the other rows run to max_gen_toks."""
    from lm_eval.api.instance import Instance

    model = tiny(seed=2)
    enc = get_encoding()
    lm = ev.CheckpointLM(model=model, device="cpu", batch_size=4)
    a, b = "The king is", "The queen was"
    assert len(enc.encode_ordinary(a)) == len(enc.encode_ordinary(b))  # one batch

    def greedy(prompt, n=12):
        x = torch.tensor([enc.encode_ordinary(prompt)])
        ids = sample_py.generate(model, x, n, top_k=1)[0, x.shape[1] :].tolist()
        return ids, lm.tok_decode(ids)

    (ids_a, text_a), (_, text_b) = greedy(a), greedy(b)
    stop = next(
        s for s in (lm.tok_decode(ids_a[t : t + 1]) for t in range(1, 4)) if s.strip() and s not in text_b
    )
    assert text_a.split(stop)[0] != text_a
    gen = {"until": [stop], "max_gen_toks": 12}
    got = lm.generate_until(
        [Instance("generate_until", {}, (p, gen), k) for k, p in enumerate((a, b))], disable_tqdm=True
    )
    assert got == [text_a.split(stop)[0], text_b]


def test_eval_accuracy_is_the_argmax_of_direct_loglikelihoods(ev):
    """acc and acc_norm of the cloze task (0-shot, 16 items) from log-likelihoods of plain forward passes,
    one sequence each: the argmax over the choices of the summed log p (acc), of it per character
    (acc_norm), and their standard errors (the sample standard deviation over sqrt(n)). No two choices are
    near a tie, so float32 rounding decides no argmax."""
    model = tiny(seed=1, block_size=128, n_layer=2)
    enc = get_encoding()
    n = 16
    results = ev.evaluate(
        ev.CheckpointLM(model=model, device="cpu", batch_size=16),
        ["shakespeare_cloze"],
        num_fewshot=0,
        limit=n,
        builtin=False,
    )["results"]["shakespeare_cloze"]
    with open(os.path.join(ev.LOCAL_TASKS, "shakespeare_cloze", "test.jsonl"), encoding="utf-8") as f:
        items = [json.loads(line) for line in f][:n]
    hits, hits_norm = [], []
    for item in items:
        ctx = item["context"]
        lls = []
        for choice in item["choices"]:
            # lm-eval's split: the context's trailing whitespace goes to the continuation
            head = ctx.rstrip()
            ctx_ids = enc.encode_ordinary(head)
            cont_ids = enc.encode_ordinary(ctx + choice)[len(ctx_ids) :]
            ids = torch.tensor((ctx_ids + cont_ids)[-129:])  # (no cut: every item fits in block_size 128)
            with torch.no_grad():  # one sequence a forward pass, the LM head on the rows that predict cont
                h = model.hidden_states(ids[None, :-1])[0, -len(cont_ids) :]
                logp = torch.log_softmax(model.lm_head(h).double(), -1)
            lls.append(float(logp.gather(-1, ids[-len(cont_ids) :, None]).sum()))
        lengths = [len(c) for c in item["choices"]]
        for scores in (lls, [ll / k for ll, k in zip(lls, lengths)]):
            top = sorted(scores)
            assert top[-1] - top[-2] > 1e-3, scores
        hits.append(float(np.argmax(lls) == item["label"]))
        hits_norm.append(float(np.argmax([ll / k for ll, k in zip(lls, lengths)]) == item["label"]))
    for key, h in (("acc", hits), ("acc_norm", hits_norm)):
        mean = sum(h) / n
        stderr = math.sqrt(sum((x - mean) ** 2 for x in h) / (n - 1) / n)
        assert results[f"{key},none"] == pytest.approx(mean, abs=1e-12), key
        assert results[f"{key}_stderr,none"] == pytest.approx(stderr, abs=1e-12), key
    assert 0 < sum(hits) < n and hits != hits_norm  # a case that tells acc from acc_norm and from 0 or 1


# ------------------------------------------------------------------------------------------- export_hf.py


def test_export_flags(out_dir, tmp_path, capsys):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    import export_hf

    run = tmp_path / "run"
    shutil.copytree(out_dir, run)
    export_hf.main([f"--out_dir={run}"])  # --to defaults to OUT_DIR/hf
    assert capsys.readouterr().err.strip() == f"{run / 'ckpt.pt'} -> {run / 'hf'}"
    tensors, ref = load_file(run / "hf" / "model.safetensors"), tiny().state_dict()
    assert sorted(tensors) == sorted(f"gpt.{k}" for k in ref if k != "lm_head.weight")
    assert all(torch.equal(tensors[f"gpt.{k}"], ref[k]) for k in ref if k != "lm_head.weight")
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["gpt"] == dict(dataclasses.asdict(tiny().config), backend="auto", dropout=0.0)
    write_ckpt(run, tiny(seed=9))
    export_hf.main([f"--out_dir={run}", f"--to={tmp_path / 'elsewhere'}"])  # --to
    assert torch.equal(
        load_file(tmp_path / "elsewhere" / "model.safetensors")["gpt.wte.weight"], tiny(seed=9).wte.weight
    )
    with pytest.raises(SystemExit):  # the folder exists: kept without --overwrite
        export_hf.main([f"--out_dir={run}"])
    assert "exists; pass --overwrite" in last_error(capsys)
    assert torch.equal(load_file(run / "hf" / "model.safetensors")["gpt.wte.weight"], ref["wte.weight"])
    export_hf.main([f"--out_dir={run}", "--overwrite"])
    assert torch.equal(load_file(run / "hf" / "model.safetensors")["gpt.wte.weight"], tiny(seed=9).wte.weight)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):  # --overwrite replaces a folder, never a file
        export_hf.main([f"--out_dir={run}", f"--to={tmp_path / 'file'}", "--overwrite"])
    assert "exists and is not a folder" in last_error(capsys) and (tmp_path / "file").read_text() == "x"


def test_export_refuses_code_the_loader_cannot_follow(monkeypatch):
    """The folder's code is the repo's with its imports made flat; import forms that cannot be, and a line
    transformers' loader would follow to a file the folder lacks, are refused."""
    import export_hf

    path = os.path.join(export_hf.REPO, "hf_model.py")
    with pytest.raises(
        export_hf.ExportError, match="hf_model.py:2: `import` of a repo module; export_hf.py needs"
    ):
        export_hf.flatten("hf_model", "import torch\nimport model\n", path)
    with pytest.raises(export_hf.ExportError, match="hf_model.py:1: import submodules one line at a time"):
        export_hf.flatten("hf_model", "from ops.ddl import naive, DDL_V_SCALE\n", path)
    assert export_hf.flatten("hf_model", "from ops.ddl import naive as n\n", path) == (
        "from . import ops_ddl_naive as n\n",
        ["ops.ddl.naive"],
    )
    flatten = export_hf.flatten

    def one_more_import(module, text, path):
        text, needed = flatten(module, text, path)
        return text + "from .nowhere import x\n", needed

    monkeypatch.setattr(export_hf, "flatten", one_more_import)
    with pytest.raises(export_hf.ExportError, match="transformers' loader would look for nowhere.py"):
        export_hf.code_files()


# ----------------------------------------------------------------------------------- the exported model


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    import hf_model

    gpt = tiny(seed=4, vocab_size=96, block_size=16, n_layer=2, residual="ddl-tc", attention="deltaformer")
    model = hf_model.DDLGPTForCausalLM(hf_model.DDLGPTConfig(gpt=dataclasses.asdict(gpt.config))).eval()
    model.gpt.load_state_dict(gpt.state_dict())
    return hf_model, model, gpt


def test_hf_config_holds_gptconfigs_fields_and_refuses_bad_ones(hf):
    hf_model, model, gpt = hf
    cfg = model.config
    assert cfg.gpt_config() == gpt.config
    assert (
        cfg.vocab_size,
        cfg.max_position_embeddings,
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
    ) == (96, 16, 32, 2, 2)
    assert hf_model.DDLGPTConfig(gpt=dataclasses.asdict(gpt.config), vocab_size=7).vocab_size == 7
    with pytest.raises(ValueError, match="residual"):
        hf_model.DDLGPTConfig(gpt=dict(dataclasses.asdict(gpt.config), residual="ddl-zz"))


def test_hf_forward_arguments(hf):
    hf_model, model, gpt = hf
    idx = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = gpt(idx, targets=idx)[0]
        out = model(idx)
        assert torch.equal(out.logits, ref) and out.loss is None and getattr(out, hf_model.CACHE) is None
        assert torch.equal(model(input_ids=idx, attention_mask=torch.ones_like(idx)).logits, ref)
        mask = torch.ones_like(idx)
        mask[1, 0] = 0  # a left-padded row: no padding mask to honour it
        with pytest.raises(ValueError, match="attention_mask must be all ones"):
            model(idx, attention_mask=mask)
        # labels: HF's convention, position t predicts labels[t + 1]; -100 is left out of the mean
        labels = idx.clone()
        labels[0, 3], labels[1, 7] = -100, -100
        loss = model(idx, labels=labels).loss
        logp = torch.log_softmax(ref.double(), -1)
        terms = [
            -logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(9) if labels[b, t + 1] != -100
        ]
        assert len(terms) == 16 and abs(loss.item() - float(sum(terms) / len(terms))) < 1e-5
        assert model(idx, labels=labels, return_dict=False)[0] == loss  # the tuple order: loss first
        # use_cache: a cache.Cache holding the sequence, which the next call continues (either name)
        for name in ("cache", "past_key_values"):
            cache = getattr(model(idx[:, :6], use_cache=True), hf_model.CACHE)
            assert cache.pos == 6
            step = model(idx[:, 6:8], **{name: cache}).logits
            assert (step - ref[:, 6:8]).abs().max() < 1e-5 and cache.pos == 8
        assert getattr(model(idx, use_cache=False), hf_model.CACHE) is None


def test_hf_prepare_inputs_for_generation(hf):
    hf_model, model, _ = hf
    idx = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 5, dtype=torch.long)
    first = model.prepare_inputs_for_generation(idx[:, :5], attention_mask=mask)
    assert torch.equal(first["input_ids"], idx[:, :5]) and first[hf_model.CACHE].pos == 0
    assert first["attention_mask"] is mask
    with torch.no_grad():
        model(**first)
    nxt = model.prepare_inputs_for_generation(idx[:, :6], **{hf_model.CACHE: first[hf_model.CACHE]})
    assert torch.equal(nxt["input_ids"], idx[:, 5:6]) and nxt[hf_model.CACHE] is first[hf_model.CACHE]
    window = model.prepare_inputs_for_generation(idx[:, :17], **{hf_model.CACHE: first[hf_model.CACHE]})
    assert torch.equal(window["input_ids"], idx[:, 1:17]) and window[hf_model.CACHE] is None  # block_size 16


def test_hf_generate_is_sample_generate(hf):
    """generate(): max_new_tokens new tokens; do_sample=False is sample.generate's greedy decoding,
    do_sample=True (temperature, top_k) its sampling from the same seed, past block_size too; beam search
    is refused."""
    _, model, gpt = hf
    prompt = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        greedy = model.generate(prompt, max_new_tokens=14, do_sample=False)
        assert greedy.shape == (2, 19) and torch.equal(greedy, sample_py.generate(gpt, prompt, 14, top_k=1))
        for temperature, top_k in ((1.0, 0), (0.7, 5)):
            torch.manual_seed(8)
            got = model.generate(
                prompt, max_new_tokens=14, do_sample=True, temperature=temperature, top_k=top_k
            )
            torch.manual_seed(8)
            want = sample_py.generate(gpt, prompt, 14, temperature=temperature, top_k=top_k or None)
            assert torch.equal(got, want), (temperature, top_k)
            assert not torch.equal(got, greedy)
        with pytest.raises(NotImplementedError, match="cache does not support beam search"):
            model.generate(prompt, max_new_tokens=3, num_beams=2)


# ------------------------------------------------------------------------------------------- plot_logs.py


def write_log(path, train, val):
    """A log.jsonl as train.py writes it: an eval record, then the iteration's record, per iteration."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    val = dict(val)
    with open(path, "w") as f:
        for it, loss in train:
            if it in val:
                f.write(json.dumps({"iter": it, "val_loss": val.pop(it), "val_acc": 0.5}) + "\n")
            f.write(json.dumps({"iter": it, "train_loss": loss, "lr": 1e-3, "tok_per_s": 5.0}) + "\n")
        for it, loss in val.items():
            f.write(json.dumps({"iter": it, "val_loss": loss}) + "\n")


def ema(values, alpha):
    """Bias-corrected EMA written out: sum_j (1 - a) a^(i - j) v_j / (1 - a^(i + 1))."""
    return [
        sum((1 - alpha) * alpha ** (i - j) * values[j] for j in range(i + 1)) / (1 - alpha ** (i + 1))
        for i in range(len(values))
    ]


@pytest.fixture
def runs(tmp_path):
    rng = np.random.default_rng(0)
    out = {}
    for k, name in enumerate(("out-base", "out-ddl-cc", "out-ddl-tc")):
        its = list(range(0, 40 + 7 * k, 1 + k))
        train = [(it, float(v)) for it, v in zip(its, 5 - 0.03 * np.arange(len(its)) + rng.random(len(its)))]
        val = [(it, float(4 + rng.random())) for it in its[::5]] + [(its[-1] + 1, 3.5)]
        write_log(str(tmp_path / name / "log.jsonl"), train, val)
        out[name] = (str(tmp_path / name / "log.jsonl"), train, val)
    return out


def plotted(monkeypatch, argv):
    """plot_logs.main(argv) and the matplotlib Figure it drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import plot_logs

    figures, subplots = [], plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: figures.append(subplots(*a, **k)) or figures[-1])
    plot_logs.main(argv)
    ((fig, ax),) = figures
    return fig, ax


@pytest.mark.parametrize("smooth", [0.0, 0.6])
def test_plot_curves_are_the_logs_values_and_labels_name_each_run(runs, tmp_path, monkeypatch, smooth):
    png = tmp_path / "loss.png"
    _, ax = plotted(monkeypatch, [p for p, _, _ in runs.values()] + ["-o", str(png), f"--smooth={smooth}"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not os.path.exists(str(png) + ".tmp.png")
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == [f"{n} {s}" for n in runs for s in ("train", "val")]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [line.get_label() for line in lines]
    colors = []
    for (_, train, val), (tl, vl) in zip(runs.values(), zip(lines[::2], lines[1::2])):
        its, losses = zip(*train)
        assert list(tl.get_xdata()) == list(its)
        np.testing.assert_allclose(
            tl.get_ydata(), ema(list(losses), smooth) if smooth else losses, rtol=1e-12
        )
        assert list(vl.get_xdata()) == [it for it, _ in val] and list(vl.get_ydata()) == [v for _, v in val]
        assert tl.get_color() == vl.get_color()
        colors.append(tl.get_color())
    assert len(set(colors)) == len(runs)  # a colour a run
    assert ax.get_ylim()[1] > 5  # no --ymax: the data's range


def test_plot_labels_and_ymax(runs, tmp_path, monkeypatch):
    paths = [p for p, _, _ in runs.values()]
    _, ax = plotted(
        monkeypatch, [*paths, "-o", str(tmp_path / "a.png"), "--labels", "A", "B", "C", "--ymax=4.25"]
    )
    assert [line.get_label() for line in ax.get_lines()] == [
        "A train",
        "A val",
        "B train",
        "B val",
        "C train",
        "C val",
    ]
    assert ax.get_ylim()[1] == 4.25


def test_plot_a_cut_short_last_line_is_skipped(runs, tmp_path, monkeypatch, capsys):
    path, train, val = runs["out-base"]
    with open(path, "a") as f:
        f.write('{"iter": 99, "train_lo')  # being written
    _, ax = plotted(monkeypatch, [path, "-o", str(tmp_path / "a.png")])
    assert list(ax.get_lines()[0].get_xdata()) == [it for it, _ in train]
    assert f"{path}:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case, message",
    [
        ("labels", "--labels has 1 entries for 2 logs"),
        ("smooth=1", "--smooth must be in [0, 1), got 1.0"),
        ("smooth=-0.1", "--smooth must be in [0, 1), got -0.1"),
        ("missing", "no such log file: "),
        ("folder", "/no/x.png: folder "),
        ("bad line", "log.jsonl:2: not a train.py log record"),
        ("directory", "cannot write it"),
    ],
)
def test_plot_refusals(runs, tmp_path, capsys, case, message):
    import plot_logs

    a, b = runs["out-base"][0], runs["out-ddl-cc"][0]
    png = str(tmp_path / "x.png")
    argv = {
        "labels": [a, b, "-o", png, "--labels", "A"],
        "smooth=1": [a, "-o", png, "--smooth=1"],
        "smooth=-0.1": [a, "-o", png, "--smooth=-0.1"],
        "missing": [a, str(tmp_path / "none" / "log.jsonl"), "-o", png],
        "folder": [a, "-o", str(tmp_path / "no" / "x.png")],
        "bad line": [a, "-o", png],
        "directory": [a, "-o", str(tmp_path)],
    }[case]
    if case == "bad line":
        lines = open(a).read().splitlines(keepends=True)
        with open(a, "w") as f:
            f.writelines(lines[:1] + ["{oops\n"] + lines[1:])
    with pytest.raises(SystemExit) as e:
        plot_logs.main(argv)
    err = last_error(capsys)
    assert e.value.code == 2 and message in err and not os.path.exists(png)
    if case == "folder":
        assert err.endswith(f"folder {tmp_path / 'no'} does not exist")
    if case.startswith("smooth"):
        plot_logs.main([a, "-o", png, "--smooth=0.99"])  # the bound's inside
        assert os.path.exists(png)
