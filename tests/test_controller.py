"""The controller's state machine without Ray: a scripted worker group (tests/fake_group.py)
decides each call's rank outcomes, the real Controller, Checkpointer and durable tier (files in
tmp_path) do the rest. Each test is a decision the integration tests cannot time exactly."""

import pytest

from airay.config import JobConfig
from airay.controller import Controller
from airay.events import RunRecorder, read_jsonl
from tests.fake_group import FakeGroup, step_loss

STEPS = 20


def controller(tmp_path, script=None, ready_after=None, capacity=4, **overrides):
    data = {"name": "fake", "model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 24, "micro_batch_size": 4, "max_steps": STEPS, "steps_per_round": 5,
            "scaling": {"min_workers": 2, "max_workers": 4, "resources_per_worker": {"CPU": 1}},
            "checkpoint": {"every_n_steps": 5, "memory_path": str(tmp_path / "shm")},
            "timeouts": {"capacity_wait_s": 2, "grow_settle_s": 0}, "run_dir": str(tmp_path / "run")}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    factory = FakeGroup.factory(script, capacity=capacity, ready_after=ready_after)
    ctl = Controller(JobConfig.from_dict(data), RunRecorder(tmp_path / "run", echo=False), None,
                     group_factory=factory)
    return ctl, factory


def events(ctl, *types):
    return [e for e in read_jsonl(ctl.rec.run_dir / "events.jsonl") if e["type"] in types]


def test_a_fault_free_run_trains_every_step_once_and_ends_durable(tmp_path):
    ctl, _ = controller(tmp_path)
    result = ctl.run()
    assert result.status == "finished" and result.final_step == STEPS and result.world_sizes == [4]
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    assert result.durable_step == STEPS and result.restarts == 0


def test_rounds_between_checkpoints_are_queued_before_the_one_running_is_gathered(tmp_path):
    ctl, factory = controller(tmp_path, checkpoint={"every_n_steps": 10})
    result = ctl.run()
    assert result.status == "finished" and ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    calls = [c for c in factory.made[0].calls if c[0] in ("launch", "train")]
    # [5, 10) is queued while [0, 5) runs; the checkpoint at 10 waits for a gathered round.
    assert calls == [("launch", (0, 5)), ("launch", (5, 10)), ("train", 1), ("train", 2),
                     ("launch", (10, 15)), ("launch", (15, 20)), ("train", 3), ("train", 4)]
    unpipelined, _ = controller(tmp_path / "off", checkpoint={"every_n_steps": 10}, pipeline_rounds=False)
    assert unpipelined.run().status == "finished"
    assert [c[0] for c in unpipelined.group.calls if c[0] in ("launch", "train")] == ["launch", "train"] * 4


def test_a_death_with_a_round_queued_behind_settles_it_and_recovers(tmp_path):
    # Round 3 is [10, 15), with [15, 20) queued behind it: rank 1 dies in it.
    ctl, factory = controller(tmp_path, {"train": {3: {1: "died"}}}, checkpoint={"every_n_steps": 10})
    result = ctl.run()
    assert result.status == "finished" and result.restarts == 1
    group = factory.made[0]
    (settled,) = group.settled  # the queued round: every rank but the dead one is woken and waited for
    assert [ref is None for ref in settled] == [False, True, False, False]
    (failed,) = events(ctl, "worker_failed")
    assert (failed["rank"], failed["step"], failed["phase"]) == (1, 10, "round")
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    assert [e["step"] for e in events(ctl, "checkpoint_loaded")] == [10]


def test_a_rank_under_sigterm_with_a_round_queued_runs_it_then_goes_and_pipelining_resumes(tmp_path):
    # Rank 2 reports SIGTERM at the end of [0, 5); [5, 10) is queued behind it: it runs that too,
    # then the world checkpoints step 10 and shrinks without losing a step.
    ctl, factory = controller(tmp_path, {"sigterm": {1: [2]}}, checkpoint={"every_n_steps": 10},
                              scaling={"min_workers": 2, "max_workers": 3}, capacity=3)
    result = ctl.run()
    assert result.status == "finished" and result.restarts == 1
    (preempted,) = events(ctl, "worker_preempted")
    assert (preempted["rank"], preempted["step"], preempted["checkpoint_step"]) == (2, 10, 10)
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    calls = [c for c in factory.made[0].calls if c[0] in ("launch", "train")]
    assert calls[:4] == [("launch", (0, 5)), ("launch", (5, 10)), ("train", 1), ("train", 2)]
    # After the resize's one-step round, the shrunk world pipelines again.
    assert calls[-6:] == [("launch", (10, 11)), ("train", 3), ("launch", (11, 16)), ("launch", (16, 20)),
                          ("train", 4), ("train", 5)]


def test_a_rank_under_sigterm_that_dies_in_the_queued_round_does_not_stop_pipelining(tmp_path):
    # Rank 2 gets SIGTERM in [0, 5) and dies in [5, 10), queued behind it (its grace ran out).
    ctl, factory = controller(tmp_path, {"sigterm": {1: [2]}, "train": {2: {2: "died"}}},
                              checkpoint={"every_n_steps": 10}, scaling={"min_workers": 2, "max_workers": 3},
                              capacity=3)
    result = ctl.run()
    assert result.status == "finished" and result.restarts == 1
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    calls = [c for c in factory.made[0].calls if c[0] in ("launch", "train")]
    # Recovered from step 0 (no checkpoint yet), the world pipelines again to the end.
    assert calls[-8:] == [("launch", (1, 6)), ("launch", (6, 10)), ("train", 4), ("train", 5),
                          ("launch", (10, 15)), ("launch", (15, 20)), ("train", 6), ("train", 7)]


def test_a_death_during_form_is_a_recovery_and_the_world_regrows(tmp_path):
    # The first world's join loses rank 2: drop it, form 3; its replacement joins at the next grow.
    ctl, factory = controller(tmp_path, {"form": {1: {2: "died"}}}, ready_after=[0, 0, 0, 0, 2])
    result = ctl.run()
    assert result.status == "finished" and result.final_step == STEPS
    (failed,) = events(ctl, "worker_failed")
    assert (failed["phase"], failed["rank"], failed["outcome"]) == ("form", 2, "died")
    assert result.world_sizes[0] == 3 and result.world_sizes[-1] == 4
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    assert ("shutdown", None) in factory.made[0].calls


def test_worlds_that_load_a_checkpoint_build_without_weights_unless_none_loads(tmp_path):
    # Rank 1 dies in round 3 ([10, 15)): the world of 3 loads step 10, so its ranks skip the
    # factory's weights; at the grow back to 4 as well. A second run finds its checkpoint
    # unloadable (every copy bad): the world forms again, with weights, and starts at step 0.
    ctl, factory = controller(tmp_path, {"train": {3: {1: "died"}}}, checkpoint={"every_n_steps": 10},
                              ready_after=[0, 0, 0, 0, 1])
    result = ctl.run()
    assert result.status == "finished" and ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    formed = factory.made[0].formed
    assert formed[0] == (4, True) and formed[1] == (3, False) and formed[-1] == (4, False), formed
    again, factory = controller(tmp_path, {"load": {1: {0: "unavailable"}, 2: {2: "unavailable"}}},
                                checkpoint={"every_n_steps": 10})
    result = again.run()
    assert result.status == "finished" and again.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    assert factory.made[0].formed[:2] == [(4, False), (4, True)]
    assert [e["step"] for e in events(again, "checkpoint_rejected")] == [STEPS, 10]


def test_a_hang_during_save_resumes_from_the_checkpoint_before(tmp_path):
    # the save of step 10; replacements come up a few polls later
    ctl, _ = controller(tmp_path, {"save": {2: {1: "hung"}}}, ready_after=[0, 0, 0, 0, 3, 3])
    result = ctl.run()
    assert result.status == "finished"
    (hang,) = events(ctl, "hang_detected")
    assert (hang["phase"], hang["rank"], hang["step"]) == ("save", 1, 10)
    # Its node goes with it: rank 0 shares node0 with rank 1 (a world's ranks are grouped by
    # node); one failure, the hung rank's, and its node's count is one.
    assert hang["evicted_ranks"] == [0] and result.world_sizes[:2] == [4, 2]
    assert [f.rank for f in ctl.failures] == [1] and ctl.node_failures == {"node0": 1}
    (uncommitted,) = [e for e in events(ctl, "checkpoint_failed") if e["step"] == 10]
    assert "rank 1 hung during the save" in uncommitted["error"]
    # the recovery loads step 5; the grow when the replacements are up loads the step it checkpoints
    assert [(e["step"], e["tier"]) for e in events(ctl, "checkpoint_loaded")][0] == (5, "memory")


def test_a_final_checkpoint_that_never_becomes_durable_fails_the_run_with_the_reason(tmp_path):
    # Uploads 1-3 are steps 5, 10, 15; the 4th is step 20's, then its retry (upload_retries 1).
    ctl, _ = controller(tmp_path, {"upload": {4: {0: "storage"}, 5: {0: "storage"}}},
                        checkpoint={"upload_retries": 1})
    result = ctl.run()
    assert result.status == "failed"
    assert "the final checkpoint (step 20) did not reach durable storage" in result.error
    assert "The newest durable checkpoint is step 15" in result.error and result.durable_step == 15
    (retry,) = events(ctl, "checkpoint_retry")
    assert (retry["step"], retry["attempt"]) == (20, 1)
    (failed,) = [e for e in events(ctl, "checkpoint_failed") if e["tier"] == "durable"]
    assert failed["step"] == 20 and failed["newest_durable_step"] == 15
    assert events(ctl, "run_failed")[0]["durable_step"] == 15


def test_consecutive_checkpoint_failures_end_the_run_before_the_end(tmp_path):
    every = {n: {0: "storage"} for n in range(1, 20)}
    ctl, _ = controller(tmp_path, {"upload": every}, checkpoint={"upload_retries": 0},
                        health={"max_checkpoint_failures": 2})
    result = ctl.run()
    assert result.status == "failed"
    assert "2 consecutive durable checkpoints failed" in result.error and "No checkpoint is durable" in result.error


def test_the_failure_budget_ends_a_run_that_keeps_failing(tmp_path):
    ctl, _ = controller(tmp_path, {"train": {n: {0: "died"} for n in range(1, 10)}}, max_failures=2,
                        health={"failure_window_s": 600})
    result = ctl.run()
    assert result.status == "failed" and "3 failures within health.failure_window_s=600s" in result.error
    assert result.restarts == 3


def test_a_user_error_fails_fast_with_its_rank(tmp_path):
    ctl, _ = controller(tmp_path, {"train": {2: {1: "user"}}})
    result = ctl.run()
    assert result.status == "failed" and "user code failed on rank 1" in result.error and result.restarts == 0
    assert result.traceback is None  # a decision of the run, not a driver error


def test_a_recovery_is_finished_and_recorded_before_its_replacement_grows_the_world(tmp_path):
    # The replacement is ready at once: the world of 3 still runs its first step (which ends the
    # recovery and records it) before growing back; a grow first would have taken its record.
    ctl, _ = controller(tmp_path, {"train": {2: {1: "died"}}}, ready_after=[0, 0, 0, 0, 1],
                        timeouts={"grow_settle_s": 0})
    result = ctl.run()
    assert result.status == "finished" and result.world_sizes == [4, 3, 4]
    finished = events(ctl, "resize_finished")
    assert [(e["reason"], e["new_world_size"]) for e in finished] == [("failure", 3), ("grow", 4)]
    assert finished[0]["recovery_s"] > 0 and finished[1]["step"] > finished[0]["step"]
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})


def test_replacements_seconds_apart_make_one_grow(tmp_path):
    """Two ranks lost at once; their replacements come up two polls apart. With grow_settle_s the
    world grows once, 2 -> 4; without, twice, 2 -> 3 -> 4 (two checkpoints and re-formed worlds)."""
    script = {"train": {2: {2: "died", 3: "died"}}}
    # Workers 0-3 start the run; 4 and 5 replace the lost ranks, ready after 1 and 4 polls.
    batched, _ = controller(tmp_path / "a", script, ready_after=[0, 0, 0, 0, 1, 4], timeouts={"grow_settle_s": 60})
    assert batched.run().world_sizes == [4, 2, 4]
    eager, _ = controller(tmp_path / "b", script, ready_after=[0, 0, 0, 0, 1, 4], timeouts={"grow_settle_s": 0})
    assert eager.run().world_sizes == [4, 2, 3, 4]


def test_a_driver_error_is_kept_with_its_traceback(tmp_path):
    ctl, factory = controller(tmp_path)

    def broken(*args, **kwargs):
        raise KeyError("driver bug")

    ctl._record_steps = broken
    result = ctl.run()
    assert result.status == "failed" and "KeyError" in result.error
    assert "Traceback" in result.traceback and "broken" in result.traceback
    assert events(ctl, "run_failed")[0]["traceback"] == result.traceback
    assert ("shutdown", None) in factory.made[0].calls  # nothing leaks
