"""Deltaformer attention speed on one GPU: causal SDPA vs FLA 0.6.0's Deltaformer vs ours (Triton).

    python bench/bench_attention.py --json bench.json   # five shapes (SHAPES), bf16
    python bench/bench_attention.py --no-fla --profile --shapes 8,12,1024,64 2,12,4096,64   # + per kernel

ms of forward + backward of all inputs: "f+b", do_bench's median (common.median_ms, the host's launch work
included, which at these sizes can exceed the GPU's); "f+b graph", a CUDA graph's replay (the GPU's time).
FLA's Deltaformer (when `fla` imports): its u-stage (ParallelDeltaformerFunction) then causal SDPA.
--json writes every number. --profile: each kernel's GPU time per f+b of ours (softmax κ), torch.profiler;
stage 1 (its Triton kernels) against stage 2 (SDPA's), each at the least FLOPs the math needs (7 B H T^2 D:
stage 1 forms and multiplies by kappa's scores forward, then scores, G, dA, dK, dW backward; causal SDPA the
same count), as TFLOP/s against the H200's 790 dense bf16.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from common import command, graph_ms, markdown, median_ms, profiled, versions, write_json  # bench/common.py

from ops.deltaformer import deltaformer_u_triton

SHAPES = [(8, 12, 1024, 64), (8, 6, 1024, 128), (4, 12, 2048, 64), (2, 12, 4096, 64), (8, 16, 1024, 64)]


def make(B, H, T, D, kernel="softmax", dtype=torch.bfloat16, seed=0):
    """Random inputs, the same q, k, v, w (seed) for every kernel; beta in (0, beta_max) as in
    tests/test_deltaformer.py (beta_max_for): relu and linear kappa grow u with T for unrelated w and k, so
    their beta shrinks with T. relu's times include its keys' norms (`deltaformer_u_triton`)."""
    torch.manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(4))
    beta_max = {"softmax": 1.0, "relu": min(1.0, 256.0 / T), "linear": min(1.0, 8.0 * T**-0.5)}[kernel]
    beta = (beta_max * torch.rand(B, H, T, device="cuda")).to(dtype).requires_grad_(True)
    return q, k, v, w, beta


def fwd_bwd(fn, inputs, reset=False):
    """One forward + backward of fn on inputs (reset: the inputs' .grad set to None first, as do_bench's
    grad_to_none does, else every graph replay adds one more kernel per input)."""
    grad_out = torch.randn_like(fn(*inputs))

    def run():
        for x in inputs if reset else ():
            x.grad = None
        fn(*inputs).backward(grad_out)

    return run


sdpa = lambda q, k, v, w, beta: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ours(kernel, **opts):
    def fn(q, k, v, w, beta):
        u = deltaformer_u_triton(k, v, w, beta, kernel=kernel, **opts)
        return F.scaled_dot_product_attention(q, k, u, is_causal=True)

    return fn


def fla_fn():
    try:
        from fla.ops.deltaformer.parallel import ParallelDeltaformerFunction
    except Exception as e:  # noqa: BLE001
        print(f"FLA not importable: {type(e).__name__}: {e}")
        return None

    def fn(q, k, v, w, beta):
        # FLA takes [B, T, H, D]; its first argument is the first-stage query (our w), its scale 1/sqrt(D)
        t = lambda x: x.transpose(1, 2)
        u = ParallelDeltaformerFunction.apply(t(w), t(k), t(v), beta.transpose(1, 2))
        return F.scaled_dot_product_attention(q, k, t(u), is_causal=True)

    return fn


def measure_shape(B, H, T, D, fla):
    """f+b medians of SDPA, FLA, ours (softmax, relu), and the f+b graph replays of all but FLA, ms."""
    res = {}
    for name, fn in {"sdpa": sdpa, "fla": fla, "softmax": ours("softmax"), "relu": ours("relu")}.items():
        if fn is None:
            continue
        inputs = make(B, H, T, D, kernel="relu" if name == "relu" else "softmax")
        res[f"{name} f+b"] = median_ms(fwd_bwd(fn, inputs), grad_to_none=list(inputs))
        if name != "fla":  # FLA's Python loop over chunks: its host time is its cost
            res[f"{name} f+b graph"] = graph_ms(fwd_bwd(fn, inputs, reset=True))
    print(f"{B},{H},{T},{D}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    return res


# stage 1's kernels by their exact names (SDPA's FlashAttention has a "flash_fwd_kernel"), and words in SDPA's
STAGE1 = ("_prep_kernel", "_fwd_kernel", "_bwd_g_kernel", "_dk_dw_kernel", "_row_norms_kernel")
SDPA = ("flash", "fmha", "attention", "sdpa")


def kernel_split(kernels, B, H, T, D, runs):
    """(lines, us per f+b of stage 1, SDPA and the rest) from [(kernel name, GPU us over `runs` f+b)]; the
    last line has stage 1's and SDPA's TFLOP/s at the least count, 7 B H T^2 D each."""
    totals, lines = {"stage 1": 0.0, "sdpa": 0.0, "other": 0.0}, []
    for name, us in sorted(kernels, key=lambda k: -k[1]):
        part = "stage 1" if name in STAGE1 else "sdpa" if any(s in name.lower() for s in SDPA) else "other"
        totals[part] += us / runs
        lines.append(f"  {us / runs:9.1f} us  {part:7s}  {name[:110]}")
    tflops = {k: 7 * B * H * T * T * D / v / 1e6 if v else math.nan for k, v in totals.items()}
    lines.append(f"  stage 1 {totals['stage 1']:.1f} us ({tflops['stage 1']:.0f} TFLOP/s), SDPA "
                 f"{totals['sdpa']:.1f} us ({tflops['sdpa']:.0f} TFLOP/s), other {totals['other']:.1f} us; "
                 f"stage 1 / SDPA {totals['stage 1'] / (totals['sdpa'] or math.nan):.2f}x")  # fmt: skip
    return lines, totals


def profile_shape(B, H, T, D, runs=10):
    """Each kernel's GPU us per f+b of ours (softmax κ), torch.profiler over `runs` of them (kernel_split)."""
    run = fwd_bwd(ours("softmax"), make(B, H, T, D), reset=True)

    def steps(n):
        for _ in range(n):
            run()
        torch.cuda.synchronize()

    steps(3)  # warm-up
    kernels, _ = profiled(lambda: steps(runs))
    lines, totals = kernel_split([(name, us) for name, us, _ in kernels], B, H, T, D, runs)
    print(f"profile {B},{H},{T},{D} (softmax κ, us per f+b):", *lines, sep="\n", flush=True)
    return totals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", default="", help="write all numbers to this file")
    ap.add_argument("--profile", action="store_true", help="+ each kernel's GPU time (softmax κ)")
    ap.add_argument("--shapes", nargs="*", default=[], help="B,H,T,D each (default: SHAPES)")
    args = ap.parse_args()
    try:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] or SHAPES
    except ValueError:
        shapes = [()]
    if any(len(s) != 4 or min(s) < 1 for s in shapes):
        ap.error(f"--shapes: expected B,H,T,D of positive integers each, got {' '.join(args.shapes)}")
    print(f"Command: `{command(__file__)}`", versions(), sep="\n")
    results, fla = {"shapes": {}}, None if args.no_fla else fla_fn()
    for shape in shapes:
        results["shapes"][",".join(map(str, shape))] = measure_shape(*shape, fla)
        if args.profile:
            results["shapes"][",".join(map(str, shape))]["profile_us"] = profile_shape(*shape)
        if args.json:  # after every shape: a run cut short keeps what it measured
            write_json(args.json, results)

    rows, graph_rows = [], []
    for shape, r in results["shapes"].items():
        sd, fl, so, re_ = (r.get(f"{n} f+b", math.nan) for n in ("sdpa", "fla", "softmax", "relu"))
        ratios = [f"{x:.2f}x" for x in (so / sd, re_ / sd, fl / so, fl / re_)]
        rows.append([shape, *(f"{x:.3f}" for x in (sd, fl, so, re_)), *ratios])
        sd, so, re_ = (r.get(f"{n} f+b graph", math.nan) for n in ("sdpa", "softmax", "relu"))
        graph_rows.append(
            [shape, *(f"{x:.3f}" for x in (sd, so, re_)), f"{so / sd:.2f}x", f"{re_ / sd:.2f}x"]
        )
    print("\nf+b medians in ms, bf16; ours/SDPA = time ratio; FLA/ours = speed-up over FLA 0.6.0")
    head = ["B,H,T,D", *(f"{n} f+b" for n in ("sdpa", "fla", "softmax", "relu")), "softmax/SDPA", "relu/SDPA"]
    print("\n".join(markdown(head + ["FLA/softmax", "FLA/relu"], rows)))
    print("\nf+b as CUDA graph replays (GPU time), ms, and the ratios to SDPA's replay")
    head = ["B,H,T,D", "sdpa f+b graph", "softmax f+b graph", "relu f+b graph", "softmax/SDPA", "relu/SDPA"]
    print("\n".join(markdown(head, graph_rows)))


if __name__ == "__main__":
    main()
