"""Compile every Triton kernel of kernels/deltaformer.py for an H100/H200 (sm_90) on a machine without a
GPU, with whatever Triton is importable: frontend errors of an older Triton (the device has 3.6; CI and
this machine 3.9, whose interpreter accepts more) show up here, not in a device call.

    PYTHONPATH=/path/to/triton-3.6 python bench/compile_check.py

Prints per kernel and configuration: ok with its shared memory, or the error. Exit 1 if any failed.
(ptxas comes with the triton wheel; a triton 3.6 wheel unpacked anywhere works through PYTHONPATH.)"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.deltaformer as df  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SCALARS = {"scale": "fp32", "T": "i32", "NC": "i32", "BH": "i32"}
FP32_PTRS = {"Hs", "LSE", "Xinv", "DBeta", "RT"}  # always fp32 buffers; Prog, Ticket: int32
FAILED = []


def compile_one(fn, dt, consts, label, launch):
    """fn's non-constexpr arguments typed by name (inputs and their halves in dt), consts by name."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in SCALARS:
            sig[name] = SCALARS[name]
        else:
            sig[name] = "*i32" if name in ("Prog", "Ticket") else "*fp32" if name in FP32_PTRS else dt
    cx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=TARGET, options=launch)
        print(f"ok   {label}: shared memory {k.metadata.shared} B", flush=True)
    except Exception as e:  # noqa: BLE001
        while e.__cause__ is not None:
            e = e.__cause__
        FAILED.append(label)
        print(f"FAIL {label}: {type(e).__name__}: {str(e)[-600:]}", flush=True)


class _Like:
    """What `_triton_cfg` reads of a tensor: shape[-1] and dtype."""

    def __init__(self, D, dtype):
        self.shape, self.dtype = (1, 1, 1, D), dtype


def main():
    print("triton", triton.__version__, "from", os.path.dirname(triton.__file__))
    bf16, fp32 = torch.bfloat16, torch.float32
    configs = [(bf16, "lowp", True), (bf16, "split", True), (bf16, "split", False), (fp32, "split", False)]
    for D in (64, 128):
        for dtype, rec, lowp in configs:
            prec, xprec, lowp, rec_id, store_lo, launch = df._triton_cfg(_Like(D, dtype), 64, lowp, rec)
            dt = "*bf16" if dtype == torch.bfloat16 else "*fp32"
            tag = f"D{D} {dt[1:]} rec={rec_id} lowp={lowp}"
            base = dict(KERNEL=0, D=D, C=64, PREC=prec)
            compile_one(df._prep_kernel, dt, base | dict(XPREC=xprec, INVERSE=1), f"prep {tag}", launch)
            for late, poll in ((0, 0), (1, 0), (0, 1)):
                wave = base | dict(REC=rec_id, XPREC=xprec, STORE_LO=store_lo, POLL=poll, LATE=late)
                wave["SPIN_LIMIT"] = df._SPIN_LIMIT
                compile_one(df._fwd_kernel, dt, wave, f"fwd {tag} late={late} poll={poll}", launch)
                compile_one(df._bwd_g_kernel, dt, wave, f"bwd_g {tag} late={late} poll={poll}", launch)
            grads = base | dict(LOWP=lowp, HAS_LO=store_lo)
            compile_one(df._dk_kernel, dt, grads, f"dk {tag}", {"num_stages": 2, **launch})
            compile_one(df._dw_kernel, dt, grads, f"dw {tag}", launch)
    print("failed:", FAILED or "none")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
