"""bench/common.py: the job queue (run_commands) with fake jobs, a host-clock Span, the markdown table."""

import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import common  # noqa: E402

FAKE = """
import json, os, sys, time
name, do, sleep, log = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
with open(log, "a") as f:
    f.write(json.dumps(dict(variant=name, gpu=gpu, start=time.time())) + "\\n")
if do == "crash":
    os._exit(3)
time.sleep(sleep)
with open(log, "a") as f:
    f.write(json.dumps(dict(variant=name, gpu=gpu, end=time.time())) + "\\n")
"""


def make_jobs(tmp_path, specs):
    """Jobs that log (name, the GPU they see, start and end time) to log.jsonl, then do what specs say
    ("ok", or "crash" at once), then sleep."""
    log = str(tmp_path / "log.jsonl")
    return log, [dict(name=n, cmd=[sys.executable, "-c", FAKE, n, do, str(s), log]) for n, do, s in specs]


def read_log(log):
    with open(log) as f:
        return [json.loads(line) for line in f]


def spans(events, gpu):
    by = {}
    for e in events:
        if e["gpu"] == gpu:
            by.setdefault(e["variant"], {}).update(e)
    return sorted((s["start"], s.get("end", s["start"])) for s in by.values())


def test_run_commands_two_gpus_crash_and_timeout(tmp_path, monkeypatch):
    """No assertion rests on timing: run_commands's clock jumps 100 s when "a" ends, so the hang (started
    before) is then over its 50 s and killed while b, c and d still wait, and the freed g0 takes b."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "parent")
    jump = []
    monkeypatch.setattr(common, "time", types.SimpleNamespace(time=lambda: time.time() + sum(jump),
                                                              sleep=time.sleep))  # fmt: skip
    specs = [("hang", "ok", 30.0), ("a", "ok", 0.0), ("crash", "crash", 0.0), ("b", "ok", 0.1)]
    specs += [("c", "ok", 0.1), ("d", "ok", 0.1)]
    log, jobs = make_jobs(tmp_path, specs)
    ended = []

    def on_end(job):
        ended.append(job)
        jump.extend([100.0] if job["name"] == "a" else [])

    out = common.run_commands(jobs, ["g0", "g1"], job_timeout=50.0, on_end=on_end, poll_s=0.05)
    assert out is jobs and sorted(j["name"] for j in ended) == sorted(s[0] for s in specs)
    by = {j["name"]: j for j in jobs}
    assert by["hang"]["status"] == "killed after 50 s"
    assert by["crash"]["status"] == "exit 3"
    events = read_log(log)
    for name in "abcd":
        assert by[name]["status"] == "exit 0" and by[name]["slot"] in ("g0", "g1")
        seen = {e["gpu"] for e in events if e["variant"] == name}
        assert seen == {by[name]["slot"]}  # the child's CUDA_VISIBLE_DEVICES is its slot's
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "parent"
    starts = [e["variant"] for e in events if "start" in e]
    assert sorted(starts) == sorted(s[0] for s in specs)  # every job started exactly once
    for gpu in ("g0", "g1"):  # one job per GPU at a time: a GPU's jobs do not overlap
        s = spans(events, gpu)
        assert all(a[1] <= b[0] for a, b in zip(s, s[1:])), (gpu, s)
    assert (by["hang"]["slot"], by["a"]["slot"]) == ("g0", "g1")  # in order, one per free GPU
    assert by["crash"]["slot"] == "g1" and by["b"]["slot"] == "g0"  # the freed GPU took the next job


def test_run_commands_time_limit(tmp_path, monkeypatch):
    """A job starts only while min_left s remain; the ones left over are 'not run', and a job still running
    when the time limit comes is stopped. No assertion rests on timing: the clock jumps past the limit when
    x ends, while long (30 s) still runs and y waits."""
    jump = []
    monkeypatch.setattr(common, "time", types.SimpleNamespace(time=lambda: time.time() + sum(jump),
                                                              sleep=time.sleep))  # fmt: skip
    specs = [("long", "ok", 30.0), ("x", "ok", 0.0), ("y", "ok", 0.1)]
    log, jobs = make_jobs(tmp_path, specs)
    on_end = lambda job: jump.extend([101.0] if job["name"] == "x" else [])  # noqa: E731
    common.run_commands(jobs, ["g0", "g1"], time_limit=100.0, min_left=50.0, on_end=on_end, poll_s=0.05)
    by = {j["name"]: j for j in jobs}
    assert by["long"]["status"] == "killed at the deadline"
    assert by["x"]["status"] == "exit 0"
    assert by["y"]["status"] == "not run: time limit" and "slot" not in by["y"]
    assert {e["variant"] for e in read_log(log) if "start" in e} == {"long", "x"}


def test_run_commands_one_default_gpu_and_logs(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    log, jobs = make_jobs(tmp_path, [("a", "ok", 0.0), ("b", "crash", 0.0), ("c", "ok", 0.0)])
    jobs[0]["log"], jobs[0]["env"] = str(tmp_path / "a.out"), dict(GREETING="hello")
    jobs[0]["cmd"][2] = "import os; print(os.environ['GREETING'])\n" + jobs[0]["cmd"][2]
    common.run_commands(jobs, [None], poll_s=0.02)
    assert [j["status"] for j in jobs] == ["exit 0", "exit 3", "exit 0"]
    assert all(e["gpu"] is None for e in read_log(log))  # the caller's own device
    assert (tmp_path / "a.out").read_text() == "hello\n"  # its output, and its extra environment


def test_span_on_the_host_clock():
    with common.Span() as s:
        time.sleep(0.05)
        sum(range(10**6))
    assert s.seconds >= 0.05 and s.cpu_seconds > 0


def test_markdown():
    assert common.markdown(["a", "b"], [[1, "x"]], ["---", "---:"]) == [
        "| a | b |",
        "|---|---:|",
        "| 1 | x |",
    ]
    assert common.markdown(["a"], []) == ["| a |", "|---|"]


def test_run_commands_slot_environment(tmp_path, monkeypatch):
    """A slot that is a dict gives its job those environment variables (and leaves CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "parent")
    log, jobs = make_jobs(tmp_path, [("a", "ok", 0.0), ("b", "ok", 0.0)])
    for job in jobs:
        job["log"] = str(tmp_path / f"{job['name']}.out")
        job["cmd"][2] = "import os; print(os.environ['SHARE'])\n" + job["cmd"][2]
    common.run_commands(jobs, [dict(SHARE="first"), dict(SHARE="second")], poll_s=0.02)
    assert [(tmp_path / f"{n}.out").read_text() for n in "ab"] == ["first\n", "second\n"]
    assert {e["gpu"] for e in read_log(log)} == {"parent"}


def test_cpu_slots_share_the_cores(monkeypatch):
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    slots = common.cpu_slots(3, "/tmp/x.lock")
    assert [s["BENCH_CPUS"] for s in slots] == ["0,1", "2,3", "4,5"]  # disjoint, 2 each (one left over)
    assert all(
        s["TORCHINDUCTOR_COMPILE_THREADS"] == "2" and s["BENCH_GPU_LOCK"] == "/tmp/x.lock" for s in slots
    )
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {3})
    assert [s["BENCH_CPUS"] for s in common.cpu_slots(2, "l")] == ["3", "3"]  # one core: shared


def test_gpu_turn_is_exclusive(tmp_path, monkeypatch):
    """While a body of gpu_turn runs, no other open of the lock file gets it (another job's gpu_turn waits);
    after it, one does. Without BENCH_GPU_LOCK it takes no lock."""
    import fcntl

    lock = tmp_path / "gpu.lock"

    def free():  # whether another process (here another open file description) could take the lock now
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True

    monkeypatch.delenv("BENCH_GPU_LOCK", raising=False)
    with common.gpu_turn():
        assert not lock.exists()
    monkeypatch.setenv("BENCH_GPU_LOCK", str(lock))
    with common.gpu_turn():
        assert not free()
    assert free()
    try:
        with common.gpu_turn():
            raise KeyError("a failing body")
    except KeyError:
        pass
    assert free()


def test_profiled_keeps_the_gpu_kernels_and_the_host_ops(monkeypatch):
    """On the GPU the device events are the kernels (by self device time), the others the host's ops (by self
    CPU time), each largest first, zero times left out; with no device event (a CPU run), every op by CPU
    time. The profiler is a stand-in that returns known events."""
    import torch
    from torch.autograd import DeviceType

    def event(key, device, gpu_us, cpu_us, count):
        return types.SimpleNamespace(key=key, device_type=device, self_device_time_total=gpu_us,
                                     self_cpu_time_total=cpu_us, count=count)  # fmt: skip

    events = [event("aten::mm", DeviceType.CPU, 90.0, 5.0, 2), event("gemm", DeviceType.CUDA, 80.0, 0.0, 2),
              event("triton_x", DeviceType.CUDA, 120.0, 0.0, 4), event("idle", DeviceType.CUDA, 0.0, 0.0, 1),
              event("aten::add", DeviceType.CPU, 0.0, 7.0, 3)]  # fmt: skip

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def key_averages(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    ran = []
    kernels, host = common.profiled(lambda: ran.append(1))
    assert ran == [1]
    assert kernels == [("triton_x", 120.0, 4), ("gemm", 80.0, 2)]
    assert host == [("aten::add", 7.0, 3), ("aten::mm", 5.0, 2)]
    events[:] = [e for e in events if e.device_type == DeviceType.CPU]
    kernels, host = common.profiled(lambda: None, cuda=False)
    assert kernels == host == [("aten::add", 7.0, 3), ("aten::mm", 5.0, 2)]
