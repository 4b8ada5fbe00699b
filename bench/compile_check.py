"""Compile every Triton launch of this repo's kernels for sm_90 (H100/H200) without a GPU, with whatever
Triton is importable, so that another version's frontend errors show up before a GPU run.

    PYTHONPATH=/path/to/triton-3.6 python bench/compile_check.py

Each `kernel[grid](...)` launch is compiled, not run, with its argument types and constexprs: a forward and
backward of every model variant (gpt2-small width, four blocks: states rebuilt by 1-7 updates; an fp32 DDL
state, and bf16 rounded to nearest and stochastically) and the Deltaformer u-stage (every kernel, head dim
64 and 128, each dtype, both `lowp`; bf16 also within packed documents). Prints each distinct compile
(shared memory; registers, spill stack and barrier instructions from the triton wheel's cuobjdump) or its
error; exit 1 if any failed.

    python bench/compile_check.py --mix    # the Deltaformer u-stage only (bf16), + each loop's SASS mix

--mix: per compile, the SASS instructions a warp issues in one pass of each loop body (over 30 of them) by
class (MMA: HMMA/HGMMA tensor-core ops; MUFU: exp2 etc.; FP32; CVT: conversions; INT; LDG: global loads and
async copies; SMEM; BAR), set beside each pipe's rate to bound a loop's time by its issue rather than its
FLOPs."""

import functools
import os
import re
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if __name__ == "__main__":  # compile, not interpret: before triton decorates its own library (tl.sum, ...)
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SEEN, FAILED, SPILLS = {}, [], []


def cuobjdump(cubin, *flags):
    """The output of the cuobjdump that ships with Triton on a kernel's cubin; "" where it is missing."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True).stdout


MIX = [("MMA", "HMMA HGMMA"), ("MUFU", "MUFU"), ("FP32", "FFMA FMUL FADD FMNMX FSEL FSETP"),
       ("CVT", "F2F F2FP I2F F2I FRND"), ("LDG", "LDG LDGSTS"), ("SMEM", "LDS STS LDSM"), ("BAR", "BAR"),
       ("INT", "IMAD IADD3 LOP3 SHF ISETP LEA SEL IMNMX PRMT MOV VIADD")]  # fmt: skip


def loop_mix(cubin):
    """[(instructions, {class: count})] of each loop body (a backward branch's span) of over 30 instructions
    in the kernel's SASS (cuobjdump), innermost first; [] without cuobjdump."""
    sass = cuobjdump(cubin, "-sass")
    ins = re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[^;]*?(?:0x([0-9a-f]+))?\s*;", sass
    )
    at = {int(a, 16): i for i, (a, _, _) in enumerate(ins)}
    spans = {(at[int(t, 16)], i) for i, (a, op, t) in enumerate(ins) if op == "BRA" and t and int(t, 16) in at
             and int(t, 16) < int(a, 16)}  # fmt: skip
    mixes = []
    for lo, hi in sorted((s for s in spans if s[1] - s[0] >= 30), key=lambda s: s[1] - s[0]):
        ops = [op for _, op, _ in ins[lo : hi + 1]]
        mixes.append((len(ops), {c: sum(op in names.split() for op in ops) for c, names in MIX}))
    return mixes


@functools.cache
def _binder(fn):  # Triton's backend for TARGET and fn's binder, built once per kernel as the runtime does
    backend = make_backend(TARGET)
    return backend, create_function_from_signature(fn.signature, fn.params, backend)


def specialized(fn, args, kwargs):
    """(arguments by name, signature, constexprs, attributes) of a launch of fn, specialized by Triton's own
    binder as at run time: 16-byte aligned pointers and integers divisible by 16 are marked so, integers
    equal to 1 become constexprs, which decides, e.g., whether loads are vectorized."""
    backend, binder = _binder(fn)
    bound, specialization, options = binder(*args, **kwargs)
    _, sig, consts, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return bound, sig, consts, attrs


def compile_launch(fn, args, kwargs):
    """Compile fn for TARGET with this launch's specialization (once per distinct one)."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = dict(zip(fn.arg_names, args)) | kwargs
    key = label = f"{fn.__name__} " + " ".join(f"{n}={bound[n]}" for n, p in zip(fn.arg_names, fn.params)
                                              if p.is_constexpr and n not in ("SPIN_LIMIT",))  # fmt: skip
    try:
        # Triton imported under TRITON_INTERPRET=1 decorated its own library for the interpreter, which its
        # compiler cannot take (Triton 3.9's refuses on its first compile with a bare AssertionError)
        if not isinstance(tl.standard.cdiv, JITFunction):
            raise RuntimeError("triton was imported with TRITON_INTERPRET=1, so its library is "
                               "interpreted, not compilable: run compile_check in a process without "
                               "TRITON_INTERPRET")  # fmt: skip
        bound, sig, consts, attrs = specialized(fn, args, kwargs)
        key = (fn.__name__, str(sig), str(consts), str(attrs), str(options))
        if key in SEEN:
            return
        label += f" {fn.arg_names[0]}:{sig[fn.arg_names[0]]}"  # the first argument's type: the data's dtype
        # a tuple argument of tuples (the DDL rebuild chain): their lengths
        label += "".join(f" {n}={tuple(map(len, v))}" for n, v in bound.items() if isinstance(v, tuple) and v
                         and all(isinstance(x, tuple) for x in v))  # fmt: skip
        label += f" {options}" if options else ""
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=TARGET, options=options)
        SEEN[key] = f"ok   {label}: shared memory {k.metadata.shared} B"
        # registers and stack bytes (where spilled registers go) per thread, barrier instructions (what
        # cross-warp reductions and layout conversions through shared memory cost)
        out = cuobjdump(k.asm["cubin"], "--dump-resource-usage", "-sass")
        if regs := re.search(r"REG:(\d+) STACK:(\d+)", out):
            SEEN[key] += f", {regs[1]} registers, stack {regs[2]} B, barriers {out.count('BAR.SYNC')}"
            if int(regs[2]):
                SPILLS.append((int(regs[2]), label))
        for n, mix in loop_mix(k.asm["cubin"]) if "--mix" in sys.argv else ():
            SEEN[key] += f"\n       loop of {n}: " + " ".join(f"{c} {x}" for c, x in mix.items() if x)
    except Exception as e:  # noqa: BLE001
        while e.__cause__ is not None:
            e = e.__cause__
        where = traceback.extract_tb(e.__traceback__)[-1:]  # an assert without a message says nothing else
        where = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno})" if where else ""
        SEEN[key] = f"FAIL {label}: {type(e).__name__}{where}: {str(e)[-600:]}"
        FAILED.append(label)
    print(SEEN[key], flush=True)


def run_model_variants():
    from model import GPT, GPTConfig
    from ops.common import set_auto_backend

    set_auto_backend("triton")
    # ops/common.py accepts CPU tensors for backend="triton" only under the interpreter; its kernels were
    # decorated (compiled, not interpreted) at import, so this only passes that check
    os.environ["TRITON_INTERPRET"] = "1"
    variants = [dict(residual="additive", attention="deltaformer")]
    variants += [dict(residual=r) for r in ("ddl", "ddl-cc", "ddl-tc")]
    variants += [dict(residual="ddl-cc", ddl_ec=False)]
    variants += [dict(residual=r, ddl_erase=False) for r in ("ddl", "ddl-tc")]  # the write-only control
    variants += [dict(residual="ddl", ddl_keep_state_every=0)]  # d_v = 1's default: the fused norm
    states = (("float32", "nearest"), ("bfloat16", "nearest"), ("bfloat16", "stochastic"))  # DDL's (4 blocks)
    for overrides in variants:
        ddl = overrides["residual"] != "additive"
        for state, rnd in states[: 1 + 2 * ddl]:
            print(f"--- model {overrides} ddl_state_dtype={state} ddl_state_rounding={rnd}", flush=True)
            kw = dict(ddl_state_dtype=state, ddl_state_rounding=rnd, ddl_keep_state_every=4) if ddl else {}
            cfg = GPTConfig.preset("gpt2-small", n_layer=4, block_size=64, backend="triton",
                                   **{**kw, **overrides})  # fmt: skip
            model = GPT(cfg)
            idx = torch.randint(0, cfg.vocab_size, (1, 64))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            loss.backward()


def run_deltaformer_variants(mix=False):
    from ops.deltaformer import KERNELS, deltaformer_u_triton

    for D, dtype in ((64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float32), (64, torch.float16),
                     (128, torch.float32))[: 2 if mix else 5]:  # fmt: skip
        k, v, w = (torch.randn(1, 2, 70, D, dtype=dtype, requires_grad=True) for _ in range(3))
        w = k if dtype == torch.float16 else w  # once w is k, as in the model by default
        beta = torch.rand(1, 2, 70, dtype=dtype, requires_grad=True)
        docs = (None, torch.tensor([[0] * 30 + [30] * 40])) if dtype == torch.bfloat16 else (None,)
        for kernel in KERNELS:
            for lowp in (True, False):  # fp32 ignores it
                for doc_start in docs:  # bf16 (what training runs): also within packed documents
                    u = deltaformer_u_triton(k, v, w, beta, kernel=kernel, lowp=lowp, doc_start=doc_start)
                    u.float().sum().backward()


def main():
    print("triton", triton.__version__, "from", os.path.dirname(triton.__file__))
    KernelInterface.__getitem__ = lambda self, grid: lambda *a, **kw: compile_launch(self, a, kw)  # compiles
    torch.manual_seed(0)
    run_deltaformer_variants(mix="--mix" in sys.argv)
    if "--mix" not in sys.argv:
        run_model_variants()
    print(f"{len(SEEN)} distinct compiles; failed: {FAILED or 'none'}")
    largest = [f"stack {b} B: {label}" for b, label in sorted(SPILLS, reverse=True)[:10]]
    print(f"{len(SPILLS)} spill registers to the stack; the largest (per thread):", *largest, sep="\n  ")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
