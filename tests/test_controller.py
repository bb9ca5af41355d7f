"""The controller's state machine without Ray: a scripted worker group (tests/fake_group.py)
decides each call's rank outcomes, the real Controller, Checkpointer and durable tier (files in
tmp_path) do the rest. Each test is a decision the integration tests cannot time exactly."""

import pytest

from airay.config import JobConfig
from airay.controller import Controller
from airay.events import RunRecorder, read_jsonl
from tests.fake_group import FakeGroup, step_loss

STEPS = 20


def controller(tmp_path, script=None, ready_after=None, capacity=4, queue_client=None, **overrides):
    data = {"name": "fake", "model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 24, "micro_batch_size": 4, "max_steps": STEPS, "steps_per_round": 5,
            "scaling": {"min_workers": 2, "max_workers": 4, "resources_per_worker": {"CPU": 1}},
            "checkpoint": {"every_n_steps": 5, "memory_path": str(tmp_path / "shm")},
            "timeouts": {"capacity_wait_s": 2, "grow_settle_s": 0}, "run_dir": str(tmp_path / "run")}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    factory = FakeGroup.factory(script, capacity=capacity, ready_after=ready_after)
    ctl = Controller(JobConfig.from_dict(data), RunRecorder(tmp_path / "run", echo=False), None,
                     group_factory=factory, queue_client=queue_client)
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


def test_a_step_whose_lost_ranks_files_have_no_copy_left_is_not_durable_and_is_not_a_storage_failure(tmp_path):
    # Seen in the demo: a node lost as step 45 was uploading, before its rank's peer copy was
    # complete. Its upload from the peer's store cannot succeed, and retries would not change that.
    ctl, _ = controller(tmp_path, {"upload": {2: {1: "died"}}, "copies_lost": {10}},
                        checkpoint={"upload_retries": 2}, health={"max_checkpoint_failures": 1})
    result = ctl.run()
    assert result.status == "finished" and result.durable_step == STEPS
    (skipped,) = events(ctl, "checkpoint_upload_skipped")
    assert skipped["step"] == 10 and skipped["lost_ranks"] == [1] and skipped["missing"] == ["rank1.pt"]
    assert "no complete copy" in skipped["reason"]
    assert not events(ctl, "checkpoint_failed", "checkpoint_retry")
    durable = [e["step"] for e in events(ctl, "checkpoint_saved") if e["tier"] == "durable"]
    assert 10 not in durable and durable == sorted(durable) and durable[-1] == STEPS


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


# ---- failures at scale: incidents, exclusion, memory ------------------------------------------


def test_one_incident_counts_once_per_node_and_one_striking_most_nodes_counts_against_none(tmp_path):
    # Ranks 0 and 1 share node0 (ranks 2 and 3 node1): both die in round 2, one incident.
    ctl, _ = controller(tmp_path, {"train": {2: {0: "died", 1: "died"}}},
                        health={"exclude_node_after_failures": 2})
    result = ctl.run()
    assert result.status == "finished" and ctl.node_failures == {"node0": 1}
    assert events(ctl, "node_excluded") == []  # two ranks, one node, one incident: not two failures
    # A rank of every node dies at once (memory pressure, a storage outage): the cluster's cause.
    ctl, _ = controller(tmp_path / "all", {"train": {2: {0: "died", 2: "died"}}},
                        health={"exclude_node_after_failures": 1})
    result = ctl.run()
    assert result.status == "finished" and ctl.node_failures == {}
    assert events(ctl, "node_excluded") == []
    (skipped,) = events(ctl, "incident_not_counted")
    assert (skipped["nodes"], skipped["world_nodes"]) == (2, 2)
    assert ctl.losses == {s: step_loss(s) for s in range(STEPS)}


def test_an_exclusion_that_would_leave_too_little_room_ends_the_run_at_once_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeGroup, "room_without", lambda self, nodes: 1)
    ctl, _ = controller(tmp_path, {"train": {2: {1: "died"}}}, health={"exclude_node_after_failures": 1},
                        timeouts={"capacity_wait_s": 600})
    result = ctl.run()
    assert result.status == "failed" and result.wall_s < 60  # not capacity_wait_s
    assert "node0" in result.error and "leaves room for 1 worker" in result.error
    assert "scaling.min_workers=2" in result.error and "exclude_node_after_failures" in result.error
    assert events(ctl, "node_excluded") == []


def test_an_out_of_memory_rank_makes_the_memory_tier_give_memory_back_before_its_replacement(tmp_path):
    ctl, factory = controller(tmp_path, {"train": {3: {1: "oom"}}},
                              checkpoint={"every_n_steps": 10, "fast_every_n_steps": 5})
    result = ctl.run()
    assert result.status == "finished" and ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    (failed,) = events(ctl, "worker_failed")
    assert failed["outcome"] == "oom"
    (reduced,) = events(ctl, "memory_tier_reduced")
    # Steps 5 and 10 were kept in memory; 10 (the newest, being uploaded) stays.
    assert reduced["nodes"] == ["node0"] and reduced["dropped_steps"] == [5] and reduced["kept_steps"] == [10]
    assert ctl.ckpt.host_scale == {"node0": 0.5}
    calls = factory.made[0].calls
    # The tier is pruned to step 10 before the lost rank is dropped (its replacement starts then).
    assert calls.index(("prune_memory", [10])) < calls.index(("drop", [1]))


def budgeted_run(tmp_path, monkeypatch, mem_total: int):
    """A run whose 2 nodes (one host each) have `mem_total` bytes of memory: a budget of a quarter of
    it. Each node holds 2 ranks' files (64 B each) of a step, and its peer's copy: a save needs 256 B."""
    figures = {f"node{i}": {"host": f"h{i}", "mem_total": mem_total, "mem_available": mem_total // 2,
                            "shm_total": 10**9, "shm_free": 10**9, "tier_bytes": 0} for i in range(2)}
    monkeypatch.setattr(FakeGroup, "node_memory",
                        lambda self, nodes=None, timeout_s=10.0: [dict(f, node_id=n) for n, f in figures.items()])
    ctl, factory = controller(tmp_path, checkpoint={"every_n_steps": 10, "fast_every_n_steps": 5,
                                                    "memory_keep_last": 3})
    result = ctl.run()
    assert result.status == "finished" and result.durable_step == STEPS
    (budget,) = events(ctl, "memory_budget")
    assert budget["budget_bytes"] == mem_total // 4 and budget["hosts"] == 2
    group = factory.made[0]
    assert all(sum(held.values()) <= mem_total // 4 for held in group.memory_usage().values())
    return events(ctl, "checkpoint_budget"), group


def test_saves_keep_each_nodes_memory_tier_within_its_budget(tmp_path, monkeypatch):
    acted, _ = budgeted_run(tmp_path, monkeypatch, 1200)  # 300 B: a kept step (128 B) and a save do not fit
    assert acted and all(e["action"] in ("dropped", "no_peer_copy") for e in acted)
    assert all(e["planned_bytes"] <= 300 for e in acted)


def test_the_room_a_save_needs_is_made_when_the_save_before_it_commits_not_in_its_held_time(tmp_path, monkeypatch):
    # 450 B: two kept steps and a new one do not fit, one kept step and a new one do. The oldest
    # step goes as the newer one commits, while the next round runs, never the newest.
    acted, group = budgeted_run(tmp_path, monkeypatch, 1800)
    assert [(e["step"], e["dropped_steps"]) for e in acted] == [(10, [5]), (15, [10])], acted
    assert all(e["action"] == "dropped" and e["ahead"] and e["planned_bytes"] <= 450 for e in acted)
    assert sorted(group.memory) == [15, 20]  # the last commit keeps the step before it: no save follows


def test_a_durable_save_waits_for_the_upload_that_holds_its_room_instead_of_being_skipped(tmp_path, monkeypatch):
    # Budget 200 B a node; a step is 128 B of a node's own files (+128 B of its peer's copy). Uploads
    # never finish on their own (ready: False): each durable save finds the last one's step kept for it.
    figures = {f"node{i}": {"host": f"h{i}", "mem_total": 800, "mem_available": 400, "shm_total": 10**9,
                            "shm_free": 10**9, "tier_bytes": 0} for i in range(2)}
    monkeypatch.setattr(FakeGroup, "node_memory",
                        lambda self, nodes=None, timeout_s=10.0: [dict(f, node_id=n) for n, f in figures.items()])
    monkeypatch.setattr(FakeGroup, "ready", staticmethod(lambda refs, timeout_s=0.0: False))
    ctl, factory = controller(tmp_path)
    result = ctl.run()
    assert result.status == "finished" and result.durable_step == STEPS
    actions = [(e["step"], e["action"]) for e in events(ctl, "checkpoint_budget")]
    assert ("waited_for_upload" in {a for _, a in actions}) and all(a != "skipped" for _, a in actions), actions
    assert sorted(e["step"] for e in events(ctl, "checkpoint_saved") if e["tier"] == "durable") == [5, 10, 15, 20]
    assert factory.made[0].no_peer[10] == {"node0", "node1"}  # after the wait: own files only fit


def test_airays_own_error_is_retried_once_then_fails_the_run_with_its_rank_and_traceback(tmp_path):
    # Round 2 ([5, 10)): rank 1 raises in airay's code; the same world re-forms (nobody is
    # replaced) and reloads step 5. Its next round fails the same way: the run ends, naming it.
    ctl, factory = controller(tmp_path, {"train": {2: {0: "comm", 1: "internal"}, 3: {1: "internal"}}})
    result = ctl.run()
    assert result.status == "failed" and result.restarts == 1 and result.world_sizes == [4, 4]
    assert "airay's own code failed on rank 1" in result.error and "IndexError: list index out of range" in result.error
    assert "Traceback" in result.error and "airay/data/source.py" in result.error and "please report it" in result.error
    assert result.traceback is None  # a decision of the run, not a driver bug
    (failed,) = events(ctl, "worker_failed")
    assert (failed["outcome"], failed["rank"], failed["step"], failed["phase"]) == ("internal_error", 1, 5, "round")
    assert failed["node_id"] == "node0" and "Traceback" in failed["error"]  # ranks grouped by node
    assert [e["step"] for e in events(ctl, "checkpoint_loaded")] == [5]
    group = factory.made[0]
    assert len(group.pending) + len(group.standby) == 0 and group.counts["form"] == 2  # no worker replaced
    # Once in a run: it is a retry, not a loop.
    once, _ = controller(tmp_path / "once", {"train": {2: {1: "internal"}}})
    result = once.run()
    assert result.status == "finished" and result.restarts == 1
    assert once.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})


def test_a_communication_error_still_reforms_the_same_world_each_time(tmp_path):
    ctl, factory = controller(tmp_path, {"train": {2: {0: "comm", 1: "comm"}, 3: {2: "comm"}, 4: {3: "comm"}}})
    result = ctl.run()
    assert result.status == "finished" and result.restarts == 3 and result.world_sizes == [4, 4, 4, 4]
    assert [e["outcome"] for e in events(ctl, "worker_failed")] == ["comm_error"] * 3
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})


def test_a_gpu_error_replaces_its_rank_and_its_process(tmp_path):
    # Rank 1's device fails in round 2, the others' collectives are aborted behind it: rank 1 is
    # dropped (its actor killed, a replacement started in its bundle), the others train on.
    ctl, _ = controller(tmp_path, {"train": {2: {0: "comm", 1: "gpu", 2: "comm", 3: "comm"}}},
                        ready_after=[0, 0, 0, 0, 1])
    result = ctl.run()
    assert result.status == "finished" and result.world_sizes == [4, 3, 4]
    (failed,) = events(ctl, "worker_failed")
    assert (failed["outcome"], failed["rank"], failed["step"]) == ("gpu_error", 1, 5)
    assert "device-side assert" in failed["error"]
    formed = events(ctl, "world_formed")
    broken = formed[0]["workers"][1]["pid"]
    assert broken not in [w["pid"] for w in formed[1]["workers"] + formed[-1]["workers"]]
    assert 1004 in [w["pid"] for w in formed[-1]["workers"]]  # its replacement (the fifth worker started)
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})


def test_an_nccl_error_replaces_only_the_rank_it_stands_out_on(tmp_path):
    ctl, _ = controller(tmp_path, {"train": {2: {0: "comm", 2: "nccl"}}}, ready_after=[0, 0, 0, 0, 1])
    result = ctl.run()
    assert result.status == "finished" and result.world_sizes[:2] == [4, 3]
    (failed,) = events(ctl, "worker_failed")
    assert (failed["outcome"], failed["rank"]) == ("nccl_error", 2)
    # Every rank reporting one: the network's; the world re-forms whole.
    every, _ = controller(tmp_path / "every", {"train": {2: {r: "nccl" for r in range(4)}}})
    result = every.run()
    assert result.status == "finished" and result.world_sizes == [4, 4]
    assert [e["outcome"] for e in events(every, "worker_failed")] == ["comm_error"]


def test_a_checkpoint_that_cannot_be_resharded_ends_the_run_at_the_load_naming_why(tmp_path):
    # Rank 1 dies in round 3; the re-formed world's load meets a layout airay refuses to reshard
    # (every rank says so): no retry can load it, the run ends at once instead of re-forming.
    ctl, _ = controller(tmp_path, {"train": {3: {1: "died"}}, "load": {1: {0: "incompatible", 1: "incompatible",
                                                                            2: "incompatible"}}})
    result = ctl.run()
    assert result.status == "failed" and result.restarts == 1
    assert "cannot be loaded at world size" in result.error and "round_robin_gradients" in result.error
    assert result.traceback is None and events(ctl, "checkpoint_loaded") == []


@pytest.mark.parametrize("max_age_s", [30.0, -1.0], ids=["recent", "stale"])
def test_a_saves_budget_comes_from_the_figures_the_stores_sent_with_the_last_commit(tmp_path, monkeypatch, max_age_s):
    # A save's plan asked every node for its memory figures, in the save's held time; the stores
    # now send them with each commit, and the next save uses those while they are recent.
    import airay.checkpoint.manager as manager

    monkeypatch.setattr(manager, "FIGURES_MAX_AGE_S", max_age_s)
    figures = {f"node{i}": {"host": f"h{i}", "mem_total": 10**6, "mem_available": 10**6, "shm_total": 10**9,
                            "shm_free": 10**9, "tier_bytes": 0} for i in range(2)}
    asked = []
    monkeypatch.setattr(FakeGroup, "node_memory", lambda self, nodes=None, timeout_s=10.0:
                        asked.append(nodes) or [dict(f, node_id=n) for n, f in figures.items()])
    ctl, factory = controller(tmp_path)
    result = ctl.run()
    saves = [e for e in events(ctl, "checkpoint_saved") if e["tier"] == "memory"]
    commits = [c for c in factory.made[0].calls if c[0] == "commit_memory"]
    assert result.status == "finished" and len(commits) == len(saves) >= 3
    # The fake's commit reads the figures as a store's does (once per commit); the start checks once.
    # Stale, every plan asks again: each save's, and each commit's plan of the next save's room.
    if max_age_s > 0:
        assert len(asked) == 1 + len(commits), (len(asked), len(saves))
    else:
        assert len(asked) >= 1 + len(commits) + len(saves), (len(asked), len(saves))


def test_a_step_saved_again_after_a_rollback_never_writes_under_an_upload_of_its_first_save(tmp_path):
    # Seen in the demo: a node lost as step 45 was committed; the world of 3 reloaded step 40,
    # replayed 41-45 and saved 45 again into the same step directories while the first save's
    # upload read them, which then failed on a file the new world had not written.
    ctl, factory = controller(tmp_path)
    group = factory()
    group.reserve(2, 1.0)
    group.poll_pending()
    group.form(2, None)
    ck = ctl.ckpt
    saves = []  # (step saved, the steps whose uploads were running or waiting as the ranks wrote it)
    real_save = group.save
    group.save = lambda step, *a, **k: (saves.append((step, sorted(s.step for s in ck._uploads.items()))),
                                        real_save(step, *a, **k))[1]
    ck.save(group, 5)
    ck.save(group, 10)  # 5 is committed and its upload runs (FakeGroup's uploads end when collected)
    ck.wait(uploads=False)  # 10 is committed (a recovery's candidates() does this): its upload waits
    ck.save(group, 10)  # a rollback to 5 replayed 6-10: 10's first upload, still waiting, gives way
    ck.wait(uploads=False)
    ck.save(group, 5)  # a rollback to 0 replayed 1-5: 5's first upload, running, is waited for
    ck.wait()
    assert all(step not in uploading for step, uploading in saves), saves
    assert saves == [(5, []), (10, [5]), (10, [5]), (5, [10])]  # the replayed 10's upload starts after 5's ends
    (skipped,) = events(ctl, "checkpoint_upload_skipped")
    assert skipped["step"] == 10 and "saved again" in skipped["reason"]
    durable = [e["step"] for e in events(ctl, "checkpoint_saved") if e["tier"] == "durable"]
    assert durable == [5, 10, 5] and not events(ctl, "checkpoint_failed")
