"""A driver under the cluster's scheduler, without Ray: the real Controller with a scripted worker
group (tests/fake_group.py) and a scripted scheduler that lowers, raises and zeroes the job's target
at given steps. What is checked is what the planned shrink promises: no failure, no replayed
step, the chosen ranks given back, the job back at its size when the target is raised."""

import pytest

from airay.worker_group import ranks_to_release
from tests.fake_group import step_loss
from tests.test_controller import controller, events

STEPS = 30


class ScriptedQueue:
    """The scheduler's replies: `targets[step]` is the target from that step on; while it is 0
    (queued, or preempted) each poll takes the next of `readmit` instead, and the first nonzero
    one admits the job at that size."""

    def __init__(self, targets: dict[int, int], readmit: list[int] = (), evicted_at: int | None = None):
        self.targets, self.readmit, self.evicted_at = dict(targets), list(readmit), evicted_at
        self.finished: list[str] = []
        self.step = 0

    def _reply(self) -> dict:
        key = max(s for s in self.targets if s <= self.step)
        target = self.targets[key]
        if target == 0 and self.readmit:
            target = self.targets[key] = self.readmit.pop(0)
        evicted = self.evicted_at is not None and self.step >= self.evicted_at
        return {"target": target, "state": "running" if target else "queued", "reason": f"given {target}",
                "preemptions": int(evicted)}

    def submit(self):
        return self._reply()

    def report(self, current, step):
        self.step = step
        return self._reply()

    def finish(self, status):
        self.finished.append(status)


def run(tmp_path, queue, **overrides):
    ctl, factory = controller(tmp_path, queue={"priority": 1}, queue_client=queue, max_steps=STEPS, **overrides)
    return ctl, factory, ctl.run()


def test_a_lowered_target_is_a_planned_shrink_with_no_replayed_step_and_a_raised_one_grows_back(tmp_path):
    queue = ScriptedQueue({0: 4, 8: 2, 14: 4})
    ctl, factory, result = run(tmp_path, queue)
    assert result.status == "finished" and result.world_sizes == [4, 2, 4]
    assert result.restarts == 0 and not events(ctl, "worker_failed", "node_lost")
    # Every step trained once, on the same losses as a run that never resized.
    trained = [step for start, end in factory.made[0].launched for step in range(start, end)]
    assert sorted(trained) == list(range(STEPS))
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
    shrink, grow = events(ctl, "resize_started")
    assert shrink["reason"] == "scheduler" and shrink["released_ranks"] == [2, 3] and shrink["step"] == 10
    assert (shrink["old_world_size"], shrink["new_world_size"]) == (4, 2)
    assert grow["reason"] == "grow" and grow["new_world_size"] == 4
    assert ("release", [2, 3]) in factory.made[0].calls
    loaded = events(ctl, "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [10, grow["step"]]  # the shrink's own step, in memory
    assert [e["target"] for e in events(ctl, "queue_target")] == [4, 2, 4]
    assert queue.finished == ["done"]


def test_a_job_waits_in_the_queue_until_admitted_and_starts_at_its_target(tmp_path):
    queue = ScriptedQueue({0: 0}, readmit=[0, 0, 2])
    ctl, factory, result = run(tmp_path, queue)
    assert result.status == "finished" and result.world_sizes == [2]
    submitted, *targets = events(ctl, "queue_submitted", "queue_target")
    assert submitted["type"] == "queue_submitted"
    assert [e["target"] for e in targets] == [0, 2]
    assert events(ctl, "world_formed")[0]["step"] == 0
    # It never asked for more than its target: the capacity is another job's.
    assert ("demand", 2) in factory.made[0].calls and ("demand", 4) not in factory.made[0].calls


def test_target_zero_suspends_the_job_durably_and_readmission_resumes_it_at_that_step(tmp_path):
    queue = ScriptedQueue({0: 4, 5: 0}, readmit=[0, 2])
    ctl, factory, result = run(tmp_path, queue)
    assert result.status == "finished" and result.world_sizes == [4, 2]
    suspended = events(ctl, "suspended")
    assert [e["step"] for e in suspended] == [5] and suspended[0]["checkpoint_step"] == 5
    first, second = factory.made
    assert ("shutdown", None) in first.calls  # every worker and placement group released
    assert [e["step"] for e in events(ctl, "checkpoint_loaded")] == [5]  # the second group resumed there
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})


def test_ranks_to_release_takes_whole_groups_highest_ranks_first():
    assert ranks_to_release(["a", "b", "c", "d"], 2) == [2, 3]
    assert ranks_to_release(["a", "a", "b", "b"], 2) == [2, 3]
    assert ranks_to_release(["a", "a", "b", "b", "b"], 2) == [0, 1]  # the last group holds 3
    assert ranks_to_release(["a", "a", "a", "a"], 2) == []  # one group of 4 gives back none of 2


def test_a_job_evicted_and_readmitted_at_once_restarts_from_a_durable_checkpoint_instead_of_resizing(tmp_path):
    # The evict policy (Kueue-like) requeues a whole job and may readmit it in the same decision
    # at the size that is left: the driver carries that out as the eviction it is, a restart.
    queue = ScriptedQueue({0: 4, 10: 2}, evicted_at=10)
    ctl, factory, result = run(tmp_path, queue)
    assert result.status == "finished" and result.world_sizes == [4, 2]
    assert [(e["step"], e["target"]) for e in events(ctl, "suspended")] == [(10, 2)]
    assert len(factory.made) == 2 and ("shutdown", None) in factory.made[0].calls
    assert not [e for e in events(ctl, "resize_started") if e["reason"] == "scheduler"]
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})


def test_a_replacement_beyond_a_lowered_target_is_given_back_not_grown_into(tmp_path):
    # Rank 3 dies in the second round: the world goes on at 3 while its replacement starts (slowly:
    # 50 polls); the
    # scheduler lowers the target to 3, so the replacement's bundle is another job's now.
    queue = ScriptedQueue({0: 4, 10: 3})
    ctl, factory, result = run(tmp_path, queue, script={"train": {2: {3: "died"}}}, ready_after=[0, 0, 0, 0, 50])
    assert result.status == "finished" and result.world_sizes == [4, 3]
    group = factory.made[0]
    assert [c for c in group.calls if c[0] == "release_idle"] == [("release_idle", 1)]
    assert not group.standby and not group.pending
    assert ctl.losses == pytest.approx({s: step_loss(s) for s in range(STEPS)})
