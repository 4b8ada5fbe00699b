"""
Downstream evaluation of a checkpoint (out_dir/ckpt.pt written by train.py) through lm-evaluation-harness
(PyPI `lm-eval`), e.g. the DDL paper's 1-shot table:

    python eval.py --out_dir=out --num_fewshot=1 \\
        --tasks=sciq,winogrande,arc_easy,arc_challenge,hellaswag,piqa,lambada_openai \\
        [--batch_size=32 --device=cuda --limit=N --output=results.json]
    python eval.py --out_dir=out-shakespeare --tasks=shakespeare_cloze     # offline, local data

Any residual x attention variant loads (the config is in the checkpoint). The model is wrapped as an lm-eval
`LM` registered under the name "ddl-gpt"; the tasks under data/tasks (shakespeare_cloze: written by
data/shakespeare_cloze.py) are added to lm-eval's own. lm-eval's table is printed and its results JSON
written (atomically) to --output (default: out_dir/eval.json). The paper's tasks download their data from
the Hugging Face Hub on first use (cached after); the local tasks need no network.

lm-eval's own command line, with this model registered and data/tasks included:

    python eval.py lm_eval --model ddl-gpt --model_args out_dir=out --tasks shakespeare_cloze --device cpu

(`python eval.py lm_eval ARGS` runs `lm-eval ARGS` after importing this file; from Python,
`import eval` then `lm_eval.simple_evaluate(model="ddl-gpt", model_args="out_dir=out", ...)`.)

Scoring: `loglikelihood` batches requests longest first (results in the request order), each its context
left-truncated so that context + continuation fit in block_size; `loglikelihood_rolling` scores a text in
disjoint windows of block_size tokens (lm-eval's get_rolling_token_windows, as its HF model does);
`generate_until` decodes greedily with sample.generate (top_k=1) for up to max_gen_toks tokens (a batch
stops once every row holds a stop string), then cuts the text at the first stop string. GPT-2 tokens
(data/tokenizer.py); EOT is the prefix of an empty context.
"""

import argparse
import dataclasses
import inspect
import json
import os
import sys
import time
from collections import defaultdict
from functools import partial

import torch
from tqdm import tqdm

from checkpoint import CheckpointError, load_model
from data.tokenizer import EOT, get_encoding
from sample import generate

try:
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # only this file needs lm-eval; training and sampling do not
    raise ImportError(f"eval.py needs lm-evaluation-harness: pip install lm-eval ({e})") from e

REPO = os.path.dirname(os.path.abspath(__file__))
LOCAL_TASKS = os.path.join(REPO, "data", "tasks")
MODEL_NAME = "ddl-gpt"
PAPER_TASKS = "sciq,winogrande,arc_easy,arc_challenge,hellaswag,piqa,lambada_openai"
LOGIT_ROWS = 8192  # positions per LM-head call when scoring (bounds the [rows, vocab] logits in memory)


def load_checkpoint(out_dir, device="cpu"):
    """(GPT in eval mode on device, checkpoint dict) from out_dir/ckpt.pt; CheckpointError if unusable."""
    return load_model(os.path.join(out_dir, "ckpt.pt"), device)


class ModelArgsError(ValueError):
    """model_args that CheckpointLM does not take; the message (one line) lists those it does."""


class CheckpointLM(TemplateLM):
    """lm-eval LM over a model.GPT: from out_dir (its ckpt.pt) or an in-memory `model`."""

    def __init__(
        self,
        out_dir=None,
        model=None,
        batch_size=32,
        device=None,
        dtype="float32",
        max_gen_toks=256,
        **kwargs,
    ):
        super().__init__()
        if (out_dir is None) == (model is None):
            raise ValueError("CheckpointLM needs exactly one of out_dir (a directory with ckpt.pt) or model")
        kwargs.pop("max_batch_size", None)  # lm-eval passes it to every model; batches here are fixed-size
        if kwargs:
            takes = [p for p in inspect.signature(CheckpointLM).parameters if p not in ("model", "kwargs")]
            raise ModelArgsError(
                f"{MODEL_NAME}: unknown model_args {', '.join(sorted(kwargs))}; it takes {', '.join(takes)} "
                "(the model's shape and variant come from out_dir/ckpt.pt)"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.ckpt_info = {}
        if model is None:
            model, ckpt = load_checkpoint(str(out_dir), device)
            self.ckpt_info = {"out_dir": str(out_dir), "iter_num": ckpt.get("iter_num")}
        self.model = model.eval().to(device)
        self._device = torch.device(device)
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 32  # no automatic batch-size search
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16' (autocast), got {dtype!r}")
        self.dtype = dtype
        self.max_gen_toks = int(max_gen_toks)
        self.enc = get_encoding()
        self.block_size = self.model.config.block_size
        self.vocab_size = self.model.config.vocab_size

    # ---- tokenization (TemplateLM encodes context / continuation pairs with these) ----
    @property
    def eot_token_id(self):
        return EOT

    @property
    def max_length(self):
        return self.block_size

    @property
    def tokenizer_name(self):
        return "gpt2"

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.enc.encode_ordinary(string)

    def tok_decode(self, tokens):
        # ids past GPT-2's 50257 (vocab padding rows) have no text
        return self.enc.decode([t for t in tokens if t < self.enc.n_vocab])

    def get_model_info(self):
        cfg = self.model.config
        return {
            **self.ckpt_info,
            "model_args": dataclasses.asdict(cfg),
            "num_params": self.model.num_params(),
            "dtype": self.dtype,
        }

    def _autocast(self):
        return torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16")

    # ---- scoring ----
    @torch.no_grad()
    def _token_logprobs(self, batch):
        """batch: [(input ids, targets)], the last len(targets) inputs of a row predicting its targets
        -> per row (log-probabilities of the targets [n], whether each is the argmax [n])."""
        T = max(len(inp) for inp, _ in batch)
        x = torch.zeros(len(batch), T, dtype=torch.long)  # right-padded: causal, so padding is never seen
        for b, (inp, _) in enumerate(batch):
            x[b, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        with self._autocast():
            h = self.model.hidden_states(x.to(self._device))
        rows = torch.cat([h[b, len(inp) - len(tgt) : len(inp)] for b, (inp, tgt) in enumerate(batch)])
        targets = torch.tensor([t for _, tgt in batch for t in tgt], dtype=torch.long, device=self._device)
        logp, greedy = [], []
        for i in range(0, len(rows), LOGIT_ROWS):
            with self._autocast():
                logits = self.model.lm_head(rows[i : i + LOGIT_ROWS])
            lp = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
            tgt = targets[i : i + LOGIT_ROWS]
            logp.append(lp.gather(-1, tgt[:, None])[:, 0])
            greedy.append(lp.argmax(-1) == tgt)
        logp, greedy = torch.cat(logp).cpu(), torch.cat(greedy).cpu()
        out, k = [], 0
        for _, tgt in batch:
            out.append((logp[k : k + len(tgt)], greedy[k : k + len(tgt)]))
            k += len(tgt)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, desc="loglikelihood"):
        """requests: [(key, context ids, continuation ids)] -> [(sum log p(continuation | context), greedy)].

        Batched longest first; each context is left-truncated so that input + continuation fit in
        block_size; results come back in the request order."""
        results = [None] * len(requests)
        rows = []  # (request index, input ids, continuation ids)
        for k, (_, ctx, cont) in enumerate(requests):
            if not cont:
                results[k] = (0.0, True)
                continue
            if len(cont) > self.block_size:
                raise ValueError(
                    f"a continuation of {len(cont)} tokens exceeds block_size {self.block_size}: "
                    "it cannot be scored in one window"
                )
            if not ctx:
                raise ValueError("loglikelihood needs a context of at least one token")
            whole = (list(ctx) + list(cont))[-(self.block_size + 1) :]
            rows.append((k, whole[:-1], list(cont)))
        rows.sort(key=lambda r: -len(r[1]))
        bar = tqdm(total=len(rows), desc=desc, disable=disable_tqdm or not rows)
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i : i + self.batch_size]
            scored = self._token_logprobs([(inp, cont) for _, inp, cont in chunk])
            for (k, _, _), (lp, greedy) in zip(chunk, scored):
                results[k] = (float(lp.double().sum()), bool(greedy.all()))
                key = requests[k][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[k])
            bar.update(len(chunk))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """[(text,)] -> [log p(text)], EOT-prefixed, in disjoint windows of block_size tokens."""
        windows, owner = [], []
        for j, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(j)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for j, (lp, _) in zip(owner, scores):
            totals[j] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _all_stopped(self, until, new):
        """Whether every row of the new tokens [B, t] holds one of the stop strings."""
        return all(any(s in self.tok_decode(row) for s in until) for row in new.tolist())

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        """[(context, gen_kwargs)] -> greedy continuations (sample.generate, top_k=1) of up to max_gen_toks
        tokens, each cut before its first stop string (gen_kwargs["until"] and EOT's text); a batch stops
        generating once every row holds a stop string.

        Requests with the same settings share sample.generate calls, batch_size at a time, longest prompt
        first: a batch's shorter prompts are left-padded (attention_mask), each row's tokens those of its
        prompt alone. A prompt is cut to its last block_size tokens: sample.generate never looks further
        back."""
        eos = self.tok_decode([self.eot_token_id])
        groups = defaultdict(list)
        for k, req in enumerate(requests):
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(dict(gen_kwargs or {}), default_max_gen_toks=self.max_gen_toks)
            if kw.get("do_sample"):
                raise ValueError(
                    f"{MODEL_NAME} decodes greedily only; got do_sample=True ({dict(gen_kwargs)})"
                )
            until = tuple(handle_stop_sequences(list(kw["until"]), eos=eos))
            ids = self.tok_encode(context)[-self.block_size :] or [self.prefix_token_id]
            groups[(kw["max_gen_toks"], until)].append((k, ids))
        results = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm or not requests)
        for (max_gen_toks, until), items in groups.items():
            items.sort(key=lambda item: -len(item[1]))
            for i in range(0, len(items), self.batch_size):
                chunk = items[i : i + self.batch_size]
                T = len(chunk[0][1])  # the longest prompt's length: the others are left-padded to it
                x = torch.full((len(chunk), T), EOT, dtype=torch.long)  # (the padding's ids are never seen)
                mask = torch.zeros_like(x)
                for b, (_, ids) in enumerate(chunk):
                    x[b, T - len(ids) :], mask[b, T - len(ids) :] = torch.tensor(ids), 1
                mask = None if bool(mask.all()) else mask.to(self._device)  # no padding: the unmasked path
                x, stopped = x.to(self._device), partial(self._all_stopped, until)
                with self._autocast():
                    y = generate(self.model, x, max_gen_toks, top_k=1, stop=stopped, attention_mask=mask)
                for (k, _), row in zip(chunk, y[:, T:].tolist()):
                    text = self.tok_decode(row)
                    for stop in until:
                        text = text.split(stop)[0]
                    results[k] = text
                    self.cache_hook.add_partial("generate_until", requests[k].args, text)
                bar.update(len(chunk))
        bar.close()
        return results


try:
    register_model(MODEL_NAME)(CheckpointLM)
except ValueError:  # registered already by another import of this file (as __main__ and as eval)
    pass


# ---- command line ----
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="directory holding ckpt.pt (default: out)")
    p.add_argument(
        "--tasks", default=PAPER_TASKS, help=f"comma-separated lm-eval tasks (default: {PAPER_TASKS})"
    )
    p.add_argument("--num_fewshot", type=int, default=1, help="examples in each prompt (default: 1)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="bfloat16: autocast")
    p.add_argument("--limit", type=float, default=None, help="at most N documents per task (< 1: a fraction)")
    p.add_argument("--max_gen_toks", type=int, default=256, help="generation tasks' default length")
    p.add_argument("--include_path", default=None, help="more lm-eval task folders, ','-separated")
    p.add_argument("--output", default=None, help="results JSON (default: OUT_DIR/eval.json)")
    p.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (few-shot sampling among them)")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        p.error("--tasks is empty")
    if args.num_fewshot < 0:
        p.error(f"--num_fewshot must be >= 0, got {args.num_fewshot}")
    if args.batch_size < 1:
        p.error(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.limit is not None:
        if not args.limit > 0:
            p.error(f"--limit must be > 0, got {args.limit}")
        if args.limit >= 1:
            args.limit = int(args.limit)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device={args.device} but CUDA is not available (use --device=cpu)")
    if args.output is None:
        args.output = os.path.join(args.out_dir, "eval.json")
    return args


def include_paths(extra=None):
    return [LOCAL_TASKS] + [q for q in (extra or "").split(",") if q]


def named_in_task_files(names, folders):
    """The names among `names` that occur as text in some .yaml file under `folders`. Every lm-eval task,
    group and tag is named in one, so a name found in none is unknown: a test that reads the files (under a
    second) where indexing lm-eval's ~15k built-in tasks parses them all (seconds, minutes on a busy
    machine)."""
    found, left = set(), set(names)
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                if left and name.endswith((".yaml", ".yml")):
                    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                        text = f.read()
                    found |= {n for n in left if n in text}
                    left -= found
    return found


def task_manager(tasks, paths, builtin=True, say=None):
    """An lm-eval TaskManager that knows every one of tasks (names or glob patterns): the folders in paths
    alone if they hold them all, else those and (builtin=True) lm-eval's own, indexed after a line to
    say(...) (default: stderr) since that takes a while. ValueError names the unknown tasks: at once for a
    name in no task file, else after the indexing."""
    from lm_eval.tasks import TaskManager

    say = say or (lambda message: print(message, file=sys.stderr, flush=True))
    tm = TaskManager(include_path=paths, include_defaults=False)
    missing = [t for t in tasks if not tm.match_tasks([t])]
    if builtin and missing:
        plain = [t for t in missing if not any(c in t for c in "*?[")]  # not a glob pattern
        builtin_dir = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
        absent = sorted(set(plain) - named_in_task_files(plain, [builtin_dir, *paths]), key=plain.index)
        if absent:
            raise ValueError(
                f"unknown task(s) {', '.join(absent)}: named in none of lm-eval {lm_eval.__version__}'s task "
                f"files nor in {', '.join(paths)} (list them with `lm-eval ls tasks`)"
            )
        say(f"# indexing lm-eval {lm_eval.__version__}'s tasks for {', '.join(missing)} (takes a while)")
        tm = TaskManager(include_path=paths)
    unknown = [t for t in tasks if not tm.match_tasks([t])]
    if unknown:
        where = f"lm-eval {lm_eval.__version__}'s tasks" if builtin else "the task folders"
        raise ValueError(
            f"unknown task(s) {', '.join(unknown)}: not among {where} ({len(tm.all_tasks)}) nor in "
            f"{', '.join(paths)} (list them with `lm-eval ls tasks`)"
        )
    return tm


def evaluate(lm, tasks, num_fewshot=None, limit=None, paths=None, seed=1234, builtin=True, tm=None):
    """lm_eval.simple_evaluate of lm (an LM) on tasks, with data/tasks (and paths) included; tm: the
    task_manager of tasks, if already made."""
    tm = tm or task_manager(tasks, paths or include_paths(), builtin)
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=tm,
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def write_json(path, obj):
    """Atomic: write path.tmp, fsync, rename."""
    from lm_eval.utils import handle_non_serializable

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_lm_eval_cli(argv):
    """lm-eval's own command line (argv after `lm_eval`), with this model registered and data/tasks
    included unless --include_path is given."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        argv += ["--include_path", LOCAL_TASKS]
    sys.argv = ["lm-eval"] + argv
    try:
        cli_evaluate()
    except (ModelArgsError, CheckpointError) as e:  # what a user typed: one line, not a traceback
        fail(str(e))


def fail(msg):
    sys.exit(f"eval.py: error: {msg}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm_eval"]:
        return run_lm_eval_cli(argv[1:])
    args = parse_args(argv)
    try:  # the task names first: a typo fails before the model loads (and before any slow indexing)
        tm = task_manager(args.tasks, include_paths(args.include_path))
    except ValueError as e:
        fail(str(e))
    try:
        lm = CheckpointLM(
            out_dir=args.out_dir,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            max_gen_toks=args.max_gen_toks,
        )
    except CheckpointError as e:
        fail(str(e))
    cfg = lm.model.config
    print(
        f"# {args.out_dir}/ckpt.pt: iteration {lm.ckpt_info.get('iter_num')}, "
        f"{lm.model.num_params() / 1e6:.2f}M params, {cfg.residual} residual, {cfg.attention} attention; "
        f"tasks {','.join(args.tasks)}, {args.num_fewshot}-shot",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    results = evaluate(lm, args.tasks, args.num_fewshot, args.limit, seed=args.seed, tm=tm)
    seconds = time.perf_counter() - t0
    items = sum(n["effective"] for n in results.get("n-samples", {}).values())
    results["eval_seconds"] = seconds
    write_json(args.output, results)  # first: a failure while printing the table loses nothing
    where = next(lm.model.parameters()).device
    print(f"{items} items in {seconds:.1f} s: {items / seconds:.1f} items/s on {where}", file=sys.stderr)
    print(f"results -> {args.output}", file=sys.stderr)
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    return results


if __name__ == "__main__":
    main()
