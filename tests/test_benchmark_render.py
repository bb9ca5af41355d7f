"""The goodput section of BENCHMARKS.md, rendered from a run's JSON (the long run itself is not in
the test suite: it takes ~20 minutes; tests/test_benchmarks.py runs the other sections reduced)."""

from benchmarks.run import render_goodput
from benchmarks.raytrain import schedule_fault_steps, window_goodput


def test_faults_fall_half_way_between_checkpoints():
    assert schedule_fault_steps(2000, 500, 10) == [505, 1005, 1505]
    assert schedule_fault_steps(24, 12, 4) == [14]


def test_goodput_section_reports_both_sides_lost_time_and_the_simulator():
    measured = {"window_s": 100.0, "startup_s": 20.0, "full_world": 4, "step_s": 0.25, "blocking_s": 0.05,
                "recovery_s": 1.0, "replacement_s": 10.0, "fault_offsets_s": [40.0], "kept_steps": 380}
    assert window_goodput(measured) == 0.95
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


def test_checkpoint_section_has_both_baselines_and_the_ratios():
    from benchmarks.run import render_checkpoint

    ck = {"model": {"d_model": 512}, "state_bytes": 300 * 2**20, "airay_blocking_s": 0.05,
          "airay_durable_total_s": 12.0, "sync_local_dir_s": 0.5, "sync_local_dir_then_s3_s": 8.0,
          "memory_recovery_load_s": 3.0, "durable_recovery_load_s": 21.0, "blocking_vs_sync_local": 0.1,
          "blocking_vs_sync_s3": 0.00625, "recovery_speedup_memory_vs_s3": 7.0,
          "samples": {"blocking_s": [0.04, 0.05, 0.07], "sync_local_dir_s": [0.5], "sync_local_dir_then_s3_s": [8.0],
                      "durable_total_s": [12.0], "durable_load_s": [21.0], "memory_load_s": [3.0]}}
    text = "\n".join(render_checkpoint(ck))
    assert "300 MiB" in text and "| DeepSpeed sync save, local dir (baseline) | 0.500 | - | 1 |" in text
    assert "| 0.050 | 0.040-0.070 | vs local **0.100**, vs local+S3 **0.006** (target ≤ 0.10) |" in text
    assert "S3 / memory **7.00x**" in text
    # With the split of the blocking (save call + the next optimizer step's wait) and the step times.
    ck.update(save_call_s=0.03, copy_wait_s=0.02, step_s_overlapping_copy=0.6, step_s_other=0.5,
              step_inflation_overlapping_copy=1.2)
    ck["samples"].update(save_call_s=[0.03], copy_wait_s=[0.02], step_s_overlapping_copy=[0.6], step_s_other=[0.5])
    text = "\n".join(render_checkpoint(ck))
    assert "| of which the save call (blocking_s) | 0.030 |" in text and "checkpoint_wait_s) | 0.020 |" in text
    assert "| step time, steps overlapping a host copy | 0.600 | - | x1.20 vs other steps |" in text


def test_data_section_reports_both_sides_the_ratio_and_the_wait_share():
    from benchmarks.run import render_data

    result = {"workers": 2, "rows": 60000, "repeats": 3, "plain": [3483.0, 5188.0, 4027.0],
              "airay": [7673.0, 6698.0, 7153.0], "plain_median": 4027.0, "airay_median": 7153.0,
              "ratio": 7153.0 / 4027.0, "data_wait_share": 0.0001, "fit_steps": 60}
    text = "\n".join(render_data(result))
    assert "| plain DataLoader (baseline) | 4027 | 3483-5188 | 1 |" in text
    assert "| airay (Ray Data path) | 7153 | 6698-7673 | **1.78** (target ≥ 0.8) |" in text
    assert "60,000 rows" in text and "**0.01%** (target < 5%)" in text
