"""The row tables of bench/bench_train.py and bench/bench_infer.py: what each of their flags (common.py's
row_parser and their own) changes, by direct calls of main(), the workers' measure functions and the runner
with stand-ins for the clock, the compiler and the job queue (no GPU); and every number of their tables
recomputed from hand-made rows or by first principles."""

import argparse
import collections
import json
import math
import os
import pickle
import statistics
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_infer  # noqa: E402
import bench_train  # noqa: E402
import common  # noqa: E402

import ops.common  # noqa: E402
import sample  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TINY = dict(n_layer=1, n_embd=32, n_head=2, head_dim=16, vocab_size=64)


def planned(monkeypatch, script, *argv):
    """What script.main() hands common.run_rows for these flags (nothing runs): args, specs, settings, ..."""
    seen = {}

    def run_rows(args, path, specs, settings, tables, job_timeout, parallel=1):
        seen.update(args=args, path=path, specs=specs, settings=settings, tables=tables, parallel=parallel)
        seen.update(job_timeout=job_timeout)

    monkeypatch.setattr(common, "run_rows", run_rows)
    monkeypatch.setattr(sys, "argv", [script.__file__, "--device", "cpu", *argv])
    script.main()
    return types.SimpleNamespace(**seen)


def refused(monkeypatch, capsys, script, *argv):
    """The message script.main() exits with, before anything runs, for these flags."""
    monkeypatch.setattr(common, "run_rows", lambda *a, **k: pytest.fail(f"{argv} ran"))
    monkeypatch.setattr(sys, "argv", [script.__file__, "--device", "cpu", *argv])
    with pytest.raises(SystemExit) as e:
        script.main()
    return f"{e.value.code} {capsys.readouterr().err}"


def labels(specs):
    return [tuple(s["row"].values()) for s in specs]


def tiny_params(d, V, L, H, hd):
    """The tiny additive softmax GPT's parameter count, by its layers: the tied embedding, per block two
    norms, qkv and output projections, q and k norms and the SwiGLU MLP (hidden 8 d / 3), the final norm."""
    hidden = 8 * d // 3
    block = 2 * d + 3 * H * hd * d + H * hd * d + 2 * hd + 2 * hidden * d + hidden * d
    return V * d + L * block + d


def tiny_model(**kw):
    cfg = GPTConfig.preset("gpt2-small", block_size=16, **{**TINY, **kw})
    return GPT(cfg), cfg


def table_cells(text):
    """[{header: cell}] of the markdown table in text (a header's second use gets ' 2' appended)."""
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    lines = [line for line in text.splitlines() if line.startswith("|")]
    head = []
    for h in split(lines[0]):
        head.append(h + " 2" if h in head else h)
    return [dict(zip(head, split(line))) for line in lines[2:]]


@pytest.fixture
def dynamo(monkeypatch):
    """A stand-in for torch._dynamo (its import alone takes seconds): counts its resets."""
    fake = types.SimpleNamespace(resets=0, utils=types.SimpleNamespace(counters={"inductor": {}}))
    fake.reset = lambda: setattr(fake, "resets", fake.resets + 1)
    fake.utils.counters["inductor"]["cudagraph_skips"] = 0
    monkeypatch.setitem(vars(torch), "_dynamo", fake)
    return fake


class Clock:
    """Stand-in for common.Span: each span that ends without an error lasts the next of `seconds`."""

    def __init__(self, seconds):
        self.left = list(seconds)

    def __call__(self, cuda=False):
        clock = self

        class Tick:
            def __enter__(self):
                return self

            def __exit__(self, kind, *_):
                if kind is None:
                    self.seconds = self.cpu_seconds = clock.left.pop(0)

        return Tick()


# --- the flags of row_parser, as parse_row_flags and the specs take them ----------------------------------


def test_row_flags_parse_lists_batches_and_literal_overrides(monkeypatch):
    run = planned(monkeypatch, bench_train, "--models", "gpt2-small,,gpt2-medium", "--variants",
                  "ddl,additive,ddl-cc", "--batches", "8,32,8,16", "--seq", "48", "--warmup", "4", "--steps",
                  "6", "--compile", "0", "--ddl-backend", "torch", "--time-limit", "77", "--out", "D",
                  "--model-overrides", "n_layer=2,ddl_ec=False,dropout=0.1,residual=ddl-tc")  # fmt: skip
    a = run.args
    assert a.models == ["gpt2-small", "gpt2-medium"] and a.variants == ["additive", "ddl", "ddl-cc"]
    assert a.batches == [32, 16, 8]  # largest first, once each
    assert a.model_overrides == dict(n_layer=2, ddl_ec=False, dropout=0.1, residual="ddl-tc")
    got = (a.seq, a.warmup, a.steps, a.compile, a.ddl_backend, a.time_limit, a.out)
    assert got == (48, 4, 6, 0, "torch", 77.0, "D")
    # every (model, variant), model by model, additive first; the settings say what was run
    assert labels(run.specs) == [(m, v) for m in a.models for v in a.variants]
    assert "seq 48" in run.settings and "4 warm-up" in run.settings and "6 timed steps" in run.settings
    assert "eager" in run.settings and "torch.compile" not in run.settings
    assert a.command.startswith("python bench/bench_train.py --device cpu --models")
    # additive is added first where missing; it is the baseline of every ratio
    variants = planned(monkeypatch, bench_train, "--variants", "ddl-cc,ddl").args.variants
    assert variants == ["additive", "ddl-cc", "ddl"]
    assert "torch.compile" in planned(monkeypatch, bench_train, "--variants", "ddl").settings


def test_row_flags_refusals(monkeypatch, capsys):
    for bad in ("0", "x", "", "-1,4", "4,0"):
        assert "--batches" in refused(monkeypatch, capsys, bench_train, f"--batches={bad}"), bad
        assert "expected positive integers" in refused(monkeypatch, capsys, bench_infer, f"--batches={bad}")
    assert planned(monkeypatch, bench_train, "--batches", "1").args.batches == [1]  # the least accepted
    msg = refused(monkeypatch, capsys, bench_train, "--variants", "ddl,ddl-xx")
    assert "--variants: unknown variant 'ddl-xx'" in msg
    msg = refused(monkeypatch, capsys, bench_infer, "--variants", "ddl-cc+keep1")  # bench_train's only
    assert "--variants: unknown variant 'ddl-cc+keep1'" in msg
    assert "invalid choice: 'cuda'" in refused(monkeypatch, capsys, bench_train, "--ddl-backend", "cuda")
    assert "--steps 0: expected at least one" in refused(monkeypatch, capsys, bench_train, "--steps", "0")
    assert planned(monkeypatch, bench_infer, "--steps", "1").args.steps == 1
    msg = refused(monkeypatch, capsys, bench_infer, "--model-overrides", "n_layer=1,n_embd")
    assert "--model-overrides: expected KEY=VALUE pairs like n_layer=2, got 'n_embd'" in msg
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = refused(monkeypatch, capsys, bench_train, "--device", "cuda")  # the last --device wins
    assert "bench_train.py needs a CUDA GPU (or --device cpu" in msg


def test_gpt_takes_the_size_seq_overrides_device_and_backend(monkeypatch):
    """--models picks the preset, --seq its block_size, the variant's overrides then --model-overrides on
    top; --device places it; --ddl-backend fixes what backend='auto' means (auto: left to the rule)."""
    monkeypatch.setattr(ops.common, "_auto_backend", None)
    small = dict(n_embd=32, n_head=2, head_dim=16, vocab_size=64)
    args = argparse.Namespace(ddl_backend="auto", seq=24, device="meta", model_overrides=dict(small))
    model, cfg = common.gpt(args, "gpt2-medium", dict(residual="ddl-cc", ddl_ec=False))
    got = (cfg.n_layer, cfg.block_size, cfg.residual, cfg.ddl_ec, cfg.n_embd)
    assert got == (24, 24, "ddl-cc", False, 32)
    assert next(model.parameters()).device.type == "meta" and ops.common._auto_backend is None
    args.model_overrides = dict(small, n_layer=1, residual="ddl")
    _, cfg = common.gpt(args, "gpt2-small", dict(residual="ddl-cc", ddl_ec=False))
    assert (cfg.n_layer, cfg.residual, cfg.ddl_ec) == (1, "ddl", False)  # --model-overrides last
    args.ddl_backend = "torch"
    common.gpt(args, "gpt2-small", {})
    assert ops.common._auto_backend == "torch"


def test_run_rows_passes_the_time_limit_and_saves_each_row_to_out(monkeypatch, tmp_path):
    """run_rows: each spec pickled with args for `SCRIPT --job FILE`; --time-limit bounds the queue, the job
    timeout each row, --parallel the slots; the row the worker wrote (or why there is none) lands in --out's
    NAME.json and NAME.md, in spec order; without --out nothing is written."""
    seen = {}

    def run_commands(jobs, slots, time_limit, job_timeout, min_left, on_end, poll_s):
        seen.update(slots=slots, time_limit=time_limit, job_timeout=job_timeout, min_left=min_left)
        for job in reversed(jobs):  # the last ends first
            assert job["cmd"][:3] == [sys.executable, "bench/bench_x.py", "--job"]
            with open(job["cmd"][-1], "rb") as f:
                spec = pickle.load(f)
            assert spec["args"].time_limit == 123.0 and spec["extra"] == job["i"]
            if job["i"] == 1:
                job.update(status="not run: time limit")
            else:
                common.write_json(job["cmd"][-1] + ".json", dict(spec["row"], tok_s=10.0 * (job["i"] + 1)))
                job.update(status="exit 0", slot=slots[0])
            on_end(job)
        return jobs

    monkeypatch.setattr(common, "run_commands", run_commands)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(command="python bench/bench_x.py", time_limit=123.0, out=str(tmp_path / "o"))
    specs = [dict(row=dict(model="m", variant=v), extra=i) for i, v in enumerate(("a", "b", "c"))]
    tables = lambda rows: [" ".join(f"{r['variant']}:{r.get('tok_s', r.get('error'))}" for r in rows)]
    common.run_rows(args, "bench/bench_x.py", specs, "SETTINGS", tables, job_timeout=45, parallel=3)
    assert [seen[k] for k in ("time_limit", "job_timeout", "min_left")] == [123.0, 45, 30]
    assert len(seen["slots"]) == 3
    run = json.loads((tmp_path / "o" / "bench_x.json").read_text())
    assert run["settings"] == "SETTINGS" and [r["variant"] for r in run["rows"]] == ["a", "b", "c"]
    assert run["rows"][1]["error"] == "not run: --time-limit reached" and run["rows"][2]["tok_s"] == 30.0
    md = (tmp_path / "o" / "bench_x.md").read_text()
    assert md.endswith("a:10.0 b:not run: --time-limit reached c:30.0\n") and "SETTINGS" in md
    args.out = ""
    common.run_rows(args, "bench/bench_x.py", specs, "SETTINGS", tables, job_timeout=45)
    assert len(seen["slots"]) == 1 and sorted(os.listdir(tmp_path)) == ["o"]


def test_job_main_runs_the_worker_on_its_job_file(monkeypatch, tmp_path):
    """`SCRIPT --job FILE`: the worker fills a copy of the job's row, an exception becomes its error."""
    path = str(tmp_path / "0.pkl")
    with open(path, "wb") as f:
        pickle.dump(dict(row=dict(model="m", variant="v"), n=3), f)

    def worker(job, row):
        row["n"] = job["n"]
        if job["n"] == 3:
            raise RuntimeError("out of luck")

    monkeypatch.setattr(sys, "argv", ["bench/bench_x.py"])
    assert common.job_main(worker) is False and not os.path.exists(path + ".json")  # not a row's process
    monkeypatch.setattr(sys, "argv", ["bench/bench_x.py", "--job", path])
    assert common.job_main(worker) is True
    assert json.loads(open(path + ".json").read()) == dict(model="m", variant="v", n=3,
                                                            error="RuntimeError: out of luck")  # fmt: skip


def test_largest_batch_falls_back_after_each_out_of_memory(dynamo):
    tried, row = [], {}

    def measure(B):
        tried.append(B)
        if B > 8:
            raise torch.OutOfMemoryError("no room")
        return B

    assert common.largest_batch([32, 16, 8, 4], row, measure) == 8
    assert tried == [32, 16, 8] and row["oom_batches"] == [32, 16] and dynamo.resets == 2
    with pytest.raises(RuntimeError, match=r"no micro-batch of \[64\] fits"):
        common.largest_batch([64], {}, measure)


# --- bench_train.py ---------------------------------------------------------------------------------------


def test_train_flags_select_rows(monkeypatch, tmp_path):
    """--accum, --profile*, --nanogpt (adds its row) and --against (each variant but additive also on the
    other checkout, just before this one's) as main() hands them on; each refusal refused."""
    (tmp_path / "nano.py").write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.py").write_text("")
    other = str(tmp_path / "other" / ".." / "other")
    run = planned(monkeypatch, bench_train, "--models", "gpt2-small", "--variants", "ddl", "--accum", "3",
                  "--profile", "--profile-steps", "2", "--profile-top", "7", "--nanogpt",
                  str(tmp_path / "nano.py"), "--against", other)  # fmt: skip
    a = run.args
    assert (a.accum, a.profile, a.profile_steps, a.profile_top) == (3, True, 2, 7)
    assert a.against == str(tmp_path / "other") and run.job_timeout == bench_train.JOB_TIMEOUT
    got = [(s["row"]["variant"], s["variant"], s["against"]) for s in run.specs]
    # nanoGPT's model is the same on both checkouts: one row
    want = [("additive", "additive", False), ("ddl@against", "ddl", True), ("ddl", "ddl", False)]
    assert got == want + [("nanogpt", "nanogpt", False)]
    assert "of 3 micro-batch(es)" in run.settings
    plain = planned(monkeypatch, bench_train, "--variants", "ddl")
    assert (plain.args.accum, plain.args.profile, plain.args.against) == (1, False, "")
    assert [s["against"] for s in plain.specs] == [False] * 4  # 2 models x (additive, ddl)
    assert planned(monkeypatch, bench_train, "--accum", "1").args.accum == 1  # the least accepted
    # by default every variant but nanoGPT's, whose row needs --nanogpt
    default = planned(monkeypatch, bench_train).args.variants
    assert default == [v for v in bench_train.VARIANTS if v != "nanogpt"] and default[0] == "additive"


def test_doc_mask_adds_each_variants_masked_row_right_after_it(monkeypatch, tmp_path):
    """--doc-mask: each variant's row VARIANT+doc_mask (doc_mask in its spec) right after its own, with
    --against's row just before each; none for nanoGPT's GPT (no such switch); the settings say the batches
    are documents of mean length DOC_LEN. Without the flag no row is masked and the batches are plain."""
    (tmp_path / "nano.py").write_text("")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.py").write_text("")
    flags = ["--models", "gpt2-small", "--nanogpt", str(tmp_path / "nano.py"), "--doc-mask"]
    flags += ["--against", str(tmp_path / "other")]
    run = planned(monkeypatch, bench_train, "--variants", "ddl,additive+deltaformer", *flags)
    got = [(s["row"]["variant"], s["variant"], s["against"], s["doc_mask"]) for s in run.specs]
    assert got == [
        ("additive", "additive", False, False), ("additive+doc_mask", "additive", False, True),
        ("ddl@against", "ddl", True, False), ("ddl", "ddl", False, False),
        ("ddl+doc_mask@against", "ddl", True, True), ("ddl+doc_mask", "ddl", False, True),
        ("additive+deltaformer@against", "additive+deltaformer", True, False),
        ("additive+deltaformer", "additive+deltaformer", False, False),
        ("additive+deltaformer+doc_mask@against", "additive+deltaformer", True, True),
        ("additive+deltaformer+doc_mask", "additive+deltaformer", False, True),
        ("nanogpt", "nanogpt", False, False),
    ]  # fmt: skip
    assert run.args.doc_mask and f"lengths geometric, mean {bench_train.DOC_LEN}" in run.settings
    assert "×unmasked" in run.settings
    plain = planned(monkeypatch, bench_train, "--variants", "ddl")
    assert not plain.args.doc_mask and not any(s["doc_mask"] for s in plain.specs)
    assert "documents" not in plain.settings and "×unmasked" not in plain.settings
    assert all("+doc_mask" not in s["row"]["variant"] for s in plain.specs)


def test_doc_mask_reaches_the_models_config(monkeypatch, dynamo):
    """The worker builds a masked row's model with GPTConfig.doc_mask on top of its variant's overrides, an
    unmasked row's without it (so a checkout of --against that lacks the field still runs those)."""
    dynamo.config = types.SimpleNamespace()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # the worker sets both
    built, passed = [], []
    monkeypatch.setattr(bench_train, "measure", lambda model, cfg, B, args, row: built.append((cfg, B)))
    monkeypatch.setattr(common, "largest_batch", lambda batches, row, measure, reset: measure(batches[0]))
    real_gpt = common.gpt
    monkeypatch.setattr(
        common, "gpt", lambda args, size, o: passed.append(dict(o)) or real_gpt(args, size, o)
    )
    args = argparse.Namespace(ddl_backend="auto", seq=16, device="cpu", model_overrides=dict(TINY, n_layer=1),
                              batches=[3], nanogpt="", against="")  # fmt: skip
    try:
        for doc_mask in (True, False):
            row = dict(model="gpt2-small", variant="ddl-cc" + "+doc_mask" * doc_mask)
            bench_train.worker(dict(args=args, variant="ddl-cc", against=False, doc_mask=doc_mask), row)
            cfg, B = built[-1]
            assert (cfg.doc_mask, cfg.residual, cfg.block_size, B) == (doc_mask, "ddl-cc", 16, 3)
            assert row["params_M"] > 0
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert passed == [dict(residual="ddl-cc", doc_mask=True), dict(residual="ddl-cc")]
    assert bench_train.VARIANTS["ddl-cc"] == dict(residual="ddl-cc")  # the table itself untouched


def test_train_flags_refusals(monkeypatch, capsys, tmp_path):
    msg = refused(monkeypatch, capsys, bench_train, "--accum", "0")
    assert "--accum 0: expected a positive number of micro-batches" in msg
    msg = refused(monkeypatch, capsys, bench_train, "--variants", "nanogpt")  # its row, without its file
    assert "--nanogpt: the row 'nanogpt' needs nanoGPT's model.py, got ''" in msg
    msg = refused(monkeypatch, capsys, bench_train, "--nanogpt", str(tmp_path / "missing.py"))
    assert "--nanogpt: the row 'nanogpt' needs" in msg
    msg = refused(monkeypatch, capsys, bench_train, "--against", str(tmp_path))  # no model.py there
    assert "--against: expected a checkout of this repo" in msg
    msg = refused(monkeypatch, capsys, bench_train, "--doc-mask", "--model-overrides", "vocab_size=50256")
    assert "--doc-mask: documents start with EOT (50256), which needs vocab_size > 50256, got 50256" in msg
    assert planned(monkeypatch, bench_train, "--doc-mask", "--model-overrides", "vocab_size=50257").specs
    msg = refused(monkeypatch, capsys, bench_train, "--doc-mask", "--model-overrides", "doc_mask=False")
    assert "--doc-mask: leave doc_mask out of --model-overrides" in msg


def fake_steps(times):
    """A stand-in for bench_train.train_steps: records each call, each step lasts the next of times, and
    the host's four parts of step i last i, 2 i, 3 i, 4 i ms."""
    calls, left = [], list(times)

    def train_steps(model, opt, B, T, steps, vocab, device, host=None, accum=1, doc_len=0, gen=None):
        timed = host is not None
        calls.append(dict(B=B, T=T, steps=steps, vocab=vocab, device=device, accum=accum, timed=timed,
                          doc_len=doc_len, gen=gen))  # fmt: skip
        if host is not None:
            host += [[i * k / 1e3 for k in (1, 2, 3, 4)] for i in range(1, steps + 1)]
        return [left.pop(0) for _ in range(steps)] if host is not None else [0.0] * steps

    return calls, train_steps


def test_measure_tokens_per_second_mfu_and_steps(monkeypatch):
    """tokens/s = micro-batch x --accum x --seq / the median timed step; MFU = tokens/s x 6 N + 12 L H D T
    (N counted from the tiny model's layers) / 989 TFLOP/s; --warmup steps before (the first compiles),
    --steps timed; --compile compiles once with static shapes; --profile profiles after."""
    model, cfg = tiny_model()
    times = [0.30, 0.10, 0.20, 0.50, 0.40]
    calls, steps = fake_steps(times)
    compiled, profiled = [], []
    monkeypatch.setattr(bench_train, "train_steps", steps)
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append((m, kw)) or m)
    monkeypatch.setattr(bench_train, "profile_step", lambda run, B, args, row: profiled.append((B, args)))
    opts = []  # (the optimizer's settings; AdamW itself would import torch._dynamo: seconds)
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: opts.append(kw))
    args = argparse.Namespace(compile=1, device="cpu", warmup=3, steps=5, seq=16, accum=2, profile=False,
                              doc_mask=True)  # fmt: skip
    row = dict(model="gpt2-small", variant="additive")
    bench_train.measure(model, cfg, 4, args, row)
    assert compiled == [(model, dict(dynamic=False))] and profiled == []
    assert opts == [dict(lr=1e-4, weight_decay=0.1, fused=False)]  # fused on CUDA only
    assert [(c["steps"], c["timed"]) for c in calls] == [(1, False), (2, False), (5, True)]
    assert all((c["B"], c["T"], c["accum"], c["vocab"]) == (4, 16, 2, 64) for c in calls)
    # --doc-mask: documents in every step's batches, from one generator that the three calls go on drawing
    assert all(c["doc_len"] == bench_train.DOC_LEN and c["gen"] is calls[0]["gen"] for c in calls)
    assert isinstance(calls[0]["gen"], torch.Generator)
    step = 0.30  # the median of times
    assert row["batch"] == 4 and math.isclose(row["step_ms"], 1e3 * step)
    assert (row["step_ms_min"], row["step_ms_max"]) == pytest.approx((100.0, 500.0))
    assert math.isclose(row["tok_s"], 4 * 2 * 16 / step)
    n = tiny_params(32, 64, 1, 2, 16)
    assert math.isclose(row["mfu"], row["tok_s"] * (6 * n + 12 * 1 * 2 * 16 * 16) / 989e12, rel_tol=1e-12)
    assert row["host_ms"] == [3.0, 6.0, 9.0, 12.0]  # each part's median over the 5 timed steps, ms
    assert math.isnan(row["peak_GB"])  # no CUDA: no peak memory
    calls.clear()
    args = argparse.Namespace(compile=0, device="cpu", warmup=1, steps=1, seq=8, accum=1, profile=True,
                              doc_mask=False)  # fmt: skip
    steps_left = fake_steps([0.25])[1]
    # (steps, doc_len) of each call: no documents without --doc-mask
    record = lambda *a, **k: calls.append((a[4], a[9])) or steps_left(*a, **k)  # noqa: E731
    monkeypatch.setattr(bench_train, "train_steps", record)
    bench_train.measure(model, cfg, 2, args, row)
    assert len(compiled) == 1 and calls == [(1, 0), (0, 0), (1, 0)] and profiled == [(2, args)]
    assert math.isclose(row["tok_s"], 2 * 8 / 0.25)


def test_profile_step_times_per_step_and_top(monkeypatch, capsys):
    """--profile-steps N: the profile covers N steps and reports ms per step (us / 1e3 / N) and calls per
    step; --profile-top K: the K largest kernels and host ops; the time by kind sums each kind's kernels."""
    kernels = [("sm90_xmma_gemm_bf16", 8000.0, 40), ("triton_poi_fused_add_0", 4000.0, 20),
               ("ddl_update_cc_fwd", 2000.0, 8), ("flash_fwd_kernel", 1200.0, 8), ("cutlass_gemm", 800.0, 4),
               ("weird", 400.0, 4)]  # fmt: skip
    host = [("aten::mm", 3000.0, 40), ("aten::add", 1000.0, 12), ("Optimizer.step", 800.0, 4)]
    ran = []

    def profiled(fn, cuda=True):
        fn()
        return kernels, host

    monkeypatch.setattr(common, "profiled", profiled)
    args = argparse.Namespace(profile_steps=4, profile_top=2, device="cpu")
    row = dict(model="gpt2-small", variant="ddl-cc", host_ms=[1.0, 2.0, 3.0, 0.5], step_ms=5.0)
    bench_train.profile_step(ran.append, 8, args, row)
    assert ran == [4]
    assert row["profile_top"] == [["sm90_xmma_gemm_bf16", 2.0, 10], ["triton_poi_fused_add_0", 1.0, 5]]
    assert row["profile_host_top"] == [["aten::mm", 0.75, 10], ["aten::add", 0.25, 3]]
    assert row["profile_kinds_ms"] == {"matmul": 2.2, "inductor (fused elementwise/reductions)": 1.0,
                                       "DDL kernels": 0.5, "attention": 0.3, "other": 0.1}  # fmt: skip
    out = capsys.readouterr().out
    assert "4 step(s), kernels busy 4.1 ms/step (timed step 5.0 ms)" in out
    assert "in 1.0 + 2.0 + 3.0 ms, then waited 0.5 ms" in out and "host: 1.2 ms/step of CPU time" in out
    assert f"{100 * 8800 / 16400:5.1f}%" in out  # matmul's share of the kernels' time


# --- bench_infer.py ---------------------------------------------------------------------------------------


def test_infer_flags_select_rows(monkeypatch):
    """--sections picks the sections, --models the forward rows', --decode-models the decode rows' models;
    --decode-batches (ascending), --decode-modes, --prompt, --new, --none-new reach the decode worker;
    --parallel the runner."""
    run = planned(monkeypatch, bench_infer, "--models", "gpt2-small,gpt2-medium", "--variants", "ddl",
                  "--decode-models", "gpt2-medium", "--decode-batches", "32,1,32", "--decode-modes",
                  "none,static", "--seq", "64", "--prompt", "8", "--new", "56", "--none-new", "5",
                  "--parallel", "3")  # fmt: skip
    a = run.args
    assert labels(run.specs) == [
        ("forward", "gpt2-small", "additive"), ("forward", "gpt2-small", "ddl"),
        ("forward", "gpt2-medium", "additive"), ("forward", "gpt2-medium", "ddl"),
        ("decode", "gpt2-medium", "additive"), ("decode", "gpt2-medium", "ddl"),
    ]  # fmt: skip
    assert (a.decode_batches, a.decode_modes, a.prompt, a.new, a.none_new) == ([1, 32], ["none", "static"], 8,
                                                                                56, 5)  # fmt: skip
    assert run.parallel == 3 and run.job_timeout == bench_infer.JOB_TIMEOUT
    assert "a prompt of 8 random tokens, then 56 new tokens ('none': 5)" in run.settings
    decode = planned(monkeypatch, bench_infer, "--sections", "decode", "--variants", "ddl")
    assert labels(decode.specs) == [("decode", "gpt2-small", v) for v in ("additive", "ddl")]  # its default
    only = planned(monkeypatch, bench_infer, "--sections", "forward", "--models", "gpt2-medium")
    assert {s["row"]["section"] for s in only.specs} == {"forward"} and only.parallel == 1
    assert {s["row"]["model"] for s in only.specs} == {"gpt2-medium"}
    # the bounds, each at its edge: prompt + new = --seq, one token each, one row at a time
    edge = planned(monkeypatch, bench_infer, "--seq", "16", "--prompt", "1", "--new", "15", "--none-new", "1",
                   "--parallel", "1")  # fmt: skip
    assert (edge.args.prompt, edge.args.new, edge.args.none_new, edge.parallel) == (1, 15, 1, 1)


def test_infer_flags_refusals(monkeypatch, capsys):
    for flags, message in [
        (["--sections", "train"], "--sections: expected some of forward, decode, got 'train'"),
        (["--sections", ","], "--sections: expected some of forward, decode, got ''"),
        (["--decode-modes", "cache,fast"], "--decode-modes: expected some of cache, static, compiled, none"),
        (["--decode-modes", ""], "--decode-modes: expected some of"),
        (["--decode-batches", "1,0"], "--decode-batches '1,0': expected positive integers"),
        (["--seq", "16", "--prompt", "4", "--new", "13"], "with prompt + new <= --seq 16"),
        (["--prompt", "0"], "--prompt, --new, --none-new: >= 1"),
        (["--new", "0"], "--prompt, --new, --none-new: >= 1"),
        (["--none-new", "0"], "--prompt, --new, --none-new: >= 1"),
        (["--parallel", "0"], "--parallel 0: expected a positive number of rows at a time"),
    ]:
        assert message in refused(monkeypatch, capsys, bench_infer, *flags), flags


def test_forward_row_tokens_per_second_mfu_and_calls(monkeypatch, dynamo):
    """The forward row: the largest micro-batch that fits (4 runs out of memory here), its first call
    (compiled with static shapes when --compile), --warmup calls, --steps timed calls; tokens/s = B x --seq /
    the median call; MFU = tokens/s x (6 N + 12 L H D T) / 3 / 989 TFLOP/s (the forward's third)."""
    model, cfg = tiny_model()
    calls, compiled = [], []

    def compile_(fn, **kw):
        compiled.append(kw)

        def run(idx):
            calls.append(tuple(idx.shape))
            if idx.shape[0] == 4:
                raise torch.OutOfMemoryError("no room")
            return fn(idx)

        return run

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(common, "Span", Clock([1.5, 0.02, 0.05, 0.03]))
    args = argparse.Namespace(device="cpu", compile=1, batches=[4, 2], seq=16, warmup=2, steps=3)
    row = dict(model="gpt2-small", variant="additive")
    with torch.no_grad():
        bench_infer.forward_row(model, cfg, args, row)
    assert compiled == [dict(dynamic=False)] * 2 and row["oom_batches"] == [4]
    assert calls == [(4, 16)] + [(2, 16)] * (1 + 2 + 3)
    assert row["batch"] == 2 and row["compile_s"] == 1.5 and math.isclose(row["step_ms"], 30.0)
    assert math.isclose(row["tok_s"], 2 * 16 / 0.03)
    n = tiny_params(32, 64, 1, 2, 16)
    assert math.isclose(row["mfu"], row["tok_s"] * (6 * n + 12 * 2 * 16 * 16) / 3 / 989e12, rel_tol=1e-12)
    monkeypatch.setattr(common, "Span", Clock([1.0, 0.5]))
    args = argparse.Namespace(device="cpu", compile=0, batches=[3], seq=8, warmup=0, steps=1)
    with torch.no_grad():
        bench_infer.forward_row(model, cfg, args, row)
    assert len(compiled) == 2 and row["batch"] == 3 and math.isclose(row["tok_s"], 3 * 8 / 0.5)


def test_decode_row_tokens_per_second_runs_and_cache_size(monkeypatch, dynamo):
    """Each --decode-batches x --decode-modes entry: a warm-up of min(new, 8) tokens, then up to 3 timed
    runs (fewer once they pass 2 s); tokens/s = batch x new tokens / the median run, ms/token its inverse per
    row; 'none' makes --none-new tokens. Cache KB per token and sequence: keys and values of every layer."""
    model, cfg = tiny_model()
    model.eval()
    seen = []

    def generate(model, prompt, n, top_k=None, decode="cache"):
        seen.append((prompt.shape, n, top_k, decode))
        return torch.zeros(prompt.shape[0], prompt.shape[1] + n, dtype=torch.long)

    monkeypatch.setattr(sample, "generate", generate)
    counted = []  # the ops column: ops_per_layer of the row's model at 1 and 2 blocks (test_decode_ops.py)

    def ops_per_layer(make, prompt):
        counted.append((make(1).config.n_layer, make(2).config.n_layer, make(1).config.n_embd, prompt.shape))
        return collections.Counter({"aten.mm": 4, "aten.add": 3})

    monkeypatch.setattr(bench_infer, "ops_per_layer", ops_per_layer)
    runs = {(1, "cache"): [0.1, 0.3, 0.2], (1, "none"): [1.5, 1.0], (2, "cache"): [0.4, 0.4, 0.1],
            (2, "none"): [0.5, 0.6, 0.7]}  # fmt: skip
    monkeypatch.setattr(common, "Span", Clock([x for key in runs for x in [9.0, *runs[key]]]))
    args = argparse.Namespace(device="cpu", decode_batches=[1, 2], decode_modes=["cache", "none"], prompt=4,
                              new=10, none_new=3)  # fmt: skip
    row = {}
    with torch.no_grad():
        bench_infer.decode_row(model, cfg, args, row)
    assert [(B, n, mode) for (B, _), n, _, mode in seen] == [
        (B, n, mode) for B in (1, 2) for mode, new in (("cache", 10), ("none", 3))
        for n in [min(new, 8)] + [new] * len(runs[B, mode])
    ]  # fmt: skip
    assert all(shape == (shape[0], 4) and top_k == 1 for shape, _, top_k, _ in seen)
    assert counted == [(1, 2, cfg.n_embd, (1, 4))]
    assert row["ops_layer"] == 7 and row["ops_layer_by_op"] == {"aten.mm": 4, "aten.add": 3}
    kv = 1 * 2 * 2 * 16 * 4 / 1e3  # layers x (keys, values) x heads x head_dim x fp32 bytes, in KB
    for d, ((B, mode), times) in zip(row["decode"], runs.items(), strict=True):
        new = 3 if mode == "none" else 10
        assert (d["batch"], d["mode"], d["new"], d["runs"], d["first_s"]) == (B, mode, new, len(times), 9.0)
        assert math.isclose(d["tok_s"], B * new / statistics.median(times)), d
        assert math.isclose(d["ms_token"], 1e3 * statistics.median(times) / new), d
        assert math.isclose(d["kb_token"], kv) and d["kb_fixed"] == 0.0 and "error" not in d


# --- the tables -------------------------------------------------------------------------------------------


def test_throughput_table_ratios_against_the_same_models_additive():
    """×additive: tokens/s over additive's of the same model (not another model's); peak memory's only at the
    same micro-batch; MFU in %; a row without a result says why."""
    rows = [
        dict(model="s", variant="additive", batch=32, tok_s=1000.0, step_ms=20.0, peak_GB=10.0, mfu=0.4),
        dict(model="m", variant="additive", batch=16, tok_s=400.0, step_ms=50.0, peak_GB=30.0, mfu=0.41),
        dict(model="s", variant="ddl", batch=32, tok_s=800.0, step_ms=25.0, peak_GB=12.5, mfu=0.33,
             compile_s=12.5),
        dict(model="m", variant="ddl", batch=8, tok_s=300.0, step_ms=30.0, peak_GB=24.0, mfu=0.3),
        dict(model="m", variant="ddl-cc", error="RuntimeError: no micro-batch of [8] fits"),
        dict(model="x", variant="ddl", batch=8, tok_s=5.0, step_ms=1.0, peak_GB=1.0, mfu=0.01),
    ]  # fmt: skip
    cells = table_cells(common.throughput_table(rows))
    got = {(c["model"], c["variant"]): c for c in cells}
    assert [float(got[k]["×additive"]) for k in (("s", "ddl"), ("m", "ddl"))] == [0.8, 0.75]
    assert got["s", "ddl"]["×additive 2"] == "1.250"
    assert got["m", "ddl"]["×additive 2"] == "-"  # their micro-batches differ
    assert got["x", "ddl"]["×additive"] == "-"  # no additive of that model in the run
    assert got["s", "additive"]["×additive"] == "1.000" and got["m", "additive"]["×additive 2"] == "1.000"
    s = got["s", "ddl"]
    heads = ("micro-batch", "tokens/s", "step ms", "peak GB", "MFU", "compile s")
    assert [s[h] for h in heads] == ["32", "800", "25.0", "12.5", "33.0%", "12.5"]
    assert got["m", "ddl-cc"]["micro-batch"] == "not measured: RuntimeError: no micro-batch of [8] fits"
    assert got["m", "ddl"]["compile s"] == "-" and len(cells) == len(rows)


def test_throughput_table_unmasked_ratio_is_against_the_same_variant_and_model():
    """×unmasked: a +doc_mask row's tokens/s over its own variant's unmasked row of the same model (also
    @against's); "-" where that row is missing, empty on unmasked rows; ×additive of a masked row against
    additive+doc_mask. A table without masked rows has no such column."""

    def r(model, variant, tok_s, peak_GB=10.0):
        return dict(model=model, variant=variant, batch=8, tok_s=tok_s, step_ms=1.0, peak_GB=peak_GB, mfu=0.1)

    rows = [
        r("s", "additive", 1000.0), r("s", "additive+doc_mask", 960.0, 10.5), r("s", "ddl", 800.0),
        r("s", "ddl+doc_mask", 780.0, 12.0), r("s", "ddl-cc", 600.0), r("s", "ddl-cc+doc_mask", 570.0),
        r("s", "ddl-cc@against", 500.0), r("s", "ddl-cc+doc_mask@against", 450.0),
        r("m", "additive", 400.0), r("m", "ddl", 300.0), r("m", "ddl+doc_mask", 270.0),
        r("m", "ddl-tc+doc_mask", 100.0),  # its unmasked row not measured
        dict(model="m", variant="ddl-cc+doc_mask", error="RuntimeError: boom"),
    ]  # fmt: skip
    got = {(c["model"], c["variant"]): c for c in table_cells(common.throughput_table(rows))}
    unmasked = {k: c["×unmasked"] for k, c in got.items() if "+doc_mask" in k[1] and c["tokens/s"]}
    assert unmasked == {
        ("s", "additive+doc_mask"): "0.960", ("s", "ddl+doc_mask"): f"{780 / 800:.3f}",
        ("s", "ddl-cc+doc_mask"): "0.950", ("s", "ddl-cc+doc_mask@against"): "0.900",
        ("m", "ddl+doc_mask"): "0.900", ("m", "ddl-tc+doc_mask"): "-",
    }  # fmt: skip
    assert all(got[k]["×unmasked"] == "" for k in got if "+doc_mask" not in k[1])
    assert got["s", "ddl+doc_mask"]["×additive"] == f"{780 / 960:.3f}"  # against additive+doc_mask
    assert got["s", "ddl+doc_mask"]["×additive 2"] == f"{12.0 / 10.5:.3f}"
    assert got["s", "ddl"]["×additive"] == "0.800" and got["m", "ddl+doc_mask"]["×additive"] == "-"
    assert got["m", "ddl-cc+doc_mask"]["micro-batch"] == "not measured: RuntimeError: boom"
    assert len(got["m", "ddl-cc+doc_mask"]) == len(got["s", "ddl"]) == 11
    assert "×unmasked" not in common.throughput_table([r("s", "additive", 1.0), r("s", "ddl", 1.0)])


def test_decode_table_ratios_against_additive_cache_and_none():
    """The decode table: ×additive against additive at the same model, batch and mode; ×cache and ×none
    against the same variant's modes; the forward rows go through throughput_table."""

    def e(B, mode, tok):
        new = 2 if mode == "none" else 6
        return dict(batch=B, mode=mode, new=new, tok_s=tok, ms_token=1e3 / tok, peak_GB=0.5, kb_token=1.25,
                    kb_fixed=0.0, first_s=3.0)  # fmt: skip

    rows = [
        dict(section="forward", model="s", variant="additive", batch=2, tok_s=100.0, step_ms=1.0, peak_GB=1.0,
             mfu=0.1),
        dict(section="forward", model="s", variant="ddl", batch=2, tok_s=90.0, step_ms=1.0, peak_GB=1.0,
             mfu=0.1),
        dict(section="decode", model="s", variant="additive",
             decode=[e(1, "cache", 50.0), e(1, "none", 10.0), e(4, "cache", 160.0), e(4, "none", 20.0)]),
        dict(section="decode", model="s", variant="ddl",
             decode=[e(1, "cache", 40.0), e(1, "none", 8.0), e(4, "cache", 120.0), e(4, "none", 30.0),
                     dict(batch=4, mode="static", new=6, error="RuntimeError: boom")]),
        dict(section="decode", model="s", variant="ddl-tc", error="worker exit 1, no result"),
    ]  # fmt: skip
    fwd_text, dec_text = bench_infer.tables(rows)[2], bench_infer.tables(rows)[6]
    assert float(table_cells(fwd_text)[1]["×additive"]) == 0.9
    dec = {(c["variant"], c["batch"], c["decode"]): c for c in table_cells(dec_text)}
    ratios = lambda key: [dec[key][h] for h in ("×additive", "×cache", "×none")]  # noqa: E731
    assert ratios(("ddl", "4", "cache")) == ["0.750", "1.000", "4.000"]
    assert ratios(("ddl", "4", "none")) == [f"{30 / 20:.3f}", "0.250", "1.000"]
    assert ratios(("ddl", "1", "none")) == ["0.800", "0.200", "1.000"]
    assert ratios(("additive", "1", "cache")) == ["1.000", "1.000", "5.000"]
    d = dec["ddl", "4", "cache"]
    assert (d["new tokens"], d["tokens/s"], d["ms/token"], d["first call s"]) == ("6", "120.0", "8.33", "3.0")
    assert dec["ddl", "4", "static"]["new tokens"] == "not measured: RuntimeError: boom"
    assert dec["ddl-tc", "", ""]["new tokens"] == "not measured: worker exit 1, no result"
