"""DDL kernel micro-benchmarks (ops/ddl/, one GPU): time per call (median_ms) of the update, the fused
update + read-out and the compressors, forward and forward + backward (autograd.grad: no accumulation into
.grad), with the minimal bytes each must move (S: a pass over the [N, d, d_v] state, V: over [N, d]) and
the GB/s against the copy bandwidth measured in the same run; torch.compile of the reference beside them.

    python bench/bench_ddl.py                 # fp32 and bf16 state, d 768, d_v 4 and 1, K 4, N = 32,768
    python bench/bench_ddl.py --quick         # Triton, fp32 only
    python bench/bench_ddl.py --sweeps        # only launch shapes (CC backward, TC fwd and bwd), GPU time
"""

import argparse
import functools
import os

import torch
from common import command, graph_ms, median_ms, versions, write_json  # bench/common.py

N, D = 32768, 768  # tokens (as [N / 1024, 1024]), width


def state_inputs(dtype, dv, small=torch.float32):
    """Inputs that require grad, [B, T] = [N / 1024, 1024]: the state x [B, T, d, d_v] and k [B, T, d] in
    dtype; v [B, T, d_v], beta [B, T] and the CC weight w [d, d_v] in small (fp32, as in the model)."""
    B, T = N // 1024, 1024
    make = lambda f, *shape, dt: f(*shape, device="cuda", dtype=dt, requires_grad=True)  # noqa: E731
    x, k = make(torch.randn, B, T, D, dv, dt=dtype), make(torch.randn, B, T, D, dt=dtype)
    v, beta = make(torch.randn, B, T, dv, dt=small), make(torch.rand, B, T, dt=small)
    return x, k, v, beta, make(torch.randn, D, dv, dt=small)


def record(rows, timer, name, fn, nbytes):
    """Times fn (timer after one call that compiles it), prints its line and appends its row to rows; a case
    that fails prints why and the run goes on. The cases call it as case(name, fn, nbytes) (bench_kernels)."""
    try:
        fn()
        ms = timer(fn)
    except Exception as e:  # noqa: BLE001
        print(f"{name} FAILED: {type(e).__name__}: {e}"[:300], flush=True)
        return
    rows.append(r := dict(name=name, us=ms * 1e3, GB=nbytes / 1e9, GBps=nbytes / ms / 1e6))
    print(f"{name:60s} {r['us']:9.1f} us  {r['GB']:7.3f} GB  {r['GBps']:7.0f} GB/s", flush=True)


def bench_kernels(args):
    rows = []
    case = functools.partial(record, rows, graph_ms if args.sweeps else median_ms)  # sweeps: GPU time only
    bufs = [torch.randint(0, 255, (2**30,), dtype=torch.uint8, device="cuda"), None]
    bufs[1] = torch.empty_like(bufs[0])
    case("copy 1 GiB (read + write)", lambda: bufs[1].copy_(bufs[0]), 2 * 2**30)
    bufs.clear()
    # the model's state dtype first; --sweeps: only the launch shapes, of both (--quick or not)
    for dtype in (torch.float32,) if args.quick and not args.sweeps else (torch.float32, torch.bfloat16):
        sweep_update(case, dtype) if args.sweeps else bench_kernels_dtype(args, dtype, case)
        torch.cuda.empty_cache()
    if not args.sweeps:
        bench_kernels_dv1(args, case)
    return rows


def sweep_update(case, dtype):
    """Launch shapes, d_v = 4, each line naming the LAUNCH entry it sets (the shipped one marked): TC's
    forward (update_tc_fwd: one kernel, or the update and tc_fwd's), backward (tc_bwd), then the CC
    backward's (update_bwd; one update + CC read-out f+b, four in a row with inputs kept, eight rebuilt from
    the first: chains of 0-7 as the model's at every 4th block's state). Bytes: minimal passes (S, V)."""
    from ops import ddl
    from ops.ddl.triton import LAUNCH, _cfg

    d, dv = D, 4
    # what ships for this dtype (_cfg less sub-entries), as (name, value) pairs: a shape is it if a subset
    ship = {key: {(n, c) for n, c in _cfg(key, dtype).items() if not isinstance(c, dict)} for key in LAUNCH}
    tag = f"{str(dtype).replace('torch.', '')}, N={N}"
    x, k, v, beta, w = state_inputs(dtype, dv)
    gx, gh = torch.randn_like(x), torch.randn_like(k)
    S, V = (N * d * n * torch.finfo(dtype).bits // 8 for n in (dv, 1))

    def sweep(key, cfgs, *cases):
        """Each of cases (label, fn, bytes) with LAUNCH[key] set to each of cfgs in turn, then restored."""
        saved = LAUNCH[key]
        for cfg in cfgs:
            LAUNCH[key] = cfg
            for label, fn, nbytes in cases:
                case(f"{label} {key}={cfg}{' (shipped)' * (cfg.items() <= ship[key])} [{tag}]", fn, nbytes)
        LAUNCH[key] = saved

    cw, read = (torch.randn(*s, device="cuda", requires_grad=True) for s in ((d, dv, 4), (dv,)))  # TC: K = 4

    def fused_run(rebuild, n=4, tc=False):  # n fused CC (TC) updates in a row; rebuild: keep x only (model)
        op, ws = (ddl.ddl_update_compress_tc, (cw, read)) if tc else (ddl.ddl_update_compress_cc, (w,))
        X, hs, chain = x, [], None
        for _ in range(n):
            out = op(X, k, v, beta, *ws, backend="triton", rebuild_from=chain, return_step=rebuild)
            chain = (x, (chain[1] if chain else ()) + (out[2],)) if rebuild else None
            X, hs = out[0], hs + [out[1]]
        return torch.autograd.grad([X, *hs], (x, k, v, beta, *ws), [gx] + [gh] * n)

    tc = lambda: ddl.ddl_update_compress_tc(x, k, v, beta, cw, read, backend="triton")  # noqa: E731
    fused = ((32, 2, 4, None), (32, 2, 8, 128), (64, 2, 8, 128), (32, 3, 8, 128), (32, 2, 16, 64))
    cfgs = [{**LAUNCH["update_tc_fwd"], "FUSED": False}]  # 2 kernels; fused: 2 programs an SM at these regs
    cfgs += [dict(FUSED=True, TOKENS=t, STAGES=st, num_warps=nw, maxnreg=r) for t, st, nw, r in fused]
    sweep("update_tc_fwd", cfgs, ("update+tc fwd", tc, 2 * S + 2 * V))
    alts = ({}, dict(STAGES=2), dict(GK_STAGES=2), dict(GK_BLOCK_D=256), dict(TOKENS=16),
            dict(BLOCK_D=256, num_warps=8), dict(TOKENS=64))  # fmt: skip
    sweep(
        "tc_bwd", [{**LAUNCH["tc_bwd"], **a} for a in alts],  # the shipped shape, then each with changes
        ("update+tc f+b", lambda: fused_run(False, 1, True), 6 * S + 6 * V),
        ("8 x update+tc f+b, rebuilt from the first", lambda: fused_run(True, 8, True), 8 * (6 * S + 6 * V)),
    )  # fmt: skip
    bwd = ((32, 1, 4), (16, 1, 4), (32, 0, 4))
    cfgs = [dict(TOKENS=t, STAGES=1 + p, num_warps=nw) for t, p, nw in bwd]  # (tokens, pipelined, warps)
    sweep(  # the rebuilt runs' bytes as without the rebuild, whose reads of k come on top
        "update_bwd", cfgs, ("update+cc f+b", lambda: fused_run(False, 1), 5 * S + 5 * V),
        ("4 x update+cc f+b, each input kept", lambda: fused_run(False), 4 * (5 * S + 5 * V)),
        ("8 x update+cc f+b, rebuilt from the first", lambda: fused_run(True, 8), 8 * (5 * S + 5 * V)),
    )  # fmt: skip


def bench_kernels_dv1(args, case):
    """Scalar DDL (d_v = 1): the state is one d-vector per token, like the additive stream."""
    from ops import ddl

    x, k, v, beta, _ = state_inputs(torch.float32, 1)
    gx = torch.randn_like(x)
    S = N * D * 4
    upd_c = torch.compile(ddl.ddl_update_ref)
    cases = [("triton", lambda: ddl.ddl_update(x, k, v, beta, backend="triton"))]
    if not args.quick:
        cases.append(("torch.compile(ref)", lambda: upd_c(x, k, v, beta)))
    for name, fn in cases:
        case(f"update fwd  {name} [float32, d_v=1, N={N}]", fn, 3 * S)
        fb = lambda fn=fn: torch.autograd.grad(fn(), (x, k, v, beta), gx)
        case(f"update f+b  {name} [float32, d_v=1, N={N}]", fb, 8 * S)


def bench_kernels_dtype(args, dtype, case):
    from ops import ddl

    dev, d, dv, K, B, T = "cuda", D, 4, 4, N // 1024, 1024
    S, V = (N * d * n * torch.finfo(dtype).bits // 8 for n in (dv, 1))  # bytes: a pass over the state, [N, d]
    tag = f"{str(dtype).replace('torch.', '')}, N={N}"
    x, k, v, beta, w = state_inputs(dtype, dv, dtype)
    cw, read = (torch.randn(*s, device=dev, requires_grad=True) for s in ((d, dv, K), (dv,)))
    emb = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
    gx, gh = torch.randn_like(x), torch.randn_like(k)
    leaves = (x, k, v, beta, w, cw, read, emb)

    upd_c = torch.compile(ddl.ddl_update_ref)
    updcc_c = torch.compile(ddl.ddl_update_compress_cc_ref)
    tc_c = torch.compile(ddl.compress_tc_ref)

    def fb(fn, grads):  # forward + backward; autograd.grad: no read-modify-write of .grad in the timing
        def run():
            outs = fn()
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.grad(outs, leaves, grads[: len(outs)], allow_unused=True)  # all require grad

        return run

    def unfused():
        xn = ddl.ddl_update(x, k, v, beta, backend="triton")
        return xn, ddl.compress_cc(xn, w, backend="triton")

    upd = lambda: ddl.ddl_update(x, k, v, beta, backend="triton")  # noqa: E731
    updcc = lambda: ddl.ddl_update_compress_cc(x, k, v, beta, w, backend="triton")  # noqa: E731
    updtc = lambda: ddl.ddl_update_compress_tc(x, k, v, beta, cw, read, backend="triton")  # noqa: E731
    cases = [
        ("update fwd  triton", upd, 2 * S + V),
        ("update fwd  torch.compile(ref)", lambda: upd_c(x, k, v, beta), 2 * S + V),
        ("update f+b  triton", fb(upd, (gx,)), 5 * S + 3 * V),
        ("update f+b  torch.compile(ref)", fb(lambda: upd_c(x, k, v, beta), (gx,)), 5 * S + 3 * V),
        ("update+cc f+b  fused triton", fb(updcc, (gx, gh)), 5 * S + 5 * V),
        ("update+cc fwd  fused triton", updcc, 2 * S + 2 * V),
        ("update+cc f+b  triton, unfused", fb(unfused, (gx, gh)), 5 * S + 5 * V),
        ("update+cc f+b  torch.compile(ref)", fb(lambda: updcc_c(x, k, v, beta, w), (gx, gh)), 5 * S + 5 * V),
        ("update+tc f+b  fused triton", fb(updtc, (gx, gh)), 6 * S + 6 * V),
        ("update+tc fwd  fused triton", updtc, 2 * S + 2 * V),
        ("cc f+b  triton", fb(lambda: ddl.compress_cc(x, w, backend="triton"), (gh,)), 3 * S + 2 * V),
        ("tc f+b  triton", fb(lambda: ddl.compress_tc(x, cw, read, backend="triton"), (gh,)), 3 * S + 2 * V),
        ("tc f+b  torch.compile(ref)", fb(lambda: tc_c(x, cw, read), (gh,)), 3 * S + 2 * V),
        ("ec f+b  triton", fb(lambda: ddl.expand_ec(emb, cw, backend="triton"), (gx,)), 2 * S + 3 * V),
    ]
    if dtype != torch.float32 or args.quick:  # torch.compile comparisons once, in fp32 (model's dtype)
        cases = [c for c in cases if "torch.compile" not in c[0]]
    for name, fn, nbytes in cases:
        case(f"{name} [{tag}]", fn, nbytes)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Triton only, fp32 state")
    p.add_argument("--sweeps", action="store_true", help="only launch shapes, as CUDA graph replays")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for bench_ddl.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ddl.py needs a CUDA GPU")
    print(f"Command: `{command(__file__)}`", versions(), sep="\n")
    print(f"{'case':60s} {'time':>12s}  {'bytes':>10s}  {'rate':>12s}", flush=True)
    run = dict(command=command(__file__), versions=versions(), rows=bench_kernels(args))
    if args.out:
        write_json(os.path.join(args.out, "bench_ddl.json"), run)


if __name__ == "__main__":
    main()
