"""bench/bench_attention.py: --profile's split of a profile's kernels, and what each flag changes and the
tables' ratios, with a stand-in for the timing (which needs a GPU)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_attention  # noqa: E402


def test_kernel_split_sums_each_part_per_run():
    """Stage 1's Triton kernels by exact name (FlashAttention's flash_fwd_kernel is SDPA's), SDPA's by the
    words in theirs, the rest apart; per f+b; TFLOP/s at 7 B H T^2 D."""
    kernels = [("_fwd_kernel", 300.0), ("_bwd_g_kernel", 500.0), ("_prep_kernel", 100.0),
               ("_dk_dw_kernel", 100.0),
               ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 200.0),
               ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 300.0), ("fmha_cutlassB_bf16", 100.0),
               ("void at::native::vectorized_elementwise_kernel<4>", 50.0)]  # fmt: skip
    lines, totals = bench_attention.kernel_split(kernels, 8, 12, 1024, 64, runs=5)
    assert totals == {"stage 1": 200.0, "sdpa": 120.0, "other": 10.0}
    assert len(lines) == len(kernels) + 1 and lines[0].split()[:3] == ["100.0", "us", "stage"]
    flops = 7 * 8 * 12 * 1024 * 1024 * 64
    assert (
        f"({flops / 200.0 / 1e6:.0f} TFLOP/s)" in lines[-1]
        and f"({flops / 120.0 / 1e6:.0f} TFLOP/s)" in lines[-1]
    )
    assert lines[-1].endswith(f"stage 1 / SDPA {200 / 120:.2f}x") and not math.isnan(200 / 120)


def test_shapes_must_be_four_positive_integers():
    for bad in ("8,12,1024", "8,12,1024,x", "8,0,1024,64"):
        p = subprocess.run([sys.executable, "bench/bench_attention.py", "--shapes", "8,6,1024,128", bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 2 and "--shapes: expected B,H,T,D" in p.stderr, p.stderr[-2000:]
        assert "Traceback" not in p.stderr


def markdown_rows(text):
    """The cells of each row of the markdown tables in text (their heads left out)."""
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| B,H")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def test_flags_reach_each_shape_and_the_tables(monkeypatch, tmp_path, capsys):
    """--shapes: the shapes measured, in order (1 is the least size accepted); FLA's function unless
    --no-fla; --profile: each shape profiled and its split kept; --json: every number, rewritten after each
    shape. The tables' ratios: ours / SDPA, FLA / ours, from the medians and from the graph replays."""
    measured, profiled, saved, fla = [], [], [], object()

    def measure_shape(B, H, T, D, fla_fn):
        measured.append(((B, H, T, D), fla_fn))
        n = float(B * H * T * D)
        res = {"sdpa f+b": n, "softmax f+b": 2 * n, "relu f+b": 3 * n}
        res |= {"sdpa f+b graph": n / 2, "softmax f+b graph": 1.5 * n, "relu f+b graph": 2.5 * n}
        return res | ({"fla f+b": 8 * n} if fla_fn is not None else {})

    monkeypatch.setattr(bench_attention, "measure_shape", measure_shape)
    monkeypatch.setattr(bench_attention, "profile_shape", lambda *s: profiled.append(s) or {"stage 1": 1.0})
    monkeypatch.setattr(bench_attention, "fla_fn", lambda: fla)
    write = bench_attention.write_json
    monkeypatch.setattr(
        bench_attention, "write_json", lambda p, r: saved.append(list(r["shapes"])) or write(p, r)
    )
    path = str(tmp_path / "b.json")
    argv = ["bench_attention.py", "--shapes", "2,3,4,5", "1,1,1,1", "--json", path, "--profile"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_attention.main()
    assert measured == [((2, 3, 4, 5), fla), ((1, 1, 1, 1), fla)] and profiled == [(2, 3, 4, 5), (1, 1, 1, 1)]
    assert saved == [["2,3,4,5"], ["2,3,4,5", "1,1,1,1"]]
    shapes = json.load(open(path))["shapes"]
    assert shapes["2,3,4,5"]["softmax f+b"] == 240.0 and shapes["1,1,1,1"]["profile_us"] == {"stage 1": 1.0}
    rows = markdown_rows(capsys.readouterr().out)
    assert rows[1] == ["1,1,1,1", "1.000", "8.000", "2.000", "3.000", "2.00x", "3.00x", "4.00x", "2.67x"]
    assert rows[3] == ["1,1,1,1", "0.500", "1.500", "2.500", "3.00x", "5.00x"] and len(rows) == 4


def test_tables_ratios_and_no_fla(monkeypatch, capsys):
    """--no-fla: FLA is never imported, its column NaN; nothing profiled or written without --profile and
    --json. Each table's ratios from the stand-in medians (ours / SDPA, FLA / ours)."""
    measured = []

    def measure_shape(B, H, T, D, fla_fn):
        measured.append(fla_fn)
        n = float(B * H * T * D)
        res = {"sdpa f+b": n, "softmax f+b": 2 * n, "relu f+b": 3 * n}
        return res | {"sdpa f+b graph": n / 2, "softmax f+b graph": 1.5 * n, "relu f+b graph": 2.5 * n}

    monkeypatch.setattr(bench_attention, "measure_shape", measure_shape)
    monkeypatch.setattr(bench_attention, "fla_fn", lambda: pytest.fail("FLA imported"))
    monkeypatch.setattr(bench_attention, "profile_shape", lambda *s: pytest.fail("profiled"))
    monkeypatch.setattr(bench_attention, "write_json", lambda *a: pytest.fail("written"))
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--no-fla", "--shapes", "2,3,4,5"])
    bench_attention.main()
    assert measured == [None]
    (median, graph) = markdown_rows(capsys.readouterr().out)
    assert median == ["2,3,4,5", "120.000", "nan", "240.000", "360.000", "2.00x", "3.00x", "nanx", "nanx"]
    assert graph == ["2,3,4,5", "60.000", "180.000", "300.000", "3.00x", "5.00x"]
