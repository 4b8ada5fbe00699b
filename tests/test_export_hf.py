"""export_hf.py: the exported folder, loaded by transformers in a process without the repo on its path (as a
user loads it), gives model.py's logits and sample.generate's greedy tokens for every variant, decodes through
the cache, tokenizes as data/tokenizer.py does, runs in the stock `lm_eval --model hf` with eval.py's
loglikelihoods; bad input is refused in one line, and the folder is written atomically."""

import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from readme_code import pasted, readme_blocks  # noqa: E402

import export_hf  # noqa: E402
from data.tokenizer import get_encoding  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from sample import generate  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK, PROMPT, NEW = 16, 6, 14  # greedy generation runs past block_size: the window slides
DDL_ROWS = [
    dict(residual=r, ddl_ec=ec, ddl_v=v)
    for r in ("ddl-cc", "ddl-tc")
    for ec in (True, False)
    for v in ("sigmoid", "linear")
]
RESIDUALS = [dict(residual="additive"), dict(residual="ddl"), dict(residual="ddl", ddl_v="linear"), *DDL_ROWS]
KAPPA_W = [(k, w) for k in ("softmax", "relu", "linear") for w in ("k", "q", "proj")]
# every residual with softmax attention and with Deltaformer, whose kappa x w go round all nine
VARIANTS = [{**r, "attention": "softmax"} for r in RESIDUALS] + [
    {**r, "attention": "deltaformer", "deltaformer_kernel": k, "deltaformer_w": w}
    for r, (k, w) in zip(RESIDUALS, KAPPA_W + KAPPA_W)
]
# the left-padded batches: one variant of each residual x attention row
PADDED = [
    next(v for v in VARIANTS if v["residual"] == r and v["attention"] == a)
    for r in ("additive", "ddl", "ddl-cc", "ddl-tc")
    for a in ("softmax", "deltaformer")
]
ROW_LENGTHS, PROMPT_LENGTHS = (BLOCK, 9, 12), (PROMPT, 2, 4)
TEXTS = [
    "Hello world<|endoftext|>ROMEO:\n  But soft, what light through yonder window breaks?\n\n\n",
    "<|endoftext|><|endoftext|>x  y\t\tz 1234567 don't I'll ‘quotes’ café 日本語 🤖  \n",
]

# The HF side runs here, in a fresh interpreter outside the repo (-P, another cwd): the folder must load on
# its own, with none of the repo's modules on the path.
CHILD = r"""
import sys
import torch
if sys.argv[3] == "no-triton":
    sys.modules["triton"] = None  # as on a machine without Triton: the import fails
from transformers import AutoModelForCausalLM, AutoTokenizer
jobs, out = torch.load(sys.argv[1]), {}
for name, job in jobs.items():
    if "texts" in job:
        tok = AutoTokenizer.from_pretrained(job["folder"])
        ids = [tok(t)["input_ids"] for t in job["texts"]]
        out[name] = ids, [tok.decode(i) for i in ids]
        continue
    model = AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=True).eval()
    flat = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".ops_common"]
    calls = []
    if sys.argv[3] == "triton":  # the repo's Triton kernels (interpreted on the CPU) for every op
        flat.set_auto_backend("triton")
        df = sys.modules[flat.__name__.replace("ops_common", "ops_deltaformer")]
        u = df.deltaformer_u_triton
        df.deltaformer_u_triton = lambda *a, **k: calls.append(1) or u(*a, **k)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    with torch.no_grad():
        logits = model(input_ids=job["tokens"]).logits
        new = job["new"]
        ids = model.generate(job["prompt"], max_new_tokens=new, do_sample=False) if new else None
    out[name] = dict(logits=logits, ids=ids, seen=seen[1:], triton_calls=len(calls))
    if "padded" in job and new:  # left-padded batches: a forward, and greedy generate() from the prompts
        pad = job["padded"]
        with torch.no_grad():
            logits = model(input_ids=pad["tokens"], attention_mask=pad["tokens_mask"]).logits
            ids = model.generate(pad["prompt"], attention_mask=pad["prompt_mask"], max_new_tokens=new,
                                 do_sample=False)
        out[name]["padded"] = dict(logits=logits, ids=ids)
torch.save(out, sys.argv[2])
"""


def child_env(tmp):
    """The environment of a process outside the repo: offline, its own module cache, no repo on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != REPO]
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_MODULES_CACHE=str(tmp / "modules"),
        OMP_NUM_THREADS="1",
        PYTHONIOENCODING="utf-8",
    )
    return env


def run_child(tmp, jobs, mode="no-triton"):
    torch.save(jobs, tmp / "jobs.pt")
    env = child_env(tmp)
    if mode == "triton":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-P", "-c", CHILD, str(tmp / "jobs.pt"), str(tmp / "out.pt"), mode]
    r = subprocess.run(
        cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=False)


def name(v):
    return "-".join(f"{k}={x}" for k, x in v.items())


def tiny(seed=0, vocab_size=512, block_size=BLOCK, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(
        n_layer=2, n_embd=64, head_dim=32, n_head=2, block_size=block_size, vocab_size=vocab_size, **kw
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # larger logits than the init's: clear greedy choices
        model.wte.weight.mul_(10)
    return model


def write_checkpoint(out_dir, model):
    os.makedirs(out_dir, exist_ok=True)
    ckpt = {"model": model.state_dict(), "model_args": dataclasses.asdict(model.config), "iter_num": 3}
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every variant exported, its reference (model.py's logits, sample.generate's greedy tokens) and what
    the folder gives in transformers (one process without Triton for all)."""
    tmp = tmp_path_factory.mktemp("hf")
    gen = torch.Generator().manual_seed(0)
    refs, jobs = {}, {}
    for k, v in enumerate(VARIANTS):
        model = tiny(seed=k, **v)
        with torch.no_grad():  # the norms off their init (ones): RoPE before q_norm, k_norm is not relative
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(0.5 * torch.randn(p.shape, generator=gen))
        write_checkpoint(tmp / f"ckpt{k}", model)
        folder = export_hf.export(str(tmp / f"ckpt{k}"), str(tmp / f"hf{k}"))
        tokens = torch.randint(0, 512, (2, BLOCK), generator=gen)
        prompt = tokens[:, :PROMPT]
        with torch.no_grad():
            logits = model(tokens, targets=tokens)[0]  # targets: the logits at every position
        refs[name(v)] = dict(logits=logits, ids=generate(model, prompt, NEW, top_k=1))
        jobs[name(v)] = dict(folder=folder, tokens=tokens, prompt=prompt, new=NEW)
        if v in PADDED:
            jobs[name(v)]["padded"], refs[name(v)]["padded"] = padded_job(model, gen)
    jobs["tokenizer"] = dict(folder=jobs[name(VARIANTS[0])]["folder"], texts=TEXTS)
    return tmp, jobs, refs, run_child(tmp, jobs)


def left_padded(rows, gen):
    """The rows (1-D) left-padded with random tokens to the longest's length, and their attention_mask."""
    T = max(map(len, rows))
    idx, mask = (
        torch.randint(0, 512, (len(rows), T), generator=gen),
        torch.zeros(len(rows), T, dtype=torch.long),
    )
    for b, row in enumerate(rows):
        idx[b, T - len(row) :], mask[b, T - len(row) :] = row, 1
    return idx, mask


def padded_job(model, gen):
    """(a job of left-padded batches, the reference: each row alone in model.py and sample.generate)."""
    rows = [torch.randint(0, 512, (n,), generator=gen) for n in ROW_LENGTHS]
    prompts = [torch.randint(0, 512, (n,), generator=gen) for n in PROMPT_LENGTHS]
    (tokens, tokens_mask), (prompt, prompt_mask) = left_padded(rows, gen), left_padded(prompts, gen)
    with torch.no_grad():
        logits = [model(r[None], targets=r[None])[0][0] for r in rows]
    ids = [generate(model, p[None], NEW, top_k=1)[0, len(p) :] for p in prompts]
    job = dict(tokens=tokens, tokens_mask=tokens_mask, prompt=prompt, prompt_mask=prompt_mask)
    return job, dict(logits=logits, ids=ids)


@pytest.mark.parametrize("variant", VARIANTS, ids=name)
def test_logits_and_greedy_generate_equal_the_repo(exported, variant):
    _, _, refs, got = exported
    equal_the_repo(got[name(variant)], refs[name(variant)])


def equal_the_repo(hf, ref):
    """The folder's logits and greedy tokens (hf, from the child) are model.py's and sample.generate's."""
    assert hf["logits"].dtype == torch.float32
    assert (hf["logits"] - ref["logits"]).abs().max().item() <= 1e-5
    assert torch.equal(hf["ids"], ref["ids"])
    # the cache: the prompt once, then one token a step; past block_size the last block_size tokens
    assert hf["seen"] == [PROMPT] + [1] * (BLOCK - PROMPT) + [BLOCK] * (NEW - 1 - (BLOCK - PROMPT))


@pytest.mark.parametrize("variant", PADDED, ids=name)
def test_left_padded_rows_equal_each_alone(exported, variant):
    """A left-padded batch (attention_mask) in transformers: each row's logits are those of the row alone
    in model.py (float32, the same bound as above: the rounding of another order of operations), and
    batched greedy generate() gives each prompt's tokens alone (sample.generate), its window sliding over
    the padding past block_size (the prompts of 6, 2 and 4 tokens, 14 new: the batch crosses 16)."""
    _, _, refs, got = exported
    hf, ref = got[name(variant)]["padded"], refs[name(variant)]["padded"]
    for b, n in enumerate(ROW_LENGTHS):
        assert (hf["logits"][b, BLOCK - n :] - ref["logits"][b]).abs().max().item() <= 1e-5, b
    for b in range(len(PROMPT_LENGTHS)):
        assert torch.equal(hf["ids"][b, PROMPT:], ref["ids"][b]), b


def test_generate_decodes_compiled_steps(monkeypatch):
    """hf_model's generate(): decode="compiled" (CUDA's default; here asked for, its step compiled with
    backend "aot_eager") gives decode="cache"'s greedy tokens (the CPU's default) and sample.generate's,
    past block_size too, from one graph without recompiles (a second prompt too); the config's decode
    is the default; a bad one is refused in one line."""
    from torch._dynamo.utils import counters

    import cache
    import hf_model

    aot_eager, calls = cache.compiled_next_logits("aot_eager"), []
    monkeypatch.setattr(hf_model, "compiled_next_logits", lambda: calls.append(1) or aot_eager)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    gpt = dict(n_layer=1, n_head=2, n_embd=32, head_dim=16, block_size=BLOCK, vocab_size=64)
    gpt.update(residual="ddl-cc", attention="deltaformer")
    model = hf_model.DDLGPTForCausalLM(hf_model.DDLGPTConfig(gpt=gpt))
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    prompts = [torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n)) for n in (PROMPT, 3)]
    run = lambda prompt, **kw: model.generate(prompt, max_new_tokens=NEW, do_sample=False, **kw)  # noqa: E731
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = [run(prompt, decode="compiled") for prompt in prompts]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    steps = len(calls)
    assert steps == (BLOCK - PROMPT) + (BLOCK - 3)  # the steps within the block (then no cache applies)
    for prompt, ids in zip(prompts, compiled):
        assert torch.equal(ids, run(prompt)) and torch.equal(ids, generate(model.gpt, prompt, NEW, top_k=1))
    assert len(calls) == steps  # the CPU's default: eager
    model.config.decode = "compiled"
    assert torch.equal(run(prompts[1]), compiled[1]) and len(calls) == steps + BLOCK - 3
    with pytest.raises(ValueError, match=r"decode must be one of \('cache', 'compiled'\), got 'fast'"):
        run(prompts[0], decode="fast")


def test_generate_compiled_steps_of_a_left_padded_batch(monkeypatch):
    """CUDA's default path for lm-eval's generation batches: decode="compiled" (its step compiled with
    backend "aot_eager" here) after a left-padded prompt gives each row the greedy tokens of its prompt
    alone (sample.generate, no padding), past block_size too, from one graph; the prompt pass takes the
    mask, the steps continue the cache's documents."""
    from torch._dynamo.utils import counters

    import cache
    import hf_model

    aot_eager = cache.compiled_next_logits("aot_eager")
    monkeypatch.setattr(hf_model, "compiled_next_logits", lambda: aot_eager)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    gpt = dict(n_layer=1, n_head=2, n_embd=32, head_dim=16, block_size=BLOCK, vocab_size=64)
    gpt.update(residual="ddl-cc", attention="deltaformer")
    model = hf_model.DDLGPTForCausalLM(hf_model.DDLGPTConfig(gpt=gpt)).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    lengths = (PROMPT, 2, 4)
    rows = [torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.zeros(len(rows), PROMPT, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, PROMPT - row.shape[1] :], mask[b, PROMPT - row.shape[1] :] = row[0], 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, decode="compiled")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
    for b, row in enumerate(rows):
        assert torch.equal(out[b, PROMPT:], generate(model.gpt, row, NEW, top_k=1)[0, row.shape[1] :]), b


def test_readme_recipes_export(tmp_path, monkeypatch):
    """The README's DDL-CC with one beta for the whole model and its Deltaformer at beta = 1, pasted at the
    end of model.py (and so of the model.py the folder holds), trained a few steps: the folder keeps the
    one beta (gpt.shared.beta), and transformers gives model.py's logits and greedy tokens from it."""
    from safetensors.torch import load_file

    code = readme_blocks("Add your own residual")[-1] + "\n\n" + readme_blocks("Add your own attention")[0]
    repo_files = export_hf.code_files

    def with_code():  # the folder's code, model.py with the blocks at its end
        files = repo_files()
        return {**files, "model.py": files["model.py"] + "\n\n" + code}

    monkeypatch.setattr(export_hf, "code_files", with_code)
    with pasted(code) as (rule, attention):
        model = tiny(seed=3, residual=rule, attention=attention).train()
        tokens = torch.randint(0, 512, (2, BLOCK), generator=torch.Generator().manual_seed(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            model(tokens, tokens)[1].backward()
            opt.step()
        model.eval()
        write_checkpoint(tmp_path / "ckpt", model)
        folder = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
        with torch.no_grad():
            logits, ids = model(tokens, targets=tokens)[0], generate(model, tokens[:, :PROMPT], NEW, top_k=1)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    assert [k for k in weights if "beta" in k] == ["gpt.shared.beta"]
    assert weights["gpt.shared.beta"].item() == model.shared.beta.item() != 0  # trained, from logit(1/2) = 0
    job = dict(folder=folder, tokens=tokens, prompt=tokens[:, :PROMPT], new=NEW)
    equal_the_repo(run_child(tmp_path, {"recipes": job})["recipes"], dict(logits=logits, ids=ids))


def test_tokenizer_gives_the_repo_ids(exported):
    _, _, _, got = exported
    enc = get_encoding()
    ids, texts = got["tokenizer"]
    assert ids == [enc.encode(t, allowed_special="all") for t in TEXTS]
    assert ids[0].count(50256) == 1 and ids[1][:2] == [50256, 50256]
    assert texts == TEXTS


@pytest.mark.slow
def test_triton_kernels_run_when_available(exported):
    """With Triton (its interpreter here) the folder runs the repo's Triton kernels, to the same logits."""
    tmp, jobs, refs, _ = exported
    picked = [
        name(v)
        for v in VARIANTS
        if v["residual"] in ("ddl-cc", "ddl-tc")
        and v.get("ddl_ec") is not False
        and v["attention"] == "deltaformer"
        and v.get("ddl_v") != "linear"
    ][:2]
    got = run_child(tmp, {n: dict(jobs[n], new=0) for n in picked}, mode="triton")
    for n in picked:
        assert got[n]["triton_calls"] == 2  # stage 1 of each layer's Deltaformer
        assert (got[n]["logits"] - refs[n]["logits"]).abs().max().item() <= 1e-5


def run_lm_eval(tmp_path, folder, task, num_fewshot, limit, batch_size):
    """`lm_eval --model hf` on the folder's model, in a process outside the repo: {doc_id: logged sample}."""
    import eval as ev

    out = tmp_path / f"lm-{task}-{batch_size}"
    cmd = [sys.executable, "-P", "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={folder},trust_remote_code=True", "--tasks", task, "--include_path", ev.LOCAL_TASKS,
           "--num_fewshot", str(num_fewshot), "--limit", str(limit), "--device", "cpu", "--batch_size",
           str(batch_size), "--seed", "1234", "--log_samples", "--output_path", str(out)]  # fmt: skip
    r = subprocess.run(
        cmd, cwd=tmp_path, env=child_env(tmp_path), capture_output=True, text=True, timeout=1800
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (samples,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    with open(samples, encoding="utf-8") as f:
        return {d["doc_id"]: d for d in map(json.loads, f)}


def test_lm_eval_hf_generates_in_left_padded_batches(tmp_path):
    """`lm_eval --model hf` runs the local generation task (shakespeare_cloze_gen) at --batch_size 4, its
    prompts of different lengths left-padded together: each output is the one of --batch_size 1."""
    pytest.importorskip("lm_eval")
    import eval as ev

    model = tiny(seed=6, vocab_size=50304, block_size=96, residual="ddl-tc", attention="softmax")
    with torch.no_grad():  # off the init: outputs that depend on the context (and would on the padding)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    write_checkpoint(tmp_path / "ckpt", model)
    folder = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    limit, enc = 8, get_encoding()
    with open(os.path.join(ev.LOCAL_TASKS, "shakespeare_cloze", "test.jsonl"), encoding="utf-8") as f:
        items = [json.loads(line) for line in f][:limit]
    lengths = [len(enc.encode_ordinary(item["context"])) for item in items]  # all fit: 96 - max_gen_toks (8)
    assert len(set(lengths)) == limit and max(lengths) <= 88  # every batch of 4 is padded
    batched, single = (run_lm_eval(tmp_path, folder, "shakespeare_cloze_gen", 0, limit, n) for n in (4, 1))
    assert sorted(batched) == sorted(single) == list(range(limit))
    outputs = [batched[i]["resps"][0][0] for i in range(limit)]
    assert outputs == [single[i]["resps"][0][0] for i in range(limit)]
    assert len(set(outputs)) == limit, outputs  # the outputs differ, none empty
    assert [batched[i]["target"] for i in range(limit)] == [it["choices"][it["label"]] for it in items]


def test_lm_eval_hf_equals_eval_py(tmp_path):
    """`lm_eval --model hf` on the export scores the local task with eval.py's loglikelihoods (1e-4)."""
    pytest.importorskip("lm_eval")
    import lm_eval

    import eval as ev

    model = tiny(seed=5, vocab_size=50304, block_size=64, residual="ddl-cc", attention="deltaformer")
    write_checkpoint(tmp_path / "ckpt", model)
    folder = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    limit = 6
    hf = run_lm_eval(tmp_path, folder, "shakespeare_cloze", num_fewshot=1, limit=limit, batch_size=4)
    lm = ev.CheckpointLM(out_dir=str(tmp_path / "ckpt"), device="cpu", batch_size=4)
    ours = lm_eval.simple_evaluate(
        model=lm,
        tasks=["shakespeare_cloze"],
        num_fewshot=1,
        limit=limit,
        task_manager=ev.task_manager(["shakespeare_cloze"], ev.include_paths(), False),
        log_samples=True,
        random_seed=1234,
        numpy_random_seed=1234,
        torch_random_seed=1234,
        fewshot_random_seed=1234,
    )
    ref = {d["doc_id"]: d for d in ours["samples"]["shakespeare_cloze"]}
    assert sorted(hf) == sorted(ref) == list(range(limit))
    for i in ref:
        hf_args = [[a["arg_0"], a["arg_1"]] for a in hf[i]["arguments"].values()]  # the log's form
        assert hf_args == [list(a) for a in ref[i]["arguments"]]  # the same requests
        got = [float(lp) for lp, _ in hf[i]["filtered_resps"]]
        want = [lp for lp, _ in ref[i]["filtered_resps"]]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4, (i, got, want)
        assert (hf[i]["acc"], hf[i]["acc_norm"]) == (ref[i]["acc"], ref[i]["acc_norm"])


# ---- bad input and the atomic write ----
def export_error(capsys, *args):
    with pytest.raises(SystemExit) as e:
        export_hf.main(list(args))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("export_hf.py: error: ")
    return err


def test_bad_input_is_one_line(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert "no checkpoint at" in export_error(
        capsys, f"--out_dir={tmp_path / 'empty'}", f"--to={tmp_path / 'x'}"
    )
    model = tiny()
    bad = {
        "model": model.state_dict(),
        "model_args": {**dataclasses.asdict(model.config), "residual": "ddl-zz"},
    }
    os.makedirs(tmp_path / "bad")
    torch.save(bad, tmp_path / "bad" / "ckpt.pt")
    err = export_error(capsys, f"--out_dir={tmp_path / 'bad'}", f"--to={tmp_path / 'x'}")
    assert "GPTConfig.residual must be one of" in err and "ddl-zz" in err
    write_checkpoint(tmp_path / "ok", model)
    os.makedirs(tmp_path / "there")
    err = export_error(capsys, f"--out_dir={tmp_path / 'ok'}", f"--to={tmp_path / 'there'}")
    assert "exists; pass --overwrite" in err
    assert not os.path.exists(tmp_path / "x") and os.listdir(tmp_path / "there") == []
    export_hf.main([f"--out_dir={tmp_path / 'ok'}", f"--to={tmp_path / 'there'}", "--overwrite"])
    assert os.path.isfile(tmp_path / "there" / "model.safetensors")


def test_export_is_atomic(tmp_path, monkeypatch):
    """A failure while writing leaves no folder (nor temp files), and an --overwrite keeps the old one."""
    write_checkpoint(tmp_path / "ckpt", tiny())
    to = tmp_path / "out" / "hf"

    def fail(folder, block_size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_hf, "write_tokenizer", fail)
    with pytest.raises(OSError, match="No space"):
        export_hf.export(str(tmp_path / "ckpt"), str(to))
    assert os.listdir(tmp_path / "out") == []
    monkeypatch.undo()
    export_hf.export(str(tmp_path / "ckpt"), str(to))
    before = {n: (to / n).read_bytes() for n in os.listdir(to)}
    write_checkpoint(tmp_path / "ckpt", tiny(seed=1))
    monkeypatch.setattr(export_hf, "write_tokenizer", fail)
    with pytest.raises(OSError, match="No space"):
        export_hf.export(str(tmp_path / "ckpt"), str(to), overwrite=True)
    assert os.listdir(tmp_path / "out") == ["hf"]
    assert {n: (to / n).read_bytes() for n in os.listdir(to)} == before
    monkeypatch.undo()
    export_hf.export(str(tmp_path / "ckpt"), str(to), overwrite=True)
    assert (
        os.listdir(tmp_path / "out") == ["hf"]
        and (to / "model.safetensors").read_bytes() != before["model.safetensors"]
    )
