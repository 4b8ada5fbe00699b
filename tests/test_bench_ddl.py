"""bench/bench_ddl.py without a GPU: what --quick, --sweeps and --out change (the cases' tensors made on the
CPU and nothing timed), and each row's numbers from its bytes and its time."""

import argparse
import json
import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_ddl  # noqa: E402


class OnCPU(TorchFunctionMode):
    """Tensors asked for on "cuda" made on the CPU; the 1 GiB copy buffer made 1 KiB."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        args = tuple((1024,) if a == (2**30,) else a for a in args)
        return func(*args, **kwargs)


def test_record_rates_from_bytes_and_time(capsys):
    """A row: the case called once (it compiles) before it is timed; us = ms x 1e3, GB = bytes / 1e9,
    GB/s = bytes / seconds / 1e9; a case that fails prints why and adds no row."""
    rows, calls = [], []
    bench_ddl.record(rows, lambda fn: 0.25, "case", lambda: calls.append(1), 3e9)
    assert calls == [1] and rows == [dict(name="case", us=250.0, GB=3.0, GBps=3e9 / 0.25e-3 / 1e9)]
    bench_ddl.record(rows, lambda fn: 1.0, "bad", lambda: 1 / 0, 1)
    assert len(rows) == 1 and "bad FAILED: ZeroDivisionError" in capsys.readouterr().out


def test_quick_and_sweeps_choose_the_cases_and_the_timer(monkeypatch):
    """Default: fp32 and bf16 cases, then d_v = 1's, timed by median_ms; --quick: fp32 only; --sweeps: only
    the launch shapes of both dtypes (--quick or not), as CUDA graph replays. The copy's bytes: read +
    write of 1 GiB."""
    seen = []
    monkeypatch.setattr(bench_ddl, "median_ms", lambda fn: 2.0)
    monkeypatch.setattr(bench_ddl, "graph_ms", lambda fn: 4.0)
    monkeypatch.setattr(bench_ddl, "sweep_update", lambda case, dtype: seen.append(("sweep", dtype)))
    monkeypatch.setattr(
        bench_ddl, "bench_kernels_dtype", lambda args, dtype, case: seen.append(("kernels", dtype))
    )
    monkeypatch.setattr(bench_ddl, "bench_kernels_dv1", lambda args, case: seen.append(("dv1",)))
    f32, bf16 = torch.float32, torch.bfloat16
    for quick, sweeps, want, ms in [
        (False, False, [("kernels", f32), ("kernels", bf16), ("dv1",)], 2.0),
        (True, False, [("kernels", f32), ("dv1",)], 2.0),
        (False, True, [("sweep", f32), ("sweep", bf16)], 4.0),
        (True, True, [("sweep", f32), ("sweep", bf16)], 4.0),
    ]:
        seen.clear()
        with OnCPU():
            rows = bench_ddl.bench_kernels(argparse.Namespace(quick=quick, sweeps=sweeps))
        assert seen == want, (quick, sweeps)
        (copy,) = rows
        assert (
            copy["name"].startswith("copy 1 GiB") and copy["us"] == ms * 1e3 and copy["GB"] == 2 * 2**30 / 1e9
        )


def test_quick_leaves_out_torch_compile_and_the_bytes_are_passes_over_the_state(monkeypatch):
    """--quick drops the torch.compile comparisons (kept once, in fp32, otherwise); each case's bytes are
    minimal passes over the state (N tokens x d x d_v elements) and over [N, d], in the state's dtype."""
    monkeypatch.setattr(bench_ddl, "N", 1024)
    monkeypatch.setattr(bench_ddl, "D", 8)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # not called: nothing is timed
    cases = {}

    def names(quick, dtype):
        cases.clear()
        with OnCPU():
            bench_ddl.bench_kernels_dtype(
                argparse.Namespace(quick=quick), dtype, lambda n, fn, b: cases.update({n: b})
            )
        return list(cases)

    full, quick = names(False, torch.float32), names(True, torch.float32)
    compiled = [n for n in full if "torch.compile" in n]
    assert len(compiled) == 4 and quick == [n for n in full if n not in compiled]
    assert not [n for n in names(False, torch.bfloat16) if "torch.compile" in n]
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        names(False, dtype)
        S, V = 1024 * 8 * 4 * size, 1024 * 8 * size  # the state [N, d, d_v = 4], a vector per token [N, d]
        tag = f"[{str(dtype)[6:]}, N=1024]"
        assert cases[f"update fwd  triton {tag}"] == 2 * S + V  # read x, k; write x
        assert cases[f"update+cc f+b  fused triton {tag}"] == 5 * S + 5 * V
    for quick, want in ((False, 4), (True, 2)):  # d_v = 1: Triton, and torch.compile of the reference
        cases.clear()
        with OnCPU():
            bench_ddl.bench_kernels_dv1(
                argparse.Namespace(quick=quick), lambda n, fn, b: cases.update({n: b})
            )
        assert len(cases) == want and sum("torch.compile" in n for n in cases) == want - 2
        assert cases["update fwd  triton [float32, d_v=1, N=1024]"] == 3 * 1024 * 8 * 4


def test_main_needs_cuda_and_writes_out(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["bench/bench_ddl.py", "--quick"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="bench_ddl.py needs a CUDA GPU"):
        bench_ddl.main()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_ddl, "versions", lambda: "GPU X")
    got = []
    monkeypatch.setattr(bench_ddl, "bench_kernels", lambda args: got.append(args) or [dict(name="c", us=1.0)])
    bench_ddl.main()
    assert (got[-1].quick, got[-1].sweeps) == (True, False) and os.listdir(tmp_path) == []  # no --out
    monkeypatch.setattr(sys, "argv", ["bench/bench_ddl.py", "--sweeps", "--out", str(tmp_path / "o")])
    bench_ddl.main()
    assert (got[-1].quick, got[-1].sweeps) == (False, True)
    run = json.load(open(tmp_path / "o" / "bench_ddl.json"))
    assert run["command"] == f"python bench/bench_ddl.py --sweeps --out {tmp_path / 'o'}"
    assert run["versions"] == "GPU X" and run["rows"] == [dict(name="c", us=1.0)]
