"""Shared test setup.

Without CUDA, every Triton kernel runs through Triton's CPU interpreter: TRITON_INTERPRET must be
set before `triton.jit` decorates anything, i.e. before the kernels are imported, hence here.

No test measures the wall clock: a subprocess's timeout (1800 s) only guards against a hang, and code
with time limits is tested with a fake clock, so a slow or loaded machine fails no test.
"""

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()

if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    # one thread a worker (and for the processes tests start): `-n 2` on 2 cores runs 2 workers, and torch's
    # default of a thread a core each would have 4 threads contend for 2 cores
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _interpret_device_calls_without_repatching():
    """Triton's interpreter patches triton.language at a kernel's launch (undone at its end), and again at
    every call of a @triton.jit helper inside it: a third of an interpreted kernel's time here. For the
    helpers of ops/ the second patch changes nothing (every module there imports `triton.language as tl`,
    the module their kernel's launch patched), so their calls go straight to the function; Triton's own
    (tl.zeros, ...), whose modules see triton.language.core, are patched as before. Left as it is when the
    interpreter's code is not the one this was written against."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    call = interpreter.InterpretedFunction.__call__
    lines = [line.strip() for line in inspect.getsource(call).splitlines()]
    if lines[2:5] != ["_patch_lang(self.fn)", "fn = self.rewrite()", "try:"]:
        return

    def device_call(self, *args, **kwargs):
        if not self.fn.__module__.startswith("ops."):
            interpreter._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = device_call


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_device_calls_without_repatching()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
