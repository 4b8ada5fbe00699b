"""Deltaformer attention speed on one GPU: causal SDPA vs FLA 0.6.0's Deltaformer vs ours (Triton).

    python bench/bench_attention.py --json bench.json   # five shapes (SHAPES), bf16

ms, medians of do_bench (common.median_ms); "fwd": the forward alone, "f+b": forward + backward of all
inputs; "f+b graph": the same as a CUDA graph's replay (the GPU's time without the host's launch work,
which at these sizes can exceed it). FLA's Deltaformer (when `fla` imports): its u-stage
(ParallelDeltaformerFunction) then causal SDPA. Our floors: the larger of the minimal matrix FLOPs
(forward 4 T^2 D per head, f+b 12 T^2 D) over the measured bf16 matmul rate and the minimal bytes over the
copy bandwidth. --json writes every number.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import command, graph_ms, markdown, median_ms, versions, write_json  # noqa: E402

from kernels.deltaformer import deltaformer_u_triton  # noqa: E402

SHAPES = [(8, 12, 1024, 64), (8, 6, 1024, 128), (4, 12, 2048, 64), (2, 12, 4096, 64), (8, 16, 1024, 64)]


def measure_ceilings():
    """bf16 matmul TFLOP/s on random data and device-to-device copy GB/s (read + write)."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9
    x = torch.empty(2 << 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    return tflops, 2 * x.numel() / median_ms(lambda: y.copy_(x)) / 1e6


def make(B, H, T, D, kernel="softmax", dtype=torch.bfloat16, seed=0):
    """Random inputs. beta in (0, beta_max) as in the tests (tests/test_deltaformer.py, beta_max_for): relu
    and linear kappa of unit w, k still grow u with T for unrelated w and k (linear: ~6x at T = 1024, D = 64
    with beta up to 1), so their beta shrinks with T, u - v staying ~0.1-0.5 |v|. The same q, k, v, w (seed)
    for every kernel. relu's times include the norms folded around the kernels (`deltaformer_u_triton`)."""
    torch.manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(4))
    beta_max = {"softmax": 1.0, "relu": min(1.0, 256.0 / T), "linear": min(1.0, 8.0 * T**-0.5)}[kernel]
    beta = (beta_max * torch.rand(B, H, T, device="cuda")).to(dtype).requires_grad_(True)
    return q, k, v, w, beta


def time_fn(fn, inputs, backward):
    """Median ms of the forward alone (no grad) or of the forward + backward of every input (do_bench resets
    their .grad between calls, outside the timed span)."""
    return median_ms(call(fn, inputs, backward), grad_to_none=list(inputs))


def call(fn, inputs, backward, reset=False):
    """One call of fn on inputs: the forward under no_grad, or forward + backward (reset: the inputs' .grad
    set to None first, as do_bench's grad_to_none does, else every call adds one more kernel per input)."""
    grad_out = torch.randn_like(fn(*inputs))

    def run():
        if not backward:
            with torch.no_grad():
                return fn(*inputs)
        for x in inputs if reset else ():
            x.grad = None
        fn(*inputs).backward(grad_out)

    return run


def sdpa(q, k, v, w, beta):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ours(kernel, **opts):
    def fn(q, k, v, w, beta):
        u = deltaformer_u_triton(k, v, w, beta, kernel=kernel, **opts)
        return F.scaled_dot_product_attention(q, k, u, is_causal=True)

    return fn


def graph_time(fn, inputs, backward=True):
    """Median ms of a CUDA graph's replay of one forward(+backward): the GPU's time alone."""
    ms = graph_ms(call(fn, inputs, backward, reset=True))
    for x in inputs:
        x.grad = None
    return ms


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


def measure_shape(B, H, T, D, fla, tflops, gbs):
    """fwd and f+b medians of SDPA, FLA, ours (softmax, relu), f+b graph replays, and our floors, ms."""
    res = {}
    fns = {"sdpa": sdpa, "fla": fla, "softmax": ours("softmax"), "relu": ours("relu")}
    for name, fn in fns.items():
        if fn is None:
            continue
        inputs = make(B, H, T, D, kernel="relu" if name == "relu" else "softmax")
        for mode in ("fwd", "f+b"):
            res[f"{name} {mode}"] = time_fn(fn, inputs, backward=mode == "f+b")
        if name != "fla":  # FLA's Python loop over chunks: its host time is its cost
            res[f"{name} f+b graph"] = graph_time(fn, inputs)
    print(f"{B},{H},{T},{D}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    bh, n = B * H, B * H * T * D
    bytes_fwd = 2 * (5 * n + bh * T)  # read q k v w beta, write o (bf16)
    bytes_fb = bytes_fwd + 2 * (6 * n + bh * T)  # + read do, write dq dk dv dw dbeta
    res["floor fwd"] = max(4 * T * T * D * bh / tflops / 1e9, bytes_fwd / gbs / 1e6)
    res["floor f+b"] = max(12 * T * T * D * bh / tflops / 1e9, bytes_fb / gbs / 1e6)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", default="", help="write all numbers to this file")
    args = ap.parse_args()
    save = lambda: args.json and write_json(args.json, results)

    print(f"Command: `{command(__file__)}`", versions(), sep="\n")
    tflops, gbs = measure_ceilings()
    print(f"measured ceilings: bf16 matmul {tflops:.0f} TFLOP/s, device copy {gbs:.0f} GB/s")
    results = {"tflops": tflops, "gbs": gbs, "shapes": {}}
    fla = None if args.no_fla else fla_fn()
    for shape in SHAPES:
        results["shapes"][",".join(map(str, shape))] = measure_shape(*shape, fla, tflops, gbs)
        save()  # after every shape: a run cut short keeps what it measured

    print("\nmedians in ms, bf16; ours/SDPA = time ratio; FLA/ours = speed-up over FLA 0.6.0")
    cols = [f"{n} {m}" for n in ("sdpa", "fla", "softmax", "relu") for m in ("fwd", "f+b")]
    head = ["B,H,T,D", *cols, "softmax/SDPA f+b", "relu/SDPA f+b", "FLA/softmax f+b", "FLA/relu f+b"]
    rows, graph_rows = [], []
    for shape, r in results["shapes"].items():
        sd, fl, so, re_ = (r.get(c, math.nan) for c in ("sdpa f+b", "fla f+b", "softmax f+b", "relu f+b"))
        cells = [f"{r.get(c, math.nan):.3f}" for c in cols] + [
            f"{x:.2f}x" for x in (so / sd, re_ / sd, fl / so, fl / re_)
        ]
        rows.append([shape, *cells, f"{r['floor fwd']:.3f}", f"{r['floor f+b']:.3f}"])
        sd, so, re_ = (r.get(f"{n} f+b graph", math.nan) for n in ("sdpa", "softmax", "relu"))
        graph_rows.append(
            [shape] + [f"{x:.3f}" for x in (sd, so, re_)] + [f"{so / sd:.2f}x", f"{re_ / sd:.2f}x"]
        )
    print("\n".join(markdown(head + ["floor fwd", "floor f+b"], rows)))
    # the same f+b as CUDA graph replays: the GPU's time alone. At these sizes the host's launch work
    # (~1.3 ms per f+b for ours, 0.25 for SDPA) can exceed it, and do_bench then times the host.
    print("\nf+b as CUDA graph replays (GPU time), ms, and the ratios to SDPA's replay")
    head = ["B,H,T,D", "sdpa f+b graph", "softmax f+b graph", "relu f+b graph", "softmax/SDPA", "relu/SDPA"]
    print("\n".join(markdown(head, graph_rows)))


if __name__ == "__main__":
    main()
