"""The goodput simulator against closed forms, and its CLI and the decision benchmark in reduced mode."""

import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from airay.simulate import Costs, Fleet, daly_goodput, simulate, young_daly_interval

ROOT = Path(__file__).resolve().parents[1]

# A small fleet that fails often (fleet MTBF ~4.9 h), so 60 simulated days hold ~300 failures.
FLEET = Fleet(gpus=1024, gpus_per_node=8, mtbf_gpu_hours=5000.0, replacement_s=0.0)
COSTS = Costs(checkpoint_s=60.0, warm_recovery_s=5.0, cold_restart_s=300.0)


def mean_goodput(policy, fleet=FLEET, costs=COSTS, interval=None, days=60.0, seeds=6):
    return statistics.mean(simulate(fleet, costs, policy, interval, days, seed=s).goodput for s in range(seeds))


def test_restart_matches_dalys_exact_expectation():
    m = FLEET.fleet_mtbf_s
    for interval in (600.0, young_daly_interval(COSTS.checkpoint_s, m), 6000.0):
        expected = daly_goodput(interval, COSTS.checkpoint_s, COSTS.cold_restart_s, m)
        assert mean_goodput("restart", interval=interval) == pytest.approx(expected, abs=0.01)


def test_daly_interval_beats_shorter_and_longer_ones():
    opt = young_daly_interval(COSTS.checkpoint_s, FLEET.fleet_mtbf_s)
    at_opt = mean_goodput("restart", interval=opt)
    assert at_opt > mean_goodput("restart", interval=opt / 4)
    assert at_opt > mean_goodput("restart", interval=opt * 4)
    closed = [daly_goodput(t, COSTS.checkpoint_s, COSTS.cold_restart_s, FLEET.fleet_mtbf_s)
              for t in (opt / 1.5, opt, opt * 1.5)]
    assert closed[1] == max(closed)


def test_without_failures_only_checkpoints_cost():
    fleet = replace(FLEET, mtbf_gpu_hours=1e15)
    r = simulate(fleet, COSTS, "shrink", interval_s=940.0, days=1)
    assert r.failures == 0
    assert r.goodput == pytest.approx(940.0 / 1000.0, abs=0.002)  # the last partial segment aside


def test_accounting_adds_up_and_policies_order_as_expected():
    fleet = replace(FLEET, replacement_s=3600.0)
    rows = {p: simulate(fleet, COSTS, p, days=30, seed=1) for p in ("shrink", "wait", "restart")}
    for r in rows.values():
        total = r.goodput + r.lost_work_share + r.recovery_share + r.checkpoint_share + r.degraded_share
        assert total == pytest.approx(1.0, abs=1e-6)
        assert r.failures > 50
    # Waiting an hour for each replacement costs far more than training on a smaller world.
    assert rows["shrink"].goodput > rows["wait"].goodput + 0.05
    assert rows["wait"].goodput > rows["restart"].goodput  # same waits, warm vs cold restart
    same = simulate(fleet, replace(COSTS, cold_restart_s=COSTS.warm_recovery_s), "restart", days=30, seed=1)
    assert same.goodput == pytest.approx(rows["wait"].goodput, rel=1e-12)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="policy"):
        simulate(FLEET, COSTS, "pray")
    with pytest.raises(ValueError, match="gpus_per_node"):
        simulate(replace(FLEET, gpus=1000, gpus_per_node=16), COSTS, "shrink")


def test_simulate_cli_json():
    proc = subprocess.run([sys.executable, "-m", "airay.cli", "simulate", "--gpus", "256,1024", "--days", "3",
                           "--repeats", "1", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["gpus"], r["policy"]) for r in rows] == [(g, p) for g in (256, 1024) for p in ("shrink", "wait", "restart")]
    assert all(0 < r["goodput"] <= 1 for r in rows)
    bad = subprocess.run([sys.executable, "-m", "airay.cli", "simulate", "--gpus", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gpus" in bad.stderr


def test_decision_benchmark_reduced(tmp_path):
    out = tmp_path / "decision.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decision.py"), "--workers", "256",
                           "--repeats", "3", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["workers"] for r in rows] == [64, 256]
    assert all(0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in rows)
    assert "decision path at 256 workers" in proc.stdout


def test_a_given_failure_schedule_is_replayed_exactly():
    """One failure at t=25 s, segments of 10 s work + 1 s checkpoint, 2 s recovery, 100 s: by hand,
    80 GPU-s of two committed segments, 3 s x 4 lost, then 3 GPUs train on (and, once the node is
    back at 45 s, grow to 4 at the 49 s checkpoint boundary)."""
    costs = Costs(checkpoint_s=1.0, warm_recovery_s=2.0)
    never_back = Fleet(gpus=4, gpus_per_node=1, replacement_s=1e9)
    r = simulate(never_back, costs, "shrink", interval_s=10.0, days=100 / 86400, failure_times=[25.0])
    assert r.failures == 1
    # 2 x 40 + six segments of 10 s at 3 GPUs (27..93) + the last 7 s at 3 GPUs, over 4 x 100.
    assert r.goodput == pytest.approx((80 + 6 * 30 + 21) / 400, abs=1e-9)
    assert r.lost_work_share == pytest.approx(12 / 400, abs=1e-9)
    back = replace(never_back, replacement_s=20.0)
    r = simulate(back, costs, "shrink", interval_s=10.0, days=100 / 86400, failure_times=[25.0])
    # 80 + 2 x 30 (27..49) + grow 49..51 + four segments at 4 GPUs (51..95) + the last 5 s at 4.
    assert r.goodput == pytest.approx((80 + 60 + 160 + 20) / 400, abs=1e-9)
    # Without a schedule the same fleet (MTBF 50,000 h per GPU) does not fail in 100 s.
    assert simulate(back, costs, "shrink", interval_s=10.0, days=100 / 86400).failures == 0
