"""bench/bench_quality.py (the run commands, the flags, the table) and data/package_corpus.py (the corpus)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from train_inline import run_train

from bench import bench_quality as bq
from data import package_corpus


def write_run(top, setting, name, vals, done=True):
    d = os.path.join(top, setting, name)
    os.makedirs(d)
    with open(os.path.join(d, "log.jsonl"), "w") as f:
        for it, v in vals:
            f.write(json.dumps({"iter": it, "train_loss": 9.0}) + "\n")
            f.write(json.dumps({"iter": it, "val_loss": v}) + "\n")
    with open(os.path.join(d, "train.out"), "w") as f:
        f.write("done: 3 iterations\n" if done else "Traceback\n")


def test_table_means_spreads_and_baseline(tmp_path):
    top = str(tmp_path)
    write_run(top, "shakespeare", "additive-s1", [(0, 5.0), (1, 4.0), (2, 4.2)])
    write_run(top, "shakespeare", "additive-s2", [(0, 5.0), (1, 4.4), (2, 4.6)])
    write_run(top, "shakespeare", "ddl-cc-s1", [(0, 5.0), (1, 3.9)])
    write_run(top, "shakespeare", "ddl-cc-s2", [(0, 5.0), (1, float("nan"))], done=False)
    lines = {line.split(" | ")[0].strip("| "): line for line in bq.table([top]).splitlines() if "|" in line}
    # additive: best 4.0 and 4.4 -> 4.2 ± 0.2; final 4.2 and 4.6 -> 4.4 ± 0.2
    assert "4.2000 ± 0.2000 | 4.4000 ± 0.2000 | +0.0000 | ok" in lines["additive"]
    # ddl-cc: bests 3.9 and 5.0 (the finite minimum of a run that went NaN) -> 4.45 ± 0.55, 0.25 above
    # additive; finals 3.9 and NaN -> 3.9 over the finite one; the NaN run is marked
    assert "| 4.4500 ± 0.5500 | 3.9000 | +0.2500 |" in lines["ddl-cc"]
    assert "s2 cut short at iter 2" in lines["ddl-cc"]  # no error line: killed
    write_run(top, "corpus", "ddl-s1", [(0, 5.0), (1, 3.5)])  # a setting without its additive run
    assert "| ddl | 1 | 3.5000 | 3.5000 | — | ok |" in bq.table([top])


def test_table_of_a_setting_folder_and_of_nothing(tmp_path, capsys):
    """--table takes the --out folder or one setting's folder (same table); a folder without runs is an
    error naming it, not an empty table."""
    top = str(tmp_path / "out")
    write_run(top, "corpus", "additive-s2", [(0, 5.0), (1, 4.0)])
    write_run(top, "corpus", "ddl-s2", [(0, 5.0), (1, 3.5)])
    assert bq.table([os.path.join(top, "corpus")]) == bq.table([top])
    assert "| ddl | 2 | 3.5000 | 3.5000 | -0.5000 | ok |" in bq.table([os.path.join(top, "corpus") + "/"])
    with pytest.raises(ValueError, match="no runs"):
        bq.table([str(tmp_path)])
    with pytest.raises(SystemExit):
        bq.main(["--table", str(tmp_path / "empty")])
    assert "no runs" in capsys.readouterr().err
    bq.main(["--table", os.path.join(top, "corpus")])
    assert "| additive | 2 |" in capsys.readouterr().out
    assert "| ddl | 2 |" in open(os.path.join(top, "corpus", "quality.md")).read()


@pytest.mark.parametrize(
    "setting,row",
    [("shakespeare", "ddl-cc-write-only"), ("corpus", "ddl-cc-bf16-state"), ("corpus", "ddl-cc-doc-mask")],
)
def test_run_args_are_train_config_keys(setting, row, tmp_path):
    """train.py accepts every key a run passes (its --dry_run resolves the config and exits; run in this
    process by train_inline)."""
    cmd = bq.run_args(setting, row, 7, str(tmp_path / "run"), data_dir=str(tmp_path), extra=["dry_run=True"])
    assert cmd[:2] == [sys.executable, os.path.join(bq.REPO, "train.py")]
    code, out, err, _ = run_train(*cmd[2:], "--device=cpu", "--compile=False")
    assert code == 0, out + err
    for key, value in {**bq.SETTINGS[setting], **bq.ROWS[row], "seed": 7}.items():
        if key != "compile":
            assert f"{key} = {value!r}" in out, key


def test_package_corpus_is_deterministic_deduplicated_and_capped(tmp_path):
    root = tmp_path / "site"
    (root / "b").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n" * 100)
    (root / "b" / "copy.py").write_text("x = 1\n" * 100)  # same bytes: dropped
    (root / "b" / "doc.md").write_text("# Title\n" + "words " * 100)
    (root / "b" / "tiny.txt").write_text("short")  # under 200 bytes: dropped
    (root / "b" / "bin.txt").write_bytes(b"\xff\xfe" * 200)  # not UTF-8: dropped
    (root / "b" / "data.json").write_text("{}" * 200)  # not a text suffix
    out = str(tmp_path / "c.jsonl")
    n, total = package_corpus.build([str(root)], out, max_mb=1)
    texts = [json.loads(line)["text"] for line in open(out)]
    assert n == 2 and texts == ["x = 1\n" * 100, "# Title\n" + "words " * 100]
    assert total == sum(len(t.encode()) for t in texts)
    n_capped, _ = package_corpus.build([str(root)], out, max_mb=1e-6)  # stops after the first file
    assert n_capped == 1


def test_package_corpus_shards_start_each_file_with_eot(tmp_path):
    """The corpus setting's data, made as the docstring says (package_corpus.py, then fineweb_edu.py
    --input): one document a file, each after an EOT, and no other EOT (a file's literal "<|endoftext|>" is
    text), so GPTConfig.doc_mask splits its rows at the files' boundaries."""
    from data.fineweb_edu import prepare
    from data.shards import read_shard
    from data.tokenizer import EOT, get_encoding

    root = tmp_path / "site"
    root.mkdir()
    texts = [
        "def f():\n    return 1\n" * 12,
        "# Notes\n<|endoftext|> is text here. " * 8,
        "x = [1, 2]\n" * 30,
    ]
    for i, text in enumerate(texts):
        (root / f"m{i}.py").write_text(text)
    corpus = str(tmp_path / "c.jsonl")
    assert package_corpus.build([str(root)], corpus, max_mb=1)[0] == 3
    out = str(tmp_path / "shards")
    paths = prepare(out, inputs=[corpus], shard_tokens=40, workers=1, progress=False)
    stream = np.concatenate([read_shard(p) for p in paths])
    lengths = [1 + len(get_encoding().encode_ordinary(t)) for t in texts]  # EOT + the file's tokens
    assert len(stream) == sum(lengths)
    assert np.flatnonzero(stream == EOT).tolist() == np.cumsum([0] + lengths[:-1]).tolist()


def test_doc_mask_rows_are_their_rows_with_the_mask_and_in_no_default(monkeypatch, tmp_path, capsys):
    """additive-doc-mask and ddl-cc-doc-mask: additive's and ddl-cc's overrides with doc_mask=True, the only
    rows with it, in no setting's default rows; the corpus command with them and their rows, 2 seeds, runs
    each with --doc_mask=True exactly where its name says, and tables them in ROWS' order."""
    for row, base in (("additive-doc-mask", "additive"), ("ddl-cc-doc-mask", "ddl-cc")):
        assert bq.ROWS[row] == {**bq.ROWS[base], "doc_mask": True}
    assert [r for r in bq.ROWS if "doc_mask" in bq.ROWS[r]] == ["additive-doc-mask", "ddl-cc-doc-mask"]
    assert not any("doc-mask" in r for rows in bq.DEFAULT_ROWS.values() for r in rows)
    launched = []

    def launch_all(jobs, parallel, on_finish):
        launched.extend(jobs)
        for i, (_, out_dir) in enumerate(jobs):
            write_run(os.path.dirname(os.path.dirname(out_dir)), "corpus", os.path.basename(out_dir),
                      [(0, 5.0), (1, 4.0 - i / 100)])  # fmt: skip

    monkeypatch.setattr(bq, "launch_all", launch_all)
    rows = ["ddl-cc-doc-mask", "additive", "ddl-cc", "additive-doc-mask"]
    bq.main(["--setting", "corpus", "--rows", *rows, "--seeds", "1", "2", "--out", str(tmp_path)])
    assert len(launched) == 8
    for cmd, out_dir in launched:
        keys = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
        row = os.path.basename(out_dir).rpartition("-s")[0]
        assert keys.get("doc_mask") == ("True" if row.endswith("-doc-mask") else None), cmd
        assert keys["residual"] == bq.ROWS[row]["residual"] and keys["dataset"] == "fineweb_edu"
    table = [line.split(" | ")[0].strip("| ") for line in capsys.readouterr().out.splitlines()]
    assert [r for r in table if r in bq.ROWS] == [
        "additive",
        "additive-doc-mask",
        "ddl-cc",
        "ddl-cc-doc-mask",
    ]


def test_launch_all_reports_each_finished_run(tmp_path):
    """on_finish runs after every job (the bench rewrites its table then, so a cut-short run keeps it); each
    run's checkpoint is removed when it ends."""
    seen = []
    code = "import sys; open(sys.argv[1] + '/ckpt.pt', 'w').write('x'); print(sys.argv[2])"
    jobs = [([sys.executable, "-c", code, str(tmp_path / f"run{i}"), str(i)], str(tmp_path / f"run{i}"))
            for i in range(3)]  # fmt: skip
    bq.launch_all(jobs, 2, on_finish=lambda: seen.append(len(seen)))
    assert seen == [0, 1, 2]
    assert [open(tmp_path / f"run{i}" / "train.out").read() for i in range(3)] == ["0\n", "1\n", "2\n"]
    assert not any((tmp_path / f"run{i}" / "ckpt.pt").exists() for i in range(3))  # removed: disk


def largest_rise(xs):
    """max over i <= j of xs[j] - xs[i]: the spike by its definition, over all pairs."""
    return max(xs[j] - xs[i] for j in range(len(xs)) for i in range(j + 1))


def test_largest_spike_is_the_largest_rise_over_a_running_minimum():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 50):
        xs = (torch.rand(n, generator=g, dtype=torch.float64) * 5).tolist()
        assert bq.largest_spike(xs) == pytest.approx(largest_rise(xs), abs=1e-12)
    assert bq.largest_spike([3.0, 2.0, 1.0]) == 0.0
    assert bq.largest_spike([3.0, float("nan")]) == float("inf")


def write_stability_run(top, folder, name, train, vals, console):
    d = os.path.join(top, folder, name)
    os.makedirs(d)
    with open(os.path.join(d, "log.jsonl"), "w") as f:
        for it, loss in enumerate(train):
            f.write(json.dumps({"iter": it, "train_loss": loss, "lr": 2e-3 * min(1, (it + 1) / 3)}) + "\n")
        for it, v in vals:
            f.write(json.dumps({"iter": it, "val_loss": v}) + "\n")
    with open(os.path.join(d, "train.out"), "w") as f:
        f.write(console)
    return d


NONFINITE = "iteration 3: train loss nan, gradient norm nan: stopping before the update."


def test_stability_table_has_a_line_per_run(tmp_path):
    top = str(tmp_path)
    write_stability_run(top, "stability-lr0.002", "additive-s1", [9.0, 7.0, 8.5, 6.0], [(0, 9.5), (4, 6.1)],
                        "done: 4 iterations\n")  # fmt: skip
    d = write_stability_run(
        top, "stability-lr0.002", "deltaformer-softmax-beta2-s3", [9.0, 6.0, 9.9], [(0, 9.4)],
        f"train.py: error: {NONFINITE}\n",
    )  # fmt: skip
    with open(os.path.join(d, "probe.jsonl"), "w") as f:
        rec = dict(finite=True, v_finite=True, beta_mean=1.2, beta_max=1.9, beta_over_1=0.6)
        f.write(json.dumps({**rec, "iter": 0, "layer": 1, "u_over_v": 3.0, "kappa_prev_mean": 0.4}) + "\n")
        f.write(json.dumps({**rec, "iter": 2, "layer": 0, "u_over_v": 40.0, "kappa_prev_mean": 0.5}) + "\n")
        f.write(json.dumps({**rec, "iter": 3, "layer": 5, "u_over_v": 1.0, "finite": False}) + "\n")
    text = bq.table([top])
    assert "**stability-lr0.002** (480 iterations, peak lr 0.002): 1 of 2 runs finished, 1 stopped" in text
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["additive"] == "| additive | 1 | finished | 1.500 | 6.1000 |  |"  # 8.5 over 7.0
    beta2 = lines["deltaformer-softmax-beta2"]
    assert "| 3 | stopped at iter 3 (non-finite loss) | 3.900 | 9.4000 |" in beta2
    assert "u/v 40 (iter 2, layer 0, beta mean 1.20 max 1.90, kappa(i-1) 0.50)" in text
    assert "first non-finite u: iter 3 layer 5 (v finite: True)" in text
    assert "|u|" not in text  # no bare pipes inside a cell


def test_stability_table_tells_a_crash_from_a_divergence(tmp_path):
    """Only train.py's stop on a non-finite loss counts as stopped; a run that an error (here a shard gone
    from under it) or a kill cut short is counted apart, with the error's line."""
    top, losses = str(tmp_path), [9.0, 7.0, 6.5]
    write_stability_run(top, "stability", "ddl-s1", losses, [(0, 9.0)], f"train.py: error: {NONFINITE}\n")
    missing = "train.py: error: dataset='fineweb_edu': D/x_train_000001.bin: cannot read shard (No such file)"
    write_stability_run(top, "stability", "ddl-s2", losses, [(0, 9.0)], f"iter 0: loss 9.0\n{missing}\n")
    write_stability_run(top, "stability", "ddl-s3", losses, [(0, 9.0)], "iter 0: loss 9.0\n")  # killed
    write_stability_run(top, "stability", "ddl-s4", losses, [(0, 9.0), (3, 6.4)], "done: 3 iterations\n")
    text = bq.table([top])
    assert ": 1 of 4 runs finished, 1 stopped, 2 failed or cut short\n" in text
    cells = [line.split(" | ") for line in text.splitlines() if line.startswith("| ddl")]
    runs = {seed: status for _, seed, status, *_ in cells}
    assert runs == {"1": "stopped at iter 3 (non-finite loss)", "2": f"failed at iter 3 ({missing})",
                    "3": "cut short at iter 3", "4": "finished"}  # fmt: skip


def test_run_args_lr_and_probe():
    cmd = bq.run_args("stability", "deltaformer-softmax", 1, "o", lr=2e-3, probe=8)
    assert cmd[1:4] == [os.path.abspath(bq.__file__), "--probe-run", "8"] and cmd[4] == "--"
    assert "--learning_rate=0.002" in cmd and "--min_lr=0.0002" in cmd
    assert bq.run_args("stability", "additive", 1, "o", probe=8)[1].endswith("train.py")  # nothing to watch


def test_launch_all_gives_each_run_its_own_compile_cache(tmp_path):
    code = "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['TRITON_CACHE_DIR'])"
    jobs = [([sys.executable, "-c", code], str(tmp_path / f"run{i}")) for i in range(3)]
    bq.launch_all(jobs, 3)
    caches = [open(tmp_path / f"run{i}" / "train.out").read().split() for i in range(3)]
    assert len({c[0] for c in caches}) == 3 and all(c[1].startswith(c[0]) for c in caches)
    assert not any(os.path.exists(c[0]) for c in caches)  # removed when the run ends


def test_probe_records_stage1_of_a_training_run(tmp_path):
    """A tiny CPU training run under --probe: a record per Deltaformer layer at iterations 0 and 2, with
    beta inside (0, beta_max) and softmax kappa's weight on the previous token; additive rows run plain."""
    from data.shards import write_shard

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split, i in (("val", 0), ("train", 1)):
        tokens = rng.integers(0, 50257, 4000).astype(np.uint16)
        write_shard(str(data / f"fineweb_edu_{split}_{i:06d}.bin"), tokens)
    out = str(tmp_path / "run")
    tiny = ["n_layer=2", "n_embd=64", "n_head=2", "head_dim=32", "block_size=32", "batch_size=2",
            "max_iters=4", "warmup_iters=1", "lr_decay_iters=4", "eval_interval=4", "eval_iters=1",
            "compile=False", "device=cpu"]  # fmt: skip
    cmd = bq.run_args("stability", "deltaformer-softmax-beta2", 1, out, str(data), extra=tiny, probe=2)
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=bq.REPO)
    assert run.returncode == 0, run.stdout + run.stderr
    recs = [json.loads(line) for line in open(os.path.join(out, "probe.jsonl"))]
    assert [(r["iter"], r["layer"]) for r in recs] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    for r in recs:
        assert r["finite"] and r["v_finite"] and 0 < r["beta_mean"] <= r["beta_max"] < 2.0
        assert 0 < r["kappa_prev_mean"] <= 1 and r["u_over_v"] > 0


def test_rerunning_a_command_keeps_the_runs_that_ended(tmp_path, monkeypatch):
    """A set cut short resumes: the command run again launches only the runs without a normal end (one that
    never started, one that crashed), and the table still lists every run."""
    top = str(tmp_path)
    write_run(top, "stability", "additive-s1", [(0, 5.0), (1, 4.0)])
    write_run(top, "stability", "additive-s2", [(0, 5.0)], done=False)  # crashed: runs again
    write_stability_run(top, "stability", "additive-s4", [9.0, 7.0, float("nan")], [(0, 9.5)],
                        f"train.py: error: {NONFINITE}\n")  # stopped on a non-finite loss: kept  # fmt: skip
    launched = []
    monkeypatch.setattr(bq, "launch_all", lambda jobs, n, on_finish: launched.extend(d for _, d in jobs))
    bq.main(["--setting", "stability", "--rows", "additive", "--seeds", "1", "2", "3", "4", "--out", top])
    assert launched == [os.path.join(top, "stability", f"additive-s{s}") for s in (2, 3)]


def test_table_best_final_and_difference_are_means_over_seeds(tmp_path):
    """Per row: the best (lowest finite) and the final (last iteration's) validation loss, their mean and
    half-range over the seeds, and the mean best less additive's, from random losses."""
    rng = np.random.default_rng(1)
    top, want = str(tmp_path), {}
    for row in ("additive", "ddl", "ddl-cc"):
        bests, finals = [], []
        for seed in (1, 2, 3):
            vals = [(it, float(rng.uniform(3, 5))) for it in range(0, 40 * (seed + 1), 40)]
            write_run(top, "shakespeare", f"{row}-s{seed}", vals)
            bests.append(min(v for _, v in vals))
            finals.append(vals[-1][1])
        want[row] = [(sum(x) / 3, (max(x) - min(x)) / 2) for x in (bests, finals)]
    cells = [line.strip("| ").split(" | ") for line in bq.table([top]).splitlines() if line.startswith("| ")]
    lines = {c[0]: c for c in cells[1:]}
    for row, ((best, best_spread), (final, final_spread)) in want.items():
        best_cell, final_cell = f"{best:.4f} ± {best_spread:.4f}", f"{final:.4f} ± {final_spread:.4f}"
        assert lines[row][1:4] == ["1,2,3", best_cell, final_cell]
        assert lines[row][4] == f"{best - want['additive'][0][0]:+.4f}" and lines[row][5] == "ok"


def test_main_flags_build_the_runs(monkeypatch, tmp_path, capsys):
    """--setting, --rows, --seeds, --out: the runs, seed by seed, in OUT/<setting>/<row>-s<seed>; --lr: the
    peak learning rate and min_lr = lr / 10, in OUT/<setting>-lr<lr>; --data-dir, --max-seconds reach
    train.py; --probe runs the Deltaformer rows under the probe; --parallel: runs at a time (default: the
    setting's); the table of the finished runs is printed and written."""
    launched = []

    def launch_all(jobs, parallel, on_finish):
        launched.append((jobs, parallel))
        for _, out_dir in jobs:
            write_run(os.path.dirname(os.path.dirname(out_dir)), os.path.basename(os.path.dirname(out_dir)),
                      os.path.basename(out_dir), [(0, 5.0), (1, 4.0)])  # fmt: skip
            on_finish()

    monkeypatch.setattr(bq, "launch_all", launch_all)
    out = str(tmp_path / "out")
    bq.main(["--setting", "corpus", "--rows", "additive", "deltaformer-relu", "--seeds", "3", "5", "--out",
             out, "--data-dir", "DD", "--parallel", "2", "--max-seconds", "60", "--lr", "0.002", "--probe",
             "4"])  # fmt: skip
    ((jobs, parallel),) = launched
    folder = os.path.join(out, "corpus-lr0.002")
    assert parallel == 2 and [d for _, d in jobs] == [
        os.path.join(folder, f"{row}-s{seed}") for seed in (3, 5) for row in ("additive", "deltaformer-relu")
    ]
    for cmd, out_dir in jobs:
        k = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
        got = [k[key] for key in ("data_dir", "max_seconds", "learning_rate", "min_lr", "seed", "out_dir")]
        assert got == ["DD", "60.0", "0.002", "0.0002", out_dir[-1], out_dir] and k["n_layer"] == "12"
        probed = cmd[2:4] == ["--probe-run", "4"]
        assert probed == ("deltaformer" in out_dir), cmd[:4]
    text = capsys.readouterr().out
    assert "**corpus-lr0.002**" in text and "| deltaformer-relu | 3,5 |" in text
    assert open(os.path.join(out, "quality.md")).read().strip() == text.strip()
    launched.clear()
    bq.main(["--setting", "shakespeare", "--out", out, "--seeds", "1"])  # the setting's rows, lr and parallel
    ((jobs, parallel),) = launched
    assert parallel == bq.PARALLEL["shakespeare"] and len(jobs) == len(bq.DEFAULT_ROWS["shakespeare"])
    assert all(os.path.dirname(d) == os.path.join(out, "shakespeare") for _, d in jobs)
    for cmd, _ in jobs:
        assert f"--learning_rate={bq.RECIPE['learning_rate']}" in cmd and "--probe-run" not in cmd
        assert not any(a.startswith(("--data_dir", "--max_seconds")) for a in cmd)
    launched.clear()
    bq.main(["--table", out, "--parallel", "1"])  # the least accepted; nothing runs
    assert launched == [] and "**shakespeare**" in capsys.readouterr().out


def test_main_refusals(capsys, tmp_path):
    for argv, message in [
        ([], "--setting is required (or --table DIR ...)"),
        (["--setting", "wiki"], "invalid choice: 'wiki'"),
        (["--setting", "corpus", "--rows", "ddl-xx"], "invalid choice: 'ddl-xx'"),
        (["--setting", "corpus", "--parallel", "0"], "--parallel 0: expected a positive number"),
        (["--setting", "corpus", "--seeds"], "expected at least one argument"),
    ]:
        with pytest.raises(SystemExit):
            bq.main(argv + ["--out", str(tmp_path / "out")])
        assert message in capsys.readouterr().err, argv
    assert not os.path.exists(tmp_path / "out")


def test_a_run_that_ended_on_a_non_finite_validation_loss_is_not_finished(tmp_path):
    top = str(tmp_path)
    write_run(top, "stability", "ddl-s1", [(0, 5.0), (1, float("nan"))])  # "done:", but its last loss NaN
    write_run(top, "stability", "ddl-s2", [(0, 5.0), (1, 4.0)])
    text = bq.table([top])
    assert ": 1 of 2 runs finished, 0 stopped, 1 failed or cut short\n" in text
    assert "| ddl | 1 | cut short at iter 2 |" in text and "| ddl | 2 | finished |" in text
