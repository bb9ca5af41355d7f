"""The scheduler simulator (airay.sched.simulate) on traces small enough to check by hand, and the
trace format and generator (airay.sched.trace)."""

import json

import numpy as np
import pytest

from airay import cli
from airay.sched.simulate import Settings, compare, simulate_queue
from airay.sched.trace import TraceError, TraceJob, generate, load_csv, quotas, write_csv

# One 8-GPU node. A: low priority, elastic 4..8, 100 s at 8 GPUs (800 GPU-s of work). B: high
# priority, rigid 4, arrives at 10 s.
TWO = [TraceJob("A", 0.0, 8, 100.0, priority=0, min_gpus=4), TraceJob("B", 10.0, 4, 75.0, priority=1)]


def run(jobs, policy, **kw):
    return simulate_queue(jobs, Settings(gpus=8, **{"cold_restart_s": 5.0, "checkpoint_interval_s": 1000.0, **kw}),
                          policy)


def test_two_jobs_by_hand():
    jobs = [TWO[0], TraceJob("B", 10.0, 4, 50.0, priority=1)]
    # evict: at 10 s A is evicted (its 80 GPU-s since the start are lost: no checkpoint yet), B
    # starts at 4, A is readmitted at the 4 left and restarts cold (5 s): 800 / 4 -> ends at 215.
    r = run(jobs, "evict", resize_s=1.0)
    assert r.mean_jct_s == pytest.approx((215 + 50) / 2) and r.preemptions == 1 and r.resizes == 0
    assert r.lost_work_gpu_h * 3600 == pytest.approx(80) and r.lost_gpu_h * 3600 == pytest.approx(80 + 5 * 4)
    # shrink: A shrinks to 4 (1 s idle), B runs 10..60; A grows back at 60 (1 s idle): 80 + 49 x 4
    # = 276 done at 60, 524 left at 8 from 61 -> ends at 126.5. Lost: 1 s x 4 + 1 s x 8.
    r = run(jobs, "shrink", resize_s=1.0)
    assert r.mean_jct_s == pytest.approx((126.5 + 50) / 2) and r.preemptions == 0 and r.resizes == 2
    assert r.lost_gpu_h * 3600 == pytest.approx(12) and r.makespan_s == pytest.approx(126.5)
    assert run(jobs, "goodput", resize_s=1.0).mean_jct_s == r.mean_jct_s  # the grow pays: 524/4 s left


def test_a_grow_that_does_not_pay_for_its_resize():
    # resize_s 100: A's shrink at 10 idles it until 110, B runs 10..85. At 85 A has 720 GPU-s left
    # (180 s at 4). shrink grows it anyway: idle until 210, then 720 / 8 -> ends at 300. goodput
    # does not (at 8 it would end 100 + 90 s later, after 180 s): A resumes at 110, ends at 290.
    shrink, goodput = run(TWO, "shrink", resize_s=100.0), run(TWO, "goodput", resize_s=100.0)
    assert shrink.mean_jct_s == pytest.approx((300 + 75) / 2) and shrink.resizes == 2
    assert goodput.mean_jct_s == pytest.approx((290 + 75) / 2) and goodput.resizes == 1
    assert shrink.lost_gpu_h * 3600 == pytest.approx(4 * 75 + 8 * 125)
    assert goodput.lost_gpu_h * 3600 == pytest.approx(4 * 100)


def test_eviction_loses_only_the_work_since_the_last_checkpoint():
    # Checkpoints every 4 s of training: at 10 s the last was at 8, so 2 s x 8 GPUs are lost and A
    # resumes from 64 GPU-s: 736 / 4 from 15 -> ends at 199.
    jobs = [TWO[0], TraceJob("B", 10.0, 4, 50.0, priority=1)]
    r = run(jobs, "evict", resize_s=1.0, checkpoint_interval_s=4.0)
    assert r.mean_jct_s == pytest.approx((199 + 50) / 2)
    assert r.lost_work_gpu_h * 3600 == pytest.approx(16) and r.lost_gpu_h * 3600 == pytest.approx(16 + 20)


def test_waits_utilisation_and_sublinear_scaling():
    jobs = [TraceJob("A", 0.0, 8, 100.0, priority=2), TraceJob("B", 10.0, 8, 100.0, priority=2)]
    r = run(jobs, "shrink")
    assert r.high_priority == 2 and r.high_jobs == 2
    assert r.high_wait_mean_s == pytest.approx(45) and r.high_wait_p99_s == pytest.approx(0.99 * 90)
    assert r.utilisation == pytest.approx(1.0) and r.mean_jct_s == pytest.approx((100 + 190) / 2)
    # At 4 of its 8 GPUs with scaling 0.5 a job runs at 8 x 0.5^0.5 GPU-s per second.
    half = simulate_queue([TraceJob("A", 0.0, 8, 100.0, min_gpus=4)], Settings(gpus=4, gpus_per_node=4, scaling=0.5),
                          "shrink")
    assert half.mean_jct_s == pytest.approx(800 / (8 * 0.5 ** 0.5))


def test_generated_trace_is_seeded_and_offers_the_load_asked():
    a, b = generate(1000, 1024, seed=3), generate(1000, 1024, seed=3)
    assert a == b and a != generate(1000, 1024, seed=4) and len(a) == 1000
    work = sum(j.work_gpu_s for j in a)
    assert work / (1024 * a[-1].submit_s) == pytest.approx(0.9, rel=0.15)
    assert all(1 <= j.min_size <= j.gpus <= 512 and j.min_size % j.multiple == 0 for j in a)
    assert {j.priority for j in a} == {0, 1, 2} and set(quotas(1024)) == {j.team for j in a}
    assert sum(quotas(1024).values()) <= 1024
    durations = np.array([j.duration_s for j in a])
    assert np.percentile(durations, 99) > 10 * np.median(durations)  # heavy-tailed


def test_trace_csv_round_trip_and_errors_name_the_line_and_column(tmp_path):
    jobs = generate(50, 1024, seed=1)
    path = tmp_path / "trace.csv"
    write_csv(path, jobs)
    assert load_csv(path) == jobs
    minimal = tmp_path / "min.csv"
    minimal.write_text("# a comment\njob_id,submit_s,gpus,duration_s\nj1,0,8,3600\n")
    assert load_csv(minimal) == [TraceJob("j1", 0.0, 8, 3600.0, "default", 0, None, 1)]
    bad = {
        "job_id,submit_s,gpus,duration_s\nj1,0,eight,3600\n":
            "line 2 (job_id 'j1'), column 'gpus': 'eight' is not an integer",
        "job_id,submit_s,gpus\nj1,0,8\n": "missing column(s) duration_s",
        "job_id,submit_s,gpus,duration_s,prio\nj1,0,8,1,2\n": "unknown column(s) prio",
        "job_id,submit_s,gpus,duration_s,min_gpus\nj1,0,8,1,9\n": "column 'min_gpus': 9 must be in 1..gpus (8)",
        "job_id,submit_s,gpus,duration_s\nj1,0,8,1\nj1,5,8,1\n":
            "line 3 (job_id 'j1'), column 'job_id': 'j1' appears twice",
        "job_id,submit_s,gpus,duration_s,multiple,min_gpus\nj1,0,12,1,8,9\n": "no multiple of 8 lies in min_gpus..gpus",
    }
    for text, message in bad.items():
        minimal.write_text(text)
        with pytest.raises(TraceError, match=message.replace("(", "\\(").replace(")", "\\)")):
            load_csv(minimal)


def test_policies_on_a_generated_trace_and_the_cli(tmp_path, capsys):
    rows = compare([1024], jobs=200, seed=0)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"evict", "shrink", "goodput"} and all(r["jobs"] == 200 for r in rows)
    assert by["shrink"]["lost_work_gpu_h"] == 0 and by["evict"]["lost_gpu_h"] > by["shrink"]["lost_gpu_h"]
    assert by["shrink"]["mean_jct_s"] < by["evict"]["mean_jct_s"]
    path = tmp_path / "t.csv"
    write_csv(path, generate(60, 256, seed=2))
    assert cli.main(["simulate-queue", "--trace", str(path), "--gpus", "256", "--quota", "team-a=64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out] == ["evict", "shrink", "goodput"] and out[0]["jobs"] == 60
    assert cli.main(["simulate-queue", "--jobs", "40", "--gpus", "1024", "--policies", "shrink"]) == 0
    assert "mean JCT h" in capsys.readouterr().out
    path.write_text("job_id,submit_s,gpus,duration_s\nj1,0,512,1\n")
    assert cli.main(["simulate-queue", "--trace", str(path), "--gpus", "256"]) == 2
    assert "larger than the fleet's 256 GPUs" in capsys.readouterr().err
