"""bench/bench_data.py: the corpus it cuts, what --workers, --mb and --repeats change, and its throughputs
recomputed from stand-in clocks (the tokenizer and the shard pipeline stand-ins too: no real run)."""

import os
import sys

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_data  # noqa: E402

PARAGRAPH = "abcdefgh\n\n"  # 10 characters, a blank line at 8
PLAYS = [("a", PARAGRAPH * 40), ("b", "Short b.\n\nEnd.\n")]


def test_make_corpus_cuts_documents_at_blank_lines_up_to_the_size(monkeypatch):
    """Each play cut at the first blank line at or after doc_bytes characters from the cut (its tail
    whole); the documents repeated until there are --mb MB, the last one crossing it."""
    monkeypatch.setattr(bench_data, "load_plays", lambda: PLAYS)
    b = PLAYS[1][1]  # shorter than doc_bytes: one document
    for doc_bytes, once in (
        (98, [PARAGRAPH * 10] * 4 + [b]),
        (99, [PARAGRAPH * 11] * 3 + [PARAGRAPH * 7, b]),
    ):
        docs, size = bench_data.make_corpus(0.002, doc_bytes=doc_bytes)
        assert docs == [once[i % len(once)] for i in range(len(docs))], doc_bytes
        assert size == sum(len(d.encode()) for d in docs) and size >= 2000 > size - len(docs[-1].encode())


class Clock:
    """Stand-in for common.Span: each span lasts the next (wall, CPU) seconds."""

    def __init__(self, spans):
        self.left = list(spans)

    def __call__(self):
        clock = self

        class Tick:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.seconds, self.cpu_seconds = clock.left.pop(0)

        return Tick()


def test_main_throughputs_and_flags(monkeypatch, capsys):
    """--workers: the tokenizer's threads and the pipeline's workers; --repeats: interleaved runs of each,
    the best wall and the best CPU time kept; MB/s = bytes / 1e6 / best wall, Mtokens/s = tokens / 1e6 /
    best wall (the pipeline's with one EOT per document), MB per CPU-second; the ratio pipeline / raw."""
    monkeypatch.setattr(bench_data, "load_plays", lambda: PLAYS)
    threads, prepared = [], []

    class Encoding:  # a token per character
        def encode_ordinary_batch(self, texts, num_threads):
            threads.append(num_threads)
            return [[0] * len(t) for t in texts]

    def prepare(out, inputs, shard_tokens, workers, progress):
        prepared.append((len(pq.read_table(inputs[0])), shard_tokens, workers, progress))

    monkeypatch.setattr(bench_data, "get_encoding", Encoding)
    monkeypatch.setattr(bench_data, "prepare", prepare)
    raw = [(2e-4, 4e-4), (1e-4, 5e-4), (1.5e-4, 3e-4)]  # (wall, CPU) of each raw run; then the pipeline's
    pipe = [(3e-4, 6e-4), (4e-4, 9e-4), (2.5e-4, 7e-4)]
    monkeypatch.setattr(bench_data, "Span", Clock([s for pair in zip(raw, pipe) for s in pair]))
    monkeypatch.setattr(sys, "argv", ["bench_data.py", "--workers", "3", "--mb", "0.002", "--repeats", "3"])
    bench_data.main()
    docs, nbytes = bench_data.make_corpus(0.002)
    ntokens = sum(len(d) for d in docs)
    assert threads == [3] * 4 and prepared == [(len(docs), 2_000_000, 3, False)] * 3  # the warm-up + 3
    out = capsys.readouterr().out
    assert f"corpus: {len(docs):,} docs, {nbytes / 1e6:.1f} MB, {ntokens:,} tokens; 3 workers" in out
    rates = {line.split()[0]: [float(x) for x in line.split()[-3:]] for line in out.splitlines()
             if line.startswith(("raw encode", "pipeline fineweb"))}  # fmt: skip
    for name, tokens, wall, cpu in (
        ("raw", ntokens, 1e-4, 3e-4),
        ("pipeline", ntokens + len(docs), 2.5e-4, 6e-4),
    ):
        want = [nbytes / 1e6 / wall, tokens / 1e6 / wall, nbytes / 1e6 / cpu]
        assert rates[name] == pytest.approx(want, abs=0.006), name
    assert (
        f"pipeline / raw: {1e-4 / 2.5e-4:.2f}x throughput (wall clock), {3e-4 / 6e-4:.2f}x per CPU-second"
        in out
    )
    monkeypatch.setattr(bench_data, "Span", Clock([(1.0, 1.0)] * 2))
    monkeypatch.setattr(sys, "argv", ["bench_data.py", "--workers", "1", "--mb", "0.001", "--repeats", "1"])
    bench_data.main()  # the least of each
    assert threads[-2:] == [1, 1] and prepared[-1][2] == 1 and len(prepared) == 4


def test_refusals(monkeypatch, capsys):
    monkeypatch.setattr(bench_data, "make_corpus", lambda mb: pytest.fail("ran"))
    for flag, value in (("--workers", "0"), ("--repeats", "0"), ("--mb", "0"), ("--mb", "nan")):
        monkeypatch.setattr(sys, "argv", ["bench_data.py", flag, value])
        with pytest.raises(SystemExit):
            bench_data.main()
        assert f"{flag} {value}" in capsys.readouterr().err, flag
