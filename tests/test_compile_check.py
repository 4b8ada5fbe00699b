"""bench/compile_check.py: a launch compiled for sm_90 on this machine, with its registers and spills."""

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import compile_check  # noqa: E402


def _scale(X, Y, PAIRS, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a, b = PAIRS
    y = tl.load(X + offs, mask=offs < N) * 2.0
    for i in tl.static_range(len(a)):
        y += tl.load(a[i] + offs, mask=offs < N) * tl.load(b[i] + offs, mask=offs < N)
    tl.store(Y + offs, y, mask=offs < N)


def test_a_launch_compiles_for_sm90_with_its_resources(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # decorated now: compiled, not interpreted
    kernel = triton.jit(_scale)
    monkeypatch.setattr(compile_check, "SEEN", {})
    monkeypatch.setattr(compile_check, "FAILED", [])
    x = torch.empty(8)
    pairs = ((x, x), (x, x))  # a tuple of tuples: the label gives their lengths
    compile_check.compile_launch(kernel, (x, x, pairs, 8), dict(BLOCK=8, num_warps=1))
    (line,) = compile_check.SEEN.values()
    assert line.startswith("ok   _scale BLOCK=8 X:*fp32 PAIRS=(2, 2) {'num_warps': 1}: shared memory")
    assert " registers, stack 0 B" in line and not compile_check.FAILED
    assert capsys.readouterr().out.strip() == line
