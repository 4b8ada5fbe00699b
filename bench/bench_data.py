"""Tokenization throughput: raw tiktoken vs the FineWeb-Edu shard pipeline on the same number of cores.

    python bench/bench_data.py [--workers N] [--mb 100] [--repeats 2]

Corpus: the Shakespeare plays cut into ~4 KB documents (FineWeb-Edu's average) up to --mb MB, in a parquet
file of FineWeb-Edu's layout. raw: enc.encode_ordinary_batch(texts, num_threads=N) in memory; pipeline:
data/fineweb_edu.py's prepare(workers=N) (read, tokenize, write 2M-token shards). MB/s and tokens/s on the
wall clock, MB per CPU-second (all threads and processes: holds up when other jobs share the cores); the
best of --repeats interleaved runs.
"""

import argparse
import itertools
import os
import shutil
import tempfile

from common import Span, command, versions  # bench/common.py, first: it puts the root on sys.path

from data.fineweb_edu import prepare
from data.shakespeare import load_plays
from data.tokenizer import get_encoding


def make_corpus(megabytes, doc_bytes=4000):
    docs = []
    for _, text in load_plays():
        cut = 0
        while cut < len(text):  # cut at the first blank line after doc_bytes characters
            end = text.find("\n\n", cut + doc_bytes)
            end = len(text) if end < 0 else end + 2
            docs.append(text[cut:end])
            cut = end
    out, size = [], 0
    for d in itertools.cycle(docs):
        if size >= megabytes * 1e6:
            return out, size
        out.append(d)
        size += len(d.encode("utf-8"))


def main():
    p = argparse.ArgumentParser(description="tokenization throughput: raw tiktoken vs shard pipeline")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--mb", type=float, default=100.0)  # enough tasks that the last one is a small tail
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.workers < 1 or args.repeats < 1 or not args.mb > 0:
        p.error(f"--workers {args.workers}, --repeats {args.repeats}: >= 1; --mb {args.mb}: > 0")

    import pyarrow as pa
    import pyarrow.parquet as pq
    import tiktoken

    texts, nbytes = make_corpus(args.mb)
    enc = get_encoding()
    ntokens = sum(len(t) for t in enc.encode_ordinary_batch(texts[:1000], num_threads=args.workers))  # warm
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        parquet = os.path.join(tmp, "corpus.parquet")
        n = len(texts)
        table = pa.table({"text": texts, "id": [f"<urn:uuid:{i}>" for i in range(n)], "int_score": [3] * n})
        pq.write_table(table, parquet, row_group_size=1000)

        raw, pipe = [], []  # (wall seconds, CPU seconds of this process and its reaped children)
        for _ in range(args.repeats):
            with Span() as span:
                ids = enc.encode_ordinary_batch(texts, num_threads=args.workers)
            raw.append((span.seconds, span.cpu_seconds))
            ntokens = sum(len(i) for i in ids)
            del ids
            out = os.path.join(tmp, "out")
            shutil.rmtree(out, ignore_errors=True)
            with Span() as span:
                prepare(out, inputs=[parquet], shard_tokens=2_000_000, workers=args.workers, progress=False)
            pipe.append((span.seconds, span.cpu_seconds))

    pipe_tokens = ntokens + len(texts)  # the pipeline also writes one EOT per document
    print(f"Command: `{command(__file__)}`", f"{versions()}; tiktoken {tiktoken.__version__}; "
          f"pyarrow {pa.__version__}; {os.cpu_count()} CPU cores", sep="\n")  # fmt: skip
    print(f"corpus: {len(texts):,} docs, {nbytes / 1e6:.1f} MB, {ntokens:,} tokens; {args.workers} workers")
    print(f"{'method':<48} {'MB/s':>8} {'Mtokens/s':>10} {'MB/CPU-s':>9}")
    for name, runs, tokens in [
        (f"raw encode_ordinary_batch(num_threads={args.workers})", raw, ntokens),
        (f"pipeline fineweb_edu.prepare(workers={args.workers})", pipe, pipe_tokens),
    ]:
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"{name:<48} {nbytes / 1e6 / wall:8.2f} {tokens / 1e6 / wall:10.2f} {nbytes / 1e6 / cpu:9.2f}")
    wall_ratio, cpu_ratio = (min(r[i] for r in raw) / min(r[i] for r in pipe) for i in (0, 1))
    print(f"pipeline / raw: {wall_ratio:.2f}x throughput (wall clock), {cpu_ratio:.2f}x per CPU-second")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
