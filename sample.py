"""
Sample from a trained model (out_dir/ckpt.pt written by train.py); runs on CPU or GPU.

    python sample.py --out_dir=out-shakespeare --start="ROMEO:" --num_samples=2 --max_new_tokens=200
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0.7 --top_k=50

The prompt is GPT-2 tokenized; "<|endoftext|>" in it is the EOT token (the document separator the model
saw before every document, so it asks for the start of a fresh document). Generation uses the model's
incremental cache (`generate` below, also what eval.py uses); on CUDA its steps run compiled (CUDA graphs;
the first call compiles), --decode=cache runs them eagerly. --top_k=1 is greedy decoding. It prints the
tokens/s of the generation (all samples, the prompt's pass included) on stderr.
"""

import argparse
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

from cache import Cache, compiled_next_logits, next_logits, static_cache  # noqa: F401 (sample's API too)
from checkpoint import CheckpointError, load_model
from data.tokenizer import get_encoding

# Past block_size each new token is a forward pass over the whole window (no cache applies), so long
# generations are slow: they report progress, and a bound keeps a typo from running for days.
MAX_NEW_TOKENS = 1_000_000  # ~4 MB of text a sample
PROGRESS_EVERY = 1000  # new tokens between progress lines on stderr
DECODES = ("cache", "static", "compiled", "none")  # generate's ways to compute a token (generate's docstring)


@torch.no_grad()
def generate(
    model, idx, max_new_tokens, temperature=1.0, top_k=None, stop=None, decode="cache", attention_mask=None
):
    """Append max_new_tokens sampled tokens to idx [B, T] (top_k=1: greedy), through the model's cache
    while the sequence fits in block_size, then cropped like nanoGPT (the window slides: no cache applies).
    stop: called with the new tokens [B, t] after each step; generation ends early once it returns True.
    decode: how a token's logits are computed, the same in every way up to the rounding of another order of
    operations: "cache", a Cache; "static", a StaticCache; "compiled", a StaticCache with each step after the
    prompt compiled (torch.compile, CUDA graphs on a GPU; one compile per model, batch size and dtype);
    "none", no cache: a forward pass over the whole sequence for every token (nanoGPT's loop).
    attention_mask [B, T] (1: a token, 0: left padding): prompts of different lengths, each row's tokens
    those of its prompt alone; passed to the prompt's pass, and to each window's (the new tokens as ones)."""
    if decode not in DECODES:
        raise ValueError(f"generate: decode must be one of {DECODES}, got {decode!r}")
    mask = attention_mask  # (the model refuses right padding; a row of padding alone has nothing to go on)
    if mask is not None and not bool(mask[..., -1].all()):
        raise ValueError("generate: attention_mask must end every row with a token (left padding only)")
    block_size, T = model.config.block_size, idx.size(1)
    cache, token, step = None, None, compiled_next_logits() if decode == "compiled" else next_logits
    for _ in range(max_new_tokens):
        if stop is not None and idx.size(1) > T and stop(idx[:, T:]):
            break
        if decode == "none" or idx.size(1) > block_size:
            window = None if mask is None else F.pad(mask, (0, idx.size(1) - T), value=1)[:, -block_size:]
            cache, logits = None, next_logits(model, None, idx[:, -block_size:], window)
        elif cache is None:  # the prompt
            cache = Cache() if decode == "cache" else static_cache(model, idx)
            logits = next_logits(model, cache, idx, mask)
            if decode != "cache":
                cache.prompt = False  # a StaticCache's steps from here on
        else:  # the last token, [B, 1] of its own (a view of idx would change strides: a recompile each)
            logits = step(model, cache, token)
        token = sample_token(logits, temperature, top_k)
        idx = torch.cat([idx, token], dim=1)
    return idx


def sample_token(logits, temperature=1.0, top_k=None):
    """logits [B, V] -> token ids [B, 1]; top_k=1 is the argmax."""
    if top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="directory holding ckpt.pt (default: out)")
    p.add_argument("--start", default="\n", help="prompt text, or FILE:path to read it from a file")
    p.add_argument("--num_samples", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="> 0; lower is more conservative")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--decode", choices=DECODES, help="how each token is computed: cache, static (a "
                   "preallocated cache), compiled (static, its step compiled: the default on CUDA), none "
                   "(default on the CPU: cache)")  # fmt: skip
    args = p.parse_args(argv)
    args.decode = args.decode or ("compiled" if args.device.startswith("cuda") else "cache")
    if args.num_samples < 1:
        p.error(f"--num_samples must be >= 1, got {args.num_samples}")
    if not 0 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        p.error(f"--max_new_tokens must be in 0..{MAX_NEW_TOKENS:,}, got {args.max_new_tokens:,}")
    if not args.temperature > 0:
        p.error(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k < 0:
        p.error(f"--top_k must be >= 0 (0 = no top-k filter), got {args.top_k}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device={args.device} but CUDA is not available (use --device=cpu)")
    return p, args


def read_prompt(start):
    """The prompt text: `start` itself, or the contents of the UTF-8 file it names as FILE:path."""
    if not start.startswith("FILE:"):
        try:  # argv bytes that are not UTF-8 arrive as lone surrogates (U+DC80..U+DCFF), not as text
            start.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = ord(start[e.start]) - 0xDC00 if 0xDC80 <= ord(start[e.start]) <= 0xDCFF else None
            what = f"byte {byte:#04x}" if byte is not None else f"character {start[e.start]!r}"
            raise ValueError(f"--start: not UTF-8 text ({what} at position {e.start})") from None
        return start
    path = start[len("FILE:") :]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--start=FILE:{path}: cannot read the prompt file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--start=FILE:{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def main(argv=None):
    parser, args = parse_args(argv)
    try:  # everything that can fail on the user's input first, before the model is loaded
        start = read_prompt(args.start)
        enc = get_encoding()
    except (ValueError, ImportError, OSError) as e:
        parser.error(str(e))
    path = os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.exists(path):
        parser.error(f"no checkpoint at {path} (train one with train.py, or set --out_dir)")
    try:
        model, ckpt = load_model(path, args.device)
    except CheckpointError as e:
        parser.error(str(e))
    ids = enc.encode(start, allowed_special={"<|endoftext|>"})
    vocab_size = model.config.vocab_size
    if not ids:
        parser.error("--start is empty after tokenization; give at least one character (default '\\n')")
    if max(ids) >= vocab_size:
        parser.error(f"the prompt has token ids >= the model's vocab_size ({vocab_size}): {sorted(set(ids))}")
    print(
        f"# {path}: iteration {ckpt.get('iter_num', '?')}, {model.num_params() / 1e6:.2f}M params, "
        f"{model.config.residual} residual, {model.config.attention} attention",
        file=sys.stderr,
    )

    torch.manual_seed(args.seed)
    x = torch.tensor(ids, dtype=torch.long, device=args.device)[None].repeat(args.num_samples, 1)
    top_k = args.top_k or None

    def progress(new):  # a line every PROGRESS_EVERY tokens of a long generation; never stops it
        if new.size(1) % PROGRESS_EVERY == 0:
            print(f"# {new.size(1):,} of {args.max_new_tokens:,} new tokens", file=sys.stderr, flush=True)
        return False

    t0 = time.perf_counter()
    y = generate(model, x, args.max_new_tokens, temperature=args.temperature, top_k=top_k, stop=progress,
                 decode=args.decode)  # fmt: skip
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    seconds, n = max(time.perf_counter() - t0, 1e-9), y.numel() - x.numel()  # the prompt's pass included
    print(f"# {n:,} tokens generated in {seconds:.2f} s: {n / seconds:,.1f} tokens/s", file=sys.stderr)
    for k, row in enumerate(y.tolist()):
        # ids past GPT-2's 50257 (vocab padding rows) never occur in the data and have no text
        text = enc.decode([t for t in row if t < enc.n_vocab])
        print(text)
        if k < args.num_samples - 1:
            print("---------------")


if __name__ == "__main__":
    main()
