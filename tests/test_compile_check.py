"""bench/compile_check.py: a launch compiled for sm_90 on this machine, with its registers and spills; which
launches main() and --mix compile."""

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import compile_check  # noqa: E402


def _scale(X, Y, PAIRS, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a, b = PAIRS
    y = tl.load(X + offs, mask=offs < N) * 2.0
    for i in tl.static_range(len(a)):
        y += tl.load(a[i] + offs, mask=offs < N) * tl.load(b[i] + offs, mask=offs < N)
    tl.store(Y + offs, y, mask=offs < N)


def _total(X, Y, BLOCK: tl.constexpr):  # a sum across 4 warps: through shared memory, with barriers
    tl.store(Y, tl.sum(tl.load(X + tl.arange(0, BLOCK)), axis=0))


def _loop(X, Y, N, BLOCK: tl.constexpr):  # a loop over N: loads, an exp and fp32 arithmetic per pass
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, N, BLOCK):
        acc += tl.exp(tl.load(X + i + tl.arange(0, BLOCK)) * 3.0)
    tl.store(Y + tl.arange(0, BLOCK), acc)


# as compile_check runs: a process whose triton was imported without TRITON_INTERPRET (this one's was, by
# conftest.py, for the kernel tests)
CHILD = """
import sys
import torch
import triton
sys.path[:0] = [{bench!r}, {tests!r}]
import compile_check
from test_compile_check import _loop, _scale, _total
x = torch.empty(512)
pairs = ((x, x), (x, x))  # a tuple of tuples: the label gives their lengths
compile_check.compile_launch(triton.jit(_scale), (x, x, pairs, 8), dict(BLOCK=8, num_warps=1))
compile_check.compile_launch(triton.jit(_total), (x, x), dict(BLOCK=512, num_warps=4))
print("failed:", compile_check.FAILED)
"""

# --mix: the SASS of a kernel with one loop over its input
MIX = """
import sys
import torch
import triton
sys.path[:0] = [{bench!r}, {tests!r}]
import compile_check
from test_compile_check import _loop
sys.argv.append("--mix")
x = torch.empty(4096)
compile_check.compile_launch(triton.jit(_loop), (x, x, 4096), dict(BLOCK=256, num_warps=4))
"""

# what the runtime's specialization gives three launches of one kernel: pointers 16-byte aligned or not,
# integers divisible by 16, equal to 1, or neither
SPECIALIZED = """
import sys
import torch
import triton
sys.path[:0] = [{bench!r}, {tests!r}]
import compile_check
from test_compile_check import _scale
fn, x = triton.jit(_scale), torch.empty(64)
for args in ((x, x, (), 64), (x[1:], x, (), 7), (x, x[1:], (), 1)):
    _, sig, consts, attrs = compile_check.specialized(fn, args, dict(BLOCK=8, num_warps=1))
    print(sig["N"], sorted(i for (i,), a in attrs.items() if ["tt.divisibility", 16] in a), consts.get((3,)))
"""


def test_a_launch_compiles_for_sm90_with_its_resources(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache of an earlier run
    code = CHILD.format(bench=os.path.join(REPO, "bench"), tests=os.path.join(REPO, "tests"))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line, total, failed = result.stdout.strip().splitlines()
    assert line.startswith("ok   _scale BLOCK=8 X:*fp32 PAIRS=(2, 2) {'num_warps': 1}: shared memory"), line
    assert line.endswith(" registers, stack 0 B, barriers 0") and failed == "failed: []", line
    assert total.startswith("ok   _total BLOCK=512") and int(total.split("barriers ")[1]) > 0, total


def test_mix_counts_a_loop_body_by_class(tmp_path):
    """--mix: one line for the loop (its instruction count and classes): its loads, MUFU (the exp) and fp32
    arithmetic, and no MMA; the count is the classes' sum at most."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = MIX.format(bench=os.path.join(REPO, "bench"), tests=os.path.join(REPO, "tests"))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loops = [line.split("loop of ")[1] for line in result.stdout.splitlines() if "loop of " in line]
    assert len(loops) == 1, result.stdout
    n, mix = loops[0].split(": ")
    counts = dict(zip(mix.split()[::2], map(int, mix.split()[1::2])))
    assert counts["LDG"] >= 1 and counts["MUFU"] >= 1 and counts["FP32"] >= 1 and "MMA" not in counts, counts
    assert sum(counts.values()) <= int(n), (n, counts)


def test_launches_are_specialized_as_at_run_time(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = SPECIALIZED.format(bench=os.path.join(REPO, "bench"), tests=os.path.join(REPO, "tests"))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # X, Y (arguments 0, 1) and N (3) marked divisible by 16 where they are; N = 1 a constexpr
    assert result.stdout.splitlines() == ["i32 [0, 1, 3] None", "i32 [1] None", "constexpr [0] 1"]


def test_a_process_with_interpreted_triton_is_told_why_it_cannot_compile(monkeypatch, capsys):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this process compiles Triton kernels (CUDA): nothing interpreted")
    monkeypatch.delenv("TRITON_INTERPRET")  # the kernel decorated for the compiler, triton's library not
    monkeypatch.setattr(compile_check, "SEEN", {})
    monkeypatch.setattr(compile_check, "FAILED", [])
    x = torch.empty(8)
    compile_check.compile_launch(triton.jit(_scale), (x, x, ((x, x), (x, x)), 8), dict(BLOCK=8, num_warps=1))
    (line,) = compile_check.SEEN.values()
    assert line.startswith("FAIL _scale BLOCK=8") and "imported with TRITON_INTERPRET=1" in line, line
    assert compile_check.FAILED and capsys.readouterr().out.strip() == line


def test_main_compiles_every_launch_and_mix_only_the_u_stage(monkeypatch, capsys):
    """main() turns every `kernel[grid](...)` into a compile; --mix: only the Deltaformer u-stage's launches
    (bf16), else the u-stage's and every model variant's; exit 1 when any compile failed."""
    from triton.runtime.jit import KernelInterface

    monkeypatch.setattr(KernelInterface, "__getitem__", KernelInterface.__getitem__)  # restored after
    for name, value in (("SEEN", {}), ("FAILED", []), ("SPILLS", [])):
        monkeypatch.setattr(compile_check, name, value)
    ran, compiled = [], []
    monkeypatch.setattr(compile_check, "run_deltaformer_variants", lambda mix=False: ran.append(("u", mix)))
    monkeypatch.setattr(compile_check, "run_model_variants", lambda: ran.append(("model",)))
    monkeypatch.setattr(compile_check, "compile_launch", lambda fn, a, kw: compiled.append((fn, a, kw)))
    for argv, want in ((["--mix"], [("u", True)]), ([], [("u", False), ("model",)])):
        ran.clear()
        monkeypatch.setattr(sys, "argv", ["compile_check.py", *argv])
        with pytest.raises(SystemExit) as e:
            compile_check.main()
        assert e.value.code == 0 and ran == want, argv
    kernel = object.__new__(KernelInterface)
    kernel[(4,)](1, 2, BLOCK=8)
    assert compiled == [(kernel, (1, 2), dict(BLOCK=8))]
    compile_check.FAILED.append("x")
    with pytest.raises(SystemExit) as e:
        compile_check.main()
    assert e.value.code == 1 and "failed: ['x']" in capsys.readouterr().out


def test_mix_takes_the_bf16_u_stage_shapes(monkeypatch):
    """The u-stage launches: every kernel and `lowp` at head dims 64 and 128 in bf16, and in fp32 and fp16
    too unless --mix (fp16 with w = k, as in the model by default)."""
    import ops.deltaformer as df

    seen = []

    def u(k, v, w, beta, kernel, lowp):
        seen.append((k.shape[-1], k.dtype, kernel, lowp, w is k))
        return v * 1.0

    monkeypatch.setattr(df, "deltaformer_u_triton", u)
    every = [(D, dt, kernel, lowp, dt == torch.float16) for D, dt in
             ((64, torch.bfloat16), (128, torch.bfloat16), (64, torch.float32), (64, torch.float16),
              (128, torch.float32)) for kernel in df.KERNELS for lowp in (True, False)]  # fmt: skip
    compile_check.run_deltaformer_variants(mix=True)
    assert seen == every[: 4 * len(df.KERNELS)]
    seen.clear()
    compile_check.run_deltaformer_variants()
    assert seen == every
