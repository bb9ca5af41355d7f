"""The goodput section of BENCHMARKS.md, rendered from a run's JSON (the long run itself is not in
the test suite: it takes ~20 minutes; tests/test_benchmarks.py runs the other sections reduced)."""

from benchmarks.run import render_goodput
from airay.simulate import predicted_goodput, replay_measured
from benchmarks.raytrain import schedule_fault_steps


def test_faults_fall_half_way_between_checkpoints():
    assert schedule_fault_steps(2000, 500, 10) == [505, 1005, 1505]
    assert schedule_fault_steps(24, 12, 4) == [14]


def test_goodput_section_reports_both_sides_lost_time_and_the_simulator():
    measured = {"window_s": 100.0, "startup_s": 20.0, "full_world": 4, "step_s": 0.25, "blocking_s": 0.05,
                "recovery_s": 1.0, "replacement_s": 10.0, "fault_offsets_s": [40.0], "kept_steps": 380}
    # The simulator's figure in airay.goodput's definition: the measured start-up is wall time too.
    window = replay_measured(measured, 10).goodput
    assert 0.5 < window < 1.0
    assert abs(predicted_goodput(measured, 10) - window * 100.0 / 120.0) < 1e-12
    result = {"args": {"schedule_steps": 380, "schedule_ckpt_every": 10, "schedule_repeats": 1},
              "schedule": {"fault_steps": [205]},
              "median": {"schedule": {
                  "airay": {"goodput": [0.8, 0.8, 0.8], "wall_s": [120.0] * 3, "steps_redone": [5] * 3,
                            "lost_s": {"startup": 20.0, "recovery": 1.0}},
                  "ray_train": {"goodput": [0.4, 0.4, 0.4], "wall_s": [240.0] * 3, "steps_redone": [5] * 3},
                  "simulator": {"predicted": 0.93, "measured": 0.95}}}}
    text = "\n".join(render_goodput(result))
    assert "| airay | 0.800 | 0.800-0.800 | 120.0 | 5 | 2.00x |" in text
    assert "| Ray Train | 0.400 |" in text and "startup 20.0, recovery 1.0" in text
    assert "predicts goodput 0.930" in text and "measured 0.950" in text
    assert "**not met**" in text


def test_checkpoint_section_has_a_row_per_size_and_the_targets():
    from benchmarks.run import render_checkpoint

    row = {"d_model": 256, "parameters": 6.5e6, "bytes": 80 * 2**20, "driver_node_peak_rss": 700 * 2**20,
           "worker_rss_vs_footprint": 1.2, "held_median_s": 0.02, "sync_save_s": 0.5, "held_vs_sync": 0.04,
           "commit_median_s": 0.1, "commit_gb_per_s": 0.8, "copy_median_s": 0.2, "reshard_load_median_s": 0.3,
           "recovery_s": 1.5}
    ck = {"sizes": [row, {**row, "d_model": 1024, "parameters": 1.0e8}], "workers": 4, "driver_node_rss_growth": 1.1,
          "worst_worker_rss_vs_footprint": 1.2, "min_commit_gb_per_s": 0.8, "largest_recovery_s": 1.5,
          "worst_held_vs_sync": 0.04}
    text = "\n".join(render_checkpoint(ck))
    assert "| 256 | 6.5M | 80 | 700 | 1.20 | 0.020 | 0.500 | 0.040 | 0.10 | 0.80 | 0.20 | 0.30 | 1.50 |" in text
    assert "| 1024 | 100.0M |" in text
    assert "**x1.10** (target ≤ 1.5)" in text and "**0.80 GB/s** (target ≥ 1)" in text
    assert "**0.040** (target ≤ 0.10)" in text


def test_checkpoint_section_with_stages_reports_reads_losses_and_the_build():
    from benchmarks.run import render_checkpoint

    row = {"d_model": 256, "stage": 3, "parameters": 6.5e6, "bytes": 80 * 2**20, "driver_node_peak_rss": 700 * 2**20,
           "worker_rss_vs_footprint": 1.2, "held_median_s": 0.02, "sync_save_s": 0.5, "held_vs_sync": 0.04,
           "commit_median_s": 0.1, "commit_gb_per_s": 0.8, "copy_median_s": 0.2, "reshard_load_median_s": 0.3,
           "recovery_s": 1.5, "read_vs_needed": 1.07, "loss_rel_diff": 3.2e-7, "build_model_vs_bytes": 0.35}
    targets = {"driver_node_rss_growth": 1.1, "worst_worker_rss_vs_footprint": 1.2, "min_commit_gb_per_s": 0.8,
               "largest_recovery_s": 1.5, "worst_held_vs_sync": 0.04, "worst_loss_rel_diff": 3.2e-7,
               "worst_read_vs_needed": 1.07}
    ck = {"sizes": [{**row, "stage": 2}, row], "workers": 4, "zero2": targets, "zero3": targets,
          "zero3_build_model_vs_bytes": 0.35}
    text = "\n".join(render_checkpoint(ck))
    assert "| 3 | 256 | 6.5M | 80 | 700 | 1.20 | 0.020 | 0.500 | 0.040 | 0.10 | 0.80 | 0.20 | 0.30 | 1.50 | 1.07 | " \
           "3.2e-07 | 0.35 |" in text and "| 2 | 256 |" in text
    assert "ZeRO-2: driver-node" in text and "ZeRO-3: driver-node" in text
    assert "**3.2e-07** (target < 1e-5)" in text and "**1.07** (target ≤ 1.2)" in text
    assert "worst: **0.35** (target ≤ 0.5)" in text


def test_data_section_reports_both_sides_the_ratio_and_the_wait_share():
    from benchmarks.run import render_data

    result = {"workers": 2, "rows": 60000, "repeats": 3, "plain": [3483.0, 5188.0, 4027.0],
              "airay": [7673.0, 6698.0, 7153.0], "plain_median": 4027.0, "airay_median": 7153.0,
              "ratio": 7153.0 / 4027.0, "data_wait_share": 0.0001, "data_wait_share_unpaced": 0.0123,
              "fit_steps": 60}
    text = "\n".join(render_data(result))
    assert "| plain DataLoader (baseline) | 4027 | 3483-5188 | 1 |" in text
    assert "| airay (Ray Data path) | 7153 | 6698-7673 | **1.78** (target ≥ 0.8) |" in text
    assert "60,000 rows" in text and "paced (the demo model's 0.1 s sleep per forward) **0.01%**" in text
    assert "unpaced (no sleep: CPU-bound steps) **1.23%** (target < 5%)" in text


def test_goodput_schedule_and_young_daly_interval_in_steps():
    from benchmarks.goodput import interval_steps, schedule

    plan = schedule(1200.0, 6)
    assert [off for off, _ in plan] == [100.0, 300.0, 500.0, 700.0, 900.0, 1100.0]
    assert [k for _, k in plan] == ["node", "kill", "preempt"] * 2
    # sqrt(2 C M) - C: C 0.04 s, M 200 s -> 3.96 s of work, at 0.1 s a step -> 40 steps.
    assert interval_steps(0.04, 200.0, 0.1) == 40
    assert interval_steps(2.0, 200.0, 0.1) == 263  # a dearer checkpoint: longer between them


def test_goodput_window_section_reports_each_run_causes_simulator_and_target():
    from benchmarks.run import render_goodput

    run = {"goodput": 0.96, "lost_s": {"startup": 20.0, "recovery": 10.0, "replayed_steps": 2.0,
                                       "checkpoint_blocking": 5.0, "other": 11.0}, "predicted": 0.97}
    result = {"args": {"window": 1200.0, "faults": 6, "repeats": 2, "regrow": 60.0},
              "schedule": [[100.0, "node"], [300.0, "kill"]], "mtbf_s": 200.0, "model_kwargs": {},
              "calibration": {"airay": {"checkpoint_s": 0.04, "step_s": 0.1, "interval_steps": 40},
                              "ray_train": {"checkpoint_s": 2.0, "step_s": 0.12, "interval_steps": 230}},
              "runs": {"airay": [run, {**run, "goodput": 0.94}], "ray_train": [{"goodput": 0.5}, {"goodput": 0.6}]},
              "median": {"airay": 0.95, "ray_train": 0.55}, "predicted_median": 0.97}
    text = "\n".join(render_goodput(result))
    assert "Unpaced" in text and "100 s a node lost, added back 60 s later; 300 s SIGKILL of a worker" in text
    assert "airay C = 0.040 s, step 0.100 s -> every 40 steps" in text and "every 230 steps" in text
    assert "| airay | 0.950 | 0.960, 0.940 | 1.73x |" in text and "| Ray Train | 0.550 | 0.500, 0.600 | 1.00x |" in text
    assert "startup 20.0, recovery 10.0" in text and "predicts 0.970 for airay against 0.950 measured" in text
    assert "**met**" in text


def test_driver_scale_section_has_a_row_per_size_and_each_target():
    from benchmarks.run import readme_driver_scale, render_driver_scale

    row = {"workers": 64, "round_ms": 1.0, "round_ms_mean": 1.1, "round_ms_max": 5.9, "round_target_ms": 10.64,
           "recovery_ms": 1.17, "grow_ms": 1.3, "round_fake_ms": 0.32, "console_longest": 332}
    slow = {**row, "workers": 4096, "round_ms": 61.0, "round_target_ms": 50.96, "recovery_ms": 140.0,
            "grow_ms": None, "console_longest": 338}
    result = {"args": {"rounds": 40, "steps_per_round": 5, "save_every": 5, "deaths": 3}, "rows": [row, slow]}
    text = "\n".join(render_driver_scale(result))
    assert "| 64 | 1.00 | 1.10 | 5.9 | < 10.64 | 1.17 | - | 1.30 | 0.32 | 332 |" in text
    assert "| 4096 | 61.00 | 1.10 | 5.9 | < 50.96 | 140.00 | < 100 | - | 0.32 | 338 |" in text
    assert "**not met** at 4,096 ranks (61.0 ms at 4,096 ranks against 50.96)" in text
    assert "**140.0 ms** (target < 100 ms: **not met**)" in text and "40 rounds of 5 steps" in text
    good = {**result, "rows": [row]}
    assert "met at every size" in "\n".join(render_driver_scale(good))
    stored = {"driver_scale": {"result": result, "command": "python benchmarks/driver_scale.py", "date": "2026-12-05",
                               "machine": "2 CPU cores (x86_64), no GPU; Python 3.11"}}
    (line,) = readme_driver_scale(stored)
    assert "1.00 ms per round and 1.17 ms per recovery at 64, 61.00 ms per round and 140.00 ms per recovery at 4,096" \
        in line and "332 characters at 64, 338 characters at 4,096 ranks" in line


def test_sched_sim_section_has_a_row_per_fleet_and_policy_and_the_ratios():
    from benchmarks.run import render_sched_sim

    def row(gpus, policy, resize_s, jct, lost, ratio=None, lost_ratio=None):
        return {"gpus": gpus, "policy": policy, "resize_s": resize_s, "mean_jct_s": jct * 3600, "p99_jct_s": 36000.0,
                "high_wait_mean_s": 0.0, "high_wait_p99_s": 0.0, "wait_mean_s": 600.0, "utilisation": 0.8,
                "lost_gpu_h": lost, "preemptions": 10.0, "resizes": 0.0 if policy == "evict" else 50.0,
                "mean_jct_s_vs_evict": ratio, "mean_jct_s_vs_evict_range": [0.85, 0.95] if ratio else None,
                "p99_jct_s_vs_evict": 0.9 if ratio else None, "lost_gpu_h_vs_evict": lost_ratio}

    rows = [row(1024, "evict", 0.746, 10.0, 1000.0), row(1024, "shrink", 0.746, 9.0, 10.0, 0.9, 0.01),
            row(1024, "goodput", 0.746, 9.0, 10.0, 0.9, 0.01), row(1024, "shrink", 300.0, 9.2, 800.0, 0.92, 0.8),
            row(1024, "goodput", 300.0, 9.1, 400.0, 0.91, 0.4)]
    res = {"args": {"jobs": 1200, "seeds": 3, "load": 0.9, "slow_resize_s": 300.0},
           "settings": {"checkpoint_interval_s": 1800.0, "horizon_s": 3600.0, "resize_s": 0.746, "cold_restart_s": 9.7},
           "teams": {"a": {"quota_share": 0.3}, "b": {"quota_share": 0.1}}, "rows": rows}
    text = "\n".join(render_sched_sim(res))
    assert "| 1,024 | evict | 0.746 | 10.00 | 10.0 | 1 (baseline) | 0.0 / 0.0 | 10.0 | 0.800 | 1,000 | 1 | 10 | 0 |" \
        in text
    assert "| 1,024 | shrink | 0.746 | 9.00 | 10.0 | **0.900** (0.850-0.950) |" in text
    assert "mean JCT x0.900 at 1,024 GPUs; p99 JCT x0.900; lost GPU-hours x0.010" in text
    assert "idles 0.50x the GPU-hours of shrink at 1,024 GPUs, at a mean JCT x0.989 of shrink's" in text
    assert "goodput's mean JCT is x1.000 of shrink's" in text and "30%, 10% of the fleet" in text
