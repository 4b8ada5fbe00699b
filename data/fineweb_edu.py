"""FineWeb-Edu -> GPT-2 token shards in llm.c's format, resumable.

    python data/fineweb_edu.py --out data/fineweb_edu                     # streams sample-10BT from the Hub
    python data/fineweb_edu.py --config sample-100BT --workers 16
    python data/fineweb_edu.py --input DIR_OR_FILES ... --min-int-score 3 --shard-tokens 10000000

Documents are read in input order (the Hub stream's order, or the --input files in the order given, a
directory contributing its *.parquet / *.jsonl files recursively in sorted order), optionally filtered on
`int_score`, tokenized by --workers processes (results are consumed in order, so the output does not
depend on the worker count), and each one is written as EOT + its tokens into a stream of shards of
--shard-tokens tokens: fineweb_edu_val_000000.bin, fineweb_edu_train_000001.bin, ... As in llm.c,
documents straddle shard boundaries, so the shards concatenated in index order are exactly the token
stream; shard 0 is the validation split; the last shard may be shorter.

Resumable. A shard is built in memory and written under a temporary name, then renamed (data/shards.py),
so a file with a final name is always complete. After each shard, fineweb_edu_state.json (written
atomically too) records how many shards are done and where the next one starts: (document index in the
input, token offset inside that document). It also holds a hash of the arguments that determine the
output. Killed at any moment and re-run with the same arguments, the run skips the documents already in
finished shards (re-tokenizing only the one that straddles) and ends with the same bytes as an
uninterrupted run. Bad input stops the run with an InputError naming the file (and row/line): every input
file's schema is checked before anything is written, so a broken or foreign file leaves no output at
all; a bad row found later leaves only the finished shards and the state, never a partial shard.
Documents whose text is empty are skipped (counted in the state and the final report). A run holds --out
(a lock the OS drops when the process ends): a second run there is refused. Ctrl-C (SIGINT) or SIGTERM
stops the command line with one line; run it again to resume.
"""

import argparse
import collections
import contextlib
import ctypes
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.shards import hold_dir, lock_holder, remove_empty_dirs, write_shard  # noqa: E402
from data.tokenizer import EOT, get_encoding  # noqa: E402

HUB_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb_edu")
STATE_NAME = "fineweb_edu_state.json"
BATCH_DOCS = 64  # jsonl / Hub documents per tokenization task (~250 KB): amortizes IPC, spreads the work


class InputError(ValueError):
    """Malformed input; the message names the file (or the Hub dataset) and the row."""


def shard_path(out, index):
    split = "val" if index == 0 else "train"
    return os.path.join(out, f"fineweb_edu_{split}_{index:06d}.bin")


# ---------------------------------------------------------------------------------------------- inputs


def list_inputs(paths):
    """Expand files and directories (recursively, sorted) into the ordered list of input files."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                found += [os.path.join(root, n) for n in sorted(names) if n.endswith((".parquet", ".jsonl"))]
            if not found:
                raise InputError(f"{p}: directory holds no .parquet or .jsonl files")
            files += found
        elif os.path.isfile(p):
            if not p.endswith((".parquet", ".jsonl")):
                raise InputError(f"{p}: unsupported input type (expected .parquet or .jsonl)")
            files.append(p)
        else:
            raise InputError(f"{p}: no such file or directory")
    return [os.path.abspath(f) for f in files]


def check_input(path, need_int_score):
    """Fail early, before any output exists, on a file that cannot be read or lacks the needed columns."""
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.ParquetFile(path).schema_arrow
        except Exception as e:
            raise InputError(f"{path}: not a readable parquet file ({e})") from e
        columns = {"text": (pa.types.is_string, pa.types.is_large_string)}
        if need_int_score:
            columns["int_score"] = (pa.types.is_integer,)
        for name, type_checks in columns.items():
            if name not in schema.names:
                raise InputError(f"{path}: no '{name}' column (columns: {', '.join(schema.names)})")
            if not any(check(schema.field(name).type) for check in type_checks):
                raise InputError(f"{path}: column '{name}' has type {schema.field(name).type}")
    else:
        try:
            with open(path, encoding="utf-8") as f:
                first = next((line for line in f if line.strip()), None)
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: cannot read as UTF-8 JSON lines ({e})") from e
        if first is None:
            raise InputError(f"{path}: empty jsonl file")
        _parse_json_line(path, 1, first, need_int_score)


def _parse_json_line(path, line_no, line, need_int_score):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{line_no}: invalid JSON ({e.msg})") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise InputError(f"{path}:{line_no}: record has no string field 'text'")
    score = record.get("int_score")
    if need_int_score and not (isinstance(score, int) and not isinstance(score, bool)):
        raise InputError(f"{path}:{line_no}: record has no integer field 'int_score'")
    return record["text"], score


def _check_batch(where, first_row, texts, scores):
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"{where}: row {first_row + i}: 'text' is {type(t).__name__}, not a string")
    if scores is not None:
        for i, s in enumerate(scores):
            if not isinstance(s, int):
                raise InputError(f"{where}: row {first_row + i}: 'int_score' is {s!r}, not an integer")


def read_files(files, start_doc, need_int_score, batch_docs=BATCH_DOCS):
    """Yield the work, in input order, from document `start_doc` on, as tasks for run_task():
    ("rowgroup", path, row_group, first_row_in_file, first_doc, skip, need_int_score) per parquet row
    group (the worker reads it, so texts never travel between processes), or
    ("texts", first_doc, texts, int_scores or None) per batch of jsonl lines.

    Documents before `start_doc` are skipped cheaply (whole files / row groups by their metadata)."""
    import pyarrow.parquet as pq

    doc = 0  # index of the next document in the whole input
    for path in files:
        if path.endswith(".parquet"):
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:
                raise InputError(f"{path}: not a readable parquet file ({e})") from e
            file_row = 0
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if doc + n > start_doc:
                    yield ("rowgroup", path, rg, file_row, doc, max(0, start_doc - doc), need_int_score)
                doc += n
                file_row += n
        else:
            texts, scores, first = [], [], doc
            with open(path, encoding="utf-8") as f:
                try:
                    for line_no, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        if doc >= start_doc:
                            if not texts:
                                first = doc
                            text, score = _parse_json_line(path, line_no, line, need_int_score)
                            texts.append(text)
                            scores.append(score)
                            if len(texts) == batch_docs:
                                yield ("texts", first, texts, scores if need_int_score else None)
                                texts, scores = [], []
                        doc += 1
                except UnicodeDecodeError as e:
                    raise InputError(f"{path}: not UTF-8 text ({e})") from e
            if texts:
                yield ("texts", first, texts, scores if need_int_score else None)


def read_row_group(path, rg, file_row, need_int_score):
    """(texts, int_scores or None) of one parquet row group, validated."""
    import pyarrow.parquet as pq

    columns = ["text"] + (["int_score"] if need_int_score else [])
    try:
        table = pq.ParquetFile(path).read_row_group(rg, columns=columns)
        texts = table.column("text").to_pylist()
        scores = table.column("int_score").to_pylist() if need_int_score else None
    except Exception as e:  # a corrupt page or row group
        raise InputError(f"{path}: cannot read parquet row group {rg} ({e})") from e
    _check_batch(path, file_row, texts, scores)
    return texts, scores


def read_hub(config, start_doc, need_int_score, batch_docs=BATCH_DOCS):
    """Like read_files ("texts" tasks), streaming HuggingFaceFW/fineweb-edu (`config`) via `datasets`."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("streaming from the Hub needs `pip install datasets` (or use --input)") from e
    ds = datasets.load_dataset(HUB_DATASET, name=config, split="train", streaming=True)
    if start_doc:
        ds = ds.skip(start_doc)
    where = f"{HUB_DATASET} ({config})"
    doc = start_doc
    texts, scores = [], []
    for record in ds:
        texts.append(record.get("text"))
        scores.append(record.get("int_score"))
        if len(texts) == batch_docs:
            _check_batch(where, doc, texts, scores if need_int_score else None)
            yield ("texts", doc, texts, scores if need_int_score else None)
            doc += len(texts)
            texts, scores = [], []
    if texts:
        _check_batch(where, doc, texts, scores if need_int_score else None)
        yield ("texts", doc, texts, scores if need_int_score else None)


# ---------------------------------------------------------------------------------------- tokenizing


def tokenize_docs(texts):
    """EOT + tokens of every text, concatenated (uint16); per-document lengths; UTF-8 bytes read."""
    enc = get_encoding()
    lengths = np.empty(len(texts), dtype=np.int64)
    ids = []
    nbytes = 0
    for i, text in enumerate(texts):
        tokens = enc.encode_ordinary(text)
        ids.append(EOT)
        ids.extend(tokens)
        lengths[i] = len(tokens) + 1
        nbytes += len(text.encode("utf-8"))
    return np.array(ids, dtype=np.uint16), lengths, nbytes


def _init_worker(parent):
    # A worker whose parent was killed would live on only to print BrokenPipeError tracebacks when it sends
    # its result: on Linux the kernel kills it with its parent instead (prctl PR_SET_PDEATHSIG), silently,
    # whatever it holds (a worker that dies of the broken pipe itself can hold the pool's write lock and
    # leave its siblings blocked forever).
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that
            os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops the pool
    # main() makes SIGTERM raise KeyboardInterrupt, which a forked worker inherits: pool.terminate() would
    # print each worker's traceback
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    get_encoding()  # build the encoding once per process, before the first task


def make_pool(workers):
    """A process pool for run_task, or None for workers <= 1 (tokenize in this process).

    Linux forks (instant start; no re-import of __main__, so it also works from a notebook or stdin).
    prepare() makes the pool before it reads any input or starts tqdm, so that no thread of ours (pyarrow's,
    tqdm's, the Hub client's) is running when it forks. Elsewhere: spawn."""
    if workers <= 1:
        return None
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    pool = multiprocessing.get_context(method).Pool
    return pool(workers, initializer=_init_worker, initargs=(os.getpid(),))


def run_task(task, min_int_score):
    """One task of read_files/read_hub -> (doc_indices, tokens, lengths, nbytes) of the documents kept, and
    the indices of the empty documents skipped (those the --min-int-score filter kept)."""
    if task[0] == "rowgroup":
        _, path, rg, file_row, first, skip, need_int_score = task
        texts, scores = read_row_group(path, rg, file_row, need_int_score)
        texts, scores, first = texts[skip:], scores[skip:] if scores is not None else None, first + skip
    else:
        _, first, texts, scores = task
    index = np.arange(first, first + len(texts), dtype=np.int64)
    if min_int_score is not None:
        keep = [i for i, s in enumerate(scores) if s >= min_int_score]
        index, texts = index[keep], [texts[i] for i in keep]
    empty = index[[t == "" for t in texts]] if texts else index
    keep = [i for i, t in enumerate(texts) if t]
    return (index[keep], *tokenize_docs([texts[i] for i in keep]), empty)


def tokenized(tasks, min_int_score, pool, workers):
    """Yield run_task's results in task order, in this process or in the pool.

    With a pool, at most 4 tasks per worker are in flight, so memory stays bounded whatever the input."""
    if pool is None:
        for task in tasks:
            yield run_task(task, min_int_score)
        return
    pending = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(run_task, (task, min_int_score)))
        if len(pending) >= 4 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# -------------------------------------------------------------------------------------------- driver


def _write_json_atomic(path, obj):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


STATE_KEYS = {"args_hash": str, "shards_done": int, "next_doc": int, "next_offset": int, "tokens": int}


def read_state(path):
    """The state file's dict; ValueError naming the file when it is not valid JSON of the expected shape."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ValueError(
            f"{path}: corrupt state file ({e}); delete the --out directory's contents to start over"
        ) from None
    bad = [k for k, t in STATE_KEYS.items() if not isinstance(state, dict) or not isinstance(state.get(k), t)]
    if bad or not isinstance(state.get("complete"), bool):
        raise ValueError(
            f"{path}: corrupt state file (missing or wrong {', '.join(bad) or 'complete'}); delete the --out "
            "directory's contents to start over"
        )
    return state


def prepare(out, *args, **kwargs):
    """Write the shards into `out` (resuming from its state file); return the list of shard paths.

    Arguments: write_shards'. `out` is held for the run (hold_dir): a second run there raises ValueError;
    the folders made for it are removed again if the run fails before writing anything there."""
    try:
        fd, made = hold_dir(out)
    except NotADirectoryError:
        raise ValueError(f"--out {out} is a file, not a folder") from None
    except BlockingIOError:
        raise ValueError(
            f"{out} is in use by another data/fineweb_edu.py run{lock_holder(out)}: wait for it to end, or "
            "choose another --out"
        ) from None
    try:
        return write_shards(out, *args, **kwargs)
    except BaseException:
        remove_empty_dirs(made)
        raise
    finally:
        os.close(fd)


def write_shards(
    out,
    inputs=None,
    config="sample-10BT",
    shard_tokens=100_000_000,
    min_int_score=None,
    workers=1,
    progress=True,
    on_shard=None,
):
    """prepare() once `out` is held.

    inputs: local .parquet/.jsonl files or directories (None: stream `config` from the Hub).
    on_shard(index, path): test hook, called after a shard file is written, before the state records it.
    """
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    need_int_score = min_int_score is not None
    if inputs is not None:
        files = list_inputs(inputs)
        if not files:
            raise InputError("--input: no input files given")
        for f in files:
            check_input(f, need_int_score)
        source = {"inputs": files}
    else:
        source = {"hub": HUB_DATASET, "config": config}
    # Everything that determines the output bytes (not --workers: the output does not depend on it).
    args = {**source, "shard_tokens": shard_tokens, "min_int_score": min_int_score, "tokenizer": "gpt2"}
    args_hash = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()

    state_path = os.path.join(out, STATE_NAME)
    for name in os.listdir(out):  # temporary files of a killed run
        if name.startswith("fineweb_edu_") and ".tmp." in name:
            os.remove(os.path.join(out, name))
    if os.path.exists(state_path):
        state = read_state(state_path)
        if state.get("args_hash") != args_hash:
            raise ValueError(
                f"{state_path} was written by a run with different arguments ({state.get('args')}); "
                "re-run with those, or use an empty --out directory"
            )
    else:
        stale = [n for n in os.listdir(out) if n.startswith("fineweb_edu_") and n.endswith(".bin")]
        if stale:
            raise ValueError(f"{out} holds shards ({stale[0]}, ...) but no {STATE_NAME}; use an empty --out")
        state = {"args": args, "args_hash": args_hash, "shards_done": 0, "next_doc": 0, "next_offset": 0}
        state.update(tokens=0, complete=False)
        _write_json_atomic(state_path, state)  # before the first shard, so a shard never lacks a state
    if state["complete"]:
        print(f"{out}: already complete ({state['shards_done']} shards, {state['tokens']:,} tokens)")
        return [shard_path(out, i) for i in range(state["shards_done"])]
    state.setdefault("empty_docs", 0)  # not in the state of an older run: from here on
    empty = collections.deque()  # indices of the empty documents skipped and not yet counted in the state
    if state["shards_done"]:
        print(f"resuming after {state['shards_done']} shards, at document {state['next_doc']:,}")

    def finish_shard(tokens, next_doc, next_offset):
        index = state["shards_done"]
        path = shard_path(out, index)
        write_shard(path, tokens)
        if on_shard is not None:
            on_shard(index, path)
        state.update(shards_done=index + 1, next_doc=int(next_doc), next_offset=int(next_offset))
        while empty and empty[0] < next_doc:  # those before the resume position, counted once
            state["empty_docs"] += 1
            empty.popleft()
        state["tokens"] += len(tokens)
        _write_json_atomic(state_path, state)

    start_doc, skip = state["next_doc"], state["next_offset"]
    # the tokenizer here, once: a worker whose pool initializer raises (no GPT-2 BPE files) is replaced by
    # another that raises too, for ever, and the run hangs without a word; forked workers inherit it
    get_encoding()
    pool = make_pool(workers)  # first: before anything starts threads (see make_pool)
    try:
        if inputs is not None:
            tasks = read_files(files, start_doc, need_int_score)
        else:
            tasks = read_hub(config, start_doc, need_int_score)
        bar = None
        if progress:
            from tqdm import tqdm

            # on a terminal, redrawn up to 10 times a second; into a file (a batch job's log), a line a minute
            tty = sys.stderr.isatty()
            bar = tqdm(unit=" docs", desc="fineweb-edu", dynamic_ncols=True, mininterval=0.1 if tty else 60)
        buf = np.empty(shard_tokens, dtype=np.uint16)
        fill, tokens_seen, bytes_seen, t0 = 0, 0, 0, time.time()
        for index, tokens, lengths, nbytes, skipped in tokenized(tasks, min_int_score, pool, workers):
            empty.extend(skipped.tolist())
            ends = np.cumsum(lengths)  # end of each document inside `tokens`
            pos = 0
            if skip:  # the document that straddled the last finished shard: its head is already written
                assert index[0] == start_doc, "resume position out of sync with the input"
                pos, skip = skip, 0
            while pos < len(tokens):
                take = min(shard_tokens - fill, len(tokens) - pos)
                buf[fill : fill + take] = tokens[pos : pos + take]
                fill += take
                pos += take
                if fill == shard_tokens:
                    k = int(np.searchsorted(ends, pos, side="right"))  # documents finished by `pos`
                    if k == len(index):
                        finish_shard(buf, index[-1] + 1, 0)
                    else:
                        finish_shard(buf, index[k], pos - (ends[k - 1] if k else 0))
                    fill = 0
            tokens_seen += len(tokens)
            bytes_seen += nbytes
            if bar is not None:
                mb_s = bytes_seen / 1e6 / max(time.time() - t0, 1e-9)
                postfix = f"{tokens_seen:,} tokens, {state['shards_done']} shards, {mb_s:.1f} MB/s"
                bar.set_postfix_str(postfix, refresh=False)  # drawn by update(), at most every mininterval
                bar.update(len(index))
        if bar is not None:
            bar.close()
    except BaseException as e:
        if pool is not None and not isinstance(e, Exception):  # Ctrl-C and the like: stop the workers now
            pool.terminate()
        raise
    finally:
        if pool is not None:
            # let the tasks in flight (at most 4 per worker) finish: a worker terminated while it writes a
            # result can leave the pool's result reader blocked on the half-written message for good
            pool.close()
            pool.join()
    if fill or state["shards_done"] == 0:
        if fill == 0:
            os.remove(state_path)
            filters = f"after the --min-int-score filter and {len(empty):,} empty ones skipped"
            raise InputError(f"no documents in the input ({filters})")
        finish_shard(buf[:fill], state["next_doc"], 0)  # the position no longer matters: complete below
    state["complete"] = True
    state["empty_docs"] += len(empty)
    _write_json_atomic(state_path, state)
    n = state["shards_done"]
    print(f"{out}: {n} shards ({n - 1} train + 1 val), {state['tokens']:,} tokens")
    if state["empty_docs"]:
        print(f'skipped {state["empty_docs"]:,} empty documents (text ""): not written')
    if n == 1:
        print("warning: everything fits in the validation shard; lower --shard-tokens to get train shards")
    return [shard_path(out, i) for i in range(n)]


def main(argv=None):
    p = argparse.ArgumentParser(description="FineWeb-Edu -> GPT-2 token shards (llm.c format), resumable")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default data/fineweb_edu)")
    p.add_argument("--config", default="sample-10BT", help=f"{HUB_DATASET} config to stream")
    p.add_argument("--input", nargs="+", help="local .parquet/.jsonl files or directories instead of the Hub")
    p.add_argument("--min-int-score", type=int, default=None, help="keep documents with int_score >= this")
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p.add_argument("--workers", type=int, default=cores, help="tokenizer processes (default: all cores)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: one line, no traceback
    try:
        prepare(
            a.out,
            inputs=a.input,
            config=a.config,
            shard_tokens=a.shard_tokens,
            min_int_score=a.min_int_score,
            workers=a.workers,
            progress=not a.no_progress,
        )
    except (InputError, ValueError, ImportError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (above): the finished shards stay, the state says which
        sys.exit(f"interrupted: run the same command again to resume ({a.out})")


if __name__ == "__main__":
    main()
