"""bench/run_state_tracking.py: what each flag changes in the runs it starts (the job queue a stand-in that
writes each run's log), the Triton check's verdict, and the tables' accuracies and curriculum columns from
hand-made log records. Real CPU runs: tests/test_state_tracking.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import run_state_tracking as rst  # noqa: E402

RECORDS = [
    {"iter": 0, "train_loss": 2.0, "dt_ms": 1500.0},
    {"iter": 0, "val_loss": 2.0, "val_acc": 0.1, "st_length": 64},
    {"iter": 10, "train_loss": 1.0, "dt_ms": 2000.0},
    {"iter": 10, "val_loss": 1.0, "val_acc": 0.5, "st_length": 256},
    {"iter": 20, "train_loss": 0.5, "dt_ms": 1000.0},
    {"iter": 20, "val_loss": 0.5, "val_acc": 0.9, "st_length": 256},
    {"iter": 25, "final": True, "val_acc@93": 0.8764, "val_acc_last@93": 0.5, "val_acc@1024": 0.25,
     "val_acc@189": 0.75, "val_acc_last@189": 0.125},
]  # fmt: skip


def test_summarise_and_table_from_the_log_records():
    """train s: the sum of the steps' dt_ms; the curriculum's last length and the first iteration at the
    target length; accuracies in % at each evaluated length, lengths in numeric order; '-' where a run has
    none; a run that did not exit 0 says how it ended."""
    job = dict(name="swap/tf-1", status="exit 0", seconds=41.6, shown="python train.py X")
    row = rst.summarise(job, RECORDS, 256)
    assert row == {"config": "swap/tf-1", "iters": 25, "wall_s": "42", "command": "python train.py X",
                   "train_s": "4", "len": "256", "target_at": "10", "acc@93": "87.6", "acc_last@93": "50.0",
                   "acc@1024": "25.0", "acc@189": "75.0", "acc_last@189": "12.5"}  # fmt: skip
    assert rst.summarise(job, RECORDS, 512)["target_at"] == "-"  # never reached
    killed = rst.summarise(dict(job, status="killed at the deadline"), RECORDS[:3], None)
    assert killed["config"] == "swap/tf-1 (killed at the deadline)" and killed["iters"] == 2
    assert "len" not in killed and "target_at" not in killed and not any(k.startswith("acc") for k in killed)
    lines = rst.table([row, killed], 256).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    accuracies = [f"{kind}acc@{L} %" for L in (93, 189, 1024) for kind in ("", "last-pos ")]
    assert head == [
        "config",
        "iters",
        "train s",
        "wall s",
        "final train len",
        "iter len 256 reached",
        *accuracies,
    ]
    assert lines[2] == "| swap/tf-1 | 25 | 4 | 42 | 256 | 10 | 87.6 | 50.0 | 75.0 | 12.5 | 25.0 | - |"
    assert lines[3].startswith("| swap/tf-1 (killed at the deadline) | 2 | 4 | 42 | - | - | - |")
    assert "- swap/tf-1: `python train.py X`" in lines


def test_check_triton_reads_its_subprocess(monkeypatch):
    calls = []

    def run(cmd, cwd, capture_output, text, timeout):
        calls.append(timeout)
        if timeout < 1:
            raise subprocess.TimeoutExpired(cmd, timeout)
        out = (
            "softmax T=32: ...\nTRITON_OK\n"
            if timeout > 10
            else "softmax T=32: ...\nAssertionError: slower\n"
        )
        return subprocess.CompletedProcess(cmd, 0 if timeout > 10 else 1, out, "")

    monkeypatch.setattr(rst.subprocess, "run", run)
    assert rst.check_triton(60) == (True, "Triton stage 1 (agrees with the PyTorch path and is faster)")
    assert rst.check_triton(5) == (False, "PyTorch stage 1 (Triton check failed: AssertionError: slower)")
    assert rst.check_triton(0.5) == (False, "Triton check timed out after 0.5 s")
    assert calls == [60, 5, 0.5]


def fake_queue(seen, status="exit 0"):
    """A stand-in for run_commands: each run 'ends' with RECORDS as its log and a line of output."""

    def run_commands(jobs, slots, time_limit):
        seen.update(jobs=jobs, slots=slots, time_limit=time_limit)
        for job in jobs:
            out_dir = next(a.split("=", 1)[1] for a in job["cmd"] if a.startswith("--out_dir="))
            with open(os.path.join(out_dir, "log.jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in RECORDS)
            with open(job["log"], "w") as f:
                f.write(f"output of {job['name']}\n")
            job.update(status=status, seconds=30.0)
        return jobs

    return run_commands


def test_flags_reach_every_run_and_the_results(monkeypatch, tmp_path):
    """--tasks and --only select the runs; --seconds each run's budget, --deadline the queue's limit (0:
    seconds + 300); --extra more train.py overrides for every run; --work the runs' folders, --out the
    results; without CUDA the Deltaformer runs take the PyTorch path."""
    seen, work, out = {}, str(tmp_path / "w"), str(tmp_path / "o")
    monkeypatch.setattr(rst, "run_commands", fake_queue(seen))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--tasks", "dag", "--only", "df-relu-q,tf-2", "--seconds", "7.5", "--deadline", "40",
            "--extra=--device=cpu --max_iters=3", "--out", out, "--work", work]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["run_state_tracking.py", *argv])
    rst.main()
    jobs = seen["jobs"]
    assert [j["name"] for j in jobs] == ["dag/df-relu-q", "dag/tf-2"] and len(seen["slots"]) == 2
    assert seen["time_limit"] == 40.0
    for job in jobs:
        cmd = job["cmd"]
        assert cmd[1:3] == ["train.py", "configs/state_tracking.py"] and "--st_task=dag" in cmd
        assert cmd[-4:] == ["--device=cpu", "--max_iters=3", f"--out_dir={os.path.join(work, job['name'])}",
                            "--overwrite=True"]  # fmt: skip
        assert "--max_seconds=7.5" in cmd and ("--backend=torch" in cmd) == (job["name"] == "dag/df-relu-q")
    results = open(os.path.join(out, "results.md")).read()
    assert "## DAG reachability, 32 nodes" in results and "## swap" not in results
    assert (
        "| dag/tf-2 | 25 | 4 | 30 |" in results and "Deltaformer stage 1: PyTorch path (no CUDA)" in results
    )
    logs = [json.loads(line) for line in open(os.path.join(out, "logs.jsonl"))]
    assert [r["config"] for r in logs] == ["dag/df-relu-q"] * len(RECORDS) + ["dag/tf-2"] * len(RECORDS)
    assert "===== dag/tf-2 (exit 0): python train.py" in open(os.path.join(out, "stdout.txt")).read()
    argv = ["--only", "tf-1", "--seconds", "20", "--out", out, "--work", work]
    monkeypatch.setattr(sys, "argv", ["run_state_tracking.py", *argv])
    rst.main()
    assert [j["name"] for j in seen["jobs"]] == ["swap/tf-1", "dag/tf-1"] and seen["time_limit"] == 320.0


def test_check_timeout_and_the_triton_verdict(monkeypatch, tmp_path):
    """With CUDA, a Deltaformer run takes the Triton path only if the check (given --check-timeout s) says
    so; runs without a Deltaformer need no check."""
    checks, seen = [], {}
    monkeypatch.setattr(rst, "run_commands", fake_queue(seen))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rst, "versions", lambda: "GPU X")
    base = ["run_state_tracking.py", "--tasks", "swap", "--out", str(tmp_path / "o"), "--work", str(tmp_path)]
    for verdict, backend in ((True, "--backend=triton"), (False, "--backend=torch")):
        check = lambda timeout, verdict=verdict: checks.append(timeout) or (verdict, "NOTE")  # noqa: E731
        monkeypatch.setattr(rst, "check_triton", check)
        monkeypatch.setattr(sys, "argv", base + ["--only", "df-softmax-k", "--check-timeout", "12"])
        rst.main()
        assert checks[-1] == 12.0 and backend in seen["jobs"][0]["cmd"]
        assert "Deltaformer stage 1: NOTE" in open(tmp_path / "o" / "results.md").read()
    monkeypatch.setattr(sys, "argv", base + ["--only", "tf-4"])
    rst.main()
    assert len(checks) == 2 and not any(a.startswith("--backend") for a in seen["jobs"][0]["cmd"])


def test_refusals(monkeypatch, capsys):
    monkeypatch.setattr(rst, "run_commands", lambda *a, **k: pytest.fail("ran"))
    for argv, message in [
        (["--tasks", "swap,parity"], "--tasks must name some of ['swap', 'dag'], got 'swap,parity'"),
        (["--tasks", ","], "--tasks must name some of"),
        (["--only", "tf-3"], "unknown config(s) ['tf-3']"),
        (["--seconds", "-1"], "--seconds -1, --deadline 0: need >= 0"),
        (["--deadline", "-5"], "--seconds 180, --deadline -5: need >= 0"),
    ]:
        monkeypatch.setattr(sys, "argv", ["run_state_tracking.py", *argv])
        with pytest.raises(SystemExit) as e:
            rst.main()
        assert message in str(e.value.code), argv
