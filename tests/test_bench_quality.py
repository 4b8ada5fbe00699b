"""bench/bench_quality.py (the run commands, the table) and data/package_corpus.py (the corpus)."""

import json
import os
import subprocess
import sys

import pytest

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
    assert "s2 stopped at iter 1" in lines["ddl-cc"]


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
    "setting,row", [("shakespeare", "ddl-cc-write-only"), ("corpus", "ddl-cc-bf16-state")]
)
def test_run_args_are_train_config_keys(setting, row, tmp_path):
    """train.py accepts every key a run passes (its --dry_run resolves the config and exits)."""
    cmd = bq.run_args(setting, row, 7, str(tmp_path / "run"), data_dir=str(tmp_path), extra=["dry_run=True"])
    out = subprocess.run(
        cmd + ["--device=cpu", "--compile=False"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for key, value in {**bq.SETTINGS[setting], **bq.ROWS[row], "seed": 7}.items():
        if key != "compile":
            assert f"{key} = {value!r}" in out.stdout, key


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


def test_launch_all_reports_each_finished_run(tmp_path):
    """on_finish runs after every job (the bench rewrites its table then, so a cut-short run keeps it)."""
    seen = []
    jobs = [([sys.executable, "-c", f"print({i})"], str(tmp_path / f"run{i}")) for i in range(3)]
    bq.launch_all(jobs, 2, on_finish=lambda: seen.append(len(seen)))
    assert seen == [0, 1, 2]
    assert [open(tmp_path / f"run{i}" / "train.out").read() for i in range(3)] == ["0\n", "1\n", "2\n"]
