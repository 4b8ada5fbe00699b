"""The ATen ops that one token of eager cached decoding (sample.generate, decode="cache", batch 1) dispatches
per layer, for every residual x attention row of bench/bench_infer.py (relu and linear kappa included),
bounded so that a regression (an op more per layer) fails. Counted by bench_infer.ops_per_layer (a
TorchDispatchMode; the ops of a 2-block model less those of a 1-block one), in float32, twice:
- "cpu": as it runs here, the DDL ops on their PyTorch path (backend "torch");
- "cuda": as CUDA runs it: the DDL ops' Triton kernels (here through Triton's interpreter, a custom op each,
  the views around them counted) and each RMSNorm one op (F.rms_norm's fused kernel, ops.rope.rms_norm's
  path on CUDA where nothing is differentiated). Autocast's casts come on top (bench_infer's column has them).
The count per layer does not depend on the width (checked on two shapes)."""

import os
import sys

import pytest
import torch

import model as model_module
import ops.rope as rope_module
from model import GPT, GPTConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_infer import VARIANTS, ops_per_layer  # noqa: E402

# (cpu, cuda) bounds per layer: the counts of this code
BOUNDS = {
    "additive": (54, 40),
    "ddl": (120, 68),
    "ddl-cc": (132, 100),
    "ddl-tc": (132, 102),
    "ddl-cc-noec": (132, 100),
    "ddl-tc-noec": (132, 102),
    "additive+deltaformer": (73, 59),
    "additive+deltaformer-relu": (82, 68),
    "additive+deltaformer-linear": (81, 67),
    "ddl-cc+deltaformer": (151, 119),
}
SHAPE = dict(n_head=2, n_embd=32, head_dim=16, block_size=16, vocab_size=64)


@torch.library.custom_op("decode_ops_test::rms_norm", mutates_args=())
def _rms_norm_one_op(xf: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return RMS_NORM(xf, weight, eps)  # the counting mode sees this op, not the ops in it (as a Triton op)


RMS_NORM = rope_module.rms_norm


def count(overrides, backend, shape=SHAPE):
    """ops_per_layer of the row `overrides` on `backend`."""
    make = lambda n: GPT(GPTConfig(n_layer=n, backend=backend, **shape, **overrides)).eval()  # noqa: E731
    with torch.no_grad():
        return ops_per_layer(make, torch.randint(0, 64, (1, 2), generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("row", BOUNDS)
def test_ops_per_layer_cpu(row):
    cfg = GPTConfig(**SHAPE, **VARIANTS[row])
    ops = count(VARIANTS[row], "torch")
    # it sees the work: the matmuls of c_attn, c_proj, the MLP's two, the DDL logits, Deltaformer's beta
    assert ops["aten.mm"] == 4 + 2 * cfg.is_ddl + (cfg.attention == "deltaformer"), dict(ops)
    assert sum(ops.values()) <= BOUNDS[row][0], (row, sum(ops.values()), dict(ops.most_common()))


@pytest.mark.parametrize("row", BOUNDS)
def test_ops_per_layer_as_on_cuda(row, monkeypatch):
    pytest.importorskip("triton")
    for module in (model_module, rope_module):  # RMSNorm's and rope_norm's
        monkeypatch.setattr(module, "rms_norm", _rms_norm_one_op)
    ops = count(VARIANTS[row], "triton")
    # the RMSNorms: the residual's two (at d_v = 1 in the update's kernel, ddl::update_norm) and q and k's
    assert ops["decode_ops_test.rms_norm"] == (1 if GPTConfig(**VARIANTS[row]).ddl_dv == 1 else 3), dict(ops)
    assert sum(ops.values()) <= BOUNDS[row][1], (row, sum(ops.values()), dict(ops.most_common()))


@pytest.mark.parametrize("row", ["additive", "ddl-cc+deltaformer"])
def test_ops_per_layer_do_not_depend_on_width(row):
    wide = dict(SHAPE, n_head=3, n_embd=48, head_dim=8)
    assert count(VARIANTS[row], "torch") == count(VARIANTS[row], "torch", shape=wide)
