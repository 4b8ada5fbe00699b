"""Shared test setup.

Without CUDA, every Triton kernel runs through Triton's CPU interpreter: TRITON_INTERPRET must be
set before `triton.jit` decorates anything, i.e. before the kernels are imported, hence here.

No test measures the wall clock: a subprocess's timeout (1800 s) only guards against a hang, and code
with time limits is tested with a fake clock, so a slow or loaded machine fails no test.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
