"""Bad specs fail at validation, before Ray is touched, naming the field and the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from airay import ConfigError, JobConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "jobs" / "demo.yaml"


def demo_dict():
    return yaml.safe_load(DEMO.read_text())


def error_for(mutate) -> str:
    spec = demo_dict()
    mutate(spec)
    with pytest.raises(ConfigError) as err:
        JobConfig.from_dict(spec)
    return str(err.value)


def test_demo_spec_is_valid():
    cfg = JobConfig.from_yaml(DEMO)
    assert cfg.scaling.max_workers == 4 and cfg.zero_stage == 2 and len(cfg.chaos) == 3


def test_unknown_field_is_named():
    msg = error_for(lambda s: s["scaling"].update(max_wrokers=4))
    assert "scaling.max_wrokers" in msg and "unknown field" in msg


def test_min_greater_than_max():
    msg = error_for(lambda s: s["scaling"].update(min_workers=5))
    assert "scaling" in msg and "min_workers (5) > max_workers (4)" in msg


def test_any_world_size_up_to_the_batch_is_valid():
    # 16 over 2..4 workers: 3 does not divide it, ranks take 6, 5 and 5 samples.
    cfg = JobConfig.from_dict({**demo_dict(), "global_batch_size": 16})
    assert cfg.scaling.world_sizes == [2, 3, 4]
    msg = error_for(lambda s: s.update(global_batch_size=3))
    assert "global_batch_size 3 is smaller than world size 4 (scaling.max_workers)" in msg
    assert "raise global_batch_size to at least 4" in msg


def test_world_size_multiple():
    cfg = JobConfig.from_dict({**demo_dict(), "global_batch_size": 64,
                               "scaling": {"min_workers": 8, "max_workers": 32, "world_size_multiple": 8}})
    assert cfg.scaling.world_sizes == [8, 16, 24, 32]
    msg = error_for(lambda s: s["scaling"].update(min_workers=5, max_workers=7, world_size_multiple=8))
    assert "scaling" in msg and "no multiple of world_size_multiple (8) lies in min_workers..max_workers (5..7)" in msg


def test_missing_model_factory():
    msg = error_for(lambda s: s["model"].update(factory="airay.models.tiny_gpt:nope"))
    assert "model.factory" in msg and "no attribute 'nope'" in msg
    msg = error_for(lambda s: s["model"].update(factory="no_such_pkg.mod:build"))
    assert "model.factory" in msg and "cannot import module 'no_such_pkg.mod'" in msg


def test_missing_required_field():
    msg = error_for(lambda s: s.pop("loss_fn"))
    assert "loss_fn: required field is missing" in msg


def test_deepspeed_batch_keys_are_owned_by_airay():
    msg = error_for(lambda s: s["deepspeed"].update(train_batch_size=8))
    assert "deepspeed" in msg and "train_batch_size" in msg


def test_bad_zero_stage_and_missing_deepspeed_file(tmp_path):
    assert "stage must be 0, 1, 2 or 3" in error_for(lambda s: s["deepspeed"].update(zero_optimization={"stage": 4}))
    msg = error_for(lambda s: s.update(deepspeed=str(tmp_path / "ds.json")))
    assert "ds.json' does not exist" in msg


def test_tensor_parallelism_counts_ranks_in_whole_replicas_and_what_it_cannot_do_is_refused():
    def tp(n, **scaling):
        return lambda s: (s["deepspeed"].update(tensor_parallel={"autotp_size": n}), s["scaling"].update(scaling))

    spec = demo_dict()
    tp(2)(spec)
    cfg = JobConfig.from_dict(spec)
    assert cfg.model_parallel_size == 2 and cfg.world_sizes == [2, 4]
    plans = cfg.batch_plans()  # over replicas: 1 and 2 of them, the same 24 samples a step
    assert plans[2].world_size == 1 and plans[4].world_size == 2
    assert plans[4].rank_rows(1) == (12, 24)
    msg = error_for(tp(2, min_workers=3))
    assert "scaling.min_workers (3) must be a multiple of the model-parallel size 2" in msg
    msg = error_for(tp(4, max_workers=6, min_workers=4))
    assert "scaling.max_workers (6)" in msg
    msg = error_for(tp(2, placement_strategy="SPREAD"))
    assert "SPREAD" in msg and "share a node" in msg
    msg = error_for(lambda s: (tp(2)(s), s["deepspeed"].update(zero_optimization={"stage": 3})))
    assert "stage 3" in msg and "use stage 1 or 2" in msg
    msg = error_for(tp(-1))
    assert "tensor_parallel.autotp_size must be a whole number >= 1, got -1" in msg
    msg = error_for(lambda s: s["deepspeed"].update(sequence_parallel_size=2))  # the demo's tiny GPT loss
    assert "loss_fn airay.models.tiny_gpt:loss with deepspeed.sequence_parallel_size 2" in msg
    msg = error_for(lambda s: (tp(2)(s), s["deepspeed"].update(sequence_parallel_size=2)))
    assert "one model-parallel dimension at a time" in msg
    msg = error_for(lambda s: s["deepspeed"].update(sequence_parallel_size=2, zero_optimization={"stage": 3}))
    assert "sequence_parallel_size (2) with zero_optimization.stage 3" in msg
    # A world of 8 replicas of 4 ranks needs 8 samples a step at least.
    msg = error_for(lambda s: (tp(4, min_workers=4, max_workers=32)(s), s.update(global_batch_size=6)))
    assert "8 data-parallel replicas (world size 32 / model-parallel size 4)" in msg
    spec = demo_dict()
    spec["deepspeed"]["tensor_parallel"] = {"autotp_size": 1}  # size 1 splits nothing
    assert JobConfig.from_dict(spec).model_parallel_size == 1


def test_layouts_airay_cannot_reshard_are_refused_when_the_world_can_change_size():
    """round_robin_gradients and elastic_checkpoint (ZeRO-1/2) write checkpoints that cannot be
    resharded (tests/test_reshard.py's probes): refused before Ray starts, naming the key and the
    fix, unless the world is fixed. bf16 + ZeRO-1 + fp32 gradient accumulation (DeepSpeed's
    BF16_Optimizer) is resharded bit for bit there, so it is accepted."""
    def zero(**keys):
        return lambda s: s["deepspeed"].update(zero_optimization={"stage": 2, **keys})

    msg = error_for(zero(round_robin_gradients=True))
    assert "zero_optimization.round_robin_gradients" in msg and "remove it (or set it false)" in msg
    assert "scaling.min_workers = max_workers" in msg
    assert "zero_optimization.round_robin_gradients" in error_for(
        lambda s: s["deepspeed"].update(zero_optimization={"stage": 1, "round_robin_gradients": True}))
    msg = error_for(zero(elastic_checkpoint=True))
    assert "zero_optimization.elastic_checkpoint" in msg and "remove it (or set it false)" in msg
    msg = error_for(lambda s: s["deepspeed"].update(bfloat16={"enabled": True}, zero_optimization={"stage": 0}))
    assert "bf16 with zero_optimization.stage 0" in msg and "use zero_optimization.stage 1-3" in msg

    def config(deepspeed, **scaling):
        spec = demo_dict()
        spec["deepspeed"].update(deepspeed)
        spec["scaling"].update(scaling)
        return JobConfig.from_dict(spec)

    # A fixed world never reshards; ZeRO-3 ignores both keys (its own layout is resharded).
    assert config({"zero_optimization": {"stage": 2, "round_robin_gradients": True}}, min_workers=4).zero_stage == 2
    assert config({"zero_optimization": {"stage": 3, "round_robin_gradients": True, "elastic_checkpoint": True}}).zero_stage == 3
    assert config({"zero_optimization": {"stage": 2, "round_robin_gradients": False}}).zero_stage == 2
    bf16_optimizer = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}}
    assert len(config(bf16_optimizer).scaling.world_sizes) > 1


def test_deepspeed_json_relative_to_spec(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    spec = demo_dict()
    spec["deepspeed"] = "ds.json"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert JobConfig.from_yaml(tmp_path / "job.yaml").zero_stage == 3


def test_chaos_validation():
    assert "chaos.0.at_step" in error_for(lambda s: s["chaos"][0].update(at_step=-1))
    assert "chaos[0].at_step (500) must be < max_steps" in error_for(lambda s: s["chaos"][0].update(at_step=500))
    assert "chaos.0.fault" in error_for(lambda s: s["chaos"][0].update(fault="explode"))


def test_overrides_parse_yaml_values():
    cfg = JobConfig.from_yaml(DEMO, ["max_steps=7", "scaling.min_workers=3", "chaos=[]"])
    assert cfg.max_steps == 7 and cfg.scaling.min_workers == 3 and cfg.chaos == []
    with pytest.raises(ConfigError, match="key.path=value"):
        JobConfig.from_yaml(DEMO, ["max_steps"])


def test_missing_spec_file():
    with pytest.raises(ConfigError, match="does not exist"):
        JobConfig.from_yaml("/nonexistent/job.yaml")


def test_cli_rejects_bad_spec_before_starting_ray(tmp_path):
    spec = demo_dict()
    spec["scaling"]["min_workers"] = 9
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "airay.cli", "run", str(tmp_path / "bad.yaml"),
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "scaling" in proc.stderr and "min_workers (9) > max_workers (4)" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started, not even the run directory


def test_resolved_config_round_trips():
    cfg = JobConfig.from_yaml(DEMO)
    again = JobConfig.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_fault_and_health_fields_are_validated_with_the_fix():
    import pytest as _pytest

    from airay.config import ConfigError, JobConfig

    base = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 12, "micro_batch_size": 2, "max_steps": 20,
            "scaling": {"min_workers": 2, "max_workers": 4}, "checkpoint": {"every_n_steps": 5}}
    with _pytest.raises(ConfigError, match="hang_timeout_s .* must be < collective_timeout_s"):
        JobConfig.from_dict({**base, "timeouts": {"hang_timeout_s": 200}})
    with _pytest.raises(ConfigError, match="corrupt_checkpoint at_step 4 needs a committed checkpoint"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "corrupt_checkpoint", "at_step": 4}]})
    with _pytest.raises(ConfigError, match="lose_node_memory needs a committed memory checkpoint: set at_step > 5"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "lose_node_memory", "at_step": 5}]})
    with _pytest.raises(ConfigError, match="corrupt_memory_copy needs a committed memory checkpoint: set at_step > 2"):
        JobConfig.from_dict({**base, "checkpoint": {"every_n_steps": 10, "fast_every_n_steps": 2},
                             "chaos": [{"fault": "corrupt_memory_copy", "at_step": 2}]})
    with _pytest.raises(ConfigError, match="corrupt_memory_copy kills the rank after `rank`"):
        JobConfig.from_dict({**base, "scaling": {"min_workers": 1, "max_workers": 1},
                             "chaos": [{"fault": "corrupt_memory_copy", "at_step": 7}]})
    with _pytest.raises(ConfigError, match="slow_worker steps .* run past max_steps"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "slow_worker", "at_step": 18, "steps": 5}]})
    with _pytest.raises(ConfigError, match=r"more than one fault at \(at_step, rank\) \[\(6, 1\)\]"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "kill_worker", "at_step": 6, "rank": 1},
                                               {"fault": "hang_worker", "at_step": 6, "rank": 1}]})
    with _pytest.raises(ConfigError, match="chaos.0.hang_mode"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "hang_worker", "at_step": 6, "hang_mode": "freeze"}]})
    with _pytest.raises(ConfigError, match="health.straggler_factor"):
        JobConfig.from_dict({**base, "health": {"straggler_factor": 0.5}})
    ok = JobConfig.from_dict({**base, "health": {"retry_user_errors": 1, "exclude_node_after_failures": 2},
                              "chaos": [{"fault": "oom_worker", "at_step": 3, "rank": 1}]})
    assert ok.health.retry_user_errors == 1 and ok.timeouts.hang_timeout_s < ok.timeouts.collective_timeout_s


def test_a_first_step_gets_its_own_deadline_between_the_hang_and_collective_timeouts():
    base = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 20}
    timeouts = JobConfig.from_dict(base).timeouts
    assert (timeouts.first_step_timeout_s, timeouts.first_step_s) == (None, 90.0)  # halfway between 60 and 120
    assert JobConfig.from_dict({**base, "timeouts": {"hang_timeout_s": 4, "collective_timeout_s": 30}}
                               ).timeouts.first_step_s == 17.0
    assert JobConfig.from_dict({**base, "timeouts": {"first_step_timeout_s": 60}}).timeouts.first_step_s == 60
    for bad in (30, 120, 200):  # below hang_timeout_s, at or past collective_timeout_s
        with pytest.raises(ConfigError, match=r"first_step_timeout_s \(\d+\) must be >= hang_timeout_s \(60\) "
                                              r"and < collective_timeout_s \(120\)"):
            JobConfig.from_dict({**base, "timeouts": {"first_step_timeout_s": bad}})


def test_capacity_wait_outlasts_a_cloud_nodes_boot():
    base = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 20}
    assert JobConfig.from_dict(base).timeouts.capacity_wait_s == 600  # a GPU node boots in minutes


def test_stall_collective_is_a_step_fault_with_its_collective_number():
    base = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 20,
            "scaling": {"min_workers": 1, "max_workers": 4}}
    ok = JobConfig.from_dict({**base, "chaos": [{"fault": "stall_collective", "at_step": 6, "rank": 1,
                                                 "collective": 3}]})
    assert ok.chaos[0].collective == 3
    with pytest.raises(ConfigError, match="chaos.0.collective"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "stall_collective", "at_step": 6, "collective": 0}]})
    with pytest.raises(ConfigError, match=r"chaos\[0\]\.during is for kill_worker and hang_worker"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "stall_collective", "at_step": 6, "during": "save"}]})


def test_chaos_points_and_storage_faults_are_checked_before_any_actor_starts():
    base = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 20,
            "scaling": {"min_workers": 1, "max_workers": 4}}
    ok = JobConfig.from_dict({**base, "chaos": [{"fault": "hang_worker", "during": "save", "at_step": 5},
                                                {"fault": "kill_worker", "during": "form", "at_step": 5}]})
    assert [c.during for c in ok.chaos] == ["save", "form"]
    with pytest.raises(ConfigError, match=r"chaos\[0\]\.during is for kill_worker and hang_worker"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "oom_worker", "during": "save", "at_step": 5}]})
    with pytest.raises(ConfigError, match="break_storage acts on a checkpoint directory"):
        JobConfig.from_dict({**base, "checkpoint": {"path": "s3://bucket/x"},
                             "chaos": [{"fault": "break_storage", "at_step": 5}]})
    assert JobConfig.from_dict(base).health.max_driver_restarts == 3  # supervised by default


def test_the_supervisor_reads_only_its_fields_and_bad_ones_get_the_specs_own_error():
    from airay.config import supervision

    # No model code is imported for this: the driver checks the rest (exit 2 on bad input).
    run_dir, restarts = supervision({"name": "x", "model": {"factory": "no.such:thing"}, "run_dir": "runs/a"}, "s.yaml")
    assert (str(run_dir), restarts) == ("runs/a", 3)
    run_dir, restarts = supervision({"name": "job", "health": {"max_driver_restarts": 0}}, "s.yaml")
    assert run_dir.parent.name == "runs" and run_dir.name.startswith("job-") and restarts == 0
    with pytest.raises(ConfigError, match=r"health.max_driver_restarts: Input should be greater than or equal to 0"):
        supervision({**demo_dict(), "health": {"max_driver_restarts": -1}}, "s.yaml")


def test_the_tensor_parallel_llama_job_is_two_replicas_of_two_ranks_at_most():
    cfg = JobConfig.from_yaml(ROOT / "jobs" / "llama_tp.yaml")
    assert cfg.model_parallel_size == 2 and cfg.world_sizes == [2, 4]
    assert {w: p.world_size for w, p in cfg.batch_plans().items()} == {2: 1, 4: 2}
    assert cfg.cluster.local_nodes * cfg.cluster.cpus_per_node == 4  # a group of 2 fits each node
