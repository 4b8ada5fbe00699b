"""bench/bench_ddp.py: the report's loss differences and scaling, from run folders made here; each stage's
train.py commands and what each flag changes (the job queue a stand-in)."""

import argparse
import json
import os
import random
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_ddp  # noqa: E402


def fake_run(work, name, losses, rates, ranks, peak):
    d = os.path.join(work, name)
    os.makedirs(d)
    with open(os.path.join(d, "log.jsonl"), "w") as f:
        f.write(json.dumps({"iter": 0, "val_loss": 11.0}) + "\n")
        for i, (loss, rate) in enumerate(zip(losses, rates)):
            f.write(json.dumps({"iter": i, "train_loss": loss, "tok_per_s": rate, "dt_ms": 1.0}) + "\n")
    with open(os.path.join(d, "stdout.txt"), "w") as f:
        f.write(f"{ranks} rank(s) on cuda:0, ...\npeak memory {peak} GiB\ndone\n")
    with open(os.path.join(d, "command.txt"), "w") as f:
        f.write(f"python train.py # {name}\n")


def test_report(tmp_path, capsys):
    rng = random.Random(0)
    n = 12
    base = [10 - 0.1 * i + rng.random() * 1e-3 for i in range(n)]
    multi = list(base)
    multi[7] += 3e-3  # the largest difference, planted
    multi[3] -= 1e-3
    yard = [x + 5e-4 for x in base]
    work = str(tmp_path / "work")
    fake_run(work, "additive-single", base, [100.0] * 3 + [1000.0, 1010.0, 990.0] * 3, 1, 40.0)
    fake_run(work, "additive-multi", multi, [50.0] * 3 + [1900.0, 1950.0, 1800.0] * 3, 2, 30.0)
    fake_run(work, "additive-yardstick", yard, [1000.0] * n, 1, 41.0)
    args = argparse.Namespace(
        work=work,
        variants=["additive", "ddl-cc"],
        iters=n,
        skip=3,
        warmup=2,
        batch_size=4,
        grad_accum=8,
        out=str(tmp_path / "out"),
    )
    summary = bench_ddp.report(args)
    assert summary[("additive", "multi")] == pytest.approx(3e-3, rel=1e-6)
    assert summary[("additive", "yardstick")] == pytest.approx(5e-4, rel=1e-6)
    assert summary[("additive", "scaling")] == pytest.approx(1900.0 / 1000.0 / 2)  # medians, iters >= skip
    text = open(tmp_path / "out" / "bench_ddp.md").read()
    assert "(iter 7)" in text and "| 2 x 4 x 4 |" in text and "| 1 x 8 x 4 |" in text
    assert "| ddl-cc | single | not run |" in text
    losses = json.load(open(tmp_path / "out" / "bench_ddp_losses.json"))
    assert losses["additive-multi"] == multi and losses["ddl-cc-single"] is None


def test_max_difference_needs_enough_losses():
    assert bench_ddp.max_difference([1.0, 2.0], [1.5, 2.0], 2) == (0.5, 0)
    with pytest.raises(ValueError, match="need 3 losses"):
        bench_ddp.max_difference([1.0, 2.0], [1.0, 2.0, 3.0], 3)


def keys(cmd):
    """train.py's --key=value arguments of a command, as a dict."""
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_train_command_per_stage(tmp_path):
    """The same global batch in every stage: single and multi --batch-size x --grad-accum (torchrun over the
    GPUs of --gpus for multi), the yardstick twice the rows in half the micro-steps; --iters, --warmup, the
    variant and --work reach train.py; an odd --grad-accum has no yardstick."""
    args = argparse.Namespace(
        batch_size=4, grad_accum=8, iters=30, warmup=5, work=str(tmp_path), gpus="0,2,5"
    )
    train = [os.path.join(bench_ddp.REPO, "train.py"), os.path.join(bench_ddp.REPO, bench_ddp.CONFIG)]
    single, multi, yard = (bench_ddp.train_command(args, "ddl-cc", s) for s in bench_ddp.STAGES)
    assert single[:3] == [sys.executable, *train]
    assert multi[:7] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                         *train]  # fmt: skip
    for cmd, stage, rows, steps in (
        (single, "single", 4, 8),
        (multi, "multi", 4, 8),
        (yard, "yardstick", 8, 4),
    ):
        k = keys(cmd)
        assert (k["batch_size"], k["gradient_accumulation_steps"]) == (str(rows), str(steps)), stage
        assert (k["max_iters"], k["warmup_iters"], k["lr_decay_iters"]) == ("30", "5", "300")
        assert k["residual"] == "ddl-cc" and k["out_dir"] == os.path.join(str(tmp_path), f"ddl-cc-{stage}")
    args.grad_accum = 7
    with pytest.raises(SystemExit, match="--grad-accum must be even for the yardstick, got 7"):
        bench_ddp.train_command(args, "additive", "yardstick")
    args.grad_accum = 2  # the least even count: micro-steps of 1
    assert keys(bench_ddp.train_command(args, "additive", "yardstick"))["gradient_accumulation_steps"] == "1"


def test_run_stage_slots_commands_and_failures(monkeypatch, tmp_path):
    """single and yardstick: one run per GPU of --gpus at a time; multi: one run on all of them; each run's
    command as typed, with the GPUs it got, in its folder; the variants whose run failed are returned."""
    seen = {}

    def run_commands(jobs, slots, on_end):
        seen[jobs[0]["name"].split()[0]] = slots
        for i, job in enumerate(jobs):
            assert job["cwd"] == bench_ddp.REPO and job["log"] == os.path.join(job["out_dir"], "stdout.txt")
            job.update(status="exit 1" if job["variant"] == "ddl" else "exit 0", slot=slots[i % len(slots)])
            on_end(job)
        return jobs

    monkeypatch.setattr(bench_ddp, "run_commands", run_commands)
    args = argparse.Namespace(batch_size=4, grad_accum=8, iters=3, warmup=1, work=str(tmp_path), gpus="0,2",
                              variants=["additive", "ddl", "ddl-cc"])  # fmt: skip
    assert bench_ddp.run_stage(args, "single") == ["ddl"]
    assert bench_ddp.run_stage(args, "multi") == ["ddl"]
    assert seen == {"[single]": ["0", "2"], "[multi]": ["0,2"]}
    text = (tmp_path / "ddl-single" / "command.txt").read_text()  # the second job: the second GPU
    assert text.startswith("CUDA_VISIBLE_DEVICES=2 python train.py configs/gpt2_small.py --residual=ddl ")
    text = (tmp_path / "additive-multi" / "command.txt").read_text()
    assert text.startswith("CUDA_VISIBLE_DEVICES=0,2 python -m torch.distributed.run --standalone")


def test_main_stages_and_refusals(monkeypatch, capsys, tmp_path):
    ran = []
    monkeypatch.setattr(bench_ddp, "run_stage", lambda args, stage: ran.append((stage, args)) or [])
    monkeypatch.setattr(bench_ddp, "report", lambda args: ("report", args))

    def main(*argv):
        monkeypatch.setattr(sys, "argv", ["bench_ddp.py", *argv])
        return bench_ddp.main()

    for argv, message in [
        ((), "the following arguments are required: --stage"),
        (("--stage", "all"), "invalid choice: 'all'"),
        (("--stage", "multi", "--gpus", "0,1,2"), "--grad-accum 8 must be divisible by the 3 GPUs of --gpus"),
        (
            ("--stage", "multi", "--gpus", "0,1", "--grad-accum", "3"),
            "--grad-accum 3 must be divisible by the 2",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            main(*argv)
        assert message in f"{e.value.code} {capsys.readouterr().err}", argv
    assert ran == []
    main("--stage", "multi", "--gpus", "0,1", "--grad-accum", "2", "--variants", "ddl,,additive")
    ((stage, args),) = ran
    assert (stage, args.variants, args.grad_accum, args.gpus) == ("multi", ["ddl", "additive"], 2, "0,1")
    kind, args = main("--stage", "report", "--iters", "9", "--skip", "2", "--out", "O", "--work", "W")
    assert kind == "report" and len(ran) == 1  # a report runs nothing
    assert (args.iters, args.skip, args.out, args.work) == (9, 2, "O", "W")
    monkeypatch.setattr(bench_ddp, "run_stage", lambda args, stage: ["ddl"])
    with pytest.raises(
        SystemExit, match=r"bench_ddp: yardstick failed for \['ddl'\]: see W/<variant>-yardstick"
    ):
        main("--stage", "yardstick", "--work", "W")


def test_report_scaling_is_against_the_one_gpu_run(tmp_path, capsys, monkeypatch):
    """scaling = median tokens/s (iterations from --skip) of N GPUs / the 1-GPU run's, efficiency that / N;
    loss differences over the first --iters iterations; the yardstick's tokens/s is no baseline."""
    monkeypatch.chdir(tmp_path)
    n, work = 12, str(tmp_path / "work")
    base = [10 - 0.2 * i for i in range(n)]
    multi = [x + 1e-3 * (i % 4) for i, x in enumerate(base)]
    multi[9] += 0.05  # the largest difference, past the first 8 iterations
    single_rates = [10.0, 20.0, 30.0] + [300.0, 310.0, 290.0, 305.0, 295.0, 320.0, 280.0, 330.0, 270.0]
    multi_rates = [5.0, 6.0, 7.0] + [1000.0, 1100.0, 900.0, 1050.0, 950.0, 1200.0, 800.0, 1010.0, 990.0]
    fake_run(work, "ddl-single", base, single_rates, 1, 20.0)
    fake_run(work, "ddl-multi", multi, multi_rates, 4, 9.0)
    fake_run(work, "ddl-yardstick", base, [500.0] * n, 1, 21.0)  # tokens/s unlike the 1-GPU run's
    args = argparse.Namespace(work=work, variants=["ddl"], iters=8, skip=3, warmup=2, batch_size=2,
                              grad_accum=8, out="")  # fmt: skip
    summary = bench_ddp.report(args)
    s = statistics.median(multi_rates[3:]) / statistics.median(single_rates[3:])
    assert summary[("ddl", "scaling")] == pytest.approx(s / 4)
    diffs = [abs(a - b) for a, b in zip(multi[:8], base[:8])]
    assert summary[("ddl", "multi")] == pytest.approx(max(diffs)) and summary[("ddl", "yardstick")] == 0.0
    rows = {line.split(" | ")[1]: line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ddl |")}  # fmt: skip
    assert rows["multi"][2:6] == ["4 x 2 x 2", "1,000", f"{s:.2f}x ({s / 4:.2f} of 4x)", "9.0"]
    assert rows["single"][2:5] == ["1 x 2 x 8", "300", ""] and rows["yardstick"][2] == "1 x 4 x 4"
    assert rows["multi"][6].strip(" |") == f"{max(diffs):.2e} (iter {diffs.index(max(diffs))})"
    args.skip = 0  # the slow first iterations in the medians
    s0 = statistics.median_high(multi_rates) / statistics.median_high(single_rates)
    assert bench_ddp.report(args)[("ddl", "scaling")] == pytest.approx(s0 / 4)
    args.iters = n
    assert bench_ddp.report(args)[("ddl", "multi")] == pytest.approx(abs(multi[9] - base[9]))
    assert os.listdir(tmp_path) == ["work"]  # no --out: nothing written
