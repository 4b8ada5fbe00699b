"""bench/bench_attention.py --profile's split of a profile's kernels (the timing itself needs a GPU)."""

import math
import os
import subprocess
import sys

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
